//! Cluster mode with a real nats-server and three kvroute replicas as
//! processes: one exact index whichever replica events arrive at, a
//! replica killed with SIGKILL catching up from snapshot plus log, NATS
//! going away and coming back, and booked load shared so replicas do not
//! herd.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{
    TestServer, batch,
    cluster::{Nats, Replica, converged},
    registration, removed, select_hashes, stored,
};
use kvroute::pb::{self, router_client::RouterClient, workers_client::WorkersClient};
use tonic::transport::Channel;

const MODEL: &str = "m";

/// Worker `w`'s events in batches: chains over shared local hashes (so
/// prefixes overlap between workers), some evicted again.
fn history(worker_id: u64, batches: usize) -> Vec<pb::KvEventBatch> {
    let mut out = Vec::new();
    let mut id = 0u64;
    let mut engine = worker_id * 1_000_000;
    for b in 0..batches {
        let mut events = Vec::new();
        let mut parent = None;
        let mut chain = Vec::new();
        for i in 0..8u64 {
            engine += 1;
            let local = 1000 + (b as u64 % 5) * 100 + i + if i > 5 { worker_id * 7 } else { 0 };
            chain.push(engine);
            events.push(stored(id, parent, &[(engine, local)]));
            id += 1;
            parent = Some(engine);
        }
        if b % 3 == 2 {
            events.push(removed(id, &chain[6..]));
            id += 1;
        }
        out.push(batch(worker_id, 0, events));
    }
    out
}

/// Sends batches on one stream, each after the previous one's reply;
/// retries a batch answered UNAVAILABLE (NATS away) on a new stream.
async fn publish_all(channel: &Channel, batches: &[pb::KvEventBatch]) -> usize {
    let mut client = WorkersClient::new(channel.clone());
    let mut retries = 0;
    for b in batches {
        loop {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tx.send(b.clone()).await.unwrap();
            drop(tx);
            let reply = match client
                .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
            {
                Ok(replies) => replies.into_inner().message().await,
                Err(status) => Err(status),
            };
            match reply {
                Ok(Some(_)) => break,
                Ok(None) => panic!("stream closed without a reply"),
                Err(status) => {
                    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                    retries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    retries
}

async fn register(channel: &Channel, worker_id: u64) {
    WorkersClient::new(channel.clone())
        .register_worker(registration(worker_id, MODEL))
        .await
        .expect("register");
}

/// What a single process holds after the same events.
async fn single_process_digest(workers: &[(u64, Vec<pb::KvEventBatch>)]) -> (u64, u64) {
    let server = TestServer::start().await;
    for (w, batches) in workers {
        server.register(registration(*w, MODEL)).await;
        for b in batches {
            server.publish(b.clone()).await.expect("publish");
        }
    }
    let stats = server
        .admin()
        .get_index_stats(pb::GetIndexStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    (stats.entries, stats.digest)
}

async fn three(nats: &Nats, cluster: &str, extra: &[&str]) -> Vec<Replica> {
    let mut replicas = Vec::new();
    for i in 0..3 {
        replicas.push(Replica::start(nats, cluster, &format!("{cluster}-r{i}"), extra).await);
    }
    replicas
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_through_different_replicas_give_one_index() {
    let nats = Nats::start("one-index");
    let replicas = three(&nats, "one", &[]).await;
    let workers: Vec<(u64, Vec<pb::KvEventBatch>)> = (1..=4).map(|w| (w, history(w, 30))).collect();
    // Worker w registers at one replica and streams its events to another.
    for (w, _) in &workers {
        register(&replicas[*w as usize % 3].channel, *w).await;
    }
    let mut sends = Vec::new();
    for (w, batches) in workers.clone() {
        let channel = replicas[(w as usize + 1) % 3].channel.clone();
        sends.push(tokio::spawn(async move {
            publish_all(&channel, &batches).await
        }));
    }
    for s in sends {
        s.await.unwrap();
    }
    let all: Vec<&Replica> = replicas.iter().collect();
    let digest = converged(&all, Duration::from_secs(20)).await;
    assert!(digest.0 > 0, "the index holds the events");
    assert_eq!(digest, single_process_digest(&workers).await);
    // Every replica knows every worker.
    for r in &replicas {
        for (w, _) in &workers {
            assert!(r.worker(*w).await.is_some(), "{} lacks worker {w}", r.name);
        }
    }
}
