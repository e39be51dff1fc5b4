//! A tower layer that answers UNAVAILABLE to every call but health checks
//! and reflection until the service has its state back (the snapshot
//! loaded). The port can then be bound and health report NOT_SERVING from
//! the first moment, while no call sees a fleet that is still being
//! restored.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use tower::{Layer, Service};

/// Opens once; until then only health and reflection are served.
#[derive(Clone, Debug, Default)]
pub struct StartupGate {
    open: Arc<AtomicBool>,
}

impl StartupGate {
    pub fn new() -> Self {
        Self::default()
    }

    /// Lets every call through from now on.
    pub fn open(&self) {
        self.open.store(true, Ordering::Release);
    }

    fn passes(&self, path: &str) -> bool {
        self.open.load(Ordering::Acquire)
            || path.starts_with("/grpc.health.v1.Health/")
            || path.starts_with("/grpc.reflection.")
    }
}

impl<S> Layer<S> for StartupGate {
    type Service = Gated<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Gated {
            inner,
            gate: self.clone(),
        }
    }
}

/// The service made by [`StartupGate`].
#[derive(Clone)]
pub struct Gated<S> {
    inner: S,
    gate: StartupGate,
}

impl<S, B, RB> Service<http::Request<B>> for Gated<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    RB: Default + Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if self.gate.passes(request.uri().path()) {
            return Box::pin(self.inner.call(request));
        }
        let refused = tonic::Status::unavailable(
            "kvroute is starting: its saved state is being loaded; retry shortly",
        )
        .into_http::<RB>();
        Box::pin(std::future::ready(Ok(refused)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_health_and_reflection_pass_until_it_opens() {
        let gate = StartupGate::new();
        assert!(gate.passes("/grpc.health.v1.Health/Check"));
        assert!(gate.passes("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"));
        assert!(!gate.passes("/kvroute.v1.Router/SelectWorker"));
        assert!(!gate.passes("/kvroute.v1.Workers/PublishEvents"));
        gate.clone().open();
        assert!(gate.passes("/kvroute.v1.Router/SelectWorker"));
    }
}
