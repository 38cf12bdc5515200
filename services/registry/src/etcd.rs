//! The etcd v3 backend: the instance table kept in etcd, shared by every registry replica.
//!
//! Keys under the configured prefix (default `/reach/registry/`):
//! - `table` → a random id written once by the first replica; with the etcd cluster id and
//!   the prefix it makes the Watch epoch.
//! - `instances/{instance_id}` → the instance as registered ([`StoredInstance`], protobuf),
//!   bound to the instance's own etcd lease, whose TTL is the instance lease: a heartbeat is a
//!   lease keep-alive, plus a write when the state or load changed (at most one such write
//!   per second per replica and instance, DRAINING at once); when the lease runs out etcd deletes the
//!   key, so the instance is OFFLINE on every replica at once. A value under this key that
//!   is not such an instance of this id on its own lease (written by something else) counts
//!   as no instance, and a registration of the id overwrites it. The lease's deadline lives
//!   in etcd alone: `lease_expires_at` is unset in listings and watch events.
//! - `drained/{lease_id}` → empty, on a 10-minute lease: heartbeats of an instance an operator
//!   drained are answered INSTANCE_DRAINED, whichever replica they reach.
//! - `tokens/{jti}` → empty, on a lease that ends with the token: one-time join tokens used
//!   to register, through whichever replica, so that none registers twice.
//! - `replicas/{replica_id}` → empty, on the replica's own short lease: the live replicas (a
//!   key on no lease is not one; a replica whose key was deleted puts it back).
//!   First health probes are split between them by rendezvous hashing of the instance id, so
//!   no instance is probed twice, and a dead replica's share moves when its key expires.
//!
//! Every replica mirrors the prefix into a [`Registry`] table (a range read at revision R,
//! then an etcd watch from R + 1) and serves Watch, ListInstances and ListCapabilities from
//! it. The etcd revision is the Watch revision, and the epoch is derived from the etcd cluster
//! id and the prefix, so a router may resume its watch on any replica; a revision etcd has
//! compacted yields a fresh snapshot said to be COMPACTED.
//!
//! Writes are compare-and-swap transactions on the key's mod revision: replicas never
//! overwrite each other's changes.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, Txn,
    TxnOp, TxnOpResponse, WatchOptions,
};
use reach_proto::v1::{Instance, InstanceSpec, InstanceState, SnapshotCause};
use reach_rpc::backoff::Backoff;
use reach_trust::tls::TlsSource;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::{EtcdConfig, RegistryConfig};
use crate::error::{InitError, RegistryError};
use crate::store::{CheckedSpec, Held, Load, Registration, Registry, instance_id};

/// How long a drained lease's tombstone lives: heartbeats with it are answered
/// INSTANCE_DRAINED for this long, as the in-memory registry does.
const DRAINED_TTL_SECS: i64 = 600;
/// How many times a write is retried when another replica changed the key meanwhile.
const CAS_ATTEMPTS: usize = 8;
/// The longest lease TTL read back from etcd (a day, in ms); longer values are clamped.
const MAX_STORED_TTL_MS: u64 = 24 * 3600 * 1000;
/// The shortest time between two heartbeat writes of an instance (its reported state and
/// load): heartbeats between them renew the lease without writing, so a chatty (or hostile)
/// agent costs etcd at most one value per interval. DRAINING is written at once.
const REPORT_WRITE_INTERVAL: Duration = Duration::from_secs(1);
/// The longest a used one-time join token is remembered in etcd (30 days, in seconds): join
/// tokens expire long before; one without `exp` is remembered this long.
pub const MAX_TOKEN_RECORD_SECS: u64 = 30 * 24 * 3600;
/// How often a replica checks that etcd answers (its health check follows).
const STATUS_INTERVAL: Duration = Duration::from_secs(1);

/// An instance as the etcd backend stores it under `instances/{instance_id}`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StoredInstance {
    /// The instance: descriptors included, lease id set, `revision` and `lease_expires_at`
    /// unset (the key's mod revision is the instance's revision; etcd holds the lease's
    /// deadline).
    #[prost(message, optional, tag = "1")]
    pub instance: Option<Instance>,
    /// The identity that registered it.
    #[prost(string, tag = "2")]
    pub owner: String,
    /// The granted lease TTL, in ms.
    #[prost(uint64, tag = "3")]
    pub lease_ttl_ms: u64,
    /// Whether its first health probe passed (or probing is off).
    #[prost(bool, tag = "4")]
    pub probed: bool,
}

impl StoredInstance {
    fn of(held: &Held) -> Self {
        let mut instance = held.instance.clone();
        instance.revision = 0;
        // etcd keeps the lease's deadline (keep-alives renew it without a write), so a stored
        // time would only go stale.
        instance.lease_expires_at = None;
        Self {
            instance: Some(instance),
            owner: held.owner.clone(),
            lease_ttl_ms: u64::try_from(held.lease_ttl.as_millis()).unwrap_or(u64::MAX),
            probed: held.probed,
        }
    }

    fn into_held(self, revision: u64) -> Option<Held> {
        let mut instance = self.instance?;
        instance.revision = revision;
        Some(Held {
            instance,
            owner: self.owner,
            // Bounded: a corrupt value must not overflow the mirror's clock arithmetic.
            lease_ttl: Duration::from_millis(self.lease_ttl_ms.min(MAX_STORED_TTL_MS)),
            probed: self.probed,
        })
    }

    fn encode(held: &Held) -> Vec<u8> {
        prost::Message::encode_to_vec(&Self::of(held))
    }

    fn decode(value: &[u8], revision: u64) -> Option<Held> {
        <Self as prost::Message>::decode(value)
            .ok()
            .and_then(|stored| stored.into_held(revision))
    }
}

/// The registry on etcd: writes go to etcd, reads are served from a mirrored table.
pub struct EtcdRegistry {
    /// A client per etcd member (`registry.etcd.endpoints`, in order), with its endpoint.
    members: Vec<(String, Client)>,
    /// The member this replica talks to now (an index into `members`).
    current: AtomicUsize,
    config: EtcdConfig,
    view: Registry,
    /// This replica's id (random, drawn at start-up).
    replica_id: String,
    /// The table id under `{prefix}table` this replica's epoch is made of.
    table_id: String,
    /// When this replica last wrote a heartbeat's report, by instance id: such writes are
    /// coalesced to one per [`REPORT_WRITE_INTERVAL`].
    report_written: Mutex<HashMap<String, tokio::time::Instant>>,
    /// The live replicas' ids, this one included.
    replicas: Mutex<BTreeSet<String>>,
    /// Lease ids this replica is probing now.
    probing: Mutex<HashSet<String>>,
    /// TLS for health probes (the registry's certificates), when trust has them.
    probe_tls: Option<Arc<TlsSource>>,
    /// Whether etcd answers and the mirror's watch is up: the health check's SERVING.
    serving: watch::Sender<bool>,
    /// Whether the mirror's watch is connected.
    mirrored: watch::Sender<bool>,
    /// The replica key's etcd lease, revoked at shutdown so others take over at once.
    replica_lease: Mutex<Option<i64>>,
    stop: CancellationToken,
}

/// `registry.etcd.endpoints` as an error message shows them.
fn endpoints_of(config: &EtcdConfig) -> String {
    config.endpoints.join(", ")
}

/// What an etcd client error means for a caller: UNAVAILABLE, retry (with the fix named
/// when etcd is out of space).
fn unavailable(error: &etcd_client::Error) -> RegistryError {
    let cause = reach_rpc::errors::chain(error);
    if cause.contains("database space exceeded") {
        return RegistryError::StoreUnavailable(format!(
            "etcd is out of space ({cause}): its operator must compact and defragment etcd and disarm the NOSPACE alarm (`etcdctl alarm disarm`), or raise --quota-backend-bytes"
        ));
    }
    RegistryError::StoreUnavailable(format!("etcd: {cause}"))
}

/// What an etcd error on writing an instance means: INVALID_ARGUMENT when etcd refused the
/// value as too large (its `--max-request-bytes`, 1.5 MiB by default), else as
/// [`unavailable`].
fn write_refused(error: &etcd_client::Error) -> RegistryError {
    let cause = reach_rpc::errors::chain(error);
    if cause.contains("request is too large") {
        return RegistryError::InvalidRegistration(format!(
            "the instance is larger than the etcd cluster takes in one request ({cause}); shorten its descriptions, schemas and labels, or raise etcd's --max-request-bytes"
        ));
    }
    unavailable(error)
}

/// The etcd lease of a registry lease id (`{etcd lease, 16 hex digits}.{secret}`).
fn etcd_lease_of(lease_id: &str) -> Option<i64> {
    let (lease, secret) = lease_id.split_once('.')?;
    if lease.len() != 16 || secret.is_empty() {
        return None;
    }
    u64::from_str_radix(lease, 16)
        .ok()
        .map(|lease| lease.cast_signed())
}

/// FNV-1a, 64 bits, over `parts`, then MurmurHash3's finalizer (the rendezvous weight of a
/// replica for an instance): the same on every replica and every build, which std's hasher
/// does not promise.
fn fnv1a(parts: &[&str]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for byte in part.bytes().chain([0]) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    // MurmurHash3's 64-bit finalizer: FNV alone mixes the last bytes poorly, which skews
    // the shares of similar ids.
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^ (hash >> 33)
}

/// The replica among `replicas` that probes `instance_id`: the one of highest rendezvous
/// weight (Thaler and Ravishankar, "A Name-Based Mapping Scheme for Rendezvous", 1996), so a
/// replica's death moves only its own share.
pub fn prober_of<'a>(
    replicas: impl IntoIterator<Item = &'a str>,
    instance_id: &str,
) -> Option<&'a str> {
    replicas
        .into_iter()
        .max_by_key(|replica| (fnv1a(&[replica, instance_id]), *replica))
}

impl EtcdRegistry {
    /// Connects to etcd, reads the instance table, registers this replica and starts
    /// mirroring. `probe_tls` is what health probes present (the registry's certificates).
    ///
    /// # Errors
    /// [`InitError::Config`] for a bad setting, [`InitError::Etcd`] when etcd cannot be
    /// reached within `dial_timeout` or refuses the first reads (the message names the
    /// endpoints and the setting to check), [`InitError::ProtocolRegistry`] as
    /// [`Registry::new`].
    pub async fn connect(
        config: RegistryConfig,
        probe_tls: Option<Arc<TlsSource>>,
    ) -> Result<Arc<Self>, InitError> {
        config.validate()?;
        let etcd = config.etcd.clone();
        etcd.validate()?;
        let options = ConnectOptions::new()
            .with_connect_timeout(etcd.dial_timeout)
            .with_timeout(etcd.request_timeout)
            .with_keep_alive(etcd.keep_alive_interval, etcd.keep_alive_timeout)
            .with_keep_alive_while_idle(true);
        let endpoints = endpoints_of(&etcd);
        let cannot = |what: String| {
            let fix = if what.contains("database space exceeded") {
                "etcd is out of space (NOSPACE): compact and defragment it, then `etcdctl alarm disarm`, or raise its --quota-backend-bytes"
            } else {
                "check that etcd runs there and registry.etcd.endpoints (and registry.etcd.tls) match it"
            };
            InitError::Etcd(format!("cannot use etcd at {endpoints}: {what}; {fix}"))
        };
        // One lazily connected client per member, each used alone: etcd-client's balanced
        // channel keeps sending to a member that died, so this replica talks to one member
        // at a time and moves to another when it stops answering (see `run_status`).
        let connector = match &etcd.tls {
            Some(tls) => Some(crate::etcd_tls::EtcdTlsConnector::new(tls)?),
            None => None,
        };
        let mut members = Vec::with_capacity(etcd.endpoints.len());
        for member in &etcd.endpoints {
            let endpoint = tonic::transport::Endpoint::from_shared(member.clone())
                .map_err(|e| cannot(format!("{member}: {e}")))?
                .connect_timeout(etcd.dial_timeout)
                .timeout(etcd.request_timeout)
                .http2_keep_alive_interval(etcd.keep_alive_interval)
                .keep_alive_timeout(etcd.keep_alive_timeout)
                .keep_alive_while_idle(true);
            let channel = match &connector {
                Some(connector) => endpoint.connect_with_connector_lazy(connector.clone()),
                None => endpoint.connect_lazy(),
            };
            let client =
                Client::from_channel(etcd_client::Channel::Tonic(channel), Some(options.clone()))
                    .await
                    .map_err(|e| cannot(reach_rpc::errors::chain(&e)))?;
            members.push((member.clone(), client));
        }
        // The first member that answers (members forward to the leader).
        let mut failures = Vec::new();
        let mut connected = None;
        for (index, (member, client)) in members.iter().enumerate() {
            match first_status(client.clone(), &etcd).await {
                Ok(answered) => {
                    connected = Some((index, answered));
                    break;
                }
                Err(why) => failures.push(format!("{member}: {why}")),
            }
        }
        let (current, (mut client, status)) =
            connected.ok_or_else(|| cannot(failures.join("; ")))?;
        let cluster_id = status.header().map_or(0, |h| h.cluster_id());
        // The table's own id, written once by the first replica: an etcd recreated (or
        // restored) with the same cluster id still gets a new epoch, so no watcher resumes
        // across it.
        let table_id = table_id(&mut client, &etcd.prefix)
            .await
            .map_err(|e| cannot(reach_rpc::errors::chain(&e)))?;
        let epoch = uuid::Uuid::new_v5(
            &uuid::Uuid::NAMESPACE_URL,
            format!("etcd://{cluster_id:016x}{}{table_id}", etcd.prefix).as_bytes(),
        )
        .simple()
        .to_string();
        let view = Registry::mirror(config, epoch)?;
        let (serving, _) = watch::channel(false);
        let (mirrored, _) = watch::channel(false);
        let registry = Arc::new(Self {
            members,
            current: AtomicUsize::new(current),
            config: etcd,
            view,
            replica_id: uuid::Uuid::new_v4().simple().to_string(),
            table_id,
            report_written: Mutex::default(),
            replicas: Mutex::default(),
            probing: Mutex::default(),
            probe_tls,
            serving,
            mirrored,
            replica_lease: Mutex::default(),
            stop: CancellationToken::new(),
        });
        let revision = registry
            .load(SnapshotCause::Start)
            .await
            .map_err(|e| cannot(reach_rpc::errors::chain(&e)))?;
        registry
            .announce()
            .await
            .map_err(|e| cannot(reach_rpc::errors::chain(&e)))?;
        info!(
            replica = %registry.replica_id,
            endpoints = %endpoints_of(&registry.config),
            prefix = %registry.config.prefix,
            revision,
            instances = registry.view.list("", "").instances.len(),
            "registry on etcd"
        );
        tokio::spawn(Arc::clone(&registry).run_mirror(revision.cast_signed() + 1));
        tokio::spawn(Arc::clone(&registry).run_replica_lease());
        tokio::spawn(Arc::clone(&registry).run_status());
        registry.rescan();
        Ok(registry)
    }

    /// The mirrored table: what Watch, ListInstances and ListCapabilities read.
    pub fn view(&self) -> &Registry {
        &self.view
    }

    /// This replica's id (its key is `replicas/{id}`).
    pub fn replica_id(&self) -> &str {
        &self.replica_id
    }

    /// Whether this replica should answer SERVING: etcd answers and the mirror is current.
    /// The receiver sees every change.
    pub fn serving(&self) -> watch::Receiver<bool> {
        self.serving.subscribe()
    }

    /// The live replicas' ids as this replica sees them, itself included.
    pub fn replicas(&self) -> Vec<String> {
        self.replicas
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Stops this replica's background work (mirror, replica key, probes) without revoking
    /// anything in etcd, as a crash would: its replica key expires after `replica_ttl`. For
    /// fault tests; [`EtcdRegistry::close`] is the orderly stop.
    pub fn abandon(&self) {
        self.stop.cancel();
        self.view.close_watches();
    }

    /// Stops this replica: revokes its replica key (the others take over its probing at
    /// once), ends its background tasks and its open watch streams. Instances stay in etcd.
    pub async fn close(&self) {
        self.stop.cancel();
        self.view.close_watches();
        let lease = self
            .replica_lease
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(lease) = lease {
            let mut client = self.client();
            let _ =
                tokio::time::timeout(self.config.request_timeout, client.lease_revoke(lease)).await;
        }
    }

    /// The client of the etcd member this replica talks to now.
    fn client(&self) -> Client {
        self.members[self.current.load(Ordering::Relaxed)].1.clone()
    }

    /// Asks the members after the current one, in turn, for their status; moves to the first
    /// that answers within `request_timeout`. Returns whether one did.
    async fn fail_over(&self) -> bool {
        let from = self.current.load(Ordering::Relaxed);
        for step in 1..self.members.len() {
            let index = (from + step) % self.members.len();
            let (member, client) = &self.members[index];
            let mut client = client.clone();
            let answered = tokio::time::timeout(self.config.request_timeout, client.status()).await;
            if matches!(answered, Ok(Ok(_))) {
                warn!(from = %self.members[from].0, to = %member, "etcd member does not answer; this replica now talks to another");
                self.current.store(index, Ordering::Relaxed);
                return true;
            }
        }
        false
    }

    fn key(&self, kind: &str, name: &str) -> String {
        format!("{}{kind}/{name}", self.config.prefix)
    }

    /// Reads the instance table and the drained leases at one revision into the view;
    /// returns the revision.
    async fn load(&self, cause: SnapshotCause) -> Result<u64, etcd_client::Error> {
        let mut client = self.client();
        let (instances, revision) = self.range(&mut client, "instances", 0).await?;
        let drained = client
            .get(
                self.key("drained", ""),
                Some(GetOptions::new().with_prefix().with_revision(revision)),
            )
            .await?;
        let replicas = client
            .get(
                self.key("replicas", ""),
                Some(GetOptions::new().with_prefix().with_revision(revision)),
            )
            .await?;
        let held: Vec<Held> = instances
            .iter()
            .filter_map(|kv| {
                let held = self.stored_at(kv);
                if held.is_none() {
                    warn!(key = %String::from_utf8_lossy(kv.key()), "skipping an etcd key that is not an instance this registry wrote");
                }
                held
            })
            .collect();
        {
            let mut live = self.replicas.lock().unwrap_or_else(|p| p.into_inner());
            live.clear();
            live.insert(self.replica_id.clone());
            // A key on no lease would outlive its replica: not a live replica's.
            live.extend(
                replicas
                    .kvs()
                    .iter()
                    .filter(|kv| kv.lease() != 0)
                    .filter_map(|kv| self.name_of("replicas", kv.key())),
            );
        }
        self.report_written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.view.apply_reset(held, revision.cast_unsigned(), cause);
        for kv in drained.kvs() {
            if let Some(lease) = self.name_of("drained", kv.key()) {
                self.view.apply_drained(&lease, true);
            }
        }
        Ok(revision.cast_unsigned())
    }

    /// Every key under `{prefix}{kind}/` at `revision` (0: the latest, which is returned), read
    /// in pages: a page holds at most 1,000 keys and is halved whenever etcd's answer would
    /// exceed the 4 MiB a client decodes, so a table of any size loads.
    async fn range(
        &self,
        client: &mut Client,
        kind: &str,
        revision: i64,
    ) -> Result<(Vec<KeyValue>, i64), etcd_client::Error> {
        let prefix = self.key(kind, "");
        // The end of the prefix's range: its last byte (`/`) incremented.
        let mut end = prefix.clone().into_bytes();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let mut from = prefix.into_bytes();
        let mut revision = revision;
        let mut limit: i64 = 1000;
        let mut kvs = Vec::new();
        loop {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(limit)
                .with_revision(revision);
            let page = match client.get(from.clone(), Some(options)).await {
                Ok(page) => page,
                Err(error)
                    if limit > 1 && reach_rpc::errors::chain(&error).contains("too large") =>
                {
                    limit /= 2;
                    continue;
                }
                Err(error) => return Err(error),
            };
            if revision == 0 {
                revision = page.header().map_or(0, |h| h.revision());
            }
            let more = page.more();
            if let Some(last) = page.kvs().last() {
                from = [last.key(), &[0]].concat();
            }
            kvs.extend(page.kvs().iter().cloned());
            if !more || page.kvs().is_empty() {
                return Ok((kvs, revision));
            }
        }
    }

    /// The name after `{prefix}{kind}/` in `key`, when `key` is of that kind.
    fn name_of(&self, kind: &str, key: &[u8]) -> Option<String> {
        let key = std::str::from_utf8(key).ok()?;
        let name = key
            .strip_prefix(self.config.prefix.as_str())?
            .strip_prefix(kind)?
            .strip_prefix('/')?;
        (!name.is_empty()).then(|| name.to_string())
    }

    /// The instance `kv` (a key under `instances/`) holds, when it is one this registry wrote:
    /// a [`StoredInstance`] of the key's own instance id, on the etcd lease its lease id
    /// names. Anything else there (another writer's value, a value copied under another id,
    /// a key on no lease, which would never expire) counts as no instance: the mirror leaves
    /// it out and a registration of that id overwrites it.
    fn stored_at(&self, kv: &KeyValue) -> Option<Held> {
        let id = self.name_of("instances", kv.key())?;
        let held = StoredInstance::decode(kv.value(), kv.mod_revision().cast_unsigned())?;
        (instance_id(&held.instance) == id
            && kv.lease() != 0
            && etcd_lease_of(&held.instance.lease_id) == Some(kv.lease()))
        .then_some(held)
    }

    /// What a compare-and-swap's `else` branch read of its key: `None` when the key is
    /// absent, else its mod revision and the instance it holds (`None` when it holds none,
    /// see [`EtcdRegistry::stored_at`]).
    fn got(&self, responses: &[TxnOpResponse]) -> Option<(Option<Held>, i64)> {
        responses.iter().find_map(|response| match response {
            TxnOpResponse::Get(get) => get
                .kvs()
                .first()
                .map(|kv| (self.stored_at(kv), kv.mod_revision())),
            _ => None,
        })
    }

    /// `{prefix}table`, the key of the table id (part of the Watch epoch).
    fn key_of_table(&self) -> String {
        format!("{}table", self.config.prefix)
    }

    /// Puts this replica's key back on its lease after someone deleted it; when the lease is
    /// gone too, the keep-alive loop announces this replica on a new one.
    async fn reannounce(self: Arc<Self>) {
        if self.stop.is_cancelled() {
            return;
        }
        let lease = *self.replica_lease.lock().unwrap_or_else(|p| p.into_inner());
        let Some(lease) = lease else { return };
        match self.put_replica_key(lease).await {
            Ok(_) => {
                warn!(replica = %self.replica_id, "this replica's key was deleted from etcd; put it back")
            }
            Err(error) => {
                warn!(replica = %self.replica_id, %error, "could not put this replica's key back; announcing it on a new lease")
            }
        }
    }

    /// Puts `replicas/{replica_id}` on `lease`.
    async fn put_replica_key(&self, lease: i64) -> Result<(), etcd_client::Error> {
        let mut client = self.client();
        client
            .put(
                self.key("replicas", &self.replica_id),
                Vec::new(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map(drop)
    }

    /// Puts this replica's key on a lease of `replica_ttl`.
    async fn announce(&self) -> Result<i64, etcd_client::Error> {
        let mut client = self.client();
        let ttl = ttl_secs(self.config.replica_ttl);
        let lease = client.lease_grant(ttl, None).await?.id();
        self.put_replica_key(lease).await?;
        *self.replica_lease.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
        Ok(lease)
    }

    /// Keeps this replica's key alive (a keep-alive every third of `replica_ttl`); puts it
    /// again on a new lease when the old one was lost (etcd unreachable for longer).
    async fn run_replica_lease(self: Arc<Self>) {
        let every = self.config.replica_ttl / 3;
        let mut backoff = Backoff::doubling(Duration::from_millis(100), Duration::from_secs(2));
        loop {
            let lease = *self.replica_lease.lock().unwrap_or_else(|p| p.into_inner());
            let kept = async {
                let lease = match lease {
                    Some(lease) => lease,
                    None => self.announce().await?,
                };
                let mut client = self.client();
                let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
                loop {
                    tokio::time::sleep(every).await;
                    keeper.keep_alive().await?;
                    match stream.message().await? {
                        Some(response) if response.ttl() > 0 => {}
                        _ => {
                            return Err(etcd_client::Error::LeaseKeepAliveError(
                                "lease not found".into(),
                            ));
                        }
                    }
                }
                #[allow(unreachable_code)]
                Ok::<(), etcd_client::Error>(())
            };
            let error = tokio::select! {
                () = self.stop.cancelled() => return,
                result = kept => result.err(),
            };
            if let Some(error) = error {
                warn!(%error, "registry replica key: keep-alive failed; announcing again");
                if matches!(error, etcd_client::Error::LeaseKeepAliveError(_)) {
                    *self.replica_lease.lock().unwrap_or_else(|p| p.into_inner()) = None;
                }
            }
            tokio::select! {
                () = self.stop.cancelled() => return,
                () = backoff.wait() => {}
            }
        }
    }

    /// Asks etcd for its status every second; SERVING while it answers within
    /// `request_timeout` and the mirror's watch is connected.
    ///
    /// etcd's alarms (NOSPACE: writes refused until an operator frees space) are logged as
    /// they appear and clear; reads and lease keep-alives go on under them, so the replica
    /// stays SERVING.
    async fn run_status(self: Arc<Self>) {
        let mut mirrored = self.mirrored.subscribe();
        let mut served = false;
        let mut alarms: Vec<String> = Vec::new();
        loop {
            let mut client = self.client();
            let mut answered =
                tokio::time::timeout(self.config.request_timeout, client.status()).await;
            if !matches!(answered, Ok(Ok(_))) && self.fail_over().await {
                let mut client = self.client();
                answered = tokio::time::timeout(self.config.request_timeout, client.status()).await;
            }
            if let Ok(Ok(status)) = &answered
                && status.errors() != alarms.as_slice()
            {
                alarms = status.errors().to_vec();
                if alarms.is_empty() {
                    info!("etcd's alarms cleared");
                } else {
                    warn!(alarms = %alarms.join("; "), "etcd raised alarms: registrations and state changes fail until its operator clears them (NOSPACE: compact, defragment, `etcdctl alarm disarm`)");
                }
            }
            let up = matches!(answered, Ok(Ok(_))) && *mirrored.borrow_and_update();
            let was = self.serving.send_replace(up);
            if was != up {
                if up && !served {
                    info!("etcd answers and the mirror is current; registry SERVING");
                } else if up {
                    info!("etcd answers again; registry SERVING");
                } else {
                    warn!(endpoints = %endpoints_of(&self.config), "etcd does not answer; registry NOT_SERVING (routers keep their last view)");
                }
                served |= up;
            }
            tokio::select! {
                () = self.stop.cancelled() => return,
                () = tokio::time::sleep(STATUS_INTERVAL) => {}
                _ = mirrored.changed() => {}
            }
        }
    }

    /// Mirrors etcd into the view from revision `next`, forever: reconnects after errors
    /// from where it left off, and reads the table afresh when etcd compacted past it.
    async fn run_mirror(self: Arc<Self>, mut next: i64) {
        let mut backoff = Backoff::doubling(Duration::from_millis(50), Duration::from_secs(2));
        loop {
            let outcome = tokio::select! {
                () = self.stop.cancelled() => return,
                outcome = self.mirror_from(&mut next) => outcome,
            };
            self.mirrored.send_replace(false);
            match outcome {
                Mirror::Compacted(compacted) => {
                    warn!(
                        next,
                        compacted,
                        "etcd compacted the revisions this replica needed; reading the table afresh"
                    );
                    match self.load(SnapshotCause::Compacted).await {
                        Ok(revision) => {
                            next = revision.cast_signed() + 1;
                            self.rescan();
                            continue;
                        }
                        Err(error) => warn!(%error, "etcd: reading the table failed"),
                    }
                }
                Mirror::Failed(error) => {
                    warn!(%error, next, "etcd watch failed; reconnecting from where it left off");
                }
            }
            tokio::select! {
                () = self.stop.cancelled() => return,
                () = backoff.wait() => {}
            }
        }
    }

    async fn mirror_from(self: &Arc<Self>, next: &mut i64) -> Mirror {
        let mut client = self.client();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(*next)
            .with_progress_notify();
        let mut stream = match client
            .watch(self.config.prefix.clone(), Some(options))
            .await
        {
            Ok(stream) => stream,
            Err(error) => return Mirror::Failed(error.to_string()),
        };
        loop {
            let response = match stream.message().await {
                Ok(Some(response)) => response,
                Ok(None) => return Mirror::Failed("etcd ended the watch".into()),
                Err(error) => return Mirror::Failed(error.to_string()),
            };
            if response.compact_revision() > 0 {
                return Mirror::Compacted(response.compact_revision());
            }
            if response.canceled() {
                return Mirror::Failed(format!(
                    "etcd cancelled the watch: {}",
                    response.cancel_reason()
                ));
            }
            if response.created() {
                self.mirrored.send_replace(true);
            }
            let events = response.events();
            if events.is_empty() {
                // A progress notification: every event up to its revision has been sent.
                if let Some(header) = response.header()
                    && !response.created()
                {
                    *next = (*next).max(header.revision() + 1);
                    self.view.apply_progress(header.revision().cast_unsigned());
                }
                continue;
            }
            let mut replicas_changed = false;
            for event in events {
                let Some(kv) = event.kv() else { continue };
                let revision = kv.mod_revision();
                *next = (*next).max(revision + 1);
                let revision = revision.cast_unsigned();
                let put = event.event_type() == EventType::Put;
                if let Some(id) = self.name_of("instances", kv.key()) {
                    match self.stored_at(kv).filter(|_| put) {
                        Some(held) => {
                            self.view.apply_put(held.clone(), revision);
                            self.consider(held);
                        }
                        None => {
                            if put {
                                warn!(key = %String::from_utf8_lossy(kv.key()), "an etcd value that is not an instance this registry wrote: the instance id counts as unregistered");
                            }
                            self.report_written_forget(&id);
                            // The key no longer holds an instance: one it held leaves.
                            self.view.apply_delete(&id, revision);
                        }
                    }
                } else if let Some(lease) = self.name_of("drained", kv.key()) {
                    self.view.apply_drained(&lease, put);
                    self.view.apply_progress(revision);
                } else if let Some(replica) = self.name_of("replicas", kv.key()) {
                    // A key on no lease would outlive its replica: it counts as gone.
                    let live_key = put && kv.lease() != 0;
                    if replica == self.replica_id {
                        if !live_key {
                            // Someone deleted (or detached) this replica's key: put it back,
                            // or the others would probe this replica's share twice.
                            tokio::spawn(Arc::clone(self).reannounce());
                        }
                    } else {
                        let mut live = self.replicas.lock().unwrap_or_else(|p| p.into_inner());
                        replicas_changed |= if live_key {
                            live.insert(replica)
                        } else {
                            live.remove(&replica)
                        };
                    }
                    self.view.apply_progress(revision);
                } else if kv.key() == self.key_of_table().as_bytes() {
                    // Deleted with the whole prefix, it marks a wiped table: replicas started
                    // from then on serve a new epoch (routers moving to them take a fresh
                    // snapshot, which says EPOCH_CHANGED), so it is not written back.
                    if !put || kv.value() != self.table_id.as_bytes() {
                        warn!(key = %self.key_of_table(), "the registry table id in etcd was deleted or changed: replicas that start from now on serve another Watch epoch than this one");
                    }
                    self.view.apply_progress(revision);
                } else {
                    self.view.apply_progress(revision);
                }
            }
            if replicas_changed {
                let live: Vec<String> = self
                    .replicas
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .cloned()
                    .collect();
                info!(replicas = ?live, "registry replicas changed; probing is split anew");
                self.rescan();
            }
        }
    }

    /// Forgets when a heartbeat's report of `instance_id` was last written (it left the table).
    fn report_written_forget(&self, instance_id: &str) {
        self.report_written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(instance_id);
    }

    /// Whether this replica probes `instance_id` (see [`prober_of`]).
    fn probes(&self, instance_id: &str) -> bool {
        let live = self.replicas.lock().unwrap_or_else(|p| p.into_inner());
        prober_of(live.iter().map(String::as_str), instance_id) == Some(self.replica_id.as_str())
    }

    /// Starts probing every instance this replica now probes that has not passed.
    fn rescan(self: &Arc<Self>) {
        for (held, _) in self.view.held_all() {
            self.consider(held);
        }
    }

    /// Starts probing `held` when it waits for its first probe, this replica probes it, and
    /// no probe of its lease runs here already.
    fn consider(self: &Arc<Self>, held: Held) {
        if held.probed || !self.view.config().health_probe {
            return;
        }
        let id = instance_id(&held.instance).to_string();
        if !self.probes(&id) {
            return;
        }
        let lease_id = held.instance.lease_id.clone();
        let Some(spec) = held.instance.spec.clone() else {
            return;
        };
        if !self
            .probing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(lease_id.clone())
        {
            return;
        }
        let this = Arc::clone(self);
        let tls = self.probe_tls.clone().map(|tls| {
            let expected = reach_trust::Identity::agent(tls.trust_domain(), &spec.service).ok();
            (tls, expected)
        });
        tokio::spawn(async move {
            crate::probe::probe_until_ready(
                Arc::clone(&this),
                id,
                lease_id.clone(),
                spec.endpoint,
                tls,
            )
            .await;
            this.probing
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&lease_id);
        });
    }

    /// The instance as etcd holds it now, with its key's mod revision.
    async fn read(&self, instance_id: &str) -> Result<Option<(Held, i64)>, RegistryError> {
        let mut client = self.client();
        let response = client
            .get(self.key("instances", instance_id), None)
            .await
            .map_err(|e| unavailable(&e))?;
        Ok(response
            .kvs()
            .first()
            .and_then(|kv| Some((self.stored_at(kv)?, kv.mod_revision()))))
    }

    /// The instance from the view when it holds `lease_id` there, else from etcd: the view may
    /// not have seen a registration (or re-registration) through another replica yet.
    async fn current(
        &self,
        instance_id: &str,
        lease_id: &str,
    ) -> Result<Option<(Held, i64)>, RegistryError> {
        match self.view.held(instance_id) {
            Some((held, revision)) if held.instance.lease_id == lease_id => {
                Ok(Some((held, revision.cast_signed())))
            }
            _ => self.read(instance_id).await,
        }
    }

    /// The identity that registered `instance_id` when `lease_id` is its live lease, read from
    /// etcd when this replica's view has not seen the lease yet; `None` for an unknown
    /// instance or another lease (or when etcd does not answer: the write then fails anyway).
    pub async fn owner_of(&self, instance_id: &str, lease_id: &str) -> Option<String> {
        match self.current(instance_id, lease_id).await {
            Ok(Some((held, _))) if held.instance.lease_id == lease_id => Some(held.owner),
            _ => None,
        }
    }

    /// Changes the instance `instance_id` of `lease_id` with `change` (which returns whether
    /// it changed anything), by compare-and-swap on the key's mod revision, retrying when
    /// another replica wrote in between. Returns the revision written, `None` when nothing
    /// changed.
    ///
    /// # Errors
    /// [`RegistryError::LeaseNotFound`] when the instance is gone or holds another lease,
    /// [`RegistryError::StoreUnavailable`] when etcd fails or the key keeps changing.
    async fn update(
        &self,
        instance_id: &str,
        lease_id: &str,
        mut change: impl FnMut(&mut Held) -> bool,
    ) -> Result<Option<u64>, RegistryError> {
        let not_found = || RegistryError::LeaseNotFound {
            instance_id: instance_id.to_string(),
            lease_id: lease_id.to_string(),
        };
        let key = self.key("instances", instance_id);
        let mut current = self.current(instance_id, lease_id).await?;
        for _ in 0..CAS_ATTEMPTS {
            let Some((held, revision)) = current.take() else {
                return Err(not_found());
            };
            if held.instance.lease_id != lease_id {
                return Err(not_found());
            }
            let mut next = held;
            if !change(&mut next) {
                return Ok(None);
            }
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    key.clone(),
                    CompareOp::Equal,
                    revision,
                )])
                .and_then([TxnOp::put(
                    key.clone(),
                    StoredInstance::encode(&next),
                    Some(PutOptions::new().with_ignore_lease()),
                )])
                .or_else([TxnOp::get(key.clone(), None)]);
            let mut client = self.client();
            let response = client.txn(txn).await.map_err(|e| write_refused(&e))?;
            if response.succeeded() {
                return Ok(Some(
                    response
                        .header()
                        .map_or(0, |h| h.revision())
                        .cast_unsigned(),
                ));
            }
            current = self
                .got(&response.op_responses())
                .and_then(|(held, revision)| Some((held?, revision)));
        }
        Err(RegistryError::StoreUnavailable(format!(
            "instance {instance_id:?} kept changing under {CAS_ATTEMPTS} attempts to write it"
        )))
    }

    /// Waits (at most `request_timeout`) until the view holds `revision`, so that a caller
    /// reads its own write from this replica.
    async fn settle(&self, revision: u64) {
        if !self
            .view
            .applied(revision, self.config.request_timeout)
            .await
        {
            debug!(revision, "the mirror has not caught up with a write yet");
        }
    }

    /// Registers (or replaces) an instance: a new etcd lease of the granted TTL (whole
    /// seconds, at least etcd's minimum), and the key written on it unless another identity
    /// holds the instance id. The old lease of a replaced registration is revoked.
    ///
    /// # Errors
    /// [`RegistryError::CapabilityNotDeclared`] in strict mode, [`RegistryError::NotOwner`]
    /// when another identity holds the id, [`RegistryError::StoreUnavailable`] when etcd
    /// fails.
    pub async fn register(
        &self,
        spec: CheckedSpec,
        requested_ttl: Option<Duration>,
        owner: &str,
    ) -> Result<Registration, RegistryError> {
        let spec: InstanceSpec = spec.spec().clone();
        self.view.check_declared(&spec)?;
        let ttl = self.view.config().grant(requested_ttl);
        let mut client = self.client();
        let grant = client
            .lease_grant(ttl_secs(ttl), None)
            .await
            .map_err(|e| unavailable(&e))?;
        let lease = grant.id();
        let granted = Duration::from_secs(grant.ttl().max(1).cast_unsigned());
        let written = self.write_registration(spec, lease, granted, owner).await;
        if written.is_err() {
            let _ = client.lease_revoke(lease).await;
        }
        let (registration, revision, replaced) = written?;
        if let Some(old) = replaced.filter(|old| *old != lease) {
            // The key is on the new lease now: revoking the old one deletes nothing.
            let _ = client.lease_revoke(old).await;
        }
        self.settle(revision).await;
        info!(instance = %instance_id(&registration.instance), lease_ttl = ?granted, "instance registered (etcd)");
        Ok(registration)
    }

    async fn write_registration(
        &self,
        spec: InstanceSpec,
        lease: i64,
        granted: Duration,
        owner: &str,
    ) -> Result<(Registration, u64, Option<i64>), RegistryError> {
        let probed = !self.view.config().health_probe;
        let now = SystemTime::now();
        let lease_id = format!(
            "{:016x}.{}",
            lease.cast_unsigned(),
            uuid::Uuid::new_v4().simple()
        );
        let key = self.key("instances", &spec.instance_id);
        let instance_id = spec.instance_id.clone();
        let mut instance = Instance {
            state: if probed {
                InstanceState::Ready
            } else {
                InstanceState::Registered
            } as i32,
            lease_id: lease_id.clone(),
            lease_expires_at: Some(reach_rpc::time::timestamp(now + granted)),
            registered_at: Some(reach_rpc::time::timestamp(now)),
            spec: Some(spec),
            ..Instance::default()
        };
        let held = Held {
            instance: instance.clone(),
            owner: owner.to_string(),
            lease_ttl: granted,
            probed,
        };
        let value = StoredInstance::encode(&held);
        // Assume a new id first (one round trip); the transaction's else branch reads the
        // key when it exists, and the next attempt compares against what it read.
        let mut current: Option<(Option<Held>, i64)> = None;
        for _ in 0..CAS_ATTEMPTS {
            let (expected, replaced) = match current.take() {
                Some((None, revision)) => {
                    warn!(instance = %instance_id, "overwriting an etcd value under this instance id that is not an instance this registry wrote");
                    (revision, None)
                }
                Some((Some(existing), revision)) => {
                    if existing.owner != owner {
                        return Err(RegistryError::NotOwner {
                            identity: owner.to_string(),
                            instance_id,
                            owner: existing.owner,
                        });
                    }
                    (revision, etcd_lease_of(&existing.instance.lease_id))
                }
                None => (0, None),
            };
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    key.clone(),
                    CompareOp::Equal,
                    expected,
                )])
                .and_then([TxnOp::put(
                    key.clone(),
                    value.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                )])
                .or_else([TxnOp::get(key.clone(), None)]);
            let mut client = self.client();
            let response = client.txn(txn).await.map_err(|e| write_refused(&e))?;
            if response.succeeded() {
                let revision = response
                    .header()
                    .map_or(0, |h| h.revision())
                    .cast_unsigned();
                instance.revision = revision;
                return Ok((
                    Registration {
                        lease_id,
                        lease_ttl: granted,
                        instance,
                    },
                    revision,
                    replaced,
                ));
            }
            current = self.got(&response.op_responses());
        }
        Err(RegistryError::StoreUnavailable(format!(
            "instance {instance_id:?} kept changing under {CAS_ATTEMPTS} attempts to register it"
        )))
    }

    /// Renews the lease (an etcd keep-alive) and records the reported state and load,
    /// writing only when they changed. Returns when the lease now ends and the state.
    ///
    /// # Errors
    /// [`RegistryError::Drained`] when an operator drained the lease,
    /// [`RegistryError::LeaseNotFound`] when it is unknown or expired,
    /// [`RegistryError::StoreUnavailable`] when etcd fails.
    pub async fn heartbeat(
        &self,
        instance_id: &str,
        lease_id: &str,
        reported: InstanceState,
        load: Load,
    ) -> Result<(SystemTime, InstanceState), RegistryError> {
        if self.view.is_drained(lease_id) {
            return Err(RegistryError::Drained(instance_id.to_string()));
        }
        let not_found = || RegistryError::LeaseNotFound {
            instance_id: instance_id.to_string(),
            lease_id: lease_id.to_string(),
        };
        let lease = etcd_lease_of(lease_id).ok_or_else(not_found)?;
        let Some((held, _)) = self.current(instance_id, lease_id).await? else {
            return Err(not_found());
        };
        if held.instance.lease_id != lease_id {
            return Err(not_found());
        }
        let mut client = self.client();
        match client.lease_keep_alive(lease).await {
            Ok(_) => {}
            Err(etcd_client::Error::LeaseKeepAliveError(_)) => return Err(not_found()),
            Err(error) => return Err(unavailable(&error)),
        }
        let expires = SystemTime::now() + held.lease_ttl;
        let mut state = held.instance.state();
        let now = tokio::time::Instant::now();
        let due = self
            .report_written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(instance_id)
            .is_none_or(|at| now.duration_since(*at) >= REPORT_WRITE_INTERVAL);
        let recorded = self
            .update(instance_id, lease_id, |held| {
                let before = held.instance.state();
                let (next, changed) =
                    crate::store::apply_report(&mut held.instance, held.probed, reported, load);
                state = next;
                // A change waits for a later heartbeat when one was written within the
                // interval (that heartbeat compares against what etcd holds again), except
                // DRAINING, which routers must see at once.
                let draining = next == InstanceState::Draining && before != next;
                changed && (due || draining)
            })
            .await;
        let written = match recorded {
            Ok(written) => written,
            // The lease is renewed; the report is written by a later heartbeat (each compares
            // against what etcd holds). Answer with the state etcd holds.
            Err(RegistryError::StoreUnavailable(why)) => {
                warn!(instance = %instance_id, %why, "heartbeat renewed the lease but could not record the reported state and load");
                return Ok((expires, held.instance.state()));
            }
            Err(error) => return Err(error),
        };
        if let Some(revision) = written {
            self.report_written
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(instance_id.to_string(), now);
            self.settle(revision).await;
        }
        Ok((expires, state))
    }

    /// Records the one-time join token `jti` (expiring at `exp`, unix seconds) as used, for
    /// every replica: `tokens/{jti}` created if absent, on an etcd lease that ends with the
    /// token (at most [`MAX_TOKEN_RECORD_SECS`]). Returns whether this claim created it.
    ///
    /// # Errors
    /// [`RegistryError::StoreUnavailable`] when etcd fails.
    pub async fn claim_token(&self, jti: &str, exp: u64) -> Result<bool, RegistryError> {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let ttl = exp.saturating_sub(now).clamp(1, MAX_TOKEN_RECORD_SECS);
        let mut client = self.client();
        let lease = client
            .lease_grant(ttl.cast_signed(), None)
            .await
            .map_err(|e| unavailable(&e))?
            .id();
        let key = self.key("tokens", jti);
        let txn = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                Vec::new(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let created = client.txn(txn).await.map(|r| r.succeeded());
        if !matches!(created, Ok(true)) {
            let _ = client.lease_revoke(lease).await;
        }
        created.map_err(|e| unavailable(&e))
    }

    /// Deletes the record of [`EtcdRegistry::claim_token`] (the registration it was for
    /// failed, so the token was not used). Best effort: a record left behind only expires.
    pub async fn release_token(&self, jti: &str) {
        let mut client = self.client();
        let _ = client.delete(self.key("tokens", jti), None).await;
    }

    /// Removes an instance at once (revokes its etcd lease, which deletes its key).
    ///
    /// # Errors
    /// [`RegistryError::LeaseNotFound`] when the instance or lease is unknown,
    /// [`RegistryError::StoreUnavailable`] when etcd fails.
    pub async fn deregister(&self, instance_id: &str, lease_id: &str) -> Result<(), RegistryError> {
        let not_found = || RegistryError::LeaseNotFound {
            instance_id: instance_id.to_string(),
            lease_id: lease_id.to_string(),
        };
        let lease = etcd_lease_of(lease_id).ok_or_else(not_found)?;
        match self.current(instance_id, lease_id).await? {
            Some((held, _)) if held.instance.lease_id == lease_id => {}
            _ => return Err(not_found()),
        }
        let mut client = self.client();
        let revoked = client.lease_revoke(lease).await.map_err(|e| match &e {
            etcd_client::Error::GRpcStatus(status) if status.code() == tonic::Code::NotFound => {
                not_found()
            }
            _ => unavailable(&e),
        })?;
        info!(instance = %instance_id, "instance deregistered (etcd)");
        self.settle(revoked.header().map_or(0, |h| h.revision()).cast_unsigned())
            .await;
        Ok(())
    }

    /// Drains every instance of `service`: each becomes DRAINING, its lease is recorded as
    /// drained (for 10 minutes), and its lease is revoked once it reports no work in flight
    /// or after `grace`. Returns the drained instance ids.
    pub async fn drain_service(self: &Arc<Self>, service: &str, grace: Duration) -> Vec<String> {
        let targets: Vec<(String, String)> = self
            .view
            .list(service, "")
            .instances
            .iter()
            .filter(|i| crate::store::service_of(i) == service)
            .map(|i| (instance_id(i).to_string(), i.lease_id.clone()))
            .collect();
        let mut client = self.client();
        let tombstone = client
            .lease_grant(DRAINED_TTL_SECS, None)
            .await
            .ok()
            .map(|g| g.id());
        let mut drained = Vec::new();
        for (id, lease_id) in targets {
            if let Some(tombstone) = tombstone {
                let _ = client
                    .put(
                        self.key("drained", &lease_id),
                        Vec::new(),
                        Some(PutOptions::new().with_lease(tombstone)),
                    )
                    .await;
            }
            let marked = self
                .update(&id, &lease_id, |held| {
                    let changed = held.instance.state() != InstanceState::Draining;
                    held.instance.state = InstanceState::Draining as i32;
                    changed
                })
                .await;
            match marked {
                Ok(_) => {
                    info!(instance = %id, "instance drained by an operator (etcd)");
                    drained.push((id, lease_id));
                }
                Err(error) => warn!(instance = %id, %error, "could not drain"),
            }
        }
        let ids = drained.iter().map(|(id, _)| id.clone()).collect();
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + grace;
            let mut pending = drained;
            while !pending.is_empty() {
                let overdue = tokio::time::Instant::now() >= deadline;
                let mut still = Vec::new();
                for (id, lease_id) in pending {
                    let idle = this
                        .view
                        .held(&id)
                        .is_none_or(|(held, _)| held.instance.in_flight == 0);
                    match etcd_lease_of(&lease_id) {
                        Some(lease) if idle || overdue => {
                            let mut client = this.client();
                            let _ = client.lease_revoke(lease).await;
                        }
                        Some(_) => still.push((id, lease_id)),
                        None => {}
                    }
                }
                pending = still;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        ids
    }

    /// Removes every instance of `service` at once (revokes their leases). Returns how many.
    pub async fn remove_service(&self, service: &str) -> usize {
        let leases: Vec<i64> = self
            .view
            .list(service, "")
            .instances
            .iter()
            .filter_map(|i| etcd_lease_of(&i.lease_id))
            .collect();
        let mut client = self.client();
        let mut removed = 0;
        for lease in leases {
            if client.lease_revoke(lease).await.is_ok() {
                removed += 1;
            }
        }
        removed
    }
}

/// The id under `{prefix}table`, created (a random UUID) by the first replica to start on an
/// empty prefix: a create-if-absent transaction, so concurrent first replicas agree.
async fn table_id(client: &mut Client, prefix: &str) -> Result<String, etcd_client::Error> {
    let key = format!("{prefix}table");
    let fresh = uuid::Uuid::new_v4().simple().to_string();
    let txn = Txn::new()
        .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.clone(), fresh.clone(), None)])
        .or_else([TxnOp::get(key, None)]);
    let response = client.txn(txn).await?;
    if response.succeeded() {
        return Ok(fresh);
    }
    Ok(response
        .op_responses()
        .iter()
        .find_map(|op| match op {
            TxnOpResponse::Get(get) => get
                .kvs()
                .first()
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
            _ => None,
        })
        .unwrap_or(fresh))
}

/// First probes on etcd: only the instances this replica probes ([`prober_of`]), and the
/// outcome written to etcd for every replica to see.
impl crate::probe::ProbeTarget for Arc<EtcdRegistry> {
    fn probe_timeout(&self) -> Duration {
        self.view.config().probe_timeout
    }

    /// Whether a probe of `lease_id` of `instance_id` should go on: the lease is live, its
    /// probe has not passed, and this replica still probes it.
    fn should_probe(&self, instance_id: &str, lease_id: &str) -> bool {
        !self.stop.is_cancelled()
            && self
                .view
                .held(instance_id)
                .is_some_and(|(held, _)| held.instance.lease_id == lease_id && !held.probed)
            && self.probes(instance_id)
    }

    /// Marks the first health probe of `lease_id` passed: REGISTERED becomes READY.
    async fn probe_passed(&self, instance_id: &str, lease_id: &str) {
        let result = self
            .update(instance_id, lease_id, |held| {
                if held.probed {
                    return false;
                }
                held.probed = true;
                held.instance.health_probe_error.clear();
                if held.instance.state() == InstanceState::Registered {
                    held.instance.state = InstanceState::Ready as i32;
                }
                true
            })
            .await;
        match result {
            Ok(_) => debug!(instance = %instance_id, "health probe passed"),
            Err(error) => debug!(instance = %instance_id, %error, "recording a passed probe"),
        }
    }

    /// Records why the first health probe failed; returns whether the reason changed.
    async fn probe_failed(&self, instance_id: &str, lease_id: &str, reason: &str) -> bool {
        self.update(instance_id, lease_id, |held| {
            if held.probed || held.instance.health_probe_error == reason {
                return false;
            }
            held.instance.health_probe_error = reason.to_string();
            true
        })
        .await
        .is_ok_and(|written| written.is_some())
    }
}

/// `client`'s first status call, within `dial_timeout`: the client and the status, or why not.
async fn first_status(
    mut client: Client,
    etcd: &EtcdConfig,
) -> Result<(Client, etcd_client::StatusResponse), String> {
    match tokio::time::timeout(etcd.dial_timeout, client.status()).await {
        Ok(Ok(status)) => Ok((client, status)),
        Ok(Err(error)) => Err(reach_rpc::errors::chain(&error)),
        Err(_) => Err(format!(
            "no answer within registry.etcd.dial_timeout ({})",
            crate::config::readable(etcd.dial_timeout)
        )),
    }
}

/// How a mirror's watch ended.
enum Mirror {
    /// etcd compacted past the revision it needed (the compaction revision).
    Compacted(i64),
    /// It broke (etcd unreachable, the stream ended); the reason.
    Failed(String),
}

/// `ttl` as an etcd lease TTL: whole seconds, rounded up, at least 1.
fn ttl_secs(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis().div_ceil(1000))
        .unwrap_or(i64::MAX)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_instance_has_one_prober_and_a_removed_replica_moves_only_its_share() {
        let three = ["r-a", "r-b", "r-c"];
        let ids: Vec<String> = (0..300).map(|i| format!("instance-{i}")).collect();
        let mut shares = std::collections::HashMap::new();
        for id in &ids {
            *shares.entry(prober_of(three, id).unwrap()).or_insert(0) += 1;
        }
        for replica in three {
            let share = shares[replica];
            assert!(
                (60..=140).contains(&share),
                "{replica} probes {share} of 300"
            );
        }
        // r-b dies: its instances move, every other keeps its prober.
        for id in &ids {
            let before = prober_of(three, id).unwrap();
            let after = prober_of(["r-a", "r-c"], id).unwrap();
            if before != "r-b" {
                assert_eq!(before, after, "{id} moved although its prober lives");
            }
        }
        assert_eq!(prober_of([], "x"), None);
    }

    #[test]
    fn lease_ids_carry_the_etcd_lease_and_a_secret() {
        assert_eq!(
            etcd_lease_of("694d7a1c2e3f4a5b.0123abcd"),
            Some(0x694d_7a1c_2e3f_4a5b)
        );
        assert_eq!(etcd_lease_of("694d7a1c2e3f4a5b."), None, "no secret");
        assert_eq!(etcd_lease_of("694d7a1c2e3f4a5b"), None);
        assert_eq!(
            etcd_lease_of("0123456789abcdef0123456789abcdef"),
            None,
            "an in-memory lease id"
        );
        assert_eq!(ttl_secs(Duration::from_millis(100)), 1);
        assert_eq!(ttl_secs(Duration::from_millis(1500)), 2);
        assert_eq!(ttl_secs(Duration::from_secs(10)), 10);
    }

    #[test]
    fn a_stored_instance_round_trips_with_the_keys_revision() {
        let held = Held {
            instance: Instance {
                lease_id: "00000000000000ff.s".into(),
                revision: 99,
                spec: Some(InstanceSpec {
                    instance_id: "i".into(),
                    ..InstanceSpec::default()
                }),
                ..Instance::default()
            },
            owner: "anonymous".into(),
            lease_ttl: Duration::from_secs(10),
            probed: true,
        };
        let decoded = StoredInstance::decode(&StoredInstance::encode(&held), 7).unwrap();
        assert_eq!(
            decoded.instance.revision, 7,
            "the revision is the key's, not stored"
        );
        assert_eq!(decoded.lease_ttl, held.lease_ttl);
        assert_eq!(decoded.owner, held.owner);
        assert!(StoredInstance::decode(b"\xff\xff not protobuf", 1).is_none());
    }
}
