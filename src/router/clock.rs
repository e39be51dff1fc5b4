//! The routing clock: the milliseconds bookings, sessions, predictions,
//! trust deadlines and peer estimates are timed in.
//!
//! Why a type of its own: the routing side and the cache views read it by
//! themselves (each where it read it before, under its own lock), and the
//! replay simulator drives it on virtual time. One clock is made per core
//! and cloned into both; a manual clock's reading is shared by the clones.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use super::now;

/// Milliseconds of the routing clock (see the module docs).
#[derive(Clone, Debug)]
pub(super) struct Clock {
    /// When the core started: zero of the clock.
    started: Instant,
    /// The reading when a caller drives it (the replay simulator's virtual
    /// time); `None`: tokio's clock since `started`.
    manual: Option<Arc<AtomicU64>>,
}

impl Clock {
    /// tokio's clock (so tests can pause it), from now.
    pub(super) fn tokio() -> Self {
        Self {
            started: now(),
            manual: None,
        }
    }

    /// A clock that reads what [`Self::set_ms`] last set, from 0.
    pub(super) fn manual() -> Self {
        Self {
            manual: Some(Arc::new(AtomicU64::new(0))),
            ..Self::tokio()
        }
    }

    pub(super) fn now_ms(&self) -> u64 {
        match &self.manual {
            Some(clock) => clock.load(Ordering::Relaxed),
            None => millis(now().saturating_duration_since(self.started)),
        }
    }

    /// Sets a manual clock (never back); does nothing to tokio's.
    pub(super) fn set_ms(&self, now_ms: u64) {
        if let Some(clock) = &self.manual {
            clock.fetch_max(now_ms, Ordering::Relaxed);
        }
    }
}

/// A duration in whole milliseconds of the routing clock, saturating.
pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
