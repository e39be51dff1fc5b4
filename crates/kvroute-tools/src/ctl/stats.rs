//! `kvroute ctl stats`: the KV index's totals, of one model or of all,
//! to see how much the router holds and how its event stream is doing.

use serde_json::{Value, json};

use kvroute::pb;

use super::{client::Admin, error::CtlError, format::bytes_text, output::Output, table::Table};

/// Shows the index statistics, of `model` only when given.
pub(super) async fn show(
    admin: &mut Admin,
    model: Option<String>,
    output: Output<'_>,
) -> Result<(), CtlError> {
    let stats = admin
        .get_index_stats(pb::GetIndexStatsRequest { model })
        .await?
        .into_inner();
    output.print(|| stats_json(&stats), || stats_text(&stats))
}

/// The totals as a key/value list, numbers right-aligned.
pub(super) fn stats_text(s: &pb::IndexStats) -> String {
    let mut table = Table::new(&[("", false), ("", true)]);
    for (name, value) in [
        ("blocks", s.blocks.to_string()),
        ("nodes", s.nodes.to_string()),
        ("workers", s.workers.to_string()),
        ("events applied", s.events_applied.to_string()),
        ("events skipped", s.events_skipped.to_string()),
        ("events rejected", s.events_rejected.to_string()),
        ("memory", bytes_text(s.memory_bytes)),
        ("entries", s.entries.to_string()),
        ("digest", format!("{:016x}", s.digest)),
    ] {
        table.row(vec![name.into(), value]);
    }
    table.render_rows()
}

/// The totals as `--json` prints them.
pub(super) fn stats_json(s: &pb::IndexStats) -> Value {
    json!({
        "blocks": s.blocks,
        "nodes": s.nodes,
        "workers": s.workers,
        "events_applied": s.events_applied,
        "events_skipped": s.events_skipped,
        "events_rejected": s.events_rejected,
        "memory_bytes": s.memory_bytes,
        "entries": s.entries,
        "digest": format!("{:016x}", s.digest),
    })
}
