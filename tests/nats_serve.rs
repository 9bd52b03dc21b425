//! `contextfold serve` (every role in one process) against real nats-server
//! processes: a raw-published turn is folded; a conversation over its
//! threshold gets one job at a time and its summaries come back and are
//! folded; a job whose worker dies mid-sweep is finished by another; two
//! instances split the partitions, a kill moves them, and the survivor ends
//! with the state of a clean replay of the events stream; a long transcript
//! published at once settles without a job loop (issue 10, item 5).
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/llm_server.rs"]
mod llm_server;
mod support;
use contextfold::testing::small_policy;
use support::serve::*;
use support::turns::turns;

use async_nats::jetstream;
use contextfold::core::assembly::{self, AssemblyRequest};
use contextfold::core::event::{Envelope, EventBody};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::summary::{RollingStateRequest, SummaryRequest};
use contextfold::nats::config::StorageKind;
use contextfold::nats::serve::{Roles, Service};
use contextfold::nats::setup::{ensure, Infrastructure};
use contextfold::summarizer::{
    Budget, DeterministicSummarizer, RollingOutcome, SummarizeError, Summarizer, SummaryOutcome,
};
use futures::StreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::nats_server::NatsServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_the_api_role_answers_requests_over_nats() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = PolicyConfig::default();
    let mut opts = options(&server.url(), dir.path(), &policy, "api");
    opts.roles = "folder,api".parse::<Roles>().unwrap();
    let service = start_alone(opts).await;
    let (client, js, infra) = client_for(&server.url()).await;
    let key = "agent:api/one";
    raw_publish(&client, &turns(key, 0..3, 8)).await;
    wait_until("3 turns folded", Duration::from_secs(20), || {
        conversations(&service).get(key).map(|c| c.0) == Some(3)
    })
    .await;

    // The public subject, then the owning partition's subject: both answer
    // from the folded state.
    let partition = partition_of(key);
    for subject in [
        format!("cf.api.assemble.{}", token(key)),
        format!("cf.api.p.{partition}.assemble.{}", token(key)),
    ] {
        let body = serde_json::json!({ "conversation": key }).to_string();
        let reply = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                // The partition subscriptions follow the leases every few
                // hundred ms: until then the request finds no responder.
                match client.request(subject.clone(), body.clone().into()).await {
                    Ok(m) => break m,
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no answer on {subject}"));
        let text = String::from_utf8_lossy(&reply.payload);
        assert!(text.contains("turn 2:"), "{subject}: {text}");
    }

    // `compact` stores its event in the events stream, once however often
    // it is asked, and the owner folds it.
    let body = serde_json::json!({
        "conversation": key,
        "request_id": "operator-1",
        "instructions": "keep every path",
    })
    .to_string();
    let mut event_id = String::new();
    for _ in 0..2 {
        let reply = client
            .request(
                format!("cf.api.compact.{}", token(key)),
                body.clone().into(),
            )
            .await
            .expect("compact answers");
        let v: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(v["published"], true, "{v}");
        event_id = v["event"]["id"].as_str().unwrap().to_string();
    }
    let engine = service.engines().unwrap().get(partition).unwrap();
    wait_until(
        "the compaction request folded",
        Duration::from_secs(20),
        || engine.lock().unwrap().state.conversations[key].has_applied(&event_id),
    )
    .await;
    drop(engine);
    let stored = partition_events(&js, &infra, partition)
        .await
        .into_iter()
        .filter(|(_, e)| e.id == event_id)
        .count();
    assert_eq!(stored, 1, "a retried compact request is stored once");
    service.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_published_turn_is_folded_and_assembles() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = PolicyConfig::default();
    let mut opts = options(&server.url(), dir.path(), &policy, "solo");
    opts.roles = "all".parse::<Roles>().unwrap();
    let service = start_alone(opts).await;
    let (client, js, infra) = client_for(&server.url()).await;

    let key = "agent:alpha/main thread.ü";
    let events = turns(key, 0..3, 8);
    raw_publish(&client, &events).await;
    wait_until("3 turns folded", Duration::from_secs(20), || {
        conversations(&service).get(key).map(|c| c.0) == Some(3)
    })
    .await;
    let engine = service.engines().unwrap().get(partition_of(key)).unwrap();
    {
        let e = engine.lock().unwrap();
        let assembled = assembly::assemble_from(
            &e.state.conversations[key],
            &e.bodies(),
            &e.policy,
            &AssemblyRequest::default(),
        )
        .unwrap();
        let last = serde_json::to_string(assembled.messages.last().unwrap()).unwrap();
        assert!(last.contains("turn 2:"), "{last}");
    }
    drop(engine);

    // An agent that keeps its context asks for what is new only.
    let ask = |since: serde_json::Value| {
        let client = client.clone();
        let body = serde_json::json!({"conversation": key, "since": since}).to_string();
        async move {
            let reply = client
                .request(format!("cf.api.assemble.{}", token(key)), body.into())
                .await
                .unwrap();
            serde_json::from_slice::<serde_json::Value>(&reply.payload).unwrap()
        }
    };
    let first = ask(serde_json::json!({"messages": 0})).await;
    assert_eq!(first["delta"]["from"], 0, "{first}");
    assert_eq!(first["delta"]["messages"], 3);
    assert_eq!(first["messages"].as_array().unwrap().len(), 3);
    raw_publish(&client, &turns(key, 3..4, 8)).await;
    wait_until("the 4th turn folded", Duration::from_secs(20), || {
        conversations(&service).get(key).map(|c| c.0) == Some(4)
    })
    .await;
    let held = serde_json::json!({"messages": 3, "fingerprint": first["delta"]["fingerprint"]});
    let next = ask(held).await;
    assert_eq!(next["delta"]["from"], 3, "{next}");
    assert_eq!(next["delta"]["messages"], 4);
    let new = next["messages"].as_array().unwrap();
    assert_eq!(new.len(), 1);
    assert!(new[0].to_string().contains("turn 3:"), "{}", new[0]);
    // A fingerprint that is not this context's start: all of it.
    let stale = ask(serde_json::json!({"messages": 3, "fingerprint": "0123"})).await;
    assert_eq!(stale["delta"]["from"], 0);
    assert_eq!(stale["messages"].as_array().unwrap().len(), 4);

    // Republished: the server drops the copies, nothing changes.
    let before = conversations(&service);
    raw_publish(&client, &events).await;
    let all: BTreeSet<u32> = (0..16).collect();
    assert_matches_replay(&service, &js, &infra, &all, &policy).await;
    assert_eq!(conversations(&service), before);

    // Committed to the state store under --data.
    service.shutdown().await;
    let stores = std::fs::read_dir(dir.path().join("nats").join("cf"))
        .unwrap()
        .count();
    assert_eq!(stores, 16, "one state store per partition");
}

/// Checks in the log of `p` that `conv` never had two jobs outstanding:
/// every `job_issued` after the first follows the `sweep_ended` of the one
/// before. Returns how many jobs were issued.
fn one_job_at_a_time(events: &[(u64, Envelope)], conv: &str) -> usize {
    let mut outstanding: Option<String> = None;
    let mut issued = 0;
    for (_, e) in events.iter().filter(|(_, e)| e.conversation == conv) {
        match &e.body {
            EventBody::JobIssued(j) => {
                assert!(
                    outstanding.is_none(),
                    "job {} issued while {outstanding:?} was pending",
                    j.job_id
                );
                outstanding = Some(j.job_id.clone());
                issued += 1;
            }
            EventBody::SweepEnded(s) if outstanding.as_deref() == Some(s.job_id.as_str()) => {
                outstanding = None;
            }
            _ => {}
        }
    }
    issued
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflowing_conversation_gets_one_job_at_a_time_and_its_summaries_are_folded() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = small_policy();
    let service = start_alone(options(&server.url(), dir.path(), &policy, "solo")).await;
    let (client, js, infra) = client_for(&server.url()).await;
    let conv = "agent:compact";
    // Far over the threshold, in several bursts: triggers keep firing
    // while jobs are pending.
    for burst in 0..4 {
        raw_publish(&client, &turns(conv, burst * 15..(burst + 1) * 15, 120)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_until(
        "60 turns folded and summarized",
        Duration::from_secs(30),
        || {
            conversations(&service)
                .get(conv)
                .is_some_and(|c| c.0 == 60 && c.1 > 0)
        },
    )
    .await;
    let all: BTreeSet<u32> = (0..16).collect();
    // Settled: no job pending, the queue empty, the state a clean replay.
    let engines = service.engines().unwrap();
    wait_until("no pending job", Duration::from_secs(30), || {
        engines.get(partition_of(conv)).is_some_and(|e| {
            e.lock().unwrap().state.conversations[conv]
                .pending_job
                .is_none()
        })
    })
    .await;
    assert_matches_replay(&service, &js, &infra, &all, &policy).await;
    let events = partition_events(&js, &infra, partition_of(conv)).await;
    let issued = one_job_at_a_time(&events, conv);
    assert!(issued >= 1);
    let summaries = events
        .iter()
        .filter(|(_, e)| matches!(e.body, EventBody::SummaryRecorded(_)))
        .count();
    assert!(summaries >= 1, "no summary came back");
    let counters = service.summarizer_counters().unwrap();
    let done = counters.done.load(Ordering::Relaxed) as usize;
    assert!(
        done >= 1 && done <= issued,
        "{done} jobs done, {issued} issued"
    );
    let mut jobs = infra.jobs.clone();
    assert_eq!(jobs.info().await.unwrap().state.messages, 0, "jobs left");

    // The assembled context is within the budget thanks to the summaries.
    let engine = engines.get(partition_of(conv)).unwrap();
    {
        let e = engine.lock().unwrap();
        let c = &e.state.conversations[conv];
        let assembled =
            assembly::assemble_from(c, &e.bodies(), &e.policy, &AssemblyRequest::default())
                .unwrap();
        let text = serde_json::to_string(&assembled.messages).unwrap();
        assert!(text.contains("turn 59:"));
        assert!(c.summaries.len() as u64 >= 1);
    }
    drop(engine);
    service.shutdown().await;
}

/// `conv`'s summaries reach `folder`, its jobs went out one at a time,
/// and every partition's state is a clean replay's.
async fn summaries_folded_as_replayed(
    folder: &Service,
    js: &jetstream::Context,
    infra: &Infrastructure,
    conv: &str,
    policy: &PolicyConfig,
) {
    wait_until("summaries folded", Duration::from_secs(20), || {
        conversations(folder).get(conv).is_some_and(|c| c.1 > 0)
    })
    .await;
    let events = partition_events(js, infra, partition_of(conv)).await;
    one_job_at_a_time(&events, conv);
    let all: BTreeSet<u32> = (0..16).collect();
    assert_matches_replay(folder, js, infra, &all, policy).await;
}

/// A summarizer whose summaries wait: `delay` each, and until `open`.
struct Held {
    delay: Duration,
    open: std::sync::atomic::AtomicBool,
    calls: AtomicU64,
}

impl Held {
    /// Each summary `delay` late.
    fn slow(delay: Duration) -> Held {
        Held {
            delay,
            open: true.into(),
            calls: AtomicU64::new(0),
        }
    }

    /// Summaries wait until the test opens the gate.
    fn gated() -> Held {
        Held {
            delay: Duration::ZERO,
            open: false.into(),
            calls: AtomicU64::new(0),
        }
    }
}

impl Summarizer for Held {
    async fn summarize(
        &self,
        req: &SummaryRequest,
        budget: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(self.delay).await;
        while !self.open.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        DeterministicSummarizer.summarize(req, budget).await
    }
    async fn rolling_state(
        &self,
        req: &RollingStateRequest,
        budget: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        DeterministicSummarizer.rolling_state(req, budget).await
    }
    fn name(&self) -> &str {
        "held"
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_of_a_killed_worker_is_redelivered_and_finished_by_another() {
    let server = NatsServer::start();
    let policy = small_policy();
    let (dir_f, dir_a, dir_b) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let mut folder_opts = options(&server.url(), dir_f.path(), &policy, "folder");
    folder_opts.roles = "folder".parse().unwrap();
    let folder = Service::start(folder_opts, Arc::new(DeterministicSummarizer))
        .await
        .unwrap();
    let slow = Arc::new(Held::slow(Duration::from_secs(30)));
    let mut worker_opts = options(&server.url(), dir_a.path(), &policy, "doomed");
    worker_opts.roles = "summarizer".parse().unwrap();
    let doomed = Service::start(worker_opts, slow.clone()).await.unwrap();
    wait_until("all partitions held", Duration::from_secs(10), || {
        held(&folder).len() == 16
    })
    .await;

    let (client, js, infra) = client_for(&server.url()).await;
    let conv = "agent:redelivered";
    raw_publish(&client, &turns(conv, 0..40, 120)).await;
    wait_until(
        "the doomed worker is mid-sweep",
        Duration::from_secs(20),
        || slow.calls.load(Ordering::Relaxed) > 0,
    )
    .await;
    // Progress acks keep the job with the doomed worker past ack_wait.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let consumer_info = infra
        .jobs
        .consumer_info(infra.subjects.summarizer_consumer())
        .await
        .unwrap();
    assert_eq!(consumer_info.num_ack_pending, 1, "{consumer_info:?}");
    assert_eq!(
        consumer_info.num_redelivered, 0,
        "redelivered despite progress acks"
    );
    let progress = doomed.summarizer_counters().unwrap();
    assert!(progress.progress_acks.load(Ordering::Relaxed) >= 2);
    doomed.abort();

    let mut rescuer_opts = options(&server.url(), dir_b.path(), &policy, "rescuer");
    rescuer_opts.roles = "summarizer".parse().unwrap();
    let rescuer = Service::start(rescuer_opts, Arc::new(DeterministicSummarizer))
        .await
        .unwrap();
    let counters = rescuer.summarizer_counters().unwrap();
    wait_until(
        "the rescuer finished the job",
        Duration::from_secs(20),
        || counters.done.load(Ordering::Relaxed) >= 1,
    )
    .await;
    summaries_folded_as_replayed(&folder, &js, &infra, conv, &policy).await;
    rescuer.shutdown().await;
    folder.shutdown().await;
}

/// The events stream takes nothing for a while (as when it has no leader):
/// the worker holds the job and publishes its results again until the
/// stream takes them, instead of spending the job's deliveries on the
/// outage and dead-lettering it (which left the conversation waiting for
/// the job to expire: 100 s in the cluster convergence case).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_results_the_stream_cannot_store_for_a_while_is_finished() {
    let server = NatsServer::start();
    let policy = small_policy();
    let (dir_f, dir_w) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Two deliveries: an outage of a few seconds used to be enough to
    // dead-letter the job.
    let mut folder_opts = options(&server.url(), dir_f.path(), &policy, "folder");
    folder_opts.roles = "folder".parse().unwrap();
    folder_opts.nats.job_max_deliver = 2;
    let folder = start_alone(folder_opts).await;
    let gated = Arc::new(Held::gated());
    let mut worker_opts = options(&server.url(), dir_w.path(), &policy, "worker");
    worker_opts.roles = "summarizer".parse().unwrap();
    worker_opts.nats.job_max_deliver = 2;
    let worker = Service::start(worker_opts, gated.clone()).await.unwrap();
    let counters = worker.summarizer_counters().unwrap();

    let (client, js, infra) = client_for(&server.url()).await;
    let conv = "agent:outage";
    raw_publish(&client, &turns(conv, 0..40, 120)).await;
    wait_until("the worker is mid-sweep", Duration::from_secs(20), || {
        gated.calls.load(Ordering::Relaxed) > 0
    })
    .await;
    // The stream stops taking anything: no subject is its own.
    let stream = infra.events.cached_info().config.clone();
    let mut closed = stream.clone();
    closed.subjects = vec!["test.nowhere.>".into()];
    js.update_stream(&closed).await.unwrap();
    gated.open.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(counters.done.load(Ordering::Relaxed), 0, "stored nowhere");
    js.update_stream(&stream).await.unwrap();

    wait_until(
        "the worker finished the job",
        Duration::from_secs(20),
        || counters.done.load(Ordering::Relaxed) >= 1,
    )
    .await;
    assert_eq!(counters.dead_lettered.load(Ordering::Relaxed), 0);
    assert!(
        counters.progress_acks.load(Ordering::Relaxed) >= 2,
        "the job was held through the outage"
    );
    summaries_folded_as_replayed(&folder, &js, &infra, conv, &policy).await;
    worker.shutdown().await;
    folder.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_split_partitions_and_a_kill_moves_them_to_the_survivor() {
    let server = NatsServer::start();
    let policy = small_policy();
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Service::start(
        options(&server.url(), dir_a.path(), &policy, "serve-a"),
        Arc::new(DeterministicSummarizer),
    )
    .await
    .unwrap();
    let b = Service::start(
        options(&server.url(), dir_b.path(), &policy, "serve-b"),
        Arc::new(DeterministicSummarizer),
    )
    .await
    .unwrap();
    wait_until("an 8/8 split", Duration::from_secs(15), || {
        held(&a).len() == 8 && held(&b).len() == 8
    })
    .await;
    assert!(held(&a).is_disjoint(&held(&b)));

    let (client, js, infra) = client_for(&server.url()).await;
    let convs: Vec<String> = (0..30).map(|i| format!("team/{i}:chat")).collect();
    let first: Vec<Envelope> = convs.iter().flat_map(|c| turns(c, 0..12, 60)).collect();
    raw_publish(&client, &first).await;
    wait_until("every conversation folded", Duration::from_secs(30), || {
        let (ca, cb) = (conversations(&a), conversations(&b));
        convs
            .iter()
            .all(|k| ca.get(k).or(cb.get(k)).map(|c| c.0) == Some(12))
    })
    .await;
    let (ca, cb) = (conversations(&a), conversations(&b));
    let keys_a: BTreeSet<&String> = ca.keys().collect();
    let keys_b: BTreeSet<&String> = cb.keys().collect();
    assert!(keys_a.is_disjoint(&keys_b), "a conversation folded twice");
    assert_eq!(keys_a.len() + keys_b.len(), convs.len());
    assert!(!keys_a.is_empty() && !keys_b.is_empty());

    // Kill B (no release, nothing flushed); A takes its partitions over.
    b.abort();
    let more: Vec<Envelope> = convs.iter().flat_map(|c| turns(c, 12..20, 60)).collect();
    raw_publish(&client, &more).await;
    wait_until("A holds every partition", Duration::from_secs(10), || {
        held(&a).len() == 16
    })
    .await;
    let all: BTreeSet<u32> = (0..16).collect();
    // Jobs of B's partitions may still be in flight; wait for none pending.
    let engines = a.engines().unwrap();
    wait_until("every job settled", Duration::from_secs(40), || {
        all.iter().all(|p| {
            engines.get(*p).is_some_and(|e| {
                e.lock()
                    .unwrap()
                    .state
                    .conversations
                    .values()
                    .all(|c| c.pending_job.is_none())
            })
        })
    })
    .await;
    assert_matches_replay(&a, &js, &infra, &all, &policy).await;
    let final_state = conversations(&a);
    assert_eq!(final_state.len(), convs.len());
    assert!(final_state.values().all(|c| c.0 == 20));
    for p in &all {
        let events = partition_events(&js, &infra, *p).await;
        for c in convs.iter().filter(|c| partition_of(c) == *p) {
            one_job_at_a_time(&events, c);
        }
    }
    a.shutdown().await;
}

/// Issue 22: with two processes, `cf.admin.status` answered with the
/// answering process's partitions only (3,725 conversations and 19
/// pending jobs, or 3,662 and 0, alternately). Now whichever process
/// answers gathers the other's partitions from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_status_gathers_every_processs_partitions() {
    let server = NatsServer::start();
    let policy = small_policy();
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let with_api = |dir: &Path, name: &str| {
        let mut o = options(&server.url(), dir, &policy, name);
        o.roles = "folder,summarizer,api".parse::<Roles>().unwrap();
        o
    };
    let a = Service::start(
        with_api(dir_a.path(), "serve-a"),
        Arc::new(DeterministicSummarizer),
    )
    .await
    .unwrap();
    let b = Service::start(
        with_api(dir_b.path(), "serve-b"),
        Arc::new(DeterministicSummarizer),
    )
    .await
    .unwrap();
    wait_until("an 8/8 split", Duration::from_secs(15), || {
        held(&a).len() == 8 && held(&b).len() == 8
    })
    .await;
    let (client, _, _) = client_for(&server.url()).await;
    let convs: Vec<String> = (0..30).map(|i| format!("team/{i}:chat")).collect();
    let events: Vec<Envelope> = convs.iter().flat_map(|c| turns(c, 0..12, 60)).collect();
    raw_publish(&client, &events).await;
    wait_until("every conversation folded", Duration::from_secs(30), || {
        let (ca, cb) = (conversations(&a), conversations(&b));
        convs
            .iter()
            .all(|k| ca.get(k).or(cb.get(k)).map(|c| c.0) == Some(12))
    })
    .await;
    // Asked several times, answered by either process: always the whole.
    for _ in 0..6 {
        let reply = client
            .request("cf.admin.status", "{}".into())
            .await
            .unwrap();
        let g: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(g["conversations"], 30, "{g}");
        assert_eq!(g["turns"], 30 * 12, "{g}");
        assert_eq!(g["partitions"].as_array().map(Vec::len), Some(16), "{g}");
        assert_eq!(g["partitions_total"], 16);
        assert!(g.get("missing_partitions").is_none(), "{g}");
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// Runs the `contextfold` binary without blocking the runtime.
async fn cli(data: &Path, args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::from(support::cli::command(data, args))
        .output()
        .await
        .expect("the contextfold binary runs");
    support::cli::split(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_publishes_and_asks_a_running_service_over_nats() {
    let server = NatsServer::start();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let policy = PolicyConfig::default();
    let mut opts = options(&url, &dir.path().join("serve"), &policy, "cli");
    opts.roles = Roles::default();
    let service = start_alone(opts).await;

    // An agent's turns, published by the CLI as `import` writes them.
    let key = "agent:cli/one";
    let file = dir.path().join("events.jsonl");
    let lines: Vec<String> = turns(key, 0..5, 8).iter().map(|e| e.to_json()).collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let client_data = dir.path().join("client");
    let data = client_data.as_path();
    let (ok, _, err) = cli(data, &["publish", "--nats", &url, file.to_str().unwrap()]).await;
    assert!(ok, "publish: {err}");
    wait_until("5 turns folded", Duration::from_secs(20), || {
        conversations(&service).get(key).map(|c| c.0) == Some(5)
    })
    .await;

    let (ok, out, err) = cli(data, &["status", key, "--nats", &url]).await;
    assert!(ok, "status: {err}");
    assert_eq!(support::cli::json_of(&out)["turns"]["total"], 5, "{out}");

    let (ok, out, err) = cli(data, &["assemble", key, "--nats", &url]).await;
    assert!(ok, "assemble: {err}");
    assert!(
        out.contains("turn 4:") && out.contains("== 5 messages"),
        "{out}"
    );
    let (ok, out, err) = cli(data, &["assemble", key, "--json", "--nats", &url]).await;
    assert!(ok, "assemble --json: {err}");
    assert_eq!(
        support::cli::json_of(&out)["messages"]
            .as_array()
            .unwrap()
            .len(),
        5
    );

    let (ok, out, err) = cli(data, &["grep", key, "turn 3:", "--nats", &url]).await;
    assert!(ok, "grep: {err}");
    assert_eq!(
        support::cli::json_of(&out)["matches"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "{out}"
    );
    let (ok, out, err) = cli(data, &["describe", key, "2", "--nats", &url]).await;
    assert!(ok, "describe: {err}");
    assert!(out.contains("turn 2:"), "{out}");

    let (ok, out, err) = cli(
        data,
        &[
            "compact",
            key,
            "--instructions",
            "keep the ports",
            "--request-id",
            "op-1",
            "--nats",
            &url,
        ],
    )
    .await;
    assert!(ok, "compact: {err}");
    let compact = support::cli::json_of(&out);
    assert_eq!(compact["published"], true, "{out}");
    let event_id = compact["event"]["id"].as_str().unwrap().to_string();
    let mut entries = Vec::new();
    for _ in 0..100 {
        let (ok, out, err) = cli(data, &["history", key, "--nats", &url]).await;
        assert!(ok, "history: {err}");
        entries = support::cli::json_of(&out)["entries"]
            .as_array()
            .unwrap()
            .clone();
        if entries.iter().any(|e| e["event_id"] == event_id.as_str()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        entries.iter().any(|e| e["event_id"] == event_id.as_str()),
        "the manual compaction is in the history: {entries:?}"
    );

    // Errors are the command's errors, with the API's words.
    let (ok, _, err) = cli(data, &["status", "agent:nobody", "--nats", &url]).await;
    assert!(!ok && err.contains("unknown conversation"), "{err}");
    let (ok, _, err) = cli(data, &["status", "--nats", &url, "--prefix", "other"]).await;
    assert!(!ok && err.contains("no contextfold API answers"), "{err}");
    service.shutdown().await;
}

/// `contextfold serve` (the binary) with `[summarizer]` configured writes
/// its summaries with the model, not the deterministic fallback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serve_binary_summarizes_with_the_configured_model() {
    // A model that answers in the handover shape, keeping the user's
    // words (validation refuses an answer below the deterministic summary
    // of the same span, as an echo of the request would be).
    let llm = llm_server::ScriptedServer::start(llm_server::Scripted::handover).await;
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let base = llm.base_url();
    let (mut child, client) = spawn_serve(
        &server,
        dir.path(),
        &[
            ("CONTEXTFOLD_SUMMARIZER__BASE_URL", base.as_str()),
            ("CONTEXTFOLD_SUMMARIZER__MODEL", "good"),
            ("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "6000"),
            ("CONTEXTFOLD_POLICY__FRESH_TAIL_COUNT", "6"),
            ("CONTEXTFOLD_POLICY__LEAF_CHUNK_TOKENS", "1200"),
            ("CONTEXTFOLD_POLICY__LEAF_TARGET_TOKENS", "200"),
        ],
    )
    .await;
    let key = "agent:model/one";
    // What the agent itself would watch to tell its user: the service's
    // events about its conversation.
    let mut watch = client
        .subscribe(format!("cf.svc.{}", token(key)))
        .await
        .unwrap();
    raw_publish(&client, &turns(key, 0..40, 60)).await;
    let body = serde_json::json!({ "conversation": key }).to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = serde_json::Value::Null;
    let status = loop {
        let reply = client
            .request(format!("cf.api.status.{}", token(key)), body.clone().into())
            .await;
        if let Ok(reply) = reply {
            let v: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
            if v["summaries"]["total"].as_u64().unwrap_or(0) > 0 && v["pending_job"].is_null() {
                break v;
            }
            last = v;
        }
        let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap_or_default();
        let exited = child.try_wait().unwrap();
        assert!(exited.is_none(), "serve exited ({exited:?}):\n{log}");
        if Instant::now() >= deadline {
            let history = client
                .request(
                    format!("cf.api.history.{}", token(key)),
                    body.clone().into(),
                )
                .await
                .map(|m| String::from_utf8_lossy(&m.payload).into_owned());
            panic!("no summary in 60 s ({last}); history {history:?}; serve said:\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(status["summaries"]["fallback"], 0, "{status}");
    let mut seen = BTreeSet::new();
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), watch.next()).await {
        if let Ok(e) = Envelope::decode(&m.payload, contextfold::core::event::Encoding::Msgpack)
            .or_else(|_| Envelope::decode(&m.payload, contextfold::core::event::Encoding::Json))
        {
            seen.insert(e.type_name().to_string());
        }
    }
    for shown in [
        "memory_flush_requested",
        "job_issued",
        "summary_recorded",
        "sweep_ended",
    ] {
        assert!(
            seen.contains(shown),
            "{shown} not seen by the agent: {seen:?}"
        );
    }
    assert!(!llm.received().is_empty(), "the model was called");
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    assert!(log.contains("summarizer good at"), "{log}");
    child.kill().await.unwrap();
}

/// The server crashes and comes back (same port, same store): serve
/// reconnects by itself, folds what is published after, and loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_reconnects_after_the_server_restarts_without_losing_work() {
    let mut server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = small_policy();
    let mut cfg = nats_config(&server.url());
    cfg.storage = StorageKind::File;
    let mut opts = options(&server.url(), dir.path(), &policy, "steady");
    opts.nats = cfg.clone();
    let service = start_alone(opts).await;
    let keys = ["agent:r/one", "agent:r/two", "agent:r/three"];
    let client = async_nats::connect(server.url()).await.unwrap();
    for key in keys {
        raw_publish(&client, &turns(key, 0..20, 40)).await;
    }
    client.flush().await.unwrap();
    wait_until("20 turns each folded", Duration::from_secs(30), || {
        let c = conversations(&service);
        keys.iter().all(|k| c.get(*k).map(|c| c.0) == Some(20))
    })
    .await;

    server.kill();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    server.restart();

    // A fresh client, as an agent that reconnects; the service's own
    // connection comes back by itself.
    let client = async_nats::connect(server.url()).await.unwrap();
    for key in keys {
        raw_publish(&client, &turns(key, 20..40, 40)).await;
    }
    client.flush().await.unwrap();
    wait_until("40 turns each folded", Duration::from_secs(60), || {
        let c = conversations(&service);
        keys.iter().all(|k| c.get(*k).map(|c| c.0) == Some(40))
    })
    .await;
    let js = jetstream::new(client.clone());
    let infra = ensure(&js, &cfg).await.expect("setup is as serve left it");
    wait_until("all partitions held again", Duration::from_secs(30), || {
        held(&service).len() == 16
    })
    .await;
    let partitions: BTreeSet<u32> = keys.iter().map(|k| partition_of(k)).collect();
    assert_matches_replay(&service, &js, &infra, &partitions, &policy).await;
    service.shutdown().await;
}

/// The shared data beside the crate, or beside the worktree's parent.
const TRANSCRIPT: [&str; 2] = [
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../shared/data/transcripts/claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl"
    ),
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/data/transcripts/claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl"
    ),
];

/// Jobs of `conv` issued after a job that made no progress the fold
/// accepted (no summary, no rolling state) without agent input between the
/// end of that job and the event that issued the next: the fold must issue
/// none. Decisions reach the stream after whatever was queued before them,
/// so the order is the fold's, read from its history: each `job_issued`,
/// `sweep_ended` and `job_expired` line names the event that caused it,
/// and the stream gives that event's position.
fn jobs_without_progress_or_input(
    events: &[(u64, Envelope)],
    conv: &contextfold::core::state::Conversation,
) -> Vec<String> {
    let position: BTreeMap<&str, u64> = events
        .iter()
        .filter(|(_, e)| e.conversation == conv.key)
        .map(|(pos, e)| (e.id.as_str(), *pos))
        .collect();
    let inputs: Vec<u64> = events
        .iter()
        .filter(|(_, e)| {
            e.conversation == conv.key
                && matches!(
                    e.body,
                    EventBody::TurnAppended(_)
                        | EventBody::ProviderErrorObserved(_)
                        | EventBody::CompactionRequested(_)
                        | EventBody::ModelDeclared(_)
                        | EventBody::ConversationReset(_)
                )
        })
        .map(|(pos, _)| *pos)
        .collect();
    let progress = |job: &str| {
        conv.summaries
            .iter()
            .any(|s| s.job_id.as_deref() == Some(job))
            || events.iter().any(|(_, e)| {
                matches!(&e.body, EventBody::RollingStateUpdated(r)
                    if r.job_id.as_deref() == Some(job))
            })
    };
    let job_of = |detail: &str| detail.split(':').next().unwrap_or_default().to_string();
    let mut bad = Vec::new();
    // The last job issued and where it ended (its sweep_ended or expiry).
    let mut last: Option<(String, Option<u64>)> = None;
    for h in conv.history.resident() {
        let at = position.get(h.event_id.as_str()).copied();
        match h.event_type.as_str() {
            "job_issued" => {
                let job = job_of(&h.detail);
                if let (Some((prev, ended)), Some(at)) = (&last, at) {
                    let from = ended.unwrap_or(0);
                    let spoke = inputs.iter().any(|&i| i > from && i <= at);
                    if !progress(prev) && !spoke {
                        bad.push(format!("{job} after barren {prev} with no input between"));
                    }
                }
                last = Some((job, None));
            }
            "sweep_ended" | "job_expired" => {
                let job = h.detail.split([':', ' ']).next().unwrap_or_default();
                if let Some((prev, ended)) = &mut last {
                    if prev == job && ended.is_none() {
                        *ended = at;
                    }
                }
            }
            _ => {}
        }
    }
    bad
}

/// Issue 10, item 5: one Claude Code session published at once to one
/// `serve`, an 8,000-token budget and a fresh tail of 16. The transcript's
/// own clock runs hours ahead of the fold's jobs, so turns expire jobs
/// whose workers still run, and an expired job's summaries and its
/// successor's arrive mixed. Before, that left raw turns between two
/// summaries and an endless job loop (612 jobs in 4 s on the first try,
/// the stream growing 133 events/s). It is a race: several copies of the
/// session go at once, each its own conversation. For each: no raw turn
/// between summaries, a bounded number of jobs, no job right after a job
/// that made no progress unless the agent spoke in between, and once the
/// input stops the stream stops growing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transcript_published_at_once_settles_without_a_job_loop() {
    let Some(path) = TRANSCRIPT.iter().map(Path::new).find(|p| p.is_file()) else {
        eprintln!("SKIPPED: no transcript at {TRANSCRIPT:?} (shared test data not mounted)");
        return;
    };
    let imported = contextfold::import::import_file(path, contextfold::import::Format::ClaudeCode)
        .expect("the transcript imports");
    let session = imported.first().expect("one conversation");
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = PolicyConfig {
        max_assembly_token_budget: Some(8_000),
        fresh_tail_count: 16,
        ..PolicyConfig::default()
    };
    let service = start_alone(options(&server.url(), dir.path(), &policy, "solo")).await;
    let (client, js, infra) = client_for(&server.url()).await;
    let turns_each = session
        .events
        .iter()
        .filter(|e| matches!(e.body, EventBody::TurnAppended(_)))
        .count();
    // The tenure of every partition: deterministic summaries written
    // during the burst must not starve the lease renewals (they did, on
    // the async workers, and the service lost every partition it held).
    let tenures = |s: &Service| {
        let engines = s.engines().unwrap();
        (0..16u32)
            .map(|p| engines.get(p).map(|e| Arc::as_ptr(&e) as usize))
            .collect::<Vec<_>>()
    };
    let tenure = tenures(&service);
    assert!(tenure.iter().all(Option::is_some), "every partition held");
    // Rounds of copies published at once, each copy its own conversation.
    const ROUNDS: usize = 3;
    const COPIES: usize = 4;
    for round in 0..ROUNDS {
        let keys: Vec<String> = (0..COPIES)
            .map(|a| format!("agent:loop-{round}-{a}/{}", session.conversation))
            .collect();
        let copies: Vec<Vec<Envelope>> = keys
            .iter()
            .map(|key| {
                session
                    .events
                    .iter()
                    .map(|e| {
                        let mut e = e.clone();
                        e.id = format!("{key}#{}", e.id);
                        e.conversation = key.clone();
                        e
                    })
                    .collect()
            })
            .collect();
        let started = Instant::now();
        for copy in &copies {
            raw_publish(&client, copy).await;
        }
        let partitions: BTreeSet<u32> = keys.iter().map(|k| partition_of(k)).collect();
        // Every event folded, no job pending, and the stream still for 2 s.
        // Read through the engine, resident or not: a lease lost under load
        // reopens the partition's store with nothing resident.
        let settled = |p: u32| {
            let engine = service.engines()?.get(p)?;
            let position = engine.lock().unwrap().position();
            let idle = keys
                .iter()
                .filter(|k| partition_of(k) == p)
                .all(|k| conversation_of(&service, k).is_some_and(|c| c.pending_job.is_none()));
            Some((idle, position))
        };
        let mut last = BTreeMap::new();
        let mut still_since = Instant::now();
        loop {
            // The engines' locks are held for a whole batch: wait for them
            // off the async workers the service shares with this test.
            let (now, folded_all) = tokio::task::block_in_place(|| {
                let now: BTreeMap<u32, _> = partitions.iter().map(|&p| (p, settled(p))).collect();
                // Every copy's last event applied (turns the fold rejects too).
                let folded_all = copies.iter().all(|copy| {
                    copy.last().is_some_and(|e| {
                        conversation_of(&service, &e.conversation)
                            .is_some_and(|c| c.has_applied(&e.id))
                    })
                });
                (now, folded_all)
            });
            if now != last || !folded_all || now.values().any(|s| s.is_none_or(|(idle, _)| !idle)) {
                last = now;
                still_since = Instant::now();
            } else if still_since.elapsed() > Duration::from_secs(2) {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "round {round}: did not settle in 15 s: {last:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The stream stopped growing: its end is where the folder is.
        let mut total_jobs = 0;
        for &p in &partitions {
            let events = partition_events(&js, &infra, p).await;
            let end = events.last().map_or(0, |(pos, _)| *pos);
            let position = service
                .engines()
                .and_then(|e| e.get(p))
                .map(|e| e.lock().unwrap().position());
            assert_eq!(
                position,
                Some(end),
                "partition {p}: the stream grew past the fold"
            );
            for key in keys.iter().filter(|k| partition_of(k) == p) {
                let conv = &conversation_of(&service, key).unwrap();
                let first_raw = conv
                    .context
                    .iter()
                    .position(|i| matches!(i, contextfold::core::state::ContextItem::Turn(_)))
                    .unwrap_or(conv.context.len());
                assert!(
                    conv.context[first_raw..]
                        .iter()
                        .all(|i| matches!(i, contextfold::core::state::ContextItem::Turn(_))),
                    "{key}: raw turns between summaries: {:?}",
                    conv.context
                );
                // Not one at a time: the transcript's clock expires jobs.
                let jobs = events
                    .iter()
                    .filter(|(_, e)| &e.conversation == key)
                    .filter(|(_, e)| matches!(e.body, EventBody::JobIssued(_)))
                    .count();
                total_jobs += jobs;
                // A job follows progress or new input: never more jobs than
                // accepted summaries and rolling states plus the agent's turns.
                assert!(
                    jobs <= conv.summaries.len() + turns_each,
                    "{key}: {jobs} jobs for {} summaries and {turns_each} turns",
                    conv.summaries.len()
                );
                let bad = jobs_without_progress_or_input(&events, conv);
                assert!(bad.is_empty(), "{key}: {bad:?}");
                assert!(!conv.summaries.is_empty(), "{key}: nothing was compacted");
                // Compaction finished rather than stopped: nothing owed, within budget.
                assert!(conv.debt.is_none(), "{key}: still owes {:?}", conv.debt);
                assert!(
                    conv.context.tokens() <= 8_000,
                    "{key}: {} tokens",
                    conv.context.tokens()
                );
            }
        }
        assert_eq!(
            tenures(&service),
            tenure,
            "round {round}: a partition changed hands (a lease ran out)"
        );
        eprintln!(
            "round {round}: {COPIES} copies of {turns_each} turns settled in {:?} with {total_jobs} jobs",
            started.elapsed()
        );
    }
    service.shutdown().await;
}

/// `recall` over NATS (issue 14): a running service plans it on the
/// owner's state, asks its `[recall]` model, stores the spend as a
/// `recall_answered` event in the events stream and answers; the CLI asks
/// with `--nats`, and the conversation's spend window then counts the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recall_over_nats_asks_the_model_and_counts_its_spend() {
    let rules = serde_json::json!({"rules": [
        {"name": "recall", "when": {"model_matches": "recaller"},
         "respond": {"content": "The deploy key is K-7731 (turn 10)."}}
    ]});
    let Some(llm) = llm_server::FakeLlm::start(&rules.to_string()).await else {
        return;
    };
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let base = llm.base_url();
    let (mut child, client) = spawn_serve(
        &server,
        dir.path(),
        &[
            ("CONTEXTFOLD_RECALL__BASE_URL", base.as_str()),
            ("CONTEXTFOLD_RECALL__MODEL", "recaller"),
        ],
    )
    .await;
    let key = "agent:recall";
    let mut events = turns(key, 0..10, 30);
    events.push(Envelope::new(
        format!("{key}#needle"),
        key,
        1_700_000_100_000,
        EventBody::TurnAppended(contextfold::core::event::TurnAppended::from(
            contextfold::core::message::ChatMessage::text(
                contextfold::core::message::Role::User,
                "Remember: the deploy key is K-7731.",
            ),
        )),
    ));
    raw_publish(&client, &events).await;
    let status_body = serde_json::json!({ "conversation": key }).to_string();
    let status = |client: async_nats::Client| {
        let body = status_body.clone();
        async move {
            let reply = client
                .request(format!("cf.api.status.{}", token(key)), body.into())
                .await
                .ok()?;
            serde_json::from_slice::<serde_json::Value>(&reply.payload).ok()
        }
    };
    let folded = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(s) = status(client.clone()).await {
            if s["turns"]["total"].as_u64() == Some(11) {
                break;
            }
        }
        assert!(Instant::now() < folded, "the turns were not folded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Without a request id over NATS: refused, saying why, no model call.
    let bare = serde_json::json!({"conversation": key, "question": "What is the deploy key?"});
    let reply = client
        .request(
            format!("cf.api.recall.{}", token(key)),
            bare.to_string().into(),
        )
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(v["error"]["code"], "bad_request", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("request_id"),
        "{v}"
    );
    assert_eq!(llm.total().await, 0);

    let (ok, stdout, stderr) = cli(
        &dir.path().join("cli"),
        &[
            "recall",
            "--nats",
            &server.url(),
            key,
            "What is the deploy key?",
            "--json",
            "--request-id",
            "r-1",
        ],
    )
    .await;
    assert!(ok, "{stdout}\n{stderr}");
    let answer: serde_json::Value = serde_json::from_str(&stdout).expect("recall JSON");
    assert!(
        answer["answer"]
            .as_str()
            .unwrap_or_default()
            .contains("K-7731"),
        "{answer}"
    );
    let sources = answer["sources"].as_array().cloned().unwrap_or_default();
    assert!(
        sources.iter().any(|s| s["seq"].as_u64() == Some(10)),
        "the needle's turn is not among the sources: {answer}"
    );
    assert!(
        answer["tokens"].as_u64() <= answer["max_tokens"].as_u64(),
        "{answer}"
    );
    assert_eq!(llm.total().await, 1);

    // The spend is folded from the events stream into the spend window.
    let counted = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = status(client.clone()).await {
            if s["spend_window"]["calls"].as_u64().unwrap_or(0) >= 1 {
                break;
            }
            assert!(
                Instant::now() < counted,
                "the recall's spend is not counted: {s}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The same request id again: answered, the spend event deduplicated.
    let (ok, stdout, stderr) = cli(
        &dir.path().join("cli"),
        &[
            "recall",
            "--nats",
            &server.url(),
            key,
            "What is the deploy key?",
            "--request-id",
            "r-1",
        ],
    )
    .await;
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("K-7731"), "{stdout}");
    child.kill().await.unwrap();
}

/// A serve process with the folder role only, default policy.
async fn a_folder_alone(server: &NatsServer, dir: &Path, name: &str) -> Service {
    let policy = PolicyConfig::default();
    let mut opts = options(&server.url(), dir, &policy, name);
    opts.roles = "folder".parse::<Roles>().unwrap();
    start_alone(opts).await
}

/// A delivery the folder never receives (here taken by another client
/// pulling from the folder's own consumer, as a message lost in flight when
/// a NATS node dies) is not acknowledged past by the folder's ack-all: the
/// folder sees the gap in the consumer's delivery numbers and refolds from
/// its position, so every turn is folded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_lost_on_the_way_is_folded_all_the_same() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let service = a_folder_alone(&server, dir.path(), "gap").await;
    let (client, _, _) = client_for(&server.url()).await;
    let key = "agent:gap/one";
    raw_publish(&client, &turns(key, 0..2, 8)).await;
    wait_until("2 turns folded", Duration::from_secs(20), || {
        conversations(&service).get(key).map(|c| c.0) == Some(2)
    })
    .await;
    // The thief waits in the consumer's queue of pull requests beside the
    // folder's; the server hands the next messages out between them.
    let consumer = contextfold::nats::subjects::Subjects::new("cf")
        .unwrap()
        .folder_consumer(partition_of(key));
    let inbox = client.new_inbox();
    let mut stolen = client.subscribe(inbox.clone()).await.unwrap();
    for _ in 0..4 {
        client
            .publish_with_reply(
                format!("$JS.API.CONSUMER.MSG.NEXT.CF_EVENTS.{consumer}"),
                inbox.clone(),
                r#"{"batch":1,"expires":10000000000}"#.into(),
            )
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    let more = turns(key, 0..12, 8);
    let mut taken = 0;
    for e in &more[2..] {
        raw_publish(&client, std::slice::from_ref(e)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(5), stolen.next()).await
        {
            if !m.payload.is_empty() && m.status.is_none() {
                taken += 1;
            }
        }
    }
    assert!(taken > 0, "the test took no delivery from the folder");
    wait_until("all 12 turns folded", Duration::from_secs(20), || {
        conversations(&service).get(key).map(|c| c.0) == Some(12)
    })
    .await;
    service.shutdown().await;
}

/// A folder consumer an operator deletes under a running serve is
/// recreated at the partition's committed position, and the partition
/// folds on: the server's deletion notice ends the pull and the folder
/// recreates the consumer (taking that notice for a lost pull, and pulling
/// again, fails this test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_consumer_deleted_under_a_running_serve_is_recreated() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let service = a_folder_alone(&server, dir.path(), "deleted").await;
    let (client, js, _) = client_for(&server.url()).await;
    let key = "agent:deleted/one";
    let all = turns(key, 0..5, 8);
    raw_publish(&client, &all[..2]).await;
    wait_until("2 turns folded", Duration::from_secs(20), || {
        conversations(&service).get(key).map(|c| c.0) == Some(2)
    })
    .await;
    let subjects = contextfold::nats::subjects::Subjects::new("cf").unwrap();
    js.get_stream(subjects.events_stream())
        .await
        .unwrap()
        .delete_consumer(&subjects.folder_consumer(partition_of(key)))
        .await
        .unwrap();
    raw_publish(&client, &all[2..]).await;
    wait_until("all 5 turns folded", Duration::from_secs(20), || {
        conversations(&service).get(key).map(|c| c.0) == Some(5)
    })
    .await;
    service.shutdown().await;
}

/// `publish` names its duplicates: a re-run's (the same bytes already
/// stored) pass; an event whose message id another record holds (here one
/// published first on the same conversation without credentials, as an
/// unkeyed id can be) is reported as not stored, and publish fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_names_duplicates_and_fails_on_ones_not_its_own() {
    use contextfold::core::event::Origin;
    let server = NatsServer::start();
    let url = server.url();
    let (client, _, _) = client_for(&url).await;
    let dir = tempfile::tempdir().unwrap();
    let key = "agent:dup/one";
    let events = turns(key, 0..4, 8);
    let file = dir.path().join("events.jsonl");
    let lines: Vec<String> = events.iter().map(|e| e.to_json()).collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let data = dir.path().join("client");
    let file_arg = file.to_str().unwrap();

    // Another record takes event 2's (unkeyed) message id first.
    let squatted = &events[2];
    let mut headers = async_nats::HeaderMap::new();
    let id = contextfold::nats::msg_id::of(Origin::Agent, None, key, &squatted.id);
    headers.insert("Nats-Msg-Id", id.as_str());
    headers.insert("Content-Type", "application/json");
    let mut other = squatted.clone();
    other.body = turns(key, 9..10, 3)[0].body.clone();
    client
        .publish_with_headers(
            format!("cf.in.{}", token(key)),
            headers,
            other.to_json().into(),
        )
        .await
        .unwrap();
    client.flush().await.unwrap();

    let (ok, _, err) = cli(&data, &["publish", "--nats", &url, file_arg]).await;
    assert!(!ok, "a squatted event must fail the publish: {err}");
    assert!(err.contains("1 event(s) NOT stored"), "{err}");
    assert!(err.contains(&squatted.id), "names the event: {err}");

    // A re-run: the three stored events are this publisher's own.
    let (ok, _, err) = cli(&data, &["publish", "--nats", &url, file_arg]).await;
    assert!(!ok, "the squatted event is still not stored: {err}");
    assert!(
        err.contains("3 duplicate(s) already stored with these same bytes"),
        "{err}"
    );
    let own: Vec<String> = lines
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 2)
        .map(|(_, l)| l.clone())
        .collect();
    let own_file = dir.path().join("own.jsonl");
    std::fs::write(&own_file, own.join("\n") + "\n").unwrap();
    let (ok, _, err) = cli(
        &data,
        &["publish", "--nats", &url, own_file.to_str().unwrap()],
    )
    .await;
    assert!(ok, "a re-run of stored events passes: {err}");
}

/// Issue 23, finding 2: an agent that publishes another's next event ids
/// first, on its own subject and within its permissions, takes nothing:
/// message ids are scoped to their conversation and keyed by the
/// publisher's credentials, so neither the bare ids nor the unkeyed scoped
/// ids the attacker can compute collide with the victim's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_agents_event_ids_cannot_be_squatted() {
    use contextfold::core::event::Origin;
    let server = NatsServer::start_with_config(
        r#"authorization { users = [ {user: a, password: "pass-a"}, {user: b, password: "pass-b"} ] }"#,
    );
    let url = server.url();
    let as_user = |user: &str, password: &str| {
        let mut cfg = nats_config(&url);
        cfg.connection.user = Some(user.into());
        cfg.connection.password = Some(contextfold::secret::Secret::new(password));
        cfg
    };
    let (attacker, js, _) = client_for_config(&as_user("a", "pass-a")).await;
    let (victim_key, attacker_key) = ("team-b/agent", "team-a/agent");
    let victims = turns(victim_key, 0..10, 8);
    // The attacker publishes, on its own conversation's subject, a record
    // under each id the victim's events could have: the bare event id (as
    // ids were) and the unkeyed scoped id anyone can compute.
    for (n, e) in victims.iter().enumerate() {
        for id in [
            e.id.clone(),
            contextfold::nats::msg_id::of(Origin::Agent, None, victim_key, &e.id),
        ] {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", id.as_str());
            let decoy = &turns(attacker_key, n..n + 1, 3)[0];
            attacker
                .publish_with_headers(
                    format!("cf.in.{}", token(attacker_key)),
                    headers,
                    decoy.to_json().into(),
                )
                .await
                .unwrap();
        }
    }
    attacker.flush().await.unwrap();

    // The victim publishes with its own credentials: every event stored.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("events.jsonl");
    let lines: Vec<String> = victims.iter().map(|e| e.to_json()).collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let out = tokio::process::Command::from({
        let mut c = support::cli::command(
            &dir.path().join("client"),
            &["publish", "--nats", &url, file.to_str().unwrap()],
        );
        c.env("CONTEXTFOLD_NATS__CONNECTION__USER", "b")
            .env("CONTEXTFOLD_NATS__CONNECTION__PASSWORD", "pass-b");
        c
    })
    .output()
    .await
    .unwrap();
    let (ok, _, err) = support::cli::split(out);
    assert!(ok, "{err}");
    assert!(err.contains("(10 new, 0 duplicates"), "{err}");
    let stored = js
        .get_stream("CF_EVENTS")
        .await
        .unwrap()
        .create_consumer(jetstream::consumer::pull::Config {
            filter_subject: format!("cf.ev.*.in.{}", token(victim_key)),
            ..Default::default()
        })
        .await
        .unwrap()
        .cached_info()
        .num_pending;
    assert_eq!(stored, 10, "every one of the victim's events is stored");
}
