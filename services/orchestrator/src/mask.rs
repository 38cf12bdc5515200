//! Masking of sensitive values in everything the API, the HTTP admin routes and the CLI show.
//!
//! The store keeps values as given (flows need them); masking is applied on the way out.
//! Masked: e-mail addresses, phone numbers, card numbers (13 to 19 digits), account numbers
//! (IBANs and 8 to 17 digit runs), bearer tokens, and every value under a configured field
//! name (matched case-insensitively, at any depth).

use std::collections::HashSet;
use std::sync::Arc;

use regex::Regex;

/// The field names masked by default, whatever their value.
pub const DEFAULT_SENSITIVE_FIELDS: &[&str] = &[
    "password",
    "secret",
    "token",
    "api_key",
    "apikey",
    "authorization",
    "ssn",
    "card_number",
    "account_number",
    "iban",
];

/// Masks sensitive values in JSON. Cheap to clone.
#[derive(Clone)]
pub struct Masker {
    inner: Arc<Inner>,
}

struct Inner {
    fields: HashSet<String>,
    patterns: Vec<(Regex, &'static str)>,
}

impl std::fmt::Debug for Masker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Masker")
            .field("fields", &self.inner.fields)
            .finish_non_exhaustive()
    }
}

impl Masker {
    /// A masker for the built-in patterns plus `fields` (case-insensitive field names).
    pub fn new<I, S>(fields: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
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
        .collect();
        Self {
            inner: Arc::new(Inner {
                fields: fields
                    .into_iter()
                    .map(|f| f.as_ref().to_ascii_lowercase())
                    .collect(),
                patterns,
            }),
        }
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
                        let masked = if self.inner.fields.contains(&k.to_ascii_lowercase()) {
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
}
