//! The connection to the running kvroute: the address as operators type it,
//! the timeouts, and the credentials (TLS and the bearer token). Every
//! sub-command talks through what this gives it.

use std::time::Duration;

use tonic::{service::interceptor::InterceptedService, transport::Channel};

use kvroute::{
    pb::admin_client::AdminClient,
    security::client::{Bearer, ClientCredentials},
};

use super::error::{CtlError, chain};

/// How long a call may take before `ctl` gives up.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The Admin service's client, the bearer token on every call.
pub(super) type Admin = AdminClient<InterceptedService<Channel, Bearer>>;

/// `host:port` becomes `http://host:port`; a URI with a scheme stays.
pub fn normalize_addr(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

/// Connects to `addr` with the operator's credentials: the channel, and the
/// bearer token to put on its calls.
pub(super) async fn connect(
    addr: &str,
    credentials: &ClientCredentials,
) -> Result<(Channel, Bearer), CtlError> {
    let channel = open(addr, credentials).await?;
    let bearer = credentials.bearer().map_err(CtlError::Credentials)?;
    Ok((channel, bearer))
}

/// Opens the channel to `addr`, over TLS when the credentials ask for it.
async fn open(addr: &str, credentials: &ClientCredentials) -> Result<Channel, CtlError> {
    let uri = normalize_addr(addr);
    let endpoint = credentials
        .endpoint(&uri)
        .map_err(|message| CtlError::BadAddr {
            addr: addr.to_string(),
            message,
        })?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(CALL_TIMEOUT);
    endpoint.connect().await.map_err(|e| CtlError::Connect {
        addr: uri,
        message: chain(&e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_without_a_scheme_get_http() {
        assert_eq!(normalize_addr("127.0.0.1:5"), "http://127.0.0.1:5");
        assert_eq!(normalize_addr("https://h:1"), "https://h:1");
    }
}
