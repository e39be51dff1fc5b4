//! Local block hashes: kvroute's hash of the tokens of one KV block.
//!
//! Why this exists: the index matches requests against cached blocks by these
//! hashes, and frontends that hash prompts Dynamo-style must produce the same
//! numbers, so the definition is fixed and must stay bit-compatible with
//! `compute_block_hash_for_seq` of `dynamo-kv-router` 1.6.1 (proven by
//! `crates/kvroute-core/tests/it/hash_vectors.rs` and the committed vectors in `tests/data/`).
//!
//! Definition (invariants):
//! * Only complete blocks are hashed; a partial last block is ignored, and a
//!   `block_size` of 0 yields no hashes.
//! * Each block is hashed independently (hashes are not chained): XXH3-64 over
//!   the block's token ids written as little-endian `u32` bytes.
//! * The seed is 1337, plus (wrapping) XXH3-64 of the LoRA name with seed 0
//!   when a LoRA name is given, plus (wrapping) XXH3-64 of the cache namespace
//!   with seed 1 when a namespace is given. Empty strings count as absent.
//! * When block `i` has multimodal objects, their 64-bit hashes, sorted
//!   ascending, are appended to that block's bytes (little-endian `u64` each)
//!   before hashing. A block with an empty list hashes like a plain block.

use crate::types::LocalHash;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The base seed of every local block hash.
pub const BASE_SEED: u64 = 1337;

/// Request-wide identities that change the hash seed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HashOptions<'a> {
    /// LoRA adapter name; `None` or `""` means the base model.
    pub lora_name: Option<&'a str>,
    /// Cache isolation namespace (salt); `None` or `""` means none.
    pub cache_namespace: Option<&'a str>,
}

impl<'a> HashOptions<'a> {
    /// Options for a base-model request with no namespace.
    pub const fn plain() -> Self {
        Self {
            lora_name: None,
            cache_namespace: None,
        }
    }

    /// The XXH3 seed these options select (see the module docs).
    pub(crate) fn seed(&self) -> u64 {
        let mut seed = BASE_SEED;
        if let Some(lora) = self.lora_name.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
        }
        if let Some(ns) = self.cache_namespace.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(ns.as_bytes(), 1));
        }
        seed
    }
}

/// Local hashes of every complete block of `tokens`.
///
/// `block_mm_hashes[i]`, when present, lists the multimodal object hashes of
/// block `i` (any order; they are sorted here). Entries past the number of
/// complete blocks are ignored; missing entries mean "no multimodal objects".
pub fn compute_block_hashes(
    tokens: &[u32],
    block_size: u32,
    opts: &HashOptions<'_>,
    block_mm_hashes: Option<&[Vec<u64>]>,
) -> Vec<LocalHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let bs = block_size as usize;
    let mut hasher = BlockHasher::new(opts, bs, block_mm_hashes);
    let mut out = Vec::with_capacity(tokens.len() / bs);
    for (i, block) in tokens.chunks_exact(bs).enumerate() {
        hasher.scratch.clear();
        for t in block {
            hasher.scratch.extend_from_slice(&t.to_le_bytes());
        }
        out.push(hasher.hash_scratch(i));
    }
    out
}

/// [`compute_block_hashes`] of token ids already written as little-endian
/// `u32` bytes (`packed_token_ids` on the wire), which is the very input the
/// hash is defined over: a block without multimodal objects is hashed where
/// it lies, with no copy. Trailing bytes short of a whole token are ignored
/// like a partial block; callers validate the length first.
pub fn compute_block_hashes_le(
    token_bytes: &[u8],
    block_size: u32,
    opts: &HashOptions<'_>,
    block_mm_hashes: Option<&[Vec<u64>]>,
) -> Vec<LocalHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let block_bytes = block_size as usize * 4;
    let mut hasher = BlockHasher::new(opts, block_size as usize, block_mm_hashes);
    let mut out = Vec::with_capacity(token_bytes.len() / block_bytes);
    for (i, block) in token_bytes.chunks_exact(block_bytes).enumerate() {
        if hasher.mm_of(i).is_none() {
            out.push(xxh3_64_with_seed(block, hasher.seed));
        } else {
            hasher.scratch.clear();
            hasher.scratch.extend_from_slice(block);
            out.push(hasher.hash_scratch(i));
        }
    }
    out
}

/// The state one prompt's blocks share: the seed, the multimodal lists and
/// one scratch buffer reused for every block that needs copying.
struct BlockHasher<'m> {
    seed: u64,
    mm: Option<&'m [Vec<u64>]>,
    scratch: Vec<u8>,
    mm_sorted: Vec<u64>,
}

impl<'m> BlockHasher<'m> {
    fn new(opts: &HashOptions<'_>, block_size: usize, mm: Option<&'m [Vec<u64>]>) -> Self {
        Self {
            seed: opts.seed(),
            mm,
            scratch: Vec::with_capacity(block_size * 4),
            mm_sorted: Vec::new(),
        }
    }

    /// Block `i`'s multimodal hashes, if it has any.
    fn mm_of(&self, i: usize) -> Option<&'m [u64]> {
        self.mm
            .and_then(|all| all.get(i))
            .map(Vec::as_slice)
            .filter(|mm| !mm.is_empty())
    }

    /// The hash of block `i` whose token bytes are in `scratch`: its sorted
    /// multimodal hashes are appended first.
    fn hash_scratch(&mut self, i: usize) -> LocalHash {
        if let Some(mm) = self.mm_of(i) {
            self.mm_sorted.clear();
            self.mm_sorted.extend_from_slice(mm);
            self.mm_sorted.sort_unstable();
            for h in &self.mm_sorted {
                self.scratch.extend_from_slice(&h.to_le_bytes());
            }
        }
        xxh3_64_with_seed(&self.scratch, self.seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_block_ignored_and_zero_block_size() {
        let toks: Vec<u32> = (0..40).collect();
        assert_eq!(
            compute_block_hashes(&toks, 16, &HashOptions::plain(), None).len(),
            2
        );
        assert!(compute_block_hashes(&toks, 0, &HashOptions::plain(), None).is_empty());
    }

    #[test]
    fn empty_strings_are_absent_and_options_change_seed() {
        let empty = HashOptions {
            lora_name: Some(""),
            cache_namespace: Some(""),
        };
        assert_eq!(empty.seed(), BASE_SEED);
        let lora = HashOptions {
            lora_name: Some("a"),
            cache_namespace: None,
        };
        let ns = HashOptions {
            lora_name: None,
            cache_namespace: Some("a"),
        };
        assert_ne!(lora.seed(), ns.seed());
        assert_ne!(lora.seed(), BASE_SEED);
    }

    #[test]
    fn mm_order_does_not_matter_and_empty_mm_is_plain() {
        let toks: Vec<u32> = (0..32).collect();
        let o = HashOptions::plain();
        let a = compute_block_hashes(&toks, 16, &o, Some(&[vec![3, 1, 2], vec![]]));
        let b = compute_block_hashes(&toks, 16, &o, Some(&[vec![2, 3, 1]]));
        let plain = compute_block_hashes(&toks, 16, &o, None);
        assert_eq!(a, b);
        assert_ne!(a[0], plain[0]);
        assert_eq!(a[1], plain[1]);
    }

    #[test]
    fn packed_bytes_hash_like_token_ids() {
        let toks: Vec<u32> = (0..100).map(|t| t * 70_001).collect();
        let packed: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
        let lora = HashOptions {
            lora_name: Some("l"),
            cache_namespace: Some("n"),
        };
        let mm = [vec![9, 4], vec![], vec![7]];
        for opts in [HashOptions::plain(), lora] {
            for mm in [None, Some(&mm[..])] {
                for bs in [0, 1, 16, 33] {
                    assert_eq!(
                        compute_block_hashes_le(&packed, bs, &opts, mm),
                        compute_block_hashes(&toks, bs, &opts, mm),
                    );
                }
            }
        }
    }
}
