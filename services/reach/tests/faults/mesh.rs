//! A mesh of real `reach` processes on 127.0.0.1: each service is a child process on a port
//! chosen once, so it can be SIGKILLed and started again at the same address.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reach_proto::v1::ListInstancesRequest;
use reach_proto::v1::registry_service_client::RegistryServiceClient;

/// The repository root (flows and data are read from there).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// How many instances `reach example-agents` registers.
pub const INSTANCES: usize = 10;

/// A free port on 127.0.0.1 (bound and released; a service takes it right after).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind an ephemeral port")
        .local_addr()
        .unwrap()
        .port()
}

/// One `reach` subcommand as a child process; restartable at the same address.
pub struct Service {
    /// What it is, for messages (`router`, `agents`, ...).
    name: &'static str,
    /// The arguments after `reach`.
    args: Vec<String>,
    /// Its stderr goes here (appended across restarts), for a failed run's diagnosis.
    log: PathBuf,
    /// The line prefix on stdout that says it is serving.
    ready_line: &'static str,
    /// Extra environment (`REACH_*` settings).
    env: Vec<(String, String)>,
    child: Option<Child>,
}

impl Service {
    /// `reach ARGS`, logging to `logs/NAME.log`, ready once stdout has a line starting with
    /// `ready_line`.
    pub fn new(
        name: &'static str,
        args: Vec<String>,
        logs: &Path,
        ready_line: &'static str,
    ) -> Self {
        Self {
            name,
            args,
            log: logs.join(format!("{name}.log")),
            ready_line,
            env: Vec::new(),
            child: None,
        }
    }

    /// The same with one more environment variable.
    pub fn with_env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// Starts the process and waits (at most 30 s) until it prints its ready line.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} is already running", self.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_reach"))
            .args(&self.args)
            .current_dir(repo_root())
            .env("REACH_LOG", "warn")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start reach {}: {e}", self.name));
        let stdout = child.stdout.take().unwrap();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let ready_line = self.ready_line;
        // Reads the banner, then keeps draining stdout so the child never blocks on a pipe.
        std::thread::spawn(move || {
            use std::io::BufRead;
            let mut announced = false;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if !announced && line.starts_with(ready_line) {
                    announced = true;
                    let _ = ready_tx.send(());
                }
            }
        });
        if ready_rx.recv_timeout(Duration::from_secs(30)).is_err() {
            let _ = child.kill();
            panic!(
                "reach {} did not become ready; its log: {}",
                self.name,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
        self.child = Some(child);
    }

    /// SIGKILL: no drain, no deregistration — a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Registry, router, orchestrator (SQLite in a temporary directory, the repo's flows) and the
/// example agents, each a process of its own.
pub struct Mesh {
    /// `http://127.0.0.1:PORT` of the registry.
    pub registry_url: String,
    /// `http://127.0.0.1:PORT` of the router.
    pub router_url: String,
    /// `http://127.0.0.1:PORT` of the orchestrator.
    pub orchestrator_url: String,
    /// `reach registry`.
    pub registry: Service,
    /// `reach router`.
    pub router: Service,
    /// `reach orchestrator`.
    pub orchestrator: Service,
    /// `reach example-agents`.
    pub agents: Service,
    /// Holds the store and the logs; removed with the mesh.
    _dir: tempfile::TempDir,
}

impl Mesh {
    /// Starts every process and waits until the example agents, asking for leases of
    /// `agent_lease_ttl` (e.g. `10s`), are routable.
    pub async fn start(agent_lease_ttl: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("reach-faults-")
            .tempdir()
            .unwrap();
        let [registry_port, router_port, orchestrator_port] =
            [free_port(), free_port(), free_port()];
        let url = |port: u16| format!("http://127.0.0.1:{port}");
        let listen = |port: u16| {
            vec![
                "--listen".to_string(),
                format!("127.0.0.1:{port}"),
                "--admin-listen".to_string(),
                String::new(),
            ]
        };
        let strings = |args: &[&str]| args.iter().map(ToString::to_string).collect::<Vec<_>>();
        let logs = dir.path();
        let registry = Service::new(
            "registry",
            [strings(&["registry"]), listen(registry_port)].concat(),
            logs,
            "grpc",
        );
        let router = Service::new(
            "router",
            [
                strings(&["router"]),
                listen(router_port),
                strings(&["--registry", &url(registry_port)]),
            ]
            .concat(),
            logs,
            "grpc",
        );
        let store = format!("sqlite://{}/orchestrator.db", dir.path().display());
        let orchestrator = Service::new(
            "orchestrator",
            [
                strings(&["orchestrator"]),
                listen(orchestrator_port),
                strings(&["--router", &url(router_port), "--store", &store]),
                strings(&["--flows", "examples/flows"]),
            ]
            .concat(),
            logs,
            "grpc",
        );
        let agents = Service::new(
            "agents",
            strings(&[
                "example-agents",
                "--registry",
                &url(registry_port),
                "--router",
                &url(router_port),
                "--lease-ttl",
                agent_lease_ttl,
            ]),
            logs,
            "registered with",
        );
        let mut mesh = Self {
            registry_url: url(registry_port),
            router_url: url(router_port),
            orchestrator_url: url(orchestrator_port),
            registry,
            router,
            orchestrator,
            agents,
            _dir: dir,
        };
        mesh.registry.start();
        mesh.router.start();
        mesh.orchestrator.start();
        mesh.agents.start();
        mesh.wait_ready_instances(INSTANCES).await;
        mesh
    }

    /// Waits (at most 30 s) until the registry lists at least `count` READY instances.
    pub async fn wait_ready_instances(&self, count: usize) {
        let started = Instant::now();
        loop {
            let ready = ready_instances(&self.registry_url).await;
            if ready >= count {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "only {ready} of {count} instances became READY"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// How many READY instances the registry at `registry_url` lists (0 when it does not answer).
pub async fn ready_instances(registry_url: &str) -> usize {
    match RegistryServiceClient::connect(registry_url.to_string()).await {
        Ok(mut registry) => registry
            .list_instances(ListInstancesRequest::default())
            .await
            .map(|list| {
                list.into_inner()
                    .instances
                    .iter()
                    .filter(|i| i.state() == reach_proto::v1::InstanceState::Ready)
                    .count()
            })
            .unwrap_or(0),
        Err(_) => 0,
    }
}
