//! Engine events to index events: local hashes, media and groups.
//!
//! Why this exists: the index matches requests by kvroute's local hashes,
//! which the engines do not send. We recompute them from each event's
//! `token_ids` exactly as kvroute hashes a request (`hashing`), folding in
//! the same identities, so a request's prompt matches what the engine stored:
//! * LoRA: the event's `lora_name`; failing that, `lora_id` looked up in the
//!   configured id -> name map; an unmapped id is hashed as `"lora-id:<id>"`
//!   so such blocks never match base-model requests (counted as a skip reason
//!   nowhere: they are correct, just unmatched until configured).
//! * Cache salt -> `cache_namespace`: SGLang sends it as `cache_salt` (map)
//!   or in a trailing metadata map (array). vLLM puts it in block 0's
//!   `extra_keys` of a request, after the LoRA name and multimodal items;
//!   later events of the same request only name their parent, so the salt of
//!   every salted block is remembered per rank and inherited by children.
//! * Multimodal: vLLM's extra key `[identifier, offset]` contributes
//!   `xxh3_64(identifier, seed 0)` ([`mm_identifier_hash`]) to that block's
//!   mm hashes; frontends must hash a request's multimodal identifiers the
//!   same way. The in-block offset is not part of kvroute's hash.
//! * Any other extra key (prompt-embeds bytes, unknown shapes) cannot be
//!   represented: the event is skipped ([`DecodeReason::UnsupportedExtraKey`])
//!   rather than risk matching requests that merely share token ids.
//!
//! Only media in `cached_media` (default `GPU`; no medium means GPU) change
//! the index; other media are counted. Events of a KV cache group other than
//! the configured one (hybrid models) are counted and skipped.

use std::collections::HashMap;
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::wire::{DecodeError, DecodeReason, EngineEvent, ExtraKey};
use kvroute_core::hashing::{HashOptions, compute_block_hashes};
use kvroute_core::index::KvEvent;
use kvroute_core::types::EngineHash;

/// The medium engines report for device memory; also assumed when absent.
pub const MEDIUM_GPU: &str = "GPU";

/// The labels `engine_event_media_total` counts store and remove events
/// under: `none` (an event naming no medium: the device), the media
/// engines name in their KV events (vLLM's `GPU`, `CPU`, `FS`, `OBJ`,
/// `STORAGE`; SGLang's `CPU_PINNED`, `CPU_TIER1`, `CPU_TIER2`; llm-d's
/// `SHARED_STORAGE`, `OBJECT_STORE`), then `unknown` for any other value.
pub const MEDIUM_LABELS: [&str; 12] = [
    "none",
    "GPU",
    "CPU",
    "FS",
    "OBJ",
    "STORAGE",
    "CPU_PINNED",
    "CPU_TIER1",
    "CPU_TIER2",
    "SHARED_STORAGE",
    "OBJECT_STORE",
    "unknown",
];

/// Where `unknown` is in [`MEDIUM_LABELS`].
const UNKNOWN_MEDIUM: usize = MEDIUM_LABELS.len() - 1;

/// The media engines name, by their names: [`MEDIUM_LABELS`] less `none`
/// and `unknown`.
pub fn known_media() -> &'static [&'static str] {
    &MEDIUM_LABELS[1..UNKNOWN_MEDIUM]
}

/// Where in [`MEDIUM_LABELS`] an event's medium is counted: a known medium
/// by its name (any case), `none` when the event names none, `unknown` for
/// any other value, whatever its length or bytes (never echoed: an engine
/// must not choose the metric's labels).
pub fn medium_index(medium: Option<&str>) -> usize {
    let Some(medium) = medium else {
        return 0;
    };
    known_media()
        .iter()
        .position(|known| known.eq_ignore_ascii_case(medium))
        .map_or(UNKNOWN_MEDIUM, |i| i + 1)
}

/// The label [`medium_index`] counts `medium` under.
pub fn medium_label(medium: Option<&str>) -> &'static str {
    MEDIUM_LABELS[medium_index(medium)]
}

/// kvroute's 64-bit id of a multimodal item identifier (see module docs).
pub fn mm_identifier_hash(identifier: &str) -> u64 {
    xxh3_64_with_seed(identifier.as_bytes(), 0)
}

/// What to do with one engine event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Translated {
    Apply(KvEvent),
    /// Stored or removed on a medium not counted as cached.
    OtherMedium,
    /// A KV cache group other than the configured one.
    OtherGroup,
    /// Nothing to do (e.g. an empty block list).
    Nothing,
}

/// Translation settings of one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TranslateOptions {
    pub block_size: u32,
    /// Media whose blocks count as cached for routing.
    pub cached_media: Vec<String>,
    /// The KV cache group to index; events without a group always count.
    /// `None`: every group.
    pub kv_group: Option<i64>,
    /// LoRA id -> name, for engines that report only the id.
    pub lora_names: HashMap<i64, String>,
}

/// Per-rank translation state (inherited cache salts).
#[derive(Debug)]
pub struct Translator {
    opts: Arc<TranslateOptions>,
    /// The cache salt of each salted block the rank holds: a block stored
    /// under a salted parent inherits it. Shared, so a snapshot can save it
    /// (a chain continued after a restart must hash with its salt).
    salts: Salts,
}

/// Engine hash -> cache salt, of one rank's salted blocks.
pub type Salts = Arc<parking_lot::Mutex<HashMap<EngineHash, Arc<str>>>>;

impl Translator {
    pub(crate) fn new(opts: Arc<TranslateOptions>) -> Self {
        Self {
            opts,
            salts: Salts::default(),
        }
    }

    /// The salts, shared with whoever saves them.
    pub(crate) fn salts(&self) -> &Salts {
        &self.salts
    }

    /// Takes saved salts back (a resume from a snapshot).
    pub(crate) fn restore_salts(
        &mut self,
        saved: impl IntoIterator<Item = (EngineHash, Arc<str>)>,
    ) {
        self.salts.lock().extend(saved);
    }

    /// Forget all per-rank state (engine restart or cache cleared).
    pub(crate) fn reset(&mut self) {
        self.salts.lock().clear();
    }

    fn counts_medium(&self, medium: Option<&str>) -> bool {
        let m = medium.unwrap_or(MEDIUM_GPU);
        self.opts
            .cached_media
            .iter()
            .any(|c| c.eq_ignore_ascii_case(m))
    }

    fn counts_group(&self, group: Option<i64>) -> bool {
        match (self.opts.kv_group, group) {
            (Some(want), Some(got)) => want == got,
            _ => true,
        }
    }

    pub(crate) fn translate(&mut self, event: EngineEvent) -> Result<Translated, DecodeError> {
        match event {
            EngineEvent::Cleared => {
                self.salts.lock().clear();
                Ok(Translated::Apply(KvEvent::Cleared))
            }
            EngineEvent::Removed(r) => {
                if !self.counts_group(r.group_idx) {
                    return Ok(Translated::OtherGroup);
                }
                if !self.counts_medium(r.medium.as_deref()) {
                    return Ok(Translated::OtherMedium);
                }
                if r.block_hashes.is_empty() {
                    return Ok(Translated::Nothing);
                }
                let mut salts = self.salts.lock();
                for h in &r.block_hashes {
                    salts.remove(h);
                }
                drop(salts);
                Ok(Translated::Apply(KvEvent::Removed {
                    blocks: r.block_hashes,
                }))
            }
            EngineEvent::Stored(s) => {
                if !self.counts_group(s.group_idx) {
                    return Ok(Translated::OtherGroup);
                }
                if !self.counts_medium(s.medium.as_deref()) {
                    return Ok(Translated::OtherMedium);
                }
                if s.block_hashes.is_empty() {
                    return Ok(Translated::Nothing);
                }
                let bs = self.opts.block_size;
                if s.block_size != bs {
                    return Err(DecodeError::new(
                        DecodeReason::BlockSizeMismatch,
                        format!(
                            "event block_size {} != worker block_size {bs}",
                            s.block_size
                        ),
                    ));
                }
                let n = s.block_hashes.len();
                if s.token_ids.len() != n * bs as usize {
                    return Err(DecodeError::new(
                        DecodeReason::TokenCount,
                        format!("{} token ids for {n} blocks of {bs}", s.token_ids.len()),
                    ));
                }
                let lora_name: Option<String> = match (&s.lora_name, s.lora_id) {
                    (Some(name), _) if !name.is_empty() => Some(name.clone()),
                    (_, Some(id)) => Some(
                        self.opts
                            .lora_names
                            .get(&id)
                            .cloned()
                            .unwrap_or_else(|| format!("lora-id:{id}")),
                    ),
                    _ => None,
                };
                let (mm, salt_from_keys) =
                    interpret_extra_keys(s.extra_keys.as_deref(), lora_name.as_deref(), n)?;
                let namespace: Option<Arc<str>> = s
                    .cache_salt
                    .filter(|x| !x.is_empty())
                    .map(Arc::from)
                    .or(salt_from_keys.map(Arc::from))
                    .or_else(|| {
                        s.parent_block_hash
                            .and_then(|p| self.salts.lock().get(&p).cloned())
                    });
                let opts = HashOptions {
                    lora_name: lora_name.as_deref(),
                    cache_namespace: namespace.as_deref(),
                };
                let locals = compute_block_hashes(&s.token_ids, bs, &opts, mm.as_deref());
                if let Some(ns) = &namespace {
                    let mut salts = self.salts.lock();
                    for h in &s.block_hashes {
                        salts.insert(*h, Arc::clone(ns));
                    }
                }
                Ok(Translated::Apply(KvEvent::Stored {
                    parent: s.parent_block_hash,
                    blocks: s.block_hashes.into_iter().zip(locals).collect(),
                }))
            }
        }
    }
}

type MmPerBlock = Vec<Vec<u64>>;

/// Split vLLM extra keys into per-block mm hashes and the cache salt.
fn interpret_extra_keys(
    keys: Option<&[Option<Vec<ExtraKey>>]>,
    lora_name: Option<&str>,
    blocks: usize,
) -> Result<(Option<MmPerBlock>, Option<String>), DecodeError> {
    let Some(keys) = keys else {
        return Ok((None, None));
    };
    let mut mm: MmPerBlock = vec![Vec::new(); blocks];
    let mut any_mm = false;
    let mut salt = None;
    for (i, block_keys) in keys.iter().enumerate().take(blocks) {
        let Some(block_keys) = block_keys else {
            continue;
        };
        for (j, key) in block_keys.iter().enumerate() {
            match key {
                ExtraKey::Text(t) if j == 0 && Some(t.as_str()) == lora_name => {}
                ExtraKey::Text(t) => {
                    if !t.is_empty() {
                        salt = Some(t.clone());
                    }
                }
                ExtraKey::Multimodal { identifier, .. } => {
                    if let Some(slot) = mm.get_mut(i) {
                        slot.push(mm_identifier_hash(identifier));
                        any_mm = true;
                    }
                }
                ExtraKey::Bytes(_) | ExtraKey::Other => {
                    return Err(DecodeError::new(
                        DecodeReason::UnsupportedExtraKey,
                        format!("block {i} has an extra key kvroute cannot hash: {key:?}"),
                    ));
                }
            }
        }
    }
    Ok((any_mm.then_some(mm), salt))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_events::wire::{BlockRemoved, BlockStored};

    fn opts() -> Arc<TranslateOptions> {
        Arc::new(TranslateOptions {
            block_size: 2,
            cached_media: vec![MEDIUM_GPU.to_owned()],
            kv_group: Some(0),
            lora_names: HashMap::from([(7, "ad".to_owned())]),
        })
    }

    fn stored(hashes: &[u64], parent: Option<u64>, toks: &[u32]) -> BlockStored {
        BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: toks.to_vec(),
            block_size: 2,
            ..BlockStored::default()
        }
    }

    fn locals(ev: &Translated) -> Vec<u64> {
        match ev {
            Translated::Apply(KvEvent::Stored { blocks, .. }) => {
                blocks.iter().map(|b| b.1).collect()
            }
            _ => Vec::new(),
        }
    }

    #[test]
    fn plain_store_matches_request_hashing() -> Result<(), DecodeError> {
        let mut t = Translator::new(opts());
        let out = t.translate(EngineEvent::Stored(stored(&[1, 2], None, &[1, 2, 3, 4])))?;
        let want = compute_block_hashes(&[1, 2, 3, 4], 2, &HashOptions::plain(), None);
        assert_eq!(locals(&out), want);
        Ok(())
    }

    #[test]
    fn vllm_salt_in_block0_is_inherited_by_children() -> Result<(), DecodeError> {
        let mut t = Translator::new(opts());
        let mut s = stored(&[1], None, &[1, 2]);
        s.lora_name = Some("ad".into());
        s.extra_keys = Some(vec![Some(vec![
            ExtraKey::Text("ad".into()),
            ExtraKey::Multimodal {
                identifier: "img".into(),
                offset: 0,
            },
            ExtraKey::Text("salt".into()),
        ])]);
        let first = t.translate(EngineEvent::Stored(s))?;
        let o = HashOptions {
            lora_name: Some("ad"),
            cache_namespace: Some("salt"),
        };
        let mm = vec![vec![mm_identifier_hash("img")]];
        assert_eq!(
            locals(&first),
            compute_block_hashes(&[1, 2], 2, &o, Some(&mm))
        );
        let mut child = stored(&[2], Some(1), &[3, 4]);
        child.lora_id = Some(7);
        let second = t.translate(EngineEvent::Stored(child))?;
        assert_eq!(locals(&second), compute_block_hashes(&[3, 4], 2, &o, None));
        Ok(())
    }

    #[test]
    fn sglang_salt_field() -> Result<(), DecodeError> {
        let mut t = Translator::new(opts());
        let mut s = stored(&[1], None, &[1, 2]);
        s.cache_salt = Some("tenant".into());
        let out = t.translate(EngineEvent::Stored(s))?;
        let o = HashOptions {
            lora_name: None,
            cache_namespace: Some("tenant"),
        };
        assert_eq!(locals(&out), compute_block_hashes(&[1, 2], 2, &o, None));
        Ok(())
    }

    #[test]
    fn media_groups_and_errors() {
        let mut t = Translator::new(opts());
        let mut s = stored(&[1], None, &[1, 2]);
        s.medium = Some("CPU_PINNED".into());
        assert_eq!(
            t.translate(EngineEvent::Stored(s)),
            Ok(Translated::OtherMedium)
        );
        let mut s = stored(&[1], None, &[1, 2]);
        s.group_idx = Some(1);
        assert_eq!(
            t.translate(EngineEvent::Stored(s)),
            Ok(Translated::OtherGroup)
        );
        let r = BlockRemoved {
            block_hashes: vec![1],
            medium: Some("gpu".into()),
            group_idx: None,
        };
        assert!(matches!(
            t.translate(EngineEvent::Removed(r)),
            Ok(Translated::Apply(KvEvent::Removed { .. }))
        ));
        let s = stored(&[1, 2], None, &[1, 2, 3]);
        assert_eq!(
            t.translate(EngineEvent::Stored(s)).map_err(|e| e.reason),
            Err(DecodeReason::TokenCount)
        );
        let mut s = stored(&[1], None, &[1, 2, 3, 4]);
        s.block_size = 4;
        assert_eq!(
            t.translate(EngineEvent::Stored(s)).map_err(|e| e.reason),
            Err(DecodeReason::BlockSizeMismatch)
        );
        let mut s = stored(&[1], None, &[1, 2]);
        s.extra_keys = Some(vec![Some(vec![ExtraKey::Bytes(vec![1])])]);
        assert_eq!(
            t.translate(EngineEvent::Stored(s)).map_err(|e| e.reason),
            Err(DecodeReason::UnsupportedExtraKey)
        );
    }
}
