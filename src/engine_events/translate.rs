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
//! Media are tiers ([`medium_tier`]): the device (`GPU`, or no medium), host
//! memory, local storage, or an external pool. A medium kvroute does not know
//! is counted and the event ignored, never guessed. A host-tier store that
//! names its blocks by engine hash alone (vLLM before
//! `self_describing_kv_events`: no token ids, `block_size` 0) becomes
//! [`KvEvent::StoredKnown`]: the index places each block where another tier
//! of the rank holds it. `AllBlocksCleared` clears every tier (see
//! [`TieredEvent`]). Events of a KV
//! cache group other than the configured one (hybrid models) are counted and
//! skipped.

use std::collections::HashMap;
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::wire::{DecodeError, DecodeReason, EngineEvent, ExtraKey};
use kvroute_core::hashing::{HashOptions, compute_block_hashes};
use kvroute_core::index::{KvEvent, Tier, TieredEvent};
use kvroute_core::types::EngineHash;

/// The medium engines report for device memory; also assumed when absent.
pub const MEDIUM_GPU: &str = "GPU";

/// The tier an event's medium names; `None` for a medium kvroute does not
/// know. `locality` is vLLM's for `STORAGE`: `REMOTE` storage is shared
/// beyond the machine (external), anything else local.
///
/// * device: no medium, `GPU`;
/// * host: vLLM's and LMCache's `CPU`, SGLang's `CPU_PINNED` and its older
///   `CPU_TIER1`;
/// * storage: vLLM's `FS`, local `STORAGE`, SGLang's older `CPU_TIER2`
///   (its third tier, below host memory);
/// * external: vLLM's `OBJ`, remote `STORAGE`, llm-d's `SHARED_STORAGE` and
///   `OBJECT_STORE`.
pub fn medium_tier(medium: Option<&str>, locality: Option<&str>) -> Option<Tier> {
    let (label, tier) = MEDIA[medium_index(medium)];
    let remote = locality.is_some_and(|l| l.eq_ignore_ascii_case("REMOTE"));
    match tier {
        Some(Tier::Storage) if label == "STORAGE" && remote => Some(Tier::External),
        tier => tier,
    }
}

/// Every medium label with its tier, in one list so a medium is named and
/// placed once: `none` (an event naming no medium: the device), the media
/// engines name in their KV events (vLLM's `GPU`, `CPU`, `FS`, `OBJ`,
/// `STORAGE`; SGLang's `CPU_PINNED`, `CPU_TIER1`, `CPU_TIER2`; llm-d's
/// `SHARED_STORAGE`, `OBJECT_STORE`), then `unknown` for any other value
/// (no tier). `STORAGE` is local here; [`medium_tier`] makes remote storage
/// external.
const MEDIA: [(&str, Option<Tier>); 12] = [
    ("none", Some(Tier::Device)),
    ("GPU", Some(Tier::Device)),
    ("CPU", Some(Tier::Host)),
    ("FS", Some(Tier::Storage)),
    ("OBJ", Some(Tier::External)),
    ("STORAGE", Some(Tier::Storage)),
    ("CPU_PINNED", Some(Tier::Host)),
    ("CPU_TIER1", Some(Tier::Host)),
    ("CPU_TIER2", Some(Tier::Storage)),
    ("SHARED_STORAGE", Some(Tier::External)),
    ("OBJECT_STORE", Some(Tier::External)),
    ("unknown", None),
];

/// The labels `engine_event_media_total` counts store and remove events
/// under: [`MEDIA`]'s names.
pub const MEDIUM_LABELS: [&str; MEDIA.len()] = {
    let mut labels = [""; MEDIA.len()];
    let mut i = 0;
    while i < MEDIA.len() {
        labels[i] = MEDIA[i].0;
        i += 1;
    }
    labels
};

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
    Apply(TieredEvent),
    /// Stored or removed on a medium kvroute does not know.
    UnknownMedium,
    /// A KV cache group other than the configured one.
    OtherGroup,
    /// Nothing to do (e.g. an empty block list).
    Nothing,
}

/// Translation settings of one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TranslateOptions {
    pub block_size: u32,
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
    /// The multimodal hashes of each device block that has any: vLLM's
    /// host-tier events carry no extra keys, so a block offloaded from the
    /// device is hashed with what its device store carried. Kept for the
    /// device's blocks only (dropped with them), so bounded by its capacity.
    mm_blocks: HashMap<EngineHash, Vec<u64>>,
}

/// Engine hash -> cache salt, of one rank's salted blocks.
pub type Salts = Arc<parking_lot::Mutex<HashMap<EngineHash, Arc<str>>>>;

impl Translator {
    pub(crate) fn new(opts: Arc<TranslateOptions>) -> Self {
        Self {
            opts,
            salts: Salts::default(),
            mm_blocks: HashMap::new(),
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
        self.mm_blocks.clear();
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
                self.reset();
                // Every tier (see `TieredEvent`).
                Ok(Translated::Apply(TieredEvent::device(KvEvent::Cleared)))
            }
            EngineEvent::Removed(r) => {
                if !self.counts_group(r.group_idx) {
                    return Ok(Translated::OtherGroup);
                }
                let Some(tier) = medium_tier(r.medium.as_deref(), r.locality.as_deref()) else {
                    return Ok(Translated::UnknownMedium);
                };
                if r.block_hashes.is_empty() {
                    return Ok(Translated::Nothing);
                }
                if tier == Tier::Device {
                    // A lower tier's copy may still be offloaded from the
                    // device's; only the device's own eviction forgets.
                    let mut salts = self.salts.lock();
                    for h in &r.block_hashes {
                        salts.remove(h);
                        self.mm_blocks.remove(h);
                    }
                }
                Ok(Translated::Apply(TieredEvent::new(
                    tier,
                    KvEvent::Removed {
                        blocks: r.block_hashes,
                    },
                )))
            }
            EngineEvent::Stored(s) => {
                if !self.counts_group(s.group_idx) {
                    return Ok(Translated::OtherGroup);
                }
                let Some(tier) = medium_tier(s.medium.as_deref(), s.locality.as_deref()) else {
                    return Ok(Translated::UnknownMedium);
                };
                if s.block_hashes.is_empty() {
                    return Ok(Translated::Nothing);
                }
                if tier != Tier::Device && s.block_size == 0 && s.token_ids.is_empty() {
                    // Named by engine hash only: blocks another tier holds.
                    return Ok(Translated::Apply(TieredEvent::new(
                        tier,
                        KvEvent::StoredKnown {
                            blocks: s.block_hashes,
                        },
                    )));
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
                let (mut mm, salt_from_keys) =
                    interpret_extra_keys(s.extra_keys.as_deref(), lora_name.as_deref(), n)?;
                let offloaded = tier != Tier::Device && s.extra_keys.is_none();
                // An offloaded block without extra keys takes its salt and
                // multimodal items from its own device store, else from
                // its parent's salt.
                let own_salt = || {
                    let salts = self.salts.lock();
                    s.block_hashes.iter().find_map(|h| salts.get(h).cloned())
                };
                let namespace: Option<Arc<str>> = s
                    .cache_salt
                    .filter(|x| !x.is_empty())
                    .map(Arc::from)
                    .or(salt_from_keys.map(Arc::from))
                    .or_else(|| if offloaded { own_salt() } else { None })
                    .or_else(|| {
                        s.parent_block_hash
                            .and_then(|p| self.salts.lock().get(&p).cloned())
                    });
                if offloaded
                    && s.block_hashes
                        .iter()
                        .any(|h| self.mm_blocks.contains_key(h))
                {
                    mm = Some(
                        s.block_hashes
                            .iter()
                            .map(|h| self.mm_blocks.get(h).cloned().unwrap_or_default())
                            .collect(),
                    );
                }
                let opts = HashOptions {
                    lora_name: lora_name.as_deref(),
                    cache_namespace: namespace.as_deref(),
                };
                let locals = compute_block_hashes(&s.token_ids, bs, &opts, mm.as_deref());
                if tier == Tier::Device {
                    if let Some(ns) = &namespace {
                        let mut salts = self.salts.lock();
                        for h in &s.block_hashes {
                            salts.insert(*h, Arc::clone(ns));
                        }
                    }
                    if let Some(mm) = &mm {
                        for (h, items) in s.block_hashes.iter().zip(mm) {
                            if !items.is_empty() {
                                self.mm_blocks.insert(*h, items.clone());
                            }
                        }
                    }
                }
                Ok(Translated::Apply(TieredEvent::new(
                    tier,
                    KvEvent::Stored {
                        parent: s.parent_block_hash,
                        blocks: s.block_hashes.into_iter().zip(locals).collect(),
                    },
                )))
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
            Translated::Apply(TieredEvent {
                event: KvEvent::Stored { blocks, .. },
                ..
            }) => blocks.iter().map(|b| b.1).collect(),
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
    fn media_name_tiers() {
        let cases = [
            (None, None, Some(Tier::Device)),
            (Some("gpu"), None, Some(Tier::Device)),
            (Some("CPU"), None, Some(Tier::Host)),
            (Some("CPU_PINNED"), None, Some(Tier::Host)),
            (Some("CPU_TIER1"), None, Some(Tier::Host)),
            (Some("CPU_TIER2"), None, Some(Tier::Storage)),
            (Some("FS"), None, Some(Tier::Storage)),
            (Some("STORAGE"), None, Some(Tier::Storage)),
            (Some("STORAGE"), Some("LOCAL"), Some(Tier::Storage)),
            (Some("STORAGE"), Some("remote"), Some(Tier::External)),
            (Some("OBJ"), None, Some(Tier::External)),
            (Some("SHARED_STORAGE"), None, Some(Tier::External)),
            (Some("OBJECT_STORE"), None, Some(Tier::External)),
            (Some(""), None, None),
            (Some("NVME"), None, None),
        ];
        for (medium, locality, want) in cases {
            assert_eq!(
                medium_tier(medium, locality),
                want,
                "{medium:?} {locality:?}"
            );
        }
        // Every medium the metrics name is a tier.
        for known in known_media() {
            assert!(medium_tier(Some(known), None).is_some(), "{known}");
        }
    }

    #[test]
    fn host_events_with_and_without_tokens() -> Result<(), DecodeError> {
        let mut t = Translator::new(opts());
        // Self-describing: tokens, parent on the device; hashed as usual.
        let mut s = stored(&[2], Some(1), &[3, 4]);
        s.medium = Some("CPU".into());
        let out = t.translate(EngineEvent::Stored(s))?;
        assert!(matches!(
            &out,
            Translated::Apply(TieredEvent {
                tier: Tier::Host,
                event: KvEvent::Stored {
                    parent: Some(1),
                    ..
                }
            })
        ));
        assert_eq!(
            locals(&out),
            compute_block_hashes(&[3, 4], 2, &HashOptions::plain(), None)
        );
        // A placeholder: engine hashes only.
        let placeholder = BlockStored {
            block_hashes: vec![1, 2],
            medium: Some("CPU".into()),
            ..BlockStored::default()
        };
        assert_eq!(
            t.translate(EngineEvent::Stored(placeholder.clone()))?,
            Translated::Apply(TieredEvent::new(
                Tier::Host,
                KvEvent::StoredKnown { blocks: vec![1, 2] }
            ))
        );
        // The same shape on the device is malformed, as before.
        let device = BlockStored {
            medium: None,
            ..placeholder
        };
        assert_eq!(
            t.translate(EngineEvent::Stored(device))
                .map_err(|e| e.reason),
            Err(DecodeReason::BlockSizeMismatch)
        );
        assert_eq!(
            t.translate(EngineEvent::Cleared)?,
            Translated::Apply(TieredEvent::device(KvEvent::Cleared))
        );
        Ok(())
    }

    #[test]
    fn an_offloaded_block_hashes_as_its_device_store_did() -> Result<(), DecodeError> {
        let mut t = Translator::new(opts());
        // Block 0 of a salted request with an image, on the device.
        let mut device = stored(&[1], None, &[1, 2]);
        device.extra_keys = Some(vec![Some(vec![
            ExtraKey::Multimodal {
                identifier: "img".into(),
                offset: 0,
            },
            ExtraKey::Text("salt".into()),
        ])]);
        let on_device = locals(&t.translate(EngineEvent::Stored(device))?);
        // vLLM's self-describing host event: the tokens, no extra keys.
        let mut host = stored(&[1], None, &[1, 2]);
        host.medium = Some("CPU".into());
        let offloaded = locals(&t.translate(EngineEvent::Stored(host.clone()))?);
        assert_eq!(offloaded, on_device);
        // A host removal forgets nothing; the device's own eviction does.
        let removal = |medium: &str| BlockRemoved {
            block_hashes: vec![1],
            medium: Some(medium.into()),
            ..BlockRemoved::default()
        };
        t.translate(EngineEvent::Removed(removal("CPU")))?;
        assert_eq!(
            locals(&t.translate(EngineEvent::Stored(host.clone()))?),
            on_device
        );
        t.translate(EngineEvent::Removed(removal("GPU")))?;
        assert_ne!(locals(&t.translate(EngineEvent::Stored(host))?), on_device);
        Ok(())
    }

    #[test]
    fn media_groups_and_errors() {
        let mut t = Translator::new(opts());
        let mut s = stored(&[1], None, &[1, 2]);
        s.medium = Some("CPU_PINNED\u{0}".into());
        assert_eq!(
            t.translate(EngineEvent::Stored(s)),
            Ok(Translated::UnknownMedium)
        );
        let mut s = stored(&[1], None, &[1, 2]);
        s.group_idx = Some(1);
        assert_eq!(
            t.translate(EngineEvent::Stored(s)),
            Ok(Translated::OtherGroup)
        );
        let r = BlockRemoved {
            locality: None,
            block_hashes: vec![1],
            medium: Some("gpu".into()),
            group_idx: None,
        };
        assert!(matches!(
            t.translate(EngineEvent::Removed(r)),
            Ok(Translated::Apply(TieredEvent {
                tier: Tier::Device,
                event: KvEvent::Removed { .. }
            }))
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
