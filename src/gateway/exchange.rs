//! One ext_proc stream: one HTTP request through Envoy and its response.
//!
//! The request's headers come first; its body is read to its end (Envoy
//! sends it in `FULL_DUPLEX_STREAMED` mode), then the pick is made and
//! answered with one headers response and the body again. The response
//! passes through chunk by chunk: its first body chunk marks the booking's
//! prefill complete, its end releases the booking with the engine's
//! cached-token count, and a stream that ends any other way (the client
//! gone, Envoy resetting, an error) releases it when it is dropped. So no
//! mix of finished, failed and abandoned streams leaves load booked. The
//! booking itself is kept by a task of its own (`booking.rs`).
//!
//! Nothing a message holds can make the stream panic or hold more than
//! its body limit; messages out of order or repeated (Envoy resends a
//! large body's final chunk, envoy#46237) are counted and ignored.

use std::{collections::HashSet, sync::Arc, time::Instant};

use envoy_types::pb::{
    envoy::{
        config::core::v3::{HeaderMap, Metadata},
        service::ext_proc::v3::{ProcessingRequest, ProcessingResponse, processing_request},
    },
    google::protobuf::value::Kind,
};
use kvroute_prompt::OpenAiRequest;
use tokio::sync::mpsc;
use tonic::Status;

use super::{
    Gateway,
    body::{Body, Refused},
    booking::BookingHandle,
    pick::{self, Ask, Refusal},
    prompts::{Served, Tokens, tokenize},
    reply::{self, SUBSET_KEY, SUBSET_NAMESPACE},
    usage::CachedTokensScanner,
};
use crate::router::Admitted;

/// Where the stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Waiting for the request headers.
    Headers,
    /// Reading the request body.
    Body,
    /// Picked and answered; the response passes through.
    Routed,
    /// Answered by the picker itself; nothing more is done.
    Refused,
}

/// The stream's answers go out here; `Err` when Envoy is gone.
pub(super) type Out = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// Envoy stopped listening.
#[derive(Debug)]
pub(super) struct Gone;

/// One stream's state (see the module docs).
pub(super) struct Exchange {
    gateway: Arc<Gateway>,
    out: Out,
    deadline: tokio::time::Instant,
    stage: Stage,
    path: String,
    subset: Option<HashSet<String>>,
    body: Option<Body>,
    /// The last request body chunk, to recognise it resent.
    last_chunk_len: usize,
    booking: Option<BookingHandle>,
    response_status: Option<u16>,
    cached_tokens: CachedTokensScanner,
}

impl Exchange {
    pub(super) fn new(gateway: Arc<Gateway>, out: Out, deadline: tokio::time::Instant) -> Self {
        Self {
            gateway,
            out,
            deadline,
            stage: Stage::Headers,
            path: String::new(),
            subset: None,
            body: None,
            last_chunk_len: 0,
            booking: None,
            response_status: None,
            cached_tokens: CachedTokensScanner::default(),
        }
    }

    async fn send(&self, response: ProcessingResponse) -> Result<(), Gone> {
        self.out.send(Ok(response)).await.map_err(|_| Gone)
    }

    fn oddity(&self, what: &'static str) {
        self.gateway
            .metrics
            .protocol_oddities
            .with_label_values(&[what])
            .inc();
    }

    /// Answers with `refusal` and stops picking.
    async fn refuse(&mut self, refusal: Refusal) -> Result<(), Gone> {
        self.stage = Stage::Refused;
        self.body = None;
        self.gateway
            .metrics
            .requests
            .with_label_values(&[refusal.outcome])
            .inc();
        tracing::debug!(status = refusal.status, message = %refusal.message, "endpoint picker refused");
        self.send(reply::immediate(refusal.status, &refusal.message))
            .await
    }

    /// Handles one message from Envoy.
    pub(super) async fn handle(&mut self, message: ProcessingRequest) -> Result<(), Gone> {
        use processing_request::Request as R;
        let Some(request) = message.request else {
            self.oddity("empty_message");
            return Ok(());
        };
        match request {
            R::RequestHeaders(headers) => {
                if self.stage != Stage::Headers {
                    self.oddity("request_headers_again");
                    return Ok(());
                }
                self.request_headers(headers.headers.as_ref(), message.metadata_context.as_ref())
                    .await?;
                if self.stage == Stage::Body && headers.end_of_stream {
                    return self.pick_without_body().await;
                }
                Ok(())
            }
            R::RequestBody(chunk) => self.request_body(&chunk.body, chunk.end_of_stream).await,
            R::RequestTrailers(_) => {
                if self.stage == Stage::Body {
                    self.pick().await?;
                }
                if self.stage == Stage::Refused {
                    return Ok(());
                }
                self.send(reply::trailers(true)).await
            }
            R::ResponseHeaders(headers) => {
                if self.stage == Stage::Refused {
                    return Ok(());
                }
                self.response_status = headers
                    .headers
                    .as_ref()
                    .and_then(|h| header(h, ":status"))
                    .and_then(|s| s.parse().ok());
                self.send(reply::response_headers()).await?;
                if headers.end_of_stream {
                    self.response_ended();
                }
                Ok(())
            }
            R::ResponseBody(chunk) => {
                if self.stage == Stage::Refused {
                    return Ok(());
                }
                // The chunk goes back to Envoy before the booking hears of
                // it; the booking's own task does that work (booking.rs),
                // off the client's path. The cached-token scan reads it first.
                self.cached_tokens.feed(&chunk.body);
                let end = chunk.end_of_stream;
                self.send(reply::streamed(chunk.body, end, false)).await?;
                if let Some(booking) = &mut self.booking {
                    booking.first_response_bytes();
                }
                if end {
                    self.response_ended();
                }
                Ok(())
            }
            R::ResponseTrailers(_) => {
                if self.stage == Stage::Refused {
                    return Ok(());
                }
                self.send(reply::trailers(false)).await?;
                self.response_ended();
                Ok(())
            }
        }
    }

    async fn request_headers(
        &mut self,
        headers: Option<&HeaderMap>,
        metadata: Option<&Metadata>,
    ) -> Result<(), Gone> {
        self.path = headers
            .and_then(|h| header(h, ":path"))
            .unwrap_or_default()
            .to_owned();
        self.subset = match subset_hint(metadata) {
            Ok(subset) => subset,
            Err(why) => return self.refuse(Refusal::new(503, why)).await,
        };
        let limit = self.gateway.settings.max_body_bytes;
        let declared = headers
            .and_then(|h| header(h, "content-length"))
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|len| len > limit) {
            return self
                .refuse(Refusal::new(
                    413,
                    format!(
                        "body of {} bytes is over the limit of {limit}",
                        declared.unwrap_or(0)
                    ),
                ))
                .await;
        }
        self.stage = Stage::Body;
        self.body = Some(Body::new(limit, self.gateway.body_budget.clone()));
        Ok(())
    }

    async fn request_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Result<(), Gone> {
        match self.stage {
            Stage::Body => {}
            Stage::Routed => {
                let resent = self.last_chunk_len == chunk.len() || chunk.is_empty();
                self.oddity(if resent {
                    "final_chunk_resent"
                } else {
                    "body_after_pick"
                });
                return Ok(());
            }
            Stage::Headers => {
                self.oddity("body_before_headers");
                return Ok(());
            }
            Stage::Refused => return Ok(()),
        }
        let Some(body) = &mut self.body else {
            return Ok(());
        };
        match body.push(chunk) {
            Ok(()) => {}
            Err(Refused::TooLarge) => {
                let limit = self.gateway.settings.max_body_bytes;
                return self
                    .refuse(Refusal::new(
                        413,
                        format!("body is over the limit of {limit} bytes"),
                    ))
                    .await;
            }
            Err(Refused::Crowded) => {
                return self
                    .refuse(Refusal::new(
                        503,
                        "the picker holds as many bodies as it may",
                    ))
                    .await;
            }
        }
        if !chunk.is_empty() {
            self.last_chunk_len = chunk.len();
        }
        if end_of_stream {
            self.pick().await?;
        }
        Ok(())
    }

    /// A request without a body names no model: routed by load to any
    /// reachable worker (a `GET /v1/models`, say).
    async fn pick_without_body(&mut self) -> Result<(), Gone> {
        self.body = None;
        let workers: Vec<_> = self
            .gateway
            .core
            .workers(None)
            .into_iter()
            .map(|w| w.snapshot())
            .collect();
        let reachable: Vec<_> = pick::reachable(&workers, self.subset.as_ref())
            .map(|(_, address)| address.to_owned())
            .collect();
        if reachable.is_empty() {
            return self
                .refuse(Refusal::new(503, "no worker with an HTTP endpoint"))
                .await;
        }
        let at = rand::random_range(0..reachable.len());
        let destination = reply::Destination {
            endpoints: vec![reachable[at].clone()],
            dp_rank: None,
        };
        self.stage = Stage::Routed;
        self.gateway
            .metrics
            .requests
            .with_label_values(&["routed"])
            .inc();
        self.send(reply::routed(&destination, None)).await
    }

    /// The body is whole: read it, pick, answer.
    async fn pick(&mut self) -> Result<(), Gone> {
        let Some(body) = self.body.take() else {
            return Ok(());
        };
        let gateway = self.gateway.clone();
        #[allow(clippy::disallowed_methods)] // how long the work took, not a deadline
        let started = Instant::now();
        // Parsing, templates and tokenizers are CPU work, and a parsed body
        // takes several times its size: off the runtime's threads, one per
        // core at a time. The permit goes with the work: released when it
        // ends, even if this stream is gone by then.
        let Ok(permit) = gateway.tokenizing.clone().acquire_owned().await else {
            return self.refuse(Refusal::new(503, "shutting down")).await;
        };
        gateway.time("wait", started);
        let (path, worker) = (self.path.clone(), gateway.clone());
        let prepared = tokio::task::spawn_blocking(move || {
            let read = read_and_tokenize(&worker, &path, &body);
            drop(permit);
            (body, read)
        })
        .await;
        let (body, request, served, tokens) = match prepared {
            Ok((body, Ok((request, served, tokens)))) => (body, request, served, tokens),
            Ok((_, Err(refusal))) => return self.refuse(refusal).await,
            Err(_) => {
                return self
                    .refuse(Refusal::new(503, "tokenization did not finish"))
                    .await;
            }
        };
        match &tokens {
            Tokens::ByLoad(reason) => gateway
                .metrics
                .untokenized
                .with_label_values(&[reason])
                .inc(),
            Tokens::Ids { ids, cached } => {
                let tokens = &gateway.metrics.prompt_tokens;
                tokens.with_label_values(&["cached"]).inc_by(*cached);
                tokens
                    .with_label_values(&["tokenized"])
                    .inc_by((ids.len() as u64).saturating_sub(*cached));
            }
        }
        #[allow(clippy::disallowed_methods)]
        let started = Instant::now();
        let view = gateway.core.model_view(&served.base);
        let ask = Ask {
            request_id: gateway.next_request_id(),
            model: &served.base,
            lora_name: served.lora_name.as_deref(),
            cache_salt: request.cache_salt.as_deref(),
            tokens: &tokens,
            untokenized_tokens: (body.len() / 4) as u64,
            admission: gateway.settings.admission,
            max_blocks: gateway.settings.max_blocks,
        };
        let Some(prepared) = pick::prepare(&ask, &view, self.subset.as_ref()) else {
            let message = match &self.subset {
                Some(_) => format!(
                    "no worker of model {:?} in the proxy's endpoint subset",
                    served.base
                ),
                None => format!("no worker of model {:?} has an HTTP endpoint", served.base),
            };
            return self.refuse(Refusal::new(503, message)).await;
        };
        let request_id = prepared.request.request_id.clone();
        let outcome = match gateway.core.route(&view, prepared, self.deadline).await {
            Ok(outcome) => outcome,
            Err(error) => return self.refuse(error.into()).await,
        };
        let booking = (outcome.admitted != Admitted::Untracked)
            .then(|| BookingHandle::start(gateway.clone(), gateway.core.clone(), request_id));
        let Some(destination) = pick::destination(
            &outcome.selection,
            &view,
            self.subset.as_ref(),
            gateway.settings.fallbacks,
        ) else {
            drop(booking);
            return self
                .refuse(Refusal::new(503, "the chosen worker has no HTTP endpoint"))
                .await;
        };
        gateway.time("select", started);
        self.booking = booking;
        self.stage = Stage::Routed;
        gateway
            .metrics
            .requests
            .with_label_values(&["routed"])
            .inc();
        tracing::debug!(
            endpoint = %destination.joined(),
            dp_rank = ?destination.dp_rank,
            overlap = outcome.selection.overlap_blocks,
            "endpoint picked"
        );
        self.send(reply::routed(&destination, Some(body.len())))
            .await?;
        for chunk in reply::body_chunks(body.bytes()) {
            self.send(chunk).await?;
        }
        Ok(())
    }

    /// The response is over: the booking is released, with the engine's
    /// cached-token count when it answered well.
    fn response_ended(&mut self) {
        let succeeded = self
            .response_status
            .is_some_and(|s| (200..300).contains(&s));
        if let Some(booking) = self.booking.take() {
            let cached = succeeded
                .then(|| self.cached_tokens.cached_tokens())
                .flatten();
            booking.release(if succeeded { "finished" } else { "failed" }, cached);
        }
    }
}

/// The body read as an OpenAI request, its model resolved and its prompt
/// tokenized, each part timed (on a blocking thread).
fn read_and_tokenize(
    gateway: &Gateway,
    path: &str,
    body: &Body,
) -> Result<(OpenAiRequest, Served, Tokens), Refusal> {
    #[allow(clippy::disallowed_methods)] // how long the work took, not a deadline
    let started = Instant::now();
    let request = pick::read_body(path, body.bytes())?;
    gateway.time("parse", started);
    let served = gateway.prompts.resolve(&request.model);
    #[allow(clippy::disallowed_methods)]
    let started = Instant::now();
    let tokens = tokenize(served.tokenizer.as_deref(), &request)?;
    gateway.time("tokenize", started);
    Ok((request, served, tokens))
}

/// A header's value (`raw_value` as Envoy sends it, or `value`).
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .and_then(|h| {
            if h.raw_value.is_empty() {
                Some(h.value.as_str())
            } else {
                std::str::from_utf8(&h.raw_value).ok()
            }
        })
}

/// The proxy's subset hint: `None` when it gave none; an error when it is
/// not a list of strings.
fn subset_hint(metadata: Option<&Metadata>) -> Result<Option<HashSet<String>>, &'static str> {
    let Some(hint) = metadata
        .and_then(|m| m.filter_metadata.get(SUBSET_NAMESPACE))
        .and_then(|ns| ns.fields.get(SUBSET_KEY))
    else {
        return Ok(None);
    };
    let Some(Kind::ListValue(list)) = &hint.kind else {
        return Err("the endpoint subset hint is not a list");
    };
    list.values
        .iter()
        .map(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Ok(s.trim().to_owned()),
            _ => Err("an endpoint subset entry is not a string"),
        })
        .collect::<Result<HashSet<_>, _>>()
        .map(Some)
}
