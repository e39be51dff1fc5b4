//! Cluster mode with a real nats-server and three kvroute replicas as
//! processes: one exact index whichever replica events arrive at, a
//! replica killed with SIGKILL catching up from snapshot plus log, NATS
//! going away and coming back, and booked load shared so replicas do not
//! herd.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::time::Duration;

use common::{
    TestServer, batch,
    cluster::{Nats, Replica, converged},
    registration, removed, stored,
};
use kvroute::pb::{self, router_client::RouterClient, workers_client::WorkersClient};
use tonic::transport::Channel;

const MODEL: &str = "m";

/// One test at a time: each runs a nats-server and up to seven replicas
/// on a two-core machine.
pub(crate) static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
pub(crate) async fn publish_all(channel: &Channel, batches: &[pb::KvEventBatch]) -> usize {
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

pub(crate) async fn register(channel: &Channel, worker_id: u64) {
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
    let _serial = SERIAL.lock().await;
    let nats = Nats::start("one-index");
    let replicas = three(&nats, "one", &[]).await;
    let workers: Vec<(u64, Vec<pb::KvEventBatch>)> = (1..=4).map(|w| (w, history(w, 30))).collect();
    // Worker w registers at one replica and streams its events to another,
    // once that one has the registration from the log (a batch checked
    // against a replica that has not is NOT_FOUND, as for any stranger).
    for (w, _) in &workers {
        register(&replicas[*w as usize % 3].channel, *w).await;
    }
    for (w, _) in &workers {
        wait_for(
            &replicas[(*w as usize + 1) % 3],
            *w,
            "the registration",
            |_| true,
        )
        .await;
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

async fn route(channel: &Channel, request_id: &str, hashes: &[u64], session: Option<&str>) -> u64 {
    common::route_hashes(channel, MODEL, request_id, hashes, session).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_under_traffic_catches_up_from_snapshot_and_log() {
    let _serial = SERIAL.lock().await;
    let nats = Nats::start("restart");
    let mut replicas = three(&nats, "restart", &["--snapshot-interval", "1s"]).await;
    let workers: Vec<(u64, Vec<pb::KvEventBatch>)> = (1..=3).map(|w| (w, history(w, 40))).collect();
    for (w, batches) in &workers {
        register(&replicas[0].channel, *w).await;
        publish_all(&replicas[1].channel, &batches[..15]).await;
    }
    replicas[1]
        .admin()
        .cordon_worker(pb::CordonWorkerRequest { worker_id: 2 })
        .await
        .expect("cordon");
    let bound = route(&replicas[0].channel, "q-1", &[1000, 1001], Some("sess-a")).await;
    // A snapshot is written within the interval by one of them.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while replicas
        .iter()
        .map(|r| r.metric("kvroute_snapshots_total{outcome=\"written\"}"))
        .sum::<f64>()
        < 1.0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no snapshot written"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Traffic through the other two while the third is killed and restarts.
    let mut sends = Vec::new();
    for (w, batches) in workers.clone() {
        let channel = replicas[w as usize % 2].channel.clone();
        sends.push(tokio::spawn(async move {
            publish_all(&channel, &batches[15..]).await
        }));
    }
    let killed = replicas.pop().expect("three");
    let restarted = killed.kill_9_and_restart().await;
    for s in sends {
        s.await.unwrap();
    }
    assert_eq!(
        restarted.metric("kvroute_snapshots_total{outcome=\"loaded\"}"),
        1.0,
        "the restarted replica loads the snapshot"
    );
    replicas.push(restarted);
    let all: Vec<&Replica> = replicas.iter().collect();
    let digest = converged(&all, Duration::from_secs(20)).await;
    assert_eq!(digest, single_process_digest(&workers).await);
    // Cordons, leases and sessions agree.
    for (w, _) in &workers {
        let seen: Vec<pb::WorkerInfo> = {
            let mut v = Vec::new();
            for r in &replicas {
                v.push(r.worker(*w).await.expect("known everywhere"));
            }
            v
        };
        for info in &seen {
            assert_eq!(info.cordoned, *w == 2, "worker {w}: {info:?}");
            assert!(info.lease_remaining_ms > 100_000, "worker {w}: {info:?}");
        }
    }
    // The restarted replica read the bookings still open (q-1's).
    let booked = |info: pb::WorkerInfo| info.ranks[0].booked_load.expect("booked");
    assert_eq!(
        booked(replicas[2].worker(bound).await.expect("bound")),
        booked(replicas[0].worker(bound).await.expect("bound")),
    );
    assert_eq!(
        booked(replicas[2].worker(bound).await.expect("bound")).active_requests,
        1
    );
    let again = route(&replicas[2].channel, "q-2", &[1000, 1001], Some("sess-a")).await;
    assert_eq!(
        again, bound,
        "the session's binding survives at the restarted replica"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// The order of the held-out check (#35): the cordon made at one replica
/// and a HARD session at another after the last snapshot, so that the
/// replica killed in the middle has them only from the buckets; within a
/// second of serving again it must agree on the cordon, the session and
/// each lease's deadline.
async fn a_restarted_replica_agrees_on_cordons_sessions_and_leases() {
    let _serial = SERIAL.lock().await;
    let nats = Nats::start("agree");
    let mut replicas = three(&nats, "agree", &["--snapshot-interval", "3600s"]).await;
    let workers: Vec<(u64, Vec<pb::KvEventBatch>)> = (1..=3).map(|w| (w, history(w, 40))).collect();
    for (w, batches) in &workers {
        register(&replicas[0].channel, *w).await;
        publish_all(&replicas[2].channel, &batches[..15]).await;
    }
    let written = replicas[0]
        .admin()
        .snapshot(pb::SnapshotRequest {})
        .await
        .expect("snapshot");
    assert!(written.into_inner().bytes > 0);
    // Time passes between the snapshot and the restart: a lease restored
    // from the snapshot alone would end later than the others'.
    tokio::time::sleep(Duration::from_secs(3)).await;
    replicas[0]
        .admin()
        .cordon_worker(pb::CordonWorkerRequest { worker_id: 2 })
        .await
        .expect("cordon");
    let bound = route(&replicas[2].channel, "q-1", &[1000, 1001], Some("sess-b")).await;
    assert_ne!(bound, 2, "a cordoned worker takes no new session");
    // Event traffic through the other two while the middle one restarts.
    let mut sends = Vec::new();
    for (w, batches) in workers.clone() {
        let channel = replicas[if w % 2 == 0 { 0 } else { 2 }].channel.clone();
        sends.push(tokio::spawn(async move {
            publish_all(&channel, &batches[15..]).await
        }));
    }
    let killed = replicas.remove(1);
    let restarted = killed.kill_9_and_restart().await;
    // Serving: from now on it must already agree (one second of slack for
    // the calls themselves).
    let serving = tokio::time::Instant::now();
    let info = restarted.worker(2).await.expect("worker 2 known");
    assert!(info.cordoned, "the cordon made at replica 0: {info:?}");
    let again = route(&restarted.channel, "q-2", &[1000, 1001], Some("sess-b")).await;
    assert_eq!(again, bound, "the HARD session made at replica 2");
    for (w, _) in &workers {
        let here = restarted
            .worker(*w)
            .await
            .expect("known")
            .lease_remaining_ms;
        let there = replicas[0]
            .worker(*w)
            .await
            .expect("known")
            .lease_remaining_ms;
        assert!(
            here.abs_diff(there) < 1_000,
            "worker {w}: lease {here} ms here, {there} ms at replica 0"
        );
    }
    assert!(serving.elapsed() < Duration::from_secs(1));
    for s in sends {
        s.await.unwrap();
    }
    replicas.insert(1, restarted);
    let all: Vec<&Replica> = replicas.iter().collect();
    let digest = converged(&all, Duration::from_secs(20)).await;
    assert_eq!(digest, single_process_digest(&workers).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_away_for_ten_seconds_loses_no_accepted_event() {
    let _serial = SERIAL.lock().await;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let mut nats = Nats::start("outage");
    let replicas = three(&nats, "outage", &[]).await;
    let workers: Vec<(u64, Vec<pb::KvEventBatch>)> = (1..=3).map(|w| (w, history(w, 60))).collect();
    for (w, _) in &workers {
        register(&replicas[*w as usize % 3].channel, *w).await;
    }
    let mut sends = Vec::new();
    for (w, batches) in workers.clone() {
        let channel = replicas[w as usize % 3].channel.clone();
        sends.push(tokio::spawn(async move {
            let mut retries = 0;
            for chunk in batches.chunks(3) {
                retries += publish_all(&channel, chunk).await;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            retries
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut router0 = RouterClient::new(replicas[0].channel.clone());
    route(&replicas[0].channel, "before-1", &[1000, 1001], None).await;
    route(&replicas[0].channel, "before-2", &[1000, 1002], None).await;
    nats.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Routing goes on (and books); the Workers service says it cannot
    // take events.
    let chosen = route(&replicas[0].channel, "during", &[1000, 1001], None).await;
    assert!((1..=3).contains(&chosen));
    router0
        .release_request(pb::ReleaseRequestRequest {
            cached_tokens: None,
            request_id: "before-1".into(),
        })
        .await
        .expect("release");
    let status = HealthClient::new(replicas[0].channel.clone())
        .check(HealthCheckRequest {
            service: "kvroute.v1.Workers".into(),
        })
        .await
        .expect("health")
        .into_inner()
        .status;
    assert_eq!(status, 2, "Workers NOT_SERVING while NATS is away");
    tokio::time::sleep(Duration::from_secs(8)).await;
    nats.resume();
    let mut retries = 0;
    for s in sends {
        retries += s.await.unwrap();
    }
    assert!(
        retries > 0,
        "some batches were answered UNAVAILABLE and resent"
    );
    let all: Vec<&Replica> = replicas.iter().collect();
    let digest = converged(&all, Duration::from_secs(30)).await;
    assert_eq!(digest, single_process_digest(&workers).await);
    // Booked load made and released while NATS was away reaches the others.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut views = Vec::new();
        for r in &replicas {
            let mut loads = Vec::new();
            for (w, _) in &workers {
                let info = r.worker(*w).await.expect("worker");
                loads.push(info.ranks[0].booked_load.expect("booked"));
            }
            views.push(loads);
        }
        let active: u32 = views[0].iter().map(|l| l.active_requests).sum();
        if views.windows(2).all(|p| p[0] == p[1]) {
            assert_eq!(active, 2, "before-2 and during are open: {views:?}");
            assert!(replicas[1].metric("kvroute_cluster_booking_resyncs_total") >= 1.0);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "booked load differs after the outage: {views:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Four equal workers, worker 1 caching a long prefix. Each of `waves`
/// waves makes `CALLS` RESERVE calls for prompts sharing the prefix, 5 ms
/// apart, each at the next of `routers`, all outstanding until the wave
/// ends; then each is released (with `synced`, at another router than the
/// one that booked it; unsynced routers only know their own bookings).
/// Returns the calls each worker took. With `synced`, checks before the
/// last release that every router sees the cluster's whole booked load.
async fn herd(routers: &[&Replica], waves: usize, synced: bool) -> [usize; 4] {
    const CALLS: usize = 6;
    let prefix: Vec<u64> = (1..=32).collect();
    let mut taken = [0usize; 4];
    for wave in 0..waves {
        let mut wave_taken = [0usize; 4];
        for k in 0..CALLS {
            let mut prompt = prefix.clone();
            prompt.extend((0..16).map(|i| 1_000_000 + (wave * CALLS + k) as u64 * 100 + i));
            let id = format!("req-{wave}-{k}");
            let w = route(&routers[k % routers.len()].channel, &id, &prompt, None).await;
            wave_taken[w as usize - 1] += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if synced && wave + 1 == waves {
            tokio::time::sleep(Duration::from_millis(100)).await;
            for w in 1..=4u64 {
                let mut loads = Vec::new();
                for r in routers {
                    let info = r.worker(w).await.expect("worker");
                    loads.push(info.ranks[0].booked_load.expect("booked"));
                }
                assert!(
                    loads.windows(2).all(|p| p[0] == p[1]),
                    "worker {w}: {loads:?}"
                );
                assert_eq!(
                    loads[0].active_requests as usize,
                    wave_taken[w as usize - 1]
                );
            }
        }
        for k in 0..CALLS {
            let at = if synced { k + 1 } else { k };
            RouterClient::new(routers[at % routers.len()].channel.clone())
                .release_request(pb::ReleaseRequestRequest {
                    cached_tokens: None,
                    request_id: format!("req-{wave}-{k}"),
                })
                .await
                .expect("release");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        for (t, n) in taken.iter_mut().zip(wave_taken) {
            *t += n;
        }
    }
    taken
}

pub(crate) async fn herd_fleet(channel: &Channel) {
    for w in 1..=4 {
        register(channel, w).await;
    }
    let blocks: Vec<(u64, u64)> = (1..=32).map(|l| (500 + l, l)).collect();
    let events = vec![stored(0, None, &blocks)];
    publish_all(channel, &[batch(1, 0, events)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synced_replicas_do_not_herd() {
    let _serial = SERIAL.lock().await;
    let nats = Nats::start("herd");
    const WAVES: usize = 4;
    let single = Replica::start(&nats, "single", "single-r0", &[]).await;
    herd_fleet(&single.channel).await;
    let one = herd(&[&single], WAVES, false).await;

    // Replicas deciding at once and sharing after (not in log order).
    let local = ["--decision-order", "local"];
    let synced = three(&nats, "synced", &local).await;
    herd_fleet(&synced[0].channel).await;
    converged(&synced.iter().collect::<Vec<_>>(), Duration::from_secs(10)).await;
    let three_synced = herd(&synced.iter().collect::<Vec<_>>(), WAVES, true).await;

    // The same, with the replicas estimating their peers' bookings within
    // the sync delay (--cluster-replicas).
    let mut estimating = Vec::new();
    for i in 0..3 {
        let (name, index) = (format!("estimating-r{i}"), i.to_string());
        let extra = [
            "--cluster-replicas",
            "3",
            "--replica-index",
            &index,
            "--decision-order",
            "local",
        ];
        estimating.push(Replica::start(&nats, "estimating", &name, &extra).await);
    }
    herd_fleet(&estimating[0].channel).await;
    converged(
        &estimating.iter().collect::<Vec<_>>(),
        Duration::from_secs(10),
    )
    .await;
    let three_estimating = herd(&estimating.iter().collect::<Vec<_>>(), WAVES, true).await;
    drop(estimating);

    let mut alone = Vec::new();
    for i in 0..3 {
        let r = Replica::start(&nats, &format!("alone{i}"), &format!("alone{i}-r0"), &local).await;
        herd_fleet(&r.channel).await;
        alone.push(r);
    }
    let unsynced = herd(&alone.iter().collect::<Vec<_>>(), WAVES, false).await;

    println!(
        "calls each worker took: one router {one:?}, 3 synced {three_synced:?}, \
         3 synced estimating {three_estimating:?}, 3 unsynced {unsynced:?}"
    );
    let calls: usize = one.iter().sum();
    assert!(
        one[0] < calls,
        "one router spreads load once it outweighs the cache: {one:?}"
    );
    let tolerance = (one[0] as f64 * 0.1).ceil() as usize;
    assert!(
        three_synced[0].abs_diff(one[0]) <= tolerance,
        "synced replicas herd: {three_synced:?} against one router's {one:?}"
    );
    // Estimating replicas think their peers' requests go where load alone
    // sends them, not to the shared prefix, so on a burst that all shares
    // one prefix they lean to the cached worker more than one router
    // (docs/CLUSTER.md, "Router replicas"), but still less than unsynced ones.
    assert!(
        three_estimating[0] >= one[0] && three_estimating[0] < unsynced[0],
        "{three_estimating:?} against one router's {one:?} and unsynced {unsynced:?}"
    );
    // Each unsynced replica sends its share of a burst to the cached
    // worker as if it were alone: herding.
    assert!(
        unsynced[0] as f64 >= one[0] as f64 * 1.5,
        "unsynced replicas should herd: {unsynced:?} against {one:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_is_removed_once_and_heartbeats_anywhere_renew() {
    let _serial = SERIAL.lock().await;
    let nats = Nats::start("leases");
    let replicas = three(&nats, "leases", &[]).await;
    let short = |worker_id| pb::RegisterWorkerRequest {
        lease_ttl_secs: 2,
        ..registration(worker_id, MODEL)
    };
    let mut at0 = WorkersClient::new(replicas[0].channel.clone());
    at0.register_worker(short(1)).await.expect("register 1");
    at0.register_worker(short(2)).await.expect("register 2");
    publish_all(&replicas[0].channel, &history(1, 3)).await;
    // Worker 2 heartbeats to replica 1 only; worker 1 never does.
    let mut at1 = WorkersClient::new(replicas[1].channel.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        at1.heartbeat(pb::HeartbeatRequest {
            worker_id: 2,
            load: Vec::new(),
        })
        .await
        .expect("heartbeat");
        let mut gone = 0;
        for r in &replicas {
            gone += usize::from(r.worker(1).await.is_none());
        }
        if gone == 3 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "worker 1 never lapsed everywhere"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let reaped: f64 = replicas
        .iter()
        .map(|r| r.metric("kvroute_cluster_leases_reaped_total"))
        .sum();
    assert_eq!(reaped, 1.0, "one replica removed the lapsed worker");
    for r in &replicas {
        assert!(
            r.worker(2).await.is_some(),
            "{} lost the renewed worker",
            r.name
        );
    }
    let all: Vec<&Replica> = replicas.iter().collect();
    let (entries, _) = converged(&all, Duration::from_secs(10)).await;
    assert_eq!(entries, 0, "the lapsed worker's blocks went with it");
    // Admin/Snapshot writes the cluster's snapshot, at a log position.
    let written = replicas[1]
        .admin()
        .snapshot(pb::SnapshotRequest::default())
        .await
        .expect("snapshot")
        .into_inner();
    assert!(written.path.contains("log position"), "{written:?}");
    assert_eq!(written.workers, 1, "{written:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_larger_than_a_nats_message_is_applied_whole() {
    let _serial = SERIAL.lock().await;
    let nats = Nats::start("large");
    let replicas = three(&nats, "large", &[]).await;
    WorkersClient::new(replicas[0].channel.clone())
        .register_worker(pb::RegisterWorkerRequest {
            total_kv_blocks: 1 << 17, // room for the 65,536 blocks
            ..registration(1, MODEL)
        })
        .await
        .expect("register");
    // Four events of 16,384 blocks: about 1.3 MB, over NATS's 1 MB.
    let events: Vec<pb::KvEvent> = (0..4u64)
        .map(|e| {
            let blocks: Vec<(u64, u64)> = (0..16_384u64)
                .map(|b| (e * 100_000 + b + 1, e * 100_000 + b + 1))
                .collect();
            stored(e, None, &blocks)
        })
        .collect();
    let retries = publish_all(&replicas[1].channel, &[batch(1, 0, events)]).await;
    assert_eq!(retries, 0);
    let all: Vec<&Replica> = replicas.iter().collect();
    let (entries, _) = converged(&all, Duration::from_secs(20)).await;
    assert_eq!(entries, 4 * 16_384);
}

/// An engine's batch that the index refuses counts in the worker's
/// `index_rejected` in cluster mode as it does alone, though there it is
/// applied from the shared log by the follower, not by the subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_events_the_index_refuses_count_in_cluster_mode() {
    use crate::engine_reconnect::{engine_registration, send, seq, stored as engine_stored};

    let nats = Nats::start("engine-rejected");
    let replica = Replica::start(&nats, "rejected", "r0", &[]).await;
    let endpoint = format!("tcp://127.0.0.1:{}", common::cluster::free_addr().port());
    let mut engine = <zeromq::PubSocket as zeromq::Socket>::new();
    zeromq::Socket::bind(&mut engine, &endpoint).await.unwrap();
    WorkersClient::new(replica.channel.clone())
        .register_worker(engine_registration(7, &endpoint))
        .await
        .expect("register");
    let connected = |info: &pb::WorkerInfo| info.subscription.contains(" connected,");
    wait_for(&replica, 7, "connected", connected).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    send(
        &mut engine,
        vec![vec![], seq(0), engine_stored(1, None, 10)],
    )
    .await;
    // Its parent was never stored: the index refuses it.
    send(
        &mut engine,
        vec![vec![], seq(1), engine_stored(2, Some(99), 12)],
    )
    .await;
    send(
        &mut engine,
        vec![vec![], seq(2), engine_stored(3, Some(1), 14)],
    )
    .await;
    let cached =
        |info: &pb::WorkerInfo| info.ranks.iter().map(|r| r.cached_blocks).sum::<u64>() == 2;
    wait_for(&replica, 7, "two blocks", cached).await;

    let series = r#"kvroute_engine_events_ignored_total{reason="index_rejected",worker="7"}"#;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while replica.metric(series) < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} never counted the refused event"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(replica.metric(series), 1.0);
}

/// Polls the replica's GetWorker until `done` holds (10 s at most).
async fn wait_for(
    replica: &Replica,
    worker_id: u64,
    what: &str,
    done: impl Fn(&pb::WorkerInfo) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(info) = replica.worker(worker_id).await
            && done(&info)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A worker registered again through another replica starts a new event
/// stream on every replica (#38): its new event 0 applies everywhere and
/// the old stream's blocks are gone everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_registered_again_starts_a_new_stream_on_every_replica() {
    let _serial = SERIAL.lock().await;
    let nats = Nats::start("reregister");
    let a = Replica::start(&nats, "rereg", "rereg-a", &[]).await;
    let b = Replica::start(&nats, "rereg", "rereg-b", &[]).await;
    register(&a.channel, 1).await;
    wait_for(&b, 1, "the registration", |_| true).await;
    let old: Vec<pb::KvEvent> = (0..5)
        .map(|i| stored(i, None, &[(100 + i, 1000 + i)]))
        .collect();
    publish_all(&b.channel, &[batch(1, 0, old)]).await;
    converged(&[&a, &b], Duration::from_secs(20)).await;
    register(&b.channel, 1).await;
    wait_for(&a, 1, "the new registration", |w| {
        w.ranks[0].cached_blocks == 0
    })
    .await;
    let new = vec![batch(1, 0, vec![stored(0, None, &[(7, 70)])])];
    publish_all(&a.channel, &new).await;
    let digest = converged(&[&a, &b], Duration::from_secs(20)).await;
    assert_eq!(digest, single_process_digest(&[(1, new)]).await);
    for r in [&a, &b] {
        let ranks = r.worker(1).await.expect("registered").ranks;
        assert_eq!(
            (ranks[0].cached_blocks, ranks[0].last_event_id),
            (1, 0),
            "{}",
            r.name
        );
    }
}
