//! The index's families: the KV events it took or refused, those applied
//! while catching up, and the size of what it and the predicted caches
//! hold.

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec};

use super::registrar::Registrar;

pub(super) struct IndexFamilies {
    pub(super) events: IntCounterVec,
    pub(super) catchup_events: IntCounterVec,
    pub(super) blocks: IntGauge,
    pub(super) tier_blocks: IntGaugeVec,
    pub(super) bytes: IntGauge,
    pub(super) predicted_blocks: IntGauge,
}

impl IndexFamilies {
    pub(super) fn register(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            events: families.counter_vec(
                "kv_events_total",
                "KV events by outcome and reason",
                &["outcome", "reason"],
            )?,
            catchup_events: families.counter_vec(
                "catchup_events_total",
                "Events applied while catching up after a gap or a restart, by source",
                &["source"],
            )?,
            blocks: families.int_gauge(
                "index_blocks",
                "Cached (block, worker rank) entries in the index",
            )?,
            tier_blocks: families.int_gauge_vec(
                "index_tier_blocks",
                "Cached (block, worker rank) entries by tier (device, host, storage, external)",
                &["tier"],
            )?,
            bytes: families.int_gauge("index_memory_bytes", "Estimated bytes used by the index")?,
            predicted_blocks: families.int_gauge(
                "predicted_blocks",
                "Predicted (block, worker rank) entries of workers without KV events",
            )?,
        })
    }
}
