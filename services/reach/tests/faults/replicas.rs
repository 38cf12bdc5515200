//! The registry on etcd, two replicas behind one address (as a Kubernetes Service puts them):
//! one replica is SIGKILLed while a router routes steady calls and agents heartbeat through
//! that address. The router's watch and the agents' heartbeats move to the survivor, which
//! holds the same table (it lives in etcd): no call fails, and every instance stays READY.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::mesh::{self, Service};

/// How long calls run before the kill, and after it.
const BEFORE_KILL: Duration = Duration::from_secs(2);
const AFTER_KILL: Duration = Duration::from_secs(6);

/// What the scenario measured.
pub struct Report {
    /// The steady calls' outcome through the kill.
    pub calls: crate::calls::Tally,
    /// READY instances the survivor lists after the kill (of [`mesh::INSTANCES`]).
    pub ready_after: usize,
}

/// An etcd of its own on ephemeral ports, SIGKILLed when dropped.
struct Etcd {
    child: Child,
    url: String,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether an `etcd` binary is installed (scripts/etcd-env.sh installs one).
pub fn etcd_installed() -> bool {
    Command::new("etcd").arg("--version").output().is_ok()
}

fn start_etcd(dir: &std::path::Path) -> Etcd {
    let url = format!("http://127.0.0.1:{}", free_port());
    let peer = format!("http://127.0.0.1:{}", free_port());
    let child = Command::new("etcd")
        .args([
            "--data-dir",
            dir.join("etcd").to_str().unwrap(),
            "--name",
            "faults",
        ])
        .args([
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
        ])
        .args([
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
        ])
        .args(["--initial-cluster", &format!("faults={peer}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start etcd");
    Etcd { child, url }
}

/// A TCP front for several backends, as a Kubernetes Service is: each connection goes to the
/// next backend in turn that accepts it.
async fn front(backends: Vec<SocketAddr>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let next = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let (backends, next) = (backends.clone(), Arc::clone(&next));
            tokio::spawn(async move {
                for _ in 0..backends.len() {
                    let backend = backends[next.fetch_add(1, Ordering::Relaxed) % backends.len()];
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(backend).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        return;
                    }
                }
            });
        }
    });
    url
}

/// Runs the scenario; logs go to `logs`.
pub async fn run(logs: &std::path::Path) -> Report {
    let etcd = start_etcd(logs);
    let endpoints = format!("[\"{}\"]", etcd.url);
    let ports = [free_port(), free_port()];
    let mut replicas: Vec<Service> = ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            Service::new(
                if i == 0 { "registry-a" } else { "registry-b" },
                vec![
                    "registry".into(),
                    "--listen".into(),
                    format!("127.0.0.1:{port}"),
                    "--admin-listen".into(),
                    String::new(),
                ],
                logs,
                "grpc",
            )
            .with_env("REACH_REGISTRY__BACKEND", "etcd")
            .with_env("REACH_REGISTRY__ETCD__ENDPOINTS", &endpoints)
            .with_env("REACH_REGISTRY__ETCD__REPLICA_TTL", "2s")
        })
        .collect();
    // etcd answers within about 0.1 s; a replica that starts before exits naming it, so the
    // first start is retried for a bounded while.
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        if std::net::TcpStream::connect(etcd.url.trim_start_matches("http://")).is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for replica in &mut replicas {
        replica.start();
    }
    let registry_url = front(
        ports
            .iter()
            .map(|port| SocketAddr::from(([127, 0, 0, 1], *port)))
            .collect(),
    )
    .await;
    let router_port = free_port();
    let mut router = Service::new(
        "router-on-etcd",
        vec![
            "router".into(),
            "--listen".into(),
            format!("127.0.0.1:{router_port}"),
            "--admin-listen".into(),
            String::new(),
            "--registry".into(),
            registry_url.clone(),
        ],
        logs,
        "grpc",
    );
    router.start();
    let router_url = format!("http://127.0.0.1:{router_port}");
    let mut agents = Service::new(
        "agents-on-etcd",
        vec![
            "example-agents".into(),
            "--registry".into(),
            registry_url.clone(),
            "--router".into(),
            router_url.clone(),
            "--lease-ttl".into(),
            "10s".into(),
        ],
        logs,
        "registered with",
    );
    agents.start();
    let ready = Instant::now();
    while mesh::ready_instances(&registry_url).await < mesh::INSTANCES {
        assert!(
            ready.elapsed() < Duration::from_secs(30),
            "the instances did not become READY on the etcd registry"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let steady = crate::calls::Steady::start(&router_url);
    tokio::time::sleep(BEFORE_KILL).await;
    replicas[0].kill();
    tokio::time::sleep(AFTER_KILL).await;
    let calls = steady.stop().await;
    let survivor = format!("http://127.0.0.1:{}", ports[1]);
    let ready_after = mesh::ready_instances(&survivor).await;
    drop(agents);
    drop(router);
    drop(replicas);
    drop(etcd);
    Report { calls, ready_after }
}
