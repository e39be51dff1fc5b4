//! OPLOG v1: parse a recorded index workload and replay it against an index.
//!
//! Why this exists: every index (ours, the naive oracle, Dynamo's RadixTree
//! in `examples/dynamo_index_compare.rs`) replays the same log through the
//! same loop, so speed, memory and answers compare side by side. The format
//! and the known answers are in `shared/bench/OPLOG.md`; the CLI is
//! `kvroute bench index --oplog FILE`.
//!
//! Invariants:
//! * Hashes are parsed as `u64` (never through floats: they exceed 2^53).
//! * Parsing and per-implementation preparation of ops ([`ReplayIndex::prepare`])
//!   happen before the clock starts; `secs` covers the replay loop alone.
//! * `blocks` counts each op's blocks once: a `match`'s `local`, a `store`'s
//!   blocks (its `local` and `seq` lists have the same length), a `remove`'s
//!   `seq`.
//! * `overlap_sum` adds, per match, the largest prefix of any target;
//!   `score_sum` adds every non-zero prefix; `event_errors` counts rejected
//!   events.

use kvroute_core::index::naive::NaiveIndex;
use kvroute_core::index::{KvEvent, KvIndex, OverlapScores};
use kvroute_core::types::{DpRank, EngineHash, LocalHash, WorkerId, WorkerRank};
use serde::{Deserialize, Serialize};
use std::io::BufRead;
use std::path::Path;
use std::time::Instant;

/// Why a log could not be read.
#[derive(Debug, thiserror::Error)]
pub enum OplogError {
    #[error("reading the op log: {0}")]
    Io(#[from] std::io::Error),
    #[error("op log line {line}: {source}")]
    Json {
        line: usize,
        source: serde_json::Error,
    },
    #[error("op log line {line}: {msg}")]
    Invalid { line: usize, msg: String },
    #[error("unknown index implementation {0:?} (expected kvroute or naive)")]
    UnknownImpl(String),
}

/// The header line.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct OplogHeader {
    pub oplog: u32,
    pub block_size: u32,
    #[serde(default)]
    pub workers: u64,
    #[serde(default)]
    pub capacity: u64,
    #[serde(default)]
    pub source: String,
}

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum RawOp {
    Match {
        local: Vec<u64>,
    },
    Store {
        worker: WorkerId,
        dp_rank: DpRank,
        parent: Option<u64>,
        local: Vec<u64>,
        seq: Vec<u64>,
    },
    Remove {
        worker: WorkerId,
        dp_rank: DpRank,
        seq: Vec<u64>,
    },
    Clear {
        worker: WorkerId,
        dp_rank: DpRank,
    },
}

/// One replayable op.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Match(Vec<LocalHash>),
    Event { worker: WorkerRank, event: KvEvent },
}

impl Op {
    /// Blocks this op carries (see the module docs).
    pub(crate) fn blocks(&self) -> u64 {
        match self {
            Op::Match(q) => q.len() as u64,
            Op::Event { event, .. } => event.block_count() as u64,
        }
    }
}

/// A parsed log.
#[derive(Clone, Debug)]
pub struct OpLog {
    pub header: OplogHeader,
    pub ops: Vec<Op>,
}

impl OpLog {
    /// Parse a log from any reader.
    pub(crate) fn parse<R: BufRead>(reader: R) -> Result<Self, OplogError> {
        let mut header = None;
        let mut ops = Vec::new();
        for (i, line) in reader.lines().enumerate() {
            let line = line?;
            let lineno = i + 1;
            if line.trim().is_empty() {
                continue;
            }
            if header.is_none() {
                let h: OplogHeader =
                    serde_json::from_str(&line).map_err(|source| OplogError::Json {
                        line: lineno,
                        source,
                    })?;
                header = Some(h);
                continue;
            }
            let raw: RawOp = serde_json::from_str(&line).map_err(|source| OplogError::Json {
                line: lineno,
                source,
            })?;
            ops.push(convert(raw, lineno)?);
        }
        let header = header.ok_or(OplogError::Invalid {
            line: 0,
            msg: "empty op log (no header)".into(),
        })?;
        Ok(Self { header, ops })
    }

    /// Parse a log file.
    pub fn load(path: &Path) -> Result<Self, OplogError> {
        let f = std::fs::File::open(path)?;
        Self::parse(std::io::BufReader::with_capacity(1 << 20, f))
    }

    /// Blocks in the whole log.
    pub(crate) fn blocks(&self) -> u64 {
        self.ops.iter().map(Op::blocks).sum()
    }
}

fn convert(raw: RawOp, line: usize) -> Result<Op, OplogError> {
    Ok(match raw {
        RawOp::Match { local } => Op::Match(local),
        RawOp::Store {
            worker,
            dp_rank,
            parent,
            local,
            seq,
        } => {
            if local.len() != seq.len() {
                return Err(OplogError::Invalid {
                    line,
                    msg: format!(
                        "store has {} local and {} seq hashes",
                        local.len(),
                        seq.len()
                    ),
                });
            }
            let blocks: Vec<(EngineHash, LocalHash)> = seq.into_iter().zip(local).collect();
            Op::Event {
                worker: WorkerRank::new(worker, dp_rank),
                event: KvEvent::Stored { parent, blocks },
            }
        }
        RawOp::Remove {
            worker,
            dp_rank,
            seq,
        } => Op::Event {
            worker: WorkerRank::new(worker, dp_rank),
            event: KvEvent::Removed { blocks: seq },
        },
        RawOp::Clear { worker, dp_rank } => Op::Event {
            worker: WorkerRank::new(worker, dp_rank),
            event: KvEvent::Cleared,
        },
    })
}

/// What one replayed op did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// A match ran; the prefixes were written.
    Matched,
    /// An event was accepted.
    Applied,
    /// An event was rejected.
    Rejected,
}

/// An index the replay loop can drive.
pub trait ReplayIndex {
    /// An op in the form this index consumes (built before timing starts).
    type Prepared;
    /// The `impl` field of the report.
    fn impl_name(&self) -> String;
    fn prepare(&self, op: &Op) -> Self::Prepared;
    /// Run one op. For a match, push every non-zero prefix length to `prefixes`
    /// (cleared by the caller).
    fn run(&mut self, op: Self::Prepared, prefixes: &mut Vec<u32>) -> Step;
    /// Cached (block, target) entries now held.
    fn entries(&self) -> u64;
    /// The index's own memory estimate, if it has one.
    fn bytes_estimate(&self) -> Option<u64> {
        None
    }
}

/// The JSON line of OPLOG.md, plus memory fields.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ReplayReport {
    #[serde(rename = "impl")]
    pub impl_name: String,
    pub ops: u64,
    pub blocks: u64,
    pub secs: f64,
    pub ops_per_s: f64,
    pub blocks_per_s: f64,
    pub match_p50_us: f64,
    pub match_p99_us: f64,
    pub match_max_us: f64,
    pub overlap_sum: u64,
    pub score_sum: u64,
    pub event_errors: u64,
    /// Cached (block, target) entries after the replay.
    pub entries: u64,
    /// The index's own estimate of its heap bytes, when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_estimate: Option<u64>,
    /// Heap bytes per entry, from `bytes_estimate` or an external measure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_per_entry: Option<f64>,
}

impl ReplayReport {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

fn percentile_us(sorted_ns: &[u64], p: f64) -> f64 {
    if sorted_ns.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted_ns.len() as f64).ceil() as usize;
    let i = rank.clamp(1, sorted_ns.len()) - 1;
    sorted_ns.get(i).copied().unwrap_or(0) as f64 / 1000.0
}

/// Replay prepared ops in order (the timed part); see the module docs.
/// `prepared[i]` is `log.ops[i]` prepared for `index`.
pub(crate) fn replay_prepared<I: ReplayIndex>(
    index: &mut I,
    prepared: Vec<I::Prepared>,
    log: &OpLog,
) -> ReplayReport {
    debug_assert_eq!(prepared.len(), log.ops.len(), "one prepared op per log op");
    let ops = prepared.len() as u64;
    let blocks = log.blocks();
    let mut lat_ns: Vec<u64> = Vec::with_capacity(prepared.len());
    let mut prefixes: Vec<u32> = Vec::with_capacity(64);
    let (mut overlap_sum, mut score_sum, mut event_errors) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    for (op, source) in prepared.into_iter().zip(&log.ops) {
        prefixes.clear();
        // only a match's latency is reported, so only a match reads the
        // clock: two clock reads per event would add about 1 ms per
        // replay of loop cost to every index's figure
        let t0 = matches!(source, Op::Match(_)).then(Instant::now);
        let step = index.run(op, &mut prefixes);
        let dt = t0.map(|t| t.elapsed());
        match step {
            Step::Matched => {
                debug_assert!(
                    dt.is_some(),
                    "a match ran untimed: prepared from a non-match"
                );
                lat_ns.push(dt.map_or(0, |d| d.as_nanos() as u64));
                overlap_sum += u64::from(prefixes.iter().copied().max().unwrap_or(0));
                score_sum += prefixes.iter().map(|&p| u64::from(p)).sum::<u64>();
            }
            Step::Applied => {}
            Step::Rejected => event_errors += 1,
        }
    }
    let secs = start.elapsed().as_secs_f64();
    lat_ns.sort_unstable();
    let entries = index.entries();
    let bytes_estimate = index.bytes_estimate();
    let per_s = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    ReplayReport {
        impl_name: index.impl_name(),
        ops,
        blocks,
        secs,
        ops_per_s: per_s(ops),
        blocks_per_s: per_s(blocks),
        match_p50_us: percentile_us(&lat_ns, 50.0),
        match_p99_us: percentile_us(&lat_ns, 99.0),
        match_max_us: lat_ns.last().map_or(0.0, |&n| n as f64 / 1000.0),
        overlap_sum,
        score_sum,
        event_errors,
        entries,
        bytes_estimate,
        bytes_per_entry: bytes_estimate
            .filter(|_| entries > 0)
            .map(|b| b as f64 / entries as f64),
    }
}

/// Prepare every op (untimed), then replay them in order.
pub(crate) fn replay<I: ReplayIndex>(index: &mut I, log: &OpLog) -> ReplayReport {
    let prepared: Vec<I::Prepared> = log.ops.iter().map(|op| index.prepare(op)).collect();
    replay_prepared(index, prepared, log)
}

/// kvroute's [`KvIndex`] under replay.
pub struct KvRouteReplay {
    pub index: KvIndex,
    scratch: OverlapScores,
}

impl KvRouteReplay {
    pub(crate) fn new(block_size: u32) -> Self {
        Self {
            index: KvIndex::new(block_size),
            scratch: OverlapScores::default(),
        }
    }

    /// An index for `log` whose targets are registered the way the service
    /// registers workers: each one that appears in the log declares the
    /// header's `capacity` as its KV capacity ([`KvIndex::reserve`]).
    pub fn registered(log: &OpLog) -> Self {
        let replay = Self::new(log.header.block_size);
        if log.header.capacity > 0 {
            let targets: std::collections::BTreeSet<_> = log
                .ops
                .iter()
                .filter_map(|op| match op {
                    Op::Event { worker, .. } => Some(*worker),
                    Op::Match(_) => None,
                })
                .collect();
            for target in targets {
                replay.index.reserve(target, log.header.capacity);
            }
        }
        replay
    }
}

impl ReplayIndex for KvRouteReplay {
    type Prepared = Op;

    fn impl_name(&self) -> String {
        "kvroute".into()
    }

    fn prepare(&self, op: &Op) -> Op {
        op.clone()
    }

    fn run(&mut self, op: Op, prefixes: &mut Vec<u32>) -> Step {
        match op {
            Op::Match(q) => {
                self.index.find_matches_into(&q, &mut self.scratch);
                prefixes.extend(self.scratch.scores.iter().map(|s| s.blocks));
                Step::Matched
            }
            Op::Event { worker, event } => match self.index.apply_owned(worker, event) {
                Ok(_) => Step::Applied,
                Err(_) => Step::Rejected,
            },
        }
    }

    fn entries(&self) -> u64 {
        self.index.stats().blocks
    }

    fn bytes_estimate(&self) -> Option<u64> {
        Some(self.index.stats().bytes_used)
    }
}

/// The naive oracle under replay (slow; a cross-check of the answers).
pub struct NaiveReplay {
    pub index: NaiveIndex,
}

impl ReplayIndex for NaiveReplay {
    type Prepared = Op;

    fn impl_name(&self) -> String {
        "naive".into()
    }

    fn prepare(&self, op: &Op) -> Op {
        op.clone()
    }

    fn run(&mut self, op: Op, prefixes: &mut Vec<u32>) -> Step {
        match op {
            Op::Match(q) => {
                let s = self.index.find_matches(&q);
                prefixes.extend(s.scores.iter().map(|s| s.blocks));
                Step::Matched
            }
            Op::Event { worker, event } => match self.index.apply(worker, &event) {
                Ok(_) => Step::Applied,
                Err(_) => Step::Rejected,
            },
        }
    }

    fn entries(&self) -> u64 {
        self.index.stats().blocks
    }
}

/// `kvroute bench index --oplog FILE [--impl kvroute|naive]`: load, replay,
/// report.
pub fn bench_index(path: &Path, impl_name: &str) -> Result<ReplayReport, OplogError> {
    let log = OpLog::load(path)?;
    let bs = log.header.block_size;
    match impl_name {
        "kvroute" => Ok(replay(&mut KvRouteReplay::registered(&log), &log)),
        "naive" => Ok(replay(
            &mut NaiveReplay {
                index: NaiveIndex::new(bs),
            },
            &log,
        )),
        other => Err(OplogError::UnknownImpl(other.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = r#"{"oplog": 1, "block_size": 64, "workers": 2, "capacity": 4, "source": "t"}
{"op": "match", "local": [1, 2]}
{"op": "store", "worker": 0, "dp_rank": 0, "parent": null, "local": [1, 2], "seq": [18446744073709551615, 11]}
{"op": "store", "worker": 1, "dp_rank": 0, "parent": 99, "local": [3], "seq": [12]}
{"op": "match", "local": [1, 2, 3]}
{"op": "remove", "worker": 0, "dp_rank": 0, "seq": [11]}
{"op": "match", "local": [1, 2, 3]}
{"op": "clear", "worker": 0, "dp_rank": 0}
"#;

    #[test]
    fn parses_big_hashes_and_replays() -> Result<(), OplogError> {
        let log = OpLog::parse(LOG.as_bytes())?;
        assert_eq!(log.header.block_size, 64);
        assert_eq!(log.ops.len(), 7);
        assert_eq!(log.blocks(), 2 + 2 + 1 + 3 + 1 + 3);
        match &log.ops[1] {
            Op::Event {
                event: KvEvent::Stored { blocks, .. },
                ..
            } => assert_eq!(blocks[0], (u64::MAX, 1)),
            other => panic!("unexpected {other:?}"),
        }
        for r in [
            replay(&mut KvRouteReplay::new(64), &log),
            replay(
                &mut NaiveReplay {
                    index: NaiveIndex::new(64),
                },
                &log,
            ),
        ] {
            assert_eq!((r.overlap_sum, r.score_sum, r.event_errors), (3, 3, 1));
            assert_eq!(r.entries, 0);
            // the matches were timed (events are not, one by one)
            assert!(r.match_max_us > 0.0, "{r:?}");
            assert!(r.to_json().starts_with("{\"impl\":"));
        }
        Ok(())
    }

    #[test]
    fn bad_lines_are_errors() {
        assert!(OpLog::parse("".as_bytes()).is_err());
        let bad = "{\"oplog\":1,\"block_size\":4}\n{\"op\":\"store\",\"worker\":0,\"dp_rank\":0,\"parent\":null,\"local\":[1],\"seq\":[]}\n";
        assert!(matches!(
            OpLog::parse(bad.as_bytes()),
            Err(OplogError::Invalid { line: 2, .. })
        ));
        assert!(
            OpLog::parse(
                "{\"oplog\":1,\"block_size\":4}\n{\"op\":\"match\",\"local\":[1.5]}\n".as_bytes()
            )
            .is_err()
        );
    }
}
