//! A minimal HTTP/1.1 client for the binaries that call the gateway — the demo's session and
//! the session-guarantee checker: one request per connection, a JSON body or none, the
//! answer's status, headers and JSON body.
//!
//! Written by hand rather than enabling hyper's client: hyper's `client` feature would change
//! the features of the hyper and axum the gateway is built with, so every build that includes
//! these binaries would recompile them (see docs/DECISIONS.md, "Demo"). A connection per
//! request also means a gateway restart costs a caller one failed request, no more.

use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// A response, read to the end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    /// Header names in lower case, in the order received.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The first header named `name` (compared without regard to case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> anyhow::Result<Value> {
        serde_json::from_slice(&self.body).with_context(|| {
            format!("the {} response body is not JSON: {:?}", self.status, String::from_utf8_lossy(&self.body))
        })
    }
}

/// A client of one server, `host:port`.
#[derive(Clone, Debug)]
pub struct Client {
    address: String,
    timeout: Duration,
}

impl Client {
    /// `timeout` bounds each whole request: connect, send, and read to the end.
    pub fn new(address: &str, timeout: Duration) -> Client {
        Client { address: address.to_string(), timeout }
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> anyhow::Result<Response> {
        self.send("GET", path, headers, None).await
    }

    pub async fn post_json(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> anyhow::Result<Response> {
        self.send("POST", path, headers, Some(body.to_string().into_bytes())).await
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Vec<u8>>,
    ) -> anyhow::Result<Response> {
        let request = encode_request(&self.address, method, path, headers, body.as_deref());
        let exchange = async {
            let mut stream = TcpStream::connect(&self.address).await.context("connecting")?;
            stream.write_all(&request).await.context("sending the request")?;
            let mut raw = Vec::new();
            stream.read_to_end(&mut raw).await.context("reading the response")?;
            parse_response(&raw)
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| anyhow!("no complete answer within {:?}", self.timeout))
            .and_then(|r| r)
            .with_context(|| format!("{method} http://{}{path}", self.address))
    }
}

fn encode_request(host: &str, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> Vec<u8> {
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nAccept: application/json\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body.unwrap_or_default());
    out
}

/// Parses a whole HTTP/1.1 response: status line, headers, and a body delimited by
/// `Content-Length`, by chunked transfer coding, or by the end of the connection.
pub fn parse_response(raw: &[u8]) -> anyhow::Result<Response> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| anyhow!("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..end]).context("the response head is not UTF-8")?;
    let rest = &raw[end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let (version, code) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    if !version.starts_with("HTTP/1.") {
        bail!("not an HTTP/1.x status line: {status_line:?}");
    }
    let status: u16 = code.parse().map_err(|_| anyhow!("bad status code in {status_line:?}"))?;
    let mut headers = Vec::new();
    for line in lines {
        let (name, value) = line.split_once(':').ok_or_else(|| anyhow!("bad header line {line:?}"))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    let response = Response { status, headers, body: Vec::new() };
    let chunked = response.header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        decode_chunked(rest)?
    } else if let Some(length) = response.header("content-length") {
        let length: usize = length.parse().map_err(|_| anyhow!("bad Content-Length {length:?}"))?;
        if rest.len() < length {
            bail!("the body ends after {} of {length} bytes", rest.len());
        }
        rest[..length].to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response { body, ..response })
}

fn decode_chunked(mut rest: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n").ok_or_else(|| anyhow!("truncated chunk size"))?;
        let size_text = std::str::from_utf8(&rest[..line_end]).context("chunk size is not ASCII")?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| anyhow!("bad chunk size {size_text:?}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        if rest.len() < size + 2 || &rest[size..size + 2] != b"\r\n" {
            bail!("truncated chunk");
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(raw: &str, status: u16, body: &str) {
        let r = parse_response(raw.as_bytes()).unwrap();
        assert_eq!(r.status, status, "{raw:?}");
        assert_eq!(String::from_utf8(r.body).unwrap(), body, "{raw:?}");
    }

    #[test]
    fn bodies_are_delimited_by_length_chunks_or_close() {
        check("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", 200, "{}");
        check("HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}trailing", 201, "{}");
        check(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\n{\"a\r\n4;x=y\r\n\":1}\r\n0\r\n\r\n",
            200,
            "{\"a\":1}",
        );
        check("HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\n\r\nuntil close", 503, "until close");
    }

    #[test]
    fn headers_are_found_without_regard_to_case() {
        let r = parse_response(b"HTTP/1.1 201 Created\r\nParsley-Session: abc\r\ncontent-length: 0\r\n\r\n").unwrap();
        assert_eq!(r.header("parsley-session"), Some("abc"));
        assert_eq!(r.header("PARSLEY-SESSION"), Some("abc"));
        assert_eq!(r.header("retry-after"), None);
    }

    #[test]
    fn broken_responses_are_errors() {
        for raw in [
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n{}",
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n",
            "SMTP 220 hello\r\n\r\n",
            "HTTP/1.1 abc OK\r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
        ] {
            assert!(parse_response(raw.as_bytes()).is_err(), "{raw:?}");
        }
    }

    #[test]
    fn requests_carry_host_length_and_close() {
        let r = encode_request("127.0.0.1:1", "POST", "/x", &[("Parsley-Session", "t")], Some(b"{}"));
        let text = String::from_utf8(r).unwrap();
        assert!(text.starts_with("POST /x HTTP/1.1\r\nHost: 127.0.0.1:1\r\nConnection: close\r\n"), "{text}");
        assert!(text.contains("Parsley-Session: t\r\n"), "{text}");
        assert!(text.ends_with("Content-Length: 2\r\n\r\n{}"), "{text}");
    }
}
