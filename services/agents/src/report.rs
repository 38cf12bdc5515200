//! The complaint report's data work: read a CSV into a table, aggregate a column by group,
//! write Markdown — the bodies of the report agent's tools `read_csv`, `aggregate` and
//! `write_report`.
//!
//! Every path a model names is resolved inside a [`Workspace`] root: a model is not trusted
//! with the file system, so `..`, absolute paths outside the root and symlinks that leave it
//! are refused, and what is read or written is bounded.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The largest CSV file read (bytes).
pub const MAX_CSV_BYTES: u64 = 64 << 20;
/// The most rows one read keeps.
pub const MAX_ROWS: usize = 100_000;
/// The most columns a CSV may have.
pub const MAX_COLUMNS: usize = 1024;
/// The largest report written (bytes).
pub const MAX_REPORT_BYTES: usize = 1 << 20;

/// Why a report tool could not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The path leaves the workspace or is malformed.
    #[error("path {path:?} is outside the workspace {root}: name a file inside it, relative to it")]
    OutsideWorkspace {
        /// The path as given.
        path: String,
        /// The workspace root.
        root: String,
    },
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a CSV with a header row, or is too large.
    #[error("{path}: {message}")]
    Csv {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// No table of that name was read in this task.
    #[error("no table {0:?}: call read_csv first and pass the table it returns")]
    NoTable(String),
    /// A column the call named is not in the table.
    #[error("no column {column:?}; the table's columns are {columns:?}")]
    NoColumn {
        /// The column asked for.
        column: String,
        /// The columns there are.
        columns: Vec<String>,
    },
    /// `sum` of a column with a value that is not a number.
    #[error("column {column:?} row {row}: {value:?} is not a number, so it cannot be summed")]
    NotANumber {
        /// The column.
        column: String,
        /// The row (1-based, after the header).
        row: usize,
        /// The value.
        value: String,
    },
    /// The report is larger than [`MAX_REPORT_BYTES`].
    #[error("the report is {0} bytes; at most {MAX_REPORT_BYTES} bytes are written")]
    ReportTooLarge(usize),
}

/// The directory the report tools may read from and write to.
#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
}

impl Workspace {
    /// A workspace rooted at `root` (made absolute).
    ///
    /// # Errors
    /// [`ReportError::Io`] when `root` does not exist.
    pub fn new(root: impl AsRef<Path>) -> Result<Self, ReportError> {
        let root = root.as_ref();
        let root = root.canonicalize().map_err(|source| ReportError::Io {
            path: root.display().to_string(),
            source,
        })?;
        Ok(Self { root })
    }

    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `path` inside the root: relative paths are joined to it; absolute ones must lie in
    /// it; `..` is refused; an existing file (or the parent of a new one) must resolve —
    /// symlinks followed — inside it; a dangling symlink is refused.
    ///
    /// # Errors
    /// [`ReportError::OutsideWorkspace`].
    pub fn resolve(&self, path: &str) -> Result<PathBuf, ReportError> {
        let outside = || ReportError::OutsideWorkspace {
            path: path.to_string(),
            root: self.root.display().to_string(),
        };
        let given = Path::new(path.trim());
        if path.trim().is_empty()
            || given
                .components()
                .any(|c| matches!(c, Component::ParentDir | Component::Prefix(_)))
        {
            return Err(outside());
        }
        let joined = if given.is_absolute() {
            given.to_path_buf()
        } else {
            self.root.join(given)
        };
        // The deepest part that exists — a symlink counts, even a dangling one, so writing
        // through it cannot create a file elsewhere — must resolve inside the root.
        let mut existing = joined.as_path();
        while existing.symlink_metadata().is_err() {
            existing = existing.parent().ok_or_else(outside)?;
        }
        let real = existing.canonicalize().map_err(|_| outside())?;
        if !real.starts_with(&self.root) {
            return Err(outside());
        }
        Ok(joined)
    }
}

/// A CSV read into memory: the header and the rows, every value a string.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// The header row.
    pub columns: Vec<String>,
    /// The rows, each as long as `columns`.
    pub rows: Vec<Vec<String>>,
    /// Whether rows were left unread because of `max_rows`.
    pub truncated: bool,
}

impl Table {
    fn column(&self, name: &str) -> Result<usize, ReportError> {
        let wanted = name.trim();
        self.columns
            .iter()
            .position(|c| c == wanted)
            .or_else(|| {
                self.columns
                    .iter()
                    .position(|c| c.eq_ignore_ascii_case(wanted))
            })
            .ok_or_else(|| ReportError::NoColumn {
                column: name.to_string(),
                columns: self.columns.clone(),
            })
    }
}

/// Reads at most `max_rows` rows (capped at [`MAX_ROWS`]) of the CSV at `path` (inside the
/// workspace), with a header row.
///
/// # Errors
/// [`ReportError::OutsideWorkspace`], [`ReportError::Io`], [`ReportError::Csv`] (no header,
/// a malformed row, larger than [`MAX_CSV_BYTES`]).
pub fn read_csv(workspace: &Workspace, path: &str, max_rows: usize) -> Result<Table, ReportError> {
    let file = workspace.resolve(path)?;
    let shown = file.display().to_string();
    let io = |source| ReportError::Io {
        path: shown.clone(),
        source,
    };
    let metadata = std::fs::metadata(&file).map_err(io)?;
    if !metadata.is_file() {
        // A FIFO or a device would block or never end: only regular files are read.
        return Err(ReportError::Csv {
            path: shown,
            message: "not a regular file".into(),
        });
    }
    let size = metadata.len();
    if size > MAX_CSV_BYTES {
        return Err(ReportError::Csv {
            path: shown,
            message: format!("{size} bytes; at most {MAX_CSV_BYTES} bytes are read"),
        });
    }
    let mut reader = csv::Reader::from_path(&file).map_err(|e| ReportError::Csv {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    let columns: Vec<String> = reader
        .headers()
        .map_err(|e| ReportError::Csv {
            path: shown.clone(),
            message: e.to_string(),
        })?
        .iter()
        .map(str::to_string)
        .collect();
    if columns.is_empty() {
        return Err(ReportError::Csv {
            path: shown,
            message: "no header row".into(),
        });
    }
    if columns.len() > MAX_COLUMNS {
        return Err(ReportError::Csv {
            path: shown,
            message: format!("{} columns; at most {MAX_COLUMNS} are read", columns.len()),
        });
    }
    let limit = max_rows.min(MAX_ROWS);
    let mut rows = Vec::new();
    let mut truncated = false;
    for record in reader.records() {
        let record = record.map_err(|e| ReportError::Csv {
            path: shown.clone(),
            message: e.to_string(),
        })?;
        if rows.len() == limit {
            truncated = true;
            break;
        }
        rows.push(record.iter().map(str::to_string).collect());
    }
    Ok(Table {
        columns,
        rows,
        truncated,
    })
}

/// What [`aggregate`] computes per group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Aggregation {
    /// Rows per group.
    Count,
    /// The sum of a numeric column.
    Sum,
    /// The smallest value of a column (numeric when every value is a number, else text).
    Min,
    /// The largest value of a column.
    Max,
}

/// One group of an aggregation: its key and value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Group {
    /// The group's value of the `group_by` column (`"(all)"` without grouping; `"(blank)"`
    /// for an empty value).
    pub key: String,
    /// The count, sum, min or max.
    pub value: serde_json::Value,
}

/// Groups `table` by `group_by` (or not at all) and computes `op` over `column` (`count`
/// needs none). Counts and sums are sorted largest first, then by key; min and max by key.
///
/// # Errors
/// [`ReportError::NoColumn`]; [`ReportError::NotANumber`] for `sum` over text.
pub fn aggregate(
    table: &Table,
    group_by: Option<&str>,
    op: Aggregation,
    column: Option<&str>,
) -> Result<Vec<Group>, ReportError> {
    let key_index = group_by.map(|c| table.column(c)).transpose()?;
    let value_index = match (op, column) {
        (Aggregation::Count, None) => None,
        (_, Some(c)) => Some(table.column(c)?),
        (_, None) => {
            return Err(ReportError::NoColumn {
                column: String::new(),
                columns: table.columns.clone(),
            });
        }
    };
    let mut groups: BTreeMap<String, Vec<(usize, &str)>> = BTreeMap::new();
    for (i, row) in table.rows.iter().enumerate() {
        let key = match key_index {
            None => "(all)".to_string(),
            Some(k) => match row[k].trim() {
                "" => "(blank)".to_string(),
                v => v.to_string(),
            },
        };
        let value = value_index.map(|v| row[v].trim()).unwrap_or("");
        groups.entry(key).or_default().push((i + 1, value));
    }
    let column_name = || column.unwrap_or_default().to_string();
    let mut out = Vec::with_capacity(groups.len());
    for (key, values) in groups {
        let value = match op {
            Aggregation::Count => serde_json::json!(values.len()),
            Aggregation::Sum => {
                let mut sum = 0.0;
                for (row, v) in &values {
                    if v.is_empty() {
                        continue;
                    }
                    sum += v.parse::<f64>().map_err(|_| ReportError::NotANumber {
                        column: column_name(),
                        row: *row,
                        value: v.to_string(),
                    })?;
                }
                number(sum)
            }
            Aggregation::Min | Aggregation::Max => extreme(&values, op == Aggregation::Max),
        };
        out.push(Group { key, value });
    }
    if matches!(op, Aggregation::Count | Aggregation::Sum) {
        out.sort_by(|a, b| {
            let (x, y) = (a.value.as_f64(), b.value.as_f64());
            y.partial_cmp(&x)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then_with(|| a.key.cmp(&b.key))
        });
    }
    Ok(out)
}

/// The smallest or largest non-empty value: numeric when all parse as numbers, else text.
fn extreme(values: &[(usize, &str)], largest: bool) -> serde_json::Value {
    let present: Vec<&str> = values
        .iter()
        .map(|(_, v)| *v)
        .filter(|v| !v.is_empty())
        .collect();
    let numbers: Option<Vec<f64>> = present.iter().map(|v| v.parse::<f64>().ok()).collect();
    match numbers {
        Some(ns) if !ns.is_empty() => {
            let pick = ns
                .into_iter()
                .reduce(|a, b| if (b > a) == largest && b != a { b } else { a });
            pick.map(number).unwrap_or(serde_json::Value::Null)
        }
        _ => {
            let pick = if largest {
                present.iter().max()
            } else {
                present.iter().min()
            };
            pick.map(|v| serde_json::Value::String(v.to_string()))
                .unwrap_or(serde_json::Value::Null)
        }
    }
}

/// An integer when `x` is whole, else a float.
fn number(x: f64) -> serde_json::Value {
    if x.fract() == 0.0 && x.abs() < 9.0e15 {
        serde_json::json!(x as i64)
    } else {
        serde_json::json!(x)
    }
}

/// Writes `markdown` to `path` inside the workspace (creating parent directories) and
/// returns the absolute path and the bytes written.
///
/// # Errors
/// [`ReportError::OutsideWorkspace`], [`ReportError::ReportTooLarge`], [`ReportError::Io`].
pub fn write_report(
    workspace: &Workspace,
    path: &str,
    markdown: &str,
) -> Result<(PathBuf, usize), ReportError> {
    if markdown.len() > MAX_REPORT_BYTES {
        return Err(ReportError::ReportTooLarge(markdown.len()));
    }
    let file = workspace.resolve(path)?;
    let io = |source| ReportError::Io {
        path: file.display().to_string(),
        source,
    };
    if let Some(parent) = file.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    // Only a regular file is replaced: writing into a FIFO would block until a reader came.
    if std::fs::symlink_metadata(&file).is_ok_and(|m| !m.is_file()) {
        return Err(io(std::io::Error::other(
            "exists and is not a regular file; name another path",
        )));
    }
    std::fs::write(&file, markdown).map_err(io)?;
    Ok((file, markdown.len()))
}

/// A Markdown table of groups under a heading: `| key | value |`, with `|` in keys escaped.
pub fn markdown_table(heading: &str, key: &str, value: &str, groups: &[Group]) -> String {
    let mut out = format!("## {heading}\n\n| {key} | {value} |\n|---|---:|\n");
    for g in groups {
        let shown = match &g.value {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        out.push_str(&format!("| {} | {shown} |\n", g.key.replace('|', "\\|")));
    }
    out.push('\n');
    out
}

/// The complaint report as Markdown: the total, the date range, and complaints by issue,
/// by company and by state (each group list as [`aggregate`] returns it).
pub fn complaint_report(
    source: &str,
    total: usize,
    first: &str,
    last: &str,
    by_issue: &[Group],
    by_company: &[Group],
    by_state: &[Group],
) -> String {
    let mut out = format!(
        "# Complaint report\n\n{total} complaints from `{source}`, received {first} to {last}.\n\n"
    );
    out.push_str(&markdown_table("By issue", "Issue", "Complaints", by_issue));
    out.push_str(&markdown_table(
        "By company",
        "Company",
        "Complaints",
        by_company,
    ));
    out.push_str(&markdown_table("By state", "State", "Complaints", by_state));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Table {
        Table {
            columns: vec!["Issue".into(), "State".into(), "Amount".into()],
            rows: vec![
                vec!["a".into(), "CA".into(), "2".into()],
                vec!["b".into(), "".into(), "3.5".into()],
                vec!["a".into(), "NY".into(), "1".into()],
            ],
            truncated: false,
        }
    }

    #[test]
    fn aggregates_count_sum_min_max() {
        let t = table();
        let by_issue = aggregate(&t, Some("issue"), Aggregation::Count, None).unwrap();
        assert_eq!(
            by_issue,
            [
                Group {
                    key: "a".into(),
                    value: serde_json::json!(2)
                },
                Group {
                    key: "b".into(),
                    value: serde_json::json!(1)
                }
            ]
        );
        let blank = aggregate(&t, Some("State"), Aggregation::Count, None).unwrap();
        assert!(blank.iter().any(|g| g.key == "(blank)"));
        let sum = aggregate(&t, None, Aggregation::Sum, Some("Amount")).unwrap();
        assert_eq!(sum[0].value, serde_json::json!(6.5));
        let max = aggregate(&t, None, Aggregation::Max, Some("Amount")).unwrap();
        assert_eq!(max[0].value, serde_json::json!(3.5));
        let min = aggregate(&t, None, Aggregation::Min, Some("State")).unwrap();
        assert_eq!(min[0].value, serde_json::json!("CA"));
        assert!(matches!(
            aggregate(&t, None, Aggregation::Sum, Some("State")),
            Err(ReportError::NotANumber { row: 1, .. })
        ));
        assert!(matches!(
            aggregate(&t, Some("nope"), Aggregation::Count, None),
            Err(ReportError::NoColumn { .. })
        ));
    }

    #[test]
    fn paths_stay_inside_the_workspace() {
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace::new(dir.path()).unwrap();
        assert!(ws.resolve("report.md").is_ok());
        assert!(ws.resolve("out/report.md").is_ok());
        for bad in ["../x", "/etc/passwd", "a/../../x", "", "  "] {
            assert!(
                matches!(ws.resolve(bad), Err(ReportError::OutsideWorkspace { .. })),
                "{bad}"
            );
        }
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/etc", dir.path().join("escape")).unwrap();
            assert!(ws.resolve("escape/passwd").is_err());
            // A dangling link would let a write create its target outside.
            let outside = tempfile::tempdir().unwrap();
            std::os::unix::fs::symlink(outside.path().join("new.md"), dir.path().join("d.md"))
                .unwrap();
            assert!(matches!(
                ws.resolve("d.md"),
                Err(ReportError::OutsideWorkspace { .. })
            ));
            assert!(write_report(&ws, "d.md", "x").is_err());
            assert!(!outside.path().join("new.md").exists());
        }
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        assert!(
            matches!(read_csv(&ws, "sub", 10), Err(ReportError::Csv { message, .. }) if message == "not a regular file")
        );
        assert!(matches!(
            write_report(&ws, "sub", "# hi\n"),
            Err(ReportError::Io { .. })
        ));
        let (path, n) = write_report(&ws, "out/r.md", "# hi\n").unwrap();
        assert_eq!(n, 5);
        assert!(path.starts_with(ws.root()));
    }
}
