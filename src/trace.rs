//! Mooncake request traces (JSON Lines: `timestamp`, `input_length`,
//! `output_length`, `hash_ids`) turned into concrete prompts.
//!
//! A trace gives each request as a chain of `hash_id`s, one per 512-token
//! block, without the tokens themselves. Tools that need real token ids
//! (`kvroute ctl explain --trace`, benchmarks, replays) expand every hash_id
//! the same deterministic way here, so two requests that share a hash_id share
//! those tokens, and so share router blocks at any block size dividing 512.

use std::{
    io::{BufRead, BufReader},
    path::Path,
};

use serde::Deserialize;

/// Tokens covered by one trace `hash_id`.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// Token ids produced by the expansion are below this (a plausible vocabulary).
pub const TOKEN_VOCAB: u64 = 50_000;

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
}

/// Why a trace line could not be read.
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
}

/// The token ids of a prompt given as trace `hash_ids`: token `j` of hash_id
/// `h` is `mix(h, j) % TOKEN_VOCAB`, and the sequence is cut at
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
            // The remainder is below TOKEN_VOCAB, which fits u32.
            tokens.push(u32::try_from(mix(h, j) % TOKEN_VOCAB).unwrap_or(0));
        }
    }
    tokens
}

/// A splitmix64 finaliser applied to `a` and `b` combined: a stable,
/// well-spread 64-bit value per pair. The same pairing as the oplog generator
/// (shared/bench/make_oplog.py), so both sides agree on what a pair maps to.
pub fn mix(a: u64, b: u64) -> u64 {
    let mut z = a
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(b)
        .wrapping_add(0x0632_BE59_BD9B_4E5B);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Reads request `line` (1-based) of a trace file.
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

    #[test]
    fn expansion_is_deterministic_truncated_and_in_vocabulary() {
        let tokens = tokens_for(&[0, 1, 2], 1100);
        assert_eq!(tokens.len(), 1100);
        assert_eq!(tokens, tokens_for(&[0, 1, 2], 1100));
        assert!(tokens.iter().all(|&t| u64::from(t) < TOKEN_VOCAB));
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
    fn mix_matches_the_oplog_generator() {
        // Values of make_oplog.py's mix(a, b).
        assert_eq!(mix(0, 0), 0x2160_7BA2_621A_71AC);
        assert_eq!(mix(1, 2), 1_047_459_439_998_094_806);
        assert_eq!(mix(5, 7) % TOKEN_VOCAB, 4026);
        assert_ne!(mix(1, 2), mix(2, 1));
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
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
