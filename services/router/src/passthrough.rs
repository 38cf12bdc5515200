//! Typed pass-through: calls to an agent's own gRPC service (for example
//! `/examples.complaints.v1.TriageService/Triage`) arriving at the router are forwarded, bytes
//! untouched, to an instance that registered that service (`InstanceSpec.grpc_services`).
//!
//! This is a raw HTTP/2 proxy, not a decode/re-encode: the request's headers, its body (the
//! length-prefixed gRPC messages) and the response's body and trailers stream through as they
//! are, so unary and streaming methods of any service work and any gRPC client generated from
//! the agent's proto calls it through the mesh. The instance is chosen like any capability's
//! (the route's balancing policy, concurrency limits, outlier ejection); the call counts
//! against the instance until the response body (trailers included) has been sent. The router
//! does not inspect these messages, so the envelope features (TTL, size limit, schemas,
//! adapters, retries) do not apply; `grpc-timeout` is forwarded and enforced by the instance.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::future::BoxFuture;
use tokio::time::Instant;
use tonic::Status;
use tower::{Service, ServiceExt};

use crate::endpoint::Reservation;
use crate::error::RouteError;
use crate::key::RouteKey;
use crate::table::RoutingTable;

/// The pass-through service: a fallback for paths the router's own services do not serve.
#[derive(Clone)]
pub struct PassThrough {
    table: Arc<RoutingTable>,
}

impl PassThrough {
    /// A pass-through over `table`'s gRPC-service routes.
    pub fn new(table: Arc<RoutingTable>) -> Self {
        Self { table }
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
        let table = self.table.clone();
        Box::pin(async move {
            Ok(forward(&table, request)
                .await
                .unwrap_or_else(|status| status.into_http()))
        })
    }
}

async fn forward(
    table: &RoutingTable,
    request: http::Request<axum::body::Body>,
) -> Result<axum::response::Response, Status> {
    let started = Instant::now();
    let path = request.uri().path();
    let Some((service, _method)) = path.trim_start_matches('/').split_once('/') else {
        return Err(Status::unimplemented(format!(
            "{path:?} is not a gRPC method path (/package.Service/Method)"
        )));
    };
    let key = RouteKey::GrpcService(service.to_string());
    if table.route(&key).is_none() {
        return Err(Status::unimplemented(format!(
            "no routable instance serves gRPC service {service:?}; an agent serves its own gRPC service through the router by registering it in InstanceSpec.grpc_services"
        )));
    }
    let deadline = request
        .headers()
        .get(reach_rpc::deadline::GRPC_TIMEOUT)
        .and_then(|v| v.to_str().ok())
        .and_then(reach_rpc::deadline::parse_grpc_timeout)
        .map(|t| started + t);
    let reserved = table.reserve(&key, &[], None, deadline, started).await?;
    let endpoint = reserved.endpoint().clone();
    let (parts, body) = request.into_parts();
    let request = http::Request::from_parts(parts, tonic::body::Body::new(body));
    let mut channel = endpoint.channel();
    let response = match channel.ready().await {
        Ok(ready) => ready.call(request).await,
        Err(error) => Err(error),
    };
    match response {
        Ok(response) => {
            endpoint.record_success();
            let (parts, body) = response.into_parts();
            let body = GuardedBody {
                inner: body,
                _in_flight: reserved,
            };
            Ok(http::Response::from_parts(
                parts,
                axum::body::Body::new(body),
            ))
        }
        Err(error) => {
            endpoint.record_failure();
            Err(RouteError::NoReadyInstance {
                key,
                waited: started.elapsed(),
                detail: error.to_string(),
            }
            .into())
        }
    }
}

/// A response body that keeps the call counted against its instance until it ends.
struct GuardedBody {
    inner: tonic::body::Body,
    _in_flight: Reservation,
}

impl http_body::Body for GuardedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
