//! The router call of a task node or parallel branch: one `RouterService.Call` per attempt,
//! bounded by the attempt's deadline, traced under the task's trace.

use std::collections::HashMap;
use std::time::Duration;

use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{CallRequest, Header, Part, Payload, ReachMessage, header, part};
use reach_rpc::usage::TokenUsage;
use reach_telemetry::grpc::GrpcClientTrace;
use serde_json::Value;
use tonic::Code;
use tonic::transport::Channel;

use crate::failure::NodeError;

use super::clock::Clock;
use super::step::{CallResult, CallSpec, Delivery};

/// The router client the engine calls through.
pub(super) type Router = RouterServiceClient<GrpcClientTrace<Channel>>;

/// What a call needs besides its [`CallSpec`]: the task it belongs to.
pub(super) struct CallContext {
    /// The task id (`header.task_id`).
    pub(super) task_id: String,
    /// The task's trace id (`header.trace_id`).
    pub(super) trace_id: String,
    /// The flow (`metadata.flow_id`).
    pub(super) flow_id: String,
    /// `header.source`.
    pub(super) source: String,
    /// The timeout of an attempt without a deadline.
    pub(super) default_timeout: Duration,
}

/// Makes one call through the router: the reply's first data part (else its first text
/// part, else null), or the failure with the status's code. An attempt past its deadline is
/// DEADLINE_EXCEEDED, whether the local timeout or tonic's grpc-timeout noticed first.
pub(super) async fn call(
    mut router: Router,
    clock: Clock,
    cx: CallContext,
    spec: CallSpec,
) -> CallResult {
    let CallContext {
        task_id,
        trace_id,
        flow_id,
        source,
        default_timeout,
    } = cx;
    let now = clock.now_ms();
    let timeout = match spec.deadline_ms {
        Some(d) => Duration::from_millis(u64::try_from((d - now).max(1)).unwrap_or(1)),
        None => default_timeout,
    };
    let slot_node = spec
        .slot
        .split('/')
        .next()
        .unwrap_or(&spec.slot)
        .to_string();
    let mut metadata = HashMap::new();
    metadata.insert("flow_id".to_string(), flow_id);
    metadata.insert("node_id".to_string(), slot_node);
    metadata.insert("attempt".to_string(), spec.attempt.to_string());
    let message = ReachMessage {
        header: Some(Header {
            message_id: spec.message_id.clone(),
            trace_id: trace_id.clone(),
            task_id: task_id.clone(),
            source,
            target: Some(header::Target::Capability(spec.capability.clone())),
            created_at: Some(reach_rpc::time::now()),
            metadata,
            ..Default::default()
        }),
        payload: Some(Payload {
            r#type: spec.capability.clone(),
            parts: vec![Part {
                content: Some(part::Content::Data(crate::json::to_proto(&spec.input))),
                media_type: "application/json".into(),
                ..Default::default()
            }],
        }),
    };
    // The node's span is a child of the task's span (exported when the task ends, with the
    // id derived from the task id, so it is the same across restarts); the traced channel
    // sends its context as `traceparent`, so the router and the agents join the trace under it.
    let parent = reach_rpc::trace::TraceId::parse(&trace_id)
        .ok()
        .map(|id| reach_telemetry::remote_parent(id, task_span_id(&task_id)));
    let span = reach_telemetry::message_span_with_parent("orchestrator.node", &message, parent);
    let mut request = tonic::Request::new(CallRequest {
        message: Some(message),
    });
    request.set_timeout(timeout);
    let started = tokio::time::Instant::now();
    let deadline_exceeded = || {
        Err(NodeError::new(
            Code::DeadlineExceeded,
            format!("no reply within {}", humantime::format_duration(timeout)),
        ))
    };
    let sent = tracing::Instrument::instrument(router.call(request), span.clone());
    let mut delivery = Delivery::Maybe;
    let mut usage = TokenUsage::default();
    let result = match tokio::time::timeout(timeout, sent).await {
        Err(_) => deadline_exceeded(),
        // tonic enforces the grpc-timeout it sends too, answering CANCELLED: that is the
        // attempt's deadline passing, as the retry policy knows it.
        Ok(Err(status)) if status.code() == Code::Cancelled && started.elapsed() >= timeout => {
            deadline_exceeded()
        }
        Ok(Err(status)) => {
            delivery = delivery_of(&status);
            Err(NodeError::from(&status))
        }
        Ok(Ok(reply)) => {
            let message = reply.into_inner().message.unwrap_or_default();
            if let Some(reported) = message
                .header
                .as_ref()
                .and_then(|h| TokenUsage::read(&h.metadata))
            {
                usage = reported;
            }
            let parts = message.payload.map(|p| p.parts).unwrap_or_default();
            let data = parts.iter().find_map(|p| match &p.content {
                Some(part::Content::Data(v)) => Some(crate::json::from_proto(v)),
                _ => None,
            });
            let text = || {
                parts.iter().find_map(|p| match &p.content {
                    Some(part::Content::Text(t)) => Some(Value::String(t.clone())),
                    _ => None,
                })
            };
            Ok(data.or_else(text).unwrap_or(Value::Null))
        }
    };
    match &result {
        Ok(_) => reach_telemetry::record_status(&span, Code::Ok, ""),
        Err(error) => {
            span.record("otel.status_code", "error");
            span.record("otel.status_description", error.to_string().as_str());
        }
    }
    CallResult {
        slot: spec.slot,
        attempt: spec.attempt,
        result,
        delivery,
        usage,
    }
}

const TASK_SPAN_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x3b8e_52a1_9c4d_4e7f_a6b0_1d2e_8f90_c3a7);

/// The span id of task `task_id`'s span, the root of its trace: derived from the task id (the
/// first 8 bytes of a UUIDv5), so node spans made before and after a restart share it.
pub fn task_span_id(task_id: &str) -> [u8; 8] {
    let bytes = uuid::Uuid::new_v5(&TASK_SPAN_NAMESPACE, task_id.as_bytes()).into_bytes();
    let mut id = [0u8; 8];
    id.copy_from_slice(&bytes[..8]);
    if id == [0; 8] {
        id[7] = 1;
    }
    id
}

/// Whether a failed call provably reached no agent: the router answered that nothing
/// routable took it (ROUTE_NOT_FOUND, INSTANCE_UNAVAILABLE, OVERLOADED, INSTANCE_DRAINING),
/// or the router itself could not be connected to, or a closing connection to it never
/// carried the call. INSTANCE_LOST (the agent's connection broke mid-call) and every other
/// failure may have been handled: the attempt counts.
fn delivery_of(status: &tonic::Status) -> Delivery {
    use reach_rpc::errors::reason;
    if matches!(
        reach_rpc::errors::reason_of(status).as_deref(),
        Some(
            reason::ROUTE_NOT_FOUND
                | reason::INSTANCE_UNAVAILABLE
                | reason::OVERLOADED
                | reason::INSTANCE_DRAINING
        )
    ) {
        return Delivery::NotDelivered;
    }
    if reach_rpc::errors::is_connect_error(status) || reach_rpc::errors::is_unprocessed(status) {
        return Delivery::NotDelivered;
    }
    Delivery::Maybe
}

#[cfg(test)]
mod tests {
    use reach_rpc::errors::{reason, status_with_reason};
    use tonic::Code;

    use super::*;

    fn refused(reason: &str) -> tonic::Status {
        status_with_reason(Code::Unavailable, "refused", reason, [])
    }

    #[test]
    fn only_refusals_that_prove_nothing_was_delivered_spare_the_attempt() {
        for not_delivered in [
            reason::ROUTE_NOT_FOUND,
            reason::INSTANCE_UNAVAILABLE,
            reason::OVERLOADED,
            reason::INSTANCE_DRAINING,
        ] {
            assert_eq!(
                delivery_of(&refused(not_delivered)),
                Delivery::NotDelivered,
                "{not_delivered}"
            );
        }
        // The agent's host went away mid-call: it may have handled the message.
        assert_eq!(
            delivery_of(&refused(reason::INSTANCE_LOST)),
            Delivery::Maybe
        );
        assert_eq!(
            delivery_of(&tonic::Status::unavailable("connection reset")),
            Delivery::Maybe
        );
        assert_eq!(
            delivery_of(&tonic::Status::internal("handler failed")),
            Delivery::Maybe
        );
    }
}
