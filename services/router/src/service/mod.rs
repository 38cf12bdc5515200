//! `reach.v1.RouterService`: the [`Router`] and its RPCs, one module each:
//! - `call` — Call and CallMux: the envelope, the route, the version plan, delivery with
//!   retries (see [`crate::retry`]), the asynchronous reply wait, the ledger and metrics;
//! - `stream` — Stream: the first message picks the instance, then the stream pump
//!   ([`crate::pump`]) forwards the rest frame by frame;
//! - `publish` — Publish: one delivery to every subscriber of a topic;
//! - `reply` — Reply: asynchronous replies, completed here or forwarded to the replica whose
//!   call waits for them.
//!
//! Every RPC holds its messages to the same envelope rules ([`crate::envelope`]).

mod call;
mod publish;
mod reply;
mod stream;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use futures::Stream;
use moka::sync::Cache;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::router_service_server::{RouterService, RouterServiceServer};
use reach_proto::v1::{
    CallMuxRequest, CallMuxResponse, CallRequest, CallResponse, PublishRequest, PublishResponse,
    ReplyRequest, ReplyResponse, StreamRequest, StreamResponse,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};
use tower::retry::budget::TpsBudget;

use crate::balance::{Random, ThreadRandom};
use crate::config::RouterConfig;
use crate::envelope::EnvelopeRules;
use crate::error::StartError;
use crate::key::RouteKey;
use crate::ledger::{LedgerSink, LedgerSinkConfig};
use crate::metrics::RouteMetrics;
use crate::protocol::ProtocolRegistry;
use crate::pump::CallerEnd;
use crate::table::RoutingTable;
use crate::watch::follow_registry;

pub use call::MAX_OPEN_CALLS_PER_STREAM;

/// Response metadata key naming the trace id of a routed stream.
pub const TRACE_ID_METADATA: &str = "x-reach-trace-id";
/// Response metadata key naming the instance a stream was routed to.
pub const INSTANCE_ID_METADATA: &str = "x-reach-instance-id";
/// Request metadata set on a Reply forwarded between router replicas (never forwarded again).
pub const FORWARDED_REPLY_METADATA: &str = "x-reach-forwarded-reply";
/// Request metadata of a Reply forwarded between router replicas (with trust on): the identity
/// of the agent that sent the reply, which the replica holding the call checks. Read only from
/// router identities.
pub const REPLIER_METADATA: &str = "x-reach-replier";

pub use reply::{MAX_ENDED_REPLIES, MAX_REPLY_PEERS, REPLY_PEER_IDLE};

pub use crate::metrics::UNROUTED_LABEL;

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
    waiting_replies: Mutex<HashMap<String, reply::WaitingReply>>,
    /// Calls that waited for an asynchronous reply and ended recently, by request message id,
    /// with the services that could have replied: their late or repeated replies are answered
    /// `delivered: false`, anyone else's are refused as for an unknown id. Bounded, expiring.
    ended_replies: Cache<String, Arc<[String]>>,
    /// Clients of other router replicas, by endpoint URL, for forwarding replies: only
    /// replicas a reply was forwarded to successfully; bounded, idle entries expire.
    peers: Cache<String, RouterServiceClient<Channel>>,
    /// The message ledger sink, when one is configured.
    ledger: Option<LedgerSink>,
    /// Cancelled by [`Router::close_streams`]: CallMux streams stop reading calls.
    closing: CancellationToken,
    /// The call metrics of names no instance serves.
    unrouted_metrics: Arc<RouteMetrics>,
}

impl Router {
    /// A router with an empty table. Call [`Router::spawn_registry_watch`] to fill it.
    /// Balancing draws from an OS-seeded generator. Must be called inside a tokio runtime
    /// when a ledger is configured.
    ///
    /// # Errors
    /// [`StartError::Config`] for an invalid setting, [`StartError::ProtocolRegistry`] when
    /// the protocol registry cannot be loaded, [`StartError::Ledger`] for a malformed
    /// `ledger_endpoint`.
    pub fn new(config: RouterConfig) -> Result<Self, StartError> {
        Self::with_random(config, Arc::new(ThreadRandom))
    }

    /// [`Router::new`] with balancing drawing from `random` (a
    /// [`crate::balance::SeededRandom`] makes random and weighted picks reproducible).
    ///
    /// # Errors
    /// As [`Router::new`].
    pub fn with_random(config: RouterConfig, random: Arc<dyn Random>) -> Result<Self, StartError> {
        Self::with_random_and_trust(config, random, reach_trust::Trust::disabled())
    }

    /// [`Router::new`] with `trust` (see [`Router::with_random_and_trust`]).
    ///
    /// # Errors
    /// As [`Router::new`].
    pub fn with_trust(
        config: RouterConfig,
        trust: Arc<reach_trust::Trust>,
    ) -> Result<Self, StartError> {
        Self::with_random_and_trust(config, Arc::new(ThreadRandom), trust)
    }

    /// [`Router::with_random`] with `trust`: connections to instances, the registry, the
    /// ledger and peer routers use its certificates (instances must present their service's
    /// identity), and every call is held to its policy (see [`crate::envelope::authorize`]).
    ///
    /// # Errors
    /// As [`Router::new`].
    pub fn with_random_and_trust(
        config: RouterConfig,
        random: Arc<dyn Random>,
        trust: Arc<reach_trust::Trust>,
    ) -> Result<Self, StartError> {
        config.validate()?;
        let protocols = match &config.protocol_registry {
            Some(path) => Some(Arc::new(ProtocolRegistry::load(path)?)),
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
            Some(LedgerSink::spawn_with_tls(
                &config.ledger_endpoint,
                LedgerSinkConfig {
                    recorded_by: "router".into(),
                    sample_rate: config.ledger_sample_rate,
                    ..LedgerSinkConfig::default()
                },
                trust.tls(),
            )?)
        };
        Ok(Self {
            inner: Arc::new(Inner {
                table: RoutingTable::with_trust(config, random, trust),
                budget,
                protocols,
                waiting_replies: Mutex::new(HashMap::new()),
                ended_replies: reply::ended_replies_cache(),
                peers: reply::peer_cache(),
                ledger,
                closing: CancellationToken::new(),
                unrouted_metrics: Arc::new(RouteMetrics::new(UNROUTED_LABEL)),
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

    /// Adds the router to `server`: `RouterService` (traced), typed pass-through
    /// ([`crate::passthrough`]) for every path no other service claims, reflection of the
    /// agents' typed services ([`crate::reflection`]), and their message
    /// limits, checked against each gRPC message's length prefix
    /// ([`RouterConfig::request_message_limit`], [`RouterConfig::passthrough_message_limit`]).
    pub fn add_to(&self, server: reach_rpc::GrpcServer) -> reach_rpc::GrpcServer {
        server
            .with_prefix_limit(
                <RouterServiceServer<Self> as tonic::server::NamedService>::NAME,
                self.config().prefix_limit(),
            )
            .add_service(WatchCallers::new(
                reach_telemetry::traced(self.clone().into_server()),
                self.inner.unrouted_metrics.clone(),
            ))
            .with_fallback(crate::passthrough::PassThrough::new(self.table().clone()))
            .with_reflection_source(Arc::new(crate::reflection::AgentDescriptors::new(
                self.table().clone(),
            )))
            .with_fallback_message_limit(self.config().passthrough_message_limit())
    }

    fn config(&self) -> &RouterConfig {
        self.inner.table.config()
    }

    /// The envelope rules every message is held to.
    fn rules(&self) -> EnvelopeRules {
        EnvelopeRules::of(self.config())
    }

    /// The call metrics of a route: labelled with its name while the routing table has it
    /// (names that instances registered, so bounded), else with [`UNROUTED_LABEL`].
    fn route_metrics(&self, key: &RouteKey) -> Arc<RouteMetrics> {
        match self.inner.table.route(key) {
            Some(route) => route.metrics.clone(),
            None => self.inner.unrouted_metrics.clone(),
        }
    }
}

#[tonic::async_trait]
impl RouterService for Router {
    async fn call(&self, request: Request<CallRequest>) -> Result<Response<CallResponse>, Status> {
        self.serve_call(request).await
    }

    type CallMuxStream = Pin<Box<dyn Stream<Item = Result<CallMuxResponse, Status>> + Send>>;

    async fn call_mux(
        &self,
        request: Request<Streaming<CallMuxRequest>>,
    ) -> Result<Response<Self::CallMuxStream>, Status> {
        Ok(self.serve_call_mux(request))
    }

    type StreamStream = Pin<Box<dyn Stream<Item = Result<StreamResponse, Status>> + Send>>;

    async fn stream(
        &self,
        request: Request<Streaming<StreamRequest>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        self.serve_stream(request).await
    }

    async fn publish(
        &self,
        request: Request<PublishRequest>,
    ) -> Result<Response<PublishResponse>, Status> {
        self.serve_publish(request).await
    }

    async fn reply(
        &self,
        request: Request<ReplyRequest>,
    ) -> Result<Response<ReplyResponse>, Status> {
        self.serve_reply(request).await
    }
}

/// The router's gRPC service as served (see [`Router::add_to`]): every request body is
/// watched, so that a caller abandoning it part-way (resetting its stream, or its connection
/// breaking, before it half-closed) is known, since tonic's decoder reports that as a clean
/// end (request-side CANCELLED) or fails the request before the handler runs:
/// - each request carries a [`CallerEnd`] in its extensions, which a routed stream's
///   inbound half reads to reset the instance's stream instead of half-closing it;
/// - a unary Call abandoned part-way is counted as CANCELLED in
///   `reach_router_requests_total`, under [`UNROUTED_LABEL`] since its message never named a
///   route.
#[derive(Clone)]
pub struct WatchCallers<S> {
    inner: S,
    unrouted: Arc<RouteMetrics>,
}

impl<S> WatchCallers<S> {
    fn new(inner: S, unrouted: Arc<RouteMetrics>) -> Self {
        Self { inner, unrouted }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for WatchCallers<S> {
    const NAME: &'static str = S::NAME;
}

/// The path of `RouterService.Call`.
const CALL_PATH: &str = "/reach.v1.RouterService/Call";

impl<S> tower::Service<http::Request<tonic::body::Body>> for WatchCallers<S>
where
    S: tower::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        let end = CallerEnd::default();
        request.extensions_mut().insert(end.clone());
        let unrouted = (request.uri().path() == CALL_PATH).then(|| self.unrouted.clone());
        let started = tokio::time::Instant::now();
        self.inner.call(request.map(|inner| {
            tonic::body::Body::new(WatchedRequest {
                inner,
                end,
                unrouted,
                started,
            })
        }))
    }
}

/// A request body whose failure is recorded (see [`WatchCallers`]). A failure that is the
/// serving layer's own refusal (a `Status` with no transport error under it, such as an
/// oversized message) is not the caller abandoning the request.
struct WatchedRequest {
    inner: tonic::body::Body,
    end: CallerEnd,
    /// A unary Call's metrics, where an abandoned one is counted.
    unrouted: Option<Arc<RouteMetrics>>,
    started: tokio::time::Instant,
}

impl http_body::Body for WatchedRequest {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Err(status))) = &polled
            && std::error::Error::source(status).is_some_and(|s| !s.is::<Status>())
        {
            self.end.fail(format!(
                "{}: {}",
                reach_rpc::errors::code_name(status.code()),
                status.message()
            ));
            if let Some(unrouted) = self.unrouted.take() {
                unrouted.request(tonic::Code::Cancelled, self.started.elapsed());
            }
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
