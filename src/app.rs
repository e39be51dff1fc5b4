//! Wires the services together and runs them until shutdown.
//!
//! `run` is what `main` and the integration tests call: it takes already
//! bound listeners (tests bind `127.0.0.1:0`) and a shutdown future. The
//! shutdown sequence is: health NOT_SERVING → optional drain delay (still
//! accepting) → stop accepting, let in-flight calls finish → after the grace
//! period, abort whatever is left → background tasks stop → return.

use std::{future::Future, net::SocketAddr, pin::Pin, sync::Arc, time::Duration};

use tokio::net::TcpListener;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::transport::{Server, server::TcpIncoming};
use tonic_health::pb::health_server::{Health, HealthServer};
use tower::limit::GlobalConcurrencyLimitLayer;

use crate::{
    cluster::{Cluster, ClusterError, ClusterSettings, ReplicatedChanges},
    config::ServeConfig,
    fleet::{
        Fleet, FleetError,
        changes::{FleetChanges, LocalChanges},
    },
    grpc::{
        admin::AdminService,
        metadata_budget::{HTTP2_HEADER_LIST_BYTES, MetadataBudget},
        router::RouterService,
        rpc_metrics::{RpcMetricsLayer, rpc_paths},
        startup_gate::StartupGate,
        workers::WorkersService,
    },
    http_listener::Bounded,
    ingest::{self, EventWriter},
    metrics::Metrics,
    pb,
    router::RouterCore,
    security::{
        EndpointAllow, Guard, Policy,
        screen::ScreenLayer,
        tls::{ServerTls, TlsFiles},
    },
    snapshot::{SnapshotError, Snapshots, WriteSnapshot},
};

/// The gRPC service names health reports on, besides the overall "":
/// kvroute's services, `readiness` (the same as "") and the endpoint
/// picker's ext_proc service, whose health Envoy checks to fail open.
/// `liveness` is SERVING from the start while the process runs.
pub const SERVICE_NAMES: [&str; 5] = [
    "kvroute.v1.Router",
    "kvroute.v1.Workers",
    "kvroute.v1.Admin",
    "readiness",
    crate::gateway::SERVICE_NAME,
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
    #[error("--engine: {0}")]
    Engine(FleetError),
    #[error("{0}")]
    Snapshot(#[from] SnapshotError),
    /// `--state-dir` names no usable directory.
    #[error("--state-dir: {0}")]
    StateDir(SnapshotError),
    /// Settings that cluster mode replaces.
    #[error("cluster mode: {0}")]
    ClusterSettings(&'static str),
    #[error("cluster mode: {0}")]
    Cluster(#[from] ClusterError),
    #[error("{0}")]
    Security(String),
    /// The endpoint picker's settings (a tokenizer directory, say).
    #[error("{0}")]
    Gateway(String),
}

impl ServeError {
    /// Whether the settings are at fault (exit code 2, as for a bad command
    /// line), not the run: a malformed auth policy or TLS file, protected
    /// mode refusing an open address, a bad `--engine` or `--state-dir`,
    /// settings cluster mode replaces.
    pub fn is_invalid_setting(&self) -> bool {
        matches!(
            self,
            Self::Security(_)
                | Self::ClusterSettings(_)
                | Self::Engine(_)
                | Self::StateDir(_)
                | Self::Gateway(_)
        )
    }
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
    metrics.engine.set_series_cap(
        usize::try_from(config.limits.max_engine_metric_workers).unwrap_or(usize::MAX),
    );
    let grpc_local = grpc_listener.local_addr().ok();
    let security = Security::load(&config, grpc_local, &metrics)?;
    // The web view's own listener, if it has one: bound now, so a taken
    // address fails the start as the other two do.
    let web_listener = match (config.web_ui, config.web_addr) {
        (true, Some(addr)) => {
            Some(
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| ServeError::Bind {
                        addr,
                        setting: "web_addr",
                        source,
                    })?,
            )
        }
        _ => None,
    };
    // Health says NOT_SERVING from the first moment until the snapshot is
    // loaded; the listeners are bound already, so probes get an answer.
    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, tonic_health::ServingStatus::NotServing).await;
    let (fleet, snapshots) = build_fleet(&config, &metrics, &security.endpoint_allow)?;
    let replica = replicated_changes(&config, &fleet)?;
    let gate = StartupGate::new();

    health
        .set_service_status("liveness", tonic_health::ServingStatus::Serving)
        .await;
    let stop_accepting = CancellationToken::new();
    let grpc_addr = grpc_listener.local_addr().ok();
    let ext_proc_future = match config.gateway.ext_proc_addr {
        Some(addr) => Some(
            ext_proc_server(
                &config,
                addr,
                &metrics,
                fleet.router(),
                (&gate, &security),
                health_service.clone(),
                stop_accepting.clone(),
            )
            .await?,
        ),
        None => None,
    };
    let server_future = grpc_server(
        &config,
        &metrics,
        (&fleet, snapshots.clone(), replica.clone()),
        (&gate, &security),
        health_service,
        grpc_listener,
        stop_accepting.clone(),
    )?;
    let server_future: ServerFuture = match ext_proc_future {
        Some(ext_proc) => Box::pin(async move {
            let (grpc, ext_proc) = tokio::join!(server_future, ext_proc);
            grpc.and(ext_proc)
        }),
        None => server_future,
    };
    // With a state directory, serve health (NOT_SERVING) and refuse the
    // rest while the snapshot loads; without one there is nothing to wait
    // for, and the configured engines are registered before the first call.
    let (go, start_serving) = tokio::sync::oneshot::channel::<()>();
    let mut server = tokio::spawn(async move {
        match start_serving.await {
            Ok(()) => server_future.await,
            Err(_) => Ok(()), // the start failed before serving
        }
    });
    let mut go = Some(go);
    if (snapshots.is_some() || replica.is_some())
        && let Some(go) = go.take()
    {
        let _ = go.send(());
    }
    let cluster_tasks = (TaskTracker::new(), CancellationToken::new());
    let started = match &replica {
        Some(changes) => join_cluster(&config, &fleet, changes, &cluster_tasks, &health).await,
        None => restore_and_start(&config, &fleet, snapshots.as_deref()).await,
    };
    if let Err(error) = started {
        drop(go);
        stop_accepting.cancel();
        cluster_tasks.1.cancel();
        let _ = server.await;
        fleet.shutdown().await;
        return Err(error);
    }
    if let Some(go) = go.take() {
        let _ = go.send(());
    }
    gate.open();

    let metrics_addr = metrics_listener.local_addr().ok();
    let background = Background::start(
        (metrics_listener, web_listener),
        &metrics,
        &fleet,
        snapshots.clone(),
        &config,
        &security,
    );

    set_health(&health, tonic_health::ServingStatus::Serving).await;
    tracing::info!(grpc = %shown(grpc_addr), metrics = %shown(metrics_addr), "kvroute serving");

    tokio::select! {
        () = shutdown => {}
        result = &mut server => {
            // The server ended on its own: an accept loop failure.
            background.stop().await;
            fleet.shutdown().await;
            return flatten(result);
        }
    }

    Serving {
        fleet,
        snapshots,
        health,
        cluster_tasks,
        stop_accepting,
        server,
        background,
    }
    .drain_and_stop(&config)
    .await
}

/// What a serving kvroute stops, in order, when shutdown is requested.
struct Serving {
    fleet: Arc<Fleet>,
    snapshots: Option<Arc<Snapshots>>,
    health: tonic_health::server::HealthReporter,
    /// The replica's tasks and their token (cluster mode).
    cluster_tasks: (TaskTracker, CancellationToken),
    stop_accepting: CancellationToken,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    background: Background,
}

impl Serving {
    /// Health NOT_SERVING, the drain delay, no new connections, the calls
    /// in flight finish within the grace period; then the background and
    /// cluster tasks stop, a last snapshot is written and the engine
    /// subscriptions end.
    async fn drain_and_stop(mut self, config: &ServeConfig) -> Result<(), ServeError> {
        let fleet = &self.fleet;
        tracing::info!("shutdown requested: health NOT_SERVING, draining");
        fleet.router().fail_queue();
        self.cluster_tasks.1.cancel();
        set_health(&self.health, tonic_health::ServingStatus::NotServing).await;
        if !config.drain_delay.is_zero() {
            tokio::time::sleep(config.drain_delay).await;
        }
        self.stop_accepting.cancel();
        let result = match tokio::time::timeout(config.shutdown_grace, &mut self.server).await {
            Ok(result) => flatten(result),
            Err(_) => {
                tracing::warn!(
                    grace = ?config.shutdown_grace,
                    "grace period over: aborting calls still in flight"
                );
                self.server.abort();
                Ok(())
            }
        };
        if tokio::time::timeout(Duration::from_secs(5), self.background.stop())
            .await
            .is_err()
        {
            tracing::warn!("background tasks did not stop within 5s");
        }
        // A state that could not be saved is an error of the run: the
        // exit code says so, as the log does.
        let mut result = result;
        if let Some(snapshots) = &self.snapshots
            && let Err(error) = snapshots.write().await
        {
            tracing::error!(%error, "snapshot at shutdown failed");
            if result.is_ok() {
                result = Err(ServeError::Snapshot(error));
            }
        }
        self.cluster_tasks.0.close();
        if tokio::time::timeout(Duration::from_secs(5), self.cluster_tasks.0.wait())
            .await
            .is_err()
        {
            tracing::warn!("cluster tasks did not stop within 5s");
        }
        if tokio::time::timeout(Duration::from_secs(5), fleet.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("engine event subscriptions did not stop within 5s");
        }
        tracing::info!("kvroute stopped");
        result
    }
}

/// The router core, its index writer, the fleet and, with a state
/// directory, its snapshots.
fn build_fleet(
    config: &ServeConfig,
    metrics: &Arc<Metrics>,
    endpoint_allow: &EndpointAllow,
) -> Result<(Arc<Fleet>, Option<Arc<Snapshots>>), ServeError> {
    let core = if config.cluster.ordered() {
        // Replicas deciding in log order run the routing clock on the
        // log's time (`router::ordered`).
        RouterCore::with_manual_clock(config.router_config(), metrics.clone())
    } else {
        RouterCore::new(config.router_config(), metrics.clone())
    };
    let core = Arc::new(core);
    let writer = Arc::new(EventWriter::new(core.clone()));
    let ingest = ingest::start_writer(writer).map_err(ServeError::Writer)?;
    // A restored endpoint has no registering peer: it is held to the
    // allow-list as a loopback peer's would be, so without a list only
    // this machine's engines are connected to again.
    let allow = endpoint_allow.clone();
    let loopback = Some(std::net::IpAddr::from([127, 0, 0, 1]));
    let restored_endpoints = Arc::new(move |endpoint: &str| allow.permits(endpoint, loopback));
    let fleet = Arc::new(Fleet::new(core, ingest, restored_endpoints));
    let snapshots = match &config.state_dir {
        Some(dir) => Some(Arc::new(
            Snapshots::open(dir, fleet.clone(), metrics.clone()).map_err(ServeError::StateDir)?,
        )),
        None => None,
    };
    Ok((fleet, snapshots))
}

/// Cluster mode's side of the fleet's seam, or `None` alone; refuses the
/// settings that cluster mode replaces.
fn replicated_changes(
    config: &ServeConfig,
    fleet: &Arc<Fleet>,
) -> Result<Option<Arc<ReplicatedChanges>>, ServeError> {
    if config.cluster.nats_url.is_none() {
        return Ok(None);
    }
    if config.state_dir.is_some() {
        return Err(ServeError::ClusterSettings(
            "--state-dir: replicas keep their snapshot in the cluster's object store",
        ));
    }
    if !config.engine.is_empty() {
        return Err(ServeError::ClusterSettings(
            "--engine: register engines over gRPC (RegisterWorker with events_endpoint), so every replica follows them",
        ));
    }
    if !config.gateway.pool.is_empty() {
        return Err(ServeError::ClusterSettings(
            "--pool: each replica would register the members itself; register engines over gRPC (RegisterWorker with events_endpoint)",
        ));
    }
    Ok(Some(Arc::new(ReplicatedChanges::new(fleet.clone()))))
}

/// Joins the cluster (snapshot, log catch-up, the replica's tasks on
/// `tasks` until its token), and keeps the Workers service's health in
/// step with the NATS connection.
async fn join_cluster(
    config: &ServeConfig,
    fleet: &Arc<Fleet>,
    changes: &ReplicatedChanges,
    (tasks, stop): &(TaskTracker, CancellationToken),
    health: &tonic_health::server::HealthReporter,
) -> Result<(), ServeError> {
    let url = config.cluster.nats_url.as_deref().unwrap_or_default();
    let settings = ClusterSettings {
        snapshot_interval: config.snapshot_interval,
        booking_ttl: config.booking_ttl,
        session_ttl: config.session_ttl,
    };
    let cluster = Cluster::start(
        &config.cluster,
        url,
        settings,
        fleet.clone(),
        tasks,
        stop.clone(),
    )
    .await?;
    let mut connection = cluster.connection();
    changes.attach(cluster);
    let (health, stop) = (health.clone(), stop.clone());
    tasks.spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                changed = connection.changed() => if changed.is_err() { return },
            }
            let status = if *connection.borrow() {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            health
                .set_service_status("kvroute.v1.Workers", status)
                .await;
        }
    });
    Ok(())
}

/// Restores the newest snapshot, if there is a state directory, then
/// registers and subscribes every `--engine`.
async fn restore_and_start(
    config: &ServeConfig,
    fleet: &Fleet,
    snapshots: Option<&Snapshots>,
) -> Result<(), ServeError> {
    if let Some(snapshots) = snapshots {
        load_snapshot(snapshots, config.require_snapshot).await?;
    }
    fleet
        .start_configured(&config.engine)
        .await
        .map_err(ServeError::Engine)
}

/// Loads the newest snapshot that loads; each newer one passed over is
/// logged in one line (moved aside when damaged), and with none that
/// loads kvroute starts cold, or, with `required`, does not start.
async fn load_snapshot(snapshots: &Snapshots, required: bool) -> Result<(), ServeError> {
    let outcome = snapshots.load(required).await?;
    for passed in &outcome.passed_over {
        let path = passed.path.display();
        match &passed.moved_to {
            Some(aside) => {
                tracing::error!(%path, why = %passed.why, aside = %aside.display(), "snapshot unusable: moved aside")
            }
            None => tracing::error!(%path, why = %passed.why, "snapshot unreadable: left in place"),
        }
    }
    match &outcome.loaded {
        Some(loaded) => {
            let r = &loaded.report;
            tracing::info!(
                path = %loaded.path.display(),
                workers = r.workers,
                targets = r.targets,
                entries = r.entries,
                seconds = loaded.seconds,
                older_than_newest = !outcome.passed_over.is_empty(),
                targets_refused = r.targets_refused,
                bookings_refused = r.bookings_refused,
                "snapshot loaded"
            );
            for (worker_id, why) in &r.workers_refused {
                tracing::warn!(worker_id, %why, "saved worker not restored");
            }
        }
        None if outcome.passed_over.is_empty() => {
            tracing::info!("no snapshot in the state directory: starting cold");
        }
        None => tracing::warn!("no snapshot in the state directory loads: starting cold"),
    }
    Ok(())
}

/// The gRPC server on `listener`, serving until `stop_accepting` is
/// cancelled: health, reflection and the three kvroute services, behind
/// the concurrency limit and the RPC metrics layer.
fn grpc_server<H: Health>(
    config: &ServeConfig,
    metrics: &Arc<Metrics>,
    (fleet, snapshots, replica): (
        &Arc<Fleet>,
        Option<Arc<Snapshots>>,
        Option<Arc<ReplicatedChanges>>,
    ),
    (gate, security): (&StartupGate, &Security),
    health: HealthServer<H>,
    listener: TcpListener,
    stop_accepting: CancellationToken,
) -> Result<ServerFuture, ServeError> {
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let max = usize::try_from(config.max_message_bytes).unwrap_or(usize::MAX);
    let router = pb::router_server::RouterServer::new(RouterService::new(
        fleet.router().clone(),
        config.request_timeout,
    ))
    .max_decoding_message_size(max)
    .max_encoding_message_size(max);
    // The one place that knows whether this server is alone or a replica.
    let (changes, snapshot_writer): (Arc<dyn FleetChanges>, Option<Arc<dyn WriteSnapshot>>) =
        match replica {
            Some(replicated) => (replicated.clone(), Some(replicated)),
            None => (
                Arc::new(LocalChanges(fleet.clone())),
                snapshots.map(|s| s as Arc<dyn WriteSnapshot>),
            ),
        };
    let workers = WorkersService::new(fleet.clone(), changes.clone())
        .with_endpoint_allow(security.endpoint_allow.clone());
    let admin = AdminService::new(fleet.clone(), changes, snapshot_writer);
    let workers = pb::workers_server::WorkersServer::new(workers)
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let admin = pb::admin_server::AdminServer::new(admin)
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);

    let known_paths = rpc_paths(&[
        pb::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
    ]);
    let guard = security.guard(metrics, known_paths.clone());
    let concurrency = usize::try_from(config.concurrency_limit).unwrap_or(usize::MAX);
    let (reflection_v1, reflection_v1alpha) = if security.reflection {
        (Some(reflection_v1), Some(reflection_v1alpha))
    } else {
        (None, None)
    };
    let router = Server::builder()
        .timeout(config.request_timeout)
        .max_frame_size(Some(MAX_FRAME_BYTES))
        .http2_max_header_list_size(HTTP2_HEADER_LIST_BYTES)
        .trace_fn(|request| tracing::info_span!("rpc", method = %request.uri().path()))
        .layer(GlobalConcurrencyLimitLayer::new(concurrency))
        .layer(RpcMetricsLayer::new(metrics.clone(), known_paths))
        .layer(ScreenLayer(MetadataBudget::new(
            metrics
                .input_rejected
                .with_label_values(&["metadata", "too_large"]),
        )))
        .layer(ScreenLayer(guard))
        .layer(ScreenLayer(gate.clone()))
        .add_service(health)
        .add_optional_service(reflection_v1)
        .add_optional_service(reflection_v1alpha)
        .add_service(router)
        .add_service(workers)
        .add_service(admin);
    // TCP_NODELAY: a request's HEADERS and DATA frames are separate
    // writes; with Nagle on, delayed ACKs stall them ~40 ms.
    let tcp = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(60)));
    let stop = stop_accepting.clone().cancelled_owned();
    Ok(match &security.grpc_tls {
        Some(tls) => {
            let failures = metrics
                .security
                .tls_handshake_failures
                .with_label_values(&["grpc"]);
            let incoming = tls.clone().incoming(tcp, failures, stop_accepting);
            Box::pin(router.serve_with_incoming_shutdown(incoming, stop))
        }
        None => Box::pin(router.serve_with_incoming_shutdown(tcp, stop)),
    })
}

/// The endpoint picker's server on `addr` (`--ext-proc-addr`): Envoy's
/// ext_proc service and health, behind the same layers as the gRPC port
/// (TLS, the auth guard, the startup gate, RPC metrics) but without a
/// call time limit: a stream lasts as long as its HTTP response.
async fn ext_proc_server<H: Health>(
    config: &ServeConfig,
    addr: SocketAddr,
    metrics: &Arc<Metrics>,
    core: &Arc<RouterCore>,
    (gate, security): (&StartupGate, &Security),
    health: HealthServer<H>,
    stop_accepting: CancellationToken,
) -> Result<ServerFuture, ServeError> {
    let gateway =
        crate::gateway::Gateway::new(core.clone(), &config.gateway, config.request_timeout)
            .map_err(ServeError::Gateway)?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr,
            setting: "ext_proc_addr",
            source,
        })?;
    let local = listener.local_addr().unwrap_or(addr);
    crate::security::protected_mode(
        local,
        security
            .grpc_tls
            .as_ref()
            .is_some_and(|t| t.requires_client_certificates()),
        security.policy.is_some(),
        config.security.allow_unauthenticated,
    )
    .map_err(|e| ServeError::Security(format!("--ext-proc-addr: {e}")))?;
    let mut known_paths = rpc_paths(&[tonic_health::pb::FILE_DESCRIPTOR_SET]);
    known_paths.insert(crate::gateway::PROCESS_PATH.to_owned());
    let guard = security.guard(metrics, known_paths.clone());
    let concurrency = usize::try_from(config.concurrency_limit).unwrap_or(usize::MAX);
    let max = usize::try_from(config.max_message_bytes).unwrap_or(usize::MAX);
    let router = Server::builder()
        .max_frame_size(Some(MAX_FRAME_BYTES))
        .http2_max_header_list_size(HTTP2_HEADER_LIST_BYTES)
        .layer(GlobalConcurrencyLimitLayer::new(concurrency))
        .layer(RpcMetricsLayer::new(metrics.clone(), known_paths))
        .layer(ScreenLayer(MetadataBudget::new(
            metrics
                .input_rejected
                .with_label_values(&["metadata", "too_large"]),
        )))
        .layer(ScreenLayer(guard))
        .layer(ScreenLayer(gate.clone()))
        .add_service(health)
        .add_service(
            gateway
                .service()
                .max_decoding_message_size(max)
                .max_encoding_message_size(max),
        );
    let tcp = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(60)));
    tracing::info!(ext_proc = %local, "endpoint picker listening");
    let stop = stop_accepting.clone().cancelled_owned();
    Ok(match &security.grpc_tls {
        Some(tls) => {
            let failures = metrics
                .security
                .tls_handshake_failures
                .with_label_values(&["ext_proc"]);
            let incoming = tls.clone().incoming(tcp, failures, stop_accepting);
            Box::pin(router.serve_with_incoming_shutdown(incoming, stop))
        }
        None => Box::pin(router.serve_with_incoming_shutdown(tcp, stop)),
    })
}

/// The largest HTTP/2 frame kvroute accepts (the protocol's default is
/// 16 KiB): a 12,000-token prompt (48 KB packed, about 33 KB as varints)
/// then comes as one DATA frame instead of three or four, each of which
/// costs a pass through h2's stream bookkeeping and a wake-up. What a
/// connection buffers stays bounded by its flow-control windows.
const MAX_FRAME_BYTES: u32 = 256 * 1024;

/// The gRPC server, plain or TLS.
type ServerFuture = Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>>;

/// The security settings, loaded: TLS of each port, the auth policy, the
/// engine endpoint allow-list, whether reflection is offered.
struct Security {
    grpc_tls: Option<Arc<ServerTls>>,
    metrics_tls: Option<Arc<ServerTls>>,
    policy: Option<Arc<Policy>>,
    endpoint_allow: EndpointAllow,
    reflection: bool,
    reload_interval: Duration,
}

impl Security {
    /// Loads the files and checks protected mode for the gRPC address.
    fn load(
        config: &ServeConfig,
        grpc_addr: Option<SocketAddr>,
        metrics: &Metrics,
    ) -> Result<Self, ServeError> {
        let options = &config.security;
        let reloads = metrics.security.tls_reloads.clone();
        let tls = |files: Option<TlsFiles>, alpn: &[&[u8]]| {
            files
                .map(|files| {
                    ServerTls::load(files, alpn, reloads.clone())
                        .map_err(|e| ServeError::Security(format!("--tls-cert/--tls-key: {e}")))
                })
                .transpose()
        };
        let grpc_tls = tls(options.grpc_tls(), &[b"h2"])?;
        let metrics_tls = tls(options.metrics_tls_files(), &[b"http/1.1"])?;
        let policy = options
            .auth_policy
            .as_deref()
            .map(|path| Policy::load(path).map(Arc::new))
            .transpose()
            .map_err(|e| ServeError::Security(format!("--auth-policy {e}")))?;
        let client_certificates = grpc_tls
            .as_ref()
            .is_some_and(|t| t.requires_client_certificates());
        let grpc_addr = grpc_addr.unwrap_or(config.grpc_addr);
        crate::security::protected_mode(
            grpc_addr,
            client_certificates,
            policy.is_some(),
            options.allow_unauthenticated,
        )
        .map_err(ServeError::Security)?;
        let endpoint_allow = options.endpoint_allow().map_err(ServeError::Security)?;
        let reflection = match options.reflection {
            crate::config::Reflection::On => true,
            crate::config::Reflection::Off => false,
            crate::config::Reflection::Auto => policy
                .as_ref()
                .is_none_or(|p| p.reflection.unwrap_or(false)),
        };
        if policy.is_some() && grpc_tls.is_none() && !grpc_addr.ip().is_loopback() {
            tracing::warn!("an auth policy without TLS: bearer tokens cross the network in clear");
        }
        Ok(Self {
            grpc_tls,
            metrics_tls,
            policy,
            endpoint_allow,
            reflection,
            reload_interval: options.tls_reload_interval,
        })
    }

    fn guard(&self, metrics: &Metrics, known_paths: std::collections::HashSet<String>) -> Guard {
        Guard::new(
            self.policy.clone(),
            self.grpc_tls
                .as_ref()
                .is_some_and(|t| t.requires_client_certificates()),
            metrics.security.auth_decisions.clone(),
            known_paths,
        )
    }
}

/// The tasks beside the gRPC server: the metrics endpoint and housekeeping.
struct Background {
    tasks: TaskTracker,
    stop: CancellationToken,
}

impl Background {
    fn start(
        (metrics_listener, web_listener): (TcpListener, Option<TcpListener>),
        metrics: &Arc<Metrics>,
        fleet: &Arc<Fleet>,
        snapshots: Option<Arc<Snapshots>>,
        config: &ServeConfig,
        security: &Security,
    ) -> Self {
        let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
        let web = config.web_ui.then(|| {
            crate::web::routes(crate::web::WebState::new(
                fleet.clone(),
                metrics.clone(),
                crate::web::guard_for(security.policy.as_ref(), metrics),
                config
                    .cluster
                    .nats_url
                    .as_ref()
                    .map(|_| config.cluster.replica()),
            ))
        });
        // The view on its own listener, or beside `/metrics`.
        let (beside_metrics, alone) = match web_listener {
            Some(listener) => (None, web.map(|routes| (listener, routes))),
            None => (web, None),
        };
        if let Some((listener, routes)) = alone {
            tasks.spawn(serve_http(listener, None, routes, "web", stop.clone()));
        }
        tasks.spawn(serve_metrics(
            metrics_listener,
            security.metrics_tls.clone(),
            metrics.clone(),
            fleet.clone(),
            snapshots.clone(),
            beside_metrics,
            stop.clone(),
        ));
        for tls in [&security.grpc_tls, &security.metrics_tls]
            .into_iter()
            .flatten()
        {
            tasks.spawn(tls.clone().watch(security.reload_interval, stop.clone()));
        }
        tasks.spawn(housekeeping(fleet.clone(), config.lease_ttl, stop.clone()));
        if !config.gateway.pool.is_empty() {
            let pools = crate::pools::Pools::new(
                fleet.clone(),
                security.endpoint_allow.clone(),
                config.gateway.pool.clone(),
            );
            tasks.spawn(pools.run(config.gateway.pool_refresh_interval, stop.clone()));
        }
        if let Some(snapshots) = snapshots {
            let (interval, stop) = (config.snapshot_interval, stop.clone());
            tasks.spawn(async move { snapshots.every(interval, stop).await });
        }
        tasks.close();
        Self { tasks, stop }
    }

    /// Stops the tasks and waits for them.
    async fn stop(&self) {
        self.stop.cancel();
        self.tasks.wait().await;
    }
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

/// An address for the log: the address, or `unknown` if the listener
/// could not say.
fn shown(addr: Option<SocketAddr>) -> String {
    addr.map_or_else(|| "unknown".to_string(), |a| a.to_string())
}

/// Periodic upkeep through the fleet: configured engines' leases, lapsed
/// leases (with their blocks, subscriptions, bookings and sessions), expired
/// bookings and sessions, index and subscription gauges.
async fn housekeeping(fleet: Arc<Fleet>, lease_ttl: Duration, stop: CancellationToken) {
    let period = (lease_ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = ticker.tick() => {}
        }
        fleet.tick().await;
    }
}

async fn serve_metrics(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    metrics: Arc<Metrics>,
    fleet: Arc<Fleet>,
    snapshots: Option<Arc<Snapshots>>,
    web: Option<axum::Router>,
    stop: CancellationToken,
) {
    let handshake_failures = metrics.security.tls_handshake_failures.clone();
    let tls = tls.map(|tls| (tls, handshake_failures.with_label_values(&["metrics"])));
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            fleet.refresh_subscription_ages();
            fleet.router().refresh_booked_gauges();
            if let Some(snapshots) = &snapshots {
                snapshots.refresh_age();
            }
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
    let app = match web {
        Some(web) => app.merge(web),
        None => app,
    };
    serve_http(listener, tls, app, "metrics", stop).await;
}

/// Serves `app` on `listener` (TLS with `tls`) until `stop`.
async fn serve_http(
    listener: TcpListener,
    tls: Option<(Arc<ServerTls>, prometheus::IntCounter)>,
    app: axum::Router,
    name: &'static str,
    stop: CancellationToken,
) {
    // Both: at most so many connections, idle ones closed (`http_listener`).
    let served = match tls {
        Some((tls, failures)) => {
            let listener = TlsListener::new(listener, tls, failures, stop.clone());
            axum::serve(Bounded::new(listener), app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        }
        None => {
            axum::serve(Bounded::new(listener), app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        }
    };
    if let Err(error) = served {
        tracing::error!(%error, server = name, "HTTP server failed");
    }
}

/// The metrics port's listener with `--metrics-tls`: TLS connections,
/// handshaken as the gRPC port's are.
struct TlsListener {
    connections: Pin<
        Box<
            dyn futures::Stream<
                    Item = std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
                > + Send,
        >,
    >,
    local: Option<SocketAddr>,
}

impl TlsListener {
    fn new(
        listener: TcpListener,
        tls: Arc<ServerTls>,
        failures: prometheus::IntCounter,
        stop: CancellationToken,
    ) -> Self {
        let local = listener.local_addr().ok();
        let tcp = TcpIncoming::from(listener).with_nodelay(Some(true));
        Self {
            connections: Box::pin(tls.incoming(tcp, failures, stop)),
            local,
        }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = Option<SocketAddr>;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        use futures::StreamExt;
        loop {
            match self.connections.next().await {
                Some(Ok(stream)) => {
                    let peer = stream.get_ref().0.peer_addr().ok();
                    return (stream, peer);
                }
                Some(Err(_)) => {}
                // Accepting stopped: shutdown is under way.
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
