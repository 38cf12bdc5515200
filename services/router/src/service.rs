//! `reach.v1.RouterService`: Call and Stream.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use prost::Message as _;
use reach_proto::v1::router_service_server::{RouterService, RouterServiceServer};
use reach_proto::v1::{
    CallRequest, CallResponse, HandleRequest, Header, ReachMessage, RouteInfo, StreamRequest,
    StreamResponse, header,
};
use reach_rpc::deadline;
use reach_rpc::errors::reason;
use reach_rpc::trace::{self, TraceId};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Request, Response, Status, Streaming};
use tower::{Service, ServiceExt};
use tracing::{Instrument, debug};

use crate::config::RouterConfig;
use crate::endpoint::{Forward, Forwarded, Outcome};
use crate::error::RouteError;
use crate::pump::{InboundPump, OutboundPump};
use crate::table::{RouteKey, RouteService, RoutingTable};
use crate::watch::follow_registry;

/// Response metadata key naming the trace id of a routed stream.
pub const TRACE_ID_METADATA: &str = "x-reach-trace-id";
/// Response metadata key naming the instance a stream was routed to.
pub const INSTANCE_ID_METADATA: &str = "x-reach-instance-id";

/// The router: a routing table plus the RouterService that forwards through it. Cloning
/// shares the table.
#[derive(Clone)]
pub struct Router {
    table: Arc<RoutingTable>,
}

impl Router {
    /// A router with an empty table. Call [`Router::spawn_registry_watch`] to fill it.
    ///
    /// # Errors
    /// The config's validation message.
    pub fn new(config: RouterConfig) -> Result<Self, String> {
        config.validate()?;
        Ok(Self {
            table: RoutingTable::new(config),
        })
    }

    /// The routing table.
    pub fn table(&self) -> &Arc<RoutingTable> {
        &self.table
    }

    /// Starts following the registry in the background.
    pub fn spawn_registry_watch(&self) -> JoinHandle<()> {
        tokio::spawn(follow_registry(self.table.clone()))
    }

    /// The tonic service, with message size limits set from the config.
    pub fn into_server(self) -> RouterServiceServer<Self> {
        let limit = self.config().decoding_limit();
        RouterServiceServer::new(self)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit)
    }

    fn config(&self) -> &RouterConfig {
        self.table.config()
    }

    fn check_size(&self, size: usize) -> Result<(), RouteError> {
        let limit = self.config().max_message_bytes;
        if size > limit {
            return Err(RouteError::PayloadTooLarge { size, limit });
        }
        Ok(())
    }

    /// Forwards a prepared unary message, redelivering when provably undelivered.
    async fn forward_call(
        &self,
        message: ReachMessage,
        metadata: MetadataMap,
        key: RouteKey,
        deadline: Option<Instant>,
        started: Instant,
    ) -> Result<Response<CallResponse>, Status> {
        let (trace_id, message_id) = trace_and_message_id(&message);
        let metadata = forwarded_metadata(metadata);

        let mut redeliveries = 0;
        loop {
            let mut service = self.ready_route(&key, deadline, started).await?;
            let mut forward = Request::new(HandleRequest {
                message: Some(message.clone()),
            });
            *forward.metadata_mut() = metadata.clone();
            if let Some(deadline) = deadline {
                let remaining = deadline.saturating_duration_since(Instant::now());
                if remaining.is_zero() {
                    return Err(RouteError::DeadlineExceeded(started.elapsed()).into());
                }
                forward.set_timeout(remaining);
            }
            let call = service.call(Forward::Unary(forward));
            let forwarded = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, call)
                    .await
                    .map_err(|_| RouteError::DeadlineExceeded(started.elapsed()))?,
                None => call.await,
            };
            let Forwarded { instance, outcome } =
                forwarded.map_err(|error| RouteError::Balancer {
                    key: key.clone(),
                    detail: error.to_string(),
                })?;
            let Outcome::Unary(result) = outcome else {
                return Err(Status::internal("a unary call came back as a stream"));
            };
            match result {
                Ok(response) => {
                    let mut reply = response.into_inner().message.unwrap_or_default();
                    let header = reply.header.get_or_insert_with(Header::default);
                    if header.trace_id.is_empty() {
                        header.trace_id = trace_id.clone();
                    }
                    if header.correlation_id.is_empty() {
                        header.correlation_id = message_id.clone();
                    }
                    return Ok(Response::new(CallResponse {
                        message: Some(reply),
                        route: Some(RouteInfo {
                            instance_id: instance.instance_id.clone(),
                            service: instance.service.clone(),
                            trace_id,
                            message_id,
                        }),
                    }));
                }
                Err(status)
                    if provably_undelivered(&status)
                        && redeliveries < self.config().max_redeliveries =>
                {
                    redeliveries += 1;
                    reach_telemetry::metrics::router::retry(key.label());
                    debug!(instance = %instance.instance_id, code = ?status.code(), redeliveries, "not delivered; trying another instance");
                }
                Err(status) => return Err(status),
            }
        }
    }

    fn resolve(&self, key: &RouteKey) -> Result<RouteService, RouteError> {
        self.table.route(key).ok_or_else(|| {
            let (capabilities, services) = self.table.summary();
            RouteError::route_not_found(key.clone(), &capabilities, &services)
        })
    }

    /// Waits until the route's balancer has picked a ready instance, within `route_wait` and
    /// the caller's deadline.
    async fn ready_route(
        &self,
        key: &RouteKey,
        deadline: Option<Instant>,
        started: Instant,
    ) -> Result<RouteService, RouteError> {
        let mut service = self.resolve(key)?;
        let wait = Instant::now() + self.config().route_wait;
        let limit = deadline.map_or(wait, |d| d.min(wait));
        match tokio::time::timeout_at(limit, service.ready()).await {
            Ok(Ok(_)) => Ok(service),
            Ok(Err(error)) => Err(RouteError::Balancer {
                key: key.clone(),
                detail: error.to_string(),
            }),
            Err(_) if deadline.is_some_and(|d| d <= limit) => {
                Err(RouteError::DeadlineExceeded(started.elapsed()))
            }
            Err(_) => Err(RouteError::NoReadyInstance {
                key: key.clone(),
                waited: self.config().route_wait,
            }),
        }
    }
}

/// Reads the caller's deadline from `grpc-timeout`.
fn read_deadline(
    metadata: &MetadataMap,
    started: Instant,
) -> Result<(Option<Instant>, Option<Duration>), RouteError> {
    let timeout = deadline::grpc_timeout(metadata).map_err(RouteError::InvalidTimeout)?;
    Ok((timeout.map(|t| started + t), timeout))
}

/// Completes a message header in place: validates or assigns the trace id (from
/// `traceparent` when present, else fresh), assigns a message id and creation time.
fn prepare_header(message: &mut ReachMessage, metadata: &MetadataMap) -> Result<(), RouteError> {
    let header = message.header.get_or_insert_with(Header::default);
    if header.trace_id.is_empty() {
        let from_parent = metadata
            .get(trace::TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(TraceId::from_traceparent);
        header.trace_id = from_parent.unwrap_or_else(TraceId::random).to_string();
    } else {
        TraceId::parse(&header.trace_id)?;
    }
    if header.message_id.is_empty() {
        header.message_id = trace::new_message_id();
    }
    if header.created_at.is_none() {
        header.created_at = Some(reach_rpc::time::now());
    }
    Ok(())
}

fn route_key(message: &ReachMessage) -> Result<RouteKey, RouteError> {
    match message.header.as_ref().and_then(|h| h.target.as_ref()) {
        Some(header::Target::Service(name)) if !name.is_empty() => {
            Ok(RouteKey::Service(name.clone()))
        }
        Some(header::Target::Capability(name)) if !name.is_empty() => {
            Ok(RouteKey::Capability(name.clone()))
        }
        Some(header::Target::Topic(topic)) => Err(RouteError::TopicNotCallable(topic.clone())),
        _ => Err(RouteError::MissingTarget),
    }
}

/// The caller's metadata as forwarded to the instance: everything but the timeout, which is
/// re-sent as the remaining time.
fn forwarded_metadata(mut metadata: MetadataMap) -> MetadataMap {
    metadata.remove(deadline::GRPC_TIMEOUT);
    metadata
}

/// Whether a failed attempt provably never reached a handler, so another instance may take
/// the message: the instance said it is draining, or the connection itself failed (a status
/// made locally from a transport error; statuses sent by an instance carry no source).
fn provably_undelivered(status: &Status) -> bool {
    if reach_rpc::errors::reason_of(status).as_deref() == Some(reason::INSTANCE_DRAINING) {
        return true;
    }
    status.code() == Code::Unavailable && std::error::Error::source(status).is_some()
}

fn trace_and_message_id(message: &ReachMessage) -> (String, String) {
    message
        .header
        .as_ref()
        .map(|h| (h.trace_id.clone(), h.message_id.clone()))
        .unwrap_or_default()
}

#[tonic::async_trait]
impl RouterService for Router {
    async fn call(&self, request: Request<CallRequest>) -> Result<Response<CallResponse>, Status> {
        let started = Instant::now();
        let (metadata, _, body) = request.into_parts();
        let (deadline, _) = read_deadline(&metadata, started)?;
        let mut message = body.message.ok_or(RouteError::MissingMessage)?;
        self.check_size(message.encoded_len())?;
        prepare_header(&mut message, &metadata)?;
        let key = route_key(&message)?;
        let span = reach_telemetry::message_span("router.call", &message);
        let label = key.label().to_string();
        let _in_flight = reach_telemetry::metrics::router::in_flight(&label);
        let message_type = message
            .payload
            .as_ref()
            .map(|p| p.r#type.clone())
            .unwrap_or_default();
        let result = self
            .forward_call(message, metadata, key, deadline, started)
            .instrument(span.clone())
            .await;
        let code = result.as_ref().map_or_else(Status::code, |_| Code::Ok);
        match &result {
            Ok(response) => {
                if let Some(route) = &response.get_ref().route {
                    span.record("instance", route.instance_id.as_str());
                }
            }
            Err(status) => reach_telemetry::metrics::router::message_failure(&message_type, status),
        }
        reach_telemetry::record_status(
            &span,
            code,
            result.as_ref().err().map_or("", |s| s.message()),
        );
        reach_telemetry::metrics::router::request(&label, code, started.elapsed());
        result
    }

    type StreamStream = Pin<Box<dyn Stream<Item = Result<StreamResponse, Status>> + Send>>;

    async fn stream(
        &self,
        request: Request<Streaming<StreamRequest>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let started = Instant::now();
        let (metadata, _, mut inbound) = request.into_parts();
        let (deadline, _) = read_deadline(&metadata, started)?;
        let first = inbound.message().await?.ok_or_else(|| {
            Status::invalid_argument(
                "the stream closed before its first message; the first message picks the instance",
            )
        })?;
        let mut message = first.message.ok_or(RouteError::MissingMessage)?;
        self.check_size(message.encoded_len())?;
        prepare_header(&mut message, &metadata)?;
        let key = route_key(&message)?;
        let (trace_id, _) = trace_and_message_id(&message);

        let (abort_tx, abort_rx) = oneshot::channel();
        let inbound = InboundPump::new(
            message,
            inbound,
            trace_id.clone(),
            self.config().max_message_bytes,
            abort_tx,
        );
        let mut forward = Request::new(inbound);
        *forward.metadata_mut() = forwarded_metadata(metadata);
        if let Some(deadline) = deadline {
            forward.set_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        let mut service = self.ready_route(&key, deadline, started).await?;
        let Forwarded { instance, outcome } = service
            .call(Forward::Stream(forward))
            .await
            .map_err(|error| RouteError::Balancer {
                key: key.clone(),
                detail: error.to_string(),
            })?;
        let Outcome::Stream(result, in_flight) = outcome else {
            return Err(Status::internal("a stream came back as a unary call"));
        };
        let agent_stream = result?.into_inner();
        let outbound = OutboundPump::new(agent_stream, abort_rx, in_flight, deadline);
        let mut response = Response::new(Box::pin(outbound) as Self::StreamStream);
        if let Ok(value) = MetadataValue::try_from(trace_id.as_str()) {
            response.metadata_mut().insert(TRACE_ID_METADATA, value);
        }
        if let Ok(value) = MetadataValue::try_from(instance.instance_id.as_str()) {
            response.metadata_mut().insert(INSTANCE_ID_METADATA, value);
        }
        Ok(response)
    }
}
