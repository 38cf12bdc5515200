//! Task pages: the recent tasks, and one task — its status, the node path it took, each
//! node's input and output (masked as the API masks them), attempts and errors, its timers,
//! and the message ledger with its events as one timeline (the `reach dump` data), each
//! span's duration drawn to scale, and the trace id (linked through
//! [`crate::ConsoleConfig::trace_url`] when set).

use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::response::Html;
use maud::{Markup, html};
use reach_proto::v1::{
    DumpRecord, DumpTaskRequest, GetTaskRequest, ListTasksRequest, Task, TaskStatus, dump_record,
};
use serde::Deserialize;

use crate::layout::{Nav, live_page};
use crate::render::{self, badge, between, coarse, pretty};
use crate::{BASE, Console, ConsoleError, request};

/// The most timeline records shown (the rest are counted).
pub const MAX_RECORDS: usize = 2000;

/// The task list's filters (`?status=WAITING_HUMAN&flow=…`).
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    /// A status name (`FAILED`, `WAITING_HUMAN`, …); empty lists all.
    #[serde(default)]
    pub status: String,
    /// A flow id; empty lists all.
    #[serde(default)]
    pub flow: String,
}

const STATUSES: [&str; 8] = [
    "PENDING",
    "DISPATCHED",
    "PROCESSING",
    "WAITING_HUMAN",
    "SUCCEEDED",
    "FAILED",
    "PARTIAL",
    "CANCELLED",
];

/// `GET /console/tasks`: the 100 newest tasks, filterable by status and flow.
///
/// # Errors
/// [`ConsoleError`] when the orchestrator cannot be asked.
pub async fn list(
    State(console): State<Console>,
    Query(query): Query<ListQuery>,
) -> Result<Html<String>, ConsoleError> {
    let status = TaskStatus::from_str_name(&format!("TASK_STATUS_{}", query.status))
        .unwrap_or(TaskStatus::Unspecified);
    let flow: String = query.flow.chars().take(128).collect();
    let tasks = console
        .orchestrator()?
        .list_tasks(request(ListTasksRequest {
            status: status as i32,
            flow_id: flow.clone(),
            page_size: 100,
            page_token: String::new(),
            labels: Default::default(),
        }))
        .await?
        .into_inner()
        .tasks;
    let body = html! {
        h1 { "Tasks" }
        form.filters method="get" action={ (BASE) "/tasks" } {
            label { "Status"
                select name="status" {
                    option value="" { "any status" }
                    @for s in STATUSES { option value=(s) selected[s == query.status] { (s) } }
                }
            }
            input type="hidden" name="flow" value=(flow);
            noscript { button type="submit" { "Filter" } }
        }
        p.muted { "The " (tasks.len()) " newest tasks" @if !flow.is_empty() { " of flow " code { (flow) } } "." }
        div.scroll {
            table.wide {
                thead { tr { th { "Task" } th { "Flow" } th { "Status" } th { "Node" } th { "Updated" } } }
                tbody {
                    @for t in &tasks {
                        tr {
                            td data-label="task" { a href={ (BASE) "/tasks/" (t.task_id) } { (t.task_id) } }
                            td data-label="flow" { (t.flow_id) " v" (t.flow_version) }
                            td data-label="status" { (badge(render::task_status_name(t.status))) }
                            td data-label="node" { (t.current_node) }
                            td data-label="updated" { (render::age(t.updated_at.as_ref())) " ago" }
                        }
                    }
                }
            }
        }
    };
    Ok(live_page(
        "Tasks",
        Nav::Tasks,
        console.config().refresh_ms,
        body,
    ))
}

/// A notice to show on arrival (`?resumed=1` after a review, `?cancelled=1`).
#[derive(Debug, Default, Deserialize)]
pub struct PageQuery {
    /// Set after the console resumed the task.
    #[serde(default)]
    pub resumed: Option<String>,
    /// Set after the console cancelled the task.
    #[serde(default)]
    pub cancelled: Option<String>,
}

/// `GET /console/tasks/{task_id}`: one task with its nodes and timeline (live until it
/// ends).
///
/// # Errors
/// [`ConsoleError`] when the task cannot be read (404 for an unknown id).
pub async fn page(
    State(console): State<Console>,
    Path(task_id): Path<String>,
    Query(query): Query<PageQuery>,
) -> Result<Html<String>, ConsoleError> {
    if task_id.is_empty() || task_id.len() > 128 {
        return Err(ConsoleError::BadRequest(
            "a task id has 1 to 128 characters".into(),
        ));
    }
    let mut client = console.orchestrator()?;
    let task = client
        .get_task(request(GetTaskRequest {
            task_id: task_id.clone(),
        }))
        .await?
        .into_inner()
        .task
        .unwrap_or_default();
    let records = client
        .dump_task(request(DumpTaskRequest {
            task_id: task_id.clone(),
        }))
        .await
        .map(|r| r.into_inner().records)
        .unwrap_or_default();
    let status = render::task_status_name(task.status);
    let ended = task.ended_at.is_some();
    let body = html! {
        @if query.resumed.is_some() { div.notice.ok #resumed-notice { "Resumed. The task continues from its human node." } }
        @if query.cancelled.is_some() { div.notice.ok { "Cancel requested." } }
        h1 { "Task " (task.task_id) }
        (summary(&console, &task))
        @if task.status == TaskStatus::WaitingHuman as i32 {
            div.notice.info {
                "Waits for a person in " code { (task.current_node) } ". "
                a href={ (BASE) "/inbox/" (task.task_id) } { "Review it →" }
            }
        }
        h2 { "Node path" }
        div.path #node-path {
            @for (i, run) in task.nodes.iter().enumerate() {
                @if i > 0 { span.arrow { "→" } }
                span.step { (run.node_id) " " (badge(render::node_status_name(run.status))) }
            }
        }
        h2 { "Nodes" }
        (nodes(&task))
        h2 { "Timers" }
        (timers(&task, &records))
        h2 { "Timeline" }
        (timeline(&task, &records))
    };
    let refresh = if ended {
        0
    } else {
        console.config().refresh_ms
    };
    Ok(live_page(
        &format!("Task {} ({status})", task.task_id),
        Nav::Tasks,
        refresh,
        body,
    ))
}

fn summary(console: &Console, task: &Task) -> Markup {
    let trace_url = &console.config().trace_url;
    html! {
        div.card {
            dl.fields {
                dt { "status" } dd #task-status { (badge(render::task_status_name(task.status))) }
                dt { "flow" } dd { a href={ (BASE) "/flows/" (task.flow_id) } { (task.flow_id) } " v" (task.flow_version) }
                @if !task.current_node.is_empty() { dt { "current node" } dd { code { (task.current_node) } } }
                dt { "trace id" } dd {
                    @if trace_url.is_empty() || task.trace_id.is_empty() { code { (task.trace_id) } }
                    @else { a href=(trace_url.replace("{trace_id}", &task.trace_id)) { code { (task.trace_id) } } }
                }
                dt { "started" } dd { (render::time(task.created_at.as_ref())) }
                dt { "updated" } dd { (render::time(task.updated_at.as_ref())) }
                @if task.ended_at.is_some() {
                    dt { "ended" } dd { (render::time(task.ended_at.as_ref()))
                        @if let Some(d) = between(task.created_at.as_ref(), task.ended_at.as_ref()) { " (took " (coarse(d)) ")" } }
                }
                @if !task.error.is_empty() { dt { "error" } dd.error { (task.error) } }
                @if !task.failed_node.is_empty() { dt { "failed at" } dd { code { (task.failed_node) } } }
                @if let Some(usage) = &task.usage {
                    dt { "model usage" } dd { (usage.model_calls) " calls, " (usage.input_tokens) " in / " (usage.output_tokens) " out tokens" }
                }
                @for (k, v) in &task.labels { dt { "label " (k) } dd { (v) } }
            }
            details { summary { "task input" } (pretty(&render::json(task.input.as_ref()))) }
            @if task.output.is_some() { details open { summary { "task output" } (pretty(&render::json(task.output.as_ref()))) } }
        }
    }
}

fn nodes(task: &Task) -> Markup {
    html! {
        div.scroll {
            table.wide #nodes {
                thead { tr { th { "Node" } th { "Type" } th { "Status" } th { "Attempts" } th { "Started" } th { "Took" } th { "Input / output" } } }
                tbody {
                    @for run in &task.nodes {
                        tr {
                            td data-label="node" { code { (run.node_id) } @if !run.next_node.is_empty() { div.muted { "→ " (run.next_node) } } }
                            td data-label="type" { (run.node_type) }
                            td data-label="status" { (badge(render::node_status_name(run.status)))
                                @if !run.error.is_empty() { div.error { (run.error) } } }
                            td data-label="attempts" { (run.attempts) }
                            td data-label="started" { (render::time(run.started_at.as_ref())) }
                            td data-label="took" { @match between(run.started_at.as_ref(), run.ended_at.as_ref()) {
                                Some(d) => (coarse(d)), None => "running" } }
                            td data-label="data" {
                                details { summary { "input" } (pretty(&render::json(run.input.as_ref()))) }
                                details { summary { "output" } (pretty(&render::json(run.output.as_ref()))) }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The timer events of the log (scheduled, fired, cancelled) and the human wait's deadline.
fn timers(task: &Task, records: &[DumpRecord]) -> Markup {
    let events: Vec<_> = records
        .iter()
        .filter_map(|r| match &r.record {
            Some(dump_record::Record::Event(e)) if e.kind.starts_with("timer") => Some(e),
            _ => None,
        })
        .collect();
    let deadline = task.waiting.as_ref().and_then(|w| w.deadline.as_ref());
    html! {
        @if events.is_empty() && deadline.is_none() {
            p.muted { "No timers." }
        } @else {
            @if let Some(d) = deadline { p { "The human wait times out at " (render::time(Some(d))) "." } }
            p.muted { "Times of day in UTC." }
            div.scroll { table.wide {
                thead { tr { th { "At (UTC)" } th { "Event" } th { "Node" } th { "Detail" } } }
                tbody { @for e in &events { tr {
                    td data-label="at" { (render::clock(e.at.as_ref())) }
                    td data-label="event" { (e.kind) }
                    td data-label="node" { (e.node_id) }
                    td.detail data-label="detail" { (render::detail(&render::json(e.detail.as_ref()))) }
                } } }
            } }
        }
    }
}

/// One timeline row: offset from the task's start, what, and the span (for a message, its
/// delivery latency).
struct Row<'a> {
    offset: Duration,
    span: Duration,
    record: &'a DumpRecord,
}

fn timeline(task: &Task, records: &[DumpRecord]) -> Markup {
    let start = records
        .first()
        .and_then(|r| render::system_time(r.at.as_ref()))
        .or_else(|| render::system_time(task.created_at.as_ref()));
    let rows: Vec<Row> = records
        .iter()
        .take(MAX_RECORDS)
        .map(|record| {
            let at = render::system_time(record.at.as_ref());
            let offset = match (start, at) {
                (Some(s), Some(a)) => a.duration_since(s).unwrap_or_default(),
                _ => Duration::ZERO,
            };
            let span = match &record.record {
                Some(dump_record::Record::Message(m)) => {
                    render::duration(m.latency.as_ref()).unwrap_or_default()
                }
                _ => Duration::ZERO,
            };
            Row {
                offset,
                span,
                record,
            }
        })
        .collect();
    let total = rows
        .iter()
        .map(|r| r.offset + r.span)
        .max()
        .unwrap_or_default()
        .max(Duration::from_millis(1));
    let pct = |d: Duration| d.as_secs_f64() / total.as_secs_f64() * 100.0;
    html! {
        @if rows.is_empty() { p.muted { "No messages or events recorded (the ledger may be sampled or purged)." } }
        @else {
            div.scroll { table.timeline.wide #timeline {
                thead { tr { th { "+time" } th { "Record" } th { "Detail" } th { "Took" } th { "Span" } } }
                tbody {
                    @for row in &rows {
                        @match &row.record.record {
                            Some(dump_record::Record::Message(m)) => {
                                @let header = m.header.clone().unwrap_or_default();
                                @let failed = m.status_code != 0;
                                tr {
                                    td data-label="+time" { "+" (coarse(row.offset)) }
                                    td data-label="record" { "message " code { (m.payload_type) } }
                                    td data-label="detail" {
                                        (header.source) " → " (m.instance_id)
                                        " · " (m.payload_bytes) " B"
                                        @if failed { div.error { "status " (m.status_code) ": " (m.status_message) } }
                                        div.muted { "message " code { (header.message_id) } }
                                    }
                                    td data-label="took" { (coarse(row.span)) }
                                    td.bar { div class={ "span" @if failed { " failed" } }
                                        style=(format!("margin-left:{:.2}%;width:{:.2}%", pct(row.offset), pct(row.span).max(0.3))) {} }
                                }
                            }
                            Some(dump_record::Record::Event(e)) => {
                                tr {
                                    td data-label="+time" { "+" (coarse(row.offset)) }
                                    td data-label="record" { (e.kind) }
                                    td data-label="detail" {
                                        @if !e.node_id.is_empty() { code { (e.node_id) } " " }
                                        span.muted { (render::cut(&render::detail(&render::json(e.detail.as_ref())), 160)) }
                                    }
                                    td data-label="took" { "" }
                                    td.bar { div.span.event style=(format!("margin-left:{:.2}%;width:0.3%", pct(row.offset))) {} }
                                }
                            }
                            None => {}
                        }
                    }
                }
            } }
            @if records.len() > MAX_RECORDS { p.muted { (records.len() - MAX_RECORDS) " more records not shown." } }
        }
    }
}
