//! Mooncake-format traces: parsing, deterministic tokenisation, and the
//! infinite-cache reuse ideal.
//!
//! The simulator needs real token ids (engines hash 64-token blocks, routers
//! index them), but a Mooncake trace only carries 512-token `hash_ids`. Each
//! hash id therefore expands to a fixed pseudo-random 512-token run, so equal
//! hash ids give equal tokens wherever they appear and prefixes stay shared.

use std::fmt;
use std::io::BufRead;
use std::path::Path;

/// One trace line: the same type `kvroute ctl explain --trace` reads.
pub use crate::trace::{TRACE_BLOCK_TOKENS, TraceRequest as TraceRecord};

/// Synthetic output token ids are drawn from `0..TOKEN_VOCAB`.
pub const TOKEN_VOCAB: u32 = 1 << 17;

/// A whole trace, in file order (arrival order; ties keep file order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    pub records: Vec<TraceRecord>,
}

/// Why a trace could not be loaded.
#[derive(Debug)]
pub enum TraceError {
    Io(std::io::Error),
    Parse { line: usize, message: String },
    Invalid { line: usize, message: String },
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Io(e) => write!(f, "reading trace: {e}"),
            TraceError::Parse { line, message } => write!(f, "trace line {line}: {message}"),
            TraceError::Invalid { line, message } => {
                write!(f, "trace line {line} is invalid: {message}")
            }
        }
    }
}

impl std::error::Error for TraceError {}

impl From<std::io::Error> for TraceError {
    fn from(e: std::io::Error) -> Self {
        TraceError::Io(e)
    }
}

impl Trace {
    /// Parse JSONL from a reader. Blank lines are skipped.
    pub fn from_reader(reader: impl BufRead) -> Result<Self, TraceError> {
        let mut records = Vec::new();
        for (idx, line) in reader.lines().enumerate() {
            let line = line?;
            let text = line.trim();
            if text.is_empty() {
                continue;
            }
            let record: TraceRecord =
                serde_json::from_str(text).map_err(|e| TraceError::Parse {
                    line: idx + 1,
                    message: e.to_string(),
                })?;
            let needed = record.input_length.div_ceil(TRACE_BLOCK_TOKENS);
            if record.input_length == 0 || record.hash_ids.len() < needed {
                return Err(TraceError::Invalid {
                    line: idx + 1,
                    message: format!(
                        "input_length {} needs {} hash_ids, found {}",
                        record.input_length,
                        needed,
                        record.hash_ids.len()
                    ),
                });
            }
            if let Some(prev) = records.last().map(|r: &TraceRecord| r.timestamp)
                && record.timestamp < prev
            {
                return Err(TraceError::Invalid {
                    line: idx + 1,
                    message: format!("timestamp {} goes back from {prev}", record.timestamp),
                });
            }
            records.push(record);
        }
        Ok(Trace { records })
    }

    /// Parse JSONL text.
    pub fn parse(text: &str) -> Result<Self, TraceError> {
        Self::from_reader(text.as_bytes())
    }

    /// Load a JSONL file.
    pub fn load(path: &Path) -> Result<Self, TraceError> {
        let file = std::fs::File::open(path)?;
        Self::from_reader(std::io::BufReader::new(file))
    }

    /// Keep only the first `n` records.
    pub fn truncated(mut self, n: usize) -> Self {
        self.records.truncate(n);
        self
    }

    /// Total prompt tokens over the trace.
    pub fn total_input_tokens(&self) -> u64 {
        self.records.iter().map(|r| r.input_length as u64).sum()
    }

    /// Reuse an infinitely large shared cache would get, at 512-token
    /// granularity: a block hits when its prefix chain (hash ids up to and
    /// including it) occurred in any earlier request.
    pub fn ideal_reuse(&self) -> IdealReuse {
        let mut seen: std::collections::HashSet<u64, super::FastBuild> = Default::default();
        let mut out = IdealReuse::default();
        for r in &self.records {
            let n = r.input_length.div_ceil(TRACE_BLOCK_TOKENS);
            let mut chain = 0x5eed_u64;
            let mut chains = Vec::with_capacity(n);
            for (i, &id) in r.hash_ids.iter().take(n).enumerate() {
                chain = super::mix64(chain ^ super::mix64(id.wrapping_add(1)));
                let tokens = if i + 1 < n {
                    TRACE_BLOCK_TOKENS
                } else {
                    r.input_length - TRACE_BLOCK_TOKENS * (n - 1)
                };
                out.total_blocks += 1;
                out.total_tokens += tokens as u64;
                if seen.contains(&chain) {
                    out.hit_blocks += 1;
                    out.hit_tokens += tokens as u64;
                }
                chains.push(chain);
            }
            seen.extend(chains);
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

/// Prompt tokens of a record: each hash id expands to its own fixed
/// 512-token run, truncated to `input_length` (the expansion `kvroute ctl
/// explain --trace` and the benchmarks use too, so their prompts match).
pub fn tokenize(record: &TraceRecord) -> Vec<u32> {
    crate::trace::tokens_for(&record.hash_ids, record.input_length)
}

/// A synthetic output token: unique per request and position, so generated
/// blocks never collide with prompt blocks.
pub fn output_token(request_id: u64, position: usize) -> u32 {
    let x = super::mix64(request_id ^ 0xA5A5_0000_0000_0000 ^ ((position as u64) << 20));
    (x >> 32) as u32 % TOKEN_VOCAB
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ts: u64, len: usize, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: ts,
            input_length: len,
            output_length: 4,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn equal_hash_ids_give_equal_tokens_anywhere() {
        let a = tokenize(&rec(0, 1024, &[7, 9]));
        let b = tokenize(&rec(0, 600, &[9, 3]));
        assert_eq!(a.len(), 1024);
        assert_eq!(b.len(), 600);
        assert_eq!(&a[512..1024], &b[0..512]);
        assert_ne!(&a[0..512], &b[0..512]);
        // truncation keeps a prefix of the run
        let c = tokenize(&rec(0, 100, &[7]));
        assert_eq!(&c[..], &a[..100]);
        assert!(a.iter().all(|&t| t < TOKEN_VOCAB));
    }

    #[test]
    fn parse_rejects_short_hash_ids() {
        let bad = r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}"#;
        assert!(matches!(Trace::parse(bad), Err(TraceError::Invalid { .. })));
        let good =
            r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}"#;
        assert_eq!(Trace::parse(good).unwrap().records.len(), 1);
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
