//! Node failures, typed: [`NodeError`] (a gRPC code and a message) and [`FailureCode`] (a
//! gRPC code, or [`FailureCode::Flow`] when the flow itself failed the task), with the gRPC
//! code names they are stored and written under (`UNAVAILABLE`, ...).
//!
//! The event log stores codes by name, so logs written by earlier versions read unchanged:
//! an attempt's code as `"code": "UNAVAILABLE"`, a slot's final error as the one string
//! `"UNAVAILABLE: message"`, a node failure's code as a name or `"FLOW"`.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tonic::Code;

pub use reach_rpc::errors::code_name;

/// Every gRPC code, in code-number order.
pub const ALL_CODES: [Code; 17] = [
    Code::Ok,
    Code::Cancelled,
    Code::Unknown,
    Code::InvalidArgument,
    Code::DeadlineExceeded,
    Code::NotFound,
    Code::AlreadyExists,
    Code::PermissionDenied,
    Code::ResourceExhausted,
    Code::FailedPrecondition,
    Code::Aborted,
    Code::OutOfRange,
    Code::Unimplemented,
    Code::Internal,
    Code::Unavailable,
    Code::DataLoss,
    Code::Unauthenticated,
];

/// The gRPC code named `name` (canonical upper-case, as [`code_name`] writes it; ASCII case
/// is ignored). `None` for any other text.
pub fn code_from_name(name: &str) -> Option<Code> {
    ALL_CODES
        .into_iter()
        .find(|c| code_name(*c).eq_ignore_ascii_case(name))
}

/// Why an attempt, a call slot or a node failed: a gRPC code a retry policy matches, and a
/// message for a person.
///
/// Displays (and is stored in `slot_completed` events) as `"CODE: message"`, the shape logs
/// have always had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeError {
    /// The code: the callee's status code, `DEADLINE_EXCEEDED` for a timed-out attempt,
    /// `INVALID_ARGUMENT` when the input cannot be built, ...
    pub code: Code,
    /// What went wrong.
    pub message: String,
}

impl NodeError {
    /// A failure with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// Parses the stored `"CODE: message"` form. Text without a known code prefix is an
    /// `UNKNOWN` failure with the whole text as its message (never an error: old logs stay
    /// readable).
    pub fn parse(text: &str) -> Self {
        text.split_once(": ")
            .and_then(|(code, message)| Some(Self::new(code_from_name(code)?, message)))
            .unwrap_or_else(|| Self::new(Code::Unknown, text))
    }
}

impl fmt::Display for NodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", code_name(self.code), self.message)
    }
}

impl std::error::Error for NodeError {}

impl From<&tonic::Status> for NodeError {
    fn from(status: &tonic::Status) -> Self {
        Self::new(status.code(), status.message())
    }
}

impl Serialize for NodeError {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for NodeError {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Ok(Self::parse(&text))
    }
}

/// What a node failed with for good: a gRPC code, or the flow itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCode {
    /// The flow failed the task: a `fail` node, or a node the flow version does not have.
    /// Stored as `FLOW`.
    Flow,
    /// The node's own failure (its last attempt's code, a condition that cannot be
    /// evaluated, a human node's timeout, a parallel node below its threshold).
    Grpc(Code),
}

impl FailureCode {
    /// The stored name: a gRPC code name or `FLOW`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureCode::Flow => "FLOW",
            FailureCode::Grpc(code) => code_name(code),
        }
    }

    /// Parses a stored name; an unknown name reads as `UNKNOWN`.
    pub fn parse(name: &str) -> Self {
        if name == "FLOW" {
            FailureCode::Flow
        } else {
            FailureCode::Grpc(code_from_name(name).unwrap_or(Code::Unknown))
        }
    }
}

impl fmt::Display for FailureCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for FailureCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for FailureCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self::parse(&String::deserialize(d)?))
    }
}

/// Serde for a bare [`Code`] as its name (`#[serde(with = "crate::failure::code_serde")]`);
/// an unknown name reads as `UNKNOWN`.
pub mod code_serde {
    use serde::{Deserialize, Deserializer, Serializer};
    use tonic::Code;

    /// Writes the code's name.
    ///
    /// # Errors
    /// The serializer's.
    pub fn serialize<S: Serializer>(code: &Code, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(super::code_name(*code))
    }

    /// Reads a code name.
    ///
    /// # Errors
    /// When the value is not a string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Code, D::Error> {
        let name = String::deserialize(d)?;
        Ok(super::code_from_name(&name).unwrap_or(Code::Unknown))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_name_round_trips() {
        for code in ALL_CODES {
            assert_eq!(code_from_name(code_name(code)), Some(code));
        }
        assert_eq!(code_from_name("unavailable"), Some(Code::Unavailable));
        assert_eq!(code_from_name("FLOW"), None);
    }

    /// Slot errors written by earlier versions (`"CODE: message"`) read back typed, and are
    /// written back in the same shape.
    #[test]
    fn node_errors_keep_the_stored_shape() {
        let e: NodeError = serde_json::from_str(r#""UNAVAILABLE: down: for now""#).unwrap();
        assert_eq!(e, NodeError::new(Code::Unavailable, "down: for now"));
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#""UNAVAILABLE: down: for now""#
        );
        let e: NodeError = serde_json::from_str(r#""no code here""#).unwrap();
        assert_eq!(e, NodeError::new(Code::Unknown, "no code here"));
        let e: NodeError = serde_json::from_str(r#""BOGUS: x""#).unwrap();
        assert_eq!(e, NodeError::new(Code::Unknown, "BOGUS: x"));
    }

    #[test]
    fn failure_codes_keep_the_stored_names() {
        for (text, code) in [
            ("FLOW", FailureCode::Flow),
            (
                "DEADLINE_EXCEEDED",
                FailureCode::Grpc(Code::DeadlineExceeded),
            ),
        ] {
            let json = format!("\"{text}\"");
            assert_eq!(serde_json::from_str::<FailureCode>(&json).unwrap(), code);
            assert_eq!(serde_json::to_string(&code).unwrap(), json);
        }
    }
}
