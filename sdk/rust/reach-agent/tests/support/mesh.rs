//! A registry and a router on 127.0.0.1 ephemeral ports, and agents started beside them.

use std::time::Duration;

use reach_registry::{Registry, RegistryConfig, RegistryGrpc};
use reach_router::{Router, RouterConfig};
use reach_rpc::GrpcServer;
use reach_sdk::runtime::RunningAgent;
use reach_sdk::{AgentConfig, AgentRuntime, MeshClient};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A registry and a router on ephemeral ports.
pub struct Mesh {
    registry_url: String,
    router_url: String,
    router: Router,
    registry: Registry,
    stop: CancellationToken,
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.registry.close_watches();
        self.stop.cancel();
    }
}

impl Mesh {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    /// A mesh whose router configuration `tweak` adjusts.
    pub async fn start_with(tweak: impl FnOnce(&mut RouterConfig)) -> Self {
        let stop = CancellationToken::new();
        let registry = Registry::new(RegistryConfig {
            health_probe: false,
            ..RegistryConfig::default()
        })
        .unwrap();
        tokio::spawn(registry.clone().run_sweeper());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let registry_url = format!("http://{}", listener.local_addr().unwrap());
        let server =
            GrpcServer::new().add_service(RegistryGrpc::new(registry.clone()).into_server());
        let token = stop.clone();
        tokio::spawn(server.serve(listener, async move { token.cancelled().await }));

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let router_url = format!("http://{}", listener.local_addr().unwrap());
        let mut config = RouterConfig {
            registry_endpoint: registry_url.clone(),
            advertise_endpoint: router_url.clone(),
            ..RouterConfig::default()
        };
        tweak(&mut config);
        let router = Router::new(config).unwrap();
        router.spawn_registry_watch();
        router.table().wait_synced().await;
        let token = stop.clone();
        let server = router.add_to(GrpcServer::new());
        tokio::spawn(server.serve(listener, async move { token.cancelled().await }));
        Self {
            registry_url,
            router_url,
            router,
            registry,
            stop,
        }
    }

    /// Starts `runtime` and waits until the router routes to it.
    pub async fn start_agent(&self, runtime: AgentRuntime, id: &str) -> RunningAgent {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (agent, _) = runtime.start(listener).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), async {
            while !self
                .router
                .table()
                .instances()
                .iter()
                .any(|i| i.instance_id == id)
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the agent became routable");
        agent
    }

    pub fn config(&self, service: &str, id: &str) -> AgentConfig {
        AgentConfig::new(service, self.registry_url.clone())
            .with_instance_id(id)
            .with_max_drain(Duration::from_secs(1))
    }

    /// The registry itself (to register instances by hand).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// A channel to the registry (for discovery).
    pub async fn registry_channel(&self) -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(self.registry_url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn client(&self, source: &str) -> MeshClient {
        MeshClient::connect(&self.router_url, source).await.unwrap()
    }
}
