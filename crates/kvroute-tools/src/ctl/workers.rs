//! `kvroute ctl workers`: every registered worker on one line each, the
//! overview an operator starts from; `cordon` shows its worker the same way.

use serde_json::json;

use kvroute::pb;

use super::{
    client::Admin,
    error::CtlError,
    format::{lease_text, rank_range, role_name, view_name, yes_no},
    output::Output,
    table::Table,
    worker::{booked_of, worker_json},
};

/// Lists the workers, of `model` only when given.
pub(super) async fn list(
    admin: &mut Admin,
    model: Option<String>,
    output: Output<'_>,
) -> Result<(), CtlError> {
    let reply = admin
        .list_workers(pb::ListWorkersRequest { model })
        .await?
        .into_inner();
    output.print(
        || json!({ "workers": reply.workers.iter().map(worker_json).collect::<Vec<_>>() }),
        || workers_table(&reply.workers),
    )
}

/// A line per worker, or a sentence when there is none.
pub(super) fn workers_table(workers: &[pb::WorkerInfo]) -> String {
    if workers.is_empty() {
        return "no workers registered\n".into();
    }
    let mut table = Table::new(&[
        ("ID", true),
        ("MODEL", false),
        ("ROLE", false),
        ("RANKS", false),
        ("VIEW", false),
        ("BLOCKS", true),
        ("BOOKED", true),
        ("LEASE LEFT", true),
        ("CORDONED", false),
    ]);
    for w in workers {
        // The blocks of the view it is scored on.
        let blocks: u64 = w
            .ranks
            .iter()
            .map(|r| match w.cache_view() {
                pb::CacheView::Predicted => r.predicted_blocks,
                _ => r.cached_blocks,
            })
            .sum();
        table.row(vec![
            w.worker_id.to_string(),
            w.model.clone(),
            role_name(w.role()).into(),
            rank_range(w),
            view_name(w.cache_view()).into(),
            blocks.to_string(),
            booked_of(w).active_requests.to_string(),
            lease_text(w.lease_remaining_ms),
            yes_no(w.cordoned).into(),
        ]);
    }
    table.render()
}
