//! How fast a model's tokenizer turns text into ids here, fresh and
//! through the segment cache: `cargo run --release -p kvroute-prompt
//! --example tokenize_throughput -- DIR [WORDS]` (DIR holds tokenizer.json
//! and tokenizer_config.json, e.g. ~/.cache/kvroute/tokenizers/qwen3).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use kvroute_prompt::{ModelTokenizer, request};

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().expect("a tokenizer directory");
    let words: usize = args.next().map_or(10_000, |w| w.parse().unwrap());
    let reference = ModelTokenizer::from_dir(std::path::Path::new(&dir))
        .unwrap()
        .with_fast_path(false);
    let model = ModelTokenizer::from_dir(std::path::Path::new(&dir)).unwrap();
    println!("ids-only byte-level encoder: {}", model.has_fast_path());
    let vocabulary = [
        "time", "year", "people", "way", "day", "thing", "world", "school",
    ];
    let text: String = (0..words)
        .map(|i| vocabulary[(i * 7 + i / 3) % vocabulary.len()])
        .collect::<Vec<_>>()
        .join(" ");
    let mut expected = Vec::new();
    for (path, tokenizer) in [("Hugging Face", &reference), ("ids-only", &model)] {
        for pass in ["first", "second"] {
            #[allow(clippy::disallowed_methods)]
            let started = Instant::now();
            let ids = tokenizer.encode(&text, false).unwrap();
            let secs = started.elapsed().as_secs_f64();
            println!(
                "plain text, {path}, {pass}: {} ids in {:.2} ms, {:.0} k ids/s",
                ids.len(),
                secs * 1e3,
                ids.len() as f64 / secs / 1e3
            );
            if expected.is_empty() {
                expected = ids;
            } else {
                assert_eq!(ids, expected, "{path} differs");
            }
        }
    }
    // A chat of messages of 512 words each, then again (all cached).
    let per = 512;
    let messages: Vec<_> = (0..words / 512)
        .map(|m| {
            // Each message its own (a block number first), so the first
            // pass finds nothing cached.
            let words = text
                .split(' ')
                .skip(m * per)
                .take(per)
                .collect::<Vec<_>>()
                .join(" ");
            let content = format!("Block {m}. {words}");
            serde_json::json!({"role": if m % 2 == 0 { "user" } else { "assistant" }, "content": content})
        })
        .collect();
    let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
    #[allow(clippy::disallowed_methods)]
    let started = Instant::now();
    let parsed = request::parse(Some(request::Endpoint::ChatCompletions), body.as_bytes()).unwrap();
    println!(
        "chat, parse a {} KiB body: {:.2} ms",
        body.len() / 1024,
        started.elapsed().as_secs_f64() * 1e3
    );
    if let (Some(template), request::Prompt::Chat(chat)) = (model.template(), &parsed.prompt) {
        let chat = kvroute_prompt::ChatRequest {
            messages: &chat.messages,
            tools: None,
            add_generation_prompt: chat.add_generation_prompt,
            continue_final_message: false,
            kwargs: None,
        };
        #[allow(clippy::disallowed_methods)]
        let started = Instant::now();
        let text = template.render(&chat).unwrap();
        println!(
            "chat, the template alone: {} KiB in {:.2} ms",
            text.len() / 1024,
            started.elapsed().as_secs_f64() * 1e3
        );
    }
    for pass in ["fresh", "cached"] {
        #[allow(clippy::disallowed_methods)]
        let started = Instant::now();
        let (ids, cached) = model.prompt_ids_counted(&parsed).unwrap();
        let secs = started.elapsed().as_secs_f64();
        println!(
            "chat, {pass}: {} ids ({cached} from the cache) in {:.2} ms",
            ids.len(),
            secs * 1e3
        );
    }
}
