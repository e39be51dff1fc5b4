//! `kvroute bench soak`: a long run against a real server with everything a
//! fleet does to it at once, because leaks and slow drift show only over
//! time and under mixed load.
//!
//! * Simulated engines (`crate::sim`'s, with LRU caches, so the index reaches
//!   a steady size) serve a trace's requests at a multiple of its rate and
//!   publish their KV events through PublishEvents, one stream per worker.
//! * Frontends book (SelectWorker RESERVE), mark prefill complete and release
//!   trace prompts.
//! * A schedule of churn cordons and uncordons workers, lets leases lapse and
//!   deregisters workers; each one comes back with a fresh engine.
//!
//! Every interval (a minute) it prints the server's resident memory and,
//! where the server counts it, its heap (bytes allocated and not freed;
//! each the median and peak of one sample a second: a single reading mostly
//! measures which event batches happen to be in flight),
//! SelectWorker p50/p99, events applied and errors by kind, split into the
//! designed ones (what the churn makes expected, e.g. NOT_FOUND for a lapsed
//! worker) and the rest. At the end it compares the server's index with an
//! in-process [`KvIndex`] fed exactly the events the server accepted, and
//! gives a verdict: memory flat after warm-up (the heap where it is
//! counted: resident memory also grows with pages the allocator keeps for
//! reuse, which is no leak), p99 without drift, no unexpected error, an
//! exact index. Then it deregisters its workers and reads the heap again:
//! what the run left behind.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Args;
use parking_lot::Mutex;
use tokio::{sync::mpsc, task::JoinHandle, time::MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use super::histogram::{Histogram, SELECT_WORKER, ServerLatency};
use super::{BenchError, Latency, connect, scrape_metrics, target};
use crate::{
    sim::{EngineConfig, EngineKvEvent, SimEngine, block_hashes, engine::EngineRequest},
    trace::{Trace, mix},
};
use kvroute::{
    config::ServeConfig,
    grpc::{convert, rpc_metrics::code_name},
    pb::{
        self, admin_client::AdminClient, router_client::RouterClient, workers_client::WorkersClient,
    },
};
use kvroute_core::{
    hashing::{HashOptions, compute_block_hashes},
    index::{KvEvent, KvIndex},
    types::WorkerRank,
};

mod frontend;
mod memory;
mod report;
mod tally;
#[cfg(test)]
mod tests;
mod verdict;
mod workers;

use frontend::*;
use memory::*;
use report::*;
use tally::*;
use verdict::*;
use workers::*;

/// Arguments of `kvroute bench soak`.
#[derive(Debug, Clone, Args)]
pub struct SoakBenchArgs {
    /// A Mooncake-format trace (the conversation trace).
    #[arg(
        long,
        default_value = "../shared/data/traces/mooncake_fast25_conversation_trace.jsonl"
    )]
    pub trace: std::path::PathBuf,
    /// Target an already running server instead of starting one.
    #[arg(long)]
    pub addr: Option<String>,
    /// The external server's metrics address (host:port): its resident
    /// memory and heap are read from `process_resident_memory_bytes` and
    /// `kvroute_heap_allocated_bytes` when exported.
    #[arg(long, requires = "addr")]
    pub metrics_addr: Option<String>,
    /// Length of the run.
    #[arg(long, default_value_t = 30.0)]
    pub minutes: f64,
    /// Length of the run in seconds (overrides --minutes; for tests).
    #[arg(long, hide = true)]
    pub seconds: Option<f64>,
    /// Seconds per reported interval.
    #[arg(long, hide = true, default_value_t = 60.0)]
    pub interval_secs: f64,
    /// Intervals of warm-up (the index filling) that the verdict ignores.
    #[arg(long, default_value_t = 3)]
    pub warmup_intervals: usize,
    /// KV events at this multiple of the trace's request rate.
    #[arg(long, default_value_t = 10.0)]
    pub event_rate_x: f64,
    /// Simulated workers (one engine and one event stream each).
    #[arg(long, default_value_t = 8)]
    pub workers: u64,
    /// KV cache of each simulated engine, in blocks (its LRU capacity).
    #[arg(long, default_value_t = 16_384)]
    pub engine_blocks: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 64)]
    pub block_size: u32,
    /// Frontend clients, each on its own connection.
    #[arg(long, default_value_t = 4)]
    pub frontends: usize,
    /// SelectWorker calls per second, all frontends together.
    #[arg(long, default_value_t = 200.0)]
    pub select_rate: f64,
    /// Every Nth SelectWorker of a frontend sends token ids instead of
    /// block hashes (0: never).
    #[arg(long, default_value_t = 10)]
    pub tokens_every: u64,
    /// Seconds between churn actions (cordon, lease lapse, deregistration;
    /// in turn, each on the next worker).
    #[arg(long, default_value_t = 15.0)]
    pub churn_secs: f64,
    /// Lease of the workers, in seconds (heartbeats every third of it).
    #[arg(long, default_value_t = 5)]
    pub lease_secs: u32,
}

const MODEL: &str = "soak";
/// Requests a frontend keeps booked before releasing the oldest.
const BOOKED_DEPTH: usize = 8;
/// Events per KvEventBatch.
const BATCH_EVENTS: usize = 256;
/// Engine steps per request at most (a request longer than this is left to
/// finish with the next one).
const MAX_STEPS: usize = 200_000;
/// Time between two memory samples (resident and heap).
const MEMORY_SAMPLE_PERIOD: Duration = Duration::from_secs(1);
/// Relative growth of the judged memory (heap, else RSS) after warm-up that
/// still counts as flat.
const MEMORY_TOLERANCE: f64 = 0.05;
/// Heap an external server may hold after the run, once every worker is
/// gone, beyond what it held before: pools grown to the run's peak (tokio's
/// task and timer slabs, connection buffers) stay allocated.
const HEAP_LEFT_TOLERANCE: i64 = 2 << 20;
/// Relative p99 rise, last intervals against the first after warm-up.
const P99_TOLERANCE: f64 = 0.20;
/// Intervals averaged at each end for the p99 drift.
const P99_WINDOW: usize = 3;

/// One interval's figures, printed as a JSON line.
#[derive(Clone, Debug, serde::Serialize)]
pub struct IntervalReport {
    pub bench: &'static str,
    pub interval: usize,
    pub elapsed_s: f64,
    /// Median resident memory of the server over the interval's samples
    /// (of this whole process when the server runs in it: engines and
    /// clients included).
    pub rss_median_bytes: Option<u64>,
    /// Largest sample of the interval.
    pub rss_peak_bytes: Option<u64>,
    pub rss_samples: usize,
    /// Median and largest heap sample (allocated, not freed), where the
    /// server exports it.
    pub heap_median_bytes: Option<u64>,
    pub heap_peak_bytes: Option<u64>,
    pub select_calls: u64,
    #[serde(flatten)]
    pub select: Latency,
    /// SelectWorker as the server timed it over the interval (from its
    /// `rpc_duration_seconds` histogram; `None` where it cannot be read).
    pub server_select: Option<ServerLatency>,
    /// Events the server applied in the interval (GetIndexStats).
    pub events_applied: u64,
    /// Events whose batches the server acknowledged in the interval.
    pub events_accepted: u64,
    pub index_blocks: u64,
    pub index_memory_bytes: u64,
    /// Trace requests no engine could take (all queues full or down).
    pub requests_shed: u64,
    pub designed_errors: BTreeMap<String, u64>,
    pub unexpected_errors: BTreeMap<String, u64>,
}

/// The end-of-run checks, printed as a JSON line.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SoakVerdict {
    pub bench: &'static str,
    pub intervals: usize,
    pub warmup_intervals: usize,
    /// Mean of the RSS interval medians over the middle third of the
    /// intervals after warm-up, and over the last third.
    pub rss_middle_bytes: Option<u64>,
    pub rss_last_bytes: Option<u64>,
    /// `rss_last_bytes` over `rss_middle_bytes`, minus 1.
    pub rss_growth: Option<f64>,
    /// Largest single sample after warm-up (printed, not judged: it moves
    /// with the event batches in flight at that second).
    pub rss_peak_bytes: Option<u64>,
    /// The same for the heap.
    pub heap_middle_bytes: Option<u64>,
    pub heap_last_bytes: Option<u64>,
    pub heap_growth: Option<f64>,
    /// What "flat" judges: `heap` when every interval after warm-up has it,
    /// else `rss`.
    pub memory_source: &'static str,
    pub memory_flat: Option<bool>,
    /// An external server's heap before the workers registered and after
    /// they were deregistered at the end, and the difference.
    pub heap_before_bytes: Option<u64>,
    pub heap_after_bytes: Option<u64>,
    pub heap_left_bytes: Option<i64>,
    /// Whether the run left at most `HEAP_LEFT_TOLERANCE` behind.
    pub heap_returned: Option<bool>,
    /// Whose SelectWorker p99 the drift judges: the server's own timing
    /// when every interval after warm-up has it, else the clients'.
    pub p99_source: &'static str,
    pub p99_first_us: Option<f64>,
    pub p99_last_us: Option<f64>,
    pub p99_drift: Option<f64>,
    pub p99_stable: Option<bool>,
    /// The clients' p99 drift, printed beside the server's (it also
    /// carries the machine's scheduling noise).
    pub client_p99_drift: Option<f64>,
    pub designed_errors: BTreeMap<String, u64>,
    pub unexpected_errors: BTreeMap<String, u64>,
    pub server_blocks: u64,
    pub reference_blocks: u64,
    pub server_digest: u64,
    pub reference_digest: u64,
    pub index_mismatches: Vec<String>,
    pub index_exact: bool,
    pub pass: bool,
}

/// Everything a run printed.
#[derive(Clone, Debug)]
pub struct SoakReport {
    pub intervals: Vec<IntervalReport>,
    pub verdict: SoakVerdict,
}

/// The soak's durations and rates, checked.
struct Settings {
    trace: Arc<Trace>,
    total: Duration,
    interval: Duration,
    rate_x: f64,
    select_rate: f64,
    churn_period: Duration,
}

impl Settings {
    fn from_args(args: &SoakBenchArgs) -> Result<Self, BenchError> {
        let trace = Arc::new(Trace::load(&args.trace)?);
        if trace.records.is_empty() || args.workers == 0 {
            return Err(BenchError::Setup(
                "the soak needs a non-empty trace and at least one worker".into(),
            ));
        }
        let seconds = |flag: &str, value: f64| within(flag, value, 0.1, 1e7);
        Ok(Self {
            trace,
            total: Duration::from_secs_f64(seconds(
                "--minutes/--seconds",
                args.seconds.unwrap_or(args.minutes * 60.0),
            )?),
            interval: Duration::from_secs_f64(seconds("--interval-secs", args.interval_secs)?),
            rate_x: within("--event-rate-x", args.event_rate_x, 1e-3, 1e6)?,
            select_rate: within("--select-rate", args.select_rate, 0.01, 1e7)?,
            churn_period: Duration::from_secs_f64(seconds("--churn-secs", args.churn_secs)?),
        })
    }
}

/// The running load: its workers, and the tasks to stop at the end.
struct Load {
    slots: Vec<Arc<WorkerSlot>>,
    /// Dispatch, frontends and churn: stopped first.
    load_tasks: Vec<JoinHandle<()>>,
    stop: CancellationToken,
    /// The workers: stopped once nothing sends them work.
    worker_tasks: Vec<JoinHandle<()>>,
    stop_workers: CancellationToken,
}

/// What every interval adds up to.
#[derive(Default)]
struct Totals {
    designed: BTreeMap<String, u64>,
    unexpected: BTreeMap<String, u64>,
}

impl Totals {
    /// Splits `counts`' errors into designed and unexpected, adds them to
    /// the totals and returns this part's.
    fn add(&mut self, counts: &Counts) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
        let (designed, unexpected) = split(&counts.errors);
        for (k, v) in &designed {
            *self.designed.entry(k.clone()).or_insert(0) += v;
        }
        for (k, v) in &unexpected {
            *self.unexpected.entry(k.clone()).or_insert(0) += v;
        }
        (designed, unexpected)
    }
}

/// Runs the soak and prints its lines; the verdict says whether it passed
/// (the caller decides the exit code).
pub async fn run(args: &SoakBenchArgs) -> Result<SoakReport, BenchError> {
    let settings = Settings::from_args(args)?;
    let config = ServeConfig {
        block_size: args.block_size,
        concurrency_limit: 1 << 20,
        ..ServeConfig::for_tests()
    };
    let (addr, local) = target(args.addr.as_deref(), config).await?;
    let channel = connect(&addr).await?;
    let memory = match (&local, &args.metrics_addr) {
        (Some(_), _) => Memory::OwnProcess,
        (None, Some(metrics)) => Memory::Scrape(metrics.clone()),
        (None, None) => Memory::Unknown,
    };
    let metrics_addr = local
        .as_ref()
        .map(|l| l.metrics_addr.to_string())
        .or_else(|| args.metrics_addr.clone());
    // The heap before any worker: judged against the heap after, only for
    // an external server (in this process the engines, the reference index
    // and the prompts are still allocated at the end).
    let heap_before = match &memory {
        Memory::Scrape(_) => memory.read().await.heap,
        _ => None,
    };
    let samples = Arc::new(Mutex::new(Samples::default()));
    let stop_sampling = CancellationToken::new();
    let sampler = tokio::spawn(sample_memory(
        memory.clone(),
        samples.clone(),
        stop_sampling.clone(),
    ));

    let tally = Arc::new(Tally::default());
    let reference = Arc::new(KvIndex::new(args.block_size));
    let load = start_load(args, &settings, &addr, &channel, &tally, &reference).await?;

    let mut admin = AdminClient::new(channel.clone());
    let started = tokio::time::Instant::now();
    let mut intervals = Vec::new();
    let mut last_applied = index_stats(&mut admin, &tally)
        .await
        .map_or(0, |s| s.events_applied);
    let mut totals = Totals::default();
    let mut last_histogram = select_histogram(metrics_addr.as_deref()).await;
    let count = (settings.total.as_secs_f64() / settings.interval.as_secs_f64())
        .ceil()
        .max(1.0) as usize;
    for n in 1..=count {
        let end = (started + settings.interval * n as u32).min(started + settings.total);
        tokio::time::sleep_until(end).await;
        let taken = tally.take();
        let stats = index_stats(&mut admin, &tally).await.unwrap_or_default();
        let histogram = select_histogram(metrics_addr.as_deref()).await;
        let server_select = match (&histogram, &last_histogram) {
            (Some(now), Some(before)) => now.since(before).summary(),
            _ => None,
        };
        last_histogram = histogram;
        let applied = stats.events_applied.saturating_sub(last_applied);
        last_applied = stats.events_applied;
        let (designed, unexpected) = totals.add(&taken);
        let mut latencies = taken.latencies;
        let Samples { mut rss, mut heap } = std::mem::take(&mut *samples.lock());
        rss.sort_unstable();
        heap.sort_unstable();
        let report = IntervalReport {
            bench: "soak",
            interval: n,
            elapsed_s: started.elapsed().as_secs_f64(),
            rss_median_bytes: rss.get(rss.len() / 2).copied(),
            rss_peak_bytes: rss.last().copied(),
            rss_samples: rss.len(),
            heap_median_bytes: heap.get(heap.len() / 2).copied(),
            heap_peak_bytes: heap.last().copied(),
            select_calls: latencies.len() as u64,
            select: Latency::of(&mut latencies),
            server_select,
            events_applied: applied,
            events_accepted: taken.events_accepted,
            index_blocks: stats.blocks,
            index_memory_bytes: stats.memory_bytes,
            requests_shed: taken.shed,
            designed_errors: designed,
            unexpected_errors: unexpected,
        };
        println!("{}", serde_json::to_string(&report).unwrap_or_default());
        eprintln!("{}", human(&report));
        intervals.push(report);
    }

    stop_sampling.cancel();
    let _ = sampler.await;
    let slots = load.stop().await;
    // Errors of the wind-down count too.
    totals.add(&tally.take());
    let check = compare(&channel, &slots, &reference).await?;
    // Leave the server as it was found: without this, a soak run right
    // after this one would find these worker ids still registered (until
    // their leases lapse) with this run's blocks.
    deregister_all(&channel, &slots).await;
    let heap_after = match (&memory, heap_before) {
        (Memory::Scrape(_), Some(_)) => {
            // Removals reach the index through its writer: let it drain.
            tokio::time::sleep(Duration::from_secs(2)).await;
            memory.read().await.heap
        }
        _ => None,
    };
    if let Some(local) = local {
        local.stop().await;
    }
    let mut verdict = judge(
        &intervals,
        args.warmup_intervals,
        totals.designed,
        totals.unexpected,
        check,
    );
    verdict.judge_heap_left(heap_before, heap_after);
    println!("{}", serde_json::to_string(&verdict).unwrap_or_default());
    eprintln!("{}", human_verdict(&verdict));
    Ok(SoakReport { intervals, verdict })
}

/// Registers the workers, then starts the trace's dispatch to them, the
/// frontends and the churn.
async fn start_load(
    args: &SoakBenchArgs,
    settings: &Settings,
    addr: &str,
    channel: &Channel,
    tally: &Arc<Tally>,
    reference: &Arc<KvIndex>,
) -> Result<Load, BenchError> {
    let stop = CancellationToken::new();
    let stop_workers = CancellationToken::new();
    // Workers first, registered before any load starts.
    let mut slots = Vec::new();
    let mut churn_orders = Vec::new();
    let mut worker_tasks = Vec::new();
    for worker_id in 0..args.workers {
        let (jobs_tx, jobs_rx) = mpsc::channel(64);
        let (churn_tx, churn_rx) = mpsc::channel(4);
        let slot = Arc::new(WorkerSlot {
            id: worker_id,
            up: AtomicBool::new(false),
            jobs: jobs_tx,
        });
        let mut worker = Worker {
            slot: slot.clone(),
            channel: connect(addr).await?,
            engine_config: EngineConfig {
                num_blocks: args.engine_blocks.max(1),
                block_size: args.block_size.max(1) as usize,
                ..EngineConfig::default()
            },
            engine: SimEngine::new(EngineConfig::default()),
            block_size: args.block_size,
            lease_secs: args.lease_secs.max(1),
            reference: reference.clone(),
            tally: tally.clone(),
            stream: None,
            next_event_id: 0,
        };
        worker.start().await?;
        slots.push(slot);
        churn_orders.push(churn_tx);
        worker_tasks.push(tokio::spawn(worker.run(
            jobs_rx,
            churn_rx,
            stop_workers.clone(),
        )));
    }

    let trace = &settings.trace;
    let prompts: Arc<Vec<Vec<u64>>> = Arc::new(
        trace
            .records
            .iter()
            .map(|r| {
                compute_block_hashes(&r.tokens(), args.block_size, &HashOptions::default(), None)
            })
            .collect(),
    );
    let mut load_tasks: Vec<JoinHandle<()>> = Vec::new();
    load_tasks.push(tokio::spawn(dispatch(
        trace.clone(),
        slots.clone(),
        settings.rate_x,
        tally.clone(),
        stop.clone(),
    )));
    let frontends = args.frontends.max(1);
    let period = Duration::from_secs_f64(frontends as f64 / settings.select_rate);
    for index in 0..frontends {
        let frontend = Frontend {
            index,
            router: RouterClient::new(connect(addr).await?),
            prompts: prompts.clone(),
            trace: trace.clone(),
            tally: tally.clone(),
            tokens_every: args.tokens_every,
        };
        load_tasks.push(tokio::spawn(frontend.run(period, stop.clone())));
    }
    load_tasks.push(tokio::spawn(churn(
        AdminClient::new(channel.clone()),
        slots.clone(),
        churn_orders,
        settings.churn_period,
        tally.clone(),
        stop.clone(),
    )));

    eprintln!(
        "bench soak: {} workers ({} blocks each), events at {}x the trace's rate, {} frontends at {} SelectWorker/s, churn every {}s, {:.1} minutes",
        args.workers,
        args.engine_blocks,
        args.event_rate_x,
        frontends,
        args.select_rate,
        args.churn_secs,
        settings.total.as_secs_f64() / 60.0
    );
    Ok(Load {
        slots,
        load_tasks,
        stop,
        worker_tasks,
        stop_workers,
    })
}

impl Load {
    /// Quiesces: load and churn first, then the workers (one caught in a
    /// lapse finishes it). Returns the workers' slots, for the comparison.
    async fn stop(self) -> Vec<Arc<WorkerSlot>> {
        self.stop.cancel();
        for task in self.load_tasks {
            let _ = task.await;
        }
        self.stop_workers.cancel();
        for task in self.worker_tasks {
            let _ = task.await;
        }
        self.slots
    }
}

/// `value` when finite and in `min..=max`, else a setup error naming `flag`.
fn within(flag: &str, value: f64, min: f64, max: f64) -> Result<f64, BenchError> {
    if value.is_finite() && (min..=max).contains(&value) {
        Ok(value)
    } else {
        Err(BenchError::Setup(format!(
            "{flag} must be between {min} and {max}, not {value}"
        )))
    }
}
