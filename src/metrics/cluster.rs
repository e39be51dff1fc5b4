//! Cluster mode's families (`crate::cluster`, with `--nats-url`): the shared
//! log, the bookings exchanged with other replicas, leases and the NATS
//! connection.

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};

use super::registrar::Registrar;

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
    pub log_lag: Histogram,
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
    /// RESERVE calls this replica took with `--decision-order ordered`, by
    /// `outcome`: ordered (decided in the log), local (the log was away:
    /// decided here), not_decided (appended, not decided here in time),
    /// local_step (a booking step applied here first: the log was away;
    /// it is appended once the log is back), step_dropped (too many steps
    /// waiting for the log).
    pub ordered_decisions: IntCounterVec,
}

impl ClusterFamilies {
    pub(super) fn register(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            log_appends: families.counter_vec(
                "cluster_log_appends_total",
                "Records this replica appended to the shared log, by outcome",
                &["outcome"],
            )?,
            log_applied: families.counter_vec(
                "cluster_log_applied_total",
                "Shared log records applied here, by kind",
                &["kind"],
            )?,
            log_position: families.int_gauge(
                "cluster_log_position",
                "The last shared log position applied here",
            )?,
            log_lag: families.histogram(
                "cluster_log_lag_seconds",
                "From another replica's append to the apply here",
                &[
                    0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                    0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
                ],
            )?,
            booking_changes: families.counter_vec(
                "cluster_booking_changes_total",
                "Booked-load and session changes sent to and received from other replicas",
                &["direction", "kind"],
            )?,
            changes_dropped: families.counter(
                "cluster_changes_dropped_total",
                "Routing changes not sent to the other replicas (feed full or NATS unreachable)",
            )?,
            booking_gaps: families.counter(
                "cluster_booking_gaps_total",
                "Jumps in another replica's change sequence (changes missed)",
            )?,
            booking_resyncs: families.counter(
                "cluster_booking_resyncs_total",
                "Resyncs of another replica's open bookings applied here",
            )?,
            leases_reaped: families.counter(
                "cluster_leases_reaped_total",
                "Lapsed leases this replica removed",
            )?,
            connected: families.int_gauge(
                "cluster_nats_connected",
                "1 while the NATS connection is up",
            )?,
            ordered_decisions: families.counter_vec(
                "cluster_ordered_decisions_total",
                "RESERVE calls taken here with ordered decisions, by outcome",
                &["outcome"],
            )?,
        })
    }
}
