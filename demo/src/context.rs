//! What every step of the demo shares: the configuration (`config/demo.toml`, read with the
//! store's parser and override rule), the model's two topics with their broker IDs, Kafka producers, the
//! gateway's address, the gateway's status report, and the narrative's output helpers.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context as _};
use parsley::channel::{ChannelId, TopicId};
use parsley::CausalPast;
use parsley_settings::config::{Apply, Config, GATEWAY_SECTION};
use parsley_settings::overrides::{self, Env};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use serde_json::Value;

use crate::http;

/// Partitions of each demo topic: the model runs this many tasks.
pub const PARTITIONS: u32 = 4;
/// How long one Kafka request may take.
pub const KAFKA_TIMEOUT: Duration = Duration::from_secs(15);
/// How long the demo waits for something the projector is expected to do soon.
pub const EXPECT_WITHIN: Duration = Duration::from_secs(30);

/// One of the model's topics.
#[derive(Clone, Debug)]
pub struct Topic {
    pub name: String,
    pub id: TopicId,
}

/// Where a record landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coordinate {
    pub partition: u32,
    pub offset: i64,
}

pub struct Demo {
    /// The cluster and its `[kafka.properties]`, for every client the demo makes.
    pub cluster: parsley_infra::kafka::Cluster,
    pub model: String,
    /// The topic applied with `replace`.
    pub orders: Topic,
    /// The topic applied with `merge`.
    pub payments: Topic,
    pub gateway: http::Client,
    /// The gateway's admin listener (`/v1/status`, `/metrics`).
    pub admin: http::Client,
    /// Makes this run's keys unique (`make demo` passes a timestamp).
    pub run: String,
}

/// The configuration file and the names in it that the demo relies on: one model with one
/// `replace` topic (the orders) and one `merge` topic (the payments).
pub struct Declared {
    pub config: Config,
    pub model: String,
    pub orders: String,
    pub payments: String,
}

impl Declared {
    pub fn load(path: &Path) -> anyhow::Result<Declared> {
        Declared::from_config(Config::load(path)?).with_context(|| format!("in {}", path.display()))
    }

    fn from_config(config: Config) -> anyhow::Result<Declared> {
        let [model] = config.models.as_slice() else {
            bail!("the configuration must declare exactly one [[models]] entry for the demo");
        };
        let with = |apply: Apply| -> anyhow::Result<String> {
            let names: Vec<&str> = model.topics.iter().filter(|t| t.apply == apply).map(|t| t.name.as_str()).collect();
            match names.as_slice() {
                [one] => Ok(one.to_string()),
                _ => {
                    bail!("model {} must receive exactly one topic with apply = {apply:?}, found {names:?}", model.name)
                }
            }
        };
        let orders = with(Apply::Replace)?;
        let payments = with(Apply::Merge)?;
        ensure!(model.topics.len() == 2, "model {} must receive exactly two topics", model.name);
        Ok(Declared { model: model.name.clone(), orders, payments, config })
    }
}

impl Demo {
    /// Reads the configuration and resolves the topics' IDs (they must exist: `prepare`
    /// creates them).
    pub async fn load(path: &Path, run: &str) -> anyhow::Result<Demo> {
        let declared = Declared::load(path)?;
        let cluster = declared.config.kafka.cluster();
        let names = vec![declared.orders.clone(), declared.payments.clone()];
        let described = parsley_infra::describe_topics(&cluster, &names, KAFKA_TIMEOUT)
            .await
            .context("resolving the demo topics (does `parsley-demo prepare` run first?)")?;
        let topic = |i: usize| Topic { name: described[i].name.clone(), id: TopicId::from_bytes(described[i].id) };
        Ok(Demo {
            gateway: http::Client::new(&gateway_listen(&declared.config)?, Duration::from_secs(15)),
            admin: http::Client::new(
                &gateway_setting(&declared.config, "admin_listen", "127.0.0.1:9091")?,
                Duration::from_secs(15),
            ),
            cluster,
            model: declared.model,
            orders: topic(0),
            payments: topic(1),
            run: run.to_string(),
        })
    }

    /// A key of this run, e.g. `order-20250102-030405-held`.
    pub fn key(&self, what: &str) -> String {
        format!("order-{}-{what}", self.run)
    }

    /// The task (and partition) a key belongs to: murmur2 of its bytes, as the producers
    /// partition it.
    pub fn partition_of(&self, key: &str) -> u32 {
        parsley::murmur2::partition_for_key(key.as_bytes(), PARTITIONS)
    }

    /// `topic/partition@offset`, naming the topic by its name when it is one of the demo's.
    pub fn describe(&self, channel: ChannelId, offset: i64) -> String {
        let name = [&self.orders, &self.payments]
            .into_iter()
            .find(|t| t.id == channel.topic)
            .map_or_else(|| channel.topic.to_string(), |t| t.name.clone());
        format!("{name}/{}@{offset}", channel.partition)
    }

    /// A `parsley.causes` value in readable form.
    pub fn describe_past(&self, past: &CausalPast) -> String {
        let pairs: Vec<String> = past.iter().map(|(c, p)| self.describe(c, p)).collect();
        format!("{{{}}}", pairs.join(", "))
    }

    pub fn producer(&self) -> anyhow::Result<FutureProducer> {
        parsley_infra::kafka::producer_config(&self.cluster).create().context("creating a Kafka producer")
    }

    /// A transactional producer under the demo's fixed `transactional.id`: initialising it
    /// aborts a transaction an interrupted earlier run left open.
    pub fn transactional_producer(&self) -> anyhow::Result<FutureProducer> {
        use rdkafka::producer::Producer as _;
        let producer: FutureProducer =
            parsley_infra::kafka::transactional_producer_config(&self.cluster, "parsley-demo")
                .create()
                .context("creating a transactional Kafka producer")?;
        // The first transaction on a fresh broker waits for its transaction-state topic.
        tokio::task::block_in_place(|| producer.init_transactions(Duration::from_secs(60)))
            .context("initialising Kafka transactions")?;
        Ok(producer)
    }

    /// Produces one JSON record keyed `key` (partitioned by murmur2, like every producer of
    /// the project) and returns where the broker put it.
    pub async fn produce(
        &self,
        producer: &FutureProducer,
        topic: &Topic,
        key: &str,
        value: &Value,
        causes: Option<&CausalPast>,
    ) -> anyhow::Result<Coordinate> {
        let payload = value.to_string();
        let causes = causes.map(CausalPast::encode);
        let deadline = Instant::now() + KAFKA_TIMEOUT;
        loop {
            let mut record: FutureRecord<'_, str, str> = FutureRecord::to(&topic.name).key(key).payload(&payload);
            if let Some(c) = &causes {
                record = record
                    .headers(OwnedHeaders::new().insert(Header { key: "parsley.causes", value: Some(c.as_slice()) }));
            }
            match producer.send(record, KAFKA_TIMEOUT).await {
                Ok(delivery) => {
                    let partition = u32::try_from(delivery.partition).context("a negative partition")?;
                    return Ok(Coordinate { partition, offset: delivery.offset });
                }
                // A topic created a moment ago may not be in the producer's metadata yet.
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::UnknownPartition), _))
                    if Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err((e, _)) => return Err(anyhow!(e)).with_context(|| format!("producing to {}", topic.name)),
            }
        }
    }

    /// `GET /v1/status` for the demo's model.
    pub async fn status(&self) -> anyhow::Result<ModelStatus> {
        let r = self.admin.get("/v1/status", &[]).await?;
        ensure!(r.status == 200, "GET /v1/status answered {}: {}", r.status, String::from_utf8_lossy(&r.body));
        let body = r.json()?;
        let model = body["models"]
            .as_array()
            .and_then(|ms| ms.iter().find(|m| m["model"] == self.model.as_str()))
            .ok_or_else(|| anyhow!("GET /v1/status does not list model {}", self.model))?;
        Ok(ModelStatus(model.clone()))
    }

    /// The gateway's `parsley_gateway_gate_checks_total` for the model: one per gate
    /// transaction, so a read that waited counts more than one.
    pub async fn gate_checks(&self) -> anyhow::Result<u64> {
        let r = self.admin.get("/metrics", &[]).await?;
        ensure!(r.status == 200, "GET /metrics answered {}", r.status);
        let series = format!("parsley_gateway_gate_checks_total{{model=\"{}\"}} ", self.model);
        let text = String::from_utf8_lossy(&r.body);
        match text.lines().find_map(|l| l.strip_prefix(series.as_str())) {
            None => Ok(0),
            Some(v) => v.trim().parse::<f64>().map(|v| v as u64).with_context(|| format!("metric value {v:?}")),
        }
    }

    /// `GET /v1/models/{model}/documents/{key}`, with the session token if given.
    pub async fn get_document(&self, key: &str, token: Option<&str>) -> anyhow::Result<http::Response> {
        let path = format!("/v1/models/{}/documents/{key}", self.model);
        match token {
            Some(t) => self.gateway.get(&path, &[("Parsley-Session", t)]).await,
            None => self.gateway.get(&path, &[]).await,
        }
    }

    /// `POST /v1/topics/{topic}/records`, with the session token if given.
    pub async fn post_record(
        &self,
        topic: &Topic,
        key: &str,
        value: &Value,
        token: Option<&str>,
    ) -> anyhow::Result<http::Response> {
        let path = format!("/v1/topics/{}/records", topic.name);
        let body = serde_json::json!({"key": key, "value": value});
        match token {
            Some(t) => self.gateway.post_json(&path, &[("Parsley-Session", t)], &body).await,
            None => self.gateway.post_json(&path, &[], &body).await,
        }
    }
}

/// The gateway's address from `[gateway] listen` (default `127.0.0.1:8080`), overridden by
/// the environment like the gateway does (`PARSLEY_GATEWAY__LISTEN`, `PARSLEY_GATEWAY_LISTEN`).
pub fn gateway_listen(config: &Config) -> anyhow::Result<String> {
    gateway_setting(config, "listen", "127.0.0.1:8080")
}

/// An address setting of `[gateway]`, overridden by the environment by the one rule the
/// gateway follows (an empty value leaves the file's).
fn gateway_setting(config: &Config, key: &str, default: &str) -> anyhow::Result<String> {
    let overrides = overrides::overrides(&Env::process(), |section| section == GATEWAY_SECTION)?;
    if let Some(o) = overrides.iter().find(|o| o.path == [GATEWAY_SECTION, key]) {
        if !o.value.trim().is_empty() {
            return Ok(o.value.trim().to_string());
        }
    }
    match config.gateway.as_ref().and_then(|g| g.get(key)) {
        None => Ok(default.to_string()),
        Some(toml_value) => toml_value
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("gateway.{key} must be a string \"host:port\"")),
    }
}

/// One model of `GET /v1/status`.
#[derive(Clone, Debug)]
pub struct ModelStatus(pub Value);

/// One channel of one task in [`ModelStatus`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelStatus {
    pub task_status: String,
    pub fed_up_to: Option<i64>,
    pub settled: Option<i64>,
    pub held: u64,
    pub head: Option<i64>,
    /// The head's blockers: (topic name, partition, required, settled).
    pub blockers: Vec<(String, u32, i64, Option<i64>)>,
}

impl ModelStatus {
    fn tasks(&self) -> &[Value] {
        self.0["tasks"].as_array().map(Vec::as_slice).unwrap_or_default()
    }

    /// The status of `topic`'s partition `partition` in task `partition`, if the task
    /// reports it.
    pub fn channel(&self, topic: &str, partition: u32) -> Option<ChannelStatus> {
        let task = self.tasks().iter().find(|t| t["task"] == partition)?;
        let channel = task["channels"]
            .as_array()?
            .iter()
            .find(|c| c["channel"]["topic"] == topic && c["channel"]["partition"] == partition)?;
        let blockers = channel["blockers"]
            .as_array()
            .map(|bs| {
                bs.iter()
                    .map(|b| {
                        (
                            b["channel"]["topic"].as_str().unwrap_or("?").to_string(),
                            b["channel"]["partition"].as_u64().unwrap_or(u64::MAX) as u32,
                            b["required"].as_i64().unwrap_or(-1),
                            b["settled"].as_i64(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        Some(ChannelStatus {
            task_status: task["status"].as_str().unwrap_or("?").to_string(),
            fed_up_to: channel["fed_up_to"].as_i64(),
            settled: channel["settled"].as_i64(),
            held: channel["held"].as_u64().unwrap_or(0),
            head: channel["head"].as_i64(),
            blockers,
        })
    }

    /// Every task that is not `running`, as `task N: status (detail)`.
    pub fn troubles(&self) -> Vec<String> {
        self.tasks()
            .iter()
            .filter(|t| t["status"] != "running")
            .map(|t| {
                let detail = match (&t["refusal"], &t["last_error"]) {
                    (Value::Object(r), _) => format!("{} {}", r["reason"], r["diagnosis"]),
                    (_, Value::String(e)) => e.clone(),
                    _ => String::new(),
                };
                format!("task {}: {} {detail}", t["task"], t["status"])
            })
            .collect()
    }

    /// Records held by the model's tasks, in total.
    pub fn held_total(&self) -> u64 {
        self.tasks().iter().map(|t| t["held"].as_u64().unwrap_or(0)).sum()
    }

    /// Each task's owner, in task order.
    pub fn owners(&self) -> Vec<String> {
        self.tasks().iter().map(|t| t["owner"].as_str().unwrap_or_default().to_string()).collect()
    }

    pub fn task_count(&self) -> usize {
        self.tasks().len()
    }
}

/// `-1`/`null` positions as the status shows them.
pub fn position(p: Option<i64>) -> String {
    p.map_or_else(|| "none".to_string(), |p| p.to_string())
}

/// Prints a section heading of the narrative.
pub fn heading(text: &str) {
    println!();
    println!("== {text} ==");
}

/// Prints one line of the narrative.
pub fn say(text: impl AsRef<str>) {
    println!("  {}", text.as_ref());
}

/// Prints an expectation that held.
pub fn held(text: impl AsRef<str>) {
    println!("  ok: {}", text.as_ref());
}

/// Polls `probe` until it returns `Some`, at most `within`; the error names `what`.
pub async fn wait_for<T, F, Fut>(what: &str, within: Duration, mut probe: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = probe().await? {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {within:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_configuration_names_one_model_with_orders_and_payments() {
        let config = Config::parse(include_str!("../../config/demo.toml")).unwrap();
        let listen = gateway_listen(&config).unwrap();
        let declared = Declared::from_config(config).unwrap();
        assert_eq!(
            (declared.model.as_str(), declared.orders.as_str(), declared.payments.as_str()),
            ("shop", "demo.orders", "demo.payments")
        );
        assert!(listen.parse::<std::net::SocketAddr>().is_ok(), "{listen}");
    }
}
