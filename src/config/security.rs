//! `kvroute serve`'s security flags (`crate::security` enforces them).

use std::{path::PathBuf, time::Duration};

use clap::{Args, ValueEnum};

use crate::security::{EndpointAllow, tls::TlsFiles};

/// Whether the reflection service is offered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Reflection {
    /// On without an auth policy, off with one (unless the policy says).
    Auto,
    On,
    Off,
}

/// TLS, identities and roles, and what workers may make kvroute connect to.
#[derive(Clone, Debug, Args)]
pub struct SecurityOptions {
    /// Server certificate chain (PEM): serve gRPC over TLS. Re-read every
    /// `tls_reload_interval`; a changed file is picked up without a restart.
    #[arg(long, env = "KVROUTE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// The server certificate's private key (PEM).
    #[arg(long, env = "KVROUTE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// CA bundle (PEM) that client certificates must chain to: with it,
    /// every client needs a valid certificate (mTLS).
    #[arg(long, env = "KVROUTE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// How often the TLS files are checked for changes, e.g. `10s`.
    #[arg(long, env = "KVROUTE_TLS_RELOAD_INTERVAL", default_value = "10s",
          value_parser = super::parse_positive_duration)]
    pub tls_reload_interval: Duration,

    /// Serve /metrics over TLS too, with the same certificate (no client
    /// certificate asked). Off: the metrics port is plain HTTP.
    #[arg(long, env = "KVROUTE_METRICS_TLS", num_args = 0..=1,
          default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set, requires = "tls_cert")]
    pub metrics_tls: bool,

    /// Auth policy (TOML): identities (client-certificate SANs, bearer
    /// token digests) and their roles. See docs/auth-policy.example.toml.
    #[arg(long, env = "KVROUTE_AUTH_POLICY")]
    pub auth_policy: Option<PathBuf>,

    /// The gRPC reflection service: auto is on without an auth policy and
    /// off with one.
    #[arg(long, env = "KVROUTE_REFLECTION", value_enum, default_value = "auto")]
    pub reflection: Reflection,

    /// Listen on a non-loopback address without client certificates or an
    /// auth policy: anyone who reaches the port may do anything.
    #[arg(long, env = "KVROUTE_ALLOW_UNAUTHENTICATED", num_args = 0..=1,
          default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub allow_unauthenticated: bool,

    /// Hosts a RegisterWorker `events_endpoint` may point at: CIDRs, IP
    /// addresses, host names and `*.domain` (comma separated, repeatable).
    /// Not given: only the registering peer's own address (and loopback
    /// for a loopback peer).
    #[arg(long, env = "KVROUTE_ENGINE_ENDPOINT_ALLOW", value_name = "LIST")]
    pub engine_endpoint_allow: Vec<String>,
}

impl Default for SecurityOptions {
    fn default() -> Self {
        Self {
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            tls_reload_interval: Duration::from_secs(10),
            metrics_tls: false,
            auth_policy: None,
            reflection: Reflection::Auto,
            allow_unauthenticated: false,
            engine_endpoint_allow: Vec::new(),
        }
    }
}

impl SecurityOptions {
    /// The gRPC port's TLS files, if TLS is on.
    pub(crate) fn grpc_tls(&self) -> Option<TlsFiles> {
        Some(TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            client_ca: self.tls_client_ca.clone(),
        })
    }

    /// The metrics port's, with `--metrics-tls`.
    pub(crate) fn metrics_tls_files(&self) -> Option<TlsFiles> {
        let files = self.grpc_tls()?;
        self.metrics_tls.then_some(TlsFiles {
            client_ca: None,
            ..files
        })
    }

    pub(crate) fn endpoint_allow(&self) -> Result<EndpointAllow, String> {
        EndpointAllow::parse(&self.engine_endpoint_allow)
    }
}
