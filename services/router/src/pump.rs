//! The two halves of a routed stream, as concrete `Stream`s, and the codec ([`StreamCodec`])
//! through which the inbound half can end the instance's stream as a failure.
//!
//! A stream ends the way it really ended: when the caller resets or cancels its stream (or
//! its connection breaks), or one of its messages is refused, the instance's inbound stream
//! is reset (RST_STREAM), so the agent sees an error, never a clean end of input after the
//! messages it got (which it could take for a complete upload). Only the caller's own
//! half-close reaches the instance as a half-close.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut};
use futures::StreamExt;
use prost::Message as _;
use reach_proto::v1::{
    HandleStreamRequest, HandleStreamResponse, ReachMessage, StreamRequest, StreamResponse,
};
use reach_protocol::Adapter;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tonic::{Status, Streaming};

use crate::endpoint::Reservation;
use crate::envelope::{EnvelopeRules, TraceOrigin};
use crate::error::RouteError;
use crate::metrics;
use crate::protocol::{AdapterExt, ProtocolRegistry};

/// The caller-to-instance half of a routed stream: the first message, then the rest, each
/// admitted by the envelope rules as a call's message is (header completed with the stream's
/// trace id, size, target name, TTL and `created_at`; see [`crate::envelope`]), checked
/// against the capability's input schema (when the router validates payloads) and adapted to
/// the instance's version (when the stream has an adapter; then its size is checked again).
/// A violation ends the inbound half and hands the error to the outbound half, which ends the
/// call with it.
pub struct InboundPump {
    first: Option<ReachMessage>,
    rest: Streaming<StreamRequest>,
    trace_id: String,
    checks: InboundChecks,
    adapter: Option<Adapter>,
    abort: Option<oneshot::Sender<Status>>,
    /// Whether the caller's request body failed rather than ended.
    caller_end: CallerEnd,
}

/// Whether a caller's request body failed (the caller reset its stream, or its connection
/// broke) rather than ended with a half-close. tonic's decoder reports a cancelled request
/// body as a clean end of the stream, so the router watches the body itself (see
/// [`crate::service::WatchCallers`]) and tells the two apart with this, found in the
/// request's extensions. Clones share the record.
#[derive(Debug, Clone, Default)]
pub struct CallerEnd(Arc<std::sync::Mutex<Option<String>>>);

impl CallerEnd {
    /// Records that the body failed, and why.
    pub fn fail(&self, why: String) {
        let mut failure = self.0.lock().unwrap_or_else(|p| p.into_inner());
        failure.get_or_insert(why);
    }

    /// Why the body failed; `None` while it has not.
    pub fn failure(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// What every later message of a stream is checked against, as a call's message is.
pub struct InboundChecks {
    /// The envelope rules (size, TTL, clock skew).
    pub rules: EnvelopeRules,
    /// The protocol registry and capability whose input schema each message must match.
    pub validation: Option<(Arc<ProtocolRegistry>, String)>,
}

impl InboundPump {
    /// A pump that sends `first` (already checked and adapted) and then, for each of `rest`,
    /// admits it with `checks`' envelope rules (completing its header with `trace_id`, the
    /// stream's), validates it against `checks`' input schema, adapts it with `adapter`
    /// and forwards it. `caller_end` tells a caller's reset from its half-close.
    pub fn new(
        first: ReachMessage,
        rest: Streaming<StreamRequest>,
        trace_id: String,
        checks: InboundChecks,
        adapter: Option<Adapter>,
        abort: oneshot::Sender<Status>,
        caller_end: CallerEnd,
    ) -> Self {
        Self {
            first: Some(first),
            rest,
            trace_id,
            checks,
            adapter,
            abort: Some(abort),
            caller_end,
        }
    }

    fn complete(&self, mut message: ReachMessage) -> Result<ReachMessage, RouteError> {
        let rules = &self.checks.rules;
        rules.admit(&mut message, TraceOrigin::Stream(&self.trace_id))?;
        rules.deadline(&message, None)?;
        if let Some((protocols, capability)) = &self.checks.validation {
            crate::protocol::validate_input(protocols, capability, &message)?;
        }
        if let Some(adapter) = &self.adapter {
            adapter.adapt_request(&mut message)?;
            rules.check_bounds(&message)?;
        }
        Ok(message)
    }
}

impl futures::Stream for InboundPump {
    type Item = Outgoing;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Outgoing::Message(HandleStreamRequest {
                message: Some(first),
            })));
        }
        if self.abort.is_none() {
            return Poll::Ready(None);
        }
        let next = match self.rest.poll_next_unpin(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(Ok(next))) => next,
            // The caller half-closed: half-close towards the instance.
            Poll::Ready(None) => {
                // tonic reports a cancelled request body as a clean end; the body's own
                // watcher says whether it was one.
                return match self.caller_end.failure() {
                    None => Poll::Ready(None),
                    Some(why) => {
                        self.abort = None;
                        Poll::Ready(Some(Outgoing::Abort(Status::cancelled(format!(
                            "the caller's stream ended without a half-close ({why})"
                        )))))
                    }
                };
            }
            // The caller reset its stream, or its connection broke: the instance's stream is
            // reset too, never half-closed.
            Poll::Ready(Some(Err(status))) => {
                self.abort = None;
                return Poll::Ready(Some(Outgoing::Abort(Status::cancelled(format!(
                    "the caller's stream ended without a half-close ({}: {})",
                    reach_rpc::errors::code_name(status.code()),
                    status.message()
                )))));
            }
        };
        match self.complete(next.message.unwrap_or_default()) {
            Ok(message) => Poll::Ready(Some(Outgoing::Message(HandleStreamRequest {
                message: Some(message),
            }))),
            Err(error) => {
                let status = Status::from(error);
                if let Some(abort) = self.abort.take() {
                    let _ = abort.send(status.clone());
                }
                Poll::Ready(Some(Outgoing::Abort(status)))
            }
        }
    }
}

/// One item of the caller-to-instance half: a message to send, or the end of the instance's
/// stream as a failure (it is reset, so the agent sees an error on its inbound stream).
#[derive(Debug)]
// A message is what almost every item is; boxing it would allocate per message for the rare
// abort.
#[allow(clippy::large_enum_variant)]
pub enum Outgoing {
    /// The next message.
    Message(HandleStreamRequest),
    /// The stream failed on the caller's side (why, for the router's logs; the instance
    /// sees a reset).
    Abort(Status),
}

/// The codec of a routed stream's call to `AgentService.HandleStream`: protobuf both ways,
/// and an [`Outgoing::Abort`] fails the request body, which resets the instance's stream
/// (tonic's client hands an encoding error to hyper, which answers it with RST_STREAM).
#[derive(Debug, Default, Clone, Copy)]
pub struct StreamCodec;

/// The encoder of [`StreamCodec`].
#[derive(Debug, Default, Clone, Copy)]
pub struct OutgoingEncoder;

/// The decoder of [`StreamCodec`].
#[derive(Debug, Default, Clone, Copy)]
pub struct ResponseDecoder;

impl tonic::codec::Codec for StreamCodec {
    type Encode = Outgoing;
    type Decode = HandleStreamResponse;
    type Encoder = OutgoingEncoder;
    type Decoder = ResponseDecoder;

    fn encoder(&mut self) -> OutgoingEncoder {
        OutgoingEncoder
    }

    fn decoder(&mut self) -> ResponseDecoder {
        ResponseDecoder
    }
}

impl tonic::codec::Encoder for OutgoingEncoder {
    type Item = Outgoing;
    type Error = Status;

    fn encode(
        &mut self,
        item: Outgoing,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        match item {
            Outgoing::Message(message) => {
                dst.reserve(message.encoded_len());
                message
                    .encode(&mut dst.writer().into_inner())
                    .map_err(|e| Status::internal(format!("encoding a stream message: {e}")))
            }
            Outgoing::Abort(status) => Err(status),
        }
    }
}

impl tonic::codec::Decoder for ResponseDecoder {
    type Item = HandleStreamResponse;
    type Error = Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<HandleStreamResponse>, Status> {
        let len = src.remaining();
        HandleStreamResponse::decode(src.copy_to_bytes(len))
            .map(Some)
            .map_err(|e| Status::internal(format!("decoding an instance's stream message: {e}")))
    }
}

/// The instance-to-caller half of a routed stream: the instance's messages (adapted back to
/// the caller's version when the stream has an adapter, each held to the message size limit)
/// and final status, unless the inbound half aborted or the deadline passed first. Holds the
/// stream's in-flight load until it ends.
pub struct OutboundPump {
    agent: Streaming<HandleStreamResponse>,
    adapter: Option<Adapter>,
    /// The largest message forwarded to the caller (`router.max_message_bytes`), in bytes.
    max_message_bytes: usize,
    /// Resolves with a status when the inbound half aborts; `None` once the inbound half has
    /// ended without aborting.
    abort: Option<oneshot::Receiver<Status>>,
    /// The reservation of the instance serving the stream (which it names when its
    /// connection breaks).
    reserved: Reservation,
    /// `reach_router_open_streams` for the route, until the pump drops.
    _open: reach_telemetry::metrics::GaugeGuard,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    done: bool,
    /// The route label and start, for the stream metrics recorded when the pump drops.
    label: String,
    started: Instant,
    /// The final code once the stream ended; `None` (recorded as CANCELLED) when the caller
    /// went away first.
    code: Option<tonic::Code>,
}

impl OutboundPump {
    /// A pump over the stream of the instance `reserved` is on; `label` (the route) and
    /// `started` feed the stream metrics (`reach_router_streams_total`, `reach_router_stream_duration_seconds`), and
    /// `open` (raised when the stream took its instance) is held until the pump drops. A
    /// message of the instance's over `max_message_bytes` (after adapting) ends the stream
    /// with RESOURCE_EXHAUSTED / `PAYLOAD_TOO_LARGE`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        agent: Streaming<HandleStreamResponse>,
        abort: oneshot::Receiver<Status>,
        reserved: Reservation,
        open: reach_telemetry::metrics::GaugeGuard,
        deadline: Option<Instant>,
        adapter: Option<Adapter>,
        max_message_bytes: usize,
        label: String,
        started: Instant,
    ) -> Self {
        Self {
            agent,
            adapter,
            max_message_bytes,
            abort: Some(abort),
            reserved: reserved.for_stream(),
            _open: open,
            deadline: deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
            done: false,
            label,
            started,
            code: None,
        }
    }

    fn finish(&mut self, code: tonic::Code) {
        self.done = true;
        self.code = Some(code);
    }
}

impl Drop for OutboundPump {
    fn drop(&mut self) {
        metrics::stream(
            &self.label,
            self.code.unwrap_or(tonic::Code::Cancelled),
            self.started.elapsed(),
        );
    }
}

impl futures::Stream for OutboundPump {
    type Item = Result<StreamResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        if let Some(abort) = self.abort.as_mut()
            && let Poll::Ready(outcome) = Pin::new(abort).poll(cx)
        {
            self.abort = None;
            if let Ok(status) = outcome {
                self.finish(status.code());
                return Poll::Ready(Some(Err(status)));
            }
        }
        if let Some(deadline) = self.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            self.finish(tonic::Code::DeadlineExceeded);
            return Poll::Ready(Some(Err(Status::deadline_exceeded(
                "the stream's deadline passed before the instance finished",
            ))));
        }
        match self.agent.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(response))) => {
                let mut message = response.message;
                if let (Some(adapter), Some(message)) = (&self.adapter, message.as_mut())
                    && let Err(error) = adapter.adapt_response(message)
                {
                    let status = Status::from(error);
                    self.finish(status.code());
                    return Poll::Ready(Some(Err(status)));
                }
                let size = message.as_ref().map_or(0, prost::Message::encoded_len);
                if size > self.max_message_bytes {
                    let status = Status::from(RouteError::ReplyTooLarge {
                        size,
                        limit: self.max_message_bytes,
                        instance: self.reserved.endpoint().info().instance_id.clone(),
                    });
                    self.finish(status.code());
                    return Poll::Ready(Some(Err(status)));
                }
                Poll::Ready(Some(Ok(StreamResponse { message })))
            }
            Poll::Ready(Some(Err(status))) => {
                // A status with a local source is the connection failing (the instance went
                // away), not one the instance sent: say so, as UNAVAILABLE. A stream that
                // ended without a status is INTERNAL, as on every path.
                let instance_id = &self.reserved.endpoint().info().instance_id;
                let status = if std::error::Error::source(&status).is_some() {
                    crate::endpoint::lost_stream_instance(instance_id, status.message())
                } else if reach_rpc::errors::is_missing_status(&status) {
                    crate::endpoint::missing_status(instance_id)
                } else {
                    status
                };
                self.finish(status.code());
                Poll::Ready(Some(Err(status)))
            }
            Poll::Ready(None) => {
                self.finish(tonic::Code::Ok);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
