//! Mooncake request traces (JSON Lines: `timestamp`, `input_length`,
//! `output_length`, `hash_ids`): reading them and turning them into token ids.
//!
//! It exists so every tool that replays a trace sees the same prompts: the
//! simulator (`kvroute replay`), the benchmarks (`kvroute bench select`) and
//! `kvroute ctl explain --trace` all read and expand traces here.
//!
//! A trace gives each request as a chain of `hash_id`s, one per 512-token
//! block, without the tokens themselves. Every hash_id expands the same
//! deterministic way ([`tokens_for`]), so two requests that share a hash_id
//! share those tokens, and so share router and engine blocks at any block
//! size dividing 512.
//!
//! Two token vocabularies live here, for two different purposes, and they
//! differ on purpose: prompt tokens expanded from a trace are below
//! [`PROMPT_TOKEN_VOCAB`], and the simulator's synthetic output tokens
//! ([`output_token`]) are below [`OUTPUT_TOKEN_VOCAB`]. Changing either
//! changes every token id, block hash and replay result built on it.

use std::{
    collections::HashSet,
    io::{BufRead, BufReader},
    path::Path,
};

use serde::Deserialize;

/// Tokens covered by one trace `hash_id`.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// Prompt token ids expanded from a trace's `hash_ids` ([`tokens_for`]) are
/// below this (a plausible tokenizer vocabulary).
pub const PROMPT_TOKEN_VOCAB: u64 = 50_000;

/// The simulator's synthetic output token ids ([`output_token`]) are below
/// this.
pub const OUTPUT_TOKEN_VOCAB: u32 = 1 << 17;

/// One request of a Mooncake trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    /// Arrival, in milliseconds from the start of the trace.
    #[serde(default)]
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Tokens generated.
    #[serde(default)]
    pub output_length: usize,
    /// One id per 512-token block of the prompt, prefix-chained.
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// The prompt's token ids (see [`tokens_for`]).
    pub fn tokens(&self) -> Vec<u32> {
        tokens_for(&self.hash_ids, self.input_length)
    }

    /// The prompt's 512-token blocks as (prefix-chained key, tokens in the
    /// block): equal keys mean equal prompts up to the end of that block.
    pub(crate) fn chained_blocks(&self) -> Vec<(u64, usize)> {
        let n = self.input_length.div_ceil(TRACE_BLOCK_TOKENS);
        let mut chain = 0x5eed_u64;
        self.hash_ids
            .iter()
            .take(n)
            .enumerate()
            .map(|(i, &id)| {
                chain = mix64(chain ^ mix64(id.wrapping_add(1)));
                let tokens = if i + 1 < n {
                    TRACE_BLOCK_TOKENS
                } else {
                    self.input_length - TRACE_BLOCK_TOKENS * (n - 1)
                };
                (chain, tokens)
            })
            .collect()
    }
}

/// Why a trace, or one line of it, could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: line numbers start at 1")]
    LineZero { path: String },
    #[error("{path}: has {lines} lines, line {line} asked for")]
    NoSuchLine {
        path: String,
        line: usize,
        lines: usize,
    },
    #[error("{path}:{line}: not a trace request: {source}")]
    Parse {
        path: String,
        line: usize,
        source: serde_json::Error,
    },
    /// A well-formed line the simulator cannot replay (too few hash_ids for
    /// its length, or a timestamp going back).
    #[error("{path}:{line}: {message}")]
    Invalid {
        path: String,
        line: usize,
        message: String,
    },
}

/// A whole trace, in file order (arrival order; ties keep file order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    pub records: Vec<TraceRequest>,
}

impl Trace {
    /// Parse JSONL from a reader; `path` names it in errors. Blank lines are
    /// skipped. Every request must have the hash_ids its `input_length`
    /// needs, and timestamps must not go back.
    pub(crate) fn from_reader(reader: impl BufRead, path: &str) -> Result<Self, TraceError> {
        let mut records = Vec::new();
        for (idx, line) in reader.lines().enumerate() {
            let line = line.map_err(|source| TraceError::Read {
                path: path.to_string(),
                source,
            })?;
            let text = line.trim();
            if text.is_empty() {
                continue;
            }
            let invalid = |message: String| TraceError::Invalid {
                path: path.to_string(),
                line: idx + 1,
                message,
            };
            let record: TraceRequest =
                serde_json::from_str(text).map_err(|source| TraceError::Parse {
                    path: path.to_string(),
                    line: idx + 1,
                    source,
                })?;
            let needed = record.input_length.div_ceil(TRACE_BLOCK_TOKENS);
            if record.input_length == 0 || record.hash_ids.len() < needed {
                return Err(invalid(format!(
                    "input_length {} needs {} hash_ids, found {}",
                    record.input_length,
                    needed,
                    record.hash_ids.len()
                )));
            }
            if let Some(prev) = records.last().map(|r: &TraceRequest| r.timestamp)
                && record.timestamp < prev
            {
                return Err(invalid(format!(
                    "timestamp {} goes back from {prev}",
                    record.timestamp
                )));
            }
            records.push(record);
        }
        Ok(Trace { records })
    }

    #[cfg(test)]
    /// Parse JSONL text.
    pub(crate) fn parse(text: &str) -> Result<Self, TraceError> {
        Self::from_reader(text.as_bytes(), "(text)")
    }

    /// Load a JSONL file.
    pub fn load(path: &Path) -> Result<Self, TraceError> {
        let shown = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|source| TraceError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::from_reader(BufReader::new(file), &shown)
    }

    /// Keep only the first `n` records.
    pub(crate) fn truncated(mut self, n: usize) -> Self {
        self.records.truncate(n);
        self
    }

    /// Reuse an infinitely large shared cache would get, at 512-token
    /// granularity: a block hits when its prefix chain (hash ids up to and
    /// including it) occurred in any earlier request.
    pub fn ideal_reuse(&self) -> IdealReuse {
        // Only membership is asked, so the set's hasher cannot change the
        // result; FxHash is fast on integer keys.
        let mut seen: HashSet<u64, rustc_hash::FxBuildHasher> = HashSet::default();
        let mut out = IdealReuse::default();
        for r in &self.records {
            let blocks = r.chained_blocks();
            for &(chain, tokens) in &blocks {
                out.total_blocks += 1;
                out.total_tokens += tokens as u64;
                if seen.contains(&chain) {
                    out.hit_blocks += 1;
                    out.hit_tokens += tokens as u64;
                }
            }
            seen.extend(blocks.iter().map(|&(chain, _)| chain));
        }
        out
    }
}

/// Infinite-cache prefix reuse of a trace (see [`Trace::ideal_reuse`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IdealReuse {
    pub hit_blocks: u64,
    pub total_blocks: u64,
    pub hit_tokens: u64,
    pub total_tokens: u64,
}

impl IdealReuse {
    pub fn block_ratio(&self) -> f64 {
        ratio(self.hit_blocks, self.total_blocks)
    }

    pub fn token_ratio(&self) -> f64 {
        ratio(self.hit_tokens, self.total_tokens)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// The token ids of a prompt given as trace `hash_ids`: token `j` of hash_id
/// `h` is `mix(h, j) % PROMPT_TOKEN_VOCAB`, and the sequence is cut at
/// `input_length` (the last block of a trace request is usually partial). An
/// `input_length` beyond `512 * hash_ids.len()` yields only what the ids cover.
pub fn tokens_for(hash_ids: &[u64], input_length: usize) -> Vec<u32> {
    let len = input_length.min(hash_ids.len().saturating_mul(TRACE_BLOCK_TOKENS));
    let mut tokens = Vec::with_capacity(len);
    'blocks: for &h in hash_ids {
        for j in 0..TRACE_BLOCK_TOKENS as u64 {
            if tokens.len() == len {
                break 'blocks;
            }
            // The remainder is below PROMPT_TOKEN_VOCAB, which fits u32.
            tokens.push(u32::try_from(mix(h, j) % PROMPT_TOKEN_VOCAB).unwrap_or(0));
        }
    }
    tokens
}

/// The simulator's synthetic output token at `position` of request
/// `request_id`: unique per request and position, so generated blocks never
/// collide with prompt blocks.
pub(crate) fn output_token(request_id: u64, position: usize) -> u32 {
    let x = mix64(request_id ^ 0xA5A5_0000_0000_0000 ^ ((position as u64) << 20));
    (x >> 32) as u32 % OUTPUT_TOKEN_VOCAB
}

/// A splitmix64 finaliser applied to `a` and `b` combined: a stable,
/// well-spread 64-bit value per pair. The same pairing as the oplog generator
/// (shared/bench/make_oplog.py), so both sides agree on what a pair maps to.
pub(crate) fn mix(a: u64, b: u64) -> u64 {
    let mut z = a
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(b)
        .wrapping_add(0x0632_BE59_BD9B_4E5B);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64 of one word (increment, then finaliser): a fast, well-mixed,
/// seedless 64-bit hash. The simulator's hashes and random numbers are built
/// on it too.
pub(crate) fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Reads request `line` (1-based) of a trace file, without checking the rest
/// of the file.
pub fn read_line(path: &Path, line: usize) -> Result<TraceRequest, TraceError> {
    let shown = path.display().to_string();
    if line == 0 {
        return Err(TraceError::LineZero { path: shown });
    }
    let file = std::fs::File::open(path).map_err(|source| TraceError::Read {
        path: shown.clone(),
        source,
    })?;
    let mut lines = 0;
    for text in BufReader::new(file).lines() {
        let text = text.map_err(|source| TraceError::Read {
            path: shown.clone(),
            source,
        })?;
        lines += 1;
        if lines == line {
            return serde_json::from_str(&text).map_err(|source| TraceError::Parse {
                path: shown,
                line,
                source,
            });
        }
    }
    Err(TraceError::NoSuchLine {
        path: shown,
        line,
        lines,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ts: u64, len: usize, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: ts,
            input_length: len,
            output_length: 4,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn expansion_is_deterministic_truncated_and_in_vocabulary() {
        let tokens = tokens_for(&[0, 1, 2], 1100);
        assert_eq!(tokens.len(), 1100);
        assert_eq!(tokens, tokens_for(&[0, 1, 2], 1100));
        assert!(tokens.iter().all(|&t| u64::from(t) < PROMPT_TOKEN_VOCAB));
        // Only what the ids cover.
        assert_eq!(tokens_for(&[7], 10_000).len(), TRACE_BLOCK_TOKENS);
        assert!(tokens_for(&[], 100).is_empty());
    }

    #[test]
    fn shared_hash_ids_share_tokens_and_others_do_not() {
        let a = tokens_for(&[0, 1], 1024);
        let b = tokens_for(&[0, 2], 1024);
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..], b[512..]);
        // Token j depends on j, not only on the hash_id.
        assert_ne!(a[0..16], a[16..32]);
    }

    #[test]
    fn equal_hash_ids_give_equal_tokens_anywhere() {
        let a = rec(0, 1024, &[7, 9]).tokens();
        let b = rec(0, 600, &[9, 3]).tokens();
        assert_eq!(a.len(), 1024);
        assert_eq!(b.len(), 600);
        assert_eq!(&a[512..1024], &b[0..512]);
        assert_ne!(&a[0..512], &b[0..512]);
        // truncation keeps a prefix of the run
        let c = rec(0, 100, &[7]).tokens();
        assert_eq!(&c[..], &a[..100]);
    }

    #[test]
    fn mix_matches_the_oplog_generator() {
        // Values of make_oplog.py's mix(a, b).
        assert_eq!(mix(0, 0), 0x2160_7BA2_621A_71AC);
        assert_eq!(mix(1, 2), 1_047_459_439_998_094_806);
        assert_eq!(mix(5, 7) % PROMPT_TOKEN_VOCAB, 4026);
        assert_ne!(mix(1, 2), mix(2, 1));
    }

    #[test]
    fn output_tokens_are_in_their_vocabulary_and_vary() {
        let tokens: Vec<u32> = (0..64).map(|p| output_token(3, p)).collect();
        assert!(tokens.iter().all(|&t| t < OUTPUT_TOKEN_VOCAB));
        assert_ne!(tokens[0], tokens[1]);
        assert_ne!(output_token(3, 0), output_token(4, 0));
    }

    #[test]
    fn reads_the_requested_line() {
        let dir = std::env::temp_dir().join(format!("kvroute-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        std::fs::write(
            &path,
            "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 3, \"input_length\": 100, \"output_length\": 7, \"hash_ids\": [0]}\n",
        )
        .unwrap();
        let second = read_line(&path, 2).unwrap();
        assert_eq!((second.timestamp, second.input_length), (3, 100));
        assert_eq!(second.tokens().len(), 100);
        assert!(matches!(
            read_line(&path, 3),
            Err(TraceError::NoSuchLine { lines: 2, .. })
        ));
        assert!(matches!(
            read_line(&path, 0),
            Err(TraceError::LineZero { .. })
        ));
        assert_eq!(Trace::load(&path).unwrap().records.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn parse_rejects_short_hash_ids_and_time_going_back() {
        let bad = r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}"#;
        assert!(matches!(Trace::parse(bad), Err(TraceError::Invalid { .. })));
        let good =
            r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}"#;
        assert_eq!(Trace::parse(good).unwrap().records.len(), 1);
        let back = "{\"timestamp\": 5, \"input_length\": 1, \"hash_ids\": [1]}\n\
                    {\"timestamp\": 4, \"input_length\": 1, \"hash_ids\": [1]}";
        let err = Trace::parse(back).unwrap_err();
        assert!(matches!(err, TraceError::Invalid { line: 2, .. }), "{err}");
    }

    #[test]
    fn ideal_reuse_counts_repeated_prefix_chains() {
        let t = Trace {
            records: vec![
                rec(0, 1024, &[1, 2]),
                rec(1, 1100, &[1, 2, 3]),
                rec(2, 512, &[2]),
            ],
        };
        let ideal = t.ideal_reuse();
        assert_eq!(ideal.total_blocks, 6);
        assert_eq!(ideal.hit_blocks, 2); // [1], [1,2] in the second; [2] alone is a new chain
        assert_eq!(ideal.hit_tokens, 1024);
        assert_eq!(ideal.total_tokens, 1024 + 1100 + 512);
    }
}
