//! Every crate's `lib.rs` opens with a "# Layout" section naming each of its modules: the
//! section must list exactly the modules the crate declares, so the map a reader starts from
//! is never stale.

use std::collections::{BTreeMap, BTreeSet};
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

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// The module path of `file` under `src` (`engine/decide.rs` → `["engine", "decide"]`;
/// `lib.rs`, `main.rs` and `mod.rs` stand for their directory).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut path: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        path.last().map(String::as_str),
        Some("lib" | "main" | "mod")
    ) {
        path.pop();
    }
    path
}

/// `source` without its unit tests (a `#[cfg(test)] mod` and everything after it) and
/// without `//` comments (doc links are not imports).
fn code_of(source: &str) -> String {
    let code = match source.find("#[cfg(test)]\nmod ") {
        Some(at) => &source[..at],
        None => source,
    };
    code.lines()
        .map(|line| line.split_once("//").map_or(line, |(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module paths `code` (of the module at `path`) refers to:
/// `use crate::a::...`, `use crate::{a, b}`, `use super::a` and inline `crate::a::` paths,
/// each as written (resolved against the crate's modules by the caller).
fn references(code: &str, path: &[String]) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let split = |rest: &str| -> Vec<String> {
        rest.split("::")
            .map(|s| {
                s.chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect()
            })
            .take_while(|s: &String| !s.is_empty())
            .collect()
    };
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                found.push(split(item.trim()));
            }
        } else {
            found.push(split(rest));
        }
    }
    // `super` of `a/b.rs` (path `a::b`) is `a`; of `a/mod.rs` (path `a`) the crate root.
    let parent = &path[..path.len().saturating_sub(1)];
    for (at, _) in code.match_indices("use super::") {
        let rest = &code[at + "use super::".len()..];
        let base = parent.to_vec();
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                let mut full = base.clone();
                full.extend(split(item.trim()));
                found.push(full);
            }
        } else {
            let mut full = base;
            full.extend(split(rest));
            found.push(full);
        }
    }
    found
}

/// A cycle among `edges` (module → modules it uses), as the modules on it, if any.
fn find_cycle(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    fn visit(
        node: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        on_path: &mut Vec<Vec<String>>,
        done: &mut BTreeSet<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        if let Some(at) = on_path.iter().position(|n| n == node) {
            let mut cycle = on_path[at..].to_vec();
            cycle.push(node.clone());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        on_path.push(node.clone());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, on_path, done) {
                return Some(cycle);
            }
        }
        on_path.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|node| visit(node, edges, &mut Vec::new(), &mut done))
}

/// No module of a crate uses one that uses it back, directly or around a circle — at the
/// crate's top level, and among the children of each directory module — so each module can
/// be read knowing only the ones below it. A parent and its own children are exempt (a
/// directory module re-exports and shares vocabulary with its files).
#[test]
fn no_module_uses_a_module_that_uses_it_back() {
    let mut checked = 0;
    let mut circles = BTreeSet::new();
    for root in crate_roots() {
        let src = root.parent().unwrap().to_path_buf();
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_path(&src, f)).collect();
        for depth in [1, 2] {
            let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
            for file in &files {
                let path = module_path(&src, file);
                if path.is_empty() {
                    continue;
                }
                let code = code_of(&std::fs::read_to_string(file).unwrap());
                for reference in references(&code, &path) {
                    let Some(target) = (1..=reference.len())
                        .rev()
                        .map(|k| reference[..k].to_vec())
                        .find(|prefix| modules.contains(prefix))
                    else {
                        continue;
                    };
                    let (from, to) = (
                        path[..path.len().min(depth)].to_vec(),
                        target[..target.len().min(depth)].to_vec(),
                    );
                    let related = from.starts_with(&to) || to.starts_with(&from);
                    if !related {
                        edges.entry(from).or_default().insert(to);
                    }
                }
            }
            if let Some(cycle) = find_cycle(&edges) {
                let names: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
                circles.insert(format!("{}: {}", src.display(), names.join(" → ")));
            }
        }
        checked += 1;
    }
    assert!(checked >= 8, "checked only {checked} crates");
    assert!(
        circles.is_empty(),
        "modules use each other in a circle (move what both need into a module of its own, \
         below both):\n{}",
        circles.into_iter().collect::<Vec<_>>().join("\n")
    );
}
