//! `reach dump --task ID`: every message and node event of a task in time order.

use std::io::Write;

use clap::Args;
use reach_orchestrator::json;
use reach_proto::v1 as pb;
use serde_json::json;

use super::{CliError, client, compact, fmt_ts, status_name};

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
        if let Some(usage) = &task.usage {
            writeln!(out, "tokens {}", super::task::usage_line(usage))?;
        }
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
                let code = reach_rpc::errors::code_name(tonic::Code::from_i32(m.status_code));
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
