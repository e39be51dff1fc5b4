//! `kvroute bench soak` for a few seconds on the committed trace sample:
//! the run reports intervals, its churn happened (a lapsed worker was
//! reported NOT_FOUND, a designed error) and the server's index equals the
//! in-process replay of the events it accepted. Timing verdicts (memory,
//! p99) are not asserted: a few seconds on a shared machine prove nothing.

use kvroute_tools::bench::soak;
use kvroute_tools::cli::{self, BenchCommand, Command};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_soak_reports_and_its_index_matches_the_replay() {
    let argv = [
        "kvroute",
        "bench",
        "soak",
        "--trace",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/conversation_sample.jsonl"
        ),
        "--seconds",
        "4",
        "--interval-secs",
        "1",
        "--warmup-intervals",
        "1",
        "--event-rate-x",
        "20",
        "--workers",
        "3",
        "--engine-blocks",
        "512",
        "--frontends",
        "2",
        "--select-rate",
        "40",
        "--churn-secs",
        "0.7",
        "--lease-secs",
        "2",
    ];
    let args = match cli::parse(argv.iter().map(|s| s.to_string()).collect()) {
        Ok(cli::Cli {
            command: Command::Bench(BenchCommand::Soak(args)),
        }) => args,
        other => panic!("bench soak arguments not parsed: {other:?}"),
    };
    let report = soak::run(&args).await.expect("the soak runs");
    assert!(!report.intervals.is_empty(), "no interval reported");
    let accepted: u64 = report.intervals.iter().map(|i| i.events_accepted).sum();
    assert!(accepted > 0, "no event was accepted");
    assert!(
        report.verdict.index_exact,
        "index differs from the replay: {:?}",
        report.verdict.index_mismatches
    );
    assert!(report.verdict.server_blocks > 0);
    assert!(
        report
            .verdict
            .designed_errors
            .contains_key("GetWorker NOT_FOUND"),
        "no lease lapsed: {:?}",
        report.verdict.designed_errors
    );
}
