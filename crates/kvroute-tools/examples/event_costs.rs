//! What one op costs as a function of its size: replay an op log REPS
//! times, keep each op's best time, and fit `fixed + per_block * blocks`
//! (least squares) for each op kind. A fixed cost near the whole says the
//! misses of reaching the tree dominate; a per-block cost near
//! `table_only_replay`'s says the engine-hash table does.
//!
//! Usage: `cargo run --release --example event_costs -- FILE [REPS]`
mod common;

use kvroute_core::index::{KvEvent, OverlapScores};
use kvroute_tools::oplog::{KvRouteReplay, Op};
use std::process::ExitCode;
use std::time::Instant;

const KINDS: [&str; 3] = ["match", "store", "remove"];

fn main() -> ExitCode {
    let (log, reps) = match common::log_and_reps("event_costs", 5) {
        Ok(x) => x,
        Err(code) => return code,
    };
    // (kind, blocks, best nanoseconds) per op; clears are left out
    let mut ops: Vec<(usize, f64, f64)> = vec![(usize::MAX, 0.0, f64::MAX); log.ops.len()];
    for _ in 0..reps {
        let idx = KvRouteReplay::registered(&log).index;
        let mut out = OverlapScores::default();
        for (op, slot) in log.ops.clone().into_iter().zip(ops.iter_mut()) {
            let t0 = Instant::now();
            let (kind, blocks) = match op {
                Op::Match(q) => {
                    idx.find_matches_into(&q, &mut out);
                    (0, q.len())
                }
                Op::Event { worker, event } => {
                    let kind = match &event {
                        KvEvent::Stored { .. } => 1,
                        KvEvent::Removed { .. } => 2,
                        KvEvent::Cleared | KvEvent::StoredKnown { .. } => usize::MAX,
                    };
                    let blocks = event.block_count();
                    let _ = idx.apply_owned(worker, event);
                    (kind, blocks)
                }
            };
            let ns = t0.elapsed().as_nanos() as f64;
            *slot = (kind, blocks as f64, slot.2.min(ns));
        }
    }
    for (kind, name) in KINDS.iter().enumerate() {
        let xy: Vec<(f64, f64)> = ops
            .iter()
            .filter(|o| o.0 == kind)
            .map(|o| (o.1, o.2))
            .collect();
        let n = xy.len() as f64;
        let (sx, sy) = xy.iter().fold((0.0, 0.0), |a, p| (a.0 + p.0, a.1 + p.1));
        let (sxx, sxy) = xy
            .iter()
            .fold((0.0, 0.0), |a, p| (a.0 + p.0 * p.0, a.1 + p.0 * p.1));
        let per_block = (n * sxy - sx * sy) / (n * sxx - sx * sx);
        let fixed = (sy - per_block * sx) / n;
        println!(
            "{name}: {n} ops, {:.4} s; {fixed:.0} ns per op + {per_block:.2} ns per block \
             (fixed part {:.0}%)",
            sy / 1e9,
            100.0 * fixed * n / sy
        );
    }
    ExitCode::SUCCESS
}
