//! Every service refuses a message over its limit — at any size — with RESOURCE_EXHAUSTED and
//! ErrorInfo `PAYLOAD_TOO_LARGE` naming both sizes, by the message's gRPC length prefix in
//! the shared serving layer (`reach_rpc::limits::MessageLimits`), never tonic's OUT_OF_RANGE.
//! The router, the registry and the orchestrator run as `reach dev` runs them, on one
//! 127.0.0.1 port.

use reach::config::ReachConfig;
use reach::control_plane::{ControlPlane, Services};
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{
    CallRequest, Header, InstanceSpec, Payload, ReachMessage, RegisterRequest, StartTaskRequest,
    header,
};
use tokio::net::TcpListener;
use tonic::Code;

/// The router's message limit (`router.max_message_bytes`, its default), bytes.
const ROUTER_LIMIT: usize = 4 * 1024 * 1024;

/// Asserts `status` is PAYLOAD_TOO_LARGE naming exactly `limit` (the configured limit, also
/// when the router refuses by prefix past its decoding limit) and a size above it.
fn assert_too_large(what: &str, status: &tonic::Status, limit: usize) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{what}: {status:?}");
    assert_eq!(
        reach_rpc::errors::reason_of(status).as_deref(),
        Some(reach_rpc::errors::reason::PAYLOAD_TOO_LARGE),
        "{what}: {status:?}"
    );
    let metadata = reach_rpc::errors::metadata_of(status);
    let size: usize = metadata["size_bytes"].parse().unwrap();
    let limit_bytes: usize = metadata["limit_bytes"].parse().unwrap();
    assert_eq!(
        limit_bytes, limit,
        "{what}: the refusal names the configured limit"
    );
    assert!(
        size > limit_bytes,
        "{what}: size {size}, limit {limit_bytes}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_of_two_and_a_half_times_the_limit_is_payload_too_large_on_every_service() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = ReachConfig::default();
    config.router.max_message_bytes = ROUTER_LIMIT;
    config.orchestrator.store_url = format!("sqlite://{}", dir.path().join("o.db").display());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plane = ControlPlane::start(listener, &config, Services::ALL)
        .await
        .expect("control plane starts");
    let channel = tonic::transport::Endpoint::from_shared(plane.endpoint())
        .unwrap()
        .connect()
        .await
        .unwrap();

    // The router: 2.5 × router.max_message_bytes, beyond tonic's decoding limit (twice it).
    let big = ROUTER_LIMIT * 5 / 2;
    let call = CallRequest {
        message: Some(ReachMessage {
            header: Some(Header {
                target: Some(header::Target::Capability("anything".into())),
                ..Header::default()
            }),
            payload: Some(Payload::text("t", "x".repeat(big))),
        }),
    };
    let status = RouterServiceClient::new(channel.clone())
        .call(call)
        .await
        .unwrap_err();
    assert_too_large("router", &status, ROUTER_LIMIT);

    // The registry and the orchestrator: 2.5 × their limit (tonic's default, 4 MiB).
    let default = reach_rpc::limits::DEFAULT_MAX_MESSAGE_BYTES;
    let big = default * 5 / 2;
    let register = RegisterRequest {
        instance: Some(InstanceSpec {
            service: "x".repeat(big),
            ..InstanceSpec::default()
        }),
        lease_ttl: None,
    };
    let status = RegistryServiceClient::new(channel.clone())
        .register(register)
        .await
        .unwrap_err();
    assert_too_large("registry", &status, default);

    let start = StartTaskRequest {
        flow_id: "x".repeat(big),
        ..StartTaskRequest::default()
    };
    let status = OrchestratorServiceClient::new(channel.clone())
        .start_task(start)
        .await
        .unwrap_err();
    assert_too_large("orchestrator", &status, default);

    // The connection is fine afterwards: a small call is answered.
    let status = RouterServiceClient::new(channel)
        .call(CallRequest { message: None })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    plane.shutdown().await.unwrap();
}
