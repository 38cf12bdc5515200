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

/// Loads every complaint of a CFPB CSV export file (RFC 4180, header row, multi-line
/// fields).
///
/// # Errors
/// [`LoadError`] naming the file and line of the first bad record.
pub fn load_csv(path: &Path) -> Result<Vec<Complaint>, LoadError> {
    let shown = path.display().to_string();
    let io = |source| LoadError::Io {
        path: shown.clone(),
        source,
    };
    if path.is_dir() {
        return Err(io(std::io::Error::other(
            "it is a directory; pass a CSV file",
        )));
    }
    let text = std::fs::read_to_string(path).map_err(io)?;
    parse_csv(&text, &shown)
}

/// Parses complaints from CSV text; `name` names the source in errors. Every record needs a
/// unique, non-empty `Complaint ID` and a non-empty narrative.
///
/// # Errors
/// [`LoadError`] naming the source and line of the first bad record.
pub fn parse_csv(text: &str, name: &str) -> Result<Vec<Complaint>, LoadError> {
    let mut reader = csv::Reader::from_reader(text.as_bytes());
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut records = reader.deserialize::<Complaint>();
    while let Some(record) = records.next() {
        let line = records.reader().position().line();
        let complaint = record.map_err(|e| LoadError::Record {
            path: name.to_string(),
            line: e.position().map_or(line, csv::Position::line),
            message: match e.kind() {
                csv::ErrorKind::UnequalLengths { expected_len, len, .. } => format!(
                    "it has {len} fields where the header has {expected_len} (an unterminated quote or a stray comma?)"
                ),
                _ => e.to_string(),
            },
        })?;
        if complaint.complaint_id.trim().is_empty() {
            return Err(LoadError::Record {
                path: name.to_string(),
                line,
                message: "its Complaint ID is empty".into(),
            });
        }
        if !seen.insert(complaint.complaint_id.clone()) {
            return Err(LoadError::Record {
                path: name.to_string(),
                line,
                message: format!("Complaint ID {} appears twice", complaint.complaint_id),
            });
        }
        if complaint.narrative.trim().is_empty() {
            return Err(LoadError::EmptyNarrative {
                path: name.to_string(),
                id: complaint.complaint_id,
                line,
            });
        }
        out.push(complaint);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "Complaint ID,Date received,Product,Sub-product,Issue,Sub-issue,Consumer complaint narrative,Company,State,Submitted via\n";

    #[test]
    fn the_sample_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/data/cfpb-complaints-sample.csv");
        assert_eq!(load_csv(&path).unwrap().len(), 87);
    }

    #[test]
    fn bad_records_are_located() {
        let dup = format!("{HEADER}1,d,p,s,i,si,text,c,TX,Web\n1,d,p,s,i,si,more,c,TX,Web\n");
        let err = parse_csv(&dup, "x.csv").unwrap_err().to_string();
        assert!(
            err.contains("x.csv") && err.contains("appears twice"),
            "{err}"
        );
        let short = format!("{HEADER}1,d,p\n");
        let err = parse_csv(&short, "x.csv").unwrap_err().to_string();
        assert!(err.contains("3 fields"), "{err}");
        let empty = format!("{HEADER}1,d,p,s,i,si,\"  \",c,TX,Web\n");
        assert!(matches!(
            parse_csv(&empty, "x.csv"),
            Err(LoadError::EmptyNarrative { .. })
        ));
        let dir = load_csv(Path::new(env!("CARGO_MANIFEST_DIR")))
            .unwrap_err()
            .to_string();
        assert!(dir.contains("directory"), "{dir}");
    }
}
