//! Configuration of `kvroute serve`: command-line flags, `KVROUTE_*`
//! environment variables and an optional TOML file, with precedence
//! flag > env > file > default.
//!
//! clap handles flags, env and defaults. The file is folded in by turning each
//! of its keys whose setting was left at its default into the matching
//! `--flag value` and parsing again, so file values go through exactly the
//! same parsers and error messages as flags.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, ValueEnum, parser::ValueSource};

/// Default weight of prefill cost against decode cost. Dynamo's router uses
/// 1.0 (and `--overlap-weight 1` reproduces its choices); 16 is what trace
/// replay showed best for time to first token on both Mooncake traces:
/// prefill is what a request waits for, while booked decode blocks only
/// measure KV occupancy (see docs/ARCHITECTURE.md, "Scoring").
pub const DEFAULT_OVERLAP_WEIGHT: f64 = 16.0;

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable, coloured when writing to a terminal.
    Pretty,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Every setting of the service. The doc comment of each field is its `--help`.
#[derive(Clone, Debug, Args)]
pub struct ServeConfig {
    /// Optional TOML file of settings; its keys are the long flag names
    /// (`grpc_addr` or `grpc-addr`). Flags and env vars override it.
    #[arg(long, env = "KVROUTE_CONFIG")]
    pub config: Option<PathBuf>,

    /// Address the gRPC services listen on.
    #[arg(long, env = "KVROUTE_GRPC_ADDR", default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,

    /// Address of the Prometheus metrics endpoint (`GET /metrics`).
    #[arg(long, env = "KVROUTE_METRICS_ADDR", default_value = "127.0.0.1:9464")]
    pub metrics_addr: SocketAddr,

    /// Tokens per KV block for models whose first worker has not said otherwise.
    #[arg(long, env = "KVROUTE_BLOCK_SIZE", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub block_size: u32,

    /// Log line format.
    #[arg(long, env = "KVROUTE_LOG_FORMAT", value_enum, default_value = "pretty")]
    pub log_format: LogFormat,

    /// Log filter: a level (error, warn, info, debug, trace) or a
    /// tracing-subscriber directive such as `kvroute=debug,tower=warn`.
    #[arg(long, env = "KVROUTE_LOG_LEVEL", default_value = "info",
          value_parser = parse_log_filter)]
    pub log_level: String,

    /// Largest gRPC message accepted or sent, in bytes; larger ones are refused
    /// with OUT_OF_RANGE before being buffered.
    #[arg(long, env = "KVROUTE_MAX_MESSAGE_BYTES", default_value_t = 16 * 1024 * 1024,
          value_parser = clap::value_parser!(u64).range(1024..=1_073_741_824))]
    pub max_message_bytes: u64,

    /// Time limit of a unary RPC (a client's shorter grpc-timeout wins), e.g. `30s`.
    #[arg(long, env = "KVROUTE_REQUEST_TIMEOUT", default_value = "30s",
          value_parser = parse_positive_duration)]
    pub request_timeout: Duration,

    /// RPCs served at once across all connections; more wait for a slot.
    #[arg(long, env = "KVROUTE_CONCURRENCY_LIMIT", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub concurrency_limit: u64,

    /// On SIGTERM/SIGINT, how long in-flight RPCs get to finish, e.g. `10s`.
    #[arg(long, env = "KVROUTE_SHUTDOWN_GRACE", default_value = "10s",
          value_parser = humantime::parse_duration)]
    pub shutdown_grace: Duration,

    /// After SIGTERM/SIGINT, how long health reports NOT_SERVING while calls
    /// are still accepted, so load balancers stop sending work first, e.g. `5s`.
    #[arg(long, env = "KVROUTE_DRAIN_DELAY", default_value = "0s",
          value_parser = humantime::parse_duration)]
    pub drain_delay: Duration,

    /// Lease given to workers that do not ask for one; a worker that does not
    /// heartbeat within its lease is removed with all its blocks.
    #[arg(long, env = "KVROUTE_LEASE_TTL", default_value = "10s",
          value_parser = parse_positive_duration)]
    pub lease_ttl: Duration,

    /// Bookings a frontend never releases expire after this long.
    #[arg(long, env = "KVROUTE_BOOKING_TTL", default_value = "300s",
          value_parser = parse_positive_duration)]
    pub booking_ttl: Duration,

    /// Weight of prefill cost against decode cost in scoring (Dynamo's is 1).
    #[arg(long, env = "KVROUTE_OVERLAP_WEIGHT", default_value_t = DEFAULT_OVERLAP_WEIGHT,
          value_parser = parse_non_negative_f64)]
    pub overlap_weight: f64,

    /// Softmax temperature of scoring; 0 always takes the lowest cost.
    #[arg(long, env = "KVROUTE_TEMPERATURE", default_value_t = 0.0,
          value_parser = parse_non_negative_f64)]
    pub temperature: f64,

    /// A worker is busy when its booked prefill tokens exceed this many times
    /// its max_num_batched_tokens.
    #[arg(long, env = "KVROUTE_BUSY_THRESHOLD", default_value_t = 4.0,
          value_parser = parse_non_negative_f64)]
    pub busy_threshold: f64,

    /// A worker is busy when its reported KV usage exceeds this fraction.
    #[arg(long, env = "KVROUTE_KV_BUSY_FRACTION", default_value_t = 0.98,
          value_parser = parse_non_negative_f64)]
    pub kv_busy_fraction: f64,

    /// Most SelectWorker calls waiting (WAIT admission) at once; more are
    /// refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "KVROUTE_QUEUE_CAPACITY", default_value_t = 1024)]
    pub queue_capacity: usize,

    /// Session affinity entries expire after this long unused.
    #[arg(long, env = "KVROUTE_SESSION_TTL", default_value = "600s",
          value_parser = parse_positive_duration)]
    pub session_ttl: Duration,

    /// Most events in one KvEventBatch.
    #[arg(long, env = "KVROUTE_MAX_EVENTS_PER_BATCH", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_events_per_batch: u32,

    /// Most blocks in one stored event (and prompt blocks per request).
    #[arg(long, env = "KVROUTE_MAX_BLOCKS_PER_EVENT", default_value_t = 16384,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_blocks_per_event: u32,

    /// Seed of the random tie-break and sampling (0: a fresh seed per start).
    #[arg(long, env = "KVROUTE_SEED", default_value_t = 0)]
    pub seed: u64,
}

impl Default for ServeConfig {
    fn default() -> Self {
        use clap::{FromArgMatches, Parser};
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            config: ServeConfig,
        }
        let matches = <Only as clap::CommandFactory>::command()
            .no_binary_name(true)
            .try_get_matches_from(Vec::<String>::new());
        // The defaults above are constants that parse; should they ever not,
        // fall back to a hand-written copy rather than panic.
        match matches.and_then(|m| Only::from_arg_matches(&m)) {
            Ok(only) => only.config,
            Err(_) => Self::fallback(),
        }
    }
}

impl ServeConfig {
    fn fallback() -> Self {
        Self {
            config: None,
            grpc_addr: SocketAddr::from(([127, 0, 0, 1], 50051)),
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], 9464)),
            block_size: 16,
            log_format: LogFormat::Pretty,
            log_level: "info".into(),
            max_message_bytes: 16 * 1024 * 1024,
            request_timeout: Duration::from_secs(30),
            concurrency_limit: 4096,
            shutdown_grace: Duration::from_secs(10),
            drain_delay: Duration::ZERO,
            lease_ttl: Duration::from_secs(10),
            booking_ttl: Duration::from_secs(300),
            overlap_weight: DEFAULT_OVERLAP_WEIGHT,
            temperature: 0.0,
            busy_threshold: 4.0,
            kv_busy_fraction: 0.98,
            queue_capacity: 1024,
            session_ttl: Duration::from_secs(600),
            max_events_per_batch: 4096,
            max_blocks_per_event: 16384,
            seed: 0,
        }
    }

    /// Settings for tests: ephemeral loopback ports, everything else default.
    pub fn for_tests() -> Self {
        Self {
            grpc_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            seed: 7,
            ..Self::default()
        }
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {message}")]
    File { path: String, message: String },
    #[error("{0}")]
    Invalid(String),
}

/// Folds the TOML file named by `--config` (if any) into the parsed command
/// line. `matches` are the `serve` sub-command's matches and `argv` the full
/// original arguments; returns argv with the file's settings appended where
/// neither a flag nor an env var set them.
pub fn argv_with_config_file(
    matches: &clap::ArgMatches,
    config_path: Option<&PathBuf>,
    argv: Vec<String>,
) -> Result<Vec<String>, ConfigError> {
    let Some(path) = config_path else {
        return Ok(argv);
    };
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::File {
            path: shown.clone(),
            message: e.message().to_string(),
        })?;
    let mut argv = argv;
    for (key, value) in table {
        let id = key.replace('-', "_");
        if id == "config" {
            return Err(ConfigError::File {
                path: shown,
                message: "`config` cannot be set from a config file".into(),
            });
        }
        let source = matches
            .try_contains_id(&id)
            .map_err(|_| ConfigError::File {
                path: shown.clone(),
                message: format!("unknown setting `{key}`"),
            })
            .map(|_| matches.value_source(&id))?;
        if !matches!(source, Some(ValueSource::DefaultValue) | None) {
            continue; // a flag or env var wins over the file
        }
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(ConfigError::File {
                    path: shown,
                    message: format!("setting `{key}` must be a string or number, not {other}"),
                });
            }
        };
        argv.push(format!("--{}={text}", id.replace('_', "-")));
    }
    Ok(argv)
}

fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

fn parse_non_negative_f64(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a number"))?;
    if !v.is_finite() || v < 0.0 {
        return Err("must be a finite number >= 0".into());
    }
    Ok(v)
}

fn parse_log_filter(text: &str) -> Result<String, String> {
    tracing_subscriber::EnvFilter::try_new(text)
        .map(|_| text.to_string())
        .map_err(|e| e.to_string())
}
