//! Text that finds where a tokenizer's pieces are cut: words, numbers and
//! punctuation; every kind of whitespace and line break in runs of every
//! length; contractions in both cases (and the long s and the Kelvin sign,
//! which fold to them); scripts that need NFC (combining marks, Hangul
//! jamo), CJK, emoji sequences, digits of other scripts; added tokens whole
//! and cut short; long runs that merge by the heap; and code points drawn
//! from every plane. Seeded, so a failure repeats.

/// A small deterministic generator (xorshift64*): tests need no `rand`.
pub struct Gen(u64);

impl Gen {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

const WORDS: &[&str] = &[
    "the",
    "The",
    "THE",
    "router",
    "cache",
    "hello",
    "world",
    "naïve",
    "café",
    "Zürich",
    "straße",
    "über",
    "déjà",
    "x",
    "a",
    "I",
    "tokenization",
    "Supercalifragilistic",
    "def",
    "fn",
    "return",
    "self",
    "None",
    "null",
    "true",
    "i18n",
    "snake_case",
    "camelCase",
    "http",
    "www",
    "com",
    "ünïcödé",
    "ΑΒΓ",
    "αβγ",
    "Москва",
    "привет",
    "中文",
    "日本語",
    "한국어",
    "العربية",
    "हिन्दी",
    "ไทย",
    "עברית",
    "ελληνικά",
];

const SPACES: &[&str] = &[
    " ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", " \n", "\n ", "  \n  ",
    "\u{a0}", "\u{3000}", "\u{2003}", "\u{2028}", "\u{2029}", "\u{85}", "\u{b}", "\u{c}",
    "\u{200b}", "\u{feff}", "\u{1680}", "\u{202f}", "\u{205f}", " \u{a0} ", "\n\t\n",
];

const OTHERS: &[&str] = &[
    "'s",
    "'S",
    "'t",
    "'re",
    "'VE",
    "'m",
    "'ll",
    "'LL",
    "'d",
    "'D",
    "'ſ",
    "'\u{212a}",
    "'",
    "''",
    "\"",
    "...",
    "!",
    "?!",
    ",",
    ".",
    ";",
    ":",
    "-",
    "--",
    "—",
    "–",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "<",
    ">",
    "/",
    "\\",
    "|",
    "@",
    "#",
    "$",
    "%",
    "^",
    "&",
    "*",
    "_",
    "+",
    "=",
    "~",
    "`",
    "©",
    "®",
    "€",
    "£",
    "¥",
    "§",
    "¶",
    "•",
    "…",
    "→",
    "∑",
    "0",
    "7",
    "12",
    "123",
    "1234",
    "12345",
    "3.14159",
    "1e10",
    "0x1F",
    "٣٤٥",
    "０１２",
    "²",
    "½",
    "Ⅻ",
    "e\u{301}",
    "a\u{308}",
    "\u{1100}\u{1161}\u{11a8}",
    "\u{301}",
    "😀",
    "👍🏽",
    "👨\u{200d}👩\u{200d}👧",
    "🇯🇵",
    "\u{0}",
    "\u{7f}",
    "\u{1b}[0m",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_",
    "|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|end|>",
    "```rust\n",
    "```",
    "    return x;\n",
    "{\"key\": [1, 2]}",
    "http://example.com/a?b=c",
];

/// One piece of text: mostly plain words and spaces, sometimes anything.
pub fn text(g: &mut Gen, pieces: usize) -> String {
    let mut out = String::new();
    for _ in 0..pieces {
        match g.below(20) {
            0..=7 => {
                if g.below(3) > 0 {
                    out.push(' ');
                }
                out.push_str(g.pick(WORDS));
            }
            8..=10 => out.push_str(g.pick(SPACES)),
            11..=15 => out.push_str(g.pick(OTHERS)),
            16 => {
                // A long run: letters, digits or one repeated mark.
                let unit = g.pick(&["a", "ab", "9", "-", "中", "é", " ", "\n", "=", "xyz"]);
                let n = 20 + g.below(200);
                out.push_str(&unit.repeat(n));
            }
            _ => {
                // Code points from every plane, assigned or not.
                for _ in 0..1 + g.below(4) {
                    let plane = [0u32, 0, 0, 1, 2, 3, 14, 15][g.below(8)];
                    let code = plane << 16 | (g.next() as u32 & 0xFFFF);
                    if let Some(c) = char::from_u32(code) {
                        out.push(c);
                    }
                }
            }
        }
    }
    out
}

/// The same text with its non-ASCII characters left out: what the ASCII
/// scan of the split (`bytelevel/split.rs`) sees.
pub fn ascii_text(g: &mut Gen, pieces: usize) -> String {
    text(g, pieces).chars().filter(char::is_ascii).collect()
}
