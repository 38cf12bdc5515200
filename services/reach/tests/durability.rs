//! Durability: SIGKILL a real orchestrator process (`reach orchestrator`) mid-flow and restart
//! it; two replicas on one PostgreSQL run each node once.

/// The orchestrator tests' fake router and store helpers, shared rather than copied.
#[path = "../../orchestrator/tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{TestRouter, eventually, store_url};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use serde_json::json;
use tonic::Status;

const CRASH_FLOW: &str = r#"
id: crash-flow
version: 1
initial: route
states:
  route:
    type: condition
    conditions:
      - {if: "input.stage == 'mid_node'", next: slow}
      - {if: "input.stage == 'backoff'", next: flaky}
      - {if: "input.stage == 'wait'", next: pause}
    default: review
  slow: {type: task, capability: test.slow, timeout: 120s, next: after}
  flaky:
    type: task
    capability: test.flaky
    retry: {max_attempts: 3, initial_interval: 4s, jitter: 0}
    next: after
  pause: {type: wait, duration: 4s, next: after}
  review: {type: human, next: after}
  after: {type: task, capability: test.after, next: done}
  done: {type: succeed}
"#;

struct Proc {
    child: Child,
    endpoint: String,
}

fn spawn(store: &str, flows: &std::path::Path, router: &str) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_reach"))
        .args([
            "orchestrator",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "",
            "--store",
            store,
            "--router",
            router,
        ])
        .arg("--flows")
        .arg(flows)
        .env("REACH_ORCHESTRATOR__NODE_ID", "crash-test")
        .env("REACH_ORCHESTRATOR__LEASE", "3s")
        .env("REACH_ORCHESTRATOR__POLL_INTERVAL", "100ms")
        .env("REACH_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn reach orchestrator");
    // The banner's `grpc` line names the bound address: `grpc         http://ADDR  (...)`.
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let endpoint = loop {
        let mut line = String::new();
        assert_ne!(
            stdout.read_line(&mut line).unwrap(),
            0,
            "reach orchestrator exited"
        );
        if let Some(rest) = line.strip_prefix("grpc") {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    // Keep reading the banner so the process never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    Proc { child, endpoint }
}

async fn get(
    c: &mut OrchestratorServiceClient<tonic::transport::Channel>,
    id: &str,
) -> Option<pb::Task> {
    c.get_task(pb::GetTaskRequest { task_id: id.into() })
        .await
        .ok()?
        .into_inner()
        .task
}

async fn sigkill_and_restart(backend: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = store_url(backend, dir.path()).await else {
        return;
    };
    let flows = dir.path().join("flows");
    std::fs::create_dir_all(&flows).unwrap();
    std::fs::write(flows.join("crash.yaml"), CRASH_FLOW).unwrap();

    let router = TestRouter::default();
    let (router_url, _stop) = router.serve().await;
    // The first delivery of test.slow hangs (the process dies meanwhile); a redelivery of the
    // same message id answers at once.
    router.handle("test.slow", |d| {
        if d.redelivery == 0 {
            Err(Status::aborted("sleep:600000"))
        } else {
            Ok(json!({"slow": "done"}))
        }
    });
    router.handle("test.flaky", |d| {
        if d.attempt == 1 {
            Err(Status::unavailable("first attempt fails"))
        } else {
            Ok(json!({"flaky": "done"}))
        }
    });
    router.handle("test.after", |_| Ok(json!({"after": "done"})));

    let mut p1 = spawn(&url, &flows, &router_url);
    let mut c = OrchestratorServiceClient::connect(p1.endpoint.clone())
        .await
        .unwrap();
    let mut ids = HashMap::new();
    for stage in ["human", "mid_node", "wait", "backoff"] {
        let t = c
            .start_task(pb::StartTaskRequest {
                flow_id: "crash-flow".into(),
                input: Some(reach_orchestrator::json::to_proto(&json!({"stage": stage}))),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .task
            .unwrap();
        ids.insert(stage, t.task_id);
    }
    // Wait until every task is where we want to kill it.
    let c1 = c.clone();
    let ids1 = ids.clone();
    let router1 = router.clone();
    eventually("tasks staged", Duration::from_secs(30), || {
        let mut c = c1.clone();
        let ids = ids1.clone();
        let router = router1.clone();
        async move {
            let human = get(&mut c, &ids["human"]).await?;
            let wait = get(&mut c, &ids["wait"]).await?;
            let backoff = get(&mut c, &ids["backoff"]).await?;
            let mid = router
                .deliveries()
                .iter()
                .any(|d| d.task_id == ids["mid_node"] && d.node == "slow");
            let in_backoff = backoff.current_node == "flaky"
                && backoff.nodes.last().is_some_and(|n| !n.error.is_empty());
            (human.status == pb::TaskStatus::WaitingHuman as i32
                && wait.current_node == "pause"
                && in_backoff
                && mid)
                .then_some(())
        }
    })
    .await;
    p1.child.kill().unwrap(); // SIGKILL
    p1.child.wait().unwrap();

    let mut p2 = spawn(&url, &flows, &router_url);
    let mut c = OrchestratorServiceClient::connect(p2.endpoint.clone())
        .await
        .unwrap();
    c.resume_task(pb::ResumeTaskRequest {
        task_id: ids["human"].clone(),
        input: Some(reach_orchestrator::json::to_proto(&json!({"ok": true}))),
        ..Default::default()
    })
    .await
    .unwrap();
    for (stage, id) in &ids {
        let c2 = c.clone();
        let id2 = id.clone();
        eventually(
            &format!("{stage} task succeeds after restart"),
            Duration::from_secs(60),
            || {
                let mut c = c2.clone();
                let id = id2.clone();
                async move {
                    get(&mut c, &id)
                        .await
                        .filter(|t| t.status == pb::TaskStatus::Succeeded as i32)
                }
            },
        )
        .await;
        // Each node completed exactly once; each timer fired at most once, and every timer
        // that was not cancelled fired exactly once.
        let dump = c
            .dump_task(pb::DumpTaskRequest {
                task_id: id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        let mut completed: HashMap<String, usize> = HashMap::new();
        let mut scheduled: HashMap<String, usize> = HashMap::new();
        let mut fired: HashMap<String, usize> = HashMap::new();
        let mut cancelled: HashMap<String, usize> = HashMap::new();
        for r in &dump.records {
            let Some(pb::dump_record::Record::Event(e)) = &r.record else {
                continue;
            };
            let detail = reach_orchestrator::json::from_proto_opt(e.detail.as_ref());
            let timer = detail["timer"].as_str().unwrap_or_default().to_string();
            match e.kind.as_str() {
                "node_completed" => *completed.entry(e.node_id.clone()).or_default() += 1,
                "timer_scheduled" => *scheduled.entry(timer).or_default() += 1,
                "timer_fired" => *fired.entry(timer).or_default() += 1,
                "timer_cancelled" => *cancelled.entry(timer).or_default() += 1,
                _ => {}
            }
        }
        assert!(
            completed.values().all(|n| *n == 1),
            "{stage}: {completed:?}"
        );
        assert_eq!(completed.get("after"), Some(&1), "{stage}");
        assert_eq!(completed.get("done"), Some(&1), "{stage}");
        for (t, n) in &scheduled {
            assert_eq!(*n, 1, "{stage}: timer {t} scheduled twice");
            let f = fired.get(t).copied().unwrap_or(0);
            let x = cancelled.get(t).copied().unwrap_or(0);
            assert_eq!(
                f + x,
                1,
                "{stage}: timer {t} fired {f} and cancelled {x} times"
            );
        }
        if *stage == "wait" || *stage == "backoff" {
            assert_eq!(fired.len(), 1, "{stage}: its timer fired once: {fired:?}");
        }
        // Side effects once: one message id per node (a redelivery reuses the id).
        assert_eq!(router.effects(id, "after"), 1, "{stage}");
    }
    assert_eq!(router.effects(&ids["mid_node"], "slow"), 1);
    assert_eq!(
        router
            .deliveries()
            .iter()
            .filter(|d| d.task_id == ids["mid_node"] && d.node == "slow")
            .count(),
        2,
        "the in-flight call was re-sent once after the restart"
    );
    assert_eq!(router.effects(&ids["backoff"], "flaky"), 2);
    p2.child.kill().unwrap();
    let _ = p2.child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_restart_sqlite() {
    sigkill_and_restart("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_restart_postgres() {
    sigkill_and_restart("postgres").await;
}

const REPLICA_FLOW: &str = r#"
id: replicas
version: 1
initial: first
states:
  first: {type: task, capability: test.first, next: pause}
  pause: {type: wait, duration: 200ms, next: second}
  second: {type: task, capability: test.second, next: done}
  done: {type: succeed}
"#;

/// Two orchestrator replicas on one PostgreSQL: every node of every task runs once, and when
/// one replica dies the other takes its tasks over after their leases expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_postgres_run_each_node_once() {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = store_url("postgres", dir.path()).await else {
        return;
    };
    let router = TestRouter::default();
    let (router_url, _stop) = router.serve().await;
    router.handle("test.first", |_| Ok(json!({"n": 1})));
    router.handle("test.second", |_| Ok(json!({"n": 2})));
    let mut replicas = Vec::new();
    for name in ["replica-a", "replica-b"] {
        let config = reach_orchestrator::OrchestratorConfig {
            store_url: url.clone(),
            router_endpoint: router_url.clone(),
            node_id: Some(name.into()),
            lease: Duration::from_secs(2),
            poll_interval: Duration::from_millis(50),
            ..Default::default()
        };
        let orch = reach_orchestrator::Orchestrator::new(config).await.unwrap();
        let _ = orch
            .engine()
            .flows()
            .apply("t", REPLICA_FLOW, orch.engine().clock().now_ms())
            .await;
        let running = orch.start().unwrap();
        replicas.push((orch, running));
    }
    // Both replicas know the flow (the second applied the same text: unchanged).
    let mut ids = Vec::new();
    for i in 0..40 {
        let (orch, _) = &replicas[i % 2];
        ids.push(
            orch.engine()
                .start_task("replicas", 0, json!({"i": i}), None)
                .await
                .unwrap()
                .id,
        );
    }
    // Replica A stops half-way as if it crashed (no lease handed over), once it has driven
    // some of its tasks into their first call: B takes its tasks once their leases expire.
    let (orch_a, running_a) = replicas.remove(0);
    let a_ids: Vec<String> = ids.iter().step_by(2).cloned().collect();
    let router_a = router.clone();
    eventually(
        "replica A calls for its tasks",
        Duration::from_secs(30),
        || {
            let started = router_a
                .deliveries()
                .iter()
                .any(|d| a_ids.contains(&d.task_id));
            async move { started.then_some(()) }
        },
    )
    .await;
    running_a.abort();
    drop(orch_a);
    let (orch_b, running_b) = replicas.remove(0);
    for id in &ids {
        let engine = orch_b.engine().clone();
        let id2 = id.clone();
        eventually(
            &format!("task {id} succeeds"),
            Duration::from_secs(60),
            || {
                let engine = engine.clone();
                let id = id2.clone();
                async move {
                    engine
                        .load(&id)
                        .await
                        .ok()
                        .filter(|s| s.status == reach_orchestrator::event::TaskStatus::Succeeded)
                }
            },
        )
        .await;
        let s = orch_b.engine().load(id).await.unwrap();
        let path: Vec<&str> = s.visits.iter().map(|v| v.node.as_str()).collect();
        assert_eq!(path, ["first", "pause", "second", "done"], "task {id}");
        for node in ["first", "second"] {
            assert_eq!(router.effects(id, node), 1, "task {id} node {node}");
        }
    }
    running_b.shutdown().await;
}
