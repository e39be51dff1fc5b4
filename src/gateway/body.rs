//! Request bodies held while they stream in: each stream's body up to
//! `--epp-max-body-bytes`, all streams' together up to
//! `--epp-max-buffered-bytes`. A body grows only by bytes that arrived, so
//! a `content-length` that lies cannot make kvroute reserve anything; a
//! larger declared length is only refused early.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use prometheus::IntGauge;

/// The bytes all streams' bodies may hold together.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    limit: u64,
    used: AtomicU64,
    gauge: IntGauge,
}

impl BodyBudget {
    pub(crate) fn new(limit: u64, gauge: IntGauge) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicU64::new(0),
            gauge,
        })
    }

    fn take(&self, bytes: u64) -> bool {
        let taken = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .is_ok();
        if taken {
            self.gauge.add(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        taken
    }

    /// Counts bytes already held, whatever the limit.
    fn count(&self, bytes: u64) {
        self.used.fetch_add(bytes, Ordering::AcqRel);
        self.gauge.add(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    fn give_back(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
        self.gauge.sub(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
}

/// Why a chunk was not added.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The body would pass its own limit (413).
    TooLarge,
    /// All bodies together would pass theirs (503).
    Crowded,
}

/// One stream's body, its bytes counted against the budget until dropped.
#[derive(Debug)]
pub(crate) struct Body {
    bytes: Vec<u8>,
    limit: u64,
    budget: Arc<BodyBudget>,
}

impl Body {
    pub(crate) fn new(limit: u64, budget: Arc<BodyBudget>) -> Self {
        Self {
            bytes: Vec::new(),
            limit,
            budget,
        }
    }

    /// Appends a chunk, within both limits. The budget counts the bytes
    /// the body holds, its spare capacity included.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Result<(), Refused> {
        let grown = self.bytes.len() as u64 + chunk.len() as u64;
        if grown > self.limit {
            return Err(Refused::TooLarge);
        }
        let held = self.bytes.capacity();
        // Doubling as a Vec does, but never past the body's own limit.
        let wanted = if grown as usize <= held {
            held
        } else {
            (held * 2).max(grown as usize).min(self.limit as usize)
        };
        if !self.budget.take((wanted - held) as u64) {
            return Err(Refused::Crowded);
        }
        self.bytes.reserve_exact(wanted - self.bytes.len());
        self.bytes.extend_from_slice(chunk);
        // `reserve_exact` may give more than asked: count what is held.
        let extra = self.bytes.capacity().saturating_sub(wanted);
        if extra > 0 {
            self.budget.count(extra as u64);
        }
        Ok(())
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes.capacity() as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gauge() -> IntGauge {
        IntGauge::new("test_bytes", "test").unwrap()
    }

    #[test]
    fn what_a_body_holds_is_what_it_counts() {
        let budget = BodyBudget::new(1 << 30, gauge());
        let mut body = Body::new(8 << 20, budget.clone());
        for _ in 0..1000 {
            body.push(&[7u8; 4099]).unwrap();
            assert_eq!(
                budget.used.load(Ordering::Acquire),
                body.bytes.capacity() as u64
            );
        }
    }

    #[test]
    fn each_body_and_all_bodies_are_held_to_their_limits() {
        let budget = BodyBudget::new(10, gauge());
        let mut first = Body::new(8, budget.clone());
        first.push(b"12345").unwrap();
        assert_eq!(first.push(b"6789"), Err(Refused::TooLarge));
        let mut second = Body::new(8, budget.clone());
        assert_eq!(second.push(b"123456"), Err(Refused::Crowded));
        second.push(b"12345").unwrap();
        assert_eq!(budget.gauge.get(), 10);
        drop(first);
        assert_eq!(budget.gauge.get(), 5);
        // Growing takes spare capacity too, never past the body's limit.
        second.push(b"678").unwrap();
        assert_eq!(budget.gauge.get(), 8);
        drop(second);
        assert_eq!(budget.used.load(Ordering::Acquire), 0);
        assert_eq!(budget.gauge.get(), 0);
    }
}
