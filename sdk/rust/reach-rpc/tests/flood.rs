//! Slow clients against an admin-like HTTP port (`serve_http` with the admin port's limits,
//! 256 connections and 64 per peer address) on 127.0.0.1: a flood of idle TCP connections, or
//! of TLS connections trickling their request headers, does not keep `GET /health` from
//! answering, whether the flood comes from the prober's own address or from many; and the gRPC
//! port (`GrpcServer` with its default limits, over TLS) answers `grpc.health.v1` through the
//! same flood.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use reach_rpc::ConnectionLimits;
use reach_trust::issue::CertificateAuthority;
use reach_trust::tls::{TlsConfig, TlsSource};
use reach_trust::{Identity, Trust, TrustConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const DAY: Duration = Duration::from_secs(86_400);
const TD: &str = "reach.test";
/// How long `/health` may take to answer under the flood.
const DEADLINE: Duration = Duration::from_secs(3);

/// The admin port's limits (reach-telemetry's `serve_admin`).
fn admin_limits() -> ConnectionLimits {
    ConnectionLimits {
        max_connections: 256,
        max_connections_per_peer: 64,
        ..ConnectionLimits::default()
    }
}

async fn serve(trust: Arc<Trust>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = axum::Router::new().route("/health", axum::routing::get(|| async { "ok" }));
    tokio::spawn(reach_rpc::server::serve_http_with_client_certificates(
        listener,
        router,
        std::future::pending(),
        Duration::from_secs(1),
        admin_limits(),
        reach_rpc::limits::MessageLimits::default(),
        trust,
        reach_rpc::server::ClientCertificates::Optional,
    ));
    addr
}

/// A TCP connection to `addr` from `source` (any port).
async fn connect_from(source: std::net::IpAddr, addr: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(source, 0)).unwrap();
    socket.connect(addr).await.unwrap()
}

/// `GET /health` over HTTP/1.1 on `io`: the status line's code.
async fn get_health<T: AsyncRead + AsyncWrite + Unpin>(mut io: T) -> std::io::Result<u16> {
    io.write_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        .await?;
    let mut answer = Vec::new();
    io.read_to_end(&mut answer).await?;
    let text = String::from_utf8_lossy(&answer);
    text.split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status line in {text:?}")))
}

/// Plaintext `/health` from 127.0.0.1 within [`DEADLINE`].
async fn health(addr: SocketAddr) -> u16 {
    tokio::time::timeout(DEADLINE, async {
        get_health(TcpStream::connect(addr).await?).await
    })
    .await
    .expect("no answer from /health within the deadline")
    .expect("/health failed")
}

#[tokio::test]
async fn health_answers_through_300_idle_connections_from_its_own_address() {
    let addr = serve(Trust::disabled()).await;
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    assert_eq!(health(addr).await, 200);
    // And again: the answer was no lucky gap in the flood.
    assert_eq!(health(addr).await, 200);
}

#[tokio::test]
async fn health_answers_through_300_idle_connections_from_many_addresses() {
    let addr = serve(Trust::disabled()).await;
    let mut idle = Vec::new();
    // 30 connections from each of ten addresses: within the per-peer limit, past the total.
    for peer in 2..12u8 {
        for _ in 0..30 {
            idle.push(connect_from([127, 0, 0, peer].into(), addr).await);
        }
    }
    assert_eq!(health(addr).await, 200);
}

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

#[tokio::test]
async fn health_answers_over_tls_through_256_connections_sending_headers_slowly() {
    let dir = tempfile::tempdir().unwrap();
    let ca = CertificateAuthority::generate(TD, DAY).unwrap();
    let server = write_identity(
        &ca,
        dir.path(),
        "registry",
        &Identity::service(TD, "registry").unwrap(),
    );
    let trust = Trust::load(&TrustConfig {
        trust_domain: TD.into(),
        tls: Some(server),
        ..TrustConfig::default()
    })
    .unwrap();
    let addr = serve(trust).await;
    // A client trusting the CA, without a certificate of its own (as a probe).
    let client = TlsSource::load(
        &TlsConfig {
            cert: None,
            key: None,
            ..TlsConfig::new("", "", dir.path().join("ca.pem"))
        },
        TD,
    )
    .unwrap();
    let handshakes = tokio_rustls::TlsConnector::from(client.client_config());
    let connector = reach_trust::connector::TlsConnector::new(client);
    // 256 connections from four addresses (64 each: every one within its peer's limit, all of
    // them the listener's), each through its handshake and a first header line, then silent.
    let mut slow = Vec::new();
    for peer in 2..6u8 {
        for _ in 0..64 {
            let tcp = connect_from([127, 0, 0, peer].into(), addr).await;
            let name = reach_trust::rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
            let tls = handshakes.connect(name, tcp).await;
            let Ok(mut tls) = tls else {
                // A handshake whose connection was closed to make room for a later one.
                continue;
            };
            let _ = tls.write_all(b"GET /health HTTP/1.1\r\nhost: 12").await;
            let _ = tls.flush().await;
            slow.push(tls);
        }
    }
    let answered = tokio::time::timeout(DEADLINE, async {
        let tls = connector.connect("127.0.0.1", addr.port()).await?;
        get_health(tls)
            .await
            .map_err(|e| reach_trust::connector::ConnectError::Io {
                address: addr.to_string(),
                source: e,
            })
    })
    .await
    .expect("no answer from /health over TLS within the deadline")
    .expect("/health over TLS failed");
    assert_eq!(answered, 200);
}

#[tokio::test]
async fn grpc_health_answers_over_tls_through_300_idle_and_256_slow_connections() {
    let dir = tempfile::tempdir().unwrap();
    let ca = CertificateAuthority::generate(TD, DAY).unwrap();
    let server = write_identity(
        &ca,
        dir.path(),
        "router",
        &Identity::service(TD, "router").unwrap(),
    );
    let client = write_identity(&ca, dir.path(), "agent", &Identity::agent(TD, "a").unwrap());
    let trust = Trust::load(&TrustConfig {
        trust_domain: TD.into(),
        tls: Some(server),
        ..TrustConfig::default()
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // The gRPC port's default limits.
    tokio::spawn(
        reach_rpc::GrpcServer::new()
            .with_trust(trust)
            .serve(listener, std::future::pending()),
    );
    let client = TlsSource::load(&client, TD).unwrap();
    let handshakes = tokio_rustls::TlsConnector::from(client.client_config());
    let mut flood = Vec::new();
    for _ in 0..300 {
        flood.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut slow = Vec::new();
    for _ in 0..256 {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = reach_trust::rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        if let Ok(mut tls) = handshakes.connect(name, tcp).await {
            // Part of the HTTP/2 preface, then nothing.
            let _ = tls.write_all(b"PRI * HTTP/2").await;
            let _ = tls.flush().await;
            slow.push(tls);
        }
    }
    let endpoint = reach_rpc::http2::endpoint(format!("https://{addr}")).unwrap();
    let checked = tokio::time::timeout(DEADLINE, async {
        let channel = reach_rpc::http2::channel(&endpoint, Some(&client), None)
            .await
            .map_err(|e| e.to_string())?;
        tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .map_err(|e| e.to_string())
    })
    .await
    .expect("no gRPC health answer within the deadline");
    assert_eq!(
        checked
            .expect("the health check failed")
            .into_inner()
            .status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}
