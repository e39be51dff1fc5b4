//! The resident memory of a hostile capacity claim, in a test binary of
//! its own: the test reads this process's resident memory, which the other
//! integration tests (`tests/it/`), running beside it in one process,
//! would disturb.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "it/common/mod.rs"]
mod common;

use common::{TestServer, batch, claim, refused, stored, try_register};
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
    // A claim reserves nothing until blocks arrive (#38).
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let claimed = resident_bytes();
    assert!(claimed < before + (64 << 20), "{before} -> {claimed}");
    // One block on every rank: now their tables are sized (up to 2^20
    // blocks per rank and 2^24 per model), or this test would show nothing.
    store_one_block_per_rank(&server, &[200, 201]).await;
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

async fn store_one_block_per_rank(server: &TestServer, workers: &[u64]) {
    for &worker_id in workers {
        for rank in 0..16 {
            server
                .publish(batch(worker_id, rank, vec![stored(0, None, &[(7, 9)])]))
                .await
                .unwrap();
        }
    }
}

/// The same with the binary's own allocator (mimalloc, which keeps freed
/// pages): a real `kvroute serve` whose resident memory is read from
/// /proc. Two claims of 16 ranks x 4,194,304 blocks, a block on every
/// rank, then both deregistered: its memory comes back within 100 MiB of
/// where it started (#38: it stayed at the peak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_tables_go_back_to_the_os_under_the_binarys_allocator() {
    let grpc = free_port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
        .args(["--log-level", "warn"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    };
    let channel = common::connect(format!("127.0.0.1:{grpc}").parse().unwrap()).await;
    common::wait_serving(&channel).await;
    let mut workers = pb::workers_client::WorkersClient::new(channel);
    let before = rss();
    for worker_id in [200, 201] {
        workers
            .register_worker(claim(worker_id, "m", 16, 1 << 22))
            .await
            .unwrap();
        for rank in 0..16 {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tx.send(batch(worker_id, rank, vec![stored(0, None, &[(7, 9)])]))
                .await
                .unwrap();
            drop(tx);
            let mut replies = workers
                .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            replies.message().await.unwrap().unwrap();
        }
    }
    let peak = rss();
    assert!(
        peak > before + (256 << 20),
        "tables sized: {before} -> {peak}"
    );
    for worker_id in [200, 201] {
        workers
            .deregister_worker(pb::DeregisterWorkerRequest { worker_id })
            .await
            .unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let after = rss();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        after < before + (100 << 20),
        "resident memory {before} -> {peak} -> {after} bytes"
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}
