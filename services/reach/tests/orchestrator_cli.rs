//! The orchestrator commands of the CLI (`reach flow`, `reach task`, `reach dump`) against a
//! real orchestrator server.

/// The orchestrator tests' fake router and server harness, shared rather than copied.
#[path = "../../orchestrator/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::{REVIEW_V1, eventually, server, wait_for};
use reach::cli;
use reach_proto::v1 as pb;
use reach_router::ledger::{CallOutcome, LedgerSink, LedgerSinkConfig};
use serde_json::json;
use tonic::Status;

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
        cli::flow::flow_apply(&s.endpoint, &file, &mut o)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        String::from_utf8_lossy(&o).trim(),
        "flow review version 1 applied"
    );
    let mut o = out();
    assert_eq!(
        cli::flow::flow_apply(&s.endpoint, &file, &mut o)
            .await
            .unwrap(),
        0
    );
    assert!(String::from_utf8_lossy(&o).contains("unchanged"));
    // Same version, other text: refused with the fix.
    std::fs::write(&file, REVIEW_V1.replace("withdrawn}", "withdrawn by user}")).unwrap();
    let mut o = out();
    assert_eq!(
        cli::flow::flow_apply(&s.endpoint, &file, &mut o)
            .await
            .unwrap(),
        1
    );
    assert!(String::from_utf8_lossy(&o).contains("bump `version`"));
    let mut o = out();
    cli::flow::flow_list(&s.endpoint, &mut o).await.unwrap();
    assert!(String::from_utf8_lossy(&o).contains("review"));

    // start -> waiting; a bad resume names the field; a good one finishes the task.
    let mut o = out();
    cli::task::task_start(
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
    cli::task::task_start(
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
    cli::task::task_list(&s.endpoint, Some("waiting_human"), None, 10, false, &mut o)
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&o).contains("order-42"));
    // --json: an array of tasks for scripts, each as `task get --json` shows it.
    let mut o = out();
    cli::task::task_list(&s.endpoint, Some("waiting_human"), None, 10, true, &mut o)
        .await
        .unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&o).unwrap();
    assert_eq!(listed[0]["task_id"], "order-42", "{listed}");
    assert_eq!(listed[0]["status"], "WAITING_HUMAN", "{listed}");
    let err = cli::task::task_resume(&s.endpoint, &id, r#"{"approved": "yes"}"#, None, &mut out())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("invalid argument:") && text.contains("/approved"),
        "{text}"
    );
    assert!(matches!(
        cli::task::task_list(&s.endpoint, Some("sleeping"), None, 10, false, &mut out()).await,
        Err(cli::CliError::Usage(_))
    ));
    cli::task::task_resume(&s.endpoint, &id, r#"{"approved": true}"#, None, &mut out())
        .await
        .unwrap();
    wait_for(&s.endpoint, &id, pb::TaskStatus::Succeeded).await;

    let mut o = out();
    cli::task::task_watch(&s.endpoint, &id, &mut o)
        .await
        .unwrap();
    let watched = String::from_utf8(o).unwrap();
    assert!(
        watched.lines().last().unwrap().contains("task_ended"),
        "{watched}"
    );

    // get --json is masked: the e-mail and the configured field never show.
    let mut o = out();
    cli::task::task_get(&s.endpoint, &id, true, &mut o)
        .await
        .unwrap();
    let shown = String::from_utf8(o).unwrap();
    let v: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(v["status"], "SUCCEEDED");
    assert!(
        !shown.contains("jane@example.com") && !shown.contains("Jane Roe"),
        "{shown}"
    );
    assert_eq!(v["nodes"][1]["output"]["customer_name"], "***");
    let mut o = out();
    cli::task::task_get(&s.endpoint, &id, false, &mut o)
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&o).contains("SUCCEEDED"));

    // cancel while waiting goes to on_cancel; retry of a cancelled task is refused.
    let mut o = out();
    cli::task::task_start(&s.endpoint, "review", "{}", 0, None, true, &mut o)
        .await
        .unwrap();
    let id2 = started_id(o);
    wait_for(&s.endpoint, &id2, pb::TaskStatus::WaitingHuman).await;
    cli::task::task_cancel(&s.endpoint, &id2, "customer withdrew", &mut out())
        .await
        .unwrap();
    let t = wait_for(&s.endpoint, &id2, pb::TaskStatus::Failed).await;
    assert_eq!(t.failed_node, "withdrawn");

    // A task node failing for good is a dead letter; retry runs it again.
    s.router
        .handle("test.act", |_| Err(Status::invalid_argument("refused")));
    let mut o = out();
    cli::task::task_start(&s.endpoint, "review", "{}", 0, None, true, &mut o)
        .await
        .unwrap();
    let id3 = started_id(o);
    wait_for(&s.endpoint, &id3, pb::TaskStatus::WaitingHuman).await;
    cli::task::task_resume(&s.endpoint, &id3, r#"{"approved": true}"#, None, &mut out())
        .await
        .unwrap();
    wait_for(&s.endpoint, &id3, pb::TaskStatus::Failed).await;
    let mut o = out();
    cli::task::dead_letters(&s.endpoint, None, &mut o)
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&o).contains(&id3));
    s.router.handle("test.act", |_| Ok(json!({"acted": true})));
    let mut o = out();
    cli::task::task_retry(&s.endpoint, &id3, &mut o)
        .await
        .unwrap();
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

/// A task waiting for a person says what it waits for (the task's input — what the reviewer
/// decides on —, the human node, its prompt, schema and timeout, the command to resume it)
/// and shows no output: the condition node's output before
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
        cli::flow::flow_apply(&s.endpoint, &file, &mut out())
            .await
            .unwrap(),
        0
    );
    let mut o = out();
    cli::task::task_start(
        &s.endpoint,
        "triage",
        r#"{"complaint": "charged twice"}"#,
        0,
        None,
        true,
        &mut o,
    )
    .await
    .unwrap();
    let id = started_id(o);
    wait_for(&s.endpoint, &id, pb::TaskStatus::WaitingHuman).await;

    let mut o = out();
    cli::task::task_get(&s.endpoint, &id, false, &mut o)
        .await
        .unwrap();
    let shown = String::from_utf8(o).unwrap();
    for expected in [
        "status    WAITING_HUMAN",
        r#"input     {"complaint":"charged twice"}"#,
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
    cli::task::task_get(&s.endpoint, &id, true, &mut o)
        .await
        .unwrap();
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
    cli::task::task_start(
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
    cli::task::task_resume(
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
    cli::task::task_get(&s.endpoint, &id, true, &mut o)
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o).unwrap();
    assert_eq!(v["output"], json!({"category": "servicing"}), "{v:#}");
    assert_eq!(v["waiting"], serde_json::Value::Null);
    let mut o = out();
    cli::task::task_get(&s.endpoint, &id, false, &mut o)
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&o).contains(r#"output    {"category":"servicing"}"#),
        "{}",
        String::from_utf8_lossy(&o)
    );
}

#[test]
fn flow_validate_cli_reports_located_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.yaml");
    std::fs::write(&file, "id: bad\nversion: 1\ninitial: start\nstates:\n  start: {type: task, capability: x, next: missing}\n  done: {type: succeed}\n").unwrap();
    let mut out = Vec::new();
    let code = cli::flow::flow_validate(&file, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert_eq!(code, 1);
    assert!(
        text.contains("bad.yaml:5:38: node `start`: `next: missing` names no node"),
        "{text}"
    );
    for example in ["complaint-flow.yaml", "order-flow.yaml"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/flows")
            .join(example);
        let mut out = Vec::new();
        assert_eq!(
            cli::flow::flow_validate(&path, &mut out).unwrap(),
            0,
            "{}",
            String::from_utf8_lossy(&out)
        );
    }
}

/// What an agent's replies say their model calls cost is summed per task: `reach task get`
/// shows it (and `--json` carries it per node), and so does `reach dump`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_get_and_dump_show_the_tokens_the_agents_reported() {
    let s = server(|_, _| {}).await;
    s.router
        .handle("test.ask", |_| Ok(json!({"answer": "yes"})));
    s.router.report_usage(
        "test.ask",
        reach_rpc::usage::TokenUsage {
            input_tokens: 1200,
            output_tokens: 300,
            model_calls: 2,
        },
    );
    s.router.handle("test.plain", |_| Ok(json!({})));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ask.yaml");
    std::fs::write(
        &file,
        "id: ask\nversion: 1\ninitial: first\nstates:\n  first: {type: task, capability: test.ask, next: plain}\n  plain: {type: task, capability: test.plain, next: second}\n  second: {type: task, capability: test.ask, next: done}\n  done: {type: succeed}\n",
    )
    .unwrap();
    cli::flow::flow_apply(&s.endpoint, &file, &mut out())
        .await
        .unwrap();
    cli::task::task_start(
        &s.endpoint,
        "ask",
        "{}",
        0,
        Some("ask-1".into()),
        true,
        &mut out(),
    )
    .await
    .unwrap();
    wait_for(&s.endpoint, "ask-1", pb::TaskStatus::Succeeded).await;

    let mut o = out();
    cli::task::task_get(&s.endpoint, "ask-1", false, &mut o)
        .await
        .unwrap();
    let text = String::from_utf8(o).unwrap();
    assert!(
        text.contains("tokens    2400 in, 600 out (4 model calls)"),
        "{text}"
    );
    let mut o = out();
    cli::task::task_get(&s.endpoint, "ask-1", true, &mut o)
        .await
        .unwrap();
    let task: serde_json::Value = serde_json::from_slice(&o).unwrap();
    assert_eq!(
        task["usage"],
        json!({"input_tokens": 2400, "output_tokens": 600, "model_calls": 4})
    );
    let per_node: Vec<&serde_json::Value> = task["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| &n["usage"])
        .collect();
    assert_eq!(per_node[0]["input_tokens"], 1200);
    assert!(
        per_node[1].is_null(),
        "a reply that reported nothing: {per_node:?}"
    );
    assert_eq!(per_node[2]["model_calls"], 2);

    let mut o = out();
    cli::dump::dump(
        &s.endpoint,
        cli::dump::DumpArgs {
            task: "ask-1".into(),
            json: false,
        },
        &mut o,
    )
    .await
    .unwrap();
    let dump = String::from_utf8(o).unwrap();
    assert!(
        dump.contains("tokens 2400 in, 600 out (4 model calls)"),
        "{dump}"
    );
    assert_eq!(dump.matches("model_usage").count(), 2, "{dump}");
}

/// `task list` says when it stopped at `--limit`, and fetches several pages for a limit
/// over one page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_list_says_when_there_are_more_than_the_limit() {
    let s = server(|_, _| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("review.yaml");
    std::fs::write(&file, REVIEW_V1).unwrap();
    cli::flow::flow_apply(&s.endpoint, &file, &mut out())
        .await
        .unwrap();
    for i in 0..3 {
        let id = format!("listed-{i}");
        cli::task::task_start(
            &s.endpoint,
            "review",
            "{}",
            0,
            Some(id.clone()),
            true,
            &mut out(),
        )
        .await
        .unwrap();
        wait_for(&s.endpoint, &id, pb::TaskStatus::WaitingHuman).await;
    }
    let list = |limit: u32| {
        let endpoint = s.endpoint.clone();
        async move {
            let mut o = out();
            cli::task::task_list(&endpoint, None, Some("review"), limit, false, &mut o)
                .await
                .unwrap();
            String::from_utf8(o).unwrap()
        }
    };
    let two = list(2).await;
    assert_eq!(two.matches("listed-").count(), 2, "{two}");
    assert!(
        two.contains("showing the first 2 tasks; there are more"),
        "{two}"
    );
    let all = list(3).await;
    assert_eq!(all.matches("listed-").count(), 3, "{all}");
    assert!(!all.contains("there are more"), "{all}");
}
