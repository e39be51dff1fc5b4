//! The front door's families: the endpoint picker's (`crate::gateway`)
//! requests by the status they were answered with, prompts kvroute could
//! not tokenize and why, what Envoy sent that the protocol did not expect,
//! where a pick's time went; and the pools' members (`crate::pools`).

use prometheus::{HistogramVec, IntCounterVec, IntGauge};

use super::registrar::Registrar;

/// The endpoint picker (Envoy ext_proc).
#[derive(Clone)]
pub struct GatewayFamilies {
    /// `outcome`: routed, or the HTTP status answered (bad_request,
    /// too_large, busy, unavailable, ...).
    pub requests: IntCounterVec,
    /// `reason`: why a prompt was routed by load instead of by its cache.
    pub untokenized: IntCounterVec,
    /// Prompt token ids by `source`: cached (a chat's earlier turns, from
    /// the tokenizer's segment cache), tokenized (computed for this pick).
    pub prompt_tokens: IntCounterVec,
    /// `what`: ext_proc messages out of order or repeated (Envoy's resent
    /// final chunk, a body after the decision, ...), ignored.
    pub protocol_oddities: IntCounterVec,
    /// `end`: how streams with a booking ended: finished, failed, abandoned.
    pub streams_ended: IntCounterVec,
    /// Streams open now.
    pub streams_open: IntGauge,
    /// Bytes of request bodies held while they are read.
    pub buffered_bytes: IntGauge,
    /// Seconds of each part of a pick: `part` = parse, wait (for a core to
    /// tokenize on), tokenize, select.
    pub pick_seconds: HistogramVec,
    /// Pool members registered now (`--pool`).
    pub pool_members: IntGauge,
    /// `outcome`: read, failed (a file or name; its members stay),
    /// member_refused (the endpoint allow-list).
    pub pool_refreshes: IntCounterVec,
}

impl GatewayFamilies {
    pub(super) fn register(families: Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            requests: families.counter_vec(
                "epp_requests_total",
                "Endpoint picker requests by outcome: routed, or the status answered",
                &["outcome"],
            )?,
            untokenized: families.counter_vec(
                "epp_untokenized_total",
                "Endpoint picker prompts routed by load, by why they were not tokenized",
                &["reason"],
            )?,
            prompt_tokens: families.counter_vec(
                "epp_prompt_tokens_total",
                "Endpoint picker prompt token ids by source: cached (segment cache), tokenized",
                &["source"],
            )?,
            protocol_oddities: families.counter_vec(
                "epp_protocol_oddities_total",
                "ext_proc messages out of order or repeated, ignored, by kind",
                &["what"],
            )?,
            streams_ended: families.counter_vec(
                "epp_streams_ended_total",
                "Endpoint picker streams with a booking, by how they ended: finished, failed, abandoned",
                &["end"],
            )?,
            streams_open: families.int_gauge(
                "epp_streams_open",
                "Endpoint picker (ext_proc) streams open now",
            )?,
            buffered_bytes: families.int_gauge(
                "epp_buffered_body_bytes",
                "Bytes of request bodies the endpoint picker holds while reading them",
            )?,
            pick_seconds: families.histogram_vec(
                "epp_pick_seconds",
                "Seconds of each part of a pick: parse, wait (for a core), tokenize, select",
                &[
                    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
                    0.05, 0.1, 0.25, 1.0,
                ],
                &["part"],
            )?,
            pool_members: families.int_gauge(
                "pool_members",
                "Engines registered from pool files (--pool)",
            )?,
            pool_refreshes: families.counter_vec(
                "pool_refreshes_total",
                "Pool file refreshes by outcome: read, failed, member_refused",
                &["outcome"],
            )?,
        })
    }
}
