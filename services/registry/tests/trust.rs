//! The registry with trust on, over gRPC on 127.0.0.1:0, callers authenticated by bearer
//! tokens: serve rules govern topics and typed gRPC services as they govern capabilities;
//! only routers, edges and operators Watch and ListInstances, each identity but routers with
//! a capped number of Watch streams, out of slots routers never lose; an instance advertises
//! only its own address (or one the policy grants), and health probes are paced per identity.
//!
//! The registry is served by Reach's own server (`reach_rpc::GrpcServer`), plaintext with
//! bearer tokens: it authenticates each caller and records each connection's peer address,
//! which the endpoint rule judges.

use std::time::Duration;

use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::{
    Capability, InstanceSpec, ListInstancesRequest, RegisterRequest, WatchRequest, watch_response,
};
use reach_registry::{Registry, RegistryConfig, RegistryGrpc};
use reach_trust::{Identity, Trust, TrustConfig};
use tonic::transport::Channel;
use tonic::{Code, Status};

const TD: &str = "td";

/// A registry with trust on (bearer tokens, `policy`), and the key to sign callers' tokens.
struct Mesh {
    _dir: tempfile::TempDir,
    token_key: String,
    url: String,
    registry: Registry,
}

impl Mesh {
    async fn start(policy: &str, config: RegistryConfig) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (token_key, public) = reach_trust::issue::token_signing_key().unwrap();
        std::fs::write(dir.path().join("jwt.pem"), public).unwrap();
        std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
        let trust = Trust::load(&TrustConfig {
            trust_domain: TD.into(),
            policy: Some(dir.path().join("policy.yaml")),
            jwt: Some(reach_trust::token::JwtConfig::new(vec![
                dir.path().join("jwt.pem"),
            ])),
            ..TrustConfig::default()
        })
        .unwrap();
        let registry = Registry::new(config).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let service = RegistryGrpc::new(registry.clone())
            .with_trust(trust.clone())
            .into_server();
        let server = reach_rpc::GrpcServer::new()
            .with_trust(trust)
            .add_service(service);
        tokio::spawn(server.serve(listener, futures::future::pending()));
        Self {
            _dir: dir,
            token_key,
            url,
            registry,
        }
    }

    /// A client calling as `identity` (a path of the trust domain, such as `/router`).
    async fn client(&self, identity: &str) -> Client {
        let identity = Identity::new(TD, identity).unwrap();
        let claims =
            reach_trust::token::claims(identity.as_str(), "reach", None, Duration::from_secs(300));
        let token = reach_trust::token::sign(self.token_key.as_bytes(), &claims.into()).unwrap();
        let channel = Channel::from_shared(self.url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        Client {
            inner: RegistryServiceClient::new(channel),
            authorization: format!("Bearer {token}"),
        }
    }
}

/// A registry client that sends its bearer token with every request.
struct Client {
    inner: RegistryServiceClient<Channel>,
    authorization: String,
}

impl Client {
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request
            .metadata_mut()
            .insert("authorization", self.authorization.parse().unwrap());
        request
    }

    async fn register(&mut self, spec: InstanceSpec) -> Result<(), Status> {
        let request = self.request(RegisterRequest {
            instance: Some(spec),
            lease_ttl: None,
        });
        self.inner.register(request).await.map(|_| ())
    }

    async fn watch(&mut self) -> Result<tonic::Streaming<reach_proto::v1::WatchResponse>, Status> {
        let request = self.request(WatchRequest::default());
        let mut stream = self.inner.watch(request).await?.into_inner();
        // The snapshot: the stream is open and holds its slot.
        let first = stream.message().await?.expect("a snapshot");
        assert!(matches!(
            first.event,
            Some(watch_response::Event::Snapshot(_))
        ));
        Ok(stream)
    }

    async fn list(&mut self) -> Result<Vec<reach_proto::v1::Instance>, Status> {
        let request = self.request(ListInstancesRequest::default());
        Ok(self
            .inner
            .list_instances(request)
            .await?
            .into_inner()
            .instances)
    }
}

fn spec(service: &str, id: &str, endpoint: &str) -> InstanceSpec {
    InstanceSpec {
        service: service.into(),
        instance_id: id.into(),
        endpoint: endpoint.into(),
        capabilities: vec![Capability {
            name: format!("{service}.ask"),
            version: "1.0.0".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn no_probes() -> RegistryConfig {
    RegistryConfig {
        health_probe: false,
        ..RegistryConfig::default()
    }
}

/// Asserts `status` is `code` with ErrorInfo `reason`, and its message says each of `says`.
fn assert_refused(status: &Status, code: Code, reason: &str, says: &[&str]) {
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(
        reach_rpc::errors::reason_of(status).as_deref(),
        Some(reason),
        "{status:?}"
    );
    for said in says {
        assert!(
            status.message().contains(said),
            "{said:?} in {}",
            status.message()
        );
    }
}

const ALPHA: &str = r#"
serve:
  - identities: ["spiffe://td/agent/alpha"]
    capabilities: ["alpha.*"]
  - identities: ["spiffe://td/agent/typed"]
    capabilities: ["typed.*"]
    grpc_services: ["typed.v1.*"]
  - identities: ["spiffe://td/agent/pods"]
    capabilities: ["pods.*"]
    endpoints: ["192.0.2.0/24"]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_rules_govern_topics_and_grpc_services_at_register() {
    let mesh = Mesh::start(ALPHA, no_probes()).await;
    let mut alpha = mesh.client("/agent/alpha").await;
    let mut topic = spec("alpha", "a-1", "http://127.0.0.1:9");
    topic.topics = vec!["alpha.news".into(), "echo.news".into()];
    let refused = alpha.register(topic).await.unwrap_err();
    assert_refused(
        &refused,
        Code::PermissionDenied,
        "NOT_AUTHORIZED",
        &["spiffe://td/agent/alpha", "topic echo.news", "`topics`"],
    );
    let mut typed = spec("alpha", "a-2", "http://127.0.0.1:9");
    typed.grpc_services = vec!["secret.v1.Vault".into()];
    let refused = alpha.register(typed).await.unwrap_err();
    assert_refused(
        &refused,
        Code::PermissionDenied,
        "NOT_AUTHORIZED",
        &["grpc_service secret.v1.Vault", "`grpc_services`"],
    );
    assert_eq!(
        reach_rpc::errors::metadata_of(&refused)
            .get("target")
            .map(String::as_str),
        Some("service \"alpha\" serving grpc_service secret.v1.Vault")
    );
    // What the rule grants registers.
    let mut granted = spec("alpha", "a-3", "http://127.0.0.1:9");
    granted.topics = vec!["alpha.news".into()];
    alpha.register(granted).await.unwrap();
    let mut typed = mesh.client("/agent/typed").await;
    let mut granted = spec("typed", "t-1", "http://127.0.0.1:9");
    granted.grpc_services = vec!["typed.v1.Triage".into()];
    typed.register(granted).await.unwrap();
    // Nothing refused was registered.
    let ids: Vec<String> = mesh
        .registry
        .list("", "")
        .instances
        .into_iter()
        .map(|i| i.spec.unwrap().instance_id)
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_routers_edges_and_operators_watch_and_list_instances() {
    let mesh = Mesh::start(ALPHA, no_probes()).await;
    for who in ["/user/mallory", "/agent/alpha"] {
        let mut client = mesh.client(who).await;
        let refused = client.watch().await.unwrap_err();
        assert_refused(
            &refused,
            Code::PermissionDenied,
            "NOT_AUTHORIZED",
            &[
                who,
                "may not watch the registry's instances",
                "registry.watchers",
            ],
        );
        let refused = client.list().await.unwrap_err();
        assert_refused(
            &refused,
            Code::PermissionDenied,
            "NOT_AUTHORIZED",
            &[who, "may not list the registry's instances"],
        );
    }
    mesh.client("/router").await.watch().await.unwrap();
    mesh.client("/operator/ops").await.watch().await.unwrap();
    mesh.client("/edge").await.list().await.unwrap();
    mesh.client("/operator/ops").await.list().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_are_capped_per_identity_and_routers_keep_their_slots() {
    use reach_registry::service::MAX_WATCHES;
    let mesh = Mesh::start(
        ALPHA,
        RegistryConfig {
            max_watches_per_identity: 3,
            // Five slots for everyone else; the rest are the routers'.
            router_watch_slots: MAX_WATCHES - 5,
            ..no_probes()
        },
    )
    .await;
    let mut alice = mesh.client("/operator/alice").await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(alice.watch().await.unwrap());
    }
    let refused = alice.watch().await.unwrap_err();
    assert_refused(
        &refused,
        Code::ResourceExhausted,
        "TOO_MANY_WATCHES",
        &[
            "spiffe://td/operator/alice holds 3 Watch streams",
            "registry.max_watches_per_identity = 3",
        ],
    );
    let metadata = reach_rpc::errors::metadata_of(&refused);
    assert_eq!(metadata["identity"], "spiffe://td/operator/alice");
    assert_eq!(metadata["limit"], "3");
    assert_eq!(metadata["setting"], "registry.max_watches_per_identity");
    let mut bob = mesh.client("/operator/bob").await;
    held.push(bob.watch().await.unwrap());
    held.push(bob.watch().await.unwrap());
    let refused = bob.watch().await.unwrap_err();
    assert_refused(
        &refused,
        Code::ResourceExhausted,
        "TOO_MANY_WATCHES",
        &["registry.router_watch_slots"],
    );
    // Routers are neither capped per identity nor kept out of their slots: every replica
    // of the router shares one identity.
    let mut router = mesh.client("/router").await;
    let mut routers = Vec::new();
    for _ in 0..8 {
        routers.push(router.watch().await.unwrap());
    }
    // A closed watch gives its slot back to its identity.
    held.remove(0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match alice.watch().await {
            Ok(stream) => {
                held.push(stream);
                break;
            }
            Err(status) if status.code() == Code::ResourceExhausted => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the closed watch's slot was not freed within 10 s"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_advertises_only_its_own_address_or_a_granted_one() {
    let mesh = Mesh::start(
        ALPHA,
        RegistryConfig {
            health_probe: true,
            probe_timeout: Duration::from_millis(200),
            ..RegistryConfig::default()
        },
    )
    .await;
    let mut alpha = mesh.client("/agent/alpha").await;
    // This test's connections come from 127.0.0.1: any loopback address is its machine.
    alpha
        .register(spec("alpha", "a-1", "http://127.0.0.1:9"))
        .await
        .unwrap();
    alpha
        .register(spec("alpha", "a-2", "http://127.0.0.2:9"))
        .await
        .unwrap();
    for endpoint in ["http://192.0.2.7:22", "http://[2001:db8::1]:22"] {
        let refused = alpha
            .register(spec("alpha", "a-3", endpoint))
            .await
            .unwrap_err();
        assert_refused(
            &refused,
            Code::PermissionDenied,
            "NOT_AUTHORIZED",
            &[
                &format!("may not advertise endpoint \"{endpoint}\""),
                "came from 127.0.0.1",
                "`endpoints`",
            ],
        );
    }
    let refused = alpha
        .register(spec("alpha", "a-3", "http://nowhere.invalid:22"))
        .await
        .unwrap_err();
    assert_refused(
        &refused,
        Code::PermissionDenied,
        "NOT_AUTHORIZED",
        &["resolves to no address"],
    );
    // A granted network.
    mesh.client("/agent/pods")
        .await
        .register(spec("pods", "p-1", "http://192.0.2.7:8080"))
        .await
        .unwrap();
    // A name is judged by what it resolves to, and probed at the address checked.
    alpha
        .register(spec("alpha", "a-4", "http://localhost:9"))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let error = loop {
        let instance = mesh
            .registry
            .list("alpha", "")
            .instances
            .into_iter()
            .find(|i| i.spec.as_ref().unwrap().instance_id == "a-4")
            .unwrap();
        if !instance.health_probe_error.is_empty() {
            break instance.health_probe_error;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the probe of a-4 did not fail within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        error.contains("on http://127.0.0.1:9:"),
        "the probe dials the registrant's own address of those checked, not the name: {error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_probes_are_paced_per_identity() {
    let mesh = Mesh::start(
        ALPHA,
        RegistryConfig {
            health_probe: true,
            probe_timeout: Duration::from_millis(200),
            probe_burst_per_identity: 2,
            probes_per_second_per_identity: 1,
            ..RegistryConfig::default()
        },
    )
    .await;
    let mut alpha = mesh.client("/agent/alpha").await;
    // Two at once, then one a second: a registration this machine is slow to make may find a
    // probe refilled, so count what was accepted against the time it took.
    let start = tokio::time::Instant::now();
    let mut accepted = 0;
    let refused = loop {
        match alpha
            .register(spec(
                "alpha",
                &format!("a-{accepted}"),
                "http://127.0.0.1:9",
            ))
            .await
        {
            Ok(()) => accepted += 1,
            Err(status) => break status,
        }
        assert!(accepted <= 50, "50 registrations in a row were probed");
    };
    let refilled = start.elapsed().as_secs() as usize + 1;
    assert!(
        (2..=2 + refilled).contains(&accepted),
        "{accepted} registrations probed in {:?}",
        start.elapsed()
    );
    assert_refused(
        &refused,
        Code::ResourceExhausted,
        "PROBE_RATE_LIMITED",
        &[
            "spiffe://td/agent/alpha",
            "registry.probes_per_second_per_identity",
        ],
    );
    let retry = reach_rpc::errors::retry_after_of(&refused).expect("RetryInfo");
    assert!(retry <= Duration::from_secs(1), "{retry:?}");
    // Another identity has an allowance of its own.
    mesh.client("/agent/pods")
        .await
        .register(spec("pods", "p-1", "http://127.0.0.1:9"))
        .await
        .unwrap();
    // The allowance refills.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match alpha
            .register(spec("alpha", "a-last", "http://127.0.0.1:10"))
            .await
        {
            Ok(()) => break,
            Err(status) if status.code() == Code::ResourceExhausted => {
                assert!(tokio::time::Instant::now() < deadline, "{status:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    }
}
