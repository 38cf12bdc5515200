//! Process-wide `tracing` setup: log lines to stderr, spans to OpenTelemetry.

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use tracing::Dispatch;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::config::{LogFormat, SamplerConfig, TelemetryConfig};
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
    shutdown_timeout: Duration,
    exporting: bool,
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

    /// Flushes queued spans and stops the exporter, within the configured time limit
    /// (`TelemetryConfig::shutdown_timeout`): returns at the latest shortly after it, even
    /// when the collector is down or never answers.
    ///
    /// # Errors
    /// [`ShutdownError`] when the limit passes first or the collector refuses the spans.
    pub async fn shutdown(self) -> Result<(), ShutdownError> {
        let provider = self.provider.clone();
        let limit = self.shutdown_timeout;
        self.bounded(move || provider.shutdown_with_timeout(limit))
            .await
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
    let provider = tracer_provider(config)?;
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
            shutdown_timeout: config.shutdown_timeout,
            exporting,
        },
    ))
}

fn tracer_provider(config: &TelemetryConfig) -> Result<SdkTracerProvider, InitError> {
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
        // absent collector drops spans, it never blocks the code that ends them.
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(config.max_queue_size)
            .build();
        builder = builder.with_span_processor(
            BatchSpanProcessor::builder(exporter)
                .with_batch_config(batch)
                .build(),
        );
    }
    Ok(builder.build())
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
