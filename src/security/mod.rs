//! Who may do what (#19). The pieces:
//!
//! * `tls`: TLS on the gRPC and metrics ports, certificates reloaded in place;
//! * `policy`: the auth policy file, identities and their roles;
//! * `certificate`: a client certificate's SANs, which name its identity;
//! * `endpoint_allow`: which hosts a worker may make kvroute connect to;
//! * `screen`: a layer that answers a call itself when a check refuses it;
//! * here: [`Guard`], the check that authenticates every call and
//!   checks its method's role, and the per-call checks the handlers make
//!   (a worker acts only for its own ids, a booking is released only by
//!   its owner).
//!
//! With neither a policy nor client certificates required, nothing is
//! enforced (the loopback default); `--allow-unauthenticated` is then needed
//! to listen on any other address (protected mode, see [`protected_mode`]).

pub mod certificate;
pub mod client;
pub mod endpoint_allow;
pub mod policy;
pub mod screen;
pub mod tls;

use std::{net::SocketAddr, sync::Arc};

use prometheus::IntCounterVec;
use tonic::{
    Status,
    transport::server::{TcpConnectInfo, TlsConnectInfo},
};

pub use endpoint_allow::EndpointAllow;
pub use policy::{Identity, Policy, Role};

/// The pseudo method the operators' web view (`web`) is checked as.
pub const WEB_VIEW_PATH: &str = "/kvroute.web/View";

/// What a method needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Health and reflection: anyone.
    Open,
    /// Any of these roles.
    AnyOf(&'static [Role]),
}

impl Access {
    /// The label of `auth_decisions_total`'s `role`.
    fn label(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::AnyOf([only]) => only.label(),
            Self::AnyOf(_) => "frontend|operator-write",
        }
    }
}

/// The roles each method needs. Every Admin method not listed as a read is
/// a change, so a method added later is guarded as operator-write.
pub(crate) fn access(path: &str) -> Access {
    const ADMIN_READS: [&str; 4] = [
        "ListWorkers",
        "GetWorker",
        "GetIndexStats",
        "ExplainSelection",
    ];
    if path.starts_with("/grpc.health.v1.Health/") || path.starts_with("/grpc.reflection.") {
        return Access::Open;
    }
    if path == "/kvroute.v1.Router/ReleaseRequest" {
        return Access::AnyOf(&[Role::Frontend, Role::OperatorWrite]);
    }
    // The endpoint picker's stream (Envoy's ext_proc) routes requests as a
    // frontend does.
    if path.starts_with("/kvroute.v1.Router/")
        || path.starts_with("/envoy.service.ext_proc.v3.ExternalProcessor/")
    {
        return Access::AnyOf(&[Role::Frontend]);
    }
    // The operators' web view (`web`) reads what the Admin reads do.
    if path == WEB_VIEW_PATH {
        return Access::AnyOf(&[Role::OperatorRead]);
    }
    if path.starts_with("/kvroute.v1.Workers/") {
        return Access::AnyOf(&[Role::Worker]);
    }
    if let Some(method) = path.strip_prefix("/kvroute.v1.Admin/")
        && ADMIN_READS.contains(&method)
    {
        return Access::AnyOf(&[Role::OperatorRead]);
    }
    Access::AnyOf(&[Role::OperatorWrite])
}

/// The identity a call was authenticated as, in its request extensions.
#[derive(Clone, Debug)]
pub struct Caller(pub Arc<Identity>);

/// The caller of a request, if authentication is on.
pub(crate) fn caller(extensions: &http::Extensions) -> Option<&Arc<Identity>> {
    extensions.get::<Caller>().map(|c| &c.0)
}

/// Refuses a Workers call for `worker_id` by a `worker` identity whose list
/// does not hold it. Without authentication (no caller) every id is allowed.
pub(crate) fn check_worker_id(caller: Option<&Identity>, worker_id: u64) -> Result<(), Status> {
    let Some(identity) = caller else {
        return Ok(());
    };
    if identity
        .worker_ids
        .as_ref()
        .is_some_and(|ids| ids.contains(worker_id))
    {
        return Ok(());
    }
    Err(Status::permission_denied(format!(
        "identity {:?} may not act for worker_id {worker_id}: not in its worker_ids",
        identity.name
    )))
}

/// Authenticates calls and checks their roles: the layer in front of every
/// service.
#[derive(Clone)]
pub struct Guard {
    inner: Arc<GuardState>,
}

struct GuardState {
    policy: Option<Arc<Policy>>,
    /// The TLS port requires client certificates.
    client_certificates: bool,
    /// `auth_decisions_total{method, role, outcome}`
    decisions: IntCounterVec,
    known_paths: Arc<std::collections::HashSet<String>>,
    /// What each client certificate seen lately identifies (reading a
    /// certificate costs more than the rest of the check), by its DER bytes.
    certificates: parking_lot::Mutex<std::collections::HashMap<Vec<u8>, Identified>>,
}

/// What a certificate identifies, or why it does not.
type Identified = Result<Arc<Identity>, Status>;

/// Certificates whose identity is remembered; past this the memory is
/// emptied, so clients cannot grow it.
const MAX_REMEMBERED_CERTIFICATES: usize = 4096;

impl Guard {
    pub(crate) fn new(
        policy: Option<Arc<Policy>>,
        client_certificates: bool,
        decisions: IntCounterVec,
        known_paths: std::collections::HashSet<String>,
    ) -> Self {
        Self {
            inner: Arc::new(GuardState {
                policy,
                client_certificates,
                decisions,
                known_paths: Arc::new(known_paths),
                certificates: parking_lot::Mutex::default(),
            }),
        }
    }

    /// Whether calls are authenticated at all.
    pub(crate) fn enforcing(&self) -> bool {
        self.inner.policy.is_some() || self.inner.client_certificates
    }

    /// The caller's identity, or the error to answer; `Ok(None)` when
    /// nothing is enforced or the method is open.
    pub(crate) fn authorize(
        &self,
        path: &str,
        headers: &http::HeaderMap,
        extensions: &http::Extensions,
    ) -> Result<Option<Arc<Identity>>, Status> {
        let access = access(path);
        if !self.enforcing() || access == Access::Open {
            return Ok(None);
        }
        let method = if self.inner.known_paths.contains(path) {
            path
        } else {
            "unknown"
        };
        let outcome = self
            .authenticate(headers, extensions)
            .and_then(|identity| permitted(access, path, identity));
        let label = match &outcome {
            Ok(_) => "allowed",
            Err(status) if status.code() == tonic::Code::Unauthenticated => "unauthenticated",
            Err(_) => "denied",
        };
        self.inner
            .decisions
            .with_label_values(&[method, access.label(), label])
            .inc();
        outcome.map(Some)
    }

    fn authenticate(
        &self,
        headers: &http::HeaderMap,
        extensions: &http::Extensions,
    ) -> Result<Arc<Identity>, Status> {
        let policy = self.inner.policy.as_ref();
        if let Some(value) = headers.get(http::header::AUTHORIZATION) {
            let token = value.to_str().ok().and_then(bearer_token).ok_or_else(|| {
                Status::unauthenticated("authorization metadata must be `Bearer <token>`")
            })?;
            return policy.and_then(|p| p.by_token(token)).ok_or_else(|| {
                Status::unauthenticated("the bearer token matches no identity of the auth policy")
            });
        }
        let chain = extensions
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(TlsConnectInfo::peer_certs);
        let Some(certificate) = chain.as_deref().and_then(|c| c.first()) else {
            return Err(Status::unauthenticated(
                "no credentials: present a client certificate or `authorization: Bearer <token>` metadata",
            ));
        };
        let known = self
            .inner
            .certificates
            .lock()
            .get(certificate.as_ref())
            .cloned();
        if let Some(known) = known {
            return known;
        }
        let decided = self.identify(certificate::subject_alt_names(certificate));
        let mut certificates = self.inner.certificates.lock();
        if certificates.len() >= MAX_REMEMBERED_CERTIFICATES {
            certificates.clear();
        }
        certificates.insert(certificate.to_vec(), decided.clone());
        decided
    }

    /// The identity of a verified client certificate with these names.
    fn identify(&self, sans: Vec<String>) -> Result<Arc<Identity>, Status> {
        match self.inner.policy.as_deref() {
            Some(policy) => policy.by_sans(sans.iter().map(String::as_str)).ok_or_else(|| {
                Status::unauthenticated(format!(
                    "the client certificate's names {sans:?} match no identity of the auth policy"
                ))
            }),
            None => {
                let name = sans.first().map_or("client-certificate", String::as_str);
                Ok(Arc::new(Identity::trusted_client(name)))
            }
        }
    }
}

fn permitted(access: Access, path: &str, identity: Arc<Identity>) -> Result<Arc<Identity>, Status> {
    let Access::AnyOf(roles) = access else {
        return Ok(identity);
    };
    if roles.iter().any(|&role| identity.has(role)) {
        return Ok(identity);
    }
    let needed: Vec<&str> = roles.iter().map(|r| r.label()).collect();
    Err(Status::permission_denied(format!(
        "identity {:?} lacks the role {} that {path} needs",
        identity.name,
        needed.join(" or ")
    )))
}

/// Protected mode: refuses to listen beyond loopback with nothing that
/// authenticates callers, unless told to on purpose.
pub(crate) fn protected_mode(
    grpc_addr: SocketAddr,
    client_certificates: bool,
    policy: bool,
    allow_unauthenticated: bool,
) -> Result<(), String> {
    if grpc_addr.ip().is_loopback() || client_certificates || policy || allow_unauthenticated {
        return Ok(());
    }
    Err(format!(
        "refusing to listen on {grpc_addr} without authentication: give --tls-client-ca or --auth-policy, or --allow-unauthenticated to accept anyone who can reach the port"
    ))
}

impl screen::Screen for Guard {
    fn screen(
        &self,
        path: &str,
        headers: &http::HeaderMap,
        extensions: &mut http::Extensions,
    ) -> Result<(), Status> {
        if let Some(identity) = self.authorize(path, headers, extensions)? {
            extensions.insert(Caller(identity));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_method_needs_its_role() {
        let role = |path: &str| match access(path) {
            Access::Open => vec![],
            Access::AnyOf(roles) => roles.to_vec(),
        };
        assert_eq!(role("/grpc.health.v1.Health/Check"), vec![]);
        assert_eq!(role("/kvroute.v1.Router/SelectWorker"), [Role::Frontend]);
        assert_eq!(
            role("/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
            [Role::Frontend]
        );
        assert_eq!(
            role("/kvroute.v1.Router/MarkPrefillComplete"),
            [Role::Frontend]
        );
        assert_eq!(
            role("/kvroute.v1.Router/ReleaseRequest"),
            [Role::Frontend, Role::OperatorWrite]
        );
        for m in [
            "RegisterWorker",
            "Heartbeat",
            "DeregisterWorker",
            "PublishEvents",
        ] {
            assert_eq!(role(&format!("/kvroute.v1.Workers/{m}")), [Role::Worker]);
        }
        for m in [
            "ListWorkers",
            "GetWorker",
            "GetIndexStats",
            "ExplainSelection",
        ] {
            assert_eq!(
                role(&format!("/kvroute.v1.Admin/{m}")),
                [Role::OperatorRead]
            );
        }
        for m in ["CordonWorker", "UncordonWorker", "Snapshot", "SomethingNew"] {
            assert_eq!(
                role(&format!("/kvroute.v1.Admin/{m}")),
                [Role::OperatorWrite]
            );
        }
        assert_eq!(role("/other.Service/Method"), [Role::OperatorWrite]);
    }

    #[test]
    fn protected_mode_refuses_open_non_loopback() {
        let any: SocketAddr = "0.0.0.0:50051".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:50051".parse().unwrap();
        let error = protected_mode(any, false, false, false).unwrap_err();
        assert!(error.contains("--allow-unauthenticated"), "{error}");
        assert!(protected_mode(local, false, false, false).is_ok());
        assert!(protected_mode(any, true, false, false).is_ok());
        assert!(protected_mode(any, false, true, false).is_ok());
        assert!(protected_mode(any, false, false, true).is_ok());
    }
}

/// The token of an `authorization` value `Bearer <token>`; the scheme is
/// compared without regard to case, as RFC 7235 has it.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

#[cfg(test)]
mod bearer_tests {
    use super::bearer_token;

    /// #38: the scheme is case-insensitive (RFC 7235); `BEARER` was refused.
    #[test]
    fn the_bearer_scheme_is_read_without_regard_to_case() {
        for value in ["Bearer t0k", "bearer t0k", "BEARER t0k", "bEaReR   t0k "] {
            assert_eq!(bearer_token(value), Some("t0k"), "{value}");
        }
        for value in ["Basic t0k", "Bearert0k", "Bearer ", "Bearer", "", " t0k"] {
            assert_eq!(bearer_token(value), None, "{value}");
        }
    }
}
