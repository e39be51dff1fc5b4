//! Entry points for fuzzing: each takes raw bytes, runs them through the
//! code the server runs on untrusted input, and returns normally whatever
//! the bytes are. A panic is a bug: either a panic on input in the code
//! under test, or a failed check of what that code must guarantee (for
//! `publish_events`, agreement with the naive reference index).
//!
//! Why in the library: the `cargo fuzz` targets in `fuzz/` (nightly,
//! libFuzzer, with the feature `fuzzing`) and the stable replay of the
//! corpus (`tests.rs`) call the same functions, so every input the fuzzer
//! ever found stays checked by `cargo test`. Not part of the service's API
//! and not in its binary.

mod config;
mod policy;
mod publish;
mod select;
mod snapshot;
#[cfg(test)]
mod tests;
mod zmq;

pub use config::config_file;
pub use policy::auth_policy;
pub use publish::publish_events;
pub use select::select_worker;
pub use snapshot::snapshot_payload;
pub use zmq::zmq_payload;

/// A fuzz target's entry point.
pub type Entry = fn(&[u8]);

/// The fuzz targets by name (the `fuzz/corpus/<name>/` directories), with
/// their entry points.
pub const TARGETS: [(&str, Entry); 6] = [
    ("zmq_payload", zmq_payload),
    ("publish_events", publish_events),
    ("select_worker", select_worker),
    ("config_file", config_file),
    ("snapshot_payload", snapshot_payload),
    ("auth_policy", auth_policy),
];

/// Reads structured choices from fuzz bytes; past the end every read is 0,
/// so any input decodes to something.
struct Bytes<'a> {
    data: &'a [u8],
}

impl<'a> Bytes<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    fn u64(&mut self) -> u64 {
        let mut out = [0u8; 8];
        for byte in &mut out {
            *byte = self.u8();
        }
        u64::from_le_bytes(out)
    }

    /// Up to `n` bytes (fewer at the end).
    fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        head
    }

    /// Whatever is left.
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}
