//! Multiplexed request-reply over one gRPC bidirectional stream: many concurrent calls, each
//! a `reach.v1.CallFrame` out and a `reach.v1.ReplyFrame` back, tagged with a `call_id`.
//!
//! A unary gRPC call opens a new HTTP/2 stream: HEADERS with the path, content type, timeout
//! and trace context (HPACK-encoded), DATA, then response HEADERS, DATA and trailers, plus the
//! stream bookkeeping on both ends. On a multiplexed stream a call is one length-prefixed DATA
//! frame each way, and frames of concurrent calls coalesce into the same `sendmsg` — the trade
//! NATS request-reply makes over one connection. `RouterService.CallMux` (caller → router) and
//! `AgentService.HandleMux` (router → instance) use it; unary `Call` / `Handle` stay for
//! generated clients, grpcurl and agents that do not implement the stream.
//!
//! - [`MuxLink`] is the caller's side: it opens the stream lazily, matches replies to waiting
//!   calls, sends a cancel frame when a waiting call is dropped (deadline, caller gone) and
//!   keeps the call's [`OutgoingCall::hold`] (the caller's slot on the callee) until the
//!   callee acknowledges the cancel, fails every waiting call with UNAVAILABLE when the stream
//!   breaks and opens a new stream for the next call. A callee that answers the stream with UNIMPLEMENTED makes the link report
//!   [`MuxError::Unsupported`] (for a while), so the caller falls back to the unary RPC.
//! - [`serve`] is the callee's side: it runs every call of one stream as its own task, stops
//!   a call on its cancel frame ([`OnCancel`]) and acknowledges the cancel once the call has
//!   stopped (a reply frame with CANCELLED), bounds the calls open at once and yields the
//!   outcomes in completion order.
//!
//! A call counts against the callee until its reply or its cancel's acknowledgement arrives,
//! not until the caller gave up: a callee whose handler is still running is still busy.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, Stream, StreamExt};
use reach_proto::v1::agent_service_client::AgentServiceClient;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{
    CallError, CallFrame, CallMuxRequest, CallMuxResponse, HandleMuxRequest, HandleMuxResponse,
    ReachMessage, ReplyFrame, reply_frame,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::Channel;
use tonic::{Code, Status};

/// How long a link remembers that its callee does not implement the stream before trying
/// again (a callee may be upgraded in place).
pub const UNSUPPORTED_RETRY_AFTER: Duration = Duration::from_secs(60);

/// The most per-call metadata a frame may carry (keys plus values, bytes) — the role of
/// HTTP/2's header list limit for a unary call.
pub const MAX_CALL_METADATA_BYTES: usize = 8 * 1024;

/// Bytes a frame spends around its message (call id, deadline, metadata up to
/// [`MAX_CALL_METADATA_BYTES`], field tags): a callee's decoding limit is its message limit
/// plus this, so a frame is never refused as a whole for a message within the limit.
pub const FRAME_OVERHEAD_BYTES: usize = 16 * 1024;

fn metadata_len(metadata: &HashMap<String, String>) -> usize {
    metadata.iter().map(|(k, v)| k.len() + v.len()).sum()
}

/// The retry hint of a call refused because its stream has too many calls open.
const OVERLOADED_RETRY_AFTER: Duration = Duration::from_millis(50);

/// Frames queued towards the callee per stream before a new call waits for room (HTTP/2 flow
/// control then pushes back on the sender).
const OUTBOUND_QUEUE: usize = 1024;

/// The status of a failed call, as a `CallError` (code, message and the encoded
/// `google.rpc.Status` details).
pub fn error_of(status: &Status) -> CallError {
    CallError {
        code: status.code() as i32,
        message: status.message().to_string(),
        details: bytes::Bytes::copy_from_slice(status.details()),
    }
}

/// The status a `CallError` carries, details included (so `google.rpc.ErrorInfo` reasons
/// survive the hop).
pub fn status_of(error: CallError) -> Status {
    Status::with_details(Code::from_i32(error.code), error.message, error.details)
}

/// The `ReplyFrame` answering `call_id` with `outcome`.
pub fn reply_frame(call_id: u64, outcome: Result<ReachMessage, Status>) -> ReplyFrame {
    ReplyFrame {
        call_id,
        result: Some(match outcome {
            Ok(message) => reply_frame::Result::Reply(message),
            Err(status) => reply_frame::Result::Error(error_of(&status)),
        }),
    }
}

/// The outcome a `ReplyFrame` carries.
///
/// # Errors
/// The call's status; INTERNAL for a frame with neither a reply nor an error.
pub fn outcome_of(frame: Option<ReplyFrame>) -> Result<ReachMessage, Status> {
    match frame.and_then(|f| f.result) {
        Some(reply_frame::Result::Reply(message)) => Ok(message),
        Some(reply_frame::Result::Error(error)) => Err(status_of(error)),
        None => Err(Status::internal(
            "the callee sent a reply frame with neither a reply nor an error",
        )),
    }
}

/// A reply frame type of a multiplexed RPC (`HandleMuxResponse`, `CallMuxResponse`).
pub trait MuxReply: Send + 'static {
    /// The id of the call this frame answers.
    fn call_id(&self) -> u64;
    /// The reply frame itself (see [`outcome_of`]).
    fn into_frame(self) -> Option<ReplyFrame>;
}

impl MuxReply for HandleMuxResponse {
    fn call_id(&self) -> u64 {
        self.frame.as_ref().map_or(0, |f| f.call_id)
    }

    fn into_frame(self) -> Option<ReplyFrame> {
        self.frame
    }
}

impl MuxReply for CallMuxResponse {
    fn call_id(&self) -> u64 {
        self.frame.as_ref().map_or(0, |f| f.call_id)
    }

    fn into_frame(self) -> Option<ReplyFrame> {
        self.frame
    }
}

/// Opens the multiplexed RPC: given the outbound frames, resolves to the inbound reply frames
/// once the callee accepted the stream, or to the status that refused it.
pub type Opener<R> = Arc<
    dyn Fn(
            ReceiverStream<CallFrame>,
        ) -> BoxFuture<'static, Result<BoxStream<'static, Result<R, Status>>, Status>>
        + Send
        + Sync,
>;

/// Why a multiplexed call did not produce the callee's answer.
#[derive(Debug)]
pub enum MuxError {
    /// The callee does not implement the multiplexed RPC: send the call (handed back) with
    /// the unary one. Nothing was delivered.
    Unsupported(Box<OutgoingCall>),
    /// The call was not delivered: the stream could not be opened (the status keeps the
    /// transport error as its source, or is the callee's refusal), the frame could not be
    /// sent, or the callee ended the stream draining before it read the call.
    Failed(Status),
    /// The stream broke while the call waited for its reply: the callee may or may not have
    /// handled it. The status is the cause (why the stream ended); converted into a `Status`
    /// this becomes UNAVAILABLE saying so.
    Lost(Status),
}

impl From<MuxError> for Status {
    fn from(error: MuxError) -> Self {
        match error {
            MuxError::Unsupported(_) => Status::unimplemented(
                "the peer does not serve the multiplexed stream; use the unary RPC",
            ),
            MuxError::Failed(status) => status,
            MuxError::Lost(cause) => Status::unavailable(format!(
                "the connection broke while the call was in flight ({}: {}); the message may or may not have been handled: retry with the same message_id to be safe",
                crate::errors::code_name(cause.code()),
                cause.message()
            )),
        }
    }
}

/// Why no stream could be had.
enum Opened {
    Unsupported,
    Failed(Status),
}

/// A guard the link keeps for a call until the callee's reply or cancel acknowledgement
/// arrives, or the stream breaks (see [`OutgoingCall::hold`]).
pub type Hold = Box<dyn std::any::Any + Send + Sync>;

/// One call to send on a link.
#[derive(Default)]
pub struct OutgoingCall {
    /// The request.
    pub message: ReachMessage,
    /// The time the callee has; `None` for no deadline. Sent in ms, rounded up. The caller
    /// enforces its own deadline too (dropping the future sends a cancel frame).
    pub timeout: Option<Duration>,
    /// Per-call metadata (`traceparent`, `tracestate`, `x-*`).
    pub metadata: HashMap<String, String>,
    /// Kept until the callee has answered or acknowledged the call's cancel (or the stream
    /// broke), even after the waiting future is dropped: the caller's slot on the callee,
    /// which must not be given to another call while the callee still runs this one.
    pub hold: Option<Hold>,
}

impl std::fmt::Debug for OutgoingCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutgoingCall")
            .field("message", &self.message)
            .field("timeout", &self.timeout)
            .field("metadata", &self.metadata)
            .field("hold", &self.hold.is_some())
            .finish()
    }
}

/// The caller's side of a multiplexed RPC to one peer (see the module docs). Cheap to share
/// behind an `Arc`; every call goes over the peer's current stream.
pub struct MuxLink<R: MuxReply> {
    peer: String,
    opener: Opener<R>,
    current: Mutex<Option<Arc<Session<R>>>>,
    /// Single-flights opening a stream.
    opening: tokio::sync::Mutex<()>,
    /// Set while the callee is known not to implement the stream.
    unsupported: AtomicBool,
    unsupported_since: Mutex<Option<Instant>>,
    streams_opened: AtomicU64,
}

impl<R: MuxReply> std::fmt::Debug for MuxLink<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MuxLink")
            .field("peer", &self.peer)
            .field("unsupported", &self.unsupported.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// One open stream of a link.
struct Session<R> {
    next_call_id: AtomicU64,
    outbound: mpsc::Sender<CallFrame>,
    waiting: Arc<Waiting<R>>,
}

/// Calls waiting for their reply frame, by call id; `broken` once the stream ended.
struct Waiting<R> {
    state: Mutex<WaitingState<R>>,
}

struct WaitingState<R> {
    calls: HashMap<u64, Waiter<R>>,
    /// Cancelled calls whose acknowledgement has not arrived, with their holds.
    cancelled: HashMap<u64, Option<Hold>>,
    /// Why the stream ended; no call may wait on it any more.
    broken: Option<Status>,
}

/// A call waiting for its reply frame.
struct Waiter<R> {
    reply: oneshot::Sender<Result<R, MuxError>>,
    hold: Option<Hold>,
}

impl<R> Waiting<R> {
    fn lock(&self) -> std::sync::MutexGuard<'_, WaitingState<R>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl MuxLink<HandleMuxResponse> {
    /// A link to an instance's `AgentService.HandleMux` over `channel` (a tonic `Channel`, or
    /// one wrapped such as a [`crate::limits::MeteredChannel`]), for messages of up to
    /// `max_message_bytes` (frames get [`FRAME_OVERHEAD_BYTES`] more). The stream is
    /// long-lived, so it is not traced as one call: each call carries its own `traceparent`.
    pub fn to_agent<T>(peer: impl Into<String>, channel: T, max_message_bytes: usize) -> Self
    where
        T: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + Sync + 'static,
        T::Future: Send,
        T::Error: Into<tonic::codegen::StdError>,
        T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        <T::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError> + Send,
    {
        let frame_limit = max_message_bytes.saturating_add(FRAME_OVERHEAD_BYTES);
        let client = AgentServiceClient::new(channel)
            .max_decoding_message_size(frame_limit)
            .max_encoding_message_size(frame_limit);
        Self::new(
            peer,
            Arc::new(move |frames| {
                let mut client = client.clone();
                Box::pin(async move {
                    let request = frames.map(|frame| HandleMuxRequest { frame: Some(frame) });
                    Ok(client.handle_mux(request).await?.into_inner().boxed())
                })
            }),
        )
    }
}

impl MuxLink<CallMuxResponse> {
    /// A link to a router's `RouterService.CallMux` over `channel`, for messages of up to
    /// `max_message_bytes` (frames get [`FRAME_OVERHEAD_BYTES`] more); traced per call as
    /// [`MuxLink::to_agent`] is.
    pub fn to_router(peer: impl Into<String>, channel: Channel, max_message_bytes: usize) -> Self {
        let frame_limit = max_message_bytes.saturating_add(FRAME_OVERHEAD_BYTES);
        let client = RouterServiceClient::new(channel)
            .max_decoding_message_size(frame_limit)
            .max_encoding_message_size(frame_limit);
        Self::new(
            peer,
            Arc::new(move |frames| {
                let mut client = client.clone();
                Box::pin(async move {
                    let request = frames.map(|frame| CallMuxRequest { frame: Some(frame) });
                    Ok(client.call_mux(request).await?.into_inner().boxed())
                })
            }),
        )
    }
}

impl<R: MuxReply> MuxLink<R> {
    /// A link to `peer` (named in error messages) that opens streams with `opener`. Nothing
    /// is opened until the first call.
    pub fn new(peer: impl Into<String>, opener: Opener<R>) -> Self {
        Self {
            peer: peer.into(),
            opener,
            current: Mutex::new(None),
            opening: tokio::sync::Mutex::new(()),
            unsupported: AtomicBool::new(false),
            unsupported_since: Mutex::new(None),
            streams_opened: AtomicU64::new(0),
        }
    }

    /// How many streams this link has opened so far (1 while the first one lives; more
    /// after breaks). For diagnostics and tests.
    pub fn streams_opened(&self) -> u64 {
        self.streams_opened.load(Ordering::Relaxed)
    }

    /// Whether the callee is known not to implement the multiplexed RPC (use the unary one).
    pub fn is_unsupported(&self) -> bool {
        if !self.unsupported.load(Ordering::Relaxed) {
            return false;
        }
        let mut since = self
            .unsupported_since
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if since.is_some_and(|at| at.elapsed() >= UNSUPPORTED_RETRY_AFTER) {
            *since = None;
            self.unsupported.store(false, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Sends one call and waits for its reply frame.
    ///
    /// Dropping the returned future before the reply arrives sends a cancel frame for the
    /// call, so the callee stops it; the call's [`OutgoingCall::hold`] is kept until the callee
    /// acknowledges the cancel (or the stream breaks).
    ///
    /// # Errors
    /// [`MuxError::Unsupported`] when the callee does not implement the stream (nothing was
    /// sent); [`MuxError::Failed`] as that variant describes.
    pub async fn call(&self, mut call: OutgoingCall) -> Result<R, MuxError> {
        if self.is_unsupported() {
            return Err(MuxError::Unsupported(Box::new(call)));
        }
        let session = match self.session().await {
            Ok(session) => session,
            Err(Opened::Unsupported) => return Err(MuxError::Unsupported(Box::new(call))),
            Err(Opened::Failed(status)) => return Err(MuxError::Failed(status)),
        };
        let call_id = session.next_call_id.fetch_add(1, Ordering::Relaxed);
        let (reply_tx, reply_rx) = oneshot::channel();
        {
            let mut waiting = session.waiting.lock();
            if let Some(broken) = &waiting.broken {
                return Err(MuxError::Failed(not_sent(&self.peer, broken)));
            }
            waiting.calls.insert(
                call_id,
                Waiter {
                    reply: reply_tx,
                    hold: call.hold.take(),
                },
            );
        }
        let mut guard = CancelOnDrop {
            session: &session,
            call_id,
            armed: true,
            sent: false,
        };
        let frame = CallFrame {
            call_id,
            message: Some(call.message),
            timeout_ms: call.timeout.map_or(0, timeout_ms),
            metadata: call.metadata,
            cancel: false,
        };
        if session.outbound.send(frame).await.is_err() {
            guard.armed = false;
            let waiter = session.waiting.lock().calls.remove(&call_id);
            drop(waiter);
            self.forget(&session);
            return Err(MuxError::Failed(crate::errors::unsent(
                Status::unavailable(format!(
                    "the stream to {} closed before the call was sent; nothing was delivered",
                    self.peer
                )),
            )));
        }
        guard.sent = true;
        let outcome = reply_rx.await;
        guard.armed = false;
        match outcome {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(error)) => {
                self.forget(&session);
                Err(error)
            }
            Err(_) => Err(MuxError::Failed(Status::internal(format!(
                "the reply of call {call_id} to {} was lost",
                self.peer
            )))),
        }
    }

    /// The current live stream, opened when there is none.
    async fn session(&self) -> Result<Arc<Session<R>>, Opened> {
        if let Some(session) = self.live() {
            return Ok(session);
        }
        let _opening = self.opening.lock().await;
        if let Some(session) = self.live() {
            return Ok(session);
        }
        if self.is_unsupported() {
            return Err(Opened::Unsupported);
        }
        let (outbound, outbound_rx) = mpsc::channel(OUTBOUND_QUEUE);
        let inbound = match (self.opener)(ReceiverStream::new(outbound_rx)).await {
            Ok(inbound) => inbound,
            Err(status) => {
                // A callee that answered (no transport error underneath) UNIMPLEMENTED does
                // not serve the stream.
                if status.code() == Code::Unimplemented
                    && std::error::Error::source(&status).is_none()
                {
                    self.unsupported.store(true, Ordering::Relaxed);
                    *self
                        .unsupported_since
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                    tracing::debug!(peer = %self.peer, "peer does not serve the multiplexed stream; using unary calls");
                    return Err(Opened::Unsupported);
                }
                return Err(Opened::Failed(status));
            }
        };
        self.streams_opened.fetch_add(1, Ordering::Relaxed);
        let waiting = Arc::new(Waiting {
            state: Mutex::new(WaitingState {
                calls: HashMap::new(),
                cancelled: HashMap::new(),
                broken: None,
            }),
        });
        tokio::spawn(read_replies(
            self.peer.clone(),
            inbound,
            Arc::downgrade(&waiting),
        ));
        let session = Arc::new(Session {
            next_call_id: AtomicU64::new(1),
            outbound,
            waiting,
        });
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(session.clone());
        Ok(session)
    }

    fn live(&self) -> Option<Arc<Session<R>>> {
        let current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        current
            .as_ref()
            .filter(|s| !s.outbound.is_closed() && s.waiting.lock().broken.is_none())
            .cloned()
    }

    /// Drops `session` as the current stream (it broke), so the next call opens another.
    fn forget(&self, session: &Arc<Session<R>>) {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, session)) {
            *current = None;
        }
    }
}

/// Reads reply frames and completes the waiting calls; when the stream ends, fails every
/// call still waiting.
async fn read_replies<R: MuxReply>(
    peer: String,
    mut inbound: BoxStream<'static, Result<R, Status>>,
    waiting: std::sync::Weak<Waiting<R>>,
) {
    let ended = loop {
        match inbound.next().await {
            Some(Ok(reply)) => {
                let Some(waiting) = waiting.upgrade() else {
                    return;
                };
                let (waiter, acknowledged) = {
                    let mut state = waiting.lock();
                    let waiter = state.calls.remove(&reply.call_id());
                    // No waiter: the call was cancelled; this is the callee's answer or its
                    // acknowledgement of the cancel, and the call's hold goes now.
                    let acknowledged = match waiter {
                        Some(_) => None,
                        None => state.cancelled.remove(&reply.call_id()),
                    };
                    (waiter, acknowledged)
                };
                drop(acknowledged);
                if let Some(waiter) = waiter {
                    let _ = waiter.reply.send(Ok(reply));
                    drop(waiter.hold);
                }
            }
            Some(Err(status)) => break status,
            None => break Status::unavailable("the callee ended the stream"),
        }
    };
    let Some(waiting) = waiting.upgrade() else {
        return;
    };
    let (calls, cancelled) = {
        let mut state = waiting.lock();
        state.broken = Some(ended.clone());
        (
            std::mem::take(&mut state.calls),
            std::mem::take(&mut state.cancelled),
        )
    };
    // No acknowledgement will come on a broken stream.
    drop(cancelled);
    let drained = crate::errors::reason_of(&ended).as_deref()
        == Some(crate::errors::reason::INSTANCE_DRAINING);
    if !calls.is_empty() && !drained {
        tracing::warn!(peer = %peer, calls = calls.len(), code = ?ended.code(), error = %ended.message(), "multiplexed stream broke with calls in flight");
    }
    for (_, waiter) in calls {
        let Waiter {
            reply: waiter,
            hold,
        } = waiter;
        drop(hold);
        if drained {
            // The callee answered every call it read before it ended the stream.
            let _ = waiter.send(Err(MuxError::Failed(ended.clone())));
            continue;
        }
        let _ = waiter.send(Err(MuxError::Lost(Status::new(
            ended.code(),
            format!("the stream to {peer} ended: {}", ended.message()),
        ))));
    }
}

fn not_sent(peer: &str, broken: &Status) -> Status {
    crate::errors::unsent(Status::unavailable(format!(
        "the stream to {peer} had ended ({}); nothing was delivered",
        broken.message()
    )))
}

/// `timeout` in whole milliseconds, rounded up, at least 1 (0 would mean no deadline).
fn timeout_ms(timeout: Duration) -> u32 {
    let ms = timeout.as_micros().div_ceil(1000).max(1);
    u32::try_from(ms).unwrap_or(u32::MAX)
}

/// Sends a cancel frame for a call whose waiting future is dropped before its reply; a call
/// dropped while its frame still waited for room in the outbound queue was never sent, so it
/// is only forgotten (a cancel would never be acknowledged, and its hold never released).
struct CancelOnDrop<'a, R> {
    session: &'a Session<R>,
    call_id: u64,
    armed: bool,
    /// Whether the call's frame is in the outbound queue (so the callee will see it).
    sent: bool,
}

impl<R> Drop for CancelOnDrop<'_, R> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        {
            let mut state = self.session.waiting.lock();
            let Some(waiter) = state.calls.remove(&self.call_id) else {
                // Already answered or failed.
                return;
            };
            if state.broken.is_some() || !self.sent {
                return;
            }
            // The hold stays until the callee acknowledges the cancel.
            state.cancelled.insert(self.call_id, waiter.hold);
        }
        let cancel = CallFrame {
            call_id: self.call_id,
            cancel: true,
            ..CallFrame::default()
        };
        if let Err(mpsc::error::TrySendError::Full(cancel)) = self.session.outbound.try_send(cancel)
        {
            let outbound = self.session.outbound.clone();
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let _ = outbound.send(cancel).await;
                });
            }
        }
    }
}

/// One call received on a multiplexed stream.
#[derive(Debug)]
pub struct IncomingCall {
    /// The caller's id of the call.
    pub call_id: u64,
    /// The request.
    pub message: ReachMessage,
    /// When the frame was read.
    pub received_at: Instant,
    /// When the call's time runs out (`received_at` + `timeout_ms`); `None` for no deadline.
    pub deadline: Option<Instant>,
    /// Per-call metadata (`traceparent`, `tracestate`, `x-*`).
    pub metadata: HashMap<String, String>,
    /// Cancelled when the caller cancels the call (a cancel frame). With
    /// [`OnCancel::Tell`] this is how the handler learns it; its outcome, whenever it comes,
    /// is the cancel's acknowledgement.
    pub cancelled: CancellationToken,
}

/// What [`serve`] does with a call when its cancel frame arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnCancel {
    /// Drops the handler's future at once (the handler is stopped at its next `.await`), then
    /// acknowledges the cancel with a reply frame (CANCELLED).
    Drop,
    /// Cancels [`IncomingCall::cancelled`] and lets the handler finish: its outcome, sent as
    /// the call's reply, acknowledges the cancel. For handlers that do not stop at once (work
    /// that must finish, or is shared), so the caller keeps counting the call until it ended.
    Tell,
}

/// The status acknowledging a cancel frame (see [`serve`]).
pub fn cancelled_status() -> Status {
    Status::cancelled("the call was cancelled by its caller (a cancel frame) and has stopped")
}

/// Runs the calls of one multiplexed stream (the callee's side; see the module docs).
///
/// Every call frame becomes a task running `handler`, which sends its own reply as it
/// finishes (no hop through a collecting task); a cancel frame drops the handler's future
/// ([`OnCancel::Drop`], see [`serve_with`] for the other way) and, once it is gone, answers
/// the call with [`cancelled_status`]: that reply acknowledges the cancel, and until it is
/// sent the call is open (its id in use, its slot taken). A call that finished before its
/// cancel was read has already been answered. At most `max_open_calls` run at once: a call
/// beyond that
/// is answered at once with UNAVAILABLE, reason `OVERLOADED` and a retry hint (it was not
/// handled). A call counts until its reply is queued, so a caller that stops reading replies
/// is refused new calls instead of making finished ones pile up. The returned stream yields `(call_id, outcome)`
/// ([`Outcome`]) in completion order and ends after the caller half-closed and every call finished; it yields
/// the inbound stream's error (for example an oversized frame) and ends when that breaks.
/// When the returned stream is dropped (the caller went away), open calls are aborted.
///
/// When `closing` is cancelled (the callee drains or shuts down) it stops reading frames,
/// answers every call it had read, and then ends the stream with [`closing_status`]
/// (UNAVAILABLE, `INSTANCE_DRAINING`): every call the caller has not had a reply for was
/// never read, so [`MuxLink`] fails those with that status and the caller may send them
/// elsewhere — the GOAWAY rule of HTTP/2 (RFC 9113 §6.8), per call.
pub fn serve<S, H, F, T>(
    inbound: S,
    handler: H,
    max_open_calls: usize,
    closing: CancellationToken,
) -> impl Stream<Item = Outcome<T>> + Send + 'static
where
    S: Stream<Item = Result<CallFrame, Status>> + Send + 'static,
    H: Fn(IncomingCall) -> F + Send + 'static,
    F: Future<Output = Result<T, Status>> + Send + 'static,
    T: Send + 'static,
{
    serve_with(inbound, handler, max_open_calls, closing, OnCancel::Drop)
}

/// [`serve`], with cancel frames handled as `on_cancel` says.
pub fn serve_with<S, H, F, T>(
    inbound: S,
    handler: H,
    max_open_calls: usize,
    closing: CancellationToken,
    on_cancel: OnCancel,
) -> impl Stream<Item = Outcome<T>> + Send + 'static
where
    S: Stream<Item = Result<CallFrame, Status>> + Send + 'static,
    H: Fn(IncomingCall) -> F + Send + 'static,
    F: Future<Output = Result<T, Status>> + Send + 'static,
    T: Send + 'static,
{
    let (replies, replies_rx) = mpsc::channel(OUTBOUND_QUEUE);
    tokio::spawn(run_calls(
        inbound,
        handler,
        max_open_calls,
        closing,
        on_cancel,
        replies,
    ));
    ReceiverStream::new(replies_rx)
}

/// One item of [`serve`]'s output: a call's id and outcome, or the error that broke the
/// inbound stream.
pub type Outcome<T> = Result<(u64, Result<T, Status>), Status>;

/// A call being handled on a multiplexed stream: whose task it is, and how to stop it.
struct OpenCall {
    /// Tells a reused id's calls apart: only the call that opened the entry may close it.
    generation: u64,
    task: AbortHandle,
    /// Cancelled by the call's cancel frame.
    cancel: CancellationToken,
}

/// The open calls of one stream, shared by the reader and the call tasks.
type OpenCalls = Arc<Mutex<HashMap<u64, OpenCall>>>;

fn lock_open(open: &OpenCalls) -> std::sync::MutexGuard<'_, HashMap<u64, OpenCall>> {
    open.lock().unwrap_or_else(|p| p.into_inner())
}

fn abort_open(open: &OpenCalls) {
    for (_, call) in lock_open(open).drain() {
        call.task.abort();
    }
}

async fn run_calls<S, H, F, T>(
    inbound: S,
    handler: H,
    max_open_calls: usize,
    closing: CancellationToken,
    on_cancel: OnCancel,
    replies: mpsc::Sender<Outcome<T>>,
) where
    S: Stream<Item = Result<CallFrame, Status>> + Send + 'static,
    H: Fn(IncomingCall) -> F + Send + 'static,
    F: Future<Output = Result<T, Status>> + Send + 'static,
    T: Send + 'static,
{
    let mut inbound = std::pin::pin!(inbound);
    let open: OpenCalls = Arc::default();
    // A call holds a permit from when it is accepted until its reply is queued: a caller that
    // does not read its replies is refused new calls rather than making finished calls (and
    // their replies) pile up here.
    let unanswered = Arc::new(tokio::sync::Semaphore::new(max_open_calls));
    let tasks = TaskTracker::new();
    let mut generation = 0u64;
    let mut closed = false;
    loop {
        tokio::select! {
            // Closing first: once it is cancelled, no further frame is read.
            biased;
            () = closing.cancelled() => {
                closed = true;
                break;
            },
            frame = inbound.next() => match frame {
                Some(Ok(frame)) => {
                    if frame.cancel {
                        // The call stays open until it has stopped and the acknowledgement is
                        // on its way.
                        if let Some(call) = lock_open(&open).get(&frame.call_id) {
                            call.cancel.cancel();
                        }
                        continue;
                    }
                    let call_id = frame.call_id;
                    let already_open = lock_open(&open).contains_key(&call_id);
                    let permit = if already_open {
                        None
                    } else {
                        unanswered.clone().try_acquire_owned().ok()
                    };
                    let refused = if already_open {
                        Some(crate::errors::status_with_reason(
                            Code::InvalidArgument,
                            format!(
                                "call_id {call_id} is already open on this stream; use a new id per call (the open call still gets its own reply)"
                            ),
                            crate::errors::reason::CALL_ID_IN_USE,
                            [("call_id".to_string(), call_id.to_string())],
                        ))
                    } else if permit.is_none() {
                        // Not read into a handler: safe to send elsewhere or again later.
                        Some(crate::errors::status_with_retry(
                            Code::Unavailable,
                            format!(
                                "{max_open_calls} calls are already open on this stream; the call was not handled: retry after the hint, or wait for replies"
                            ),
                            crate::errors::reason::OVERLOADED,
                            [("max_open_calls".to_string(), max_open_calls.to_string())],
                            OVERLOADED_RETRY_AFTER,
                        ))
                    } else if metadata_len(&frame.metadata) > MAX_CALL_METADATA_BYTES {
                        let size = metadata_len(&frame.metadata);
                        Some(crate::errors::status_with_reason(
                            Code::ResourceExhausted,
                            format!(
                                "call {call_id}'s metadata is {size} bytes, over the limit of {MAX_CALL_METADATA_BYTES} bytes; put large values in the message"
                            ),
                            crate::errors::reason::PAYLOAD_TOO_LARGE,
                            [
                                ("size_bytes".to_string(), size.to_string()),
                                ("limit_bytes".to_string(), MAX_CALL_METADATA_BYTES.to_string()),
                            ],
                        ))
                    } else if frame.message.is_none() {
                        Some(crate::errors::status_with_reason(
                            Code::InvalidArgument,
                            format!(
                                "the frame for call_id {call_id} carries no message and is not a cancel (an empty frame?); send {{\"call_id\": N, \"message\": {{...}}}} to start a call or {{\"call_id\": N, \"cancel\": true}} to cancel one"
                            ),
                            crate::errors::reason::INVALID_FRAME,
                            [("call_id".to_string(), call_id.to_string())],
                        ))
                    } else {
                        None
                    };
                    if let Some(status) = refused {
                        if replies.send(Ok((call_id, Err(status)))).await.is_err() {
                            break;
                        }
                        continue;
                    }
                    let received_at = Instant::now();
                    let cancel = CancellationToken::new();
                    let call = IncomingCall {
                        call_id,
                        message: frame.message.unwrap_or_default(),
                        received_at,
                        deadline: (frame.timeout_ms > 0).then(|| {
                            received_at + Duration::from_millis(u64::from(frame.timeout_ms))
                        }),
                        metadata: frame.metadata,
                        cancelled: cancel.clone(),
                    };
                    // Boxed at once: a handler's future can be several KiB (the router's is),
                    // and each move on the way into the task would copy all of it.
                    let run = AssertUnwindSafe(Box::pin(handler(call))).catch_unwind();
                    generation += 1;
                    let this = generation;
                    let task_open = open.clone();
                    let task_replies = replies.clone();
                    // The entry is made under the lock the task needs to close it, so a call
                    // that finishes at once still finds it.
                    let mut open = lock_open(&open);
                    let task_cancel = cancel.clone();
                    let task = tasks.spawn(async move {
                        let run = async move {
                            run.await
                                .unwrap_or_else(|_| Err(Status::internal("the handler panicked")))
                        };
                        let outcome = match on_cancel {
                            OnCancel::Tell => run.await,
                            // The handler's future is dropped before the acknowledgement goes.
                            OnCancel::Drop => tokio::select! {
                                biased;
                                () = task_cancel.cancelled() => Err(cancelled_status()),
                                outcome = run => outcome,
                            },
                        };
                        // The reply (for a cancelled call, the acknowledgement) goes out only
                        // while this call still owns its id. The id is closed before the reply
                        // is sent, so the caller may reuse it as soon as the reply arrives.
                        let owner = {
                            let mut open = lock_open(&task_open);
                            let owns = open.get(&call_id).is_some_and(|c| c.generation == this);
                            if owns {
                                open.remove(&call_id);
                            }
                            owns
                        };
                        if owner {
                            let _ = task_replies.send(Ok((call_id, outcome))).await;
                        }
                        drop(permit);
                    });
                    open.insert(
                        call_id,
                        OpenCall {
                            generation: this,
                            task: task.abort_handle(),
                            cancel,
                        },
                    );
                }
                Some(Err(status)) => {
                    let _ = replies.send(Err(status)).await;
                    abort_open(&open);
                    return;
                }
                None => break,
            },
            () = replies.closed() => {
                abort_open(&open);
                return;
            },
        }
    }
    // Reading stopped: the open calls still answer as they finish. The stream ends when the
    // last of them has (every reply sender is gone), after the closing status when closing.
    tasks.close();
    tokio::select! {
        () = tasks.wait() => {
            if closed {
                let _ = replies.send(Err(closing_status())).await;
            }
        },
        () = replies.closed() => abort_open(&open),
    }
}

/// The status that ends a multiplexed stream whose callee stopped taking calls (see
/// [`serve`]): UNAVAILABLE with reason `INSTANCE_DRAINING`. Calls without a reply were not
/// read and may be sent elsewhere.
pub fn closing_status() -> Status {
    crate::errors::status_with_reason(
        Code::Unavailable,
        "the callee is shutting down and read no more calls from this stream; calls without a reply were not handled, send them elsewhere",
        crate::errors::reason::INSTANCE_DRAINING,
        [],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use reach_proto::v1::{Part, Payload};
    use tokio::sync::Semaphore;

    /// A link whose callee is `serve` in-process, running `handler`.
    fn link<H, F>(handler: H, closing: CancellationToken) -> MuxLink<HandleMuxResponse>
    where
        H: Fn(IncomingCall) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Result<ReachMessage, Status>> + Send + 'static,
    {
        MuxLink::new(
            "the test callee",
            Arc::new(move |frames: ReceiverStream<CallFrame>| {
                let replies = serve(frames.map(Ok), handler.clone(), 16, closing.clone());
                Box::pin(async move {
                    Ok(replies
                        .map(|item| {
                            item.map(|(call_id, outcome)| HandleMuxResponse {
                                frame: Some(reply_frame(call_id, outcome)),
                            })
                        })
                        .boxed())
                })
            }),
        )
    }

    /// [`serve`] fed by a channel of `queue` frames: the frame sender and the outcomes.
    fn served<H, F>(
        handler: H,
        max_open_calls: usize,
        queue: usize,
    ) -> (
        mpsc::Sender<CallFrame>,
        BoxStream<'static, Outcome<ReachMessage>>,
    )
    where
        H: Fn(IncomingCall) -> F + Send + 'static,
        F: Future<Output = Result<ReachMessage, Status>> + Send + 'static,
    {
        let (frames, frames_rx) = mpsc::channel(queue);
        let replies = serve(
            ReceiverStream::new(frames_rx).map(Ok),
            handler,
            max_open_calls,
            CancellationToken::new(),
        );
        (frames, replies.boxed())
    }

    /// A handler answering each call with its own message.
    async fn echo(call: IncomingCall) -> Result<ReachMessage, Status> {
        Ok(call.message)
    }

    fn text(message: &ReachMessage) -> String {
        match message
            .payload
            .as_ref()
            .and_then(|p| p.parts.first())
            .and_then(|p| p.content.as_ref())
        {
            Some(reach_proto::v1::part::Content::Text(t)) => t.clone(),
            _ => String::new(),
        }
    }

    fn call(text: &str) -> OutgoingCall {
        OutgoingCall {
            message: ReachMessage {
                header: None,
                payload: Some(Payload {
                    r#type: "t".into(),
                    parts: vec![Part {
                        content: Some(reach_proto::v1::part::Content::Text(text.into())),
                        ..Part::default()
                    }],
                }),
            },
            ..OutgoingCall::default()
        }
    }

    #[tokio::test]
    async fn closing_answers_the_calls_read_and_refuses_the_rest_as_not_delivered() {
        let gate = Arc::new(Semaphore::new(0));
        let handled = Arc::new(AtomicU64::new(0));
        let closing = CancellationToken::new();
        let handler = {
            let (gate, handled) = (gate.clone(), handled.clone());
            move |call: IncomingCall| {
                let (gate, handled) = (gate.clone(), handled.clone());
                async move {
                    handled.fetch_add(1, Ordering::SeqCst);
                    let _permit = gate.acquire().await;
                    Ok(call.message)
                }
            }
        };
        let link = Arc::new(link(handler, closing.clone()));
        let first = tokio::spawn({
            let link = link.clone();
            async move { link.call(call("one")).await }
        });
        while handled.load(Ordering::SeqCst) < 1 {
            tokio::task::yield_now().await;
        }
        // The callee starts draining; a call sent afterwards is never read.
        closing.cancel();
        let late = tokio::spawn({
            let link = link.clone();
            async move { link.call(call("late")).await }
        });
        tokio::task::yield_now().await;
        gate.add_permits(10);
        let reply = first
            .await
            .unwrap()
            .expect("the call read before closing is answered");
        assert_eq!(text(&outcome_of(reply.frame).unwrap()), "one");
        match late.await.unwrap() {
            Err(MuxError::Failed(status)) => {
                assert_eq!(status.code(), Code::Unavailable);
                assert_eq!(
                    crate::errors::reason_of(&status).as_deref(),
                    Some(crate::errors::reason::INSTANCE_DRAINING),
                    "{status:?}"
                );
            }
            other => panic!("the late call must be refused as not delivered: {other:?}"),
        }
        assert_eq!(handled.load(Ordering::SeqCst), 1, "the late call never ran");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_id_may_be_reused_as_soon_as_its_reply_arrives() {
        let (frames, mut replies) = served(echo, 16, 4);
        for round in 0..500 {
            let started = call(&round.to_string());
            frames
                .send(CallFrame {
                    call_id: 7,
                    message: Some(started.message),
                    ..CallFrame::default()
                })
                .await
                .unwrap();
            let (call_id, outcome) = replies.next().await.unwrap().unwrap();
            assert_eq!(call_id, 7);
            let reply = outcome.unwrap_or_else(|s| panic!("round {round}: {s:?}"));
            assert_eq!(text(&reply), round.to_string());
        }
    }

    #[tokio::test]
    async fn a_call_over_the_open_call_limit_is_refused_as_overloaded_not_run() {
        let ran = Arc::new(AtomicU64::new(0));
        let handler = {
            let ran = ran.clone();
            move |_call: IncomingCall| {
                ran.fetch_add(1, Ordering::SeqCst);
                std::future::pending::<Result<ReachMessage, Status>>()
            }
        };
        let (frames, mut replies) = served(handler, 1, 4);
        for call_id in [1, 2] {
            frames
                .send(CallFrame {
                    call_id,
                    message: Some(call("x").message),
                    ..CallFrame::default()
                })
                .await
                .unwrap();
        }
        let (call_id, outcome) = replies.next().await.unwrap().unwrap();
        assert_eq!(call_id, 2);
        let status = outcome.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(
            crate::errors::reason_of(&status).as_deref(),
            Some(crate::errors::reason::OVERLOADED)
        );
        assert_eq!(ran.load(Ordering::SeqCst), 1, "only the first call ran");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caller_that_reads_no_replies_cannot_make_finished_calls_pile_up() {
        let ran = Arc::new(AtomicU64::new(0));
        let handler = {
            let ran = ran.clone();
            move |call: IncomingCall| {
                ran.fetch_add(1, Ordering::SeqCst);
                async move { Ok(call.message) }
            }
        };
        const MAX_OPEN: usize = 64;
        let (frames, replies) = served(handler, MAX_OPEN, 16);
        // Far more calls than the reply queue and the open-call limit hold, none read.
        let sender = tokio::spawn(async move {
            for call_id in 0..(OUTBOUND_QUEUE as u64 + 2000) {
                let frame = CallFrame {
                    call_id,
                    message: Some(call("x").message),
                    ..CallFrame::default()
                };
                if frames.send(frame).await.is_err() {
                    return;
                }
            }
        });
        // Until the callee stops taking calls (or has run them all).
        let mut last = u64::MAX;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let now = ran.load(Ordering::SeqCst);
            if now == last {
                break;
            }
            last = now;
        }
        // Queued replies plus the calls holding a permit while they wait to queue theirs; the
        // rest were refused (or not read), never run.
        let bound = (OUTBOUND_QUEUE + MAX_OPEN + 1) as u64;
        let ran = ran.load(Ordering::SeqCst);
        assert!(ran <= bound, "{ran} calls ran, more than {bound}");
        drop(replies);
        sender.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancel_is_acknowledged_once_the_call_stopped_then_its_id_is_free() {
        // "hang" never finishes on its own; anything else is echoed.
        let handler = |call: IncomingCall| async move {
            if text(&call.message) == "hang" {
                std::future::pending::<()>().await;
            }
            Ok(call.message)
        };
        let (frames, mut replies) = served(handler, 16, 16);
        let start = |text: &str| CallFrame {
            call_id: 5,
            message: Some(call(text).message),
            ..CallFrame::default()
        };
        frames.send(start("hang")).await.unwrap();
        frames
            .send(CallFrame {
                call_id: 5,
                cancel: true,
                ..CallFrame::default()
            })
            .await
            .unwrap();
        let (call_id, outcome) = replies.next().await.unwrap().unwrap();
        assert_eq!(call_id, 5);
        assert_eq!(
            outcome.unwrap_err().code(),
            Code::Cancelled,
            "the cancel is acknowledged"
        );
        frames.send(start("second")).await.unwrap();
        drop(frames);
        let mut answered = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(item) = replies.next().await {
                let (call_id, outcome) = item.unwrap();
                answered.push((call_id, outcome.map(|m| text(&m)).unwrap_or_default()));
            }
        })
        .await
        .expect("the stream ended: the cancelled call was stopped");
        assert_eq!(answered, vec![(5, "second".to_string())]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_on_cancel_tell_the_handler_finishes_and_its_outcome_is_the_acknowledgement() {
        let handler = |call: IncomingCall| async move {
            call.cancelled.cancelled().await;
            Err::<ReachMessage, _>(Status::aborted("stopped after cleaning up"))
        };
        let (frames, frames_rx) = mpsc::channel(4);
        let mut replies = serve_with(
            ReceiverStream::new(frames_rx).map(Ok),
            handler,
            16,
            CancellationToken::new(),
            OnCancel::Tell,
        )
        .boxed();
        frames
            .send(CallFrame {
                call_id: 9,
                message: Some(call("x").message),
                ..CallFrame::default()
            })
            .await
            .unwrap();
        frames
            .send(CallFrame {
                call_id: 9,
                cancel: true,
                ..CallFrame::default()
            })
            .await
            .unwrap();
        let (call_id, outcome) = replies.next().await.unwrap().unwrap();
        assert_eq!(call_id, 9);
        assert_eq!(outcome.unwrap_err().code(), Code::Aborted);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_calls_hold_is_kept_until_the_callee_acknowledges_the_cancel() {
        // The callee lets each handler finish (OnCancel::Tell) once `release` lets it.
        let release = Arc::new(Semaphore::new(0));
        let started = Arc::new(tokio::sync::Notify::new());
        let handler = {
            let (release, started) = (release.clone(), started.clone());
            move |call: IncomingCall| {
                let (release, started) = (release.clone(), started.clone());
                async move {
                    started.notify_one();
                    let _permit = release.acquire().await;
                    Ok(call.message)
                }
            }
        };
        let link = MuxLink::<HandleMuxResponse>::new(
            "the test callee",
            Arc::new(move |frames: ReceiverStream<CallFrame>| {
                let replies = serve_with(
                    frames.map(Ok),
                    handler.clone(),
                    16,
                    CancellationToken::new(),
                    OnCancel::Tell,
                );
                Box::pin(async move {
                    Ok(replies
                        .map(|item| {
                            item.map(|(call_id, outcome)| HandleMuxResponse {
                                frame: Some(reply_frame(call_id, outcome)),
                            })
                        })
                        .boxed())
                })
            }),
        );
        let (held_tx, mut held_rx) = tokio::sync::mpsc::channel::<()>(1);
        let mut outgoing = call("slow");
        outgoing.hold = Some(Box::new(held_tx));
        let waiting = link.call(outgoing);
        tokio::select! {
            _ = waiting => panic!("the handler waits for its release"),
            () = started.notified() => {}
        }
        // The waiting future is gone (cancel frame sent), but the callee still runs the call:
        // the hold is kept.
        assert!(
            held_rx.try_recv().is_err(),
            "the hold is still kept while the callee runs the call"
        );
        release.add_permits(1);
        // The handler's reply acknowledges the cancel: the hold is dropped (the channel closes).
        tokio::time::timeout(Duration::from_secs(5), held_rx.recv())
            .await
            .expect("the hold went once the callee answered");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_dropped_before_its_frame_was_queued_is_forgotten_not_cancelled() {
        // A callee that reads no frame: the outbound queue fills up.
        let (frames_tx, _frames) = std::sync::mpsc::channel::<ReceiverStream<CallFrame>>();
        let frames_tx = std::sync::Mutex::new(frames_tx);
        let link = Arc::new(MuxLink::<HandleMuxResponse>::new(
            "the test callee",
            Arc::new(move |frames: ReceiverStream<CallFrame>| {
                let _ = frames_tx.lock().unwrap().send(frames);
                Box::pin(async { Ok(futures::stream::pending().boxed()) })
            }),
        ));
        for _ in 0..OUTBOUND_QUEUE {
            let link = link.clone();
            tokio::spawn(async move { link.call(call("queued")).await });
        }
        // Paused time advances only once every task waits: the queue is full by then.
        tokio::time::sleep(Duration::from_millis(1)).await;
        let (held_tx, mut held_rx) = tokio::sync::mpsc::channel::<()>(1);
        let mut outgoing = call("never sent");
        outgoing.hold = Some(Box::new(held_tx));
        let waited = tokio::time::timeout(Duration::from_millis(10), link.call(outgoing)).await;
        assert!(waited.is_err(), "the call waited for room in the queue");
        assert!(
            matches!(
                held_rx.try_recv(),
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected)
            ),
            "the hold of a call that was never sent is released at once"
        );
        let session = link.live().expect("the stream is still open");
        let state = session.waiting.lock();
        assert!(
            state.cancelled.is_empty(),
            "no cancel awaits an acknowledgement"
        );
        assert_eq!(state.calls.len(), OUTBOUND_QUEUE);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refused_frames_say_why_and_leave_the_open_call_alone() {
        let handler = |call: IncomingCall| async move {
            if text(&call.message) == "slow" {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(call.message)
        };
        let (frames, mut replies) = served(handler, 16, 16);
        let start = |call_id: u64, body: &str| CallFrame {
            call_id,
            message: Some(call(body).message),
            ..CallFrame::default()
        };
        for frame in [
            start(7, "slow"),
            start(7, "again"),
            CallFrame {
                call_id: 8,
                ..CallFrame::default()
            },
        ] {
            frames.send(frame).await.unwrap();
        }
        drop(frames);
        let mut answered = Vec::new();
        while let Some(item) = replies.next().await {
            let (call_id, outcome) = item.unwrap();
            answered.push((
                call_id,
                outcome.map_or_else(
                    |status| crate::errors::reason_of(&status).unwrap_or_default(),
                    |m| text(&m),
                ),
            ));
        }
        answered.sort();
        assert_eq!(
            answered,
            vec![
                (7, crate::errors::reason::CALL_ID_IN_USE.to_string()),
                (7, "slow".to_string()),
                (8, crate::errors::reason::INVALID_FRAME.to_string()),
            ]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancel_that_arrives_after_the_reply_changes_nothing() {
        let (frames, mut replies) = served(echo, 16, 16);
        frames
            .send(CallFrame {
                call_id: 5,
                message: Some(call("first").message),
                ..CallFrame::default()
            })
            .await
            .unwrap();
        let (call_id, outcome) = replies.next().await.unwrap().unwrap();
        assert_eq!((call_id, text(&outcome.unwrap())), (5, "first".to_string()));
        // Too late to cancel: nothing is open under the id, and it is free for a new call.
        for frame in [
            CallFrame {
                call_id: 5,
                cancel: true,
                ..CallFrame::default()
            },
            CallFrame {
                call_id: 5,
                message: Some(call("second").message),
                ..CallFrame::default()
            },
        ] {
            frames.send(frame).await.unwrap();
        }
        drop(frames);
        let (call_id, outcome) = replies.next().await.unwrap().unwrap();
        assert_eq!(
            (call_id, text(&outcome.unwrap())),
            (5, "second".to_string())
        );
        assert!(replies.next().await.is_none());
    }

    #[tokio::test]
    async fn oversized_call_metadata_fails_only_that_call() {
        let (frames, mut replies) = served(echo, 16, 4);
        let mut metadata = HashMap::new();
        metadata.insert("x-big".to_string(), "a".repeat(MAX_CALL_METADATA_BYTES));
        frames
            .send(CallFrame {
                call_id: 1,
                message: Some(call("big").message),
                metadata,
                ..CallFrame::default()
            })
            .await
            .unwrap();
        let (_, outcome) = replies.next().await.unwrap().unwrap();
        let status = outcome.unwrap_err();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            crate::errors::reason_of(&status).as_deref(),
            Some(crate::errors::reason::PAYLOAD_TOO_LARGE)
        );
        frames
            .send(CallFrame {
                call_id: 2,
                message: Some(call("small").message),
                ..CallFrame::default()
            })
            .await
            .unwrap();
        let (call_id, outcome) = replies.next().await.unwrap().unwrap();
        assert_eq!((call_id, text(&outcome.unwrap())), (2, "small".to_string()));
    }

    #[tokio::test]
    async fn dropping_a_waiting_call_cancels_it_at_the_callee() {
        let dropped = Arc::new(tokio::sync::Notify::new());
        let started = Arc::new(tokio::sync::Notify::new());
        let handler = {
            let (dropped, started) = (dropped.clone(), started.clone());
            move |_call: IncomingCall| {
                let (dropped, started) = (dropped.clone(), started.clone());
                async move {
                    struct OnDrop(Arc<tokio::sync::Notify>);
                    impl Drop for OnDrop {
                        fn drop(&mut self) {
                            self.0.notify_one();
                        }
                    }
                    let _guard = OnDrop(dropped);
                    started.notify_one();
                    std::future::pending::<Result<ReachMessage, Status>>().await
                }
            }
        };
        let link = link(handler, CancellationToken::new());
        let waiting = link.call(call("slow"));
        tokio::select! {
            _ = waiting => panic!("the handler never answers"),
            () = started.notified() => {}
        }
        // The call future is dropped here: a cancel frame reaches the callee.
        tokio::time::timeout(Duration::from_secs(5), dropped.notified())
            .await
            .expect("the callee dropped the cancelled call");
        // The stream is still usable and no reply for the cancelled call is pending.
        assert_eq!(link.streams_opened(), 1);
    }
}
