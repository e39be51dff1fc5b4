//! Workers without KV events, over real gRPC: APPROXIMATE workers are
//! scored on what kvroute predicts from its own bookings, AUTO workers
//! until their first event, and a fleet of both kinds is scored together.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use crate::common;

use common::{TestServer, batch, registration, select_hashes, stored};
use kvroute::pb;
use tonic::Code;

fn with_mode(
    mut request: pb::RegisterWorkerRequest,
    mode: pb::KvEventsMode,
) -> pb::RegisterWorkerRequest {
    request.kv_events = mode.into();
    request
}

fn pinned(mut request: pb::SelectWorkerRequest, worker_id: u64) -> pb::SelectWorkerRequest {
    request.hints = Some(pb::RoutingHints {
        backend_instance_id: Some(worker_id),
        ..Default::default()
    });
    request
}

async fn reserve(
    server: &TestServer,
    request: pb::SelectWorkerRequest,
) -> pb::SelectWorkerResponse {
    server
        .router()
        .select_worker(request)
        .await
        .expect("select worker")
        .into_inner()
}

async fn release(server: &TestServer, request_id: &str) {
    let released = server
        .router()
        .release_request(pb::ReleaseRequestRequest {
            cached_tokens: None,
            request_id: request_id.into(),
        })
        .await
        .expect("release")
        .into_inner();
    assert!(released.changed, "{request_id} was booked");
}

async fn mark_prefill_complete(server: &TestServer, request_id: &str) {
    server
        .router()
        .mark_prefill_complete(pb::MarkPrefillCompleteRequest {
            cached_tokens: None,
            request_id: request_id.into(),
        })
        .await
        .expect("prefill complete");
}

async fn explain(
    server: &TestServer,
    request: pb::SelectWorkerRequest,
) -> Vec<pb::CandidateExplanation> {
    let mut candidates = server
        .admin()
        .explain_selection(request)
        .await
        .expect("explain")
        .into_inner()
        .candidates;
    candidates.sort_by_key(|c| c.worker_id);
    candidates
}

/// Each candidate's worker, view and overlap.
fn views(candidates: &[pb::CandidateExplanation]) -> Vec<(u64, pb::CacheView, u32)> {
    candidates
        .iter()
        .map(|c| (c.worker_id, c.cache_view(), c.overlap_blocks))
        .collect()
}

fn blocks(range: std::ops::Range<u64>) -> Vec<u64> {
    range.collect()
}

#[tokio::test]
async fn an_approximate_worker_attracts_the_follow_up_turn_of_a_conversation_it_served() {
    let server = TestServer::start().await;
    for worker_id in 1..=3 {
        let mut request = with_mode(registration(worker_id, "m"), pb::KvEventsMode::Approximate);
        request.total_kv_blocks = 12;
        server.register(request).await;
    }
    let turn1 = blocks(100..108);
    let first = reserve(&server, select_hashes("turn-1", "m", &turn1)).await;
    assert_eq!(
        first.overlap_blocks, 0,
        "nothing is predicted before any routing"
    );
    release(&server, "turn-1").await;
    let served = first.worker_id;

    // The next turn repeats the conversation and adds to it; every worker
    // is idle again, so only the predicted prefix tells them apart.
    let mut turn2 = turn1.clone();
    turn2.extend(200..204);
    let candidates = explain(&server, select_hashes("turn-2", "m", &turn2)).await;
    for c in &candidates {
        assert_eq!(
            c.cache_view(),
            pb::CacheView::Predicted,
            "worker {}",
            c.worker_id
        );
        assert_eq!(c.cache_view_reason, "predicted: registered approximate");
        let expected = if c.worker_id == served { 8 } else { 0 };
        assert_eq!(c.overlap_blocks, expected, "worker {}", c.worker_id);
    }
    let second = reserve(&server, select_hashes("turn-2", "m", &turn2)).await;
    assert_eq!((second.worker_id, second.overlap_blocks), (served, 8));
    release(&server, "turn-2").await;

    // The worker is held to its declared capacity: 12 blocks, the whole
    // second turn, no more.
    let info = server.worker_info(served).await;
    assert_eq!(info.kv_events(), pb::KvEventsMode::Approximate);
    assert_eq!(info.cache_view(), pb::CacheView::Predicted);
    assert_eq!(info.ranks[0].predicted_blocks, 12);
    assert_eq!(info.ranks[0].cached_blocks, 0, "nothing in the exact index");
    let mut turn3 = blocks(300..310);
    turn3.truncate(10);
    reserve(&server, pinned(select_hashes("other", "m", &turn3), served)).await;
    assert_eq!(
        server.worker_info(served).await.ranks[0].predicted_blocks,
        12,
        "a booked prompt counts once its prefill completes, not before"
    );
    mark_prefill_complete(&server, "other").await;
    let info = server.worker_info(served).await;
    assert_eq!(info.ranks[0].predicted_blocks, 12);
    // The least recently used blocks went: the second turn's tail, deepest
    // first, so its first 2 blocks are still predicted.
    let after = explain(&server, select_hashes("turn-4", "m", &turn2)).await;
    let c = after.iter().find(|c| c.worker_id == served).unwrap();
    assert_eq!(c.overlap_blocks, 2);

    // A QUERY_ONLY call books nothing and predicts nothing.
    let mut query = select_hashes("q", "m", &blocks(500..505));
    query.mode = pb::SelectionMode::QueryOnly.into();
    let asked = reserve(&server, query.clone()).await;
    let again = explain(&server, query).await;
    assert!(
        again.iter().all(|c| c.overlap_blocks == 0),
        "worker {} predicted",
        asked.worker_id
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_mixed_fleet_routes_by_overlap_across_both_kinds() {
    let server = TestServer::start().await;
    server.register(registration(1, "m")).await; // exact
    server
        .register(with_mode(
            registration(2, "m"),
            pb::KvEventsMode::Approximate,
        ))
        .await;
    // Worker 1 reports a prefix of 6 blocks through its events.
    let exact_prefix: Vec<(u64, u64)> = (0..6).map(|i| (1000 + i, 10 + i)).collect();
    let reply = server
        .publish(batch(1, 0, vec![stored(0, None, &exact_prefix)]))
        .await
        .unwrap();
    assert_eq!(reply.rejected, 0);
    // Worker 2 served another prompt of 9 blocks (pinned there), which
    // kvroute only knows from that booking.
    let predicted_prompt = blocks(50..59);
    let booked = reserve(
        &server,
        pinned(select_hashes("b1", "m", &predicted_prompt), 2),
    )
    .await;
    assert_eq!(booked.worker_id, 2);
    release(&server, "b1").await;

    // Each follow-up goes where its prefix is, whichever kind of view says so.
    let exact_followup: Vec<u64> = (10..16).chain(90..92).collect();
    let candidates = explain(&server, select_hashes("x", "m", &exact_followup)).await;
    assert_eq!(
        views(&candidates),
        vec![
            (1, pb::CacheView::Exact, 6),
            (2, pb::CacheView::Predicted, 0)
        ]
    );
    let to_exact = reserve(&server, select_hashes("x", "m", &exact_followup)).await;
    assert_eq!((to_exact.worker_id, to_exact.overlap_blocks), (1, 6));
    release(&server, "x").await;

    let predicted_followup: Vec<u64> = (50..59).chain(70..72).collect();
    let candidates = explain(&server, select_hashes("y", "m", &predicted_followup)).await;
    assert_eq!(
        views(&candidates),
        vec![
            (1, pb::CacheView::Exact, 0),
            (2, pb::CacheView::Predicted, 9)
        ]
    );
    let to_predicted = reserve(&server, select_hashes("y", "m", &predicted_followup)).await;
    assert_eq!(
        (to_predicted.worker_id, to_predicted.overlap_blocks),
        (2, 9)
    );
    // The exact worker's booking predicted nothing for it: it is scored
    // on its events alone.
    assert_eq!(server.worker_info(1).await.ranks[0].predicted_blocks, 0);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn an_auto_worker_is_predicted_until_its_first_event_then_exact() {
    let server = TestServer::start().await;
    server
        .register(with_mode(registration(7, "m"), pb::KvEventsMode::Auto))
        .await;
    let info = server.worker_info(7).await;
    assert_eq!(info.cache_view(), pb::CacheView::Predicted);
    assert_eq!(info.cache_view_reason, "predicted: auto, no events yet");
    reserve(&server, select_hashes("a1", "m", &blocks(1..5))).await;
    release(&server, "a1").await;
    assert_eq!(server.worker_info(7).await.ranks[0].predicted_blocks, 4);

    // Its engine starts publishing: from now on the events decide, and the
    // predictions are dropped.
    let reply = server
        .publish(batch(7, 0, vec![stored(0, None, &[(77, 1)])]))
        .await
        .unwrap();
    assert_eq!(reply.rejected, 0);
    let info = server.worker_info(7).await;
    assert_eq!(info.cache_view(), pb::CacheView::Exact);
    assert_eq!(info.cache_view_reason, "exact");
    assert_eq!(info.ranks[0].predicted_blocks, 0);
    let candidates = explain(&server, select_hashes("a2", "m", &blocks(1..5))).await;
    assert_eq!(
        candidates[0].overlap_blocks, 1,
        "block 1 from the event only"
    );
    assert_eq!(candidates[0].cache_view(), pb::CacheView::Exact);
    // Bookings no longer predict for it.
    reserve(&server, select_hashes("a3", "m", &blocks(1..5))).await;
    release(&server, "a3").await;
    assert_eq!(server.worker_info(7).await.ranks[0].predicted_blocks, 0);

    // Re-registering with another layout starts it over as unknown.
    let mut again = with_mode(registration(7, "m"), pb::KvEventsMode::Auto);
    again.dp_size = 2;
    server.register(again).await;
    assert_eq!(
        server.worker_info(7).await.cache_view(),
        pb::CacheView::Predicted
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn an_unknown_kv_events_mode_is_refused_and_registers_nothing() {
    let server = TestServer::start().await;
    let mut request = registration(9, "m");
    request.kv_events = 99;
    let status = server
        .workers()
        .register_worker(request)
        .await
        .expect_err("unknown mode");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("kv_events"),
        "{}",
        status.message()
    );
    // An APPROXIMATE worker that names an events endpoint contradicts
    // itself.
    let mut request = with_mode(registration(9, "m"), pb::KvEventsMode::Approximate);
    request.events_endpoint = "tcp://127.0.0.1:5557".into();
    request.events_dialect = "vllm".into();
    let status = server
        .workers()
        .register_worker(request)
        .await
        .expect_err("approximate with an endpoint");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("APPROXIMATE"),
        "{}",
        status.message()
    );
    let missing = server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: 9 })
        .await
        .expect_err("not registered");
    assert_eq!(missing.code(), Code::NotFound);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn events_from_an_approximate_worker_are_refused_and_counted() {
    let server = TestServer::start().await;
    server
        .register(with_mode(
            registration(3, "m"),
            pb::KvEventsMode::Approximate,
        ))
        .await;
    let status = server
        .publish(batch(3, 0, vec![stored(0, None, &[(1, 1), (2, 2)])]))
        .await
        .expect_err("an approximate worker publishes no events");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains("worker 3"),
        "{}",
        status.message()
    );
    assert_eq!(server.index_stats().await.blocks, 0, "nothing was stored");
    let info = server.worker_info(3).await;
    assert_eq!(info.cache_view(), pb::CacheView::Predicted);
    let (_, metrics) = server.http_get("/metrics").await;
    assert!(
        metrics.contains(
            r#"kvroute_kv_events_total{outcome="rejected",reason="approximate_worker"} 1"#
        ),
        "{metrics}"
    );
    server.stop().await.unwrap();
}

/// A server that checks trust every 100 ms (housekeeping runs at a
/// quarter of the default lease) and distrusts a gap after 300 ms.
async fn trust_server() -> TestServer {
    let mut config = kvroute::config::ServeConfig::for_tests();
    config.lease_ttl = std::time::Duration::from_millis(400);
    config.event_gap_deadline = std::time::Duration::from_millis(300);
    config.events_behind_deadline = std::time::Duration::from_millis(300);
    TestServer::start_with(config).await
}

fn long_lease(mut request: pb::RegisterWorkerRequest) -> pb::RegisterWorkerRequest {
    request.lease_ttl_secs = 600;
    request
}

async fn view_of(server: &TestServer, worker_id: u64) -> (pb::CacheView, String) {
    let info = server.worker_info(worker_id).await;
    (info.cache_view(), info.cache_view_reason)
}

async fn wait_for_view(server: &TestServer, worker_id: u64, view: pb::CacheView) {
    for _ in 0..100 {
        if view_of(server, worker_id).await.0 == view {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("worker {worker_id} never reached {view:?}");
}

/// The series counting trust `change`s ("downgraded", "recovered") for
/// `reason`.
fn trust_changes(change: &str, reason: &str) -> String {
    format!(r#"kvroute_worker_trust_changes_total{{change="{change}",reason="{reason}"}}"#)
}

/// Waits for `worker_id` to be blended, then checks that its view says
/// why (`why` in the reason) and that the downgrade was counted once
/// under `reason`.
async fn expect_blended(server: &TestServer, worker_id: u64, why: &str, reason: &str) {
    wait_for_view(server, worker_id, pb::CacheView::Blended).await;
    let (_, said) = view_of(server, worker_id).await;
    assert!(said.contains(why), "{said}");
    let (_, metrics) = server.http_get("/metrics").await;
    let downgraded = trust_changes("downgraded", reason);
    assert_eq!(metric(&metrics, &downgraded), 1.0, "{metrics}");
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn an_exact_worker_with_a_gap_unhealed_past_the_deadline_is_blended_and_recovers_when_it_heals()
 {
    let server = trust_server().await;
    server.register(long_lease(registration(1, "m"))).await;
    server.register(long_lease(registration(2, "m"))).await;
    let prefix: Vec<(u64, u64)> = (0..4).map(|i| (100 + i, 10 + i)).collect();
    let (tx, mut replies) = server.open_events().await;
    tx.send(batch(1, 0, vec![stored(0, None, &prefix)]))
        .await
        .unwrap();
    replies.message().await.unwrap().unwrap();
    // Event 1 is lost; event 2 waits behind the gap and a resend is asked.
    tx.send(batch(1, 0, vec![stored(2, Some(103), &[(104, 14)])]))
        .await
        .unwrap();
    let reply = replies.message().await.unwrap().unwrap();
    assert_eq!(
        (reply.resend_from_event_id, reply.held_events),
        (Some(1), 1)
    );
    assert_eq!(
        view_of(&server, 1).await.0,
        pb::CacheView::Exact,
        "within the deadline"
    );

    expect_blended(&server, 1, "gap", "gap_unhealed").await;
    let (_, metrics) = server.http_get("/metrics").await;
    assert_eq!(metric(&metrics, "kvroute_workers_untrusted"), 1.0);

    // The index's part of the blend: what it knew before the gap.
    let known: Vec<u64> = (10..14).collect();
    let candidates = explain(&server, select_hashes("k", "m", &known)).await;
    let one = &candidates[0];
    assert_eq!(
        (one.worker_id, one.cache_view(), one.overlap_blocks),
        (1, pb::CacheView::Blended, 4)
    );
    assert_eq!(candidates[1].cache_view(), pb::CacheView::Exact);
    // The predictions' part: what is sent there from now on.
    let fresh: Vec<u64> = (50..56).collect();
    reserve(&server, pinned(select_hashes("p", "m", &fresh), 1)).await;
    mark_prefill_complete(&server, "p").await;
    let candidates = explain(&server, select_hashes("q", "m", &fresh)).await;
    assert_eq!(candidates[0].overlap_blocks, 6);
    assert_eq!(
        candidates[1].overlap_blocks, 0,
        "worker 2 is scored on its events"
    );
    assert_eq!(server.worker_info(1).await.ranks[0].predicted_blocks, 6);

    // The resend heals the gap: trusted again, predictions dropped, and
    // the held event applied.
    tx.send(batch(1, 0, vec![stored(1, Some(103), &[(199, 99)])]))
        .await
        .unwrap();
    let reply = replies.message().await.unwrap().unwrap();
    assert_eq!((reply.resend_from_event_id, reply.held_events), (None, 0));
    wait_for_view(&server, 1, pb::CacheView::Exact).await;
    assert_eq!(server.worker_info(1).await.ranks[0].predicted_blocks, 0);
    let (_, metrics) = server.http_get("/metrics").await;
    let recovered = trust_changes("recovered", "gap_unhealed");
    assert_eq!(metric(&metrics, &recovered), 1.0, "{metrics}");
    let downgraded = trust_changes("downgraded", "gap_unhealed");
    assert_eq!(
        metric(&metrics, &downgraded),
        1.0,
        "logged and counted once"
    );
    let candidates = explain(&server, select_hashes("r", "m", &fresh)).await;
    assert_eq!(
        candidates[0].overlap_blocks, 0,
        "its events never stored these"
    );
    drop(tx);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn with_trust_off_a_gap_never_changes_the_view() {
    let mut config = kvroute::config::ServeConfig::for_tests();
    config.lease_ttl = std::time::Duration::from_millis(400);
    config.event_gap_deadline = std::time::Duration::from_millis(100);
    config.event_trust = false;
    let server = TestServer::start_with(config).await;
    server.register(long_lease(registration(1, "m"))).await;
    let (tx, mut replies) = server.open_events().await;
    tx.send(batch(1, 0, vec![stored(3, None, &[(1, 1)])]))
        .await
        .unwrap();
    replies.message().await.unwrap().unwrap();
    tx.send(batch(1, 0, vec![stored(5, None, &[(2, 2)])]))
        .await
        .unwrap();
    let reply = replies.message().await.unwrap().unwrap();
    assert!(
        reply.resend_from_event_id.is_some() || reply.held_events > 0,
        "{reply:?}"
    );
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(view_of(&server, 1).await.0, pb::CacheView::Exact);
    drop(tx);
    server.stop().await.unwrap();
}

async fn complete_with(server: &TestServer, request_id: &str, cached_tokens: u64) {
    server
        .router()
        .mark_prefill_complete(pb::MarkPrefillCompleteRequest {
            request_id: request_id.into(),
            cached_tokens: Some(cached_tokens),
        })
        .await
        .expect("prefill complete");
}

#[tokio::test]
async fn a_worker_whose_engine_reports_contradict_its_events_is_flagged_and_recovers() {
    let server = trust_server().await;
    server.register(long_lease(registration(1, "m"))).await;
    server.register(long_lease(registration(2, "m"))).await;
    // Worker 1's events say it holds 8 blocks (128 tokens) of this prefix.
    let prefix: Vec<(u64, u64)> = (0..8).map(|i| (100 + i, 10 + i)).collect();
    server
        .publish(batch(1, 0, vec![stored(0, None, &prefix)]))
        .await
        .unwrap();
    // Wholly cached by the index, so no new blocks (and no events) are owed.
    let prompt: Vec<u64> = (10..18).collect();

    // Its engine says it found nothing cached, request after request.
    for i in 0..kvroute::router::feedback::MIN_REPORTS {
        let id = format!("c{i}");
        let routed = reserve(&server, pinned(select_hashes(&id, "m", &prompt), 1)).await;
        assert_eq!(routed.cached_tokens, 128);
        complete_with(&server, &id, 0).await;
        release(&server, &id).await;
    }
    let feedback = server.worker_info(1).await.cached_tokens_feedback.unwrap();
    assert_eq!(
        feedback.reports,
        kvroute::router::feedback::MIN_REPORTS as u64
    );
    assert_eq!(feedback.mean_error_tokens, 128.0);
    assert_eq!(feedback.index_error_blocks, 8.0);
    assert!(feedback.contradicted);
    expect_blended(&server, 1, "contradict", "cached_tokens_contradict").await;
    assert_eq!(view_of(&server, 2).await.0, pb::CacheView::Exact);

    // Reports that do not fit are counted and change nothing.
    reserve(&server, pinned(select_hashes("big", "m", &prompt), 1)).await;
    complete_with(&server, "big", 1_000_000).await;
    complete_with(&server, "never-booked", 5).await;
    let (_, metrics) = server.http_get("/metrics").await;
    for (outcome, n) in [("recorded", 16.0), ("implausible", 1.0), ("unknown", 1.0)] {
        let series = format!("kvroute_cached_tokens_reports_total{{outcome=\"{outcome}\"}}");
        assert_eq!(metric(&metrics, &series), n, "{outcome}: {metrics}");
    }
    assert!(
        metrics.lines().any(
            |l| l.starts_with("kvroute_cached_tokens_error_tokens_count")
                && l.contains(r#"view="exact""#)
                && l.contains(r#"worker="1""#)
                && l.ends_with(" 16")
        ),
        "{metrics}"
    );
    let contradicted = trust_changes("downgraded", "cached_tokens_contradict");
    assert_eq!(metric(&metrics, &contradicted), 1.0, "counted once");

    // The engine agrees with the index again: trusted again.
    for i in 0..kvroute::router::feedback::WINDOW {
        let id = format!("ok{i}");
        reserve(&server, pinned(select_hashes(&id, "m", &prompt), 1)).await;
        complete_with(&server, &id, 128).await;
        release(&server, &id).await;
    }
    assert!(
        !server
            .worker_info(1)
            .await
            .cached_tokens_feedback
            .unwrap()
            .contradicted
    );
    wait_for_view(&server, 1, pb::CacheView::Exact).await;
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_worker_whose_events_never_follow_its_prefills_falls_behind_and_recovers_when_they_come()
{
    let server = trust_server().await;
    server.register(long_lease(registration(1, "m"))).await;
    server
        .publish(batch(1, 0, vec![stored(0, None, &[(1, 1)])]))
        .await
        .unwrap();
    // A prefill whose events come before it completes: nothing owed.
    reserve(&server, pinned(select_hashes("a", "m", &blocks(40..44)), 1)).await;
    server
        .publish(batch(1, 0, vec![stored(1, None, &[(40, 40)])]))
        .await
        .unwrap();
    mark_prefill_complete(&server, "a").await;
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(view_of(&server, 1).await.0, pb::CacheView::Exact);

    // An approximate worker owes no events: its prefills never make it
    // "behind", nor wipe its predictions.
    server
        .register(long_lease(with_mode(
            registration(2, "m"),
            pb::KvEventsMode::Approximate,
        )))
        .await;
    reserve(&server, pinned(select_hashes("c", "m", &blocks(80..84)), 2)).await;
    mark_prefill_complete(&server, "c").await;

    // A prefill of 4 new blocks completes and no event ever follows.
    reserve(&server, pinned(select_hashes("b", "m", &blocks(60..64)), 1)).await;
    mark_prefill_complete(&server, "b").await;
    assert_eq!(
        view_of(&server, 1).await.0,
        pb::CacheView::Exact,
        "within the deadline"
    );
    expect_blended(&server, 1, "none came", "events_behind").await;
    let approximate = server.worker_info(2).await;
    assert_eq!(approximate.cache_view(), pb::CacheView::Predicted);
    assert_eq!(approximate.ranks[0].predicted_blocks, 4);

    // Its events arrive at last.
    server
        .publish(batch(1, 0, vec![stored(2, None, &[(60, 60)])]))
        .await
        .unwrap();
    wait_for_view(&server, 1, pb::CacheView::Exact).await;
    server.stop().await.unwrap();
}
