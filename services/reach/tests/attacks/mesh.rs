//! A mesh deployed as `docs/security.md` describes for a shared network: `reach certs init`,
//! JWT keys, a policy, and the registry, router, orchestrator and edge each a `reach` process
//! of its own on 127.0.0.1 port 0 (the address read from its banner), serving TLS.
//!
//! The policy ([`POLICY`]): agent `alpha` may serve `alpha.*` and call `echo.*`; agent `echo`
//! serves `echo.*`; users `alice` and `bob` may start and view the `approve` flow; `mallory`
//! may do nothing; `operator/admin` is the operator. Agents run inside the test process
//! ([`TrustedMesh::start_agent`]) with their own certificates.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use reach_proto::v1 as pb;
use reach_sdk::runtime::RunningAgent;
use reach_sdk::{AgentConfig, AgentRuntime, HandlerContext};
use reach_trust::tls::{TlsConfig, TlsSource};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};
use tonic_types::StatusExt;

/// The trust domain of the mesh.
pub const TD: &str = "reach.local";

/// The policy every service loads.
pub const POLICY: &str = r#"
operators: ["spiffe://reach.local/operator/admin"]
serve:
  - identities: ["spiffe://reach.local/agent/alpha"]
    services: ["alpha"]
    capabilities: ["alpha.*"]
  - identities: ["spiffe://reach.local/agent/echo"]
    services: ["echo"]
    capabilities: ["echo.*"]
call:
  - identities: ["spiffe://reach.local/agent/alpha"]
    capabilities: ["echo.*"]
  - identities: ["spiffe://reach.local/user/alice", "spiffe://reach.local/user/bob"]
    capabilities: ["echo.*"]
  - identities: ["spiffe://reach.local/orchestrator"]
    capabilities: ["*"]
    services: ["*"]
tasks:
  - identities: ["spiffe://reach.local/user/alice", "spiffe://reach.local/user/bob"]
    flows: ["approve"]
    actions: [start, view]
"#;

/// A flow with one human step, so its tasks wait and can be listed, viewed and probed.
pub const FLOW: &str = r"
id: approve
version: 1
initial: ask
states:
  ask: {type: human, timeout: 1h, next: done}
  done: {type: succeed}
";

/// One `reach` process, killed when dropped; its stderr goes to `logs/NAME.log`.
struct Process {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The running mesh.
pub struct TrustedMesh {
    /// The directory `reach certs init` wrote: `ca.pem`, `registry.pem`, `router.pem`,
    /// `orchestrator.pem`, `edge.pem`, `agent-alpha.pem`, `agent-echo.pem`,
    /// `operator-admin.pem` (each with `-key.pem`), `jwt-key.pem`, `jwt-public.pem`.
    pub certs: PathBuf,
    /// The policy file every service loads.
    pub policy: PathBuf,
    /// `https://127.0.0.1:PORT` of the registry's gRPC port.
    pub registry_url: String,
    /// `https://127.0.0.1:PORT` of the registry's admin port.
    pub registry_admin_url: String,
    /// `https://127.0.0.1:PORT` of the router's gRPC port.
    pub router_url: String,
    /// `https://127.0.0.1:PORT` of the orchestrator's gRPC port.
    pub orchestrator_url: String,
    /// `https://127.0.0.1:PORT` of the orchestrator's admin port (the console is under
    /// `/console`).
    pub orchestrator_admin_url: String,
    /// `https://127.0.0.1:PORT` of the edge's gRPC port (lf.a2a.v1.A2AService).
    pub edge_grpc_url: String,
    /// `https://127.0.0.1:PORT` of the edge's HTTP port (A2A JSON-RPC, agent cards, MCP).
    pub edge_http_url: String,
    /// The endpoint (`https://127.0.0.1:PORT`) of instance `echo-1` of service `echo`, serving
    /// `echo.say` (answers the payload unchanged), running throughout.
    pub echo_endpoint: String,
    echo: Option<RunningAgent>,
    processes: Vec<Process>,
    dir: tempfile::TempDir,
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `reach ARGS` to completion, panicking with its stderr when it fails; returns stdout.
pub fn reach(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_reach"))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run reach {args:?}: {e}"));
    assert!(
        out.status.success(),
        "reach {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl TrustedMesh {
    /// Makes the certificates, keys and policy, starts registry, router, orchestrator and edge
    /// (in that order) and waits until each has printed its banner.
    pub async fn start() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("reach-attacks-")
            .tempdir()
            .unwrap();
        let certs = dir.path().join("certs");
        let certs_arg = certs.to_str().unwrap().to_string();
        reach(&[
            "certs",
            "init",
            "--dir",
            &certs_arg,
            "--trust-domain",
            TD,
            "--agents",
            "alpha,echo",
            "--operators",
            "admin",
        ]);
        reach(&[
            "certs",
            "issue",
            "--dir",
            &certs_arg,
            "--identity",
            &format!("spiffe://{TD}/edge"),
            "--out",
            "edge",
        ]);
        let policy = dir.path().join("policy.yaml");
        std::fs::write(&policy, POLICY).unwrap();
        let flows = dir.path().join("flows");
        std::fs::create_dir(&flows).unwrap();
        std::fs::write(flows.join("approve.yaml"), FLOW).unwrap();
        let logs = dir.path().join("logs");
        std::fs::create_dir(&logs).unwrap();

        let mut mesh = Self {
            certs,
            policy,
            registry_url: String::new(),
            registry_admin_url: String::new(),
            router_url: String::new(),
            orchestrator_url: String::new(),
            orchestrator_admin_url: String::new(),
            edge_grpc_url: String::new(),
            edge_http_url: String::new(),
            echo_endpoint: String::new(),
            echo: None,
            processes: Vec::new(),
            dir,
        };
        let banner = mesh.spawn(
            "registry",
            &["registry", "--admin-listen", "127.0.0.1:0"],
            // Agents may join with tokens, users call with tokens.
            "optional",
        );
        mesh.registry_url = banner.grpc;
        mesh.registry_admin_url = banner.admin.expect("the registry's admin port");
        let registry = mesh.registry_url.clone();
        let banner = mesh.spawn(
            "router",
            &["router", "--admin-listen", "", "--registry", &registry],
            "optional",
        );
        mesh.router_url = banner.grpc;
        let router = mesh.router_url.clone();
        let store = format!("sqlite://{}/orchestrator.db", mesh.dir.path().display());
        let flows = flows.to_str().unwrap().to_string();
        let banner = mesh.spawn(
            "orchestrator",
            &[
                "orchestrator",
                "--admin-listen",
                "127.0.0.1:0",
                "--router",
                &router,
                "--store",
                &store,
                "--flows",
                &flows,
            ],
            "optional",
        );
        mesh.orchestrator_url = banner.grpc;
        mesh.orchestrator_admin_url = banner.admin.expect("the orchestrator's admin port");
        let orchestrator = mesh.orchestrator_url.clone();
        let banner = mesh.spawn(
            "edge",
            &[
                "edge",
                "--admin-listen",
                "",
                "--edge-listen",
                "127.0.0.1:0",
                "--registry",
                &registry,
                "--router",
                &router,
                "--orchestrator",
                &orchestrator,
            ],
            "optional",
        );
        mesh.edge_grpc_url = banner.grpc;
        mesh.edge_http_url = banner.edge_http.expect("the edge's HTTP port");
        let (echo, endpoint) = mesh
            .start_agent("echo", "echo-1", |runtime| echo(runtime, "echo.say"))
            .await;
        mesh.echo = Some(echo);
        mesh.echo_endpoint = endpoint;
        mesh
    }

    /// Starts `reach ARGS --listen 127.0.0.1:0` with the `[trust]` settings of identity `name`
    /// (its `NAME.pem`), the policy and the JWT key, and reads its banner (at most 30 s).
    fn spawn(&mut self, name: &str, args: &[&str], client_auth: &str) -> Banner {
        let log = self.dir.path().join("logs").join(format!("{name}.log"));
        let stderr = std::fs::File::create(&log).unwrap();
        let cert = |file: &str| self.certs.join(file).to_str().unwrap().to_string();
        let mut child = Command::new(env!("CARGO_BIN_EXE_reach"))
            .args(args)
            .args(["--listen", "127.0.0.1:0"])
            .current_dir(repo_root())
            .env("REACH_LOG", "warn,reach::audit=info")
            .env("REACH_TRUST__TRUST_DOMAIN", TD)
            .env("REACH_TRUST__POLICY", self.policy.to_str().unwrap())
            .env("REACH_TRUST__TLS__CERT", cert(&format!("{name}.pem")))
            .env("REACH_TRUST__TLS__KEY", cert(&format!("{name}-key.pem")))
            .env("REACH_TRUST__TLS__CA", cert("ca.pem"))
            .env("REACH_TRUST__TLS__CLIENT_AUTH", client_auth)
            .env(
                "REACH_TRUST__JWT__KEYS",
                format!("[\"{}\"]", cert("jwt-public.pem")),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("start reach {name}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let (lines_tx, lines_rx) = std::sync::mpsc::channel::<String>();
        // Reads the banner, then keeps draining stdout so the child never blocks on a pipe.
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = lines_tx.send(line);
            }
        });
        let process = Process {
            name: name.to_string(),
            child,
            log,
        };
        let mut banner = Banner::default();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let Ok(line) = lines_rx.recv_timeout(left) else {
                panic!(
                    "reach {} printed no `grpc` banner line within 30 s; its log:\n{}",
                    process.name,
                    std::fs::read_to_string(&process.log).unwrap_or_default()
                );
            };
            let url = |line: &str| {
                let address = line
                    .split_whitespace()
                    .find(|word| word.contains("127.0.0.1:"))
                    .expect("an address in the banner line")
                    .trim_start_matches("http://")
                    .trim_start_matches("https://")
                    .split('/')
                    .next()
                    .unwrap()
                    .to_string();
                format!("https://{address}")
            };
            if line.starts_with("admin http") {
                banner.admin = Some(url(&line));
            } else if line.starts_with("a2a ") {
                banner.edge_http = Some(url(&line));
            } else if line.starts_with("grpc ") {
                banner.grpc = url(&line);
                break;
            }
        }
        self.processes.push(process);
        banner
    }

    /// The TLS settings of certificate `name` (`agent-alpha`, `operator-admin`, `router`, ...;
    /// `None`: no client certificate, only the CA).
    pub fn tls_config(&self, name: Option<&str>) -> TlsConfig {
        let ca = self.certs.join("ca.pem");
        match name {
            Some(name) => TlsConfig::new(
                self.certs.join(format!("{name}.pem")),
                self.certs.join(format!("{name}-key.pem")),
                ca,
            ),
            None => TlsConfig {
                cert: None,
                key: None,
                ..TlsConfig::new("", "", ca)
            },
        }
    }

    /// A TLS channel to `url` presenting certificate `name` (or none).
    pub async fn channel(&self, url: &str, name: Option<&str>) -> Channel {
        let tls = TlsSource::load(&self.tls_config(name), TD).expect("load TLS files");
        let endpoint = Endpoint::from_shared(url.to_string())
            .unwrap()
            .connect_timeout(Duration::from_secs(5));
        reach_rpc::http2::channel(&endpoint, Some(&tls), None)
            .await
            .unwrap_or_else(|e| panic!("connect to {url} as {name:?}: {e}"))
    }

    /// A TLS channel to `url` without a client certificate, sending `token` as
    /// `authorization: Bearer` on every call.
    pub async fn channel_with_token(&self, url: &str, token: &str) -> Authorized {
        InterceptedService::new(self.channel(url, None).await, Bearer::new(token))
    }

    /// A bearer token (1 hour) for `subject`: a SPIFFE ID, or a name that becomes
    /// `spiffe://reach.local/user/<name>`.
    pub fn token(&self, subject: &str) -> String {
        let key = std::fs::read(self.certs.join("jwt-key.pem")).unwrap();
        let claims = reach_trust::token::claims(subject, "reach", None, Duration::from_secs(3600));
        reach_trust::token::sign(&key, &serde_json::Value::Object(claims)).unwrap()
    }

    /// An agent of `service` (its own certificate `agent-<service>`) with `runtime_setup`
    /// adding its handlers, serving on 127.0.0.1 port 0 and registered with the registry.
    /// Returns once the registry lists it READY.
    pub async fn start_agent(
        &self,
        service: &str,
        instance: &str,
        runtime_setup: impl FnOnce(AgentRuntime) -> AgentRuntime,
    ) -> (RunningAgent, String) {
        let config = self.agent_config(service, instance);
        let runtime = runtime_setup(AgentRuntime::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (agent, endpoint) = runtime.start(listener).await.expect("agent starts");
        self.wait_ready(instance).await;
        (agent, endpoint)
    }

    /// The config of an agent of `service` with id `instance` presenting `agent-<service>`.
    pub fn agent_config(&self, service: &str, instance: &str) -> AgentConfig {
        AgentConfig::new(service, self.registry_url.clone())
            .with_instance_id(instance)
            .with_trust_domain(TD)
            .with_tls(self.tls_config(Some(&format!("agent-{service}"))))
            .with_lease_ttl(Duration::from_secs(10))
            .with_max_drain(Duration::from_secs(2))
    }

    /// Waits (at most 20 s) until the registry lists instance `id` READY.
    pub async fn wait_ready(&self, id: &str) {
        let mut registry = pb::registry_service_client::RegistryServiceClient::new(
            self.channel(&self.registry_url, Some("operator-admin"))
                .await,
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let ready = registry
                .list_instances(pb::ListInstancesRequest::default())
                .await
                .map(|list| {
                    list.into_inner().instances.iter().any(|i| {
                        i.spec.as_ref().is_some_and(|s| s.instance_id == id)
                            && i.state() == pb::InstanceState::Ready
                    })
                })
                .unwrap_or(false);
            if ready {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "instance {id} did not become READY within 20 s; the registry's log:\n{}",
                self.log("registry")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The stderr log of process `name` so far (for a failed check's diagnosis).
    pub fn log(&self, name: &str) -> String {
        self.processes
            .iter()
            .find(|p| p.name == name)
            .map(|p| std::fs::read_to_string(&p.log).unwrap_or_default())
            .unwrap_or_default()
    }
}

/// What a service printed on start-up.
#[derive(Default)]
struct Banner {
    grpc: String,
    admin: Option<String>,
    edge_http: Option<String>,
}

/// A channel that sends a bearer token with every call.
pub type Authorized = InterceptedService<Channel, Bearer>;

/// Adds `authorization: Bearer <token>` to every request.
#[derive(Clone)]
pub struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl Bearer {
    /// The interceptor for `token`.
    pub fn new(token: &str) -> Self {
        Self(format!("Bearer {token}").parse().unwrap())
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request
            .metadata_mut()
            .insert("authorization", self.0.clone());
        Ok(request)
    }
}

/// `Ok` when `result` is a refusal with `code` and ErrorInfo `reason` ("" when the refusal
/// carries no ErrorInfo by design); otherwise what came instead.
pub fn refused<T: std::fmt::Debug>(
    result: Result<T, Status>,
    code: Code,
    reason: &str,
) -> Result<(), String> {
    match result {
        Ok(answer) => Err(format!("accepted (expected {code:?} {reason}): {answer:?}")),
        Err(status) => {
            let got = status
                .get_details_error_info()
                .map(|info| info.reason)
                .unwrap_or_default();
            if status.code() == code && got == reason {
                Ok(())
            } else {
                Err(format!(
                    "refused with {:?} {got:?} (expected {code:?} {reason:?}): {}",
                    status.code(),
                    status.message()
                ))
            }
        }
    }
}

/// An echo handler: answers the message's payload unchanged.
pub fn echo(runtime: AgentRuntime, capability: &str) -> AgentRuntime {
    runtime.handle(
        capability,
        "1.0.0",
        |_ctx: HandlerContext, message: pb::ReachMessage| async move {
            Ok(message.payload.unwrap_or_default())
        },
    )
}

/// A text message for `capability`.
pub fn message(capability: &str, text: &str) -> pb::ReachMessage {
    pb::ReachMessage {
        header: Some(pb::Header {
            message_id: uuid::Uuid::now_v7().to_string(),
            source: "attacks.client".into(),
            target: Some(pb::header::Target::Capability(capability.into())),
            ..Default::default()
        }),
        payload: Some(pb::Payload::text(capability, text)),
    }
}
