//! JSON as Python's `json.dumps` prints it, for the templates' `tojson`:
//! Hugging Face renders chat templates with a `tojson` that calls
//! `json.dumps(x, ensure_ascii=False, indent=indent)`, so `", "` between
//! items and `": "` after keys (`","` and newlines with an indent), keys in
//! their given order, and non-ASCII text unescaped. minijinja's own
//! `tojson` escapes HTML characters and sorts keys, which changes the
//! prompt's text (and so its ids) for every template with tools.

use std::io;

use serde::Serialize;
use serde_json::ser::{Formatter, PrettyFormatter, Serializer};

/// Python's separators without an indent: `", "` and `": "`.
struct Spaced;

/// `", "` before every item but the first (of an array or an object).
fn item_separator<W: ?Sized + io::Write>(w: &mut W, first: bool) -> io::Result<()> {
    if first { Ok(()) } else { w.write_all(b", ") }
}

impl Formatter for Spaced {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        item_separator(w, first)
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        item_separator(w, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// `value` as `json.dumps(value, ensure_ascii=False, indent=indent)`.
pub(crate) fn dumps(value: &impl Serialize, indent: Option<usize>) -> Result<String, String> {
    let mut out = Vec::new();
    let written = match indent {
        None => value.serialize(&mut Serializer::with_formatter(&mut out, Spaced)),
        Some(n) => {
            let spaces = " ".repeat(n);
            let formatter = PrettyFormatter::with_indent(spaces.as_bytes());
            value.serialize(&mut Serializer::with_formatter(&mut out, formatter))
        }
    };
    written.map_err(|e| e.to_string())?;
    String::from_utf8(out).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::dumps;
    use serde_json::json;

    #[test]
    fn prints_what_python_prints() {
        let v = json!({"b": [1, 2.5, "x"], "a": {"é": "<&>'\"\n"}, "e": [], "o": {}});
        assert_eq!(
            dumps(&v, None).unwrap_or_default(),
            r#"{"b": [1, 2.5, "x"], "a": {"é": "<&>'\"\n"}, "e": [], "o": {}}"#
        );
        assert_eq!(
            dumps(&json!({"a": [1], "b": {}}), Some(2)).unwrap_or_default(),
            "{\n  \"a\": [\n    1\n  ],\n  \"b\": {}\n}"
        );
    }
}
