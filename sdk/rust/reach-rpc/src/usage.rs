//! Model token usage as it travels on the mesh: an LLM agent adds what its model calls cost
//! to its reply's `header.metadata`, and the orchestrator sums it into the task record.
//!
//! The keys follow the OpenTelemetry GenAI semantic conventions' attribute names
//! (`gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`), prefixed `reach.` because
//! they are header metadata, not span attributes; `reach.gen_ai.model_calls` counts the
//! model calls the reply took.

use std::collections::HashMap;

/// Header metadata key: input (prompt) tokens, a decimal `u64`.
pub const INPUT_TOKENS_KEY: &str = "reach.gen_ai.usage.input_tokens";
/// Header metadata key: output (completion) tokens, a decimal `u64`.
pub const OUTPUT_TOKENS_KEY: &str = "reach.gen_ai.usage.output_tokens";
/// Header metadata key: how many model calls the reply took, a decimal `u64`.
pub const MODEL_CALLS_KEY: &str = "reach.gen_ai.model_calls";

/// The most tokens (input or output) one reply may report: 10⁹ (a billion tokens is far
/// beyond any model call today; larger is treated as a bad report).
pub const MAX_REPORTED_TOKENS: u64 = 1_000_000_000;
/// The most model calls one reply may report.
pub const MAX_REPORTED_CALLS: u64 = 1_000_000;

/// Tokens spent by model calls (summed over calls, replies or a task's nodes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenUsage {
    /// Input (prompt) tokens.
    pub input_tokens: u64,
    /// Output (completion) tokens.
    pub output_tokens: u64,
    /// Model calls.
    pub model_calls: u64,
}

impl TokenUsage {
    /// Whether nothing was spent.
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }

    /// Adds `other`, saturating at `u64::MAX` (a hostile agent cannot wrap a task's sum).
    pub fn add(&mut self, other: TokenUsage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.model_calls = self.model_calls.saturating_add(other.model_calls);
    }

    /// Writes the usage into header metadata (nothing when it is zero).
    pub fn write(&self, metadata: &mut HashMap<String, String>) {
        if self.is_zero() {
            return;
        }
        metadata.insert(INPUT_TOKENS_KEY.to_string(), self.input_tokens.to_string());
        metadata.insert(
            OUTPUT_TOKENS_KEY.to_string(),
            self.output_tokens.to_string(),
        );
        metadata.insert(MODEL_CALLS_KEY.to_string(), self.model_calls.to_string());
    }

    /// Reads the usage from header metadata: `None` when no key is present. A value that is
    /// not a decimal `u64`, or is over [`MAX_REPORTED_TOKENS`] (or [`MAX_REPORTED_CALLS`]),
    /// counts as 0: it is an agent's report, not an order, and no single reply spends that
    /// much — so a rogue agent cannot make a task's sum meaningless.
    pub fn read(metadata: &HashMap<String, String>) -> Option<TokenUsage> {
        let field = |key: &str| {
            let limit = if key == MODEL_CALLS_KEY {
                MAX_REPORTED_CALLS
            } else {
                MAX_REPORTED_TOKENS
            };
            metadata.get(key).map(|v| {
                v.trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|n| *n <= limit)
                    .unwrap_or(0)
            })
        };
        let (input, output, calls) = (
            field(INPUT_TOKENS_KEY),
            field(OUTPUT_TOKENS_KEY),
            field(MODEL_CALLS_KEY),
        );
        if input.is_none() && output.is_none() && calls.is_none() {
            return None;
        }
        Some(TokenUsage {
            input_tokens: input.unwrap_or(0),
            output_tokens: output.unwrap_or(0),
            model_calls: calls.unwrap_or(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_round_trips_through_metadata_and_garbage_counts_as_zero() {
        let usage = TokenUsage {
            input_tokens: 120,
            output_tokens: 30,
            model_calls: 2,
        };
        let mut metadata = HashMap::new();
        usage.write(&mut metadata);
        assert_eq!(TokenUsage::read(&metadata), Some(usage));
        assert_eq!(TokenUsage::read(&HashMap::new()), None);
        metadata.insert(INPUT_TOKENS_KEY.into(), "-5".into());
        assert_eq!(TokenUsage::read(&metadata).unwrap().input_tokens, 0);
        metadata.insert(OUTPUT_TOKENS_KEY.into(), u64::MAX.to_string());
        metadata.insert(MODEL_CALLS_KEY.into(), "1000001".into());
        let claimed = TokenUsage::read(&metadata).unwrap();
        assert_eq!((claimed.output_tokens, claimed.model_calls), (0, 0));
        let mut sum = TokenUsage {
            input_tokens: u64::MAX,
            ..usage
        };
        sum.add(usage);
        assert_eq!(sum.input_tokens, u64::MAX);
        assert_eq!(sum.output_tokens, 60);
    }
}
