//! The tools the loop and trace tests give their agents.

use reach_agent::tool::{Tool, ToolContext, ToolRegistry};
use serde_json::{Value, json};

/// `util.echo`: answers `{"echo": text}`.
pub fn echo_tool() -> Tool {
    #[derive(serde::Deserialize, schemars::JsonSchema)]
    struct Args {
        /// What to echo.
        text: String,
    }
    Tool::from_fn::<Args, Value, _, _>(
        "util.echo",
        "Echoes text. Use it to test; not for real work.",
        |args: Args, _ctx: ToolContext| async move { Ok(json!({"echo": args.text})) },
    )
    .unwrap()
}

/// A registry with [`echo_tool`] alone.
pub fn tools() -> ToolRegistry {
    ToolRegistry::new().with(echo_tool()).unwrap()
}
