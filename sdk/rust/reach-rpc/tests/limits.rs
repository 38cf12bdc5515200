//! `ConnectionLimits` against a real server on 127.0.0.1: connections that never start
//! speaking are closed, a connection past `max_connections` (or its peer's
//! `max_connections_per_peer`) takes the place of the longest-idle one or, when every one is
//! busy, is closed at once, and partly
//! received messages may pin only their budget of memory. The peers are raw TCP sockets and
//! raw HTTP/2 (the `h2` crate), to send exactly what a misbehaving client would.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use reach_rpc::{ConnectionLimits, GrpcServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const HEALTH_CHECK: &str = "/grpc.health.v1.Health/Check";
const KIB: usize = 1024;

/// Serves an empty `GrpcServer` (health and reflection) with `limits` until the test ends.
async fn serve(limits: ConnectionLimits) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = GrpcServer::new().with_limits(limits);
    tokio::spawn(server.serve(listener, std::future::pending()));
    addr
}

/// Waits until the server closes `tcp` (end of stream or a reset); panics after `within`.
async fn closed_by_server(tcp: &mut TcpStream, within: Duration) {
    let mut buf = [0u8; 1024];
    tokio::time::timeout(within, async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // the server's SETTINGS, for a connection that got that far
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the server kept the connection open for {within:?}"));
}

/// An HTTP/2 connection to `addr`, driven in the background.
async fn h2_connect(addr: SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client.ready().await.unwrap()
}

/// Starts a gRPC call to `path` and sends `data` without ending the request.
fn start_call(
    client: &mut h2::client::SendRequest<Bytes>,
    path: &str,
    data: Vec<u8>,
) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
    start_request(client, path, Some("application/grpc"), data)
}

/// Starts a POST to `path` with `content_type` (none when `None`) and sends `data` without
/// ending the request.
fn start_request(
    client: &mut h2::client::SendRequest<Bytes>,
    path: &str,
    content_type: Option<&str>,
    data: Vec<u8>,
) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
    let mut request = http::Request::post(format!("http://reach.test{path}"));
    if let Some(content_type) = content_type {
        request = request.header("content-type", content_type);
    }
    let request = request.header("te", "trailers").body(()).unwrap();
    let (response, mut send) = client.send_request(request, false).unwrap();
    send.send_data(Bytes::from(data), false).unwrap();
    (response, send)
}

/// Starts a health check whose message declares `declared_kib` KiB and sends `sent_kib` KiB
/// of it, leaving the message (and the request) unfinished.
fn start_partial_call(
    client: &mut h2::client::SendRequest<Bytes>,
    declared_kib: u32,
    sent_kib: usize,
) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
    start_call(
        client,
        HEALTH_CHECK,
        partial_message(declared_kib * 1024, sent_kib * KIB),
    )
}

/// The first `sent` bytes of a gRPC message whose prefix declares `declared` bytes.
fn partial_message(declared: u32, sent: usize) -> Vec<u8> {
    let mut bytes = vec![0];
    bytes.extend_from_slice(&declared.to_be_bytes());
    bytes.resize(5 + sent, 0x20);
    bytes
}

/// The call's status: from a trailers-only response, or from the trailers.
async fn call_status(response: h2::client::ResponseFuture) -> tonic::Status {
    let response = tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .expect("no response within 5 s")
        .unwrap();
    if let Some(status) = tonic::Status::from_header_map(response.headers()) {
        return status;
    }
    let mut body = response.into_body();
    while body.data().await.is_some() {}
    let trailers = body.trailers().await.unwrap().expect("no trailers");
    tonic::Status::from_header_map(&trailers).expect("no grpc-status in the trailers")
}

/// A well-formed, empty `HealthCheckRequest` (service ""), as one whole message.
fn health_check_message() -> Vec<u8> {
    vec![0, 0, 0, 0, 0]
}

fn limits() -> ConnectionLimits {
    ConnectionLimits {
        handshake_timeout: Duration::from_millis(300),
        ..ConnectionLimits::default()
    }
}

#[tokio::test]
async fn a_connection_that_does_not_start_speaking_is_closed_after_the_handshake_timeout() {
    let addr = serve(limits()).await;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut trickling = TcpStream::connect(addr).await.unwrap();
    // Ten bytes of the 24-byte HTTP/2 preface, then nothing.
    trickling.write_all(b"PRI * HTTP").await.unwrap();
    closed_by_server(&mut silent, Duration::from_secs(3)).await;
    closed_by_server(&mut trickling, Duration::from_secs(3)).await;
}

#[tokio::test]
async fn a_connection_that_sent_its_preface_may_stay_idle_past_the_handshake_timeout() {
    let addr = serve(limits()).await;
    let mut client = h2_connect(addr).await;
    let (response, mut send) = start_call(&mut client, HEALTH_CHECK, health_check_message());
    send.send_data(Bytes::new(), true).unwrap();
    assert_eq!(call_status(response).await.code(), tonic::Code::Ok);
    tokio::time::sleep(Duration::from_millis(900)).await;
    // The same connection: had the deadline still been armed, reads would have failed.
    let mut client = client
        .ready()
        .await
        .expect("the idle connection was closed");
    let (response, mut send) = start_call(&mut client, HEALTH_CHECK, health_check_message());
    send.send_data(Bytes::new(), true).unwrap();
    assert_eq!(call_status(response).await.code(), tonic::Code::Ok);
}

#[tokio::test]
async fn connections_past_max_connections_are_closed_at_once_while_all_are_busy_until_one_ends() {
    let addr = serve(ConnectionLimits {
        max_connections: 2,
        ..limits()
    })
    .await;
    // Each connection has a call in progress (its message unfinished), so neither is idle
    // and neither may be closed to make room.
    let mut first = h2_connect(addr).await;
    let _first_call = start_partial_call(&mut first, 1, 0);
    let mut second = h2_connect(addr).await;
    let _second_call = start_partial_call(&mut second, 1, 0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut third = TcpStream::connect(addr).await.unwrap();
    third
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    closed_by_server(&mut third, Duration::from_millis(500)).await;

    // Once one of the two goes away there is room again.
    drop(first);
    drop(_first_call);
    tokio::time::timeout(Duration::from_secs(3), async {
        while health_check_on_a_new_connection(addr).await.is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("no room for a new connection after one closed");
}

#[tokio::test]
async fn at_max_connections_a_new_connection_takes_the_place_of_the_longest_idle_one() {
    let addr = serve(ConnectionLimits {
        max_connections: 2,
        ..limits()
    })
    .await;
    // Two connections that sent their preface and nothing more: idle.
    let mut oldest = TcpStream::connect(addr).await.unwrap();
    oldest
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _newer = h2_connect(addr).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    // A third is served, and the longest-idle one is closed for it.
    assert_eq!(
        tokio::time::timeout(
            Duration::from_secs(3),
            health_check_on_a_new_connection(addr)
        )
        .await
        .expect("no answer within 3 s")
        .expect("the new connection was refused"),
        tonic::Code::Ok
    );
    closed_by_server(&mut oldest, Duration::from_secs(1)).await;
}

#[tokio::test]
async fn at_max_connections_per_peer_a_peer_replaces_only_its_own_idle_connections() {
    let addr = serve(ConnectionLimits {
        max_connections_per_peer: 2,
        ..limits()
    })
    .await;
    // Another peer address (the whole of 127.0.0.0/8 is loopback) holds an idle connection.
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut other = other.connect(addr).await.unwrap();
    other
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    // 127.0.0.1 opens ten idle connections: at most two of them stay open.
    let mut mine = Vec::new();
    for _ in 0..10 {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        mine.push(tcp);
    }
    for tcp in &mut mine[..8] {
        closed_by_server(tcp, Duration::from_secs(1)).await;
    }
    // The other peer's connection was not touched, and 127.0.0.1 still gets answers.
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(Duration::from_millis(300), async {
        loop {
            match other.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // the server's SETTINGS
            }
        }
    })
    .await;
    assert!(closed.is_err(), "the other peer's connection was closed");
    assert_eq!(
        health_check_on_a_new_connection(addr).await.unwrap(),
        tonic::Code::Ok
    );
}

/// One health check on a connection of its own; an error when the connection fails.
async fn health_check_on_a_new_connection(addr: SocketAddr) -> Result<tonic::Code, h2::Error> {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (client, connection) = h2::client::handshake(tcp).await?;
    tokio::spawn(connection);
    let mut client = client.ready().await?;
    let (response, mut send) = start_call(&mut client, HEALTH_CHECK, health_check_message());
    send.send_data(Bytes::new(), true)?;
    let response = response.await?;
    Ok(tonic::Status::from_header_map(response.headers())
        .map_or(tonic::Code::Ok, |status| status.code()))
}

#[tokio::test]
async fn partly_received_messages_may_hold_only_the_connections_budget() {
    let addr = serve(ConnectionLimits {
        max_buffered_bytes_per_connection: 1024 * KIB,
        ..limits()
    })
    .await;
    let mut client = h2_connect(addr).await;
    // 800 KiB of a 900 KiB message: held by the server until the rest comes.
    let (_first, first_send) = start_partial_call(&mut client, 900, 800);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // 300 KiB more on another stream would take the connection past 1 MiB.
    let (second, _second_send) = start_partial_call(&mut client, 900, 300);
    let refused = call_status(second).await;
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("this connection")
            && refused
                .message()
                .contains("server.max_buffered_bytes_per_connection"),
        "the refusal says what was full and which setting governs it: {refused:?}"
    );

    // Whole messages still pass on the same connection.
    let (response, mut send) = start_call(&mut client, HEALTH_CHECK, health_check_message());
    send.send_data(Bytes::new(), true).unwrap();
    assert_eq!(call_status(response).await.code(), tonic::Code::Ok);

    // The first stream's bytes go back when it is abandoned: 300 KiB then fit.
    let mut first_send = first_send;
    first_send.send_reset(h2::Reason::CANCEL);
    let accepted = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            let (response, mut send) = start_partial_call(&mut client, 400, 300);
            send.send_data(Bytes::from(vec![0x20; 100 * KIB]), true)
                .unwrap();
            // The whole message is not a valid HealthCheckRequest; what matters is that it
            // was not refused for its size.
            let status = call_status(response).await;
            if status.code() != tonic::Code::ResourceExhausted {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the abandoned stream's bytes were never given back");
    assert_ne!(accepted.code(), tonic::Code::ResourceExhausted);
}

#[tokio::test]
async fn partly_received_messages_of_all_connections_may_hold_only_the_listeners_budget() {
    let addr = serve(ConnectionLimits {
        max_buffered_bytes_per_connection: 1024 * KIB,
        max_buffered_bytes: 1536 * KIB,
        ..limits()
    })
    .await;
    let mut one = h2_connect(addr).await;
    let (_first, _first_send) = start_partial_call(&mut one, 1000, 900);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Within the second connection's own budget, but not within the listener's.
    let mut two = h2_connect(addr).await;
    let (second, _second_send) = start_partial_call(&mut two, 1000, 700);
    let refused = call_status(second).await;
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("the server"),
        "the refusal names the listener-wide budget: {refused:?}"
    );
}

#[tokio::test]
async fn a_request_that_is_not_grpc_is_refused_unread_and_any_case_of_grpc_is_metered() {
    let addr = serve(ConnectionLimits {
        max_buffered_bytes_per_connection: 1024 * KIB,
        ..limits()
    })
    .await;
    let mut client = h2_connect(addr).await;
    // Without a gRPC content-type a body would not be metered, so it is not read at all:
    // 415, as the gRPC protocol asks of servers.
    for content_type in [None, Some("application/json"), Some("text/plain")] {
        let (response, _send) = start_request(
            &mut client,
            HEALTH_CHECK,
            content_type,
            partial_message(900 * 1024, 800 * KIB),
        );
        let response = tokio::time::timeout(Duration::from_secs(5), response)
            .await
            .expect("no response within 5 s")
            .unwrap();
        assert_eq!(
            response.status(),
            http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "content-type {content_type:?}"
        );
    }
    // Media types are case-insensitive: this is gRPC, served and metered.
    let (_first, _first_send) = start_request(
        &mut client,
        HEALTH_CHECK,
        Some("Application/GRPC"),
        partial_message(900 * 1024, 800 * KIB),
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (second, _second_send) = start_partial_call(&mut client, 900, 300);
    assert_eq!(
        call_status(second).await.code(),
        tonic::Code::ResourceExhausted,
        "the upper-case content-type's message counted against the budget"
    );
}
