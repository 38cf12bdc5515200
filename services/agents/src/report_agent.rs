//! The complaint report agent's tools and its scripted analyst.
//!
//! - `report.read_csv` and `report.aggregate` ([`data_tools`]) are served on the mesh by a
//!   data agent, so the report agent reaches them as mesh tools, through the router;
//! - `report.write_report` ([`write_report_tool`]) runs in the report agent's process;
//! - [`scripted_analyst`] is a deterministic model that uses those tools as an analyst
//!   would — read, aggregate by issue, company and state, find the date range, write — so
//!   `reach demo report` runs without a model endpoint. With a real model the same tools
//!   and [`SYSTEM_PROMPT`] are used.
//!
//! Every path a tool is given is resolved inside a [`Workspace`]: the model names files,
//! it does not get the file system.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;

use reach_agent::provider::{ChatRequest, Role};
use reach_agent::result::ToolError;
use reach_agent::tool::{Tool, ToolContext, ToolDefinitionError, ToolRegistry};
use reach_agent::{ScriptedProvider, Step};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::report::{self, Aggregation, Group, Workspace};

/// The capability of the CSV reading tool.
pub const READ_CSV: &str = "report.read_csv";
/// The capability of the aggregation tool.
pub const AGGREGATE: &str = "report.aggregate";
/// The name of the report writing tool (local to the report agent).
pub const WRITE_REPORT: &str = "report.write_report";

/// The report agent's instructions (for a real model).
pub const SYSTEM_PROMPT: &str = "You are a data analyst. Answer only with what the tools return: never invent numbers. \
To write a complaint report: call report__read_csv once to learn the columns and the row count; \
call report__aggregate for complaints by `Issue`, by `Company` and by `State` (op `count`), and for the \
min and max of `Date received`; then call report__write_report once with a Markdown report that has a \
title, the total, the date range and one table per grouping (all groups, largest first). \
Then answer with one sentence saying where the report is.";

/// Arguments of `report.read_csv`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadCsvArgs {
    /// The CSV file, relative to the data directory (for example `complaints.csv`).
    pub path: String,
    /// The most rows to read (at most 100000); the sample returned is at most 5 of them.
    #[serde(default = "default_max_rows")]
    #[schemars(range(min = 1, max = 100_000))]
    pub max_rows: u32,
}

fn default_max_rows() -> u32 {
    10_000
}

/// What `report.read_csv` returns.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CsvSummary {
    /// The header row.
    pub columns: Vec<String>,
    /// Rows read.
    pub rows: usize,
    /// Whether the file has more rows than `max_rows`.
    pub truncated: bool,
    /// The first rows (at most 5), as column → value.
    pub sample: Vec<HashMap<String, String>>,
}

/// Arguments of `report.aggregate`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AggregateArgs {
    /// The CSV file, relative to the data directory.
    pub path: String,
    /// The column to group by; omit it for one group over all rows.
    #[serde(default)]
    pub group_by: Option<String>,
    /// What to compute per group.
    pub op: Aggregation,
    /// The column to sum, or take the min or max of (not needed for `count`).
    #[serde(default)]
    pub column: Option<String>,
    /// The most rows to read (at most 100000).
    #[serde(default = "default_max_rows")]
    #[schemars(range(min = 1, max = 100_000))]
    pub max_rows: u32,
}

/// What `report.aggregate` returns.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Aggregated {
    /// Rows aggregated.
    pub rows: usize,
    /// The groups: counts and sums largest first, min and max by key.
    pub groups: Vec<GroupRow>,
}

/// One group of [`Aggregated`].
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct GroupRow {
    /// The group's value of the `group_by` column (`(all)` without grouping).
    pub key: String,
    /// The count, sum, min or max.
    pub value: Value,
}

/// Arguments of `report.write_report`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteReportArgs {
    /// The report's file name; this tool writes only the one report file it was given, so
    /// leave it out or repeat that name.
    #[serde(default)]
    pub path: Option<String>,
    /// The whole report, in Markdown (at most 1 MiB).
    pub markdown: String,
}

/// What `report.write_report` returns.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Written {
    /// The absolute path written.
    pub path: String,
    /// Bytes written.
    pub bytes: usize,
}

fn failed(error: report::ReportError) -> ToolError {
    ToolError::failed(error.to_string())
}

/// `report.read_csv` and `report.aggregate` over CSV files in `data`.
///
/// # Errors
/// [`ToolDefinitionError`] only if a schema cannot be built (a bug).
pub fn data_tools(data: Workspace) -> Result<ToolRegistry, ToolDefinitionError> {
    let read_root = data.clone();
    let read_csv = Tool::from_fn::<ReadCsvArgs, CsvSummary, _, _>(
        READ_CSV,
        "Reads a CSV file with a header row and returns its columns, its row count and a \
         sample of rows. Use it first, to learn a file's columns; do not use it to count or \
         group rows (use report.aggregate).",
        move |args: ReadCsvArgs, _ctx: ToolContext| {
            let root = read_root.clone();
            async move {
                let table = tokio::task::spawn_blocking(move || {
                    report::read_csv(&root, &args.path, args.max_rows as usize)
                })
                .await
                .map_err(|e| ToolError::failed(e.to_string()))?
                .map_err(failed)?;
                let sample = table
                    .rows
                    .iter()
                    .take(5)
                    .map(|row| {
                        table
                            .columns
                            .iter()
                            .cloned()
                            .zip(row.iter().map(|v| reach_rpc::errors::cut(v, 200)))
                            .collect()
                    })
                    .collect();
                Ok(CsvSummary {
                    columns: table.columns,
                    rows: table.rows.len(),
                    truncated: table.truncated,
                    sample,
                })
            }
        },
    )?;
    let aggregate = Tool::from_fn::<AggregateArgs, Aggregated, _, _>(
        AGGREGATE,
        "Groups the rows of a CSV file by a column and counts them, or sums, or takes the min \
         or max of another column, per group. Use it for every number in a report; do not \
         compute numbers yourself.",
        move |args: AggregateArgs, _ctx: ToolContext| {
            let root = data.clone();
            async move {
                tokio::task::spawn_blocking(move || {
                    let table = report::read_csv(&root, &args.path, args.max_rows as usize)?;
                    let groups = report::aggregate(
                        &table,
                        args.group_by.as_deref(),
                        args.op,
                        args.column.as_deref(),
                    )?;
                    Ok(Aggregated {
                        rows: table.rows.len(),
                        groups: groups
                            .into_iter()
                            .map(|g| GroupRow {
                                key: g.key,
                                value: g.value,
                            })
                            .collect(),
                    })
                })
                .await
                .map_err(|e| ToolError::failed(e.to_string()))?
                .map_err(failed)
            }
        },
    )?;
    ToolRegistry::new().with(read_csv)?.with(aggregate)
}

/// `report.write_report`, writing Markdown to the one file `report` in `output`: the user
/// chooses where the report goes, the model only what it says — so a model (or a prompt
/// injected into the data it reads) cannot write any other file, however it names it.
///
/// # Errors
/// [`ToolDefinitionError`] only if a schema cannot be built (a bug).
pub fn write_report_tool(output: Workspace, report: &str) -> Result<Tool, ToolDefinitionError> {
    let report = report.to_string();
    Tool::from_fn::<WriteReportArgs, Written, _, _>(
        WRITE_REPORT,
        "Writes the finished Markdown report to the report file. Use it once, with the whole \
         report; do not use it for notes or drafts.",
        move |args: WriteReportArgs, _ctx: ToolContext| {
            let root = output.clone();
            let report = report.clone();
            async move {
                if let Some(asked) = args.path.as_deref().map(str::trim)
                    && asked != report
                    && Path::new(asked).file_name() != Some(OsStr::new(&report))
                {
                    return Err(ToolError::failed(format!(
                        "this tool writes only the report file {report:?}, not {asked:?}: leave `path` out"
                    )));
                }
                let (path, bytes) = tokio::task::spawn_blocking(move || {
                    report::write_report(&root, &report, &args.markdown)
                })
                .await
                .map_err(|e| ToolError::failed(e.to_string()))?
                .map_err(failed)?;
                Ok(Written {
                    path: path.display().to_string(),
                    bytes,
                })
            }
        },
    )
}

/// A deterministic model that writes the complaint report of `csv` (relative to the data
/// directory) to `report_path` (relative to the output directory) with the report tools:
/// read the CSV; aggregate by `Issue`, `Company` and `State` and take the min and max of
/// `Date received`, in one step of five tool calls; write the Markdown built from what the
/// tools returned; answer. A tool that fails stops it with an answer that says so.
pub fn scripted_analyst(csv: &str, report_path: &str) -> ScriptedProvider {
    let csv = csv.to_string();
    let report_path = report_path.to_string();
    ScriptedProvider::from_fn(move |request| {
        let results = tool_results(request);
        if let Some((name, error)) = results.iter().find_map(|(name, _, r)| {
            (r.get("status").and_then(Value::as_str) != Some("ok"))
                .then(|| (name.clone(), r.get("error").cloned().unwrap_or(Value::Null)))
        }) {
            return Ok(Step::reply(format!(
                "I could not write the report: {name} failed: {error}"
            )));
        }
        let called = |tool: &str| results.iter().any(|(name, _, _)| name == tool);
        let step = if !called(READ_CSV) {
            Step::ToolCalls(vec![(
                READ_CSV.into(),
                json!({"path": csv, "max_rows": 100_000}).to_string(),
            )])
        } else if !called(AGGREGATE) {
            let count = |column: &str| {
                json!({"path": csv, "group_by": column, "op": "count", "max_rows": 100_000})
                    .to_string()
            };
            let extreme = |op: &str| {
                json!({"path": csv, "op": op, "column": "Date received", "max_rows": 100_000})
                    .to_string()
            };
            Step::ToolCalls(vec![
                (AGGREGATE.into(), count("Issue")),
                (AGGREGATE.into(), count("Company")),
                (AGGREGATE.into(), count("State")),
                (AGGREGATE.into(), extreme("min")),
                (AGGREGATE.into(), extreme("max")),
            ])
        } else if !called(WRITE_REPORT) {
            let markdown = report_from(&csv, &results);
            Step::ToolCalls(vec![(
                WRITE_REPORT.into(),
                json!({"path": report_path, "markdown": markdown}).to_string(),
            )])
        } else {
            let written = results
                .iter()
                .find(|(name, _, _)| name == WRITE_REPORT)
                .and_then(|(_, _, r)| r.pointer("/data/path").and_then(Value::as_str))
                .unwrap_or(&report_path)
                .to_string();
            Step::reply(format!("The complaint report is in {written}."))
        };
        Ok(step)
    })
    .with_model("scripted-analyst")
}

/// Every tool result so far: (tool name, its arguments, the normalised result).
fn tool_results(request: &ChatRequest) -> Vec<(String, Value, Value)> {
    let mut calls: HashMap<&str, (String, Value)> = HashMap::new();
    let mut out = Vec::new();
    for message in &request.messages {
        for call in &message.tool_calls {
            let arguments = serde_json::from_str(&call.arguments).unwrap_or(Value::Null);
            calls.insert(
                &call.id,
                (reach_agent::tool::capability_name(&call.name), arguments),
            );
        }
        if message.role == Role::Tool
            && let Some((name, arguments)) =
                message.tool_call_id.as_deref().and_then(|id| calls.get(id))
        {
            let result = serde_json::from_str(message.text()).unwrap_or(Value::Null);
            out.push((name.clone(), arguments.clone(), result));
        }
    }
    out
}

/// The report's Markdown from the aggregations among `results`.
fn report_from(csv: &str, results: &[(String, Value, Value)]) -> String {
    let aggregation = |wanted: &dyn Fn(&Value) -> bool| -> (usize, Vec<Group>) {
        results
            .iter()
            .find(|(name, args, _)| name == AGGREGATE && wanted(args))
            .map(|(_, _, r)| {
                let rows = r.pointer("/data/rows").and_then(Value::as_u64).unwrap_or(0) as usize;
                let groups = r
                    .pointer("/data/groups")
                    .and_then(|g| serde_json::from_value::<Vec<GroupRow>>(g.clone()).ok())
                    .unwrap_or_default()
                    .into_iter()
                    .map(|g| Group {
                        key: g.key,
                        value: g.value,
                    })
                    .collect();
                (rows, groups)
            })
            .unwrap_or_default()
    };
    let by = |column: &'static str| {
        move |args: &Value| args.get("group_by").and_then(Value::as_str) == Some(column)
    };
    let op = |name: &'static str| move |args: &Value| args["op"] == name;
    let (total, by_issue) = aggregation(&by("Issue"));
    let (_, by_company) = aggregation(&by("Company"));
    let (_, by_state) = aggregation(&by("State"));
    let day = |groups: Vec<Group>| {
        groups
            .first()
            .and_then(|g| g.value.as_str())
            .map(|v| v.get(..10).unwrap_or(v).to_string())
            .unwrap_or_else(|| "?".into())
    };
    let first = day(aggregation(&op("min")).1);
    let last = day(aggregation(&op("max")).1);
    report::complaint_report(csv, total, &first, &last, &by_issue, &by_company, &by_state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model chooses what the report says, never where it goes: any other path it names
    /// is refused and nothing but the report file is written.
    #[tokio::test]
    async fn write_report_writes_only_the_report_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(".git")).unwrap();
        std::fs::write(dir.path().join("data.csv"), "a\n1\n").unwrap();
        let tool = write_report_tool(Workspace::new(dir.path()).unwrap(), "report.md").unwrap();
        for hostile in [".git/config", "data.csv", "other.md", ".bashrc"] {
            let result = tool
                .call_value(
                    json!({"path": hostile, "markdown": "pwned"}),
                    ToolContext::default(),
                )
                .await;
            assert!(!result.is_ok(), "{hostile}: {result:?}");
        }
        assert!(!dir.path().join(".git/config").exists());
        assert_eq!(
            std::fs::read_to_string(dir.path().join("data.csv")).unwrap(),
            "a\n1\n"
        );
        for fine in [
            json!({"markdown": "# one"}),
            json!({"path": "out/report.md", "markdown": "# two"}),
        ] {
            let result = tool.call_value(fine.clone(), ToolContext::default()).await;
            assert!(result.is_ok(), "{fine}: {result:?}");
        }
        assert_eq!(
            std::fs::read_to_string(dir.path().join("report.md")).unwrap(),
            "# two"
        );
        assert!(!dir.path().join("out").exists());
    }
}
