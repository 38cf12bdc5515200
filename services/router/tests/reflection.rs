//! Server reflection on the router's port lists and describes the agents' own gRPC services
//! (typed pass-through) while an instance serves them: grpcurl (v1alpha) and a tonic v1
//! client, with no proto on the caller's side.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::*;
use reach_router::RouterConfig;
use tonic_reflection::pb::v1;

const TRIAGE: &str = "examples.complaints.v1.TriageService";

fn grpcurl(args: &[&str]) -> (bool, String) {
    let bin = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/grpcurl");
    assert!(
        bin.exists(),
        "grpcurl is missing: run scripts/python-env.sh first"
    );
    let output = Command::new(bin).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// `ListServices` over reflection v1.
async fn listed_v1(url: &str) -> Vec<String> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel);
    let request = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
    };
    let mut responses = client
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    match responses.message().await.unwrap().unwrap().message_response {
        Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("not a list: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_reflection_lists_describes_and_calls_a_typed_service_while_it_is_served() {
    let registry = registry().await;
    let router = router(&registry.url, RouterConfig::default()).await;
    let address = router.url.trim_start_matches("http://").to_string();

    let (ok, listed) = grpcurl(&["-plaintext", &address, "list"]);
    assert!(ok, "{listed}");
    assert!(listed.contains("reach.v1.RouterService"), "{listed}");
    assert!(!listed.contains(TRIAGE), "{listed}");

    let runtime = reach_agents::typed::triage_agent(config("triage", "triage-1", &registry.url));
    let (agent, _) = agent(runtime).await;
    router.wait_routable(1).await;

    let (ok, listed) = grpcurl(&["-plaintext", &address, "list"]);
    assert!(ok, "{listed}");
    assert!(listed.contains("reach.v1.RouterService"), "{listed}");
    assert!(listed.lines().any(|l| l.trim() == TRIAGE), "{listed}");
    assert!(listed_v1(&router.url).await.contains(&TRIAGE.to_string()));

    let (ok, described) = grpcurl(&["-plaintext", &address, "describe", TRIAGE]);
    assert!(ok, "{described}");
    assert!(described.contains("rpc Triage"), "{described}");
    let (ok, described) = grpcurl(&[
        "-plaintext",
        &address,
        "describe",
        "examples.complaints.v1.TriageRequest",
    ]);
    assert!(ok, "{described}");
    assert!(described.contains("narrative"), "{described}");

    let (ok, reply) = grpcurl(&[
        "-plaintext",
        "-d",
        r#"{"complaint_id": "c1", "narrative": "my servicer misapplied my payment and charged a late fee"}"#,
        &address,
        &format!("{TRIAGE}/Triage"),
    ]);
    assert!(ok, "{reply}");
    assert!(reply.contains("servicing"), "{reply}");

    // The mesh's own services are still described from its descriptors.
    let (ok, described) = grpcurl(&["-plaintext", &address, "describe", "reach.v1.RouterService"]);
    assert!(ok, "{described}");

    agent.drain().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !router.router.table().instances().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the instance left the table");
    let (ok, listed) = grpcurl(&["-plaintext", &address, "list"]);
    assert!(ok, "{listed}");
    assert!(!listed.contains(TRIAGE), "{listed}");
    let (ok, described) = grpcurl(&["-plaintext", &address, "describe", TRIAGE]);
    assert!(!ok, "{described}");
}
