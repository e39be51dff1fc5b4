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
        LogFormat::Pretty => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
