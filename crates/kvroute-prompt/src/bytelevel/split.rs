//! The pre-tokenizer's split, as HF's `Split` (isolated) or `ByteLevel`
//! regex cuts text: the pieces BPE merges one by one.
//!
//! Two ways, the same pieces:
//! * any supported pattern on regex-automata's lazy DFA, each piece found
//!   by an anchored forward search where the last one ended; the lookahead
//!   `\s+(?!\S)`, which the DFA lacks, becomes `\s+\z` and `\s+\s` with
//!   the last character given back;
//! * for ASCII text under the Qwen2 / Llama 3 pattern (the one nearly all
//!   current byte-level models ship), a hand-written scan of the same
//!   alternatives in the same order, on byte classes: no search at all.
//!
//! `split_scan_equals_the_regex` checks the two agree on every ASCII string
//! of a small alphabet it draws; the parity tests check both against HF.

use std::sync::Mutex;

use regex_automata::{Anchored, Input, meta::Regex, util::syntax};

/// The pre-tokenizer's lookahead, and GPT-2's own split pattern (a
/// `ByteLevel` pre-tokenizer with `use_regex`).
pub(super) const LOOKAHEAD: &str = r"\s+(?!\S)";
pub(super) const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// The pre-tokenizer's regex, split into its top-level alternatives, with
/// the lookahead alternative replaced; `None` for a pattern this encoder
/// cannot reproduce (another lookaround, or a syntax `regex` refuses).
pub(super) struct Splitter {
    /// The scan for ASCII text, where the pattern is one it knows.
    ascii: Option<AsciiScan>,
    regex: Regex,
    /// The pattern whose match gives its last character back.
    give_back: usize,
    /// Search caches (the lazy DFA's states), one per encode at a time.
    caches: Mutex<Vec<regex_automata::meta::Cache>>,
}

/// Search caches kept between encodes.
const MAX_IDLE_CACHES: usize = 8;

fn top_level_alternatives(pattern: &str) -> Vec<String> {
    let mut alternatives = vec![String::new()];
    let (mut parens, mut brackets) = (0usize, 0usize);
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        let last = alternatives.len() - 1;
        match c {
            '\\' => {
                alternatives[last].push(c);
                if let Some(escaped) = chars.next() {
                    alternatives[last].push(escaped);
                }
                continue;
            }
            '[' => brackets += 1,
            ']' if brackets > 0 => brackets -= 1,
            '(' if brackets == 0 => parens += 1,
            ')' if brackets == 0 => parens = parens.saturating_sub(1),
            '|' if brackets == 0 && parens == 0 => {
                alternatives.push(String::new());
                continue;
            }
            _ => {}
        }
        alternatives[last].push(c);
    }
    alternatives
}

impl Splitter {
    pub(super) fn new(pattern: &str) -> Option<Self> {
        let mut patterns = Vec::new();
        let mut give_back = None;
        for alternative in top_level_alternatives(pattern) {
            if alternative == LOOKAHEAD && give_back.is_none() {
                patterns.push(r"\s+\z".to_owned());
                give_back = Some(patterns.len());
                patterns.push(r"\s+\s".to_owned());
            } else if alternative.contains("(?=")
                || alternative.contains("(?!")
                || alternative.contains("(?<")
                || alternative.is_empty()
            {
                return None;
            } else {
                patterns.push(alternative);
            }
        }
        let regex = Regex::builder()
            .syntax(syntax::Config::new().unicode(true).utf8(true))
            .build_many(&patterns)
            .ok()?;
        Some(Self {
            ascii: AsciiScan::for_pattern(pattern),
            regex,
            give_back: give_back.unwrap_or(usize::MAX),
            caches: Mutex::default(),
        })
    }

    /// Calls `piece` with each piece of `text` in order: the regex's
    /// matches, and any text between them, as HF's `Isolated` split.
    ///
    /// Each match is searched anchored where the last one ended, forward
    /// only (the start is known): a half search, a third of a full one's
    /// work. Text no pattern matches there is found by an unanchored
    /// search and given as a piece of its own.
    pub(super) fn split(&self, text: &str, mut piece: impl FnMut(&str)) {
        if let Some(scan) = &self.ascii
            && text.is_ascii()
        {
            let bytes = text.as_bytes();
            let mut at = 0;
            while at < bytes.len() {
                let end = scan.piece_end(bytes, at);
                piece(&text[at..end]);
                at = end;
            }
            return;
        }
        self.split_by_regex(text, piece);
    }

    fn split_by_regex(&self, text: &str, mut piece: impl FnMut(&str)) {
        let mut cache = self
            .caches
            .lock()
            .ok()
            .and_then(|mut caches| caches.pop())
            .unwrap_or_else(|| self.regex.create_cache());
        let mut at = 0;
        while at < text.len() {
            let anchored = Input::new(text)
                .span(at..text.len())
                .anchored(Anchored::Yes);
            let (start, end, pattern) = match self.regex.search_half_with(&mut cache, &anchored) {
                Some(half) => (at, half.offset(), half.pattern().as_usize()),
                None => {
                    let rest = Input::new(text).span(at..text.len());
                    let Some(found) = self.regex.search_with(&mut cache, &rest) else {
                        piece(&text[at..]);
                        break;
                    };
                    (found.start(), found.end(), found.pattern().as_usize())
                }
            };
            let mut end = end;
            if pattern == self.give_back {
                // `\s+\s`: the last whitespace character is not the
                // lookahead's; it starts the next piece.
                end = text[..end]
                    .char_indices()
                    .next_back()
                    .map_or(end, |(i, _)| i);
            }
            if start > at {
                piece(&text[at..start]);
            }
            if end <= start {
                // An empty match (no supported pattern has one): move on
                // by a character so the loop ends.
                let step = text[start..].chars().next().map_or(1, char::len_utf8);
                piece(&text[start..start + step]);
                at = start + step;
                continue;
            }
            piece(&text[start..end]);
            at = end;
        }
        if let Ok(mut caches) = self.caches.lock()
            && caches.len() < MAX_IDLE_CACHES
        {
            caches.push(cache);
        }
    }
}

/// The Qwen2 split pattern (`\p{N}`: one digit a piece) and Llama 3's
/// (`\p{N}{1,3}`), as their `tokenizer.json` files write them.
pub(super) const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(super) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// An ASCII byte as the pattern's classes see it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    /// `\r` or `\n`.
    Newline,
    /// The rest of `\s`: tab, vertical tab, form feed, space.
    Space,
    /// Neither `\s`, `\p{L}` nor `\p{N}`: punctuation and controls.
    Other,
}

fn class(byte: u8) -> Class {
    match byte {
        b'a'..=b'z' | b'A'..=b'Z' => Class::Letter,
        b'0'..=b'9' => Class::Digit,
        b'\r' | b'\n' => Class::Newline,
        b'\t' | 0x0B | 0x0C | b' ' => Class::Space,
        _ => Class::Other,
    }
}

/// The Qwen2 / Llama 3 pattern on ASCII, alternative by alternative.
struct AsciiScan {
    /// Digits one piece holds: 1 (Qwen2) or 3 (Llama 3).
    digits: usize,
}

impl AsciiScan {
    fn for_pattern(pattern: &str) -> Option<Self> {
        match pattern {
            QWEN2_PATTERN => Some(Self { digits: 1 }),
            LLAMA3_PATTERN => Some(Self { digits: 3 }),
            _ => None,
        }
    }

    /// Where the piece starting at `at` ends (`at < text.len()`), as the
    /// first alternative that matches there ends it.
    fn piece_end(&self, text: &[u8], at: usize) -> usize {
        let n = text.len();
        let of = |i: usize| text.get(i).map_or(Class::Newline, |b| class(*b));
        let run = |from: usize, keep: &dyn Fn(Class) -> bool| {
            let mut end = from;
            while end < n && keep(class(text[end])) {
                end += 1;
            }
            end
        };
        let first = class(text[at]);
        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if text[at] == b'\'' {
            let lower = |i: usize| text.get(i).map(u8::to_ascii_lowercase);
            match (lower(at + 1), lower(at + 2)) {
                (Some(b's' | b't' | b'm' | b'd'), _) => return at + 2,
                (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => return at + 3,
                _ => {}
            }
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if first == Class::Letter {
            return run(at, &|c| c == Class::Letter);
        }
        if matches!(first, Class::Space | Class::Other) && of(at + 1) == Class::Letter {
            return run(at + 1, &|c| c == Class::Letter);
        }
        // \p{N} or \p{N}{1,3}
        if first == Class::Digit {
            let digits = run(at, &|c| c == Class::Digit);
            return digits.min(at + self.digits);
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        let other_from = if first == Class::Other {
            Some(at)
        } else if text[at] == b' ' && of(at + 1) == Class::Other {
            Some(at + 1)
        } else {
            None
        };
        if let Some(from) = other_from {
            let others = run(from, &|c| c == Class::Other);
            return run(others, &|c| c == Class::Newline);
        }
        // Whitespace from here on.
        let spaces = run(at, &|c| matches!(c, Class::Space | Class::Newline));
        // \s*[\r\n]+: through the run's last line break.
        if let Some(last) = (at..spaces)
            .rev()
            .find(|i| class(text[*i]) == Class::Newline)
        {
            return last + 1;
        }
        // \s+(?!\S): all of it at the end of the text, else all but the
        // last, which goes with what follows; \s+: a single one.
        if spaces == n || spaces - at == 1 {
            spaces
        } else {
            spaces - 1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_scan_equals_the_regex() {
        // Every string the scan could meet, in small: each class, the
        // contraction letters in both cases, and the pattern's edges.
        let alphabet = b"aZsStTlLrReEvVdDmM19' \t\n\r\x0b\x0c.-(\x1c\x7f\x00";
        for pattern in [QWEN2_PATTERN, LLAMA3_PATTERN] {
            let splitter = Splitter::new(pattern).unwrap();
            assert!(splitter.ascii.is_some());
            let mut state = 0x9E37_79B9_7F4A_7C15u64;
            for case in 0..60_000 {
                let len = 1 + case % 14;
                let text: String = (0..len)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        char::from(alphabet[(state % alphabet.len() as u64) as usize])
                    })
                    .collect();
                let (mut by_scan, mut by_regex) = (Vec::new(), Vec::new());
                splitter.split(&text, |p| by_scan.push(p.to_owned()));
                splitter.split_by_regex(&text, |p| by_regex.push(p.to_owned()));
                assert_eq!(by_scan, by_regex, "{pattern}: {text:?}");
            }
        }
    }

    #[test]
    fn alternatives_split_at_the_top_level_only() {
        let pattern = r"(?i:'s|'t)|[^\r\n\p{L}|]?\p{L}+|\p{N}{1,3}|\s+(?!\S)|\s+";
        assert_eq!(
            top_level_alternatives(pattern),
            [
                r"(?i:'s|'t)",
                r"[^\r\n\p{L}|]?\p{L}+",
                r"\p{N}{1,3}",
                LOOKAHEAD,
                r"\s+"
            ]
        );
    }

    #[test]
    fn the_lookahead_is_given_back_as_the_backtracking_engine_does() {
        let splitter = Splitter::new(GPT2_PATTERN).unwrap();
        let pieces = |text: &str| {
            let mut out = Vec::new();
            splitter.split(text, |p| out.push(p.to_owned()));
            out
        };
        // Three spaces before a word: two alone, the third goes with it.
        assert_eq!(pieces("a   b"), ["a", "  ", " b"]);
        // At the end of the text the whole run is one piece.
        assert_eq!(pieces("a   "), ["a", "   "]);
        // One space before a word stays with it.
        assert_eq!(pieces("a b"), ["a", " b"]);
        assert_eq!(pieces("it's 12"), ["it", "'s", " 12"]);
        // A multi-byte space given back whole (GPT-2 joins only an ASCII
        // space to a word).
        assert_eq!(
            pieces("a\u{3000}\u{3000}\u{3000}b"),
            ["a", "\u{3000}\u{3000}", "\u{3000}", "b"]
        );
    }

    #[test]
    fn lookarounds_other_than_the_known_one_are_refused() {
        assert!(Splitter::new(r"\p{L}+(?=\d)|\s+").is_none());
        assert!(Splitter::new(r"(?<=a)b").is_none());
    }
}
