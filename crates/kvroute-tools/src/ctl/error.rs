//! Why `ctl` failed, as the one line `main` prints on stderr: every failure
//! of every sub-command is a `CtlError`, so its wording lives in one place.

use kvroute::grpc::rpc_metrics::code_name;

/// Why `ctl` failed; printed as one line.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// The server answered with an error status.
    #[error("{}: {}", code_name(.0.code()), one_line(.0.message()))]
    Status(tonic::Status),
    /// `--addr` is not a usable URI.
    #[error("--addr {addr}: {message}")]
    BadAddr { addr: String, message: String },
    /// No connection could be made.
    #[error("UNAVAILABLE: cannot connect to {addr}: {message}")]
    Connect { addr: String, message: String },
    /// The prompt could not be read.
    #[error("{0}")]
    Prompt(String),
    /// Writing the output failed.
    #[error("writing stdout: {0}")]
    Write(#[from] std::io::Error),
    /// `--ca`, `--cert`, `--key` or `--token` cannot be used.
    #[error("credentials: {0}")]
    Credentials(String),
    /// `ctl health` got an answer other than SERVING.
    #[error("health: {0}")]
    NotServing(String),
    /// The async runtime did not start.
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
}

impl From<tonic::Status> for CtlError {
    fn from(status: tonic::Status) -> Self {
        Self::Status(status)
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// An error and its sources, joined on one line.
pub(super) fn chain(error: &dyn std::error::Error) -> String {
    let mut parts = vec![error.to_string()];
    let mut source = error.source();
    while let Some(next) = source {
        let text = next.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = next.source();
    }
    one_line(&parts.join(": "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_errors_are_one_line_with_the_code_name() {
        let error = CtlError::from(tonic::Status::not_found("worker 9\nis not registered"));
        assert_eq!(error.to_string(), "NOT_FOUND: worker 9 is not registered");
    }
}
