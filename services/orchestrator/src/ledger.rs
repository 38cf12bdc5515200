//! The router side of the message ledger: a bounded, batched, never-blocking sink.
//!
//! [`LedgerSink::record`] puts an entry on a bounded channel with `try_send` and returns at
//! once; when the channel is full the entry is dropped and counted. A background task sends
//! batches (up to `batch_size`, or whatever arrived within `flush_interval`) to
//! `OrchestratorService/RecordMessages`; a failed send drops that batch and counts it. The
//! drop count is reported with the next batch, and readable with [`LedgerSink::dropped`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use reach_proto::v1::LedgerEntry;
use reach_proto::v1::RecordMessagesRequest;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
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
}

impl Default for LedgerSinkConfig {
    fn default() -> Self {
        Self {
            capacity: 10_000,
            batch_size: 256,
            flush_interval: Duration::from_millis(200),
            timeout: Duration::from_secs(5),
        }
    }
}

/// A handle to record routed messages. Cheap to clone; `record` never blocks or fails.
#[derive(Clone, Debug)]
pub struct LedgerSink {
    tx: mpsc::Sender<LedgerEntry>,
    dropped: Arc<AtomicU64>,
    sent: Arc<AtomicU64>,
}

impl LedgerSink {
    /// Starts the background sender towards the orchestrator at `endpoint`
    /// (`http://HOST:PORT`, connected lazily). Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// A message when `endpoint` is not a valid URI.
    pub fn spawn(endpoint: &str, config: LedgerSinkConfig) -> Result<Self, String> {
        let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())
            .map_err(|e| format!("ledger endpoint {endpoint:?} is not a URI: {e}"))?
            .connect_lazy();
        let (tx, rx) = mpsc::channel(config.capacity.max(1));
        let dropped = Arc::new(AtomicU64::new(0));
        let sent = Arc::new(AtomicU64::new(0));
        tokio::spawn(run(
            OrchestratorServiceClient::new(channel),
            rx,
            config,
            dropped.clone(),
            sent.clone(),
        ));
        Ok(Self { tx, dropped, sent })
    }

    /// Queues an entry; returns false (and counts a drop) when the buffer is full or the
    /// sender stopped.
    pub fn record(&self, entry: LedgerEntry) -> bool {
        if self.tx.try_send(entry).is_ok() {
            true
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            false
        }
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
