//! Reply: asynchronous replies. A Call whose message names `reply_to` waits (on the
//! replica that took it) for a Reply correlated to its message id; a Reply arriving at another
//! replica is forwarded once to the replica its `reply_to` names.
//!
//! With trust on, a reply is taken only from the agents the call was handed to: the replica
//! holding the call records, before each delivery attempt, the service of the instance it
//! dials (whose identity the connection requires: `spiffe://<td>/agent/<service>`), and takes
//! a reply only from one of those identities. A replica forwarding a reply presents the router
//! identity and names the agent that sent it in [`REPLIER_METADATA`]; forwarded replies are
//! taken only from router identities. Everyone else is refused `PERMISSION_DENIED` /
//! `NOT_AUTHORIZED` with the same answer whether a call with that id is in flight or not, so a
//! refusal reveals nothing about other callers' calls.
//!
//! A reply is forwarded only to a known router replica ([`Router::check_reply_peer`]): with
//! `router.peers` set, one listed there; otherwise, with trust on, one that proves the router
//! identity in the TLS handshake (nothing is sent to anything else); with trust off, any
//! `http(s)://host:port`. Clients of replicas are kept in a bounded cache
//! ([`MAX_REPLY_PEERS`], idle ones dropped after [`REPLY_PEER_IDLE`]) and only once a forward
//! to them succeeded, so `reply_to` values that lead nowhere cost nothing kept.

use std::sync::Arc;
use std::time::Duration;

use moka::sync::Cache;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{ReachMessage, ReplyRequest, ReplyResponse};
use reach_trust::{Caller, Denied, Identity};
use tokio::sync::oneshot;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tracing::warn;

use super::{FORWARDED_REPLY_METADATA, REPLIER_METADATA, Router};
use crate::config::is_reply_peer_url;
use crate::error::RouteError;

/// The most router replicas whose clients are kept for forwarding replies.
pub const MAX_REPLY_PEERS: u64 = 256;
/// How long a router replica's client is kept unused.
pub const REPLY_PEER_IDLE: Duration = Duration::from_secs(600);
/// The most ended asynchronous calls remembered (so that their agents' late replies are
/// answered `delivered: false` rather than refused).
pub const MAX_ENDED_REPLIES: u64 = 65_536;
/// The longest a forwarded reply may take to be answered by the replica holding the call.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an ended asynchronous call is remembered.
const ENDED_REPLY_TTL: Duration = Duration::from_secs(600);

/// The cache of router replica clients ([`MAX_REPLY_PEERS`], [`REPLY_PEER_IDLE`]).
pub(super) fn peer_cache() -> Cache<String, RouterServiceClient<Channel>> {
    Cache::builder()
        .max_capacity(MAX_REPLY_PEERS)
        .time_to_idle(REPLY_PEER_IDLE)
        .build()
}

/// The cache of recently ended asynchronous calls ([`MAX_ENDED_REPLIES`]).
pub(super) fn ended_replies_cache() -> Cache<String, Arc<[String]>> {
    Cache::builder()
        .max_capacity(MAX_ENDED_REPLIES)
        .time_to_live(ENDED_REPLY_TTL)
        .build()
}

/// A call waiting for an asynchronous reply.
pub(super) struct WaitingReply {
    /// Completes the call.
    sender: oneshot::Sender<ReachMessage>,
    /// The services of the instances the message was handed to (before each attempt): with
    /// trust on, only their agent identities may reply.
    repliers: Vec<String>,
}

impl WaitingReply {
    /// A call waiting on `sender`, handed to no instance yet.
    pub(super) fn new(sender: oneshot::Sender<ReachMessage>) -> Self {
        Self {
            sender,
            repliers: Vec::new(),
        }
    }
}

/// Who sent a reply, as far as the trust layer knows.
enum Replier {
    /// Trust is off: anyone may reply.
    Anyone,
    /// The agent identity that sent it (the caller, or the one a forwarding router named).
    Agent(Identity),
}

impl Router {
    /// `RouterService.Reply`: completes the call waiting for this asynchronous reply (by its
    /// `correlation_id`) on this replica, or forwards the reply to the replica `reply_to`
    /// names.
    pub(super) async fn serve_reply(
        &self,
        request: Request<ReplyRequest>,
    ) -> Result<Response<ReplyResponse>, Status> {
        let (metadata, extensions, body) = request.into_parts();
        let forwarded = metadata.contains_key(FORWARDED_REPLY_METADATA);
        let caller = Caller::of(&extensions);
        let message = body.message.ok_or(RouteError::MissingMessage)?;
        let correlation = message
            .header
            .as_ref()
            .map(|h| h.correlation_id.clone())
            .unwrap_or_default();
        // Who may reply at all is settled before anything else is looked at or dialed.
        let replier = self.replier(&caller, forwarded, &metadata, &correlation)?;
        self.rules().check_bounds(&message)?;
        if correlation.is_empty() {
            return Err(Status::invalid_argument(
                "a reply needs header.correlation_id set to the request's message_id",
            ));
        }
        let own = &self.config().advertise_endpoint;
        if forwarded || body.reply_to.is_empty() || body.reply_to == *own {
            let delivered = self.complete_reply(&caller, &replier, &correlation, message)?;
            return Ok(Response::new(ReplyResponse { delivered }));
        }
        // The waiting call is held by another replica: hand the reply to it.
        self.check_reply_peer(&caller, &body.reply_to)?;
        let mut forward = Request::new(ReplyRequest {
            message: Some(message),
            reply_to: body.reply_to.clone(),
        });
        forward
            .metadata_mut()
            .insert(FORWARDED_REPLY_METADATA, MetadataValue::from_static("1"));
        forward.set_timeout(FORWARD_TIMEOUT);
        if let Replier::Agent(identity) = &replier
            && let Ok(value) = MetadataValue::try_from(identity.as_str())
        {
            forward.metadata_mut().insert(REPLIER_METADATA, value);
        }
        let (mut peer, cached) = match self.inner.peers.get(&body.reply_to) {
            Some(client) => (client, true),
            None => (self.peer_client(&body.reply_to)?, false),
        };
        match peer.reply(forward).await {
            Ok(response) => {
                if !cached {
                    self.inner.peers.insert(body.reply_to.clone(), peer);
                }
                Ok(response)
            }
            // The replica answered (a refusal, or no call waiting): its answer stands.
            Err(status) if std::error::Error::source(&status).is_none() => Err(status),
            // It could not be reached, or did not prove the router identity. Which of those
            // is logged, not answered, so reply_to cannot be used to probe the network.
            Err(status) => {
                if cached {
                    self.inner.peers.invalidate(&body.reply_to);
                }
                warn!(reply_to = %body.reply_to, code = ?status.code(), error = %status.message(), "could not forward an asynchronous reply to its router replica");
                Err(reach_rpc::errors::status_with_reason(
                    tonic::Code::Unavailable,
                    format!(
                        "could not forward the reply to the router replica reply_to names ({}): it did not answer as a router replica of this mesh; the waiting call may have ended with its replica",
                        body.reply_to
                    ),
                    reach_rpc::errors::reason::REPLY_PEER_UNAVAILABLE,
                    [("reply_to".to_string(), body.reply_to.clone())],
                ))
            }
        }
    }

    /// Who sent this reply, or why they may not reply. With trust off, anyone. With trust on:
    /// a reply sent directly must come from an agent identity (its service is checked against
    /// the call when it is found); a forwarded one from a router identity (this replica's own
    /// identity counts, for a process serving several roles), naming the agent in
    /// [`REPLIER_METADATA`].
    fn replier(
        &self,
        caller: &Caller,
        forwarded: bool,
        metadata: &MetadataMap,
        correlation: &str,
    ) -> Result<Replier, Status> {
        let trust = self.table().trust();
        if !trust.is_enabled() {
            return Ok(Replier::Anyone);
        }
        if forwarded {
            if !self.is_router(caller) {
                return Err(self.refuse(Denied {
                    identity: caller.name().to_string(),
                    action: "forward a reply".into(),
                    target: format!("message {correlation:?}"),
                    reason: format!(
                        "only router replicas (spiffe://{}/router) forward replies; an agent sends its reply without {FORWARDED_REPLY_METADATA}",
                        trust.trust_domain()
                    ),
                }));
            }
            let named = metadata
                .get(REPLIER_METADATA)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| Identity::parse(v).ok())
                .filter(|id| id.agent_service().is_some());
            return match named {
                Some(identity) => Ok(Replier::Agent(identity)),
                None => Err(Status::invalid_argument(format!(
                    "a forwarded reply must name the agent that sent it in {REPLIER_METADATA} (a spiffe://…/agent/<service> ID); upgrade the forwarding router"
                ))),
            };
        }
        match caller.identity() {
            Some(identity) if identity.agent_service().is_some() => {
                Ok(Replier::Agent(identity.clone()))
            }
            _ => Err(self.refuse(not_the_replier(caller, correlation, trust.trust_domain()))),
        }
    }

    /// Whether `caller` is a router replica: the router identity, or this process's own.
    fn is_router(&self, caller: &Caller) -> bool {
        let trust = self.table().trust();
        let Some(identity) = caller.identity() else {
            return false;
        };
        Identity::service(trust.trust_domain(), "router").is_ok_and(|router| router == *identity)
            || trust
                .tls()
                .and_then(|tls| tls.identity())
                .is_some_and(|own| own == *identity)
    }

    /// Records and audits a refusal.
    fn refuse(&self, denied: Denied) -> Status {
        denied.audit();
        denied.to_status()
    }

    /// Refuses a `reply_to` that names no known router replica, before anything is dialed:
    /// one not shaped like a router URL, or, with `router.peers` set, one not listed there.
    /// Without `router.peers` and with trust on, the replica must prove the router identity
    /// when it is dialed ([`Router::peer_client`]).
    fn check_reply_peer(&self, caller: &Caller, reply_to: &str) -> Result<(), Status> {
        let peers = &self.config().peers;
        let known = is_reply_peer_url(reply_to)
            && (peers.is_empty() || peers.iter().any(|p| p == reply_to));
        if known {
            return Ok(());
        }
        let shown: String = reply_to.chars().take(128).collect();
        let reason = if peers.is_empty() {
            "reply_to must be the router URL (scheme, host and port) the request carried in header.reply_to; copy it unchanged"
        } else {
            "it is not one of this router's replicas (router.peers); copy the request's header.reply_to unchanged"
        };
        Err(self.refuse(Denied {
            identity: caller.name().to_string(),
            action: "forward a reply to".into(),
            target: format!("reply_to {shown:?}"),
            reason: reason.into(),
        }))
    }

    /// Completes a waiting asynchronous call; returns whether one was waiting. With trust on,
    /// only for an agent identity the call was handed to: anyone else is refused, whether or
    /// not the call exists.
    fn complete_reply(
        &self,
        caller: &Caller,
        replier: &Replier,
        correlation: &str,
        reply: ReachMessage,
    ) -> Result<bool, Status> {
        let trust = self.table().trust();
        let may_reply = |repliers: &[String]| match replier {
            Replier::Anyone => true,
            Replier::Agent(identity) => identity
                .agent_service()
                .is_some_and(|service| repliers.iter().any(|r| r == service)),
        };
        let waiter = {
            let mut waiting = self
                .inner
                .waiting_replies
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            match waiting.get(correlation) {
                Some(w) if may_reply(&w.repliers) => waiting.remove(correlation),
                _ => None,
            }
        };
        if let Some(waiter) = waiter {
            self.inner
                .ended_replies
                .insert(correlation.to_string(), waiter.repliers.into());
            return Ok(waiter.sender.send(reply).is_ok());
        }
        // Nothing this replier may complete: its own call that ended (timed out, answered
        // already) is `delivered: false`; anything else is refused alike.
        let ended = self.inner.ended_replies.get(correlation);
        match replier {
            Replier::Anyone => Ok(false),
            Replier::Agent(_) if ended.is_some_and(|r| may_reply(&r)) => Ok(false),
            Replier::Agent(identity) => {
                let mut denied = not_the_replier(caller, correlation, trust.trust_domain());
                denied.identity = identity.to_string();
                Err(self.refuse(denied))
            }
        }
    }

    /// Allows the agent identity of `service` to reply to the waiting call `message_id`: called
    /// before the message is handed to an instance of `service`.
    pub(super) fn allow_replier(&self, message_id: &str, service: &str) {
        let mut waiting = self
            .inner
            .waiting_replies
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(w) = waiting.get_mut(message_id)
            && !w.repliers.iter().any(|r| r == service)
        {
            w.repliers.push(service.to_string());
        }
    }

    /// A client of the router replica at `endpoint` (not cached: see [`Router::serve_reply`]).
    /// With trust on, the connection requires the router identity of the replica.
    fn peer_client(&self, endpoint: &str) -> Result<RouterServiceClient<Channel>, Status> {
        let channel = reach_rpc::http2::endpoint(endpoint)
            .map_err(|e| {
                Status::invalid_argument(format!("reply_to {endpoint:?} is not a router URL: {e}"))
            })?
            .connect_timeout(self.config().connect_timeout);
        let trust = self.table().trust();
        let expected = trust
            .tls()
            .and_then(|tls| Identity::service(tls.trust_domain(), "router").ok());
        let channel = reach_rpc::http2::channel_lazy(&channel, trust.tls(), expected);
        Ok(RouterServiceClient::new(channel)
            .max_decoding_message_size(self.config().decoding_limit())
            .max_encoding_message_size(self.config().decoding_limit()))
    }

    /// How many router replica clients are kept for forwarding replies (at most
    /// [`MAX_REPLY_PEERS`]): those a reply was forwarded to successfully and used within
    /// [`REPLY_PEER_IDLE`].
    pub fn reply_peers_cached(&self) -> u64 {
        self.inner.peers.run_pending_tasks();
        self.inner.peers.entry_count()
    }
}

/// The refusal of a reply by someone the call was not handed to, or for a call this replica
/// does not hold: the same either way.
fn not_the_replier(caller: &Caller, correlation: &str, trust_domain: &str) -> Denied {
    let shown: String = correlation.chars().take(128).collect();
    Denied {
        identity: caller.name().to_string(),
        action: "reply to".into(),
        target: format!("message {shown:?}"),
        reason: format!(
            "only the agent the message was delivered to (spiffe://{trust_domain}/agent/<service>) may reply to it, while its caller waits"
        ),
    }
}

/// Removes a waiting-reply entry when the waiting call ends (answered, timed out, cancelled),
/// remembering who could have replied ([`MAX_ENDED_REPLIES`]).
pub(super) struct ReplyWaiter<'a> {
    router: &'a Router,
    message_id: String,
}

impl<'a> ReplyWaiter<'a> {
    /// Removes the entry of the call waiting for a reply to `message_id` when dropped.
    pub(super) fn new(router: &'a Router, message_id: String) -> Self {
        Self { router, message_id }
    }
}

impl Drop for ReplyWaiter<'_> {
    fn drop(&mut self) {
        let removed = self
            .router
            .inner
            .waiting_replies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.message_id);
        if let Some(waiting) = removed
            && !waiting.repliers.is_empty()
        {
            self.router.inner.ended_replies.insert(
                std::mem::take(&mut self.message_id),
                waiting.repliers.into(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_peer_cache_keeps_at_most_its_bound() {
        let cache = peer_cache();
        let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        for i in 0..(MAX_REPLY_PEERS * 4) {
            cache.insert(
                format!("http://10.0.{}.{}:7070", i / 250, i % 250),
                RouterServiceClient::new(channel.clone()),
            );
            cache.run_pending_tasks();
            assert!(
                cache.entry_count() <= MAX_REPLY_PEERS,
                "{}",
                cache.entry_count()
            );
        }
        assert!(cache.entry_count() > 0);
    }
}
