//! The soak's lines for people: one per interval and the verdict.

use super::*;

pub(super) fn mib(bytes: Option<u64>) -> String {
    bytes.map_or_else(
        || "?".into(),
        |b| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0)),
    )
}

pub(super) fn percent(fraction: Option<f64>) -> String {
    fraction.map_or_else(|| "?".into(), |f| format!("{:+.1}%", f * 100.0))
}

pub(super) fn errors_line(errors: &BTreeMap<String, u64>) -> String {
    if errors.is_empty() {
        return "none".into();
    }
    errors
        .iter()
        .map(|(k, v)| format!("{k} x{v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn human(r: &IntervalReport) -> String {
    format!(
        "soak {:>3} ({:.0}s): rss median {} (peak {}), heap median {} (peak {}), SelectWorker p50 {:.0}us p99 {:.0}us ({} calls; server: {}), {} events applied, index {} blocks, shed {}; designed errors: {}; unexpected: {}",
        r.interval,
        r.elapsed_s,
        mib(r.rss_median_bytes),
        mib(r.rss_peak_bytes),
        mib(r.heap_median_bytes),
        mib(r.heap_peak_bytes),
        r.select.p50_us,
        r.select.p99_us,
        r.select_calls,
        r.server_select.map_or_else(
            || "?".into(),
            |s| format!("mean {:.0}us p99 {:.0}us", s.mean_us, s.p99_us)
        ),
        r.events_applied,
        r.index_blocks,
        r.requests_shed,
        errors_line(&r.designed_errors),
        errors_line(&r.unexpected_errors),
    )
}

pub(super) fn human_verdict(v: &SoakVerdict) -> String {
    let judged = |x: Option<bool>| match x {
        Some(true) => "ok",
        Some(false) => "FAIL",
        None => "not judged",
    };
    format!(
        "soak verdict: {}. memory {} on {} (heap, middle third -> last third: {} -> {}, {}; rss: {} -> {}, {}; rss peak sample {}); heap left after the run {} ({} -> {}); p99 {} ({}: {} -> {}, drift {}; clients' drift {}); unexpected errors {} ({}); index {} (server {} blocks, replay {}{})",
        if v.pass { "PASS" } else { "FAIL" },
        judged(v.memory_flat),
        v.memory_source,
        mib(v.heap_middle_bytes),
        mib(v.heap_last_bytes),
        percent(v.heap_growth),
        mib(v.rss_middle_bytes),
        mib(v.rss_last_bytes),
        percent(v.rss_growth),
        mib(v.rss_peak_bytes),
        judged(v.heap_returned),
        mib(v.heap_before_bytes),
        mib(v.heap_after_bytes),
        judged(v.p99_stable),
        v.p99_source,
        v.p99_first_us
            .map_or_else(|| "?".into(), |p| format!("{p:.0}us")),
        v.p99_last_us
            .map_or_else(|| "?".into(), |p| format!("{p:.0}us")),
        percent(v.p99_drift),
        percent(v.client_p99_drift),
        if v.unexpected_errors.is_empty() {
            "none"
        } else {
            "FAIL"
        },
        errors_line(&v.unexpected_errors),
        if v.index_exact { "exact" } else { "MISMATCH" },
        v.server_blocks,
        v.reference_blocks,
        if v.index_mismatches.is_empty() {
            String::new()
        } else {
            format!("; {}", v.index_mismatches.join("; "))
        },
    )
}
