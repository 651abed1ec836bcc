//! Part 1: a held effect, released when its cause commits. An order is written inside a
//! Kafka transaction that stays open; a payment naming the order's coordinate in
//! `parsley.causes` is written directly to Kafka. The projector receives the payment and holds
//! it (the order is invisible to its read-committed consumer); the demo shows the hold and its
//! blocker in the gateway's status, commits, and shows both applied, order first.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use parsley::channel::ChannelId;
use parsley::CausalPast;
use rdkafka::producer::{FutureProducer, Producer as _};
use serde_json::{json, Value};

use crate::context::{
    heading, held, position, say, wait_for, ChannelStatus, Coordinate, Demo, EXPECT_WITHIN, KAFKA_TIMEOUT,
};

/// How long the demo keeps checking that the hold stays put.
const HOLD_OBSERVED_FOR: Duration = Duration::from_millis(1500);

pub async fn run(demo: &Demo) -> anyhow::Result<()> {
    heading("1. A held effect, released when its cause commits");
    say("An order written in a Kafka transaction left open, and a payment that names the order as its");
    say("cause: the projector must hold the payment until the order can be applied before it.");
    let key = demo.key("held");
    let order = json!({"item": "teapot", "total": 30, "status": "placed"});
    let payment = json!({"status": "paid", "paid": 30});
    say(format!("key {key}: murmur2 puts it on partition {} of both topics", demo.partition_of(&key)));

    let before = demo.status().await?;
    if before.held_total() > 0 {
        say(format!(
            "(note: model {} already holds {} record(s) from an interrupted earlier run; a later order on \
             their partition releases them)",
            demo.model,
            before.held_total()
        ));
    }

    let txp = demo.transactional_producer()?;
    txp.begin_transaction().context("beginning a Kafka transaction")?;
    let outcome = hold_then_release(demo, &txp, &key, &order, &payment).await;
    if outcome.is_err() {
        // Leave no open transaction behind: it would stall the orders partition for every
        // read-committed reader until the broker's transaction timeout.
        let _ = tokio::task::block_in_place(|| txp.abort_transaction(KAFKA_TIMEOUT));
    }
    outcome
}

async fn hold_then_release(
    demo: &Demo,
    txp: &FutureProducer,
    key: &str,
    order: &Value,
    payment: &Value,
) -> anyhow::Result<()> {
    let order_at = demo.produce(txp, &demo.orders, key, order, None).await?;
    let order_channel = ChannelId::new(demo.orders.id, order_at.partition);
    say(format!(
        "order   {order}  -> {}  (acknowledged inside an OPEN Kafka transaction)",
        demo.describe(order_channel, order_at.offset)
    ));

    let causes = CausalPast::from_pairs([(order_channel, order_at.offset)]);
    let plain = demo.producer()?;
    let pay_at = demo.produce(&plain, &demo.payments, key, payment, Some(&causes)).await?;
    let pay_channel = ChannelId::new(demo.payments.id, pay_at.partition);
    say(format!(
        "payment {payment}  -> {}  parsley.causes = {}",
        demo.describe(pay_channel, pay_at.offset),
        demo.describe_past(&causes)
    ));
    ensure!(
        pay_at.partition == order_at.partition && order_at.partition == demo.partition_of(key),
        "the order went to partition {} and the payment to {}: the producers do not partition like murmur2",
        order_at.partition,
        pay_at.partition
    );

    // The projector receives the payment and holds it: its cause is not visible yet.
    let p = pay_at.partition;
    let hold = wait_for("the projector to receive and hold the payment", EXPECT_WITHIN, || async {
        let status = demo.status().await?;
        let troubles = status.troubles();
        ensure!(troubles.is_empty(), "the projector's tasks are not all running: {}", troubles.join("; "));
        Ok(status
            .channel(&demo.payments.name, p)
            .filter(|c| c.held > 0 && c.fed_up_to.is_some_and(|f| f >= pay_at.offset)))
    })
    .await?;
    show_hold(demo, p, &hold);
    check_hold(demo, &hold, order_at, pay_at)?;
    held("the payment is held: its cause is not visible to the projector's read-committed consumer");
    expect_absent(demo, key).await?;
    held(format!("GET /v1/models/{}/documents/{key} -> 404 not-found: neither record is applied", demo.model));

    tokio::time::sleep(HOLD_OBSERVED_FOR).await;
    let later = demo.status().await?.channel(&demo.payments.name, p).context("the payments channel vanished")?;
    check_hold(demo, &later, order_at, pay_at)?;
    expect_absent(demo, key).await?;
    held(format!("{} ms later the payment is still held, the document still absent", HOLD_OBSERVED_FOR.as_millis()));

    say("commit the Kafka transaction");
    tokio::task::block_in_place(|| txp.commit_transaction(KAFKA_TIMEOUT)).context("committing the transaction")?;
    let committed = Instant::now();
    let applied = wait_for("both records to be applied", EXPECT_WITHIN, || async {
        let r = demo.get_document(key, None).await?;
        match r.status {
            404 => Ok(None),
            200 => {
                let body = r.json()?;
                Ok((body["document"]["status"] == "paid").then_some(body))
            }
            other => bail!("GET document answered {other}: {}", String::from_utf8_lossy(&r.body)),
        }
    })
    .await?;
    let mut expected = order.clone();
    json_merge(&mut expected, payment);
    say(format!(
        "GET /v1/models/{}/documents/{key} -> 200 after {} ms: {} (version {})",
        demo.model,
        committed.elapsed().as_millis(),
        applied["document"],
        applied["version"]
    ));
    ensure!(
        applied["document"] == expected && applied["version"] == 2,
        "expected document {expected} at version 2, got {applied}"
    );
    held(
        "the order was applied first (replace), then the payment merged into it (status placed -> paid); \
          had the payment gone first, the order's replace would have erased it",
    );

    let after = demo.status().await?.channel(&demo.payments.name, p).context("the payments channel vanished")?;
    ensure!(after.head != Some(pay_at.offset), "the payment is still reported held after being applied: {after:?}");
    held(format!(
        "GET /v1/status: {}/{p} now holds {} record(s), settled {}",
        demo.payments.name,
        after.held,
        position(after.settled)
    ));
    Ok(())
}

fn show_hold(demo: &Demo, partition: u32, hold: &ChannelStatus) {
    say(format!(
        "GET /v1/status: task {partition} ({}), channel {}/{partition}: fed_up_to {}, settled {}, held {} (head {})",
        hold.task_status,
        demo.payments.name,
        position(hold.fed_up_to),
        position(hold.settled),
        hold.held,
        position(hold.head)
    ));
    for (topic, p, required, settled) in &hold.blockers {
        say(format!("    blocked on {topic}/{p}: required {required}, settled {}", position(*settled)));
    }
}

/// The payment is held, and when it is the head of its queue, blocked on exactly the order.
fn check_hold(demo: &Demo, hold: &ChannelStatus, order_at: Coordinate, pay_at: Coordinate) -> anyhow::Result<()> {
    ensure!(hold.held > 0 && hold.fed_up_to.is_some_and(|f| f >= pay_at.offset), "the payment is not held: {hold:?}");
    match hold.head {
        Some(head) if head == pay_at.offset => {
            let expected = (demo.orders.name.clone(), order_at.partition, order_at.offset);
            let [(topic, p, required, settled)] = hold.blockers.as_slice() else {
                bail!("the held payment should have one blocker, the order; status says {:?}", hold.blockers);
            };
            ensure!(
                (topic.clone(), *p, *required) == expected && settled.is_none_or(|s| s < order_at.offset),
                "the held payment should be blocked on {}/{}@{} (unsettled); status says {:?}",
                expected.0,
                expected.1,
                expected.2,
                hold.blockers
            );
            Ok(())
        }
        // An older record from an interrupted run heads the queue; ours waits behind it.
        Some(head) if head < pay_at.offset => Ok(()),
        other => bail!("the payments queue's head is {other:?}, not the payment at {}", pay_at.offset),
    }
}

async fn expect_absent(demo: &Demo, key: &str) -> anyhow::Result<()> {
    let r = demo.get_document(key, None).await?;
    ensure!(
        r.status == 404,
        "the document must not exist while its order is uncommitted; GET answered {}: {}",
        r.status,
        String::from_utf8_lossy(&r.body)
    );
    Ok(())
}

/// RFC 7396 merge patch, to state the expected document.
fn json_merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    if let Value::Object(t) = target {
        for (k, v) in patch {
            if v.is_null() {
                t.remove(k);
            } else {
                json_merge(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::json_merge;
    use serde_json::json;

    #[test]
    fn merge_patch_follows_rfc_7396() {
        for (target, patch, expected) in [
            (json!({"a": 1, "b": 2}), json!({"b": 3, "c": 4}), json!({"a": 1, "b": 3, "c": 4})),
            (json!({"a": 1, "b": 2}), json!({"a": null}), json!({"b": 2})),
            (json!({"a": {"x": 1}}), json!({"a": {"y": 2}}), json!({"a": {"x": 1, "y": 2}})),
            (json!([1]), json!({"a": null, "b": 1}), json!({"b": 1})),
            (json!({"a": 1}), json!("s"), json!("s")),
        ] {
            let mut t = target.clone();
            json_merge(&mut t, &patch);
            assert_eq!(t, expected, "{target} + {patch}");
        }
    }
}
