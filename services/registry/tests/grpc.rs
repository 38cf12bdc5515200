//! The registry over gRPC on 127.0.0.1:0: ListCapabilities pages, Watch and ListInstances
//! carry no capability descriptors, bad descriptors are refused before registering, and a
//! Watch resumes after a broken stream.

use std::collections::BTreeSet;

use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::{
    Capability, InstanceSpec, ListCapabilitiesRequest, ListInstancesRequest, RegisterRequest,
    WatchRequest, watch_response,
};
use reach_registry::{Registry, RegistryConfig, RegistryGrpc};
use tonic::transport::Channel;

async fn serve() -> (Registry, RegistryServiceClient<Channel>) {
    let (registry, client, _) = serve_at().await;
    (registry, client)
}

/// [`serve`], and the registry's URL.
async fn serve_at() -> (Registry, RegistryServiceClient<Channel>, String) {
    let registry = Registry::new(RegistryConfig {
        health_probe: false,
        ..RegistryConfig::default()
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server =
        reach_rpc::GrpcServer::new().add_service(RegistryGrpc::new(registry.clone()).into_server());
    tokio::spawn(server.serve(listener, futures::future::pending()));
    let client = RegistryServiceClient::connect(url.clone()).await.unwrap();
    (registry, client, url)
}

fn spec(id: &str, capabilities: impl IntoIterator<Item = String>) -> InstanceSpec {
    InstanceSpec {
        service: "svc.paged".into(),
        instance_id: id.into(),
        endpoint: "http://127.0.0.1:9".into(),
        capabilities: capabilities
            .into_iter()
            .map(|name| Capability {
                description: format!("what {name} does"),
                input_schema: r#"{"type":"object","properties":{"q":{"pattern":"^a+$"}}}"#.into(),
                name,
                version: "1.0.0".into(),
                output_schema: String::new(),
            })
            .collect(),
        ..Default::default()
    }
}

async fn register(client: &mut RegistryServiceClient<Channel>, spec: InstanceSpec) {
    client
        .register(RegisterRequest {
            instance: Some(spec),
            lease_ttl: None,
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_capabilities_pages_through_every_name_exactly_once() {
    let (_registry, mut client) = serve().await;
    // 3 instances × 250 capabilities, overlapping: 600 distinct names, more than a page.
    for (id, range) in [("a", 0..250), ("b", 200..450), ("c", 350..600)] {
        register(&mut client, spec(id, range.map(|i| format!("p.c{i:04}")))).await;
    }
    let page = |token: &str, size: u32| {
        let mut client = client.clone();
        let request = ListCapabilitiesRequest {
            name_prefix: "p.".into(),
            page_size: size,
            page_token: token.into(),
        };
        async move {
            client
                .list_capabilities(request)
                .await
                .unwrap()
                .into_inner()
        }
    };
    for (size, expected_pages) in [(0, 6), (7, 86), (100_000, 2)] {
        let mut names = Vec::new();
        let mut token = String::new();
        let mut pages = 0;
        loop {
            let response = page(&token, size).await;
            pages += 1;
            let limit = match size {
                0 => 100,
                s => s.min(500) as usize,
            };
            assert!(response.capabilities.len() <= limit);
            names.extend(response.capabilities.into_iter().map(|c| c.name));
            if response.next_page_token.is_empty() {
                break;
            }
            token = response.next_page_token;
        }
        assert_eq!(pages, expected_pages, "page size {size}");
        let expected: Vec<String> = (0..600).map(|i| format!("p.c{i:04}")).collect();
        assert_eq!(
            names, expected,
            "every name once, in order, at page size {size}"
        );
    }
    let first = page("", 0).await;
    assert_eq!(first.capabilities[0].description, "what p.c0000 does");
    assert_eq!(first.capabilities[0].instances, 1);
    let too_long = client
        .list_capabilities(ListCapabilitiesRequest {
            page_token: "x".repeat(300),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(too_long.code(), tonic::Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_and_list_instances_show_names_and_versions_only() {
    let (_registry, mut client) = serve().await;
    let mut watch = client
        .watch(WatchRequest::default())
        .await
        .unwrap()
        .into_inner();
    let snapshot = watch.message().await.unwrap().unwrap();
    assert!(matches!(
        snapshot.event,
        Some(watch_response::Event::Snapshot(_))
    ));
    register(
        &mut client,
        spec("a", ["d.one".to_string(), "d.two".into()]),
    )
    .await;
    let upserted = match watch.message().await.unwrap().unwrap().event {
        Some(watch_response::Event::Upserted(instance)) => instance,
        other => panic!("{other:?}"),
    };
    let listed = client
        .list_instances(ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .instances
        .remove(0);
    for instance in [upserted, listed] {
        let capabilities = instance.spec.unwrap().capabilities;
        let shown: BTreeSet<(String, String)> = capabilities
            .iter()
            .map(|c| (c.name.clone(), c.version.clone()))
            .collect();
        assert_eq!(shown.len(), 2);
        for c in &capabilities {
            assert_eq!(
                (
                    c.description.as_str(),
                    c.input_schema.as_str(),
                    c.output_schema.as_str()
                ),
                ("", "", ""),
                "{c:?}"
            );
        }
    }
    let described = client
        .list_capabilities(ListCapabilitiesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert_eq!(described.len(), 2);
    assert_eq!(described[0].description, "what d.one does");
    assert!(described[0].input_schema.contains("pattern"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_pattern_is_refused_with_its_pointer_and_a_short_status() {
    let (registry, mut client) = serve().await;
    let mut bad = spec("a", ["x.tool".to_string()]);
    let alternation: Vec<String> = (0..10_000).map(|i| format!("w{i}")).collect();
    bad.capabilities[0].input_schema = serde_json::json!({
        "type": "object",
        "properties": {"q": {"type": "string", "pattern": alternation.join("|")}},
    })
    .to_string();
    let status = client
        .register(RegisterRequest {
            instance: Some(bad),
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("at \"/properties/q/pattern\"")
            && status.message().contains("over the limit of 1024 bytes"),
        "{}",
        status.message()
    );
    assert!(status.message().len() + status.details().len() < 1500);
    assert!(registry.list("", "").instances.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_resumed_after_a_broken_stream_gets_the_missed_events_and_no_snapshot() {
    let (registry, mut client) = serve().await;
    register(&mut client, spec("a", [])).await;
    let mut first = client
        .watch(WatchRequest::default())
        .await
        .unwrap()
        .into_inner();
    let snapshot = first.message().await.unwrap().unwrap();
    assert_eq!(snapshot.epoch, registry.epoch());
    drop(first);
    // Two changes while the watcher is away.
    register(&mut client, spec("b", [])).await;
    register(&mut client, spec("c", [])).await;
    let mut resumed = client
        .watch(WatchRequest {
            after_revision: snapshot.revision,
            epoch: snapshot.epoch.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    for expected in ["b", "c"] {
        let event = resumed.message().await.unwrap().unwrap();
        match event.event {
            Some(watch_response::Event::Upserted(instance)) => {
                assert_eq!(instance.spec.unwrap().instance_id, expected);
                // The lease id stays redacted in replayed events too.
                assert!(instance.lease_id.is_empty());
            }
            other => panic!("expected the missed upsert of {expected}, got {other:?}"),
        }
    }
    // Resuming from another registry's epoch: a snapshot that says so.
    let mut other = client
        .watch(WatchRequest {
            after_revision: 1,
            epoch: "an-earlier-registry".into(),
        })
        .await
        .unwrap()
        .into_inner();
    match other.message().await.unwrap().unwrap().event {
        Some(watch_response::Event::Snapshot(snapshot)) => {
            assert_eq!(
                snapshot.cause(),
                reach_proto::v1::SnapshotCause::EpochChanged
            );
            assert_eq!(snapshot.instances.len(), 3);
        }
        other => panic!("{other:?}"),
    }
    let too_long = client
        .watch(WatchRequest {
            after_revision: 1,
            epoch: "e".repeat(200),
        })
        .await
        .unwrap_err();
    assert_eq!(too_long.code(), tonic::Code::InvalidArgument);
    assert!(
        too_long.message().contains("epoch is 200 bytes"),
        "{too_long}"
    );
}

/// The registry serves at most [`reach_registry::service::MAX_WATCHES`] Watch streams; one
/// more is RESOURCE_EXHAUSTED saying so, and a watcher that goes away frees its slot at once —
/// also in a quiet mesh, where no change would wake its stream (else closed watches could
/// lock every router out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_watches_free_their_slots_without_a_registry_change() {
    use reach_registry::service::MAX_WATCHES;
    let (_registry, client, url) = serve_at().await;
    let mut watches = Vec::with_capacity(MAX_WATCHES);
    let mut clients = Vec::new();
    for i in 0..MAX_WATCHES {
        // A connection carries a bounded number of streams: 64 watches per connection.
        if i % 64 == 0 {
            clients.push(RegistryServiceClient::connect(url.clone()).await.unwrap());
        }
        let mut stream = clients
            .last_mut()
            .unwrap()
            .watch(WatchRequest::default())
            .await
            .unwrap()
            .into_inner();
        stream.message().await.unwrap().unwrap();
        watches.push(stream);
    }
    let refused = client
        .clone()
        .watch(WatchRequest::default())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(
        refused.message().starts_with(&format!(
            "the registry serves {MAX_WATCHES} Watch streams already"
        )),
        "{}",
        refused.message()
    );
    drop(watches);
    drop(clients);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match client.clone().watch(WatchRequest::default()).await {
            Ok(_) => break,
            Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the closed watches' slots were not freed within 10 s"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(status) => panic!("{status}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_id_in_a_heartbeat_or_deregister_is_refused_without_being_echoed() {
    let (_registry, mut client) = serve().await;
    let huge = "x".repeat(1 << 20);
    let heartbeat = client
        .heartbeat(reach_proto::v1::HeartbeatRequest {
            instance_id: "a".into(),
            lease_id: huge.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    let deregister = client
        .deregister(reach_proto::v1::DeregisterRequest {
            instance_id: huge,
            lease_id: "l".into(),
        })
        .await
        .unwrap_err();
    for (status, field) in [(heartbeat, "lease_id"), (deregister, "instance_id")] {
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
        assert!(status.message().starts_with(field), "{}", status.message());
        assert!(status.message().len() < 200);
    }
}
