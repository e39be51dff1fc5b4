//! Behaviour tests of the whole decision (the reference's tests re-expressed
//! through `select`, plus scoring scenarios).

use crate::types::RankMap;
use std::collections::{HashMap, HashSet};

use rand::SeedableRng;
use rand::rngs::StdRng;

use super::*;
use crate::types::BookedLoad;
use crate::types::{RankLoad, WorkerRole};

const BS: u32 = 4;

fn worker(id: WorkerId, dp_size: u32) -> WorkerSnapshot {
    WorkerSnapshot {
        worker_id: id,
        model: "m".into(),
        endpoint: String::new(),
        role: WorkerRole::Aggregated,
        block_size: BS,
        dp_start_rank: 0,
        dp_size,
        total_kv_blocks: 1_000,
        max_num_batched_tokens: 100,
        ..Default::default()
    }
}

fn request(blocks: u64) -> SelectRequest {
    SelectRequest {
        request_id: "req-1".into(),
        model: "m".into(),
        prompt_tokens: blocks * u64::from(BS),
        block_size: BS,
        ..Default::default()
    }
}

fn wr(w: WorkerId, r: DpRank) -> WorkerRank {
    WorkerRank::new(w, r)
}

#[derive(Default)]
struct Fixture {
    workers: Vec<WorkerSnapshot>,
    overlaps: RankMap<u32>,
    tier_overlaps: RankMap<TierBlocks>,
    cached: RankMap<u64>,
    booked: HashMap<WorkerRank, BookedLoad>,
    sessions: SessionTable,
    config: SelectConfig,
    now_ms: u64,
}

impl Fixture {
    fn with(workers: Vec<WorkerSnapshot>) -> Self {
        Self {
            workers,
            ..Default::default()
        }
    }

    fn run_seeded(&self, req: &SelectRequest, seed: u64) -> Result<Selection, SelectError> {
        let ctx = SelectContext {
            workers: &self.workers,
            overlaps: &self.overlaps,
            tier_overlaps: &self.tier_overlaps,
            cached_blocks: &self.cached,
            booked: &self.booked,
            sessions: &self.sessions,
            now_ms: self.now_ms,
            prefill_timing: &(),
        };
        let mut rng = StdRng::seed_from_u64(seed);
        select(req, &ctx, &self.config, &CostScorer, &mut rng)
    }

    fn run(&self, req: &SelectRequest) -> Result<Selection, SelectError> {
        self.run_seeded(req, 0)
    }
}

fn busy_load() -> BookedLoad {
    BookedLoad {
        prefill_tokens: 10_000,
        ..Default::default()
    }
}

// ---- reference behaviours, through `select` -------------------------------

#[test]
fn explicit_dp_rank_zero_is_a_rank_not_unset() {
    let f = Fixture::with(vec![worker(7, 2), worker(8, 1)]);
    let mut req = request(2);
    req.hints.backend_instance_id = Some(7);
    req.hints.dp_rank = Some(0);
    let s = f.run(&req).unwrap();
    assert_eq!(s.target, wr(7, 0));
    assert_eq!(s.route, Route::Pinned(PinSource::Hint));
}

#[test]
fn pin_without_rank_uses_the_workers_only_rank() {
    let mut w = worker(7, 1);
    w.dp_start_rank = 3;
    let f = Fixture::with(vec![w]);
    let mut req = request(2);
    req.hints.backend_instance_id = Some(7);
    assert_eq!(f.run(&req).unwrap().target, wr(7, 3));
}

#[test]
fn pin_without_rank_to_multi_rank_worker_fails() {
    let f = Fixture::with(vec![worker(7, 4)]);
    let mut req = request(2);
    req.hints.backend_instance_id = Some(7);
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FailedPrecondition);
    let msg = e.to_string();
    assert!(msg.contains("requires an explicit dp_rank"), "{msg}");
    assert!(msg.contains("req-1") && msg.contains("worker 7"), "{msg}");
    // With an explicit rank it routes.
    req.hints.dp_rank = Some(2);
    assert_eq!(f.run(&req).unwrap().target, wr(7, 2));
}

#[test]
fn phase_selects_the_pinning_hint() {
    let mut f = Fixture::with(vec![worker(1, 8), worker(2, 8), worker(5, 8)]);
    f.workers[1].role = WorkerRole::Prefill;
    f.workers[2].role = WorkerRole::Decode;
    let mut req = request(2);
    req.hints = RoutingHints {
        backend_instance_id: Some(1),
        prefill_worker_id: Some(2),
        decode_worker_id: Some(5),
        dp_rank: Some(3),
        prefill_dp_rank: Some(4),
        ..Default::default()
    };
    req.phase = RequestPhase::Prefill;
    assert_eq!(f.run(&req).unwrap().target, wr(2, 4));
    req.phase = RequestPhase::Decode;
    assert_eq!(f.run(&req).unwrap().target, wr(5, 3));
    // Aggregated also reads the decode hint; worker 5 is a decode worker,
    // so the pin is refused as ineligible rather than silently re-routed.
    req.phase = RequestPhase::Aggregated;
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FailedPrecondition);
    assert!(e.to_string().contains("worker 5 dp_rank 3"), "{e}");
    f.workers[2].role = WorkerRole::Aggregated;
    assert_eq!(f.run(&req).unwrap().target, wr(5, 3));
    // Without a decode hint, the backend instance pins.
    req.hints.decode_worker_id = None;
    assert_eq!(f.run(&req).unwrap().target, wr(1, 3));
}

#[test]
fn affinity_rank_is_borrowed_by_matching_explicit_pin() {
    let mut f = Fixture::with(vec![worker(7, 4), worker(8, 1)]);
    f.sessions.bind("s", PinTarget::new(7, Some(0)), 0);
    let mut req = request(2);
    req.session = Some(SessionRef {
        session_id: "s".into(),
        mode: AffinityMode::Hard,
    });
    req.hints.backend_instance_id = Some(7);
    let s = f.run(&req).unwrap();
    assert_eq!(s.target, wr(7, 0), "explicit worker borrows rank 0");
    assert_eq!(s.route, Route::Pinned(PinSource::Hint));
    // An explicit rank of its own is kept.
    req.hints.dp_rank = Some(2);
    assert_eq!(f.run(&req).unwrap().target, wr(7, 2));
    // No explicit pin: the affinity pins.
    req.hints = RoutingHints::default();
    let s = f.run(&req).unwrap();
    assert_eq!(
        (s.target, s.route),
        (wr(7, 0), Route::Pinned(PinSource::Affinity))
    );
}

#[test]
fn worker_only_affinity_narrows_the_allowed_set() {
    let mut f = Fixture::with(vec![worker(7, 2), worker(8, 1)]);
    f.overlaps.insert(wr(8, 0), 4); // worker 8 would win on cache
    f.overlaps.insert(wr(7, 1), 1);
    f.sessions.bind("s", PinTarget::new(7, None), 0);
    let mut req = request(4);
    req.session = Some(SessionRef {
        session_id: "s".into(),
        mode: AffinityMode::Hard,
    });
    let s = f.run(&req).unwrap();
    assert_eq!(s.target, wr(7, 1), "scored among worker 7's ranks");
    assert_eq!(s.route, Route::Scored);
    let c8 = s.candidates.iter().find(|c| c.target == wr(8, 0)).unwrap();
    assert_eq!(c8.eligible, Err(Ineligible::NotAllowed));
    // An explicit pin of the same worker without a rank adds nothing.
    req.hints.backend_instance_id = Some(7);
    assert_eq!(f.run(&req).unwrap().target, wr(7, 1));
    // An explicit pin of another worker is not in the narrowed set.
    req.hints.backend_instance_id = Some(8);
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FailedPrecondition);
    assert!(e.to_string().contains("not in the allowed set"), "{e}");
    // The session's worker left the registry: NOT_FOUND, naming it.
    req.hints.backend_instance_id = None;
    f.workers.retain(|w| w.worker_id != 7);
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotFound);
    assert!(e.to_string().contains("worker 7"), "{e}");
}

#[test]
fn planned_worker_must_agree_with_the_pin() {
    let f = Fixture::with(vec![worker(3, 2), worker(4, 2)]);
    let mut req = request(2);
    req.planned_worker = Some(wr(3, 1));
    req.hints.backend_instance_id = Some(4);
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FailedPrecondition);
    let msg = e.to_string();
    assert!(
        msg.contains("worker 3 dp_rank 1") && msg.contains("worker 4"),
        "{msg}"
    );
    // Same worker, conflicting rank.
    req.hints.backend_instance_id = Some(3);
    req.hints.dp_rank = Some(0);
    assert!(f.run(&req).is_err());
    // Same worker, no rank: agrees.
    req.hints.dp_rank = None;
    let s = f.run(&req).unwrap();
    assert_eq!(
        (s.target, s.route),
        (wr(3, 1), Route::Pinned(PinSource::Planned))
    );
    // No pin at all: the planned worker is used.
    req.hints = RoutingHints::default();
    assert_eq!(f.run(&req).unwrap().target, wr(3, 1));
}

#[test]
fn migration_exclusions_and_exhaustion() {
    let mut f = Fixture::with(vec![worker(1, 1), worker(2, 1), worker(3, 1)]);
    f.workers[2].taints = vec!["spot".into()];
    f.overlaps.insert(wr(1, 0), 2);
    let mut req = request(2);
    req.excluded_worker_ids = HashSet::from([1]);
    let s = f.run(&req).unwrap();
    assert_eq!(s.target, wr(2, 0), "1 excluded, 3 tainted");
    req.excluded_worker_ids = HashSet::from([2, 1]);
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Unavailable);
    let msg = e.to_string();
    assert!(msg.contains("exhausted") && msg.contains("[1, 2]"), "{msg}");
    // Tolerating the taint leaves worker 3.
    req.hints.tolerated_taints = vec!["spot".into()];
    assert_eq!(f.run(&req).unwrap().target, wr(3, 0));
    // An explicit pin ignores exclusions.
    req.hints.tolerated_taints.clear();
    req.hints.backend_instance_id = Some(1);
    assert_eq!(f.run(&req).unwrap().target, wr(1, 0));
}

#[test]
fn pinned_worker_must_be_known_and_eligible() {
    let mut f = Fixture::with(vec![worker(1, 2), worker(2, 1)]);
    let mut req = request(2);
    req.hints.backend_instance_id = Some(99);
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotFound);
    assert!(e.to_string().contains("worker 99") && e.to_string().contains("req-1"));
    req.hints.backend_instance_id = Some(1);
    req.hints.dp_rank = Some(5);
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FailedPrecondition);
    assert!(e.to_string().contains("outside the worker's ranks"), "{e}");
    req.hints.dp_rank = None;
    req.hints.backend_instance_id = Some(2);
    f.workers[1].cordoned = true;
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FailedPrecondition);
    assert!(e.to_string().contains("cordoned"), "{e}");
    f.workers[1].cordoned = false;
    req.hints.allowed_worker_ids = Some(HashSet::from([1]));
    assert_eq!(
        f.run(&req).unwrap_err().code(),
        ErrorCode::FailedPrecondition
    );
}

#[test]
fn affinity_validation_ignores_transient_overload() {
    let mut f = Fixture::with(vec![worker(7, 1), worker(8, 1)]);
    f.booked.insert(wr(7, 0), busy_load());
    // Unpinned scheduling skips the busy worker while another is idle.
    let mut req = request(2);
    let s = f.run(&req).unwrap();
    assert_eq!(s.target, wr(8, 0));
    assert!(!s.all_busy);
    let c7 = s.candidates.iter().find(|c| c.target == wr(7, 0)).unwrap();
    assert!(c7.eligible.is_ok() && c7.busy.is_some() && c7.score.is_none());
    // A HARD affinity to the busy worker is still valid.
    f.sessions.bind("s", PinTarget::new(7, Some(0)), 0);
    req.session = Some(SessionRef {
        session_id: "s".into(),
        mode: AffinityMode::Hard,
    });
    let s = f.run(&req).unwrap();
    assert_eq!(s.target, wr(7, 0));
    assert!(matches!(s.busy, Some(Busy::PrefillBacklog { .. })));
    assert!(s.all_busy, "the caller decides whether to wait");
}

#[test]
fn a_backlogged_candidate_holding_the_prompt_is_still_scored() {
    let mut f = Fixture::with(vec![worker(7, 1), worker(8, 1)]);
    // Worker 7 is busy with 1,000 booked prefill tokens (over 4 x 100) but
    // holds 600 of the prompt's 640 blocks (2,560 tokens); worker 8 holds
    // none.
    let backlog = BookedLoad {
        prefill_tokens: 1_000,
        ..Default::default()
    };
    f.booked.insert(wr(7, 0), backlog);
    f.overlaps.insert(wr(7, 0), 600);
    let req = request(640);
    let s = f.run(&req).unwrap();
    let c7 = s.candidates.iter().find(|c| c.target == wr(7, 0)).unwrap();
    assert!(c7.busy.is_some() && c7.score.is_some());
    assert_eq!(s.target, wr(7, 0), "1,000 + 160 tokens beat 2,560");
    assert!(!s.all_busy);
    // Holding less, its queue and remainder (1,000 + 1,760) are longer
    // than the whole prompt on the idle worker: skipped as before.
    f.overlaps.insert(wr(7, 0), 200);
    let s = f.run(&req).unwrap();
    let c7 = s.candidates.iter().find(|c| c.target == wr(7, 0)).unwrap();
    assert!(c7.busy.is_some() && c7.score.is_none());
    assert_eq!(s.target, wr(8, 0));
    // Busy by KV usage it is skipped whatever it holds: the prompt's
    // decode needs room it does not have.
    f.overlaps.insert(wr(7, 0), 640);
    f.booked.remove(&wr(7, 0));
    f.workers[0].load = vec![(
        0,
        RankLoad {
            kv_blocks_used: 990,
            ..Default::default()
        },
    )];
    let s = f.run(&req).unwrap();
    assert_eq!(s.target, wr(8, 0));
}

// ---- scoring scenarios -----------------------------------------------------

/// A tiny index: each worker holds block sequences; overlap is the longest
/// cached prefix, the total is the number of distinct cached prefixes.
fn index(held: &[(WorkerId, Vec<Vec<char>>)], prompt: &[char]) -> (RankMap<u32>, RankMap<u64>) {
    let mut overlaps = RankMap::default();
    let mut totals = RankMap::default();
    for (w, seqs) in held {
        let mut prefixes: HashSet<Vec<char>> = HashSet::new();
        for s in seqs {
            for i in 1..=s.len() {
                prefixes.insert(s[..i].to_vec());
            }
        }
        let overlap = (1..=prompt.len())
            .take_while(|&i| prefixes.contains(&prompt[..i]))
            .count();
        overlaps.insert(wr(*w, 0), overlap as u32);
        totals.insert(wr(*w, 0), prefixes.len() as u64);
    }
    (overlaps, totals)
}

fn seven_blocks(prompt: &[char]) -> Fixture {
    let held = vec![
        (1, vec![vec!['A', 'B'], vec!['A', 'C', 'D']]),
        (2, vec![vec!['A', 'C', 'E']]),
    ];
    let (overlaps, cached) = index(&held, prompt);
    Fixture {
        overlaps,
        cached,
        ..Fixture::with(vec![worker(1, 1), worker(2, 1)])
    }
}

#[test]
fn seven_blocks_longest_prefix_wins() {
    let prompt = ['A', 'C', 'D', 'F'];
    let f = seven_blocks(&prompt);
    assert_eq!(f.cached[&wr(1, 0)], 4);
    assert_eq!(f.cached[&wr(2, 0)], 3);
    let s = f.run(&request(prompt.len() as u64)).unwrap();
    assert_eq!(s.target, wr(1, 0));
    assert_eq!(s.overlap_blocks, 3);
    assert_eq!(s.effective_overlap_blocks, 3.0);
    assert_eq!(s.cached_tokens, 3 * u64::from(BS));
    assert_eq!(s.total_blocks, 4);
    assert_eq!(s.potential_prefill_blocks, 1);
    assert_eq!(s.potential_prefill_tokens, u64::from(BS));
    assert_eq!(s.potential_decode_blocks, 4);
    let costs: Vec<f64> = s.candidates.iter().map(|c| c.score.unwrap().cost).collect();
    assert_eq!(costs, vec![5.0, 6.0]);
}

#[test]
fn seven_blocks_tie_goes_to_fewer_cached_blocks() {
    let prompt = ['A', 'C', 'G'];
    let f = seven_blocks(&prompt);
    assert_eq!(f.overlaps[&wr(1, 0)], 2);
    assert_eq!(f.overlaps[&wr(2, 0)], 2);
    for seed in 0..16 {
        let s = f.run_seeded(&request(3), seed).unwrap();
        assert_eq!(s.target, wr(2, 0), "seed {seed}");
        assert_eq!(s.overlap_blocks, 2);
    }
}

#[test]
fn booked_load_shifts_the_choice() {
    let prompt = ['A', 'C', 'D', 'F'];
    let mut f = seven_blocks(&prompt);
    // Worker 1 wins unloaded (5 vs 6); two decode blocks booked on it flip it.
    f.booked.insert(
        wr(1, 0),
        BookedLoad {
            decode_blocks: 2,
            active_requests: 1,
            ..Default::default()
        },
    );
    let s = f.run(&request(4)).unwrap();
    assert_eq!(s.target, wr(2, 0));
    let c1 = &s.candidates[0];
    assert_eq!(c1.score.unwrap().cost, 7.0);
    assert_eq!(c1.potential_decode_blocks, 6);
    // Booked prefill counts through the overlap weight.
    f.booked.insert(
        wr(1, 0),
        BookedLoad {
            prefill_blocks: 1,
            ..Default::default()
        },
    );
    assert_eq!(
        f.run(&request(4)).unwrap().target,
        wr(2, 0),
        "6 vs 6: fewer cached"
    );
    let mut req = request(4);
    req.overrides.overlap_weight = Some(0.5);
    // Worker 1: 0.5*2 + 4 = 5; worker 2: 0.5*2 + 4 = 5; tie -> fewer cached.
    assert_eq!(f.run(&req).unwrap().target, wr(2, 0));
    req.overrides.overlap_weight = Some(0.0);
    // Pure decode balance: 4 vs 4, tie again; a decode booking on 2 flips it.
    f.booked.insert(
        wr(2, 0),
        BookedLoad {
            decode_blocks: 1,
            ..Default::default()
        },
    );
    assert_eq!(f.run(&req).unwrap().target, wr(1, 0));
}

#[test]
fn temperature_sampling_is_deterministic_per_seed() {
    let prompt = ['A', 'C', 'D', 'F'];
    let mut f = seven_blocks(&prompt);
    f.config.temperature = 1.0;
    let req = request(4);
    let picks: Vec<WorkerRank> = (0..64)
        .map(|seed| f.run_seeded(&req, seed).unwrap().target)
        .collect();
    let again: Vec<WorkerRank> = (0..64)
        .map(|seed| f.run_seeded(&req, seed).unwrap().target)
        .collect();
    assert_eq!(picks, again);
    assert!(picks.contains(&wr(1, 0)) && picks.contains(&wr(2, 0)));
    let s = f.run_seeded(&req, 5).unwrap();
    let p: Vec<f64> = s
        .candidates
        .iter()
        .map(|c| c.score.unwrap().probability)
        .collect();
    // Normalised costs 0 and 1 -> logits 0 and -1.
    let expected = 1.0 / (1.0 + (-1.0f64).exp());
    assert!((p[0] - expected).abs() < 1e-12 && (p[0] + p[1] - 1.0).abs() < 1e-12);
    // Temperature override 0 is deterministic again.
    let mut cold = req.clone();
    cold.overrides.temperature = Some(0.0);
    assert!((0..16).all(|seed| f.run_seeded(&cold, seed).unwrap().target == wr(1, 0)));
}

#[test]
fn soft_affinity_prefers_but_does_not_pin() {
    let prompt = ['A', 'C', 'G'];
    let mut f = seven_blocks(&prompt);
    f.sessions.bind("s", PinTarget::new(1, None), 0);
    let mut req = request(3);
    req.session = Some(SessionRef {
        session_id: "s".into(),
        mode: AffinityMode::Soft,
    });
    // A tie that would go to 2 goes to the session's worker 1.
    let s = f.run(&req).unwrap();
    assert_eq!((s.target, s.route), (wr(1, 0), Route::Scored));
    // Much better elsewhere: the session's worker loses.
    f.booked.insert(
        wr(1, 0),
        BookedLoad {
            decode_blocks: 10,
            ..Default::default()
        },
    );
    assert_eq!(f.run(&req).unwrap().target, wr(2, 0));
    // An ineligible SOFT target is ignored, not an error.
    f.workers[0].cordoned = true;
    f.booked.clear();
    assert_eq!(f.run(&req).unwrap().target, wr(2, 0));
    // An expired session is no preference.
    f.workers[0].cordoned = false;
    f.now_ms = f.sessions.ttl_ms() + 1;
    assert_eq!(f.run(&req).unwrap().target, wr(2, 0));
}

#[test]
fn all_busy_returns_the_best_busy_candidate() {
    let mut f = Fixture::with(vec![worker(1, 1), worker(2, 1)]);
    f.booked.insert(wr(1, 0), busy_load());
    f.workers[1].load = vec![(
        0,
        RankLoad {
            kv_blocks_used: 990,
            ..Default::default()
        },
    )];
    f.overlaps.insert(wr(2, 0), 2);
    let s = f.run(&request(2)).unwrap();
    assert!(s.all_busy);
    assert_eq!(s.target, wr(2, 0));
    assert_eq!(
        s.busy,
        Some(Busy::KvUsage {
            used: 990,
            total: 1_000
        })
    );
    assert_eq!(s.reported.kv_blocks_used, 990);
    assert!(s.candidates.iter().all(|c| c.score.is_some()));
}

#[test]
fn roles_models_and_no_eligible_worker() {
    let mut f = Fixture::with(vec![worker(1, 1), worker(2, 1), worker(3, 1)]);
    f.workers[0].role = WorkerRole::Decode;
    f.workers[1].role = WorkerRole::Prefill;
    f.workers[2].model = "other".into();
    let mut req = request(2);
    req.phase = RequestPhase::Prefill;
    let s = f.run(&req).unwrap();
    assert_eq!(s.target, wr(2, 0));
    assert!(matches!(
        s.candidates[0].eligible,
        Err(Ineligible::RoleMismatch { .. })
    ));
    assert!(matches!(
        s.candidates[2].eligible,
        Err(Ineligible::ModelMismatch { .. })
    ));
    f.workers[1].cordoned = true;
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Unavailable);
    assert!(e.to_string().contains("req-1"), "{e}");
    let e = Fixture::default().run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Unavailable);
}

#[test]
fn invalid_requests_and_block_size_mismatch() {
    let f = Fixture::with(vec![worker(1, 1)]);
    let mut req = request(0);
    assert_eq!(f.run(&req).unwrap_err().code(), ErrorCode::InvalidArgument);
    req = request(1);
    req.overrides.temperature = Some(-1.0);
    assert_eq!(f.run(&req).unwrap_err().code(), ErrorCode::InvalidArgument);
    req = request(1);
    req.overrides.overlap_weight = Some(f64::NAN);
    assert_eq!(f.run(&req).unwrap_err().code(), ErrorCode::InvalidArgument);
    req = request(1);
    req.block_size = 8;
    let e = f.run(&req).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FailedPrecondition);
    assert!(e.to_string().contains("worker 1"), "{e}");
    req = request(1);
    req.request_id.clear();
    assert_eq!(f.run(&req).unwrap_err().code(), ErrorCode::InvalidArgument);
}

#[test]
fn partial_last_block_counts_in_totals_but_not_in_cache() {
    let mut f = Fixture::with(vec![worker(1, 1)]);
    f.overlaps.insert(wr(1, 0), 99); // index over-reports: clamped
    let mut req = request(2);
    req.prompt_tokens = 2 * u64::from(BS) + 1;
    let s = f.run(&req).unwrap();
    assert_eq!(s.total_blocks, 3);
    assert_eq!(s.overlap_blocks, 3);
    assert_eq!(s.cached_tokens, req.prompt_tokens);
    assert_eq!(s.request_prefill_tokens, 0);
    f.overlaps.insert(wr(1, 0), 2);
    let s = f.run(&req).unwrap();
    assert_eq!(s.cached_tokens, 2 * u64::from(BS));
    assert_eq!((s.request_prefill_tokens, s.request_prefill_blocks), (1, 1));
}

#[test]
fn explain_lists_every_rank_in_order() {
    let mut f = Fixture::with(vec![worker(2, 2), worker(1, 1)]);
    f.workers[0].cordoned = true;
    let s = f.run(&request(1)).unwrap();
    let targets: Vec<WorkerRank> = s.candidates.iter().map(|c| c.target).collect();
    assert_eq!(targets, vec![wr(1, 0), wr(2, 0), wr(2, 1)]);
    assert_eq!(s.candidates[1].eligible, Err(Ineligible::Cordoned));
    assert_eq!(s.candidates.iter().filter(|c| c.chosen).count(), 1);
    assert_eq!(s.policy, "cost");
    // Pinned: the others are reported as not pinned.
    f.workers[0].cordoned = false;
    let mut req = request(1);
    req.hints.backend_instance_id = Some(2);
    req.hints.dp_rank = Some(1);
    let s = f.run(&req).unwrap();
    assert_eq!(s.candidates[0].eligible, Err(Ineligible::NotPinned));
    assert!(s.candidates[2].chosen && s.candidates[2].score.is_some());
}

#[test]
fn config_validation() {
    assert_eq!(SelectConfig::default().validate(), Ok(()));
    let bad = SelectConfig {
        soft_affinity_discount: 1.0,
        ..Default::default()
    };
    assert!(bad.validate().is_err());
    let bad = SelectConfig {
        temperature: f64::INFINITY,
        ..Default::default()
    };
    assert!(bad.validate().is_err());
    let bad = SelectConfig {
        adapter_load_tokens: MAX_ADAPTER_LOAD_TOKENS + 1,
        ..Default::default()
    };
    assert!(bad.validate().is_err());
}

/// A second policy, as a new implementation of the trait: fewest active
/// requests wins, first on ties.
struct FewestActive;

impl Scorer for FewestActive {
    fn name(&self) -> &'static str {
        "fewest-active"
    }

    fn score(
        &self,
        candidates: &[ScoreInput],
        _params: &ScoreParams,
        _rng: &mut dyn RngCore,
    ) -> Option<scoring::ScoreOutcome> {
        let chosen = (0..candidates.len()).min_by_key(|&i| candidates[i].booked.active_requests)?;
        let scores = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| CandidateScore {
                cost: c.booked.active_requests as f64,
                probability: if i == chosen { 1.0 } else { 0.0 },
                ..Default::default()
            })
            .collect();
        Some(scoring::ScoreOutcome { scores, chosen })
    }
}

/// A policy that breaks the contract.
struct Broken;

impl Scorer for Broken {
    fn name(&self) -> &'static str {
        "broken"
    }

    fn score(
        &self,
        _: &[ScoreInput],
        _: &ScoreParams,
        _: &mut dyn RngCore,
    ) -> Option<scoring::ScoreOutcome> {
        Some(scoring::ScoreOutcome {
            scores: vec![],
            chosen: 7,
        })
    }
}

#[test]
fn another_policy_plugs_in_through_the_trait() {
    let prompt = ['A', 'C', 'D', 'F'];
    let mut f = seven_blocks(&prompt);
    f.booked.insert(
        wr(1, 0),
        BookedLoad {
            active_requests: 1,
            ..Default::default()
        },
    );
    let ctx = SelectContext {
        workers: &f.workers,
        overlaps: &f.overlaps,
        tier_overlaps: &f.tier_overlaps,
        cached_blocks: &f.cached,
        booked: &f.booked,
        sessions: &f.sessions,
        now_ms: 0,
        prefill_timing: &(),
    };
    let mut rng = StdRng::seed_from_u64(0);
    let s = select(&request(4), &ctx, &f.config, &FewestActive, &mut rng).unwrap();
    assert_eq!((s.target, s.policy), (wr(2, 0), "fewest-active"));
    assert_eq!(
        s.overlap_blocks, 2,
        "outputs still describe the chosen target"
    );
    let e = select(&request(4), &ctx, &f.config, &Broken, &mut rng).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Internal);
    assert!(e.to_string().contains("broken") && e.to_string().contains("req-1"));
}

#[test]
fn no_eligible_worker_names_each_worker_and_why() {
    let mut f = Fixture::with(vec![worker(1, 2), worker(2, 1)]);
    f.workers[0].cordoned = true;
    f.workers[1].taints = vec!["gpu=h100".into()];
    let e = f.run(&request(1)).unwrap_err();
    let msg = e.to_string();
    assert_eq!(e.code(), ErrorCode::Unavailable);
    assert!(
        msg.ends_with(
            "among 2 worker(s): worker 1: worker is cordoned; \
             worker 2: taint \"gpu=h100\" is not tolerated by the request"
        ),
        "{msg}"
    );
}

// ---- cache tiers ----------------------------------------------------------

/// Three idle workers for an 8-block prompt: 1 holds it on the device, 2
/// in host memory, 3 holds nothing.
fn tiered_three() -> Fixture {
    let mut f = Fixture::with(vec![worker(1, 1), worker(2, 1), worker(3, 1)]);
    f.overlaps.insert(wr(1, 0), 8);
    f.overlaps.insert(wr(2, 0), 8);
    f.tier_overlaps.insert(wr(2, 0), TierBlocks([0, 8, 0, 0]));
    f
}

#[test]
fn device_beats_host_beats_nothing() {
    let f = tiered_three();
    let s = f.run(&request(8)).unwrap();
    assert_eq!(s.target, wr(1, 0));
    let host = &s.candidates[1];
    assert_eq!(host.tiers, TierBlocks([0, 8, 0, 0]));
    let saving = TierSavings::DEFAULT.get(Tier::Host);
    assert!((host.effective_overlap_blocks - 8.0 * saving).abs() < 1e-9);
    // The effective blocks save their tokens, and their whole blocks: at
    // the default 0.7, 5.6 effective blocks save 22 of 32 tokens and 5 of
    // 8 blocks.
    let saved_tokens = (8.0 * saving * 4.0).floor() as u64;
    let saved_blocks = (8.0 * saving).floor() as u64;
    assert_eq!(host.potential_prefill_tokens, 32 - saved_tokens);
    assert_eq!(host.potential_prefill_blocks, 8 - saved_blocks);
    let mut f = f;
    f.workers.remove(0);
    let s = f.run(&request(8)).unwrap();
    assert_eq!(s.target, wr(2, 0), "host memory beats nothing");
    assert_eq!(s.tiers, TierBlocks([0, 8, 0, 0]));
    assert_eq!(s.request_prefill_tokens, 32 - saved_tokens);
    assert_eq!(s.overlap_blocks, 8);
    assert_eq!(s.cached_tokens, 32);
}

#[test]
fn a_near_one_saving_still_ranks_below_the_device() {
    let mut f = tiered_three();
    f.config.tier_savings = TierSavings::DEFAULT.with(Tier::Host, 0.999);
    assert_eq!(f.run(&request(8)).unwrap().target, wr(1, 0));
}

#[test]
fn lower_tiers_extend_the_device_prefix_by_their_saving() {
    // Worker 1: 3 device blocks. Worker 2: 2 device + 4 host blocks.
    let mut f = Fixture::with(vec![worker(1, 1), worker(2, 1)]);
    f.overlaps.insert(wr(1, 0), 3);
    f.overlaps.insert(wr(2, 0), 6);
    f.tier_overlaps.insert(wr(2, 0), TierBlocks([2, 4, 0, 0]));
    let s = f.run(&request(8)).unwrap();
    assert_eq!(s.target, wr(2, 0));
    let host = TierSavings::DEFAULT.get(Tier::Host);
    assert!((s.effective_overlap_blocks - (2.0 + 4.0 * host)).abs() < 1e-9);
    // With device-only scoring the host blocks count for nothing.
    f.config.tier_savings = TierSavings::DEVICE_ONLY;
    assert_eq!(f.run(&request(8)).unwrap().target, wr(1, 0));
}

#[test]
fn a_workers_declared_saving_overrides_the_routers() {
    let mut f = tiered_three();
    f.workers.remove(0);
    f.workers[0].tiers = vec![crate::types::TierSpec {
        tier: Tier::Host,
        capacity_blocks: 100,
        prefill_saving: Some(0.0),
    }];
    // Worker 2's host blocks save nothing: a tie with worker 3, broken by
    // the fewest cached blocks (both 0 here), so either may win; the cost
    // is what shows the override.
    let s = f.run(&request(8)).unwrap();
    let host = &s.candidates[0];
    assert_eq!(host.effective_overlap_blocks, 0.0);
    assert_eq!(host.potential_prefill_blocks, 8);
}

#[test]
fn a_split_longer_than_the_prompt_is_cut_from_the_slowest_tier() {
    let mut f = Fixture::with(vec![worker(1, 1)]);
    f.overlaps.insert(wr(1, 0), 9);
    f.tier_overlaps.insert(wr(1, 0), TierBlocks([3, 4, 2, 0]));
    let s = f.run(&request(5)).unwrap();
    assert_eq!(s.overlap_blocks, 5);
    assert_eq!(s.tiers, TierBlocks([3, 2, 0, 0]));
}

// ---- adapters loaded on request ---------------------------------------------

/// Worker 1 serves adapter "x"; 2 serves "y" and loads others on request;
/// 3 serves "y" only.
fn adapter_three() -> Fixture {
    let mut f = Fixture::with(vec![worker(1, 1), worker(2, 1), worker(3, 1)]);
    f.workers[0].adapters = vec!["x".into()];
    f.workers[1].adapters = vec!["y".into()];
    f.workers[1].loads_adapters = true;
    f.workers[2].adapters = vec!["y".into()];
    f
}

fn for_adapter(blocks: u64, adapter: &str) -> SelectRequest {
    SelectRequest {
        adapter: Some(adapter.into()),
        ..request(blocks)
    }
}

#[test]
fn a_worker_that_loads_adapters_takes_the_request_paying_the_load() {
    let mut f = adapter_three();
    let req = for_adapter(8, "x");
    let s = f.run(&req).unwrap();
    assert_eq!(s.target, wr(1, 0), "the worker serving it beats the load");
    let [serves, loads, cannot] = &s.candidates[..] else {
        panic!("three candidates: {:?}", s.candidates);
    };
    assert!(!serves.loads_adapter);
    assert!(loads.loads_adapter && loads.eligible.is_ok());
    assert_eq!(
        loads.potential_prefill_tokens - serves.potential_prefill_tokens,
        f.config.adapter_load_tokens
    );
    assert_eq!(
        loads.potential_prefill_blocks - serves.potential_prefill_blocks,
        f.config.adapter_load_tokens / u64::from(BS)
    );
    assert_eq!(
        cannot.eligible,
        Err(Ineligible::AdapterNotServed {
            adapter: "x".into()
        })
    );
    assert!(!cannot.loads_adapter, "it cannot load it, so pays nothing");
    // The request's own prefill, booked on the winner, is the prompt's.
    assert_eq!(s.request_prefill_tokens, 8 * u64::from(BS));

    // Worker 1 busy: the loader, never the worker that cannot load it.
    f.booked.insert(wr(1, 0), busy_load());
    for seed in 0..8 {
        assert_eq!(f.run_seeded(&req, seed).unwrap().target, wr(2, 0));
    }
    // Worker 1 gone: the same.
    f.booked.clear();
    f.workers.remove(0);
    let s = f.run(&req).unwrap();
    assert_eq!(s.target, wr(2, 0));
    assert!(s.candidates[0].loads_adapter);
    assert_eq!(
        s.potential_prefill_tokens,
        8 * u64::from(BS) + f.config.adapter_load_tokens
    );
    // Without a loader, nobody can take it.
    f.workers[0].loads_adapters = false;
    assert_eq!(f.run(&req).unwrap_err().code(), ErrorCode::Unavailable);
    // A request for an adapter it serves loads nothing.
    f.workers[0].loads_adapters = true;
    let s = f.run(&for_adapter(8, "y")).unwrap();
    assert!(s.candidates.iter().all(|c| !c.loads_adapter));
}
