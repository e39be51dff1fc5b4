//! A snapshot file's payload: the fuzz bytes behind a header that agrees
//! with them (so the checksum passes and the bytes reach the protobuf
//! decoder, the state's checks and the restore), restored into an empty
//! fleet under small limits, as a planted file would be.
//!
//! Checked after the restore: every saved worker was restored or refused,
//! never both; the registry holds no more than its limits allow; every
//! restored rank holds no more blocks than its capacity; and the index
//! holds blocks only for restored workers' ranks (no ghost ranks).

use std::sync::Arc;

use crate::{
    fleet::Fleet,
    ingest::{EventWriter, start_writer},
    metrics::Metrics,
    router::{RouterConfig, RouterCore},
    snapshot::{convert, format},
};
use kvroute_core::{registry::RegistryLimits, types::WorkerRank};

const MAX_WORKERS: usize = 4;
const MAX_RANKS: u32 = 4;
const MAX_BLOCKS_PER_RANK: u64 = 64;

pub fn snapshot_payload(data: &[u8]) {
    let Ok(state) = format::decode(&format::frame(data)) else {
        return;
    };
    let Ok(state) = convert::state_from_pb(state) else {
        return;
    };
    let saved = state.workers.len();
    let Ok(metrics) = Metrics::new() else {
        return;
    };
    let config = RouterConfig {
        registry_limits: RegistryLimits {
            max_tier_blocks_per_rank: 1 << 24,
            max_workers: MAX_WORKERS,
            max_models: 2,
            max_ranks_per_worker: MAX_RANKS,
            max_kv_blocks_per_rank: MAX_BLOCKS_PER_RANK,
            default_kv_blocks_per_rank: MAX_BLOCKS_PER_RANK,
            index_memory_budget: u64::MAX,
        },
        ..RouterConfig::default()
    };
    let router = Arc::new(RouterCore::new(config, metrics));
    let Ok(ingest) = start_writer(Arc::new(EventWriter::new(router.clone()))) else {
        return;
    };
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    // Only loopback engines may be connected to again, as without an
    // allow-list; nothing connects here (no subscription is started for a
    // worker that fails it, and loopback ports are left unreached).
    let loopback_only = Arc::new(|endpoint: &str| {
        endpoint.starts_with("tcp://127.0.0.1:") || endpoint.starts_with("ipc://")
    });
    let fleet = Fleet::new(router.clone(), ingest, loopback_only);
    runtime.block_on(async {
        let report = fleet.restore(state).await;
        assert_eq!(
            report.workers + report.workers_refused.len(),
            saved,
            "every saved worker restored or refused"
        );
        let workers = router.workers(None);
        assert_eq!(workers.len(), report.workers);
        assert!(workers.len() <= MAX_WORKERS);
        let mut held = 0;
        for record in &workers {
            let r = &record.registration;
            assert!(r.dp_size <= MAX_RANKS && r.total_kv_blocks <= MAX_BLOCKS_PER_RANK);
            let Some(index) = router.index_of(&r.model) else {
                continue;
            };
            for rank in r.dp_start_rank..r.dp_start_rank + r.dp_size {
                let blocks = index.worker_blocks(WorkerRank::new(r.worker_id, rank));
                assert!(blocks <= MAX_BLOCKS_PER_RANK, "over capacity");
                held += blocks;
            }
        }
        assert_eq!(
            fleet.index_view(None).stats.blocks,
            held,
            "blocks only for restored ranks"
        );
        fleet.shutdown().await;
    });
}
