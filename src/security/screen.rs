//! A tower layer that answers a call itself, with a gRPC status, when a
//! check refuses it, and otherwise passes it on. The guard (credentials and
//! roles) and the startup gate are both such checks.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use tonic::Status;
use tower::{Layer, Service};

/// A check made of every call before it reaches a service.
pub trait Screen: Clone {
    /// `Err` answers the call with that status; `Ok` lets it through (the
    /// check may add to the call's extensions).
    fn screen(
        &self,
        path: &str,
        headers: &http::HeaderMap,
        extensions: &mut http::Extensions,
    ) -> Result<(), Status>;
}

/// Puts a [`Screen`] in front of a service.
#[derive(Clone, Debug)]
pub struct ScreenLayer<C>(pub C);

impl<S, C: Screen> Layer<S> for ScreenLayer<C> {
    type Service = Screened<S, C>;
    fn layer(&self, inner: S) -> Self::Service {
        Screened {
            inner,
            check: self.0.clone(),
        }
    }
}

/// The service made by [`ScreenLayer`].
#[derive(Clone)]
pub struct Screened<S, C> {
    inner: S,
    check: C,
}

impl<S, C, B, RB> Service<http::Request<B>> for Screened<S, C>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    RB: Default + Send + 'static,
    S::Error: Send + 'static,
    C: Screen,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        match self
            .check
            .screen(parts.uri.path(), &parts.headers, &mut parts.extensions)
        {
            Ok(()) => Box::pin(self.inner.call(http::Request::from_parts(parts, body))),
            Err(status) => Box::pin(std::future::ready(Ok(status.into_http::<RB>()))),
        }
    }
}
