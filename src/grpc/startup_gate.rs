//! A tower layer that answers UNAVAILABLE to every call but health checks
//! and reflection until the service has its state back (the snapshot
//! loaded). The port can then be bound and health report NOT_SERVING from
//! the first moment, while no call sees a fleet that is still being
//! restored.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use crate::security::screen::Screen;

/// Opens once; until then only health and reflection are served.
#[derive(Clone, Debug, Default)]
pub struct StartupGate {
    open: Arc<AtomicBool>,
}

impl StartupGate {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Lets every call through from now on.
    pub(crate) fn open(&self) {
        self.open.store(true, Ordering::Release);
    }

    fn passes(&self, path: &str) -> bool {
        self.open.load(Ordering::Acquire)
            || path.starts_with("/grpc.health.v1.Health/")
            || path.starts_with("/grpc.reflection.")
    }
}

impl Screen for StartupGate {
    fn screen(
        &self,
        path: &str,
        _headers: &http::HeaderMap,
        _extensions: &mut http::Extensions,
    ) -> Result<(), tonic::Status> {
        if self.passes(path) {
            return Ok(());
        }
        Err(tonic::Status::unavailable(
            "kvroute is starting: its saved state is being loaded; retry shortly",
        ))
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
