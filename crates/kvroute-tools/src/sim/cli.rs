//! `kvroute replay`: runs policies over a trace in the simulator and prints
//! the comparison (table, or one JSON object per policy), optionally a chart.
//!
//! It exists to keep the command line (flags and their checks, the progress
//! bar, output formats) out of the simulator, whose API takes plain values
//! and is what tests and other tools call.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::engine::{DEFAULT_HOST_LOAD_MS_PER_BLOCK, EngineConfig};
use super::event_link::LinkImpairment;
use super::fleet::replay_with_progress;
use super::kvroute_policy::{DYNAMO_TIER_WEIGHTS, KvRouteKnobs, KvRoutePolicy};
use super::policy::{POLICY_NAMES, Router, policy_by_name};
use super::replicas::ReplicatedKvRoute;
use super::report::Report;
use super::types::{ReplicaSetup, SimConfig};
use crate::trace::Trace;
use kvroute::router::ScorerChoice;
use kvroute_core::select::{TierSavings, TtftSettings};

/// Every policy `--policy` accepts.
pub const ALL_POLICIES: &[&str] = &[
    "kvroute",
    "kvroute-ttft",
    "round-robin",
    "random",
    "least-loaded",
    "prefix-only",
];

/// Policies `--policy` accepts that `all` leaves out: the kvroute policy
/// scoring cache tiers another way (for engines with `--host-blocks`).
/// `kvroute` itself is the tier-aware default.
pub const TIER_POLICIES: &[&str] = &["kvroute-device-only", "kvroute-dynamo-tiers"];

/// Arguments of `kvroute replay`. Engine defaults follow Dynamo's mocker.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// A Mooncake-format trace (JSONL: timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    pub trace: PathBuf,
    /// Simulated engines.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub workers: u64,
    /// Arrival times are divided by this.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Policies to compare (repeat or comma-separate): kvroute,
    /// kvroute-ttft, round-robin, random, least-loaded, prefix-only, or all;
    /// with a host tier also kvroute-device-only (routing blind to lower
    /// tiers, as before them) and kvroute-dynamo-tiers (Dynamo's weights:
    /// host 0.75, disk 0.25), or `tiers` for those two and kvroute.
    #[arg(long = "policy", value_delimiter = ',', default_value = "all")]
    pub policies: Vec<String>,
    /// kvroute policy: weight of prefill cost against decode cost.
    #[arg(long, default_value_t = kvroute::router::DEFAULT_OVERLAP_WEIGHT)]
    pub overlap_weight: f64,
    /// kvroute policy: cost taken off per cached prompt block.
    #[arg(long, default_value_t = kvroute::router::DEFAULT_OVERLAP_CREDIT)]
    pub overlap_credit: f64,
    /// kvroute policy: softmax temperature (0: lowest cost).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// kvroute-ttft policy: candidates predicted within this fraction of
    /// the fastest (plus --ttft-slack-ms) compete on cached prefix.
    #[arg(long, default_value_t = TtftSettings::default().slack_fraction)]
    pub ttft_slack: f64,
    /// kvroute-ttft policy: ms added to the slack.
    #[arg(long, default_value_t = TtftSettings::default().slack_ms)]
    pub ttft_slack_ms: f64,
    /// kvroute policies: the first N engines register APPROXIMATE (no KV
    /// events reach the router; it predicts their caches from its own
    /// routing). N at least --workers makes every engine approximate.
    #[arg(long, default_value_t = 0)]
    pub approximate_workers: usize,
    /// kvroute policies: fraction (0 to 1) of the --lossy-workers engines'
    /// KV events lost on the way (their ids skipped, never resent).
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub event_loss: f64,
    /// kvroute policies: how many engines (the last ones) lose events.
    #[arg(long, default_value_t = 0)]
    pub lossy_workers: usize,
    /// kvroute policies: virtual ms every engine's KV events take to reach
    /// the router.
    #[arg(long, default_value_t = 0.0, value_parser = kvroute::config::parse_non_negative_f64)]
    pub event_delay_ms: f64,
    /// kvroute policies: trust per worker (`--event-trust` of serve); false
    /// scores a worker whose stream broke on its index regardless.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub event_trust: bool,
    /// kvroute policy: router replicas sharing the fleet, each its own
    /// router core seeing every KV event; request i is routed by replica
    /// i mod N. Only the kvroute policy books load, so only it accepts N > 1.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub router_replicas: u64,
    /// With --router-replicas: virtual ms after which a replica's bookings,
    /// prefill completions and releases reach the other replicas.
    #[arg(long, default_value_t = 0.0, conflicts_with = "no_replica_sync")]
    pub replica_sync_delay_ms: f64,
    /// With --router-replicas: replicas never learn each other's bookings.
    #[arg(long)]
    pub no_replica_sync: bool,
    /// With --router-replicas: decisions are records of the replicated log
    /// (cluster mode's ordered decisions): every replica applies every
    /// decision in one order, and each decision waits
    /// --replica-sync-delay-ms for its record.
    #[arg(long, conflicts_with = "no_replica_sync")]
    pub ordered_decisions: bool,
    /// kvroute policies: what a block in each lower tier saves of its
    /// prefill, as `serve --tier-savings` (e.g. `host=0.8`); the kvroute
    /// policy's default is the router's.
    #[arg(long, value_parser = kvroute::config::parse_tier_savings)]
    pub tier_savings: Option<TierSavings>,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Replay only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// One JSON object per policy instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write a chart comparing the policies to this .svg or .png file (TTFT
    /// by percentile, reuse against the ideal, imbalance). Needs a binary
    /// built with the `plot` feature (the default; not the server image).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// KV cache blocks per engine.
    #[arg(long, default_value_t = 16_384)]
    pub num_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// Most sequences running at once per engine.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one engine step.
    #[arg(long, default_value_t = 8_192)]
    pub max_num_batched_tokens: usize,
    /// Turn prefix caching off.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Turn chunked prefill off.
    #[arg(long)]
    pub no_chunked_prefill: bool,
    /// Prefill step ms = a*N^2 + b*N + c for N new tokens: a.
    #[arg(long, default_value_t = 4.209989e-7, allow_negative_numbers = true)]
    pub prefill_quadratic: f64,
    /// Prefill step: b.
    #[arg(long, default_value_t = 1.518344e-2, allow_negative_numbers = true)]
    pub prefill_linear: f64,
    /// Prefill step: c.
    #[arg(long, default_value_t = 16.50142, allow_negative_numbers = true)]
    pub prefill_constant: f64,
    /// Decode step ms = a*u^2 + b*u + c for KV utilisation u: a.
    #[arg(long, default_value_t = -25.74, allow_negative_numbers = true)]
    pub decode_quadratic: f64,
    /// Decode step: b.
    #[arg(long, default_value_t = 54.01, allow_negative_numbers = true)]
    pub decode_linear: f64,
    /// Decode step: c.
    #[arg(long, default_value_t = 5.74, allow_negative_numbers = true)]
    pub decode_constant: f64,
    /// Shortest decode step, ms.
    #[arg(long, default_value_t = 1.0)]
    pub decode_min_ms: f64,
    /// Host-memory tier per engine, in blocks (0: none): blocks the device
    /// evicts move there and load back at --host-load-ms-per-block each.
    #[arg(long, default_value_t = 0)]
    pub host_blocks: usize,
    /// ms to load one block from the host tier (default: a 64-token block
    /// of an 8B model over PCIe Gen5, docs/TIERS.md).
    #[arg(long, default_value_t = DEFAULT_HOST_LOAD_MS_PER_BLOCK,
          value_parser = kvroute::config::parse_non_negative_f64)]
    pub host_load_ms_per_block: f64,
}

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Trace(#[from] crate::trace::TraceError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("writing the chart: {0}")]
    Plot(String),
    #[error(
        "--plot: this kvroute binary was built without the `plot` feature (the server \
         image leaves it out); use a build with default features, e.g. `cargo run --release \
         -- replay ... --plot out.png`"
    )]
    PlotNotBuilt,
}

impl ReplayArgs {
    fn sim_config(&self) -> Result<SimConfig, ReplayError> {
        let engine = EngineConfig {
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            enable_prefix_caching: !self.no_prefix_caching,
            enable_chunked_prefill: !self.no_chunked_prefill,
            prefill_quadratic: self.prefill_quadratic,
            prefill_linear: self.prefill_linear,
            prefill_constant: self.prefill_constant,
            decode_quadratic: self.decode_quadratic,
            decode_linear: self.decode_linear,
            decode_constant: self.decode_constant,
            decode_min_ms: self.decode_min_ms,
            host_blocks: self.host_blocks,
            host_load_ms_per_block: self.host_load_ms_per_block,
        };
        engine.validate().map_err(ReplayError::Invalid)?;
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(ReplayError::Invalid("--speedup must be > 0".into()));
        }
        for (name, v) in [
            ("--overlap-weight", self.overlap_weight),
            ("--temperature", self.temperature),
            ("--overlap-credit", self.overlap_credit),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ReplayError::Invalid(format!("{name} must be >= 0")));
            }
        }
        if !(self.replica_sync_delay_ms.is_finite() && self.replica_sync_delay_ms >= 0.0) {
            return Err(ReplayError::Invalid(
                "--replica-sync-delay-ms must be >= 0".into(),
            ));
        }
        Ok(SimConfig {
            workers: self.workers as usize,
            speedup: self.speedup,
            seed: self.seed,
            engine,
        })
    }

    /// `--plot` can be honoured: the chart code is built in and the file is
    /// named *.svg or *.png. Checked before replaying, so a long run does not
    /// end in an error.
    fn check_plot(&self) -> Result<(), ReplayError> {
        let Some(path) = &self.plot else {
            return Ok(());
        };
        if !cfg!(feature = "plot") {
            return Err(ReplayError::PlotNotBuilt);
        }
        if !matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("svg" | "png")
        ) {
            return Err(ReplayError::Plot(format!(
                "{}: name the chart *.svg or *.png",
                path.display()
            )));
        }
        Ok(())
    }

    fn policy_names(&self) -> Result<Vec<String>, ReplayError> {
        let mut names = Vec::new();
        for name in &self.policies {
            if name == "all" {
                names.extend(ALL_POLICIES.iter().map(|s| s.to_string()));
            } else if name == "tiers" {
                names.extend(
                    ["kvroute-device-only", "kvroute", "kvroute-dynamo-tiers"].map(String::from),
                );
            } else if ALL_POLICIES.contains(&name.as_str())
                || TIER_POLICIES.contains(&name.as_str())
            {
                names.push(name.clone());
            } else {
                return Err(ReplayError::Invalid(format!(
                    "unknown policy `{name}` (one of {}, {}, tiers or all)",
                    ALL_POLICIES.join(", "),
                    TIER_POLICIES.join(", ")
                )));
            }
        }
        names.dedup();
        if self.router_replicas > 1
            && let Some(baseline) = names.iter().find(|n| !n.starts_with("kvroute"))
        {
            return Err(ReplayError::Invalid(format!(
                "--router-replicas {} models routers that book load, which only the kvroute \
                 policy does; `{baseline}` would route as one router. Pass --policy kvroute",
                self.router_replicas
            )));
        }
        Ok(names)
    }

    /// The replicas asked for; `None` for one router, which is the plain
    /// policy (so one router's replay is the same whatever the sync flags).
    fn replicas(&self) -> Option<ReplicaSetup> {
        (self.router_replicas > 1).then(|| ReplicaSetup {
            count: self.router_replicas as usize,
            sync_delay_ms: (!self.no_replica_sync).then_some(self.replica_sync_delay_ms),
            ordered: self.ordered_decisions,
        })
    }

    fn router(&self, name: &str) -> Result<Box<dyn Router>, ReplayError> {
        if name.starts_with("kvroute") {
            let tier_savings = match name {
                "kvroute-device-only" => TierSavings::DEVICE_ONLY,
                "kvroute-dynamo-tiers" => DYNAMO_TIER_WEIGHTS,
                _ => self.tier_savings.unwrap_or(TierSavings::DEFAULT),
            };
            let knobs = KvRouteKnobs {
                overlap_weight: self.overlap_weight,
                overlap_credit: self.overlap_credit,
                temperature: self.temperature,
                seed: self.seed,
                scorer: if name == "kvroute-ttft" {
                    ScorerChoice::Ttft(TtftSettings {
                        slack_fraction: self.ttft_slack,
                        slack_ms: self.ttft_slack_ms,
                        ..TtftSettings::default()
                    })
                } else {
                    ScorerChoice::Cost
                },
                approximate_workers: self.approximate_workers,
                impairment: LinkImpairment {
                    loss: self.event_loss,
                    lossy_engines: self.lossy_workers,
                    delay_ms: self.event_delay_ms,
                },
                trust: self.event_trust,
                tier_savings,
            };
            return Ok(match self.replicas() {
                Some(setup) => Box::new(ReplicatedKvRoute::new(knobs, setup)?),
                None => Box::new(KvRoutePolicy::new(knobs)?),
            });
        }
        policy_by_name(name, self.seed)
            .ok_or_else(|| ReplayError::Invalid(format!("unknown policy `{name}`")))
    }
}

/// Runs `kvroute replay`; returns the reports in policy order.
pub fn run(args: &ReplayArgs) -> Result<Vec<Report>, ReplayError> {
    debug_assert!(POLICY_NAMES.iter().all(|p| ALL_POLICIES.contains(p)));
    let config = args.sim_config()?;
    let names = args.policy_names()?;
    args.check_plot()?;
    let mut trace = Trace::load(&args.trace)?;
    if let Some(n) = args.limit {
        trace = trace.truncated(n);
    }
    let mut reports = Vec::new();
    for name in &names {
        let mut router = args.router(name)?;
        let bar = ProgressBar::hidden();
        bar.set_style(
            ProgressStyle::with_template("{msg:>14} [{bar:40}] {pos}/{len} requests {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_message(name.clone());
        bar.set_length(trace.records.len() as u64);
        let started = Instant::now();
        let mut shown = false;
        let report = replay_with_progress(&trace, &config, router.as_mut(), &mut |done, _| {
            // Only runs longer than a second get a bar, on stderr.
            if !shown && started.elapsed() > Duration::from_secs(1) {
                bar.set_draw_target(ProgressDrawTarget::stderr());
                shown = true;
            }
            bar.set_position(done as u64);
        });
        bar.finish_and_clear();
        if args.json {
            println!("{}", report.to_json());
        }
        reports.push(report);
    }
    if !args.json {
        print!("{}", Report::table(&reports));
        let floors = super::bounds::ttft_floors(&trace, &config.engine, config.workers);
        print!("{}", super::bounds::table(&floors, config.workers));
    }
    if let Some(path) = &args.plot {
        write_chart(path, &reports)?;
    }
    Ok(reports)
}

#[cfg(feature = "plot")]
fn write_chart(path: &Path, reports: &[Report]) -> Result<(), ReplayError> {
    super::plot::write_chart(path, reports).map_err(ReplayError::Plot)
}

/// Without the `plot` feature there is no chart code; `run` refuses `--plot`
/// before replaying, so this is only reached if that check is bypassed.
#[cfg(not(feature = "plot"))]
fn write_chart(_path: &Path, _reports: &[Report]) -> Result<(), ReplayError> {
    Err(ReplayError::PlotNotBuilt)
}

fn parse_fraction(text: &str) -> Result<f64, String> {
    let v = kvroute::config::parse_non_negative_f64(text)?;
    if v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("{v} is not a fraction from 0 to 1"))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        replay: ReplayArgs,
    }

    /// Runs `replay` on a trace that does not exist: an error about the trace
    /// means every check before loading it passed.
    fn run_with_plot(plot: &str) -> ReplayError {
        let cli = Cli::parse_from([
            "replay",
            "--trace",
            "/nonexistent/trace.jsonl",
            "--plot",
            plot,
        ]);
        match run(&cli.replay) {
            Err(e) => e,
            Ok(_) => panic!("a missing trace replays"),
        }
    }

    #[test]
    fn router_replicas_run_the_kvroute_policy_only() {
        let err = |args: &[&str]| {
            let cli = Cli::parse_from(
                ["replay", "--trace", "/nonexistent/trace.jsonl"]
                    .iter()
                    .chain(args),
            );
            match run(&cli.replay) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("a missing trace replays"),
            }
        };
        let all = err(&["--router-replicas", "3"]);
        assert!(all.contains("Pass --policy kvroute"), "{all}");
        let rr = err(&["--router-replicas", "2", "--policy", "kvroute,round-robin"]);
        assert!(rr.contains("`round-robin`"), "{rr}");
        // kvroute alone gets as far as loading the trace
        let kv = err(&[
            "--router-replicas",
            "3",
            "--no-replica-sync",
            "--policy",
            "kvroute",
        ]);
        assert!(kv.contains("/nonexistent/trace.jsonl"), "{kv}");
        let negative = err(&["--router-replicas", "3", "--replica-sync-delay-ms=-1"]);
        assert!(negative.contains("must be >= 0"), "{negative}");
    }

    #[test]
    fn replica_flags_say_how_load_is_shared() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(["replay", "--trace", "t.jsonl"].iter().chain(args))
                .map(|cli| cli.replay.replicas())
        };
        assert_eq!(parse(&[]).ok(), Some(None));
        assert_eq!(parse(&["--no-replica-sync"]).ok(), Some(None));
        assert_eq!(
            parse(&["--router-replicas", "3", "--replica-sync-delay-ms", "10"]).ok(),
            Some(Some(ReplicaSetup {
                count: 3,
                sync_delay_ms: Some(10.0),
                ordered: false,
            }))
        );
        assert_eq!(
            parse(&[
                "--router-replicas",
                "3",
                "--replica-sync-delay-ms",
                "10",
                "--ordered-decisions"
            ])
            .ok(),
            Some(Some(ReplicaSetup {
                count: 3,
                sync_delay_ms: Some(10.0),
                ordered: true,
            }))
        );
        assert!(
            parse(&[
                "--router-replicas",
                "3",
                "--no-replica-sync",
                "--ordered-decisions"
            ])
            .is_err()
        );
        assert_eq!(
            parse(&["--router-replicas", "3"])
                .ok()
                .flatten()
                .map(|s| s.sync_delay_ms),
            Some(Some(0.0))
        );
        assert_eq!(
            parse(&["--router-replicas", "3", "--no-replica-sync"]).ok(),
            Some(Some(ReplicaSetup {
                count: 3,
                sync_delay_ms: None,
                ordered: false,
            }))
        );
        assert!(parse(&["--replica-sync-delay-ms", "1", "--no-replica-sync"]).is_err());
        assert!(parse(&["--router-replicas", "0"]).is_err());
    }

    #[test]
    fn plot_needs_the_feature_and_an_svg_or_png_name() {
        let png = run_with_plot("out.png");
        let txt = run_with_plot("out.txt");
        if cfg!(feature = "plot") {
            assert!(matches!(png, ReplayError::Trace(_)), "{png}");
            assert!(matches!(txt, ReplayError::Plot(_)), "{txt}");
        } else {
            // One clear error, before any replay, whatever the file name.
            assert!(matches!(png, ReplayError::PlotNotBuilt), "{png}");
            assert!(matches!(txt, ReplayError::PlotNotBuilt), "{txt}");
            assert!(png.to_string().contains("without the `plot` feature"));
        }
    }
}
