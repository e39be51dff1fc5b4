//! Where the index's replay time goes: replay an op log several times,
//! time each op kind (match, store, remove) and print the best time per
//! kind over the runs, which is steadier than one replay on a busy machine.
//!
//! Usage: `cargo run --release --example op_breakdown -- FILE [REPS]`
mod common;

use kvroute_core::index::{KvEvent, OverlapScores};
use kvroute_tools::oplog::{KvRouteReplay, Op};
use std::process::ExitCode;
use std::time::Instant;

fn main() -> ExitCode {
    let (log, reps) = match common::log_and_reps("op_breakdown", 3) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let mut best = [f64::MAX; 4];
    for _ in 0..reps {
        // workers registered with the log's capacity, as in the replay
        let idx = KvRouteReplay::registered(&log).index;
        let mut out = OverlapScores::default();
        let mut t = [0f64; 4];
        let mut lat: Vec<u64> = Vec::new();
        // each op is handed over, as the replay and the ingest do
        let ops = log.ops.clone();
        for op in ops {
            let t0 = Instant::now();
            let k = match op {
                Op::Match(q) => {
                    idx.find_matches_into(&q, &mut out);
                    lat.push(t0.elapsed().as_nanos() as u64);
                    0
                }
                Op::Event { worker, event } => {
                    let k = match event {
                        KvEvent::Stored { .. } => 1,
                        KvEvent::Removed { .. } => 2,
                        KvEvent::Cleared | KvEvent::StoredKnown { .. } => 3,
                    };
                    let _ = idx.apply_owned(worker, event);
                    k
                }
            };
            if let Some(x) = t.get_mut(k) {
                *x += t0.elapsed().as_secs_f64();
            }
        }
        for (b, x) in best.iter_mut().zip(t) {
            *b = b.min(x);
        }
        lat.sort_unstable();
        let st = idx.stats();
        println!(
            "match {:.4} store {:.4} remove {:.4} clear {:.4} | p50 {} p99 {} ns | bytes/entry {:.1} | entries {} nodes {}",
            t[0],
            t[1],
            t[2],
            t[3],
            lat.get(lat.len() / 2).copied().unwrap_or(0),
            lat.get(lat.len() * 99 / 100).copied().unwrap_or(0),
            st.bytes_used as f64 / st.blocks.max(1) as f64,
            st.blocks,
            st.nodes
        );
    }
    println!(
        "MIN match {:.4} store {:.4} remove {:.4} clear {:.4} total {:.4}",
        best[0],
        best[1],
        best[2],
        best[3],
        best.iter().sum::<f64>()
    );
    ExitCode::SUCCESS
}
