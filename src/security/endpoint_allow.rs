//! Which hosts a worker may ask kvroute to connect to. A RegisterWorker
//! with an `events_endpoint` makes kvroute open ZeroMQ connections to it,
//! and one with an HTTP `endpoint` (`host:port`) makes the endpoint picker
//! send users' requests there;
//! unchecked, anyone could point kvroute at any host and port (and read
//! from the connection counters whether something listens there). An
//! endpoint is accepted only if its host is on `--engine-endpoint-allow`
//! (CIDRs and host names) or, when that is not given, is the registering
//! peer's own address (any loopback address for a loopback peer).

use std::net::IpAddr;

use crate::engine_events::EngineSource;

/// `--engine-endpoint-allow`, parsed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointAllow {
    /// `None`: the default rule (the peer's own address).
    list: Option<AllowList>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct AllowList {
    networks: Vec<(IpAddr, u8)>,
    /// Exact names, lower case.
    hosts: Vec<String>,
    /// `*.example.org` as `.example.org`.
    suffixes: Vec<String>,
}

/// The one answer to every refused endpoint, whether or not anything
/// listens there.
pub const REFUSED: &str =
    "host is not in --engine-endpoint-allow (by default only the registering peer's own address)";

impl EndpointAllow {
    /// Parses the flag's entries (each may hold several, comma-separated);
    /// no entries is the default rule.
    pub(crate) fn parse(entries: &[String]) -> Result<Self, String> {
        let mut list = AllowList::default();
        let mut any = false;
        for entry in entries.iter().flat_map(|e| e.split(',')) {
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            any = true;
            if let Some(network) = parse_network(entry)? {
                list.networks.push(network);
            } else if let Some(suffix) = entry.strip_prefix("*.") {
                list.suffixes
                    .push(format!(".{}", suffix.to_ascii_lowercase()));
            } else if entry
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
            {
                list.hosts.push(entry.to_ascii_lowercase());
            } else {
                return Err(format!(
                    "--engine-endpoint-allow: `{entry}` is not a CIDR, an IP address, a host name or `*.domain`"
                ));
            }
        }
        Ok(Self {
            list: any.then_some(list),
        })
    }

    /// Whether kvroute may connect to `endpoint` (`tcp://HOST:PORT` or
    /// `ipc://PATH`, already checked for form) for a worker registering
    /// from `peer`.
    pub(crate) fn permits(&self, endpoint: &str, peer: Option<IpAddr>) -> bool {
        let peer = peer.map(|p| p.to_canonical());
        let peer_is_loopback = peer.is_some_and(|p| p.is_loopback());
        if endpoint.starts_with("ipc://") {
            // A local socket: only for a worker on this machine.
            return peer_is_loopback;
        }
        let Some(host) = endpoint
            .strip_prefix("tcp://")
            .and_then(|rest| rest.rsplit_once(':'))
            .map(|(host, _port)| host.trim_start_matches('[').trim_end_matches(']'))
        else {
            return false;
        };
        let ip = host.parse::<IpAddr>().ok().map(|ip| ip.to_canonical());
        match &self.list {
            Some(list) => match ip {
                Some(ip) => list
                    .networks
                    .iter()
                    .any(|&(net, bits)| in_network(ip, net, bits)),
                None => {
                    let host = host.to_ascii_lowercase();
                    list.hosts.contains(&host) || list.suffixes.iter().any(|s| host.ends_with(s))
                }
            },
            None => match ip {
                Some(ip) => Some(ip) == peer || (peer_is_loopback && ip.is_loopback()),
                None => peer_is_loopback && host.eq_ignore_ascii_case("localhost"),
            },
        }
    }
}

impl EndpointAllow {
    /// The first of a worker's endpoints kvroute may not connect or route
    /// to, by its field name: its HTTP `endpoint` (when it is `host:port`),
    /// then its engine's events and replay endpoints.
    pub(crate) fn refused_field(
        &self,
        endpoint: &str,
        source: Option<&EngineSource>,
        peer: Option<IpAddr>,
    ) -> Option<&'static str> {
        let http = http_address(endpoint).map(|address| format!("tcp://{address}"));
        [
            ("endpoint", http.as_ref()),
            ("events_endpoint", source.map(|s| &s.endpoint)),
            (
                "replay_endpoint",
                source.and_then(|s| s.replay_endpoint.as_ref()),
            ),
        ]
        .into_iter()
        .find_map(|(field, endpoint)| endpoint.filter(|e| !self.permits(e, peer)).map(|_| field))
    }
}

/// The HTTP address (`host:port`) of a worker's registered endpoint, if
/// it is one: `host:port` or `http://host:port[/]`.
pub(crate) fn http_address(endpoint: &str) -> Option<&str> {
    let address = endpoint.strip_prefix("http://").unwrap_or(endpoint);
    let address = address.strip_suffix('/').unwrap_or(address);
    let (host, port) = address.rsplit_once(':')?;
    let host_ok = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.[]:".contains(&b));
    (host_ok && port.parse::<u16>().is_ok_and(|p| p != 0)).then_some(address)
}

/// `10.0.0.0/8`, `fd00::/8` or a bare address; `None` for a host name.
fn parse_network(entry: &str) -> Result<Option<(IpAddr, u8)>, String> {
    let (address, bits) = match entry.split_once('/') {
        Some((address, bits)) => (address, Some(bits)),
        None => (entry, None),
    };
    let Ok(ip) = address.parse::<IpAddr>() else {
        return match bits {
            Some(_) => Err(format!("--engine-endpoint-allow: `{entry}` is not a CIDR")),
            None => Ok(None),
        };
    };
    let ip = ip.to_canonical();
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let bits = match bits {
        Some(bits) => bits
            .parse::<u8>()
            .ok()
            .filter(|&b| b <= max)
            .ok_or_else(|| format!("--engine-endpoint-allow: `{entry}`: prefix length 0-{max}"))?,
        None => max,
    };
    Ok(Some((ip, bits)))
}

fn in_network(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    let mask = |width: u32| {
        if bits == 0 {
            0u128
        } else {
            u128::MAX << (width - u32::from(bits))
        }
    };
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(b)) => {
            let m = mask(32);
            (u128::from(u32::from(a)) & m) == (u128::from(u32::from(b)) & m)
        }
        (IpAddr::V6(a), IpAddr::V6(b)) => {
            let m = mask(128);
            (u128::from(a) & m) == (u128::from(b) & m)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> Option<IpAddr> {
        Some(text.parse().unwrap())
    }

    #[test]
    fn by_default_only_the_peer_itself() {
        let allow = EndpointAllow::parse(&[]).unwrap();
        assert!(allow.permits("tcp://10.1.2.3:5557", ip("10.1.2.3")));
        assert!(allow.permits("tcp://10.1.2.3:5557", ip("::ffff:10.1.2.3")));
        assert!(!allow.permits("tcp://10.1.2.4:5557", ip("10.1.2.3")));
        assert!(!allow.permits("tcp://127.0.0.1:22", ip("10.1.2.3")));
        assert!(!allow.permits("tcp://internal.db:5432", ip("10.1.2.3")));
        assert!(!allow.permits("ipc:///tmp/engine.sock", ip("10.1.2.3")));
        assert!(allow.permits("tcp://127.0.0.1:5557", ip("127.0.0.1")));
        assert!(allow.permits("tcp://[::1]:5557", ip("127.0.0.1")));
        assert!(allow.permits("tcp://localhost:5557", ip("::1")));
        assert!(allow.permits("ipc:///tmp/engine.sock", ip("127.0.0.1")));
        assert!(!allow.permits("tcp://10.1.2.3:5557", None));
    }

    #[test]
    fn the_list_replaces_the_default() {
        let allow = EndpointAllow::parse(&[
            "10.0.0.0/8, fd00::/8".into(),
            "engine-0.serving.svc,*.vllm.serving.svc".into(),
            "192.168.1.7".into(),
        ])
        .unwrap();
        assert!(allow.permits("tcp://10.200.0.1:5557", ip("172.16.0.1")));
        assert!(allow.permits("tcp://[fd00::5]:5557", ip("172.16.0.1")));
        assert!(allow.permits("tcp://192.168.1.7:1", ip("172.16.0.1")));
        assert!(!allow.permits("tcp://192.168.1.8:1", ip("192.168.1.8")));
        assert!(allow.permits("tcp://ENGINE-0.serving.svc:5557", None));
        assert!(allow.permits("tcp://pod-3.vllm.serving.svc:5557", None));
        assert!(!allow.permits("tcp://vllm.serving.svc.evil.org:5557", None));
        assert!(!allow.permits("tcp://11.0.0.1:5557", ip("11.0.0.1")));
    }

    #[test]
    fn bad_entries_are_named() {
        for bad in ["10.0.0.0/33", "10.0.0.0/x", "not a host!", "nope/8"] {
            let error = EndpointAllow::parse(&[bad.into()]).unwrap_err();
            assert!(error.contains(bad), "{error}");
        }
        assert!(in_network(
            ip("1.2.3.4").unwrap(),
            ip("0.0.0.0").unwrap(),
            0
        ));
    }

    #[test]
    fn http_addresses_are_host_and_port_only() {
        assert_eq!(http_address("10.0.0.1:8000"), Some("10.0.0.1:8000"));
        assert_eq!(http_address("http://engine-0:8000/"), Some("engine-0:8000"));
        assert_eq!(http_address("[::1]:8000"), Some("[::1]:8000"));
        for not in [
            "",
            "engine",
            "tcp://10.0.0.1:5557",
            "10.0.0.1:0",
            "10.0.0.1:99999",
            "a b:80",
            "a,b:80",
            "sim://engine/1",
            "https://x:443/path",
        ] {
            assert_eq!(http_address(not), None, "{not:?}");
        }
    }
}
