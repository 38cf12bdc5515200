//! One instance as the router sees it: a lazily connecting gRPC client to its
//! `reach.v1.AgentService`, its shared load signal, its concurrency limit, its registry state
//! and its outlier-ejection record.
//!
//! Calls go over the instance's multiplexed `HandleMux` stream (one per instance and router,
//! opened on first use, see [`reach_rpc::mux`]); an instance that does not serve it (an agent
//! written without the SDK) gets unary `Handle` calls instead.
//!
//! Ejection follows Envoy's outlier detection (`consecutive_gateway_failure`): after
//! `consecutive_failures` connect errors or UNAVAILABLE answers in a row the instance is
//! ejected for `base_ejection × 2^(ejections-1)` (capped); when the interval passes it gets
//! traffic again, and the first failure after a return ejects it again for twice as long,
//! while a success clears its record. An instance whose connection is refused (or cannot be
//! made: nothing was delivered) is ejected on that first failure
//! ([`InstanceEndpoint::record_unreachable`]), then probed back the same way.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use reach_proto::v1::agent_service_client::AgentServiceClient;
use reach_proto::v1::{HandleMuxResponse, HandleRequest, InstanceState, ReachMessage};
use reach_rpc::limits::MeteredChannel;
use reach_rpc::mux::{MuxError, MuxLink, OutgoingCall};
use reach_telemetry::grpc::GrpcClientTrace;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tonic::metadata::{KeyAndValueRef, MetadataMap};
use tonic::transport::Channel;
use tonic::{Request, Status};

use crate::load::{InFlight, LoadTracker, Room};
use crate::metrics::{self, InstanceMetrics};

/// When an instance is taken out of rotation after failures (the router's `ejection`
/// settings).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EjectionConfig {
    /// Consecutive failures (UNAVAILABLE answers, broken connections) that eject an instance;
    /// a refused connection ejects at once ([`InstanceEndpoint::record_unreachable`]). 0
    /// disables ejection. Default 5.
    pub consecutive_failures: u32,
    /// How long the first ejection lasts; each further ejection doubles it. Default 1 s.
    #[serde(with = "humantime_serde")]
    pub base_ejection: Duration,
    /// The longest ejection. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub max_ejection: Duration,
}

impl Default for EjectionConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(1),
            max_ejection: Duration::from_secs(30),
        }
    }
}

/// What the router knows about an instance besides its connection.
#[derive(Debug)]
pub struct InstanceInfo {
    /// The instance id.
    pub instance_id: String,
    /// The service the instance belongs to.
    pub service: String,
    /// The endpoint URL.
    pub endpoint: String,
    /// The relative weight for weighted balancing (at least 1).
    pub weight: u32,
    /// How many calls this router sends it at once; 0 means unlimited.
    pub max_concurrency: u32,
    /// The protocol version it speaks.
    pub protocol_version: String,
}

/// A connection to one instance plus its shared load, state and health.
#[derive(Debug)]
pub struct InstanceEndpoint {
    /// Unary and streaming calls; replies count against the router's reply budget.
    client: AgentServiceClient<GrpcClientTrace<MeteredChannel>>,
    /// The same transport for calls with a codec of the router's own (routed streams, see
    /// [`crate::pump::StreamCodec`]).
    grpc: tonic::client::Grpc<GrpcClientTrace<MeteredChannel>>,
    /// The raw channel, for typed pass-through (which forwards bytes without holding them).
    channel: Channel,
    /// The multiplexed `HandleMux` stream to the instance.
    link: MuxLink<HandleMuxResponse>,
    info: Arc<InstanceInfo>,
    load: Arc<LoadTracker>,
    room: Arc<Room>,
    /// The registry's state for it (READY or BUSY), updated by watch events.
    state: AtomicI32,
    /// Failures in a row (connect errors and UNAVAILABLE).
    consecutive_failures: AtomicU32,
    /// How many times it was ejected since it last succeeded.
    ejections: AtomicU32,
    /// Until when it is ejected, in ns since `epoch`; 0 when it is not.
    ejected_until_ns: AtomicU64,
    epoch: Instant,
    ejection: EjectionConfig,
    /// Its latency histogram (`reach_router_instance_duration_seconds`).
    metrics: InstanceMetrics,
}

impl InstanceEndpoint {
    /// An endpoint over a (lazily connecting) channel whose replies count against a reply
    /// budget (except typed pass-through's, which are forwarded as they arrive).
    pub fn new(
        metered: MeteredChannel,
        info: InstanceInfo,
        state: InstanceState,
        load: Arc<LoadTracker>,
        room: Arc<Room>,
        ejection: EjectionConfig,
        max_message_bytes: usize,
    ) -> Self {
        let channel = metered.unmetered().clone();
        let client = AgentServiceClient::new(reach_telemetry::traced_channel(metered.clone()))
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes);
        let grpc = tonic::client::Grpc::new(reach_telemetry::traced_channel(metered.clone()))
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes);
        let link = MuxLink::to_agent(
            format!("instance {} ({})", info.instance_id, info.endpoint),
            metered,
            max_message_bytes,
        );
        let metrics = InstanceMetrics::new(&info.service, &info.instance_id);
        Self {
            client,
            grpc,
            channel,
            link,
            metrics,
            info: Arc::new(info),
            load,
            room,
            state: AtomicI32::new(state as i32),
            consecutive_failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected_until_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            ejection,
        }
    }

    /// The instance's identity.
    pub fn info(&self) -> &Arc<InstanceInfo> {
        &self.info
    }

    /// Records the latency of one attempt to the instance (a call, or a delivery to it as a
    /// subscriber), whatever its outcome.
    pub fn record_latency(&self, elapsed: Duration) {
        self.metrics.latency(elapsed);
    }

    /// The instance's load tracker.
    pub fn load_tracker(&self) -> &Arc<LoadTracker> {
        &self.load
    }

    /// A client of the instance's AgentService (cheap clone of a shared connection).
    pub fn client(&self) -> AgentServiceClient<GrpcClientTrace<MeteredChannel>> {
        self.client.clone()
    }

    /// The instance's transport for calls with a codec of the caller's choosing (cheap clone
    /// of a shared connection).
    pub fn grpc(&self) -> tonic::client::Grpc<GrpcClientTrace<MeteredChannel>> {
        self.grpc.clone()
    }

    /// Delivers one message and returns the instance's reply: over the multiplexed stream, or
    /// as a unary `Handle` when the instance does not serve it. `metadata` is the caller's
    /// (forwarded without `grpc-timeout`); `timeout` is the time the instance has. The span
    /// context of the current span travels as `traceparent`.
    ///
    ///
    /// `hold` (the call's slot on the instance, [`Reservation`] or [`InFlight`]) is kept until
    /// the call has ended at the instance, not merely until this future ends: over the
    /// multiplexed stream, a call dropped before its reply (its caller gave up) keeps its hold
    /// until the instance acknowledges the cancel (see [`reach_rpc::mux`]), so the instance's
    /// concurrency limit holds while its handler still runs. A unary `Handle` is reset when
    /// dropped, which ends it at the instance at once.
    ///
    /// # Errors
    /// The instance's status; a transport status (with its source) when nothing could be
    /// sent; UNAVAILABLE with reason `INSTANCE_LOST` when the connection broke while the
    /// call was in flight (the instance may have handled it).
    pub async fn handle(
        &self,
        message: ReachMessage,
        metadata: &MetadataMap,
        timeout: Option<Duration>,
        hold: reach_rpc::mux::Hold,
    ) -> Result<ReachMessage, Status> {
        if !self.link.is_unsupported() {
            let mut call_metadata = HashMap::new();
            for entry in metadata.iter() {
                if let KeyAndValueRef::Ascii(key, value) = entry
                    && let Ok(value) = value.to_str()
                    && forwards(key.as_str())
                {
                    call_metadata.insert(key.as_str().to_string(), value.to_string());
                }
            }
            reach_telemetry::inject_span_map(&tracing::Span::current(), &mut call_metadata);
            let call = OutgoingCall {
                message,
                timeout,
                metadata: call_metadata,
                hold: Some(hold),
            };
            match self.link.call(call).await {
                Ok(reply) => return reach_rpc::mux::outcome_of(reply.frame),
                // Not served: the call comes back and goes as a unary Handle.
                Err(MuxError::Unsupported(call)) => {
                    let OutgoingCall { message, hold, .. } = *call;
                    let _hold = hold;
                    return Box::pin(self.handle_unary(message, metadata, timeout)).await;
                }
                Err(MuxError::Failed(status)) => return Err(status),
                Err(MuxError::Lost(status)) => {
                    return Err(lost_instance(&self.info.instance_id, status.message()));
                }
            }
        }
        // Boxed: a unary call's future is several KiB, and every routed call's task would
        // otherwise carry (and copy on spawn) room for it.
        let _hold = hold;
        Box::pin(self.handle_unary(message, metadata, timeout)).await
    }

    async fn handle_unary(
        &self,
        message: ReachMessage,
        metadata: &MetadataMap,
        timeout: Option<Duration>,
    ) -> Result<ReachMessage, Status> {
        let mut forward = Request::new(HandleRequest {
            message: Some(message),
        });
        *forward.metadata_mut() = metadata.clone();
        if let Some(timeout) = timeout {
            forward.set_timeout(timeout);
        }
        let mut client = self.client();
        client
            .handle(forward)
            .await
            .map(|response| response.into_inner().message.unwrap_or_default())
            .map_err(|status| {
                if reach_rpc::errors::is_missing_status(&status) {
                    missing_status(&self.info.instance_id)
                } else {
                    status
                }
            })
    }

    /// The multiplexed `HandleMux` link to the instance.
    pub fn link(&self) -> &MuxLink<HandleMuxResponse> {
        &self.link
    }

    /// The raw channel, for typed pass-through of other gRPC services.
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// The registry's state for the instance.
    pub fn state(&self) -> InstanceState {
        InstanceState::try_from(self.state.load(Ordering::Relaxed))
            .unwrap_or(InstanceState::Unspecified)
    }

    pub(crate) fn set_state(&self, state: InstanceState) {
        self.state.store(state as i32, Ordering::Relaxed);
    }

    /// Whether the router may send it one more call now (below its concurrency limit).
    pub fn has_room(&self) -> bool {
        let limit = self.info.max_concurrency as usize;
        limit == 0 || self.load.pending() < limit
    }

    /// Counts a call in flight if the instance has room; `None` when it is at its limit.
    pub fn try_reserve(self: &Arc<Self>) -> Option<Reservation> {
        let limit = self.info.max_concurrency as usize;
        self.load
            .try_start(limit, self.room.clone())
            .map(|in_flight| Reservation {
                endpoint: self.clone(),
                in_flight,
            })
    }

    /// Whether the instance is ejected at `now`.
    pub fn is_ejected(&self, now: Instant) -> bool {
        let until = self.ejected_until_ns.load(Ordering::Relaxed);
        until != 0 && self.nanos(now) < until
    }

    /// How many times the instance was ejected since it last succeeded.
    pub fn ejections(&self) -> u32 {
        self.ejections.load(Ordering::Relaxed)
    }

    fn nanos(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Records an answer that shows the instance is alive (any status but UNAVAILABLE).
    pub fn record_success(&self) {
        if self.consecutive_failures.load(Ordering::Relaxed) != 0 {
            self.consecutive_failures.store(0, Ordering::Relaxed);
        }
        if self.ejections.load(Ordering::Relaxed) != 0 {
            self.ejections.store(0, Ordering::Relaxed);
            self.ejected_until_ns.store(0, Ordering::Relaxed);
            tracing::info!(instance = %self.info.instance_id, "instance recovered");
        }
    }

    /// Records a connect error or UNAVAILABLE answer; returns whether this ejected it.
    pub fn record_failure(&self) -> bool {
        let threshold = self.ejection.consecutive_failures;
        if threshold == 0 {
            return false;
        }
        let failures = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        let now = Instant::now();
        if self.is_ejected(now) {
            return false;
        }
        // On probation after an ejection, one failure is enough.
        let on_probation = self.ejections.load(Ordering::Relaxed) > 0;
        if failures < threshold && !on_probation {
            return false;
        }
        self.eject(now, "consecutive failures");
        true
    }

    /// Records that the instance could not be reached at all (its connection was refused or
    /// could not be made, so nothing was delivered): ejected at once, without waiting for
    /// `consecutive_failures` (a refused connection is no passing blip: the next call would
    /// be refused too). It is probed back as any ejected instance, after the interval, and
    /// ejected again for twice as long if still unreachable. Returns whether this ejected it
    /// (not when it already was, or ejection is disabled).
    pub fn record_unreachable(&self) -> bool {
        if self.ejection.consecutive_failures == 0 {
            return false;
        }
        self.consecutive_failures.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        if self.is_ejected(now) {
            return false;
        }
        self.eject(now, "unreachable");
        true
    }

    /// Records a failed call's `status` that counts against the instance (UNAVAILABLE, or a
    /// transport error): [`InstanceEndpoint::record_unreachable`] when the connection could
    /// not be made ([`crate::retry::is_connect_error`]), else
    /// [`InstanceEndpoint::record_failure`]. Returns whether this ejected it.
    pub fn record_failed(&self, status: &Status) -> bool {
        if std::error::Error::source(status).is_some() && crate::retry::is_connect_error(status) {
            self.record_unreachable()
        } else {
            self.record_failure()
        }
    }

    /// Ejects the instance from `now` for the interval its ejection count calls for
    /// (`base_ejection × 2^(ejections-1)`, capped), logging `why` as the cause.
    fn eject(&self, now: Instant, why: &'static str) {
        let ejections = self.ejections.fetch_add(1, Ordering::Relaxed) + 1;
        let interval = reach_rpc::backoff::Exponential::doubling(
            self.ejection.base_ejection,
            self.ejection.max_ejection,
        )
        .delay(ejections);
        let until = self.nanos(now + interval);
        self.ejected_until_ns.store(until, Ordering::Relaxed);
        self.consecutive_failures.store(0, Ordering::Relaxed);
        tracing::warn!(instance = %self.info.instance_id, ejections, interval = ?interval, cause = why, "instance ejected");
        metrics::ejection(&self.info.service, &self.info.instance_id);
    }

    /// How long until the ejection ends (zero when not ejected).
    pub fn ejected_for(&self, now: Instant) -> Duration {
        let until = self.ejected_until_ns.load(Ordering::Relaxed);
        Duration::from_nanos(until.saturating_sub(self.nanos(now)))
    }
}

/// A slot reserved on one instance for one call or stream: the instance and the in-flight
/// guard counting the call against its concurrency limit until this drops.
#[derive(Debug)]
pub struct Reservation {
    endpoint: Arc<InstanceEndpoint>,
    in_flight: InFlight,
}

impl Reservation {
    /// The instance the slot is on.
    pub fn endpoint(&self) -> &Arc<InstanceEndpoint> {
        &self.endpoint
    }

    /// Marks the reservation as a stream's (see [`InFlight::for_stream`]).
    pub fn for_stream(self) -> Self {
        Self {
            endpoint: self.endpoint,
            in_flight: self.in_flight.for_stream(),
        }
    }
}

/// Whether a caller's metadata key travels with a multiplexed call: application keys, W3C
/// baggage and trace context, not gRPC's own or HTTP/2's. The caller's `traceparent` is
/// replaced by the router's span when the router records spans, and passes through
/// unchanged when it does not.
fn forwards(key: &str) -> bool {
    !(key.starts_with("grpc-") || matches!(key, "te" | "content-type" | "user-agent"))
}

/// The status of a call that never reached its instance (the connection was refused or could
/// not be made): UNAVAILABLE with reason `INSTANCE_UNAVAILABLE` naming the instance, saying
/// the message was not delivered.
pub fn unreachable_instance(instance_id: &str, detail: &str) -> Status {
    instance_status(
        reach_rpc::errors::reason::INSTANCE_UNAVAILABLE,
        instance_id,
        format!(
            "instance {instance_id} could not be reached ({detail}); the message was not delivered: retry it"
        ),
    )
}

/// The status of a call whose instance connection broke while the call was in flight:
/// UNAVAILABLE with reason `INSTANCE_LOST` naming the instance, and the advice to retry with
/// the same `message_id`.
pub fn lost_instance(instance_id: &str, detail: &str) -> Status {
    instance_status(
        reach_rpc::errors::reason::INSTANCE_LOST,
        instance_id,
        format!(
            "instance {instance_id} failed during the call ({detail}); the message may or may not have been handled: retry with the same message_id to be safe"
        ),
    )
}

/// The status of a routed stream whose instance connection broke while it was open:
/// UNAVAILABLE with reason `INSTANCE_LOST` naming the instance. Messages sent since the
/// instance's last reply may or may not have been handled.
pub fn lost_stream_instance(instance_id: &str, detail: &str) -> Status {
    instance_status(
        reach_rpc::errors::reason::INSTANCE_LOST,
        instance_id,
        format!(
            "instance {instance_id} went away while the stream was open ({detail}); messages sent since its last reply may or may not have been handled: open a new stream to go on"
        ),
    )
}

/// The status of a call or stream whose instance's response ended without a gRPC status
/// (see [`reach_rpc::errors::is_missing_status`]): INTERNAL naming the instance and the
/// missing status, never a clean end.
pub fn missing_status(instance_id: &str) -> Status {
    Status::internal(format!(
        "the response of instance {instance_id} ended without a gRPC status (no grpc-status trailer); the call may or may not have completed"
    ))
}

/// UNAVAILABLE with `reason` and the instance's id in the metadata.
fn instance_status(reason: &'static str, instance_id: &str, message: String) -> Status {
    reach_rpc::errors::status_with_reason(
        tonic::Code::Unavailable,
        message,
        reason,
        [("instance_id".to_string(), instance_id.to_string())],
    )
}

/// Endpoints for unit tests: lazily connecting to a port nothing listens on (no call is made).
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// An endpoint `id` of service `svc` with `weight`, `max_concurrency` and `ejection`.
    /// Must be called inside a tokio runtime.
    pub(crate) fn endpoint(
        id: &str,
        weight: u32,
        max_concurrency: u32,
        ejection: EjectionConfig,
    ) -> Arc<InstanceEndpoint> {
        let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        let metered = reach_rpc::ReplyBudget::new(1 << 20, 1 << 20).meter(channel);
        Arc::new(InstanceEndpoint::new(
            metered,
            InstanceInfo {
                instance_id: id.into(),
                service: "svc".into(),
                endpoint: "http://127.0.0.1:1".into(),
                weight,
                max_concurrency,
                protocol_version: "1.0".into(),
            },
            InstanceState::Ready,
            Arc::new(LoadTracker::new(
                Duration::from_millis(5),
                Duration::from_secs(10),
            )),
            Arc::new(Room::default()),
            ejection,
            1 << 20,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::testing::endpoint;
    use super::*;

    /// An endpoint whose clock has moved on from its creation (at its very first nanosecond
    /// times read one nanosecond late: 0 means "not ejected").
    async fn aged(ejection: EjectionConfig) -> Arc<InstanceEndpoint> {
        let e = endpoint("a", 1, 0, ejection);
        tokio::time::advance(Duration::from_millis(1)).await;
        e
    }

    fn ejection(consecutive_failures: u32) -> EjectionConfig {
        EjectionConfig {
            consecutive_failures,
            base_ejection: Duration::from_secs(1),
            max_ejection: Duration::from_secs(5),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn consecutive_failures_eject_for_the_base_interval_then_it_returns() {
        let e = aged(ejection(3)).await;
        assert!(!e.record_failure());
        assert!(!e.record_failure());
        assert!(
            !e.is_ejected(Instant::now()),
            "two failures are below the threshold"
        );
        assert!(e.record_failure(), "the third failure in a row ejects");
        assert!(e.is_ejected(Instant::now()));
        assert_eq!(e.ejections(), 1);
        assert_eq!(e.ejected_for(Instant::now()), Duration::from_secs(1));
        assert!(
            !e.record_failure(),
            "an ejected instance is not ejected again"
        );

        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(e.is_ejected(Instant::now()));
        assert_eq!(e.ejected_for(Instant::now()), Duration::from_millis(1));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!e.is_ejected(Instant::now()), "back after the interval");
        assert_eq!(e.ejected_for(Instant::now()), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_on_probation_ejects_again_for_twice_as_long_up_to_the_cap() {
        let e = aged(ejection(2)).await;
        e.record_failure();
        assert!(e.record_failure());
        let mut expected = Duration::from_secs(1);
        for ejections in 1..=5 {
            assert_eq!(e.ejections(), ejections);
            assert_eq!(e.ejected_for(Instant::now()), expected);
            tokio::time::advance(expected).await;
            assert!(!e.is_ejected(Instant::now()));
            assert!(e.record_failure(), "one failure on probation ejects");
            expected = (expected * 2).min(Duration::from_secs(5));
        }
        // 1, 2, 4, then capped at 5 s.
        assert_eq!(e.ejected_for(Instant::now()), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_clears_the_record() {
        let e = aged(ejection(2)).await;
        e.record_failure();
        e.record_success();
        assert!(
            !e.record_failure(),
            "a success in between restarts the count"
        );
        assert!(e.record_failure());
        tokio::time::advance(Duration::from_secs(1)).await;
        e.record_success();
        assert_eq!(e.ejections(), 0);
        assert!(!e.is_ejected(Instant::now()));
        // Off probation: one failure no longer ejects; the threshold applies again, and the
        // interval starts over at the base.
        assert!(!e.record_failure());
        assert!(e.record_failure());
        assert_eq!(e.ejected_for(Instant::now()), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreachable_instance_is_ejected_at_once_and_probed_back_with_back_off() {
        let e = aged(ejection(5)).await;
        assert!(e.record_unreachable(), "one refused connection ejects");
        assert_eq!(e.ejected_for(Instant::now()), Duration::from_secs(1));
        assert!(!e.record_unreachable(), "already ejected");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            !e.is_ejected(Instant::now()),
            "probed back after the interval"
        );
        assert!(e.record_unreachable());
        assert_eq!(e.ejected_for(Instant::now()), Duration::from_secs(2));
        tokio::time::advance(Duration::from_secs(2)).await;
        e.record_success();
        assert_eq!(e.ejections(), 0);
        assert!(!aged(ejection(0)).await.record_unreachable(), "0 disables");
    }

    #[tokio::test(start_paused = true)]
    async fn zero_consecutive_failures_disables_ejection() {
        let e = aged(ejection(0)).await;
        for _ in 0..100 {
            assert!(!e.record_failure());
        }
        assert!(!e.is_ejected(Instant::now()));
        assert_eq!(e.ejections(), 0);
    }
}
