//! The registry on a real etcd (started by each test on 127.0.0.1 ephemeral ports): several
//! replicas share one table, leases expire in etcd, watches resume across replicas, a
//! compacted revision yields a snapshot that says so, an unreachable etcd turns the health
//! check NOT_SERVING (and the admin port's `/ready` 503), and a dead replica's share of health probing moves to the survivors;
//! what others write under the prefix (foreign values, lease-less keys, deleted keys) fools no
//! replica, and load-only heartbeats are coalesced.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::{
    DeregisterRequest, HeartbeatRequest, InstanceSpec, InstanceState, ListInstancesRequest,
    RegisterRequest, RegisterResponse, SnapshotCause, WatchRequest, WatchResponse, watch_response,
};
use reach_registry::config::{Backend as BackendKind, EtcdConfig};
use reach_registry::{Backend, RegistryConfig, RegistryGrpc};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// An etcd server of its own, killed (SIGKILL) when dropped.
struct Etcd {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Etcd {
    /// Starts etcd, or returns `None` (skipping the test loudly) when it is not installed and
    /// this is not CI.
    async fn start() -> Option<Etcd> {
        Self::start_with(None).await
    }

    /// [`Etcd::start`] serving TLS with `tls` (directory of `ca.pem`, `server.pem`,
    /// `server-key.pem`) and requiring client certificates signed by that CA.
    async fn start_with(tls: Option<&std::path::Path>) -> Option<Etcd> {
        Self::start_with_args(tls, &[]).await
    }

    /// [`Etcd::start_with`], passing etcd `args` besides.
    async fn start_with_args(tls: Option<&std::path::Path>, args: &[&str]) -> Option<Etcd> {
        let binary = std::env::var("REACH_TEST_ETCD").unwrap_or_else(|_| "etcd".into());
        if Command::new(&binary).arg("--version").output().is_err() {
            assert!(
                std::env::var("CI").is_err(),
                "etcd is not installed but CI is set: scripts/test.sh installs etcd-server"
            );
            eprintln!(
                "\n!!!!! SKIPPING etcd test: no `{binary}` binary (apt-get install etcd-server, or set REACH_TEST_ETCD) !!!!!\n"
            );
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (free_port(), free_port());
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut command = Command::new(&binary);
        if let Some(dir) = tls {
            let file = |name: &str| dir.join(name).to_str().unwrap().to_string();
            command
                .args(["--cert-file", &file("server.pem")])
                .args(["--key-file", &file("server-key.pem")])
                .args(["--trusted-ca-file", &file("ca.pem")])
                .arg("--client-cert-auth");
        }
        let child = command
            .args(args)
            .args(["--data-dir", dir.path().to_str().unwrap()])
            .args(["--name", "test"])
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        let etcd = Etcd {
            child,
            url,
            _dir: dir,
        };
        // Healthy in about 0.1 s; bounded. Over TLS, listening is enough: the registry's
        // own start-up then checks the handshake.
        for _ in 0..200 {
            if tls.is_some() {
                if tokio::net::TcpStream::connect(("127.0.0.1", client))
                    .await
                    .is_ok()
                {
                    return Some(etcd);
                }
            } else if let Ok(mut client) = etcd_client::Client::connect([&etcd.url], None).await
                && client.status().await.is_ok()
            {
                return Some(etcd);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("etcd did not become healthy within 10 s at {}", etcd.url);
    }

    async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([&self.url], None)
            .await
            .unwrap()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy in front of etcd that a test can cut (every connection dropped, new ones
/// refused at once) and restore: etcd becomes unreachable for one replica only.
struct Proxy {
    url: String,
    cut: Arc<std::sync::atomic::AtomicBool>,
    connections: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>>,
    _accept: JoinHandle<()>,
}

impl Proxy {
    async fn to(target: &str) -> Proxy {
        let target: SocketAddr = target.trim_start_matches("http://").parse().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let connections: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (is_cut, held) = (Arc::clone(&cut), Arc::clone(&connections));
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if is_cut.load(std::sync::atomic::Ordering::SeqCst) {
                    continue; // dropped: the client sees the connection reset
                }
                held.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                }));
            }
        });
        Proxy {
            url,
            cut,
            connections,
            _accept: accept,
        }
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }

    fn restore(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A registry replica on etcd, served over gRPC on 127.0.0.1:0, with its admin port (whose
/// `/ready` follows the gRPC health) on another.
struct Replica {
    backend: Backend,
    url: String,
    admin: SocketAddr,
    stop: tokio_util::sync::CancellationToken,
}

fn etcd_config(etcd_url: &str) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![etcd_url.to_string()],
        dial_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(2),
        // etcd's floor: it answers more frequent pings with GOAWAY.
        keep_alive_interval: Duration::from_secs(5),
        keep_alive_timeout: Duration::from_secs(1),
        replica_ttl: Duration::from_secs(2),
        ..EtcdConfig::default()
    }
}

impl Replica {
    async fn start(etcd_url: &str, health_probe: bool) -> Replica {
        Self::start_with(etcd_config(etcd_url), health_probe).await
    }

    async fn start_with(etcd: EtcdConfig, health_probe: bool) -> Replica {
        let config = RegistryConfig {
            backend: BackendKind::Etcd,
            health_probe,
            etcd,
            ..RegistryConfig::default()
        };
        let backend = Backend::start(config, None)
            .await
            .expect("registry on etcd");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = reach_rpc::GrpcServer::new()
            .add_service(RegistryGrpc::with_backend(backend.clone()).into_server())
            .serving_while(
                reach_proto::v1::registry_service_server::SERVICE_NAME,
                backend.serving(),
            );
        let readiness = server.readiness();
        let stop = tokio_util::sync::CancellationToken::new();
        let stopped = stop.clone();
        tokio::spawn(server.serve(listener, async move { stopped.cancelled().await }));
        let admin_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = admin_listener.local_addr().unwrap();
        let stopped = stop.clone();
        tokio::spawn(reach_telemetry::serve_admin(
            admin_listener,
            reach_telemetry::admin_router(reach_telemetry::metrics::install().unwrap(), readiness),
            async move { stopped.cancelled().await },
            reach_rpc::server::DEFAULT_GRACE,
        ));
        Replica {
            backend,
            url,
            admin,
            stop,
        }
    }

    /// The HTTP status of `GET /ready` on the admin port.
    async fn ready(&self) -> u16 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.admin).await.unwrap();
        let request = format!(
            "GET /ready HTTP/1.1\r\nhost: {}\r\nconnection: close\r\n\r\n",
            self.admin
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
            .strip_prefix("HTTP/1.1 ")
            .and_then(|rest| rest.get(..3))
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP/1.1 response: {response}"))
    }

    async fn client(&self) -> RegistryServiceClient<Channel> {
        RegistryServiceClient::connect(self.url.clone())
            .await
            .unwrap()
    }

    async fn health(&self) -> ServingStatus {
        let channel = tonic::transport::Endpoint::from_shared(self.url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = HealthClient::new(channel);
        health
            .check(tonic_health::pb::HealthCheckRequest {
                service: reach_proto::v1::registry_service_server::SERVICE_NAME.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn spec(id: &str, endpoint: &str) -> InstanceSpec {
    InstanceSpec {
        service: "svc.etcd".into(),
        instance_id: id.into(),
        endpoint: endpoint.into(),
        ..Default::default()
    }
}

async fn register(
    client: &mut RegistryServiceClient<Channel>,
    spec: InstanceSpec,
    ttl: Duration,
) -> RegisterResponse {
    client
        .register(RegisterRequest {
            instance: Some(spec),
            lease_ttl: Some(reach_rpc::time::proto_duration(ttl)),
        })
        .await
        .unwrap()
        .into_inner()
}

async fn watch(
    client: &mut RegistryServiceClient<Channel>,
    request: WatchRequest,
) -> tonic::Streaming<WatchResponse> {
    client.watch(request).await.unwrap().into_inner()
}

async fn next(stream: &mut tonic::Streaming<WatchResponse>) -> WatchResponse {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("a watch event within 10 s")
        .unwrap()
        .expect("the watch stream stays open")
}

/// The instance id and state an upsert or removal carries (panics on a snapshot).
fn change(event: &WatchResponse) -> (&'static str, String, InstanceState) {
    match event.event.as_ref() {
        Some(watch_response::Event::Upserted(i)) => {
            ("upserted", i.spec.clone().unwrap().instance_id, i.state())
        }
        Some(watch_response::Event::Removed(i)) => {
            ("removed", i.spec.clone().unwrap().instance_id, i.state())
        }
        other => panic!("expected an upsert or removal, got {other:?}"),
    }
}

fn snapshot(event: &WatchResponse) -> (SnapshotCause, Vec<String>) {
    match event.event.as_ref() {
        Some(watch_response::Event::Snapshot(s)) => (
            s.cause(),
            s.instances
                .iter()
                .map(|i| i.spec.clone().unwrap().instance_id)
                .collect(),
        ),
        other => panic!("expected a snapshot, got {other:?}"),
    }
}

/// Polls `check` every 20 ms until it holds, for at most `limit`; returns how long it took.
async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = tokio::time::Instant::now();
    while start.elapsed() < limit {
        if check().await {
            return start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}: not within {limit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_registered_through_one_replica_is_listed_watched_renewed_and_removed_through_another()
 {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let (a, b) = (
        Replica::start(&etcd.url, false).await,
        Replica::start(&etcd.url, false).await,
    );
    let (mut client_a, mut client_b) = (a.client().await, b.client().await);
    let mut watch_b = watch(&mut client_b, WatchRequest::default()).await;
    let start = next(&mut watch_b).await;
    assert_eq!(snapshot(&start), (SnapshotCause::Start, vec![]));
    assert_eq!(
        start.epoch,
        a.backend.view().epoch(),
        "replicas on one etcd prefix share an epoch"
    );

    let registered = register(
        &mut client_a,
        spec("one", "http://127.0.0.1:9"),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(registered.lease_ttl.unwrap().seconds, 10);
    let upsert = next(&mut watch_b).await;
    assert_eq!(
        change(&upsert),
        ("upserted", "one".into(), InstanceState::Ready)
    );
    assert_eq!(
        upsert.revision,
        registered.instance.as_ref().unwrap().revision,
        "the Watch revision is the etcd revision of the write"
    );
    let listed = client_b
        .list_instances(ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.instances.len(), 1);
    assert!(
        listed.instances[0].lease_id.is_empty(),
        "lease ids stay redacted"
    );

    // A heartbeat through B renews the lease A granted and records the load.
    let beat = client_b
        .heartbeat(HeartbeatRequest {
            instance_id: "one".into(),
            lease_id: registered.lease_id.clone(),
            state: InstanceState::Busy as i32,
            in_flight: 3,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(beat.state(), InstanceState::Busy);
    let busy = next(&mut watch_b).await;
    assert_eq!(
        change(&busy),
        ("upserted", "one".into(), InstanceState::Busy)
    );
    // A's own mirror applies the write through its etcd watch (a moment after B's).
    assert!(
        a.backend
            .view()
            .applied(busy.revision, Duration::from_secs(5))
            .await
    );
    let on_a = a.backend.view().list("", "");
    assert_eq!(on_a.instances[0].in_flight, 3, "A sees B's write");

    // A wrong lease id is refused on either replica; another identity cannot take the id.
    let wrong = client_a
        .heartbeat(HeartbeatRequest {
            instance_id: "one".into(),
            lease_id: "0000000000000001.forged".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(wrong.code(), tonic::Code::NotFound, "{wrong}");

    client_b
        .deregister(DeregisterRequest {
            instance_id: "one".into(),
            lease_id: registered.lease_id.clone(),
        })
        .await
        .unwrap();
    let removed = next(&mut watch_b).await;
    assert_eq!(
        change(&removed),
        ("removed", "one".into(), InstanceState::Offline)
    );
    assert!(
        a.backend
            .view()
            .applied(removed.revision, Duration::from_secs(5))
            .await
    );
    assert!(a.backend.view().list("", "").instances.is_empty());
    let gone = client_a
        .heartbeat(HeartbeatRequest {
            instance_id: "one".into(),
            lease_id: registered.lease_id,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound, "{gone}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expiry_in_etcd_makes_the_instance_offline_on_every_replica() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let (a, b) = (
        Replica::start(&etcd.url, false).await,
        Replica::start(&etcd.url, false).await,
    );
    let (mut client_a, mut client_b) = (a.client().await, b.client().await);
    let mut watch_a = watch(&mut client_a, WatchRequest::default()).await;
    let mut watch_b = watch(&mut client_b, WatchRequest::default()).await;
    next(&mut watch_a).await;
    next(&mut watch_b).await;
    // etcd leases are whole seconds, at least etcd's minimum (1.5 s rounded up).
    let registered = register(
        &mut client_a,
        spec("short", "http://127.0.0.1:9"),
        Duration::from_millis(1500),
    )
    .await;
    let granted = registered.lease_ttl.unwrap().seconds;
    assert!((2..=3).contains(&granted), "granted {granted} s");
    for stream in [&mut watch_a, &mut watch_b] {
        assert_eq!(change(&next(stream).await).0, "upserted");
    }
    // No heartbeats: etcd expires the lease and deletes the key; both replicas say OFFLINE.
    for stream in [&mut watch_a, &mut watch_b] {
        let removed = next(stream).await;
        assert_eq!(
            change(&removed),
            ("removed", "short".into(), InstanceState::Offline)
        );
    }
    assert!(b.backend.view().list("", "").instances.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_resumed_on_another_replica_gets_exactly_the_missed_events() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let (a, b) = (
        Replica::start(&etcd.url, false).await,
        Replica::start(&etcd.url, false).await,
    );
    let (mut client_a, mut client_b) = (a.client().await, b.client().await);
    let ttl = Duration::from_secs(30);
    let x = register(&mut client_a, spec("x", "http://127.0.0.1:9"), ttl).await;
    let mut first = watch(&mut client_a, WatchRequest::default()).await;
    let seen = next(&mut first).await;
    assert_eq!(snapshot(&seen).1, vec!["x".to_string()]);
    drop(first);

    // Three changes while the watcher is away.
    let y = register(&mut client_a, spec("y", "http://127.0.0.1:9"), ttl).await;
    client_a
        .heartbeat(HeartbeatRequest {
            instance_id: "x".into(),
            lease_id: x.lease_id.clone(),
            state: InstanceState::Ready as i32,
            in_flight: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    client_a
        .deregister(DeregisterRequest {
            instance_id: "y".into(),
            lease_id: y.lease_id,
        })
        .await
        .unwrap();
    eventually(
        "B mirrors the three changes",
        Duration::from_secs(5),
        || {
            let view = b.backend.view().clone();
            async move { view.list("", "").instances.len() == 1 }
        },
    )
    .await;

    // Resumed on B: exactly the three missed events, in order, no snapshot.
    let mut resumed = watch(
        &mut client_b,
        WatchRequest {
            after_revision: seen.revision,
            epoch: seen.epoch.clone(),
        },
    )
    .await;
    let mut missed = Vec::new();
    for _ in 0..3 {
        let event = next(&mut resumed).await;
        assert_eq!(event.epoch, seen.epoch);
        missed.push(change(&event));
    }
    assert_eq!(
        missed,
        vec![
            ("upserted", "y".into(), InstanceState::Ready),
            ("upserted", "x".into(), InstanceState::Ready),
            ("removed", "y".into(), InstanceState::Offline),
        ]
    );
    // Nothing more is pending: the next event is a new change.
    register(&mut client_b, spec("z", "http://127.0.0.1:9"), ttl).await;
    assert_eq!(change(&next(&mut resumed).await).1, "z");

    // A replica started after that revision does not hold the events: a snapshot, COMPACTED.
    let c = Replica::start(&etcd.url, false).await;
    let mut late = watch(
        &mut c.client().await,
        WatchRequest {
            after_revision: seen.revision,
            epoch: seen.epoch.clone(),
        },
    )
    .await;
    let (cause, mut ids) = snapshot(&next(&mut late).await);
    ids.sort();
    assert_eq!(cause, SnapshotCause::Compacted);
    assert_eq!(ids, vec!["x".to_string(), "z".to_string()]);

    // The table wiped (etcd recreated, or the prefix deleted): a new epoch, so a watcher
    // resuming from the old one is sent a snapshot that says so, not a gap.
    etcd.client()
        .await
        .delete(
            "/reach/registry/",
            Some(etcd_client::DeleteOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let d = Replica::start(&etcd.url, false).await;
    assert_ne!(d.backend.view().epoch(), seen.epoch);
    let mut wiped = watch(
        &mut d.client().await,
        WatchRequest {
            after_revision: seen.revision,
            epoch: seen.epoch,
        },
    )
    .await;
    assert_eq!(
        snapshot(&next(&mut wiped).await),
        (SnapshotCause::EpochChanged, vec![])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_unreachable_turns_health_not_serving_and_a_compacted_revision_yields_a_snapshot() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let proxy = Proxy::to(&etcd.url).await;
    let a = Replica::start(&proxy.url, false).await;
    let mut client_a = a.client().await;
    let ttl = Duration::from_secs(30);
    register(&mut client_a, spec("kept", "http://127.0.0.1:9"), ttl).await;
    let mut watcher = watch(&mut client_a, WatchRequest::default()).await;
    assert_eq!(
        snapshot(&next(&mut watcher).await).1,
        vec!["kept".to_string()]
    );
    assert_eq!(a.health().await, ServingStatus::Serving);
    eventually("A's /ready answers 200", Duration::from_secs(5), || async {
        a.ready().await == 200
    })
    .await;

    // etcd unreachable from A: NOT_SERVING, while A keeps serving its last view.
    proxy.cut();
    let took = eventually("A reports NOT_SERVING", Duration::from_secs(10), || async {
        a.health().await == ServingStatus::NotServing
    })
    .await;
    eprintln!(
        "NOT_SERVING {} ms after etcd became unreachable",
        took.as_millis()
    );
    // The admin port's /ready says what the gRPC health says (HTTPS probes, L4 checks).
    eventually("A's /ready answers 503", Duration::from_secs(5), || async {
        a.ready().await == 503
    })
    .await;
    assert_eq!(a.backend.view().list("", "").instances.len(), 1);
    let refused = tokio::time::timeout(Duration::from_secs(10), async {
        client_a
            .register(RegisterRequest {
                instance: Some(spec("lost", "http://127.0.0.1:9")),
                lease_ttl: None,
            })
            .await
    })
    .await
    .expect("a register answers within the request timeout")
    .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused}");

    // Meanwhile another writer changes the table and etcd compacts those revisions.
    let mut direct = etcd.client().await;
    let b = Replica::start(&etcd.url, false).await;
    register(
        &mut b.client().await,
        spec("new", "http://127.0.0.1:9"),
        ttl,
    )
    .await;
    let revision = direct.status().await.unwrap().header().unwrap().revision();
    direct.compact(revision, None).await.unwrap();

    // Reachable again: A reads the table afresh and says why in the open stream.
    proxy.restore();
    let event = next(&mut watcher).await;
    let (cause, mut ids) = snapshot(&event);
    ids.sort();
    assert_eq!(cause, SnapshotCause::Compacted);
    assert_eq!(ids, vec!["kept".to_string(), "new".to_string()]);
    eventually(
        "A reports SERVING again",
        Duration::from_secs(10),
        || async { a.health().await == ServingStatus::Serving },
    )
    .await;
    eventually(
        "A's /ready answers 200 again",
        Duration::from_secs(5),
        || async { a.ready().await == 200 },
    )
    .await;
}

/// A `grpc.health.v1` server for the probed instances, NOT_SERVING until `serve()`.
async fn agent_health() -> (String, tonic_health::server::HealthReporter) {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(
            "reach.v1.AgentService",
            tonic_health::ServingStatus::NotServing,
        )
        .await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (url, reporter)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probing_is_split_between_replicas_and_a_dead_replicas_share_moves_to_the_survivor() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let (endpoint, health) = agent_health().await;
    let a = Replica::start(&etcd.url, true).await;
    let b = Replica::start(&etcd.url, true).await;
    let (id_a, id_b) = match (&a.backend, &b.backend) {
        (Backend::Etcd(a), Backend::Etcd(b)) => {
            (a.replica_id().to_string(), b.replica_id().to_string())
        }
        _ => unreachable!("etcd replicas"),
    };
    eventually(
        "each replica sees the other",
        Duration::from_secs(5),
        || {
            let (a, b) = (a.backend.clone(), b.backend.clone());
            async move {
                match (&a, &b) {
                    (Backend::Etcd(a), Backend::Etcd(b)) => {
                        a.replicas().len() == 2 && b.replicas().len() == 2
                    }
                    _ => false,
                }
            }
        },
    )
    .await;
    let ids: Vec<String> = (0..16).map(|i| format!("probed-{i}")).collect();
    let share_a = ids
        .iter()
        .filter(|id| {
            reach_registry::etcd::prober_of([id_a.as_str(), id_b.as_str()], id)
                == Some(id_a.as_str())
        })
        .count();
    assert!(
        (1..16).contains(&share_a),
        "16 instances split between two replicas, {share_a} to A"
    );
    let mut client_b = b.client().await;
    for id in &ids {
        register(&mut client_b, spec(id, &endpoint), LEASE_TTL).await;
    }
    // Both replicas probe their share: every instance records why it is not READY yet.
    eventually(
        "every instance records its failed probe",
        Duration::from_secs(10),
        || {
            let view = b.backend.view().clone();
            async move {
                let listed = view.list("", "").instances;
                listed.len() == 16
                    && listed.iter().all(|i| {
                        i.state() == InstanceState::Registered
                            && i.health_probe_error.contains("NOT_SERVING")
                    })
            }
        },
    )
    .await;

    // A dies without revoking anything (as SIGKILL would leave it): its replica key expires
    // after replica_ttl (2 s), and B takes over A's share.
    match &a.backend {
        Backend::Etcd(a) => a.abandon(),
        _ => unreachable!(),
    }
    drop(a);
    health
        .set_service_status(
            "reach.v1.AgentService",
            tonic_health::ServingStatus::Serving,
        )
        .await;
    // Within one instance lease TTL, as a router would notice an instance gone.
    let took = eventually(
        "every instance READY, A's share probed by B",
        LEASE_TTL,
        || {
            let view = b.backend.view().clone();
            async move {
                view.list("", "")
                    .instances
                    .iter()
                    .all(|i| i.state() == InstanceState::Ready)
            }
        },
    )
    .await;
    eprintln!(
        "all 16 READY {} ms after A died (replica TTL 2 s)",
        took.as_millis()
    );
}

/// The instance lease TTL of the probing test: a dead replica's share moves within it.
const LEASE_TTL: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_etcd_works_with_a_client_certificate_and_is_refused_at_start_up_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let ca =
        reach_trust::issue::CertificateAuthority::generate("etcd.test", Duration::from_secs(3600))
            .unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
    write("ca.pem", ca.cert_pem());
    for (who, path) in [("server", "/etcd"), ("client", "/registry")] {
        let identity = reach_trust::Identity::parse(&format!("spiffe://etcd.test{path}")).unwrap();
        let issued = ca.issue(&identity, &[], Duration::from_secs(3600)).unwrap();
        write(&format!("{who}.pem"), &issued.cert_pem);
        write(&format!("{who}-key.pem"), &issued.key_pem);
    }
    let Some(etcd) = Etcd::start_with(Some(dir.path())).await else {
        return;
    };
    let file = |name: &str| dir.path().join(name);
    let tls = |client_cert: bool| reach_registry::config::EtcdTls {
        ca: file("ca.pem"),
        cert: client_cert.then(|| file("client.pem")),
        key: client_cert.then(|| file("client-key.pem")),
        domain: None,
    };

    let replica = Replica::start_with(
        EtcdConfig {
            tls: Some(tls(true)),
            ..etcd_config(&etcd.url)
        },
        false,
    )
    .await;
    let mut client = replica.client().await;
    register(
        &mut client,
        spec("over-tls", "http://127.0.0.1:9"),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(replica.backend.view().list("", "").instances.len(), 1);
    assert_eq!(replica.health().await, ServingStatus::Serving);

    // etcd asks for a client certificate: without one, the registry does not start, and
    // says where it tried and what to check.
    let refused = Backend::start(
        RegistryConfig {
            backend: BackendKind::Etcd,
            etcd: EtcdConfig {
                tls: Some(tls(false)),
                ..etcd_config(&etcd.url)
            },
            ..RegistryConfig::default()
        },
        None,
    )
    .await
    .err()
    .expect("refused without a client certificate")
    .to_string();
    assert!(
        refused.contains(&format!("cannot use etcd at {}", etcd.url))
            && refused.contains("registry.etcd.tls"),
        "{refused}"
    );
}

const INSTANCES: &str = "/reach/registry/instances/";

/// Values under `instances/` the registry did not write (garbage, another instance's value
/// copied under a key of its own, a key on no lease) are not instances: the mirror shows
/// none of them, and a registration of such an id overwrites the value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_in_etcd_the_registry_did_not_write_are_not_instances_and_block_no_id() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let a = Replica::start(&etcd.url, false).await;
    let mut client = a.client().await;
    let mut raw = etcd.client().await;
    let real = register(
        &mut client,
        spec("real", "http://127.0.0.1:9"),
        Duration::from_secs(30),
    )
    .await;
    let value = raw
        .get(format!("{INSTANCES}real"), None)
        .await
        .unwrap()
        .kvs()[0]
        .value()
        .to_vec();
    client
        .deregister(DeregisterRequest {
            instance_id: "real".into(),
            lease_id: real.lease_id,
        })
        .await
        .unwrap();
    // A copy of "real" under another key (on no lease: it would never expire) and garbage.
    raw.put(format!("{INSTANCES}ghost"), value, None)
        .await
        .unwrap();
    let garbage = raw
        .put(
            format!("{INSTANCES}blocked"),
            b"not protobuf \xff".to_vec(),
            None,
        )
        .await
        .unwrap();
    let revision = garbage.header().unwrap().revision().cast_unsigned();
    assert!(
        a.backend
            .view()
            .applied(revision, Duration::from_secs(5))
            .await
    );
    assert!(
        a.backend.view().list("", "").instances.is_empty(),
        "no ghost of a copied value: {:?}",
        a.backend.view().list("", "").instances
    );

    // The id under garbage registers (the value is overwritten), at the first try.
    let blocked = register(
        &mut client,
        spec("blocked", "http://127.0.0.1:9"),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        blocked.instance.unwrap().spec.unwrap().instance_id,
        "blocked"
    );
    let mut watch = watch(&mut client, WatchRequest::default()).await;
    assert_eq!(
        snapshot(&next(&mut watch).await),
        (SnapshotCause::Start, vec!["blocked".to_string()])
    );
    // Garbage written over a live instance: it leaves every view.
    raw.put(format!("{INSTANCES}blocked"), b"\x00\x01".to_vec(), None)
        .await
        .unwrap();
    assert_eq!(
        change(&next(&mut watch).await),
        ("removed", "blocked".into(), InstanceState::Offline)
    );
}

/// Heartbeats that change the load or flip the state are written to etcd at most about once
/// a second (a chatty agent cannot grow etcd's history), DRAINING at once, and the lease's
/// deadline is etcd's: listings leave `lease_expires_at` unset rather than stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_writes_are_coalesced_and_draining_is_written_at_once() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let a = Replica::start(&etcd.url, false).await;
    let mut client = a.client().await;
    let mut raw = etcd.client().await;
    let registered = register(
        &mut client,
        spec("chatty", "http://127.0.0.1:9"),
        Duration::from_secs(30),
    )
    .await;
    let beat = |state: InstanceState, in_flight: u32| HeartbeatRequest {
        instance_id: "chatty".into(),
        lease_id: registered.lease_id.clone(),
        state: state as i32,
        in_flight,
        ..Default::default()
    };
    let started = tokio::time::Instant::now();
    for in_flight in 1..=30 {
        let state = if in_flight % 2 == 0 {
            InstanceState::Busy
        } else {
            InstanceState::Ready
        };
        let answer = client
            .heartbeat(beat(state, in_flight))
            .await
            .unwrap()
            .into_inner();
        assert!(
            answer.lease_expires_at.is_some(),
            "a heartbeat says when the lease ends"
        );
    }
    let elapsed = started.elapsed();
    let version = |raw: &mut etcd_client::Client| {
        let mut raw = raw.clone();
        async move {
            raw.get(format!("{INSTANCES}chatty"), None)
                .await
                .unwrap()
                .kvs()[0]
                .version()
        }
    };
    // The registration, then one load write per started second at most.
    let writes = version(&mut raw).await;
    let allowed = 2 + i64::try_from(elapsed.as_secs()).unwrap();
    assert!(
        writes <= allowed,
        "30 heartbeats flipping state and load in {elapsed:?} wrote the value {writes} times (at most {allowed})"
    );

    // DRAINING is written by the heartbeat that reports it.
    let before = version(&mut raw).await;
    client
        .heartbeat(beat(InstanceState::Draining, 30))
        .await
        .unwrap();
    assert_eq!(version(&mut raw).await, before + 1);
    let listed = client
        .list_instances(ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .instances;
    assert_eq!(listed[0].state(), InstanceState::Draining);
    assert!(
        listed[0].lease_expires_at.is_none(),
        "etcd holds the lease's deadline: {:?}",
        listed[0].lease_expires_at
    );

    // The last load reported is written once the interval has passed.
    eventually("the last load is written", Duration::from_secs(5), || {
        let mut client = client.clone();
        let beat = beat(InstanceState::Draining, 77);
        let view = a.backend.view().clone();
        async move {
            client.heartbeat(beat).await.unwrap();
            view.list("", "").instances[0].in_flight == 77
        }
    })
    .await;
}

/// A key under `replicas/` on no lease is not a live replica (it would outlive any), and a
/// replica whose own key was deleted puts it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_keys_on_no_lease_do_not_count_and_a_deleted_own_key_comes_back() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let mut raw = etcd.client().await;
    raw.put("/reach/registry/replicas/forged-early", Vec::new(), None)
        .await
        .unwrap();
    let a = Replica::start(&etcd.url, false).await;
    let Backend::Etcd(registry) = &a.backend else {
        unreachable!("an etcd replica")
    };
    let id = registry.replica_id().to_string();
    assert_eq!(registry.replicas(), vec![id.clone()], "read at start-up");
    let forged = raw
        .put("/reach/registry/replicas/forged-late", Vec::new(), None)
        .await
        .unwrap();
    assert!(
        a.backend
            .view()
            .applied(
                forged.header().unwrap().revision().cast_unsigned(),
                Duration::from_secs(5)
            )
            .await
    );
    assert_eq!(registry.replicas(), vec![id.clone()], "seen in the watch");

    let key = format!("/reach/registry/replicas/{id}");
    raw.delete(key.clone(), None).await.unwrap();
    eventually("the replica's key is back", Duration::from_secs(5), || {
        let mut raw = raw.clone();
        let key = key.clone();
        async move {
            raw.get(key, None)
                .await
                .unwrap()
                .kvs()
                .first()
                .is_some_and(|kv| kv.lease() != 0)
        }
    })
    .await;
}

/// An instance larger than the etcd cluster takes in one request (its `--max-request-bytes`)
/// is refused INVALID_ARGUMENT, saying what to shorten, not UNAVAILABLE (which agents retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_larger_than_etcd_takes_is_invalid_not_unavailable() {
    let Some(etcd) = Etcd::start_with_args(None, &["--max-request-bytes", "4096"]).await else {
        return;
    };
    let a = Replica::start(&etcd.url, false).await;
    let mut client = a.client().await;
    let mut large = spec("large", "http://127.0.0.1:9");
    large.labels = [("note".to_string(), "x".repeat(15 * 1024))].into();
    let Err(refused) = client
        .register(RegisterRequest {
            instance: Some(large),
            lease_ttl: None,
        })
        .await
    else {
        panic!("a 15 KiB instance was written to an etcd that takes 4 KiB requests");
    };
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    assert!(
        refused.message().contains("--max-request-bytes"),
        "{}",
        refused.message()
    );
    assert!(a.backend.view().list("", "").instances.is_empty());
}

/// Several members in `registry.etcd.endpoints`: a replica starts while the first one is
/// down, and when the member it talks to stops answering it moves to another, staying
/// SERVING and taking registrations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_starts_past_a_dead_member_and_moves_to_another_when_its_member_dies() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    // Two routes to the one etcd stand for two members; a port with nothing on it, a third.
    let (first, second) = (Proxy::to(&etcd.url).await, Proxy::to(&etcd.url).await);
    let dead = format!("http://127.0.0.1:{}", free_port());
    let config = EtcdConfig {
        endpoints: vec![dead, first.url.clone(), second.url.clone()],
        ..etcd_config(&etcd.url)
    };
    let a = Replica::start_with(config, false).await;
    let mut client = a.client().await;
    let ttl = Duration::from_secs(30);
    register(&mut client, spec("before", "http://127.0.0.1:9"), ttl).await;
    first.cut();
    eventually(
        "registrations succeed through the other member",
        Duration::from_secs(10),
        || {
            let mut client = client.clone();
            async move {
                client
                    .register(RegisterRequest {
                        instance: Some(spec("after", "http://127.0.0.1:9")),
                        lease_ttl: Some(reach_rpc::time::proto_duration(ttl)),
                    })
                    .await
                    .is_ok()
            }
        },
    )
    .await;
    eventually("SERVING again", Duration::from_secs(10), || async {
        a.health().await == ServingStatus::Serving
    })
    .await;
    let mut ids: Vec<String> = a
        .backend
        .view()
        .list("", "")
        .instances
        .iter()
        .map(|i| i.spec.clone().unwrap().instance_id)
        .collect();
    ids.sort();
    assert_eq!(ids, ["after", "before"]);
}

/// A table larger than one etcd answer can carry (4 MiB) is read in pages: a replica starts
/// on it and holds every instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_starts_on_a_table_larger_than_one_etcd_answer() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let a = Replica::start(&etcd.url, false).await;
    let mut client = a.client().await;
    let count = 90;
    for i in 0..count {
        let mut wide = spec(&format!("wide-{i}"), "http://127.0.0.1:9");
        // About 58 KiB each, within every bound: 90 of them are about 5 MiB.
        wide.labels = [("note".to_string(), "x".repeat(15 * 1024))].into();
        wide.grpc_services = (0..170)
            .map(|s| format!("svc{s}.{}", "s".repeat(240)))
            .collect();
        register(&mut client, wide, Duration::from_secs(60)).await;
    }
    let b = Replica::start(&etcd.url, false).await;
    assert_eq!(b.backend.view().list("", "").instances.len(), count);
}

/// A one-time join token's use is recorded in etcd: a second replica refuses it too, and a
/// released claim (its registration failed) can be made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_time_token_used_through_one_replica_is_used_on_every_replica() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let (a, b) = (
        Replica::start(&etcd.url, false).await,
        Replica::start(&etcd.url, false).await,
    );
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 300;
    assert!(a.backend.claim_token("jti-1", exp).await.unwrap());
    assert!(!b.backend.claim_token("jti-1", exp).await.unwrap());
    assert!(!a.backend.claim_token("jti-1", exp).await.unwrap());
    a.backend.release_token("jti-1").await;
    assert!(b.backend.claim_token("jti-1", exp).await.unwrap());
    // The record ends with the token: its key is on a lease.
    let record = etcd
        .client()
        .await
        .get("/reach/registry/tokens/jti-1", None)
        .await
        .unwrap();
    assert_ne!(record.kvs()[0].lease(), 0);
}
