//! The console served over TLS by Reach's HTTP server on 127.0.0.1 (as the admin port serves
//! it with trust on): the login cookie is `Secure` whether the browser speaks HTTP/1.1 (whose
//! requests name no scheme) or HTTP/2, so a browser never sends the token over plain HTTP;
//! over plain HTTP it is not (a browser would drop a `Secure` cookie set there).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use reach_console::{Console, ConsoleChannels, ConsoleConfig};
use reach_trust::issue::CertificateAuthority;
use reach_trust::tls::{TlsConfig, TlsSource};
use reach_trust::{Identity, Trust, TrustConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const DAY: Duration = Duration::from_secs(86_400);
const TD: &str = "reach.test";

fn write_identity(ca: &CertificateAuthority, dir: &Path) -> TlsConfig {
    let issued = ca
        .issue(&Identity::service(TD, "orchestrator").unwrap(), &[], DAY)
        .unwrap();
    std::fs::write(dir.join("server.pem"), issued.cert_pem).unwrap();
    std::fs::write(dir.join("server-key.pem"), issued.key_pem).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.cert_pem()).unwrap();
    TlsConfig::new(
        dir.join("server.pem"),
        dir.join("server-key.pem"),
        dir.join("ca.pem"),
    )
}

/// Serves a console that asks for logins (and calls no service, so any token logs in) on
/// 127.0.0.1:0 with `trust`.
async fn serve(trust: std::sync::Arc<Trust>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let routes = Console::new(
        ConsoleChannels::default(),
        ConsoleConfig {
            login: true,
            ..ConsoleConfig::default()
        },
    )
    .routes();
    tokio::spawn(reach_rpc::server::serve_http_with_client_certificates(
        listener,
        routes,
        std::future::pending(),
        Duration::from_secs(1),
        reach_rpc::ConnectionLimits::default(),
        reach_rpc::limits::MessageLimits::default(),
        trust,
        reach_rpc::server::ClientCertificates::Optional,
    ));
    addr
}

/// Posts a login over HTTP/1.1 on `io`; answers the `Set-Cookie` header's value.
async fn login<T: AsyncRead + AsyncWrite + Unpin>(mut io: T) -> String {
    let body = "next=%2Fconsole%2Finbox&token=eyJ.token";
    let request = format!(
        "POST /console/login HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/x-www-form-urlencoded\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    io.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), io.read_to_end(&mut answer))
        .await
        .expect("no answer within 5 s")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(answer.starts_with("HTTP/1.1 303"), "{answer}");
    answer
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("set-cookie")
                .then(|| value.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no Set-Cookie in {answer}"))
}

fn attributes(cookie: &str) -> Vec<String> {
    cookie
        .split(';')
        .map(|a| a.trim().to_ascii_lowercase())
        .collect()
}

#[tokio::test]
async fn over_tls_on_http1_the_login_cookie_is_secure() {
    let dir = tempfile::tempdir().unwrap();
    let ca = CertificateAuthority::generate(TD, DAY).unwrap();
    let trust = Trust::load(&TrustConfig {
        trust_domain: TD.into(),
        tls: Some(write_identity(&ca, dir.path())),
        ..TrustConfig::default()
    })
    .unwrap();
    let addr = serve(trust).await;
    let browser = TlsSource::load(
        &TlsConfig {
            cert: None,
            key: None,
            ..TlsConfig::new("", "", dir.path().join("ca.pem"))
        },
        TD,
    )
    .unwrap();
    let tls = reach_trust::connector::TlsConnector::new(browser)
        .connect("127.0.0.1", addr.port())
        .await
        .unwrap();
    let cookie = login(tls).await;
    let attributes = attributes(&cookie);
    for expected in ["secure", "httponly", "samesite=strict", "path=/console"] {
        assert!(
            attributes.iter().any(|a| a == expected),
            "{expected} missing: {cookie}"
        );
    }
}

#[tokio::test]
async fn over_plain_http_the_login_cookie_is_not_secure() {
    let addr = serve(Trust::disabled()).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let cookie = login(tcp).await;
    assert!(
        !attributes(&cookie).iter().any(|a| a == "secure"),
        "{cookie}"
    );
}
