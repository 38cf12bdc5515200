//! Masking of sensitive values in everything the API, the HTTP admin routes and the CLI show.
//!
//! The store keeps values as given (flows need them); masking is applied on the way out.
//! Masked: e-mail addresses, phone numbers, card numbers (13 to 19 digits), account numbers
//! (IBANs and 8 to 17 digit runs), bearer tokens, values matching configured regexes, and
//! every value under a sensitive field name, at any depth: names are matched
//! case-insensitively against globs (`*password*` masks `db_password` and `PasswordHash`), so
//! the names people actually use are caught, not only exact ones.

use std::sync::Arc;

use globset::{Glob, GlobSet, GlobSetBuilder};
use regex::Regex;

/// The field-name globs masked by default, whatever their value (matched against the
/// lowercased name). `*token` masks `access_token` and `github_token` but not
/// `input_tokens` (model usage counts).
pub const DEFAULT_SENSITIVE_FIELDS: &[&str] = &[
    "*password*",
    "*passwd*",
    "*secret*",
    "*token",
    "*api_key*",
    "*apikey*",
    "*api-key*",
    "*authorization*",
    "*credential*",
    "*private_key*",
    "cookie",
    "ssn",
    "card_number",
    "account_number",
    "iban",
];

/// Why a masking pattern was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MaskError {
    /// A field-name glob does not parse.
    #[error(
        "redact_fields: {pattern:?} is not a glob ({reason}); use names or globs such as *password*"
    )]
    Field {
        /// The pattern.
        pattern: String,
        /// Why.
        reason: String,
    },
    /// A value regex does not compile.
    #[error("redact_values: {pattern:?} is not a regular expression ({reason})")]
    Value {
        /// The pattern.
        pattern: String,
        /// Why.
        reason: String,
    },
}

/// Masks sensitive values in JSON. Cheap to clone.
#[derive(Clone)]
pub struct Masker {
    inner: Arc<Inner>,
}

struct Inner {
    /// The field-name globs, as given.
    field_patterns: Vec<String>,
    fields: GlobSet,
    patterns: Vec<(Regex, &'static str)>,
}

impl std::fmt::Debug for Masker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Masker")
            .field("fields", &self.inner.field_patterns)
            .finish_non_exhaustive()
    }
}

impl Masker {
    /// A masker for the built-in value patterns and the field-name globs `fields` (matched
    /// case-insensitively).
    ///
    /// # Panics
    /// When a glob does not parse: for built-in lists; use [`Masker::with_patterns`] for
    /// configured ones.
    pub fn new<I, S>(fields: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::with_patterns(fields, std::iter::empty::<&str>())
            .unwrap_or_else(|e| panic!("built-in mask patterns: {e}"))
    }

    /// A masker for the field-name globs `fields` (case-insensitive) and, besides the built-in
    /// value patterns, the regexes `values` (each match replaced by `***`).
    ///
    /// # Errors
    /// [`MaskError`] naming the pattern that does not parse.
    pub fn with_patterns<I, S, V, T>(fields: I, values: V) -> Result<Self, MaskError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
        V: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        let field_patterns: Vec<String> = fields
            .into_iter()
            .map(|f| f.as_ref().to_ascii_lowercase())
            .collect();
        let mut set = GlobSetBuilder::new();
        for pattern in &field_patterns {
            set.add(Glob::new(pattern).map_err(|e| MaskError::Field {
                pattern: pattern.clone(),
                reason: e.to_string(),
            })?);
        }
        let fields = set.build().map_err(|e| MaskError::Field {
            pattern: field_patterns.join(", "),
            reason: e.to_string(),
        })?;
        let mut configured = Vec::new();
        for pattern in values {
            let pattern = pattern.as_ref();
            configured.push((
                Regex::new(pattern).map_err(|e| MaskError::Value {
                    pattern: pattern.to_string(),
                    reason: e.to_string(),
                })?,
                "***",
            ));
        }
        let patterns = [
            (r"(?i)\bbearer\s+[a-z0-9\-._~+/]+=*", "Bearer ***"),
            (
                r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}",
                "***@***",
            ),
            (r"\b(?:\d[ \-]?){12,18}\d\b", "[card ***]"),
            (r"\b[A-Z]{2}\d{2}[A-Z0-9]{11,30}\b", "[account ***]"),
            // Phone numbers as people write them: grouped with separators (555-123-4567,
            // (555) 123 4567, +1 555.123.4567) or international with a leading `+`
            // (+44 20 7946 0958). A bare digit run is not taken for one (ids, amounts, dates);
            // 8 to 17 bare digits are masked as account numbers below.
            (
                r"(?:\+\d{1,3}[ .\-]?)?\(?\b\d{3}\)?[ .\-]\d{3}[ .\-]\d{4}\b",
                "[phone ***]",
            ),
            (r"\+\d{1,3}(?:[ .\-]?\d{2,4}){3,5}\b", "[phone ***]"),
            (r"\b\d{8,17}\b", "[account ***]"),
        ]
        .into_iter()
        .map(|(re, with)| {
            (
                Regex::new(re).expect("built-in mask patterns compile"),
                with,
            )
        })
        .chain(configured)
        .collect();
        Ok(Self {
            inner: Arc::new(Inner {
                field_patterns,
                fields,
                patterns,
            }),
        })
    }

    /// A masked copy of `value`.
    pub fn mask(&self, value: &serde_json::Value) -> serde_json::Value {
        match value {
            serde_json::Value::String(s) => serde_json::Value::String(self.mask_text(s)),
            serde_json::Value::Array(items) => {
                serde_json::Value::Array(items.iter().map(|v| self.mask(v)).collect())
            }
            serde_json::Value::Object(map) => serde_json::Value::Object(
                map.iter()
                    .map(|(k, v)| {
                        let masked = if self.inner.fields.is_match(k.to_ascii_lowercase()) {
                            serde_json::Value::String("***".into())
                        } else {
                            self.mask(v)
                        };
                        (k.clone(), masked)
                    })
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    /// `text` with every sensitive substring replaced.
    pub fn mask_text(&self, text: &str) -> String {
        let mut out = std::borrow::Cow::Borrowed(text);
        for (re, with) in &self.inner.patterns {
            if re.is_match(&out) {
                out = std::borrow::Cow::Owned(re.replace_all(&out, *with).into_owned());
            }
        }
        out.into_owned()
    }
}

impl Default for Masker {
    fn default() -> Self {
        Self::new(DEFAULT_SENSITIVE_FIELDS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn masks_patterns_and_fields() {
        let m = Masker::new(["customer_name"]);
        let v = json!({
            "text": "mail jane.doe@example.com or call +1 (555) 123-4567, card 4111 1111 1111 1111",
            "auth": "Bearer abc.def-ghi",
            "iban": "keep?",
            "customer_name": "Jane",
            "nested": [{"acct": "account 12345678901"}],
            "amount": 42
        });
        let out = m.mask(&v);
        let text = out["text"].as_str().unwrap();
        assert!(!text.contains("jane.doe"), "{text}");
        assert!(!text.contains("4111"), "{text}");
        assert!(!text.contains("555"), "{text}");
        assert_eq!(out["auth"], "Bearer ***");
        assert_eq!(out["customer_name"], "***");
        assert!(
            !out["nested"][0]["acct"]
                .as_str()
                .unwrap()
                .contains("12345678901")
        );
        assert_eq!(out["amount"], 42);
    }

    #[test]
    fn leaves_ordinary_text() {
        let m = Masker::default();
        assert_eq!(
            m.mask_text("category servicing, confidence 0.9"),
            "category servicing, confidence 0.9"
        );
        // Ids, dates and amounts with short digit runs are not phone numbers.
        for text in [
            "task cli-routed-12345 started",
            "complaint 3318297 on 2026-11-29 for $1400.00",
            "version 1.2.3, port 7070",
        ] {
            assert_eq!(m.mask_text(text), text);
        }
    }

    #[test]
    fn masks_phone_numbers_as_people_write_them() {
        let m = Masker::default();
        for phone in [
            "555-123-4567",
            "(555) 123-4567",
            "+1 555.123.4567",
            "+1 (555) 123-4567",
            "+44 20 7946 0958",
        ] {
            let masked = m.mask_text(&format!("call me at {phone} today"));
            assert_eq!(masked, "call me at [phone ***] today", "{phone}");
        }
    }

    #[test]
    fn field_names_are_matched_by_pattern_case_insensitively() {
        let m = Masker::default();
        let v = json!({
            "db_password": "hunter2",
            "GithubToken": "ghp_x",
            "x-api-key": "k",
            "AWS_SECRET_ACCESS_KEY": "s",
            "client_credentials": {"id": "a"},
            "input_tokens": 12,
            "passage": "the text",
            "tokenizer": "cl100k",
        });
        let masked = m.mask(&v);
        for key in [
            "db_password",
            "GithubToken",
            "x-api-key",
            "AWS_SECRET_ACCESS_KEY",
            "client_credentials",
        ] {
            assert_eq!(masked[key], json!("***"), "{key}");
        }
        assert_eq!(masked["input_tokens"], json!(12), "model usage counts stay");
        assert_eq!(masked["passage"], json!("the text"));
        assert_eq!(masked["tokenizer"], json!("cl100k"));
    }

    #[test]
    fn configured_patterns_add_to_the_built_in_ones_and_bad_ones_are_named() {
        let m = Masker::with_patterns(["customer_*"], [r"ACME-\d{4}"]).unwrap();
        let masked = m.mask(&json!({"customer_name": "Ann", "note": "ref ACME-1234 ok"}));
        assert_eq!(masked["customer_name"], json!("***"));
        assert_eq!(masked["note"], json!("ref *** ok"));
        let error = Masker::with_patterns(["a["], std::iter::empty::<&str>()).unwrap_err();
        assert!(error.to_string().contains("\"a[\""), "{error}");
        let error = Masker::with_patterns(std::iter::empty::<&str>(), ["("]).unwrap_err();
        assert!(error.to_string().contains("redact_values"), "{error}");
    }
}
