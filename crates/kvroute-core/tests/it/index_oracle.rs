//! The fast index against the naive oracle: random interleavings of store /
//! remove / clear / remove-worker / remove-rank / query, including invalid
//! ops (unknown parents, unknown removes, duplicate and conflicting stores),
//! must give equal answers, equal outcomes and equal sizes after every op.
//! With tiers, the same ops land on a target's host and storage tiers too,
//! and placeholder stores (blocks named by engine hash only) join blocks
//! another tier holds.

use kvroute_core::index::naive::NaiveIndex;
use kvroute_core::index::{Holder, KvEvent, KvIndex, Tier};
use kvroute_core::types::WorkerRank;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Action {
    Event(Holder, KvEvent),
    RemoveWorker(u64),
    RemoveRank(WorkerRank),
    Query(Vec<u64>),
}

fn action(workers: u64, ranks: u32) -> impl Strategy<Value = Action> {
    action_with(workers, ranks, 16, 4, 6)
}

/// Actions whose events land on any tier (half of them on the device).
fn tiered_action(workers: u64, ranks: u32) -> impl Strategy<Value = Action> {
    let tier = prop_oneof![
        3 => Just(Tier::Device),
        2 => Just(Tier::Host),
        1 => Just(Tier::Storage),
    ];
    let holder = (0..workers, 0..ranks, tier.clone())
        .prop_map(|(w, r, t)| Holder::new(WorkerRank::new(w, r), t));
    prop_oneof![
        6 => (action_with(workers, ranks, 16, 4, 6), tier).prop_map(|(a, t)| match a {
            Action::Event(h, ev) => Action::Event(Holder::new(h.target, t), ev),
            other => other,
        }),
        2 => (holder, proptest::collection::vec(0u64..16, 0..5))
            .prop_map(|(h, blocks)| Action::Event(h, KvEvent::StoredKnown { blocks })),
    ]
}

/// `engines` / `locals`: alphabet sizes; `len`: longest store.
fn action_with(
    workers: u64,
    ranks: u32,
    engines: u64,
    locals: u64,
    len: usize,
) -> impl Strategy<Value = Action> {
    let wr = (0..workers, 0..ranks).prop_map(|(w, r)| WorkerRank::new(w, r));
    let device = wr.clone().prop_map(Holder::device);
    // small alphabets so paths collide, engine hashes repeat and parents miss
    let engine = 0u64..engines;
    let local = 0u64..locals;
    prop_oneof![
        5 => (device.clone(), proptest::option::weighted(0.6, engine.clone()),
              proptest::collection::vec((engine.clone(), local.clone()), 0..len))
            .prop_map(|(w, parent, blocks)| Action::Event(w, KvEvent::Stored { parent, blocks })),
        2 => (device.clone(), proptest::collection::vec(engine.clone(), 0..5))
            .prop_map(|(w, blocks)| Action::Event(w, KvEvent::Removed { blocks })),
        // chains as engines send them: consecutive engine hashes stored in
        // order, evicted deepest first (runs of removes in one segment)
        2 => (device.clone(), engine.clone(), proptest::collection::vec(local.clone(), 1..len + 1))
            .prop_map(|(w, first, locals)| Action::Event(w, KvEvent::Stored {
                parent: first.checked_sub(1),
                blocks: locals.iter().enumerate().map(|(i, &l)| (first + i as u64, l)).collect(),
            })),
        2 => (device.clone(), engine, 1..len as u64 + 1)
            .prop_map(|(w, first, n)| Action::Event(w, KvEvent::Removed {
                blocks: (first..first + n).rev().collect(),
            })),
        1 => device.clone().prop_map(|w| Action::Event(w, KvEvent::Cleared)),
        1 => (0..workers).prop_map(Action::RemoveWorker),
        1 => wr.prop_map(Action::RemoveRank),
        4 => proptest::collection::vec(local, 0..len + 1).prop_map(Action::Query),
    ]
}

/// A fresh index rebuilt from `from`'s exported content, target by target
/// (as a snapshot load does).
fn rebuilt(from: &KvIndex) -> Result<KvIndex, TestCaseError> {
    let to = KvIndex::new(from.block_size());
    for target in from.targets() {
        let content = from.export_target(target);
        prop_assert!(content.is_well_formed(), "{:?}", content);
        to.restore_target(target, &content)
            .map_err(|e| TestCaseError::fail(format!("restore {target}: {e}")))?;
    }
    Ok(to)
}

fn check(actions: Vec<Action>) -> Result<(), TestCaseError> {
    let mut fast = KvIndex::new(16);
    let mut naive = NaiveIndex::new(16);
    for (i, a) in actions.iter().enumerate() {
        if i == actions.len() / 2 {
            // Halfway, carry on with an index rebuilt from the content
            // alone: it must answer, count and take the remaining events
            // exactly as the one built by the history did.
            fast = rebuilt(&fast)?;
        }
        match a {
            Action::Event(w, ev) => {
                // both ways in: borrowed, and handed over (a store may keep
                // the event's array)
                let got = if i % 2 == 0 {
                    fast.apply_in(*w, ev)
                } else {
                    fast.apply_owned_in(*w, ev.clone())
                };
                prop_assert_eq!(got, naive.apply_in(*w, ev), "op {} {:?}", i, a);
            }
            Action::RemoveWorker(id) => {
                prop_assert_eq!(fast.remove_worker(*id), naive.remove_worker(*id));
            }
            Action::RemoveRank(w) => {
                prop_assert_eq!(fast.remove_rank(*w), naive.remove_rank(*w));
            }
            Action::Query(q) => {
                prop_assert_eq!(
                    fast.find_matches(q).sorted(),
                    naive.find_matches(q).sorted(),
                    "op {} {:?}",
                    i,
                    a
                );
            }
        }
        let (f, n) = (fast.stats(), naive.stats());
        prop_assert_eq!(
            (f.blocks, f.nodes, f.workers, &f.per_worker, f.per_tier),
            (n.blocks, n.nodes, n.workers, &n.per_worker, n.per_tier),
            "sizes after op {} {:?}",
            i,
            a
        );
        prop_assert_eq!(
            fast.digest(),
            naive.digest(),
            "digest after op {} {:?}",
            i,
            a
        );
    }
    // every prefix of every alphabet string, at the end
    for a in 0..4u64 {
        for b in 0..4u64 {
            for c in 0..4u64 {
                let q = [a, b, c];
                prop_assert_eq!(
                    fast.find_matches(&q).sorted(),
                    naive.find_matches(&q).sorted()
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn few_targets(actions in proptest::collection::vec(action(3, 2), 1..80)) {
        check(actions)?;
    }

    /// Long stores over a tiny local alphabet: long segments that split
    /// (branching, partial holds, removes mid-segment) and merge back.
    #[test]
    fn long_chains_split_segments(actions in proptest::collection::vec(action_with(3, 2, 48, 2, 14), 1..120)) {
        check(actions)?;
    }

    /// Events on every tier: lower tiers hanging under device parents,
    /// placeholders, removals per tier; answers per tier.
    #[test]
    fn tiers_of_few_targets(actions in proptest::collection::vec(tiered_action(3, 2), 1..100)) {
        check(actions)?;
    }

    /// More than 64 holders: the tiered walk over wide masks.
    #[test]
    fn tiers_of_many_targets(actions in proptest::collection::vec(tiered_action(30, 1), 1..150)) {
        check(actions)?;
    }

    #[test]
    fn many_targets_wide_masks(actions in proptest::collection::vec(action(40, 2), 1..150)) {
        check(actions)?;
    }
}
