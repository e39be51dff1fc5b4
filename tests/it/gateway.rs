//! The endpoint picker over a real ext_proc stream: a tonic client plays
//! Envoy's part of the protocol (headers, the body in
//! `FULL_DUPLEX_STREAMED` chunks, then the response) against the real
//! server, with workers registered and their blocks published over gRPC.
//! The real Envoy in front of stub engines is tests/python/test_gateway.py.

use std::{net::SocketAddr, time::Duration};

use envoy_types::pb::{
    envoy::{
        config::core::v3::{HeaderMap, HeaderValue, Metadata},
        service::ext_proc::v3::{
            HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, body_mutation::Mutation,
            external_processor_client::ExternalProcessorClient, processing_request::Request as Req,
            processing_response::Response as Resp,
        },
    },
    google::protobuf::{ListValue, Struct, Value, value::Kind},
};
use kvroute::{config::ServeConfig, pb};
use kvroute_core::hashing::{HashOptions, compute_block_hashes};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::common::{TestServer, batch, cluster::free_addr, registration, stored};

const MODEL: &str = "m";
const BLOCK: u32 = 16;

/// What the picker answered a request with.
#[derive(Debug)]
enum Answer {
    Routed {
        header: String,
        metadata: String,
        dp_rank: Option<String>,
        content_length: Option<String>,
        removed: Vec<String>,
        body: Vec<u8>,
        chunks: Vec<usize>,
    },
    Refused(u16, String),
}

impl Answer {
    fn endpoints(&self) -> Vec<String> {
        match self {
            Self::Routed { header, .. } => header.split(',').map(str::to_owned).collect(),
            Self::Refused(status, body) => panic!("refused with {status}: {body}"),
        }
    }

    fn status(&self) -> u16 {
        match self {
            Self::Routed { .. } => 200,
            Self::Refused(status, _) => *status,
        }
    }
}

/// Envoy's side of one ext_proc stream.
struct Stream {
    tx: Option<mpsc::Sender<ProcessingRequest>>,
    rx: tonic::Streaming<ProcessingResponse>,
}

fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}

fn subset_metadata(subset: &[&str]) -> Metadata {
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: subset
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue((*s).into())),
                })
                .collect(),
        })),
    };
    Metadata {
        filter_metadata: [(
            "envoy.lb.subset_hint".to_owned(),
            Struct {
                fields: [("x-gateway-destination-endpoint-subset".to_owned(), list)].into(),
            },
        )]
        .into(),
        ..Default::default()
    }
}

impl Stream {
    async fn open(addr: SocketAddr) -> Self {
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .expect("connect ext_proc");
        let (tx, rx) = mpsc::channel(64);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .expect("open ext_proc stream")
            .into_inner();
        Self { tx: Some(tx), rx }
    }

    async fn send(&self, request: Req, metadata: Option<Metadata>) {
        let message = ProcessingRequest {
            request: Some(request),
            metadata_context: metadata,
            ..Default::default()
        };
        self.tx
            .as_ref()
            .expect("open")
            .send(message)
            .await
            .expect("send to picker");
    }

    async fn headers(&self, pairs: &[(&str, &str)], end_of_stream: bool, subset: Option<&[&str]>) {
        let headers = HttpHeaders {
            headers: Some(header_map(pairs)),
            end_of_stream,
            ..Default::default()
        };
        self.send(Req::RequestHeaders(headers), subset.map(subset_metadata))
            .await;
    }

    async fn body(&self, body: &[u8], end_of_stream: bool) {
        let chunk = HttpBody {
            body: body.to_vec(),
            end_of_stream,
            ..Default::default()
        };
        self.send(Req::RequestBody(chunk), None).await;
    }

    async fn next(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("picker answered in time")
            .expect("stream healthy")
            .expect("stream open")
    }

    /// Reads the pick: a headers response and the body's chunks, or an
    /// immediate response.
    async fn answer(&mut self) -> Answer {
        let first = self.next().await;
        let headers = match first.response {
            Some(Resp::ImmediateResponse(immediate)) => {
                return Answer::Refused(
                    u16::try_from(immediate.status.unwrap().code).unwrap(),
                    String::from_utf8_lossy(&immediate.body).into_owned(),
                );
            }
            Some(Resp::RequestHeaders(headers)) => headers,
            other => panic!("expected the request headers answer, got {other:?}"),
        };
        let common = headers.response.unwrap();
        assert!(common.clear_route_cache, "the route cache must be cleared");
        let mutation = common.header_mutation.unwrap();
        let set = |name: &str| {
            mutation
                .set_headers
                .iter()
                .filter_map(|h| h.header.as_ref())
                .find(|h| h.key == name)
                .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
        };
        let lb = first.dynamic_metadata.unwrap().fields["envoy.lb"].clone();
        let Some(Kind::StructValue(lb)) = lb.kind else {
            panic!("envoy.lb is not a struct")
        };
        let Some(Kind::StringValue(metadata)) =
            lb.fields["x-gateway-destination-endpoint"].kind.clone()
        else {
            panic!("no destination in envoy.lb")
        };
        let mut body = Vec::new();
        let mut chunks = Vec::new();
        let content_length = set("content-length");
        if content_length.is_some() {
            loop {
                let Some(Resp::RequestBody(answer)) = self.next().await.response else {
                    panic!("expected a request body chunk");
                };
                let Some(Mutation::StreamedResponse(chunk)) =
                    answer.response.unwrap().body_mutation.unwrap().mutation
                else {
                    panic!("body not streamed back");
                };
                chunks.push(chunk.body.len());
                body.extend_from_slice(&chunk.body);
                if chunk.end_of_stream {
                    break;
                }
            }
        }
        Answer::Routed {
            header: set("x-gateway-destination-endpoint").unwrap(),
            metadata,
            dp_rank: set("x-data-parallel-rank"),
            content_length,
            removed: mutation.remove_headers,
            body,
            chunks,
        }
    }

    /// The engine's answer passing back: status, then the body in chunks.
    async fn response(&mut self, status: u16, chunks: &[&[u8]]) {
        let headers = HttpHeaders {
            headers: Some(header_map(&[(":status", &status.to_string())])),
            end_of_stream: chunks.is_empty(),
            ..Default::default()
        };
        self.send(Req::ResponseHeaders(headers), None).await;
        assert!(matches!(
            self.next().await.response,
            Some(Resp::ResponseHeaders(_))
        ));
        for (i, chunk) in chunks.iter().enumerate() {
            self.send(
                Req::ResponseBody(HttpBody {
                    body: chunk.to_vec(),
                    end_of_stream: i + 1 == chunks.len(),
                    ..Default::default()
                }),
                None,
            )
            .await;
            let Some(Resp::ResponseBody(answer)) = self.next().await.response else {
                panic!("expected the response chunk back");
            };
            let Some(Mutation::StreamedResponse(back)) =
                answer.response.unwrap().body_mutation.unwrap().mutation
            else {
                panic!("response chunk not streamed back");
            };
            assert_eq!(back.body, *chunk, "the response passes unchanged");
        }
    }

    /// Envoy goes away (the client disconnected, a reset).
    fn abandon(mut self) {
        self.tx = None;
        drop(self.rx);
    }
}

/// A request through the picker: headers, the body in one chunk, the pick.
async fn request(addr: SocketAddr, path: &str, body: &[u8]) -> (Stream, Answer) {
    let mut stream = Stream::open(addr).await;
    stream
        .headers(&[(":path", path), (":method", "POST")], false, None)
        .await;
    stream.body(body, true).await;
    let answer = stream.answer().await;
    (stream, answer)
}

fn completion(tokens: &[u32]) -> Vec<u8> {
    serde_json::json!({"model": MODEL, "prompt": tokens, "max_tokens": 4})
        .to_string()
        .into_bytes()
}

fn tokens(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 100_000 + i).collect()
}

/// A server with the picker on, `extra` flags applied.
async fn server(extra: impl FnOnce(&mut ServeConfig)) -> (TestServer, SocketAddr) {
    let ext_proc = free_addr();
    let mut config = ServeConfig::for_tests();
    config.gateway.ext_proc_addr = Some(ext_proc);
    extra(&mut config);
    let server = TestServer::start_with(config).await;
    (server, ext_proc)
}

async fn worker(server: &TestServer, id: u64, port: u16, dp_size: u32) {
    server
        .register(pb::RegisterWorkerRequest {
            endpoint: format!("127.0.0.1:{port}"),
            dp_size,
            lease_ttl_secs: 600,
            ..registration(id, MODEL)
        })
        .await;
}

/// Publishes that `(id, rank)` holds the blocks of `tokens`, as an engine
/// does, hashed with `options`.
async fn holds(
    server: &TestServer,
    id: u64,
    rank: u32,
    first_event: u64,
    tokens: &[u32],
    options: HashOptions<'_>,
) {
    let locals = compute_block_hashes(tokens, BLOCK, &options, None);
    let blocks: Vec<(u64, u64)> = locals
        .iter()
        .enumerate()
        .map(|(i, local)| {
            (
                id * 1_000_000 + u64::from(rank) * 10_000 + i as u64 + 1,
                *local,
            )
        })
        .collect();
    server
        .publish(batch(id, rank, vec![stored(first_event, None, &blocks)]))
        .await
        .expect("publish");
}

async fn booked_requests(server: &TestServer, id: u64) -> u32 {
    server
        .worker_info(id)
        .await
        .ranks
        .iter()
        .map(|r| r.booked_load.unwrap_or_default().active_requests)
        .sum()
}

#[tokio::test]
async fn a_prompt_goes_where_its_prefix_is_cached_and_the_body_comes_back_whole() {
    let (server, ext_proc) = server(|_| {}).await;
    worker(&server, 1, 8001, 1).await;
    worker(&server, 2, 8002, 1).await;
    let prompt = tokens(1, 8);
    holds(&server, 2, 0, 1, &prompt, HashOptions::plain()).await;
    let body = completion(&prompt);
    let (_stream, answer) = request(ext_proc, "/v1/completions", &body).await;
    let Answer::Routed {
        header,
        metadata,
        body: back,
        content_length,
        dp_rank,
        removed,
        ..
    } = &answer
    else {
        panic!("{answer:?}");
    };
    assert_eq!(answer.endpoints()[0], "127.0.0.1:8002");
    assert_eq!(
        header, metadata,
        "header and metadata name the same endpoints"
    );
    assert_eq!(
        answer.endpoints(),
        ["127.0.0.1:8002", "127.0.0.1:8001"],
        "one fallback after the pick"
    );
    assert_eq!(back, &body);
    assert_eq!(
        content_length.as_deref(),
        Some(body.len().to_string().as_str())
    );
    assert_eq!(*dp_rank, None, "a one-rank worker gets no rank header");
    assert!(
        removed.iter().any(|h| h == "x-data-parallel-rank"),
        "a client's own rank header is dropped"
    );
    // The same prompt salted, or for an adapter, shares nothing cached.
    let salted = serde_json::json!({"model": MODEL, "prompt": prompt, "cache_salt": "tenant-a"});
    let options = HashOptions {
        lora_name: None,
        cache_namespace: Some("tenant-a"),
    };
    holds(&server, 1, 0, 1, &prompt, options).await;
    let (_s, answer) = request(ext_proc, "/v1/completions", salted.to_string().as_bytes()).await;
    assert_eq!(
        answer.endpoints()[0],
        "127.0.0.1:8001",
        "the salt is part of the hash"
    );
}

#[tokio::test]
async fn a_large_body_goes_back_in_62000_byte_chunks() {
    let (server, ext_proc) = server(|_| {}).await;
    worker(&server, 1, 8001, 1).await;
    let text = "x".repeat(200_000);
    let body = serde_json::json!({"model": MODEL, "prompt": text})
        .to_string()
        .into_bytes();
    // Sent in Envoy-sized pieces, an empty final chunk ending it.
    let mut stream = Stream::open(ext_proc).await;
    stream
        .headers(&[(":path", "/v1/completions")], false, None)
        .await;
    for piece in body.chunks(16_384) {
        stream.body(piece, false).await;
    }
    stream.body(&[], true).await;
    let answer = stream.answer().await;
    let Answer::Routed {
        body: back, chunks, ..
    } = answer
    else {
        panic!()
    };
    assert_eq!(back, body);
    assert!(chunks.iter().all(|c| *c <= 62_000), "{chunks:?}");
    assert_eq!(chunks.len(), body.len().div_ceil(62_000));
    // Envoy's resent final chunk (envoy#46237) is ignored: the stream goes on.
    stream.body(body.chunks(16_384).last().unwrap(), true).await;
    stream.response(200, &[b"{}"]).await;
    assert_eq!(booked_requests(&server, 1).await, 0);
}

#[tokio::test]
async fn the_rank_is_picked_behind_one_endpoint_and_named_in_a_header() {
    let (server, ext_proc) = server(|_| {}).await;
    worker(&server, 1, 8001, 2).await;
    let prompt = tokens(3, 6);
    holds(&server, 1, 1, 1, &prompt, HashOptions::plain()).await;
    let (_s, answer) = request(ext_proc, "/v1/completions", &completion(&prompt)).await;
    let Answer::Routed {
        dp_rank, header, ..
    } = answer
    else {
        panic!()
    };
    assert_eq!(
        header, "127.0.0.1:8001",
        "one endpoint: no fallback to itself"
    );
    assert_eq!(dp_rank.as_deref(), Some("1"));
}

#[tokio::test]
async fn the_proxys_subset_hint_is_obeyed() {
    let (server, ext_proc) = server(|_| {}).await;
    worker(&server, 1, 8001, 1).await;
    worker(&server, 2, 8002, 1).await;
    let prompt = tokens(4, 8);
    holds(&server, 2, 0, 1, &prompt, HashOptions::plain()).await;
    let body = completion(&prompt);
    for (subset, expected) in [
        (&["127.0.0.1:8001"][..], Some("127.0.0.1:8001")),
        (&["10.9.9.9:80"][..], None),
        (&[][..], None),
    ] {
        let mut stream = Stream::open(ext_proc).await;
        stream
            .headers(&[(":path", "/v1/completions")], false, Some(subset))
            .await;
        stream.body(&body, true).await;
        let answer = stream.answer().await;
        match expected {
            Some(endpoint) => assert_eq!(answer.endpoints(), [endpoint], "only the subset"),
            None => assert_eq!(answer.status(), 503, "{subset:?}: {answer:?}"),
        }
    }
}

#[tokio::test]
async fn errors_get_the_protocols_statuses_and_the_stream_goes_on() {
    let (server, ext_proc) = server(|c| c.gateway.epp_max_body_bytes = 4 << 20).await;
    worker(&server, 1, 8001, 1).await;
    let nested = format!(
        "{{\"model\":\"m\",\"prompt\":{}1{}}}",
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    let huge = serde_json::json!({"model": MODEL, "prompt": "y".repeat(10 << 20)}).to_string();
    let many = serde_json::json!({"model": MODEL, "messages": vec![serde_json::json!({"role": "user", "content": "hi"}); 100_000]}).to_string();
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        (
            "/v1/chat/completions",
            b"{\"model\": \"m\", \"messages\": [".to_vec(),
            400,
        ),
        ("/v1/chat/completions", b"not json".to_vec(), 400),
        ("/v1/chat/completions", b"[1, 2]".to_vec(), 400),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": "hi"}]}"#.to_vec(),
            400,
        ),
        (
            "/v1/chat/completions",
            br#"{"model": 5, "messages": []}"#.to_vec(),
            400,
        ),
        (
            "/v1/chat/completions",
            br#"{"model": "m", "messages": "hi"}"#.to_vec(),
            400,
        ),
        (
            "/v1/chat/completions",
            br#"{"model": "m", "messages": [{"role": "user"}], "tools": 3}"#.to_vec(),
            400,
        ),
        (
            "/v1/chat/completions",
            br#"{"model": "m", "messages": [{"role": "user", "content": 7}]}"#.to_vec(),
            400,
        ),
        (
            "/v1/completions",
            br#"{"model": "m", "prompt": [1, -1]}"#.to_vec(),
            400,
        ),
        (
            "/v1/completions",
            br#"{"model": "m", "prompt": "hi", "stream": "yes"}"#.to_vec(),
            400,
        ),
        ("/v1/completions", nested.into_bytes(), 400),
        ("/v1/completions", huge.into_bytes(), 413),
        (
            "/v1/completions",
            br#"{"model": "nobody-serves-this", "prompt": "hi"}"#.to_vec(),
            503,
        ),
        // No tokenizer for the model: routed by load, not refused.
        ("/v1/chat/completions", many.into_bytes(), 200),
        (
            "/v1/embeddings",
            br#"{"model": "m", "input": "hi"}"#.to_vec(),
            200,
        ),
    ];
    for (path, body, status) in cases {
        let mut stream = Stream::open(ext_proc).await;
        stream.headers(&[(":path", path)], false, None).await;
        for piece in body.chunks(65_536) {
            stream.body(piece, false).await;
        }
        stream.body(&[], true).await;
        let answer = stream.answer().await;
        assert_eq!(
            answer.status(),
            status,
            "{path} {:?}: {answer:?}",
            String::from_utf8_lossy(&body[..body.len().min(60)])
        );
        if let Answer::Refused(_, error) = &answer {
            let error: serde_json::Value = serde_json::from_str(error).expect("a JSON error body");
            assert_eq!(error["error"]["code"], status);
        }
    }
    // A content-length over the limit is refused before any byte is read.
    let mut stream = Stream::open(ext_proc).await;
    stream
        .headers(
            &[
                (":path", "/v1/completions"),
                ("content-length", "999999999999"),
            ],
            false,
            None,
        )
        .await;
    assert_eq!(stream.answer().await.status(), 413);
    // One that lies the other way changes nothing: only what arrives counts.
    let body = completion(&tokens(5, 2));
    let mut stream = Stream::open(ext_proc).await;
    stream
        .headers(
            &[(":path", "/v1/completions"), ("content-length", "3")],
            false,
            None,
        )
        .await;
    stream.body(&body, true).await;
    let Answer::Routed { content_length, .. } = stream.answer().await else {
        panic!()
    };
    assert_eq!(
        content_length,
        Some(body.len().to_string()),
        "the real length is set"
    );
    let metrics = server.http_get("/metrics").await.1;
    assert!(
        metrics.contains("kvroute_epp_requests_total{outcome=\"bad_request\"} 11"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvroute_epp_untokenized_total{reason=\"no_tokenizer\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvroute_epp_buffered_body_bytes 0"),
        "bodies are let go"
    );
}

#[tokio::test]
async fn every_candidate_busy_under_reject_is_429() {
    use kvroute::config::EppAdmission;
    let (server, ext_proc) = server(|c| {
        c.gateway.epp_admission = EppAdmission::Reject;
        c.busy_threshold = 1.0;
    })
    .await;
    server
        .register(pb::RegisterWorkerRequest {
            endpoint: "127.0.0.1:8001".into(),
            max_num_batched_tokens: 64,
            lease_ttl_secs: 600,
            ..registration(1, MODEL)
        })
        .await;
    // The first books 128 uncached tokens on a 64-token budget: busy after.
    let (_held, first) = request(ext_proc, "/v1/completions", &completion(&tokens(6, 8))).await;
    assert_eq!(first.status(), 200);
    let (_s, second) = request(ext_proc, "/v1/completions", &completion(&tokens(7, 8))).await;
    assert_eq!(second.status(), 429, "{second:?}");
}

/// Waits (up to 2 s) for worker 1 to hold no booking.
async fn no_booking_left(server: &TestServer, why: &str) {
    for _ in 0..100 {
        if booked_requests(server, 1).await == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{why}");
}

#[tokio::test]
async fn booked_load_returns_to_zero_after_finished_failed_and_abandoned_streams() {
    let (server, ext_proc) = server(|_| {}).await;
    worker(&server, 1, 8001, 1).await;
    let prompt = tokens(8, 4);
    holds(&server, 1, 0, 1, &prompt, HashOptions::plain()).await;
    let usage = br#"{"usage":{"prompt_tokens":64,"prompt_tokens_details":{"cached_tokens":48}}}"#;

    let (mut finished, _) = request(ext_proc, "/v1/completions", &completion(&prompt)).await;
    assert_eq!(booked_requests(&server, 1).await, 1, "a pick is a booking");
    let prefill = |info: pb::WorkerInfo| info.ranks[0].booked_load.unwrap().prefill_tokens;
    finished
        .response(200, &[b"data: {\"choices\":[]}\n\n", usage])
        .await;
    // The booking's own task releases it, just after the last chunk.
    no_booking_left(&server, "a finished stream's booking must be released").await;
    assert_eq!(prefill(server.worker_info(1).await), 0);

    let (mut failed, _) = request(ext_proc, "/v1/completions", &completion(&prompt)).await;
    failed.response(500, &[b"{\"error\":\"engine\"}"]).await;
    no_booking_left(&server, "a failed stream's booking must be released").await;

    let (abandoned, _) = request(ext_proc, "/v1/completions", &completion(&prompt)).await;
    assert_eq!(booked_requests(&server, 1).await, 1);
    abandoned.abandon();
    no_booking_left(&server, "an abandoned stream's booking must be released").await;
    // Abandoned mid-response too.
    let (mut cut, _) = request(ext_proc, "/v1/completions", &completion(&prompt)).await;
    cut.send(
        Req::ResponseHeaders(HttpHeaders {
            headers: Some(header_map(&[(":status", "200")])),
            ..Default::default()
        }),
        None,
    )
    .await;
    cut.next().await;
    cut.abandon();
    no_booking_left(
        &server,
        "a stream cut mid-response must release its booking",
    )
    .await;
    // The finished stream's cached tokens reached the feedback.
    let feedback = server
        .worker_info(1)
        .await
        .cached_tokens_feedback
        .expect("feedback recorded");
    assert_eq!(feedback.reports, 1, "only the finished stream reports");
    let metrics = server.http_get("/metrics").await.1;
    for end in ["finished", "failed", "abandoned"] {
        assert!(
            metrics.contains(&format!("kvroute_epp_streams_ended_total{{end=\"{end}\"}}")),
            "{end}"
        );
    }
}

#[tokio::test]
async fn health_reports_on_the_ext_proc_port_for_envoys_checks() {
    let (_server, ext_proc) = server(|_| {}).await;
    let channel = crate::common::connect(ext_proc).await;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    for service in [
        "",
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health answers")
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service:?}"
        );
    }
}

/// The committed tiny tokenizer (tests/data/tokenizer-tiny).
fn tiny_tokenizer() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer-tiny")
}

fn words(range: std::ops::Range<u32>) -> String {
    range.map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ")
}

#[tokio::test]
async fn chats_are_tokenized_as_the_engine_does_and_later_turns_reuse_the_prefix() {
    use kvroute::config::TokenizerDir;
    use kvroute_prompt::{ModelTokenizer, request};
    let (server, ext_proc) = server(|c| {
        c.gateway.epp_tokenizer = vec![TokenizerDir {
            model: MODEL.into(),
            dir: tiny_tokenizer(),
        }];
    })
    .await;
    worker(&server, 1, 8001, 1).await;
    worker(&server, 2, 8002, 1).await;
    let first = serde_json::json!({"model": MODEL, "messages": [
        {"role": "system", "content": words(0..40)},
        {"role": "user", "content": words(40..80)},
    ]});
    // The engine's ids for this chat, as the engine's tokenizer gives them:
    // worker 2 holds them.
    let tokenizer = ModelTokenizer::from_dir(&tiny_tokenizer()).unwrap();
    let parsed = request::parse(
        Some(request::Endpoint::ChatCompletions),
        first.to_string().as_bytes(),
    )
    .unwrap();
    let ids = tokenizer.prompt_ids(&parsed).unwrap();
    assert!(ids.len() >= 80, "{}", ids.len());
    holds(&server, 2, 0, 1, &ids, HashOptions::plain()).await;
    let (_s, answer) = request(
        ext_proc,
        "/v1/chat/completions",
        first.to_string().as_bytes(),
    )
    .await;
    assert_eq!(
        answer.endpoints()[0],
        "127.0.0.1:8002",
        "the chat's blocks are on worker 2"
    );
    // The next turn repeats the first: its earlier segments come from the
    // cache, and it still goes where its prefix is.
    let second = serde_json::json!({"model": MODEL, "messages": [
        {"role": "system", "content": words(0..40)},
        {"role": "user", "content": words(40..80)},
        {"role": "assistant", "content": words(80..90)},
        {"role": "user", "content": words(90..120)},
    ]});
    let (_s, answer) = request(
        ext_proc,
        "/v1/chat/completions",
        second.to_string().as_bytes(),
    )
    .await;
    assert_eq!(answer.endpoints()[0], "127.0.0.1:8002");
    let metrics = server.http_get("/metrics").await.1;
    let cached: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvroute_epp_prompt_tokens_total{source=\"cached\"} "))
        .and_then(|v| v.parse().ok())
        .expect("cached tokens counted");
    assert!(
        cached >= 80,
        "the first turn's segments were cached: {cached}\n{metrics}"
    );

    // A request's own template that loops, or raises, is the client's error.
    for template in [
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "{{ raise_exception('no system messages here') }}",
        "{% for %}",
    ] {
        let body = serde_json::json!({"model": MODEL, "chat_template": template,
            "messages": [{"role": "user", "content": "w1"}]});
        let (_s, answer) = request(
            ext_proc,
            "/v1/chat/completions",
            body.to_string().as_bytes(),
        )
        .await;
        assert_eq!(answer.status(), 400, "{template}: {answer:?}");
    }
    // 100,000 messages render and tokenize (within the template's fuel)
    // and are routed like any chat.
    let many: Vec<_> = (0..100_000)
        .map(|i| serde_json::json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("w{}", i % 512)}))
        .collect();
    let body = serde_json::json!({"model": MODEL, "messages": many});
    let (_s, answer) = request(
        ext_proc,
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    )
    .await;
    assert_eq!(answer.status(), 200, "{answer:?}");
    // Images cannot be tokenized here: routed by load, counted.
    let image = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]});
    let (_s, answer) = request(
        ext_proc,
        "/v1/chat/completions",
        image.to_string().as_bytes(),
    )
    .await;
    assert_eq!(answer.status(), 200);
    let metrics = server.http_get("/metrics").await.1;
    assert!(
        metrics.contains("kvroute_epp_untokenized_total{reason=\"untokenizable\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_lora_adapter_routes_among_its_base_models_workers_with_its_own_hashes() {
    use kvroute::config::AdapterOf;
    let (server, ext_proc) = server(|c| {
        c.gateway.epp_lora = vec![AdapterOf {
            adapter: "sql".into(),
            base: MODEL.into(),
        }];
    })
    .await;
    worker(&server, 1, 8001, 1).await;
    worker(&server, 2, 8002, 1).await;
    let prompt = tokens(9, 8);
    // Worker 1 holds the base model's blocks, worker 2 the adapter's.
    holds(&server, 1, 0, 1, &prompt, HashOptions::plain()).await;
    holds(
        &server,
        2,
        0,
        1,
        &prompt,
        HashOptions {
            lora_name: Some("sql"),
            cache_namespace: None,
        },
    )
    .await;
    let body = |model: &str| serde_json::json!({"model": model, "prompt": prompt}).to_string();
    let (_s, base) = request(ext_proc, "/v1/completions", body(MODEL).as_bytes()).await;
    assert_eq!(base.endpoints()[0], "127.0.0.1:8001");
    let (_s, adapter) = request(ext_proc, "/v1/completions", body("sql").as_bytes()).await;
    assert_eq!(adapter.endpoints()[0], "127.0.0.1:8002");
}
