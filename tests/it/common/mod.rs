//! TestServer: the real kvroute app on `127.0.0.1:0`, with typed gRPC clients
//! and a shutdown handle. Every integration test talks to it over the network.
//! `worker::TestWorker` is a worker's side of the KV event protocol.
#![allow(dead_code)]

pub mod cluster;
pub mod worker;

use std::{net::SocketAddr, time::Duration};

use kvroute::{
    app,
    config::ServeConfig,
    pb::{admin_client::AdminClient, router_client::RouterClient, workers_client::WorkersClient},
};
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;

pub struct TestServer {
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub channel: Channel,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<Result<(), app::ServeError>>>,
}

impl TestServer {
    pub async fn start() -> Self {
        Self::start_with(ServeConfig::for_tests()).await
    }

    pub async fn start_with(config: ServeConfig) -> Self {
        let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind grpc");
        let metrics = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind metrics");
        let grpc_addr = grpc.local_addr().expect("grpc addr");
        let metrics_addr = metrics.local_addr().expect("metrics addr");
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(app::run(config, grpc, metrics, async move {
            let _ = rx.await;
        }));
        let channel = connect(grpc_addr).await;
        wait_serving(&channel).await;
        Self {
            grpc_addr,
            metrics_addr,
            channel,
            shutdown: Some(tx),
            handle: Some(handle),
        }
    }

    pub fn router(&self) -> RouterClient<Channel> {
        RouterClient::new(self.channel.clone())
    }
    pub fn workers(&self) -> WorkersClient<Channel> {
        WorkersClient::new(self.channel.clone())
    }
    pub fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel.clone())
    }
    pub fn health(&self) -> tonic_health::pb::health_client::HealthClient<Channel> {
        tonic_health::pb::health_client::HealthClient::new(self.channel.clone())
    }

    /// Starts the shutdown sequence without waiting for it.
    pub fn begin_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Shuts down and waits for `run` to return.
    pub async fn stop(mut self) -> Result<(), app::ServeError> {
        self.begin_shutdown();
        let handle = self.handle.take().expect("running");
        tokio::time::timeout(Duration::from_secs(30), handle)
            .await
            .expect("server stops within 30s")
            .expect("server task did not panic")
    }

    /// GET a path on the metrics address; returns (status, body).
    pub async fn http_get(&self, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.metrics_addr)
            .await
            .expect("connect metrics");
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut raw = String::new();
        stream.read_to_string(&mut raw).await.expect("read");
        let status = raw
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = raw
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (status, body)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.begin_shutdown();
    }
}

/// Waits until health says SERVING: with a state directory, every other
/// call is UNAVAILABLE while the snapshot loads.
pub async fn wait_serving(channel: &Channel) {
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    for _ in 0..1000 {
        let status = health
            .check(HealthCheckRequest::default())
            .await
            .map(|r| r.into_inner().status)
            .ok();
        if status == Some(ServingStatus::Serving as i32) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("kvroute never said SERVING");
}

pub async fn connect(addr: SocketAddr) -> Channel {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5));
    for _ in 0..100 {
        if let Ok(channel) = endpoint.connect().await {
            return channel;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("could not connect to {addr}");
}

use kvroute::{grpc::convert::kv_event_to_pb, pb};
use kvroute_core::index::KvEvent;

/// A registration with sensible defaults for tests.
pub fn registration(worker_id: u64, model: &str) -> pb::RegisterWorkerRequest {
    pb::RegisterWorkerRequest {
        worker_id,
        model: model.into(),
        block_size: 16,
        dp_size: 1,
        total_kv_blocks: 10_000,
        max_num_batched_tokens: 8192,
        ..Default::default()
    }
}

impl TestServer {
    pub async fn register(&self, request: pb::RegisterWorkerRequest) {
        self.workers()
            .register_worker(request)
            .await
            .expect("register worker");
    }

    /// GetWorker's answer for a registered worker.
    pub async fn worker_info(&self, worker_id: u64) -> pb::WorkerInfo {
        self.admin()
            .get_worker(pb::GetWorkerRequest { worker_id })
            .await
            .expect("get worker")
            .into_inner()
    }

    /// GetIndexStats' answer.
    pub async fn index_stats(&self) -> pb::IndexStats {
        self.admin()
            .get_index_stats(pb::GetIndexStatsRequest::default())
            .await
            .expect("index stats")
            .into_inner()
    }

    /// Opens a PublishEvents stream; returns its sender and reply stream.
    pub async fn open_events(
        &self,
    ) -> (
        tokio::sync::mpsc::Sender<pb::KvEventBatch>,
        tonic::Streaming<pb::PublishEventsReply>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let replies = self
            .workers()
            .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .expect("open stream")
            .into_inner();
        (tx, replies)
    }

    /// Sends one batch on a fresh stream and returns the reply.
    pub async fn publish(
        &self,
        batch: pb::KvEventBatch,
    ) -> Result<pb::PublishEventsReply, tonic::Status> {
        let (tx, mut replies) = self.open_events().await;
        tx.send(batch).await.expect("send batch");
        let reply = replies.message().await;
        drop(tx);
        match reply {
            Ok(Some(reply)) => Ok(reply),
            Ok(None) => Err(tonic::Status::unknown("stream closed without reply")),
            Err(status) => Err(status),
        }
    }
}

/// A stored event of blocks given as (engine hash, local hash).
pub fn stored(event_id: u64, parent: Option<u64>, blocks: &[(u64, u64)]) -> pb::KvEvent {
    let blocks = blocks.to_vec();
    kv_event_to_pb(event_id, &KvEvent::Stored { parent, blocks })
}

pub fn removed(event_id: u64, engine_hashes: &[u64]) -> pb::KvEvent {
    let blocks = engine_hashes.to_vec();
    kv_event_to_pb(event_id, &KvEvent::Removed { blocks })
}

pub fn cleared(event_id: u64) -> pb::KvEvent {
    kv_event_to_pb(event_id, &KvEvent::Cleared)
}

pub fn batch(worker_id: u64, dp_rank: u32, events: Vec<pb::KvEvent>) -> pb::KvEventBatch {
    pb::KvEventBatch {
        worker_id,
        dp_rank,
        events,
    }
}

/// A SelectWorker request over precomputed local hashes.
/// SelectWorker over `channel` for a block-hash prompt of `model`, under a
/// HARD session when one is named; the chosen worker's id.
pub async fn route_hashes(
    channel: &Channel,
    model: &str,
    request_id: &str,
    hashes: &[u64],
    hard_session: Option<&str>,
) -> u64 {
    let mut request = select_hashes(request_id, model, hashes);
    request.session = hard_session.map(|s| pb::SessionAffinity {
        session_id: s.into(),
        mode: pb::AffinityMode::Hard.into(),
    });
    RouterClient::new(channel.clone())
        .select_worker(request)
        .await
        .expect("select")
        .into_inner()
        .worker_id
}

pub fn select_hashes(request_id: &str, model: &str, hashes: &[u64]) -> pb::SelectWorkerRequest {
    pb::SelectWorkerRequest {
        request_id: request_id.into(),
        model: model.into(),
        prompt: Some(pb::Prompt {
            content: Some(pb::prompt::Content::BlockHashes(pb::BlockHashes {
                hashes: hashes.to_vec(),
            })),
        }),
        ..Default::default()
    }
}

/// A registration claiming `dp_size` ranks of `blocks` KV blocks each.
pub fn claim(worker_id: u64, model: &str, dp_size: u32, blocks: u64) -> pb::RegisterWorkerRequest {
    pb::RegisterWorkerRequest {
        dp_size,
        total_kv_blocks: blocks,
        lease_ttl_secs: 600,
        ..registration(worker_id, model)
    }
}

pub async fn try_register(
    server: &TestServer,
    request: pb::RegisterWorkerRequest,
) -> Result<(), tonic::Status> {
    server.workers().register_worker(request).await.map(|_| ())
}

/// The RESOURCE_EXHAUSTED refusal of a registration, which must name the
/// worker and the limit.
pub async fn refused(server: &TestServer, request: pb::RegisterWorkerRequest, limit: &str) {
    let worker_id = request.worker_id;
    let status = try_register(server, request)
        .await
        .expect_err("registration past a limit");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let message = status.message();
    assert!(
        message.contains(limit) && message.contains(&format!("worker {worker_id}")),
        "{message}"
    );
}
