//! `reach task start | get | list | resume | cancel | retry | watch | dead-letters`.

use std::io::Write;

use clap::{Args, Subcommand};
use reach_orchestrator::event::TaskStatus;
use reach_orchestrator::json::{self, task_json};
use reach_proto::v1 as pb;

use super::{
    CliError, DEFAULT_ENDPOINT, client, compact, fmt_ts, parse_json, status_name, write_json,
};

/// `reach task ...`
#[derive(Debug, Clone, Subcommand)]
pub enum TaskCommand {
    /// Start a task.
    Start {
        /// The flow id.
        #[arg(long)]
        flow: String,
        /// The task input as JSON.
        #[arg(long, default_value = "{}")]
        input: String,
        /// A flow version (default: latest).
        #[arg(long, default_value_t = 0)]
        version: u32,
        /// A task id of your choice (starting it again returns the same task).
        #[arg(long)]
        id: Option<String>,
        /// Print the task as JSON (as `task get --json` does; `.task_id` is its id) instead of
        /// its id, status and the commands to follow it. For scripts.
        #[arg(long)]
        json: bool,
    },
    /// Show a task with its node history.
    Get {
        /// The task id.
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List tasks, newest first.
    List {
        /// Only this status (pending, dispatched, processing, waiting_human, succeeded,
        /// failed, partial, cancelled).
        #[arg(long)]
        status: Option<String>,
        /// Only this flow.
        #[arg(long)]
        flow: Option<String>,
        /// At most this many (the list says when there are more).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// Print a JSON array of tasks, each as `task get --json` prints one (without node
        /// history, which lists leave out).
        #[arg(long)]
        json: bool,
    },
    /// Give a person's input to a task waiting in a human node.
    Resume {
        /// The task id.
        id: String,
        /// The input as JSON.
        #[arg(long)]
        input: String,
        /// The human node (default: the one the task waits in).
        #[arg(long)]
        node: Option<String>,
    },
    /// Cancel a task.
    Cancel {
        /// The task id.
        id: String,
        /// Why.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Retry a failed task from its failed node.
    Retry {
        /// The task id.
        id: String,
    },
    /// Stream a task's events until it ends.
    Watch {
        /// The task id.
        id: String,
    },
    /// List dead letters (tasks that failed for good).
    DeadLetters {
        /// Only this flow.
        #[arg(long)]
        flow: Option<String>,
    },
}

/// `reach task` arguments.
#[derive(Debug, Clone, Args)]
pub struct TaskArgs {
    /// The subcommand.
    #[command(subcommand)]
    pub command: TaskCommand,
}

/// Runs `reach task ...`; returns the exit code.
///
/// # Errors
/// [`CliError`] for transport failures and rejected requests.
pub async fn task(endpoint: &str, args: TaskArgs, out: &mut dyn Write) -> Result<i32, CliError> {
    match args.command {
        TaskCommand::Start {
            flow,
            input,
            version,
            id,
            json,
        } => task_start(endpoint, &flow, &input, version, id, json, out).await,
        TaskCommand::Get { id, json } => task_get(endpoint, &id, json, out).await,
        TaskCommand::List {
            status,
            flow,
            limit,
            json,
        } => {
            task_list(
                endpoint,
                status.as_deref(),
                flow.as_deref(),
                limit,
                json,
                out,
            )
            .await
        }
        TaskCommand::Resume { id, input, node } => {
            task_resume(endpoint, &id, &input, node, out).await
        }
        TaskCommand::Cancel { id, reason } => task_cancel(endpoint, &id, &reason, out).await,
        TaskCommand::Retry { id } => task_retry(endpoint, &id, out).await,
        TaskCommand::Watch { id } => task_watch(endpoint, &id, out).await,
        TaskCommand::DeadLetters { flow } => dead_letters(endpoint, flow.as_deref(), out).await,
    }
}

/// `reach task start --flow ID --input JSON [--json]`: starts a task (flow `version` 0 means
/// the latest) and prints its id, flow and status, then the commands that follow it, show it
/// and — when it already waits for a person — resume it. With `as_json`, prints the task as
/// `task get --json` does instead, for scripts (`.task_id` is the id).
///
/// # Errors
/// [`CliError::Usage`] when `input` is not JSON; [`CliError::Connect`] and
/// [`CliError::Rpc`] (for example an unknown flow) from the orchestrator.
pub async fn task_start(
    endpoint: &str,
    flow: &str,
    input: &str,
    version: u32,
    id: Option<String>,
    as_json: bool,
    out: &mut dyn Write,
) -> Result<i32, CliError> {
    let input = parse_json("--input", input)?;
    let mut c = client(endpoint).await?;
    let task = c
        .start_task(pb::StartTaskRequest {
            flow_id: flow.to_string(),
            flow_version: version,
            input: Some(json::to_proto(&input)),
            task_id: id.unwrap_or_default(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .task
        .unwrap_or_default();
    if as_json {
        write_json(out, &task_json(&task))?;
        return Ok(0);
    }
    let status = status_name(task.status);
    let at = if task.current_node.is_empty() {
        String::new()
    } else {
        format!(" at node {}", task.current_node)
    };
    writeln!(
        out,
        "task {}  {status}{at}  (flow {} v{})",
        task.task_id, task.flow_id, task.flow_version
    )?;
    let endpoint_flag = endpoint_flag(endpoint);
    let id = &task.task_id;
    writeln!(out, "follow it:  reach task watch {id}{endpoint_flag}")?;
    writeln!(out, "show it:    reach task get {id}{endpoint_flag}")?;
    if let Some(resume) = resume_command(&task, endpoint) {
        writeln!(out, "resume it:  {resume}")?;
    }
    Ok(0)
}

/// The command that resumes `task`, when it waits for a person.
fn resume_command(task: &pb::Task, endpoint: &str) -> Option<String> {
    let waiting = task.waiting.as_ref()?;
    let input = if waiting.input_schema.is_some() {
        "<JSON matching the schema>"
    } else {
        "<JSON>"
    };
    Some(format!(
        "reach task resume {} --input '{input}'{}",
        task.task_id,
        endpoint_flag(endpoint)
    ))
}

/// ` --endpoint URL` when `endpoint` is not the default, so a printed command works as is.
fn endpoint_flag(endpoint: &str) -> String {
    if endpoint == DEFAULT_ENDPOINT {
        String::new()
    } else {
        format!(" --endpoint {endpoint}")
    }
}

/// `reach task get ID [--json]`: the task's status and input; while it waits for a person,
/// the human node, its prompt and schema and the command to resume it; once it ended, its output; and
/// every node visit with its output or error.
///
/// # Errors
/// [`CliError`].
pub async fn task_get(
    endpoint: &str,
    id: &str,
    as_json: bool,
    out: &mut dyn Write,
) -> Result<i32, CliError> {
    let mut c = client(endpoint).await?;
    let task = c
        .get_task(pb::GetTaskRequest {
            task_id: id.to_string(),
        })
        .await?
        .into_inner()
        .task
        .unwrap_or_default();
    if as_json {
        write_json(out, &task_json(&task))?;
        return Ok(0);
    }
    writeln!(out, "task      {}", task.task_id)?;
    writeln!(out, "flow      {} v{}", task.flow_id, task.flow_version)?;
    writeln!(out, "status    {}", status_name(task.status))?;
    // What the task was started with: a reviewer deciding a human step needs it.
    if let Some(input) = &task.input {
        writeln!(out, "input     {}", json::from_proto(input))?;
    }
    if let Some(waiting) = &task.waiting {
        writeln!(
            out,
            "waiting   for a person, at human node {}",
            waiting.node_id
        )?;
        if !waiting.prompt.is_empty() {
            writeln!(out, "prompt    {}", waiting.prompt)?;
        }
        if let Some(schema) = &waiting.input_schema {
            writeln!(out, "schema    {}", json::from_proto(schema))?;
        }
        if let Some(deadline) = &waiting.deadline {
            writeln!(out, "times out {}", fmt_ts(deadline))?;
        }
        if let Some(resume) = resume_command(&task, endpoint) {
            writeln!(out, "resume    {resume}")?;
        }
    } else if !task.current_node.is_empty() {
        writeln!(out, "node      {}", task.current_node)?;
    }
    writeln!(out, "trace     {}", task.trace_id)?;
    if let Some(usage) = &task.usage {
        writeln!(out, "tokens    {}", usage_line(usage))?;
    }
    if !task.error.is_empty() {
        writeln!(out, "error     {}", task.error)?;
    }
    // Only an ended task has an output; while it runs, each node's output is in the table.
    if let Some(output) = &task.output {
        writeln!(out, "output    {}", json::from_proto(output))?;
    }
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header([
        "NODE",
        "TYPE",
        "STATUS",
        "ATTEMPTS",
        "NEXT",
        "OUTPUT / ERROR",
    ]);
    for n in &task.nodes {
        let status = pb::NodeStatus::try_from(n.status)
            .map(|s| {
                s.as_str_name()
                    .trim_start_matches("NODE_STATUS_")
                    .to_string()
            })
            .unwrap_or_default();
        let detail = if !n.error.is_empty() {
            n.error.clone()
        } else if n.node_type == "human" && n.status == pb::NodeStatus::Running as i32 {
            "(waiting for a person)".to_string()
        } else {
            compact(&json::from_proto_opt(n.output.as_ref()))
        };
        table.add_row([
            n.node_id.clone(),
            n.node_type.clone(),
            status,
            n.attempts.to_string(),
            n.next_node.clone(),
            detail,
        ]);
    }
    writeln!(out, "{table}")?;
    Ok(0)
}

/// `reach task list [--status S]`.
///
/// # Errors
/// [`CliError`]; [`CliError::Usage`] for an unknown status.
pub async fn task_list(
    endpoint: &str,
    status: Option<&str>,
    flow: Option<&str>,
    limit: u32,
    as_json: bool,
    out: &mut dyn Write,
) -> Result<i32, CliError> {
    let status = match status {
        None => pb::TaskStatus::Unspecified,
        Some(s) => {
            let parsed = TaskStatus::parse(s).ok_or_else(|| {
                CliError::Usage(format!(
                    "--status {s:?} is not a status; use one of {}",
                    TaskStatus::ALL
                        .iter()
                        .map(|s| s.as_str().to_lowercase())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            reach_orchestrator::service::status_to_proto(parsed)
        }
    };
    let mut c = client(endpoint).await?;
    // Pages of at most the server's page bound, until `limit` tasks or the end.
    let mut tasks = Vec::new();
    let mut page_token = String::new();
    let more = loop {
        let want = (limit as usize - tasks.len()).min(MAX_PAGE) as u32;
        let page = c
            .list_tasks(pb::ListTasksRequest {
                status: status.into(),
                flow_id: flow.unwrap_or_default().to_string(),
                page_size: want,
                page_token: std::mem::take(&mut page_token),
                ..Default::default()
            })
            .await?
            .into_inner();
        tasks.extend(page.tasks);
        if page.next_page_token.is_empty() {
            break false;
        }
        if tasks.len() >= limit as usize {
            // A full page comes with a token even when nothing follows: look for one more.
            let next = c
                .list_tasks(pb::ListTasksRequest {
                    status: status.into(),
                    flow_id: flow.unwrap_or_default().to_string(),
                    page_size: 1,
                    page_token: page.next_page_token,
                    ..Default::default()
                })
                .await?
                .into_inner();
            break !next.tasks.is_empty();
        }
        page_token = page.next_page_token;
    };
    tasks.truncate(limit as usize);
    if as_json {
        write_json(out, &tasks.iter().map(task_json).collect::<Vec<_>>())?;
        if more {
            // stdout stays one JSON array; the person running it still learns of the rest.
            eprintln!("{}", more_tasks(limit));
        }
        return Ok(0);
    }
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header(["TASK", "FLOW", "STATUS", "NODE", "ERROR"]);
    for t in &tasks {
        table.add_row([
            t.task_id.clone(),
            format!("{} v{}", t.flow_id, t.flow_version),
            status_name(t.status),
            t.current_node.clone(),
            t.error.clone(),
        ]);
    }
    writeln!(out, "{table}")?;
    if more {
        writeln!(out, "{}", more_tasks(limit))?;
    }
    Ok(0)
}

/// The most tasks asked for in one ListTasks page (the orchestrator's own bound).
const MAX_PAGE: usize = 1000;

/// The line that says a list stopped at `--limit`.
fn more_tasks(limit: u32) -> String {
    format!(
        "showing the first {limit} tasks; there are more: raise --limit, or narrow with --status / --flow"
    )
}

/// `reach task resume ID --input JSON`.
///
/// # Errors
/// [`CliError`]; a schema violation comes back as [`CliError::Rpc`] naming the field path.
pub async fn task_resume(
    endpoint: &str,
    id: &str,
    input: &str,
    node: Option<String>,
    out: &mut dyn Write,
) -> Result<i32, CliError> {
    let input = parse_json("--input", input)?;
    let mut c = client(endpoint).await?;
    let task = c
        .resume_task(pb::ResumeTaskRequest {
            task_id: id.to_string(),
            node_id: node.unwrap_or_default(),
            input: Some(json::to_proto(&input)),
        })
        .await?
        .into_inner()
        .task
        .unwrap_or_default();
    writeln!(
        out,
        "task {} resumed ({})",
        task.task_id,
        status_name(task.status)
    )?;
    Ok(0)
}

/// `reach task cancel ID`.
///
/// # Errors
/// [`CliError`].
pub async fn task_cancel(
    endpoint: &str,
    id: &str,
    reason: &str,
    out: &mut dyn Write,
) -> Result<i32, CliError> {
    let mut c = client(endpoint).await?;
    let task = c
        .cancel_task(pb::CancelTaskRequest {
            task_id: id.to_string(),
            reason: reason.to_string(),
        })
        .await?
        .into_inner()
        .task
        .unwrap_or_default();
    writeln!(
        out,
        "task {} {}",
        task.task_id,
        status_name(task.status).to_lowercase()
    )?;
    Ok(0)
}

/// `reach task retry ID`.
///
/// # Errors
/// [`CliError`].
pub async fn task_retry(endpoint: &str, id: &str, out: &mut dyn Write) -> Result<i32, CliError> {
    let mut c = client(endpoint).await?;
    let task = c
        .retry_task(pb::RetryTaskRequest {
            task_id: id.to_string(),
        })
        .await?
        .into_inner()
        .task
        .unwrap_or_default();
    writeln!(
        out,
        "task {} retried from node {}",
        task.task_id, task.current_node
    )?;
    Ok(0)
}

/// `reach task watch ID`: one line per event until the task ends.
///
/// # Errors
/// [`CliError`].
pub async fn task_watch(endpoint: &str, id: &str, out: &mut dyn Write) -> Result<i32, CliError> {
    let mut c = client(endpoint).await?;
    let mut stream = c
        .watch_task(pb::WatchTaskRequest {
            task_id: id.to_string(),
            after_sequence: 0,
        })
        .await?
        .into_inner();
    while let Some(r) = stream.message().await? {
        let Some(e) = r.event else { continue };
        let at = e.at.as_ref().map(fmt_ts).unwrap_or_default();
        let mut d = json::from_proto_opt(e.detail.as_ref());
        if let Some(m) = d.as_object_mut() {
            m.remove("kind");
            m.remove("node");
        }
        writeln!(
            out,
            "{at}  #{:<4} {:<16} {:<14} {:<13} {}",
            e.sequence,
            e.kind,
            e.node_id,
            status_name(e.status),
            compact(&d)
        )?;
        out.flush()?;
    }
    Ok(0)
}

/// `reach task dead-letters`.
///
/// # Errors
/// [`CliError`].
pub async fn dead_letters(
    endpoint: &str,
    flow: Option<&str>,
    out: &mut dyn Write,
) -> Result<i32, CliError> {
    let mut c = client(endpoint).await?;
    let list = c
        .list_dead_letters(pb::ListDeadLettersRequest {
            flow_id: flow.unwrap_or_default().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .dead_letters;
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header(["TASK", "FLOW", "FAILED NODE", "ERROR"]);
    for d in &list {
        let t = d.task.clone().unwrap_or_default();
        table.add_row([t.task_id, t.flow_id, d.failed_node.clone(), d.error.clone()]);
    }
    writeln!(out, "{table}")?;
    Ok(0)
}

/// `1200 in, 300 out (4 model calls)`.
pub(crate) fn usage_line(usage: &pb::TokenUsage) -> String {
    let calls = match usage.model_calls {
        1 => "1 model call".to_string(),
        n => format!("{n} model calls"),
    };
    format!(
        "{} in, {} out ({calls})",
        usage.input_tokens, usage.output_tokens
    )
}
