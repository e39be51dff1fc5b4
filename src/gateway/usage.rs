//! The engine's own count of cached prompt tokens, read from the response
//! as it streams past: vLLM reports `usage.prompt_tokens_details.
//! cached_tokens` in a plain answer and in the last SSE chunk of a stream
//! (with `stream_options.include_usage`). It feeds the cached-token
//! feedback (`router::feedback`) that checks the index against the engine.
//!
//! Why a scanner and not a JSON parser: the body is the engine's and may
//! be large and split anywhere; only one number is wanted. The scanner
//! keeps at most [`CARRY`] bytes between chunks, so a key split across two
//! chunks is still found and a hostile engine cannot make it hold more.

const KEY: &[u8] = b"\"cached_tokens\"";

/// Bytes kept from the end of one chunk for the next: the key, a colon,
/// spaces and a 20-digit number fit.
const CARRY: usize = 64;

/// Finds the last `"cached_tokens": N` in a body fed in chunks.
#[derive(Debug, Default)]
pub(crate) struct CachedTokensScanner {
    carry: Vec<u8>,
    found: Option<u64>,
}

impl CachedTokensScanner {
    /// Reads one chunk.
    pub(crate) fn feed(&mut self, chunk: &[u8]) {
        let mut window = std::mem::take(&mut self.carry);
        window.extend_from_slice(chunk);
        let mut at = 0;
        while let Some(offset) = find(&window[at..], KEY) {
            let value_at = at + offset + KEY.len();
            match number_after(&window[value_at..]) {
                Value::Number(n) => self.found = Some(n),
                Value::NotANumber => {}
                // Cut at the chunk's end: the next chunk completes it.
                Value::Incomplete => {
                    self.carry = window[at + offset..].to_vec();
                    self.carry.truncate(CARRY);
                    return;
                }
            }
            at = value_at;
        }
        let keep = window.len().min(CARRY);
        self.carry = window[window.len() - keep..].to_vec();
        // A number right after a key that ended the window was complete
        // only if the next byte is not a digit; keeping the tail lets the
        // next chunk see the whole of it (and finds it again, which is
        // harmless: the last value wins).
    }

    /// The last value seen.
    pub(crate) fn cached_tokens(&self) -> Option<u64> {
        self.found
    }
}

enum Value {
    Number(u64),
    NotANumber,
    Incomplete,
}

/// The number after `: ` at the start of `rest`.
fn number_after(rest: &[u8]) -> Value {
    let mut i = 0;
    while i < rest.len() && rest[i].is_ascii_whitespace() {
        i += 1;
    }
    if i == rest.len() {
        return Value::Incomplete;
    }
    if rest[i] != b':' {
        return Value::NotANumber;
    }
    i += 1;
    while i < rest.len() && rest[i].is_ascii_whitespace() {
        i += 1;
    }
    let start = i;
    while i < rest.len() && rest[i].is_ascii_digit() {
        i += 1;
    }
    if i == rest.len() {
        return Value::Incomplete;
    }
    if start == i || i - start > 20 {
        return Value::NotANumber;
    }
    std::str::from_utf8(&rest[start..i])
        .ok()
        .and_then(|digits| digits.parse().ok())
        .map_or(Value::NotANumber, Value::Number)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAIN: &str = r#"{"id":"x","usage":{"prompt_tokens":40,"total_tokens":45,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":32}}}"#;

    #[test]
    fn a_plain_answer_gives_its_cached_tokens() {
        let mut scanner = CachedTokensScanner::default();
        scanner.feed(PLAIN.as_bytes());
        assert_eq!(scanner.cached_tokens(), Some(32));
    }

    #[test]
    fn every_split_of_the_body_gives_the_same_number() {
        for cut in 0..=PLAIN.len() {
            let mut scanner = CachedTokensScanner::default();
            scanner.feed(&PLAIN.as_bytes()[..cut]);
            scanner.feed(&PLAIN.as_bytes()[cut..]);
            assert_eq!(scanner.cached_tokens(), Some(32), "cut at {cut}");
        }
        // Byte by byte too.
        let mut scanner = CachedTokensScanner::default();
        for byte in PLAIN.as_bytes() {
            scanner.feed(std::slice::from_ref(byte));
        }
        assert_eq!(scanner.cached_tokens(), Some(32));
    }

    #[test]
    fn the_last_sse_chunk_wins_and_nulls_and_junk_are_ignored() {
        let mut scanner = CachedTokensScanner::default();
        scanner.feed(b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":null}}}\n\n");
        assert_eq!(scanner.cached_tokens(), None);
        scanner.feed(b"data: {\"cached_tokens\": 16}\n\ndata: {\"cached_tokens\" : 48}\n\n");
        scanner.feed(b"data: [DONE]\n\n");
        assert_eq!(scanner.cached_tokens(), Some(48));
        scanner.feed(b"\"cached_tokens\":99999999999999999999999999}");
        assert_eq!(scanner.cached_tokens(), Some(48));
    }

    #[test]
    fn what_it_keeps_between_chunks_is_bounded() {
        let mut scanner = CachedTokensScanner::default();
        let mut hostile = b"\"cached_tokens\":".to_vec();
        hostile.extend(std::iter::repeat_n(b'1', 10_000));
        scanner.feed(&hostile);
        assert!(scanner.carry.len() <= CARRY);
        scanner.feed(&vec![b' '; 100_000]);
        assert!(scanner.carry.len() <= CARRY);
    }
}
