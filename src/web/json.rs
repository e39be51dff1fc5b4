//! The web view's JSON of decisions. Workers are written by
//! `grpc::json::worker_json`, the JSON `kvroute ctl --json` prints.

use serde_json::{Value, json};

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
