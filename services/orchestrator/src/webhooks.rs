//! Task webhooks: their formats ([`WebhookRenderer`]), validation and views. The loop that
//! delivers them is [`crate::delivery`].
//!
//! A webhook (a row of `reach_webhooks`, see [`crate::store::WebhookRow`]) names a task, a
//! URL and a `format`. The [`WebhookRenderer`] registered for that format turns the task's
//! whole masked event log (the `pb::TaskEvent`s WatchTask streams, from sequence 1) into
//! notifications, each tagged with the sequence number of the event it came from; the
//! delivery loop ([`crate::delivery::spawn`]) POSTs those after the webhook's `delivered_seq`, in order, and
//! advances `delivered_seq` durably after each accepted one. A webhook that fails (connect
//! error, timeout, non-2xx) is retried with exponential back-off and gets every event later,
//! none lost. Replicas sharing a PostgreSQL store lease webhooks
//! ([`crate::store::Store::claim_webhooks`]), so two never deliver the same webhook at once.
//!
//! A webhook whose task ended and that was sent every event is parked: kept (GetTaskWebhook
//! shows it until the task is purged with its webhooks) but not polled; RetryTask makes it due
//! again.
//!
//! Delivery is at least once: a replica that crashes after a POST was accepted but before it
//! recorded it sends that notification again. Receivers deduplicate by sequence number.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use reach_proto::v1 as pb;

use crate::egress::EgressPolicy;
use crate::error::Error;
use crate::store::{WEBHOOK_PARKED_MS, WebhookRow};

/// The most webhooks one task may have.
pub const MAX_WEBHOOKS_PER_TASK: usize = 16;
/// The longest webhook URL, in bytes.
pub const MAX_URL_BYTES: usize = 2048;
/// The longest `token` or `auth_credentials`, in bytes.
pub const MAX_SECRET_BYTES: usize = 4096;
/// The longest `auth_scheme`, in bytes.
pub const MAX_SCHEME_BYTES: usize = 64;
/// The format of webhooks created without one.
pub const DEFAULT_FORMAT: &str = "reach";

/// One notification a renderer made.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The sequence number of the event it came from: the webhook's `delivered_seq` becomes
    /// this once it is accepted.
    pub sequence: u64,
    /// The JSON body POSTed.
    pub body: serde_json::Value,
}

/// Makes the notification bodies of one webhook `format` (`reach` is built in; the A2A
/// edge registers `a2a`). Register one with [`crate::Orchestrator::with_webhook_renderer`].
pub trait WebhookRenderer: Send + Sync + 'static {
    /// The format name webhooks ask for (`CreateTaskWebhookRequest.format`).
    fn format(&self) -> &'static str;

    /// The notifications of a task, in order: `task` is the task as GetTask shows it now,
    /// `events` its whole event log from sequence 1 (masked, as WatchTask streams them).
    /// Each [`Rendered`] carries the sequence of the event it came from, non-decreasing;
    /// an event may give none. It must be a pure function of `events` (and of the parts of
    /// `task` that only change with them) so that a redelivery after a crash or a failure
    /// sends the same bodies.
    fn render(&self, task: &pb::Task, events: &[pb::TaskEvent]) -> Vec<Rendered>;
}

/// The built-in `reach` format: one notification per event, the event as JSON
/// ([`crate::json::event_json`]: `task_id`, `sequence`, `kind`, `node_id`, `status`,
/// `detail`, `at`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReachRenderer;

impl WebhookRenderer for ReachRenderer {
    fn format(&self) -> &'static str {
        DEFAULT_FORMAT
    }

    fn render(&self, _task: &pb::Task, events: &[pb::TaskEvent]) -> Vec<Rendered> {
        events
            .iter()
            .map(|e| Rendered {
                sequence: e.sequence,
                body: crate::json::event_json(e),
            })
            .collect()
    }
}

/// The renderers an orchestrator knows, by format; `reach` always among them.
#[derive(Clone)]
pub struct Renderers {
    by_format: HashMap<&'static str, Arc<dyn WebhookRenderer>>,
}

impl Default for Renderers {
    fn default() -> Self {
        let mut by_format: HashMap<&'static str, Arc<dyn WebhookRenderer>> = HashMap::new();
        by_format.insert(DEFAULT_FORMAT, Arc::new(ReachRenderer));
        Self { by_format }
    }
}

impl std::fmt::Debug for Renderers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.formats()).finish()
    }
}

impl Renderers {
    /// Adds `renderer` under its format, replacing one registered before under that name.
    pub fn insert(&mut self, renderer: Arc<dyn WebhookRenderer>) {
        self.by_format.insert(renderer.format(), renderer);
    }

    /// The renderer of `format`.
    pub fn get(&self, format: &str) -> Option<&Arc<dyn WebhookRenderer>> {
        self.by_format.get(format)
    }

    /// The known formats, sorted.
    pub fn formats(&self) -> Vec<&'static str> {
        let mut formats: Vec<_> = self.by_format.keys().copied().collect();
        formats.sort_unstable();
        formats
    }
}

// === validation and views ===

fn invalid(field: &'static str, detail: impl Into<String>) -> Error {
    Error::InvalidWebhook {
        field,
        detail: detail.into(),
    }
}

/// Whether `s` is an HTTP header value: visible ASCII and spaces.
fn header_safe(s: &str) -> bool {
    http::HeaderValue::from_str(s).is_ok()
}

/// Checks a CreateTaskWebhook request and returns the row to store (id made when empty,
/// format defaulted to `reach`), created at `now_ms`.
///
/// # Errors
/// [`Error::InvalidWebhook`] naming the field: an id that is not 1 to 128 characters of
/// `A-Z a-z 0-9 . _ : -`; a URL that does not parse, is not `http`/`https`, has no host or
/// is longer than [`MAX_URL_BYTES`]; a token or credentials longer than [`MAX_SECRET_BYTES`]
/// or not header-safe; credentials without a scheme; a format `renderers` does not know; an
/// IP-literal host that `egress` refuses (a name is checked on each delivery instead).
pub fn validate(
    r: &pb::CreateTaskWebhookRequest,
    renderers: &Renderers,
    egress: &EgressPolicy,
    now_ms: i64,
) -> Result<WebhookRow, Error> {
    let webhook_id = if r.webhook_id.is_empty() {
        uuid::Uuid::now_v7().to_string()
    } else if r.webhook_id.len() <= 128
        && r.webhook_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._:-".contains(c))
    {
        r.webhook_id.clone()
    } else {
        return Err(invalid(
            "webhook_id",
            "use 1 to 128 characters of A-Z a-z 0-9 . _ : -, or leave it empty to have one made",
        ));
    };
    if r.url.len() > MAX_URL_BYTES {
        return Err(invalid(
            "url",
            format!("it is {} bytes; use at most {MAX_URL_BYTES}", r.url.len()),
        ));
    }
    let url = reqwest::Url::parse(&r.url).map_err(|e| {
        invalid(
            "url",
            format!("it does not parse ({e}); use http://HOST/PATH or https://HOST/PATH"),
        )
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid(
            "url",
            format!("its scheme is {:?}; use http or https", url.scheme()),
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid(
            "url",
            "it has no host; use http://HOST/PATH or https://HOST/PATH",
        ));
    }
    egress
        .check_url(&url)
        .map_err(|refused| invalid("url", refused.to_string()))?;
    for (field, value) in [
        ("token", &r.token),
        ("auth_credentials", &r.auth_credentials),
    ] {
        if value.len() > MAX_SECRET_BYTES {
            return Err(invalid(
                field,
                format!(
                    "it is {} bytes; use at most {MAX_SECRET_BYTES}",
                    value.len()
                ),
            ));
        }
        if !header_safe(value) {
            return Err(invalid(
                field,
                "it must be visible ASCII (a header value: no control characters)",
            ));
        }
    }
    let scheme_ok = r.auth_scheme.len() <= MAX_SCHEME_BYTES
        && r.auth_scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c));
    if !scheme_ok {
        return Err(invalid(
            "auth_scheme",
            "use an HTTP authentication scheme name such as Bearer or Basic (at most 64 characters, no spaces)",
        ));
    }
    if r.auth_scheme.is_empty() && !r.auth_credentials.is_empty() {
        return Err(invalid(
            "auth_scheme",
            "it is required with auth_credentials; for example Bearer",
        ));
    }
    let format = if r.format.is_empty() {
        DEFAULT_FORMAT.to_string()
    } else {
        r.format.clone()
    };
    if renderers.get(&format).is_none() {
        return Err(invalid(
            "format",
            format!(
                "{format:?} is not a known format; use one of [{}]",
                renderers.formats().join(", ")
            ),
        ));
    }
    Ok(WebhookRow {
        webhook_id,
        task_id: r.task_id.clone(),
        url: r.url.clone(),
        token: r.token.clone(),
        auth_scheme: r.auth_scheme.clone(),
        auth_credentials: r.auth_credentials.clone(),
        format,
        delivered_seq: 0,
        created_ms: now_ms,
        failed_attempts: 0,
        last_error: String::new(),
        next_attempt_ms: 0,
        lease_owner: None,
        lease_until_ms: 0,
    })
}

/// A webhook as the API shows it: `auth_credentials` always empty (write-only).
pub fn view(w: &WebhookRow) -> pb::TaskWebhook {
    pb::TaskWebhook {
        webhook_id: w.webhook_id.clone(),
        task_id: w.task_id.clone(),
        url: w.url.clone(),
        token: w.token.clone(),
        auth_scheme: w.auth_scheme.clone(),
        auth_credentials: String::new(),
        format: w.format.clone(),
        delivered_sequence: u64::try_from(w.delivered_seq).unwrap_or(0),
        created_at: Some(reach_rpc::time::from_unix_ms(w.created_ms)),
        failed_attempts: u32::try_from(w.failed_attempts).unwrap_or(u32::MAX),
        last_error: w.last_error.clone(),
        next_attempt_at: (w.next_attempt_ms > 0 && w.next_attempt_ms != WEBHOOK_PARKED_MS)
            .then(|| reach_rpc::time::from_unix_ms(w.next_attempt_ms)),
    }
}

/// The wait before attempt `failures + 1` after `failures` failures in a row: `base`
/// doubled per failure after the first, capped at `max`, of which a random half to all is
/// taken (jitter, so webhooks that failed together do not retry together).
pub fn backoff(failures: i64, base: Duration, max: Duration) -> Duration {
    let failures = u32::try_from(failures.max(1)).unwrap_or(u32::MAX);
    let full = reach_rpc::backoff::Exponential::doubling(base, max).delay(failures);
    let factor: f64 = rand::Rng::random_range(&mut rand::rng(), 0.5..=1.0);
    full.mul_f64(factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(url: &str) -> pb::CreateTaskWebhookRequest {
        pb::CreateTaskWebhookRequest {
            task_id: "t".into(),
            url: url.into(),
            ..Default::default()
        }
    }

    fn field_of(e: Error) -> &'static str {
        match e {
            Error::InvalidWebhook { field, .. } => field,
            other => panic!("not an invalid webhook: {other}"),
        }
    }

    #[test]
    fn validation_names_the_field() {
        let r = Renderers::default();
        let egress = EgressPolicy::new(Vec::new());
        let ok = validate(&request("https://example.com/hook"), &r, &egress, 5).unwrap();
        assert_eq!(ok.format, "reach");
        assert_eq!(ok.created_ms, 5);
        assert_eq!(
            uuid::Uuid::parse_str(&ok.webhook_id)
                .unwrap()
                .get_version_num(),
            7
        );
        for (req, field) in [
            (request("ftp://example.com/x"), "url"),
            (request("not a url"), "url"),
            (
                request(&format!("https://e.com/{}", "a".repeat(2048))),
                "url",
            ),
            (
                pb::CreateTaskWebhookRequest {
                    webhook_id: "a b".into(),
                    ..request("http://e.com")
                },
                "webhook_id",
            ),
            (
                pb::CreateTaskWebhookRequest {
                    token: "x".repeat(4097),
                    ..request("http://e.com")
                },
                "token",
            ),
            (
                pb::CreateTaskWebhookRequest {
                    token: "a\nb".into(),
                    ..request("http://e.com")
                },
                "token",
            ),
            (
                pb::CreateTaskWebhookRequest {
                    auth_credentials: "secret".into(),
                    ..request("http://e.com")
                },
                "auth_scheme",
            ),
            (
                pb::CreateTaskWebhookRequest {
                    format: "a2a".into(),
                    ..request("http://e.com")
                },
                "format",
            ),
            (request("http://169.254.169.254/latest/meta-data/"), "url"),
            (request("http://[::1]:8080/hook"), "url"),
        ] {
            assert_eq!(
                field_of(validate(&req, &r, &egress, 0).unwrap_err()),
                field,
                "{req:?}"
            );
        }
        let e = validate(
            &pb::CreateTaskWebhookRequest {
                format: "a2a".into(),
                ..request("http://e.com")
            },
            &r,
            &egress,
            0,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "webhook format is not valid: \"a2a\" is not a known format; use one of [reach]"
        );
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_with_jitter() {
        let base = Duration::from_secs(1);
        let max = Duration::from_secs(300);
        for (failures, full) in [(1, 1), (2, 2), (3, 4), (9, 256), (10, 300), (60, 300)] {
            let d = backoff(failures, base, max);
            let full = Duration::from_secs(full);
            assert!(
                d >= full / 2 && d <= full,
                "{failures}: {d:?} not in [{full:?}/2, {full:?}]"
            );
        }
    }

    #[test]
    fn credentials_are_never_shown() {
        let r = Renderers::default();
        let w = validate(
            &pb::CreateTaskWebhookRequest {
                auth_scheme: "Bearer".into(),
                auth_credentials: "s3cret".into(),
                ..request("http://e.com")
            },
            &r,
            &EgressPolicy::new(Vec::new()),
            0,
        )
        .unwrap();
        let v = view(&w);
        assert_eq!(v.auth_credentials, "");
        assert_eq!(v.auth_scheme, "Bearer");
        assert!(v.next_attempt_at.is_none());
    }
}
