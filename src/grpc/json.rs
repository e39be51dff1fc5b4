//! The protocol's Admin messages as JSON: one spelling for `kvroute ctl
//! --json` (kvroute-tools) and the operators' web view (`web`), so neither
//! drifts from the other or from the gRPC API.

use serde_json::{Value, json};

use crate::pb;

pub fn role_name(role: pb::WorkerRole) -> &'static str {
    match role {
        pb::WorkerRole::Aggregated => "aggregated",
        pb::WorkerRole::Prefill => "prefill",
        pb::WorkerRole::Decode => "decode",
    }
}

pub fn kv_events_name(mode: pb::KvEventsMode) -> &'static str {
    match mode {
        pb::KvEventsMode::Unspecified | pb::KvEventsMode::Exact => "exact",
        pb::KvEventsMode::Approximate => "approximate",
        pb::KvEventsMode::Auto => "auto",
    }
}

pub fn view_name(view: pb::CacheView) -> &'static str {
    match view {
        pb::CacheView::Unspecified => "-",
        pb::CacheView::Exact => "exact",
        pb::CacheView::Predicted => "predicted",
        pb::CacheView::Blended => "blended",
    }
}

/// One booked load, as in `worker_json`.
pub fn booked_json(b: &pb::BookedLoad) -> Value {
    json!({
        "prefill_tokens": b.prefill_tokens,
        "prefill_blocks": b.prefill_blocks,
        "decode_blocks": b.decode_blocks,
        "active_requests": b.active_requests,
    })
}

/// The worker, its ranks and their loads, as `--json` prints it.
pub fn worker_json(w: &pb::WorkerInfo) -> Value {
    let ranks: Vec<Value> = w
        .ranks
        .iter()
        .map(|r| {
            let load = r.reported_load.unwrap_or_default();
            json!({
                "dp_rank": r.dp_rank,
                "reported_load": {
                    "running_requests": load.running_requests,
                    "waiting_requests": load.waiting_requests,
                    "kv_blocks_used": load.kv_blocks_used,
                },
                "booked_load": booked_json(&r.booked_load.unwrap_or_default()),
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
        "role": role_name(w.role()),
        "endpoint": w.endpoint,
        "block_size": w.block_size,
        "dp_start_rank": w.dp_start_rank,
        "dp_size": w.dp_size,
        "total_kv_blocks": w.total_kv_blocks,
        "max_num_batched_tokens": w.max_num_batched_tokens,
        "taints": w.taints,
        "adapters": w.adapters.iter().map(|a| json!({"id": a.id, "name": a.name})).collect::<Vec<_>>(),
        "loads_adapters": w.loads_adapters,
        "lease_remaining_ms": w.lease_remaining_ms,
        "cordoned": w.cordoned,
        "subscription": w.subscription,
        "kv_events": kv_events_name(w.kv_events()),
        "cache_view": view_name(w.cache_view()),
        "cache_view_reason": w.cache_view_reason,
        "cached_tokens_feedback": w.cached_tokens_feedback.as_ref().map_or(Value::Null, |f| json!({
            "reports": f.reports,
            "mean_error_tokens": f.mean_error_tokens,
            "mean_abs_error_tokens": f.mean_abs_error_tokens,
            "index_error_blocks": f.index_error_blocks,
            "contradicted": f.contradicted,
        })),
        "cached_blocks": w.ranks.iter().map(|r| r.cached_blocks).sum::<u64>(),
        "booked_load": booked_json(&booked_of(w)),
        "ranks": ranks,
    })
}

/// The load booked on all of the worker's ranks.
pub fn booked_of(info: &pb::WorkerInfo) -> pb::BookedLoad {
    info.ranks
        .iter()
        .filter_map(|r| r.booked_load)
        .fold(pb::BookedLoad::default(), |sum, b| pb::BookedLoad {
            prefill_tokens: sum.prefill_tokens + b.prefill_tokens,
            prefill_blocks: sum.prefill_blocks + b.prefill_blocks,
            decode_blocks: sum.decode_blocks + b.decode_blocks,
            active_requests: sum.active_requests + b.active_requests,
        })
}
