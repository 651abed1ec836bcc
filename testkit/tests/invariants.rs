//! Workspace invariants that hold across every crate, checked on the source tree:
//! - `unsafe` code lives only in the audited modules listed in [`UNSAFE_MODULES`], and every
//!   crate inherits the workspace lints (which deny `unsafe_code` everywhere else);
//! - every Rust file starts with a module doc (`//!`) saying what it is;
//! - the layering holds: no crate depends on one above it (core → infra → settings → store →
//!   projector, gateway), and the pure engine is the root package;
//! - only the store reads the schema's `migrations/`, and no SQL is written outside the store.
//!
//! The engine's own dependency allowlist and purity are checked by `tests/purity.rs`.
//!
//! `cargo fmt --check` and `cargo clippy -D warnings` are the other half of the invariant
//! checks; `scripts/test.sh` runs them before the test suite.

use std::path::{Path, PathBuf};

/// The only files allowed `unsafe` (each opts in with `#![allow(unsafe_code)]` and argues
/// every block's safety): librdkafka's topic IDs and its raw header access, and the counting
/// allocator of the kept snapshots' memory test.
const UNSAFE_MODULES: &[&str] = &["infra/src/topic_id.rs", "infra/src/headers.rs", "gateway/tests/kept_bytes.rs"];

/// Directories that are not source (build output, local services, dependencies).
const SKIPPED: &[&str] = &["target", ".local", ".git", "node_modules"];

fn workspace_root() -> PathBuf {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // The root manifest is the one with a [workspace] table.
    loop {
        let manifest = dir.join("Cargo.toml");
        if manifest.exists() && std::fs::read_to_string(&manifest).unwrap().contains("[workspace]") {
            return dir;
        }
        assert!(dir.pop(), "no workspace root above {}", env!("CARGO_MANIFEST_DIR"));
    }
}

fn files_with_extension(dir: &Path, extension: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            if !SKIPPED.contains(&name.as_str()) {
                files_with_extension(&path, extension, out);
            }
        } else if path.extension().is_some_and(|e| e == extension) {
            out.push(path);
        }
    }
}

fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/")
}

/// The code of a line: what precedes a `//` comment (string contents are not parsed; the
/// fragments searched for do not occur in strings of this workspace).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

/// Files whose code (comments aside) has a line `matches`, relative to `root`, sorted.
fn files_whose_code(root: &Path, files: &[PathBuf], matches: impl Fn(&str) -> bool) -> Vec<String> {
    let mut found: Vec<String> = files
        .iter()
        .filter(|path| std::fs::read_to_string(path).unwrap().lines().any(|l| matches(code(l))))
        .map(|path| relative(root, path))
        .collect();
    found.sort();
    found
}

/// Files whose code (comments aside) uses `unsafe` or allows it.
fn unsafe_users(root: &Path, files: &[PathBuf]) -> Vec<String> {
    files_whose_code(root, files, |c| {
        c.contains("unsafe ") || c.contains("unsafe{") || c.contains("allow(unsafe_code)")
    })
}

#[test]
fn unsafe_code_lives_only_in_the_audited_modules() {
    let root = workspace_root();
    let mut files = Vec::new();
    files_with_extension(&root, "rs", &mut files);
    assert!(files.len() > 50, "the scan found only {} Rust files under {}", files.len(), root.display());
    // This file names the fragments it looks for.
    files.retain(|p| !p.ends_with(file!()));
    let users = unsafe_users(&root, &files);
    let stray: Vec<&String> = users.iter().filter(|f| !UNSAFE_MODULES.contains(&f.as_str())).collect();
    assert!(stray.is_empty(), "`unsafe` outside the audited modules {UNSAFE_MODULES:?}: {stray:?}");
    for module in UNSAFE_MODULES {
        assert!(users.iter().any(|u| u == module), "{module} is listed as audited but no longer uses unsafe");
    }
}

#[test]
fn every_crate_inherits_the_workspace_lints() {
    let root = workspace_root();
    let workspace = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    assert!(workspace.contains("unsafe_code = \"deny\""), "the workspace no longer denies unsafe_code");
    let mut manifests = Vec::new();
    files_with_extension(&root, "toml", &mut manifests);
    let manifests: Vec<PathBuf> = manifests.into_iter().filter(|p| p.ends_with("Cargo.toml")).collect();
    assert!(manifests.len() >= 5, "found {} crate manifests", manifests.len());
    for manifest in manifests {
        let text = std::fs::read_to_string(&manifest).unwrap();
        if !text.contains("[package]") {
            continue;
        }
        assert!(
            text.contains("[lints]\nworkspace = true"),
            "{} does not inherit the workspace lints ([lints] workspace = true)",
            relative(&root, &manifest)
        );
    }
}

#[test]
fn every_rust_file_starts_with_a_module_doc() {
    let root = workspace_root();
    let mut files = Vec::new();
    files_with_extension(&root, "rs", &mut files);
    let undocumented: Vec<String> = files
        .iter()
        .filter(|p| !std::fs::read_to_string(p).unwrap().trim_start().starts_with("//!"))
        .map(|p| relative(&root, p))
        .collect();
    assert!(undocumented.is_empty(), "files without a module doc (`//!` first): {undocumented:?}");
}

/// The scan itself can fail: a file using `unsafe` outside the list is found, comments
/// are not.
#[test]
fn the_unsafe_scan_finds_what_it_looks_for() {
    let dir = std::env::temp_dir().join(format!("parsley-invariants-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.rs");
    let fine = dir.join("fine.rs");
    std::fs::write(&bad, "//! x\nfn f() { unsafe { g() } }\n").unwrap();
    std::fs::write(&fine, "//! x\n// unsafe { is only mentioned here }\nfn f() {}\n").unwrap();
    let found = unsafe_users(&dir, &[bad, fine]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found, vec!["bad.rs".to_string()]);
}

/// The crates of the workspace, lowest layer first; a crate may depend only on crates listed
/// before it (tests and benches aside, which may run a real projector).
const LAYERS: &[(&str, &str)] = &[
    ("parsley", "."),
    ("parsley-infra", "infra"),
    ("parsley-settings", "settings"),
    ("parsley-store", "store"),
    ("parsley-projector", "projector"),
    ("parsley-gateway", "gateway"),
];

/// The names of a manifest's `[dependencies]` table (not dev- or build-dependencies).
fn runtime_dependencies(manifest: &str) -> Vec<String> {
    let mut in_table = false;
    let mut names = Vec::new();
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_table = line == "[dependencies]";
            continue;
        }
        if in_table && !line.is_empty() && !line.starts_with('#') {
            if let Some((name, _)) = line.split_once('=') {
                names.push(name.trim().to_string());
            }
        }
    }
    names
}

/// `(crate, dependency)` pairs where a crate depends on one of its own layer or above.
fn upward_arrows(manifests: &[(&str, String)]) -> Vec<(String, String)> {
    let rank = |name: &str| LAYERS.iter().position(|(n, _)| *n == name);
    let mut found = Vec::new();
    for (name, manifest) in manifests {
        let own = rank(name).expect("a layered crate");
        for dep in runtime_dependencies(manifest) {
            if rank(&dep).is_some_and(|r| r >= own) {
                found.push((name.to_string(), dep));
            }
        }
    }
    found
}

#[test]
fn no_crate_depends_on_a_layer_above_it() {
    let root = workspace_root();
    let manifests: Vec<(&str, String)> = LAYERS
        .iter()
        .map(|(name, dir)| (*name, std::fs::read_to_string(root.join(dir).join("Cargo.toml")).unwrap()))
        .collect();
    let root_manifest = &manifests[0].1;
    assert!(
        root_manifest.contains("[package]\nname = \"parsley\"") && root_manifest.contains("[workspace]"),
        "the root manifest is the engine's package and the workspace"
    );
    assert!(
        runtime_dependencies(&manifests[4].1).contains(&"parsley-store".to_string()),
        "the scan reads the projector's dependencies (it should find the store among them)"
    );
    let arrows = upward_arrows(&manifests);
    assert!(arrows.is_empty(), "dependencies that point up the layers: {arrows:?}");
}

#[test]
fn the_layer_scan_finds_an_arrow_up() {
    let manifests = vec![
        (
            "parsley-store",
            "[dependencies]\nparsley = { path = \"..\" }\nparsley-projector = { path = \"../projector\" }\n"
                .to_string(),
        ),
        (
            "parsley-infra",
            "[dependencies]\nparsley = { path = \"..\" }\n[dev-dependencies]\nparsley-store = \"1\"\n".to_string(),
        ),
    ];
    assert_eq!(upward_arrows(&manifests), vec![("parsley-store".to_string(), "parsley-projector".to_string())]);
}

/// The code of a Rust file outside its test module (`#[cfg(test)] mod ...`, last by
/// convention), comments left out, with line numbers.
fn non_test_code(text: &str) -> Vec<(usize, &str)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim() == "#[cfg(test)]" && lines.get(i + 1).is_some_and(|l| l.trim_start().starts_with("mod ")) {
            break;
        }
        let code = code(line);
        if !code.trim().is_empty() {
            out.push((i + 1, code));
        }
    }
    out
}

/// Fragments of SQL statement text; a string literal holding one is a statement.
const SQL_FRAGMENTS: &[&str] = &[
    "SELECT ",
    "INSERT INTO",
    "UPDATE ",
    "DELETE FROM",
    "CREATE ",
    "DROP ",
    "ALTER ",
    "TRUNCATE ",
    "LISTEN ",
    "NOTIFY ",
    "SET search_path",
];

/// `file:line` of every SQL statement text in the code of `files` (string literals only).
fn sql_statements(root: &Path, files: &[PathBuf]) -> Vec<String> {
    let mut found = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(path).unwrap();
        for (n, line) in non_test_code(&text) {
            let literals: Vec<&str> = line.split('"').skip(1).step_by(2).collect();
            if literals.iter().any(|l| SQL_FRAGMENTS.iter().any(|f| l.contains(f))) {
                found.push(format!("{}:{n}", relative(root, path)));
            }
        }
    }
    found
}

/// The crates whose code is the project's own service code; the store is the one crate
/// allowed SQL. The test kit (scratch databases), the examples (a user's own projection) and
/// every crate's tests and benchmarks may write SQL of their own.
const SERVICE_CRATES: &[&str] = &[
    "src",
    "infra/src",
    "settings/src",
    "projector/src",
    "gateway/src",
    "check/src",
    "demo/src",
    "cli/src",
    "sim/src",
];

#[test]
fn no_sql_is_written_outside_the_store() {
    let root = workspace_root();
    let mut files = Vec::new();
    for dir in SERVICE_CRATES {
        files_with_extension(&root.join(dir), "rs", &mut files);
    }
    assert!(files.len() > 50, "the scan found only {} files", files.len());
    let found = sql_statements(&root, &files);
    assert!(found.is_empty(), "SQL outside the store (move the statement into store/src): {found:?}");
    let mut store = Vec::new();
    files_with_extension(&root.join("store/src"), "rs", &mut store);
    assert!(sql_statements(&root, &store).len() > 20, "the scan finds the store's own statements");
}

#[test]
fn the_sql_scan_finds_a_statement_and_skips_comments_and_tests() {
    let dir = std::env::temp_dir().join(format!("parsley-sql-scan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.rs");
    std::fs::write(
        &bad,
        "//! x\n/// sqlx::query(\"SELECT 1\") in a doc\nfn f() { sqlx::query(\"SELECT 1\"); }\n\
         #[cfg(test)]\nmod tests { fn t() { q(\"DELETE FROM t\"); } }\n",
    )
    .unwrap();
    let found = sql_statements(&dir, &[bad]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found, vec!["bad.rs:3".to_string()]);
}

/// Ways code names the workspace's `migrations/` directory.
const MIGRATIONS_PATHS: &[&str] = &["../migrations", "join(\"migrations\")", "\"migrations/"];

/// Files whose code (comments aside) names the workspace's `migrations/` directory.
fn migrations_readers(root: &Path, files: &[PathBuf]) -> Vec<String> {
    files_whose_code(root, files, |c| MIGRATIONS_PATHS.iter().any(|p| c.contains(p)))
}

#[test]
fn only_the_store_reads_the_migrations_directory() {
    let root = workspace_root();
    assert!(root.join("migrations").is_dir(), "the schema's migrations live in migrations/ at the root");
    let mut files = Vec::new();
    files_with_extension(&root, "rs", &mut files);
    files.retain(|p| !p.ends_with(file!()));
    let readers = migrations_readers(&root, &files);
    assert!(
        readers.iter().any(|r| r.starts_with("store/")),
        "the store embeds migrations/ (the scan should find it): {readers:?}"
    );
    let others: Vec<&String> = readers.iter().filter(|r| !r.starts_with("store/")).collect();
    assert!(others.is_empty(), "code outside the store reads migrations/: {others:?}");
}
