//! One worker's event stream through the index writer (`EventWriter`, as
//! the service runs it, without gRPC): whatever order events arrive in,
//! once every gap is healed the index holds exactly what the worker holds.
//!
//! The property test plays a worker (`common::worker::TestWorker`) through
//! a network that loses, delays, doubles and replays batches. It assumes
//! only what the protocol asks (proto/kvroute/v1/workers.proto,
//! `PublishEvents`): a stream's first batch arrives first (it sets the
//! start), and a worker renumbers only when answering a resync request,
//! on a new stream, so nothing numbered before arrives after it. Batches of
//! two numberings cannot be told apart by anyone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::{collections::VecDeque, sync::Arc};

use common::worker::{Ev, Reply, TestWorker};
use kvroute::{
    ingest::{BatchOutcome, EventWriter, IngestEvent, ValidatedBatch},
    metrics::Metrics,
    router::{RouterConfig, RouterCore},
};
use kvroute_core::{
    index::{KvEvent, KvIndex, TieredEvent, naive::NaiveIndex},
    registry::Registration,
    types::{WorkerRank, WorkerRole},
};
use proptest::{prelude::*, sample::Index};

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
                tiers: Vec::new(),
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
                adapters: Vec::new(),
                loads_adapters: false,
                lease_ttl: None,
                kv_events: kvroute_core::types::KvEventsMode::Exact,
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
                        event: TieredEvent::device(event.clone()),
                    })
                    .collect(),
            })
            .unwrap()
    }

    fn send_ev(&self, events: &[(u64, Ev)]) -> BatchOutcome {
        let events: Vec<(u64, KvEvent)> =
            events.iter().map(|(id, e)| (*id, e.to_index())).collect();
        self.send(&events)
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

/// One step of the worker's own history (indices pick among the blocks it
/// holds at that point).
#[derive(Clone, Debug)]
enum Op {
    /// Stores a chain under a block it holds (or the root).
    Store {
        parent: Option<Index>,
        locals: Vec<u64>,
    },
    /// Evicts blocks it holds, leaves or not.
    Remove(Vec<Index>),
    Clear,
    /// Its numbering jumps: ids it never used and cannot resend.
    SkipIds(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (
            proptest::option::weighted(0.8, any::<Index>()),
            proptest::collection::vec(0u64..6, 1..5),
        )
            .prop_map(|(parent, locals)| Op::Store { parent, locals }),
        6 => proptest::collection::vec(any::<Index>(), 1..4).prop_map(Op::Remove),
        1 => Just(Op::Clear),
        1 => prop_oneof![Just(3u64), Just(cursor_bound() + 10)].prop_map(Op::SkipIds),
    ]
}

fn cursor_bound() -> u64 {
    kvroute::ingest::cursor::MAX_HELD_EVENTS
}

/// What the network does with one batch.
#[derive(Clone, Copy, Debug)]
enum Net {
    Deliver,
    /// Lost (a broken stream): the worker gets no reply.
    Lose,
    /// Arrives after this many later batches.
    Delay(u8),
    /// Arrives twice.
    Twice,
    /// Arrives, then a copy of a batch sent earlier arrives again.
    AlsoOld(Index),
}

fn net() -> impl Strategy<Value = Net> {
    prop_oneof![
        10 => Just(Net::Deliver),
        2 => Just(Net::Lose),
        2 => (1u8..6).prop_map(Net::Delay),
        1 => Just(Net::Twice),
        1 => any::<Index>().prop_map(Net::AlsoOld),
    ]
}

/// How the worker takes one reply.
#[derive(Clone, Copy, Debug)]
struct Answer {
    /// False: it ignores the reply (no acknowledgement, no answer).
    heeds: bool,
    /// Where a resync of its numbers from.
    renumber: Renumber,
}

#[derive(Clone, Copy, Debug)]
enum Renumber {
    /// Its own next id.
    Continue,
    /// As low as kvroute allows (the reply's resync floor).
    Floor,
    Far(u64),
}

fn answer() -> impl Strategy<Value = Answer> {
    (
        proptest::bool::weighted(0.7),
        prop_oneof![
            3 => Just(Renumber::Continue),
            1 => Just(Renumber::Floor),
            1 => (0u64..1 << 40).prop_map(Renumber::Far),
        ],
    )
        .prop_map(|(heeds, renumber)| Answer { heeds, renumber })
}

/// A batch's events with their ids.
type Events = Vec<(u64, Ev)>;

/// A worker, the network between it and the writer, and the writer.
struct Sim {
    stream: Stream,
    worker: TestWorker,
    nets: Vec<Net>,
    answers: Vec<Answer>,
    turn: usize,
    /// Batches to send, tagged with their epoch (see `epoch`).
    outbox: VecDeque<(u32, Events)>,
    /// Batches on their way, with the step they arrive at.
    delayed: Vec<(usize, u32, Events)>,
    /// Batches sent so far, for late copies.
    sent: Vec<(u32, Events)>,
    step: usize,
    /// Raised when the worker renumbers in a resync: it opens a new stream
    /// then, so nothing numbered before it arrives afterwards (batches of
    /// two numberings cannot be told apart; proto: "its own next id is
    /// safest").
    epoch: u32,
    /// The network is reliable and the worker heeds every reply.
    reliable: bool,
    first_sent: bool,
    /// What happened, for a failing case's message.
    log: Vec<String>,
}

impl Sim {
    fn next_net(&mut self) -> Net {
        if self.reliable || !self.first_sent {
            // A stream starts at its first batch: it arrives first.
            self.first_sent = true;
            return Net::Deliver;
        }
        self.turn += 1;
        self.nets[self.turn % self.nets.len()]
    }

    fn next_answer(&mut self) -> Answer {
        self.turn += 1;
        let answer = self.answers[self.turn % self.answers.len()];
        Answer {
            heeds: answer.heeds || self.reliable,
            ..answer
        }
    }

    /// Sends everything in the outbox through the network.
    fn flush(&mut self) {
        let mut budget = 500;
        while let Some((epoch, batch)) = self.outbox.pop_front() {
            budget -= 1;
            if budget == 0 {
                break;
            }
            if epoch != self.epoch || batch.is_empty() && !self.reliable {
                continue;
            }
            let net = self.next_net();
            self.log.push(format!("send {} {net:?}", describe(&batch)));
            match net {
                Net::Deliver => self.arrive(epoch, &batch),
                Net::Lose => {}
                Net::Delay(k) => self
                    .delayed
                    .push((self.step + k as usize, epoch, batch.clone())),
                Net::Twice => {
                    self.arrive(epoch, &batch);
                    self.arrive(epoch, &batch);
                }
                Net::AlsoOld(i) => {
                    self.arrive(epoch, &batch);
                    if !self.sent.is_empty() {
                        let (old_epoch, old) = self.sent[i.index(self.sent.len())].clone();
                        self.arrive(old_epoch, &old);
                    }
                }
            }
            self.sent.push((epoch, batch));
            self.step += 1;
            let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.delayed)
                .into_iter()
                .partition(|d| d.0 <= self.step);
            self.delayed = later;
            for (_, epoch, batch) in due {
                self.arrive(epoch, &batch);
            }
        }
    }

    /// A batch reaches the writer; the worker takes the reply.
    fn arrive(&mut self, epoch: u32, batch: &[(u64, Ev)]) {
        if epoch != self.epoch {
            return;
        }
        let outcome = self.stream.send_ev(batch);
        self.log.push(format!(
            "arrive {} -> last {:?} resend {:?} resync {} held {} skipped {} rejected {}",
            describe(batch),
            outcome.last_applied,
            outcome.resend_from,
            outcome.resync_required,
            outcome.held,
            outcome.skipped,
            outcome.rejected
        ));
        let answer = self.next_answer();
        if !answer.heeds {
            return;
        }
        let from = match answer.renumber {
            Renumber::Continue => self.worker.next_event_id(),
            Renumber::Floor => 0, // the reply's floor, the lowest allowed
            Renumber::Far(id) => id,
        };
        let (resyncs, own_next) = (self.worker.resyncs, self.worker.next_event_id());
        let reply = Reply {
            last_applied: outcome.last_applied,
            resend_from: outcome.resend_from,
            resync_required: outcome.resync_required,
            resync_floor: outcome.resync_floor,
        };
        let events = self.worker.on_reply(reply, from);
        let renumbered = events.first().is_some_and(|(id, _)| *id != own_next);
        if self.worker.resyncs > resyncs && renumbered {
            self.epoch += 1;
            self.delayed.clear();
        }
        if !events.is_empty() {
            self.outbox.push_back((self.epoch, events));
        }
    }
}

/// A batch in a log line: its ids, `c` for a cleared.
fn describe(batch: &[(u64, Ev)]) -> String {
    let ids: Vec<String> = batch
        .iter()
        .map(|(id, e)| match e {
            Ev::Cleared => format!("c{id}"),
            Ev::Stored { .. } => format!("s{id}"),
            Ev::Removed(_) => format!("r{id}"),
        })
        .collect();
    format!("[{}]", ids.join(" "))
}

/// Runs one history through the simulation and checks the index against
/// the naive one fed the history in order.
fn run(
    first_id: u64,
    ops: &[Op],
    cuts: &[usize],
    nets: Vec<Net>,
    answers: Vec<Answer>,
) -> Result<(), TestCaseError> {
    let mut sim = Sim {
        stream: Stream::new(),
        worker: TestWorker::new(WORKER, 0, first_id),
        nets,
        answers,
        turn: 0,
        outbox: VecDeque::new(),
        delayed: Vec::new(),
        sent: Vec::new(),
        step: 0,
        epoch: 0,
        reliable: false,
        first_sent: false,
        log: Vec::new(),
    };
    let target = WorkerRank::new(WORKER, 0);
    let mut naive = NaiveIndex::new(16);
    let mut ops = ops.iter();
    for &cut in cuts.iter().cycle() {
        let mut batch = Vec::new();
        for op in ops.by_ref().take(cut) {
            let worker = &mut sim.worker;
            let held = worker.held();
            let event = match op {
                Op::Store { parent, locals } => {
                    let parent = parent
                        .filter(|_| !held.is_empty())
                        .map(|i| held[i.index(held.len())]);
                    worker.store(parent, locals)
                }
                Op::Remove(picks) if !held.is_empty() => {
                    let mut chosen: Vec<u64> =
                        picks.iter().map(|i| held[i.index(held.len())]).collect();
                    chosen.sort_unstable();
                    chosen.dedup();
                    worker.remove(&chosen)
                }
                Op::Remove(_) => continue,
                Op::Clear => worker.clear(),
                Op::SkipIds(n) => {
                    worker.skip_ids(*n);
                    continue;
                }
            };
            naive.apply(target, &event.1.to_index()).unwrap();
            batch.push(event);
        }
        if batch.is_empty() && ops.len() == 0 {
            break;
        }
        if !batch.is_empty() {
            sim.outbox.push_back((sim.epoch, batch));
            sim.flush();
        }
    }
    // Delivery completes: what is on its way arrives, then the worker
    // reconnects and resends what was not acknowledged (or only asks, with
    // an empty batch), and heeds every reply on a reliable network.
    sim.reliable = true;
    let delayed = std::mem::take(&mut sim.delayed);
    for (_, epoch, batch) in delayed {
        sim.arrive(epoch, &batch);
    }
    for _ in 0..20 {
        let unacked = sim.worker.unacked();
        sim.outbox.push_back((sim.epoch, unacked));
        sim.flush();
        let cursor = sim.stream.writer.cursor(target).unwrap_or_default();
        if cursor.resend_from().is_none() && !cursor.resync_required() {
            break;
        }
    }
    let cursor = sim.stream.writer.cursor(target).unwrap_or_default();
    let log = sim.log.join("\n");
    prop_assert_eq!(cursor.resend_from(), None, "{}", log);
    prop_assert!(!cursor.resync_required(), "{}", log);
    prop_assert_eq!(cursor.held_events(), 0, "{}", log);
    let index = sim.stream.index();
    prop_assert_eq!(index.digest(), naive.digest(), "{}", log);
    prop_assert_eq!(index.worker_blocks(target), sim.worker.held_count());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random histories, random batches, lost, late, doubled and replayed
    /// batches, a worker that sometimes ignores replies and renumbers when
    /// it resyncs: once every resend is answered, the index digest equals
    /// the naive index's fed the history in order.
    #[test]
    fn the_index_ends_exact_whatever_the_order_of_arrival(
        first_id in prop_oneof![Just(0u64), Just(1), 0u64..1 << 50],
        ops in proptest::collection::vec(op(), 1..150),
        cuts in proptest::collection::vec(1usize..6, 1..40),
        nets in proptest::collection::vec(net(), 1..60),
        answers in proptest::collection::vec(answer(), 1..30),
    ) {
        run(first_id, &ops, &cuts, nets, answers)?;
    }
}

#[test]
fn engine_events_the_index_refuses_count_as_rejected_for_the_rank() {
    let stream = Stream::new();
    let outcome = stream
        .writer
        .apply_engine_batch(kvroute::ingest::EngineBatch {
            worker_id: WORKER,
            generation: stream.generation,
            model: MODEL.into(),
            dp_rank: 0,
            events: vec![TieredEvent::device(KvEvent::Stored {
                parent: Some(404),
                blocks: vec![(1, 1)],
            })],
        })
        .unwrap();
    assert_eq!(outcome.rejected, 1);
    let cursor = stream.writer.cursor(WorkerRank::new(WORKER, 0)).unwrap();
    assert_eq!(cursor.rejected, 1);
    assert_eq!(stream.writer.cursor_totals(), (0, 1));
}
