//! A server's Prometheus histogram, scraped at two moments and differenced:
//! the quantiles of what it observed in between. The soak reads the
//! server's own SelectWorker timing this way (`rpc_duration_seconds`), the
//! cluster bench its replicas' log lag.
//!
//! Why the soak judges the server's timing: its clients share the machine
//! with the server, so the latency they observe also carries the machine's
//! scheduling noise. On the 2-core VM, over a 10-minute soak the server's
//! mean SelectWorker handling time stayed at 110-141 us per 30 s while the
//! clients' p50 wandered between 490 and 670 us, with both processes using
//! a fifth of the machine. The server's histogram, differenced between
//! scrapes, measures kvroute alone.

/// The RPC path of SelectWorker, as the histogram labels it.
pub const SELECT_WORKER: &str = "/kvroute.v1.Router/SelectWorker";

/// The histogram of every RPC's handling time, by method and code.
const RPC_DURATION: &str = "kvroute_rpc_duration_seconds";

/// Cumulative counts of one histogram family, its series summed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    /// (upper bound in seconds, calls at or under it), by bound.
    buckets: Vec<(f64, u64)>,
    sum_s: f64,
    count: u64,
}

/// A window's figures (see [`Histogram::summary`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct ServerLatency {
    pub calls: u64,
    pub mean_us: f64,
    /// Interpolated within its bucket, as Prometheus' `histogram_quantile`.
    pub p99_us: f64,
}

impl Histogram {
    /// The time RPC `method` took (every status code together), from a
    /// Prometheus text exposition.
    pub(crate) fn rpc(text: &str, method: &str) -> Self {
        Self::parse(text, RPC_DURATION, Some(&format!("method=\"{method}\"")))
    }

    /// `family`'s series that carry `label` (all of them for `None`),
    /// summed, from a Prometheus text exposition.
    pub(crate) fn parse(text: &str, family: &str, label: Option<&str>) -> Self {
        let mut out = Self::default();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(family) else {
                continue;
            };
            if label.is_some_and(|label| !rest.contains(label)) {
                continue;
            }
            let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
                continue;
            };
            if rest.starts_with("_bucket{") {
                let Some(le) = label_value(rest, "le") else {
                    continue;
                };
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    match le.parse::<f64>() {
                        Ok(b) => b,
                        Err(_) => continue,
                    }
                };
                out.add_bucket(bound, value as u64);
            } else if rest.starts_with("_sum{") {
                out.sum_s += value;
            } else if rest.starts_with("_count{") {
                out.count += value as u64;
            }
        }
        out
    }

    /// Adds `other`'s observations (another replica's, say).
    pub(crate) fn add(&mut self, other: &Histogram) {
        for &(bound, n) in &other.buckets {
            self.add_bucket(bound, n);
        }
        self.sum_s += other.sum_s;
        self.count += other.count;
    }

    fn add_bucket(&mut self, bound: f64, n: u64) {
        match self.buckets.iter_mut().find(|(b, _)| *b == bound) {
            Some((_, total)) => *total += n,
            None => {
                self.buckets.push((bound, n));
                self.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
        }
    }

    /// The calls between `earlier` and this scrape (a restarted server's
    /// counters count from zero: nothing is negative).
    pub(crate) fn since(&self, earlier: &Histogram) -> Histogram {
        let before = |bound: f64| {
            earlier
                .buckets
                .iter()
                .find(|(b, _)| *b == bound)
                .map_or(0, |(_, n)| *n)
        };
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(b, n)| (b, n.saturating_sub(before(b))))
                .collect(),
            sum_s: (self.sum_s - earlier.sum_s).max(0.0),
            count: self.count.saturating_sub(earlier.count),
        }
    }

    /// Calls, mean and p99; `None` without calls.
    pub(crate) fn summary(&self) -> Option<ServerLatency> {
        (self.count > 0).then(|| ServerLatency {
            calls: self.count,
            mean_us: self.sum_s / self.count as f64 * 1e6,
            p99_us: self.quantile_s(0.99) * 1e6,
        })
    }

    /// The `q` quantile in seconds, linear within its bucket; a rank in
    /// the open top bucket answers the last finite bound (0 when empty).
    pub(crate) fn quantile_s(&self, q: f64) -> f64 {
        let total = self.buckets.last().map_or(0, |&(_, n)| n);
        if total == 0 {
            return 0.0;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let (mut lower, mut below) = (0.0, 0u64);
        for &(bound, cumulative) in &self.buckets {
            if cumulative as f64 >= rank && cumulative > below {
                if bound.is_infinite() {
                    return lower;
                }
                let share = (rank - below as f64) / (cumulative - below) as f64;
                return lower + (bound - lower) * share;
            }
            lower = bound;
            below = cumulative;
        }
        lower
    }
}

/// The value of `name="..."` in a label set.
fn label_value<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let start = labels.find(&format!("{name}=\""))? + name.len() + 2;
    let len = labels[start..].find('"')?;
    Some(&labels[start..start + len])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposition(ok: [u64; 4], sum: f64) -> String {
        let m = SELECT_WORKER;
        format!(
            "# TYPE kvroute_rpc_duration_seconds histogram\n\
             kvroute_rpc_duration_seconds_bucket{{code=\"OK\",method=\"{m}\",le=\"0.0001\"}} {}\n\
             kvroute_rpc_duration_seconds_bucket{{code=\"OK\",method=\"{m}\",le=\"0.001\"}} {}\n\
             kvroute_rpc_duration_seconds_bucket{{code=\"OK\",method=\"{m}\",le=\"0.01\"}} {}\n\
             kvroute_rpc_duration_seconds_bucket{{code=\"OK\",method=\"{m}\",le=\"+Inf\"}} {}\n\
             kvroute_rpc_duration_seconds_sum{{code=\"OK\",method=\"{m}\"}} {sum}\n\
             kvroute_rpc_duration_seconds_count{{code=\"OK\",method=\"{m}\"}} {}\n\
             kvroute_rpc_duration_seconds_bucket{{code=\"NOT_FOUND\",method=\"{m}\",le=\"0.0001\"}} 10\n\
             kvroute_rpc_duration_seconds_bucket{{code=\"NOT_FOUND\",method=\"{m}\",le=\"0.001\"}} 10\n\
             kvroute_rpc_duration_seconds_bucket{{code=\"NOT_FOUND\",method=\"{m}\",le=\"0.01\"}} 10\n\
             kvroute_rpc_duration_seconds_bucket{{code=\"NOT_FOUND\",method=\"{m}\",le=\"+Inf\"}} 10\n\
             kvroute_rpc_duration_seconds_sum{{code=\"NOT_FOUND\",method=\"{m}\"}} 0.0005\n\
             kvroute_rpc_duration_seconds_count{{code=\"NOT_FOUND\",method=\"{m}\"}} 10\n\
             kvroute_rpc_duration_seconds_bucket{{code=\"OK\",method=\"/grpc.health.v1.Health/Check\",le=\"+Inf\"}} 999\n",
            ok[0], ok[1], ok[2], ok[3], ok[3]
        )
    }

    #[test]
    fn a_family_without_a_label_sums_every_series() {
        let text = "x_bucket{r=\"a\",le=\"0.001\"} 50\nx_bucket{r=\"a\",le=\"0.002\"} 50\n\
                    x_bucket{r=\"a\",le=\"+Inf\"} 50\n\
                    x_bucket{r=\"b\",le=\"0.001\"} 0\nx_bucket{r=\"b\",le=\"0.002\"} 50\n\
                    x_bucket{r=\"b\",le=\"+Inf\"} 50\nxy_bucket{le=\"+Inf\"} 7\n";
        let h = Histogram::parse(text, "x", None);
        assert!((h.quantile_s(0.5) - 0.001).abs() < 1e-12);
        assert!((h.quantile_s(0.75) - 0.0015).abs() < 1e-12);
        let mut twice = h.clone();
        twice.add(&h);
        assert!((twice.quantile_s(0.75) - 0.0015).abs() < 1e-12);
        assert_eq!(h.since(&h).quantile_s(0.5), 0.0);
    }

    #[test]
    fn codes_are_summed_and_other_methods_ignored() {
        let h = Histogram::rpc(&exposition([50, 90, 100, 100], 0.02), SELECT_WORKER);
        let s = h.summary().unwrap();
        assert_eq!(s.calls, 110);
        assert!((s.mean_us - 0.0205 / 110.0 * 1e6).abs() < 1e-6, "{s:?}");
    }

    #[test]
    fn the_window_between_two_scrapes_is_what_counts() {
        let early = Histogram::rpc(&exposition([50, 90, 100, 100], 0.02), SELECT_WORKER);
        // 100 more calls, all between 1 and 10 ms.
        let late = Histogram::rpc(&exposition([50, 90, 200, 200], 0.52), SELECT_WORKER);
        let s = late.since(&early).summary().unwrap();
        assert_eq!(s.calls, 100);
        assert!((s.mean_us - 5000.0).abs() < 1e-6, "{s:?}");
        // Rank 99 of 100 in the 1-10 ms bucket: 1 ms + 9 ms * 0.99.
        assert!((s.p99_us - 9910.0).abs() < 1e-6, "{s:?}");
        assert_eq!(early.since(&early).summary(), None);
        // A restarted server: counters below the earlier scrape's.
        assert_eq!(early.since(&late).summary(), None);
    }

    #[test]
    fn p99_interpolates_and_stops_at_the_last_finite_bound() {
        let h = Histogram::rpc(&exposition([0, 100, 100, 100], 0.01), SELECT_WORKER);
        // 110 calls: 10 under 100 us, 100 more under 1 ms.
        let p99 = h.summary().unwrap().p99_us;
        let expected = 100.0 + 900.0 * (0.99 * 110.0 - 10.0) / 100.0;
        assert!((p99 - expected).abs() < 1e-6, "{p99} vs {expected}");
        let slow = Histogram::rpc(&exposition([0, 0, 0, 100], 10.0), SELECT_WORKER);
        assert!((slow.summary().unwrap().p99_us - 10_000.0).abs() < 1e-6);
        assert_eq!(Histogram::rpc("garbage\n", SELECT_WORKER).summary(), None);
    }
}
