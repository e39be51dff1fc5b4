//! Why a prompt could not be made: the model's files, its template, the
//! tokenizer, or a request the template cannot continue.

/// Why a prompt could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("{path}: {why}")]
    Files { path: String, why: String },
    #[error("the model has no chat template")]
    NoTemplate,
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenize(String),
    #[error("continue_final_message: the final message's content is not in the rendered prompt")]
    FinalMessageMissing,
    /// Nothing kvroute can tokenize (the request is routed by load).
    #[error("cannot tokenize: {0}")]
    Untokenizable(&'static str),
}
