//! [`AgentRuntime`]: serves `reach.v1.AgentService` around the handlers, registers with the
//! registry, keeps the lease alive, and drains on shutdown.
//!
//! Lifecycle: bind → serve → register (REGISTERED; READY once the registry's health probe
//! passes) → heartbeat every third of the lease, reporting READY or BUSY (in flight ≥
//! `max_concurrency`) → on shutdown: report DRAINING, refuse new messages with UNAVAILABLE
//! (`INSTANCE_DRAINING`, so the router redelivers them elsewhere), wait for in-flight work up
//! to `max_drain`, deregister, stop serving.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt};
use prost::Message as _;
use reach_proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::{
    Capability, DeregisterRequest, HandleMuxRequest, HandleMuxResponse, HandleRequest,
    HandleResponse, HandleStreamRequest, HandleStreamResponse, Header, HeartbeatRequest,
    InstanceSpec, InstanceState, Payload, ReachMessage, RegisterRequest, header,
};
use reach_rpc::backoff::Backoff;
use reach_rpc::errors::{reason, status_with_reason};
use reach_rpc::{GrpcServer, deadline, mux, trace};
use tokio::sync::{Notify, Semaphore, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::capability::DescribedCapability;
use crate::config::AgentConfig;
use crate::dedupe::DedupeCache;
use crate::handler::{Handler, HandlerContext, ReplyMetadata, StreamHandler};
use crate::models::ModelSlots;

/// Why an agent could not run.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A setting of [`AgentConfig`] cannot work ([`AgentConfig::validate`]).
    #[error("invalid agent config: {0}")]
    InvalidConfig(#[from] crate::config::ConfigError),
    /// The configuration is invalid otherwise (a capability over the registry's bounds, TLS
    /// material that does not load); the message names the setting.
    #[error("invalid agent config: {0}")]
    Config(String),
    /// The listener's address could not be read.
    #[error("cannot read the listener address: {0}")]
    Listener(std::io::Error),
    /// Serving failed.
    #[error(transparent)]
    Serve(#[from] reach_rpc::server::ServeError),
    /// The registry refused the registration for good (INVALID_ARGUMENT, PERMISSION_DENIED, UNAUTHENTICATED or
    /// FAILED_PRECONDITION: a bad name, version or capability descriptor, which no retry can
    /// fix); the message is the registry's.
    #[error(
        "the registry refused this agent's registration: {0}; it cannot succeed as configured: fix what it names and start the agent again"
    )]
    RegistrationRefused(String),
}

/// Adds one of the agent's own gRPC services to its server.
type AddService = Box<dyn FnOnce(GrpcServer) -> GrpcServer + Send>;

/// An agent process: handlers by capability, served and registered.
pub struct AgentRuntime {
    config: AgentConfig,
    handlers: HashMap<String, Arc<dyn Handler>>,
    stream_handlers: HashMap<String, Arc<dyn StreamHandler>>,
    capabilities: Vec<Capability>,
    grpc_services: Vec<(String, AddService)>,
    /// The model call slots (`config.model_slots` of them), shared with every handler.
    model_slots: ModelSlots,
    /// What is wrong with the described capabilities; [`AgentRuntime::start`] refuses them.
    problems: Vec<String>,
}

impl AgentRuntime {
    /// A runtime with no handlers yet.
    pub fn new(config: AgentConfig) -> Self {
        Self {
            model_slots: ModelSlots::new(config.model_slots),
            config,
            handlers: HashMap::new(),
            stream_handlers: HashMap::new(),
            capabilities: Vec::new(),
            grpc_services: Vec::new(),
            problems: Vec::new(),
        }
    }

    /// This agent's model call slots (`AgentConfig::model_slots` of them; every
    /// [`HandlerContext::model_slots`] is a clone): wrap each model call in
    /// [`ModelSlots::acquire`], and heartbeats report the model's load.
    pub fn model_slots(&self) -> ModelSlots {
        self.model_slots.clone()
    }

    /// Serves one of the agent's own tonic services (for example
    /// `examples.complaints.v1.TriageService`) next to AgentService, and registers its name so
    /// the router forwards its method paths to this instance (typed pass-through).
    /// `descriptor_set` (the service's encoded `FileDescriptorSet`) is added to reflection.
    pub fn grpc_service<S>(mut self, service: S, descriptor_set: Option<&'static [u8]>) -> Self
    where
        S: tower::Service<http::Request<tonic::body::Body>, Error = std::convert::Infallible>
            + tonic::server::NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.grpc_services.push((
            S::NAME.to_string(),
            Box::new(move |server: GrpcServer| {
                let server = server.add_service(service);
                match descriptor_set {
                    Some(set) => server.add_file_descriptor_set(set),
                    None => server,
                }
            }),
        ));
        self
    }

    /// Serves unary messages for `capability` (semver `version`) with `handler`.
    pub fn handle(self, capability: &str, version: &str, handler: impl Handler) -> Self {
        self.handle_described(DescribedCapability::new(capability, version), handler)
    }

    /// Serves unary messages for `capability` with `handler`, registering its description
    /// and JSON Schemas (served by the registry's ListCapabilities). The registry refuses a
    /// registration whose description or schemas are out of bounds (see
    /// [`DescribedCapability`]).
    pub fn handle_described(
        mut self,
        capability: DescribedCapability,
        handler: impl Handler,
    ) -> Self {
        self.handlers
            .insert(capability.name.clone(), Arc::new(handler));
        self.declare(capability);
        self
    }

    /// Serves streams for `capability` with `handler`, registering its description and
    /// schemas (as [`AgentRuntime::handle_described`]).
    pub fn handle_stream_described(
        mut self,
        capability: DescribedCapability,
        handler: impl StreamHandler,
    ) -> Self {
        self.stream_handlers
            .insert(capability.name.clone(), Arc::new(handler));
        self.declare(capability);
        self
    }

    /// Serves streams for `capability` (semver `version`) with `handler`.
    pub fn handle_stream(
        self,
        capability: &str,
        version: &str,
        handler: impl StreamHandler,
    ) -> Self {
        self.handle_stream_described(DescribedCapability::new(capability, version), handler)
    }

    /// Declares `capability` once: a unary and a stream handler of one name share it, the
    /// first declaration's version stays, and a later one's non-empty description and
    /// schemas fill in.
    fn declare(&mut self, capability: DescribedCapability) {
        if let Err(problem) = capability.check() {
            self.problems.push(problem);
        }
        let declared = capability.to_proto();
        match self
            .capabilities
            .iter_mut()
            .find(|c| c.name == declared.name)
        {
            None => self.capabilities.push(declared),
            Some(existing) => {
                for (field, new) in [
                    (&mut existing.description, declared.description),
                    (&mut existing.input_schema, declared.input_schema),
                    (&mut existing.output_schema, declared.output_schema),
                ] {
                    if !new.is_empty() {
                        *field = new;
                    }
                }
            }
        }
    }

    /// Serves on `listener` and registers, until `shutdown` resolves; then drains and
    /// deregisters. Returns once the instance has left the mesh.
    ///
    /// Registration is retried (20 ms doubling to 2 s) while the registry is unreachable, and
    /// repeated when the registry has lost the lease (for example after it restarted).
    ///
    /// # Errors
    /// [`AgentError`] when the config is invalid or serving fails;
    /// [`AgentError::RegistrationRefused`] (after draining) when the registry refuses the
    /// registration for good.
    pub async fn run(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AgentError> {
        let (running, _) = self.start(listener).await?;
        let refused = tokio::select! {
            () = shutdown => None,
            refusal = running.registration_refused() => Some(refusal),
        };
        let drained = running.drain().await;
        match refused {
            Some(refusal) => Err(AgentError::RegistrationRefused(refusal)),
            None => drained,
        }
    }

    /// Starts serving and registering, and returns a handle to drain it later plus the
    /// instance's endpoint URL. [`AgentRuntime::run`] is `start` + wait + drain.
    ///
    /// # Errors
    /// [`AgentError`] when the config is invalid (also: a described capability over the
    /// registry's bounds, see [`DescribedCapability::check`]) or the listener address is
    /// unreadable.
    pub async fn start(
        self,
        listener: tokio::net::TcpListener,
    ) -> Result<(RunningAgent, String), AgentError> {
        let mut config = self.config;
        config.validate()?;
        if let Some(problem) = self.problems.into_iter().next() {
            return Err(AgentError::Config(problem));
        }
        if config.instance_id.is_empty() {
            config.instance_id = format!(
                "{}-{}",
                config.service,
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            );
        }
        let addr: SocketAddr = listener.local_addr().map_err(AgentError::Listener)?;
        let host = if config.advertise_host.is_empty() {
            if addr.ip().is_unspecified() {
                return Err(AgentError::Config(format!(
                    "the agent listens on {addr}, a wildcard address the router cannot dial: set agent.advertise_host to the address others reach it at (a pod IP, a DNS name), or listen on a specific address"
                )));
            }
            addr.ip().to_string()
        } else {
            config.advertise_host.clone()
        };
        let endpoint = if host.contains(':') {
            format!("http://[{host}]:{}", addr.port())
        } else {
            format!("http://{host}:{}", addr.port())
        };

        let trust = match &config.tls {
            None => reach_trust::Trust::disabled(),
            Some(tls) => reach_trust::Trust::load(&reach_trust::TrustConfig {
                trust_domain: config.trust_domain.clone(),
                tls: Some(tls.clone()),
                ..reach_trust::TrustConfig::default()
            })
            .map_err(|e| AgentError::Config(format!("agent.tls: {e}")))?,
        };
        // Serving TLS, the agent answers only routers (and the registry's health probes), so
        // that the router's call policy cannot be skipped by dialing the agent.
        let direct_callers = match trust.tls() {
            Some(_) => Some(config.direct_callers()?),
            None => None,
        };
        let shared = Arc::new(Shared {
            direct_callers: direct_callers.clone(),
            instance_id: Arc::from(config.instance_id.as_str()),
            source: format!("{}.{}", config.service, config.instance_id),
            protocol_version: config.protocol_version.clone(),
            handlers: self.handlers,
            stream_handlers: self.stream_handlers,
            permits: Semaphore::new(config.max_concurrency),
            max_message_bytes: config.max_message_bytes,
            in_flight: AtomicU32::new(0),
            model_slots: self.model_slots.clone(),
            idle: Notify::new(),
            draining: AtomicBool::new(false),
            closing: CancellationToken::new(),
            dedupe: DedupeCache::new(
                config.dedupe_window,
                config.dedupe_capacity,
                config.dedupe_max_bytes,
            ),
        });

        let (stop_serving, serving_stopped) = watch::channel(false);
        let mut grpc_service_names = Vec::new();
        // The server stops only at the end of a drain, which already gave in-flight work its
        // `max_drain`; what is still open then gets a short grace, not another full one.
        let mut server = GrpcServer::new()
            .with_grace(SERVER_GRACE_AFTER_DRAIN)
            .with_limits(config.server)
            .with_trust(trust.clone());
        if let Some(callers) = &direct_callers {
            server = server.with_admission(callers.admission());
        }
        for (name, add) in self.grpc_services {
            grpc_service_names.push(name);
            server = add(server);
        }
        let agent_service = AgentServiceServer::new(AgentGrpc {
            shared: shared.clone(),
        })
        // The transport's limit leaves room for a multiplexed frame's own fields; the message
        // limit itself is checked per call (PAYLOAD_TOO_LARGE), so one oversized message never
        // breaks a stream other calls share.
        .max_decoding_message_size(config.max_message_bytes + mux::FRAME_OVERHEAD_BYTES)
        .max_encoding_message_size(config.max_message_bytes + mux::FRAME_OVERHEAD_BYTES);
        let server = server
            .with_message_limit(
                <AgentServiceServer<AgentGrpc> as tonic::server::NamedService>::NAME,
                config.max_message_bytes + mux::FRAME_OVERHEAD_BYTES,
            )
            .add_service(reach_telemetry::traced(agent_service));
        let health = server.health_reporter();
        let serve = tokio::spawn(server.serve(listener, async move {
            let mut stopped = serving_stopped;
            let _ = stopped.wait_for(|stop| *stop).await;
        }));

        let spec = InstanceSpec {
            service: config.service.clone(),
            instance_id: config.instance_id.clone(),
            endpoint: endpoint.clone(),
            capabilities: self.capabilities,
            protocol_version: config.protocol_version.clone(),
            weight: config.weight,
            max_concurrency: u32::try_from(config.max_concurrency).unwrap_or(u32::MAX),
            topics: config.topics.clone(),
            labels: config.labels.clone(),
            grpc_services: grpc_service_names,
        };
        let registry = tonic::transport::Endpoint::from_shared(config.registry_endpoint.clone())
            .map_err(|e| {
                AgentError::Config(format!(
                    "agent.registry_endpoint {:?}: {e}",
                    config.registry_endpoint
                ))
            })?
            .connect_timeout(Duration::from_secs(1))
            .timeout(REGISTRY_CALL_TIMEOUT)
            .tcp_nodelay(true);
        let registry = reach_rpc::http2::channel_lazy(&registry, trust.tls(), None);
        let join_token = if config.join_token.is_empty() {
            None
        } else {
            Some(
                tonic::metadata::MetadataValue::try_from(format!(
                    "Bearer {}",
                    config.join_token.trim()
                ))
                .map_err(|_| {
                    AgentError::Config(
                        "agent.join_token is not a valid token (it must be printable ASCII)".into(),
                    )
                })?,
            )
        };
        let lease = Arc::new(tokio::sync::Mutex::new(None::<String>));
        let stop_heartbeats = CancellationToken::new();
        let (refused_tx, refused) = watch::channel(None);
        let registration = keep_registered(
            RegistryServiceClient::new(registry.clone()),
            Enrollment {
                spec,
                lease_ttl: config.lease_ttl,
                join_token,
            },
            {
                let shared = shared.clone();
                (
                    move || shared.in_flight.load(Ordering::SeqCst),
                    config.max_concurrency,
                    self.model_slots.clone(),
                )
            },
            lease.clone(),
            stop_heartbeats.clone(),
            reach_rpc::backoff::uniform_unit,
        );
        let heartbeats = tokio::spawn(
            async move {
                if let Err(status) = registration.await {
                    refused_tx.send_replace(Some(status.message().to_string()));
                }
            }
            .instrument(info_span!("agent", instance = %config.instance_id)),
        );
        info!(instance = %config.instance_id, %endpoint, "agent serving");
        Ok((
            RunningAgent {
                shared,
                registry: RegistryServiceClient::new(registry),
                lease,
                stop_heartbeats,
                heartbeats,
                refused,
                health,
                stop_serving,
                serve,
                max_drain: config.max_drain,
            },
            endpoint,
        ))
    }
}

/// A started agent. Call [`RunningAgent::drain`] to take it out of the mesh.
pub struct RunningAgent {
    shared: Arc<Shared>,
    registry: RegistryServiceClient<Channel>,
    lease: Arc<tokio::sync::Mutex<Option<String>>>,
    stop_heartbeats: CancellationToken,
    heartbeats: tokio::task::JoinHandle<()>,
    /// Set once the registry refused the registration for good.
    refused: watch::Receiver<Option<String>>,
    /// The server's health: NOT_SERVING from the start of a drain.
    health: tonic_health::server::HealthReporter,
    stop_serving: watch::Sender<bool>,
    serve: tokio::task::JoinHandle<Result<(), reach_rpc::server::ServeError>>,
    max_drain: Duration,
}

impl RunningAgent {
    /// Resolves when the registry has refused the registration for good (see
    /// [`AgentError::RegistrationRefused`]), to the registry's message; never resolves while
    /// the registration stands or is being retried. [`AgentRuntime::run`] drains and returns
    /// the error then; a caller of [`AgentRuntime::start`] can do the same.
    pub async fn registration_refused(&self) -> String {
        let mut refused = self.refused.clone();
        // The watch guard is dropped before the next await, so the future is Send.
        let refusal = match refused.wait_for(Option::is_some).await {
            Ok(refusal) => Some(refusal.clone().unwrap_or_default()),
            Err(_) => None,
        };
        match refusal {
            Some(refusal) => refusal,
            None => std::future::pending().await,
        }
    }

    /// This instance's id.
    pub fn instance_id(&self) -> &str {
        &self.shared.instance_id
    }

    /// Messages being handled now.
    pub fn in_flight(&self) -> u32 {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// This instance's model call slots (see [`AgentRuntime::model_slots`]).
    pub fn model_slots(&self) -> ModelSlots {
        self.shared.model_slots.clone()
    }

    /// Drains: reports DRAINING, refuses new messages, waits up to `max_drain` for in-flight
    /// work, deregisters and stops serving.
    ///
    /// # Errors
    /// [`AgentError::Serve`] when the server had failed.
    pub async fn drain(self) -> Result<(), AgentError> {
        let instance = self.shared.instance_id.clone();
        self.shared.draining.store(true, Ordering::SeqCst);
        // Readiness probes (Kubernetes' gRPC probe asks "") see the drain at once.
        for service in [AGENT_SERVICE_NAME, ""] {
            self.health
                .set_service_status(service, tonic_health::ServingStatus::NotServing)
                .await;
        }
        self.shared.closing.cancel();
        self.stop_heartbeats.cancel();
        let _ = self.heartbeats.await;
        let lease = self.lease.lock().await.clone();
        let mut registry = self.registry;
        if let Some(lease_id) = &lease {
            let models = self.shared.model_slots.load();
            let report = HeartbeatRequest {
                instance_id: instance.to_string(),
                lease_id: lease_id.clone(),
                state: InstanceState::Draining as i32,
                in_flight: self.shared.in_flight.load(Ordering::SeqCst),
                model_calls_in_flight: models.in_flight,
                model_slots_free: models.free,
            };
            if let Err(status) = registry.heartbeat(report).await {
                warn!(instance = %instance, error = %status.message(), "could not report draining");
            }
        }
        info!(instance = %instance, in_flight = self.shared.in_flight.load(Ordering::SeqCst), "draining");
        let drained = tokio::time::timeout(self.max_drain, self.shared.wait_idle())
            .await
            .is_ok();
        if !drained {
            warn!(
                instance = %instance,
                in_flight = self.shared.in_flight.load(Ordering::SeqCst),
                max_drain = ?self.max_drain,
                "drain time exceeded; abandoning in-flight work"
            );
        }
        if let Some(lease_id) = lease {
            let request = DeregisterRequest {
                instance_id: instance.to_string(),
                lease_id,
            };
            if let Err(status) = registry.deregister(request).await {
                warn!(instance = %instance, error = %status.message(), "could not deregister; the lease will expire");
            }
        }
        let _ = self.stop_serving.send(true);
        match tokio::time::timeout(
            SERVER_GRACE_AFTER_DRAIN + Duration::from_secs(2),
            self.serve,
        )
        .await
        {
            Ok(Ok(result)) => result?,
            Ok(Err(_)) | Err(_) => warn!(instance = %instance, "server did not stop in time"),
        }
        info!(instance = %instance, "agent stopped");
        Ok(())
    }
}

/// The gRPC name of the agent service, whose health the registry probes.
const AGENT_SERVICE_NAME: &str =
    <AgentServiceServer<AgentGrpc> as tonic::server::NamedService>::NAME;

/// How long one Register, Heartbeat or Deregister call to the registry may take: a registry
/// that hangs must not stall the heartbeat loop past the lease.
const REGISTRY_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an agent's server lets calls and streams still open at the end of a drain (after
/// `max_drain`) finish before it closes their connections.
const SERVER_GRACE_AFTER_DRAIN: Duration = Duration::from_secs(1);

/// What an instance registers: its spec, the lease TTL it asks for, and the join token that
/// proves its right to register (`authorization` metadata), if it uses one.
struct Enrollment {
    spec: InstanceSpec,
    lease_ttl: Duration,
    join_token: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

/// The relative jitter of registration and heartbeat retries: a nominal delay `d` becomes
/// one drawn from `[d/2, 3d/2]`.
const REGISTER_JITTER: f64 = 0.5;
/// The most an instance waits (a random share of it, at most a quarter of its heartbeat
/// period) before registering again when the registry no longer knows its lease.
const REREGISTER_SPREAD: Duration = Duration::from_millis(250);

/// Registers, then heartbeats every third of the granted lease until `stop`; registers
/// again (after a random share of [`REREGISTER_SPREAD`]) whenever the registry no longer
/// knows the lease, as after a restart. A failed registration is retried with jittered
/// doubling back-off (20 ms to 2 s), a failed heartbeat likewise (20 ms up to the period or
/// 1 s), so a registry back from an outage is found within about a second. `unit` draws the
/// jitter, uniform in `[-1, 1]` ([`reach_rpc::backoff::uniform_unit`]). Ends with `Err` (the registry's
/// status, logged) when the registry refuses the registration with INVALID_ARGUMENT or
/// FAILED_PRECONDITION: the spec itself is wrong, and retrying cannot help.
///
/// `registry` is any gRPC transport (a [`Channel`] in production, the registry service itself
/// in tests); `in_flight` reads the messages being handled now, reported in each heartbeat
/// (BUSY at `max_concurrency`), with the model load of `models` (BUSY while every model slot
/// is taken; a change into or out of that sends a heartbeat at once).
async fn keep_registered<T>(
    mut registry: RegistryServiceClient<T>,
    enrollment: Enrollment,
    (in_flight, max_concurrency, models): (impl Fn() -> u32, usize, ModelSlots),
    lease: Arc<tokio::sync::Mutex<Option<String>>>,
    stop: CancellationToken,
    mut unit: impl FnMut() -> f64 + Send,
) -> Result<(), Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: http_body::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let Enrollment {
        spec,
        lease_ttl,
        join_token,
    } = enrollment;
    let mut backoff = Backoff::doubling(Duration::from_millis(20), Duration::from_secs(2));
    'register: loop {
        let mut request = tonic::Request::new(RegisterRequest {
            instance: Some(spec.clone()),
            lease_ttl: Some(reach_rpc::time::proto_duration(lease_ttl)),
        });
        // The join token proves the right to register; heartbeats then authenticate with the
        // lease id the registration granted.
        if let Some(token) = &join_token {
            request
                .metadata_mut()
                .insert("authorization", token.clone());
        }
        let granted = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            result = registry.register(request) => result,
        };
        let response = match granted {
            Ok(response) => response.into_inner(),
            Err(status)
                if matches!(
                    status.code(),
                    Code::InvalidArgument
                        | Code::FailedPrecondition
                        | Code::PermissionDenied
                        | Code::Unauthenticated
                ) =>
            {
                error!(error = %status.message(), code = ?status.code(), "the registry refused the registration; not retrying: fix the agent's configuration");
                return Err(status);
            }
            Err(status) => {
                warn!(error = %status.message(), code = ?status.code(), "registration failed; retrying");
                let delay = backoff.next_delay_with_jitter(REGISTER_JITTER, unit());
                tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(delay) => {}
                }
                continue;
            }
        };
        backoff.reset();
        let granted_ttl = response
            .lease_ttl
            .as_ref()
            .and_then(reach_rpc::time::std_duration)
            .unwrap_or(lease_ttl);
        *lease.lock().await = Some(response.lease_id.clone());
        info!(lease_ttl = ?granted_ttl, "registered");
        let period = (granted_ttl / 3).max(Duration::from_millis(10));
        // A failed heartbeat is retried sooner than the next period, so that the instance
        // finds a restarted registry (which answers LEASE_NOT_FOUND) within about a second.
        let mut retry = Backoff::doubling(
            Duration::from_millis(20),
            period.min(Duration::from_secs(1)),
        );
        let mut wait = period;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                _ = tokio::time::sleep(wait) => {}
                () = models.changed() => {}
            }
            let in_flight = in_flight();
            let model_load = models.load();
            let state = if in_flight as usize >= max_concurrency || model_load.saturated() {
                InstanceState::Busy
            } else {
                InstanceState::Ready
            };
            let beat = HeartbeatRequest {
                instance_id: spec.instance_id.clone(),
                lease_id: response.lease_id.clone(),
                state: state as i32,
                in_flight,
                model_calls_in_flight: model_load.in_flight,
                model_slots_free: model_load.free,
            };
            match registry.heartbeat(beat).await {
                Ok(response) if response.get_ref().state() == InstanceState::Draining => {
                    // An operator drained this service: stop renewing (and do not register
                    // again when the lease goes); in-flight work still finishes.
                    warn!(
                        "the registry drained this instance; no longer taking new work through it"
                    );
                    return Ok(());
                }
                Ok(_) => {
                    retry.reset();
                    wait = period;
                }
                Err(status)
                    if reach_rpc::errors::reason_of(&status).as_deref()
                        == Some(reason::INSTANCE_DRAINED) =>
                {
                    warn!(
                        "the registry drained this instance; no longer taking new work through it"
                    );
                    return Ok(());
                }
                Err(status) if status.code() == Code::NotFound => {
                    // Every instance of a restarted registry learns this at about the same
                    // time: a random share of the spread keeps them from registering at once.
                    let spread = (period / 4).min(REREGISTER_SPREAD);
                    let delay = spread.mul_f64((1.0 + unit().clamp(-1.0, 1.0)) / 2.0);
                    warn!(after = ?delay, "registry lost the lease; registering again");
                    tokio::select! {
                        _ = stop.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(delay) => {}
                    }
                    continue 'register;
                }
                Err(status) => {
                    wait = retry
                        .next_delay_with_jitter(REGISTER_JITTER, unit())
                        .min(period);
                    warn!(error = %status.message(), retry_in = ?wait, "heartbeat failed");
                }
            }
        }
    }
}

/// State shared by the gRPC service and the runtime.
struct Shared {
    instance_id: Arc<str>,
    source: String,
    protocol_version: String,
    handlers: HashMap<String, Arc<dyn Handler>>,
    stream_handlers: HashMap<String, Arc<dyn StreamHandler>>,
    permits: Semaphore,
    /// The largest message taken or sent (bytes), per call on every RPC.
    max_message_bytes: usize,
    in_flight: AtomicU32,
    /// The model call slots, reported with each heartbeat and handed to every handler.
    model_slots: ModelSlots,
    idle: Notify,
    draining: AtomicBool,
    /// Cancelled when draining begins: multiplexed streams stop reading calls, answer what
    /// they read and end (see `reach_rpc::mux::serve`).
    closing: CancellationToken,
    dedupe: DedupeCache<Result<HandleResponse, Status>>,
    /// Who may call this agent (the routers, whose `x-reach-caller` is believed), when it
    /// serves TLS; `None` when it serves plaintext.
    direct_callers: Option<crate::callers::DirectCallers>,
}

/// The metadata key the router names a call's verified caller in.
const CALLER_METADATA: &str = "x-reach-caller";

impl Shared {
    /// The caller the router vouches for: `vouched` (the `x-reach-caller` value) when the
    /// connection's peer (`peer`, from the TLS handshake) is a router, else `None`.
    fn caller(
        &self,
        peer: &reach_trust::Caller,
        vouched: Option<&str>,
    ) -> Option<reach_trust::Identity> {
        if !self.direct_callers.as_ref()?.is_router(peer.identity()) {
            return None;
        }
        reach_trust::Identity::parse(vouched?).ok()
    }

    async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.in_flight.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }

    fn refuse_if_draining(&self) -> Result<(), Status> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(status_with_reason(
                Code::Unavailable,
                format!(
                    "instance {} is draining and takes no new work; send it elsewhere",
                    self.instance_id
                ),
                reason::INSTANCE_DRAINING,
                [("instance_id".to_string(), self.instance_id.to_string())],
            ));
        }
        Ok(())
    }

    fn context(
        &self,
        message: &ReachMessage,
        deadline: Option<Instant>,
        caller: Option<reach_trust::Identity>,
    ) -> HandlerContext {
        let header = message.header.clone().unwrap_or_default();
        let capability = match header.target {
            Some(header::Target::Capability(name)) => name,
            _ => String::new(),
        };
        HandlerContext {
            reply_to: header.reply_to,
            trace_id: header.trace_id,
            task_id: header.task_id,
            message_id: header.message_id,
            turn: header.turn,
            reply_metadata: ReplyMetadata::default(),
            model_slots: self.model_slots.clone(),
            capability,
            deadline,
            cancellation: CancellationToken::new(),
            instance_id: self.instance_id.clone(),
            caller,
        }
    }

    /// Picks the handler: by the addressed capability, else (service-addressed) by the payload
    /// type when it names a capability, else the only handler there is.
    fn pick<'a, T: ?Sized>(
        &self,
        handlers: &'a HashMap<String, Arc<T>>,
        message: &ReachMessage,
    ) -> Result<&'a Arc<T>, Status> {
        let header = message.header.as_ref();
        let wanted = match header.and_then(|h| h.target.as_ref()) {
            Some(header::Target::Capability(name)) => Some(name.as_str()),
            _ => message
                .payload
                .as_ref()
                .map(|p| p.r#type.as_str())
                .filter(|t| handlers.contains_key(*t)),
        };
        let found = match wanted {
            Some(name) => handlers.get(name),
            None if handlers.len() == 1 => handlers.values().next(),
            None => None,
        };
        found.ok_or_else(|| {
            let mut known: Vec<&str> = handlers.keys().map(String::as_str).collect();
            known.sort_unstable();
            status_with_reason(
                Code::Unimplemented,
                format!(
                    "instance {} has no handler for {}; it handles: {}",
                    self.instance_id,
                    wanted.map_or_else(
                        || "this message (address a capability)".to_string(),
                        |w| format!("capability {w:?}")
                    ),
                    known.join(", ")
                ),
                reason::CAPABILITY_NOT_HANDLED,
                [],
            )
        })
    }

    /// The reply envelope for `payload`, answering `request`, with the handler's reply
    /// header `metadata`.
    fn reply(
        &self,
        request_header: &Header,
        payload: Payload,
        metadata: HashMap<String, String>,
    ) -> ReachMessage {
        ReachMessage {
            header: Some(Header {
                message_id: trace::new_message_id(),
                trace_id: request_header.trace_id.clone(),
                task_id: request_header.task_id.clone(),
                source: self.source.clone(),
                protocol_version: self.protocol_version.clone(),
                created_at: Some(reach_rpc::time::now()),
                correlation_id: request_header.message_id.clone(),
                turn: request_header.turn.saturating_add(1),
                metadata,
                ..Header::default()
            }),
            payload: Some(payload),
        }
    }

    fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlightGuard {
            shared: self.clone(),
        }
    }
}

/// Counts one message in flight; the last one out wakes a waiting drain.
struct InFlightGuard {
    shared: Arc<Shared>,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.shared.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.shared.idle.notify_waiters();
        }
    }
}

fn read_deadline(
    request_metadata: &tonic::metadata::MetadataMap,
) -> Result<Option<Instant>, Status> {
    let timeout = deadline::grpc_timeout(request_metadata).map_err(Status::invalid_argument)?;
    Ok(timeout.map(|t| Instant::now() + t))
}

/// The `reach.v1.AgentService` face of the runtime.
struct AgentGrpc {
    shared: Arc<Shared>,
}

/// PAYLOAD_TOO_LARGE for a `what` (message or reply) of `size` bytes over `limit`.
fn too_large(what: &str, size: usize, limit: usize) -> Status {
    status_with_reason(
        Code::ResourceExhausted,
        format!(
            "the {what} is {size} bytes, over this agent's limit of {limit} bytes (max_message_bytes); send large content by url, or raise the limit"
        ),
        reason::PAYLOAD_TOO_LARGE,
        [
            ("size_bytes".to_string(), size.to_string()),
            ("limit_bytes".to_string(), limit.to_string()),
        ],
    )
}

/// A handler's error as the handler's own outcome: an error carrying a delivery reason
/// (ROUTE_NOT_FOUND, INSTANCE_DRAINING, OVERLOADED, INSTANCE_UNAVAILABLE) comes from a call
/// the handler made, which was not delivered, while this message was; passed on unchanged, the
/// router, the orchestrator and callers would read it as "this message was not delivered" and
/// send it again. It becomes FAILED_PRECONDITION without details, its message prefixed with
/// "a call this handler made failed: ". Other errors pass unchanged.
fn as_handler_outcome(status: Status) -> Status {
    match reach_rpc::errors::reason_of(&status).as_deref() {
        Some(
            reason::ROUTE_NOT_FOUND
            | reason::INSTANCE_DRAINING
            | reason::OVERLOADED
            | reason::INSTANCE_UNAVAILABLE,
        ) => Status::failed_precondition(format!(
            "a call this handler made failed: {}",
            status.message()
        )),
        _ => status,
    }
}

/// INTERNAL for a handler's reply whose data part `part` nests `depth` levels deep, over
/// [`reach_proto::json::MAX_DATA_DEPTH`]: the router could not decode it in the multiplexed
/// stream other calls share, so it is not sent.
fn too_deep_reply(part: usize, depth: usize) -> Status {
    Status::internal(format!(
        "the handler's reply part {part} nests {depth} levels deep, over the limit of {}; the reply was not sent: flatten it",
        reach_proto::json::MAX_DATA_DEPTH
    ))
}

/// INTERNAL for a handler that panicked (or whose task was cancelled): the caller gets a
/// generic message with an error id, and the agent's log has the detail under that id; what
/// the panic said (which may hold anything the handler had at hand) stays in the log.
fn handler_failed(join: &tokio::task::JoinError) -> Status {
    let error_id = uuid::Uuid::new_v4();
    error!(%error_id, error = %join, "handler failed");
    Status::internal(format!(
        "handler failed; error id {error_id}; see the agent's log"
    ))
}

/// Calls one multiplexed stream may have open at once (beyond the handler concurrency they
/// wait for a permit, as unary calls do).
const MAX_OPEN_CALLS_PER_STREAM: usize = 1024;

/// What remembering `outcome` in the dedupe memory costs, bytes: the reply's encoded size, or
/// the error's message and details, plus the id and bookkeeping.
fn remembered_bytes(outcome: &Result<HandleResponse, Status>) -> usize {
    const ENTRY_OVERHEAD_BYTES: usize = 256;
    ENTRY_OVERHEAD_BYTES
        + match outcome {
            Ok(response) => response.encoded_len(),
            Err(status) => status.message().len() + status.details().len(),
        }
}

/// Handles one message: dedupe slot, in-flight count, concurrency permit, the handler, the
/// reply envelope, the deadline. Shared by Handle and HandleMux; `span` is the message's span
/// (`agent.handle`), already parented.
///
/// `cancelled` is a multiplexed call's cancel (its caller gave up). When it fires, or the
/// deadline passes, the handler is told (its context's cancellation) and this returns only
/// once the handler has finished: the reply then acknowledges the cancel, so the caller (the
/// router) counts the call against this instance while its handler still runs. A unary
/// Handle (`None`) answers at the deadline at once (its caller resets the stream then).
async fn handle_message(
    shared: &Arc<Shared>,
    message: ReachMessage,
    deadline: Option<Instant>,
    cancelled: Option<CancellationToken>,
    span: tracing::Span,
    caller: Option<reach_trust::Identity>,
) -> Result<HandleResponse, Status> {
    span.record("instance", &*shared.instance_id);
    let size = message.encoded_len();
    if size > shared.max_message_bytes {
        let status = too_large("message", size, shared.max_message_bytes);
        reach_telemetry::record_status(&span, status.code(), status.message());
        return Err(status);
    }
    let handler = match shared.pick(&shared.handlers, &message) {
        Ok(handler) => handler.clone(),
        Err(status) => {
            reach_telemetry::record_status(&span, status.code(), status.message());
            return Err(status);
        }
    };
    let ctx = shared.context(&message, deadline, caller);
    let started = Instant::now();
    let capability = ctx.capability.clone();
    let _in_flight_metric = crate::metrics::in_flight(&capability);
    let message_id = ctx.message_id.clone();
    // Outcomes are remembered per caller: with trust on, the caller the router verified. A
    // message id is the caller's to choose (and the orchestrator's are derived from task ids),
    // so keyed by the id alone one principal could have its answer handed to another's
    // redelivery (an agent pre-answering a node of someone else's task).
    let dedupe_key = match &ctx.caller {
        Some(caller) if !message_id.is_empty() => format!("{caller}\u{0}{message_id}"),
        _ => message_id.clone(),
    };

    // Cancels the handler when this call goes away (caller cancelled, deadline passed).
    let cancel_on_drop = ctx.cancellation.clone().drop_guard();
    let caller_gone = ctx.cancellation.clone();
    let run_shared = shared.clone();
    let queue_capability = capability.clone();
    let run = async move {
        let shared = run_shared;
        // Counted in flight until the handler returns, even after the caller has gone:
        // a drain waits for it.
        let _in_flight = shared.enter();
        let slot = if message_id.is_empty() {
            Default::default()
        } else {
            shared.dedupe.slot(&dedupe_key)
        };
        // A message that never got a handler slot (its caller gave up while it waited, or
        // the instance shut down) was not handled: that is not remembered, so a redelivery
        // of the same message id runs it. Everything a handler returned is remembered.
        let outcome = slot
            .get_or_try_init(|| async {
                let _permit = match shared.permits.try_acquire() {
                    Ok(permit) => permit,
                    Err(tokio::sync::TryAcquireError::NoPermits) => {
                        // Every slot is busy: counted as waiting until one frees, or until
                        // the caller gives up (deadline, cancel, reset), which drops it.
                        let _waiting = crate::metrics::waiting(&queue_capability);
                        tokio::select! {
                            permit = shared.permits.acquire() => permit
                                .map_err(|_| Status::unavailable("instance is shutting down"))?,
                            () = caller_gone.cancelled() => return Err(Status::cancelled(
                                "the caller gave up while the message waited for a handler slot; it was not handled",
                            )),
                        }
                    }
                    Err(tokio::sync::TryAcquireError::Closed) => {
                        return Err(Status::unavailable("instance is shutting down"));
                    }
                };
                let outcome = async {
                    let request_header = message.header.clone().unwrap_or_default();
                    let reply_metadata = ctx.reply_metadata.clone();
                    let payload = handler
                        .handle(ctx, message)
                        .await
                        .map_err(as_handler_outcome)?;
                    if let Some((part, depth)) = payload.too_deep() {
                        return Err(too_deep_reply(part, depth));
                    }
                    let reply = shared.reply(&request_header, payload, reply_metadata.take());
                    let size = reply.encoded_len();
                    if size > shared.max_message_bytes {
                        return Err(too_large("reply", size, shared.max_message_bytes));
                    }
                    Ok(HandleResponse {
                        message: Some(reply),
                    })
                }
                .await;
                if !message_id.is_empty() {
                    shared
                        .dedupe
                        .charge(&dedupe_key, remembered_bytes(&outcome));
                }
                Ok(outcome)
            })
            .await;
        outcome.and_then(Clone::clone)
    }
    .instrument(span.clone());
    // The deduplicated run is its own task: when the caller goes away (a reset connection,
    // a passed deadline, a cancel frame) the handler is told through its cancellation token,
    // may still finish, and its outcome is remembered, so a redelivery of the same message id
    // gets that outcome instead of running it again. A panicking handler fails only its call.
    let mut task = tokio::spawn(run);
    let joined = |join: Result<Result<HandleResponse, Status>, tokio::task::JoinError>| {
        join.unwrap_or_else(|join| Err(handler_failed(&join)))
    };
    let settle = cancelled.is_some();
    let cancelled = async move {
        match cancelled {
            Some(token) => token.cancelled_owned().await,
            None => std::future::pending().await,
        }
    };
    let expired = async move {
        match deadline {
            Some(deadline) => tokio::time::sleep_until(deadline).await,
            None => std::future::pending().await,
        }
    };
    let result = tokio::select! {
        join = &mut task => Ok(joined(join)),
        () = expired => Err(status_with_reason(
            Code::DeadlineExceeded,
            "the caller's deadline passed before the handler finished",
            reason::DEADLINE_EXCEEDED,
            [],
        )),
        () = cancelled => Err(Status::cancelled(
            "the caller cancelled the call; the handler was told and has finished",
        )),
    };
    let result = match result {
        Ok(result) => result,
        Err(status) => {
            // The handler is told; a multiplexed call answers once it has finished.
            drop(cancel_on_drop);
            if settle {
                let _ = (&mut task).await;
            }
            Err(status)
        }
    };
    let code = result.as_ref().map_or_else(Status::code, |_| Code::Ok);
    let message = result.as_ref().err().map_or("", |s| s.message());
    reach_telemetry::record_status(&span, code, message);
    let elapsed = started.elapsed();
    span.in_scope(
        || debug!(code = ?code, elapsed_us = elapsed.as_micros() as u64, "message handled"),
    );
    crate::metrics::handler(&capability, code, elapsed);
    result
}

#[tonic::async_trait]
impl AgentService for AgentGrpc {
    async fn handle(
        &self,
        request: Request<HandleRequest>,
    ) -> Result<Response<HandleResponse>, Status> {
        self.shared.refuse_if_draining()?;
        let deadline = read_deadline(request.metadata())?;
        let caller = self.shared.caller(
            &reach_trust::Caller::of(request.extensions()),
            request
                .metadata()
                .get(CALLER_METADATA)
                .and_then(|v| v.to_str().ok()),
        );
        let message = request
            .into_inner()
            .message
            .ok_or_else(|| Status::invalid_argument("the request has no message"))?;
        let span = reach_telemetry::message_span("agent.handle", &message);
        handle_message(&self.shared, message, deadline, None, span, caller)
            .await
            .map(Response::new)
    }

    type HandleMuxStream = Pin<Box<dyn Stream<Item = Result<HandleMuxResponse, Status>> + Send>>;

    async fn handle_mux(
        &self,
        request: Request<Streaming<HandleMuxRequest>>,
    ) -> Result<Response<Self::HandleMuxStream>, Status> {
        self.shared.refuse_if_draining()?;
        let peer = reach_trust::Caller::of(request.extensions());
        let inbound = request
            .into_inner()
            .map(|item| item.map(|request| request.frame.unwrap_or_default()));
        let shared = self.shared.clone();
        // A cancel frame tells the handler and waits for it (see `handle_message`).
        let outcomes = mux::serve_with(
            inbound,
            move |call: mux::IncomingCall| {
                let shared = shared.clone();
                let caller = shared.caller(
                    &peer,
                    call.metadata.get(CALLER_METADATA).map(String::as_str),
                );
                async move {
                    shared.refuse_if_draining()?;
                    let parent = reach_telemetry::extract_map(&call.metadata);
                    let span = reach_telemetry::message_span_with_parent(
                        "agent.handle",
                        &call.message,
                        Some(parent),
                    );
                    let response = handle_message(
                        &shared,
                        call.message,
                        call.deadline,
                        Some(call.cancelled),
                        span,
                        caller,
                    )
                    .await?;
                    Ok(response.message.unwrap_or_default())
                }
            },
            MAX_OPEN_CALLS_PER_STREAM,
            self.shared.closing.clone(),
            mux::OnCancel::Tell,
        );
        let replies = outcomes.map(|item| {
            item.map(|(call_id, outcome)| HandleMuxResponse {
                frame: Some(mux::reply_frame(call_id, outcome)),
            })
        });
        Ok(Response::new(Box::pin(replies)))
    }

    type HandleStreamStream =
        Pin<Box<dyn Stream<Item = Result<HandleStreamResponse, Status>> + Send>>;

    async fn handle_stream(
        &self,
        request: Request<Streaming<HandleStreamRequest>>,
    ) -> Result<Response<Self::HandleStreamStream>, Status> {
        self.shared.refuse_if_draining()?;
        let deadline = read_deadline(request.metadata())?;
        let caller = self.shared.caller(
            &reach_trust::Caller::of(request.extensions()),
            request
                .metadata()
                .get(CALLER_METADATA)
                .and_then(|v| v.to_str().ok()),
        );
        let mut inbound = request.into_inner();
        let first = inbound
            .message()
            .await?
            .and_then(|m| m.message)
            .ok_or_else(|| {
                Status::invalid_argument("the stream closed before its first message")
            })?;
        let handler = self
            .shared
            .pick(&self.shared.stream_handlers, &first)?
            .clone();
        let ctx = self.shared.context(&first, deadline, caller);
        // Each reply answers the latest message the handler has read: the first, until it
        // reads another.
        let answering = Arc::new(std::sync::Mutex::new(
            first.header.clone().unwrap_or_default(),
        ));
        debug!(trace_id = %ctx.trace_id, capability = %ctx.capability, "stream opened");
        let read = answering.clone();
        let rest = inbound
            .map(move |item| {
                item.map(|m| {
                    let message = m.message.unwrap_or_default();
                    if let Some(header) = &message.header {
                        *read.lock().unwrap_or_else(|p| p.into_inner()) = header.clone();
                    }
                    message
                })
            })
            .boxed();
        let guard = self.shared.enter();
        let cancel_on_drop = ctx.cancellation.clone().drop_guard();
        let shared = self.shared.clone();
        let reply_metadata = ctx.reply_metadata.clone();
        let replies = handler.handle(ctx, first, rest).map(move |item| {
            // Keep the stream counted and its cancellation armed for as long as it lives.
            let _ = (&guard, &cancel_on_drop);
            item.map_err(as_handler_outcome).and_then(|payload| {
                if let Some((part, depth)) = payload.too_deep() {
                    return Err(too_deep_reply(part, depth));
                }
                let answering = answering.lock().unwrap_or_else(|p| p.into_inner());
                Ok(HandleStreamResponse {
                    message: Some(shared.reply(&answering, payload, reply_metadata.take())),
                })
            })
        });
        Ok(Response::new(Box::pin(replies)))
    }
}

#[cfg(test)]
mod tests {
    //! The registration loop against an in-memory registry service (no sockets), on tokio's
    //! paused clock: every figure below is exact.

    use std::sync::Mutex;

    use reach_proto::v1::registry_service_server::{RegistryService, RegistryServiceServer};
    use reach_proto::v1::{
        DeregisterResponse, HeartbeatResponse, ListInstancesRequest, ListInstancesResponse,
        RegisterResponse, WatchRequest, WatchResponse,
    };

    use super::*;

    /// What the fake registry answers next.
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Answer {
        Ok,
        Unavailable,
        Invalid,
        LeaseLost,
        Drained,
        DrainingState,
    }

    /// One call the fake registry saw: what, when (ms of paused time since the start), and for
    /// heartbeats the reported state and load.
    #[derive(Clone, PartialEq, Debug)]
    enum Seen {
        Register(u64),
        Heartbeat(u64, InstanceState, u32),
    }

    #[derive(Clone)]
    struct FakeRegistry {
        started: Instant,
        seen: Arc<Mutex<Vec<Seen>>>,
        /// Answers for the coming calls, in order; `Ok` once empty.
        answers: Arc<Mutex<std::collections::VecDeque<Answer>>>,
        granted_ttl: Duration,
    }

    impl FakeRegistry {
        fn new(answers: &[Answer]) -> Self {
            Self {
                started: Instant::now(),
                seen: Arc::default(),
                answers: Arc::new(Mutex::new(answers.iter().copied().collect())),
                granted_ttl: Duration::from_millis(300),
            }
        }

        fn at(&self) -> u64 {
            u64::try_from(self.started.elapsed().as_millis()).unwrap()
        }

        fn next(&self) -> Answer {
            self.answers
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or(Answer::Ok)
        }

        fn seen(&self) -> Vec<Seen> {
            self.seen.lock().unwrap().clone()
        }
    }

    #[tonic::async_trait]
    impl RegistryService for FakeRegistry {
        async fn register(
            &self,
            request: Request<RegisterRequest>,
        ) -> Result<Response<RegisterResponse>, Status> {
            self.seen.lock().unwrap().push(Seen::Register(self.at()));
            assert_eq!(
                request.get_ref().instance.as_ref().unwrap().instance_id,
                "a-1"
            );
            match self.next() {
                Answer::Unavailable => Err(Status::unavailable("registry starting")),
                Answer::Invalid => Err(Status::invalid_argument(
                    "invalid registration: instance.capabilities[0].version \"one\" is not semver",
                )),
                _ => Ok(Response::new(RegisterResponse {
                    lease_id: format!("lease-{}", self.seen().len()),
                    lease_ttl: Some(reach_rpc::time::proto_duration(self.granted_ttl)),
                    ..Default::default()
                })),
            }
        }

        async fn heartbeat(
            &self,
            request: Request<HeartbeatRequest>,
        ) -> Result<Response<HeartbeatResponse>, Status> {
            let beat = request.into_inner();
            self.seen.lock().unwrap().push(Seen::Heartbeat(
                self.at(),
                beat.state(),
                beat.in_flight,
            ));
            match self.next() {
                Answer::Ok => Ok(Response::new(HeartbeatResponse {
                    state: InstanceState::Ready as i32,
                    ..Default::default()
                })),
                Answer::DrainingState => Ok(Response::new(HeartbeatResponse {
                    state: InstanceState::Draining as i32,
                    ..Default::default()
                })),
                Answer::Unavailable | Answer::Invalid => Err(Status::unavailable("registry busy")),
                Answer::LeaseLost => Err(status_with_reason(
                    Code::NotFound,
                    "no live lease",
                    reason::LEASE_NOT_FOUND,
                    [],
                )),
                Answer::Drained => Err(status_with_reason(
                    Code::FailedPrecondition,
                    "drained by an operator",
                    reason::INSTANCE_DRAINED,
                    [],
                )),
            }
        }

        async fn deregister(
            &self,
            _: Request<DeregisterRequest>,
        ) -> Result<Response<DeregisterResponse>, Status> {
            Err(Status::unimplemented("not used by the loop"))
        }

        async fn list_instances(
            &self,
            _: Request<ListInstancesRequest>,
        ) -> Result<Response<ListInstancesResponse>, Status> {
            Err(Status::unimplemented("not used by the loop"))
        }

        type WatchStream = futures::stream::Empty<Result<WatchResponse, Status>>;

        async fn watch(
            &self,
            _: Request<WatchRequest>,
        ) -> Result<Response<Self::WatchStream>, Status> {
            Err(Status::unimplemented("not used by the loop"))
        }

        async fn list_capabilities(
            &self,
            _: Request<reach_proto::v1::ListCapabilitiesRequest>,
        ) -> Result<Response<reach_proto::v1::ListCapabilitiesResponse>, Status> {
            Err(Status::unimplemented("not used by the loop"))
        }
    }

    /// Runs the loop against `registry` for `run_for` of paused time with `in_flight` messages
    /// handled throughout (of at most 4); returns whether it had ended by itself.
    async fn run_loop(registry: &FakeRegistry, in_flight: u32, run_for: Duration) -> bool {
        let spec = InstanceSpec {
            service: "a".into(),
            instance_id: "a-1".into(),
            ..Default::default()
        };
        let stop = CancellationToken::new();
        let task = tokio::spawn(keep_registered(
            RegistryServiceClient::new(RegistryServiceServer::new(registry.clone())),
            Enrollment {
                spec,
                lease_ttl: Duration::from_secs(10),
                join_token: None,
            },
            (move || in_flight, 4, ModelSlots::default()),
            Arc::default(),
            stop.clone(),
            || 0.0,
        ));
        tokio::time::sleep(run_for).await;
        let ended = task.is_finished();
        stop.cancel();
        task.await.unwrap().unwrap();
        ended
    }

    #[tokio::test(start_paused = true)]
    async fn heartbeats_every_third_of_the_granted_lease_reporting_the_load() {
        let registry = FakeRegistry::new(&[]);
        assert!(!run_loop(&registry, 2, Duration::from_millis(350)).await);
        // The registry granted 300 ms (not the 10 s asked for): a beat every 100 ms.
        assert_eq!(
            registry.seen(),
            [
                Seen::Register(0),
                Seen::Heartbeat(100, InstanceState::Ready, 2),
                Seen::Heartbeat(200, InstanceState::Ready, 2),
                Seen::Heartbeat(300, InstanceState::Ready, 2),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_instance_at_its_limit_reports_busy() {
        let registry = FakeRegistry::new(&[]);
        run_loop(&registry, 4, Duration::from_millis(150)).await;
        assert_eq!(
            registry.seen()[1],
            Seen::Heartbeat(100, InstanceState::Busy, 4)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn full_model_slots_report_busy_at_once_and_free_ones_ready() {
        let registry = FakeRegistry::new(&[]);
        let spec = InstanceSpec {
            service: "a".into(),
            instance_id: "a-1".into(),
            ..Default::default()
        };
        let slots = ModelSlots::new(1);
        let stop = CancellationToken::new();
        let task = tokio::spawn(keep_registered(
            RegistryServiceClient::new(RegistryServiceServer::new(registry.clone())),
            Enrollment {
                spec,
                lease_ttl: Duration::from_secs(10),
                join_token: None,
            },
            (|| 1, 4, slots.clone()),
            Arc::default(),
            stop.clone(),
            || 0.0,
        ));
        tokio::time::sleep(Duration::from_millis(30)).await;
        // The only slot is taken at 30 ms: a heartbeat goes at once, not at 100 ms.
        let guard = slots.acquire().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(guard);
        tokio::time::sleep(Duration::from_millis(10)).await;
        stop.cancel();
        task.await.unwrap().unwrap();
        assert_eq!(
            registry.seen(),
            [
                Seen::Register(0),
                Seen::Heartbeat(30, InstanceState::Busy, 1),
                Seen::Heartbeat(40, InstanceState::Ready, 1),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_registration_is_retried_with_doubling_back_off() {
        use Answer::Unavailable as U;
        let registry = FakeRegistry::new(&[U, U, U, U]);
        run_loop(&registry, 0, Duration::from_millis(200)).await;
        // Each retry waits twice as long as the last: 20, 40, then 80 ms.
        assert_eq!(
            registry.seen(),
            [
                Seen::Register(0),
                Seen::Register(20),
                Seen::Register(60),
                Seen::Register(140),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_registration_refused_as_invalid_is_not_retried() {
        use Answer::{Invalid, Unavailable};
        let registry = FakeRegistry::new(&[Unavailable, Invalid]);
        let spec = InstanceSpec {
            service: "a".into(),
            instance_id: "a-1".into(),
            ..Default::default()
        };
        let ended = keep_registered(
            RegistryServiceClient::new(RegistryServiceServer::new(registry.clone())),
            Enrollment {
                spec,
                lease_ttl: Duration::from_secs(10),
                join_token: None,
            },
            (|| 0, 4, ModelSlots::default()),
            Arc::default(),
            CancellationToken::new(),
            || 0.0,
        )
        .await;
        let refusal = ended.unwrap_err();
        assert_eq!(refusal.code(), Code::InvalidArgument);
        assert!(refusal.message().contains("is not semver"), "{refusal}");
        // Unavailable is retried (after 20 ms); the refusal ends the loop.
        assert_eq!(registry.seen(), [Seen::Register(0), Seen::Register(20)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_lease_registers_again_and_the_back_off_starts_over() {
        use Answer::{LeaseLost, Ok, Unavailable};
        // Register fails once (20 ms back-off), then succeeds; the first beat finds the lease
        // lost; registering again succeeds at once.
        // Registering again waits a draw from the spread (a quarter of the 100 ms period:
        // the middle draw is 12.5 ms, which tokio's millisecond timer rounds up to 13), so that
        // a restarted registry's instances come apart.
        let registry = FakeRegistry::new(&[Unavailable, Ok, LeaseLost]);
        run_loop(&registry, 0, Duration::from_millis(240)).await;
        assert_eq!(
            registry.seen(),
            [
                Seen::Register(0),
                Seen::Register(20),
                Seen::Heartbeat(120, InstanceState::Ready, 0),
                Seen::Register(133),
                Seen::Heartbeat(233, InstanceState::Ready, 0),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_heartbeat_that_fails_otherwise_keeps_the_lease_and_is_retried_sooner() {
        use Answer::{Ok, Unavailable};
        let registry = FakeRegistry::new(&[Ok, Ok, Unavailable, Unavailable, Unavailable]);
        run_loop(&registry, 0, Duration::from_millis(400)).await;
        // Failed beats are retried after 20, 40, then 80 ms (the registry may be back, and
        // may have lost the lease), then the period resumes.
        assert_eq!(
            registry.seen(),
            [
                Seen::Register(0),
                Seen::Heartbeat(100, InstanceState::Ready, 0),
                Seen::Heartbeat(200, InstanceState::Ready, 0),
                Seen::Heartbeat(220, InstanceState::Ready, 0),
                Seen::Heartbeat(260, InstanceState::Ready, 0),
                Seen::Heartbeat(340, InstanceState::Ready, 0),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_drained_instance_stops_renewing_and_never_registers_again() {
        for answer in [Answer::Drained, Answer::DrainingState] {
            let registry = FakeRegistry::new(&[Answer::Ok, answer]);
            assert!(
                run_loop(&registry, 0, Duration::from_secs(5)).await,
                "{answer:?}: the loop ends by itself"
            );
            assert_eq!(
                registry.seen(),
                [
                    Seen::Register(0),
                    Seen::Heartbeat(100, InstanceState::Ready, 0)
                ],
                "{answer:?}"
            );
        }
    }
}
