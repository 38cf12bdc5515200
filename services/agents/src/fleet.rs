//! Starts the example fleet: ingest, coordinator and two executors per category, each on its
//! own ephemeral port (127.0.0.1 unless `FleetOptions::listen_host` says otherwise), registered
//! with the given registry.

use std::time::Duration;

use reach_proto::v1::ReachMessage;
use reach_sdk::runtime::RunningAgent;
use reach_sdk::{AgentConfig, AgentError, AgentRuntime, HandlerContext, MeshClient};
use tokio::net::TcpListener;

use crate::catalog::described;
use crate::classifier::Category;
use crate::coordinator::{DEFAULT_REVIEW_THRESHOLD, classify_handler, triage_handler};
use crate::decision::ComplaintClassifier;
use crate::ingest::{INGEST_CAPABILITY, TRIAGE_CAPABILITY, ingest_handler};

/// How big a fleet to start.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// Executor instances per category (at least 2 shows balancing).
    pub executors_per_category: usize,
    /// Coordinator instances.
    pub coordinators: usize,
    /// The coordinator's human-review threshold.
    pub review_threshold: f64,
    /// The lease TTL agents ask for.
    pub lease_ttl: Duration,
    /// How long a drain may take.
    pub max_drain: Duration,
    /// The coordinators' classifier: the rules (the default), or a model with the rules as
    /// its fallback.
    pub classifier: ComplaintClassifier,
    /// The address every agent listens on, each on an ephemeral port (127.0.0.1; `0.0.0.0`
    /// in a container, with `advertise_host` set).
    pub listen_host: std::net::IpAddr,
    /// The host the agents register for the router to dial (a pod IP, say); empty: the
    /// listen address, which must then not be a wildcard.
    pub advertise_host: String,
    /// Where each agent's certificate is (`agent-<service>.pem`, `agent-<service>-key.pem`
    /// and `ca.pem`, as `reach certs init` writes them), for a mesh that serves TLS: every
    /// agent then serves and connects over mutual TLS with its own. `None`: plaintext.
    pub tls_dir: Option<std::path::PathBuf>,
    /// The trust domain of the certificates in `tls_dir`.
    pub trust_domain: String,
}

impl Default for FleetOptions {
    fn default() -> Self {
        Self {
            executors_per_category: 2,
            coordinators: 1,
            review_threshold: DEFAULT_REVIEW_THRESHOLD,
            lease_ttl: Duration::from_secs(10),
            max_drain: Duration::from_secs(10),
            classifier: ComplaintClassifier::rules(),
            listen_host: std::net::Ipv4Addr::LOCALHOST.into(),
            advertise_host: String::new(),
            tls_dir: None,
            trust_domain: reach_trust::DEFAULT_TRUST_DOMAIN.into(),
        }
    }
}

/// A started agent and where it serves.
pub struct FleetMember {
    /// The running agent.
    pub agent: RunningAgent,
    /// Its service name.
    pub service: String,
    /// Its endpoint URL.
    pub endpoint: String,
}

/// The running example fleet.
pub struct Fleet {
    /// Every agent, in start order.
    pub members: Vec<FleetMember>,
}

impl Fleet {
    /// Starts the fleet. Agents call other agents through the router at `router_endpoint`.
    ///
    /// # Errors
    /// [`AgentError`] when an agent cannot start (bad endpoint, no port).
    pub async fn start(
        registry_endpoint: &str,
        router_endpoint: &str,
        options: &FleetOptions,
    ) -> Result<Self, AgentError> {
        let router = reach_rpc::http2::endpoint(router_endpoint)
            .map_err(|e| AgentError::Config(format!("router endpoint {router_endpoint:?}: {e}")))?;
        let tls = |service: &str| -> Result<Option<reach_trust::tls::TlsConfig>, AgentError> {
            let Some(dir) = &options.tls_dir else {
                return Ok(None);
            };
            let tls = reach_trust::tls::TlsConfig::new(
                dir.join(format!("agent-{service}.pem")),
                dir.join(format!("agent-{service}-key.pem")),
                dir.join("ca.pem"),
            );
            if let Some(missing) = [&tls.cert, &tls.key]
                .into_iter()
                .flatten()
                .find(|p| !p.is_file())
            {
                return Err(AgentError::Config(format!(
                    "the example agent {service} serves TLS with {}, which does not exist; `reach certs init --dir {}` makes the example agents' certificates (or start without them: --no-agents)",
                    missing.display(),
                    dir.display()
                )));
            }
            Ok(Some(tls))
        };
        // A client of the router presenting `service`'s certificate, when the mesh is TLS.
        let router_for = |service: &str| -> Result<tonic::transport::Channel, AgentError> {
            let source = tls(service)?
                .map(|tls| {
                    reach_trust::tls::TlsSource::load(&tls, &options.trust_domain)
                        .map_err(|e| AgentError::Config(format!("agent {service}: {e}")))
                })
                .transpose()?;
            Ok(reach_rpc::http2::channel_lazy(
                &router,
                source.as_ref(),
                None,
            ))
        };
        let config = |service: &str, index: usize| -> Result<AgentConfig, AgentError> {
            let config = AgentConfig::new(service, registry_endpoint)
                .with_instance_id(format!("{service}-{index}"))
                .with_lease_ttl(options.lease_ttl)
                .with_max_drain(options.max_drain)
                .with_advertise_host(&options.advertise_host)
                .with_trust_domain(&options.trust_domain);
            Ok(match tls(service)? {
                Some(tls) => config.with_tls(tls),
                None => config,
            })
        };
        let mut members = Vec::new();
        for category in Category::ALL {
            let service = format!("executor.{}", category.name());
            for index in 1..=options.executors_per_category {
                let runtime = AgentRuntime::new(config(&service, index)?).handle_described(
                    described(category.capability(), "1.0.0"),
                    move |ctx: HandlerContext, message: ReachMessage| {
                        crate::executor::handle(category, ctx, message)
                    },
                );
                members.push(start(runtime, &service, options.listen_host).await?);
            }
        }
        for index in 1..=options.coordinators.max(1) {
            let mesh = MeshClient::new(router_for("coordinator")?, format!("coordinator.{index}"));
            let threshold = options.review_threshold;
            let (triage, classify, stream) = (
                options.classifier.clone(),
                options.classifier.clone(),
                options.classifier.clone(),
            );
            let runtime = AgentRuntime::new(config("coordinator", index)?)
                .handle_described(
                    described(TRIAGE_CAPABILITY, "1.0.0"),
                    move |ctx, message| {
                        triage_handler(mesh.clone(), triage.clone(), threshold, ctx, message)
                    },
                )
                .handle_described(
                    described("complaint.classify", "1.0.0"),
                    move |ctx, message| classify_handler(classify.clone(), ctx, message),
                )
                .handle_stream("complaint.classify", "1.0.0", move |ctx, first, rest| {
                    crate::coordinator::classify_stream(stream.clone(), ctx, first, rest)
                });
            members.push(start(runtime, "coordinator", options.listen_host).await?);
        }
        let mesh = MeshClient::new(router_for("ingest")?, "ingest.1");
        let runtime = AgentRuntime::new(config("ingest", 1)?).handle_described(
            described(INGEST_CAPABILITY, "1.0.0"),
            move |ctx, message| ingest_handler(mesh.clone(), ctx, message),
        );
        members.push(start(runtime, "ingest", options.listen_host).await?);
        Ok(Self { members })
    }

    /// Drains every agent (they deregister), concurrently.
    pub async fn drain(self) {
        let drains = self.members.into_iter().map(|m| m.agent.drain());
        for result in futures::future::join_all(drains).await {
            if let Err(error) = result {
                tracing::warn!(%error, "agent did not drain cleanly");
            }
        }
    }
}

async fn start(
    runtime: AgentRuntime,
    service: &str,
    host: std::net::IpAddr,
) -> Result<FleetMember, AgentError> {
    let listener = TcpListener::bind((host, 0))
        .await
        .map_err(AgentError::Listener)?;
    let (agent, endpoint) = runtime.start(listener).await?;
    Ok(FleetMember {
        agent,
        service: service.to_string(),
        endpoint,
    })
}
