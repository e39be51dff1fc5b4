//! The ids-only byte-level BPE encoder (`src/bytelevel.rs`) against Hugging
//! Face's own path, on a fresh clone: byte-level BPE tokenizers of each
//! shape the encoder takes (Qwen's split with NFC, Llama 3's with
//! `ignore_merges`, GPT-2's `ByteLevel` regex) are trained here on
//! generated text, then both paths encode other generated text and must
//! give the same ids. The real Qwen3 and Llama 3 files are compared in
//! `parity.rs` (scripts/tokenizer-parity.sh).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;

use kvroute_prompt::ModelTokenizer;
use tokenizers::{
    AddedToken, SplitDelimiterBehavior, Tokenizer,
    models::{TrainerWrapper, bpe::BPE, bpe::BpeTrainer},
    normalizers::NFC,
    pre_tokenizers::{
        PreTokenizerWrapper, byte_level::ByteLevel, sequence::Sequence, split::Split,
        split::SplitPattern,
    },
};

const QWEN_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer trained on generated text, written to its own directory.
fn trained(name: &str, split: Option<&str>, nfc: bool, ignore_merges: bool) -> PathBuf {
    let byte_level = ByteLevel::new(false, false, split.is_none());
    let pre: PreTokenizerWrapper = match split {
        Some(pattern) => Sequence::new(vec![
            Split::new(
                SplitPattern::Regex(pattern.to_owned()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .unwrap()
            .into(),
            byte_level.into(),
        ])
        .into(),
        None => byte_level.into(),
    };
    let mut tokenizer = Tokenizer::new(BPE::default());
    if nfc {
        tokenizer.with_normalizer(Some(NFC));
    }
    tokenizer.with_pre_tokenizer(Some(pre));
    let special = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
        .map(|t| AddedToken::from(t, true))
        .to_vec();
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(4_000)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(special)
        .build()
        .into();
    let mut g = common::Gen::new(1);
    let corpus: Vec<String> = (0..1_500).map(|_| common::text(&mut g, 40)).collect();
    tokenizer.train(&mut trainer, corpus.iter()).unwrap();
    // A non-special added token too, as Qwen3 has `<think>`.
    tokenizer.add_tokens(&[AddedToken::from("<think>", false).normalized(false)]);
    let mut json: serde_json::Value =
        serde_json::from_str(&tokenizer.to_string(false).unwrap()).unwrap();
    json["model"]["ignore_merges"] = ignore_merges.into();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("bytelevel-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    dir
}

fn same_ids_on_generated_text(dir: &std::path::Path, seed: u64) {
    let model = ModelTokenizer::from_dir(dir).unwrap();
    assert!(
        model.has_fast_path(),
        "{}: no ids-only encoder",
        dir.display()
    );
    let mut g = common::Gen::new(seed);
    let mut ids = 0;
    for case in 0..1_500 {
        // Odd cases ASCII only: the split's scan instead of its regex.
        let text = if case % 2 == 1 {
            common::ascii_text(&mut g, 1 + case % 50)
        } else {
            common::text(&mut g, 1 + case % 50)
        };
        let reference = model.reference_ids(&text).unwrap();
        let fast = model.encode(&text, false).unwrap();
        assert_eq!(fast, reference, "{}, case {case}: {text:?}", dir.display());
        // Twice: now the pieces come from the cache.
        assert_eq!(model.encode(&text, false).unwrap(), reference);
        ids += fast.len();
    }
    assert!(ids > 50_000, "only {ids} ids compared");
}

#[test]
fn qwen_shape_with_nfc() {
    same_ids_on_generated_text(&trained("qwen", Some(QWEN_SPLIT), true, false), 2);
}

#[test]
fn llama3_shape_with_ignore_merges() {
    same_ids_on_generated_text(&trained("llama3", Some(LLAMA3_SPLIT), false, true), 3);
}

#[test]
fn gpt2_shape() {
    same_ids_on_generated_text(&trained("gpt2", None, false, false), 4);
}

#[test]
fn other_pipelines_keep_hugging_faces_path() {
    // The committed word-level tokenizer: no ids-only encoder.
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/tokenizer-tiny");
    assert!(!ModelTokenizer::from_dir(&tiny).unwrap().has_fast_path());
    // A byte-level BPE with an added token that strips spaces.
    let dir = trained("lstrip", Some(QWEN_SPLIT), false, false);
    let path = dir.join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["added_tokens"][0]["lstrip"] = true.into();
    std::fs::write(&path, json.to_string()).unwrap();
    let model = ModelTokenizer::from_dir(&dir).unwrap();
    assert!(!model.has_fast_path());
    // Still the reference's ids, by the reference's path.
    let text = "a <|im_start|> b";
    assert_eq!(
        model.encode(text, false).unwrap(),
        model.reference_ids(text).unwrap()
    );
}

#[test]
fn long_chats_tokenized_in_two_halves_equal_the_reference() {
    // A chat past the size at which its segments are tokenized on two
    // threads (and again, from the segment cache): the same ids as the
    // rendered text tokenized whole by Hugging Face.
    let dir = trained("chat", Some(QWEN_SPLIT), true, false);
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template}).to_string(),
    )
    .unwrap();
    let model = ModelTokenizer::from_dir(&dir).unwrap();
    let mut g = common::Gen::new(5);
    let messages: Vec<_> = (0..120)
        .map(|m| {
            let role = if m % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({"role": role, "content": common::text(&mut g, 200)})
        })
        .collect();
    let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
    let request = kvroute_prompt::request::parse(
        Some(kvroute_prompt::Endpoint::ChatCompletions),
        body.as_bytes(),
    )
    .unwrap();
    let kvroute_prompt::Prompt::Chat(chat) = &request.prompt else {
        panic!("not a chat")
    };
    let rendered = model
        .template()
        .unwrap()
        .render(&kvroute_prompt::ChatRequest {
            messages: &chat.messages,
            tools: None,
            add_generation_prompt: true,
            continue_final_message: false,
            kwargs: None,
        })
        .unwrap();
    assert!(rendered.len() > 256 << 10, "{} bytes", rendered.len());
    let reference = model.reference_ids(&rendered).unwrap();
    let (first, cached_first) = model.prompt_ids_counted(&request).unwrap();
    assert_eq!(first, reference);
    assert_eq!(cached_first, 0);
    let (again, cached_again) = model.prompt_ids_counted(&request).unwrap();
    assert_eq!(again, reference);
    assert!(cached_again > reference.len() as u64 / 2, "{cached_again}");
}

#[test]
fn a_piece_past_the_limit_is_refused_not_merged() {
    // One run of letters is one piece: up to the limit it is merged (the
    // reference's ids), past it the text is refused, not merged in memory
    // in proportion to the caller's input.
    let model = ModelTokenizer::from_dir(&trained("long", Some(QWEN_SPLIT), true, false)).unwrap();
    let within = format!("x {} y", "ab".repeat(30_000));
    assert_eq!(
        model.encode(&within, false).unwrap(),
        model.reference_ids(&within).unwrap()
    );
    let past = format!("x {} y", "a".repeat(100_000));
    let error = model.encode(&past, false).unwrap_err().to_string();
    assert!(error.contains("100001 bytes"), "{error}");
}
