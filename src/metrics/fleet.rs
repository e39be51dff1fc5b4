//! The fleet's families: workers by state, and those whose lease lapsed.

use prometheus::{IntCounter, IntGaugeVec};

use super::registrar::Registrar;

pub(super) struct FleetFamilies {
    pub(super) workers: IntGaugeVec,
    pub(super) leases_expired: IntCounter,
}

impl FleetFamilies {
    pub(super) fn register(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            workers: families.int_gauge_vec(
                "workers",
                "Registered workers by state",
                &["state"],
            )?,
            leases_expired: families.counter(
                "leases_expired_total",
                "Workers removed because their lease lapsed",
            )?,
        })
    }
}
