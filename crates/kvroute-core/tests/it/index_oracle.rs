//! The fast index against the naive oracle: random interleavings of store /
//! remove / clear / remove-worker / remove-rank / query, including invalid
//! ops (unknown parents, unknown removes, duplicate and conflicting stores),
//! must give equal answers, equal outcomes and equal sizes after every op.

use kvroute_core::index::naive::NaiveIndex;
use kvroute_core::index::{KvEvent, KvIndex};
use kvroute_core::types::WorkerRank;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Action {
    Event(WorkerRank, KvEvent),
    RemoveWorker(u64),
    RemoveRank(WorkerRank),
    Query(Vec<u64>),
}

fn action(workers: u64, ranks: u32) -> impl Strategy<Value = Action> {
    action_with(workers, ranks, 16, 4, 6)
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
    // small alphabets so paths collide, engine hashes repeat and parents miss
    let engine = 0u64..engines;
    let local = 0u64..locals;
    prop_oneof![
        5 => (wr.clone(), proptest::option::weighted(0.6, engine.clone()),
              proptest::collection::vec((engine.clone(), local.clone()), 0..len))
            .prop_map(|(w, parent, blocks)| Action::Event(w, KvEvent::Stored { parent, blocks })),
        2 => (wr.clone(), proptest::collection::vec(engine.clone(), 0..5))
            .prop_map(|(w, blocks)| Action::Event(w, KvEvent::Removed { blocks })),
        // chains as engines send them: consecutive engine hashes stored in
        // order, evicted deepest first (runs of removes in one segment)
        2 => (wr.clone(), engine.clone(), proptest::collection::vec(local.clone(), 1..len + 1))
            .prop_map(|(w, first, locals)| Action::Event(w, KvEvent::Stored {
                parent: first.checked_sub(1),
                blocks: locals.iter().enumerate().map(|(i, &l)| (first + i as u64, l)).collect(),
            })),
        2 => (wr.clone(), engine, 1..len as u64 + 1)
            .prop_map(|(w, first, n)| Action::Event(w, KvEvent::Removed {
                blocks: (first..first + n).rev().collect(),
            })),
        1 => wr.clone().prop_map(|w| Action::Event(w, KvEvent::Cleared)),
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
                    fast.apply(*w, ev)
                } else {
                    fast.apply_owned(*w, ev.clone())
                };
                prop_assert_eq!(got, naive.apply(*w, ev), "op {} {:?}", i, a);
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
            (f.blocks, f.nodes, f.workers, &f.per_worker),
            (n.blocks, n.nodes, n.workers, &n.per_worker),
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

    #[test]
    fn many_targets_wide_masks(actions in proptest::collection::vec(action(40, 2), 1..150)) {
        check(actions)?;
    }
}
