//! `docs/errors.md` lists exactly the ErrorInfo reasons `reach_rpc::errors::reason` defines,
//! each reason's value is its own name, and every reason is returned somewhere: a program
//! that branches on the documented reasons sees all of them and no others.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../..")
}

/// `(name, value)` of every `pub const NAME: &str = "VALUE";` in `pub mod reason { ... }`.
fn defined_reasons() -> Vec<(String, String)> {
    let source = std::fs::read_to_string(repo().join("sdk/rust/reach-rpc/src/errors.rs")).unwrap();
    let start = source
        .find("pub mod reason {")
        .expect("errors.rs has `pub mod reason`");
    let end = start + source[start..].find("\n}\n").expect("`mod reason` ends");
    source[start..end]
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("pub const ")?;
            let (name, value) = rest.split_once(": &str = ")?;
            let value = value.trim_end_matches(';').trim_matches('"');
            Some((name.to_string(), value.to_string()))
        })
        .collect()
}

/// The heading of `docs/errors.md`'s section on the A2A edge's reasons (a table, after every
/// Reach reason).
const A2A_SECTION: &str = "## A2A edge";

/// Every `### `REASON`` heading of `docs/errors.md` before its A2A section.
fn documented_reasons() -> BTreeSet<String> {
    std::fs::read_to_string(repo().join("docs/errors.md"))
        .unwrap()
        .lines()
        .take_while(|line| !line.starts_with(A2A_SECTION))
        .filter_map(|line| {
            let name = line.strip_prefix("### `")?.strip_suffix('`')?;
            Some(name.to_string())
        })
        .collect()
}

/// The Rust sources of every crate that returns statuses (tests excluded).
fn sources(dir: &Path, found: &mut Vec<(PathBuf, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() {
            if !matches!(name.as_ref(), "tests" | "target" | "generated") {
                sources(&path, found);
            }
        } else if name.ends_with(".rs") {
            found.push((path.clone(), std::fs::read_to_string(&path).unwrap()));
        }
    }
}

#[test]
fn the_error_page_lists_every_reason_and_only_those() {
    let defined = defined_reasons();
    assert!(defined.len() >= 19, "parsed too few reasons: {defined:?}");
    for (name, value) in &defined {
        assert_eq!(name, value, "reason {name} must be spelled as its value");
    }
    let defined: BTreeSet<String> = defined.into_iter().map(|(name, _)| name).collect();
    let documented = documented_reasons();
    let undocumented: Vec<_> = defined.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&defined).collect();
    assert!(
        undocumented.is_empty() && stale.is_empty(),
        "docs/errors.md is out of step with reach_rpc::errors::reason: add a `### `NAME`` \
         section for {undocumented:?}; remove the sections for {stale:?}"
    );
}

#[test]
fn every_reason_is_returned_by_some_service() {
    let mut files = Vec::new();
    for dir in ["services", "sdk/rust"] {
        sources(&repo().join(dir), &mut files);
    }
    let errors_rs = repo().join("sdk/rust/reach-rpc/src/errors.rs");
    for (name, _) in defined_reasons() {
        let needle = format!("reason::{name}");
        let used = files.iter().any(|(path, text)| {
            // `errors.rs` defines the reasons; a use must be elsewhere (or in its code below
            // the module, which has none).
            path != &errors_rs
                && text.match_indices(&needle).any(|(at, _)| {
                    // Not a prefix of a longer name (`INSTANCE_DRAINING` vs `..._DRAINED`).
                    !text[at + needle.len()..]
                        .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
                })
        });
        assert!(
            used,
            "reason {name} is defined and documented but no service returns it: remove it"
        );
    }
}

/// The reasons the A2A edge answers with: every `=> "REASON"` of `A2aError::reason`.
fn a2a_reasons() -> BTreeSet<String> {
    let source = std::fs::read_to_string(repo().join("services/edge/src/a2a/error.rs")).unwrap();
    let start = source
        .find("pub fn reason(&self)")
        .expect("A2aError has `fn reason`");
    let end = start + source[start..].find("\n    }\n").expect("`fn reason` ends");
    source[start..end]
        .lines()
        .filter_map(|line| {
            let quoted = line.split("=> \"").nth(1)?;
            Some(quoted.split('"').next()?.to_string())
        })
        .collect()
}

#[test]
fn the_error_page_lists_every_a2a_reason_and_only_those() {
    let page = std::fs::read_to_string(repo().join("docs/errors.md")).unwrap();
    let section = &page[page
        .find(A2A_SECTION)
        .expect("errors.md has the A2A section")..];
    let documented: BTreeSet<String> = section
        .lines()
        .filter_map(|line| {
            let name = line.strip_prefix("| `")?.split('`').next()?;
            Some(name.to_string())
        })
        .collect();
    let returned = a2a_reasons();
    assert!(
        returned.len() >= 10,
        "parsed too few A2A reasons: {returned:?}"
    );
    assert_eq!(
        documented, returned,
        "docs/errors.md's A2A table is out of step with A2aError::reason"
    );
}
