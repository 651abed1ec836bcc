//! `parsley`: the operator's command line for inspecting `parsley.causes` values, and for
//! signing a development JWT for a gateway that authenticates callers.
//!
//! ```text
//! parsley causes encode          < [{"topic_id": "<uuid>", "partition": 0, "position": 42}, ...]
//! parsley causes decode <hex>
//! parsley dev-token --key <private key PEM> --iss <issuer> --aud <audience> --sub <subject>
//!                   [--kid <kid>] [--alg EdDSA|ES256|RS256|PS256] [--scope "<s> <s>"]
//!                   [--claim name=value]... [--ttl-s <seconds>]
//! ```
//! Exit 0 on success (and for `--help`, `--version`), 2 on a usage error or invalid input (with
//! one line on stderr saying why).

use std::io::{Read, Write};
use std::process::ExitCode;

use clap::{Arg, Command};
use parsley::codec::{self, DecodeError};
use parsley::{CausalPast, ChannelId, TopicId};
use serde::{Deserialize, Serialize};

/// One pair in the CLI's JSON form. Fields are read as wide integers so out-of-range
/// values get a precise message instead of a generic type error.
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct PairJson {
    topic_id: String,
    partition: i64,
    position: i64,
}

/// The command line: `causes encode` and `causes decode <hex>`, parsed by clap (as every
/// binary of the workspace is); a usage error exits 2, like invalid input.
fn command() -> Command {
    Command::new("parsley")
        .version(concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("PARSLEY_BUILD_COMMIT"), ")"))
        .about("Inspect parsley.causes values; sign development JWTs")
        .subcommand_required(true)
        .arg_required_else_help(true)
        .subcommand(
            Command::new("causes")
                .about("Encode or decode a parsley.causes value")
                .subcommand_required(true)
                .arg_required_else_help(true)
                .subcommand(Command::new("encode").about(
                    "read a JSON array of {\"topic_id\", \"partition\", \"position\"} on stdin, \
                     print the canonical parsley.causes value as lowercase hex",
                ))
                .subcommand(
                    Command::new("decode")
                        .about("print the pairs of a parsley.causes value (hex) as that JSON array")
                        .arg(Arg::new("hex").required(true).help("the value, as hex digits")),
                ),
        )
        .subcommand(
            Command::new("dev-token")
                .about(
                    "FOR DEVELOPMENT ONLY: print a JWT signed with a local private key, for a gateway whose \
                     [gateway.auth] trusts that key's JWKS (scripts/compose-secrets.sh makes such a pair)",
                )
                .arg(Arg::new("key").long("key").required(true).help("the private key, PEM (PKCS#8)"))
                .arg(Arg::new("iss").long("iss").required(true).help("the issuer (gateway.auth.issuer)"))
                .arg(Arg::new("aud").long("aud").required(true).help("the audience (gateway.auth.audience)"))
                .arg(Arg::new("sub").long("sub").required(true).help("the subject"))
                .arg(Arg::new("kid").long("kid").help("the key id in the JWKS"))
                .arg(Arg::new("alg").long("alg").default_value("EdDSA").help("EdDSA, ES256, RS256 or PS256"))
                .arg(Arg::new("scope").long("scope").help("space-separated scopes (the scope claim)"))
                .arg(
                    Arg::new("claim")
                        .long("claim")
                        .action(clap::ArgAction::Append)
                        .help("another claim, name=value (a JSON value, or else text); may repeat"),
                )
                .arg(Arg::new("ttl-s").long("ttl-s").default_value("3600").help("lifetime in seconds")),
        )
}

fn main() -> ExitCode {
    let matches = match command().try_get_matches() {
        Ok(m) => m,
        Err(e) => {
            // Help and version print to stdout and succeed; anything else is a usage error.
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    let result = match matches.subcommand() {
        Some(("causes", causes)) => match causes.subcommand() {
            Some(("encode", _)) => encode_stdin(),
            Some(("decode", args)) => decode_hex(args.get_one::<String>("hex").expect("required")),
            _ => unreachable!("clap requires a subcommand"),
        },
        Some(("dev-token", args)) => dev_token(args),
        _ => unreachable!("clap requires a subcommand"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::from(2)
        }
    }
}

/// Signs and prints a development JWT (`dev-token`).
fn dev_token(args: &clap::ArgMatches) -> Result<(), String> {
    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    let arg = |name: &str| args.get_one::<String>(name).cloned();
    let path = arg("key").expect("required");
    let pem = std::fs::read(&path).map_err(|e| format!("cannot read the key {path}: {e}"))?;
    let alg = match arg("alg").as_deref() {
        Some("EdDSA") => Algorithm::EdDSA,
        Some("ES256") => Algorithm::ES256,
        Some("RS256") => Algorithm::RS256,
        Some("PS256") => Algorithm::PS256,
        other => return Err(format!("invalid input: --alg {other:?} is not EdDSA, ES256, RS256 or PS256")),
    };
    let key = match alg {
        Algorithm::EdDSA => EncodingKey::from_ed_pem(&pem),
        Algorithm::ES256 => EncodingKey::from_ec_pem(&pem),
        _ => EncodingKey::from_rsa_pem(&pem),
    }
    .map_err(|e| format!("invalid input: {path} is not a PKCS#8 private key for {alg:?}: {e}"))?;
    let ttl: u64 =
        arg("ttl-s").expect("defaulted").parse().map_err(|_| "invalid input: --ttl-s is not a number".to_string())?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "the clock is before 1970".to_string())?
        .as_secs();
    let mut claims = serde_json::Map::new();
    for extra in args.get_many::<String>("claim").into_iter().flatten() {
        let (name, value) =
            extra.split_once('=').ok_or_else(|| format!("invalid input: --claim {extra:?} is not name=value"))?;
        let value = serde_json::from_str(value).unwrap_or_else(|_| serde_json::Value::String(value.to_string()));
        claims.insert(name.to_string(), value);
    }
    if let Some(scope) = arg("scope") {
        claims.insert("scope".into(), scope.into());
    }
    claims.insert("iss".into(), arg("iss").expect("required").into());
    claims.insert("aud".into(), arg("aud").expect("required").into());
    claims.insert("sub".into(), arg("sub").expect("required").into());
    claims.insert("iat".into(), now.into());
    claims.insert("exp".into(), (now + ttl).into());
    let mut header = Header::new(alg);
    header.kid = arg("kid");
    let jwt = jsonwebtoken::encode(&header, &claims, &key).map_err(|e| format!("cannot sign: {e}"))?;
    println!("{jwt}");
    Ok(())
}

fn encode_stdin() -> Result<(), String> {
    let mut input = String::new();
    std::io::stdin().read_to_string(&mut input).map_err(|e| format!("cannot read stdin: {e}"))?;
    let past = parse_pairs(&input)?;
    let bytes = codec::encode(&past);
    let mut hex = String::with_capacity(bytes.len() * 2);
    for b in &bytes {
        hex.push_str(&format!("{b:02x}"));
    }
    println!("{hex}");
    Ok(())
}

/// Parses the CLI's JSON array into a past; several entries on one channel compress to the
/// greatest position.
fn parse_pairs(input: &str) -> Result<CausalPast, String> {
    let pairs: Vec<PairJson> = serde_json::from_str(input).map_err(|e| {
        format!("invalid input: expected a JSON array of {{\"topic_id\", \"partition\", \"position\"}} objects: {e}")
    })?;
    let mut out = Vec::with_capacity(pairs.len());
    for (i, pair) in pairs.iter().enumerate() {
        let topic: TopicId = pair.topic_id.parse().map_err(|e| format!("invalid input: entry {i}: {e}"))?;
        if topic.is_zero() {
            return Err(format!("invalid input: entry {i}: the all-zero topic ID is not a topic"));
        }
        if !(0..=i64::from(parsley::channel::MAX_PARTITION)).contains(&pair.partition) {
            return Err(format!("invalid input: entry {i}: partition {} is outside 0..=2147483647", pair.partition));
        }
        if pair.position < 0 {
            return Err(format!("invalid input: entry {i}: position {} is negative", pair.position));
        }
        out.push((ChannelId::new(topic, pair.partition as u32), pair.position));
    }
    Ok(CausalPast::from_pairs(out))
}

fn decode_hex(hex: &str) -> Result<(), String> {
    let hex = hex.trim();
    let bytes = parse_hex(hex).map_err(|e| format!("UNDECODABLE_METADATA: {e}"))?;
    // The operator is inspecting, not receiving: no budget applies beyond what fits in memory.
    let past = codec::decode(&bytes, usize::MAX).map_err(|e| match e {
        DecodeError::Undecodable(m) => format!("UNDECODABLE_METADATA: {m} ({})", m.class()),
        DecodeError::OverBudget { .. } => format!("METADATA_BUDGET_EXCEEDED: {e}"),
    })?;
    let json: Vec<PairJson> = past
        .iter()
        .map(|(c, p)| PairJson { topic_id: c.topic.to_string(), partition: i64::from(c.partition), position: p })
        .collect();
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, &json).map_err(|e| format!("cannot write: {e}"))?;
    writeln!(out).map_err(|e| format!("cannot write: {e}"))?;
    Ok(())
}

fn parse_hex(hex: &str) -> Result<Vec<u8>, String> {
    if let Some((i, c)) = hex.char_indices().find(|(_, c)| !c.is_ascii_hexdigit()) {
        return Err(format!("{c:?} at character {i} is not a hex digit"));
    }
    if !hex.len().is_multiple_of(2) {
        return Err(format!("the hex string has an odd number of digits ({})", hex.len()));
    }
    Ok(hex
        .as_bytes()
        .chunks_exact(2)
        .map(|pair| {
            let digit = |b: u8| (b as char).to_digit(16).expect("checked above") as u8;
            (digit(pair[0]) << 4) | digit(pair[1])
        })
        .collect())
}
