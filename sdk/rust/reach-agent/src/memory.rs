//! Per-task conversation memory: the newest messages verbatim, older ones folded into one
//! summary message by the model; bounded in tasks (least recently used evicted) and time
//! (idle TTL).
//!
//! **Folding** ([`Memory::fold`]): when the conversation (system messages aside) has more than
//! `keep_last` messages, the older ones — a previous summary included — are summarised by
//! the provider (the `summary_prompt` as system message, the rendered older messages as user
//! message, no tools) and replaced by one system message
//! `"Summary of the earlier conversation: ..."` placed before the kept ones. The cut never
//! separates a tool result from the assistant message that requested it (it moves to the
//! next non-tool message). The agent loop folds after a round of tool calls completes, not
//! on every message.
//!
//! **Stripping**, exactly:
//! - before each model call ([`strip_repeated_system`]): a system message whose text
//!   (trimmed) equals an earlier system message's is removed; the first stays;
//! - in the text sent for summarisation, and in the summary that comes back
//!   ([`replace_urls`]): every `http://` / `https://` URL (up to the next whitespace or
//!   `)`, `]`, `>`, `"`, `'`) is replaced by `<url>`. Messages kept verbatim keep their URLs.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::provider::{ChatMessage, ChatRequest, ModelError, ModelProvider, Role, Usage};

/// The prefix of a folded summary message.
pub const SUMMARY_PREFIX: &str = "Summary of the earlier conversation: ";

/// Memory bounds and folding.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// Messages kept verbatim (system messages aside).
    pub keep_last: usize,
    /// Tasks remembered at once; the least recently used is forgotten first.
    pub max_tasks: usize,
    /// How long an untouched task is remembered.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// The system prompt of the summarisation call.
    pub summary_prompt: String,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            keep_last: 12,
            max_tasks: 1024,
            ttl: Duration::from_secs(3600),
            summary_prompt: "Summarise the conversation below for your own later use: keep facts, \
                decisions, tool results and open questions; drop pleasantries. Reply with the \
                summary only."
                .into(),
        }
    }
}

struct Entry {
    messages: Vec<ChatMessage>,
    /// When it was last loaded or stored (for the TTL).
    touched: Instant,
    /// The use counter's value at that time (for least-recently-used order).
    used: u64,
}

#[derive(Default)]
struct Tasks {
    entries: HashMap<String, Entry>,
    uses: u64,
}

/// Conversation memory keyed by task id.
pub struct Memory {
    config: MemoryConfig,
    tasks: Mutex<Tasks>,
}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memory")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Memory {
    /// An empty memory.
    pub fn new(config: MemoryConfig) -> Self {
        Self {
            config,
            tasks: Mutex::new(Tasks::default()),
        }
    }

    /// The settings.
    pub fn config(&self) -> &MemoryConfig {
        &self.config
    }

    /// The remembered conversation of `task_id` (empty when unknown or expired).
    pub fn load(&self, task_id: &str) -> Vec<ChatMessage> {
        let mut guard = self.tasks.lock().expect("memory lock");
        let tasks = &mut *guard;
        let now = Instant::now();
        tasks.uses += 1;
        match tasks.entries.get_mut(task_id) {
            Some(entry) if now.duration_since(entry.touched) <= self.config.ttl => {
                entry.touched = now;
                entry.used = tasks.uses;
                entry.messages.clone()
            }
            Some(_) => {
                tasks.entries.remove(task_id);
                Vec::new()
            }
            None => Vec::new(),
        }
    }

    /// Remembers `messages` as the conversation of `task_id`, evicting expired tasks and,
    /// past `max_tasks`, the least recently used.
    pub fn store(&self, task_id: &str, messages: Vec<ChatMessage>) {
        let mut guard = self.tasks.lock().expect("memory lock");
        let tasks = &mut *guard;
        let now = Instant::now();
        let ttl = self.config.ttl;
        tasks.uses += 1;
        tasks
            .entries
            .retain(|_, e| now.duration_since(e.touched) <= ttl);
        tasks.entries.insert(
            task_id.to_string(),
            Entry {
                messages,
                touched: now,
                used: tasks.uses,
            },
        );
        while tasks.entries.len() > self.config.max_tasks.max(1) {
            let Some(oldest) = tasks
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            tasks.entries.remove(&oldest);
        }
    }

    /// Forgets `task_id`.
    pub fn forget(&self, task_id: &str) {
        self.tasks
            .lock()
            .expect("memory lock")
            .entries
            .remove(task_id);
    }

    /// How many tasks are remembered.
    pub fn len(&self) -> usize {
        self.tasks.lock().expect("memory lock").entries.len()
    }

    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Folds the older part of `messages` into one summary (see the module docs); returns
    /// the summarisation call's usage, `None` when nothing needed folding.
    ///
    /// # Errors
    /// The provider's [`ModelError`]; `messages` is then unchanged.
    pub async fn fold(
        &self,
        provider: &dyn ModelProvider,
        messages: &mut Vec<ChatMessage>,
    ) -> Result<Option<Usage>, ModelError> {
        let (system, conversation): (Vec<ChatMessage>, Vec<ChatMessage>) = messages
            .iter()
            .cloned()
            .partition(|m| m.role == Role::System && !m.text().starts_with(SUMMARY_PREFIX));
        let keep = self.config.keep_last.max(1);
        if conversation.len() <= keep {
            return Ok(None);
        }
        let mut cut = conversation.len() - keep;
        while cut < conversation.len() && conversation[cut].role == Role::Tool {
            cut += 1;
        }
        if cut == 0 || cut >= conversation.len() {
            return Ok(None);
        }
        let (older, newer) = conversation.split_at(cut);
        let rendered = older.iter().map(render).collect::<Vec<_>>().join("\n");
        let request = ChatRequest::new(vec![
            ChatMessage::system(self.config.summary_prompt.clone()),
            ChatMessage::user(replace_urls(&rendered)),
        ]);
        let response = crate::gen_ai::observed_chat(provider, request, false).await?;
        let summary = replace_urls(response.message.text().trim());
        let mut folded = system;
        folded.push(ChatMessage::system(format!("{SUMMARY_PREFIX}{summary}")));
        folded.extend_from_slice(newer);
        *messages = folded;
        Ok(Some(response.usage))
    }
}

fn render(message: &ChatMessage) -> String {
    let mut line = format!("{}: {}", message.role.as_str(), message.text());
    for call in &message.tool_calls {
        line.push_str(&format!(" [calls {}({})]", call.name, call.arguments));
    }
    if let Some(name) = &message.name
        && message.role == Role::Tool
    {
        line = format!("tool {name}: {}", message.text());
    }
    line
}

/// `messages` without system messages that repeat an earlier system message's text.
pub fn strip_repeated_system(messages: &[ChatMessage]) -> Vec<ChatMessage> {
    let mut seen: Vec<&str> = Vec::new();
    let mut out = Vec::with_capacity(messages.len());
    for message in messages {
        if message.role == Role::System {
            let text = message.text().trim();
            if seen.contains(&text) {
                continue;
            }
            seen.push(text);
        }
        out.push(message.clone());
    }
    out
}

/// `text` with every `http://` or `https://` URL replaced by `<url>`.
pub fn replace_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let next = [rest.find("http://"), rest.find("https://")]
            .into_iter()
            .flatten()
            .min();
        let Some(start) = next else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..start]);
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| c.is_whitespace() || matches!(c, ')' | ']' | '>' | '"' | '\''))
            .unwrap_or(tail.len());
        out.push_str("<url>");
        rest = &tail[end..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_repeated_system_text_are_stripped() {
        assert_eq!(
            replace_urls("see https://a.example/x?y=1 and (http://b.example)."),
            "see <url> and (<url>)."
        );
        let messages = vec![
            ChatMessage::system("be brief"),
            ChatMessage::user("hi"),
            ChatMessage::system(" be brief "),
            ChatMessage::system("other"),
        ];
        let stripped = strip_repeated_system(&messages);
        assert_eq!(stripped.len(), 3);
        assert_eq!(stripped[2].text(), "other");
    }

    #[test]
    fn tasks_are_bounded_least_recently_used_first() {
        let memory = Memory::new(MemoryConfig {
            max_tasks: 2,
            ..MemoryConfig::default()
        });
        memory.store("a", vec![ChatMessage::user("a")]);
        memory.store("b", vec![ChatMessage::user("b")]);
        let _ = memory.load("a");
        memory.store("c", vec![ChatMessage::user("c")]);
        assert_eq!(memory.len(), 2);
        assert!(memory.load("b").is_empty());
        assert_eq!(memory.load("a").len(), 1);
    }
}
