//! Serving tonic services with health and reflection on a listener the caller bound.
//!
//! Services are routed by an axum router and served by hyper's connection builder
//! (`hyper-util`) rather than `tonic::transport::Server`: tonic's server answers an expired
//! `grpc-timeout` with `CANCELLED`, while Reach enforces deadlines itself (router and SDK) and
//! answers `DEADLINE_EXCEEDED`, as the gRPC spec asks; and serving the connections ourselves
//! sets the HTTP/2 settings Reach wants ([`crate::http2::MAX_FRAME_BYTES`]), which
//! `axum::serve` does not expose.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tower::Service;

use crate::limits::{
    BufferBudget, CONNECTIONS_REFUSED, ConnectionBudgets, ConnectionLimits, HandshakeDeadline,
    MessageLimits, Metered, OPEN_CONNECTIONS,
};

/// A service for requests no added service claims (see [`GrpcServer::with_fallback`]).
pub type Fallback = tower::util::BoxCloneSyncService<
    http::Request<axum::body::Body>,
    axum::response::Response,
    Infallible,
>;

pub use crate::authenticate::{Challenge, ClientCertificates};
pub use crate::limits::DEFAULT_GRACE;

/// A set of gRPC services to serve on one listener, plus `grpc.health.v1.Health` and server
/// reflection (`grpc.reflection.v1` and `grpc.reflection.v1alpha`).
///
/// Every added service, and the server as a whole (service `""`), is reported `SERVING` by the
/// health service once serving starts, and `NOT_SERVING` when the shutdown future resolves (so
/// probes fail while in-flight calls drain).
pub struct GrpcServer {
    routes: Routes,
    health: HealthReporter,
    health_service:
        tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>,
    service_names: Vec<&'static str>,
    descriptor_sets: Vec<&'static [u8]>,
    /// Set by [`GrpcServer::with_grace`]; otherwise the limits' `shutdown_grace`.
    grace: Option<Duration>,
    limits: ConnectionLimits,
    message_limits: MessageLimits,
    fallback: Option<Fallback>,
    reflection_source: Option<std::sync::Arc<dyn crate::reflection::ReflectionSource>>,
    /// Services reported NOT_SERVING until their future resolves (see
    /// [`GrpcServer::ready_when`]).
    readiness: Vec<(&'static str, futures::future::BoxFuture<'static, ()>)>,
    /// Services whose status follows a flag ([`GrpcServer::serving_while`]).
    conditions: Vec<(&'static str, tokio::sync::watch::Receiver<bool>)>,
    /// Whether the server and every added service are SERVING, as the health service says
    /// (see [`GrpcServer::readiness`]): false until [`GrpcServer::serve`] has set their
    /// statuses, then following them.
    ready: tokio::sync::watch::Sender<bool>,
    trust: std::sync::Arc<reach_trust::Trust>,
    /// The check every request passes before routing ([`GrpcServer::with_admission`]).
    admission: Option<crate::admission::Admission>,
}

impl Default for GrpcServer {
    fn default() -> Self {
        Self::new()
    }
}

impl GrpcServer {
    /// An empty server that already knows the reach.v1 and grpc.health.v1 descriptors.
    pub fn new() -> Self {
        let health = HealthReporter::new();
        let health_service = tonic_health::pb::health_server::HealthServer::new(
            tonic_health::server::HealthService::from_health_reporter(health.clone()),
        );
        Self {
            routes: Routes::default(),
            health,
            health_service,
            service_names: Vec::new(),
            descriptor_sets: vec![
                reach_proto::FILE_DESCRIPTOR_SET,
                tonic_health::pb::FILE_DESCRIPTOR_SET,
                // google.rpc.Status and the error details (ErrorInfo, RetryInfo, BadRequest),
                // so grpcurl can decode the details of a failed call.
                tonic_types::pb::FILE_DESCRIPTOR_SET,
            ],
            grace: None,
            limits: ConnectionLimits::default(),
            message_limits: MessageLimits::default(),
            fallback: None,
            reflection_source: None,
            readiness: Vec::new(),
            conditions: Vec::new(),
            ready: tokio::sync::watch::channel(false).0,
            trust: reach_trust::Trust::disabled(),
            admission: None,
        }
    }

    /// Lets through to the services (health and reflection included) only the requests
    /// `admission` admits; the others are answered with its refusal. It runs after the TLS
    /// handshake and authentication (see [`crate::admission`]).
    pub fn with_admission(mut self, admission: crate::admission::Admission) -> Self {
        self.admission = Some(admission);
        self
    }

    /// Serves with `trust`: TLS when it has certificates (client certificates verified the
    /// SPIFFE way), and every request's caller authenticated (certificate or bearer token) and
    /// put in its extensions as a [`reach_trust::Caller`] for the services to authorize.
    /// Default [`reach_trust::Trust::disabled`]: plaintext, every caller anonymous.
    pub fn with_trust(mut self, trust: std::sync::Arc<reach_trust::Trust>) -> Self {
        self.trust = trust;
        self
    }

    /// Reports the added service `name` NOT_SERVING until `ready` resolves, then SERVING
    /// (unless shutdown has begun): for a service that answers before it can do its job, such
    /// as a router whose registry view has not synced yet, so readiness probes (Kubernetes'
    /// gRPC probe on the service's name) wait for it. The server's own status (`""`) is
    /// SERVING from the start.
    pub fn ready_when(
        mut self,
        name: &'static str,
        ready: impl Future<Output = ()> + Send + 'static,
    ) -> Self {
        self.readiness.push((name, Box::pin(ready)));
        self
    }

    /// Reports the added service `name` SERVING while `serving` holds true and NOT_SERVING
    /// while it holds false (until shutdown, which sets NOT_SERVING): for a service whose
    /// ability to do its job comes and goes, such as a registry whose store stops answering.
    pub fn serving_while(
        mut self,
        name: &'static str,
        serving: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        self.conditions.push((name, serving));
        self
    }

    /// Sends requests for paths no added service serves to `fallback` (the router's typed
    /// pass-through) instead of answering UNIMPLEMENTED.
    pub fn with_fallback<S>(mut self, fallback: S) -> Self
    where
        S: Service<
                http::Request<axum::body::Body>,
                Response = axum::response::Response,
                Error = Infallible,
            > + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        self.fallback = Some(tower::util::BoxCloneSyncService::new(fallback));
        self
    }

    /// Makes reflection answer, after the server's own descriptor sets, from `source`: its
    /// services are listed after the server's and its files served for symbols and file
    /// names the sets do not hold (the router's agents' typed services).
    pub fn with_reflection_source(
        mut self,
        source: std::sync::Arc<dyn crate::reflection::ReflectionSource>,
    ) -> Self {
        self.reflection_source = Some(source);
        self
    }

    /// Adds a tonic service; it is reported SERVING once the server runs.
    pub fn add_service<S>(mut self, svc: S) -> Self
    where
        S: Service<http::Request<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.service_names.push(S::NAME);
        self.routes = self.routes.add_service(svc);
        self
    }

    /// Adds an encoded `FileDescriptorSet` to reflection, for services outside reach.v1.
    pub fn add_file_descriptor_set(mut self, encoded: &'static [u8]) -> Self {
        self.descriptor_sets.push(encoded);
        self
    }

    /// Sets how long in-flight calls (and open streams, such as registry watches) may run after
    /// shutdown begins before their connections are closed, overriding the limits'
    /// `shutdown_grace` (see [`GrpcServer::with_limits`]). Default 10 s.
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = Some(grace);
        self
    }

    /// Sets the limits the listener holds its connections to (connections at once, handshake
    /// time, buffered message bytes) and its shutdown grace (`shutdown_grace`, unless
    /// [`GrpcServer::with_grace`] set one). Default [`ConnectionLimits::default`].
    pub fn with_limits(mut self, limits: ConnectionLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Sets the largest request message `service` (its full name, such as
    /// `reach.v1.RouterService`) accepts, in bytes: a message whose gRPC length prefix
    /// declares more is refused `RESOURCE_EXHAUSTED` / `PAYLOAD_TOO_LARGE` before any of it is
    /// buffered (see [`MessageLimits`]). Services given no limit accept
    /// [`crate::limits::DEFAULT_MAX_MESSAGE_BYTES`] (tonic's default), so a service that raises
    /// its tonic decoding limit must say so here too.
    pub fn with_message_limit(mut self, service: &str, max_message_bytes: usize) -> Self {
        self.message_limits.set(service, max_message_bytes);
        self
    }

    /// Sets `service`'s message limit as a [`crate::limits::PrefixLimit`]: refused by the
    /// length prefix above `limit.refuse_above`, the refusal naming `limit.named` (for a
    /// service that refuses the messages in between itself; see
    /// [`GrpcServer::with_message_limit`]).
    pub fn with_prefix_limit(mut self, service: &str, limit: crate::limits::PrefixLimit) -> Self {
        self.message_limits.set_prefix_limit(service, limit);
        self
    }

    /// Sets the largest request message of paths the fallback service serves (see
    /// [`GrpcServer::with_fallback`]), in bytes; without it they get
    /// [`crate::limits::DEFAULT_MAX_MESSAGE_BYTES`].
    pub fn with_fallback_message_limit(mut self, max_message_bytes: usize) -> Self {
        self.message_limits.set_fallback(max_message_bytes);
        self
    }

    /// A handle to change the health status of the served services.
    pub fn health_reporter(&self) -> HealthReporter {
        self.health.clone()
    }

    /// What `grpc.health.v1` says of this server as one flag, for an HTTP readiness check
    /// (the admin port's `GET /ready`) to say the same: true while the server as a whole
    /// (service `""`) and every added service are SERVING; false before
    /// [`GrpcServer::serve`] has set their statuses, while any is NOT_SERVING (a
    /// [`GrpcServer::ready_when`] not yet resolved, a [`GrpcServer::serving_while`] flag
    /// false, or a status set through [`GrpcServer::health_reporter`]), and from the moment
    /// shutdown begins.
    pub fn readiness(&self) -> tokio::sync::watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// Serves until `shutdown` resolves, then stops accepting connections and waits for
    /// in-flight calls to finish, at most the grace period (see [`GrpcServer::with_grace`]);
    /// returns at most a moment after it, whatever the peers do.
    ///
    /// # Errors
    /// Returns an error when a descriptor set cannot be decoded (a build bug). A failed
    /// `accept` (such as running out of file descriptors) is logged and retried after 1 s
    /// rather than ending the server.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let mut index = crate::reflection::DescriptorIndex::default();
        for set in self.descriptor_sets.iter().copied().chain([
            tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
            tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
        ]) {
            index.add_encoded_set(set)?;
        }
        // List what this server serves (the descriptor sets also describe services it does
        // not, such as AgentService on a control plane); every type stays resolvable.
        let served: Vec<&'static str> = self
            .service_names
            .iter()
            .copied()
            .chain([
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
            ])
            .collect();
        let mut message_limits = self.message_limits;
        for name in &served {
            message_limits.serve(name);
        }
        let reflection = crate::reflection::Reflection::new(
            index,
            served.iter().map(|name| name.to_string()).collect(),
            self.reflection_source,
        );
        let v1 = reflection.clone().v1();
        let v1alpha = reflection.v1alpha();
        let stopping = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        for name in &self.service_names {
            let gated = self.readiness.iter().any(|(gated, _)| gated == name)
                || self
                    .conditions
                    .iter()
                    .any(|(gated, serving)| gated == name && !*serving.borrow());
            let status = if gated {
                ServingStatus::NotServing
            } else {
                ServingStatus::Serving
            };
            self.health.set_service_status(*name, status).await;
        }
        // Every status is set: the readiness flag follows them from here.
        tokio::spawn(follow_health(
            self.health.clone(),
            self.service_names.iter().copied().chain([""]).collect(),
            self.ready,
        ));
        for (name, ready) in self.readiness {
            let (health, stopping) = (self.health.clone(), stopping.clone());
            tokio::spawn(async move {
                ready.await;
                if !stopping.load(std::sync::atomic::Ordering::SeqCst) {
                    health
                        .set_service_status(name, ServingStatus::Serving)
                        .await;
                    // Shutdown may have begun meanwhile, its NOT_SERVING already set.
                    if stopping.load(std::sync::atomic::Ordering::SeqCst) {
                        health
                            .set_service_status(name, ServingStatus::NotServing)
                            .await;
                    }
                }
            });
        }
        for (name, mut serving) in self.conditions {
            let (health, stopping) = (self.health.clone(), stopping.clone());
            tokio::spawn(async move {
                loop {
                    let status = if *serving.borrow_and_update() {
                        ServingStatus::Serving
                    } else {
                        ServingStatus::NotServing
                    };
                    if stopping.load(std::sync::atomic::Ordering::SeqCst) {
                        return;
                    }
                    health.set_service_status(name, status).await;
                    // Shutdown may have begun meanwhile, its NOT_SERVING already set.
                    if stopping.load(std::sync::atomic::Ordering::SeqCst) {
                        health
                            .set_service_status(name, ServingStatus::NotServing)
                            .await;
                        return;
                    }
                    if serving.changed().await.is_err() {
                        return;
                    }
                }
            });
        }
        let mut router = self
            .routes
            .add_service(self.health_service)
            .add_service(v1)
            .add_service(v1alpha)
            .prepare()
            .into_axum_router();
        if let Some(fallback) = self.fallback {
            router = router.fallback_service(fallback);
        }
        if let Some(admission) = self.admission {
            router = router.layer(admission);
        }
        let router = router.layer(axum::middleware::from_fn(refuse_what_is_not_grpc));
        let health = self.health.clone();
        let names = self.service_names.clone();
        let shutdown = async move {
            shutdown.await;
            stopping.store(true, std::sync::atomic::Ordering::SeqCst);
            // "" is the server's overall status, which probes ask by default (Kubernetes'
            // gRPC probe, grpc_health_probe).
            for name in names.into_iter().chain([""]) {
                health
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
        };
        let grace = self.grace.unwrap_or(self.limits.shutdown_grace);
        serve_http_with_trust(
            listener,
            router,
            shutdown,
            grace,
            self.limits,
            message_limits,
            self.trust,
        )
        .await;
        Ok(())
    }
}

/// Keeps `ready` true while every service of `names` is SERVING in `health` (watched through
/// the health service itself, so the flag says what `grpc.health.v1` says), until no one holds
/// a receiver of `ready`.
async fn follow_health(
    health: HealthReporter,
    names: Vec<&'static str>,
    ready: tokio::sync::watch::Sender<bool>,
) {
    use futures::StreamExt;
    use tonic_health::pb::health_check_response::ServingStatus as Wire;
    use tonic_health::pb::health_server::Health;
    let service = tonic_health::server::HealthService::from_health_reporter(health);
    let mut statuses = futures::stream::SelectAll::new();
    for (index, name) in names.iter().enumerate() {
        let request = tonic::Request::new(tonic_health::pb::HealthCheckRequest {
            service: (*name).to_string(),
        });
        // Every name has a status by now (serve set them); one without stays not serving.
        let Ok(watch) = service.watch(request).await else {
            tracing::warn!(service = %name, "no health status to follow; readiness stays false");
            return;
        };
        statuses.push(watch.into_inner().map(move |status| (index, status)));
    }
    let mut serving = vec![false; names.len()];
    loop {
        tokio::select! {
            () = ready.closed() => return,
            next = statuses.next() => {
                let Some((index, status)) = next else { return };
                serving[index] = status.is_ok_and(|s| s.status() == Wire::Serving);
                ready.send_replace(serving.iter().all(|serving| *serving));
            }
        }
    }
}

/// Answers a request that is not gRPC (its `content-type` is not `application/grpc…`) with
/// HTTP 415 Unsupported Media Type, as the gRPC over HTTP/2 protocol asks of servers (and
/// grpc-go does), without reading its body: a body no one parses as gRPC messages would
/// escape the buffer budgets of [`ConnectionLimits`].
async fn refuse_what_is_not_grpc(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if crate::limits::is_grpc(request.headers()) {
        return next.run(request).await;
    }
    (
        http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "this port serves gRPC only: send content-type application/grpc (grpcurl, a gRPC \
         client); the HTTP admin endpoints are on the admin port\n",
    )
        .into_response()
}

/// Accepts connections on `listener` and serves `router` on each (HTTP/2, and HTTP/1.1 for
/// plain HTTP callers such as admin endpoints), until `shutdown` resolves; then stops
/// accepting, asks every connection to finish (HTTP/2 GOAWAY; HTTP/1.1 closes after the
/// response in progress) and closes those still open after `grace`. Returns once every
/// connection is closed.
///
/// HTTP/2 connections advertise [`crate::http2::MAX_FRAME_BYTES`] and are pinged every
/// [`crate::http2::KEEPALIVE_INTERVAL`]; a peer that does not answer a ping within
/// [`crate::http2::KEEPALIVE_TIMEOUT`] is disconnected. `limits` bounds the connections
/// served at once and per peer address (at either limit, the longest-idle connection is closed
/// to make room for the new one, so probes get through a flood of idle or slow connections),
/// the time a new one has to start speaking (TLS handshake included), the time an HTTP/1.1
/// request's headers may take, the streams of an HTTP/2 connection, and the bytes of partly
/// received gRPC messages held per connection and in all (see [`ConnectionLimits`]); every
/// request carries its connection's [`Transport`]; the listener's open connections are the
/// gauge [`OPEN_CONNECTIONS`], and what the limits closed is counted in
/// [`CONNECTIONS_REFUSED`]. Each gRPC request message is held to
/// [`crate::limits::DEFAULT_MAX_MESSAGE_BYTES`] (see [`serve_http_with_message_limits`]).
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: ConnectionLimits,
) {
    serve_http_with_message_limits(
        listener,
        router,
        shutdown,
        grace,
        limits,
        MessageLimits::default(),
    )
    .await;
}

/// [`serve_http`], with each gRPC request message held to its path's limit in
/// `message_limits` (checked against its length prefix, see [`MessageLimits`]).
pub async fn serve_http_with_message_limits(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: ConnectionLimits,
    message_limits: MessageLimits,
) {
    serve_http_with_trust(
        listener,
        router,
        shutdown,
        grace,
        limits,
        message_limits,
        reach_trust::Trust::disabled(),
    )
    .await;
}

/// [`serve_http_with_message_limits`], with `trust`: when it has certificates, each
/// connection is TLS (the handshake held to the limits' `handshake_timeout`; a client
/// certificate whose identity is not of the trust domain ends the connection), and when it
/// authenticates, each request's caller is established ([`reach_trust::Trust::authenticate`])
/// and put in its extensions as a [`reach_trust::Caller`]. A request whose credentials are
/// refused is answered `UNAUTHENTICATED` (gRPC) or 401 (HTTP) without reaching `router`,
/// except GETs of the admin paths the policy leaves open and gRPC health checks.
pub async fn serve_http_with_trust(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: ConnectionLimits,
    message_limits: MessageLimits,
    trust: std::sync::Arc<reach_trust::Trust>,
) {
    serve_http_with_client_certificates(
        listener,
        router,
        shutdown,
        grace,
        limits,
        message_limits,
        trust,
        ClientCertificates::AsConfigured,
    )
    .await;
}

/// [`serve_http_with_trust`], asking TLS clients for certificates as `client_certificates`
/// says.
#[allow(clippy::too_many_arguments)]
pub async fn serve_http_with_client_certificates(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: ConnectionLimits,
    message_limits: MessageLimits,
    trust: std::sync::Arc<reach_trust::Trust>,
    client_certificates: ClientCertificates,
) {
    serve_http_with_challenges(
        listener,
        router,
        shutdown,
        grace,
        limits,
        message_limits,
        trust,
        client_certificates,
        Vec::new(),
    )
    .await;
}

/// [`serve_http_with_client_certificates`], with the 401 of a request under a
/// [`Challenge`]'s prefix naming that challenge's resource metadata.
#[allow(clippy::too_many_arguments)]
pub async fn serve_http_with_challenges(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: ConnectionLimits,
    message_limits: MessageLimits,
    trust: std::sync::Arc<reach_trust::Trust>,
    client_certificates: ClientCertificates,
    challenges: Vec<Challenge>,
) {
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    use hyper_util::server::conn::auto::Builder;

    let router = if trust.is_enabled() {
        router.layer(axum::middleware::from_fn_with_state(
            std::sync::Arc::new(crate::authenticate::Authentication {
                trust: trust.clone(),
                challenges,
            }),
            crate::authenticate::authenticate,
        ))
    } else {
        router
    };
    let mut builder = Builder::new(TokioExecutor::new());
    // The timer lets hyper enforce its HTTP/1.1 header read timeout.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_frame_size(crate::http2::MAX_FRAME_BYTES)
        .max_concurrent_streams(limits.http2_max_concurrent_streams)
        .max_pending_accept_reset_streams(crate::http2::MAX_PENDING_ACCEPT_RESET_STREAMS)
        .max_local_error_reset_streams(crate::http2::MAX_LOCAL_ERROR_RESET_STREAMS)
        .keep_alive_interval(crate::http2::KEEPALIVE_INTERVAL)
        .keep_alive_timeout(crate::http2::KEEPALIVE_TIMEOUT);
    let listener_name: std::sync::Arc<str> = listener
        .local_addr()
        .map_or_else(|_| "unknown".into(), |addr| addr.to_string().into());
    // Metric handles are looked up when used (per connection, not per request), not once here:
    // a handle taken before the process installs its recorder would stay a no-op for good.
    let mut over_limit = OverLimit::new(listener_name.clone(), limits);
    let listener_budget = BufferBudget::new(limits.max_buffered_bytes);
    let message_limits = std::sync::Arc::new(message_limits);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut connections = Connections::new(limits);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer_addr)) => {
                    let peer_ip = peer_addr.ip().to_canonical();
                    match connections.admit(peer_ip) {
                        Room::Refused(reason) => over_limit.refuse(tcp, reason),
                        Room::Made { evicted } => {
                            if evicted {
                                over_limit.evicted();
                            }
                            // Small gRPC frames must not wait for Nagle's algorithm.
                            let _ = tcp.set_nodelay(true);
                            let budgets = ConnectionBudgets {
                                connection: BufferBudget::new(limits.max_buffered_bytes_per_connection),
                                listener: listener_budget.clone(),
                                listener_name: listener_name.clone(),
                                metered: Metered::Requests,
                                message_limits: message_limits.clone(),
                            };
                            let open = OpenConnection::new(&listener_name);
                            let activity = connections.activity();
                            let tracked = activity.clone();
                            let connect_info = tonic::transport::server::TcpConnectInfo {
                                local_addr: tcp.local_addr().ok(),
                                remote_addr: Some(peer_addr),
                            };
                            let (router, builder, watcher) =
                                (router.clone(), builder.clone(), graceful.watcher());
                            let (listener_name, trust) = (listener_name.clone(), trust.clone());
                            let task = async move {
                                let served = match trust.tls() {
                                    None => {
                                        let io = HandshakeDeadline::new(tcp, limits.handshake_timeout, listener_name);
                                        serve_connection(io, router, &builder, watcher, budgets, activity, connect_info, None).await
                                    }
                                    Some(tls) => {
                                        let Some((stream, peer)) = crate::authenticate::accept_tls(
                                            tls,
                                            tcp,
                                            limits.handshake_timeout,
                                            &listener_name,
                                            client_certificates,
                                        )
                                        .await
                                        else {
                                            return;
                                        };
                                        let io = HandshakeDeadline::new(stream, limits.handshake_timeout, listener_name);
                                        serve_connection(io, router, &builder, watcher, budgets, activity, connect_info, Some(peer)).await
                                    }
                                };
                                if let Err(error) = served {
                                    tracing::trace!(%error, "connection ended with an error");
                                }
                                drop(open);
                            };
                            connections.spawn(peer_ip, tracked, task);
                        }
                    }
                }
                Err(error) => wait_after_accept_error(error).await,
            },
            // Reap finished connections so the table holds only open ones.
            Some(joined) = connections.set.join_next_with_id(), if !connections.set.is_empty() => {
                connections.joined(joined);
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        // Connections that ended since the loop stopped reaping are not open any more.
        connections.reap();
        tracing::warn!(grace = ?grace, open = connections.open.len(), "grace period over; closing remaining connections");
    }
    connections.set.shutdown().await;
}

/// What one connection is doing, as the accept loop sees it when it must choose a
/// connection to close: how many of its requests are in progress (until their responses
/// have been sent whole) and when it last started or finished one.
struct Activity {
    in_flight: std::sync::atomic::AtomicUsize,
    /// Milliseconds from the listener's epoch to the connection's last activity (its accept,
    /// or a request starting or ending).
    last_active_ms: std::sync::atomic::AtomicU64,
    epoch: std::time::Instant,
}

impl Activity {
    fn new(epoch: std::time::Instant) -> Self {
        let activity = Self {
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            last_active_ms: std::sync::atomic::AtomicU64::new(0),
            epoch,
        };
        activity.touch();
        activity
    }

    fn touch(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_active_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// `Some(last activity)` while no request is in progress.
    fn idle_since(&self) -> Option<u64> {
        (self.in_flight.load(std::sync::atomic::Ordering::Acquire) == 0).then(|| {
            self.last_active_ms
                .load(std::sync::atomic::Ordering::Relaxed)
        })
    }
}

/// A request in progress on a connection, from the moment its head is read until its
/// response has been sent whole (or dropped).
struct Busy(std::sync::Arc<Activity>);

impl Busy {
    fn start(activity: &std::sync::Arc<Activity>) -> Self {
        activity
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        activity.touch();
        Self(activity.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        self.0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request [`Busy`] until it has been sent (dropped).
    struct BusyBody {
        #[pin]
        inner: axum::body::Body,
        busy: Busy,
    }
}

impl http_body::Body for BusyBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The listener's open connections: their tasks, what each is doing, and how many each peer
/// address holds, to admit a new connection within `max_connections` and
/// `max_connections_per_peer` (closing the longest-idle one to make room; see
/// [`ConnectionLimits::max_connections`]).
struct Connections {
    set: tokio::task::JoinSet<()>,
    open: std::collections::HashMap<tokio::task::Id, OpenEntry>,
    per_peer: std::collections::HashMap<std::net::IpAddr, usize>,
    limits: ConnectionLimits,
    epoch: std::time::Instant,
}

struct OpenEntry {
    peer: std::net::IpAddr,
    activity: std::sync::Arc<Activity>,
    abort: tokio::task::AbortHandle,
}

/// Whether a new connection is served.
enum Room {
    /// Served; `evicted` when an idle connection was closed to make room.
    Made { evicted: bool },
    /// Closed at once: every connection it could replace is busy (the reason label).
    Refused(&'static str),
}

impl Connections {
    fn new(limits: ConnectionLimits) -> Self {
        Self {
            set: tokio::task::JoinSet::new(),
            open: std::collections::HashMap::new(),
            per_peer: std::collections::HashMap::new(),
            limits,
            epoch: std::time::Instant::now(),
        }
    }

    /// Decides on a new connection from `peer`: room within both limits, else the room of the
    /// longest-idle connection (of that peer when the peer is at its own limit), else refused.
    fn admit(&mut self, peer: std::net::IpAddr) -> Room {
        self.reap();
        let mut evicted = false;
        let per_peer = self.limits.max_connections_per_peer;
        if per_peer > 0 && self.per_peer.get(&peer).copied().unwrap_or(0) >= per_peer {
            if !self.evict_idle(Some(peer)) {
                return Room::Refused("max_connections_per_peer");
            }
            evicted = true;
        }
        if self.open.len() >= self.limits.max_connections {
            if !self.evict_idle(None) {
                return Room::Refused("max_connections");
            }
            evicted = true;
        }
        Room::Made { evicted }
    }

    /// A new connection's activity record, for its task and [`Connections::spawn`].
    fn activity(&self) -> std::sync::Arc<Activity> {
        std::sync::Arc::new(Activity::new(self.epoch))
    }

    /// Runs the admitted connection's task, recording `activity` as its.
    fn spawn(
        &mut self,
        peer: std::net::IpAddr,
        activity: std::sync::Arc<Activity>,
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        let abort = self.set.spawn(task);
        *self.per_peer.entry(peer).or_default() += 1;
        self.open.insert(
            abort.id(),
            OpenEntry {
                peer,
                activity,
                abort,
            },
        );
    }

    /// Closes the longest-idle connection (of `peer` only, when given); false when there is
    /// none (every connection has a request in progress).
    fn evict_idle(&mut self, peer: Option<std::net::IpAddr>) -> bool {
        let oldest = self
            .open
            .iter()
            .filter(|(_, entry)| peer.is_none_or(|peer| entry.peer == peer))
            .filter_map(|(id, entry)| entry.activity.idle_since().map(|since| (since, *id)))
            .min();
        let Some((_, id)) = oldest else {
            return false;
        };
        if let Some(entry) = self.forget(id) {
            // Dropping the task's future closes the connection (and its gauge).
            entry.abort.abort();
        }
        true
    }

    /// Takes the connections whose tasks have ended out of the table.
    fn reap(&mut self) {
        while let Some(joined) = self.set.try_join_next_with_id() {
            self.joined(joined);
        }
    }

    /// Records a connection task's end.
    fn joined(&mut self, joined: Result<(tokio::task::Id, ()), tokio::task::JoinError>) {
        let id = match joined {
            Ok((id, ())) => id,
            Err(error) => error.id(),
        };
        self.forget(id);
    }

    fn forget(&mut self, id: tokio::task::Id) -> Option<OpenEntry> {
        let entry = self.open.remove(&id)?;
        if let std::collections::hash_map::Entry::Occupied(mut count) =
            self.per_peer.entry(entry.peer)
        {
            *count.get_mut() -= 1;
            if *count.get() == 0 {
                count.remove();
            }
        }
        Some(entry)
    }
}

/// Serves one accepted connection (`io`: plaintext, or TLS with the client's `peer` identity,
/// which every request then carries in its extensions, as do [`Transport`] and
/// `connect_info`, the addresses tonic's `Request::remote_addr` reads) until it ends or
/// graceful shutdown closes it; each request is counted in `activity` until its response has
/// been sent.
#[allow(clippy::too_many_arguments)]
async fn serve_connection<T>(
    io: T,
    router: axum::Router,
    builder: &hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>,
    watcher: hyper_util::server::graceful::Watcher,
    budgets: ConnectionBudgets,
    activity: std::sync::Arc<Activity>,
    connect_info: tonic::transport::server::TcpConnectInfo,
    peer: Option<reach_trust::PeerIdentity>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use hyper_util::rt::TokioIo;
    use hyper_util::service::TowerToHyperService;
    use tower::ServiceExt;
    let transport = if peer.is_some() {
        Transport::Tls
    } else {
        Transport::Plaintext
    };
    let service = tower::service_fn(move |mut request: http::Request<hyper::body::Incoming>| {
        if let Some(peer) = &peer {
            request.extensions_mut().insert(peer.clone());
        }
        request.extensions_mut().insert(transport);
        request.extensions_mut().insert(connect_info.clone());
        let busy = Busy::start(&activity);
        let call = router.clone().oneshot(budgets.meter(request));
        async move {
            let response = call.await?;
            Ok::<_, Infallible>(
                response.map(|inner| axum::body::Body::new(BusyBody { inner, busy })),
            )
        }
    });
    let connection = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
    watcher.watch(connection.into_owned()).await
}

/// How the connection a request came on is carried, in every request's extensions:
/// [`Transport::Tls`] when the listener serves TLS (whatever the HTTP version), for what
/// depends on it, such as whether a cookie is `Secure`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Plain TCP.
    Plaintext,
    /// TLS.
    Tls,
}

impl Transport {
    /// The transport of the request with `extensions`; [`Transport::Plaintext`] when no
    /// Reach server put one there (a request served some other way).
    pub fn of(extensions: &http::Extensions) -> Self {
        extensions.get().copied().unwrap_or(Self::Plaintext)
    }
}

/// One open connection in [`OPEN_CONNECTIONS`], from accept until its task ends or is cut.
struct OpenConnection(metrics::Gauge);

impl OpenConnection {
    fn new(listener_name: &str) -> Self {
        let gauge = metrics::gauge!(OPEN_CONNECTIONS, "listener" => listener_name.to_string());
        gauge.increment(1);
        Self(gauge)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.decrement(1);
    }
}

/// Connections closed because the listener was at `server.max_connections` or a peer at
/// `server.max_connections_per_peer`: each counted in [`CONNECTIONS_REFUSED`] (reason
/// `max_connections`, `max_connections_per_peer`, or `idle_evicted` for an idle connection
/// closed to make room), and logged at most every 10 s (the first of a burst at once), so a
/// flood does not flood the log too; the counter has the exact totals.
struct OverLimit {
    listener_name: std::sync::Arc<str>,
    limits: ConnectionLimits,
    /// Connections closed and not yet logged.
    since_warning: u64,
    last_warning: Option<std::time::Instant>,
}

impl OverLimit {
    const WARN_EVERY: Duration = Duration::from_secs(10);

    fn new(listener_name: std::sync::Arc<str>, limits: ConnectionLimits) -> Self {
        Self {
            listener_name,
            limits,
            since_warning: 0,
            last_warning: None,
        }
    }

    /// Closes `tcp` at once; the peer sees the connection end before any response.
    fn refuse(&mut self, tcp: tokio::net::TcpStream, reason: &'static str) {
        drop(tcp);
        self.count(reason);
    }

    /// Counts an idle connection closed to make room for a new one.
    fn evicted(&mut self) {
        self.count("idle_evicted");
    }

    fn count(&mut self, reason: &'static str) {
        metrics::counter!(
            CONNECTIONS_REFUSED,
            "reason" => reason,
            "listener" => self.listener_name.to_string()
        )
        .increment(1);
        self.since_warning += 1;
        if self
            .last_warning
            .is_none_or(|last| last.elapsed() >= Self::WARN_EVERY)
        {
            tracing::warn!(
                listener = %self.listener_name,
                max_connections = self.limits.max_connections,
                max_connections_per_peer = self.limits.max_connections_per_peer,
                reason,
                closed_since_last_warning = self.since_warning,
                "at a connection limit (server.max_connections, server.max_connections_per_peer): \
                 closing idle connections to make room, and new ones when every connection is \
                 busy; raise the limits or add replicas if this is real load \
                 (reach_server_connections_refused_total counts every one by reason)"
            );
            self.since_warning = 0;
            self.last_warning = Some(std::time::Instant::now());
        }
    }
}

/// What a failed `accept` calls for: a connection that failed before it was accepted is the
/// peer's business; anything else (such as `EMFILE`, out of file descriptors) is logged and
/// accepting pauses for a second, so the loop does not spin while nothing can be accepted.
async fn wait_after_accept_error(error: std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        error.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(%error, "accepting a connection failed; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// Why serving failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A file descriptor set could not be decoded.
    #[error("cannot build the reflection service: {0}")]
    Reflection(#[from] prost::DecodeError),
}
