//! Protobuf ↔ domain conversions, with the validation of every field that
//! comes from the network. Handlers call these and nothing else touches pb
//! field semantics.

use std::collections::HashSet;

use crate::{
    engine_events::{EngineSource, dialect_name},
    fleet::{IndexView, WorkerView},
    grpc::status::InvalidInput,
    ingest::{BatchOutcome, IngestEvent, ValidatedBatch},
    pb::{self, cache_tier},
    router::{Admitted, PreparedRequest, now},
};
use kvroute_core::{
    admission::AdmissionMode,
    hashing::{HashOptions, compute_block_hashes, compute_block_hashes_le},
    index::{KvEvent, TIERS, Tier, TieredEvent},
    registry::{Adapter, EventTarget, Registration},
    select::{
        RoutingHints, ScoringOverrides, SelectMode, SelectRequest,
        affinity::{AffinityMode, SessionRef},
    },
    types::{CacheView, KvEventsMode, RankLoad, RequestPhase, WorkerId, WorkerRank, WorkerRole},
};

/// Longest model, endpoint, taint, LoRA or id string accepted.
pub const MAX_NAME_BYTES: usize = kvroute_core::registry::MAX_NAME_BYTES;

/// Most multimodal hashes one block may carry: one per image, audio or
/// video clip whose tokens fall in the block; even a 512-token block holds
/// only a few.
pub const MAX_MM_HASHES_PER_BLOCK: usize = 64;

/// Checks one block's multimodal hashes against
/// [`MAX_MM_HASHES_PER_BLOCK`]; the error names no place (the caller does).
fn mm_hashes_within_limit(info: &pb::BlockMultimodalInfo) -> Result<(), String> {
    if info.mm_hashes.len() > MAX_MM_HASHES_PER_BLOCK {
        return Err(format!(
            "{} multimodal hashes in one block is over the limit of {MAX_MM_HASHES_PER_BLOCK}",
            info.mm_hashes.len()
        ));
    }
    Ok(())
}

/// Checks a string field's length.
pub(crate) fn name(field: &str, value: &str) -> Result<(), InvalidInput> {
    if value.len() > MAX_NAME_BYTES {
        return Err(InvalidInput::new(
            field,
            format!(
                "{} bytes is over the limit of {MAX_NAME_BYTES}",
                value.len()
            ),
        ));
    }
    Ok(())
}

pub(crate) fn role_from_pb(value: i32) -> Result<WorkerRole, InvalidInput> {
    match pb::WorkerRole::try_from(value) {
        Ok(pb::WorkerRole::Aggregated) => Ok(WorkerRole::Aggregated),
        Ok(pb::WorkerRole::Prefill) => Ok(WorkerRole::Prefill),
        Ok(pb::WorkerRole::Decode) => Ok(WorkerRole::Decode),
        Err(_) => Err(InvalidInput::new("role", format!("unknown role {value}"))),
    }
}

pub(crate) fn kv_events_from_pb(value: i32) -> Result<KvEventsMode, InvalidInput> {
    pb::KvEventsMode::to_domain(value)
        .ok_or_else(|| InvalidInput::new("kv_events", format!("unknown KV events mode {value}")))
}

pub(crate) fn cache_view_to_pb(view: CacheView) -> pb::CacheView {
    match view {
        CacheView::Exact => pb::CacheView::Exact,
        CacheView::Predicted(_) => pb::CacheView::Predicted,
        CacheView::Blended(_) => pb::CacheView::Blended,
    }
}

pub(crate) fn role_to_pb(role: WorkerRole) -> pb::WorkerRole {
    match role {
        WorkerRole::Aggregated => pb::WorkerRole::Aggregated,
        WorkerRole::Prefill => pb::WorkerRole::Prefill,
        WorkerRole::Decode => pb::WorkerRole::Decode,
    }
}

/// Converts a RegisterWorker request: the registration, and where the
/// worker's engine publishes its KV events if it named an endpoint.
pub(crate) fn registration_from_pb(
    request: pb::RegisterWorkerRequest,
) -> Result<(Registration, Option<EngineSource>), InvalidInput> {
    let worker_id = request.worker_id;
    let source = EngineSource::from_fields(
        &request.events_endpoint,
        &request.events_dialect,
        &request.replay_endpoint,
    )
    // the message names the field itself
    .map_err(|message| InvalidInput::new(format!("worker {worker_id}"), message))?;
    name("model", &request.model)?;
    name("endpoint", &request.endpoint)?;
    for taint in &request.taints {
        name("taints", taint)?;
    }
    if request.adapters.len() > kvroute_core::registry::MAX_ADAPTERS {
        return Err(InvalidInput::new(
            "adapters",
            format!(
                "worker {worker_id} declares {} adapters, over the limit of {}",
                request.adapters.len(),
                kvroute_core::registry::MAX_ADAPTERS
            ),
        ));
    }
    for adapter in &request.adapters {
        name("adapters.name", &adapter.name)?;
    }
    if request.block_size == 0 {
        return Err(InvalidInput::new(
            "block_size",
            format!("worker {} declares block_size 0", request.worker_id),
        ));
    }
    if request.cache_tiers.len() > TIERS - 1 {
        return Err(InvalidInput::new(
            "cache_tiers",
            format!(
                "worker {worker_id} declares {} cache tiers; there are {} below the device",
                request.cache_tiers.len(),
                TIERS - 1
            ),
        ));
    }
    let tiers = request
        .cache_tiers
        .iter()
        .map(cache_tier::tier_spec)
        .collect::<Result<Vec<_>, String>>()
        .map_err(|message| {
            InvalidInput::new("cache_tiers", format!("worker {worker_id}: {message}"))
        })?;
    let registration = Registration {
        worker_id: request.worker_id,
        model: request.model,
        role: role_from_pb(request.role)?,
        endpoint: request.endpoint,
        block_size: request.block_size,
        dp_start_rank: request.dp_start_rank,
        dp_size: request.dp_size,
        total_kv_blocks: request.total_kv_blocks,
        max_num_batched_tokens: request.max_num_batched_tokens,
        taints: request.taints,
        adapters: request.adapters.into_iter().map(Adapter::from).collect(),
        loads_adapters: request.loads_adapters,
        lease_ttl: (request.lease_ttl_secs > 0)
            .then(|| std::time::Duration::from_secs(u64::from(request.lease_ttl_secs))),
        kv_events: kv_events_from_pb(request.kv_events)?,
        tiers,
    };
    if registration.kv_events == KvEventsMode::Approximate && source.is_some() {
        return Err(InvalidInput::new(
            "kv_events",
            format!(
                "worker {worker_id} is APPROXIMATE (publishes no KV events) but names events_endpoint; register it EXACT or AUTO, or drop the endpoint"
            ),
        ));
    }
    Ok((registration, source))
}

/// The RegisterWorker request that [`registration_from_pb`] reads back as
/// `registration` and `source`: cluster mode appends registrations to the
/// shared log in this form, which every replica reads the same way.
pub(crate) fn registration_to_pb(
    registration: &Registration,
    source: Option<&EngineSource>,
) -> pb::RegisterWorkerRequest {
    let r = registration;
    pb::RegisterWorkerRequest {
        worker_id: r.worker_id,
        model: r.model.clone(),
        role: role_to_pb(r.role).into(),
        endpoint: r.endpoint.clone(),
        block_size: r.block_size,
        dp_start_rank: r.dp_start_rank,
        dp_size: r.dp_size,
        cache_tiers: r.tiers.iter().map(pb::CacheTierSpec::from).collect(),
        total_kv_blocks: r.total_kv_blocks,
        max_num_batched_tokens: r.max_num_batched_tokens,
        taints: r.taints.clone(),
        adapters: r.adapters.iter().map(pb::LoraAdapter::from).collect(),
        loads_adapters: r.loads_adapters,
        lease_ttl_secs: r
            .lease_ttl
            .map_or(0, |ttl| u32::try_from(ttl.as_secs()).unwrap_or(u32::MAX)),
        kv_events: pb::KvEventsMode::from(r.kv_events).into(),
        events_endpoint: source.map_or_else(String::new, |s| s.endpoint.clone()),
        events_dialect: source.map_or_else(String::new, |s| dialect_name(s.dialect).into()),
        replay_endpoint: source
            .and_then(|s| s.replay_endpoint.clone())
            .unwrap_or_default(),
    }
}

pub(crate) fn rank_load_from_pb(load: &pb::RankLoad) -> (u32, RankLoad) {
    (
        load.dp_rank,
        RankLoad {
            running_requests: load.running_requests,
            waiting_requests: load.waiting_requests,
            kv_blocks_used: load.kv_blocks_used,
        },
    )
}

pub(crate) fn rank_load_to_pb(dp_rank: u32, load: RankLoad) -> pb::RankLoad {
    pb::RankLoad {
        dp_rank,
        running_requests: load.running_requests,
        waiting_requests: load.waiting_requests,
        kv_blocks_used: load.kv_blocks_used,
    }
}

/// Limits a batch must respect.
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    pub max_events: usize,
    pub max_blocks_per_event: usize,
}

/// Checks a batch's shape against its (worker, rank)'s registration and
/// computes the local hashes of blocks sent as token ids. Nothing is
/// applied when any event is malformed. Called with no lock held: hashing a
/// large batch must not hold up routing.
pub fn batch_from_pb(
    batch: pb::KvEventBatch,
    target: &EventTarget,
    limits: BatchLimits,
) -> Result<ValidatedBatch, InvalidInput> {
    let (worker_id, dp_rank) = (batch.worker_id, batch.dp_rank);
    if batch.events.len() > limits.max_events {
        return Err(InvalidInput::new(
            "events",
            format!(
                "worker {worker_id} dp_rank {dp_rank}: batch of {} events is over the limit of {}",
                batch.events.len(),
                limits.max_events
            ),
        ));
    }
    let events = batch
        .events
        .into_iter()
        .enumerate()
        .map(|(position, event)| {
            let place = EventPlace {
                position,
                worker_id,
                dp_rank,
                event_id: event.event_id,
            };
            let converted = event_from_pb(event.kind, &place, target, limits)?;
            Ok(IngestEvent {
                event_id: event.event_id,
                event: converted,
            })
        })
        .collect::<Result<Vec<_>, InvalidInput>>()?;
    Ok(ValidatedBatch {
        worker_id,
        generation: target.generation,
        model: target.model.clone(),
        dp_rank,
        events,
    })
}

/// The reply to one `PublishEvents` batch (see `PublishEventsReply`).
pub(crate) fn publish_reply_to_pb(outcome: &BatchOutcome) -> pb::PublishEventsReply {
    pb::PublishEventsReply {
        dp_rank: outcome.dp_rank,
        last_applied_event_id: outcome.last_applied.unwrap_or(0),
        resend_from_event_id: outcome.resend_from,
        skipped: outcome.skipped,
        rejected: outcome.rejected,
        first_rejection: outcome
            .first_rejection
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default(),
        resync_required: outcome.resync_required,
        held_events: outcome.held,
        resync_from_event_id: outcome.resync_floor,
    }
}

/// Where an event sits, for error messages (formatted only on error).
struct EventPlace {
    position: usize,
    worker_id: u64,
    dp_rank: u32,
    event_id: u64,
}

impl EventPlace {
    /// An error on field `f` of this event.
    fn error(&self, f: &str, message: impl std::fmt::Display) -> InvalidInput {
        InvalidInput::new(
            format!("events[{}].{f}", self.position),
            format!(
                "worker {} dp_rank {} event_id {}: {message}",
                self.worker_id, self.dp_rank, self.event_id
            ),
        )
    }
}

/// The tier an event names; an error for a value no version of the API
/// defines.
fn event_tier(raw: i32, place: &EventPlace, field: &str) -> Result<Tier, InvalidInput> {
    cache_tier::tier_of(raw)
        .ok_or_else(|| place.error(field, format_args!("unknown cache tier {raw}")))
}

fn event_from_pb(
    kind: Option<pb::kv_event::Kind>,
    place: &EventPlace,
    target: &EventTarget,
    limits: BatchLimits,
) -> Result<TieredEvent, InvalidInput> {
    let too_many = |field: &str, n: usize| {
        place.error(
            field,
            format_args!(
                "{n} blocks is over the limit of {}",
                limits.max_blocks_per_event
            ),
        )
    };
    // A store or copy names at least one block, and no more than the limit.
    let some_blocks = |field: &str, n: usize, what: &str| {
        if n == 0 {
            return Err(place.error(field, format_args!("{what} event with no blocks")));
        }
        if n > limits.max_blocks_per_event {
            return Err(too_many(field, n));
        }
        Ok(())
    };
    match kind.ok_or_else(|| place.error("kind", "no event kind set"))? {
        pb::kv_event::Kind::Stored(stored) => {
            some_blocks("stored.blocks", stored.blocks.len(), "stored")?;
            let tier = event_tier(stored.tier, place, "stored.tier")?;
            Ok(TieredEvent::new(
                tier,
                stored_from_pb(stored, place, target.block_size)?,
            ))
        }
        pb::kv_event::Kind::Removed(removed) => {
            if removed.engine_hashes.len() > limits.max_blocks_per_event {
                return Err(too_many(
                    "removed.engine_hashes",
                    removed.engine_hashes.len(),
                ));
            }
            Ok(TieredEvent::new(
                event_tier(removed.tier, place, "removed.tier")?,
                KvEvent::Removed {
                    blocks: removed.engine_hashes,
                },
            ))
        }
        pb::kv_event::Kind::Cleared(_) => Ok(TieredEvent::device(KvEvent::Cleared)),
        pb::kv_event::Kind::Copied(copied) => {
            some_blocks("copied.engine_hashes", copied.engine_hashes.len(), "copied")?;
            let tier = event_tier(copied.tier, place, "copied.tier")?;
            if tier == Tier::Device {
                return Err(place.error(
                    "copied.tier",
                    "blocks are copied to a tier below the device; the device's are stored with their content",
                ));
            }
            Ok(TieredEvent::new(
                tier,
                KvEvent::StoredKnown {
                    blocks: copied.engine_hashes,
                },
            ))
        }
    }
}

/// A stored event's blocks, each given by its local hash or hashed from its
/// token ids at the worker's block size.
fn stored_from_pb(
    stored: pb::BlocksStored,
    place: &EventPlace,
    block_size: u32,
) -> Result<KvEvent, InvalidInput> {
    name(
        &format!("events[{}].stored.lora_name", place.position),
        &stored.lora_name,
    )?;
    name(
        &format!("events[{}].stored.cache_namespace", place.position),
        &stored.cache_namespace,
    )?;
    // As SelectWorker hashes a prompt's tokens with its lora_name and
    // cache_namespace, so that the two meet.
    let options = HashOptions {
        lora_name: Some(stored.lora_name.as_str()),
        cache_namespace: Some(stored.cache_namespace.as_str()),
    };
    let mut blocks = Vec::with_capacity(stored.blocks.len());
    for (i, block) in stored.blocks.into_iter().enumerate() {
        let local = match block.content {
            Some(pb::stored_block::Content::LocalHash(hash)) => hash,
            Some(pb::stored_block::Content::TokenIds(tokens)) => {
                if tokens.ids.len() != block_size as usize {
                    return Err(place.error(
                        &format!("stored.blocks[{i}].token_ids"),
                        format_args!(
                            "block has {} tokens, the worker's block_size is {block_size}",
                            tokens.ids.len()
                        ),
                    ));
                }
                if let Some(info) = &block.mm_info {
                    mm_hashes_within_limit(info)
                        .map_err(|m| place.error(&format!("stored.blocks[{i}].mm_info"), m))?;
                }
                let mm = block.mm_info.map(|info| vec![info.mm_hashes]);
                compute_block_hashes(&tokens.ids, block_size, &options, mm.as_deref())
                    .first()
                    .copied()
                    .unwrap_or_default()
            }
            None => {
                return Err(place.error(
                    &format!("stored.blocks[{i}]"),
                    "block has neither token_ids nor local_hash",
                ));
            }
        };
        blocks.push((block.engine_hash, local));
    }
    Ok(KvEvent::Stored {
        parent: stored.parent_engine_hash,
        blocks,
    })
}

/// The wire form of an index event, blocks given by their local hashes: what
/// a worker that hashes its own blocks sends (benchmarks, test workers).
pub fn kv_event_to_pb(event_id: u64, event: &KvEvent) -> pb::KvEvent {
    tiered_event_to_pb(event_id, &TieredEvent::device(event.clone()))
}

/// [`kv_event_to_pb`] of an event in any tier (cluster mode's log carries
/// the engines' events in this form).
pub fn tiered_event_to_pb(event_id: u64, tiered: &TieredEvent) -> pb::KvEvent {
    let tier = pb::CacheTier::from(tiered.tier) as i32;
    let kind = match &tiered.event {
        KvEvent::Stored { parent, blocks } => pb::kv_event::Kind::Stored(pb::BlocksStored {
            parent_engine_hash: *parent,
            blocks: blocks
                .iter()
                .map(|&(engine, local)| pb::StoredBlock {
                    engine_hash: engine,
                    content: Some(pb::stored_block::Content::LocalHash(local)),
                    mm_info: None,
                })
                .collect(),
            lora_name: String::new(),
            cache_namespace: String::new(),
            tier,
        }),
        KvEvent::Removed { blocks } => pb::kv_event::Kind::Removed(pb::BlocksRemoved {
            engine_hashes: blocks.clone(),
            tier,
        }),
        KvEvent::Cleared => pb::kv_event::Kind::Cleared(pb::CacheCleared {}),
        KvEvent::StoredKnown { blocks } => pb::kv_event::Kind::Copied(pb::BlocksCopied {
            engine_hashes: blocks.clone(),
            tier,
        }),
    };
    pb::KvEvent {
        event_id,
        kind: Some(kind),
    }
}

/// The inverse of [`kv_event_to_pb`]: an event whose blocks are all given
/// by local hash (cluster mode's log carries events in this form). `None`
/// for anything else.
pub(crate) fn index_event_from_pb(event: pb::KvEvent) -> Option<TieredEvent> {
    Some(match event.kind? {
        pb::kv_event::Kind::Stored(stored) => {
            let mut blocks = Vec::with_capacity(stored.blocks.len());
            for block in stored.blocks {
                let Some(pb::stored_block::Content::LocalHash(local)) = block.content else {
                    return None;
                };
                blocks.push((block.engine_hash, local));
            }
            let event = KvEvent::Stored {
                parent: stored.parent_engine_hash,
                blocks,
            };
            TieredEvent::new(cache_tier::tier_of(stored.tier)?, event)
        }
        pb::kv_event::Kind::Removed(removed) => TieredEvent::new(
            cache_tier::tier_of(removed.tier)?,
            KvEvent::Removed {
                blocks: removed.engine_hashes,
            },
        ),
        pb::kv_event::Kind::Cleared(_) => TieredEvent::device(KvEvent::Cleared),
        pb::kv_event::Kind::Copied(copied) => TieredEvent::new(
            cache_tier::tier_of(copied.tier)?,
            KvEvent::StoredKnown {
                blocks: copied.engine_hashes,
            },
        ),
    })
}

/// Converts a SelectWorker request. `block_size` is the model's; prompts over
/// `max_blocks` blocks are refused.
pub fn select_request_from_pb(
    request: pb::SelectWorkerRequest,
    block_size: u32,
    max_blocks: usize,
) -> Result<PreparedRequest, InvalidInput> {
    if request.request_id.is_empty() {
        return Err(InvalidInput::new("request_id", "must not be empty"));
    }
    let at = RequestAt::new(&request.request_id);
    at.name("request_id", &request.request_id)?;
    at.name("model", &request.model)?;
    at.name("lora_name", &request.lora_name)?;
    at.name("cache_namespace", &request.cache_namespace)?;
    let (phase, mode, admission) = modes_from_pb(&request, &at)?;
    let prompt = PromptParts {
        content: request.prompt.and_then(|p| p.content),
        block_mm_infos: request.block_mm_infos,
        options: HashOptions {
            lora_name: Some(request.lora_name.as_str()),
            cache_namespace: Some(request.cache_namespace.as_str()),
        },
    };
    let (hashes, prompt_tokens) = prompt_hashes(prompt, block_size, max_blocks, &at)?;
    let hints = hints_from_pb(request.hints.unwrap_or_default(), max_blocks, &at)?;
    let session = session_from_pb(request.session, &at)?;
    if request.excluded_worker_ids.len() > max_blocks {
        return Err(at.error("excluded_worker_ids", "too many entries"));
    }
    let overrides = overrides_from_pb(request.overrides.unwrap_or_default(), &at)?;
    let select_request = SelectRequest {
        request_id: request.request_id,
        model: request.model,
        adapter: (!request.lora_name.is_empty()).then_some(request.lora_name),
        phase,
        prompt_tokens,
        block_size,
        hints,
        session,
        planned_worker: request
            .planned_worker
            .map(|w| WorkerRank::new(w.worker_id, w.dp_rank)),
        excluded_worker_ids: request.excluded_worker_ids.into_iter().collect(),
        mode,
        overrides,
    };
    Ok(PreparedRequest {
        owner: None,
        request: select_request,
        hashes,
        admission,
    })
}

/// A prepared SelectWorker call back in wire form, its prompt as the block
/// hashes it was hashed to (ordered decisions carry it so in the shared
/// log): [`select_request_from_pb`] at the same block size gives it back,
/// but for `prompt_tokens` and the owner, which travel beside it.
pub(crate) fn prepared_to_pb(prepared: &PreparedRequest) -> pb::SelectWorkerRequest {
    let request = &prepared.request;
    let hints = &request.hints;
    let mut allowed: Vec<WorkerId> = hints.allowed_worker_ids.iter().flatten().copied().collect();
    allowed.sort_unstable();
    let mut excluded: Vec<WorkerId> = request.excluded_worker_ids.iter().copied().collect();
    excluded.sort_unstable();
    pb::SelectWorkerRequest {
        request_id: request.request_id.clone(),
        model: request.model.clone(),
        prompt: Some(pb::Prompt {
            content: Some(pb::prompt::Content::BlockHashes(pb::BlockHashes {
                hashes: prepared.hashes.clone(),
            })),
        }),
        block_mm_infos: Vec::new(),
        // The hashes hold the adapter and namespace already; the adapter
        // also decides which workers are eligible.
        lora_name: request.adapter.clone().unwrap_or_default(),
        cache_namespace: String::new(),
        phase: match request.phase {
            RequestPhase::Aggregated => pb::RequestPhase::Aggregated,
            RequestPhase::Prefill => pb::RequestPhase::Prefill,
            RequestPhase::Decode => pb::RequestPhase::Decode,
        }
        .into(),
        hints: Some(pb::RoutingHints {
            backend_instance_id: hints.backend_instance_id,
            prefill_worker_id: hints.prefill_worker_id,
            decode_worker_id: hints.decode_worker_id,
            dp_rank: hints.dp_rank,
            prefill_dp_rank: hints.prefill_dp_rank,
            allowed_worker_ids: allowed,
            tolerated_taints: hints.tolerated_taints.clone(),
            expected_output_tokens: hints.expected_output_tokens,
            priority_jump: hints.priority_jump,
            strict_priority: hints.strict_priority,
            policy_class: hints.policy_class.clone().unwrap_or_default(),
        }),
        session: request.session.as_ref().map(|s| pb::SessionAffinity {
            session_id: s.session_id.clone(),
            mode: match s.mode {
                AffinityMode::Hard => pb::AffinityMode::Hard,
                AffinityMode::Soft => pb::AffinityMode::Soft,
            }
            .into(),
        }),
        planned_worker: request.planned_worker.map(|w| pb::WorkerRank {
            worker_id: w.worker_id,
            dp_rank: w.dp_rank,
        }),
        excluded_worker_ids: excluded,
        mode: match request.mode {
            SelectMode::Reserve => pb::SelectionMode::Reserve,
            SelectMode::QueryOnly => pb::SelectionMode::QueryOnly,
        }
        .into(),
        admission: match prepared.admission {
            AdmissionMode::Wait => pb::AdmissionMode::Wait,
            AdmissionMode::Reject => pb::AdmissionMode::Reject,
            AdmissionMode::Advisory => pb::AdmissionMode::Advisory,
        }
        .into(),
        overrides: Some(pb::ScoringOverrides {
            overlap_weight: request.overrides.overlap_weight,
            temperature: request.overrides.temperature,
        }),
    }
}

/// Names a SelectWorker request in its field errors (by at most its first
/// [`REQUEST_ID_SHOWN`] bytes: an over-long id is itself an error to report).
struct RequestAt(String);

/// How much of a request id an error message repeats.
const REQUEST_ID_SHOWN: usize = 64;

impl RequestAt {
    fn new(request_id: &str) -> Self {
        let mut end = request_id.len().min(REQUEST_ID_SHOWN);
        while !request_id.is_char_boundary(end) {
            end -= 1;
        }
        let shown = request_id.get(..end).unwrap_or_default();
        if end < request_id.len() {
            Self(format!("{shown}..."))
        } else {
            Self(shown.to_owned())
        }
    }

    fn error(&self, field: &str, message: impl std::fmt::Display) -> InvalidInput {
        InvalidInput::new(field, format!("request {:?}: {message}", self.0))
    }

    /// [`name`], naming the request.
    fn name(&self, field: &str, value: &str) -> Result<(), InvalidInput> {
        name(field, value).map_err(|e| self.error(field, e.message))
    }
}

fn modes_from_pb(
    request: &pb::SelectWorkerRequest,
    at: &RequestAt,
) -> Result<(RequestPhase, SelectMode, AdmissionMode), InvalidInput> {
    let phase = match pb::RequestPhase::try_from(request.phase) {
        Ok(pb::RequestPhase::Aggregated) => RequestPhase::Aggregated,
        Ok(pb::RequestPhase::Prefill) => RequestPhase::Prefill,
        Ok(pb::RequestPhase::Decode) => RequestPhase::Decode,
        Err(_) => return Err(at.error("phase", format_args!("unknown phase {}", request.phase))),
    };
    let mode = match pb::SelectionMode::try_from(request.mode) {
        Ok(pb::SelectionMode::Reserve) => SelectMode::Reserve,
        Ok(pb::SelectionMode::QueryOnly) => SelectMode::QueryOnly,
        Err(_) => return Err(at.error("mode", format_args!("unknown mode {}", request.mode))),
    };
    let admission = match pb::AdmissionMode::try_from(request.admission) {
        Ok(pb::AdmissionMode::Wait) => AdmissionMode::Wait,
        Ok(pb::AdmissionMode::Reject) => AdmissionMode::Reject,
        Ok(pb::AdmissionMode::Advisory) => AdmissionMode::Advisory,
        Err(_) => {
            return Err(at.error(
                "admission",
                format_args!("unknown admission {}", request.admission),
            ));
        }
    };
    Ok((phase, mode, admission))
}

/// What a prompt's block hashes are made from.
struct PromptParts<'a> {
    content: Option<pb::prompt::Content>,
    block_mm_infos: Vec<pb::BlockMultimodalInfo>,
    options: HashOptions<'a>,
}

/// The prompt's local block hashes and its token count: token ids are
/// hashed at the model's block size, block hashes are taken as given.
fn prompt_hashes(
    prompt: PromptParts<'_>,
    block_size: u32,
    max_blocks: usize,
    at: &RequestAt,
) -> Result<(Vec<u64>, u64), InvalidInput> {
    if prompt.block_mm_infos.len() > max_blocks {
        return Err(at.error(
            "block_mm_infos",
            format_args!("more than {max_blocks} entries"),
        ));
    }
    for (i, info) in prompt.block_mm_infos.iter().enumerate() {
        mm_hashes_within_limit(info).map_err(|m| at.error(&format!("block_mm_infos[{i}]"), m))?;
    }
    let mm: Vec<Vec<u64>> = prompt
        .block_mm_infos
        .into_iter()
        .map(|info| info.mm_hashes)
        .collect();
    let (hashes, prompt_tokens) = match prompt.content {
        Some(pb::prompt::Content::TokenIds(tokens)) => {
            let max_tokens = max_blocks.saturating_mul(block_size as usize);
            if tokens.ids.len() > max_tokens {
                return Err(at.error(
                    "prompt.token_ids",
                    format_args!(
                        "{} tokens is over the limit of {max_tokens}",
                        tokens.ids.len()
                    ),
                ));
            }
            let mm = (!mm.is_empty()).then_some(mm.as_slice());
            (
                compute_block_hashes(&tokens.ids, block_size, &prompt.options, mm),
                tokens.ids.len() as u64,
            )
        }
        Some(pb::prompt::Content::PackedTokenIds(bytes)) => {
            if bytes.len() % 4 != 0 {
                return Err(at.error(
                    "prompt.packed_token_ids",
                    format_args!(
                        "{} bytes is not a whole number of 4-byte token ids",
                        bytes.len()
                    ),
                ));
            }
            let tokens = bytes.len() / 4;
            let max_tokens = max_blocks.saturating_mul(block_size as usize);
            if tokens > max_tokens {
                return Err(at.error(
                    "prompt.packed_token_ids",
                    format_args!("{tokens} tokens is over the limit of {max_tokens}"),
                ));
            }
            let mm = (!mm.is_empty()).then_some(mm.as_slice());
            (
                compute_block_hashes_le(&bytes, block_size, &prompt.options, mm),
                tokens as u64,
            )
        }
        Some(pb::prompt::Content::BlockHashes(hashes)) => {
            if hashes.hashes.len() > max_blocks {
                return Err(at.error(
                    "prompt.block_hashes",
                    format_args!(
                        "{} blocks is over the limit of {max_blocks}",
                        hashes.hashes.len()
                    ),
                ));
            }
            let tokens = hashes.hashes.len() as u64 * u64::from(block_size);
            (hashes.hashes, tokens)
        }
        None => {
            return Err(at.error(
                "prompt",
                "no prompt: set token_ids, packed_token_ids or block_hashes",
            ));
        }
    };
    if prompt_tokens == 0 {
        return Err(at.error("prompt", "the prompt is empty"));
    }
    Ok((hashes, prompt_tokens))
}

fn hints_from_pb(
    hints: pb::RoutingHints,
    max_blocks: usize,
    at: &RequestAt,
) -> Result<RoutingHints, InvalidInput> {
    if hints.allowed_worker_ids.len() > max_blocks || hints.tolerated_taints.len() > 1024 {
        return Err(at.error("hints", "too many allowed workers or taints"));
    }
    for taint in &hints.tolerated_taints {
        at.name("hints.tolerated_taints", taint)?;
    }
    at.name("hints.policy_class", &hints.policy_class)?;
    if !hints.priority_jump.is_finite() {
        return Err(at.error("hints.priority_jump", "must be a finite number"));
    }
    Ok(RoutingHints {
        backend_instance_id: hints.backend_instance_id,
        prefill_worker_id: hints.prefill_worker_id,
        decode_worker_id: hints.decode_worker_id,
        dp_rank: hints.dp_rank,
        prefill_dp_rank: hints.prefill_dp_rank,
        allowed_worker_ids: (!hints.allowed_worker_ids.is_empty())
            .then(|| hints.allowed_worker_ids.into_iter().collect::<HashSet<_>>()),
        tolerated_taints: hints.tolerated_taints,
        expected_output_tokens: hints.expected_output_tokens,
        priority_jump: hints.priority_jump,
        strict_priority: hints.strict_priority,
        policy_class: (!hints.policy_class.is_empty()).then_some(hints.policy_class),
    })
}

fn session_from_pb(
    session: Option<pb::SessionAffinity>,
    at: &RequestAt,
) -> Result<Option<SessionRef>, InvalidInput> {
    let Some(session) = session.filter(|s| !s.session_id.is_empty()) else {
        return Ok(None);
    };
    at.name("session.session_id", &session.session_id)?;
    let mode = match pb::AffinityMode::try_from(session.mode) {
        Ok(pb::AffinityMode::None) => return Ok(None),
        Ok(pb::AffinityMode::Hard) => AffinityMode::Hard,
        Ok(pb::AffinityMode::Soft) => AffinityMode::Soft,
        Err(_) => {
            return Err(at.error(
                "session.mode",
                format_args!("unknown mode {}", session.mode),
            ));
        }
    };
    Ok(Some(SessionRef {
        session_id: session.session_id,
        mode,
    }))
}

fn overrides_from_pb(
    overrides: pb::ScoringOverrides,
    at: &RequestAt,
) -> Result<ScoringOverrides, InvalidInput> {
    for (field, value) in [
        ("overrides.overlap_weight", overrides.overlap_weight),
        ("overrides.temperature", overrides.temperature),
    ] {
        if let Some(v) = value
            && !(v.is_finite() && v >= 0.0)
        {
            return Err(at.error(field, format_args!("must be a finite number >= 0, got {v}")));
        }
    }
    Ok(ScoringOverrides {
        overlap_weight: overrides.overlap_weight,
        temperature: overrides.temperature,
    })
}

pub(crate) fn booked_load_to_pb(load: kvroute_core::types::BookedLoad) -> pb::BookedLoad {
    pb::BookedLoad {
        prefill_tokens: load.prefill_tokens,
        prefill_blocks: load.prefill_blocks,
        decode_blocks: load.decode_blocks,
        active_requests: u32::try_from(load.active_requests).unwrap_or(u32::MAX),
    }
}

/// The response fields of a selection.
pub(crate) fn selection_to_pb(
    selection: &kvroute_core::select::Selection,
    admitted: Admitted,
    advisory: bool,
) -> pb::SelectWorkerResponse {
    let (admission, queued_ms) = match admitted {
        Admitted::Now => (pb::AdmissionResult::Admitted, 0),
        Admitted::AfterQueue(waited) => (
            pb::AdmissionResult::AdmittedAfterQueue,
            u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
        ),
        Admitted::Untracked => (pb::AdmissionResult::Untracked, 0),
    };
    pb::SelectWorkerResponse {
        worker_id: selection.target.worker_id,
        dp_rank: selection.target.dp_rank,
        overlap_blocks: selection.overlap_blocks,
        effective_overlap_blocks: selection.effective_overlap_blocks,
        overlap_by_tier: Some(selection.tiers.into()),
        cached_tokens: selection.cached_tokens,
        total_blocks: selection.total_blocks,
        potential_prefill_tokens: selection.potential_prefill_tokens,
        potential_decode_blocks: selection.potential_decode_blocks,
        admission: admission.into(),
        queued_ms,
        advisory_load: advisory.then(|| booked_load_to_pb(selection.booked)),
    }
}

/// What the Admin API reports of one worker.
pub(crate) fn worker_view_to_pb(view: &WorkerView) -> pb::WorkerInfo {
    let (record, r) = (&view.record, &view.record.registration);
    let ranks = view
        .ranks
        .iter()
        .map(|rank| pb::RankInfo {
            dp_rank: rank.dp_rank,
            reported_load: Some(rank_load_to_pb(rank.dp_rank, rank.reported)),
            booked_load: Some(booked_load_to_pb(rank.booked)),
            cached_blocks: rank.cached_blocks,
            last_event_id: rank.cursor.last_applied().unwrap_or(0),
            events_skipped: rank.cursor.skipped,
            events_rejected: rank.cursor.rejected,
            predicted_blocks: rank.predicted_blocks,
        })
        .collect();
    pb::WorkerInfo {
        worker_id: r.worker_id,
        model: r.model.clone(),
        role: role_to_pb(r.role).into(),
        endpoint: r.endpoint.clone(),
        block_size: r.block_size,
        dp_start_rank: r.dp_start_rank,
        dp_size: r.dp_size,
        cache_tiers: r.tiers.iter().map(pb::CacheTierSpec::from).collect(),
        total_kv_blocks: r.total_kv_blocks,
        max_num_batched_tokens: r.max_num_batched_tokens,
        taints: r.taints.clone(),
        adapters: r.adapters.iter().map(pb::LoraAdapter::from).collect(),
        loads_adapters: r.loads_adapters,
        lease_remaining_ms: u64::try_from(record.lease_remaining(now()).as_millis())
            .unwrap_or(u64::MAX),
        cordoned: record.cordoned,
        ranks,
        subscription: view.subscription.clone(),
        kv_events: pb::KvEventsMode::from(r.kv_events).into(),
        cache_view: cache_view_to_pb(view.cache_view).into(),
        cache_view_reason: view.cache_view.describe().to_owned(),
        cached_tokens_feedback: view.feedback.as_ref().map(|f| pb::CachedTokensFeedback {
            reports: f.reports,
            mean_error_tokens: f.mean_error(),
            mean_abs_error_tokens: f.mean_abs_error(),
            index_error_blocks: f.window_error_blocks(),
            contradicted: f.contradicted,
        }),
    }
}

/// What the Admin API reports of the index.
pub(crate) fn index_view_to_pb(view: &IndexView) -> pb::IndexStats {
    pb::IndexStats {
        blocks: view.stats.blocks,
        nodes: view.stats.nodes,
        workers: view.stats.workers,
        events_applied: view.stats.events_applied,
        events_skipped: view.events_skipped,
        events_rejected: view.events_rejected,
        memory_bytes: view.stats.bytes_used,
        entries: view.digest.entries,
        digest: view.digest.digest,
        blocks_by_tier: Some(pb::BlocksByTier::from_counts(view.stats.per_tier)),
        blocks_unresolved: view.stats.blocks_unresolved,
        blocks_evicted: view.stats.blocks_evicted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_events::Dialect;

    /// Cluster mode appends `registration_to_pb` and every replica reads it
    /// with `registration_from_pb`: what it wrote must come back whole.
    #[test]
    fn a_registration_reads_back_as_it_was_written() {
        let full = Registration {
            tiers: Vec::new(),
            worker_id: 42,
            model: "llama".into(),
            role: WorkerRole::Prefill,
            endpoint: "10.0.0.7:8000".into(),
            block_size: 16,
            dp_start_rank: 4,
            dp_size: 2,
            total_kv_blocks: 9000,
            max_num_batched_tokens: 8192,
            taints: vec!["gpu=h100".into(), "spot".into()],
            adapters: Vec::new(),
            loads_adapters: true,
            lease_ttl: Some(std::time::Duration::from_secs(45)),
            kv_events: KvEventsMode::Auto,
        };
        let source = EngineSource {
            dialect: Dialect::Sglang,
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: Some("tcp://127.0.0.1:5600".into()),
        };
        let bare = Registration {
            tiers: Vec::new(),
            worker_id: 7,
            model: "m".into(),
            role: WorkerRole::Decode,
            endpoint: String::new(),
            block_size: 64,
            dp_start_rank: 0,
            dp_size: 1,
            total_kv_blocks: 0,
            max_num_batched_tokens: 0,
            taints: Vec::new(),
            adapters: Vec::new(),
            loads_adapters: false,
            lease_ttl: None,
            kv_events: KvEventsMode::Approximate,
        };
        for (registration, source) in [(full, Some(source)), (bare, None)] {
            let request = registration_to_pb(&registration, source.as_ref());
            let back = registration_from_pb(request).expect("reads back");
            assert_eq!(back, (registration, source));
        }
    }
}
