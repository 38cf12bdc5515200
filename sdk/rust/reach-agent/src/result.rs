//! Normalised tool results and tool errors.
//!
//! Every tool call — local, or a mesh capability — ends as one [`ToolResult`]:
//!
//! ```json
//! {"status": "ok", "data": {...}, "elapsed_ms": 12, "metadata": {"repairs": [...]}}
//! {"status": "error", "error": {"code": "invalid_arguments", "message": "...",
//!   "violations": [{"pointer": "/days", "keyword": "type", "expected": "..."}]}, "elapsed_ms": 0}
//! ```
//!
//! The model receives this object (as JSON text) in the tool message, so it can read an error
//! and retry. `metadata` appears only when it has content.
//!
//! **JSON-safe data** (decided here, for every tool):
//! - non-finite floats (NaN, ±infinity) have no JSON form; `serde_json` writes them as
//!   `null`. A typed tool's output is validated against its output schema, so a `null`
//!   where the schema requires a number refuses the result (`invalid_output`, naming the
//!   pointer and this cause) instead of passing a silent `null` to the model. Declare the
//!   field `Option<f64>` to allow it.
//! - bytes: base64 (RFC 4648, standard alphabet, padded) strings — use [`Bytes`] or
//!   `#[serde(with = "reach_agent::result::base64_bytes")]`; their schema is
//!   `{"type": "string", "contentEncoding": "base64"}`.
//! - timestamps: RFC 3339 strings in UTC with millisecond precision
//!   (`2026-12-01T15:47:23.000Z`) — use [`Timestamp`]; schema
//!   `{"type": "string", "format": "date-time"}`.

use std::borrow::Cow;
use std::time::SystemTime;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::repair::{InvalidArguments, Repair, Violation};

/// `ok` or `error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolStatus {
    /// The tool ran and returned data.
    Ok,
    /// It did not: see `error`.
    Error,
}

/// What kind of failure a [`ToolError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolErrorCode {
    /// The arguments could not be read or repaired (see `violations`): fix and retry.
    InvalidArguments,
    /// The model named a tool that does not exist.
    UnknownTool,
    /// The tool ran and failed.
    Failed,
    /// The tool did not finish within its deadline.
    Timeout,
    /// The tool (or the capability behind it) is unavailable now; retrying later may work.
    Unavailable,
    /// The tool's output is not valid against its output schema, or not JSON-safe.
    InvalidOutput,
}

/// A tool's failure, as the model sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ToolError {
    /// The kind of failure.
    pub code: ToolErrorCode,
    /// What went wrong and what to do, for the model.
    pub message: String,
    /// The bad fields, for `invalid_arguments` and `invalid_output`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub violations: Vec<Violation>,
}

impl ToolError {
    /// An error of `code` saying `message`.
    pub fn new(code: ToolErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            violations: Vec::new(),
        }
    }

    /// The tool ran and failed.
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(ToolErrorCode::Failed, message)
    }

    /// A mesh call's status as a tool error: DEADLINE_EXCEEDED → `timeout`, UNAVAILABLE and
    /// RESOURCE_EXHAUSTED → `unavailable`, INVALID_ARGUMENT → `invalid_arguments`, anything
    /// else → `failed`; the message carries the code name, the ErrorInfo reason and the text.
    pub fn from_status(status: &tonic::Status) -> Self {
        use tonic::Code;
        let code = match status.code() {
            Code::DeadlineExceeded => ToolErrorCode::Timeout,
            Code::Unavailable | Code::ResourceExhausted => ToolErrorCode::Unavailable,
            Code::InvalidArgument => ToolErrorCode::InvalidArguments,
            _ => ToolErrorCode::Failed,
        };
        let reason = reach_rpc::errors::reason_of(status)
            .map(|r| format!(" {r}"))
            .unwrap_or_default();
        Self::new(
            code,
            format!(
                "{}{reason}: {}",
                reach_rpc::errors::code_name(status.code()),
                status.message()
            ),
        )
    }
}

impl From<InvalidArguments> for ToolError {
    fn from(invalid: InvalidArguments) -> Self {
        Self {
            code: ToolErrorCode::InvalidArguments,
            message: invalid.to_string(),
            violations: invalid.violations,
        }
    }
}

/// What else a result reports.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolMetadata {
    /// Repairs made to the arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repairs: Vec<Repair>,
    /// Notes (for example a conversion made to the data).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl ToolMetadata {
    /// Whether there is nothing to report.
    pub fn is_empty(&self) -> bool {
        self.repairs.is_empty() && self.notes.is_empty()
    }
}

/// A normalised tool result (see the module docs for the shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    /// `ok` or `error`.
    pub status: ToolStatus,
    /// The data (`ok` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// The error (`error` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ToolError>,
    /// How long the call took, in milliseconds (argument repair included).
    pub elapsed_ms: u64,
    /// Repairs and notes.
    #[serde(default, skip_serializing_if = "ToolMetadata::is_empty")]
    pub metadata: ToolMetadata,
}

impl ToolResult {
    /// A success with `data`.
    pub fn ok(data: Value, elapsed_ms: u64) -> Self {
        Self {
            status: ToolStatus::Ok,
            data: Some(data),
            error: None,
            elapsed_ms,
            metadata: ToolMetadata::default(),
        }
    }

    /// A failure.
    pub fn error(error: ToolError, elapsed_ms: u64) -> Self {
        Self {
            status: ToolStatus::Error,
            data: None,
            error: Some(error),
            elapsed_ms,
            metadata: ToolMetadata::default(),
        }
    }

    /// Whether it succeeded.
    pub fn is_ok(&self) -> bool {
        self.status == ToolStatus::Ok
    }

    /// The result as JSON.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// The JSON text the model receives in the tool message.
    pub fn to_model_text(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{\"status\":\"error\"}".into())
    }
}

/// `value` as JSON.
///
/// # Errors
/// `invalid_output` when it cannot be serialised (a map with non-string keys, a failing
/// `Serialize` impl). Non-finite floats become `null` (see the module docs).
pub fn json_safe<T: Serialize>(value: &T) -> Result<Value, ToolError> {
    serde_json::to_value(value).map_err(|e| {
        ToolError::new(
            ToolErrorCode::InvalidOutput,
            format!("the tool's output cannot be written as JSON: {e}"),
        )
    })
}

// === bytes ===

/// Bytes written as a base64 string (standard alphabet, padded).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bytes(pub Vec<u8>);

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        base64_bytes::serialize(&self.0, serializer)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        base64_bytes::deserialize(deserializer).map(Bytes)
    }
}

impl JsonSchema for Bytes {
    fn schema_name() -> Cow<'static, str> {
        "Bytes".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({"type": "string", "contentEncoding": "base64"})
    }
}

/// `#[serde(with = "reach_agent::result::base64_bytes")]` for `Vec<u8>` fields.
pub mod base64_bytes {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes `bytes` as base64.
    ///
    /// # Errors
    /// The serializer's.
    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    /// Reads base64.
    ///
    /// # Errors
    /// When the string is not base64.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(deserializer)?;
        base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map_err(serde::de::Error::custom)
    }
}

// === timestamps ===

/// A point in time written as RFC 3339 in UTC with milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timestamp(pub SystemTime);

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&humantime::format_rfc3339_millis(self.0).to_string())
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        humantime::parse_rfc3339_weak(text.trim())
            .map(Timestamp)
            .map_err(serde::de::Error::custom)
    }
}

impl JsonSchema for Timestamp {
    fn schema_name() -> Cow<'static, str> {
        "Timestamp".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({"type": "string", "format": "date-time"})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_timestamps_are_json_safe() {
        let v = json_safe(&(
            Bytes(vec![0, 255]),
            Timestamp(SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1500)),
        ))
        .unwrap();
        assert_eq!(v, serde_json::json!(["AP8=", "1970-01-01T00:00:01.500Z"]));
        let back: Bytes = serde_json::from_value(v[0].clone()).unwrap();
        assert_eq!(back.0, vec![0, 255]);
    }
}
