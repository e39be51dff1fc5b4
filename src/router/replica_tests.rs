//! Router replicas that learn of each other's bookings late: with
//! `RouterConfig::replicas` set, a burst routed by three replicas from the
//! same view spreads as one router spreads it (`admission::peers`).

use std::{collections::BTreeSet, time::Duration};

use super::{PreparedRequest, ReplicaSettings, RouterConfig, RouterCore};
use crate::metrics::Metrics;
use kvroute_core::{
    admission::{AdmissionMode, bookings::SavedBooking},
    registry::Registration,
    select::{SelectMode, SelectRequest, Selection},
    types::{WorkerId, WorkerRank, WorkerRole},
};

const MODEL: &str = "m";
const WORKERS: u64 = 6;

fn core(replicas: ReplicaSettings) -> RouterCore {
    let config = RouterConfig {
        seed: 7,
        replicas,
        ..RouterConfig::default()
    };
    let core = RouterCore::with_manual_clock(config, Metrics::new().expect("metrics"));
    for worker_id in 1..=WORKERS {
        core.register_worker(Registration {
            tiers: Vec::new(),
            worker_id,
            model: MODEL.into(),
            role: WorkerRole::Aggregated,
            endpoint: String::new(),
            block_size: 16,
            dp_start_rank: 0,
            dp_size: 1,
            total_kv_blocks: 1000,
            max_num_batched_tokens: 8192,
            taints: Vec::new(),
            adapters: Vec::new(),
            loads_adapters: false,
            lease_ttl: Some(Duration::from_secs(3600)),
            kv_events: kvroute_core::types::KvEventsMode::Exact,
        })
        .expect("registers");
    }
    // Load every replica already knows of: worker k has k - 1 blocks of
    // prefill booked, so one router fills worker 1, 2, ... in turn.
    let known = (1..=WORKERS)
        .map(|k| SavedBooking {
            request_id: format!("earlier{k}"),
            target: WorkerRank::new(k, 0),
            prefill: Some((16 * (k - 1), k - 1)),
            keys: Vec::new(),
            age_ms: 0,
            owner: None,
        })
        .collect();
    assert_eq!(core.restore_routing(Vec::new(), known), 0);
    core
}

/// Request `n`: 8 blocks of its own (nothing cached anywhere), more than
/// the differences between the workers' earlier load.
fn request(n: u64, mode: SelectMode) -> PreparedRequest {
    PreparedRequest {
        owner: None,
        request: SelectRequest {
            request_id: format!("r{n}"),
            model: MODEL.into(),
            prompt_tokens: 8 * 16,
            block_size: 16,
            mode,
            ..SelectRequest::default()
        },
        hashes: (0..8).map(|b| 1000 * n + b).collect(),
        admission: AdmissionMode::Wait,
    }
}

fn route(core: &RouterCore, n: u64) -> WorkerId {
    core.route_unqueued(request(n, SelectMode::Reserve))
        .expect("routes")
        .selection
        .target
        .worker_id
}

fn replica(index: u32, sync_delay: Duration) -> ReplicaSettings {
    ReplicaSettings {
        count: 3,
        index,
        sync_delay,
    }
}

/// Routes `burst` requests at one instant, request `i` by replica
/// `i % replicas.len()`, none hearing of the others' bookings.
fn burst(replicas: &[RouterCore], burst: u64) -> Vec<WorkerId> {
    (0..burst)
        .map(|i| route(&replicas[(i % replicas.len() as u64) as usize], i))
        .collect()
}

fn distinct(targets: &[WorkerId]) -> usize {
    targets.iter().collect::<BTreeSet<_>>().len()
}

#[test]
fn a_burst_over_three_replicas_spreads_as_one_router_spreads_it() {
    let one = burst(&[core(ReplicaSettings::default())], 6);
    assert_eq!(one, [1, 2, 3, 4, 5, 6], "one router");

    let blind: Vec<RouterCore> = (0..3).map(|_| core(ReplicaSettings::default())).collect();
    let blind = burst(&blind, 6);
    assert_eq!(
        distinct(&blind),
        2,
        "replicas that count only their own bookings choose alike: {blind:?}"
    );

    let aware: Vec<RouterCore> = (0..3)
        .map(|i| core(replica(i, Duration::from_millis(2))))
        .collect();
    let aware = burst(&aware, 6);
    assert_eq!(aware, one, "replicas that estimate their peers' load");
}

#[test]
fn estimates_count_until_the_sync_delay_has_passed() {
    // Replica 0 of 3 routes r0 at 0 ms and estimates two peer copies of
    // it: three workers count as loaded while the estimate lasts (2 ms),
    // then only r0's own.
    let replica = core(replica(0, Duration::from_millis(2)));
    let blind = core(ReplicaSettings::default());
    let first = route(&replica, 0);
    assert_eq!(route(&blind, 0), first, "place 0 is one router's choice");
    let loaded_at = |ms: u64| {
        replica.set_clock_ms(ms);
        let preview = explain(&replica, &request(1, SelectMode::QueryOnly));
        let loaded: BTreeSet<WorkerId> = preview
            .candidates
            .iter()
            .filter(|c| c.booked.active_requests > 1) // beyond the earlier load
            .map(|c| c.target.worker_id)
            .collect();
        assert!(
            !loaded.contains(&preview.target.worker_id),
            "{ms} ms: chose a loaded worker"
        );
        loaded
    };
    let during = loaded_at(1);
    assert_eq!(during.len(), 3, "r0 and its two peer copies: {during:?}");
    assert_eq!(
        during,
        BTreeSet::from([1, 2, 3]),
        "one router's first three"
    );
    assert_eq!(loaded_at(2), BTreeSet::from([first]), "the copies aged out");
    // A RESERVE decides as its preview did.
    let preview = explain(&replica, &request(1, SelectMode::QueryOnly));
    assert_eq!(route(&replica, 1), preview.target.worker_id);
}

#[test]
fn one_replica_or_no_delay_routes_as_one_router() {
    let plain: Vec<WorkerId> = burst(&[core(ReplicaSettings::default())], 12);
    for settings in [
        ReplicaSettings {
            count: 1,
            index: 0,
            sync_delay: Duration::from_millis(5),
        },
        replica(2, Duration::ZERO),
    ] {
        assert!(!settings.estimates_peers());
        assert_eq!(settings.horizon_ms(), 0);
        assert_eq!(burst(&[core(settings)], 12), plain, "{settings:?}");
    }
}

#[test]
fn the_horizon_rounds_the_delay_up_to_whole_milliseconds() {
    assert_eq!(replica(0, Duration::from_micros(300)).horizon_ms(), 1);
    assert_eq!(replica(0, Duration::from_millis(2)).horizon_ms(), 2);
    assert_eq!(replica(0, Duration::from_micros(2001)).horizon_ms(), 3);
}

/// The decision `core` would make for `prepared`, explained.
fn explain(core: &RouterCore, prepared: &PreparedRequest) -> Selection {
    core.explain(&core.model_view(&prepared.request.model), prepared)
        .expect("explains")
}
