//! Attacks on the HTTP ports of the mesh (the registry's admin port, the orchestrator's admin
//! port with the console):
//! - slow clients: 300 idle TCP connections from ten addresses, then 256 TLS connections
//!   trickling their request headers, and `GET /health` must still answer 200 (before the
//!   per-peer limit and the eviction of idle connections, the port's 256 connections were
//!   full and `/health` went unanswered);
//! - operator routes from a browser: with an operator's client certificate (which a browser
//!   presents by itself), a change posted from another site's page (`Origin`) and a read by
//!   a rebound name (`Host`) are refused 403 (before, trust on skipped the console's guard);
//! - the console's login cookie over HTTPS on HTTP/1.1 is `Secure` (before, only HTTP/2
//!   requests, which name the scheme, got it).

use std::net::SocketAddr;
use std::time::Duration;

use reach_trust::tls::TlsSource;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::Check;
use crate::mesh::{TD, TrustedMesh};

/// How long `/health` may take to answer under a flood.
const HEALTH_DEADLINE: Duration = Duration::from_secs(5);

/// Runs this module's attacks against `mesh`, adding one [`Check`] per attack.
pub async fn run(mesh: &TrustedMesh, checks: &mut Vec<Check>) {
    for (name, url) in [
        ("registry", &mesh.registry_admin_url),
        ("orchestrator", &mesh.orchestrator_admin_url),
    ] {
        checks.push(Check::new(
            format!(
                "{name} admin port: 300 idle connections and 256 slow-header TLS connections, then GET /health"
            ),
            slow_clients_then_health(mesh, url).await,
        ));
    }
    checks.push(Check::new(
        "registry admin: an operator's DELETE /agents/{service} posted from another site (Origin) is refused 403",
        expect_refused(
            mesh,
            &mesh.registry_admin_url,
            "DELETE /agents/no-such-service HTTP/1.1\r\nhost: 127.0.0.1\r\norigin: https://evil.example\r\ncontent-length: 0\r\n",
            "Origin",
        )
        .await,
    ));
    checks.push(Check::new(
        "orchestrator admin: an operator's POST /tasks/{id}/retry from a cross-site page (Sec-Fetch-Site) is refused 403",
        expect_refused(
            mesh,
            &mesh.orchestrator_admin_url,
            "POST /tasks/no-such-task/retry HTTP/1.1\r\nhost: 127.0.0.1\r\nsec-fetch-site: cross-site\r\ncontent-length: 0\r\n",
            "Sec-Fetch-Site",
        )
        .await,
    ));
    checks.push(Check::new(
        "registry admin: an operator's GET /agents by a rebound name (Host evil.example) is refused 403",
        expect_refused(
            mesh,
            &mesh.registry_admin_url,
            "GET /agents HTTP/1.1\r\nhost: evil.example\r\n",
            "host",
        )
        .await,
    ));
    checks.push(Check::new(
        "console over HTTPS on HTTP/1.1: the login cookie is Secure",
        console_cookie_is_secure(mesh).await,
    ));
}

/// The `127.0.0.1:PORT` of an `https://127.0.0.1:PORT` URL.
fn address(url: &str) -> SocketAddr {
    url.trim_start_matches("https://")
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|e| panic!("{url}: {e}"))
}

/// A TLS connector trusting the mesh's CA, presenting certificate `name` (or none).
fn connector(mesh: &TrustedMesh, name: Option<&str>) -> reach_trust::connector::TlsConnector {
    let tls = TlsSource::load(&mesh.tls_config(name), TD).expect("load TLS files");
    reach_trust::connector::TlsConnector::new(tls).with_timeout(Duration::from_secs(5))
}

/// Sends `head` (request line and headers, each ending in CRLF; `connection: close` is added)
/// and `body` on `io`; answers the status code and the whole response as text.
async fn exchange<T: AsyncRead + AsyncWrite + Unpin>(
    mut io: T,
    head: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let request = format!("{head}connection: close\r\n\r\n{body}");
    io.write_all(request.as_bytes())
        .await
        .map_err(|e| format!("sending the request: {e}"))?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), io.read_to_end(&mut answer))
        .await
        .map_err(|_| "no whole response within 10 s".to_string())?
        .map_err(|e| format!("reading the response: {e}"))?;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("no status line in {text:?}"))?;
    Ok((status, text))
}

/// One HTTPS request to `url` presenting certificate `name` (or none).
async fn https(
    mesh: &TrustedMesh,
    url: &str,
    name: Option<&str>,
    head: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let addr = address(url);
    let tls = connector(mesh, name)
        .connect("127.0.0.1", addr.port())
        .await
        .map_err(|e| e.to_string())?;
    exchange(tls, head, body).await
}

async fn slow_clients_then_health(mesh: &TrustedMesh, url: &str) -> Result<(), String> {
    let addr = address(url);
    // 300 idle TCP connections, 30 from each of 127.0.0.2 to 127.0.0.11 (all loopback): each
    // address within its own limit, together past the port's 256.
    let mut flood = Vec::new();
    for peer in 2..12u8 {
        for _ in 0..30 {
            let socket = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
            socket
                .bind(SocketAddr::from(([127, 0, 0, peer], 0)))
                .map_err(|e| format!("bind 127.0.0.{peer}: {e}"))?;
            if let Ok(tcp) = socket.connect(addr).await {
                flood.push(tcp);
            }
        }
    }
    // 256 TLS connections from 127.0.0.1 (the prober's own address), each through its
    // handshake and the first bytes of a request, then silent.
    let slow_connector = connector(mesh, None);
    let mut slow = Vec::new();
    for _ in 0..256 {
        // One whose handshake was cut to make room for a later one is part of the attack too.
        if let Ok(mut tls) = slow_connector.connect("127.0.0.1", addr.port()).await {
            let _ = tls.write_all(b"GET /health HTTP/1.1\r\nhost: 12").await;
            let _ = tls.flush().await;
            slow.push(tls);
        }
    }
    // The probe: no client certificate, as Kubernetes' HTTPS probe.
    let probe = tokio::time::timeout(
        HEALTH_DEADLINE,
        https(
            mesh,
            url,
            None,
            "GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n",
            "",
        ),
    )
    .await;
    drop((flood, slow));
    match probe {
        Err(_) => Err(format!(
            "GET /health gave no answer within {HEALTH_DEADLINE:?} under the flood"
        )),
        Ok(Err(e)) => Err(format!("GET /health failed under the flood: {e}")),
        Ok(Ok((200, _))) => Ok(()),
        Ok(Ok((status, text))) => Err(format!(
            "GET /health answered {status} under the flood: {text}"
        )),
    }
}

/// Sends `head` as the operator (its client certificate) to `url`: `Ok` when it is refused
/// 403 by the Host/Origin guard (the refusal naming `names`).
async fn expect_refused(
    mesh: &TrustedMesh,
    url: &str,
    head: &str,
    names: &str,
) -> Result<(), String> {
    let (status, text) = https(mesh, url, Some("operator-admin"), head, "").await?;
    if status == 403 && text.contains(names) {
        Ok(())
    } else {
        Err(format!(
            "answered {status} (expected 403 naming {names:?}): {}",
            text.lines().last().unwrap_or_default()
        ))
    }
}

async fn console_cookie_is_secure(mesh: &TrustedMesh) -> Result<(), String> {
    let token = mesh.token(&format!("spiffe://{TD}/operator/admin"));
    let body = format!("next=%2Fconsole%2Finbox&token={token}");
    let head = format!(
        "POST /console/login HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/x-www-form-urlencoded\r\ncontent-length: {}\r\n",
        body.len()
    );
    let (status, text) = https(mesh, &mesh.orchestrator_admin_url, None, &head, &body).await?;
    let cookie = text
        .lines()
        .find(|line| line.to_ascii_lowercase().starts_with("set-cookie:"))
        .ok_or_else(|| format!("the login answered {status} without a cookie: {text}"))?;
    let attributes: Vec<String> = cookie
        .split(';')
        .map(|a| a.trim().to_ascii_lowercase())
        .collect();
    if attributes.iter().any(|a| a == "secure") {
        Ok(())
    } else {
        Err(format!("the login cookie is not Secure: {cookie}"))
    }
}
