//! `kvroute ctl worker ID`: one worker in full, its fields and then a row
//! per dp rank. Its JSON (`--json`, and `workers` and `cordon`) is the
//! server's `grpc::json::worker_json`, which the web view serves too.

use kvroute::pb;

pub(super) use kvroute::grpc::json::{booked_of, worker_json};

use super::{
    client::Admin,
    error::CtlError,
    format::{kv_events_name, lease_text, rank_range, role_name, yes_no},
    output::Output,
    table::Table,
};

/// Shows worker `id`.
pub(super) async fn show(admin: &mut Admin, id: u64, output: Output<'_>) -> Result<(), CtlError> {
    let info = admin
        .get_worker(pb::GetWorkerRequest { worker_id: id })
        .await?
        .into_inner();
    output.print(|| worker_json(&info), || worker_detail(&info))
}

/// The worker's fields, a blank line, then its ranks.
pub(super) fn worker_detail(w: &pb::WorkerInfo) -> String {
    format!("{}\n{}", fields_text(w), ranks_table(w))
}

/// The worker's fields as a key/value list.
fn fields_text(w: &pb::WorkerInfo) -> String {
    let mut fields = Table::new(&[("", false), ("", false)]);
    let mut field = |name: &'static str, value: String| fields.row(vec![name.into(), value]);
    field("worker", w.worker_id.to_string());
    field("model", w.model.clone());
    field("role", role_name(w.role()).into());
    field("endpoint", dash_if_empty(&w.endpoint));
    field("block size", w.block_size.to_string());
    field("dp ranks", rank_range(w));
    field("kv blocks/rank", w.total_kv_blocks.to_string());
    field("batch tokens", w.max_num_batched_tokens.to_string());
    field(
        "taints",
        if w.taints.is_empty() {
            "-".into()
        } else {
            w.taints.join(",")
        },
    );
    field(
        "adapters",
        if w.adapters.is_empty() {
            "-".into()
        } else {
            let served = w
                .adapters
                .iter()
                .map(|a| format!("{}={}", a.id, a.name))
                .collect::<Vec<_>>()
                .join(",");
            if w.loads_adapters {
                format!("{served} (loads others on request)")
            } else {
                served
            }
        },
    );
    field("lease left", lease_text(w.lease_remaining_ms));
    field("cordoned", yes_no(w.cordoned).into());
    field("kv events", kv_events_name(w.kv_events()).into());
    field("scored on", w.cache_view_reason.clone());
    field(
        "cached-token reports",
        match &w.cached_tokens_feedback {
            None => "-".into(),
            Some(f) => format!(
                "{}, mean error {:+.0} tokens, mean |error| {:.0}, index error {:.1} blocks{}",
                f.reports,
                f.mean_error_tokens,
                f.mean_abs_error_tokens,
                f.index_error_blocks,
                if f.contradicted { ", contradicted" } else { "" }
            ),
        },
    );
    field("subscription", dash_if_empty(&w.subscription));
    fields.render_rows()
}

fn dash_if_empty(text: &str) -> String {
    if text.is_empty() {
        "-".into()
    } else {
        text.to_string()
    }
}

/// A row per dp rank: the load its engine reports, what it caches and what
/// is booked on it.
fn ranks_table(w: &pb::WorkerInfo) -> String {
    let mut ranks = Table::new(&[
        ("RANK", true),
        ("RUNNING", true),
        ("WAITING", true),
        ("KV USED", true),
        ("CACHED", true),
        ("PREDICTED", true),
        ("BOOKED REQS", true),
        ("PREFILL TOKENS", true),
        ("DECODE BLOCKS", true),
        ("LAST EVENT", true),
        ("SKIPPED", true),
        ("REJECTED", true),
    ]);
    for r in &w.ranks {
        let load = r.reported_load.unwrap_or_default();
        let booked = r.booked_load.unwrap_or_default();
        ranks.row(vec![
            r.dp_rank.to_string(),
            load.running_requests.to_string(),
            load.waiting_requests.to_string(),
            load.kv_blocks_used.to_string(),
            r.cached_blocks.to_string(),
            r.predicted_blocks.to_string(),
            booked.active_requests.to_string(),
            booked.prefill_tokens.to_string(),
            booked.decode_blocks.to_string(),
            r.last_event_id.to_string(),
            r.events_skipped.to_string(),
            r.events_rejected.to_string(),
        ]);
    }
    ranks.render()
}
