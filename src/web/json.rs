//! The web view's JSON: the Admin service's own messages (what `kvroute ctl`
//! shows) written as JSON objects, so the page and the gRPC API never
//! disagree.

use serde_json::{Value, json};

use crate::pb;

fn role(role: i32) -> &'static str {
    match pb::WorkerRole::try_from(role) {
        Ok(pb::WorkerRole::Prefill) => "prefill",
        Ok(pb::WorkerRole::Decode) => "decode",
        _ => "aggregated",
    }
}

fn kv_events(mode: i32) -> &'static str {
    match pb::KvEventsMode::try_from(mode) {
        Ok(pb::KvEventsMode::Approximate) => "approximate",
        Ok(pb::KvEventsMode::Auto) => "auto",
        _ => "exact",
    }
}

/// One worker, its ranks and what routing trusts of its cache.
pub(super) fn worker(w: &pb::WorkerInfo) -> Value {
    let ranks: Vec<Value> = w
        .ranks
        .iter()
        .map(|r| {
            let reported = r.reported_load.unwrap_or_default();
            let booked = r.booked_load.unwrap_or_default();
            json!({
                "rank": r.dp_rank,
                "running": reported.running_requests,
                "waiting": reported.waiting_requests,
                "kv_blocks_used": reported.kv_blocks_used,
                "booked_prefill_tokens": booked.prefill_tokens,
                "booked_decode_blocks": booked.decode_blocks,
                "booked_requests": booked.active_requests,
                "cached_blocks": r.cached_blocks,
                "predicted_blocks": r.predicted_blocks,
                "last_event_id": r.last_event_id,
                "events_skipped": r.events_skipped,
                "events_rejected": r.events_rejected,
            })
        })
        .collect();
    json!({
        "worker_id": w.worker_id,
        "model": w.model,
        "role": role(w.role),
        "endpoint": w.endpoint,
        "dp_start_rank": w.dp_start_rank,
        "dp_size": w.dp_size,
        "total_kv_blocks": w.total_kv_blocks,
        "taints": w.taints,
        "lease_remaining_ms": w.lease_remaining_ms,
        "cordoned": w.cordoned,
        "kv_events": kv_events(w.kv_events),
        "cache_view_reason": w.cache_view_reason,
        "subscription": w.subscription,
        "feedback": w.cached_tokens_feedback.map(|f| json!({
            "reports": f.reports,
            "mean_abs_error_tokens": f.mean_abs_error_tokens,
            "contradicted": f.contradicted,
        })),
        "ranks": ranks,
    })
}

/// One decision and its kept candidates.
pub(super) fn decision(d: &crate::router::decisions::Decision) -> Value {
    let candidates: Vec<Value> = d
        .candidates
        .iter()
        .map(|c| {
            json!({
                "worker_id": c.worker_id,
                "rank": c.dp_rank,
                "eligible": c.eligible,
                "busy": c.busy,
                "chosen": c.chosen,
                "overlap_blocks": c.overlap_blocks,
                "booked_prefill_tokens": c.booked_prefill_tokens,
                "booked_requests": c.booked_requests,
                "prefill_cost": c.prefill_cost,
                "decode_cost": c.decode_cost,
                "probability": c.probability,
            })
        })
        .collect();
    json!({
        "seq": d.seq,
        "at_unix_ms": d.at_unix_ms,
        "request_id": d.request_id,
        "model": d.model,
        "outcome": d.outcome,
        "worker_id": d.worker_id,
        "rank": d.dp_rank,
        "overlap_blocks": d.overlap_blocks,
        "total_blocks": d.total_blocks,
        "policy": d.policy,
        "candidates_total": d.candidates_total,
        "candidates": candidates,
    })
}
