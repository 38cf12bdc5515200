//! Test support: a sandbox that runs a real control plane (registry + router) on a
//! 127.0.0.1 ephemeral port, starts agents beside it, and hands out clients.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use reach::config::ReachConfig;
use reach::control_plane::{ControlPlane, Services};
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_sdk::runtime::RunningAgent;
use reach_sdk::{AgentConfig, AgentRuntime, MeshClient};
use tokio::net::TcpListener;
use tonic::transport::Channel;

/// A running registry + router on one ephemeral port.
pub struct Sandbox {
    /// The control plane.
    pub plane: ControlPlane,
}

impl Sandbox {
    /// Starts with test-friendly settings: 1 s default leases, health probing on.
    pub async fn start() -> Self {
        let mut config = ReachConfig::default();
        config.registry.default_lease_ttl = Duration::from_secs(1);
        Self::start_with(config).await
    }

    /// Starts with `config` (its listen address is ignored: the sandbox binds port 0).
    pub async fn start_with(config: ReachConfig) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind an ephemeral port");
        let plane = ControlPlane::start(listener, &config, Services::MESH)
            .await
            .expect("control plane starts");
        let router = plane.router().expect("router").table().clone();
        tokio::time::timeout(Duration::from_secs(5), router.wait_synced())
            .await
            .expect("router synced with the registry");
        Self { plane }
    }

    /// The gRPC endpoint URL.
    pub fn endpoint(&self) -> String {
        self.plane.endpoint()
    }

    /// A channel to the control plane.
    pub async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(self.endpoint())
            .expect("valid url")
            .connect()
            .await
            .expect("connect to the sandbox")
    }

    /// A raw router client.
    pub async fn router_client(&self) -> RouterServiceClient<Channel> {
        RouterServiceClient::new(self.channel().await)
    }

    /// A raw registry client.
    pub async fn registry_client(&self) -> RegistryServiceClient<Channel> {
        RegistryServiceClient::new(self.channel().await)
    }

    /// A mesh client sending as `test.client`.
    pub async fn mesh(&self) -> MeshClient {
        MeshClient::new(self.channel().await, "test.client")
    }

    /// An agent config for `service` with id `instance` registering here, with short leases.
    pub fn agent_config(&self, service: &str, instance: &str) -> AgentConfig {
        AgentConfig::new(service, self.endpoint())
            .with_instance_id(instance)
            .with_lease_ttl(Duration::from_secs(1))
            .with_max_drain(Duration::from_secs(5))
    }

    /// Starts `runtime` on an ephemeral port and waits until the router can route to it.
    pub async fn start_agent(&self, runtime: AgentRuntime) -> RunningAgent {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind agent port");
        let (agent, _endpoint) = runtime.start(listener).await.expect("agent starts");
        let id = agent.instance_id().to_string();
        let table = self.plane.router().expect("router").table().clone();
        eventually(Duration::from_secs(5), || {
            let table = table.clone();
            let id = id.clone();
            async move { table.instances().iter().any(|i| i.instance_id == id) }
        })
        .await;
        agent
    }

    /// Stops the control plane.
    pub async fn stop(self) {
        let _ = self.plane.shutdown().await;
    }
}

/// Polls `check` every 5 ms until it holds; panics after `within`.
pub async fn eventually<F, Fut>(within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Python of the repository's virtualenv (`scripts/python-env.sh` creates it).
///
/// # Panics
/// When the venv is missing, with the command that creates it.
pub fn venv_python() -> PathBuf {
    let python = repo_root().join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/python-env.sh first (it installs grpcio, grpcio-tools and grpcurl into .venv)",
        python.display()
    );
    python
}
