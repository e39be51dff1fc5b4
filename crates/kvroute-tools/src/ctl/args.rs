//! `kvroute ctl`'s command line: the global flags (address, `--json`,
//! credentials) and one variant per sub-command. Kept apart from the calls so
//! the help text, which operators read, is in one place.

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

use kvroute::{pb, security::client::ClientCredentials};

/// The address `ctl` talks to unless told otherwise (the `serve` default).
pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

/// Arguments of `kvroute ctl`.
#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The kvroute gRPC address (`http://host:port`, or `host:port`).
    #[arg(long, global = true, default_value = DEFAULT_ADDR)]
    pub addr: String,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(flatten)]
    pub credentials: ClientCredentials,
    #[command(subcommand)]
    pub command: CtlCommand,
}

/// `kvroute ctl ...`
#[derive(Debug, Subcommand)]
pub enum CtlCommand {
    /// List registered workers.
    Workers {
        /// Only workers of this model.
        #[arg(long)]
        model: Option<String>,
    },
    /// Show one worker and each of its dp ranks.
    Worker {
        /// The worker id.
        id: u64,
    },
    /// Show KV index statistics.
    Stats {
        /// Only this model's index.
        #[arg(long)]
        model: Option<String>,
    },
    /// Score every candidate for a prompt, as SelectWorker would (changes nothing).
    Explain(ExplainArgs),
    /// Keep new requests away from a worker.
    Cordon {
        /// The worker id.
        id: u64,
    },
    /// Let a cordoned worker take requests again.
    Uncordon {
        /// The worker id.
        id: u64,
    },
    /// Write a snapshot of the router's state to its --state-dir now.
    Snapshot,
    /// Ask the gRPC health service (open to every caller); exits non-zero
    /// unless SERVING. The Kubernetes probe over TLS.
    Health {
        /// A service name (e.g. `kvroute.v1.Router`); empty: the server.
        #[arg(long, default_value = "")]
        service: String,
    },
}

/// Arguments of `kvroute ctl explain`.
#[derive(Debug, Args)]
#[command(group(
    clap::ArgGroup::new("prompt")
        .required(true)
        .args(["tokens", "tokens_file", "trace"])
))]
pub struct ExplainArgs {
    /// The model to route for.
    #[arg(long)]
    pub model: String,
    /// The prompt's token ids, whitespace-separated or a JSON array.
    #[arg(long)]
    pub tokens: Option<String>,
    /// A file holding the prompt's token ids (whitespace-separated or a JSON array).
    #[arg(long)]
    pub tokens_file: Option<PathBuf>,
    /// A Mooncake trace (JSONL); the prompt is request `--line` of it.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The trace line (1-based).
    #[arg(long, default_value_t = 1, requires = "trace")]
    pub line: usize,
    /// The phase being routed.
    #[arg(long, value_enum, default_value_t = Phase::Aggregated)]
    pub phase: Phase,
    /// LoRA adapter name.
    #[arg(long)]
    pub lora: Option<String>,
    /// Cache namespace.
    #[arg(long)]
    pub namespace: Option<String>,
}

/// The phase of `--phase`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Phase {
    Aggregated,
    Prefill,
    Decode,
}

impl From<Phase> for pb::RequestPhase {
    fn from(phase: Phase) -> Self {
        match phase {
            Phase::Aggregated => pb::RequestPhase::Aggregated,
            Phase::Prefill => pb::RequestPhase::Prefill,
            Phase::Decode => pb::RequestPhase::Decode,
        }
    }
}
