//! `reach.v1.RouterService`: Call, Stream, Publish and Reply.
//!
//! The unary path (Call): check size, complete the header, check the TTL, resolve the route
//! (and, for a versioned capability, the compatible instances or an adapter), reserve a slot
//! on one instance with the route's policy, forward, and classify the outcome for outlier
//! ejection and retries (see [`crate::retry`]).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::future::join_all;
use futures::{Stream, StreamExt};
use prost::Message as _;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::router_service_server::{RouterService, RouterServiceServer};
use reach_proto::v1::{
    CallMuxRequest, CallMuxResponse, CallRequest, CallResponse, Header, PublishFailure,
    PublishRequest, PublishResponse, ReachMessage, ReplyRequest, ReplyResponse, RouteInfo,
    StreamRequest, StreamResponse, header,
};
use reach_rpc::trace::{self, TraceId};
use reach_rpc::{deadline, mux};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status, Streaming};
use tower::retry::budget::{Budget, TpsBudget};
use tracing::{Instrument, debug, warn};

use crate::config::RouterConfig;
use crate::error::RouteError;
use crate::ledger::{CallOutcome, LedgerSink, LedgerSinkConfig};
use crate::protocol::{AdapterExt, ProtocolRegistry, VersionPlan};
use crate::pump::{InboundChecks, InboundPump, OutboundPump};
use crate::retry::{Classified, classify};
use crate::table::{RouteKey, RoutingTable};
use crate::watch::follow_registry;

/// Response metadata key naming the trace id of a routed stream.
pub const TRACE_ID_METADATA: &str = "x-reach-trace-id";
/// Response metadata key naming the instance a stream was routed to.
pub const INSTANCE_ID_METADATA: &str = "x-reach-instance-id";
/// Request metadata set on a Reply forwarded between router replicas (never forwarded again).
pub const FORWARDED_REPLY_METADATA: &str = "x-reach-forwarded-reply";

/// The router: a routing table plus the RouterService that forwards through it. Cloning
/// shares everything.
#[derive(Clone)]
pub struct Router {
    inner: Arc<Inner>,
}

struct Inner {
    table: Arc<RoutingTable>,
    budget: TpsBudget,
    protocols: Option<Arc<ProtocolRegistry>>,
    /// Calls waiting for an asynchronous reply, by request message id.
    waiting_replies: Mutex<HashMap<String, oneshot::Sender<ReachMessage>>>,
    /// Clients of other router replicas, by endpoint URL, for forwarding replies.
    peers: Mutex<HashMap<String, RouterServiceClient<Channel>>>,
    /// The message ledger sink, when one is configured.
    ledger: Option<LedgerSink>,
    /// Cancelled by [`Router::close_streams`]: CallMux streams stop reading calls.
    closing: CancellationToken,
    /// The call metrics of names no instance serves.
    unrouted_metrics: Arc<reach_telemetry::metrics::router::RouteMetrics>,
}

impl Router {
    /// A router with an empty table. Call [`Router::spawn_registry_watch`] to fill it.
    ///
    /// # Errors
    /// The config's validation message, or the protocol registry's load error.
    pub fn new(config: RouterConfig) -> Result<Self, String> {
        config.validate()?;
        let protocols = match &config.protocol_registry {
            Some(path) => Some(Arc::new(
                ProtocolRegistry::load(path).map_err(|e| e.to_string())?,
            )),
            None => None,
        };
        let budget = TpsBudget::new(
            config.retry_budget.window,
            config.retry_budget.min_per_second,
            config.retry_budget.retry_ratio,
        );
        let ledger = if config.ledger_endpoint.is_empty() {
            None
        } else {
            Some(LedgerSink::spawn(
                &config.ledger_endpoint,
                LedgerSinkConfig {
                    recorded_by: "router".into(),
                    sample_rate: config.ledger_sample_rate,
                    ..LedgerSinkConfig::default()
                },
            )?)
        };
        Ok(Self {
            inner: Arc::new(Inner {
                table: RoutingTable::new(config),
                budget,
                protocols,
                waiting_replies: Mutex::new(HashMap::new()),
                peers: Mutex::new(HashMap::new()),
                ledger,
                closing: CancellationToken::new(),
                unrouted_metrics: Arc::new(reach_telemetry::metrics::router::RouteMetrics::new(
                    UNROUTED_LABEL,
                )),
            }),
        })
    }

    /// Tells every open `CallMux` stream to stop reading calls, answer those it read and end
    /// (UNAVAILABLE, `INSTANCE_DRAINING`, so clients send the rest to another replica). Call
    /// it when shutdown begins, before the server's grace period, so open streams do not hold
    /// the server up.
    pub fn close_streams(&self) {
        self.inner.closing.cancel();
    }

    /// The routing table.
    pub fn table(&self) -> &Arc<RoutingTable> {
        &self.inner.table
    }

    /// The protocol registry, when one is configured.
    pub fn protocols(&self) -> Option<&Arc<ProtocolRegistry>> {
        self.inner.protocols.as_ref()
    }

    /// Starts following the registry in the background.
    pub fn spawn_registry_watch(&self) -> JoinHandle<()> {
        tokio::spawn(follow_registry(self.inner.table.clone()))
    }

    /// The tonic service, with message size limits set from the config.
    pub fn into_server(self) -> RouterServiceServer<Self> {
        let limit = self.config().decoding_limit();
        RouterServiceServer::new(self)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit)
    }

    fn config(&self) -> &RouterConfig {
        self.inner.table.config()
    }

    fn check_size(&self, size: usize) -> Result<(), RouteError> {
        let limit = self.config().max_message_bytes;
        if size > limit {
            return Err(RouteError::PayloadTooLarge { size, limit });
        }
        Ok(())
    }

    fn is_idempotent(&self, key: &RouteKey) -> bool {
        match (key, &self.inner.protocols) {
            (RouteKey::Capability(name), Some(protocols)) => protocols.is_idempotent(name),
            _ => false,
        }
    }

    /// The call metrics of a route: labelled with its name while the routing table has it
    /// (names that instances registered, so bounded), else with [`UNROUTED_LABEL`].
    fn route_metrics(&self, key: &RouteKey) -> Arc<reach_telemetry::metrics::router::RouteMetrics> {
        match self.inner.table.route(key) {
            Some(route) => route.metrics.clone(),
            None => self.inner.unrouted_metrics.clone(),
        }
    }

    /// `RouterService.Stream` up to the point where the stream is open: reads the first
    /// message, picks the instance (and adapter) and opens the instance's stream. Sets
    /// `route_label` to the route's metric label once the first message names the route.
    async fn open_stream(
        &self,
        request: Request<Streaming<StreamRequest>>,
        started: Instant,
        route_label: &mut Option<String>,
    ) -> Result<Response<<Self as RouterService>::StreamStream>, Status> {
        let (metadata, _, mut inbound) = request.into_parts();
        let deadline = read_deadline(&metadata, started)?;
        let first = inbound.message().await?.ok_or_else(|| {
            Status::invalid_argument(
                "the stream closed before its first message; the first message picks the instance",
            )
        })?;
        let mut message = first.message.ok_or(RouteError::MissingMessage)?;
        self.check_size(message.encoded_len())?;
        prepare_header(&mut message, &metadata)?;
        let header = message.header.as_ref().ok_or(RouteError::MissingMessage)?;
        apply_ttl(header, None, self.config().max_clock_skew)?;
        let key = route_key(&message)?;
        *route_label = Some(self.route_metrics(&key).label().to_string());
        let plan = match &key {
            RouteKey::Capability(name) => VersionPlan::resolve(
                &self.inner.table,
                self.inner.protocols.as_deref(),
                name,
                &header.capability_version,
            )?,
            _ => VersionPlan::any(),
        };
        // Every message of the caller's is checked against the capability's input schema (when
        // the router validates payloads), as a call's is, before any adapter rewrites it.
        let validation = match (&key, &self.inner.protocols) {
            (RouteKey::Capability(name), Some(protocols)) if self.config().validate_payloads => {
                crate::protocol::validate_input(protocols, name, &message)?;
                Some((protocols.clone(), name.clone()))
            }
            _ => None,
        };
        // With an adapter, every message is rewritten: the caller's to the instance's version
        // on the way in, the instance's back to the caller's on the way out.
        if let Some(adapter) = &plan.adapter {
            adapter.adapt_request(&mut message)?;
            self.check_size(message.encoded_len())?;
        }
        let (trace_id, _) = ids_of(&message);

        let reserved = self
            .inner
            .table
            .reserve(&key, &[], plan.allowed.as_ref(), deadline, started)
            .await?;
        let Some(endpoint) = reserved.endpoint().cloned() else {
            return Err(Status::internal("a reservation without an instance"));
        };
        // Counted open from here, while the instance has not answered yet as well.
        let label = self.route_metrics(&key).label().to_string();
        let open = reach_telemetry::metrics::router::open_stream(&label);
        let (abort_tx, abort_rx) = oneshot::channel();
        let inbound = InboundPump::new(
            message,
            inbound,
            trace_id.clone(),
            InboundChecks {
                max_message_bytes: self.config().max_message_bytes,
                max_clock_skew: self.config().max_clock_skew,
                validation,
            },
            plan.adapter.clone(),
            abort_tx,
        );
        let mut forward = Request::new(inbound);
        *forward.metadata_mut() = forwarded_metadata(metadata);
        if let Some(deadline) = deadline {
            forward.set_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        let opened = endpoint.client().handle_stream(forward).await;
        let agent_stream = match opened {
            Ok(response) => {
                endpoint.record_success();
                response.into_inner()
            }
            Err(status) => {
                if status.code() == Code::Unavailable {
                    endpoint.record_failure();
                }
                return Err(status);
            }
        };
        let outbound = OutboundPump::new(
            agent_stream,
            abort_rx,
            reserved,
            open,
            deadline,
            plan.adapter,
            label,
            started,
        );
        let mut response =
            Response::new(Box::pin(outbound) as <Self as RouterService>::StreamStream);
        if let Ok(value) = MetadataValue::try_from(trace_id.as_str()) {
            response.metadata_mut().insert(TRACE_ID_METADATA, value);
        }
        if let Ok(value) = MetadataValue::try_from(endpoint.info().instance_id.as_str()) {
            response.metadata_mut().insert(INSTANCE_ID_METADATA, value);
        }
        Ok(response)
    }

    /// Sends `message` to one instance of `key` (among `plan`'s instances when set), retrying
    /// on other instances when that is safe, and returns the reply and where it was handled.
    async fn deliver(
        &self,
        key: &RouteKey,
        message: &ReachMessage,
        metadata: &MetadataMap,
        plan: &VersionPlan,
        deadline: Option<Instant>,
        started: Instant,
    ) -> Result<(ReachMessage, Arc<crate::endpoint::InstanceInfo>), Status> {
        let table = &self.inner.table;
        let idempotent = self.is_idempotent(key);
        self.inner.budget.deposit();
        let mut tried: Vec<Arc<str>> = Vec::new();
        let mut redeliveries = 0;
        loop {
            let reserved = table
                .reserve(key, &tried, plan.allowed.as_ref(), deadline, started)
                .await?;
            let Some(endpoint) = reserved.endpoint().cloned() else {
                return Err(Status::internal("a reservation without an instance"));
            };
            let mut timeout = None;
            if let Some(deadline) = deadline {
                let remaining = deadline.saturating_duration_since(Instant::now());
                if remaining.is_zero() {
                    return Err(RouteError::DeadlineExceeded(started.elapsed()).into());
                }
                timeout = Some(remaining);
            }
            let call = endpoint.handle(message.clone(), metadata, timeout);
            let attempt = Instant::now();
            let result = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, call).await,
                None => Ok(call.await),
            };
            // Every attempt that ended (answered, failed or ran out of time) is a sample of
            // the instance's latency; one whose caller went away is not.
            endpoint.record_latency(attempt.elapsed());
            let result = result.map_err(|_| RouteError::DeadlineExceeded(started.elapsed()))?;
            drop(reserved);
            let status = match result {
                Ok(reply) => {
                    endpoint.record_success();
                    return Ok((reply, endpoint.info().clone()));
                }
                Err(status) => status,
            };
            // tonic's client enforces the forwarded grpc-timeout itself and reports CANCELLED;
            // the caller's deadline (or the TTL) is what ran out.
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(RouteError::DeadlineExceeded(started.elapsed()).into());
            }
            let classified = classify(&status);
            match classified {
                Classified::NotDelivered { instance_failed } => {
                    if instance_failed {
                        endpoint.record_failure();
                    }
                }
                Classified::MaybeDelivered { instance_failed } => {
                    if instance_failed {
                        endpoint.record_failure();
                    } else {
                        endpoint.record_success();
                    }
                }
                Classified::Answered => endpoint.record_success(),
            }
            let retry = match classified {
                Classified::NotDelivered { .. } => true,
                Classified::MaybeDelivered { .. } => idempotent,
                Classified::Answered => false,
            };
            if !retry || redeliveries >= self.config().max_redeliveries {
                return Err(explain_lost_instance(
                    status,
                    classified,
                    &endpoint.info().instance_id,
                    message,
                ));
            }
            if !self.inner.budget.withdraw() {
                debug!(instance = %endpoint.info().instance_id, "retry budget exhausted; not retrying");
                return Err(explain_lost_instance(
                    status,
                    classified,
                    &endpoint.info().instance_id,
                    message,
                ));
            }
            redeliveries += 1;
            reach_telemetry::metrics::router::retry(key.label());
            debug!(instance = %endpoint.info().instance_id, code = ?status.code(), redeliveries, idempotent, "retrying on another instance");
            tried.push(Arc::from(endpoint.info().instance_id.as_str()));
        }
    }

    /// The routed part of Call: TTL, versions and schema, delivery (with retries), the
    /// asynchronous reply wait, and the reply envelope.
    async fn call_routed(
        &self,
        mut message: ReachMessage,
        metadata: MetadataMap,
        key: RouteKey,
        caller_deadline: Option<Instant>,
        started: Instant,
    ) -> Result<CallResponse, Status> {
        let header = message.header.as_ref().ok_or(RouteError::MissingMessage)?;
        let deadline = apply_ttl(header, caller_deadline, self.config().max_clock_skew)?;
        let ttl_bound = deadline != caller_deadline;
        let (trace_id, message_id) = ids_of(&message);
        let metadata = forwarded_metadata(metadata);

        let plan = match &key {
            RouteKey::Capability(name) => {
                let requirement = header.capability_version.clone();
                if self.config().validate_payloads
                    && let Some(protocols) = &self.inner.protocols
                {
                    crate::protocol::validate_input(protocols, name, &message)?;
                }
                VersionPlan::resolve(
                    &self.inner.table,
                    self.inner.protocols.as_deref(),
                    name,
                    &requirement,
                )?
            }
            _ => VersionPlan::any(),
        };
        if let Some(adapter) = &plan.adapter {
            adapter.adapt_request(&mut message)?;
        }

        // Asynchronous reply: the caller asked for one; this replica will wait for it.
        let async_reply = message
            .header
            .as_ref()
            .is_some_and(|h| !h.reply_to.is_empty());
        let mut waiter = None;
        if async_reply {
            let advertise = &self.config().advertise_endpoint;
            if advertise.is_empty() {
                return Err(Status::failed_precondition(
                    "this router has no advertise_endpoint, so it cannot take asynchronous replies; set router.advertise_endpoint or send without header.reply_to",
                ));
            }
            if let Some(h) = message.header.as_mut() {
                h.reply_to.clone_from(advertise);
            }
            let (tx, rx) = oneshot::channel();
            self.inner
                .waiting_replies
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(message_id.clone(), tx);
            waiter = Some((
                rx,
                ReplyWaiter {
                    router: self,
                    message_id: message_id.clone(),
                },
            ));
        }

        let delivered = self
            .deliver(&key, &message, &metadata, &plan, deadline, started)
            .await;
        let (mut reply, instance) = match delivered {
            Ok(ok) => ok,
            Err(status) if ttl_bound && status.code() == Code::DeadlineExceeded => {
                let created = header_age(&message);
                return Err(RouteError::MessageExpired {
                    age: created,
                    ttl: message
                        .header
                        .as_ref()
                        .and_then(|h| h.ttl.as_ref())
                        .and_then(reach_rpc::time::std_duration)
                        .unwrap_or_default(),
                }
                .into());
            }
            Err(status) => return Err(status),
        };
        let acked = reply
            .payload
            .as_ref()
            .is_some_and(|p| p.r#type == reach_rpc::ACK_PAYLOAD_TYPE);
        if let (true, Some((rx, _guard))) = (acked, waiter) {
            let wait = self.config().max_async_wait;
            let limit = deadline.map_or(Instant::now() + wait, |d| d.min(Instant::now() + wait));
            reply = match tokio::time::timeout_at(limit, rx).await {
                Ok(Ok(reply)) => reply,
                Ok(Err(_)) => return Err(Status::internal("the reply waiter was dropped")),
                Err(_) => return Err(RouteError::DeadlineExceeded(started.elapsed()).into()),
            };
        }
        if let Some(adapter) = &plan.adapter {
            adapter.adapt_response(&mut reply)?;
        }
        let reply_size = reply.encoded_len();
        if reply_size > self.config().max_message_bytes {
            return Err(RouteError::ReplyTooLarge {
                size: reply_size,
                limit: self.config().max_message_bytes,
                instance: instance.instance_id.clone(),
            }
            .into());
        }
        let reply_header = reply.header.get_or_insert_with(Header::default);
        if reply_header.trace_id.is_empty() {
            reply_header.trace_id.clone_from(&trace_id);
        }
        if reply_header.correlation_id.is_empty() {
            reply_header.correlation_id.clone_from(&message_id);
        }
        Ok(CallResponse {
            message: Some(reply),
            route: Some(RouteInfo {
                instance_id: instance.instance_id.clone(),
                service: instance.service.clone(),
                trace_id,
                message_id,
            }),
        })
    }

    /// Call's work after the request is read: size, header, route, delivery, ledger, span and
    /// metrics. Shared by Call and CallMux; `remote_parent` is a multiplexed call's
    /// `traceparent` (a unary call's parent is the current gRPC server span).
    async fn route_call(
        &self,
        mut message: ReachMessage,
        metadata: MetadataMap,
        caller_deadline: Option<Instant>,
        started: Instant,
        remote_parent: Option<reach_telemetry::OtelContext>,
    ) -> Result<CallResponse, Status> {
        // Measured after the header is completed: the size the instance will receive.
        prepare_header(&mut message, &metadata)?;
        self.check_size(message.encoded_len())?;
        let key = route_key(&message)?;
        let span =
            reach_telemetry::message_span_with_parent("router.call", &message, remote_parent);

        // Counts the call when it ends, as CANCELLED when its caller goes away first (this
        // future is dropped at the `.await` below).
        let mut record = CallRecord {
            metrics: self.route_metrics(&key),
            started,
            finished: false,
        };
        let _in_flight = record.metrics.in_flight();
        let message_type = message
            .payload
            .as_ref()
            .map(|p| p.r#type.clone())
            .unwrap_or_default();
        // The ledger keeps task messages only; cloning is skipped for everything else.
        let for_ledger = self
            .inner
            .ledger
            .as_ref()
            .filter(|_| {
                message
                    .header
                    .as_ref()
                    .is_some_and(|h| !h.task_id.is_empty())
            })
            .map(|sink| (sink, message.clone(), std::time::SystemTime::now()));
        let result = self
            .call_routed(message, metadata, key, caller_deadline, started)
            .instrument(span.clone())
            .await;
        let code = result.as_ref().map_or_else(Status::code, |_| Code::Ok);
        if let Some((sink, request, routed_at)) = for_ledger {
            let outcome = CallOutcome {
                code,
                status_message: result
                    .as_ref()
                    .err()
                    .map(|s| s.message().to_string())
                    .unwrap_or_default(),
                latency: started.elapsed(),
                routed_at,
                instance_id: result
                    .as_ref()
                    .ok()
                    .and_then(|r| r.route.as_ref())
                    .map(|r| r.instance_id.clone())
                    .unwrap_or_default(),
            };
            sink.record_call(&request, &outcome);
        }
        match &result {
            Ok(response) => {
                if let Some(route) = &response.route {
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
        record.finish(code);
        result
    }

    /// Completes a waiting asynchronous call; returns whether one was waiting.
    fn complete_reply(&self, reply: ReachMessage) -> bool {
        let correlation = reply
            .header
            .as_ref()
            .map(|h| h.correlation_id.clone())
            .unwrap_or_default();
        let waiter = self
            .inner
            .waiting_replies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&correlation);
        match waiter {
            Some(waiter) => waiter.send(reply).is_ok(),
            None => false,
        }
    }

    fn peer(&self, endpoint: &str) -> Result<RouterServiceClient<Channel>, Status> {
        let mut peers = self.inner.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(client) = peers.get(endpoint) {
            return Ok(client.clone());
        }
        let channel = reach_rpc::http2::endpoint(endpoint)
            .map_err(|e| {
                Status::invalid_argument(format!("reply_to {endpoint:?} is not a router URL: {e}"))
            })?
            .connect_timeout(self.config().connect_timeout)
            .connect_lazy();
        let client = RouterServiceClient::new(channel)
            .max_decoding_message_size(self.config().decoding_limit())
            .max_encoding_message_size(self.config().decoding_limit());
        peers.insert(endpoint.to_string(), client.clone());
        Ok(client)
    }
}

/// Removes a waiting-reply entry when the waiting call ends (answered, timed out, cancelled).
struct ReplyWaiter<'a> {
    router: &'a Router,
    message_id: String,
}

impl Drop for ReplyWaiter<'_> {
    fn drop(&mut self) {
        self.router
            .inner
            .waiting_replies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.message_id);
    }
}

/// A failure the instance did not answer with becomes UNAVAILABLE / `INSTANCE_UNAVAILABLE`
/// naming the instance, instead of the transport's UNKNOWN: one that broke mid-call says the
/// message may have been handled, one that never reached it (a refused connection) says it was
/// not delivered. Statuses an instance sent pass through unchanged.
fn explain_lost_instance(
    status: Status,
    classified: Classified,
    instance_id: &str,
    message: &ReachMessage,
) -> Status {
    let local = std::error::Error::source(&status).is_some();
    match classified {
        Classified::MaybeDelivered {
            instance_failed: true,
        }
        | Classified::NotDelivered {
            instance_failed: true,
        } if local => {
            let (trace_id, message_id) = ids_of(message);
            warn!(instance = %instance_id, %trace_id, %message_id, code = ?status.code(), error = %status.message(), "instance failed during a call");
            match classified {
                Classified::NotDelivered { .. } => {
                    crate::endpoint::unreachable_instance(instance_id, status.message())
                }
                _ => crate::endpoint::lost_instance(instance_id, status.message()),
            }
        }
        _ => status,
    }
}

/// Calls one `CallMux` stream may have open at once; more are answered UNAVAILABLE /
/// `OVERLOADED` with a retry hint. Above the router's own limits (per-instance concurrency and
/// shedding), this only bounds the tasks one client can make the router hold.
pub const MAX_OPEN_CALLS_PER_STREAM: usize = 4096;

/// A multiplexed call's metadata map as gRPC metadata (keys that are not valid ASCII
/// metadata are dropped).
fn metadata_of(entries: HashMap<String, String>) -> MetadataMap {
    let mut metadata = MetadataMap::new();
    for (key, value) in entries {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::AsciiMetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            metadata.insert(key, value);
        }
    }
    metadata
}

/// Reads the caller's deadline from `grpc-timeout`.
fn read_deadline(metadata: &MetadataMap, started: Instant) -> Result<Option<Instant>, RouteError> {
    let timeout = deadline::grpc_timeout(metadata).map_err(RouteError::InvalidTimeout)?;
    Ok(timeout.map(|t| started + t))
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

/// Checks the message's TTL and folds its expiry into the deadline: a message whose
/// `created_at + ttl` has passed is refused with MESSAGE_EXPIRED, one created more than
/// `max_clock_skew` in the future is refused as an invalid header, and one that is still
/// valid is delivered no later than its expiry.
fn apply_ttl(
    header: &Header,
    deadline: Option<Instant>,
    max_clock_skew: Duration,
) -> Result<Option<Instant>, RouteError> {
    Ok(match ttl_expiry(header, max_clock_skew)? {
        Some(expiry) => Some(deadline.map_or(expiry, |d| d.min(expiry))),
        None => deadline,
    })
}

/// When the message's TTL runs out (`None`: no TTL).
///
/// # Errors
/// [`RouteError::MessageExpired`] when `created_at + ttl` has passed;
/// [`RouteError::InvalidHeader`] for a negative TTL, a `created_at` out of range or more than
/// `max_clock_skew` in the future.
pub(crate) fn ttl_expiry(
    header: &Header,
    max_clock_skew: Duration,
) -> Result<Option<Instant>, RouteError> {
    let Some(ttl) = &header.ttl else {
        return Ok(None);
    };
    let ttl = reach_rpc::time::std_duration(ttl).ok_or_else(|| RouteError::InvalidHeader {
        field: "header.ttl",
        detail: "it is negative; leave it unset for no limit".into(),
    })?;
    if ttl.is_zero() {
        return Ok(None);
    }
    let created = header
        .created_at
        .as_ref()
        .and_then(reach_rpc::time::system_time)
        .ok_or_else(|| RouteError::InvalidHeader {
            field: "header.created_at",
            detail: "it is out of range; leave it unset to have the router stamp it".into(),
        })?;
    let now = SystemTime::now();
    if let Ok(ahead) = created.duration_since(now)
        && ahead > max_clock_skew
    {
        return Err(RouteError::InvalidHeader {
            field: "header.created_at",
            detail: format!(
                "it is {:.1} s ahead of the router's clock (allowed: {}, router max_clock_skew); fix the sender's clock, or leave it unset to have the router stamp it",
                ahead.as_secs_f64(),
                humantime::format_duration(max_clock_skew),
            ),
        });
    }
    let age = now.duration_since(created).unwrap_or(Duration::ZERO);
    if age >= ttl {
        return Err(RouteError::MessageExpired { age, ttl });
    }
    Ok(Some(Instant::now() + (ttl - age)))
}

/// The longest service, capability or topic name the router accepts, in bytes.
pub const MAX_TARGET_NAME_BYTES: usize = 256;

/// The metrics label of calls to a name no instance serves: such names come from callers,
/// unbounded, and would each make metric series of their own.
pub const UNROUTED_LABEL: &str = "(unrouted)";

/// Refuses a target name (service, capability or topic) over [`MAX_TARGET_NAME_BYTES`].
fn check_target_name(header: Option<&Header>) -> Result<(), RouteError> {
    if let Some(
        header::Target::Service(name)
        | header::Target::Capability(name)
        | header::Target::Topic(name),
    ) = header.and_then(|h| h.target.as_ref())
        && name.len() > MAX_TARGET_NAME_BYTES
    {
        return Err(RouteError::TargetNameTooLong(name.len()));
    }
    Ok(())
}

fn route_key(message: &ReachMessage) -> Result<RouteKey, RouteError> {
    check_target_name(message.header.as_ref())?;
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

/// Connection-specific (hop-by-hop) HTTP fields, which describe the caller's connection to the
/// router and are never forwarded (RFC 9110 §7.6.1; `proxy-authorization` is the router's to
/// consume, `host` names the router, not the instance).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "host",
    "keep-alive",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "transfer-encoding",
    "upgrade",
];

/// The caller's metadata as forwarded to the instance: end-to-end application metadata
/// (including `authorization`, so agents can authenticate the end caller, as HTTP proxies
/// do) and W3C trace context, without
/// - `grpc-timeout`, which is re-sent as the time that remains;
/// - hop-by-hop fields ([`HOP_BY_HOP`]);
/// - a malformed `traceparent` and the `tracestate` that goes with it (W3C Trace Context §3.3:
///   an invalid parent is ignored, not propagated).
fn forwarded_metadata(mut metadata: MetadataMap) -> MetadataMap {
    metadata.remove(deadline::GRPC_TIMEOUT);
    for key in HOP_BY_HOP {
        metadata.remove(key);
    }
    let parent = metadata
        .get(trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .filter(|v| TraceId::from_traceparent(v).is_some());
    match parent {
        None => {
            metadata.remove(trace::TRACEPARENT);
            metadata.remove("tracestate");
        }
        // Valid, with surrounding whitespace a lenient parse allowed: forwarded trimmed.
        Some(parent) if parent.trim() != parent => {
            if let Ok(trimmed) = MetadataValue::try_from(parent.trim()) {
                metadata.insert(trace::TRACEPARENT, trimmed);
            }
        }
        Some(_) => {}
    }
    metadata
}

fn ids_of(message: &ReachMessage) -> (String, String) {
    message
        .header
        .as_ref()
        .map(|h| (h.trace_id.clone(), h.message_id.clone()))
        .unwrap_or_default()
}

fn code_name(code: Code) -> String {
    format!("{code:?}")
}

#[tonic::async_trait]
impl RouterService for Router {
    async fn call(&self, request: Request<CallRequest>) -> Result<Response<CallResponse>, Status> {
        let started = Instant::now();
        let (metadata, _, body) = request.into_parts();
        let caller_deadline = read_deadline(&metadata, started)?;
        let message = body.message.ok_or(RouteError::MissingMessage)?;
        self.route_call(message, metadata, caller_deadline, started, None)
            .await
            .map(Response::new)
    }

    type CallMuxStream = Pin<Box<dyn Stream<Item = Result<CallMuxResponse, Status>> + Send>>;

    async fn call_mux(
        &self,
        request: Request<Streaming<CallMuxRequest>>,
    ) -> Result<Response<Self::CallMuxStream>, Status> {
        let inbound = request
            .into_inner()
            .map(|item| item.map(|request| request.frame.unwrap_or_default()));
        let router = self.clone();
        let outcomes = mux::serve(
            inbound,
            move |call: mux::IncomingCall| {
                let router = router.clone();
                async move {
                    let parent = reach_telemetry::extract_map(&call.metadata);
                    let metadata = metadata_of(call.metadata);
                    router
                        .route_call(
                            call.message,
                            metadata,
                            call.deadline,
                            call.received_at,
                            Some(parent),
                        )
                        .await
                }
            },
            MAX_OPEN_CALLS_PER_STREAM,
            self.inner.closing.clone(),
        );
        let replies = outcomes.map(|item| {
            item.map(|(call_id, outcome)| match outcome {
                Ok(response) => CallMuxResponse {
                    frame: Some(mux::reply_frame(
                        call_id,
                        Ok(response.message.unwrap_or_default()),
                    )),
                    route: response.route,
                },
                Err(status) => CallMuxResponse {
                    frame: Some(mux::reply_frame(call_id, Err(status))),
                    route: None,
                },
            })
        });
        Ok(Response::new(Box::pin(replies)))
    }

    type StreamStream = Pin<Box<dyn Stream<Item = Result<StreamResponse, Status>> + Send>>;

    async fn stream(
        &self,
        request: Request<Streaming<StreamRequest>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let started = Instant::now();
        let mut route_label = None;
        let opened = self.open_stream(request, started, &mut route_label).await;
        if let Err(status) = &opened {
            // A stream refused before it opened counts among the finished ones, with its code
            // (an open stream is counted by its pump when it ends).
            reach_telemetry::metrics::router::stream(
                route_label.as_deref().unwrap_or(UNROUTED_LABEL),
                status.code(),
                started.elapsed(),
            );
        }
        opened
    }

    async fn publish(
        &self,
        request: Request<PublishRequest>,
    ) -> Result<Response<PublishResponse>, Status> {
        let started = Instant::now();
        let (metadata, _, body) = request.into_parts();
        let caller_deadline = read_deadline(&metadata, started)?;
        let mut message = body.message.ok_or(RouteError::MissingMessage)?;
        self.check_size(message.encoded_len())?;
        prepare_header(&mut message, &metadata)?;
        let header = message.header.as_ref().ok_or(RouteError::MissingMessage)?;
        let deadline = apply_ttl(header, caller_deadline, self.config().max_clock_skew)?;
        check_target_name(Some(header))?;
        let topic = match &header.target {
            Some(header::Target::Topic(topic)) if !topic.is_empty() => topic.clone(),
            _ => {
                return Err(RouteError::InvalidHeader {
                    field: "header.topic",
                    detail: "Publish needs a topic target; use Call for a service or capability"
                        .into(),
                }
                .into());
            }
        };
        let (_, message_id) = ids_of(&message);
        let metadata = forwarded_metadata(metadata);
        let members = self
            .inner
            .table
            .route(&RouteKey::Topic(topic))
            .map(|route| route.members.clone())
            .unwrap_or_else(|| Arc::from(Vec::new()));
        let sends = members.iter().map(|endpoint| {
            let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let endpoint = endpoint.clone();
            let (message, metadata) = (&message, &metadata);
            async move {
                let _in_flight = endpoint.load_tracker().start();
                let call = endpoint.handle(message.clone(), metadata, timeout);
                let attempt = Instant::now();
                let result = match deadline {
                    Some(deadline) => match tokio::time::timeout_at(deadline, call).await {
                        Ok(result) => result.map(|_| ()),
                        Err(_) => Err(Status::deadline_exceeded(
                            "the deadline passed before the subscriber answered",
                        )),
                    },
                    None => call.await.map(|_| ()),
                };
                endpoint.record_latency(attempt.elapsed());
                match &result {
                    Ok(()) => endpoint.record_success(),
                    Err(status) if status.code() == Code::Unavailable => {
                        endpoint.record_failure();
                    }
                    Err(_) => endpoint.record_success(),
                }
                (endpoint.info().instance_id.clone(), result)
            }
        });
        let mut response = PublishResponse {
            message_id,
            ..PublishResponse::default()
        };
        for (instance_id, result) in join_all(sends).await {
            match result {
                Ok(()) => response.delivered += 1,
                Err(status) => {
                    response.failed += 1;
                    response.failures.push(PublishFailure {
                        instance_id,
                        code: code_name(status.code()),
                        message: status.message().to_string(),
                    });
                }
            }
        }
        Ok(Response::new(response))
    }

    async fn reply(
        &self,
        request: Request<ReplyRequest>,
    ) -> Result<Response<ReplyResponse>, Status> {
        let forwarded = request.metadata().contains_key(FORWARDED_REPLY_METADATA);
        let body = request.into_inner();
        let message = body.message.ok_or(RouteError::MissingMessage)?;
        self.check_size(message.encoded_len())?;
        if message
            .header
            .as_ref()
            .is_none_or(|h| h.correlation_id.is_empty())
        {
            return Err(Status::invalid_argument(
                "a reply needs header.correlation_id set to the request's message_id",
            ));
        }
        let own = &self.config().advertise_endpoint;
        if forwarded || body.reply_to.is_empty() || body.reply_to == *own {
            let delivered = self.complete_reply(message);
            return Ok(Response::new(ReplyResponse { delivered }));
        }
        // The waiting call is held by another replica: hand the reply to it.
        let mut peer = self.peer(&body.reply_to)?;
        let mut forward = Request::new(ReplyRequest {
            message: Some(message),
            reply_to: body.reply_to.clone(),
        });
        forward
            .metadata_mut()
            .insert(FORWARDED_REPLY_METADATA, MetadataValue::from_static("1"));
        match peer.reply(forward).await {
            Ok(response) => Ok(response),
            Err(status) => {
                warn!(reply_to = %body.reply_to, code = ?status.code(), "could not forward an asynchronous reply to its router replica");
                Err(status)
            }
        }
    }
}

/// Records a routed call in `reach_router_requests_total` and
/// `reach_router_request_duration_seconds` exactly once: with its code at
/// [`CallRecord::finish`], or as CANCELLED when dropped unfinished (the caller cancelled or
/// went away and the call's future was dropped).
struct CallRecord {
    metrics: Arc<reach_telemetry::metrics::router::RouteMetrics>,
    started: Instant,
    finished: bool,
}

impl CallRecord {
    fn finish(&mut self, code: Code) {
        self.finished = true;
        self.metrics.request(code, self.started.elapsed());
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        if !self.finished {
            self.metrics
                .request(Code::Cancelled, self.started.elapsed());
        }
    }
}

fn header_age(message: &ReachMessage) -> Duration {
    message
        .header
        .as_ref()
        .and_then(|h| h.created_at.as_ref())
        .and_then(reach_rpc::time::system_time)
        .and_then(|created| SystemTime::now().duration_since(created).ok())
        .unwrap_or_default()
}
