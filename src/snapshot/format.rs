//! The snapshot file: a 28-byte header (magic, format version, XXH3-64 of
//! the payload, payload length) and the payload, a protobuf
//! `SnapshotState` (`proto/kvroute/v1/snapshot.proto` documents both).
//!
//! Why protobuf: kvroute already speaks it through prost, its packed
//! repeated fields keep a block at about 17 bytes (two fixed64 hashes and a
//! one-byte parent link), and fields can be added without breaking older
//! files. The version guards changes that are not additive; the checksum
//! and the length catch a torn or corrupted file before anything of it is
//! believed.

use prost::Message;
use xxhash_rust::xxh3::xxh3_64;

use crate::pb;

pub const MAGIC: &[u8; 8] = b"KVRSNAP\0";
pub const VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 28;

/// Why a file is not a snapshot this kvroute can load.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("{len} bytes is shorter than the {HEADER_BYTES}-byte header")]
    Truncated { len: usize },
    #[error("not a kvroute snapshot (wrong magic bytes)")]
    Magic,
    #[error("format version {found}, this kvroute reads version {VERSION}")]
    Version { found: u32 },
    #[error("the header declares {declared} payload bytes, the file has {actual}")]
    Length { declared: u64, actual: u64 },
    #[error("checksum mismatch: header {declared:#018x}, payload {actual:#018x}")]
    Checksum { declared: u64, actual: u64 },
    #[error("payload does not decode: {0}")]
    Decode(String),
}

/// The file bytes of `state`.
pub fn encode(state: &pb::SnapshotState) -> Vec<u8> {
    frame(&state.encode_to_vec())
}

/// A file of `payload` behind a header that agrees with it.
pub(crate) fn frame(payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER_BYTES + payload.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&VERSION.to_le_bytes());
    bytes.extend_from_slice(&xxh3_64(payload).to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// The state in a file's bytes, if the header, length and checksum agree.
pub fn decode(bytes: &[u8]) -> Result<pb::SnapshotState, FormatError> {
    let (header, payload) = bytes
        .split_at_checked(HEADER_BYTES)
        .ok_or(FormatError::Truncated { len: bytes.len() })?;
    let header = Header::read(header, bytes.len() as u64)?;
    header.decode(payload)
}

/// A checked header: magic, version, and a payload length that agrees
/// with the file's size, so the body is read only when all three hold
/// (and its size is the file's, never what the header merely claims).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    checksum: u64,
    payload_len: u64,
}

impl Header {
    /// Reads the first [`HEADER_BYTES`] of a file of `file_len` bytes.
    pub(crate) fn read(header: &[u8], file_len: u64) -> Result<Self, FormatError> {
        let header = header
            .get(..HEADER_BYTES)
            .ok_or(FormatError::Truncated { len: header.len() })?;
        let word = |at: usize| -> u64 {
            let mut b = [0u8; 8];
            b.copy_from_slice(&header[at..at + 8]);
            u64::from_le_bytes(b)
        };
        if &header[0..8] != MAGIC {
            return Err(FormatError::Magic);
        }
        let mut version = [0u8; 4];
        version.copy_from_slice(&header[8..12]);
        let version = u32::from_le_bytes(version);
        if version != VERSION {
            return Err(FormatError::Version { found: version });
        }
        let (checksum, payload_len) = (word(12), word(20));
        let actual = file_len.saturating_sub(HEADER_BYTES as u64);
        if payload_len != actual {
            return Err(FormatError::Length {
                declared: payload_len,
                actual,
            });
        }
        Ok(Self {
            checksum,
            payload_len,
        })
    }

    /// Bytes of payload after the header.
    pub(crate) fn payload_len(&self) -> u64 {
        self.payload_len
    }

    /// The state in `payload`, if its checksum is the header's.
    pub(crate) fn decode(&self, payload: &[u8]) -> Result<pb::SnapshotState, FormatError> {
        if payload.len() as u64 != self.payload_len {
            return Err(FormatError::Length {
                declared: self.payload_len,
                actual: payload.len() as u64,
            });
        }
        let actual = xxh3_64(payload);
        if actual != self.checksum {
            return Err(FormatError::Checksum {
                declared: self.checksum,
                actual,
            });
        }
        pb::SnapshotState::decode(payload).map_err(|e| FormatError::Decode(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> pb::SnapshotState {
        pb::SnapshotState {
            taken_unix_ms: 42,
            targets: vec![pb::SnapshotTarget {
                worker_id: 7,
                locals: vec![1, 2, 3],
                parent_back: vec![0, 1, 1],
                engines: vec![10, 11, 12],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_file_round_trips() {
        assert_eq!(decode(&encode(&state())), Ok(state()));
    }

    #[test]
    fn every_damage_is_caught_before_decoding() {
        let good = encode(&state());
        assert_eq!(decode(&good[..10]), Err(FormatError::Truncated { len: 10 }));
        assert!(matches!(
            decode(&good[..good.len() - 1]),
            Err(FormatError::Length { .. })
        ));
        let mut magic = good.clone();
        magic[0] ^= 0xff;
        assert_eq!(decode(&magic), Err(FormatError::Magic));
        let mut version = good.clone();
        version[8] = 9;
        assert_eq!(decode(&version), Err(FormatError::Version { found: 9 }));
        // every single flipped payload byte
        for at in HEADER_BYTES..good.len() {
            let mut flipped = good.clone();
            flipped[at] ^= 0x01;
            assert!(
                matches!(decode(&flipped), Err(FormatError::Checksum { .. })),
                "byte {at}"
            );
        }
    }
}
