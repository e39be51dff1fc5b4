//! `kvroute ctl` as an operator runs it: the real binary against a
//! TestServer holding registered workers and published KV events. Checks the
//! tables, the JSON, and that failures are one line with a non-zero exit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{TestServer, batch, registration};
use kvroute::pb;
use serde_json::Value;

const MODEL: &str = "llama";

/// Runs `kvroute ctl --addr ADDR ARGS`; returns (exit code, stdout, stderr).
async fn ctl(addr: &str, args: &[&str]) -> (i32, String, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvroute-tools"))
        .arg("ctl")
        .args(["--addr", addr])
        .args(args)
        .output()
        .await
        .expect("run kvroute ctl");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// Runs ctl expecting success; returns stdout.
async fn ctl_ok(addr: &str, args: &[&str]) -> String {
    let (code, stdout, stderr) = ctl(addr, args).await;
    assert_eq!(code, 0, "ctl {args:?} failed: {stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    stdout
}

async fn ctl_json(addr: &str, args: &[&str]) -> Value {
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let stdout = ctl_ok(addr, &with_json).await;
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// A stored event of complete blocks given as token ids, chained from the root.
fn stored_tokens(event_id: u64, first_engine_hash: u64, tokens: &[u32]) -> pb::KvEvent {
    let blocks = tokens
        .chunks_exact(16)
        .enumerate()
        .map(|(i, chunk)| pb::StoredBlock {
            engine_hash: first_engine_hash + i as u64,
            content: Some(pb::stored_block::Content::TokenIds(pb::TokenIds {
                ids: chunk.to_vec(),
            })),
            mm_info: None,
        })
        .collect();
    pb::KvEvent {
        event_id,
        kind: Some(pb::kv_event::Kind::Stored(pb::BlocksStored {
            tier: 0,
            parent_engine_hash: None,
            blocks,
            lora_name: String::new(),
            cache_namespace: String::new(),
        })),
    }
}

fn prompt() -> Vec<u32> {
    (100..164).collect()
}

/// Worker 1 caches one block of the prompt, worker 2 three (of four), worker
/// 3 is a prefill worker with nothing cached; worker 2 has two dp ranks.
async fn fleet() -> (TestServer, String) {
    let server = TestServer::start().await;
    server.register(registration(1, MODEL)).await;
    server
        .register(pb::RegisterWorkerRequest {
            dp_size: 2,
            ..registration(2, MODEL)
        })
        .await;
    server
        .register(pb::RegisterWorkerRequest {
            role: pb::WorkerRole::Prefill.into(),
            ..registration(3, MODEL)
        })
        .await;
    let tokens = prompt();
    let reply = server
        .publish(batch(1, 0, vec![stored_tokens(0, 100, &tokens[..16])]))
        .await
        .unwrap();
    assert_eq!(reply.rejected, 0);
    let reply = server
        .publish(batch(2, 1, vec![stored_tokens(0, 200, &tokens[..48])]))
        .await
        .unwrap();
    assert_eq!(reply.rejected, 0);
    // Without a scheme: ctl adds http://.
    let addr = server.grpc_addr.to_string();
    (server, addr)
}

fn tokens_arg() -> String {
    prompt()
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The cells of the table row whose first cell is `first`.
fn row<'a>(table: &'a str, first: &str) -> Vec<&'a str> {
    table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cells| cells.first() == Some(&first))
        .unwrap_or_else(|| panic!("no row {first} in:\n{table}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_lists_every_worker_as_a_table_and_as_json() {
    let (server, addr) = fleet().await;
    let table = ctl_ok(&addr, &["workers"]).await;
    let header = table.lines().next().unwrap();
    for column in [
        "ID",
        "MODEL",
        "ROLE",
        "RANKS",
        "VIEW",
        "BLOCKS",
        "BOOKED",
        "LEASE LEFT",
        "CORDONED",
    ] {
        assert!(header.contains(column), "{column} missing: {table}");
    }
    assert_eq!(table.lines().count(), 4, "{table}");
    // Columns line up: every row's model starts under the MODEL header and
    // right-aligned numbers end under BLOCKS.
    let model_at = header.find("MODEL").unwrap();
    let blocks_end = header.find("BLOCKS").unwrap() + "BLOCKS".len();
    for line in table.lines().skip(1) {
        assert!(line[model_at..].starts_with(MODEL), "{table}");
        assert_ne!(line.as_bytes()[blocks_end - 1], b' ', "{table}");
        assert_eq!(line.as_bytes()[blocks_end], b' ', "{table}");
    }
    let one = row(&table, "1");
    assert_eq!(one[1..4], [MODEL, "aggregated", "0"]);
    assert_eq!((one[4], one[5], one[6], one[8]), ("exact", "1", "0", "no"));
    let two = row(&table, "2");
    assert_eq!((two[3], two[5]), ("0-1", "3"));
    assert_eq!(row(&table, "3")[2], "prefill");

    let json = ctl_json(&addr, &["workers"]).await;
    let workers = json["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 3);
    assert_eq!(workers[1]["worker_id"], 2);
    assert_eq!(workers[1]["cached_blocks"], 3);
    assert_eq!(workers[1]["kv_events"], "exact");
    assert_eq!(workers[1]["cache_view"], "exact");
    assert_eq!(workers[1]["ranks"][1]["predicted_blocks"], 0);
    assert_eq!(workers[1]["ranks"][1]["cached_blocks"], 3);
    assert_eq!(workers[1]["ranks"][1]["last_event_id"], 0);
    assert_eq!(workers[2]["role"], "prefill");
    assert!(workers[0]["lease_remaining_ms"].as_u64().unwrap() > 0);

    // --model filters.
    let none = ctl_json(&addr, &["workers", "--model", "other"]).await;
    assert_eq!(none["workers"].as_array().unwrap().len(), 0);
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_and_stats_show_ranks_and_index_totals() {
    let (server, addr) = fleet().await;
    let detail = ctl_ok(&addr, &["worker", "2"]).await;
    assert!(
        detail.contains("model") && detail.contains(MODEL),
        "{detail}"
    );
    assert!(
        detail.contains("RANK") && detail.contains("CACHED"),
        "{detail}"
    );
    assert_eq!(
        row(&detail, "1")[4],
        "3",
        "rank 1 caches 3 blocks: {detail}"
    );
    assert!(
        detail.contains("cached-token reports") && detail.contains("scored on"),
        "{detail}"
    );
    let json = ctl_json(&addr, &["worker", "2"]).await;
    assert_eq!(json["dp_size"], 2);
    assert!(json["cached_tokens_feedback"].is_null(), "no reports yet");

    let stats = ctl_ok(&addr, &["stats"]).await;
    assert!(stats.contains("blocks"), "{stats}");
    let json = ctl_json(&addr, &["stats"]).await;
    assert_eq!(json["blocks"], 4);
    assert_eq!(json["workers"], 2);
    assert_eq!(json["events_applied"], 2);
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_the_winner_and_scores_every_candidate() {
    let (server, addr) = fleet().await;
    let tokens = tokens_arg();
    let table = ctl_ok(&addr, &["explain", "--model", MODEL, "--tokens", &tokens]).await;
    for column in [
        "WORKER",
        "RANK",
        "ELIGIBLE",
        "REASON",
        "OVERLAP",
        "TIERS",
        "EFFECTIVE",
        "VIEW",
        "PREFILL COST",
        "DECODE COST",
        "LOGIT",
        "PROBABILITY",
        "BUSY",
    ] {
        assert!(table.contains(column), "{column} missing: {table}");
    }
    assert!(
        table.contains("winner: worker 2 rank 1 (overlap 3 of 4 blocks"),
        "{table}"
    );
    let prefill_worker = row(&table, "3");
    assert_eq!(prefill_worker[2..4], ["no", "role"], "{table}");

    let json = ctl_json(&addr, &["explain", "--model", MODEL, "--tokens", &tokens]).await;
    assert_eq!(json["winner"]["worker_id"], 2);
    assert_eq!(json["winner"]["dp_rank"], 1);
    let candidates = json["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 4, "one per (worker, rank)");
    let best = candidates
        .iter()
        .max_by(|a, b| {
            let p = |c: &Value| c["probability"].as_f64().unwrap();
            p(a).total_cmp(&p(b))
        })
        .unwrap();
    assert_eq!(
        (&best["worker_id"], &best["dp_rank"]),
        (&2.into(), &1.into())
    );
    assert_eq!(best["eligible"], true);
    assert_eq!(best["overlap_blocks"], 3);

    // The prefill phase makes the prefill worker eligible.
    let json = ctl_json(
        &addr,
        &[
            "explain", "--model", MODEL, "--tokens", &tokens, "--phase", "prefill",
        ],
    )
    .await;
    let three = json["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["worker_id"] == 3)
        .unwrap();
    assert_eq!(three["eligible"], true);

    // The same prompt from a file (JSON array).
    let dir = std::env::temp_dir().join(format!("kvroute-ctl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("prompt.json");
    std::fs::write(&file, serde_json::to_string(&prompt()).unwrap()).unwrap();
    let json = ctl_json(
        &addr,
        &[
            "explain",
            "--model",
            MODEL,
            "--tokens-file",
            file.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(json["winner"]["worker_id"], 2);
    std::fs::remove_dir_all(&dir).unwrap();
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_takes_a_mooncake_trace_line() {
    let (server, addr) = fleet().await;
    // Worker 1 caches the first 512-token trace block of hash_id 7 (32
    // router blocks); line 2 of the trace starts with it.
    let cached = kvroute_tools::trace::tokens_for(&[7], 512);
    server
        .publish(batch(1, 0, vec![stored_tokens(1, 1000, &cached)]))
        .await
        .unwrap();
    let dir = std::env::temp_dir().join(format!("kvroute-ctl-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 700, \"output_length\": 10, \"hash_ids\": [0, 1]}\n\
         {\"timestamp\": 5, \"input_length\": 800, \"output_length\": 10, \"hash_ids\": [7, 8]}\n",
    )
    .unwrap();
    let path = trace.to_str().unwrap();
    let json = ctl_json(
        &addr,
        &["explain", "--model", MODEL, "--trace", path, "--line", "2"],
    )
    .await;
    assert_eq!(json["winner"]["worker_id"], 1);
    assert_eq!(json["winner"]["overlap_blocks"], 32);
    assert_eq!(json["winner"]["total_blocks"], 50, "800 tokens / 16");

    let (code, _, stderr) = ctl(
        &addr,
        &["explain", "--model", MODEL, "--trace", path, "--line", "9"],
    )
    .await;
    assert_eq!(code, 1);
    assert_one_line(&stderr, "has 2 lines");
    std::fs::remove_dir_all(&dir).unwrap();
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cordon_and_uncordon_change_eligibility() {
    let (server, addr) = fleet().await;
    let out = ctl_ok(&addr, &["cordon", "2"]).await;
    assert!(out.starts_with("worker 2 cordoned\n"), "{out}");
    assert_eq!(row(&out, "2")[8], "yes", "{out}");
    let tokens = tokens_arg();
    let table = ctl_ok(&addr, &["explain", "--model", MODEL, "--tokens", &tokens]).await;
    assert!(table.contains("winner: worker 1 rank 0"), "{table}");
    assert_eq!(row(&table, "2")[2..4], ["no", "cordoned"], "{table}");

    let json = ctl_json(&addr, &["uncordon", "2"]).await;
    assert_eq!(json["cordoned"], false);
    let json = ctl_json(&addr, &["explain", "--model", MODEL, "--tokens", &tokens]).await;
    assert_eq!(json["winner"]["worker_id"], 2);
    drop(server);
}

fn assert_one_line(stderr: &str, needle: &str) {
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr:?}");
    assert!(lines[0].starts_with("kvroute: "), "{stderr}");
    assert!(lines[0].contains(needle), "{needle} not in {stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_worker_is_one_line_and_a_failure_exit() {
    let (server, addr) = fleet().await;
    let (code, stdout, stderr) = ctl(&addr, &["worker", "9"]).await;
    assert_eq!(code, 1);
    assert!(stdout.is_empty(), "{stdout}");
    assert_eq!(stderr, "kvroute: NOT_FOUND: worker 9 is not registered\n");
    let (code, _, stderr) = ctl(&addr, &["cordon", "9"]).await;
    assert_eq!(code, 1);
    assert_one_line(&stderr, "NOT_FOUND");
    let (code, _, stderr) = ctl(&addr, &["explain", "--model", "nope", "--tokens", "1 2"]).await;
    assert_ne!(code, 0);
    assert_one_line(&stderr, "kvroute: ");
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_server_is_one_line_and_a_failure_exit() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("http://127.0.0.1:{port}");
    let (code, stdout, stderr) = ctl(&addr, &["workers"]).await;
    assert_eq!(code, 1);
    assert!(stdout.is_empty());
    assert_one_line(&stderr, "UNAVAILABLE: cannot connect to http://127.0.0.1:");
    // Bad usage is clap's exit 2.
    let (code, _, _) = ctl(&addr, &["explain", "--model", "m"]).await;
    assert_eq!(code, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_the_ttft_policys_prediction_in_parts() {
    let config = kvroute::config::ServeConfig {
        scorer: kvroute::config::ScoringPolicy::Ttft,
        ..kvroute::config::ServeConfig::for_tests()
    };
    let server = TestServer::start_with(config).await;
    server.register(registration(1, MODEL)).await;
    server.register(registration(2, MODEL)).await;
    let tokens = prompt();
    let reply = server
        .publish(batch(2, 0, vec![stored_tokens(0, 200, &tokens[..48])]))
        .await
        .unwrap();
    assert_eq!(reply.rejected, 0);
    let addr = server.grpc_addr.to_string();
    let args = ["explain", "--model", MODEL, "--tokens", &tokens_arg()];

    let table = ctl_ok(&addr, &args).await;
    for column in ["TTFT MS", "QUEUED MS", "OWN MS", "DECODE MS", "SCALE"] {
        assert!(table.contains(column), "{column} missing: {table}");
    }
    assert!(!table.contains("LOGIT"), "{table}");
    assert!(table.contains("policy: ttft"), "{table}");
    assert!(table.contains("winner: worker 2 rank 0"), "{table}");

    let candidate = |json: &Value, worker: u64| {
        json["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["worker_id"] == worker)
            .unwrap()["ttft"]
            .clone()
    };
    let json = ctl_json(&addr, &args).await;
    assert_eq!(json["policy"], "ttft");
    let (one, two) = (candidate(&json, 1), candidate(&json, 2));
    // 16 uncached tokens on worker 2 against 64 on worker 1, nothing queued
    assert_eq!(one["own_prefill_tokens"], 64);
    assert_eq!(two["own_prefill_tokens"], 16);
    let ms = |v: &Value, key: &str| v[key].as_f64().unwrap();
    assert!(ms(&two, "total_ms") < ms(&one, "total_ms"), "{json}");
    assert!(ms(&two, "total_ms") > 0.0);
    let parts = ms(&one, "queued_prefill_ms") + ms(&one, "own_prefill_ms") + ms(&one, "decode_ms");
    assert!((parts - ms(&one, "total_ms")).abs() < 1e-9, "{one}");
    assert_eq!(
        (&one["queue_tracked"], &one["scale"]),
        (&false.into(), &1.0.into())
    );

    // A booking puts worker 2's queue under the router's tracking, and its
    // completion teaches the worker's scale.
    let mut router = server.router();
    let request = pb::SelectWorkerRequest {
        request_id: "r1".into(),
        model: MODEL.into(),
        prompt: Some(pb::Prompt {
            content: Some(pb::prompt::Content::TokenIds(pb::TokenIds { ids: tokens })),
        }),
        mode: pb::SelectionMode::Reserve.into(),
        ..Default::default()
    };
    let chosen = router.select_worker(request).await.unwrap().into_inner();
    assert_eq!(chosen.worker_id, 2);
    let json = ctl_json(&addr, &args).await;
    assert_eq!(candidate(&json, 2)["queue_tracked"], true, "{json}");
    assert_eq!(candidate(&json, 1)["queue_tracked"], false, "{json}");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    router
        .mark_prefill_complete(pb::MarkPrefillCompleteRequest {
            cached_tokens: None,
            request_id: "r1".into(),
        })
        .await
        .unwrap();
    let json = ctl_json(&addr, &args).await;
    // 300 ms measured against a prediction of a few tens: slower than the
    // prior
    let scale = ms(&candidate(&json, 2), "scale");
    assert!(scale > 2.0, "{json}");
    assert_eq!(ms(&candidate(&json, 1), "scale"), 1.0);
    drop(server);
}
