//! The engine-hash table's share of an op-log replay: replay only the table
//! work of the log (one `GroupTable` per target, reserved for the header's
//! `capacity` as the index does; each stored block inserted, each removed
//! block taken, prefetching ahead as the index does), with no tree behind
//! it, and print the best time of N replays. Values are the engine hashes
//! themselves (less the table's check bits), so a probe confirms a
//! candidate without the tree's extra load; this is a floor for the table,
//! not a model of the whole index.
//!
//! Usage: `cargo run --release --example table_only_replay -- FILE [REPS]`
mod common;

use kvroute_core::index::KvEvent;
use kvroute_core::index::group_table::{CHECK_BITS, GroupTable};
use kvroute_tools::oplog::Op;
use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

/// Spreads an engine hash over the table (any good 64-bit mixer will do).
fn spread(e: u64) -> u64 {
    let m = u128::from(e ^ 0x5851_F42D_4C95_7F2D) * 0xD6E8_FEB8_6659_FD93_u128;
    (m as u64) ^ ((m >> 64) as u64)
}

/// The table's value (and key) for an engine hash: the hash less the bits
/// the table keeps for itself.
fn value(e: u64) -> u64 {
    e & !CHECK_BITS
}

fn main() -> ExitCode {
    let (log, reps) = match common::log_and_reps("table_only_replay", 5) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let capacity = log.header.capacity as usize;
    let mut best = (f64::MAX, f64::MAX);
    for _ in 0..reps {
        let mut tables = HashMap::new();
        let (mut store, mut remove) = (0f64, 0f64);
        for op in &log.ops {
            let Op::Event { worker, event } = op else {
                continue;
            };
            let table = tables.entry(*worker).or_insert_with(|| {
                let mut t = GroupTable::new();
                t.reserve(capacity, spread);
                t
            });
            let t0 = Instant::now();
            match event {
                KvEvent::Stored { blocks, .. } => {
                    for (k, &(e, _)) in blocks.iter().enumerate() {
                        table.prefetch_ahead(k, |i| blocks.get(i).map(|b| spread(value(b.0))));
                        let v = value(e);
                        table.insert_unless(spread(v), v, |x| x == v, spread);
                    }
                    store += t0.elapsed().as_secs_f64();
                }
                KvEvent::Removed { blocks } => {
                    for (k, &e) in blocks.iter().enumerate() {
                        table.prefetch_ahead(k, |i| blocks.get(i).map(|&e| spread(value(e))));
                        let v = value(e);
                        std::hint::black_box(table.remove(spread(v), |x| x == v));
                    }
                    remove += t0.elapsed().as_secs_f64();
                }
                KvEvent::Cleared => table.clear(),
                // op logs carry device events only
                KvEvent::StoredKnown { .. } => {}
            }
        }
        println!(
            "store {store:.4} remove {remove:.4} total {:.4}",
            store + remove
        );
        best = (best.0.min(store), best.1.min(remove));
    }
    println!(
        "MIN store {:.4} remove {:.4} total {:.4}",
        best.0,
        best.1,
        best.0 + best.1
    );
    ExitCode::SUCCESS
}
