//! Prompts as the engine sees them (issue #33, the endpoint picker): an
//! OpenAI chat request is rendered with the model's own chat template and
//! tokenized with its own tokenizer, so the token ids (and so the block
//! hashes) are the ones the engine computes and reports in its KV events.
//!
//! Why a crate of its own: the tokenizer and template engines are large and
//! only the front door needs them; the routing domain (`kvroute-core`)
//! stays free of them. Invariants:
//! * the ids equal Hugging Face `transformers`' `apply_chat_template(...,
//!   tokenize=True)` for the same files and request (the parity test);
//! * a template cannot run forever or without bound: rendering has fuel,
//!   and a template's own `raise_exception` is an error, never a panic.

mod bytelevel;
mod error;
mod pyjson;
pub mod request;
mod segments;
pub mod template;

use std::path::Path;

pub use error::PromptError;
pub use request::{ChatPrompt, Endpoint, OpenAiRequest, Prompt, RequestError};
pub use segments::DEFAULT_CACHED_IDS;
pub use template::{ChatRequest, ChatTemplate};

/// A served model's tokenizer and chat template, from the two files
/// Hugging Face keeps in a model's directory.
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// The ids-only encoder, where the tokenizer is byte-level BPE
    /// (`bytelevel.rs`); `None`: Hugging Face's own path.
    fast: Option<bytelevel::ByteLevelBpe>,
    template: Option<ChatTemplate>,
    /// Rendered chats are tokenized in cached segments (`segments.rs`).
    segments: segments::Segments,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("template", &self.template.is_some())
            .field("fast", &self.fast.is_some())
            .finish_non_exhaustive()
    }
}

impl ModelTokenizer {
    /// Loads `tokenizer.json` and, if present, `tokenizer_config.json`
    /// (its `chat_template`, `bos_token`, `eos_token`) from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, PromptError> {
        let files = |path: &Path, why: String| PromptError::Files {
            path: path.display().to_string(),
            why,
        };
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer_text = std::fs::read_to_string(&tokenizer_path)
            .map_err(|e| files(&tokenizer_path, e.to_string()))?;
        let tokenizer: tokenizers::Tokenizer = tokenizer_text
            .parse()
            .map_err(|e: tokenizers::Error| files(&tokenizer_path, e.to_string()))?;
        let fast = serde_json::from_str(&tokenizer_text)
            .ok()
            .and_then(|json| bytelevel::ByteLevelBpe::from_json(&json));
        drop(tokenizer_text);
        let config_path = dir.join("tokenizer_config.json");
        let template = match std::fs::read_to_string(&config_path) {
            Ok(text) => {
                let config: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| files(&config_path, e.to_string()))?;
                template::from_config(&config).map_err(|e| files(&config_path, e.to_string()))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(files(&config_path, e.to_string())),
        };
        let segments = segments::Segments::new(&tokenizer, DEFAULT_CACHED_IDS);
        Ok(Self {
            tokenizer,
            fast,
            template,
            segments,
        })
    }

    /// The same tokenizer with a segment cache of at most `cached_ids`
    /// ids (0: none).
    pub fn with_segment_cache(mut self, cached_ids: usize) -> Self {
        self.segments = segments::Segments::new(&self.tokenizer, cached_ids);
        self
    }

    /// The same tokenizer on Hugging Face's own path only (`false`), or
    /// with the ids-only encoder where it applies (`true`, the default):
    /// for comparing the two.
    pub fn with_fast_path(mut self, on: bool) -> Self {
        if !on {
            self.fast = None;
        }
        self
    }

    /// Whether the ids-only byte-level BPE encoder serves this model.
    pub fn has_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// Ids served from the segment cache, and ids of rendered chats in
    /// all, since the start.
    pub fn segment_cache_ids(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let stats = &self.segments.stats;
        (
            stats.cached_ids.load(Relaxed),
            stats.total_ids.load(Relaxed),
        )
    }

    /// The chat template, if the model has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The ids of a chat request: its rendered template, tokenized without
    /// adding special tokens (the template writes them), as
    /// `apply_chat_template(..., tokenize=True)` does.
    pub fn chat_ids(&self, request: &ChatRequest<'_>) -> Result<Vec<u32>, PromptError> {
        let template = self.template.as_ref().ok_or(PromptError::NoTemplate)?;
        let text = template.render(request)?;
        Ok(self
            .segments
            .encode(&text, |piece| self.encode_plain(piece))?
            .0)
    }

    /// The token ids the engine computes for `request`: its chat rendered
    /// with the request's `chat_template` or the model's, its completion
    /// text tokenized, or its token ids as given.
    pub fn prompt_ids(&self, request: &OpenAiRequest) -> Result<Vec<u32>, PromptError> {
        self.prompt_ids_counted(request).map(|(ids, _)| ids)
    }

    /// [`Self::prompt_ids`], and how many of the ids came from the segment
    /// cache (a chat's earlier turns).
    pub fn prompt_ids_counted(
        &self,
        request: &OpenAiRequest,
    ) -> Result<(Vec<u32>, u64), PromptError> {
        match &request.prompt {
            Prompt::Chat(prompt) => {
                let chat = ChatRequest {
                    messages: &prompt.messages,
                    tools: prompt.tools.as_ref(),
                    add_generation_prompt: prompt.add_generation_prompt,
                    continue_final_message: prompt.continue_final_message,
                    kwargs: prompt.kwargs.as_ref(),
                };
                let text = match (&prompt.chat_template, &self.template) {
                    (Some(source), model) => {
                        let (bos, eos) = model
                            .as_ref()
                            .map(|t| t.special_tokens())
                            .unwrap_or_default();
                        ChatTemplate::new(source.clone(), bos, eos)?.render(&chat)?
                    }
                    (None, Some(template)) => template.render(&chat)?,
                    (None, None) => return Err(PromptError::NoTemplate),
                };
                self.segments
                    .encode(&text, |piece| self.encode_plain(piece))
            }
            Prompt::Text {
                text,
                add_special_tokens,
            } => Ok((self.encode(text, *add_special_tokens)?, 0)),
            Prompt::TokenIds(ids) => Ok((ids.clone(), 0)),
            Prompt::Untokenizable(why) => Err(PromptError::Untokenizable(why)),
        }
    }

    /// The ids of `text`; `add_special_tokens` as the tokenizer's own
    /// post-processor adds them (a completion prompt).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        if !add_special_tokens {
            return self.encode_plain(text);
        }
        self.hugging_face_ids(text, true)
    }
}

impl ModelTokenizer {
    /// The ids of `text` with no special tokens added: by the ids-only
    /// encoder where there is one, else by Hugging Face's path.
    fn encode_plain(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        let Some(fast) = &self.fast else {
            return self.hugging_face_ids(text, false);
        };
        fast.encode(text, |piece| {
            use tokenizers::Normalizer;
            let Some(normalizer) = self.tokenizer.get_normalizer() else {
                return Ok(piece.to_owned());
            };
            let mut normalized = tokenizers::NormalizedString::from(piece);
            normalizer
                .normalize(&mut normalized)
                .map_err(|e| PromptError::Tokenize(e.to_string()))?;
            Ok(normalized.get().to_owned())
        })
    }

    /// Hugging Face's ids for `text` (no special tokens added), whatever
    /// encoder serves the model: the reference the fast path is tested
    /// against.
    pub fn reference_ids(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        self.hugging_face_ids(text, false)
    }

    /// The ids of `text` by the `tokenizers` pipeline.
    fn hugging_face_ids(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, PromptError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| PromptError::Tokenize(e.to_string()))
    }
}
