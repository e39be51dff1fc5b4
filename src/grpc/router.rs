//! The `kvroute.v1.Router` service: SelectWorker and the request lifecycle.

use std::{sync::Arc, time::Duration};

use tonic::{Request, Response, Status};

use crate::{
    grpc::{convert, status::reason_label},
    pb,
    router::{Admitted, ModelView, PreparedRequest, RouterCore},
    security::{self, Identity, Role},
};
use kvroute_core::admission::AdmissionMode;

/// Handlers of `kvroute.v1.Router`.
#[derive(Clone)]
pub struct RouterService {
    core: Arc<RouterCore>,
    /// The server's limit of a unary call (a client's shorter one wins).
    request_timeout: Duration,
}

impl RouterService {
    pub(crate) fn new(core: Arc<RouterCore>, request_timeout: Duration) -> Self {
        Self {
            core,
            request_timeout,
        }
    }

    /// Refuses a lifecycle call on another identity's booking; an
    /// operator-write identity may release any.
    fn check_owner(
        &self,
        caller: Option<&Identity>,
        request_id: &str,
        method: &str,
        operator_may: bool,
    ) -> Result<(), Status> {
        let Some(caller) = caller else {
            return Ok(());
        };
        if operator_may && caller.has(Role::OperatorWrite) {
            return Ok(());
        }
        if !self.core.booked_by_other(request_id, &caller.name) {
            return Ok(());
        }
        self.core
            .metrics()
            .security
            .auth_decisions
            .with_label_values(&[method, "frontend", "denied"])
            .inc();
        Err(Status::permission_denied(format!(
            "request_id {request_id:?} was booked by another identity than {:?}",
            caller.name
        )))
    }

    fn fail(&self, status: Status) -> Status {
        self.core
            .metrics()
            .input_rejected
            .with_label_values(&["router", reason_label(&status)])
            .inc();
        status
    }
}

/// Converts a SelectWorker request, hashing its prompt at the block size
/// of `model`, the view of the request's model the call is decided on.
pub(crate) fn prepare_on(
    core: &RouterCore,
    model: &ModelView,
    request: pb::SelectWorkerRequest,
) -> Result<PreparedRequest, Status> {
    convert::select_request_from_pb(
        request,
        model.block_size(),
        core.config().limits.max_blocks_per_event as usize,
    )
    .map_err(Status::from)
}

/// The call's deadline: the client's `grpc-timeout` or the server's request
/// timeout, whichever is sooner, less a small margin so the queue answers
/// DEADLINE_EXCEEDED itself before the transport cancels the call.
fn deadline<T>(request: &Request<T>, server_timeout: Duration) -> tokio::time::Instant {
    let client = request
        .metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_grpc_timeout);
    let budget = client.map_or(server_timeout, |c| c.min(server_timeout));
    let margin = (budget / 10).min(Duration::from_millis(50));
    tokio::time::Instant::now() + budget.saturating_sub(margin)
}

/// Parses a `grpc-timeout` header value: up to 8 digits and a unit.
fn parse_grpc_timeout(text: &str) -> Option<Duration> {
    if text.len() < 2 || text.len() > 9 {
        return None;
    }
    let (digits, unit) = text.split_at(text.len() - 1);
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(value.saturating_mul(3600)),
        "M" => Duration::from_secs(value.saturating_mul(60)),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

#[tonic::async_trait]
impl pb::router_server::Router for RouterService {
    async fn select_worker(
        &self,
        request: Request<pb::SelectWorkerRequest>,
    ) -> Result<Response<pb::SelectWorkerResponse>, Status> {
        let deadline = deadline(&request, self.request_timeout);
        let owner = security::caller(request.extensions()).map(|c| c.name.clone());
        // One read of the members lock: the prompt is hashed at this
        // view's block size and decided on its workers and index.
        let model = self.core.model_view(&request.get_ref().model);
        let mut prepared =
            prepare_on(&self.core, &model, request.into_inner()).map_err(|s| self.fail(s))?;
        prepared.owner = owner;
        let advisory = prepared.admission == AdmissionMode::Advisory;
        let request_id = prepared.request.request_id.clone();
        let outcome = self
            .core
            .route(&model, prepared, deadline)
            .await
            .map_err(|e| self.fail(e.into()))?;
        let selection = &outcome.selection;
        tracing::debug!(
            request_id,
            worker_id = selection.target.worker_id,
            dp_rank = selection.target.dp_rank,
            overlap = selection.overlap_blocks,
            total = selection.total_blocks,
            "routed"
        );
        let advisory = advisory && outcome.admitted == Admitted::Untracked;
        Ok(Response::new(convert::selection_to_pb(
            selection,
            outcome.admitted,
            advisory,
        )))
    }

    async fn mark_prefill_complete(
        &self,
        request: Request<pb::MarkPrefillCompleteRequest>,
    ) -> Result<Response<pb::MarkPrefillCompleteResponse>, Status> {
        let caller = security::caller(request.extensions()).cloned();
        let pb::MarkPrefillCompleteRequest {
            request_id: id,
            cached_tokens,
        } = request.into_inner();
        convert::name("request_id", &id).map_err(|e| self.fail(e.into()))?;
        self.check_owner(
            caller.as_deref(),
            &id,
            "/kvroute.v1.Router/MarkPrefillComplete",
            false,
        )?;
        if let Some(cached_tokens) = cached_tokens {
            self.core.report_cached_tokens(&id, cached_tokens);
        }
        let changed = self.core.finish_booking(&id, false).await;
        Ok(Response::new(pb::MarkPrefillCompleteResponse { changed }))
    }

    async fn release_request(
        &self,
        request: Request<pb::ReleaseRequestRequest>,
    ) -> Result<Response<pb::ReleaseRequestResponse>, Status> {
        let caller = security::caller(request.extensions()).cloned();
        let pb::ReleaseRequestRequest {
            request_id: id,
            cached_tokens,
        } = request.into_inner();
        convert::name("request_id", &id).map_err(|e| self.fail(e.into()))?;
        self.check_owner(
            caller.as_deref(),
            &id,
            "/kvroute.v1.Router/ReleaseRequest",
            true,
        )?;
        if let Some(cached_tokens) = cached_tokens {
            self.core.report_cached_tokens(&id, cached_tokens);
        }
        let changed = self.core.finish_booking(&id, true).await;
        Ok(Response::new(pb::ReleaseRequestResponse { changed }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_units() {
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("123456789S"), None);
        assert_eq!(parse_grpc_timeout("S"), None);
        assert_eq!(parse_grpc_timeout("5x"), None);
    }
}
