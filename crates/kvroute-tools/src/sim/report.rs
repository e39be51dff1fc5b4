//! Replay results: latency distributions, throughput, cache reuse and load
//! balance for one policy, as a struct, a JSON object and a text table.
//!
//! It exists so every policy is summarised by the same definitions:
//! * TTFT: arrival to the end of the step that produced the first token.
//! * E2E: arrival to the last token. ITL: gaps between a request's
//!   consecutive tokens, pooled over all requests.
//! * Throughput: tokens over the simulated span (first arrival to last token).
//! * Reuse: prompt tokens found cached at admission / prompt tokens (a
//!   preempted and re-admitted request counts its best admission).
//! * Ideal reuse: infinite shared cache at 512-token granularity
//!   (`Trace::ideal_reuse`), on the TOKEN basis like `reuse_ratio`: 0.3736
//!   on the conversation trace. The block basis (0.3664, the manifest's
//!   "0.366") is kept in `ideal_reuse_ratio_blocks`; it is not an upper bound
//!   of a token ratio (the 300-line sample: prefix-only reuses 0.0810 of
//!   prompt tokens, block-basis ideal 0.0796, token-basis ideal 0.0810).
//! * Imbalance: max / mean over engines of prompt tokens computed (prefill
//!   work served, cache hits excluded).

use serde::Serialize;

use super::types::{ReplicaSetup, SimConfig};
use crate::trace::Trace;

/// Summary of a sample.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Distribution {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Distribution {
    /// Mean and nearest-rank percentiles (rank rounded from `(n-1)*p`).
    pub(crate) fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Distribution::default();
        }
        values.sort_unstable_by(f64::total_cmp);
        let n = values.len();
        let at = |p: f64| values[(((n - 1) as f64) * p / 100.0).round() as usize];
        Distribution {
            mean: values.iter().sum::<f64>() / n as f64,
            p50: at(50.0),
            p90: at(90.0),
            p99: at(99.0),
        }
    }
}

/// Per-engine counters.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EngineStats {
    /// Requests routed to the engine.
    pub requests: u64,
    /// Prompt tokens of those requests.
    pub prompt_tokens: u64,
    /// Prompt tokens the engine computed (cache hits excluded, recomputation
    /// after preemption included).
    pub prefill_tokens: u64,
    pub completed: u64,
    /// Sequences preempted for lack of KV blocks.
    pub preemptions: u64,
    pub steps: u64,
    pub busy_ms: f64,
}

/// One request's fate, as the event loop recorded it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestOutcome {
    pub arrival_ms: f64,
    pub engine: usize,
    pub prompt_tokens: usize,
    pub reused_tokens: usize,
    /// Of `reused_tokens`, those loaded from the engine's host tier.
    pub host_reused_tokens: usize,
    pub first_token_ms: Option<f64>,
    pub finish_ms: Option<f64>,
    pub output_tokens: usize,
    pub rejected: bool,
}

/// Results of one replay.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub policy: String,
    /// Router replicas the policy ran as; `None` for one router.
    pub replicas: Option<ReplicaSetup>,
    /// With ordered decisions: those some replica made differently.
    pub divergent_decisions: Option<u64>,
    pub workers: usize,
    pub speedup: f64,
    pub requests: usize,
    pub completed: usize,
    pub rejected: usize,
    pub ttft_ms: Distribution,
    pub e2e_ms: Distribution,
    pub itl_ms: Distribution,
    pub output_tok_s: f64,
    pub total_tok_s: f64,
    pub reuse_ratio: f64,
    /// Of `reuse_ratio`, the part loaded from host tiers (engines with a
    /// host tier only; the device's part is the rest).
    pub host_reuse_ratio: Option<f64>,
    /// Infinite-cache ideal, token basis (see the module docs).
    pub ideal_reuse_ratio: f64,
    /// Infinite-cache ideal, block basis.
    pub ideal_reuse_ratio_blocks: f64,
    pub imbalance: f64,
    /// Requests whose TTFT was at most 2 s.
    pub ttft_under_2s: usize,
    /// Simulated span in seconds.
    pub span_s: f64,
    /// Wall time of the replay in seconds (the only non-deterministic field).
    pub sim_secs: f64,
    pub engines: Vec<EngineStats>,
    /// TTFT at every percentile 0..=100 (for the chart).
    pub ttft_percentiles_ms: Vec<f64>,
    /// How well the policy predicted TTFT, if it predicts it.
    pub ttft_prediction: Option<PredictionAccuracy>,
    /// Predicted against engine-found cached prompt tokens (in tokens, not
    /// ms), for policies that read a cache view.
    pub cached_prediction: Option<PredictionErrors>,
}

/// Errors of predicted against simulated TTFT over some requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PredictionErrors {
    pub requests: usize,
    /// Mean of |predicted - actual|.
    pub mae_ms: f64,
    /// 90th percentile of |predicted - actual|.
    pub p90_abs_ms: f64,
    /// Mean of predicted - actual (negative: predictions too optimistic).
    pub bias_ms: f64,
}

impl PredictionErrors {
    /// Over `(predicted, actual)` pairs.
    pub(crate) fn of(pairs: &[(f64, f64)]) -> Self {
        if pairs.is_empty() {
            return Self::default();
        }
        let n = pairs.len() as f64;
        let mut abs: Vec<f64> = pairs.iter().map(|(p, a)| (p - a).abs()).collect();
        abs.sort_by(f64::total_cmp);
        let rank = ((0.9 * (abs.len() - 1) as f64).round() as usize).min(abs.len() - 1);
        Self {
            requests: pairs.len(),
            mae_ms: abs.iter().sum::<f64>() / n,
            p90_abs_ms: abs[rank],
            bias_ms: pairs.iter().map(|(p, a)| p - a).sum::<f64>() / n,
        }
    }
}

/// Predicted TTFT against the simulator's, in the order prefills completed:
/// the first tenth (the router still learning each engine's speed) and the
/// second half (learning settled).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PredictionAccuracy {
    pub all: PredictionErrors,
    pub first_tenth: PredictionErrors,
    pub second_half: PredictionErrors,
}

impl PredictionAccuracy {
    pub(crate) fn of(pairs: &[(f64, f64)]) -> Self {
        let tenth = pairs.len().div_ceil(10);
        Self {
            all: PredictionErrors::of(pairs),
            first_tenth: PredictionErrors::of(&pairs[..tenth]),
            second_half: PredictionErrors::of(&pairs[pairs.len() / 2..]),
        }
    }
}

/// Values at percentiles 0, 1, ..., 100 (nearest rank); empty input, empty.
fn percentiles(values: &[f64]) -> Vec<f64> {
    if values.is_empty() {
        return Vec::new();
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    (0..=100)
        .map(|p| {
            let rank = (p as f64 / 100.0 * (sorted.len() - 1) as f64).round() as usize;
            sorted[rank.min(sorted.len() - 1)]
        })
        .collect()
}

impl Report {
    /// The report of one router (`replicas` is `None`).
    pub(crate) fn build(
        policy: &str,
        config: &SimConfig,
        trace: &Trace,
        requests: &[RequestOutcome],
        itl_ms: Vec<f64>,
        engines: Vec<EngineStats>,
        sim_secs: f64,
    ) -> Report {
        let mut ttft = Vec::with_capacity(requests.len());
        let mut e2e = Vec::with_capacity(requests.len());
        let mut prompt_total = 0u64;
        let mut reused_total = 0u64;
        let mut host_reused_total = 0u64;
        let mut output_total = 0u64;
        let mut completed_prompt = 0u64;
        let mut first_arrival = f64::INFINITY;
        let mut last_token = f64::NEG_INFINITY;
        let mut completed = 0;
        for r in requests {
            prompt_total += r.prompt_tokens as u64;
            reused_total += r.reused_tokens as u64;
            host_reused_total += r.host_reused_tokens as u64;
            output_total += r.output_tokens as u64;
            first_arrival = first_arrival.min(r.arrival_ms);
            if let Some(t) = r.first_token_ms {
                ttft.push(t - r.arrival_ms);
            }
            if let Some(t) = r.finish_ms {
                completed += 1;
                completed_prompt += r.prompt_tokens as u64;
                e2e.push(t - r.arrival_ms);
                last_token = last_token.max(t);
            }
        }
        let span_s = if last_token > first_arrival {
            (last_token - first_arrival) / 1000.0
        } else {
            0.0
        };
        let ratio = |x: u64| {
            if prompt_total > 0 {
                x as f64 / prompt_total as f64
            } else {
                0.0
            }
        };
        let per_s = |x: u64| if span_s > 0.0 { x as f64 / span_s } else { 0.0 };
        let ttft_under_2s = ttft.iter().filter(|&&t| t <= 2000.0).count();
        let ideal = trace.ideal_reuse();
        let served: Vec<f64> = engines.iter().map(|e| e.prefill_tokens as f64).collect();
        let mean_served = served.iter().sum::<f64>() / served.len().max(1) as f64;
        let imbalance = if mean_served > 0.0 {
            served.iter().copied().fold(0.0, f64::max) / mean_served
        } else {
            1.0
        };
        Report {
            policy: policy.to_string(),
            replicas: None,
            divergent_decisions: None,
            workers: config.workers,
            speedup: config.speedup,
            requests: requests.len(),
            completed,
            rejected: requests.iter().filter(|r| r.rejected).count(),
            ttft_percentiles_ms: percentiles(&ttft),
            ttft_prediction: None,
            cached_prediction: None,
            ttft_ms: Distribution::of(ttft),
            e2e_ms: Distribution::of(e2e),
            itl_ms: Distribution::of(itl_ms),
            output_tok_s: per_s(output_total),
            total_tok_s: per_s(output_total + completed_prompt),
            reuse_ratio: ratio(reused_total),
            host_reuse_ratio: (config.engine.host_blocks > 0).then(|| ratio(host_reused_total)),
            ideal_reuse_ratio: ideal.token_ratio(),
            ideal_reuse_ratio_blocks: ideal.block_ratio(),
            imbalance,
            ttft_under_2s,
            span_s,
            sim_secs,
            engines,
        }
    }

    /// The report with its wall time zeroed, for determinism checks.
    pub fn without_wall_time(&self) -> Report {
        Report {
            sim_secs: 0.0,
            ..self.clone()
        }
    }

    /// The JSON object for this policy, with exactly the documented keys;
    /// `router_replicas` and `replica_sync_delay_ms` (null: never) only when
    /// the policy ran as several replicas.
    pub fn to_json(&self) -> serde_json::Value {
        let mut json = serde_json::json!({
            "policy": self.policy,
            "workers": self.workers,
            "speedup": self.speedup,
            "completed": self.completed,
            "ttft_ms": self.ttft_ms,
            "e2e_ms": self.e2e_ms,
            "itl_ms": { "mean": self.itl_ms.mean, "p99": self.itl_ms.p99 },
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
            "reuse_ratio": self.reuse_ratio,
            "ideal_reuse_ratio": self.ideal_reuse_ratio,
            "imbalance": self.imbalance,
            "ttft_under_2s": self.ttft_under_2s,
            "sim_secs": self.sim_secs,
        });
        if let (Some(host), Some(object)) = (self.host_reuse_ratio, json.as_object_mut()) {
            object.insert("host_reuse_ratio".into(), host.into());
        }
        if let (Some(setup), Some(object)) = (self.replicas, json.as_object_mut()) {
            object.insert("router_replicas".into(), setup.count.into());
            object.insert("replica_sync_delay_ms".into(), setup.sync_delay_ms.into());
            object.insert("ordered_decisions".into(), setup.ordered.into());
            if let Some(divergent) = self.divergent_decisions {
                object.insert("divergent_decisions".into(), divergent.into());
            }
        }
        if let (Some(errors), Some(object)) = (self.cached_prediction, json.as_object_mut()) {
            // The same statistics as for TTFT, in tokens.
            object.insert(
                "cached_prediction".into(),
                serde_json::json!({
                    "requests": errors.requests,
                    "mae_tokens": errors.mae_ms,
                    "p90_abs_tokens": errors.p90_abs_ms,
                    "bias_tokens": errors.bias_ms,
                }),
            );
        }
        if let (Some(accuracy), Some(object)) = (self.ttft_prediction, json.as_object_mut()) {
            object.insert(
                "ttft_prediction".into(),
                serde_json::to_value(accuracy).unwrap_or_default(),
            );
        }
        json
    }

    /// A fixed-width text table, one row per report, after a line per
    /// report that ran as several router replicas saying how.
    pub(crate) fn table(reports: &[Report]) -> String {
        let mut out = String::new();
        for r in reports {
            if let Some(setup) = r.replicas {
                out.push_str(&format!("{}: {setup}", r.policy));
                if let Some(divergent) = r.divergent_decisions {
                    out.push_str(&format!(
                        "; decisions some replica made differently: {divergent}"
                    ));
                }
                out.push('\n');
            }
        }
        out.push_str(&format!(
            "{:<14} {:>3} {:>6} {:>6} | {:>7} {:>7} {:>7} {:>7} | {:>7} {:>7} {:>7} | {:>6} {:>6} | {:>8} {:>8} | {:>6} {:>6} {:>6} | {:>7} {:>6}\n",
            "policy", "wrk", "speed", "done",
            "ttft", "p50", "p90", "p99",
            "e2e", "p50", "p99",
            "itl", "p99",
            "out/s", "tot/s",
            "reuse", "ideal", "imbal",
            "ttft<2s", "sim_s",
        ));
        out.push_str(&format!(
            "{:<14} {:>3} {:>6} {:>6} | {:>31} | {:>23} | {:>13} | {:>17} | {:>20} | {:>14}\n",
            "",
            "",
            "",
            "",
            "ms (mean p50 p90 p99)",
            "ms (mean p50 p99)",
            "ms (mean p99)",
            "tokens/s",
            "ratios",
            "",
        ));
        for r in reports {
            let under = if r.requests > 0 {
                100.0 * r.ttft_under_2s as f64 / r.requests as f64
            } else {
                0.0
            };
            out.push_str(&format!(
                "{:<14} {:>3} {:>6.2} {:>6} | {:>7.0} {:>7.0} {:>7.0} {:>7.0} | {:>7.0} {:>7.0} {:>7.0} | {:>6.1} {:>6.1} | {:>8.0} {:>8.0} | {:>6.3} {:>6.3} {:>6.3} | {:>6.1}% {:>6.2}\n",
                r.policy, r.workers, r.speedup, r.completed,
                r.ttft_ms.mean, r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99,
                r.e2e_ms.mean, r.e2e_ms.p50, r.e2e_ms.p99,
                r.itl_ms.mean, r.itl_ms.p99,
                r.output_tok_s, r.total_tok_s,
                r.reuse_ratio, r.ideal_reuse_ratio, r.imbalance,
                under, r.sim_secs,
            ));
        }
        for r in reports {
            if let Some(a) = r.ttft_prediction {
                let line = |e: PredictionErrors| {
                    format!(
                        "MAE {:.0} ms, p90 {:.0} ms, bias {:+.0} ms",
                        e.mae_ms, e.p90_abs_ms, e.bias_ms
                    )
                };
                out.push_str(&format!(
                    "{}: predicted TTFT error over {} requests: {}; first tenth {}; second half {}\n",
                    r.policy,
                    a.all.requests,
                    line(a.all),
                    line(a.first_tenth),
                    line(a.second_half)
                ));
            }
        }
        for r in reports {
            if let Some(host) = r.host_reuse_ratio {
                out.push_str(&format!(
                    "{}: reuse by tier: device {:.3}, host {:.3}\n",
                    r.policy,
                    r.reuse_ratio - host,
                    host
                ));
            }
        }
        for r in reports {
            if let Some(e) = r.cached_prediction {
                out.push_str(&format!(
                    "{}: predicted cached tokens against the engines' over {} requests: MAE {:.0}, p90 {:.0}, bias {:+.0} tokens\n",
                    r.policy, e.requests, e.mae_ms, e.p90_abs_ms, e.bias_ms
                ));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distribution_uses_nearest_rank() {
        let d = Distribution::of((1..=101).map(f64::from).collect());
        assert_eq!(d.p50, 51.0);
        assert_eq!(d.p90, 91.0);
        assert_eq!(d.p99, 100.0);
        assert!((d.mean - 51.0).abs() < 1e-12);
        assert_eq!(Distribution::of(vec![]), Distribution::default());
    }

    #[test]
    fn json_has_exactly_the_documented_keys() {
        let r = Report {
            policy: "x".into(),
            ..Report::default()
        };
        let v = r.to_json();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut want = vec![
            "policy",
            "workers",
            "speedup",
            "completed",
            "ttft_ms",
            "e2e_ms",
            "itl_ms",
            "output_tok_s",
            "total_tok_s",
            "reuse_ratio",
            "ideal_reuse_ratio",
            "imbalance",
            "ttft_under_2s",
            "sim_secs",
        ];
        want.sort_unstable();
        assert_eq!(keys, want);
        for k in ["ttft_ms", "e2e_ms"] {
            let mut sub: Vec<&str> = v[k]
                .as_object()
                .unwrap()
                .keys()
                .map(String::as_str)
                .collect();
            sub.sort_unstable();
            assert_eq!(sub, vec!["mean", "p50", "p90", "p99"]);
        }
        let mut itl: Vec<&str> = v["itl_ms"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        itl.sort_unstable();
        assert_eq!(itl, vec!["mean", "p99"]);
        let replicated = Report {
            replicas: Some(ReplicaSetup {
                count: 3,
                sync_delay_ms: None,
                ordered: false,
            }),
            ..r.clone()
        }
        .to_json();
        assert_eq!(replicated["router_replicas"], 3);
        assert!(replicated["replica_sync_delay_ms"].is_null());
        assert_eq!(replicated["ordered_decisions"], false);
        assert_eq!(replicated.as_object().unwrap().len(), want.len() + 3);
        let ordered = Report {
            replicas: Some(ReplicaSetup {
                count: 3,
                sync_delay_ms: Some(10.0),
                ordered: true,
            }),
            divergent_decisions: Some(0),
            ..r
        }
        .to_json();
        assert_eq!(ordered["ordered_decisions"], true);
        assert_eq!(ordered["divergent_decisions"], 0);
        assert_eq!(ordered.as_object().unwrap().len(), want.len() + 4);
    }

    #[test]
    fn table_has_a_row_per_report() {
        let r = Report {
            policy: "round-robin".into(),
            ..Report::default()
        };
        let t = Report::table(&[r.clone(), r]);
        assert_eq!(t.lines().count(), 4);
        assert!(t.contains("round-robin"));
    }

    #[test]
    fn table_says_how_replicas_shared_their_load() {
        let r = Report {
            policy: "kvroute".into(),
            replicas: Some(ReplicaSetup {
                count: 3,
                sync_delay_ms: Some(1.0),
                ordered: false,
            }),
            ..Report::default()
        };
        let t = Report::table(&[r]);
        assert_eq!(t.lines().count(), 4);
        assert!(
            t.starts_with("kvroute: 3 router replicas (request i routed by replica i mod 3)"),
            "{t}"
        );
        assert!(t.lines().next().unwrap().ends_with("after 1 ms"), "{t}");
    }
}
