//! What one listener lets its peers hold: connections, time to start speaking HTTP, and memory
//! in partly received gRPC messages ([`ConnectionLimits`]), enforced by
//! [`crate::server::serve_http`]; and how large one gRPC message may be ([`MessageLimits`]),
//! checked against each message's length prefix before any of it is buffered.
//!
//! Without them a peer that opens connections and stays silent keeps file descriptors until
//! the process can accept nothing more (`EMFILE`), and a peer that starts many large messages
//! and never finishes them makes the server buffer each one up to the message size limit: HTTP/2
//! flow control does not bound this, because tonic takes every received byte out of the
//! connection's window into its own buffer until the message is whole (150 such streams on one
//! connection held 600 MB before these limits).

use std::error::Error;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The largest registry answer a Reach client decodes (ListInstances, a Watch snapshot
/// part), in bytes: 64 MiB, about 600,000 instances of ordinary size (107 bytes each
/// without descriptors, docs/scaling.md). gRPC's default of 4 MiB is past at about 40,000.
pub const REGISTRY_LIST_BYTES: usize = 64 << 20;

/// How long in-flight calls may run after shutdown begins, by default.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);

/// Counter: connections a listener closed because of a limit, by `reason`
/// (`max_connections`, `max_connections_per_peer`, `idle_evicted`, `handshake_timeout`) and
/// `listener` (its local address).
pub const CONNECTIONS_REFUSED: &str = "reach_server_connections_refused_total";
/// Gauge: connections a listener is serving, by `listener` (its local address).
pub const OPEN_CONNECTIONS: &str = "reach_server_open_connections";
/// Counter: gRPC requests and streams failed with `RESOURCE_EXHAUSTED` because a message in
/// progress would have taken a connection or listener past its buffer budget, by `listener`.
pub const BUFFER_REFUSALS: &str = "reach_server_buffer_refusals_total";

/// The length of the HTTP/2 client connection preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`,
/// RFC 9113 §3.4), in bytes: a new connection must have sent this many bytes within
/// [`ConnectionLimits::handshake_timeout`].
pub const PREFACE_BYTES: usize = 24;

/// The shortest [`ConnectionLimits::handshake_timeout`] accepted.
pub const MIN_HANDSHAKE_TIMEOUT: Duration = Duration::from_millis(100);

/// Limits one listener enforces on its connections; the `[server]` section of the `reach`
/// configuration. Every field has a default that suits a router in front of production agents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConnectionLimits {
    /// Connections served at once. A connection accepted at the limit takes the place of the
    /// open connection that has been idle longest (no request or stream in progress: one
    /// still in its TLS handshake, one trickling its request headers, one between requests),
    /// which is closed (counted in [`CONNECTIONS_REFUSED`] as `idle_evicted`), so a flood of
    /// idle or slow connections cannot keep a probe out; when every open connection has a
    /// request in progress, the new one is closed at once instead: the peer sees the
    /// connection end before any response (grpcio reports `UNAVAILABLE`, tonic `UNAVAILABLE`
    /// or `CANCELLED`, depending on when it notices) and may try another replica; counted as
    /// `max_connections`. Keep it below the process's open-file limit (`ulimit -n`) minus the
    /// connections it opens itself. Default 10 000.
    pub max_connections: usize,
    /// Connections one peer address (IP, whatever the port) may hold at once; 0 for no limit
    /// of its own. A connection accepted at it takes the place of that peer's longest-idle
    /// connection (`idle_evicted`), or is closed at once when all of the peer's connections
    /// are busy (`max_connections_per_peer`). Peers behind one address (a NAT, a sidecar
    /// proxy, the kubelet's probes) share it, so leave room for them. Default 0 (none) on
    /// the gRPC listener.
    pub max_connections_per_peer: usize,
    /// How long a new connection may take to send its first [`PREFACE_BYTES`] bytes (the
    /// HTTP/2 preface, or the start of an HTTP/1.1 request) before it is closed. Bounds what
    /// a silent or trickling peer costs; after the preface, a peer that stops answering is
    /// closed by the HTTP/2 keepalive ([`crate::http2::KEEPALIVE_INTERVAL`] +
    /// [`crate::http2::KEEPALIVE_TIMEOUT`], 50 s) or, over HTTP/1.1, after
    /// [`ConnectionLimits::header_read_timeout`] without complete headers. With TLS the
    /// handshake counts too. At least [`MIN_HANDSHAKE_TIMEOUT`]. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// How long an HTTP/1.1 connection may take to send a request's headers, counted from
    /// when the server starts waiting for them (so it also closes a keep-alive connection idle
    /// that long between requests). At least [`MIN_HANDSHAKE_TIMEOUT`]. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Streams (calls) one HTTP/2 connection may have open at once (`SETTINGS_MAX_CONCURRENT_STREAMS`);
    /// a client opens more on other connections or waits. At least 1. Default 200.
    pub http2_max_concurrent_streams: u32,
    /// Bytes of partly received gRPC messages one connection may hold at once, across its
    /// streams. A message that would take the connection past it fails its call or stream with
    /// `RESOURCE_EXHAUSTED`; messages that arrive whole in one read do not count. Must be at
    /// least the largest message accepted. Default 64 MiB.
    pub max_buffered_bytes_per_connection: usize,
    /// The same budget across all of the listener's connections, which bounds the memory all
    /// peers together can pin. Default 1 GiB.
    pub max_buffered_bytes: usize,
    /// How long in-flight calls and open streams may run once shutdown begins before their
    /// connections are closed: what the listener adds to a process's exit, whatever its peers
    /// do (idle, silent, streaming without end, or no longer reading). Default 10 s
    /// ([`DEFAULT_GRACE`]).
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            max_connections_per_peer: 0,
            handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(30),
            http2_max_concurrent_streams: 200,
            max_buffered_bytes_per_connection: 64 * 1024 * 1024,
            max_buffered_bytes: 1024 * 1024 * 1024,
            shutdown_grace: DEFAULT_GRACE,
        }
    }
}

impl ConnectionLimits {
    /// Checks the limits, given the largest message a service on the listener accepts
    /// (`max_message_bytes`, in bytes, set by the setting named `message_limit_key`).
    ///
    /// # Errors
    /// The first [`LimitsError`] found, naming the `server.*` setting to fix and how.
    pub fn validate(
        &self,
        max_message_bytes: usize,
        message_limit_key: &str,
    ) -> Result<(), LimitsError> {
        if self.max_connections == 0 {
            return Err(LimitsError::NoConnections);
        }
        if self.handshake_timeout < MIN_HANDSHAKE_TIMEOUT {
            return Err(LimitsError::HandshakeTimeoutTooShort {
                value: self.handshake_timeout,
            });
        }
        if self.header_read_timeout < MIN_HANDSHAKE_TIMEOUT {
            return Err(LimitsError::HeaderReadTimeoutTooShort {
                value: self.header_read_timeout,
            });
        }
        if self.http2_max_concurrent_streams == 0 {
            return Err(LimitsError::NoStreams);
        }
        if self.max_buffered_bytes_per_connection < max_message_bytes {
            return Err(LimitsError::ConnectionBudgetBelowMessageLimit {
                value: self.max_buffered_bytes_per_connection,
                max_message_bytes,
                message_limit_key: message_limit_key.to_string(),
            });
        }
        if self.max_buffered_bytes < self.max_buffered_bytes_per_connection {
            return Err(LimitsError::ListenerBudgetBelowConnectionBudget {
                value: self.max_buffered_bytes,
                per_connection: self.max_buffered_bytes_per_connection,
            });
        }
        Ok(())
    }
}

/// A `[server]` setting that cannot work, from [`ConnectionLimits::validate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitsError {
    /// `server.max_connections` is 0.
    #[error("server.max_connections is 0; it must be at least 1")]
    NoConnections,
    /// `server.handshake_timeout` is below [`MIN_HANDSHAKE_TIMEOUT`].
    #[error(
        "server.handshake_timeout is {value:?}; it must be at least {MIN_HANDSHAKE_TIMEOUT:?} (a loaded client needs that long to send its first bytes), such as \"10s\""
    )]
    HandshakeTimeoutTooShort {
        /// The configured timeout.
        value: Duration,
    },
    /// `server.header_read_timeout` is below [`MIN_HANDSHAKE_TIMEOUT`].
    #[error(
        "server.header_read_timeout is {value:?}; it must be at least {MIN_HANDSHAKE_TIMEOUT:?} (a client needs that long to send its request headers), such as \"30s\""
    )]
    HeaderReadTimeoutTooShort {
        /// The configured timeout.
        value: Duration,
    },
    /// `server.http2_max_concurrent_streams` is 0.
    #[error("server.http2_max_concurrent_streams is 0; it must be at least 1, such as 200")]
    NoStreams,
    /// `server.max_buffered_bytes_per_connection` is below the largest message accepted.
    #[error(
        "server.max_buffered_bytes_per_connection is {value} bytes, less than the largest message accepted ({max_message_bytes} bytes, {message_limit_key}), so such a message could never be received; raise it to at least {max_message_bytes}"
    )]
    ConnectionBudgetBelowMessageLimit {
        /// The configured budget, in bytes.
        value: usize,
        /// The largest message accepted, in bytes.
        max_message_bytes: usize,
        /// The setting that sets `max_message_bytes`.
        message_limit_key: String,
    },
    /// `server.max_buffered_bytes` is below `server.max_buffered_bytes_per_connection`.
    #[error(
        "server.max_buffered_bytes ({value}) is less than server.max_buffered_bytes_per_connection ({per_connection}); the listener-wide budget must be at least one connection's"
    )]
    ListenerBudgetBelowConnectionBudget {
        /// The configured listener budget, in bytes.
        value: usize,
        /// The configured per-connection budget, in bytes.
        per_connection: usize,
    },
}

impl LimitsError {
    /// The setting to fix (`server.max_connections`, ...).
    pub fn key(&self) -> &'static str {
        match self {
            Self::NoConnections => "server.max_connections",
            Self::HandshakeTimeoutTooShort { .. } => "server.handshake_timeout",
            Self::HeaderReadTimeoutTooShort { .. } => "server.header_read_timeout",
            Self::NoStreams => "server.http2_max_concurrent_streams",
            Self::ConnectionBudgetBelowMessageLimit { .. } => {
                "server.max_buffered_bytes_per_connection"
            }
            Self::ListenerBudgetBelowConnectionBudget { .. } => "server.max_buffered_bytes",
        }
    }
}

/// The largest gRPC message a service accepts when it was given no limit of its own, in bytes:
/// tonic's default decoding limit (4 MiB).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// The largest request message, in bytes (the gRPC length prefix's value), each service of a
/// listener accepts. A message whose prefix declares more is refused as soon as its 5-byte
/// prefix has arrived, before any of it is buffered, with `RESOURCE_EXHAUSTED` and ErrorInfo
/// `PAYLOAD_TOO_LARGE` (`size_bytes`, `limit_bytes`), whatever its size; tonic's own decoder
/// would answer `OUT_OF_RANGE` past its limit, so every service's tonic limit must be at
/// least its limit here (which holds when neither is set: both are
/// [`DEFAULT_MAX_MESSAGE_BYTES`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MessageLimits {
    /// Limits by full service name (`reach.v1.RouterService`).
    by_service: std::collections::HashMap<String, PrefixLimit>,
    /// Services the server serves (with or without a limit of their own).
    known: std::collections::HashSet<String>,
    /// The limit of paths no known service claims (a fallback service's), when set.
    fallback: Option<PrefixLimit>,
}

/// A gRPC message size limit as checked against each message's 5-byte length prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixLimit {
    /// Messages whose prefix declares more bytes than this are refused before any of them
    /// is read.
    pub refuse_above: usize,
    /// The limit a refusal names (`limit_bytes`, and in its message), in bytes: the
    /// service's own limit. It is below `refuse_above` when the service reads the messages
    /// in between and refuses them itself, with the same reason (the router does, so that
    /// one oversized call on a shared `CallMux` stream fails alone).
    pub named: usize,
}

impl PrefixLimit {
    /// Refuses above `max_message_bytes` and names it.
    pub fn exact(max_message_bytes: usize) -> Self {
        Self {
            refuse_above: max_message_bytes,
            named: max_message_bytes,
        }
    }
}

impl MessageLimits {
    /// Sets the limit of `service` (its full name), in bytes.
    pub fn set(&mut self, service: &str, max_message_bytes: usize) {
        self.set_prefix_limit(service, PrefixLimit::exact(max_message_bytes));
    }

    /// Sets the limit of `service` (its full name) as a [`PrefixLimit`].
    pub fn set_prefix_limit(&mut self, service: &str, limit: PrefixLimit) {
        self.by_service.insert(service.to_string(), limit);
    }

    /// Sets the limit of paths no known service claims (they go to a fallback service), in
    /// bytes.
    pub fn set_fallback(&mut self, max_message_bytes: usize) {
        self.fallback = Some(PrefixLimit::exact(max_message_bytes));
    }

    /// Records that the server serves `service`, so its paths are not the fallback's.
    pub fn serve(&mut self, service: &str) {
        self.known.insert(service.to_string());
    }

    /// The limit of a request to `path` (`/package.Service/Method`): its service's, else the
    /// fallback's for a service the server does not serve (when a fallback limit is set),
    /// else [`DEFAULT_MAX_MESSAGE_BYTES`].
    pub fn for_path(&self, path: &str) -> PrefixLimit {
        let service = path
            .trim_start_matches('/')
            .split_once('/')
            .map_or("", |(service, _)| service);
        if let Some(limit) = self.by_service.get(service) {
            return *limit;
        }
        match self.fallback {
            Some(limit) if !self.known.contains(service) => limit,
            _ => PrefixLimit::exact(DEFAULT_MAX_MESSAGE_BYTES),
        }
    }
}

/// The status of a message refused by its length prefix: `RESOURCE_EXHAUSTED`, ErrorInfo
/// `PAYLOAD_TOO_LARGE` with `size_bytes` (what the prefix declares) and `limit_bytes`.
fn message_too_large(metered: Metered, size: usize, limit: usize) -> tonic::Status {
    let message = match metered {
        Metered::Requests => format!(
            "the message is {size} bytes, over the limit of {limit} bytes this service accepts; \
             send large content by url (or in several smaller messages), or raise the service's \
             message limit"
        ),
        Metered::Replies => format!(
            "the instance's reply is {size} bytes, over the limit of {limit} bytes the router \
             takes (router.max_message_bytes); have the agent return large content by url, or \
             raise the limit"
        ),
    };
    crate::errors::status_with_reason(
        tonic::Code::ResourceExhausted,
        message,
        crate::errors::reason::PAYLOAD_TOO_LARGE,
        [
            ("size_bytes".to_string(), size.to_string()),
            ("limit_bytes".to_string(), limit.to_string()),
        ],
    )
}

/// A connection's IO until it has sent [`PREFACE_BYTES`] bytes: a read that would wait past
/// the deadline fails with [`io::ErrorKind::TimedOut`] instead, which ends the connection.
/// After that it costs one branch per read.
pub(crate) struct HandshakeDeadline<T> {
    io: T,
    /// `None` once the preface's bytes have arrived.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    received: usize,
    /// The `listener` label of [`CONNECTIONS_REFUSED`], where a timeout is counted.
    listener_name: Arc<str>,
}

impl<T> HandshakeDeadline<T> {
    /// Wraps `io`, an accepted connection of the listener `listener_name`, which must send its
    /// preface within `timeout`.
    pub(crate) fn new(io: T, timeout: Duration, listener_name: Arc<str>) -> Self {
        Self {
            io,
            deadline: Some(Box::pin(tokio::time::sleep(timeout))),
            received: 0,
            listener_name,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for HandshakeDeadline<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        let Some(deadline) = this.deadline.as_mut() else {
            return read;
        };
        match read {
            Poll::Ready(Ok(())) => {
                this.received += buf.filled().len() - before;
                if this.received >= PREFACE_BYTES {
                    this.deadline = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if deadline.as_mut().poll(cx).is_ready() => {
                // Counted once: the error ends the connection, whose reads stop here.
                metrics::counter!(
                    CONNECTIONS_REFUSED,
                    "reason" => "handshake_timeout",
                    "listener" => this.listener_name.to_string()
                )
                .increment(1);
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the peer sent {} of the first {PREFACE_BYTES} bytes within the handshake \
                         timeout",
                        this.received
                    ),
                )))
            }
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for HandshakeDeadline<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A budget of bytes, shared by the streams of a connection or the connections of a listener.
#[derive(Debug)]
pub(crate) struct BufferBudget {
    limit: usize,
    used: AtomicUsize,
}

impl BufferBudget {
    pub(crate) fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// Takes `bytes` from the budget, or nothing when they do not fit.
    fn try_reserve(&self, bytes: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= self.limit)
            })
            .is_ok()
    }

    fn release(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }

    #[cfg(test)]
    fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}

/// The budgets a connection's requests count against, and where to count refusals.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionBudgets {
    pub(crate) connection: Arc<BufferBudget>,
    pub(crate) listener: Arc<BufferBudget>,
    /// The `listener` label of [`BUFFER_REFUSALS`].
    pub(crate) listener_name: Arc<str>,
    pub(crate) metered: Metered,
    /// The largest message of each request's path.
    pub(crate) message_limits: Arc<MessageLimits>,
}

/// Which messages a budget holds, for what a refusal says.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Metered {
    /// Requests a server receives (`[server]` settings).
    Requests,
    /// Replies a router receives from its instances (`[router]` settings).
    Replies,
}

/// Which budget a message did not fit in.
#[derive(Debug, Clone, Copy)]
enum Full {
    /// The connection's (or channel's) own.
    Connection,
    /// The one shared by all connections (or channels).
    All,
}

impl Metered {
    /// What a refused message's status says: which budget of `limit` bytes was full, the
    /// setting that governs it, and what the sender can do.
    fn refusal(self, full: Full, limit: usize) -> String {
        match (self, full) {
            (Self::Requests, Full::Connection) => format!(
                "this connection already holds close to {limit} bytes of messages that have not \
                 fully arrived; send large messages one after another, or over more connections \
                 (the server's limit is server.max_buffered_bytes_per_connection)"
            ),
            (Self::Requests, Full::All) => format!(
                "the server already holds close to {limit} bytes of messages that have not fully \
                 arrived, across its connections; retry later (the server's limit is \
                 server.max_buffered_bytes)"
            ),
            (Self::Replies, Full::Connection) => format!(
                "the router already holds close to {limit} bytes of replies from this instance \
                 that have not fully arrived (router.max_buffered_reply_bytes_per_instance); the \
                 instance starts large replies faster than it finishes them"
            ),
            (Self::Replies, Full::All) => format!(
                "the router already holds close to {limit} bytes of replies from its instances \
                 that have not fully arrived (router.max_buffered_reply_bytes); retry later"
            ),
        }
    }
}

impl ConnectionBudgets {
    /// Wraps a request's body so the bytes of its partly received gRPC messages count against
    /// the budgets; requests that are not gRPC (see [`is_grpc`]) pass as they are, which is
    /// safe because a [`crate::GrpcServer`] refuses them before reading their body.
    pub(crate) fn meter<B>(&self, request: http::Request<B>) -> http::Request<MeteredBody<B>> {
        let meter = is_grpc(request.headers())
            .then(|| self.new_meter(self.message_limits.for_path(request.uri().path())));
        request.map(|inner| MeteredBody::new(inner, meter))
    }

    fn new_meter(&self, limit: PrefixLimit) -> MessageMeter {
        MessageMeter {
            budgets: self.clone(),
            limit,
            header: [0; 5],
            header_len: 0,
            body_remaining: 0,
            held: 0,
        }
    }
}

/// A budget for the bytes of partly received gRPC replies a client holds: per channel (one
/// peer's connection) and across every channel it [meters](ReplyBudget::meter). A reply that
/// would take either past its limit fails its call with `RESOURCE_EXHAUSTED`; replies that
/// arrive whole in one read never count. The router meters its channels to instances with it,
/// so that an instance that starts large replies and never finishes them cannot pin the
/// router's memory (every reply is buffered until it is whole, up to the message size limit).
#[derive(Debug, Clone)]
pub struct ReplyBudget {
    per_channel: usize,
    total: Arc<BufferBudget>,
    limit: PrefixLimit,
}

impl ReplyBudget {
    /// `per_channel` bytes for each metered channel, `total` across them all; replies of any
    /// size (see [`ReplyBudget::with_max_message_bytes`]).
    pub fn new(per_channel: usize, total: usize) -> Self {
        Self {
            per_channel,
            total: BufferBudget::new(total),
            limit: PrefixLimit::exact(usize::MAX),
        }
    }

    /// Refuses every reply message whose length prefix declares more than
    /// `max_message_bytes` bytes as soon as its prefix arrives, with `RESOURCE_EXHAUSTED` and
    /// `PAYLOAD_TOO_LARGE` (both sizes), instead of tonic's `OUT_OF_RANGE`.
    pub fn with_max_message_bytes(mut self, max_message_bytes: usize) -> Self {
        self.limit = PrefixLimit::exact(max_message_bytes);
        self
    }

    /// [`ReplyBudget::with_max_message_bytes`], refusing above `limit.refuse_above` and
    /// naming `limit.named`.
    pub fn with_prefix_limit(mut self, limit: PrefixLimit) -> Self {
        self.limit = limit;
        self
    }

    /// `channel`, with the replies it receives counted against this budget.
    pub fn meter(&self, channel: tonic::transport::Channel) -> MeteredChannel {
        MeteredChannel {
            inner: channel,
            budgets: ConnectionBudgets {
                connection: BufferBudget::new(self.per_channel),
                listener: self.total.clone(),
                listener_name: "(replies)".into(),
                metered: Metered::Replies,
                message_limits: Arc::default(),
            },
            limit: self.limit,
        }
    }
}

/// A channel whose replies count against a [`ReplyBudget`]; use it as a tonic client's
/// transport (`AgentServiceClient::new(metered)`). Clones share the channel and its budget.
#[derive(Debug, Clone)]
pub struct MeteredChannel {
    inner: tonic::transport::Channel,
    budgets: ConnectionBudgets,
    limit: PrefixLimit,
}

impl MeteredChannel {
    /// The channel itself, unmetered: for forwarding replies as they arrive, which holds none.
    pub fn unmetered(&self) -> &tonic::transport::Channel {
        &self.inner
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for MeteredChannel {
    type Response = http::Response<MeteredBody<tonic::body::Body>>;
    type Error = tonic::transport::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let response = self.inner.call(request);
        let budgets = self.budgets.clone();
        let limit = self.limit;
        Box::pin(async move {
            // Every reply is metered, whatever its content-type says: the client will parse
            // it as gRPC messages.
            Ok(response
                .await?
                .map(|inner| MeteredBody::new(inner, Some(budgets.new_meter(limit)))))
        })
    }
}

/// Whether a request is gRPC: its `content-type` is `application/grpc`, or starts with it
/// (`application/grpc+proto`), in any case (media types are case-insensitive, RFC 9110 §8.3.1).
pub(crate) fn is_grpc(headers: &http::HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.as_bytes().get(..GRPC.len()))
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(GRPC))
}

/// Tracks where a gRPC stream's bytes stand in its length-prefixed messages (gRPC over HTTP/2:
/// a 1-byte compressed flag, a 4-byte big-endian length, then the message) and how many
/// bytes of the message in progress the server holds.
#[derive(Debug)]
struct MessageMeter {
    budgets: ConnectionBudgets,
    /// The largest message accepted, by its length prefix.
    limit: PrefixLimit,
    header: [u8; 5],
    header_len: usize,
    /// Bytes of the current message's body still to come; 0 between messages.
    body_remaining: usize,
    /// Bytes of the message in progress (prefix included) taken from the budgets.
    held: usize,
}

impl MessageMeter {
    /// Accounts for `data`, the stream's next bytes.
    ///
    /// # Errors
    /// `RESOURCE_EXHAUSTED` when the message in progress would take a budget past its limit,
    /// and with `PAYLOAD_TOO_LARGE` when a length prefix declares more than the message limit.
    fn observe(&mut self, mut data: &[u8]) -> Result<(), tonic::Status> {
        let mut held = self.held;
        while !data.is_empty() {
            let take;
            if self.body_remaining == 0 {
                take = (5 - self.header_len).min(data.len());
                self.header[self.header_len..self.header_len + take].copy_from_slice(&data[..take]);
                self.header_len += take;
                held += take;
                if self.header_len == 5 {
                    self.header_len = 0;
                    let length = u32::from_be_bytes([
                        self.header[1],
                        self.header[2],
                        self.header[3],
                        self.header[4],
                    ]);
                    self.body_remaining = length as usize;
                    if self.body_remaining > self.limit.refuse_above {
                        return Err(message_too_large(
                            self.budgets.metered,
                            self.body_remaining,
                            self.limit.named,
                        ));
                    }
                    if self.body_remaining == 0 {
                        held = 0;
                    }
                }
            } else {
                take = self.body_remaining.min(data.len());
                self.body_remaining -= take;
                held += take;
                if self.body_remaining == 0 {
                    held = 0;
                }
            }
            data = &data[take..];
        }
        match held.cmp(&self.held) {
            std::cmp::Ordering::Less => self.give_back(self.held - held),
            std::cmp::Ordering::Greater => self.take(held - self.held)?,
            std::cmp::Ordering::Equal => {}
        }
        self.held = held;
        Ok(())
    }

    fn take(&self, bytes: usize) -> Result<(), tonic::Status> {
        let budgets = &self.budgets;
        let (full, limit) = if !budgets.connection.try_reserve(bytes) {
            (Full::Connection, budgets.connection.limit)
        } else if !budgets.listener.try_reserve(bytes) {
            budgets.connection.release(bytes);
            (Full::All, budgets.listener.limit)
        } else {
            return Ok(());
        };
        metrics::counter!(BUFFER_REFUSALS, "listener" => budgets.listener_name.to_string())
            .increment(1);
        Err(tonic::Status::resource_exhausted(
            budgets.metered.refusal(full, limit),
        ))
    }

    fn give_back(&self, bytes: usize) {
        self.budgets.connection.release(bytes);
        self.budgets.listener.release(bytes);
    }
}

impl Drop for MessageMeter {
    fn drop(&mut self) {
        if self.held > 0 {
            self.give_back(self.held);
        }
    }
}

pin_project_lite::pin_project! {
    /// A request or reply body whose partly received gRPC messages count against buffer
    /// budgets: a server's ([`ConnectionLimits`]) or a client's ([`ReplyBudget`]).
    pub struct MeteredBody<B> {
        #[pin]
        inner: B,
        meter: Option<MessageMeter>,
    }
}

impl<B> MeteredBody<B> {
    fn new(inner: B, meter: Option<MessageMeter>) -> Self {
        Self { inner, meter }
    }
}

impl<B> Body for MeteredBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        let frame = match ready!(this.inner.poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(error)) => return Poll::Ready(Some(Err(error.into()))),
            None => return Poll::Ready(None),
        };
        if let (Some(meter), Some(data)) = (this.meter.as_mut(), frame.data_ref())
            && let Err(status) = meter.observe(data)
        {
            // The message will not be completed: its bytes go back now, not when the body is
            // dropped.
            *this.meter = None;
            return Poll::Ready(Some(Err(Box::new(status))));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_stream_limits_that_cannot_work_are_refused_naming_their_setting() {
        let limits = ConnectionLimits::default();
        assert!(limits.validate(1024, "router.max_message_bytes").is_ok());
        let error = ConnectionLimits {
            header_read_timeout: Duration::from_millis(10),
            ..limits
        }
        .validate(1024, "router.max_message_bytes")
        .unwrap_err();
        assert_eq!(error.key(), "server.header_read_timeout");
        assert!(error.to_string().contains("at least"), "{error}");
        let error = ConnectionLimits {
            http2_max_concurrent_streams: 0,
            ..limits
        }
        .validate(1024, "router.max_message_bytes")
        .unwrap_err();
        assert_eq!(error.key(), "server.http2_max_concurrent_streams");
    }

    fn budgets(connection: usize, listener: usize) -> ConnectionBudgets {
        ConnectionBudgets {
            connection: BufferBudget::new(connection),
            listener: BufferBudget::new(listener),
            listener_name: "test".into(),
            metered: Metered::Requests,
            message_limits: Arc::default(),
        }
    }

    fn meter(budgets: &ConnectionBudgets) -> MessageMeter {
        let request = http::Request::builder()
            .header("content-type", "application/grpc")
            .body(())
            .unwrap();
        budgets.meter(request).into_body().meter.unwrap()
    }

    fn message(length: usize) -> Vec<u8> {
        let mut bytes = vec![0];
        bytes.extend_from_slice(&(length as u32).to_be_bytes());
        bytes.resize(5 + length, 7);
        bytes
    }

    #[test]
    fn whole_messages_take_nothing_however_they_are_split() {
        let budgets = budgets(64, 64);
        let stream: Vec<u8> = [message(10), message(0), message(40), message(3)].concat();
        for chunk in [1, 2, 5, 6, 7, 13, 64, stream.len()] {
            let mut meter = meter(&budgets);
            for piece in stream.chunks(chunk) {
                meter.observe(piece).unwrap();
                assert_eq!(budgets.connection.used(), meter.held);
            }
            assert_eq!(meter.held, 0, "chunks of {chunk}");
            assert_eq!(budgets.listener.used(), 0, "chunks of {chunk}");
        }
    }

    #[test]
    fn a_message_in_progress_holds_its_bytes_until_it_completes() {
        let budgets = budgets(1000, 1000);
        let mut meter = meter(&budgets);
        let bytes = message(100);
        meter.observe(&bytes[..3]).unwrap();
        assert_eq!(budgets.connection.used(), 3);
        meter.observe(&bytes[3..60]).unwrap();
        assert_eq!(budgets.connection.used(), 60);
        assert_eq!(budgets.listener.used(), 60);
        // The rest of this message and the start of the next.
        let next = message(20);
        meter.observe(&[&bytes[60..], &next[..8]].concat()).unwrap();
        assert_eq!(budgets.connection.used(), 8);
        drop(meter);
        assert_eq!(budgets.connection.used(), 0, "a dropped stream gives back");
        assert_eq!(budgets.listener.used(), 0);
    }

    #[test]
    fn a_message_past_either_budget_is_refused_and_takes_nothing() {
        let budgets = budgets(100, 150);
        let mut first = meter(&budgets);
        first.observe(&message(200)[..80]).unwrap();
        let mut second = meter(&budgets);
        let refused = second.observe(&message(200)[..30]).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.message().contains("this connection"), "{refused:?}");
        assert_eq!(budgets.connection.used(), 80);

        // Another connection of the same listener: its own budget has room, the listener's not.
        let other = ConnectionBudgets {
            connection: BufferBudget::new(100),
            ..budgets.clone()
        };
        let mut third = meter(&other);
        let refused = third.observe(&message(200)[..90]).unwrap_err();
        assert!(refused.message().contains("the server"), "{refused:?}");
        assert_eq!(other.connection.used(), 0, "a refusal takes nothing");
        assert_eq!(budgets.listener.used(), 80);
    }

    #[test]
    fn requests_that_are_not_grpc_are_not_metered() {
        let budgets = budgets(1, 1);
        let request = http::Request::builder()
            .header("content-type", "application/json")
            .body(())
            .unwrap();
        assert!(budgets.meter(request).into_body().meter.is_none());
    }
}
