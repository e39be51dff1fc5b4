//! The registry's unit tests: registration rules, leases, load, snapshots.
// std's clock: the registry takes its clock as an argument; any start will do.
#![allow(clippy::disallowed_methods)]

use super::*;

/// Removes every worker whose lease lapsed by `now`, as the fleet's reaper
/// does one worker at a time.
fn reap(registry: &mut Registry, now: Instant) -> Vec<WorkerRecord> {
    registry
        .lapsed(now)
        .into_iter()
        .filter_map(|id| registry.remove_if_lapsed(id, now))
        .collect()
}

fn registration(worker_id: WorkerId, model: &str, block_size: u32) -> Registration {
    Registration {
        worker_id,
        model: model.into(),
        role: WorkerRole::Aggregated,
        endpoint: String::new(),
        block_size,
        dp_start_rank: 0,
        dp_size: 1,
        total_kv_blocks: 1000,
        max_num_batched_tokens: 8192,
        taints: vec![],
        adapters: vec![],
        loads_adapters: false,
        lease_ttl: None,
        kv_events: crate::types::KvEventsMode::Exact,
        tiers: Vec::new(),
    }
}

#[test]
fn first_worker_fixes_the_models_block_size() {
    let mut registry = Registry::new();
    let now = Instant::now();
    let ttl = Duration::from_secs(10);
    assert!(
        registry
            .register(registration(1, "m", 16), ttl, now)
            .unwrap()
            .created
    );
    let error = registry
        .register(registration(2, "m", 32), ttl, now)
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "worker 2 declares block_size 32 but model \"m\" uses block_size 16"
    );
    // Another model may use another size; the only worker of a model may change it.
    registry
        .register(registration(3, "other", 32), ttl, now)
        .unwrap();
    let outcome = registry
        .register(registration(1, "m", 64), ttl, now)
        .unwrap();
    assert!(!outcome.created);
    assert_eq!(outcome.invalidated.map(|r| r.block_size), Some(16));
}

#[test]
fn registering_again_starts_anew_keeping_the_cordon_and_renewing_the_lease() {
    let mut registry = Registry::new();
    let start = Instant::now();
    let ttl = Duration::from_secs(10);
    let first = registry
        .register(registration(1, "m", 16), ttl, start)
        .unwrap();
    registry.set_cordoned(1, true).unwrap();
    let later = start + Duration::from_secs(8);
    let outcome = registry
        .register(registration(1, "m", 16), ttl, later)
        .unwrap();
    assert!(!outcome.created);
    // Same fields, yet a new stream: the previous registration's blocks
    // and cursors go, under a new generation.
    assert_eq!(outcome.invalidated, Some(registration(1, "m", 16)));
    assert_ne!(outcome.record.generation, first.record.generation);
    let record = registry.get(1).unwrap();
    assert!(record.cordoned);
    assert_eq!(record.lease_remaining(later), ttl);
}

#[test]
fn a_configured_engine_registered_again_continues_its_streams() {
    let mut registry = Registry::new();
    let start = Instant::now();
    let ttl = Duration::from_secs(10);
    let first = registry
        .register_continuing(registration(1, "m", 16), ttl, start)
        .unwrap();
    let again = registry
        .register_continuing(registration(1, "m", 16), ttl, start)
        .unwrap();
    assert_eq!(again.invalidated, None);
    assert_eq!(again.record.generation, first.record.generation);
    // A layout change invalidates all the same.
    let moved = registry
        .register_continuing(registration(1, "m", 32), ttl, start)
        .unwrap();
    assert!(moved.invalidated.is_some());
}

#[test]
fn heartbeat_renews_and_lapsed_leases_are_reaped() {
    let mut registry = Registry::new();
    let start = Instant::now();
    let ttl = Duration::from_secs(10);
    registry
        .register(registration(1, "m", 16), ttl, start)
        .unwrap();
    registry
        .register(registration(2, "m", 16), ttl, start)
        .unwrap();
    let load = RankLoad {
        running_requests: 3,
        waiting_requests: 1,
        kv_blocks_used: 50,
    };
    registry
        .heartbeat(1, &[(0, load)], start + Duration::from_secs(9))
        .unwrap();
    assert!(matches!(
        registry.heartbeat(1, &[(5, load)], start),
        Err(RegistryError::UnknownRank { dp_rank: 5, .. })
    ));
    let reaped = reap(&mut registry, start + Duration::from_secs(10));
    assert_eq!(reaped.len(), 1);
    assert_eq!(reaped[0].registration.worker_id, 2);
    assert_eq!(registry.get(1).unwrap().snapshot().rank_load(0), load);
    assert!(reap(&mut registry, start + Duration::from_secs(18)).is_empty());
    assert_eq!(
        reap(&mut registry, start + Duration::from_secs(19)).len(),
        1
    );
}

#[test]
fn snapshots_follow_every_change() {
    let mut registry = Registry::new();
    let now = Instant::now();
    let ttl = Duration::from_secs(10);
    registry
        .register(registration(2, "m", 16), ttl, now)
        .unwrap();
    registry
        .register(registration(1, "m", 16), ttl, now)
        .unwrap();
    let ids =
        |r: &Registry| -> Vec<u64> { r.model_snapshots("m").iter().map(|w| w.worker_id).collect() };
    assert_eq!(ids(&registry), vec![1, 2]);
    registry.set_cordoned(2, true).unwrap();
    assert!(registry.model_snapshots("m")[1].cordoned);
    let load = RankLoad {
        running_requests: 7,
        ..RankLoad::default()
    };
    registry.heartbeat(1, &[(0, load)], now).unwrap();
    assert_eq!(registry.model_snapshots("m")[0].rank_load(0), load);
    // Moving a worker to another model moves its snapshot.
    registry
        .register(registration(1, "other", 32), ttl, now)
        .unwrap();
    assert_eq!(ids(&registry), vec![2]);
    assert_eq!(registry.model_snapshots("other").len(), 1);
    registry.deregister(2).unwrap();
    assert!(registry.model_snapshots("m").is_empty());
    reap(&mut registry, now + ttl);
    assert!(registry.model_snapshots("other").is_empty());
}

#[test]
fn invalid_registrations_are_refused() {
    let mut registry = Registry::new();
    let now = Instant::now();
    let ttl = Duration::from_secs(10);
    assert!(
        registry
            .register(registration(1, "m", 0), ttl, now)
            .is_err()
    );
    let mut many = registration(1, "m", 16);
    many.dp_size = MAX_DP_SIZE + 1;
    assert!(registry.register(many, ttl, now).is_err());
    let mut overflow = registration(1, "m", 16);
    overflow.dp_start_rank = u32::MAX;
    overflow.dp_size = 2;
    assert!(registry.register(overflow, ttl, now).is_err());
    // A caller's numbers do not decide how long it is remembered or how
    // large its blocks are.
    let mut forever = registration(1, "m", 16);
    forever.lease_ttl = Some(MAX_LEASE_TTL + Duration::from_secs(1));
    let refused = registry
        .register(forever, ttl, now)
        .expect_err("lease too long");
    assert!(
        refused.to_string().contains("lease_ttl_secs 3601"),
        "{refused}"
    );
    let mut huge = registration(1, "m", MAX_BLOCK_SIZE + 1);
    huge.lease_ttl = Some(MAX_LEASE_TTL);
    let refused = registry
        .register(huge, ttl, now)
        .expect_err("block too large");
    assert!(
        refused.to_string().contains("block_size 65537"),
        "{refused}"
    );
    assert_eq!(registry.all().len(), 0);
    let mut longest = registration(1, "m", MAX_BLOCK_SIZE);
    longest.lease_ttl = Some(MAX_LEASE_TTL);
    assert!(registry.register(longest, ttl, now).is_ok());
}

/// #38: an APPROXIMATE worker's predicted cache took about 106 bytes a
/// declared block, over the 96 the index memory budget counts. At capacity
/// (filled, then turned over eight times, evicting as it goes, so deletions
/// leave tombstones that make the table grow early), its tables as
/// allocated stay under the budget's figure. Each cache draws its own hash
/// seed, so the rounds try several layouts.
#[test]
fn a_full_predicted_cache_takes_less_than_the_budgeted_bytes_a_block() {
    use crate::predict::PredictedCaches;
    let target = crate::types::WorkerRank::new(1, 0);
    for capacity in [1_000u64, 1_800, 4_096, 40_000, 1 << 16] {
        for _round in 0..4 {
            let mut caches = PredictedCaches::new(None);
            let mut next = 0u64;
            let mut worst = 0.0f64;
            let mut record = |caches: &mut PredictedCaches| {
                let prompt: Vec<u64> = (next..next + 64).collect();
                next += 64;
                caches.record(target, &prompt, capacity, 0);
            };
            while caches.blocks(target) < capacity {
                record(&mut caches);
            }
            for _ in 0..8 * capacity / 64 {
                record(&mut caches);
                assert_eq!(caches.blocks(target), capacity);
                let per_block = caches.table_bytes(target) as f64 / capacity as f64;
                worst = worst.max(per_block);
            }
            assert!(
                worst < INDEX_BYTES_PER_BLOCK as f64,
                "{worst:.1} bytes a block at capacity {capacity}"
            );
        }
    }
}

#[test]
fn a_lease_renewed_elsewhere_ends_when_that_one_does() {
    let mut registry = Registry::new();
    let start = Instant::now();
    let ttl = Duration::from_secs(10);
    registry
        .register(registration(1, "m", 16), ttl, start)
        .unwrap();
    // Another replica's heartbeat left 4 s: not a whole TTL from now.
    registry
        .renew_until(1, &[], Duration::from_secs(4), start)
        .unwrap();
    assert_eq!(
        registry.get(1).unwrap().lease_remaining(start),
        Duration::from_secs(4)
    );
    // Never past the TTL, whatever the entry claims.
    registry
        .renew_until(1, &[], Duration::from_secs(3600), start)
        .unwrap();
    assert_eq!(registry.get(1).unwrap().lease_remaining(start), ttl);
}

#[test]
fn a_restored_worker_keeps_its_generation_and_later_ones_stay_above() {
    let mut saved_from = Registry::new();
    let start = Instant::now();
    saved_from.set_next_generation(41);
    saved_from
        .register(registration(1, "m", 16), Duration::from_secs(10), start)
        .unwrap();
    let saved = saved_from.get(1).unwrap().saved(start);
    assert_eq!(saved.generation, 41);
    let mut restored = Registry::new();
    restored.restore(saved, start).unwrap();
    assert_eq!(restored.get(1).unwrap().generation, 41);
    restored
        .register(registration(2, "m", 16), Duration::from_secs(10), start)
        .unwrap();
    assert!(restored.get(2).unwrap().generation > 41);
}

fn tier(tier: crate::types::Tier, capacity_blocks: u64) -> TierSpec {
    TierSpec {
        tier,
        capacity_blocks,
        prefill_saving: None,
    }
}

#[test]
fn declared_tiers_are_checked_and_count_against_the_budget() {
    use crate::types::Tier;
    let limits = RegistryLimits {
        index_memory_budget: 10_000 * crate::registry::limits::INDEX_BYTES_PER_BLOCK,
        max_tier_blocks_per_rank: 8_000,
        ..RegistryLimits::default()
    };
    let now = Instant::now();
    let ttl = Duration::from_secs(10);
    let refused = |tiers: Vec<TierSpec>| {
        let mut registry = Registry::with_limits(limits);
        let mut r = registration(1, "m", 16);
        r.tiers = tiers;
        registry.register(r, ttl, now).err()
    };
    // Malformed declarations: INVALID_ARGUMENT, whatever the limits.
    for bad in [
        vec![tier(Tier::Device, 10)],
        vec![tier(Tier::Host, 10), tier(Tier::Host, 20)],
        vec![TierSpec {
            prefill_saving: Some(f64::NAN),
            ..tier(Tier::Host, 10)
        }],
        vec![TierSpec {
            prefill_saving: Some(1.5),
            ..tier(Tier::Storage, 10)
        }],
    ] {
        assert!(
            matches!(refused(bad.clone()), Some(RegistryError::Invalid { .. })),
            "{bad:?}"
        );
    }
    // Past a server limit: the per-tier maximum, then the budget, which
    // counts the device (1000) and every tier.
    assert!(matches!(
        refused(vec![tier(Tier::Host, 1 << 63)]),
        Some(RegistryError::LimitReached {
            limit: "max_tier_blocks_per_rank",
            ..
        })
    ));
    assert!(matches!(
        refused(vec![tier(Tier::Host, 8_000), tier(Tier::Storage, 1_500)]),
        Some(RegistryError::LimitReached {
            limit: "index_memory_budget",
            ..
        })
    ));
    assert_eq!(
        refused(vec![tier(Tier::Host, 0), tier(Tier::Storage, 8_000)]),
        None,
        "a zero capacity is a tier kept empty; 9,000 blocks fit"
    );
}
