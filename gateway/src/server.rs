//! The HTTP/1 server: hyper's connection builder with the bounds `axum::serve` does not
//! offer — a header-read timeout (a client that trickles its request line and headers, or
//! leaves a kept-alive connection idle, is disconnected after `gateway.header_read_timeout_ms`)
//! and a limit on the request line plus headers (`431` beyond `gateway.max_header_bytes`).
//! and a cap on open connections (`gateway.max_connections` on the main listener): at the cap
//! the server stops accepting, so new connections wait in the listening socket's accept
//! queue (its backlog; beyond that the kernel drops or refuses them) until one closes. A
//! body is bounded by `max_body_bytes` and its arrival by `gateway.body_timeout_ms`
//! ([`crate::receive`]). On shutdown it stops accepting, lets every connection finish its
//! request in flight, and returns.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// The connection bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    pub header_read_timeout: Duration,
    pub max_header_bytes: usize,
    /// Most connections open at once (`None`: no cap).
    pub max_connections: Option<usize>,
}

/// Pause after a failed `accept` (out of file descriptors, say) before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `router` on `listener` until `shutdown` turns true (or its sender is dropped),
/// then waits for the connections to finish their requests in flight.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ServerLimits,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(limits.max_header_bytes);
    // Every connection task holds a receiver; the server returns when all are dropped.
    let (open_tx, open_rx) = watch::channel(());
    let slots = limits.max_connections.map(|n| Arc::new(Semaphore::new(n)));
    loop {
        // At the cap, nothing is accepted until a connection closes.
        let slot = match &slots {
            None => None,
            Some(slots) => tokio::select! {
                slot = Arc::clone(slots).acquire_owned() => Some(slot.expect("the semaphore is never closed")),
                _ = shutdown.wait_for(|s| *s) => break,
            },
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.wait_for(|s| *s) => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let connection = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        let mut stop = shutdown.clone();
        let open = open_rx.clone();
        tokio::spawn(async move {
            let mut connection = std::pin::pin!(connection);
            let stopping = tokio::select! {
                result = connection.as_mut() => Some(result),
                _ = stop.wait_for(|s| *s) => None,
            };
            let result = match stopping {
                Some(result) => result,
                None => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = result {
                // Clients hanging up, timeouts, oversized headers: theirs, not ours.
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(slot);
            drop(open);
        });
    }
    drop(listener);
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The bounds, over real sockets on loopback (no other service needed).

    use std::time::Instant;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpStream;

    use super::*;

    async fn start(limits: ServerLimits) -> (std::net::SocketAddr, watch::Sender<bool>, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let router = Router::new().route("/", get(|| async { "ok" }));
        let (stop, shutdown) = watch::channel(false);
        let task = tokio::spawn(async move { serve(listener, router, limits, shutdown).await.unwrap() });
        (address, stop, task)
    }

    /// Everything the server sends until it closes the connection (or 5 s pass).
    async fn read_all(socket: &mut TcpStream) -> String {
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), socket.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    const LIMITS: ServerLimits =
        ServerLimits { header_read_timeout: Duration::from_millis(300), max_header_bytes: 2048, max_connections: None };

    #[tokio::test]
    async fn a_client_that_never_finishes_its_headers_is_disconnected() {
        let (address, stop, task) = start(LIMITS).await;
        let mut socket = TcpStream::connect(address).await.unwrap();
        socket.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: ").await.unwrap();
        let started = Instant::now();
        let answer = read_all(&mut socket).await;
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(250) && waited < Duration::from_secs(3), "closed after {waited:?}");
        assert!(!answer.contains("200 OK"), "{answer}");

        // An idle kept-alive connection is bounded the same way.
        let mut socket = TcpStream::connect(address).await.unwrap();
        socket.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
        let started = Instant::now();
        let answer = read_all(&mut socket).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(started.elapsed() < Duration::from_secs(3), "the idle connection was closed");
        stop.send(true).unwrap();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn oversized_headers_are_refused_with_431() {
        let (address, stop, task) = start(LIMITS).await;
        let mut socket = TcpStream::connect(address).await.unwrap();
        let big = format!("GET / HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n", "x".repeat(4096));
        socket.write_all(big.as_bytes()).await.unwrap();
        let answer = read_all(&mut socket).await;
        assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");

        let mut socket = TcpStream::connect(address).await.unwrap();
        let fits = format!("GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\nX-Fits: {}\r\n\r\n", "x".repeat(1024));
        socket.write_all(fits.as_bytes()).await.unwrap();
        assert!(read_all(&mut socket).await.starts_with("HTTP/1.1 200 OK"));
        stop.send(true).unwrap();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn beyond_the_cap_a_connection_waits_in_the_accept_queue_until_one_closes() {
        let limits = ServerLimits {
            header_read_timeout: Duration::from_secs(30),
            max_header_bytes: 2048,
            max_connections: Some(1),
        };
        let (address, stop, task) = start(limits).await;
        // The first connection takes the one slot and stays open (kept alive).
        let mut first = TcpStream::connect(address).await.unwrap();
        first.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
        let mut answer = [0u8; 256];
        let n = tokio::time::timeout(Duration::from_secs(5), first.read(&mut answer)).await.unwrap().unwrap();
        assert!(answer[..n].starts_with(b"HTTP/1.1 200 OK"), "{}", String::from_utf8_lossy(&answer[..n]));
        // The second is connected by the kernel (the backlog) but not accepted: no answer.
        let mut second = TcpStream::connect(address).await.unwrap();
        second.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").await.unwrap();
        let waited = tokio::time::timeout(Duration::from_millis(500), second.read(&mut answer)).await;
        assert!(waited.is_err(), "answered beyond the cap: {waited:?}");
        // The first closes: the second is accepted and answered.
        drop(first);
        let started = Instant::now();
        assert!(read_all(&mut second).await.starts_with("HTTP/1.1 200 OK"));
        assert!(started.elapsed() < Duration::from_secs(3));
        stop.send(true).unwrap();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn shutdown_lets_the_request_in_flight_finish() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let router = Router::new().route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "done"
            }),
        );
        let (stop, shutdown) = watch::channel(false);
        let server = tokio::spawn(serve(listener, router, LIMITS, shutdown));
        let mut socket = TcpStream::connect(address).await.unwrap();
        socket.write_all(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.send(true).unwrap();
        let answer = read_all(&mut socket).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK") && answer.ends_with("done"), "{answer}");
        tokio::time::timeout(Duration::from_secs(5), server).await.expect("the server stops").unwrap().unwrap();
    }
}
