//! Engines kvroute finds by itself (`--pool FILE`): each pool file (see
//! `spec`) names a model's engines by address or by a DNS name, and
//! kvroute registers every member as a worker at `ADDR:HTTP_PORT`,
//! subscribed to its KV events at `tcp://ADDR:EVENTS_PORT`, with no agent
//! calling RegisterWorker. The files are re-read and the names resolved
//! again every `--pool-refresh-interval`: a new member is registered, a
//! member that left is removed as a deregistration removes it, a changed
//! file registers its members again.
//!
//! What stays true: kvroute connects only to members the engine endpoint
//! allow-list admits (as for a worker registering from loopback: without
//! `--engine-endpoint-allow`, only this machine's engines); a file that
//! cannot be read or a name that does not resolve keeps the members it had
//! (a DNS hiccup must not empty the fleet); one pool's trouble never
//! touches another's members.

mod spec;

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use tokio_util::sync::CancellationToken;

use crate::{
    engine_events::EngineSource, fleet::Fleet, metrics::GatewayFamilies, security::EndpointAllow,
};
use kvroute_core::{registry::Registration, types::WorkerId};

pub(crate) use spec::PoolSpec;
pub use spec::member_id;
use spec::{Members, distinct};

/// A member as registered: its pool (index in the files), registration and
/// source.
#[derive(Clone, Debug, PartialEq)]
struct Member {
    pool: usize,
    registration: Registration,
    source: EngineSource,
}

/// The pools and the members registered for them.
pub(crate) struct Pools {
    fleet: Arc<Fleet>,
    allow: EndpointAllow,
    files: Vec<PathBuf>,
    metrics: GatewayFamilies,
    members: HashMap<WorkerId, Member>,
}

impl Pools {
    pub(crate) fn new(fleet: Arc<Fleet>, allow: EndpointAllow, files: Vec<PathBuf>) -> Self {
        let metrics = fleet.router().metrics().gateway.clone();
        Self {
            fleet,
            allow,
            files,
            metrics,
            members: HashMap::new(),
        }
    }

    /// Refreshes every `interval` until `stop`.
    pub(crate) async fn run(mut self, interval: Duration, stop: CancellationToken) {
        loop {
            self.refresh().await;
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
        }
    }

    /// Reads every file, resolves its members and brings the registered
    /// members in line.
    pub(crate) async fn refresh(&mut self) {
        let mut wanted: HashMap<WorkerId, Member> = HashMap::new();
        for (pool, path) in self.files.iter().enumerate() {
            match self.pool_members(pool).await {
                Ok(members) => {
                    self.count("read");
                    for member in members {
                        wanted.insert(member.registration.worker_id, member);
                    }
                }
                Err(why) => {
                    self.count("failed");
                    tracing::warn!(pool = %path.display(), %why, "pool not refreshed: its members stay");
                    for (id, member) in &self.members {
                        if member.pool == pool {
                            wanted.insert(*id, member.clone());
                        }
                    }
                }
            }
        }
        let gone: Vec<WorkerId> = self
            .members
            .keys()
            .filter(|id| !wanted.contains_key(id))
            .copied()
            .collect();
        for worker_id in gone {
            self.members.remove(&worker_id);
            match self.fleet.deregister(worker_id).await {
                Ok(blocks) => tracing::info!(worker_id, blocks, "pool member left: removed"),
                Err(error) => tracing::debug!(worker_id, %error, "pool member already gone"),
            }
        }
        for (worker_id, member) in wanted {
            let registered = self.fleet.router().worker(worker_id).is_some();
            if registered && self.members.get(&worker_id) == Some(&member) {
                continue;
            }
            let endpoint = member.registration.endpoint.clone();
            match self
                .fleet
                .register_member(member.registration.clone(), member.source.clone())
                .await
            {
                Ok(()) => {
                    tracing::info!(worker_id, %endpoint, "pool member registered");
                    self.members.insert(worker_id, member);
                }
                Err(error) => {
                    tracing::warn!(worker_id, %endpoint, %error, "pool member not registered");
                    self.members.remove(&worker_id);
                }
            }
        }
        self.metrics
            .pool_members
            .set(i64::try_from(self.members.len()).unwrap_or(i64::MAX));
    }

    fn count(&self, outcome: &str) {
        self.metrics
            .pool_refreshes
            .with_label_values(&[outcome])
            .inc();
    }

    /// The members pool `pool`'s file names now, those the allow-list
    /// refuses left out (and logged).
    async fn pool_members(&self, pool: usize) -> Result<Vec<Member>, String> {
        let path = &self.files[pool];
        let spec = PoolSpec::read(path)?;
        let hosts = match spec.members() {
            Members::Listed(hosts) => hosts.to_vec(),
            Members::Dns(name) => resolve(name, spec.http_port).await?,
        };
        let mut members = Vec::with_capacity(hosts.len());
        for host in hosts {
            let (registration, source) = spec.member(&host)?;
            if !self.admitted(&registration, &source) {
                self.metrics
                    .pool_refreshes
                    .with_label_values(&["member_refused"])
                    .inc();
                tracing::warn!(
                    pool = %path.display(),
                    member = %host,
                    "pool member refused: {}",
                    crate::security::endpoint_allow::REFUSED
                );
                continue;
            }
            members.push(Member {
                pool,
                registration,
                source,
            });
        }
        Ok(members)
    }

    /// Whether the allow-list admits every endpoint of a member, judged as
    /// for a worker registering from loopback.
    fn admitted(&self, registration: &Registration, source: &EngineSource) -> bool {
        let peer = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        self.allow
            .refused_field(&registration.endpoint, Some(source), peer)
            .is_none()
    }
}

/// The addresses `name` resolves to now.
async fn resolve(name: &str, port: u16) -> Result<Vec<String>, String> {
    let addresses = tokio::net::lookup_host((name, port))
        .await
        .map_err(|e| format!("{name}: {e}"))?;
    Ok(distinct(addresses.map(|a| a.ip())))
}
