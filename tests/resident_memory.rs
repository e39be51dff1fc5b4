//! The resident memory of a hostile capacity claim, in a test binary of
//! its own: the test reads this process's resident memory, which the other
//! integration tests (`tests/it/`), running beside it in one process,
//! would disturb.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "it/common/mod.rs"]
mod common;

use common::{TestServer, claim, refused, try_register};
use kvroute::pb;

fn resident_bytes() -> u64 {
    kvroute::metrics::resident_memory_bytes().expect("VmRSS in /proc/self/status")
}

/// The attack: the largest capacity under a new model name, three
/// times. Refused at the first check; nothing is reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_capacity_claim_reserves_nothing() {
    let server = TestServer::start().await;
    let before = resident_bytes();
    for i in 0..3 {
        refused(
            &server,
            claim(100 + i, &format!("model-{i}"), 16, 1 << 63),
            "max_kv_blocks_per_rank",
        )
        .await;
    }
    // Past the budget: 16 GiB at 96 bytes a block is 178,956,970 blocks;
    // 16 ranks x 4,194,304 is 67,108,864, so the third such worker is refused.
    for i in 0..2 {
        try_register(&server, claim(200 + i, "m", 16, 1 << 22))
            .await
            .unwrap();
    }
    refused(&server, claim(202, "m", 16, 1 << 22), "index_memory_budget").await;
    // The accepted ones reserved table room (up to 2^20 blocks per rank
    // and 2^24 per model), or this test would show nothing.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let peak = resident_bytes();
    assert!(peak > before + (64 << 20), "{before} -> {peak}");
    for worker_id in [200, 201] {
        server
            .workers()
            .deregister_worker(pb::DeregisterWorkerRequest { worker_id })
            .await
            .unwrap();
    }
    // Once the writer has dropped the deregistered tables (GetIndexStats
    // queues behind it), the memory is back.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let after = resident_bytes();
    assert!(
        after < before + (64 << 20),
        "resident memory grew from {before} to {after} bytes"
    );
}
