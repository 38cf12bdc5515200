//! Flow behaviour against a real orchestrator and an in-test router, on SQLite and PostgreSQL.

mod common;

use std::time::Duration;

use common::{TestRouter, eventually, store_url};
use reach_orchestrator::event::{Event, TaskStatus, TimerPurpose};
use reach_orchestrator::{Orchestrator, OrchestratorConfig};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use serde_json::json;
use tonic::Status;
use tonic_types::StatusExt;

const COMPLAINT: &str = include_str!("../../../examples/flows/complaint-flow.yaml");

const PARALLEL: &str = r#"
id: fanout
version: 1
initial: notify
states:
  notify:
    type: parallel
    branches:
      - {name: email, capability: notify.email}
      - {name: sms, capability: notify.sms}
      - {name: push, capability: notify.push}
    success_threshold: THRESHOLD
    next: done
  done: {type: succeed}
"#;

const RETRYING: &str = r#"
id: retrying
version: 1
initial: flaky
states:
  flaky:
    type: task
    capability: test.flaky
    retry: {max_attempts: 4, initial_interval: 1s, multiplier: 2, max_interval: 10s, jitter: 0}
    catch: recover
    next: done
  recover: {type: task, capability: test.recover, next: done}
  done: {type: succeed}
"#;

struct Env {
    _dir: tempfile::TempDir,
    router: TestRouter,
    _router_stop: tokio::sync::oneshot::Sender<()>,
    orch_stop: Option<tokio::sync::oneshot::Sender<()>>,
    client: OrchestratorServiceClient<tonic::transport::Channel>,
    engine: reach_orchestrator::Engine,
}

async fn env(backend: &str, flows: &[&str]) -> Option<Env> {
    let dir = tempfile::tempdir().unwrap();
    let url = store_url(backend, dir.path()).await?;
    let router = TestRouter::default();
    let (router_url, router_stop) = router.serve().await;
    let config = OrchestratorConfig {
        store_url: url,
        router_endpoint: router_url,
        poll_interval: Duration::from_millis(100),
        ..Default::default()
    };
    let orch = Orchestrator::new(config).await.unwrap();
    for f in flows {
        orch.engine()
            .flows()
            .apply("test", f, orch.engine().clock().now_ms())
            .await
            .unwrap();
    }
    let engine = orch.engine().clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        orch.serve(listener, async move {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    let client = OrchestratorServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    Some(Env {
        _dir: dir,
        router,
        _router_stop: router_stop,
        orch_stop: Some(tx),
        client,
        engine,
    })
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(tx) = self.orch_stop.take() {
            let _ = tx.send(());
        }
    }
}

impl Env {
    async fn start(&mut self, flow: &str, input: serde_json::Value) -> String {
        self.client
            .start_task(pb::StartTaskRequest {
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

    async fn task(&mut self, id: &str) -> pb::Task {
        self.client
            .get_task(pb::GetTaskRequest { task_id: id.into() })
            .await
            .unwrap()
            .into_inner()
            .task
            .unwrap()
    }

    async fn wait_status(&mut self, id: &str, status: pb::TaskStatus) -> pb::Task {
        let mut c = self.client.clone();
        let id = id.to_string();
        eventually(
            &format!("task {id} {status:?}"),
            Duration::from_secs(30),
            || {
                let mut c = c.clone();
                let id = id.clone();
                async move {
                    let t = c
                        .get_task(pb::GetTaskRequest { task_id: id })
                        .await
                        .ok()?
                        .into_inner()
                        .task?;
                    (t.status == status as i32).then_some(t)
                }
            },
        )
        .await;

        c.get_task(pb::GetTaskRequest { task_id: id })
            .await
            .unwrap()
            .into_inner()
            .task
            .unwrap()
    }
}

fn classify_handler(router: &TestRouter) {
    router.handle("complaint.classify", |d| {
        let text = d.input["complaint"].as_str().unwrap_or_default().to_string();
        Ok(if text.contains("unclear") {
            json!({"category": "servicing", "confidence": 0.2, "capability": "complaint.servicing"})
        } else {
            json!({"category": "servicing", "confidence": 0.93, "capability": "complaint.servicing"})
        })
    });
    router.handle("complaint.servicing", |d| {
        Ok(json!({"resolution": "refund issued", "seen": d.input.clone()}))
    });
}

macro_rules! both_backends {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                super::$name("sqlite").await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$name("postgres").await;
            }
        }
    };
}

async fn complaint_routes_and_waits_for_a_person(backend: &str) {
    let Some(mut env) = env(backend, &[COMPLAINT]).await else {
        return;
    };
    classify_handler(&env.router);

    // Confident: classify -> route -> servicing -> done.
    let id = env
        .start(
            "complaint-flow",
            json!({"complaint": "they charged me twice, mail me at a@b.com"}),
        )
        .await;
    let task = env.wait_status(&id, pb::TaskStatus::Succeeded).await;
    let nodes: Vec<&str> = task.nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(nodes, ["classify", "route", "servicing", "done"]);
    // Masked in what is shown.
    let input = reach_orchestrator::json::from_proto_opt(task.input.as_ref());
    assert!(!input.to_string().contains("a@b.com"), "{input}");
    // One fresh trace id per task, carried by every call, never reused.
    let deliveries = env.router.deliveries();
    assert!(
        deliveries
            .iter()
            .filter(|d| d.task_id == id)
            .all(|d| d.trace_id == task.trace_id)
    );
    let id2 = env
        .start("complaint-flow", json!({"complaint": "late fee"}))
        .await;
    let t2 = env.wait_status(&id2, pb::TaskStatus::Succeeded).await;
    assert_ne!(t2.trace_id, task.trace_id);

    // Unsure: a human review; a bad resume is refused with the field path.
    let id3 = env
        .start("complaint-flow", json!({"complaint": "unclear letter"}))
        .await;
    env.wait_status(&id3, pb::TaskStatus::WaitingHuman).await;
    let err = env
        .client
        .resume_task(pb::ResumeTaskRequest {
            task_id: id3.clone(),
            input: Some(reach_orchestrator::json::to_proto(&json!({"category": 7}))),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("/category"), "{}", err.message());
    let fields: Vec<String> = err
        .get_details_bad_request()
        .unwrap()
        .field_violations
        .iter()
        .map(|v| v.field.clone())
        .collect();
    assert!(fields.contains(&"input/category".to_string()), "{fields:?}");
    env.client
        .resume_task(pb::ResumeTaskRequest {
            task_id: id3.clone(),
            input: Some(reach_orchestrator::json::to_proto(
                &json!({"category": "servicing"}),
            )),
            ..Default::default()
        })
        .await
        .unwrap();
    let t3 = env.wait_status(&id3, pb::TaskStatus::Succeeded).await;
    assert!(t3.nodes.iter().any(|n| n.node_id == "human_review"));

    // Listing by status.
    let listed = env
        .client
        .list_tasks(pb::ListTasksRequest {
            status: pb::TaskStatus::Succeeded.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .tasks;
    assert_eq!(listed.len(), 3);
}
both_backends!(complaint_routes_and_waits_for_a_person);

async fn parallel_partial_and_failed(backend: &str) {
    let two = PARALLEL.replace("THRESHOLD", "2");
    let three = PARALLEL
        .replace("THRESHOLD", "3")
        .replace("version: 1", "version: 2");
    let Some(mut env) = env(backend, &[&two]).await else {
        return;
    };
    env.router
        .handle("notify.email", |_| Ok(json!({"sent": true})));
    env.router.handle("notify.sms", |_| {
        Err(Status::invalid_argument("bad phone number"))
    });
    env.router
        .handle("notify.push", |_| Ok(json!({"sent": true})));

    let id = env.start("fanout", json!({})).await;
    let t = env.wait_status(&id, pb::TaskStatus::Partial).await;
    let out = reach_orchestrator::json::from_proto_opt(t.nodes[0].output.as_ref());
    assert_eq!(out["email"]["sent"], true);
    assert!(out["sms"]["error"].as_str().unwrap().contains("bad phone"));

    env.client
        .apply_flow(pb::ApplyFlowRequest {
            yaml: three,
            source: "test".into(),
        })
        .await
        .unwrap();
    let id2 = env.start("fanout", json!({})).await;
    let t2 = env.wait_status(&id2, pb::TaskStatus::Failed).await;
    assert_eq!(t2.flow_version, 2);
    assert_eq!(t2.failed_node, "notify");
    // A dead letter, retried from its failed node once the branch is fixed.
    let dead = env
        .client
        .list_dead_letters(pb::ListDeadLettersRequest::default())
        .await
        .unwrap()
        .into_inner()
        .dead_letters;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].failed_node, "notify");
    env.router
        .handle("notify.sms", |_| Ok(json!({"sent": true})));
    env.client
        .retry_task(pb::RetryTaskRequest {
            task_id: id2.clone(),
        })
        .await
        .unwrap();
    env.wait_status(&id2, pb::TaskStatus::Succeeded).await;
    // The first task kept its version (1) though version 2 was applied.
    assert_eq!(env.task(&id).await.flow_version, 1);
}
both_backends!(parallel_partial_and_failed);

async fn retries_then_catches(backend: &str) {
    let Some(mut env) = env(backend, &[RETRYING]).await else {
        return;
    };
    env.router.handle("test.flaky", |d| {
        if d.input["fail_always"] == true {
            Err(Status::unavailable("down"))
        } else if d.attempt < 3 {
            Err(Status::unavailable("try again"))
        } else {
            Ok(json!({"ok": true}))
        }
    });
    env.router
        .handle("test.recover", |_| Ok(json!({"recovered": true})));
    let id = env.start("retrying", json!({})).await;
    let t = env.wait_status(&id, pb::TaskStatus::Succeeded).await;
    assert_eq!(t.nodes[0].attempts, 3);
    assert_eq!(env.router.effects(&id, "flaky"), 3);

    let id2 = env.start("retrying", json!({"fail_always": true})).await;
    let t2 = env.wait_status(&id2, pb::TaskStatus::Succeeded).await;
    let path: Vec<&str> = t2.nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(path, ["flaky", "recover", "done"]);
    assert_eq!(t2.nodes[0].attempts, 4);
    // Unknown task -> NOT_FOUND; cancel of an ended task -> FAILED_PRECONDITION.
    let e = env
        .client
        .get_task(pb::GetTaskRequest {
            task_id: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert_eq!(
        reach_rpc::errors::reason_of(&e).as_deref(),
        Some(reach_rpc::errors::reason::TASK_NOT_FOUND)
    );
    let e = env
        .client
        .cancel_task(pb::CancelTaskRequest {
            task_id: id2,
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert_eq!(
        reach_rpc::errors::reason_of(&e).as_deref(),
        Some(reach_rpc::errors::reason::TASK_ENDED)
    );
    let _ = env.engine.clone();
}
both_backends!(retries_then_catches);

/// Back-off follows the policy exactly (jitter 0): 1s, 2s, 4s between attempts, read from the
/// durable timers the engine recorded, and no retry is dispatched before its timer — with
/// tokio's paused clock, so the 7 s of back-off take no real time.
///
/// sqlx wraps every pool acquire in a tokio timeout, and a paused clock auto-advances to the
/// nearest timer whenever the runtime idles (here: while SQLite's worker thread or the
/// loopback socket works). A 1 ms ticker keeps a nearer timer pending, so virtual time only
/// creeps forward while real work happens and jumps straight to each back-off deadline when
/// everything waits for it.
#[tokio::test]
async fn backoff_follows_the_policy_with_paused_time() {
    let dir = tempfile::tempdir().unwrap();
    let router = TestRouter::default();
    let (router_url, _stop) = router.serve().await;
    router.handle("test.flaky", |_| Err(Status::unavailable("down")));
    router.handle("test.recover", |_| Ok(json!({})));
    let config = OrchestratorConfig {
        store_url: format!("sqlite://{}/o.db", dir.path().display()),
        router_endpoint: router_url,
        ..Default::default()
    };
    let orch = Orchestrator::new(config).await.unwrap();
    orch.engine()
        .flows()
        .apply("t", RETRYING, orch.engine().clock().now_ms())
        .await
        .unwrap();
    tokio::time::pause();
    let ticker = tokio::spawn(async {
        loop {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    let real = std::time::Instant::now();
    let running = orch.start().unwrap();
    let task = orch
        .engine()
        .start_task("retrying", 0, json!({}), None)
        .await
        .unwrap();
    let engine = orch.engine().clone();
    loop {
        let s = engine.load(&task.id).await.unwrap();
        if s.status.is_terminal() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let events = engine.events_after(&task.id, 0).await.unwrap();
    let mut delays = Vec::new();
    let mut failed_at = None;
    let mut last_fire = 0;
    for e in &events {
        match &e.event {
            Event::AttemptFailed { .. } => failed_at = Some(e.at_ms),
            Event::TimerScheduled {
                purpose: TimerPurpose::Backoff,
                fire_at_ms,
                ..
            } => {
                delays.push(fire_at_ms - failed_at.unwrap());
                last_fire = *fire_at_ms;
            }
            Event::AttemptStarted { attempt, .. } if *attempt > 1 => assert!(
                e.at_ms >= last_fire,
                "attempt {attempt} before its back-off ended"
            ),
            _ => {}
        }
    }
    assert_eq!(delays, [1000, 2000, 4000]);
    let s = engine.load(&task.id).await.unwrap();
    assert_eq!(s.status, TaskStatus::Succeeded);
    assert_eq!(
        s.visits.iter().map(|v| v.node.as_str()).collect::<Vec<_>>(),
        ["flaky", "recover", "done"]
    );
    // Not a timing assertion on the flow: just that the clock really was virtual.
    eprintln!("7 s of back-off ran in {:?} of real time", real.elapsed());
    ticker.abort();
    running.shutdown().await;
}
