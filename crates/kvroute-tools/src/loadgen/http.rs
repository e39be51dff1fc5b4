//! One streamed completion over HTTP/1.1: the request written, the
//! server-sent events read as they arrive, each token's arrival timed.
//!
//! Why our own: the load generator needs the time each event reaches the
//! socket, not when a client library hands it over, and nothing more than
//! a POST and an event stream; one connection per request, as a client
//! that opens a stream per call does. Responses may be sized, chunked or
//! closed at their end; every length is bounded, whatever the server says.

use std::{net::SocketAddr, time::Instant};

use anyhow::{Context, bail};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

/// Most bytes of a response head.
const MAX_HEAD: usize = 64 << 10;
/// Most bytes of one server-sent event.
const MAX_EVENT: usize = 1 << 20;
/// Most bytes of a response body.
const MAX_BODY: u64 = 256 << 20;

/// What the engine's `usage` said.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// `prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
}

/// A streamed response as the client saw it.
#[derive(Debug)]
pub struct Streamed {
    pub status: u16,
    /// When each event carrying generated text arrived.
    pub token_events: Vec<Instant>,
    pub usage: Option<Usage>,
    /// When the response ended.
    pub finished: Instant,
}

/// POSTs `body` (JSON) to `path` at `addr` with `headers` and reads the
/// response to its end.
pub async fn post_streaming(
    addr: SocketAddr,
    path: &str,
    headers: &[(String, String)],
    body: &[u8],
    mut on_first_token: Option<tokio::sync::oneshot::Sender<()>>,
) -> anyhow::Result<Streamed> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let mut conn = BufReader::new(stream);
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         accept: text/event-stream\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    let mut bytes = request.into_bytes();
    bytes.extend_from_slice(body);
    conn.get_mut().write_all(&bytes).await?;

    let (status, framing) = read_head(&mut conn).await?;
    let mut events = EventParser::default();
    let mut streamed = Streamed {
        status,
        token_events: Vec::new(),
        usage: None,
        finished: Instant::now(),
    };
    let mut on_bytes = |bytes: &[u8], streamed: &mut Streamed| -> anyhow::Result<()> {
        for event in events.feed(bytes)? {
            read_event(&event, streamed);
        }
        if !streamed.token_events.is_empty()
            && let Some(first) = on_first_token.take()
        {
            let _ = first.send(());
        }
        Ok(())
    };
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0u64;
    match framing {
        Framing::Length(length) => {
            if length > MAX_BODY {
                bail!("a body of {length} bytes");
            }
            feed(&mut conn, &mut buf, length, &mut |b| {
                on_bytes(b, &mut streamed)
            })
            .await?;
        }
        Framing::Chunked => loop {
            let mut line = String::new();
            (&mut conn).take(1024).read_line(&mut line).await?;
            let size_text = line.trim_end().split(';').next().unwrap_or_default();
            let size = u64::from_str_radix(size_text, 16).context("chunk size")?;
            total += size;
            if total > MAX_BODY {
                bail!("a body over {MAX_BODY} bytes");
            }
            feed(&mut conn, &mut buf, size, &mut |b| {
                on_bytes(b, &mut streamed)
            })
            .await?;
            let mut crlf = [0u8; 2];
            conn.read_exact(&mut crlf).await?;
            if size == 0 {
                break;
            }
        },
        Framing::UntilClose => loop {
            let n = conn.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            total += n as u64;
            if total > MAX_BODY {
                bail!("a body over {MAX_BODY} bytes");
            }
            on_bytes(&buf[..n], &mut streamed)?;
        },
    }
    streamed.finished = Instant::now();
    Ok(streamed)
}

/// Reads exactly `n` bytes through `buf`, handing each read to `on_bytes`
/// as it arrives.
async fn feed(
    conn: &mut BufReader<TcpStream>,
    buf: &mut [u8],
    mut n: u64,
    on_bytes: &mut impl FnMut(&[u8]) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    while n > 0 {
        let want = buf.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        let read = conn.read(&mut buf[..want]).await?;
        if read == 0 {
            bail!("the connection closed mid-body");
        }
        n -= read as u64;
        on_bytes(&buf[..read])?;
    }
    Ok(())
}

/// How the response body ends.
enum Framing {
    Length(u64),
    Chunked,
    UntilClose,
}

async fn read_head(conn: &mut BufReader<TcpStream>) -> anyhow::Result<(u16, Framing)> {
    let mut line = String::new();
    let mut read = (&mut *conn)
        .take(MAX_HEAD as u64)
        .read_line(&mut line)
        .await?;
    let status: u16 = line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status line in {line:?}"))?;
    let mut framing = Framing::UntilClose;
    loop {
        line.clear();
        read += (&mut *conn)
            .take(MAX_HEAD as u64)
            .read_line(&mut line)
            .await?;
        if read > MAX_HEAD {
            bail!("a response head over {MAX_HEAD} bytes");
        }
        let header = line.trim_end();
        if header.is_empty() {
            return Ok((status, framing));
        }
        let Some((name, value)) = header.split_once(':') else {
            bail!("malformed header {header:?}");
        };
        if name.eq_ignore_ascii_case("transfer-encoding")
            && value.to_ascii_lowercase().contains("chunked")
        {
            framing = Framing::Chunked;
        } else if name.eq_ignore_ascii_case("content-length")
            && !matches!(framing, Framing::Chunked)
        {
            framing = Framing::Length(value.trim().parse()?);
        }
    }
}

/// Splits a byte stream into server-sent events' `data` payloads.
#[derive(Default)]
struct EventParser {
    pending: Vec<u8>,
}

impl EventParser {
    fn feed(&mut self, bytes: &[u8]) -> anyhow::Result<Vec<String>> {
        self.pending.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = find_event_end(&self.pending) {
            let (raw, sep) = end;
            let event: Vec<u8> = self.pending.drain(..raw + sep).take(raw).collect();
            let text = String::from_utf8_lossy(&event);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect();
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        if self.pending.len() > MAX_EVENT {
            bail!("a server-sent event over {MAX_EVENT} bytes");
        }
        Ok(events)
    }
}

/// The end of the first event: its length and the separator's.
fn find_event_end(bytes: &[u8]) -> Option<(usize, usize)> {
    let lf = bytes.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Reads one event's data: generated text (completions' `text`, chats'
/// `delta.content`) marks a token event; `usage` is kept.
fn read_event(data: &str, streamed: &mut Streamed) {
    if data == "[DONE]" {
        return;
    }
    let Ok(value) = serde_json::from_str::<serde_json::Value>(data) else {
        return;
    };
    let has_text = value["choices"].as_array().is_some_and(|choices| {
        choices.iter().any(|c| {
            c["text"].as_str().is_some_and(|t| !t.is_empty())
                || c["delta"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
        })
    });
    if has_text {
        streamed.token_events.push(Instant::now());
    }
    let usage = &value["usage"];
    if usage.is_object() {
        streamed.usage = Some(Usage {
            prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
            completion_tokens: usage["completion_tokens"].as_u64().unwrap_or(0),
            cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_split_across_reads_and_text_counted() {
        let mut parser = EventParser::default();
        let stream = b"data: {\"choices\":[{\"text\":\" a\"}]}\n\ndata: {\"choices\":[{\"text\":\"\"}],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\r\n\r\ndata: [DONE]\n\n";
        let mut events = Vec::new();
        for piece in stream.chunks(7) {
            events.extend(parser.feed(piece).expect("bounded"));
        }
        assert_eq!(events.len(), 3);
        let mut streamed = Streamed {
            status: 200,
            token_events: Vec::new(),
            usage: None,
            finished: Instant::now(),
        };
        for event in &events {
            read_event(event, &mut streamed);
        }
        assert_eq!(streamed.token_events.len(), 1, "only events with text");
        assert_eq!(
            streamed.usage,
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: 2,
                cached_tokens: 4
            })
        );
        let mut endless = EventParser::default();
        assert!(endless.feed(&vec![b'x'; MAX_EVENT + 1]).is_err());
    }
}
