//! The soak's frontends: SelectWorker RESERVE, MarkPrefillComplete and
//! ReleaseRequest on trace prompts.

use super::*;

/// A frontend: books trace prompts, marks their prefill complete at once
/// and releases each after a few more bookings.
pub(super) struct Frontend {
    pub(super) index: usize,
    pub(super) router: RouterClient<Channel>,
    pub(super) prompts: Arc<Vec<Vec<u64>>>,
    pub(super) trace: Arc<Trace>,
    pub(super) tally: Arc<Tally>,
    pub(super) tokens_every: u64,
}

impl Frontend {
    pub(super) async fn run(mut self, period: Duration, stop: CancellationToken) {
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut booked: VecDeque<String> = VecDeque::new();
        let count = self.prompts.len().max(1);
        let mut n: u64 = 0;
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = ticker.tick() => {}
            }
            let i = (self.index * 7919 + n as usize * 31) % count;
            let content = match (self.tokens_every, self.trace.records.get(i)) {
                (every, Some(record)) if every > 0 && n.is_multiple_of(every) => {
                    pb::prompt::Content::TokenIds(pb::TokenIds {
                        ids: record.tokens(),
                    })
                }
                _ => pb::prompt::Content::BlockHashes(pb::BlockHashes {
                    hashes: self.prompts.get(i).cloned().unwrap_or_default(),
                }),
            };
            let request_id = format!("soak-{}-{n}", self.index);
            n += 1;
            let request = pb::SelectWorkerRequest {
                request_id: request_id.clone(),
                model: MODEL.into(),
                prompt: Some(pb::Prompt {
                    content: Some(content),
                }),
                mode: pb::SelectionMode::Reserve.into(),
                ..Default::default()
            };
            let started = Instant::now();
            match self.router.select_worker(request).await {
                Ok(_) => {
                    self.tally.latency(started.elapsed());
                    self.mark(&request_id).await;
                    booked.push_back(request_id);
                }
                Err(status) => self.tally.status("SelectWorker", &status, false),
            }
            while booked.len() > BOOKED_DEPTH {
                if let Some(id) = booked.pop_front() {
                    self.release(id).await;
                }
            }
        }
        for id in booked {
            self.release(id).await;
        }
    }

    pub(super) async fn mark(&mut self, request_id: &str) {
        let request = pb::MarkPrefillCompleteRequest {
            request_id: request_id.to_string(),
            cached_tokens: None,
        };
        if let Err(status) = self.router.mark_prefill_complete(request).await {
            self.tally.status("MarkPrefillComplete", &status, false);
        }
    }

    pub(super) async fn release(&mut self, request_id: String) {
        let request = pb::ReleaseRequestRequest {
            request_id,
            cached_tokens: None,
        };
        if let Err(status) = self.router.release_request(request).await {
            self.tally.status("ReleaseRequest", &status, false);
        }
    }
}
