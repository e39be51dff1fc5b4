//! The HTTP listeners' connections (metrics, the web view): at most
//! [`MAX_CONNECTIONS`] at once, each closed after [`IDLE_TIMEOUT`] with no
//! byte from the peer.
//!
//! Why: hyper, as axum serves it, keeps a connection that sends half a
//! request forever, at about 37 KB each; 3,000 such connections took
//! kvroute from 22 MB to 133 MB. Past the cap, new connections wait in the
//! kernel's backlog until one closes; an idle one closes by itself, so
//! stalled callers cannot hold the cap either.

use std::{
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use axum::serve::Listener;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Sleep,
};

/// Connections one listener serves at once.
pub const MAX_CONNECTIONS: usize = 1024;
/// A connection with no byte from its peer for this long is closed
/// (Prometheus scrapes every 15-60 s and reconnects as needed).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(75);

/// A listener whose connections are counted and timed.
pub struct Bounded<L> {
    inner: L,
    slots: Arc<Semaphore>,
    idle: Duration,
}

impl<L> Bounded<L> {
    pub fn new(inner: L) -> Self {
        Self::with_limits(inner, MAX_CONNECTIONS, IDLE_TIMEOUT)
    }

    pub fn with_limits(inner: L, connections: usize, idle: Duration) -> Self {
        Self {
            inner,
            slots: Arc::new(Semaphore::new(connections)),
            idle,
        }
    }
}

impl<L: Listener> Listener for Bounded<L> {
    type Io = Counted<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        // Closed never: the semaphore lives as long as the listener.
        let slot = self.slots.clone().acquire_owned().await.ok();
        let (io, addr) = self.inner.accept().await;
        let idle = self.idle;
        (
            Counted {
                io,
                _slot: slot,
                idle,
                deadline: Box::pin(tokio::time::sleep(idle)),
            },
            addr,
        )
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// One connection: its slot held until it is dropped, closed when the peer
/// sends nothing for the idle timeout.
pub struct Counted<T> {
    io: T,
    _slot: Option<OwnedSemaphorePermit>,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                let next = tokio::time::Instant::now() + this.idle;
                this.deadline.as_mut().reset(next);
                Poll::Ready(result)
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no byte from the peer within the idle timeout",
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn connections_past_the_cap_wait_and_idle_ones_close() {
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let mut listener = Bounded::with_limits(tcp, 2, Duration::from_millis(300));
        let _a = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _b = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut first, _) = listener.accept().await;
        let (_second, _) = listener.accept().await;
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        // The third waits: both slots are held.
        let third = tokio::time::timeout(Duration::from_millis(100), listener.accept()).await;
        assert!(third.is_err());
        // The first, idle, times out; its slot frees when it is dropped.
        let mut buf = [0u8; 8];
        let read = first.read(&mut buf).await;
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::TimedOut);
        drop(first);
        let (mut third, _) = tokio::time::timeout(Duration::from_secs(2), listener.accept())
            .await
            .unwrap();
        c.write_all(b"hi").await.unwrap();
        assert_eq!(third.read(&mut buf).await.unwrap(), 2);
    }
}
