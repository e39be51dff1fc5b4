//! Where an engine publishes its KV events: the value types a registration
//! or a `kvroute serve --engine` setting carries (endpoint, dialect, replay
//! endpoint), and their validation. They live with the engine events, below
//! the tokio subscription code that follows them, so the configuration and
//! the gRPC conversion can name them without depending on that code.

use super::{Dialect, EngineEventsConfig};
use kvroute_core::types::WorkerId;

/// Where and how a worker's engine publishes its KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineSource {
    pub dialect: Dialect,
    /// PUB endpoint as configured in the engine (rank 0's; rank `r` listens
    /// on the port plus `r`).
    pub endpoint: String,
    /// The engine's replay (ROUTER) endpoint, offset the same way.
    pub replay_endpoint: Option<String>,
}

impl EngineSource {
    /// Reads the three `RegisterWorkerRequest` fields: `None` when no events
    /// endpoint is given, an error message naming the field otherwise.
    pub(crate) fn from_fields(
        endpoint: &str,
        dialect: &str,
        replay: &str,
    ) -> Result<Option<Self>, String> {
        if endpoint.is_empty() {
            if !dialect.is_empty() || !replay.is_empty() {
                return Err(
                    "events_dialect and replay_endpoint need an events_endpoint".to_string()
                );
            }
            return Ok(None);
        }
        check_endpoint("events_endpoint", endpoint)?;
        let dialect = parse_dialect(dialect)?;
        let replay_endpoint = if replay.is_empty() {
            None
        } else {
            check_endpoint("replay_endpoint", replay)?;
            Some(replay.to_string())
        };
        Ok(Some(Self {
            dialect,
            endpoint: endpoint.to_string(),
            replay_endpoint,
        }))
    }

    /// The subscriber's configuration for a worker with these ranks; an
    /// error when a rank's endpoint cannot be derived (e.g. `ipc://` with
    /// several ranks) or the layout is unusable.
    pub(crate) fn events_config(
        &self,
        worker_id: WorkerId,
        model: &str,
        block_size: u32,
        dp_start_rank: u32,
        dp_size: u32,
    ) -> Result<EngineEventsConfig, String> {
        let mut cfg = EngineEventsConfig::new(
            worker_id,
            model,
            block_size,
            self.endpoint.clone(),
            self.dialect,
        );
        cfg.replay_endpoint = self.replay_endpoint.clone();
        let end = dp_start_rank
            .checked_add(dp_size.max(1))
            .ok_or_else(|| "dp_start_rank + dp_size overflows".to_string())?;
        cfg.dp_ranks = (dp_start_rank..end).collect();
        cfg.validate().map_err(|e| e.to_string())?;
        Ok(cfg)
    }
}

/// `vllm` or `sglang` (any case).
pub fn parse_dialect(text: &str) -> Result<Dialect, String> {
    match text.to_ascii_lowercase().as_str() {
        "vllm" => Ok(Dialect::Vllm),
        "sglang" => Ok(Dialect::Sglang),
        "" => Err("events_dialect is required with an events_endpoint: vllm or sglang".into()),
        other => Err(format!(
            "events_dialect {other:?} is not supported: use vllm or sglang"
        )),
    }
}

pub fn dialect_name(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Vllm => "vllm",
        Dialect::Sglang => "sglang",
    }
}

/// A ZeroMQ endpoint kvroute can connect to: `tcp://HOST:PORT` or
/// `ipc://PATH`.
pub fn check_endpoint(field: &str, endpoint: &str) -> Result<(), String> {
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        if tcp_host_port(rest).is_some() {
            return Ok(());
        }
        return Err(format!(
            "{field} {endpoint:?}: expected tcp://HOST:PORT with a connectable host (a DNS name, an IPv4 address or a bracketed IPv6 address) and a port 1-65535"
        ));
    }
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        if !path.is_empty() && path.len() <= MAX_IPC_PATH && !path.chars().any(char::is_control) {
            return Ok(());
        }
        return Err(format!(
            "{field} {endpoint:?}: ipc:// needs a socket path of at most {MAX_IPC_PATH} bytes without control characters"
        ));
    }
    Err(format!(
        "{field} {endpoint:?}: only tcp://HOST:PORT and ipc://PATH endpoints are supported"
    ))
}

/// Longest `ipc://` path: a Unix socket address holds 108 bytes with the
/// terminating NUL.
const MAX_IPC_PATH: usize = 107;

/// `HOST:PORT` of a `tcp://` endpoint, if the host can be connected to and
/// the port is 1-65535.
fn tcp_host_port(rest: &str) -> Option<(&str, u16)> {
    let (host, port) = rest.rsplit_once(':')?;
    let port: u16 = port.parse().ok().filter(|&p| p > 0)?;
    let connectable = match host.strip_prefix('[') {
        Some(inner) => inner
            .strip_suffix(']')
            .is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok()),
        None => host.parse::<std::net::Ipv4Addr>().is_ok() || is_dns_name(host),
    };
    connectable.then_some((host, port))
}

/// A host name: dot-separated labels of 1-63 letters, digits and inner
/// hyphens, 253 bytes at most.
fn is_dns_name(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

/// One `kvroute serve --engine` setting: a worker kvroute registers itself
/// and whose engine-native KV events it subscribes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineSpec {
    pub worker_id: WorkerId,
    pub model: String,
    pub block_size: u32,
    pub dp_start_rank: u32,
    pub dp_size: u32,
    pub source: EngineSource,
}

#[cfg(test)]
mod tests {
    use super::check_endpoint;

    #[test]
    fn endpoints_are_checked_whole() {
        for good in [
            "tcp://10.0.0.5:5557",
            "tcp://engine-0.engines.svc.cluster.local:5557",
            "tcp://localhost:1",
            "tcp://[::1]:5557",
            "tcp://[fe80::1]:65535",
            "ipc:///tmp/kvroute/engine.sock",
        ] {
            assert_eq!(check_endpoint("events_endpoint", good), Ok(()), "{good}");
        }
        for bad in [
            "tcp://[::1",
            "tcp://[::1]",
            "tcp://[not-an-ip]:5557",
            "tcp://::1:5557",
            "tcp://*:5557",
            "tcp://:5557",
            "tcp://host:0",
            "tcp://host:65536",
            "tcp://ho st:5557",
            "tcp://host\n:5557",
            "tcp://-host:5557",
            "tcp://host..example:5557",
            "ipc://",
            "ipc://a\nb",
            "udp://host:5557",
        ] {
            assert!(
                check_endpoint("events_endpoint", bad).is_err(),
                "{bad:?} accepted"
            );
        }
        let long = format!("ipc:///{}", "x".repeat(107));
        assert!(check_endpoint("events_endpoint", &long).is_err());
    }
}
