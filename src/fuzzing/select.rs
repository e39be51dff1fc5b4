//! SelectWorker: the bytes are a protobuf `SelectWorkerRequest`, converted
//! and validated as the handler does (`grpc::router::prepare_on`), then scored
//! (`explain`) and routed with a booking (`route_unqueued`, which waits for
//! nothing) over a small fleet whose index holds a few blocks, and
//! released. Every step may refuse the request; none may panic.

use prost::Message;

use crate::{
    grpc::router::prepare_on,
    metrics::Metrics,
    pb,
    router::{RouterConfig, RouterCore},
};
use kvroute_core::{
    hashing::{HashOptions, compute_block_hashes},
    index::KvEvent,
    registry::Registration,
    types::{WorkerRank, WorkerRole},
};

const MODEL: &str = "m";
const BLOCK_SIZE: u32 = 4;

pub fn select_worker(data: &[u8]) {
    let Ok(request) = pb::SelectWorkerRequest::decode(data) else {
        return;
    };
    let Some(core) = fleet() else {
        return;
    };
    let model = core.model_view(&request.model);
    let Ok(prepared) = prepare_on(&core, &model, request) else {
        return;
    };
    let request_id = prepared.request.request_id.clone();
    let _ = core.explain(&model, &prepared);
    if core.route_unqueued(prepared).is_ok() {
        core.mark_prefill_complete(&request_id);
        core.release_request(&request_id);
    }
}

/// Three workers of model `m`: aggregated (two dp ranks), prefill, and a
/// tainted decode worker; ranks hold the first blocks of tokens 0..16
/// (hashed without LoRA or namespace) to different depths.
fn fleet() -> Option<RouterCore> {
    let core = RouterCore::new(RouterConfig::default(), Metrics::new().ok()?);
    let workers = [
        (1, WorkerRole::Aggregated, 2, Vec::new()),
        (2, WorkerRole::Prefill, 1, Vec::new()),
        (3, WorkerRole::Decode, 1, vec!["spot".to_string()]),
    ];
    for (worker_id, role, dp_size, taints) in workers {
        core.register_worker(Registration {
            tiers: Vec::new(),
            worker_id,
            model: MODEL.into(),
            role,
            endpoint: String::new(),
            block_size: BLOCK_SIZE,
            dp_start_rank: 0,
            dp_size,
            total_kv_blocks: 1000,
            max_num_batched_tokens: 8192,
            taints,
            adapters: Vec::new(),
            loads_adapters: false,
            lease_ttl: None,
            kv_events: kvroute_core::types::KvEventsMode::Exact,
        })
        .ok()?;
    }
    let index = core.index_of(MODEL)?;
    let tokens: Vec<u32> = (0..16).collect();
    let locals = compute_block_hashes(&tokens, BLOCK_SIZE, &HashOptions::default(), None);
    for (target, depth) in [((1, 0), 4), ((1, 1), 1), ((2, 0), 2)] {
        let blocks = (0u64..).zip(locals.iter().copied()).take(depth).collect();
        let stored = KvEvent::Stored {
            parent: None,
            blocks,
        };
        index
            .apply(WorkerRank::new(target.0, target.1), &stored)
            .ok()?;
    }
    Some(core)
}
