//! Golden vectors for both dialects and both encodings, written byte by byte
//! from the published format description (msgpack spec + the field order of
//! the engines' event structs), plus processor tests over a real `KvIndex`.

use super::wire::*;
use super::*;
use kvroute_core::hashing::{HashOptions, compute_block_hashes};

// --- tiny msgpack byte builders (each is one msgpack spec rule) -----------

/// fixstr (len < 32): 0xa0 | len, then UTF-8.
fn s(x: &str) -> Vec<u8> {
    assert!(x.len() < 32);
    let mut v = vec![0xa0 | x.len() as u8];
    v.extend_from_slice(x.as_bytes());
    v
}

/// bin8: 0xc4, len, bytes.
fn bin(b: &[u8]) -> Vec<u8> {
    let mut v = vec![0xc4, b.len() as u8];
    v.extend_from_slice(b);
    v
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

const NIL: &[u8] = &[0xc0];
/// float64 1.5 (0xcb + IEEE-754 big-endian).
const TS_1_5: &[u8] = &[0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0];

fn hash32(last8: u64) -> Vec<u8> {
    let mut b = vec![0xaa; 24];
    b.extend_from_slice(&last8.to_be_bytes());
    b
}

// --- vLLM, positional arrays (<= 0.23) ------------------------------------

fn vllm_array_batch() -> Vec<u8> {
    cat(&[
        &[0x93], // [ts, events, dp_rank]
        TS_1_5,
        &[0x93], // 3 events
        // ["BlockStored", [1, u64::MAX-1], nil, [10,11,12,13], 2, nil, "GPU", nil]
        &[0x98],
        &s("BlockStored"),
        &[
            0x92, 0x01, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe,
        ],
        NIL,
        &[0x94, 0x0a, 0x0b, 0x0c, 0x0d],
        &[0x02],
        NIL,
        &s("GPU"),
        NIL,
        // ["BlockRemoved", [1], "GPU"]
        &[0x93],
        &s("BlockRemoved"),
        &[0x91, 0x01],
        &s("GPU"),
        // ["AllBlocksCleared"]
        &[0x91],
        &s("AllBlocksCleared"),
        &[0x00], // dp_rank 0
    ])
}

#[test]
fn golden_vllm_array() {
    let b = decode_batch(&vllm_array_batch(), Dialect::Vllm).unwrap();
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(
        b.events,
        vec![
            Ok(EngineEvent::Stored(BlockStored {
                block_hashes: vec![1, u64::MAX - 1],
                parent_block_hash: None,
                token_ids: vec![10, 11, 12, 13],
                block_size: 2,
                medium: Some("GPU".into()),
                ..BlockStored::default()
            })),
            Ok(EngineEvent::Removed(BlockRemoved {
                locality: None,
                block_hashes: vec![1],
                medium: Some("GPU".into()),
                group_idx: None,
            })),
            Ok(EngineEvent::Cleared),
        ]
    );
}

#[test]
fn golden_vllm_array_full_trailing_fields() {
    // ["BlockStored", [5], 4, [1,2], 2, 3, "CPU", "ad", [["ad", ["img", 1], "salt"]], 1, "full_attention", 128]
    let ev = cat(&[
        &[0x9c],
        &s("BlockStored"),
        &[0x91, 0x05],
        &[0x04],
        &[0x92, 0x01, 0x02],
        &[0x02],
        &[0x03],
        &s("CPU"),
        &s("ad"),
        &[0x91, 0x93],
        &s("ad"),
        &[0x92],
        &s("img"),
        &[0x01],
        &s("salt"),
        &[0x01],
        &s("full_attention"),
        &[0xcc, 0x80],
    ]);
    let batch = cat(&[&[0x92], TS_1_5, &[0x91], &ev]);
    let b = decode_batch(&batch, Dialect::Vllm).unwrap();
    assert_eq!(b.dp_rank, None);
    assert_eq!(
        b.events[0],
        Ok(EngineEvent::Stored(BlockStored {
            locality: None,
            block_hashes: vec![5],
            parent_block_hash: Some(4),
            token_ids: vec![1, 2],
            block_size: 2,
            lora_id: Some(3),
            lora_name: Some("ad".into()),
            medium: Some("CPU".into()),
            extra_keys: Some(vec![Some(vec![
                ExtraKey::Text("ad".into()),
                ExtraKey::Multimodal {
                    identifier: "img".into(),
                    offset: 1
                },
                ExtraKey::Text("salt".into()),
            ])]),
            group_idx: Some(1),
            kv_cache_spec_kind: Some("full_attention".into()),
            cache_salt: None,
        }))
    );
}

// --- vLLM, tagged maps (>= 0.24), bytes hashes -----------------------------

fn vllm_map_batch() -> Vec<u8> {
    let h1 = hash32(0x0102_0304_0506_0708);
    let h2 = hash32(42);
    cat(&[
        &[0x93],
        TS_1_5,
        &[0x93],
        // {"type": "BlockStored", "block_hashes": [h1], "parent_block_hash": h2,
        //  "token_ids": [7, 8], "block_size": 2, "lora_id": nil, "medium": nil,
        //  "lora_name": nil, "future_field": 1}
        &[0x89],
        &s("type"),
        &s("BlockStored"),
        &s("block_hashes"),
        &[0x91],
        &bin(&h1),
        &s("parent_block_hash"),
        &bin(&h2),
        &s("token_ids"),
        &[0x92, 0x07, 0x08],
        &s("block_size"),
        &[0x02],
        &s("lora_id"),
        NIL,
        &s("medium"),
        NIL,
        &s("lora_name"),
        NIL,
        &s("future_field"),
        &[0x01],
        // {"type": "BlockRemoved", "block_hashes": [h1], "medium": "GPU", "group_idx": 0}
        &[0x84],
        &s("type"),
        &s("BlockRemoved"),
        &s("block_hashes"),
        &[0x91],
        &bin(&h1),
        &s("medium"),
        &s("GPU"),
        &s("group_idx"),
        &[0x00],
        // {"type": "AllBlocksCleared"}
        &[0x81],
        &s("type"),
        &s("AllBlocksCleared"),
        &[0x03], // dp_rank 3
    ])
}

#[test]
fn golden_vllm_map_bytes_hashes() {
    let b = decode_batch(&vllm_map_batch(), Dialect::Vllm).unwrap();
    assert_eq!(b.dp_rank, Some(3));
    assert_eq!(
        b.events,
        vec![
            Ok(EngineEvent::Stored(BlockStored {
                block_hashes: vec![0x0102_0304_0506_0708],
                parent_block_hash: Some(42),
                token_ids: vec![7, 8],
                block_size: 2,
                ..BlockStored::default()
            })),
            Ok(EngineEvent::Removed(BlockRemoved {
                locality: None,
                block_hashes: vec![0x0102_0304_0506_0708],
                medium: Some("GPU".into()),
                group_idx: Some(0),
            })),
            Ok(EngineEvent::Cleared),
        ]
    );
}

#[test]
fn bytes_hash_slice_is_last_8_big_endian() {
    assert_eq!(bytes_to_hash(&hash32(7)), 7);
    assert_eq!(bytes_to_hash(&[1, 2]), 0x0102);
    assert_eq!(bytes_to_hash(&[]), 0);
}

// --- SGLang, positional arrays (<= 0.5.19) ---------------------------------

#[test]
fn golden_sglang_array_no_rank_signed_hashes_metadata() {
    let batch = cat(&[
        &[0x92], // old batch: [ts, events] without rank
        TS_1_5,
        &[0x93],
        // ["BlockStored", [-1, -2^63], nil, [1, 2], 2, nil, nil]
        &[0x97],
        &s("BlockStored"),
        &[0x92, 0xff, 0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],
        NIL,
        &[0x92, 0x01, 0x02],
        &[0x02],
        NIL,
        NIL,
        // ["BlockStored", [5], -1, [3, 4], 2, 9, "GPU", {"cache_salt": "t"}]
        &[0x98],
        &s("BlockStored"),
        &[0x91, 0x05],
        &[0xff],
        &[0x92, 0x03, 0x04],
        &[0x02],
        &[0x09],
        &s("GPU"),
        &[0x81],
        &s("cache_salt"),
        &s("t"),
        // ["BlockRemoved", [-1], nil]
        &[0x93],
        &s("BlockRemoved"),
        &[0x91, 0xff],
        NIL,
    ]);
    let b = decode_batch(&batch, Dialect::Sglang).unwrap();
    assert_eq!(b.dp_rank, None);
    assert_eq!(
        b.events,
        vec![
            Ok(EngineEvent::Stored(BlockStored {
                block_hashes: vec![u64::MAX, 1 << 63],
                token_ids: vec![1, 2],
                block_size: 2,
                ..BlockStored::default()
            })),
            Ok(EngineEvent::Stored(BlockStored {
                block_hashes: vec![5],
                parent_block_hash: Some(u64::MAX),
                token_ids: vec![3, 4],
                block_size: 2,
                lora_id: Some(9),
                medium: Some("GPU".into()),
                cache_salt: Some("t".into()),
                ..BlockStored::default()
            })),
            Ok(EngineEvent::Removed(BlockRemoved {
                locality: None,
                block_hashes: vec![u64::MAX],
                medium: None,
                group_idx: None,
            })),
        ]
    );
    // a nil rank is the same as no rank
    let with_nil = cat(&[&[0x93], TS_1_5, &[0x90], NIL]);
    assert_eq!(
        decode_batch(&with_nil, Dialect::Sglang).unwrap().dp_rank,
        None
    );
}

// --- SGLang, tagged maps (>= 0.5.20) ---------------------------------------

#[test]
fn golden_sglang_map() {
    let batch = cat(&[
        &[0x93],
        TS_1_5,
        &[0x92],
        // {"type": "BlockStored", "block_hashes": [-2], "parent_block_hash": nil,
        //  "token_ids": [1, 2], "block_size": 2, "lora_id": nil,
        //  "cache_salt": "t", "session_id": "s1"}
        &[0x88],
        &s("type"),
        &s("BlockStored"),
        &s("block_hashes"),
        &[0x91, 0xfe],
        &s("parent_block_hash"),
        NIL,
        &s("token_ids"),
        &[0x92, 0x01, 0x02],
        &s("block_size"),
        &[0x02],
        &s("lora_id"),
        NIL,
        &s("cache_salt"),
        &s("t"),
        &s("session_id"),
        &s("s1"),
        // {"type": "BlockRemoved", "block_hashes": [-2]}
        &[0x82],
        &s("type"),
        &s("BlockRemoved"),
        &s("block_hashes"),
        &[0x91, 0xfe],
        &[0x01],
    ]);
    let b = decode_batch(&batch, Dialect::Sglang).unwrap();
    assert_eq!(b.dp_rank, Some(1));
    assert_eq!(
        b.events,
        vec![
            Ok(EngineEvent::Stored(BlockStored {
                block_hashes: vec![u64::MAX - 1],
                token_ids: vec![1, 2],
                block_size: 2,
                cache_salt: Some("t".into()),
                ..BlockStored::default()
            })),
            Ok(EngineEvent::Removed(BlockRemoved {
                locality: None,
                block_hashes: vec![u64::MAX - 1],
                medium: None,
                group_idx: None,
            })),
        ]
    );
}

// --- malformed input --------------------------------------------------------

#[test]
fn malformed_payloads_and_events() {
    let reason = |p: &[u8]| {
        decode_batch(p, Dialect::Vllm)
            .map(|_| ())
            .map_err(|e| e.reason)
    };
    assert_eq!(reason(&[0x93, 0xcb, 0x3f]), Err(DecodeReason::Msgpack)); // truncated float
    assert_eq!(reason(&[0x93, 0x01]), Err(DecodeReason::Msgpack)); // truncated
    assert_eq!(reason(&[0x01]), Err(DecodeReason::BatchShape));
    assert_eq!(reason(&[0x91, 0x01]), Err(DecodeReason::BatchShape));
    assert_eq!(
        reason(&cat(&[&[0x92], TS_1_5, &[0x01]])),
        Err(DecodeReason::BatchShape)
    );
    // one bad event among good ones: only that event fails
    let batch = cat(&[
        &[0x92],
        TS_1_5,
        &[0x94],
        &[0x91],
        &s("Mystery"),
        &[0x92],
        &s("BlockRemoved"),
        &[0x91, 0xc3], // hash `true`
        &[0x05],
        &[0x91],
        &s("AllBlocksCleared"),
    ]);
    let b = decode_batch(&batch, Dialect::Vllm).unwrap();
    let reasons: Vec<_> = b
        .events
        .iter()
        .map(|e| e.as_ref().map(|_| ()).map_err(|e| e.reason))
        .collect();
    assert_eq!(
        reasons,
        vec![
            Err(DecodeReason::UnknownEventType),
            Err(DecodeReason::BlockHash),
            Err(DecodeReason::EventShape),
            Ok(()),
        ]
    );
}

#[test]
fn live_and_replay_frames() {
    let seq = 5u64.to_be_bytes();
    let f: Vec<&[u8]> = vec![b"kv", &seq, b"p"];
    assert_eq!(
        parse_live_frames(&f).unwrap(),
        LiveFrame {
            topic: b"kv",
            seq: 5,
            payload: b"p"
        }
    );
    let two: Vec<&[u8]> = vec![&seq, b"p"];
    assert_eq!(
        parse_live_frames(&two).map_err(|e| e.reason),
        Err(DecodeReason::FrameCount)
    );
    let short: Vec<&[u8]> = vec![b"", &seq[..7], b"p"];
    assert_eq!(
        parse_live_frames(&short).map_err(|e| e.reason),
        Err(DecodeReason::SeqLength)
    );
    let batch = ReplayFrame::Batch {
        seq: 5,
        payload: b"p",
    };
    // DEALER view of the ROUTER reply: ["", seq, payload]
    let r: Vec<&[u8]> = vec![b"", &seq, b"p"];
    assert_eq!(parse_replay_frames(&r).unwrap(), batch);
    // with the topic frame: ["", topic, seq, payload]
    let r: Vec<&[u8]> = vec![b"", b"kv", &seq, b"p"];
    assert_eq!(parse_replay_frames(&r).unwrap(), batch);
    // without the delimiter
    let r: Vec<&[u8]> = vec![&seq, b"p"];
    assert_eq!(parse_replay_frames(&r).unwrap(), batch);
    let end = (-1i64).to_be_bytes();
    let r: Vec<&[u8]> = vec![b"", &end, b""];
    assert_eq!(parse_replay_frames(&r).unwrap(), ReplayFrame::End);
    let r: Vec<&[u8]> = vec![b"", b"kv", &end, b""];
    assert_eq!(parse_replay_frames(&r).unwrap(), ReplayFrame::End);
    let r: Vec<&[u8]> = vec![b""];
    assert_eq!(
        parse_replay_frames(&r).map_err(|e| e.reason),
        Err(DecodeReason::FrameCount)
    );
}

// --- processor over a real index --------------------------------------------
// The index sink's futures are always ready, so a plain executor drives them.

use futures::executor::block_on;

fn processor(
    dialect: Dialect,
) -> (
    RankProcessor<KvIndex>,
    Arc<KvIndex>,
    Arc<WorkerEventMetrics>,
) {
    let idx = Arc::new(KvIndex::new(2));
    let families = crate::metrics::Metrics::new()
        .map(|m| m.engine.clone())
        .unwrap_or_else(|e| panic!("metrics: {e}"));
    let m = Arc::new(WorkerEventMetrics::bound(&families, 1));
    let opts =
        Arc::new(EngineEventsConfig::new(1, "m", 2, "ipc:///x", dialect).translate_options());
    let p = RankProcessor::new(
        WorkerRank::new(1, 0),
        dialect,
        opts,
        Arc::clone(&m),
        Arc::clone(&idx),
    );
    (p, idx, m)
}

/// `[1.5, [["BlockStored", [h], parent, [t, t+1], 2, nil, "GPU", nil]], 0]`
fn stored_batch(h: u8, parent: Option<u8>, t: u8) -> Vec<u8> {
    let p: Vec<u8> = parent.map_or(vec![0xc0], |p| vec![p]);
    cat(&[
        &[0x93],
        TS_1_5,
        &[0x91, 0x98],
        &s("BlockStored"),
        &[0x91, h],
        &p,
        &[0x92, t, t + 1],
        &[0x02],
        NIL,
        &s("GPU"),
        NIL,
        &[0x00],
    ])
}

fn local(tokens: &[u32]) -> Vec<u64> {
    compute_block_hashes(tokens, 2, &HashOptions::plain(), None)
}

#[test]
fn processor_in_order_gap_duplicate_restart() {
    let (mut p, idx, m) = processor(Dialect::Vllm);
    assert_eq!(block_on(p.on_live(0)), None);
    block_on(p.apply_batch(0, &stored_batch(1, None, 10)));
    // seq 1 lost; live 2 arrives: gap [1, 2); "replay" delivers 1 and 2
    assert_eq!(block_on(p.on_live(2)), Some(1..2));
    block_on(p.apply_batch(1, &stored_batch(2, Some(1), 12)));
    block_on(p.apply_batch(2, &stored_batch(3, Some(2), 14)));
    block_on(p.apply_batch(2, &stored_batch(3, Some(2), 14))); // the live copy: duplicate
    let q = local(&[10, 11, 12, 13, 14, 15]);
    assert_eq!(
        idx.find_matches(&q).get(p.target()).map(|s| s.blocks),
        Some(3)
    );
    let snap = m.snapshot();
    assert_eq!((snap.batches, snap.gaps, snap.batches_lost), (3, 1, 0));
    // restart: live goes back to 0, the rank is cleared first
    assert_eq!(block_on(p.on_live(0)), None);
    assert_eq!(idx.worker_blocks(p.target()), 0);
    block_on(p.apply_batch(0, &stored_batch(9, None, 10)));
    assert_eq!(idx.worker_blocks(p.target()), 1);
    assert_eq!(m.snapshot().restarts, 1);
}

#[test]
fn processor_unrecovered_gap_counts_and_continues() {
    let (mut p, idx, m) = processor(Dialect::Vllm);
    block_on(p.on_live(0));
    block_on(p.apply_batch(0, &stored_batch(1, None, 10)));
    // no replay endpoint: 1 and 2 are lost; 3's parent is unknown -> rejected
    assert_eq!(block_on(p.on_live(3)), Some(1..3));
    block_on(p.apply_batch(3, &stored_batch(4, Some(3), 16)));
    block_on(p.on_live(4));
    block_on(p.apply_batch(4, &stored_batch(5, None, 20)));
    let snap = m.snapshot();
    assert_eq!(snap.batches_lost, 2);
    assert_eq!(snap.index_rejected, 1);
    assert_eq!(idx.worker_blocks(p.target()), 2);
}

#[test]
fn processor_skips_malformed_and_unknown_media() {
    let (mut p, idx, m) = processor(Dialect::Vllm);
    block_on(p.on_live(0));
    block_on(p.apply_batch(0, &[0x93, 0xcb, 0x3f]));
    block_on(p.on_live(1));
    let cpu = cat(&[
        &[0x93],
        TS_1_5,
        &[0x92, 0x98],
        &s("BlockStored"),
        &[0x91, 0x07],
        NIL,
        &[0x92, 0x01, 0x02],
        &[0x02],
        NIL,
        &s("NVME"),
        NIL,
        &[0x91],
        &s("Bogus"),
        &[0x00],
    ]);
    block_on(p.apply_batch(1, &cpu));
    block_on(p.on_live(2));
    block_on(p.apply_batch(2, &stored_batch(1, None, 10)));
    let snap = m.snapshot();
    assert_eq!(snap.decode_error(DecodeReason::Msgpack), 1);
    assert_eq!(snap.decode_error(DecodeReason::UnknownEventType), 1);
    assert_eq!(snap.events_unknown_medium, 1);
    // Counted by medium: each store by the medium it names, an unknown
    // one also by its value.
    assert_eq!(m.medium_count("unknown"), 1);
    assert_eq!(m.unknown_medium_count("NVME"), 1);
    assert_eq!(m.medium_count("GPU"), 1);
    assert_eq!(m.medium_count("none"), 0);
    assert_eq!(snap.batches, 3);
    assert!(snap.last_event_age.is_some());
    assert_eq!(snap.last_seq, Some(2));
    assert_eq!(idx.worker_blocks(p.target()), 1);
}

#[test]
fn config_endpoints() {
    let mut c = EngineEventsConfig::new(1, "m", 16, "tcp://127.0.0.1:5557", Dialect::Sglang);
    c.replay_endpoint = Some("tcp://127.0.0.1:6000".into());
    c.dp_ranks = vec![0, 2];
    assert_eq!(c.validate(), Ok(()));
    assert_eq!(
        c.endpoints_for(2).unwrap(),
        RankEndpoints {
            endpoint: "tcp://127.0.0.1:5559".into(),
            replay_endpoint: Some("tcp://127.0.0.1:6002".into())
        }
    );
    let mut c = EngineEventsConfig::new(1, "m", 16, "ipc:///tmp/kv", Dialect::Vllm);
    c.dp_ranks = vec![0, 1];
    assert!(matches!(
        c.validate(),
        Err(ConfigError::NoRankEndpoint { rank: 1, .. })
    ));
    c.rank_endpoints.insert(
        1,
        RankEndpoints {
            endpoint: "ipc:///tmp/kv1".into(),
            replay_endpoint: None,
        },
    );
    assert_eq!(c.validate(), Ok(()));
}

// --- sequence defects: duplicates, step backs and absurd jumps never wipe ---

/// Applies batches `seqs` live, in order, each storing one block chained to
/// the previous one (block `s + 1`, tokens `2s, 2s + 1`).
fn feed_chain(p: &mut RankProcessor<KvIndex>, seqs: std::ops::RangeInclusive<u8>) {
    for s in seqs {
        assert_eq!(block_on(p.on_live(u64::from(s))), None, "seq {s}");
        let parent = s.checked_sub(1).map(|q| q + 1);
        block_on(p.apply_batch(u64::from(s), &stored_batch(s + 1, parent, 2 * s)));
    }
}

#[test]
fn processor_live_duplicate_does_not_wipe_the_rank() {
    let (mut p, idx, m) = processor(Dialect::Vllm);
    feed_chain(&mut p, 0..=3);
    assert_eq!(idx.worker_blocks(p.target()), 4);
    // the same batch again (e.g. overlap with a replay): skipped, not a restart
    let missing = block_on(p.on_live(3));
    block_on(p.apply_batch(3, &stored_batch(4, Some(3), 6)));
    assert_eq!(idx.worker_blocks(p.target()), 4);
    assert_eq!(missing, None);
    let snap = m.snapshot();
    assert_eq!((snap.restarts, snap.batches, snap.batches_lost), (0, 4, 0));
    assert_eq!(snap.skipped_duplicates, 1);
    // and the stream goes on
    assert_eq!(block_on(p.on_live(4)), None);
    block_on(p.apply_batch(4, &stored_batch(5, Some(4), 8)));
    assert_eq!(idx.worker_blocks(p.target()), 5);
}

#[test]
fn processor_small_step_back_is_not_a_restart() {
    let (mut p, idx, m) = processor(Dialect::Vllm);
    feed_chain(&mut p, 0..=40);
    assert_eq!(idx.worker_blocks(p.target()), 41);
    // 30 is neither near zero nor far back: already applied, skipped
    let missing = block_on(p.on_live(30));
    block_on(p.apply_batch(30, &stored_batch(31, Some(30), 60)));
    assert_eq!(idx.worker_blocks(p.target()), 41);
    assert_eq!(missing, None);
    assert_eq!(
        (m.snapshot().restarts, m.snapshot().skipped_duplicates),
        (0, 1)
    );
    // back to near zero is a restart
    assert_eq!(block_on(p.on_live(0)), None);
    assert_eq!(idx.worker_blocks(p.target()), 0);
    assert_eq!(m.snapshot().restarts, 1);
}

#[test]
fn processor_absurd_jump_is_one_anomaly_and_never_wipes() {
    let (mut p, idx, m) = processor(Dialect::Vllm);
    feed_chain(&mut p, 0..=3);
    let absurd = 1u64 << 63;
    let missing = block_on(p.on_live(absurd));
    block_on(p.apply_batch(absurd, &stored_batch(50, None, 100)));
    let snap = m.snapshot();
    assert!(snap.batches_lost < 1_000, "{}", snap.batches_lost);
    assert_eq!(missing, None, "no replay of 2^63 batches");
    // the engine's next real sequence continues; nothing is wiped
    assert_eq!(block_on(p.on_live(4)), None);
    block_on(p.apply_batch(4, &stored_batch(5, Some(4), 8)));
    let snap = m.snapshot();
    assert_eq!(
        (snap.restarts, snap.batches_lost, snap.skipped_jumps),
        (0, 0, 1)
    );
    assert_eq!(idx.worker_blocks(p.target()), 5);
    assert_eq!(snap.last_seq, Some(4));
}

// --- unsynced ranks -----------------------------------------------------------

/// `[1.5, [["AllBlocksCleared"]], 0]`
fn cleared_batch() -> Vec<u8> {
    cat(&[
        &[0x93],
        TS_1_5,
        &[0x91, 0x91],
        &s("AllBlocksCleared"),
        &[0x00],
    ])
}

#[test]
fn processor_lost_batches_unsync_the_rank_until_all_blocks_cleared() {
    let (mut p, idx, m) = processor(Dialect::Vllm);
    feed_chain(&mut p, 0..=1);
    assert!(!p.progress().is_unsynced());
    // no replay: 2 and 3 are lost for good
    assert_eq!(block_on(p.on_live(4)), Some(2..4));
    block_on(p.apply_batch(4, &stored_batch(9, None, 40)));
    assert!(p.progress().is_unsynced());
    assert_eq!(m.snapshot().unsynced_ranks, 1);
    // a further loss keeps it unsynced, counted once in the gauge
    block_on(p.on_live(6));
    block_on(p.apply_batch(6, &stored_batch(10, Some(9), 42)));
    assert_eq!(
        (m.snapshot().unsynced_ranks, m.snapshot().batches_lost),
        (1, 3)
    );
    // a duplicate changes nothing
    block_on(p.on_live(6));
    block_on(p.apply_batch(6, &stored_batch(10, Some(9), 42)));
    assert!(p.progress().is_unsynced());
    // AllBlocksCleared: exact again (and then the batch's own stores count)
    block_on(p.on_live(7));
    block_on(p.apply_batch(7, &cleared_batch()));
    assert!(!p.progress().is_unsynced());
    assert_eq!(m.snapshot().unsynced_ranks, 0);
    assert_eq!(idx.worker_blocks(p.target()), 0);
    assert_eq!(p.progress().last_applied(), Some(7));
}

#[test]
fn processor_jump_unsyncs_and_restart_resyncs() {
    let (mut p, idx, m) = processor(Dialect::Vllm);
    feed_chain(&mut p, 0..=2);
    block_on(p.on_live(u64::MAX));
    block_on(p.apply_batch(u64::MAX, &stored_batch(50, None, 100)));
    assert!(p.progress().is_unsynced());
    assert_eq!(p.progress().last_applied(), Some(2));
    assert_eq!(m.snapshot().unsynced_ranks, 1);
    assert_eq!(idx.worker_blocks(p.target()), 3);
    // the engine restarts: the rank is cleared and starts exact
    assert_eq!(block_on(p.on_live(0)), None);
    assert!(!p.progress().is_unsynced());
    assert_eq!(p.progress().last_applied(), None);
    assert_eq!(m.snapshot().unsynced_ranks, 0);
    assert_eq!(idx.worker_blocks(p.target()), 0);
}

// --- resume from a saved sequence --------------------------------------------

#[test]
fn processor_resumed_from_a_saved_sequence() {
    let (mut p, idx, m) = processor(Dialect::Vllm);
    p.resume_from(9, false);
    assert_eq!(p.progress().last_applied(), Some(9));
    assert!(!p.progress().is_unsynced());
    // the first live batch after the saved one is 12: 10 and 11 are a gap
    assert_eq!(block_on(p.on_live(12)), Some(10..12));
    for s in 9..=12u8 {
        // the replay starts at 10; 9 (were it sent) is a duplicate
        block_on(p.apply_batch(u64::from(s), &stored_batch(s, None, 2 * s)));
    }
    assert_eq!(idx.worker_blocks(p.target()), 3);
    let snap = m.snapshot();
    assert_eq!((snap.batches, snap.batches_lost, snap.restarts), (3, 0, 0));
    assert_eq!(snap.skipped_duplicates, 1);
    assert_eq!(p.progress().last_applied(), Some(12));
    assert!(!p.progress().is_unsynced());

    // a rank saved unsynced starts unsynced, until AllBlocksCleared
    let (mut p, _, m) = processor(Dialect::Vllm);
    p.resume_from(9, true);
    assert!(p.progress().is_unsynced());
    assert_eq!(m.snapshot().unsynced_ranks, 1);
    block_on(p.on_live(10));
    block_on(p.apply_batch(10, &cleared_batch()));
    assert!(!p.progress().is_unsynced());
    assert_eq!(m.snapshot().unsynced_ranks, 0);

    // the engine restarted while kvroute was away: back to near zero
    let (mut p, idx, m) = processor(Dialect::Vllm);
    // a block restored with the saved state
    let restored = KvEvent::Stored {
        parent: None,
        blocks: vec![(1, local(&[10, 11])[0])],
    };
    KvIndex::apply(&idx, p.target(), &restored).unwrap();
    p.resume_from(500, false);
    assert_eq!(block_on(p.on_live(2)), Some(0..2));
    assert_eq!(idx.worker_blocks(p.target()), 0);
    assert_eq!(m.snapshot().restarts, 1);
}

/// Media are counted by their name when kvroute knows it, and as `unknown`
/// whatever else an engine sends: the label set stays bounded.
#[test]
fn media_labels_are_known_names_none_or_unknown() {
    use super::translate::{MEDIUM_LABELS, known_media, medium_label};
    assert_eq!(medium_label(None), "none");
    for &known in known_media() {
        assert_eq!(medium_label(Some(known)), known);
        assert_eq!(medium_label(Some(&known.to_ascii_lowercase())), known);
        assert!(MEDIUM_LABELS.contains(&known));
    }
    let hostile = [
        "",
        "gpu ",
        "NVME",
        "\u{0}GPU",
        "x".repeat(1 << 20).as_str(),
        "é",
    ]
    .map(|m| medium_label(Some(m)));
    assert!(hostile.iter().all(|l| *l == "unknown"), "{hostile:?}");
    assert_eq!(MEDIUM_LABELS.len(), known_media().len() + 2);
    assert_eq!((MEDIUM_LABELS[0], MEDIUM_LABELS[11]), ("none", "unknown"));
}

/// Unknown media are counted by their value, made printable and cut short,
/// and only so many values get a series of their own.
#[test]
fn unknown_media_are_counted_by_a_bounded_set_of_values() {
    use crate::metrics::UnknownMedia;
    let (_p, _idx, m) = processor(Dialect::Vllm);
    m.count_medium(Some(&"y".repeat(1 << 20)));
    m.count_medium(Some("a\u{0}b é"));
    for i in 0..40 {
        m.count_medium(Some(&format!("X{i}")));
    }
    assert_eq!(
        m.unknown_medium_count(&"y".repeat(UnknownMedia::MAX_LEN)),
        1
    );
    assert_eq!(m.unknown_medium_count("a?b??"), 1);
    let own = UnknownMedia::MAX_VALUES - 2;
    assert_eq!(m.unknown_medium_count("X0"), 1);
    assert_eq!(m.unknown_medium_count(&format!("X{}", own - 1)), 1);
    assert_eq!(m.unknown_medium_count("(other)"), (40 - own) as u64);
    assert_eq!(m.medium_count("unknown"), 42);
    // A known medium is never counted as unknown.
    m.count_medium(Some("cpu"));
    assert_eq!(m.medium_count("CPU"), 1);
    assert_eq!(m.medium_count("unknown"), 42);
}
