//! An OpenAI request body as the endpoint picker reads it: which endpoint,
//! which model, and the fields that change the prompt the engine sees
//! (`messages`, `tools`, `chat_template`, `chat_template_kwargs`,
//! `add_generation_prompt`, `continue_final_message` for chat; `prompt` as
//! a string, a list of strings or token ids for completions, and
//! `add_special_tokens`; `cache_salt`).
//!
//! The body is untrusted: its size is checked before it is parsed, JSON
//! nesting past serde_json's limit is an error, and every field of the
//! wrong type is refused by name. A prompt kvroute cannot tokenize (image
//! parts, an empty batch) is not an error: it is routed by load, and the
//! reason says why.

use serde_json::{Map, Value};

/// Largest body read, in bytes (a 100,000-token prompt is well under 1 MB).
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// Which OpenAI endpoint a request is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
}

impl Endpoint {
    /// The endpoint of a request path (`/v1/chat/completions`,
    /// `/v1/completions`, with or without a query string).
    pub fn of_path(path: &str) -> Option<Self> {
        match path.split('?').next().unwrap_or_default() {
            "/v1/chat/completions" => Some(Self::ChatCompletions),
            "/v1/completions" => Some(Self::Completions),
            _ => None,
        }
    }
}

/// Why a body is refused (the picker answers 400, or 413 for its size).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("body of {bytes} bytes is over the limit of {limit}")]
    TooLarge { bytes: usize, limit: usize },
    #[error("body is not JSON: {0}")]
    NotJson(String),
    #[error("body is not a JSON object")]
    NotAnObject,
    #[error("`model` is missing or not a non-empty string")]
    NoModel,
    #[error("`{field}`: {why}")]
    Field {
        field: &'static str,
        why: &'static str,
    },
}

impl RequestError {
    /// The HTTP status the picker answers with.
    pub fn http_status(&self) -> u16 {
        match self {
            Self::TooLarge { .. } => 413,
            _ => 400,
        }
    }
}

/// A chat request's prompt fields.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatPrompt {
    pub messages: Value,
    pub tools: Option<Value>,
    /// The request's own template, in place of the model's.
    pub chat_template: Option<String>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// `chat_template_kwargs`.
    pub kwargs: Option<Map<String, Value>>,
}

/// What the engine's prompt is made from.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// A chat request, rendered with the model's (or the request's) template.
    Chat(Box<ChatPrompt>),
    /// A completion prompt's text (the first of a list: one pick routes
    /// the whole request), with the tokenizer's special tokens unless the
    /// request's `add_special_tokens` is false (vLLM's default and field).
    Text {
        text: String,
        add_special_tokens: bool,
    },
    /// A completion prompt given as token ids.
    TokenIds(Vec<u32>),
    /// Nothing kvroute can tokenize: routed by load.
    Untokenizable(&'static str),
}

/// A request as the picker reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenAiRequest {
    pub model: String,
    pub prompt: Prompt,
    /// `cache_salt`: part of every block hash, as the engine salts them.
    pub cache_salt: Option<String>,
    pub stream: bool,
}

fn field(field: &'static str, why: &'static str) -> RequestError {
    RequestError::Field { field, why }
}

fn flag(
    body: &Map<String, Value>,
    name: &'static str,
    default: bool,
) -> Result<bool, RequestError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(field(name, "must be true or false")),
    }
}

fn optional_string(
    body: &Map<String, Value>,
    name: &'static str,
) -> Result<Option<String>, RequestError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(field(name, "must be a string")),
    }
}

/// Reads the body of a request to `endpoint`; `None` is any other path
/// with a JSON body (embeddings, responses, ...): only its `model` is
/// read, and its prompt is routed by load.
pub fn parse(endpoint: Option<Endpoint>, body: &[u8]) -> Result<OpenAiRequest, RequestError> {
    if body.len() > MAX_BODY_BYTES {
        return Err(RequestError::TooLarge {
            bytes: body.len(),
            limit: MAX_BODY_BYTES,
        });
    }
    let value: Value =
        serde_json::from_slice(body).map_err(|e| RequestError::NotJson(e.to_string()))?;
    let Value::Object(body) = value else {
        return Err(RequestError::NotAnObject);
    };
    let model = match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        _ => return Err(RequestError::NoModel),
    };
    let prompt = match endpoint {
        Some(Endpoint::ChatCompletions) => chat_prompt(&body)?,
        Some(Endpoint::Completions) => completion_prompt(&body)?,
        None => Prompt::Untokenizable("not a completions endpoint"),
    };
    Ok(OpenAiRequest {
        model,
        prompt,
        cache_salt: optional_string(&body, "cache_salt")?,
        stream: flag(&body, "stream", false)?,
    })
}

fn chat_prompt(body: &Map<String, Value>) -> Result<Prompt, RequestError> {
    let messages = match body.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        _ => return Err(field("messages", "must be a non-empty array")),
    };
    for message in messages {
        let Value::Object(message) = message else {
            return Err(field("messages", "each message must be an object"));
        };
        if !matches!(message.get("role"), Some(Value::String(_))) {
            return Err(field("messages", "each message needs a string `role`"));
        }
        match message.get("content") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                if parts
                    .iter()
                    .any(|p| p.get("type").and_then(Value::as_str) != Some("text"))
                {
                    return Ok(Prompt::Untokenizable("non-text content parts"));
                }
            }
            Some(_) => {
                return Err(field(
                    "messages",
                    "`content` must be a string, an array or null",
                ));
            }
        }
    }
    let tools = match body.get("tools") {
        None | Some(Value::Null) => None,
        Some(tools @ Value::Array(_)) => Some(tools.clone()),
        Some(_) => return Err(field("tools", "must be an array")),
    };
    let kwargs = match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => None,
        Some(Value::Object(kwargs)) => Some(kwargs.clone()),
        Some(_) => return Err(field("chat_template_kwargs", "must be an object")),
    };
    let continue_final_message = flag(body, "continue_final_message", false)?;
    Ok(Prompt::Chat(Box::new(ChatPrompt {
        messages: Value::Array(messages.clone()),
        tools,
        chat_template: optional_string(body, "chat_template")?,
        add_generation_prompt: flag(body, "add_generation_prompt", !continue_final_message)?,
        continue_final_message,
        kwargs,
    })))
}

fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect()
}

fn completion_prompt(body: &Map<String, Value>) -> Result<Prompt, RequestError> {
    let wrong = || {
        field(
            "prompt",
            "must be a string, a list of strings, or token ids",
        )
    };
    let add_special_tokens = flag(body, "add_special_tokens", true)?;
    let text = |text: &String| Prompt::Text {
        text: text.clone(),
        add_special_tokens,
    };
    match body.get("prompt") {
        Some(Value::String(t)) => Ok(text(t)),
        Some(Value::Array(items)) => match items.first() {
            None => Ok(Prompt::Untokenizable("an empty prompt list")),
            Some(Value::String(first)) => Ok(text(first)),
            Some(Value::Number(_)) => token_ids(items).map(Prompt::TokenIds).ok_or_else(wrong),
            Some(Value::Array(first)) => token_ids(first).map(Prompt::TokenIds).ok_or_else(wrong),
            Some(_) => Err(wrong()),
        },
        _ => Err(wrong()),
    }
}

#[cfg(test)]
mod tests;
