//! The fleet's state ↔ the snapshot file's protobuf messages. Decoding
//! checks everything a damaged or hand-made file could get wrong (parent
//! links, engine hashes per held block, roles, endpoints), so a file that
//! passes its checksum but describes an impossible state is refused as a
//! whole, like a corrupted one.

use std::{collections::BTreeMap, time::Duration};

use crate::{
    engine_events::{EngineSource, dialect_name},
    fleet::state::{FleetState, FleetTarget, FleetWorker},
    ingest::CapturedTarget,
    pb::{self, cache_tier},
};
use kvroute_core::{
    admission::bookings::SavedBooking,
    index::{
        Tier,
        content::{ContentNode, TargetContent},
    },
    registry::{Adapter, Registration, SavedWorker},
    select::{PinTarget, affinity::SavedSession},
    types::{RankLoad, WorkerRank, WorkerRole},
};

/// Why a decoded snapshot describes no state kvroute can restore.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {why}")]
pub struct InvalidState {
    what: String,
    why: String,
}

fn invalid(what: impl Into<String>, why: impl Into<String>) -> InvalidState {
    InvalidState {
        what: what.into(),
        why: why.into(),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub(crate) fn state_to_pb(state: &FleetState, taken_unix_ms: u64) -> pb::SnapshotState {
    pb::SnapshotState {
        taken_unix_ms,
        workers: state.workers.iter().map(worker_to_pb).collect(),
        targets: state.targets.iter().map(target_to_pb).collect(),
        sessions: state.sessions.iter().map(session_to_pb).collect(),
        bookings: state.bookings.iter().map(booking_to_pb).collect(),
        routing_clock_ms: state.routing_clock_ms,
    }
}

/// A session binding in wire form (snapshots, and cluster mode's bucket).
pub(crate) fn session_to_pb(s: &SavedSession) -> pb::SnapshotSession {
    pb::SnapshotSession {
        session_id: s.session_id.clone(),
        worker_id: s.target.worker_id,
        dp_rank: s.target.dp_rank,
        idle_ms: s.idle_ms,
    }
}

pub(crate) fn session_from_pb(s: pb::SnapshotSession) -> SavedSession {
    SavedSession {
        session_id: s.session_id,
        target: PinTarget::new(s.worker_id, s.dp_rank),
        idle_ms: s.idle_ms,
    }
}

/// An open booking in wire form (snapshots, and cluster mode's changes).
pub(crate) fn booking_to_pb(b: &SavedBooking) -> pb::SnapshotBooking {
    pb::SnapshotBooking {
        request_id: b.request_id.clone(),
        worker_id: b.target.worker_id,
        dp_rank: b.target.dp_rank,
        prefill_outstanding: b.prefill.is_some(),
        prefill_tokens: b.prefill.map_or(0, |p| p.0),
        prefill_blocks: b.prefill.map_or(0, |p| p.1),
        keys: b.keys.clone(),
        age_ms: b.age_ms,
        owner: b.owner.as_deref().unwrap_or_default().to_owned(),
    }
}

pub(crate) fn booking_from_pb(b: pb::SnapshotBooking) -> SavedBooking {
    SavedBooking {
        request_id: b.request_id,
        target: WorkerRank::new(b.worker_id, b.dp_rank),
        prefill: b
            .prefill_outstanding
            .then_some((b.prefill_tokens, b.prefill_blocks)),
        keys: b.keys,
        age_ms: b.age_ms,
        owner: (!b.owner.is_empty()).then(|| b.owner.into()),
    }
}

fn worker_to_pb(w: &FleetWorker) -> pb::SnapshotWorker {
    let r = &w.worker.registration;
    let role = match r.role {
        WorkerRole::Aggregated => pb::WorkerRole::Aggregated,
        WorkerRole::Prefill => pb::WorkerRole::Prefill,
        WorkerRole::Decode => pb::WorkerRole::Decode,
    };
    let source = w.source.as_ref();
    pb::SnapshotWorker {
        worker_id: r.worker_id,
        model: r.model.clone(),
        role: role.into(),
        endpoint: r.endpoint.clone(),
        block_size: r.block_size,
        dp_start_rank: r.dp_start_rank,
        dp_size: r.dp_size,
        total_kv_blocks: r.total_kv_blocks,
        max_num_batched_tokens: r.max_num_batched_tokens,
        taints: r.taints.clone(),
        adapters: r.adapters.iter().map(pb::LoraAdapter::from).collect(),
        loads_adapters: r.loads_adapters,
        cache_tiers: r.tiers.iter().map(pb::CacheTierSpec::from).collect(),
        lease_ttl_ms: millis(w.worker.lease_ttl),
        lease_remaining_ms: millis(w.worker.lease_remaining),
        cordoned: w.worker.cordoned,
        generation: w.worker.generation,
        load: w
            .worker
            .load
            .iter()
            .map(|(&dp_rank, l)| pb::RankLoad {
                dp_rank,
                running_requests: l.running_requests,
                waiting_requests: l.waiting_requests,
                kv_blocks_used: l.kv_blocks_used,
            })
            .collect(),
        events_endpoint: source.map_or_else(String::new, |s| s.endpoint.clone()),
        events_dialect: source.map_or_else(String::new, |s| dialect_name(s.dialect).into()),
        replay_endpoint: source
            .and_then(|s| s.replay_endpoint.clone())
            .unwrap_or_default(),
        configured: w.configured,
        kv_events: pb::KvEventsMode::from(r.kv_events).into(),
    }
}

fn target_to_pb(t: &FleetTarget) -> pb::SnapshotTarget {
    let content = &t.captured.content;
    let form = content_to_pb(content);
    pb::SnapshotTarget {
        worker_id: t.target.worker_id,
        dp_rank: t.target.dp_rank,
        last_event_id: t.captured.last_event_id,
        engine_sequence: t.engine_sequence,
        engine_unsynced: t.engine_unsynced,
        salted_blocks: t.engine_salts.iter().map(|(h, _)| *h).collect(),
        salts: t.engine_salts.iter().map(|(_, s)| s.to_string()).collect(),
        locals: form.locals,
        parent_back: form.parent_back,
        unheld: form.unheld,
        engines: form.engines,
        more_nodes: form.more_nodes,
        more_engines: form.more_engines,
        lower_tiers: content
            .lower_tiers
            .iter()
            .map(|(tier, lower)| pb::SnapshotTierBlocks {
                tier: pb::CacheTier::from(*tier) as i32,
                ..content_to_pb(lower)
            })
            .collect(),
    }
}

/// One tier's content in the snapshot's node form (the tier left unset).
fn content_to_pb(content: &TargetContent) -> pb::SnapshotTierBlocks {
    let mut out = pb::SnapshotTierBlocks::default();
    out.locals.reserve(content.nodes.len());
    out.parent_back.reserve(content.nodes.len());
    out.engines.reserve(content.nodes.len());
    for (i, node) in content.nodes.iter().enumerate() {
        out.locals.push(node.local);
        out.parent_back
            .push(node.parent.map_or(0, |p| (i as u32).saturating_sub(p)));
        match node.engine {
            Some(engine) => out.engines.push(engine),
            None => out.unheld.push(i as u32),
        }
    }
    for &(node, engine) in &content.more_engines {
        out.more_nodes.push(node);
        out.more_engines.push(engine);
    }
    out
}

pub(crate) fn state_from_pb(state: pb::SnapshotState) -> Result<FleetState, InvalidState> {
    Ok(FleetState {
        workers: state
            .workers
            .into_iter()
            .map(worker_from_pb)
            .collect::<Result<_, _>>()?,
        targets: state
            .targets
            .into_iter()
            .map(target_from_pb)
            .collect::<Result<_, _>>()?,
        sessions: state.sessions.into_iter().map(session_from_pb).collect(),
        bookings: state.bookings.into_iter().map(booking_from_pb).collect(),
        routing_clock_ms: state.routing_clock_ms,
    })
}

fn worker_from_pb(w: pb::SnapshotWorker) -> Result<FleetWorker, InvalidState> {
    let what = || format!("worker {}", w.worker_id);
    let role = match pb::WorkerRole::try_from(w.role) {
        Ok(pb::WorkerRole::Aggregated) => WorkerRole::Aggregated,
        Ok(pb::WorkerRole::Prefill) => WorkerRole::Prefill,
        Ok(pb::WorkerRole::Decode) => WorkerRole::Decode,
        Err(_) => return Err(invalid(what(), format!("unknown role {}", w.role))),
    };
    let source =
        EngineSource::from_fields(&w.events_endpoint, &w.events_dialect, &w.replay_endpoint)
            .map_err(|why| invalid(what(), why))?;
    let load: BTreeMap<u32, RankLoad> = w
        .load
        .iter()
        .map(|l| {
            (
                l.dp_rank,
                RankLoad {
                    running_requests: l.running_requests,
                    waiting_requests: l.waiting_requests,
                    kv_blocks_used: l.kv_blocks_used,
                },
            )
        })
        .collect();
    Ok(FleetWorker {
        worker: SavedWorker {
            registration: Registration {
                worker_id: w.worker_id,
                model: w.model,
                role,
                endpoint: w.endpoint,
                block_size: w.block_size,
                dp_start_rank: w.dp_start_rank,
                dp_size: w.dp_size,
                total_kv_blocks: w.total_kv_blocks,
                max_num_batched_tokens: w.max_num_batched_tokens,
                taints: w.taints,
                adapters: w.adapters.into_iter().map(Adapter::from).collect(),
                loads_adapters: w.loads_adapters,
                lease_ttl: None,
                kv_events: pb::KvEventsMode::to_domain(w.kv_events).ok_or_else(|| {
                    invalid(what(), format!("unknown KV events mode {}", w.kv_events))
                })?,
                tiers: w
                    .cache_tiers
                    .iter()
                    .map(cache_tier::tier_spec)
                    .collect::<Result<_, _>>()
                    .map_err(|why| invalid(what(), why))?,
            },
            lease_ttl: Duration::from_millis(w.lease_ttl_ms),
            lease_remaining: Duration::from_millis(w.lease_remaining_ms),
            cordoned: w.cordoned,
            load,
            generation: w.generation,
        },
        source,
        configured: w.configured,
    })
}

fn target_from_pb(t: pb::SnapshotTarget) -> Result<FleetTarget, InvalidState> {
    let target = WorkerRank::new(t.worker_id, t.dp_rank);
    let what = || format!("target {target}");
    if t.salted_blocks.len() != t.salts.len() {
        return Err(invalid(what(), "salted blocks and salts differ in length"));
    }
    let mut content = content_from_pb(
        pb::SnapshotTierBlocks {
            tier: 0,
            locals: t.locals,
            parent_back: t.parent_back,
            unheld: t.unheld,
            engines: t.engines,
            more_nodes: t.more_nodes,
            more_engines: t.more_engines,
        },
        &what,
    )?;
    let mut seen = [false; kvroute_core::index::TIERS];
    for lower in t.lower_tiers {
        let tier = cache_tier::tier_of(lower.tier)
            .filter(|tier| *tier != Tier::Device)
            .ok_or_else(|| {
                invalid(
                    what(),
                    format!("lower tier {} is no tier below the device", lower.tier),
                )
            })?;
        if std::mem::replace(&mut seen[tier.index()], true) {
            return Err(invalid(what(), format!("the {tier} tier is saved twice")));
        }
        let tier_what = || format!("target {target}, {tier} tier");
        content
            .lower_tiers
            .push((tier, content_from_pb(lower, &tier_what)?));
    }
    Ok(FleetTarget {
        target,
        captured: CapturedTarget {
            content,
            last_event_id: t.last_event_id,
        },
        engine_sequence: t.engine_sequence,
        engine_unsynced: t.engine_unsynced,
        engine_salts: t
            .salted_blocks
            .into_iter()
            .zip(t.salts)
            .map(|(h, s)| (h, std::sync::Arc::from(s)))
            .collect(),
    })
}

/// One tier's content from the snapshot's node form, checked for shape.
fn content_from_pb(
    t: pb::SnapshotTierBlocks,
    what: &dyn Fn() -> String,
) -> Result<TargetContent, InvalidState> {
    let n = t.locals.len();
    if t.parent_back.len() != n {
        return Err(invalid(what(), "parent_back and locals differ in length"));
    }
    if t.engines.len() + t.unheld.len() != n || t.more_nodes.len() != t.more_engines.len() {
        return Err(invalid(
            what(),
            "engine hashes do not match the held blocks",
        ));
    }
    let mut unheld = t.unheld.iter().copied().peekable();
    let mut engines = t.engines.iter().copied();
    let mut nodes = Vec::with_capacity(n);
    for (i, (&local, &back)) in t.locals.iter().zip(&t.parent_back).enumerate() {
        let i = i as u32;
        let parent =
            match back {
                0 => None,
                back => Some(i.checked_sub(back).ok_or_else(|| {
                    invalid(what(), format!("node {i} has a parent before node 0"))
                })?),
            };
        let engine = if unheld.peek() == Some(&i) {
            unheld.next();
            None
        } else {
            Some(
                engines
                    .next()
                    .ok_or_else(|| invalid(what(), "fewer engine hashes than held blocks"))?,
            )
        };
        nodes.push(ContentNode {
            parent,
            local,
            engine,
        });
    }
    if unheld.next().is_some() {
        return Err(invalid(what(), "unheld node indexes out of order or range"));
    }
    let content = TargetContent {
        nodes,
        more_engines: t.more_nodes.into_iter().zip(t.more_engines).collect(),
        lower_tiers: Vec::new(),
    };
    if !content.is_well_formed() {
        return Err(invalid(
            what(),
            "extra engine hashes name unheld or missing nodes",
        ));
    }
    Ok(content)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::types::KvEventsMode;

    fn worker(kv_events: KvEventsMode) -> FleetWorker {
        FleetWorker {
            worker: SavedWorker {
                registration: Registration {
                    tiers: Vec::new(),
                    worker_id: 4,
                    model: "m".into(),
                    role: WorkerRole::Aggregated,
                    endpoint: String::new(),
                    block_size: 16,
                    dp_start_rank: 0,
                    dp_size: 1,
                    total_kv_blocks: 100,
                    max_num_batched_tokens: 8192,
                    taints: Vec::new(),
                    adapters: Vec::new(),
                    loads_adapters: false,
                    lease_ttl: None,
                    kv_events,
                },
                lease_ttl: Duration::from_secs(10),
                lease_remaining: Duration::from_secs(5),
                cordoned: false,
                load: BTreeMap::new(),
                generation: 9,
            },
            source: None,
            configured: false,
        }
    }

    #[test]
    fn a_workers_kv_events_mode_survives_a_snapshot() {
        for mode in [
            KvEventsMode::Exact,
            KvEventsMode::Approximate,
            KvEventsMode::Auto,
        ] {
            let back = worker_from_pb(worker_to_pb(&worker(mode))).expect("restores");
            assert_eq!(back.worker.registration.kv_events, mode);
        }
        let mut damaged = worker_to_pb(&worker(KvEventsMode::Exact));
        damaged.kv_events = 42;
        assert!(worker_from_pb(damaged).is_err());
    }

    #[test]
    fn a_workers_adapters_survive_a_snapshot() {
        let mut saved = worker(KvEventsMode::Exact);
        saved.worker.registration.adapters = vec![
            Adapter {
                id: 5,
                name: "sql".into(),
            },
            Adapter {
                id: -1,
                name: "chat".into(),
            },
        ];
        saved.worker.registration.loads_adapters = true;
        let back = worker_from_pb(worker_to_pb(&saved)).expect("restores");
        assert_eq!(back.worker.registration, saved.worker.registration);
    }
}
