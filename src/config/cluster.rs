//! `kvroute serve`'s cluster flags (`crate::cluster` runs the replica).

use std::{path::PathBuf, time::Duration};

use clap::Args;

use crate::router::ReplicaSettings;

/// Cluster mode: several replicas sharing one index over NATS JetStream.
/// Without `--nats-url` kvroute runs alone and needs no other server.
#[derive(Clone, Debug, Args)]
pub struct ClusterOptions {
    /// NATS server(s) of the cluster, e.g. `nats://nats:4222` (comma
    /// separated for several). Set: this process is one replica of a
    /// cluster (JetStream must be enabled on the server).
    #[arg(long, env = "KVROUTE_NATS_URL")]
    pub nats_url: Option<String>,

    /// Prefix of every subject, stream, bucket and object store of this
    /// cluster, so several clusters can share one NATS: letters, digits,
    /// `-` and `_`.
    #[arg(long, env = "KVROUTE_CLUSTER_NAME", default_value = "kvroute",
          value_parser = parse_cluster_name)]
    pub cluster_name: String,

    /// This replica's name in the cluster (unique per replica; default: the
    /// host name and process id).
    #[arg(long, env = "KVROUTE_REPLICA_ID")]
    pub replica_id: Option<String>,

    /// Replicas of this cluster routing at once. Above 1, each replica
    /// estimates the load its peers book before their bookings reach it
    /// (`--replica-sync-delay`), so replicas deciding a burst from the same
    /// view spread it as one router would (docs/CLUSTER.md, "Router replicas").
    #[arg(long, env = "KVROUTE_CLUSTER_REPLICAS", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub cluster_replicas: u32,

    /// This replica's place among `--cluster-replicas`, from 0; replicas
    /// with distinct places make distinct choices from the same view.
    /// Default: the replica name's trailing number (a StatefulSet's
    /// `kvroute-2` is 2), else a hash of the name, modulo the replicas.
    #[arg(long, env = "KVROUTE_REPLICA_INDEX")]
    pub replica_index: Option<u32>,

    /// How late a peer's booking is expected to reach this replica: how
    /// long the estimate of a peer's load counts (0 turns it off).
    /// At most 1s: each decision keeps its peers' estimates that long.
    #[arg(long, env = "KVROUTE_REPLICA_SYNC_DELAY", default_value = "2ms",
          value_parser = parse_sync_delay)]
    pub replica_sync_delay: Duration,

    /// How replicas decide RESERVE calls. `ordered`: each call is a record
    /// of the shared log and every replica decides it there, from the same
    /// state, so all book what one router would (the answer waits for the
    /// log: about a NATS round trip). `local`: the replica that takes the
    /// call decides at once and shares the booking within milliseconds
    /// (`--cluster-replicas` estimates what it has not yet seen).
    /// docs/CLUSTER.md, "Ordered decisions".
    #[arg(long, env = "KVROUTE_DECISION_ORDER", value_enum, default_value_t = DecisionOrder::Ordered)]
    pub decision_order: DecisionOrder,

    /// NATS credentials file (JWT and NKey seed, `.creds`).
    #[arg(long, env = "KVROUTE_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,

    /// NATS user name (with `--nats-password`).
    #[arg(long, env = "KVROUTE_NATS_USER")]
    pub nats_user: Option<String>,

    /// NATS password.
    #[arg(long, env = "KVROUTE_NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,

    /// NATS token.
    #[arg(long, env = "KVROUTE_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,

    /// CA certificate (PEM) to verify the NATS server with; implies TLS.
    #[arg(long, env = "KVROUTE_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,

    /// Client certificate and key (PEM) for NATS servers that verify
    /// clients.
    #[arg(long, env = "KVROUTE_NATS_TLS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    #[arg(long, env = "KVROUTE_NATS_TLS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,

    /// How long the shared event log keeps records. A replica that starts
    /// loads the newest snapshot and reads the log from the position it
    /// covers, so this must be well over `--snapshot-interval` (the default
    /// is 2880 intervals of 30 s).
    #[arg(long, env = "KVROUTE_LOG_MAX_AGE", default_value = "24h",
          value_parser = humantime::parse_duration)]
    pub log_max_age: Duration,

    /// Most bytes the shared event log keeps (oldest records go first).
    /// JetStream reserves it from its storage limit when the stream is
    /// made. The conversation trace's hour of events takes about 90 MB.
    #[arg(long, env = "KVROUTE_LOG_MAX_BYTES", default_value_t = 1 << 30)]
    pub log_max_bytes: i64,

    /// How long JetStream remembers appended message ids: the same engine
    /// batch appended by several replicas within it is kept once.
    #[arg(long, env = "KVROUTE_LOG_DUPLICATE_WINDOW", default_value = "10m",
          value_parser = humantime::parse_duration)]
    pub log_duplicate_window: Duration,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            nats_url: None,
            cluster_name: "kvroute".into(),
            replica_id: None,
            cluster_replicas: 1,
            replica_index: None,
            replica_sync_delay: Duration::from_millis(2),
            decision_order: DecisionOrder::Ordered,
            nats_creds: None,
            nats_user: None,
            nats_password: None,
            nats_token: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
            log_max_age: Duration::from_secs(24 * 3600),
            log_max_bytes: 1 << 30,
            log_duplicate_window: Duration::from_secs(600),
        }
    }
}

/// How a replica decides RESERVE calls (`--decision-order`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DecisionOrder {
    /// At once, from the replica's own view, shared after.
    Local,
    /// In the shared log's order, alike on every replica.
    #[default]
    Ordered,
}

/// A replica's default place among `count`: its name's trailing number,
/// else a hash of the name, modulo `count`.
fn place_of(replica: &str, count: u32) -> u32 {
    let digits = replica.bytes().rev().take_while(u8::is_ascii_digit).count();
    let number = replica[replica.len() - digits..]
        .parse::<u64>()
        .unwrap_or_else(|_| xxhash_rust::xxh3::xxh3_64(replica.as_bytes()));
    u32::try_from(number % u64::from(count.max(1))).unwrap_or(0)
}

fn parse_sync_delay(text: &str) -> Result<Duration, String> {
    let delay = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if delay > Duration::from_secs(1) {
        return Err("at most 1s (replicas share bookings within milliseconds)".into());
    }
    Ok(delay)
}

fn parse_cluster_name(text: &str) -> Result<String, String> {
    let ok = !text.is_empty()
        && text.len() <= 64
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(text.to_owned())
    } else {
        Err("a cluster name is 1 to 64 letters, digits, '-' or '_'".into())
    }
}

impl ClusterOptions {
    /// This replica's name.
    pub(crate) fn replica(&self) -> String {
        self.replica_id.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/etc/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_default();
            let host = if host.is_empty() {
                "kvroute".into()
            } else {
                host
            };
            format!("{host}-{}", std::process::id())
        })
    }

    /// Whether RESERVE calls are decided in log order (cluster mode only).
    pub(crate) fn ordered(&self) -> bool {
        self.nats_url.is_some() && self.decision_order == DecisionOrder::Ordered
    }

    /// What this process's router core knows of its peer replicas: nothing
    /// alone (no `--nats-url`) or when decisions are ordered (every replica
    /// then sees every booking before its next decision), else the
    /// cluster's replica flags.
    pub(crate) fn replica_settings(&self) -> ReplicaSettings {
        if self.nats_url.is_none() || self.cluster_replicas <= 1 || self.ordered() {
            return ReplicaSettings::default();
        }
        let count = self.cluster_replicas;
        let index = self
            .replica_index
            .unwrap_or_else(|| place_of(&self.replica(), count));
        ReplicaSettings {
            count,
            index: index % count,
            sync_delay: self.replica_sync_delay,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_delays_are_bounded() {
        assert!(parse_cluster_name("prod-a_1").is_ok());
        assert!(parse_cluster_name("a.b").is_err());
        assert!(parse_cluster_name("").is_err());
        assert!(parse_cluster_name(&"x".repeat(65)).is_err());
        assert_eq!(parse_sync_delay("2ms"), Ok(Duration::from_millis(2)));
        assert!(parse_sync_delay("2s").is_err());
    }
}
