//! The binary's contract on a saved history: `parsley-check verify FILE` prints one JSON line
//! on stdout and exits 1 on a violation (a read that misses the session's own write); and
//! runs against a live stack ([`stack`]).

use std::process::Command;

mod stack;

#[test]
fn verify_prints_one_json_line_and_fails_on_a_violation() {
    let path = std::env::temp_dir().join(format!("parsley-check-it-{}.jsonl", std::process::id()));
    std::fs::write(
        &path,
        concat!(
            r#"{"type":"session","session":1,"at_ms":0}"#,
            "\n",
            r#"{"type":"write","session":1,"seq":1,"key":"k","apply":"replace","outcome":"ok","gateway":0,"start_ms":0,"end_ms":1}"#,
            "\n",
            r#"{"type":"read","session":1,"seq":2,"key":"k","outcome":"not_found","gateway":0,"start_ms":1,"end_ms":2}"#,
            "\n"
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_parsley-check")).arg("verify").arg(&path).output().unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    let summary: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(summary["violations"], 1, "{summary}");
    assert_eq!(summary["by_kind"]["read-your-writes"], 1, "{summary}");
}
