//! Flow pages: every applied flow with its running, waiting and failed tasks; one flow's
//! graph ([`crate::graph`]) with the tasks currently at each node and the failures per
//! node.

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::response::Html;
use maud::html;
use reach_proto::v1::{ListFlowsRequest, ListTasksRequest, Task, TaskStatus};

use crate::graph::{Counts, Graph};
use crate::layout::{Nav, live_page};
use crate::render;
use crate::{BASE, Console, ConsoleError, request};

/// The most tasks of a status read to count them per node.
pub const MAX_COUNTED: usize = 1000;

/// The unfinished statuses (their tasks are "at" a node).
const ACTIVE: [TaskStatus; 4] = [
    TaskStatus::Pending,
    TaskStatus::Dispatched,
    TaskStatus::Processing,
    TaskStatus::WaitingHuman,
];

/// Up to [`MAX_COUNTED`] tasks of `flow` with `status`.
async fn tasks(
    console: &Console,
    flow: &str,
    status: TaskStatus,
) -> Result<Vec<Task>, ConsoleError> {
    let mut client = console.orchestrator()?;
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        let page = client
            .list_tasks(request(ListTasksRequest {
                status: status as i32,
                flow_id: flow.to_string(),
                page_size: 500,
                page_token: token,
                labels: Default::default(),
            }))
            .await?
            .into_inner();
        out.extend(page.tasks);
        if page.next_page_token.is_empty() || out.len() >= MAX_COUNTED {
            out.truncate(MAX_COUNTED);
            return Ok(out);
        }
        token = page.next_page_token;
    }
}

/// Tasks at each node and failures per node of `flow` (empty: every flow, keyed
/// `flow/node`).
async fn counts(console: &Console, flow: &str) -> Result<Counts, ConsoleError> {
    let mut counts = Counts::default();
    for status in ACTIVE {
        for t in tasks(console, flow, status).await? {
            *counts.at.entry(key(flow, &t, &t.current_node)).or_default() += 1;
        }
    }
    for t in tasks(console, flow, TaskStatus::Failed).await? {
        *counts
            .failed
            .entry(key(flow, &t, &t.failed_node))
            .or_default() += 1;
    }
    Ok(counts)
}

fn key(flow: &str, task: &Task, node: &str) -> String {
    if flow.is_empty() {
        format!("{}/{node}", task.flow_id)
    } else {
        node.to_string()
    }
}

/// `GET /console/flows`: every flow with its active and failed tasks.
///
/// # Errors
/// [`ConsoleError`] when the orchestrator cannot be asked.
pub async fn list(State(console): State<Console>) -> Result<Html<String>, ConsoleError> {
    let flows = console
        .orchestrator()?
        .list_flows(request(ListFlowsRequest::default()))
        .await?
        .into_inner()
        .flows;
    let counts = counts(&console, "").await?;
    let sum = |map: &BTreeMap<String, u64>, flow: &str| -> u64 {
        map.iter()
            .filter(|(k, _)| k.split_once('/').is_some_and(|(f, _)| f == flow))
            .map(|(_, v)| v)
            .sum()
    };
    let body = html! {
        h1 { "Flows" }
        div.scroll { table.wide #flows {
            thead { tr { th { "Flow" } th { "Version" } th { "Nodes" } th { "Active tasks" } th { "Failed" } th { "Applied" } th { "Description" } } }
            tbody { @for f in &flows { tr {
                td data-label="flow" { a href={ (BASE) "/flows/" (f.flow_id) } { (f.flow_id) } }
                td data-label="version" { (f.version) }
                td data-label="nodes" { (f.node_count) }
                td data-label="active" { (sum(&counts.at, &f.flow_id)) }
                td data-label="failed" { (sum(&counts.failed, &f.flow_id)) }
                td data-label="applied" { (render::time(f.applied_at.as_ref())) div.muted { (f.source) } }
                td data-label="description" { (f.description) }
            } } }
        } }
    };
    Ok(live_page(
        "Flows",
        Nav::Flows,
        console.config().refresh_ms,
        body,
    ))
}

/// `GET /console/flows/{flow_id}`: the flow's graph with counts per node.
///
/// # Errors
/// [`ConsoleError`] when the orchestrator cannot be asked, or has no such flow (404).
pub async fn page(
    State(console): State<Console>,
    Path(flow_id): Path<String>,
) -> Result<Html<String>, ConsoleError> {
    let flows = console
        .orchestrator()?
        .list_flows(request(ListFlowsRequest {
            flow_id: flow_id.clone(),
        }))
        .await?
        .into_inner()
        .flows;
    let Some(flow) = flows.into_iter().find(|f| f.flow_id == flow_id) else {
        return Err(ConsoleError::Rpc(tonic::Status::not_found(format!(
            "flow {flow_id:?} is not applied"
        ))));
    };
    let counts = counts(&console, &flow_id).await?;
    let graph = Graph::from_yaml(&flow.yaml);
    let body = html! {
        p.muted { a href={ (BASE) "/flows" } { "← Flows" } }
        h1 { "Flow " (flow.flow_id) " v" (flow.version) }
        @if !flow.description.is_empty() { p { (flow.description) } }
        @match &graph {
            Ok(graph) => div.graph #flow-graph { (graph.svg(&counts)) },
            Err(e) => div.notice.info { "No graph: " (e) },
        }
        h2 { "Tasks per node" }
        div.scroll { table.wide #node-counts {
            thead { tr { th { "Node" } th { "Tasks there now" } th { "Failed there" } } }
            tbody {
                @for node in graph.as_ref().map(|g| g.node_ids()).unwrap_or_default() {
                    tr {
                        td data-label="node" { code { (node) } }
                        td data-label="now" { (counts.at.get(node).copied().unwrap_or(0)) }
                        td data-label="failed" { (counts.failed.get(node).copied().unwrap_or(0)) }
                    }
                }
            }
        } }
    };
    Ok(live_page(
        &format!("Flow {}", flow.flow_id),
        Nav::Flows,
        console.config().refresh_ms,
        body,
    ))
}
