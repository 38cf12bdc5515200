//! `reach top` against a live registry (a fixed one that lists two instances) and a live
//! admin port serving the process's metrics.

use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::registry_service_server::{RegistryService, RegistryServiceServer};
use reach_proto::v1::{
    DeregisterRequest, DeregisterResponse, HeartbeatRequest, HeartbeatResponse, Instance,
    InstanceSpec, InstanceState, ListInstancesRequest, ListInstancesResponse, RegisterRequest,
    RegisterResponse, WatchRequest, WatchResponse,
};
use reach_telemetry::metrics::names;
use tonic::{Request, Response, Status};

/// A registry that only lists two fixed instances.
struct FixedRegistry;

#[tonic::async_trait]
impl RegistryService for FixedRegistry {
    async fn register(
        &self,
        _: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        Err(Status::unimplemented("fixed"))
    }

    async fn heartbeat(
        &self,
        _: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        Err(Status::unimplemented("fixed"))
    }

    async fn deregister(
        &self,
        _: Request<DeregisterRequest>,
    ) -> Result<Response<DeregisterResponse>, Status> {
        Err(Status::unimplemented("fixed"))
    }

    async fn list_instances(
        &self,
        _: Request<ListInstancesRequest>,
    ) -> Result<Response<ListInstancesResponse>, Status> {
        let instance = |id: &str, state: InstanceState| Instance {
            spec: Some(InstanceSpec {
                service: "echo".to_string(),
                instance_id: id.to_string(),
                max_concurrency: 8,
                ..Default::default()
            }),
            state: state as i32,
            in_flight: 1,
            ..Default::default()
        };
        Ok(Response::new(ListInstancesResponse {
            instances: vec![
                instance("echo-1", InstanceState::Ready),
                instance("echo-2", InstanceState::Draining),
            ],
            revision: 1,
        }))
    }

    type WatchStream = tokio_stream::Empty<Result<WatchResponse, Status>>;

    async fn watch(&self, _: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("fixed"))
    }

    async fn list_capabilities(
        &self,
        _: Request<reach_proto::v1::ListCapabilitiesRequest>,
    ) -> Result<Response<reach_proto::v1::ListCapabilitiesResponse>, Status> {
        Err(Status::unimplemented("fixed"))
    }
}

#[tokio::test]
async fn top_reads_a_live_registry_and_admin_port() {
    let handle = reach_telemetry::metrics::install().unwrap();
    // Series as the router writes them: one instance's latency, one capability's requests.
    ::metrics::histogram!(names::ROUTER_INSTANCE_DURATION, "service" => "echo", "instance" => "echo-1")
        .record(0.002);
    ::metrics::counter!(names::ROUTER_REQUESTS, "capability" => "board.test", "code" => "OK")
        .increment(1);
    ::metrics::histogram!(names::ROUTER_REQUEST_DURATION, "capability" => "board.test", "code" => "OK")
        .record(0.002);

    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc_addr = grpc.local_addr().unwrap();
    tokio::spawn(
        reach_rpc::GrpcServer::new()
            .add_service(RegistryServiceServer::new(FixedRegistry))
            .serve(grpc, std::future::pending()),
    );
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_addr = admin.local_addr().unwrap().to_string();
    tokio::spawn(reach_telemetry::serve_admin(
        admin,
        reach_telemetry::admin_router(handle, tokio::sync::watch::channel(true).1),
        std::future::pending(),
        reach_rpc::server::DEFAULT_GRACE,
    ));

    let endpoint = format!("http://{grpc_addr}");
    let channel = tonic::transport::Endpoint::from_shared(endpoint.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut registry = RegistryServiceClient::new(channel);
    let mut board = reach::top::Board::new();
    let snapshot = reach::top::fetch(&mut board, &mut registry, &endpoint, &admin_addr, None).await;
    assert_eq!(snapshot.registry_error, None);
    assert_eq!(snapshot.metrics_error, None);
    assert_eq!(snapshot.instances.len(), 2);
    assert!(snapshot.instances[0].p99.is_some());
    assert!(
        snapshot
            .capabilities
            .iter()
            .any(|c| c.capability == "board.test")
    );
    let frame = reach::top::render_to_string(&snapshot, 120, 30);
    assert!(frame.contains("echo-2"), "{frame}");
    assert!(frame.contains("draining"), "{frame}");
    assert!(frame.contains("board.test"), "{frame}");

    // The once mode runs end to end (its frame goes to stdout).
    reach::top::run(reach::top::TopOptions {
        endpoint: endpoint.clone(),
        admin: Some(admin_addr.clone()),
        once: true,
        ..Default::default()
    })
    .await
    .unwrap();

    // An endpoint nobody serves degrades instead of failing.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody = format!("http://127.0.0.1:{port}");
    let channel = tonic::transport::Endpoint::from_shared(nobody.clone())
        .unwrap()
        .connect_lazy();
    let snapshot = reach::top::fetch(
        &mut board,
        &mut RegistryServiceClient::new(channel),
        &nobody,
        &format!("127.0.0.1:{port}"),
        None,
    )
    .await;
    assert!(snapshot.registry_error.is_some());
    assert!(snapshot.metrics_error.is_some());
}
