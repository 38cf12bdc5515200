//! Tool names ↔ capability names, both ways and without loss.
//!
//! A capability name is dotted segments of ASCII letters, digits, `_` and `-` (at most 256
//! bytes, the registry's rule). An MCP tool name is 1–128 of `A-Z a-z 0-9 _ - .` (the
//! 2026-07-28 revision, SEP-986), so under [`ToolNaming::Capability`] (the default) a tool is
//! named exactly as its capability. Some LLM hosts accept only `^[a-zA-Z0-9_-]{1,64}$` as a
//! tool (function) name; [`ToolNaming::Underscored`] names tools as the agent kit names its
//! functions ([`reach_agent::tool::function_name`]: each `.` as `__`), refusing the
//! capabilities whose names that would make ambiguous or too long.

use serde::{Deserialize, Serialize};

/// The longest MCP tool name (characters, all ASCII).
pub const MAX_TOOL_NAME: usize = 128;

/// How tools are named after capabilities (`[edge.mcp] tool_names`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolNaming {
    /// The tool is named as the capability: `complaint.classify`.
    #[default]
    Capability,
    /// Each `.` becomes `__`: `complaint__classify` (at most 64 characters).
    Underscored,
}

/// Why a capability has no tool name, or a tool name no capability.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The capability's name is longer than a tool name may be.
    #[error(
        "capability {capability:?} makes a tool name of {length} characters, over the limit of {limit}; give the capability a shorter name"
    )]
    TooLong {
        /// The capability.
        capability: String,
        /// The tool name's length.
        length: usize,
        /// The limit it exceeds.
        limit: usize,
    },
    /// Under [`ToolNaming::Underscored`], the capability's name makes no function name
    /// (`__` or a segment starting or ending with `_` would read back as another capability;
    /// over 64 characters).
    #[error(
        "capability {capability:?} has no underscored tool name: {reason}; rename it, or set edge.mcp.tool_names = \"capability\""
    )]
    NotAFunctionName {
        /// The capability.
        capability: String,
        /// The rule it breaks.
        reason: String,
    },
    /// The tool name is no capability's (not a dotted name under this naming).
    #[error("no tool is named {tool:?}; list the tools with tools/list")]
    UnknownTool {
        /// The tool name, clipped.
        tool: String,
    },
}

impl ToolNaming {
    /// The tool name of `capability`.
    ///
    /// # Errors
    /// [`NameError::TooLong`] over [`MAX_TOOL_NAME`]; [`NameError::NotAFunctionName`] for a
    /// name underscoring cannot carry.
    pub fn tool_name(self, capability: &str) -> Result<String, NameError> {
        match self {
            Self::Capability if capability.len() > MAX_TOOL_NAME => Err(NameError::TooLong {
                capability: capability.to_string(),
                length: capability.len(),
                limit: MAX_TOOL_NAME,
            }),
            Self::Capability => Ok(capability.to_string()),
            Self::Underscored => reach_agent::tool::function_name(capability).map_err(|error| {
                NameError::NotAFunctionName {
                    capability: capability.to_string(),
                    reason: match error {
                        reach_agent::tool::ToolDefinitionError::InvalidName { reason, .. } => {
                            reason
                        }
                        other => other.to_string(),
                    },
                }
            }),
        }
    }

    /// The capability a tool name stands for: the inverse of [`ToolNaming::tool_name`].
    ///
    /// # Errors
    /// [`NameError::UnknownTool`] when `tool` is no tool name this naming makes.
    pub fn capability_name(self, tool: &str) -> Result<String, NameError> {
        let capability = match self {
            Self::Capability => tool.to_string(),
            Self::Underscored => reach_agent::tool::capability_name(tool),
        };
        match self.tool_name(&capability) {
            Ok(back) if back == tool && reach_proto::names::is_dotted_name(&capability) => {
                Ok(capability)
            }
            _ => Err(NameError::UnknownTool {
                tool: tool.chars().take(MAX_TOOL_NAME).collect(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_go_both_ways_under_either_naming() {
        for naming in [ToolNaming::Capability, ToolNaming::Underscored] {
            for capability in [
                "complaint.classify",
                "echo",
                "mcp.words.count_words",
                "a-b.c",
            ] {
                let tool = naming.tool_name(capability).unwrap();
                assert_eq!(naming.capability_name(&tool).unwrap(), capability);
            }
        }
        assert_eq!(
            ToolNaming::Underscored
                .tool_name("complaint.classify")
                .unwrap(),
            "complaint__classify"
        );
    }

    #[test]
    fn names_that_cannot_go_back_are_refused() {
        let underscored = ToolNaming::Underscored;
        for capability in ["a__b", "a_.b", "a._b"] {
            assert!(
                matches!(
                    underscored.tool_name(capability),
                    Err(NameError::NotAFunctionName { .. })
                ),
                "{capability}"
            );
        }
        let long = "x".repeat(129);
        assert!(matches!(
            ToolNaming::Capability.tool_name(&long),
            Err(NameError::TooLong { length: 129, .. })
        ));
        assert!(matches!(
            underscored.tool_name(&format!("{}.y", "y".repeat(63))),
            Err(NameError::NotAFunctionName { .. })
        ));
        for tool in ["", "a..b", "a b", "a___b", "x.__y"] {
            assert!(
                ToolNaming::Capability.capability_name(tool).is_err()
                    || underscored.capability_name(tool).is_err(),
                "{tool:?}"
            );
        }
        assert!(underscored.capability_name("a___b").is_err());
        assert!(ToolNaming::Capability.capability_name("a b").is_err());
        assert!(ToolNaming::Capability.capability_name("").is_err());
    }
}
