//! Architecture invariant: the `parsley` library performs no I/O, reads no clock and draws
//! no randomness, and depends on nothing but error derivation. This test fails if its
//! dependencies or its source say otherwise. (The operator CLI, which reads stdin and
//! speaks JSON, is a host like any other: the `parsley-cli` crate.)

use std::path::{Path, PathBuf};

/// Dependencies the core may have: error derivation, nothing else.
const ALLOWED_DEPENDENCIES: &[&str] = &["thiserror"];

/// Source fragments that mean I/O, time, randomness, concurrency or a substrate client.
const FORBIDDEN: &[&str] = &[
    "std::time",
    "Instant::",
    "SystemTime",
    "std::net",
    "TcpStream",
    "UdpSocket",
    "std::fs",
    "std::io",
    "std::env",
    "std::process",
    "std::thread",
    "rand::",
    "getrandom",
    "tokio",
    "sqlx",
    "rdkafka",
    "println!",
    "eprintln!",
    "print!(",
    "HashMap",
    "HashSet",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "bin") {
                continue;
            }
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every (file, line, fragment) where a forbidden fragment occurs in code (not in `//`
/// comments, where the invariant may be described).
fn violations(files: &[(String, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for (name, text) in files {
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for fragment in FORBIDDEN {
                if code.contains(fragment) {
                    found.push(format!("{name}:{}: {fragment}", i + 1));
                }
            }
        }
    }
    found
}

#[test]
fn core_source_touches_no_clock_randomness_io_or_substrate() {
    let mut paths = Vec::new();
    rust_files(&root().join("src"), &mut paths);
    assert!(paths.len() >= 8, "the scan found only {paths:?}: is it looking in the right place?");
    let files: Vec<(String, String)> =
        paths.iter().map(|p| (p.display().to_string(), std::fs::read_to_string(p).unwrap())).collect();
    let found = violations(&files);
    assert!(found.is_empty(), "the core crate must stay pure:\n{}", found.join("\n"));
}

#[test]
fn the_scan_catches_what_it_looks_for() {
    let sample = vec![(
        "sample.rs".to_string(),
        "use std::time::Instant;\nlet x = tokio::spawn(f);\n// std::fs in a comment is fine\n".to_string(),
    )];
    let found = violations(&sample);
    assert_eq!(found, vec!["sample.rs:1: std::time", "sample.rs:2: tokio"]);
}

/// The `[dependencies]` table of the root manifest, by name.
fn dependencies(manifest: &str) -> Vec<String> {
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

#[test]
fn core_depends_on_no_io_crate() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let deps = dependencies(&manifest);
    assert!(!deps.is_empty(), "no [dependencies] found: the manifest parse is broken");
    let extra: Vec<&String> = deps.iter().filter(|d| !ALLOWED_DEPENDENCIES.contains(&d.as_str())).collect();
    assert!(
        extra.is_empty(),
        "the core crate gained dependencies {extra:?}; only {ALLOWED_DEPENDENCIES:?} are allowed"
    );
    assert!(!manifest.contains("[target."), "platform-specific dependency tables would escape this check");
}
