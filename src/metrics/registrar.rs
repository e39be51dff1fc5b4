//! Creating a family and registering it, in one call that names it, says
//! what it counts and lists its labels (and buckets). Every area's
//! constructor goes through it, so a family reads as one line of what it
//! is rather than the same five lines of builder calls.

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

/// The latency buckets of RPCs and of the admission queue, in seconds.
pub(super) const LATENCY_BUCKETS: &[f64] = &[
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

type Made<C> = Result<C, prometheus::Error>;

/// Registers new families in one registry. Registration of fixed, distinct
/// names cannot collide, so its failures are programming errors; they are
/// returned rather than panicking.
#[derive(Clone, Copy)]
pub(super) struct Registrar<'a>(&'a Registry);

impl<'a> Registrar<'a> {
    pub(super) fn new(registry: &'a Registry) -> Self {
        Self(registry)
    }

    pub(super) fn counter(self, name: &str, help: &str) -> Made<IntCounter> {
        self.registered(IntCounter::new(name, help)?)
    }

    pub(super) fn counter_vec(
        self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Made<IntCounterVec> {
        self.registered(IntCounterVec::new(Opts::new(name, help), labels)?)
    }

    pub(super) fn int_gauge(self, name: &str, help: &str) -> Made<IntGauge> {
        self.registered(IntGauge::new(name, help)?)
    }

    pub(super) fn int_gauge_vec(
        self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Made<IntGaugeVec> {
        self.registered(IntGaugeVec::new(Opts::new(name, help), labels)?)
    }

    pub(super) fn gauge(self, name: &str, help: &str) -> Made<Gauge> {
        self.registered(Gauge::new(name, help)?)
    }

    pub(super) fn gauge_vec(self, name: &str, help: &str, labels: &[&str]) -> Made<GaugeVec> {
        self.registered(GaugeVec::new(Opts::new(name, help), labels)?)
    }

    pub(super) fn histogram(self, name: &str, help: &str, buckets: &[f64]) -> Made<Histogram> {
        self.registered(Histogram::with_opts(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        )?)
    }

    pub(super) fn histogram_vec(
        self,
        name: &str,
        help: &str,
        buckets: &[f64],
        labels: &[&str],
    ) -> Made<HistogramVec> {
        self.registered(HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
            labels,
        )?)
    }

    /// Registers `collector` and returns it (a handle to the same series).
    fn registered<C>(self, collector: C) -> Made<C>
    where
        C: prometheus::core::Collector + Clone + 'static,
    {
        self.0.register(Box::new(collector.clone()))?;
        Ok(collector)
    }
}
