//! Unit tests of [`GroupTable`]: random operations against a `HashMap`
//! model under crowded and spread homes, with the layout checked as they
//! go, plus the corners (saturated overflow counts, reservations, check
//! bits, renames).

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

/// Values are keys here; `spread` bits of hash (the top of the 32 the
/// home is scaled from) decide the home group, so a small `spread`
/// crowds every key into a few groups.
fn hash(v: u64, spread: u32) -> u64 {
    let h = v.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let h = h ^ (h >> 29);
    let home_bits = match spread {
        0 => 0,
        _ => ((h >> 8) & ((1u64 << spread) - 1)) << (32 - spread),
    };
    (h & !((1u64 << 56) - 1)) | home_bits
}

fn run(ops: &[(u8, u64)], spread: u32, check_every: usize) -> Result<(), String> {
    let mut t = GroupTable::new();
    let mut model: HashMap<u64, ()> = HashMap::new();
    for (n, &(op, key)) in ops.iter().enumerate() {
        let h = hash(key, spread);
        match op % 3 {
            0 => {
                let added = t.insert_unless(h, key, |v| v == key, |v| hash(v, spread));
                let want = model.insert(key, ()).is_none();
                if added != want {
                    return Err(format!("insert {key}: added {added}, want {want}"));
                }
            }
            1 => {
                let got = t.remove(h, |v| v == key);
                let want = model.remove(&key).map(|_| key);
                if got != want {
                    return Err(format!("remove {key}: {got:?}, want {want:?}"));
                }
            }
            _ => {
                let got = t.find(h, |v| v == key);
                let want = model.contains_key(&key).then_some(key);
                if got != want {
                    return Err(format!("find {key}: {got:?}, want {want:?}"));
                }
            }
        }
        if n % check_every == 0 {
            t.check(|v| hash(v, spread))?;
        }
    }
    t.check(|v| hash(v, spread))?;
    let mut all: Vec<u64> = t.iter().collect();
    all.sort_unstable();
    let mut want: Vec<u64> = model.keys().copied().collect();
    want.sort_unstable();
    if all != want {
        return Err("iter differs from the model".into());
    }
    Ok(())
}

proptest! {
    #[test]
    fn matches_a_hash_map(
        ops in prop::collection::vec((0u8..3, 0u64..400), 0..600),
        spread in prop::sample::select(vec![0u32, 1, 3, 20]),
    ) {
        prop_assert_eq!(run(&ops, spread, 1), Ok(()));
    }
}

#[test]
fn a_crowded_group_saturates_its_count_and_stays_exact() -> Result<(), String> {
    // 2000 keys all homed in group 0: counts pass 255 and stick there
    let ops: Vec<(u8, u64)> = (0..2000u64)
        .map(|k| (0, k))
        .chain((0..2000).step_by(3).map(|k| (1, k)))
        .chain((0..2000).map(|k| (2, k)))
        .collect();
    let mut t = GroupTable::new();
    for &(_, k) in ops.iter().filter(|o| o.0 == 0) {
        t.insert_new(hash(k, 0), k, |v| hash(v, 0));
    }
    if t.groups.first().map(Group::overflow) != Some(255) {
        return Err("group 0's count should have saturated".into());
    }
    t.check(|v| hash(v, 0))?;
    run(&ops, 0, 500)
}

#[test]
fn a_reserved_table_takes_that_many_without_resizing_and_keeps_room_when_cleared() {
    let mut t = GroupTable::new();
    t.reserve(5000, |v| hash(v, 20));
    let groups = t.groups.len();
    assert!(groups * MAX_PER_GROUP >= 5000);
    for k in 0..5000u64 {
        t.insert_new(hash(k, 20), k, |v| hash(v, 20));
    }
    assert_eq!(t.groups.len(), groups);
    assert_eq!(t.check(|v| hash(v, 20)), Ok(()));
    t.clear();
    assert_eq!(
        (t.groups.len(), t.find(hash(7, 20), |v| v == 7)),
        (groups, None)
    );
    assert_eq!(t.check(|v| hash(v, 20)), Ok(()));
}

#[test]
fn only_a_candidate_with_the_same_check_bits_is_confirmed() {
    // one home and one tag for every key; bits 48..56 of the hash differ
    let hash = |k: u64| (0xAB << 56) | ((k & 0xFF) << 48);
    let mut t = GroupTable::new();
    for k in 0..6u64 {
        t.insert_new(hash(k), k, hash);
    }
    let mut asked = Vec::new();
    let added = t.insert_unless(
        hash(6),
        6,
        |v| {
            asked.push(v);
            v == 6
        },
        hash,
    );
    assert!(added);
    assert_eq!(asked, Vec::<u64>::new());
    // same check bits as key 2 (hash(258) == hash(2)): key 2 is asked
    assert_eq!(t.find(hash(258), |v| v == 258), None);
    let mut asked = Vec::new();
    let _ = t.find(hash(258), |v| {
        asked.push(v);
        false
    });
    assert_eq!(asked, vec![2]);
    assert_eq!(t.check(hash), Ok(()));
    assert_eq!(t.remove(hash(3), |v| v == 3), Some(3));
    assert_eq!(t.find(hash(6), |v| v == 6), Some(6));
}

#[test]
fn replace_renames_one_value() -> Result<(), String> {
    let mut t = GroupTable::new();
    for k in 0..50u64 {
        t.insert_new(hash(k, 20), k * 10, |v| hash(v / 10, 20));
    }
    if !t.replace(hash(7, 20), |v| v == 70, 71) {
        return Err("replace found nothing".into());
    }
    if t.find(hash(7, 20), |v| v == 70).is_some() || t.find(hash(7, 20), |v| v == 71) != Some(71) {
        return Err("replace did not rename".into());
    }
    if t.replace(hash(8, 20), |v| v == 999, 1) {
        return Err("replace of an absent value".into());
    }
    Ok(())
}
