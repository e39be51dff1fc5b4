//! The mock engine's HTTP/1.1 server: requests read with every length
//! bounded (lines, heads, bodies sized or chunked; a body grows only by the
//! bytes that arrive), answers written sized, or
//! chunked for event streams; connections kept alive between requests,
//! as Envoy and OpenAI clients keep them.

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

/// Most bytes of a request head.
pub const MAX_HEAD: usize = 64 << 10;

/// One request as read.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Why a request could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// The connection ended between requests.
    Closed,
    /// The body is over the limit (413).
    TooLarge,
    /// Anything else malformed (400), or an I/O error.
    Bad(String),
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Bad(e.to_string())
    }
}

/// Reads one line of at most `max` bytes: a client that never ends its
/// line cannot make the server hold more.
async fn read_line(
    conn: &mut BufReader<TcpStream>,
    line: &mut String,
    max: usize,
) -> Result<usize, ReadError> {
    let n = (&mut *conn).take(max as u64).read_line(line).await?;
    if n == max && !line.ends_with('\n') {
        return Err(ReadError::Bad(format!("a line over {max} bytes")));
    }
    Ok(n)
}

/// Reads the next request of a connection, its body at most `max_body`.
pub async fn read_request(
    conn: &mut BufReader<TcpStream>,
    max_body: usize,
) -> Result<Request, ReadError> {
    let mut line = String::new();
    if read_line(conn, &mut line, MAX_HEAD).await? == 0 {
        return Err(ReadError::Closed);
    }
    let mut parts = line.split_whitespace();
    let (Some(method), Some(path)) = (parts.next(), parts.next()) else {
        return Err(ReadError::Bad("no request line".into()));
    };
    let (method, path) = (method.to_owned(), path.to_owned());
    let mut headers = Vec::new();
    let mut read = line.len();
    loop {
        line.clear();
        let n = read_line(conn, &mut line, MAX_HEAD).await?;
        read += n;
        if n == 0 || read > MAX_HEAD {
            return Err(ReadError::Bad(
                "the request head is cut short or too long".into(),
            ));
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else {
            return Err(ReadError::Bad(format!("malformed header {header:?}")));
        };
        headers.push((name.trim().to_owned(), value.trim().to_owned()));
    }
    let request = Request {
        method,
        path,
        headers,
        body: Vec::new(),
    };
    let chunked = request
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked {
        read_chunked(conn, max_body).await?
    } else {
        let length = match request.header("content-length") {
            Some(v) => v
                .parse::<usize>()
                .map_err(|_| ReadError::Bad("bad content-length".into()))?,
            None => 0,
        };
        if length > max_body {
            return Err(ReadError::TooLarge);
        }
        // Grown by the bytes that arrive, not by what the header claims.
        let mut body = Vec::new();
        (&mut *conn)
            .take(length as u64)
            .read_to_end(&mut body)
            .await?;
        if body.len() < length {
            return Err(ReadError::Bad("the body is cut short".into()));
        }
        body
    };
    Ok(Request { body, ..request })
}

async fn read_chunked(
    conn: &mut BufReader<TcpStream>,
    max_body: usize,
) -> Result<Vec<u8>, ReadError> {
    let mut body = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if read_line(conn, &mut line, 1024).await? == 0 {
            return Err(ReadError::Bad("bad chunk size line".into()));
        }
        let size_text = line.trim_end().split(';').next().unwrap_or_default();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| ReadError::Bad("bad chunk size".into()))?;
        if size == 0 {
            // Trailers, if any, end with an empty line.
            loop {
                line.clear();
                if read_line(conn, &mut line, MAX_HEAD).await? == 0 || line.trim_end().is_empty() {
                    return Ok(body);
                }
            }
        }
        if body.len().saturating_add(size) > max_body {
            return Err(ReadError::TooLarge);
        }
        let at = body.len();
        (&mut *conn)
            .take(size as u64)
            .read_to_end(&mut body)
            .await?;
        if body.len() < at + size {
            return Err(ReadError::Bad("a chunk is cut short".into()));
        }
        let mut crlf = [0u8; 2];
        conn.read_exact(&mut crlf).await?;
        if crlf != *b"\r\n" {
            return Err(ReadError::Bad("a chunk does not end with CRLF".into()));
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Payload Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

/// Writes a whole response.
pub async fn respond(
    conn: &mut TcpStream,
    status: u16,
    content_type: &str,
    body: &[u8],
) -> anyhow::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
        reason(status),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    conn.write_all(&out).await?;
    Ok(())
}

/// A streamed (chunked) response under way.
pub struct Streaming<'a> {
    conn: &'a mut TcpStream,
}

impl<'a> Streaming<'a> {
    /// Writes the head of a `text/event-stream` response.
    pub async fn start(conn: &'a mut TcpStream) -> anyhow::Result<Self> {
        conn.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n\
              transfer-encoding: chunked\r\n\r\n",
        )
        .await?;
        Ok(Self { conn })
    }

    /// One server-sent event with `data`.
    pub async fn event(&mut self, data: &str) -> anyhow::Result<()> {
        let event = format!("data: {data}\n\n");
        let chunk = format!("{:x}\r\n{event}\r\n", event.len());
        self.conn.write_all(chunk.as_bytes()).await?;
        Ok(())
    }

    /// The end of the stream.
    pub async fn finish(self) -> anyhow::Result<()> {
        self.conn.write_all(b"0\r\n\r\n").await?;
        Ok(())
    }
}

/// Refuses a connection over the limit, politely.
pub async fn refuse_busy(mut conn: TcpStream) {
    let body = br#"{"object":"error","message":"too many connections","type":"ServiceUnavailableError","param":null,"code":503}"#;
    let _ = respond(&mut conn, 503, "application/json", body).await;
}
