//! `GrpcServer`'s shutdown contract against a real connection on 127.0.0.1: stop accepting,
//! leave open calls their grace period, then close what is still open and return.
//! (In-flight calls finishing while an instance drains are tested in `tests/tests/routing.rs`.)

use std::time::{Duration, Instant};

use reach_rpc::GrpcServer;
use tonic::server::NamedService;
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

/// A service that answers nothing (UNIMPLEMENTED): a name for the health service to report.
#[derive(Clone)]
struct Gated;

impl NamedService for Gated {
    const NAME: &'static str = "test.v1.GatedService";
}

impl tower::Service<http::Request<tonic::body::Body>> for Gated {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _request: http::Request<tonic::body::Body>) -> Self::Future {
        std::future::ready(Ok(tonic::Status::unimplemented("nothing here").into_http()))
    }
}

/// Waits (at most 5 s) until `readiness` holds `expected`.
async fn readiness_becomes(readiness: &mut tokio::sync::watch::Receiver<bool>, expected: bool) {
    tokio::time::timeout(
        Duration::from_secs(5),
        readiness.wait_for(|ready| *ready == expected),
    )
    .await
    .unwrap_or_else(|_| panic!("readiness did not become {expected} within 5 s"))
    .expect("the server keeps its readiness sender while it serves");
}

#[tokio::test]
async fn readiness_says_what_the_health_service_says_until_shutdown() {
    let (serving, condition) = tokio::sync::watch::channel(true);
    let server = GrpcServer::new()
        .add_service(Gated)
        .serving_while(Gated::NAME, condition);
    let mut readiness = server.readiness();
    assert!(!*readiness.borrow(), "not ready before it serves");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.serve(listener, async move {
        let _ = stopped.await;
    }));
    let channel = reach_rpc::http2::endpoint(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let mut status = async |service: &str| {
        health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status()
    };

    readiness_becomes(&mut readiness, true).await;
    assert_eq!(status(Gated::NAME).await, ServingStatus::Serving);
    // The service's flag drops: NOT_SERVING over gRPC, not ready; and back.
    serving.send_replace(false);
    readiness_becomes(&mut readiness, false).await;
    assert_eq!(status(Gated::NAME).await, ServingStatus::NotServing);
    assert_eq!(
        status("").await,
        ServingStatus::Serving,
        "the server itself serves"
    );
    serving.send_replace(true);
    readiness_becomes(&mut readiness, true).await;
    assert_eq!(status(Gated::NAME).await, ServingStatus::Serving);

    // Shutdown turns every status NOT_SERVING, and readiness with them.
    stop.send(()).unwrap();
    readiness_becomes(&mut readiness, false).await;
    tokio::time::timeout(Duration::from_secs(15), task)
        .await
        .expect("serve returns after its grace period")
        .unwrap()
        .unwrap();
}
