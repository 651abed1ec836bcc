//! `parsley-projector create-topics`: the configured models' missing topics created,
//! co-partitioned; existing ones left as they are; a model whose topics differ refused by name.

use std::process::{Command, Output};

use parsley_testkit::{bootstrap, create_topics, database_url, unique, TIMEOUT};

/// Runs `parsley-projector --config <file> create-topics <args>` on a configuration of
/// `models` (name, topics).
fn run(models: &[(&str, &[&str])], args: &[&str]) -> Output {
    let mut toml = String::new();
    for (name, topics) in models {
        let topics: Vec<String> = topics.iter().map(|t| format!("{{ name = \"{t}\" }}")).collect();
        toml.push_str(&format!("[[models]]\nname = \"{name}\"\ntopics = [{}]\n\n", topics.join(", ")));
    }
    let path = std::env::temp_dir().join(format!("{}.toml", unique("create-topics")));
    std::fs::write(&path, toml).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_parsley-projector"))
        .arg("--config")
        .arg(&path)
        .arg("create-topics")
        .args(args)
        .env("PARSLEY_DATABASE_URL", database_url())
        .env("PARSLEY_KAFKA_BOOTSTRAP", bootstrap())
        .env("RUST_LOG", "warn")
        .output()
        .expect("running parsley-projector create-topics");
    std::fs::remove_file(&path).ok();
    output
}

async fn partitions(topic: &str) -> u32 {
    parsley_infra::describe_topics(&bootstrap(), &[topic.to_string()], TIMEOUT).await.unwrap()[0].partitions
}

#[tokio::test]
async fn missing_topics_are_created_co_partitioned_and_existing_ones_left_alone() {
    let (a, b, c) = (unique("ct-a"), unique("ct-b"), unique("ct-c"));
    create_topics(&[&c], 3).await;
    let out = run(&[("m1", &[&a, &b]), ("m2", &[&b])], &["--partitions", "3"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(&format!("created topic {a} (3 partitions)")), "{stdout}");
    assert_eq!(stdout.matches(&format!("created topic {b} ")).count(), 1, "a topic of two models once: {stdout}");
    assert_eq!((partitions(&a).await, partitions(&b).await), (3, 3));

    // Again, with a model naming an existing topic: nothing is created, nothing altered.
    let out = run(&[("m1", &[&a, &b]), ("m3", &[&c])], &["--partitions", "5"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for t in [&a, &b, &c] {
        assert!(stdout.contains(&format!("topic {t} exists (3 partitions): left as it is")), "{stdout}");
        assert_eq!(partitions(t).await, 3);
    }

    // Only the named model's topics.
    let d = unique("ct-d");
    let out = run(&[("m1", &[&a]), ("m4", &[&d])], &["--model", "m1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        parsley_infra::describe_topics(&bootstrap(), std::slice::from_ref(&d), TIMEOUT).await.is_err(),
        "{d} was created"
    );
}

#[tokio::test]
async fn a_model_whose_topics_differ_in_partitions_is_refused_by_name() {
    let (a, b) = (unique("ct-e"), unique("ct-f"));
    create_topics(&[&a], 2).await;
    let out = run(&[("uneven", &[&a, &b])], &["--partitions", "4"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("\"uneven\"'s topics are not co-partitioned"), "{stderr}");
    assert!(stderr.contains(&format!("{a} has 2")) && stderr.contains(&format!("{b} has 4")), "{stderr}");

    // Values the parser refuses are usage errors (exit 2), naming the option and the value.
    for (args, says) in [(&["--partitions", "0"][..], "'0'"), (&["--partitions", "x"][..], "'x'")] {
        let out = run(&[("uneven", &[&a, &b])], args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("--partitions") && stderr.contains(says), "{args:?}: {stderr}");
    }
    let out = run(&[("uneven", &[&a, &b])], &["--model", "nope"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("no model named \"nope\" is configured"), "{stderr}");
}
