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
use super::{BenchError, Latency, connect, target};
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

/// Runs the soak and prints its lines; the verdict says whether it passed
/// (the caller decides the exit code).
pub async fn run(args: &SoakBenchArgs) -> Result<SoakReport, BenchError> {
    let trace = Arc::new(Trace::load(&args.trace)?);
    if trace.records.is_empty() || args.workers == 0 {
        return Err(BenchError::Setup(
            "the soak needs a non-empty trace and at least one worker".into(),
        ));
    }
    let total = Duration::from_secs_f64(within(
        "--minutes/--seconds",
        args.seconds.unwrap_or(args.minutes * 60.0),
        0.1,
        1e7,
    )?);
    let interval =
        Duration::from_secs_f64(within("--interval-secs", args.interval_secs, 0.1, 1e7)?);
    let rate_x = within("--event-rate-x", args.event_rate_x, 1e-3, 1e6)?;
    let select_rate = within("--select-rate", args.select_rate, 0.01, 1e7)?;
    let churn_period = Duration::from_secs_f64(within("--churn-secs", args.churn_secs, 0.1, 1e7)?);
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
            channel: connect(&addr).await?,
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
        rate_x,
        tally.clone(),
        stop.clone(),
    )));
    let frontends = args.frontends.max(1);
    let period = Duration::from_secs_f64(frontends as f64 / select_rate);
    for index in 0..frontends {
        let frontend = Frontend {
            index,
            router: RouterClient::new(connect(&addr).await?),
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
        churn_period,
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
        total.as_secs_f64() / 60.0
    );

    let mut admin = AdminClient::new(channel.clone());
    let started = tokio::time::Instant::now();
    let mut intervals = Vec::new();
    let mut last_applied = index_stats(&mut admin, &tally)
        .await
        .map_or(0, |s| s.events_applied);
    let mut designed_total = BTreeMap::new();
    let mut unexpected_total = BTreeMap::new();
    let mut last_histogram = select_histogram(metrics_addr.as_deref()).await;
    let count = (total.as_secs_f64() / interval.as_secs_f64())
        .ceil()
        .max(1.0) as usize;
    for n in 1..=count {
        let end = (started + interval * n as u32).min(started + total);
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
        let mut latencies = taken.latencies;
        let Samples { mut rss, mut heap } = std::mem::take(&mut *samples.lock());
        rss.sort_unstable();
        heap.sort_unstable();
        let (designed, unexpected) = split(&taken.errors);
        for (k, v) in &designed {
            *designed_total.entry(k.clone()).or_insert(0) += v;
        }
        for (k, v) in &unexpected {
            *unexpected_total.entry(k.clone()).or_insert(0) += v;
        }
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
    // Quiesce: load and churn first, then the workers (one caught in a lapse
    // finishes it), then compare.
    stop.cancel();
    for task in load_tasks {
        let _ = task.await;
    }
    stop_workers.cancel();
    for task in worker_tasks {
        let _ = task.await;
    }
    // Errors of the wind-down count too.
    let taken = tally.take();
    let (designed, unexpected) = split(&taken.errors);
    for (k, v) in designed {
        *designed_total.entry(k).or_insert(0) += v;
    }
    for (k, v) in unexpected {
        *unexpected_total.entry(k).or_insert(0) += v;
    }
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
        designed_total,
        unexpected_total,
        check,
    );
    verdict.judge_heap_left(heap_before, heap_after);
    println!("{}", serde_json::to_string(&verdict).unwrap_or_default());
    eprintln!("{}", human_verdict(&verdict));
    Ok(SoakReport { intervals, verdict })
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

/// Where the server's memory figures come from.
#[derive(Clone)]
enum Memory {
    /// The server runs in this process: /proc/self/status.
    OwnProcess,
    /// An external server's /metrics.
    Scrape(String),
    Unknown,
}

/// One reading of the server's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct MemoryReading {
    rss: Option<u64>,
    heap: Option<u64>,
}

impl Memory {
    async fn read(&self) -> MemoryReading {
        match self {
            Memory::OwnProcess => MemoryReading {
                rss: kvroute::metrics::resident_memory_bytes(),
                heap: kvroute::metrics::heap_allocated_bytes(),
            },
            Memory::Scrape(addr) => match super::scrape_metrics(addr).await {
                Some(text) => MemoryReading {
                    rss: gauge(&text, "process_resident_memory_bytes"),
                    heap: gauge(&text, "kvroute_heap_allocated_bytes"),
                },
                None => MemoryReading::default(),
            },
            Memory::Unknown => MemoryReading::default(),
        }
    }
}

/// The value of an unlabelled gauge `name` in a text exposition.
fn gauge(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| {
        l.strip_prefix(name)
            .is_some_and(|rest| rest.starts_with(' '))
    })?;
    let value: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    (value.is_finite() && value >= 0.0).then_some(value as u64)
}

/// Memory samples of the current interval.
#[derive(Debug, Default)]
struct Samples {
    rss: Vec<u64>,
    heap: Vec<u64>,
}

/// The server's SelectWorker histogram, if its metrics can be read.
async fn select_histogram(metrics_addr: Option<&str>) -> Option<Histogram> {
    let text = super::scrape_metrics(metrics_addr?).await?;
    Some(Histogram::rpc(&text, SELECT_WORKER))
}

/// Reads the server's memory every [`MEMORY_SAMPLE_PERIOD`] into `samples`
/// (the interval loop takes them) until `stop`.
async fn sample_memory(memory: Memory, samples: Arc<Mutex<Samples>>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(MEMORY_SAMPLE_PERIOD);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let reading = memory.read().await;
        let mut samples = samples.lock();
        samples.rss.extend(reading.rss);
        samples.heap.extend(reading.heap);
    }
}

/// An error of one RPC: which RPC, its code, and whether the churn made it
/// expected.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ErrorKind {
    rpc: &'static str,
    code: &'static str,
    designed: bool,
}

/// What the load tasks counted since the last interval.
#[derive(Default)]
struct Counts {
    latencies: Vec<Duration>,
    errors: BTreeMap<ErrorKind, u64>,
    events_accepted: u64,
    shed: u64,
}

#[derive(Default)]
struct Tally(Mutex<Counts>);

impl Tally {
    fn take(&self) -> Counts {
        std::mem::take(&mut *self.0.lock())
    }
    fn latency(&self, took: Duration) {
        self.0.lock().latencies.push(took);
    }
    fn status(&self, rpc: &'static str, status: &tonic::Status, designed: bool) {
        self.error(rpc, code_name(status.code()), designed);
    }
    fn error(&self, rpc: &'static str, code: &'static str, designed: bool) {
        *self
            .0
            .lock()
            .errors
            .entry(ErrorKind {
                rpc,
                code,
                designed,
            })
            .or_insert(0) += 1;
    }
    fn accepted(&self, events: u64) {
        self.0.lock().events_accepted += events;
    }
    fn shed(&self) {
        self.0.lock().shed += 1;
    }
}

/// Designed and unexpected errors as "Rpc CODE" -> count.
fn split(errors: &BTreeMap<ErrorKind, u64>) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let (mut designed, mut unexpected) = (BTreeMap::new(), BTreeMap::new());
    for (kind, &n) in errors {
        let side = if kind.designed {
            &mut designed
        } else {
            &mut unexpected
        };
        *side
            .entry(format!("{} {}", kind.rpc, kind.code))
            .or_insert(0) += n;
    }
    (designed, unexpected)
}

async fn index_stats(admin: &mut AdminClient<Channel>, tally: &Tally) -> Option<pb::IndexStats> {
    match admin
        .get_index_stats(pb::GetIndexStatsRequest {
            model: Some(MODEL.into()),
        })
        .await
    {
        Ok(reply) => Some(reply.into_inner()),
        Err(status) => {
            tally.status("GetIndexStats", &status, false);
            None
        }
    }
}

/// What the dispatcher and the churn see of a worker.
struct WorkerSlot {
    id: u64,
    /// Registered and publishing (false while the churn has it away).
    up: AtomicBool,
    jobs: mpsc::Sender<Job>,
}

impl WorkerSlot {
    fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }
}

/// A trace request for an engine.
struct Job {
    id: u64,
    tokens: Vec<u32>,
    output_length: usize,
}

/// What the churn asks a worker to do.
#[derive(Clone, Copy, Debug)]
enum Churn {
    /// Stop heartbeating until the lease lapses, then come back.
    Lapse,
    /// Deregister, then come back.
    Deregister,
}

/// One open PublishEvents stream.
struct EventStream {
    batches: mpsc::Sender<pb::KvEventBatch>,
    replies: tonic::Streaming<pb::PublishEventsReply>,
}

/// One simulated worker: an engine, its event stream and its lease. It is
/// the only writer of its own events, so the reference index sees them in
/// the order the server does.
struct Worker {
    slot: Arc<WorkerSlot>,
    channel: Channel,
    engine_config: EngineConfig,
    engine: SimEngine,
    block_size: u32,
    lease_secs: u32,
    reference: Arc<KvIndex>,
    tally: Arc<Tally>,
    stream: Option<EventStream>,
    next_event_id: u64,
}

impl Worker {
    /// Registers with a fresh engine (empty cache, events from id 0) and
    /// opens the event stream.
    async fn start(&mut self) -> Result<(), tonic::Status> {
        self.engine = SimEngine::new(self.engine_config.clone());
        self.next_event_id = 0;
        self.stream = None;
        let mut workers = WorkersClient::new(self.channel.clone());
        workers
            .register_worker(pb::RegisterWorkerRequest {
                worker_id: self.slot.id,
                model: MODEL.into(),
                block_size: self.block_size,
                dp_size: 1,
                total_kv_blocks: self.engine_config.num_blocks as u64,
                max_num_batched_tokens: 1 << 20,
                lease_ttl_secs: self.lease_secs,
                ..Default::default()
            })
            .await?;
        let (batches, receiver) = mpsc::channel(4);
        let replies = workers
            .publish_events(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await?
            .into_inner();
        self.stream = Some(EventStream { batches, replies });
        self.slot.up.store(true, Ordering::Release);
        Ok(())
    }

    async fn run(
        mut self,
        mut jobs: mpsc::Receiver<Job>,
        mut orders: mpsc::Receiver<Churn>,
        stop: CancellationToken,
    ) {
        let mut beat =
            tokio::time::interval(Duration::from_millis(u64::from(self.lease_secs) * 1000 / 3));
        beat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                Some(order) = orders.recv() => self.churn(order, &mut jobs).await,
                _ = beat.tick() => self.heartbeat().await,
                Some(job) = jobs.recv() => self.serve(job).await,
            }
        }
    }

    async fn heartbeat(&mut self) {
        if !self.slot.is_up() {
            return;
        }
        let load = self.engine.load();
        let request = pb::HeartbeatRequest {
            worker_id: self.slot.id,
            load: vec![pb::RankLoad {
                dp_rank: 0,
                running_requests: load.running as u32,
                waiting_requests: load.waiting as u32,
                kv_blocks_used: load.active_blocks as u64,
            }],
        };
        if let Err(status) = WorkersClient::new(self.channel.clone())
            .heartbeat(request)
            .await
        {
            self.tally.status("Heartbeat", &status, false);
        }
    }

    /// Runs one request on the engine to completion and publishes what its
    /// cache did.
    async fn serve(&mut self, job: Job) {
        if !self.slot.is_up() {
            self.tally.shed();
            return;
        }
        let hashes = block_hashes(&job.tokens, self.engine_config.block_size);
        self.engine.enqueue(EngineRequest {
            id: job.id,
            tokens: job.tokens,
            block_hashes: hashes,
            output_length: job.output_length,
        });
        let mut events = Vec::new();
        let mut steps = 0;
        while self.engine.has_work() && steps < MAX_STEPS {
            let outcome = self.engine.step();
            events.extend(outcome.kv_events);
            steps += 1;
            if !outcome.did_work {
                break;
            }
        }
        let events: Vec<KvEvent> = events.into_iter().map(|e| self.to_index(e)).collect();
        for chunk in events.chunks(BATCH_EVENTS) {
            if !self.publish(chunk).await {
                break;
            }
        }
    }

    /// An engine event as the index sees it (local hashes of the tokens).
    fn to_index(&self, event: EngineKvEvent) -> KvEvent {
        match event {
            EngineKvEvent::Stored { parent, blocks } => KvEvent::Stored {
                parent,
                blocks: blocks
                    .into_iter()
                    .map(|(engine, tokens)| {
                        let local = compute_block_hashes(
                            &tokens,
                            self.block_size,
                            &HashOptions::default(),
                            None,
                        )
                        .first()
                        .copied()
                        .unwrap_or_default();
                        (engine, local)
                    })
                    .collect(),
            },
            EngineKvEvent::Removed { engine_hashes } => KvEvent::Removed {
                blocks: engine_hashes,
            },
        }
    }

    /// Sends one batch and waits for its reply; the events go into the
    /// reference index once the server acknowledged them. False when the
    /// stream broke (it is reopened by the next registration only, so the
    /// worker's later events are not sent into a gap).
    async fn publish(&mut self, events: &[KvEvent]) -> bool {
        let Some(stream) = self.stream.as_mut() else {
            return false;
        };
        let batch = pb::KvEventBatch {
            worker_id: self.slot.id,
            dp_rank: 0,
            events: events
                .iter()
                .enumerate()
                .map(|(i, e)| convert::kv_event_to_pb(self.next_event_id + i as u64, e))
                .collect(),
        };
        self.next_event_id += events.len() as u64;
        if stream.batches.send(batch).await.is_err() {
            self.tally.error("PublishEvents", "STREAM_CLOSED", false);
            self.stream = None;
            return false;
        }
        match stream.replies.message().await {
            Ok(Some(reply)) => {
                let target = WorkerRank::new(self.slot.id, 0);
                for event in events {
                    let _ = self.reference.apply(target, event);
                }
                self.tally.accepted(events.len() as u64);
                if reply.rejected > 0 {
                    self.tally.error("PublishEvents", "EVENTS_REJECTED", false);
                }
                if reply.resend_from_event_id.is_some() {
                    self.tally.error("PublishEvents", "RESEND_ASKED", false);
                }
                if reply.resync_required {
                    self.tally.error("PublishEvents", "RESYNC_REQUIRED", false);
                }
                true
            }
            Ok(None) => {
                self.tally.error("PublishEvents", "STREAM_ENDED", false);
                self.stream = None;
                false
            }
            Err(status) => {
                self.tally.status("PublishEvents", &status, false);
                self.stream = None;
                false
            }
        }
    }

    /// Goes away as the churn asks, then comes back with a fresh engine.
    async fn churn(&mut self, order: Churn, jobs: &mut mpsc::Receiver<Job>) {
        self.slot.up.store(false, Ordering::Release);
        self.stream = None;
        let worker_id = self.slot.id;
        match order {
            Churn::Lapse => self.lapse(jobs).await,
            Churn::Deregister => {
                if let Err(status) = WorkersClient::new(self.channel.clone())
                    .deregister_worker(pb::DeregisterWorkerRequest { worker_id })
                    .await
                {
                    self.tally.status("DeregisterWorker", &status, false);
                }
            }
        }
        self.reference.remove_worker(worker_id);
        while jobs.try_recv().is_ok() {
            self.tally.shed();
        }
        if let Err(status) = self.start().await {
            self.tally.status("RegisterWorker", &status, false);
        }
    }

    /// Waits, without heartbeats, until the server forgot the worker; then
    /// heartbeats once as a returning engine would, which must be refused.
    async fn lapse(&mut self, jobs: &mut mpsc::Receiver<Job>) {
        let worker_id = self.slot.id;
        let mut admin = AdminClient::new(self.channel.clone());
        let deadline = Instant::now() + Duration::from_secs(u64::from(self.lease_secs) * 4 + 30);
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            while jobs.try_recv().is_ok() {
                self.tally.shed();
            }
            match admin.get_worker(pb::GetWorkerRequest { worker_id }).await {
                Ok(_) if Instant::now() < deadline => continue,
                Ok(_) => {
                    // Deregister so the server and the reference agree again.
                    self.tally.error("Lease", "NEVER_LAPSED", false);
                    let _ = WorkersClient::new(self.channel.clone())
                        .deregister_worker(pb::DeregisterWorkerRequest { worker_id })
                        .await;
                    return;
                }
                Err(status) => {
                    let designed = status.code() == tonic::Code::NotFound;
                    self.tally.status("GetWorker", &status, designed);
                    break;
                }
            }
        }
        match WorkersClient::new(self.channel.clone())
            .heartbeat(pb::HeartbeatRequest {
                worker_id,
                load: Vec::new(),
            })
            .await
        {
            Ok(_) => self.tally.error("Heartbeat", "OK_AFTER_LAPSE", false),
            Err(status) => {
                let designed = status.code() == tonic::Code::NotFound;
                self.tally.status("Heartbeat", &status, designed);
            }
        }
    }
}

/// Hands the trace's requests to the engines at `rate_x` times the trace's
/// pace, looping over it; a conversation stays on one worker while it is up.
async fn dispatch(
    trace: Arc<Trace>,
    slots: Vec<Arc<WorkerSlot>>,
    rate_x: f64,
    tally: Arc<Tally>,
    stop: CancellationToken,
) {
    let records = &trace.records;
    let span_ms = records.iter().map(|r| r.timestamp).max().unwrap_or(0) + 1000;
    let started = tokio::time::Instant::now();
    let workers = slots.len() as u64;
    let mut k: u64 = 0;
    loop {
        let n = records.len() as u64;
        let Some(record) = records.get((k % n) as usize) else {
            return;
        };
        let lap = k / n;
        let at_ms = (lap * span_ms + record.timestamp) as f64;
        let due = started
            + Duration::try_from_secs_f64(at_ms / 1000.0 / rate_x).unwrap_or(Duration::ZERO);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(due) => {}
        }
        let key = record
            .hash_ids
            .iter()
            .take(3)
            .fold(0u64, |acc, &h| mix(acc, h));
        let first = (key % workers) as usize;
        let mut job = Job {
            id: k,
            tokens: record.tokens(),
            output_length: record.output_length,
        };
        let mut placed = false;
        for j in 0..slots.len() {
            let slot = &slots[(first + j) % slots.len()];
            if !slot.is_up() {
                continue;
            }
            match slot.jobs.try_send(job) {
                Ok(()) => {
                    placed = true;
                    break;
                }
                Err(error) => job = error.into_inner(),
            }
        }
        if !placed {
            tally.shed();
        }
        k += 1;
    }
}

/// A frontend: books trace prompts, marks their prefill complete at once
/// and releases each after a few more bookings.
struct Frontend {
    index: usize,
    router: RouterClient<Channel>,
    prompts: Arc<Vec<Vec<u64>>>,
    trace: Arc<Trace>,
    tally: Arc<Tally>,
    tokens_every: u64,
}

impl Frontend {
    async fn run(mut self, period: Duration, stop: CancellationToken) {
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut booked: VecDeque<String> = VecDeque::new();
        let count = self.prompts.len().max(1);
        let mut n: u64 = 0;
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = ticker.tick() => {}
            }
            let i = (self.index * 7919 + n as usize * 31) % count;
            let content = match (self.tokens_every, self.trace.records.get(i)) {
                (every, Some(record)) if every > 0 && n.is_multiple_of(every) => {
                    pb::prompt::Content::TokenIds(pb::TokenIds {
                        ids: record.tokens(),
                    })
                }
                _ => pb::prompt::Content::BlockHashes(pb::BlockHashes {
                    hashes: self.prompts.get(i).cloned().unwrap_or_default(),
                }),
            };
            let request_id = format!("soak-{}-{n}", self.index);
            n += 1;
            let request = pb::SelectWorkerRequest {
                request_id: request_id.clone(),
                model: MODEL.into(),
                prompt: Some(pb::Prompt {
                    content: Some(content),
                }),
                mode: pb::SelectionMode::Reserve.into(),
                ..Default::default()
            };
            let started = Instant::now();
            match self.router.select_worker(request).await {
                Ok(_) => {
                    self.tally.latency(started.elapsed());
                    self.mark(&request_id).await;
                    booked.push_back(request_id);
                }
                Err(status) => self.tally.status("SelectWorker", &status, false),
            }
            while booked.len() > BOOKED_DEPTH {
                if let Some(id) = booked.pop_front() {
                    self.release(id).await;
                }
            }
        }
        for id in booked {
            self.release(id).await;
        }
    }

    async fn mark(&mut self, request_id: &str) {
        let request = pb::MarkPrefillCompleteRequest {
            request_id: request_id.to_string(),
            cached_tokens: None,
        };
        if let Err(status) = self.router.mark_prefill_complete(request).await {
            self.tally.status("MarkPrefillComplete", &status, false);
        }
    }

    async fn release(&mut self, request_id: String) {
        let request = pb::ReleaseRequestRequest {
            request_id,
            cached_tokens: None,
        };
        if let Err(status) = self.router.release_request(request).await {
            self.tally.status("ReleaseRequest", &status, false);
        }
    }
}

/// Every `period` one churn action on the next worker, in turn: cordon
/// (uncordoned half a period later), lease lapse, deregistration.
async fn churn(
    mut admin: AdminClient<Channel>,
    slots: Vec<Arc<WorkerSlot>>,
    orders: Vec<mpsc::Sender<Churn>>,
    period: Duration,
    tally: Arc<Tally>,
    stop: CancellationToken,
) {
    let mut tick: usize = 0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        let w = tick % slots.len().max(1);
        let (Some(slot), Some(order)) = (slots.get(w), orders.get(w)) else {
            return;
        };
        let worker_id = slot.id;
        match tick % 3 {
            0 => {
                // A worker the churn has away answers NOT_FOUND: designed.
                if let Err(status) = admin
                    .cordon_worker(pb::CordonWorkerRequest { worker_id })
                    .await
                {
                    tally.status("CordonWorker", &status, !slot.is_up());
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(period / 2) => {}
                }
                if let Err(status) = admin
                    .uncordon_worker(pb::UncordonWorkerRequest { worker_id })
                    .await
                {
                    tally.status("UncordonWorker", &status, !slot.is_up());
                }
            }
            1 => {
                let _ = order.try_send(Churn::Lapse);
            }
            _ => {
                let _ = order.try_send(Churn::Deregister);
            }
        }
        tick += 1;
    }
}

/// The end-of-run comparison of the server's index with the reference.
struct IndexCheck {
    server_blocks: u64,
    reference_blocks: u64,
    server_digest: u64,
    reference_digest: u64,
    mismatches: Vec<String>,
}

/// Deregisters every soak worker (NOT_FOUND for one already gone is fine).
async fn deregister_all(channel: &Channel, slots: &[Arc<WorkerSlot>]) {
    let mut workers = WorkersClient::new(channel.clone());
    for slot in slots {
        let _ = workers
            .deregister_worker(pb::DeregisterWorkerRequest { worker_id: slot.id })
            .await;
    }
}

async fn compare(
    channel: &Channel,
    slots: &[Arc<WorkerSlot>],
    reference: &KvIndex,
) -> Result<IndexCheck, BenchError> {
    let mut admin = AdminClient::new(channel.clone());
    let mut workers = WorkersClient::new(channel.clone());
    let mut mismatches = Vec::new();
    for slot in slots {
        let worker_id = slot.id;
        // Keep every lease alive while the check runs.
        let _ = workers
            .heartbeat(pb::HeartbeatRequest {
                worker_id,
                load: Vec::new(),
            })
            .await;
        let want = reference.worker_blocks(WorkerRank::new(worker_id, 0));
        match admin.get_worker(pb::GetWorkerRequest { worker_id }).await {
            Ok(info) => {
                let have: u64 = info
                    .into_inner()
                    .ranks
                    .iter()
                    .map(|r| r.cached_blocks)
                    .sum();
                if have != want {
                    mismatches.push(format!("worker {worker_id}: server {have} vs {want}"));
                }
            }
            Err(status) if status.code() == tonic::Code::NotFound && want == 0 => {}
            Err(status) => {
                mismatches.push(format!("worker {worker_id}: {}", status.message()));
            }
        }
    }
    let stats = admin
        .get_index_stats(pb::GetIndexStatsRequest {
            model: Some(MODEL.into()),
        })
        .await?
        .into_inner();
    let reference_stats = reference.stats();
    let digest = reference.digest();
    if stats.blocks != reference_stats.blocks {
        mismatches.push(format!(
            "blocks: server {} vs {}",
            stats.blocks, reference_stats.blocks
        ));
    }
    if stats.digest != digest.digest || stats.entries != digest.entries {
        mismatches.push(format!(
            "digest: server {:#x} ({} entries) vs {:#x} ({})",
            stats.digest, stats.entries, digest.digest, digest.entries
        ));
    }
    Ok(IndexCheck {
        server_blocks: stats.blocks,
        reference_blocks: reference_stats.blocks,
        server_digest: stats.digest,
        reference_digest: digest.digest,
        mismatches,
    })
}

/// The mean p99 (as `p99_of` reads it) of the first and of the last
/// [`P99_WINDOW`] intervals of `after`, and the relative rise between them.
fn p99_window_drift(
    after: &[IntervalReport],
    p99_of: impl Fn(&IntervalReport) -> Option<f64>,
) -> (Option<f64>, Option<f64>, Option<f64>) {
    if after.len() < 2 {
        return (None, None, None);
    }
    let mean = |window: &[IntervalReport]| {
        let values: Vec<f64> = window.iter().filter_map(&p99_of).collect();
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
    };
    let window = P99_WINDOW.min(after.len() / 2).max(1);
    let first = mean(&after[..window]);
    let last = mean(&after[after.len() - window..]);
    (first, last, rise(first, last))
}

/// `last` over `first`, minus 1, when both are known and `first` is positive.
fn rise(first: Option<f64>, last: Option<f64>) -> Option<f64> {
    match (first, last) {
        (Some(first), Some(last)) if first > 0.0 => Some(last / first - 1.0),
        _ => None,
    }
}

/// The verdict. Warm-up is the first `warmup` intervals (the index fills).
/// Memory is flat when the mean of the last third of the interval medians
/// after warm-up is within 5 % of the middle third's: a leak keeps growing
/// to the end, while pools and maps that grow to the run's peaks (the heap
/// rose 11 % over the 4 minutes after a 3-minute warm-up, then held for the
/// rest of a 30-minute run) settle in the first third. p99 drift compares
/// the mean p99 of the last three intervals with the first three after
/// warm-up, as the server timed SelectWorker when that is known for every
/// interval after warm-up (`crate::bench::histogram` says why), else as the
/// clients saw it.
/// A check without enough intervals is not judged (None) and does not fail
/// the run.
fn judge(
    intervals: &[IntervalReport],
    warmup: usize,
    designed_errors: BTreeMap<String, u64>,
    unexpected_errors: BTreeMap<String, u64>,
    check: IndexCheck,
) -> SoakVerdict {
    let after = intervals.get(warmup..).unwrap_or_default();
    let (rss_middle_bytes, rss_last_bytes, rss_growth) =
        thirds_growth(after, |r| r.rss_median_bytes);
    let (heap_middle_bytes, heap_last_bytes, heap_growth) =
        thirds_growth(after, |r| r.heap_median_bytes);
    let rss_peak_bytes = after.iter().filter_map(|r| r.rss_peak_bytes).max();
    let heap_counted = !after.is_empty() && after.iter().all(|r| r.heap_median_bytes.is_some());
    let (memory_source, growth) = if heap_counted {
        ("heap", heap_growth)
    } else {
        ("rss", rss_growth)
    };
    let memory_flat = growth.map(|g| g <= MEMORY_TOLERANCE);
    let server_p99 = |r: &IntervalReport| r.server_select.map(|s| s.p99_us);
    let client_p99 = |r: &IntervalReport| (r.select_calls > 0).then_some(r.select.p99_us);
    let client_drift = p99_window_drift(after, client_p99);
    let server_timed = !after.is_empty() && after.iter().all(|r| server_p99(r).is_some());
    let (p99_source, (p99_first_us, p99_last_us, p99_drift)) = if server_timed {
        ("server", p99_window_drift(after, server_p99))
    } else {
        ("client", client_drift)
    };
    // Only a rise fails: a p99 that fell is no regression (it is printed).
    let p99_stable = p99_drift.map(|d| d <= P99_TOLERANCE);
    let index_exact = check.mismatches.is_empty();
    let pass = index_exact
        && unexpected_errors.is_empty()
        && memory_flat != Some(false)
        && p99_stable != Some(false);
    SoakVerdict {
        bench: "soak-verdict",
        intervals: intervals.len(),
        warmup_intervals: warmup,
        rss_middle_bytes,
        rss_last_bytes,
        rss_growth,
        rss_peak_bytes,
        heap_middle_bytes,
        heap_last_bytes,
        heap_growth,
        memory_source,
        memory_flat,
        heap_before_bytes: None,
        heap_after_bytes: None,
        heap_left_bytes: None,
        heap_returned: None,
        p99_source,
        p99_first_us,
        p99_last_us,
        p99_drift,
        p99_stable,
        client_p99_drift: client_drift.2,
        designed_errors,
        unexpected_errors,
        server_blocks: check.server_blocks,
        reference_blocks: check.reference_blocks,
        server_digest: check.server_digest,
        reference_digest: check.reference_digest,
        index_mismatches: check.mismatches,
        index_exact,
        pass,
    }
}

/// The means of `of` over the middle and the last third of `after` (at
/// least one interval each), and the growth from one to the other; `None`
/// with fewer than three intervals or a value missing.
fn thirds_growth(
    after: &[IntervalReport],
    of: impl Fn(&IntervalReport) -> Option<u64>,
) -> (Option<u64>, Option<u64>, Option<f64>) {
    let third = after.len() / 3;
    if third == 0 {
        return (None, None, None);
    }
    let mean = |part: &[IntervalReport]| -> Option<u64> {
        let values: Option<Vec<u64>> = part.iter().map(&of).collect();
        let values = values?;
        Some(values.iter().sum::<u64>() / values.len() as u64)
    };
    let middle = mean(&after[third..2 * third]);
    let last = mean(&after[after.len() - third..]);
    let as_f64 = |bytes: Option<u64>| bytes.map(|b| b as f64);
    (middle, last, rise(as_f64(middle), as_f64(last)))
}

impl SoakVerdict {
    /// Judges what the run left on the heap once its workers were gone; a
    /// check without both readings is not judged and does not fail.
    fn judge_heap_left(&mut self, before: Option<u64>, after: Option<u64>) {
        self.heap_before_bytes = before;
        self.heap_after_bytes = after;
        self.heap_left_bytes = match (before, after) {
            (Some(b), Some(a)) => Some(a as i64 - b as i64),
            _ => None,
        };
        self.heap_returned = self.heap_left_bytes.map(|left| left <= HEAP_LEFT_TOLERANCE);
        self.pass &= self.heap_returned != Some(false);
    }
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or_else(
        || "?".into(),
        |b| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0)),
    )
}

fn percent(fraction: Option<f64>) -> String {
    fraction.map_or_else(|| "?".into(), |f| format!("{:+.1}%", f * 100.0))
}

fn errors_line(errors: &BTreeMap<String, u64>) -> String {
    if errors.is_empty() {
        return "none".into();
    }
    errors
        .iter()
        .map(|(k, v)| format!("{k} x{v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn human(r: &IntervalReport) -> String {
    format!(
        "soak {:>3} ({:.0}s): rss median {} (peak {}), heap median {} (peak {}), SelectWorker p50 {:.0}us p99 {:.0}us ({} calls; server: {}), {} events applied, index {} blocks, shed {}; designed errors: {}; unexpected: {}",
        r.interval,
        r.elapsed_s,
        mib(r.rss_median_bytes),
        mib(r.rss_peak_bytes),
        mib(r.heap_median_bytes),
        mib(r.heap_peak_bytes),
        r.select.p50_us,
        r.select.p99_us,
        r.select_calls,
        r.server_select.map_or_else(
            || "?".into(),
            |s| format!("mean {:.0}us p99 {:.0}us", s.mean_us, s.p99_us)
        ),
        r.events_applied,
        r.index_blocks,
        r.requests_shed,
        errors_line(&r.designed_errors),
        errors_line(&r.unexpected_errors),
    )
}

fn human_verdict(v: &SoakVerdict) -> String {
    let judged = |x: Option<bool>| match x {
        Some(true) => "ok",
        Some(false) => "FAIL",
        None => "not judged",
    };
    format!(
        "soak verdict: {}. memory {} on {} (heap, middle third -> last third: {} -> {}, {}; rss: {} -> {}, {}; rss peak sample {}); heap left after the run {} ({} -> {}); p99 {} ({}: {} -> {}, drift {}; clients' drift {}); unexpected errors {} ({}); index {} (server {} blocks, replay {}{})",
        if v.pass { "PASS" } else { "FAIL" },
        judged(v.memory_flat),
        v.memory_source,
        mib(v.heap_middle_bytes),
        mib(v.heap_last_bytes),
        percent(v.heap_growth),
        mib(v.rss_middle_bytes),
        mib(v.rss_last_bytes),
        percent(v.rss_growth),
        mib(v.rss_peak_bytes),
        judged(v.heap_returned),
        mib(v.heap_before_bytes),
        mib(v.heap_after_bytes),
        judged(v.p99_stable),
        v.p99_source,
        v.p99_first_us
            .map_or_else(|| "?".into(), |p| format!("{p:.0}us")),
        v.p99_last_us
            .map_or_else(|| "?".into(), |p| format!("{p:.0}us")),
        percent(v.p99_drift),
        percent(v.client_p99_drift),
        if v.unexpected_errors.is_empty() {
            "none"
        } else {
            "FAIL"
        },
        errors_line(&v.unexpected_errors),
        if v.index_exact { "exact" } else { "MISMATCH" },
        v.server_blocks,
        v.reference_blocks,
        if v.index_mismatches.is_empty() {
            String::new()
        } else {
            format!("; {}", v.index_mismatches.join("; "))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interval(n: usize, rss: u64, p99: f64) -> IntervalReport {
        IntervalReport {
            bench: "soak",
            interval: n,
            elapsed_s: n as f64,
            rss_median_bytes: Some(rss),
            rss_peak_bytes: Some(rss + rss / 5),
            rss_samples: 60,
            heap_median_bytes: None,
            heap_peak_bytes: None,
            select_calls: 100,
            select: Latency {
                p50_us: p99 / 2.0,
                p99_us: p99,
                max_us: p99,
            },
            server_select: None,
            events_applied: 0,
            events_accepted: 0,
            index_blocks: 0,
            index_memory_bytes: 0,
            requests_shed: 0,
            designed_errors: BTreeMap::new(),
            unexpected_errors: BTreeMap::new(),
        }
    }

    fn exact() -> IndexCheck {
        IndexCheck {
            server_blocks: 1,
            reference_blocks: 1,
            server_digest: 2,
            reference_digest: 2,
            mismatches: Vec::new(),
        }
    }

    #[test]
    fn warm_up_growth_is_ignored_and_later_growth_fails() {
        // Memory doubles during warm-up, then stays: flat.
        let flat: Vec<_> = [100, 200, 300, 300, 305, 310, 300]
            .iter()
            .enumerate()
            .map(|(i, &m)| interval(i + 1, m, 1000.0))
            .collect();
        let v = judge(&flat, 3, BTreeMap::new(), BTreeMap::new(), exact());
        assert_eq!(v.memory_flat, Some(true));
        assert!(v.pass);
        // 10 % more after warm-up: a leak.
        let leak: Vec<_> = [100, 200, 300, 300, 310, 320, 330]
            .iter()
            .enumerate()
            .map(|(i, &m)| interval(i + 1, m, 1000.0))
            .collect();
        let v = judge(&leak, 3, BTreeMap::new(), BTreeMap::new(), exact());
        assert_eq!(v.memory_flat, Some(false));
        assert!(!v.pass);
    }

    #[test]
    fn p99_drift_and_unexpected_errors_fail() {
        let drift: Vec<_> = [1000.0, 1000.0, 1000.0, 1100.0, 1300.0, 1400.0]
            .iter()
            .enumerate()
            .map(|(i, &p)| interval(i + 1, 100, p))
            .collect();
        let v = judge(&drift, 0, BTreeMap::new(), BTreeMap::new(), exact());
        assert_eq!(v.p99_stable, Some(false));
        let steady: Vec<_> = (1..=6).map(|i| interval(i, 100, 1000.0)).collect();
        let errors = BTreeMap::from([("SelectWorker UNAVAILABLE".to_string(), 1)]);
        let v = judge(&steady, 0, BTreeMap::new(), errors, exact());
        assert_eq!(v.p99_stable, Some(true));
        assert!(!v.pass);
        let designed = BTreeMap::from([("Heartbeat NOT_FOUND".to_string(), 3)]);
        let v = judge(&steady, 0, designed, BTreeMap::new(), exact());
        assert!(v.pass);
    }

    #[test]
    fn the_servers_timing_is_judged_when_every_interval_has_it() {
        // The clients' p99 doubles (the machine got busy); the server's
        // own stays put: stable, judged on the server's figure.
        let mut noisy: Vec<_> = [1000.0, 1000.0, 1000.0, 2000.0, 2000.0, 2000.0]
            .iter()
            .enumerate()
            .map(|(i, &p)| interval(i + 1, 100, p))
            .collect();
        for r in &mut noisy {
            r.server_select = Some(ServerLatency {
                calls: 100,
                mean_us: 100.0,
                p99_us: 300.0,
            });
        }
        let v = judge(&noisy, 0, BTreeMap::new(), BTreeMap::new(), exact());
        assert_eq!((v.p99_source, v.p99_stable), ("server", Some(true)));
        assert!((v.client_p99_drift.unwrap() - 1.0).abs() < 1e-9);
        // The server slowing down fails it.
        for r in &mut noisy[3..] {
            r.server_select = Some(ServerLatency {
                calls: 100,
                mean_us: 150.0,
                p99_us: 400.0,
            });
        }
        let v = judge(&noisy, 0, BTreeMap::new(), BTreeMap::new(), exact());
        assert_eq!(v.p99_stable, Some(false));
        // One interval without the server's figure: the clients' is judged.
        noisy[4].server_select = None;
        let v = judge(&noisy, 0, BTreeMap::new(), BTreeMap::new(), exact());
        assert_eq!((v.p99_source, v.p99_stable), ("client", Some(false)));
    }

    #[test]
    fn growth_that_settles_is_flat_and_growth_to_the_end_is_not() {
        let run = |medians: &[u64]| {
            let intervals: Vec<_> = medians
                .iter()
                .enumerate()
                .map(|(i, &m)| interval(i + 1, m, 1000.0))
                .collect();
            judge(&intervals, 0, BTreeMap::new(), BTreeMap::new(), exact())
        };
        // Up 11 % in the first third, then level: pools at their peak.
        let settled = run(&[1000, 1080, 1110, 1105, 1110, 1100, 1108, 1112, 1104]);
        assert_eq!(settled.memory_flat, Some(true));
        // 2 % more every interval: a leak, though no single step is large.
        let leak: Vec<u64> = (0..9).map(|i| 1000 + 20 * i).collect();
        let leaking = run(&leak);
        assert_eq!(
            (leaking.rss_middle_bytes, leaking.rss_last_bytes),
            (Some(1080), Some(1140))
        );
        assert_eq!(leaking.memory_flat, Some(false));
    }

    #[test]
    fn the_heap_is_judged_when_every_interval_counts_it() {
        // RSS climbs 20 % (the allocator keeps pages) while the heap stays
        // flat: flat, judged on the heap.
        let mut kept: Vec<_> = [100, 100, 100, 120]
            .iter()
            .enumerate()
            .map(|(i, &m)| interval(i + 1, m, 1000.0))
            .collect();
        for r in &mut kept {
            r.heap_median_bytes = Some(50);
        }
        let v = judge(&kept, 1, BTreeMap::new(), BTreeMap::new(), exact());
        assert_eq!((v.memory_source, v.memory_flat), ("heap", Some(true)));
        assert!(v.rss_growth.unwrap() > 0.19 && v.pass);
        // The heap growing 10 % fails it.
        kept[3].heap_median_bytes = Some(55);
        let v = judge(&kept, 1, BTreeMap::new(), BTreeMap::new(), exact());
        assert_eq!(v.memory_flat, Some(false));
        // One interval without the heap: RSS is judged (and fails).
        kept[3].heap_median_bytes = None;
        let v = judge(&kept, 1, BTreeMap::new(), BTreeMap::new(), exact());
        assert_eq!((v.memory_source, v.memory_flat), ("rss", Some(false)));
    }

    #[test]
    fn heap_left_after_the_run_fails_past_the_tolerance() {
        let steady: Vec<_> = (1..=4).map(|i| interval(i, 100, 1000.0)).collect();
        let mut v = judge(&steady, 0, BTreeMap::new(), BTreeMap::new(), exact());
        v.judge_heap_left(Some(10 << 20), Some(11 << 20));
        assert_eq!(
            (v.heap_left_bytes, v.heap_returned),
            (Some(1 << 20), Some(true))
        );
        assert!(v.pass);
        v.judge_heap_left(Some(10 << 20), Some(13 << 20));
        assert_eq!(v.heap_returned, Some(false));
        assert!(!v.pass);
        let mut v = judge(&steady, 0, BTreeMap::new(), BTreeMap::new(), exact());
        v.judge_heap_left(None, Some(13 << 20));
        assert_eq!((v.heap_left_bytes, v.heap_returned), (None, None));
        assert!(v.pass);
    }

    #[test]
    fn gauges_are_read_by_their_exact_name() {
        let text = "kvroute_heap_allocated_bytes_total 9\nkvroute_heap_allocated_bytes 1234\nprocess_resident_memory_bytes 5e3\n";
        assert_eq!(gauge(text, "kvroute_heap_allocated_bytes"), Some(1234));
        assert_eq!(gauge(text, "process_resident_memory_bytes"), Some(5000));
        assert_eq!(gauge(text, "missing"), None);
        assert_eq!(gauge("x NaN\n", "x"), None);
    }

    #[test]
    fn too_short_a_run_is_not_judged() {
        let one = vec![interval(1, 100, 1000.0)];
        let v = judge(&one, 3, BTreeMap::new(), BTreeMap::new(), exact());
        assert_eq!((v.memory_flat, v.p99_stable), (None, None));
        assert!(v.pass);
    }
}
