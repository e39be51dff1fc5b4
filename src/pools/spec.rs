//! A pool file: the engines of one model that kvroute finds by itself,
//! without an agent calling RegisterWorker. The file says what every
//! member shares (model, HTTP and KV-event ports, block size, dp size,
//! capacity) and where the members are: a list of addresses, or a DNS
//! name whose addresses are the members (a Kubernetes headless Service
//! lists the ready pods of an `InferencePool` that way).
//!
//! ```toml
//! model = "Qwen/Qwen3-0.6B"
//! http_port = 8000
//! events_port = 5557          # rank r publishes on events_port + r
//! replay_port = 5558          # optional
//! dialect = "vllm"            # or "sglang"
//! block_size = 16
//! dp_size = 1
//! total_kv_blocks = 65536     # per rank; 0: the server's default
//! max_num_batched_tokens = 8192
//! members = ["10.0.0.5", "10.0.0.6"]   # or: dns = "vllm.serving.svc"
//! loads_adapters = false      # true: members load adapters on request
//!
//! [[cache_tiers]]             # optional: tiers below the device
//! tier = "host"               # host, storage or external
//! capacity_blocks = 262144    # per rank
//! prefill_saving = 0.9        # optional: else the router's setting
//! ```

use std::{collections::BTreeSet, net::IpAddr, path::Path};

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64;

use crate::engine_events::EngineSource;
use kvroute_core::{
    index::Tier,
    registry::{Adapter, Registration},
    types::{KvEventsMode, TierSpec, WorkerId, WorkerRole},
};

/// Largest pool file read, in bytes.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Most members one pool may list or resolve to.
pub(crate) const MAX_MEMBERS: usize = 4096;

/// One pool file, read.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct PoolSpec {
    pub model: String,
    pub http_port: u16,
    pub events_port: u16,
    #[serde(default)]
    pub replay_port: Option<u16>,
    pub dialect: String,
    pub block_size: u32,
    #[serde(default = "one")]
    pub dp_size: u32,
    #[serde(default)]
    pub total_kv_blocks: u64,
    #[serde(default)]
    pub max_num_batched_tokens: u64,
    #[serde(default)]
    pub members: Option<Vec<String>>,
    #[serde(default)]
    pub dns: Option<String>,
    /// The LoRA adapters every member serves (`[[adapters]]` tables of
    /// `id` and `name`), as RegisterWorker's `adapters`.
    #[serde(default)]
    pub adapters: Vec<PoolAdapter>,
    /// Every member loads adapters it does not serve on request, as
    /// RegisterWorker's `loads_adapters`. Default false.
    #[serde(default)]
    pub loads_adapters: bool,
    /// The cache tiers below the device every member keeps
    /// (`[[cache_tiers]]` tables of `tier` = host, storage or external,
    /// `capacity_blocks` and optionally `prefill_saving`), as
    /// RegisterWorker's `cache_tiers`.
    #[serde(default)]
    pub cache_tiers: Vec<PoolTier>,
}

/// A cache tier below the device of a pool's members.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct PoolTier {
    pub tier: String,
    pub capacity_blocks: u64,
    #[serde(default)]
    pub prefill_saving: Option<f64>,
}

/// A LoRA adapter of a pool's members.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub(crate) struct PoolAdapter {
    pub id: i64,
    pub name: String,
}

fn one() -> u32 {
    1
}

/// Where a pool's members come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Members<'a> {
    Listed(&'a [String]),
    Dns(&'a str),
}

impl PoolSpec {
    /// Reads and checks a pool file.
    pub(crate) fn read(path: &Path) -> Result<Self, String> {
        let size = std::fs::metadata(path).map_err(|e| e.to_string())?.len();
        if size > MAX_FILE_BYTES {
            return Err(format!("{size} bytes, more than {MAX_FILE_BYTES}"));
        }
        let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
        Self::parse(&text)
    }

    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let spec: Self = toml::from_str(text).map_err(|e| e.message().to_owned())?;
        if spec.model.is_empty() {
            return Err("`model` is empty".into());
        }
        if spec.http_port == 0 || spec.events_port == 0 || spec.replay_port == Some(0) {
            return Err("ports must be 1-65535".into());
        }
        match (&spec.members, &spec.dns) {
            (Some(_), Some(_)) => return Err("give `members` or `dns`, not both".into()),
            (None, None) => return Err("give `members` (addresses) or `dns` (a name)".into()),
            (Some(members), None) if members.len() > MAX_MEMBERS => {
                return Err(format!("more than {MAX_MEMBERS} members"));
            }
            _ => {}
        }
        if let Some(members) = &spec.members
            && let Some(bad) = members.iter().find(|m| !is_host(m))
        {
            return Err(format!("member {bad:?} is not an address or a host name"));
        }
        if let Some(name) = &spec.dns
            && !is_host(name)
        {
            return Err(format!("dns {name:?} is not a host name"));
        }
        // The checks every member's source would fail (dialect, ports for
        // every rank).
        let (registration, source) = spec.member("127.0.0.1")?;
        source.events_config(
            registration.worker_id,
            &spec.model,
            spec.block_size.max(1),
            0,
            registration.dp_size,
        )?;
        Ok(spec)
    }

    pub(crate) fn members(&self) -> Members<'_> {
        match (&self.members, &self.dns) {
            (Some(listed), _) => Members::Listed(listed),
            (None, Some(name)) => Members::Dns(name),
            (None, None) => Members::Listed(&[]),
        }
    }

    fn source(&self, host: &str) -> Result<EngineSource, String> {
        let host = bracketed(host);
        let replay = self
            .replay_port
            .map(|port| format!("tcp://{host}:{port}"))
            .unwrap_or_default();
        EngineSource::from_fields(
            &format!("tcp://{host}:{}", self.events_port),
            &self.dialect,
            &replay,
        )?
        .ok_or_else(|| "no events endpoint".to_owned())
    }

    /// The registration and event source of the member at `host`.
    pub(crate) fn member(&self, host: &str) -> Result<(Registration, EngineSource), String> {
        let source = self.source(host)?;
        let registration = Registration {
            worker_id: member_id(&self.model, host),
            model: self.model.clone(),
            role: WorkerRole::Aggregated,
            endpoint: format!("{}:{}", bracketed(host), self.http_port),
            block_size: self.block_size,
            dp_start_rank: 0,
            dp_size: self.dp_size.max(1),
            total_kv_blocks: self.total_kv_blocks,
            max_num_batched_tokens: self.max_num_batched_tokens,
            taints: Vec::new(),
            adapters: self
                .adapters
                .iter()
                .map(|a| Adapter {
                    id: a.id,
                    name: a.name.clone(),
                })
                .collect(),
            loads_adapters: self.loads_adapters,
            lease_ttl: None,
            kv_events: KvEventsMode::Exact,
            tiers: self
                .cache_tiers
                .iter()
                .map(|t| {
                    let tier = Tier::from_name(&t.tier)
                        .filter(|tier| *tier != Tier::Device)
                        .ok_or_else(|| {
                            format!("cache_tiers: {:?} is not host, storage or external", t.tier)
                        })?;
                    Ok(TierSpec {
                        tier,
                        capacity_blocks: t.capacity_blocks,
                        prefill_saving: t.prefill_saving,
                    })
                })
                .collect::<Result<_, String>>()?,
        };
        Ok((registration, source))
    }
}

/// A member's worker id: the same for the same model and address at every
/// start and on every replica; the high bit set keeps it apart from the
/// small ids agents usually pick.
pub fn member_id(model: &str, host: &str) -> WorkerId {
    let mut key = Vec::with_capacity(model.len() + host.len() + 1);
    key.extend_from_slice(model.as_bytes());
    key.push(0);
    key.extend_from_slice(host.as_bytes());
    xxh3_64(&key) | 1 << 63
}

/// Resolved addresses, in order, at most [`MAX_MEMBERS`].
pub(crate) fn distinct(addresses: impl IntoIterator<Item = IpAddr>) -> Vec<String> {
    addresses
        .into_iter()
        .map(|ip| ip.to_canonical().to_string())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .take(MAX_MEMBERS)
        .collect()
}

fn bracketed(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

fn is_host(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 253
        && (text.parse::<IpAddr>().is_ok()
            || text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LISTED: &str = r#"
        model = "llama"
        http_port = 8000
        events_port = 5557
        replay_port = 5558
        dialect = "vllm"
        block_size = 16
        dp_size = 2
        total_kv_blocks = 1000
        members = ["10.0.0.5", "fd00::7"]
    "#;

    #[test]
    fn a_member_is_registered_at_its_http_port_and_subscribed_at_its_events_port() {
        let spec = PoolSpec::parse(LISTED).unwrap();
        assert_eq!(
            spec.members(),
            Members::Listed(&["10.0.0.5".into(), "fd00::7".into()])
        );
        let (registration, source) = spec.member("10.0.0.5").unwrap();
        assert_eq!(registration.endpoint, "10.0.0.5:8000");
        assert_eq!(registration.dp_size, 2);
        assert_eq!(registration.total_kv_blocks, 1000);
        assert_eq!(source.endpoint, "tcp://10.0.0.5:5557");
        assert_eq!(
            source.replay_endpoint.as_deref(),
            Some("tcp://10.0.0.5:5558")
        );
        let (v6, source) = spec.member("fd00::7").unwrap();
        assert_eq!(v6.endpoint, "[fd00::7]:8000");
        assert_eq!(source.endpoint, "tcp://[fd00::7]:5557");
        assert_ne!(registration.worker_id, v6.worker_id);
        assert_eq!(
            registration.worker_id,
            member_id("llama", "10.0.0.5"),
            "stable"
        );
        assert!(registration.worker_id >= 1 << 63);
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        let cases = [
            (
                LISTED.replace("dialect = \"vllm\"", "dialect = \"tgi\""),
                "dialect",
            ),
            (LISTED.replace("http_port = 8000", "http_port = 0"), "ports"),
            (
                LISTED.replace("http_port = 8000", "http_port = 70000"),
                "u16",
            ),
            (
                LISTED.replace("members = [\"10.0.0.5\", \"fd00::7\"]", ""),
                "give `members`",
            ),
            (
                LISTED.replace("members = [", "dns = \"x.svc\"\nmembers = ["),
                "not both",
            ),
            (LISTED.replace("\"10.0.0.5\"", "\"a b\""), "not an address"),
            (format!("{LISTED}\ncolour = 1"), "colour"),
            (LISTED.replace("model = \"llama\"", "model = \"\""), "model"),
        ];
        for (text, why) in cases {
            let error = PoolSpec::parse(&text).unwrap_err();
            assert!(error.contains(why), "{why}: {error}");
        }
    }

    #[test]
    fn the_example_in_deploy_reads() {
        let text = include_str!("../../deploy/pool.example.toml");
        let spec = PoolSpec::parse(text).unwrap();
        assert_eq!(spec.members(), Members::Listed(&["127.0.0.1".into()]));
        assert!(!spec.loads_adapters, "not unless asked");
        // Its commented adapters, uncommented, read too.
        let adapters = text.replace("# [[adapters]]", "[[adapters]]");
        let adapters = adapters
            .replace("# loads_adapters = true", "loads_adapters = true")
            .replace("# id = 1", "id = 1")
            .replace("# name = \"sql-lora\"", "name = \"sql-lora\"");
        let spec = PoolSpec::parse(&adapters).unwrap();
        let (registration, _) = spec.member("127.0.0.1").unwrap();
        assert_eq!(
            registration.adapters,
            [Adapter {
                id: 1,
                name: "sql-lora".into()
            }]
        );
        assert!(registration.loads_adapters);
        // ...and so do its commented cache tiers.
        let tiers = text
            .replace("# [[cache_tiers]]", "[[cache_tiers]]")
            .replace("# tier = \"host\"", "tier = \"host\"")
            .replace("# capacity_blocks = 262144", "capacity_blocks = 262144")
            .replace("# prefill_saving = 0.8", "prefill_saving = 0.8");
        let spec = PoolSpec::parse(&tiers).unwrap();
        let (registration, _) = spec.member("127.0.0.1").unwrap();
        assert_eq!(
            registration.tiers,
            [TierSpec {
                tier: Tier::Host,
                capacity_blocks: 262_144,
                prefill_saving: Some(0.8),
            }]
        );
    }

    #[test]
    fn resolved_addresses_are_distinct_and_bounded() {
        let ips = ["10.0.0.2", "10.0.0.1", "10.0.0.2"].map(|a| a.parse().unwrap());
        assert_eq!(distinct(ips), ["10.0.0.1", "10.0.0.2"]);
        let many = (0..5000u32).map(|i| IpAddr::from(std::net::Ipv4Addr::from(i)));
        assert_eq!(distinct(many).len(), MAX_MEMBERS);
    }
}
