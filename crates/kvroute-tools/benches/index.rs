//! Criterion benches of the index: store, remove and query at several tree
//! sizes, chain depths and worker counts. Kept short (small measurement time).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvroute_core::index::{KvEvent, KvIndex, OverlapScores};
use kvroute_core::types::WorkerRank;
use std::hint::black_box;
use std::time::Duration;

fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(b);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^ (z >> 31)
}

/// `workers` targets, each holding `chains` chains of `depth` blocks; chain
/// c shares its first half with every worker (a common system prompt).
fn build(workers: u64, chains: u64, depth: u64) -> KvIndex {
    let idx = KvIndex::new(16);
    for w in 0..workers {
        for c in 0..chains {
            let blocks: Vec<(u64, u64)> = (0..depth)
                .map(|d| {
                    let shared = d < depth / 2;
                    let local = if shared {
                        mix(c, d)
                    } else {
                        mix(c * 1000 + w + 1, d)
                    };
                    (mix(w * 1_000_003 + c, d), local)
                })
                .collect();
            let _ = idx.apply(
                WorkerRank::new(w, 0),
                &KvEvent::Stored {
                    parent: None,
                    blocks,
                },
            );
        }
    }
    idx
}

fn query(c: u64, w: u64, depth: u64) -> Vec<u64> {
    (0..depth)
        .map(|d| {
            if d < depth / 2 {
                mix(c, d)
            } else {
                mix(c * 1000 + w + 1, d)
            }
        })
        .collect()
}

fn benches(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("index");
    g.measurement_time(Duration::from_millis(700))
        .warm_up_time(Duration::from_millis(200))
        .sample_size(20);
    for &(workers, chains, depth) in &[(4u64, 64u64, 16u64), (16, 256, 64), (64, 64, 256)] {
        let label = format!("w{workers}_c{chains}_d{depth}");
        let idx = build(workers, chains, depth);
        let mut out = OverlapScores::default();
        let q = query(chains / 2, 1, depth);
        g.bench_function(BenchmarkId::new("query_hit", &label), |b| {
            b.iter(|| {
                idx.find_matches_into(black_box(&q), &mut out);
                black_box(out.scores.len())
            })
        });
        let miss: Vec<u64> = (0..depth).map(|d| mix(u64::MAX, d)).collect();
        g.bench_function(BenchmarkId::new("query_miss", &label), |b| {
            b.iter(|| {
                idx.find_matches_into(black_box(&miss), &mut out);
                black_box(out.scores.len())
            })
        });
        // store then remove one fresh chain of `depth` blocks on a new target
        let who = WorkerRank::new(workers + 1, 0);
        let blocks: Vec<(u64, u64)> = (0..depth).map(|d| (mix(7, d), mix(8, d))).collect();
        let store = KvEvent::Stored {
            parent: None,
            blocks: blocks.clone(),
        };
        let remove = KvEvent::Removed {
            blocks: blocks.iter().map(|b| b.0).collect(),
        };
        g.bench_function(BenchmarkId::new("store_then_remove_chain", &label), |b| {
            b.iter(|| {
                let _ = black_box(idx.apply(who, &store));
                let _ = black_box(idx.apply(who, &remove));
            })
        });
    }
    g.finish();
}

criterion_group!(index_benches, benches);
criterion_main!(index_benches);
