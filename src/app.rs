//! Wires the services together and runs them until shutdown.
//!
//! `run` is what `main` and the integration tests call: it takes already
//! bound listeners (tests bind `127.0.0.1:0`) and a shutdown future. The
//! shutdown sequence is: health NOT_SERVING → optional drain delay (still
//! accepting) → stop accepting, let in-flight calls finish → after the grace
//! period, abort whatever is left → background tasks stop → return.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use tokio::net::TcpListener;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::transport::{Server, server::TcpIncoming};
use tower::limit::GlobalConcurrencyLimitLayer;

use crate::{
    config::ServeConfig,
    core::RouterCore,
    grpc::{
        admin::AdminService,
        router::RouterService,
        rpc_metrics::{RpcMetricsLayer, rpc_paths},
        workers::WorkersService,
    },
    ingest::{self, IngestHandle},
    metrics::Metrics,
    pb,
    registry::Registration,
    subscriptions::Subscriptions,
    types::WorkerRole,
};

/// The gRPC service names health reports on, besides the overall "".
pub const SERVICE_NAMES: [&str; 3] = [
    "kvroute.v1.Router",
    "kvroute.v1.Workers",
    "kvroute.v1.Admin",
];

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr} ({setting})")]
    Bind {
        addr: SocketAddr,
        setting: &'static str,
        source: std::io::Error,
    },
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("cannot start the index writer thread: {0}")]
    Writer(std::io::Error),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("--engine {worker_id}: {message}")]
    Engine { worker_id: u64, message: String },
}

/// Binds the configured gRPC and metrics addresses, naming the setting on
/// failure.
pub async fn bind(config: &ServeConfig) -> Result<(TcpListener, TcpListener), ServeError> {
    let bind_one = |addr: SocketAddr, setting: &'static str| async move {
        TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Bind {
                addr,
                setting,
                source,
            })
    };
    let grpc = bind_one(config.grpc_addr, "grpc_addr").await?;
    let metrics = bind_one(config.metrics_addr, "metrics_addr").await?;
    Ok((grpc, metrics))
}

/// Runs kvroute on the given listeners until `shutdown` resolves, then drains.
pub async fn run(
    config: ServeConfig,
    grpc_listener: TcpListener,
    metrics_listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let metrics = Metrics::new()?;
    let core = Arc::new(RouterCore::new(config.clone(), metrics.clone()));
    let ingest = ingest::start_writer(core.clone()).map_err(ServeError::Writer)?;
    let subscriptions = Subscriptions::new(ingest.clone(), metrics.clone());
    if let Err(error) = start_configured_engines(&config, &core, &subscriptions).await {
        subscriptions.shutdown().await;
        return Err(error);
    }
    let tasks = TaskTracker::new();
    let stop_tasks = CancellationToken::new();

    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, tonic_health::ServingStatus::NotServing).await;

    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let max = usize::try_from(config.max_message_bytes).unwrap_or(usize::MAX);
    let router = pb::router_server::RouterServer::new(RouterService::new(core.clone()))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let workers = pb::workers_server::WorkersServer::new(WorkersService::new(
        core.clone(),
        ingest.clone(),
        subscriptions.clone(),
    ))
    .max_decoding_message_size(max)
    .max_encoding_message_size(max);
    let admin =
        pb::admin_server::AdminServer::new(AdminService::new(core.clone(), subscriptions.clone()))
            .max_decoding_message_size(max)
            .max_encoding_message_size(max);

    let known_paths = rpc_paths(&[
        pb::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
    ]);
    let concurrency = usize::try_from(config.concurrency_limit).unwrap_or(usize::MAX);

    let stop_accepting = CancellationToken::new();
    let grpc_addr = grpc_listener.local_addr().ok();
    let server = Server::builder()
        .timeout(config.request_timeout)
        .trace_fn(|request| tracing::info_span!("rpc", method = %request.uri().path()))
        .layer(GlobalConcurrencyLimitLayer::new(concurrency))
        .layer(RpcMetricsLayer::new(metrics.clone(), known_paths))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(router)
        .add_service(workers)
        .add_service(admin)
        .serve_with_incoming_shutdown(
            // TCP_NODELAY: a request's HEADERS and DATA frames are separate
            // writes; with Nagle on, delayed ACKs stall them ~40 ms.
            TcpIncoming::from(grpc_listener)
                .with_nodelay(Some(true))
                .with_keepalive(Some(Duration::from_secs(60))),
            stop_accepting.clone().cancelled_owned(),
        );
    let mut server = tokio::spawn(server);

    let metrics_addr = metrics_listener.local_addr().ok();
    tasks.spawn(serve_metrics(
        metrics_listener,
        metrics.clone(),
        subscriptions.clone(),
        stop_tasks.clone(),
    ));
    tasks.spawn(housekeeping(
        core.clone(),
        ingest,
        subscriptions.clone(),
        stop_tasks.clone(),
    ));
    tasks.close();

    set_health(&health, tonic_health::ServingStatus::Serving).await;
    tracing::info!(grpc = ?grpc_addr, metrics = ?metrics_addr, "kvroute serving");

    tokio::select! {
        () = shutdown => {}
        result = &mut server => {
            // The server ended on its own: an accept loop failure.
            stop_tasks.cancel();
            tasks.wait().await;
            subscriptions.shutdown().await;
            return flatten(result);
        }
    }

    tracing::info!("shutdown requested: health NOT_SERVING, draining");
    core.fail_queue();
    set_health(&health, tonic_health::ServingStatus::NotServing).await;
    if !config.drain_delay.is_zero() {
        tokio::time::sleep(config.drain_delay).await;
    }
    stop_accepting.cancel();
    let result = match tokio::time::timeout(config.shutdown_grace, &mut server).await {
        Ok(result) => flatten(result),
        Err(_) => {
            tracing::warn!(
                grace = ?config.shutdown_grace,
                "grace period over: aborting calls still in flight"
            );
            server.abort();
            Ok(())
        }
    };
    stop_tasks.cancel();
    if tokio::time::timeout(Duration::from_secs(5), tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!("background tasks did not stop within 5s");
    }
    if tokio::time::timeout(Duration::from_secs(5), subscriptions.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("engine event subscriptions did not stop within 5s");
    }
    tracing::info!("kvroute stopped");
    result
}

fn flatten(
    result: Result<Result<(), tonic::transport::Error>, tokio::task::JoinError>,
) -> Result<(), ServeError> {
    match result {
        Ok(inner) => inner.map_err(ServeError::from),
        Err(join_error) => {
            tracing::error!(%join_error, "gRPC server task failed");
            Ok(())
        }
    }
}

async fn set_health(
    health: &tonic_health::server::HealthReporter,
    status: tonic_health::ServingStatus,
) {
    health.set_service_status("", status).await;
    for name in SERVICE_NAMES {
        health.set_service_status(name, status).await;
    }
}

/// Registers every `--engine` of the configuration as a worker and starts
/// its subscription.
async fn start_configured_engines(
    config: &ServeConfig,
    core: &Arc<RouterCore>,
    subscriptions: &Subscriptions,
) -> Result<(), ServeError> {
    for spec in &config.engine {
        let worker_id = spec.worker_id;
        let failed = |message: String| ServeError::Engine { worker_id, message };
        if subscriptions.is_configured(worker_id) {
            return Err(failed("worker id configured twice".into()));
        }
        core.register_worker(Registration {
            worker_id,
            model: spec.model.clone(),
            role: WorkerRole::Aggregated,
            endpoint: spec.source.endpoint.clone(),
            block_size: spec.block_size,
            dp_start_rank: spec.dp_start_rank,
            dp_size: spec.dp_size,
            total_kv_blocks: 0,
            max_num_batched_tokens: 0,
            taints: Vec::new(),
            lease_ttl: None,
        })
        .map_err(|e| failed(e.to_string()))?;
        let record = core
            .registry
            .read()
            .get(worker_id)
            .cloned()
            .ok_or_else(|| failed("not registered".into()))?;
        subscriptions
            .update(&record, Some(spec.source.clone()), true)
            .await
            .map_err(failed)?;
    }
    Ok(())
}

/// Periodic upkeep: configured engines' leases, lapsed leases (with their
/// blocks, subscriptions, bookings and sessions), expired bookings and
/// sessions, index and subscription gauges.
async fn housekeeping(
    core: Arc<RouterCore>,
    ingest: IngestHandle,
    subscriptions: Arc<Subscriptions>,
    stop: CancellationToken,
) {
    let period =
        (core.config.lease_ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = ticker.tick() => {}
        }
        subscriptions.renew_configured(&core);
        for record in core.reap_expired_leases() {
            let worker_id = record.registration.worker_id;
            subscriptions.stop(worker_id).await;
            let blocks = ingest
                .remove_worker(worker_id, record.registration.model)
                .await;
            core.forget_worker(worker_id);
            tracing::warn!(worker_id, blocks, "lease lapsed: worker removed");
        }
        core.expire_bookings();
        core.refresh_index_gauges();
        subscriptions.export_metrics();
    }
}

async fn serve_metrics(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    subscriptions: Arc<Subscriptions>,
    stop: CancellationToken,
) {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            subscriptions.export_metrics();
            async move {
                (
                    [(
                        http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    metrics.render(),
                )
            }
        }),
    );
    if let Err(error) = axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
    {
        tracing::error!(%error, "metrics server failed");
    }
}
