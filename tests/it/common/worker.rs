//! TestWorker: a worker that publishes KV events the way the protocol asks
//! (proto/kvroute/v1/workers.proto, `PublishEventsReply`): it knows its own
//! cache, numbers its events, keeps every event kvroute has not yet
//! acknowledged, resends from the id a reply asks for, and answers a
//! resync request with a `cleared` followed by stores of everything it
//! holds. Used over real gRPC (tests/it/workers.rs) and against the index
//! writer directly (tests/it/event_stream.rs).

use std::collections::{BTreeMap, BTreeSet};

use kvroute::pb;
use kvroute_core::index::KvEvent;

/// One event as the worker describes it: what it stored, removed or
/// cleared. Convertible to the wire form and to the index's form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ev {
    /// Blocks `(engine hash, local hash)` chained under `parent`.
    Stored {
        parent: Option<u64>,
        blocks: Vec<(u64, u64)>,
    },
    Removed(Vec<u64>),
    Cleared,
}

impl Ev {
    pub fn to_pb(&self, event_id: u64) -> pb::KvEvent {
        kvroute::grpc::convert::kv_event_to_pb(event_id, &self.to_index())
    }

    pub fn to_index(&self) -> KvEvent {
        match self {
            Ev::Stored { parent, blocks } => KvEvent::Stored {
                parent: *parent,
                blocks: blocks.clone(),
            },
            Ev::Removed(hashes) => KvEvent::Removed {
                blocks: hashes.clone(),
            },
            Ev::Cleared => KvEvent::Cleared,
        }
    }
}

/// One block the worker stored since its last clear.
#[derive(Clone, Copy, Debug)]
struct Block {
    parent: Option<u64>,
    local: u64,
    /// False once evicted; kept while blocks below it are held, since they
    /// still hang at its path.
    held: bool,
}

/// What a reply told the worker (see `PublishEventsReply`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    /// Every event up to this id was processed, in order.
    pub last_applied: Option<u64>,
    pub resend_from: Option<u64>,
    pub resync_required: bool,
    /// With `resync_required`: the lowest id the answer may start at.
    pub resync_floor: Option<u64>,
}

impl Reply {
    pub fn from_pb(reply: &pb::PublishEventsReply) -> Self {
        Self {
            // A reply to a batch always comes after something was processed
            // or asks for a resend or a resync, so 0 means event 0 here.
            last_applied: Some(reply.last_applied_event_id),
            resend_from: reply.resend_from_event_id,
            resync_required: reply.resync_required,
            resync_floor: reply.resync_from_event_id,
        }
    }
}

/// A worker's cache and its side of the event protocol.
#[derive(Clone, Debug)]
pub struct TestWorker {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Every block stored since the last clear, by engine hash.
    blocks: BTreeMap<u64, Block>,
    next_engine_hash: u64,
    next_event_id: u64,
    /// Events sent and not yet acknowledged, by id.
    unacked: BTreeMap<u64, Ev>,
    /// The lowest id it can still resend: events before it were
    /// acknowledged and forgotten, or belong to before its last resync.
    kept_from: u64,
    /// Resync batches sent.
    pub resyncs: u32,
    /// Resend answers sent.
    pub resends: u32,
}

impl TestWorker {
    /// A worker whose first event will carry `first_event_id`; its engine
    /// hashes start at `worker_id << 32`, so two workers never share one.
    pub fn new(worker_id: u64, dp_rank: u32, first_event_id: u64) -> Self {
        Self {
            worker_id,
            dp_rank,
            blocks: BTreeMap::new(),
            next_engine_hash: (worker_id << 32) + 1,
            next_event_id: first_event_id,
            unacked: BTreeMap::new(),
            kept_from: first_event_id,
            resyncs: 0,
            resends: 0,
        }
    }

    /// Engine hashes of the blocks held now, ascending.
    pub fn held(&self) -> Vec<u64> {
        self.blocks
            .iter()
            .filter(|(_, b)| b.held)
            .map(|(&e, _)| e)
            .collect()
    }

    /// How many blocks the worker holds.
    pub fn held_count(&self) -> u64 {
        self.blocks.values().filter(|b| b.held).count() as u64
    }

    /// The id its next event will carry.
    pub fn next_event_id(&self) -> u64 {
        self.next_event_id
    }

    /// Events sent and not yet acknowledged.
    pub fn unacked(&self) -> Vec<(u64, Ev)> {
        self.unacked
            .iter()
            .map(|(&id, e)| (id, e.clone()))
            .collect()
    }

    fn record(&mut self, event: Ev) -> (u64, Ev) {
        let id = self.next_event_id;
        self.next_event_id = id.wrapping_add(1);
        self.unacked.insert(id, event.clone());
        (id, event)
    }

    /// Stores blocks with the given local hashes under `parent` (a block it
    /// holds, or the root), with fresh engine hashes.
    pub fn store(&mut self, parent: Option<u64>, locals: &[u64]) -> (u64, Ev) {
        if let Some(p) = parent {
            assert!(
                self.blocks.get(&p).is_some_and(|b| b.held),
                "a worker stores only under blocks it holds"
            );
        }
        let mut blocks = Vec::with_capacity(locals.len());
        let mut up = parent;
        for &local in locals {
            let engine = self.next_engine_hash;
            self.next_engine_hash += 1;
            self.blocks.insert(
                engine,
                Block {
                    parent: up,
                    local,
                    held: true,
                },
            );
            blocks.push((engine, local));
            up = Some(engine);
        }
        self.record(Ev::Stored { parent, blocks })
    }

    /// Evicts blocks it holds.
    pub fn remove(&mut self, engine_hashes: &[u64]) -> (u64, Ev) {
        for e in engine_hashes {
            let block = self
                .blocks
                .get_mut(e)
                .expect("a worker removes blocks it has");
            assert!(block.held, "a worker removes only blocks it holds");
            block.held = false;
        }
        self.forget_unneeded();
        self.record(Ev::Removed(engine_hashes.to_vec()))
    }

    /// Skips `n` event ids, as a worker whose numbering jumped would: the
    /// ids were never used, so it cannot resend them.
    pub fn skip_ids(&mut self, n: u64) {
        self.next_event_id += n;
    }

    /// Drops its whole cache.
    pub fn clear(&mut self) -> (u64, Ev) {
        self.blocks.clear();
        self.record(Ev::Cleared)
    }

    /// Forgets evicted blocks nothing held hangs below.
    fn forget_unneeded(&mut self) {
        let needed = self.needed();
        self.blocks.retain(|e, _| needed.contains(e));
    }

    /// Blocks that are held, or lie on the path to a held block.
    fn needed(&self) -> BTreeSet<u64> {
        let mut needed = BTreeSet::new();
        for (&e, b) in &self.blocks {
            if !b.held {
                continue;
            }
            let mut at = Some(e);
            while let Some(x) = at {
                if !needed.insert(x) {
                    break;
                }
                at = self.blocks.get(&x).and_then(|b| b.parent);
            }
        }
        needed
    }

    /// Takes a reply to heart: forgets what it acknowledges and returns the
    /// events to send in answer: a resend, a resync (numbered from
    /// `resync_from`, or the reply's floor if that is higher, when kvroute
    /// asked for it), or nothing.
    pub fn on_reply(&mut self, reply: Reply, resync_from: u64) -> Vec<(u64, Ev)> {
        if reply.resync_required {
            return self.resync(resync_from.max(reply.resync_floor.unwrap_or(0)));
        }
        if let Some(last) = reply.last_applied {
            match reply.resend_from {
                // Never forget what is asked for.
                Some(0) => {}
                Some(from) => self.acknowledge(last.min(from - 1)),
                None => self.acknowledge(last),
            }
        }
        match reply.resend_from {
            Some(from) => self.resend(from),
            None => Vec::new(),
        }
    }

    /// Forgets events up to `id`: kvroute has them.
    pub fn acknowledge(&mut self, id: u64) {
        if id >= self.kept_from && id < self.next_event_id {
            self.unacked.retain(|&k, _| k > id);
            self.kept_from = id + 1;
        }
    }

    /// Every unacknowledged event from `from` on; a resync instead when it
    /// does not have `from` (what a worker does when it cannot resend). A
    /// resync kvroute did not ask for keeps the worker's numbering: kvroute
    /// is not dropping events meanwhile, so renumbered events could be
    /// taken for old ones should the resync batch be lost.
    pub fn resend(&mut self, from: u64) -> Vec<(u64, Ev)> {
        let has_it = from >= self.kept_from
            && (from == self.next_event_id || self.unacked.contains_key(&from));
        if !has_it {
            return self.resync(self.next_event_id);
        }
        self.resends += 1;
        self.unacked
            .range(from..)
            .map(|(&id, e)| (id, e.clone()))
            .collect()
    }

    /// A resync: a `cleared`, then stores of every block it holds (and of
    /// the evicted blocks above them, removed again at the end, so each
    /// held block hangs at its own path), numbered from `from`. Earlier
    /// unacknowledged events are forgotten: the resync replaces them.
    pub fn resync(&mut self, from: u64) -> Vec<(u64, Ev)> {
        self.resyncs += 1;
        self.unacked.clear();
        self.kept_from = from;
        self.next_event_id = from;
        let mut out = vec![self.record(Ev::Cleared)];
        let needed = self.needed();
        let mut children: BTreeMap<Option<u64>, Vec<u64>> = BTreeMap::new();
        for &e in &needed {
            children.entry(self.blocks[&e].parent).or_default().push(e);
        }
        // Depth first from the root, one stored event per chain.
        let mut order = Vec::with_capacity(needed.len());
        let mut stack: Vec<u64> = children.get(&None).cloned().unwrap_or_default();
        stack.reverse();
        while let Some(e) = stack.pop() {
            order.push(e);
            if let Some(kids) = children.get(&Some(e)) {
                stack.extend(kids.iter().rev());
            }
        }
        let mut stores: Vec<Ev> = Vec::new();
        for e in order {
            let block = self.blocks[&e];
            match stores.last_mut() {
                Some(Ev::Stored { blocks, .. })
                    if blocks.last().map(|&(last, _)| last) == block.parent =>
                {
                    blocks.push((e, block.local));
                }
                _ => stores.push(Ev::Stored {
                    parent: block.parent,
                    blocks: vec![(e, block.local)],
                }),
            }
        }
        for store in stores {
            out.push(self.record(store));
        }
        let evicted: Vec<u64> = needed
            .iter()
            .copied()
            .filter(|e| !self.blocks[e].held)
            .collect();
        if !evicted.is_empty() {
            out.push(self.record(Ev::Removed(evicted)));
        }
        out
    }

    /// A wire batch of `events`.
    pub fn batch(&self, events: &[(u64, Ev)]) -> pb::KvEventBatch {
        pb::KvEventBatch {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            events: events.iter().map(|(id, e)| e.to_pb(*id)).collect(),
        }
    }
}
