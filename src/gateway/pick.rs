//! From a request body to a destination: the body read as an OpenAI
//! request, its model resolved (a LoRA adapter routes among its base
//! model's workers), its prompt tokenized and hashed as the engine hashes
//! its KV events (block size of the model's workers, the adapter's name,
//! the `cache_salt`), then decided by the router core like any RESERVE
//! SelectWorker, among the workers the picker may send to: those with an
//! HTTP endpoint, within the proxy's subset hint if it gave one.

use std::collections::HashSet;

use kvroute_core::{
    hashing::{HashOptions, compute_block_hashes},
    select::{ErrorCode, SelectMode, SelectRequest, Selection},
    types::{WorkerId, WorkerSnapshot},
};
use kvroute_prompt::{OpenAiRequest, PromptError, RequestError, request};

use super::{prompts::Tokens, reply::Destination};
use crate::{
    router::{ModelView, PreparedRequest, RouteError},
    security::endpoint_allow::http_address,
};
use kvroute_core::admission::AdmissionMode;

/// Why a request is answered by the picker itself: the HTTP status, the
/// metric label and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub status: u16,
    pub outcome: &'static str,
    pub message: String,
}

impl Refusal {
    pub(crate) fn new(status: u16, message: impl Into<String>) -> Self {
        let outcome = match status {
            400 => "bad_request",
            413 => "too_large",
            429 => "busy",
            _ => "unavailable",
        };
        Self {
            status,
            outcome,
            message: message.into(),
        }
    }
}

impl From<RequestError> for Refusal {
    fn from(error: RequestError) -> Self {
        Self::new(error.http_status(), error.to_string())
    }
}

impl From<PromptError> for Refusal {
    fn from(error: PromptError) -> Self {
        Self::new(400, error.to_string())
    }
}

impl From<RouteError> for Refusal {
    fn from(error: RouteError) -> Self {
        let status = match &error {
            RouteError::Admission(e) => match e.code() {
                ErrorCode::ResourceExhausted | ErrorCode::DeadlineExceeded => 429,
                ErrorCode::InvalidArgument => 400,
                _ => 503,
            },
            RouteError::Select(e) => match e.code() {
                ErrorCode::InvalidArgument => 400,
                _ => 503,
            },
            RouteError::ShuttingDown { .. } | RouteError::NotDecided { .. } => 503,
        };
        Self::new(status, error.to_string())
    }
}

/// The body of a request to `path`, read.
pub(crate) fn read_body(path: &str, body: &[u8]) -> Result<OpenAiRequest, Refusal> {
    let endpoint = request::Endpoint::of_path(path);
    request::parse(endpoint, body).map_err(Refusal::from)
}

/// The workers of a model the picker may send to: with an HTTP endpoint,
/// and in `subset` when the proxy gave one.
pub(crate) fn reachable<'a>(
    workers: &'a [WorkerSnapshot],
    subset: Option<&'a HashSet<String>>,
) -> impl Iterator<Item = (&'a WorkerSnapshot, &'a str)> + 'a {
    workers.iter().filter_map(move |w| {
        let address = http_address(&w.endpoint)?;
        subset
            .is_none_or(|s| s.contains(address))
            .then_some((w, address))
    })
}

/// What the decision is asked, for one request.
pub(crate) struct Ask<'a> {
    pub request_id: String,
    pub model: &'a str,
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    pub tokens: &'a Tokens,
    /// A guess at the prompt's length when it was not tokenized (bytes /
    /// 4), so load still counts it.
    pub untokenized_tokens: u64,
    pub admission: AdmissionMode,
    pub max_blocks: usize,
}

/// The RESERVE request for `ask` on `view`, excluding the workers the
/// picker may not send to; `None` when none is left.
pub(crate) fn prepare(
    ask: &Ask<'_>,
    view: &ModelView,
    subset: Option<&HashSet<String>>,
) -> Option<PreparedRequest> {
    let allowed: HashSet<WorkerId> = reachable(view.workers(), subset)
        .map(|(w, _)| w.worker_id)
        .collect();
    if allowed.is_empty() {
        return None;
    }
    let excluded_worker_ids = view
        .workers()
        .iter()
        .map(|w| w.worker_id)
        .filter(|id| !allowed.contains(id))
        .collect();
    let block_size = view.block_size();
    let (hashes, prompt_tokens) = match ask.tokens {
        Tokens::Ids { ids, .. } => {
            let options = HashOptions {
                lora_name: ask.lora_name,
                cache_namespace: ask.cache_salt,
            };
            let mut hashes = compute_block_hashes(ids, block_size, &options, None);
            // Past the limit only the leading blocks count: matching stops
            // there, the booking does not grow with the prompt.
            hashes.truncate(ask.max_blocks);
            (hashes, ids.len() as u64)
        }
        Tokens::ByLoad(_) => (Vec::new(), ask.untokenized_tokens),
    };
    let prompt_tokens = prompt_tokens.min(ask.max_blocks as u64 * u64::from(block_size));
    Some(PreparedRequest {
        request: SelectRequest {
            request_id: ask.request_id.clone(),
            model: ask.model.to_owned(),
            // The adapter's workers only, where workers declare theirs.
            adapter: ask.lora_name.map(str::to_owned),
            prompt_tokens,
            block_size,
            excluded_worker_ids,
            mode: SelectMode::Reserve,
            ..SelectRequest::default()
        },
        hashes,
        admission: ask.admission,
        owner: None,
    })
}

/// The chosen endpoint, then up to `fallbacks` others (distinct addresses,
/// the lowest cost first), and the rank to pin when the chosen worker
/// serves several behind its one endpoint.
pub(crate) fn destination(
    selection: &Selection,
    view: &ModelView,
    subset: Option<&HashSet<String>>,
    fallbacks: usize,
) -> Option<Destination> {
    let reachable: Vec<(&WorkerSnapshot, &str)> = reachable(view.workers(), subset).collect();
    let address_of = |id: WorkerId| {
        reachable
            .iter()
            .find(|(w, _)| w.worker_id == id)
            .map(|(w, a)| (*w, *a))
    };
    let (chosen, address) = address_of(selection.target.worker_id)?;
    let mut endpoints = vec![address.to_owned()];
    let mut others: Vec<(f64, &str)> = selection
        .candidates
        .iter()
        .filter(|c| c.eligible.is_ok() && c.target.worker_id != chosen.worker_id)
        .filter_map(|c| {
            let (_, address) = address_of(c.target.worker_id)?;
            Some((c.score.map_or(f64::INFINITY, |s| s.cost), address))
        })
        .collect();
    others.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (_, address) in others {
        if endpoints.len() > fallbacks {
            break;
        }
        if !endpoints.iter().any(|e| e == address) {
            endpoints.push(address.to_owned());
        }
    }
    Some(Destination {
        endpoints,
        dp_rank: (chosen.dp_size > 1).then_some(selection.target.dp_rank),
    })
}
