//! How values are spelled in `ctl`'s tables and JSON: the names of the
//! protocol's enums, durations, sizes and rank ranges. One spelling for
//! every sub-command that shows the same value.

use kvroute::pb;

// The names of roles, KV event modes and cache views are the server's,
// so `ctl`'s JSON and the web view spell them alike.
pub(super) use kvroute::grpc::json::{kv_events_name, role_name, view_name};

pub(super) fn reason_name(reason: pb::IneligibleReason) -> &'static str {
    match reason {
        pb::IneligibleReason::None => "-",
        pb::IneligibleReason::Cordoned => "cordoned",
        pb::IneligibleReason::NotAllowed => "not allowed",
        pb::IneligibleReason::Taint => "taint",
        pb::IneligibleReason::Excluded => "excluded",
        pb::IneligibleReason::Role => "role",
        pb::IneligibleReason::PinnedElsewhere => "pinned elsewhere",
        pb::IneligibleReason::Adapter => "adapter",
    }
}

pub(super) fn admission_name(admission: pb::AdmissionResult) -> &'static str {
    match admission {
        pb::AdmissionResult::Unspecified => "unspecified",
        pb::AdmissionResult::Admitted => "admitted",
        pb::AdmissionResult::AdmittedAfterQueue => "admitted after queue",
        pb::AdmissionResult::Untracked => "untracked",
    }
}

pub(super) fn yes_no(flag: bool) -> &'static str {
    if flag { "yes" } else { "no" }
}

/// `0` for one rank, `0-3` for several.
pub(super) fn rank_range(info: &pb::WorkerInfo) -> String {
    let last = info
        .dp_start_rank
        .saturating_add(info.dp_size.saturating_sub(1));
    if info.dp_size <= 1 {
        info.dp_start_rank.to_string()
    } else {
        format!("{}-{last}", info.dp_start_rank)
    }
}

/// Milliseconds as seconds with one decimal (`9.8s`).
/// A per-tier count as `ctl`'s JSON spells it (`null` when the server
/// sent none).
pub(super) fn tiers_json(tiers: Option<&pb::BlocksByTier>) -> serde_json::Value {
    tiers.map_or(serde_json::Value::Null, |t| {
        serde_json::json!({
            "device": t.device,
            "host": t.host,
            "storage": t.storage,
            "external": t.external,
        })
    })
}

pub(super) fn lease_text(ms: u64) -> String {
    format!("{}.{}s", ms / 1000, (ms % 1000) / 100)
}

pub(super) fn bytes_text(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_formats() {
        assert_eq!(lease_text(9_876), "9.8s");
        assert_eq!(lease_text(0), "0.0s");
        assert_eq!(bytes_text(10), "10 B");
        assert_eq!(bytes_text(3 * 1024 * 1024), "3.0 MiB");
        let info = pb::WorkerInfo {
            dp_start_rank: 2,
            dp_size: 4,
            ..Default::default()
        };
        assert_eq!(rank_range(&info), "2-5");
    }
}
