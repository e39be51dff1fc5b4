//! Prometheus metrics: created once at start-up, handed to every area that
//! counts something, served as text at `GET /metrics` on the metrics address.
//!
//! Label values come only from fixed sets (known RPC paths, gRPC code names,
//! fixed reason strings) so untrusted input can never grow the label space.
//! The one exception is the `worker` label of the `engine_event_*` families:
//! a registered worker's id, whose series are removed when its subscription
//! stops (`subscriptions`).

use std::{sync::Arc, time::Duration};

use prometheus::{
    Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric family kvroute exports.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    pub rpc_requests: IntCounterVec,
    pub rpc_duration: HistogramVec,
    pub decisions: IntCounterVec,
    pub overlap_ratio: HistogramVec,
    pub queue_depth: IntGauge,
    pub queue_wait: HistogramVec,
    pub bookings_active: IntGauge,
    pub bookings_expired: IntCounter,
    pub workers: IntGaugeVec,
    pub leases_expired: IntCounter,
    pub events: IntCounterVec,
    pub index_blocks: IntGauge,
    pub index_bytes: IntGauge,
    pub predicted_blocks: IntGauge,
    pub worker_trust_changes: IntCounterVec,
    pub cached_tokens_reports: IntCounterVec,
    pub cached_tokens_error: HistogramVec,
    pub workers_untrusted: IntGauge,
    pub event_streams: IntGauge,
    pub input_rejected: IntCounterVec,
    pub engine: EngineEventFamilies,
    pub snapshot: SnapshotFamilies,
    /// Cluster mode (`--nats-url`): the shared log, bookings, leases.
    pub cluster: ClusterFamilies,
    /// `source`: grpc (events applied by batches answering a resend). An
    /// engine's catch-up is `engine_event_replayed_batches_total{worker}`.
    pub catchup_events: IntCounterVec,
    /// TLS, authentication and roles (`crate::security`).
    pub security: SecurityFamilies,
}

/// Engine-native KV event subscriptions, per worker (`subscriptions`).
#[derive(Clone)]
pub struct EngineEventFamilies {
    /// `worker`
    pub batches: IntCounterVec,
    /// `worker`, `kind` (stored, removed, cleared)
    pub events: IntCounterVec,
    /// `worker`, `reason` (other_medium, other_group, index_rejected)
    pub ignored: IntCounterVec,
    /// `worker`: batches stamped with another dp rank than the socket's
    /// (still applied to the socket's rank)
    pub rank_mismatch: IntCounterVec,
    /// `worker`
    pub gaps: IntCounterVec,
    /// `worker`
    pub batches_lost: IntCounterVec,
    /// `worker`, `outcome` (requested, failed)
    pub replays: IntCounterVec,
    /// `worker`
    pub replayed_batches: IntCounterVec,
    /// `worker`
    pub restarts: IntCounterVec,
    /// `worker`, `reason` (duplicate, jump)
    pub skipped_batches: IntCounterVec,
    /// `worker`: dp ranks whose index may differ from the engine's cache
    pub unsynced_ranks: IntGaugeVec,
    /// `worker`, `reason` (`DecodeReason::label`)
    pub decode_errors: IntCounterVec,
    /// `worker`, `event` (connected, disconnected, failed)
    pub connections: IntCounterVec,
    /// `worker`
    pub connected_ranks: IntGaugeVec,
    /// `worker`; absent before the first batch
    pub last_event_age: GaugeVec,
    /// Which workers have series of their own (`None` in the shadow).
    series: Option<Arc<SeriesBudget>>,
}

/// At most `cap` workers get engine-event series: each one adds about 30,
/// and a fleet of engines must not grow the scrape without bound. Workers
/// past the cap count in `shadow`, the same families in a registry nobody
/// scrapes, so `GetWorker` still reads their own counters; how many there
/// are is `engine_event_workers_without_series`.
struct SeriesBudget {
    cap: std::sync::atomic::AtomicUsize,
    workers: parking_lot::Mutex<SeriesWorkers>,
    shadow: EngineEventFamilies,
    without_series: IntGauge,
}

/// Which workers' series are exported, and which count in the shadow.
#[derive(Default)]
struct SeriesWorkers {
    exported: std::collections::HashSet<kvroute_core::types::WorkerId>,
    without: std::collections::HashSet<kvroute_core::types::WorkerId>,
}

/// Default of `--max-engine-metric-workers`.
pub const DEFAULT_ENGINE_SERIES_WORKERS: usize = 64;

impl EngineEventFamilies {
    /// Most workers with series of their own.
    pub fn set_series_cap(&self, cap: usize) {
        if let Some(series) = &self.series {
            series.cap.store(cap, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The families `worker_id`'s counters go to: these while it has (or
    /// can get) series of its own, the unscraped shadow past the cap.
    pub fn families_for(&self, worker_id: kvroute_core::types::WorkerId) -> &EngineEventFamilies {
        let Some(series) = &self.series else {
            return self;
        };
        let cap = series.cap.load(std::sync::atomic::Ordering::Relaxed);
        let mut workers = series.workers.lock();
        if workers.exported.contains(&worker_id) || workers.exported.len() < cap {
            workers.exported.insert(worker_id);
            return self;
        }
        workers.without.insert(worker_id);
        series.without_series.set(workers.without.len() as i64);
        &series.shadow
    }

    /// Forgets `worker_id` (its subscription stopped): the families its
    /// series were in, so the caller removes them there.
    pub fn release(&self, worker_id: kvroute_core::types::WorkerId) -> &EngineEventFamilies {
        let Some(series) = &self.series else {
            return self;
        };
        let mut workers = series.workers.lock();
        if workers.exported.remove(&worker_id) {
            return self;
        }
        workers.without.remove(&worker_id);
        series.without_series.set(workers.without.len() as i64);
        &series.shadow
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

impl Metrics {
    /// Creates and registers every family. Registration of fixed, distinct
    /// names cannot collide, so failures here are programming errors; they are
    /// reported rather than panicking.
    pub fn new() -> Result<Arc<Self>, prometheus::Error> {
        let registry = Registry::new_custom(Some("kvroute".into()), None)?;
        Ok(Arc::new(Self {
            rpc_requests: registered(
                &registry,
                IntCounterVec::new(
                    Opts::new("rpc_requests_total", "gRPC calls by method and status code"),
                    &["method", "code"],
                )?,
            )?,
            rpc_duration: registered(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "rpc_duration_seconds",
                        "gRPC call latency to response headers (whole call for unary RPCs)",
                    )
                    .buckets(LATENCY_BUCKETS.to_vec()),
                    &["method", "code"],
                )?,
            )?,
            decisions: registered(
                &registry,
                IntCounterVec::new(
                    Opts::new("routing_decisions_total", "SelectWorker outcomes"),
                    &["outcome"],
                )?,
            )?,
            overlap_ratio: registered(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "routing_overlap_ratio",
                        "Cached share of the prompt's blocks on the chosen worker",
                    )
                    .buckets(vec![0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]),
                    &["mode"],
                )?,
            )?,
            queue_depth: registered(
                &registry,
                IntGauge::new(
                    "admission_queue_depth",
                    "SelectWorker calls waiting for a free worker",
                )?,
            )?,
            queue_wait: registered(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "admission_queue_wait_seconds",
                        "Time queued before an answer",
                    )
                    .buckets(LATENCY_BUCKETS.to_vec()),
                    &["outcome"],
                )?,
            )?,
            bookings_active: registered(
                &registry,
                IntGauge::new(
                    "bookings_active",
                    "Requests with booked load not yet released",
                )?,
            )?,
            bookings_expired: registered(
                &registry,
                IntCounter::new(
                    "bookings_expired_total",
                    "Bookings dropped because they were never released",
                )?,
            )?,
            workers: registered(
                &registry,
                IntGaugeVec::new(
                    Opts::new("workers", "Registered workers by state"),
                    &["state"],
                )?,
            )?,
            leases_expired: registered(
                &registry,
                IntCounter::new(
                    "leases_expired_total",
                    "Workers removed because their lease lapsed",
                )?,
            )?,
            events: registered(
                &registry,
                IntCounterVec::new(
                    Opts::new("kv_events_total", "KV events by outcome and reason"),
                    &["outcome", "reason"],
                )?,
            )?,
            index_blocks: registered(
                &registry,
                IntGauge::new(
                    "index_blocks",
                    "Cached (block, worker rank) entries in the index",
                )?,
            )?,
            index_bytes: registered(
                &registry,
                IntGauge::new("index_memory_bytes", "Estimated bytes used by the index")?,
            )?,
            predicted_blocks: registered(
                &registry,
                IntGauge::new(
                    "predicted_blocks",
                    "Predicted (block, worker rank) entries of workers without KV events",
                )?,
            )?,
            worker_trust_changes: registered(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "worker_trust_changes_total",
                        "Exact workers whose KV events stopped (downgraded) or started again (recovered) being trusted, by reason",
                    ),
                    &["change", "reason"],
                )?,
            )?,
            cached_tokens_reports: registered(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "cached_tokens_reports_total",
                        "Engine-reported cached tokens passed back, by outcome (recorded, unknown request, implausible)",
                    ),
                    &["outcome"],
                )?,
            )?,
            cached_tokens_error: registered(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "cached_tokens_error_tokens",
                        "Cached tokens kvroute scored a request with minus what its engine reported, by worker (the first 64 to report; the rest as other) and the view scored",
                    )
                    .buckets(vec![
                        -4096.0, -1024.0, -256.0, -64.0, -16.0, -0.5, 0.5, 16.0, 64.0, 256.0,
                        1024.0, 4096.0,
                    ]),
                    &["worker", "view"],
                )?,
            )?,
            workers_untrusted: registered(
                &registry,
                IntGauge::new(
                    "workers_untrusted",
                    "Exact workers scored on their index blended with predictions",
                )?,
            )?,
            event_streams: registered(
                &registry,
                IntGauge::new("event_streams", "Open PublishEvents streams")?,
            )?,
            input_rejected: registered(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "input_rejected_total",
                        "Requests refused for bad input, by RPC area and reason",
                    ),
                    &["area", "reason"],
                )?,
            )?,
            engine: EngineEventFamilies::register(&registry)?,
            snapshot: SnapshotFamilies::register(&registry)?,
            cluster: ClusterFamilies::register(&registry)?,
            security: SecurityFamilies::register(&registry)?,
            catchup_events: registered(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "catchup_events_total",
                        "Events applied while catching up after a gap or a restart, by source",
                    ),
                    &["source"],
                )?,
            )?,
            registry,
        }))
    }

    /// The text exposition of every family, then the process's resident
    /// memory under its conventional (unprefixed) name.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        let encoder = TextEncoder::new();
        if let Err(error) = encoder.encode(&self.registry.gather(), &mut buffer) {
            tracing::warn!(%error, "metrics encoding failed");
        }
        let mut text = String::from_utf8_lossy(&buffer).into_owned();
        if let Some(bytes) = resident_memory_bytes() {
            text.push_str(
                "# HELP process_resident_memory_bytes Resident memory size in bytes.\n\
                 # TYPE process_resident_memory_bytes gauge\n",
            );
            text.push_str(&format!("process_resident_memory_bytes {bytes}\n"));
        }
        if let Some(bytes) = heap_allocated_bytes() {
            text.push_str(
                "# HELP kvroute_heap_allocated_bytes Heap bytes allocated and not yet freed \
                 (resident memory also holds freed pages the allocator keeps, code and stacks).\n\
                 # TYPE kvroute_heap_allocated_bytes gauge\n",
            );
            text.push_str(&format!("kvroute_heap_allocated_bytes {bytes}\n"));
        }
        text
    }

    /// Records one finished RPC.
    pub fn observe_rpc(&self, method: &str, code: &str, elapsed: Duration) {
        self.rpc_requests.with_label_values(&[method, code]).inc();
        self.rpc_duration
            .with_label_values(&[method, code])
            .observe(elapsed.as_secs_f64());
    }
}

/// How the heap's allocated bytes are read: the binary's counting global
/// allocator, installed by `main` (a library cannot see it). Unset in tests
/// and embedders, where the gauge is absent.
static HEAP_ALLOCATED: std::sync::OnceLock<fn() -> u64> = std::sync::OnceLock::new();

/// Installs the reader of the heap's allocated bytes (first call wins).
pub fn count_heap_with(reader: fn() -> u64) {
    let _ = HEAP_ALLOCATED.set(reader);
}

/// Heap bytes allocated and not yet freed, if the binary counts them. A leak
/// grows this; pages the allocator keeps after a burst grow only the
/// resident memory.
pub fn heap_allocated_bytes() -> Option<u64> {
    HEAP_ALLOCATED.get().map(|read| read())
}

/// This process's resident memory (VmRSS), where /proc tells it (Linux).
/// `/metrics` exports it; `kvroute bench soak` prints it and judges by it
/// only where the heap is not counted.
pub fn resident_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Registers `collector` in `registry` and returns it (a handle to the same
/// series).
fn registered<C>(registry: &Registry, collector: C) -> Result<C, prometheus::Error>
where
    C: prometheus::core::Collector + Clone + 'static,
{
    registry.register(Box::new(collector.clone()))?;
    Ok(collector)
}

impl EngineEventFamilies {
    /// Creates the engine-event families and registers them in `registry`,
    /// with their cap of workers with series.
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let mut families = Self::families(registry)?;
        families.series = Some(Arc::new(SeriesBudget {
            cap: std::sync::atomic::AtomicUsize::new(DEFAULT_ENGINE_SERIES_WORKERS),
            workers: Default::default(),
            shadow: Self::families(&Registry::new())?,
            without_series: registered(
                registry,
                IntGauge::new(
                    "engine_event_workers_without_series",
                    "Engine-subscribed workers past --max-engine-metric-workers: counted, not exported",
                )?,
            )?,
        }));
        Ok(families)
    }

    fn families(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            batches: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_event_batches_total",
                        "Engine KV event batches admitted (live or replayed), per worker",
                    ),
                    &["worker"],
                )?,
            )?,
            events: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_events_total",
                        "Engine KV events decoded, per worker and kind",
                    ),
                    &["worker", "kind"],
                )?,
            )?,
            ignored: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_events_ignored_total",
                        "Engine KV events not routed on, per worker and reason",
                    ),
                    &["worker", "reason"],
                )?,
            )?,
            rank_mismatch: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_event_rank_mismatch_total",
                        "Engine batches stamped with another dp rank than their socket's",
                    ),
                    &["worker"],
                )?,
            )?,
            gaps: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_event_gaps_total",
                        "Sequence gaps seen on an engine's live stream",
                    ),
                    &["worker"],
                )?,
            )?,
            batches_lost: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_event_batches_lost_total",
                        "Engine batches neither received live nor replayed",
                    ),
                    &["worker"],
                )?,
            )?,
            replays: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_event_replays_total",
                        "Replay requests to an engine's replay socket, by outcome",
                    ),
                    &["worker", "outcome"],
                )?,
            )?,
            replayed_batches: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_event_replayed_batches_total",
                        "Batches received through an engine's replay socket",
                    ),
                    &["worker"],
                )?,
            )?,
            restarts: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_event_restarts_total",
                        "Engine restarts detected (sequence back to near zero, or far back on a new connection); the rank was cleared",
                    ),
                    &["worker"],
                )?,
            )?,
            skipped_batches: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_event_skipped_batches_total",
                        "Engine batches not applied: already applied (duplicate) or an absurd sequence jump",
                    ),
                    &["worker", "reason"],
                )?,
            )?,
            unsynced_ranks: registered(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "engine_event_unsynced_ranks",
                        "Dp ranks whose blocks may differ from the engine's cache (lost batches, a sequence jump) until it reports AllBlocksCleared",
                    ),
                    &["worker"],
                )?,
            )?,
            decode_errors: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_event_decode_errors_total",
                        "Malformed engine frames, payloads or events skipped, by reason",
                    ),
                    &["worker", "reason"],
                )?,
            )?,
            connections: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "engine_event_connections_total",
                        "Engine event socket connects, disconnects and failed connects",
                    ),
                    &["worker", "event"],
                )?,
            )?,
            connected_ranks: registered(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "engine_event_connected_ranks",
                        "Dp ranks whose engine event socket is connected",
                    ),
                    &["worker"],
                )?,
            )?,
            last_event_age: registered(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "engine_event_last_age_seconds",
                        "Seconds since the worker's engine last sent a batch",
                    ),
                    &["worker"],
                )?,
            )?,
            series: None,
        })
    }
}

/// Durable state (`snapshot`): what was written and loaded, and how long
/// it took.
#[derive(Clone)]
pub struct SnapshotFamilies {
    /// `outcome`: written, write_failed, loaded, set_aside
    pub outcomes: IntCounterVec,
    /// Seconds since the last snapshot written or loaded.
    pub age: Gauge,
    /// Bytes and cached entries of the last snapshot written.
    pub bytes: IntGauge,
    pub entries: IntGauge,
    /// Seconds the last snapshot took to capture and to write.
    pub capture_seconds: Gauge,
    pub write_seconds: Gauge,
    /// Seconds the snapshot loaded at start took, and the entries it restored.
    pub load_seconds: Gauge,
    pub entries_restored: IntGauge,
}

impl SnapshotFamilies {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let gauge = |name: &str, help: &str| registered(registry, Gauge::new(name, help)?);
        let int_gauge = |name: &str, help: &str| registered(registry, IntGauge::new(name, help)?);
        Ok(Self {
            outcomes: registered(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "snapshots_total",
                        "Snapshots written, failed, loaded and set aside",
                    ),
                    &["outcome"],
                )?,
            )?,
            age: gauge(
                "snapshot_age_seconds",
                "Seconds since the last snapshot written or loaded",
            )?,
            bytes: int_gauge("snapshot_bytes", "Bytes of the last snapshot written")?,
            entries: int_gauge(
                "snapshot_entries",
                "Cached entries in the last snapshot written",
            )?,
            capture_seconds: gauge(
                "snapshot_capture_seconds",
                "Seconds the last snapshot took to capture",
            )?,
            write_seconds: gauge(
                "snapshot_write_seconds",
                "Seconds the last snapshot took to encode and write",
            )?,
            load_seconds: gauge(
                "snapshot_load_seconds",
                "Seconds the snapshot loaded at start took",
            )?,
            entries_restored: int_gauge(
                "snapshot_entries_restored",
                "Cached entries restored from the snapshot loaded at start",
            )?,
        })
    }
}

/// TLS, authentication and roles (`crate::security`).
#[derive(Clone)]
pub struct SecurityFamilies {
    /// `method` (a known RPC path or `unknown`), `role` (the role the method
    /// needs), `outcome` (allowed, unauthenticated, denied)
    pub auth_decisions: IntCounterVec,
    /// `outcome` (applied, failed): certificate files that changed
    pub tls_reloads: IntCounterVec,
    /// `port` (grpc, metrics)
    pub tls_handshake_failures: IntCounterVec,
    /// RegisterWorker `events_endpoint`s refused by `--engine-endpoint-allow`
    pub endpoints_refused: IntCounter,
}

impl SecurityFamilies {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            registered(registry, IntCounterVec::new(Opts::new(name, help), labels)?)
        };
        Ok(Self {
            auth_decisions: counter_vec(
                "auth_decisions_total",
                "Calls checked against the auth policy, by method, role needed and outcome",
                &["method", "role", "outcome"],
            )?,
            tls_reloads: counter_vec(
                "tls_reloads_total",
                "Changed TLS certificate files, by whether they loaded",
                &["outcome"],
            )?,
            tls_handshake_failures: counter_vec(
                "tls_handshake_failures_total",
                "TLS handshakes that failed or timed out, by port",
                &["port"],
            )?,
            endpoints_refused: registered(
                registry,
                IntCounter::new(
                    "engine_endpoints_refused_total",
                    "RegisterWorker events endpoints outside --engine-endpoint-allow",
                )?,
            )?,
        })
    }
}

/// Cluster mode's families (`crate::cluster`).
#[derive(Clone)]
pub struct ClusterFamilies {
    /// `outcome`: appended, duplicate, failed
    pub log_appends: IntCounterVec,
    /// Log records applied, by `kind` (register, deregister, lapsed,
    /// events, engine, undecodable).
    pub log_applied: IntCounterVec,
    /// The last log position applied here.
    pub log_position: IntGauge,
    /// Seconds from a record's append to its apply here (records of other
    /// replicas only).
    pub log_lag: prometheus::Histogram,
    /// `direction` (sent, received), `kind`
    pub booking_changes: IntCounterVec,
    /// Routing changes dropped: the feed was full or NATS unreachable.
    pub changes_dropped: IntCounter,
    /// Changes of another replica that were missed (a jump in its sequence).
    pub booking_gaps: IntCounter,
    /// Resyncs of another replica's bookings applied.
    pub booking_resyncs: IntCounter,
    /// Lapsed leases this replica removed (it won the compare-and-set).
    pub leases_reaped: IntCounter,
    /// 1 while the NATS connection is up.
    pub connected: IntGauge,
}

impl ClusterFamilies {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            registered(registry, IntCounterVec::new(Opts::new(name, help), labels)?)
        };
        let counter = |name: &str, help: &str| registered(registry, IntCounter::new(name, help)?);
        Ok(Self {
            log_appends: counter_vec(
                "cluster_log_appends_total",
                "Records this replica appended to the shared log, by outcome",
                &["outcome"],
            )?,
            log_applied: counter_vec(
                "cluster_log_applied_total",
                "Shared log records applied here, by kind",
                &["kind"],
            )?,
            log_position: registered(
                registry,
                IntGauge::new(
                    "cluster_log_position",
                    "The last shared log position applied here",
                )?,
            )?,
            log_lag: registered(
                registry,
                prometheus::Histogram::with_opts(
                    prometheus::HistogramOpts::new(
                        "cluster_log_lag_seconds",
                        "From another replica's append to the apply here",
                    )
                    .buckets(vec![
                        0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02,
                        0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
                    ]),
                )?,
            )?,
            booking_changes: counter_vec(
                "cluster_booking_changes_total",
                "Booked-load and session changes sent to and received from other replicas",
                &["direction", "kind"],
            )?,
            changes_dropped: counter(
                "cluster_changes_dropped_total",
                "Routing changes not sent to the other replicas (feed full or NATS unreachable)",
            )?,
            booking_gaps: counter(
                "cluster_booking_gaps_total",
                "Jumps in another replica's change sequence (changes missed)",
            )?,
            booking_resyncs: counter(
                "cluster_booking_resyncs_total",
                "Resyncs of another replica's open bookings applied here",
            )?,
            leases_reaped: counter(
                "cluster_leases_reaped_total",
                "Lapsed leases this replica removed",
            )?,
            connected: registered(
                registry,
                IntGauge::new(
                    "cluster_nats_connected",
                    "1 while the NATS connection is up",
                )?,
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn render_ends_with_the_resident_memory() {
        let metrics = Metrics::new().expect("metrics");
        let text = metrics.render();
        let line = text
            .lines()
            .find(|l| l.starts_with("process_resident_memory_bytes "))
            .expect("the gauge");
        let bytes: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .expect("a number");
        assert!(bytes > 0);
    }

    #[test]
    fn render_exports_the_heap_once_a_reader_is_installed() {
        count_heap_with(|| 12_345);
        assert_eq!(heap_allocated_bytes(), Some(12_345));
        let text = Metrics::new().expect("metrics").render();
        assert!(
            text.lines()
                .any(|l| l == "kvroute_heap_allocated_bytes 12345"),
            "{text}"
        );
        assert!(text.contains("# TYPE kvroute_heap_allocated_bytes gauge"));
    }
}
