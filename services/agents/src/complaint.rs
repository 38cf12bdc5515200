//! The complaint record, as in the CFPB export's CSV (original header names).

use std::path::Path;

use serde::{Deserialize, Serialize};

/// One consumer complaint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Complaint {
    /// The CFPB complaint number.
    #[serde(rename = "Complaint ID")]
    pub complaint_id: String,
    /// When the CFPB received it (ISO 8601).
    #[serde(rename = "Date received")]
    pub date_received: String,
    /// The product category.
    #[serde(rename = "Product")]
    pub product: String,
    /// The sub-product.
    #[serde(rename = "Sub-product")]
    pub sub_product: String,
    /// The issue the consumer chose: the label the classifier is scored against.
    #[serde(rename = "Issue")]
    pub issue: String,
    /// The sub-issue the consumer chose.
    #[serde(rename = "Sub-issue")]
    pub sub_issue: String,
    /// The consumer's own text, scrubbed by the CFPB.
    #[serde(rename = "Consumer complaint narrative")]
    pub narrative: String,
    /// The company complained about.
    #[serde(rename = "Company")]
    pub company: String,
    /// The consumer's two-letter state code (or `None`).
    #[serde(rename = "State")]
    pub state: String,
    /// The channel of submission.
    #[serde(rename = "Submitted via")]
    pub submitted_via: String,
}

/// Why complaints could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A record is malformed; names the line.
    #[error(
        "{path}: record at line {line} is malformed: {message}. Expected the CFPB export's columns (Complaint ID, Date received, Product, Sub-product, Issue, Sub-issue, Consumer complaint narrative, Company, State, Submitted via)"
    )]
    Record {
        /// The file.
        path: String,
        /// The 1-based line where the record starts.
        line: u64,
        /// What is wrong.
        message: String,
    },
    /// A record has an empty narrative, which cannot be triaged.
    #[error("{path}: complaint {id} (line {line}) has an empty narrative")]
    EmptyNarrative {
        /// The file.
        path: String,
        /// The complaint id.
        id: String,
        /// The line.
        line: u64,
    },
}

/// Loads every complaint of a CFPB CSV export (RFC 4180, header row, multi-line fields).
///
/// # Errors
/// [`LoadError`] naming the file and line of the first bad record.
pub fn load_csv(path: &Path) -> Result<Vec<Complaint>, LoadError> {
    let shown = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| LoadError::Io {
        path: shown.clone(),
        source,
    })?;
    let mut reader = csv::Reader::from_reader(file);
    let mut out = Vec::new();
    for record in reader.deserialize::<Complaint>() {
        let complaint = record.map_err(|e| LoadError::Record {
            path: shown.clone(),
            line: e.position().map_or(0, csv::Position::line),
            message: e.to_string(),
        })?;
        if complaint.narrative.trim().is_empty() {
            return Err(LoadError::EmptyNarrative {
                path: shown.clone(),
                id: complaint.complaint_id,
                line: reader.position().line(),
            });
        }
        out.push(complaint);
    }
    Ok(out)
}
