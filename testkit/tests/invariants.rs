//! Workspace invariants that hold across every crate, checked on the source tree:
//! - `unsafe` code lives only in the audited modules listed in [`UNSAFE_MODULES`], and every
//!   crate inherits the workspace lints (which deny `unsafe_code` everywhere else);
//! - every Rust file starts with a module doc (`//!`) saying what it is.
//!
//! `cargo fmt --check` and `cargo clippy -D warnings` are the other half of the invariant
//! checks; `scripts/test.sh` runs them before the test suite.

use std::path::{Path, PathBuf};

/// The only files allowed `unsafe` (each opts in with `#![allow(unsafe_code)]` and argues
/// every block's safety): librdkafka's topic IDs and its raw header access.
const UNSAFE_MODULES: &[&str] = &["infra/src/topic_id.rs", "infra/src/headers.rs"];

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

/// Files whose code (comments aside) uses `unsafe` or allows it.
fn unsafe_users(root: &Path, files: &[PathBuf]) -> Vec<String> {
    let mut found = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(path).unwrap();
        let uses = text.lines().any(|l| {
            let c = code(l);
            c.contains("unsafe ") || c.contains("unsafe{") || c.contains("allow(unsafe_code)")
        });
        if uses {
            found.push(relative(root, path));
        }
    }
    found.sort();
    found
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
