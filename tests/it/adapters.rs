//! LoRA adapters and cache salts (#34's third part) over real gRPC: workers
//! declare the adapters they serve; a request for an adapter is routed only
//! among workers that serve it (or declare none); blocks stored through
//! PublishEvents with an adapter and a cache namespace match exactly the
//! requests hashed with the same two, and no others; hostile declarations
//! are refused. A worker that loads adapters on request (loads_adapters)
//! takes requests for adapters it does not serve, its prefill estimate
//! raised by the load.

use crate::common::{self, TestServer, batch, registration};
use kvroute::pb;

const SQL: u64 = 1;
const CHAT: u64 = 2;
const UNDECLARED: u64 = 3;

fn adapters(list: &[(i64, &str)]) -> Vec<pb::LoraAdapter> {
    list.iter()
        .map(|&(id, name)| pb::LoraAdapter {
            id,
            name: name.into(),
        })
        .collect()
}

/// Worker 1 serves adapter "sql" (id 5), worker 2 "chat" (id 6), worker 3
/// declares none.
async fn fleet() -> TestServer {
    let server = TestServer::start().await;
    for (worker_id, declared) in [
        (SQL, adapters(&[(5, "sql")])),
        (CHAT, adapters(&[(6, "chat")])),
        (UNDECLARED, Vec::new()),
    ] {
        server
            .register(pb::RegisterWorkerRequest {
                adapters: declared,
                ..registration(worker_id, "m")
            })
            .await;
    }
    server
}

fn tokens() -> Vec<u32> {
    (1000..1048).collect()
}

/// Worker `worker_id` stores the prompt's three blocks as token ids, under
/// `lora_name` and `cache_namespace`.
async fn store(server: &TestServer, worker_id: u64, lora: &str, namespace: &str) {
    let blocks = tokens()
        .chunks_exact(16)
        .enumerate()
        .map(|(i, chunk)| pb::StoredBlock {
            engine_hash: worker_id * 100 + i as u64,
            content: Some(pb::stored_block::Content::TokenIds(pb::TokenIds {
                ids: chunk.to_vec(),
            })),
            mm_info: None,
        })
        .collect();
    let event = pb::KvEvent {
        event_id: 0,
        kind: Some(pb::kv_event::Kind::Stored(pb::BlocksStored {
            tier: 0,
            parent_engine_hash: None,
            blocks,
            lora_name: lora.into(),
            cache_namespace: namespace.into(),
        })),
    };
    server
        .publish(batch(worker_id, 0, vec![event]))
        .await
        .expect("publish");
}

/// Each candidate's (worker, eligible, reason, overlap) for a prompt of
/// `tokens()` under `lora` and `namespace`.
async fn explain(
    server: &TestServer,
    lora: &str,
    namespace: &str,
) -> Vec<(u64, bool, pb::IneligibleReason, u32)> {
    let request = pb::SelectWorkerRequest {
        request_id: "explain".into(),
        model: "m".into(),
        prompt: Some(pb::Prompt {
            content: Some(pb::prompt::Content::TokenIds(pb::TokenIds {
                ids: tokens(),
            })),
        }),
        lora_name: lora.into(),
        cache_namespace: namespace.into(),
        ..Default::default()
    };
    candidates(server, request)
        .await
        .into_iter()
        .map(|c| (c.worker_id, c.eligible, c.reason(), c.overlap_blocks))
        .collect()
}

/// ExplainSelection's candidates for `request`, by worker id.
async fn candidates(
    server: &TestServer,
    request: pb::SelectWorkerRequest,
) -> Vec<pb::CandidateExplanation> {
    let mut out = server
        .admin()
        .explain_selection(request)
        .await
        .expect("explain")
        .into_inner()
        .candidates;
    out.sort_by_key(|c| c.worker_id);
    out
}

/// A request for blocks [1, 2, 3] of model "m" with adapter `lora`.
fn adapter_request(request_id: &str, lora: &str) -> pb::SelectWorkerRequest {
    let mut request = common::select_hashes(request_id, "m", &[1, 2, 3]);
    request.lora_name = lora.into();
    request
}

async fn select_for_adapter(
    server: &TestServer,
    request_id: &str,
    lora: &str,
) -> pb::SelectWorkerResponse {
    server
        .router()
        .select_worker(adapter_request(request_id, lora))
        .await
        .expect("select")
        .into_inner()
}

#[tokio::test]
async fn a_request_for_an_adapter_goes_only_where_it_is_served() {
    let server = fleet().await;
    use pb::IneligibleReason::{Adapter, None as Eligible};
    let eligible = |rows: &[(u64, bool, pb::IneligibleReason, u32)]| -> Vec<(u64, bool)> {
        rows.iter().map(|r| (r.0, r.1)).collect()
    };
    let sql = explain(&server, "sql", "").await;
    assert_eq!(
        eligible(&sql),
        [(SQL, true), (CHAT, false), (UNDECLARED, true)]
    );
    assert_eq!(sql[1].2, Adapter, "{sql:?}");
    let chat = explain(&server, "chat", "").await;
    assert_eq!(
        eligible(&chat),
        [(SQL, false), (CHAT, true), (UNDECLARED, true)]
    );
    // The base model: every worker.
    let base = explain(&server, "", "").await;
    assert!(base.iter().all(|r| r.1 && r.2 == Eligible), "{base:?}");
    // An adapter nobody declares goes to the worker that declares none.
    let reply = select_for_adapter(&server, "other", "unknown-adapter").await;
    assert_eq!(reply.worker_id, UNDECLARED);
    // GetWorker reports what was declared.
    let info = server
        .admin()
        .get_worker(pb::GetWorkerRequest { worker_id: SQL })
        .await
        .expect("worker")
        .into_inner();
    assert_eq!(info.adapters, adapters(&[(5, "sql")]));
}

#[tokio::test]
async fn events_with_an_adapter_and_a_salt_match_requests_with_both_and_no_others() {
    let server = fleet().await;
    store(&server, SQL, "sql", "tenant-a").await;
    store(&server, UNDECLARED, "", "").await;
    let overlap = |rows: &[(u64, bool, pb::IneligibleReason, u32)], worker: u64| {
        rows.iter().find(|r| r.0 == worker).map(|r| r.3)
    };
    let both = explain(&server, "sql", "tenant-a").await;
    assert_eq!(overlap(&both, SQL), Some(3), "{both:?}");
    assert_eq!(
        overlap(&both, UNDECLARED),
        Some(0),
        "plain blocks do not match"
    );
    for (lora, namespace) in [("sql", ""), ("", "tenant-a"), ("sql", "tenant-b"), ("", "")] {
        let rows = explain(&server, lora, namespace).await;
        assert_eq!(
            overlap(&rows, SQL),
            Some(0),
            "{lora:?} / {namespace:?} matched the salted adapter's blocks: {rows:?}"
        );
    }
    let plain = explain(&server, "", "").await;
    assert_eq!(overlap(&plain, UNDECLARED), Some(3), "{plain:?}");
}

#[tokio::test]
async fn hostile_adapter_declarations_are_refused() {
    let server = TestServer::start().await;
    let mut workers = server.workers();
    let refused = |adapters: Vec<pb::LoraAdapter>| pb::RegisterWorkerRequest {
        adapters,
        ..registration(9, "m")
    };
    let too_many: Vec<(i64, String)> = (0..257).map(|i| (i, format!("a{i}"))).collect();
    let cases = [
        (
            "too many",
            refused(
                too_many
                    .iter()
                    .map(|(id, name)| pb::LoraAdapter {
                        id: *id,
                        name: name.clone(),
                    })
                    .collect(),
            ),
        ),
        ("an id naming two", refused(adapters(&[(1, "x"), (1, "y")]))),
        ("no name", refused(adapters(&[(1, "")]))),
        (
            "a name over 1 KiB",
            refused(vec![pb::LoraAdapter {
                id: 1,
                name: "n".repeat(1025),
            }]),
        ),
    ];
    for (what, request) in cases {
        let status = workers.register_worker(request).await.expect_err(what);
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{what}: {status:?}"
        );
    }
    assert!(
        server
            .admin()
            .get_worker(pb::GetWorkerRequest { worker_id: 9 })
            .await
            .is_err(),
        "nothing registered"
    );
    // A namespace over the name limit in an event is refused, the stream
    // and the server go on.
    server.register(registration(9, "m")).await;
    let event = pb::KvEvent {
        event_id: 0,
        kind: Some(pb::kv_event::Kind::Stored(pb::BlocksStored {
            tier: 0,
            parent_engine_hash: None,
            blocks: vec![pb::StoredBlock {
                engine_hash: 1,
                content: Some(pb::stored_block::Content::LocalHash(7)),
                mm_info: None,
            }],
            lora_name: String::new(),
            cache_namespace: "s".repeat(1025),
        })),
    };
    let status = server
        .publish(batch(9, 0, vec![event]))
        .await
        .expect_err("namespace too long");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
}

const LOADER: u64 = 10;
const X_ONLY: u64 = 11;

/// Worker 10 serves "y" and loads others on request, 11 serves "x" only;
/// a load costs `load_tokens`.
async fn loading_fleet(load_tokens: u64) -> TestServer {
    let server = TestServer::start_with(kvroute::config::ServeConfig {
        adapter_load_tokens: load_tokens,
        ..kvroute::config::ServeConfig::for_tests()
    })
    .await;
    for (worker_id, declared, loads_adapters) in [
        (LOADER, adapters(&[(1, "y")]), true),
        (X_ONLY, adapters(&[(2, "x")]), false),
    ] {
        server
            .register(pb::RegisterWorkerRequest {
                adapters: declared,
                loads_adapters,
                ..registration(worker_id, "m")
            })
            .await;
    }
    server
}

/// Each candidate's (worker, eligible, reason, loads_adapter) for `lora`.
async fn explain_loads(
    server: &TestServer,
    lora: &str,
) -> Vec<(u64, bool, pb::IneligibleReason, bool)> {
    candidates(server, adapter_request("explain", lora))
        .await
        .into_iter()
        .map(|c| (c.worker_id, c.eligible, c.reason(), c.loads_adapter))
        .collect()
}

#[tokio::test]
async fn a_worker_that_loads_adapters_takes_others_priced_by_the_load() {
    let server = loading_fleet(1000).await;
    use pb::IneligibleReason::{Adapter, None as Eligible};
    // An adapter nobody serves: only the loader may take it, paying the load.
    assert_eq!(
        explain_loads(&server, "z").await,
        [
            (LOADER, true, Eligible, true),
            (X_ONLY, false, Adapter, false)
        ]
    );
    for i in 0..8 {
        let reply = select_for_adapter(&server, &format!("z-{i}"), "z").await;
        assert_eq!(reply.worker_id, LOADER);
        if i == 0 {
            // Nothing booked yet: three 16-token blocks and the load.
            assert_eq!(reply.potential_prefill_tokens, 48 + 1000, "{reply:?}");
        }
    }
    // "x": both may take it, the loader paying the load; "y": it serves it.
    assert_eq!(
        explain_loads(&server, "x").await,
        [
            (LOADER, true, Eligible, true),
            (X_ONLY, true, Eligible, false)
        ]
    );
    assert!(explain_loads(&server, "y").await.iter().all(|c| !c.3));
    // GetWorker and ListWorkers report it.
    assert!(server.worker_info(LOADER).await.loads_adapters);
    assert!(!server.worker_info(X_ONLY).await.loads_adapters);
    let listed: Vec<(u64, bool)> = server
        .admin()
        .list_workers(pb::ListWorkersRequest::default())
        .await
        .expect("list")
        .into_inner()
        .workers
        .iter()
        .map(|w| (w.worker_id, w.loads_adapters))
        .collect();
    assert_eq!(listed, [(LOADER, true), (X_ONLY, false)]);
}
