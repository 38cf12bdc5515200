//! Calls and streams end the way they really ended, and every message is held to the size
//! limit, on every path: a caller's reset reaches the agent as a reset, an upstream response
//! without a gRPC status reaches the caller as a failure, and typed pass-through checks both
//! directions. The misbehaving peers are raw HTTP/2 (the `h2` crate), so they send exactly
//! the frames under test.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use prost::Message as _;
use reach_proto::v1::{InstanceSpec, Payload, ReachMessage, StreamRequest};
use reach_router::RouterConfig;
use reach_sdk::{AgentRuntime, CallOptions, HandlerContext};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc};

/// The typed service the raw agents below register.
const RAW_SERVICE: &str = "test.v1.Raw";
const RAW_PATH: &str = "/test.v1.Raw/Echo";

/// `message` framed as one gRPC message (flag, 4-byte length, bytes).
fn framed(message: &[u8]) -> Bytes {
    let mut out = vec![0];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    Bytes::from(out)
}

/// An HTTP/2 connection to `addr`, driven in the background.
async fn h2_connect(addr: &str) -> h2::client::SendRequest<Bytes> {
    let addr: SocketAddr = addr.trim_start_matches("http://").parse().unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client.ready().await.unwrap()
}

/// Starts a gRPC request to `path` (the body is left open).
fn start(
    client: &mut h2::client::SendRequest<Bytes>,
    path: &str,
) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://mesh{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    client.send_request(request, false).unwrap()
}

/// How a response ended, as a raw caller sees it: its data, then its `grpc-status` (from the
/// headers of a trailers-only response or from the trailers), or `None` when it ended
/// without one (a clean end with no status, or a reset). `first_data` is told when the first
/// data arrived.
async fn ending(
    response: h2::client::ResponseFuture,
    first_data: &tokio::sync::Notify,
) -> (Vec<u8>, Option<i32>) {
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("response headers within 10 s")
        .unwrap();
    let status_of = |headers: &http::HeaderMap| {
        headers
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    };
    if let Some(code) = status_of(response.headers()) {
        return (Vec::new(), Some(code));
    }
    let mut body = response.into_body();
    let mut data = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), body.data()).await {
            Err(_) => panic!("the response neither ended nor sent data within 10 s"),
            Ok(Some(Ok(chunk))) => {
                let _ = body.flow_control().release_capacity(chunk.len());
                data.extend_from_slice(&chunk);
                first_data.notify_one();
            }
            Ok(Some(Err(_))) => return (data, None),
            Ok(None) => break,
        }
    }
    let trailers = tokio::time::timeout(Duration::from_secs(10), body.trailers())
        .await
        .expect("trailers within 10 s");
    (data, trailers.ok().flatten().and_then(|t| status_of(&t)))
}

/// How a raw agent answers `RAW_PATH`.
#[derive(Debug, Clone, Copy)]
enum Answer {
    /// One message, then END_STREAM on that DATA frame: no trailers, no status.
    DataEndStream,
    /// Reads the request to its end, sends one message, then (once the caller has it)
    /// RST_STREAM(NO_ERROR).
    ResetNoError,
    /// One message, then (once the caller has it) the connection closes.
    DropConnection,
    /// A message of this many bytes, with an OK status.
    Message(usize),
    /// Reads the request to its end and answers OK with one empty message.
    Ok,
    /// Reads the request to its end and fails it with a trailers-only response: one HEADERS
    /// frame with END_STREAM carrying [`trailers_only_failure`].
    TrailersOnly,
}

/// The headers of [`Answer::TrailersOnly`]: FAILED_PRECONDITION with a message,
/// `grpc-status-details-bin` and a custom entry.
fn trailers_only_failure() -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "application/grpc".parse().unwrap());
    headers.insert("grpc-status", "9".parse().unwrap());
    headers.insert("grpc-message", "not%20now".parse().unwrap());
    headers.insert(
        "grpc-status-details-bin",
        "CAkSB25vdCBub3c".parse().unwrap(),
    );
    headers.insert("x-agent-reason", "quota".parse().unwrap());
    headers
}

/// Serves `answer` for every request on 127.0.0.1:0 (a raw HTTP/2 server standing in for an
/// agent's typed service) and registers it as instance `id` serving [`RAW_SERVICE`]. `go`
/// tells a `ResetNoError` or `DropConnection` answer to go on after its message.
async fn raw_agent(
    registry: &TestRegistry,
    id: &str,
    service: &str,
    answer: Answer,
    go: Arc<Notify>,
) {
    let spec = InstanceSpec {
        service: service.replace('.', "-"),
        instance_id: id.into(),
        endpoint: raw_server(answer, go).await,
        grpc_services: vec![service.into()],
        protocol_version: "1.0".into(),
        weight: 1,
        ..InstanceSpec::default()
    };
    registry
        .registry
        .register(spec, Some(Duration::from_secs(60)))
        .expect("registration");
}

/// The raw HTTP/2 server of [`raw_agent`], answering `answer` on every path but
/// `HandleMux`, which it does not serve (UNIMPLEMENTED, so a router sends envelope calls as
/// unary `Handle`s); returns its endpoint.
async fn raw_server(answer: Answer, go: Arc<Notify>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let go = go.clone();
            tokio::spawn(async move {
                let mut connection = h2::server::handshake(tcp).await.unwrap();
                let (close, mut closed) = mpsc::channel::<()>(1);
                loop {
                    let (request, respond) = tokio::select! {
                        next = connection.accept() => match next {
                            Some(Ok(next)) => next,
                            _ => return,
                        },
                        // Drops the connection: the socket closes.
                        _ = closed.recv() => return,
                    };
                    tokio::spawn(answer_one(
                        request,
                        respond,
                        answer,
                        go.clone(),
                        close.clone(),
                    ));
                }
            });
        }
    });
    endpoint
}

async fn answer_one(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    answer: Answer,
    go: Arc<Notify>,
    close: mpsc::Sender<()>,
) {
    if request.uri().path().ends_with("/HandleMux") {
        let unimplemented = http::Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", "12")
            .body(())
            .unwrap();
        let _ = respond.send_response(unimplemented, true);
        return;
    }
    let mut body = request.into_body();
    // A reset after a complete request is the server's word that it is done (RFC 9113 §8.1);
    // before it, it would also cut the request short.
    if matches!(
        answer,
        Answer::Ok | Answer::ResetNoError | Answer::TrailersOnly
    ) {
        while let Some(chunk) = body.data().await {
            match chunk {
                Ok(chunk) => {
                    let _ = body.flow_control().release_capacity(chunk.len());
                }
                Err(_) => return,
            }
        }
    }
    if matches!(answer, Answer::TrailersOnly) {
        let mut response = http::Response::new(());
        *response.headers_mut() = trailers_only_failure();
        let _ = respond.send_response(response, true);
        return;
    }
    let response = http::Response::builder()
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    let Ok(mut send) = respond.send_response(response, false) else {
        return;
    };
    let ok = || {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        trailers
    };
    let message = framed(b"");
    let _ = match answer {
        Answer::DataEndStream => send.send_data(message, true),
        Answer::ResetNoError => {
            let _ = send.send_data(message, false);
            go.notified().await;
            send.send_reset(h2::Reason::NO_ERROR);
            Ok(())
        }
        Answer::DropConnection => {
            let _ = send.send_data(message, false);
            go.notified().await;
            let _ = close.send(()).await;
            Ok(())
        }
        Answer::Message(size) => {
            let _ = send.send_data(framed(&vec![b'x'; size]), false);
            send.send_trailers(ok())
        }
        Answer::Ok => {
            let _ = send.send_data(message, false);
            send.send_trailers(ok())
        }
        Answer::TrailersOnly => unreachable!("answered above"),
    };
}

async fn mesh_with_raw_agent(
    answer: Answer,
    config: RouterConfig,
) -> (TestRegistry, TestRouter, Arc<Notify>) {
    mesh_with_raw_service(RAW_SERVICE, answer, config).await
}

/// [`mesh_with_raw_agent`] with the agent serving `service`.
async fn mesh_with_raw_service(
    service: &str,
    answer: Answer,
    config: RouterConfig,
) -> (TestRegistry, TestRouter, Arc<Notify>) {
    let registry = registry().await;
    let go = Arc::new(Notify::new());
    raw_agent(&registry, "raw-1", service, answer, go.clone()).await;
    let router = router(&registry.url, config).await;
    router.wait_routable(1).await;
    (registry, router, go)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_through_response_without_a_status_reaches_the_caller_as_a_failure() {
    for (answer, expected) in [
        (Answer::DataEndStream, tonic::Code::Internal),
        (Answer::ResetNoError, tonic::Code::Internal),
        (Answer::DropConnection, tonic::Code::Unavailable),
    ] {
        let (_registry, router, go) = mesh_with_raw_agent(answer, RouterConfig::default()).await;
        let mut client = h2_connect(&router.url).await;
        let (response, mut send) = start(&mut client, RAW_PATH);
        send.send_data(framed(b""), true).unwrap();
        let (data, status) = ending(response, &go).await;
        assert_eq!(
            data,
            framed(b""),
            "{answer:?}: the instance's message arrives"
        );
        assert_eq!(
            status,
            Some(expected as i32),
            "{answer:?}: the caller gets a status saying what happened, not a clean end"
        );
    }
}

/// A typed call the agent fails with a trailers-only response (one HEADERS frame with
/// END_STREAM) reaches the caller the same way: code, message, `grpc-status-details-bin` and
/// custom metadata unchanged, and END_STREAM on the headers — grpcio reads a status in
/// headers followed by an empty DATA frame as "Stream removed" (UNKNOWN).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trailers_only_failure_passes_through_as_trailers_only() {
    let (_registry, router, _go) =
        mesh_with_raw_agent(Answer::TrailersOnly, RouterConfig::default()).await;
    let mut client = h2_connect(&router.url).await;
    let (response, mut send) = start(&mut client, RAW_PATH);
    send.send_data(framed(b"hi"), true).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("response headers within 10 s")
        .unwrap();
    let expected = trailers_only_failure();
    for name in [
        "grpc-status",
        "grpc-message",
        "grpc-status-details-bin",
        "x-agent-reason",
    ] {
        assert_eq!(
            response.headers().get(name),
            expected.get(name),
            "{name} arrives unchanged"
        );
    }
    assert!(
        response.body().is_end_stream(),
        "the headers carry END_STREAM (a trailers-only response), not a body to follow"
    );
}

/// The envelope paths (a Call sent as a unary `Handle`, a routed Stream) end as pass-through
/// does when the instance's response carries no gRPC status: INTERNAL naming the missing
/// status (UNAVAILABLE / `INSTANCE_LOST` for a lost connection), never a clean end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envelope_response_without_a_status_reaches_the_caller_as_a_failure() {
    use tonic::Code::{Internal, Unavailable};
    // A reset right after the message may overtake it (h2 drops what it had not yet written
    // when a stream is reset), and hyper reports a reset of an unfinished response as a
    // broken stream: the router then says the instance was lost. Either is a failure.
    for (answer, endings) in [
        (Answer::DataEndStream, &[(Internal, "")][..]),
        (
            Answer::ResetNoError,
            &[(Internal, ""), (Unavailable, "INSTANCE_LOST")][..],
        ),
        (
            Answer::DropConnection,
            &[(Unavailable, "INSTANCE_LOST")][..],
        ),
    ] {
        let registry = registry().await;
        let go = Arc::new(Notify::new());
        // No caller sees the instance's message before the response ends: let it go on at once.
        go.notify_one();
        let endpoint = raw_server(answer, go.clone()).await;
        register_capability(&registry, "raw-envelope", "raw.work", endpoint);
        let router = router(&registry.url, RouterConfig::default()).await;
        router.wait_routable(1).await;
        let client = router.client().await;

        let status = client
            .call("raw.work", Payload::text("t", "x"), CallOptions::default())
            .await
            .expect_err("a response without a status is no success");
        assert!(
            endings.contains(&(status.code(), reason(&status).as_str())),
            "{answer:?}: Call ended {status:?}, expected one of {endings:?}"
        );
        if matches!(answer, Answer::DataEndStream) {
            assert!(
                status.message().contains("ended without a gRPC status")
                    && status.message().contains("raw-envelope"),
                "the caller learns what was missing, and from which instance: {status:?}"
            );
        }

        go.notify_one();
        let mut stream = h2_connect(&router.url).await;
        let (response, mut send) = start(&mut stream, "/reach.v1.RouterService/Stream");
        let mut message = client.message_to_capability(
            "raw.work",
            Payload::text("t", "x"),
            &CallOptions::default(),
        );
        if let Some(header) = message.header.as_mut() {
            header.trace_id.clear();
        }
        send.send_data(
            framed(
                &StreamRequest {
                    message: Some(message),
                }
                .encode_to_vec(),
            ),
            true,
        )
        .unwrap();
        let (_, code) = ending(response, &Notify::new()).await;
        assert!(
            endings
                .iter()
                .any(|(expected, _)| code == Some(*expected as i32)),
            "{answer:?}: Stream ended with status {code:?}, expected one of {endings:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_through_messages_over_the_limit_are_refused_both_ways() {
    let limit = 16 * 1024;
    let config = RouterConfig {
        passthrough_max_message_bytes: Some(limit),
        ..RouterConfig::default()
    };
    // The instance's reply is over the limit.
    let (_registry, router, _) =
        mesh_with_raw_agent(Answer::Message(limit + 1), config.clone()).await;
    let channel = tonic::transport::Endpoint::from_shared(router.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let status = raw_call(channel.clone(), 10).await.unwrap_err();
    assert_payload_too_large(&status, limit);

    // The caller's message is over the limit (2.5 ×).
    let (_registry, router, _) = mesh_with_raw_agent(Answer::Ok, config).await;
    let channel = tonic::transport::Endpoint::from_shared(router.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let status = raw_call(channel.clone(), limit * 5 / 2).await.unwrap_err();
    assert_payload_too_large(&status, limit);
    raw_call(channel, 10).await.expect("a small message passes");
}

fn assert_payload_too_large(status: &tonic::Status, limit: usize) {
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(reason(status), "PAYLOAD_TOO_LARGE", "{status:?}");
    let meta = reach_rpc::errors::metadata_of(status);
    assert_eq!(meta["limit_bytes"], limit.to_string(), "{status:?}");
    assert!(
        meta["size_bytes"].parse::<usize>().unwrap() > limit,
        "{status:?}"
    );
}

/// Calls `RAW_PATH` with a message of `size` bytes (a `bytes` field), decoding the reply as
/// any bytes.
async fn raw_call(
    channel: tonic::transport::Channel,
    size: usize,
) -> Result<prost::bytes::Bytes, tonic::Status> {
    raw_call_to(channel, RAW_PATH, size).await
}

/// [`raw_call`] to `path`.
async fn raw_call_to(
    channel: tonic::transport::Channel,
    path: &'static str,
    size: usize,
) -> Result<prost::bytes::Bytes, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let request = reach_proto::v1::part::Content::Raw(Bytes::from(vec![0u8; size]));
    let part = reach_proto::v1::Part {
        content: Some(request),
        ..Default::default()
    };
    grpc.unary(
        tonic::Request::new(part),
        http::uri::PathAndQuery::from_static(path),
        tonic_prost::ProstCodec::<reach_proto::v1::Part, reach_proto::v1::Part>::default(),
    )
    .await
    .map(|r| r.into_inner().encode_to_vec().into())
}

/// How an agent's inbound stream ended.
#[derive(Debug, PartialEq, Eq)]
enum InboundEnd {
    /// A clean end (the caller half-closed), after this many messages.
    Clean(usize),
    /// An error, after this many messages.
    Failed(usize),
}

/// A `talk` stream agent that reports, on `ended`, how each inbound stream ended. The
/// inbound stream is read by a task of its own, so it is followed to its end even when the
/// stream's replies are dropped (a reset ends both directions).
fn recording_agent(registry: &str, ended: mpsc::UnboundedSender<InboundEnd>) -> AgentRuntime {
    AgentRuntime::new(config("talk", "talk-1", registry)).handle_stream(
        "talk",
        "1.0.0",
        move |_c: HandlerContext,
              _first: ReachMessage,
              rest: reach_sdk::handler::InboundMessages| {
            use futures::StreamExt;
            let ended = ended.clone();
            let (done_tx, done) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                let mut rest = rest;
                let mut seen = 1;
                let end = loop {
                    match rest.next().await {
                        Some(Ok(_)) => seen += 1,
                        Some(Err(_)) => break InboundEnd::Failed(seen),
                        None => break InboundEnd::Clean(seen),
                    }
                };
                let _ = ended.send(end);
                let _ = done_tx.send(());
            });
            futures::stream::once(async move {
                let _ = done.await;
                Ok(Payload::text("done", "bye"))
            })
        },
    )
}

/// One `StreamRequest` to capability `talk`, framed.
fn talk(client: &reach_sdk::MeshClient, text: &str) -> Bytes {
    let mut message =
        client.message_to_capability("talk", Payload::text("t", text), &CallOptions::default());
    // Later messages of a stream take the stream's trace id.
    if let Some(header) = message.header.as_mut() {
        header.trace_id.clear();
    }
    framed(
        &StreamRequest {
            message: Some(message),
        }
        .encode_to_vec(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_resets_its_stream_is_a_reset_for_the_agent_not_an_end_of_input() {
    let registry = registry().await;
    let (ended_tx, mut ended) = mpsc::unbounded_channel();
    let (_agent, _) = agent(recording_agent(&registry.url, ended_tx)).await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let mesh = router.client().await;
    let talk = |text: &str| talk(&mesh, text);

    // A caller that sends two messages and half-closes: a clean end after two.
    let mut client = h2_connect(&router.url).await;
    let (response, mut send) = start(&mut client, "/reach.v1.RouterService/Stream");
    send.send_data(talk("one"), false).unwrap();
    send.send_data(talk("two"), true).unwrap();
    let end = tokio::time::timeout(Duration::from_secs(10), ended.recv())
        .await
        .unwrap();
    assert_eq!(end, Some(InboundEnd::Clean(2)));
    drop(response);

    // A caller that sends two messages and resets its stream (it gave up part-way).
    let (response, mut send) = start(&mut client, "/reach.v1.RouterService/Stream");
    send.send_data(talk("one"), false).unwrap();
    send.send_data(talk("two"), false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .unwrap()
        .unwrap();
    send.send_reset(h2::Reason::CANCEL);
    let end = tokio::time::timeout(Duration::from_secs(10), ended.recv())
        .await
        .unwrap();
    assert_eq!(
        end,
        Some(InboundEnd::Failed(2)),
        "the agent must not take a reset stream for a complete one"
    );
    drop(response);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_stream_message_over_the_limit_ends_the_stream_with_payload_too_large() {
    let registry = registry().await;
    let runtime = AgentRuntime::new(config("talk", "talk-1", &registry.url)).handle_stream(
        "talk",
        "1.0.0",
        |_c: HandlerContext, _first: ReachMessage, _rest: reach_sdk::handler::InboundMessages| {
            futures::stream::iter([
                Ok(Payload::text("t", "small")),
                Ok(Payload::text("t", "x".repeat(8 * 1024))),
            ])
        },
    );
    let (_agent, _) = agent(runtime).await;
    let config = RouterConfig {
        max_message_bytes: 4096,
        ..RouterConfig::default()
    };
    let router = router(&registry.url, config).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let first =
        client.message_to_capability("talk", Payload::text("t", "hi"), &CallOptions::default());
    let mut replies = client
        .stream(
            first,
            futures::stream::pending(),
            Some(Duration::from_secs(10)),
        )
        .await
        .unwrap();
    let small = replies.message().await.unwrap().unwrap();
    assert_eq!(
        small.message.unwrap().payload.unwrap().first_text(),
        Some("small")
    );
    let status = replies.message().await.unwrap_err();
    assert_payload_too_large(&status, 4096);
}

/// The process's metrics recorder (installed once per test binary).
fn metrics() -> &'static reach_telemetry::metrics::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<reach_telemetry::metrics::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE.get_or_init(|| reach_telemetry::metrics::install().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_caller_abandons_the_request_part_way_is_counted_cancelled() {
    let metrics = metrics();
    let registry = registry().await;
    let router = router(&registry.url, RouterConfig::default()).await;
    let cancelled = || {
        metric(
            &metrics.render(),
            "reach_router_requests_total",
            &[("capability", "(unrouted)"), ("code", "CANCELLED")],
        )
    };
    let before = cancelled();
    let mesh = router.client().await;
    let mut client = h2_connect(&router.url).await;
    let (response, mut send) = start(&mut client, "/reach.v1.RouterService/Call");
    // Half of a message's bytes, then the caller gives up.
    let whole = talk(&mesh, "part");
    send.send_data(whole.slice(..whole.len() / 2), false)
        .unwrap();
    send.send_reset(h2::Reason::CANCEL);
    drop(response);
    eventually("the abandoned call is counted as CANCELLED", || {
        cancelled() > before
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_through_calls_are_counted_like_envelope_calls() {
    let metrics = metrics();
    // A service of its own: the metrics are the process's, other tests run alongside.
    const SERVICE: &str = "test.v1.Counted";
    const PATH: &str = "/test.v1.Counted/Echo";
    let (_registry, router, go) =
        mesh_with_raw_service(SERVICE, Answer::Ok, RouterConfig::default()).await;
    let requests = |code: &str| {
        metric(
            &metrics.render(),
            "reach_router_requests_total",
            &[("capability", SERVICE), ("code", code)],
        )
    };
    let latencies = || {
        metric(
            &metrics.render(),
            "reach_router_instance_duration_seconds_count",
            &[("service", "test-v1-Counted"), ("instance", "raw-1")],
        )
    };
    let (ok_before, internal_before, latencies_before) =
        (requests("OK"), requests("INTERNAL"), latencies());
    let channel = tonic::transport::Endpoint::from_shared(router.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    for _ in 0..3 {
        raw_call_to(channel.clone(), PATH, 10).await.unwrap();
    }
    assert_eq!(requests("OK") - ok_before, 3.0);
    assert_eq!(latencies() - latencies_before, 3.0);
    assert_eq!(requests("INTERNAL"), internal_before);

    // A response without a status is counted with the status the caller got.
    let (_registry, router, _) =
        mesh_with_raw_service(SERVICE, Answer::DataEndStream, RouterConfig::default()).await;
    let mut client = h2_connect(&router.url).await;
    let (response, mut send) = start(&mut client, PATH);
    send.send_data(framed(b""), true).unwrap();
    let (_, status) = ending(response, &go).await;
    assert_eq!(status, Some(tonic::Code::Internal as i32));
    assert_eq!(requests("INTERNAL") - internal_before, 1.0);
}

/// Registers instance `id` of capability `capability` at a raw HTTP/2 server that refuses
/// every stream unprocessed (RST_STREAM(REFUSED_STREAM), RFC 9113 §8.7), as a server going
/// away does; returns how many streams it refused.
async fn refusing_instance(
    registry: &TestRegistry,
    id: &str,
    capability: &str,
) -> Arc<std::sync::atomic::AtomicUsize> {
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let counter = refused.clone();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let counter = counter.clone();
            tokio::spawn(async move {
                let Ok(mut connection) = h2::server::handshake(tcp).await else {
                    return;
                };
                while let Some(Ok((_, mut respond))) = connection.accept().await {
                    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                }
            });
        }
    });
    register_capability(registry, id, capability, endpoint);
    refused
}

/// Registers instance `id` at `endpoint` serving `capability` 1.0.0 (a raw server's).
fn register_capability(registry: &TestRegistry, id: &str, capability: &str, endpoint: String) {
    let spec = InstanceSpec {
        service: capability.split('.').next().unwrap_or(capability).into(),
        instance_id: id.into(),
        endpoint,
        capabilities: vec![reach_proto::v1::Capability {
            name: capability.into(),
            version: "1.0.0".into(),
            ..Default::default()
        }],
        protocol_version: "1.0".into(),
        weight: 1,
        ..InstanceSpec::default()
    };
    registry
        .registry
        .register(spec, Some(Duration::from_secs(60)))
        .expect("registration");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_an_instance_refused_unprocessed_goes_to_another_instance() {
    let registry = registry().await;
    let refused = refusing_instance(&registry, "work-refusing", "work").await;
    let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = served.clone();
    // Much slower than a refusal (even the first, which opens the connection), so p2c peak-EWMA
    // (lower latency wins; a peak fades within `rtt_decay`) keeps picking the refusing instance.
    let serving = AgentRuntime::new(config("work", "work-serving", &registry.url)).handle(
        "work",
        "1.0.0",
        move |_: HandlerContext, message: ReachMessage| {
            let counter = counter.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(25)).await;
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(message.payload.unwrap_or_default())
            }
        },
    );
    let (_serving, _) = agent(serving).await;
    let config = RouterConfig {
        rtt_decay: Duration::from_millis(100),
        ..RouterConfig::default()
    };
    let router = router(&registry.url, config).await;
    router.wait_routable(2).await;
    let client = router.client().await;
    // Not idempotent: only a refusal that provably ran nothing may be sent again.
    let mut calls = 0;
    while refused.load(std::sync::atomic::Ordering::SeqCst) < 3 {
        calls += 1;
        assert!(
            calls <= 200,
            "the refusing instance was picked {} times",
            refused.load(std::sync::atomic::Ordering::SeqCst)
        );
        client
            .call("work", Payload::text("t", "x"), CallOptions::default())
            .await
            .unwrap_or_else(|status| panic!("call {calls} failed: {status:?}"));
    }
    assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), calls);
}
