//! Logging set-up: tracing-subscriber with the configured filter and format.

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber. Logs go to stderr so that commands whose
/// stdout is data (`kvroute hash`, `kvroute bench`) stay clean.
///
/// The NATS client logs every failed reconnect attempt at info, several a
/// second while NATS is away; kvroute logs the outage itself in one line,
/// so the client's lines are held to warnings unless the filter names it.
pub fn init(format: LogFormat, filter: &str) {
    let filter = if filter.contains("async_nats") {
        filter.to_owned()
    } else {
        format!("{filter},async_nats=warn")
    };
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second init (tests) is not an error worth reporting.
    let _ = match format {
        LogFormat::Pretty => builder.fmt_fields(escaped_fields()).try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Field formatting of the pretty format with control characters escaped,
/// as the JSON format does: a value with a newline in it (an endpoint a
/// client sent) cannot start a forged log line.
fn escaped_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> {
    use tracing_subscriber::field::MakeExt;
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let raw = format!("{value:?}");
        let text = escape_controls(&raw);
        if field.name() == "message" {
            write!(writer, "{text}")
        } else {
            write!(writer, "{field}={text}")
        }
    })
    .delimited(" ")
}

/// `text` with every control character written as its escape (`\n`,
/// `\u{1b}`).
pub(crate) fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            escaped.extend(c.escape_default());
        } else {
            escaped.push(c);
        }
    }
    std::borrow::Cow::Owned(escaped)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::{escape_controls, escaped_fields};

    /// Lines written by the pretty format with a hostile value in a field
    /// and in the message stay one line each.
    #[test]
    fn a_newline_in_a_value_cannot_forge_a_line() {
        let written = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = written.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .fmt_fields(escaped_fields())
            .with_writer(move || SharedWriter(sink.clone()))
            .finish();
        let hostile = "tcp://h:1\n2026-12-03T00:00:00Z  INFO kvroute: worker registered";
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(endpoint = %hostile, debug = ?hostile, "refused {}", hostile);
        });
        let text = String::from_utf8(written.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(text.contains("endpoint=tcp://h:1\\n2026"), "{text}");
    }

    struct SharedWriter(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for SharedWriter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escape_controls("tcp://h:1"), "tcp://h:1");
        assert_eq!(
            escape_controls("tcp://h:1\nINFO forged\u{1b}[31m\r"),
            "tcp://h:1\\nINFO forged\\u{1b}[31m\\r"
        );
    }
}
