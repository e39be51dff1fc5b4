//! The fleet's lifecycle under concurrency: one worker's operations take
//! turns, so no subscription outlives its registration and the map of turns
//! does not grow with the workers seen.

use std::sync::Arc;

use super::*;
use crate::{
    engine_events::Dialect,
    ingest::{EventWriter, start_writer},
    metrics::Metrics,
    router::RouterConfig,
};

fn fleet() -> Fleet {
    let metrics = Metrics::new().unwrap_or_else(|e| panic!("metrics: {e}"));
    let router = Arc::new(RouterCore::new(RouterConfig::default(), metrics));
    let ingest = start_writer(Arc::new(EventWriter::new(router.clone())))
        .unwrap_or_else(|e| panic!("writer: {e}"));
    Fleet::new(router, ingest, Arc::new(|_: &str| true))
}

fn registration(worker_id: WorkerId, block_size: u32) -> Registration {
    Registration {
        tiers: Vec::new(),
        worker_id,
        model: "m".into(),
        role: WorkerRole::Aggregated,
        endpoint: String::new(),
        block_size,
        dp_start_rank: 0,
        dp_size: 2,
        total_kv_blocks: 0,
        max_num_batched_tokens: 8192,
        taints: Vec::new(),
        adapters: Vec::new(),
        loads_adapters: false,
        lease_ttl: None,
        kv_events: kvroute_core::types::KvEventsMode::Exact,
    }
}

/// An engine endpoint nothing listens on: the subscription keeps retrying,
/// so its tasks stay alive until stopped.
fn source(port: u16) -> EngineSource {
    EngineSource {
        dialect: Dialect::Vllm,
        endpoint: format!("tcp://127.0.0.1:{port}"),
        replay_endpoint: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_registrations_of_one_worker_leave_one_subscription() {
    let fleet = Arc::new(fleet());
    let calls: Vec<_> = (0..16u16)
        .map(|i| {
            let fleet = fleet.clone();
            // Alternate sources, so every call must stop and start one.
            tokio::spawn(async move {
                fleet
                    .register(registration(7, 16), Some(source(9 + i % 2)))
                    .await
            })
        })
        .collect();
    for call in calls {
        let outcome = call.await.unwrap_or_else(|e| panic!("join: {e}"));
        assert!(outcome.is_ok(), "{outcome:?}");
    }
    // One subscription of two ranks: two tasks, whichever source won.
    assert_eq!(fleet.subscriptions.tracker_len(), 2);
    assert!(fleet.turns.is_empty(), "turns left behind");
    fleet
        .deregister(7)
        .await
        .unwrap_or_else(|e| panic!("deregister: {e}"));
    assert_eq!(
        fleet.subscriptions.tracker_len(),
        0,
        "a subscription outlived its registration"
    );
    assert!(fleet.worker_view(7).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_block_size_change_races_no_other_registration_into_a_stale_index() {
    let fleet = Arc::new(fleet());
    // Worker 1 alone moves its model between block sizes while worker 2
    // tries to join at one of them: whatever the order, the model's index
    // has the block size of the workers registered under it.
    let mover = {
        let fleet = fleet.clone();
        tokio::spawn(async move {
            for i in 0..50u32 {
                let _ = fleet.register(registration(1, 16 << (i % 2)), None).await;
            }
        })
    };
    let joiner = {
        let fleet = fleet.clone();
        tokio::spawn(async move {
            for _ in 0..50 {
                let _ = fleet.register(registration(2, 16), None).await;
                let _ = fleet.deregister(2).await;
            }
        })
    };
    for task in [mover, joiner] {
        task.await.unwrap_or_else(|e| panic!("join: {e}"));
    }
    let router = fleet.router();
    let index = router.index_of("m").unwrap_or_else(|| panic!("no index"));
    assert_eq!(index.block_size(), router.model_view("m").block_size());
}

#[tokio::test]
async fn operations_on_many_workers_leave_no_turns_behind() {
    let fleet = fleet();
    for worker_id in 0..100 {
        fleet
            .register(registration(worker_id, 16), None)
            .await
            .unwrap_or_else(|e| panic!("register: {e}"));
    }
    for worker_id in 0..100 {
        fleet
            .deregister(worker_id)
            .await
            .unwrap_or_else(|e| panic!("deregister: {e}"));
    }
    assert!(fleet.deregister(0).await.is_err(), "deregistered twice");
    assert!(fleet.turns.is_empty());
}
