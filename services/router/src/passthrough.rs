//! Typed pass-through: calls to an agent's own gRPC service (for example
//! `/examples.complaints.v1.TriageService/Triage`) arriving at the router are forwarded, bytes
//! untouched, to an instance that registered that service (`InstanceSpec.grpc_services`).
//!
//! This is a raw HTTP/2 proxy, not a decode/re-encode: the request's headers, its body (the
//! length-prefixed gRPC messages) and the response's body and trailers stream through as they
//! are, so unary and streaming methods of any service work and any gRPC client generated from
//! the agent's proto calls it through the mesh. The instance is chosen like any capability's
//! (the route's balancing policy, concurrency limits, outlier ejection); the call counts
//! against the instance until the response body (trailers included) has been sent.
//!
//! The router does not decode these messages, so the envelope features (TTL, schemas,
//! adapters, retries) do not apply, but a pass-through call gets the router's treatment
//! otherwise:
//! - every message, both ways, is held to `router.passthrough_max_message_bytes` by its gRPC
//!   length prefix (RESOURCE_EXHAUSTED, `PAYLOAD_TOO_LARGE`; the caller's messages are checked
//!   by the serving layer, [`reach_rpc::limits::MessageLimits`], the instance's here);
//! - a trailers-only response (the instance's status in one HEADERS frame with END_STREAM)
//!   reaches the caller as one, its headers unchanged (code, message,
//!   `grpc-status-details-bin`, custom metadata);
//! - a response that ends without a gRPC status (END_STREAM on DATA with no trailers, a
//!   RST_STREAM(NO_ERROR) after data) reaches the caller as INTERNAL naming the missing
//!   status, and a lost connection as UNAVAILABLE (`INSTANCE_LOST`), never as a clean
//!   end;
//! - a `router.passthrough` span, child of the caller's `traceparent` and parent of the
//!   instance's (the forwarded `traceparent` is rewritten);
//! - the route's request metrics (`reach_router_requests_total`, `_request_duration_seconds`,
//!   `reach_router_in_flight`; CANCELLED when the caller goes away first) and the instance's
//!   latency (`reach_router_instance_duration_seconds`).
//!
//! `grpc-timeout` is forwarded and enforced by the instance.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body::Frame;
use tokio::time::Instant;
use tonic::{Code, Status};
use tower::{Service, ServiceExt};
use tracing::Instrument;

use crate::endpoint::{InstanceEndpoint, Reservation};
use crate::error::RouteError;
use crate::key::RouteKey;
use crate::metrics::RouteMetrics;
use crate::table::RoutingTable;

/// The pass-through service: a fallback for paths the router's own services do not serve.
#[derive(Clone)]
pub struct PassThrough {
    table: Arc<RoutingTable>,
    /// The metrics of calls to services no instance serves.
    unrouted: Arc<RouteMetrics>,
}

impl PassThrough {
    /// A pass-through over `table`'s gRPC-service routes.
    pub fn new(table: Arc<RoutingTable>) -> Self {
        Self {
            table,
            unrouted: Arc::new(RouteMetrics::new(crate::metrics::UNROUTED_LABEL)),
        }
    }
}

impl Service<http::Request<axum::body::Body>> for PassThrough {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<axum::body::Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(request).await) })
    }
}

impl PassThrough {
    async fn forward(self, request: http::Request<axum::body::Body>) -> axum::response::Response {
        let started = Instant::now();
        let path = request.uri().path().to_string();
        let Some((service, method)) = path.trim_start_matches('/').split_once('/') else {
            return Status::unimplemented(format!(
                "{path:?} is not a gRPC method path (/package.Service/Method)"
            ))
            .into_http();
        };
        let key = RouteKey::GrpcService(service.to_string());
        let route = self.table.route(&key);
        let metrics = route
            .as_ref()
            .map_or_else(|| self.unrouted.clone(), |r| r.metrics.clone());
        let span = tracing::info_span!(
            target: "reach::message::router",
            "reach.message",
            otel.name = "router.passthrough",
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = service,
            rpc.method = method,
            instance = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            rpc.grpc.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
        );
        reach_telemetry::propagation::set_parent_from_headers(&span, request.headers());
        if let Some(trace_id) = reach_telemetry::span_trace_id(&span) {
            span.record("trace_id", tracing::field::display(trace_id));
        }
        let record = CallRecord {
            _in_flight: metrics.in_flight(),
            metrics,
            span: span.clone(),
            started,
            finished: false,
        };
        if route.is_none() {
            return record.fail(Status::unimplemented(format!(
                "no routable instance serves gRPC service {service:?}; an agent serves its own gRPC service through the router by registering it in InstanceSpec.grpc_services"
            )));
        }
        // The caller's policy, and what the instance sees of the caller, as for a Call.
        let (mut parts, body) = request.into_parts();
        let caller = reach_trust::Caller::of(&parts.extensions);
        let mut metadata =
            tonic::metadata::MetadataMap::from_headers(std::mem::take(&mut parts.headers));
        if let Err(error) =
            crate::envelope::authorize(self.table.trust(), &caller, &key, &mut metadata)
        {
            return record.fail(error.into());
        }
        parts.headers = metadata.into_headers();
        let request = http::Request::from_parts(parts, body);
        let limit = self.table.config().passthrough_message_limit();
        self.forward_routed(request, key, limit, record)
            .instrument(span)
            .await
    }

    async fn forward_routed(
        &self,
        request: http::Request<axum::body::Body>,
        key: RouteKey,
        limit: usize,
        record: CallRecord,
    ) -> axum::response::Response {
        let started = record.started;
        let deadline = request
            .headers()
            .get(reach_rpc::deadline::GRPC_TIMEOUT)
            .and_then(|v| v.to_str().ok())
            .and_then(reach_rpc::deadline::parse_grpc_timeout)
            .map(|t| started + t);
        let reserved = match self.table.reserve(&key, &[], None, deadline, started).await {
            Ok(reserved) => reserved,
            Err(error) => return record.fail(error.into()),
        };
        let endpoint = reserved.endpoint().clone();
        record
            .span
            .record("instance", endpoint.info().instance_id.as_str());
        let (mut parts, body) = request.into_parts();
        // The instance's span is a child of this one, not of the caller's.
        reach_telemetry::propagation::inject_span_headers(&record.span, &mut parts.headers);
        let caller_failed = Arc::new(Mutex::new(None));
        let body = CallerBody {
            inner: body,
            failed: caller_failed.clone(),
        };
        let request = http::Request::from_parts(parts, tonic::body::Body::new(body));
        let attempt = Instant::now();
        let mut channel = endpoint.channel();
        let response = match channel.ready().await {
            Ok(ready) => ready.call(request).await,
            Err(error) => Err(error),
        };
        match response {
            Ok(response) => {
                endpoint.record_success();
                let (parts, body) = response.into_parts();
                // A trailers-only response (gRPC's status in the response headers, sent as
                // one HEADERS frame with END_STREAM) goes on as one: headers unchanged and an
                // empty body, so the caller's HEADERS frame carries END_STREAM too. A body
                // behind them, even an empty one, would end in an empty DATA frame, which
                // clients such as grpcio read as "Stream removed" (UNKNOWN) instead of the
                // status.
                if let Some(code) = code_of(&parts.headers) {
                    endpoint.record_latency(attempt.elapsed());
                    let message = parts
                        .headers
                        .get("grpc-message")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_string();
                    let mut record = record;
                    record.finish(code, &message);
                    drop(reserved);
                    return http::Response::from_parts(parts, axum::body::Body::empty());
                }
                let body = Forwarded {
                    inner: body,
                    prefixes: Prefixes::default(),
                    limit,
                    caller_failed,
                    end: End::Open,
                    attempt,
                    endpoint,
                    record: Some(record),
                    _reserved: Some(reserved),
                };
                http::Response::from_parts(parts, axum::body::Body::new(body))
            }
            Err(error) => {
                endpoint.record_failure();
                endpoint.record_latency(attempt.elapsed());
                let status = take(&caller_failed).unwrap_or_else(|| {
                    RouteError::NoReadyInstance {
                        key,
                        waited: started.elapsed(),
                        detail: error.to_string(),
                    }
                    .into()
                });
                record.fail(status)
            }
        }
    }
}

fn take(slot: &Mutex<Option<Status>>) -> Option<Status> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// The gRPC status code in `headers` (`grpc-status`), if any.
fn code_of(headers: &http::HeaderMap) -> Option<Code> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map(Code::from_i32)
}

/// `status` as HTTP/2 trailers.
fn trailers_of(status: &Status) -> http::HeaderMap {
    let mut trailers = http::HeaderMap::new();
    // Only fails for a message that cannot be a header value, which tonic percent-encodes.
    let _ = status.add_header(&mut trailers);
    trailers
}

/// Records one pass-through call exactly once: its span's status and the route's request
/// metrics, with its code when it ends, or as CANCELLED when dropped first (the caller went
/// away).
struct CallRecord {
    metrics: Arc<RouteMetrics>,
    /// `reach_router_in_flight` for the route, until the call ends.
    _in_flight: reach_telemetry::metrics::GaugeGuard,
    span: tracing::Span,
    started: Instant,
    finished: bool,
}

impl CallRecord {
    fn finish(&mut self, code: Code, message: &str) {
        if self.finished {
            return;
        }
        self.finished = true;
        reach_telemetry::record_status(&self.span, code, message);
        self.metrics.request(code, self.started.elapsed());
    }

    /// Ends the call before any response from an instance: `status` as a trailers-only
    /// response.
    fn fail(mut self, status: Status) -> axum::response::Response {
        self.finish(status.code(), status.message());
        status.into_http()
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        self.finish(
            Code::Cancelled,
            "the caller went away before the call ended",
        );
    }
}

/// The caller's request body on its way to the instance: a failure (the caller reset the
/// stream or its connection broke, or a message over the limit was refused) is kept, so the
/// caller's status says why the call ended.
struct CallerBody {
    inner: axum::body::Body,
    failed: Arc<Mutex<Option<Status>>>,
}

impl http_body::Body for CallerBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Err(error))) = &polled {
            let status = match std::error::Error::source(error)
                .and_then(|source| source.downcast_ref::<Status>())
            {
                Some(status) => status.clone(),
                None => Status::cancelled(format!(
                    "the caller's request ended before it was complete ({error})"
                )),
            };
            *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Where a stream of length-prefixed gRPC messages stands: the prefix bytes of the next
/// message read so far, or the bytes of the current message still to come.
#[derive(Debug, Default)]
struct Prefixes {
    header: [u8; 5],
    header_len: usize,
    body_remaining: usize,
}

impl Prefixes {
    /// Takes `data`, the stream's next bytes; returns the declared size of the first message
    /// whose prefix declares more than `limit` bytes.
    fn over(&mut self, mut data: &[u8], limit: usize) -> Option<usize> {
        while !data.is_empty() {
            if self.body_remaining == 0 {
                let take = (5 - self.header_len).min(data.len());
                self.header[self.header_len..self.header_len + take].copy_from_slice(&data[..take]);
                self.header_len += take;
                data = &data[take..];
                if self.header_len == 5 {
                    self.header_len = 0;
                    let [_, a, b, c, d] = self.header;
                    self.body_remaining = u32::from_be_bytes([a, b, c, d]) as usize;
                    if self.body_remaining > limit {
                        return Some(self.body_remaining);
                    }
                }
            } else {
                let take = self.body_remaining.min(data.len());
                self.body_remaining -= take;
                data = &data[take..];
            }
        }
        None
    }
}

/// How a forwarded response body stands.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// Frames are still forwarded.
    Open,
    /// The router ended it with its own trailers; nothing more follows.
    Ended,
}

/// The instance's response body on its way to the caller: messages held to the limit, the
/// end made explicit (see the module docs), and the call counted against its instance until
/// it ends.
struct Forwarded {
    inner: tonic::body::Body,
    prefixes: Prefixes,
    limit: usize,
    /// Why the caller's request failed, if it did.
    caller_failed: Arc<Mutex<Option<Status>>>,
    end: End,
    attempt: Instant,
    endpoint: Arc<InstanceEndpoint>,
    record: Option<CallRecord>,
    /// The slot on the instance, released when the response ends.
    _reserved: Option<Reservation>,
}

impl Forwarded {
    /// Ends the call with `code`: latency, metrics, span, and the instance's slot.
    fn finish(&mut self, code: Code, message: &str) {
        self.endpoint.record_latency(self.attempt.elapsed());
        if let Some(mut record) = self.record.take() {
            record.finish(code, message);
        }
        self._reserved = None;
    }

    /// Ends the response with the router's own `status` as trailers.
    fn end_with(&mut self, status: &Status) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.finish(status.code(), status.message());
        self.end = End::Ended;
        // The instance's stream is reset now rather than when the caller's ends.
        self.inner = tonic::body::Body::empty();
        Poll::Ready(Some(Ok(Frame::trailers(trailers_of(status)))))
    }
}

impl http_body::Body for Forwarded {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.end == End::Ended {
            return Poll::Ready(None);
        }
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && let Some(size) = this.prefixes.over(data, this.limit)
                {
                    let status = Status::from(RouteError::ReplyTooLarge {
                        size,
                        limit: this.limit,
                        instance: this.endpoint.info().instance_id.clone(),
                    });
                    return this.end_with(&status);
                }
                if let Some(trailers) = frame.trailers_ref() {
                    let code = code_of(trailers).unwrap_or(Code::Unknown);
                    let message = trailers
                        .get("grpc-message")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_string();
                    this.finish(code, &message);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => {
                let status = take(&this.caller_failed).unwrap_or_else(|| {
                    crate::endpoint::lost_instance(
                        &this.endpoint.info().instance_id,
                        &error.to_string(),
                    )
                });
                if status.code() == Code::Unavailable {
                    this.endpoint.record_failure();
                }
                this.end_with(&status)
            }
            Poll::Ready(None) => {
                if this.record.is_none() {
                    // Trailers were forwarded.
                    return Poll::Ready(None);
                }
                let status = take(&this.caller_failed).unwrap_or_else(|| {
                    crate::endpoint::missing_status(&this.endpoint.info().instance_id)
                });
                this.end_with(&status)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.end == End::Ended
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(length: usize) -> Vec<u8> {
        let mut bytes = vec![0];
        bytes.extend_from_slice(&(length as u32).to_be_bytes());
        bytes.resize(5 + length, 7);
        bytes
    }

    #[test]
    fn prefixes_find_the_first_message_over_the_limit_however_the_bytes_are_split() {
        let stream = [message(10), message(0), message(40), message(3)].concat();
        for chunk in [1, 2, 5, 6, 7, 13, stream.len()] {
            let mut prefixes = Prefixes::default();
            let over = stream
                .chunks(chunk)
                .find_map(|piece| prefixes.over(piece, 39));
            assert_eq!(over, Some(40), "chunks of {chunk}");
            let mut prefixes = Prefixes::default();
            assert!(
                stream.chunks(chunk).all(|p| prefixes.over(p, 40).is_none()),
                "chunks of {chunk}"
            );
        }
    }
}
