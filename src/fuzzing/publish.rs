//! PublishEvents, differential: batches decoded from the fuzz bytes go
//! through the server's validation (`convert::batch_from_pb`) and its index
//! writer (`EventWriter`, cursor and `KvIndex`) and, beside them, through
//! an `EventCursor` feeding the naive reference index. Ids may be anything
//! (gaps, duplicates, jumps, resyncs), stores may name unknown parents or
//! conflicting hashes, and workers may be removed midway.
//!
//! Equal answers, checked after every batch: the same counts in the reply
//! (applied, rejected, skipped, held) and the same cursor position (last
//! applied, resend, resync and its floor), so both indexes accepted and
//! rejected the same events; the same blocks per target, index digest and
//! node count; and the same overlap of every target for every query of up
//! to three blocks over the small alphabet the stores use. Also checked, of
//! the writer alone: every event received is applied, rejected, skipped or
//! still held; held events stay within their bounds; a resend is asked
//! from one past the last event applied.

use std::{collections::BTreeMap, sync::Arc};

use super::Bytes;
use crate::{
    grpc::convert::{self, BatchLimits},
    ingest::{
        EventWriter,
        cursor::{EventCursor, MAX_HELD_BLOCKS, MAX_HELD_EVENTS},
    },
    metrics::Metrics,
    pb,
    router::{RouterConfig, RouterCore},
};
use kvroute_core::{
    index::{KvIndex, naive::NaiveIndex},
    registry::Registration,
    types::{LocalHash, WorkerRank, WorkerRole},
};

const MODEL: &str = "m";
const BLOCK_SIZE: u32 = 2;
/// Local hashes given directly are drawn from this many values, so that
/// stores share prefixes and every short query can be asked.
const LOCALS: u64 = 3;
/// Engine hashes are drawn from this many values: duplicates and conflicts.
const ENGINE_HASHES: u8 = 24;
/// Batches per input, and events per batch.
const MAX_BATCHES: usize = 64;
const MAX_EVENTS: u8 = 8;

/// Workers 1 (dp ranks 0 and 1) and 2 (rank 0); the fuzz bytes also name
/// rank 2 of worker 1 and rank 1 of worker 2, which are not registered.
const WORKERS: [(u64, u32); 2] = [(1, 2), (2, 1)];

/// The reference: a cursor per target in front of the naive index.
struct Reference {
    naive: NaiveIndex,
    cursors: BTreeMap<WorkerRank, EventCursor>,
}

pub fn publish_events(data: &[u8]) {
    let Ok(metrics) = Metrics::new() else {
        return;
    };
    let core = Arc::new(RouterCore::new(RouterConfig::default(), metrics));
    for (worker_id, dp_size) in WORKERS {
        let registered = core.register_worker(Registration {
            tiers: Vec::new(),
            worker_id,
            model: MODEL.into(),
            role: WorkerRole::Aggregated,
            endpoint: String::new(),
            block_size: BLOCK_SIZE,
            dp_start_rank: 0,
            dp_size,
            total_kv_blocks: 0,
            max_num_batched_tokens: 8192,
            taints: Vec::new(),
            adapters: Vec::new(),
            loads_adapters: false,
            lease_ttl: None,
            kv_events: kvroute_core::types::KvEventsMode::Exact,
        });
        assert!(registered.is_ok(), "fixed registrations are valid");
    }
    let writer = EventWriter::new(Arc::clone(&core));
    let Some(index) = core.index_of(MODEL) else {
        panic!("a registered model has an index");
    };
    let limits = core.config().limits;
    let limits = BatchLimits {
        max_events: limits.max_events_per_batch as usize,
        max_blocks_per_event: limits.max_blocks_per_event as usize,
    };
    let mut reference = Reference {
        naive: NaiveIndex::new(BLOCK_SIZE),
        cursors: BTreeMap::new(),
    };
    // Events received per target since its cursor was made.
    let mut received: BTreeMap<WorkerRank, u64> = BTreeMap::new();
    let mut input = Bytes::new(data);
    let mut last_id = 0u64;
    for _ in 0..MAX_BATCHES {
        if input.is_empty() {
            break;
        }
        let op = input.u8();
        if op % 8 == 7 {
            // The worker goes: its blocks and cursors with it.
            let worker_id = WORKERS[usize::from(op >> 3) & 1].0;
            let dropped = writer.remove_worker(worker_id, MODEL);
            let naive_dropped = reference.naive.remove_worker(worker_id);
            assert_eq!(
                dropped, naive_dropped,
                "blocks dropped with worker {worker_id}"
            );
            reference.cursors.retain(|t, _| t.worker_id != worker_id);
            received.retain(|t, _| t.worker_id != worker_id);
            compare(&index, &reference.naive);
            continue;
        }
        let (batch, queries) = batch(&mut input, op, &mut last_id);
        let Ok(target) = core.event_target(batch.worker_id, batch.dp_rank) else {
            continue;
        };
        let Ok(validated) = convert::batch_from_pb(batch, &target, limits) else {
            continue;
        };
        let rank = WorkerRank::new(validated.worker_id, validated.dp_rank);
        *received.entry(rank).or_default() += validated.events.len() as u64;
        let naive = &mut reference.naive;
        let cursor = reference.cursors.entry(rank).or_default();
        let mut first_rejection = None;
        let receipt = cursor.receive(validated.events.clone(), |event| {
            // The fuzzed worker declares no tier below the device.
            let applied = if event.tier == kvroute_core::index::Tier::Device {
                naive.apply(rank, &event.event)
            } else {
                Err(kvroute_core::index::IndexError::TierNotDeclared {
                    worker: rank,
                    tier: event.tier,
                })
            };
            match applied {
                Ok(_) => true,
                Err(error) => {
                    first_rejection.get_or_insert(error);
                    false
                }
            }
        });
        let Ok(outcome) = writer.apply_batch(validated) else {
            panic!("the registration the batch was validated against is current");
        };
        assert_eq!(
            (
                outcome.applied,
                outcome.rejected,
                outcome.skipped,
                outcome.held,
            ),
            (
                receipt.applied,
                receipt.rejected,
                receipt.skipped_total(),
                u32::try_from(cursor.held_events()).unwrap_or(u32::MAX),
            ),
            "applied, rejected, skipped, held of {rank}"
        );
        assert_eq!(
            (
                outcome.last_applied,
                outcome.resend_from,
                outcome.resync_required,
                outcome.resync_floor
            ),
            (
                cursor.last_applied(),
                cursor.resend_from(),
                cursor.resync_required(),
                cursor.resync_floor()
            ),
            "cursor position of {rank}"
        );
        assert_eq!(
            outcome.first_rejection, first_rejection,
            "why {rank}'s event was rejected"
        );
        let Some(live) = writer.cursor(rank) else {
            panic!("a rank that received a batch has a cursor");
        };
        let held = live.held_events() as u64;
        assert_eq!(
            live.applied + live.rejected + live.skipped + held,
            received.get(&rank).copied().unwrap_or(0),
            "every event of {rank} applied, rejected, skipped or held"
        );
        assert!(held <= MAX_HELD_EVENTS, "{held} events held");
        assert!(live.held_blocks() <= MAX_HELD_BLOCKS, "blocks held");
        if let Some(from) = live.resend_from() {
            assert_eq!(
                live.last_applied().and_then(|l| l.checked_add(1)),
                Some(from),
                "resend from one past the last applied"
            );
        }
        compare(&index, &reference.naive);
        for query in &queries {
            same_overlap(&index, &reference.naive, query);
        }
    }
}

/// Decodes one batch; also returns the chains of local hashes its stores
/// name, as extra queries.
fn batch(
    input: &mut Bytes<'_>,
    op: u8,
    last_id: &mut u64,
) -> (pb::KvEventBatch, Vec<Vec<LocalHash>>) {
    let worker_id = WORKERS[usize::from(op >> 3) & 1].0;
    let dp_rank = u32::from((op >> 4) & 3) % 3;
    let count = input.u8() % (MAX_EVENTS + 1);
    let mut events = Vec::with_capacity(usize::from(count));
    let mut queries = Vec::new();
    for _ in 0..count {
        let event_id = next_id(input, last_id);
        let kind = input.u8();
        let kind = match kind % 8 {
            0..=3 => {
                let (stored, locals) = stored(input, kind);
                queries.push(locals);
                Some(pb::kv_event::Kind::Stored(stored))
            }
            4 | 5 => {
                let n = input.u8() % 4;
                Some(pb::kv_event::Kind::Removed(pb::BlocksRemoved {
                    tier: 0,
                    engine_hashes: (0..n)
                        .map(|_| u64::from(input.u8() % ENGINE_HASHES))
                        .collect(),
                }))
            }
            6 => Some(pb::kv_event::Kind::Cleared(pb::CacheCleared {})),
            _ => None,
        };
        events.push(pb::KvEvent { event_id, kind });
    }
    let batch = pb::KvEventBatch {
        worker_id,
        dp_rank,
        events,
    };
    (batch, queries)
}

/// An event id: mostly a small step from the last one (back, repeat,
/// forward, a gap), sometimes an arbitrary or extreme one.
fn next_id(input: &mut Bytes<'_>, last_id: &mut u64) -> u64 {
    let step = input.u8();
    let id = match step {
        0xfd => input.u64(),
        0xfe => MAX_HELD_EVENTS + u64::from(input.u8()),
        0xff => u64::MAX - u64::from(input.u8() % 4),
        _ => last_id.wrapping_add_signed(i64::from(step as i8 % 16)),
    };
    *last_id = id;
    id
}

/// A stored event under a parent from the engine hash pool (or the root),
/// with up to four blocks (none is malformed), each given by a small local
/// hash or by token ids.
fn stored(input: &mut Bytes<'_>, kind: u8) -> (pb::BlocksStored, Vec<LocalHash>) {
    let parent = match input.u8() {
        p if p < ENGINE_HASHES => Some(u64::from(p)),
        _ => None,
    };
    let n = input.u8() % 5;
    let mut blocks = Vec::with_capacity(usize::from(n));
    let mut locals = Vec::new();
    for _ in 0..n {
        let engine_hash = u64::from(input.u8() % ENGINE_HASHES);
        let choice = input.u8();
        let content = if choice & 0x80 == 0 {
            let local = u64::from(choice) % LOCALS;
            locals.push(local);
            pb::stored_block::Content::LocalHash(local)
        } else {
            // Token ids; a wrong count is malformed.
            let len = if choice & 0x40 == 0 {
                BLOCK_SIZE as usize
            } else {
                usize::from(choice % 4)
            };
            pb::stored_block::Content::TokenIds(pb::TokenIds {
                ids: (0..len).map(|_| u32::from(input.u8() % 4)).collect(),
            })
        };
        blocks.push(pb::StoredBlock {
            engine_hash,
            content: Some(content),
            mm_info: None,
        });
    }
    let stored = pb::BlocksStored {
        tier: 0,
        parent_engine_hash: parent,
        blocks,
        lora_name: if kind & 4 == 0 {
            String::new()
        } else {
            "adapter".into()
        },
        cache_namespace: if kind & 16 == 0 {
            String::new()
        } else {
            "salt".into()
        },
    };
    (stored, locals)
}

/// Whole-index answers: blocks per target, digest, nodes, and every query
/// over the small alphabet up to three blocks long.
fn compare(index: &KvIndex, naive: &NaiveIndex) {
    let (stats, naive_stats) = (index.stats(), naive.stats());
    assert_eq!(
        stats.per_worker, naive_stats.per_worker,
        "blocks per target"
    );
    assert_eq!(stats.blocks, naive_stats.blocks, "blocks");
    assert_eq!(stats.workers, naive_stats.workers, "targets holding blocks");
    assert_eq!(stats.nodes, naive_stats.nodes, "nodes");
    assert_eq!(index.digest(), naive.digest(), "digest");
    let mut query = Vec::with_capacity(3);
    for a in 0..LOCALS {
        query.clear();
        query.push(a);
        same_overlap(index, naive, &query);
        for b in 0..LOCALS {
            query.truncate(1);
            query.push(b);
            same_overlap(index, naive, &query);
            for c in 0..LOCALS {
                query.truncate(2);
                query.push(c);
                same_overlap(index, naive, &query);
            }
        }
    }
}

fn same_overlap(index: &KvIndex, naive: &NaiveIndex, query: &[LocalHash]) {
    assert_eq!(
        index.find_matches(query).sorted(),
        naive.find_matches(query).sorted(),
        "overlap of {query:?}"
    );
}
