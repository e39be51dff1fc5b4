//! Request bodies, well-formed and hostile.

use super::*;
use serde_json::json;

fn chat(body: Value) -> Result<OpenAiRequest, RequestError> {
    parse(Some(Endpoint::ChatCompletions), body.to_string().as_bytes())
}

fn completion(body: Value) -> Result<OpenAiRequest, RequestError> {
    parse(Some(Endpoint::Completions), body.to_string().as_bytes())
}

#[test]
fn the_fields_that_change_the_prompt_are_read() {
    let r = chat(json!({
        "model": "qwen3", "stream": true, "cache_salt": "tenant-a",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": false},
        "continue_final_message": false,
    }));
    let Ok(r) = r else { panic!("{r:?}") };
    assert_eq!(
        (r.model.as_str(), r.stream, r.cache_salt.as_deref()),
        ("qwen3", true, Some("tenant-a"))
    );
    let Prompt::Chat(read) = r.prompt else {
        panic!()
    };
    assert!(read.tools.is_some() && read.kwargs.is_some() && read.add_generation_prompt);
    // continue_final_message turns the generation prompt off by default
    let r = chat(json!({"model": "m", "continue_final_message": true,
        "messages": [{"role": "assistant", "content": "Once"}]}));
    assert!(matches!(r.map(|r| r.prompt), Ok(Prompt::Chat(c)) if !c.add_generation_prompt));
    let text = |t: &str, special| Prompt::Text {
        text: t.into(),
        add_special_tokens: special,
    };
    assert_eq!(
        completion(json!({"model": "m", "prompt": "text"})).map(|r| r.prompt),
        Ok(text("text", true))
    );
    assert_eq!(
        completion(json!({"model": "m", "prompt": ["a", "b"], "add_special_tokens": false}))
            .map(|r| r.prompt),
        Ok(text("a", false))
    );
    assert_eq!(
        completion(json!({"model": "m", "prompt": [1, 2, 3]})).map(|r| r.prompt),
        Ok(Prompt::TokenIds(vec![1, 2, 3]))
    );
    assert_eq!(
        completion(json!({"model": "m", "prompt": [[7, 8], [9]]})).map(|r| r.prompt),
        Ok(Prompt::TokenIds(vec![7, 8]))
    );
}

#[test]
fn what_cannot_be_tokenized_is_routed_by_load_not_refused() {
    let image = chat(
        json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:"}}]}]}),
    );
    assert_eq!(
        image.map(|r| r.prompt),
        Ok(Prompt::Untokenizable("non-text content parts"))
    );
    let empty = completion(json!({"model": "m", "prompt": []}));
    assert_eq!(
        empty.map(|r| r.prompt),
        Ok(Prompt::Untokenizable("an empty prompt list"))
    );
}

#[test]
fn hostile_bodies_get_their_status_and_nothing_panics() {
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (b"{\"model\": \"m\", \"messages\": [".to_vec(), 400),
        (b"not json".to_vec(), 400),
        (b"[1, 2]".to_vec(), 400),
        (b"".to_vec(), 400),
        (
            json!({"messages": [{"role": "user", "content": "x"}]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            json!({"model": 7, "messages": []}).to_string().into_bytes(),
            400,
        ),
        (
            json!({"model": "m", "messages": "hi"})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            json!({"model": "m", "messages": [{"content": "x"}]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            json!({"model": "m", "messages": [{"role": "user", "content": 5}]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            json!({"model": "m", "messages": [{"role": "user"}], "tools": {}})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            json!({"model": "m", "messages": [{"role": "user"}], "stream": "yes"})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            json!({"model": "m", "messages": [{"role": "user"}], "chat_template_kwargs": []})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            json!({"model": "m", "messages": [{"role": "user"}], "cache_salt": 1})
                .to_string()
                .into_bytes(),
            400,
        ),
        (vec![b'['; 10_000], 400),
        (
            format!(
                "{{\"model\": \"m\", \"x\": {}1{}}}",
                "[".repeat(200),
                "]".repeat(200)
            )
            .into_bytes(),
            400,
        ),
        (vec![b' '; MAX_BODY_BYTES + 1], 413),
    ];
    for (body, status) in cases {
        let got = parse(Some(Endpoint::ChatCompletions), &body);
        assert_eq!(
            got.as_ref().err().map(RequestError::http_status),
            Some(status),
            "{:?}: {got:?}",
            String::from_utf8_lossy(&body[..body.len().min(80)])
        );
    }
    for prompt in [
        json!(5),
        json!({}),
        json!([true]),
        json!([1, -1]),
        json!([1, 4_294_967_296u64]),
        json!([[1, "a"]]),
    ] {
        let got = completion(json!({"model": "m", "prompt": prompt}));
        assert_eq!(
            got.as_ref().err().map(RequestError::http_status),
            Some(400),
            "{got:?}"
        );
    }
}

#[test]
fn large_but_allowed_bodies_are_read() {
    // A 7 MB string and 100,000 messages, under the body limit.
    let long =
        chat(json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(7 << 20)}]}));
    assert!(long.is_ok());
    let many: Vec<Value> = (0..100_000)
        .map(|_| json!({"role": "user", "content": "hi"}))
        .collect();
    let many = chat(json!({"model": "m", "messages": many}));
    assert!(
        matches!(many.map(|r| r.prompt), Ok(Prompt::Chat(c)) if c.messages.as_array().map(Vec::len) == Some(100_000))
    );
}

#[test]
fn endpoints_by_path() {
    assert_eq!(
        Endpoint::of_path("/v1/chat/completions"),
        Some(Endpoint::ChatCompletions)
    );
    assert_eq!(
        Endpoint::of_path("/v1/completions?x=1"),
        Some(Endpoint::Completions)
    );
    assert_eq!(Endpoint::of_path("/v1/embeddings"), None);
}
