//! `reach.v1.RegistryService` over a [`Backend`]: writes go to the backend, reads come from
//! its [`Backend::view`].

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use reach_proto::v1::registry_service_server::{RegistryService, RegistryServiceServer};
use reach_proto::v1::{
    DeregisterRequest, DeregisterResponse, HeartbeatRequest, HeartbeatResponse, InstanceState,
    ListCapabilitiesRequest, ListCapabilitiesResponse, ListInstancesRequest, ListInstancesResponse,
    RegisterRequest, RegisterResponse, WatchRequest, WatchResponse, WatchSnapshot,
};
use reach_trust::{Caller, Denied, Trust};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::warn;

use crate::backend::Backend;
use crate::error::RegistryError;
use crate::limits::{ProbeLimiter, WatchSlots, Watcher};
use crate::probe::probe_until_ready;
use crate::store::{Registry, WatchFrom};
use crate::tokens::{Refused, UsedTokens};

/// The gRPC face of a registry [`Backend`].
#[derive(Clone)]
pub struct RegistryGrpc {
    backend: Backend,
    trust: Arc<Trust>,
    used_tokens: Arc<UsedTokens>,
    /// Slots for open Watch streams ([`MAX_WATCHES`]; with trust on, capped per identity with
    /// slots held back for routers).
    watches: WatchSlots,
    /// With trust on: the pace of health probes each registrant identity may start.
    probes: ProbeLimiter,
}

impl RegistryGrpc {
    /// Serves the in-memory `registry` over gRPC, with trust off (see
    /// [`RegistryGrpc::with_trust`]).
    pub fn new(registry: Registry) -> Self {
        Self::with_backend(Backend::Memory(registry))
    }

    /// Serves `backend` over gRPC, with trust off (see [`RegistryGrpc::with_trust`]).
    pub fn with_backend(backend: Backend) -> Self {
        let config = backend.view().config();
        let watches = WatchSlots::new(
            MAX_WATCHES,
            config.router_watch_slots,
            config.max_watches_per_identity,
        );
        let probes = ProbeLimiter::new(
            config.probe_burst_per_identity,
            config.probes_per_second_per_identity,
        );
        Self {
            backend,
            trust: Trust::disabled(),
            used_tokens: Arc::default(),
            watches,
            probes,
        }
    }

    /// Authorizes with `trust`: Register only as the service the caller's certificate or
    /// join token names ([`Trust::check_register`]), a one-time join token once; Heartbeat
    /// and Deregister only by the instance's owner (the identity that registered it) or an
    /// operator, with its lease id (an instance that joined with a join token: its lease id
    /// alone, without credentials); health probes over TLS when `trust` has certificates,
    /// expecting the agent's identity. Also, with trust on: a registration's capabilities,
    /// topics and typed gRPC services must be granted by the policy's `serve` rules
    /// ([`Trust::check_registration`]); its endpoint must be on the registering connection's
    /// own address or one the policy lets the identity advertise ([`Trust::check_endpoint`]);
    /// registrations that start health probes are paced per identity; and only routers, edges
    /// and operators may Watch and ListInstances ([`Trust::check_watcher`]), each identity but
    /// routers with at most `registry.max_watches_per_identity` Watch streams, out of the
    /// slots not held back for routers (`registry.router_watch_slots`).
    pub fn with_trust(mut self, trust: Arc<Trust>) -> Self {
        self.trust = trust;
        self
    }

    /// With trust on: `caller` must own `instance_id` (registered it) or be an operator to
    /// `action` it. An unknown instance or lease passes here (the store answers
    /// LEASE_NOT_FOUND).
    async fn check_owner(
        &self,
        caller: &Caller,
        action: &str,
        instance_id: &str,
        lease_id: &str,
    ) -> Result<(), Status> {
        if !self.trust.is_enabled() {
            return Ok(());
        }
        let Some(owner) = self.backend.owner_of(instance_id, lease_id).await else {
            return Ok(());
        };
        if owner == caller.name() || self.trust.is_operator(caller) {
            return Ok(());
        }
        // An instance that joined with a join token keeps its lease with the lease id alone
        // (it matched above): the token may have been one-time, or have expired since.
        if caller.identity().is_none()
            && reach_trust::Identity::parse(&owner).is_ok_and(|id| id.path().starts_with("/join/"))
        {
            return Ok(());
        }
        let denied = Denied {
            identity: caller.name().to_string(),
            action: action.to_string(),
            target: format!("instance {instance_id:?}"),
            reason: format!(
                "it is registered by {owner}; only its owner or an operator may {action} it"
            ),
        };
        denied.audit();
        Err(denied.to_status())
    }

    /// Claims a one-time join token the caller presents; returns its `jti` to release should
    /// the registration fail for another reason.
    /// The claim is recorded in this process and, on etcd, for every replica (a token is used
    /// once across all of them).
    async fn claim_join_token(
        &self,
        caller: &Caller,
        service: &str,
    ) -> Result<Option<String>, Status> {
        let Some(claims) = caller.claims() else {
            return Ok(None);
        };
        let Ok(Some(grant)) = reach_trust::token::JoinGrant::of(claims) else {
            return Ok(None);
        };
        if !grant.one_time {
            return Ok(None);
        }
        let refuse = |reason: String| {
            let denied = Denied {
                identity: caller.name().to_string(),
                action: "register as".into(),
                target: format!("service {service:?}"),
                reason,
            };
            denied.audit();
            denied.to_status()
        };
        let Some(jti) = claims.get("jti").and_then(serde_json::Value::as_str) else {
            return Err(refuse(
                "its one-time join token has no jti claim to record it by; make one with `reach token join`".into(),
            ));
        };
        let exp = claims
            .get("exp")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(u64::MAX);
        let used = || {
            refuse(format!(
                "its one-time join token (jti {jti}) was used already; make a new one with `reach token join --service {service}`"
            ))
        };
        match self.used_tokens.claim(jti, exp) {
            Ok(()) => match self.backend.claim_token(jti, exp).await {
                Ok(true) => Ok(Some(jti.to_string())),
                // Used through another replica; this one's record stays (it was used).
                Ok(false) => Err(used()),
                Err(error) => {
                    self.used_tokens.release(jti);
                    Err(error.into())
                }
            },
            Err(Refused::Used) => Err(used()),
            Err(Refused::Full) => Err(Status::unavailable(format!(
                "the registry remembers {} one-time join tokens in use and takes no more until some expire; retry later or use a certificate",
                crate::tokens::MAX_USED_TOKENS
            ))),
        }
    }

    /// The tonic service, ready to add to a server.
    pub fn into_server(self) -> RegistryServiceServer<Self> {
        RegistryServiceServer::new(self)
    }
}

impl RegistryGrpc {
    async fn register_request(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<RegisterResponse, Status> {
        // A malformed grpc-timeout is treated as none: the wait is bounded either way.
        let deadline = reach_rpc::deadline::grpc_timeout(request.metadata())
            .ok()
            .flatten();
        let caller = Caller::of(request.extensions());
        let peer = request.remote_addr().map(|address| address.ip());
        let request = request.into_inner();
        let spec = request
            .instance
            .ok_or_else(|| RegistryError::InvalidRegistration("instance is required".into()))?;
        let requested = match request.lease_ttl.as_ref() {
            None => None,
            Some(d) => Some(reach_rpc::time::std_duration(d).ok_or_else(|| {
                RegistryError::InvalidRegistration("lease_ttl must not be negative".into())
            })?),
        };
        let endpoint = spec.endpoint.clone();
        let service = spec.service.clone();
        {
            let capabilities: Vec<&str> =
                spec.capabilities.iter().map(|c| c.name.as_str()).collect();
            let topics: Vec<&str> = spec.topics.iter().map(String::as_str).collect();
            let grpc_services: Vec<&str> = spec.grpc_services.iter().map(String::as_str).collect();
            self.trust
                .check_registration(
                    &caller,
                    &service,
                    reach_trust::Served {
                        capabilities: &capabilities,
                        topics: &topics,
                        grpc_services: &grpc_services,
                    },
                )
                .map_err(|denied| denied.to_status())?;
        }
        // Checking descriptors compiles schemas: off the async workers, one at a time.
        let checked = self
            .backend
            .view()
            .check_off_worker(deadline, move || crate::store::check_spec(spec))
            .await??;
        // Paced before the endpoint is judged (and its name resolved): refused attempts
        // count too, as a scanner's would.
        if self.trust.is_enabled() && self.backend.view().config().health_probe {
            self.probes.take(caller.name())?;
        }
        let probe_endpoint = self
            .check_advertised(&caller, &service, &endpoint, peer)
            .await?;
        let join_token = self.claim_join_token(&caller, &service).await?;
        let registration = match self
            .backend
            .register(checked, requested, caller.name())
            .await
        {
            Ok(registration) => registration,
            Err(error) => {
                if let Some(jti) = join_token {
                    self.used_tokens.release(&jti);
                    self.backend.release_token(&jti).await;
                }
                if let Some(denied) = error.denied() {
                    denied.audit();
                }
                return Err(error.into());
            }
        };
        if self.backend.probes_at_registration() && self.backend.view().config().health_probe {
            let tls = self.trust.tls().cloned().map(|tls| {
                let expected = reach_trust::Identity::agent(tls.trust_domain(), &service).ok();
                (tls, expected)
            });
            tokio::spawn(probe_until_ready(
                self.backend.view().clone(),
                crate::store::instance_id(&registration.instance).to_string(),
                registration.lease_id.clone(),
                probe_endpoint,
                tls,
            ));
        }
        Ok(RegisterResponse {
            lease_id: registration.lease_id,
            lease_ttl: Some(reach_rpc::time::proto_duration(registration.lease_ttl)),
            instance: Some(registration.instance),
        })
    }

    /// With trust on, checks the host of a registration's (valid) `endpoint`: an IP address,
    /// or every address a host name resolves to, must be `peer`'s own or one the policy lets
    /// the caller advertise, unless the name itself is granted ([`Trust::check_endpoint`]).
    /// Returns the endpoint this replica's health probe dials: for a name judged by its
    /// addresses, the address checked, so a name that resolves elsewhere by the time of the
    /// probe (DNS rebinding) is not dialed. `peer` is the address the registration came
    /// from, as Reach's server records it (tonic's `TcpConnectInfo`); unknown, it grants
    /// nothing.
    async fn check_advertised(
        &self,
        caller: &Caller,
        service: &str,
        endpoint: &str,
        peer: Option<std::net::IpAddr>,
    ) -> Result<String, Status> {
        if !self.trust.is_enabled() {
            return Ok(endpoint.to_string());
        }
        let uri: http::Uri = endpoint.parse().map_err(|_| {
            RegistryError::InvalidRegistration(format!(
                "instance.endpoint {endpoint:?} is not a URL"
            ))
        })?;
        let written = uri.host().unwrap_or_default();
        let host = written.trim_start_matches('[').trim_end_matches(']');
        let port = uri.port_u16().unwrap_or_default();
        if self.trust.advertises_by_name(caller, service, host) {
            return Ok(endpoint.to_string());
        }
        let (addresses, is_name) = match host.parse::<std::net::IpAddr>() {
            Ok(ip) => (vec![ip], false),
            Err(_) => (resolve(host, port).await, true),
        };
        self.trust
            .check_endpoint(caller, service, endpoint, host, &addresses, peer)
            .map_err(|denied| denied.to_status())?;
        // Of the addresses checked, the probe dials the registrant's own when the name
        // resolves to it (`localhost` to 127.0.0.1 and ::1, the agent listening on one).
        let peer = peer.map(reach_trust::policy::canonical_ip);
        let dialed = addresses
            .iter()
            .find(|ip| Some(reach_trust::policy::canonical_ip(**ip)) == peer)
            .or_else(|| {
                addresses
                    .iter()
                    .find(|ip| peer.is_some_and(|peer| ip.is_ipv4() == peer.is_ipv4()))
            })
            .or(addresses.first());
        Ok(match dialed {
            Some(ip) if is_name => format!(
                "{}://{}",
                uri.scheme_str().unwrap_or("http"),
                std::net::SocketAddr::new(*ip, port)
            ),
            _ => endpoint.to_string(),
        })
    }

    async fn heartbeat_request(
        &self,
        caller: &Caller,
        request: HeartbeatRequest,
    ) -> Result<HeartbeatResponse, Status> {
        check_ids(&request.instance_id, &request.lease_id)?;
        self.check_owner(caller, "heartbeat", &request.instance_id, &request.lease_id)
            .await?;
        let reported = InstanceState::try_from(request.state)
            .ok()
            .filter(|s| {
                matches!(
                    s,
                    InstanceState::Unspecified
                        | InstanceState::Ready
                        | InstanceState::Busy
                        | InstanceState::Draining
                )
            })
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "state {} cannot be reported: send READY, BUSY or DRAINING (or leave it unset)",
                    request.state
                ))
            })?;
        for (field, value) in [
            ("in_flight", request.in_flight),
            ("model_calls_in_flight", request.model_calls_in_flight),
            ("model_slots_free", request.model_slots_free),
        ] {
            if value > MAX_IN_FLIGHT {
                return Err(Status::invalid_argument(format!(
                    "{field} {value} is implausible; the limit is {MAX_IN_FLIGHT}"
                )));
            }
        }
        let (expires, state) = self
            .backend
            .heartbeat(
                &request.instance_id,
                &request.lease_id,
                reported,
                crate::store::Load {
                    in_flight: request.in_flight,
                    model_calls_in_flight: request.model_calls_in_flight,
                    model_slots_free: request.model_slots_free,
                },
            )
            .await?;
        Ok(HeartbeatResponse {
            lease_expires_at: Some(reach_rpc::time::timestamp(expires)),
            state: state as i32,
        })
    }
}

pub use crate::limits::MAX_WATCHES;

/// How long resolving a registered endpoint's host name may take (with trust on).
const RESOLVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The addresses `host` resolves to (none when it does not resolve within
/// [`RESOLVE_TIMEOUT`]).
async fn resolve(host: &str, port: u16) -> Vec<std::net::IpAddr> {
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port))).await {
        Ok(Ok(addresses)) => addresses.map(|address| address.ip()).collect(),
        Ok(Err(error)) => {
            tracing::debug!(%host, %error, "an advertised host name does not resolve");
            Vec::new()
        }
        Err(_) => Vec::new(),
    }
}

/// How many events wait, copied, for one watcher to take them.
const WATCH_SEND_BUFFER: usize = 16;

/// How long a resumed Watch waits for this replica's mirror to reach the watcher's revision.
const RESUME_CATCH_UP: std::time::Duration = std::time::Duration::from_secs(2);

/// The longest `epoch` a Watch request may carry (epochs are 32 hex digits).
const MAX_EPOCH_BYTES: usize = 128;

/// The largest in-flight (or model slot) count a heartbeat may report.
const MAX_IN_FLIGHT: u32 = 1_000_000;

/// The longest `name_prefix` ListCapabilities takes (the longest capability name).
const MAX_NAME_PREFIX_BYTES: usize = 256;
/// The longest `page_token` ListCapabilities takes (it is a capability name).
const MAX_PAGE_TOKEN_BYTES: usize = 256;
/// The page size of ListCapabilities when the request sets none.
pub const DEFAULT_PAGE_SIZE: usize = 100;
/// The largest page size of ListCapabilities; larger requests get pages of this size.
pub const MAX_PAGE_SIZE: usize = 500;

/// The longest `lease_id` Heartbeat and Deregister take (the registry's own are under 64
/// bytes).
const MAX_LEASE_ID_BYTES: usize = 128;
/// The longest `instance_id` Heartbeat and Deregister take (Register's bound).
const MAX_INSTANCE_ID_BYTES: usize = 256;

/// Refuses ids longer than any the registry grants, before they are looked up or echoed in
/// an error: INVALID_ARGUMENT, naming the field and the bound, not the value.
fn check_ids(instance_id: &str, lease_id: &str) -> Result<(), Status> {
    for (field, value, limit) in [
        ("instance_id", instance_id, MAX_INSTANCE_ID_BYTES),
        ("lease_id", lease_id, MAX_LEASE_ID_BYTES),
    ] {
        if value.len() > limit {
            return Err(Status::invalid_argument(format!(
                "{field} is {} bytes, over the limit of {limit}; send the {field} Register returned, unchanged",
                value.len()
            )));
        }
    }
    Ok(())
}

/// Clears the lease id of an instance shown to others: the lease id is the instance's
/// credential for Heartbeat and Deregister, returned only by Register.
fn redact(instance: &mut reach_proto::v1::Instance) {
    instance.lease_id.clear();
}

/// The most bytes of instances one part of a Watch snapshot carries (see
/// `WatchSnapshot.continues`): under the 4 MiB a gRPC client decodes by default, whatever
/// the instance count.
pub const SNAPSHOT_PART_BYTES: usize = 1 << 20;

/// Sends a shared event to one watcher: copied as it is sent, with every lease id redacted,
/// and a snapshot split into parts of at most [`SNAPSHOT_PART_BYTES`] of instances (one
/// instance larger than that is a part of its own). Returns `false` when the watcher went
/// away.
async fn send_event(
    tx: &mpsc::Sender<Result<WatchResponse, Status>>,
    event: &WatchResponse,
) -> bool {
    use reach_proto::v1::watch_response::Event;
    let Some(Event::Snapshot(snapshot)) = &event.event else {
        let mut event = event.clone();
        if let Some(Event::Upserted(instance) | Event::Removed(instance)) = &mut event.event {
            redact(instance);
        }
        return tx.send(Ok(event)).await.is_ok();
    };
    let part = |instances, continues| WatchResponse {
        revision: event.revision,
        epoch: event.epoch.clone(),
        event: Some(Event::Snapshot(WatchSnapshot {
            instances,
            cause: snapshot.cause,
            continues,
        })),
    };
    let mut instances = Vec::new();
    let mut bytes = 0;
    for instance in &snapshot.instances {
        let mut instance = instance.clone();
        redact(&mut instance);
        let size = prost::Message::encoded_len(&instance);
        if !instances.is_empty() && bytes + size > SNAPSHOT_PART_BYTES {
            if tx
                .send(Ok(part(std::mem::take(&mut instances), true)))
                .await
                .is_err()
            {
                return false;
            }
            bytes = 0;
        }
        bytes += size;
        instances.push(instance);
    }
    tx.send(Ok(part(instances, false))).await.is_ok()
}

/// Records a registry operation's outcome in the metrics and wraps it in a response.
fn observed<T>(operation: &'static str, result: Result<T, Status>) -> Result<Response<T>, Status> {
    let code = result
        .as_ref()
        .map_or_else(Status::code, |_| tonic::Code::Ok);
    crate::metrics::operation(operation, code);
    result.map(Response::new)
}

#[tonic::async_trait]
impl RegistryService for RegistryGrpc {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        observed("register", self.register_request(request).await)
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let caller = Caller::of(request.extensions());
        observed(
            "heartbeat",
            self.heartbeat_request(&caller, request.into_inner()).await,
        )
    }

    async fn deregister(
        &self,
        request: Request<DeregisterRequest>,
    ) -> Result<Response<DeregisterResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let request = request.into_inner();
        check_ids(&request.instance_id, &request.lease_id)?;
        let result = match self
            .check_owner(
                &caller,
                "deregister",
                &request.instance_id,
                &request.lease_id,
            )
            .await
        {
            Ok(()) => self
                .backend
                .deregister(&request.instance_id, &request.lease_id)
                .await
                .map_err(Status::from)
                .map(|()| DeregisterResponse {}),
            Err(denied) => Err(denied),
        };
        observed("deregister", result)
    }

    async fn list_instances(
        &self,
        request: Request<ListInstancesRequest>,
    ) -> Result<Response<ListInstancesResponse>, Status> {
        let caller = Caller::of(request.extensions());
        self.trust
            .check_watcher(&caller, "list")
            .map_err(|denied| denied.to_status())?;
        let request = request.into_inner();
        let mut list = self
            .backend
            .view()
            .list(&request.service, &request.capability);
        list.instances.iter_mut().for_each(redact);
        Ok(Response::new(list))
    }

    async fn list_capabilities(
        &self,
        request: Request<ListCapabilitiesRequest>,
    ) -> Result<Response<ListCapabilitiesResponse>, Status> {
        let request = request.into_inner();
        if request.name_prefix.len() > MAX_NAME_PREFIX_BYTES {
            return observed(
                "list_capabilities",
                Err(Status::invalid_argument(format!(
                    "name_prefix is {} bytes, over the limit of {MAX_NAME_PREFIX_BYTES} bytes; capability names are short dotted identifiers",
                    request.name_prefix.len()
                ))),
            );
        }
        if request.page_token.len() > MAX_PAGE_TOKEN_BYTES {
            return observed(
                "list_capabilities",
                Err(Status::invalid_argument(format!(
                    "page_token is {} bytes, over the limit of {MAX_PAGE_TOKEN_BYTES} bytes; send back the next_page_token of the previous page unchanged",
                    request.page_token.len()
                ))),
            );
        }
        let page_size = match usize::try_from(request.page_size).unwrap_or(usize::MAX) {
            0 => DEFAULT_PAGE_SIZE,
            size => size.min(MAX_PAGE_SIZE),
        };
        // The token is the last name of the previous page: names sort after it.
        observed(
            "list_capabilities",
            Ok(self.backend.view().list_capabilities_page(
                &request.name_prefix,
                &request.page_token,
                page_size,
            )),
        )
    }

    type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchResponse, Status>> + Send>>;

    async fn watch(
        &self,
        request: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let caller = Caller::of(request.extensions());
        self.trust
            .check_watcher(&caller, "watch")
            .map_err(|denied| denied.to_status())?;
        let request = request.into_inner();
        if request.epoch.len() > MAX_EPOCH_BYTES {
            return Err(Status::invalid_argument(format!(
                "epoch is {} bytes, over the limit of {MAX_EPOCH_BYTES} bytes; send back the epoch of the watch events you read, unchanged",
                request.epoch.len()
            )));
        }
        let from = if request.after_revision == 0 {
            WatchFrom::Snapshot
        } else {
            WatchFrom::Resume {
                epoch: &request.epoch,
                after_revision: request.after_revision,
            }
        };
        let watcher = if !self.trust.is_enabled() {
            Watcher::Anyone
        } else if self.trust.is_router(&caller) {
            Watcher::Router
        } else {
            Watcher::Other(caller.name())
        };
        let slot = self.watches.acquire(watcher)?;
        if let WatchFrom::Resume {
            epoch,
            after_revision,
        } = from
            && self.backend.is_shared()
            && epoch == self.backend.view().epoch()
            && after_revision > self.backend.view().revision()
        {
            // A watcher that read another replica of the same store further than this one's
            // mirror has got: wait (briefly) for it to catch up rather than send it a snapshot
            // older than what it has.
            self.backend
                .view()
                .applied(after_revision, RESUME_CATCH_UP)
                .await;
        }
        let (first, mut events) = self.backend.view().watch_from(from);
        // Events are copied (redacted) as the watcher takes them: one that reads slowly holds
        // at most this many copies, the shared history and buffer hold the rest.
        let (tx, rx) = mpsc::channel(WATCH_SEND_BUFFER);
        let registry = self.backend.view().clone();
        tokio::spawn(async move {
            let _slot = slot;
            for event in first {
                if !send_event(&tx, &event).await {
                    return;
                }
            }
            loop {
                // A watcher that went away frees its slot at once, not at the next change.
                let received = tokio::select! {
                    () = registry.watches_closed() => return,
                    () = tx.closed() => return,
                    received = events.recv() => received,
                };
                let sent = match received {
                    Ok(event) => vec![event],
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        // The watcher fell behind the buffer: start it over from a snapshot.
                        warn!(missed, "watcher lagged; resending a snapshot");
                        let (snapshot, fresh) = registry.watch_from(WatchFrom::Lagged);
                        events = fresh;
                        snapshot
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                for event in sent {
                    if !send_event(&tx, &event).await {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
