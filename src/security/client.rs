//! The client side of TLS and bearer tokens, for kvroute's own clients
//! (`kvroute ctl`, the benchmarks, the tests): a channel that trusts a CA,
//! presents a client certificate, and an interceptor that sends a token.

use std::path::PathBuf;

use clap::Args;
use tonic::{
    metadata::{Ascii, MetadataValue},
    service::Interceptor,
    transport::{Certificate, ClientTlsConfig, Endpoint, Identity},
};

/// How a client proves who it is and whom it trusts.
#[derive(Clone, Debug, Default, Args)]
pub struct ClientCredentials {
    /// CA bundle (PEM) that the server's certificate must chain to; given,
    /// the connection uses TLS (an `http://` address becomes `https://`).
    #[arg(long, global = true, env = "KVROUTE_CTL_CA")]
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM), for a server that requires one (mTLS).
    #[arg(long, global = true, env = "KVROUTE_CTL_CERT", requires = "key")]
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, global = true, env = "KVROUTE_CTL_KEY", requires = "cert")]
    pub key: Option<PathBuf>,
    /// Bearer token sent as `authorization: Bearer <token>`.
    #[arg(long, global = true, env = "KVROUTE_CTL_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

impl ClientCredentials {
    /// `endpoint` with TLS set up, if a CA is given. `addr` is the address
    /// as given (`http://` is turned into `https://` when TLS is on).
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, String> {
        let tls = self.ca.is_some() || self.cert.is_some();
        let scheme = if tls { "https" } else { "http" };
        let uri = match addr.split_once("://") {
            Some(("http", rest)) => format!("{scheme}://{rest}"),
            Some(_) => addr.to_owned(),
            None => format!("{scheme}://{addr}"),
        };
        let endpoint = Endpoint::from_shared(uri).map_err(|e| e.to_string())?;
        if !tls {
            return Ok(endpoint);
        }
        let mut config = ClientTlsConfig::new();
        if let Some(ca) = &self.ca {
            config = config.ca_certificate(Certificate::from_pem(read(ca)?));
        }
        if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
            config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        endpoint.tls_config(config).map_err(|e| e.to_string())
    }

    /// The interceptor that sends the token, if there is one.
    pub fn bearer(&self) -> Result<Bearer, String> {
        let value = match &self.token {
            Some(token) => Some(
                format!("Bearer {token}")
                    .parse::<MetadataValue<Ascii>>()
                    .map_err(|_| "--token must be printable ASCII".to_string())?,
            ),
            None => None,
        };
        Ok(Bearer(value))
    }
}

fn read(path: &PathBuf) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Adds `authorization: Bearer <token>` to every call.
#[derive(Clone, Debug)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}
