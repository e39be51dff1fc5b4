//! `kvroute ctl stats`: the KV index's totals, of one model or of all,
//! to see how much the router holds (by cache tier) and how its event
//! stream is doing.

use serde_json::{Value, json};

use kvroute::pb;

use super::{
    client::Admin,
    error::CtlError,
    format::{bytes_text, tiers_json},
    output::Output,
    table::Table,
};

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
        (
            "entries by tier",
            tiers_text(s.blocks_by_tier.unwrap_or_default()),
        ),
        ("placeholders unresolved", s.blocks_unresolved.to_string()),
        ("evicted to tier capacity", s.blocks_evicted.to_string()),
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
        "entries_by_tier": tiers_json(Some(&s.blocks_by_tier.unwrap_or_default())),
        "blocks_unresolved": s.blocks_unresolved,
        "blocks_evicted": s.blocks_evicted,
        "digest": format!("{:016x}", s.digest),
    })
}

/// `device 10, host 4`: the tiers holding any entry (`device 0` if none).
fn tiers_text(t: pb::BlocksByTier) -> String {
    let parts: Vec<String> = [
        ("device", t.device),
        ("host", t.host),
        ("storage", t.storage),
        ("external", t.external),
    ]
    .into_iter()
    .filter(|&(name, n)| n > 0 || name == "device")
    .map(|(name, n)| format!("{name} {n}"))
    .collect();
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_show_entries_by_tier_and_the_tier_counters() {
        let stats = pb::IndexStats {
            entries: 14,
            blocks_by_tier: Some(pb::BlocksByTier {
                device: 10,
                host: 4,
                storage: 0,
                external: 0,
            }),
            blocks_unresolved: 3,
            blocks_evicted: 2,
            ..Default::default()
        };
        let text = stats_text(&stats);
        assert!(text.contains("device 10, host 4"), "{text}");
        assert!(!text.contains("storage"), "{text}");
        let line = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .map(|l| l.split_whitespace().last().unwrap_or("").to_string())
        };
        assert_eq!(line("placeholders unresolved").as_deref(), Some("3"));
        assert_eq!(line("evicted to tier capacity").as_deref(), Some("2"));
        let json = stats_json(&stats);
        assert_eq!(json["entries_by_tier"]["host"], 4);
        assert_eq!(json["blocks_unresolved"], 3);
        assert_eq!(json["blocks_evicted"], 2);
        assert_eq!(tiers_text(pb::BlocksByTier::default()), "device 0");
    }
}
