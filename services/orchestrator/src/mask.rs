//! Masking of sensitive values in everything the API, the HTTP admin routes and the CLI show.
//!
//! The store keeps values as given (flows need them); masking is applied on the way out.
//! Masked: e-mail addresses, phone numbers, card numbers (13 to 19 digits that pass the Luhn
//! check), numbers written as account numbers (`account 12345678`, `acct no: ...`) and
//! IBANs, bearer tokens, the value of every sensitive key written in text (`password=hunter2`,
//! `token: abc`, `"api_key": "..."`, `Authorization: Basic ...`: error messages quote them),
//! values matching configured regexes, and every value under a sensitive field name, at any
//! depth: names are matched case-insensitively against globs (`*password*` masks
//! `db_password` and `PasswordHash`), so the names people actually use are caught, not only
//! exact ones. Other numbers — ids, sizes, counts, amounts — are left as they are.

use std::sync::Arc;

use globset::{Glob, GlobSet, GlobSetBuilder};
use regex::Regex;

/// The field-name globs masked by default, whatever their value (matched against the
/// lowercased name). `*token` masks `access_token`, `refresh_token` and `github_token` but
/// not `input_tokens` (model usage counts); `*secret*` masks `client_secret`; `*cookie*`
/// masks `session_cookie` and `set-cookie`.
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
    "*privatekey*",
    "*pwd*",
    "*cookie*",
    "*cvv*",
    "cvc",
    "*session_id*",
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
    patterns: Vec<(Regex, Replace)>,
}

/// What a value pattern's match is replaced with.
#[derive(Debug, Clone, Copy)]
enum Replace {
    /// This text (with `$1`-style references to the match's groups).
    With(&'static str),
    /// `[card ***]` when the match's digits are 13 to 19 and pass the Luhn check; else the
    /// match as it is (an id, a size, a timestamp).
    Card,
}

/// The sensitive keys whose values are masked where text writes `key=value` or `key: value`
/// (the key may carry a prefix: `db_password=`, `X-Api-Key:`).
const SENSITIVE_KEYS: &str = "password|passwd|pwd|secret|token|api[_-]?key|apikey|\
     authorization|credentials?|private[_-]?key|cookie|cvv|cvc|session[_-]?id";

/// Whether the digits of `text` (separators ignored) are 13 to 19 and pass the Luhn check.
fn is_card_number(text: &str) -> bool {
    let digits: Vec<u32> = text.chars().filter_map(|c| c.to_digit(10)).collect();
    if !(13..=19).contains(&digits.len()) {
        return false;
    }
    let sum: u32 = digits
        .iter()
        .rev()
        .enumerate()
        .map(|(i, d)| {
            if i % 2 == 1 {
                let d = d * 2;
                if d > 9 { d - 9 } else { d }
            } else {
                *d
            }
        })
        .sum();
    sum.is_multiple_of(10)
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
                Replace::With("***"),
            ));
        }
        let key = format!(r#"(?i)\b([a-z0-9_\-]*(?:{SENSITIVE_KEYS}))(["']?\s*[:=]\s*"#);
        let double_quoted = format!(r#"{key}")[^"]*""#);
        let single_quoted = format!(r#"{key}')[^']*'"#);
        let bare = format!(r#"{key})(?:(?:bearer|basic|digest|token)\s+)?[^\s,;&"']+"#);
        let patterns = [
            // Keys first, so `Authorization: Bearer x` becomes `Authorization: ***` whole;
            // a quoted value keeps its quotes.
            (double_quoted.as_str(), Replace::With("$1$2***\"")),
            (single_quoted.as_str(), Replace::With("$1$2***'")),
            (bare.as_str(), Replace::With("$1$2***")),
            (
                r"(?i)\bbearer\s+[a-z0-9\-._~+/]+=*",
                Replace::With("Bearer ***"),
            ),
            (
                r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}",
                Replace::With("***@***"),
            ),
            (r"\b(?:\d[ \-]?){12,18}\d\b", Replace::Card),
            (
                r"(?i)\b(account|acct|a/c)(\s*(?:number|num|no\.?|#)?\s*[:#=]?\s*)\d(?:[\d \-]{4,32}\d)",
                Replace::With("$1$2[account ***]"),
            ),
            (
                r"\b[A-Z]{2}\d{2}[A-Z0-9]{11,30}\b",
                Replace::With("[account ***]"),
            ),
            // Phone numbers as people write them: grouped with separators (555-123-4567,
            // (555) 123 4567, +1 555.123.4567) or international with a leading `+`
            // (+44 20 7946 0958). A bare digit run is not taken for one (ids, amounts, dates,
            // sizes), nor for an account number unless the text says it is one.
            (
                r"(?:\+\d{1,3}[ .\-]?)?\(?\b\d{3}\)?[ .\-]\d{3}[ .\-]\d{4}\b",
                Replace::With("[phone ***]"),
            ),
            (
                r"\+\d{1,3}(?:[ .\-]?\d{2,4}){3,5}\b",
                Replace::With("[phone ***]"),
            ),
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
            if !re.is_match(&out) {
                continue;
            }
            let replaced = match with {
                Replace::With(with) => re.replace_all(&out, *with).into_owned(),
                Replace::Card => re
                    .replace_all(&out, |caps: &regex::Captures<'_>| {
                        if is_card_number(&caps[0]) {
                            "[card ***]".to_string()
                        } else {
                            caps[0].to_string()
                        }
                    })
                    .into_owned(),
            };
            out = std::borrow::Cow::Owned(replaced);
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

    #[test]
    fn new_default_fields_are_masked() {
        let m = Masker::default();
        let v = json!({
            "cvv": "123",
            "card_cvv2": "123",
            "pwd": "hunter2",
            "db_pwd": "hunter2",
            "session_cookie": "sid=abc",
            "Cookie": "a=b",
            "passwd": "x",
            "private_key": "-----BEGIN",
            "client_secret": "s3",
            "access_token": "at",
            "refresh_token": "rt",
            "session_id": "42",
            "input_tokens": 7,
            "cookbook": "stays",
        });
        let masked = m.mask(&v);
        for key in [
            "cvv",
            "card_cvv2",
            "pwd",
            "db_pwd",
            "session_cookie",
            "Cookie",
            "passwd",
            "private_key",
            "client_secret",
            "access_token",
            "refresh_token",
            "session_id",
        ] {
            assert_eq!(masked[key], json!("***"), "{key}");
        }
        assert_eq!(masked["input_tokens"], json!(7));
        assert_eq!(masked["cookbook"], json!("stays"));
    }

    #[test]
    fn secrets_written_in_text_are_masked() {
        let m = Masker::default();
        for (text, want) in [
            (
                "connect failed: password=hunter2 host=db",
                "connect failed: password=*** host=db",
            ),
            ("login with pwd: hunter2", "login with pwd: ***"),
            ("invalid token: abc.def", "invalid token: ***"),
            (
                "upstream said Authorization: Bearer eyJx.y.z rejected",
                "upstream said Authorization: *** rejected",
            ),
            ("Authorization: Basic dXNlcjpwdw==", "Authorization: ***"),
            (
                r#"body {"api_key": "sk-123", "n": 1}"#,
                r#"body {"api_key": "***", "n": 1}"#,
            ),
            ("X-Api-Key: k1, retry", "X-Api-Key: ***, retry"),
            ("cvv=123&amount=5", "cvv=***&amount=5"),
            (
                "set session_cookie=s%3Aabc; Path=/",
                "set session_cookie=***; Path=/",
            ),
            ("client_secret='abc def' next", "client_secret='***' next"),
            ("call with Bearer abc123", "call with Bearer ***"),
        ] {
            assert_eq!(m.mask_text(text), want, "{text}");
        }
        // Token counts and words that merely contain a key stay.
        for text in [
            "input_tokens: 12, output_tokens: 40",
            "the token expired",
            "tokenizer: cl100k",
        ] {
            assert_eq!(m.mask_text(text), text);
        }
    }

    #[test]
    fn ordinary_numbers_stay_and_card_numbers_need_the_luhn_check() {
        let m = Masker::default();
        for text in [
            "complaint 12345678 escalated",
            "complaint id 87654321: no agent",
            "payload of 16777216 bytes is over the limit of 4194304 bytes",
            "message_id 1764000000123 at 1764000000123456",
            "order 1234567812345678 shipped",
        ] {
            assert_eq!(m.mask_text(text), text);
        }
        for card in [
            "4111 1111 1111 1111",
            "4111-1111-1111-1111",
            "4111111111111111",
            "378282246310005",
        ] {
            assert_eq!(
                m.mask_text(&format!("paid with {card} today")),
                "paid with [card ***] today",
                "{card}"
            );
        }
        assert_eq!(
            m.mask_text("refund to account 12345678 today"),
            "refund to account [account ***] today"
        );
        assert_eq!(
            m.mask_text("acct no: 0012-3456-789"),
            "acct no: [account ***]"
        );
        assert_eq!(
            m.mask_text("iban DE89370400440532013000"),
            "iban [account ***]"
        );
        assert!(is_card_number("4111111111111111"));
        assert!(!is_card_number("4111111111111112"));
        assert!(!is_card_number("411111111111"));
    }
}
