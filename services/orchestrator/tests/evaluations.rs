//! Evaluation slots per flow, against a real orchestrator server: a flow whose conditions are
//! heavy holds at most its own share of the evaluation slots, so another flow's conditions
//! run while the heavy ones are still being evaluated.

mod common;

use std::time::Duration;

use common::{eventually, server, status_of, wait_for};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;

fn condition_flow(id: &str, expression: &str) -> String {
    format!(
        "id: {id}\nversion: 1\ninitial: route\nstates:\n  route:\n    type: condition\n    conditions:\n      - if: \"{expression}\"\n        next: done\n    default: done\n  done: {{type: succeed}}\n"
    )
}

async fn start(c: &mut OrchestratorServiceClient<tonic::transport::Channel>, flow: &str) -> String {
    c.start_task(pb::StartTaskRequest {
        flow_id: flow.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .task
    .unwrap()
    .task_id
}

fn ended(task: &pb::Task) -> bool {
    [
        pb::TaskStatus::Succeeded,
        pb::TaskStatus::Failed,
        pb::TaskStatus::Partial,
        pb::TaskStatus::Cancelled,
    ]
    .iter()
    .any(|s| *s as i32 == task.status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavy_flow_holds_only_its_share_and_another_flows_conditions_run() {
    let s = server(|c, _| {
        c.max_concurrent_evaluations = 2;
        c.max_evaluations_per_flow = 1;
        // Each heavy condition runs until its time budget ends it.
        c.expressions.max_steps = u64::MAX;
        c.expressions.max_time = Duration::from_secs(2);
    })
    .await;
    let mut c = OrchestratorServiceClient::connect(s.endpoint.clone())
        .await
        .unwrap();
    let list = format!("[{}]", vec!["1"; 300].join(","));
    let heavy = format!("{list}.all(x, {list}.all(y, {list}.all(z, true)))");
    for (id, expression) in [("heavy", heavy.as_str()), ("light", "1 + 1 == 2")] {
        c.apply_flow(pb::ApplyFlowRequest {
            yaml: condition_flow(id, expression),
            source: "test.yaml".into(),
        })
        .await
        .unwrap();
    }
    let mut heavies = Vec::new();
    for _ in 0..3 {
        heavies.push(start(&mut c, "heavy").await);
    }
    // A heavy condition is being evaluated, and the heavy flow holds no more than its share.
    let engine = s.orch.engine().clone();
    eventually(
        "a heavy condition is evaluated",
        Duration::from_secs(10),
        || {
            let running = engine.evaluations_running();
            async move { (running >= 1).then_some(()) }
        },
    )
    .await;
    assert_eq!(engine.evaluations_running(), 1, "one slot per flow");

    // The light flow's task runs through while the heavy ones still wait or run: with one
    // shared queue it would have waited behind them.
    let light = start(&mut c, "light").await;
    wait_for(&s.endpoint, &light, pb::TaskStatus::Succeeded).await;
    for id in &heavies {
        let task = status_of(&s.endpoint, id).await.unwrap();
        assert!(
            !ended(&task),
            "heavy task {id} ended before the light one was through: {:?}",
            task.status
        );
    }
    // The heavy ones end too, one at a time, each failing at its time budget.
    for id in &heavies {
        let task = wait_for(&s.endpoint, id, pb::TaskStatus::Failed).await;
        assert!(task.error.contains("evaluation budget"), "{}", task.error);
    }
}
