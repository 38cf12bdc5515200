//! Reply: asynchronous replies. A Call whose message names `reply_to` waits (on the
//! replica that took it) for a Reply correlated to its message id; a Reply arriving at another
//! replica is forwarded once to the replica its `reply_to` names.

use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{ReachMessage, ReplyRequest, ReplyResponse};
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tracing::warn;

use super::{FORWARDED_REPLY_METADATA, Router};
use crate::error::RouteError;

impl Router {
    /// `RouterService.Reply`: completes the call waiting for this asynchronous reply (by its
    /// `correlation_id`) on this replica, or forwards the reply to the replica `reply_to`
    /// names.
    pub(super) async fn serve_reply(
        &self,
        request: Request<ReplyRequest>,
    ) -> Result<Response<ReplyResponse>, Status> {
        let forwarded = request.metadata().contains_key(FORWARDED_REPLY_METADATA);
        let body = request.into_inner();
        let message = body.message.ok_or(RouteError::MissingMessage)?;
        self.rules().check_bounds(&message)?;
        if message
            .header
            .as_ref()
            .is_none_or(|h| h.correlation_id.is_empty())
        {
            return Err(Status::invalid_argument(
                "a reply needs header.correlation_id set to the request's message_id",
            ));
        }
        let own = &self.config().advertise_endpoint;
        if forwarded || body.reply_to.is_empty() || body.reply_to == *own {
            let delivered = self.complete_reply(message);
            return Ok(Response::new(ReplyResponse { delivered }));
        }
        // The waiting call is held by another replica: hand the reply to it.
        let mut peer = self.peer(&body.reply_to)?;
        let mut forward = Request::new(ReplyRequest {
            message: Some(message),
            reply_to: body.reply_to.clone(),
        });
        forward
            .metadata_mut()
            .insert(FORWARDED_REPLY_METADATA, MetadataValue::from_static("1"));
        match peer.reply(forward).await {
            Ok(response) => Ok(response),
            Err(status) => {
                warn!(reply_to = %body.reply_to, code = ?status.code(), "could not forward an asynchronous reply to its router replica");
                Err(status)
            }
        }
    }

    /// Completes a waiting asynchronous call; returns whether one was waiting.
    fn complete_reply(&self, reply: ReachMessage) -> bool {
        let correlation = reply
            .header
            .as_ref()
            .map(|h| h.correlation_id.clone())
            .unwrap_or_default();
        let waiter = self
            .inner
            .waiting_replies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&correlation);
        match waiter {
            Some(waiter) => waiter.send(reply).is_ok(),
            None => false,
        }
    }

    fn peer(&self, endpoint: &str) -> Result<RouterServiceClient<Channel>, Status> {
        let mut peers = self.inner.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(client) = peers.get(endpoint) {
            return Ok(client.clone());
        }
        let channel = reach_rpc::http2::endpoint(endpoint)
            .map_err(|e| {
                Status::invalid_argument(format!("reply_to {endpoint:?} is not a router URL: {e}"))
            })?
            .connect_timeout(self.config().connect_timeout);
        let channel = reach_rpc::http2::channel_lazy(&channel, self.table().trust().tls(), None);
        let client = RouterServiceClient::new(channel)
            .max_decoding_message_size(self.config().decoding_limit())
            .max_encoding_message_size(self.config().decoding_limit());
        peers.insert(endpoint.to_string(), client.clone());
        Ok(client)
    }
}

/// Removes a waiting-reply entry when the waiting call ends (answered, timed out, cancelled).
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
        self.router
            .inner
            .waiting_replies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.message_id);
    }
}
