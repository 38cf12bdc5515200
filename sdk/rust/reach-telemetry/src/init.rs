//! Process-wide `tracing` setup: log lines to stderr, spans to OpenTelemetry.
//!
//! Export is bounded and accounted for: finished spans wait in a bounded queue (a full queue
//! drops new ones), each export has the configured timeout, shutdown spends at most that
//! timeout (a collector that is down or never answers costs the exit no more), and every span
//! that was never exported is counted by reason in `reach_telemetry_spans_dropped_total`
//! ([`DroppedSpans`]) and reported in one log line at shutdown.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter,
    SpanProcessor,
};
use tracing::Dispatch;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::config::{LogFormat, SamplerConfig, TelemetryConfig};
use crate::metrics::names::TELEMETRY_SPANS_DROPPED;
use crate::propagation::ReachIdGenerator;

/// The filter of the span pipeline (independent of `REACH_LOG`, so quieter logs never break
/// traces or `traceparent` propagation): every span at `info` or above.
const SPAN_FILTER: &str = "info";

/// Why telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// `REACH_LOG` holds an invalid directive.
    #[error("REACH_LOG {filter:?} is not a valid filter: {source}")]
    Filter {
        /// The filter text.
        filter: String,
        /// The parser's complaint.
        source: tracing_subscriber::filter::ParseError,
    },
    /// The OTLP exporter could not be built (for example a malformed endpoint).
    #[error("cannot build the OTLP exporter for {endpoint:?}: {source}")]
    Exporter {
        /// The configured endpoint.
        endpoint: String,
        /// The exporter's complaint.
        source: opentelemetry_otlp::ExporterBuildError,
    },
    /// OTLP export was asked for outside a tokio runtime (tonic needs one).
    #[error("OTLP export needs a tokio runtime: call init from inside one")]
    NoRuntime,
    /// A global subscriber is already installed in this process.
    #[error("a global tracing subscriber is already installed")]
    AlreadyInstalled,
}

/// Why a flush or shutdown did not complete.
#[derive(Debug, thiserror::Error)]
pub enum ShutdownError {
    /// The time limit passed first; spans still queued are lost.
    #[error("span export did not finish within {0:?}")]
    TimedOut(Duration),
    /// The exporter reported an error (for example the collector refused the spans).
    #[error("span export failed: {0}")]
    Export(String),
}

/// A handle on the span pipeline. Call [`TelemetryGuard::shutdown`] before the process
/// exits: the installed subscriber keeps the pipeline alive, so spans still queued at exit
/// without it are lost. Clones share the same pipeline.
#[derive(Debug, Clone)]
pub struct TelemetryGuard {
    provider: SdkTracerProvider,
    /// How long a flush or shutdown may take: the configured shutdown timeout, or the export
    /// timeout when that is shorter.
    shutdown_timeout: Duration,
    exporting: bool,
    /// The export pipeline's span accounts; `None` when nothing is exported.
    accounts: Option<Arc<SpanAccounts>>,
}

/// Finished spans that were never exported, by reason (the `reason` label of
/// `reach_telemetry_spans_dropped_total`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DroppedSpans {
    /// The export queue (`OTEL_BSP_MAX_QUEUE_SIZE`) was full when the span ended.
    pub queue_full: u64,
    /// Its batch failed to export: refused, collector unreachable, or no answer within the
    /// export timeout.
    pub export_failed: u64,
    /// Still waiting (queued or being exported) when shutdown's time limit ran out.
    pub shutdown: u64,
}

impl DroppedSpans {
    /// Every dropped span.
    pub fn total(&self) -> u64 {
        self.queue_full + self.export_failed + self.shutdown
    }
}

/// What happened to the spans handed to the export pipeline, shared by [`CountedProcessor`],
/// [`CountedExporter`] and the guard.
#[derive(Debug)]
struct SpanAccounts {
    /// The most spans that may wait: the queue size.
    max_queued: usize,
    /// Spans handed to the batch processor and not yet to the exporter.
    queued: AtomicUsize,
    /// Spans in exports that have not returned yet.
    exporting: AtomicUsize,
    queue_full: AtomicU64,
    export_failed: AtomicU64,
    shutdown: AtomicU64,
}

impl SpanAccounts {
    fn new(max_queued: usize) -> Self {
        Self {
            max_queued,
            queued: AtomicUsize::new(0),
            exporting: AtomicUsize::new(0),
            queue_full: AtomicU64::new(0),
            export_failed: AtomicU64::new(0),
            shutdown: AtomicU64::new(0),
        }
    }

    fn drop_spans(&self, reason: &'static str, counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
        ::metrics::counter!(TELEMETRY_SPANS_DROPPED, "reason" => reason).increment(n as u64);
    }

    /// The exporter takes `n` queued spans; `false` when shutdown already claimed them.
    ///
    /// Each span is counted once: a shutdown that gives up claims every span still queued or
    /// exporting ([`SpanAccounts::claim_unexported`]), so an export that ends after it —
    /// failed or not — must not count them again, nor wrap the counters below zero.
    fn begin_export(&self, n: usize) -> bool {
        let owned = take(&self.queued, n);
        if owned {
            self.exporting.fetch_add(n, Ordering::AcqRel);
        }
        owned
    }

    /// An export of `n` spans ended; a failed one counts them as `export_failed` unless
    /// shutdown claimed them meanwhile.
    fn end_export(&self, n: usize, owned: bool, failed: bool) {
        if owned && take(&self.exporting, n) && failed {
            self.drop_spans("export_failed", &self.export_failed, n);
        }
    }

    /// Claims every span still queued or exporting, counted as `shutdown`; returns how many.
    fn claim_unexported(&self) -> usize {
        let waiting =
            self.queued.swap(0, Ordering::AcqRel) + self.exporting.swap(0, Ordering::AcqRel);
        if waiting > 0 {
            self.drop_spans("shutdown", &self.shutdown, waiting);
        }
        waiting
    }

    fn snapshot(&self) -> DroppedSpans {
        DroppedSpans {
            queue_full: self.queue_full.load(Ordering::Relaxed),
            export_failed: self.export_failed.load(Ordering::Relaxed),
            shutdown: self.shutdown.load(Ordering::Relaxed),
        }
    }
}

/// Subtracts `n` from `counter` unless that would go below zero; whether it did.
fn take(counter: &AtomicUsize, n: usize) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| c.checked_sub(n))
        .is_ok()
}

/// The batch processor behind a queue bound of its own, so that a span it would drop for a
/// full queue is counted: the SDK keeps that count to itself. The bound counts spans from
/// their end until the exporter takes them, which includes the SDK's queue, so the SDK's own
/// queue never overflows.
#[derive(Debug)]
struct CountedProcessor {
    inner: BatchSpanProcessor,
    accounts: Arc<SpanAccounts>,
}

impl SpanProcessor for CountedProcessor {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        let accounts = &self.accounts;
        let admitted = accounts
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < accounts.max_queued).then_some(n + 1)
            })
            .is_ok();
        if admitted {
            self.inner.on_end(span);
        } else {
            accounts.drop_spans("queue_full", &accounts.queue_full, 1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting the spans of every batch it fails to export.
#[derive(Debug)]
struct CountedExporter<E> {
    inner: E,
    accounts: Arc<SpanAccounts>,
}

impl<E: SpanExporter> SpanExporter for CountedExporter<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let owned = self.accounts.begin_export(n);
        let result = self.inner.export(batch).await;
        self.accounts.end_export(n, owned, result.is_err());
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

impl TelemetryGuard {
    /// Whether spans are exported over OTLP.
    pub fn is_exporting(&self) -> bool {
        self.exporting
    }

    /// The tracer provider, for code that uses the OpenTelemetry API directly.
    pub fn tracer_provider(&self) -> &SdkTracerProvider {
        &self.provider
    }

    /// Exports every finished span now, waiting at most the configured shutdown timeout.
    ///
    /// # Errors
    /// [`ShutdownError`] when the limit passes first or the collector refuses the spans.
    pub async fn flush(&self) -> Result<(), ShutdownError> {
        let provider = self.provider.clone();
        self.bounded(move || provider.force_flush()).await
    }

    /// Spans dropped so far, by reason (all zero when nothing is exported). Spans still
    /// waiting when shutdown gives up are counted by [`TelemetryGuard::shutdown`].
    pub fn dropped_spans(&self) -> DroppedSpans {
        self.accounts
            .as_ref()
            .map(|a| a.snapshot())
            .unwrap_or_default()
    }

    /// Flushes queued spans and stops the exporter, within the export timeout
    /// (`OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` / `OTEL_EXPORTER_OTLP_TIMEOUT`, or
    /// `TelemetryConfig::shutdown_timeout` if shorter): returns at the latest shortly
    /// (250 ms) after it, even when the collector is down or never answers. Spans that were
    /// never exported are then counted (those still waiting as `shutdown`) and, if there are
    /// any, reported in one warning: `N spans dropped: ...`.
    ///
    /// # Errors
    /// [`ShutdownError`] when the limit passes first or the collector refuses the spans.
    pub async fn shutdown(self) -> Result<(), ShutdownError> {
        let provider = self.provider.clone();
        let limit = self.shutdown_timeout;
        let result = self
            .bounded(move || provider.shutdown_with_timeout(limit))
            .await;
        if let Some(accounts) = &self.accounts {
            accounts.claim_unexported();
            let dropped = accounts.snapshot();
            if dropped.total() > 0 {
                tracing::warn!(
                    dropped = dropped.total(),
                    queue_full = dropped.queue_full,
                    export_failed = dropped.export_failed,
                    shutdown = dropped.shutdown,
                    "{} spans dropped: {} at a full export queue, {} in failed exports, {} unexported at shutdown",
                    dropped.total(),
                    dropped.queue_full,
                    dropped.export_failed,
                    dropped.shutdown
                );
            }
        }
        result
    }

    async fn bounded(
        &self,
        work: impl FnOnce() -> opentelemetry_sdk::error::OTelSdkResult + Send + 'static,
    ) -> Result<(), ShutdownError> {
        let limit = self.shutdown_timeout;
        // The SDK blocks the calling thread while the batch thread exports; the exporter
        // itself needs the tokio runtime, so never block a runtime thread.
        let task = tokio::task::spawn_blocking(work);
        match tokio::time::timeout(limit + Duration::from_millis(250), task).await {
            Err(_) => Err(ShutdownError::TimedOut(limit)),
            Ok(Err(join)) => Err(ShutdownError::Export(join.to_string())),
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(opentelemetry_sdk::error::OTelSdkError::Timeout(_)))) => {
                Err(ShutdownError::TimedOut(limit))
            }
            // The provider folds its processors' timeouts into one failure message.
            Ok(Ok(Err(e))) if e.to_string().contains("Timeout(") => {
                Err(ShutdownError::TimedOut(limit))
            }
            Ok(Ok(Err(e))) => Err(ShutdownError::Export(e.to_string())),
        }
    }
}

/// Installs the process-wide subscriber: logs to stderr filtered by `REACH_LOG` in
/// `REACH_LOG_FORMAT`, spans to OpenTelemetry (exported over OTLP/gRPC when an endpoint is
/// configured). Call once, first thing in `main`, inside the tokio runtime.
///
/// # Errors
/// [`InitError`] for a bad filter, an unusable endpoint, a missing runtime, or a second call.
pub fn init(config: &TelemetryConfig) -> Result<TelemetryGuard, InitError> {
    let (dispatch, guard) = dispatch(config, std::io::stderr)?;
    tracing::dispatcher::set_global_default(dispatch).map_err(|_| InitError::AlreadyInstalled)?;
    // Spans made with the OpenTelemetry API directly (`export_root_span`) use it too.
    opentelemetry::global::set_tracer_provider(guard.provider.clone());
    Ok(guard)
}

/// Builds the same subscriber as [`init`] writing log lines to `writer`, without installing
/// it: tests use it with `tracing::dispatcher::set_default` (or `with_default`), embedders with
/// their own writer.
///
/// # Errors
/// [`InitError`] for a bad filter, an unusable endpoint or a missing runtime.
pub fn dispatch<W>(
    config: &TelemetryConfig,
    writer: W,
) -> Result<(Dispatch, TelemetryGuard), InitError>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let log_filter = EnvFilter::builder()
        .parse(&config.log_filter)
        .map_err(|source| InitError::Filter {
            filter: config.log_filter.clone(),
            source,
        })?;
    let (provider, accounts) = tracer_provider(config)?;
    let exporting = config.otlp_endpoint.is_some();
    let tracer = provider.tracer("reach");

    let log_layer = match config.log_format {
        LogFormat::Plain => tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(false)
            .with_filter(log_filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .with_writer(writer)
            .with_filter(log_filter)
            .boxed(),
    };
    let mut layers = vec![log_layer];
    // Spans become OpenTelemetry spans only when they go somewhere: without an exporter the
    // layer would cost every span its bookkeeping for nothing. Trace context then passes
    // through unchanged (the router forwards the caller's `traceparent`), as with
    // OpenTelemetry's no-op tracer, and log lines still carry the envelope's trace id.
    if exporting {
        layers.push(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_tracked_inactivity(false)
                .with_threads(false)
                .with_filter(EnvFilter::new(SPAN_FILTER))
                .boxed(),
        );
    }
    let subscriber = Registry::default().with(layers);
    Ok((
        Dispatch::new(subscriber),
        TelemetryGuard {
            provider,
            shutdown_timeout: config.shutdown_timeout.min(config.export_timeout),
            exporting,
            accounts,
        },
    ))
}

fn tracer_provider(
    config: &TelemetryConfig,
) -> Result<(SdkTracerProvider, Option<Arc<SpanAccounts>>), InitError> {
    let resource = Resource::builder_empty()
        .with_service_name(config.service_name.clone())
        .with_attributes(
            config
                .resource_attributes
                .iter()
                .filter(|(k, _)| k != "service.name")
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .build();
    let mut builder = SdkTracerProvider::builder()
        .with_sampler(sampler(config.sampler))
        .with_id_generator(ReachIdGenerator)
        .with_resource(resource);
    if let Some(endpoint) = &config.otlp_endpoint {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(InitError::NoRuntime);
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .with_timeout(config.export_timeout)
            .build()
            .map_err(|source| InitError::Exporter {
                endpoint: endpoint.clone(),
                source,
            })?;
        // Finished spans go to a bounded queue drained by a background thread: a slow or
        // absent collector drops spans (counted), it never blocks the code that ends them.
        let max_queued = config.max_queue_size.max(1);
        let accounts = Arc::new(SpanAccounts::new(max_queued));
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(max_queued)
            .build();
        let exporter = CountedExporter {
            inner: exporter,
            accounts: accounts.clone(),
        };
        builder = builder.with_span_processor(CountedProcessor {
            inner: BatchSpanProcessor::builder(exporter)
                .with_batch_config(batch)
                .build(),
            accounts: accounts.clone(),
        });
        return Ok((builder.build(), Some(accounts)));
    }
    Ok((builder.build(), None))
}

fn sampler(config: SamplerConfig) -> Sampler {
    match config {
        SamplerConfig::AlwaysOn => Sampler::AlwaysOn,
        SamplerConfig::AlwaysOff => Sampler::AlwaysOff,
        SamplerConfig::TraceIdRatio(r) => Sampler::TraceIdRatioBased(r),
        SamplerConfig::ParentBasedAlwaysOn => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        SamplerConfig::ParentBasedAlwaysOff => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        SamplerConfig::ParentBasedTraceIdRatio(r) => {
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(r)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An export that fails after shutdown gave up on it counts its spans once (as
    /// `shutdown`), not twice, and leaves no counter wrapped below zero; one that fails
    /// before shutdown counts them as `export_failed`.
    #[test]
    fn every_unexported_span_is_counted_once() {
        let accounts = SpanAccounts::new(16);
        accounts.queued.store(8 + 3, Ordering::SeqCst);
        let owned = accounts.begin_export(8);
        assert!(owned);
        // Shutdown gives up while those 8 are exporting and 3 more wait.
        assert_eq!(accounts.claim_unexported(), 11);
        accounts.end_export(8, owned, true);
        // A batch the exporter takes only after the claim was counted already.
        let late = accounts.begin_export(3);
        assert!(!late);
        accounts.end_export(3, late, true);
        let dropped = accounts.snapshot();
        assert_eq!(
            (dropped.shutdown, dropped.export_failed, dropped.total()),
            (11, 0, 11)
        );
        assert_eq!(accounts.exporting.load(Ordering::SeqCst), 0);
        assert_eq!(accounts.queued.load(Ordering::SeqCst), 0);

        let accounts = SpanAccounts::new(16);
        accounts.queued.store(4, Ordering::SeqCst);
        let owned = accounts.begin_export(4);
        accounts.end_export(4, owned, true);
        assert_eq!(accounts.claim_unexported(), 0);
        assert_eq!(accounts.snapshot().export_failed, 4);
    }
}
