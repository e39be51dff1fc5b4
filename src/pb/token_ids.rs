//! `kvroute.v1.TokenIds` with a faster decoder than the generated one.
//!
//! Why this exists: a 12,000-token prompt is 12,000 varints, and prost's
//! generated decoder takes them one by one through the `Buf` trait (a
//! bounds check, an advance of the receive buffer and a `Vec` push that
//! may grow, per token): about 60% of the server's time in
//! `bench select --send-tokens`. This type is the same message (`build.rs`
//! maps the proto type here with `extern_path`), encoded the same way; it
//! only decodes a packed field that lies in one contiguous chunk (always,
//! for a gRPC message) straight from that slice, four bytes at a time, into
//! a `Vec` sized once by counting the varints' last bytes.
//!
//! Invariants: accepts and refuses exactly what the generated decoder does
//! (packed or unpacked ids, several occurrences appended, values truncated
//! to 32 bits as prost does, a varint cut short or over 10 bytes an error);
//! `tests` below check it against prost's own encoding and decoding.

use prost::{
    DecodeError, Message,
    bytes::{Buf, BufMut},
    encoding::{DecodeContext, WireType, decode_varint, skip_field, uint32},
};

/// A token id sequence (proto `kvroute.v1.TokenIds`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct TokenIds {
    /// The token ids.
    pub ids: Vec<u32>,
}

impl Message for TokenIds {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        uint32::encode_packed(1, &self.ids, buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if tag != 1 {
            return skip_field(wire_type, tag, buf, ctx);
        }
        if wire_type == WireType::LengthDelimited {
            let chunk = buf.chunk();
            let mut after_len = chunk;
            if let Ok(len) = decode_varint(&mut after_len)
                && let Ok(len) = usize::try_from(len)
                && len <= after_len.len()
            {
                decode_packed(&after_len[..len], &mut self.ids)?;
                let consumed = chunk.len() - after_len.len() + len;
                buf.advance(consumed);
                return Ok(());
            }
        }
        // Unpacked ids, or a field split across chunks: prost's own way.
        uint32::merge_repeated(wire_type, &mut self.ids, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        uint32::encoded_len_packed(1, &self.ids)
    }

    fn clear(&mut self) {
        self.ids.clear();
    }
}

/// Appends the varints of `packed` to `ids`, truncated to 32 bits as
/// prost's `uint32` decoding does.
fn decode_packed(packed: &[u8], ids: &mut Vec<u32>) -> Result<(), DecodeError> {
    // Every varint ends in the one byte of it below 0x80.
    ids.reserve(packed.iter().filter(|&&b| b < 0x80).count());
    let mut rest = packed;
    // A varint of up to 4 bytes (every id below 2^28) is read from one
    // 4-byte word without a branch per byte: the first byte without its
    // top bit set ends it, and the 7-bit groups are put side by side.
    while let Some(word) = rest.first_chunk::<4>() {
        let word = u32::from_le_bytes(*word);
        let ends = !word & 0x8080_8080;
        if ends == 0 {
            // 5 bytes or more: prost's decoder, truncated as prost does.
            ids.push(decode_varint(&mut rest)? as u32);
            continue;
        }
        let len = ends.trailing_zeros() / 8 + 1;
        let word = word & (u32::MAX >> (32 - 8 * len));
        ids.push(
            (word & 0x7f)
                | ((word >> 1) & (0x7f << 7))
                | ((word >> 2) & (0x7f << 14))
                | ((word >> 3) & (0x7f << 21)),
        );
        rest = &rest[len as usize..];
    }
    while !rest.is_empty() {
        // The last few bytes. On a slice prost's varint decoder reads in
        // place; past the end of `packed` (a varint cut short) it fails.
        ids.push(decode_varint(&mut rest)? as u32);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The message as prost generates it, to compare with.
    #[derive(Clone, PartialEq, prost::Message)]
    struct Generated {
        #[prost(uint32, repeated, tag = "1")]
        ids: Vec<u32>,
    }

    fn both(
        bytes: &[u8],
    ) -> (
        Result<TokenIds, DecodeError>,
        Result<Generated, DecodeError>,
    ) {
        (TokenIds::decode(bytes), Generated::decode(bytes))
    }

    #[test]
    fn encodes_and_decodes_like_the_generated_message() {
        for ids in [
            vec![],
            vec![0],
            vec![1, 127, 128, 16_383, 16_384, 49_999, u32::MAX],
            (0..5000).map(|i| i * 86_243).collect(),
        ] {
            let ours = TokenIds { ids: ids.clone() };
            let theirs = Generated { ids: ids.clone() };
            assert_eq!(ours.encode_to_vec(), theirs.encode_to_vec());
            assert_eq!(ours.encoded_len(), theirs.encoded_len());
            let (a, b) = both(&theirs.encode_to_vec());
            assert_eq!(a.map(|m| m.ids).ok(), b.map(|m| m.ids).ok());
        }
    }

    #[test]
    fn accepts_and_refuses_what_the_generated_decoder_does() {
        let cases: Vec<Vec<u8>> = vec![
            // Unpacked ids, then a packed run: appended in order.
            vec![0x08, 0x05, 0x08, 0x96, 0x01, 0x0a, 0x02, 0x01, 0x02],
            // Two packed runs.
            vec![0x0a, 0x01, 0x07, 0x0a, 0x01, 0x08],
            // A 64-bit value: truncated to 32 bits.
            vec![
                0x0a, 0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ],
            // An unknown field is skipped.
            vec![0x10, 0x01, 0x0a, 0x01, 0x03],
            // A varint cut short by the field's length.
            vec![0x0a, 0x01, 0x96, 0x01],
            // The field's length past the end of the message.
            vec![0x0a, 0x05, 0x01],
            // An 11-byte varint.
            vec![
                0x0a, 0x0b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ],
            // A varint whose 10th byte is over 1.
            vec![
                0x0a, 0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
            ],
            // A wrong wire type for field 1.
            vec![0x0d, 0x01, 0x02, 0x03, 0x04],
        ];
        for bytes in cases {
            let (a, b) = both(&bytes);
            assert_eq!(a.is_ok(), b.is_ok(), "{bytes:02x?}: {a:?} vs {b:?}");
            assert_eq!(a.ok().map(|m| m.ids), b.ok().map(|m| m.ids), "{bytes:02x?}");
        }
    }

    #[test]
    fn every_varint_length_decodes_like_prost() {
        let mut ids = Vec::new();
        for shift in 0..32 {
            let edge = 1u32 << shift;
            ids.extend([edge - 1, edge, edge | 1, edge.wrapping_mul(3)]);
        }
        ids.push(u32::MAX);
        // Every alignment of the 4-byte reads, and the tail after them.
        for skip in 0..8 {
            let theirs = Generated {
                ids: ids[skip..].to_vec(),
            };
            let ours = TokenIds::decode(theirs.encode_to_vec().as_slice());
            assert_eq!(ours.map(|m| m.ids).ok(), Some(theirs.ids));
        }
    }

    #[test]
    fn a_field_split_across_chunks_decodes_the_same() {
        let ids: Vec<u32> = (0..300).map(|i| i * 1_000_003).collect();
        let bytes = Generated { ids: ids.clone() }.encode_to_vec();
        let (head, tail) = bytes.split_at(7);
        let chained = Buf::chain(head, tail);
        assert_eq!(TokenIds::decode(chained).map(|m| m.ids).ok(), Some(ids));
    }
}
