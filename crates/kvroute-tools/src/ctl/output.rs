//! Where a sub-command's answer goes: a table for people by default, JSON
//! for scripts with `--json`. Each sub-command gives both forms of its
//! reply; this picks one and writes it, the same way for all of them.

use std::io::Write;

use serde_json::Value;

use super::error::CtlError;

/// Standard output and the `--json` choice.
pub(super) struct Output<'a> {
    out: &'a mut dyn Write,
    json: bool,
}

impl<'a> Output<'a> {
    pub(super) fn new(out: &'a mut dyn Write, json: bool) -> Self {
        Self { out, json }
    }

    /// Writes `json()` pretty-printed with `--json`, else `text()` as it is.
    pub(super) fn print(
        self,
        json: impl FnOnce() -> Value,
        text: impl FnOnce() -> String,
    ) -> Result<(), CtlError> {
        if self.json {
            print_json(self.out, &json())
        } else {
            write!(self.out, "{}", text())?;
            Ok(())
        }
    }
}

fn print_json(out: &mut dyn Write, value: &Value) -> Result<(), CtlError> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| CtlError::Write(std::io::Error::other(e)))?;
    writeln!(out, "{text}")?;
    Ok(())
}
