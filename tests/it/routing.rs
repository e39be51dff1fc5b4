//! SelectWorker over real gRPC: the seven-block scenario, booked load,
//! phase pins, admission, and every error code of the API's table.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::time::Duration;

use common::{TestServer, batch, registration, select_hashes, stored};
use kvroute::{config::ServeConfig, pb};
use tonic::Code;

const A: u64 = 0xA;
const B: u64 = 0xB;
const C: u64 = 0xC;
const D: u64 = 0xD;
const E: u64 = 0xE;
const F: u64 = 0xF;
const G: u64 = 0x10;
const WORKER_A: u64 = 1;
const WORKER_B: u64 = 2;

/// Worker a holds [A,B] and [A,C,D]; worker b holds [A,C,E].
async fn seven_block_fleet() -> TestServer {
    let server = TestServer::start().await;
    server.register(registration(WORKER_A, "m")).await;
    server.register(registration(WORKER_B, "m")).await;
    let a = batch(
        WORKER_A,
        0,
        vec![
            stored(0, None, &[(101, A), (102, B)]),
            stored(1, Some(101), &[(103, C), (104, D)]),
        ],
    );
    let reply = server.publish(a).await.unwrap();
    assert_eq!((reply.last_applied_event_id, reply.rejected), (1, 0));
    let b = batch(
        WORKER_B,
        0,
        vec![stored(0, None, &[(201, A), (202, C), (203, E)])],
    );
    server.publish(b).await.unwrap();
    server
}

fn query_only(mut request: pb::SelectWorkerRequest) -> pb::SelectWorkerRequest {
    request.mode = pb::SelectionMode::QueryOnly.into();
    request
}

#[tokio::test]
async fn seven_blocks_longest_prefix_then_fewer_cached_blocks() {
    let server = seven_block_fleet().await;
    let mut router = server.router();
    for i in 0..100 {
        let reply = router
            .select_worker(query_only(select_hashes(
                &format!("q{i}"),
                "m",
                &[A, C, D, F],
            )))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((reply.worker_id, reply.overlap_blocks), (WORKER_A, 3));
        assert_eq!(reply.cached_tokens, 48);
        assert_eq!(reply.total_blocks, 4);
        assert_eq!(reply.admission(), pb::AdmissionResult::Untracked);
        let tie = router
            .select_worker(query_only(select_hashes(&format!("t{i}"), "m", &[A, C, G])))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (tie.worker_id, tie.overlap_blocks),
            (WORKER_B, 2),
            "tie goes to fewer cached blocks"
        );
    }
    // QUERY_ONLY booked nothing.
    let info = server
        .admin()
        .get_worker(pb::GetWorkerRequest {
            worker_id: WORKER_A,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.ranks[0].booked_load.unwrap().active_requests, 0);
    assert_eq!(info.ranks[0].cached_blocks, 4);
}

#[tokio::test]
async fn reserve_shifts_to_the_other_worker_once_booked_load_outweighs_overlap() {
    let server = seven_block_fleet().await;
    let mut router = server.router();
    let mut chosen = Vec::new();
    for i in 0..6 {
        let reply = router
            .select_worker(select_hashes(&format!("r{i}"), "m", &[A, C, D, F]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(reply.admission(), pb::AdmissionResult::Admitted);
        chosen.push(reply.worker_id);
    }
    assert_eq!(chosen[0], WORKER_A, "{chosen:?}");
    assert!(
        chosen.contains(&WORKER_B),
        "booked load never moved the choice: {chosen:?}"
    );
    // Releasing everything brings the first choice back.
    for i in 0..6 {
        let released = router
            .release_request(pb::ReleaseRequestRequest {
                cached_tokens: None,
                request_id: format!("r{i}"),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(released.changed);
        let again = router
            .release_request(pb::ReleaseRequestRequest {
                cached_tokens: None,
                request_id: format!("r{i}"),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!again.changed, "release is idempotent");
    }
    let reply = router
        .select_worker(query_only(select_hashes("after", "m", &[A, C, D, F])))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.worker_id, WORKER_A);
}

#[tokio::test]
async fn token_prompts_are_hashed_like_the_events() {
    let server = TestServer::start().await;
    server.register(registration(WORKER_A, "m")).await;
    server.register(registration(WORKER_B, "m")).await;
    let tokens: Vec<u32> = (0..40).collect();
    // Worker b stores the first two blocks of the prompt as token ids.
    let blocks = tokens
        .chunks_exact(16)
        .enumerate()
        .map(|(i, chunk)| pb::StoredBlock {
            engine_hash: 500 + i as u64,
            content: Some(pb::stored_block::Content::TokenIds(pb::TokenIds {
                ids: chunk.to_vec(),
            })),
            mm_info: None,
        })
        .collect();
    let event = pb::KvEvent {
        event_id: 0,
        kind: Some(pb::kv_event::Kind::Stored(pb::BlocksStored {
            tier: 0,
            parent_engine_hash: None,
            blocks,
            lora_name: String::new(),
            cache_namespace: String::new(),
        })),
    };
    server
        .publish(batch(WORKER_B, 0, vec![event]))
        .await
        .unwrap();
    let request = pb::SelectWorkerRequest {
        request_id: "tok".into(),
        model: "m".into(),
        prompt: Some(pb::Prompt {
            content: Some(pb::prompt::Content::TokenIds(pb::TokenIds { ids: tokens })),
        }),
        mode: pb::SelectionMode::QueryOnly.into(),
        ..Default::default()
    };
    let reply = server
        .router()
        .select_worker(request)
        .await
        .unwrap()
        .into_inner();
    // total_blocks counts the partial last block, as the reference does.
    assert_eq!(
        (reply.worker_id, reply.overlap_blocks, reply.total_blocks),
        (WORKER_B, 2, 3)
    );
    assert_eq!(reply.cached_tokens, 32);
}

#[tokio::test]
async fn phase_pins_follow_the_reference_precedence() {
    let server = seven_block_fleet().await;
    let hints = pb::RoutingHints {
        backend_instance_id: Some(WORKER_A),
        prefill_worker_id: Some(WORKER_B),
        ..Default::default()
    };
    let mut request = query_only(select_hashes("p", "m", &[A, C, D]));
    request.hints = Some(hints.clone());
    request.phase = pb::RequestPhase::Prefill.into();
    assert_eq!(chosen_worker(&server, request.clone()).await, WORKER_B);
    // Decode and aggregated ignore prefill_worker_id and use backend_instance_id...
    request.phase = pb::RequestPhase::Decode.into();
    assert_eq!(chosen_worker(&server, request.clone()).await, WORKER_A);
    request.phase = pb::RequestPhase::Aggregated.into();
    assert_eq!(chosen_worker(&server, request.clone()).await, WORKER_A);
    // ...unless decode_worker_id is set, which wins.
    request.hints = Some(pb::RoutingHints {
        decode_worker_id: Some(WORKER_B),
        ..hints
    });
    assert_eq!(chosen_worker(&server, request).await, WORKER_B);
}

/// The worker a successful SelectWorker chose.
async fn chosen_worker(server: &TestServer, request: pb::SelectWorkerRequest) -> u64 {
    server
        .router()
        .select_worker(request)
        .await
        .unwrap()
        .into_inner()
        .worker_id
}

async fn code_of(server: &TestServer, request: pb::SelectWorkerRequest) -> (Code, String) {
    let status = server
        .router()
        .select_worker(request)
        .await
        .expect_err("should fail");
    (status.code(), status.message().to_string())
}

#[tokio::test]
async fn each_error_code_of_the_api_table() {
    let config = ServeConfig {
        queue_capacity: 1,
        ..ServeConfig::for_tests()
    };
    let server = TestServer::start_with(config).await;
    server.register(registration(WORKER_A, "m")).await;
    let mut two_ranks = registration(3, "m");
    two_ranks.dp_size = 2;
    server.register(two_ranks).await;

    // INVALID_ARGUMENT: empty prompt, unknown phase.
    let (code, message) = code_of(&server, select_hashes("empty", "m", &[])).await;
    assert_eq!(code, Code::InvalidArgument);
    assert!(message.contains("empty"), "{message}");
    let mut bad_phase = select_hashes("phase", "m", &[A]);
    bad_phase.phase = 9;
    assert_eq!(code_of(&server, bad_phase).await.0, Code::InvalidArgument);

    // NOT_FOUND: a pin to an unknown worker, naming it.
    let mut unknown = select_hashes("nf", "m", &[A]);
    unknown.hints = Some(pb::RoutingHints {
        backend_instance_id: Some(999),
        ..Default::default()
    });
    let (code, message) = code_of(&server, unknown).await;
    assert_eq!(code, Code::NotFound);
    assert!(
        message.contains("999") && message.contains("nf"),
        "{message}"
    );

    // FAILED_PRECONDITION: a rank that cannot be resolved.
    let mut no_rank = select_hashes("rank", "m", &[A]);
    no_rank.hints = Some(pb::RoutingHints {
        backend_instance_id: Some(3),
        ..Default::default()
    });
    let (code, message) = code_of(&server, no_rank).await;
    assert_eq!(code, Code::FailedPrecondition);
    assert!(message.contains("explicit dp_rank"), "{message}");

    // FAILED_PRECONDITION: planned worker conflicts with the pin; both named.
    let mut conflict = select_hashes("plan", "m", &[A]);
    conflict.hints = Some(pb::RoutingHints {
        backend_instance_id: Some(WORKER_A),
        ..Default::default()
    });
    conflict.planned_worker = Some(pb::WorkerRank {
        worker_id: 3,
        dp_rank: 1,
    });
    let (code, message) = code_of(&server, conflict).await;
    assert_eq!(code, Code::FailedPrecondition);
    assert!(
        message.contains('3') && message.contains(&WORKER_A.to_string()),
        "{message}"
    );

    // FAILED_PRECONDITION: block size mismatch at registration.
    let mut wrong_size = registration(4, "m");
    wrong_size.block_size = 32;
    let status = server
        .workers()
        .register_worker(wrong_size)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains("32") && status.message().contains("16"),
        "{}",
        status.message()
    );

    // FAILED_PRECONDITION: pin to a cordoned worker.
    server
        .admin()
        .cordon_worker(pb::CordonWorkerRequest {
            worker_id: WORKER_A,
        })
        .await
        .unwrap();
    let mut cordoned = select_hashes("cordon", "m", &[A]);
    cordoned.hints = Some(pb::RoutingHints {
        backend_instance_id: Some(WORKER_A),
        ..Default::default()
    });
    let (code, message) = code_of(&server, cordoned).await;
    assert_eq!(code, Code::FailedPrecondition, "{message}");
    server
        .admin()
        .uncordon_worker(pb::UncordonWorkerRequest {
            worker_id: WORKER_A,
        })
        .await
        .unwrap();

    // UNAVAILABLE: every worker excluded by migration; a model with no workers.
    let mut exhausted = select_hashes("mig", "m", &[A]);
    exhausted.excluded_worker_ids = vec![WORKER_A, 3];
    assert_eq!(code_of(&server, exhausted).await.0, Code::Unavailable);
    assert_eq!(
        code_of(&server, select_hashes("none", "other-model", &[A]))
            .await
            .0,
        Code::Unavailable
    );
}

/// One worker that is busy after a single booking of 10 uncached blocks.
async fn busy_fleet(config: ServeConfig) -> TestServer {
    let server = TestServer::start_with(config).await;
    let mut small = registration(WORKER_A, "m");
    small.max_num_batched_tokens = 16; // busy above 64 booked prefill tokens
    server.register(small).await;
    let first = server
        .router()
        .select_worker(select_hashes(
            "first",
            "m",
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.admission(), pb::AdmissionResult::Admitted);
    server
}

fn with_admission(
    mut request: pb::SelectWorkerRequest,
    mode: pb::AdmissionMode,
) -> pb::SelectWorkerRequest {
    request.admission = mode.into();
    request
}

#[tokio::test]
async fn busy_workers_reject_advise_queue_and_time_out() {
    let config = ServeConfig {
        queue_capacity: 1,
        ..ServeConfig::for_tests()
    };
    let server = busy_fleet(config).await;
    let mut router = server.router();

    let (code, message) = code_of(
        &server,
        with_admission(select_hashes("rej", "m", &[50]), pb::AdmissionMode::Reject),
    )
    .await;
    assert_eq!(code, Code::ResourceExhausted);
    assert!(
        message.contains("rej") && message.contains("busy"),
        "{message}"
    );

    let advisory = router
        .select_worker(with_admission(
            select_hashes("adv", "m", &[50]),
            pb::AdmissionMode::Advisory,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(advisory.admission(), pb::AdmissionResult::Untracked);
    let load = advisory.advisory_load.expect("advisory answers with load");
    assert_eq!((load.prefill_tokens, load.active_requests), (160, 1));

    // WAIT with a short deadline: DEADLINE_EXCEEDED, and nothing left behind.
    let mut request = tonic::Request::new(select_hashes("late", "m", &[50]));
    request.set_timeout(Duration::from_millis(1000));
    let status = router.select_worker(request).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("late"));

    // A full queue: one waiter fills it, the next is refused.
    let waiter = queued_waiter(&server, "waiter").await;
    let (code, message) = code_of(&server, select_hashes("overflow", "m", &[70])).await;
    assert_eq!(code, Code::ResourceExhausted);
    assert!(message.contains("queue"), "{message}");

    // Releasing the booking admits the waiter.
    router
        .release_request(pb::ReleaseRequestRequest {
            cached_tokens: None,
            request_id: "first".into(),
        })
        .await
        .unwrap();
    let admitted = waiter.await.unwrap().unwrap().into_inner();
    assert_eq!(
        admitted.admission(),
        pb::AdmissionResult::AdmittedAfterQueue
    );
    assert_eq!(admitted.worker_id, WORKER_A);
}

#[tokio::test]
async fn a_caller_that_goes_away_leaves_no_booking_or_queue_entry() {
    let server = busy_fleet(ServeConfig::for_tests()).await;
    let waiter = queued_waiter(&server, "gone").await;
    waiter.abort();
    wait_for_queue_depth(&server, 0).await;
    server
        .router()
        .release_request(pb::ReleaseRequestRequest {
            cached_tokens: None,
            request_id: "first".into(),
        })
        .await
        .unwrap();
    let info = server
        .admin()
        .get_worker(pb::GetWorkerRequest {
            worker_id: WORKER_A,
        })
        .await
        .unwrap()
        .into_inner();
    let booked = info.ranks[0].booked_load.unwrap();
    assert_eq!(
        (
            booked.active_requests,
            booked.prefill_tokens,
            booked.decode_blocks
        ),
        (0, 0, 0)
    );
}

/// A SelectWorker for block 60 in its own task, once it waits in the queue.
async fn queued_waiter(
    server: &TestServer,
    request_id: &str,
) -> tokio::task::JoinHandle<Result<tonic::Response<pb::SelectWorkerResponse>, tonic::Status>> {
    let mut router = server.router();
    let request = select_hashes(request_id, "m", &[60]);
    let waiter = tokio::spawn(async move { router.select_worker(request).await });
    wait_for_queue_depth(server, 1).await;
    waiter
}

async fn wait_for_queue_depth(server: &TestServer, depth: usize) {
    let line = format!("kvroute_admission_queue_depth {depth}");
    for _ in 0..200 {
        let (_, body) = server.http_get("/metrics").await;
        if body.lines().any(|l| l == line) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("queue depth never reached {depth}");
}
