//! The router side of the message ledger: a bounded, batched, never-blocking sink.
//!
//! [`LedgerSink::record`] puts an entry on a bounded channel with `try_send` and returns at
//! once; when the channel is full the entry is dropped and counted. A background task sends
//! batches (up to `batch_size`, or whatever arrived within `flush_interval`) to
//! `OrchestratorService/RecordMessages`; a failed send drops that batch and counts it. The
//! drop count is reported with the next batch, and readable with [`LedgerSink::dropped`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use prost::Message;
use reach_proto::v1::RecordMessagesRequest;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_proto::v1::{LedgerEntry, ReachMessage};
use tokio::sync::mpsc;

/// Settings of a [`LedgerSink`].
#[derive(Debug, Clone)]
pub struct LedgerSinkConfig {
    /// Entries buffered before new ones are dropped. Default 10 000.
    pub capacity: usize,
    /// Entries per RecordMessages call. Default 256.
    pub batch_size: usize,
    /// Longest an entry waits before its batch is sent. Default 200ms.
    pub flush_interval: Duration,
    /// Per-call timeout. Default 5s.
    pub timeout: Duration,
    /// The router instance recorded in every entry (`recorded_by`). Default `router`.
    pub recorded_by: String,
    /// The fraction of tasks recorded, in `[0, 1]` (default 1). Sampling is per task (a hash
    /// of the task id), so a sampled task is recorded whole.
    pub sample_rate: f64,
}

impl Default for LedgerSinkConfig {
    fn default() -> Self {
        Self {
            capacity: 10_000,
            batch_size: 256,
            flush_interval: Duration::from_millis(200),
            timeout: Duration::from_secs(5),
            sample_rate: 1.0,
            recorded_by: "router".into(),
        }
    }
}

/// A handle to record routed messages. Cheap to clone; `record` never blocks or fails.
#[derive(Clone, Debug)]
pub struct LedgerSink {
    tx: mpsc::Sender<LedgerEntry>,
    sample_per_10k: u64,
    recorded_by: Arc<str>,
    dropped: Arc<AtomicU64>,
    sent: Arc<AtomicU64>,
}

impl LedgerSink {
    /// Starts the background sender towards the orchestrator at `endpoint`
    /// (`http://HOST:PORT`, connected lazily). Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// [`LedgerError::InvalidEndpoint`] when `endpoint` is not a valid URI.
    pub fn spawn(endpoint: &str, config: LedgerSinkConfig) -> Result<Self, LedgerError> {
        Self::spawn_with_tls(endpoint, config, None)
    }

    /// [`LedgerSink::spawn`], over TLS with `tls`'s certificate when given.
    ///
    /// # Errors
    /// As [`LedgerSink::spawn`].
    pub fn spawn_with_tls(
        endpoint: &str,
        config: LedgerSinkConfig,
        tls: Option<&Arc<reach_trust::tls::TlsSource>>,
    ) -> Result<Self, LedgerError> {
        let channel =
            tonic::transport::Endpoint::from_shared(endpoint.to_string()).map_err(|source| {
                LedgerError::InvalidEndpoint {
                    endpoint: endpoint.to_string(),
                    source,
                }
            })?;
        let channel = reach_rpc::http2::channel_lazy(&channel, tls, None);
        let (tx, rx) = mpsc::channel(config.capacity.max(1));
        let recorded_by = config.recorded_by.clone();
        let dropped = Arc::new(AtomicU64::new(0));
        let sent = Arc::new(AtomicU64::new(0));
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let sample_per_10k = (config.sample_rate.clamp(0.0, 1.0) * 10_000.0).round() as u64;
        tokio::spawn(run(
            OrchestratorServiceClient::new(channel),
            rx,
            config,
            dropped.clone(),
            sent.clone(),
        ));
        Ok(Self {
            tx,
            recorded_by: Arc::from(recorded_by.as_str()),
            sample_per_10k,
            dropped,
            sent,
        })
    }

    /// Queues an entry; returns false (and counts a drop) when the buffer is full or the
    /// sender stopped. Entries without a task id, or of a task outside the sample, are
    /// skipped (returns true).
    pub fn record(&self, entry: LedgerEntry) -> bool {
        let task = entry
            .header
            .as_ref()
            .map(|h| h.task_id.as_str())
            .unwrap_or_default();
        if task.is_empty() || !self.sampled(task) {
            return true;
        }
        if self.tx.try_send(entry).is_ok() {
            true
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    /// Records a routed call: the request's header (without payload), payload type and
    /// encoded size, and its [`CallOutcome`]. See [`entry`].
    pub fn record_call(&self, request: &ReachMessage, outcome: &CallOutcome) -> bool {
        self.record(entry(request, outcome, &self.recorded_by))
    }

    fn sampled(&self, task_id: &str) -> bool {
        if self.sample_per_10k >= 10_000 {
            return true;
        }
        // FNV-1a: stable across processes, so every router samples the same tasks.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in task_id.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h % 10_000 < self.sample_per_10k
    }

    /// Entries dropped so far (buffer full or send failed).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Entries the orchestrator acknowledged so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

/// Why a [`LedgerSink`] could not be started.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The orchestrator endpoint is not a URI.
    #[error(
        "ledger endpoint {endpoint:?} is not a URI: {source}; use the orchestrator's URL, such as http://127.0.0.1:7070"
    )]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        source: tonic::transport::Error,
    },
}

/// How a routed call went, for [`LedgerSink::record_call`].
#[derive(Debug, Clone)]
pub struct CallOutcome {
    /// The delivery's gRPC code (`Ok` when the instance answered).
    pub code: tonic::Code,
    /// The status message when it failed.
    pub status_message: String,
    /// Request to reply.
    pub latency: Duration,
    /// When the router received the request.
    pub routed_at: SystemTime,
    /// The instance that handled it (empty when none did).
    pub instance_id: String,
}

/// A ledger entry for a routed message: its header without the payload, the payload's type
/// and encoded size in bytes, the outcome, and the recording router.
pub fn entry(request: &ReachMessage, outcome: &CallOutcome, recorded_by: &str) -> LedgerEntry {
    LedgerEntry {
        header: request.header.clone(),
        payload_type: request
            .payload
            .as_ref()
            .map(|p| p.r#type.clone())
            .unwrap_or_default(),
        payload_bytes: request
            .payload
            .as_ref()
            .map_or(0, |p| p.encoded_len() as u64),
        status_code: outcome.code as i32,
        status_message: outcome.status_message.clone(),
        latency: Some(reach_rpc::time::proto_duration(outcome.latency)),
        routed_at: Some(reach_rpc::time::timestamp(outcome.routed_at)),
        instance_id: outcome.instance_id.clone(),
        recorded_by: recorded_by.to_string(),
    }
}

async fn run(
    mut client: OrchestratorServiceClient<tonic::transport::Channel>,
    mut rx: mpsc::Receiver<LedgerEntry>,
    config: LedgerSinkConfig,
    dropped: Arc<AtomicU64>,
    sent: Arc<AtomicU64>,
) {
    let mut reported = 0u64;
    let mut batch = Vec::with_capacity(config.batch_size);
    loop {
        if rx.recv_many(&mut batch, config.batch_size).await == 0 {
            return;
        }
        let deadline = tokio::time::Instant::now() + config.flush_interval;
        while batch.len() < config.batch_size {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(e)) => batch.push(e),
                Ok(None) | Err(_) => break,
            }
        }
        let n = batch.len() as u64;
        let total_dropped = dropped.load(Ordering::Relaxed);
        let mut req = tonic::Request::new(RecordMessagesRequest {
            entries: std::mem::take(&mut batch),
            dropped: total_dropped - reported,
        });
        req.set_timeout(config.timeout);
        match client.record_messages(req).await {
            Ok(_) => {
                reported = total_dropped;
                sent.fetch_add(n, Ordering::Relaxed);
            }
            Err(status) => {
                dropped.fetch_add(n, Ordering::Relaxed);
                tracing::debug!(code = ?status.code(), entries = n, "ledger batch dropped");
            }
        }
    }
}
