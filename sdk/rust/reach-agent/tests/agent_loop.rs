//! The tool loop with a scripted model: it stops at `max_turns` with a clear outcome, runs a
//! message's tool calls concurrently (or one per step), feeds tool errors back, accumulates
//! token usage, folds memory, and traces each model and tool call.

mod support;

use std::sync::Arc;

use reach_agent::memory::{Memory, MemoryConfig, SUMMARY_PREFIX};
use reach_agent::provider::{ChatRequest, Role};
use reach_agent::result::ToolErrorCode;
use reach_agent::scripted::{ScriptedProvider, Step};
use reach_agent::tool::{Tool, ToolContext, ToolRegistry};
use reach_agent::{Agent, RunContext, Stopped};
use serde_json::{Value, json};
use support::tools::tools;

#[tokio::test]
async fn the_loop_stops_at_max_turns_with_a_clear_outcome() {
    let model =
        ScriptedProvider::from_fn(|_| Ok(Step::tool_call("util.echo", r#"{"text": "again"}"#)))
            .with_usage(10, 5);
    let agent = Agent::new(model.shared(), tools()).max_turns(3);
    let outcome = agent
        .run(RunContext::default(), "loop forever")
        .await
        .unwrap();
    assert_eq!(outcome.stopped, Stopped::MaxTurns);
    assert_eq!(outcome.turns, 3);
    assert!(
        outcome
            .answer
            .contains("could not complete the task within 3 turns"),
        "{}",
        outcome.answer
    );
    assert_eq!(outcome.tool_calls.len(), 3);
    assert_eq!(
        (
            outcome.usage.input_tokens,
            outcome.usage.output_tokens,
            outcome.usage.model_calls
        ),
        (30, 15, 3)
    );
}

#[tokio::test]
async fn token_usage_accumulates_and_tool_errors_go_back_to_the_model() {
    let model = Arc::new(
        ScriptedProvider::new([
            Step::tool_call("no.such_tool", "{}"),
            Step::tool_call("util.echo", r#"{"txt": "typo"}"#),
            Step::reply("done"),
        ])
        .with_usage(7, 3),
    );
    let agent = Agent::new(model.clone(), tools());
    let outcome = agent.run(RunContext::default(), "go").await.unwrap();
    assert_eq!(outcome.stopped, Stopped::Final);
    assert_eq!(outcome.answer, "done");
    assert_eq!(
        (
            outcome.usage.input_tokens,
            outcome.usage.output_tokens,
            outcome.usage.model_calls
        ),
        (21, 9, 3)
    );
    let unknown = outcome.tool_calls[0].result.error.as_ref().unwrap();
    assert_eq!(unknown.code, ToolErrorCode::UnknownTool);
    assert!(
        unknown.message.contains("util__echo"),
        "{}",
        unknown.message
    );
    let invalid = outcome.tool_calls[1].result.error.as_ref().unwrap();
    assert_eq!(invalid.code, ToolErrorCode::InvalidArguments);
    let pointers: Vec<&str> = invalid
        .violations
        .iter()
        .map(|v| v.pointer.as_str())
        .collect();
    assert!(pointers.contains(&"/text"), "{pointers:?}");
    // The model saw both errors as tool messages.
    let last = model.requests().pop().unwrap();
    let tool_texts: Vec<&str> = last
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.text())
        .collect();
    assert_eq!(tool_texts.len(), 2);
    assert!(tool_texts[1].contains("\"status\":\"error\"") && tool_texts[1].contains("/text"));
}

#[tokio::test]
async fn tool_calls_of_one_message_run_concurrently() {
    // Each call waits for the other: run one after the other, they would never finish.
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    #[derive(serde::Deserialize, schemars::JsonSchema)]
    struct Args {}
    let wait = {
        let barrier = barrier.clone();
        Tool::from_fn::<Args, Value, _, _>(
            "sync.wait",
            "Waits.",
            move |_: Args, _ctx: ToolContext| {
                let barrier = barrier.clone();
                async move {
                    barrier.wait().await;
                    Ok(json!("met"))
                }
            },
        )
        .unwrap()
    };
    let model = ScriptedProvider::new([
        Step::ToolCalls(vec![
            ("sync.wait".into(), "{}".into()),
            ("sync.wait".into(), "{}".into()),
        ]),
        Step::reply("both met"),
    ]);
    let agent = Agent::new(model.shared(), ToolRegistry::new().with(wait).unwrap());
    let outcome = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        agent.run(RunContext::default(), "meet"),
    )
    .await
    .expect("concurrent tool calls finish")
    .unwrap();
    assert_eq!(outcome.answer, "both met");
    assert!(outcome.tool_calls.iter().all(|c| c.result.is_ok()));
}

#[tokio::test]
async fn one_tool_per_step_runs_only_the_first_call() {
    let model = Arc::new(ScriptedProvider::new([
        Step::ToolCalls(vec![
            ("util.echo".into(), r#"{"text": "a"}"#.into()),
            ("util.echo".into(), r#"{"text": "b"}"#.into()),
        ]),
        Step::reply("ok"),
    ]));
    let agent = Agent::new(model.clone(), tools()).one_tool_per_step(true);
    let outcome = agent
        .run(RunContext::default(), "two at once")
        .await
        .unwrap();
    assert!(outcome.tool_calls[0].result.is_ok());
    let skipped = outcome.tool_calls[1].result.error.as_ref().unwrap();
    assert!(
        skipped.message.contains("one tool call per step"),
        "{}",
        skipped.message
    );
    assert_eq!(model.requests()[0].parallel_tool_calls, Some(false));
}

#[tokio::test]
async fn memory_folds_older_messages_into_one_summary_and_keeps_the_newest() {
    let summary_prompt = MemoryConfig::default().summary_prompt;
    let is_summary_call = move |r: &ChatRequest| r.messages[0].text() == summary_prompt;
    let summarised = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let model = {
        let summarised = summarised.clone();
        let calls = std::sync::atomic::AtomicUsize::new(0);
        Arc::new(
            ScriptedProvider::from_fn(move |request| {
                if is_summary_call(request) {
                    summarised
                        .lock()
                        .unwrap()
                        .push(request.messages[1].text().to_string());
                    return Ok(Step::reply(
                        "the user asked about https://docs.example/x; echoed 1 and 2",
                    ));
                }
                let tool_results = request
                    .messages
                    .iter()
                    .filter(|m| m.role == Role::Tool)
                    .count();
                let echoed = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if echoed < 4 {
                    Ok(Step::tool_call(
                        "util.echo",
                        format!(r#"{{"text": "{}"}}"#, echoed + 1),
                    ))
                } else {
                    Ok(Step::reply(format!(
                        "finished after {tool_results} visible tool results"
                    )))
                }
            })
            .with_usage(10, 2),
        )
    };
    let memory = Arc::new(Memory::new(MemoryConfig {
        keep_last: 4,
        ..MemoryConfig::default()
    }));
    let agent = Agent::new(model.clone(), tools())
        .system("You echo.")
        .memory(memory.clone())
        .max_turns(10);
    let outcome = agent
        .run(
            RunContext::task("t-1"),
            "please echo; see https://docs.example/x for why",
        )
        .await
        .unwrap();
    assert_eq!(outcome.stopped, Stopped::Final);

    // Folding happened after tool rounds, with URLs stripped from what was summarised.
    let inputs = summarised.lock().unwrap().clone();
    assert!(!inputs.is_empty());
    assert!(inputs.iter().all(|t| !t.contains("https://")), "{inputs:?}");
    assert!(inputs[0].contains("<url>"), "{inputs:?}");

    // One summary (URLs stripped from it too), the system prompt, and the newest verbatim.
    let messages = &outcome.messages;
    let summaries: Vec<_> = messages
        .iter()
        .filter(|m| m.text().starts_with(SUMMARY_PREFIX))
        .collect();
    assert_eq!(summaries.len(), 1, "{messages:#?}");
    assert!(summaries[0].text().contains("<url>") && !summaries[0].text().contains("https://"));
    assert_eq!(messages[0].text(), "You echo.");
    assert!(
        !messages
            .iter()
            .any(|m| m.role == Role::User && m.text().starts_with("please echo")),
        "the oldest message should be folded"
    );
    let conversation: Vec<_> = messages.iter().filter(|m| m.role != Role::System).collect();
    assert!(conversation.len() <= 5, "{conversation:#?}");
    assert_eq!(conversation.last().unwrap().role, Role::Assistant);
    assert!(conversation.last().unwrap().text().starts_with("finished"));
    // A kept tool message always follows the assistant message that requested it.
    assert_ne!(conversation[0].role, Role::Tool);

    // Folding calls count in the usage.
    assert!(outcome.usage.model_calls > u64::from(outcome.turns));
    assert_eq!(outcome.usage.input_tokens, 10 * outcome.usage.model_calls);

    // The task remembers, keyed by task id; another task starts empty.
    let remembered = memory.load("t-1");
    assert!(
        remembered
            .iter()
            .any(|m| m.text().starts_with(SUMMARY_PREFIX))
    );
    assert!(!remembered.iter().any(|m| m.text() == "You echo."));
    assert!(memory.load("t-2").is_empty());
}

#[tokio::test]
async fn repeated_system_text_is_sent_once() {
    let model = Arc::new(ScriptedProvider::new([Step::reply("hi")]));
    let agent = Agent::new(model.clone(), ToolRegistry::new()).system("Be brief.");
    agent
        .run_messages(
            RunContext::default(),
            vec![
                reach_agent::ChatMessage::system("Be brief."),
                reach_agent::ChatMessage::user("hello"),
            ],
        )
        .await
        .unwrap();
    let sent = &model.requests()[0].messages;
    assert_eq!(sent.iter().filter(|m| m.role == Role::System).count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_tool_past_the_runs_deadline_is_a_timeout_for_the_model() {
    #[derive(serde::Deserialize, schemars::JsonSchema)]
    struct Args {}
    let slow = Tool::from_fn::<Args, Value, _, _>(
        "slow.op",
        "Takes a minute.",
        |_: Args, _ctx: ToolContext| async move {
            tokio::time::sleep(std::time::Duration::from_secs(60)).await;
            Ok(json!("late"))
        },
    )
    .unwrap();
    let model = ScriptedProvider::new([Step::tool_call("slow.op", "{}"), Step::reply("gave up")]);
    let agent = Agent::new(model.shared(), ToolRegistry::new().with(slow).unwrap());
    let ctx = RunContext {
        deadline: Some(tokio::time::Instant::now() + std::time::Duration::from_secs(5)),
        ..RunContext::default()
    };
    let outcome = agent.run(ctx, "do the slow thing").await.unwrap();
    let error = outcome.tool_calls[0].result.error.as_ref().unwrap();
    assert_eq!(error.code, ToolErrorCode::Timeout);
    assert_eq!(outcome.answer, "gave up");
}
