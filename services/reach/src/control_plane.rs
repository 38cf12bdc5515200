//! The control plane: registry and router served together on one gRPC listener (as in
//! `reach dev`), or either alone (`reach registry`, `reach router`).

use std::net::SocketAddr;

use reach_registry::{Backend, RegistryGrpc};
use reach_router::Router;
use reach_rpc::GrpcServer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::ReachConfig;

/// Which services a control plane runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Services {
    /// Run the registry.
    pub registry: bool,
    /// Run the router. With the registry alongside, the router watches it over loopback.
    pub router: bool,
    /// Run the orchestrator. With the router alongside, task nodes call it over loopback.
    pub orchestrator: bool,
    /// Serve the A2A edge's gRPC service (`lf.a2a.v1.A2AService`) on this listener, calling
    /// the registry, router and orchestrator served alongside over loopback.
    pub edge: bool,
}

impl Services {
    /// Registry, router and orchestrator together, as `reach dev` runs them.
    pub const ALL: Services = Services {
        registry: true,
        router: true,
        orchestrator: true,
        edge: true,
    };
    /// Registry and router only (the mesh without flows).
    pub const MESH: Services = Services {
        registry: true,
        router: true,
        orchestrator: false,
        edge: false,
    };
}

/// Why the control plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The registry could not be made from its settings, or its etcd could not be used.
    #[error("{}", registry_message(.0))]
    Registry(#[from] reach_registry::InitError),
    /// The router could not be made from its settings.
    #[error("invalid configuration: {0}")]
    Router(#[from] reach_router::StartError),
    /// The orchestrator could not start (store, flows).
    #[error("orchestrator: {0}")]
    Orchestrator(#[from] reach_orchestrator::Error),
    /// The listener could not be used.
    #[error("cannot use the listener: {0}")]
    Io(#[from] std::io::Error),
    /// The trust settings did not load, or forbid this listener.
    #[error("{0}")]
    Trust(#[from] reach_trust::TrustError),
}

/// An [`InitError`](reach_registry::InitError) as `reach` prints it: a bad setting is an
/// invalid configuration; an etcd that cannot be used says so itself.
fn registry_message(error: &reach_registry::InitError) -> String {
    if registry_misconfigured(error) {
        format!("invalid configuration: {error}")
    } else {
        format!("registry: {error}")
    }
}

/// Whether the registry could not start for its settings (exit 64) rather than for an etcd
/// that does not answer or refuses it (exit 1).
fn registry_misconfigured(error: &reach_registry::InitError) -> bool {
    use reach_registry::InitError;
    match error {
        // A setting out of range, or a file it names (the etcd TLS files) unusable.
        InitError::Config(_) | InitError::ProtocolRegistry(_) => true,
        // `backend = "etcd"` in a build without it: the setting cannot work here.
        InitError::EtcdNotBuilt => true,
        InitError::Etcd(_) => false,
    }
}

impl StartError {
    /// Whether the settings are at fault (what `reach` exits 64, EX_USAGE, for), not the
    /// world: a registry or router setting that cannot work, or a file a setting names that
    /// cannot be used. An etcd that does not answer, an orchestrator store, a listener or the
    /// trust files are not (exit 1).
    pub fn is_configuration(&self) -> bool {
        match self {
            Self::Registry(error) => registry_misconfigured(error),
            Self::Router(_) => true,
            Self::Orchestrator(_) | Self::Io(_) | Self::Trust(_) => false,
        }
    }
}

/// A running control plane.
pub struct ControlPlane {
    addr: SocketAddr,
    registry: Option<Backend>,
    router: Option<Router>,
    orchestrator: Option<(
        reach_orchestrator::Orchestrator,
        reach_orchestrator::Running,
    )>,
    edge: Option<reach_edge::a2a::A2aEdge>,
    mcp_edge: Option<reach_edge::mcp::McpEdge>,
    shutdown: CancellationToken,
    serve: JoinHandle<Result<(), reach_rpc::server::ServeError>>,
    /// The gRPC server's health as one flag ([`GrpcServer::readiness`]), for the admin
    /// port's `/ready`.
    readiness: tokio::sync::watch::Receiver<bool>,
    background: Vec<JoinHandle<()>>,
    trust: std::sync::Arc<reach_trust::Trust>,
}

impl ControlPlane {
    /// Starts the chosen services on `listener`, with the trust settings of `config` (loaded
    /// here; see [`ControlPlane::start_with_trust`]).
    ///
    /// # Errors
    /// [`StartError`] for invalid settings or an unusable listener.
    pub async fn start(
        listener: TcpListener,
        config: &ReachConfig,
        services: Services,
    ) -> Result<Self, StartError> {
        let trust = reach_trust::Trust::load(&config.trust)?;
        Self::start_with_trust(listener, config, services, trust).await
    }

    /// Starts the chosen services on `listener` with `trust`: TLS and authenticated callers
    /// when it has certificates or token keys, and its policy applied by each service.
    ///
    /// # Errors
    /// [`StartError`] for invalid settings or an unusable listener, including a non-loopback
    /// listener without TLS unless `trust.insecure` is set.
    pub async fn start_with_trust(
        listener: TcpListener,
        config: &ReachConfig,
        services: Services,
        trust: std::sync::Arc<reach_trust::Trust>,
    ) -> Result<Self, StartError> {
        let addr = listener.local_addr()?;
        trust.check_listener(addr)?;
        let mut server = GrpcServer::new()
            .with_limits(config.server)
            .with_trust(trust.clone());
        let mut background = Vec::new();
        let registry = if services.registry {
            let registry = Backend::start(config.registry.clone(), trust.tls().cloned()).await?;
            background.push(tokio::spawn(registry.view().clone().run_sweeper()));
            server = server
                .add_service(reach_telemetry::traced(
                    RegistryGrpc::with_backend(registry.clone())
                        .with_trust(trust.clone())
                        .into_server(),
                ))
                // With etcd: NOT_SERVING while etcd does not answer (routers keep their view).
                .serving_while(
                    reach_proto::v1::registry_service_server::SERVICE_NAME,
                    registry.serving(),
                );
            Some(registry)
        } else {
            None
        };
        let router = if services.router {
            let mut router_config = config.router.clone();
            if services.registry {
                router_config.registry_endpoint = format!("http://{addr}");
            }
            if services.orchestrator && router_config.ledger_endpoint.is_empty() {
                // The co-located orchestrator keeps the message ledger (`reach dump`).
                router_config.ledger_endpoint = format!("http://{addr}");
            }
            if router_config.advertise_endpoint.is_empty() && !addr.ip().is_unspecified() {
                // Asynchronous replies name this replica; a wildcard listener needs an explicit
                // router.advertise_endpoint.
                router_config.advertise_endpoint = format!("http://{addr}");
            }
            let router = Router::with_trust(router_config, trust.clone())?;
            background.push(router.spawn_registry_watch());
            server = router.add_to(server);
            // Ready (for readiness probes) once the first registry snapshot is applied: before
            // that every call would be ROUTE_NOT_FOUND.
            let table = router.table().clone();
            let name = reach_proto::v1::router_service_server::SERVICE_NAME;
            server = server.ready_when(name, async move {
                table.wait_synced().await;
            });
            Some(router)
        } else {
            None
        };
        let orchestrator = if services.orchestrator {
            let mut orchestrator_config = config.orchestrator.clone();
            if services.router {
                orchestrator_config.router_endpoint = format!("http://{addr}");
            }
            // A2A push notifications are webhooks of the `a2a` format.
            let orchestrator =
                reach_orchestrator::Orchestrator::with_trust(orchestrator_config, trust.clone())
                    .await?
                    .with_webhook_renderer(std::sync::Arc::new(A2aPushRenderer));
            let running = orchestrator.start()?;
            server = server.add_service(reach_telemetry::traced(orchestrator.grpc_service()));
            Some((orchestrator, running))
        } else {
            None
        };
        let mut mcp_edge = None;
        let edge = if services.edge {
            let (edge, mcp) = edges(addr, config, services, &trust)?;
            mcp_edge = mcp;
            server = server
                .add_service(reach_telemetry::traced(
                    reach_edge::a2a::A2aGrpc::new(edge.clone()).into_server(),
                ))
                .add_file_descriptor_set(reach_edge::a2a::proto::FILE_DESCRIPTOR_SET);
            Some(edge)
        } else {
            None
        };
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        let readiness = server.readiness();
        let serve = tokio::spawn(server.serve(listener, async move { stop.cancelled().await }));
        info!(
            %addr,
            registry = services.registry,
            router = services.router,
            orchestrator = services.orchestrator,
            "control plane serving"
        );
        Ok(Self {
            addr,
            registry,
            router,
            orchestrator,
            edge,
            mcp_edge,
            shutdown,
            serve,
            readiness,
            background,
            trust,
        })
    }

    /// The A2A edge, when this control plane serves it (its JSON-RPC routes go on an HTTP
    /// listener: [`reach_edge::a2a::jsonrpc::routes`]).
    pub fn a2a_edge(&self) -> Option<&reach_edge::a2a::A2aEdge> {
        self.edge.as_ref()
    }

    /// The MCP edge, when this control plane serves the edges and `edge.mcp.enabled` (its
    /// routes go on the edge's HTTP listener: [`reach_edge::mcp::http::routes`]).
    pub fn mcp_edge(&self) -> Option<&reach_edge::mcp::McpEdge> {
        self.mcp_edge.as_ref()
    }

    /// The trust this control plane serves with.
    pub fn trust(&self) -> &std::sync::Arc<reach_trust::Trust> {
        &self.trust
    }

    /// The gRPC address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The gRPC endpoint URL (`http://127.0.0.1:7070`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// True while the gRPC health says SERVING for the server and each of its services (see
    /// [`GrpcServer::readiness`]): false while the registry's etcd does not answer, before
    /// the router's first registry snapshot, and once shutdown begins.
    pub fn readiness(&self) -> tokio::sync::watch::Receiver<bool> {
        self.readiness.clone()
    }

    /// The registry, when this control plane runs one.
    pub fn registry(&self) -> Option<&Backend> {
        self.registry.as_ref()
    }

    /// The router, when this control plane runs one.
    pub fn router(&self) -> Option<&Router> {
        self.router.as_ref()
    }

    /// Waits until this control plane's router can route to at least `n` instances, at most
    /// `within`; `false` when the time ran out first (or it runs no router).
    pub async fn wait_routable(&self, n: usize, within: std::time::Duration) -> bool {
        let Some(router) = &self.router else {
            return false;
        };
        let table = router.table();
        tokio::time::timeout(within, async {
            while table.instances().len() < n {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await
        .is_ok()
    }

    /// The orchestrator, when this control plane runs one.
    pub fn orchestrator(&self) -> Option<&reach_orchestrator::Orchestrator> {
        self.orchestrator.as_ref().map(|(o, _)| o)
    }

    /// A token that stops serving when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Waits until serving stops (after [`ControlPlane::shutdown_token`] is cancelled).
    ///
    /// # Errors
    /// The server's failure, if it failed.
    pub async fn wait(self) -> Result<(), reach_rpc::server::ServeError> {
        // Long-lived streams (registry watches, CallMux) end when shutdown begins, so they do
        // not hold the server's graceful shutdown up.
        let (registry, router) = (self.registry.clone(), self.router.clone());
        let token = self.shutdown.clone();
        // The router stops following the registry first, so it does not mistake the
        // registry's shutdown for an outage (and log that it reconnects).
        let background: Vec<_> = self.background.iter().map(|t| t.abort_handle()).collect();
        tokio::spawn(async move {
            token.cancelled().await;
            for task in background {
                task.abort();
            }
            if let Some(registry) = registry {
                registry.close().await;
            }
            if let Some(router) = router {
                router.close_streams();
            }
        });
        let result = self.serve.await.unwrap_or(Ok(()));
        for task in self.background {
            task.abort();
        }
        if let Some((orchestrator, running)) = self.orchestrator {
            running.shutdown().await;
            orchestrator.engine().store().close().await;
        }
        result
    }

    /// Stops serving, waiting for in-flight calls.
    ///
    /// # Errors
    /// The server's failure, if it failed.
    pub async fn shutdown(self) -> Result<(), reach_rpc::server::ServeError> {
        // Stop following the registry first, so the router does not mistake the shutdown
        // for an outage and try to reconnect.
        for task in &self.background {
            task.abort();
        }
        self.shutdown.cancel();
        if let Some(registry) = &self.registry {
            registry.close().await;
        }
        if let Some(router) = &self.router {
            router.close_streams();
        }
        self.wait().await
    }
}

/// The edges of a control plane on `addr` (A2A, and MCP unless `edge.mcp.enabled` is off):
/// the registry, router and orchestrator they call
/// are the ones served on `addr` when `services` runs them, else `config.edge`'s endpoints
/// (over TLS when `trust` has certificates). Its cards advertise `config.edge.public_url`
/// (set by `reach dev` and `reach edge` to their edge HTTP listener) and the gRPC target
/// `addr`, unless `config.edge.public_grpc` names another.
fn edges(
    addr: SocketAddr,
    config: &ReachConfig,
    services: Services,
    trust: &std::sync::Arc<reach_trust::Trust>,
) -> Result<(reach_edge::a2a::A2aEdge, Option<reach_edge::mcp::McpEdge>), StartError> {
    let scheme = if trust.tls().is_some() {
        "https"
    } else {
        "http"
    };
    let local = format!("{scheme}://{addr}");
    // Requests of callers with a bearer token go on channels without the edge's certificate,
    // trusting the same CA, so the mesh judges the caller by its token.
    let anonymous = match trust.tls() {
        Some(tls) => Some(
            reach_trust::tls::TlsSource::load(
                &reach_trust::tls::TlsConfig {
                    cert: None,
                    key: None,
                    ..tls.config().clone()
                },
                trust.trust_domain(),
            )
            .map_err(reach_trust::TrustError::from)?,
        ),
        None => None,
    };
    let channel = |alongside: bool,
                   configured: &str,
                   tls: Option<&std::sync::Arc<reach_trust::tls::TlsSource>>| {
        let url = if alongside {
            local.as_str()
        } else {
            configured
        };
        reach_rpc::http2::endpoint(url.to_string())
            .map(|endpoint| reach_rpc::http2::channel_lazy(&endpoint, tls, None))
            .map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("edge endpoint {url:?}: {e}"),
                )
            })
    };
    let edge_config = config.edge.clone();
    let (router_url, orchestrator_url) = (
        edge_config.router_endpoint.as_str(),
        edge_config.orchestrator_endpoint.as_str(),
    );
    let registry = channel(
        services.registry,
        &edge_config.registry_endpoint,
        trust.tls(),
    )?;
    let router = channel(services.router, router_url, trust.tls())?;
    let orchestrator = channel(services.orchestrator, orchestrator_url, trust.tls())?;
    let as_caller = match &anonymous {
        Some(tls) => Some((
            channel(services.router, router_url, Some(tls))?,
            channel(services.orchestrator, orchestrator_url, Some(tls))?,
        )),
        None => None,
    };
    let interfaces = reach_edge::a2a::card::Interfaces {
        json_rpc: edge_config.public_url.trim_end_matches('/').to_string(),
        grpc: if edge_config.public_grpc.is_empty() {
            addr.to_string()
        } else {
            edge_config.public_grpc.clone()
        },
    };
    let security = reach_edge::a2a::card::Security {
        bearer: trust.config().jwt.is_some(),
        tls: trust.tls().is_some(),
    };
    let mcp = edge_config.mcp.enabled.then(|| {
        reach_edge::mcp::McpEdge::new(
            edge_config.mcp.clone(),
            reach_edge::mcp::McpLimits {
                call_timeout: edge_config.call_timeout,
                max_message_bytes: edge_config.max_message_bytes,
            },
            reach_edge::mcp::McpChannels {
                registry: registry.clone(),
                router: router.clone(),
                as_caller: as_caller.as_ref().map(|(router, _)| router.clone()),
            },
            trust.clone(),
        )
    });
    let a2a = reach_edge::a2a::A2aEdge::new(
        edge_config,
        interfaces,
        security,
        reach_edge::a2a::MeshChannels {
            registry,
            router,
            orchestrator,
            as_caller,
        },
    );
    Ok((a2a, mcp))
}

/// Renders task webhooks of the `a2a` format: the A2A edge's push notifications
/// ([`reach_edge::a2a::mapping::push_notifications`]), delivered by the orchestrator.
struct A2aPushRenderer;

impl reach_orchestrator::WebhookRenderer for A2aPushRenderer {
    fn format(&self) -> &'static str {
        reach_edge::a2a::edge::PUSH_FORMAT
    }

    fn render(
        &self,
        task: &reach_proto::v1::Task,
        events: &[reach_proto::v1::TaskEvent],
    ) -> Vec<reach_orchestrator::Rendered> {
        reach_edge::a2a::mapping::push_notifications(task, events)
            .into_iter()
            .map(|(sequence, body)| reach_orchestrator::Rendered { sequence, body })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use reach_registry::{ConfigError, InitError};

    use super::StartError;

    #[test]
    fn a_registry_that_cannot_start_for_its_settings_is_a_configuration_error() {
        let bad_file = StartError::Registry(InitError::Config(ConfigError::Etcd(
            "registry.etcd.tls.ca: cannot use /etc/etcd/ca.pem: I/O error".into(),
        )));
        assert!(bad_file.is_configuration());
        assert!(
            bad_file
                .to_string()
                .starts_with("invalid configuration: registry.etcd.tls.ca"),
            "{bad_file}"
        );
        assert!(StartError::Registry(InitError::EtcdNotBuilt).is_configuration());
        let unreachable = StartError::Registry(InitError::Etcd(
            "cannot use etcd at http://127.0.0.1:2379: connection refused".into(),
        ));
        assert!(
            !unreachable.is_configuration(),
            "etcd down is not a setting"
        );
        assert!(
            unreachable
                .to_string()
                .starts_with("registry: cannot use etcd")
        );
    }
}
