//! Configuration of `kvroute serve`: command-line flags, `KVROUTE_*`
//! environment variables and an optional TOML file, with precedence
//! flag > env > file > default.
//!
//! clap handles flags, env and defaults. The file is folded in by turning each
//! of its keys whose setting was left at its default into the matching
//! `--flag value` and parsing again, so file values go through exactly the
//! same parsers and error messages as flags.

mod cluster;
mod gateway;
mod limits;
mod security;

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, ValueEnum, parser::ValueSource};

pub use cluster::{ClusterOptions, DecisionOrder};
pub use gateway::{AdapterOf, EppAdmission, GatewayOptions, TokenizerDir};
pub use limits::{LimitOptions, parse_bytes};
pub use security::{Reflection, SecurityOptions};

use crate::{
    engine_events::{EngineSource, EngineSpec},
    router::{
        DEFAULT_OVERLAP_CREDIT, DEFAULT_OVERLAP_WEIGHT, InputLimits, RouterConfig, ScorerChoice,
        TrustSettings,
    },
};
use kvroute_core::select::{TierSavings, TtftSettings};

// the most blocks per event that the flag accepts is the index's own limit
const _: () = assert!(kvroute_core::index::radix::MAX_EVENT_BLOCKS == 16_777_215);

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable, coloured when writing to a terminal.
    Pretty,
    /// One JSON object per line, for log collectors.
    Json,
}

/// How SelectWorker scores candidates (`select::scoring`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScoringPolicy {
    /// Overlap-weighted prefill blocks plus decode blocks.
    Cost,
    /// Predicted time to first token, learned per worker.
    Ttft,
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

    /// Serve the operators' web view (`/ui/`): on `--web-addr` if set,
    /// else on the metrics listener.
    #[arg(long, env = "KVROUTE_WEB_UI", default_value_t = true, action = clap::ArgAction::Set)]
    pub web_ui: bool,

    /// Address of the web view's own listener (plain HTTP); unset: the
    /// view is served on the metrics listener.
    #[arg(long, env = "KVROUTE_WEB_ADDR")]
    pub web_addr: Option<SocketAddr>,

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

    /// Cost taken off per cached prompt block, beyond the prefill it saves
    /// (staying where a prefix lives keeps it warm for the next turn).
    #[arg(long, env = "KVROUTE_OVERLAP_CREDIT", default_value_t = DEFAULT_OVERLAP_CREDIT,
          value_parser = parse_non_negative_f64)]
    pub overlap_credit: f64,

    /// What a cached block below the device saves of its prefill, per tier:
    /// `host=0.7,storage=0.3,external=0.2` (the defaults, from the replay in
    /// docs/TIERS.md). 0 ignores a tier; a worker may declare its own.
    #[arg(long, env = "KVROUTE_TIER_SAVINGS", default_value = "host=0.7,storage=0.3,external=0.2",
          value_parser = parse_tier_savings)]
    pub tier_savings: TierSavings,

    /// What loading a LoRA adapter costs a worker that loads adapters on
    /// request (`loads_adapters`) and does not serve the one asked for, in
    /// prefill tokens added to its estimate; at most 16777216.
    #[arg(long, env = "KVROUTE_ADAPTER_LOAD_TOKENS",
          default_value_t = kvroute_core::select::DEFAULT_ADAPTER_LOAD_TOKENS,
          value_parser = clap::value_parser!(u64)
              .range(..=kvroute_core::select::MAX_ADAPTER_LOAD_TOKENS))]
    pub adapter_load_tokens: u64,

    /// Softmax temperature of scoring; 0 always takes the lowest cost.
    #[arg(long, env = "KVROUTE_TEMPERATURE", default_value_t = 0.0,
          value_parser = parse_non_negative_f64)]
    pub temperature: f64,

    /// Scoring policy: `cost` weighs cached prefix against booked blocks;
    /// `ttft` predicts each candidate's time to first token.
    #[arg(long, env = "KVROUTE_SCORER", value_enum, default_value = "cost")]
    pub scorer: ScoringPolicy,

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

    /// How long a predicted cache block (workers registered APPROXIMATE,
    /// or AUTO before their first event) lasts untouched; 0s: until the
    /// worker's capacity pushes it out.
    #[arg(long, env = "KVROUTE_PREDICTION_TTL", default_value = "0s",
          value_parser = parse_duration)]
    pub prediction_ttl: Duration,

    /// Score an exact worker whose event stream is in trouble (below) on
    /// its index blended with predictions until the trouble is over.
    #[arg(long, env = "KVROUTE_EVENT_TRUST", num_args = 0..=1,
          default_value_t = true, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub event_trust: bool,

    /// A gap in a worker's event stream unhealed this long makes it
    /// untrusted (with `event_trust`).
    #[arg(long, env = "KVROUTE_EVENT_GAP_DEADLINE", default_value = "5s",
          value_parser = parse_positive_duration)]
    pub event_gap_deadline: Duration,

    /// An engine subscription down this long makes its worker untrusted
    /// (with `event_trust`).
    #[arg(long, env = "KVROUTE_SUBSCRIPTION_DOWN_DEADLINE", default_value = "10s",
          value_parser = parse_positive_duration)]
    pub subscription_down_deadline: Duration,

    /// A worker owing events this long for a prefill it completed (one
    /// that computed new blocks, with no event from it since its booking)
    /// is untrusted (with `event_trust`).
    #[arg(long, env = "KVROUTE_EVENTS_BEHIND_DEADLINE", default_value = "10s",
          value_parser = parse_positive_duration)]
    pub events_behind_deadline: Duration,

    /// Most events in one KvEventBatch.
    #[arg(long, env = "KVROUTE_MAX_EVENTS_PER_BATCH", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_events_per_batch: u32,

    /// Most blocks in one stored event (and prompt blocks per request), at
    /// most the index's own limit (`index::radix::MAX_EVENT_BLOCKS`).
    #[arg(long, env = "KVROUTE_MAX_BLOCKS_PER_EVENT", default_value_t = 16384,
          value_parser = clap::value_parser!(u32).range(1..=16_777_215))]
    pub max_blocks_per_event: u32,

    /// Seed of the random tie-break and sampling (0: a fresh seed per
    /// start; replicas deciding in log order then share a fixed one, and
    /// must share any other).
    #[arg(long, env = "KVROUTE_SEED", default_value_t = 0)]
    pub seed: u64,

    /// Directory of durable state: kvroute writes snapshots of its state
    /// there (every `snapshot_interval`, at graceful shutdown, and on
    /// `kvroute ctl snapshot`) and loads the newest at start. Unset: no
    /// state survives a restart.
    #[arg(long, env = "KVROUTE_STATE_DIR")]
    pub state_dir: Option<PathBuf>,

    /// Time between snapshots, with `state_dir`, e.g. `30s`.
    #[arg(long, env = "KVROUTE_SNAPSHOT_INTERVAL", default_value = "30s",
          value_parser = parse_positive_duration)]
    pub snapshot_interval: Duration,

    /// Refuse to start when the newest snapshot in `state_dir` cannot be
    /// loaded (the file stays in place), instead of moving it aside and
    /// starting cold. An empty directory is a first start and starts cold.
    #[arg(long, env = "KVROUTE_REQUIRE_SNAPSHOT", num_args = 0..=1,
          default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub require_snapshot: bool,

    /// An engine whose ZeroMQ KV events kvroute subscribes to (repeatable):
    /// `WORKER_ID:MODEL:BLOCK_SIZE:DP_START:DP_SIZE:DIALECT:ENDPOINT[:REPLAY]`,
    /// e.g. `1:llama:16:0:2:vllm:tcp://10.0.0.5:5557:tcp://10.0.0.5:5558`.
    /// DIALECT is vllm or sglang; ENDPOINT and REPLAY are the engine's PUB and
    /// replay endpoints as configured in the engine (tcp://HOST:PORT, rank r
    /// at PORT+r, or ipc://PATH for one rank). The engine is registered as a
    /// worker whose lease is renewed while kvroute runs. In a config file:
    /// `engine = ["SPEC", ...]`.
    #[arg(long = "engine", value_name = "SPEC", value_parser = parse_engine_spec)]
    pub engine: Vec<EngineSpec>,

    #[command(flatten)]
    pub cluster: ClusterOptions,

    #[command(flatten)]
    pub security: SecurityOptions,

    #[command(flatten)]
    pub limits: LimitOptions,

    #[command(flatten)]
    pub gateway: GatewayOptions,
}

/// Parses `WORKER_ID:MODEL:BLOCK_SIZE:DP_START:DP_SIZE:DIALECT:ENDPOINT[:REPLAY]`.
/// The endpoints contain colons themselves, so REPLAY starts at the second
/// `tcp://` or `ipc://` (the model name must not contain a colon).
pub fn parse_engine_spec(text: &str) -> Result<EngineSpec, String> {
    const FORMAT: &str = "WORKER_ID:MODEL:BLOCK_SIZE:DP_START:DP_SIZE:DIALECT:ENDPOINT[:REPLAY]";
    let fields: Vec<&str> = text.splitn(7, ':').collect();
    let [id, model, block_size, dp_start, dp_size, dialect, endpoints] = fields[..] else {
        return Err(format!("expected {FORMAT}"));
    };
    let number = |name: &str, v: &str| -> Result<u32, String> {
        v.parse::<u32>()
            .map_err(|_| format!("{name} {v:?} is not a number (expected {FORMAT})"))
    };
    let worker_id = id
        .parse::<u64>()
        .map_err(|_| format!("WORKER_ID {id:?} is not a number (expected {FORMAT})"))?;
    if model.is_empty() {
        return Err(format!("MODEL is empty (expected {FORMAT})"));
    }
    let block_size = number("BLOCK_SIZE", block_size)?;
    if block_size == 0 {
        return Err("BLOCK_SIZE must be at least 1".into());
    }
    let dp_start_rank = number("DP_START", dp_start)?;
    let dp_size = number("DP_SIZE", dp_size)?.max(1);
    let split = ["tcp://", "ipc://"]
        .iter()
        .filter_map(|scheme| endpoints.get(1..)?.find(&format!(":{scheme}")))
        .min()
        .map(|i| i + 1);
    let (endpoint, replay) = match split {
        Some(i) => (&endpoints[..i], &endpoints[i + 1..]),
        None => (endpoints, ""),
    };
    // The checks are shared with RegisterWorker: name this syntax's fields.
    let rename = |e: String| {
        e.replace("events_dialect", "DIALECT")
            .replace("events_endpoint", "ENDPOINT")
            .replace("replay_endpoint", "REPLAY")
    };
    let source = EngineSource::from_fields(endpoint, dialect, replay)
        .map_err(rename)?
        .ok_or_else(|| format!("ENDPOINT is empty (expected {FORMAT})"))?;
    // Checks that every rank's endpoint can be derived.
    source.events_config(worker_id, model, block_size, dp_start_rank, dp_size)?;
    Ok(EngineSpec {
        worker_id,
        model: model.to_string(),
        block_size,
        dp_start_rank,
        dp_size,
        source,
    })
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
        // The router's own defaults are the flags' defaults.
        let r = RouterConfig::default();
        Self {
            config: None,
            grpc_addr: SocketAddr::from(([127, 0, 0, 1], 50051)),
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], 9464)),
            web_ui: true,
            web_addr: None,
            block_size: r.default_block_size,
            log_format: LogFormat::Pretty,
            log_level: "info".into(),
            max_message_bytes: 16 * 1024 * 1024,
            request_timeout: Duration::from_secs(30),
            concurrency_limit: 4096,
            shutdown_grace: Duration::from_secs(10),
            drain_delay: Duration::ZERO,
            lease_ttl: r.lease_ttl,
            booking_ttl: r.booking_ttl,
            overlap_weight: r.overlap_weight,
            overlap_credit: r.overlap_credit,
            tier_savings: r.tier_savings,
            adapter_load_tokens: r.adapter_load_tokens,
            temperature: r.temperature,
            scorer: ScoringPolicy::Cost,
            busy_threshold: r.busy_threshold,
            kv_busy_fraction: r.kv_busy_fraction,
            queue_capacity: r.queue_capacity,
            session_ttl: r.session_ttl,
            prediction_ttl: r.prediction_ttl.unwrap_or_default(),
            event_trust: r.trust.enabled,
            event_gap_deadline: r.trust.gap_deadline,
            subscription_down_deadline: r.trust.subscription_deadline,
            events_behind_deadline: r.trust.events_behind_deadline,
            max_events_per_batch: r.limits.max_events_per_batch,
            max_blocks_per_event: r.limits.max_blocks_per_event,
            seed: r.seed,
            state_dir: None,
            snapshot_interval: Duration::from_secs(30),
            require_snapshot: false,
            engine: Vec::new(),
            cluster: ClusterOptions::default(),
            security: SecurityOptions::default(),
            limits: LimitOptions::default(),
            gateway: GatewayOptions::default(),
        }
    }

    /// The router core's part of the settings.
    pub(crate) fn router_config(&self) -> RouterConfig {
        RouterConfig {
            default_block_size: self.block_size,
            lease_ttl: self.lease_ttl,
            booking_ttl: self.booking_ttl,
            booking_limits: self.limits.booking_limits(),
            overlap_weight: self.overlap_weight,
            overlap_credit: self.overlap_credit,
            tier_savings: self.tier_savings,
            adapter_load_tokens: self.adapter_load_tokens,
            temperature: self.temperature,
            busy_threshold: self.busy_threshold,
            kv_busy_fraction: self.kv_busy_fraction,
            queue_capacity: self.queue_capacity,
            session_ttl: self.session_ttl,
            seed: match self.seed {
                0 if self.cluster.ordered() => crate::router::ordered::CLUSTER_SEED,
                seed => seed,
            },
            limits: InputLimits {
                max_events_per_batch: self.max_events_per_batch,
                max_blocks_per_event: self.max_blocks_per_event,
                max_engine_message_bytes: usize::try_from(self.limits.max_engine_message_bytes)
                    .unwrap_or(usize::MAX),
            },
            replicas: self.cluster.replica_settings(),
            registry_limits: self.limits.registry_limits(),
            scorer: match self.scorer {
                ScoringPolicy::Cost => ScorerChoice::Cost,
                ScoringPolicy::Ttft => ScorerChoice::Ttft(TtftSettings::default()),
            },
            prediction_ttl: (!self.prediction_ttl.is_zero()).then_some(self.prediction_ttl),
            trust: TrustSettings {
                enabled: self.event_trust,
                gap_deadline: self.event_gap_deadline,
                subscription_deadline: self.subscription_down_deadline,
                events_behind_deadline: self.events_behind_deadline,
            },
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
/// line. `command` is the `serve` sub-command (which settings exist),
/// `matches` its matches and `argv` the full original arguments; returns
/// argv with the file's settings appended where neither a flag nor an env
/// var set them.
pub(crate) fn argv_with_config_file(
    command: &clap::Command,
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
    argv_with_config_text(command, matches, &shown, &text, argv)
}

/// [`argv_with_config_file`] once the file is read: `text` is its TOML,
/// `shown` the name its errors give it.
pub(crate) fn argv_with_config_text(
    command: &clap::Command,
    matches: &clap::ArgMatches,
    shown: &str,
    text: &str,
    argv: Vec<String>,
) -> Result<Vec<String>, ConfigError> {
    let file_error = |message: String| ConfigError::File {
        path: shown.to_string(),
        message,
    };
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| file_error(e.message().to_string()))?;
    let mut argv = argv;
    for (key, value) in table {
        let id = key.replace('-', "_");
        if id == "config" {
            return Err(file_error(
                "`config` cannot be set from a config file".into(),
            ));
        }
        // asked of the command, not of `matches`: `ArgMatches` checks that
        // an id exists only in debug builds
        if !command.get_arguments().any(|a| a.get_id() == id.as_str()) {
            return Err(file_error(format!("unknown setting `{key}`")));
        }
        if !matches!(
            matches.value_source(&id),
            Some(ValueSource::DefaultValue) | None
        ) {
            continue; // a flag or env var wins over the file
        }
        if let toml::Value::Array(items) = value {
            // A repeatable setting (`engine`): one flag per string.
            for item in items {
                let toml::Value::String(text) = item else {
                    return Err(file_error(format!(
                        "setting `{key}` must be an array of strings"
                    )));
                };
                argv.push(format!("--{}={text}", id.replace('_', "-")));
            }
            continue;
        }
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(file_error(format!(
                    "setting `{key}` must be a string or number, not {other}"
                )));
            }
        };
        argv.push(format!("--{}={text}", id.replace('_', "-")));
    }
    Ok(argv)
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| e.to_string())
}

fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

/// `--tier-savings`: `tier=fraction` pairs over the defaults.
pub fn parse_tier_savings(text: &str) -> Result<TierSavings, String> {
    TierSavings::DEFAULT.parse_onto(text)
}

pub fn parse_non_negative_f64(text: &str) -> Result<f64, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flags_defaults_are_the_routers_defaults() {
        assert_eq!(
            ServeConfig::default().router_config(),
            RouterConfig::default()
        );
        assert_eq!(
            ServeConfig::fallback().router_config(),
            RouterConfig::default()
        );
    }

    #[test]
    fn cluster_replicas_tell_the_core_of_their_peers() {
        use crate::router::ReplicaSettings;
        let cluster = |replicas: u32, index: Option<u32>, name: &str| {
            let mut config = ServeConfig::default();
            config.cluster.nats_url = Some("nats://nats:4222".into());
            config.cluster.cluster_replicas = replicas;
            config.cluster.replica_index = index;
            config.cluster.replica_id = Some(name.into());
            config.cluster.decision_order = crate::config::DecisionOrder::Local;
            config.router_config().replicas
        };
        let settings = cluster(3, None, "kvroute-2");
        assert_eq!((settings.count, settings.index), (3, 2));
        assert_eq!(settings.sync_delay, Duration::from_millis(2));
        assert!(settings.estimates_peers());
        assert_eq!(
            cluster(3, None, "kvroute-4").index,
            1,
            "modulo the replicas"
        );
        assert_eq!(cluster(3, Some(1), "kvroute-0").index, 1, "the flag wins");
        assert!(cluster(3, None, "router-a").index < 3, "a hash of the name");
        assert_eq!(cluster(1, None, "kvroute-2"), ReplicaSettings::default());
        let mut alone = ServeConfig::default();
        alone.cluster.cluster_replicas = 3;
        assert_eq!(
            alone.router_config().replicas,
            ReplicaSettings::default(),
            "no cluster without --nats-url"
        );
    }

    #[test]
    fn ordered_decisions_are_the_cluster_default_and_share_a_seed() {
        let mut config = ServeConfig::default();
        assert!(!config.cluster.ordered(), "alone, nothing to order");
        config.cluster.nats_url = Some("nats://nats:4222".into());
        config.cluster.cluster_replicas = 3;
        config.cluster.replica_id = Some("kvroute-1".into());
        assert!(config.cluster.ordered());
        let router = config.router_config();
        assert!(!router.replicas.estimates_peers(), "nothing to estimate");
        assert_eq!(router.seed, crate::router::ordered::CLUSTER_SEED);
        config.seed = 9;
        assert_eq!(config.router_config().seed, 9, "a set seed is kept");
        config.cluster.decision_order = crate::config::DecisionOrder::Local;
        assert!(config.router_config().replicas.estimates_peers());
        assert_eq!(config.seed, config.router_config().seed);
    }
    use crate::engine_events::Dialect;

    #[test]
    fn engine_specs_parse_with_and_without_replay() {
        let spec = parse_engine_spec("7:llama:16:2:2:vllm:tcp://10.0.0.5:5557:tcp://10.0.0.5:5558")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (spec.worker_id, spec.model.as_str(), spec.block_size),
            (7, "llama", 16)
        );
        assert_eq!((spec.dp_start_rank, spec.dp_size), (2, 2));
        assert_eq!(spec.source.dialect, Dialect::Vllm);
        assert_eq!(spec.source.endpoint, "tcp://10.0.0.5:5557");
        assert_eq!(
            spec.source.replay_endpoint.as_deref(),
            Some("tcp://10.0.0.5:5558")
        );
        let spec = parse_engine_spec("1:m:16:0:1:SGLang:ipc:///run/kv.sock")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.source.dialect, Dialect::Sglang);
        assert_eq!(spec.source.endpoint, "ipc:///run/kv.sock");
        assert_eq!(spec.source.replay_endpoint, None);
    }

    #[test]
    fn bad_engine_specs_say_what_is_wrong() {
        for (spec, message) in [
            ("7:m:16:0:1:vllm", "expected WORKER_ID:MODEL"),
            ("x:m:16:0:1:vllm:tcp://h:1", "WORKER_ID \"x\""),
            ("7:m:0:0:1:vllm:tcp://h:1", "BLOCK_SIZE must be"),
            ("7:m:16:0:1:trt:tcp://h:1", "not supported"),
            ("7:m:16:0:2:vllm:ipc:///x", "dp rank 1"),
            ("7:m:16:0:1:vllm:tcp://h", "tcp://HOST:PORT"),
        ] {
            let error = parse_engine_spec(spec).err().unwrap_or_default();
            assert!(error.contains(message), "{spec}: {error}");
        }
    }
}
