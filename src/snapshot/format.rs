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
pub(crate) fn encode(state: &pb::SnapshotState) -> Vec<u8> {
    let payload = state.encode_to_vec();
    let mut bytes = Vec::with_capacity(HEADER_BYTES + payload.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&VERSION.to_le_bytes());
    bytes.extend_from_slice(&xxh3_64(&payload).to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&payload);
    bytes
}

/// The state in a file's bytes, if the header, length and checksum agree.
pub(crate) fn decode(bytes: &[u8]) -> Result<pb::SnapshotState, FormatError> {
    let (header, payload) = bytes
        .split_at_checked(HEADER_BYTES)
        .ok_or(FormatError::Truncated { len: bytes.len() })?;
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
    let (declared_sum, declared_len) = (word(12), word(20));
    if declared_len != payload.len() as u64 {
        return Err(FormatError::Length {
            declared: declared_len,
            actual: payload.len() as u64,
        });
    }
    let actual = xxh3_64(payload);
    if actual != declared_sum {
        return Err(FormatError::Checksum {
            declared: declared_sum,
            actual,
        });
    }
    pb::SnapshotState::decode(payload).map_err(|e| FormatError::Decode(e.to_string()))
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
