//! The routing table: which instances are routable, grouped into routes, and admission of a
//! call onto one of them.
//!
//! A route is a service name, a capability name or a topic. Each route holds an immutable
//! snapshot of its members (`Arc<[Arc<InstanceEndpoint>]>`) replaced as a whole under the
//! table's write lock when a registry watch event changes it, so a call sees either the old
//! or the new member set, never a mix; a re-registered instance at a new address is swapped in
//! the same step (no stale-endpoint window). Calls pick synchronously from the snapshot with
//! the route's [`Policy`] (no buffer task or channel hop on the request path) and reserve a
//! slot under the instance's concurrency limit; when no instance has room they wait, bounded
//! in number and time, then are shed (see [`RoutingTable::reserve`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use reach_proto::v1::{Instance, InstanceSpec, InstanceState};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::balance::{self, NoPick, Policy, Random, ThreadRandom};
use crate::config::RouterConfig;
use crate::endpoint::{InstanceEndpoint, InstanceInfo, Reservation};
use crate::error::RouteError;
use crate::key::RouteKey;
use crate::load::{LoadTracker, Room};
use crate::metrics::{self, RouteMetrics};

/// `reach_router_shed_total`'s `reason` when a call is shed at once because
/// `admission.max_waiting` calls wait for room already.
pub const SHED_MAX_WAITING: &str = "max_waiting";
/// `reach_router_shed_total`'s `reason` when a call waited `admission.max_wait` (before its
/// own deadline) and no instance had room.
pub const SHED_MAX_WAIT: &str = "max_wait";

/// One route's members and policy at one moment.
#[derive(Debug)]
pub struct Route {
    /// What the route addresses.
    pub key: RouteKey,
    /// How it balances.
    pub policy: Policy,
    /// Its members, in instance-id order.
    pub members: Arc<[Arc<InstanceEndpoint>]>,
    /// For a capability route, the capability version each member declared, parsed once
    /// when the route was built (in `members` order; an empty or malformed version is
    /// `0.0.0`). Empty for other routes.
    pub versions: Arc<[semver::Version]>,
    /// Its call metrics, labelled with its name.
    pub metrics: Arc<RouteMetrics>,
    rr: AtomicUsize,
}

impl Route {
    /// Picks a member with the route's policy, skipping `excluded` instance ids, drawing
    /// from `random`.
    ///
    /// # Errors
    /// [`NoPick`] when no member can take a call now.
    pub fn pick(
        &self,
        excluded: &[Arc<str>],
        random: &dyn Random,
    ) -> Result<&Arc<InstanceEndpoint>, NoPick> {
        balance::pick(self.policy, &self.members, excluded, &self.rr, random)
    }

    /// The members with their declared capability versions (a capability route's; empty
    /// for other routes).
    pub fn member_versions(
        &self,
    ) -> impl Iterator<Item = (&Arc<InstanceEndpoint>, &semver::Version)> {
        self.members.iter().zip(self.versions.iter())
    }
}

/// The router's live view of the mesh. Shared by the watch loop (writer) and every call
/// (readers).
pub struct RoutingTable {
    config: RouterConfig,
    state: RwLock<State>,
    synced: watch::Sender<bool>,
    room: Arc<Room>,
    /// What replies from instances may hold in partly received messages.
    replies: reach_rpc::ReplyBudget,
    /// What the balancing policies draw from.
    random: Arc<dyn Random>,
    /// Certificates for the connections to instances, and the policy calls are held to.
    trust: Arc<reach_trust::Trust>,
    /// Woken when a registry restart starts a grace ([`RoutingTable::run_unconfirmed_expiry`]).
    unconfirmed_changed: tokio::sync::Notify,
}

#[derive(Default)]
struct State {
    members: HashMap<String, Member>,
    /// Instances the registry lists that are not routable now, by id.
    unroutable: HashMap<String, Unroutable>,
    routes: HashMap<RouteKey, Arc<Route>>,
    revision: u64,
    /// The epoch of the registry the revision belongs to ("" before the first snapshot).
    epoch: String,
    /// Members the registry no longer lists since it lost its state (a snapshot of a new
    /// epoch), kept routable until the deadline while they register again.
    unconfirmed: HashMap<String, Instant>,
}

/// An instance that is not routable (REGISTERED behind its health probe, DRAINING, or with
/// an endpoint the router cannot use): kept so that ROUTE_NOT_FOUND can say that the route
/// has instances but none is READY, and why.
struct Unroutable {
    keys: Vec<RouteKey>,
    state: InstanceState,
    why: String,
}

/// A routable instance: its declaration and its endpoint.
struct Member {
    spec: InstanceSpec,
    endpoint: Arc<InstanceEndpoint>,
    keys: Vec<RouteKey>,
}

/// A routable instance as the table sees it (for admin views and tests).
#[derive(Debug, Clone)]
pub struct RoutableInstance {
    /// The instance id.
    pub instance_id: String,
    /// Its service.
    pub service: String,
    /// Its endpoint URL.
    pub endpoint: String,
    /// Its state (READY or BUSY).
    pub state: InstanceState,
    /// Requests this router has in flight on it.
    pub pending: usize,
    /// Whether it is ejected now.
    pub ejected: bool,
    /// Whether it is kept from before a registry restart and has not registered again yet
    /// (see [`RoutingTable::apply_snapshot`]).
    pub unconfirmed: bool,
}

impl RoutingTable {
    /// An empty table; it becomes synced at the first registry snapshot. Balancing draws
    /// from an OS-seeded generator ([`ThreadRandom`]).
    pub fn new(config: RouterConfig) -> Arc<Self> {
        Self::with_random(config, Arc::new(ThreadRandom))
    }

    /// An empty table whose balancing draws from `random` (a [`crate::balance::SeededRandom`]
    /// makes random and weighted picks reproducible).
    pub fn with_random(config: RouterConfig, random: Arc<dyn Random>) -> Arc<Self> {
        Self::with_trust(config, random, reach_trust::Trust::disabled())
    }

    /// An empty table whose connections to instances use `trust`'s certificates: TLS, each
    /// instance required to present the identity of the service it registered as
    /// (`spiffe://<trust-domain>/agent/<service>`), so an address taken over by another
    /// process gets no calls.
    pub fn with_trust(
        config: RouterConfig,
        random: Arc<dyn Random>,
        trust: Arc<reach_trust::Trust>,
    ) -> Arc<Self> {
        Arc::new(Self {
            trust,
            random,
            state: RwLock::new(State::default()),
            synced: watch::Sender::new(false),
            unconfirmed_changed: tokio::sync::Notify::new(),
            room: Arc::new(Room::default()),
            replies: reach_rpc::ReplyBudget::new(
                config.max_buffered_reply_bytes_per_instance,
                config.max_buffered_reply_bytes,
            )
            .with_prefix_limit(config.prefix_limit()),
            config,
        })
    }

    /// The router configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The trust the router serves and connects with.
    pub fn trust(&self) -> &Arc<reach_trust::Trust> {
        &self.trust
    }

    /// Resolves after the first registry snapshot has been applied.
    pub async fn wait_synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|synced| *synced).await;
    }

    /// How many calls wait for room now (bounded by `admission.max_waiting`).
    pub fn waiting(&self) -> usize {
        self.room.waiting()
    }

    /// The gRPC services (typed pass-through) some routable instance serves, by full name,
    /// sorted.
    pub fn grpc_services(&self) -> Vec<String> {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        let mut names: Vec<String> = state
            .routes
            .keys()
            .filter_map(|key| match key {
                RouteKey::GrpcService(name) => Some(name.clone()),
                _ => None,
            })
            .collect();
        names.sort();
        names
    }

    /// The route's current snapshot, or `None` when no routable instance is on it.
    pub fn route(&self, key: &RouteKey) -> Option<Arc<Route>> {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        state.routes.get(key).cloned()
    }

    /// Reserves a slot on an instance of `key` for one call: picks with the route's policy,
    /// skipping `excluded` instance ids (already tried) and, when `allowed` is set, every
    /// instance not in it. When every instance is at its limit the call waits for room, at
    /// most `admission.max_wait` and until `deadline`, with at most `admission.max_waiting`
    /// calls waiting router-wide.
    ///
    /// # Errors
    /// [`RouteError::RouteNotFound`] when nothing serves `key`; [`RouteError::Overloaded`]
    /// when the call is shed; [`RouteError::DeadlineExceeded`] when the deadline passes first.
    pub async fn reserve(
        &self,
        key: &RouteKey,
        excluded: &[Arc<str>],
        allowed: Option<&HashSet<String>>,
        deadline: Option<Instant>,
        started: Instant,
    ) -> Result<Reservation, RouteError> {
        if let Some(reserved) = self.try_reserve(key, excluded, allowed)? {
            return Ok(reserved);
        }
        let admission = &self.config.admission;
        let Some(_waiting) = self.room.try_wait(admission.max_waiting) else {
            return Err(self.overloaded(key, SHED_MAX_WAITING));
        };
        let max_wait = Instant::now() + admission.max_wait;
        let limit = deadline.map_or(max_wait, |d| d.min(max_wait));
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(reserved) = self.try_reserve(key, excluded, allowed)? {
                return Ok(reserved);
            }
            if tokio::time::timeout_at(limit, notified).await.is_err() {
                if deadline.is_some_and(|d| d <= limit) {
                    return Err(RouteError::DeadlineExceeded(started.elapsed()));
                }
                return Err(self.overloaded(key, SHED_MAX_WAIT));
            }
        }
    }

    fn try_reserve(
        &self,
        key: &RouteKey,
        excluded: &[Arc<str>],
        allowed: Option<&HashSet<String>>,
    ) -> Result<Option<Reservation>, RouteError> {
        let route = self.route(key).ok_or_else(|| self.not_found(key))?;
        let filtered;
        let route = match allowed {
            Some(allowed) => {
                filtered = Route {
                    key: route.key.clone(),
                    policy: route.policy,
                    metrics: route.metrics.clone(),
                    members: route
                        .members
                        .iter()
                        .filter(|m| allowed.contains(&m.info().instance_id))
                        .cloned()
                        .collect(),
                    versions: Arc::from([]),
                    rr: AtomicUsize::new(route.rr.fetch_add(1, Ordering::Relaxed)),
                };
                &filtered
            }
            None => &*route,
        };
        // A pick can lose the race for the last slot; try a few times before waiting.
        for _ in 0..4 {
            match route.pick(excluded, &*self.random) {
                Ok(endpoint) => {
                    if let Some(reserved) = endpoint.try_reserve() {
                        return Ok(Some(reserved));
                    }
                }
                Err(NoPick::Full) => return Ok(None),
                Err(NoPick::Empty) => return Err(self.not_found(key)),
            }
        }
        Ok(None)
    }

    fn not_found(&self, key: &RouteKey) -> RouteError {
        if !*self.synced.borrow() {
            return RouteError::NotSynced {
                key: key.clone(),
                registry: self.config.registry_endpoint.clone(),
            };
        }
        let (capabilities, services) = self.summary();
        let mut unroutable: Vec<(String, &'static str, String)> = {
            let state = self.state.read().unwrap_or_else(|p| p.into_inner());
            state
                .unroutable
                .iter()
                .filter(|(_, u)| u.keys.contains(key))
                .map(|(id, u)| (id.clone(), u.state.short_name(), u.why.clone()))
                .collect()
        };
        unroutable.sort();
        RouteError::route_not_found(key.clone(), &capabilities, &services, &unroutable)
    }

    /// The refusal of a shed call, counted in `reach_router_shed_total` with `reason`.
    fn overloaded(&self, key: &RouteKey, reason: &'static str) -> RouteError {
        metrics::shed(key.label(), reason);
        RouteError::Overloaded {
            key: key.clone(),
            retry_after: self.config.admission.retry_after,
        }
    }

    /// Routable capabilities and services with their instance counts, for error messages.
    pub fn summary(&self) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        let mut capabilities = BTreeMap::new();
        let mut services = BTreeMap::new();
        for (key, route) in &state.routes {
            match key {
                RouteKey::Capability(name) => {
                    capabilities.insert(name.clone(), route.members.len());
                }
                RouteKey::Service(name) => {
                    services.insert(name.clone(), route.members.len());
                }
                RouteKey::Topic(_) | RouteKey::GrpcService(_) => {}
            }
        }
        (capabilities, services)
    }

    /// Every routable instance, sorted by id.
    pub fn instances(&self) -> Vec<RoutableInstance> {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let mut out: Vec<RoutableInstance> = state
            .members
            .iter()
            .map(|(id, m)| RoutableInstance {
                instance_id: id.clone(),
                service: m.spec.service.clone(),
                endpoint: m.spec.endpoint.clone(),
                state: m.endpoint.state(),
                pending: m.endpoint.load_tracker().pending(),
                ejected: m.endpoint.is_ejected(now),
                unconfirmed: state.unconfirmed.contains_key(id),
            })
            .collect();
        out.sort_by(|a, b| a.instance_id.cmp(&b.instance_id));
        out
    }

    /// The endpoint of instance `id`, if it is routable.
    pub fn endpoint(&self, id: &str) -> Option<Arc<InstanceEndpoint>> {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        state.members.get(id).map(|m| m.endpoint.clone())
    }

    /// The registry revision last applied.
    pub fn revision(&self) -> u64 {
        self.state
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .revision
    }

    /// The registry epoch and revision last applied: where a reconnecting watch resumes.
    pub fn position(&self) -> (String, u64) {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        (state.epoch.clone(), state.revision)
    }

    /// Replaces the whole view with a registry snapshot of `epoch` at `revision`.
    ///
    /// A snapshot of the epoch the table follows is the whole truth: members it lacks leave.
    /// A snapshot of a new epoch means the registry lost its state (an in-memory registry
    /// restarted) and its instances are registering again, so members it lacks stay
    /// routable, unconfirmed, for `registry_restart_grace` (0 drops them at once); each leaves
    /// when that grace ends unless it registers again first ([`RoutingTable::expire_unconfirmed`]).
    pub fn apply_snapshot(&self, revision: u64, epoch: &str, instances: Vec<Instance>) {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        let grace = self.config.registry_restart_grace;
        let restarted = !state.epoch.is_empty() && state.epoch != epoch && !grace.is_zero();
        let deadline = Instant::now() + grace;
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
        if restarted {
            // Every member is unconfirmed until the new registry lists it routable: the
            // upserts below confirm the ones that registered again already.
            let members: Vec<String> = state.members.keys().cloned().collect();
            for id in members {
                state.unconfirmed.entry(id).or_insert(deadline);
            }
        }
        let mut touched = HashSet::new();
        let mut kept = 0;
        for id in gone {
            if state.unconfirmed.contains_key(&id) {
                // Within its grace: it is likely registering again.
                kept += 1;
            } else {
                remove_member(&mut state, &id, &mut touched);
            }
        }
        state.unroutable.retain(|id, _| live.contains(id));
        for instance in instances {
            self.upsert_locked(&mut state, instance, &mut touched);
        }
        self.rebuild(&mut state, touched);
        let previous = std::mem::replace(&mut state.epoch, epoch.to_string());
        state.revision = revision;
        metrics::unconfirmed_instances(state.unconfirmed.len());
        drop(state);
        self.room.release();
        self.synced.send_replace(true);
        if restarted {
            self.unconfirmed_changed.notify_one();
            warn!(
                revision,
                from_epoch = %previous,
                to_epoch = %epoch,
                instances = live.len(),
                kept,
                grace = ?grace,
                "the registry restarted without its state; routing on to the instances it no longer lists while they register again"
            );
        } else {
            info!(
                revision,
                instances = live.len(),
                "routing table synced from registry snapshot"
            );
        }
    }

    /// Removes the unconfirmed members whose grace ended by `now` (they did not register
    /// again after a registry restart); returns when the next grace ends, if any is running.
    pub fn expire_unconfirmed(&self, now: Instant) -> Option<Instant> {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        let expired: Vec<String> = state
            .unconfirmed
            .iter()
            .filter(|(_, deadline)| **deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        let mut touched = HashSet::new();
        for id in &expired {
            state.unconfirmed.remove(id);
            remove_member(&mut state, id, &mut touched);
            warn!(instance = %id, "instance did not register again after the registry restarted; no longer routing to it");
        }
        self.rebuild(&mut state, touched);
        metrics::unconfirmed_instances(state.unconfirmed.len());
        state.unconfirmed.values().min().copied()
    }

    /// Runs [`RoutingTable::expire_unconfirmed`] whenever a grace ends, forever. Spawned by
    /// the registry watch.
    pub async fn run_unconfirmed_expiry(self: Arc<Self>) {
        loop {
            let next = self.expire_unconfirmed(Instant::now());
            match next {
                Some(at) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(at) => {}
                        () = self.unconfirmed_changed.notified() => {}
                    }
                }
                None => self.unconfirmed_changed.notified().await,
            }
        }
    }

    /// Applies an added or changed instance.
    pub fn apply_upsert(&self, revision: u64, instance: Instance) {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        let mut touched = HashSet::new();
        self.upsert_locked(&mut state, instance, &mut touched);
        self.rebuild(&mut state, touched);
        state.revision = revision;
        metrics::unconfirmed_instances(state.unconfirmed.len());
        drop(state);
        self.room.release();
    }

    /// Applies a removed instance.
    pub fn apply_remove(&self, revision: u64, instance: &Instance) {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        let mut touched = HashSet::new();
        if let Some(spec) = &instance.spec {
            remove_member(&mut state, &spec.instance_id, &mut touched);
            state.unroutable.remove(&spec.instance_id);
            state.unconfirmed.remove(&spec.instance_id);
        }
        self.rebuild(&mut state, touched);
        state.revision = revision;
        metrics::unconfirmed_instances(state.unconfirmed.len());
    }

    fn upsert_locked(
        &self,
        state: &mut State,
        instance: Instance,
        touched: &mut HashSet<RouteKey>,
    ) {
        let new_state = instance.state();
        let Some(spec) = instance.spec else { return };
        let routable = matches!(new_state, InstanceState::Ready | InstanceState::Busy);
        let id = spec.instance_id.clone();
        state.unroutable.remove(&id);
        if state.unconfirmed.contains_key(&id) {
            let same = state.members.get(&id).is_some_and(|m| m.spec == spec);
            if same && new_state == InstanceState::Registered {
                // Registering again after a registry restart, its health probe pending: it
                // stays routable (and unconfirmed) until the probe passes or its grace ends.
                return;
            }
            state.unconfirmed.remove(&id);
            if state.unconfirmed.is_empty() {
                info!("every instance kept through the registry restart is registered again");
            }
        }
        if let Some(member) = state.members.get(&id) {
            if routable && member.spec == spec {
                member.endpoint.set_state(new_state);
                return;
            }
            // Gone unroutable, or re-registered with another endpoint or capabilities: the old
            // endpoint leaves every route in the same step as the new one joins.
            remove_member(state, &id, touched);
        }
        if !routable {
            // A probe's error names what answered at the endpoint (refused, another
            // identity): with trust on it is for watchers and operators (`reach agents`), not
            // for every caller of the route — a registrant could read it back as a port scan.
            let why = if self.trust.is_enabled() && !instance.health_probe_error.is_empty() {
                "its health probe has not passed; `reach agents`, as an operator, shows why".into()
            } else {
                instance.health_probe_error
            };
            let unroutable = Unroutable {
                keys: route_keys(&spec),
                state: new_state,
                why,
            };
            state.unroutable.insert(id, unroutable);
            return;
        }
        let endpoint = match self.connect(&spec, new_state) {
            Ok(endpoint) => Arc::new(endpoint),
            Err(error) => {
                warn!(instance = %id, endpoint = %spec.endpoint, %error, "instance endpoint unusable; not routing to it");
                let unroutable = Unroutable {
                    keys: route_keys(&spec),
                    state: new_state,
                    why: format!(
                        "the router cannot use its endpoint {:?}: {error}",
                        spec.endpoint
                    ),
                };
                state.unroutable.insert(id, unroutable);
                return;
            }
        };
        let keys = route_keys(&spec);
        touched.extend(keys.iter().cloned());
        debug!(instance = %id, routes = keys.len(), "instance routable");
        state.members.insert(
            id,
            Member {
                spec,
                endpoint,
                keys,
            },
        );
    }

    /// Rebuilds the snapshots of the `touched` routes from the members.
    fn rebuild(&self, state: &mut State, touched: HashSet<RouteKey>) {
        if touched.is_empty() {
            return;
        }
        let mut by_key: HashMap<RouteKey, Vec<(&String, Arc<InstanceEndpoint>)>> =
            touched.iter().map(|k| (k.clone(), Vec::new())).collect();
        for (id, member) in &state.members {
            for key in &member.keys {
                if let Some(list) = by_key.get_mut(key) {
                    list.push((id, member.endpoint.clone()));
                }
            }
        }
        let mut routes = std::mem::take(&mut state.routes);
        for (key, mut list) in by_key {
            if list.is_empty() {
                routes.remove(&key);
                continue;
            }
            list.sort_by(|a, b| a.0.cmp(b.0));
            let policy = self.config.policy_for(key.name());
            // A rebuilt route keeps its metric handles.
            let metrics = routes.get(&key).map_or_else(
                || Arc::new(RouteMetrics::new(key.label())),
                |old| old.metrics.clone(),
            );
            let versions = match &key {
                RouteKey::Capability(name) => list
                    .iter()
                    .map(|(id, _)| declared_version(&state.members[*id].spec, name))
                    .collect(),
                _ => Arc::from([]),
            };
            routes.insert(
                key.clone(),
                Arc::new(Route {
                    metrics,
                    key,
                    policy,
                    members: list.into_iter().map(|(_, e)| e).collect(),
                    versions,
                    rr: AtomicUsize::new(0),
                }),
            );
        }
        state.routes = routes;
    }

    fn connect(
        &self,
        spec: &InstanceSpec,
        state: InstanceState,
    ) -> Result<InstanceEndpoint, tonic::transport::Error> {
        let endpoint = reach_rpc::http2::endpoint(spec.endpoint.clone())?
            .connect_timeout(self.config.connect_timeout);
        let expected = self
            .trust
            .tls()
            .and_then(|tls| reach_trust::Identity::agent(tls.trust_domain(), &spec.service).ok());
        let channel = reach_rpc::http2::channel_lazy(&endpoint, self.trust.tls(), expected);
        // Connect now, in the background, so the instance's first call does not pay (and its
        // first latency sample does not include) the TCP and HTTP/2 handshakes: peak-EWMA
        // takes a first sample as a peak, and an inflated one would keep a new instance out
        // of rotation for about `rtt_decay`. A failure here is only logged; calls reconnect.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let mut warm = channel.clone();
            let instance = spec.instance_id.clone();
            runtime.spawn(async move {
                if let Err(error) =
                    tower::ServiceExt::<http::Request<tonic::body::Body>>::ready(&mut warm).await
                {
                    debug!(%instance, %error, "could not connect ahead of the first call");
                }
            });
        }
        Ok(InstanceEndpoint::new(
            self.replies.meter(channel),
            InstanceInfo {
                instance_id: spec.instance_id.clone(),
                service: spec.service.clone(),
                endpoint: spec.endpoint.clone(),
                weight: spec.weight.max(1),
                max_concurrency: spec.max_concurrency,
                protocol_version: spec.protocol_version.clone(),
            },
            state,
            Arc::new(LoadTracker::new(
                self.config.default_rtt,
                self.config.rtt_decay,
            )),
            self.room.clone(),
            self.config.ejection.clone(),
            self.config.decoding_limit(),
        ))
    }
}

/// The version of `capability` that `spec` declared: `0.0.0` when it is empty or not semver
/// (such an instance matches only requirements that accept `0.0.0`).
fn declared_version(spec: &InstanceSpec, capability: &str) -> semver::Version {
    spec.capabilities
        .iter()
        .find(|c| c.name == capability)
        .and_then(|c| semver::Version::parse(&c.version).ok())
        .unwrap_or(semver::Version::new(0, 0, 0))
}

fn remove_member(state: &mut State, id: &str, touched: &mut HashSet<RouteKey>) {
    let Some(member) = state.members.remove(id) else {
        return;
    };
    touched.extend(member.keys);
    debug!(instance = %id, "instance no longer routable");
}

fn route_keys(spec: &InstanceSpec) -> Vec<RouteKey> {
    let mut keys = vec![RouteKey::Service(spec.service.clone())];
    let mut seen = HashSet::new();
    for capability in &spec.capabilities {
        if seen.insert(capability.name.as_str()) {
            keys.push(RouteKey::Capability(capability.name.clone()));
        }
    }
    let mut seen = HashSet::new();
    for topic in &spec.topics {
        if seen.insert(topic.as_str()) {
            keys.push(RouteKey::Topic(topic.clone()));
        }
    }
    let mut seen = HashSet::new();
    for service in &spec.grpc_services {
        if seen.insert(service.as_str()) {
            keys.push(RouteKey::GrpcService(service.clone()));
        }
    }
    keys
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use reach_proto::v1::{Instance, InstanceSpec, InstanceState};
    use tokio::time::Instant;

    use super::RoutingTable;
    use crate::config::RouterConfig;
    use crate::key::RouteKey;

    fn instance(id: &str, state: InstanceState) -> Instance {
        Instance {
            state: state as i32,
            spec: Some(InstanceSpec {
                service: "echo".into(),
                instance_id: id.into(),
                // Nothing listens there: the table connects lazily, calls are not made.
                endpoint: "http://127.0.0.1:9".into(),
                ..InstanceSpec::default()
            }),
            ..Instance::default()
        }
    }

    /// The route's member ids, and which are unconfirmed.
    fn members(table: &RoutingTable) -> (Vec<String>, Vec<String>) {
        let routed = table
            .route(&RouteKey::Service("echo".into()))
            .map(|route| {
                route
                    .members
                    .iter()
                    .map(|m| m.info().instance_id.clone())
                    .collect()
            })
            .unwrap_or_default();
        let unconfirmed = table
            .instances()
            .into_iter()
            .filter(|i| i.unconfirmed)
            .map(|i| i.instance_id)
            .collect();
        (routed, unconfirmed)
    }

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(ToString::to_string).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_registry_restart_keeps_known_instances_routable_until_they_register_again() {
        let table = RoutingTable::new(RouterConfig::default());
        let ready = InstanceState::Ready;
        table.apply_snapshot(7, "first", vec![instance("a", ready), instance("b", ready)]);
        assert_eq!(table.position(), ("first".to_string(), 7));
        // The registry comes back empty, with another epoch: both stay routable, unconfirmed.
        table.apply_snapshot(0, "second", vec![]);
        assert_eq!(members(&table), (ids(&["a", "b"]), ids(&["a", "b"])));
        // `a` registers again: while its probe is pending it keeps routing, then is confirmed.
        table.apply_upsert(1, instance("a", InstanceState::Registered));
        assert_eq!(members(&table), (ids(&["a", "b"]), ids(&["a", "b"])));
        table.apply_upsert(2, instance("a", ready));
        assert_eq!(members(&table), (ids(&["a", "b"]), ids(&["b"])));
        // A snapshot of the new epoch (a watcher that lagged) does not cut `b`'s grace short.
        table.apply_snapshot(2, "second", vec![instance("a", ready)]);
        assert_eq!(members(&table), (ids(&["a", "b"]), ids(&["b"])));
        // Two default lease TTLs later `b` has not come back: it leaves, `a` stays.
        let grace = RouterConfig::default().registry_restart_grace;
        assert_eq!(grace, Duration::from_secs(20));
        let next = table.expire_unconfirmed(Instant::now());
        assert!(next.is_some_and(|at| at <= Instant::now() + grace));
        tokio::time::advance(grace - Duration::from_millis(1)).await;
        assert!(table.expire_unconfirmed(Instant::now()).is_some());
        assert_eq!(members(&table).0, ids(&["a", "b"]));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(table.expire_unconfirmed(Instant::now()), None);
        assert_eq!(members(&table), (ids(&["a"]), ids(&[])));
    }

    #[tokio::test(start_paused = true)]
    async fn the_expiry_task_removes_what_was_not_confirmed_when_the_grace_ends() {
        let table = RoutingTable::new(RouterConfig::default());
        let expiry = tokio::spawn(table.clone().run_unconfirmed_expiry());
        table.apply_snapshot(3, "first", vec![instance("a", InstanceState::Ready)]);
        table.apply_snapshot(0, "second", vec![]);
        tokio::time::sleep(Duration::from_secs(19)).await;
        assert_eq!(members(&table).0, ids(&["a"]));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(members(&table).0, ids(&[]));
        expiry.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_snapshot_of_the_same_epoch_or_with_no_grace_is_the_whole_truth() {
        let ready = InstanceState::Ready;
        let table = RoutingTable::new(RouterConfig::default());
        table.apply_snapshot(1, "first", vec![instance("a", ready), instance("b", ready)]);
        // The same registry, after a reconnect whose events it no longer held.
        table.apply_snapshot(5, "first", vec![instance("a", ready)]);
        assert_eq!(members(&table), (ids(&["a"]), ids(&[])));
        // A re-registration that goes unroutable (drained) is not kept either.
        table.apply_snapshot(0, "second", vec![]);
        table.apply_upsert(1, instance("a", InstanceState::Draining));
        assert_eq!(members(&table), (ids(&[]), ids(&[])));

        let config = RouterConfig {
            registry_restart_grace: Duration::ZERO,
            ..RouterConfig::default()
        };
        let table = RoutingTable::new(config);
        table.apply_snapshot(1, "first", vec![instance("a", ready)]);
        table.apply_snapshot(0, "second", vec![]);
        assert_eq!(members(&table), (ids(&[]), ids(&[])));
    }
}
