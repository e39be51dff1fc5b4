//! Durable state's families (`crate::snapshot`): snapshots written, failed,
//! loaded and set aside, their size and how long they took.

use prometheus::{Gauge, IntCounterVec, IntGauge};

use super::registrar::Registrar;

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
    pub(super) fn register(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            outcomes: families.counter_vec(
                "snapshots_total",
                "Snapshots by outcome: written, write_failed, loaded, damaged, unreadable, set_aside",
                &["outcome"],
            )?,
            age: families.gauge(
                "snapshot_age_seconds",
                "Seconds since the last snapshot written or loaded",
            )?,
            bytes: families.int_gauge("snapshot_bytes", "Bytes of the last snapshot written")?,
            entries: families.int_gauge(
                "snapshot_entries",
                "Cached entries in the last snapshot written",
            )?,
            capture_seconds: families.gauge(
                "snapshot_capture_seconds",
                "Seconds the last snapshot took to capture",
            )?,
            write_seconds: families.gauge(
                "snapshot_write_seconds",
                "Seconds the last snapshot took to encode and write",
            )?,
            load_seconds: families.gauge(
                "snapshot_load_seconds",
                "Seconds the snapshot loaded at start took",
            )?,
            entries_restored: families.int_gauge(
                "snapshot_entries_restored",
                "Cached entries restored from the snapshot loaded at start",
            )?,
        })
    }
}
