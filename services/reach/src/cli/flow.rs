//! `reach flow validate | apply | list`.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use reach_orchestrator::flow::Flow;
use reach_proto::v1 as pb;

use super::{CliError, client};

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

/// `reach flow` arguments.
#[derive(Debug, Clone, Args)]
pub struct FlowArgs {
    /// The subcommand.
    #[command(subcommand)]
    pub command: FlowCommand,
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
