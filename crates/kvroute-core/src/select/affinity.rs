//! Session affinity: which worker (and optionally dp rank) a session's
//! requests should go to.
//!
//! Why it exists: multi-turn sessions reuse their own KV cache best when
//! their turns land on the same worker. A session is bound on its first
//! RESERVE routing and the binding's TTL is refreshed each time it is used.
//! Invariants:
//! * time is an explicit argument (milliseconds on any monotonic clock the
//!   caller chooses), so the table is deterministic and testable;
//! * an entry whose last use is more than `ttl_ms` ago is dead: `lookup`
//!   never returns it even before `expire` removes it;
//! * `lookup` is read-only, so QUERY_ONLY selections change nothing; only
//!   `bind` / `touch` (called from the RESERVE commit) refresh an entry.
//!
//! Modes: HARD pins the request to the session's target (a worker-only
//! target narrows the allowed workers to that worker; a target with a rank
//! is a pin). SOFT only prefers it: the default scorer discounts the target's
//! cost by `SelectConfig::soft_affinity_discount` (10% by default) and lets it
//! win exact ties; an ineligible or missing SOFT target is silently ignored.

use std::collections::HashMap;

use crate::types::{WorkerId, WorkerRank};

use super::pins::PinTarget;

/// Default time a session binding survives without use: 10 minutes.
pub const DEFAULT_SESSION_TTL_MS: u64 = 600_000;

/// How strongly a request follows its session's binding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AffinityMode {
    /// Pin to the session's worker; fail if it cannot serve the request.
    Hard,
    /// Prefer the session's worker; route elsewhere if it is worse or gone.
    #[default]
    Soft,
}

/// A request's reference to its session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionRef {
    pub session_id: String,
    pub mode: AffinityMode,
}

/// A session binding as a snapshot keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedSession {
    pub session_id: String,
    pub target: PinTarget,
    /// Milliseconds since it was last used.
    pub idle_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    target: PinTarget,
    last_used_ms: u64,
}

/// session_id -> bound target, with a use-refreshed TTL.
#[derive(Clone, Debug)]
pub struct SessionTable {
    ttl_ms: u64,
    entries: HashMap<String, Entry>,
}

impl Default for SessionTable {
    fn default() -> Self {
        Self::new(DEFAULT_SESSION_TTL_MS)
    }
}

impl SessionTable {
    pub fn new(ttl_ms: u64) -> Self {
        Self {
            ttl_ms,
            entries: HashMap::new(),
        }
    }

    #[cfg(test)]
    pub(crate) fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    fn alive(&self, entry: &Entry, now_ms: u64) -> bool {
        now_ms.saturating_sub(entry.last_used_ms) <= self.ttl_ms
    }

    /// Every live binding, as a snapshot keeps it, by session id.
    pub fn export(&self, now_ms: u64) -> Vec<SavedSession> {
        let mut saved: Vec<SavedSession> = self
            .entries
            .iter()
            .filter(|(_, e)| self.alive(e, now_ms))
            .map(|(id, e)| SavedSession {
                session_id: id.clone(),
                target: e.target,
                idle_ms: now_ms.saturating_sub(e.last_used_ms),
            })
            .collect();
        saved.sort_by(|a, b| a.session_id.cmp(&b.session_id));
        saved
    }

    /// Binds a saved session again, idle as it was (as far as the clock
    /// reaches back).
    pub fn restore(&mut self, saved: SavedSession, now_ms: u64) {
        self.entries.insert(
            saved.session_id,
            Entry {
                target: saved.target,
                last_used_ms: now_ms.saturating_sub(saved.idle_ms),
            },
        );
    }

    /// The live target of `session_id`, without refreshing it.
    pub fn lookup(&self, session_id: &str, now_ms: u64) -> Option<PinTarget> {
        self.entries
            .get(session_id)
            .filter(|e| self.alive(e, now_ms))
            .map(|e| e.target)
    }

    /// Binds (or rebinds) `session_id` to `target` and refreshes its TTL.
    /// Returns the previous live target, if any.
    pub(crate) fn bind(
        &mut self,
        session_id: &str,
        target: PinTarget,
        now_ms: u64,
    ) -> Option<PinTarget> {
        let previous = self.lookup(session_id, now_ms);
        self.entries.insert(
            session_id.to_owned(),
            Entry {
                target,
                last_used_ms: now_ms,
            },
        );
        previous
    }

    /// Records that the session routed to `routed`: a session with no live
    /// binding is bound to it; a live binding that covers `routed` keeps its
    /// target and has its TTL refreshed; a live binding that does not cover
    /// it (a SOFT session that went elsewhere, whose newest cache is now on
    /// `routed`) is moved to `routed`. Returns the target now bound.
    pub(crate) fn record_routing(
        &mut self,
        session_id: &str,
        routed: WorkerRank,
        now_ms: u64,
    ) -> PinTarget {
        let target = match self.lookup(session_id, now_ms) {
            Some(bound) if bound.covers(routed) => bound,
            _ => PinTarget::from(routed),
        };
        self.bind(session_id, target, now_ms);
        target
    }

    #[cfg(test)]
    /// Refreshes a live binding's TTL. Returns whether one was refreshed.
    pub(crate) fn touch(&mut self, session_id: &str, now_ms: u64) -> bool {
        let ttl = self.ttl_ms;
        match self.entries.get_mut(session_id) {
            Some(e) if now_ms.saturating_sub(e.last_used_ms) <= ttl => {
                e.last_used_ms = e.last_used_ms.max(now_ms);
                true
            }
            _ => false,
        }
    }

    #[cfg(test)]
    /// Forgets a session. Returns whether it was present (live or not).
    pub(crate) fn remove(&mut self, session_id: &str) -> bool {
        self.entries.remove(session_id).is_some()
    }

    /// Forgets every session bound to `worker_id` (e.g. on deregistration).
    /// Returns how many were removed.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        let before = self.entries.len();
        self.entries.retain(|_, e| e.target.worker_id != worker_id);
        before - self.entries.len()
    }

    /// Removes dead entries. Returns how many were removed.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let ttl = self.ttl_ms;
        let before = self.entries.len();
        self.entries
            .retain(|_, e| now_ms.saturating_sub(e.last_used_ms) <= ttl);
        before - self.entries.len()
    }

    #[cfg(test)]
    /// Number of stored entries (dead ones included until `expire`).
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_lookup_and_ttl() {
        let mut t = SessionTable::new(1_000);
        assert_eq!(t.lookup("s", 0), None);
        assert_eq!(t.bind("s", PinTarget::new(1, Some(0)), 100), None);
        assert_eq!(t.lookup("s", 1_100), Some(PinTarget::new(1, Some(0))));
        assert_eq!(t.lookup("s", 1_101), None, "dead after ttl");
        // lookup does not refresh; touch does.
        assert!(t.touch("s", 900));
        assert_eq!(t.lookup("s", 1_900), Some(PinTarget::new(1, Some(0))));
        assert!(!t.touch("s", 5_000));
        assert_eq!(t.expire(5_000), 1);
        assert!(t.is_empty());
    }

    #[test]
    fn record_routing_binds_keeps_and_moves() {
        let mut t = SessionTable::new(1_000);
        let r = |w, d| WorkerRank::new(w, d);
        assert_eq!(
            t.record_routing("s", r(1, 0), 0),
            PinTarget::new(1, Some(0))
        );
        // Same target: kept and refreshed.
        assert_eq!(
            t.record_routing("s", r(1, 0), 900),
            PinTarget::new(1, Some(0))
        );
        assert!(t.lookup("s", 1_800).is_some());
        // A worker-only binding covering the routed rank is kept.
        t.bind("w", PinTarget::new(2, None), 0);
        assert_eq!(t.record_routing("w", r(2, 3), 10), PinTarget::new(2, None));
        // Routed elsewhere: the binding moves.
        assert_eq!(
            t.record_routing("s", r(4, 1), 1_000),
            PinTarget::new(4, Some(1))
        );
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn remove_worker_and_remove() {
        let mut t = SessionTable::default();
        t.bind("a", PinTarget::new(1, None), 0);
        t.bind("b", PinTarget::new(1, Some(2)), 0);
        t.bind("c", PinTarget::new(2, None), 0);
        assert_eq!(t.remove_worker(1), 2);
        assert!(t.remove("c"));
        assert!(!t.remove("c"));
    }
}
