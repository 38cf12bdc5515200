//! Reach's web console: server-rendered pages for the people who review tasks and watch a
//! mesh at work — the human-review inbox, task timelines, flow graphs and the mesh at a
//! glance (`docs/console.md`). Pages are HTML rendered with maud (every value escaped), a
//! stylesheet and a little vanilla JavaScript served from the binary: no build step, no CDN.
//!
//! The console is a client of the orchestrator's and registry's gRPC APIs, never of their
//! internals, so the same code serves in-process (`reach dev`, `reach orchestrator`, on their
//! admin port) and against any endpoint (`reach console --orchestrator URL --registry URL`).
//! [`Console::routes`] gives the routes under [`BASE`].
//!
//! # Layout
//! - [`auth`]: the login with a bearer token once trust is on, forwarded on every call.
//! - [`error`]: [`ConsoleError`], what a page could not do, as an HTML page with its status.
//! - [`flows`]: the flow list and a flow's page (its graph with tasks and failures per node).
//! - [`graph`]: a flow's nodes and transitions from its YAML, laid out in layers as SVG.
//! - [`guard`]: the Host and Origin checks (DNS rebinding, cross-site form posts).
//! - [`inbox`]: tasks waiting for a person, the review form, resume and cancel.
//! - [`layout`]: the page shell, navigation, the stylesheet and script (live updates).
//! - [`mesh`]: instances by capability, capabilities with schemas, dead letters with retry.
//! - [`render`]: small renderers shared by the pages (times, durations, JSON, statuses).
//! - [`schema_form`]: a human node's JSON Schema as form fields, the posted form as JSON,
//!   and the API's JSON pointers mapped back to fields.
//! - [`session`]: the bearer token of the request being served, from the login cookie.
//! - [`task`]: a task's status, node path, node inputs and outputs, and ledger timeline.

pub mod auth;
pub mod error;
pub mod flows;
pub mod graph;
pub mod guard;
pub mod inbox;
pub mod layout;
pub mod mesh;
pub mod render;
pub mod schema_form;
pub mod session;
pub mod task;

use std::sync::Arc;

use axum::Router;
use axum::response::Redirect;
use axum::routing::{get, post};
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use tonic::transport::Channel;

pub use error::ConsoleError;

/// The path every console route is served under (`/console/inbox`, ...).
pub const BASE: &str = "/console";

/// The largest form body accepted, in bytes (a review form's fields together).
pub const MAX_FORM_BYTES: usize = 64 * 1024;

/// How long the console waits for one call of the orchestrator or registry.
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What the console calls: the orchestrator (inbox, tasks, flows, dead letters) and the
/// registry (mesh page). A page whose service is absent says so instead of failing.
#[derive(Debug, Clone, Default)]
pub struct ConsoleChannels {
    /// The orchestrator's gRPC channel.
    pub orchestrator: Option<Channel>,
    /// The registry's gRPC channel.
    pub registry: Option<Channel>,
    /// Each instance's latency as a router in this process measures it, by instance id
    /// (the mesh page's latency column); `None` where no router runs alongside the console
    /// (`reach console` against a remote mesh), and the column says so.
    pub latency: Option<LatencySource>,
}

/// Each instance's latency by its id, as a router measures it (the decayed peak-EWMA
/// estimate its p2c balancer weighs, after linkerd's); `None` for an instance it has not
/// measured yet. Cheap to clone.
#[derive(Clone)]
pub struct LatencySource(Arc<LatencyOf>);

/// The function behind a [`LatencySource`]: instance id → latency.
type LatencyOf = dyn Fn(&str) -> Option<std::time::Duration> + Send + Sync;

impl LatencySource {
    /// The latencies `of` gives (instance id → latency).
    pub fn new(of: impl Fn(&str) -> Option<std::time::Duration> + Send + Sync + 'static) -> Self {
        Self(Arc::new(of))
    }

    /// The latency of instance `instance_id`, if measured.
    pub fn of(&self, instance_id: &str) -> Option<std::time::Duration> {
        (self.0)(instance_id)
    }
}

impl std::fmt::Debug for LatencySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LatencySource")
    }
}

/// The console's settings.
#[derive(Debug, Clone, Default)]
pub struct ConsoleConfig {
    /// Host names (`host` or `host:port`, lower case) requests may name besides loopback
    /// ([`reach_rpc::hosts::LOOPBACK_HOSTS`]); empty serves loopback names only.
    pub allowed_hosts: Vec<String>,
    /// A URL template for trace ids on the task page, `{trace_id}` replaced (for example
    /// `http://localhost:16686/trace/{trace_id}`); empty shows the id without a link.
    pub trace_url: String,
    /// How often pages refresh their live part, in milliseconds; 0 turns live updates off.
    pub refresh_ms: u64,
    /// Whether a person must log in with a bearer token ([`auth`]), which every call then
    /// carries; without it the console calls the mesh without credentials.
    pub login: bool,
}

/// The console: cheap to clone, one per process.
#[derive(Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

struct Inner {
    orchestrator: Option<OrchestratorServiceClient<Channel>>,
    registry: Option<RegistryServiceClient<Channel>>,
    latency: Option<LatencySource>,
    config: ConsoleConfig,
    guard: guard::Guard,
}

/// The default refresh interval of live pages, in milliseconds.
pub const DEFAULT_REFRESH_MS: u64 = 2000;

impl Console {
    /// A console calling `channels`, with `config`.
    pub fn new(channels: ConsoleChannels, config: ConsoleConfig) -> Self {
        let guard = guard::Guard::new(&config.allowed_hosts);
        Self {
            inner: Arc::new(Inner {
                orchestrator: channels
                    .orchestrator
                    .map(|c| OrchestratorServiceClient::new(c).max_decoding_message_size(16 << 20)),
                registry: channels.registry.map(|c| {
                    RegistryServiceClient::new(c)
                        .max_decoding_message_size(reach_rpc::limits::REGISTRY_LIST_BYTES)
                }),
                latency: channels.latency,
                config,
                guard,
            }),
        }
    }

    /// The settings.
    pub fn config(&self) -> &ConsoleConfig {
        &self.inner.config
    }

    /// Where instance latencies come from, when a router runs alongside.
    pub(crate) fn latency(&self) -> Option<&LatencySource> {
        self.inner.latency.as_ref()
    }

    /// The orchestrator client.
    ///
    /// # Errors
    /// [`ConsoleError::NoService`] when the console has no orchestrator.
    pub(crate) fn orchestrator(&self) -> Result<OrchestratorServiceClient<Channel>, ConsoleError> {
        self.inner
            .orchestrator
            .clone()
            .ok_or(ConsoleError::NoService("orchestrator"))
    }

    /// The registry client.
    ///
    /// # Errors
    /// [`ConsoleError::NoService`] when the console has no registry.
    pub(crate) fn registry(&self) -> Result<RegistryServiceClient<Channel>, ConsoleError> {
        self.inner
            .registry
            .clone()
            .ok_or(ConsoleError::NoService("registry"))
    }

    /// The console's routes, all under [`BASE`] (`GET /console` redirects to the inbox),
    /// behind the [`guard`] and a [`MAX_FORM_BYTES`] body limit.
    pub fn routes(&self) -> Router {
        let pages = Router::new()
            .route(
                "/",
                get(|| async { Redirect::to(&format!("{BASE}/inbox")) }),
            )
            .route("/inbox", get(inbox::list))
            .route("/inbox/{task_id}", get(inbox::review).post(inbox::resume))
            .route("/inbox/{task_id}/cancel", post(inbox::cancel))
            .route("/tasks", get(task::list))
            .route("/tasks/{task_id}", get(task::page))
            .route("/flows", get(flows::list))
            .route("/flows/{flow_id}", get(flows::page))
            .route("/mesh", get(mesh::page))
            .route("/dead-letters/{task_id}/retry", post(mesh::retry))
            .route("/assets/console.css", get(layout::stylesheet))
            .route("/assets/console.js", get(layout::script))
            .route("/login", get(auth::login_form).post(auth::login))
            .route("/logout", post(auth::logout))
            .layer(axum::middleware::from_fn_with_state(
                self.clone(),
                auth::layer,
            ))
            .with_state(self.clone());
        let guard = self.inner.guard.clone();
        Router::new()
            .nest(BASE, pages)
            .layer(axum::extract::DefaultBodyLimit::max(MAX_FORM_BYTES))
            .layer(axum::middleware::from_fn(
                move |request: axum::extract::Request, next: axum::middleware::Next| {
                    let refused = guard
                        .check(request.method(), request.uri(), request.headers())
                        .err();
                    async move {
                        let mut response = match refused {
                            Some(refusal) => axum::response::IntoResponse::into_response(refusal),
                            None => next.run(request).await,
                        };
                        guard::harden(response.headers_mut());
                        response
                    }
                },
            ))
    }
}

/// A gRPC request carrying `message`, with the console's call deadline and the logged-in
/// person's bearer token ([`session::current`]) when there is one.
pub(crate) fn request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(CALL_TIMEOUT);
    if let Some(token) = session::current()
        && let Ok(value) = format!("Bearer {token}").parse()
    {
        request.metadata_mut().insert("authorization", value);
    }
    request
}
