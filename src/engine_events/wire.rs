//! The engines' ZeroMQ KV-event wire format, decoded into neutral types.
//!
//! Why this exists: vLLM and SGLang publish the same kind of information in
//! two dialects and, across releases, two encodings. Everything above this
//! module (sequence tracking, translation to index events) must not care
//! which engine or release produced a batch, so this module is the only
//! place that knows the byte layout.
//!
//! Format (as published by the engines' `kv_events.py`):
//! * Live frames: `[topic, seq, payload]`; `seq` is 8 bytes big-endian.
//! * Replay replies on the DEALER side: an optional empty delimiter frame,
//!   then `[seq, payload]` or `[topic, seq, payload]`; a sequence of all ones
//!   (`-1` as signed 64-bit) ends the replay.
//! * Payload: msgpack array `[ts, events, dp_rank]`; `dp_rank` may be nil or
//!   absent (older SGLang batches).
//! * Events, positional encoding (vLLM <= 0.23, SGLang <= 0.5.19): an array
//!   whose first element is the tag (`"BlockStored"`, `"BlockRemoved"`,
//!   `"AllBlocksCleared"`), then the fields in declaration order; trailing
//!   fields with defaults may be absent.
//!   - vLLM `BlockStored`: hashes, parent, token_ids, block_size, lora_id,
//!     medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...
//!   - SGLang `BlockStored`: hashes, parent, token_ids, block_size, lora_id,
//!     medium, then optionally a metadata map `{cache_salt}`.
//!   - `BlockRemoved`: hashes, medium (vLLM also group_idx).
//! * Events, map encoding (vLLM >= 0.24, SGLang >= 0.5.20): a map with the
//!   tag under `"type"` and the fields by name; unknown keys are ignored.
//!
//! Engine hashes are kept opaque as `u64`:
//! * integers: unsigned values as they are; negative (SGLang's signed) values
//!   as their two's-complement bit pattern;
//! * bytes: the LAST 8 bytes read big-endian (shorter strings are
//!   zero-extended on the left). This is the value vLLM itself publishes when
//!   it is configured for integer hashes (the low 64 bits of the big-endian
//!   number), so both of an engine's settings give the same ids.

use rmpv::Value;

/// Which engine family published the batch (decides positional field order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dialect {
    Vllm,
    Sglang,
}

impl std::str::FromStr for Dialect {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "vllm" => Ok(Dialect::Vllm),
            "sglang" => Ok(Dialect::Sglang),
            other => Err(format!("unknown engine dialect {other:?} (vllm|sglang)")),
        }
    }
}

/// Why a frame, batch or event was skipped. Used as a metrics label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeReason {
    /// Wrong number of frames in a multipart message.
    FrameCount,
    /// Sequence frame is not exactly 8 bytes.
    SeqLength,
    /// Payload is not valid msgpack.
    Msgpack,
    /// Payload is not `[ts, events, dp_rank?]`.
    BatchShape,
    /// An event is neither a tagged array nor a tagged map, or lacks a field.
    EventShape,
    /// An event's tag is not one we know.
    UnknownEventType,
    /// A block hash is neither an integer nor bytes.
    BlockHash,
    /// A token id or block size is not a valid unsigned 32-bit integer.
    TokenId,
    /// The event's block size differs from the worker's.
    BlockSizeMismatch,
    /// `token_ids` do not cover exactly the announced blocks.
    TokenCount,
    /// An extra key kvroute cannot fold into its hashes (e.g. prompt embeds).
    UnsupportedExtraKey,
    /// The message is larger than `max_message_bytes`: not decoded.
    TooLarge,
}

impl DecodeReason {
    pub const ALL: [DecodeReason; 12] = [
        DecodeReason::FrameCount,
        DecodeReason::SeqLength,
        DecodeReason::Msgpack,
        DecodeReason::BatchShape,
        DecodeReason::EventShape,
        DecodeReason::UnknownEventType,
        DecodeReason::BlockHash,
        DecodeReason::TokenId,
        DecodeReason::BlockSizeMismatch,
        DecodeReason::TokenCount,
        DecodeReason::UnsupportedExtraKey,
        DecodeReason::TooLarge,
    ];

    /// Stable snake_case label for metrics.
    pub(crate) fn label(self) -> &'static str {
        match self {
            DecodeReason::FrameCount => "frame_count",
            DecodeReason::SeqLength => "seq_length",
            DecodeReason::Msgpack => "msgpack",
            DecodeReason::BatchShape => "batch_shape",
            DecodeReason::EventShape => "event_shape",
            DecodeReason::UnknownEventType => "unknown_event_type",
            DecodeReason::BlockHash => "block_hash",
            DecodeReason::TokenId => "token_id",
            DecodeReason::BlockSizeMismatch => "block_size_mismatch",
            DecodeReason::TokenCount => "token_count",
            DecodeReason::UnsupportedExtraKey => "unsupported_extra_key",
            DecodeReason::TooLarge => "too_large",
        }
    }

    /// Index into a fixed array of counters.
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// A decode failure: the reason (for metrics) and a detail (for logs).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {detail}", reason.label())]
pub struct DecodeError {
    pub reason: DecodeReason,
    pub detail: String,
}

/// Refuses a message whose frames together are larger than `max` bytes,
/// before anything in it is decoded: a payload decodes into several times
/// its size, and an engine's message is untrusted.
pub(crate) fn check_message_size(frames: &[bytes::Bytes], max: usize) -> Result<(), DecodeError> {
    let size = frames.iter().fold(0usize, |n, f| n.saturating_add(f.len()));
    if size > max {
        return Err(DecodeError::new(
            DecodeReason::TooLarge,
            format!("{size} bytes is over the limit of {max}"),
        ));
    }
    Ok(())
}

impl DecodeError {
    pub(crate) fn new(reason: DecodeReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

/// The replay terminator: sequence `-1` as signed 64-bit.
pub const END_OF_REPLAY: u64 = u64::MAX;

/// One message from the PUB socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveFrame<'a> {
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

/// One message from the replay (DEALER) socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayFrame<'a> {
    Batch { seq: u64, payload: &'a [u8] },
    End,
}

fn parse_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let arr: [u8; 8] = frame.try_into().map_err(|_| {
        DecodeError::new(
            DecodeReason::SeqLength,
            format!("sequence frame has {} bytes, want 8", frame.len()),
        )
    })?;
    Ok(u64::from_be_bytes(arr))
}

/// Parse `[topic, seq, payload]`.
pub(crate) fn parse_live_frames<'a, F: AsRef<[u8]>>(
    frames: &'a [F],
) -> Result<LiveFrame<'a>, DecodeError> {
    match frames {
        [topic, seq, payload] => Ok(LiveFrame {
            topic: topic.as_ref(),
            seq: parse_seq(seq.as_ref())?,
            payload: payload.as_ref(),
        }),
        _ => Err(DecodeError::new(
            DecodeReason::FrameCount,
            format!("live message has {} frames, want 3", frames.len()),
        )),
    }
}

/// Parse a replay reply: optional empty delimiter, then `[seq, payload]` or
/// `[topic, seq, payload]`; sequence -1 is the end marker.
pub(crate) fn parse_replay_frames<'a, F: AsRef<[u8]>>(
    frames: &'a [F],
) -> Result<ReplayFrame<'a>, DecodeError> {
    let rest = match frames.split_first() {
        Some((first, rest)) if first.as_ref().is_empty() && rest.len() >= 2 => rest,
        _ => frames,
    };
    let (seq, payload) = match rest {
        [seq, payload] => (seq.as_ref(), payload.as_ref()),
        [_topic, seq, payload] => (seq.as_ref(), payload.as_ref()),
        _ => {
            return Err(DecodeError::new(
                DecodeReason::FrameCount,
                format!("replay message has {} frames", frames.len()),
            ));
        }
    };
    let seq = parse_seq(seq)?;
    if seq == END_OF_REPLAY {
        return Ok(ReplayFrame::End);
    }
    Ok(ReplayFrame::Batch { seq, payload })
}

/// One element of a block's extra keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtraKey {
    /// A string: the LoRA name or the cache salt (vLLM puts the LoRA name
    /// first and the salt after the multimodal items, block 0 only).
    Text(String),
    /// A multimodal item `[identifier, offset-in-block]`.
    Multimodal { identifier: String, offset: i64 },
    /// Raw bytes (vLLM's prompt-embeds hash).
    Bytes(Vec<u8>),
    /// Anything else.
    Other,
}

/// A `BlockStored` event, fields in neutral form.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockStored {
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    pub medium: Option<String>,
    /// vLLM's `locality` of a `STORAGE` medium (`LOCAL`, `REMOTE`).
    pub locality: Option<String>,
    /// One entry per block (`None`: no extra keys for that block).
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    pub group_idx: Option<i64>,
    pub kv_cache_spec_kind: Option<String>,
    /// SGLang: the salt of the request (map field or metadata map).
    pub cache_salt: Option<String>,
}

/// A `BlockRemoved` event.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    /// As [`BlockStored::locality`].
    pub locality: Option<String>,
    pub group_idx: Option<i64>,
}

/// One engine event, independent of dialect and encoding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    Stored(BlockStored),
    Removed(BlockRemoved),
    Cleared,
}

/// A decoded payload. Events that fail to decode are kept as errors so the
/// caller can count them and still apply the others.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineBatch {
    pub ts: f64,
    pub dp_rank: Option<i64>,
    pub events: Vec<Result<EngineEvent, DecodeError>>,
}

/// Decode one msgpack payload `[ts, events, dp_rank?]`.
pub(crate) fn decode_batch(payload: &[u8], dialect: Dialect) -> Result<EngineBatch, DecodeError> {
    let mut cursor = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut cursor, 32)
        .map_err(|e| DecodeError::new(DecodeReason::Msgpack, e.to_string()))?;
    let Value::Array(items) = value else {
        return Err(DecodeError::new(
            DecodeReason::BatchShape,
            "batch is not an array",
        ));
    };
    let (ts, events, rank) = match items.as_slice() {
        [ts, events] => (ts, events, None),
        [ts, events, rank, ..] => (ts, events, Some(rank)),
        _ => {
            return Err(DecodeError::new(
                DecodeReason::BatchShape,
                format!("batch array has {} elements", items.len()),
            ));
        }
    };
    let ts = match ts {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        Value::Integer(i) => i.as_f64().unwrap_or(0.0),
        _ => {
            return Err(DecodeError::new(
                DecodeReason::BatchShape,
                "ts is not a number",
            ));
        }
    };
    let dp_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(i)) => i.as_i64(),
        Some(_) => {
            return Err(DecodeError::new(
                DecodeReason::BatchShape,
                "dp_rank is not an integer",
            ));
        }
    };
    let Value::Array(events) = events else {
        return Err(DecodeError::new(
            DecodeReason::BatchShape,
            "events is not an array",
        ));
    };
    Ok(EngineBatch {
        ts,
        dp_rank,
        events: events.iter().map(|e| decode_event(e, dialect)).collect(),
    })
}

/// Decode one event in either encoding.
pub(crate) fn decode_event(value: &Value, dialect: Dialect) -> Result<EngineEvent, DecodeError> {
    match value {
        Value::Array(items) => decode_positional(items, dialect),
        Value::Map(entries) => decode_map(entries),
        _ => Err(DecodeError::new(
            DecodeReason::EventShape,
            "event is neither an array nor a map",
        )),
    }
}

fn shape(detail: impl Into<String>) -> DecodeError {
    DecodeError::new(DecodeReason::EventShape, detail)
}

fn decode_positional(items: &[Value], dialect: Dialect) -> Result<EngineEvent, DecodeError> {
    let Some((tag, fields)) = items.split_first() else {
        return Err(shape("empty event array"));
    };
    let tag = tag
        .as_str()
        .ok_or_else(|| shape("event tag is not a string"))?;
    let at = |i: usize| fields.get(i).unwrap_or(&Value::Nil);
    match tag {
        "BlockStored" => {
            if fields.len() < 4 {
                return Err(shape(format!("BlockStored has {} fields", fields.len())));
            }
            let mut ev = BlockStored {
                block_hashes: hashes(&fields[0])?,
                parent_block_hash: opt_hash(&fields[1])?,
                token_ids: token_ids(&fields[2])?,
                block_size: block_size(&fields[3])?,
                lora_id: opt_int(at(4), "lora_id")?,
                medium: opt_str(at(5), "medium")?,
                ..BlockStored::default()
            };
            match dialect {
                Dialect::Vllm => {
                    ev.lora_name = opt_str(at(6), "lora_name")?;
                    ev.extra_keys = extra_keys(at(7))?;
                    ev.group_idx = opt_int(at(8), "group_idx")?;
                    ev.kv_cache_spec_kind = opt_str(at(9), "kv_cache_spec_kind")?;
                }
                Dialect::Sglang => {
                    if let Value::Map(meta) = at(6) {
                        ev.cache_salt = opt_str(map_get(meta, "cache_salt"), "cache_salt")?;
                    }
                }
            }
            Ok(EngineEvent::Stored(ev))
        }
        "BlockRemoved" => {
            if fields.is_empty() {
                return Err(shape("BlockRemoved has no fields"));
            }
            Ok(EngineEvent::Removed(BlockRemoved {
                block_hashes: hashes(&fields[0])?,
                medium: opt_str(at(1), "medium")?,
                locality: None,
                group_idx: match dialect {
                    Dialect::Vllm => opt_int(at(2), "group_idx")?,
                    Dialect::Sglang => None,
                },
            }))
        }
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Err(DecodeError::new(
            DecodeReason::UnknownEventType,
            format!("event tag {other:?}"),
        )),
    }
}

fn map_get<'a>(entries: &'a [(Value, Value)], key: &str) -> &'a Value {
    entries
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map_or(&Value::Nil, |(_, v)| v)
}

fn decode_map(entries: &[(Value, Value)]) -> Result<EngineEvent, DecodeError> {
    let get = |k: &str| map_get(entries, k);
    let tag = get("type")
        .as_str()
        .ok_or_else(|| shape("event map has no string \"type\""))?;
    let require = |k: &str| match get(k) {
        Value::Nil if !entries.iter().any(|(key, _)| key.as_str() == Some(k)) => {
            Err(shape(format!("{tag} lacks {k}")))
        }
        v => Ok(v),
    };
    match tag {
        "BlockStored" => {
            let cache_salt = match opt_str(get("cache_salt"), "cache_salt")? {
                Some(s) => Some(s),
                None => match get("metadata") {
                    Value::Map(meta) => opt_str(map_get(meta, "cache_salt"), "cache_salt")?,
                    _ => None,
                },
            };
            Ok(EngineEvent::Stored(BlockStored {
                block_hashes: hashes(require("block_hashes")?)?,
                parent_block_hash: opt_hash(get("parent_block_hash"))?,
                token_ids: token_ids(require("token_ids")?)?,
                block_size: block_size(require("block_size")?)?,
                lora_id: opt_int(get("lora_id"), "lora_id")?,
                lora_name: opt_str(get("lora_name"), "lora_name")?,
                medium: opt_str(get("medium"), "medium")?,
                locality: opt_str(get("locality"), "locality")?,
                extra_keys: extra_keys(get("extra_keys"))?,
                group_idx: opt_int(get("group_idx"), "group_idx")?,
                kv_cache_spec_kind: opt_str(get("kv_cache_spec_kind"), "kv_cache_spec_kind")?,
                cache_salt,
            }))
        }
        "BlockRemoved" => Ok(EngineEvent::Removed(BlockRemoved {
            block_hashes: hashes(require("block_hashes")?)?,
            medium: opt_str(get("medium"), "medium")?,
            locality: opt_str(get("locality"), "locality")?,
            group_idx: opt_int(get("group_idx"), "group_idx")?,
        })),
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Err(DecodeError::new(
            DecodeReason::UnknownEventType,
            format!("event type {other:?}"),
        )),
    }
}

/// An engine hash in either representation (see the module docs).
pub(crate) fn engine_hash(v: &Value) -> Result<u64, DecodeError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or_else(|| DecodeError::new(DecodeReason::BlockHash, "integer out of range")),
        Value::Binary(b) => Ok(bytes_to_hash(b)),
        _ => Err(DecodeError::new(
            DecodeReason::BlockHash,
            "block hash is neither an integer nor bytes",
        )),
    }
}

/// The last 8 bytes of `b`, big-endian (zero-extended when shorter).
pub(crate) fn bytes_to_hash(b: &[u8]) -> u64 {
    let tail = &b[b.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, x| (acc << 8) | u64::from(*x))
}

fn opt_hash(v: &Value) -> Result<Option<u64>, DecodeError> {
    match v {
        Value::Nil => Ok(None),
        v => engine_hash(v).map(Some),
    }
}

fn hashes(v: &Value) -> Result<Vec<u64>, DecodeError> {
    match v {
        Value::Array(items) => items.iter().map(engine_hash).collect(),
        _ => Err(DecodeError::new(
            DecodeReason::BlockHash,
            "block_hashes is not an array",
        )),
    }
}

fn token_ids(v: &Value) -> Result<Vec<u32>, DecodeError> {
    let Value::Array(items) = v else {
        return Err(DecodeError::new(
            DecodeReason::TokenId,
            "token_ids is not an array",
        ));
    };
    items
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| DecodeError::new(DecodeReason::TokenId, format!("token id {t}")))
        })
        .collect()
}

/// A block size; 0 is what vLLM's placeholder host events carry (the
/// translation refuses it anywhere else).
fn block_size(v: &Value) -> Result<u32, DecodeError> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| DecodeError::new(DecodeReason::TokenId, format!("block_size {v}")))
}

fn opt_int(v: &Value, what: &str) -> Result<Option<i64>, DecodeError> {
    match v {
        Value::Nil => Ok(None),
        Value::Integer(i) => i
            .as_i64()
            .map(Some)
            .ok_or_else(|| shape(format!("{what} out of range"))),
        _ => Err(shape(format!("{what} is not an integer"))),
    }
}

fn opt_str(v: &Value, what: &str) -> Result<Option<String>, DecodeError> {
    match v {
        Value::Nil => Ok(None),
        Value::String(s) => s
            .as_str()
            .map(|s| Some(s.to_owned()))
            .ok_or_else(|| shape(format!("{what} is not UTF-8"))),
        _ => Err(shape(format!("{what} is not a string"))),
    }
}

fn extra_key(v: &Value) -> ExtraKey {
    match v {
        Value::String(s) => s
            .as_str()
            .map_or(ExtraKey::Other, |s| ExtraKey::Text(s.to_owned())),
        Value::Binary(b) => ExtraKey::Bytes(b.clone()),
        Value::Array(pair) => match pair.as_slice() {
            [Value::String(id), Value::Integer(off)] => match (id.as_str(), off.as_i64()) {
                (Some(id), Some(offset)) => ExtraKey::Multimodal {
                    identifier: id.to_owned(),
                    offset,
                },
                _ => ExtraKey::Other,
            },
            _ => ExtraKey::Other,
        },
        _ => ExtraKey::Other,
    }
}

fn extra_keys(v: &Value) -> Result<Option<Vec<Option<Vec<ExtraKey>>>>, DecodeError> {
    match v {
        Value::Nil => Ok(None),
        Value::Array(per_block) => per_block
            .iter()
            .map(|b| match b {
                Value::Nil => Ok(None),
                Value::Array(keys) => Ok(Some(keys.iter().map(extra_key).collect())),
                _ => Err(shape("extra_keys entry is not an array")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        _ => Err(shape("extra_keys is not an array")),
    }
}
