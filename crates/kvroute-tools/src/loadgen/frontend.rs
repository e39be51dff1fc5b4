//! The load generator as a frontend of kvroute: what a team's own
//! frontend does without the front door.
//!
//! For each request: `SelectWorker` (RESERVE) with the prompt's token ids,
//! the streamed completion to the engine it names (with its data-parallel
//! rank in `x-data-parallel-rank` when the worker has several),
//! `MarkPrefillComplete` when the first token arrives, and `ReleaseRequest`
//! when the stream ends, however it ends. Token ids are the mock engine's
//! word tokenization (`text::word_ids`): this mode pairs with mock engines
//! run without `--tokenizer`.

use std::{collections::HashMap, net::SocketAddr, time::Duration};

use anyhow::{Context, bail};
use kvroute::pb;
use tokio::sync::oneshot;
use tonic::transport::Channel;

use super::{address, http, text};

/// A kvroute to ask, and the engines of its workers.
pub(super) struct Frontend {
    router: pb::router_client::RouterClient<Channel>,
    model: String,
    /// Worker id -> (its index among the engines, its address, its ranks).
    workers: HashMap<u64, (usize, SocketAddr, u32)>,
    engines: Vec<SocketAddr>,
}

impl Frontend {
    /// Connects and reads the workers of `model` with an HTTP endpoint.
    pub(super) async fn connect(url: &str, model: &str) -> anyhow::Result<Self> {
        let uri = if url.starts_with("http://") {
            url.to_owned()
        } else {
            format!("http://{url}")
        };
        let channel = Channel::from_shared(uri)?
            .connect()
            .await
            .with_context(|| format!("connecting to kvroute at {url}"))?;
        let listed = pb::admin_client::AdminClient::new(channel.clone())
            .list_workers(pb::ListWorkersRequest {
                model: Some(model.to_owned()),
            })
            .await?
            .into_inner();
        let mut workers = HashMap::new();
        let mut engines = Vec::new();
        for worker in listed.workers {
            let Ok(addr) = address(&worker.endpoint) else {
                continue;
            };
            workers.insert(worker.worker_id, (engines.len(), addr, worker.dp_size));
            engines.push(addr);
        }
        if engines.is_empty() {
            bail!("kvroute at {url} knows no worker of {model:?} with an HTTP endpoint");
        }
        Ok(Self {
            router: pb::router_client::RouterClient::new(channel),
            model: model.to_owned(),
            workers,
            engines,
        })
    }

    /// The engines, in the order of their index.
    pub(super) fn engines(&self) -> Vec<SocketAddr> {
        self.engines.clone()
    }

    /// One request through kvroute and the engine it picks: (that engine's
    /// index, the answer).
    pub(super) async fn serve(
        &self,
        request_id: &str,
        prompt: &str,
        body: &[u8],
        timeout: Duration,
    ) -> (
        usize,
        Result<anyhow::Result<http::Streamed>, tokio::time::error::Elapsed>,
    ) {
        let select = pb::SelectWorkerRequest {
            request_id: request_id.to_owned(),
            model: self.model.clone(),
            prompt: Some(pb::Prompt {
                content: Some(pb::prompt::Content::TokenIds(pb::TokenIds {
                    ids: text::word_ids(prompt),
                })),
            }),
            ..Default::default()
        };
        let selected = match self.router.clone().select_worker(select).await {
            Ok(answer) => answer.into_inner(),
            Err(status) => {
                let error = anyhow::anyhow!("SelectWorker: {}", status.message());
                return (0, Ok(Err(error)));
            }
        };
        let Some(&(engine, addr, dp_size)) = self.workers.get(&selected.worker_id) else {
            self.release(request_id).await;
            let error = anyhow::anyhow!(
                "kvroute picked worker {} it did not list",
                selected.worker_id
            );
            return (0, Ok(Err(error)));
        };
        let headers = if dp_size > 1 {
            vec![(
                "x-data-parallel-rank".to_owned(),
                selected.dp_rank.to_string(),
            )]
        } else {
            Vec::new()
        };
        let (first_token, first) = oneshot::channel();
        let mut router = self.router.clone();
        let prefill_id = request_id.to_owned();
        let prefill = tokio::spawn(async move {
            if first.await.is_ok() {
                let _ = router
                    .mark_prefill_complete(pb::MarkPrefillCompleteRequest {
                        request_id: prefill_id,
                        cached_tokens: None,
                    })
                    .await;
            }
        });
        let streamed =
            http::post_streaming(addr, "/v1/completions", &headers, body, Some(first_token));
        let answer = tokio::time::timeout(timeout, streamed).await;
        let _ = prefill.await;
        self.release(request_id).await;
        (engine, answer)
    }

    async fn release(&self, request_id: &str) {
        let _ = self
            .router
            .clone()
            .release_request(pb::ReleaseRequestRequest {
                request_id: request_id.to_owned(),
                cached_tokens: None,
            })
            .await;
    }
}
