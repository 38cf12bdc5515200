//! The router with trust on, over real TLS on 127.0.0.1 with certificates made in the test:
//! every call is held to the policy (an unknown caller is denied what the policy restricts and
//! allowed what it opens), the caller's bearer token is not forwarded, the instance sees the
//! verified caller in `x-reach-caller` (a forged one is replaced), an SDK agent serving TLS
//! reads it as `HandlerContext::caller`, and a policy change applies without a restart.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reach::config::ReachConfig;
use reach::control_plane::{ControlPlane, Services};
use reach_proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{
    CallRequest, Capability, HandleMuxRequest, HandleMuxResponse, HandleRequest, HandleResponse,
    HandleStreamRequest, HandleStreamResponse, InstanceSpec, Payload, ReachMessage,
    RegisterRequest,
};
use reach_sdk::{AgentConfig, AgentRuntime, HandlerContext};
use reach_trust::issue::{CertificateAuthority, token_signing_key};
use reach_trust::tls::{ClientAuth, TlsConfig, TlsSource};
use reach_trust::token::{JwtConfig, claims, sign};
use reach_trust::{Identity, TrustConfig};
use tokio_stream::Stream;
use tonic::{Code, Request, Response, Status, Streaming};

const TD: &str = "reach.test";
const DAY: Duration = Duration::from_secs(86_400);

struct Pki {
    dir: tempfile::TempDir,
    ca: CertificateAuthority,
    signing_key: String,
}

impl Pki {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = CertificateAuthority::generate(TD, DAY).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.cert_pem()).unwrap();
        let (signing_key, public) = token_signing_key().unwrap();
        std::fs::write(dir.path().join("jwt-public.pem"), public).unwrap();
        Self {
            dir,
            ca,
            signing_key,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Certificate files for `identity`, as a TLS configuration.
    fn tls(&self, name: &str, identity: &Identity) -> TlsConfig {
        let issued = self.ca.issue(identity, &[], DAY).unwrap();
        std::fs::write(self.path(&format!("{name}.pem")), issued.cert_pem).unwrap();
        std::fs::write(self.path(&format!("{name}-key.pem")), issued.key_pem).unwrap();
        let mut tls = TlsConfig::new(
            self.path(&format!("{name}.pem")),
            self.path(&format!("{name}-key.pem")),
            self.path("ca.pem"),
        );
        tls.reload_interval = Duration::from_millis(20);
        tls
    }

    /// A TLS client configuration that trusts the CA and presents no certificate.
    fn anonymous_tls(&self) -> Arc<TlsSource> {
        let tls = TlsConfig {
            cert: None,
            key: None,
            ..TlsConfig::new("", "", self.path("ca.pem"))
        };
        TlsSource::load(&tls, TD).unwrap()
    }

    fn token(&self, subject: &str) -> String {
        let claims = claims(subject, "reach", None, Duration::from_secs(600));
        sign(self.signing_key.as_bytes(), &claims.into()).unwrap()
    }
}

async fn start_plane(pki: &Pki, policy: &Path) -> ControlPlane {
    let mut config = ReachConfig::default();
    config.registry.default_lease_ttl = Duration::from_secs(2);
    let mut tls = pki.tls("router", &Identity::service(TD, "router").unwrap());
    // Callers without a certificate may present a bearer token.
    tls.client_auth = ClientAuth::Optional;
    config.trust = TrustConfig {
        trust_domain: TD.into(),
        policy: Some(policy.to_path_buf()),
        policy_reload_interval: Duration::from_millis(20),
        tls: Some(tls),
        jwt: Some(JwtConfig::new(vec![pki.path("jwt-public.pem")])),
        ..TrustConfig::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plane = ControlPlane::start(listener, &config, Services::MESH)
        .await
        .unwrap();
    let table = plane.router().unwrap().table().clone();
    tokio::time::timeout(Duration::from_secs(5), table.wait_synced())
        .await
        .unwrap();
    plane
}

/// An agent without the SDK that answers every Handle and keeps each request's metadata.
#[derive(Default, Clone)]
struct RecordingAgent {
    metadata: Arc<Mutex<Vec<tonic::metadata::MetadataMap>>>,
}

#[tonic::async_trait]
impl AgentService for RecordingAgent {
    async fn handle(
        &self,
        request: Request<HandleRequest>,
    ) -> Result<Response<HandleResponse>, Status> {
        self.metadata
            .lock()
            .unwrap()
            .push(request.metadata().clone());
        let message = request.into_inner().message.unwrap_or_default();
        Ok(Response::new(HandleResponse {
            message: Some(ReachMessage {
                header: None,
                payload: message.payload,
            }),
        }))
    }

    type HandleStreamStream =
        Pin<Box<dyn Stream<Item = Result<HandleStreamResponse, Status>> + Send>>;

    async fn handle_stream(
        &self,
        _request: Request<Streaming<HandleStreamRequest>>,
    ) -> Result<Response<Self::HandleStreamStream>, Status> {
        Err(Status::unimplemented("no streams here"))
    }

    type HandleMuxStream = Pin<Box<dyn Stream<Item = Result<HandleMuxResponse, Status>> + Send>>;

    async fn handle_mux(
        &self,
        _request: Request<Streaming<HandleMuxRequest>>,
    ) -> Result<Response<Self::HandleMuxStream>, Status> {
        Err(Status::unimplemented(
            "unary only, so the test reads each call's metadata",
        ))
    }
}

/// Serves `agent` over TLS as `service` and registers it with the plane, presenting the
/// agent's certificate; waits until the router can route to it.
async fn serve_recording_agent(
    pki: &Pki,
    plane: &ControlPlane,
    service: &str,
    capabilities: &[&str],
    agent: RecordingAgent,
) {
    let tls = pki.tls(
        &format!("agent-{service}"),
        &Identity::agent(TD, service).unwrap(),
    );
    let trust = reach_trust::Trust::load(&TrustConfig {
        trust_domain: TD.into(),
        tls: Some(tls.clone()),
        ..TrustConfig::default()
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        reach_rpc::GrpcServer::new()
            .with_trust(trust.clone())
            .add_service(AgentServiceServer::new(agent))
            .serve(listener, std::future::pending()),
    );
    let channel = reach_rpc::http2::channel(
        &reach_rpc::http2::endpoint(plane.endpoint()).unwrap(),
        trust.tls(),
        None,
    )
    .await
    .unwrap();
    RegistryServiceClient::new(channel)
        .register(RegisterRequest {
            instance: Some(InstanceSpec {
                service: service.into(),
                instance_id: format!("{service}-1"),
                endpoint,
                capabilities: capabilities
                    .iter()
                    .map(|name| Capability {
                        name: name.to_string(),
                        version: "1.0.0".into(),
                        ..Capability::default()
                    })
                    .collect(),
                protocol_version: "1.0".into(),
                ..InstanceSpec::default()
            }),
            lease_ttl: None,
        })
        .await
        .unwrap();
    wait_routable(plane, &format!("{service}-1")).await;
}

async fn wait_routable(plane: &ControlPlane, instance: &str) {
    let table = plane.router().unwrap().table().clone();
    reach_tests::eventually(Duration::from_secs(10), || {
        let table = table.clone();
        let instance = instance.to_string();
        async move { table.instances().iter().any(|i| i.instance_id == instance) }
    })
    .await;
}

/// A router client over TLS without a client certificate, sending `token` (if any) as a
/// bearer token on every call, and `extra` metadata.
async fn client(pki: &Pki, plane: &ControlPlane) -> RouterServiceClient<tonic::transport::Channel> {
    let channel = reach_rpc::http2::channel(
        &reach_rpc::http2::endpoint(plane.endpoint()).unwrap(),
        Some(&pki.anonymous_tls()),
        None,
    )
    .await
    .unwrap();
    RouterServiceClient::new(channel)
}

fn call(
    capability: &str,
    token: Option<&str>,
    extra: &[(&'static str, &str)],
) -> Request<CallRequest> {
    let message = ReachMessage {
        header: Some(reach_proto::v1::Header {
            target: Some(reach_proto::v1::header::Target::Capability(
                capability.into(),
            )),
            ..Default::default()
        }),
        payload: Some(Payload::text("echo.request", "hi")),
    };
    let mut request = Request::new(CallRequest {
        message: Some(message),
    });
    if let Some(token) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    for (key, value) in extra {
        request.metadata_mut().insert(*key, value.parse().unwrap());
    }
    request
}

fn error_info(status: &Status) -> (String, std::collections::HashMap<String, String>) {
    use tonic_types::StatusExt;
    let info = status.get_details_error_info().expect("ErrorInfo");
    (info.reason, info.metadata)
}

const POLICY: &str = r#"
call:
  - identities: ["*"]
    capabilities: ["echo.open"]
  - identities: ["spiffe://reach.test/user/alice"]
    capabilities: ["echo.say"]
serve:
  - identities: ["spiffe://reach.test/agent/*"]
    capabilities: ["*"]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_held_to_the_policy_and_the_instance_sees_only_the_verified_caller() {
    let pki = Pki::new();
    let policy = pki.path("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let plane = start_plane(&pki, &policy).await;
    let agent = RecordingAgent::default();
    serve_recording_agent(
        &pki,
        &plane,
        "echo",
        &["echo.say", "echo.open"],
        agent.clone(),
    )
    .await;
    let mut router = client(&pki, &plane).await;
    let (alice, bob) = (pki.token("alice"), pki.token("bob"));

    // No certificate and no token: who is calling is unknown.
    let status = router.call(call("echo.open", None, &[])).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(
        status.message().contains("bearer token"),
        "{}",
        status.message()
    );

    // Bob may call what the policy opens, not what it restricts to alice.
    router
        .call(call("echo.open", Some(&bob), &[]))
        .await
        .unwrap();
    let status = router
        .call(call("echo.say", Some(&bob), &[]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let (reason, metadata) = error_info(&status);
    assert_eq!(reason, "NOT_AUTHORIZED");
    assert_eq!(metadata["identity"], "spiffe://reach.test/user/bob");
    assert_eq!(metadata["target"], "capability echo.say");
    assert!(
        status.message().contains("add one under `call:`"),
        "{}",
        status.message()
    );

    // Alice may; the instance sees her verified identity, not her token, and not the caller
    // she claims to be.
    agent.metadata.lock().unwrap().clear();
    router
        .call(call(
            "echo.say",
            Some(&alice),
            &[("x-reach-caller", "spiffe://reach.test/operator/root")],
        ))
        .await
        .unwrap();
    let seen = agent
        .metadata
        .lock()
        .unwrap()
        .pop()
        .expect("the agent was called");
    assert_eq!(
        seen.get("x-reach-caller").unwrap().to_str().unwrap(),
        "spiffe://reach.test/user/alice"
    );
    assert!(
        seen.get("authorization").is_none(),
        "the bearer token was forwarded"
    );

    // A policy change applies without a restart: bob gets echo.say too.
    let mut reloads = plane.trust().policy_source().unwrap().reloads();
    std::fs::write(
        &policy,
        POLICY.replace(
            "[\"spiffe://reach.test/user/alice\"]",
            "[\"spiffe://reach.test/user/*\"]",
        ),
    )
    .unwrap();
    tokio::time::timeout(Duration::from_secs(10), reloads.changed())
        .await
        .unwrap()
        .unwrap();
    router
        .call(call("echo.say", Some(&bob), &[]))
        .await
        .unwrap();
    let _ = plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sdk_agent_serving_tls_reads_the_caller_the_router_verified() {
    let pki = Pki::new();
    let policy = pki.path("policy.yaml");
    std::fs::write(
        &policy,
        "call:\n  - identities: ['*']\n    capabilities: ['whoami']\nserve:\n  - identities: ['*']\n",
    )
    .unwrap();
    let plane = start_plane(&pki, &policy).await;
    let config = AgentConfig::new("whoami", plane.endpoint())
        .with_instance_id("whoami-1")
        .with_lease_ttl(Duration::from_secs(2))
        .with_trust_domain(TD)
        .with_tls(pki.tls("agent-whoami", &Identity::agent(TD, "whoami").unwrap()));
    let runtime = AgentRuntime::new(config).handle(
        "whoami",
        "1.0.0",
        |ctx: HandlerContext, _message: ReachMessage| async move {
            Ok(Payload::text(
                "whoami.reply",
                ctx.caller
                    .map_or_else(|| "nobody".to_string(), |id| id.to_string()),
            ))
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (agent, agent_endpoint) = runtime.start(listener).await.unwrap();
    wait_routable(&plane, "whoami-1").await;
    let mut router = client(&pki, &plane).await;
    let reply = router
        .call(call("whoami", Some(&pki.token("carol")), &[]))
        .await
        .unwrap()
        .into_inner();
    let text = reply
        .message
        .and_then(|m| m.payload)
        .and_then(|p| p.first_text().map(str::to_string))
        .unwrap();
    assert_eq!(text, "spiffe://reach.test/user/carol");

    // A client calling the agent directly (not the router) cannot claim a caller: it is not
    // answered at all, forged `x-reach-caller` or not, since only routers may call an agent.
    let direct = reach_rpc::http2::channel(
        &reach_rpc::http2::endpoint(agent_endpoint).unwrap(),
        Some(
            &TlsSource::load(
                &pki.tls("agent-other", &Identity::agent(TD, "other").unwrap()),
                TD,
            )
            .unwrap(),
        ),
        None,
    )
    .await
    .unwrap();
    let mut request = Request::new(HandleRequest {
        message: Some(ReachMessage {
            header: Some(reach_proto::v1::Header {
                target: Some(reach_proto::v1::header::Target::Capability("whoami".into())),
                message_id: uuid_like(),
                ..Default::default()
            }),
            payload: Some(Payload::text("whoami.request", "")),
        }),
    });
    request.metadata_mut().insert(
        "x-reach-caller",
        "spiffe://reach.test/operator/root".parse().unwrap(),
    );
    let refused = reach_proto::v1::agent_service_client::AgentServiceClient::new(direct)
        .handle(request)
        .await
        .expect_err("a non-router peer calling the agent directly is refused");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    let _ = agent.drain().await;
    let _ = plane.shutdown().await;
}

fn uuid_like() -> String {
    "0190f0f0-0000-7000-8000-000000000001".into()
}
