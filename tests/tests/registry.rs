//! Registry behaviour over gRPC: leases, heartbeats, expiry, lifecycle, Watch.

use std::time::Duration;

use reach_proto::v1::{
    Capability, DeregisterRequest, HeartbeatRequest, InstanceSpec, InstanceState,
    ListInstancesRequest, RegisterRequest, WatchRequest, watch_response,
};
use reach_rpc::GrpcServer;
use reach_tests::{Sandbox, eventually};
use tokio::net::TcpListener;
use tonic::Code;

/// An endpoint whose grpc.health.v1 reports reach.v1.AgentService SERVING (so the
/// registry's probe passes).
async fn healthy_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = GrpcServer::new();
    server
        .health_reporter()
        .set_service_status(
            "reach.v1.AgentService",
            tonic_health::ServingStatus::Serving,
        )
        .await;
    tokio::spawn(server.serve(listener, std::future::pending()));
    format!("http://{addr}")
}

/// An endpoint that serves gRPC health but not the agent service (a router, say).
async fn not_an_agent_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(GrpcServer::new().serve(listener, std::future::pending()));
    format!("http://{addr}")
}

fn spec(service: &str, id: &str, endpoint: &str) -> InstanceSpec {
    InstanceSpec {
        service: service.into(),
        instance_id: id.into(),
        endpoint: endpoint.into(),
        capabilities: vec![Capability {
            name: "echo".into(),
            version: "1.0.0".into(),
            ..Default::default()
        }],
        protocol_version: "1.0".into(),
        weight: 1,
        max_concurrency: 4,
        ..InstanceSpec::default()
    }
}

async fn state_of(sandbox: &Sandbox, id: &str) -> Option<InstanceState> {
    let list = sandbox
        .registry_client()
        .await
        .list_instances(ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner();
    list.instances
        .iter()
        .find(|i| i.spec.as_ref().unwrap().instance_id == id)
        .map(|i| i.state())
}

#[tokio::test]
async fn a_lease_is_granted_renewed_by_heartbeats_and_expires_without_them() {
    let sandbox = Sandbox::start().await;
    let mut registry = sandbox.registry_client().await;
    let endpoint = healthy_endpoint().await;
    let granted = registry
        .register(RegisterRequest {
            instance: Some(spec("svc", "svc-1", &endpoint)),
            lease_ttl: Some(reach_rpc::time::proto_duration(Duration::from_millis(400))),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        reach_rpc::time::std_duration(granted.lease_ttl.as_ref().unwrap()),
        Some(Duration::from_millis(400))
    );
    assert_eq!(granted.instance.unwrap().state(), InstanceState::Registered);

    // The health probe passes: READY.
    eventually(Duration::from_secs(3), || async {
        state_of(&sandbox, "svc-1").await == Some(InstanceState::Ready)
    })
    .await;

    // Heartbeats keep it alive well past one TTL and carry the reported state.
    for _ in 0..8 {
        let beat = registry
            .heartbeat(HeartbeatRequest {
                instance_id: "svc-1".into(),
                lease_id: granted.lease_id.clone(),
                state: InstanceState::Busy as i32,
                in_flight: 4,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(beat.state(), InstanceState::Busy);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state_of(&sandbox, "svc-1").await, Some(InstanceState::Busy));

    // Silence: the lease expires and the instance leaves.
    eventually(Duration::from_secs(3), || async {
        state_of(&sandbox, "svc-1").await.is_none()
    })
    .await;
    let late = registry
        .heartbeat(HeartbeatRequest {
            instance_id: "svc-1".into(),
            lease_id: granted.lease_id.clone(),
            state: InstanceState::Ready as i32,
            in_flight: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(late.code(), Code::NotFound);
    assert_eq!(
        reach_rpc::errors::reason_of(&late).as_deref(),
        Some("LEASE_NOT_FOUND")
    );
    sandbox.stop().await;
}

#[tokio::test]
async fn watch_sends_a_snapshot_then_deltas_with_rising_revisions() {
    let sandbox = Sandbox::start().await;
    let mut registry = sandbox.registry_client().await;
    let endpoint = healthy_endpoint().await;
    let a = registry
        .register(RegisterRequest {
            instance: Some(spec("svc", "a", &endpoint)),
            lease_ttl: None,
        })
        .await
        .unwrap()
        .into_inner();
    let mut watch = registry
        .watch(WatchRequest::default())
        .await
        .unwrap()
        .into_inner();

    let first = watch.message().await.unwrap().unwrap();
    let Some(watch_response::Event::Snapshot(snapshot)) = first.event else {
        panic!("the first watch event must be a snapshot, got {first:?}");
    };
    assert!(
        snapshot
            .instances
            .iter()
            .any(|i| i.spec.as_ref().unwrap().instance_id == "a")
    );
    let mut revision = first.revision;

    registry
        .register(RegisterRequest {
            instance: Some(spec("svc", "b", &endpoint)),
            lease_ttl: None,
        })
        .await
        .unwrap();
    registry
        .deregister(DeregisterRequest {
            instance_id: "a".into(),
            lease_id: a.lease_id,
        })
        .await
        .unwrap();

    let mut saw_b = false;
    let mut saw_a_removed = false;
    while !(saw_b && saw_a_removed) {
        let event = tokio::time::timeout(Duration::from_secs(3), watch.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(
            event.revision > revision,
            "revisions must rise: {} after {revision}",
            event.revision
        );
        revision = event.revision;
        match event.event.unwrap() {
            watch_response::Event::Upserted(i) if i.spec.as_ref().unwrap().instance_id == "b" => {
                saw_b = true
            }
            watch_response::Event::Removed(i) => {
                assert_eq!(i.spec.as_ref().unwrap().instance_id, "a");
                assert_eq!(i.state(), InstanceState::Offline);
                saw_a_removed = true;
            }
            _ => {}
        }
    }
    sandbox.stop().await;
}

#[tokio::test]
async fn a_malformed_registration_is_refused_with_the_field_to_fix() {
    let sandbox = Sandbox::start().await;
    let mut registry = sandbox.registry_client().await;
    let err = registry
        .register(RegisterRequest {
            instance: Some(spec("svc", "x", "not a url")),
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("instance.endpoint"),
        "{}",
        err.message()
    );
    // Credentials in the endpoint would be shown to everyone who lists instances.
    let err = registry
        .register(RegisterRequest {
            instance: Some(spec("svc", "x", "http://admin:hunter2@127.0.0.1:50051")),
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("no user info") && !err.message().contains("hunter2"),
        "{}",
        err.message()
    );
    let err = registry
        .register(RegisterRequest {
            instance: Some(spec("", "x", "http://127.0.0.1:1")),
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert!(
        err.message().contains("instance.service"),
        "{}",
        err.message()
    );
    sandbox.stop().await;
}

#[tokio::test]
async fn an_instance_that_fails_its_health_probe_stays_registered_and_says_why() {
    let sandbox = Sandbox::start().await;
    let mut registry = sandbox.registry_client().await;
    // A bound but never-accepting port: connections hang, the probe times out.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", silent.local_addr().unwrap());
    // A gRPC server that is not an agent (no reach.v1.AgentService health status).
    let other = not_an_agent_endpoint().await;
    // A port nothing listens on.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    for (id, endpoint) in [
        ("silent", &endpoint),
        ("not-an-agent", &other),
        ("closed", &closed),
    ] {
        let mut spec = spec("svc", id, endpoint);
        spec.capabilities = vec![Capability {
            name: "svc.work".into(),
            version: "1.0.0".into(),
            ..Capability::default()
        }];
        registry
            .register(RegisterRequest {
                instance: Some(spec),
                // Longer than the sandbox's 1 s default: the instances must outlive their
                // failing probes (the silent one takes the 1 s probe timeout) however loaded
                // the machine is.
                lease_ttl: Some(reach_rpc::time::proto_duration(Duration::from_secs(30))),
            })
            .await
            .unwrap();
    }
    let why = |id: &'static str| {
        let sandbox = &sandbox;
        async move {
            let list = sandbox
                .registry_client()
                .await
                .list_instances(ListInstancesRequest::default())
                .await
                .unwrap()
                .into_inner();
            let instance = list
                .instances
                .into_iter()
                .find(|i| i.spec.as_ref().unwrap().instance_id == id)
                .unwrap();
            (instance.state(), instance.health_probe_error)
        }
    };
    // Each probe failure is recorded with what went wrong and what to do about it.
    for (id, expected) in [
        ("silent", "no answer within 1000 ms"),
        (
            "not-an-agent",
            "NOT_FOUND: the endpoint serves grpc.health.v1 but not for reach.v1.AgentService",
        ),
        ("closed", "cannot connect"),
    ] {
        eventually(Duration::from_secs(10), || async {
            why(id).await.1.contains(expected)
        })
        .await;
        let (state, error) = why(id).await;
        assert_eq!(state, InstanceState::Registered, "{id}: {error}");
        assert!(
            error.starts_with("health probe: reach.v1.AgentService on http://127.0.0.1:"),
            "{id}: {error}"
        );
    }
    assert!(
        sandbox
            .plane
            .router()
            .unwrap()
            .table()
            .instances()
            .is_empty()
    );
    // A caller is told the capability has instances, none READY, and why.
    let err = sandbox
        .mesh()
        .await
        .call(
            "svc.work",
            reach_proto::v1::Payload::text("t", "x"),
            reach_sdk::CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(
        reach_rpc::errors::reason_of(&err).as_deref(),
        Some("ROUTE_NOT_FOUND")
    );
    let message = err.message();
    assert!(
        message.contains("instances serve it but none is READY"),
        "{message}"
    );
    assert!(
        message.contains("not-an-agent is REGISTERED (health probe: reach.v1.AgentService on"),
        "{message}"
    );
    assert!(message.contains("reach agents"), "{message}");
    let unroutable = reach_rpc::errors::metadata_of(&err)
        .get("unroutable_instances")
        .cloned()
        .unwrap_or_default();
    assert!(unroutable.contains("closed is REGISTERED"), "{unroutable}");
    sandbox.stop().await;
}

#[tokio::test]
async fn a_passing_probe_clears_the_recorded_failure() {
    let sandbox = Sandbox::start().await;
    let mut registry = sandbox.registry_client().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let server = GrpcServer::new();
    let health = server.health_reporter();
    health
        .set_service_status(
            "reach.v1.AgentService",
            tonic_health::ServingStatus::NotServing,
        )
        .await;
    tokio::spawn(server.serve(listener, std::future::pending()));
    registry
        .register(RegisterRequest {
            instance: Some(spec("svc", "late", &endpoint)),
            lease_ttl: None,
        })
        .await
        .unwrap();
    let listed = || async {
        sandbox
            .registry_client()
            .await
            .list_instances(ListInstancesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .instances
            .remove(0)
    };
    eventually(Duration::from_secs(10), || async {
        listed().await.health_probe_error.contains("NOT_SERVING")
    })
    .await;
    health
        .set_service_status(
            "reach.v1.AgentService",
            tonic_health::ServingStatus::Serving,
        )
        .await;
    eventually(Duration::from_secs(10), || async {
        listed().await.state() == InstanceState::Ready
    })
    .await;
    assert_eq!(listed().await.health_probe_error, "");
    sandbox.stop().await;
}

#[tokio::test]
async fn lease_ids_are_never_shown_to_others_and_reports_are_checked() {
    let sandbox = Sandbox::start().await;
    let mut registry = sandbox.registry_client().await;
    let endpoint = healthy_endpoint().await;
    let granted = registry
        .register(RegisterRequest {
            instance: Some(spec("svc", "private", &endpoint)),
            lease_ttl: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        !granted.lease_id.is_empty(),
        "Register returns the lease to its owner"
    );
    let list = registry
        .list_instances(ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(
        list.instances.iter().all(|i| i.lease_id.is_empty()),
        "ListInstances hides lease ids"
    );
    let mut watch = registry
        .watch(WatchRequest::default())
        .await
        .unwrap()
        .into_inner();
    let Some(watch_response::Event::Snapshot(snapshot)) =
        watch.message().await.unwrap().unwrap().event
    else {
        panic!("snapshot first");
    };
    assert!(
        snapshot.instances.iter().all(|i| i.lease_id.is_empty()),
        "Watch hides lease ids"
    );

    let offline = registry
        .heartbeat(HeartbeatRequest {
            instance_id: "private".into(),
            lease_id: granted.lease_id.clone(),
            state: InstanceState::Offline as i32,
            in_flight: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        offline.code(),
        Code::InvalidArgument,
        "an instance cannot report itself OFFLINE"
    );
    let bad_id = registry
        .register(RegisterRequest {
            instance: Some(spec("svc", "two words", &endpoint)),
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert!(
        bad_id.message().contains("instance_id"),
        "{}",
        bad_id.message()
    );
    let mut labelled = spec("svc", "labelled", &endpoint);
    labelled.labels.insert("blob".into(), "x".repeat(100_000));
    let too_big = registry
        .register(RegisterRequest {
            instance: Some(labelled),
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert!(
        too_big.message().contains("labels"),
        "{}",
        too_big.message()
    );
    sandbox.stop().await;
}

#[tokio::test]
async fn a_router_is_ready_for_probes_once_its_registry_view_has_synced() {
    use tonic_health::pb::health_check_response::ServingStatus;
    // The registry's address is chosen now; the registry starts later.
    let registry_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let registry_addr = registry_listener.local_addr().unwrap();
    drop(registry_listener);
    let mut config = reach::config::ReachConfig::default();
    config.router.registry_endpoint = format!("http://{registry_addr}");
    let router = reach::control_plane::ControlPlane::start(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        &config,
        reach::control_plane::Services {
            registry: false,
            router: true,
            orchestrator: false,
            edge: false,
        },
    )
    .await
    .unwrap();
    let channel = tonic::transport::Endpoint::from_shared(router.endpoint())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = |service: &'static str| {
        let mut health = health.clone();
        async move {
            health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap()
                .into_inner()
                .status()
        }
    };
    // The process is alive (liveness), the router not ready: it has no routes to use.
    eventually(Duration::from_secs(5), || async {
        status("").await == ServingStatus::Serving
    })
    .await;
    assert_eq!(
        status("reach.v1.RouterService").await,
        ServingStatus::NotServing
    );
    // Once the registry answers and the first snapshot is applied, it is.
    let registry = reach::control_plane::ControlPlane::start(
        TcpListener::bind(registry_addr).await.unwrap(),
        &reach::config::ReachConfig::default(),
        reach::control_plane::Services {
            registry: true,
            router: false,
            orchestrator: false,
            edge: false,
        },
    )
    .await
    .unwrap();
    eventually(Duration::from_secs(10), || async {
        status("reach.v1.RouterService").await == ServingStatus::Serving
    })
    .await;
    let _ = router.shutdown().await;
    let _ = registry.shutdown().await;
}
