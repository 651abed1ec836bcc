//! Parts 2 and 3: sessions through the gateway. A write answered with a sealed token, read
//! back at once with that token (the gateway waits for the projector if it must); a payment
//! written with the token carries the order's coordinate in `parsley.causes`; a tampered
//! token is refused. Then, with the projector stopped, a session's read is refused with the
//! gaps (never served stale), and served once the projector is back.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context as _};
use parsley::channel::ChannelId;
use parsley::CausalPast;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};

use crate::context::{heading, held, say, wait_for, Coordinate, Demo, Topic, KAFKA_TIMEOUT};
use crate::http::Response;

/// The largest `parsley.causes` value the demo decodes (the projector's default budget).
const METADATA_BUDGET: usize = 262_144;
/// How long a read may keep answering 503 while a restarted projector catches up.
const RECOVERY_WITHIN: Duration = Duration::from_secs(60);

/// A 201 from `POST /v1/topics/{topic}/records`: where the record went, and the new token.
struct Written {
    at: Coordinate,
    token: String,
}

async fn write(demo: &Demo, topic: &Topic, key: &str, value: &Value, token: Option<&str>) -> anyhow::Result<Written> {
    let r = demo.post_record(topic, key, value, token).await?;
    ensure!(r.status == 201, "POST {} answered {}: {}", topic.name, r.status, String::from_utf8_lossy(&r.body));
    let body = r.json()?;
    ensure!(body["topic"] == topic.name.as_str(), "the 201 names topic {}, not {}", body["topic"], topic.name);
    let partition = body["partition"].as_u64().and_then(|p| u32::try_from(p).ok());
    let offset = body["offset"].as_i64();
    let (Some(partition), Some(offset)) = (partition, offset) else { bail!("the 201 body has no coordinate: {body}") };
    let token = session_token(&r)?;
    say(format!(
        "POST /v1/topics/{}/records {} -> 201 Created, {}/{partition}@{offset}, new Parsley-Session ({} chars)",
        topic.name,
        json!({"key": key, "value": value}),
        topic.name,
        token.len()
    ));
    Ok(Written { at: Coordinate { partition, offset }, token })
}

fn session_token(r: &Response) -> anyhow::Result<String> {
    r.header("parsley-session")
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .ok_or_else(|| anyhow!("the {} response carries no Parsley-Session token", r.status))
}

/// A 200 with the expected document, and the refreshed token.
fn expect_document(r: &Response, expected: &Value, version: i64) -> anyhow::Result<String> {
    ensure!(r.status == 200, "GET document answered {}: {}", r.status, String::from_utf8_lossy(&r.body));
    let body = r.json()?;
    ensure!(
        body["document"] == *expected && body["version"] == version,
        "expected {expected} at version {version}, got {body}"
    );
    session_token(r)
}

pub async fn read_your_writes(demo: &Demo) -> anyhow::Result<()> {
    heading("2. Read-your-writes through the gateway");
    say("A client writes through the gateway and gets a sealed session token; reads with it see the write.");
    let key = demo.key("web");
    let order = json!({"item": "kettle", "total": 45, "status": "placed"});
    let written = write(demo, &demo.orders, &key, &order, None).await?;

    let checks_before = demo.gate_checks().await?;
    let started = Instant::now();
    let r = demo.get_document(&key, Some(&written.token)).await?;
    let waited = started.elapsed();
    let checks = demo.gate_checks().await? - checks_before;
    let token = expect_document(&r, &order, 1)?;
    say(format!(
        "GET /v1/models/{}/documents/{key} with that token -> 200 after {} ms: {} (version 1)",
        demo.model,
        waited.as_millis(),
        order
    ));
    if checks > 1 {
        say(format!(
            "the gateway checked the clock {checks} times: the read waited for the projector to apply the write"
        ));
    } else {
        say("the gateway checked the clock once: the projector had already applied the write");
    }
    held("the read, sent right after the write, returned the value just written");

    let payment = json!({"status": "paid", "paid": 45});
    let paid = write(demo, &demo.payments, &key, &payment, Some(&token)).await?;
    let stamped = stamped_causes(demo, &demo.payments, paid.at).await?;
    let order_channel = ChannelId::new(demo.orders.id, written.at.partition);
    say(format!("the gateway stamped it: parsley.causes = {}", demo.describe_past(&stamped)));
    ensure!(
        stamped.get(&order_channel).is_some_and(|p| p >= written.at.offset),
        "the payment written with the session should name the order {} as a cause; it names {}",
        demo.describe(order_channel, written.at.offset),
        demo.describe_past(&stamped)
    );
    held("a write made with the session carries the session's past: the payment names the order as its cause");

    let r = demo.get_document(&key, Some(&paid.token)).await?;
    let merged = json!({"item": "kettle", "total": 45, "status": "paid", "paid": 45});
    let token = expect_document(&r, &merged, 2)?;
    say(format!("GET with the newest token -> 200: {merged} (version 2)"));
    held("the session reads its second write too");

    let tampered = tamper(&token);
    let r = demo.get_document(&key, Some(&tampered)).await?;
    let problem = r.json().unwrap_or(Value::Null);
    say(format!(
        "GET with the token altered in one character -> {} {}: {}",
        r.status,
        problem["title"].as_str().unwrap_or("?"),
        problem["detail"].as_str().unwrap_or("?")
    ));
    ensure!(
        r.status == 400
            && r.header("content-type").is_some_and(|c| c.starts_with("application/problem+json"))
            && problem["type"] == "https://parsley.dev/problems/token-invalid",
        "a tampered token must be refused with 400 token-invalid; got {} {}",
        r.status,
        problem
    );
    held("the tampered token is refused with a problem document (type token-invalid), never read as an empty session");
    Ok(())
}

/// The token with one character changed, away from both ends (the last character of
/// unpadded base64 may carry unused bits; the first ones are the envelope's format and key
/// id, which would be refused as malformed rather than as tampered).
fn tamper(token: &str) -> String {
    let mut chars: Vec<char> = token.chars().collect();
    let i = chars.len() - 8;
    chars[i] = if chars[i] == 'A' { 'B' } else { 'A' };
    chars.into_iter().collect()
}

/// Reads back the `parsley.causes` header of the record at `at` on `topic`.
async fn stamped_causes(demo: &Demo, topic: &Topic, at: Coordinate) -> anyhow::Result<CausalPast> {
    let consumer: StreamConsumer = parsley_infra::kafka::consumer_config(&demo.cluster, "parsley-demo-check")
        .create()
        .context("creating a Kafka consumer")?;
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(&topic.name, at.partition as i32, Offset::Offset(at.offset))
        .context("building the assignment")?;
    consumer.assign(&assignment).context("assigning the partition")?;
    let message = tokio::time::timeout(KAFKA_TIMEOUT, consumer.recv())
        .await
        .map_err(|_| {
            anyhow!("the record at {}/{}@{} was not read within {KAFKA_TIMEOUT:?}", topic.name, at.partition, at.offset)
        })?
        .context("reading the record back")?;
    ensure!(message.offset() == at.offset, "read offset {} instead of {}", message.offset(), at.offset);
    // Header names read as bytes: rdkafka's own accessors panic on a name that is not UTF-8.
    let headers = parsley_infra::headers::message_headers(&message);
    ensure!(!headers.is_empty(), "the record has no headers, so no parsley.causes");
    let values: Vec<Option<&[u8]>> =
        headers.iter().filter(|(name, _)| name == b"parsley.causes").map(|(_, v)| v.as_deref()).collect();
    parsley::codec::decode_headers(&values, METADATA_BUDGET).map_err(|e| anyhow!("the stamped parsley.causes: {e}"))
}

/// With the projector stopped: a write, a read without a session (404 at once: it is owed
/// nothing), and the writer's read (503 with the gap). Saves the session to `state` for
/// [`recover`].
pub async fn outage(demo: &Demo, state: &Path) -> anyhow::Result<()> {
    heading("3. The projector is stopped: a session's read is refused, never served stale");
    say("A write the projector cannot apply yet: the writer's read answers 503 with the gap, not old data.");
    let key = demo.key("outage");
    let order = json!({"item": "mug", "total": 12, "status": "placed"});
    let written = write(demo, &demo.orders, &key, &order, None).await?;

    let r = demo.get_document(&key, None).await?;
    ensure!(r.status == 404, "a sessionless read should find nothing yet; got {}", r.status);
    say(format!("GET /v1/models/{}/documents/{key} without a session -> 404 at once (it is owed nothing)", demo.model));

    let r = demo.get_document(&key, Some(&written.token)).await?;
    let problem = r.json().unwrap_or(Value::Null);
    ensure!(
        r.status == 503 && problem["type"] == "https://parsley.dev/problems/not-yet-covered",
        "the writer's read should be refused 503 not-yet-covered while the projector is stopped; got {} {problem}",
        r.status
    );
    let gaps = problem["gaps"].as_array().cloned().unwrap_or_default();
    say(format!(
        "GET with the writer's token -> 503 {} after {} ms, Retry-After: {}",
        problem["title"].as_str().unwrap_or("?"),
        problem["waited_ms"],
        r.header("retry-after").unwrap_or("none")
    ));
    for g in &gaps {
        say(format!(
            "    gap: {}/{} required {}, recorded {}, tasks {}",
            g["topic"].as_str().unwrap_or("?"),
            g["partition"],
            g["required"],
            g["recorded"].as_i64().map_or_else(|| "none".to_string(), |r| r.to_string()),
            g["tasks"]
        ));
    }
    let names_the_write = gaps.iter().any(|g| {
        g["topic"] == demo.orders.name.as_str()
            && g["partition"] == written.at.partition
            && g["required"] == written.at.offset
    });
    ensure!(names_the_write, "the 503 should name the write's channel and position as a gap: {problem}");
    held(
        "the session is refused with its gap (the write's own coordinate), not served a snapshot that lacks its write",
    );

    let saved = json!({"key": key, "value": order, "token": written.token});
    write_private(state, &saved.to_string())?;
    Ok(())
}

/// With the projector started again: the saved session's read is served.
pub async fn recover(demo: &Demo, state: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(state).with_context(|| format!("reading {}", state.display()))?;
    let _ = std::fs::remove_file(state);
    let saved: Value = serde_json::from_str(&text).context("the saved session is not JSON")?;
    let (Some(key), Some(token)) = (saved["key"].as_str(), saved["token"].as_str()) else {
        bail!("the saved session lacks a key or a token");
    };
    say("projector started again");
    let started = Instant::now();
    let mut attempts = 0;
    let r = wait_for("the restarted projector to cover the session", RECOVERY_WITHIN, || {
        attempts += 1;
        async {
            let r = demo.get_document(key, Some(token)).await?;
            Ok((r.status != 503).then_some(r))
        }
    })
    .await?;
    expect_document(&r, &saved["value"], 1)?;
    say(format!(
        "GET with the same token -> 200 after {} ms ({attempts} attempt(s)): {}",
        started.elapsed().as_millis(),
        saved["value"]
    ));
    held("once the projector caught up, the same session reads its write");
    Ok(())
}

/// Writes `text` to `path`, readable by its owner only (it holds a session token).
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes()).with_context(|| format!("writing {}", path.display()))
}
