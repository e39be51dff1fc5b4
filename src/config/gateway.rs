//! `kvroute serve`'s endpoint picker settings (`crate::gateway` serves
//! them): where Envoy's ext_proc stream comes in, which tokenizer each
//! served model uses, and the bounds on what a request body may make
//! kvroute hold.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, ValueEnum};

use super::limits::parse_bytes;

/// What the endpoint picker does when every candidate is busy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EppAdmission {
    /// Wait for a worker within the stream's time limit (`request_timeout`).
    Wait,
    /// Answer 429 at once.
    Reject,
}

/// A served model's tokenizer directory (`MODEL=DIR`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizerDir {
    pub model: String,
    pub dir: PathBuf,
}

/// A LoRA adapter served under its own model name (`ADAPTER=BASE`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterOf {
    pub adapter: String,
    pub base: String,
}

/// The endpoint picker (Envoy ext_proc, the Gateway API Inference
/// Extension's protocol).
#[derive(Clone, Debug, Args)]
pub struct GatewayOptions {
    /// Serve Envoy's `envoy.service.ext_proc.v3.ExternalProcessor` (the
    /// inference gateway's endpoint picker) and gRPC health on this
    /// address. Unset: no endpoint picker.
    #[arg(long, env = "KVROUTE_EXT_PROC_ADDR")]
    pub ext_proc_addr: Option<SocketAddr>,

    /// A served model's tokenizer (repeatable): `MODEL=DIR`, DIR holding
    /// its `tokenizer.json` and `tokenizer_config.json` (the chat
    /// template). Requests for a model without one are routed by load. In
    /// a config file: `epp_tokenizer = ["MODEL=DIR", ...]`.
    #[arg(long = "epp-tokenizer", value_name = "MODEL=DIR",
          env = "KVROUTE_EPP_TOKENIZER", value_delimiter = ',',
          value_parser = parse_tokenizer_dir)]
    pub epp_tokenizer: Vec<TokenizerDir>,

    /// A LoRA adapter's model name and its base model (repeatable):
    /// `ADAPTER=BASE`. A request naming ADAPTER is routed among BASE's
    /// workers and hashed with the adapter's name, as the engine hashes it.
    #[arg(long = "epp-lora", value_name = "ADAPTER=BASE",
          env = "KVROUTE_EPP_LORA", value_delimiter = ',',
          value_parser = parse_adapter)]
    pub epp_lora: Vec<AdapterOf>,

    /// Largest request body the picker reads, in bytes (suffixes KiB,
    /// MiB); a larger one is answered 413.
    #[arg(long, env = "KVROUTE_EPP_MAX_BODY_BYTES", default_value = "8MiB",
          value_parser = parse_bytes)]
    pub epp_max_body_bytes: u64,

    /// Request bodies all streams may hold at once while they are read, in
    /// bytes; a stream that would pass it is answered 503.
    #[arg(long, env = "KVROUTE_EPP_MAX_BUFFERED_BYTES", default_value = "256MiB",
          value_parser = parse_bytes)]
    pub epp_max_buffered_bytes: u64,

    /// Token ids each model's prompt cache keeps (4 bytes each): a
    /// conversation's earlier turns are not tokenized again while they are
    /// held. 0 turns it off.
    #[arg(long, env = "KVROUTE_EPP_PROMPT_CACHE_TOKENS", default_value_t = 1 << 24)]
    pub epp_prompt_cache_tokens: usize,

    /// When every candidate is busy: `wait` (within `request_timeout`) or
    /// `reject` (429).
    #[arg(
        long,
        env = "KVROUTE_EPP_ADMISSION",
        value_enum,
        default_value = "wait"
    )]
    pub epp_admission: EppAdmission,

    /// A pool file (repeatable): a model's engines found by address or by
    /// a DNS name, registered and subscribed without an agent (see
    /// deploy/pool.example.toml). In a config file: `pool = ["FILE", ...]`.
    #[arg(
        long = "pool",
        value_name = "FILE",
        env = "KVROUTE_POOL",
        value_delimiter = ','
    )]
    pub pool: Vec<PathBuf>,

    /// How often pool files are read again and their DNS names resolved.
    #[arg(long, env = "KVROUTE_POOL_REFRESH_INTERVAL", default_value = "5s",
          value_parser = super::parse_positive_duration)]
    pub pool_refresh_interval: Duration,

    /// Endpoints offered after the chosen one, for Envoy's retries to
    /// walk on to when the first refuses the connection. 0 for an
    /// `ORIGINAL_DST` cluster, which takes one address only.
    #[arg(long, env = "KVROUTE_EPP_FALLBACKS", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(0..=16))]
    pub epp_fallbacks: u32,
}

impl Default for GatewayOptions {
    fn default() -> Self {
        Self {
            ext_proc_addr: None,
            epp_tokenizer: Vec::new(),
            epp_lora: Vec::new(),
            epp_max_body_bytes: 8 << 20,
            epp_max_buffered_bytes: 256 << 20,
            epp_prompt_cache_tokens: 1 << 24,
            epp_admission: EppAdmission::Wait,
            epp_fallbacks: 2,
            pool: Vec::new(),
            pool_refresh_interval: Duration::from_secs(5),
        }
    }
}

fn parse_pair(text: &str, what: &str) -> Result<(String, String), String> {
    let (left, right) = text
        .split_once('=')
        .ok_or_else(|| format!("expected {what}"))?;
    let (left, right) = (left.trim(), right.trim());
    if left.is_empty() || right.is_empty() {
        return Err(format!("expected {what}, both sides non-empty"));
    }
    Ok((left.to_owned(), right.to_owned()))
}

fn parse_tokenizer_dir(text: &str) -> Result<TokenizerDir, String> {
    let (model, dir) = parse_pair(text, "MODEL=DIR")?;
    Ok(TokenizerDir {
        model,
        dir: PathBuf::from(dir),
    })
}

fn parse_adapter(text: &str) -> Result<AdapterOf, String> {
    let (adapter, base) = parse_pair(text, "ADAPTER=BASE")?;
    if adapter == base {
        return Err(format!("the adapter {adapter:?} cannot be its own base"));
    }
    Ok(AdapterOf { adapter, base })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_parse_and_refuse_halves() {
        let dir = parse_tokenizer_dir("Qwen/Qwen3-0.6B=/models/qwen3").unwrap();
        assert_eq!(dir.model, "Qwen/Qwen3-0.6B");
        assert_eq!(dir.dir, PathBuf::from("/models/qwen3"));
        assert!(parse_tokenizer_dir("qwen3").is_err());
        assert!(parse_tokenizer_dir("=dir").is_err());
        assert!(parse_tokenizer_dir("model=").is_err());
        let lora = parse_adapter("sql-lora=llama").unwrap();
        assert_eq!(
            (lora.adapter.as_str(), lora.base.as_str()),
            ("sql-lora", "llama")
        );
        assert!(parse_adapter("same=same").is_err());
    }
}
