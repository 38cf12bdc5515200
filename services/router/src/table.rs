//! The routing table: which instances are routable, and one tower p2c balancer per route.
//!
//! A route is a service name or a capability name. Each route owns a
//! `tower::balance::p2c::Balance` fed by a discovery channel; the table inserts and removes
//! instances on it as registry watch events arrive. Balancers sit behind a `tower::buffer`
//! so that many concurrent calls share one balancer.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use reach_proto::v1::{Instance, InstanceSpec, InstanceState};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tower::balance::p2c::Balance;
use tower::buffer::Buffer;
use tower::discover::Change;
use tower::util::BoxCloneSyncService;
use tracing::{debug, info, warn};

use crate::config::RouterConfig;
use crate::endpoint::{Forward, Forwarded, InstanceEndpoint, InstanceInfo};
use crate::load::LoadTracker;

/// How many calls may wait in one route's buffer for the balancer.
const ROUTE_BUFFER: usize = 1024;

/// A balanced handle on one route: call it to forward to the least loaded of two random
/// ready instances.
pub type RouteService = BoxCloneSyncService<Forward, Forwarded, tower::BoxError>;

/// What a message addresses.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RouteKey {
    /// Any instance of this service.
    Service(String),
    /// Any instance that serves this capability.
    Capability(String),
}

impl RouteKey {
    /// The route's name, for metric labels: the capability or service name.
    pub fn label(&self) -> &str {
        match self {
            RouteKey::Service(name) | RouteKey::Capability(name) => name,
        }
    }
}

impl std::fmt::Display for RouteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteKey::Service(name) => write!(f, "service {name:?}"),
            RouteKey::Capability(name) => write!(f, "capability {name:?}"),
        }
    }
}

/// The router's live view of the mesh. Shared by the watch loop (writer) and every call
/// (readers).
pub struct RoutingTable {
    config: RouterConfig,
    state: RwLock<State>,
    synced: watch::Sender<bool>,
}

#[derive(Default)]
struct State {
    members: HashMap<String, Member>,
    routes: HashMap<RouteKey, Route>,
    revision: u64,
}

struct Member {
    spec: InstanceSpec,
    state: InstanceState,
    endpoint: InstanceEndpoint,
    keys: Vec<RouteKey>,
}

struct Route {
    service: RouteService,
    changes: mpsc::UnboundedSender<Change<String, InstanceEndpoint>>,
    members: HashSet<String>,
}

/// A routable instance as the table sees it (for admin views and tests).
#[derive(Debug, Clone)]
pub struct RoutableInstance {
    /// The instance id.
    pub instance_id: String,
    /// Its service.
    pub service: String,
    /// Its state (READY or BUSY).
    pub state: InstanceState,
    /// Requests the router has in flight on it.
    pub pending: usize,
}

impl RoutingTable {
    /// An empty table; it becomes synced at the first registry snapshot.
    pub fn new(config: RouterConfig) -> Arc<Self> {
        Arc::new(Self {
            config,
            state: RwLock::new(State::default()),
            synced: watch::Sender::new(false),
        })
    }

    /// The router configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Resolves after the first registry snapshot has been applied.
    pub async fn wait_synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|synced| *synced).await;
    }

    /// The balanced service of a route, or `None` when no routable instance is on it.
    pub fn route(&self, key: &RouteKey) -> Option<RouteService> {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        state
            .routes
            .get(key)
            .filter(|route| !route.members.is_empty())
            .map(|route| route.service.clone())
    }

    /// Routable capabilities and services with their instance counts, for error messages.
    pub fn summary(&self) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        let mut capabilities = BTreeMap::new();
        let mut services = BTreeMap::new();
        for (key, route) in &state.routes {
            match key {
                RouteKey::Capability(name) => {
                    capabilities.insert(name.clone(), route.members.len())
                }
                RouteKey::Service(name) => services.insert(name.clone(), route.members.len()),
            };
        }
        (capabilities, services)
    }

    /// Every routable instance, sorted by id.
    pub fn instances(&self) -> Vec<RoutableInstance> {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<RoutableInstance> = state
            .members
            .iter()
            .map(|(id, m)| RoutableInstance {
                instance_id: id.clone(),
                service: m.spec.service.clone(),
                state: m.state,
                pending: m.endpoint.load_tracker().pending(),
            })
            .collect();
        out.sort_by(|a, b| a.instance_id.cmp(&b.instance_id));
        out
    }

    /// The registry revision last applied.
    pub fn revision(&self) -> u64 {
        self.state
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .revision
    }

    /// Replaces the whole view with a registry snapshot.
    pub fn apply_snapshot(&self, revision: u64, instances: Vec<Instance>) {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        let live: HashSet<String> = instances
            .iter()
            .filter_map(|i| i.spec.as_ref().map(|s| s.instance_id.clone()))
            .collect();
        let gone: Vec<String> = state
            .members
            .keys()
            .filter(|id| !live.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            remove_member(&mut state, &id);
        }
        for instance in instances {
            self.upsert_locked(&mut state, instance);
        }
        state.revision = revision;
        drop(state);
        self.synced.send_replace(true);
        info!(
            revision,
            instances = live.len(),
            "routing table synced from registry snapshot"
        );
    }

    /// Applies an added or changed instance.
    pub fn apply_upsert(&self, revision: u64, instance: Instance) {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        self.upsert_locked(&mut state, instance);
        state.revision = revision;
    }

    /// Applies a removed instance.
    pub fn apply_remove(&self, revision: u64, instance: &Instance) {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        if let Some(spec) = &instance.spec {
            remove_member(&mut state, &spec.instance_id);
        }
        state.revision = revision;
    }

    fn upsert_locked(&self, state: &mut State, instance: Instance) {
        let new_state = instance.state();
        let Some(spec) = instance.spec else { return };
        let routable = matches!(new_state, InstanceState::Ready | InstanceState::Busy);
        let id = spec.instance_id.clone();
        if let Some(member) = state.members.get_mut(&id) {
            if routable && member.spec == spec {
                member.state = new_state;
                return;
            }
            // Gone unroutable, or re-registered with another endpoint or capabilities: the old
            // connection leaves every route before any new one joins.
            remove_member(state, &id);
        }
        if !routable {
            return;
        }
        let endpoint = match self.connect(&spec) {
            Ok(endpoint) => endpoint,
            Err(error) => {
                warn!(instance = %id, endpoint = %spec.endpoint, %error, "instance endpoint unusable; not routing to it");
                return;
            }
        };
        let keys = route_keys(&spec);
        for key in &keys {
            let route = state.routes.entry(key.clone()).or_insert_with(new_route);
            route.members.insert(id.clone());
            let _ = route
                .changes
                .send(Change::Insert(id.clone(), endpoint.clone()));
        }
        debug!(instance = %id, routes = keys.len(), "instance routable");
        state.members.insert(
            id,
            Member {
                spec,
                state: new_state,
                endpoint,
                keys,
            },
        );
    }

    fn connect(&self, spec: &InstanceSpec) -> Result<InstanceEndpoint, tonic::transport::Error> {
        let channel = tonic::transport::Endpoint::from_shared(spec.endpoint.clone())?
            .connect_timeout(self.config.connect_timeout)
            .tcp_nodelay(true)
            .connect_lazy();
        Ok(InstanceEndpoint::new(
            channel,
            InstanceInfo {
                instance_id: spec.instance_id.clone(),
                service: spec.service.clone(),
                endpoint: spec.endpoint.clone(),
            },
            Arc::new(LoadTracker::new(
                self.config.default_rtt,
                self.config.rtt_decay,
            )),
            self.config.decoding_limit(),
        ))
    }
}

fn remove_member(state: &mut State, id: &str) {
    let Some(member) = state.members.remove(id) else {
        return;
    };
    for key in member.keys {
        if let Some(route) = state.routes.get_mut(&key) {
            route.members.remove(id);
            let _ = route.changes.send(Change::Remove(id.to_string()));
            if route.members.is_empty() {
                state.routes.remove(&key);
            }
        }
    }
    debug!(instance = %id, "instance no longer routable");
}

fn new_route() -> Route {
    let (changes, rx) = mpsc::unbounded_channel();
    let discover = UnboundedReceiverStream::new(rx).map(Ok::<_, Infallible>);
    let balance = Balance::new(discover);
    let service = BoxCloneSyncService::new(Buffer::new(balance, ROUTE_BUFFER));
    Route {
        service,
        changes,
        members: HashSet::new(),
    }
}

fn route_keys(spec: &InstanceSpec) -> Vec<RouteKey> {
    let mut keys = vec![RouteKey::Service(spec.service.clone())];
    let mut seen = HashSet::new();
    for capability in &spec.capabilities {
        if seen.insert(capability.name.as_str()) {
            keys.push(RouteKey::Capability(capability.name.clone()));
        }
    }
    keys
}
