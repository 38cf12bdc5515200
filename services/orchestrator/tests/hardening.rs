//! Hostile input, overload and restarts, against a real orchestrator server: expressions and
//! flows cannot take it down, a busy task cannot keep a cancel out, a failure that provably
//! did not deliver is not an attempt, and a cancelled task's timers show in its history.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{eventually, server, status_of, wait_for};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_rpc::errors::{reason, status_with_reason};
use serde_json::json;
use tonic::Code;
use tonic_types::StatusExt;

async fn client(endpoint: &str) -> OrchestratorServiceClient<tonic::transport::Channel> {
    OrchestratorServiceClient::connect(endpoint.to_string())
        .await
        .unwrap()
}

async fn apply(
    c: &mut OrchestratorServiceClient<tonic::transport::Channel>,
    yaml: &str,
) -> Result<pb::ApplyFlowResponse, tonic::Status> {
    c.apply_flow(pb::ApplyFlowRequest {
        yaml: yaml.into(),
        source: "test.yaml".into(),
    })
    .await
    .map(tonic::Response::into_inner)
}

async fn start(
    c: &mut OrchestratorServiceClient<tonic::transport::Channel>,
    flow: &str,
    input: serde_json::Value,
) -> String {
    c.start_task(pb::StartTaskRequest {
        flow_id: flow.into(),
        input: Some(reach_orchestrator::json::to_proto(&input)),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .task
    .unwrap()
    .task_id
}

fn condition_flow(id: &str, expression: &str) -> String {
    format!(
        "id: {id}\nversion: 1\ninitial: route\nstates:\n  route:\n    type: condition\n    conditions:\n      - if: \"{expression}\"\n        next: done\n    default: done\n  done: {{type: succeed}}\n"
    )
}

const GOOD: &str = "id: good\nversion: 1\ninitial: done\nstates:\n  done: {type: succeed}\n";

/// Ten thousand chained terms overflowed the CEL parser's stack and aborted the process at
/// start-up; now the file is refused with a located error and the others load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_expression_in_the_flows_dir_is_refused_and_the_rest_load() {
    let long = format!("{}1", "1 + ".repeat(10_000));
    let s = server(|c, dir| {
        let flows = dir.join("flows");
        std::fs::create_dir_all(&flows).unwrap();
        std::fs::write(flows.join("a-bad.yaml"), condition_flow("bad", &long)).unwrap();
        std::fs::write(flows.join("b-good.yaml"), GOOD).unwrap();
        c.flows_dir = Some(flows);
    })
    .await;
    let mut c = client(&s.endpoint).await;
    let flows = c
        .list_flows(pb::ListFlowsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .flows;
    let ids: Vec<&str> = flows.iter().map(|f| f.flow_id.as_str()).collect();
    assert_eq!(ids, ["good"]);

    // Through the API: a located error, small enough for gRPC metadata, not an echo of the
    // 40 KB expression.
    let e = apply(&mut c, &condition_flow("bad", &long))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().starts_with(
            "test.yaml:8:9: node `route`: expression is 40001 bytes; the limit is 4096"
        ),
        "{}",
        e.message()
    );
    // Deep nesting within the size limit.
    let deep = format!("{}1{}", "(".repeat(500), ")".repeat(500));
    let e = apply(&mut c, &condition_flow("bad", &deep))
        .await
        .unwrap_err();
    assert!(
        e.message()
            .contains("node `route`: expression is nested 33 deep; the limit is 32"),
        "{}",
        e.message()
    );
}

/// A validation error that echoed a 125 KB value became "metadata size exceeds hard limit"
/// at the client; now every echo is cut and the status fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_errors_stay_small_whatever_the_flow_echoes() {
    let s = server(|_, _| {}).await;
    let mut c = client(&s.endpoint).await;
    // Large echoes, and many of them, within the flow file limit.
    let huge = "x".repeat(6_000);
    let mut yaml = format!(
        "id: echo\nversion: 1\ninitial: a\nstates:\n  a: {{type: wait, duration: \"{huge}\", next: {huge}}}\n"
    );
    for i in 0..30 {
        yaml.push_str(&format!("  n{i}: {{type: task, next: {huge}}}\n"));
    }
    let e = apply(&mut c, &yaml).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().len() <= 1024, "{}", e.message().len());
    assert!(e.message().contains("is not a duration"), "{}", e.message());
    let bad = e.get_details_bad_request().unwrap();
    assert!(
        bad.field_violations.len() <= 11,
        "{}",
        bad.field_violations.len()
    );
    assert!(
        bad.field_violations
            .iter()
            .all(|v| v.description.chars().count() <= 201)
    );
}

/// Nested comprehensions (10⁹ evaluations) pinned a core with no limit; now the node fails
/// at its budget with RESOURCE_EXHAUSTED and the server keeps answering meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_condition_over_its_budget_fails_its_node_and_rpcs_keep_answering() {
    let s = server(|_, _| {}).await;
    let mut c = client(&s.endpoint).await;
    let list = format!("[{}]", vec!["1"; 300].join(","));
    let slow = format!("{list}.all(x, {list}.all(y, {list}.all(z, true)))");
    assert!(slow.len() < 4096);
    apply(&mut c, &condition_flow("slow", &slow)).await.unwrap();
    let ids = [
        start(&mut c, "slow", json!({})).await,
        start(&mut c, "slow", json!({})).await,
    ];
    // RPCs answer while the conditions run.
    let listed = tokio::time::timeout(
        Duration::from_secs(5),
        c.list_flows(pb::ListFlowsRequest::default()),
    )
    .await
    .expect("ListFlows answers while conditions are evaluated");
    assert!(listed.is_ok());
    for id in ids {
        let t = wait_for(&s.endpoint, &id, pb::TaskStatus::Failed).await;
        assert!(
            t.error
                .contains("condition of node `route` exceeded its evaluation budget of "),
            "{}",
            t.error
        );
    }
}

const LOOP: &str = "id: loop\nversion: 1\ninitial: a\nstates:\n  a: {type: condition, conditions: [{if: 'true', next: b}], default: done}\n  b: {type: condition, conditions: [{if: 'true', next: a}], default: done}\n  done: {type: succeed}\n";

/// Condition nodes that point at each other looped forever; now the task fails at the
/// visit bound, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_of_nodes_ends_at_the_visit_bound() {
    let s = server(|c, _| c.max_node_visits = 50).await;
    let mut c = client(&s.endpoint).await;
    apply(&mut c, LOOP).await.unwrap();
    let id = start(&mut c, "loop", json!({})).await;
    let t = wait_for(&s.endpoint, &id, pb::TaskStatus::Failed).await;
    assert!(
        t.error.contains(
            "the task made 51 node visits, over the bound of 50 (orchestrator.max_node_visits)"
        ),
        "{}",
        t.error
    );
    assert_eq!(t.nodes.len(), 51);
}

/// CancelTask answered "changes too fast to apply the command" to a looping task every
/// time; now a cancel always gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_wins_against_a_busy_task() {
    let s = server(|c, _| c.max_node_visits = 10_000_000).await;
    let mut c = client(&s.endpoint).await;
    apply(&mut c, LOOP).await.unwrap();
    let id = start(&mut c, "loop", json!({})).await;
    eventually("the task loops", Duration::from_secs(10), || {
        let endpoint = s.endpoint.clone();
        let id = id.clone();
        async move {
            status_of(&endpoint, &id)
                .await
                .filter(|t| t.nodes.len() > 200)
        }
    })
    .await;
    for _ in 0..3 {
        let cancelled = c
            .cancel_task(pb::CancelTaskRequest {
                task_id: id.clone(),
                reason: "stop".into(),
            })
            .await;
        match cancelled {
            Ok(_) => break,
            Err(e) => {
                // The only acceptable refusal: it ended already (by an earlier try).
                assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
            }
        }
    }
    let t = wait_for(&s.endpoint, &id, pb::TaskStatus::Cancelled).await;
    assert_eq!(t.error, "stop");
}

const ACT: &str = "id: act\nversion: 1\ninitial: act\nstates:\n  act:\n    type: task\n    capability: test.act\n    timeout: 2s\n    retry: {max_attempts: 3, initial_interval: 10ms}\n    next: done\n  done: {type: succeed}\n";

/// The router answering "nothing routable" spent a node's three attempts in half a second;
/// now such a try is sent again after a pause, as the same attempt, until an instance takes
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tries_that_were_not_delivered_are_not_attempts() {
    let s = server(|_, _| {}).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    s.router.handle("test.act", move |_| {
        if seen.fetch_add(1, Ordering::SeqCst) < 5 {
            let refusal = if seen.load(Ordering::SeqCst).is_multiple_of(2) {
                reason::ROUTE_NOT_FOUND
            } else {
                reason::INSTANCE_UNAVAILABLE
            };
            return Err(status_with_reason(
                Code::Unavailable,
                "no routable instance of test.act; the message was not delivered: retry it",
                refusal,
                [],
            ));
        }
        Ok(json!({"done": true}))
    });
    let mut c = client(&s.endpoint).await;
    // Five pauses of 50 ms doubling take about 1.6 s: well within the timeout.
    apply(&mut c, &ACT.replace("timeout: 2s", "timeout: 20s"))
        .await
        .unwrap();
    let id = start(&mut c, "act", json!({})).await;
    let t = wait_for(&s.endpoint, &id, pb::TaskStatus::Succeeded).await;
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    assert_eq!(t.nodes[0].attempts, 1, "{:#?}", t.nodes[0]);
    // Every try carried the same message id (the SDK's dedupe key).
    let deliveries = s.router.deliveries();
    assert!(
        deliveries
            .iter()
            .all(|d| d.message_id == deliveries[0].message_id)
    );
}

/// With the router down (connection refused) and back 1 s later, the task succeeds on its
/// first attempt instead of spending its attempts on connect errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_comes_back_costs_no_attempt() {
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let s = server(|c, _| c.router_endpoint = format!("http://127.0.0.1:{port}")).await;
    let mut c = client(&s.endpoint).await;
    apply(&mut c, &ACT.replace("timeout: 2s", "timeout: 20s"))
        .await
        .unwrap();
    let id = start(&mut c, "act", json!({})).await;
    // The outage: nothing listens on the router's port for a while.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let router = common::TestRouter::default();
    router.handle("test.act", |_| Ok(json!({"done": true})));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let (_url, _stop) = router.serve_on(listener);
    let t = wait_for(&s.endpoint, &id, pb::TaskStatus::Succeeded).await;
    assert_eq!(t.nodes[0].attempts, 1, "{:#?}", t.nodes[0]);
    assert_eq!(router.deliveries().len(), 1);
}

/// While nothing is routable the attempt waits within its timeout, then fails with
/// DEADLINE_EXCEEDED saying nothing was routable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_that_finds_nothing_routable_fails_at_its_timeout() {
    let s = server(|_, _| {}).await;
    s.router.handle("test.act", |_| {
        Err(status_with_reason(
            Code::NotFound,
            "no routable instance of test.act",
            reason::ROUTE_NOT_FOUND,
            [],
        ))
    });
    let mut c = client(&s.endpoint).await;
    apply(
        &mut c,
        &ACT.replace("timeout: 2s", "timeout: 700ms")
            .replace("max_attempts: 3", "max_attempts: 1"),
    )
    .await
    .unwrap();
    let id = start(&mut c, "act", json!({})).await;
    let t = wait_for(&s.endpoint, &id, pb::TaskStatus::Failed).await;
    assert!(
        // The window is the node's 700 ms timeout, measured from the attempt's start (so
        // it may print a millisecond less).
        t.error
            .starts_with("node act failed: nothing routable took `test.act` within 69")
            || t.error
                .starts_with("node act failed: nothing routable took `test.act` within 700ms"),
        "{}",
        t.error
    );
    assert!(t.error.contains("ROUTE_NOT_FOUND") || t.error.contains("NOT_FOUND"));
    assert_eq!(t.nodes[0].attempts, 1);
    assert!(s.router.deliveries().len() > 2, "it kept trying");
    let dump = c
        .dump_task(pb::DumpTaskRequest { task_id: id })
        .await
        .unwrap()
        .into_inner();
    let failed = dump.records.iter().find_map(|r| match &r.record {
        Some(pb::dump_record::Record::Event(e)) if e.kind == "attempt_failed" => Some(e.clone()),
        _ => None,
    });
    let detail = reach_orchestrator::json::from_proto(&failed.unwrap().detail.unwrap());
    assert_eq!(detail["code"], "DEADLINE_EXCEEDED");
}

/// A cancelled task's pending timers are cancelled in its history, with their purpose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_task_lists_its_cancelled_timers() {
    let s = server(|_, _| {}).await;
    let mut c = client(&s.endpoint).await;
    apply(
        &mut c,
        "id: pause\nversion: 1\ninitial: pause\nstates:\n  pause: {type: wait, duration: 1h, next: done}\n  done: {type: succeed}\n",
    )
    .await
    .unwrap();
    let id = start(&mut c, "pause", json!({})).await;
    eventually("the wait is scheduled", Duration::from_secs(10), || {
        let endpoint = s.endpoint.clone();
        let id = id.clone();
        async move {
            let mut c = client(&endpoint).await;
            let dump = c
                .dump_task(pb::DumpTaskRequest { task_id: id })
                .await
                .ok()?
                .into_inner();
            dump.records
                .iter()
                .any(|r| matches!(&r.record, Some(pb::dump_record::Record::Event(e)) if e.kind == "timer_scheduled"))
                .then_some(())
        }
    })
    .await;
    c.cancel_task(pb::CancelTaskRequest {
        task_id: id.clone(),
        reason: String::new(),
    })
    .await
    .unwrap();
    let dump = c
        .dump_task(pb::DumpTaskRequest { task_id: id })
        .await
        .unwrap()
        .into_inner();
    let cancelled: Vec<serde_json::Value> = dump
        .records
        .iter()
        .filter_map(|r| match &r.record {
            Some(pb::dump_record::Record::Event(e)) if e.kind == "timer_cancelled" => Some(
                reach_orchestrator::json::from_proto(e.detail.as_ref().unwrap()),
            ),
            _ => None,
        })
        .collect();
    assert_eq!(cancelled.len(), 1, "{cancelled:#?}");
    assert_eq!(cancelled[0]["purpose"], "wait");
}
