//! The worker registry: who is registered under which model, with which dp
//! ranks, capacity, taints, lease and reported load, and who is cordoned.
//!
//! Plain synchronous code; time is passed in, so leases are testable without
//! a clock. The registry also fixes each model's block size: the first worker
//! of a model sets it, and a worker declaring another size is refused while
//! the model has workers. Each registration gets a fresh `generation`, so
//! work queued for an earlier registration of the same id can be recognised
//! and dropped.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::{Duration, Instant},
};

use crate::types::Tier;
use crate::types::{
    DpRank, KvEventsMode, RankLoad, TierSpec, WorkerId, WorkerRole, WorkerSnapshot,
};

mod limits;

pub use limits::{INDEX_BYTES_PER_BLOCK, RegistryLimits};

/// Largest number of dp ranks one worker may declare, whatever
/// `RegistryLimits::max_ranks_per_worker` says.
pub const MAX_DP_SIZE: u32 = 1024;
/// Largest number of taints one worker may declare.
pub const MAX_TAINTS: usize = 64;
/// Largest number of LoRA adapters one worker may declare.
pub const MAX_ADAPTERS: usize = 256;
/// Longest model name, endpoint or taint, in bytes.
pub const MAX_NAME_BYTES: usize = 1024;
/// Largest block size a worker may declare, in tokens: far above any
/// engine's (16 to 512), and small enough that one block's token ids fit
/// a message many times over.
pub const MAX_BLOCK_SIZE: u32 = 65_536;
/// Longest lease a worker may ask for: a worker that dies is forgotten
/// within this, whatever it declared.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(3600);

/// A LoRA adapter a worker serves: its name, which requests and vLLM's
/// events give, and the engine's id for it, which is all SGLang's events
/// give.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Adapter {
    pub id: i64,
    pub name: String,
}

/// What a worker declares when it registers.
#[derive(Clone, Debug, PartialEq)]
pub struct Registration {
    pub worker_id: WorkerId,
    pub model: String,
    pub role: WorkerRole,
    pub endpoint: String,
    pub block_size: u32,
    pub dp_start_rank: DpRank,
    pub dp_size: u32,
    pub total_kv_blocks: u64,
    pub max_num_batched_tokens: u64,
    pub taints: Vec<String>,
    /// The LoRA adapters it serves. Empty: not declared, so a request for
    /// any adapter may go there (as before adapters were declared).
    pub adapters: Vec<Adapter>,
    /// It loads adapters it does not serve on request (see
    /// `WorkerSnapshot::loads_adapters`).
    pub loads_adapters: bool,
    /// Lease asked for; `None` takes the server's default.
    pub lease_ttl: Option<Duration>,
    /// Whether it publishes KV events (see `KvEventsMode`).
    pub kv_events: KvEventsMode,
    /// Its cache tiers below the device (at most one entry per tier).
    pub tiers: Vec<TierSpec>,
}

/// A registered worker as a snapshot keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedWorker {
    pub registration: Registration,
    pub lease_ttl: Duration,
    pub lease_remaining: Duration,
    pub cordoned: bool,
    pub load: BTreeMap<DpRank, RankLoad>,
    /// The registration's generation; 0: unknown (a fresh one is given).
    pub generation: u64,
}

/// One registered worker.
#[derive(Clone, Debug)]
pub struct WorkerRecord {
    pub registration: Registration,
    pub generation: u64,
    pub cordoned: bool,
    pub lease_ttl: Duration,
    pub lease_deadline: Instant,
    pub load: BTreeMap<DpRank, RankLoad>,
}

impl WorkerRecord {
    /// The read-only view selection works from.
    pub fn snapshot(&self) -> WorkerSnapshot {
        let r = &self.registration;
        WorkerSnapshot {
            worker_id: r.worker_id,
            model: r.model.clone(),
            endpoint: r.endpoint.clone(),
            role: r.role,
            block_size: r.block_size,
            dp_start_rank: r.dp_start_rank,
            dp_size: r.dp_size,
            total_kv_blocks: r.total_kv_blocks,
            max_num_batched_tokens: r.max_num_batched_tokens,
            taints: r.taints.clone(),
            adapters: r.adapters.iter().map(|a| a.name.clone()).collect(),
            loads_adapters: r.loads_adapters,
            cordoned: self.cordoned,
            kv_events: r.kv_events,
            tiers: r.tiers.clone(),
            load: self
                .load
                .iter()
                .map(|(rank, load)| (*rank, *load))
                .collect(),
        }
    }

    pub fn has_rank(&self, dp_rank: DpRank) -> bool {
        let r = &self.registration;
        dp_rank >= r.dp_start_rank && dp_rank - r.dp_start_rank < r.dp_size
    }

    pub fn lease_remaining(&self, now: Instant) -> Duration {
        self.lease_deadline.saturating_duration_since(now)
    }

    /// The record as a snapshot keeps it.
    pub fn saved(&self, now: Instant) -> SavedWorker {
        SavedWorker {
            registration: self.registration.clone(),
            lease_ttl: self.lease_ttl,
            lease_remaining: self.lease_remaining(now),
            cordoned: self.cordoned,
            load: self.load.clone(),
            generation: self.generation,
        }
    }
}

/// The registration one (worker, dp_rank)'s events are checked and applied
/// against: a copy, so a batch is validated (and its tokens hashed) with no
/// lock held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventTarget {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    /// The registration the events are valid for (see `WorkerRecord`).
    pub generation: u64,
    pub model: String,
    pub block_size: u32,
}

/// Registry failures, each naming the worker concerned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RegistryError {
    #[error("worker {worker_id}: {message}")]
    Invalid {
        worker_id: WorkerId,
        message: String,
    },
    #[error(
        "worker {worker_id} declares block_size {declared} but model {model:?} uses block_size {model_block_size}"
    )]
    BlockSizeMismatch {
        worker_id: WorkerId,
        model: String,
        declared: u32,
        model_block_size: u32,
    },
    #[error("worker {worker_id} is not registered")]
    UnknownWorker { worker_id: WorkerId },
    #[error("worker {worker_id} has no dp_rank {dp_rank} (ranks {start}..{end})")]
    UnknownRank {
        worker_id: WorkerId,
        dp_rank: DpRank,
        start: DpRank,
        end: u64,
    },
    /// Events for a worker registered APPROXIMATE, which publishes none:
    /// refused, so it never holds both an exact index and predictions.
    #[error(
        "worker {worker_id} is registered with kv_events APPROXIMATE and publishes no events; register it EXACT or AUTO to publish"
    )]
    PublishesNoEvents { worker_id: WorkerId },
    /// A server-side limit (see [`RegistryLimits`]) refuses the
    /// registration; `limit` is the setting's name.
    #[error("worker {worker_id}: {message}; the server's limit {limit} is {max}")]
    LimitReached {
        worker_id: WorkerId,
        limit: &'static str,
        max: u64,
        message: String,
    },
}

/// Whether a registration of a worker already registered keeps its event
/// streams ([`Registry::register`], [`Registry::register_continuing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Streams {
    StartAnew,
    Continue,
}

/// What a registration did.
#[derive(Clone, Debug)]
pub struct RegisterOutcome {
    /// The worker's record as the registration left it.
    pub record: WorkerRecord,
    pub created: bool,
    pub lease_ttl: Duration,
    /// The previous registration, when this one invalidates the worker's
    /// cached blocks and event streams: always for [`Registry::register`],
    /// for [`Registry::register_continuing`] when the layout changed (model,
    /// block size or dp ranks). The caller must drop them.
    pub invalidated: Option<Registration>,
}

/// The registry of workers.
#[derive(Debug, Default)]
pub struct Registry {
    limits: RegistryLimits,
    workers: HashMap<WorkerId, WorkerRecord>,
    next_generation: u64,
    /// Per model, its workers' snapshots sorted by id, rebuilt on every
    /// change to one of them: routing reads them on every request, changes
    /// (registration, heartbeat, cordon, removal) are rare by comparison.
    snapshots: HashMap<String, Arc<[WorkerSnapshot]>>,
}

impl Registry {
    #[cfg(test)]
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A registry whose registrations are held to `limits`.
    pub fn with_limits(limits: RegistryLimits) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }

    /// Makes the next registration's generation `generation` (cluster mode:
    /// a registration's generation is its position in the shared log, the
    /// same on every replica whatever each registered before).
    pub fn set_next_generation(&mut self, generation: u64) {
        self.next_generation = generation.saturating_sub(1);
    }

    /// Registers a worker, or registers it again, renewing its lease. A
    /// registration of a worker already registered starts it anew: its
    /// previous registration comes back as `invalidated` (its blocks and
    /// event streams are to be dropped, as the worker's engine may have
    /// restarted and counts its events from 0 again) under a new
    /// generation; only its cordon is kept.
    pub fn register(
        &mut self,
        registration: Registration,
        default_lease: Duration,
        now: Instant,
    ) -> Result<RegisterOutcome, RegistryError> {
        let mut registration = registration;
        check_declared(&mut registration)?;
        self.check_limits(&registration)?;
        self.register_with(registration, default_lease, now, Streams::StartAnew, |_| {})
    }

    /// [`Self::register`], except that a worker already registered with
    /// the same layout (model, block size, dp ranks) keeps its generation,
    /// blocks and event streams: a configured engine registered again at
    /// start after its state was restored, resuming where it was.
    pub fn register_continuing(
        &mut self,
        registration: Registration,
        default_lease: Duration,
        now: Instant,
    ) -> Result<RegisterOutcome, RegistryError> {
        let mut registration = registration;
        check_declared(&mut registration)?;
        self.check_limits(&registration)?;
        self.register_with(registration, default_lease, now, Streams::Continue, |_| {})
    }

    /// Refuses a registration past a server-side limit (see
    /// [`RegistryLimits`]), naming it. A snapshot's workers are checked
    /// too: a snapshot file is untrusted input (it can be planted or
    /// damaged), so a worker past a limit is refused at restore, and
    /// registers again.
    fn check_limits(&self, r: &Registration) -> Result<(), RegistryError> {
        let limits = &self.limits;
        let worker_id = r.worker_id;
        let reached = |limit: &'static str, max: u64, message: String| {
            Err(RegistryError::LimitReached {
                worker_id,
                limit,
                max,
                message,
            })
        };
        let previous = self.workers.get(&worker_id);
        if previous.is_none() && self.workers.len() >= limits.max_workers {
            return reached(
                "max_workers",
                limits.max_workers as u64,
                format!("{} workers are registered", self.workers.len()),
            );
        }
        let other_models: std::collections::HashSet<&str> = self
            .workers
            .values()
            .filter(|w| w.registration.worker_id != worker_id)
            .map(|w| w.registration.model.as_str())
            .collect();
        if !other_models.contains(r.model.as_str()) && other_models.len() >= limits.max_models {
            return reached(
                "max_models",
                limits.max_models as u64,
                format!(
                    "model {:?} would be one more than the {} registered",
                    r.model,
                    other_models.len()
                ),
            );
        }
        let dp_size = r.dp_size.max(1);
        if dp_size > limits.max_ranks_per_worker {
            return reached(
                "max_ranks_per_worker",
                u64::from(limits.max_ranks_per_worker),
                format!("dp_size {dp_size} is more ranks than one worker may have"),
            );
        }
        if r.total_kv_blocks > limits.max_kv_blocks_per_rank {
            return reached(
                "max_kv_blocks_per_rank",
                limits.max_kv_blocks_per_rank,
                format!(
                    "total_kv_blocks {} is more than one rank may declare",
                    r.total_kv_blocks
                ),
            );
        }
        for spec in &r.tiers {
            if spec.capacity_blocks > limits.max_tier_blocks_per_rank {
                return reached(
                    "max_tier_blocks_per_rank",
                    limits.max_tier_blocks_per_rank,
                    format!(
                        "the {} tier's {} blocks are more than one rank may declare",
                        spec.tier, spec.capacity_blocks
                    ),
                );
            }
        }
        // Every tier a rank declares is a capacity the index holds it to.
        let claim = |r: &Registration| {
            r.tiers
                .iter()
                .map(|t| t.capacity_blocks)
                .fold(limits.rank_capacity(r.total_kv_blocks), u64::saturating_add)
                .saturating_mul(u64::from(r.dp_size.max(1)))
        };
        let others: u64 = self
            .workers
            .values()
            .filter(|w| w.registration.worker_id != worker_id)
            .map(|w| claim(&w.registration))
            .fold(0, u64::saturating_add);
        let wanted = claim(r);
        let budget = limits.budget_blocks();
        if others.saturating_add(wanted) > budget {
            return reached(
                "index_memory_budget",
                limits.index_memory_budget,
                format!(
                    "its {dp_size} rank(s) of {} blocks (all tiers) would take the capacity \
                     registered to {} blocks of the {budget} ({INDEX_BYTES_PER_BLOCK} bytes \
                     each) the index memory budget allows",
                    wanted / u64::from(dp_size),
                    others.saturating_add(wanted),
                ),
            );
        }
        Ok(())
    }

    /// [`Self::register`], letting `adjust` set what a snapshot restores
    /// (cordon, load, lease deadline) on the record before it is stored.
    fn register_with(
        &mut self,
        registration: Registration,
        default_lease: Duration,
        now: Instant,
        streams: Streams,
        adjust: impl FnOnce(&mut WorkerRecord),
    ) -> Result<RegisterOutcome, RegistryError> {
        let worker_id = registration.worker_id;
        if let Some(model_block_size) =
            self.model_block_size_excluding(&registration.model, worker_id)
            && model_block_size != registration.block_size
        {
            return Err(RegistryError::BlockSizeMismatch {
                worker_id,
                model: registration.model.clone(),
                declared: registration.block_size,
                model_block_size,
            });
        }
        let lease_ttl = registration.lease_ttl.unwrap_or(default_lease);
        self.next_generation += 1;
        let generation = self.next_generation;
        let previous = self.workers.get(&worker_id);
        let invalidated = previous.and_then(|old| {
            let o = &old.registration;
            let changed = o.model != registration.model
                || o.block_size != registration.block_size
                || o.dp_start_rank != registration.dp_start_rank
                || o.dp_size != registration.dp_size;
            (changed || streams == Streams::StartAnew).then(|| o.clone())
        });
        let created = previous.is_none();
        // One that continues keeps cordon state and load; one that starts
        // anew keeps the cordon (an operator's decision) only.
        let (cordoned, load, generation) = match previous {
            Some(old) if invalidated.is_none() => (old.cordoned, old.load.clone(), old.generation),
            Some(old) => (old.cordoned, BTreeMap::new(), generation),
            None => (false, BTreeMap::new(), generation),
        };
        let mut record = WorkerRecord {
            registration,
            generation,
            cordoned,
            lease_ttl,
            lease_deadline: now + lease_ttl,
            load,
        };
        adjust(&mut record);
        self.workers.insert(worker_id, record.clone());
        if let Some(old) = &invalidated {
            self.refresh_snapshots(&old.model.clone());
        }
        self.refresh_snapshots(&record.registration.model);
        Ok(RegisterOutcome {
            record,
            created,
            lease_ttl,
            invalidated,
        })
    }

    /// Registers a worker saved by a snapshot: its registration (checked
    /// as any is), cordon, load, and the lease time it had left, so a worker
    /// that died while kvroute was down still lapses.
    pub fn restore(
        &mut self,
        saved: SavedWorker,
        now: Instant,
    ) -> Result<RegisterOutcome, RegistryError> {
        let mut registration = saved.registration;
        registration.lease_ttl = Some(saved.lease_ttl);
        check_declared(&mut registration)?;
        self.check_limits(&registration)?;
        let (cordoned, load, generation) = (saved.cordoned, saved.load, saved.generation);
        let deadline = now + saved.lease_remaining.min(saved.lease_ttl);
        // Later registrations' generations stay above every restored one.
        self.next_generation = self.next_generation.max(generation);
        self.register_with(
            registration,
            saved.lease_ttl,
            now,
            Streams::Continue,
            |record| {
                record.cordoned = cordoned;
                record.lease_deadline = deadline;
                // The generation the registration had: in cluster mode the
                // other replicas' lease entries name it, and an entry of
                // another generation is not applied.
                if generation != 0 {
                    record.generation = generation;
                }
                record.load = load
                    .into_iter()
                    .filter(|(rank, _)| record.has_rank(*rank))
                    .collect();
            },
        )
    }

    /// Renews a lease and records load; ranks outside the worker are refused.
    pub fn heartbeat(
        &mut self,
        worker_id: WorkerId,
        loads: &[(DpRank, RankLoad)],
        now: Instant,
    ) -> Result<Duration, RegistryError> {
        self.renew(worker_id, loads, None, now)
    }

    /// A heartbeat taken elsewhere (another replica): the lease ends when
    /// that one's does, `remaining` from `now` (at most the TTL), not a
    /// whole TTL from now.
    pub fn renew_until(
        &mut self,
        worker_id: WorkerId,
        loads: &[(DpRank, RankLoad)],
        remaining: Duration,
        now: Instant,
    ) -> Result<Duration, RegistryError> {
        self.renew(worker_id, loads, Some(remaining), now)
    }

    fn renew(
        &mut self,
        worker_id: WorkerId,
        loads: &[(DpRank, RankLoad)],
        remaining: Option<Duration>,
        now: Instant,
    ) -> Result<Duration, RegistryError> {
        let record = self
            .workers
            .get_mut(&worker_id)
            .ok_or(RegistryError::UnknownWorker { worker_id })?;
        if loads.len() > record.registration.dp_size as usize {
            return Err(RegistryError::Invalid {
                worker_id,
                message: format!(
                    "load: {} entries for a worker of {} dp rank(s)",
                    loads.len(),
                    record.registration.dp_size
                ),
            });
        }
        if let Some((dp_rank, _)) = loads.iter().find(|(rank, _)| !record.has_rank(*rank)) {
            let r = &record.registration;
            return Err(RegistryError::UnknownRank {
                worker_id,
                dp_rank: *dp_rank,
                start: r.dp_start_rank,
                end: u64::from(r.dp_start_rank) + u64::from(r.dp_size),
            });
        }
        for (rank, load) in loads {
            record.load.insert(*rank, *load);
        }
        record.lease_deadline =
            now + remaining.map_or(record.lease_ttl, |r| r.min(record.lease_ttl));
        let (ttl, model) = (record.lease_ttl, record.registration.model.clone());
        if !loads.is_empty() {
            self.refresh_snapshots(&model);
        }
        Ok(ttl)
    }

    /// Removes a worker, returning its record.
    pub fn deregister(&mut self, worker_id: WorkerId) -> Result<WorkerRecord, RegistryError> {
        let record = self
            .workers
            .remove(&worker_id)
            .ok_or(RegistryError::UnknownWorker { worker_id })?;
        self.refresh_snapshots(&record.registration.model);
        Ok(record)
    }

    /// Workers whose lease lapsed by `now`, by id.
    pub fn lapsed(&self, now: Instant) -> Vec<WorkerId> {
        let mut lapsed: Vec<WorkerId> = self
            .workers
            .values()
            .filter(|w| w.lease_deadline <= now)
            .map(|w| w.registration.worker_id)
            .collect();
        lapsed.sort_unstable();
        lapsed
    }

    /// Removes `worker_id` if its lease lapsed by `now`, returning its record.
    pub fn remove_if_lapsed(&mut self, worker_id: WorkerId, now: Instant) -> Option<WorkerRecord> {
        if self.workers.get(&worker_id)?.lease_deadline > now {
            return None;
        }
        let record = self.workers.remove(&worker_id)?;
        self.refresh_snapshots(&record.registration.model);
        Some(record)
    }

    /// Cordons or uncordons a worker, returning its record.
    pub fn set_cordoned(
        &mut self,
        worker_id: WorkerId,
        cordoned: bool,
    ) -> Result<WorkerRecord, RegistryError> {
        let record = self
            .workers
            .get_mut(&worker_id)
            .ok_or(RegistryError::UnknownWorker { worker_id })?;
        record.cordoned = cordoned;
        let record = record.clone();
        self.refresh_snapshots(&record.registration.model);
        Ok(record)
    }

    pub fn get(&self, worker_id: WorkerId) -> Option<&WorkerRecord> {
        self.workers.get(&worker_id)
    }

    /// What events for `(worker_id, dp_rank)` are checked and applied
    /// against; an error if that rank is not registered.
    pub fn event_target(
        &self,
        worker_id: WorkerId,
        dp_rank: DpRank,
    ) -> Result<EventTarget, RegistryError> {
        let record = self
            .workers
            .get(&worker_id)
            .ok_or(RegistryError::UnknownWorker { worker_id })?;
        let r = &record.registration;
        if !record.has_rank(dp_rank) {
            return Err(RegistryError::UnknownRank {
                worker_id,
                dp_rank,
                start: r.dp_start_rank,
                end: u64::from(r.dp_start_rank) + u64::from(r.dp_size),
            });
        }
        if r.kv_events == KvEventsMode::Approximate {
            return Err(RegistryError::PublishesNoEvents { worker_id });
        }
        Ok(EventTarget {
            worker_id,
            dp_rank,
            generation: record.generation,
            model: r.model.clone(),
            block_size: r.block_size,
        })
    }

    /// Every worker, by id.
    pub fn all(&self) -> Vec<&WorkerRecord> {
        let mut all: Vec<&WorkerRecord> = self.workers.values().collect();
        all.sort_by_key(|w| w.registration.worker_id);
        all
    }

    /// Snapshots of a model's workers, by id (shared, cheap to take).
    pub fn model_snapshots(&self, model: &str) -> Arc<[WorkerSnapshot]> {
        self.snapshots
            .get(model)
            .cloned()
            .unwrap_or_else(|| Arc::from(Vec::new()))
    }

    fn refresh_snapshots(&mut self, model: &str) {
        let mut snapshots: Vec<WorkerSnapshot> = self
            .workers
            .values()
            .filter(|w| w.registration.model == model)
            .map(WorkerRecord::snapshot)
            .collect();
        if snapshots.is_empty() {
            self.snapshots.remove(model);
            return;
        }
        snapshots.sort_by_key(|w| w.worker_id);
        self.snapshots.insert(model.to_string(), snapshots.into());
    }

    /// The block size of a model, if it has a worker.
    pub fn model_block_size(&self, model: &str) -> Option<u32> {
        self.workers
            .values()
            .find(|w| w.registration.model == model)
            .map(|w| w.registration.block_size)
    }

    fn model_block_size_excluding(&self, model: &str, worker_id: WorkerId) -> Option<u32> {
        self.workers
            .values()
            .find(|w| w.registration.model == model && w.registration.worker_id != worker_id)
            .map(|w| w.registration.block_size)
    }

    /// Counts of workers: (active, cordoned).
    pub fn counts(&self) -> (usize, usize) {
        let cordoned = self.workers.values().filter(|w| w.cordoned).count();
        (self.workers.len() - cordoned, cordoned)
    }
}

#[cfg(test)]
mod tests;

/// A worker's declared tiers: each below the device, at most once, with a
/// saving in `[0, 1]` if it gives one.
fn check_tiers(tiers: &[TierSpec]) -> Result<(), String> {
    let mut seen = [false; crate::types::TIERS];
    for spec in tiers {
        if spec.tier == Tier::Device {
            return Err("the device tier's capacity is total_kv_blocks, not a cache tier".into());
        }
        if std::mem::replace(&mut seen[spec.tier.index()], true) {
            return Err(format!("the {} tier is declared twice", spec.tier));
        }
        if let Some(saving) = spec.prefill_saving
            && !(saving.is_finite() && (0.0..=1.0).contains(&saving))
        {
            return Err(format!(
                "the {} tier's prefill_saving must be in [0, 1], got {saving}",
                spec.tier
            ));
        }
    }
    Ok(())
}

/// The hard limits of what a worker may declare, whatever the server's
/// limits: checked first, so a declaration no server accepts is
/// INVALID_ARGUMENT, never a RESOURCE_EXHAUSTED of some server limit.
/// Makes a `dp_size` of 0 mean 1.
fn check_declared(registration: &mut Registration) -> Result<(), RegistryError> {
    let worker_id = registration.worker_id;
    let invalid = |message: String| RegistryError::Invalid { worker_id, message };
    if registration.block_size == 0 {
        return Err(invalid("block_size must be at least 1".into()));
    }
    if registration.block_size > MAX_BLOCK_SIZE {
        return Err(invalid(format!(
            "block_size {} exceeds the limit of {MAX_BLOCK_SIZE}",
            registration.block_size
        )));
    }
    if let Some(ttl) = registration.lease_ttl
        && ttl > MAX_LEASE_TTL
    {
        return Err(invalid(format!(
            "lease_ttl_secs {} exceeds the limit of {}",
            ttl.as_secs(),
            MAX_LEASE_TTL.as_secs()
        )));
    }
    if registration.dp_size == 0 {
        registration.dp_size = 1;
    }
    if registration.dp_size > MAX_DP_SIZE {
        return Err(invalid(format!(
            "dp_size {} exceeds the limit of {MAX_DP_SIZE}",
            registration.dp_size
        )));
    }
    if u64::from(registration.dp_start_rank) + u64::from(registration.dp_size) > u64::from(u32::MAX)
    {
        return Err(invalid("dp_start_rank + dp_size overflows".into()));
    }
    if registration.taints.len() > MAX_TAINTS {
        return Err(invalid(format!("more than {MAX_TAINTS} taints")));
    }
    if registration.adapters.len() > MAX_ADAPTERS {
        return Err(invalid(format!("more than {MAX_ADAPTERS} adapters")));
    }
    let mut ids = std::collections::HashMap::new();
    for adapter in &registration.adapters {
        if adapter.name.is_empty() {
            return Err(invalid(format!("adapter {} has no name", adapter.id)));
        }
        if let Some(other) = ids.insert(adapter.id, &adapter.name)
            && *other != adapter.name
        {
            return Err(invalid(format!(
                "adapter id {} names both {other:?} and {:?}",
                adapter.id, adapter.name
            )));
        }
    }
    check_tiers(&registration.tiers).map_err(invalid)?;
    let names = [
        ("model", &registration.model),
        ("endpoint", &registration.endpoint),
    ];
    for (field, value) in names
        .into_iter()
        .chain(registration.taints.iter().map(|t| ("taints", t)))
        .chain(registration.adapters.iter().map(|a| ("adapters", &a.name)))
    {
        if value.len() > MAX_NAME_BYTES {
            return Err(invalid(format!(
                "{field}: {} bytes is over the limit of {MAX_NAME_BYTES}",
                value.len()
            )));
        }
    }
    Ok(())
}
