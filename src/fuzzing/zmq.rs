//! The ZeroMQ path: frame parsing (live and replay), msgpack payload
//! decoding in both dialects, and translation of the decoded events to
//! index events, as a rank's processor runs them.
//!
//! Input: one flag byte, then either the payload itself or multipart
//! frames (a count, then each frame but the last as a length byte and its
//! bytes; the last frame is the rest).

use std::{collections::HashMap, sync::Arc};

use super::Bytes;
use crate::engine_events::{
    translate::{TranslateOptions, Translated, Translator},
    wire::{self, Dialect, EngineEvent, ReplayFrame},
};
use kvroute_core::index::{KvEvent, TieredEvent};

/// Block sizes the translation is tried with (flag bits 4..6).
const BLOCK_SIZES: [u32; 4] = [1, 2, 4, 16];

/// Flag bits: 0 dialect (SGLang when set); 1..3 framing (0 a bare payload,
/// 1 live frames, 2 replay frames); 3 index KV cache group 0 only;
/// 4..6 block size.
pub fn zmq_payload(data: &[u8]) {
    let mut input = Bytes::new(data);
    let flags = input.u8();
    let dialect = if flags & 1 == 0 {
        Dialect::Vllm
    } else {
        Dialect::Sglang
    };
    let framing = (flags >> 1) & 3;
    let frames = match framing {
        1 | 2 => frames(&mut input),
        _ => vec![input.rest()],
    };
    let payload = match framing {
        1 => match wire::parse_live_frames(&frames) {
            Ok(live) => live.payload,
            Err(_) => return,
        },
        2 => match wire::parse_replay_frames(&frames) {
            Ok(ReplayFrame::Batch { payload, .. }) => payload,
            Ok(ReplayFrame::End) | Err(_) => return,
        },
        _ => frames.first().copied().unwrap_or_default(),
    };
    let Ok(batch) = wire::decode_batch(payload, dialect) else {
        return;
    };
    let opts = TranslateOptions {
        block_size: BLOCK_SIZES[usize::from(flags >> 4) & 3],
        kv_group: (flags & 8 != 0).then_some(0),
        lora_names: HashMap::from([(1, "adapter".to_string())]),
    };
    let mut translator = Translator::new(Arc::new(opts));
    for event in batch.events.into_iter().flatten() {
        let announced = match &event {
            EngineEvent::Stored(s) => s.block_hashes.len(),
            EngineEvent::Removed(r) => r.block_hashes.len(),
            EngineEvent::Cleared => 0,
        };
        match translator.translate(event) {
            Ok(Translated::Apply(TieredEvent {
                event: KvEvent::Stored { blocks, .. },
                ..
            })) => {
                assert_eq!(blocks.len(), announced, "one local hash per engine block");
            }
            Ok(Translated::Apply(TieredEvent {
                event: KvEvent::Removed { blocks } | KvEvent::StoredKnown { blocks },
                ..
            })) => {
                assert_eq!(blocks.len(), announced, "every named block kept");
            }
            Ok(_) | Err(_) => {}
        }
    }
}

/// Multipart frames: a count (0..=4), each frame but the last prefixed by
/// its length, the last one the rest.
fn frames<'a>(input: &mut Bytes<'a>) -> Vec<&'a [u8]> {
    let count = usize::from(input.u8() % 5);
    let mut frames = Vec::with_capacity(count);
    for i in 0..count {
        if i + 1 == count {
            frames.push(input.rest());
        } else {
            let len = usize::from(input.u8());
            frames.push(input.take(len));
        }
    }
    frames
}
