//! `reach demo report`: an LLM agent writes a complaint report from the CFPB CSV.
//!
//! In one process: a registry and a router; a *data* agent serving `report.read_csv` and
//! `report.aggregate` as described capabilities; and the *report* agent, whose tools are
//! those two — discovered from the registry and called through the router, as mesh tools —
//! plus its own `report.write_report`. The model is the scripted analyst
//! ([`reach_agents::report_agent::scripted_analyst`]) unless an OpenAI-compatible endpoint
//! is given, so the demo runs with no network.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use reach_agent::mesh::{discover, mesh_tools};
use reach_agent::tool::ToolRegistry;
use reach_agent::{Agent, AgentOutcome, ModelConfig, ModelProvider, OpenAiProvider, RunContext};
use reach_agents::report::Workspace;
use reach_agents::report_agent::{
    AGGREGATE, READ_CSV, SYSTEM_PROMPT, data_tools, scripted_analyst, write_report_tool,
};
use reach_sdk::{AgentConfig, AgentRuntime};
use serde::Serialize;
use tokio::net::TcpListener;

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
    /// Input (prompt) tokens spent.
    pub input_tokens: u64,
    /// Output (completion) tokens spent.
    pub output_tokens: u64,
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
    std::fs::create_dir_all(&output_dir)
        .with_context(|| format!("cannot create {}", output_dir.display()))?;
    let report_name = options
        .output
        .file_name()
        .and_then(|n| n.to_str())
        .context("--output must name a file")?
        .to_string();

    let config = ReachConfig {
        listen: "127.0.0.1:0".into(),
        ..ReachConfig::default()
    };
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the demo's gRPC port")?;
    let plane = ControlPlane::start(listener, &config, Services::MESH).await?;
    let endpoint = plane.endpoint();

    // The data agent: the CSV tools, served as described capabilities.
    let tools = data_tools(Workspace::new(&data_dir)?)?;
    let data_agent = reach_agent::mesh::serve_tools(
        AgentRuntime::new(AgentConfig::new("report-data", endpoint.clone())),
        &tools,
    );
    let (data_agent, _) = data_agent
        .start(TcpListener::bind("127.0.0.1:0").await?)
        .await?;
    let router = plane.router().expect("the demo runs a router").table().clone();
    tokio::time::timeout(Duration::from_secs(10), async {
        while router.instances().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .context("the data agent did not become routable within 10 s")?;

    // The report agent: mesh tools from the registry, and a local one.
    let channel = tonic::transport::Endpoint::from_shared(endpoint.clone())?
        .connect()
        .await?;
    let specs = discover(channel, "report.").await?;
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
    agent_tools.add(write_report_tool(Workspace::new(&output_dir)?)?)?;
    let provider: Arc<dyn ModelProvider> = match &options.model {
        Some(model) => Arc::new(OpenAiProvider::new(model.clone())?),
        None => scripted_analyst(&csv_name, &report_name).shared(),
    };
    let model = provider.model().to_string();
    let agent = Agent::new(provider, agent_tools)
        .system(SYSTEM_PROMPT)
        .max_turns(options.max_turns);
    let ask = format!(
        "Write the complaint report of `{csv_name}` (in the data directory) to `{report_name}` (in the output directory)."
    );
    let context = RunContext {
        task_id: format!("report-{}", reach_rpc::trace::new_message_id()),
        deadline: Some(tokio::time::Instant::now() + Duration::from_secs(600)),
        ..RunContext::default()
    };
    let outcome = agent.run(context, ask).await;
    data_agent.drain().await.ok();
    plane.shutdown().await.ok();
    let outcome = outcome?;
    let report = output_dir
        .canonicalize()
        .unwrap_or(output_dir)
        .join(&report_name);
    let wrote = outcome
        .tool_calls
        .iter()
        .any(|c| c.name == reach_agents::report_agent::WRITE_REPORT && c.result.is_ok());
    if !wrote || !report.exists() {
        bail!(
            "the agent ended without writing {} ({}): {}",
            report.display(),
            if outcome.stopped == reach_agent::Stopped::Final {
                "it answered"
            } else {
                "it ran out of turns"
            },
            outcome.answer
        );
    }
    Ok(summary(outcome, report, model))
}

fn split(input: &Path) -> anyhow::Result<(PathBuf, String)> {
    let dir = input.parent().context("the input has no directory")?;
    let name = input
        .file_name()
        .and_then(|n| n.to_str())
        .context("the input's file name is not UTF-8")?;
    Ok((dir.to_path_buf(), name.to_string()))
}

fn summary(outcome: AgentOutcome, report: PathBuf, model: String) -> ReportRun {
    ReportRun {
        report,
        completed: outcome.stopped == reach_agent::Stopped::Final,
        turns: outcome.turns,
        model,
        tool_calls: outcome
            .tool_calls
            .iter()
            .map(|c| ToolCallSummary {
                mesh: c.name != reach_agents::report_agent::WRITE_REPORT,
                status: if c.result.is_ok() { "ok" } else { "error" }.into(),
                error: c.result.error.as_ref().map(|e| e.message.clone()),
                name: c.name.clone(),
            })
            .collect(),
        input_tokens: outcome.usage.input_tokens,
        output_tokens: outcome.usage.output_tokens,
        answer: outcome.answer,
    }
}

/// The run as text: where the report is, then one line per tool call.
pub fn render_text(run: &ReportRun) -> String {
    let mut out = format!(
        "wrote {}\n{} ({} model calls, {} tokens in, {} out)\n",
        run.report.display(),
        run.answer,
        run.turns,
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
