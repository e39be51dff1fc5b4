//! The one mapping from domain errors to `tonic::Status`, following the
//! error table of the API: malformed input → INVALID_ARGUMENT, unknown worker
//! → NOT_FOUND, a state that forbids the call → FAILED_PRECONDITION, nothing
//! to route to → UNAVAILABLE, queue full or busy → RESOURCE_EXHAUSTED, queued
//! too long → DEADLINE_EXCEEDED. Messages name the request and worker(s).

use tonic::{Code, Status};

use crate::{
    fleet::{FleetError, changes::ReplicationError},
    ingest::IngestError,
    router::RouteError,
};
use kvroute_core::{registry::RegistryError, select::error::ErrorCode};

/// A request field that failed validation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidInput {
    pub field: String,
    pub message: String,
}

impl InvalidInput {
    pub(crate) fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl From<InvalidInput> for Status {
    fn from(error: InvalidInput) -> Self {
        Status::invalid_argument(error.to_string())
    }
}

/// The status of a registry refusal (the domain's error type lives in
/// `kvroute_core`, which knows nothing of gRPC).
pub(crate) fn registry_status(error: RegistryError) -> Status {
    {
        let code = match &error {
            RegistryError::Invalid { .. } => Code::InvalidArgument,
            // API.md: "a dp rank that cannot be resolved" is a precondition
            // failure; the worker itself is known.
            RegistryError::BlockSizeMismatch { .. }
            | RegistryError::UnknownRank { .. }
            | RegistryError::PublishesNoEvents { .. } => Code::FailedPrecondition,
            RegistryError::UnknownWorker { .. } => Code::NotFound,
            RegistryError::LimitReached { .. } => Code::ResourceExhausted,
        };
        Status::new(code, error.to_string())
    }
}

impl From<IngestError> for Status {
    fn from(error: IngestError) -> Self {
        let code = match &error {
            IngestError::WorkerGone { .. } => Code::NotFound,
            IngestError::WriterStopped => Code::Unavailable,
            IngestError::Restore(_) => Code::Internal,
        };
        Status::new(code, error.to_string())
    }
}

impl From<FleetError> for Status {
    fn from(error: FleetError) -> Self {
        match error {
            FleetError::Registry(e) => registry_status(e),
            FleetError::Ingest(e) => e.into(),
            FleetError::InvalidSource { .. } => Status::invalid_argument(error.to_string()),
            FleetError::ConfiguredEngine { .. }
            | FleetError::DuplicateEngine { .. }
            | FleetError::MemberIdTaken { .. } => Status::failed_precondition(error.to_string()),
            FleetError::Replication(ReplicationError::Unavailable(message)) => {
                Status::unavailable(message)
            }
            FleetError::Replication(ReplicationError::Refused(message)) => {
                Status::invalid_argument(message)
            }
            FleetError::Replication(ReplicationError::Inconsistent(message)) => {
                Status::internal(message)
            }
        }
    }
}

/// A short, fixed label for a status code, for the rejection counter.
pub(crate) fn reason_label(status: &Status) -> &'static str {
    super::rpc_metrics::code_name(status.code())
}

fn code_of(code: ErrorCode) -> Code {
    use ErrorCode as E;
    match code {
        E::InvalidArgument => Code::InvalidArgument,
        E::NotFound => Code::NotFound,
        E::FailedPrecondition => Code::FailedPrecondition,
        E::Unavailable => Code::Unavailable,
        E::ResourceExhausted => Code::ResourceExhausted,
        E::DeadlineExceeded => Code::DeadlineExceeded,
        E::Internal => Code::Internal,
    }
}

impl From<RouteError> for Status {
    fn from(error: RouteError) -> Self {
        let code = match &error {
            RouteError::Select(e) => code_of(e.code()),
            RouteError::Admission(e) => code_of(e.code()),
            RouteError::ShuttingDown { .. } | RouteError::NotDecided { .. } => Code::Unavailable,
        };
        Status::new(code, error.to_string())
    }
}
