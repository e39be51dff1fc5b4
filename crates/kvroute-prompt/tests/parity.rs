//! Token ids against Hugging Face `transformers`, the reference the engines
//! use: every case `scripts/tokenizer_cases.py` generated (chat requests of
//! every kind, with the ids `apply_chat_template` gave, and completion
//! prompts, with the tokenizer's ids) must get exactly the same ids from
//! kvroute-prompt, read as the picker reads them: an OpenAI request body
//! through `request::parse`, then `ModelTokenizer::prompt_ids`. Run by `scripts/tokenizer-parity.sh`,
//! which fetches real tokenizer files and makes the cases; ignored by a
//! plain `cargo test`, which has neither. Also here: the ids-only
//! byte-level encoder against Hugging Face's own path on the same real
//! files, over generated text of every kind.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;

use kvroute_prompt::{Endpoint, ModelTokenizer, request};
use serde_json::json;

fn dir(var: &str) -> PathBuf {
    PathBuf::from(std::env::var_os(var).unwrap_or_else(|| panic!("{var} is not set")))
}

#[test]
#[ignore = "needs real tokenizer files and reference ids: run scripts/tokenizer-parity.sh"]
fn chat_ids_equal_transformers_on_every_generated_case() {
    let cases = dir("KVROUTE_TOKENIZER_CASES");
    let models = dir("KVROUTE_TOKENIZER_MODELS");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&cases)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no cases in {}", cases.display());
    for file in files {
        let family = file.file_stem().unwrap().to_string_lossy().into_owned();
        let model = ModelTokenizer::from_dir(&models.join(&family)).unwrap();
        let mut checked = 0;
        let mut cached_again = 0;
        let mut mismatches = Vec::new();
        for (n, line) in std::fs::read_to_string(&file).unwrap().lines().enumerate() {
            let case: serde_json::Value = serde_json::from_str(line).unwrap();
            let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            let (endpoint, body) = if case["kind"] == "completion" {
                let body = json!({"model": family, "prompt": case["prompt"],
                    "add_special_tokens": case["add_special_tokens"]});
                (Endpoint::Completions, body)
            } else {
                let body = json!({"model": family, "messages": case["messages"],
                    "tools": case["tools"], "add_generation_prompt": case["add_generation_prompt"],
                    "continue_final_message": case["continue_final_message"],
                    "chat_template_kwargs": case["kwargs"]});
                (Endpoint::ChatCompletions, body)
            };
            let parsed = request::parse(Some(endpoint), body.to_string().as_bytes()).unwrap();
            let got = model.prompt_ids(&parsed);
            checked += 1;
            // Again: the same ids, now from the segment cache where a
            // segment is long enough to be kept.
            let (cached_before, _) = model.segment_cache_ids();
            let again = model.prompt_ids(&parsed);
            assert_eq!(
                again.as_ref().ok(),
                got.as_ref().ok(),
                "case {n}: cached ids differ"
            );
            if endpoint == Endpoint::ChatCompletions && got.is_ok() {
                cached_again += model.segment_cache_ids().0 - cached_before;
            }
            match got {
                Ok(ids) if ids == expected => {}
                Ok(ids) => {
                    let at = ids
                        .iter()
                        .zip(&expected)
                        .position(|(a, b)| a != b)
                        .unwrap_or(ids.len().min(expected.len()));
                    mismatches.push(format!(
                        "case {n}: first difference at id {at} of {} (reference {})",
                        ids.len(),
                        expected.len()
                    ));
                }
                Err(error) => mismatches.push(format!("case {n}: {error}")),
            }
        }
        eprintln!("{family}: {checked} cases, {} differ", mismatches.len());
        assert!(
            mismatches.is_empty(),
            "{family}: {} of {checked} differ from transformers:\n{}",
            mismatches.len(),
            mismatches[..mismatches.len().min(10)].join("\n")
        );
        assert!(checked >= 400, "{family}: only {checked} cases");
        assert!(
            cached_again > 0,
            "{family}: the repeated chats found nothing cached"
        );
    }
}

#[test]
#[ignore = "needs real tokenizer files: run scripts/tokenizer-parity.sh"]
fn the_ids_only_encoder_equals_hugging_face_on_real_tokenizers() {
    let models = dir("KVROUTE_TOKENIZER_MODELS");
    for family in ["qwen3", "llama3"] {
        let model = ModelTokenizer::from_dir(&models.join(family)).unwrap();
        assert!(model.has_fast_path(), "{family}: no ids-only encoder");
        let mut g = common::Gen::new(7);
        let mut ids = 0;
        for case in 0..3_000 {
            // Odd cases ASCII only: the split's scan instead of its regex.
            let text = if case % 2 == 1 {
                common::ascii_text(&mut g, 1 + case % 60)
            } else {
                common::text(&mut g, 1 + case % 60)
            };
            let reference = model.reference_ids(&text).unwrap();
            let fast = model.encode(&text, false).unwrap();
            assert_eq!(fast, reference, "{family}, case {case}: {text:?}");
            ids += fast.len();
        }
        eprintln!("{family}: 3000 texts, {ids} ids, all equal");
    }
}

#[test]
#[ignore = "needs real tokenizer files: run scripts/tokenizer-parity.sh"]
fn the_ids_only_encoder_classifies_code_points_as_hugging_face_does() {
    // Scalar values between letters, digits and spaces, in chunks: a
    // character the two regex engines class differently (a letter of a
    // newer Unicode, say) cuts a piece differently and shows here. Every
    // one in a release build (about a minute); every 29th in a debug one.
    let step = if cfg!(debug_assertions) { 29 } else { 1 };
    let models = dir("KVROUTE_TOKENIZER_MODELS");
    for family in ["qwen3", "llama3"] {
        let model = ModelTokenizer::from_dir(&models.join(family)).unwrap();
        let chars: Vec<char> = (0..=0x10FFFFu32)
            .step_by(step)
            .filter_map(char::from_u32)
            .collect();
        for chunk in chars.chunks(256) {
            let mut text = String::new();
            for c in chunk {
                text.extend(['a', *c, 'b', ' ', *c, '1', ' ', *c, *c, ' ', ' ', *c, '\n']);
            }
            assert_eq!(
                model.encode(&text, false).unwrap(),
                model.reference_ids(&text).unwrap(),
                "{family}: between U+{:04X} and U+{:04X}",
                u32::from(chunk[0]),
                u32::from(chunk[chunk.len() - 1])
            );
        }
    }
}
