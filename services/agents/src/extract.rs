//! Key fields from a complaint: the company, the state and the dollar amounts.
//!
//! CFPB narratives write amounts as `{$1234.56}` after scrubbing; free-typed `$1,234` forms
//! are recognised too.

use std::sync::LazyLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

/// Fields extracted from one complaint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyFields {
    /// The company the complaint names (from the record, or found in the text).
    pub company: Option<String>,
    /// The two-letter state code, when known.
    pub state: Option<String>,
    /// Dollar amounts mentioned, in order, in US dollars.
    pub amounts_usd: Vec<f64>,
    /// The largest amount mentioned, in US dollars.
    pub max_amount_usd: Option<f64>,
}

static AMOUNT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\{?\$\s?([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(\.[0-9]{1,2})?\}?")
        .expect("amount regex")
});

/// Servicers and lenders that narratives name, for complaints whose record lacks a company.
const KNOWN_COMPANIES: &[(&str, &str)] = &[
    ("mohela", "MOHELA"),
    ("nelnet", "Nelnet, Inc."),
    ("navient", "Navient"),
    ("sallie mae", "SLM CORPORATION"),
    ("edfinancial", "EdFinancial Services"),
    ("aidvantage", "Maximus Federal Services, Inc."),
    ("maximus", "Maximus Federal Services, Inc."),
    ("climb credit", "Climb Credit Inc."),
    ("mpower", "MPOWER Financing"),
];

/// Extracts the key fields. `company` and `state` are the record's values, used when present
/// (`None` and empty count as absent).
pub fn extract(narrative: &str, company: &str, state: &str) -> KeyFields {
    let amounts_usd: Vec<f64> = AMOUNT
        .captures_iter(narrative)
        .filter_map(|c| {
            let whole = c.get(1)?.as_str().replace(',', "");
            let cents = c.get(2).map_or("", |m| m.as_str());
            format!("{whole}{cents}").parse::<f64>().ok()
        })
        .collect();
    let max_amount_usd = amounts_usd
        .iter()
        .copied()
        .fold(None, |m: Option<f64>, a| Some(m.map_or(a, |m| m.max(a))));
    let company = present(company).map(str::to_string).or_else(|| {
        let lower = narrative.to_lowercase();
        KNOWN_COMPANIES
            .iter()
            .find(|(needle, _)| lower.contains(needle))
            .map(|(_, name)| (*name).to_string())
    });
    let state = present(state)
        .filter(|s| s.len() == 2 && s.bytes().all(|b| b.is_ascii_uppercase()))
        .map(str::to_string);
    KeyFields {
        company,
        state,
        amounts_usd,
        max_amount_usd,
    }
}

fn present(value: &str) -> Option<&str> {
    let value = value.trim();
    (!value.is_empty() && value != "None").then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_scrubbed_and_typed_amounts() {
        let f = extract("I paid {$64000.00} and then $1,250 and {$12.5}", "", "None");
        assert_eq!(f.amounts_usd, vec![64000.0, 1250.0, 12.5]);
        assert_eq!(f.max_amount_usd, Some(64000.0));
        assert_eq!(f.state, None);
    }

    #[test]
    fn falls_back_to_companies_named_in_the_text() {
        let f = extract("My servicer Nelnet lost my payment", "", "TX");
        assert_eq!(f.company.as_deref(), Some("Nelnet, Inc."));
        assert_eq!(f.state.as_deref(), Some("TX"));
    }
}
