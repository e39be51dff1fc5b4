//! Certificates for `bench select --tls`: a throwaway CA, a server
//! certificate for 127.0.0.1 and one client whose SAN the policy gives the
//! frontend and worker roles, so the benchmark pays for TLS, client
//! certificate verification and the role check on every call.

use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};

use super::BenchError;
use kvroute::{config::ServeConfig, security::client::ClientCredentials};

/// The files of one run, removed when it ends.
pub struct Fixture {
    dir: PathBuf,
    client: ClientCredentials,
}

const CLIENT_SAN: &str = "spiffe://bench/frontend";

impl Fixture {
    /// Makes the files and points `config` at them.
    pub(crate) fn make(config: &mut ServeConfig) -> Result<Self, BenchError> {
        let failed = |e: &dyn std::fmt::Display| BenchError::Setup(format!("bench TLS files: {e}"));
        let dir = std::env::temp_dir().join(format!("kvroute-bench-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| failed(&e))?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(|e| failed(&e))?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "kvroute bench CA");
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().map_err(|e| failed(&e))?)
            .map_err(|e| failed(&e))?;
        let leaf = |san: SanType| -> Result<(String, String), BenchError> {
            let mut params =
                CertificateParams::new(Vec::<String>::new()).map_err(|e| failed(&e))?;
            params.subject_alt_names.push(san);
            let key = KeyPair::generate().map_err(|e| failed(&e))?;
            let cert = params.signed_by(&key, &ca).map_err(|e| failed(&e))?;
            Ok((cert.pem(), key.serialize_pem()))
        };
        let server = leaf(SanType::IpAddress([127, 0, 0, 1].into()))?;
        let uri = CLIENT_SAN.to_string().try_into().map_err(|e| failed(&e))?;
        let client = leaf(SanType::URI(uri))?;
        let policy = format!(
            "[[identity]]\nname = \"bench\"\nroles = [\"frontend\", \"worker\"]\nsan = [\"{CLIENT_SAN}\"]\nworker_ids = [\"*\"]\n"
        );
        let files = [
            ("ca.pem", ca.pem()),
            ("server.crt", server.0),
            ("server.key", server.1),
            ("client.crt", client.0),
            ("client.key", client.1),
            ("policy.toml", policy),
        ];
        for (name, text) in files {
            std::fs::write(dir.join(name), text).map_err(|e| failed(&e))?;
        }
        let security = &mut config.security;
        security.tls_cert = Some(dir.join("server.crt"));
        security.tls_key = Some(dir.join("server.key"));
        security.tls_client_ca = Some(dir.join("ca.pem"));
        security.auth_policy = Some(dir.join("policy.toml"));
        let client = ClientCredentials {
            ca: Some(dir.join("ca.pem")),
            cert: Some(dir.join("client.crt")),
            key: Some(dir.join("client.key")),
            token: None,
        };
        Ok(Self { dir, client })
    }

    /// The client's certificate and the CA it trusts.
    pub(crate) fn credentials(&self) -> &ClientCredentials {
        &self.client
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
