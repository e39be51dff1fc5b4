//! Admission verdicts and the RESERVE commit, end to end with `select`.

use crate::types::RankMap;

use rand::SeedableRng;
use rand::rngs::StdRng;

use super::bookings::BookingLedger;
use super::*;
use crate::select::{
    AffinityMode, CostScorer, SelectConfig, SelectContext, SelectError, SessionRef, select,
};
use crate::types::BookedLoad;
use crate::types::{WorkerRank, WorkerSnapshot};

fn worker(id: u64) -> WorkerSnapshot {
    WorkerSnapshot {
        worker_id: id,
        model: "m".into(),
        endpoint: String::new(),
        block_size: 4,
        dp_size: 1,
        total_kv_blocks: 1_000,
        max_num_batched_tokens: 8,
        ..Default::default()
    }
}

fn request(id: &str, blocks: u64) -> SelectRequest {
    SelectRequest {
        request_id: id.into(),
        model: "m".into(),
        prompt_tokens: blocks * 4,
        block_size: 4,
        ..Default::default()
    }
}

struct World {
    workers: Vec<WorkerSnapshot>,
    overlaps: RankMap<u32>,
    cached: RankMap<u64>,
    ledger: BookingLedger,
    sessions: SessionTable,
}

impl World {
    fn new(n: u64) -> Self {
        Self {
            workers: (1..=n).map(worker).collect(),
            overlaps: RankMap::default(),
            cached: RankMap::default(),
            ledger: BookingLedger::new(),
            sessions: SessionTable::new(10_000),
        }
    }

    fn select(&self, req: &SelectRequest, now_ms: u64) -> Result<Selection, SelectError> {
        let ctx = SelectContext {
            workers: &self.workers,
            overlaps: &self.overlaps,
            tier_overlaps: &RankMap::default(),
            cached_blocks: &self.cached,
            booked: &self.ledger,
            sessions: &self.sessions,
            now_ms,
            prefill_timing: &(),
        };
        select(
            req,
            &ctx,
            &SelectConfig::default(),
            &CostScorer,
            &mut StdRng::seed_from_u64(9),
        )
    }

    fn route(&mut self, req: &SelectRequest, hashes: &[u64], now_ms: u64) -> WorkerRank {
        let s = self.select(req, now_ms).unwrap();
        commit(
            req,
            &s,
            hashes,
            &mut self.ledger,
            &mut self.sessions,
            now_ms,
            None,
        )
        .unwrap();
        s.target
    }
}

#[test]
fn verdicts_follow_mode_and_busyness() {
    let w = World::new(1);
    let mut s = w.select(&request("r", 1), 0).unwrap();
    assert_eq!(admit("r", AdmissionMode::Wait, &s), Ok(Admission::Admit));
    assert_eq!(admit("r", AdmissionMode::Reject, &s), Ok(Admission::Admit));
    assert_eq!(
        admit("r", AdmissionMode::Advisory, &s),
        Ok(Admission::Advisory)
    );
    s.all_busy = true;
    assert_eq!(admit("r", AdmissionMode::Wait, &s), Ok(Admission::Queue));
    assert_eq!(
        admit("r", AdmissionMode::Advisory, &s),
        Ok(Admission::Advisory)
    );
    let e = admit("r", AdmissionMode::Reject, &s).unwrap_err();
    assert_eq!(e.code(), ErrorCode::ResourceExhausted);
    assert!(e.to_string().contains("request r") && e.to_string().contains("worker 1"));
}

#[test]
fn query_only_changes_nothing() {
    let mut w = World::new(2);
    let mut req = request("q", 3);
    req.mode = SelectMode::QueryOnly;
    req.session = Some(SessionRef {
        session_id: "s".into(),
        mode: AffinityMode::Soft,
    });
    let s = w.select(&req, 0).unwrap();
    let booked = commit(
        &req,
        &s,
        &[1, 2, 3],
        &mut w.ledger,
        &mut w.sessions,
        0,
        None,
    )
    .unwrap();
    assert!(!booked);
    assert!(w.ledger.is_empty());
    assert!(w.sessions.is_empty());
}

#[test]
fn reserve_books_and_spreads_load() {
    let mut w = World::new(2);
    let first = w.route(&request("a", 3), &[1, 2, 3], 0);
    assert_eq!(
        w.ledger.load(first),
        BookedLoad {
            prefill_tokens: 12,
            prefill_blocks: 3,
            decode_blocks: 3,
            active_requests: 1
        }
    );
    // The next request sees the booking and goes to the other worker.
    let second = w.route(&request("b", 3), &[4, 5, 6], 0);
    assert_ne!(first, second);
    // Routing the same id twice is refused and changes nothing.
    let s = w.select(&request("a", 3), 0).unwrap();
    let e = commit(
        &request("a", 3),
        &s,
        &[1],
        &mut w.ledger,
        &mut w.sessions,
        0,
        None,
    )
    .unwrap_err();
    assert_eq!(e.code(), ErrorCode::FailedPrecondition);
    assert_eq!(w.ledger.len(), 2);
    // Draining.
    assert!(w.ledger.mark_prefill_complete("a"));
    assert_eq!(w.ledger.load(first).prefill_tokens, 0);
    assert!(w.ledger.release("a") && w.ledger.release("b"));
    assert_eq!(w.ledger.ranks_with_bookings(), 0);
}

#[test]
fn busy_worker_is_avoided_then_all_busy_queues() {
    let mut w = World::new(2);
    // 9 blocks = 36 uncached tokens > 4 * 8: the first booking makes it busy.
    let first = w.route(&request("a", 9), &[], 0);
    let s = w.select(&request("b", 1), 0).unwrap();
    assert_ne!(s.target, first);
    assert!(!s.all_busy);
    w.route(&request("b", 9), &[], 0);
    let s = w.select(&request("c", 1), 0).unwrap();
    assert!(s.all_busy);
    assert_eq!(admit("c", AdmissionMode::Wait, &s), Ok(Admission::Queue));
    w.ledger.mark_prefill_complete("a");
    let s = w.select(&request("c", 1), 0).unwrap();
    assert_eq!((s.target, s.all_busy), (first, false));
}

#[test]
fn sessions_bind_on_reserve_and_hard_mode_follows() {
    let mut w = World::new(3);
    let mut req = request("t1", 2);
    req.session = Some(SessionRef {
        session_id: "chat".into(),
        mode: AffinityMode::Hard,
    });
    let bound = w.route(&req, &[1, 2], 0);
    assert_eq!(
        w.sessions.lookup("chat", 0),
        Some(crate::select::PinTarget::from(bound))
    );
    // Load elsewhere is lower, but HARD affinity pins the next turn.
    for turn in 2..5 {
        let mut next = req.clone();
        next.request_id = format!("t{turn}");
        assert_eq!(w.route(&next, &[1, 2, 3], turn * 1_000), bound);
    }
    // The worker goes away: a HARD session now fails NOT_FOUND ...
    w.workers.retain(|x| x.worker_id != bound.worker_id);
    let mut next = req.clone();
    next.request_id = "t9".into();
    assert_eq!(
        w.select(&next, 5_000).unwrap_err().code(),
        ErrorCode::NotFound
    );
    // ... until the registry drops the worker's sessions.
    assert_eq!(w.sessions.remove_worker(bound.worker_id), 1);
    assert_ne!(w.route(&next, &[1], 5_000), bound);
}

#[test]
fn decode_phase_books_no_prefill() {
    let mut w = World::new(1);
    let mut req = request("d", 2);
    req.phase = crate::types::RequestPhase::Decode;
    let t = w.route(&req, &[1, 2], 0);
    let load = w.ledger.load(t);
    assert_eq!((load.prefill_tokens, load.decode_blocks), (0, 2));
}
