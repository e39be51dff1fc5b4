//! `Prompt.packed_token_ids` over real gRPC: the same prompt packed as
//! little-endian u32 routes exactly like it does as varint `token_ids`, and
//! a malformed packed prompt is refused with INVALID_ARGUMENT naming the
//! request, as the varint path refuses the same prompt, and counted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{TestServer, batch, registration};
use kvroute::{config::ServeConfig, pb};
use tonic::Code;

const WORKER_A: u64 = 1;
const WORKER_B: u64 = 2;

fn varint(ids: &[u32]) -> pb::prompt::Content {
    pb::prompt::Content::TokenIds(pb::TokenIds { ids: ids.to_vec() })
}

fn packed(ids: &[u32]) -> pb::prompt::Content {
    pb::prompt::Content::PackedTokenIds(ids.iter().flat_map(|t| t.to_le_bytes()).collect())
}

fn select(request_id: &str, content: pb::prompt::Content) -> pb::SelectWorkerRequest {
    pb::SelectWorkerRequest {
        request_id: request_id.into(),
        model: "m".into(),
        prompt: Some(pb::Prompt {
            content: Some(content),
        }),
        mode: pb::SelectionMode::QueryOnly.into(),
        ..Default::default()
    }
}

/// Stores the first `blocks` 16-token blocks of `tokens` on `worker`, as
/// its event `event_id`, under `lora`.
async fn store(
    server: &TestServer,
    (worker, event_id): (u64, u64),
    tokens: &[u32],
    blocks: usize,
    lora: &str,
) {
    let stored = tokens
        .chunks_exact(16)
        .take(blocks)
        .enumerate()
        .map(|(i, chunk)| pb::StoredBlock {
            engine_hash: 1000 * (event_id + 1) + i as u64,
            content: Some(pb::stored_block::Content::TokenIds(pb::TokenIds {
                ids: chunk.to_vec(),
            })),
            mm_info: None,
        })
        .collect();
    let event = pb::KvEvent {
        event_id,
        kind: Some(pb::kv_event::Kind::Stored(pb::BlocksStored {
            tier: 0,
            parent_engine_hash: None,
            blocks: stored,
            lora_name: lora.into(),
            cache_namespace: String::new(),
        })),
    };
    let reply = server.publish(batch(worker, 0, vec![event])).await.unwrap();
    assert_eq!(reply.rejected, 0);
}

#[tokio::test]
async fn packed_and_varint_token_ids_get_the_same_answer() {
    let server = TestServer::start().await;
    server.register(registration(WORKER_A, "m")).await;
    server.register(registration(WORKER_B, "m")).await;
    // Large ids (several varint bytes) and a partial last block.
    let tokens: Vec<u32> = (0..1000u32)
        .map(|t| t.wrapping_mul(2_654_435_761))
        .collect();
    store(&server, (WORKER_A, 0), &tokens, 10, "").await;
    store(&server, (WORKER_B, 0), &tokens, 30, "").await;
    let mut router = server.router();
    for len in [16, 17, 200, 480, 1000] {
        let prompt = &tokens[..len];
        let by_varint = router
            .select_worker(select(&format!("v{len}"), varint(prompt)))
            .await
            .unwrap()
            .into_inner();
        let by_packed = router
            .select_worker(select(&format!("p{len}"), packed(prompt)))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(by_varint, by_packed, "prompt of {len} tokens");
    }
    let whole = router
        .select_worker(select("whole", packed(&tokens)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((whole.worker_id, whole.overlap_blocks), (WORKER_B, 30));
    assert_eq!(whole.total_blocks, 63);
    // A LoRA name and multimodal objects change block identity alike.
    let mut with_lora = select("lora-v", varint(&tokens[..64]));
    with_lora.lora_name = "adapter".into();
    with_lora.block_mm_infos = vec![
        pb::BlockMultimodalInfo { mm_hashes: vec![] },
        pb::BlockMultimodalInfo {
            mm_hashes: vec![7, 3],
        },
    ];
    let mut packed_lora = with_lora.clone();
    packed_lora.request_id = "lora-p".into();
    packed_lora.prompt = Some(pb::Prompt {
        content: Some(packed(&tokens[..64])),
    });
    store(&server, (WORKER_A, 1), &tokens, 4, "adapter").await;
    let a = router.select_worker(with_lora).await.unwrap().into_inner();
    let b = router
        .select_worker(packed_lora)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a, b);
    // Block 0 is plain under the adapter; block 1's objects make it differ.
    assert_eq!((a.worker_id, a.overlap_blocks), (WORKER_A, 1));
}

#[tokio::test]
async fn malformed_packed_prompts_are_invalid_argument_naming_the_request() {
    let config = ServeConfig {
        max_blocks_per_event: 8,
        ..ServeConfig::for_tests()
    };
    let server = TestServer::start_with(config).await;
    server.register(registration(WORKER_A, "m")).await;
    let refuse = async |request: pb::SelectWorkerRequest| {
        let status = server
            .router()
            .select_worker(request)
            .await
            .expect_err("refused");
        (status.code(), status.message().to_string())
    };

    let mut ragged = select("ragged-1", packed(&[1, 2, 3]));
    if let Some(pb::prompt::Content::PackedTokenIds(bytes)) =
        ragged.prompt.as_mut().and_then(|p| p.content.as_mut())
    {
        *bytes = bytes.slice(..11);
    }
    let (code, message) = refuse(ragged).await;
    assert_eq!(code, Code::InvalidArgument);
    assert!(
        message.contains("ragged-1") && message.contains("packed_token_ids"),
        "{message}"
    );
    assert!(message.contains("11 bytes"), "{message}");

    // 8 blocks of 16 tokens is the limit: 129 tokens are over it, either way.
    let over: Vec<u32> = (0..129).collect();
    let (code, message) = refuse(select("big-p", packed(&over))).await;
    assert_eq!(code, Code::InvalidArgument);
    assert!(
        message.contains("big-p") && message.contains("129 tokens") && message.contains("128"),
        "{message}"
    );
    let (varint_code, varint_message) = refuse(select("big-v", varint(&over))).await;
    assert_eq!(varint_code, code);
    assert!(
        varint_message.contains("129 tokens is over the limit of 128"),
        "{varint_message}"
    );
    assert!(
        message.contains("129 tokens is over the limit of 128"),
        "{message}"
    );
    let at_limit = select("limit", packed(&over[..128]));
    server.router().select_worker(at_limit).await.unwrap();

    let (code, message) = refuse(select("empty-p", packed(&[]))).await;
    assert_eq!(code, Code::InvalidArgument);
    assert!(
        message.contains("empty-p") && message.contains("empty"),
        "{message}"
    );

    let (_, metrics) = server.http_get("/metrics").await;
    let refused = metrics
        .lines()
        .find(|l| {
            l.starts_with("kvroute_input_rejected_total")
                && l.contains("area=\"router\"")
                && l.contains("INVALID_ARGUMENT")
        })
        .unwrap_or_default();
    assert!(refused.ends_with(" 4"), "{refused}");
}
