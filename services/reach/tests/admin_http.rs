//! The admin port's operator routes with trust on, served over TLS on 127.0.0.1 and called
//! with an operator's client certificate (which a browser holding it presents by itself): a
//! change from another site's page (`Origin`, `Sec-Fetch-Site`) and a request by a name that
//! is not the port's (`Host`: DNS rebinding) are refused 403, while the same requests from a
//! client of the port's own origin (curl, `reach`) reach the route; `/health` answers by any
//! name; names in `admin.allowed_hosts` are answered.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use reach_trust::issue::CertificateAuthority;
use reach_trust::tls::{TlsConfig, TlsSource};
use reach_trust::{Identity, Trust, TrustConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DAY: Duration = Duration::from_secs(86_400);
const TD: &str = "reach.test";

fn write_identity(ca: &CertificateAuthority, dir: &Path, name: &str, id: &Identity) -> TlsConfig {
    let issued = ca.issue(id, &[], DAY).unwrap();
    std::fs::write(dir.join(format!("{name}.pem")), issued.cert_pem).unwrap();
    std::fs::write(dir.join(format!("{name}-key.pem")), issued.key_pem).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.cert_pem()).unwrap();
    TlsConfig::new(
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}-key.pem")),
        dir.join("ca.pem"),
    )
}

struct Admin {
    addr: SocketAddr,
    operator: reach_trust::connector::TlsConnector,
    _dir: tempfile::TempDir,
}

impl Admin {
    /// Serves the admin routes (no registry behind them) with trust on, answering
    /// `allowed_hosts` besides loopback names.
    async fn start(allowed_hosts: &[String]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = CertificateAuthority::generate(TD, DAY).unwrap();
        let server = write_identity(
            &ca,
            dir.path(),
            "registry",
            &Identity::service(TD, "registry").unwrap(),
        );
        let operator = write_identity(
            &ca,
            dir.path(),
            "operator",
            &Identity::operator(TD, "admin").unwrap(),
        );
        let policy = dir.path().join("policy.yaml");
        std::fs::write(
            &policy,
            format!("operators: [\"spiffe://{TD}/operator/admin\"]\n"),
        )
        .unwrap();
        let trust = Trust::load(&TrustConfig {
            trust_domain: TD.into(),
            tls: Some(server),
            policy: Some(policy),
            ..TrustConfig::default()
        })
        .unwrap();
        let metrics = match reach_telemetry::metrics::install() {
            Ok(handle) => handle,
            Err(e) => panic!("install metrics: {e}"),
        };
        let routes = reach::admin::routes_for(
            metrics,
            tokio::sync::watch::channel(true).1,
            None,
            trust.clone(),
            allowed_hosts,
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(reach_telemetry::serve_admin_with_trust(
            listener,
            routes,
            std::future::pending(),
            Duration::from_secs(1),
            trust,
        ));
        let operator =
            reach_trust::connector::TlsConnector::new(TlsSource::load(&operator, TD).unwrap());
        Self {
            addr,
            operator,
            _dir: dir,
        }
    }

    /// Sends `head` (request line and headers, CRLF-terminated) as the operator over
    /// HTTP/1.1; answers the status and the body.
    async fn send(&self, head: &str) -> (u16, String) {
        let mut tls = self
            .operator
            .connect("127.0.0.1", self.addr.port())
            .await
            .unwrap();
        tls.write_all(format!("{head}content-length: 0\r\nconnection: close\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut answer))
            .await
            .expect("no answer within 5 s")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let status = answer.split(' ').nth(1).unwrap().parse().unwrap();
        let body = answer
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_string())
            .unwrap_or_default();
        (status, body)
    }
}

// One test: the metrics recorder is installed once per process.
#[tokio::test]
async fn with_trust_on_operator_routes_answer_only_their_hosts_and_their_own_origin() {
    let admin = Admin::start(&["reach-registry.reach.svc".to_string()]).await;
    // From another site's page: refused before the route.
    let (status, body) = admin
        .send("DELETE /agents/echo HTTP/1.1\r\nhost: 127.0.0.1\r\norigin: https://evil.example\r\n")
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("Origin"), "{body}");
    let (status, body) = admin
        .send("DELETE /agents/echo HTTP/1.1\r\nhost: 127.0.0.1\r\nsec-fetch-site: cross-site\r\n")
        .await;
    assert_eq!(status, 403, "{body}");
    // By a rebound name: refused, reads too.
    let (status, body) = admin
        .send("GET /agents HTTP/1.1\r\nhost: evil.example\r\n")
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("evil.example"), "{body}");
    // The port's own origin, and clients that send no Origin, reach the route (which says
    // this process runs no registry: the operator was let through).
    for head in [
        "DELETE /agents/echo HTTP/1.1\r\nhost: 127.0.0.1\r\norigin: https://127.0.0.1\r\n",
        "DELETE /agents/echo HTTP/1.1\r\nhost: 127.0.0.1\r\n",
        "GET /agents HTTP/1.1\r\nhost: reach-registry.reach.svc:7071\r\n",
    ] {
        let (status, body) = admin.send(head).await;
        assert_eq!(status, 404, "{head}: {body}");
        assert!(body.contains("runs no registry"), "{head}: {body}");
    }
    // Probes name the pod's IP: /health answers by any name.
    let (status, body) = admin
        .send("GET /health HTTP/1.1\r\nhost: 10.1.2.3:7071\r\n")
        .await;
    assert_eq!(status, 200, "{body}");
}
