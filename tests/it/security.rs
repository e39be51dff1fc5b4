//! TLS, identities and roles over the network (#19): a real kvroute with
//! mTLS and an auth policy, certificates made here with rcgen (nothing
//! secret is committed), kvroute's own client (`security::client`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use common::{batch, cleared, registration, select_hashes, stored};
use kvroute::{
    app,
    config::ServeConfig,
    pb::{
        self, admin_client::AdminClient, router_client::RouterClient, workers_client::WorkersClient,
    },
    security::client::{Bearer, ClientCredentials},
};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};
use tokio::{net::TcpListener, sync::oneshot};
use tonic::{Code, service::interceptor::InterceptedService, transport::Channel};

type Client = InterceptedService<Channel, Bearer>;

/// A scratch directory of this test process.
fn scratch(name: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvroute-security-{}-{name}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A certificate authority of the test.
struct Authority {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Authority {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Self { issuer }
    }

    /// A leaf certificate and key (PEM) with these SANs: `spiffe://` ones as
    /// URIs, IP addresses as IPs, the rest as DNS names.
    fn leaf(&self, sans: &[&str], expired: bool) -> (String, String) {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        for san in sans {
            let san = if san.contains("://") {
                SanType::URI(san.to_string().try_into().unwrap())
            } else if let Ok(ip) = san.parse() {
                SanType::IpAddress(ip)
            } else {
                SanType::DnsName(san.to_string().try_into().unwrap())
            };
            params.subject_alt_names.push(san);
        }
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2020, 1, 2);
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn write_ca(&self, path: &Path) {
        std::fs::write(path, self.issuer.pem()).unwrap();
    }
}

/// A client's files in `dir`: its CA, and its certificate if it has one.
fn credentials(dir: &Path, name: &str, pair: Option<(String, String)>) -> ClientCredentials {
    let mut credentials = ClientCredentials {
        ca: Some(dir.join("ca.pem")),
        ..Default::default()
    };
    if let Some((cert, key)) = pair {
        let (c, k) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&c, cert).unwrap();
        std::fs::write(&k, key).unwrap();
        credentials.cert = Some(c);
        credentials.key = Some(k);
    }
    credentials
}

const POLICY: &str = r#"
[[identity]]
name = "frontend-a"
roles = ["frontend"]
san = ["spiffe://test/frontend-a"]

[[identity]]
name = "frontend-b"
roles = ["frontend"]
san = ["spiffe://test/frontend-b"]

[[identity]]
name = "worker-a"
roles = ["worker"]
san = ["worker-a.test"]
worker_ids = ["100-199"]

[[identity]]
name = "worker-b"
roles = ["worker"]
san = ["spiffe://test/worker-b"]
worker_ids = ["200-299"]

[[identity]]
name = "reader"
roles = ["operator-read"]
san = ["spiffe://test/reader"]

[[identity]]
name = "writer"
roles = ["operator-write"]
san = ["spiffe://test/writer"]
"#;

/// kvroute with mTLS and the policy above; the CA in `dir/ca.pem`.
struct SecureServer {
    dir: PathBuf,
    ca: Authority,
    addr: SocketAddr,
    metrics_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<Result<(), app::ServeError>>,
}

impl SecureServer {
    async fn start(adjust: impl FnOnce(&mut ServeConfig)) -> Self {
        let dir = scratch("server");
        let ca = Authority::new("kvroute test CA");
        ca.write_ca(&dir.join("ca.pem"));
        let (cert, key) = ca.leaf(&["127.0.0.1", "localhost"], false);
        std::fs::write(dir.join("server.crt"), cert).unwrap();
        std::fs::write(dir.join("server.key"), key).unwrap();
        std::fs::write(dir.join("policy.toml"), POLICY).unwrap();
        let mut config = ServeConfig::for_tests();
        config.security.tls_cert = Some(dir.join("server.crt"));
        config.security.tls_key = Some(dir.join("server.key"));
        config.security.tls_client_ca = Some(dir.join("ca.pem"));
        config.security.auth_policy = Some(dir.join("policy.toml"));
        config.security.tls_reload_interval = Duration::from_millis(100);
        adjust(&mut config);
        let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (addr, metrics_addr) = (grpc.local_addr().unwrap(), metrics.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let handle = tokio::spawn(app::run(config, grpc, metrics, async move {
            let _ = stopped.await;
        }));
        let server = Self {
            dir,
            ca,
            addr,
            metrics_addr,
            stop: Some(stop),
            handle,
        };
        let probe = server.identity("spiffe://test/reader").await;
        for _ in 0..100 {
            if health(&probe).await == Ok(()) {
                return server;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("kvroute with TLS did not become healthy");
    }

    /// A client holding a CA-signed certificate for `san`.
    async fn identity(&self, san: &str) -> Client {
        let pair = self.ca.leaf(&[san], false);
        let name = san.replace(['/', ':'], "_");
        self.connect(credentials(&self.dir, &name, Some(pair)))
            .await
    }

    async fn connect(&self, credentials: ClientCredentials) -> Client {
        let channel = credentials
            .endpoint(&format!("https://{}", self.addr))
            .unwrap()
            .connect_lazy();
        InterceptedService::new(channel, credentials.bearer().unwrap())
    }

    async fn metric(&self, line_start: &str) -> f64 {
        let mut stream = tokio::net::TcpStream::connect(self.metrics_addr)
            .await
            .unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).await.unwrap();
        text.lines()
            .filter(|l| l.starts_with(line_start))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), &mut self.handle).await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn health(client: &Client) -> Result<(), Code> {
    tonic_health::pb::health_client::HealthClient::new(client.clone())
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .map(|_| ())
        .map_err(|s| s.code())
}

fn code<T>(result: Result<tonic::Response<T>, tonic::Status>) -> Code {
    match result {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    }
}

/// One call of `method` (as the role table names it), harmless when
/// allowed, for worker 150 and request `probe`; its status code.
async fn try_method(client: &Client, method: &str) -> Code {
    let (mut router, mut workers, mut admin) = (
        RouterClient::new(client.clone()),
        WorkersClient::new(client.clone()),
        AdminClient::new(client.clone()),
    );
    match method {
        "SelectWorker" => {
            let mut request = select_hashes("probe", "m", &[1, 2]);
            request.mode = pb::SelectionMode::QueryOnly as i32;
            code(router.select_worker(request).await)
        }
        "MarkPrefillComplete" => code(
            router
                .mark_prefill_complete(pb::MarkPrefillCompleteRequest {
                    cached_tokens: None,
                    request_id: "probe".into(),
                })
                .await,
        ),
        "ReleaseRequest" => code(
            router
                .release_request(pb::ReleaseRequestRequest {
                    cached_tokens: None,
                    request_id: "probe".into(),
                })
                .await,
        ),
        "RegisterWorker" => code(workers.register_worker(registration(150, "m")).await),
        "Heartbeat" => code(
            workers
                .heartbeat(pb::HeartbeatRequest {
                    worker_id: 150,
                    ..Default::default()
                })
                .await,
        ),
        "PublishEvents" => {
            let events = vec![batch(150, 0, vec![stored(0, None, &[(1, 1)])])];
            match workers.publish_events(tokio_stream::iter(events)).await {
                Ok(reply) => match reply.into_inner().message().await {
                    Ok(_) => Code::Ok,
                    Err(status) => status.code(),
                },
                Err(status) => status.code(),
            }
        }
        "DeregisterWorker" => code(
            workers
                .deregister_worker(pb::DeregisterWorkerRequest { worker_id: 150 })
                .await,
        ),
        "ListWorkers" => code(admin.list_workers(pb::ListWorkersRequest::default()).await),
        "GetWorker" => code(
            admin
                .get_worker(pb::GetWorkerRequest { worker_id: 150 })
                .await,
        ),
        "GetIndexStats" => code(
            admin
                .get_index_stats(pb::GetIndexStatsRequest::default())
                .await,
        ),
        "ExplainSelection" => code(admin.explain_selection(select_hashes("x", "m", &[1])).await),
        "CordonWorker" => code(
            admin
                .cordon_worker(pb::CordonWorkerRequest { worker_id: 150 })
                .await,
        ),
        "UncordonWorker" => code(
            admin
                .uncordon_worker(pb::UncordonWorkerRequest { worker_id: 150 })
                .await,
        ),
        "Snapshot" => code(admin.snapshot(pb::SnapshotRequest::default()).await),
        other => panic!("no such method {other}"),
    }
}

const METHODS: [&str; 14] = [
    "SelectWorker",
    "MarkPrefillComplete",
    "ReleaseRequest",
    "RegisterWorker",
    "Heartbeat",
    "PublishEvents",
    "ListWorkers",
    "GetWorker",
    "GetIndexStats",
    "ExplainSelection",
    "CordonWorker",
    "UncordonWorker",
    "Snapshot",
    // last: it removes worker 150 that the calls before use
    "DeregisterWorker",
];

#[tokio::test]
async fn each_role_reaches_exactly_its_methods() {
    let server = SecureServer::start(|_| {}).await;
    let roles: [(&str, &[&str]); 4] = [
        (
            "spiffe://test/frontend-a",
            &["SelectWorker", "MarkPrefillComplete", "ReleaseRequest"],
        ),
        (
            "worker-a.test",
            &[
                "RegisterWorker",
                "Heartbeat",
                "PublishEvents",
                "DeregisterWorker",
            ],
        ),
        (
            "spiffe://test/reader",
            &[
                "ListWorkers",
                "GetWorker",
                "GetIndexStats",
                "ExplainSelection",
            ],
        ),
        (
            "spiffe://test/writer",
            &[
                "ReleaseRequest",
                "CordonWorker",
                "UncordonWorker",
                "Snapshot",
            ],
        ),
    ];
    let worker = server.identity("worker-a.test").await;
    for (san, allowed) in roles {
        let client = server.identity(san).await;
        // worker 150 exists for the calls that need it
        assert_eq!(try_method(&worker, "RegisterWorker").await, Code::Ok);
        for method in METHODS {
            let got = try_method(&client, method).await;
            if allowed.contains(&method) {
                assert!(
                    got != Code::PermissionDenied && got != Code::Unauthenticated,
                    "{san} should reach {method}, got {got:?}"
                );
            } else {
                assert_eq!(got, Code::PermissionDenied, "{san} must not reach {method}");
            }
        }
    }
    // Health is open to every certificate the CA signed, even one the
    // policy does not know; anything else needs an identity.
    let stranger = server.identity("spiffe://test/stranger").await;
    assert_eq!(health(&stranger).await, Ok(()));
    assert_eq!(
        try_method(&stranger, "ListWorkers").await,
        Code::Unauthenticated
    );
    assert!(
        server
            .metric("kvroute_auth_decisions_total{method=\"/kvroute.v1.Admin/Snapshot\",outcome=\"denied\",role=\"operator-write\"}")
            .await
            >= 3.0
    );
    server.stop().await;
}

/// The state a hostile client must not change.
async fn fleet_state(reader: &Client) -> (pb::WorkerInfo, pb::IndexStats) {
    let mut admin = AdminClient::new(reader.clone());
    let mut worker = admin
        .get_worker(pb::GetWorkerRequest { worker_id: 150 })
        .await
        .unwrap()
        .into_inner();
    worker.lease_remaining_ms = 0;
    let stats = admin
        .get_index_stats(pb::GetIndexStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    (worker, stats)
}

#[tokio::test]
async fn hostile_clients_are_refused_and_change_nothing() {
    let server = SecureServer::start(|_| {}).await;
    let (owner, victim_frontend) = (
        server.identity("worker-a.test").await,
        server.identity("spiffe://test/frontend-a").await,
    );
    let reader = server.identity("spiffe://test/reader").await;
    // The victims: worker 150 of team a with cached blocks, and a booking.
    let mut workers = WorkersClient::new(owner.clone());
    workers
        .register_worker(registration(150, "team-a"))
        .await
        .unwrap();
    let events = vec![batch(
        150,
        0,
        vec![stored(0, None, &[(11, 1), (12, 2), (13, 3)])],
    )];
    let mut replies = workers
        .publish_events(tokio_stream::iter(events))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(replies.message().await.unwrap().unwrap().rejected, 0);
    RouterClient::new(victim_frontend.clone())
        .select_worker(select_hashes("victim-request", "team-a", &[1, 2, 3]))
        .await
        .unwrap();
    let before = fleet_state(&reader).await;
    assert_eq!(before.0.ranks[0].cached_blocks, 3);
    assert_eq!(
        before.0.ranks[0]
            .booked_load
            .as_ref()
            .unwrap()
            .active_requests,
        1
    );

    // The attackers: another team's worker, another frontend, a stranger
    // with a certificate the policy does not know, a made-up token.
    let other_worker = server.identity("spiffe://test/worker-b").await;
    let other_frontend = server.identity("spiffe://test/frontend-b").await;
    let stranger = server.identity("spiffe://test/stranger").await;
    let token = server
        .connect(ClientCredentials {
            token: Some("guessed".into()),
            ..credentials(
                &server.dir,
                "token-client",
                Some(server.ca.leaf(&["x.test"], false)),
            )
        })
        .await;
    let mut w = WorkersClient::new(other_worker.clone());
    let mut reregister = registration(150, "team-b");
    reregister.block_size = 32;
    assert_eq!(
        code(w.register_worker(reregister).await),
        Code::PermissionDenied
    );
    assert_eq!(
        code(
            w.deregister_worker(pb::DeregisterWorkerRequest { worker_id: 150 })
                .await
        ),
        Code::PermissionDenied
    );
    let fake_load = pb::HeartbeatRequest {
        worker_id: 150,
        load: vec![pb::RankLoad {
            dp_rank: 0,
            kv_blocks_used: 0,
            ..Default::default()
        }],
    };
    assert_eq!(code(w.heartbeat(fake_load).await), Code::PermissionDenied);
    for forged in [
        batch(150, 0, vec![cleared(1)]),
        batch(150, 0, vec![stored(1, None, &[(91, 7), (92, 8)])]),
    ] {
        let mut stream = w
            .publish_events(tokio_stream::iter(vec![forged]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            stream.message().await.unwrap_err().code(),
            Code::PermissionDenied
        );
    }
    assert_eq!(
        try_method(&other_worker, "CordonWorker").await,
        Code::PermissionDenied
    );
    let mut f = RouterClient::new(other_frontend.clone());
    let release = pb::ReleaseRequestRequest {
        cached_tokens: None,
        request_id: "victim-request".into(),
    };
    assert_eq!(
        code(f.release_request(release.clone()).await),
        Code::PermissionDenied
    );
    assert_eq!(
        code(
            f.mark_prefill_complete(pb::MarkPrefillCompleteRequest {
                cached_tokens: None,
                request_id: "victim-request".into()
            })
            .await
        ),
        Code::PermissionDenied
    );
    for intruder in [&stranger, &token] {
        for method in [
            "RegisterWorker",
            "CordonWorker",
            "ReleaseRequest",
            "PublishEvents",
        ] {
            assert_eq!(
                try_method(intruder, method).await,
                Code::Unauthenticated,
                "{method}"
            );
        }
    }
    assert_eq!(
        fleet_state(&reader).await,
        before,
        "a refused call changed state"
    );

    // The owner may release its own booking; an operator-write identity
    // may release anyone's.
    let mut own = RouterClient::new(victim_frontend.clone());
    assert!(
        own.release_request(release.clone())
            .await
            .unwrap()
            .into_inner()
            .changed
    );
    own.select_worker(select_hashes("second", "team-a", &[1]))
        .await
        .unwrap();
    let writer = server.identity("spiffe://test/writer").await;
    let released = RouterClient::new(writer)
        .release_request(pb::ReleaseRequestRequest {
            cached_tokens: None,
            request_id: "second".into(),
        })
        .await
        .unwrap();
    assert!(released.into_inner().changed);
    server.stop().await;
}

#[tokio::test]
async fn missing_untrusted_and_expired_certificates_fail_the_handshake() {
    let server = SecureServer::start(|_| {}).await;
    let before = server
        .metric("kvroute_tls_handshake_failures_total{port=\"grpc\"}")
        .await;
    let other_ca = Authority::new("someone else");
    let refused = [
        ("no certificate", credentials(&server.dir, "none", None)),
        (
            "untrusted",
            credentials(
                &server.dir,
                "untrusted",
                Some(other_ca.leaf(&["spiffe://test/reader"], false)),
            ),
        ),
        (
            "expired",
            credentials(
                &server.dir,
                "expired",
                Some(server.ca.leaf(&["spiffe://test/reader"], true)),
            ),
        ),
    ];
    for (what, credentials) in refused {
        let client = server.connect(credentials).await;
        assert!(
            health(&client).await.is_err(),
            "{what} certificate was accepted"
        );
        assert!(
            try_method(&client, "ListWorkers").await != Code::Ok,
            "{what} certificate reached ListWorkers"
        );
    }
    let after = server
        .metric("kvroute_tls_handshake_failures_total{port=\"grpc\"}")
        .await;
    assert!(
        after - before >= 3.0,
        "handshake failures {before} -> {after}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_rotated_server_certificate_is_served_without_a_restart() {
    let server = SecureServer::start(|_| {}).await;
    let old_client = server.identity("spiffe://test/reader").await;
    assert_eq!(health(&old_client).await, Ok(()));

    // cert-manager rotates to a certificate of a new CA (the client CA is
    // unchanged, so the same client certificates still work).
    let new_ca = Authority::new("rotated CA");
    let (cert, key) = new_ca.leaf(&["127.0.0.1"], false);
    let client_ca = std::fs::read_to_string(server.dir.join("ca.pem")).unwrap();
    let trusting_new = scratch("rotated");
    new_ca.write_ca(&trusting_new.join("ca.pem"));
    let pair = server.ca.leaf(&["spiffe://test/reader"], false);
    let new_client = || async {
        server
            .connect(credentials(&trusting_new, "reader", Some(pair.clone())))
            .await
    };
    assert!(
        health(&new_client().await).await.is_err(),
        "the new CA was trusted too early"
    );

    // A half-written set is refused and the old certificate kept.
    std::fs::write(
        server.dir.join("server.crt"),
        "-----BEGIN CERTIFICATE-----\ngarbage",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        server
            .metric("kvroute_tls_reloads_total{outcome=\"failed\"}")
            .await
            >= 1.0
    );
    let fresh_old = server.identity("spiffe://test/reader").await;
    assert_eq!(
        health(&fresh_old).await,
        Ok(()),
        "a bad file replaced the certificate"
    );

    std::fs::write(server.dir.join("server.key"), key).unwrap();
    std::fs::write(server.dir.join("server.crt"), cert).unwrap();
    assert_eq!(
        client_ca,
        std::fs::read_to_string(server.dir.join("ca.pem")).unwrap()
    );
    let mut picked_up = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if health(&new_client().await).await == Ok(()) {
            picked_up = true;
            break;
        }
    }
    assert!(picked_up, "the rotated certificate was not served");
    assert!(
        server
            .metric("kvroute_tls_reloads_total{outcome=\"applied\"}")
            .await
            >= 1.0
    );
    // The connection opened before the rotation is still served; a new
    // one that trusts only the old CA is not.
    assert_eq!(health(&old_client).await, Ok(()));
    let old_only = server.identity("spiffe://test/reader").await;
    assert!(health(&old_only).await.is_err());
    let _ = std::fs::remove_dir_all(&trusting_new);
    server.stop().await;
}

#[tokio::test]
async fn an_engine_endpoint_outside_the_allow_list_gets_no_connection() {
    // Loopback is not on the list, so the listening socket below is refused.
    let server = SecureServer::start(|c| {
        c.security.engine_endpoint_allow = vec!["10.0.0.0/8".into()];
    })
    .await;
    let worker = server.identity("worker-a.test").await;
    let listening = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let open_port = listening.local_addr().unwrap().port();
    let closed_port = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut messages = Vec::new();
    for port in [open_port, closed_port] {
        let mut request = registration(150, "m");
        request.events_endpoint = format!("tcp://127.0.0.1:{port}");
        request.events_dialect = "vllm".into();
        let status = WorkersClient::new(worker.clone())
            .register_worker(request)
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied);
        messages.push(status.message().to_owned());
    }
    assert_eq!(
        messages[0], messages[1],
        "the answer tells whether something listens"
    );
    assert!(
        messages[0].starts_with("worker 150: events_endpoint: host is not in"),
        "{messages:?}"
    );
    // An allowed events endpoint with a refused replay endpoint: the
    // replay endpoint is the one named.
    let mut request = registration(150, "m");
    request.events_endpoint = "tcp://10.0.0.5:5557".into();
    request.events_dialect = "vllm".into();
    request.replay_endpoint = format!("tcp://127.0.0.1:{open_port}");
    let status = WorkersClient::new(worker.clone())
        .register_worker(request)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status
            .message()
            .starts_with("worker 150: replay_endpoint: host is not in"),
        "{status:?}"
    );
    // The HTTP endpoint the endpoint picker sends users' requests to is
    // held to the same list; a form that is not host:port stays
    // informational and is never routed to.
    let mut request = registration(150, "m");
    request.endpoint = format!("http://127.0.0.1:{open_port}");
    let status = WorkersClient::new(worker.clone())
        .register_worker(request)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status
            .message()
            .starts_with("worker 150: endpoint: host is not in"),
        "{status:?}"
    );
    let connected = tokio::time::timeout(Duration::from_millis(700), listening.accept()).await;
    assert!(
        connected.is_err(),
        "kvroute connected to a refused endpoint"
    );
    assert_eq!(
        server
            .metric("kvroute_engine_endpoints_refused_total")
            .await,
        4.0
    );
    // No worker was registered by the refused calls.
    let reader = server.identity("spiffe://test/reader").await;
    let listed = AdminClient::new(reader)
        .list_workers(pb::ListWorkersRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.workers.is_empty());
    server.stop().await;
}

#[test]
fn listening_beyond_loopback_without_credentials_refuses_to_start() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "serve",
            "--grpc-addr",
            "0.0.0.0:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .env_remove("KVROUTE_ALLOW_UNAUTHENTICATED")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "an invalid setting");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("refusing to listen on 0.0.0.0:")
            && lines[0].contains("--allow-unauthenticated"),
        "{stderr}"
    );
}

/// One identity's open bookings are bounded on their own (#38): a frontend
/// that floods RESERVE calls without releasing is refused, counted, while
/// another frontend still books.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_identitys_open_bookings_are_bounded_alone() {
    let prompt: Vec<u64> = (1..=256).collect();
    let one = kvroute_core::admission::bookings::booking_cost("a1", prompt.len());
    let server = SecureServer::start(|c| {
        c.limits.max_booking_memory_per_identity = 2 * one + one / 2;
    })
    .await;
    let worker = server.identity("worker-a.test").await;
    WorkersClient::new(worker)
        .register_worker(registration(100, "m"))
        .await
        .unwrap();
    let mut a = RouterClient::new(server.identity("spiffe://test/frontend-a").await);
    let mut b = RouterClient::new(server.identity("spiffe://test/frontend-b").await);
    for id in ["a1", "a2"] {
        a.select_worker(select_hashes(id, "m", &prompt))
            .await
            .unwrap();
    }
    let status = a
        .select_worker(select_hashes("a3", "m", &prompt))
        .await
        .expect_err("past frontend-a's bound");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("identity frontend-a"),
        "{status:?}"
    );
    for id in ["b1", "b2"] {
        b.select_worker(select_hashes(id, "m", &prompt))
            .await
            .unwrap();
    }
    a.release_request(pb::ReleaseRequestRequest {
        request_id: "a1".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    a.select_worker(select_hashes("a3", "m", &prompt))
        .await
        .unwrap();
    assert_eq!(
        server
            .metric("kvroute_bookings_refused_total{bound=\"identity\"}")
            .await,
        1.0
    );
    server.stop().await;
}
