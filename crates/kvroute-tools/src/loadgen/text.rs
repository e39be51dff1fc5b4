//! Prompt text for a trace request: one word per trace token, made per
//! block, so requests sharing leading blocks share leading text exactly.
//!
//! Why: a trace gives block ids, not text, and an engine over real sockets
//! needs text. A block's words depend only on its prefix-chained key (the
//! block and every block before it), so two prompts are equal up to the
//! end of a block exactly when the trace says so, and an engine's cache
//! reuses what the trace's requests share. Words are short common English
//! words with a leading space: about one token each in the byte-level BPE
//! tokenizers of Llama, Qwen and GPT families, and exactly one in the mock
//! engine's word-level tokenization; a block boundary is a word boundary,
//! so shared blocks tokenize alike.

use crate::trace::TraceRequest;

/// The words text is made of.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "new", "some",
    "what", "up", "out", "other", "into", "only", "its", "may", "then", "first", "any", "like",
    "now", "my", "such", "make", "over", "our", "even", "most", "me", "state", "after", "also",
    "made", "many", "did", "must", "before", "back", "see", "through", "way", "where", "get",
    "much", "go", "well", "your", "know", "should", "down", "work", "year", "because", "come",
    "people", "just", "each", "these", "those", "how", "two", "use", "same", "long", "good", "day",
    "man", "world", "life", "part", "house", "water", "place", "case", "point", "hand", "high",
    "old", "great", "last", "own", "right", "small", "large", "next", "early", "young",
];

/// The prompt of `request`: `input_length` words (at least one).
pub fn prompt_text(request: &TraceRequest) -> String {
    let mut text = String::with_capacity(request.input_length.max(1) * 6);
    for (key, tokens) in request.chained_blocks() {
        let mut state = key;
        for _ in 0..tokens {
            state = splitmix(state);
            text.push(' ');
            text.push_str(WORDS[(state % WORDS.len() as u64) as usize]);
        }
    }
    if text.is_empty() {
        text.push_str(" hello");
    }
    text
}

/// The ids of `text` under the mock engine's tokenization without a
/// tokenizer: each whitespace-separated word one token (a hash of it). The
/// load generator's frontend mode asks kvroute with these ids.
pub fn word_ids(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| (xxhash_rust::xxh3::xxh3_64(w.as_bytes()) % (1 << 17)) as u32)
        .collect()
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(hash_ids: Vec<u64>, input_length: usize) -> TraceRequest {
        TraceRequest {
            timestamp: 0,
            input_length,
            output_length: 1,
            hash_ids,
        }
    }

    #[test]
    fn shared_blocks_give_shared_text_and_one_word_per_token() {
        let a = prompt_text(&request(vec![1, 2, 3], 3 * 512));
        let b = prompt_text(&request(vec![1, 2, 9], 2 * 512 + 100));
        assert_eq!(a.split(' ').count() - 1, 3 * 512);
        assert_eq!(b.split(' ').count() - 1, 2 * 512 + 100);
        let words = |t: &str| t.split(' ').skip(1).map(str::to_owned).collect::<Vec<_>>();
        let (wa, wb) = (words(&a), words(&b));
        assert_eq!(wa[..1024], wb[..1024], "two shared blocks, shared words");
        assert_ne!(wa[1024..1124], wb[1024..1124], "the third block differs");
        // The same id after another prefix is another block's text.
        let c = prompt_text(&request(vec![7, 2], 2 * 512));
        assert_ne!(words(&c)[512..], wa[512..1024]);
        assert_eq!(prompt_text(&request(vec![], 0)), " hello");
    }
}
