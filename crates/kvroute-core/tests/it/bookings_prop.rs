//! Property tests of the booked-load ledger: over random sequences of book,
//! prefill-complete, release, touch and expire, the ledger's totals always
//! equal a naive recomputation from the live bookings, every call reports a
//! change exactly when the model changed, and releasing everything returns
//! every total to zero.

use std::collections::{BTreeMap, HashSet};

use kvroute_core::types::{LocalHash, WorkerRank};
use kvroute_core::{admission::bookings::BookingLedger, types::BookedLoad};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Book {
        id: u8,
        rank: u8,
        tokens: u64,
        blocks: u64,
        hashes: Vec<LocalHash>,
    },
    Complete(u8),
    Release(u8),
    Touch(u8),
    Advance(u64),
    Expire(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..10, 0u8..4, 0u64..5_000, 0u64..64, prop::collection::vec(0u64..4, 0..8))
            .prop_map(|(id, rank, tokens, blocks, hashes)| Op::Book { id, rank, tokens, blocks, hashes }),
        2 => (0u8..10).prop_map(Op::Complete),
        2 => (0u8..10).prop_map(Op::Release),
        1 => (0u8..10).prop_map(Op::Touch),
        2 => (0u64..200).prop_map(Op::Advance),
        1 => (0u64..300).prop_map(Op::Expire),
    ]
}

#[derive(Clone, Debug)]
struct Model {
    rank: WorkerRank,
    prefill: Option<(u64, u64)>,
    hashes: Vec<LocalHash>,
    at: u64,
}

fn target(r: u8) -> WorkerRank {
    WorkerRank::new(u64::from(r % 2), u32::from(r / 2))
}

fn all_ranks() -> impl Iterator<Item = WorkerRank> {
    (0u8..4).map(target)
}

/// Totals recomputed from scratch. Decode blocks are distinct prompt
/// prefixes, compared as token-hash sequences (no chained hashing).
fn naive(live: &BTreeMap<String, Model>, rank: WorkerRank) -> BookedLoad {
    let mut load = BookedLoad::default();
    let mut prefixes: HashSet<Vec<LocalHash>> = HashSet::new();
    for b in live.values().filter(|b| b.rank == rank) {
        load.active_requests += 1;
        if let Some((t, k)) = b.prefill {
            load.prefill_tokens += t;
            load.prefill_blocks += k;
        }
        for i in 0..b.hashes.len() {
            prefixes.insert(b.hashes[..=i].to_vec());
        }
    }
    load.decode_blocks = prefixes.len() as u64;
    load
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn totals_match_naive_and_drain_to_zero(ops in prop::collection::vec(op(), 0..80)) {
        let mut ledger = BookingLedger::new();
        let mut live: BTreeMap<String, Model> = BTreeMap::new();
        let mut now = 0u64;
        for op in ops {
            match op {
                Op::Book { id, rank, tokens, blocks, hashes } => {
                    let id = id.to_string();
                    let r = ledger.book(&id, target(rank), tokens, blocks, &hashes, now, None);
                    prop_assert_eq!(r.is_err(), live.contains_key(&id));
                    if r.is_ok() {
                        live.insert(id, Model { rank: target(rank), prefill: Some((tokens, blocks)), hashes, at: now });
                    }
                }
                Op::Complete(id) => {
                    let id = id.to_string();
                    let expected = live.get_mut(&id).and_then(|b| b.prefill.take()).is_some();
                    prop_assert_eq!(ledger.mark_prefill_complete(&id), expected);
                }
                Op::Release(id) => {
                    let id = id.to_string();
                    prop_assert_eq!(ledger.release(&id), live.remove(&id).is_some());
                }
                Op::Touch(id) => {
                    let id = id.to_string();
                    let expected = match live.get_mut(&id) {
                        Some(b) => { b.at = b.at.max(now); true }
                        None => false,
                    };
                    prop_assert_eq!(ledger.touch(&id, now), expected);
                }
                Op::Advance(dt) => now += dt,
                Op::Expire(ttl) => {
                    let before = live.len();
                    live.retain(|_, b| now - b.at <= ttl);
                    prop_assert_eq!(ledger.expire(now, ttl), before - live.len());
                }
            }
            prop_assert_eq!(ledger.len(), live.len());
            for rank in all_ranks() {
                prop_assert_eq!(ledger.load(rank), naive(&live, rank), "rank {}", rank);
            }
        }
        let ids: Vec<String> = live.keys().cloned().collect();
        for id in &ids {
            prop_assert!(ledger.release(id));
            prop_assert!(!ledger.release(id));
        }
        for rank in all_ranks() {
            prop_assert_eq!(ledger.load(rank), BookedLoad::default());
        }
        prop_assert!(ledger.is_empty());
        prop_assert_eq!(ledger.ranks_with_bookings(), 0);
        prop_assert!(ledger.loads().is_empty());
    }

    #[test]
    fn expiring_everything_drains_to_zero(ops in prop::collection::vec(op(), 0..60)) {
        let mut ledger = BookingLedger::new();
        let mut now = 0u64;
        for op in ops {
            match op {
                Op::Book { id, rank, tokens, blocks, hashes } => {
                    let _ = ledger.book(&id.to_string(), target(rank), tokens, blocks, &hashes, now, None);
                }
                Op::Complete(id) => { ledger.mark_prefill_complete(&id.to_string()); }
                Op::Release(id) => { ledger.release(&id.to_string()); }
                Op::Touch(id) => { ledger.touch(&id.to_string(), now); }
                Op::Advance(dt) => now += dt,
                Op::Expire(ttl) => { ledger.expire(now, ttl); }
            }
        }
        let n = ledger.len();
        prop_assert_eq!(ledger.expire(now + 1, 0), n);
        prop_assert!(ledger.is_empty());
        prop_assert_eq!(ledger.ranks_with_bookings(), 0);
        for rank in all_ranks() {
            prop_assert_eq!(ledger.load(rank), BookedLoad::default());
        }
    }
}
