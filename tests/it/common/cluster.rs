//! A real nats-server with JetStream and kvroute replicas as processes,
//! for the cluster-mode tests. A test that needs NATS fails (it never
//! skips) when `nats-server` cannot be started: `.ci/run` installs it.
#![allow(dead_code)]

use std::{
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use kvroute::pb::{self, admin_client::AdminClient};
use tonic::transport::Channel;

use super::{connect, wait_serving};

pub fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// `nats-server -js` on a free port with its own store directory; it can
/// be stopped and started again on the same port and store.
pub struct Nats {
    child: Option<Child>,
    pub addr: SocketAddr,
    store: PathBuf,
}

impl Nats {
    pub fn start(name: &str) -> Self {
        let store = temp_dir(&format!("nats-{name}"));
        // A free port can be handed out twice before anyone binds it: try
        // another when the server could not listen on this one.
        for _ in 0..5 {
            let mut nats = Self {
                child: None,
                addr: free_addr(),
                store: store.clone(),
            };
            if nats.try_resume() {
                return nats;
            }
        }
        panic!("nats-server did not start (is the Debian package nats-server installed?)");
    }

    fn try_resume(&mut self) -> bool {
        let mut child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &self.addr.port().to_string()])
            .args(["-js", "-sd", &self.store.display().to_string()])
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(self.store.with_extension("log"))
                    .map_or(Stdio::null(), Stdio::from),
            )
            .spawn()
            .expect("nats-server must be installed (Debian package nats-server)");
        for _ in 0..500 {
            if let Ok(Some(_)) = child.try_wait() {
                return false; // exited: the port was taken
            }
            if TcpStream::connect(self.addr).is_ok() {
                std::thread::sleep(Duration::from_millis(50));
                if let Ok(None) = child.try_wait() {
                    self.child = Some(child);
                    return true;
                }
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        false
    }

    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// Starts the server again (same port, same store).
    pub fn resume(&mut self) {
        assert!(
            self.try_resume(),
            "nats-server did not start again on {}",
            self.addr
        );
    }

    /// Stops the server (SIGKILL: as a crash or a partition looks).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

/// One `kvroute serve --nats-url` process.
pub struct Replica {
    child: Child,
    pub name: String,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    pub channel: Channel,
    args: Vec<String>,
}

impl Replica {
    /// Starts replica `name` of `cluster` and waits until it serves.
    pub async fn start(nats: &Nats, cluster: &str, name: &str, extra: &[&str]) -> Self {
        let mut args: Vec<String> = [
            "serve",
            "--nats-url",
            &nats.url(),
            "--cluster-name",
            cluster,
            "--replica-id",
            name,
            "--lease-ttl",
            "120s",
            "--seed",
            "7",
            "--log-max-bytes",
            "67108864",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::spawn(name, free_addr(), args).await
    }

    async fn spawn(name: &str, grpc: SocketAddr, args: Vec<String>) -> Self {
        let metrics = free_addr();
        let log =
            std::env::temp_dir().join(format!("kvroute-replica-{name}-{}.log", std::process::id()));
        let child = Command::new(server_binary())
            .args(&args)
            .args(["--grpc-addr", &grpc.to_string()])
            .args(["--metrics-addr", &metrics.to_string()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).map_or(Stdio::null(), Stdio::from))
            .spawn()
            .expect("spawn kvroute");
        // Killed on drop, also when it never serves and the test panics.
        let mut replica = Self {
            child,
            name: name.into(),
            grpc,
            metrics,
            channel: tonic::transport::Endpoint::from_static("http://[::1]:1").connect_lazy(),
            args,
        };
        replica.channel = connect(grpc).await;
        wait_serving(&replica.channel).await;
        replica
    }

    /// SIGKILL, then the same command again on the same address.
    pub async fn kill_9_and_restart(mut self) -> Self {
        self.child.kill().expect("kill -9");
        self.child.wait().expect("reap");
        let (name, grpc, args) = (self.name.clone(), self.grpc, std::mem::take(&mut self.args));
        drop(self);
        Self::spawn(&name, grpc, args).await
    }

    pub fn kill_9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel.clone())
    }

    /// `(entries, digest)` of its index.
    pub async fn digest(&self) -> (u64, u64) {
        let stats = self
            .admin()
            .get_index_stats(pb::GetIndexStatsRequest::default())
            .await
            .expect("stats")
            .into_inner();
        (stats.entries, stats.digest)
    }

    /// The value of one series of its Prometheus endpoint (0 when absent).
    pub fn metric(&self, series: &str) -> f64 {
        use std::io::{Read, Write};
        let Ok(mut stream) = TcpStream::connect(self.metrics) else {
            return 0.0;
        };
        let _ = stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: kvroute\r\n\r\n");
        let mut text = String::new();
        let _ = stream.read_to_string(&mut text);
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    }

    pub async fn worker(&self, worker_id: u64) -> Option<pb::WorkerInfo> {
        self.admin()
            .get_worker(pb::GetWorkerRequest { worker_id })
            .await
            .ok()
            .map(|r| r.into_inner())
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until every replica reports the same log position and digest;
/// returns the digest. Panics after `timeout`.
pub async fn converged(replicas: &[&Replica], timeout: Duration) -> (u64, u64) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let mut digests = Vec::new();
        for r in replicas {
            digests.push((r.digest().await, r.metric("kvroute_cluster_log_position")));
        }
        if digests.windows(2).all(|w| w[0] == w[1]) {
            return digests[0].0;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replicas did not converge: {digests:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The server binary cargo built for kvroute's own tests (the tools'
/// tests share these helpers but start no replica processes).
fn server_binary() -> &'static str {
    const SERVER_BINARY: Option<&str> = option_env!("CARGO_BIN_EXE_kvroute");
    match SERVER_BINARY {
        Some(path) => path,
        None => {
            panic!("replica processes run from kvroute's own tests, where cargo builds the binary")
        }
    }
}
