//! What an agent implements: handlers for unary messages and streams.

use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use reach_proto::v1::{Payload, ReachMessage};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// What a handler knows about the message it handles.
#[derive(Clone, Debug)]
pub struct HandlerContext {
    /// The message's W3C trace id (32 lowercase hex).
    pub trace_id: String,
    /// The message's task id ("" when none).
    pub task_id: String,
    /// The message's id.
    pub message_id: String,
    /// The capability the message addressed ("" when it addressed the service).
    pub capability: String,
    /// When the caller stops waiting, if it set a deadline.
    pub deadline: Option<Instant>,
    /// Cancelled when the caller goes away or the deadline passes: long work should
    /// `select!` on [`CancellationToken::cancelled`] and stop.
    pub cancellation: CancellationToken,
    /// This instance's id.
    pub instance_id: Arc<str>,
    /// Where an asynchronous reply goes ("" when the caller waits for the handler's return
    /// value). When set, a handler may return [`HandlerContext::ack`] at once and send the
    /// answer later with [`crate::MeshClient::reply`].
    pub reply_to: String,
}

impl HandlerContext {
    /// The acknowledgement payload: return it to answer asynchronously later.
    pub fn ack() -> Payload {
        Payload {
            r#type: reach_rpc::ACK_PAYLOAD_TYPE.to_string(),
            parts: Vec::new(),
        }
    }

    /// Whether the call has been cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.cancellation.is_cancelled()
    }
}

/// Handles one message and returns the reply payload. The SDK wraps the payload in an
/// envelope that answers the request (same trace and task, `correlation_id` = request id).
///
/// Implemented for every `Fn(HandlerContext, ReachMessage) -> impl Future<Output =
/// Result<Payload, Status>>`. Return a `Status` with the right code for failures.
pub trait Handler: Send + Sync + 'static {
    /// Handles `message`.
    fn handle(
        &self,
        ctx: HandlerContext,
        message: ReachMessage,
    ) -> BoxFuture<'static, Result<Payload, Status>>;
}

impl<F, Fut> Handler for F
where
    F: Fn(HandlerContext, ReachMessage) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Payload, Status>> + Send + 'static,
{
    fn handle(
        &self,
        ctx: HandlerContext,
        message: ReachMessage,
    ) -> BoxFuture<'static, Result<Payload, Status>> {
        Box::pin(self(ctx, message))
    }
}

/// The caller's messages on a stream, in order; an `Err` means the caller's side failed.
pub type InboundMessages = BoxStream<'static, Result<ReachMessage, Status>>;

/// Handles a bidirectional stream: consumes the caller's messages and produces reply
/// payloads. Ending the returned stream closes the call with OK; yielding an `Err` closes it
/// with that status (after the payloads already yielded).
pub trait StreamHandler: Send + Sync + 'static {
    /// Handles one stream. `first` is the message that opened it.
    fn handle(
        &self,
        ctx: HandlerContext,
        first: ReachMessage,
        rest: InboundMessages,
    ) -> BoxStream<'static, Result<Payload, Status>>;
}

impl<F, S> StreamHandler for F
where
    F: Fn(HandlerContext, ReachMessage, InboundMessages) -> S + Send + Sync + 'static,
    S: futures::Stream<Item = Result<Payload, Status>> + Send + 'static,
{
    fn handle(
        &self,
        ctx: HandlerContext,
        first: ReachMessage,
        rest: InboundMessages,
    ) -> BoxStream<'static, Result<Payload, Status>> {
        Box::pin(self(ctx, first, rest))
    }
}
