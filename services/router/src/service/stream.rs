//! Stream: the first message is admitted ([`crate::envelope`]) and picks the instance (and
//! adapter), then the stream pump ([`crate::pump`]) forwards the rest frame by frame, each
//! message held to the same rules, and the instance's replies back.

use reach_proto::v1::StreamRequest;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tonic::metadata::MetadataValue;
use tonic::{Code, Request, Response, Status, Streaming};

use super::{INSTANCE_ID_METADATA, Router, RouterService, TRACE_ID_METADATA, UNROUTED_LABEL};
use crate::envelope::{TraceOrigin, forwarded_metadata, ids_of, read_deadline, route_key};
use crate::error::RouteError;
use crate::key::RouteKey;
use crate::metrics;
use crate::protocol::{AdapterExt, VersionPlan};
use crate::pump::{CallerEnd, InboundChecks, InboundPump, OutboundPump, StreamCodec};

impl Router {
    /// `RouterService.Stream`: opens the stream ([`Router::open_stream`]); a stream refused
    /// before it opened is counted among the finished ones here.
    pub(super) async fn serve_stream(
        &self,
        request: Request<Streaming<StreamRequest>>,
    ) -> Result<Response<<Router as RouterService>::StreamStream>, Status> {
        let started = Instant::now();
        let mut route_label = None;
        let opened = self.open_stream(request, started, &mut route_label).await;
        if let Err(status) = &opened {
            // A stream refused before it opened counts among the finished ones, with its code
            // (an open stream is counted by its pump when it ends).
            metrics::stream(
                route_label.as_deref().unwrap_or(UNROUTED_LABEL),
                status.code(),
                started.elapsed(),
            );
        }
        opened
    }

    /// `RouterService.Stream` up to the point where the stream is open: reads the first
    /// message, picks the instance (and adapter) and opens the instance's stream. Sets
    /// `route_label` to the route's metric label once the first message names the route.
    async fn open_stream(
        &self,
        request: Request<Streaming<StreamRequest>>,
        started: Instant,
        route_label: &mut Option<String>,
    ) -> Result<Response<<Router as RouterService>::StreamStream>, Status> {
        let (mut metadata, extensions, mut inbound) = request.into_parts();
        let caller = reach_trust::Caller::of(&extensions);
        let caller_end = extensions.get::<CallerEnd>().cloned().unwrap_or_default();
        let deadline = read_deadline(&metadata, started)?;
        let first = inbound.message().await?.ok_or_else(|| {
            Status::invalid_argument(
                "the stream closed before its first message; the first message picks the instance",
            )
        })?;
        let mut message = first.message.ok_or(RouteError::MissingMessage)?;
        let rules = self.rules();
        rules.admit(&mut message, TraceOrigin::Caller(&metadata))?;
        // The TTL bounds the delivery of each message, not how long the stream lives.
        rules.deadline(&message, None)?;
        let key = route_key(&message)?;
        crate::envelope::authorize(self.table().trust(), &caller, &key, &mut metadata)?;
        *route_label = Some(self.route_metrics(&key).label().to_string());
        let plan = match &key {
            RouteKey::Capability(name) => VersionPlan::resolve(
                self.inner.table.route(&key).as_deref(),
                self.inner.protocols.as_deref(),
                name,
                message
                    .header
                    .as_ref()
                    .map_or("", |h| h.capability_version.as_str()),
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
            rules.check_bounds(&message)?;
        }
        let (trace_id, _) = ids_of(&message);

        let reserved = self
            .inner
            .table
            .reserve(&key, &[], plan.allowed.as_ref(), deadline, started)
            .await?;
        let endpoint = reserved.endpoint().clone();
        // Counted open from here, while the instance has not answered yet as well.
        let label = self.route_metrics(&key).label().to_string();
        let open = metrics::open_stream(&label);
        let (abort_tx, mut abort_rx) = oneshot::channel();
        let inbound = InboundPump::new(
            message,
            inbound,
            trace_id.clone(),
            InboundChecks { rules, validation },
            plan.adapter.clone(),
            abort_tx,
            caller_end,
        );
        let mut forward = Request::new(inbound);
        *forward.metadata_mut() = forwarded_metadata(metadata);
        if let Some(deadline) = deadline {
            forward.set_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        forward.extensions_mut().insert(tonic::GrpcMethod::new(
            "reach.v1.AgentService",
            "HandleStream",
        ));
        let mut grpc = endpoint.grpc();
        let opened = match grpc.ready().await {
            Ok(()) => {
                grpc.streaming(
                    forward,
                    http::uri::PathAndQuery::from_static("/reach.v1.AgentService/HandleStream"),
                    StreamCodec,
                )
                .await
            }
            Err(error) => Err(crate::endpoint::unreachable_instance(
                &endpoint.info().instance_id,
                &tonic::codegen::StdError::from(error).to_string(),
            )),
        };
        let agent_stream = match opened {
            Ok(response) => {
                endpoint.record_success();
                response.into_inner()
            }
            Err(status) => {
                // A message refused before the instance answered resets its stream: the
                // refusal is the stream's outcome, not the reset.
                if let Ok(refusal) = abort_rx.try_recv() {
                    return Err(refusal);
                }
                let status = explain_failed_open(status, &endpoint.info().instance_id);
                if status.code() == Code::Unavailable {
                    endpoint.record_failed(&status);
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
            self.config().max_message_bytes,
            label,
            started,
        );
        let mut response =
            Response::new(Box::pin(outbound) as <Router as RouterService>::StreamStream);
        if let Ok(value) = MetadataValue::try_from(trace_id.as_str()) {
            response.metadata_mut().insert(TRACE_ID_METADATA, value);
        }
        if let Ok(value) = MetadataValue::try_from(endpoint.info().instance_id.as_str()) {
            response.metadata_mut().insert(INSTANCE_ID_METADATA, value);
        }
        Ok(response)
    }
}

/// A stream the instance never answered the opening of, as the caller should see it: a
/// transport failure (a local source) is UNAVAILABLE naming the instance —
/// `INSTANCE_UNAVAILABLE` when provably nothing was sent, `INSTANCE_LOST` otherwise — instead
/// of tonic's bare "transport error"; a response without a gRPC status is INTERNAL; statuses
/// the instance sent pass through.
fn explain_failed_open(status: Status, instance_id: &str) -> Status {
    let Some(source) = std::error::Error::source(&status) else {
        return if reach_rpc::errors::is_missing_status(&status) {
            crate::endpoint::missing_status(instance_id)
        } else {
            status
        };
    };
    let mut detail = source.to_string();
    let mut cause = source.source();
    while let Some(inner) = cause {
        detail = format!("{detail}: {inner}");
        cause = inner.source();
    }
    if reach_rpc::errors::is_connect_error(&status) || reach_rpc::errors::is_unprocessed(&status) {
        crate::endpoint::unreachable_instance(instance_id, &detail)
    } else {
        crate::endpoint::lost_stream_instance(instance_id, &detail)
    }
}
