//! What an agent implements: handlers for unary messages and streams.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use reach_proto::v1::{Payload, ReachMessage};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::warn;

use crate::models::ModelSlots;

/// What a handler knows about the message it handles.
#[derive(Clone, Debug)]
pub struct HandlerContext {
    /// The message's W3C trace id (32 lowercase hex).
    pub trace_id: String,
    /// The message's task id ("" when none).
    pub task_id: String,
    /// The message's id.
    pub message_id: String,
    /// The message's `header.turn`: how many agent hops its conversation has taken. A call
    /// made on its behalf goes at `turn + 1` ([`crate::CallOptions::within`]); the router
    /// refuses turns above its `max_turn`.
    pub turn: u32,
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
    /// Header metadata for the reply (see [`HandlerContext::set_reply_metadata`]); shared by
    /// every clone of this context.
    pub reply_metadata: ReplyMetadata,
    /// This instance's model call slots: wrap each model call in
    /// [`ModelSlots::acquire`] so heartbeats report the model's load.
    pub model_slots: ModelSlots,
    /// Who the call is from, as the router verified it (`x-reach-caller`): set only when this
    /// agent serves TLS and the call came over a connection whose client certificate is the
    /// router's (`spiffe://<trust-domain>/router`), so it can be relied on without
    /// authenticating the caller again. `None` for anonymous callers, plaintext agents and
    /// calls from anyone else.
    pub caller: Option<reach_trust::Identity>,
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

    /// Adds `key` = `value` to the reply's `header.metadata` (for example the model tokens
    /// the reply cost, `reach_rpc::usage::TokenUsage::write`); setting a key again replaces
    /// its value. Bounded: at most [`MAX_REPLY_METADATA_ENTRIES`] entries, keys of at most
    /// [`MAX_REPLY_METADATA_KEY_BYTES`] bytes and values of at most
    /// [`MAX_REPLY_METADATA_VALUE_BYTES`]; an entry past a bound is dropped with a warning.
    /// Returns whether it was kept.
    pub fn set_reply_metadata(&self, key: impl Into<String>, value: impl Into<String>) -> bool {
        self.reply_metadata.set(key, value)
    }
}

/// The most reply metadata entries a handler may set.
pub const MAX_REPLY_METADATA_ENTRIES: usize = 64;
/// The longest reply metadata key, in bytes.
pub const MAX_REPLY_METADATA_KEY_BYTES: usize = 128;
/// The longest reply metadata value, in bytes.
pub const MAX_REPLY_METADATA_VALUE_BYTES: usize = 1024;

/// Header metadata a handler adds to its reply, bounded; clones share the entries. The
/// runtime copies them into the reply envelope's `header.metadata`: once for a unary reply
/// (Handle, HandleMux), and for a stream, the entries set since the previous reply with
/// each reply.
#[derive(Clone, Debug, Default)]
pub struct ReplyMetadata {
    entries: Arc<Mutex<HashMap<String, String>>>,
}

impl ReplyMetadata {
    /// Sets `key` = `value` within the bounds (see [`HandlerContext::set_reply_metadata`]);
    /// returns whether it was kept.
    pub fn set(&self, key: impl Into<String>, value: impl Into<String>) -> bool {
        let (key, value) = (key.into(), value.into());
        if key.is_empty() || key.len() > MAX_REPLY_METADATA_KEY_BYTES {
            warn!(
                key_bytes = key.len(),
                limit = MAX_REPLY_METADATA_KEY_BYTES,
                "reply metadata key empty or too long; dropped"
            );
            return false;
        }
        if value.len() > MAX_REPLY_METADATA_VALUE_BYTES {
            warn!(%key, value_bytes = value.len(), limit = MAX_REPLY_METADATA_VALUE_BYTES, "reply metadata value too long; dropped");
            return false;
        }
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.len() >= MAX_REPLY_METADATA_ENTRIES && !entries.contains_key(&key) {
            warn!(%key, limit = MAX_REPLY_METADATA_ENTRIES, "too many reply metadata entries; dropped");
            return false;
        }
        entries.insert(key, value);
        true
    }

    /// The entries set so far (a copy).
    pub fn entries(&self) -> HashMap<String, String> {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Takes the entries set so far, leaving none.
    pub fn take(&self) -> HashMap<String, String> {
        std::mem::take(&mut *self.entries.lock().unwrap_or_else(|p| p.into_inner()))
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
