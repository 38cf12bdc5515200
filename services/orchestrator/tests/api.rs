//! The management surface: WatchTask, the ledger, HTTP admin routes, hot
//! reload, TTL purge, timeouts, cancel and masking — against a real orchestrator server.

mod common;

use std::time::Duration;

use common::{REVIEW_V1, eventually, server, status_of, wait_for};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_router::ledger::{LedgerSink, LedgerSinkConfig};
use serde_json::json;
use tonic::Status;

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
    let flows_dir = s.dir.path().join("flows");
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
