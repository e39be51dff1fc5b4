//! The tools' command line: `kvroute replay | loadgen | bench | ctl | hash`. The
//! server's `kvroute` hands these sub-commands to this binary unchanged.

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use kvroute::cli::{CliError, clap_error};

/// kvroute's tools: trace replay, benchmarks, ctl and the hash tool.
#[derive(Debug, Parser)]
#[command(name = "kvroute", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// What to run.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the local hash of each complete block of token ids read from
    /// stdin (whitespace-separated or a JSON array), one unsigned decimal per line.
    Hash(HashArgs),
    /// Replay a request trace through simulated engines under several
    /// routing policies and compare TTFT, latency, throughput and cache reuse.
    Replay(Box<crate::sim::cli::ReplayArgs>),
    /// Replay a request trace against real engines over HTTP (streamed
    /// completions) and print the replay's table from what the client saw.
    Loadgen(crate::loadgen::LoadgenArgs),
    /// A GPU-free stand-in for a vLLM server: the OpenAI API, vLLM's load
    /// metrics and KV events, timed by the replay's engine model.
    MockEngine(crate::mock_engine::MockEngineArgs),
    /// kvroute against round robin on mock engines over real sockets, with
    /// the replay's prediction beside (about two minutes).
    Demo(crate::demo::DemoArgs),
    /// Benchmarks that print figures.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Ask a running kvroute what it knows (workers, index stats), why it
    /// would route a prompt where it does, and cordon or uncordon workers.
    Ctl(crate::ctl::CtlArgs),
}

/// Arguments of `kvroute hash`.
#[derive(Debug, Args)]
pub struct HashArgs {
    /// Tokens per block.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: u32,
    /// LoRA adapter name (changes the hash seed).
    #[arg(long)]
    pub lora: Option<String>,
    /// Cache namespace (changes the hash seed).
    #[arg(long)]
    pub namespace: Option<String>,
}

/// `kvroute bench ...`
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Replay an OPLOG v1 file through an index and print one JSON line of
    /// figures (blocks/s, match latency, memory, answer sums).
    Index {
        /// The op log: OPLOG v1 as `oplog.rs` reads it, made from a
        /// Mooncake trace by the benchmark kit's make_oplog.py
        /// (docs/BENCHMARKS.md gives the command).
        #[arg(long)]
        oplog: std::path::PathBuf,
        /// Which index: kvroute (the service's) or naive (the test oracle).
        #[arg(long = "impl", default_value = "kvroute")]
        implementation: String,
    },
    /// Many concurrent gRPC clients calling SelectWorker with trace prompts,
    /// then Health/Check on the same server: calls/s and latency of each.
    Select(crate::bench::select::SelectBenchArgs),
    /// Replay an op log's events through PublishEvents, check the server's
    /// block counts against an in-process replay, print blocks/s.
    Ingest(crate::bench::ingest::IngestBenchArgs),
    /// Fill workers through PublishEvents, snapshot them while SelectWorker
    /// runs, load the snapshot in a new server: bytes per entry, write and
    /// load seconds, routing latency during the snapshot.
    Snapshot(crate::bench::snapshot::SnapshotBenchArgs),
    /// Three replicas on NATS JetStream: an op log's events through
    /// PublishEvents at one, blocks/s until applied on all, and the lag to
    /// the others at a multiple of the trace's event rate.
    Cluster(crate::bench::cluster::ClusterBenchArgs),
    /// RESERVE and release through one router, three replicas deciding
    /// locally and three deciding in the shared log's order: decisions/s
    /// at saturation and the latency each adds at a paced rate.
    Decisions(crate::bench::decisions::DecisionsBenchArgs),
    /// A long run (30 minutes by default) of KV events at a multiple of a
    /// trace's rate, booking frontends and worker churn; per-minute memory,
    /// SelectWorker latency, events and errors, then an index check and a
    /// verdict (exit 1 when it fails).
    Soak(crate::bench::soak::SoakBenchArgs),
}

/// Parses `argv` (program name first).
pub fn parse(argv: Vec<String>) -> Result<Cli, CliError> {
    let matches = Cli::command()
        .try_get_matches_from(argv)
        .map_err(clap_error)?;
    Cli::from_arg_matches(&matches).map_err(clap_error)
}
