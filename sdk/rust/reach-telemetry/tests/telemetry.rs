//! End-to-end tests of the observability layer with real tonic services on 127.0.0.1 and the
//! real Python OTLP receiver (`tests/otlp_receiver.py`, run with `<repo>/.venv/bin/python`;
//! create the venv with `scripts/python-env.sh`).

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use reach_proto::v1::HandleRequest;
use reach_proto::v1::agent_service_client::AgentServiceClient;
use reach_rpc::trace::TraceId;
use reach_telemetry::TelemetryConfig;
use serde_json::Value;
use support::{Agent, Capture, Receiver};
use tracing::Instrument;

const SPAN_KIND_SERVER: i64 = 2;
const SPAN_KIND_CLIENT: i64 = 3;

fn config(receiver_endpoint: &str, extra: &[(&str, &str)]) -> TelemetryConfig {
    let mut vars = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver_endpoint),
        ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test"),
        ("REACH_LOG_FORMAT", "json"),
        ("REACH_LOG", "warn,reach=info,telemetry=info"),
    ];
    vars.extend_from_slice(extra);
    TelemetryConfig::from_vars("reach-test", vars).unwrap()
}

fn in_trace<'a>(spans: &'a [Value], trace_id: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["trace_id"] == trace_id).collect()
}

/// The field `name` of a JSON log line, looked up in its own fields, its current span and
/// every enclosing span.
fn log_field(line: &Value, name: &str) -> Vec<String> {
    let mut found = Vec::new();
    if let Some(v) = line.get(name).and_then(Value::as_str) {
        found.push(v.to_string());
    }
    if let Some(v) = line["span"].get(name).and_then(Value::as_str) {
        found.push(v.to_string());
    }
    for span in line["spans"].as_array().into_iter().flatten() {
        if let Some(v) = span.get(name).and_then(Value::as_str) {
            found.push(v.to_string());
        }
    }
    found
}

#[tokio::test]
async fn a_task_across_two_agents_is_one_linked_trace_and_its_logs_carry_the_trace_id() {
    let receiver = Receiver::start(false);
    let logs = Capture::default();
    let (dispatch, guard) =
        reach_telemetry::dispatch(&config(&receiver.endpoint(), &[]), logs.clone()).unwrap();
    let _default = tracing::dispatcher::set_default(&dispatch);

    let b = support::serve(Agent {
        name: "b",
        next: None,
    })
    .await;
    let a = support::serve(Agent {
        name: "a",
        next: Some(support::client(b.addr).await),
    })
    .await;
    let mut client_a = support::client(a.addr).await;

    // The edge: a root span whose trace id becomes the envelope's trace id.
    let edge = tracing::info_span!("test.edge");
    let (trace_id, reply) = async {
        let trace_id = reach_telemetry::current_trace_id().expect("the edge span has a trace id");
        let reply = client_a
            .handle(HandleRequest {
                message: Some(support::message(&trace_id.to_string(), "task-1")),
            })
            .await
            .unwrap()
            .into_inner();
        (trace_id.to_string(), reply)
    }
    .instrument(edge)
    .await;
    assert_eq!(reply.message.unwrap().header.unwrap().trace_id, trace_id);

    // A message that names a trace but arrives without traceparent (as from a client that
    // only fills the envelope): its handling joins the envelope's trace.
    let adopted = TraceId::random().to_string();
    let mut plain = AgentServiceClient::new(support::channel(b.addr).await);
    let reply = plain
        .handle(HandleRequest {
            message: Some(support::message(&adopted, "task-2")),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.message.unwrap().header.unwrap().trace_id, adopted);

    // A failing call: the status reaches the client and the spans record it.
    let (failed, status) = async {
        let failed = reach_telemetry::current_trace_id().unwrap().to_string();
        let mut message = support::message(&failed, "task-3");
        message.payload.as_mut().unwrap().r#type = "echo.fail".to_string();
        let status = client_a
            .handle(HandleRequest {
                message: Some(message),
            })
            .await
            .unwrap_err();
        (failed, status)
    }
    .instrument(tracing::info_span!("test.edge.fail"))
    .await;
    assert_eq!(status.code(), tonic::Code::Unavailable);

    guard.flush().await.unwrap();
    let spans = receiver
        .wait_for(|spans| {
            in_trace(spans, &trace_id).len() >= 7
                && !in_trace(spans, &adopted).is_empty()
                && in_trace(spans, &failed).len() >= 5
        })
        .await;
    let failed_spans = in_trace(&spans, &failed);
    assert_eq!(failed_spans.len(), 5, "{failed_spans:#?}");
    for span in &failed_spans {
        const STATUS_CODE_ERROR: i64 = 2;
        if span["name"] == "reach.v1.AgentService/Handle" || span["name"] == "agent.handle" {
            assert_eq!(span["status_code"], STATUS_CODE_ERROR, "{span:#}");
            assert_eq!(span["attributes"]["rpc.grpc.status_code"], 14, "{span:#}");
        }
    }

    // One trace: edge -> client A -> server A -> agent.handle A -> client B -> server B ->
    // agent.handle B, every parent present.
    let trace = in_trace(&spans, &trace_id);
    let by_id: HashMap<&str, &Value> = trace
        .iter()
        .map(|s| (s["span_id"].as_str().unwrap(), *s))
        .collect();
    let roots: Vec<_> = trace.iter().filter(|s| s["parent_span_id"] == "").collect();
    assert_eq!(roots.len(), 1, "one root: {trace:#?}");
    assert_eq!(roots[0]["name"], "test.edge");
    let deepest = trace
        .iter()
        .filter(|s| s["name"] == "agent.handle")
        .max_by_key(|s| {
            let mut depth = 0;
            let mut at = **s;
            while let Some(parent) = by_id.get(at["parent_span_id"].as_str().unwrap()) {
                depth += 1;
                at = parent;
            }
            depth
        })
        .unwrap();
    let mut chain = Vec::new();
    let mut at = *deepest;
    loop {
        chain.push((
            at["name"].as_str().unwrap().to_string(),
            at["kind"].as_i64().unwrap(),
        ));
        match by_id.get(at["parent_span_id"].as_str().unwrap()) {
            Some(parent) => at = parent,
            None => {
                assert_eq!(at["parent_span_id"], "", "a parent is missing: {trace:#?}");
                break;
            }
        }
    }
    chain.reverse();
    let handle = "reach.v1.AgentService/Handle".to_string();
    assert_eq!(
        chain,
        vec![
            ("test.edge".to_string(), 1),
            (handle.clone(), SPAN_KIND_CLIENT),
            (handle.clone(), SPAN_KIND_SERVER),
            ("agent.handle".to_string(), 1),
            (handle.clone(), SPAN_KIND_CLIENT),
            (handle.clone(), SPAN_KIND_SERVER),
            ("agent.handle".to_string(), 1),
        ]
    );

    // Attributes.
    for span in &trace {
        assert_eq!(span["service.name"], "reach-test");
        assert_eq!(span["resource"]["deployment.environment"], "test");
        if span["name"] == handle.as_str() {
            let attrs = &span["attributes"];
            assert_eq!(attrs["rpc.system"], "grpc");
            assert_eq!(attrs["rpc.service"], "reach.v1.AgentService");
            assert_eq!(attrs["rpc.method"], "Handle");
            assert_eq!(attrs["rpc.grpc.status_code"], 0, "{span:#?}");
            assert_eq!(attrs["trace_id"], trace_id.as_str());
        }
        if span["name"] == "agent.handle" {
            let attrs = &span["attributes"];
            assert_eq!(attrs["task_id"], "task-1");
            assert_eq!(attrs["trace_id"], trace_id.as_str());
            assert_eq!(attrs["message.type"], "echo.request");
            assert_eq!(attrs["capability"], "echo");
            assert_eq!(attrs["source"], "test.edge");
        }
    }
    let adopted_spans = in_trace(&spans, &adopted);
    assert!(
        adopted_spans
            .iter()
            .any(|s| s["name"] == "agent.handle" && s["attributes"]["task_id"] == "task-2"),
        "{adopted_spans:#?}"
    );

    // Logs: every line emitted inside a message's handling carries its trace and task ids.
    let lines: Vec<Value> = logs
        .lines()
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    let handled: Vec<&Value> = lines
        .iter()
        .filter(|l| {
            l["message"] == "handling message"
                || l["message"] == "inner step"
                || l["message"] == "refusing message"
        })
        .collect();
    assert_eq!(handled.len(), 9, "{lines:#?}");
    for line in handled {
        let trace_ids = log_field(line, "trace_id");
        let task_ids = log_field(line, "task_id");
        let (want_trace, want_task) = if task_ids.iter().any(|t| t == "task-2") {
            (&adopted, "task-2")
        } else if task_ids.iter().any(|t| t == "task-3") {
            (&failed, "task-3")
        } else {
            (&trace_id, "task-1")
        };
        assert!(!trace_ids.is_empty(), "no trace_id in {line}");
        assert!(trace_ids.iter().all(|t| t == want_trace), "{line}");
        assert!(task_ids.iter().all(|t| t == want_task), "{line}");
    }

    drop((a, b));
    guard.shutdown().await.unwrap();
}

/// Calls through services whose collector is unreachable (`down`) or never answers
/// (`blackhole`) finish promptly, and shutdown returns within its limit, well before the
/// export timeout.
async fn calls_stay_fast_when_the_collector(endpoint: &str) {
    let logs = Capture::default();
    let mut config = config(endpoint, &[("OTEL_EXPORTER_OTLP_TIMEOUT", "8000")]);
    config.shutdown_timeout = Duration::from_secs(1);
    let (dispatch, guard) = reach_telemetry::dispatch(&config, logs).unwrap();
    let _default = tracing::dispatcher::set_default(&dispatch);

    let b = support::serve(Agent {
        name: "b",
        next: None,
    })
    .await;
    let mut client = support::client(b.addr).await;

    // Get an export stuck first, then call while it hangs.
    let flushing = {
        let guard = guard.clone();
        tokio::spawn(async move { guard.flush().await })
    };
    let start = Instant::now();
    for i in 0..30 {
        let span = tracing::info_span!("test.call", i);
        client
            .handle(HandleRequest {
                message: Some(support::message("", "task-x")),
            })
            .instrument(span)
            .await
            .unwrap();
    }
    let calls = start.elapsed();
    assert!(
        calls < Duration::from_secs(4),
        "30 calls took {calls:?} with the collector at {endpoint}"
    );

    let start = Instant::now();
    let result = guard.shutdown().await;
    let shutdown = start.elapsed();
    eprintln!("collector {endpoint}: calls {calls:?}, shutdown {shutdown:?}: {result:?}");
    assert!(
        shutdown < Duration::from_secs(4),
        "shutdown took {shutdown:?} (limit 1 s, export timeout 8 s): {result:?}"
    );
    flushing.abort();
}

#[tokio::test]
async fn a_blackholed_collector_neither_slows_calls_nor_shutdown() {
    let receiver = Receiver::start(true);
    calls_stay_fast_when_the_collector(&receiver.endpoint()).await;
}

#[tokio::test]
async fn a_collector_that_is_down_neither_slows_calls_nor_shutdown() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    calls_stay_fast_when_the_collector(&format!("http://127.0.0.1:{port}")).await;
}

/// Records one routed request the way the router does: a counter and a latency histogram,
/// labelled by capability and code name.
fn request(capability: &'static str, code: &'static str, elapsed: Duration) {
    use reach_telemetry::metrics::names;
    ::metrics::counter!(names::ROUTER_REQUESTS, "capability" => capability, "code" => code)
        .increment(1);
    ::metrics::histogram!(names::ROUTER_REQUEST_DURATION, "capability" => capability, "code" => code)
        .record(elapsed.as_secs_f64());
}

/// `GET path` on the admin port at `addr`, over HTTP/1.1; the body as text (asserting 200).
async fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<String, std::io::Error> {
    let (status, body) = http_get_status(addr, path).await?;
    assert_eq!(status, 200, "GET {path}: {body}");
    Ok(body)
}

/// `GET path` on the admin port at `addr`, over HTTP/1.1: the status code and the body.
async fn http_get_status(
    addr: std::net::SocketAddr,
    path: &str,
) -> Result<(u16, String), std::io::Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP/1.1 response: {head}"));
    Ok((status, body.to_string()))
}

#[tokio::test]
async fn ready_follows_the_readiness_flag_while_health_stays_ok() {
    let handle = reach_telemetry::metrics::install().unwrap();
    let (serving, ready) = tokio::sync::watch::channel(true);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(reach_telemetry::serve_admin(
        listener,
        reach_telemetry::admin_router(handle, ready),
        std::future::pending(),
        reach_rpc::server::DEFAULT_GRACE,
    ));
    let json = |body: &str| serde_json::from_str::<serde_json::Value>(body).unwrap();

    let (status, body) = http_get_status(addr, "/ready").await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body), serde_json::json!({"status": "serving"}));

    // Not serving (the registry's etcd does not answer): 503, while /health, liveness, stays
    // 200 so the process is not restarted for it.
    serving.send_replace(false);
    let (status, body) = http_get_status(addr, "/ready").await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert_eq!(json(&body), serde_json::json!({"status": "not_serving"}));
    let health = http_get(addr, "/health").await.unwrap();
    assert_eq!(json(&health), serde_json::json!({"status": "ok"}));

    serving.send_replace(true);
    let (status, _) = http_get_status(addr, "/ready").await.unwrap();
    assert_eq!(status, 200);
    assert!(reach_telemetry::ADMIN_PATHS.contains(&"/ready"));
}

/// A Prometheus text exposition, parsed.
fn parse_metrics(text: &str) -> prometheus_parse::Scrape {
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap()
}

#[tokio::test]
async fn metrics_are_served_and_counters_move() {
    use reach_telemetry::metrics::{self, names};

    let handle = metrics::install().unwrap();
    // A second install (another service in the same process) shares the recorder.
    metrics::install().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = reach_telemetry::admin_router(handle, tokio::sync::watch::channel(true).1).route(
        "/v1/extra",
        axum::routing::get(|| async { axum::Json(serde_json::json!({"extra": true})) }),
    );
    tokio::spawn(reach_telemetry::serve_admin(
        listener,
        router,
        std::future::pending(),
        reach_rpc::server::DEFAULT_GRACE,
    ));

    let health = http_get(addr, "/health").await.unwrap();
    assert!(health.contains("ok"), "{health}");
    let extra = http_get(addr, "/v1/extra").await.unwrap();
    assert!(extra.contains("extra"), "{extra}");

    let requests = |scrape: &prometheus_parse::Scrape| -> f64 {
        scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == names::ROUTER_REQUESTS
                    && s.labels.get("capability") == Some("metrics.test")
                    && s.labels.get("code") == Some("OK")
            })
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                ref other => panic!("{other:?}"),
            })
            .unwrap_or(0.0)
    };
    let scrape = || async {
        let text = http_get(addr, "/metrics").await.unwrap();
        parse_metrics(&text)
    };

    request("metrics.test", "OK", Duration::from_millis(3));
    let before = requests(&scrape().await);
    assert_eq!(before, 1.0);
    for _ in 0..4 {
        request("metrics.test", "OK", Duration::from_millis(3));
    }
    request("metrics.test", "UNAVAILABLE", Duration::from_millis(30));
    {
        let in_flight = ::metrics::gauge!(names::ROUTER_IN_FLIGHT, "capability" => "metrics.test");
        in_flight.increment(1.0);
        ::metrics::gauge!(names::REGISTRY_INSTANCES, "state" => "ready").set(2.0);
        let after = scrape().await;
        assert_eq!(requests(&after), 5.0);
        let gauge = after
            .samples
            .iter()
            .find(|s| s.metric == names::ROUTER_IN_FLIGHT)
            .unwrap();
        assert!(matches!(gauge.value, prometheus_parse::Value::Gauge(v) if v == 1.0));
        let histogram = after
            .samples
            .iter()
            .find(|s| {
                s.metric == names::ROUTER_REQUEST_DURATION
                    && s.labels.get("code") == Some("UNAVAILABLE")
            })
            .unwrap_or_else(|| panic!("{:#?}", after.samples));
        let prometheus_parse::Value::Histogram(buckets) = &histogram.value else {
            panic!("{histogram:?}")
        };
        let le_50ms = buckets
            .iter()
            .find(|b| (b.less_than - 0.05).abs() < 1e-9)
            .unwrap();
        assert_eq!(le_50ms.count, 1.0);
        in_flight.decrement(1.0);
    }
    let gauge = scrape()
        .await
        .samples
        .into_iter()
        .find(|s| s.metric == names::ROUTER_IN_FLIGHT)
        .unwrap();
    assert!(matches!(gauge.value, prometheus_parse::Value::Gauge(v) if v == 0.0));
}

#[tokio::test]
async fn the_default_filter_shows_info_from_every_reach_crate() {
    let logs = Capture::default();
    let config = TelemetryConfig::from_vars("x", Vec::<(String, String)>::new()).unwrap();
    let (dispatch, _guard) = reach_telemetry::dispatch(&config, logs.clone()).unwrap();
    tracing::dispatcher::with_default(&dispatch, || {
        tracing::info!(target: "reach_registry::lease", "registry info");
        tracing::info!(target: "reach_router", "router info");
        tracing::info!(target: "reach_sdk::runtime", "sdk info");
        tracing::debug!(target: "reach_router", "router debug");
        tracing::info!(target: "hyper::proto", "hyper info");
        tracing::warn!(target: "hyper::proto", "hyper warn");
        let message = support::message("4bf92f3577b34da6a3ce929d0e0e4736", "task-9");
        // The router's and the client's per-message spans stay out of log lines (their
        // formatting cost the router ~9 % of its throughput); an agent's is shown.
        for (otel_name, line) in [
            ("router.call", "inside a routed call"),
            ("mesh.call", "inside a client call"),
        ] {
            let _span = reach_telemetry::message_span(otel_name, &message).entered();
            tracing::warn!(target: "reach_router", "{line}");
        }
        let _span = reach_telemetry::message_span("agent.handle", &message).entered();
        tracing::info!(target: "reach_sdk::runtime", "inside a message");
    });
    for line in ["inside a routed call", "inside a client call"] {
        let logged = logs.lines().into_iter().find(|l| l.contains(line)).unwrap();
        assert!(!logged.contains("reach.message"), "{logged}");
    }
    let text = logs.lines().join("\n");
    for shown in ["registry info", "router info", "sdk info", "hyper warn"] {
        assert!(text.contains(shown), "{shown} missing from {text}");
    }
    let inside = logs
        .lines()
        .into_iter()
        .find(|l| l.contains("inside a message"))
        .unwrap();
    assert!(
        inside.contains("trace_id=4bf92f3577b34da6a3ce929d0e0e4736")
            && inside.contains("task_id=task-9"),
        "{inside}"
    );
    for hidden in ["router debug", "hyper info"] {
        assert!(!text.contains(hidden), "{hidden} shown in {text}");
    }
}

#[tokio::test]
async fn the_interceptor_and_metadata_helpers_carry_traceparent() {
    // Spans have OpenTelemetry contexts only when exporting: point export at a closed port
    // (nothing is flushed during the test).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = TelemetryConfig::from_vars(
        "x",
        [(
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_string(),
            format!("http://127.0.0.1:{port}"),
        )],
    )
    .unwrap();
    let (dispatch, _guard) = reach_telemetry::dispatch(&config, Capture::default()).unwrap();
    let _default = tracing::dispatcher::set_default(&dispatch);

    let caller = tracing::info_span!("test.caller");
    let caller_trace = reach_telemetry::span_trace_id(&caller).unwrap();
    let request = {
        let _entered = caller.enter();
        reach_telemetry::inject_trace_context(tonic::Request::new(())).unwrap()
    };
    let traceparent = request
        .metadata()
        .get(reach_rpc::trace::TRACEPARENT)
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(TraceId::from_traceparent(&traceparent), Some(caller_trace));

    let callee = tracing::info_span!(parent: None, "test.callee");
    assert!(reach_telemetry::set_parent_from_metadata(
        &callee,
        request.metadata()
    ));
    assert_eq!(reach_telemetry::span_trace_id(&callee), Some(caller_trace));

    // Without traceparent nothing changes; a root span can adopt an envelope's trace id.
    let orphan = tracing::info_span!(parent: None, "test.orphan");
    assert!(!reach_telemetry::set_parent_from_metadata(
        &orphan,
        &tonic::metadata::MetadataMap::new()
    ));
    let wanted = TraceId::random();
    assert!(reach_telemetry::adopt_trace_id(&orphan, wanted));
    assert_eq!(reach_telemetry::span_trace_id(&orphan), Some(wanted));
    // A started span keeps its trace.
    assert!(!reach_telemetry::adopt_trace_id(&orphan, TraceId::random()));
}

#[tokio::test]
async fn without_an_exporter_spans_keep_the_envelope_trace_id_and_no_otel_context() {
    let config = TelemetryConfig::from_vars("x", Vec::<(String, String)>::new()).unwrap();
    let capture = Capture::default();
    let (dispatch, guard) = reach_telemetry::dispatch(&config, capture.clone()).unwrap();
    assert!(!guard.is_exporting());
    let _default = tracing::dispatcher::set_default(&dispatch);

    let trace_id = TraceId::random().to_string();
    let span =
        reach_telemetry::message_span("agent.handle", &support::message(&trace_id, "task-9"));
    // No OpenTelemetry bookkeeping: nothing to inject, so a caller's traceparent passes on.
    assert_eq!(reach_telemetry::span_trace_id(&span), None);
    let mut metadata = std::collections::HashMap::new();
    reach_telemetry::inject_span_map(&span, &mut metadata);
    assert!(metadata.is_empty(), "{metadata:?}");
    span.in_scope(|| tracing::info!(target: "reach_test", "handling message"));
    let lines = capture.lines().join("\n");
    assert!(lines.contains(&format!("trace_id={trace_id}")), "{lines}");
    assert!(lines.contains("task_id=task-9"), "{lines}");
}

/// Export timeout of the bounded-shutdown tests.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(1);

/// Spans ended before a flush, after it, and how many the queue holds.
const BEFORE_FLUSH: usize = 20;
const AFTER_FLUSH: usize = 5;
const QUEUE: usize = 8;

/// With an export already stuck when shutdown begins (a flush), and more spans queued behind
/// it, shutdown still returns within the export timeout (plus a small bound) — not one export
/// timeout per batch, nor the 5 s shutdown timeout — and every span that was not exported is
/// counted: in [`reach_telemetry::TelemetryGuard::dropped_spans`], in
/// `reach_telemetry_spans_dropped_total` and in one log line.
///
/// `exporting` resolves once the flush's export has reached the collector (so the spans ended
/// after it wait for a second export); `None` when that cannot be seen.
async fn shutdown_is_bounded_and_counts_drops(
    endpoint: &str,
    exporting: Option<tokio::sync::oneshot::Receiver<()>>,
) -> reach_telemetry::DroppedSpans {
    let metrics = reach_telemetry::metrics::install().unwrap();
    let logs = Capture::default();
    let timeout_ms = EXPORT_TIMEOUT.as_millis().to_string();
    let queue = QUEUE.to_string();
    let config = config(
        endpoint,
        &[
            ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", &timeout_ms),
            ("OTEL_BSP_MAX_QUEUE_SIZE", &queue),
        ],
    );
    assert_eq!(config.shutdown_timeout, Duration::from_secs(5));
    let (dispatch, guard) = reach_telemetry::dispatch(&config, logs.clone()).unwrap();
    let _default = tracing::dispatcher::set_default(&dispatch);
    let spans = |n: usize| {
        for i in 0..n {
            tracing::info_span!("test.dropped", i).in_scope(|| {});
        }
    };
    // More than the queue holds: the rest are dropped at once.
    spans(BEFORE_FLUSH);
    let flushing = {
        let guard = guard.clone();
        tokio::spawn(async move { guard.flush().await })
    };
    if let Some(exporting) = exporting {
        tokio::time::timeout(Duration::from_secs(5), exporting)
            .await
            .expect("the flush reached the collector")
            .unwrap();
    }
    spans(AFTER_FLUSH);

    let start = Instant::now();
    let result = guard.clone().shutdown().await;
    let took = start.elapsed();
    let dropped = guard.dropped_spans();
    eprintln!("collector {endpoint}: shutdown {took:?}: {result:?}, dropped {dropped:?}");
    assert!(
        took < EXPORT_TIMEOUT + Duration::from_millis(600),
        "shutdown took {took:?} with an export timeout of {EXPORT_TIMEOUT:?}: {result:?}"
    );
    assert_eq!(
        dropped.total(),
        (BEFORE_FLUSH + AFTER_FLUSH) as u64,
        "no span reached the collector, so every one is counted: {dropped:?}"
    );
    let line = logs
        .lines()
        .into_iter()
        .find(|l| l.contains("spans dropped"))
        .expect("shutdown logs the dropped spans");
    assert!(
        line.contains(&format!("{} spans dropped:", dropped.total())),
        "{line}"
    );
    let rendered = metrics.render();
    for (reason, count) in [
        ("queue_full", dropped.queue_full),
        ("export_failed", dropped.export_failed),
        ("shutdown", dropped.shutdown),
    ] {
        if count == 0 {
            continue;
        }
        // Other tests of this binary drop spans too: at least this one's.
        let counted: f64 = rendered
            .lines()
            .filter(|l| {
                l.starts_with("reach_telemetry_spans_dropped_total{")
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert!(
            counted >= count as f64,
            "{reason}: {counted} < {count}\n{rendered}"
        );
    }
    flushing.abort();
    dropped
}

#[tokio::test]
async fn a_blackholed_collector_costs_shutdown_one_export_timeout_and_drops_are_counted() {
    // A TCP black hole: accepts connections, never sends a byte (not even the HTTP/2
    // handshake), and says when the first connection came.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", hole.local_addr().unwrap());
    let (accepted, exporting) = tokio::sync::oneshot::channel();
    let holding = tokio::spawn(async move {
        let mut accepted = Some(accepted);
        let mut held = Vec::new();
        while let Ok((connection, _)) = hole.accept().await {
            held.push(connection);
            if let Some(accepted) = accepted.take() {
                let _ = accepted.send(());
            }
        }
    });
    let dropped = shutdown_is_bounded_and_counts_drops(&endpoint, Some(exporting)).await;
    // The second batch was waiting behind the first (or being exported, unanswered) when
    // shutdown gave up: one export timeout, not two.
    assert!(dropped.shutdown >= AFTER_FLUSH as u64, "{dropped:?}");
    // The queue bound counts a span until the exporter takes it, and the batch thread may
    // take one full batch (the queue size) while the spans are still being ended; that
    // export never returns, so at most two queues' worth were admitted.
    assert!(
        dropped.queue_full >= (BEFORE_FLUSH - 2 * QUEUE) as u64,
        "{dropped:?}"
    );
    holding.abort();
}

#[tokio::test]
async fn a_collector_that_is_down_costs_shutdown_little_and_drops_are_counted() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dropped =
        shutdown_is_bounded_and_counts_drops(&format!("http://127.0.0.1:{port}"), None).await;
    assert!(dropped.export_failed > 0, "{dropped:?}");
}
