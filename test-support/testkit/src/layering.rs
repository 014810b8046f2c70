//! A crate's module layering, read from its source: which top-level modules name
//! which through `crate::` outside test code, the circles among them, and which
//! modules name a path they must not (`tonic`, `census_proto::pb`). Each crate keeps
//! its own rules in a test of its own and asks these questions of its `src/`.
//!
//! The reading is textual, not a parse: comments and the items under `#[cfg(test)]`
//! are dropped, then `root::` paths (with their `{ ... }` groups) are collected. A
//! path spelled through a `use` alias is not followed; the crates do not do that.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs, io,
    path::{Path, PathBuf},
};

/// Top-level module -> the top-level modules it names through `crate::`.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// One source file of a top-level module, its test code dropped.
#[derive(Debug, Clone)]
pub struct SourceFile {
    /// The path under `src/`.
    pub path: PathBuf,
    pub code: String,
}

/// The production code of a crate's `src/`, by top-level module. The crate root
/// (`lib.rs`, `main.rs`), binaries (`bin/`) and test files (any `tests.rs`, any file
/// under a `tests/` directory, `layering.rs`) are left out.
#[derive(Debug, Clone, Default)]
pub struct Modules(pub BTreeMap<String, Vec<SourceFile>>);

impl Modules {
    /// Reads `src`.
    pub fn read(src: &Path) -> io::Result<Self> {
        let mut files = Vec::new();
        rust_files(src, &mut files)?;
        let mut modules = BTreeMap::<String, Vec<SourceFile>>::new();
        for file in files {
            let relative = file.strip_prefix(src).unwrap_or(&file).to_path_buf();
            if is_test_code(&relative) {
                continue;
            }
            let Some(first) = relative.iter().next() else {
                continue;
            };
            let first = first.to_string_lossy();
            if first == "bin" || first == "main.rs" || first == "lib.rs" {
                continue;
            }
            let module = first.trim_end_matches(".rs").to_owned();
            let code = production_code(&fs::read_to_string(&file)?);
            modules.entry(module).or_default().push(SourceFile {
                path: relative,
                code,
            });
        }
        Ok(Self(modules))
    }

    /// [`Modules::read`] of `<manifest_dir>/src`, panicking with the path on failure.
    pub fn of_crate(manifest_dir: &str) -> Self {
        let src = Path::new(manifest_dir).join("src");
        Self::read(&src).unwrap_or_else(|e| panic!("reading {}: {e}", src.display()))
    }

    /// Which top-level modules each one names.
    pub fn graph(&self) -> Graph {
        self.0
            .iter()
            .map(|(module, files)| {
                let used = files
                    .iter()
                    .flat_map(|f| names_under(&f.code, "crate"))
                    .filter(|m| m != module)
                    .collect();
                (module.clone(), used)
            })
            .collect()
    }

    /// The files of `module` that name one of `paths`, with the path each names
    /// first (see [`names`]). Panics if the crate has no such module: a check of a
    /// module that was renamed away would pass without checking anything.
    pub fn naming(&self, module: &str, paths: &[&str]) -> Vec<(PathBuf, String)> {
        self.files_of(module)
            .iter()
            .filter_map(|f| {
                let found = paths.iter().find(|p| names(&f.code, p))?;
                Some((f.path.clone(), (*found).to_owned()))
            })
            .collect()
    }

    /// The files of `module`; panics if there is none (see [`Self::naming`]).
    pub fn files_of(&self, module: &str) -> &[SourceFile] {
        match self.0.get(module) {
            Some(files) if !files.is_empty() => files,
            _ => panic!("the crate has no module `{module}`: a check of it would check nothing"),
        }
    }

    /// The `crate::` modules `module` uses; panics if the crate has no such module.
    pub fn uses(&self, module: &str) -> BTreeSet<String> {
        self.files_of(module);
        self.graph().remove(module).unwrap_or_default()
    }

    /// The files of any module but those in `allowed` that name one of `paths`.
    pub fn naming_outside(&self, allowed: &[&str], paths: &[&str]) -> Vec<(PathBuf, String)> {
        self.0
            .keys()
            .filter(|m| !allowed.contains(&m.as_str()))
            .flat_map(|m| self.naming(m, paths))
            .collect()
    }
}

/// Whether a file under `src/` is test code.
fn is_test_code(relative: &Path) -> bool {
    let file_name = relative.file_name().and_then(|n| n.to_str());
    matches!(file_name, Some("tests.rs" | "layering.rs"))
        || relative
            .parent()
            .is_some_and(|dir| dir.iter().any(|part| part == "tests"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> io::Result<()> {
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
pub fn production_code(text: &str) -> String {
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

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn ident(text: &str) -> &str {
    let end = text.find(|c: char| !is_ident_char(c)).unwrap_or(text.len());
    &text[..end]
}

/// The first segments of the paths `code` names under `root::`: for
/// `crate::{a, b::{c, d}}` and `crate::e::f`, `a`, `b` and `e`. `root` must start a
/// path (`tonic::` in `monotonic::` does not count).
pub fn names_under(code: &str, root: &str) -> BTreeSet<String> {
    let prefix = format!("{root}::");
    let mut used = BTreeSet::new();
    for (at, _) in code.match_indices(&prefix) {
        if code[..at].chars().next_back().is_some_and(is_ident_char) {
            continue;
        }
        let after = code[at + prefix.len()..].trim_start();
        if let Some(group) = after.strip_prefix('{') {
            let mut depth = 0usize;
            let mut start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && is_ident_char(c) => {
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

/// Whether `code` names `path`: a crate (`tonic`: any `tonic::` path) or an item
/// under one (`tonic::Status`, `census_proto::pb`, `tokio::net`), also inside a `use`
/// group. Only the first segment after the crate is compared.
pub fn names(code: &str, path: &str) -> bool {
    match path.split_once("::") {
        None => !names_under(code, path).is_empty(),
        Some((root, rest)) => {
            let first = rest.split("::").next().unwrap_or(rest);
            names_under(code, root).contains(first)
        }
    }
}

/// A circle of `graph`, if it has one: its modules in order, the first repeated last.
pub fn circle(graph: &Graph) -> Option<Vec<String>> {
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

/// Every circle of `graph` at once: the groups of modules that each reach every
/// other of their group (strongly connected, more than one module).
pub fn tangles(graph: &Graph) -> Vec<BTreeSet<String>> {
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_owned()];
        while let Some(node) = todo.pop() {
            for next in graph.get(&node).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        graph.keys().map(|m| (m, reach(m))).collect();
    let mut groups: Vec<BTreeSet<String>> = Vec::new();
    for (module, from) in &reached {
        if groups.iter().any(|g| g.contains(*module)) {
            continue;
        }
        let group: BTreeSet<String> = from
            .iter()
            .filter(|other| {
                reached
                    .get(other)
                    .is_some_and(|back| back.contains(*module))
            })
            .cloned()
            .collect();
        if group.len() > 1 {
            groups.push(group);
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &str)]) -> Graph {
        let mut graph = Graph::new();
        for (a, b) in edges {
            graph
                .entry((*a).to_owned())
                .or_default()
                .insert((*b).to_owned());
            graph.entry((*b).to_owned()).or_default();
        }
        graph
    }

    #[test]
    fn paths_are_read_from_groups_and_test_code_is_skipped() {
        let code = "use crate::{a::{X, Y}, b};\nfn f() { crate::c::g(); }\n\
                    #[cfg(test)]\nmod tests { use crate::d; }\n// crate::e\n";
        assert_eq!(
            names_under(&production_code(code), "crate"),
            ["a", "b", "c"].map(String::from).into()
        );
        let code = "use census_proto::{domain::X, pb::{self, Y}};\nuse tokio::{net::T, sync};\n\
                    /// monotonic::x\nlet c = monotonic::now();";
        assert!(names(code, "census_proto::pb"));
        assert!(names(code, "tokio::net"));
        assert!(!names(code, "tokio::time"));
        assert!(!names(code, "tonic"), "monotonic:: is not tonic::");
        assert!(names("#[tonic::async_trait]", "tonic"));
        assert!(names("use tonic::{Request, Status};", "tonic::Status"));
    }

    #[test]
    fn circles_are_found_and_grouped() {
        let g = graph(&[
            ("x", "y"),
            ("y", "z"),
            ("z", "x"),
            ("z", "w"),
            ("p", "q"),
            ("q", "p"),
        ]);
        assert_eq!(circle(&g), Some(["p", "q", "p"].map(String::from).to_vec()));
        assert_eq!(
            tangles(&g),
            vec![
                ["p", "q"].map(String::from).into(),
                ["x", "y", "z"].map(String::from).into()
            ]
        );
        let line = graph(&[("a", "b"), ("b", "c")]);
        assert_eq!(circle(&line), None);
        assert!(tangles(&line).is_empty());
    }

    #[test]
    fn test_files_are_not_production_code() {
        for path in ["core/tests.rs", "allocator/tests/unit.rs", "layering.rs"] {
            assert!(is_test_code(Path::new(path)), "{path}");
        }
        for path in ["core/mod.rs", "grpc/sync.rs", "tests_helper.rs"] {
            assert!(!is_test_code(Path::new(path)), "{path}");
        }
    }
}
