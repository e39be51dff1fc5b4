//! The worker lifecycle and KV event streams over real gRPC: leases (with
//! paused tokio time), cursors, resend requests, malformed batches kept to
//! their own stream, deregistration, and draining an open stream at shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::time::Duration;

use common::{
    TestServer, batch, cleared, registration, removed, select_hashes, stored,
    worker::{Ev, Reply, TestWorker},
};
use kvroute::{ingest::cursor, pb};
use tonic::Code;

async fn cached_blocks(server: &TestServer, worker_id: u64) -> Option<u64> {
    server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id })
        .await
        .ok()
        .map(|r| r.into_inner().ranks.iter().map(|r| r.cached_blocks).sum())
}

async fn index_stats(server: &TestServer) -> pb::IndexStats {
    server
        .admin()
        .get_index_stats(pb::GetIndexStatsRequest { model: None })
        .await
        .unwrap()
        .into_inner()
}

async fn index_blocks(server: &TestServer) -> u64 {
    index_stats(server).await.blocks
}

#[tokio::test]
async fn a_lapsed_lease_removes_the_worker_and_its_blocks() {
    let server = TestServer::start().await;
    let mut short = registration(1, "m");
    short.lease_ttl_secs = 600;
    server.register(short).await;
    let mut long = registration(2, "m");
    long.lease_ttl_secs = 3600;
    server.register(long).await;
    server
        .publish(batch(1, 0, vec![stored(0, None, &[(11, 1), (12, 2)])]))
        .await
        .unwrap();
    server
        .publish(batch(2, 0, vec![stored(0, None, &[(21, 1)])]))
        .await
        .unwrap();
    assert_eq!(index_blocks(&server).await, 3);

    // The clock stops only now: paused time jumps ahead whenever the
    // runtime waits, also while the index writer thread works, so a setup
    // under paused time could lapse worker 1's lease before it is done.
    tokio::time::pause();
    // Worker 2 keeps heartbeating; worker 1 goes silent.
    tokio::time::sleep(Duration::from_secs(500)).await;
    let load = pb::RankLoad {
        dp_rank: 0,
        running_requests: 2,
        waiting_requests: 0,
        kv_blocks_used: 10,
    };
    server
        .workers()
        .heartbeat(pb::HeartbeatRequest {
            worker_id: 2,
            load: vec![load],
        })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(200)).await;

    let status = server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: 1 })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    // the reaper forgets the worker first, then the index writer thread
    // drops its blocks: give that thread real time (paused time would not)
    let mut blocks = index_blocks(&server).await;
    for _ in 0..200 {
        if blocks == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
        tokio::task::yield_now().await;
        blocks = index_blocks(&server).await;
    }
    assert_eq!(blocks, 1, "the lapsed worker's blocks are gone");
    let survivor = server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: 2 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(survivor.ranks[0].reported_load.unwrap().running_requests, 2);
    let (_, metrics) = server.http_get("/metrics").await;
    assert!(
        metrics.contains("kvroute_leases_expired_total 1"),
        "{metrics}"
    );
    // Routing no longer considers the lapsed worker.
    let reply = server
        .router()
        .select_worker(select_hashes("r", "m", &[1, 2]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.worker_id, 2);
}

#[tokio::test]
async fn a_gap_asks_for_a_resend_and_the_resent_events_apply() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;
    let (tx, mut replies) = server.open_events().await;
    tx.send(batch(1, 0, vec![stored(0, None, &[(11, 1)])]))
        .await
        .unwrap();
    let first = replies.message().await.unwrap().unwrap();
    assert_eq!(
        (first.last_applied_event_id, first.resend_from_event_id),
        (0, None)
    );
    // Events 1 and 2 are lost; 3 arrives.
    tx.send(batch(1, 0, vec![stored(3, Some(13), &[(14, 4)])]))
        .await
        .unwrap();
    let gap = replies.message().await.unwrap().unwrap();
    assert_eq!(gap.resend_from_event_id, Some(1));
    assert_eq!(
        (gap.last_applied_event_id, gap.held_events, gap.rejected),
        (0, 1, 0),
        "3 waits for 1 and 2 (its parent is in them)"
    );
    assert_eq!(cached_blocks(&server, 1).await, Some(1));
    // The worker resends 1..=3, with a duplicate of 1.
    tx.send(batch(
        1,
        0,
        vec![
            stored(1, Some(11), &[(12, 2)]),
            stored(1, Some(11), &[(12, 2)]),
            stored(2, Some(12), &[(13, 3)]),
            stored(3, Some(13), &[(14, 4)]),
        ],
    ))
    .await
    .unwrap();
    let resent = replies.message().await.unwrap().unwrap();
    assert_eq!(resent.resend_from_event_id, None);
    assert_eq!(resent.last_applied_event_id, 3);
    assert_eq!(
        resent.skipped, 2,
        "the duplicate of 1, and the resent 3 (already held)"
    );
    assert_eq!(resent.rejected, 0, "3 applies after its parent");
    assert_eq!(resent.held_events, 0);
    assert_eq!(cached_blocks(&server, 1).await, Some(4));
    let reply = server
        .router()
        .select_worker(select_hashes("q", "m", &[1, 2, 3, 4]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.overlap_blocks, 4);
    // Removed and cleared through the same stream.
    tx.send(batch(1, 0, vec![removed(4, &[13])])).await.unwrap();
    replies.message().await.unwrap().unwrap();
    let after_remove = server
        .router()
        .select_worker(select_hashes("q2", "m", &[1, 2, 3, 4]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        after_remove.overlap_blocks, 2,
        "removing block 3 ends the prefix there"
    );
    tx.send(batch(1, 0, vec![cleared(5)])).await.unwrap();
    replies.message().await.unwrap().unwrap();
    assert_eq!(cached_blocks(&server, 1).await, Some(0));
    let info = server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: 1 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.ranks[0].last_event_id, 5);
    assert_eq!(info.ranks[0].events_skipped, 2);
    assert_eq!(info.ranks[0].events_rejected, 0);
}

#[tokio::test]
async fn a_malformed_batch_ends_only_its_own_stream() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;
    server.register(registration(2, "m")).await;
    let (good_tx, mut good) = server.open_events().await;
    let (bad_tx, mut bad) = server.open_events().await;
    good_tx
        .send(batch(1, 0, vec![stored(0, None, &[(11, 1)])]))
        .await
        .unwrap();
    good.message().await.unwrap().unwrap();

    let empty_store = pb::KvEvent {
        event_id: 0,
        kind: Some(pb::kv_event::Kind::Stored(pb::BlocksStored::default())),
    };
    // A valid event first: the whole batch is refused, nothing applied.
    bad_tx
        .send(batch(2, 0, vec![stored(0, None, &[(21, 1)]), empty_store]))
        .await
        .unwrap();
    let status = bad.message().await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("worker 2") && status.message().contains("no blocks"),
        "{}",
        status.message()
    );
    assert_eq!(cached_blocks(&server, 2).await, Some(0));

    // The other stream goes on.
    good_tx
        .send(batch(1, 0, vec![stored(1, Some(11), &[(12, 2)])]))
        .await
        .unwrap();
    let reply = good.message().await.unwrap().unwrap();
    assert_eq!(reply.last_applied_event_id, 1);
    assert_eq!(cached_blocks(&server, 1).await, Some(2));
    let (_, metrics) = server.http_get("/metrics").await;
    assert!(
        metrics.contains(r#"kvroute_kv_events_total{outcome="rejected",reason="malformed"} 2"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn events_for_unknown_workers_ranks_and_oversized_batches_are_refused() {
    let config = kvroute::config::ServeConfig {
        max_events_per_batch: 2,
        max_blocks_per_event: 3,
        ..kvroute::config::ServeConfig::for_tests()
    };
    let server = TestServer::start_with(config).await;
    server.register(registration(1, "m")).await;
    let cases = [
        (
            batch(9, 0, vec![stored(0, None, &[(1, 1)])]),
            Code::NotFound,
            "worker 9",
        ),
        (
            batch(1, 5, vec![stored(0, None, &[(1, 1)])]),
            Code::FailedPrecondition,
            "dp_rank 5",
        ),
        (
            batch(1, 0, vec![cleared(0), cleared(1), cleared(2)]),
            Code::InvalidArgument,
            "limit of 2",
        ),
        (
            batch(
                1,
                0,
                vec![stored(0, None, &[(1, 1), (2, 2), (3, 3), (4, 4)])],
            ),
            Code::InvalidArgument,
            "limit of 3",
        ),
        (
            batch(
                1,
                0,
                vec![pb::KvEvent {
                    event_id: 0,
                    kind: None,
                }],
            ),
            Code::InvalidArgument,
            "no event kind",
        ),
    ];
    for (bad, code, needle) in cases {
        let status = server.publish(bad).await.unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
        assert!(
            status.message().contains(needle),
            "{needle}: {}",
            status.message()
        );
    }
    // A wrong-length token block is refused too.
    let short_block = pb::KvEvent {
        event_id: 0,
        kind: Some(pb::kv_event::Kind::Stored(pb::BlocksStored {
            tier: 0,
            parent_engine_hash: None,
            blocks: vec![pb::StoredBlock {
                engine_hash: 1,
                content: Some(pb::stored_block::Content::TokenIds(pb::TokenIds {
                    ids: vec![1, 2, 3],
                })),
                mm_info: None,
            }],
            lora_name: String::new(),
            cache_namespace: String::new(),
        })),
    };
    let status = server
        .publish(batch(1, 0, vec![short_block]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("block_size is 16"),
        "{}",
        status.message()
    );
    assert_eq!(index_blocks(&server).await, 0);
}

#[tokio::test]
async fn deregistering_drops_blocks_and_reregistering_starts_anew() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;
    server
        .publish(batch(1, 0, vec![stored(0, None, &[(11, 1), (12, 2)])]))
        .await
        .unwrap();
    // Registering again, even with the same layout, starts a new stream:
    // the engine may have restarted with an empty cache.
    let mut update = registration(1, "m");
    update.taints = vec!["gpu-h100".into()];
    let reply = server
        .workers()
        .register_worker(update)
        .await
        .unwrap()
        .into_inner();
    assert!(!reply.created);
    assert_eq!(cached_blocks(&server, 1).await, Some(0));
    server
        .publish(batch(1, 0, vec![stored(0, None, &[(11, 1), (12, 2)])]))
        .await
        .unwrap();
    assert_eq!(cached_blocks(&server, 1).await, Some(2));
    // Heartbeat for a rank the worker does not have.
    let load = pb::RankLoad {
        dp_rank: 3,
        ..Default::default()
    };
    let status = server
        .workers()
        .heartbeat(pb::HeartbeatRequest {
            worker_id: 1,
            load: vec![load],
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    let removed = server
        .workers()
        .deregister_worker(pb::DeregisterWorkerRequest { worker_id: 1 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(removed.blocks_removed, 2);
    assert_eq!(index_blocks(&server).await, 0);
    let again = server
        .workers()
        .deregister_worker(pb::DeregisterWorkerRequest { worker_id: 1 })
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::NotFound);
}

/// The issue's restarted engine (#38): events 0-4 stored, the worker
/// registers again with the same fields (its engine restarted and counts
/// from 0), and its new event 0 is applied, not skipped as a duplicate of
/// the old stream's; the old stream's blocks are gone.
#[tokio::test]
async fn a_worker_registered_again_starts_a_new_event_stream() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;
    let old: Vec<pb::KvEvent> = (0..5)
        .map(|i| stored(i, None, &[(100 + i, 1000 + i)]))
        .collect();
    let reply = server.publish(batch(1, 0, old)).await.unwrap();
    assert_eq!(reply.last_applied_event_id, 4);
    assert_eq!(cached_blocks(&server, 1).await, Some(5));

    let again = server
        .workers()
        .register_worker(registration(1, "m"))
        .await
        .unwrap()
        .into_inner();
    assert!(!again.created);
    let reply = server
        .publish(batch(1, 0, vec![stored(0, None, &[(7, 70)])]))
        .await
        .unwrap();
    assert_eq!(
        (
            reply.last_applied_event_id,
            reply.skipped,
            reply.resend_from_event_id
        ),
        (0, 0, None),
        "{reply:?}"
    );
    assert_eq!(
        cached_blocks(&server, 1).await,
        Some(1),
        "only the new stream's block"
    );
    let info = server.worker_info(1).await;
    assert_eq!(info.ranks[0].last_event_id, 0);
}

/// The KV capacity a worker registers sizes its index table up front, so
/// the table never rehashes under the index lock as the cache fills.
#[tokio::test]
async fn registered_kv_capacity_sizes_the_index_table_up_front() {
    // room for 60,000 positions of 8 bytes is at least 480 KB
    assert!(memory_after_first_store(60_000).await >= 480_000);
    assert!(memory_after_first_store(0).await < 64_000);
}

/// Index memory on a fresh server once a worker registered with
/// `total_kv_blocks` has stored one block.
async fn memory_after_first_store(total_kv_blocks: u64) -> u64 {
    let server = TestServer::start().await;
    let mut worker = registration(1, "m");
    worker.total_kv_blocks = total_kv_blocks;
    server.register(worker).await;
    server
        .publish(batch(1, 0, vec![stored(0, None, &[(11, 1)])]))
        .await
        .unwrap();
    index_stats(&server).await.memory_bytes
}

#[tokio::test]
async fn shutdown_drains_an_in_flight_stream() {
    let mut server = TestServer::start().await;
    server.register(registration(1, "m")).await;
    let (tx, mut replies) = server.open_events().await;
    tx.send(batch(1, 0, vec![stored(0, None, &[(11, 1)])]))
        .await
        .unwrap();
    replies.message().await.unwrap().unwrap();
    server.begin_shutdown();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The open call still works while the server drains...
    tx.send(batch(1, 0, vec![stored(1, Some(11), &[(12, 2)])]))
        .await
        .unwrap();
    let reply = replies.message().await.unwrap().unwrap();
    assert_eq!(reply.last_applied_event_id, 1);
    // ...and the server finishes once the client closes it.
    drop(tx);
    assert!(replies.message().await.unwrap().is_none());
    server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn a_stream_starts_at_the_first_batch_a_worker_sends() {
    let server = TestServer::start().await;
    // Numbering from 1.
    server.register(registration(1, "m")).await;
    let (tx, mut replies) = server.open_events().await;
    tx.send(batch(1, 0, vec![stored(1, None, &[(11, 1)])]))
        .await
        .unwrap();
    let first = replies.message().await.unwrap().unwrap();
    assert_eq!(
        (first.last_applied_event_id, first.resend_from_event_id),
        (1, None)
    );
    tx.send(batch(1, 0, vec![stored(2, Some(11), &[(12, 2)])]))
        .await
        .unwrap();
    let second = replies.message().await.unwrap().unwrap();
    assert_eq!(
        (second.last_applied_event_id, second.resend_from_event_id),
        (2, None)
    );
    // Resuming at 1000 (kvroute restarted while the worker ran on).
    server.register(registration(2, "m")).await;
    let reply = server
        .publish(batch(2, 0, vec![stored(1000, None, &[(21, 1)])]))
        .await
        .unwrap();
    assert_eq!(
        (reply.last_applied_event_id, reply.resend_from_event_id),
        (1000, None)
    );
    assert_eq!(cached_blocks(&server, 1).await, Some(2));
    assert_eq!(cached_blocks(&server, 2).await, Some(1));
}

#[tokio::test]
async fn an_absurd_id_jump_asks_for_a_resync_not_a_resend() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;
    let (tx, mut replies) = server.open_events().await;
    tx.send(batch(1, 0, vec![stored(0, None, &[(11, 1)])]))
        .await
        .unwrap();
    replies.message().await.unwrap().unwrap();
    tx.send(batch(1, 0, vec![stored(1 << 63, Some(11), &[(12, 2)])]))
        .await
        .unwrap();
    let jump = replies.message().await.unwrap().unwrap();
    assert_eq!(
        jump.resend_from_event_id, None,
        "no worker keeps 2^63 events to resend"
    );
    assert!(jump.resync_required);
    assert_eq!((jump.last_applied_event_id, jump.skipped), (0, 1));
    // Until the worker resynchronises, its events are skipped and every
    // reply says so.
    tx.send(batch(1, 0, vec![stored(1, Some(11), &[(13, 3)])]))
        .await
        .unwrap();
    let next = replies.message().await.unwrap().unwrap();
    assert_eq!(next.resend_from_event_id, None);
    assert!(next.resync_required);
    assert_eq!(cached_blocks(&server, 1).await, Some(1));
    // The resync: cleared, then everything it holds, numbered from the
    // floor the replies name (one past the highest id received).
    let floor = next.resync_from_event_id.expect("a resync floor");
    assert_eq!(floor, (1 << 63) + 1);
    tx.send(batch(
        1,
        0,
        vec![cleared(floor), stored(floor + 1, None, &[(11, 1), (13, 3)])],
    ))
    .await
    .unwrap();
    let resynced = replies.message().await.unwrap().unwrap();
    assert!(!resynced.resync_required);
    assert_eq!(
        (
            resynced.last_applied_event_id,
            resynced.resend_from_event_id
        ),
        (floor + 1, None)
    );
    assert_eq!(cached_blocks(&server, 1).await, Some(2));
    let (_, body) = server.http_get("/metrics").await;
    assert!(
        body.contains(r#"kvroute_kv_events_total{outcome="skipped",reason="resync"} 2"#),
        "{body}"
    );
}

#[tokio::test]
async fn a_rejected_store_comes_back_with_its_reason() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;
    let (tx, mut replies) = server.open_events().await;
    tx.send(batch(1, 0, vec![stored(0, None, &[(11, 1)])]))
        .await
        .unwrap();
    replies.message().await.unwrap().unwrap();
    // Event 2 waits for 1; 1 stores under a block the worker never stored,
    // so it is rejected when its turn comes, and so is 2, chained on it.
    tx.send(batch(1, 0, vec![stored(2, Some(12), &[(13, 3)])]))
        .await
        .unwrap();
    let gap = replies.message().await.unwrap().unwrap();
    assert_eq!(
        (gap.rejected, gap.first_rejection.as_str()),
        (0, ""),
        "nothing is judged past a gap"
    );
    tx.send(batch(1, 0, vec![stored(1, Some(99), &[(12, 2)])]))
        .await
        .unwrap();
    let healed = replies.message().await.unwrap().unwrap();
    assert_eq!(healed.resend_from_event_id, None);
    assert_eq!(healed.rejected, 2);
    assert!(
        healed.first_rejection.contains("parent engine hash 99"),
        "{}",
        healed.first_rejection
    );
    let info = server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: 1 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.ranks[0].events_rejected, 2);
    assert_eq!(info.ranks[0].last_event_id, 2);
}

/// Sends `events` of `worker` as batches of at most 4096 events on an open
/// stream; returns the last reply.
async fn send_events(
    tx: &tokio::sync::mpsc::Sender<pb::KvEventBatch>,
    replies: &mut tonic::Streaming<pb::PublishEventsReply>,
    worker: &TestWorker,
    events: &[(u64, Ev)],
) -> pb::PublishEventsReply {
    let mut last = None;
    for chunk in events.chunks(4096) {
        tx.send(worker.batch(chunk)).await.unwrap();
        last = Some(replies.message().await.unwrap().unwrap());
    }
    last.expect("at least one event")
}

#[tokio::test]
async fn a_worker_told_to_resync_sends_its_cache_and_the_index_holds_exactly_that() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;
    let (tx, mut replies) = server.open_events().await;
    let mut worker = TestWorker::new(1, 0, 1);
    // Chains of 10 blocks sharing their first two local hashes, and evictions
    // at the leaves and in the middle of chains (the blocks below stay held).
    let mut sent = Vec::new();
    let mut tips = Vec::new();
    for chain in 0..8u64 {
        let (id, event) = worker.store(None, &[1, 2]);
        let Ev::Stored { blocks, .. } = &event else {
            unreachable!()
        };
        let root_tip = blocks[1].0;
        sent.push((id, event));
        let locals: Vec<u64> = (0..8).map(|i| 100 * chain + i).collect();
        let (id, event) = worker.store(Some(root_tip), &locals);
        let Ev::Stored { blocks, .. } = &event else {
            unreachable!()
        };
        tips.push(blocks.iter().map(|b| b.0).collect::<Vec<_>>());
        sent.push((id, event));
    }
    sent.push(worker.remove(&[tips[0][7], tips[1][3], tips[2][0]]));
    let reply = send_events(&tx, &mut replies, &worker, &sent).await;
    assert_eq!(reply.resend_from_event_id, None);
    worker.on_reply(Reply::from_pb(&reply), 0);
    assert_eq!(cached_blocks(&server, 1).await, Some(worker.held_count()));

    // One event is lost, and the worker sends more than kvroute holds.
    let _lost = worker.store(Some(tips[3][7]), &[900]);
    let mut after: Vec<(u64, Ev)> = Vec::new();
    let mut tip = tips[4][7];
    for i in 0..cursor::MAX_HELD_EVENTS + 1 {
        let (id, event) = worker.store(Some(tip), &[1000 + i]);
        if let Ev::Stored { blocks, .. } = &event {
            tip = blocks[0].0;
        }
        after.push((id, event));
    }
    after.push(worker.remove(&[tips[5][2]]));
    let reply = send_events(&tx, &mut replies, &worker, &after).await;
    assert!(reply.resync_required, "{reply:?}");
    assert_eq!(reply.resend_from_event_id, None);

    // The reply names the lowest id the answer may start at: one past the
    // highest kvroute received. Below it, an answer is taken for a late copy.
    let floor = reply.resync_from_event_id.expect("a resync floor");
    assert_eq!(floor, after.last().map(|e| e.0 + 1).unwrap());
    let early = vec![(7, Ev::Cleared)];
    let skipped = send_events(&tx, &mut replies, &worker, &early).await;
    assert!(skipped.resync_required, "{skipped:?}");
    // The worker answers with cleared + everything it holds, from there.
    let dump = worker.on_reply(Reply::from_pb(&reply), 7);
    assert_eq!(dump[0], (floor, Ev::Cleared));
    assert_eq!(worker.resyncs, 1);
    let reply = send_events(&tx, &mut replies, &worker, &dump).await;
    assert!(!reply.resync_required, "{reply:?}");
    assert_eq!(reply.resend_from_event_id, None);
    assert_eq!(reply.rejected, 0, "{}", reply.first_rejection);
    assert_eq!(reply.last_applied_event_id, floor + dump.len() as u64 - 1);
    worker.on_reply(Reply::from_pb(&reply), 0);

    let held = worker.held_count();
    assert_eq!(held, 8 * 10 - 3 + 1 + cursor::MAX_HELD_EVENTS + 1 - 1);
    assert_eq!(cached_blocks(&server, 1).await, Some(held));
    assert_eq!(index_blocks(&server).await, held);
    // Blocks below an evicted one keep their path: chain 2 lost its first
    // block after the shared prefix, so a query along it matches 2 blocks.
    let along = |chain: u64| -> Vec<u64> {
        let mut q = vec![1, 2];
        q.extend((0..8).map(|i| 100 * chain + i));
        q
    };
    let overlap = |q: Vec<u64>| {
        let mut router = server.router();
        let mut request = select_hashes("q", "m", &q);
        request.mode = pb::SelectionMode::QueryOnly.into();
        async move {
            router
                .select_worker(request)
                .await
                .unwrap()
                .into_inner()
                .overlap_blocks
        }
    };
    assert_eq!(overlap(along(6)).await, 10);
    assert_eq!(overlap(along(2)).await, 2);
    assert_eq!(overlap(along(1)).await, 5);

    // The stream goes on after the dump, numbered on from it.
    let (id, event) = worker.store(Some(tips[6][7]), &[5000]);
    assert_eq!(id, floor + dump.len() as u64);
    let reply = send_events(&tx, &mut replies, &worker, &[(id, event)]).await;
    assert_eq!((reply.last_applied_event_id, reply.rejected), (id, 0));
    assert_eq!(cached_blocks(&server, 1).await, Some(held + 1));
    let info = server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: 1 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.ranks[0].events_rejected, 0);
    assert_eq!(
        info.ranks[0].events_skipped,
        cursor::MAX_HELD_EVENTS + 3,
        "the held events and the one past the bound (dropped for the resync), \
         the removal after it, and the answer below the floor"
    );
}

#[tokio::test]
async fn rejected_events_show_in_the_admin_api_as_in_the_metrics() {
    let server = TestServer::start().await;
    server.register(registration(3, "m")).await;
    // A block of 3 token ids where the worker's block size is 16: the whole
    // batch of two events is refused.
    let mut bad = stored(0, None, &[(1, 11)]);
    if let Some(pb::kv_event::Kind::Stored(s)) = &mut bad.kind {
        s.blocks[0].content = Some(pb::stored_block::Content::TokenIds(pb::TokenIds {
            ids: vec![1, 2, 3],
        }));
    }
    let refused = server
        .publish(batch(3, 0, vec![stored(0, None, &[(5, 55)]), bad]))
        .await
        .expect_err("malformed");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    // An event the index refuses (its parent is unknown) in a valid batch.
    let reply = server
        .publish(batch(3, 0, vec![stored(0, Some(999), &[(6, 66)])]))
        .await
        .expect("batch");
    assert_eq!(reply.rejected, 1);
    let info = server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: 3 })
        .await
        .expect("worker")
        .into_inner();
    assert_eq!(info.ranks[0].events_rejected, 3, "{info:?}");
    assert_eq!(index_stats(&server).await.events_rejected, 3);
}

/// A worker that pipelines many small batches without waiting for each
/// reply (#38) keeps its connection: h2 closed it with GOAWAY
/// (`too_many_data_frames`) when kvroute fell behind, dropping every other
/// stream on it. Either every batch is answered, or this stream alone ends
/// with RESOURCE_EXHAUSTED naming the documented limit; a call on the same
/// connection works afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_small_batches_keep_the_connection() {
    let server = TestServer::start().await;
    server
        .register(pb::RegisterWorkerRequest {
            total_kv_blocks: 1 << 20,
            ..registration(1, "m")
        })
        .await;
    let channel = common::connect(server.grpc_addr).await;
    let mut client = kvroute::pb::workers_client::WorkersClient::new(channel.clone());
    const BATCHES: u64 = 30_000;
    let (tx, rx) = tokio::sync::mpsc::channel(BATCHES as usize);
    for id in 0..BATCHES {
        tx.send(batch(1, 0, vec![stored(id, None, &[(id + 1, id + 7)])]))
            .await
            .unwrap();
    }
    drop(tx);
    let mut replies = client
        .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // Not reading replies for a while: the worker is slow, or kvroute's
    // replies are; either way kvroute stops taking batches from the stream.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let mut answered = 0u64;
    let ended = loop {
        match replies.message().await {
            Ok(Some(_)) => answered += 1,
            Ok(None) => break None,
            Err(status) => break Some(status),
        }
    };
    match ended {
        None => assert_eq!(answered, BATCHES, "every batch answered"),
        Some(status) => {
            assert_eq!(
                status.code(),
                Code::ResourceExhausted,
                "{status:?} after {answered}"
            );
            assert!(status.message().contains("unanswered"), "{status:?}");
        }
    }
    // The connection is still there for other calls.
    kvroute::pb::workers_client::WorkersClient::new(channel)
        .heartbeat(pb::HeartbeatRequest {
            worker_id: 1,
            load: vec![],
        })
        .await
        .expect("the same connection serves the next call");
}
