//! Errors of the selection decision.
//!
//! Why it exists: the gRPC layer must turn every refusal into a status code
//! and a message a person can act on. Invariants: each variant maps to exactly
//! one [`ErrorCode`], and each message names the request id and the worker(s)
//! concerned (or, when no worker is concerned, the model and phase).

use crate::types::{DpRank, RequestPhase, WorkerId, WorkerRank};

use super::eligibility::Ineligible;

/// The gRPC status a refusal maps to. Shared by the selection and admission
/// areas so the gRPC layer has a single `match` to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    InvalidArgument,
    NotFound,
    FailedPrecondition,
    Unavailable,
    ResourceExhausted,
    DeadlineExceeded,
    /// A bug (e.g. a scorer broke its contract); not the caller's fault.
    Internal,
}

/// Why a selection was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SelectError {
    #[error("request {request_id}: invalid argument: {reason}")]
    InvalidArgument { request_id: String, reason: String },

    #[error(
        "request {request_id}: block size {request_block_size} does not match worker {worker_id}'s block size {worker_block_size}"
    )]
    BlockSizeMismatch {
        request_id: String,
        worker_id: WorkerId,
        worker_block_size: u32,
        request_block_size: u32,
    },

    #[error(
        "request {request_id}: pinned worker {worker_id} is not registered for model {model:?}"
    )]
    PinnedWorkerNotFound {
        request_id: String,
        worker_id: WorkerId,
        model: String,
    },

    #[error(
        "request {request_id}: pinned worker {worker_id} requires an explicit dp_rank because it has {dp_size} dp ranks"
    )]
    DpRankRequired {
        request_id: String,
        worker_id: WorkerId,
        dp_size: u32,
    },

    #[error("request {request_id}: pinned {target} is not eligible: {reason}")]
    PinnedWorkerIneligible {
        request_id: String,
        target: WorkerRank,
        reason: Ineligible,
    },

    #[error("request {request_id}: previewed {planned} conflicts with requested worker {requested_worker} dp_rank {}", fmt_rank(*requested_dp_rank))]
    PlannedWorkerConflict {
        request_id: String,
        planned: WorkerRank,
        requested_worker: WorkerId,
        requested_dp_rank: Option<DpRank>,
    },

    #[error("request {request_id}: no eligible worker for model {model:?} in phase {phase:?} among {} worker(s){}", rejected.len(), fmt_rejected(rejected))]
    NoEligibleWorker {
        request_id: String,
        model: String,
        phase: RequestPhase,
        /// Each worker of the model with why it was refused (its first
        /// rank's reason), in worker id order.
        rejected: Vec<(WorkerId, Ineligible)>,
    },

    #[error(
        "request {request_id}: migration exhausted: every eligible worker was already tried (excluded workers {excluded:?})"
    )]
    MigrationExhausted {
        request_id: String,
        excluded: Vec<WorkerId>,
    },

    #[error("request {request_id}: scoring policy {policy:?} failed: {reason}")]
    ScorerFailed {
        request_id: String,
        policy: &'static str,
        reason: String,
    },
}

/// How many refused workers an error message lists before summarising.
const LISTED_REJECTIONS: usize = 8;

fn fmt_rejected(rejected: &[(WorkerId, Ineligible)]) -> String {
    let mut out = String::new();
    for (i, (worker, why)) in rejected.iter().take(LISTED_REJECTIONS).enumerate() {
        out.push_str(if i == 0 { ": " } else { "; " });
        out.push_str(&format!("worker {worker}: {why}"));
    }
    if rejected.len() > LISTED_REJECTIONS {
        out.push_str(&format!(
            "; and {} more",
            rejected.len() - LISTED_REJECTIONS
        ));
    }
    out
}

fn fmt_rank(rank: Option<DpRank>) -> String {
    rank.map_or_else(|| "unset".to_owned(), |r| r.to_string())
}

impl SelectError {
    /// The gRPC status this error maps to.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::InvalidArgument { .. } => ErrorCode::InvalidArgument,
            Self::PinnedWorkerNotFound { .. } => ErrorCode::NotFound,
            Self::BlockSizeMismatch { .. }
            | Self::DpRankRequired { .. }
            | Self::PinnedWorkerIneligible { .. }
            | Self::PlannedWorkerConflict { .. } => ErrorCode::FailedPrecondition,
            Self::NoEligibleWorker { .. } | Self::MigrationExhausted { .. } => {
                ErrorCode::Unavailable
            }
            Self::ScorerFailed { .. } => ErrorCode::Internal,
        }
    }

    #[cfg(test)]
    /// The request the error is about.
    pub(crate) fn request_id(&self) -> &str {
        match self {
            Self::InvalidArgument { request_id, .. }
            | Self::BlockSizeMismatch { request_id, .. }
            | Self::PinnedWorkerNotFound { request_id, .. }
            | Self::DpRankRequired { request_id, .. }
            | Self::PinnedWorkerIneligible { request_id, .. }
            | Self::PlannedWorkerConflict { request_id, .. }
            | Self::NoEligibleWorker { request_id, .. }
            | Self::MigrationExhausted { request_id, .. }
            | Self::ScorerFailed { request_id, .. } => request_id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_request_and_workers() {
        let e = SelectError::PlannedWorkerConflict {
            request_id: "r1".into(),
            planned: WorkerRank::new(3, 1),
            requested_worker: 4,
            requested_dp_rank: None,
        };
        let msg = e.to_string();
        assert!(msg.contains("r1"), "{msg}");
        assert!(msg.contains("worker 3 dp_rank 1"), "{msg}");
        assert!(msg.contains("worker 4 dp_rank unset"), "{msg}");
        assert_eq!(e.code(), ErrorCode::FailedPrecondition);
        assert_eq!(e.request_id(), "r1");
    }

    #[test]
    fn codes() {
        let nf = SelectError::PinnedWorkerNotFound {
            request_id: "r".into(),
            worker_id: 1,
            model: "m".into(),
        };
        assert_eq!(nf.code(), ErrorCode::NotFound);
        let ex = SelectError::MigrationExhausted {
            request_id: "r".into(),
            excluded: vec![1, 2],
        };
        assert_eq!(ex.code(), ErrorCode::Unavailable);
        assert!(ex.to_string().contains("[1, 2]"));
    }

    #[test]
    fn no_eligible_lists_workers_and_summarises() {
        let rejected: Vec<(WorkerId, Ineligible)> =
            (1..=10).map(|w| (w, Ineligible::Cordoned)).collect();
        let e = SelectError::NoEligibleWorker {
            request_id: "r".into(),
            model: "m".into(),
            phase: RequestPhase::Decode,
            rejected,
        };
        let msg = e.to_string();
        assert!(
            msg.contains("among 10 worker(s): worker 1: worker is cordoned; worker 2"),
            "{msg}"
        );
        assert!(msg.ends_with("; and 2 more"), "{msg}");
        assert!(!msg.contains("worker 9:"), "{msg}");
        let none = SelectError::NoEligibleWorker {
            request_id: "r".into(),
            model: "m".into(),
            phase: RequestPhase::Decode,
            rejected: vec![],
        };
        assert!(none.to_string().ends_with("among 0 worker(s)"));
    }
}
