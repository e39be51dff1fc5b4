//! A rendered chat tokenized in segments, each segment's ids cached: a
//! conversation's next turn repeats the previous turns' text, and should
//! not pay to tokenize it again.
//!
//! Why this is exact: a Hugging Face tokenizer first cuts the text at its
//! added tokens, then normalizes and pre-tokenizes each piece between them
//! on its own. So cutting the text just before a special token (one that
//! strips no whitespace around it and is not single-word) and tokenizing
//! the pieces apart gives the same ids as tokenizing the whole. Special
//! tokens that strip whitespace are never cut at. The parity test runs
//! through this path.
//!
//! Bounds: segments shorter than [`MIN_CACHED_BYTES`] are tokenized each
//! time; the cache holds at most its capacity in ids (4 bytes each) over
//! two generations (the older dropped whole when the newer fills), so
//! memory is fixed whatever prompts arrive.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use xxhash_rust::xxh3::xxh3_128;

use crate::error::PromptError;

/// Segments shorter than this are not worth a lookup.
const MIN_CACHED_BYTES: usize = 64;

/// Prompts at least this long are tokenized in two halves at once.
const PARALLEL_BYTES: usize = 128 << 10;

/// Ids the cache holds by default (in two generations of half each).
pub const DEFAULT_CACHED_IDS: usize = 1 << 24;

/// Ids served from the cache and ids in all, since the start.
#[derive(Debug, Default)]
pub struct SegmentStats {
    pub cached_ids: AtomicU64,
    pub total_ids: AtomicU64,
}

#[derive(Debug, Default)]
struct Generations {
    young: HashMap<u128, Arc<[u32]>>,
    young_ids: usize,
    old: HashMap<u128, Arc<[u32]>>,
    /// Ids one generation holds at most.
    generation_ids: usize,
}

impl Generations {
    fn get(&mut self, key: u128) -> Option<Arc<[u32]>> {
        if let Some(ids) = self.young.get(&key) {
            return Some(ids.clone());
        }
        let ids = self.old.remove(&key)?;
        self.insert(key, ids.clone());
        Some(ids)
    }

    fn insert(&mut self, key: u128, ids: Arc<[u32]>) {
        if ids.len() > self.generation_ids {
            return;
        }
        if self.young_ids + ids.len() > self.generation_ids {
            self.old = std::mem::take(&mut self.young);
            self.young_ids = 0;
        }
        self.young_ids += ids.len();
        self.young.insert(key, ids);
    }
}

/// Where a text may be cut, and the cache of its segments' ids.
#[derive(Debug)]
pub(crate) struct Segments {
    /// Special tokens it is safe to cut before; `None` when there are none.
    markers: Option<aho_corasick::AhoCorasick>,
    cache: Mutex<Generations>,
    pub(crate) stats: SegmentStats,
}

impl Segments {
    /// The cut points of `tokenizer`'s special tokens, and a cache of at
    /// most `cached_ids` ids.
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer, cached_ids: usize) -> Self {
        let added = tokenizer.get_added_tokens_decoder();
        let markers: Vec<&str> = added
            .values()
            .filter(|t| t.special && !t.lstrip && !t.rstrip && !t.single_word)
            .map(|t| t.content.as_str())
            .filter(|content| !content.is_empty())
            .collect();
        // Where none can be built, nothing is cut: every cut is optional.
        let markers = (!markers.is_empty())
            .then(|| {
                aho_corasick::AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                    .build(&markers)
                    .ok()
            })
            .flatten();
        Self {
            markers,
            cache: Mutex::new(Generations {
                generation_ids: cached_ids / 2,
                ..Generations::default()
            }),
            stats: SegmentStats::default(),
        }
    }

    /// The byte offsets where a special token starts (0 excluded). Any
    /// set of such offsets gives the same ids, so the matches need not
    /// overlap.
    fn cuts(&self, text: &str) -> Vec<usize> {
        let Some(markers) = &self.markers else {
            return Vec::new();
        };
        markers
            .find_iter(text)
            .map(|m| m.start())
            .filter(|at| *at > 0)
            .collect()
    }

    /// The ids of `text` (no special tokens added), segment by segment,
    /// each segment's by `encode` unless cached, and how many of them came
    /// from the cache.
    pub(crate) fn encode(
        &self,
        text: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, PromptError> + Sync,
    ) -> Result<(Vec<u32>, u64), PromptError> {
        let mut segments = Vec::new();
        let mut start = 0;
        for end in self.cuts(text) {
            if !text.is_char_boundary(end) {
                // Cannot happen at an ASCII marker's start: the rest is
                // then tokenized whole.
                break;
            }
            segments.push(start..end);
            start = end;
        }
        segments.push(start..text.len());
        let run = |segments: &[std::ops::Range<usize>]| {
            let bytes =
                segments.last().map_or(0, |s| s.end) - segments.first().map_or(0, |s| s.start);
            let mut ids = Vec::with_capacity(bytes / 3);
            let mut cached = 0u64;
            for segment in segments {
                self.encode_segment(&text[segment.clone()], &encode, &mut ids, &mut cached)?;
            }
            Ok::<_, PromptError>((ids, cached))
        };
        let (ids, cached) = if text.len() >= PARALLEL_BYTES && segments.len() >= 2 {
            // A long prompt's second half on a second thread: a 100k-token
            // prompt is tokenized in about half the time when a core is
            // free. Both halves are exact (cut before special tokens).
            let half = segments
                .iter()
                .position(|s| s.end >= text.len() / 2)
                .map_or(1, |at| at + 1)
                .min(segments.len() - 1);
            let (front, back) = segments.split_at(half);
            std::thread::scope(|scope| {
                let back_job = std::thread::Builder::new()
                    .name("kvroute-tokenize".into())
                    .spawn_scoped(scope, || run(back));
                let Ok(back_job) = back_job else {
                    // No thread to be had: one after the other.
                    return run(&segments);
                };
                let (mut ids, cached) = run(front)?;
                let (more, more_cached) = back_job
                    .join()
                    .map_err(|_| PromptError::Tokenize("a tokenizing thread failed".into()))??;
                ids.extend_from_slice(&more);
                Ok((ids, cached + more_cached))
            })?
        } else {
            run(&segments)?
        };
        self.stats.cached_ids.fetch_add(cached, Ordering::Relaxed);
        self.stats
            .total_ids
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        Ok((ids, cached))
    }

    /// One segment's ids onto `ids`: from the cache, or by `encode` (and
    /// then kept) when it is long enough to be worth a lookup.
    fn encode_segment(
        &self,
        piece: &str,
        encode: &impl Fn(&str) -> Result<Vec<u32>, PromptError>,
        ids: &mut Vec<u32>,
        cached: &mut u64,
    ) -> Result<(), PromptError> {
        if piece.len() < MIN_CACHED_BYTES {
            ids.extend(encode(piece)?);
            return Ok(());
        }
        let key = xxh3_128(piece.as_bytes());
        let hit = self.cache.lock().ok().and_then(|mut c| c.get(key));
        match hit {
            Some(piece_ids) => {
                *cached += piece_ids.len() as u64;
                ids.extend_from_slice(&piece_ids);
            }
            None => {
                let piece_ids: Arc<[u32]> = encode(piece)?.into();
                ids.extend_from_slice(&piece_ids);
                if let Ok(mut cache) = self.cache.lock() {
                    cache.insert(key, piece_ids);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_hold_a_fixed_number_of_ids() {
        let mut cache = Generations {
            generation_ids: 1 << 20,
            ..Generations::default()
        };
        for key in 0..10_000u128 {
            cache.insert(key, vec![0u32; 1000].into());
        }
        let held: usize = cache
            .young
            .values()
            .chain(cache.old.values())
            .map(|v| v.len())
            .sum();
        assert!(held <= 2 << 20, "{held}");
        // The newest is there; a lookup in the old generation promotes it.
        assert!(cache.get(9_999).is_some());
        let old_key = *cache.old.keys().next().unwrap();
        assert!(cache.get(old_key).is_some());
        assert!(cache.young.contains_key(&old_key));
        // Off: nothing is kept.
        let mut off = Generations::default();
        off.insert(1, vec![1u32].into());
        assert!(off.get(1).is_none());
    }
}
