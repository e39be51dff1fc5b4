//! Floors on time to first token, from the trace alone under the engines'
//! prefill timing, to judge a policy's tail against what the trace allows.
//!
//! Every floor serves each request the moment it arrives: no queueing, no
//! decode tokens sharing its steps, its uncached prompt prefilled in chunks
//! of the step budget. They differ only in what is cached when it arrives:
//! * `infinite cache`: every prefix the trace showed before. No router can
//!   beat it; it is the bound of the tail-routing issue.
//! * `fleet LRU cache`: one cache as large as the whole fleet's, evicting
//!   the least recently used block, as each engine does. It is what the
//!   engines' own eviction keeps when placement costs nothing (no prefix
//!   lost to another worker, none held twice). Routing can only move a
//!   fleet towards it, except by starving some engine of traffic to keep
//!   its cache warm, which balancing forbids; so it is a reference, not a
//!   proof.
//! * `fleet cache, furthest next use`: the same capacity with Belady's
//!   eviction, which knows the future. No engine evicts that way; the gap
//!   to the LRU floor is what eviction, not routing, could win.
//!
//! Blocks are the trace's 512-token blocks, chained as in
//! [`Trace::ideal_reuse`] ([`crate::trace::TraceRequest::chained_blocks`]);
//! a prompt found whole still computes one token.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::engine::EngineConfig;
use super::report::Distribution;
use crate::trace::{TRACE_BLOCK_TOKENS, Trace};

/// What the floor's cache keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheModel {
    Infinite,
    FleetLru,
    FleetFurthestNextUse,
}

impl CacheModel {
    pub const ALL: [CacheModel; 3] = [
        CacheModel::Infinite,
        CacheModel::FleetLru,
        CacheModel::FleetFurthestNextUse,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            CacheModel::Infinite => "infinite cache",
            CacheModel::FleetLru => "fleet LRU cache",
            CacheModel::FleetFurthestNextUse => "fleet cache, furthest next use",
        }
    }
}

/// One floor: the TTFT distribution and the reuse it implies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftFloor {
    pub model: CacheModel,
    pub ttft_ms: Distribution,
    /// Cached prompt tokens over all prompt tokens.
    pub reuse_ratio: f64,
}

/// A request's prompt as chained trace blocks with their token counts.
struct Prompt {
    input_tokens: usize,
    blocks: Vec<(u64, usize)>,
}

fn prompts(trace: &Trace) -> Vec<Prompt> {
    trace
        .records
        .iter()
        .map(|r| Prompt {
            input_tokens: r.input_length,
            blocks: r.chained_blocks(),
        })
        .collect()
}

/// ms to prefill `tokens` uncached prompt tokens alone on an idle engine.
pub(crate) fn solo_prefill_ms(engine: &EngineConfig, tokens: usize) -> f64 {
    if !engine.enable_chunked_prefill {
        return engine.prefill_ms(tokens);
    }
    let step = engine.max_num_batched_tokens.max(1);
    let full = tokens / step;
    full as f64 * engine.prefill_ms(step) + engine.prefill_ms(tokens % step)
}

/// The floors of `trace` for `workers` engines configured as `engine`.
pub(crate) fn ttft_floors(trace: &Trace, engine: &EngineConfig, workers: usize) -> Vec<TtftFloor> {
    let prompts = prompts(trace);
    // Flags set these; a product past usize means room for everything.
    let capacity_tokens = workers
        .max(1)
        .saturating_mul(engine.num_blocks)
        .saturating_mul(engine.block_size);
    let capacity_blocks = capacity_tokens / TRACE_BLOCK_TOKENS;
    let total: usize = prompts.iter().map(|p| p.input_tokens).sum();
    CacheModel::ALL
        .iter()
        .map(|&model| {
            let cached = cached_tokens(&prompts, model, capacity_blocks);
            let hits: usize = cached.iter().sum();
            let ttfts = prompts
                .iter()
                .zip(&cached)
                .map(|(p, &c)| solo_prefill_ms(engine, p.input_tokens - c))
                .collect();
            TtftFloor {
                model,
                ttft_ms: Distribution::of(ttfts),
                reuse_ratio: if total == 0 {
                    0.0
                } else {
                    hits as f64 / total as f64
                },
            }
        })
        .collect()
}

/// Prompt tokens each request finds cached (its leading cached blocks, at
/// most all but one token) under `model` with room for `capacity` blocks.
fn cached_tokens(prompts: &[Prompt], model: CacheModel, capacity: usize) -> Vec<usize> {
    // When each reference to a block is next referenced (usize::MAX: never),
    // for furthest-next-use eviction.
    let next_use = match model {
        CacheModel::FleetFurthestNextUse => next_uses(prompts),
        _ => Vec::new(),
    };
    // Block -> eviction priority (lowest goes first); the heap holds stale
    // entries, skipped when their priority no longer matches.
    let mut cache: HashMap<u64, usize, rustc_hash::FxBuildHasher> = HashMap::default();
    let mut heap: BinaryHeap<Reverse<(usize, u64)>> = BinaryHeap::new();
    let mut reference = 0usize;
    let mut out = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let hit: usize = prompt
            .blocks
            .iter()
            .take_while(|(key, _)| cache.contains_key(key))
            .map(|&(_, tokens)| tokens)
            .sum();
        out.push(hit.min(prompt.input_tokens.saturating_sub(1)));
        for &(key, _) in &prompt.blocks {
            let priority = match model {
                CacheModel::Infinite | CacheModel::FleetLru => reference,
                CacheModel::FleetFurthestNextUse => usize::MAX - next_use[reference],
            };
            reference += 1;
            cache.insert(key, priority);
            if model != CacheModel::Infinite {
                heap.push(Reverse((priority, key)));
            }
        }
        if model == CacheModel::Infinite {
            continue;
        }
        while cache.len() > capacity {
            let Some(Reverse((priority, key))) = heap.pop() else {
                break;
            };
            if cache.get(&key) == Some(&priority) {
                cache.remove(&key);
            }
        }
    }
    out
}

/// For every block reference in trace order, the index of the next
/// reference to the same block (`usize::MAX` if none).
fn next_uses(prompts: &[Prompt]) -> Vec<usize> {
    let keys: Vec<u64> = prompts
        .iter()
        .flat_map(|p| p.blocks.iter().map(|&(key, _)| key))
        .collect();
    let mut next = vec![usize::MAX; keys.len()];
    let mut seen: HashMap<u64, usize, rustc_hash::FxBuildHasher> = HashMap::default();
    for (i, key) in keys.iter().enumerate().rev() {
        if let Some(later) = seen.insert(*key, i) {
            next[i] = later;
        }
    }
    next
}

/// The floors as text lines under the replay table.
pub(crate) fn table(floors: &[TtftFloor], workers: usize) -> String {
    let mut out = format!(
        "TTFT floors, from the trace alone ({workers} engines' cache; no queueing, no decode in the steps):\n"
    );
    for f in floors {
        out.push_str(&format!(
            "  {:<31} p50 {:>6.0}  p90 {:>6.0}  p99 {:>6.0} ms  reuse {:.3}\n",
            f.model.name(),
            f.ttft_ms.p50,
            f.ttft_ms.p90,
            f.ttft_ms.p99,
            f.reuse_ratio
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceRequest;

    fn rec(timestamp: u64, input_length: usize, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp,
            input_length,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    /// An engine whose fleet cache holds exactly `blocks` trace blocks.
    fn engine_holding(blocks: usize) -> EngineConfig {
        EngineConfig {
            num_blocks: blocks * TRACE_BLOCK_TOKENS / 64,
            block_size: 64,
            ..EngineConfig::default()
        }
    }

    fn cached(trace: &Trace, model: CacheModel, blocks: usize) -> Vec<usize> {
        cached_tokens(&prompts(trace), model, blocks)
    }

    #[test]
    fn solo_prefill_is_full_steps_plus_the_remainder() {
        let e = EngineConfig::default();
        let one = e.prefill_ms(8192);
        assert!(
            (solo_prefill_ms(&e, 8192 * 3 + 100) - (3.0 * one + e.prefill_ms(100))).abs() < 1e-9
        );
        assert_eq!(solo_prefill_ms(&e, 0), 0.0);
        let whole = EngineConfig {
            enable_chunked_prefill: false,
            ..EngineConfig::default()
        };
        assert!((solo_prefill_ms(&whole, 20_000) - whole.prefill_ms(20_000)).abs() < 1e-9);
    }

    #[test]
    fn a_repeated_prompt_is_found_whole_but_one_token_in_an_infinite_cache() {
        let t = Trace {
            records: vec![
                rec(0, 1024, &[1, 2]),
                rec(1, 1024, &[1, 2]),
                rec(2, 700, &[1, 3]),
            ],
        };
        assert_eq!(cached(&t, CacheModel::Infinite, 0), vec![0, 1023, 512]);
    }

    #[test]
    fn lru_evicts_the_least_recently_used_block() {
        // Room for 2 blocks: 1, 2, then 1 again makes 2 the least recently
        // used, so 3 evicts it: 1 still hits, 2 misses.
        let t = Trace {
            records: vec![
                rec(0, 512, &[1]),
                rec(1, 512, &[2]),
                rec(2, 512, &[1]),
                rec(3, 512, &[3]),
                rec(4, 512, &[1]),
                rec(5, 512, &[2]),
            ],
        };
        assert_eq!(
            cached(&t, CacheModel::FleetLru, 2),
            vec![0, 0, 511, 0, 511, 0]
        );
        assert_eq!(
            cached(&t, CacheModel::Infinite, 2),
            vec![0, 0, 511, 0, 511, 511]
        );
    }

    #[test]
    fn furthest_next_use_keeps_what_comes_back_soonest() {
        // Room for 1 block: after [1] and [2], LRU holds 2, furthest-next-use
        // keeps 1 (needed next) and drops 2 (never needed again).
        let t = Trace {
            records: vec![rec(0, 512, &[1]), rec(1, 512, &[2]), rec(2, 513, &[1, 7])],
        };
        assert_eq!(cached(&t, CacheModel::FleetLru, 1)[2], 0);
        assert_eq!(cached(&t, CacheModel::FleetFurthestNextUse, 1)[2], 512);
    }

    #[test]
    fn floors_order_infinite_then_furthest_next_use_then_lru() {
        let mut records = Vec::new();
        for i in 0..200u64 {
            // Conversations 0..9 come back in turn; each turn adds a block.
            let conv = i % 10;
            let turn = i / 10;
            let ids: Vec<u64> = (0..=turn).map(|b| conv * 1000 + b).collect();
            records.push(rec(i, ids.len() * 512, &ids));
        }
        let t = Trace { records };
        let floors = ttft_floors(&t, &engine_holding(40), 1);
        let p = |m: CacheModel| floors.iter().find(|f| f.model == m).map(|f| f.ttft_ms.mean);
        let (inf, opt, lru) = (
            p(CacheModel::Infinite).unwrap_or(f64::NAN),
            p(CacheModel::FleetFurthestNextUse).unwrap_or(f64::NAN),
            p(CacheModel::FleetLru).unwrap_or(f64::NAN),
        );
        assert!(inf <= opt && opt <= lru, "{inf} {opt} {lru}");
        assert!(inf < lru, "the small cache must cost something");
    }
}
