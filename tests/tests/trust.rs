//! Trust across services, on a real control plane (registry, router, orchestrator) and admin
//! port on 127.0.0.1 serving TLS with certificates made here: agents register only as their
//! own service and never over another identity's instance; a one-time join token registers
//! once; only an instance's owner (or an operator) renews or removes it; a task is resumed or
//! cancelled only by its starter or an operator (another caller gets the unknown-id answer),
//! and ListTasks shows each caller its own; the admin API is for operators except `/health`
//! and `/metrics`; an SDK agent serving TLS answers only routers (and the registry's health
//! checks), and a handler's panic reaches callers only as an error id.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use reach::config::ReachConfig;
use reach::control_plane::{ControlPlane, Services};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_trust::issue::CertificateAuthority;
use reach_trust::tls::{ClientAuth, TlsConfig, TlsSource};
use reach_trust::token::{JoinGrant, JwtConfig};
use reach_trust::{Identity, TrustConfig};
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::StatusExt;

const DAY: Duration = Duration::from_secs(86_400);
const TD: &str = "reach.test";

/// Agents may register anything and start tasks; tasks are otherwise their starters' and
/// operators'.
const POLICY: &str = r#"
serve:
  - identities: ["*"]
    capabilities: ["*"]
call:
  - identities: ["*"]
    capabilities: ["*"]
    services: ["*"]
tasks:
  - identities: ["spiffe://reach.test/agent/*"]
    flows: ["*"]
    actions: ["start"]
"#;

const FLOW: &str = r"
id: approve
version: 1
initial: ask
states:
  ask: {type: human, timeout: 1h, next: done}
  done: {type: succeed}
";

/// A control plane with TLS (client certificates optional, so bearer tokens work too), a
/// token key and [`POLICY`], and the CA to issue callers' certificates.
struct Mesh {
    dir: tempfile::TempDir,
    ca: CertificateAuthority,
    token_key: String,
    plane: ControlPlane,
}

impl Mesh {
    async fn start() -> Self {
        Self::start_probing(false).await
    }

    /// [`Mesh::start`], the registry probing instances' health when `probe`.
    async fn start_probing(probe: bool) -> Self {
        Self::start_with(probe, POLICY).await
    }

    /// [`Mesh::start_probing`] with `policy` (YAML) instead of [`POLICY`].
    async fn start_with(probe: bool, policy: &str) -> Self {
        Self::start_as(probe, policy, "registry").await
    }

    /// [`Mesh::start_with`], the control plane presenting `spiffe://reach.test/<plane>`.
    async fn start_as(probe: bool, policy: &str, plane: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = CertificateAuthority::generate(TD, DAY).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.cert_pem()).unwrap();
        let mut tls = write_identity(
            &ca,
            dir.path(),
            "plane",
            &Identity::service(TD, plane).unwrap(),
        );
        tls.client_auth = ClientAuth::Optional;
        let (token_key, public) = reach_trust::issue::token_signing_key().unwrap();
        std::fs::write(dir.path().join("jwt.pem"), public).unwrap();
        std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
        let mut config = ReachConfig::default();
        config.registry.health_probe = probe;
        config.registry.default_lease_ttl = Duration::from_secs(30);
        config.orchestrator.store_url =
            format!("sqlite://{}", dir.path().join("orchestrator.db").display());
        // The webhooks made here point at 127.0.0.1.
        config.orchestrator.webhook_allowed_networks = vec!["127.0.0.0/8".parse().unwrap()];
        config.trust = TrustConfig {
            trust_domain: TD.into(),
            policy: Some(dir.path().join("policy.yaml")),
            tls: Some(tls),
            jwt: Some(JwtConfig::new(vec![dir.path().join("jwt.pem")])),
            ..TrustConfig::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let plane = ControlPlane::start(listener, &config, Services::ALL)
            .await
            .expect("control plane starts with trust");
        Self {
            dir,
            ca,
            token_key,
            plane,
        }
    }

    /// A TLS source presenting a certificate for `identity`.
    fn source(&self, name: &str, identity: &Identity) -> Arc<TlsSource> {
        TlsSource::load(
            &write_identity(&self.ca, self.dir.path(), name, identity),
            TD,
        )
        .unwrap()
    }

    /// A TLS source trusting the CA, presenting no certificate.
    fn anonymous_source(&self) -> Arc<TlsSource> {
        let config = TlsConfig {
            cert: None,
            key: None,
            ..TlsConfig::new("", "", self.dir.path().join("ca.pem"))
        };
        TlsSource::load(&config, TD).unwrap()
    }

    /// A channel to the control plane presenting a certificate for `identity`.
    async fn channel_as(&self, name: &str, identity: &Identity) -> Channel {
        let endpoint = reach_rpc::http2::endpoint(self.plane.endpoint()).unwrap();
        reach_rpc::http2::channel(&endpoint, Some(&self.source(name, identity)), None)
            .await
            .expect("TLS channel to the control plane")
    }

    /// A channel to the control plane without a client certificate.
    async fn anonymous_channel(&self) -> Channel {
        let endpoint = reach_rpc::http2::endpoint(self.plane.endpoint()).unwrap();
        reach_rpc::http2::channel(&endpoint, Some(&self.anonymous_source()), None)
            .await
            .expect("TLS channel to the control plane")
    }

    /// A bearer token signed with the mesh's key for `claims`.
    fn token(&self, claims: serde_json::Map<String, serde_json::Value>) -> String {
        reach_trust::token::sign(self.token_key.as_bytes(), &claims.into()).unwrap()
    }

    /// An operator's bearer token.
    fn operator_token(&self) -> String {
        self.token(reach_trust::token::claims(
            Identity::operator(TD, "alice").unwrap().as_str(),
            "reach",
            None,
            Duration::from_secs(300),
        ))
    }

    /// A one-time join token for `service`.
    fn join_token(&self, service: &str) -> String {
        self.token(reach_trust::token::join_claims(
            TD,
            &JoinGrant {
                services: vec![service.into()],
                one_time: true,
            },
            "reach",
            None,
            Duration::from_secs(300),
        ))
    }
}

fn write_identity(ca: &CertificateAuthority, dir: &Path, name: &str, id: &Identity) -> TlsConfig {
    let issued = ca.issue(id, &[], DAY).unwrap();
    let (cert, key): (PathBuf, PathBuf) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}-key.pem")),
    );
    std::fs::write(&cert, issued.cert_pem).unwrap();
    std::fs::write(&key, issued.key_pem).unwrap();
    TlsConfig::new(cert, key, dir.join("ca.pem"))
}

fn agent(service: &str) -> Identity {
    Identity::agent(TD, service).unwrap()
}

/// Sends `authorization: Bearer <token>` with every call.
fn bearer(
    token: String,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, Status> + Clone {
    move |mut request: tonic::Request<()>| {
        request.metadata_mut().insert(
            "authorization",
            format!("Bearer {token}").parse().expect("ascii token"),
        );
        Ok(request)
    }
}

fn register_request(service: &str, instance: &str) -> pb::RegisterRequest {
    pb::RegisterRequest {
        instance: Some(pb::InstanceSpec {
            service: service.into(),
            instance_id: instance.into(),
            endpoint: "http://127.0.0.1:9".into(),
            protocol_version: "1.0".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Asserts `status` is PERMISSION_DENIED with ErrorInfo NOT_AUTHORIZED, and returns its
/// metadata.
fn not_authorized(status: &Status) -> HashMap<String, String> {
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let info = status
        .get_error_details()
        .error_info()
        .cloned()
        .expect("an ErrorInfo");
    assert_eq!(info.reason, "NOT_AUTHORIZED");
    assert_eq!(info.domain, reach_trust::ERROR_DOMAIN);
    info.metadata
}

/// Asserts `status` is the answer to an unknown task id (NOT_FOUND, TASK_NOT_FOUND) naming no
/// identity: what a caller gets for a task it may not view.
fn hidden(status: &Status) {
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    let info = status
        .get_error_details()
        .error_info()
        .cloned()
        .expect("an ErrorInfo");
    assert_eq!(info.reason, "TASK_NOT_FOUND", "{status:?}");
    assert!(!status.message().contains("spiffe://"), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_registers_only_as_its_own_service_and_never_over_another_identity() {
    let mesh = Mesh::start().await;
    let mut a = RegistryServiceClient::new(mesh.channel_as("a", &agent("a")).await);

    // A certificate for service a registers as a, not as b.
    let denied = a.register(register_request("b", "b-1")).await.unwrap_err();
    let metadata = not_authorized(&denied);
    assert_eq!(metadata["identity"], "spiffe://reach.test/agent/a");
    assert_eq!(metadata["action"], "register as");
    assert_eq!(metadata["target"], "service \"b\"");
    assert!(
        denied
            .message()
            .contains("its certificate names service \"a\""),
        "{}",
        denied.message()
    );
    let lease = a
        .register(register_request("a", "a-1"))
        .await
        .expect("a registers as a")
        .into_inner()
        .lease_id;
    assert!(!lease.is_empty());

    // An impostor with a valid credential for service a (a join token) cannot take the
    // instance id over while its lease lives.
    let mut impostor = RegistryServiceClient::with_interceptor(
        mesh.anonymous_channel().await,
        bearer(mesh.join_token("a")),
    );
    let denied = impostor
        .register(register_request("a", "a-1"))
        .await
        .unwrap_err();
    let metadata = not_authorized(&denied);
    assert!(metadata["identity"].starts_with("spiffe://reach.test/join/"));
    assert_eq!(metadata["target"], "instance \"a-1\"");
    assert!(
        denied
            .message()
            .contains("registered by spiffe://reach.test/agent/a"),
        "{}",
        denied.message()
    );
    // Nor can another agent, with an instance id of its own service's name space.
    let mut b = RegistryServiceClient::new(mesh.channel_as("b", &agent("b")).await);
    not_authorized(&b.register(register_request("b", "a-1")).await.unwrap_err());
    // The instance is still a's, on its lease (an operator lists it: agents may not list the
    // registry); a registering it again is fine.
    let mut operator = RegistryServiceClient::with_interceptor(
        mesh.anonymous_channel().await,
        bearer(mesh.operator_token()),
    );
    let listed = operator
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let instance = listed
        .instances
        .iter()
        .find(|i| i.spec.as_ref().is_some_and(|s| s.instance_id == "a-1"))
        .expect("a-1 listed");
    assert_eq!(instance.spec.as_ref().unwrap().service, "a");
    assert!(instance.lease_id.is_empty(), "lease ids are never listed");
    a.register(register_request("a", "a-1"))
        .await
        .expect("the owner registers its instance again");
    mesh.plane.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_time_join_token_registers_once() {
    let mesh = Mesh::start().await;
    let token = mesh.join_token("classifier");
    let mut client = RegistryServiceClient::with_interceptor(
        mesh.anonymous_channel().await,
        bearer(token.clone()),
    );
    let lease = client
        .register(register_request("classifier", "c-1"))
        .await
        .expect("the join token registers once")
        .into_inner()
        .lease_id;
    // The instance keeps its lease with the lease id alone (the token was one-time).
    let mut no_token = RegistryServiceClient::new(mesh.anonymous_channel().await);
    no_token
        .heartbeat(reach_proto::v1::HeartbeatRequest {
            instance_id: "c-1".into(),
            lease_id: lease.clone(),
            ..Default::default()
        })
        .await
        .expect("a token-joined instance heartbeats with its lease id");
    let status = no_token
        .heartbeat(reach_proto::v1::HeartbeatRequest {
            instance_id: "c-1".into(),
            lease_id: "not-the-lease".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_ne!(status.code(), Code::Ok);
    // Not as another service.
    not_authorized(
        &client
            .register(register_request("ingest", "i-1"))
            .await
            .unwrap_err(),
    );
    // Not a second time, even another instance.
    let denied = client
        .register(register_request("classifier", "c-2"))
        .await
        .unwrap_err();
    not_authorized(&denied);
    assert!(
        denied.message().contains("used already"),
        "{}",
        denied.message()
    );
    // A bad token is UNAUTHENTICATED.
    let mut forged = RegistryServiceClient::with_interceptor(
        mesh.anonymous_channel().await,
        bearer(format!("{token}x")),
    );
    let status = forged
        .register(register_request("classifier", "c-3"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    mesh.plane.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_or_an_operator_renews_or_removes_an_instance() {
    let mesh = Mesh::start().await;
    let mut a = RegistryServiceClient::new(mesh.channel_as("a", &agent("a")).await);
    let lease = a
        .register(register_request("a", "a-1"))
        .await
        .unwrap()
        .into_inner()
        .lease_id;
    let heartbeat = |lease: &str| pb::HeartbeatRequest {
        instance_id: "a-1".into(),
        lease_id: lease.into(),
        ..Default::default()
    };
    let deregister = |lease: &str| pb::DeregisterRequest {
        instance_id: "a-1".into(),
        lease_id: lease.into(),
    };

    // Another identity holding the lease id is refused.
    let mut b = RegistryServiceClient::new(mesh.channel_as("b", &agent("b")).await);
    let metadata = not_authorized(&b.heartbeat(heartbeat(&lease)).await.unwrap_err());
    assert_eq!(metadata["action"], "heartbeat");
    assert_eq!(metadata["target"], "instance \"a-1\"");
    let metadata = not_authorized(&b.deregister(deregister(&lease)).await.unwrap_err());
    assert_eq!(metadata["action"], "deregister");
    // The owner needs the right lease id too.
    assert_eq!(
        a.heartbeat(heartbeat("not-the-lease"))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    a.heartbeat(heartbeat(&lease))
        .await
        .expect("the owner renews");
    // An operator may remove it.
    let mut operator = RegistryServiceClient::with_interceptor(
        mesh.anonymous_channel().await,
        bearer(mesh.operator_token()),
    );
    operator
        .deregister(deregister(&lease))
        .await
        .expect("an operator deregisters");
    assert_eq!(
        a.heartbeat(heartbeat(&lease)).await.unwrap_err().code(),
        Code::NotFound
    );
    mesh.plane.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_its_starters_and_operators() {
    let mesh = Mesh::start().await;
    let operator_token = mesh.operator_token();
    let mut operator = OrchestratorServiceClient::with_interceptor(
        mesh.anonymous_channel().await,
        bearer(operator_token),
    );
    let mut a = OrchestratorServiceClient::new(mesh.channel_as("a", &agent("a")).await);
    let mut b = OrchestratorServiceClient::new(mesh.channel_as("b", &agent("b")).await);

    // Applying flows is for operators.
    let apply = pb::ApplyFlowRequest {
        yaml: FLOW.into(),
        ..Default::default()
    };
    let metadata = not_authorized(&a.apply_flow(apply.clone()).await.unwrap_err());
    assert_eq!(metadata["action"], "apply");
    operator
        .apply_flow(apply)
        .await
        .expect("an operator applies");

    let start = |id: &str| pb::StartTaskRequest {
        flow_id: "approve".into(),
        task_id: id.into(),
        ..Default::default()
    };
    a.start_task(start("task-a"))
        .await
        .expect("a starts a task");
    b.start_task(start("task-b"))
        .await
        .expect("b starts a task");
    for id in ["task-a", "task-b"] {
        reach_tests::eventually(Duration::from_secs(5), || {
            let mut operator = operator.clone();
            let id = id.to_string();
            async move {
                operator
                    .get_task(pb::GetTaskRequest { task_id: id })
                    .await
                    .is_ok_and(|t| {
                        t.into_inner().task.unwrap().status() == pb::TaskStatus::WaitingHuman
                    })
            }
        })
        .await;
    }

    // b sees only its own task, may not view, resume or cancel a's (it is answered as an
    // unknown id, so b learns nothing of it); an operator sees both.
    let listed = |tasks: pb::ListTasksResponse| -> Vec<String> {
        let mut ids: Vec<String> = tasks.tasks.into_iter().map(|t| t.task_id).collect();
        ids.sort();
        ids
    };
    let all = pb::ListTasksRequest::default();
    assert_eq!(
        listed(b.list_tasks(all.clone()).await.unwrap().into_inner()),
        ["task-b"]
    );
    assert_eq!(
        listed(a.list_tasks(all.clone()).await.unwrap().into_inner()),
        ["task-a"]
    );
    assert_eq!(
        listed(operator.list_tasks(all).await.unwrap().into_inner()),
        ["task-a", "task-b"]
    );
    let get_a = || pb::GetTaskRequest {
        task_id: "task-a".into(),
    };
    hidden(&b.get_task(get_a()).await.unwrap_err());
    a.get_task(get_a()).await.expect("its starter views it");
    let resume = |id: &str| pb::ResumeTaskRequest {
        task_id: id.into(),
        node_id: "ask".into(),
        input: Some(prost_types::Value {
            kind: Some(prost_types::value::Kind::BoolValue(true)),
        }),
    };
    let cancel = |id: &str| pb::CancelTaskRequest {
        task_id: id.into(),
        reason: "test".into(),
    };
    hidden(&b.resume_task(resume("task-a")).await.unwrap_err());
    hidden(&b.cancel_task(cancel("task-a")).await.unwrap_err());
    hidden(
        &b.dump_task(pb::DumpTaskRequest {
            task_id: "task-a".into(),
        })
        .await
        .unwrap_err(),
    );
    // Task webhooks of a task b may not view: as for an unknown id.
    let webhook = |id: &str| pb::CreateTaskWebhookRequest {
        task_id: id.into(),
        webhook_id: "hook".into(),
        url: "http://127.0.0.1:9/hook".into(),
        ..Default::default()
    };
    hidden(&b.create_task_webhook(webhook("task-a")).await.unwrap_err());
    a.create_task_webhook(webhook("task-a"))
        .await
        .expect("its starter adds a webhook");
    hidden(
        &b.list_task_webhooks(pb::ListTaskWebhooksRequest {
            task_id: "task-a".into(),
            ..Default::default()
        })
        .await
        .unwrap_err(),
    );
    hidden(
        &b.delete_task_webhook(pb::DeleteTaskWebhookRequest {
            task_id: "task-a".into(),
            webhook_id: "hook".into(),
        })
        .await
        .unwrap_err(),
    );
    operator
        .delete_task_webhook(pb::DeleteTaskWebhookRequest {
            task_id: "task-a".into(),
            webhook_id: "hook".into(),
        })
        .await
        .expect("an operator deletes any task's webhook");

    // Its starter resumes it; an operator cancels b's.
    let resumed = a
        .resume_task(resume("task-a"))
        .await
        .expect("its starter resumes it")
        .into_inner();
    assert_ne!(resumed.task.unwrap().status(), pb::TaskStatus::WaitingHuman);
    let cancelled = operator
        .cancel_task(cancel("task-b"))
        .await
        .expect("an operator cancels any task")
        .into_inner();
    assert_eq!(cancelled.task.unwrap().status(), pb::TaskStatus::Cancelled);
    mesh.plane.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_is_for_operators_but_health_and_metrics_are_open() {
    let mesh = Mesh::start().await;
    let mut a = RegistryServiceClient::new(mesh.channel_as("a", &agent("a")).await);
    a.register(register_request("a", "a-1")).await.unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = format!("https://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let token = stop.clone();
    let serving = reach::admin::serve(
        listener,
        reach_telemetry::metrics::install().unwrap(),
        &mesh.plane,
        async move { token.cancelled().await },
        Duration::from_secs(1),
    )
    .unwrap();

    let ca = reqwest::Certificate::from_pem(mesh.ca.cert_pem().as_bytes()).unwrap();
    let client = |identity: Option<reqwest::Identity>| {
        let builder = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(ca.clone());
        match identity {
            Some(identity) => builder.identity(identity),
            None => builder,
        }
        .build()
        .unwrap()
    };
    // A probe presents no certificate: /health and /metrics answer it.
    let probe = client(None);
    let health = probe.get(format!("{admin}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(
        probe
            .get(format!("{admin}/metrics"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // Without credentials nothing else.
    let drain = format!("{admin}/agents/a");
    assert_eq!(probe.delete(&drain).send().await.unwrap().status(), 401);
    assert_eq!(
        probe
            .get(format!("{admin}/agents"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    // An agent's certificate is not an operator's.
    let issued = mesh.ca.issue(&agent("a"), &[], DAY).unwrap();
    let as_agent = client(Some(
        reqwest::Identity::from_pem(format!("{}{}", issued.cert_pem, issued.key_pem).as_bytes())
            .unwrap(),
    ));
    let refused = as_agent.delete(&drain).send().await.unwrap();
    assert_eq!(refused.status(), 403);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["reason"], "NOT_AUTHORIZED");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("spiffe://reach.test/agent/a may not drain service \"a\""),
        "{body}"
    );
    assert_eq!(
        as_agent
            .get(format!("{admin}/tasks/none"))
            .send()
            .await
            .unwrap()
            .status(),
        403
    );
    // An operator's bearer token may.
    let operator = format!("Bearer {}", mesh.operator_token());
    let agents = probe
        .get(format!("{admin}/agents"))
        .header("authorization", &operator)
        .send()
        .await
        .unwrap();
    assert_eq!(agents.status(), 200);
    let drained = probe
        .delete(&drain)
        .header("authorization", &operator)
        .send()
        .await
        .unwrap();
    assert_eq!(drained.status(), 202);
    let body: serde_json::Value = drained.json().await.unwrap();
    assert_eq!(body["draining"][0], "a-1");

    stop.cancel();
    let _ = serving.await;
    mesh.plane.shutdown().await.unwrap();
}

/// Serves health (reach.v1.AgentService SERVING) over TLS with a certificate for `identity`.
async fn agent_server(mesh: &Mesh, name: &str, identity: &Identity) -> String {
    let trust = reach_trust::Trust::load(&TrustConfig {
        trust_domain: TD.into(),
        tls: Some(write_identity(&mesh.ca, mesh.dir.path(), name, identity)),
        ..TrustConfig::default()
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = reach_rpc::GrpcServer::new().with_trust(trust);
    server
        .health_reporter()
        .set_service_status(
            "reach.v1.AgentService",
            tonic_health::ServingStatus::Serving,
        )
        .await;
    tokio::spawn(server.serve(listener, std::future::pending()));
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_probe_speaks_tls_and_expects_the_agents_identity() {
    let mesh = Mesh::start_probing(true).await;
    let mut operator = RegistryServiceClient::with_interceptor(
        mesh.anonymous_channel().await,
        bearer(mesh.operator_token()),
    );
    let genuine = agent_server(&mesh, "p", &agent("p")).await;
    let wrong = agent_server(&mesh, "q", &agent("q")).await;
    for (instance, endpoint) in [("p-1", genuine), ("p-2", wrong)] {
        let mut request = register_request("p", instance);
        request.instance.as_mut().unwrap().endpoint = endpoint;
        operator
            .register(request)
            .await
            .expect("an operator registers");
    }
    let state = |instance: &str| {
        let mut operator = operator.clone();
        let instance = instance.to_string();
        async move {
            operator
                .list_instances(pb::ListInstancesRequest::default())
                .await
                .unwrap()
                .into_inner()
                .instances
                .into_iter()
                .find(|i| i.spec.as_ref().is_some_and(|s| s.instance_id == instance))
                .expect("listed")
        }
    };
    reach_tests::eventually(Duration::from_secs(5), || async {
        state("p-1").await.state() == pb::InstanceState::Ready
    })
    .await;
    // An endpoint proving another identity never becomes READY, and says why.
    reach_tests::eventually(Duration::from_secs(5), || async {
        state("p-2").await.health_probe_error.contains("agent/q")
    })
    .await;
    assert_eq!(state("p-2").await.state(), pb::InstanceState::Registered);
    mesh.plane.shutdown().await.unwrap();
}

/// The A2A edge acts in the mesh with its caller's bearer token, so the policy judges the
/// caller: an operator's token reaches a task the edge's own identity may not see, a user's
/// token does not, and a caller known only by its client certificate is refused (it would act
/// as the edge). The card says how to authenticate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_a2a_edge_acts_with_its_callers_bearer_token_only() {
    use reach_edge::a2a::proto::a2a_service_client::A2aServiceClient;
    use reach_edge::a2a::proto::{GetExtendedAgentCardRequest, GetTaskRequest};

    let mesh = Mesh::start().await;
    let operator_token = mesh.operator_token();
    let mut operator = OrchestratorServiceClient::with_interceptor(
        mesh.anonymous_channel().await,
        bearer(operator_token.clone()),
    );
    operator
        .apply_flow(pb::ApplyFlowRequest {
            yaml: FLOW.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    // An agent's task: its starter and operators may view it; the edge's identity may not.
    OrchestratorServiceClient::new(mesh.channel_as("a", &agent("a")).await)
        .start_task(pb::StartTaskRequest {
            flow_id: "approve".into(),
            task_id: "task-of-a".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let get = || GetTaskRequest {
        id: "task-of-a".into(),
        ..Default::default()
    };

    let mut as_operator =
        A2aServiceClient::with_interceptor(mesh.anonymous_channel().await, bearer(operator_token));
    let task = as_operator.get_task(get()).await.unwrap().into_inner();
    assert_eq!(task.id, "task-of-a");
    let card = as_operator
        .get_extended_agent_card(GetExtendedAgentCardRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(card.security_schemes.contains_key("bearer"), "{card:?}");

    let user_token = mesh.token(reach_trust::token::claims(
        "mallory",
        "reach",
        None,
        Duration::from_secs(300),
    ));
    let mut as_user =
        A2aServiceClient::with_interceptor(mesh.anonymous_channel().await, bearer(user_token));
    // A task the user may not view is answered as an unknown one.
    let refused = as_user.get_task(get()).await.unwrap_err();
    assert_eq!(refused.code(), Code::NotFound, "{refused:?}");

    let mut by_certificate = A2aServiceClient::new(mesh.channel_as("b", &agent("b")).await);
    let refused = by_certificate.get_task(get()).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert!(
        refused.message().contains("Bearer"),
        "{}",
        refused.message()
    );
}

/// Anyone may serve; the user mallory may call only `tools.visible`; operators anything.
const MCP_POLICY: &str = r#"
serve:
  - identities: ["*"]
    capabilities: ["*"]
call:
  - identities: ["spiffe://reach.test/user/mallory"]
    capabilities: ["tools.visible"]
  - identities: ["spiffe://reach.test/operator/*"]
    capabilities: ["*"]
"#;

/// The MCP edge is an OAuth resource server acting with its callers' bearer tokens: a request
/// without a token gets a 401 naming the protected resource metadata (which anyone may read),
/// a bad token a 401 with `invalid_token`, a caller known only by its client certificate is
/// refused (it would act as the edge), `tools/list` shows a caller only what its policy lets
/// it call, and a call goes through the router as the caller (the policy refuses it there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mcp_edge_lists_and_calls_tools_as_its_bearer_token_callers() {
    let mesh = Mesh::start_with(false, MCP_POLICY).await;
    let schema = r#"{"type":"object","properties":{"text":{"type":"string"}}}"#;
    let mut register = register_request("tools", "tools-1");
    let spec = register.instance.as_mut().unwrap();
    for name in ["tools.visible", "tools.hidden"] {
        spec.capabilities.push(pb::Capability {
            name: name.into(),
            version: "1.0.0".into(),
            input_schema: schema.into(),
            ..Default::default()
        });
    }
    RegistryServiceClient::new(mesh.channel_as("tools", &agent("tools")).await)
        .register(register)
        .await
        .unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("https://{}", listener.local_addr().unwrap());
    let published = reach_edge::mcp::http::Published {
        base_url: base.clone(),
        authorization_servers: vec!["https://login.example.com".into()],
    };
    let challenge = reach_edge::mcp::http::challenge(&published);
    let guard = reach_edge::a2a::EdgeConfig::default().http_guard();
    let routes =
        reach_edge::mcp::http::routes(mesh.plane.mcp_edge().unwrap().clone(), published, &guard);
    let stop = tokio_util::sync::CancellationToken::new();
    let token = stop.clone();
    tokio::spawn(reach_rpc::server::serve_http_with_challenges(
        listener,
        routes,
        async move { token.cancelled().await },
        Duration::from_secs(1),
        reach_rpc::limits::ConnectionLimits::default(),
        reach_rpc::limits::MessageLimits::default(),
        mesh.plane.trust().clone(),
        reach_rpc::server::ClientCertificates::Optional,
        vec![challenge],
    ));

    let ca = reqwest::Certificate::from_pem(mesh.ca.cert_pem().as_bytes()).unwrap();
    let client = |identity: Option<reqwest::Identity>| {
        let builder = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(ca.clone());
        match identity {
            Some(identity) => builder.identity(identity),
            None => builder,
        }
        .build()
        .unwrap()
    };
    let http = client(None);
    let mcp = format!("{base}/mcp");
    // One stateless JSON-RPC request (2026-07-28: no session, protocol metadata in `_meta`).
    let rpc = |http: reqwest::Client,
               method: &'static str,
               params: serde_json::Value,
               token: Option<String>| {
        let mcp = mcp.clone();
        async move {
            let mut params = params;
            params["_meta"] = serde_json::json!({
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
            });
            let mut request = http
                .post(&mcp)
                .header("accept", "application/json, text/event-stream")
                .header("mcp-protocol-version", "2026-07-28")
                .header("mcp-method", method)
                .json(&serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}));
            if let Some(name) = params.get("name").and_then(|n| n.as_str()) {
                request = request.header("mcp-name", name);
            }
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            request.send().await.unwrap()
        }
    };
    let list = serde_json::json!({});
    let tool_names = |body: serde_json::Value| -> Vec<String> {
        body["result"]["tools"]
            .as_array()
            .unwrap_or_else(|| panic!("no tools in {body}"))
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect()
    };

    // No token: 401 naming the metadata, which anyone may read.
    let refused = rpc(http.clone(), "tools/list", list.clone(), None).await;
    assert_eq!(refused.status(), 401);
    let metadata_url = format!("{base}/.well-known/oauth-protected-resource/mcp");
    assert_eq!(
        refused.headers()["www-authenticate"],
        format!("Bearer resource_metadata=\"{metadata_url}\"").as_str()
    );
    let metadata: serde_json::Value = http
        .get(&metadata_url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(metadata["resource"], mcp.as_str());
    assert_eq!(
        metadata["authorization_servers"],
        serde_json::json!(["https://login.example.com"])
    );
    // A bad token: 401, invalid_token.
    let refused = rpc(
        http.clone(),
        "tools/list",
        list.clone(),
        Some("not.a.jwt".into()),
    )
    .await;
    assert_eq!(refused.status(), 401);
    let challenge = refused.headers()["www-authenticate"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(challenge.contains("error=\"invalid_token\""), "{challenge}");
    assert!(challenge.contains(&metadata_url), "{challenge}");

    // mallory sees and may call only tools.visible; the router judges her calls.
    let mallory = mesh.token(reach_trust::token::claims(
        "mallory",
        "reach",
        None,
        Duration::from_secs(300),
    ));
    let listed = rpc(
        http.clone(),
        "tools/list",
        list.clone(),
        Some(mallory.clone()),
    )
    .await;
    assert_eq!(listed.status(), 200);
    assert_eq!(tool_names(listed.json().await.unwrap()), ["tools.visible"]);
    let call = |name: &str| serde_json::json!({"name": name, "arguments": {"text": "hi"}});
    let hidden: serde_json::Value = rpc(
        http.clone(),
        "tools/call",
        call("tools.hidden"),
        Some(mallory.clone()),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(hidden["result"]["isError"], true, "{hidden}");
    let text = hidden["result"]["content"][0]["text"].as_str().unwrap();
    assert!(
        text.contains("PERMISSION_DENIED") && text.contains("mallory"),
        "{text}"
    );
    // Granted: the router lets it through to the instance, which is not there.
    let visible: serde_json::Value = rpc(
        http.clone(),
        "tools/call",
        call("tools.visible"),
        Some(mallory),
    )
    .await
    .json()
    .await
    .unwrap();
    let text = visible["result"]["content"][0]["text"].as_str().unwrap();
    assert!(!text.contains("PERMISSION_DENIED"), "{text}");
    assert!(text.contains("UNAVAILABLE"), "{text}");

    // An operator sees every tool.
    let listed = rpc(
        http.clone(),
        "tools/list",
        list.clone(),
        Some(mesh.operator_token()),
    )
    .await;
    assert_eq!(
        tool_names(listed.json().await.unwrap()),
        ["tools.hidden", "tools.visible"]
    );

    // A client certificate alone would make the edge act as itself: refused.
    let issued = mesh.ca.issue(&agent("b"), &[], DAY).unwrap();
    let by_certificate = client(Some(
        reqwest::Identity::from_pem(format!("{}{}", issued.cert_pem, issued.key_pem).as_bytes())
            .unwrap(),
    ));
    let refused = rpc(by_certificate, "tools/list", list, None).await;
    assert_eq!(refused.status(), 401);
    assert!(refused.text().await.unwrap().contains("Bearer"));
    stop.cancel();
}

/// A channel that sends every call to `path` instead of the method's own path: a health
/// check sent through it asks `path` (the refusals checked with it come before any decoding).
#[derive(Clone)]
struct ToPath(Channel, &'static str);

impl tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>> for ToPath {
    type Response = <Channel as tonic::codegen::Service<
        tonic::codegen::http::Request<tonic::body::Body>,
    >>::Response;
    type Error = <Channel as tonic::codegen::Service<
        tonic::codegen::http::Request<tonic::body::Body>,
    >>::Error;
    type Future = <Channel as tonic::codegen::Service<
        tonic::codegen::http::Request<tonic::body::Body>,
    >>::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(
        &mut self,
        mut request: tonic::codegen::http::Request<tonic::body::Body>,
    ) -> Self::Future {
        let mut parts = request.uri().clone().into_parts();
        parts.path_and_query = Some(tonic::codegen::http::uri::PathAndQuery::from_static(self.1));
        *request.uri_mut() = tonic::codegen::http::Uri::from_parts(parts).unwrap();
        self.0.call(request)
    }
}

/// An agent serving TLS answers only the mesh's routers (issue 33, item 1): through the router
/// a call is answered; called directly, an agent's certificate, an operator's and the
/// registry's are refused PERMISSION_DENIED / NOT_AUTHORIZED naming the peer, on Handle,
/// HandleStream, HandleMux and reflection alike; health is for the registry (and routers); a
/// peer presenting the router's identity is answered. A handler that panics answers a generic
/// message with an error id (item 7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_answers_only_routers_and_the_registrys_health_checks() {
    use reach_proto::v1::agent_service_client::AgentServiceClient;
    use reach_proto::v1::router_service_client::RouterServiceClient;
    use tonic_health::pb::health_client::HealthClient;

    // The control plane presents the router's identity (as a router process does).
    let mesh = Mesh::start_as(
        true,
        &POLICY.replace(
            "serve:\n  - identities: [\"*\"]\n",
            "serve:\n  - identities: [\"*\"]\n    endpoints: [\"127.0.0.0/8\"]\n",
        ),
        "router",
    )
    .await;
    let tls = write_identity(&mesh.ca, mesh.dir.path(), "agent-echo", &agent("echo"));
    let config = reach_sdk::AgentConfig::new("echo", mesh.plane.endpoint())
        .with_instance_id("echo-1")
        .with_trust_domain(TD)
        .with_tls(tls);
    let runtime = reach_sdk::AgentRuntime::new(config)
        .handle(
            "echo.say",
            "1.0.0",
            |_ctx: reach_sdk::HandlerContext, message: pb::ReachMessage| async move {
                Ok(message.payload.unwrap_or_default())
            },
        )
        .handle(
            "echo.panic",
            "1.0.0",
            |_ctx: reach_sdk::HandlerContext, _message: pb::ReachMessage| async move {
                if true {
                    panic!("the vault password is hunter2");
                }
                Ok(pb::Payload::default())
            },
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (running, agent_endpoint) = runtime.start(listener).await.unwrap();
    let message = || pb::ReachMessage {
        header: Some(pb::Header {
            target: Some(pb::header::Target::Capability("echo.say".into())),
            ..Default::default()
        }),
        payload: Some(pb::Payload::text("echo.request", "hi")),
    };

    // Through the router (an operator's token): answered, once the health probe passed.
    let mut router = RouterServiceClient::with_interceptor(
        mesh.anonymous_channel().await,
        bearer(mesh.operator_token()),
    );
    reach_tests::eventually(Duration::from_secs(10), || {
        let mut router = router.clone();
        async move {
            router
                .call(pb::CallRequest {
                    message: Some(message()),
                })
                .await
                .is_ok()
        }
    })
    .await;
    let reply = router
        .call(pb::CallRequest {
            message: Some(message()),
        })
        .await
        .expect("a call through the router is answered")
        .into_inner();
    assert_eq!(
        reply.message.unwrap().payload.unwrap().first_text(),
        Some("hi")
    );

    // A handler that panics answers a generic message with an error id (issue 33 item 7), not
    // what the panic said.
    let failed = router
        .call(pb::CallRequest {
            message: Some(pb::ReachMessage {
                header: Some(pb::Header {
                    target: Some(pb::header::Target::Capability("echo.panic".into())),
                    ..Default::default()
                }),
                payload: Some(pb::Payload::text("echo.request", "hi")),
            }),
        })
        .await
        .expect_err("a panicking handler fails the call");
    assert_eq!(failed.code(), Code::Internal, "{failed:?}");
    let id = failed
        .message()
        .strip_prefix("handler failed; error id ")
        .and_then(|rest| rest.strip_suffix("; see the agent's log"))
        .unwrap_or_else(|| panic!("a generic message: {}", failed.message()));
    assert!(uuid_like(id), "{id}");
    assert!(!failed.message().contains("hunter2"));

    let direct = |name: &'static str, identity: Identity| {
        let source = mesh.source(name, &identity);
        let endpoint = reach_rpc::http2::endpoint(agent_endpoint.clone()).unwrap();
        async move {
            reach_rpc::http2::channel(&endpoint, Some(&source), None)
                .await
                .expect("TLS channel to the agent")
        }
    };
    let registry = Identity::service(TD, "registry").unwrap();
    for (name, identity) in [
        ("other", agent("other")),
        ("root", Identity::operator(TD, "root").unwrap()),
        ("registry-direct", registry.clone()),
    ] {
        let channel = direct(name, identity.clone()).await;
        let mut client = AgentServiceClient::new(channel.clone());
        let refused = client
            .handle(pb::HandleRequest {
                message: Some(message()),
            })
            .await
            .expect_err("a direct Handle from a non-router is refused");
        let metadata = not_authorized(&refused);
        assert_eq!(metadata["identity"], identity.as_str(), "{refused:?}");
        assert!(
            refused.message().contains("spiffe://reach.test/router")
                && refused.message().contains("through a router"),
            "{}",
            refused.message()
        );
        let refused = client
            .handle_stream(futures::stream::iter([pb::HandleStreamRequest {
                message: Some(message()),
            }]))
            .await
            .expect_err("a direct HandleStream from a non-router is refused");
        not_authorized(&refused);
        let refused = client
            .handle_mux(futures::stream::pending::<pb::HandleMuxRequest>())
            .await
            .expect_err("a direct HandleMux from a non-router is refused");
        not_authorized(&refused);
        let refused = HealthClient::new(ToPath(
            channel.clone(),
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        ))
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect_err("reflection is for routers");
        not_authorized(&refused);
        let health = HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest {
                service: "reach.v1.AgentService".into(),
            })
            .await;
        if identity == registry {
            // The registry's health probe is answered.
            assert_eq!(
                health
                    .expect("the registry checks health")
                    .into_inner()
                    .status(),
                tonic_health::pb::health_check_response::ServingStatus::Serving
            );
        } else {
            let refused = health.expect_err("health is for the registry and routers");
            let metadata = not_authorized(&refused);
            assert_eq!(metadata["identity"], identity.as_str());
        }
    }

    // A peer presenting the router's identity is answered directly.
    let channel = direct("router-direct", Identity::service(TD, "router").unwrap()).await;
    let reply = AgentServiceClient::new(channel)
        .handle(pb::HandleRequest {
            message: Some(message()),
        })
        .await
        .expect("a router is answered")
        .into_inner();
    assert_eq!(
        reply.message.unwrap().payload.unwrap().first_text(),
        Some("hi")
    );
    let _ = running.drain().await;
    mesh.plane.shutdown().await.unwrap();
}

/// Whether `id` looks like a UUID (8-4-4-4-12 hex digits).
fn uuid_like(id: &str) -> bool {
    let groups: Vec<&str> = id.split('-').collect();
    groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
        && groups
            .iter()
            .all(|g| g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// A caller may name any task id in the messages it routes, and the router records them in
/// that task's ledger: each such entry names the caller the router verified
/// (`x-reach-caller` in its header metadata, replacing what the caller wrote there), so an
/// entry planted in someone else's task by an agent is attributed to that agent, never passed
/// off as the orchestrator's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_entries_name_the_caller_the_router_verified() {
    use reach_proto::v1::router_service_client::RouterServiceClient;

    let mesh = Mesh::start_as(
        true,
        &POLICY.replace(
            "serve:\n  - identities: [\"*\"]\n",
            "serve:\n  - identities: [\"*\"]\n    endpoints: [\"127.0.0.0/8\"]\n",
        ),
        "router",
    )
    .await;
    let tls = write_identity(&mesh.ca, mesh.dir.path(), "agent-echo", &agent("echo"));
    let config = reach_sdk::AgentConfig::new("echo", mesh.plane.endpoint())
        .with_instance_id("echo-1")
        .with_trust_domain(TD)
        .with_tls(tls);
    let runtime = reach_sdk::AgentRuntime::new(config).handle(
        "echo.say",
        "1.0.0",
        |_ctx: reach_sdk::HandlerContext, message: pb::ReachMessage| async move {
            Ok(message.payload.unwrap_or_default())
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (running, _endpoint) = runtime.start(listener).await.unwrap();

    let mut operator = OrchestratorServiceClient::with_interceptor(
        mesh.anonymous_channel().await,
        bearer(mesh.operator_token()),
    );
    operator
        .apply_flow(pb::ApplyFlowRequest {
            yaml: FLOW.into(),
            ..Default::default()
        })
        .await
        .expect("an operator applies");
    operator
        .start_task(pb::StartTaskRequest {
            flow_id: "approve".into(),
            task_id: "victim".into(),
            ..Default::default()
        })
        .await
        .expect("an operator starts a task");

    // Agent `a` routes a message naming the operator's task, claiming to be the orchestrator.
    let router = RouterServiceClient::new(mesh.channel_as("a", &agent("a")).await);
    let planted = || pb::CallRequest {
        message: Some(pb::ReachMessage {
            header: Some(pb::Header {
                target: Some(pb::header::Target::Capability("echo.say".into())),
                task_id: "victim".into(),
                source: "orchestrator".into(),
                metadata: [(
                    "x-reach-caller".to_string(),
                    "spiffe://reach.test/orchestrator".to_string(),
                )]
                .into(),
                ..Default::default()
            }),
            payload: Some(pb::Payload::text("echo.request", "planted")),
        }),
    };
    reach_tests::eventually(Duration::from_secs(10), || {
        let mut router = router.clone();
        async move { router.call(planted()).await.is_ok() }
    })
    .await;

    let recorded_by = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    reach_tests::eventually(Duration::from_secs(10), || {
        let mut operator = operator.clone();
        let found = recorded_by.clone();
        async move {
            let Ok(dump) = operator
                .dump_task(pb::DumpTaskRequest {
                    task_id: "victim".into(),
                })
                .await
            else {
                return false;
            };
            for record in dump.into_inner().records {
                if let Some(pb::dump_record::Record::Message(entry)) = record.record
                    && let Some(header) = entry.header
                {
                    *found.lock().unwrap() = header
                        .metadata
                        .get("x-reach-caller")
                        .cloned()
                        .unwrap_or_default();
                    return true;
                }
            }
            false
        }
    })
    .await;
    let recorded_by = recorded_by.lock().unwrap().clone();
    assert_eq!(
        recorded_by,
        agent("a").as_str(),
        "the entry names the agent that routed it, not the caller it claimed"
    );
    let _ = running.drain().await;
}
