//! Ordered decisions (`--decision-order ordered`) with a real nats-server
//! and three kvroute replicas as processes: RESERVE calls spread over the
//! replicas at once are decided in the shared log's order, every replica
//! books the same, and one router taking the calls in that order makes
//! exactly the same choices.

use std::{collections::HashMap, time::Duration};

use futures::StreamExt;
use kvroute::pb::{self, log_record::Body, router_client::RouterClient};
use prost::Message;
use tonic::transport::Channel;

use crate::{
    cluster::{SERIAL, herd_fleet},
    common::{
        cluster::{Nats, Replica, converged},
        select_hashes,
    },
};

const MODEL: &str = "m";
const ORDERED: [&str; 2] = ["--decision-order", "ordered"];

/// Request `k`'s prompt: the 32 blocks worker 1 caches, then its own 16.
fn prompt(k: usize) -> Vec<u64> {
    let mut prompt: Vec<u64> = (1..=32).collect();
    prompt.extend((0..16).map(|i| 1_000_000 + k as u64 * 100 + i));
    prompt
}

/// A RESERVE call (REJECT admission: a busy fleet is an answer too);
/// answers the worker, or the refusal's code.
async fn reserve(channel: &Channel, k: usize) -> Result<u64, tonic::Code> {
    let mut request = select_hashes(&format!("req-{k}"), MODEL, &prompt(k));
    request.admission = pb::AdmissionMode::Reject.into();
    RouterClient::new(channel.clone())
        .select_worker(request)
        .await
        .map(|r| r.into_inner().worker_id)
        .map_err(|s| s.code())
}

async fn release(replica: &Replica, k: usize) {
    RouterClient::new(replica.channel.clone())
        .release_request(pb::ReleaseRequestRequest {
            request_id: format!("req-{k}"),
            cached_tokens: None,
        })
        .await
        .expect("release");
}

/// The request ids of the decisions in the cluster's log, in its order.
async fn decisions_in_log(nats: &Nats, cluster: &str) -> Vec<String> {
    let client = async_nats::connect(nats.url()).await.expect("nats");
    let js = async_nats::jetstream::new(client);
    let mut stream = js
        .get_stream(format!("{cluster}_LOG"))
        .await
        .expect("log stream");
    let last = stream.info().await.expect("info").state.last_sequence;
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default())
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut ids = Vec::new();
    while let Some(message) = messages.next().await {
        let message = message.expect("message");
        let position = message.info().expect("info").stream_sequence;
        let record = pb::LogRecord::decode(message.payload.as_ref()).expect("record");
        if let Some(Body::Decide(decision)) = record.body {
            ids.push(decision.request.expect("call").request_id);
        }
        if position >= last {
            break;
        }
    }
    ids
}

/// Each worker's booked active requests as `replica` sees them.
async fn booked(replica: &Replica) -> Vec<u64> {
    let mut out = Vec::new();
    for w in 1..=4 {
        let info = replica.worker(w).await.expect("worker");
        out.push(u64::from(
            info.ranks[0].booked_load.expect("booked").active_requests,
        ));
    }
    out
}

/// Waits until the replicas see the same booked load, `total` in all
/// when given; returns it.
async fn agreed_bookings(replicas: &[&Replica], total: Option<u64>) -> Vec<u64> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut views = Vec::new();
        for r in replicas {
            views.push(booked(r).await);
        }
        if views.windows(2).all(|w| w[0] == w[1])
            && total.is_none_or(|t| views[0].iter().sum::<u64>() == t)
        {
            return views.swap_remove(0);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replicas disagree on bookings: {views:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The calls of `cluster`'s log, in its order, sent one by one to one
/// router (a replica of its own cluster, deciding locally, with the same
/// seed); answers it and the calls it decided otherwise than `answers`
/// (calls without an answer there are sent but not compared).
async fn one_router(
    nats: &Nats,
    cluster: &str,
    answers: &HashMap<usize, Result<u64, tonic::Code>>,
) -> (
    Replica,
    Vec<(String, Result<u64, tonic::Code>, Result<u64, tonic::Code>)>,
) {
    let order = decisions_in_log(nats, cluster).await;
    let mut seen = std::collections::HashSet::new();
    assert!(
        order.iter().all(|id| seen.insert(id.clone())),
        "a call decided twice in the log"
    );
    let local = ["--decision-order", "local"];
    let (name, replica) = (format!("{cluster}-one"), format!("{cluster}-one-r0"));
    let single = Replica::start(nats, &name, &replica, &local).await;
    herd_fleet(&single.channel).await;
    let mut differ = Vec::new();
    for id in &order {
        let k: usize = id.trim_start_matches("req-").parse().expect("id");
        let one = reserve(&single.channel, k).await;
        // A call whose replica died before answering was decided all the
        // same (it is in the log): booked, but compared with nothing.
        let answered = |a: &Result<u64, tonic::Code>| {
            !matches!(a, Err(tonic::Code::Unknown | tonic::Code::Unavailable))
        };
        if let Some(&answer) = answers.get(&k).filter(|a| answered(a))
            && answer != one
        {
            differ.push((id.clone(), answer, one));
        }
    }
    (single, differ)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reserves_over_three_replicas_book_what_one_router_books() {
    const CALLS: usize = 600;
    let _serial = SERIAL.lock().await;
    let nats = Nats::start("ordered");
    let mut replicas = Vec::new();
    for i in 0..3 {
        replicas.push(Replica::start(&nats, "ord", &format!("ord-r{i}"), &ORDERED).await);
    }
    herd_fleet(&replicas[0].channel).await;
    let all: Vec<&Replica> = replicas.iter().collect();
    converged(&all, Duration::from_secs(10)).await;

    // Every call at once, spread over the replicas.
    let calls = (0..CALLS).map(|k| {
        let channel = replicas[k % 3].channel.clone();
        async move { (k, reserve(&channel, k).await) }
    });
    let answers: HashMap<usize, Result<u64, tonic::Code>> =
        futures::future::join_all(calls).await.into_iter().collect();
    let mut taken = vec![0u64; 4];
    for w in answers.values().flatten() {
        taken[*w as usize - 1] += 1;
    }
    assert!(
        taken.iter().filter(|&&n| n > 0).count() > 1,
        "load should spread past the cached worker: {taken:?}"
    );
    // Every replica books what the calls were answered, no more, no less.
    assert_eq!(agreed_bookings(&all, None).await, taken);

    // One router taking the same calls one by one in the log's order.
    assert_eq!(
        decisions_in_log(&nats, "ord").await.len(),
        CALLS,
        "one decision record per call"
    );
    let (single, differ) = one_router(&nats, "ord", &answers).await;
    assert!(
        differ.is_empty(),
        "{} of {CALLS} calls decided otherwise than one router: {:?}",
        differ.len(),
        &differ[..differ.len().min(10)]
    );
    assert_eq!(booked(&single).await, taken);

    // Releases at other replicas than the one that booked go through the
    // log too: every replica ends with nothing booked.
    for k in 0..CALLS {
        release(&replicas[(k + 1) % 3], k).await;
    }
    assert_eq!(agreed_bookings(&all, Some(0)).await, vec![0; 4]);
    let ordered: f64 = replicas
        .iter()
        .map(|r| r.metric("kvroute_cluster_ordered_decisions_total{outcome=\"ordered\"}"))
        .sum();
    assert_eq!(ordered, CALLS as f64, "every call decided in the log");
    for r in &replicas {
        assert_eq!(
            r.metric("kvroute_cluster_ordered_decisions_total{outcome=\"local\"}"),
            0.0,
            "{} decided locally",
            r.name
        );
    }
}

/// Three ordered replicas (with `extra` flags) and the fleet of
/// `herd_fleet`.
async fn ordered_cluster(nats: &Nats, cluster: &str, extra: &[&str]) -> Vec<Replica> {
    let flags: Vec<&str> = ORDERED.iter().chain(extra).copied().collect();
    let mut replicas = Vec::new();
    for i in 0..3 {
        let name = format!("{cluster}-r{i}");
        replicas.push(Replica::start(nats, cluster, &name, &flags).await);
    }
    herd_fleet(&replicas[0].channel).await;
    converged(
        &replicas.iter().collect::<Vec<_>>(),
        Duration::from_secs(10),
    )
    .await;
    replicas
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_during_a_burst_loses_no_booking_and_books_none_twice() {
    const CALLS: usize = 300;
    let _serial = SERIAL.lock().await;
    let nats = Nats::start("ordkill");
    let mut replicas = ordered_cluster(&nats, "ordk", &[]).await;
    let channels: Vec<Channel> = replicas.iter().map(|r| r.channel.clone()).collect();
    let burst = tokio::spawn(async move {
        let calls = (0..CALLS).map(|k| {
            let channel = channels[k % 3].clone();
            async move { (k, reserve(&channel, k).await) }
        });
        futures::future::join_all(calls).await
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let victim = replicas.pop().expect("three");
    let restarted = victim.kill_9_and_restart().await;
    replicas.push(restarted);
    let answers: HashMap<usize, Result<u64, tonic::Code>> =
        burst.await.expect("burst").into_iter().collect();
    let failed = answers.values().filter(|a| a.is_err()).count();
    let all: Vec<&Replica> = replicas.iter().collect();
    converged(&all, Duration::from_secs(30)).await;
    let bookings = agreed_bookings(&all, None).await;

    // Every call answered was decided as one router decides it, and every
    // replica, the restarted one too, books what one router books for the
    // log's calls: none lost, none twice.
    let (single, differ) = one_router(&nats, "ordk", &answers).await;
    assert!(differ.is_empty(), "decided otherwise: {differ:?}");
    assert_eq!(bookings, booked(&single).await, "{failed} calls failed");
    let answered: u64 = answers.values().filter(|a| a.is_ok()).count() as u64;
    assert!(
        bookings.iter().sum::<u64>() >= answered,
        "{bookings:?} hold fewer than the {answered} bookings answered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_nats_away_replicas_decide_locally_and_agree_once_it_returns() {
    let _serial = SERIAL.lock().await;
    let mut nats = Nats::start("ordout");
    let replicas = ordered_cluster(&nats, "ordo", &[]).await;
    let all: Vec<&Replica> = replicas.iter().collect();
    for k in 0..6 {
        reserve(&replicas[k % 3].channel, k).await.expect("ordered");
    }
    nats.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    for k in 6..12 {
        let started = tokio::time::Instant::now();
        reserve(&replicas[k % 2].channel, k).await.expect("local");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "a local decision waits for no acknowledgement"
        );
    }
    let local =
        |r: &Replica| r.metric("kvroute_cluster_ordered_decisions_total{outcome=\"local\"}");
    assert_eq!(local(&replicas[0]) + local(&replicas[1]), 6.0);
    // Two bookings every replica made from the log, released here while
    // the log is away: the others release them once it is back.
    for (k, replica) in replicas.iter().take(2).enumerate() {
        release(replica, k).await;
    }
    nats.resume();
    // The bookings made while away reach every replica, and the releases.
    agreed_bookings(&all, Some(10)).await;
    // Decisions are ordered again, and releases through the log free
    // every booking on every replica.
    let ordered =
        |r: &Replica| r.metric("kvroute_cluster_ordered_decisions_total{outcome=\"ordered\"}");
    let before: f64 = replicas.iter().map(ordered).sum();
    for k in 12..18 {
        reserve(&replicas[k % 3].channel, k)
            .await
            .expect("ordered again");
    }
    let after: f64 = replicas.iter().map(ordered).sum();
    assert_eq!(after - before, 6.0, "decided in the log again");
    agreed_bookings(&all, Some(16)).await;
    for k in 2..18 {
        release(&replicas[(k + 2) % 3], k).await;
    }
    agreed_bookings(&all, Some(0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_call_finding_the_fleet_busy_is_booked_once_a_release_frees_it() {
    let _serial = SERIAL.lock().await;
    let nats = Nats::start("ordwait");
    // One call may wait at each replica.
    let replicas = ordered_cluster(&nats, "ordw", &["--queue-capacity", "1"]).await;
    let all: Vec<&Replica> = replicas.iter().collect();
    // Book until the whole fleet is busy.
    let mut booked_calls = 0;
    loop {
        match reserve(&replicas[booked_calls % 3].channel, booked_calls).await {
            Ok(_) => booked_calls += 1,
            Err(code) => {
                assert_eq!(code, tonic::Code::ResourceExhausted);
                break;
            }
        }
        assert!(booked_calls < 1_000, "the fleet never filled");
    }
    let wait = |id: &str| {
        let mut request = select_hashes(id, MODEL, &prompt(5_000));
        request.admission = pb::AdmissionMode::Wait.into();
        let mut client = RouterClient::new(replicas[1].channel.clone());
        async move { client.select_worker(request).await }
    };
    let waiting = tokio::spawn(wait("waiting"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "a WAIT call on a busy fleet waits");
    let refused = wait("one-too-many").await.expect_err("the queue is full");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(refused.message().contains("queue is full"), "{refused:?}");
    // Releases at another replica free the fleet: the call is booked, once,
    // on every replica.
    let freed = booked_calls / 2;
    for k in 0..freed {
        release(&replicas[2], k).await;
    }
    let answer = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("admitted in time")
        .expect("task")
        .expect("select")
        .into_inner();
    assert_eq!(
        answer.admission(),
        pb::AdmissionResult::AdmittedAfterQueue,
        "{answer:?}"
    );
    let left = (booked_calls - freed + 1) as u64;
    agreed_bookings(&all, Some(left)).await;
}
