//! The build script of the packages whose binaries say what they were built from
//! (`--version`, `parsley_build_info`): sets `PARSLEY_BUILD_COMMIT` for the package — the
//! variable of that name when the build sets it (an image built without its `.git`), else
//! `git rev-parse --short=12 HEAD`, else `unknown`. It runs again when HEAD moves (a commit, a
//! checkout), not at every build.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

fn main() {
    println!("cargo:rerun-if-env-changed=PARSLEY_BUILD_COMMIT");
    let given = std::env::var("PARSLEY_BUILD_COMMIT").ok().filter(|c| !c.trim().is_empty());
    let commit =
        given.clone().or_else(|| git(&["rev-parse", "--short=12", "HEAD"])).unwrap_or_else(|| "unknown".into());
    // What moves when HEAD does: HEAD itself, the branch's ref file, the packed refs.
    let mut watched: Vec<PathBuf> = Vec::new();
    if given.is_none() {
        if let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) {
            watched.push(head.into());
        }
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            if let Some(path) = git(&["rev-parse", "--git-path", &branch]) {
                watched.push(path.into());
            }
        }
        if let Some(packed) = git(&["rev-parse", "--git-path", "packed-refs"]) {
            watched.push(packed.into());
        }
    }
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let existing: Vec<PathBuf> = watched
        .into_iter()
        .map(|p| if p.is_absolute() { p } else { manifest.join(p) })
        .filter(|p| p.exists())
        .collect();
    for path in &existing {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    // Without git (nothing watched), the variable's directive alone keeps cargo from running
    // this again at every build.
    println!("cargo:rustc-env=PARSLEY_BUILD_COMMIT={commit}");
}
