//! [`MeshClient`]: calls and streams through the router, addressing capabilities or services.

use std::time::Duration;

use futures::Stream;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{
    CallRequest, CallResponse, Header, Payload, PublishRequest, PublishResponse, ReachMessage,
    ReplyRequest, StreamRequest, StreamResponse, header,
};

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
}

/// A client of the mesh: every call goes through a router, addressed by capability or
/// service. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct MeshClient {
    router: RouterServiceClient<GrpcClientTrace<Channel>>,
    source: String,
}

impl MeshClient {
    /// A client over a channel to a router, sending as `source` (dotted, e.g. `ingest.main`).
    pub fn new(channel: Channel, source: impl Into<String>) -> Self {
        Self {
            router: RouterServiceClient::new(reach_telemetry::traced_channel(channel))
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20),
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
        let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())?
            .tcp_nodelay(true)
            .connect()
            .await?;
        Ok(Self::new(channel, source))
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

    /// Sends a prepared message through the router's Call.
    ///
    /// # Errors
    /// As [`MeshClient::call`].
    pub async fn send(
        &self,
        message: ReachMessage,
        timeout: Option<Duration>,
    ) -> Result<CallResponse, Status> {
        // The edge span belongs to the message's trace, so the client span and the
        // `traceparent` sent with the call do too.
        let span = reach_telemetry::message_span("mesh.call", &message);
        let mut request = tonic::Request::new(CallRequest {
            message: Some(message),
        });
        if let Some(timeout) = timeout {
            // Sent as grpc-timeout; tonic's channel also enforces it locally.
            request.set_timeout(timeout);
        }
        let mut router = self.router.clone();
        let result = router
            .call(request)
            .instrument(span.clone())
            .await
            .map(tonic::Response::into_inner)
            .map_err(reach_rpc::deadline::normalize_client_status);
        let (code, text) = result
            .as_ref()
            .map_or_else(|s| (s.code(), s.message()), |_| (tonic::Code::Ok, ""));
        reach_telemetry::record_status(&span, code, text);
        result
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
