//! Small renderers the pages share: timestamps, ages and durations, JSON values (pretty and
//! as short summaries), task and node statuses as badges. Every value goes through maud,
//! which escapes it.

use std::time::{Duration, SystemTime};

use maud::{Markup, html};
use reach_proto::v1::{NodeStatus, TaskStatus};
use serde_json::Value;

/// The longest string shown in a summary, in characters (the rest is cut with `…`).
pub const SUMMARY_CHARS: usize = 280;

/// `timestamp` as a [`SystemTime`]; `None` when unset or out of range.
pub fn system_time(timestamp: Option<&prost_types::Timestamp>) -> Option<SystemTime> {
    let t = timestamp?;
    let secs = u64::try_from(t.seconds).ok()?;
    let nanos = u32::try_from(t.nanos).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
}

/// `timestamp` as `2026-12-02 13:54:14 UTC`; `—` when unset.
pub fn time(timestamp: Option<&prost_types::Timestamp>) -> String {
    match system_time(timestamp) {
        Some(t) => humantime::format_rfc3339_seconds(t)
            .to_string()
            .replace('T', " ")
            .replace('Z', " UTC"),
        None => "—".to_string(),
    }
}

/// `timestamp`'s time of day in UTC with milliseconds (`14:15:23.123`); `—` when unset.
pub fn clock(timestamp: Option<&prost_types::Timestamp>) -> String {
    match system_time(timestamp) {
        Some(t) => {
            let text = humantime::format_rfc3339_millis(t).to_string();
            text.split_once('T')
                .map(|(_, time)| time.trim_end_matches('Z').to_string())
                .unwrap_or(text)
        }
        None => "—".to_string(),
    }
}

/// An event's detail as one line, `key=value` pairs (its `kind` and `node` left out, as the
/// row shows them), each value cut to 60 characters and the whole to [`SUMMARY_CHARS`].
pub fn detail(value: &Value) -> String {
    let line = match value {
        Value::Object(map) => map
            .iter()
            .filter(|(k, _)| *k != "kind" && *k != "node")
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                format!("{k}={}", cut(&v, 60))
            })
            .collect::<Vec<_>>()
            .join("  ·  "),
        other => scalar(other),
    };
    cut(&line, SUMMARY_CHARS)
}

/// How long ago `timestamp` was, coarsely (`12s`, `3m 4s`, `2h 5m`); `—` when unset.
pub fn age(timestamp: Option<&prost_types::Timestamp>) -> String {
    match system_time(timestamp) {
        Some(t) => match SystemTime::now().duration_since(t) {
            Ok(d) => coarse(d),
            Err(e) => format!("in {}", coarse(e.duration())),
        },
        None => "—".to_string(),
    }
}

/// A call latency: `0.42ms` below 10 ms (loopback hops take tenths of one), else as
/// [`coarse`].
pub fn latency(d: Duration) -> String {
    if d < Duration::from_millis(10) {
        format!("{:.2}ms", d.as_secs_f64() * 1000.0)
    } else {
        coarse(d)
    }
}

/// `d` with at most two units (`850ms`, `12.3s`, `3m 4s`, `2h 5m`, `3d 4h`).
pub fn coarse(d: Duration) -> String {
    let ms = d.as_millis();
    let s = d.as_secs();
    if ms < 1000 {
        format!("{ms}ms")
    } else if s < 60 {
        format!("{:.1}s", d.as_secs_f64())
    } else if s < 3600 {
        format!("{}m {}s", s / 60, s % 60)
    } else if s < 86_400 {
        format!("{}h {}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}d {}h", s / 86_400, (s % 86_400) / 3600)
    }
}

/// The time between two timestamps; `None` when either is unset or `to` is before `from`.
pub fn between(
    from: Option<&prost_types::Timestamp>,
    to: Option<&prost_types::Timestamp>,
) -> Option<Duration> {
    system_time(to)?.duration_since(system_time(from)?).ok()
}

/// A proto `Duration` as a std one (`None` when unset or negative).
pub fn duration(d: Option<&prost_types::Duration>) -> Option<Duration> {
    let d = d?;
    Some(Duration::new(
        u64::try_from(d.seconds).ok()?,
        u32::try_from(d.nanos).ok()?,
    ))
}

/// A proto value (as the API returns it, masked) as JSON; `Null` when unset.
pub fn json(value: Option<&prost_types::Value>) -> Value {
    value
        .map(reach_proto::json::from_proto)
        .unwrap_or(Value::Null)
}

/// `value` pretty-printed in a `<pre>`.
pub fn pretty(value: &Value) -> Markup {
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    html! { pre.json { (text) } }
}

/// `text` cut to `max` characters, with `…` when cut.
pub fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut out: String = text.chars().take(max).collect();
    out.push('…');
    out
}

/// A scalar JSON value as text (strings unquoted, cut to [`SUMMARY_CHARS`]); objects and
/// arrays as compact JSON, cut.
pub fn scalar(value: &Value) -> String {
    match value {
        Value::String(s) => cut(s, SUMMARY_CHARS),
        Value::Null => "null".to_string(),
        other => cut(&other.to_string(), SUMMARY_CHARS),
    }
}

/// An object's fields as a definition list (`key: value`, at most `max` of them); any other
/// value as one line.
pub fn fields(value: &Value, max: usize) -> Markup {
    match value {
        Value::Object(map) if !map.is_empty() => html! {
            dl.fields {
                @for (key, v) in map.iter().take(max) {
                    dt { (key) }
                    dd class=@if v.as_str().is_some_and(|s| s.len() > 80) { "long" } @else { "" } { (scalar(v)) }
                }
                @if map.len() > max {
                    dt { "…" } dd { (map.len() - max) " more" }
                }
            }
        },
        Value::Null => html! { span.muted { "—" } },
        other => html! { code { (scalar(other)) } },
    }
}

/// A task status without its prefix (`WAITING_HUMAN`).
pub fn task_status_name(status: i32) -> &'static str {
    TaskStatus::try_from(status)
        .unwrap_or(TaskStatus::Unspecified)
        .as_str_name()
        .trim_start_matches("TASK_STATUS_")
}

/// A node status without its prefix (`SUCCEEDED`).
pub fn node_status_name(status: i32) -> &'static str {
    NodeStatus::try_from(status)
        .unwrap_or(NodeStatus::Unspecified)
        .as_str_name()
        .trim_start_matches("NODE_STATUS_")
}

/// A status as a badge, coloured by its class (`ok`, `bad`, `wait`, `run`).
pub fn badge(name: &str) -> Markup {
    let class = match name {
        "SUCCEEDED" | "READY" => "ok",
        "FAILED" | "CANCELLED" | "OFFLINE" => "bad",
        "WAITING_HUMAN" | "PARTIAL" | "DRAINING" | "BUSY" => "wait",
        _ => "run",
    };
    html! { span class={ "badge " (class) } { (name) } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_coarse() {
        assert_eq!(coarse(Duration::from_millis(850)), "850ms");
        assert_eq!(coarse(Duration::from_millis(12_340)), "12.3s");
        assert_eq!(coarse(Duration::from_secs(184)), "3m 4s");
        assert_eq!(coarse(Duration::from_secs(7500)), "2h 5m");
    }

    #[test]
    fn times_are_utc_and_values_escaped() {
        let t = prost_types::Timestamp {
            seconds: 1_800_000_000,
            nanos: 0,
        };
        assert_eq!(time(Some(&t)), "2027-01-15 08:00:00 UTC");
        assert_eq!(time(None), "—");
        let markup = fields(&serde_json::json!({"x": "<script>"}), 5).into_string();
        assert!(markup.contains("&lt;script&gt;"), "{markup}");
        assert_eq!(cut("abcdef", 3), "abc…");
        assert_eq!(clock(Some(&t)), "08:00:00.000");
        assert_eq!(
            detail(&serde_json::json!({"kind": "k", "node": "n", "purpose": "backoff", "n": 2})),
            "n=2  ·  purpose=backoff"
        );
    }
}
