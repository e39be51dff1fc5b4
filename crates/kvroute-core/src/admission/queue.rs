//! The WAIT admission queue's ordering: which waiting request goes next.
//!
//! Why it exists: when every eligible worker is busy, WAIT requests queue,
//! and the order they leave in is policy: strict priority classes first,
//! then first-come-first-served on arrival time moved earlier by the
//! request's `priority_jump`. This module is only that ordered structure: no
//! timers, no wake-ups (the gRPC layer owns those). Invariants:
//! * order: higher `strict_priority` first; then earlier effective arrival
//!   (`arrival - priority_jump` seconds, microsecond resolution); then lower
//!   sequence number (push order), so the order is total and stable;
//! * at most `capacity` entries are admitted by `push`; a full queue
//!   refuses (RESOURCE_EXHAUSTED); `reinsert` of a just-popped entry keeps
//!   its place and is never refused for capacity;
//! * request ids are unique within the queue; `remove` by id is how a caller
//!   that went away (cancelled, deadline) leaves.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};

use super::AdmissionError;

/// Default bound of the WAIT queue.
pub const DEFAULT_QUEUE_CAPACITY: usize = 1024;

/// One waiting request.
#[derive(Clone, Debug, PartialEq)]
pub struct QueuedRequest<T> {
    pub request_id: String,
    pub strict_priority: u32,
    pub priority_jump: f64,
    pub arrival_ms: u64,
    /// Push order, assigned by the queue.
    pub seq: u64,
    pub payload: T,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    class: Reverse<u32>,
    effective_us: i128,
    seq: u64,
}

impl<T> QueuedRequest<T> {
    fn key(&self) -> Key {
        // Float-to-int `as` saturates, so huge jumps cannot wrap.
        let jump_us = (self.priority_jump * 1e6).round() as i128;
        Key {
            class: Reverse(self.strict_priority),
            effective_us: (i128::from(self.arrival_ms) * 1000).saturating_sub(jump_us),
            seq: self.seq,
        }
    }
}

/// A bounded priority queue of waiting requests carrying a `T` each (for
/// example the handle that wakes the waiting call).
#[derive(Debug)]
pub struct WaitQueue<T> {
    capacity: usize,
    next_seq: u64,
    order: BTreeMap<Key, QueuedRequest<T>>,
    keys: HashMap<String, Key>,
}

impl<T> WaitQueue<T> {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            next_seq: 0,
            order: BTreeMap::new(),
            keys: HashMap::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    pub(crate) fn contains(&self, request_id: &str) -> bool {
        self.keys.contains_key(request_id)
    }

    /// Queues a request. Returns its sequence number.
    pub fn push(
        &mut self,
        request_id: &str,
        strict_priority: u32,
        priority_jump: f64,
        arrival_ms: u64,
        payload: T,
    ) -> Result<u64, AdmissionError> {
        if !priority_jump.is_finite() {
            return Err(AdmissionError::InvalidArgument {
                request_id: request_id.to_owned(),
                reason: format!("priority_jump must be finite, got {priority_jump}"),
            });
        }
        if self.contains(request_id) {
            return Err(AdmissionError::AlreadyQueued {
                request_id: request_id.to_owned(),
            });
        }
        if self.order.len() >= self.capacity {
            return Err(AdmissionError::QueueFull {
                request_id: request_id.to_owned(),
                capacity: self.capacity,
            });
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.insert(QueuedRequest {
            request_id: request_id.to_owned(),
            strict_priority,
            priority_jump,
            arrival_ms,
            seq,
            payload,
        });
        Ok(seq)
    }

    fn insert(&mut self, entry: QueuedRequest<T>) {
        let key = entry.key();
        self.keys.insert(entry.request_id.clone(), key);
        self.order.insert(key, entry);
    }

    /// Puts back an entry taken out by [`pop`](Self::pop) (e.g. its
    /// selection was still busy). It keeps its place; capacity is not
    /// checked. Fails only if its id is queued again meanwhile.
    pub fn reinsert(&mut self, entry: QueuedRequest<T>) -> Result<(), AdmissionError> {
        if self.contains(&entry.request_id) {
            return Err(AdmissionError::AlreadyQueued {
                request_id: entry.request_id,
            });
        }
        self.next_seq = self.next_seq.max(entry.seq.saturating_add(1));
        self.insert(entry);
        Ok(())
    }

    #[cfg(test)]
    /// The entry that would leave next.
    pub(crate) fn peek(&self) -> Option<&QueuedRequest<T>> {
        self.order.values().next()
    }

    /// Takes out the entry that leaves next.
    pub fn pop(&mut self) -> Option<QueuedRequest<T>> {
        let (_, entry) = self.order.pop_first()?;
        self.keys.remove(&entry.request_id);
        Some(entry)
    }

    /// Takes out `request_id`, wherever it is.
    pub fn remove(&mut self, request_id: &str) -> Option<QueuedRequest<T>> {
        let key = self.keys.remove(request_id)?;
        self.order.remove(&key)
    }

    #[cfg(test)]
    /// 0-based place of `request_id` in leaving order (O(n)).
    pub(crate) fn position(&self, request_id: &str) -> Option<usize> {
        let key = self.keys.get(request_id)?;
        Some(self.order.range(..key).count())
    }

    #[cfg(test)]
    /// Entries in leaving order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &QueuedRequest<T>> {
        self.order.values()
    }
}

impl<T> Default for WaitQueue<T> {
    fn default() -> Self {
        Self::new(DEFAULT_QUEUE_CAPACITY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::select::ErrorCode;

    fn ids<T>(q: &WaitQueue<T>) -> Vec<String> {
        q.iter().map(|e| e.request_id.clone()).collect()
    }

    #[test]
    fn fcfs_within_a_class() {
        let mut q = WaitQueue::new(10);
        q.push("b", 0, 0.0, 200, ()).unwrap();
        q.push("a", 0, 0.0, 100, ()).unwrap();
        q.push("c", 0, 0.0, 200, ()).unwrap();
        assert_eq!(ids(&q), ["a", "b", "c"], "arrival, then push order");
    }

    #[test]
    fn strict_priority_class_first() {
        let mut q = WaitQueue::new(10);
        q.push("low-early", 0, 100.0, 0, ()).unwrap();
        q.push("high-late", 2, 0.0, 9_999, ()).unwrap();
        q.push("mid", 1, 0.0, 0, ()).unwrap();
        assert_eq!(ids(&q), ["high-late", "mid", "low-early"]);
    }

    #[test]
    fn priority_jump_moves_arrival_earlier() {
        let mut q = WaitQueue::new(10);
        q.push("first", 0, 0.0, 10_000, ()).unwrap();
        q.push("jumper", 0, 2.5, 12_000, ()).unwrap(); // effective 9.5 s
        q.push("small-jump", 0, 0.5, 10_400, ()).unwrap(); // effective 9.9 s
        q.push("negative", 0, -1.0, 9_500, ()).unwrap(); // effective 10.5 s
        assert_eq!(ids(&q), ["jumper", "small-jump", "first", "negative"]);
        assert_eq!(q.position("first"), Some(2));
        assert_eq!(q.pop().map(|e| e.request_id), Some("jumper".into()));
        assert_eq!(q.peek().map(|e| e.request_id.as_str()), Some("small-jump"));
    }

    #[test]
    fn bounded_and_unique() {
        let mut q = WaitQueue::new(2);
        q.push("a", 0, 0.0, 0, 1).unwrap();
        let e = q.push("a", 0, 0.0, 0, 2).unwrap_err();
        assert_eq!(e.code(), ErrorCode::FailedPrecondition);
        q.push("b", 0, 0.0, 0, 2).unwrap();
        let e = q.push("c", 9, 0.0, 0, 3).unwrap_err();
        assert_eq!(e.code(), ErrorCode::ResourceExhausted);
        assert!(e.to_string().contains("request c"), "{e}");
        let e = q.push("d", 0, f64::NAN, 0, 4).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArgument);
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn remove_by_id_and_reinsert_keeps_place() {
        let mut q = WaitQueue::new(3);
        q.push("a", 0, 0.0, 1, 'a').unwrap();
        q.push("b", 0, 0.0, 2, 'b').unwrap();
        q.push("c", 0, 0.0, 3, 'c').unwrap();
        assert_eq!(q.remove("b").map(|e| e.payload), Some('b'));
        assert_eq!(q.remove("b"), None);
        assert!(!q.contains("b"));
        let a = q.pop().unwrap();
        q.push("d", 0, 0.0, 4, 'd').unwrap();
        q.push("e", 0, 0.0, 5, 'e').unwrap();
        // Full now, but a popped entry goes back in its place.
        q.reinsert(a).unwrap();
        assert_eq!(ids(&q), ["a", "c", "d", "e"]);
        let dup = q.pop().unwrap();
        q.push("a", 0, 0.0, 9, 'x').unwrap_err(); // full
        q.push("z", 0, 0.0, 9, 'z').unwrap_err(); // full
        assert_eq!(q.len(), 3);
        q.reinsert(dup).unwrap();
        assert_eq!(
            q.pop().map(|e| (e.request_id, e.payload)),
            Some(("a".into(), 'a'))
        );
        while q.pop().is_some() {}
        assert!(q.is_empty());
        assert_eq!(q.position("a"), None);
    }

    #[test]
    fn extreme_jumps_do_not_wrap() {
        let mut q = WaitQueue::new(3);
        q.push("huge", 0, 1e300, u64::MAX, ()).unwrap();
        q.push("neg", 0, -1e300, 0, ()).unwrap();
        q.push("zero", 0, 0.0, 0, ()).unwrap();
        assert_eq!(ids(&q), ["huge", "zero", "neg"]);
    }
}
