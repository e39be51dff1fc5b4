//! Routing's families: SelectWorker's outcomes and the overlap it found, the
//! admission queue, and the bookings held until requests are released.

use prometheus::{HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

use super::registrar::{LATENCY_BUCKETS, Registrar};

pub(super) struct RoutingFamilies {
    pub(super) decisions: IntCounterVec,
    pub(super) overlap_ratio: HistogramVec,
    pub(super) overlap_tier_blocks: IntCounterVec,
    pub(super) queue_depth: IntGauge,
    pub(super) queue_wait: HistogramVec,
    pub(super) bookings_active: IntGauge,
    pub(super) bookings_expired: IntCounter,
    pub(super) bookings_refused: IntCounterVec,
    pub(super) worker_booked: IntGaugeVec,
}

impl RoutingFamilies {
    pub(super) fn register(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            decisions: families.counter_vec(
                "routing_decisions_total",
                "SelectWorker outcomes",
                &["outcome"],
            )?,
            overlap_ratio: families.histogram_vec(
                "routing_overlap_ratio",
                "Cached share of the prompt's blocks on the chosen worker",
                &[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
                &["mode"],
            )?,
            overlap_tier_blocks: families.counter_vec(
                "routing_overlap_blocks_total",
                "Cached prompt blocks on the chosen workers, by the fastest tier holding each (device, host, storage, external)",
                &["tier"],
            )?,
            queue_depth: families.int_gauge(
                "admission_queue_depth",
                "SelectWorker calls waiting for a free worker",
            )?,
            queue_wait: families.histogram_vec(
                "admission_queue_wait_seconds",
                "Time queued before an answer",
                LATENCY_BUCKETS,
                &["outcome"],
            )?,
            bookings_active: families.int_gauge(
                "bookings_active",
                "Requests with booked load not yet released",
            )?,
            bookings_expired: families.counter(
                "bookings_expired_total",
                "Bookings dropped because they were never released",
            )?,
            bookings_refused: families.counter_vec(
                "bookings_refused_total",
                "RESERVE calls refused because open bookings hold their bound (bound: all, identity)",
                &["bound"],
            )?,
            worker_booked: families.int_gauge_vec(
                "worker_booked",
                "Load booked on a (worker, rank) and not yet released (kind: prefill_tokens, decode_blocks, requests), set at each scrape for the --max-engine-metric-workers ranks with the most booked",
                &["worker", "rank", "kind"],
            )?,
        })
    }
}
