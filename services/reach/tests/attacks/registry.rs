//! Attacks on the registry (issue 33 items 2, 4 and 8): an agent serving only `alpha.*`
//! registers a topic or a typed gRPC service it was not granted, to receive others' publishes
//! and calls; a user or an agent reads or watches the instance table; a watcher holds every
//! Watch slot it can so routers cannot sync; an agent advertises another host's port for the
//! registry's health probe to scan.

use std::time::Duration;

use reach_proto::v1 as pb;
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use tonic::Code;

use crate::Check;
use crate::mesh::{TrustedMesh, refused};

/// An instance of `alpha` with id `id` at `endpoint`, serving `alpha.ask`.
fn alpha(id: &str, endpoint: &str) -> pb::InstanceSpec {
    pb::InstanceSpec {
        service: "alpha".into(),
        instance_id: id.into(),
        endpoint: endpoint.into(),
        capabilities: vec![pb::Capability {
            name: "alpha.ask".into(),
            version: "1.0.0".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn register(spec: pb::InstanceSpec) -> pb::RegisterRequest {
    pb::RegisterRequest {
        instance: Some(spec),
        lease_ttl: Some(reach_rpc::time::proto_duration(Duration::from_secs(5))),
    }
}

/// Runs this module's attacks against `mesh`, adding one [`Check`] per attack.
pub async fn run(mesh: &TrustedMesh, checks: &mut Vec<Check>) {
    let mut agent =
        RegistryServiceClient::new(mesh.channel(&mesh.registry_url, Some("agent-alpha")).await);

    // Item 2: serve rules govern topics and typed services.
    let mut spec = alpha("alpha-topic", "http://127.0.0.1:9");
    spec.topics = vec!["echo.news".into()];
    let result = agent.register(register(spec)).await;
    checks.push(Check::new(
        "agent alpha (serve: alpha.*) registers topic echo.news to receive its publishes",
        refused(result, Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));
    let mut spec = alpha("alpha-typed", "http://127.0.0.1:9");
    spec.grpc_services = vec!["secret.v1.Vault".into()];
    let result = agent.register(register(spec)).await;
    checks.push(Check::new(
        "agent alpha (serve: alpha.*) registers grpc_services secret.v1.Vault to receive its calls",
        refused(result, Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));
    // Control: what the rule grants, from the agent's own address, still registers.
    let granted = agent
        .register(register(alpha("alpha-granted", "http://127.0.0.1:9")))
        .await;
    checks.push(Check::new(
        "control: agent alpha registers alpha.ask at its own address",
        match granted {
            Ok(registered) => {
                let lease_id = registered.into_inner().lease_id;
                let _ = agent
                    .deregister(pb::DeregisterRequest {
                        instance_id: "alpha-granted".into(),
                        lease_id,
                    })
                    .await;
                Ok(())
            }
            Err(status) => Err(format!("refused: {status:?}")),
        },
    ));

    // Item 8: the health probe as a port scanner. The mesh runs on loopback, so the agent's
    // own machine is every loopback address; a documentation-range address (192.0.2.0/24) is
    // another host.
    let result = agent
        .register(register(alpha("alpha-scan", "http://192.0.2.7:22")))
        .await;
    checks.push(Check::new(
        "agent alpha registers endpoint http://192.0.2.7:22 (another host's SSH port) for the registry to probe",
        refused(result, Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));

    // Item 4: who reads the instance table.
    let mut mallory = RegistryServiceClient::new(
        mesh.channel_with_token(&mesh.registry_url, &mesh.token("mallory"))
            .await,
    );
    let result = mallory.watch(pb::WatchRequest::default()).await;
    checks.push(Check::new(
        "user mallory (no registry rights) opens a registry Watch",
        refused(result.map(|_| ()), Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));
    let result = mallory
        .list_instances(pb::ListInstancesRequest::default())
        .await;
    checks.push(Check::new(
        "user mallory lists the registry's instances (endpoints, states, loads)",
        refused(result.map(|_| ()), Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));
    let result = agent.watch(pb::WatchRequest::default()).await;
    checks.push(Check::new(
        "agent alpha (a certificate of the mesh CA) opens a registry Watch",
        refused(result.map(|_| ()), Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));

    // Item 4: a watcher that may watch holds every stream it can; routers still sync.
    checks.push(Check::new(
        "the operator opens Watch streams past registry.max_watches_per_identity (16), then a router watches",
        watch_flood(mesh).await,
    ));
}

/// Opens Watch streams as the operator until refused: the 17th must be RESOURCE_EXHAUSTED
/// `TOO_MANY_WATCHES`, and a router must still get a snapshot meanwhile.
async fn watch_flood(mesh: &TrustedMesh) -> Result<(), String> {
    let mut operator = RegistryServiceClient::new(
        mesh.channel(&mesh.registry_url, Some("operator-admin"))
            .await,
    );
    let mut held = Vec::new();
    for i in 0..16 {
        let stream = operator
            .watch(pb::WatchRequest::default())
            .await
            .map_err(|status| format!("watch {} of 16 refused: {status:?}", i + 1))?;
        held.push(stream.into_inner());
    }
    refused(
        operator
            .watch(pb::WatchRequest::default())
            .await
            .map(|_| ()),
        Code::ResourceExhausted,
        "TOO_MANY_WATCHES",
    )?;
    let mut router =
        RegistryServiceClient::new(mesh.channel(&mesh.registry_url, Some("router")).await);
    let mut stream = router
        .watch(pb::WatchRequest::default())
        .await
        .map_err(|status| format!("the router's watch was refused: {status:?}"))?
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .map_err(|_| "the router's watch sent no snapshot within 5 s".to_string())?
        .map_err(|status| format!("the router's watch failed: {status:?}"))?;
    match first.and_then(|event| event.event) {
        Some(pb::watch_response::Event::Snapshot(_)) => Ok(()),
        other => Err(format!(
            "the router's watch began with {other:?}, not a snapshot"
        )),
    }
}
