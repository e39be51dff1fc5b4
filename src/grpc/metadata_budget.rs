//! A bound on what one call's request metadata may hold, answered as a
//! gRPC status. HTTP/2 alone would answer a header list past its limit
//! with HTTP 431, which gRPC clients can only report as UNKNOWN; so the
//! HTTP/2 limit is set higher ([`HTTP2_HEADER_LIST_BYTES`]) and calls past
//! [`MAX_METADATA_BYTES`] are refused here with RESOURCE_EXHAUSTED, the
//! code gRPC gives metadata over a limit, naming the limit.

use tonic::Status;

use crate::security::screen::Screen;

/// Largest request metadata (headers, counted as HTTP/2 counts them: name,
/// value and 32 bytes each) kvroute reads for one call.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;

/// The HTTP/2 header list size kvroute advertises: above
/// [`MAX_METADATA_BYTES`], so that a call between the two is answered with
/// a status naming the limit (a client that respects the setting never
/// sends more).
pub const HTTP2_HEADER_LIST_BYTES: u32 = 64 * 1024;

/// Refuses calls whose metadata is past [`MAX_METADATA_BYTES`], counted.
#[derive(Clone, Debug)]
pub struct MetadataBudget {
    refused: prometheus::IntCounter,
}

impl MetadataBudget {
    pub(crate) fn new(refused: prometheus::IntCounter) -> Self {
        Self { refused }
    }
}

impl Screen for MetadataBudget {
    fn screen(
        &self,
        _path: &str,
        headers: &http::HeaderMap,
        _extensions: &mut http::Extensions,
    ) -> Result<(), Status> {
        let bytes: usize = headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 32)
            .sum();
        if bytes > MAX_METADATA_BYTES {
            self.refused.inc();
            return Err(Status::resource_exhausted(format!(
                "request metadata of {bytes} bytes is over the limit of {MAX_METADATA_BYTES}"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_is_counted_as_http2_counts_it() {
        let refused = prometheus::IntCounter::new("t", "t").unwrap_or_else(|e| panic!("{e}"));
        let budget = MetadataBudget::new(refused.clone());
        let mut headers = http::HeaderMap::new();
        let value = "v".repeat(MAX_METADATA_BYTES - 32 - "x-a".len());
        headers.insert("x-a", value.parse().unwrap_or_else(|e| panic!("{e}")));
        let mut extensions = http::Extensions::new();
        assert!(budget.screen("/p", &headers, &mut extensions).is_ok());
        headers.insert("x-b", http::HeaderValue::from_static(""));
        let refused_status = budget.screen("/p", &headers, &mut extensions);
        assert_eq!(
            refused_status.map_err(|s| s.code()),
            Err(tonic::Code::ResourceExhausted)
        );
        assert_eq!(refused.get(), 1);
    }
}
