//! Every crate's `lib.rs` opens with a "# Layout" section naming each of its modules: the
//! section must list exactly the modules the crate declares, so the map a reader starts from
//! is never stale.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `src/lib.rs` of the workspace's crates.
fn crate_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for group in ["sdk/rust", "services"] {
        for entry in std::fs::read_dir(repo().join(group)).unwrap() {
            let lib = entry.unwrap().path().join("src/lib.rs");
            if lib.is_file() {
                roots.push(lib);
            }
        }
    }
    roots.push(repo().join("tests/src/lib.rs"));
    roots
}

/// The modules `lib.rs` declares at its top level (`pub mod name;`, `mod name;` or an inline
/// `pub mod name {`), its unit tests aside.
fn declared(source: &str) -> BTreeSet<String> {
    source
        .lines()
        .filter_map(|line| {
            let rest = line
                .strip_prefix("pub mod ")
                .or(line.strip_prefix("mod "))?;
            let name = rest.trim_end_matches(['{', ';', ' ']);
            (name != "tests").then(|| name.to_string())
        })
        .collect()
}

/// The modules the `# Layout` section's bullets start with (`//! - [`name`]` or
/// `//! - [`name`](mod@name)`; bullets naming an item such as a constant are skipped); `None`
/// when the crate has no such section.
fn listed(source: &str) -> Option<BTreeSet<String>> {
    let start = source.find("//! # Layout")?;
    let section = source[start..]
        .lines()
        .skip(1)
        .take_while(|line| line.starts_with("//!") && !line.starts_with("//! #"));
    Some(
        section
            .filter_map(|line| {
                let rest = line.strip_prefix("//! - [`")?;
                let name = rest.split('`').next()?;
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                    .then(|| name.to_string())
            })
            .collect(),
    )
}

#[test]
fn each_layout_section_lists_exactly_the_crates_modules() {
    let mut checked = 0;
    for root in crate_roots() {
        let source = std::fs::read_to_string(&root).unwrap();
        let modules = declared(&source);
        let Some(listed) = listed(&source) else {
            assert!(
                modules.is_empty(),
                "{} declares modules {modules:?} but has no `//! # Layout` section naming them",
                root.display()
            );
            continue;
        };
        checked += 1;
        let unlisted: Vec<_> = modules.difference(&listed).collect();
        let stale: Vec<_> = listed.difference(&modules).collect();
        assert!(
            unlisted.is_empty() && stale.is_empty(),
            "{}: the Layout section is out of step with the modules: add {unlisted:?}, \
             remove {stale:?}",
            root.display()
        );
    }
    assert!(checked >= 8, "found only {checked} Layout sections");
}
