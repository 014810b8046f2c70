//! The agent's module layering, checked on its source: the `crate::` paths between
//! top-level modules outside test code form no circle, and the core names no
//! shell. Run alone with `cargo test -p census-agent --lib layering`.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// The modules the core may use: the source's event types (plain data) and nothing
/// that does I/O or speaks the wire.
const CORE_MAY_USE: &[&str] = &["source"];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// `text` without comments and without the items under `#[cfg(test)]`.
fn production_code(text: &str) -> String {
    let no_comments: String = text
        .lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = String::new();
    let mut rest = no_comments.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        rest = &rest[at + "#[cfg(test)]".len()..];
        // Skip the item: up to its `;`, or its balanced `{ ... }`.
        let mut depth = 0usize;
        let mut end = rest.len();
        for (i, c) in rest.char_indices() {
            match c {
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn ident(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The top-level modules `code` names through `crate::`.
fn used_modules(code: &str) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let after = code[at + "crate::".len()..].trim_start();
        if let Some(group) = after.strip_prefix('{') {
            // `crate::{a, b::{c, d}, e}`: the first name of each top-level element.
            let mut depth = 0usize;
            let mut start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && (c.is_alphanumeric() || c == '_') => {
                        used.insert(ident(&group[i..]).to_owned());
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident(after);
            if !name.is_empty() {
                used.insert(name.to_owned());
            }
        }
    }
    used
}

/// Top-level module -> the top-level modules it uses, outside test code.
fn graph(src: &Path) -> std::io::Result<Graph> {
    let mut files = Vec::new();
    rust_files(src, &mut files)?;
    let mut graph = Graph::new();
    for file in files {
        let relative = file.strip_prefix(src).unwrap_or(&file);
        let mut parts = relative.iter().map(|p| p.to_string_lossy().into_owned());
        let Some(first) = parts.next() else { continue };
        // The binaries are crates of their own; test files are test code.
        let is_test = relative
            .file_name()
            .is_some_and(|n| n == "tests.rs" || n == "layering.rs");
        if first == "bin" || first == "main.rs" || first == "lib.rs" || is_test {
            continue;
        }
        let module = first.trim_end_matches(".rs").to_owned();
        let code = production_code(&fs::read_to_string(&file)?);
        let used = graph.entry(module.clone()).or_default();
        used.extend(used_modules(&code).into_iter().filter(|m| *m != module));
    }
    Ok(graph)
}

/// A circle of `graph`, if it has one.
fn circle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut circle = path[at..].to_vec();
            circle.push(node.to_owned());
            return Some(circle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(circle) = visit(next, graph, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

fn agent_graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    graph(&src).unwrap_or_else(|e| panic!("reading {}: {e}", src.display()))
}

#[test]
fn no_module_of_the_agent_imports_in_a_circle() {
    let graph = agent_graph();
    assert!(graph.contains_key("core") && graph.contains_key("daemon"));
    assert_eq!(circle(&graph), None, "{graph:#?}");
}

#[test]
fn the_core_names_no_shell() {
    let graph = agent_graph();
    let used = graph.get("core").cloned().unwrap_or_default();
    let allowed: BTreeSet<String> = CORE_MAY_USE.iter().map(|m| (*m).to_owned()).collect();
    assert!(used.is_subset(&allowed), "the core uses {used:?}");
}

#[test]
fn the_core_does_no_io_and_speaks_no_wire() -> std::io::Result<()> {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut files = Vec::new();
    rust_files(&core, &mut files)?;
    for file in files {
        let code = production_code(&fs::read_to_string(&file)?);
        for word in [
            "tokio",
            "tonic",
            "pb::",
            "std::fs",
            "std::net::Tcp",
            "Instant",
            "SystemTime",
        ] {
            assert!(!code.contains(word), "{} uses {word}", file.display());
        }
    }
    Ok(())
}

#[test]
fn the_check_sees_circles_and_skips_test_code() {
    let code = "use crate::{a::{X, Y}, b};\nfn f() { crate::c::g(); }\n\
                #[cfg(test)]\nmod tests { use crate::d; }\n// crate::e\n";
    assert_eq!(
        used_modules(&production_code(code)),
        ["a", "b", "c"].map(String::from).into()
    );
    let graph: Graph = [("x", "y"), ("y", "z"), ("z", "x")]
        .into_iter()
        .map(|(a, b)| (a.to_owned(), [b.to_owned()].into()))
        .collect();
    assert_eq!(
        circle(&graph),
        Some(["x", "y", "z", "x"].map(String::from).to_vec())
    );
}
