//! A `tracing` layer that records every span: its name, its parent's name and its fields.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// One recorded span.
#[derive(Debug, Clone, Default)]
pub struct SpanRecord {
    /// Its name.
    pub name: String,
    /// Its parent's id.
    pub parent: Option<u64>,
    /// Its parent's name, read when the span was created.
    pub parent_name: Option<String>,
    /// Its id.
    pub id: u64,
    /// Its fields (values as displayed).
    pub fields: HashMap<String, String>,
}

/// Spans recorded so far.
#[derive(Clone, Default)]
pub struct Spans(Arc<Mutex<Vec<SpanRecord>>>);

impl Spans {
    /// Every span named `name`.
    pub fn named(&self, name: &str) -> Vec<SpanRecord> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.name == name)
            .cloned()
            .collect()
    }

    /// The parent of `span`.
    pub fn parent_of(&self, span: &SpanRecord) -> Option<SpanRecord> {
        let id = span.parent?;
        self.0.lock().unwrap().iter().find(|s| s.id == id).cloned()
    }
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_string(),
            format!("{value:?}").trim_matches('"').to_string(),
        );
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let parent = if attrs.is_root() {
            None
        } else if let Some(parent) = attrs.parent() {
            Some(parent.into_u64())
        } else {
            ctx.current_span().id().map(Id::into_u64)
        };
        let parent_name = parent
            .and_then(|p| ctx.span(&Id::from_u64(p)))
            .map(|s| s.name().to_string());
        let mut record = SpanRecord {
            name: attrs.metadata().name().to_string(),
            parent,
            parent_name,
            id: id.into_u64(),
            fields: HashMap::new(),
        };
        attrs.record(&mut Fields(&mut record.fields));
        self.0.lock().unwrap().push(record);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let mut spans = self.0.lock().unwrap();
        if let Some(span) = spans.iter_mut().rev().find(|s| s.id == id.into_u64()) {
            values.record(&mut Fields(&mut span.fields));
        }
    }
}

/// Installs a recording subscriber for the current thread; keep the guard alive.
pub fn record() -> (Spans, tracing::subscriber::DefaultGuard) {
    use tracing_subscriber::layer::SubscriberExt;
    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry().with(spans.clone());
    (spans.clone(), tracing::subscriber::set_default(subscriber))
}
