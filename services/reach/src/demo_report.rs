//! `reach demo report`: an LLM agent writes a complaint report from the CFPB CSV.
//!
//! In one process: a registry and a router; a *data* agent serving `report.read_csv` and
//! `report.aggregate` as described capabilities; and the *report* agent, whose tools are
//! those two — discovered from the registry and called through the router, as mesh tools —
//! plus its own `report.write_report`. The model is the scripted analyst
//! ([`reach_agents::report_agent::scripted_analyst`]) unless an OpenAI-compatible endpoint
//! is given, so the demo runs with no network. The report runs as a task of [`REPORT_FLOW`]
//! on the embedded orchestrator, so its record sums the tokens the agent spent.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use reach_agent::mesh::{discover, mesh_tools};
use reach_agent::serve::{AgentAnswer, agent_handler};
use reach_agent::tool::ToolRegistry;
use reach_agent::{Agent, ModelConfig, ModelProvider, OpenAiProvider};
use reach_agents::report::Workspace;
use reach_agents::report_agent::{
    AGGREGATE, READ_CSV, SYSTEM_PROMPT, data_tools, scripted_analyst, write_report_tool,
};
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_proto::v1::{
    ApplyFlowRequest, GetTaskRequest, StartTaskRequest, Task, TaskStatus, WatchTaskRequest,
};
use reach_sdk::{AgentConfig, AgentRuntime, DescribedCapability};
use serde::Serialize;
use tokio::net::TcpListener;
use tonic::transport::Channel;

use crate::config::ReachConfig;
use crate::control_plane::{ControlPlane, Services};

/// What `reach demo report` was asked to do.
#[derive(Debug, Clone)]
pub struct ReportOptions {
    /// The complaints CSV.
    pub input: PathBuf,
    /// Where the report goes.
    pub output: PathBuf,
    /// An OpenAI-compatible endpoint to use instead of the scripted analyst.
    pub model: Option<ModelConfig>,
    /// The most model calls the agent makes.
    pub max_turns: u32,
}

/// What the run did, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct ReportRun {
    /// The report written (absolute).
    pub report: PathBuf,
    /// The agent's final answer.
    pub answer: String,
    /// Whether the agent finished within its turns.
    pub completed: bool,
    /// Model calls made.
    pub turns: u32,
    /// The model used.
    pub model: String,
    /// Every tool call: `name`, `status` and whether it went through the router (`mesh`).
    pub tool_calls: Vec<ToolCallSummary>,
    /// The task the report ran as (in `report-flow`).
    pub task_id: String,
    /// The task's trace id.
    pub trace_id: String,
    /// Input (prompt) tokens spent, from the task record.
    pub input_tokens: u64,
    /// Output (completion) tokens spent, from the task record.
    pub output_tokens: u64,
    /// Model calls made, from the task record.
    pub model_calls: u64,
}

/// One tool call of [`ReportRun`].
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallSummary {
    /// The tool (capability name).
    pub name: String,
    /// `ok` or `error`.
    pub status: String,
    /// Whether it ran on another agent, through the router.
    pub mesh: bool,
    /// The error for the model, when it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The flow the report runs as: one task node calling the report agent, so the run is a
/// durable task whose record sums the tokens the agent spent.
pub const REPORT_FLOW: &str = r#"id: report-flow
version: 1
description: An LLM agent writes a report with mesh tools.
initial: write
states:
  write:
    type: task
    capability: report.write
    input: {question: "input.question"}
    timeout: 600s
    next: done
  done: {type: succeed}
"#;

/// The report agent's capability.
pub const REPORT_CAPABILITY: &str = "report.write";

/// Runs the report demo.
///
/// # Errors
/// When the input cannot be found, the mesh cannot start, the model endpoint fails, or the
/// agent ends without having written the report.
pub async fn run(options: &ReportOptions) -> anyhow::Result<ReportRun> {
    let input = options
        .input
        .canonicalize()
        .with_context(|| format!("cannot read {}", options.input.display()))?;
    let (data_dir, csv_name) = split(&input)?;
    let output_dir = match options.output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if options.output.is_dir() {
        bail!(
            "--output {} is a directory: name the report file (for example {}/report.md)",
            options.output.display(),
            options.output.display()
        );
    }
    std::fs::create_dir_all(&output_dir)
        .with_context(|| format!("cannot create {}", output_dir.display()))?;
    let report_name = options
        .output
        .file_name()
        .and_then(|n| n.to_str())
        .context("--output must name a file")?
        .to_string();

    let store_dir = tempfile::tempdir().context("creating the demo's task store directory")?;
    let mut config = ReachConfig {
        listen: "127.0.0.1:0".into(),
        ..ReachConfig::default()
    };
    config.orchestrator.store_url = format!(
        "sqlite://{}",
        store_dir.path().join("orchestrator.db").display()
    );
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the demo's gRPC port")?;
    let plane = ControlPlane::start(listener, &config, Services::ALL).await?;
    let endpoint = plane.endpoint();
    let routable = |n: usize, what: &'static str| {
        let plane = &plane;
        async move {
            if plane.wait_routable(n, Duration::from_secs(10)).await {
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "{what} did not become routable within 10 s"
                ))
            }
        }
    };

    // The data agent: the CSV tools, served as described capabilities.
    let tools = data_tools(Workspace::new(&data_dir)?)?;
    let data_agent = reach_agent::mesh::serve_tools(
        AgentRuntime::new(AgentConfig::new("report-data", endpoint.clone())),
        &tools,
    );
    let (data_agent, _) = data_agent
        .start(TcpListener::bind("127.0.0.1:0").await?)
        .await?;
    routable(1, "the data agent").await?;

    // The report agent: mesh tools from the registry, and a local one.
    let channel = tonic::transport::Endpoint::from_shared(endpoint.clone())?
        .connect()
        .await?;
    let specs = discover(channel.clone(), "report.").await?;
    let client = reach_sdk::MeshClient::new(
        reach_rpc::http2::endpoint(&endpoint)?.connect().await?,
        "report.agent",
    );
    let mut agent_tools = ToolRegistry::new();
    mesh_tools(&client, specs, &mut agent_tools)?;
    for needed in [READ_CSV, AGGREGATE] {
        if agent_tools.get(needed).is_none() {
            bail!("the registry does not describe {needed}: the data agent did not register it");
        }
    }
    agent_tools.add(write_report_tool(
        Workspace::new(&output_dir)?,
        &report_name,
    )?)?;
    let provider: Arc<dyn ModelProvider> = match &options.model {
        Some(model) => Arc::new(OpenAiProvider::new(model.clone())?),
        None => scripted_analyst(&csv_name, &report_name).shared(),
    };
    let model = provider.model().to_string();
    let agent = Agent::new(provider, agent_tools)
        .system(SYSTEM_PROMPT)
        .max_turns(options.max_turns);
    let report_agent = AgentRuntime::new(
        AgentConfig::new("report-agent", endpoint.clone()).with_model_slots(4),
    )
    .handle_described(
        DescribedCapability::new(REPORT_CAPABILITY, "1.0.0")
            .description("Writes a report from data files with its tools. Use it for a whole report; not for one number.")
            .input_schema(serde_json::json!({
                "type": "object",
                "required": ["question"],
                "properties": {"question": {"type": "string", "description": "What to report on, and where to write it."}}
            })),
        agent_handler(agent),
    );
    let (report_agent, _) = report_agent
        .start(TcpListener::bind("127.0.0.1:0").await?)
        .await?;
    routable(2, "the report agent").await?;

    let ask = format!(
        "Write the complaint report of `{csv_name}` (in the data directory) to `{report_name}` (in the output directory)."
    );
    let task = run_task(OrchestratorServiceClient::new(channel), &ask).await;
    report_agent.drain().await.ok();
    data_agent.drain().await.ok();
    plane.shutdown().await.ok();
    let task = task?;
    let answer = task
        .nodes
        .iter()
        .rev()
        .find(|n| n.node_id == "write")
        .and_then(|n| n.output.as_ref())
        .map(reach_proto::json::from_proto)
        .and_then(|v| serde_json::from_value::<AgentAnswer>(v).ok());
    let Some(answer) = answer.filter(|_| task.status() == TaskStatus::Succeeded) else {
        bail!(
            "the report task ended {:?}: {}",
            task.status(),
            if task.error.is_empty() {
                "without the agent's answer"
            } else {
                &task.error
            }
        );
    };
    let report = output_dir
        .canonicalize()
        .unwrap_or(output_dir)
        .join(&report_name);
    let wrote = answer
        .tool_calls
        .iter()
        .any(|c| c.name == reach_agents::report_agent::WRITE_REPORT && c.ok);
    if !wrote || !report.exists() {
        bail!(
            "the agent ended without writing {} ({}): {}",
            report.display(),
            if answer.completed {
                "it answered"
            } else {
                "it ran out of turns"
            },
            answer.answer
        );
    }
    let usage = task.usage.unwrap_or_default();
    Ok(ReportRun {
        report,
        completed: answer.completed,
        turns: answer.turns,
        model,
        task_id: task.task_id,
        trace_id: task.trace_id,
        tool_calls: answer
            .tool_calls
            .iter()
            .map(|c| ToolCallSummary {
                mesh: c.name != reach_agents::report_agent::WRITE_REPORT,
                status: if c.ok { "ok" } else { "error" }.into(),
                error: c.error.clone(),
                name: c.name.clone(),
            })
            .collect(),
        input_tokens: usage.input_tokens,
        output_tokens: usage.output_tokens,
        model_calls: usage.model_calls,
        answer: answer.answer,
    })
}

/// Starts the report task and follows it until it ends; returns it as GetTask shows it.
async fn run_task(
    mut orchestrator: OrchestratorServiceClient<Channel>,
    ask: &str,
) -> anyhow::Result<Task> {
    orchestrator
        .apply_flow(ApplyFlowRequest {
            yaml: REPORT_FLOW.to_string(),
            source: "reach demo report".into(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("applying report-flow failed: {}", s.message()))?;
    let task_id = format!("report-{}", reach_rpc::trace::new_message_id());
    orchestrator
        .start_task(StartTaskRequest {
            flow_id: "report-flow".into(),
            flow_version: 0,
            input: Some(reach_proto::json::to_proto(
                &serde_json::json!({"question": ask}),
            )),
            task_id: task_id.clone(),
            ..Default::default()
        })
        .await
        .map_err(|s| anyhow::anyhow!("starting the report task failed: {}", s.message()))?;
    let mut events = orchestrator
        .watch_task(WatchTaskRequest {
            task_id: task_id.clone(),
            after_sequence: 0,
        })
        .await?
        .into_inner();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(660);
    while let Some(event) = tokio::time::timeout_at(deadline, events.message())
        .await
        .context("the report task did not end within 11 minutes")??
    {
        let ended = event.event.is_some_and(|e| {
            matches!(
                e.status(),
                TaskStatus::Succeeded
                    | TaskStatus::Failed
                    | TaskStatus::Partial
                    | TaskStatus::Cancelled
            )
        });
        if ended {
            break;
        }
    }
    orchestrator
        .get_task(GetTaskRequest { task_id })
        .await?
        .into_inner()
        .task
        .context("GetTask returned no task")
}

fn split(input: &Path) -> anyhow::Result<(PathBuf, String)> {
    let dir = input.parent().context("the input has no directory")?;
    let name = input
        .file_name()
        .and_then(|n| n.to_str())
        .context("the input's file name is not UTF-8")?;
    Ok((dir.to_path_buf(), name.to_string()))
}

/// The run as text: where the report is, then one line per tool call.
pub fn render_text(run: &ReportRun) -> String {
    let mut out = format!(
        "wrote {}\n{}\ntask {} (report-flow, in the demo's temporary store): {} model calls, {} tokens in, {} out\n",
        run.report.display(),
        run.answer,
        run.task_id,
        run.model_calls,
        run.input_tokens,
        run.output_tokens
    );
    for call in &run.tool_calls {
        out.push_str(&format!(
            "  {:<22} {:<5} {}\n",
            call.name,
            call.status,
            if call.mesh { "via the router" } else { "local" }
        ));
    }
    out
}
