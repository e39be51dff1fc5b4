//! Security's families (`crate::security`): auth decisions, certificate
//! reloads, failed TLS handshakes and refused engine endpoints.

use prometheus::{IntCounter, IntCounterVec};

use super::registrar::Registrar;

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
    pub(super) fn register(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            auth_decisions: families.counter_vec(
                "auth_decisions_total",
                "Calls checked against the auth policy, by method, role needed and outcome",
                &["method", "role", "outcome"],
            )?,
            tls_reloads: families.counter_vec(
                "tls_reloads_total",
                "Changed TLS certificate files, by whether they loaded",
                &["outcome"],
            )?,
            tls_handshake_failures: families.counter_vec(
                "tls_handshake_failures_total",
                "TLS handshakes that failed or timed out, by port",
                &["port"],
            )?,
            endpoints_refused: families.counter(
                "engine_endpoints_refused_total",
                "RegisterWorker events endpoints outside --engine-endpoint-allow",
            )?,
        })
    }
}
