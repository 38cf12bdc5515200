//! Where the instance table lives: this process's memory ([`Registry`]) or etcd
//! ([`EtcdRegistry`](crate::etcd::EtcdRegistry), with the `etcd` feature). The gRPC service,
//! the health prober and the admin API write through a [`Backend`] and read from its
//! [`Backend::view`].

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use reach_proto::v1::InstanceState;

use crate::config::RegistryConfig;
use crate::error::{InitError, RegistryError};
use crate::store::{CheckedSpec, Load, Registration, Registry};

/// A registry backend. Cloning shares it.
#[derive(Clone)]
pub enum Backend {
    /// The in-memory table: one replica, lost when the process stops.
    Memory(Registry),
    /// etcd v3: any number of replicas share the table.
    #[cfg(feature = "etcd")]
    Etcd(Arc<crate::etcd::EtcdRegistry>),
}

impl From<Registry> for Backend {
    fn from(registry: Registry) -> Self {
        Self::Memory(registry)
    }
}

impl Backend {
    /// The backend `config.backend` names: an in-memory [`Registry`], or a connection to etcd
    /// (`probe_tls` is what its health probes present). With the in-memory backend, spawn
    /// [`Registry::run_sweeper`] on [`Backend::view`] to expire leases.
    ///
    /// # Errors
    /// As [`Registry::new`]; for etcd, [`InitError::Etcd`] when etcd cannot be used, and
    /// [`InitError::EtcdNotBuilt`] when this build has no etcd support.
    pub async fn start(
        config: RegistryConfig,
        probe_tls: Option<Arc<reach_trust::tls::TlsSource>>,
    ) -> Result<Self, InitError> {
        match config.backend {
            crate::config::Backend::Memory => Ok(Self::Memory(Registry::new(config)?)),
            #[cfg(feature = "etcd")]
            crate::config::Backend::Etcd => Ok(Self::Etcd(
                crate::etcd::EtcdRegistry::connect(config, probe_tls).await?,
            )),
            #[cfg(not(feature = "etcd"))]
            crate::config::Backend::Etcd => {
                let _ = probe_tls;
                Err(InitError::EtcdNotBuilt)
            }
        }
    }

    /// The table reads are served from (for etcd, this replica's mirror of it).
    pub fn view(&self) -> &Registry {
        match self {
            Self::Memory(registry) => registry,
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.view(),
        }
    }

    /// Whether this backend's own first health probes run at registration (the in-memory
    /// backend); the etcd backend starts them itself, split between replicas.
    pub fn probes_at_registration(&self) -> bool {
        matches!(self, Self::Memory(_))
    }

    /// Whether several replicas share this backend's table (etcd): a replica's view may lag
    /// another's by a moment.
    pub fn is_shared(&self) -> bool {
        !matches!(self, Self::Memory(_))
    }

    /// SERVING while the backend can take writes: always for memory; for etcd, while etcd
    /// answers and this replica's mirror is current.
    pub fn serving(&self) -> tokio::sync::watch::Receiver<bool> {
        match self {
            Self::Memory(_) => tokio::sync::watch::channel(true).1,
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.serving(),
        }
    }

    /// Records the one-time join token `jti` (expiring at `exp`, unix seconds) as used where
    /// every replica sees it: `Ok(true)` when this claim is the first. The in-memory backend
    /// has one replica, whose own record ([`crate::tokens::UsedTokens`]) is enough: `true`.
    ///
    /// # Errors
    /// [`RegistryError::StoreUnavailable`] when etcd does not take the record.
    pub async fn claim_token(&self, jti: &str, exp: u64) -> Result<bool, RegistryError> {
        match self {
            // The in-memory registry's own record of `jti` is the only one there is.
            Self::Memory(_) => {
                let _ = (jti, exp);
                Ok(true)
            }
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.claim_token(jti, exp).await,
        }
    }

    /// Forgets a claim of [`Backend::claim_token`] (the registration failed for another
    /// reason, so the token was not used).
    pub async fn release_token(&self, jti: &str) {
        match self {
            Self::Memory(_) => {
                let _ = jti;
            }
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.release_token(jti).await,
        }
    }

    /// Registers (or replaces) an instance owned by `owner`; see [`Registry::register_owned`].
    ///
    /// # Errors
    /// As [`Registry::register_owned`], and [`RegistryError::StoreUnavailable`] for etcd.
    pub async fn register(
        &self,
        spec: CheckedSpec,
        requested_ttl: Option<Duration>,
        owner: &str,
    ) -> Result<Registration, RegistryError> {
        match self {
            Self::Memory(registry) => registry.register_owned(spec, requested_ttl, owner),
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.register(spec, requested_ttl, owner).await,
        }
    }

    /// Renews a lease and records the reported state and load; see
    /// [`Registry::heartbeat_load`].
    ///
    /// # Errors
    /// As [`Registry::heartbeat_load`], and [`RegistryError::StoreUnavailable`] for etcd.
    pub async fn heartbeat(
        &self,
        instance_id: &str,
        lease_id: &str,
        reported: InstanceState,
        load: Load,
    ) -> Result<(SystemTime, InstanceState), RegistryError> {
        match self {
            Self::Memory(registry) => {
                registry.heartbeat_load(instance_id, lease_id, reported, load)
            }
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.heartbeat(instance_id, lease_id, reported, load).await,
        }
    }

    /// Removes an instance at once; see [`Registry::deregister`].
    ///
    /// # Errors
    /// As [`Registry::deregister`], and [`RegistryError::StoreUnavailable`] for etcd.
    pub async fn deregister(&self, instance_id: &str, lease_id: &str) -> Result<(), RegistryError> {
        match self {
            Self::Memory(registry) => registry.deregister(instance_id, lease_id),
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.deregister(instance_id, lease_id).await,
        }
    }

    /// Drains every instance of `service`; see [`Registry::drain_service`]. Returns the
    /// drained instance ids.
    pub async fn drain_service(&self, service: &str, grace: Duration) -> Vec<String> {
        match self {
            Self::Memory(registry) => registry.drain_service(service, grace),
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.drain_service(service, grace).await,
        }
    }

    /// Removes every instance of `service` at once; returns how many.
    pub async fn remove_service(&self, service: &str) -> usize {
        match self {
            Self::Memory(registry) => registry.remove_service(service),
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.remove_service(service).await,
        }
    }

    /// The identity that registered `instance_id` when `lease_id` is its live lease; `None`
    /// for an unknown instance or another lease (see [`Registry::owner_of`]). On etcd, read
    /// from etcd when this replica's view has not seen the lease yet.
    pub async fn owner_of(&self, instance_id: &str, lease_id: &str) -> Option<String> {
        match self {
            Self::Memory(registry) => registry.owner_of(instance_id, lease_id),
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.owner_of(instance_id, lease_id).await,
        }
    }

    /// Stops the backend's background work at shutdown and ends its watch streams (for
    /// etcd, also revokes this replica's key so the others take over its probing at once).
    pub async fn close(&self) {
        match self {
            Self::Memory(registry) => registry.close_watches(),
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => etcd.close().await,
        }
    }
}

/// The in-memory registry's first probes (the etcd backend runs its own, split between
/// replicas).
impl crate::probe::ProbeTarget for Registry {
    fn probe_timeout(&self) -> Duration {
        self.config().probe_timeout
    }

    fn should_probe(&self, instance_id: &str, lease_id: &str) -> bool {
        self.holds_lease(instance_id, lease_id)
    }

    async fn probe_passed(&self, instance_id: &str, lease_id: &str) {
        Registry::probe_passed(self, instance_id, lease_id);
    }

    async fn probe_failed(&self, instance_id: &str, lease_id: &str, reason: &str) -> bool {
        Registry::probe_failed(self, instance_id, lease_id, reason)
    }
}
