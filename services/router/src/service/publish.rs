//! Publish: one message delivered to every subscriber of a topic at once, each delivery
//! bounded by the caller's deadline (or the message's TTL) and counted for the subscriber's
//! latency and outlier ejection.

use std::sync::Arc;

use futures::future::join_all;
use reach_proto::v1::{PublishFailure, PublishRequest, PublishResponse};
use reach_rpc::errors::code_name;
use tokio::time::Instant;
use tonic::{Code, Request, Response, Status};

use super::Router;
use crate::envelope::{self, TraceOrigin, forwarded_metadata, ids_of, read_deadline};
use crate::error::RouteError;
use crate::key::RouteKey;

impl Router {
    /// `RouterService.Publish`: the message, admitted once, delivered to every subscriber of
    /// its topic at once; the response counts deliveries and names each failure with its code
    /// name (`UNAVAILABLE`, ...).
    pub(super) async fn serve_publish(
        &self,
        request: Request<PublishRequest>,
    ) -> Result<Response<PublishResponse>, Status> {
        let started = Instant::now();
        let (mut metadata, extensions, body) = request.into_parts();
        let caller = reach_trust::Caller::of(&extensions);
        let caller_deadline = read_deadline(&metadata, started)?;
        let mut message = body.message.ok_or(RouteError::MissingMessage)?;
        let rules = self.rules();
        rules.admit(&mut message, TraceOrigin::Caller(&metadata))?;
        let deadline = rules.deadline(&message, caller_deadline)?;
        let topic = envelope::topic(&message)?;
        let key = RouteKey::Topic(topic);
        envelope::authorize(self.table().trust(), &caller, &key, &mut metadata)?;
        let (_, message_id) = ids_of(&message);
        let metadata = forwarded_metadata(metadata);
        let members = self
            .inner
            .table
            .route(&key)
            .map(|route| route.members.clone())
            .unwrap_or_else(|| Arc::from(Vec::new()));
        let sends = members.iter().map(|endpoint| {
            let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let endpoint = endpoint.clone();
            let (message, metadata) = (&message, &metadata);
            async move {
                let in_flight = endpoint.load_tracker().start();
                let call = endpoint.handle(message.clone(), metadata, timeout, Box::new(in_flight));
                let attempt = Instant::now();
                let result = match deadline {
                    Some(deadline) => match tokio::time::timeout_at(deadline, call).await {
                        Ok(result) => result.map(|_| ()),
                        Err(_) => Err(Status::deadline_exceeded(
                            "the deadline passed before the subscriber answered",
                        )),
                    },
                    None => call.await.map(|_| ()),
                };
                endpoint.record_latency(attempt.elapsed());
                match &result {
                    Ok(()) => endpoint.record_success(),
                    Err(status) if status.code() == Code::Unavailable => {
                        endpoint.record_failed(status);
                    }
                    Err(_) => endpoint.record_success(),
                }
                (endpoint.info().instance_id.clone(), result)
            }
        });
        let mut response = PublishResponse {
            message_id,
            ..PublishResponse::default()
        };
        for (instance_id, result) in join_all(sends).await {
            match result {
                Ok(()) => response.delivered += 1,
                Err(status) => {
                    response.failed += 1;
                    response.failures.push(PublishFailure {
                        instance_id,
                        code: code_name(status.code()).to_string(),
                        message: status.message().to_string(),
                    });
                }
            }
        }
        Ok(Response::new(response))
    }
}
