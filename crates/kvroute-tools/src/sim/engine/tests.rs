//! Unit tests of the simulated engine: cache reuse and eviction order, the
//! scheduler's admission and preemption rules, step timings and KV events.
//!
//! Kept in their own file so `engine.rs` reads as the model alone.

use super::*;

fn req(id: u64, tokens: Vec<u32>, out: usize, bs: usize) -> EngineRequest {
    let block_hashes = block_hashes(&tokens, bs);
    EngineRequest {
        id,
        tokens,
        block_hashes,
        output_length: out,
    }
}

fn small_cfg() -> EngineConfig {
    EngineConfig {
        num_blocks: 16,
        block_size: 4,
        max_num_seqs: 4,
        max_num_batched_tokens: 8,
        ..EngineConfig::default()
    }
}

fn run_to_idle(e: &mut SimEngine) -> Vec<PassOutcome> {
    let mut passes = Vec::new();
    for _ in 0..10_000 {
        if !e.has_work() {
            break;
        }
        passes.push(e.step());
    }
    passes
}

#[test]
fn timing_polynomials_match_the_mocker_defaults() {
    let c = EngineConfig::default();
    assert!((c.prefill_ms(1000) - (4.209989e-7 * 1e6 + 15.18344 + 16.50142)).abs() < 1e-9);
    assert_eq!(c.prefill_ms(0), 0.0);
    assert!((c.decode_ms(0.0) - 5.74).abs() < 1e-12);
    assert!((c.decode_ms(1.0) - (5.74 + 54.01 - 25.74)).abs() < 1e-9);
}

#[test]
fn chained_hashes_share_prefixes_only() {
    let a: Vec<u32> = (0..12).collect();
    let mut b = a.clone();
    b[9] = 99;
    let ha = block_hashes(&a, 4);
    let hb = block_hashes(&b, 4);
    assert_eq!(ha.len(), 3);
    assert_eq!(ha[..2], hb[..2]);
    assert_ne!(ha[2], hb[2]);
    // same contents at another position hash differently
    let c: Vec<u32> = (4..8).chain(0..4).collect();
    assert_ne!(block_hashes(&c, 4)[1], ha[1]);
}

#[test]
fn long_prompt_is_chunked_and_first_token_ends_last_chunk() {
    let mut e = SimEngine::new(small_cfg());
    e.enqueue(req(1, (0..20).collect(), 3, 4));
    let passes = run_to_idle(&mut e);
    // 20 tokens at 8 per step: 8, 8, 4 (+ first token), then 2 decodes.
    let prefill: Vec<usize> = passes.iter().map(|p| p.prefill_tokens).collect();
    assert_eq!(prefill, vec![8, 8, 4, 0, 0]);
    assert!(passes[2].emitted[0].first);
    assert!(passes[0].emitted.is_empty());
    assert!(passes[4].emitted[0].done);
    // prefill-only step: no decode cost
    let cfg = small_cfg();
    assert!((passes[0].duration_ms - cfg.prefill_ms(8)).abs() < 1e-9);
    assert!(!e.has_work());
}

#[test]
fn shared_prefix_is_reused_and_events_are_emitted() {
    let mut e = SimEngine::new(small_cfg());
    let a: Vec<u32> = (0..8).collect();
    e.enqueue(req(1, a.clone(), 1, 4));
    let p = run_to_idle(&mut e);
    let stored: usize = p
        .iter()
        .flat_map(|p| &p.kv_events)
        .map(|ev| match ev {
            EngineKvEvent::Stored { blocks, .. } => blocks.len(),
            EngineKvEvent::Removed { .. } => 0,
        })
        .sum();
    assert_eq!(stored, 2);
    let mut b = a.clone();
    b.extend(100..106);
    e.enqueue(req(2, b, 1, 4));
    let p = run_to_idle(&mut e);
    assert_eq!(p[0].admissions, vec![(2, 8)]);
    assert_eq!(p[0].prefill_tokens, 6);
    // the parent of the newly stored block is the cached prefix
    let hashes = block_hashes(&a, 4);
    assert!(p[0].kv_events.iter().any(|ev| matches!(
        ev,
        EngineKvEvent::Stored { parent: Some(h), .. } if *h == hashes[1]
    )));
}

#[test]
fn full_hit_still_computes_a_token() {
    let mut e = SimEngine::new(small_cfg());
    let a: Vec<u32> = (0..8).collect();
    e.enqueue(req(1, a.clone(), 1, 4));
    run_to_idle(&mut e);
    e.enqueue(req(2, a, 1, 4));
    let p = run_to_idle(&mut e);
    assert_eq!(p[0].admissions, vec![(2, 4)]);
    assert_eq!(p[0].prefill_tokens, 4);
}

#[test]
fn lru_evicts_oldest_idle_blocks_and_reports_them() {
    let cfg = EngineConfig {
        num_blocks: 4,
        block_size: 4,
        max_num_batched_tokens: 64,
        ..small_cfg()
    };
    let mut e = SimEngine::new(cfg);
    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (50..58).collect();
    let c: Vec<u32> = (90..98).collect();
    for (id, t) in [(1, a.clone()), (2, b.clone()), (3, c)] {
        e.enqueue(req(id, t, 1, 4));
        run_to_idle(&mut e);
    }
    // a's blocks were the least recently used: evicted for c
    let ha = block_hashes(&a, 4);
    assert!(!e.is_cached(ha[0]) && !e.is_cached(ha[1]));
    assert!(block_hashes(&b, 4).iter().all(|&h| e.is_cached(h)));
}

#[test]
fn cache_pressure_preempts_the_newest_and_everything_finishes() {
    let cfg = EngineConfig {
        num_blocks: 6,
        block_size: 4,
        max_num_batched_tokens: 64,
        ..small_cfg()
    };
    let mut e = SimEngine::new(cfg);
    e.enqueue(req(1, (0..8).collect(), 10, 4));
    e.enqueue(req(2, (100..108).collect(), 10, 4));
    let passes = run_to_idle(&mut e);
    let done: Vec<u64> = passes
        .iter()
        .flat_map(|p| &p.emitted)
        .filter(|t| t.done)
        .map(|t| t.request_id)
        .collect();
    assert_eq!(done.len(), 2);
    let admissions: usize = passes.iter().map(|p| p.admissions.len()).sum();
    assert!(admissions > 2, "expected a preemption and re-admission");
    assert_eq!(e.pool.num_active(), 0);
}

#[test]
fn prompt_over_budget_is_rejected_without_chunking() {
    let cfg = EngineConfig {
        enable_chunked_prefill: false,
        ..small_cfg()
    };
    let mut e = SimEngine::new(cfg);
    e.enqueue(req(1, (0..9).collect(), 1, 4));
    e.enqueue(req(2, (0..8).collect(), 1, 4));
    let p = e.step();
    assert_eq!(p.rejected, vec![1]);
    assert_eq!(p.prefill_tokens, 8);
}

#[test]
fn oversized_request_is_rejected() {
    let mut e = SimEngine::new(small_cfg());
    e.enqueue(req(1, (0..100).collect(), 1, 4));
    let p = e.step();
    assert_eq!(p.rejected, vec![1]);
    assert!(!e.has_work());
}

fn host_cfg() -> EngineConfig {
    EngineConfig {
        num_blocks: 4,
        block_size: 4,
        max_num_seqs: 4,
        max_num_batched_tokens: 64,
        host_blocks: 2,
        host_load_ms_per_block: 5.0,
        ..EngineConfig::default()
    }
}

fn events_of(passes: &[PassOutcome]) -> Vec<EngineKvEvent> {
    passes.iter().flat_map(|p| p.kv_events.clone()).collect()
}

/// The prompt `A` (two full blocks and a token) the host-tier tests cache
/// and then crowd out.
fn prompt_a() -> Vec<u32> {
    (0..9).collect()
}

/// Caches [`prompt_a`] on `e`'s device, then runs a request that takes the
/// whole device (four blocks): A's hashes, and the passes of the second.
fn cache_a_then_crowd_it_out(e: &mut SimEngine) -> (Vec<u64>, Vec<PassOutcome>) {
    let ha = block_hashes(&prompt_a(), 4);
    e.enqueue(req(1, prompt_a(), 1, 4));
    run_to_idle(e);
    assert!(e.is_cached(ha[0]) && e.is_cached(ha[1]));
    e.enqueue(req(2, (100..116).collect(), 1, 4));
    let passes = run_to_idle(e);
    (ha, passes)
}

#[test]
fn device_evictions_move_to_the_host_and_load_back_for_a_price() {
    let mut e = SimEngine::new(host_cfg());
    // A cached on the device, then B takes the whole device: A's blocks
    // are evicted into the host
    let (ha, passes) = cache_a_then_crowd_it_out(&mut e);
    assert!(!e.is_cached(ha[0]) && e.is_in_host(ha[0]) && e.is_in_host(ha[1]));
    let events = events_of(&passes);
    let host_stores: Vec<(Option<u64>, u64)> = events
        .iter()
        .filter_map(|ev| match ev {
            EngineKvEvent::Stored {
                tier: Tier::Host,
                parent,
                blocks,
            } => Some(blocks.iter().map(move |(h, _)| (*parent, *h))),
            _ => None,
        })
        .flatten()
        .collect();
    // each host store carries its parent and follows the device removal
    assert!(
        host_stores.contains(&(Some(ha[0]), ha[1])),
        "{host_stores:?}"
    );
    let removed_dev = events.iter().position(|ev| {
        matches!(ev, EngineKvEvent::Removed { tier: Tier::Device, engine_hashes } if engine_hashes.contains(&ha[0]))
    });
    let stored_host = events.iter().position(|ev| {
        matches!(ev, EngineKvEvent::Stored { tier: Tier::Host, blocks, .. } if blocks.iter().any(|b| b.0 == ha[0]))
    });
    assert!(removed_dev.is_some() && removed_dev < stored_host);
    // A again: both blocks come back from the host, no prefill for them,
    // and the step pays the load
    e.enqueue(req(3, prompt_a(), 1, 4));
    let passes = run_to_idle(&mut e);
    assert_eq!(passes[0].admissions, vec![(3, 8)]);
    assert_eq!(passes[0].host_loads, vec![(3, 8)]);
    assert_eq!(passes[0].loaded_blocks, 2);
    assert_eq!(passes[0].prefill_tokens, 1);
    let cfg = host_cfg();
    assert!((passes[0].duration_ms - (cfg.prefill_ms(1) + 2.0 * 5.0)).abs() < 1e-9);
    assert!(e.is_cached(ha[0]) && !e.is_in_host(ha[0]) && !e.is_in_host(ha[1]));
    // each loaded block leaves the host before its device store, so the
    // events never show the host over its capacity
    let events = events_of(&passes);
    let stored_dev = events.iter().position(|ev| {
        matches!(ev, EngineKvEvent::Stored { tier: Tier::Device, blocks, .. } if blocks.iter().any(|b| b.0 == ha[0]))
    });
    let removed_host = events.iter().position(|ev| {
        matches!(ev, EngineKvEvent::Removed { tier: Tier::Host, engine_hashes } if engine_hashes.contains(&ha[0]))
    });
    assert!(stored_dev.is_some() && removed_host.is_some() && removed_host < stored_dev);
}

#[test]
fn a_full_host_tier_drops_its_oldest_block() {
    let mut e = SimEngine::new(EngineConfig {
        host_blocks: 1,
        ..host_cfg()
    });
    let (ha, passes) = cache_a_then_crowd_it_out(&mut e);
    // two blocks evicted into a one-block tier: the first to arrive left
    let host: Vec<bool> = ha.iter().map(|&h| e.is_in_host(h)).collect();
    assert_eq!(host.iter().filter(|&&x| x).count(), 1);
    assert!(events_of(&passes).iter().any(|ev| matches!(
        ev,
        EngineKvEvent::Removed {
            tier: Tier::Host,
            ..
        }
    )));
}

#[test]
fn without_a_host_tier_nothing_moves() {
    let mut e = SimEngine::new(EngineConfig {
        host_blocks: 0,
        ..host_cfg()
    });
    let (_, passes) = cache_a_then_crowd_it_out(&mut e);
    assert!(
        events_of(&passes)
            .iter()
            .all(|ev| ev.tier() == Tier::Device)
    );
    assert!(passes.iter().all(|p| p.loaded_blocks == 0));
}

#[test]
fn a_host_tier_past_what_a_worker_may_declare_is_refused() {
    let most = kvroute_core::registry::RegistryLimits::default().max_tier_blocks_per_rank;
    let cfg = |host_blocks: u64| EngineConfig {
        host_blocks: host_blocks as usize,
        ..EngineConfig::default()
    };
    assert!(cfg(most).validate().is_ok());
    let refused = cfg(most + 1).validate().unwrap_err();
    assert!(refused.contains("host_blocks"), "{refused}");
    let nan = EngineConfig {
        host_load_ms_per_block: f64::NAN,
        ..EngineConfig::default()
    };
    assert!(nan.validate().is_err());
}
