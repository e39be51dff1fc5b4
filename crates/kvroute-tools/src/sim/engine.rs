//! One simulated inference engine: paged KV cache with prefix caching, a
//! continuous-batching scheduler with chunked prefill, and step timings.
//!
//! It exists so routing policies can be judged against the cache and queueing
//! behaviour of a real engine without running one. The model follows the
//! published behaviour of NVIDIA Dynamo's "mocker" engine (vLLM flavour):
//!
//! * Cache: `num_blocks` blocks of `block_size` tokens. A full block is
//!   identified by the chained hash of its tokens (parent hash + contents), so
//!   equal prefixes share blocks. A block whose last user finishes stays
//!   cached in an LRU pool and is evicted only when a fresh block is needed
//!   and no never-used block is left. A sequence's blocks are released tail
//!   first, so its suffix is evicted before its prefix.
//! * One step ("pass"): running sequences first, in admission order, each
//!   taking its next chunk (a decode token, or the rest of its prefill up to
//!   the remaining token budget); then waiting sequences in FIFO order while
//!   fewer than `max_num_seqs` run. A waiting sequence is admitted only if
//!   its whole known length fits in the blocks not held by running sequences
//!   (its already-active cached prefix excepted); otherwise admission stops
//!   (strict FIFO). Cache hits are counted in whole blocks and capped so at
//!   least one token is computed.
//! * If a chunk cannot get blocks, the newest running sequence is preempted
//!   (its blocks released, its progress reset, it goes to the front of the
//!   waiting queue) and no new sequence is admitted in that step.
//! * Step time = prefill time of the step's newly computed prompt tokens plus
//!   decode time of the sequences that were already decoding. A sequence whose
//!   prefill finishes in the step samples its first token from that step (no
//!   extra decode cost). All tokens of a step are emitted at its end, so TTFT
//!   ends at the end of the step that computes the prompt's last chunk.
//! * Decode time uses the KV utilisation `u` = context tokens of the decoding
//!   sequences / cache capacity in tokens (the mocker's definition; it is
//!   close to active blocks / total blocks).
//! * Host tier (`host_blocks` > 0; none by default, and then nothing below
//!   happens): a cached block the device evicts moves to host memory
//!   (`host`), which evicts its oldest block when full. A block is in one
//!   tier at a time. A waiting sequence's cached prefix is its longest run of
//!   leading blocks each on the device or in host memory; the host ones are
//!   loaded into fresh device blocks at admission and are device blocks
//!   again. Loading costs `host_load_ms_per_block` per block, added to the
//!   step that admits the sequence (the copy is not overlapped with compute:
//!   the whole batch waits for it), and no prefill: loaded tokens count as
//!   computed. Every move is a KV event of its tier, host stores carrying
//!   their parent and tokens like device stores.

use std::collections::{HashMap, VecDeque};

use kvroute_core::types::Tier;

use super::determinism::FastBuild;
use crate::trace::{mix64, output_token};

mod host;

use host::{HostBlock, HostTier};

/// Engine parameters. Defaults are the mocker's defaults.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct EngineConfig {
    /// KV cache size in blocks.
    pub num_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunks + decode tokens).
    pub max_num_batched_tokens: usize,
    /// Reuse cached blocks across requests.
    pub enable_prefix_caching: bool,
    /// Split a prompt's prefill over several steps. When off, a prompt waits
    /// until the whole remainder fits in one step's budget.
    pub enable_chunked_prefill: bool,
    /// Prefill step ms = a*N^2 + b*N + c for N newly computed prompt tokens.
    pub prefill_quadratic: f64,
    pub prefill_linear: f64,
    pub prefill_constant: f64,
    /// Decode step ms = a*u^2 + b*u + c (at least `decode_min_ms`).
    pub decode_quadratic: f64,
    pub decode_linear: f64,
    pub decode_constant: f64,
    pub decode_min_ms: f64,
    /// Host-memory tier in blocks (0: none). Blocks the device evicts move
    /// there; see the module docs.
    pub host_blocks: usize,
    /// ms to load one block from the host tier into the device, added to
    /// the step that loads it (docs/TIERS.md says why the default).
    pub host_load_ms_per_block: f64,
}

/// Default `host_load_ms_per_block`: one 64-token block of an 8B model's KV
/// cache (8.4 MB in bf16) over PCIe Gen5 x16 at about 42 GB/s, a fifth of
/// the 0.97 ms the default prefill polynomial takes to compute it
/// (docs/TIERS.md).
pub const DEFAULT_HOST_LOAD_MS_PER_BLOCK: f64 = 0.2;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            num_blocks: 16_384,
            block_size: 64,
            max_num_seqs: 256,
            max_num_batched_tokens: 8_192,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            prefill_quadratic: 4.209989e-7,
            prefill_linear: 1.518344e-2,
            prefill_constant: 16.50142,
            decode_quadratic: -25.74,
            decode_linear: 54.01,
            decode_constant: 5.74,
            decode_min_ms: 1.0,
            host_blocks: 0,
            host_load_ms_per_block: DEFAULT_HOST_LOAD_MS_PER_BLOCK,
        }
    }
}

impl EngineConfig {
    /// Prefill step time in ms for `new_tokens` newly computed tokens.
    pub(crate) fn prefill_ms(&self, new_tokens: usize) -> f64 {
        if new_tokens == 0 {
            return 0.0;
        }
        let n = new_tokens as f64;
        (self.prefill_quadratic * n * n + self.prefill_linear * n + self.prefill_constant).max(0.0)
    }

    /// Decode step time in ms at KV utilisation `u` (clamped to 0..=1).
    pub(crate) fn decode_ms(&self, u: f64) -> f64 {
        let u = u.clamp(0.0, 1.0);
        (self.decode_quadratic * u * u + self.decode_linear * u + self.decode_constant)
            .max(self.decode_min_ms)
    }

    /// Check the parameters can run a simulation.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.num_blocks == 0 || self.block_size == 0 {
            return Err("num_blocks and block_size must be positive".into());
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return Err("max_num_seqs and max_num_batched_tokens must be positive".into());
        }
        if self.num_blocks >= u32::MAX as usize {
            return Err("num_blocks too large".into());
        }
        if !(self.host_load_ms_per_block.is_finite() && self.host_load_ms_per_block >= 0.0) {
            return Err("host_load_ms_per_block must be finite and >= 0".into());
        }
        // the most a worker may declare for a tier to the router
        let most = kvroute_core::registry::RegistryLimits::default().max_tier_blocks_per_rank;
        if self.host_blocks as u64 > most {
            return Err(format!(
                "host_blocks is at most {most} (what a worker may declare for a tier)"
            ));
        }
        Ok(())
    }
}

/// A KV cache event, in the order the engine's cache changed. `tier` says
/// where: the device, or host memory (an engine with a host tier).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineKvEvent {
    /// Blocks became cached. `blocks` form a chain: the first one's parent is
    /// `parent` (`None` = first block of a sequence), each next one's parent
    /// is the block before it. Tokens are the block's `block_size` tokens.
    /// A host store's parent may be in either tier.
    Stored {
        tier: Tier,
        parent: Option<u64>,
        blocks: Vec<(u64, Vec<u32>)>,
    },
    /// Cached blocks left the tier (evicted, or, from the host, loaded
    /// back into the device).
    Removed { tier: Tier, engine_hashes: Vec<u64> },
}

impl EngineKvEvent {
    /// The tier the event is about.
    pub fn tier(&self) -> Tier {
        match self {
            EngineKvEvent::Stored { tier, .. } | EngineKvEvent::Removed { tier, .. } => *tier,
        }
    }
}

/// Chained hash of one full block: depends on the parent block's hash and
/// on this block's tokens.
pub(crate) fn chain_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = parent.map_or(0x0123_4567_89AB_CDEF, |p| p ^ 0xC2B2_AE3D_27D4_EB4F);
    for pair in tokens.chunks(2) {
        let word = u64::from(pair[0]) | (pair.get(1).map_or(0, |&t| u64::from(t)) << 32);
        h = (h.rotate_left(23) ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    mix64(h ^ tokens.len() as u64)
}

/// The engine hash chain of every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = None;
    for block in tokens.chunks_exact(block_size.max(1)) {
        let h = chain_hash(parent, block);
        out.push(h);
        parent = Some(h);
    }
    out
}

/// Load of one engine, as a router may observe it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineLoad {
    pub running: usize,
    pub waiting: usize,
    /// Blocks held by running sequences.
    pub active_blocks: usize,
    pub total_blocks: usize,
    /// Blocks the prefix cache can find by hash (held or free to evict).
    pub cached_blocks: usize,
    /// Prompt tokens still to prefill (waiting sequences plus running ones
    /// whose prefill is unfinished; cache hits not yet known are included).
    pub prefill_tokens_queued: usize,
    /// The host tier's capacity in blocks (0: none).
    pub host_blocks: usize,
}

/// A token produced by a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenEmit {
    pub request_id: u64,
    /// The request's first output token.
    pub first: bool,
    /// The request's last output token: it is finished.
    pub done: bool,
}

/// Everything one step did. Its effects become visible at `now + duration_ms`.
#[derive(Clone, Debug, Default)]
pub struct PassOutcome {
    pub duration_ms: f64,
    pub emitted: Vec<TokenEmit>,
    /// (request id, prompt tokens found cached) for each admission; with a
    /// host tier, the tokens loaded from it included (as engines report
    /// cached tokens).
    pub admissions: Vec<(u64, usize)>,
    /// (request id, prompt tokens loaded from the host tier) for each
    /// admission that loaded any.
    pub host_loads: Vec<(u64, usize)>,
    /// Blocks loaded from the host tier in this step.
    pub loaded_blocks: usize,
    /// Requests that can never run on this engine (more blocks than the
    /// cache, or, without chunked prefill, a prompt over the step budget);
    /// dropped.
    pub rejected: Vec<u64>,
    pub kv_events: Vec<EngineKvEvent>,
    /// Prompt tokens computed in this step (cache hits excluded).
    pub prefill_tokens: usize,
    /// Sequences preempted in this step.
    pub preemptions: usize,
    /// Whether anything was scheduled, emitted or rejected.
    pub did_work: bool,
}

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Block {
    hash: u64,
    cached: bool,
    refs: u32,
    prev: u32,
    next: u32,
}

/// Physical blocks: never-used/private free blocks, cached blocks indexed by
/// hash, and an LRU list of cached blocks nobody holds.
#[derive(Debug)]
struct BlockPool {
    blocks: Vec<Block>,
    free: Vec<u32>,
    map: HashMap<u64, u32, FastBuild>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
    /// Host memory (`None`: no host tier), where evicted cached blocks go.
    host: Option<HostTier>,
    /// Each cached block's parent and tokens, by block id, so an eviction
    /// can move it to the host (empty without a host tier).
    origins: Vec<HostBlock>,
}

impl BlockPool {
    fn new(n: usize, host_blocks: usize) -> Self {
        let empty = Block {
            hash: 0,
            cached: false,
            refs: 0,
            prev: NIL,
            next: NIL,
        };
        BlockPool {
            blocks: vec![empty; n],
            free: (0..n as u32).rev().collect(),
            map: HashMap::with_capacity_and_hasher(n, FastBuild::default()),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            host: (host_blocks > 0).then(|| HostTier::new(host_blocks)),
            origins: if host_blocks > 0 {
                vec![HostBlock::default(); n]
            } else {
                Vec::new()
            },
        }
    }

    fn in_host(&self, hash: u64) -> bool {
        self.host.as_ref().is_some_and(|h| h.contains(hash))
    }

    /// Moves evicted device block `id` (cached as `hash`) to the host tier,
    /// making room there first.
    fn offload(&mut self, id: u32, hash: u64, events: &mut EventSink) {
        let Some(host) = self.host.as_mut() else {
            return;
        };
        let block = std::mem::take(&mut self.origins[id as usize]);
        if let Some(old) = host.make_room() {
            events.removed(Tier::Host, old);
        }
        events.stored(Tier::Host, block.parent, hash, &block.tokens);
        host.insert(hash, block);
    }

    fn num_active(&self) -> usize {
        self.blocks.len() - self.free.len() - self.lru_len
    }

    fn unlink(&mut self, id: u32) {
        let Block { prev, next, .. } = self.blocks[id as usize];
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        self.lru_len -= 1;
    }

    fn push_lru(&mut self, id: u32) {
        let tail = self.lru_tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
        }
        if tail == NIL {
            self.lru_head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.lru_tail = id;
        self.lru_len += 1;
    }

    /// Take a reference on a cached block (leaving the LRU if idle).
    fn acquire(&mut self, id: u32) {
        if self.blocks[id as usize].refs == 0 {
            self.unlink(id);
        }
        self.blocks[id as usize].refs += 1;
    }

    /// A fresh private block, evicting the least recently used cached one if
    /// no never-used block is left.
    fn alloc(&mut self, events: &mut EventSink) -> Option<u32> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = self.lru_head;
                if id == NIL {
                    return None;
                }
                self.unlink(id);
                let hash = self.blocks[id as usize].hash;
                self.map.remove(&hash);
                events.removed(Tier::Device, hash);
                self.offload(id, hash, events);
                id
            }
        };
        let b = &mut self.blocks[id as usize];
        b.hash = 0;
        b.cached = false;
        b.refs = 1;
        Some(id)
    }

    fn release(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        b.refs -= 1;
        if b.refs == 0 {
            if b.cached {
                self.push_lru(id);
            } else {
                self.free.push(id);
            }
        }
    }

    /// Make a computed private block cached under `hash`. False when another
    /// block already holds that hash (this one stays private). With a host
    /// tier, `origin` (parent and tokens) is kept for a later offload, and
    /// a host copy of the same block leaves the host: a block is in one
    /// tier at a time.
    fn register(
        &mut self,
        id: u32,
        hash: u64,
        origin: impl FnOnce() -> HostBlock,
        events: &mut EventSink,
    ) -> bool {
        if self.map.contains_key(&hash) {
            return false;
        }
        self.map.insert(hash, id);
        let b = &mut self.blocks[id as usize];
        b.hash = hash;
        b.cached = true;
        if let Some(host) = self.host.as_mut() {
            self.origins[id as usize] = origin();
            if host.take(hash).is_some() {
                events.removed(Tier::Host, hash);
            }
        }
        true
    }
}

/// Collects KV events in order, merging adjacent ones of the same chain.
#[derive(Debug, Default)]
struct EventSink {
    events: Vec<EngineKvEvent>,
}

impl EventSink {
    fn removed(&mut self, tier: Tier, hash: u64) {
        if let Some(EngineKvEvent::Removed {
            tier: t,
            engine_hashes,
        }) = self.events.last_mut()
            && *t == tier
        {
            engine_hashes.push(hash);
        } else {
            self.events.push(EngineKvEvent::Removed {
                tier,
                engine_hashes: vec![hash],
            });
        }
    }

    fn stored(&mut self, tier: Tier, parent: Option<u64>, hash: u64, tokens: &[u32]) {
        if let Some(EngineKvEvent::Stored {
            tier: t,
            parent: p,
            blocks,
        }) = self.events.last_mut()
            && *t == tier
        {
            let last = blocks.last().map(|b| b.0).or(*p);
            if last.is_some() && last == parent {
                blocks.push((hash, tokens.to_vec()));
                return;
            }
        }
        self.events.push(EngineKvEvent::Stored {
            tier,
            parent,
            blocks: vec![(hash, tokens.to_vec())],
        });
    }
}

/// One leading block of a sequence's cached prefix, where it is found.
enum PrefixBlock {
    Device(u32),
    Host(u64),
}

/// What a request's sequence did in the current step.
#[derive(Clone, Copy, Debug, Default)]
struct Work {
    pass: u64,
    tokens: usize,
    prompt_tokens: usize,
    prefix_tokens: usize,
}

#[derive(Debug)]
struct Seq {
    id: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_output: usize,
    generated: usize,
    /// Chain hashes of the full blocks known so far.
    hashes: Vec<u64>,
    /// Blocks held, in sequence order.
    blocks: Vec<u32>,
    /// Leading blocks already finalised (cached or a private duplicate).
    finalized: usize,
    computed: usize,
    work: Work,
}

impl Seq {
    fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Make sure `hashes` covers the first `n` full blocks.
    fn ensure_hashes(&mut self, n: usize, block_size: usize) {
        while self.hashes.len() < n {
            let j = self.hashes.len();
            let parent = j.checked_sub(1).map(|p| self.hashes[p]);
            let h = chain_hash(parent, &self.tokens[j * block_size..(j + 1) * block_size]);
            self.hashes.push(h);
        }
    }
}

/// A request handed to an engine.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub id: u64,
    pub tokens: Vec<u32>,
    /// Engine block hashes of the prompt's full blocks (`block_hashes`).
    pub block_hashes: Vec<u64>,
    pub output_length: usize,
}

enum Outcome {
    Scheduled { tokens: usize },
    Blocked,
    CurrentPreempted,
}

/// Step-local accumulators.
#[derive(Default)]
struct StepAcc {
    budget: usize,
    batch_count: usize,
    total_isl: usize,
    total_prefix: usize,
    preempted_any: bool,
    preemptions: usize,
    scheduled: Vec<usize>,
}

/// The running sequences that emit a token in this step.
#[derive(Default)]
struct DecodeBatch {
    /// Keys of the sequences with their whole context computed.
    ready: Vec<usize>,
    /// Those of them already decoding (not sampling from this step's prefill).
    decode_count: usize,
    /// Context tokens of the decoding ones.
    decode_len: usize,
}

/// One simulated engine.
#[derive(Debug)]
pub struct SimEngine {
    cfg: EngineConfig,
    pool: BlockPool,
    slots: Vec<Option<Seq>>,
    free_slots: Vec<usize>,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    pass: u64,
    events: EventSink,
    /// Blocks loaded from the host tier in the current step.
    loaded_blocks: usize,
}

impl SimEngine {
    pub(crate) fn new(cfg: EngineConfig) -> Self {
        let pool = BlockPool::new(cfg.num_blocks, cfg.host_blocks);
        SimEngine {
            cfg,
            pool,
            slots: Vec::new(),
            free_slots: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pass: 0,
            events: EventSink::default(),
            loaded_blocks: 0,
        }
    }

    /// Queue a request (it is considered at the next step).
    pub(crate) fn enqueue(&mut self, req: EngineRequest) {
        let seq = Seq {
            id: req.id,
            prompt_len: req.tokens.len(),
            tokens: req.tokens,
            max_output: req.output_length.max(1),
            generated: 0,
            hashes: req.block_hashes,
            blocks: Vec::new(),
            finalized: 0,
            computed: 0,
            work: Work::default(),
        };
        let key = match self.free_slots.pop() {
            Some(k) => {
                self.slots[k] = Some(seq);
                k
            }
            None => {
                self.slots.push(Some(seq));
                self.slots.len() - 1
            }
        };
        self.waiting.push_back(key);
    }

    /// Drops request `id` wherever it is (its client went away), its
    /// blocks released as a finished request's are. Whether it was there.
    pub(crate) fn abort(&mut self, id: u64) -> bool {
        let is =
            |slots: &[Option<Seq>], key: usize| slots[key].as_ref().is_some_and(|s| s.id == id);
        if let Some(pos) = self.waiting.iter().position(|&k| is(&self.slots, k)) {
            if let Some(key) = self.waiting.remove(pos) {
                self.release_blocks(key);
                self.free_slot(key);
            }
            return true;
        }
        if let Some(pos) = self.running.iter().position(|&k| is(&self.slots, k)) {
            let key = self.running.remove(pos);
            self.release_blocks(key);
            self.free_slot(key);
            return true;
        }
        false
    }

    pub(crate) fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub(crate) fn load(&self) -> EngineLoad {
        let queued = |k: &usize| {
            self.slots[*k]
                .as_ref()
                .map_or(0, |s| s.prompt_len.saturating_sub(s.computed))
        };
        EngineLoad {
            running: self.running.len(),
            waiting: self.waiting.len(),
            active_blocks: self.pool.num_active(),
            total_blocks: self.cfg.num_blocks,
            cached_blocks: self.pool.map.len(),
            prefill_tokens_queued: self.waiting.iter().map(queued).sum::<usize>()
                + self.running.iter().map(queued).sum::<usize>(),
            host_blocks: self.cfg.host_blocks,
        }
    }

    #[cfg(test)]
    /// Whether the engine's cache holds `hash` (test and oracle helper).
    pub(crate) fn is_cached(&self, hash: u64) -> bool {
        self.pool.map.contains_key(&hash)
    }

    #[cfg(test)]
    /// Whether the engine's host tier holds `hash` (test helper).
    pub(crate) fn is_in_host(&self, hash: u64) -> bool {
        self.pool.in_host(hash)
    }

    fn seq(&self, key: usize) -> &Seq {
        match &self.slots[key] {
            Some(s) => s,
            None => unreachable_seq(key),
        }
    }

    fn seq_mut(&mut self, key: usize) -> &mut Seq {
        match &mut self.slots[key] {
            Some(s) => s,
            None => unreachable_seq(key),
        }
    }

    /// (cached full blocks usable, in either tier, of which held by running
    /// sequences).
    fn prefix_hits(&self, key: usize) -> (usize, usize) {
        if !self.cfg.enable_prefix_caching {
            return (0, 0);
        }
        let seq = self.seq(key);
        let bs = self.cfg.block_size;
        let cap = seq.len().saturating_sub(1) / bs;
        let mut hits = 0;
        let mut active = 0;
        for &h in seq.hashes.iter().take(cap) {
            match self.pool.map.get(&h) {
                Some(&id) => {
                    hits += 1;
                    if self.pool.blocks[id as usize].refs > 0 {
                        active += 1;
                    }
                }
                None if self.pool.in_host(h) => hits += 1,
                None => break,
            }
        }
        (hits, active)
    }

    /// Release every block of a sequence, tail first.
    fn release_blocks(&mut self, key: usize) {
        let blocks = std::mem::take(&mut self.seq_mut(key).blocks);
        for &id in blocks.iter().rev() {
            self.pool.release(id);
        }
        let seq = self.seq_mut(key);
        seq.finalized = 0;
        seq.computed = 0;
    }

    fn free_slot(&mut self, key: usize) {
        self.slots[key] = None;
        self.free_slots.push(key);
    }

    /// Preempt the newest running sequence. Returns its key.
    fn preempt_newest(&mut self, acc: &mut StepAcc) -> Option<usize> {
        let victim = self.running.pop()?;
        self.release_blocks(victim);
        let pass = self.pass;
        let work = self.seq(victim).work;
        if work.pass == pass {
            acc.budget += work.tokens;
            if work.prompt_tokens > 0 {
                acc.batch_count -= 1;
                acc.total_isl -= work.prefix_tokens + work.prompt_tokens;
                acc.total_prefix -= work.prefix_tokens;
            }
            acc.scheduled.retain(|&k| k != victim);
            self.seq_mut(victim).work = Work::default();
        }
        self.waiting.push_front(victim);
        acc.preempted_any = true;
        acc.preemptions += 1;
        Some(victim)
    }

    /// Try to hold blocks for the first `target` tokens, acquiring the first
    /// `cached` cached blocks if the sequence holds none yet (loading those
    /// in the host tier into fresh device blocks). All or nothing.
    fn allocate(&mut self, key: usize, target: usize, cached: usize) -> bool {
        let bs = self.cfg.block_size;
        let need = target.div_ceil(bs);
        let seq = self.seq(key);
        let held = seq.blocks.len();
        let take_cached = if held == 0 { cached } else { 0 };
        let mut idle_cached = 0;
        let mut loads = 0;
        let mut prefix = Vec::with_capacity(take_cached);
        for &h in &seq.hashes[..take_cached] {
            match self.pool.map.get(&h) {
                Some(&id) => {
                    if self.pool.blocks[id as usize].refs == 0 {
                        idle_cached += 1;
                    }
                    prefix.push(PrefixBlock::Device(id));
                }
                None if self.pool.in_host(h) => {
                    loads += 1;
                    prefix.push(PrefixBlock::Host(h));
                }
                None => return false,
            }
        }
        let fresh = need.saturating_sub(held + take_cached);
        if fresh + loads > self.pool.free.len() + self.pool.lru_len - idle_cached {
            return false;
        }
        let mut new_ids = Vec::with_capacity(need.saturating_sub(held));
        // Device hits first: acquiring takes them off the LRU, so loading
        // the host ones cannot evict them.
        for block in &prefix {
            if let PrefixBlock::Device(id) = *block {
                self.pool.acquire(id);
            }
        }
        let mut parent = None;
        for block in prefix {
            let id = match block {
                PrefixBlock::Device(id) => {
                    parent = Some(self.pool.blocks[id as usize].hash);
                    id
                }
                // A later host block of the prefix cannot be pushed out
                // meanwhile: each load frees its host slot before its
                // allocation offloads at most one device block into it.
                PrefixBlock::Host(hash) => match self.load_from_host(hash, parent) {
                    Some(id) => {
                        parent = Some(hash);
                        id
                    }
                    None => return false, // unreachable: capacity checked above
                },
            };
            new_ids.push(id);
        }
        self.loaded_blocks += loads;
        for _ in 0..fresh {
            match self.pool.alloc(&mut self.events) {
                Some(id) => new_ids.push(id),
                None => return false, // unreachable: capacity checked above
            }
        }
        let seq = self.seq_mut(key);
        seq.blocks.extend(new_ids);
        if held == 0 {
            seq.finalized = take_cached;
        }
        true
    }

    /// Loads host block `hash` into a fresh device block, cached there; its
    /// device store names `parent` (the prefix block before it, just
    /// acquired or loaded). The caller checked there is room. The block
    /// leaves the host, and its removal is published, before the
    /// allocation: its eviction may move a device block into the host, and
    /// the events must never show the host over its capacity (a router
    /// bounding the tier by it would drop a block the engine still holds).
    fn load_from_host(&mut self, hash: u64, parent: Option<u64>) -> Option<u32> {
        let block = self.pool.host.as_mut().and_then(|h| h.take(hash))?;
        self.events.removed(Tier::Host, hash);
        let id = self.pool.alloc(&mut self.events)?;
        self.events
            .stored(Tier::Device, parent, hash, &block.tokens);
        self.pool.register(id, hash, || block, &mut self.events);
        Some(id)
    }

    /// Cache the sequence's blocks completed by its computed tokens.
    fn finalize(&mut self, key: usize) {
        let bs = self.cfg.block_size;
        let caching = self.cfg.enable_prefix_caching;
        let Some(seq) = self.slots[key].as_mut() else {
            return;
        };
        let full = seq.computed / bs;
        if full <= seq.finalized {
            return;
        }
        seq.ensure_hashes(full, bs);
        for j in seq.finalized..full {
            let hash = seq.hashes[j];
            let parent = j.checked_sub(1).map(|p| seq.hashes[p]);
            let tokens = &seq.tokens[j * bs..(j + 1) * bs];
            let origin = || HostBlock {
                parent,
                tokens: tokens.to_vec(),
            };
            if caching
                && self
                    .pool
                    .register(seq.blocks[j], hash, origin, &mut self.events)
            {
                self.events.stored(Tier::Device, parent, hash, tokens);
            }
        }
        seq.finalized = full;
    }

    /// Schedule the next chunk of one sequence (vLLM-style).
    fn schedule(
        &mut self,
        key: usize,
        from_waiting: bool,
        cached_tokens: usize,
        acc: &mut StepAcc,
    ) -> Outcome {
        let bs = self.cfg.block_size;
        let seq = self.seq(key);
        let cached_tokens = if seq.computed == 0 { cached_tokens } else { 0 };
        let before = seq.computed + cached_tokens;
        let prompt_len = seq.prompt_len;
        let prompt_before = before.min(prompt_len);
        let remaining = seq.len().saturating_sub(before);
        let prompt_remaining = prompt_len.saturating_sub(prompt_before);
        if prompt_remaining > 0 && !self.cfg.enable_chunked_prefill && prompt_remaining > acc.budget
        {
            return Outcome::Blocked;
        }
        let desired = remaining.min(acc.budget);
        if desired == 0 && remaining > 0 {
            return Outcome::Blocked;
        }
        let target = before + desired;
        let mut after = target;
        loop {
            if self.allocate(key, target, cached_tokens / bs) {
                break;
            }
            match self.preempt_newest(acc) {
                None => {
                    after = before;
                    break;
                }
                Some(v) if v == key => return Outcome::CurrentPreempted,
                Some(_) => {}
            }
        }
        let used = after - before;
        if used == 0 && after < self.seq(key).len() {
            return Outcome::Blocked;
        }
        self.seq_mut(key).computed = after;
        self.finalize(key);
        let prompt_tokens = after.min(prompt_len) - prompt_before;
        let pass = self.pass;
        self.seq_mut(key).work = Work {
            pass,
            tokens: used,
            prompt_tokens,
            prefix_tokens: prompt_before,
        };
        acc.scheduled.push(key);
        if prompt_tokens > 0 {
            acc.batch_count += 1;
            acc.total_isl += prompt_before + prompt_tokens;
            acc.total_prefix += prompt_before;
        }
        if from_waiting {
            if let Some(pos) = self.waiting.iter().position(|&k| k == key) {
                self.waiting.remove(pos);
            }
            self.running.push(key);
        }
        acc.budget = acc.budget.saturating_sub(used);
        Outcome::Scheduled { tokens: used }
    }

    /// Run one step. The caller owns the clock: the step starts when called
    /// and its effects become visible `duration_ms` later.
    pub(crate) fn step(&mut self) -> PassOutcome {
        self.pass += 1;
        self.loaded_blocks = 0;
        let mut out = PassOutcome::default();
        let mut acc = StepAcc {
            budget: self.cfg.max_num_batched_tokens,
            ..StepAcc::default()
        };
        self.schedule_running(&mut acc);
        self.admit_waiting(&mut acc, &mut out);
        let batch = self.decode_batch();
        out.duration_ms = self.step_ms(&acc, &batch);
        out.prefill_tokens = acc.total_isl - acc.total_prefix;
        out.preemptions = acc.preemptions;
        out.loaded_blocks = self.loaded_blocks;
        self.emit_tokens(batch.ready, &mut out);
        out.did_work =
            !acc.scheduled.is_empty() || !out.emitted.is_empty() || !out.rejected.is_empty();
        out.kv_events = std::mem::take(&mut self.events.events);
        out
    }

    /// Step phase 1: running sequences, oldest first, each take their next
    /// chunk while the budget lasts.
    fn schedule_running(&mut self, acc: &mut StepAcc) {
        let mut i = 0;
        while i < self.running.len() && acc.budget > 0 {
            let key = self.running[i];
            match self.schedule(key, false, 0, acc) {
                Outcome::Scheduled { .. } => i += 1,
                Outcome::Blocked => break,
                Outcome::CurrentPreempted => {}
            }
        }
    }

    /// Step phase 2: waiting sequences, FIFO, while fewer than `max_num_seqs`
    /// run and nothing was preempted in this step. A sequence that can never
    /// run here is rejected; one whose blocks do not fit stops admission.
    fn admit_waiting(&mut self, acc: &mut StepAcc, out: &mut PassOutcome) {
        let bs = self.cfg.block_size;
        while !acc.preempted_any && self.running.len() < self.cfg.max_num_seqs {
            let Some(&key) = self.waiting.front() else {
                break;
            };
            let seq = self.seq(key);
            let id = seq.id;
            let total_blocks = seq.len().div_ceil(bs);
            let never_fits = total_blocks > self.cfg.num_blocks
                || (!self.cfg.enable_chunked_prefill
                    && seq.len() > self.cfg.max_num_batched_tokens);
            if never_fits {
                self.waiting.pop_front();
                out.rejected.push(id);
                self.free_slot(key);
                continue;
            }
            let (hits, active_hits) = self.prefix_hits(key);
            let needed = total_blocks - active_hits;
            let available = self.cfg.num_blocks - self.pool.num_active();
            if needed > available {
                break;
            }
            let cached_tokens = hits * bs;
            let loaded_before = self.loaded_blocks;
            match self.schedule(key, true, cached_tokens, acc) {
                Outcome::Scheduled { tokens } => {
                    out.admissions.push((id, cached_tokens));
                    let loaded = self.loaded_blocks - loaded_before;
                    if loaded > 0 {
                        out.host_loads.push((id, loaded * bs));
                    }
                    if tokens == 0 && acc.budget == 0 {
                        break;
                    }
                }
                Outcome::Blocked | Outcome::CurrentPreempted => break,
            }
        }
    }

    /// Step phase 3: the running sequences whose context is all computed
    /// (each emits a token at the end of the step), and the decode load
    /// among them. A sequence whose prefill finished in this step samples
    /// its first token from that prefill, so it adds no decode work.
    fn decode_batch(&self) -> DecodeBatch {
        let mut batch = DecodeBatch::default();
        for &key in &self.running {
            let seq = self.seq(key);
            if seq.computed < seq.len() {
                continue;
            }
            batch.ready.push(key);
            let first_from_prefill =
                seq.generated == 0 && seq.work.pass == self.pass && seq.work.prompt_tokens > 0;
            if !first_from_prefill {
                batch.decode_count += 1;
                batch.decode_len += seq.len();
            }
        }
        batch
    }

    /// The step's duration: prefill time of its new prompt tokens plus decode
    /// time at the decoding sequences' KV utilisation.
    fn step_ms(&self, acc: &StepAcc, batch: &DecodeBatch) -> f64 {
        // Like the mocker: batch size times the (integer) mean new tokens per
        // prefilling sequence, which is the step's new prompt tokens up to
        // rounding.
        let prefill_ms = match (
            acc.total_isl.checked_div(acc.batch_count),
            acc.total_prefix.checked_div(acc.batch_count),
        ) {
            (Some(mean_isl), Some(mean_prefix)) => self
                .cfg
                .prefill_ms(acc.batch_count * mean_isl.saturating_sub(mean_prefix)),
            _ => 0.0,
        };
        let decode_ms = if batch.decode_count > 0 {
            let capacity = (self.cfg.num_blocks * self.cfg.block_size) as f64;
            self.cfg.decode_ms(batch.decode_len as f64 / capacity)
        } else {
            0.0
        };
        // Host loads are not overlapped with compute: the step waits.
        let load_ms = self.loaded_blocks as f64 * self.cfg.host_load_ms_per_block;
        prefill_ms + decode_ms + load_ms
    }

    /// Step phase 4: every ready sequence emits one output token; finished
    /// ones release their blocks and leave the running set.
    fn emit_tokens(&mut self, ready: Vec<usize>, out: &mut PassOutcome) {
        let mut finished = Vec::new();
        for key in ready {
            let seq = self.seq_mut(key);
            let pos = seq.generated;
            seq.tokens.push(output_token(seq.id, pos));
            seq.generated += 1;
            let done = seq.generated >= seq.max_output;
            out.emitted.push(TokenEmit {
                request_id: seq.id,
                first: seq.generated == 1,
                done,
            });
            if done {
                finished.push(key);
            }
        }
        if !finished.is_empty() {
            for &key in &finished {
                self.release_blocks(key);
                self.free_slot(key);
            }
            self.running.retain(|k| !finished.contains(k));
        }
    }
}

#[cold]
fn unreachable_seq(key: usize) -> ! {
    // Keys in `waiting`/`running` always name live slots; reaching this is a
    // simulator bug, not an input error.
    panic!("simulated engine lost sequence slot {key}")
}

#[cfg(test)]
mod tests;
