//! TLS on kvroute's ports with certificates that can change under it.
//!
//! tonic's own TLS setting fixes the certificate at start; cert-manager
//! rotates certificates in place, so kvroute accepts TLS itself: the
//! listener stays up, each new connection is handshaken with the current
//! configuration, and a watcher re-reads the PEM files every interval and
//! swaps in a new configuration when their contents change (connections
//! already open keep theirs). A set that does not load (half-written,
//! mismatched key) is logged and counted, and the old one stays.

use std::{
    hash::{Hash, Hasher},
    io,
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use futures::Stream;
use parking_lot::{Mutex, RwLock};
use prometheus::IntCounterVec;
use rustls::{RootCertStore, ServerConfig, server::WebPkiClientVerifier};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use tokio::{net::TcpStream, sync::Semaphore};
use tokio_rustls::{TlsAcceptor, server::TlsStream};
use tokio_stream::{StreamExt, wrappers::ReceiverStream};
use tokio_util::sync::CancellationToken;

/// The PEM files of one TLS port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Client certificates must be signed by one of these (mTLS).
    pub client_ca: Option<PathBuf>,
}

/// A port's TLS configuration, swapped in place when its files change.
pub struct ServerTls {
    files: TlsFiles,
    alpn: Vec<Vec<u8>>,
    current: RwLock<Arc<ServerConfig>>,
    /// Fingerprint of the file contents last tried (loaded or not), so a
    /// bad set is reported once.
    tried: Mutex<u64>,
    reloads: IntCounterVec,
}

/// Handshakes in progress at once; more connections wait to be accepted.
const MAX_HANDSHAKES: usize = 256;
/// A client that has not finished its handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl ServerTls {
    /// Loads the files; `alpn` is what the port speaks (`h2` for gRPC).
    /// `reloads` is `tls_reloads_total{outcome}`.
    pub(crate) fn load(
        files: TlsFiles,
        alpn: &[&[u8]],
        reloads: IntCounterVec,
    ) -> Result<Arc<Self>, String> {
        let alpn: Vec<Vec<u8>> = alpn.iter().map(|p| p.to_vec()).collect();
        let (contents, fingerprint) = read(&files).map_err(|e| e.to_string())?;
        let config = build(&contents, &alpn)?;
        Ok(Arc::new(Self {
            files,
            alpn,
            current: RwLock::new(Arc::new(config)),
            tried: Mutex::new(fingerprint),
            reloads,
        }))
    }

    /// Whether clients must present a certificate.
    pub(crate) fn requires_client_certificates(&self) -> bool {
        self.files.client_ca.is_some()
    }

    fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.read().clone())
    }

    /// Re-reads the files and swaps in a new configuration if they changed;
    /// `None` when nothing changed since the last try.
    pub(crate) fn reload(&self) -> Option<Result<(), String>> {
        let (contents, fingerprint) = match read(&self.files) {
            Ok(read) => read,
            Err(error) => return self.tried(0, Err(error.to_string())),
        };
        if *self.tried.lock() == fingerprint {
            return None;
        }
        match build(&contents, &self.alpn) {
            Ok(config) => {
                *self.current.write() = Arc::new(config);
                self.tried(fingerprint, Ok(()))
            }
            Err(error) => self.tried(fingerprint, Err(error)),
        }
    }

    fn tried(&self, fingerprint: u64, outcome: Result<(), String>) -> Option<Result<(), String>> {
        let mut tried = self.tried.lock();
        if *tried == fingerprint {
            return None;
        }
        *tried = fingerprint;
        let label = if outcome.is_ok() { "applied" } else { "failed" };
        self.reloads.with_label_values(&[label]).inc();
        Some(outcome)
    }

    /// Reloads every `interval` until `stop`, logging each change once.
    pub(crate) async fn watch(self: Arc<Self>, interval: Duration, stop: CancellationToken) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let tls = self.clone();
            let Ok(outcome) = tokio::task::spawn_blocking(move || tls.reload()).await else {
                continue;
            };
            let cert = self.files.cert.display();
            match outcome {
                None => {}
                Some(Ok(())) => tracing::info!(%cert, "TLS certificate files changed: reloaded"),
                Some(Err(error)) => {
                    tracing::warn!(%cert, %error, "TLS certificate files changed but do not load: keeping the previous ones");
                }
            }
        }
    }

    /// TLS connections over the TCP connections of `tcp`, handshaken
    /// concurrently; failed handshakes are counted in `failures`
    /// (`tls_handshake_failures_total{port}` for this port) and dropped.
    pub(crate) fn incoming<S>(
        self: Arc<Self>,
        tcp: S,
        failures: prometheus::IntCounter,
        stop: CancellationToken,
    ) -> impl Stream<Item = Result<TlsStream<TcpStream>, io::Error>> + Send + 'static
    where
        S: Stream<Item = Result<TcpStream, io::Error>> + Send + 'static,
    {
        let (sender, receiver) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
            let mut tcp = std::pin::pin!(tcp);
            loop {
                let stream = tokio::select! {
                    () = stop.cancelled() => return,
                    next = tcp.next() => match next {
                        Some(Ok(stream)) => stream,
                        Some(Err(error)) => {
                            tracing::debug!(%error, "accept failed");
                            continue;
                        }
                        None => return,
                    },
                };
                let Ok(permit) = handshakes.clone().acquire_owned().await else {
                    return;
                };
                let (acceptor, sender, failures) =
                    (self.acceptor(), sender.clone(), failures.clone());
                tokio::spawn(async move {
                    let peer = stream.peer_addr().ok();
                    let shaken =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                    drop(permit);
                    match shaken {
                        Ok(Ok(tls)) => {
                            let _ = sender.send(Ok(tls)).await;
                        }
                        Ok(Err(error)) => {
                            failures.inc();
                            tracing::debug!(?peer, %error, "TLS handshake failed");
                        }
                        Err(_) => {
                            failures.inc();
                            tracing::debug!(?peer, "TLS handshake timed out");
                        }
                    }
                });
            }
        });
        ReceiverStream::new(receiver)
    }
}

/// The files' contents (cert, key, client CA) and a fingerprint of them.
fn read(files: &TlsFiles) -> io::Result<([Vec<u8>; 3], u64)> {
    let named = |path: &PathBuf| {
        std::fs::read(path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
    };
    let cert = named(&files.cert)?;
    let key = named(&files.key)?;
    let ca = match &files.client_ca {
        Some(path) => named(path)?,
        None => Vec::new(),
    };
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (&cert, &key, &ca).hash(&mut hasher);
    // 0 stands for "could not read"; a real fingerprint never is.
    Ok(([cert, key, ca], hasher.finish().max(1)))
}

fn build([cert, key, ca]: &[Vec<u8>; 3], alpn: &[Vec<u8>]) -> Result<ServerConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("certificate: {e}"))?;
    if chain.is_empty() {
        return Err("certificate: no CERTIFICATE block in the file".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("key: {e}"))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = if ca.is_empty() {
        builder.with_no_client_auth()
    } else {
        let mut roots = RootCertStore::empty();
        for certificate in CertificateDer::pem_slice_iter(ca) {
            let certificate = certificate.map_err(|e| format!("client CA: {e}"))?;
            roots
                .add(certificate)
                .map_err(|e| format!("client CA: {e}"))?;
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| format!("client CA: {e}"))?;
        builder.with_client_cert_verifier(verifier)
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| format!("certificate and key: {e}"))?;
    config.alpn_protocols = alpn.to_vec();
    Ok(config)
}
