//! Each served model's tokenizer, and the LoRA adapters served under names
//! of their own: what turns a request body into the token ids the engine
//! computes, and names the base model and adapter its blocks hash with.
//!
//! Loaded once at start from `--epp-tokenizer` and `--epp-lora`; a
//! directory that does not load stops the start (a picker that silently
//! routes by load only would look healthy and route badly).

use std::{collections::HashMap, sync::Arc};

use kvroute_prompt::{ModelTokenizer, OpenAiRequest, Prompt, PromptError};

use crate::config::{AdapterOf, TokenizerDir};

/// The tokenizers and adapters (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Prompts {
    tokenizers: HashMap<String, Arc<ModelTokenizer>>,
    /// Adapter name -> base model.
    adapters: HashMap<String, String>,
}

/// The model a request names, resolved.
#[derive(Debug)]
pub(crate) struct Served {
    /// The model its workers registered under.
    pub base: String,
    /// The LoRA adapter's name, which the engine hashes its blocks with.
    pub lora_name: Option<String>,
    pub tokenizer: Option<Arc<ModelTokenizer>>,
}

/// A prompt's token ids (and how many came from the tokenizer's segment
/// cache), or why it is routed by load (a metric label).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Tokens {
    Ids { ids: Vec<u32>, cached: u64 },
    ByLoad(&'static str),
}

impl Prompts {
    /// Loads every tokenizer directory; an error names the model and file.
    pub(crate) fn load(
        dirs: &[TokenizerDir],
        adapters: &[AdapterOf],
        cached_ids: usize,
    ) -> Result<Self, String> {
        let mut tokenizers = HashMap::new();
        for TokenizerDir { model, dir } in dirs {
            let tokenizer = ModelTokenizer::from_dir(dir)
                .map_err(|e| format!("--epp-tokenizer {model}={}: {e}", dir.display()))?
                .with_segment_cache(cached_ids);
            if tokenizers
                .insert(model.clone(), Arc::new(tokenizer))
                .is_some()
            {
                return Err(format!("--epp-tokenizer: {model:?} is given twice"));
            }
        }
        let mut by_adapter = HashMap::new();
        for AdapterOf { adapter, base } in adapters {
            if by_adapter.insert(adapter.clone(), base.clone()).is_some() {
                return Err(format!("--epp-lora: {adapter:?} is given twice"));
            }
        }
        Ok(Self {
            tokenizers,
            adapters: by_adapter,
        })
    }

    /// The base model, adapter and tokenizer of a request's `model`.
    pub(crate) fn resolve(&self, model: &str) -> Served {
        let (base, lora_name) = match self.adapters.get(model) {
            Some(base) => (base.clone(), Some(model.to_owned())),
            None => (model.to_owned(), None),
        };
        // An adapter shares its base model's tokenizer unless it has one.
        let tokenizer = self
            .tokenizers
            .get(model)
            .or_else(|| self.tokenizers.get(&base))
            .cloned();
        Served {
            base,
            lora_name,
            tokenizer,
        }
    }
}

/// The token ids of `request` as the engine computes them; a template
/// that fails (a request its own template refuses, one that runs out of
/// fuel, a `continue_final_message` it cannot continue) is the client's
/// error, anything else kvroute cannot tokenize is routed by load.
pub(crate) fn tokenize(
    tokenizer: Option<&ModelTokenizer>,
    request: &OpenAiRequest,
) -> Result<Tokens, PromptError> {
    if let Prompt::TokenIds(ids) = &request.prompt {
        return Ok(Tokens::Ids {
            ids: ids.clone(),
            cached: 0,
        });
    }
    let Some(tokenizer) = tokenizer else {
        return Ok(Tokens::ByLoad("no_tokenizer"));
    };
    match tokenizer.prompt_ids_counted(request) {
        Ok((ids, cached)) => Ok(Tokens::Ids { ids, cached }),
        Err(PromptError::Untokenizable(_)) => Ok(Tokens::ByLoad("untokenizable")),
        Err(PromptError::NoTemplate) => Ok(Tokens::ByLoad("no_template")),
        Err(PromptError::Tokenize(_) | PromptError::Files { .. }) => {
            Ok(Tokens::ByLoad("tokenizer_error"))
        }
        Err(error @ (PromptError::Template(_) | PromptError::FinalMessageMissing)) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_prompt::request::{self, Endpoint};

    #[test]
    fn adapters_route_among_their_base_models_workers() {
        let prompts = Prompts::load(
            &[],
            &[AdapterOf {
                adapter: "sql".into(),
                base: "llama".into(),
            }],
            0,
        )
        .unwrap();
        let served = prompts.resolve("sql");
        assert_eq!(served.base, "llama");
        assert_eq!(served.lora_name.as_deref(), Some("sql"));
        let plain = prompts.resolve("llama");
        assert_eq!((plain.base.as_str(), plain.lora_name), ("llama", None));
    }

    #[test]
    fn a_missing_tokenizer_directory_stops_the_start_naming_it() {
        let error = Prompts::load(
            &[TokenizerDir {
                model: "m".into(),
                dir: "/nonexistent/kvroute-test".into(),
            }],
            &[],
            0,
        )
        .unwrap_err();
        assert!(
            error.contains("--epp-tokenizer m=/nonexistent/kvroute-test"),
            "{error}"
        );
    }

    #[test]
    fn token_ids_need_no_tokenizer_and_text_without_one_goes_by_load() {
        let ids = request::parse(
            Some(Endpoint::Completions),
            br#"{"model":"m","prompt":[1,2,3]}"#,
        )
        .unwrap();
        assert_eq!(
            tokenize(None, &ids).unwrap(),
            Tokens::Ids {
                ids: vec![1, 2, 3],
                cached: 0
            }
        );
        let text = request::parse(
            Some(Endpoint::Completions),
            br#"{"model":"m","prompt":"hi"}"#,
        )
        .unwrap();
        assert_eq!(
            tokenize(None, &text).unwrap(),
            Tokens::ByLoad("no_tokenizer")
        );
    }
}
