//! Typed pass-through: an agent's own gRPC service called through the router, by a Rust
//! client and by a Python grpcio client generated from the example proto.

mod common;

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use common::*;
use reach_agents::typed::pb::TriageRequest;
use reach_agents::typed::pb::triage_service_client::TriageServiceClient;
use reach_router::RouterConfig;
use tonic::Code;

async fn two_triage_agents(registry: &TestRegistry) -> Vec<reach_sdk::runtime::RunningAgent> {
    let mut agents = Vec::new();
    for id in ["triage-1", "triage-2"] {
        let runtime = reach_agents::typed::triage_agent(config("triage", id, &registry.url));
        agents.push(agent(runtime).await.0);
    }
    agents
}

fn round_robin() -> RouterConfig {
    RouterConfig {
        balancing: reach_router::config::BalancingConfig {
            default: reach_router::Policy::RoundRobin,
            ..Default::default()
        },
        ..RouterConfig::default()
    }
}

fn request(id: &str) -> TriageRequest {
    TriageRequest {
        complaint_id: id.into(),
        narrative: "my servicer misapplied my payment and charged a late fee".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_service_is_forwarded_unary_and_streaming_and_balanced() {
    let registry = registry().await;
    let _agents = two_triage_agents(&registry).await;
    let router = router(&registry.url, round_robin()).await;
    router.wait_routable(2).await;
    let mut client = TriageServiceClient::connect(router.url.clone())
        .await
        .unwrap();

    let mut served_by = HashSet::new();
    for i in 0..20 {
        let reply = client
            .triage(request(&format!("c{i}")))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(reply.complaint_id, format!("c{i}"));
        assert_eq!(reply.category, "servicing");
        served_by.insert(reply.instance_id);
    }
    assert_eq!(
        served_by.len(),
        2,
        "both instances took calls: {served_by:?}"
    );

    let requests = futures::stream::iter((0..5).map(|i| request(&format!("s{i}"))));
    let mut replies = client.triage_stream(requests).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while let Some(reply) = replies.message().await.unwrap() {
        ids.push(reply.complaint_id);
    }
    assert_eq!(ids, ["s0", "s1", "s2", "s3", "s4"]);

    // A service nobody registered.
    let mut nobody =
        reach_proto::v1::agent_service_client::AgentServiceClient::connect(router.url.clone())
            .await
            .unwrap();
    let status = nobody
        .handle(reach_proto::v1::HandleRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_instance_of_a_typed_service_is_unavailable_with_error_info() {
    let registry = registry().await;
    let (dead, _) = dead_endpoint().await;
    registry
        .registry
        .register(
            reach_proto::v1::InstanceSpec {
                service: "triage".into(),
                instance_id: "triage-dead".into(),
                endpoint: dead,
                grpc_services: vec!["examples.complaints.v1.TriageService".into()],
                weight: 1,
                ..Default::default()
            },
            Some(Duration::from_secs(60)),
        )
        .expect("registration");
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let mut client = TriageServiceClient::connect(router.url.clone())
        .await
        .unwrap();
    let status = client.triage(request("c0")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(reason(&status), "INSTANCE_UNAVAILABLE", "{status:?}");
    assert!(
        status
            .message()
            .contains("no instance of gRPC service \"examples.complaints.v1.TriageService\""),
        "{status:?}"
    );
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn python() -> Option<PathBuf> {
    if let Ok(python) = std::env::var("REACH_PYTHON") {
        return Some(PathBuf::from(python));
    }
    let venv = repo_root().join(".venv/bin/python");
    venv.exists().then_some(venv)
}

const CLIENT: &str = r#"
import json, sys
import grpc
sys.path.insert(0, sys.argv[1])
from examples.complaints.v1 import triage_pb2, triage_pb2_grpc

channel = grpc.insecure_channel(sys.argv[2])
stub = triage_pb2_grpc.TriageServiceStub(channel)
narrative = "my servicer misapplied my payment and charged a late fee"
unary = [stub.Triage(triage_pb2.TriageRequest(complaint_id=f"py{i}", narrative=narrative), timeout=10) for i in range(6)]
stream = list(stub.TriageStream(iter([triage_pb2.TriageRequest(complaint_id=f"ps{i}", narrative=narrative) for i in range(3)]), timeout=10))
print(json.dumps({
    "unary": [[r.complaint_id, r.category, r.instance_id] for r in unary],
    "stream": [r.complaint_id for r in stream],
}))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_grpcio_client_calls_the_typed_service_through_the_router() {
    let Some(python) = python() else {
        eprintln!("skipped: no Python env; run scripts/python-env.sh (or set REACH_PYTHON)");
        return;
    };
    let registry = registry().await;
    let _agents = two_triage_agents(&registry).await;
    let router = router(&registry.url, round_robin()).await;
    router.wait_routable(2).await;

    // The generated Python modules; removed when `python_dir` drops at the end of the test,
    // passed or not.
    let python_dir = tempfile::Builder::new()
        .prefix("reach-py-")
        .tempdir()
        .unwrap();
    let out_dir = python_dir.path().to_path_buf();
    let root = repo_root();
    let target = router.url.trim_start_matches("http://").to_string();
    let output = tokio::task::spawn_blocking(move || {
        let generated = std::process::Command::new(&python)
            .args(["-m", "grpc_tools.protoc", "-I"])
            .arg(root.join("examples/proto"))
            .arg(format!("--python_out={}", out_dir.display()))
            .arg(format!("--grpc_python_out={}", out_dir.display()))
            .arg("examples/complaints/v1/triage.proto")
            .current_dir(&root)
            .output()
            .expect("run grpc_tools.protoc");
        assert!(
            generated.status.success(),
            "protoc failed: {}",
            String::from_utf8_lossy(&generated.stderr)
        );
        std::process::Command::new(&python)
            .args(["-c", CLIENT])
            .arg(&out_dir)
            .arg(&target)
            .output()
            .expect("run the python client")
    });
    let output = tokio::time::timeout(Duration::from_secs(120), output)
        .await
        .expect("python client finished")
        .unwrap();
    assert!(
        output.status.success(),
        "python client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let result: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let unary = result["unary"].as_array().unwrap();
    assert_eq!(unary.len(), 6);
    for (i, row) in unary.iter().enumerate() {
        assert_eq!(row[0], format!("py{i}"));
        assert_eq!(row[1], "servicing");
    }
    let instances: HashSet<&str> = unary.iter().map(|r| r[2].as_str().unwrap()).collect();
    assert_eq!(
        instances.len(),
        2,
        "balanced across both instances: {instances:?}"
    );
    assert_eq!(result["stream"], serde_json::json!(["ps0", "ps1", "ps2"]));
}
