//! The instance table: leases, lifecycle states, revisions and watchers.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use reach_proto::v1::{
    Capability, Instance, InstanceSpec, InstanceState, ListCapabilitiesResponse,
    ListInstancesResponse, SnapshotCause, WatchResponse, WatchSnapshot, watch_response,
};
use tokio::sync::{Semaphore, broadcast};
use tokio::time::Instant;
use tracing::{debug, info};

use crate::config::RegistryConfig;
use crate::error::{InitError, RegistryError};

/// How many watch events a slow watcher may lag before it is resent a snapshot. Events
/// carry instances without capability descriptors, so the buffer holds small events.
const WATCH_BUFFER: usize = 4096;
/// How many of the latest events the registry keeps for watchers that resume after a
/// reconnect ([`WatchFrom::Resume`]); one further back is sent a snapshot.
pub const WATCH_HISTORY: usize = 4096;
/// The most the kept events may hold together, in bytes (encoded): large events keep fewer.
pub const WATCH_HISTORY_BYTES: usize = 16 * 1024 * 1024;
/// How many registrations' descriptors are checked (schemas compiled) at once, off the
/// async workers: at most one core goes to schema checking.
const CONCURRENT_CHECKS: usize = 1;
/// How long a registration waits for the schema checker when its request has no deadline.
const MAX_CHECK_WAIT: Duration = Duration::from_secs(30);

/// The registry: a table of instances with leases, shared by the gRPC service, the lease
/// sweeper and the health prober. Cloning shares the same table.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

struct Inner {
    config: RegistryConfig,
    /// This table's epoch: a random id drawn when the registry starts. Its revisions mean
    /// something only within it; a watcher that sees another epoch knows the state was lost.
    epoch: String,
    /// The protocol registry, loaded whenever `protocol_registry` is set: its descriptors
    /// are served by ListCapabilities, and strict mode checks registrations against it.
    protocols: Option<reach_protocol::ProtocolRegistry>,
    table: Mutex<Table>,
    /// Cancelled when the registry shuts down: open watch streams end.
    closed: tokio_util::sync::CancellationToken,
    /// Every change, in revision order. Sent while the table lock is held, so a watcher that
    /// subscribes under the lock sees exactly the changes after its snapshot.
    events: broadcast::Sender<Arc<WatchResponse>>,
    /// Permits to check descriptors on the blocking pool ([`CONCURRENT_CHECKS`]).
    checks: Arc<Semaphore>,
    /// Whether this table mirrors a store that owns the state ([`Registry::mirror`]): its
    /// changes arrive through the `apply_*` methods, and leases expire in the store.
    mirror: bool,
    /// The latest revision the table holds: what [`Registry::applied`] waits on.
    applied: tokio::sync::watch::Sender<u64>,
}

#[derive(Default)]
struct Table {
    instances: HashMap<String, Entry>,
    /// Leases of instances an operator drained, with when: their heartbeats are answered
    /// INSTANCE_DRAINED (not LEASE_NOT_FOUND) so they do not register again. Kept 10 min.
    drained_leases: HashMap<String, Instant>,
    /// Increases by one with every change.
    revision: u64,
    /// The latest events (at most [`WATCH_HISTORY`], [`WATCH_HISTORY_BYTES`] together),
    /// oldest first, one per revision, each with its encoded size: what a resumed watch
    /// replays. Shared with the broadcast: a replay copies no event.
    history: VecDeque<(Arc<WatchResponse>, usize)>,
    /// The encoded bytes `history` holds.
    history_bytes: usize,
    /// Every event with a revision above this one is in `history`: a watcher that applied
    /// `history_floor` or later can resume. Revisions of a mirrored store are sparse, so
    /// coverage is kept as a floor rather than inferred from the oldest event's revision.
    history_floor: u64,
}

impl Table {
    /// The ids of every instance of `service`.
    fn ids_of_service(&self, service: &str) -> Vec<String> {
        self.instances
            .values()
            .filter(|e| service_of(&e.instance) == service)
            .map(|e| instance_id(&e.instance).to_string())
            .collect()
    }
}

struct Entry {
    /// The instance as Watch and ListInstances show it: capabilities without descriptors.
    instance: Instance,
    /// The capabilities as registered, descriptors included (for ListCapabilities).
    capabilities: Vec<Capability>,
    /// When the lease ends unless renewed.
    lease_deadline: Instant,
    /// The granted lease TTL; every heartbeat extends the lease by it.
    lease_ttl: Duration,
    /// Whether the first health probe passed (or probing is off).
    probed: bool,
    /// The registry revision of the registration: orders registrations by recency (the
    /// latest one's capability descriptors win in ListCapabilities).
    registered: u64,
    /// The identity that registered it ([`reach_trust::Caller::name`]; `anonymous` when
    /// trust is off): while its lease lives, no other identity may register the same id.
    owner: String,
}

impl Entry {
    /// The entry of `instance` as registered (descriptors included): shown without its
    /// descriptors, its lease renewed from now.
    fn of(
        instance: &Instance,
        owner: String,
        lease_ttl: Duration,
        probed: bool,
        registered: u64,
    ) -> Self {
        Self {
            instance: without_descriptors(instance),
            capabilities: instance
                .spec
                .as_ref()
                .map(|s| s.capabilities.clone())
                .unwrap_or_default(),
            lease_deadline: Instant::now() + lease_ttl,
            lease_ttl,
            probed,
            registered,
            owner,
        }
    }
}

/// The load an instance reports with a heartbeat.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Messages in flight.
    pub in_flight: u32,
    /// Model (LLM) calls in flight.
    pub model_calls_in_flight: u32,
    /// Model calls it could start at once now.
    pub model_slots_free: u32,
}

impl Load {
    /// Whether every model slot is taken while model calls run: the instance is model-bound.
    pub fn model_bound(&self) -> bool {
        self.model_calls_in_flight > 0 && self.model_slots_free == 0
    }
}

/// A registration whose spec passed [`check_spec`]: ready for [`Registry::register_checked`].
#[derive(Debug, Clone)]
pub struct CheckedSpec(InstanceSpec);

impl CheckedSpec {
    /// The checked spec.
    pub fn spec(&self) -> &InstanceSpec {
        &self.0
    }
}

/// `endpoint` with any user info (`user:password@`) replaced by `…@`, for error messages.
fn redact_user_info(endpoint: &str) -> String {
    match (endpoint.find("://"), endpoint.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}…{}", &endpoint[..scheme_end + 3], &endpoint[at..])
        }
        _ => endpoint.to_string(),
    }
}

/// Checks a registration's spec: names, endpoint, bounds, and every capability's
/// descriptor (schemas are compiled, so this is CPU-bound: the gRPC service runs it with
/// [`Registry::check_off_worker`]).
///
/// # Errors
/// [`RegistryError::InvalidRegistration`] naming the bad field,
/// [`RegistryError::InvalidCapability`] for a capability's bad description or schema.
pub fn check_spec(spec: InstanceSpec) -> Result<CheckedSpec, RegistryError> {
    validate_spec(&spec)?;
    Ok(CheckedSpec(spec))
}

/// Where a watch starts ([`Registry::watch_from`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchFrom<'a> {
    /// A snapshot of every instance ([`SnapshotCause::Start`]).
    Snapshot,
    /// A snapshot for a watcher that fell behind ([`SnapshotCause::Lagged`]).
    Lagged,
    /// The events after `after_revision` of `epoch`: what a reconnecting watcher missed.
    Resume {
        /// The epoch of the stream the watcher read before.
        epoch: &'a str,
        /// The revision of the last event it applied.
        after_revision: u64,
    },
}

/// An accepted registration.
#[derive(Debug, Clone)]
pub struct Registration {
    /// The new lease id.
    pub lease_id: String,
    /// The granted lease TTL.
    pub lease_ttl: Duration,
    /// The instance as registered.
    pub instance: Instance,
}

impl Registry {
    /// An empty registry. Call [`Registry::run_sweeper`] to expire leases.
    ///
    /// # Errors
    /// [`InitError::Config`] for a setting out of range, [`InitError::ProtocolRegistry`]
    /// when the configured protocol registry cannot be loaded.
    pub fn new(config: RegistryConfig) -> Result<Self, InitError> {
        Self::build(config, uuid::Uuid::new_v4().simple().to_string(), false)
    }

    /// An empty table that mirrors a store owning the state (the etcd backend): its epoch is
    /// the store's, its revisions are the store's, and changes arrive through
    /// [`Registry::apply_put`], [`Registry::apply_delete`] and [`Registry::apply_reset`].
    /// Leases expire in the store, not here.
    ///
    /// # Errors
    /// As [`Registry::new`].
    pub fn mirror(config: RegistryConfig, epoch: String) -> Result<Self, InitError> {
        Self::build(config, epoch, true)
    }

    fn build(config: RegistryConfig, epoch: String, mirror: bool) -> Result<Self, InitError> {
        config.validate()?;
        let protocols = match &config.protocol_registry {
            Some(path) => Some(reach_protocol::ProtocolRegistry::load(path)?),
            None => None,
        };
        let (events, _) = broadcast::channel(WATCH_BUFFER);
        Ok(Self {
            inner: Arc::new(Inner {
                epoch,
                protocols,
                config,
                table: Mutex::new(Table::default()),
                closed: tokio_util::sync::CancellationToken::new(),
                events,
                checks: Arc::new(Semaphore::new(CONCURRENT_CHECKS)),
                mirror,
                applied: tokio::sync::watch::Sender::new(0),
            }),
        })
    }

    /// Ends every open watch stream (at shutdown, so that graceful shutdown is not held up by
    /// watchers, which reconnect to another replica).
    pub fn close_watches(&self) {
        self.inner.closed.cancel();
    }

    /// Resolves when [`Registry::close_watches`] is called.
    pub async fn watches_closed(&self) {
        self.inner.closed.cancelled().await;
    }

    /// The registry's epoch (32 hex digits, drawn at start-up): every Watch event carries it.
    pub fn epoch(&self) -> &str {
        &self.inner.epoch
    }

    /// The registry's configuration.
    pub fn config(&self) -> &RegistryConfig {
        &self.inner.config
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.inner
            .table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers (or replaces) an instance and grants a lease of `requested_ttl`, clamped to
    /// the configured bounds. The instance is REGISTERED until its health probe passes, or
    /// READY at once when probing is off.
    ///
    /// # Errors
    /// [`RegistryError::InvalidRegistration`] naming the bad field,
    /// [`RegistryError::InvalidCapability`] for a capability's bad description or schema,
    /// [`RegistryError::CapabilityNotDeclared`] in strict mode.
    pub fn register(
        &self,
        spec: InstanceSpec,
        requested_ttl: Option<Duration>,
    ) -> Result<Registration, RegistryError> {
        self.register_checked(check_spec(spec)?, requested_ttl)
    }

    /// Runs `check` (CPU-bound work such as [`check_spec`]) on tokio's blocking pool, at
    /// most [`CONCURRENT_CHECKS`] at once, so that compiling schemas never stalls the async
    /// workers serving other calls. A check waits for its turn at most `deadline` (the
    /// request's deadline; 30 s when it has none).
    ///
    /// # Errors
    /// [`RegistryError::CheckerBusy`] when the turn did not come within the deadline.
    pub async fn check_off_worker<T: Send + 'static>(
        &self,
        deadline: Option<Duration>,
        check: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, RegistryError> {
        let wait = deadline.unwrap_or(MAX_CHECK_WAIT).min(MAX_CHECK_WAIT);
        let permit = tokio::time::timeout(wait, Arc::clone(&self.inner.checks).acquire_owned())
            .await
            .map_err(|_| RegistryError::CheckerBusy(wait))?
            .map_err(|_| RegistryError::CheckerBusy(wait))?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            check()
        })
        .await
        .map_err(|e| {
            // A panicking check is a registry bug; the caller sees INTERNAL, not a hang.
            RegistryError::Internal(format!("the descriptor check failed: {e}"))
        })
    }

    /// [`Registry::register`] of a spec [`check_spec`] already passed, owned by `anonymous`
    /// (see [`Registry::register_owned`]).
    ///
    /// # Errors
    /// [`RegistryError::CapabilityNotDeclared`] in strict mode;
    /// [`RegistryError::NotOwner`] when another identity holds the instance id.
    pub fn register_checked(
        &self,
        spec: CheckedSpec,
        requested_ttl: Option<Duration>,
    ) -> Result<Registration, RegistryError> {
        self.register_owned(spec, requested_ttl, reach_trust::Caller::ANONYMOUS)
    }

    /// [`Registry::register_checked`] by `owner` (the registering caller's identity). An
    /// instance id whose lease lives belongs to the identity that registered it: the same
    /// identity may register it again (replacing the lease), another may not.
    ///
    /// # Errors
    /// [`RegistryError::CapabilityNotDeclared`] in strict mode;
    /// [`RegistryError::NotOwner`] when another identity holds the instance id.
    pub fn register_owned(
        &self,
        spec: CheckedSpec,
        requested_ttl: Option<Duration>,
        owner: &str,
    ) -> Result<Registration, RegistryError> {
        let CheckedSpec(spec) = spec;
        self.check_declared(&spec)?;
        let ttl = self.inner.config.grant(requested_ttl);
        let lease_id = uuid::Uuid::new_v4().simple().to_string();
        let probed = !self.inner.config.health_probe;
        let now = SystemTime::now();
        let mut table = self.table();
        if let Some(held) = table.instances.get(&spec.instance_id)
            && held.owner != owner
            && held.lease_deadline > Instant::now()
        {
            return Err(RegistryError::NotOwner {
                identity: owner.to_string(),
                instance_id: spec.instance_id.clone(),
                owner: held.owner.clone(),
            });
        }
        table.revision += 1;
        let instance = Instance {
            state: if probed {
                InstanceState::Ready
            } else {
                InstanceState::Registered
            } as i32,
            in_flight: 0,
            model_calls_in_flight: 0,
            model_slots_free: 0,
            health_probe_error: String::new(),
            lease_id: lease_id.clone(),
            lease_expires_at: Some(reach_rpc::time::timestamp(now + ttl)),
            registered_at: Some(reach_rpc::time::timestamp(now)),
            revision: table.revision,
            spec: Some(spec),
        };
        let id = instance_id(&instance).to_string();
        let revision = table.revision;
        info!(instance = %id, service = %service_of(&instance), lease_ttl = ?ttl, "instance registered");
        let entry = Entry::of(&instance, owner.to_string(), ttl, probed, revision);
        let shown = entry.instance.clone();
        table.instances.insert(id, entry);
        self.publish(&mut table, watch_response::Event::Upserted(shown));
        Ok(Registration {
            lease_id,
            lease_ttl: ttl,
            instance,
        })
    }

    /// In strict mode, checks that every capability of `spec` is declared in the protocol
    /// registry.
    ///
    /// # Errors
    /// [`RegistryError::CapabilityNotDeclared`] naming the first undeclared capability.
    pub fn check_declared(&self, spec: &InstanceSpec) -> Result<(), RegistryError> {
        if let Some(protocols) = self
            .inner
            .protocols
            .as_ref()
            .filter(|_| self.inner.config.strict)
        {
            for capability in &spec.capabilities {
                protocols
                    .check_declared(&capability.name, &capability.version)
                    .map_err(RegistryError::CapabilityNotDeclared)?;
            }
        }
        Ok(())
    }

    /// Marks the first health probe of `lease_id` as passed: REGISTERED becomes READY.
    /// Does nothing when the lease has since been replaced or removed.
    pub fn probe_passed(&self, instance_id: &str, lease_id: &str) {
        let mut table = self.table();
        let Some(entry) = table.instances.get_mut(instance_id) else {
            return;
        };
        if entry.instance.lease_id != lease_id || entry.probed {
            return;
        }
        entry.probed = true;
        entry.instance.health_probe_error.clear();
        if entry.instance.state == InstanceState::Registered as i32 {
            entry.instance.state = InstanceState::Ready as i32;
        }
        debug!(instance = %instance_id, "health probe passed");
        self.touch_and_publish(&mut table, instance_id);
    }

    /// Records why the first health probe of `lease_id` failed, shown as the instance's
    /// `health_probe_error` (in `reach agents` and Watch) while it stays REGISTERED. Returns
    /// whether the reason changed (the caller logs each new reason once); does nothing, and
    /// returns false, when the lease has been replaced or removed or the probe has passed.
    pub fn probe_failed(&self, instance_id: &str, lease_id: &str, reason: &str) -> bool {
        let mut table = self.table();
        let Some(entry) = table.instances.get_mut(instance_id) else {
            return false;
        };
        if entry.instance.lease_id != lease_id
            || entry.probed
            || entry.instance.health_probe_error == reason
        {
            return false;
        }
        entry.instance.health_probe_error = reason.to_string();
        self.touch_and_publish(&mut table, instance_id);
        true
    }

    /// The identity that registered `instance_id` when `lease_id` is its live lease (`None`
    /// for an unknown instance or another lease).
    pub fn owner_of(&self, instance_id: &str, lease_id: &str) -> Option<String> {
        self.table()
            .instances
            .get(instance_id)
            .filter(|e| e.instance.lease_id == lease_id)
            .map(|e| e.owner.clone())
    }

    /// Whether `lease_id` is still the live lease of `instance_id`.
    pub fn holds_lease(&self, instance_id: &str, lease_id: &str) -> bool {
        self.table()
            .instances
            .get(instance_id)
            .is_some_and(|e| e.instance.lease_id == lease_id)
    }

    /// Renews the lease and records the state and messages in flight the instance reports
    /// ([`Registry::heartbeat_load`] with no model calls).
    ///
    /// # Errors
    /// As [`Registry::heartbeat_load`].
    pub fn heartbeat(
        &self,
        instance_id: &str,
        lease_id: &str,
        reported: InstanceState,
        in_flight: u32,
    ) -> Result<(SystemTime, InstanceState), RegistryError> {
        let load = Load {
            in_flight,
            ..Load::default()
        };
        self.heartbeat_load(instance_id, lease_id, reported, load)
    }

    /// Renews the lease and records the state and load the instance reports. A READY report
    /// of a model-bound instance ([`Load::model_bound`]) is recorded as BUSY.
    ///
    /// DRAINING is final: an instance that reported it never becomes READY again on this lease.
    ///
    /// # Errors
    /// [`RegistryError::LeaseNotFound`] when the instance or lease is unknown or expired,
    /// [`RegistryError::Drained`] when an operator drained it.
    pub fn heartbeat_load(
        &self,
        instance_id: &str,
        lease_id: &str,
        reported: InstanceState,
        load: Load,
    ) -> Result<(SystemTime, InstanceState), RegistryError> {
        let mut table = self.table();
        if table.drained_leases.contains_key(lease_id) {
            return Err(RegistryError::Drained(instance_id.to_string()));
        }
        let not_found = || RegistryError::LeaseNotFound {
            instance_id: instance_id.to_string(),
            lease_id: lease_id.to_string(),
        };
        let entry = table.instances.get_mut(instance_id).ok_or_else(not_found)?;
        if entry.instance.lease_id != lease_id {
            return Err(not_found());
        }
        let ttl = entry.lease_ttl;
        entry.lease_deadline = Instant::now() + ttl;
        let expires = SystemTime::now() + ttl;
        entry.instance.lease_expires_at = Some(reach_rpc::time::timestamp(expires));
        let (next, changed) = apply_report(&mut entry.instance, entry.probed, reported, load);
        if changed {
            self.touch_and_publish(&mut table, instance_id);
        }
        Ok((expires, next))
    }

    /// Removes an instance at once.
    ///
    /// # Errors
    /// [`RegistryError::LeaseNotFound`] when the instance or lease is unknown.
    pub fn deregister(&self, instance_id: &str, lease_id: &str) -> Result<(), RegistryError> {
        let mut table = self.table();
        match table.instances.get(instance_id) {
            Some(entry) if entry.instance.lease_id == lease_id => {}
            _ => {
                return Err(RegistryError::LeaseNotFound {
                    instance_id: instance_id.to_string(),
                    lease_id: lease_id.to_string(),
                });
            }
        }
        info!(instance = %instance_id, "instance deregistered");
        self.remove(&mut table, instance_id);
        Ok(())
    }

    /// Drains every instance of `service` (an operator's removal): each becomes DRAINING at
    /// once, so routers stop sending it work, and is removed when it reports no work in flight
    /// or after `grace`, whichever comes first. Returns the drained instance ids.
    pub fn drain_service(&self, service: &str, grace: Duration) -> Vec<String> {
        let ids: Vec<String> = {
            let mut table = self.table();
            let ids = table.ids_of_service(service);
            let now = Instant::now();
            table
                .drained_leases
                .retain(|_, at| now.duration_since(*at) < Duration::from_secs(600));
            for id in &ids {
                let lease = table.instances.get(id).map(|e| e.instance.lease_id.clone());
                if let Some(lease) = lease {
                    table.drained_leases.insert(lease, now);
                }
                if let Some(entry) = table.instances.get_mut(id) {
                    entry.instance.state = InstanceState::Draining as i32;
                }
                info!(instance = %id, "instance drained by an operator");
                self.touch_and_publish(&mut table, id);
            }
            ids
        };
        let registry = self.clone();
        let draining = ids.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + grace;
            let mut pending = draining;
            while !pending.is_empty() {
                let idle: Vec<String> = {
                    let table = registry.table();
                    pending
                        .iter()
                        .filter(|id| {
                            table
                                .instances
                                .get(*id)
                                .is_none_or(|e| e.instance.in_flight == 0)
                        })
                        .cloned()
                        .collect()
                };
                let overdue = Instant::now() >= deadline;
                {
                    let mut table = registry.table();
                    pending.retain(|id| {
                        if overdue || idle.contains(id) {
                            registry.remove(&mut table, id);
                            false
                        } else {
                            true
                        }
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        ids
    }

    /// Removes every instance of `service` (an operator's forced removal). Returns how many.
    pub fn remove_service(&self, service: &str) -> usize {
        let mut table = self.table();
        let ids = table.ids_of_service(service);
        for id in &ids {
            self.remove(&mut table, id);
        }
        ids.len()
    }

    /// Expires every lease whose deadline has passed; returns the expired instance ids. A
    /// mirror expires nothing (its store does).
    pub fn expire_leases(&self) -> Vec<String> {
        if self.inner.mirror {
            return Vec::new();
        }
        let now = Instant::now();
        let mut table = self.table();
        let expired: Vec<String> = table
            .instances
            .iter()
            .filter(|(_, e)| e.lease_deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &expired {
            info!(instance = %id, "lease expired");
            crate::metrics::lease_expired();
            self.remove(&mut table, id);
        }
        expired
    }

    /// Expires leases every `sweep_interval`, forever. Spawn it next to the service.
    pub async fn run_sweeper(self) {
        let mut tick = tokio::time::interval(self.inner.config.sweep_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.expire_leases();
        }
    }

    /// The instances matching the filters (empty filters match all), sorted by service then
    /// instance id, and the current revision. Their capabilities carry no descriptors
    /// (see [`Registry::list_capabilities`]).
    pub fn list(&self, service: &str, capability: &str) -> ListInstancesResponse {
        let table = self.table();
        let mut instances: Vec<Instance> = table
            .instances
            .values()
            .map(|e| e.instance.clone())
            .filter(|i| service.is_empty() || service_of(i) == service)
            .filter(|i| {
                capability.is_empty()
                    || i.spec
                        .as_ref()
                        .is_some_and(|s| s.capabilities.iter().any(|c| c.name == capability))
            })
            .collect();
        instances
            .sort_by(|a, b| (service_of(a), instance_id(a)).cmp(&(service_of(b), instance_id(b))));
        ListInstancesResponse {
            instances,
            revision: table.revision,
        }
    }

    /// The merged capability descriptors whose name starts with `name_prefix` ("" for all),
    /// sorted by name, and the current revision; see [`crate::capabilities`] for the rules.
    pub fn list_capabilities(&self, name_prefix: &str) -> ListCapabilitiesResponse {
        self.list_capabilities_page(name_prefix, "", usize::MAX)
    }

    /// One page of [`Registry::list_capabilities`]: at most `limit` descriptors whose names
    /// sort after `after` ("" for the first page); `next_page_token` is the page's last name
    /// when more follow, else empty.
    pub fn list_capabilities_page(
        &self,
        name_prefix: &str,
        after: &str,
        limit: usize,
    ) -> ListCapabilitiesResponse {
        let table = self.table();
        let registered: Vec<crate::capabilities::Registered<'_>> = table
            .instances
            .values()
            .map(|e| crate::capabilities::Registered {
                instance: &e.instance,
                capabilities: &e.capabilities,
                registered: e.registered,
            })
            .collect();
        let (capabilities, more) = crate::capabilities::merge_page(
            self.inner.protocols.as_ref(),
            &registered,
            name_prefix,
            after,
            limit,
        );
        let next_page_token = if more {
            capabilities
                .last()
                .map(|c| c.name.clone())
                .unwrap_or_default()
        } else {
            String::new()
        };
        ListCapabilitiesResponse {
            capabilities,
            revision: table.revision,
            next_page_token,
        }
    }

    /// Starts a watch: the snapshot at the current revision and a receiver of every later
    /// change, with no gap and no overlap between the two.
    pub fn watch(&self) -> (WatchResponse, broadcast::Receiver<Arc<WatchResponse>>) {
        let table = self.table();
        let receiver = self.inner.events.subscribe();
        (self.snapshot_of(&table, SnapshotCause::Start), receiver)
    }

    /// Starts a watch `from` a snapshot or a resume point: the events to send first (a
    /// snapshot, or on a resume exactly the events after the watcher's revision, possibly
    /// none) and a receiver of every later change, with no gap and no overlap.
    ///
    /// A resume gets a snapshot instead when `epoch` is not this registry's
    /// ([`SnapshotCause::EpochChanged`]) or the events after `after_revision` are no longer
    /// held, or were never reached ([`SnapshotCause::Compacted`]).
    pub fn watch_from(
        &self,
        from: WatchFrom<'_>,
    ) -> (
        Vec<Arc<WatchResponse>>,
        broadcast::Receiver<Arc<WatchResponse>>,
    ) {
        let table = self.table();
        let receiver = self.inner.events.subscribe();
        let snapshot = |cause| vec![Arc::new(self.snapshot_of(&table, cause))];
        let first = match from {
            WatchFrom::Snapshot => snapshot(SnapshotCause::Start),
            WatchFrom::Lagged => snapshot(SnapshotCause::Lagged),
            WatchFrom::Resume { epoch, .. } if epoch != self.inner.epoch => {
                snapshot(SnapshotCause::EpochChanged)
            }
            WatchFrom::Resume { after_revision, .. } if after_revision == table.revision => {
                Vec::new()
            }
            WatchFrom::Resume { after_revision, .. } => {
                let covered =
                    table.history_floor <= after_revision && after_revision < table.revision;
                if covered {
                    table
                        .history
                        .iter()
                        .filter(|(event, _)| event.revision > after_revision)
                        .map(|(event, _)| Arc::clone(event))
                        .collect()
                } else {
                    snapshot(SnapshotCause::Compacted)
                }
            }
        };
        (first, receiver)
    }

    fn snapshot_of(&self, table: &Table, cause: SnapshotCause) -> WatchResponse {
        WatchResponse {
            revision: table.revision,
            epoch: self.inner.epoch.clone(),
            event: Some(watch_response::Event::Snapshot(WatchSnapshot {
                instances: table
                    .instances
                    .values()
                    .map(|e| e.instance.clone())
                    .collect(),
                cause: cause as i32,
                continues: false,
            })),
        }
    }

    fn remove(&self, table: &mut Table, id: &str) {
        if let Some(mut entry) = table.instances.remove(id) {
            table.revision += 1;
            entry.instance.state = InstanceState::Offline as i32;
            entry.instance.revision = table.revision;
            self.publish(table, watch_response::Event::Removed(entry.instance));
        }
    }

    fn touch_and_publish(&self, table: &mut Table, id: &str) {
        table.revision += 1;
        let revision = table.revision;
        if let Some(entry) = table.instances.get_mut(id) {
            entry.instance.revision = revision;
            let instance = entry.instance.clone();
            self.publish(table, watch_response::Event::Upserted(instance));
        }
    }

    fn publish(&self, table: &mut Table, event: watch_response::Event) {
        record_state_counts(table);
        let event = WatchResponse {
            revision: table.revision,
            epoch: self.inner.epoch.clone(),
            event: Some(event),
        };
        let event = Arc::new(event);
        let bytes = prost::Message::encoded_len(&*event);
        table.history.push_back((Arc::clone(&event), bytes));
        table.history_bytes += bytes;
        while table.history.len() > WATCH_HISTORY
            || (table.history_bytes > WATCH_HISTORY_BYTES && table.history.len() > 1)
        {
            if let Some((dropped, bytes)) = table.history.pop_front() {
                table.history_bytes -= bytes;
                table.history_floor = dropped.revision;
            }
        }
        // No receivers is fine: nobody watches yet.
        let _ = self.inner.events.send(event);
        self.inner.applied.send_replace(table.revision);
    }

    /// The instance `instance_id` as its store holds it (descriptors included), with the
    /// revision it was last changed at; `None` when it is not in the table.
    pub fn held(&self, instance_id: &str) -> Option<(Held, u64)> {
        let table = self.table();
        let entry = table.instances.get(instance_id)?;
        let mut instance = entry.instance.clone();
        if let Some(spec) = instance.spec.as_mut() {
            spec.capabilities.clone_from(&entry.capabilities);
        }
        let held = Held {
            instance,
            owner: entry.owner.clone(),
            lease_ttl: entry.lease_ttl,
            probed: entry.probed,
        };
        Some((held, entry.instance.revision))
    }

    /// The instances (descriptors included) a mirror holds, with their revisions: what the
    /// etcd backend's prober scans.
    pub fn held_all(&self) -> Vec<(Held, u64)> {
        let ids: Vec<String> = self.table().instances.keys().cloned().collect();
        ids.iter().filter_map(|id| self.held(id)).collect()
    }

    /// Mirrors a store's write of `held` at `revision`: the instance is added or replaced and
    /// watchers are sent it.
    pub fn apply_put(&self, held: Held, revision: u64) {
        let Held {
            mut instance,
            owner,
            lease_ttl,
            probed,
        } = held;
        instance.revision = revision;
        let id = instance_id(&instance).to_string();
        let mut table = self.table();
        let registered = table
            .instances
            .get(&id)
            .filter(|e| e.instance.lease_id == instance.lease_id)
            .map_or(revision, |e| e.registered);
        let entry = Entry::of(&instance, owner, lease_ttl, probed, registered);
        let shown = entry.instance.clone();
        table.instances.insert(id, entry);
        table.revision = table.revision.max(revision);
        self.publish(&mut table, watch_response::Event::Upserted(shown));
    }

    /// Mirrors a store's removal of `instance_id` at `revision` (deregistered, drained or its
    /// lease expired): watchers are sent it OFFLINE.
    pub fn apply_delete(&self, instance_id: &str, revision: u64) {
        let mut table = self.table();
        if let Some(mut entry) = table.instances.remove(instance_id) {
            table.revision = table.revision.max(revision);
            entry.instance.state = InstanceState::Offline as i32;
            entry.instance.revision = table.revision;
            self.publish(&mut table, watch_response::Event::Removed(entry.instance));
        } else {
            table.revision = table.revision.max(revision);
            self.inner.applied.send_replace(table.revision);
        }
    }

    /// Records that the store reached `revision` with no change to the table (a write to
    /// another key): [`Registry::applied`] waiters of it wake.
    pub fn apply_progress(&self, revision: u64) {
        let mut table = self.table();
        table.revision = table.revision.max(revision);
        self.inner.applied.send_replace(table.revision);
    }

    /// Replaces the whole table with `instances`, the store's state at `revision` (the first
    /// read, or a re-read after the store compacted the revisions a watch needed). The
    /// history restarts there, and the drained leases are forgotten (the caller applies the
    /// store's again); open watches are sent a snapshot with `cause`.
    pub fn apply_reset(&self, instances: Vec<Held>, revision: u64, cause: SnapshotCause) {
        let mut table = self.table();
        table.instances.clear();
        table.drained_leases.clear();
        table.history.clear();
        table.history_bytes = 0;
        table.revision = revision;
        table.history_floor = revision;
        for held in instances {
            let mut instance = held.instance;
            if instance.revision == 0 {
                instance.revision = revision;
            }
            let id = instance_id(&instance).to_string();
            let registered = instance.revision;
            let entry = Entry::of(
                &instance,
                held.owner,
                held.lease_ttl,
                held.probed,
                registered,
            );
            table.instances.insert(id, entry);
        }
        record_state_counts(&table);
        let snapshot = Arc::new(self.snapshot_of(&table, cause));
        let _ = self.inner.events.send(snapshot);
        self.inner.applied.send_replace(table.revision);
    }

    /// Marks `lease_id` drained by an operator (or no longer, with `drained` false) in a
    /// mirror: heartbeats with it are answered INSTANCE_DRAINED.
    pub fn apply_drained(&self, lease_id: &str, drained: bool) {
        let mut table = self.table();
        if drained {
            table
                .drained_leases
                .insert(lease_id.to_string(), Instant::now());
        } else {
            table.drained_leases.remove(lease_id);
        }
    }

    /// Whether an operator drained `lease_id` (within the last 10 minutes).
    pub fn is_drained(&self, lease_id: &str) -> bool {
        self.table().drained_leases.contains_key(lease_id)
    }

    /// Waits until the table holds `revision` (a mirror: the store's write came back through
    /// its watch) or `timeout` passes; returns whether it does.
    pub async fn applied(&self, revision: u64, timeout: Duration) -> bool {
        let mut applied = self.inner.applied.subscribe();
        tokio::time::timeout(timeout, applied.wait_for(|held| *held >= revision))
            .await
            .is_ok_and(|waited| waited.is_ok())
    }

    /// The current revision.
    pub fn revision(&self) -> u64 {
        self.table().revision
    }
}

/// An instance as a store holds it: what a mirror's `apply_*` methods take.
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    /// The instance, capability descriptors included, lease id set.
    pub instance: Instance,
    /// The identity that registered it.
    pub owner: String,
    /// The granted lease TTL.
    pub lease_ttl: Duration,
    /// Whether its first health probe passed (or probing is off).
    pub probed: bool,
}

/// `instance` with its capabilities' descriptors cleared: what Watch and ListInstances
/// carry (the router needs names and versions only; ListCapabilities serves descriptors).
fn without_descriptors(instance: &Instance) -> Instance {
    let mut shown = instance.clone();
    if let Some(spec) = shown.spec.as_mut() {
        for capability in &mut spec.capabilities {
            *capability = crate::capabilities::without_descriptor(capability);
        }
    }
    shown
}

/// Sets the instances-by-state gauges from the table (O(instances); called on every change).
fn record_state_counts(table: &Table) {
    let mut counts = [0usize; 6];
    for entry in table.instances.values() {
        if let Some(count) = counts.get_mut(entry.instance.state as usize) {
            *count += 1;
        }
    }
    for state in [
        InstanceState::Registered,
        InstanceState::Ready,
        InstanceState::Busy,
        InstanceState::Draining,
    ] {
        crate::metrics::instances(state_label(state), counts[state as usize]);
    }
}

/// The metric label of a state (`ready`, `draining`, ...).
pub fn state_label(state: InstanceState) -> &'static str {
    match state {
        InstanceState::Unspecified => "unspecified",
        InstanceState::Registered => "registered",
        InstanceState::Ready => "ready",
        InstanceState::Busy => "busy",
        InstanceState::Draining => "draining",
        InstanceState::Offline => "offline",
    }
}

/// Records a heartbeat's `reported` state and `load` on `instance` (its first probe `probed`
/// or not): a READY report of a model-bound instance counts as BUSY, and DRAINING is final.
/// Returns the state now and whether anything watchers see changed.
pub(crate) fn apply_report(
    instance: &mut Instance,
    probed: bool,
    reported: InstanceState,
    load: Load,
) -> (InstanceState, bool) {
    let reported = if reported == InstanceState::Ready && load.model_bound() {
        InstanceState::Busy
    } else {
        reported
    };
    let current = instance.state();
    let next = next_state(current, reported, probed);
    let changed = next != current
        || instance.in_flight != load.in_flight
        || instance.model_calls_in_flight != load.model_calls_in_flight
        || instance.model_slots_free != load.model_slots_free;
    instance.state = next as i32;
    instance.in_flight = load.in_flight;
    instance.model_calls_in_flight = load.model_calls_in_flight;
    instance.model_slots_free = load.model_slots_free;
    if next != current {
        info!(instance = %instance_id(instance), from = ?current, to = ?next, "instance state changed");
    }
    (next, changed)
}

fn next_state(current: InstanceState, reported: InstanceState, probed: bool) -> InstanceState {
    use InstanceState as S;
    match (current, reported) {
        (S::Draining, _) | (_, S::Unspecified) => current,
        (_, S::Draining) => S::Draining,
        (S::Registered, _) if !probed => S::Registered,
        (_, S::Ready) => S::Ready,
        (_, S::Busy) => S::Busy,
        // An instance cannot report itself REGISTERED or OFFLINE through a heartbeat.
        (_, S::Registered | S::Offline) => current,
    }
}

/// The instance id of an instance ("" when it has no spec).
pub fn instance_id(instance: &Instance) -> &str {
    instance
        .spec
        .as_ref()
        .map_or("", |s| s.instance_id.as_str())
}

/// The service name of an instance ("" when it has no spec).
pub fn service_of(instance: &Instance) -> &str {
    instance.spec.as_ref().map_or("", |s| s.service.as_str())
}

/// The most capabilities, topics or labels one instance may declare.
pub const MAX_LIST: usize = 256;
/// The most bytes of label keys and values one instance may declare.
const MAX_LABEL_BYTES: usize = 16 * 1024;
/// The most bytes an instance's encoded spec may take besides its capabilities'
/// descriptions and schemas (which Watch and ListInstances leave out): what every watcher
/// receives of it, so a registrant cannot grow the routers' snapshot without bound.
pub const MAX_SPEC_BYTES: usize = 64 * 1024;
/// The longest `protocol_version`.
const MAX_PROTOCOL_VERSION_BYTES: usize = 64;

fn validate_spec(spec: &InstanceSpec) -> Result<(), RegistryError> {
    use crate::capabilities::{MAX_DESCRIPTOR_BYTES_PER_INSTANCE, clip, descriptor_bytes};
    let bad = |msg: String| Err(RegistryError::InvalidRegistration(msg));
    if !is_name(&spec.service) {
        return bad(format!(
            "instance.service {:?} must be a non-empty dotted name of letters, digits, '_' and '-' (e.g. \"executor.servicing\")",
            clip(&spec.service)
        ));
    }
    if spec.instance_id.is_empty()
        || spec.instance_id.len() > 256
        || !spec.instance_id.bytes().all(|b| b.is_ascii_graphic())
    {
        return bad(format!(
            "instance.instance_id {:?} must be 1 to 256 printable ASCII characters without spaces",
            clip(&spec.instance_id)
        ));
    }
    match spec.endpoint.parse::<http::Uri>() {
        Ok(uri)
            if matches!(uri.scheme_str(), Some("http" | "https"))
                && uri.host().is_some()
                // No user info: everyone who lists instances would read the credentials.
                && uri.authority().is_some_and(|a| !a.as_str().contains('@'))
                && uri.port_u16().is_some_and(|p| p != 0)
                && uri.path_and_query().is_none_or(|pq| pq.as_str() == "/") => {}
        _ => {
            return bad(format!(
                "instance.endpoint must be an http(s) URL with host and a non-zero port, no user info and no path, e.g. \"http://127.0.0.1:50051\"; got {:?}",
                clip(&redact_user_info(&spec.endpoint))
            ));
        }
    }
    if spec.capabilities.len() > MAX_LIST
        || spec.topics.len() > MAX_LIST
        || spec.labels.len() > MAX_LIST
        || spec.grpc_services.len() > MAX_LIST
    {
        return bad(format!(
            "an instance may declare at most {MAX_LIST} capabilities, topics, labels and grpc_services each"
        ));
    }
    if spec.protocol_version.len() > MAX_PROTOCOL_VERSION_BYTES {
        return bad(format!(
            "instance.protocol_version is {} bytes; the limit is {MAX_PROTOCOL_VERSION_BYTES} (a version such as \"1.0\")",
            spec.protocol_version.len()
        ));
    }
    for (i, service) in spec.grpc_services.iter().enumerate() {
        if service.len() > 256 || !is_name(service) {
            return bad(format!(
                "instance.grpc_services[{i}] {:?} must be a fully qualified gRPC service name of at most 256 bytes (e.g. \"examples.complaints.v1.TriageService\")",
                clip(service)
            ));
        }
    }
    let described = descriptor_bytes(&spec.capabilities);
    let shown = prost::Message::encoded_len(spec).saturating_sub(described);
    if shown > MAX_SPEC_BYTES {
        return bad(format!(
            "instance spec takes {shown} bytes besides its descriptions and schemas, over the limit of {MAX_SPEC_BYTES}; every watcher receives it, so keep names, labels and lists short"
        ));
    }
    if described > MAX_DESCRIPTOR_BYTES_PER_INSTANCE {
        return bad(format!(
            "instance.capabilities declare {described} bytes of descriptions and schemas in total, over the limit of {MAX_DESCRIPTOR_BYTES_PER_INSTANCE} bytes per instance; shorten the schemas or move capabilities to the protocol registry"
        ));
    }
    for (i, capability) in spec.capabilities.iter().enumerate() {
        if !is_name(&capability.name) {
            return bad(format!(
                "instance.capabilities[{i}].name {:?} must be a non-empty dotted name (e.g. \"complaint.servicing\")",
                clip(&capability.name)
            ));
        }
        if !capability.version.is_empty() && semver::Version::parse(&capability.version).is_err() {
            return bad(format!(
                "instance.capabilities[{i}].version {:?} must be a semver version such as \"1.2.0\"",
                clip(&capability.version)
            ));
        }
        crate::capabilities::check_descriptor(capability).map_err(|problem| {
            RegistryError::InvalidCapability {
                index: i,
                name: capability.name.clone(),
                field: problem.field,
                detail: problem.detail,
            }
        })?;
    }
    let label_bytes: usize = spec.labels.iter().map(|(k, v)| k.len() + v.len()).sum();
    if label_bytes > MAX_LABEL_BYTES {
        return bad(format!(
            "instance.labels hold {label_bytes} bytes; the limit is {MAX_LABEL_BYTES} bytes (labels are for short metadata)"
        ));
    }
    for (i, topic) in spec.topics.iter().enumerate() {
        if !is_name(topic) {
            return bad(format!(
                "instance.topics[{i}] {:?} must be a non-empty dotted name",
                clip(topic)
            ));
        }
    }
    Ok(())
}

/// Whether `s` is a dotted name: segments of ASCII letters, digits, `_` and `-`
/// ([`reach_proto::names::is_dotted_name`]).
pub fn is_name(s: &str) -> bool {
    reach_proto::names::is_dotted_name(s)
}

#[cfg(test)]
mod tests {
    //! The lease and lifecycle state machine, on tokio's paused clock: no test waits for real.

    use std::time::Duration;

    use reach_proto::v1::{Capability, InstanceSpec, InstanceState as S, watch_response::Event};

    use super::*;

    fn registry(health_probe: bool) -> Registry {
        Registry::new(RegistryConfig {
            health_probe,
            min_lease_ttl: Duration::from_millis(100),
            default_lease_ttl: Duration::from_secs(1),
            max_lease_ttl: Duration::from_secs(10),
            ..RegistryConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn what_every_watcher_receives_of_a_spec_is_bounded() {
        let refused = |spec: InstanceSpec| match validate_spec(&spec) {
            Err(RegistryError::InvalidRegistration(message)) => message,
            other => panic!("accepted: {other:?}"),
        };
        let many = refused(InstanceSpec {
            grpc_services: vec!["x".repeat(1000); 1000],
            ..spec("a")
        });
        assert!(many.contains("grpc_services"), "{many}");
        let long = refused(InstanceSpec {
            grpc_services: vec!["x".repeat(1000)],
            ..spec("a")
        });
        assert!(long.starts_with("instance.grpc_services[0]"), "{long}");
        let version = refused(InstanceSpec {
            protocol_version: "1".repeat(1 << 20),
            ..spec("a")
        });
        assert!(
            version.starts_with("instance.protocol_version is 1048576 bytes"),
            "{version}"
        );
        let topics = refused(InstanceSpec {
            topics: vec![format!("t.{}", "x".repeat(1000)); 200],
            ..spec("a")
        });
        assert!(topics.starts_with("instance spec takes "), "{topics}");
        assert!(
            validate_spec(&InstanceSpec {
                grpc_services: vec!["examples.complaints.v1.TriageService".into()],
                protocol_version: "1.0".into(),
                ..spec("a")
            })
            .is_ok()
        );
    }

    fn spec(id: &str) -> InstanceSpec {
        InstanceSpec {
            service: "executor.servicing".into(),
            instance_id: id.into(),
            endpoint: "http://127.0.0.1:50051".into(),
            capabilities: vec![Capability {
                name: "complaint.servicing".into(),
                version: "1.0.0".into(),
                ..Default::default()
            }],
            max_concurrency: 8,
            ..Default::default()
        }
    }

    fn state_of(registry: &Registry, id: &str) -> Option<S> {
        registry
            .list("", "")
            .instances
            .iter()
            .find(|i| instance_id(i) == id)
            .map(Instance::state)
    }

    #[tokio::test(start_paused = true)]
    async fn an_instance_is_registered_until_its_probe_passes_then_follows_its_heartbeats() {
        let registry = registry(true);
        let lease = registry.register(spec("a"), None).unwrap().lease_id;
        assert_eq!(state_of(&registry, "a"), Some(S::Registered));
        // Reporting READY before the probe passed does not make it routable.
        let (_, state) = registry.heartbeat("a", &lease, S::Ready, 0).unwrap();
        assert_eq!(state, S::Registered);

        registry.probe_passed("a", &lease);
        assert_eq!(state_of(&registry, "a"), Some(S::Ready));
        let busy = registry.heartbeat("a", &lease, S::Busy, 8).unwrap().1;
        let ready = registry.heartbeat("a", &lease, S::Ready, 3).unwrap().1;
        // An instance cannot report itself REGISTERED or OFFLINE; an empty report keeps it.
        let offline = registry.heartbeat("a", &lease, S::Offline, 3).unwrap().1;
        let unspecified = registry
            .heartbeat("a", &lease, S::Unspecified, 3)
            .unwrap()
            .1;
        assert_eq!(
            [busy, ready, offline, unspecified],
            [S::Busy, S::Ready, S::Ready, S::Ready]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn draining_is_final_for_the_lease() {
        let registry = registry(false);
        let lease = registry.register(spec("a"), None).unwrap().lease_id;
        assert_eq!(state_of(&registry, "a"), Some(S::Ready));
        registry.heartbeat("a", &lease, S::Draining, 2).unwrap();
        for reported in [S::Ready, S::Busy, S::Registered] {
            let (_, state) = registry.heartbeat("a", &lease, reported, 0).unwrap();
            assert_eq!(state, S::Draining, "reported {reported:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_lives_for_its_ttl_from_the_last_heartbeat() {
        let registry = registry(false);
        let granted = registry
            .register(spec("a"), Some(Duration::from_millis(500)))
            .unwrap();
        assert_eq!(granted.lease_ttl, Duration::from_millis(500));

        tokio::time::advance(Duration::from_millis(499)).await;
        assert!(registry.expire_leases().is_empty());
        registry
            .heartbeat("a", &granted.lease_id, S::Ready, 0)
            .unwrap();
        // 499 ms after the renewal the lease still holds; at 500 ms it is gone.
        tokio::time::advance(Duration::from_millis(499)).await;
        assert!(registry.expire_leases().is_empty());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(registry.expire_leases(), ["a"]);
        assert_eq!(state_of(&registry, "a"), None);
        assert!(matches!(
            registry.heartbeat("a", &granted.lease_id, S::Ready, 0),
            Err(RegistryError::LeaseNotFound { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn requested_ttls_are_clamped_to_the_bounds() {
        let registry = registry(false);
        let ttl = |requested| registry.register(spec("a"), requested).unwrap().lease_ttl;
        assert_eq!(ttl(None), Duration::from_secs(1));
        assert_eq!(ttl(Some(Duration::ZERO)), Duration::from_secs(1));
        assert_eq!(
            ttl(Some(Duration::from_millis(1))),
            Duration::from_millis(100)
        );
        assert_eq!(
            ttl(Some(Duration::from_secs(3600))),
            Duration::from_secs(10)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn registering_again_replaces_the_lease_and_a_stale_probe_changes_nothing() {
        let registry = registry(true);
        let first = registry.register(spec("a"), None).unwrap().lease_id;
        let second = registry.register(spec("a"), None).unwrap().lease_id;
        assert_ne!(first, second);
        assert!(!registry.holds_lease("a", &first));
        assert!(registry.holds_lease("a", &second));
        // The first registration's probe finishing late must not mark the new one READY.
        registry.probe_passed("a", &first);
        assert_eq!(state_of(&registry, "a"), Some(S::Registered));
        assert!(matches!(
            registry.heartbeat("a", &first, S::Ready, 0),
            Err(RegistryError::LeaseNotFound { .. })
        ));
        assert!(matches!(
            registry.deregister("a", &first),
            Err(RegistryError::LeaseNotFound { .. })
        ));
        registry.deregister("a", &second).unwrap();
        assert_eq!(state_of(&registry, "a"), None);
    }

    /// The kind and revision of each event (`snapshot:<cause>` for a snapshot).
    fn kinds(events: &[Arc<WatchResponse>]) -> Vec<(String, u64)> {
        events
            .iter()
            .map(|e| {
                let kind = match e.event.as_ref().unwrap() {
                    Event::Upserted(i) => format!("upserted {}", instance_id(i)),
                    Event::Removed(i) => format!("removed {}", instance_id(i)),
                    Event::Snapshot(s) => format!("snapshot {}", s.cause().as_str_name()),
                };
                (kind, e.revision)
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_resumed_watch_gets_exactly_the_events_it_missed() {
        let registry = registry(false);
        let epoch = registry.epoch().to_string();
        registry.register(spec("a"), None).unwrap();
        let (snapshot, _) = registry.watch();
        assert_eq!(snapshot.epoch, epoch);
        // The watcher read up to revision 1, then lost its stream; three changes followed.
        let b = registry.register(spec("b"), None).unwrap().lease_id;
        registry.heartbeat("b", &b, S::Ready, 3).unwrap();
        registry.deregister("b", &b).unwrap();
        let resume = |after_revision| {
            registry
                .watch_from(WatchFrom::Resume {
                    epoch: &epoch,
                    after_revision,
                })
                .0
        };
        assert_eq!(
            kinds(&resume(1)),
            [
                ("upserted b".to_string(), 2),
                ("upserted b".to_string(), 3),
                ("removed b".to_string(), 4)
            ]
        );
        assert!(resume(1).iter().all(|e| e.epoch == epoch));
        assert_eq!(kinds(&resume(3)), [("removed b".to_string(), 4)]);
        // Up to date: nothing to replay; later changes come on the receiver.
        let (first, mut events) = registry.watch_from(WatchFrom::Resume {
            epoch: &epoch,
            after_revision: 4,
        });
        assert!(first.is_empty());
        registry.register(spec("c"), None).unwrap();
        assert_eq!(events.try_recv().unwrap().revision, 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_that_cannot_resume_gets_a_snapshot_saying_why() {
        let registry = registry(false);
        let epoch = registry.epoch().to_string();
        for i in 0..WATCH_HISTORY + 2 {
            registry.register(spec(&format!("i{i}")), None).unwrap();
        }
        let head = u64::try_from(WATCH_HISTORY + 2).unwrap();
        let from = |epoch: &str, after_revision| {
            kinds(
                &registry
                    .watch_from(WatchFrom::Resume {
                        epoch,
                        after_revision,
                    })
                    .0,
            )
        };
        let snapshot = |cause: &str| vec![(format!("snapshot {cause}"), head)];
        // Revision 1's successor was dropped from the history: a snapshot, compacted.
        assert_eq!(from(&epoch, 1), snapshot("SNAPSHOT_CAUSE_COMPACTED"));
        // The oldest event held is revision 3: resuming after 2 replays the whole history.
        assert_eq!(from(&epoch, 2).len(), WATCH_HISTORY);
        // A revision the registry never reached, and another registry's epoch.
        assert_eq!(from(&epoch, head + 1), snapshot("SNAPSHOT_CAUSE_COMPACTED"));
        assert_eq!(
            from("another-registry", 2),
            snapshot("SNAPSHOT_CAUSE_EPOCH_CHANGED")
        );
        assert_eq!(
            kinds(&registry.watch_from(WatchFrom::Snapshot).0),
            snapshot("SNAPSHOT_CAUSE_START")
        );
        assert_eq!(
            kinds(&registry.watch_from(WatchFrom::Lagged).0),
            snapshot("SNAPSHOT_CAUSE_LAGGED")
        );
        // Each registry draws its own epoch.
        assert_ne!(self::registry(false).epoch(), epoch);
    }

    #[tokio::test(start_paused = true)]
    async fn the_watch_history_is_bounded_in_bytes_as_well_as_in_events() {
        let registry = registry(false);
        let epoch = registry.epoch().to_string();
        // Events of about 16 KiB each (labels at their limit): 16 MiB holds about a thousand.
        let big = |id: &str| InstanceSpec {
            labels: [("note".to_string(), "x".repeat(16 * 1024 - 8))].into(),
            ..spec(id)
        };
        for i in 0..1200 {
            registry.register(big(&format!("i{i}")), None).unwrap();
        }
        let table = registry.table();
        assert!(
            table.history.len() < 1100,
            "{} events kept",
            table.history.len()
        );
        assert!(table.history_bytes <= WATCH_HISTORY_BYTES);
        let oldest = table.history.front().unwrap().0.revision;
        drop(table);
        let resume = |after_revision| {
            kinds(
                &registry
                    .watch_from(WatchFrom::Resume {
                        epoch: &epoch,
                        after_revision,
                    })
                    .0,
            )
        };
        assert_eq!(
            resume(oldest - 2),
            [("snapshot SNAPSHOT_CAUSE_COMPACTED".to_string(), 1200)]
        );
        assert_eq!(
            resume(oldest - 1).len(),
            usize::try_from(1201 - oldest).unwrap()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn every_change_is_one_revision_and_watchers_see_it_after_their_snapshot() {
        let registry = registry(true);
        let lease = registry.register(spec("a"), None).unwrap().lease_id;
        let (snapshot, mut events) = registry.watch();
        assert_eq!(snapshot.revision, 1);
        registry.probe_passed("a", &lease);
        // A heartbeat that changes nothing publishes nothing.
        registry.heartbeat("a", &lease, S::Ready, 0).unwrap();
        registry.heartbeat("a", &lease, S::Ready, 2).unwrap();
        registry.deregister("a", &lease).unwrap();

        let mut seen = Vec::new();
        while let Ok(event) = events.try_recv() {
            let event = Arc::unwrap_or_clone(event);
            let (kind, instance) = match event.event.unwrap() {
                Event::Upserted(i) => ("upserted", i),
                Event::Removed(i) => ("removed", i),
                Event::Snapshot(_) => unreachable!("deltas only after the snapshot"),
            };
            assert_eq!(event.revision, instance.revision);
            seen.push((event.revision, kind, instance.state(), instance.in_flight));
        }
        assert_eq!(
            seen,
            [
                (2, "upserted", S::Ready, 0),
                (3, "upserted", S::Ready, 2),
                (4, "removed", S::Offline, 2),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_operator_drain_removes_idle_instances_and_refuses_their_leases() {
        let registry = registry(false);
        let idle = registry.register(spec("idle"), None).unwrap().lease_id;
        let busy = registry.register(spec("busy"), None).unwrap().lease_id;
        registry.heartbeat("busy", &busy, S::Ready, 3).unwrap();

        let mut drained = registry.drain_service("executor.servicing", Duration::from_secs(5));
        drained.sort();
        assert_eq!(drained, ["busy", "idle"]);
        assert_eq!(state_of(&registry, "busy"), Some(S::Draining));
        // Drained leases are answered INSTANCE_DRAINED, so the agents do not come back.
        assert!(matches!(
            registry.heartbeat("idle", &idle, S::Ready, 0),
            Err(RegistryError::Drained(_))
        ));

        // The drain task removes the idle instance on its first pass, the busy one at the grace.
        tokio::time::advance(Duration::from_millis(1)).await;
        tokio::task::yield_now().await;
        assert_eq!(state_of(&registry, "idle"), None);
        assert_eq!(state_of(&registry, "busy"), Some(S::Draining));
        tokio::time::sleep(Duration::from_secs(5)).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(state_of(&registry, "busy"), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_bad_descriptor_is_refused_naming_the_capability_and_the_field() {
        let registry = registry(false);
        let mut bad = spec("a");
        bad.capabilities.push(Capability {
            name: "x.tool".into(),
            input_schema: "{\"type\": \"object\"".into(),
            ..Default::default()
        });
        let error = registry.register(bad, None).unwrap_err();
        assert!(
            matches!(
                &error,
                RegistryError::InvalidCapability {
                    index: 1,
                    field: "input_schema",
                    ..
                }
            ),
            "{error:?}"
        );
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status
                .message()
                .contains("instance.capabilities[1] (\"x.tool\") input_schema is not JSON"),
            "{}",
            status.message()
        );
        let mut many = spec("b");
        many.capabilities = (0..257)
            .map(|i| Capability {
                name: format!("c{i}"),
                ..Default::default()
            })
            .collect();
        assert!(matches!(
            registry.register(many, None),
            Err(RegistryError::InvalidRegistration(_))
        ));
        assert!(registry.list("", "").instances.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn list_capabilities_merges_live_registrations_and_forgets_gone_ones() {
        let registry = registry(false);
        let described = |id: &str, words: &str| {
            let mut s = spec(id);
            s.capabilities[0].description = words.into();
            s.capabilities[0].input_schema = r#"{"type":"object"}"#.into();
            s
        };
        let first = registry.register(described("a", "first"), None).unwrap();
        registry.register(described("b", "second"), None).unwrap();
        let list = registry.list_capabilities("");
        assert_eq!(list.capabilities.len(), 1);
        assert_eq!(list.capabilities[0].description, "second");
        assert_eq!(list.capabilities[0].instances, 2);
        assert_eq!(list.revision, 2);
        // Re-registering makes "a" the latest registration: its words win.
        let again = registry
            .register(described("a", "first, again"), None)
            .unwrap();
        assert_ne!(again.lease_id, first.lease_id);
        assert_eq!(
            registry.list_capabilities("complaint.").capabilities[0].description,
            "first, again"
        );
        registry.deregister("a", &again.lease_id).unwrap();
        assert_eq!(
            registry.list_capabilities("").capabilities[0].description,
            "second"
        );
        assert!(registry.list_capabilities("other.").capabilities.is_empty());
    }

    fn described(id: &str, capabilities: usize, schema_bytes: usize) -> InstanceSpec {
        let mut s = spec(id);
        s.capabilities = (0..capabilities)
            .map(|i| Capability {
                name: format!("big.c{i}"),
                version: "1.0.0".into(),
                description: format!("tool {i}"),
                input_schema: serde_json::json!({
                    "type": "object",
                    "description": "d".repeat(schema_bytes),
                })
                .to_string(),
                output_schema: r#"{"type":"array"}"#.into(),
            })
            .collect();
        s
    }

    #[tokio::test(start_paused = true)]
    async fn watch_and_list_instances_carry_no_descriptors_but_list_capabilities_does() {
        let registry = registry(false);
        let (_, mut events) = registry.watch();
        let lease = registry
            .register(described("a", 4, 1000), None)
            .unwrap()
            .lease_id;
        // Heartbeats that change the load publish the instance again: still without them.
        registry.heartbeat("a", &lease, S::Ready, 1).unwrap();
        registry.heartbeat("a", &lease, S::Ready, 2).unwrap();
        let (snapshot, _) = registry.watch();
        let mut shown = vec![registry.list("", "").instances.remove(0)];
        let Some(Event::Snapshot(snapshot)) = snapshot.event else {
            unreachable!()
        };
        shown.extend(snapshot.instances);
        while let Ok(event) = events.try_recv() {
            match Arc::unwrap_or_clone(event).event.unwrap() {
                Event::Upserted(i) | Event::Removed(i) => shown.push(i),
                Event::Snapshot(_) => unreachable!(),
            }
        }
        assert_eq!(shown.len(), 5);
        for instance in &shown {
            let capabilities = &instance.spec.as_ref().unwrap().capabilities;
            assert_eq!(capabilities.len(), 4);
            for c in capabilities {
                assert!(c.name.starts_with("big.c") && c.version == "1.0.0", "{c:?}");
                assert!(
                    c.description.is_empty()
                        && c.input_schema.is_empty()
                        && c.output_schema.is_empty(),
                    "{c:?}"
                );
            }
        }
        // Filtering by capability still works on the names.
        assert_eq!(registry.list("", "big.c3").instances.len(), 1);
        let listed = registry.list_capabilities("big.");
        assert_eq!(listed.capabilities.len(), 4);
        assert_eq!(listed.capabilities[0].description, "tool 0");
        assert!(listed.capabilities[0].input_schema.len() > 1000);
        assert_eq!(listed.capabilities[0].output_schema, r#"{"type":"array"}"#);
    }

    #[tokio::test(start_paused = true)]
    async fn an_instance_s_descriptors_are_bounded_in_total() {
        let registry = registry(false);
        // 64 capabilities of 60 KB schemas: each is within bounds, together far over.
        let error = registry
            .register(described("a", 64, 60 * 1024), None)
            .unwrap_err();
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status
                .message()
                .contains("bytes of descriptions and schemas in total")
                && status
                    .message()
                    .contains("over the limit of 262144 bytes per instance"),
            "{}",
            status.message()
        );
        // Just under the bound is accepted.
        registry
            .register(described("b", 4, 60 * 1024), None)
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_do_not_echo_huge_values() {
        let registry = registry(false);
        let mut bad = spec("a");
        bad.capabilities[0].input_schema =
            serde_json::json!({"pattern": "(a|".repeat(250), "minLength": "x".repeat(60_000)})
                .to_string();
        let mut long_name = spec("b");
        long_name.capabilities[0].name = "n".repeat(60_000);
        let mut bad_pattern = spec("c");
        bad_pattern.capabilities[0].input_schema =
            serde_json::json!({"pattern": "(".repeat(1000)}).to_string();
        for spec in [bad, long_name, bad_pattern] {
            let status = tonic::Status::from(registry.register(spec, None).unwrap_err());
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            let size = status.message().len() + status.details().len();
            assert!(size < 1500, "{size} bytes: {}", status.message());
        }
    }

    #[test]
    fn descriptor_checks_run_on_the_blocking_pool_not_the_async_worker() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let registry = registry(false);
            let (release, released) = std::sync::mpsc::channel::<()>();
            // A check that blocks until a concurrent cheap call has run. Run on the only
            // async worker, it would wait out its 10 s and report false.
            let slow = registry.check_off_worker(None, move || {
                released.recv_timeout(Duration::from_secs(10)).is_ok()
            });
            let cheap = async {
                tokio::task::yield_now().await;
                assert!(registry.list("", "").instances.is_empty());
                // The checker is taken: a second check with a short deadline gives up.
                let busy = registry
                    .check_off_worker(Some(Duration::from_millis(20)), || ())
                    .await;
                assert!(
                    matches!(busy, Err(RegistryError::CheckerBusy(_))),
                    "{busy:?}"
                );
                release.send(()).unwrap();
            };
            let (slow, ()) = tokio::join!(slow, cheap);
            assert!(slow.unwrap(), "the check ran beside the cheap call");
            // The permit is back: the next check runs.
            let checked = registry
                .check_off_worker(Some(Duration::from_secs(5)), move || check_spec(spec("z")))
                .await
                .unwrap()
                .unwrap();
            registry.register_checked(checked, None).unwrap();
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_model_bound_instance_reporting_ready_is_recorded_busy() {
        let registry = registry(false);
        let lease = registry.register(spec("a"), None).unwrap().lease_id;
        let load = |calls, free| Load {
            in_flight: 2,
            model_calls_in_flight: calls,
            model_slots_free: free,
        };
        let (_, state) = registry
            .heartbeat_load("a", &lease, S::Ready, load(4, 0))
            .unwrap();
        assert_eq!(state, S::Busy);
        let listed = registry.list("", "").instances.remove(0);
        assert_eq!(
            (listed.model_calls_in_flight, listed.model_slots_free),
            (4, 0)
        );
        let (_, state) = registry
            .heartbeat_load("a", &lease, S::Ready, load(3, 1))
            .unwrap();
        assert_eq!(state, S::Ready);
        // No model calls at all (an agent without a model): READY stays READY.
        let (_, state) = registry
            .heartbeat_load("a", &lease, S::Ready, load(0, 0))
            .unwrap();
        assert_eq!(state, S::Ready);
    }

    #[test]
    fn a_bad_configuration_names_the_setting() {
        let config = RegistryConfig {
            min_lease_ttl: Duration::from_secs(5),
            max_lease_ttl: Duration::from_secs(1),
            ..RegistryConfig::default()
        };
        let error = Registry::new(config).err().unwrap();
        assert!(matches!(
            error,
            InitError::Config(crate::config::ConfigError::LeaseBoundsCrossed { .. })
        ));
        assert!(
            error.to_string().contains("registry.min_lease_ttl"),
            "{error}"
        );
    }
}
