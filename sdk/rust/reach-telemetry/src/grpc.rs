//! Tower middleware that traces gRPC calls: a server span per request whose parent is the
//! caller's `traceparent`, and a client span per call whose context is sent as `traceparent`.
//!
//! Spans follow the OpenTelemetry RPC conventions: named `package.Service/Method`, kind
//! server or client, attributes `rpc.system = "grpc"`, `rpc.service`, `rpc.method`,
//! `rpc.grpc.status_code`, plus a `trace_id` field so log lines inside carry it. A span
//! ends when the response body ends (streams included), and its status comes from the
//! `grpc-status` of the headers (trailers-only errors) or of the trailers.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::{Body, Frame, SizeHint};
use tonic::server::NamedService;
use tower::{Layer, Service};
use tracing::Span;

use crate::propagation::{
    inject_span_headers, record_status, set_parent_from_headers, span_trace_id,
};

/// Which side of a call a span describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Server,
    Client,
}

fn call_span(side: Side, path: &str) -> Span {
    let trimmed = path.trim_start_matches('/');
    let (service, method) = trimmed.split_once('/').unwrap_or((trimmed, ""));
    match side {
        Side::Server => tracing::info_span!(
            "grpc.server",
            otel.name = trimmed,
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = service,
            rpc.method = method,
            rpc.grpc.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
            trace_id = tracing::field::Empty,
        ),
        Side::Client => tracing::info_span!(
            "grpc.client",
            otel.name = trimmed,
            otel.kind = "client",
            rpc.system = "grpc",
            rpc.service = service,
            rpc.method = method,
            rpc.grpc.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
            trace_id = tracing::field::Empty,
        ),
    }
}

/// Reads `grpc-status` (and `grpc-message`) from headers or trailers.
fn status_of(headers: &http::HeaderMap) -> Option<(tonic::Code, String)> {
    let code = headers
        .get("grpc-status")?
        .to_str()
        .ok()?
        .parse::<i32>()
        .ok()?;
    let message = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        // grpc-message is percent-encoded.
        .map(crate::config::percent_decode)
        .unwrap_or_default();
    Some((tonic::Code::from_i32(code), message))
}

// === server ===

/// A tower layer that traces every gRPC request a server receives (see the module docs).
/// Wrap one service with [`traced`], or a whole router with `Router::layer`.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcServerTraceLayer;

impl<S> Layer<S> for GrpcServerTraceLayer {
    type Service = GrpcServerTrace<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcServerTrace { inner }
    }
}

/// Wraps a generated tonic server so its requests are traced, keeping its name, so it can
/// be passed to `reach_rpc::GrpcServer::add_service`:
/// `server.add_service(reach_telemetry::traced(AgentServiceServer::new(agent)))`.
pub fn traced<S>(service: S) -> GrpcServerTrace<S> {
    GrpcServerTrace { inner: service }
}

/// The service [`GrpcServerTraceLayer`] produces.
#[derive(Debug, Clone)]
pub struct GrpcServerTrace<S> {
    inner: S,
}

impl<S: NamedService> NamedService for GrpcServerTrace<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B, RB> Service<http::Request<B>> for GrpcServerTrace<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
{
    type Response = http::Response<TracedBody<RB>>;
    type Error = S::Error;
    type Future = TracedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let span = call_span(Side::Server, request.uri().path());
        set_parent_from_headers(&span, request.headers());
        // Without OpenTelemetry (nothing exported) the caller's traceparent still names the
        // trace for log lines.
        let trace_id = span_trace_id(&span).or_else(|| {
            request
                .headers()
                .get(reach_rpc::trace::TRACEPARENT)
                .and_then(|v| v.to_str().ok())
                .and_then(reach_rpc::trace::TraceId::from_traceparent)
        });
        if let Some(trace_id) = trace_id {
            span.record("trace_id", tracing::field::display(trace_id));
        }
        let inner = {
            let _entered = span.enter();
            self.inner.call(request)
        };
        TracedFuture {
            inner,
            span: Some(span),
        }
    }
}

// === client ===

/// A tower layer that traces every gRPC call a client makes and sends the call span's
/// context as `traceparent`:
/// `AgentServiceClient::new(GrpcClientTraceLayer.layer(channel))`.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcClientTraceLayer;

impl<S> Layer<S> for GrpcClientTraceLayer {
    type Service = GrpcClientTrace<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcClientTrace { inner }
    }
}

/// Wraps a channel so every call through it is traced and carries `traceparent`:
/// `AgentServiceClient::new(reach_telemetry::traced_channel(channel))`.
pub fn traced_channel<S>(channel: S) -> GrpcClientTrace<S> {
    GrpcClientTrace { inner: channel }
}

/// The service [`GrpcClientTraceLayer`] produces.
#[derive(Debug, Clone)]
pub struct GrpcClientTrace<S> {
    inner: S,
}

impl<S, B, RB> Service<http::Request<B>> for GrpcClientTrace<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
{
    type Response = http::Response<TracedBody<RB>>;
    type Error = S::Error;
    type Future = TracedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let span = call_span(Side::Client, request.uri().path());
        inject_span_headers(&span, request.headers_mut());
        if let Some(trace_id) = span_trace_id(&span) {
            span.record("trace_id", tracing::field::display(trace_id));
        }
        let inner = {
            let _entered = span.enter();
            self.inner.call(request)
        };
        TracedFuture {
            inner,
            span: Some(span),
        }
    }
}

// === impl TracedFuture ===

pin_project_lite::pin_project! {
    /// The response future of the tracing services: runs inside the call span and hands the
    /// span to the response body.
    pub struct TracedFuture<F> {
        #[pin]
        inner: F,
        span: Option<Span>,
    }
}

impl<F, RB, E> Future for TracedFuture<F>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
{
    type Output = Result<http::Response<TracedBody<RB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = {
            let _entered = this.span.as_ref().map(Span::enter);
            ready!(this.inner.poll(cx))
        };
        let span = this.span.take().unwrap_or_else(Span::none);
        Poll::Ready(match result {
            Ok(response) => {
                let mut span = Some(span);
                if let Some((code, message)) = status_of(response.headers()) {
                    // A trailers-only response: the call is over.
                    if let Some(span) = span.take() {
                        record_status(&span, code, &message);
                    }
                }
                Ok(response.map(|inner| TracedBody { inner, span }))
            }
            Err(error) => {
                span.record("otel.status_code", "error");
                span.record("otel.status_description", "transport error");
                Err(error)
            }
        })
    }
}

// === impl TracedBody ===

pin_project_lite::pin_project! {
    /// A response body that keeps the call span open until the body ends and records the
    /// `grpc-status` of its trailers.
    pub struct TracedBody<B> {
        #[pin]
        inner: B,
        span: Option<Span>,
    }
}

impl<B: Body> Body for TracedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let Some(trailers) = frame.trailers_ref()
                    && let Some(span) = this.span.take()
                    && let Some((code, message)) = status_of(trailers)
                {
                    record_status(&span, code, &message);
                }
            }
            Some(Err(_)) => {
                if let Some(span) = this.span.take() {
                    span.record("otel.status_code", "error");
                    span.record("otel.status_description", "response body failed");
                }
            }
            None => {
                this.span.take();
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
