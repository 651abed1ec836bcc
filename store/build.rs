//! Embeds the schema migrations: every `<version>_<description>.sql` in the workspace's
//! `migrations/`, in file-name order, as the `MIGRATIONS` list `src/migrations.rs` includes.
//! No list is kept by hand: a file added to the directory is embedded on the next build.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let dir = manifest.join("../migrations");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading the migrations directory {}: {e}", dir.display()))
        .map(|entry| entry.expect("a migrations directory entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".sql"))
        .collect();
    names.sort();
    let mut out = String::from("&[\n");
    for name in &names {
        let path = dir.join(name).canonicalize().expect("a migration's path");
        println!("cargo:rerun-if-changed={}", path.display());
        out.push_str(&format!("    ({name:?}, include_str!({:?})),\n", path.display().to_string()));
    }
    out.push_str("]\n");
    let target = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("migrations.rs");
    std::fs::write(&target, out).expect("writing the embedded migrations list");
}
