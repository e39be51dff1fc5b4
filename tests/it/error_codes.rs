//! One test per row of the error table (docs/CONFIGURATION.md, "Errors
//! and limits"): each situation gets its code over real gRPC, and its
//! message names the request or the worker concerned.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::time::Duration;

use common::{TestServer, batch, cleared, registration, select_hashes, stored};
use kvroute::{config::ServeConfig, pb};
use tonic::Code;

async fn select(server: &TestServer, request: pb::SelectWorkerRequest) -> tonic::Status {
    server
        .router()
        .select_worker(request)
        .await
        .expect_err("the call must fail")
}

fn assert_status(status: &tonic::Status, code: Code, names: &[&str]) {
    assert_eq!(status.code(), code, "{status:?}");
    for name in names {
        assert!(
            status.message().contains(name),
            "{name:?} not in {status:?}"
        );
    }
}

fn pinned(request_id: &str, hints: pb::RoutingHints) -> pb::SelectWorkerRequest {
    pb::SelectWorkerRequest {
        hints: Some(hints),
        ..select_hashes(request_id, "m", &[1, 2])
    }
}

/// Worker 1 of model "m", busy: a small batch size (busy above 64 booked
/// prefill tokens) and a RESERVE of 160 prompt tokens.
async fn make_busy(server: &TestServer) {
    let mut small = registration(1, "m");
    small.max_num_batched_tokens = 16;
    server.register(small).await;
    server
        .router()
        .select_worker(select_hashes(
            "first",
            "m",
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        ))
        .await
        .unwrap();
}

fn mm_info(hashes: usize) -> pb::BlockMultimodalInfo {
    pb::BlockMultimodalInfo {
        mm_hashes: (0..hashes as u64).collect(),
    }
}

#[tokio::test]
async fn invalid_argument_malformed_empty_unknown_and_oversized() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;

    let mut empty = select_hashes("r-empty", "m", &[]);
    empty.prompt = None;
    assert_status(
        &select(&server, empty).await,
        Code::InvalidArgument,
        &["r-empty"],
    );

    let mut phase = select_hashes("r-phase", "m", &[1]);
    phase.phase = 9;
    assert_status(
        &select(&server, phase).await,
        Code::InvalidArgument,
        &["r-phase", "phase"],
    );

    // Size limits: a long name, many multimodal hashes in one block, a
    // Heartbeat with more load entries than ranks.
    let mut long = select_hashes("r-long", "m", &[1]);
    long.lora_name = "x".repeat(2000);
    assert_status(
        &select(&server, long).await,
        Code::InvalidArgument,
        &["r-long", "lora_name"],
    );

    let mut mm = select_hashes("r-mm", "m", &[1]);
    mm.block_mm_infos = vec![mm_info(65)];
    assert_status(
        &select(&server, mm).await,
        Code::InvalidArgument,
        &["r-mm", "multimodal"],
    );

    let mut event = stored(0, None, &[]);
    if let Some(pb::kv_event::Kind::Stored(s)) = &mut event.kind {
        s.blocks.push(pb::StoredBlock {
            engine_hash: 1,
            content: Some(pb::stored_block::Content::TokenIds(pb::TokenIds {
                ids: (0..16).collect(),
            })),
            mm_info: Some(mm_info(1_000_000)),
        });
    }
    let status = server.publish(batch(1, 0, vec![event])).await.unwrap_err();
    assert_status(&status, Code::InvalidArgument, &["worker 1", "multimodal"]);

    for entries in [2, 1025, 1_000_000] {
        let load = vec![pb::RankLoad::default(); entries];
        let status = server
            .workers()
            .heartbeat(pb::HeartbeatRequest { worker_id: 1, load })
            .await
            .unwrap_err();
        assert_status(&status, Code::InvalidArgument, &["worker 1", "load"]);
    }
    // None of it changed the worker.
    let info = server.worker_info(1).await;
    assert_eq!(info.ranks[0].cached_blocks, 0);
}

#[tokio::test]
async fn not_found_pinned_or_named_worker_unknown() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;
    let hints = pb::RoutingHints {
        backend_instance_id: Some(9),
        ..Default::default()
    };
    assert_status(
        &select(&server, pinned("r-pin", hints)).await,
        Code::NotFound,
        &["r-pin", "9"],
    );
    let status = server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: 9 })
        .await
        .unwrap_err();
    assert_status(&status, Code::NotFound, &["worker 9"]);
}

#[tokio::test]
async fn failed_precondition_rank_block_size_and_cordon() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;

    // A dp rank the worker does not have, wherever it is named.
    let status = server
        .workers()
        .heartbeat(pb::HeartbeatRequest {
            worker_id: 1,
            load: vec![pb::RankLoad {
                dp_rank: 5,
                ..Default::default()
            }],
        })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::FailedPrecondition,
        &["worker 1", "dp_rank 5"],
    );
    let status = server
        .publish(batch(1, 5, vec![cleared(0)]))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::FailedPrecondition,
        &["worker 1", "dp_rank 5"],
    );
    let hints = pb::RoutingHints {
        backend_instance_id: Some(1),
        dp_rank: Some(5),
        ..Default::default()
    };
    assert_status(
        &select(&server, pinned("r-rank", hints)).await,
        Code::FailedPrecondition,
        &["r-rank"],
    );

    // A block size other than the model's.
    let status = server
        .workers()
        .register_worker(pb::RegisterWorkerRequest {
            block_size: 32,
            ..registration(2, "m")
        })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::FailedPrecondition,
        &["worker 2", "block_size"],
    );

    // A pin to a cordoned worker.
    server
        .admin()
        .cordon_worker(pb::CordonWorkerRequest { worker_id: 1 })
        .await
        .unwrap();
    let hints = pb::RoutingHints {
        backend_instance_id: Some(1),
        ..Default::default()
    };
    assert_status(
        &select(&server, pinned("r-cordon", hints)).await,
        Code::FailedPrecondition,
        &["r-cordon"],
    );
}

#[tokio::test]
async fn unavailable_no_eligible_worker() {
    let server = TestServer::start().await;
    assert_status(
        &select(&server, select_hashes("r-none", "m", &[1])).await,
        Code::Unavailable,
        &["r-none"],
    );
}

#[tokio::test]
async fn resource_exhausted_limits_and_busy_rejects() {
    let mut config = ServeConfig::for_tests();
    config.limits.max_workers = 1;
    let server = TestServer::start_with(config).await;
    make_busy(&server).await;
    let status = server
        .workers()
        .register_worker(registration(2, "m"))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::ResourceExhausted,
        &["worker 2", "max_workers"],
    );
    let mut reject = select_hashes("r-busy", "m", &[50]);
    reject.admission = pb::AdmissionMode::Reject.into();
    assert_status(
        &select(&server, reject).await,
        Code::ResourceExhausted,
        &["r-busy", "busy"],
    );
}

#[tokio::test]
async fn deadline_exceeded_queued_past_the_deadline() {
    // The server's own deadline (a client's grpc-timeout races its own
    // timer on the client side).
    let config = ServeConfig {
        request_timeout: Duration::from_millis(300),
        ..ServeConfig::for_tests()
    };
    let server = TestServer::start_with(config).await;
    make_busy(&server).await;
    let status = select(&server, select_hashes("r-late", "m", &[50])).await;
    assert_status(&status, Code::DeadlineExceeded, &["r-late"]);
}

#[tokio::test]
async fn out_of_range_message_over_the_size_limit() {
    let mut config = ServeConfig::for_tests();
    config.max_message_bytes = 64 * 1024;
    let server = TestServer::start_with(config).await;
    server.register(registration(1, "m")).await;
    let hashes: Vec<u64> = (0..20_000).collect();
    let status = select(&server, select_hashes("r-big", "m", &hashes)).await;
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    // The server is unharmed.
    server
        .router()
        .select_worker(select_hashes("r-small", "m", &[1]))
        .await
        .unwrap();
}

/// Request metadata past 16 KiB (#38) is RESOURCE_EXHAUSTED naming the
/// limit, not UNKNOWN, up to what HTTP/2 lets kvroute read at all; the
/// connection stays usable for the next call.
#[tokio::test]
async fn resource_exhausted_request_metadata_over_the_limit() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await;
    let mut router = server.router();
    for size in [17 * 1024, 40 * 1024, 60 * 1024] {
        let mut request = tonic::Request::new(select_hashes("big", "m", &[1, 2]));
        request.metadata_mut().insert(
            "x-padding",
            "p".repeat(size).parse().expect("ascii metadata"),
        );
        let status = router.select_worker(request).await.expect_err("refused");
        assert_status(&status, Code::ResourceExhausted, &["metadata", "16384"]);
        router
            .select_worker(select_hashes(&format!("after-{size}"), "m", &[1, 2]))
            .await
            .expect("the same connection serves the next call");
    }
}
