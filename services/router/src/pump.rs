//! The two halves of a routed stream, as concrete `Stream`s.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::StreamExt;
use prost::Message as _;
use reach_proto::v1::{
    HandleStreamRequest, HandleStreamResponse, Header, ReachMessage, StreamRequest, StreamResponse,
};
use reach_rpc::trace::{self, TraceId};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tonic::{Status, Streaming};

use std::sync::Arc;

use reach_protocol::Adapter;

use crate::error::RouteError;
use crate::load::InFlight;
use crate::protocol::{AdapterExt, ProtocolRegistry};

/// The caller-to-instance half of a routed stream: the first message, then the rest, each
/// checked against the capability's input schema (when the router validates payloads),
/// adapted to the instance's version (when the stream has an adapter), checked (size, trace
/// id, TTL and `created_at` as a call's) and completed (trace id, message id, creation time).
/// A violation ends the inbound half and hands the error to the outbound half, which ends the
/// call with it.
pub struct InboundPump {
    first: Option<ReachMessage>,
    rest: Streaming<StreamRequest>,
    trace_id: String,
    checks: InboundChecks,
    adapter: Option<Adapter>,
    abort: Option<oneshot::Sender<Status>>,
}

/// What every later message of a stream is checked against, as a call's message is.
pub struct InboundChecks {
    /// The size limit, bytes (encoded, after adapting).
    pub max_message_bytes: usize,
    /// How far ahead of the router's clock `created_at` may be on a message with a TTL.
    pub max_clock_skew: std::time::Duration,
    /// The protocol registry and capability whose input schema each message must match.
    pub validation: Option<(Arc<ProtocolRegistry>, String)>,
}

impl InboundPump {
    /// A pump that sends `first` (already checked and adapted) and then, for each of `rest`,
    /// validates it against `checks`' input schema, adapts it with `adapter`, checks its size
    /// and TTL against `checks` and forwards it.
    pub fn new(
        first: ReachMessage,
        rest: Streaming<StreamRequest>,
        trace_id: String,
        checks: InboundChecks,
        adapter: Option<Adapter>,
        abort: oneshot::Sender<Status>,
    ) -> Self {
        Self {
            first: Some(first),
            rest,
            trace_id,
            checks,
            adapter,
            abort: Some(abort),
        }
    }

    fn complete(&self, mut message: ReachMessage) -> Result<ReachMessage, Status> {
        if let Some((protocols, capability)) = &self.checks.validation {
            crate::protocol::validate_input(protocols, capability, &message)?;
        }
        if let Some(adapter) = &self.adapter {
            adapter.adapt_request(&mut message)?;
        }
        let size = message.encoded_len();
        if size > self.checks.max_message_bytes {
            return Err(RouteError::PayloadTooLarge {
                size,
                limit: self.checks.max_message_bytes,
            }
            .into());
        }
        let header = message.header.get_or_insert_with(Header::default);
        if header.trace_id.is_empty() {
            header.trace_id = self.trace_id.clone();
        } else {
            TraceId::parse(&header.trace_id).map_err(RouteError::from)?;
        }
        if header.message_id.is_empty() {
            header.message_id = trace::new_message_id();
        }
        if header.created_at.is_none() {
            header.created_at = Some(reach_rpc::time::now());
        }
        crate::service::ttl_expiry(header, self.checks.max_clock_skew)?;
        Ok(message)
    }
}

impl futures::Stream for InboundPump {
    type Item = HandleStreamRequest;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(HandleStreamRequest {
                message: Some(first),
            }));
        }
        if self.abort.is_none() {
            return Poll::Ready(None);
        }
        let next = match self.rest.poll_next_unpin(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(Ok(next))) => next,
            // The caller half-closed, or its side broke: half-close towards the instance.
            Poll::Ready(None | Some(Err(_))) => return Poll::Ready(None),
        };
        match self.complete(next.message.unwrap_or_default()) {
            Ok(message) => Poll::Ready(Some(HandleStreamRequest {
                message: Some(message),
            })),
            Err(status) => {
                if let Some(abort) = self.abort.take() {
                    let _ = abort.send(status);
                }
                Poll::Ready(None)
            }
        }
    }
}

/// The instance-to-caller half of a routed stream: the instance's messages (adapted back to
/// the caller's version when the stream has an adapter) and final status, unless the inbound
/// half aborted or the deadline passed first. Holds the stream's in-flight load until it
/// ends.
pub struct OutboundPump {
    agent: Streaming<HandleStreamResponse>,
    adapter: Option<Adapter>,
    /// Resolves with a status when the inbound half aborts; `None` once the inbound half has
    /// ended without aborting.
    abort: Option<oneshot::Receiver<Status>>,
    /// The reservation of the instance serving the stream (which it names when its
    /// connection breaks).
    in_flight: InFlight,
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
    /// A pump over the stream of the instance `in_flight` reserved; `label` (the route) and
    /// `started` feed the stream metrics (`reach_router_streams_total`, `reach_router_stream_duration_seconds`), and
    /// `open` (raised when the stream took its instance) is held until the pump drops.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        agent: Streaming<HandleStreamResponse>,
        abort: oneshot::Receiver<Status>,
        in_flight: InFlight,
        open: reach_telemetry::metrics::GaugeGuard,
        deadline: Option<Instant>,
        adapter: Option<Adapter>,
        label: String,
        started: Instant,
    ) -> Self {
        Self {
            agent,
            adapter,
            abort: Some(abort),
            in_flight: in_flight.for_stream(),
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
        reach_telemetry::metrics::router::stream(
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
                Poll::Ready(Some(Ok(StreamResponse { message })))
            }
            Poll::Ready(Some(Err(status))) => {
                // A status with a local source is the connection failing (the instance went
                // away), not one the instance sent: say so, as UNAVAILABLE.
                let status = match self.in_flight.endpoint() {
                    Some(endpoint) if std::error::Error::source(&status).is_some() => {
                        crate::endpoint::lost_stream_instance(
                            &endpoint.info().instance_id,
                            status.message(),
                        )
                    }
                    _ => status,
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
