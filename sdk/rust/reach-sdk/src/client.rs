//! [`MeshClient`]: calls and streams through the router, addressing capabilities or services.
//!
//! Calls go over one multiplexed `RouterService.CallMux` stream per client (opened on first
//! use, reopened after it breaks; see [`reach_rpc::mux`]), or as unary `Call`s to a router
//! that does not serve it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use prost::Message as _;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{
    CallMuxResponse, CallRequest, CallResponse, Header, Payload, PublishRequest, PublishResponse,
    ReachMessage, ReplyRequest, StreamRequest, StreamResponse, header,
};
use reach_rpc::mux::{MuxError, MuxLink, OutgoingCall};

use crate::handler::HandlerContext;
use reach_rpc::trace::{self, TraceId};
use reach_telemetry::grpc::GrpcClientTrace;
use tonic::transport::Channel;
use tonic::{Status, Streaming};
use tracing::Instrument;

/// Options of one call.
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    /// The deadline, sent as `grpc-timeout` and enforced by router and agent.
    pub timeout: Option<Duration>,
    /// The trace to continue; `None` starts a new trace (a new task's first message).
    pub trace_id: Option<String>,
    /// The task the message belongs to.
    pub task_id: Option<String>,
    /// A semver requirement on the capability version.
    pub capability_version: Option<String>,
    /// The message id; `None` lets the client assign a fresh UUIDv7. Set it to make retries
    /// of the same logical message deduplicated by the receiving agent.
    pub message_id: Option<String>,
    /// The message's `header.turn` (agent hops so far); `None` sends 0, a conversation's
    /// start. The router refuses turns above its `max_turn` (FAILED_PRECONDITION,
    /// `TURN_LIMIT_EXCEEDED`).
    pub turn: Option<u32>,
}

impl CallOptions {
    /// Options for a call a handler makes on behalf of the message `ctx` describes: the same
    /// trace id and task id, `turn` = `ctx.turn + 1`, and a timeout of what is left of
    /// `ctx`'s deadline (zero once it has passed; none when `ctx` has no deadline). Other
    /// fields are unset; set them on the result.
    pub fn within(ctx: &HandlerContext) -> Self {
        Self {
            timeout: ctx
                .deadline
                .map(|deadline| deadline.saturating_duration_since(tokio::time::Instant::now())),
            trace_id: Some(ctx.trace_id.clone()).filter(|t| !t.is_empty()),
            task_id: Some(ctx.task_id.clone()).filter(|t| !t.is_empty()),
            turn: Some(ctx.turn.saturating_add(1)),
            ..Self::default()
        }
    }
}

/// A client of the mesh: every call goes through a router, addressed by capability or
/// service. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct MeshClient {
    router: RouterServiceClient<GrpcClientTrace<Channel>>,
    /// The multiplexed CallMux stream to the router.
    link: Arc<MuxLink<CallMuxResponse>>,
    source: String,
}

/// The largest message the client sends or accepts (bytes); the router enforces its own,
/// usually smaller, limit with PAYLOAD_TOO_LARGE.
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// The largest message sent as a CallMux frame (bytes): the router's default
/// `max_message_bytes`. Larger messages go as unary Calls.
pub const MUX_MAX_MESSAGE_BYTES: usize = 4 << 20;

impl MeshClient {
    /// A client over a channel to a router, sending as `source` (dotted, e.g. `ingest.main`).
    pub fn new(channel: Channel, source: impl Into<String>) -> Self {
        let link = MuxLink::to_router("the router", channel.clone(), MAX_MESSAGE_BYTES);
        Self {
            router: RouterServiceClient::new(reach_telemetry::traced_channel(channel))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            link: Arc::new(link),
            source: source.into(),
        }
    }

    /// Connects to the router at `endpoint` (`http://127.0.0.1:7070`).
    ///
    /// # Errors
    /// When the URL is invalid or the router is unreachable.
    pub async fn connect(
        endpoint: &str,
        source: impl Into<String>,
    ) -> Result<Self, tonic::transport::Error> {
        let channel = reach_rpc::http2::endpoint(endpoint)?.connect().await?;
        Ok(Self::new(channel, source))
    }

    /// Connects to the router at `endpoint` over TLS, presenting `tls`'s certificate and
    /// verifying the router's the SPIFFE way (chained to the CA, in the trust domain).
    ///
    /// # Errors
    /// When the URL is invalid, the router is unreachable or the handshake fails.
    pub async fn connect_tls(
        endpoint: &str,
        source: impl Into<String>,
        tls: &Arc<reach_trust::tls::TlsSource>,
    ) -> Result<Self, tonic::transport::Error> {
        let endpoint = reach_rpc::http2::endpoint(endpoint)?;
        let channel = reach_rpc::http2::channel(&endpoint, Some(tls), None).await?;
        Ok(Self::new(channel, source))
    }

    /// How many multiplexed CallMux streams this client (and its clones) opened to the
    /// router: 1 while the first lives, more after reconnects, 0 when calls go unary (a
    /// router without CallMux). For diagnostics and tests.
    pub fn mux_streams_opened(&self) -> u64 {
        self.link.streams_opened()
    }

    /// A message to `capability` carrying `payload`, with a fresh message id and, unless the
    /// options continue a trace, a fresh trace id.
    pub fn message_to_capability(
        &self,
        capability: &str,
        payload: Payload,
        options: &CallOptions,
    ) -> ReachMessage {
        self.message(
            header::Target::Capability(capability.to_string()),
            payload,
            options,
        )
    }

    /// A message to any instance of `service` carrying `payload`.
    pub fn message_to_service(
        &self,
        service: &str,
        payload: Payload,
        options: &CallOptions,
    ) -> ReachMessage {
        self.message(
            header::Target::Service(service.to_string()),
            payload,
            options,
        )
    }

    fn message(
        &self,
        target: header::Target,
        payload: Payload,
        options: &CallOptions,
    ) -> ReachMessage {
        ReachMessage {
            header: Some(Header {
                message_id: options
                    .message_id
                    .clone()
                    .unwrap_or_else(trace::new_message_id),
                trace_id: options
                    .trace_id
                    .clone()
                    .unwrap_or_else(|| TraceId::random().to_string()),
                task_id: options.task_id.clone().unwrap_or_default(),
                source: self.source.clone(),
                target: Some(target),
                capability_version: options.capability_version.clone().unwrap_or_default(),
                protocol_version: "1.0".into(),
                created_at: Some(reach_rpc::time::now()),
                turn: options.turn.unwrap_or(0),
                ..Header::default()
            }),
            payload: Some(payload),
        }
    }

    /// Calls `capability` with `payload` and returns the reply and where it was handled.
    ///
    /// # Errors
    /// The router's or the agent's status (`NOT_FOUND`/`ROUTE_NOT_FOUND`, `DEADLINE_EXCEEDED`,
    /// the handler's own error, ...).
    pub async fn call(
        &self,
        capability: &str,
        payload: Payload,
        options: CallOptions,
    ) -> Result<CallResponse, Status> {
        let message = self.message_to_capability(capability, payload, &options);
        self.send(message, options.timeout).await
    }

    /// Sends a prepared message through the router (CallMux, or Call when the router does
    /// not serve it).
    ///
    /// # Errors
    /// As [`MeshClient::call`]; DEADLINE_EXCEEDED when `timeout` passes first; UNAVAILABLE
    /// when the connection to the router broke while the call was in flight (it may have
    /// been handled: resend with the same `message_id`); INVALID_ARGUMENT /
    /// `INVALID_PAYLOAD`, without sending, for data nesting deeper than
    /// [`reach_proto::json::MAX_DATA_DEPTH`].
    pub async fn send(
        &self,
        message: ReachMessage,
        timeout: Option<Duration>,
    ) -> Result<CallResponse, Status> {
        if let Some((part, depth)) = message.payload.as_ref().and_then(Payload::too_deep) {
            return Err(reach_rpc::errors::payload_too_deep(part, depth));
        }
        // The edge span belongs to the message's trace, so the `traceparent` sent with the
        // call does too.
        let span = reach_telemetry::message_span("mesh.call", &message);
        // A message over the router's default limit goes unary: over CallMux, a frame above
        // the router's transport limit would end the stream every concurrent call shares,
        // where a unary Call is refused (PAYLOAD_TOO_LARGE) alone.
        let result = if self.link.is_unsupported() || message.encoded_len() > MUX_MAX_MESSAGE_BYTES
        {
            self.send_unary(message, timeout, &span).await
        } else {
            match self.send_mux(message, timeout, &span).await {
                // Not served: the call comes back and goes as a unary Call.
                Err(MuxError::Unsupported(call)) => {
                    self.send_unary(call.message, timeout, &span).await
                }
                Err(error) => Err(error.into()),
                Ok(response) => Ok(response),
            }
        };
        let (code, text) = result
            .as_ref()
            .map_or_else(|s| (s.code(), s.message()), |_| (tonic::Code::Ok, ""));
        reach_telemetry::record_status(&span, code, text);
        result
    }

    async fn send_mux(
        &self,
        message: ReachMessage,
        timeout: Option<Duration>,
        span: &tracing::Span,
    ) -> Result<CallResponse, MuxError> {
        let mut metadata = HashMap::new();
        reach_telemetry::inject_span_map(span, &mut metadata);
        let call = self.link.call(OutgoingCall {
            message,
            timeout,
            metadata,
            hold: None,
        });
        let reply = match timeout {
            Some(timeout) => tokio::time::timeout(timeout, call).await.map_err(|_| {
                MuxError::Failed(Status::deadline_exceeded(format!(
                    "no reply within the call's timeout of {timeout:?}"
                )))
            })??,
            None => call.await?,
        };
        let route = reply.route;
        let message = reach_rpc::mux::outcome_of(reply.frame).map_err(MuxError::Failed)?;
        Ok(CallResponse {
            message: Some(message),
            route,
        })
    }

    async fn send_unary(
        &self,
        message: ReachMessage,
        timeout: Option<Duration>,
        span: &tracing::Span,
    ) -> Result<CallResponse, Status> {
        let mut request = tonic::Request::new(CallRequest {
            message: Some(message),
        });
        if let Some(timeout) = timeout {
            // Sent as grpc-timeout; tonic's channel also enforces it locally.
            request.set_timeout(timeout);
        }
        let mut router = self.router.clone();
        router
            .call(request)
            .instrument(span.clone())
            .await
            .map(tonic::Response::into_inner)
            .map_err(reach_rpc::deadline::normalize_client_status)
    }

    /// Publishes `payload` to every subscriber of `topic`; the response counts deliveries.
    ///
    /// # Errors
    /// The router's status (for example INVALID_ARGUMENT for an empty topic).
    pub async fn publish(
        &self,
        topic: &str,
        payload: Payload,
        options: CallOptions,
    ) -> Result<PublishResponse, Status> {
        let message = self.message(header::Target::Topic(topic.to_string()), payload, &options);
        let mut request = tonic::Request::new(PublishRequest {
            message: Some(message),
        });
        if let Some(timeout) = options.timeout {
            request.set_timeout(timeout);
        }
        let mut router = self.router.clone();
        Ok(router.publish(request).await?.into_inner())
    }

    /// Sends the asynchronous answer to the request `ctx` describes (a handler that returned
    /// [`HandlerContext::ack`]). Any router replica takes it and hands it to the replica
    /// whose caller waits. Returns whether a caller was still waiting.
    ///
    /// # Errors
    /// INVALID_ARGUMENT when the request asked for no asynchronous reply; the router's status
    /// otherwise.
    pub async fn reply(&self, ctx: &HandlerContext, payload: Payload) -> Result<bool, Status> {
        if ctx.reply_to.is_empty() {
            return Err(Status::invalid_argument(
                "the request carried no reply_to; return the answer from the handler instead",
            ));
        }
        let message = ReachMessage {
            header: Some(Header {
                message_id: trace::new_message_id(),
                trace_id: ctx.trace_id.clone(),
                task_id: ctx.task_id.clone(),
                source: self.source.clone(),
                correlation_id: ctx.message_id.clone(),
                protocol_version: "1.0".into(),
                created_at: Some(reach_rpc::time::now()),
                ..Header::default()
            }),
            payload: Some(payload),
        };
        let mut router = self.router.clone();
        let response = router
            .reply(ReplyRequest {
                message: Some(message),
                reply_to: ctx.reply_to.clone(),
            })
            .await?;
        Ok(response.into_inner().delivered)
    }

    /// Opens a stream through the router. The first message picks the instance; `rest` follows
    /// it on the same instance. Dropping the returned stream cancels the call.
    ///
    /// # Errors
    /// The status that prevented the stream from opening.
    pub async fn stream(
        &self,
        first: ReachMessage,
        rest: impl Stream<Item = ReachMessage> + Send + 'static,
        timeout: Option<Duration>,
    ) -> Result<Streaming<StreamResponse>, Status> {
        use futures::StreamExt;
        let outbound = futures::stream::once(async move { first })
            .chain(rest)
            .map(|message| StreamRequest {
                message: Some(message),
            });
        let mut request = tonic::Request::new(outbound);
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        let mut router = self.router.clone();
        Ok(router
            .stream(request)
            .await
            .map_err(reach_rpc::deadline::normalize_client_status)?
            .into_inner())
    }
}
