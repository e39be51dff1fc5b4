//! The front door: kvroute as an inference gateway's Endpoint Picker.
//!
//! Kubernetes gateways (Envoy Gateway, kgateway, Istio, GKE) and a plain
//! Envoy route OpenAI traffic by asking an endpoint picker over Envoy's
//! `ext_proc` gRPC stream (the Gateway API Inference Extension's protocol,
//! v1). Served on `--ext-proc-addr`, this module reads each request's body,
//! renders and tokenizes its prompt as the engine will (`prompts`, with
//! `kvroute-prompt`), lets the router core pick a (worker, dp rank) as
//! for any RESERVE SelectWorker (`pick`), and answers with the endpoint,
//! the fallbacks and the rank header (`reply`). The stream itself drives
//! the booking (`exchange`): the first response bytes complete the
//! prefill, the response's end or the stream's loss releases it.
//!
//! Bounds: a body is held only up to `--epp-max-body-bytes`, all bodies
//! together up to `--epp-max-buffered-bytes` (`body`); templates run on
//! fuel; a response is scanned for the engine's cached-token count with a
//! fixed carry (`usage`).

mod body;
mod booking;
mod exchange;
mod pick;
mod prompts;
mod reply;
mod usage;

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse,
    external_processor_server::{ExternalProcessor, ExternalProcessorServer},
};
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::{
    config::{EppAdmission, GatewayOptions},
    metrics::GatewayFamilies,
    router::RouterCore,
};
use kvroute_core::admission::AdmissionMode;

pub(crate) use body::BodyBudget;
pub(crate) use prompts::Prompts;

/// The gRPC path of the one ext_proc method (for the auth guard and the
/// RPC metrics).
pub const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// The ext_proc service name, which health reports on.
pub const SERVICE_NAME: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// How the picker decides, from the serve settings.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub max_body_bytes: u64,
    pub admission: AdmissionMode,
    pub fallbacks: usize,
    /// The longest a pick may wait for a worker (WAIT admission).
    pub request_timeout: Duration,
    /// Prompt blocks a pick hashes at most.
    pub max_blocks: usize,
}

/// What every stream shares.
pub(crate) struct Gateway {
    core: Arc<RouterCore>,
    prompts: Prompts,
    settings: Settings,
    metrics: GatewayFamilies,
    body_budget: Arc<BodyBudget>,
    /// Templates and tokenizers run on the blocking pool, at most one per
    /// core at a time: a flood of long prompts queues here instead of
    /// taking every thread.
    tokenizing: Arc<tokio::sync::Semaphore>,
    /// Bookings are named `epp-<instance>-<n>`: unique per process, and
    /// across replicas, whatever `x-request-id` a client sends.
    instance: u32,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// The picker for `core`, its tokenizers loaded (an error names the
    /// setting that failed).
    pub(crate) fn new(
        core: Arc<RouterCore>,
        options: &GatewayOptions,
        request_timeout: Duration,
    ) -> Result<Arc<Self>, String> {
        let prompts = Prompts::load(
            &options.epp_tokenizer,
            &options.epp_lora,
            options.epp_prompt_cache_tokens,
        )?;
        let metrics = core.metrics().gateway.clone();
        let body_budget = BodyBudget::new(
            options.epp_max_buffered_bytes,
            metrics.buffered_bytes.clone(),
        );
        let max_blocks = core.config().limits.max_blocks_per_event as usize;
        Ok(Arc::new(Self {
            core,
            prompts,
            settings: Settings {
                max_body_bytes: options.epp_max_body_bytes,
                admission: match options.epp_admission {
                    EppAdmission::Wait => AdmissionMode::Wait,
                    EppAdmission::Reject => AdmissionMode::Reject,
                },
                fallbacks: options.epp_fallbacks as usize,
                request_timeout,
                max_blocks,
            },
            metrics,
            body_budget,
            tokenizing: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
            instance: rand::random(),
            next_id: AtomicU64::new(0),
        }))
    }

    fn next_request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("epp-{:08x}-{n}", self.instance)
    }

    /// Records how long one part of a pick took (`pick_seconds{part}`).
    fn time(&self, part: &str, since: std::time::Instant) {
        self.metrics
            .pick_seconds
            .with_label_values(&[part])
            .observe(since.elapsed().as_secs_f64());
    }

    /// The tonic service.
    pub(crate) fn service(self: &Arc<Self>) -> ExternalProcessorServer<ExtProc> {
        ExternalProcessorServer::new(ExtProc(self.clone()))
    }
}

/// The `envoy.service.ext_proc.v3.ExternalProcessor` handler.
#[derive(Debug, Clone)]
pub(crate) struct ExtProc(Arc<Gateway>);

/// Answers a stream's messages in order; bounded, so a proxy that stops
/// reading holds the stream's task, not memory.
const ANSWERS_QUEUED: usize = 16;

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// Counts a stream open while it lives.
struct OpenStream(prometheus::IntGauge);

impl OpenStream {
    fn new(gauge: &prometheus::IntGauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let gateway = self.0.clone();
        let deadline = tokio::time::Instant::now() + gateway.settings.request_timeout;
        let mut inbound = request.into_inner();
        let (out, answers) = mpsc::channel(ANSWERS_QUEUED);
        tokio::spawn(async move {
            let _open = OpenStream::new(&gateway.metrics.streams_open);
            let mut exchange = exchange::Exchange::new(gateway, out, deadline);
            // Ends when Envoy closes its side, the stream fails, or Envoy
            // stops taking answers; dropping the exchange releases any
            // booking still held.
            while let Ok(Some(message)) = inbound.message().await {
                if exchange.handle(message).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(answers))))
    }
}
