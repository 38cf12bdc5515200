//! The span of a typed pass-through call: `router.passthrough`, child of the caller's
//! `traceparent` and parent of the instance's span, as exported over OTLP to the Python
//! receiver (`sdk/rust/reach-telemetry/tests/otlp_receiver.py`, run with `<repo>/.venv`).

mod common;
/// The OTLP receiver harness, shared with the other crates' trace tests.
#[path = "../../../sdk/rust/reach-telemetry/tests/support/otlp.rs"]
mod otlp;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use otlp::OtlpReceiver;
use reach_agents::typed::pb::triage_service_client::TriageServiceClient;
use reach_agents::typed::pb::triage_service_server::{TriageService, TriageServiceServer};
use reach_agents::typed::pb::{TriageRequest, TriageResponse};
use reach_router::RouterConfig;
use reach_rpc::GrpcServer;
use tokio::net::TcpListener;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A TriageService that answers at once.
#[derive(Clone)]
struct Triage;

#[tonic::async_trait]
impl TriageService for Triage {
    async fn triage(
        &self,
        request: Request<TriageRequest>,
    ) -> Result<Response<TriageResponse>, Status> {
        Ok(Response::new(TriageResponse {
            complaint_id: request.into_inner().complaint_id,
            ..Default::default()
        }))
    }

    type TriageStreamStream = futures::stream::Empty<Result<TriageResponse, Status>>;

    async fn triage_stream(
        &self,
        _request: Request<Streaming<TriageRequest>>,
    ) -> Result<Response<Self::TriageStreamStream>, Status> {
        Ok(Response::new(futures::stream::empty()))
    }
}

// Current-thread runtime: every task runs where the test's default dispatcher is set.
#[tokio::test]
async fn a_pass_through_call_has_a_router_span_between_the_callers_and_the_instances() {
    let receiver = OtlpReceiver::start(&repo_root(), false);
    let config = reach_telemetry::TelemetryConfig::from_vars(
        "reach-router-test",
        [(
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_string(),
            receiver.endpoint.clone(),
        )],
    )
    .unwrap();
    let (dispatch, guard) = reach_telemetry::dispatch(&config, std::io::sink).unwrap();
    let _default = tracing::dispatcher::set_default(&dispatch);

    let registry = registry().await;
    // The instance: TriageService with the SDK's server span.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        GrpcServer::new()
            .add_service(reach_telemetry::traced(TriageServiceServer::new(Triage)))
            .serve(listener, futures::future::pending()),
    );
    registry
        .registry
        .register(
            reach_proto::v1::InstanceSpec {
                service: "triage".into(),
                instance_id: "triage-1".into(),
                endpoint,
                grpc_services: vec!["examples.complaints.v1.TriageService".into()],
                weight: 1,
                ..Default::default()
            },
            Some(Duration::from_secs(60)),
        )
        .expect("registration");
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;

    let caller = tracing::info_span!("test.caller");
    let trace_id = reach_telemetry::span_trace_id(&caller).unwrap().to_string();
    async {
        let mut client = TriageServiceClient::connect(router.url.clone())
            .await
            .unwrap();
        let mut request = Request::new(TriageRequest {
            complaint_id: "c1".into(),
            narrative: "x".into(),
        });
        reach_telemetry::propagation::inject_current(request.metadata_mut());
        client.triage(request).await.unwrap();
    }
    .instrument(caller)
    .await;

    guard.flush().await.unwrap();
    let spans: Vec<serde_json::Value> = receiver
        .spans()
        .into_iter()
        .filter(|s| s["trace_id"] == trace_id)
        .collect();
    let named = |name: &str| {
        let found: Vec<&serde_json::Value> = spans.iter().filter(|s| s["name"] == name).collect();
        assert_eq!(found.len(), 1, "one {name} span: {spans:#?}");
        found[0].clone()
    };
    let caller = named("test.caller");
    let passthrough = named("router.passthrough");
    let instance = named("examples.complaints.v1.TriageService/Triage");
    assert_eq!(
        passthrough["parent_span_id"], caller["span_id"],
        "{spans:#?}"
    );
    assert_eq!(
        instance["parent_span_id"], passthrough["span_id"],
        "{spans:#?}"
    );
}
