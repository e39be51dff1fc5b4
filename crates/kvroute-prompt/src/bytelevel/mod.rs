//! An ids-only encoder for byte-level BPE tokenizers (Qwen, Llama 3,
//! GPT-2 and their kin), the front door's hot path.
//!
//! Why: Hugging Face's pipeline keeps, for every byte of the prompt, its
//! offsets and alignments through normalizer, pre-tokenizer and model, and
//! builds an `Encoding` with token strings; the router needs the ids only.
//! On 14k-token prompts that bookkeeping was most of a pick's time (#33).
//! This encoder does the same steps on plain bytes: the added tokens cut
//! out (leftmost-longest, as HF matches them), the text between them
//! normalized (by the tokenizer's own normalizer, and only when it is not
//! ASCII), split by the pre-tokenizer's regex, and each piece's bytes
//! merged by rank, the pieces' ids cached.
//!
//! Invariants:
//! * it is built only for the pipeline shape it reproduces (see
//!   [`ByteLevelBpe::from_json`]); any other tokenizer keeps HF's path;
//! * the pre-tokenizer's lookahead `\s+(?!\S)`, which the `regex` engines
//!   lack, is replaced by two patterns that give the same matches: `\s+\z`
//!   and `\s+\s` with its last character given back;
//! * the same ids as HF for every text it encodes: `tests/bytelevel.rs`
//!   compares the two on generated text over trained tokenizers, and the
//!   parity test on real Qwen3 and Llama 3 files (against `transformers`)
//!   runs through it;
//! * bounded: a piece over [`MAX_PIECE_BYTES`] is refused (the request is
//!   routed by load; HF would merge it, in memory in proportion to it),
//!   one encode's memo holds at most [`MEMO_PIECES`] pieces, and the piece
//!   cache at most [`CACHE_SHARDS`] × [`SHARD_PIECES`] pieces of at most
//!   [`MAX_CACHED_PIECE`] bytes; a piece merges in O(n log n).

mod split;

use std::{
    collections::{BinaryHeap, HashMap},
    hash::{BuildHasherDefault, Hasher},
    sync::Mutex,
};

use split::{GPT2_PATTERN, Splitter};

use serde_json::Value;

use crate::error::PromptError;
use xxhash_rust::xxh3::xxh3_64;

/// The longest piece merged: a heap merge takes about 40 bytes a byte of
/// the piece, so at most ~2.6 MB here.
pub const MAX_PIECE_BYTES: usize = 64 << 10;
/// Pieces longer than this are merged each time, not cached.
pub const MAX_CACHED_PIECE: usize = 48;
/// Shards of the piece cache (a piece's hash picks one).
pub const CACHE_SHARDS: usize = 64;
/// Pieces one shard holds; a full shard starts again empty.
pub const SHARD_PIECES: usize = 1024;
/// Pieces of at most this many symbols merge by a scan; longer ones by a
/// heap.
const SCAN_MERGE_SYMBOLS: usize = 24;

/// A hasher for keys that are already hashes or small integers.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0 << 8 | u64::from(*byte)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<PassThrough>>;

/// GPT-2's map from bytes to the printable characters the vocabulary is
/// written in.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for byte in 0..=255u8 {
        let printable = matches!(byte, 33..=126 | 161..=172 | 174..=255);
        let code = if printable {
            u32::from(byte)
        } else {
            next += 1;
            next - 1
        };
        chars[usize::from(byte)] = char::from_u32(code).unwrap_or('\0');
    }
    chars
}

/// A merge the heap holds: the lowest rank first, then the leftmost.
#[derive(PartialEq, Eq)]
struct Merge {
    rank: u32,
    at: usize,
}

impl Ord for Merge {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.at.cmp(&self.at))
    }
}

impl PartialOrd for Merge {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// A cached piece: its bytes (to tell hash collisions apart) and ids.
type CacheShard = FastMap<u64, (Box<[u8]>, Box<[u32]>)>;

/// The ids of one encode, and its memo of the pieces it has met.
struct Output {
    ids: Vec<u32>,
    memo: Memo,
    /// A piece over [`MAX_PIECE_BYTES`] was met (its length).
    too_long: Option<usize>,
}

/// The pieces one encode has met, by hash: where their bytes are in
/// `bytes` and their ids in the output. A word met again in the same text
/// (most are) costs no lock on the shared cache, so a long prompt's two
/// halves, tokenized at once, do not contend for its hot shards. Bounded
/// by [`MEMO_PIECES`] and by the text's own size.
#[derive(Default)]
struct Memo {
    pieces: FastMap<u64, (std::ops::Range<usize>, std::ops::Range<usize>)>,
    bytes: Vec<u8>,
}

/// Pieces one encode remembers.
const MEMO_PIECES: usize = 4096;

impl Memo {
    fn get(&self, hash: u64, piece: &[u8]) -> Option<std::ops::Range<usize>> {
        let (bytes, ids) = self.pieces.get(&hash)?;
        (self.bytes[bytes.clone()] == *piece).then(|| ids.clone())
    }

    fn put(&mut self, hash: u64, piece: &[u8], ids: std::ops::Range<usize>) {
        if self.pieces.len() >= MEMO_PIECES {
            return;
        }
        let at = self.bytes.len();
        self.bytes.extend_from_slice(piece);
        self.pieces
            .entry(hash)
            .or_insert((at..self.bytes.len(), ids));
    }
}

/// A shard on cache lines of its own: a long prompt's two halves are
/// tokenized at once (`segments.rs`), and shards sharing a line would make
/// the two cores pass it back and forth on every lookup.
#[derive(Default)]
#[repr(align(128))]
struct Padded(Mutex<CacheShard>);

/// The encoder. Build it with [`ByteLevelBpe::from_json`].
pub(crate) struct ByteLevelBpe {
    /// Each byte's id on its own.
    byte_ids: [u32; 256],
    /// (left, right) ids → (rank, merged id).
    merges: FastMap<u64, (u32, u32)>,
    /// Whole pieces that are one token (`ignore_merges`).
    whole: Option<HashMap<Box<[u8]>, u32>>,
    splitter: Splitter,
    /// The added tokens, matched leftmost-longest, and their ids.
    added: Option<(aho_corasick::AhoCorasick, Vec<u32>)>,
    /// Whether the tokenizer normalizes (NFC): non-ASCII text between
    /// added tokens then goes through its normalizer first.
    normalizes: bool,
    cache: Vec<Padded>,
}

impl std::fmt::Debug for ByteLevelBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteLevelBpe")
            .field("merges", &self.merges.len())
            .finish_non_exhaustive()
    }
}

fn pair(left: u32, right: u32) -> u64 {
    u64::from(left) << 32 | u64::from(right)
}

impl ByteLevelBpe {
    /// The encoder for the tokenizer in `json` (a `tokenizer.json`), or
    /// `None` unless its pipeline is exactly: no normalizer or NFC; a
    /// regex `Split` (isolated) then `ByteLevel` without prefix space, or
    /// `ByteLevel` with its own regex; a BPE model without dropout,
    /// subword prefix or suffix, or byte fallback; added tokens that strip
    /// nothing, match anywhere and are matched before normalizing.
    pub(crate) fn from_json(json: &Value) -> Option<Self> {
        let normalizes = match &json["normalizer"] {
            Value::Null => false,
            normalizer if normalizer["type"] == "NFC" => true,
            _ => return None,
        };
        let pattern = split_pattern(&json["pre_tokenizer"])?;
        let splitter = Splitter::new(&pattern)?;
        let model = &json["model"];
        let empty = |field: &str| match &model[field] {
            Value::Null => true,
            Value::String(s) => s.is_empty(),
            _ => false,
        };
        if model["type"] != "BPE"
            || !model["dropout"].is_null()
            || !empty("continuing_subword_prefix")
            || !empty("end_of_word_suffix")
            || model["byte_fallback"] == Value::Bool(true)
        {
            return None;
        }
        let vocab: HashMap<&str, u32> = model["vocab"]
            .as_object()?
            .iter()
            .map(|(token, id)| Some((token.as_str(), u32::try_from(id.as_u64()?).ok()?)))
            .collect::<Option<_>>()?;
        let chars = byte_chars();
        let mut byte_ids = [0u32; 256];
        for (byte, c) in chars.iter().enumerate() {
            byte_ids[byte] = *vocab.get(c.to_string().as_str())?;
        }
        let mut merges = FastMap::default();
        for (rank, merge) in model["merges"].as_array()?.iter().enumerate() {
            let (left, right) = match merge {
                Value::String(both) => both.split_once(' ')?,
                Value::Array(parts) if parts.len() == 2 => (parts[0].as_str()?, parts[1].as_str()?),
                _ => return None,
            };
            let merged = vocab.get(format!("{left}{right}").as_str());
            let (Some(&left), Some(&right), Some(&merged)) =
                (vocab.get(left), vocab.get(right), merged)
            else {
                // HF refuses such a file; so does this encoder.
                return None;
            };
            // A pair listed twice keeps its last rank, as HF's map does.
            merges.insert(pair(left, right), (u32::try_from(rank).ok()?, merged));
        }
        let whole = (model["ignore_merges"] == Value::Bool(true)).then(|| {
            let mut byte_of = HashMap::new();
            for (byte, c) in chars.iter().enumerate() {
                byte_of.insert(*c, byte as u8);
            }
            vocab
                .iter()
                .filter_map(|(token, id)| {
                    let bytes: Option<Vec<u8>> =
                        token.chars().map(|c| byte_of.get(&c).copied()).collect();
                    Some((bytes?.into_boxed_slice(), *id))
                })
                .collect()
        });
        let added = added_tokens(&json["added_tokens"])?;
        Some(Self {
            byte_ids,
            merges,
            whole,
            splitter,
            added,
            normalizes,
            cache: (0..CACHE_SHARDS).map(|_| Padded::default()).collect(),
        })
    }

    /// The ids of `text`, no special tokens added; `normalize` applies the
    /// tokenizer's own normalizer to a piece of text between added tokens.
    ///
    /// A piece longer than [`MAX_PIECE_BYTES`] (a run of letters or marks
    /// with no break, which no language writes) is an error: merging it
    /// would take memory in proportion to it, and the request is then
    /// routed by load.
    pub(crate) fn encode(
        &self,
        text: &str,
        normalize: impl Fn(&str) -> Result<String, PromptError>,
    ) -> Result<Vec<u32>, PromptError> {
        let mut out = Output {
            ids: Vec::with_capacity(text.len() / 4 + 1),
            memo: Memo::default(),
            too_long: None,
        };
        let mut at = 0;
        if let Some((matcher, added_ids)) = &self.added {
            for found in matcher.find_iter(text) {
                self.encode_plain(&text[at..found.start()], &normalize, &mut out)?;
                out.ids.push(added_ids[found.pattern().as_usize()]);
                at = found.end();
            }
        }
        self.encode_plain(&text[at..], &normalize, &mut out)?;
        match out.too_long {
            Some(bytes) => Err(PromptError::Tokenize(format!(
                "a pre-tokenized piece of {bytes} bytes, over {MAX_PIECE_BYTES}"
            ))),
            None => Ok(out.ids),
        }
    }

    /// Text with no added token in it.
    fn encode_plain(
        &self,
        text: &str,
        normalize: &impl Fn(&str) -> Result<String, PromptError>,
        out: &mut Output,
    ) -> Result<(), PromptError> {
        if text.is_empty() {
            return Ok(());
        }
        if self.normalizes && !text.is_ascii() {
            let normalized = normalize(text)?;
            self.splitter.split(&normalized, |piece| {
                self.encode_piece(piece.as_bytes(), out)
            });
        } else {
            self.splitter
                .split(text, |piece| self.encode_piece(piece.as_bytes(), out));
        }
        Ok(())
    }

    /// One pre-tokenized piece: from this encode's memo, else the shared
    /// cache, else merged (and kept in both).
    fn encode_piece(&self, piece: &[u8], out: &mut Output) {
        if piece.len() == 1 {
            out.ids.push(self.byte_ids[usize::from(piece[0])]);
            return;
        }
        if piece.len() > MAX_PIECE_BYTES {
            out.too_long = Some(piece.len());
            return;
        }
        if piece.len() > MAX_CACHED_PIECE {
            self.merge_piece(piece, &mut out.ids);
            return;
        }
        let hash = xxh3_64(piece);
        if let Some(range) = out.memo.get(hash, piece) {
            out.ids.extend_from_within(range);
            return;
        }
        let from = out.ids.len();
        let shard = &self.cache[(hash >> 58) as usize % CACHE_SHARDS].0;
        let hit = match shard.lock() {
            Ok(cache) => match cache.get(&hash) {
                Some((bytes, cached)) if **bytes == *piece => {
                    out.ids.extend_from_slice(cached);
                    true
                }
                _ => false,
            },
            Err(_) => false,
        };
        if !hit {
            self.merge_piece(piece, &mut out.ids);
            if let Ok(mut cache) = shard.lock() {
                if cache.len() >= SHARD_PIECES {
                    cache.clear();
                }
                cache
                    .entry(hash)
                    .or_insert_with(|| (piece.into(), out.ids[from..].into()));
            }
        }
        out.memo.put(hash, piece, from..out.ids.len());
    }

    /// BPE on one piece's bytes: the lowest-ranked adjacent pair merges
    /// first, the leftmost of equal rank first, until none merges.
    fn merge_piece(&self, piece: &[u8], ids: &mut Vec<u32>) {
        if let Some(whole) = &self.whole
            && let Some(&id) = whole.get(piece)
        {
            ids.push(id);
            return;
        }
        let mut symbols: Vec<u32> = piece
            .iter()
            .map(|b| self.byte_ids[usize::from(*b)])
            .collect();
        if symbols.len() <= SCAN_MERGE_SYMBOLS {
            self.merge_by_scan(&mut symbols);
            ids.extend_from_slice(&symbols);
        } else {
            self.merge_by_heap(&symbols, ids);
        }
    }

    fn merge_by_scan(&self, symbols: &mut Vec<u32>) {
        loop {
            let mut best: Option<(u32, usize, u32)> = None;
            for at in 0..symbols.len().saturating_sub(1) {
                if let Some(&(rank, merged)) = self.merges.get(&pair(symbols[at], symbols[at + 1]))
                    && best.is_none_or(|(best_rank, _, _)| rank < best_rank)
                {
                    best = Some((rank, at, merged));
                }
            }
            let Some((_, at, merged)) = best else { return };
            symbols[at] = merged;
            symbols.remove(at + 1);
        }
    }

    /// The same merges in O(n log n): symbols in a linked list, candidate
    /// merges in a heap, stale candidates skipped when popped.
    fn merge_by_heap(&self, initial: &[u32], ids: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        let n = initial.len();
        let mut symbol = initial.to_vec();
        let mut next: Vec<usize> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::with_capacity(n);
        let rank_at = |symbol: &[u32], next: &[usize], at: usize| -> Option<(u32, u32)> {
            let right = next[at];
            if right == NONE {
                return None;
            }
            self.merges.get(&pair(symbol[at], symbol[right])).copied()
        };
        for at in 0..n.saturating_sub(1) {
            if let Some((rank, _)) = rank_at(&symbol, &next, at) {
                heap.push(Merge { rank, at });
            }
        }
        while let Some(Merge { rank, at }) = heap.pop() {
            if !alive[at] {
                continue;
            }
            // Stale: the pair at `at` changed since this was pushed.
            let Some((current, merged)) = rank_at(&symbol, &next, at) else {
                continue;
            };
            if current != rank {
                continue;
            }
            let right = next[at];
            symbol[at] = merged;
            alive[right] = false;
            next[at] = next[right];
            if next[at] != NONE {
                prev[next[at]] = at;
            }
            if prev[at] != NONE
                && let Some((rank, _)) = rank_at(&symbol, &next, prev[at])
            {
                heap.push(Merge { rank, at: prev[at] });
            }
            if let Some((rank, _)) = rank_at(&symbol, &next, at) {
                heap.push(Merge { rank, at });
            }
        }
        let mut at = 0;
        while at != NONE {
            ids.push(symbol[at]);
            at = next[at];
        }
    }
}

/// The split regex of a pre-tokenizer this encoder reproduces.
fn split_pattern(pre: &Value) -> Option<String> {
    let byte_level_plain =
        |p: &Value| p["type"] == "ByteLevel" && p["add_prefix_space"] != Value::Bool(true);
    match pre["type"].as_str()? {
        "ByteLevel" if byte_level_plain(pre) && pre["use_regex"] != Value::Bool(false) => {
            Some(GPT2_PATTERN.to_owned())
        }
        "Sequence" => {
            let steps = pre["pretokenizers"].as_array()?;
            let [split, byte_level] = steps.as_slice() else {
                return None;
            };
            let isolated = split["type"] == "Split"
                && split["behavior"] == "Isolated"
                && split["invert"] != Value::Bool(true);
            let plain =
                byte_level_plain(byte_level) && byte_level["use_regex"] == Value::Bool(false);
            if !(isolated && plain) {
                return None;
            }
            split["pattern"]["Regex"].as_str().map(str::to_owned)
        }
        _ => None,
    }
}

/// The added tokens' matcher, if all of them can be cut out of the raw text
/// (none strips, is single-word or is matched after normalizing); `None`
/// when one cannot.
#[allow(clippy::type_complexity)]
fn added_tokens(tokens: &Value) -> Option<Option<(aho_corasick::AhoCorasick, Vec<u32>)>> {
    let tokens = match tokens {
        Value::Null => return Some(None),
        tokens => tokens.as_array()?,
    };
    if tokens.is_empty() {
        return Some(None);
    }
    let mut contents = Vec::with_capacity(tokens.len());
    let mut ids = Vec::with_capacity(tokens.len());
    for token in tokens {
        let on = |flag: &str| token[flag] == Value::Bool(true);
        if on("lstrip") || on("rstrip") || on("single_word") || on("normalized") {
            return None;
        }
        let content = token["content"].as_str()?;
        if content.is_empty() {
            return None;
        }
        contents.push(content.to_owned());
        ids.push(u32::try_from(token["id"].as_u64()?).ok()?);
    }
    let matcher = aho_corasick::AhoCorasick::builder()
        .match_kind(aho_corasick::MatchKind::LeftmostLongest)
        .build(&contents)
        .ok()?;
    Some(Some((matcher, ids)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_and_scan_merge_alike() {
        // A toy vocabulary over "a" and "b" where the order of merges
        // matters: every string of up to 40 symbols merges the same way.
        let mut vocab = serde_json::Map::new();
        let chars = byte_chars();
        for (byte, c) in chars.iter().enumerate() {
            vocab.insert(c.to_string(), Value::from(byte));
        }
        let merges = ["a a", "a b", "aa b", "b a", "ab ab", "ba a", "aab aa"];
        for (n, merge) in merges.iter().enumerate() {
            vocab.insert(merge.replace(' ', ""), Value::from(256 + n));
        }
        let json = serde_json::json!({
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "vocab": vocab, "merges": merges},
            "added_tokens": [],
        });
        let bpe = ByteLevelBpe::from_json(&json).unwrap();
        for seed in 0u64..2_000 {
            let len = 2 + (seed % 39) as usize;
            let piece: Vec<u8> = (0..len)
                .map(|i| {
                    if ((seed >> (i % 13)) & 1 == 1) ^ (i % 3 == 0) {
                        b'a'
                    } else {
                        b'b'
                    }
                })
                .collect();
            let mut by_scan: Vec<u32> = piece
                .iter()
                .map(|b| bpe.byte_ids[usize::from(*b)])
                .collect();
            bpe.merge_by_scan(&mut by_scan);
            let mut by_heap = Vec::new();
            let initial: Vec<u32> = piece
                .iter()
                .map(|b| bpe.byte_ids[usize::from(*b)])
                .collect();
            bpe.merge_by_heap(&initial, &mut by_heap);
            assert_eq!(by_scan, by_heap, "{}", String::from_utf8_lossy(&piece));
        }
    }
}
