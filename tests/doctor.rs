//! `contextfold doctor` against a real nats-server (issue 12): on a healthy
//! setup every check is ok and the exit code 0; with a folder consumer
//! deleted by hand and a dead letter present it exits non-zero, naming
//! each problem and what to do.
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

mod support;
use support::nats_server::NatsServer;
use support::serve::*;
use support::turns::turns;

use contextfold::core::policy::PolicyConfig;
use contextfold::nats::serve::Roles;
use contextfold::nats::Subjects;
use std::path::Path;
use std::time::{Duration, Instant};

/// Runs `contextfold doctor --nats URL` with the tests' NATS settings
/// (memory storage): (exit code, stdout, stderr).
async fn doctor(dir: &Path, url: &str, extra: &[&str]) -> (Option<i32>, String, String) {
    let config = dir.join("doctor.toml");
    std::fs::write(&config, "[nats]\nstorage = \"memory\"\n").unwrap();
    // The serve's data directory: its state stores are checked too.
    let data = dir.to_path_buf();
    let mut args = vec![
        "--config".to_string(),
        config.display().to_string(),
        "doctor".to_string(),
        "--nats".to_string(),
        url.to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = support::cli::command(&data, &refs)
            .output()
            .expect("the contextfold binary runs");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

fn line<'a>(out: &'a str, check: &str) -> &'a str {
    out.lines()
        .find(|l| l.contains(&format!(" {check}")))
        .unwrap_or_else(|| panic!("no line for {check:?} in:\n{out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_setup_is_all_ok_and_a_broken_one_fails_saying_what_to_do() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&server.url(), dir.path(), &PolicyConfig::default(), "doc");
    opts.roles = "all".parse::<Roles>().unwrap();
    let service = start_alone(opts).await;
    let (client, js, _infra) = client_for(&server.url()).await;
    raw_publish(&client, &turns("doctor-a", 0..6, 20)).await;
    raw_publish(&client, &turns("doctor-b", 0..4, 20)).await;
    wait_until("both conversations folded", Duration::from_secs(20), || {
        let c = conversations(&service);
        c.get("doctor-a").map(|v| v.0) == Some(6) && c.get("doctor-b").map(|v| v.0) == Some(4)
    })
    .await;

    // Healthy: every check ok (the acks of the last batch may still be on
    // their way, so lag is allowed a moment to reach 0).
    let deadline = Instant::now() + Duration::from_secs(15);
    let out = loop {
        let (code, out, err) = doctor(dir.path(), &server.url(), &[]).await;
        assert_eq!(code, Some(0), "healthy setup fails:\n{out}\n{err}");
        if out.lines().all(|l| l.starts_with("ok ")) {
            break out;
        }
        assert!(Instant::now() < deadline, "never all ok:\n{out}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for check in [
        "server",
        "stream CF_EVENTS",
        "stream CF_JOBS",
        "stream CF_DEAD",
        "folder consumers",
        "consumer lag",
        "summarizer consumer",
        "dead letters",
        "leases",
        "stalled partitions",
        "state stores",
        "serve status",
        "partition health",
        "stuck jobs",
    ] {
        assert!(line(&out, check).starts_with("ok "), "{check}:\n{out}");
    }
    assert!(line(&out, "leases").contains("holds 16"), "{out}");
    assert!(
        line(&out, "partition health").contains("16 partitions"),
        "{out}"
    );
    let (code, json, _) = doctor(dir.path(), &server.url(), &["--json"]).await;
    assert_eq!(code, Some(0));
    let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    assert_eq!(v["ok"], true, "{json}");
    assert!(v["checks"].as_array().unwrap().len() >= 12, "{json}");

    // Broken: serve stopped with turns arriving after it (a stalled
    // partition), a folder consumer deleted by hand, a record dead-lettered.
    service.shutdown().await;
    let late = (0..)
        .map(|i| format!("doctor-late-{i}"))
        .find(|k| partition_of(k) != 5)
        .unwrap();
    let stalled_partition = partition_of(&late);
    raw_publish(&client, &turns(&late, 0..3, 10)).await;
    let subjects = Subjects::new("cf").unwrap();
    let victim = subjects.folder_consumer(5);
    js.get_stream(subjects.events_stream())
        .await
        .unwrap()
        .delete_consumer(&victim)
        .await
        .unwrap();
    js.publish(subjects.partition_dead_letter(5), "refused".into())
        .await
        .unwrap()
        .await
        .unwrap();

    let (code, out, err) = doctor(dir.path(), &server.url(), &[]).await;
    assert_eq!(code, Some(1), "broken setup passes:\n{out}\n{err}");
    let consumers = line(&out, "folder consumers");
    assert!(consumers.starts_with("FAIL "), "{out}");
    assert!(consumers.contains(&victim), "{out}");
    assert!(consumers.contains("[5]"), "{out}");
    assert!(consumers.contains("restart `contextfold serve`"), "{out}");
    let dead = line(&out, "dead letters");
    assert!(
        dead.starts_with("FAIL 1 ") || dead.contains(": 1 in stream CF_DEAD"),
        "{out}"
    );
    assert!(dead.contains("purge"), "{out}");
    let stalled = line(&out, "stalled partitions");
    assert!(stalled.starts_with("FAIL "), "{out}");
    assert!(
        stalled.contains(&format!("{stalled_partition} (3 waiting)")),
        "{out}"
    );
    // No serve answers now: said, but not a failure by itself.
    assert!(line(&out, "serve status").starts_with("warn "), "{out}");
    // Serve stopped: its stores are read, within the stream, this policy.
    let stores = line(&out, "state stores");
    assert!(
        stores.starts_with("ok ") && stores.contains("16 read"),
        "{out}"
    );
    // What is still right stays ok.
    assert!(line(&out, "server").starts_with("ok "), "{out}");
    assert!(line(&out, "stream CF_EVENTS").starts_with("ok "), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_missing_or_of_another_layout_fail() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    // Nothing set up yet: the streams are missing.
    let (code, out, _) = doctor(dir.path(), &server.url(), &[]).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(line(&out, "stream CF_EVENTS").starts_with("FAIL "), "{out}");
    assert!(line(&out, "stream CF_EVENTS").contains("missing"), "{out}");

    // Set up with 8 partitions; this doctor expects the default 16.
    let mut cfg = nats_config(&server.url());
    cfg.partitions = 8;
    let _ = client_for_config(&cfg).await;
    let (code, out, _) = doctor(dir.path(), &server.url(), &[]).await;
    assert_eq!(code, Some(1), "{out}");
    let events = line(&out, "stream CF_EVENTS");
    assert!(events.starts_with("FAIL "), "{out}");
    assert!(events.contains("partition"), "{out}");
}

#[tokio::test]
async fn no_server_fails_on_the_server_line() {
    let dir = tempfile::tempdir().unwrap();
    let port = support::nats_server::free_port();
    let url = format!("nats://127.0.0.1:{port}");
    let (code, out, _) = doctor(dir.path(), &url, &[]).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(line(&out, "server").starts_with("FAIL "), "{out}");
}
