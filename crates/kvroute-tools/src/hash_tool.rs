//! `kvroute hash`: the local hash of each block of token ids, to debug
//! hash mismatches between frontends, engines and the router.

use std::io::{BufRead, Write};

use kvroute_core::hashing::{HashOptions, compute_block_hashes};

/// Why a tool failed; printed as one line.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("reading stdin: {0}")]
    Read(std::io::Error),
    #[error("writing stdout: {0}")]
    Write(std::io::Error),
    #[error("token {position}: `{text}` is not a token id (an unsigned 32-bit integer)")]
    BadToken { position: usize, text: String },
    #[error("{0}")]
    Oplog(#[from] crate::oplog::OplogError),
}

/// Parses token ids given as whitespace-separated integers or as a JSON array.
pub(crate) fn parse_tokens(text: &str) -> Result<Vec<u32>, ToolError> {
    let trimmed = text.trim();
    let inner = trimmed
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .unwrap_or(trimmed);
    inner
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|t| !t.is_empty())
        .enumerate()
        .map(|(position, text)| {
            text.parse().map_err(|_| ToolError::BadToken {
                position,
                text: text.chars().take(40).collect(),
            })
        })
        .collect()
}

/// `kvroute hash`: one local hash per complete block, unsigned decimal.
pub fn hash(
    block_size: u32,
    lora: Option<&str>,
    namespace: Option<&str>,
    input: &mut dyn BufRead,
    output: &mut dyn Write,
) -> Result<(), ToolError> {
    let mut text = String::new();
    input.read_to_string(&mut text).map_err(ToolError::Read)?;
    let tokens = parse_tokens(&text)?;
    let options = HashOptions {
        lora_name: lora,
        cache_namespace: namespace,
    };
    for hash in compute_block_hashes(&tokens, block_size, &options, None) {
        writeln!(output, "{hash}").map_err(ToolError::Write)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_parse_from_whitespace_or_json() {
        assert_eq!(parse_tokens("1 2\n3").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_tokens("[1, 2,3]").unwrap(), vec![1, 2, 3]);
        assert!(matches!(
            parse_tokens("1 x"),
            Err(ToolError::BadToken { position: 1, .. })
        ));
        assert!(parse_tokens("-1").is_err());
    }

    #[test]
    fn hash_prints_one_line_per_complete_block() {
        let tokens: Vec<String> = (0..40).map(|t| t.to_string()).collect();
        let mut out = Vec::new();
        hash(16, None, None, &mut tokens.join(" ").as_bytes(), &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<u64> = text.lines().map(|l| l.parse().unwrap()).collect();
        let ids: Vec<u32> = (0..40).collect();
        assert_eq!(
            lines,
            compute_block_hashes(&ids, 16, &HashOptions::default(), None)
        );
        assert_eq!(lines.len(), 2);
    }
}
