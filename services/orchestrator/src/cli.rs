//! The orchestrator commands of the `reach` CLI: clap argument structs plus one async
//! function per command that talks to `--endpoint` and writes to any `std::io::Write`.
//!
//! Wiring in the `reach` binary is one line per command, for example
//! `Command::Flow(args) => reach_orchestrator::cli::flow(&endpoint, args, &mut stdout).await`.
//! Every function returns the process exit code (0 ok, 1 failure such as an invalid flow);
//! [`CliError`] is for transport problems (unreachable endpoint, gRPC errors).

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use serde_json::{Value, json};

use crate::event::TaskStatus;
use crate::flow::Flow;
use crate::json;

/// The orchestrator endpoint the commands use when `--endpoint` is not given (`reach dev`'s
/// default gRPC address).
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:7070";

/// Why a command could not run.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The endpoint could not be reached.
    #[error(
        "cannot reach the orchestrator at {endpoint}: {message}; is it running (`reach dev` or `reach orchestrator`)? pass --endpoint otherwise"
    )]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// The transport error.
        message: String,
    },
    /// The orchestrator answered with an error.
    #[error("{}: {}", crate::engine::code_name(.0.code()).to_lowercase().replace('_', " "), .0.message())]
    Rpc(tonic::Status),
    /// A flag value was not valid.
    #[error("{0}")]
    Usage(String),
    /// Writing the output failed (its source is the `std::io::Error`, which `{:#}` of an
    /// `anyhow::Error` prints after this message).
    #[error("cannot write output")]
    Io(#[from] std::io::Error),
}

impl From<tonic::Status> for CliError {
    fn from(s: tonic::Status) -> Self {
        CliError::Rpc(s)
    }
}

/// `reach flow ...`
#[derive(Debug, Clone, Subcommand)]
pub enum FlowCommand {
    /// Validate a flow file locally (exit code 1 and located errors when invalid).
    Validate {
        /// The flow file.
        file: PathBuf,
    },
    /// Validate and apply a flow file on the orchestrator.
    Apply {
        /// The flow file.
        file: PathBuf,
    },
    /// List applied flows (latest version of each).
    List,
}

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
        /// At most this many.
        #[arg(long, default_value_t = 50)]
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

/// `reach flow` arguments.
#[derive(Debug, Clone, Args)]
pub struct FlowArgs {
    /// The subcommand.
    #[command(subcommand)]
    pub command: FlowCommand,
}

/// `reach task` arguments.
#[derive(Debug, Clone, Args)]
pub struct TaskArgs {
    /// The subcommand.
    #[command(subcommand)]
    pub command: TaskCommand,
}

/// `reach dump` arguments.
#[derive(Debug, Clone, Args)]
pub struct DumpArgs {
    /// The task whose messages and events to print.
    #[arg(long)]
    pub task: String,
    /// Print JSON lines.
    #[arg(long)]
    pub json: bool,
}

async fn client(
    endpoint: &str,
) -> Result<OrchestratorServiceClient<tonic::transport::Channel>, CliError> {
    let ep = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .map_err(|e| {
            CliError::Usage(format!(
                "--endpoint {endpoint:?} is not a URI: {e}; use http://HOST:PORT"
            ))
        })?
        .connect_timeout(std::time::Duration::from_secs(3));
    let channel = ep.connect().await.map_err(|e| CliError::Connect {
        endpoint: endpoint.to_string(),
        message: std::error::Error::source(&e).map_or_else(|| e.to_string(), ToString::to_string),
    })?;
    Ok(OrchestratorServiceClient::new(channel))
}

fn parse_json(flag: &str, text: &str) -> Result<Value, CliError> {
    serde_json::from_str(text).map_err(|e| {
        CliError::Usage(format!(
            "{flag} is not valid JSON ({e}); quote it, for example {flag} '{{\"text\": \"hello\"}}'"
        ))
    })
}

/// Runs `reach flow ...`; returns the exit code.
///
/// # Errors
/// [`CliError`] for transport failures.
pub async fn flow(endpoint: &str, args: FlowArgs, out: &mut dyn Write) -> Result<i32, CliError> {
    match args.command {
        FlowCommand::Validate { file } => flow_validate(&file, out),
        FlowCommand::Apply { file } => flow_apply(endpoint, &file, out).await,
        FlowCommand::List => flow_list(endpoint, out).await,
    }
}

/// `reach flow validate FILE`: 0 and a summary when valid, 1 and one located error per line
/// when not.
///
/// # Errors
/// [`CliError::Io`] when writing fails.
pub fn flow_validate(file: &std::path::Path, out: &mut dyn Write) -> Result<i32, CliError> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            writeln!(out, "{}: cannot read: {e}", file.display())?;
            return Ok(1);
        }
    };
    match Flow::parse(&file.display().to_string(), &text) {
        Ok(flow) => {
            writeln!(
                out,
                "{}: flow {} version {} is valid ({} nodes, initial {})",
                file.display(),
                flow.id,
                flow.version,
                flow.nodes.len(),
                flow.initial
            )?;
            Ok(0)
        }
        Err(errors) => {
            for e in &errors.errors {
                writeln!(out, "{e}")?;
            }
            writeln!(out, "{} error(s)", errors.errors.len())?;
            Ok(1)
        }
    }
}

/// `reach flow apply FILE`.
///
/// # Errors
/// [`CliError`] for transport failures.
pub async fn flow_apply(
    endpoint: &str,
    file: &std::path::Path,
    out: &mut dyn Write,
) -> Result<i32, CliError> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            writeln!(out, "{}: cannot read: {e}", file.display())?;
            return Ok(1);
        }
    };
    // Validate locally first, for located errors without a round trip.
    if flow_validate(file, &mut std::io::sink())? != 0 {
        return flow_validate(file, out);
    }
    let mut c = client(endpoint).await?;
    match c
        .apply_flow(pb::ApplyFlowRequest {
            yaml: text,
            source: file.display().to_string(),
        })
        .await
    {
        Ok(r) => {
            let r = r.into_inner();
            let f = r.flow.unwrap_or_default();
            writeln!(
                out,
                "flow {} version {} {}",
                f.flow_id,
                f.version,
                if r.changed { "applied" } else { "unchanged" }
            )?;
            Ok(0)
        }
        Err(s)
            if s.code() == tonic::Code::FailedPrecondition
                || s.code() == tonic::Code::InvalidArgument =>
        {
            writeln!(out, "{}", s.message())?;
            Ok(1)
        }
        Err(s) => Err(s.into()),
    }
}

/// `reach flow list`.
///
/// # Errors
/// [`CliError`] for transport failures.
pub async fn flow_list(endpoint: &str, out: &mut dyn Write) -> Result<i32, CliError> {
    let mut c = client(endpoint).await?;
    let flows = c
        .list_flows(pb::ListFlowsRequest::default())
        .await?
        .into_inner()
        .flows;
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header(["FLOW", "VERSION", "INITIAL", "NODES", "SOURCE"]);
    for f in &flows {
        table.add_row([
            f.flow_id.clone(),
            f.version.to_string(),
            f.initial.clone(),
            f.node_count.to_string(),
            f.source.clone(),
        ]);
    }
    writeln!(out, "{table}")?;
    Ok(0)
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

/// `reach task get ID [--json]`: the task's status; while it waits for a person, the human
/// node, its prompt and schema and the command to resume it; once it ended, its output; and
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

fn compact(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        format!("{}…", s.chars().take(79).collect::<String>())
    } else {
        s
    }
}

fn status_name(s: i32) -> String {
    pb::TaskStatus::try_from(s)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("TASK_STATUS_")
                .to_string()
        })
        .unwrap_or_else(|_| "UNKNOWN".into())
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
            crate::service::status_to_proto(parsed)
        }
    };
    let mut c = client(endpoint).await?;
    let tasks = c
        .list_tasks(pb::ListTasksRequest {
            status: status.into(),
            flow_id: flow.unwrap_or_default().to_string(),
            page_size: limit,
            page_token: String::new(),
        })
        .await?
        .into_inner()
        .tasks;
    if as_json {
        write_json(out, &tasks.iter().map(task_json).collect::<Vec<_>>())?;
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
    Ok(0)
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

/// `reach dump --task ID`: every message and node event of the task in time order.
///
/// # Errors
/// [`CliError`].
pub async fn dump(endpoint: &str, args: DumpArgs, out: &mut dyn Write) -> Result<i32, CliError> {
    let mut c = client(endpoint).await?;
    let r = c
        .dump_task(pb::DumpTaskRequest {
            task_id: args.task.clone(),
        })
        .await?
        .into_inner();
    let task = r.task.unwrap_or_default();
    if !args.json {
        writeln!(
            out,
            "task {} flow {} v{} status {} trace {}",
            task.task_id,
            task.flow_id,
            task.flow_version,
            status_name(task.status),
            task.trace_id
        )?;
    }
    for rec in &r.records {
        let at = rec.at.as_ref().map(fmt_ts).unwrap_or_default();
        match &rec.record {
            Some(pb::dump_record::Record::Event(e)) => {
                let detail = json::from_proto_opt(e.detail.as_ref());
                if args.json {
                    writeln!(
                        out,
                        "{}",
                        json!({"at": at, "type": "event", "seq": e.sequence, "kind": e.kind, "node": e.node_id, "status": status_name(e.status), "detail": detail})
                    )?;
                } else {
                    let mut d = detail.clone();
                    if let Some(m) = d.as_object_mut() {
                        m.remove("kind");
                        m.remove("node");
                    }
                    writeln!(
                        out,
                        "{at}  event   #{:<4} {:<16} {:<14} {}",
                        e.sequence,
                        e.kind,
                        e.node_id,
                        compact(&d)
                    )?;
                }
            }
            Some(pb::dump_record::Record::Message(m)) => {
                let h = m.header.clone().unwrap_or_default();
                let target = match &h.target {
                    Some(pb::header::Target::Capability(c)) => format!("capability:{c}"),
                    Some(pb::header::Target::Service(s)) => format!("service:{s}"),
                    Some(pb::header::Target::Topic(t)) => format!("topic:{t}"),
                    None => String::new(),
                };
                let latency = m
                    .latency
                    .as_ref()
                    .map(|d| format!("{:.1}ms", d.seconds as f64 * 1e3 + f64::from(d.nanos) / 1e6))
                    .unwrap_or_default();
                let code = crate::engine::code_name(tonic::Code::from_i32(m.status_code));
                if args.json {
                    writeln!(
                        out,
                        "{}",
                        json!({"at": at, "type": "message", "message_id": h.message_id, "source": h.source, "target": target, "payload_type": m.payload_type, "payload_bytes": m.payload_bytes, "status": code, "latency": latency, "instance": m.instance_id, "error": m.status_message})
                    )?;
                } else {
                    writeln!(
                        out,
                        "{at}  message {} {} -> {} [{}] {}B {} {} {}",
                        h.message_id,
                        h.source,
                        target,
                        m.payload_type,
                        m.payload_bytes,
                        code,
                        latency,
                        m.instance_id
                    )?;
                }
            }
            None => {}
        }
    }
    Ok(0)
}

fn fmt_ts(t: &prost_types::Timestamp) -> String {
    let st = reach_rpc::time::system_time(t).unwrap_or(std::time::UNIX_EPOCH);
    humantime::format_rfc3339_millis(st).to_string()
}

/// Writes `value` as one pretty JSON document (what `--json` prints).
fn write_json(out: &mut dyn std::io::Write, value: &impl serde::Serialize) -> std::io::Result<()> {
    writeln!(
        out,
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_default()
    )
}

/// A task as JSON (for `task get --json`, `task start --json` and `GET /tasks/{id}`); values
/// are already masked. `output` is `null` until the task ended; `waiting` (the human node, its
/// prompt, `input_schema` and `deadline`) is set only while it is WAITING_HUMAN.
pub fn task_json(t: &pb::Task) -> Value {
    let ts = |t: &Option<prost_types::Timestamp>| t.as_ref().map(fmt_ts);
    json!({
        "task_id": t.task_id,
        "flow_id": t.flow_id,
        "flow_version": t.flow_version,
        "status": status_name(t.status),
        "current_node": t.current_node,
        "input": json::from_proto_opt(t.input.as_ref()),
        "output": json::from_proto_opt(t.output.as_ref()),
        "error": t.error,
        "failed_node": t.failed_node,
        "waiting": t.waiting.as_ref().map(|w| json!({
            "node_id": w.node_id,
            "prompt": w.prompt,
            "input_schema": json::from_proto_opt(w.input_schema.as_ref()),
            "deadline": w.deadline.as_ref().map(fmt_ts),
        })),
        "trace_id": t.trace_id,
        "created_at": ts(&t.created_at),
        "updated_at": ts(&t.updated_at),
        "ended_at": ts(&t.ended_at),
        "nodes": t.nodes.iter().map(|n| json!({
            "node_id": n.node_id,
            "type": n.node_type,
            "status": pb::NodeStatus::try_from(n.status).map(|s| s.as_str_name().trim_start_matches("NODE_STATUS_").to_string()).unwrap_or_default(),
            "attempts": n.attempts,
            "message_id": n.message_id,
            "input": json::from_proto_opt(n.input.as_ref()),
            "output": json::from_proto_opt(n.output.as_ref()),
            "error": n.error,
            "started_at": ts(&n.started_at),
            "ended_at": ts(&n.ended_at),
            "next": n.next_node,
        })).collect::<Vec<_>>(),
    })
}
