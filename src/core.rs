//! The router's shared state and the domain operations the gRPC handlers
//! call. One `RouterCore` exists per server; handlers hold an `Arc` of it.

use std::sync::Arc;

use crate::{config::ServeConfig, metrics::Metrics};

/// Everything the services share.
#[derive(Debug)]
pub struct RouterCore {
    pub config: ServeConfig,
    pub metrics: Arc<Metrics>,
}

impl RouterCore {
    pub fn new(config: ServeConfig, metrics: Arc<Metrics>) -> Self {
        Self { config, metrics }
    }
}
