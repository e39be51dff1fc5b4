//! Trust in exact workers' KV events: when it was lost or regained, and
//! the cached tokens engines report next to those kvroute scored with.

use prometheus::{HistogramVec, IntCounterVec, IntGauge};

use super::registrar::Registrar;

pub(super) struct TrustFamilies {
    pub(super) changes: IntCounterVec,
    pub(super) untrusted: IntGauge,
    pub(super) cached_tokens_reports: IntCounterVec,
    pub(super) cached_tokens_error: HistogramVec,
}

impl TrustFamilies {
    pub(super) fn register(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            changes: families.counter_vec(
                "worker_trust_changes_total",
                "Exact workers whose KV events stopped (downgraded) or started again (recovered) being trusted, by reason",
                &["change", "reason"],
            )?,
            untrusted: families.int_gauge(
                "workers_untrusted",
                "Exact workers scored on their index blended with predictions",
            )?,
            cached_tokens_reports: families.counter_vec(
                "cached_tokens_reports_total",
                "Engine-reported cached tokens passed back, by outcome (recorded, unknown request, implausible)",
                &["outcome"],
            )?,
            cached_tokens_error: families.histogram_vec(
                "cached_tokens_error_tokens",
                "Cached tokens kvroute scored a request with minus what its engine reported, by worker (the first 64 to report; the rest as other) and the view scored",
                &[
                    -4096.0, -1024.0, -256.0, -64.0, -16.0, -0.5, 0.5, 16.0, 64.0, 256.0, 1024.0,
                    4096.0,
                ],
                &["worker", "view"],
            )?,
        })
    }
}
