//! TLS on a real server on 127.0.0.1 with certificates made in the test: plaintext clients,
//! clients of another CA and clients without a certificate are refused; a client with one is
//! served; replacing the files rotates the certificate for new connections while connections
//! already open keep working.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use reach_rpc::GrpcServer;
use reach_trust::issue::CertificateAuthority;
use reach_trust::rustls::pki_types::CertificateDer;
use reach_trust::rustls::pki_types::pem::PemObject;
use reach_trust::tls::{TlsConfig, TlsSource};
use reach_trust::{Identity, Trust, TrustConfig};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

const DAY: Duration = Duration::from_secs(86_400);
const TD: &str = "reach.test";

fn write_identity(ca: &CertificateAuthority, dir: &Path, name: &str, id: &Identity) -> TlsConfig {
    let issued = ca.issue(id, &[], DAY).unwrap();
    std::fs::write(dir.join(format!("{name}.pem")), issued.cert_pem).unwrap();
    std::fs::write(dir.join(format!("{name}-key.pem")), issued.key_pem).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.cert_pem()).unwrap();
    let mut config = TlsConfig::new(
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}-key.pem")),
        dir.join("ca.pem"),
    );
    config.reload_interval = Duration::from_millis(20);
    config
}

/// Serves an empty GrpcServer (health, reflection) with TLS from `config`.
async fn serve(config: TlsConfig) -> (String, Arc<Trust>) {
    let trust = Trust::load(&TrustConfig {
        trust_domain: TD.into(),
        tls: Some(config),
        ..TrustConfig::default()
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        GrpcServer::new()
            .with_trust(trust.clone())
            .serve(listener, std::future::pending()),
    );
    (url, trust)
}

async fn check(channel: tonic::transport::Channel) -> Result<(), tonic::Status> {
    HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await
        .map(|_| ())
}

fn client_source(config: &TlsConfig) -> Arc<TlsSource> {
    TlsSource::load(config, TD).unwrap()
}

#[tokio::test]
async fn only_clients_with_a_certificate_of_the_ca_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let ca = CertificateAuthority::generate(TD, DAY).unwrap();
    let server = write_identity(
        &ca,
        dir.path(),
        "router",
        &Identity::service(TD, "router").unwrap(),
    );
    let (url, _trust) = serve(server).await;
    let endpoint = reach_rpc::http2::endpoint(url.clone()).unwrap();

    // Plaintext on a TLS port.
    let plaintext = endpoint.connect().await;
    let refused = match plaintext {
        Err(_) => true,
        Ok(channel) => check(channel).await.is_err(),
    };
    assert!(refused, "a plaintext client was served on a TLS port");

    // A certificate of another CA.
    let other_dir = tempfile::tempdir().unwrap();
    let other_ca = CertificateAuthority::generate(TD, DAY).unwrap();
    let impostor = write_identity(
        &other_ca,
        other_dir.path(),
        "agent",
        &Identity::agent(TD, "a").unwrap(),
    );
    let impostor = client_source(&impostor);
    assert!(
        reach_rpc::http2::channel(&endpoint, Some(&impostor), None)
            .await
            .is_err(),
        "a client (and server) of another CA connected"
    );

    // No client certificate, but trusting the CA.
    let anonymous = TlsConfig {
        cert: None,
        key: None,
        ..TlsConfig::new("", "", dir.path().join("ca.pem"))
    };
    let anonymous = client_source(&anonymous);
    let served = match reach_rpc::http2::channel(&endpoint, Some(&anonymous), None).await {
        Err(_) => false,
        Ok(channel) => check(channel).await.is_ok(),
    };
    assert!(!served, "a client without a certificate was served");

    // A certificate of the CA.
    let agent = write_identity(&ca, dir.path(), "agent", &Identity::agent(TD, "a").unwrap());
    let agent = client_source(&agent);
    let channel = reach_rpc::http2::channel(&endpoint, Some(&agent), None)
        .await
        .unwrap();
    check(channel).await.unwrap();

    // Expecting another identity than the server's.
    let wrong = reach_rpc::http2::channel(
        &endpoint,
        Some(&agent),
        Some(Identity::agent(TD, "b").unwrap()),
    )
    .await;
    let error = reach_rpc::errors::chain(&wrong.unwrap_err());
    assert!(
        error.contains("is spiffe://reach.test/router, not spiffe://reach.test/agent/b"),
        "{error}"
    );
}

/// The certificate the server at `url` presents to a new connection.
async fn presented(url: &str, client: &Arc<TlsSource>) -> CertificateDer<'static> {
    let addr = url.trim_start_matches("http://");
    let (host, port) = addr.rsplit_once(':').unwrap();
    let stream = reach_trust::connector::TlsConnector::new(client.clone())
        .connect(host, port.parse().unwrap())
        .await
        .unwrap();
    stream.get_ref().1.peer_certificates().unwrap()[0].clone()
}

#[tokio::test]
async fn replacing_the_files_rotates_the_certificate_without_breaking_open_connections() {
    let dir = tempfile::tempdir().unwrap();
    let ca = CertificateAuthority::generate(TD, DAY).unwrap();
    let router = Identity::service(TD, "router").unwrap();
    let server = write_identity(&ca, dir.path(), "router", &router);
    let (url, trust) = serve(server).await;
    let client_dir = tempfile::tempdir().unwrap();
    let client = write_identity(
        &ca,
        client_dir.path(),
        "agent",
        &Identity::agent(TD, "a").unwrap(),
    );
    let client = client_source(&client);
    let first = presented(&url, &client).await;

    // A connection opened before the rotation.
    let endpoint = reach_rpc::http2::endpoint(url.clone()).unwrap();
    let open = reach_rpc::http2::channel(&endpoint, Some(&client), None)
        .await
        .unwrap();
    check(open.clone()).await.unwrap();

    let mut reloads = trust.tls().unwrap().reloads();
    let rotated = ca.issue(&router, &[], DAY).unwrap();
    // Write the key first, then the certificate: a reload between the two sees a mismatched
    // pair, refuses it and keeps the old one.
    std::fs::write(dir.path().join("router-key.pem"), &rotated.key_pem).unwrap();
    std::fs::write(dir.path().join("router.pem"), &rotated.cert_pem).unwrap();
    let expected = CertificateDer::from_pem_slice(rotated.cert_pem.as_bytes()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            reloads.changed().await.unwrap();
            if presented(&url, &client).await == expected {
                return;
            }
        }
    })
    .await
    .expect("the rotated certificate was not presented within 10 s");
    assert_ne!(first, expected);
    // The connection opened before still works.
    check(open).await.unwrap();
}
