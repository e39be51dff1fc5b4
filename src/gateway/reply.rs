//! The ext_proc messages the picker sends, as the Endpoint Picker
//! protocol asks: one headers response carrying the destination (header
//! and `envoy.lb` dynamic metadata, with `clear_route_cache`), then the
//! body again in streamed chunks of at most [`MAX_CHUNK`] bytes; or an
//! immediate response with the status the protocol names.

use envoy_types::pb::{
    envoy::{
        config::core::v3::{HeaderValue, HeaderValueOption},
        service::ext_proc::v3::{
            BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse,
            ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
            body_mutation::Mutation, processing_response::Response,
        },
        r#type::v3::HttpStatus,
    },
    google::protobuf::{Struct, Value, value::Kind},
};

/// The request header naming the chosen endpoint (and the fallbacks).
pub(crate) const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The proxy's subset hint: the metadata namespace and key.
pub(crate) const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub(crate) const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The metadata namespace Envoy's load balancers read.
pub(crate) const LB_NAMESPACE: &str = "envoy.lb";
/// The rank header vLLM and SGLang honour.
pub(crate) const DP_RANK: &str = "x-data-parallel-rank";
/// Largest streamed body chunk (the protocol's, below Envoy's 64 KiB).
pub(crate) const MAX_CHUNK: usize = 62_000;

/// Headers a client may send but only the picker may set: removed from
/// every routed request.
const PICKER_OWNED: [&str; 3] = [DESTINATION, SUBSET_KEY, DP_RANK];

/// `HeaderAppendAction::OVERWRITE_IF_EXISTS_OR_ADD`.
const OVERWRITE: i32 = 2;

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: OVERWRITE,
        ..HeaderValueOption::default()
    }
}

fn string(value: impl Into<String>) -> Value {
    Value {
        kind: Some(Kind::StringValue(value.into())),
    }
}

/// Where a routed request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Destination {
    /// `ip:port` of the chosen endpoint first, then the fallbacks.
    pub endpoints: Vec<String>,
    /// The dp rank to pin, for an endpoint that serves several.
    pub dp_rank: Option<u32>,
}

impl Destination {
    pub(crate) fn joined(&self) -> String {
        self.endpoints.join(",")
    }
}

/// The headers response of a routed request whose body (returned after
/// it) is `body_len` bytes.
pub(crate) fn routed(destination: &Destination, body_len: Option<usize>) -> ProcessingResponse {
    let endpoints = destination.joined();
    let mut set_headers = vec![header(DESTINATION, &endpoints)];
    let mut remove_headers: Vec<String> = Vec::new();
    match destination.dp_rank {
        Some(rank) => set_headers.push(header(DP_RANK, &rank.to_string())),
        None => remove_headers.push(DP_RANK.to_owned()),
    }
    if let Some(len) = body_len {
        set_headers.push(header("content-length", &len.to_string()));
    }
    remove_headers.extend(
        PICKER_OWNED
            .iter()
            .filter(|h| **h != DESTINATION && **h != DP_RANK)
            .map(|h| (*h).to_owned()),
    );
    let lb = Struct {
        fields: [(DESTINATION.to_owned(), string(endpoints))].into(),
    };
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers,
                    remove_headers,
                }),
                clear_route_cache: true,
                ..CommonResponse::default()
            }),
        })),
        dynamic_metadata: Some(Struct {
            fields: [(
                LB_NAMESPACE.to_owned(),
                Value {
                    kind: Some(Kind::StructValue(lb)),
                },
            )]
            .into(),
        }),
        ..ProcessingResponse::default()
    }
}

/// The request body returned unchanged, in chunks of at most
/// [`MAX_CHUNK`] bytes, the last marked end of stream.
pub(crate) fn body_chunks(body: &[u8]) -> impl Iterator<Item = ProcessingResponse> + '_ {
    let count = body.len().div_ceil(MAX_CHUNK).max(1);
    (0..count).map(move |i| {
        let start = i * MAX_CHUNK;
        let end = (start + MAX_CHUNK).min(body.len());
        streamed(
            body.get(start..end).unwrap_or_default().to_vec(),
            i + 1 == count,
            true,
        )
    })
}

/// A body chunk passed on: the request's (`request`) or the response's.
pub(crate) fn streamed(body: Vec<u8>, end_of_stream: bool, request: bool) -> ProcessingResponse {
    let answer = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..StreamedBodyResponse::default()
                })),
            }),
            ..CommonResponse::default()
        }),
    };
    ProcessingResponse {
        response: Some(if request {
            Response::RequestBody(answer)
        } else {
            Response::ResponseBody(answer)
        }),
        ..ProcessingResponse::default()
    }
}

/// The response headers, unchanged.
pub(crate) fn response_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse::default())),
        ..ProcessingResponse::default()
    }
}

/// Trailers, unchanged: the request's (`request`) or the response's.
pub(crate) fn trailers(request: bool) -> ProcessingResponse {
    let answer = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            Response::RequestTrailers(answer)
        } else {
            Response::ResponseTrailers(answer)
        }),
        ..ProcessingResponse::default()
    }
}

/// An answer the picker gives itself: `status` with an OpenAI-style error
/// body.
pub(crate) fn immediate(status: u16, message: &str) -> ProcessingResponse {
    let kind = match status {
        400 | 413 => "invalid_request_error",
        429 => "rate_limit_exceeded",
        _ => "service_unavailable",
    };
    let body = format!(
        r#"{{"error":{{"message":{},"type":"{kind}","code":{status}}}}}"#,
        json_string(message)
    );
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![header("content-type", "application/json")],
                remove_headers: Vec::new(),
            }),
            body: body.into_bytes(),
            details: format!("kvroute_epp_{status}"),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}

/// `text` as a JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk_of(response: &ProcessingResponse) -> (usize, bool) {
        let Some(Response::RequestBody(BodyResponse {
            response: Some(common),
        })) = &response.response
        else {
            panic!("not a request body answer: {response:?}");
        };
        let Some(Mutation::StreamedResponse(streamed)) = common
            .body_mutation
            .as_ref()
            .and_then(|m| m.mutation.as_ref())
        else {
            panic!("not streamed");
        };
        (streamed.body.len(), streamed.end_of_stream)
    }

    #[test]
    fn bodies_go_back_in_chunks_of_at_most_62000_bytes() {
        let body = vec![b'x'; 130_001];
        let chunks: Vec<_> = body_chunks(&body).map(|c| chunk_of(&c)).collect();
        assert_eq!(chunks, [(62_000, false), (62_000, false), (6_001, true)]);
        let empty: Vec<_> = body_chunks(&[]).map(|c| chunk_of(&c)).collect();
        assert_eq!(empty, [(0, true)]);
        let exact: Vec<_> = body_chunks(&body[..62_000]).map(|c| chunk_of(&c)).collect();
        assert_eq!(exact, [(62_000, true)]);
    }

    #[test]
    fn the_destination_is_in_the_header_and_the_lb_metadata_alike() {
        let destination = Destination {
            endpoints: vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()],
            dp_rank: Some(3),
        };
        let response = routed(&destination, Some(42));
        let Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })) = &response.response
        else {
            panic!("not a headers answer");
        };
        assert!(common.clear_route_cache);
        let mutation = common.header_mutation.as_ref().unwrap();
        let set: Vec<(String, String)> = mutation
            .set_headers
            .iter()
            .map(|h| {
                let h = h.header.as_ref().unwrap();
                (
                    h.key.clone(),
                    String::from_utf8(h.raw_value.clone()).unwrap(),
                )
            })
            .collect();
        assert!(set.contains(&(DESTINATION.into(), "10.0.0.1:8000,10.0.0.2:8000".into())));
        assert!(set.contains(&(DP_RANK.into(), "3".into())));
        assert!(set.contains(&("content-length".into(), "42".into())));
        assert!(mutation.remove_headers.contains(&SUBSET_KEY.to_owned()));
        let lb = &response.dynamic_metadata.as_ref().unwrap().fields[LB_NAMESPACE];
        let Some(Kind::StructValue(lb)) = &lb.kind else {
            panic!("envoy.lb is not a struct");
        };
        assert_eq!(
            lb.fields[DESTINATION].kind,
            Some(Kind::StringValue("10.0.0.1:8000,10.0.0.2:8000".into()))
        );
        // Without a rank, a client's own rank header is removed.
        let response = routed(
            &Destination {
                endpoints: vec!["10.0.0.1:8000".into()],
                dp_rank: None,
            },
            None,
        );
        let Some(Response::RequestHeaders(h)) = &response.response else {
            panic!()
        };
        let mutation = h
            .response
            .as_ref()
            .unwrap()
            .header_mutation
            .as_ref()
            .unwrap();
        assert!(mutation.remove_headers.contains(&DP_RANK.to_owned()));
    }

    #[test]
    fn immediate_answers_carry_a_json_error() {
        let response = immediate(400, "bad \"body\"\n");
        let Some(Response::ImmediateResponse(answer)) = &response.response else {
            panic!()
        };
        assert_eq!(answer.status.as_ref().unwrap().code, 400);
        let body: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
        assert_eq!(body["error"]["message"], "bad \"body\"\n");
        assert_eq!(body["error"]["code"], 400);
    }
}
