//! The `parsley causes` operator commands, run as a process.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn run(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_parsley"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn parsley");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

const A: &str = "01234567-89ab-cdef-fedc-ba9876543210";
const B: &str = "81234567-89ab-cdef-fedc-ba9876543210";

#[test]
fn encode_compresses_sorts_and_prints_lowercase_hex() {
    let input = format!(
        r#"[{{"topic_id":"{B}","partition":0,"position":1}},
            {{"topic_id":"{A}","partition":3,"position":9}},
            {{"topic_id":"{A}","partition":3,"position":12}}]"#
    );
    let out = run(&["causes", "encode"], &input);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let expected = concat!(
        "0102",
        "0123456789abcdeffedcba9876543210",
        "01",
        "03",
        "000000000000000c",
        "8123456789abcdeffedcba9876543210",
        "01",
        "00",
        "0000000000000001",
        "\n"
    );
    assert_eq!(text(&out.stdout), expected);
}

#[test]
fn decode_prints_canonical_json_and_round_trips() {
    let input = format!(
        r#"[{{"topic_id":"{B}","partition":200,"position":7}},{{"topic_id":"{A}","partition":0,"position":0}}]"#
    );
    let hex = text(&run(&["causes", "encode"], &input).stdout);
    let out = run(&["causes", "decode", hex.trim()], "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let expected = format!(
        r#"[{{"topic_id":"{A}","partition":0,"position":0}},{{"topic_id":"{B}","partition":200,"position":7}}]"#
    );
    assert_eq!(text(&out.stdout).trim(), expected);
    let again = run(&["causes", "encode"], &text(&out.stdout));
    assert_eq!(text(&again.stdout), hex);
}

#[test]
fn undecodable_values_say_so_on_one_line() {
    for (hex, needle) in [
        ("0102", "truncated"),
        ("0200", "unknown version"),
        ("010", "odd number"),
        ("01zz", "not a hex digit"),
        ("01é0", "not a hex digit"),
        ("010000", "trailing"),
    ] {
        let out = run(&["causes", "decode", hex], "");
        assert_eq!(out.status.code(), Some(2), "{hex}");
        let err = text(&out.stderr);
        assert!(err.starts_with("UNDECODABLE_METADATA: "), "{hex}: {err}");
        assert!(err.contains(needle), "{hex}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{hex}: {err}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn invalid_encode_input_exits_2_with_a_reason() {
    let zero = "00000000-0000-0000-0000-000000000000";
    for (input, needle) in [
        (format!(r#"[{{"topic_id":"{A}","partition":0,"position":-1}}]"#), "negative"),
        (format!(r#"[{{"topic_id":"{zero}","partition":0,"position":1}}]"#), "all-zero"),
        (format!(r#"[{{"topic_id":"{A}","partition":2147483648,"position":1}}]"#), "partition"),
        (format!(r#"[{{"topic_id":"{A}","partition":-1,"position":1}}]"#), "partition"),
        ("not json".to_string(), "JSON"),
        (r#"[{"topic_id":"nope","partition":0,"position":1}]"#.to_string(), "UUID"),
    ] {
        let out = run(&["causes", "encode"], &input);
        assert_eq!(out.status.code(), Some(2), "{input}");
        assert!(text(&out.stderr).contains(needle), "{input}: {}", text(&out.stderr));
        assert!(out.stdout.is_empty());
    }
    assert_eq!(run(&["causes"], "").status.code(), Some(2));
}

#[test]
fn dev_token_signs_a_jwt_the_fixture_key_checks() {
    let key = concat!(env!("CARGO_MANIFEST_DIR"), "/../gateway/tests/fixtures/jwt/ed-1.key.pem");
    let out = run(
        &[
            "dev-token",
            "--key",
            key,
            "--kid",
            "ed-1",
            "--iss",
            "https://dev",
            "--aud",
            "parsley",
            "--sub",
            "alice",
            "--scope",
            "orders:write",
            "--claim",
            "tenant=acme",
            "--claim",
            "level=3",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let jwt = text(&out.stdout).trim().to_string();
    let parts: Vec<&str> = jwt.split('.').collect();
    assert_eq!(parts.len(), 3, "{jwt}");
    use std::io::Read as _;
    let decode = |part: &str| {
        let mut padded = part.replace('-', "+").replace('_', "/");
        while !padded.len().is_multiple_of(4) {
            padded.push('=');
        }
        let mut child = Command::new("base64").arg("-d").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(padded.as_bytes()).unwrap();
        let mut out = String::new();
        child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        child.wait().unwrap();
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let (header, claims) = (decode(parts[0]), decode(parts[1]));
    assert_eq!((header["alg"].as_str(), header["kid"].as_str()), (Some("EdDSA"), Some("ed-1")));
    assert_eq!(claims["sub"], "alice");
    assert_eq!(claims["tenant"], "acme");
    assert_eq!(claims["level"], 3);
    assert_eq!(claims["scope"], "orders:write");
    assert!(claims["exp"].as_u64().unwrap() > claims["iat"].as_u64().unwrap());
}

#[test]
fn dev_token_refuses_a_key_that_is_not_one() {
    let out = run(&["dev-token", "--key", "/dev/null", "--iss", "i", "--aud", "a", "--sub", "s"], "");
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("not a PKCS#8 private key"), "{}", text(&out.stderr));
}

#[test]
fn version_names_the_package_and_the_build_commit() {
    for flag in ["--version", "-V"] {
        let out = run(&[flag], "");
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let stdout = text(&out.stdout);
        assert!(stdout.starts_with(&format!("parsley {} (commit ", env!("CARGO_PKG_VERSION"))), "{stdout}");
        assert!(stdout.trim_end().ends_with(')') && !stdout.contains("(commit )"), "{stdout}");
    }
    assert_eq!(run(&["--nope"], "").status.code(), Some(2), "a usage error");
}
