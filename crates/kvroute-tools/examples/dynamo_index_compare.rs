//! Replay one OPLOG v1 file through dynamo-kv-router 1.6.1's `RadixTree` and
//! through kvroute's `KvIndex` in one run, with the same loop and the same
//! heap accounting, and print both JSON lines plus the ratios (with the
//! loop's own time: timing each match and dropping each op, with no index
//! behind it).
//!
//! Memory: a counting global allocator measures live heap bytes; an index's
//! bytes are the live bytes after its replay minus those before it was built
//! (the prepared ops are consumed and freed by the replay). Bytes per entry
//! divides that by the cached (block, worker) entries left after the replay.
//!
//! Order: the harness floor replays first (which also grows the heap to
//! the replay's size), then Dynamo's tree, then kvroute. kvroute runs
//! faster later in a process (about 4-6% second against first; alone,
//! each replay is faster than the one before, up to the fourth), while
//! Dynamo's time moves little with the order, so `--kvroute-first` swaps
//! the two for a figure in the other order.
//! `--rounds N` replays both N times, alternating, and reports each
//! index's fastest round (after the first round both run on a heap the
//! other has used, whatever the order) plus every round's ratio.
//!
//! Usage: `cargo run --release --example dynamo_index_compare -- --oplog FILE [--kvroute-first] [--rounds N]`

use dynamo_kv_router::RadixTree;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use kvroute_core::index::KvEvent;
use kvroute_tools::oplog::{KvRouteReplay, Op, OpLog, ReplayIndex, ReplayReport, Step, replay};
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicI64, Ordering};

struct Counting;
static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY-free wrapper: GlobalAlloc is an unsafe trait, so this example is the
// one place that needs `unsafe`; it only forwards to the system allocator.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as i64, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as i64, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        LIVE.fetch_add(n as i64 - l.size() as i64, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> i64 {
    LIVE.load(Ordering::Relaxed)
}

enum DynOp {
    Match(Vec<LocalBlockHash>),
    Event(RouterEvent),
}

struct DynamoReplay {
    tree: RadixTree,
    next_id: u64,
}

impl ReplayIndex for DynamoReplay {
    type Prepared = DynOp;

    fn impl_name(&self) -> String {
        "dynamo-kv-router-1.6.1-RadixTree".into()
    }

    fn prepare(&self, op: &Op) -> DynOp {
        match op {
            Op::Match(q) => DynOp::Match(q.iter().map(|&h| LocalBlockHash(h)).collect()),
            Op::Event { worker, event } => {
                let data = match event {
                    KvEvent::Stored { parent, blocks } => {
                        KvCacheEventData::Stored(KvCacheStoreData {
                            parent_hash: parent.map(ExternalSequenceBlockHash),
                            start_position: None,
                            blocks: blocks
                                .iter()
                                .map(|&(e, l)| KvCacheStoredBlockData {
                                    block_hash: ExternalSequenceBlockHash(e),
                                    tokens_hash: LocalBlockHash(l),
                                    mm_extra_info: None,
                                })
                                .collect(),
                        })
                    }
                    KvEvent::Removed { blocks } => KvCacheEventData::Removed(KvCacheRemoveData {
                        block_hashes: blocks
                            .iter()
                            .map(|&e| ExternalSequenceBlockHash(e))
                            .collect(),
                    }),
                    KvEvent::Cleared => KvCacheEventData::Cleared,
                };
                DynOp::Event(RouterEvent::new(
                    worker.worker_id,
                    KvCacheEvent {
                        event_id: 0,
                        data,
                        dp_rank: worker.dp_rank,
                    },
                ))
            }
        }
    }

    fn run(&mut self, op: DynOp, prefixes: &mut Vec<u32>) -> Step {
        match op {
            DynOp::Match(q) => {
                let s = self.tree.find_matches(q, false);
                prefixes.extend(s.scores.values().copied().filter(|&v| v > 0));
                Step::Matched
            }
            DynOp::Event(mut ev) => {
                self.next_id += 1;
                ev.event.event_id = self.next_id;
                match self.tree.apply_event(ev) {
                    Ok(()) => Step::Applied,
                    Err(_) => Step::Rejected,
                }
            }
        }
    }

    fn entries(&self) -> u64 {
        self.tree.current_size() as u64
    }
}

/// The replay loop with no index: each op is prepared the way kvroute's
/// are, then dropped (a match timed first). Its time is the fixed cost both
/// indexes' figures include.
struct HarnessFloor;

impl ReplayIndex for HarnessFloor {
    type Prepared = Op;

    fn impl_name(&self) -> String {
        "harness-floor".into()
    }

    fn prepare(&self, op: &Op) -> Op {
        op.clone()
    }

    fn run(&mut self, op: Op, _prefixes: &mut Vec<u32>) -> Step {
        match op {
            Op::Match(_) => Step::Matched,
            Op::Event { .. } => Step::Applied,
        }
    }

    fn entries(&self) -> u64 {
        0
    }
}

fn measured<I: ReplayIndex>(make: impl FnOnce() -> I, log: &OpLog) -> (ReplayReport, I) {
    let before = live();
    let mut index = make();
    let mut report = replay(&mut index, log);
    let bytes = (live() - before).max(0) as f64;
    if report.entries > 0 {
        report.bytes_per_entry = Some(bytes / report.entries as f64);
    }
    (report, index)
}

fn main() -> ExitCode {
    let mut path: Option<PathBuf> = None;
    let mut kvroute_first = false;
    let mut rounds = 1usize;
    let mut bad_rounds = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--oplog" {
            path = args.next().map(PathBuf::from);
        } else if a == "--kvroute-first" {
            kvroute_first = true;
        } else if a == "--rounds" {
            match args.next().and_then(|n| n.parse().ok()) {
                Some(n) if n > 0 => rounds = n,
                _ => bad_rounds = true,
            }
        }
    }
    let (Some(path), false) = (path, bad_rounds) else {
        eprintln!("usage: dynamo_index_compare --oplog FILE [--kvroute-first] [--rounds N]");
        return ExitCode::from(2);
    };
    let log = match OpLog::load(&path) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    // the floor runs first: it also grows the heap to the replay's size, so
    // that neither index pays for that in its timed loop
    let (floor, _) = measured(|| HarnessFloor, &log);
    // each index is dropped before the next replay starts
    let dynamo = || {
        let make = || DynamoReplay {
            tree: RadixTree::new(),
            next_id: 0,
        };
        measured(make, &log).0
    };
    let kvroute = || measured(|| KvRouteReplay::registered(&log), &log).0;
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    // each round replays both indexes, in the same order; the figures are
    // each index's fastest round
    let mut runs: Vec<(ReplayReport, ReplayReport)> = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        runs.push(if kvroute_first {
            let kv = kvroute();
            (dynamo(), kv)
        } else {
            let dy = dynamo();
            (dy, kvroute())
        });
    }
    let fastest = |pick: fn(&(ReplayReport, ReplayReport)) -> &ReplayReport| {
        runs.iter()
            .map(pick)
            .min_by(|a, b| a.secs.total_cmp(&b.secs))
            .cloned()
    };
    let (Some(dy), Some(kv)) = (fastest(|r| &r.0), fastest(|r| &r.1)) else {
        return ExitCode::FAILURE;
    };
    println!("{}", dy.to_json());
    println!("{}", kv.to_json());
    let round_ratios: Vec<f64> = runs
        .iter()
        .map(|(d, k)| ratio(k.blocks_per_s, d.blocks_per_s))
        .collect();
    let same_answers = runs
        .iter()
        .all(|(d, k)| (k.overlap_sum, k.score_sum) == (d.overlap_sum, d.score_sum));
    let ratios = serde_json::json!({
        "blocks_per_s_ratio": ratio(kv.blocks_per_s, dy.blocks_per_s),
        "match_p50_ratio": ratio(kv.match_p50_us, dy.match_p50_us),
        "match_p99_ratio": ratio(kv.match_p99_us, dy.match_p99_us),
        "bytes_per_entry_ratio": ratio(kv.bytes_per_entry.unwrap_or(f64::NAN), dy.bytes_per_entry.unwrap_or(f64::NAN)),
        "same_answers": same_answers,
        "harness_floor_secs": floor.secs,
        "first": if kvroute_first { "kvroute" } else { "dynamo" },
        "rounds": rounds,
        "round_ratios": round_ratios,
    });
    println!("{ratios}");
    ExitCode::SUCCESS
}
