//! Asynchronous replies with trust on, over real TLS on 127.0.0.1 with certificates made in the
//! test: only the agent a call was delivered to may reply to it (another agent, a user or a
//! forged "forwarded" reply is refused PERMISSION_DENIED / NOT_AUTHORIZED, alike whether the
//! call exists or not), a reply sent to another replica is forwarded only to a replica proving
//! the router identity (or listed in `router.peers`), and the cache of replica clients stays
//! bounded whatever `reply_to` values arrive.

mod common;

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::Stream;
use reach_proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::router_service_server::{RouterService, RouterServiceServer};
use reach_proto::v1::{
    CallMuxRequest, CallMuxResponse, CallRequest, CallResponse, HandleMuxRequest,
    HandleMuxResponse, HandleRequest, HandleResponse, HandleStreamRequest, HandleStreamResponse,
    Header, Payload, PublishRequest, PublishResponse, ReachMessage, ReplyRequest, ReplyResponse,
    StreamRequest, StreamResponse, header,
};
use reach_registry::{Registry, RegistryConfig, RegistryGrpc};
use reach_router::{FORWARDED_REPLY_METADATA, Router, RouterConfig};
use reach_rpc::GrpcServer;
use reach_trust::issue::{CertificateAuthority, token_signing_key};
use reach_trust::tls::{ClientAuth, TlsConfig, TlsSource};
use reach_trust::token::{JwtConfig, claims, sign};
use reach_trust::{Identity, Trust, TrustConfig};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status, Streaming};

use common::{eventually, reason};

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

    /// Certificate files for `path` (`/router`, `/agent/echo`), as a TLS configuration
    /// (client certificates optional, so bearer tokens work too).
    fn tls(&self, path: &str) -> TlsConfig {
        let identity = Identity::new(TD, path).unwrap();
        let name = path.trim_start_matches('/').replace('/', "-");
        let issued = self.ca.issue(&identity, &[], DAY).unwrap();
        std::fs::write(self.path(&format!("{name}.pem")), issued.cert_pem).unwrap();
        std::fs::write(self.path(&format!("{name}-key.pem")), issued.key_pem).unwrap();
        let mut tls = TlsConfig::new(
            self.path(&format!("{name}.pem")),
            self.path(&format!("{name}-key.pem")),
            self.path("ca.pem"),
        );
        tls.client_auth = ClientAuth::Optional;
        tls
    }

    /// Trust with the certificate of `path` and the test's token key.
    fn trust(&self, path: &str) -> Arc<Trust> {
        Trust::load(&TrustConfig {
            trust_domain: TD.into(),
            tls: Some(self.tls(path)),
            jwt: Some(JwtConfig::new(vec![self.path("jwt-public.pem")])),
            ..TrustConfig::default()
        })
        .unwrap()
    }

    fn token(&self, subject: &str) -> String {
        let claims = claims(subject, "reach", None, Duration::from_secs(600));
        sign(self.signing_key.as_bytes(), &claims.into()).unwrap()
    }

    /// A router client presenting the certificate of `path`.
    async fn client(&self, url: &str, path: &str) -> RouterServiceClient<Channel> {
        let tls = TlsSource::load(&self.tls(path), TD).unwrap();
        let channel =
            reach_rpc::http2::channel(&reach_rpc::http2::endpoint(url).unwrap(), Some(&tls), None)
                .await
                .unwrap();
        RouterServiceClient::new(channel)
    }

    /// A router client presenting no certificate.
    async fn anonymous_client(&self, url: &str) -> RouterServiceClient<Channel> {
        let tls = TlsSource::load(
            &TlsConfig {
                cert: None,
                key: None,
                ..TlsConfig::new("", "", self.path("ca.pem"))
            },
            TD,
        )
        .unwrap();
        let channel =
            reach_rpc::http2::channel(&reach_rpc::http2::endpoint(url).unwrap(), Some(&tls), None)
                .await
                .unwrap();
        RouterServiceClient::new(channel)
    }
}

/// A registry served over TLS (as `/registry`), instances registered in-process.
async fn registry(pki: &Pki) -> (Registry, String) {
    let registry = Registry::new(RegistryConfig {
        health_probe: false,
        ..RegistryConfig::default()
    })
    .unwrap();
    let trust = pki.trust("/registry");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(
        GrpcServer::new()
            .with_trust(trust.clone())
            .add_service(
                RegistryGrpc::new(registry.clone())
                    .with_trust(trust)
                    .into_server(),
            )
            .serve(listener, std::future::pending()),
    );
    (registry, url)
}

/// A router serving TLS as `/router` (or trust off when `pki` is `None`), advertising its URL.
async fn router(
    pki: Option<&Pki>,
    registry_url: &str,
    mut config: RouterConfig,
) -> (Router, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let scheme = if pki.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{}", listener.local_addr().unwrap());
    config.registry_endpoint = registry_url.to_string();
    config.advertise_endpoint.clone_from(&url);
    let trust = pki.map_or_else(Trust::disabled, |pki| pki.trust("/router"));
    let router = Router::with_trust(config, trust.clone()).unwrap();
    router.spawn_registry_watch();
    tokio::time::timeout(Duration::from_secs(10), router.table().wait_synced())
        .await
        .expect("the router synced with the registry");
    tokio::spawn(
        router
            .add_to(GrpcServer::new().with_trust(trust))
            .serve(listener, std::future::pending()),
    );
    (router, url)
}

/// An agent that acknowledges every message (asking for an asynchronous reply) and hands the
/// request's `message_id` and `reply_to` to the test.
#[derive(Clone)]
struct AckingAgent {
    requests: mpsc::UnboundedSender<(String, String)>,
}

#[tonic::async_trait]
impl AgentService for AckingAgent {
    async fn handle(
        &self,
        request: Request<HandleRequest>,
    ) -> Result<Response<HandleResponse>, Status> {
        let header = request
            .into_inner()
            .message
            .and_then(|m| m.header)
            .unwrap_or_default();
        let _ = self.requests.send((header.message_id, header.reply_to));
        Ok(Response::new(HandleResponse {
            message: Some(ReachMessage {
                header: None,
                payload: Some(Payload::text(reach_rpc::ACK_PAYLOAD_TYPE, "")),
            }),
        }))
    }

    type HandleStreamStream =
        Pin<Box<dyn Stream<Item = Result<HandleStreamResponse, Status>> + Send>>;

    async fn handle_stream(
        &self,
        _request: Request<Streaming<HandleStreamRequest>>,
    ) -> Result<Response<Self::HandleStreamStream>, Status> {
        Err(Status::unimplemented("unary only"))
    }

    type HandleMuxStream = Pin<Box<dyn Stream<Item = Result<HandleMuxResponse, Status>> + Send>>;

    async fn handle_mux(
        &self,
        _request: Request<Streaming<HandleMuxRequest>>,
    ) -> Result<Response<Self::HandleMuxStream>, Status> {
        Err(Status::unimplemented("unary only"))
    }
}

/// Serves an [`AckingAgent`] as instance `echo-1` of `echo` (over TLS as `/agent/echo`),
/// registers it, and waits until `routers` can route to it.
async fn echo_agent(
    pki: &Pki,
    registry: &Registry,
    routers: &[&Router],
) -> mpsc::UnboundedReceiver<(String, String)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(
        GrpcServer::new()
            .with_trust(pki.trust("/agent/echo"))
            .add_service(AgentServiceServer::new(AckingAgent { requests: tx }))
            .serve(listener, std::future::pending()),
    );
    common::register(
        registry,
        "echo",
        "echo-1",
        &endpoint,
        &[("echo.say", "1.0.0")],
    );
    for router in routers {
        eventually("the router knows echo-1", || {
            router
                .table()
                .instances()
                .iter()
                .any(|i| i.instance_id == "echo-1")
        })
        .await;
    }
    rx
}

/// A server that is not a router but holds a mesh certificate (`/agent/evil`) and serves
/// `RouterService`, counting the replies it is sent.
#[derive(Clone, Default)]
struct FakeRouter {
    replies: Arc<AtomicUsize>,
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl RouterService for FakeRouter {
    async fn call(&self, _r: Request<CallRequest>) -> Result<Response<CallResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    type CallMuxStream = BoxStream<CallMuxResponse>;

    async fn call_mux(
        &self,
        _r: Request<Streaming<CallMuxRequest>>,
    ) -> Result<Response<Self::CallMuxStream>, Status> {
        Err(Status::unimplemented("fake"))
    }

    type StreamStream = BoxStream<StreamResponse>;

    async fn stream(
        &self,
        _r: Request<Streaming<StreamRequest>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn publish(
        &self,
        _r: Request<PublishRequest>,
    ) -> Result<Response<PublishResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn reply(&self, _r: Request<ReplyRequest>) -> Result<Response<ReplyResponse>, Status> {
        self.replies.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(ReplyResponse { delivered: true }))
    }
}

/// A call from alice (bearer token) to `echo.say` asking for an asynchronous reply, running
/// in the background; the agent's view of it (message id, reply_to) once delivered.
async fn waiting_call(
    pki: &Pki,
    router_url: &str,
    agent: &mut mpsc::UnboundedReceiver<(String, String)>,
) -> (
    tokio::task::JoinHandle<Result<CallResponse, Status>>,
    String,
    String,
) {
    let mut alice = pki.anonymous_client(router_url).await;
    let token = pki.token("alice");
    let call = tokio::spawn(async move {
        let mut request = Request::new(CallRequest {
            message: Some(ReachMessage {
                header: Some(Header {
                    target: Some(header::Target::Capability("echo.say".into())),
                    reply_to: "async".into(),
                    ..Header::default()
                }),
                payload: Some(Payload::text("echo.request", "hi")),
            }),
        });
        request.set_timeout(Duration::from_secs(20));
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        alice.call(request).await.map(Response::into_inner)
    });
    let (message_id, reply_to) = tokio::time::timeout(Duration::from_secs(10), agent.recv())
        .await
        .expect("the call reached the agent")
        .unwrap();
    (call, message_id, reply_to)
}

fn reply(correlation_id: &str, reply_to: &str, text: &str) -> ReplyRequest {
    ReplyRequest {
        message: Some(ReachMessage {
            header: Some(Header {
                correlation_id: correlation_id.into(),
                ..Header::default()
            }),
            payload: Some(Payload::text("echo.reply", text)),
        }),
        reply_to: reply_to.into(),
    }
}

fn with_token(request: ReplyRequest, token: &str) -> Request<ReplyRequest> {
    let mut request = Request::new(request);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

fn assert_not_authorized(status: &Status, action: &str) {
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert_eq!(reason(status), "NOT_AUTHORIZED", "{status:?}");
    let metadata = reach_rpc::errors::metadata_of(status);
    assert_eq!(
        metadata.get("action").map(String::as_str),
        Some(action),
        "{status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_agent_the_call_was_delivered_to_may_reply() {
    let pki = Pki::new();
    let (registry, registry_url) = registry(&pki).await;
    let (router, url) = router(Some(&pki), &registry_url, RouterConfig::default()).await;
    let mut agent = echo_agent(&pki, &registry, &[&router]).await;
    let (call, message_id, reply_to) = waiting_call(&pki, &url, &mut agent).await;
    assert_eq!(reply_to, url, "the router names itself in reply_to");

    // Another agent of the mesh forges the answer: refused.
    let mut mallory = pki.client(&url, "/agent/mallory").await;
    let in_flight = mallory
        .reply(reply(&message_id, &reply_to, "forged"))
        .await
        .unwrap_err();
    assert_not_authorized(&in_flight, "reply to");
    assert_eq!(
        reach_rpc::errors::metadata_of(&in_flight)["identity"],
        "spiffe://reach.test/agent/mallory"
    );
    // ... and is told the same for an id no call waits on: the refusal does not reveal
    // whether a call is in flight.
    let unknown_id = "0190b6a4-0000-7000-8000-000000000000";
    let unknown = mallory
        .reply(reply(unknown_id, &reply_to, "forged"))
        .await
        .unwrap_err();
    assert_not_authorized(&unknown, "reply to");
    assert_eq!(
        unknown.message(),
        in_flight.message().replace(&message_id, unknown_id)
    );

    // A user (bearer token) may not reply either.
    let mut anonymous = pki.anonymous_client(&url).await;
    let status = anonymous
        .reply(with_token(
            reply(&message_id, &reply_to, "forged"),
            &pki.token("alice"),
        ))
        .await
        .unwrap_err();
    assert_not_authorized(&status, "reply to");

    // An agent pretending its reply was forwarded by a router replica: refused.
    let mut echo = pki.client(&url, "/agent/echo").await;
    let mut forged = Request::new(reply(&message_id, &reply_to, "forged"));
    forged
        .metadata_mut()
        .insert(FORWARDED_REPLY_METADATA, "1".parse().unwrap());
    forged.metadata_mut().insert(
        "x-reach-replier",
        "spiffe://reach.test/agent/echo".parse().unwrap(),
    );
    let status = mallory.reply(forged).await.unwrap_err();
    assert_not_authorized(&status, "forward a reply");

    // The agent the call went to answers: delivered, and the caller gets its answer.
    let delivered = echo
        .reply(reply(&message_id, &reply_to, "the answer"))
        .await
        .unwrap()
        .into_inner();
    assert!(delivered.delivered);
    let answer = call.await.unwrap().expect("the call was answered");
    assert_eq!(
        answer.message.unwrap().payload.unwrap().first_text(),
        Some("the answer")
    );
    // Its second answer finds no call waiting (not a refusal).
    let again = echo
        .reply(reply(&message_id, &reply_to, "again"))
        .await
        .unwrap()
        .into_inner();
    assert!(!again.delivered);
    // A forger still learns nothing about the ended call.
    let status = mallory
        .reply(reply(&message_id, &reply_to, "late"))
        .await
        .unwrap_err();
    assert_not_authorized(&status, "reply to");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_are_forwarded_only_to_replicas_proving_the_router_identity() {
    let pki = Pki::new();
    let (registry, registry_url) = registry(&pki).await;
    let (first, first_url) = router(Some(&pki), &registry_url, RouterConfig::default()).await;
    let (second, second_url) = router(Some(&pki), &registry_url, RouterConfig::default()).await;
    let mut agent = echo_agent(&pki, &registry, &[&first, &second]).await;

    // A server with a mesh certificate that is not a router's, serving RouterService.
    let fake = FakeRouter::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake_url = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(
        GrpcServer::new()
            .with_trust(pki.trust("/agent/evil"))
            .add_service(RouterServiceServer::new(fake.clone()))
            .serve(listener, std::future::pending()),
    );

    let (call, message_id, reply_to) = waiting_call(&pki, &first_url, &mut agent).await;
    assert_eq!(reply_to, first_url);
    let mut echo = pki.client(&second_url, "/agent/echo").await;

    // reply_to naming something that is not a router URL: refused before anything is dialed.
    let status = echo
        .reply(reply(
            &message_id,
            "http://169.254.169.254:80/latest/meta-data",
            "x",
        ))
        .await
        .unwrap_err();
    assert_not_authorized(&status, "forward a reply to");
    // reply_to naming a mesh server that is not a router: nothing is sent to it.
    let status = echo
        .reply(reply(&message_id, &fake_url, "x"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(reason(&status), "REPLY_PEER_UNAVAILABLE", "{status:?}");
    assert!(
        status
            .message()
            .contains("did not answer as a router replica"),
        "{status:?}"
    );
    assert_eq!(
        fake.replies.load(Ordering::SeqCst),
        0,
        "a reply reached the fake router"
    );
    assert_eq!(second.reply_peers_cached(), 0);

    // Another agent sending its forged answer to the second replica: forwarded, and refused by
    // the replica holding the call (it knows who the call went to).
    let mut mallory = pki.client(&second_url, "/agent/mallory").await;
    let status = mallory
        .reply(reply(&message_id, &reply_to, "forged"))
        .await
        .unwrap_err();
    assert_not_authorized(&status, "reply to");
    assert_eq!(
        reach_rpc::errors::metadata_of(&status)["identity"],
        "spiffe://reach.test/agent/mallory"
    );

    // The agent's answer through the second replica reaches the call on the first.
    let delivered = echo
        .reply(reply(&message_id, &reply_to, "via the other replica"))
        .await
        .unwrap()
        .into_inner();
    assert!(delivered.delivered);
    let answer = call.await.unwrap().expect("the call was answered");
    assert_eq!(
        answer.message.unwrap().payload.unwrap().first_text(),
        Some("via the other replica")
    );
    assert_eq!(second.reply_peers_cached(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_peers_configured_other_reply_to_values_are_never_dialed() {
    let pki = Pki::new();
    let (registry, registry_url) = registry(&pki).await;
    let (first, first_url) = router(Some(&pki), &registry_url, RouterConfig::default()).await;
    let (second, second_url) = router(
        Some(&pki),
        &registry_url,
        RouterConfig {
            peers: vec![first_url.clone()],
            ..RouterConfig::default()
        },
    )
    .await;
    let mut agent = echo_agent(&pki, &registry, &[&first, &second]).await;
    // A listener that counts the connections made to it.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let listener_url = format!("https://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        while let Ok((_socket, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });

    let (call, message_id, reply_to) = waiting_call(&pki, &first_url, &mut agent).await;
    let mut echo = pki.client(&second_url, "/agent/echo").await;
    let status = echo
        .reply(reply(&message_id, &listener_url, "x"))
        .await
        .unwrap_err();
    assert_not_authorized(&status, "forward a reply to");
    assert!(status.message().contains("router.peers"), "{status:?}");
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        0,
        "the router dialed reply_to"
    );

    let delivered = echo
        .reply(reply(&message_id, &reply_to, "listed"))
        .await
        .unwrap()
        .into_inner();
    assert!(delivered.delivered);
    assert!(call.await.unwrap().is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_reply_to_values_do_not_grow_the_peer_cache() {
    let registry = common::registry().await;
    let (first, first_url) = router(None, &registry.url, RouterConfig::default()).await;
    let (second, second_url) = router(None, &registry.url, RouterConfig::default()).await;
    let _ = first;
    let (_dead, port) = common::dead_endpoint().await;
    let mut client = RouterServiceClient::connect(second_url.clone())
        .await
        .unwrap();
    // 600 distinct reply_to values, each a loopback address where nothing listens.
    for i in 0..600u32 {
        let reply_to = format!("http://127.0.{}.{}:{port}", 1 + i / 250, 1 + i % 250);
        let status = client
            .reply(reply(
                "0190b6a4-0000-7000-8000-000000000001",
                &reply_to,
                "x",
            ))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{reply_to}: {status:?}");
        assert_eq!(reason(&status), "REPLY_PEER_UNAVAILABLE", "{status:?}");
        assert!(second.reply_peers_cached() <= reach_router::MAX_REPLY_PEERS);
    }
    assert_eq!(
        second.reply_peers_cached(),
        0,
        "unreachable replicas are not kept"
    );
    // A real replica is kept once a reply reached it (none waits there: delivered false).
    let answered = client
        .reply(reply(
            "0190b6a4-0000-7000-8000-000000000002",
            &first_url,
            "x",
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(!answered.delivered);
    assert_eq!(second.reply_peers_cached(), 1);
}
