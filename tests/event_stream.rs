//! One worker's event stream through the index writer (`EventWriter`, as
//! the service runs it, without gRPC): whatever order events arrive in,
//! once every gap is healed the index holds exactly what the worker holds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvroute::{
    index::{KvEvent, KvIndex, naive::NaiveIndex},
    ingest::{BatchOutcome, EventWriter, IngestEvent, ValidatedBatch},
    metrics::Metrics,
    registry::Registration,
    router::{RouterConfig, RouterCore},
    types::{WorkerRank, WorkerRole},
};

const MODEL: &str = "m";
const WORKER: u64 = 7;

/// A router core with one registered worker and its index writer.
struct Stream {
    core: Arc<RouterCore>,
    writer: EventWriter,
    generation: u64,
}

impl Stream {
    fn new() -> Self {
        let core = Arc::new(RouterCore::new(
            RouterConfig::default(),
            Metrics::new().unwrap(),
        ));
        let outcome = core
            .register_worker(Registration {
                worker_id: WORKER,
                model: MODEL.into(),
                role: WorkerRole::Aggregated,
                endpoint: String::new(),
                block_size: 16,
                dp_start_rank: 0,
                dp_size: 1,
                total_kv_blocks: 0,
                max_num_batched_tokens: 8192,
                taints: Vec::new(),
                lease_ttl: None,
            })
            .unwrap();
        Self {
            writer: EventWriter::new(core.clone()),
            generation: outcome.record.generation,
            core,
        }
    }

    fn send(&self, events: &[(u64, KvEvent)]) -> BatchOutcome {
        self.writer
            .apply_batch(ValidatedBatch {
                worker_id: WORKER,
                generation: self.generation,
                model: MODEL.into(),
                dp_rank: 0,
                events: events
                    .iter()
                    .map(|(event_id, event)| IngestEvent {
                        event_id: *event_id,
                        event: event.clone(),
                    })
                    .collect(),
            })
            .unwrap()
    }

    fn index(&self) -> Arc<KvIndex> {
        self.core.index_of(MODEL).unwrap()
    }

    fn blocks(&self) -> u64 {
        self.index().worker_blocks(WorkerRank::new(WORKER, 0))
    }
}

fn store(parent: Option<u64>, blocks: &[(u64, u64)]) -> KvEvent {
    KvEvent::Stored {
        parent,
        blocks: blocks.to_vec(),
    }
}

fn remove(blocks: &[u64]) -> KvEvent {
    KvEvent::Removed {
        blocks: blocks.to_vec(),
    }
}

/// The naive index fed `history` in order.
fn naive_of(history: &[(u64, KvEvent)]) -> NaiveIndex {
    let mut naive = NaiveIndex::new(16);
    for (_, event) in history {
        let _ = naive.apply(WorkerRank::new(WORKER, 0), event);
    }
    naive
}

/// The defect this file was written for: a removal that arrives past a gap
/// must not run before the store it undoes. The worker stores 70 blocks,
/// evicts three of them in events 2 and 4, the blocks of event 3 in event
/// 5; events 1..=3 are lost and resent after 4 and 5 arrived.
#[test]
fn a_removal_past_a_gap_waits_for_the_store_it_undoes() {
    let chain =
        |first: u64, n: u64| -> Vec<(u64, u64)> { (first..first + n).map(|e| (e, e)).collect() };
    let history = vec![
        (0, store(None, &chain(1, 60))),
        (1, store(Some(60), &chain(61, 8))),
        (2, remove(&[68])),
        (3, store(Some(67), &chain(100, 2))),
        (4, remove(&[67, 66])),
        (5, remove(&[100, 101])),
        (6, store(Some(65), &chain(200, 2))),
    ];
    let naive = naive_of(&history);
    let stream = Stream::new();
    stream.send(&history[0..1]);
    // 1..=3 are lost; 4 and 5 arrive.
    let gap = stream.send(&history[4..6]);
    assert_eq!(gap.resend_from, Some(1));
    // The worker resends from 1, and goes on with 6.
    let healed = stream.send(&history[1..7]);
    assert_eq!(healed.resend_from, None);
    assert_eq!(stream.blocks(), 67, "what the worker holds");
    assert_eq!(stream.index().digest(), naive.digest());
}
