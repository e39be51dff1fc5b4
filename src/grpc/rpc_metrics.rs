//! A tower layer that counts every gRPC call by method and status code and
//! times it, for the `rpc_requests_total` and `rpc_duration_seconds` families.
//!
//! The code is read from the response headers: tonic sends errors of unary
//! calls as trailers-only responses, so they carry `grpc-status` there; a
//! response without it is counted as OK. For streaming calls this records the
//! opening of the stream, not its end. Paths not in the known set are labelled
//! `unknown`, so clients cannot grow the label space.

use std::{
    collections::HashSet,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use tokio::time::Instant;
use tower::{Layer, Service};

use crate::metrics::Metrics;

/// Adds RPC metrics to every call of the wrapped service.
#[derive(Clone)]
pub struct RpcMetricsLayer {
    metrics: Arc<Metrics>,
    known_paths: Arc<HashSet<String>>,
}

impl RpcMetricsLayer {
    pub(crate) fn new(metrics: Arc<Metrics>, known_paths: HashSet<String>) -> Self {
        Self {
            metrics,
            known_paths: Arc::new(known_paths),
        }
    }
}

impl<S> Layer<S> for RpcMetricsLayer {
    type Service = RpcMetrics<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RpcMetrics {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service made by [`RpcMetricsLayer`].
#[derive(Clone)]
pub struct RpcMetrics<S> {
    inner: S,
    layer: RpcMetricsLayer,
}

impl<S, B, RB> Service<http::Request<B>> for RpcMetrics<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let path = request.uri().path();
        let method = if self.layer.known_paths.contains(path) {
            path.to_string()
        } else {
            "unknown".to_string()
        };
        let metrics = self.layer.metrics.clone();
        let started = Instant::now();
        let future = self.inner.call(request);
        Box::pin(async move {
            let result = future.await;
            let code = match &result {
                Ok(response) => response
                    .headers()
                    .get("grpc-status")
                    .map(|v| tonic::Code::from_bytes(v.as_bytes()))
                    .unwrap_or(tonic::Code::Ok),
                Err(_) => tonic::Code::Internal,
            };
            metrics.observe_rpc(&method, code_name(code), started.elapsed());
            result
        })
    }
}

/// The canonical upper-case name of a gRPC status code.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Every RPC path in the given encoded file descriptor sets
/// (`/package.Service/Method`).
pub(crate) fn rpc_paths(descriptor_sets: &[&[u8]]) -> HashSet<String> {
    let mut paths = HashSet::new();
    for bytes in descriptor_sets {
        let Ok(set) = <prost_types::FileDescriptorSet as prost::Message>::decode(*bytes) else {
            continue;
        };
        for file in set.file {
            let package = file.package.unwrap_or_default();
            for service in file.service {
                let service_name = service.name.unwrap_or_default();
                for method in service.method {
                    paths.insert(format!(
                        "/{package}.{service_name}/{}",
                        method.name.unwrap_or_default()
                    ));
                }
            }
        }
    }
    paths
}
