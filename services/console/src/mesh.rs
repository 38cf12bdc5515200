//! The mesh at a glance: instances grouped by capability with their state, load (in flight
//! of max concurrency, model slots) and lease (age since registration, time left); the
//! capabilities with descriptions and schemas; the dead letters, each with a retry button.

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::response::{Html, IntoResponse, Redirect, Response};
use maud::{Markup, html};
use reach_proto::v1::{
    Instance, InstanceState, ListCapabilitiesRequest, ListDeadLettersRequest, ListInstancesRequest,
    RetryTaskRequest,
};

use crate::layout::{Nav, live_page};
use crate::render::{self, badge};
use crate::{BASE, Console, ConsoleError, request};

/// The most capabilities and dead letters listed.
pub const MAX_ROWS: u32 = 500;

/// An instance state without its prefix (`READY`).
fn state_name(state: i32) -> &'static str {
    InstanceState::try_from(state)
        .unwrap_or(InstanceState::Unspecified)
        .as_str_name()
        .trim_start_matches("INSTANCE_STATE_")
}

/// `GET /console/mesh`.
///
/// # Errors
/// [`ConsoleError`] when the registry cannot be asked (the dead letters are left out when
/// there is no orchestrator).
pub async fn page(State(console): State<Console>) -> Result<Html<String>, ConsoleError> {
    let mut registry = console.registry()?;
    let instances = registry
        .list_instances(request(ListInstancesRequest::default()))
        .await?
        .into_inner()
        .instances;
    let capabilities = registry
        .list_capabilities(request(ListCapabilitiesRequest {
            name_prefix: String::new(),
            page_size: MAX_ROWS,
            page_token: String::new(),
        }))
        .await?
        .into_inner()
        .capabilities;
    let dead = match console.orchestrator() {
        Ok(mut o) => Some(
            o.list_dead_letters(request(ListDeadLettersRequest {
                flow_id: String::new(),
                page_size: MAX_ROWS,
                page_token: String::new(),
            }))
            .await?
            .into_inner()
            .dead_letters,
        ),
        Err(_) => None,
    };
    let mut by_capability: BTreeMap<String, Vec<&Instance>> = BTreeMap::new();
    for instance in &instances {
        let spec = instance.spec.as_ref();
        let caps = spec.map(|s| s.capabilities.as_slice()).unwrap_or_default();
        if caps.is_empty() {
            by_capability
                .entry("(no capability)".into())
                .or_default()
                .push(instance);
        }
        for cap in caps {
            by_capability
                .entry(format!("{}@{}", cap.name, cap.version))
                .or_default()
                .push(instance);
        }
    }
    let body = html! {
        h1 { "Mesh" }
        p.muted { (instances.len()) " instances, " (capabilities.len()) " capabilities." }
        h2 { "Instances by capability" }
        @for (capability, list) in &by_capability {
            div.card.capability data-capability=(capability) {
                h3 { code { (capability) } " " span.muted { "(" (list.len()) ")" } }
                (instance_table(list, console.latency()))
            }
        }
        h2 { "Capabilities" }
        div.scroll { table.wide #capabilities {
            thead { tr { th { "Name" } th { "Versions" } th { "Routable" } th { "Description" } th { "Schemas" } } }
            tbody { @for c in &capabilities { tr {
                td data-label="name" { code { (c.name) } @if c.idempotent { div.muted { "idempotent" } } }
                td data-label="versions" { (c.versions.join(", ")) }
                td data-label="routable" { (c.routable_instances) " of " (c.instances) }
                td data-label="description" { (c.description) }
                td data-label="schemas" {
                    @if !c.input_schema.is_empty() { details { summary { "input" } (schema(&c.input_schema)) } }
                    @if !c.output_schema.is_empty() { details { summary { "output" } (schema(&c.output_schema)) } }
                }
            } } }
        } }
        h2 { "Dead letters" }
        @match &dead {
            None => p.muted { "No orchestrator to ask." },
            Some(list) if list.is_empty() => p.muted { "None: no task failed for good." },
            Some(list) => div.scroll { table.wide #dead-letters {
                thead { tr { th { "Task" } th { "Flow" } th { "Failed at" } th { "Error" } th { "" } } }
                tbody { @for d in list {
                    @let task = d.task.clone().unwrap_or_default();
                    tr {
                        td data-label="task" { a href={ (BASE) "/tasks/" (task.task_id) } { (task.task_id) } }
                        td data-label="flow" { (task.flow_id) }
                        td data-label="failed at" { code { (d.failed_node) } }
                        td data-label="error" { (render::cut(&d.error, 300)) }
                        td { form method="post" action={ (BASE) "/dead-letters/" (task.task_id) "/retry" } {
                            button.small type="submit" { "Retry" } } }
                    }
                } }
            } },
        }
    };
    Ok(live_page(
        "Mesh",
        Nav::Mesh,
        console.config().refresh_ms,
        body,
    ))
}

/// The instances of one capability; latencies from `latency` (the router alongside), or
/// "no router here" without one.
fn instance_table(list: &[&Instance], latency: Option<&crate::LatencySource>) -> Markup {
    html! {
        div.scroll { table.wide.instances {
            thead { tr { th { "Instance" } th { "Service" } th { "State" } th { "Load" } th { "Latency" } th { "Lease" } th { "Endpoint" } } }
            tbody { @for i in list {
                @let spec = i.spec.clone().unwrap_or_default();
                tr.instance data-instance-id=(spec.instance_id) {
                    td data-label="instance" { code { (spec.instance_id) } }
                    td data-label="service" { (spec.service) }
                    td data-label="state" { (badge(state_name(i.state)))
                        @if !i.health_probe_error.is_empty() { div.error { (i.health_probe_error) } } }
                    td data-label="load" { (i.in_flight) " / " (spec.max_concurrency) " in flight"
                        @if i.model_calls_in_flight > 0 || i.model_slots_free > 0 {
                            div.muted { (i.model_calls_in_flight) " model calls, " (i.model_slots_free) " slots free" } } }
                    td data-label="latency" { @match latency {
                        None => span.muted { "no router here" },
                        Some(source) => @match source.of(&spec.instance_id) {
                            Some(d) => (render::latency(d)),
                            None => span.muted { "not measured yet" },
                        },
                    } }
                    td data-label="lease" { "age " (render::age(i.registered_at.as_ref()))
                        div.muted { "expires " (render::age(i.lease_expires_at.as_ref())) } }
                    td data-label="endpoint" { code { (spec.endpoint) } }
                }
            } }
        } }
    }
}

/// A schema given as JSON text, pretty-printed (as given when it does not parse).
fn schema(text: &str) -> Markup {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v) => render::pretty(&v),
        Err(_) => html! { pre.json { (text) } },
    }
}

/// `POST /console/dead-letters/{task_id}/retry`: retries the task, then 303 to its page.
///
/// # Errors
/// [`ConsoleError`] when the orchestrator refuses (the task is not FAILED or PARTIAL: 409).
pub async fn retry(
    State(console): State<Console>,
    Path(task_id): Path<String>,
) -> Result<Response, ConsoleError> {
    console
        .orchestrator()?
        .retry_task(request(RetryTaskRequest {
            task_id: task_id.clone(),
        }))
        .await?;
    Ok(Redirect::to(&format!("{BASE}/tasks/{task_id}")).into_response())
}
