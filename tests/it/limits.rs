//! What a caller may make kvroute hold: registrations are bounded by the
//! server's limits (workers, models, ranks, capacity per rank, the index
//! memory budget), not by what they claim; a worker cannot store more
//! blocks than its declared capacity; and every refusal is visible in the
//! Admin API and the metrics.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{
    TestServer, batch, claim, refused, registration, removed, select_hashes, stored, try_register,
};
use kvroute::{config::ServeConfig, pb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_are_held_to_the_servers_limits() {
    let mut config = ServeConfig::for_tests();
    config.limits.max_workers = 3;
    config.limits.max_models = 2;
    config.limits.max_ranks_per_worker = 4;
    config.limits.max_kv_blocks_per_rank = 1000;
    config.limits.default_kv_blocks_per_rank = 500;
    config.limits.index_memory_budget = 96 * 4000; // 4,000 blocks of capacity
    let server = TestServer::start_with(config).await;

    refused(&server, claim(1, "a", 1, 1001), "max_kv_blocks_per_rank").await;
    refused(
        &server,
        claim(1, "a", 1, u64::MAX),
        "max_kv_blocks_per_rank",
    )
    .await;
    refused(&server, claim(1, "a", 5, 10), "max_ranks_per_worker").await;
    try_register(&server, claim(1, "a", 3, 1000)).await.unwrap();
    // 3,000 + 2 x 1,000 > 4,000
    refused(&server, claim(2, "a", 2, 1000), "index_memory_budget").await;
    // A worker that declares no capacity is counted at the default (500).
    try_register(&server, claim(2, "b", 1, 0)).await.unwrap();
    refused(&server, claim(3, "c", 1, 10), "max_models").await;
    try_register(&server, claim(3, "a", 1, 10)).await.unwrap();
    refused(&server, claim(4, "a", 1, 10), "max_workers").await;
    // Re-registering is not one more worker, and may claim less.
    try_register(&server, claim(1, "a", 3, 100)).await.unwrap();
    // A worker moving to a new model while its old one empties is fine.
    try_register(&server, claim(2, "c", 1, 0)).await.unwrap();

    // Capacity given back is free for others at once.
    refused(&server, claim(4, "a", 3, 1000), "max_workers").await;
    server
        .workers()
        .deregister_worker(pb::DeregisterWorkerRequest { worker_id: 3 })
        .await
        .unwrap();
    try_register(&server, claim(4, "a", 3, 1000)).await.unwrap();
    refused(&server, claim(1, "a", 3, 1000), "index_memory_budget").await;

    // Refusals are counted by code.
    let (_, body) = server.http_get("/metrics").await;
    let line = body
        .lines()
        .find(|l| {
            l.starts_with("kvroute_rpc_requests_total")
                && l.contains("RESOURCE_EXHAUSTED")
                && l.contains("RegisterWorker")
        })
        .expect("refusals counted");
    assert!(line.ends_with(" 8"), "{line}");
    // The refused registrations left nothing behind.
    let workers = server
        .admin()
        .list_workers(pb::ListWorkersRequest::default())
        .await
        .unwrap()
        .into_inner()
        .workers;
    let ids: Vec<u64> = workers.iter().map(|w| w.worker_id).collect();
    assert_eq!(ids, [1, 2, 4]);
}

/// A declaration no server accepts, whatever its limits, is
/// INVALID_ARGUMENT, checked before the server's own limits (#38: dp_size
/// 1025 was RESOURCE_EXHAUSTED of `max_ranks_per_worker`).
#[tokio::test]
async fn hard_limits_are_invalid_arguments_before_server_limits() {
    let server = TestServer::start().await;
    for (request, field) in [
        (claim(1, "a", 1025, 10), "dp_size 1025"),
        (
            pb::RegisterWorkerRequest {
                block_size: 65_537,
                ..claim(1, "a", 1, u64::MAX)
            },
            "block_size",
        ),
    ] {
        let status = try_register(&server, request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains(field) && status.message().contains("worker 1"),
            "{status:?}"
        );
    }
}

fn blocks(from: u64, n: u64) -> Vec<(u64, u64)> {
    (from..from + n).map(|i| (i, i * 7 + 1)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cannot_store_past_its_capacity() {
    let server = TestServer::start().await;
    server.register(claim(1, "m", 1, 100)).await;

    let first = blocks(1, 60);
    let reply = server
        .publish(batch(1, 0, vec![stored(0, None, &first)]))
        .await
        .unwrap();
    assert_eq!((reply.last_applied_event_id, reply.rejected), (0, 0));

    // 60 more would make 120 of 100.
    let second = blocks(61, 60);
    let reply = server
        .publish(batch(1, 0, vec![stored(1, Some(60), &second)]))
        .await
        .unwrap();
    assert_eq!((reply.last_applied_event_id, reply.rejected), (1, 1));
    assert!(
        reply.first_rejection.contains("capacity of 100"),
        "{}",
        reply.first_rejection
    );

    let info = server.worker_info(1).await;
    assert_eq!(
        info.ranks[0].cached_blocks, 60,
        "the rejected store left nothing"
    );
    assert_eq!(info.ranks[0].events_rejected, 1);
    let stats = server.index_stats().await;
    assert_eq!((stats.blocks, stats.events_rejected), (60, 1));
    let (_, body) = server.http_get("/metrics").await;
    assert!(
        body.contains(r#"kvroute_kv_events_total{outcome="rejected",reason="over_capacity"} 1"#),
        "{body}"
    );

    // After evicting 30, the engine may store 70 more (to exactly 100).
    let evicted: Vec<u64> = (31..=60).collect();
    let reply = server
        .publish(batch(
            1,
            0,
            vec![removed(2, &evicted), stored(3, Some(30), &blocks(200, 70))],
        ))
        .await
        .unwrap();
    assert_eq!((reply.last_applied_event_id, reply.rejected), (3, 0));
    let info = server.worker_info(1).await;
    assert_eq!(info.ranks[0].cached_blocks, 100);
}

/// A worker that declares no capacity is held to the server's default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undeclared_capacity_is_the_servers_default() {
    let mut config = ServeConfig::for_tests();
    config.limits.default_kv_blocks_per_rank = 50;
    let server = TestServer::start_with(config).await;
    server.register(claim(1, "m", 1, 0)).await;
    let reply = server
        .publish(batch(1, 0, vec![stored(0, None, &blocks(1, 51))]))
        .await
        .unwrap();
    assert_eq!(reply.rejected, 1, "{reply:?}");
    let reply = server
        .publish(batch(1, 0, vec![stored(1, None, &blocks(1, 50))]))
        .await
        .unwrap();
    assert_eq!(reply.rejected, 0, "{reply:?}");
}

/// The issue's flood (#38): RESERVE of one long prompt, again and again
/// under new request ids, never released, on an APPROXIMATE worker that
/// already caches it (so it never looks busy). Open bookings stop at the
/// bound with RESOURCE_EXHAUSTED, counted, and a release makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_bookings_are_held_to_their_bound() {
    let prompt: Vec<u64> = (1..=4096).collect();
    let one = kvroute_core::admission::bookings::booking_cost("flood-00", prompt.len());
    let mut config = ServeConfig::for_tests();
    config.limits.max_booking_memory = 5 * one + one / 2;
    let server = TestServer::start_with(config).await;
    let mut approximate = registration(1, "m");
    approximate.kv_events = pb::KvEventsMode::Approximate.into();
    approximate.total_kv_blocks = 100_000;
    server.register(approximate).await;

    let mut router = server.router();
    router
        .select_worker(select_hashes("warm", "m", &prompt))
        .await
        .unwrap();
    router
        .mark_prefill_complete(pb::MarkPrefillCompleteRequest {
            request_id: "warm".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    router
        .release_request(pb::ReleaseRequestRequest {
            request_id: "warm".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    for i in 0..5 {
        let id = format!("flood-{i:02}");
        router
            .select_worker(select_hashes(&id, "m", &prompt))
            .await
            .unwrap_or_else(|s| panic!("booking {i}: {s:?}"));
    }
    for i in 5..8 {
        let status = router
            .select_worker(select_hashes(&format!("flood-{i:02}"), "m", &prompt))
            .await
            .expect_err("past the bound");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(
            status.message().contains("all callers") && status.message().contains("bound"),
            "{status:?}"
        );
    }
    // A short prompt still fits in what is left.
    router
        .select_worker(select_hashes("short", "m", &prompt[..16]))
        .await
        .unwrap();
    // Asking costs nothing: QUERY_ONLY is answered while the bound holds.
    let mut query = select_hashes("look", "m", &prompt);
    query.mode = pb::SelectionMode::QueryOnly.into();
    router.select_worker(query).await.unwrap();

    let (_, body) = server.http_get("/metrics").await;
    let refused = body
        .lines()
        .find(|l| l.starts_with("kvroute_bookings_refused_total{bound=\"all\"}"))
        .expect("refusals counted");
    assert!(refused.ends_with(" 3"), "{refused}");
    let active = body
        .lines()
        .find(|l| l.starts_with("kvroute_bookings_active "))
        .unwrap();
    assert!(active.ends_with(" 6"), "{active}");

    // A release makes room again.
    router
        .release_request(pb::ReleaseRequestRequest {
            request_id: "flood-00".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    router
        .select_worker(select_hashes("flood-05", "m", &prompt))
        .await
        .unwrap();
}
