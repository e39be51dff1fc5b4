//! The verdict's rules on made-up intervals.

use super::*;

fn interval(n: usize, rss: u64, p99: f64) -> IntervalReport {
    IntervalReport {
        bench: "soak",
        interval: n,
        elapsed_s: n as f64,
        rss_median_bytes: Some(rss),
        rss_peak_bytes: Some(rss + rss / 5),
        rss_samples: 60,
        heap_median_bytes: None,
        heap_peak_bytes: None,
        select_calls: 100,
        select: Latency {
            p50_us: p99 / 2.0,
            p99_us: p99,
            max_us: p99,
        },
        server_select: None,
        events_applied: 0,
        events_accepted: 0,
        index_blocks: 0,
        index_memory_bytes: 0,
        requests_shed: 0,
        designed_errors: BTreeMap::new(),
        unexpected_errors: BTreeMap::new(),
    }
}

fn exact() -> IndexCheck {
    IndexCheck {
        server_blocks: 1,
        reference_blocks: 1,
        server_digest: 2,
        reference_digest: 2,
        mismatches: Vec::new(),
    }
}

#[test]
fn warm_up_growth_is_ignored_and_later_growth_fails() {
    // Memory doubles during warm-up, then stays: flat.
    let flat: Vec<_> = [100, 200, 300, 300, 305, 310, 300]
        .iter()
        .enumerate()
        .map(|(i, &m)| interval(i + 1, m, 1000.0))
        .collect();
    let v = judge(&flat, 3, BTreeMap::new(), BTreeMap::new(), exact());
    assert_eq!(v.memory_flat, Some(true));
    assert!(v.pass);
    // 10 % more after warm-up: a leak.
    let leak: Vec<_> = [100, 200, 300, 300, 310, 320, 330]
        .iter()
        .enumerate()
        .map(|(i, &m)| interval(i + 1, m, 1000.0))
        .collect();
    let v = judge(&leak, 3, BTreeMap::new(), BTreeMap::new(), exact());
    assert_eq!(v.memory_flat, Some(false));
    assert!(!v.pass);
}

#[test]
fn p99_drift_and_unexpected_errors_fail() {
    let drift: Vec<_> = [1000.0, 1000.0, 1000.0, 1100.0, 1300.0, 1400.0]
        .iter()
        .enumerate()
        .map(|(i, &p)| interval(i + 1, 100, p))
        .collect();
    let v = judge(&drift, 0, BTreeMap::new(), BTreeMap::new(), exact());
    assert_eq!(v.p99_stable, Some(false));
    let steady: Vec<_> = (1..=6).map(|i| interval(i, 100, 1000.0)).collect();
    let errors = BTreeMap::from([("SelectWorker UNAVAILABLE".to_string(), 1)]);
    let v = judge(&steady, 0, BTreeMap::new(), errors, exact());
    assert_eq!(v.p99_stable, Some(true));
    assert!(!v.pass);
    let designed = BTreeMap::from([("Heartbeat NOT_FOUND".to_string(), 3)]);
    let v = judge(&steady, 0, designed, BTreeMap::new(), exact());
    assert!(v.pass);
}

#[test]
fn the_servers_timing_is_judged_when_every_interval_has_it() {
    // The clients' p99 doubles (the machine got busy); the server's
    // own stays put: stable, judged on the server's figure.
    let mut noisy: Vec<_> = [1000.0, 1000.0, 1000.0, 2000.0, 2000.0, 2000.0]
        .iter()
        .enumerate()
        .map(|(i, &p)| interval(i + 1, 100, p))
        .collect();
    for r in &mut noisy {
        r.server_select = Some(ServerLatency {
            calls: 100,
            mean_us: 100.0,
            p99_us: 300.0,
        });
    }
    let v = judge(&noisy, 0, BTreeMap::new(), BTreeMap::new(), exact());
    assert_eq!((v.p99_source, v.p99_stable), ("server", Some(true)));
    assert!((v.client_p99_drift.unwrap() - 1.0).abs() < 1e-9);
    // The server slowing down fails it.
    for r in &mut noisy[3..] {
        r.server_select = Some(ServerLatency {
            calls: 100,
            mean_us: 150.0,
            p99_us: 400.0,
        });
    }
    let v = judge(&noisy, 0, BTreeMap::new(), BTreeMap::new(), exact());
    assert_eq!(v.p99_stable, Some(false));
    // One interval without the server's figure: the clients' is judged.
    noisy[4].server_select = None;
    let v = judge(&noisy, 0, BTreeMap::new(), BTreeMap::new(), exact());
    assert_eq!((v.p99_source, v.p99_stable), ("client", Some(false)));
}

#[test]
fn growth_that_settles_is_flat_and_growth_to_the_end_is_not() {
    let run = |medians: &[u64]| {
        let intervals: Vec<_> = medians
            .iter()
            .enumerate()
            .map(|(i, &m)| interval(i + 1, m, 1000.0))
            .collect();
        judge(&intervals, 0, BTreeMap::new(), BTreeMap::new(), exact())
    };
    // Up 11 % in the first third, then level: pools at their peak.
    let settled = run(&[1000, 1080, 1110, 1105, 1110, 1100, 1108, 1112, 1104]);
    assert_eq!(settled.memory_flat, Some(true));
    // 2 % more every interval: a leak, though no single step is large.
    let leak: Vec<u64> = (0..9).map(|i| 1000 + 20 * i).collect();
    let leaking = run(&leak);
    assert_eq!(
        (leaking.rss_middle_bytes, leaking.rss_last_bytes),
        (Some(1080), Some(1140))
    );
    assert_eq!(leaking.memory_flat, Some(false));
}

#[test]
fn the_heap_is_judged_when_every_interval_counts_it() {
    // RSS climbs 20 % (the allocator keeps pages) while the heap stays
    // flat: flat, judged on the heap.
    let mut kept: Vec<_> = [100, 100, 100, 120]
        .iter()
        .enumerate()
        .map(|(i, &m)| interval(i + 1, m, 1000.0))
        .collect();
    for r in &mut kept {
        r.heap_median_bytes = Some(50);
    }
    let v = judge(&kept, 1, BTreeMap::new(), BTreeMap::new(), exact());
    assert_eq!((v.memory_source, v.memory_flat), ("heap", Some(true)));
    assert!(v.rss_growth.unwrap() > 0.19 && v.pass);
    // The heap growing 10 % fails it.
    kept[3].heap_median_bytes = Some(55);
    let v = judge(&kept, 1, BTreeMap::new(), BTreeMap::new(), exact());
    assert_eq!(v.memory_flat, Some(false));
    // One interval without the heap: RSS is judged (and fails).
    kept[3].heap_median_bytes = None;
    let v = judge(&kept, 1, BTreeMap::new(), BTreeMap::new(), exact());
    assert_eq!((v.memory_source, v.memory_flat), ("rss", Some(false)));
}

#[test]
fn heap_left_after_the_run_fails_past_the_tolerance() {
    let steady: Vec<_> = (1..=4).map(|i| interval(i, 100, 1000.0)).collect();
    let mut v = judge(&steady, 0, BTreeMap::new(), BTreeMap::new(), exact());
    v.judge_heap_left(Some(10 << 20), Some(11 << 20));
    assert_eq!(
        (v.heap_left_bytes, v.heap_returned),
        (Some(1 << 20), Some(true))
    );
    assert!(v.pass);
    v.judge_heap_left(Some(10 << 20), Some(13 << 20));
    assert_eq!(v.heap_returned, Some(false));
    assert!(!v.pass);
    let mut v = judge(&steady, 0, BTreeMap::new(), BTreeMap::new(), exact());
    v.judge_heap_left(None, Some(13 << 20));
    assert_eq!((v.heap_left_bytes, v.heap_returned), (None, None));
    assert!(v.pass);
}

#[test]
fn gauges_are_read_by_their_exact_name() {
    let text = "kvroute_heap_allocated_bytes_total 9\nkvroute_heap_allocated_bytes 1234\nprocess_resident_memory_bytes 5e3\n";
    assert_eq!(
        crate::bench::series_value(text, "kvroute_heap_allocated_bytes"),
        Some(1234)
    );
    assert_eq!(
        crate::bench::series_value(text, "process_resident_memory_bytes"),
        Some(5000)
    );
    assert_eq!(crate::bench::series_value(text, "missing"), None);
    assert_eq!(crate::bench::series_value("x NaN\n", "x"), None);
    // A labelled series, by its name and labels.
    let labelled = "c_total{outcome=\"local\"} 2\nc_total{outcome=\"ordered\"} 7\n";
    assert_eq!(
        crate::bench::series_value(labelled, "c_total{outcome=\"ordered\"}"),
        Some(7)
    );
}

#[test]
fn too_short_a_run_is_not_judged() {
    let one = vec![interval(1, 100, 1000.0)];
    let v = judge(&one, 3, BTreeMap::new(), BTreeMap::new(), exact());
    assert_eq!((v.memory_flat, v.p99_stable), (None, None));
    assert!(v.pass);
}
