//! Durable state over the real binary: a kvroute killed with SIGKILL after
//! a snapshot comes back with the exact index (the digest of one that never
//! stopped and saw the same events), its cordons, HARD sessions and leases;
//! a damaged snapshot starts cold with one clear line, or refuses to start
//! with `--require-snapshot`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::{
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use common::{
    TestServer, batch, connect, registration, removed, stored, wait_serving,
    worker::{Ev, Reply, TestWorker},
};
use kvroute::pb::{self, admin_client::AdminClient, workers_client::WorkersClient};
use tonic::transport::Channel;

const MODEL: &str = "m";

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
}

fn state_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("state dir");
    dir
}

/// A `kvroute serve` process with a state directory.
struct Process {
    child: Child,
    grpc: SocketAddr,
    metrics: SocketAddr,
    channel: Channel,
}

impl Process {
    async fn start(dir: &Path, grpc: SocketAddr, extra: &[&str]) -> Self {
        let metrics = free_addr();
        let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .arg("serve")
            .args(["--grpc-addr", &grpc.to_string()])
            .args(["--metrics-addr", &metrics.to_string()])
            .args(["--state-dir", &dir.display().to_string()])
            .args([
                "--snapshot-interval",
                "1h",
                "--lease-ttl",
                "120s",
                "--seed",
                "7",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvroute");
        let channel = connect(grpc).await;
        wait_serving(&channel).await;
        Self {
            child,
            grpc,
            metrics,
            channel,
        }
    }

    /// The value of one series of its Prometheus endpoint (0 when absent).
    fn metric(&self, series: &str) -> f64 {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(self.metrics).expect("metrics");
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: kvroute\r\n\r\n")
            .expect("request");
        let mut text = String::new();
        stream.read_to_string(&mut text).expect("response");
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    }

    fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel.clone())
    }

    /// SIGKILL: no graceful shutdown, no snapshot at exit.
    fn kill_9(mut self) -> SocketAddr {
        self.child.kill().expect("kill -9");
        self.child.wait().expect("reap");
        self.grpc
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A worker's whole event history (ids from 0), which it keeps to resend.
struct History {
    worker_id: u64,
    events: Vec<pb::KvEvent>,
    next_engine: u64,
}

impl History {
    fn new(worker_id: u64) -> Self {
        Self {
            worker_id,
            events: Vec::new(),
            next_engine: worker_id * 1_000_000,
        }
    }

    /// A chain of `len` blocks under `parent` (local hashes shared between
    /// workers, so prefixes overlap); returns the engine hashes.
    fn store_chain(&mut self, parent: Option<u64>, locals: &[u64]) -> Vec<u64> {
        let blocks: Vec<(u64, u64)> = locals
            .iter()
            .map(|&l| {
                self.next_engine += 1;
                (self.next_engine, l)
            })
            .collect();
        let id = self.events.len() as u64;
        self.events.push(stored(id, parent, &blocks));
        blocks.iter().map(|b| b.0).collect()
    }

    fn remove(&mut self, engines: &[u64]) {
        let id = self.events.len() as u64;
        self.events.push(removed(id, engines));
    }

    fn batch(&self, from: usize, to: usize) -> pb::KvEventBatch {
        batch(self.worker_id, 0, self.events[from..to].to_vec())
    }
}

/// Sends `history`'s events from `from` as one batch, then answers every
/// resend request from the history, as a well-behaved worker does.
async fn publish_and_heal(channel: &Channel, history: &History, from: usize) {
    let mut client = WorkersClient::new(channel.clone());
    let mut next = from;
    let mut rounds = 0;
    loop {
        let to = history.events.len();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut replies = client
            .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .expect("open stream")
            .into_inner();
        tx.send(history.batch(next, to)).await.expect("send");
        let reply = replies.message().await.expect("reply").expect("a reply");
        drop(tx);
        match reply.resend_from_event_id {
            Some(id) if (id as usize) < to => next = id as usize,
            _ => return,
        }
        rounds += 1;
        assert!(rounds < 10, "resends do not converge: {reply:?}");
    }
}

async fn digest(channel: &Channel) -> (u64, u64) {
    let stats = AdminClient::new(channel.clone())
        .get_index_stats(pb::GetIndexStatsRequest::default())
        .await
        .expect("stats")
        .into_inner();
    (stats.entries, stats.digest)
}

async fn route_session(channel: &Channel, request_id: &str, session: &str, hashes: &[u64]) -> u64 {
    common::route_hashes(channel, MODEL, request_id, hashes, Some(session)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_after_a_snapshot_comes_back_exact_with_cordons_sessions_and_leases() {
    let dir = state_dir("sigkill");
    let durable = Process::start(&dir, free_addr(), &[]).await;
    let reference = TestServer::start().await;
    let channels = [durable.channel.clone(), reference.channel.clone()];

    let mut workers: Vec<History> = (1..=3).map(History::new).collect();
    for channel in &channels {
        for w in &workers {
            let mut r = registration(w.worker_id, MODEL);
            r.lease_ttl_secs = 120;
            WorkersClient::new(channel.clone())
                .register_worker(r)
                .await
                .expect("register");
        }
    }
    // Before the snapshot: overlapping chains, and evictions that leave a
    // block held below an evicted parent.
    for (i, w) in workers.iter_mut().enumerate() {
        let chain = w.store_chain(None, &[1, 2, 3, 4, 5, 6, 7, 8]);
        w.store_chain(Some(chain[3]), &[40 + i as u64, 41, 42]);
        w.remove(&[chain[1]]);
        w.remove(&[chain[7]]);
    }
    for channel in &channels {
        for w in &workers {
            publish_and_heal(channel, w, 0).await;
        }
        AdminClient::new(channel.clone())
            .cordon_worker(pb::CordonWorkerRequest { worker_id: 2 })
            .await
            .expect("cordon");
    }
    let pinned: Vec<u64> = {
        let mut pinned = Vec::new();
        for channel in &channels {
            pinned.push(route_session(channel, "r-1", "conversation", &[1, 2, 3]).await);
        }
        pinned
    };
    assert_eq!(pinned[0], pinned[1]);
    let written = durable
        .admin()
        .snapshot(pb::SnapshotRequest {})
        .await
        .expect("snapshot")
        .into_inner();
    assert!(written.entries > 0 && written.workers == 3, "{written:?}");
    let saved: Vec<usize> = workers.iter().map(|w| w.events.len()).collect();

    // After the snapshot, events the durable server sees before it dies.
    let late: Vec<Vec<u64>> = workers
        .iter_mut()
        .map(|w| w.store_chain(None, &[9, 10, 11]))
        .collect();
    for w in &workers {
        publish_and_heal(&durable.channel, w, saved[(w.worker_id - 1) as usize]).await;
        publish_and_heal(&reference.channel, w, saved[(w.worker_id - 1) as usize]).await;
    }
    let addr = durable.kill_9();

    // While it is down, the workers go on, evicting blocks it saw stored.
    for (w, late) in workers.iter_mut().zip(&late) {
        w.store_chain(None, &[12, 13]);
        w.remove(&[late[2]]);
        w.remove(&[late[0]]);
    }
    for w in &workers {
        publish_and_heal(&reference.channel, w, 0).await;
    }
    let restarted = Process::start(&dir, addr, &[]).await;
    // Each worker sends only its newest event; the server asks for the rest.
    for w in &workers {
        publish_and_heal(&restarted.channel, w, w.events.len() - 1).await;
    }
    assert_eq!(
        digest(&restarted.channel).await,
        digest(&reference.channel).await,
        "index after restart and resends"
    );
    assert_eq!(
        restarted.metric(r#"kvroute_snapshots_total{outcome="loaded"}"#),
        1.0
    );
    assert_eq!(
        restarted.metric("kvroute_snapshot_entries_restored"),
        written.entries as f64
    );
    assert!(restarted.metric(r#"kvroute_catchup_events_total{source="grpc"}"#) >= 9.0);
    let cordoned = restarted
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: 2 })
        .await
        .expect("worker 2")
        .into_inner();
    assert!(cordoned.cordoned, "the cordon survived");
    assert!(
        cordoned.lease_remaining_ms > 60_000 && cordoned.lease_remaining_ms <= 120_000,
        "the lease kept its time left: {}",
        cordoned.lease_remaining_ms
    );
    assert_eq!(
        route_session(&restarted.channel, "r-2", "conversation", &[9, 10]).await,
        pinned[0],
        "the HARD session still pins"
    );
    drop(restarted);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Delivers `worker`'s unacknowledged events to the server on `channel` and
/// answers its replies (resends, resyncs) until it is asked for nothing.
async fn deliver(channel: &Channel, worker: &mut TestWorker) {
    let mut client = WorkersClient::new(channel.clone());
    let mut events = worker.unacked();
    for _ in 0..10 {
        if events.is_empty() {
            return;
        }
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let mut replies = client
            .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .expect("open stream")
            .into_inner();
        tx.send(worker.batch(&events)).await.expect("send");
        let reply = replies.message().await.expect("reply").expect("a reply");
        events = worker.on_reply(Reply::from_pb(&reply), worker.next_event_id());
    }
    panic!("the exchange does not converge");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_can_no_longer_resend_resynchronises_with_a_full_dump() {
    let dir = state_dir("resync");
    let durable = Process::start(&dir, free_addr(), &[]).await;
    let reference = TestServer::start().await;
    for channel in [&durable.channel, &reference.channel] {
        let mut r = registration(4, MODEL);
        r.lease_ttl_secs = 120;
        WorkersClient::new(channel.clone())
            .register_worker(r)
            .await
            .expect("register");
    }
    // The same history for both servers, from two copies of the worker.
    let mut worker = TestWorker::new(4, 0, 0);
    let mut tips = Vec::new();
    for chain in 0..4u64 {
        let (_, event) = worker.store(None, &[1, 2, 100 + chain, 200 + chain]);
        if let Ev::Stored { blocks, .. } = event {
            tips.push(blocks.iter().map(|b| b.0).collect::<Vec<_>>());
        }
    }
    worker.remove(&[tips[0][1]]);
    let mut seen_by_reference = worker.clone();
    deliver(&durable.channel, &mut worker).await;
    deliver(&reference.channel, &mut seen_by_reference).await;
    durable
        .admin()
        .snapshot(pb::SnapshotRequest {})
        .await
        .expect("snapshot");

    // After the snapshot: acknowledged by the durable kvroute, so the
    // worker forgets them; then it dies.
    for w in [&mut worker, &mut seen_by_reference] {
        w.store(Some(tips[1][3]), &[300, 301]);
        w.remove(&[tips[2][3]]);
    }
    deliver(&durable.channel, &mut worker).await;
    deliver(&reference.channel, &mut seen_by_reference).await;
    let addr = durable.kill_9();
    let restarted = Process::start(&dir, addr, &[]).await;

    // Its next events: the restored cursor asks for what followed the
    // snapshot, which the worker no longer has: it resyncs.
    for w in [&mut worker, &mut seen_by_reference] {
        w.store(Some(tips[3][3]), &[400]);
    }
    deliver(&restarted.channel, &mut worker).await;
    deliver(&reference.channel, &mut seen_by_reference).await;
    assert_eq!(worker.resyncs, 1, "the worker resynchronised once");
    assert_eq!(
        digest(&restarted.channel).await,
        digest(&reference.channel).await,
        "after the resync the index holds exactly what the worker holds"
    );
    drop(restarted);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `kvroute serve` on a state directory whose snapshot is damaged;
/// returns its exit code (`None`: it started serving, and was stopped) and
/// what it logged until then.
fn start_on_damaged(dir: &Path, extra: &[&str]) -> (Option<i32>, String) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .arg("serve")
        .args(["--grpc-addr", &free_addr().to_string()])
        .args(["--metrics-addr", &free_addr().to_string()])
        .args(["--state-dir", &dir.display().to_string()])
        .args(["--log-format", "json"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvroute");
    let stderr = child.stderr.take().expect("stderr");
    let mut logged = String::new();
    for line in std::io::BufReader::new(stderr).lines() {
        let line = line.expect("stderr line");
        logged.push_str(&line);
        logged.push('\n');
        if line.contains("kvroute serving") {
            child.kill().expect("kill");
            child.wait().expect("reap");
            return (None, logged);
        }
    }
    (child.wait().expect("exit").code(), logged)
}

fn snapshot_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_snapshot_starts_cold_in_one_line_or_refuses_when_required() {
    for damage in ["flip", "truncate"] {
        let dir = state_dir(&format!("damaged-{damage}"));
        {
            let process = Process::start(&dir, free_addr(), &[]).await;
            let mut r = registration(5, MODEL);
            r.lease_ttl_secs = 120;
            WorkersClient::new(process.channel.clone())
                .register_worker(r)
                .await
                .expect("register");
            process
                .admin()
                .snapshot(pb::SnapshotRequest {})
                .await
                .expect("snapshot");
        }
        let names = snapshot_files(&dir);
        assert_eq!(names.len(), 1, "{names:?}");
        let path = dir.join(&names[0]);
        let mut bytes = std::fs::read(&path).expect("read snapshot");
        match damage {
            "flip" => {
                let at = bytes.len() - 3;
                bytes[at] ^= 0x5a;
            }
            _ => bytes.truncate(bytes.len() / 2),
        }
        std::fs::write(&path, &bytes).expect("damage snapshot");

        // Required: refuses to start, names the file, leaves it in place.
        let (code, stderr) = start_on_damaged(&dir, &["--require-snapshot"]);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(
            stderr.contains(&names[0])
                && stderr.contains("no snapshot in the state directory loads"),
            "{stderr}"
        );
        assert_eq!(snapshot_files(&dir), names);

        // Not required: one error line, the file moved aside, a cold start.
        let (code, stderr) = start_on_damaged(&dir, &[]);
        assert_eq!(code, None, "it serves: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("\"ERROR\"")).collect();
        assert_eq!(errors.len(), 1, "{stderr}");
        assert!(errors[0].contains("moved aside"), "{stderr}");
        assert!(
            stderr
                .lines()
                .any(|l| l.contains("\"WARN\"") && l.contains("starting cold")),
            "{stderr}"
        );
        let after = snapshot_files(&dir);
        assert!(
            after.len() == 1 && after[0].starts_with(&format!("{}.bad-", names[0])),
            "{after:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[tokio::test]
async fn without_a_state_directory_a_snapshot_is_a_failed_precondition() {
    let server = TestServer::start().await;
    let refused = server
        .admin()
        .snapshot(pb::SnapshotRequest {})
        .await
        .expect_err("no state directory");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(refused.message().contains("--state-dir"), "{refused:?}");
}

/// A worker restored from a snapshot that registers again (its engine
/// restarted while kvroute was down) starts a new event stream (#38): its
/// event 0 is applied, not skipped against the restored cursor, and the
/// restored blocks of the old stream are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_worker_registered_again_starts_a_new_event_stream() {
    let dir = state_dir("restored-reregister");
    let first = Process::start(&dir, free_addr(), &[]).await;
    let mut workers = WorkersClient::new(first.channel.clone());
    workers
        .register_worker(registration(1, MODEL))
        .await
        .unwrap();
    let old: Vec<pb::KvEvent> = (0..5)
        .map(|i| stored(i, None, &[(100 + i, 1000 + i)]))
        .collect();
    publish_one(&first.channel, batch(1, 0, old)).await;
    first
        .admin()
        .snapshot(pb::SnapshotRequest {})
        .await
        .unwrap();
    let grpc = first.kill_9();

    let second = Process::start(&dir, grpc, &[]).await;
    assert_eq!(cached(&second, 1).await, 5, "restored from the snapshot");
    WorkersClient::new(second.channel.clone())
        .register_worker(registration(1, MODEL))
        .await
        .unwrap();
    let reply = publish_one(
        &second.channel,
        batch(1, 0, vec![stored(0, None, &[(7, 70)])]),
    )
    .await;
    assert_eq!(
        (reply.last_applied_event_id, reply.skipped),
        (0, 0),
        "{reply:?}"
    );
    assert_eq!(cached(&second, 1).await, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

async fn publish_one(channel: &Channel, batch: pb::KvEventBatch) -> pb::PublishEventsReply {
    let mut replies = WorkersClient::new(channel.clone())
        .publish_events(tokio_stream::iter([batch]))
        .await
        .unwrap()
        .into_inner();
    replies.message().await.unwrap().expect("a reply")
}

async fn cached(process: &Process, worker_id: u64) -> u64 {
    process
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id })
        .await
        .unwrap()
        .into_inner()
        .ranks
        .iter()
        .map(|r| r.cached_blocks)
        .sum()
}

/// A damaged newest snapshot (#38): the next older one loads, the damaged
/// one is moved aside, and the snapshots written afterwards never prune the
/// one that loaded before two newer ones exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_newest_snapshot_falls_back_to_the_newest_that_loads() {
    let dir = state_dir("fallback");
    {
        let process = Process::start(&dir, free_addr(), &[]).await;
        let mut workers = WorkersClient::new(process.channel.clone());
        workers
            .register_worker(registration(1, MODEL))
            .await
            .unwrap();
        process
            .admin()
            .snapshot(pb::SnapshotRequest {})
            .await
            .unwrap();
        workers
            .register_worker(registration(2, MODEL))
            .await
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        process
            .admin()
            .snapshot(pb::SnapshotRequest {})
            .await
            .unwrap();
    }
    let names = snapshot_files(&dir);
    assert_eq!(names.len(), 2, "{names:?}");
    let newest = dir.join(&names[1]);
    let mut bytes = std::fs::read(&newest).unwrap();
    let at = bytes.len() - 2;
    bytes[at] ^= 0x5a;
    std::fs::write(&newest, &bytes).unwrap();

    let process = Process::start(&dir, free_addr(), &[]).await;
    let listed = process
        .admin()
        .list_workers(pb::ListWorkersRequest::default())
        .await
        .unwrap()
        .into_inner()
        .workers;
    let ids: Vec<u64> = listed.iter().map(|w| w.worker_id).collect();
    assert_eq!(ids, [1], "the older snapshot's state");
    let after = snapshot_files(&dir);
    assert_eq!(after[0], names[0], "the one that loaded stays: {after:?}");
    assert!(
        after[1].starts_with(&format!("{}.bad-", names[1])),
        "{after:?}"
    );
    assert_eq!(
        process.metric("kvroute_snapshots_total{outcome=\"damaged\"}"),
        1.0
    );
    // One snapshot written since: the loaded one is still one of the two kept.
    process
        .admin()
        .snapshot(pb::SnapshotRequest {})
        .await
        .unwrap();
    let kept: Vec<String> = snapshot_files(&dir)
        .into_iter()
        .filter(|n| n.ends_with(".kvs"))
        .collect();
    assert_eq!(kept.len(), 2, "{kept:?}");
    assert_eq!(kept[0], names[0]);
    drop(process);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A planted snapshot with a valid checksum (#38) is held to what
/// RegisterWorker accepts now, worker by worker: the server's limits, the
/// hard limits, names, the engine endpoint rule, one entry per worker id,
/// and blocks only for ranks a restored worker has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_snapshot_is_held_to_what_registration_accepts() {
    let dir = state_dir("planted");
    let worker = |worker_id: u64| pb::SnapshotWorker {
        worker_id,
        model: MODEL.into(),
        block_size: 16,
        dp_size: 1,
        total_kv_blocks: 1000,
        lease_ttl_ms: 600_000,
        lease_remaining_ms: 600_000,
        ..Default::default()
    };
    let target = |worker_id: u64, dp_rank: u32| pb::SnapshotTarget {
        worker_id,
        dp_rank,
        locals: vec![11, 12],
        parent_back: vec![0, 1],
        engines: vec![101, 102],
        ..Default::default()
    };
    let state = pb::SnapshotState {
        taken_unix_ms: 1,
        workers: vec![
            worker(1),
            pb::SnapshotWorker {
                total_kv_blocks: 1 << 63,
                ..worker(2)
            },
            pb::SnapshotWorker {
                dp_size: 1024,
                ..worker(3)
            },
            pb::SnapshotWorker {
                model: "m".repeat(1 << 20),
                ..worker(4)
            },
            pb::SnapshotWorker {
                events_endpoint: "tcp://169.254.169.254:80".into(),
                events_dialect: "vllm".into(),
                ..worker(5)
            },
            pb::SnapshotWorker {
                model: "other".into(),
                ..worker(1)
            },
            worker(6),
            worker(7),
        ],
        targets: vec![target(1, 0), target(1, 5)],
        ..Default::default()
    };
    std::fs::write(
        dir.join(format!("snapshot-{:020}.kvs", 1)),
        kvroute::snapshot::format::encode(&state),
    )
    .unwrap();
    let process = Process::start(&dir, free_addr(), &["--max-workers", "2"]).await;
    let listed = process
        .admin()
        .list_workers(pb::ListWorkersRequest::default())
        .await
        .unwrap()
        .into_inner()
        .workers;
    let ids: Vec<(u64, String)> = listed
        .iter()
        .map(|w| (w.worker_id, w.model.clone()))
        .collect();
    assert_eq!(ids, [(1, MODEL.to_string()), (6, MODEL.to_string())]);
    assert!(
        listed.iter().all(|w| w.subscription.is_empty()),
        "{listed:?}"
    );
    let stats = process
        .admin()
        .get_index_stats(pb::GetIndexStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.entries, 2, "rank 0's blocks only, no ghost rank");
    assert_eq!(cached(&process, 1).await, 2);
    drop(process);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A state directory that cannot be written (#38): Admin/Snapshot answers
/// FAILED_PRECONDITION naming the file, and a shutdown whose snapshot
/// fails exits non-zero, as it logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwritable_state_directory_is_a_failed_precondition_and_a_failed_exit() {
    let dir = state_dir("unwritable");
    let mut process = Process::start(&dir, free_addr(), &[]).await;
    std::fs::remove_dir_all(&dir).unwrap();
    let refused = process
        .admin()
        .snapshot(pb::SnapshotRequest {})
        .await
        .expect_err("nowhere to write");
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    assert!(refused.message().contains("snapshot"), "{refused:?}");
    let terminated = Command::new("kill")
        .args(["-TERM", &process.child.id().to_string()])
        .status()
        .unwrap();
    assert!(terminated.success());
    let status = process.child.wait().unwrap();
    assert_eq!(status.code(), Some(1), "the shutdown snapshot failed");
}
