//! Replays the fuzz corpus on stable: every file under
//! `fuzz/corpus/<target>/` (seeds) and `fuzz/regressions/<target>/`
//! (crashes the fuzzer found, minimised) goes through the same entry point
//! as the `cargo fuzz` target (`crate::fuzzing`), so a crash found once
//! stays fixed. The ignored test `write_seed_corpus` writes the seeds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use super::TARGETS;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The files of one directory, sorted; none if it does not exist.
fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn every_corpus_and_regression_file_runs_cleanly() {
    for (name, entry) in TARGETS {
        let seeds = files(&root().join("corpus").join(name));
        assert!(!seeds.is_empty(), "fuzz/corpus/{name} has no seeds");
        let regressions = files(&root().join("regressions").join(name));
        for file in seeds.iter().chain(&regressions) {
            let data = std::fs::read(file).unwrap();
            // A panic names the file.
            let run = std::panic::catch_unwind(|| entry(&data));
            assert!(run.is_ok(), "{name}: {} panicked", file.display());
        }
    }
}

/// Writes the seed corpus (`cargo test --test fuzz_corpus -- --ignored`):
/// valid and near-valid inputs of each target, built from their formats.
#[test]
#[ignore = "writes fuzz/corpus; run by hand when the seeds change"]
fn write_seed_corpus() {
    for (name, seeds) in [
        ("zmq_payload", seeds::zmq()),
        ("publish_events", seeds::publish()),
        ("select_worker", seeds::select()),
        ("config_file", seeds::config()),
        ("snapshot_payload", seeds::snapshot()),
        ("auth_policy", seeds::policy()),
    ] {
        let dir = root().join("corpus").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (file, data) in seeds {
            std::fs::write(dir.join(format!("seed-{file}")), data).unwrap();
        }
    }
}

mod seeds {
    use crate::pb;
    use kvroute_core::hashing::{HashOptions, compute_block_hashes};
    use prost::Message;
    use rmpv::Value;

    type Seeds = Vec<(&'static str, Vec<u8>)>;

    fn msgpack(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn arr(items: Vec<Value>) -> Value {
        Value::Array(items)
    }

    fn map(entries: Vec<(&str, Value)>) -> Value {
        Value::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    fn ints(xs: &[i64]) -> Value {
        arr(xs.iter().map(|&x| Value::from(x)).collect())
    }

    /// A 32-byte engine hash whose last 8 bytes are `last8`.
    fn hash32(last8: u64) -> Value {
        let mut b = vec![0xaa; 24];
        b.extend_from_slice(&last8.to_be_bytes());
        Value::Binary(b)
    }

    // zmq_payload flags: bit 0 SGLang, bits 1..3 framing (0 bare, 1 live,
    // 2 replay), bit 3 group 0 only, bits 4..6 block size (1, 2, 4, 16).
    const BARE_BS2: u8 = 0x10;
    const SGLANG: u8 = 1;
    const LIVE: u8 = 2;
    const REPLAY: u8 = 4;

    fn flagged(flags: u8, payload: &[u8]) -> Vec<u8> {
        let mut v = vec![flags];
        v.extend_from_slice(payload);
        v
    }

    /// Flags, a frame count, each frame but the last length-prefixed.
    fn framed(flags: u8, frames: &[&[u8]]) -> Vec<u8> {
        let mut v = vec![flags, frames.len() as u8];
        for (i, f) in frames.iter().enumerate() {
            if i + 1 < frames.len() {
                v.push(f.len() as u8);
            }
            v.extend_from_slice(f);
        }
        v
    }

    fn vllm_positional() -> Value {
        arr(vec![
            Value::F64(1.5),
            arr(vec![
                arr(vec![
                    s("BlockStored"),
                    arr(vec![Value::from(1u64), Value::from(u64::MAX - 1)]),
                    Value::Nil,
                    ints(&[10, 11, 12, 13]),
                    Value::from(2),
                    Value::Nil,
                    s("GPU"),
                    Value::Nil,
                ]),
                arr(vec![s("BlockRemoved"), ints(&[1]), s("GPU")]),
                arr(vec![s("AllBlocksCleared")]),
            ]),
            Value::from(0),
        ])
    }

    pub(crate) fn zmq() -> Seeds {
        let vllm = msgpack(&vllm_positional());
        let vllm_full = msgpack(&arr(vec![
            Value::F64(2.0),
            arr(vec![arr(vec![
                s("BlockStored"),
                ints(&[5, 6]),
                Value::from(4),
                ints(&[1, 2, 3, 4]),
                Value::from(2),
                Value::from(1),
                s("GPU"),
                s("adapter"),
                arr(vec![
                    arr(vec![
                        s("adapter"),
                        arr(vec![s("img-1"), Value::from(0)]),
                        s("salt"),
                    ]),
                    Value::Nil,
                ]),
                Value::from(0),
                s("full_attention"),
            ])]),
            Value::from(1),
        ]));
        let vllm_map = msgpack(&arr(vec![
            Value::F64(3.0),
            arr(vec![
                map(vec![
                    ("type", s("BlockStored")),
                    ("block_hashes", arr(vec![hash32(7), hash32(8)])),
                    ("parent_block_hash", hash32(6)),
                    ("token_ids", ints(&[1, 2, 3, 4])),
                    ("block_size", Value::from(2)),
                    ("lora_id", Value::Nil),
                    ("medium", s("GPU")),
                    ("group_idx", Value::from(0)),
                ]),
                map(vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", arr(vec![hash32(8)])),
                    ("medium", s("CPU")),
                ]),
                map(vec![("type", s("AllBlocksCleared"))]),
            ]),
            Value::Nil,
        ]));
        let sglang_positional = msgpack(&arr(vec![
            Value::from(17),
            arr(vec![
                arr(vec![
                    s("BlockStored"),
                    ints(&[-5, 7]),
                    Value::Nil,
                    ints(&[1, 2, 3, 4]),
                    Value::from(2),
                    Value::Nil,
                    s("GPU"),
                    map(vec![("cache_salt", s("tenant"))]),
                ]),
                arr(vec![s("BlockRemoved"), ints(&[-5])]),
            ]),
        ]));
        let sglang_map = msgpack(&arr(vec![
            Value::F32(1.0),
            arr(vec![
                map(vec![
                    ("type", s("BlockStored")),
                    ("block_hashes", ints(&[9])),
                    ("parent_block_hash", Value::from(-5)),
                    ("token_ids", ints(&[5, 6])),
                    ("block_size", Value::from(2)),
                    ("cache_salt", s("tenant")),
                ]),
                map(vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", ints(&[9])),
                ]),
            ]),
            Value::from(0),
        ]));
        let near = msgpack(&arr(vec![
            Value::F64(1.0),
            arr(vec![
                arr(vec![s("BlockMoved"), ints(&[1])]),
                arr(vec![
                    s("BlockStored"),
                    ints(&[1]),
                    Value::Nil,
                    ints(&[1, 2, 3]),
                    Value::from(3),
                ]),
                arr(vec![
                    s("BlockStored"),
                    ints(&[2]),
                    Value::Nil,
                    ints(&[1, 2]),
                    Value::from(2),
                    Value::Nil,
                    Value::Nil,
                    Value::Nil,
                    arr(vec![arr(vec![Value::Binary(vec![1, 2, 3])])]),
                ]),
                map(vec![
                    ("type", s("BlockStored")),
                    ("block_hashes", ints(&[3])),
                ]),
                Value::from(4),
            ]),
        ]));
        let seq = 42u64.to_be_bytes();
        let end = u64::MAX.to_be_bytes();
        vec![
            ("vllm-positional", flagged(BARE_BS2, &vllm)),
            (
                "vllm-positional-trailing-fields",
                flagged(BARE_BS2, &vllm_full),
            ),
            ("vllm-map-bytes-hashes", flagged(BARE_BS2 | 8, &vllm_map)),
            (
                "sglang-positional-signed",
                flagged(BARE_BS2 | SGLANG, &sglang_positional),
            ),
            ("sglang-map", flagged(BARE_BS2 | SGLANG, &sglang_map)),
            ("near-valid-events", flagged(BARE_BS2, &near)),
            ("truncated", flagged(BARE_BS2, &vllm[..vllm.len() / 2])),
            ("live", framed(BARE_BS2 | LIVE, &[b"kv@", &seq, &vllm])),
            (
                "live-short-seq",
                framed(BARE_BS2 | LIVE, &[b"kv@", &seq[..4], &vllm]),
            ),
            (
                "replay-delimited",
                framed(BARE_BS2 | REPLAY, &[b"", &seq, &vllm]),
            ),
            (
                "replay-topic",
                framed(BARE_BS2 | REPLAY | SGLANG, &[b"kv", &seq, &sglang_map]),
            ),
            ("replay-end", framed(BARE_BS2 | REPLAY, &[&end, b""])),
        ]
    }

    /// publish_events bytes (see `crate::fuzzing::publish`): a batch is
    /// an op byte (worker bit 3, rank bits 4..6) and an event count; an
    /// event an id step, a kind and its fields.
    struct Batch(Vec<u8>, u8);

    impl Batch {
        fn new(worker: u8, rank: u8) -> Self {
            Batch(vec![(worker << 3) | (rank << 4), 0], 0)
        }
        fn event(mut self, step: i8, body: &[u8]) -> Self {
            self.0.push(step as u8);
            self.0.extend_from_slice(body);
            self.1 += 1;
            self
        }
        /// Blocks as (engine hash, local hash < 3).
        fn store(self, step: i8, parent: Option<u8>, blocks: &[(u8, u8)]) -> Self {
            let mut body = vec![0, parent.unwrap_or(0xff), blocks.len() as u8];
            for &(engine, local) in blocks {
                body.extend_from_slice(&[engine, local]);
            }
            self.event(step, &body)
        }
        fn remove(self, step: i8, engines: &[u8]) -> Self {
            let mut body = vec![4, engines.len() as u8];
            body.extend_from_slice(engines);
            self.event(step, &body)
        }
        fn clear(self, step: i8) -> Self {
            self.event(step, &[6])
        }
        /// Worker `worker` goes (op 7): no count, no events.
        fn remove_worker(worker: u8) -> Self {
            Batch(vec![7 | (worker << 3)], 0)
        }
        fn bytes(mut self) -> Vec<u8> {
            if self.0[0] % 8 != 7 {
                self.0[1] = self.1;
            }
            self.0
        }
    }

    fn concat(batches: Vec<Batch>) -> Vec<u8> {
        batches.into_iter().flat_map(Batch::bytes).collect()
    }

    pub(crate) fn publish() -> Seeds {
        let in_order = || {
            Batch::new(0, 0)
                .store(0, None, &[(1, 0), (2, 1)])
                .store(1, Some(2), &[(3, 2)])
                .store(1, Some(1), &[(4, 2)])
                .remove(1, &[3])
        };
        let tokens = {
            let mut b = Batch::new(0, 1);
            // A stored block by token ids (2 of them), then a wrong count.
            b = b.event(0, &[0, 0xff, 1, 5, 0x80, 7, 8]);
            b.event(1, &[0, 0xff, 1, 6, 0xc1, 7])
        };
        vec![
            (
                "in-order",
                concat(vec![in_order(), Batch::new(0, 0).clear(1)]),
            ),
            (
                "gap-then-resend",
                concat(vec![
                    Batch::new(0, 0).store(0, None, &[(1, 0)]),
                    Batch::new(0, 0)
                        .store(2, Some(2), &[(3, 1)])
                        .remove(1, &[1]),
                    Batch::new(0, 0).store(-2, Some(1), &[(2, 2)]),
                ]),
            ),
            ("duplicate-batch", concat(vec![in_order(), in_order()])),
            (
                "unknown-parent-and-conflict",
                concat(vec![
                    Batch::new(0, 0)
                        .store(0, Some(9), &[(1, 0)])
                        .store(1, None, &[(1, 0), (2, 1)])
                        .store(1, None, &[(2, 0)]),
                ]),
            ),
            (
                "jump-then-resync",
                concat(vec![
                    Batch::new(0, 0).store(0, None, &[(1, 0)]),
                    Batch::new(0, 0)
                        .event(0, &[0xfe, 4])
                        .store(1, None, &[(2, 1)]),
                    Batch::new(0, 0).clear(2).store(1, None, &[(3, 2)]),
                ]),
            ),
            (
                "two-workers-and-removal",
                concat(vec![
                    in_order(),
                    Batch::new(1, 0).store(0, None, &[(1, 0), (5, 1)]),
                    Batch::remove_worker(0),
                    Batch::new(1, 0).store(1, None, &[(6, 2)]),
                ]),
            ),
            ("token-ids-and-malformed", tokens.bytes()),
            (
                "unregistered-rank-and-empty",
                concat(vec![
                    Batch::new(0, 2).store(0, None, &[(1, 0)]),
                    Batch::new(1, 0).event(0, &[0, 0xff, 0]).event(1, &[7]),
                ]),
            ),
            (
                "last-ids",
                concat(vec![
                    Batch::new(0, 0)
                        .event(0, &[0xff, 1])
                        .store(1, None, &[(1, 0)]),
                    Batch::new(0, 0).store(1, Some(1), &[(2, 1)]).clear(1),
                ]),
            ),
        ]
    }

    fn tokens(n: u32) -> pb::Prompt {
        pb::Prompt {
            content: Some(pb::prompt::Content::TokenIds(pb::TokenIds {
                ids: (0..n).collect(),
            })),
        }
    }

    pub(crate) fn select() -> Seeds {
        let base = pb::SelectWorkerRequest {
            request_id: "r1".into(),
            model: "m".into(),
            prompt: Some(tokens(16)),
            ..Default::default()
        };
        let locals = compute_block_hashes(
            &(0..16).collect::<Vec<u32>>(),
            4,
            &HashOptions::default(),
            None,
        );
        let hashes = pb::SelectWorkerRequest {
            prompt: Some(pb::Prompt {
                content: Some(pb::prompt::Content::BlockHashes(pb::BlockHashes {
                    hashes: locals,
                })),
            }),
            mode: pb::SelectionMode::QueryOnly as i32,
            admission: pb::AdmissionMode::Advisory as i32,
            ..base.clone()
        };
        let prefill = pb::SelectWorkerRequest {
            phase: pb::RequestPhase::Prefill as i32,
            hints: Some(pb::RoutingHints {
                allowed_worker_ids: vec![1, 2],
                tolerated_taints: vec!["spot".into()],
                dp_rank: Some(0),
                expected_output_tokens: Some(100),
                priority_jump: 1.0,
                ..Default::default()
            }),
            session: Some(pb::SessionAffinity {
                session_id: "s1".into(),
                mode: pb::AffinityMode::Hard as i32,
            }),
            ..base.clone()
        };
        let decode = pb::SelectWorkerRequest {
            phase: pb::RequestPhase::Decode as i32,
            planned_worker: Some(pb::WorkerRank {
                worker_id: 3,
                dp_rank: 0,
            }),
            excluded_worker_ids: vec![2],
            overrides: Some(pb::ScoringOverrides {
                overlap_weight: Some(2.0),
                temperature: Some(0.5),
            }),
            admission: pb::AdmissionMode::Reject as i32,
            ..base.clone()
        };
        let multimodal = pb::SelectWorkerRequest {
            block_mm_infos: vec![
                pb::BlockMultimodalInfo { mm_hashes: vec![7] },
                pb::BlockMultimodalInfo::default(),
            ],
            lora_name: "adapter".into(),
            cache_namespace: "tenant".into(),
            ..base.clone()
        };
        let near = [
            pb::SelectWorkerRequest {
                request_id: String::new(),
                ..base.clone()
            },
            pb::SelectWorkerRequest {
                model: "unknown".into(),
                prompt: Some(tokens(7)),
                ..base.clone()
            },
            pb::SelectWorkerRequest {
                overrides: Some(pb::ScoringOverrides {
                    overlap_weight: Some(f64::NAN),
                    temperature: Some(f64::INFINITY),
                }),
                phase: 9,
                ..base.clone()
            },
        ];
        vec![
            ("tokens", base.encode_to_vec()),
            ("hashes-query-only", hashes.encode_to_vec()),
            ("prefill-hints-session", prefill.encode_to_vec()),
            ("decode-planned-overrides", decode.encode_to_vec()),
            ("multimodal-lora-namespace", multimodal.encode_to_vec()),
            ("empty-id", near[0].encode_to_vec()),
            ("unknown-model-partial-block", near[1].encode_to_vec()),
            ("bad-overrides-phase", near[2].encode_to_vec()),
        ]
    }

    pub(crate) fn config() -> Seeds {
        let full = r#"# every kind of setting
grpc-addr = "0.0.0.0:50051"
metrics_addr = "127.0.0.1:9464"
block-size = 16
log-format = "json"
log-level = "info,kvroute=debug"
request-timeout = "5s"
lease-ttl = "10s"
overlap-weight = 1.5
temperature = 0.0
busy-threshold = 4
queue-capacity = 64
max-events-per-batch = 1024
require-snapshot = true
engine = ["7:llama:16:0:2:vllm:tcp://127.0.0.1:5557:tcp://127.0.0.1:5558"]
engine-endpoint-allow = ["tcp://10.0.0.0/8"]
cluster-replicas = 3
replica-index = 1
"#;
        let near = [
            "block-size = 0\n",
            "unknown = 1\n",
            "config = \"x.toml\"\n",
            "engine = [1]\n",
            "lease-ttl = { a = 1 }\n",
            "temperature = -1.0\nseed = 18446744073709551615\n",
            "engine = [\"1:m:16:0:1:sglang:tcp://[::1\"]\n",
            "tls-cert = \"a.pem\"\n",
            "grpc-addr = \"nowhere\n",
        ];
        let mut seeds = vec![("full", full.as_bytes().to_vec())];
        let names = [
            "block-size-zero",
            "unknown-key",
            "config-key",
            "engine-not-string",
            "table-value",
            "negative-and-max",
            "bad-endpoint",
            "tls-without-key",
            "unterminated-string",
        ];
        for (name, text) in names.into_iter().zip(near) {
            seeds.push((name, text.as_bytes().to_vec()));
        }
        seeds
    }

    /// Snapshot payloads (protobuf `SnapshotState`, without the header):
    /// a fleet a server would save, and the planted states #38 found.
    pub(crate) fn snapshot() -> Seeds {
        let worker = |worker_id: u64| pb::SnapshotWorker {
            worker_id,
            model: "m".into(),
            block_size: 16,
            dp_size: 2,
            total_kv_blocks: 32,
            lease_ttl_ms: 60_000,
            lease_remaining_ms: 30_000,
            ..Default::default()
        };
        let target = |worker_id: u64, dp_rank: u32| pb::SnapshotTarget {
            worker_id,
            dp_rank,
            last_event_id: Some(4),
            locals: vec![11, 12, 13],
            parent_back: vec![0, 1, 1],
            engines: vec![101, 102, 103],
            ..Default::default()
        };
        let fleet = pb::SnapshotState {
            taken_unix_ms: 1,
            routing_clock_ms: 0,
            workers: vec![worker(1), worker(2)],
            targets: vec![target(1, 0), target(1, 1), target(2, 0)],
            sessions: vec![pb::SnapshotSession {
                session_id: "s".into(),
                worker_id: 1,
                dp_rank: Some(0),
                idle_ms: 5,
            }],
            bookings: vec![pb::SnapshotBooking {
                request_id: "r".into(),
                worker_id: 2,
                prefill_outstanding: true,
                prefill_tokens: 40,
                prefill_blocks: 3,
                keys: vec![1, 2, 3],
                ..Default::default()
            }],
        };
        let planted = pb::SnapshotState {
            workers: vec![
                pb::SnapshotWorker {
                    total_kv_blocks: 1 << 63,
                    ..worker(3)
                },
                pb::SnapshotWorker {
                    dp_size: 1024,
                    ..worker(4)
                },
                pb::SnapshotWorker {
                    events_endpoint: "tcp://169.254.169.254:80".into(),
                    events_dialect: "vllm".into(),
                    ..worker(5)
                },
                worker(1),
                worker(1),
                worker(6),
                worker(7),
                worker(8),
            ],
            targets: vec![target(1, 9), target(9, 0)],
            ..Default::default()
        };
        vec![
            ("fleet", fleet.encode_to_vec()),
            ("planted", planted.encode_to_vec()),
            ("empty", Vec::new()),
        ]
    }

    /// Auth policy files: one of every kind of identity, and the lenient
    /// readings #38 found.
    pub(crate) fn policy() -> Seeds {
        let full = r#"reflection = true

[[identity]]
name = "frontend"
roles = ["frontend"]
san = ["spiffe://cluster/frontend"]

[[identity]]
name = "worker"
roles = ["worker"]
san = ["worker-0.engines.svc"]
worker_ids = ["1", "10-19"]

[[identity]]
name = "ops"
roles = ["operator-read", "operator-write"]
token_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

[[identity]]
name = "any-worker"
roles = ["worker"]
san = ["spiffe://cluster/any"]
worker_ids = ["*"]
"#;
        let near = [
            (
                "star-beside-ids",
                "[[identity]]\nname = \"w\"\nroles = [\"worker\"]\nsan = [\"a\"]\nworker_ids = [\"5\", \"*\"]\n",
            ),
            (
                "signed-id",
                "[[identity]]\nname = \"w\"\nroles = [\"worker\"]\nsan = [\"a\"]\nworker_ids = [\"+5\"]\n",
            ),
            (
                "no-ids",
                "[[identity]]\nname = \"w\"\nroles = [\"worker\"]\nsan = [\"a\"]\nworker_ids = []\n",
            ),
            (
                "backwards",
                "[[identity]]\nname = \"w\"\nroles = [\"worker\"]\nsan = [\"a\"]\nworker_ids = [\"9-1\"]\n",
            ),
            (
                "same-name",
                "[[identity]]\nname = \"a\"\nroles = [\"frontend\"]\nsan = [\"x\"]\n[[identity]]\nname = \"a\"\nroles = [\"frontend\"]\nsan = [\"y\"]\n",
            ),
            (
                "unclosed",
                "[[identity]]\nname = \"a\"\nroles = [\"frontend\"\n",
            ),
        ];
        let mut seeds = vec![("full", full.as_bytes().to_vec())];
        for (name, text) in near {
            seeds.push((name, text.as_bytes().to_vec()));
        }
        seeds
    }
}
