//! Attacks on the tasks side of the mesh: probing tasks the caller may not view (lists, page
//! tokens, GetTask), reading flows and webhook tokens, retrying without `retry`, and opening
//! WatchTask streams without bound. alice and bob may start and view `approve`; mallory may
//! do nothing.

use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use tonic::{Code, Status};

use crate::Check;
use crate::mesh::{self, Authorized, TrustedMesh};

type Client = OrchestratorServiceClient<Authorized>;

async fn client(mesh: &TrustedMesh, user: &str) -> Client {
    OrchestratorServiceClient::new(
        mesh.channel_with_token(&mesh.orchestrator_url, &mesh.token(user))
            .await,
    )
}

/// `Ok` when `answer` holds nothing: no tasks and no page token.
fn empty_list(
    answer: Result<tonic::Response<pb::ListTasksResponse>, Status>,
) -> Result<(), String> {
    match answer {
        Ok(page) => {
            let page = page.into_inner();
            if page.tasks.is_empty() && page.next_page_token.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "listed {} tasks, next_page_token {:?}",
                    page.tasks.len(),
                    page.next_page_token
                ))
            }
        }
        Err(status) => Err(format!("refused instead of an empty list: {status:?}")),
    }
}

/// Runs this module's attacks against `mesh`, adding one [`Check`] per attack.
pub async fn run(mesh: &TrustedMesh, checks: &mut Vec<Check>) {
    let mut alice = client(mesh, "alice").await;
    let mut bob = client(mesh, "bob").await;
    let mut mallory = client(mesh, "mallory").await;
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let ids: Vec<String> = (0..2).map(|i| format!("attack-{run_id}-{i}")).collect();
    for id in &ids {
        if let Err(status) = alice
            .start_task(pb::StartTaskRequest {
                flow_id: "approve".into(),
                task_id: id.clone(),
                ..Default::default()
            })
            .await
        {
            checks.push(Check::new(
                "control: alice starts an approve task",
                Err(format!("refused: {status:?}")),
            ));
            return;
        }
    }
    let task_id = ids[0].clone();

    // Lists: one page at a time, a caller who may view nothing learned every task id from the
    // page token.
    checks.push(Check::new(
        "mallory (no task rule) pages ListTasks with page_size 1 for task ids",
        empty_list(
            mallory
                .list_tasks(pb::ListTasksRequest {
                    page_size: 1,
                    ..Default::default()
                })
                .await,
        ),
    ));
    checks.push(Check::new(
        "mallory sends a hand-made page token (created_ms:task_id) to ListTasks",
        mesh::refused(
            mallory
                .list_tasks(pb::ListTasksRequest {
                    page_size: 1,
                    page_token: format!("99999999999999:{task_id}"),
                    ..Default::default()
                })
                .await,
            Code::InvalidArgument,
            "INVALID_PAGE_TOKEN",
        ),
    ));
    let alices_token = alice
        .list_tasks(pb::ListTasksRequest {
            page_size: 1,
            ..Default::default()
        })
        .await
        .map(|page| page.into_inner().next_page_token)
        .unwrap_or_default();
    checks.push(Check::new(
        "bob replays alice's ListTasks page token",
        if alices_token.is_empty() {
            Err("control: alice's first page of one had no token".into())
        } else {
            mesh::refused(
                bob.list_tasks(pb::ListTasksRequest {
                    page_size: 1,
                    page_token: alices_token,
                    ..Default::default()
                })
                .await,
                Code::InvalidArgument,
                "INVALID_PAGE_TOKEN",
            )
        },
    ));

    // A task mallory may not view answers exactly as an unknown id.
    let unknown = format!("attack-{run_id}-9");
    let hidden = mallory
        .get_task(pb::GetTaskRequest {
            task_id: task_id.clone(),
        })
        .await
        .map(drop);
    let absent = mallory
        .get_task(pb::GetTaskRequest {
            task_id: unknown.clone(),
        })
        .await
        .map(drop);
    let same = match (&hidden, &absent) {
        (Err(hidden), Err(absent))
            if hidden.message().replace(&task_id, &unknown) == absent.message()
                && hidden.code() == absent.code() =>
        {
            Ok(())
        }
        (hidden, absent) => Err(format!(
            "a hidden task answers unlike an unknown id: {hidden:?} vs {absent:?}"
        )),
    };
    checks.push(Check::new(
        "mallory probes GetTask of alice's task (existence, starter, flow)",
        mesh::refused(hidden, Code::NotFound, "TASK_NOT_FOUND").and(same),
    ));

    // ListFlows had no authorization.
    checks.push(Check::new(
        "mallory lists the flows",
        match mallory.list_flows(pb::ListFlowsRequest::default()).await {
            Ok(list) if list.get_ref().flows.is_empty() => Ok(()),
            Ok(list) => Err(format!(
                "listed {:?}",
                list.into_inner()
                    .flows
                    .into_iter()
                    .map(|f| f.flow_id)
                    .collect::<Vec<_>>()
            )),
            Err(status) => Err(format!("refused instead of an empty list: {status:?}")),
        },
    ));

    // Retry needs the policy's `retry`: starting the task is not enough.
    checks.push(Check::new(
        "alice (start and view only) retries her own task",
        mesh::refused(
            alice
                .retry_task(pb::RetryTaskRequest {
                    task_id: task_id.clone(),
                })
                .await,
            Code::PermissionDenied,
            "NOT_AUTHORIZED",
        ),
    ));

    // A viewer reads the starter's webhook token.
    let created = alice
        .create_task_webhook(pb::CreateTaskWebhookRequest {
            task_id: task_id.clone(),
            webhook_id: "attack".into(),
            url: "https://reach-attack-hook.invalid/hook".into(),
            token: "alice-webhook-secret".into(),
            ..Default::default()
        })
        .await;
    checks.push(Check::new(
        "bob (a viewer) reads the token of alice's task webhook",
        match created {
            Err(status) => Err(format!("control: alice's webhook was refused: {status:?}")),
            Ok(_) => match bob
                .list_task_webhooks(pb::ListTaskWebhooksRequest {
                    task_id: task_id.clone(),
                    ..Default::default()
                })
                .await
            {
                Ok(list) => {
                    let hooks = list.into_inner().webhooks;
                    if hooks.is_empty() {
                        Err("control: bob sees no webhook".into())
                    } else if hooks.iter().any(|w| !w.token.is_empty()) {
                        Err("bob read the webhook token".into())
                    } else {
                        Ok(())
                    }
                }
                Err(status) => Err(format!("control: bob may view the task: {status:?}")),
            },
        },
    ));

    // WatchTask streams were unbounded per caller.
    let mut open = Vec::new();
    let mut outcome = Err("no refusal within 64 streams and one".to_string());
    for n in 0..=reach_orchestrator::service::DEFAULT_MAX_WATCHES_PER_CALLER {
        let answer = bob
            .watch_task(pb::WatchTaskRequest {
                task_id: task_id.clone(),
                after_sequence: 0,
            })
            .await;
        match answer {
            Ok(stream) => open.push(stream.into_inner()),
            Err(status) => {
                outcome = if n == reach_orchestrator::service::DEFAULT_MAX_WATCHES_PER_CALLER {
                    mesh::refused::<()>(Err(status), Code::ResourceExhausted, "TOO_MANY_WATCHES")
                } else {
                    Err(format!("refused after only {n} streams: {status:?}"))
                };
                break;
            }
        }
    }
    checks.push(Check::new(
        "bob opens WatchTask streams without bound (65 on one task)",
        outcome,
    ));
    drop(open);
}
