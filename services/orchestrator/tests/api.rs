//! The management surface: CLI functions, WatchTask, the ledger, HTTP admin routes, hot
//! reload, TTL purge, timeouts, cancel and masking — against a real orchestrator server.

mod common;

use std::time::Duration;

use common::{TestRouter, eventually};
use reach_orchestrator::cli;
use reach_orchestrator::{Orchestrator, OrchestratorConfig};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_router::ledger::{CallOutcome, LedgerSink, LedgerSinkConfig};
use serde_json::json;
use tonic::Status;

const REVIEW_V1: &str = r#"
id: review
version: 1
initial: ask
states:
  ask:
    type: human
    schema: {type: object, required: [approved], properties: {approved: {type: boolean}}}
    on_cancel: withdrawn
    next: act
  act: {type: task, capability: test.act, next: done}
  withdrawn: {type: fail, error: withdrawn}
  done: {type: succeed}
"#;

const TIMEOUTS: &str = r#"
id: timeouts
version: 1
initial: slow
states:
  slow:
    type: task
    capability: test.slow
    timeout: 1s
    retry: {max_attempts: 5, initial_interval: 50ms, jitter: 0}
    next: ask
  ask: {type: human, timeout: 300ms, catch: late, next: done}
  late: {type: task, capability: test.act, input: {why: "nodes.ask.error"}, next: done}
  done: {type: succeed}
"#;

struct Server {
    endpoint: String,
    router: TestRouter,
    orch: std::sync::Arc<Orchestrator>,
    _router_stop: tokio::sync::oneshot::Sender<()>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn server(tweak: impl FnOnce(&mut OrchestratorConfig, &std::path::Path)) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let router = TestRouter::default();
    let (router_url, router_stop) = router.serve().await;
    let mut config = OrchestratorConfig {
        store_url: format!("sqlite://{}/o.db", dir.path().display()),
        router_endpoint: router_url,
        poll_interval: Duration::from_millis(50),
        redact_fields: vec!["customer_name".into()],
        ..Default::default()
    };
    tweak(&mut config, dir.path());
    let orch = std::sync::Arc::new(Orchestrator::new(config).await.unwrap());
    let running = orch.start().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let svc = orch.grpc_service();
    tokio::spawn(async move {
        reach_rpc::GrpcServer::new()
            .add_service(svc)
            .serve(listener, async move {
                let _ = rx.await;
            })
            .await
            .unwrap();
        running.shutdown().await;
    });
    Server {
        endpoint,
        router,
        orch,
        _router_stop: router_stop,
        stop: Some(tx),
        _dir: dir,
    }
}

async fn status_of(endpoint: &str, id: &str) -> Option<pb::Task> {
    let mut c = OrchestratorServiceClient::connect(endpoint.to_string())
        .await
        .ok()?;
    match c.get_task(pb::GetTaskRequest { task_id: id.into() }).await {
        Ok(r) => r.into_inner().task,
        Err(e) => {
            eprintln!("get_task {id}: {e}");
            None
        }
    }
}

async fn wait_for(endpoint: &str, id: &str, status: pb::TaskStatus) -> pb::Task {
    let start = std::time::Instant::now();
    loop {
        let task = status_of(endpoint, id).await;
        if let Some(t) = &task
            && t.status == status as i32
        {
            return t.clone();
        }
        let ended = task.as_ref().is_some_and(|t| {
            [
                pb::TaskStatus::Succeeded,
                pb::TaskStatus::Failed,
                pb::TaskStatus::Partial,
                pb::TaskStatus::Cancelled,
            ]
            .iter()
            .any(|s| *s as i32 == t.status)
        });
        assert!(
            start.elapsed() < Duration::from_secs(30) && !ended,
            "task {id} never reached {status:?}; last seen: {:#?}",
            task.map(|t| cli::task_json(&t))
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn out() -> Vec<u8> {
    Vec::new()
}

/// The task id in the output of `task start --json`.
fn started_id(output: Vec<u8>) -> String {
    let task: serde_json::Value = serde_json::from_slice(&output).expect("task start --json");
    task["task_id"].as_str().expect("a task_id").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_commands_against_a_server() {
    let s = server(|_, _| {}).await;
    s.router.handle("test.act", |d| {
        Ok(json!({"acted": true, "customer_name": d.input["customer_name"].clone()}))
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("review.yaml");
    std::fs::write(&file, REVIEW_V1).unwrap();

    let mut o = out();
    assert_eq!(
        cli::flow_apply(&s.endpoint, &file, &mut o).await.unwrap(),
        0
    );
    assert_eq!(
        String::from_utf8_lossy(&o).trim(),
        "flow review version 1 applied"
    );
    let mut o = out();
    assert_eq!(
        cli::flow_apply(&s.endpoint, &file, &mut o).await.unwrap(),
        0
    );
    assert!(String::from_utf8_lossy(&o).contains("unchanged"));
    // Same version, other text: refused with the fix.
    std::fs::write(&file, REVIEW_V1.replace("withdrawn}", "withdrawn by user}")).unwrap();
    let mut o = out();
    assert_eq!(
        cli::flow_apply(&s.endpoint, &file, &mut o).await.unwrap(),
        1
    );
    assert!(String::from_utf8_lossy(&o).contains("bump `version`"));
    let mut o = out();
    cli::flow_list(&s.endpoint, &mut o).await.unwrap();
    assert!(String::from_utf8_lossy(&o).contains("review"));

    // start -> waiting; a bad resume names the field; a good one finishes the task.
    let mut o = out();
    cli::task_start(
        &s.endpoint,
        "review",
        r#"{"customer_name": "Jane Roe", "email": "jane@example.com"}"#,
        0,
        Some("order-42".into()),
        false,
        &mut o,
    )
    .await
    .unwrap();
    // A person reads the id, the status and the commands to follow the task, ready to paste.
    let started = String::from_utf8(o).unwrap();
    let first = started.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("task order-42  ") && first.contains("(flow review v1)"),
        "{started}"
    );
    assert!(
        started.contains(&format!(
            "follow it:  reach task watch order-42 --endpoint {}",
            s.endpoint
        )),
        "{started}"
    );
    let id = "order-42".to_string();
    // Starting the same id again returns the same task; --json is for scripts.
    let mut o = out();
    cli::task_start(
        &s.endpoint,
        "review",
        "{}",
        0,
        Some("order-42".into()),
        true,
        &mut o,
    )
    .await
    .unwrap();
    assert_eq!(started_id(o), "order-42");
    wait_for(&s.endpoint, &id, pb::TaskStatus::WaitingHuman).await;
    let mut o = out();
    cli::task_list(&s.endpoint, Some("waiting_human"), None, 10, false, &mut o)
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&o).contains("order-42"));
    // --json: an array of tasks for scripts, each as `task get --json` shows it.
    let mut o = out();
    cli::task_list(&s.endpoint, Some("waiting_human"), None, 10, true, &mut o)
        .await
        .unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&o).unwrap();
    assert_eq!(listed[0]["task_id"], "order-42", "{listed}");
    assert_eq!(listed[0]["status"], "WAITING_HUMAN", "{listed}");
    let err = cli::task_resume(&s.endpoint, &id, r#"{"approved": "yes"}"#, None, &mut out())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("invalid argument:") && text.contains("/approved"),
        "{text}"
    );
    assert!(matches!(
        cli::task_list(&s.endpoint, Some("sleeping"), None, 10, false, &mut out()).await,
        Err(cli::CliError::Usage(_))
    ));
    cli::task_resume(&s.endpoint, &id, r#"{"approved": true}"#, None, &mut out())
        .await
        .unwrap();
    wait_for(&s.endpoint, &id, pb::TaskStatus::Succeeded).await;

    let mut o = out();
    cli::task_watch(&s.endpoint, &id, &mut o).await.unwrap();
    let watched = String::from_utf8(o).unwrap();
    assert!(
        watched.lines().last().unwrap().contains("task_ended"),
        "{watched}"
    );

    // get --json is masked: the e-mail and the configured field never show.
    let mut o = out();
    cli::task_get(&s.endpoint, &id, true, &mut o).await.unwrap();
    let shown = String::from_utf8(o).unwrap();
    let v: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(v["status"], "SUCCEEDED");
    assert!(
        !shown.contains("jane@example.com") && !shown.contains("Jane Roe"),
        "{shown}"
    );
    assert_eq!(v["nodes"][1]["output"]["customer_name"], "***");
    let mut o = out();
    cli::task_get(&s.endpoint, &id, false, &mut o)
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&o).contains("SUCCEEDED"));

    // cancel while waiting goes to on_cancel; retry of a cancelled task is refused.
    let mut o = out();
    cli::task_start(&s.endpoint, "review", "{}", 0, None, true, &mut o)
        .await
        .unwrap();
    let id2 = started_id(o);
    wait_for(&s.endpoint, &id2, pb::TaskStatus::WaitingHuman).await;
    cli::task_cancel(&s.endpoint, &id2, "customer withdrew", &mut out())
        .await
        .unwrap();
    let t = wait_for(&s.endpoint, &id2, pb::TaskStatus::Failed).await;
    assert_eq!(t.failed_node, "withdrawn");

    // A task node failing for good is a dead letter; retry runs it again.
    s.router
        .handle("test.act", |_| Err(Status::invalid_argument("refused")));
    let mut o = out();
    cli::task_start(&s.endpoint, "review", "{}", 0, None, true, &mut o)
        .await
        .unwrap();
    let id3 = started_id(o);
    wait_for(&s.endpoint, &id3, pb::TaskStatus::WaitingHuman).await;
    cli::task_resume(&s.endpoint, &id3, r#"{"approved": true}"#, None, &mut out())
        .await
        .unwrap();
    wait_for(&s.endpoint, &id3, pb::TaskStatus::Failed).await;
    let mut o = out();
    cli::dead_letters(&s.endpoint, None, &mut o).await.unwrap();
    assert!(String::from_utf8_lossy(&o).contains(&id3));
    s.router.handle("test.act", |_| Ok(json!({"acted": true})));
    let mut o = out();
    cli::task_retry(&s.endpoint, &id3, &mut o).await.unwrap();
    assert!(String::from_utf8_lossy(&o).contains("retried from node act"));
    let t = wait_for(&s.endpoint, &id3, pb::TaskStatus::Succeeded).await;
    assert_eq!(t.nodes.iter().filter(|n| n.node_id == "act").count(), 2);

    // dump: events and routed messages in time order.
    let sink = LedgerSink::spawn(
        &s.endpoint,
        LedgerSinkConfig {
            flush_interval: Duration::from_millis(10),
            ..Default::default()
        },
    )
    .unwrap();
    for d in s.router.deliveries().iter().filter(|d| d.task_id == id3) {
        let msg = pb::ReachMessage {
            header: Some(pb::Header {
                message_id: d.message_id.clone(),
                task_id: d.task_id.clone(),
                trace_id: d.trace_id.clone(),
                source: "orchestrator".into(),
                target: Some(pb::header::Target::Capability(d.capability.clone())),
                ..Default::default()
            }),
            payload: Some(pb::Payload {
                r#type: d.capability.clone(),
                parts: vec![],
            }),
        };
        let outcome = CallOutcome {
            code: tonic::Code::Ok,
            status_message: String::new(),
            latency: Duration::from_millis(3),
            routed_at: std::time::SystemTime::now(),
            instance_id: "act-1".into(),
        };
        assert!(sink.record_call(&msg, &outcome));
    }
    eventually("ledger flushed", Duration::from_secs(10), || {
        let n = sink.sent();
        async move { (n >= 2).then_some(()) }
    })
    .await;
    let mut o = out();
    cli::dump(
        &s.endpoint,
        cli::DumpArgs {
            task: id3.clone(),
            json: true,
        },
        &mut o,
    )
    .await
    .unwrap();
    let lines: Vec<serde_json::Value> = String::from_utf8(o)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["type"] == "message" && l["instance"] == "act-1")
    );
    assert!(
        lines
            .iter()
            .any(|l| l["type"] == "event" && l["kind"] == "task_retried")
    );
    let times: Vec<String> = lines
        .iter()
        .map(|l| l["at"].as_str().unwrap().to_string())
        .collect();
    let mut sorted = times.clone();
    sorted.sort();
    assert_eq!(times, sorted, "dump is in time order");
    let mut o = out();
    cli::dump(
        &s.endpoint,
        cli::DumpArgs {
            task: id3,
            json: false,
        },
        &mut o,
    )
    .await
    .unwrap();
    assert!(String::from_utf8_lossy(&o).contains("message "));
}

const TRIAGE: &str = r#"
id: triage
version: 1
initial: classify
states:
  classify: {type: task, capability: test.classify, next: route}
  route:
    type: condition
    conditions: [{if: "nodes.classify.output.confidence < 0.5", next: review}]
    default: done
  review:
    type: human
    prompt: "Pick the category"
    schema: {type: object, required: [category], properties: {category: {type: string}}}
    timeout: 1h
    next: done
  done: {type: succeed}
"#;

/// A task waiting for a person says what it waits for (the human node, its prompt, schema and
/// timeout, the command to resume it) and shows no output: the condition node's output before
/// it is not the task's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_waiting_for_a_person_shows_what_it_waits_for_not_an_output() {
    let s = server(|_, _| {}).await;
    s.router.handle("test.classify", |_| {
        Ok(json!({"category": "unsure", "confidence": 0.2}))
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("triage.yaml");
    std::fs::write(&file, TRIAGE).unwrap();
    assert_eq!(
        cli::flow_apply(&s.endpoint, &file, &mut out())
            .await
            .unwrap(),
        0
    );
    let mut o = out();
    cli::task_start(&s.endpoint, "triage", "{}", 0, None, true, &mut o)
        .await
        .unwrap();
    let id = started_id(o);
    wait_for(&s.endpoint, &id, pb::TaskStatus::WaitingHuman).await;

    let mut o = out();
    cli::task_get(&s.endpoint, &id, false, &mut o)
        .await
        .unwrap();
    let shown = String::from_utf8(o).unwrap();
    for expected in [
        "status    WAITING_HUMAN",
        "waiting   for a person, at human node review",
        "prompt    Pick the category",
        r#"schema    {"properties":{"category":{"type":"string"}},"required":["category"],"type":"object"}"#,
        "times out ",
        &format!(
            "resume    reach task resume {id} --input '<JSON matching the schema>' --endpoint {}",
            s.endpoint
        ),
        "(waiting for a person)",
    ] {
        assert!(
            shown.contains(expected),
            "{expected:?} missing from\n{shown}"
        );
    }
    assert!(
        !shown.lines().any(|l| l.starts_with("output")),
        "an unfinished task has no output:\n{shown}"
    );

    let mut o = out();
    cli::task_get(&s.endpoint, &id, true, &mut o).await.unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o).unwrap();
    assert_eq!(v["output"], serde_json::Value::Null, "{v:#}");
    assert_eq!(v["waiting"]["node_id"], "review", "{v:#}");
    assert_eq!(v["waiting"]["prompt"], "Pick the category");
    assert_eq!(
        v["waiting"]["input_schema"]["required"],
        json!(["category"])
    );
    assert!(v["waiting"]["deadline"].is_string(), "{v:#}");

    // `task start` of a task already waiting offers the resume command too.
    let mut o = out();
    cli::task_start(
        &s.endpoint,
        "triage",
        "{}",
        0,
        Some(id.clone()),
        false,
        &mut o,
    )
    .await
    .unwrap();
    assert!(
        String::from_utf8_lossy(&o).contains(&format!(
            "resume it:  reach task resume {id} --input '<JSON matching the schema>'"
        )),
        "{}",
        String::from_utf8_lossy(&o)
    );

    // Once resumed and ended, the output is the task's and nothing is awaited.
    cli::task_resume(
        &s.endpoint,
        &id,
        r#"{"category": "servicing"}"#,
        None,
        &mut out(),
    )
    .await
    .unwrap();
    wait_for(&s.endpoint, &id, pb::TaskStatus::Succeeded).await;
    let mut o = out();
    cli::task_get(&s.endpoint, &id, true, &mut o).await.unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o).unwrap();
    assert_eq!(v["output"], json!({"category": "servicing"}), "{v:#}");
    assert_eq!(v["waiting"], serde_json::Value::Null);
    let mut o = out();
    cli::task_get(&s.endpoint, &id, false, &mut o)
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&o).contains(r#"output    {"category":"servicing"}"#),
        "{}",
        String::from_utf8_lossy(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_sink_never_blocks_and_counts_drops() {
    // Nothing listens on this port: every batch fails and is counted, record() stays instant.
    let sink = LedgerSink::spawn(
        "http://127.0.0.1:9",
        LedgerSinkConfig {
            capacity: 4,
            batch_size: 2,
            flush_interval: Duration::from_millis(1),
            timeout: Duration::from_millis(200),
            ..Default::default()
        },
    )
    .unwrap();
    let entry = |i: u32| pb::LedgerEntry {
        header: Some(pb::Header {
            task_id: format!("t{i}"),
            ..Default::default()
        }),
        ..Default::default()
    };
    for i in 0..100 {
        sink.record(entry(i));
    }
    assert!(sink.dropped() > 0);
    eventually("failed batches counted", Duration::from_secs(10), || {
        let d = sink.dropped();
        async move { (d == 100).then_some(()) }
    })
    .await;
    // Sampling is per task and stable.
    let half = LedgerSink::spawn(
        "http://127.0.0.1:9",
        LedgerSinkConfig {
            sample_rate: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(half.record(entry(1)));
    assert_eq!(half.dropped(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_http_timeouts_hot_reload_and_purge() {
    let s = server(|c, dir| {
        let flows = dir.join("flows");
        std::fs::create_dir_all(&flows).unwrap();
        std::fs::write(flows.join("review.yaml"), REVIEW_V1).unwrap();
        std::fs::write(flows.join("timeouts.yaml"), TIMEOUTS).unwrap();
        c.flows_dir = Some(flows);
        c.context_ttl = Duration::from_secs(2);
    })
    .await;
    // The first delivery of each attempt of test.slow outlives the 300ms timeout once.
    s.router.handle("test.slow", |d| {
        if d.attempt == 1 {
            Err(Status::aborted("sleep:5000"))
        } else {
            Ok(json!({"fast": true}))
        }
    });
    s.router.handle("test.act", |d| Ok(d.input.clone()));
    let mut c = OrchestratorServiceClient::connect(s.endpoint.clone())
        .await
        .unwrap();

    // WatchTask streams every event to the end; attempt timeout -> retry; human timeout -> catch.
    let t = c
        .start_task(pb::StartTaskRequest {
            flow_id: "timeouts".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .task
        .unwrap();
    let mut stream = c
        .watch_task(pb::WatchTaskRequest {
            task_id: t.task_id.clone(),
            after_sequence: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut kinds = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        kinds.push(e.event.unwrap().kind);
    }
    assert_eq!(kinds.first().map(String::as_str), Some("task_created"));
    assert_eq!(kinds.last().map(String::as_str), Some("task_ended"));
    let task = wait_for(&s.endpoint, &t.task_id, pb::TaskStatus::Succeeded).await;
    let path: Vec<&str> = task.nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(path, ["slow", "ask", "late", "done"]);
    assert_eq!(task.nodes[0].attempts, 2);
    let late = reach_orchestrator::json::from_proto_opt(task.nodes[2].output.as_ref());
    assert!(
        late["why"].as_str().unwrap().contains("no one resumed"),
        "{late}"
    );

    // HTTP admin routes.
    use tower::ServiceExt;
    let admin = s.orch.admin_router();
    let resp = admin
        .clone()
        .oneshot(
            http::Request::get(format!("/tasks/{}", t.task_id))
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = serde_json::from_slice(
        &axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(body["status"], "SUCCEEDED");
    let resp = admin
        .clone()
        .oneshot(
            http::Request::get("/tasks/nope")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let resp = admin
        .oneshot(
            http::Request::post(format!("/tasks/{}/retry", t.task_id))
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 409, "a succeeded task cannot be retried");

    // Hot reload: a waiting task stays on v1 while the directory moves to v2; an invalid file
    // is not loaded.
    let waiting = c
        .start_task(pb::StartTaskRequest {
            flow_id: "review".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .task
        .unwrap();
    wait_for(&s.endpoint, &waiting.task_id, pb::TaskStatus::WaitingHuman).await;
    let flows_dir = s._dir.path().join("flows");
    std::fs::write(
        flows_dir.join("review.yaml"),
        REVIEW_V1
            .replace("version: 1", "version: 2")
            .replace("error: withdrawn}", "error: withdrawn by the customer}"),
    )
    .unwrap();
    std::fs::write(
        flows_dir.join("broken.yaml"),
        "id: broken\nversion: 1\nstates: {a: {type: nope}}\n",
    )
    .unwrap();
    let ep = s.endpoint.clone();
    eventually("review v2 loaded", Duration::from_secs(10), || {
        let ep = ep.clone();
        async move {
            let mut c = OrchestratorServiceClient::connect(ep).await.ok()?;
            let flows = c
                .list_flows(pb::ListFlowsRequest::default())
                .await
                .ok()?
                .into_inner()
                .flows;
            flows
                .iter()
                .any(|f| f.flow_id == "review" && f.version == 2)
                .then_some(())
        }
    })
    .await;
    let flows = c
        .list_flows(pb::ListFlowsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .flows;
    assert!(!flows.iter().any(|f| f.flow_id == "broken"));
    c.resume_task(pb::ResumeTaskRequest {
        task_id: waiting.task_id.clone(),
        input: Some(reach_orchestrator::json::to_proto(
            &json!({"approved": true}),
        )),
        ..Default::default()
    })
    .await
    .unwrap();
    let done = wait_for(&s.endpoint, &waiting.task_id, pb::TaskStatus::Succeeded).await;
    assert_eq!(done.flow_version, 1);
    let fresh = c
        .start_task(pb::StartTaskRequest {
            flow_id: "review".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .task
        .unwrap();
    assert_eq!(fresh.flow_version, 2);

    // TTL purge: ended tasks disappear after context_ttl (2s here).
    let ep = s.endpoint.clone();
    let id = t.task_id.clone();
    eventually("task purged", Duration::from_secs(20), || {
        let ep = ep.clone();
        let id = id.clone();
        async move {
            let mut c = OrchestratorServiceClient::connect(ep).await.ok()?;
            match c.get_task(pb::GetTaskRequest { task_id: id }).await {
                Err(s) if s.code() == tonic::Code::NotFound => Some(()),
                _ => None,
            }
        }
    })
    .await;
}

const PARKED: &str = r#"
id: parked
version: 1
initial: pause
states:
  pause: {type: wait, duration: 1h, next: done}
  done: {type: succeed}
"#;

/// Every refusal is a status a program can branch on: the gRPC code plus an ErrorInfo
/// reason (domain reach.dev) with the ids involved, and a BadRequest for request fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_carry_reasons_a_program_can_branch_on() {
    use reach_rpc::errors::{ERROR_DOMAIN, metadata_of, reason, reason_of};
    use tonic::Code;
    use tonic_types::StatusExt;

    fn check(s: &Status, code: Code, expected: &str) {
        assert_eq!(s.code(), code, "{s:?}");
        assert_eq!(reason_of(s).as_deref(), Some(expected), "{s:?}");
        assert_eq!(s.get_details_error_info().unwrap().domain, ERROR_DOMAIN);
    }

    let s = server(|_, _| {}).await;
    let mut c = OrchestratorServiceClient::connect(s.endpoint.clone())
        .await
        .unwrap();
    for yaml in [REVIEW_V1, PARKED] {
        c.apply_flow(pb::ApplyFlowRequest {
            yaml: yaml.into(),
            source: "test".into(),
        })
        .await
        .unwrap();
    }

    let e = c
        .get_task(pb::GetTaskRequest {
            task_id: "nope".into(),
        })
        .await
        .unwrap_err();
    check(&e, Code::NotFound, reason::TASK_NOT_FOUND);
    assert_eq!(metadata_of(&e)["task_id"], "nope");
    let e = c
        .dump_task(pb::DumpTaskRequest {
            task_id: "nope".into(),
        })
        .await
        .unwrap_err();
    check(&e, Code::NotFound, reason::TASK_NOT_FOUND);

    let start = |flow: &str, id: &str| pb::StartTaskRequest {
        flow_id: flow.into(),
        task_id: id.into(),
        ..Default::default()
    };
    let e = c.start_task(start("nope", "")).await.unwrap_err();
    check(&e, Code::NotFound, reason::FLOW_NOT_FOUND);
    assert_eq!(metadata_of(&e)["flow_id"], "nope");
    assert!(
        e.message().contains("known flows: [parked, review]"),
        "{e:?}"
    );
    let e = c.start_task(start("", "")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(
        e.get_details_bad_request().unwrap().field_violations[0].field,
        "flow_id"
    );
    let e = c
        .start_task(start("review", "no spaces"))
        .await
        .unwrap_err();
    check(&e, Code::InvalidArgument, reason::INVALID_TASK_ID);

    // A task waiting for a person: resume refuses another node and a bad input.
    c.start_task(start("review", "r1")).await.unwrap();
    wait_for(&s.endpoint, "r1", pb::TaskStatus::WaitingHuman).await;
    let resume = |id: &str, node: &str, input: serde_json::Value| pb::ResumeTaskRequest {
        task_id: id.into(),
        node_id: node.into(),
        input: Some(reach_orchestrator::json::to_proto(&input)),
    };
    let e = c
        .resume_task(resume("r1", "act", json!({"approved": true})))
        .await
        .unwrap_err();
    check(&e, Code::FailedPrecondition, reason::NODE_NOT_WAITING);
    assert_eq!(metadata_of(&e)["waiting_node_id"], "ask");
    let e = c
        .resume_task(resume("r1", "", json!({"approved": "yes"})))
        .await
        .unwrap_err();
    check(&e, Code::InvalidArgument, reason::INVALID_INPUT);
    assert_eq!(
        e.get_details_bad_request().unwrap().field_violations[0].field,
        "input/approved"
    );
    let e = c.start_task(start("parked", "r1")).await.unwrap_err();
    check(&e, Code::AlreadyExists, reason::TASK_ID_IN_USE);
    assert_eq!(metadata_of(&e)["flow_id"], "review");

    // A running task (in a wait node) cannot be resumed or retried.
    c.start_task(start("parked", "p1")).await.unwrap();
    let ep = s.endpoint.clone();
    eventually("p1 waits in pause", Duration::from_secs(30), || {
        let ep = ep.clone();
        async move {
            status_of(&ep, "p1")
                .await
                .filter(|t| t.current_node == "pause")
        }
    })
    .await;
    let e = c
        .resume_task(resume("p1", "", json!({})))
        .await
        .unwrap_err();
    check(&e, Code::FailedPrecondition, reason::TASK_NOT_WAITING);
    assert_eq!(metadata_of(&e)["status"], "PROCESSING");
    assert_eq!(metadata_of(&e)["node_id"], "pause");
    let e = c
        .retry_task(pb::RetryTaskRequest {
            task_id: "p1".into(),
        })
        .await
        .unwrap_err();
    check(&e, Code::FailedPrecondition, reason::TASK_NOT_RETRYABLE);

    // An ended task cannot be cancelled.
    c.cancel_task(pb::CancelTaskRequest {
        task_id: "p1".into(),
        reason: String::new(),
    })
    .await
    .unwrap();
    let e = c
        .cancel_task(pb::CancelTaskRequest {
            task_id: "p1".into(),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    check(&e, Code::FailedPrecondition, reason::TASK_ENDED);
    assert_eq!(metadata_of(&e)["status"], "CANCELLED");

    // Flows: located validation errors; a changed version must be bumped.
    let e = c
        .apply_flow(pb::ApplyFlowRequest {
            yaml: "id: broken\nversion: 1\ninitial: a\nstates: {a: {type: nope}}\n".into(),
            source: "broken.yaml".into(),
        })
        .await
        .unwrap_err();
    check(&e, Code::InvalidArgument, reason::INVALID_FLOW);
    assert!(
        e.get_details_bad_request().unwrap().field_violations[0]
            .field
            .starts_with("broken.yaml:4:"),
        "{e:?}"
    );
    let e = c
        .apply_flow(pb::ApplyFlowRequest {
            yaml: PARKED.replace("1h", "2h"),
            source: "test".into(),
        })
        .await
        .unwrap_err();
    check(&e, Code::FailedPrecondition, reason::FLOW_VERSION_CONFLICT);

    let e = c
        .list_tasks(pb::ListTasksRequest {
            page_token: "garbage".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    check(&e, Code::InvalidArgument, reason::INVALID_PAGE_TOKEN);

    // The HTTP admin routes say the same.
    use tower::ServiceExt;
    let resp = s
        .orch
        .admin_router()
        .oneshot(
            http::Request::get("/tasks/nope")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let body: serde_json::Value = serde_json::from_slice(
        &axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(body["reason"], reason::TASK_NOT_FOUND, "{body}");
}
