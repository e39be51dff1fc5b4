//! Load benchmarks against a real server over loopback gRPC:
//! `kvroute bench select` (SelectWorker beside health checks) and
//! `kvroute bench ingest` (PublishEvents throughput and exactness),
//! `kvroute bench snapshot`, `kvroute bench cluster` (replicas),
//! `kvroute bench decisions` (replicas deciding in order or not) and
//! `kvroute bench soak` (a long mixed run with a verdict). Each
//! starts kvroute in-process on 127.0.0.1:0 unless given `--addr`, and prints
//! one JSON line per measurement plus a human summary on stderr.

pub mod cluster;
pub mod decisions;
pub mod histogram;
pub mod ingest;
pub mod select;
pub mod snapshot;
pub mod soak;
mod tls;

use std::{net::SocketAddr, time::Duration};

use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;

use kvroute::{app, config::ServeConfig, security::client::ClientCredentials};

/// Why a benchmark failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Setup(String),
    #[error("gRPC: {0}")]
    Rpc(#[from] tonic::Status),
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("{0}")]
    Oplog(#[from] crate::oplog::OplogError),
    #[error("{0}")]
    Trace(#[from] crate::trace::TraceError),
    #[error("mismatch: {0}")]
    Mismatch(String),
}

/// A kvroute server this process started for a benchmark.
pub struct LocalServer {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    handle: JoinHandle<Result<(), app::ServeError>>,
}

impl LocalServer {
    pub(crate) async fn start(config: ServeConfig) -> Result<Self, BenchError> {
        Self::start_with_client(config, &ClientCredentials::default()).await
    }

    /// Starts a server that a client with `credentials` can reach (a TLS
    /// one, for `bench select --tls`).
    pub(crate) async fn start_with_client(
        config: ServeConfig,
        credentials: &ClientCredentials,
    ) -> Result<Self, BenchError> {
        let bind = |what: &'static str| async move {
            TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| BenchError::Setup(format!("bind {what}: {e}")))
        };
        let grpc = bind("grpc").await?;
        let metrics = bind("metrics").await?;
        let addr = grpc
            .local_addr()
            .map_err(|e| BenchError::Setup(e.to_string()))?;
        let metrics_addr = metrics
            .local_addr()
            .map_err(|e| BenchError::Setup(e.to_string()))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let handle = tokio::spawn(app::run(config, grpc, metrics, async move {
            let _ = stopped.await;
        }));
        let server = Self {
            addr,
            metrics_addr,
            stop: Some(stop),
            handle,
        };
        let channel = connect_as(credentials, &addr.to_string()).await?;
        server.wait_serving(channel).await?;
        Ok(server)
    }

    /// Waits until health says SERVING (with a state directory, every other
    /// call is UNAVAILABLE while the snapshot loads).
    async fn wait_serving(&self, channel: Channel) -> Result<(), BenchError> {
        use tonic_health::pb::{
            HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
        };
        let mut health = HealthClient::new(channel);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while tokio::time::Instant::now() < deadline {
            let status = health
                .check(HealthCheckRequest::default())
                .await
                .map(|r| r.into_inner().status);
            if matches!(status, Ok(s) if s == ServingStatus::Serving as i32) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(BenchError::Setup("the server never said SERVING".into()))
    }

    /// The text of its `GET /metrics`, if it answers.
    pub(crate) async fn scrape(&self) -> Option<String> {
        scrape_metrics(&self.metrics_addr.to_string()).await
    }

    pub(crate) async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(30), &mut self.handle).await;
    }
}

/// The server a benchmark talks to: `addr` when given, else one started
/// here with `config` (returned so the caller can stop it).
pub(crate) async fn target(
    addr: Option<&str>,
    config: ServeConfig,
) -> Result<(String, Option<LocalServer>), BenchError> {
    match addr {
        Some(addr) => Ok((addr.to_string(), None)),
        None => {
            let local = LocalServer::start(config).await?;
            Ok((local.addr.to_string(), Some(local)))
        }
    }
}

/// The text of `GET /metrics` at `addr` (host:port, plaintext), if it answers.
/// The value of the series `series` (a name, with its labels if it has
/// any, as the exposition writes them) in a text exposition; `None` when
/// absent or not a finite non-negative number.
pub(crate) fn series_value(text: &str, series: &str) -> Option<u64> {
    let line = text.lines().find(|l| {
        l.strip_prefix(series)
            .is_some_and(|rest| rest.starts_with(' '))
    })?;
    let value: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    (value.is_finite() && value >= 0.0).then_some(value as u64)
}

pub(crate) async fn scrape_metrics(addr: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: kvroute\r\n\r\n")
        .await
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
}

/// Connects to `addr` (host:port or a URL) in plaintext.
pub(crate) async fn connect(addr: &str) -> Result<Channel, BenchError> {
    connect_as(&ClientCredentials::default(), addr).await
}

/// Connects to `addr` with `credentials` (TLS when they name a CA).
pub(crate) async fn connect_as(
    credentials: &ClientCredentials,
    addr: &str,
) -> Result<Channel, BenchError> {
    let endpoint = credentials.endpoint(addr).map_err(BenchError::Setup)?;
    Ok(endpoint
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect()
        .await?)
}

/// Latency percentiles in microseconds of a set of samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Latency {
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl Latency {
    pub(crate) fn of(samples: &mut [Duration]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        let at = |q: f64| {
            let index = ((samples.len() - 1) as f64 * q).round() as usize;
            samples[index.min(samples.len() - 1)].as_secs_f64() * 1e6
        };
        Self {
            p50_us: at(0.50),
            p99_us: at(0.99),
            max_us: at(1.0),
        }
    }
}
