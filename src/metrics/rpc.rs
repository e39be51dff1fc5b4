//! The gRPC surface's families: every call and its latency, requests
//! refused for bad input, the PublishEvents streams open, and the web
//! view's requests. Label values
//! are known RPC paths, gRPC code names and fixed reasons only.

use prometheus::{HistogramVec, IntCounterVec, IntGauge};

use super::registrar::{LATENCY_BUCKETS, Registrar};

pub(super) struct RpcFamilies {
    pub(super) requests: IntCounterVec,
    pub(super) duration: HistogramVec,
    pub(super) input_rejected: IntCounterVec,
    pub(super) event_streams: IntGauge,
    pub(super) web_requests: IntCounterVec,
}

impl RpcFamilies {
    pub(super) fn register(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            requests: families.counter_vec(
                "rpc_requests_total",
                "gRPC calls by method and status code",
                &["method", "code"],
            )?,
            duration: families.histogram_vec(
                "rpc_duration_seconds",
                "gRPC call latency to response headers (whole call for unary RPCs)",
                LATENCY_BUCKETS,
                &["method", "code"],
            )?,
            input_rejected: families.counter_vec(
                "input_rejected_total",
                "Requests refused for bad input, by RPC area and reason",
                &["area", "reason"],
            )?,
            event_streams: families.int_gauge("event_streams", "Open PublishEvents streams")?,
            web_requests: families.counter_vec(
                "web_requests_total",
                "Requests of the web view by outcome (ok, not_found, too_long, unauthenticated, forbidden, busy)",
                &["outcome"],
            )?,
        })
    }
}
