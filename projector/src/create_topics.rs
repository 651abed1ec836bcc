//! `parsley-projector create-topics`: make the configured models' topics exist, co-partitioned.
//!
//! For trying a configuration by hand (the examples, a fresh local broker whose automatic topic
//! creation is off): each topic a model receives that the cluster lacks is created with
//! `partitions` partitions and `replication` replicas; topics that exist are left as they are
//! and only checked. A model whose topics then differ in partition count is an error naming
//! them, because a model's topics must be co-partitioned (the projector refuses such a model).
//! Nothing is ever deleted or altered.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;

use parsley_settings::config::Config;

/// How long the broker may take to answer each admin call.
const TIMEOUT: Duration = Duration::from_secs(30);

/// What happened to one topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It was missing and is now created with this many partitions.
    Created(u32),
    /// It existed with this many partitions; left as it was.
    Existed(u32),
}

/// Creates the missing topics of `models` (every configured model when empty) and checks
/// every model's topics for equal partition counts. Returns each topic's outcome, in the
/// configuration's order (a topic received by two models appears once).
pub async fn create_topics(
    config: &Config,
    models: &[String],
    partitions: u32,
    replication: u32,
) -> anyhow::Result<Vec<(String, Outcome)>> {
    ensure!(partitions >= 1, "--partitions must be at least 1");
    ensure!(replication >= 1, "--replication must be at least 1");
    for name in models {
        ensure!(config.models.iter().any(|m| &m.name == name), "no model named {name:?} is configured");
    }
    let chosen: Vec<_> = config.models.iter().filter(|m| models.is_empty() || models.contains(&m.name)).collect();
    let mut seen = BTreeSet::new();
    let names: Vec<String> = chosen
        .iter()
        .flat_map(|m| m.topics.iter().map(|t| t.name.clone()))
        .filter(|n| seen.insert(n.clone()))
        .collect();

    let cluster = config.kafka.cluster();
    let admin: AdminClient<DefaultClientContext> =
        parsley_infra::kafka::admin_config(cluster.clone()).create().context("creating a Kafka admin client")?;
    let options = AdminOptions::new().operation_timeout(Some(TIMEOUT)).request_timeout(Some(TIMEOUT));
    let replication = i32::try_from(replication).context("--replication is too large")?;
    let count = i32::try_from(partitions).context("--partitions is too large")?;
    let new: Vec<NewTopic<'_>> =
        names.iter().map(|n| NewTopic::new(n, count, TopicReplication::Fixed(replication))).collect();
    let mut created = BTreeSet::new();
    let results = admin
        .create_topics(&new, &options)
        .await
        .with_context(|| format!("creating topics at {}", config.kafka.bootstrap))?;
    for result in results {
        match result {
            Ok(name) => {
                created.insert(name);
            }
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => bail!("creating topic {name:?}: {code}"),
        }
    }

    // Right after creation a broker may not describe a topic yet: retry for a while.
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    let described = loop {
        match parsley_infra::describe_topics(cluster.clone(), &names, TIMEOUT).await {
            Ok(d) => break d,
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e.context("describing the topics")),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let partitions_of = |name: &str| described.iter().find(|d| d.name == name).map(|d| d.partitions);
    for model in &chosen {
        let counts: Vec<(String, u32)> =
            model.topics.iter().map(|t| (t.name.clone(), partitions_of(&t.name).unwrap_or(0))).collect();
        if counts.iter().any(|(_, c)| *c != counts[0].1) {
            let listed: Vec<String> = counts.iter().map(|(n, c)| format!("{n} has {c}")).collect();
            bail!(
                "model {:?}'s topics are not co-partitioned ({}): the projector refuses such a model; \
                 delete the existing topics or give them equal partition counts",
                model.name,
                listed.join(", ")
            );
        }
    }
    Ok(names
        .into_iter()
        .map(|n| {
            let p = partitions_of(&n).unwrap_or(0);
            let outcome = if created.contains(&n) { Outcome::Created(p) } else { Outcome::Existed(p) };
            (n, outcome)
        })
        .collect())
}
