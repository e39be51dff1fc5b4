//! The crate and module diagrams of `docs/ARCHITECTURE.md` are rules, not
//! pictures: this test reads them, each crate's manifest and every
//! `crate::` (and `super::`) path in each crate's `src/`, and fails when a
//! crate depends on one drawn beside or above it, when a module imports one
//! drawn beside or above it, when a top-level module is missing from its
//! crate's diagram, when the files of one folder import each other in a
//! circle, or when the core crate takes an async runtime or a transport.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// Generated code every layer may use.
const GENERATED: &[&str] = &["pb"];

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn architecture() -> String {
    fs::read_to_string(manifest_dir().join("docs/ARCHITECTURE.md"))
        .unwrap_or_else(|e| panic!("docs/ARCHITECTURE.md: {e}"))
}

/// The text of the fenced block after the line `marker` in
/// docs/ARCHITECTURE.md, its info string first.
fn fenced_block_after(marker: &str) -> String {
    let doc = architecture();
    let after = doc
        .split_once(marker)
        .unwrap_or_else(|| panic!("docs/ARCHITECTURE.md has no `{marker}` line"))
        .1;
    after
        .split_once("```")
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(block, _)| block.to_string())
        .unwrap_or_else(|| panic!("no fenced diagram after `{marker}`"))
}

/// The rows, top first, of the fenced block after the line `marker`: each
/// row's words up to `--` (those that `is_name` accepts).
fn diagram(marker: &str, is_name: fn(&str) -> bool) -> Vec<Vec<String>> {
    fenced_block_after(marker)
        .lines()
        .skip(1) // the fence's info string
        .map(|line| line.split_once("--").map_or(line, |(names, _)| names))
        .map(|names| {
            names
                .split_whitespace()
                .filter(|w| is_name(w))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter(|row| !row.is_empty())
        .collect()
}

fn is_module_name(word: &str) -> bool {
    word.chars().all(|c| c.is_ascii_lowercase() || c == '_')
}

/// A module diagram's rows, top first: the block after
/// `<!-- module layers of CRATE: top imports bottom -->`.
fn module_rows(krate: &str) -> Vec<Vec<String>> {
    diagram(
        &format!("<!-- module layers of {krate}: top imports bottom -->"),
        is_module_name,
    )
}

/// The workspace's crates, top first: (name, folder) from the rows of
/// `<!-- crate layers: top imports bottom -->`, one crate a row.
fn crate_rows() -> Vec<(String, PathBuf)> {
    fenced_block_after("<!-- crate layers: top imports bottom -->")
        .lines()
        .skip(1)
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next()?;
            let folder = words.next()?;
            Some((name.to_string(), manifest_dir().join(folder)))
        })
        .collect()
}

/// The workspace crates that a crate's manifest names under
/// `[dependencies]` (dev-dependencies may reach anything: tests).
fn workspace_dependencies(folder: &Path, crates: &[(String, PathBuf)]) -> BTreeSet<String> {
    let manifest = fs::read_to_string(folder.join("Cargo.toml"))
        .unwrap_or_else(|e| panic!("{}: {e}", folder.display()));
    normal_dependency_names(&manifest)
        .into_iter()
        .filter(|name| crates.iter().any(|(c, _)| c == name))
        .collect()
}

/// The names under `[dependencies]` (and target-specific dependency
/// tables) of a manifest.
fn normal_dependency_names(manifest: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut in_dependencies = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_dependencies = line == "[dependencies]"
                || (line.starts_with("[target.") && line.ends_with(".dependencies]"));
            continue;
        }
        if !in_dependencies || line.starts_with('#') {
            continue;
        }
        if let Some((name, _)) = line.split_once('=') {
            let name = name.trim();
            if !name.is_empty() {
                names.push(name.to_string());
            }
        }
    }
    names
}

/// Source with `//` comments removed (doc comments included), so paths in
/// prose do not count as imports.
fn code_of(text: &str) -> String {
    text.lines()
        .map(|line| line.split_once("//").map_or(line, |(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// `(first, second)` path segments after each `prefix` (`crate::` or
/// `super::`), expanding one brace group: `crate::{a, b::c}` gives
/// `(a, None)` and `(b, Some(c))`.
fn paths_after(code: &str, prefix: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let preceded_by_ident = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
        rest = &rest[at + prefix.len()..];
        if preceded_by_ident {
            continue;
        }
        let items: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let end = group
                .char_indices()
                .find(|&(_, c)| {
                    depth += match c {
                        '{' => 1,
                        '}' => -1,
                        _ => 0,
                    };
                    depth == 0
                })
                .map_or(group.len(), |(i, _)| i);
            top_level_items(&group[..end])
        } else {
            vec![rest]
        };
        for item in items {
            let item = item.trim_start();
            let first = ident_at(item);
            if first.is_empty() {
                continue;
            }
            let second = item[first.len()..]
                .strip_prefix("::")
                .map(ident_at)
                .filter(|s| !s.is_empty())
                .map(str::to_string);
            out.push((first.to_string(), second));
        }
    }
    out
}

fn top_level_items(group: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&group[start..]);
    items
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// A source file's module path below `src/`: `router/routing.rs` gives
/// `["router", "routing"]`, `index/mod.rs` gives `["index"]`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

struct Graph {
    /// Top-level module → the top-level modules it imports.
    top: BTreeMap<String, BTreeSet<String>>,
    /// `folder/file` → sibling `folder/file`s it imports.
    siblings: BTreeMap<String, BTreeSet<String>>,
}

fn import_graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph = Graph {
        top: BTreeMap::new(),
        siblings: BTreeMap::new(),
    };
    for file in files {
        let path = module_path(src, &file);
        let Some(top) = path.first().cloned() else {
            continue;
        };
        if top == "lib" || top == "main" {
            continue;
        }
        let text = fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let code = code_of(&text);
        graph.top.entry(top.clone()).or_default();
        let child = path.get(1).cloned();
        let sibling_exists = |name: &str| {
            let folder = src.join(&top);
            folder.join(format!("{name}.rs")).is_file() || folder.join(name).is_dir()
        };
        for (first, second) in paths_after(&code, "crate::") {
            if GENERATED.contains(&first.as_str()) {
                continue;
            }
            if first != top {
                graph.top.entry(top.clone()).or_default().insert(first);
            } else if let (Some(child), Some(second)) = (&child, second)
                && second != *child
                && sibling_exists(&second)
            {
                graph
                    .siblings
                    .entry(format!("{top}/{child}"))
                    .or_default()
                    .insert(format!("{top}/{second}"));
            }
        }
        if let (Some(child), 2) = (&child, path.len()) {
            for (first, _) in paths_after(&code, "super::") {
                if first != *child && sibling_exists(&first) {
                    graph
                        .siblings
                        .entry(format!("{top}/{child}"))
                        .or_default()
                        .insert(format!("{top}/{first}"));
                }
            }
        }
    }
    graph
}

#[test]
fn every_crate_depends_only_on_crates_drawn_below_it() {
    let crates = crate_rows();
    assert_eq!(
        crates.len(),
        4,
        "read {crates:?}: is the diagram's parser broken?"
    );
    let mut problems = Vec::new();
    for (row, (name, folder)) in crates.iter().enumerate() {
        for dependency in workspace_dependencies(folder, &crates) {
            let below = crates.iter().position(|(c, _)| *c == dependency);
            if below.is_none_or(|below| below <= row) {
                problems.push(format!(
                    "`{name}` depends on `{dependency}`, which the diagram draws beside or above it"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// What the core crate may not depend on: it stays the pure domain.
const NOT_IN_THE_CORE: &[&str] = &[
    "tokio",
    "tonic",
    "prost",
    "async-nats",
    "prometheus",
    "axum",
    "zeromq",
    "kvroute",
];

#[test]
fn the_core_crate_has_no_runtime_or_transport() {
    let crates = crate_rows();
    let (_, folder) = crates
        .iter()
        .find(|(name, _)| name == "kvroute-core")
        .expect("kvroute-core is in the crate diagram");
    let manifest = fs::read_to_string(folder.join("Cargo.toml")).expect("core manifest");
    let found: Vec<String> = normal_dependency_names(&manifest)
        .into_iter()
        .filter(|name| NOT_IN_THE_CORE.contains(&name.as_str()))
        .collect();
    assert!(found.is_empty(), "kvroute-core depends on {found:?}");
}

#[test]
fn every_module_imports_only_modules_drawn_below_it() {
    let mut problems = Vec::new();
    for (krate, folder) in crate_rows() {
        let rows = module_rows(&krate);
        let row_of: BTreeMap<&str, usize> = rows
            .iter()
            .enumerate()
            .flat_map(|(i, row)| row.iter().map(move |m| (m.as_str(), i)))
            .collect();
        let graph = import_graph(&folder.join("src"));
        // The parser must find at least every module the diagram draws.
        assert!(
            graph.top.len() >= row_of.len().max(2),
            "read only {} modules of {krate}, whose diagram draws {}: is the parser broken?",
            graph.top.len(),
            row_of.len()
        );
        for (module, imports) in &graph.top {
            // Generated code (and a message of it written by hand) sits
            // below every row: it may import nothing of the crate.
            if GENERATED.contains(&module.as_str()) {
                if !imports.is_empty() {
                    problems.push(format!(
                        "{krate}: `{module}` is used by every layer but imports {imports:?}"
                    ));
                }
                continue;
            }
            let Some(&row) = row_of.get(module.as_str()) else {
                problems.push(format!("{krate}: `{module}` is not in the diagram"));
                continue;
            };
            for import in imports {
                match row_of.get(import.as_str()) {
                    Some(&below) if below > row => {}
                    Some(_) => problems.push(format!(
                        "{krate}: `{module}` imports `{import}`, which the diagram draws beside or above it"
                    )),
                    None => problems.push(format!(
                        "{krate}: `{module}` imports `{import}`, which is not in the diagram"
                    )),
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_files_of_a_folder_import_each_other_in_one_direction() {
    for (_, folder) in crate_rows() {
        no_circle_among_siblings(&import_graph(&folder.join("src")));
    }
}

fn no_circle_among_siblings(graph: &Graph) {
    // Depth-first search for a cycle among sibling files.
    fn visit<'a>(
        node: &'a str,
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| *n == node) {
            return Some(stack[at..].iter().map(|s| s.to_string()).collect());
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node);
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, stack, done) {
                return Some(cycle);
            }
        }
        stack.pop();
        done.insert(node);
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.siblings.keys() {
        let cycle = visit(node, &graph.siblings, &mut Vec::new(), &mut done);
        assert!(
            cycle.is_none(),
            "files import each other in a circle: {cycle:?}"
        );
    }
}

#[test]
fn the_parser_sees_grouped_and_nested_imports() {
    let code = code_of(
        "use crate::{\n    a::B,\n    c::{d, e::F},\n    g,\n};\n// crate::commented\nlet x = crate::h::i();",
    );
    let found = paths_after(&code, "crate::");
    let firsts: Vec<&str> = found.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(firsts, ["a", "c", "g", "h"]);
    assert_eq!(found[0].1.as_deref(), Some("B"));
    assert_eq!(found[3].1.as_deref(), Some("i"));
}
