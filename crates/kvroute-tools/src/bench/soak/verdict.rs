//! The end of the soak: the server's index against the reference fed
//! the accepted events, and the verdict on memory, p99 and errors.

use super::*;

/// The end-of-run comparison of the server's index with the reference.
pub(super) struct IndexCheck {
    pub(super) server_blocks: u64,
    pub(super) reference_blocks: u64,
    pub(super) server_digest: u64,
    pub(super) reference_digest: u64,
    pub(super) mismatches: Vec<String>,
}

/// Deregisters every soak worker (NOT_FOUND for one already gone is fine).
pub(super) async fn deregister_all(channel: &Channel, slots: &[Arc<WorkerSlot>]) {
    let mut workers = WorkersClient::new(channel.clone());
    for slot in slots {
        let _ = workers
            .deregister_worker(pb::DeregisterWorkerRequest { worker_id: slot.id })
            .await;
    }
}

pub(super) async fn compare(
    channel: &Channel,
    slots: &[Arc<WorkerSlot>],
    reference: &KvIndex,
) -> Result<IndexCheck, BenchError> {
    let mut admin = AdminClient::new(channel.clone());
    let mut workers = WorkersClient::new(channel.clone());
    let mut mismatches = Vec::new();
    for slot in slots {
        let worker_id = slot.id;
        // Keep every lease alive while the check runs.
        let _ = workers
            .heartbeat(pb::HeartbeatRequest {
                worker_id,
                load: Vec::new(),
            })
            .await;
        let want = reference.worker_blocks(WorkerRank::new(worker_id, 0));
        match admin.get_worker(pb::GetWorkerRequest { worker_id }).await {
            Ok(info) => {
                let have: u64 = info
                    .into_inner()
                    .ranks
                    .iter()
                    .map(|r| r.cached_blocks)
                    .sum();
                if have != want {
                    mismatches.push(format!("worker {worker_id}: server {have} vs {want}"));
                }
            }
            Err(status) if status.code() == tonic::Code::NotFound && want == 0 => {}
            Err(status) => {
                mismatches.push(format!("worker {worker_id}: {}", status.message()));
            }
        }
    }
    let stats = admin
        .get_index_stats(pb::GetIndexStatsRequest {
            model: Some(MODEL.into()),
        })
        .await?
        .into_inner();
    let reference_stats = reference.stats();
    let digest = reference.digest();
    if stats.blocks != reference_stats.blocks {
        mismatches.push(format!(
            "blocks: server {} vs {}",
            stats.blocks, reference_stats.blocks
        ));
    }
    if stats.digest != digest.digest || stats.entries != digest.entries {
        mismatches.push(format!(
            "digest: server {:#x} ({} entries) vs {:#x} ({})",
            stats.digest, stats.entries, digest.digest, digest.entries
        ));
    }
    Ok(IndexCheck {
        server_blocks: stats.blocks,
        reference_blocks: reference_stats.blocks,
        server_digest: stats.digest,
        reference_digest: digest.digest,
        mismatches,
    })
}

/// The mean p99 (as `p99_of` reads it) of the first and of the last
/// [`P99_WINDOW`] intervals of `after`, and the relative rise between them.
pub(super) fn p99_window_drift(
    after: &[IntervalReport],
    p99_of: impl Fn(&IntervalReport) -> Option<f64>,
) -> (Option<f64>, Option<f64>, Option<f64>) {
    if after.len() < 2 {
        return (None, None, None);
    }
    let mean = |window: &[IntervalReport]| {
        let values: Vec<f64> = window.iter().filter_map(&p99_of).collect();
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
    };
    let window = P99_WINDOW.min(after.len() / 2).max(1);
    let first = mean(&after[..window]);
    let last = mean(&after[after.len() - window..]);
    (first, last, rise(first, last))
}

/// `last` over `first`, minus 1, when both are known and `first` is positive.
pub(super) fn rise(first: Option<f64>, last: Option<f64>) -> Option<f64> {
    match (first, last) {
        (Some(first), Some(last)) if first > 0.0 => Some(last / first - 1.0),
        _ => None,
    }
}

/// The verdict. Warm-up is the first `warmup` intervals (the index fills).
/// Memory is flat when the mean of the last third of the interval medians
/// after warm-up is within 5 % of the middle third's: a leak keeps growing
/// to the end, while pools and maps that grow to the run's peaks (the heap
/// rose 11 % over the 4 minutes after a 3-minute warm-up, then held for the
/// rest of a 30-minute run) settle in the first third. p99 drift compares
/// the mean p99 of the last three intervals with the first three after
/// warm-up, as the server timed SelectWorker when that is known for every
/// interval after warm-up (`crate::bench::histogram` says why), else as the
/// clients saw it.
/// A check without enough intervals is not judged (None) and does not fail
/// the run.
pub(super) fn judge(
    intervals: &[IntervalReport],
    warmup: usize,
    designed_errors: BTreeMap<String, u64>,
    unexpected_errors: BTreeMap<String, u64>,
    check: IndexCheck,
) -> SoakVerdict {
    let after = intervals.get(warmup..).unwrap_or_default();
    let (rss_middle_bytes, rss_last_bytes, rss_growth) =
        thirds_growth(after, |r| r.rss_median_bytes);
    let (heap_middle_bytes, heap_last_bytes, heap_growth) =
        thirds_growth(after, |r| r.heap_median_bytes);
    let rss_peak_bytes = after.iter().filter_map(|r| r.rss_peak_bytes).max();
    let heap_counted = !after.is_empty() && after.iter().all(|r| r.heap_median_bytes.is_some());
    let (memory_source, growth) = if heap_counted {
        ("heap", heap_growth)
    } else {
        ("rss", rss_growth)
    };
    let memory_flat = growth.map(|g| g <= MEMORY_TOLERANCE);
    let server_p99 = |r: &IntervalReport| r.server_select.map(|s| s.p99_us);
    let client_p99 = |r: &IntervalReport| (r.select_calls > 0).then_some(r.select.p99_us);
    let client_drift = p99_window_drift(after, client_p99);
    let server_timed = !after.is_empty() && after.iter().all(|r| server_p99(r).is_some());
    let (p99_source, (p99_first_us, p99_last_us, p99_drift)) = if server_timed {
        ("server", p99_window_drift(after, server_p99))
    } else {
        ("client", client_drift)
    };
    // Only a rise fails: a p99 that fell is no regression (it is printed).
    let p99_stable = p99_drift.map(|d| d <= P99_TOLERANCE);
    let index_exact = check.mismatches.is_empty();
    let pass = index_exact
        && unexpected_errors.is_empty()
        && memory_flat != Some(false)
        && p99_stable != Some(false);
    SoakVerdict {
        bench: "soak-verdict",
        intervals: intervals.len(),
        warmup_intervals: warmup,
        rss_middle_bytes,
        rss_last_bytes,
        rss_growth,
        rss_peak_bytes,
        heap_middle_bytes,
        heap_last_bytes,
        heap_growth,
        memory_source,
        memory_flat,
        heap_before_bytes: None,
        heap_after_bytes: None,
        heap_left_bytes: None,
        heap_returned: None,
        p99_source,
        p99_first_us,
        p99_last_us,
        p99_drift,
        p99_stable,
        client_p99_drift: client_drift.2,
        designed_errors,
        unexpected_errors,
        server_blocks: check.server_blocks,
        reference_blocks: check.reference_blocks,
        server_digest: check.server_digest,
        reference_digest: check.reference_digest,
        index_mismatches: check.mismatches,
        index_exact,
        pass,
    }
}

/// The means of `of` over the middle and the last third of `after` (at
/// least one interval each), and the growth from one to the other; `None`
/// with fewer than three intervals or a value missing.
pub(super) fn thirds_growth(
    after: &[IntervalReport],
    of: impl Fn(&IntervalReport) -> Option<u64>,
) -> (Option<u64>, Option<u64>, Option<f64>) {
    let third = after.len() / 3;
    if third == 0 {
        return (None, None, None);
    }
    let mean = |part: &[IntervalReport]| -> Option<u64> {
        let values: Option<Vec<u64>> = part.iter().map(&of).collect();
        let values = values?;
        Some(values.iter().sum::<u64>() / values.len() as u64)
    };
    let middle = mean(&after[third..2 * third]);
    let last = mean(&after[after.len() - third..]);
    let as_f64 = |bytes: Option<u64>| bytes.map(|b| b as f64);
    (middle, last, rise(as_f64(middle), as_f64(last)))
}

impl SoakVerdict {
    /// Judges what the run left on the heap once its workers were gone; a
    /// check without both readings is not judged and does not fail.
    pub(super) fn judge_heap_left(&mut self, before: Option<u64>, after: Option<u64>) {
        self.heap_before_bytes = before;
        self.heap_after_bytes = after;
        self.heap_left_bytes = match (before, after) {
            (Some(b), Some(a)) => Some(a as i64 - b as i64),
            _ => None,
        };
        self.heap_returned = self.heap_left_bytes.map(|left| left <= HEAP_LEFT_TOLERANCE);
        self.pass &= self.heap_returned != Some(false);
    }
}
