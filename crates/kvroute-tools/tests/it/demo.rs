//! `kvroute demo`, short: both passes over real sockets complete every
//! request, and what the engines reported cached (the client's reuse)
//! equals what the replay predicts for the same requests. The timing
//! agreement is the full demo's to show (release build, engines at the
//! model's speed: docs/REPLAY.md); at five times the speed a debug build's
//! steps are too short for the clocks to agree.

use std::path::Path;

use kvroute_tools::demo::{self, DemoArgs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_demo_completes_both_passes_and_reuses_as_predicted() {
    let trace =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/conversation_sample.jsonl");
    let args = DemoArgs {
        trace,
        workers: 4,
        speedup: 4.0,
        limit: Some(30),
        engine_speed: 5.0,
        plot: None,
    };
    let c = demo::compare(&args).await.expect("the demo runs");
    for (over_sockets, predicted) in [
        (&c.round_robin, &c.predicted_round_robin),
        (&c.routed, &c.predicted),
    ] {
        assert_eq!(over_sockets.completed, 30, "{over_sockets:?}");
        assert_eq!(predicted.completed, 30);
        assert!(
            (over_sockets.reuse_ratio - predicted.reuse_ratio).abs() < 0.01,
            "reuse {} over sockets, {} predicted",
            over_sockets.reuse_ratio,
            predicted.reuse_ratio
        );
        // Figures are in the model's time: the speedup shown is the run's.
        assert_eq!(over_sockets.speedup, 4.0);
        assert!(over_sockets.ttft_ms.p50 > 0.0);
    }
    assert_eq!(c.routed.policy, "kvroute");
    assert_eq!(c.round_robin.policy, "round-robin");
}
