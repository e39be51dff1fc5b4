//! The last few hundred routing decisions, for the operators' web view
//! (#37): each decision's target and overlap, and its best candidates with
//! the overlap, load and score ExplainSelection would report for them.
//!
//! Invariants: request ids only (cut to [`MAX_REQUEST_ID`] bytes), never
//! prompt text or hashes of it; bounded at [`KEPT`] decisions of at most
//! [`CANDIDATES_KEPT`] candidates each, whatever the fleet's size (the
//! candidates are picked in one pass, no sort); one short lock a decision.

use std::{collections::VecDeque, sync::Arc};

use parking_lot::Mutex;

use kvroute_core::select::{CandidateReport, Selection};

/// Decisions kept.
pub const KEPT: usize = 300;
/// Candidates kept of each decision: the chosen one and the best others.
pub const CANDIDATES_KEPT: usize = 8;
/// Bytes of a request id kept.
pub const MAX_REQUEST_ID: usize = 64;

/// One candidate as the decision saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct CandidateSeen {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub eligible: bool,
    pub busy: bool,
    pub chosen: bool,
    pub overlap_blocks: u32,
    /// Booked prefill tokens and active requests on it.
    pub booked_prefill_tokens: u64,
    pub booked_requests: u64,
    /// Its score: `None` when it was not scored.
    pub prefill_cost: Option<f64>,
    pub decode_cost: Option<f64>,
    pub probability: Option<f64>,
}

/// One decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Its number since the start (the view asks for those after one).
    pub seq: u64,
    pub at_unix_ms: u64,
    pub request_id: String,
    pub model: String,
    /// `admitted`, `advisory`, `query_only`, ... as `kvroute_decisions_total`.
    pub outcome: &'static str,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub overlap_blocks: u32,
    pub total_blocks: u32,
    pub policy: &'static str,
    /// Candidates in all, and the ones kept.
    pub candidates_total: usize,
    pub candidates: Vec<CandidateSeen>,
}

/// The kept decisions.
#[derive(Debug, Default)]
pub struct DecisionLog {
    inner: Mutex<Kept>,
}

#[derive(Debug, Default)]
struct Kept {
    next_seq: u64,
    decisions: VecDeque<Arc<Decision>>,
}

fn seen(c: &CandidateReport) -> CandidateSeen {
    let score = c.score.as_ref();
    CandidateSeen {
        worker_id: c.target.worker_id,
        dp_rank: c.target.dp_rank,
        eligible: c.eligible.is_ok(),
        busy: c.busy.is_some(),
        chosen: c.chosen,
        overlap_blocks: c.overlap_blocks,
        booked_prefill_tokens: c.booked.prefill_tokens,
        booked_requests: c.booked.active_requests,
        prefill_cost: score.map(|s| s.prefill_cost),
        decode_cost: score.map(|s| s.decode_cost),
        probability: score.map(|s| s.probability),
    }
}

/// Whether `a` is a better candidate to show than `b`: chosen, then
/// scored by probability, then by overlap.
fn shown_before(a: &CandidateReport, b: &CandidateReport) -> bool {
    let key = |c: &CandidateReport| {
        (
            c.chosen,
            c.score.as_ref().map_or(-1.0, |s| s.probability),
            c.overlap_blocks,
        )
    };
    let (ka, kb) = (key(a), key(b));
    (ka.0, ka.1, ka.2) > (kb.0, kb.1, kb.2)
}

/// The chosen candidate and the best others, best first, in one pass.
fn best_candidates(candidates: &[CandidateReport]) -> Vec<CandidateSeen> {
    let mut best: Vec<&CandidateReport> = Vec::with_capacity(CANDIDATES_KEPT + 1);
    for candidate in candidates {
        let at = best
            .iter()
            .position(|kept| shown_before(candidate, kept))
            .unwrap_or(best.len());
        if at < CANDIDATES_KEPT {
            best.insert(at, candidate);
            best.truncate(CANDIDATES_KEPT);
        }
    }
    best.into_iter().map(seen).collect()
}

fn cut(text: &str, bytes: usize) -> String {
    let mut end = text.len().min(bytes);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

impl DecisionLog {
    /// Keeps one decision, dropping the oldest past [`KEPT`].
    pub(crate) fn record(
        &self,
        request_id: &str,
        model: &str,
        outcome: &'static str,
        selection: &Selection,
    ) {
        let candidates = best_candidates(&selection.candidates);
        let at_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut decision = Decision {
            seq: 0,
            at_unix_ms,
            request_id: cut(request_id, MAX_REQUEST_ID),
            model: cut(model, MAX_REQUEST_ID),
            outcome,
            worker_id: selection.target.worker_id,
            dp_rank: selection.target.dp_rank,
            overlap_blocks: selection.overlap_blocks,
            total_blocks: selection.total_blocks,
            policy: selection.policy,
            candidates_total: selection.candidates.len(),
            candidates,
        };
        let mut kept = self.inner.lock();
        kept.next_seq += 1;
        decision.seq = kept.next_seq;
        if kept.decisions.len() >= KEPT {
            kept.decisions.pop_front();
        }
        kept.decisions.push_back(Arc::new(decision));
    }

    /// The kept decisions numbered after `after`, newest last, at most
    /// `limit` (the newest of them).
    pub fn after(&self, after: u64, limit: usize) -> Vec<Arc<Decision>> {
        let kept = self.inner.lock();
        let newer: Vec<_> = kept
            .decisions
            .iter()
            .filter(|d| d.seq > after)
            .cloned()
            .collect();
        let skip = newer.len().saturating_sub(limit);
        newer.into_iter().skip(skip).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::{
        select::CandidateScore,
        types::{BookedLoad, WorkerRank},
    };

    fn candidate(worker_id: u64, overlap: u32, probability: Option<f64>) -> CandidateReport {
        CandidateReport {
            tiers: kvroute_core::index::TierBlocks::device(overlap),
            effective_overlap_blocks: f64::from(overlap),
            loads_adapter: false,
            target: WorkerRank {
                worker_id,
                dp_rank: 0,
            },
            eligible: Ok(()),
            busy: None,
            overlap_blocks: overlap,
            potential_prefill_tokens: 0,
            potential_prefill_blocks: 0,
            potential_decode_blocks: 0,
            booked: BookedLoad::default(),
            score: probability.map(|p| CandidateScore {
                prefill_cost: 1.0,
                decode_cost: 1.0,
                cost: 1.0,
                logit: None,
                probability: p,
                ttft: None,
            }),
            chosen: false,
            view: Default::default(),
        }
    }

    #[test]
    fn the_chosen_and_the_best_candidates_are_kept_of_a_thousand() {
        let mut all: Vec<_> = (0..1000u64)
            .map(|w| candidate(w, (w % 50) as u32, Some(w as f64 / 1000.0)))
            .collect();
        all[3].chosen = true;
        let kept = best_candidates(&all);
        assert_eq!(kept.len(), CANDIDATES_KEPT);
        assert_eq!(kept[0].worker_id, 3);
        let others: Vec<u64> = kept[1..].iter().map(|c| c.worker_id).collect();
        assert_eq!(others, [999, 998, 997, 996, 995, 994, 993]);
    }

    #[test]
    fn the_log_keeps_the_newest_and_cuts_long_ids() {
        let log = DecisionLog::default();
        let selection = Selection {
            tiers: kvroute_core::index::TierBlocks::device(2),
            target: WorkerRank {
                worker_id: 1,
                dp_rank: 0,
            },
            route: kvroute_core::select::Route::Scored,
            overlap_blocks: 2,
            effective_overlap_blocks: 2.0,
            cached_tokens: 32,
            total_blocks: 4,
            request_prefill_tokens: 32,
            request_prefill_blocks: 2,
            potential_prefill_tokens: 32,
            potential_prefill_blocks: 2,
            potential_decode_blocks: 4,
            booked: BookedLoad::default(),
            reported: Default::default(),
            busy: None,
            all_busy: false,
            policy: "cost",
            candidates: vec![candidate(1, 2, None)],
        };
        for _ in 0..(KEPT + 50) {
            log.record(&"é".repeat(100), "m", "admitted", &selection);
        }
        let all = log.after(0, usize::MAX);
        assert_eq!(all.len(), KEPT);
        assert_eq!(all.last().unwrap().seq, (KEPT + 50) as u64);
        assert!(all[0].request_id.len() <= MAX_REQUEST_ID);
        assert_eq!(log.after(all.last().unwrap().seq - 3, 2).len(), 2);
    }
}
