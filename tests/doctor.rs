//! `contextfold doctor` against a real nats-server (issue 12): on a healthy
//! setup every check is ok and the exit code 0; with a folder consumer
//! deleted by hand and a dead letter present it exits non-zero, naming
//! each problem and what to do.
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;
use support::nats_server::NatsServer;
use support::serve::*;
use support::turns::turns;

use contextfold::core::fallback_summary;
use contextfold::core::policy::PolicyConfig;
use contextfold::core::summary::{RollingStateRequest, SummaryRequest};
use contextfold::nats::serve::{Roles, Service};
use contextfold::nats::Subjects;
use contextfold::runtime::engine::policy_fingerprint;
use contextfold::summarizer::{
    Budget, CallOutcome, CallRecord, DeterministicSummarizer, RollingOutcome, SummarizeError,
    Summarizer, SummaryOutcome,
};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs `contextfold doctor --nats URL` with the tests' NATS settings
/// (memory storage): (exit code, stdout, stderr).
async fn doctor(dir: &Path, url: &str, extra: &[&str]) -> (Option<i32>, String, String) {
    doctor_with(dir, url, extra, "").await
}

/// [`doctor`] with more configuration (e.g. a `[policy]` table).
async fn doctor_with(
    dir: &Path,
    url: &str,
    extra: &[&str],
    config_text: &str,
) -> (Option<i32>, String, String) {
    let config = dir.join("doctor.toml");
    std::fs::write(
        &config,
        format!("[nats]\nstorage = \"memory\"\n{config_text}"),
    )
    .unwrap();
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

    // A lease the stopped serve did not get to release lapses for doctor
    // after its TTL and the clock allowance (1.5 + 5 s): until then the
    // partition still looks held.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (code, out, err) = loop {
        let (code, out, err) = doctor(dir.path(), &server.url(), &[]).await;
        if line(&out, "stalled partitions").starts_with("FAIL ") || Instant::now() > deadline {
            break (code, out, err);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
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

/// A serve that dies without releasing its leases (kill -9) leaves their
/// records in the bucket until its `max_age` (30 s); once their TTL (and
/// the clock allowance) has passed unrenewed, doctor says nobody holds
/// those partitions and the turns waiting there are stalled, not that the
/// dead member holds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_a_dead_serve_left_behind_are_held_by_nobody_after_their_ttl() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let opts = options(&server.url(), dir.path(), &PolicyConfig::default(), "gone");
    let service = start_alone(opts).await;
    let (client, _, infra) = client_for(&server.url()).await;
    let partition = partition_of("doctor-orphan");
    // The serve dies folding the orphan's partition: its lease is held
    // (`start_alone`) and its consumer made. Killed before that, the
    // partition has no consumer to count its waiting turns by, and doctor
    // says so in the consumers' check instead.
    let deadline = Instant::now() + Duration::from_secs(10);
    while infra
        .events
        .consumer_info(infra.subjects.folder_consumer(partition))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "no folder consumer for {partition}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    service.abort();
    raw_publish(&client, &turns("doctor-orphan", 0..3, 10)).await;

    let deadline = Instant::now() + Duration::from_secs(20);
    let out = loop {
        let (_, out, _) = doctor(dir.path(), &server.url(), &[]).await;
        if line(&out, "stalled partitions").starts_with("FAIL ") || Instant::now() > deadline {
            break out;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let leases = line(&out, "leases (cf_leases)");
    assert!(leases.starts_with("warn "), "{out}");
    assert!(leases.contains("no folder holds partition(s)"), "{out}");
    assert!(
        !leases.contains("gone"),
        "a dead member holds nothing:\n{out}"
    );
    // Its three turns wait there (with whatever the serve had not folded).
    let stalled = line(&out, "stalled partitions");
    let listed = stalled.split(": ").nth(1).unwrap_or_default();
    assert!(
        listed
            .split(", ")
            .any(|p| p.starts_with(&format!("{partition} ("))),
        "{out}"
    );
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

/// Waits until `services` share the partitions between them, each holding
/// some (so each has written its heartbeat).
async fn wait_shared(services: &[&Service]) {
    wait_until("partitions shared", Duration::from_secs(20), || {
        let sets: Vec<_> = services.iter().map(|s| held(s)).collect();
        sets.iter().all(|h| !h.is_empty()) && sets.iter().map(|h| h.len()).sum::<usize>() == 16
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_folding_under_different_policies_fail_naming_both_fingerprints() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let same = PolicyConfig::default();
    let other = PolicyConfig {
        default_context_window: 64_000,
        ..PolicyConfig::default()
    };
    let (fp_same, fp_other) = (policy_fingerprint(&same), policy_fingerprint(&other));
    assert_ne!(fp_same, fp_other);
    let start = |name: &str, policy: &PolicyConfig| {
        let opts = options(&server.url(), &dir.path().join(name), policy, name);
        Service::start(opts, Arc::new(DeterministicSummarizer))
    };

    // Two serves under the same policy as this doctor's configuration.
    let a = start("doc-a", &same).await.expect("serve a starts");
    let b = start("doc-b", &same).await.expect("serve b starts");
    wait_shared(&[&a, &b]).await;
    let (code, out, err) = doctor(dir.path(), &server.url(), &[]).await;
    let agreement = line(&out, "policy agreement");
    assert!(agreement.starts_with("ok "), "{out}\n{err}");
    assert!(
        agreement.contains(&format!("2 live member(s) fold under {fp_same}")),
        "{out}"
    );
    assert_eq!(code, Some(0), "{out}\n{err}");

    // One of them replaced by a serve with another [policy].
    b.shutdown().await;
    let c = start("doc-c", &other).await.expect("serve c starts");
    wait_shared(&[&a, &c]).await;
    let (code, out, err) = doctor(dir.path(), &server.url(), &[]).await;
    assert_eq!(code, Some(1), "different policies pass:\n{out}\n{err}");
    let agreement = line(&out, "policy agreement");
    assert!(agreement.starts_with("FAIL "), "{out}");
    assert!(agreement.contains(&fp_same), "{out}");
    assert!(agreement.contains(&fp_other), "{out}");
    assert!(
        agreement.contains("doc-a-") && agreement.contains("doc-c-"),
        "{out}"
    );
    assert!(!agreement.contains("doc-b-"), "a member that left: {out}");
    assert!(agreement.contains("same [policy]"), "{out}");

    // A doctor whose own configuration folds under the other policy says
    // so too once the cluster agrees again (only c left).
    a.shutdown().await;
    wait_until("c holds every partition", Duration::from_secs(20), || {
        held(&c).len() == 16
    })
    .await;
    let (_, out, _) = doctor(dir.path(), &server.url(), &[]).await;
    let agreement = line(&out, "policy agreement");
    assert!(agreement.starts_with("warn "), "{out}");
    assert!(
        agreement.contains(&format!(
            "this config folds under {fp_same}, the cluster under {fp_other}"
        )),
        "{out}"
    );
    c.shutdown().await;
}

/// A summarizer that pays one call per pass and honours the job's
/// allowance, as a model summarizer does: what closes a spend window.
struct OneCallPerPass;

impl OneCallPerPass {
    /// Pays one call of 100 tokens, when the budget has one.
    fn pay(budget: &Budget) -> Result<(), SummarizeError> {
        if !budget.grant(100) {
            return Err(SummarizeError::OverBudget { calls: Vec::new() });
        }
        budget.charge(&CallRecord {
            model: "one-call".into(),
            provider: "test".into(),
            latency_ms: 1,
            prompt_tokens_provider: Some(90),
            completion_tokens_provider: Some(10),
            prompt_tokens_ours: 90,
            completion_tokens_ours: 10,
            cost_micros: 0,
            outcome: CallOutcome::Ok,
        });
        Ok(())
    }
}

impl Summarizer for OneCallPerPass {
    async fn summarize(
        &self,
        req: &SummaryRequest,
        budget: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        Self::pay(budget)?;
        Ok(SummaryOutcome::without_calls(fallback_summary::summarize(
            req,
        )))
    }

    async fn rolling_state(
        &self,
        req: &RollingStateRequest,
        budget: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        Self::pay(budget)?;
        Ok(RollingOutcome::without_calls(
            fallback_summary::rolling_state(req),
        ))
    }

    fn name(&self) -> &str {
        "one-call-per-pass"
    }
}

/// The `[policy]` of the spend-window test, as TOML and as the struct.
const TINY_WINDOW: &str = "[policy]\n\
    default_context_window = 4000\n\
    fresh_tail_count = 4\n\
    leaf_chunk_tokens = 600\n\
    leaf_target_tokens = 120\n\
    condensed_target_tokens = 120\n\
    summary_max_calls_per_window = 1\n\
    summary_call_window_ms = 600000\n";

fn tiny_window() -> PolicyConfig {
    PolicyConfig {
        default_context_window: 4_000,
        fresh_tail_count: 4,
        leaf_chunk_tokens: 600,
        leaf_target_tokens: 120,
        condensed_target_tokens: 120,
        summary_max_calls_per_window: 1,
        summary_call_window_ms: 600_000,
        ..PolicyConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_spend_window_warns_saying_what_it_means() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = tiny_window();
    let mut opts = options(&server.url(), dir.path(), &policy, "doc");
    opts.roles = "all".parse::<Roles>().unwrap();
    let service = Service::start(opts, Arc::new(OneCallPerPass))
        .await
        .expect("serve starts");
    wait_until("all partitions held", Duration::from_secs(10), || {
        held(&service).len() == 16
    })
    .await;
    let (client, _js, _infra) = client_for(&server.url()).await;

    // Before any turn: no window closed.
    let (_, out, _) = doctor_with(dir.path(), &server.url(), &[], TINY_WINDOW).await;
    assert!(line(&out, "spend windows").starts_with("ok "), "{out}");
    assert!(line(&out, "policy agreement").starts_with("ok "), "{out}");

    // Turns 2 s apart, all within one 10-minute window: the first job's
    // one call uses the window up while the debt grows.
    let key = "doctor-spend";
    raw_publish(&client, &turns(key, 0..60, 40)).await;
    wait_until("the window used up", Duration::from_secs(30), || {
        let Some(engines) = service.engines() else {
            return false;
        };
        let Some(engine) = engines.get(partition_of(key)) else {
            return false;
        };
        let e = engine.lock().unwrap();
        e.state.conversations.get(key).is_some_and(|c| {
            c.turns.len() == 60
                && c.pending_job.is_none()
                && c.spend.totals(c.last_time, 600_000).calls >= 1
        })
    })
    .await;

    let (code, out, err) = doctor_with(dir.path(), &server.url(), &[], TINY_WINDOW).await;
    let spend = line(&out, "spend windows");
    assert!(spend.starts_with("warn "), "{out}\n{err}");
    assert!(
        spend.contains("1 conversation(s) used up their window"),
        "{out}"
    );
    assert!(spend.contains("summary_max_calls_per_window"), "{out}");
    assert!(spend.contains("paused until "), "{out}");
    assert!(spend.contains("or wait"), "{out}");
    // The same [policy] here and in serve: the fingerprints agree.
    assert!(line(&out, "policy agreement").starts_with("ok "), "{out}");
    // A closed window is a warning, not a failure.
    assert_eq!(code, Some(0), "{out}\n{err}");
    service.shutdown().await;
}
