//! `reach-orchestrator`: runs flows (YAML state machines) durably over the Reach mesh.
//!
//! # Layout
//! - [`flow`]: the flow model, YAML loader and validation with located errors.
//! - [`expr`]: CEL expressions over the task context (conditions and node inputs).
//! - [`failure`]: node failures, typed ([`failure::NodeError`]: a gRPC code and a message),
//!   and the gRPC code names they are stored under.
//! - [`event`]: task events and the state folded from them (event sourcing).
//! - [`store`]: the SQLite / PostgreSQL task store (group-committed appends, leases, timers,
//!   ledger, purge) and its error kinds.
//! - [`flows`]: the registry of applied flow versions, loaded from the store and a flows
//!   directory.
//! - [`engine`]: drives tasks node by node — [`engine::clock`], the pure decider
//!   [`engine::decide`] with one module per node kind, the driver, the router call, the
//!   commands and the background loops (timers, leases, purge, flows directory watch).
//! - [`service`]: the `reach.v1.OrchestratorService` gRPC implementation (masked views).
//! - [`http`]: admin routes (`GET /tasks/{id}`, `POST /tasks/{id}/retry`).
//! - [`internal`]: who may call the internal RPCs (`RecordMessages`: router replicas only).
//! - [`mask`]: masking of sensitive values in everything shown.
//! - [`json`]: JSON views — protobuf values as JSON, and a task as `GET /tasks/{id}` and the
//!   CLI's `--json` show it.
//! - [`metrics`]: the orchestrator's Prometheus metrics.
//! - [`page`]: the opaque page tokens of the paged lists.
//! - [`webhooks`]: task webhooks — the [`webhooks::WebhookRenderer`]s of their formats,
//!   validation and views.
//! - [`delivery`]: the loop that delivers each task's events to its webhooks from the log.
//! - [`egress`]: which addresses webhooks may reach (public ones, plus the allowed networks),
//!   checked when a webhook is made and after DNS on every connection.
//! - [`error`]: [`Error`] and its mapping to gRPC statuses with ErrorInfo reasons.
//! - [`config`]: the configuration, [`OrchestratorConfig`], and [`config::ConfigError`].
//!
//! # Running
//! ```no_run
//! # async fn run() -> Result<(), reach_orchestrator::Error> {
//! let config = reach_orchestrator::OrchestratorConfig::default();
//! let orchestrator = reach_orchestrator::Orchestrator::new(config).await?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
//! orchestrator.serve(listener, async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```

pub mod config;
pub mod delivery;
pub mod egress;
pub mod engine;
pub mod error;
pub mod event;
pub mod expr;
pub mod failure;
pub mod flow;
pub mod flows;
pub mod http;
pub mod internal;
pub mod json;
pub mod mask;
pub mod metrics;
pub mod page;
pub mod service;
pub mod store;
pub mod webhooks;

use std::future::Future;
use std::sync::Arc;

pub use config::OrchestratorConfig;
pub use engine::{Clock, Engine, EngineSettings};
pub use error::Error;
pub use service::OrchestratorApi;
pub use webhooks::{Rendered, WebhookRenderer};

use reach_proto::v1::orchestrator_service_server::OrchestratorServiceServer;

/// An orchestrator: store, flows, engine and API, ready to run in-process.
pub struct Orchestrator {
    config: OrchestratorConfig,
    engine: Engine,
    api: OrchestratorApi,
}

/// The background work of a started orchestrator; [`Running::shutdown`] stops it.
pub struct Running {
    engine: Engine,
    handles: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Stops without handing tasks over, as a crash would (other replicas take them once the
    /// leases expire). For failure drills and tests.
    pub fn abort(self) {
        self.engine.halt();
        for h in self.handles {
            h.abort();
        }
    }

    /// Stops the loops and, on PostgreSQL, hands this replica's tasks to the others.
    pub async fn shutdown(self) {
        self.engine.stop().await;
        for h in self.handles {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), h).await;
        }
    }
}

impl Orchestrator {
    /// Opens the store, loads stored flows and the flows directory.
    ///
    /// # Errors
    /// [`Error::Config`] for invalid settings (or a `flows_dir` that is not a directory),
    /// [`Error::Store`] when the store cannot be opened.
    pub async fn new(config: OrchestratorConfig) -> Result<Self, Error> {
        Self::with_clock(config, Clock::new()).await
    }

    /// Like [`Orchestrator::new`] with an explicit clock (tests with paused time).
    ///
    /// # Errors
    /// As [`Orchestrator::new`].
    pub async fn with_clock(config: OrchestratorConfig, clock: Clock) -> Result<Self, Error> {
        Self::with_clock_and_trust(config, clock, reach_trust::Trust::disabled()).await
    }

    /// [`Orchestrator::new`] authorizing with `trust`: each task records its starter, and
    /// starting, viewing, resuming, cancelling and retrying tasks, applying flows and task
    /// webhooks (reading them as viewing, creating and deleting them as cancelling) are
    /// checked with [`reach_trust::Trust::check_task`] (ListTasks shows only the tasks the
    /// caller may view); the admin routes need an operator; the channel to the router
    /// presents `trust`'s certificate.
    ///
    /// # Errors
    /// As [`Orchestrator::new`].
    pub async fn with_trust(
        config: OrchestratorConfig,
        trust: Arc<reach_trust::Trust>,
    ) -> Result<Self, Error> {
        Self::with_clock_and_trust(config, Clock::new(), trust).await
    }

    /// [`Orchestrator::with_trust`] with an explicit clock.
    ///
    /// # Errors
    /// As [`Orchestrator::new`].
    pub async fn with_clock_and_trust(
        config: OrchestratorConfig,
        clock: Clock,
        trust: Arc<reach_trust::Trust>,
    ) -> Result<Self, Error> {
        config.validate()?;
        let durability = if config.sqlite_full_sync {
            store::SqliteDurability::Full
        } else {
            store::SqliteDurability::Normal
        };
        let store =
            store::Store::open_with(&config.store_url, durability, config.store_acquire_timeout)
                .await?;
        let flows = flows::FlowRegistry::load(store.clone(), config.expressions).await?;
        if let Some(dir) = &config.flows_dir {
            if !dir.is_dir() {
                return Err(
                    config::ConfigError::FlowsDirNotADirectory { path: dir.clone() }.into(),
                );
            }
            flows.apply_dir(dir, clock.now_ms()).await;
        }
        let settings = EngineSettings {
            node_id: config
                .node_id
                .clone()
                .unwrap_or_else(|| format!("orchestrator-{}", uuid::Uuid::new_v4().simple())),
            lease: config.lease,
            default_call_timeout: config.default_call_timeout,
            max_concurrent_tasks: config.max_concurrent_tasks,
            poll_interval: config.poll_interval,
            context_ttl: config.context_ttl,
            max_node_visits: config.max_node_visits,
            max_concurrent_evaluations: config.max_concurrent_evaluations,
            max_evaluations_per_flow: config.max_evaluations_per_flow,
            source: "orchestrator".into(),
        };
        let engine = Engine::new(
            store,
            flows,
            &config.router_endpoint,
            settings,
            clock,
            trust.tls(),
        )?;
        let masker = config.masker()?;
        let api = OrchestratorApi::new(engine.clone(), masker)
            .with_trust(trust)
            .with_watch_limit(config.max_watches_per_caller)
            .with_egress(egress::EgressPolicy::new(
                config.webhook_allowed_networks.clone(),
            ));
        Ok(Self {
            config,
            engine,
            api,
        })
    }

    /// Registers `renderer` for the webhook format it names (replacing one of the same
    /// name; `reach` is built in), so CreateTaskWebhook accepts that format and the delivery
    /// loop renders it. Call before [`Orchestrator::start`] / [`Orchestrator::serve`] and
    /// before taking [`Orchestrator::grpc_service`]: services taken earlier keep the formats
    /// they had.
    #[must_use]
    pub fn with_webhook_renderer(mut self, renderer: Arc<dyn WebhookRenderer>) -> Self {
        self.api = self.api.with_webhook_renderer(renderer);
        self
    }

    /// The engine (start tasks, resume, cancel, retry in-process).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The gRPC service, to add to a shared [`reach_rpc::GrpcServer`] (as `reach dev` does).
    pub fn grpc_service(&self) -> OrchestratorServiceServer<OrchestratorApi> {
        OrchestratorServiceServer::new(self.api.clone())
    }

    /// The API implementation.
    pub fn api(&self) -> &OrchestratorApi {
        &self.api
    }

    /// The HTTP admin routes (`GET /tasks/{id}`, `POST /tasks/{id}/retry`).
    pub fn admin_router(&self) -> axum::Router {
        http::router(self.api.clone())
    }

    /// Starts the engine's background work (resuming unfinished tasks, timers, leases,
    /// purge, flows directory watch, webhook delivery). Use with
    /// [`Orchestrator::grpc_service`] when the gRPC server is shared; [`Orchestrator::serve`]
    /// does both.
    ///
    /// # Errors
    /// [`Error::Config`] when the flows directory cannot be watched or the webhook HTTP
    /// client cannot be made.
    pub fn start(&self) -> Result<Running, Error> {
        let mut handles = self.engine.start();
        handles.push(delivery::spawn(
            self.api.clone(),
            delivery::WebhookSettings {
                owner: self.engine.node_id().to_string(),
                interval: self.config.webhook_interval,
                backoff: self.config.webhook_backoff,
                backoff_max: self.config.webhook_backoff_max,
            },
        )?);
        if let (Some(dir), true) = (&self.config.flows_dir, self.config.watch_flows) {
            handles.push(self.engine.watch_flows_dir(dir.clone())?);
        }
        Ok(Running {
            engine: self.engine.clone(),
            handles,
        })
    }

    /// Serves `OrchestratorService` (with health and reflection) on `listener` until
    /// `shutdown` resolves, running the engine meanwhile.
    ///
    /// # Errors
    /// [`Error::Serve`] when serving fails; [`Error::Config`] as [`Orchestrator::start`].
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), Error> {
        let running = self.start()?;
        let result = reach_rpc::GrpcServer::new()
            .with_trust(self.api.trust().clone())
            .add_service(self.grpc_service())
            .serve(listener, shutdown)
            .await;
        running.shutdown().await;
        self.engine.store().close().await;
        result.map_err(Error::from)
    }
}
