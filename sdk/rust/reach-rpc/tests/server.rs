//! `GrpcServer`'s shutdown contract against a real connection on 127.0.0.1: stop accepting,
//! leave open calls their grace period, then close what is still open and return.
//! (In-flight calls finishing while an instance drains are tested in `tests/tests/routing.rs`.)

use std::time::{Duration, Instant};

use reach_rpc::GrpcServer;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Serves an empty `GrpcServer` (health and reflection only) with `grace`; returns its URL,
/// the trigger of its shutdown and the serve task.
async fn serve(
    grace: Duration,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), reach_rpc::server::ServeError>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = GrpcServer::new().with_grace(grace);
    let task = tokio::spawn(server.serve(listener, async move {
        let _ = stopped.await;
    }));
    (url, stop, task)
}

#[tokio::test]
async fn a_stream_still_open_after_the_grace_period_is_closed_and_serve_returns() {
    let grace = Duration::from_millis(300);
    let (url, stop, task) = serve(grace).await;
    let channel = reach_rpc::http2::endpoint(url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    // Health.Watch is a stream the server never ends by itself.
    let mut watch = HealthClient::new(channel)
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);

    let began = Instant::now();
    stop.send(()).unwrap();
    // The server's overall status turns NOT_SERVING at once (probes ask "" by default); then,
    // by the grace period, the stream breaks (or ends) and `serve` returns Ok.
    let mut statuses = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(update)) = watch.message().await {
            statuses.push(update.status);
        }
    })
    .await;
    assert_eq!(
        statuses,
        [ServingStatus::NotServing as i32],
        "the watch saw the server stop serving"
    );
    assert!(
        ended.is_ok(),
        "the open stream was not closed within 5 s of shutdown (grace {grace:?})"
    );
    let served = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("serve did not return after its grace period");
    served.unwrap().unwrap();
    assert!(
        began.elapsed() >= grace,
        "the stream was cut before the grace period ({:?} < {grace:?})",
        began.elapsed()
    );

    // Nothing listens any more.
    let refused = reach_rpc::http2::endpoint(url).unwrap().connect().await;
    assert!(refused.is_err(), "a connection was accepted after shutdown");
}

#[tokio::test]
async fn a_request_that_never_finishes_does_not_hold_shutdown_past_the_grace_period() {
    use tokio::io::AsyncWriteExt;
    let grace = Duration::from_millis(300);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let routes = axum::Router::new().route("/metrics", axum::routing::get(|| async { "ok" }));
    let task = tokio::spawn(reach_rpc::server::serve_http(
        listener,
        routes,
        async move {
            let _ = stopped.await;
        },
        grace,
        reach_rpc::ConnectionLimits::default(),
    ));
    // Half an HTTP/1.1 request (the headers never end), as an admin port may see.
    let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.send(()).unwrap();
    tokio::time::timeout(grace + Duration::from_secs(3), task)
        .await
        .expect("serve waited on a request that never finishes")
        .unwrap();
    drop(half);
}
