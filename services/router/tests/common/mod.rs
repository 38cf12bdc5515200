//! A small in-process mesh for router tests: a registry, routers and agents on 127.0.0.1:0.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use reach_proto::v1::{Capability, InstanceSpec, Payload, ReachMessage};
use reach_registry::{Registry, RegistryConfig, RegistryGrpc};
use reach_router::balance::{Random, ThreadRandom};
use reach_router::{Router, RouterConfig};
use reach_rpc::GrpcServer;
use reach_sdk::runtime::RunningAgent;
use reach_sdk::{AgentConfig, AgentRuntime, HandlerContext, MeshClient};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves `agent` (an `AgentService` written without the SDK) on 127.0.0.1:0 and registers
/// it with `registry` as instance `id` of `service`, serving `capability` 1.0.0.
pub async fn serve_bare_agent<S>(
    registry: &TestRegistry,
    service: &str,
    id: &str,
    capability: &str,
    agent: S,
) where
    S: reach_proto::v1::agent_service_server::AgentService,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        GrpcServer::new()
            .add_service(reach_proto::v1::agent_service_server::AgentServiceServer::new(agent))
            .serve(listener, futures::future::pending()),
    );
    register(
        &registry.registry,
        service,
        id,
        &endpoint,
        &[(capability, "1.0.0")],
    );
}

/// A running registry.
pub struct TestRegistry {
    pub registry: Registry,
    pub url: String,
    pub stop: CancellationToken,
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        self.registry.close_watches();
        self.stop.cancel();
    }
}

pub async fn registry() -> TestRegistry {
    registry_with(RegistryConfig {
        health_probe: false,
        ..RegistryConfig::default()
    })
    .await
}

pub async fn registry_with(config: RegistryConfig) -> TestRegistry {
    let registry = Registry::new(config).expect("registry config");
    tokio::spawn(registry.clone().run_sweeper());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let server = GrpcServer::new().add_service(RegistryGrpc::new(registry.clone()).into_server());
    let token = stop.clone();
    tokio::spawn(server.serve(listener, async move { token.cancelled().await }));
    TestRegistry {
        registry,
        url,
        stop,
    }
}

/// A running router.
pub struct TestRouter {
    pub router: Router,
    pub url: String,
    pub stop: CancellationToken,
}

impl Drop for TestRouter {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl TestRouter {
    pub async fn client(&self) -> MeshClient {
        MeshClient::connect(&self.url, "test.caller").await.unwrap()
    }

    /// Waits until `n` instances are routable.
    pub async fn wait_routable(&self, n: usize) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while self.router.table().instances().len() < n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("instances did not become routable in 10 s");
    }

    /// Waits until the table has applied registry revision `revision`.
    pub async fn wait_revision(&self, revision: u64) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while self.router.table().revision() < revision {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await
        .expect("the router did not catch up with the registry in 10 s");
    }
}

pub async fn router(registry_url: &str, config: RouterConfig) -> TestRouter {
    router_with_random(registry_url, config, Arc::new(ThreadRandom)).await
}

/// A router whose balancing draws from `random`.
pub async fn router_with_random(
    registry_url: &str,
    mut config: RouterConfig,
    random: Arc<dyn Random>,
) -> TestRouter {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    config.registry_endpoint = registry_url.to_string();
    config.advertise_endpoint = url.clone();
    let router = Router::with_random(config, random).expect("router config");
    router.spawn_registry_watch();
    router.table().wait_synced().await;
    let stop = CancellationToken::new();
    let token = stop.clone();
    let server = router.add_to(GrpcServer::new());
    tokio::spawn(server.serve(listener, async move { token.cancelled().await }));
    TestRouter { router, url, stop }
}

/// Starts `runtime` on a fresh port.
pub async fn agent(runtime: AgentRuntime) -> (RunningAgent, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    runtime.start(listener).await.unwrap()
}

/// An agent config with a fixed instance id, registering with `registry`.
pub fn config(service: &str, id: &str, registry: &str) -> AgentConfig {
    AgentConfig::new(service, registry)
        .with_instance_id(id)
        .with_max_concurrency(64)
}

/// An agent for `capability` whose handler counts calls and answers with its instance id.
pub fn echo_agent(
    config: AgentConfig,
    capability: &str,
    counter: Arc<AtomicUsize>,
) -> AgentRuntime {
    AgentRuntime::new(config).handle(
        capability,
        "1.0.0",
        move |ctx: HandlerContext, message: ReachMessage| {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                let _ = message;
                Ok(Payload::text("echo", ctx.instance_id.to_string()))
            }
        },
    )
}

/// Registers an instance by hand (as a non-SDK agent would) and returns its lease and the
/// registry revision of the registration.
pub fn register(
    registry: &Registry,
    service: &str,
    id: &str,
    endpoint: &str,
    capabilities: &[(&str, &str)],
) -> (String, u64) {
    let spec = InstanceSpec {
        service: service.into(),
        instance_id: id.into(),
        endpoint: endpoint.into(),
        capabilities: capabilities
            .iter()
            .map(|(name, version)| Capability {
                name: (*name).into(),
                version: (*version).into(),
                ..Default::default()
            })
            .collect(),
        protocol_version: "1.0".into(),
        weight: 1,
        max_concurrency: 0,
        ..InstanceSpec::default()
    };
    let registration = registry
        .register(spec, Some(Duration::from_secs(60)))
        .expect("registration");
    (registration.lease_id, registration.instance.revision)
}

/// A port with nothing listening on it (connection refused).
pub async fn dead_endpoint() -> (String, u16) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    (format!("http://127.0.0.1:{port}"), port)
}

/// The ErrorInfo reason of a status.
pub fn reason(status: &tonic::Status) -> String {
    reach_rpc::errors::reason_of(status).unwrap_or_default()
}

/// The sum of the samples of metric `name` (a rendered Prometheus line name, such as
/// `reach_router_requests_total` or `..._seconds_count`) whose labels include every one of
/// `labels`, in `rendered` (a `PrometheusHandle::render()`); 0 when there is none.
pub fn metric(rendered: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let prefix = format!("{name}{{");
    rendered
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits (at most 10 s) until `check` holds; panics with `what` otherwise.
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while !check() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "{what} did not happen in 10 s");
}
