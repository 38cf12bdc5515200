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
    // Who resumed is recorded (the reviewer's name without trust), and a second resume is
    // refused: a console tells its reviewer who was first.
    let mut first = tonic::Request::new(resume("r1", "ask", json!({"approved": true})));
    first
        .metadata_mut()
        .insert("reach-reviewer", "Ana\tLima".parse().unwrap());
    c.resume_task(first).await.unwrap();
    let e = c
        .resume_task(resume("r1", "ask", json!({"approved": false})))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let dump = c
        .dump_task(pb::DumpTaskRequest {
            task_id: "r1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let by: Vec<serde_json::Value> = dump
        .records
        .iter()
        .filter_map(|r| match &r.record {
            Some(pb::dump_record::Record::Event(e)) if e.kind == "human_resumed" => e
                .detail
                .as_ref()
                .map(|d| reach_orchestrator::json::from_proto(d)["by"].clone()),
            _ => None,
        })
        .collect();
    assert_eq!(by, [json!("AnaLima")]);
    // One flow named: its YAML text comes along (a console draws it); all flows: none.
    let one = c
        .list_flows(pb::ListFlowsRequest {
            flow_id: "review".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .flows;
    assert!(one[0].yaml.contains("states"), "{one:?}");
    let all = c
        .list_flows(pb::ListFlowsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .flows;
    assert!(all.iter().all(|f| f.yaml.is_empty()));
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

/// A flow of its own (the PostgreSQL store is shared by the tests that use it).
const WATCH_RESUME: &str = r#"
id: watch-resume
version: 1
initial: ask
states:
  ask:
    type: human
    schema: {type: object, required: [approved], properties: {approved: {type: boolean}}}
    next: act
  act: {type: task, capability: test.act, next: done}
  done: {type: succeed}
"#;

/// Reads a WatchTask stream until `until` (an event kind) or its end, returning the events.
async fn watch(
    endpoint: &str,
    task_id: &str,
    after_sequence: u64,
    until: Option<&str>,
) -> Vec<pb::TaskEvent> {
    let mut client = OrchestratorServiceClient::connect(endpoint.to_string())
        .await
        .unwrap();
    let mut stream = client
        .watch_task(pb::WatchTaskRequest {
            task_id: task_id.into(),
            after_sequence,
        })
        .await
        .unwrap()
        .into_inner();
    let mut events = Vec::new();
    while let Some(response) = stream.message().await.unwrap() {
        let event = response.event.unwrap();
        let last = Some(event.kind.as_str()) == until;
        events.push(event);
        if last {
            break;
        }
    }
    events
}

/// A watcher that lost its stream resumes on another replica (two orchestrators on one
/// PostgreSQL store) with `after_sequence` and gets exactly the events it missed, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_resumes_on_another_replica_with_exactly_the_missed_events() {
    let Some(url) = common::postgres_url().await else {
        return;
    };
    let replica = |url: String| {
        server(move |c, dir| {
            let flows = dir.join("flows");
            std::fs::create_dir_all(&flows).unwrap();
            std::fs::write(flows.join("watch-resume.yaml"), WATCH_RESUME).unwrap();
            c.flows_dir = Some(flows);
            c.store_url = url;
        })
    };
    let a = replica(url.clone()).await;
    let b = replica(url).await;
    for s in [&a, &b] {
        s.router.handle("test.act", |d| Ok(d.input.clone()));
    }
    let mut client = OrchestratorServiceClient::connect(a.endpoint.clone())
        .await
        .unwrap();
    let task = client
        .start_task(pb::StartTaskRequest {
            flow_id: "watch-resume".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .task
        .unwrap();

    // The first watcher, on replica A, sees the task wait for a person, then loses its stream.
    let seen = watch(&a.endpoint, &task.task_id, 0, Some("human_waiting")).await;
    let last_seen = seen.last().unwrap().sequence;

    // Meanwhile the task moves on (resumed through replica B) and ends.
    OrchestratorServiceClient::connect(b.endpoint.clone())
        .await
        .unwrap()
        .resume_task(pb::ResumeTaskRequest {
            task_id: task.task_id.clone(),
            input: Some(reach_proto::json::to_proto(&json!({"approved": true}))),
            ..Default::default()
        })
        .await
        .unwrap();
    wait_for(&b.endpoint, &task.task_id, pb::TaskStatus::Succeeded).await;

    // Resumed on replica B after the last event it saw: exactly the rest, in order.
    let missed = watch(&b.endpoint, &task.task_id, last_seen, None).await;
    let whole = watch(&a.endpoint, &task.task_id, 0, None).await;
    let key = |events: &[pb::TaskEvent]| -> Vec<(u64, String)> {
        events
            .iter()
            .map(|e| (e.sequence, e.kind.clone()))
            .collect()
    };
    assert_eq!(key(&seen), key(&whole[..seen.len()]));
    assert_eq!(key(&missed), key(&whole[seen.len()..]));
    assert_eq!(
        missed.first().map(|e| e.kind.as_str()),
        Some("human_resumed")
    );
    assert_eq!(missed.last().map(|e| e.kind.as_str()), Some("task_ended"));
    // The waiting event carries the node's schema, as watchers (the A2A edge) need it.
    let waiting = &seen.last().unwrap();
    let detail = reach_proto::json::from_proto(waiting.detail.as_ref().unwrap());
    assert_eq!(
        detail["schema"]["required"],
        json!(["approved"]),
        "{detail}"
    );
}

/// A task keeps the labels it was started with; ListTasks filters on them; labels beyond
/// the limits are refused with INVALID_LABELS; a caller's `traceparent` is the task's trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_filter_lists_and_a_traceparent_is_continued() {
    let s = server(|c, dir| {
        let flows = dir.join("flows");
        std::fs::create_dir_all(&flows).unwrap();
        std::fs::write(flows.join("review.yaml"), REVIEW_V1).unwrap();
        c.flows_dir = Some(flows);
    })
    .await;
    let mut c = OrchestratorServiceClient::connect(s.endpoint.clone())
        .await
        .unwrap();
    let start = |context: &str| {
        let mut request = tonic::Request::new(pb::StartTaskRequest {
            flow_id: "review".into(),
            labels: [("a2a.context_id".to_string(), context.to_string())].into(),
            ..Default::default()
        });
        request.metadata_mut().insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        request
    };
    let first = c
        .start_task(start("chat-1"))
        .await
        .unwrap()
        .into_inner()
        .task
        .unwrap();
    c.start_task(start("chat-1")).await.unwrap();
    c.start_task(start("chat-2")).await.unwrap();
    assert_eq!(first.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(first.labels["a2a.context_id"], "chat-1");

    let listed = |context: &str| pb::ListTasksRequest {
        labels: [("a2a.context_id".to_string(), context.to_string())].into(),
        ..Default::default()
    };
    let chat1 = c
        .list_tasks(listed("chat-1"))
        .await
        .unwrap()
        .into_inner()
        .tasks;
    assert_eq!(chat1.len(), 2);
    assert!(chat1.iter().all(|t| t.labels["a2a.context_id"] == "chat-1"));
    assert_eq!(
        c.list_tasks(listed("chat-2"))
            .await
            .unwrap()
            .into_inner()
            .tasks
            .len(),
        1
    );
    assert!(
        c.list_tasks(listed("chat-3"))
            .await
            .unwrap()
            .into_inner()
            .tasks
            .is_empty()
    );

    let bad = c
        .start_task(pb::StartTaskRequest {
            flow_id: "review".into(),
            labels: [("no spaces".to_string(), "x".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        reach_rpc::errors::reason_of(&bad).as_deref(),
        Some("INVALID_LABELS"),
        "{bad:?}"
    );
    assert!(bad.message().contains("no spaces"), "{}", bad.message());
}
