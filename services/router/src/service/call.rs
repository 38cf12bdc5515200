//! Call and CallMux: admit the message ([`crate::envelope`]), resolve the route (and, for a
//! versioned capability, the compatible instances or an adapter), reserve a slot on one
//! instance with the route's policy, forward, and classify the outcome for outlier ejection
//! and retries (see [`crate::retry`]); wait for an asynchronous reply when the caller asked
//! for one; record the call in the ledger, its span and the route's metrics.

use std::collections::HashMap;
use std::sync::Arc;

use futures::StreamExt;
use prost::Message as _;
use reach_proto::v1::{
    CallMuxRequest, CallMuxResponse, CallRequest, CallResponse, Header, ReachMessage, RouteInfo,
};
use reach_rpc::mux;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Request, Response, Status, Streaming};
use tower::retry::budget::Budget;
use tracing::{Instrument, debug, warn};

use super::reply::{ReplyWaiter, WaitingReply};
use super::{Router, RouterService};
use crate::endpoint::InstanceInfo;
use crate::envelope::{self, TraceOrigin, forwarded_metadata, ids_of, read_deadline, route_key};
use crate::error::RouteError;
use crate::key::RouteKey;
use crate::ledger::CallOutcome;
use crate::metrics::{self, RouteMetrics};
use crate::protocol::{AdapterExt, VersionPlan};
use crate::retry::{Classified, classify};

impl Router {
    /// `RouterService.Call`.
    pub(super) async fn serve_call(
        &self,
        request: Request<CallRequest>,
    ) -> Result<Response<CallResponse>, Status> {
        let started = Instant::now();
        let (metadata, extensions, body) = request.into_parts();
        let caller = reach_trust::Caller::of(&extensions);
        let caller_deadline = read_deadline(&metadata, started)?;
        let message = body.message.ok_or(RouteError::MissingMessage)?;
        self.route_call(&caller, message, metadata, caller_deadline, started, None)
            .await
            .map(Response::new)
    }

    /// `RouterService.CallMux`: every call of the stream routed as a Call, answered in the
    /// order they finish.
    pub(super) fn serve_call_mux(
        &self,
        request: Request<Streaming<CallMuxRequest>>,
    ) -> Response<<Router as RouterService>::CallMuxStream> {
        // Every call of the stream is the stream's caller's.
        let caller = reach_trust::Caller::of(request.extensions());
        let inbound = request
            .into_inner()
            .map(|item| item.map(|request| request.frame.unwrap_or_default()));
        let router = self.clone();
        let outcomes = mux::serve(
            inbound,
            move |call: mux::IncomingCall| {
                let router = router.clone();
                let caller = caller.clone();
                async move {
                    let parent = reach_telemetry::extract_map(&call.metadata);
                    let metadata = metadata_of(call.metadata);
                    router
                        .route_call(
                            &caller,
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
        Response::new(Box::pin(replies))
    }

    fn is_idempotent(&self, key: &RouteKey) -> bool {
        match (key, &self.inner.protocols) {
            (RouteKey::Capability(name), Some(protocols)) => protocols.is_idempotent(name),
            _ => false,
        }
    }

    /// Sends `message` to one instance of `key` (among `plan`'s instances when set), retrying
    /// on other instances when that is safe, and returns the reply and where it was handled.
    /// When `message` asks for an asynchronous reply (`header.reply_to` set), before each
    /// attempt the instance's service is allowed to reply to its waiting call.
    pub(super) async fn deliver(
        &self,
        key: &RouteKey,
        message: &ReachMessage,
        metadata: &MetadataMap,
        plan: &VersionPlan,
        deadline: Option<Instant>,
        started: Instant,
    ) -> Result<(ReachMessage, Arc<InstanceInfo>), Status> {
        let reply_waiter = message
            .header
            .as_ref()
            .filter(|h| !h.reply_to.is_empty())
            .map(|h| h.message_id.as_str());
        let table = &self.inner.table;
        let idempotent = self.is_idempotent(key);
        self.inner.budget.deposit();
        let mut tried: Vec<Arc<str>> = Vec::new();
        let mut redeliveries = 0;
        loop {
            let reserved = table
                .reserve(key, &tried, plan.allowed.as_ref(), deadline, started)
                .await?;
            let endpoint = reserved.endpoint().clone();
            let mut timeout = None;
            if let Some(deadline) = deadline {
                let remaining = deadline.saturating_duration_since(Instant::now());
                if remaining.is_zero() {
                    return Err(RouteError::DeadlineExceeded(started.elapsed()).into());
                }
                timeout = Some(remaining);
            }
            if let Some(message_id) = reply_waiter {
                self.allow_replier(message_id, &endpoint.info().service);
            }
            // The slot goes with the call: it is released when the call has ended at the
            // instance (its reply, or its acknowledged cancel), not when this future ends.
            let call = endpoint.handle(message.clone(), metadata, timeout, Box::new(reserved));
            let attempt = Instant::now();
            let result = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, call).await,
                None => Ok(call.await),
            };
            // Every attempt that ended (answered, failed or ran out of time) is a sample of
            // the instance's latency; one whose caller went away is not.
            endpoint.record_latency(attempt.elapsed());
            let result = result.map_err(|_| RouteError::DeadlineExceeded(started.elapsed()))?;
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
                    // A refused connection: out of rotation at once (the call goes elsewhere).
                    if instance_failed {
                        endpoint.record_unreachable();
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
            metrics::retry(key.label());
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
        let deadline = self.rules().deadline(&message, caller_deadline)?;
        let ttl_bound = deadline != caller_deadline;
        let (trace_id, message_id) = ids_of(&message);
        let metadata = forwarded_metadata(metadata);

        let plan = match &key {
            RouteKey::Capability(name) => {
                if self.config().validate_payloads
                    && let Some(protocols) = &self.inner.protocols
                {
                    crate::protocol::validate_input(protocols, name, &message)?;
                }
                VersionPlan::resolve(
                    self.inner.table.route(&key).as_deref(),
                    self.inner.protocols.as_deref(),
                    name,
                    message
                        .header
                        .as_ref()
                        .map_or("", |h| h.capability_version.as_str()),
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
                .insert(message_id.clone(), WaitingReply::new(tx));
            waiter = Some((rx, ReplyWaiter::new(self, message_id.clone())));
        }

        let delivered = self
            .deliver(&key, &message, &metadata, &plan, deadline, started)
            .await;
        let (mut reply, instance) = match delivered {
            Ok(ok) => ok,
            Err(status) if ttl_bound && status.code() == Code::DeadlineExceeded => {
                return Err(RouteError::MessageExpired {
                    age: envelope::age(&message),
                    ttl: envelope::ttl(&message),
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
        caller: &reach_trust::Caller,
        mut message: ReachMessage,
        mut metadata: MetadataMap,
        caller_deadline: Option<Instant>,
        started: Instant,
        remote_parent: Option<reach_telemetry::OtelContext>,
    ) -> Result<CallResponse, Status> {
        self.rules()
            .admit(&mut message, TraceOrigin::Caller(&metadata))?;
        let key = route_key(&message)?;
        envelope::authorize(self.table().trust(), caller, &key, &mut metadata)?;
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
            .map(|sink| {
                // The ledger says who routed the message: a caller may name any task id, so
                // its entries are attributed to the identity the router verified (replacing
                // whatever the caller wrote under that key), never passed off as another's.
                let mut recorded = message.clone();
                if self.table().trust().is_enabled()
                    && let Some(header) = recorded.header.as_mut()
                {
                    header.metadata.insert(
                        crate::envelope::CALLER_METADATA.to_string(),
                        caller.name().to_string(),
                    );
                }
                (sink, recorded, std::time::SystemTime::now())
            });
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
            Err(status) => metrics::message_failure(&message_type, status),
        }
        reach_telemetry::record_status(
            &span,
            code,
            result.as_ref().err().map_or("", |s| s.message()),
        );
        record.finish(code);
        result
    }
}

/// Records a routed call in `reach_router_requests_total` and
/// `reach_router_request_duration_seconds` exactly once: with its code at
/// [`CallRecord::finish`], or as CANCELLED when dropped unfinished (the caller cancelled or
/// went away and the call's future was dropped).
struct CallRecord {
    metrics: Arc<RouteMetrics>,
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

/// A failure the instance did not answer with becomes UNAVAILABLE naming the instance,
/// instead of the transport's UNKNOWN: `INSTANCE_LOST` for one that broke mid-call (the
/// message may have been handled), `INSTANCE_UNAVAILABLE` for one that never reached it (a
/// refused connection: not delivered). Statuses an instance sent pass through unchanged.
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
