//! `parsley`: the operator's command line for inspecting `parsley.causes` values.
//!
//! ```text
//! parsley causes encode          < [{"topic_id": "<uuid>", "partition": 0, "position": 42}, ...]
//! parsley causes decode <hex>
//! ```
//! Exit 0 on success, 2 on invalid input (with one line on stderr saying why).

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
        .about("Inspect parsley.causes values")
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
