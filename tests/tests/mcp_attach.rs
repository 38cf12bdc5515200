//! MCP servers attached to the mesh (`reach_edge::mcp::attach`, `reach mcp attach`): Python
//! servers written with the official `mcp` package, over stdio and Streamable HTTP, their
//! tools called through the router by a Rust `MeshClient`.
//!
//! Needs the repository's venv (`scripts/python-env.sh`, which installs `mcp`).

use std::collections::BTreeMap;
use std::time::Duration;

use reach_edge::mcp::attach::{AttachConfig, AttachError, Serving, attach};
use reach_proto::v1::Payload;
use reach_sdk::{AgentConfig, CallOptions, MeshClient};
use reach_tests::{Sandbox, repo_root, venv_python};
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Code;

const WITHIN: Duration = Duration::from_secs(20);

fn server(file: &str) -> String {
    repo_root()
        .join("sdk/python/tests/mcp_servers")
        .join(file)
        .display()
        .to_string()
}

fn stdio(name: &str, file: &str) -> AttachConfig {
    AttachConfig {
        name: name.into(),
        command: vec![venv_python().display().to_string(), server(file)],
        ..AttachConfig::default()
    }
}

/// An attachment running in this process; `stop` deregisters it.
struct Attached {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), AttachError>>,
}

impl Attached {
    fn start(sandbox: &Sandbox, config: AttachConfig) -> Self {
        let mut serving = Serving::new(
            AgentConfig::new("", sandbox.endpoint())
                .with_lease_ttl(Duration::from_secs(1))
                .with_max_drain(Duration::from_secs(5)),
            "127.0.0.1:0",
        );
        serving.probe_interval = Duration::from_millis(200);
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(attach(config, serving, async {
            let _ = stopped.await;
        }));
        Self { stop, task }
    }

    async fn stop(self) -> Result<(), AttachError> {
        let _ = self.stop.send(());
        tokio::time::timeout(WITHIN, self.task)
            .await
            .expect("the attachment stops")
            .expect("the attachment did not panic")
    }
}

async fn call(mesh: &MeshClient, capability: &str, args: Value) -> Result<Payload, tonic::Status> {
    let options = CallOptions {
        timeout: Some(Duration::from_secs(10)),
        ..CallOptions::default()
    };
    let reply = mesh
        .call(capability, Payload::json("mcp.call", &args), options)
        .await?;
    Ok(reply
        .message
        .unwrap_or_default()
        .payload
        .unwrap_or_default())
}

/// Calls `capability` until it is routed (NOT_FOUND while it is not yet registered).
async fn call_when_routable(mesh: &MeshClient, capability: &str, args: Value) -> Payload {
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        match call(mesh, capability, args.clone()).await {
            Ok(payload) => return payload,
            Err(status) if status.code() == Code::NotFound => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{capability} not routable within {WITHIN:?}: {status:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(status) => panic!("{capability}: {status:?}"),
        }
    }
}

/// Waits until `capability` is no longer routed (NOT_FOUND).
async fn until_gone(mesh: &MeshClient, capability: &str) {
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        match call(mesh, capability, json!({"text": "x"})).await {
            Err(status) if status.code() == Code::NotFound => return,
            other => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{capability} still routed after {WITHIN:?}: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

#[tokio::test]
async fn a_stdio_server_s_tools_are_capabilities_called_through_the_router() {
    let sandbox = Sandbox::start().await;
    let mesh = sandbox.mesh().await;
    let attached = Attached::start(&sandbox, stdio("words", "words.py"));

    let reply = call_when_routable(
        &mesh,
        "mcp.words.count_words",
        json!({"text": "the quick brown fox"}),
    )
    .await;
    assert_eq!(reply.r#type, "mcp.tool_result");
    assert_eq!(
        reply.first_json(),
        Some(json!({"words": 4, "characters": 19}))
    );
    let shout = call(&mesh, "mcp.words.shout", json!({"text": "hey"}))
        .await
        .unwrap();
    assert_eq!(shout.first_text(), Some("HEY"));

    // Arguments must be an object.
    let status = call(&mesh, "mcp.words.count_words", json!([1, 2]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("JSON object"), "{status:?}");

    // The registry serves the tool's description and schema.
    let mut registry = sandbox.registry_client().await;
    let listed = registry
        .list_capabilities(reach_proto::v1::ListCapabilitiesRequest {
            name_prefix: "mcp.words.".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let count = listed
        .capabilities
        .iter()
        .find(|c| c.name == "mcp.words.count_words")
        .expect("count_words listed");
    assert!(count.description.contains("Counts the words"), "{count:?}");
    let schema: Value = serde_json::from_str(&count.input_schema).unwrap();
    assert_eq!(schema["properties"]["text"]["type"], "string", "{schema}");

    attached.stop().await.expect("a clean stop");
    until_gone(&mesh, "mcp.words.count_words").await;
    sandbox.stop().await;
}

#[tokio::test]
async fn tool_errors_list_changes_and_a_server_that_exits() {
    let sandbox = Sandbox::start().await;
    let mesh = sandbox.mesh().await;
    let attached = Attached::start(
        &sandbox,
        AttachConfig {
            prefix: "tools.changing".into(),
            ..stdio("changing", "changing.py")
        },
    );
    let echoed = call_when_routable(&mesh, "tools.changing.echo", json!({"text": "hi"})).await;
    assert_eq!(echoed.first_json(), Some(json!({"text": "hi"})));

    // A tool error is FAILED_PRECONDITION with the tool's text.
    let status = call(&mesh, "tools.changing.fail", json!({"reason": "because"}))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("refused: because"), "{status:?}");

    // The caller's deadline bounds the tool call.
    let options = CallOptions {
        timeout: Some(Duration::from_millis(300)),
        ..CallOptions::default()
    };
    let status = mesh
        .call(
            "tools.changing.slow",
            Payload::json("mcp.call", &json!({"seconds": 30})),
            options,
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");

    // The tool whose name cannot map is skipped; the others are served.
    let mut registry = sandbox.registry_client().await;
    let listed = registry
        .list_capabilities(reach_proto::v1::ListCapabilitiesRequest {
            name_prefix: "tools.changing.".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut names: Vec<&str> = listed
        .capabilities
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "tools.changing.echo",
            "tools.changing.enable_extra",
            "tools.changing.exit_now",
            "tools.changing.fail",
            "tools.changing.slow"
        ]
    );

    // A tool added by the server (notifications/tools/list_changed) becomes routable.
    let status = call(&mesh, "tools.changing.extra", json!({"n": 21}))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    call(&mesh, "tools.changing.enable_extra", json!({}))
        .await
        .unwrap();
    let doubled = call_when_routable(&mesh, "tools.changing.extra", json!({"n": 21})).await;
    assert_eq!(doubled.first_json(), Some(json!({"doubled": 42})));
    // The old tools stay served by the new runtime.
    let echoed = call(&mesh, "tools.changing.echo", json!({"text": "again"}))
        .await
        .unwrap();
    assert_eq!(echoed.first_json(), Some(json!({"text": "again"})));

    // The server exits: the attachment deregisters and ends with an error.
    let _ = call(&mesh, "tools.changing.exit_now", json!({"code": 3})).await;
    let ended = tokio::time::timeout(WITHIN, attached.task)
        .await
        .expect("the attachment ends when its server exits")
        .unwrap();
    assert!(
        matches!(ended, Err(AttachError::ServerGone { .. })),
        "{ended:?}"
    );
    until_gone(&mesh, "tools.changing.echo").await;
    sandbox.stop().await;
}

#[tokio::test]
async fn a_streamable_http_server_is_attached_by_url() {
    let sandbox = Sandbox::start().await;
    let mesh = sandbox.mesh().await;
    let mut python = tokio::process::Command::new(venv_python())
        .args([server("changing.py"), "--http".into()])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python starts");
    let mut lines = tokio::io::BufReader::new(python.stdout.take().unwrap()).lines();
    let url = tokio::time::timeout(WITHIN, lines.next_line())
        .await
        .expect("the server prints its url")
        .unwrap()
        .expect("a url line");
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");

    let attached = Attached::start(
        &sandbox,
        AttachConfig {
            name: "remote".into(),
            url,
            headers: BTreeMap::from([("X-Test".to_string(), "1".to_string())]),
            ..AttachConfig::default()
        },
    );
    let echoed = call_when_routable(&mesh, "mcp.remote.echo", json!({"text": "over http"})).await;
    assert_eq!(echoed.first_json(), Some(json!({"text": "over http"})));
    let status = call(&mesh, "mcp.remote.fail", json!({"reason": "http"}))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("refused: http"), "{status:?}");

    // The HTTP server goes away: failed pings end the attachment, which deregisters.
    python.kill().await.unwrap();
    let ended = tokio::time::timeout(WITHIN, attached.task)
        .await
        .expect("the attachment ends when its server goes away")
        .unwrap();
    assert!(
        matches!(ended, Err(AttachError::ServerGone { .. })),
        "{ended:?}"
    );
    until_gone(&mesh, "mcp.remote.echo").await;
    sandbox.stop().await;
}

/// The `reach` binary of this build (`cargo build -p reach` first).
fn reach_binary() -> std::path::PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let binary = target.join("debug/reach");
    assert!(
        binary.exists(),
        "{} is missing: run cargo build -p reach first",
        binary.display()
    );
    binary
}

#[tokio::test]
async fn terminating_reach_mcp_attach_deregisters_the_capabilities() {
    let sandbox = Sandbox::start().await;
    let mesh = sandbox.mesh().await;
    let mut child = tokio::process::Command::new(reach_binary())
        .args(["mcp", "attach", "--name", "words", "--registry"])
        .arg(sandbox.endpoint())
        .arg("--")
        .arg(venv_python())
        .arg(server("words.py"))
        .kill_on_drop(true)
        .spawn()
        .expect("reach starts");
    let reply = call_when_routable(&mesh, "mcp.words.count_words", json!({"text": "a b"})).await;
    assert_eq!(
        reply.first_json(),
        Some(json!({"words": 2, "characters": 3}))
    );

    let pid = child.id().expect("running").to_string();
    let killed = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(WITHIN, child.wait())
        .await
        .expect("reach exits on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
    until_gone(&mesh, "mcp.words.count_words").await;
    sandbox.stop().await;
}

#[tokio::test]
async fn reach_mcp_attach_exits_1_when_its_server_exits() {
    let sandbox = Sandbox::start().await;
    let mesh = sandbox.mesh().await;
    let child = tokio::process::Command::new(reach_binary())
        .args(["mcp", "attach", "--name", "changing", "--registry"])
        .arg(sandbox.endpoint())
        .arg("--")
        .arg(venv_python())
        .arg(server("changing.py"))
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("reach starts");
    call_when_routable(&mesh, "mcp.changing.echo", json!({"text": "hi"})).await;
    let _ = call(&mesh, "mcp.changing.exit_now", json!({"code": 0})).await;
    let output = tokio::time::timeout(WITHIN, child.wait_with_output())
        .await
        .expect("reach exits when its server exits")
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("mcp server \"changing\" went away"),
        "{stderr}"
    );
    until_gone(&mesh, "mcp.changing.echo").await;
    sandbox.stop().await;
}

/// An attached server's tools are mesh tools of an LLM agent (the agent kit): discovered from
/// the registry with their schemas like any capability, and called through the router when
/// the model asks for them.
#[tokio::test]
async fn an_llm_agent_uses_an_attached_servers_tool_as_a_mesh_tool() {
    use reach_agent::{Agent, RunContext, ScriptedProvider, Step, ToolRegistry};

    let sandbox = Sandbox::start().await;
    let mesh = sandbox.mesh().await;
    let attached = Attached::start(&sandbox, stdio("words", "words.py"));
    call_when_routable(&mesh, "mcp.words.count_words", json!({"text": "ready"})).await;

    let specs = reach_agent::mesh::discover(sandbox.channel().await, "mcp.words.")
        .await
        .unwrap();
    let described = specs
        .iter()
        .find(|s| s.capability == "mcp.words.count_words")
        .expect("count_words is discovered");
    assert_eq!(
        described.description,
        "Counts the words and characters of a text."
    );
    let mut tools = ToolRegistry::new();
    reach_agent::mesh::mesh_tools(&mesh, specs, &mut tools).unwrap();
    // The model asks for the tool by its function name, then answers with what it got.
    let model = ScriptedProvider::new([
        Step::tool_call(
            "mcp.words.count_words",
            r#"{"text": "the quick brown fox jumps"}"#,
        ),
        Step::reply("five words"),
    ]);
    let outcome = Agent::new(std::sync::Arc::new(model), tools)
        .run(RunContext::default(), "how many words?")
        .await
        .unwrap();
    assert_eq!(outcome.answer, "five words");
    let [call] = outcome.tool_calls.as_slice() else {
        panic!("one tool call: {:?}", outcome.tool_calls);
    };
    assert_eq!(call.name, "mcp.words.count_words");
    assert_eq!(
        call.result.data,
        Some(json!({"words": 5, "characters": 25})),
        "{:?}",
        call.result
    );
    attached.stop().await.unwrap();
}
