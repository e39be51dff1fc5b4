//! A model's chat template, rendered as Hugging Face renders it
//! (`transformers`' `apply_chat_template`, which vLLM and SGLang use):
//! Jinja with `trim_blocks` and `lstrip_blocks`, loop controls, Python's
//! string and list methods, a `tojson` that prints what `json.dumps`
//! prints, `raise_exception`, and the context `messages`, `tools`,
//! `add_generation_prompt`, `bos_token`, `eos_token` plus the request's
//! `chat_template_kwargs`.

use std::collections::BTreeMap;

use minijinja::{Environment, Error, ErrorKind, Value, value::Kwargs};
use serde_json::Map;

use crate::{error::PromptError, pyjson};

/// Template instructions one render may run: far above any real chat
/// template on a long conversation, low enough that a template that loops
/// ends in milliseconds.
const FUEL: u64 = 50_000_000;

/// What a chat request gives the template.
#[derive(Clone, Copy, Debug)]
pub struct ChatRequest<'a> {
    /// The `messages` array as the client sent it.
    pub messages: &'a serde_json::Value,
    /// The `tools` array, if any.
    pub tools: Option<&'a serde_json::Value>,
    pub add_generation_prompt: bool,
    /// Leave the final (assistant) message open: the prompt ends with its
    /// content, as `apply_chat_template(continue_final_message=True)` cuts it.
    pub continue_final_message: bool,
    /// `chat_template_kwargs`: more template variables (`enable_thinking`).
    pub kwargs: Option<&'a Map<String, serde_json::Value>>,
}

/// A compiled chat template with the model's special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

/// A special token as `tokenizer_config.json` gives it: a string, or an
/// object with its `content`.
fn token(config: &serde_json::Value, key: &str) -> String {
    match config.get(key) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// The template of a `tokenizer_config.json`: its `chat_template` string,
/// or the one named `default` in a list of named templates.
pub(crate) fn from_config(config: &serde_json::Value) -> Result<Option<ChatTemplate>, PromptError> {
    let source = match config.get("chat_template") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(named)) => {
            match named.iter().find(|t| t["name"] == "default") {
                Some(t) => t["template"].as_str().unwrap_or_default().to_owned(),
                None => return Ok(None),
            }
        }
        _ => return Ok(None),
    };
    ChatTemplate::new(
        source,
        token(config, "bos_token"),
        token(config, "eos_token"),
    )
    .map(Some)
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    pyjson::dumps(&value, indent)
        .map(Value::from_safe_string)
        .map_err(|why| Error::new(ErrorKind::InvalidOperation, why))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    /// Compiles `source` (Jinja) with the model's special tokens.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self, PromptError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source)
            .map_err(|e| PromptError::Template(e.to_string()))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The model's `bos_token` and `eos_token` (a request's own template
    /// renders with them too).
    pub fn special_tokens(&self) -> (String, String) {
        (self.bos_token.clone(), self.eos_token.clone())
    }

    /// The prompt text of `request`.
    pub fn render(&self, request: &ChatRequest<'_>) -> Result<String, PromptError> {
        // Each part goes into the template's context as it is, not copied
        // into a JSON map first: a long chat's messages are most of a
        // request body.
        let mut context: BTreeMap<String, Value> = BTreeMap::new();
        if let Some(kwargs) = request.kwargs {
            context.extend(
                kwargs
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::from_serialize(v))),
            );
        }
        context.insert("messages".into(), Value::from_serialize(request.messages));
        if let Some(tools) = request.tools {
            context.insert("tools".into(), Value::from_serialize(tools));
        }
        context.insert(
            "add_generation_prompt".into(),
            request.add_generation_prompt.into(),
        );
        context
            .entry("bos_token".into())
            .or_insert_with(|| self.bos_token.as_str().into());
        context
            .entry("eos_token".into())
            .or_insert_with(|| self.eos_token.as_str().into());
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| PromptError::Template(e.to_string()))?;
        // Sized for the whole prompt at once: grown by doubling, a long
        // chat's text was copied a dozen times into fresh pages.
        let mut text = Vec::with_capacity(rendered_size_hint(request.messages));
        template
            .render_captured_to(Value::from(context), &mut text)
            .map_err(|e| PromptError::Template(e.to_string()))?;
        let text = String::from_utf8(text)
            .map_err(|_| PromptError::Template("the template wrote invalid UTF-8".into()))?;
        if request.continue_final_message {
            return cut_after_final_message(text, request.messages);
        }
        Ok(text)
    }
}

/// About the prompt's length: its messages' text and 32 bytes a message
/// for the markers a chat template writes around each (Qwen's take 25).
/// The body held all that text, and its size is bounded, so this is too.
fn rendered_size_hint(messages: &serde_json::Value) -> usize {
    let Some(messages) = messages.as_array() else {
        return 0;
    };
    messages
        .iter()
        .map(|m| match m.get("content") {
            Some(serde_json::Value::String(text)) => text.len() + 32,
            _ => 32,
        })
        .sum()
}

/// Ends the prompt right after the final message's content, as
/// `apply_chat_template(continue_final_message=True)` does: at its last
/// occurrence, or that of its stripped text.
fn cut_after_final_message(
    text: String,
    messages: &serde_json::Value,
) -> Result<String, PromptError> {
    let last = messages
        .as_array()
        .and_then(|m| m.last())
        .map(|m| &m["content"]);
    let content = match last {
        Some(serde_json::Value::String(s)) => s.as_str(),
        Some(serde_json::Value::Array(parts)) => parts
            .last()
            .and_then(|p| p["text"].as_str())
            .unwrap_or_default(),
        _ => return Err(PromptError::FinalMessageMissing),
    };
    for needle in [content, content.trim()] {
        if let Some(at) = text.rfind(needle) {
            let mut text = text;
            text.truncate(at + needle.len());
            return Ok(text);
        }
    }
    Err(PromptError::FinalMessageMissing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: serde_json::Value) -> Result<String, PromptError> {
        let template = ChatTemplate::new(source.into(), "<s>".into(), "</s>".into())?;
        template.render(&ChatRequest {
            messages: &messages,
            tools: None,
            add_generation_prompt: true,
            continue_final_message: false,
            kwargs: None,
        })
    }

    #[test]
    fn whitespace_control_python_methods_and_tojson_as_hugging_face() {
        let source = "{% for m in messages %}\n  {{ bos_token }}{{ m.content.strip().upper() }}|{{ m | tojson }}\n{% endfor %}";
        let text = render(source, json!([{"role": "user", "content": " hé "}]));
        assert_eq!(
            text.ok().as_deref(),
            // what jinja2 gives for the same (lstrip_blocks strips only
            // before block tags)
            Some(r#"  <s>HÉ|{"role": "user", "content": " hé "}"#.to_owned() + "\n").as_deref()
        );
    }

    #[test]
    fn a_template_that_loops_or_raises_is_an_error() {
        let forever = "{% for i in range(100000000) %}{{ i }}{% endfor %}";
        assert!(render(forever, json!([])).is_err());
        let raises = "{{ raise_exception('no system role') }}";
        let error = render(raises, json!([])).err().map(|e| e.to_string());
        assert!(error.is_some_and(|e| e.contains("no system role")));
    }
}
