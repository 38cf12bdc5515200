//! Load for the crash scenarios: `complaint-flow` tasks started at a steady rate from the real
//! CFPB sample, then followed until each has settled.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use reach_agents::complaint::{Complaint, load_csv};
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_proto::v1::{GetTaskRequest, StartTaskRequest, TaskStatus};

use crate::mesh::repo_root;

/// How a batch of tasks ended.
#[derive(Debug, Default)]
pub struct Outcomes {
    /// Tasks started (each accepted once, by id).
    pub started: usize,
    /// Task count per final status (`SUCCEEDED`, `WAITING_HUMAN`, `FAILED`, ...).
    pub by_status: BTreeMap<&'static str, usize>,
    /// Tasks that had not settled when the wait ended (lost, as far as a user can tell).
    pub unsettled: Vec<String>,
    /// The errors of the failed tasks, one per task.
    pub failures: Vec<String>,
}

impl Outcomes {
    /// Tasks with `status`.
    pub fn count(&self, status: &str) -> usize {
        self.by_status.get(status).copied().unwrap_or(0)
    }
}

/// The complaints of the repo's sample, cycled to `count`.
pub fn complaints(count: usize) -> Vec<Complaint> {
    let all = load_csv(&repo_root().join("examples/data/cfpb-complaints-sample.csv"))
        .expect("the CFPB sample loads");
    all.iter().cycle().take(count).cloned().collect()
}

/// Starts one task per complaint (ids `{prefix}-{n}`), `per_second` of them a second,
/// calling `during(elapsed)` between starts so a scenario can inject its fault on time. A
/// start the orchestrator cannot take (it is down) is repeated with the same id until it
/// is accepted, as a client with an idempotent id would.
pub async fn start_all(
    orchestrator_url: &str,
    prefix: &str,
    complaints: &[Complaint],
    per_second: u32,
    mut during: impl FnMut(Duration),
) -> Vec<String> {
    let started = Instant::now();
    let gap = Duration::from_secs(1) / per_second;
    let mut ids = Vec::with_capacity(complaints.len());
    for (n, complaint) in complaints.iter().enumerate() {
        let due = gap * u32::try_from(n).unwrap();
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        during(started.elapsed());
        let id = format!("{prefix}-{n}");
        let input = serde_json::json!({
            "complaint_id": complaint.complaint_id,
            "narrative": complaint.narrative,
            "company": complaint.company,
            "state": complaint.state,
        });
        let request = StartTaskRequest {
            flow_id: "complaint-flow".into(),
            flow_version: 0,
            input: Some(reach_proto::json::to_proto(&input)),
            task_id: id.clone(),
            ..Default::default()
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let accepted =
                match OrchestratorServiceClient::connect(orchestrator_url.to_string()).await {
                    Ok(mut client) => client.start_task(request.clone()).await.is_ok(),
                    Err(_) => false,
                };
            if accepted {
                break;
            }
            assert!(Instant::now() < deadline, "task {id} was never accepted");
            during(started.elapsed());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        ids.push(id);
    }
    ids
}

/// Follows `ids` until each is settled (ended, or waiting for a person as the flow designs)
/// or `limit` passes.
pub async fn settle(orchestrator_url: &str, ids: &[String], limit: Duration) -> Outcomes {
    let started = Instant::now();
    let mut outcomes = Outcomes {
        started: ids.len(),
        ..Outcomes::default()
    };
    let mut pending: Vec<String> = ids.to_vec();
    while !pending.is_empty() && started.elapsed() < limit {
        let Ok(mut client) = OrchestratorServiceClient::connect(orchestrator_url.to_string()).await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let mut still = Vec::new();
        for id in pending {
            let task = client
                .get_task(GetTaskRequest {
                    task_id: id.clone(),
                })
                .await
                .ok()
                .and_then(|r| r.into_inner().task);
            let status = task.as_ref().map(|t| t.status());
            match status {
                Some(
                    s @ (TaskStatus::Succeeded
                    | TaskStatus::WaitingHuman
                    | TaskStatus::Failed
                    | TaskStatus::Partial
                    | TaskStatus::Cancelled),
                ) => {
                    let name = s.as_str_name().trim_start_matches("TASK_STATUS_");
                    *outcomes.by_status.entry(name).or_default() += 1;
                    if s == TaskStatus::Failed {
                        let task = task.unwrap();
                        outcomes
                            .failures
                            .push(format!("{id} at {}: {}", task.failed_node, task.error));
                    }
                }
                _ => still.push(id),
            }
        }
        pending = still;
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    outcomes.unsettled = pending;
    outcomes
}
