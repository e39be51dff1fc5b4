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

/// Waits until the replicas see the same booked load; returns it.
async fn agreed_bookings(replicas: &[&Replica]) -> Vec<u64> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut views = Vec::new();
        for r in replicas {
            views.push(booked(r).await);
        }
        if views.windows(2).all(|w| w[0] == w[1]) {
            return views.swap_remove(0);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replicas disagree on bookings: {views:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
    assert_eq!(agreed_bookings(&all).await, taken);

    // One router taking the same calls one by one in the log's order.
    let order = decisions_in_log(&nats, "ord").await;
    assert_eq!(order.len(), CALLS, "one decision record per call");
    let single = Replica::start(&nats, "one", "one-r0", &[]).await;
    herd_fleet(&single.channel).await;
    let mut differ = Vec::new();
    for id in &order {
        let k: usize = id.trim_start_matches("req-").parse().expect("id");
        let one = reserve(&single.channel, k).await;
        if one != answers[&k] {
            differ.push((id.clone(), answers[&k], one));
        }
    }
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
        RouterClient::new(replicas[(k + 1) % 3].channel.clone())
            .release_request(pb::ReleaseRequestRequest {
                request_id: format!("req-{k}"),
                cached_tokens: None,
            })
            .await
            .expect("release");
    }
    assert_eq!(agreed_bookings(&all).await, vec![0; 4]);
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
