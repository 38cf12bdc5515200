//! Shutdown is bounded by the grace period whatever the peers do: idle connections, silent
//! peers (connected, never a byte), endless streams and clients that stopped reading (the
//! server's writes block) — against `serve_http` and `GrpcServer` on 127.0.0.1.
//!
//! Real time, with bounds that cannot flake: a 200 ms grace, and `serve` must return within
//! 3 s more.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const GRACE: Duration = Duration::from_millis(200);
const SLACK: Duration = Duration::from_secs(3);

/// A chunk of an endless response body.
const CHUNK: usize = 64 * 1024;

/// A `serve_http` server on 127.0.0.1:0 with [`GRACE`] whose `/endless` answers a body that
/// never ends. Returns its address, the trigger of its shutdown and the serve task.
async fn serve_endless() -> (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let routes = axum::Router::new()
        .route(
            "/endless",
            axum::routing::get(|| async {
                let chunks = futures::stream::repeat_with(|| {
                    Ok::<_, Infallible>(Bytes::from(vec![b'x'; CHUNK]))
                });
                axum::body::Body::from_stream(chunks)
            }),
        )
        .route("/ok", axum::routing::get(|| async { "ok" }));
    let task = tokio::spawn(reach_rpc::server::serve_http(
        listener,
        routes,
        async move {
            let _ = stopped.await;
        },
        GRACE,
        reach_rpc::ConnectionLimits::default(),
    ));
    (addr, stop, task)
}

/// Triggers shutdown and asserts the serve task returns within [`GRACE`] + [`SLACK`].
async fn assert_bounded<T: std::fmt::Debug>(
    what: &str,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<T>,
) {
    let began = Instant::now();
    stop.send(()).unwrap();
    let served = tokio::time::timeout(GRACE + SLACK, task).await;
    assert!(
        served.is_ok(),
        "{what}: serve did not return within {:?} of shutdown (grace {GRACE:?})",
        GRACE + SLACK
    );
    served.unwrap().unwrap();
    let took = began.elapsed();
    assert!(took < GRACE + SLACK, "{what}: shutdown took {took:?}");
}

/// An HTTP/2 connection to `addr`, driven in the background.
async fn h2_client(addr: SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client.ready().await.unwrap()
}

fn get(path: &str) -> http::Request<()> {
    http::Request::get(format!("http://localhost{path}"))
        .body(())
        .unwrap()
}

#[tokio::test]
async fn idle_connections_do_not_hold_shutdown() {
    let (addr, stop, task) = serve_endless().await;
    // An HTTP/2 connection that made one call and stays open, idle.
    let mut h2 = h2_client(addr).await;
    let (response, _) = h2.send_request(get("/ok"), true).unwrap();
    let mut body = response.await.unwrap().into_body();
    while let Some(chunk) = body.data().await {
        chunk.unwrap();
    }
    // An HTTP/1.1 keep-alive connection, idle after its request.
    let mut http1 = TcpStream::connect(addr).await.unwrap();
    http1
        .write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = [0u8; 256];
    let read = tokio::io::AsyncReadExt::read(&mut http1, &mut answer)
        .await
        .unwrap();
    assert!(answer[..read].starts_with(b"HTTP/1.1 200"));
    assert_bounded("idle connections", stop, task).await;
    drop((h2, http1));
}

#[tokio::test]
async fn silent_peers_do_not_hold_shutdown() {
    let (addr, stop, task) = serve_endless().await;
    // Connected, never a byte: the handshake timeout (10 s by default) has not run out.
    let silent: Vec<TcpStream> =
        futures::future::join_all((0..4).map(|_| TcpStream::connect(addr)))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    // One that started the HTTP/2 preface and stopped halfway.
    let mut half = TcpStream::connect(addr).await.unwrap();
    half.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    assert_bounded("silent peers", stop, task).await;
    drop((silent, half));
}

#[tokio::test]
async fn an_endless_stream_is_cut_at_the_grace_period() {
    let (addr, stop, task) = serve_endless().await;
    let mut h2 = h2_client(addr).await;
    let (response, _) = h2.send_request(get("/endless"), true).unwrap();
    let mut body = response.await.unwrap().into_body();
    // Read (and release) as fast as the server sends, so only the grace period can end it.
    let reader = tokio::spawn(async move {
        let mut read = 0usize;
        while let Some(Ok(chunk)) = body.data().await {
            read += chunk.len();
            let _ = body.flow_control().release_capacity(chunk.len());
        }
        read
    });
    let began = Instant::now();
    assert_bounded("an endless stream", stop, task).await;
    assert!(
        began.elapsed() >= GRACE,
        "the stream was cut before the grace period"
    );
    let read = tokio::time::timeout(SLACK, reader)
        .await
        .expect("the stream did not end when its connection was closed")
        .unwrap();
    assert!(read > CHUNK, "the stream was flowing: {read} bytes");
}

#[tokio::test]
async fn a_client_that_stopped_reading_does_not_hold_shutdown() {
    let (addr, stop, task) = serve_endless().await;
    // HTTP/2: the response never gets flow-control credit past the first window, so the
    // server's writes wait for credit forever.
    let mut h2 = h2_client(addr).await;
    let (response, _) = h2.send_request(get("/endless"), true).unwrap();
    let _unread = response.await.unwrap();
    // HTTP/1.1: nothing is read, so the socket buffers fill and the server's writes block.
    let mut http1 = TcpStream::connect(addr).await.unwrap();
    http1
        .write_all(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert_bounded("clients that stopped reading", stop, task).await;
    drop((h2, http1));
}

#[tokio::test]
async fn grpc_server_takes_its_grace_from_the_server_settings() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    // `[server] shutdown_grace`, not the 10 s default.
    let limits = reach_rpc::ConnectionLimits {
        shutdown_grace: GRACE,
        ..reach_rpc::ConnectionLimits::default()
    };
    let task = tokio::spawn(reach_rpc::GrpcServer::new().with_limits(limits).serve(
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    let channel = reach_rpc::http2::endpoint(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    // A stream the server never ends by itself.
    let mut watch = HealthClient::new(channel)
        .watch(HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    watch.message().await.unwrap().unwrap();
    let began = Instant::now();
    stop.send(()).unwrap();
    let served = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("serve did not return within 5 s: the 10 s default grace was used");
    served.unwrap().unwrap();
    assert!(began.elapsed() >= GRACE);
}
