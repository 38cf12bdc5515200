//! `RecordMessages` with trust on, over real TLS on 127.0.0.1: only router replicas may write
//! the message ledger; an agent's certificate or a user's bearer token is refused
//! PERMISSION_DENIED / NOT_AUTHORIZED and nothing it sent is stored.

use std::path::PathBuf;
use std::time::Duration;

use reach_orchestrator::{Orchestrator, OrchestratorConfig};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_trust::issue::{CertificateAuthority, token_signing_key};
use reach_trust::tls::{ClientAuth, TlsConfig, TlsSource};
use reach_trust::token::{JwtConfig, claims, sign};
use reach_trust::{Identity, Trust, TrustConfig};
use tonic::Code;
use tonic::transport::Channel;

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

    /// Certificate files for `path` (`/router`), client certificates optional.
    fn tls(&self, path: &str) -> TlsConfig {
        let name = path.trim_start_matches('/').replace('/', "-");
        let issued = self
            .ca
            .issue(&Identity::new(TD, path).unwrap(), &[], DAY)
            .unwrap();
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

    /// A client presenting the certificate of `path`, or none.
    async fn client(&self, url: &str, path: Option<&str>) -> OrchestratorServiceClient<Channel> {
        let tls = match path {
            Some(path) => self.tls(path),
            None => TlsConfig {
                cert: None,
                key: None,
                ..TlsConfig::new("", "", self.path("ca.pem"))
            },
        };
        let tls = TlsSource::load(&tls, TD).unwrap();
        let channel =
            reach_rpc::http2::channel(&reach_rpc::http2::endpoint(url).unwrap(), Some(&tls), None)
                .await
                .unwrap();
        OrchestratorServiceClient::new(channel)
    }

    fn token(&self, subject: &str) -> String {
        let claims = claims(subject, "reach", None, Duration::from_secs(600));
        sign(self.signing_key.as_bytes(), &claims.into()).unwrap()
    }
}

fn batch(task_id: &str, message_id: &str) -> pb::RecordMessagesRequest {
    pb::RecordMessagesRequest {
        entries: vec![pb::LedgerEntry {
            header: Some(pb::Header {
                task_id: task_id.into(),
                message_id: message_id.into(),
                ..pb::Header::default()
            }),
            payload_type: "forged".into(),
            recorded_by: "router".into(),
            ..pb::LedgerEntry::default()
        }],
        dropped: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_router_identities_record_ledger_entries() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let trust = Trust::load(&TrustConfig {
        trust_domain: TD.into(),
        tls: Some(pki.tls("/orchestrator")),
        jwt: Some(JwtConfig::new(vec![pki.path("jwt-public.pem")])),
        ..TrustConfig::default()
    })
    .unwrap();
    let config = OrchestratorConfig {
        store_url: format!("sqlite://{}/o.db", dir.path().display()),
        ..OrchestratorConfig::default()
    };
    let orchestrator = std::sync::Arc::new(
        Orchestrator::with_trust(config, trust.clone())
            .await
            .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(
        reach_rpc::GrpcServer::new()
            .with_trust(trust)
            .add_service(orchestrator.grpc_service())
            .serve(listener, std::future::pending()),
    );
    let store = orchestrator.engine().store();

    // An agent plants an entry in a task's ledger: refused, nothing stored.
    let mut agent = pki.client(&url, Some("/agent/echo")).await;
    let status = agent
        .record_messages(batch("task-1", "forged-by-agent"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert_eq!(
        reach_rpc::errors::reason_of(&status).as_deref(),
        Some("NOT_AUTHORIZED")
    );
    let metadata = reach_rpc::errors::metadata_of(&status);
    assert_eq!(metadata["identity"], "spiffe://reach.test/agent/echo");
    assert!(
        status.message().contains("only router replicas"),
        "{status:?}"
    );

    // A user with a verified bearer token: refused too.
    let mut user = pki.client(&url, None).await;
    let mut request = tonic::Request::new(batch("task-1", "forged-by-user"));
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", pki.token("alice")).parse().unwrap(),
    );
    let status = user.record_messages(request).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert_eq!(
        reach_rpc::errors::reason_of(&status).as_deref(),
        Some("NOT_AUTHORIZED")
    );
    assert!(store.ledger("task-1").await.unwrap().is_empty());

    // The router records.
    let mut router = pki.client(&url, Some("/router")).await;
    let accepted = router
        .record_messages(batch("task-1", "routed"))
        .await
        .unwrap()
        .into_inner()
        .accepted;
    assert_eq!(accepted, 1);
    assert_eq!(store.ledger("task-1").await.unwrap().len(), 1);
}
