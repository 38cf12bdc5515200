//! The inbox: tasks waiting for a person (WAITING_HUMAN), oldest first, filterable by flow
//! and node, each with its node's prompt and the task's context; the review page with the
//! form generated from the node's schema ([`crate::schema_form`]); resume and cancel.
//!
//! A resume names the node the reviewer saw, and the reviewer (`reach-reviewer` metadata,
//! recorded by the orchestrator when it runs without trust; with trust it records the
//! caller's identity). A task that is no longer waiting there — another reviewer was first —
//! answers "already resumed by …" from the task's `human_resumed` event instead of
//! resuming it again.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use futures::StreamExt as _;
use maud::{Markup, html};
use reach_proto::v1::{
    CancelTaskRequest, DumpTaskRequest, GetTaskRequest, ListFlowsRequest, ListTasksRequest,
    ResumeTaskRequest, Task, TaskStatus, dump_record,
};
use serde::Deserialize;
use serde_json::Value;
use tonic_types::StatusExt as _;

use crate::layout::{Nav, live_page, page};
use crate::render::{self, badge, fields};
use crate::schema_form::{Errors, Form};
use crate::{BASE, Console, ConsoleError, request};

/// The most waiting tasks the inbox reads (oldest first; the rest are counted).
pub const MAX_INBOX: usize = 1000;
/// The most tasks the inbox shows with their context on one page.
pub const PAGE: usize = 50;
/// The longest reviewer name kept, in characters.
pub const MAX_REVIEWER_CHARS: usize = 64;
/// The longest cancel reason kept, in characters.
pub const MAX_REASON_CHARS: usize = 500;
/// The cookie remembering the reviewer's name (`SameSite=Strict`, path [`BASE`]).
pub const REVIEWER_COOKIE: &str = "reach_reviewer";
/// The gRPC metadata naming the reviewer to the orchestrator.
pub const REVIEWER_METADATA: &str = "reach-reviewer";

/// The inbox's filters (`?flow=…&node=…`).
#[derive(Debug, Default, Deserialize)]
pub struct InboxQuery {
    /// Only tasks of this flow.
    #[serde(default)]
    pub flow: String,
    /// Only tasks waiting in this node.
    #[serde(default)]
    pub node: String,
}

/// Every waiting task (at most [`MAX_INBOX`]), oldest first, and whether more were left.
async fn waiting(console: &Console, flow: &str) -> Result<(Vec<Task>, bool), ConsoleError> {
    let mut client = console.orchestrator()?;
    let mut tasks = Vec::new();
    let mut token = String::new();
    loop {
        let page = client
            .list_tasks(request(ListTasksRequest {
                status: TaskStatus::WaitingHuman as i32,
                flow_id: flow.to_string(),
                page_size: 500,
                page_token: token,
                labels: Default::default(),
            }))
            .await?
            .into_inner();
        tasks.extend(page.tasks);
        if page.next_page_token.is_empty() || tasks.len() >= MAX_INBOX {
            let more = !page.next_page_token.is_empty();
            tasks.truncate(MAX_INBOX);
            tasks.reverse();
            return Ok((tasks, more));
        }
        token = page.next_page_token;
    }
}

/// `GET /console/inbox`: the waiting tasks, oldest first, with filters.
///
/// # Errors
/// [`ConsoleError`] when the orchestrator cannot be asked.
pub async fn list(
    State(console): State<Console>,
    Query(query): Query<InboxQuery>,
) -> Result<Html<String>, ConsoleError> {
    let flow = clip(&query.flow, 128);
    let node = clip(&query.node, 128);
    let (all, more) = waiting(&console, &flow).await?;
    let mut nodes: Vec<&str> = all.iter().map(|t| t.current_node.as_str()).collect();
    nodes.sort_unstable();
    nodes.dedup();
    let shown: Vec<&Task> = all
        .iter()
        .filter(|t| node.is_empty() || t.current_node == node)
        .collect();
    let flows = console
        .orchestrator()?
        .list_flows(request(ListFlowsRequest::default()))
        .await?
        .into_inner()
        .flows;
    let client = console.orchestrator()?;
    let first: Vec<Task> = shown.iter().take(PAGE).map(|t| (*t).clone()).collect();
    let detailed: Vec<Task> = futures::stream::iter(first.into_iter().map(move |fallback| {
        let mut client = client.clone();
        let id = fallback.task_id.clone();
        async move {
            client
                .get_task(request(GetTaskRequest { task_id: id }))
                .await
                .ok()
                .and_then(|r| r.into_inner().task)
                .unwrap_or(fallback)
        }
    }))
    .buffered(8)
    .collect()
    .await;
    let body = html! {
        h1 { "Inbox" }
        form.filters method="get" action={ (BASE) "/inbox" } {
            label { "Flow"
                select name="flow" {
                    option value="" { "all flows" }
                    @for f in &flows {
                        option value=(f.flow_id) selected[f.flow_id == flow] { (f.flow_id) }
                    }
                }
            }
            label { "Node"
                select name="node" {
                    option value="" { "all nodes" }
                    @for n in &nodes {
                        option value=(n) selected[*n == node] { (n) }
                    }
                }
            }
            noscript { button type="submit" { "Filter" } }
        }
        p.muted {
            (shown.len()) " task" @if shown.len() != 1 { "s" } " waiting for a person, oldest first"
            @if more { " (the oldest " (MAX_INBOX) " are read)" }
            @if shown.len() > PAGE { "; the first " (PAGE) " are shown" }
            "."
        }
        @if shown.is_empty() {
            div.notice.info { "Nothing waits for a person. New tasks appear here as they reach a human node." }
        }
        @for task in &detailed {
            (card(task))
        }
    };
    Ok(live_page(
        "Inbox",
        Nav::Inbox,
        console.config().refresh_ms,
        body,
    ))
}

/// One inbox entry: flow, node, how long it waits, the prompt and a context summary.
fn card(task: &Task) -> Markup {
    let prompt = task
        .waiting
        .as_ref()
        .map(|w| w.prompt.as_str())
        .unwrap_or("");
    html! {
        div.card.task data-task-id=(task.task_id) {
            h3 {
                a href={ (BASE) "/inbox/" (task.task_id) } { (task.task_id) }
            }
            div.meta {
                span { "flow " strong { (task.flow_id) } " v" (task.flow_version) }
                span { "node " strong { (task.current_node) } }
                span { "waiting " (render::age(task.updated_at.as_ref())) }
                @if let Some(deadline) = task.waiting.as_ref().and_then(|w| w.deadline.as_ref()) {
                    span { "times out " (render::time(Some(deadline))) }
                }
            }
            @if !prompt.is_empty() { div.prompt { (prompt) } }
            (context(task, 6))
            div.actions {
                a href={ (BASE) "/inbox/" (task.task_id) } { "Review →" }
            }
        }
    }
}

/// What a reviewer needs to decide: the task's input and the outputs of the task nodes it
/// passed (the last visit of each), at most `max` fields each.
fn context(task: &Task, max: usize) -> Markup {
    let input = render::json(task.input.as_ref());
    let mut outputs: Vec<(&str, Value)> = Vec::new();
    for run in &task.nodes {
        if run.node_type != "task" && run.node_type != "parallel" {
            continue;
        }
        let output = render::json(run.output.as_ref());
        if output.is_null() {
            continue;
        }
        outputs.retain(|(id, _)| *id != run.node_id);
        outputs.push((run.node_id.as_str(), output));
    }
    html! {
        div.context {
            (fields(&input, max))
            @for (node, output) in &outputs {
                div.muted { "output of " code { (node) } }
                (fields(output, max))
            }
        }
    }
}

/// The reviewer name in the request's cookie; empty when none.
fn reviewer_cookie(headers: &HeaderMap) -> String {
    crate::session::cookie(headers, REVIEWER_COOKIE)
        .map(|v| reviewer_name(&v.replace('+', " ")))
        .unwrap_or_default()
}

/// `raw` as a reviewer name: letters, digits, space and `.@_-`, at most
/// [`MAX_REVIEWER_CHARS`], trimmed (it travels in a cookie and in gRPC metadata, both ASCII).
pub fn reviewer_name(raw: &str) -> String {
    raw.chars()
        .filter(|c| c.is_ascii_alphanumeric() || " .@_-".contains(*c))
        .take(MAX_REVIEWER_CHARS)
        .collect::<String>()
        .trim()
        .to_string()
}

fn clip(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

/// What the review page shows besides the task.
#[derive(Default)]
struct Review {
    posted: Vec<(String, String)>,
    errors: Errors,
    reviewer_error: Option<String>,
    reviewer: String,
}

/// `GET /console/inbox/{task_id}`: the review page.
///
/// # Errors
/// [`ConsoleError`] when the task cannot be read.
pub async fn review(
    State(console): State<Console>,
    Path(task_id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ConsoleError> {
    let task = get_task(&console, &task_id).await?;
    if task.status != TaskStatus::WaitingHuman as i32 {
        return not_waiting(&console, &task, StatusCode::OK).await;
    }
    let review = Review {
        reviewer: reviewer_cookie(&headers),
        ..Review::default()
    };
    review_page(&task, review, StatusCode::OK)
}

async fn get_task(console: &Console, task_id: &str) -> Result<Task, ConsoleError> {
    if task_id.is_empty() || task_id.len() > 128 {
        return Err(ConsoleError::BadRequest(
            "a task id has 1 to 128 characters".into(),
        ));
    }
    console
        .orchestrator()?
        .get_task(request(GetTaskRequest {
            task_id: task_id.to_string(),
        }))
        .await?
        .into_inner()
        .task
        .ok_or_else(|| ConsoleError::Rpc(tonic::Status::internal("GetTask returned no task")))
}

fn review_page(task: &Task, review: Review, status: StatusCode) -> Result<Response, ConsoleError> {
    let waiting = task.waiting.clone().unwrap_or_default();
    let schema = waiting
        .input_schema
        .as_ref()
        .map(reach_proto::json::from_proto);
    let form = Form::of(schema.as_ref()).map_err(|e| ConsoleError::BadRequest(e.to_string()))?;
    let action = format!("{BASE}/inbox/{}", task.task_id);
    let body = html! {
        p.muted { a href={ (BASE) "/inbox" } { "← Inbox" } }
        h1 { "Review " (task.task_id) }
        div.meta {
            span { "flow " strong { (task.flow_id) } " v" (task.flow_version) }
            span { "node " strong { (waiting.node_id) } }
            span { "waiting " (render::age(task.updated_at.as_ref())) }
            span { a href={ (BASE) "/tasks/" (task.task_id) } { "task details" } }
        }
        div.grid2 {
            div {
                @if !waiting.prompt.is_empty() { div.prompt { (waiting.prompt) } }
                @if !review.errors.form.is_empty() {
                    div.notice.error role="alert" #form-errors {
                        @for message in &review.errors.form { div { (message) } }
                    }
                }
                form.card method="post" action=(action) novalidate #review-form {
                    input type="hidden" name="node" value=(waiting.node_id);
                    (form.render(&review.posted, &review.errors))
                    @if crate::session::current().is_some() {
                        p.help { "Your decision is recorded with the identity of your token." }
                    } @else {
                        div class={ "field" @if review.reviewer_error.is_some() { " invalid" } } data-field="reviewer" {
                            label for="reviewer" { "Your name" span.required title="required" { " *" } }
                            input #reviewer name="reviewer" type="text" value=(review.reviewer) autocomplete="name";
                            p.help { "Recorded with your decision, so a second reviewer sees who was first." }
                            @if let Some(message) = &review.reviewer_error { p.error role="alert" { (message) } }
                        }
                    }
                    div.actions {
                        button type="submit" #submit { "Submit and resume" }
                    }
                }
                form.card method="post" action={ (action) "/cancel" } #cancel-form {
                    div.field {
                        label for="reason" { "Cancel instead" }
                        input #reason name="reason" type="text" placeholder="why (optional)";
                        input type="hidden" name="reviewer" value=(review.reviewer);
                        p.help { "Cancelling runs the node's on_cancel path when the flow declares one." }
                    }
                    button.secondary type="submit" #cancel { "Cancel task" }
                }
            }
            div {
                h2 { "Context" }
                div.card { (context(task, 12)) }
            }
        }
    };
    Ok((
        status,
        page(&format!("Review {}", task.task_id), Nav::Inbox, body),
    )
        .into_response())
}

/// Who resumed `task_id` last (its last `human_resumed` event): `(by, at, input)`.
async fn resumed_by(
    console: &Console,
    task_id: &str,
) -> Result<Option<(String, String, Value)>, ConsoleError> {
    let dump = console
        .orchestrator()?
        .dump_task(request(DumpTaskRequest {
            task_id: task_id.to_string(),
        }))
        .await?
        .into_inner();
    Ok(dump
        .records
        .iter()
        .rev()
        .find_map(|record| match &record.record {
            Some(dump_record::Record::Event(e)) if e.kind == "human_resumed" => {
                let detail = render::json(e.detail.as_ref());
                let by = detail
                    .get("by")
                    .and_then(Value::as_str)
                    .unwrap_or("someone who gave no name")
                    .to_string();
                let input = detail.get("input").cloned().unwrap_or(Value::Null);
                Some((by, render::time(e.at.as_ref()), input))
            }
            _ => None,
        }))
}

/// The page of a task that no longer waits: who resumed it, or its status.
async fn not_waiting(
    console: &Console,
    task: &Task,
    status: StatusCode,
) -> Result<Response, ConsoleError> {
    let resumed = resumed_by(console, &task.task_id).await.unwrap_or(None);
    let body = html! {
        p.muted { a href={ (BASE) "/inbox" } { "← Inbox" } }
        h1 { "Review " (task.task_id) }
        @match &resumed {
            Some((by, at, input)) => {
                div.notice.info role="alert" #already-resumed {
                    "This task was already resumed by " strong { (by) } " at " (at) "."
                }
                div.card { div.muted { "their input" } (fields(input, 12)) }
            }
            None if task.status == TaskStatus::WaitingHuman as i32 => {
                div.notice.info role="alert" #already-resumed {
                    "This task now waits at node " strong { (task.current_node) }
                    ", not at the one this form was for: "
                    a href={ (BASE) "/inbox/" (task.task_id) } { "open its review again" } "."
                }
            }
            None => {
                div.notice.info role="alert" #already-resumed {
                    "This task does not wait for a person any more: it is "
                    (render::task_status_name(task.status)) "."
                }
            }
        }
        p { "Status: " (badge(render::task_status_name(task.status))) " · "
            a href={ (BASE) "/tasks/" (task.task_id) } { "task details" } }
    };
    Ok((
        status,
        page(&format!("Review {}", task.task_id), Nav::Inbox, body),
    )
        .into_response())
}

/// `POST /console/inbox/{task_id}`: resumes the task with the posted form.
///
/// Answers 303 to the task page once resumed (remembering the reviewer's name in a
/// cookie); the review page again with the errors next to their fields (422) when the form
/// or the API refuses the input; "already resumed by …" (409) when the task no longer
/// waits in the node the reviewer saw.
///
/// # Errors
/// [`ConsoleError`] when the orchestrator cannot be asked.
pub async fn resume(
    State(console): State<Console>,
    Path(task_id): Path<String>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    extensions: axum::http::Extensions,
    axum::extract::Form(posted): axum::extract::Form<Vec<(String, String)>>,
) -> Result<Response, ConsoleError> {
    let task = get_task(&console, &task_id).await?;
    let node = posted
        .iter()
        .find(|(k, _)| k == "node")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let waiting_node = task
        .waiting
        .as_ref()
        .map(|w| w.node_id.clone())
        .unwrap_or_default();
    if task.status != TaskStatus::WaitingHuman as i32 || (!node.is_empty() && node != waiting_node)
    {
        return not_waiting(&console, &task, StatusCode::CONFLICT).await;
    }
    let reviewer_raw = posted
        .iter()
        .find(|(k, _)| k == "reviewer")
        .map(|(_, v)| v.as_str())
        .unwrap_or("");
    let reviewer = reviewer_name(reviewer_raw);
    let schema = task
        .waiting
        .as_ref()
        .and_then(|w| w.input_schema.as_ref())
        .map(reach_proto::json::from_proto);
    let form = Form::of(schema.as_ref()).map_err(|e| ConsoleError::BadRequest(e.to_string()))?;
    // With a login, the orchestrator records the person's identity; a name is optional.
    let reviewer_error = (reviewer.is_empty() && !console.config().login).then(|| {
        "say who you are (letters, digits, space and . @ _ -), so a second reviewer can be told who was first".to_string()
    });
    let input = match form.input(&posted) {
        Ok(input) if reviewer_error.is_none() => input,
        Ok(_) => {
            let review = Review {
                posted,
                errors: Errors::default(),
                reviewer_error,
                reviewer,
            };
            return review_page(&task, review, StatusCode::UNPROCESSABLE_ENTITY);
        }
        Err(errors) => {
            let review = Review {
                posted,
                errors,
                reviewer_error,
                reviewer,
            };
            return review_page(&task, review, StatusCode::UNPROCESSABLE_ENTITY);
        }
    };
    let mut call = request(ResumeTaskRequest {
        task_id: task_id.clone(),
        node_id: waiting_node,
        input: Some(reach_proto::json::to_proto(&input)),
    });
    if let Ok(value) = reviewer.parse() {
        call.metadata_mut().insert(REVIEWER_METADATA, value);
    }
    match console.orchestrator()?.resume_task(call).await {
        Ok(_) => {
            let mut response =
                Redirect::to(&format!("{BASE}/tasks/{task_id}?resumed=1")).into_response();
            let cookie = cookie::Cookie::build((REVIEWER_COOKIE, reviewer.replace(' ', "+")))
                .path(BASE)
                .same_site(cookie::SameSite::Strict)
                .http_only(true)
                .secure(crate::auth::served_securely(&uri, &headers, &extensions))
                .max_age(cookie::time::Duration::days(365))
                .build()
                .to_string();
            if let Ok(value) = HeaderValue::from_str(&cookie) {
                response.headers_mut().insert(header::SET_COOKIE, value);
            }
            Ok(response)
        }
        Err(status) if status.code() == tonic::Code::InvalidArgument => {
            let violations: Vec<(String, String)> = status
                .get_details_bad_request()
                .map(|b| {
                    b.field_violations
                        .into_iter()
                        .map(|v| (v.field, v.description))
                        .collect()
                })
                .unwrap_or_default();
            let mut errors = form.errors(&violations);
            if errors.is_empty() {
                errors.form.push(status.message().to_string());
            }
            let review = Review {
                posted,
                errors,
                reviewer_error: None,
                reviewer,
            };
            review_page(&task, review, StatusCode::UNPROCESSABLE_ENTITY)
        }
        Err(status) if status.code() == tonic::Code::FailedPrecondition => {
            let task = get_task(&console, &task_id).await?;
            not_waiting(&console, &task, StatusCode::CONFLICT).await
        }
        Err(status) => Err(status.into()),
    }
}

/// `POST /console/inbox/{task_id}/cancel`: cancels the task (its human node's `on_cancel`
/// runs when declared), then 303 to the task page.
///
/// # Errors
/// [`ConsoleError`] when the orchestrator refuses (the task already ended: 409).
pub async fn cancel(
    State(console): State<Console>,
    Path(task_id): Path<String>,
    axum::extract::Form(posted): axum::extract::Form<Vec<(String, String)>>,
) -> Result<Response, ConsoleError> {
    let value = |name: &str| {
        posted
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or("")
    };
    let reviewer = reviewer_name(value("reviewer"));
    let reason = clip(value("reason").trim(), MAX_REASON_CHARS);
    let who = if reviewer.is_empty() {
        "the console".to_string()
    } else {
        reviewer
    };
    let reason = if reason.is_empty() {
        format!("cancelled by {who} in the console")
    } else {
        format!("cancelled by {who} in the console: {reason}")
    };
    console
        .orchestrator()?
        .cancel_task(request(CancelTaskRequest {
            task_id: task_id.clone(),
            reason,
        }))
        .await?;
    Ok(Redirect::to(&format!("{BASE}/tasks/{task_id}?cancelled=1")).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reviewer_names_are_ascii_and_bounded() {
        assert_eq!(reviewer_name("  Ana <script> "), "Ana script");
        assert_eq!(reviewer_name(&"a".repeat(100)).len(), MAX_REVIEWER_CHARS);
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            "x=1; reach_reviewer=Ana+Lima".parse().unwrap(),
        );
        assert_eq!(reviewer_cookie(&headers), "Ana Lima");
    }
}
