//! Admission: what happens to a selection once it is made.
//!
//! Why it exists: a selection only says where a request would go. Whether
//! it goes now, waits, is refused or is merely advised depends on the
//! request's admission mode and on whether every candidate was busy; and a
//! RESERVE routing must then be recorded (booked load, session binding).
//! Invariants:
//! * [`admit`] is pure and decides from the mode and `Selection::all_busy`
//!   only; ADVISORY never books and never queues;
//! * [`commit`] is the only place selection results change state; it does
//!   nothing for QUERY_ONLY requests and either books and binds, or changes
//!   nothing (a duplicate booking leaves the session table untouched).

pub mod bookings;
pub mod peers;
pub mod prefill_times;
pub mod queue;

use crate::select::{ErrorCode, SelectMode, SelectRequest, Selection, SessionTable};
use crate::types::{LocalHash, RequestPhase, WorkerRank};

use bookings::BookingLedger;

/// Why admission refused a request.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AdmissionError {
    #[error("request {request_id}: already booked on {target}; release it before routing it again")]
    DuplicateBooking {
        request_id: String,
        target: WorkerRank,
    },
    #[error("request {request_id}: already waiting in the admission queue")]
    AlreadyQueued { request_id: String },
    #[error("request {request_id}: admission queue is full ({capacity} waiting)")]
    QueueFull { request_id: String, capacity: usize },
    #[error("request {request_id}: every eligible worker is busy; best was {target}: {reason}")]
    Busy {
        request_id: String,
        target: WorkerRank,
        reason: String,
    },
    #[error(
        "request {request_id}: deadline passed after waiting {waited_ms} ms for a worker (best was {target})"
    )]
    DeadlineExceeded {
        request_id: String,
        target: WorkerRank,
        waited_ms: u64,
    },
    #[error("request {request_id}: invalid argument: {reason}")]
    InvalidArgument { request_id: String, reason: String },
    #[error(
        "request {request_id}: open bookings of {} hold {held} bytes; this one needs {cost} more, past the bound of {limit} (release finished requests)",
        owner.as_ref().map_or_else(|| "all callers".to_owned(), |o| format!("identity {o}"))
    )]
    BookingsFull {
        request_id: String,
        /// The identity whose bound it is; `None`: the bound on all callers.
        owner: Option<String>,
        held: u64,
        cost: u64,
        limit: u64,
    },
}

impl AdmissionError {
    /// The gRPC status this error maps to.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::DuplicateBooking { .. } | Self::AlreadyQueued { .. } => {
                ErrorCode::FailedPrecondition
            }
            Self::QueueFull { .. } | Self::Busy { .. } | Self::BookingsFull { .. } => {
                ErrorCode::ResourceExhausted
            }
            Self::DeadlineExceeded { .. } => ErrorCode::DeadlineExceeded,
            Self::InvalidArgument { .. } => ErrorCode::InvalidArgument,
        }
    }
}

/// What the caller wants when every eligible worker is busy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AdmissionMode {
    /// Queue until a worker frees up or the call's deadline passes.
    #[default]
    Wait,
    /// Fail at once with RESOURCE_EXHAUSTED.
    Reject,
    /// Never queue, never book: answer with the best worker and its load.
    Advisory,
}

/// What to do with a selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Admission {
    /// Route now (and, for RESERVE, [`commit`]).
    Admit,
    /// Put the request in the [`queue::WaitQueue`] and select again later.
    Queue,
    /// Answer with the selection and the target's load; book nothing.
    Advisory,
}

/// Decides admission for `selection` under `mode`.
pub fn admit(
    request_id: &str,
    mode: AdmissionMode,
    selection: &Selection,
) -> Result<Admission, AdmissionError> {
    match (mode, selection.all_busy) {
        (AdmissionMode::Advisory, _) => Ok(Admission::Advisory),
        (_, false) => Ok(Admission::Admit),
        (AdmissionMode::Wait, true) => Ok(Admission::Queue),
        (AdmissionMode::Reject, true) => Err(AdmissionError::Busy {
            request_id: request_id.to_owned(),
            target: selection.target,
            reason: selection
                .busy
                .map_or_else(|| "busy".to_owned(), |b| b.to_string()),
        }),
    }
}

/// Records a RESERVE routing: books the request's load on the chosen target
/// (owned by `owner`, the authenticated caller) and binds (or refreshes)
/// its session. Returns whether anything was
/// booked: `false` for QUERY_ONLY requests, which change nothing.
///
/// Booked prefill is the request's uncached part; a DECODE-phase request
/// books no prefill (its KV arrives by transfer from the prefill worker) but
/// does book its blocks for decode.
pub fn commit(
    req: &SelectRequest,
    selection: &Selection,
    block_hashes: &[LocalHash],
    ledger: &mut BookingLedger,
    sessions: &mut SessionTable,
    now_ms: u64,
    owner: Option<&std::sync::Arc<str>>,
) -> Result<bool, AdmissionError> {
    if req.mode == SelectMode::QueryOnly {
        return Ok(false);
    }
    let (prefill_tokens, prefill_blocks) = match req.phase {
        RequestPhase::Decode => (0, 0),
        RequestPhase::Prefill | RequestPhase::Aggregated => (
            selection.request_prefill_tokens,
            selection.request_prefill_blocks,
        ),
    };
    ledger.book(
        &req.request_id,
        selection.target,
        prefill_tokens,
        prefill_blocks,
        block_hashes,
        now_ms,
        owner.cloned(),
    )?;
    if let Some(session) = &req.session {
        sessions.record_routing(&session.session_id, selection.target, now_ms);
    }
    Ok(true)
}

#[cfg(test)]
mod tests;
