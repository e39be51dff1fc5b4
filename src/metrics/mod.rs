//! Prometheus metrics: created once at start-up, handed to every area that
//! counts something, served as text at `GET /metrics` on the metrics address.
//!
//! Label values come only from fixed sets (known RPC paths, gRPC code names,
//! fixed reason strings) so untrusted input can never grow the label space.
//! The one exception is the `worker` label of the `engine_event_*` families:
//! a registered worker's id, whose series are removed when its subscription
//! stops (`subscriptions`).
//!
//! Each area registers its families in a file of its own (`rpc`, `routing`,
//! `fleet`, `index`, `trust`, `engine`, `snapshot`, `security`, `cluster`,
//! `gateway`),
//! through `registrar`; `Metrics::new` puts them together. The families
//! read across the server keep their names on `Metrics` itself, the others
//! are grouped under their area's field.

mod cluster;
mod engine;
mod fleet;
mod gateway;
mod index;
mod memory;
mod registrar;
mod routing;
mod rpc;
mod security;
mod snapshot;
mod trust;

use std::{sync::Arc, time::Duration};

use prometheus::{
    Encoder, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry, TextEncoder,
};

pub use cluster::ClusterFamilies;
pub use engine::{DEFAULT_ENGINE_SERIES_WORKERS, EngineEventFamilies, UnknownMedia};
pub use gateway::GatewayFamilies;
pub use memory::{
    count_heap_with, heap_allocated_bytes, resident_memory_bytes, return_freed_memory,
    return_freed_memory_with,
};
pub use security::SecurityFamilies;
pub use snapshot::SnapshotFamilies;

use fleet::FleetFamilies;
use index::IndexFamilies;
use registrar::Registrar;
use routing::RoutingFamilies;
use rpc::RpcFamilies;
use trust::TrustFamilies;

/// Every metric family kvroute exports.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    // The gRPC surface (`rpc`).
    pub rpc_requests: IntCounterVec,
    pub rpc_duration: HistogramVec,
    pub input_rejected: IntCounterVec,
    pub event_streams: IntGauge,
    /// The web view's requests by outcome (`web`).
    pub web_requests: IntCounterVec,
    // Routing and admission (`routing`).
    pub decisions: IntCounterVec,
    pub overlap_ratio: HistogramVec,
    /// `tier`: the chosen workers' cached prompt blocks.
    pub overlap_tier_blocks: IntCounterVec,
    pub queue_depth: IntGauge,
    pub queue_wait: HistogramVec,
    pub bookings_active: IntGauge,
    pub bookings_expired: IntCounter,
    /// `bound`: all (every caller's bookings), identity (one caller's).
    pub bookings_refused: IntCounterVec,
    /// Booked load per (worker, rank), refreshed at each scrape.
    pub worker_booked: IntGaugeVec,
    // The fleet (`fleet`).
    pub workers: IntGaugeVec,
    pub leases_expired: IntCounter,
    // The index and predicted caches (`index`).
    pub events: IntCounterVec,
    /// `source`: grpc (events applied by batches answering a resend). An
    /// engine's catch-up is `engine_event_replayed_batches_total{worker}`.
    pub catchup_events: IntCounterVec,
    pub index_blocks: IntGauge,
    /// `tier`: entries per cache tier.
    pub index_tier_blocks: IntGaugeVec,
    pub index_bytes: IntGauge,
    pub predicted_blocks: IntGauge,
    // Trust in exact workers' events (`trust`).
    pub worker_trust_changes: IntCounterVec,
    pub workers_untrusted: IntGauge,
    pub cached_tokens_reports: IntCounterVec,
    pub cached_tokens_error: HistogramVec,
    pub engine: EngineEventFamilies,
    pub snapshot: SnapshotFamilies,
    /// Cluster mode (`--nats-url`): the shared log, bookings, leases.
    pub cluster: ClusterFamilies,
    /// TLS, authentication and roles (`crate::security`).
    pub security: SecurityFamilies,
    /// The endpoint picker (`crate::gateway`).
    pub gateway: GatewayFamilies,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Creates and registers every family. Registration of fixed, distinct
    /// names cannot collide, so failures here are programming errors; they are
    /// reported rather than panicking.
    pub fn new() -> Result<Arc<Self>, prometheus::Error> {
        let registry = Registry::new_custom(Some("kvroute".into()), None)?;
        let families = Registrar::new(&registry);
        let rpc = RpcFamilies::register(families)?;
        let routing = RoutingFamilies::register(families)?;
        let fleet = FleetFamilies::register(families)?;
        let index = IndexFamilies::register(families)?;
        let trust = TrustFamilies::register(families)?;
        Ok(Arc::new(Self {
            rpc_requests: rpc.requests,
            rpc_duration: rpc.duration,
            input_rejected: rpc.input_rejected,
            event_streams: rpc.event_streams,
            web_requests: rpc.web_requests,
            decisions: routing.decisions,
            overlap_ratio: routing.overlap_ratio,
            overlap_tier_blocks: routing.overlap_tier_blocks,
            queue_depth: routing.queue_depth,
            queue_wait: routing.queue_wait,
            bookings_active: routing.bookings_active,
            bookings_expired: routing.bookings_expired,
            bookings_refused: routing.bookings_refused,
            worker_booked: routing.worker_booked,
            workers: fleet.workers,
            leases_expired: fleet.leases_expired,
            events: index.events,
            catchup_events: index.catchup_events,
            index_blocks: index.blocks,
            index_tier_blocks: index.tier_blocks,
            index_bytes: index.bytes,
            predicted_blocks: index.predicted_blocks,
            worker_trust_changes: trust.changes,
            workers_untrusted: trust.untrusted,
            cached_tokens_reports: trust.cached_tokens_reports,
            cached_tokens_error: trust.cached_tokens_error,
            engine: EngineEventFamilies::register(families)?,
            snapshot: SnapshotFamilies::register(families)?,
            cluster: ClusterFamilies::register(families)?,
            security: SecurityFamilies::register(families)?,
            gateway: GatewayFamilies::register(families)?,
            registry,
        }))
    }

    /// The text exposition of every family, then the process's resident
    /// memory under its conventional (unprefixed) name.
    pub(crate) fn render(&self) -> String {
        let mut buffer = Vec::new();
        let encoder = TextEncoder::new();
        if let Err(error) = encoder.encode(&self.registry.gather(), &mut buffer) {
            tracing::warn!(%error, "metrics encoding failed");
        }
        let mut text = String::from_utf8_lossy(&buffer).into_owned();
        text.push_str(&memory::exposition());
        text
    }

    /// Records one finished RPC.
    pub(crate) fn observe_rpc(&self, method: &str, code: &str, elapsed: Duration) {
        self.rpc_requests.with_label_values(&[method, code]).inc();
        self.rpc_duration
            .with_label_values(&[method, code])
            .observe(elapsed.as_secs_f64());
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
