//! The discrete-event loop: arrivals, routing, and the fleet's engine steps
//! in virtual time.
//!
//! It exists to turn a trace plus a routing policy into per-request timings
//! without real time passing. Two kinds of event exist: a request arriving
//! (at its trace timestamp divided by the speedup) and an engine finishing a
//! step. An idle engine with queued work starts a step at once; a busy one
//! picks up new arrivals at its next step. A step's tokens, cache events and
//! completions become visible when it ends (the router sees KV events then).
//! At equal times, step ends are handled before arrivals, and all arrivals of
//! an instant are routed before idle engines start stepping.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::Instant;

use super::engine::{EngineLoad, EngineRequest, PassOutcome, SimEngine};
use super::policy::Router;
use super::report::{EngineStats, Report, RequestOutcome};
use super::types::{FleetView, SimConfig, SimRequest};
use crate::trace::Trace;

/// Virtual time as a totally ordered key.
#[derive(Clone, Copy, Debug, PartialEq)]
struct PassEnd {
    at_ms: f64,
    engine: usize,
}

impl Eq for PassEnd {}

impl Ord for PassEnd {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: BinaryHeap is a max-heap and we want the earliest first.
        other
            .at_ms
            .total_cmp(&self.at_ms)
            .then(other.engine.cmp(&self.engine))
    }
}

impl PartialOrd for PassEnd {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Per-request bookkeeping while the replay runs.
#[derive(Clone, Debug, Default)]
struct Tracked {
    arrival_ms: f64,
    engine: usize,
    prompt_tokens: usize,
    first_token_ms: Option<f64>,
    last_token_ms: f64,
    finish_ms: Option<f64>,
    output_tokens: usize,
    reused_tokens: usize,
    rejected: bool,
}

/// Replay `trace` on a fleet of `config.workers` simulated engines, routing
/// every request with `router`. Deterministic for equal inputs (only
/// `Report::sim_secs`, the wall time, varies).
pub fn replay(trace: &Trace, config: &SimConfig, router: &mut dyn Router) -> Report {
    replay_with_progress(trace, config, router, &mut |_, _| {})
}

/// [`replay`], calling `progress(arrived, total)` as requests arrive (for a
/// progress display; it does not affect the simulation).
pub fn replay_with_progress(
    trace: &Trace,
    config: &SimConfig,
    router: &mut dyn Router,
    progress: &mut dyn FnMut(usize, usize),
) -> Report {
    let started = Instant::now();
    let workers = config.workers.max(1);
    let speedup = if config.speedup > 0.0 {
        config.speedup
    } else {
        1.0
    };
    let block_size = config.engine.block_size.max(1);
    let mut engines: Vec<SimEngine> = (0..workers)
        .map(|_| SimEngine::new(config.engine.clone()))
        .collect();
    let mut in_flight: Vec<Option<PassOutcome>> = vec![None; workers];
    let mut engine_stats = vec![EngineStats::default(); workers];
    let mut tracked: Vec<Tracked> = vec![Tracked::default(); trace.records.len()];
    let mut itl_ms: Vec<f64> = Vec::new();
    let mut heap: BinaryHeap<PassEnd> = BinaryHeap::new();
    let mut loads: Vec<EngineLoad> = Vec::with_capacity(workers);
    let mut next = 0usize;
    let arrival_of = |i: usize| trace.records[i].timestamp as f64 / speedup;

    loop {
        if next.is_multiple_of(256) {
            progress(next, trace.records.len());
        }
        let next_arrival = (next < trace.records.len()).then(|| arrival_of(next));
        let next_pass = heap.peek().map(|p| p.at_ms);
        let now = match (next_arrival, next_pass) {
            (Some(a), Some(p)) => a.min(p),
            (Some(a), None) => a,
            (None, Some(p)) => p,
            (None, None) => break,
        };

        // Steps ending now.
        while heap.peek().is_some_and(|p| p.at_ms <= now) {
            let Some(end) = heap.pop() else { break };
            let Some(outcome) = in_flight[end.engine].take() else {
                continue;
            };
            finish_pass(
                end.engine,
                now,
                outcome,
                router,
                &mut tracked,
                &mut itl_ms,
                &mut engine_stats[end.engine],
            );
        }

        // Arrivals now.
        while next < trace.records.len() && arrival_of(next) <= now {
            let record = &trace.records[next];
            let tokens = record.tokens();
            let block_hashes = super::engine::block_hashes(&tokens, block_size);
            let request = SimRequest {
                id: next as u64,
                arrival_ms: now,
                tokens,
                block_hashes,
                output_length: record.output_length,
            };
            loads.clear();
            loads.extend(engines.iter().map(SimEngine::load));
            let view = FleetView {
                engines: &loads,
                block_size,
                max_num_batched_tokens: config.engine.max_num_batched_tokens,
            };
            let target = router.route(&request, now, &view).min(workers - 1);
            let t = &mut tracked[next];
            t.arrival_ms = now;
            t.engine = target;
            t.prompt_tokens = request.tokens.len();
            engine_stats[target].requests += 1;
            engine_stats[target].prompt_tokens += request.tokens.len() as u64;
            engines[target].enqueue(EngineRequest {
                id: request.id,
                tokens: request.tokens,
                block_hashes: request.block_hashes,
                output_length: request.output_length,
            });
            next += 1;
        }

        // Idle engines with work start a step.
        for (e, engine) in engines.iter_mut().enumerate() {
            if in_flight[e].is_some() || !engine.has_work() {
                continue;
            }
            let outcome = engine.step();
            if !outcome.did_work {
                continue;
            }
            for &(id, cached) in &outcome.admissions {
                let t = &mut tracked[id as usize];
                t.reused_tokens = t.reused_tokens.max(cached);
            }
            engine_stats[e].prefill_tokens += outcome.prefill_tokens as u64;
            engine_stats[e].steps += 1;
            engine_stats[e].preemptions += outcome.preemptions as u64;
            engine_stats[e].busy_ms += outcome.duration_ms;
            heap.push(PassEnd {
                at_ms: now + outcome.duration_ms,
                engine: e,
            });
            in_flight[e] = Some(outcome);
        }
    }

    let requests: Vec<RequestOutcome> = tracked
        .iter()
        .map(|t| RequestOutcome {
            arrival_ms: t.arrival_ms,
            engine: t.engine,
            prompt_tokens: t.prompt_tokens,
            reused_tokens: t.reused_tokens,
            first_token_ms: t.first_token_ms,
            finish_ms: t.finish_ms,
            output_tokens: t.output_tokens,
            rejected: t.rejected,
        })
        .collect();
    Report::build(
        &router.name(),
        config,
        trace,
        &requests,
        itl_ms,
        engine_stats,
        started.elapsed().as_secs_f64(),
    )
}

/// Make a finished step's effects visible at `now`.
fn finish_pass(
    engine: usize,
    now: f64,
    outcome: PassOutcome,
    router: &mut dyn Router,
    tracked: &mut [Tracked],
    itl_ms: &mut Vec<f64>,
    stats: &mut EngineStats,
) {
    if !outcome.kv_events.is_empty() {
        router.on_kv_events(engine, &outcome.kv_events);
    }
    for token in &outcome.emitted {
        let t = &mut tracked[token.request_id as usize];
        if t.first_token_ms.is_none() {
            t.first_token_ms = Some(now);
        } else {
            itl_ms.push(now - t.last_token_ms);
        }
        t.last_token_ms = now;
        t.output_tokens += 1;
        if token.first {
            router.on_prefill_complete(token.request_id);
        }
        if token.done {
            t.finish_ms = Some(now);
            stats.completed += 1;
            router.on_request_complete(token.request_id);
        }
    }
    for &id in &outcome.rejected {
        tracked[id as usize].rejected = true;
        router.on_request_complete(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::policy::RoundRobin;
    use crate::trace::TraceRequest;

    fn trace(n: usize, gap_ms: u64) -> Trace {
        Trace {
            records: (0..n)
                .map(|i| TraceRequest {
                    timestamp: i as u64 * gap_ms,
                    input_length: 700,
                    output_length: 5,
                    hash_ids: vec![0, i as u64 + 1],
                })
                .collect(),
        }
    }

    #[test]
    fn single_request_ttft_is_one_prefill_step() {
        let cfg = SimConfig {
            workers: 1,
            ..SimConfig::default()
        };
        let report = replay(&trace(1, 0), &cfg, &mut RoundRobin::default());
        assert_eq!(report.completed, 1);
        let expect = cfg.engine.prefill_ms(700);
        assert!((report.ttft_ms.mean - expect).abs() < 1e-9);
        // 4 decode steps at tiny utilisation follow
        assert!(report.e2e_ms.mean > expect + 4.0 * 5.7);
    }

    #[test]
    fn speedup_compresses_arrivals() {
        let t = trace(20, 1000);
        let slow = replay(&t, &SimConfig::default(), &mut RoundRobin::default());
        let fast_cfg = SimConfig {
            speedup: 10.0,
            ..SimConfig::default()
        };
        let fast = replay(&t, &fast_cfg, &mut RoundRobin::default());
        assert_eq!(slow.completed, 20);
        assert_eq!(fast.completed, 20);
        assert!(fast.output_tok_s > slow.output_tok_s * 5.0);
    }

    #[test]
    fn second_request_reuses_the_shared_first_block_on_one_engine() {
        let cfg = SimConfig {
            workers: 1,
            ..SimConfig::default()
        };
        let report = replay(&trace(2, 10_000), &cfg, &mut RoundRobin::default());
        // hash id 0 = 512 shared tokens = 8 engine blocks
        assert_eq!(report.engines[0].requests, 2);
        assert!((report.reuse_ratio - 512.0 / 1400.0).abs() < 1e-12);
    }
}
