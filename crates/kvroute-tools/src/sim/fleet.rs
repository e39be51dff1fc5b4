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
use super::report::{EngineStats, PredictionAccuracy, PredictionErrors, Report, RequestOutcome};
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
    host_reused_tokens: usize,
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
    let mut run = Replay::new(trace, config, router);
    loop {
        if run.next.is_multiple_of(256) {
            progress(run.next, trace.records.len());
        }
        let Some(now) = run.next_event_ms() else {
            break;
        };
        run.finish_passes(now);
        run.route_arrivals(now);
        run.start_idle_engines(now);
    }
    run.into_report(started)
}

/// The state of one replay: the engines, the steps in flight and what each
/// request went through so far.
struct Replay<'a> {
    trace: &'a Trace,
    config: &'a SimConfig,
    router: &'a mut dyn Router,
    /// Arrival times are trace timestamps divided by this (positive).
    speedup: f64,
    block_size: usize,
    engines: Vec<SimEngine>,
    /// The step each engine is running, if any; it ends at its `PassEnd`.
    in_flight: Vec<Option<PassOutcome>>,
    heap: BinaryHeap<PassEnd>,
    engine_stats: Vec<EngineStats>,
    /// Per request, indexed like the trace.
    tracked: Vec<Tracked>,
    itl_ms: Vec<f64>,
    /// Scratch for the routing view (reused to avoid an allocation per
    /// request).
    loads: Vec<EngineLoad>,
    /// Index of the next request to arrive.
    next: usize,
}

impl<'a> Replay<'a> {
    fn new(trace: &'a Trace, config: &'a SimConfig, router: &'a mut dyn Router) -> Self {
        let workers = config.workers.max(1);
        Replay {
            trace,
            config,
            router,
            speedup: if config.speedup > 0.0 {
                config.speedup
            } else {
                1.0
            },
            block_size: config.engine.block_size.max(1),
            engines: (0..workers)
                .map(|_| SimEngine::new(config.engine.clone()))
                .collect(),
            in_flight: vec![None; workers],
            heap: BinaryHeap::new(),
            engine_stats: vec![EngineStats::default(); workers],
            tracked: vec![Tracked::default(); trace.records.len()],
            itl_ms: Vec::new(),
            loads: Vec::with_capacity(workers),
            next: 0,
        }
    }

    fn arrival_ms(&self, i: usize) -> f64 {
        self.trace.records[i].timestamp as f64 / self.speedup
    }

    /// Virtual time of the next event (an arrival or a step end); `None`
    /// when every request arrived and every step ended.
    fn next_event_ms(&self) -> Option<f64> {
        let next_arrival =
            (self.next < self.trace.records.len()).then(|| self.arrival_ms(self.next));
        let next_pass = self.heap.peek().map(|p| p.at_ms);
        match (next_arrival, next_pass) {
            (Some(a), Some(p)) => Some(a.min(p)),
            (Some(a), None) => Some(a),
            (None, Some(p)) => Some(p),
            (None, None) => None,
        }
    }

    /// Steps ending at or before `now` make their effects visible.
    fn finish_passes(&mut self, now: f64) {
        while self.heap.peek().is_some_and(|p| p.at_ms <= now) {
            let Some(end) = self.heap.pop() else { break };
            let Some(outcome) = self.in_flight[end.engine].take() else {
                continue;
            };
            self.finish_pass(end.engine, now, outcome);
        }
    }

    /// Make a finished step's effects visible at `now`.
    fn finish_pass(&mut self, engine: usize, now: f64, outcome: PassOutcome) {
        if !outcome.kv_events.is_empty() {
            self.router.on_kv_events(engine, &outcome.kv_events, now);
        }
        for token in &outcome.emitted {
            let t = &mut self.tracked[token.request_id as usize];
            if t.first_token_ms.is_none() {
                t.first_token_ms = Some(now);
            } else {
                self.itl_ms.push(now - t.last_token_ms);
            }
            t.last_token_ms = now;
            t.output_tokens += 1;
            if token.first {
                let cached = t.reused_tokens as u64;
                self.router
                    .on_prefill_complete(token.request_id, now, cached);
            }
            if token.done {
                t.finish_ms = Some(now);
                self.engine_stats[engine].completed += 1;
                self.router.on_request_complete(token.request_id, now);
            }
        }
        for &id in &outcome.rejected {
            self.tracked[id as usize].rejected = true;
            self.router.on_request_complete(id, now);
        }
    }

    /// Requests arriving at or before `now` are routed and queued on their
    /// engine, in trace order.
    fn route_arrivals(&mut self, now: f64) {
        while self.next < self.trace.records.len() && self.arrival_ms(self.next) <= now {
            self.route_next(now);
            self.next += 1;
        }
    }

    /// Route request `self.next` at `now` with the fleet's current load.
    fn route_next(&mut self, now: f64) {
        let record = &self.trace.records[self.next];
        let tokens = record.tokens();
        let block_hashes = super::engine::block_hashes(&tokens, self.block_size);
        let request = SimRequest {
            id: self.next as u64,
            arrival_ms: now,
            tokens,
            block_hashes,
            output_length: record.output_length,
        };
        self.loads.clear();
        self.loads.extend(self.engines.iter().map(SimEngine::load));
        let view = FleetView {
            engines: &self.loads,
            block_size: self.block_size,
            max_num_batched_tokens: self.config.engine.max_num_batched_tokens,
        };
        let target = self
            .router
            .route(&request, now, &view)
            .min(self.engines.len() - 1);
        let t = &mut self.tracked[self.next];
        // The request arrived the decision's wait before it can go (see
        // `Router::decision_delay_ms`): its TTFT counts the wait.
        t.arrival_ms = now - self.router.decision_delay_ms();
        t.engine = target;
        t.prompt_tokens = request.tokens.len();
        self.engine_stats[target].requests += 1;
        self.engine_stats[target].prompt_tokens += request.tokens.len() as u64;
        self.engines[target].enqueue(EngineRequest {
            id: request.id,
            tokens: request.tokens,
            block_hashes: request.block_hashes,
            output_length: request.output_length,
        });
    }

    /// Idle engines with work start a step at `now`.
    fn start_idle_engines(&mut self, now: f64) {
        for (e, engine) in self.engines.iter_mut().enumerate() {
            if self.in_flight[e].is_some() || !engine.has_work() {
                continue;
            }
            let outcome = engine.step();
            if !outcome.did_work {
                continue;
            }
            for &(id, cached) in &outcome.admissions {
                let t = &mut self.tracked[id as usize];
                // the admission that found the most (a preempted request is
                // admitted again), and its host loads
                if cached >= t.reused_tokens {
                    t.reused_tokens = cached;
                    t.host_reused_tokens = outcome
                        .host_loads
                        .iter()
                        .find(|(h, _)| *h == id)
                        .map_or(0, |&(_, tokens)| tokens);
                }
            }
            let stats = &mut self.engine_stats[e];
            stats.prefill_tokens += outcome.prefill_tokens as u64;
            stats.steps += 1;
            stats.preemptions += outcome.preemptions as u64;
            stats.busy_ms += outcome.duration_ms;
            self.heap.push(PassEnd {
                at_ms: now + outcome.duration_ms,
                engine: e,
            });
            self.in_flight[e] = Some(outcome);
        }
    }

    /// The report of the finished replay; `started` is when it began (wall
    /// time, for `sim_secs` only).
    fn into_report(self, started: Instant) -> Report {
        let requests: Vec<RequestOutcome> = self
            .tracked
            .iter()
            .map(|t| RequestOutcome {
                arrival_ms: t.arrival_ms,
                engine: t.engine,
                prompt_tokens: t.prompt_tokens,
                reused_tokens: t.reused_tokens,
                host_reused_tokens: t.host_reused_tokens,
                first_token_ms: t.first_token_ms,
                finish_ms: t.finish_ms,
                output_tokens: t.output_tokens,
                rejected: t.rejected,
            })
            .collect();
        let report = Report::build(
            &self.router.name(),
            self.config,
            self.trace,
            &requests,
            self.itl_ms,
            self.engine_stats,
            started.elapsed().as_secs_f64(),
        );
        let predictions = self.router.ttft_predictions();
        let cached = self.router.cached_token_predictions();
        Report {
            replicas: self.router.replicas(),
            divergent_decisions: self.router.divergent_decisions(),
            cached_prediction: (!cached.is_empty()).then(|| PredictionErrors::of(&cached)),
            ttft_prediction: (!predictions.is_empty())
                .then(|| PredictionAccuracy::of(&predictions)),
            ..report
        }
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
