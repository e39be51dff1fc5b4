//! Seedless hashing and seeded random numbers for the simulator.
//!
//! It exists so a replay is reproducible: the engines' block maps and the
//! policies' sets hash with [`FastHasher`] (no per-process random seed, unlike
//! the standard library's default), and randomised policies draw from
//! [`SimRng`], a stream fixed by `--seed`. Both are built on
//! [`crate::trace::mix64`].

use crate::trace::mix64;

/// A deterministic hasher for maps keyed by values that are already hashes
/// (or small integers): one `mix64` per word, no random seed.
#[derive(Clone, Copy, Debug, Default)]
pub struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = mix64(self.0 ^ v);
    }

    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

/// `BuildHasher` for [`FastHasher`].
pub type FastBuild = std::hash::BuildHasherDefault<FastHasher>;

/// Deterministic pseudo-random numbers (SplitMix64 stream).
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    pub(crate) fn new(seed: u64) -> Self {
        SimRng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// Uniform in `0..n` (`n > 0`), by multiply-shift.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic_and_in_range() {
        let mut a = SimRng::new(7);
        let mut b = SimRng::new(7);
        for _ in 0..1000 {
            let x = a.below(5);
            assert_eq!(x, b.below(5));
            assert!(x < 5);
        }
    }
}
