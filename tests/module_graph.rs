//! No import cycles: the modules of the library and of the binary form a
//! graph with no cycle at two levels, the top-level modules (`core`,
//! `nats`, `config`, `runtime`, ..., and the binary's `cli`) and, within
//! each of them, its direct submodules (`core::event`, `core::state`, ...,
//! `cli::audit`, `cli::serve`, ...). A cycle means neither module can be
//! read, tested or moved without the other; the way out is to move what
//! the lower module needs from the higher one into the lower one (or into
//! a module both use).
//!
//! The graph is read from the source with `syn`: every `use` item and
//! every path (in code and in macro calls) that starts with `crate::`,
//! `super::`, `self::` or the name of a child module is an edge from the
//! module it is written in to the module it names. Code under
//! `#[cfg(test)]` is left out (tests may use anything), and so is a
//! module's own `mod.rs` within its level (a parent and its children refer
//! to each other by nature: the parent declares and re-exports them).

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proc_macro2::{TokenStream, TokenTree};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use syn::visit::Visit;

/// Cycles known today and allowed until they are broken, each as the set
/// of its modules. A cycle not listed fails the test; a listed one that is
/// gone fails it too, so the list only shrinks.
const KNOWN_CYCLES: &[&[&str]] = &[];

/// A module path from the crate root: `["core", "event"]`.
type ModPath = Vec<String>;

/// One reference from a module to another: where it is written and how.
#[derive(Debug, Clone)]
struct Reference {
    from: ModPath,
    to: ModPath,
    file: PathBuf,
    written: String,
}

/// A crate's modules (path to file) and the references between them.
struct Crate {
    modules: BTreeMap<ModPath, PathBuf>,
    references: Vec<Reference>,
}

fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && matches!(&a.meta, syn::Meta::List(l) if l.tokens.to_string() == "test")
    })
}

fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    use syn::Item::*;
    match item {
        Const(i) => &i.attrs,
        Enum(i) => &i.attrs,
        ExternCrate(i) => &i.attrs,
        Fn(i) => &i.attrs,
        ForeignMod(i) => &i.attrs,
        Impl(i) => &i.attrs,
        Macro(i) => &i.attrs,
        Mod(i) => &i.attrs,
        Static(i) => &i.attrs,
        Struct(i) => &i.attrs,
        Trait(i) => &i.attrs,
        TraitAlias(i) => &i.attrs,
        Type(i) => &i.attrs,
        Union(i) => &i.attrs,
        Use(i) => &i.attrs,
        _ => &[],
    }
}

fn parse(file: &Path) -> syn::File {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// The modules under `module` (declared in `file`, which is `dir`'s
/// `mod.rs`, `lib.rs` or `main.rs` when `dir_of_children` is `dir`).
fn declare(
    modules: &mut BTreeMap<ModPath, PathBuf>,
    module: ModPath,
    file: &Path,
    items: &[syn::Item],
    children_dir: &Path,
) {
    for item in items {
        let syn::Item::Mod(m) = item else { continue };
        if is_test_only(&m.attrs) {
            continue;
        }
        let mut path = module.clone();
        path.push(m.ident.to_string());
        match &m.content {
            // Inline: part of the same file; its own children (if it
            // declared file modules) would live in a folder of its name.
            Some((_, inner)) => {
                modules.insert(path.clone(), file.to_path_buf());
                let dir = children_dir.join(m.ident.to_string());
                declare(modules, path, file, inner, &dir);
            }
            None => {
                let name = m.ident.to_string();
                let flat = children_dir.join(format!("{name}.rs"));
                let nested = children_dir.join(&name).join("mod.rs");
                let (child, dir) = if flat.is_file() {
                    (flat, children_dir.join(&name))
                } else if nested.is_file() {
                    (nested, children_dir.join(&name))
                } else {
                    panic!("no file for module {}", path.join("::"));
                };
                modules.insert(path.clone(), child.clone());
                let parsed = parse(&child);
                declare(modules, path, &child, &parsed.items, &dir);
            }
        }
    }
}

/// Collects the references of one file.
struct Collector<'a> {
    modules: &'a BTreeMap<ModPath, PathBuf>,
    file: &'a Path,
    module: ModPath,
    out: Vec<Reference>,
}

impl Collector<'_> {
    /// The module a path written in the current module names, if it names
    /// one of this crate's.
    fn resolve(&self, segments: &[String]) -> Option<ModPath> {
        let (first, rest) = segments.split_first()?;
        let absolute: ModPath = match first.as_str() {
            "crate" => rest.to_vec(),
            "self" => self.module.iter().chain(rest).cloned().collect(),
            "super" => {
                let mut base = self.module.clone();
                base.pop();
                let mut rest = rest;
                while let Some(("super", more)) = rest.split_first().map(|(s, m)| (s.as_str(), m)) {
                    base.pop();
                    rest = more;
                }
                base.into_iter().chain(rest.iter().cloned()).collect()
            }
            _ if segments.len() > 1 => {
                let mut child = self.module.clone();
                child.push(first.clone());
                if !self.modules.contains_key(&child) {
                    return None;
                }
                self.module.iter().chain(segments).cloned().collect()
            }
            _ => return None,
        };
        // The longest prefix that is a module (the rest is an item).
        (0..=absolute.len())
            .rev()
            .map(|n| absolute[..n].to_vec())
            .find(|p| p.is_empty() || self.modules.contains_key(p))
    }

    fn add(&mut self, segments: Vec<String>) {
        if let Some(to) = self.resolve(&segments) {
            self.out.push(Reference {
                from: self.module.clone(),
                to,
                file: self.file.to_path_buf(),
                written: segments.join("::"),
            });
        }
    }

    /// Paths in a macro call's tokens: `crate :: a :: b`, `super :: x`, ...
    fn scan_tokens(&mut self, tokens: TokenStream) {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < trees.len() {
            match &trees[i] {
                TokenTree::Group(g) => self.scan_tokens(g.stream()),
                TokenTree::Ident(id)
                    if ["crate", "super", "self"].contains(&id.to_string().as_str()) =>
                {
                    let mut segments = vec![id.to_string()];
                    let mut j = i + 1;
                    while let (
                        Some(TokenTree::Punct(a)),
                        Some(TokenTree::Punct(b)),
                        Some(TokenTree::Ident(next)),
                    ) = (trees.get(j), trees.get(j + 1), trees.get(j + 2))
                    {
                        if a.as_char() != ':' || b.as_char() != ':' {
                            break;
                        }
                        segments.push(next.to_string());
                        j += 3;
                    }
                    if segments.len() > 1 {
                        self.add(segments);
                    }
                    i = j;
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
    }
}

fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) if n.ident == "self" => out.push(prefix.clone()),
        syn::UseTree::Name(n) => {
            let mut p = prefix.clone();
            p.push(n.ident.to_string());
            out.push(p);
        }
        syn::UseTree::Rename(r) => {
            let mut p = prefix.clone();
            p.push(r.ident.to_string());
            out.push(p);
        }
        syn::UseTree::Glob(_) => out.push(prefix.clone()),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_paths(t, prefix, out);
            }
        }
    }
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if is_test_only(item_attrs(item)) {
            return;
        }
        match item {
            // File modules are visited as files of their own.
            syn::Item::Mod(m) if m.content.is_none() => {}
            syn::Item::Mod(m) => {
                self.module.push(m.ident.to_string());
                syn::visit::visit_item_mod(self, m);
                self.module.pop();
            }
            _ => syn::visit::visit_item(self, item),
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        let mut out = Vec::new();
        use_paths(&u.tree, &mut Vec::new(), &mut out);
        for p in out {
            self.add(p);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        self.add(segments);
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.scan_tokens(mac.tokens.clone());
        syn::visit::visit_macro(self, mac);
    }
}

fn load(root: &Path) -> Crate {
    let parsed = parse(root);
    let mut modules = BTreeMap::new();
    modules.insert(Vec::new(), root.to_path_buf());
    let dir = root.parent().unwrap();
    declare(&mut modules, Vec::new(), root, &parsed.items, dir);
    let mut references = Vec::new();
    let files: BTreeMap<PathBuf, ModPath> = modules
        .iter()
        .map(|(m, f)| (f.clone(), m.clone()))
        .fold(BTreeMap::new(), |mut acc, (f, m)| {
            // A file's module is the shortest one it holds (inline modules
            // are visited from their file).
            acc.entry(f)
                .and_modify(|old: &mut ModPath| {
                    if m.len() < old.len() {
                        *old = m.clone();
                    }
                })
                .or_insert(m);
            acc
        });
    for (file, module) in files {
        let mut c = Collector {
            modules: &modules,
            file: &file,
            module,
            out: Vec::new(),
        };
        c.visit_file(&parse(&file));
        references.extend(c.out);
    }
    Crate {
        modules,
        references,
    }
}

/// An edge of one level's graph and the first reference that makes it.
type Graph = BTreeMap<String, BTreeMap<String, Reference>>;

/// The graphs to check: the top-level modules, and each top-level
/// module's direct submodules.
fn graphs(krate: &Crate) -> BTreeMap<String, Graph> {
    let mut out: BTreeMap<String, Graph> = BTreeMap::new();
    let mut add = |level: String, from: String, to: String, r: &Reference| {
        if from != to {
            out.entry(level)
                .or_default()
                .entry(from)
                .or_default()
                .entry(to)
                .or_insert_with(|| r.clone());
        }
    };
    for r in &krate.references {
        let (Some(f0), Some(t0)) = (r.from.first(), r.to.first()) else {
            continue;
        };
        if f0 != t0 {
            add("top level".into(), f0.clone(), t0.clone(), r);
        } else if let (Some(f1), Some(t1)) = (r.from.get(1), r.to.get(1)) {
            add(f0.clone(), format!("{f0}::{f1}"), format!("{t0}::{t1}"), r);
        }
    }
    out
}

/// The graph's cycles: its strongly connected components of two or more
/// modules, each sorted.
fn cycles(graph: &Graph) -> Vec<BTreeSet<String>> {
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut queue = VecDeque::from([from.to_string()]);
        while let Some(n) = queue.pop_front() {
            for next in graph.get(&n).into_iter().flat_map(|e| e.keys()) {
                if seen.insert(next.clone()) {
                    queue.push_back(next.clone());
                }
            }
        }
        seen
    };
    let nodes: BTreeSet<&String> = graph
        .keys()
        .chain(graph.values().flat_map(|e| e.keys()))
        .collect();
    let reaches: BTreeMap<&String, BTreeSet<String>> =
        nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out: Vec<BTreeSet<String>> = Vec::new();
    for n in &nodes {
        if !reaches[n].contains(*n) || out.iter().any(|c| c.contains(*n)) {
            continue;
        }
        let component: BTreeSet<String> = nodes
            .iter()
            .filter(|m| reaches[n].contains(**m) && reaches[*m].contains(*n))
            .map(|m| m.to_string())
            .collect();
        out.push(component);
    }
    out
}

/// One cycle through `component`, as `a -> b -> a` with the reference
/// behind each step.
fn explain(graph: &Graph, component: &BTreeSet<String>) -> String {
    let start = component.iter().next().unwrap();
    // Shortest way back to `start` inside the component.
    let mut back: BTreeMap<String, String> = BTreeMap::new();
    let mut queue = VecDeque::from([start.clone()]);
    let mut last = None;
    'search: while let Some(n) = queue.pop_front() {
        for next in graph.get(&n).into_iter().flat_map(|e| e.keys()) {
            if !component.contains(next) {
                continue;
            }
            if next == start {
                last = Some(n.clone());
                break 'search;
            }
            if !back.contains_key(next) {
                back.insert(next.clone(), n.clone());
                queue.push_back(next.clone());
            }
        }
    }
    let mut middle = Vec::new();
    let mut at = last.unwrap();
    while &at != start {
        middle.push(at.clone());
        at = back[&at].clone();
    }
    middle.reverse();
    let path: Vec<String> = std::iter::once(start.clone())
        .chain(middle)
        .chain(std::iter::once(start.clone()))
        .collect();
    let steps: Vec<String> = path
        .windows(2)
        .map(|w| {
            let r = &graph[&w[0]][&w[1]];
            let file = r
                .file
                .strip_prefix(env!("CARGO_MANIFEST_DIR"))
                .unwrap_or(&r.file);
            format!(
                "  {} -> {}: {} names {}",
                w[0],
                w[1],
                file.display(),
                r.written
            )
        })
        .collect();
    format!("{}\n{}", path.join(" -> "), steps.join("\n"))
}

#[test]
fn the_module_graph_has_no_cycles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found: Vec<(BTreeSet<String>, String)> = Vec::new();
    for root in ["lib.rs", "main.rs"] {
        let krate = load(&src.join(root));
        assert!(krate.modules.len() > 10, "{root}: too few modules found");
        let graphs = graphs(&krate);
        if root == "lib.rs" {
            // The reader sees what is there: the runtime folds with the core.
            assert!(graphs["top level"]["runtime"].contains_key("core"));
            assert!(graphs["core"]["core::fold"].contains_key("core::event"));
        }
        for graph in graphs.values() {
            for c in cycles(graph) {
                let members: Vec<&str> = c.iter().map(String::as_str).collect();
                let why = format!(
                    "cycle among {{{}}}: {}",
                    members.join(", "),
                    explain(graph, &c)
                );
                found.push((c, why));
            }
        }
    }
    let known: Vec<BTreeSet<String>> = KNOWN_CYCLES
        .iter()
        .map(|c| c.iter().map(|s| s.to_string()).collect())
        .collect();
    let new: Vec<&String> = found
        .iter()
        .filter(|(c, _)| !known.contains(c))
        .map(|(_, why)| why)
        .collect();
    assert!(
        new.is_empty(),
        "import cycles (move what the lower module needs from the higher one into the lower \
         one, or into a module both use):\n{}",
        new.iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    for k in &known {
        assert!(
            found.iter().any(|(c, _)| c == k),
            "the known cycle {k:?} is gone: remove it from KNOWN_CYCLES"
        );
    }
}

#[test]
fn a_cycle_is_found_and_named() {
    let r = |from: &str, to: &str| Reference {
        from: vec![from.into()],
        to: vec![to.into()],
        file: PathBuf::from(format!("src/{from}.rs")),
        written: format!("crate::{to}::X"),
    };
    let mut graph = Graph::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e")] {
        graph.entry(a.into()).or_default().insert(b.into(), r(a, b));
    }
    let found = cycles(&graph);
    let want: BTreeSet<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    assert_eq!(found, vec![want.clone()]);
    let why = explain(&graph, &want);
    assert!(why.starts_with("a -> b -> c -> a\n"), "{why}");
    assert!(why.contains("src/c.rs names crate::a::X"), "{why}");
}

#[test]
fn paths_resolve_from_the_module_they_are_written_in() {
    let modules: BTreeMap<ModPath, PathBuf> = [
        vec![],
        vec!["core".to_string()],
        vec!["core".to_string(), "event".to_string()],
        vec!["core".to_string(), "fold".to_string()],
        vec!["core".to_string(), "fold".to_string(), "debt".to_string()],
    ]
    .into_iter()
    .map(|m| (m, PathBuf::new()))
    .collect();
    let c = Collector {
        modules: &modules,
        file: Path::new("src/core/fold/mod.rs"),
        module: vec!["core".into(), "fold".into()],
        out: Vec::new(),
    };
    let seg = |s: &str| s.split("::").map(str::to_string).collect::<Vec<_>>();
    let m = |s: &str| s.split("::").map(str::to_string).collect::<ModPath>();
    assert_eq!(
        c.resolve(&seg("crate::core::event::Envelope")),
        Some(m("core::event"))
    );
    assert_eq!(
        c.resolve(&seg("super::event::Envelope")),
        Some(m("core::event"))
    );
    assert_eq!(c.resolve(&seg("debt::raise")), Some(m("core::fold::debt")));
    assert_eq!(c.resolve(&seg("self::debt")), Some(m("core::fold::debt")));
    assert_eq!(c.resolve(&seg("std::fmt")), None);
    assert_eq!(c.resolve(&seg("Envelope")), None);
}

/// The graphs as text, for a reader planning a move:
/// `cargo test --test module_graph -- --ignored --nocapture`.
#[test]
#[ignore]
fn print_the_module_graph() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for root in ["lib.rs", "main.rs"] {
        for (level, graph) in graphs(&load(&src.join(root))) {
            println!("{root}, {level}:");
            for (from, edges) in &graph {
                for (to, r) in edges {
                    println!(
                        "  {from} -> {to} ({} names {})",
                        r.file.display(),
                        r.written
                    );
                }
            }
        }
    }
}
