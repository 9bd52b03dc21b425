//! The folder role against real nats-server processes: turns published by a
//! plain NATS client are folded and assemble; duplicates and redeliveries
//! change nothing; a crashed folder resumes from its checkpoint; two
//! processes split the partitions, fold each conversation exactly once, and
//! the survivor of a kill ends with the state of a clean replay; a
//! compaction job is issued once however many triggers fire.
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;
use contextfold::testing::small_policy;
use support::replay::replay_partition;
use support::turns::turns;

use async_nats::jetstream::{self, consumer::DeliverPolicy};
use contextfold::core::assembly::{self, AssemblyRequest};
use contextfold::core::event::{Encoding, Envelope, EventBody};
use contextfold::core::policy::PolicyConfig;
use contextfold::log::EventLog;
use contextfold::nats::config::StorageKind;
use contextfold::nats::event_log::{event_headers, NatsEventLog};
use contextfold::nats::folder::{EngineFactory, EngineMap, FolderRole, FolderSettings};
use contextfold::nats::jobs::JobMessage;
use contextfold::nats::leases::{LeaseRunner, LeaseSettings, PartitionLeases};
use contextfold::nats::setup::{ensure, Infrastructure};
use contextfold::nats::subjects::{encode_conversation, partition_of_token};
use contextfold::nats::{NatsConfig, NatsOptions};
use contextfold::runtime::engine::Engine;
use contextfold::store::memory_backend::MemoryBackend;
use contextfold::store::redb_backend::RedbBackend;
use contextfold::store::KvBackend;
use futures::StreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::nats_server::NatsServer;
use tokio::sync::watch;
use tokio::task::JoinHandle;

fn config(url: &str) -> NatsConfig {
    NatsConfig {
        connection: NatsOptions::with_servers([url]),
        lease_ttl_ms: 2_000,
        lease_renew_ms: 250,
        lease_margin_ms: 700,
        storage: StorageKind::Memory,
        ..NatsConfig::default()
    }
}

async fn connect(cfg: &NatsConfig) -> (async_nats::Client, jetstream::Context, Infrastructure) {
    let (client, _) = cfg.connection.connect().await.expect("connect");
    let js = jetstream::new(client.clone());
    let infra = ensure(&js, cfg).await.expect("setup");
    (client, js, infra)
}

/// One contextfold process: a lease member and its folder role.
struct Process<B: KvBackend> {
    runner: LeaseRunner,
    engines: EngineMap<B>,
    folder: JoinHandle<()>,
    stop: watch::Sender<bool>,
}

async fn start_process<B: KvBackend + 'static>(
    cfg: &NatsConfig,
    member: &str,
    open: EngineFactory<B>,
) -> Process<B> {
    let (_client, js, infra) = connect(cfg).await;
    let mut runner = PartitionLeases::new(
        infra.leases.clone(),
        member,
        LeaseSettings::from_config(cfg),
    )
    .expect("lease member")
    .spawn();
    let events = runner.take_events();
    let role = FolderRole::new(js, &infra, open, FolderSettings::default());
    let engines = role.engines();
    let (stop, stop_rx) = watch::channel(false);
    let folder = tokio::spawn(role.run(events, stop_rx));
    Process {
        runner,
        engines,
        folder,
        stop,
    }
}

impl<B: KvBackend> Process<B> {
    /// As a kill -9 would: nothing released, nothing flushed.
    fn crash(self) {
        self.folder.abort();
        self.runner.abort();
    }

    async fn shut_down(self) {
        let _ = self.stop.send(true);
        let _ = self.folder.await;
        self.runner.stop().await;
    }

    fn partitions(&self) -> BTreeSet<u32> {
        self.engines.partitions().into_iter().collect()
    }

    /// Conversation -> (turns, state hash) over every partition held.
    fn conversations(&self) -> BTreeMap<String, (usize, String)> {
        let mut out = BTreeMap::new();
        for p in self.engines.partitions() {
            if let Some(engine) = self.engines.get(p) {
                let e = engine.lock().unwrap();
                for (key, conv) in &e.state.conversations {
                    out.insert(
                        key.clone(),
                        (conv.turns.len(), conv.hash_with(&e.bodies()).unwrap()),
                    );
                }
            }
        }
        out
    }
}

fn memory_engines(policy: PolicyConfig) -> EngineFactory<MemoryBackend> {
    Arc::new(move |_| Engine::open(MemoryBackend::default(), policy.clone()))
}

fn redb_engines(dir: PathBuf, policy: PolicyConfig) -> EngineFactory<RedbBackend> {
    Arc::new(move |p| {
        let backend = RedbBackend::open(&dir.join(format!("partition-{p}.redb")))?;
        Engine::open(backend, policy.clone())
    })
}

async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// As an agent in any language would: core NATS, JSON, the event id as
/// `Nats-Msg-Id`, on the conversation's inbound subject.
async fn raw_publish(client: &async_nats::Client, events: &[Envelope], with_msg_id: bool) {
    for e in events {
        let subject = format!("cf.in.{}", encode_conversation(&e.conversation).unwrap());
        let body = e.to_json();
        if with_msg_id {
            client
                .publish_with_headers(subject, event_headers(&e.id, Encoding::Json), body.into())
                .await
                .unwrap();
        } else {
            client.publish(subject, body.into()).await.unwrap();
        }
    }
    client.flush().await.unwrap();
}

/// Waits until `process` folded every partition up to the stream's end,
/// then checks each partition's state against a clean replay.
async fn assert_matches_replay<B: KvBackend>(
    process: &Process<B>,
    js: &jetstream::Context,
    infra: &Infrastructure,
    partitions: &BTreeSet<u32>,
    policy: &PolicyConfig,
) {
    for &p in partitions {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (end, replayed) = replay_partition(js, infra, p, policy).await;
            let live = process.engines.get(p).map(|e| {
                let e = e.lock().unwrap();
                (e.position(), e.state_hash().unwrap())
            });
            if live == Some((end, replayed.clone())) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "partition {p}: live {live:?} vs replay {:?}",
                (end, replayed)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test]
async fn raw_published_turns_are_folded_assembled_and_duplicates_change_nothing() {
    let server = NatsServer::start();
    let cfg = config(&server.url());
    let (client, js, infra) = connect(&cfg).await;
    let policy = PolicyConfig::default();
    let p1 = start_process(&cfg, "solo", memory_engines(policy.clone())).await;
    wait_until("all partitions held", Duration::from_secs(10), || {
        p1.partitions().len() == 16
    })
    .await;

    let convs = ["agent:alpha/main", "agent beta", "gamma-7"];
    let events: Vec<Envelope> = convs.iter().flat_map(|c| turns(c, 0..20, 12)).collect();
    raw_publish(&client, &events, true).await;
    wait_until("60 turns folded", Duration::from_secs(20), || {
        let c = p1.conversations();
        convs.iter().all(|k| c.get(*k).map(|(n, _)| *n) == Some(20))
    })
    .await;

    // Assembled from the owner's state, the last turn is there verbatim.
    let key = "agent:alpha/main";
    let p = partition_of_token(&encode_conversation(key).unwrap(), cfg.partitions);
    let engine = p1.engines.get(p).expect("owner of the partition");
    {
        let e = engine.lock().unwrap();
        let conv = &e.state.conversations[key];
        let assembled =
            assembly::assemble_from(conv, &e.bodies(), &e.policy, &AssemblyRequest::default())
                .unwrap();
        let last = serde_json::to_string(&assembled.messages.last().unwrap()).unwrap();
        assert!(last.contains("turn 19:"), "{last}");
    }
    drop(engine);

    let partitions: BTreeSet<u32> = (0..cfg.partitions).collect();
    assert_matches_replay(&p1, &js, &infra, &partitions, &policy).await;
    let before = p1.conversations();

    let mut stream = infra.events.clone();
    let stored_before = stream.info().await.unwrap().state.messages;

    // Republished with the same Nats-Msg-Id: the server drops them.
    raw_publish(&client, &events, true).await;
    // Republished without it: stored again, and the fold drops them by id.
    raw_publish(&client, &events, false).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stored = stream.info().await.unwrap().state.messages;
        if stored == stored_before + 60 {
            break;
        }
        assert!(
            stored < stored_before + 60 && Instant::now() < deadline,
            "{stored} stored: expected {stored_before} plus 60 copies without a msg id"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_matches_replay(&p1, &js, &infra, &partitions, &policy).await;
    assert_eq!(p1.conversations(), before, "duplicates changed the state");
    p1.shut_down().await;
}

#[tokio::test]
async fn a_crashed_folder_resumes_from_its_checkpoint() {
    let server = NatsServer::start();
    let cfg = config(&server.url());
    let (client, js, infra) = connect(&cfg).await;
    let dir = tempfile::tempdir().unwrap();
    let policy = PolicyConfig::default();
    let first = start_process(
        &cfg,
        "first",
        redb_engines(dir.path().into(), policy.clone()),
    )
    .await;
    wait_until("all partitions held", Duration::from_secs(10), || {
        first.partitions().len() == 16
    })
    .await;
    let convs: Vec<String> = (0..12).map(|i| format!("crash:{i}")).collect();
    let early: Vec<Envelope> = convs.iter().flat_map(|c| turns(c, 0..10, 8)).collect();
    raw_publish(&client, &early, true).await;
    wait_until("first batch folded", Duration::from_secs(20), || {
        first
            .conversations()
            .values()
            .map(|(n, _)| n)
            .sum::<usize>()
            == 120
    })
    .await;
    let committed: BTreeMap<u32, u64> = first
        .engines
        .partitions()
        .into_iter()
        .filter_map(|p| {
            first
                .engines
                .get(p)
                .map(|e| (p, e.lock().unwrap().position()))
        })
        .collect();
    first.crash();

    // Turns keep coming while nobody folds.
    let late: Vec<Envelope> = convs.iter().flat_map(|c| turns(c, 10..16, 8)).collect();
    raw_publish(&client, &late, true).await;

    let second = start_process(
        &cfg,
        "second",
        redb_engines(dir.path().into(), policy.clone()),
    )
    .await;
    wait_until(
        "takeover after the lease TTL",
        Duration::from_secs(10),
        || second.partitions().len() == 16,
    )
    .await;
    // Each engine opened at the checkpoint the crashed process committed.
    let partitions: BTreeSet<u32> = (0..cfg.partitions).collect();
    assert_matches_replay(&second, &js, &infra, &partitions, &policy).await;
    let turns: usize = second.conversations().values().map(|(n, _)| n).sum();
    assert_eq!(turns, 12 * 16);
    assert!(committed.values().any(|pos| *pos > 0));

    // The consumer of each partition was recreated after the checkpoint,
    // not at the stream's start.
    for (p, pos) in committed {
        let info = infra
            .events
            .consumer_info(infra.subjects.folder_consumer(p))
            .await
            .unwrap();
        let start = match info.config.deliver_policy {
            DeliverPolicy::All => 0,
            DeliverPolicy::ByStartSequence { start_sequence } => start_sequence,
            other => panic!("unexpected deliver policy {other:?}"),
        };
        assert!(
            start == 0 || start == pos + 1,
            "partition {p}: start {start} after {pos}"
        );
    }
    second.shut_down().await;
}

#[tokio::test]
async fn two_processes_fold_each_conversation_once_and_a_kill_moves_partitions() {
    let server = NatsServer::start();
    let cfg = config(&server.url());
    let (client, js, infra) = connect(&cfg).await;
    let policy = small_policy();
    let a = start_process(&cfg, "proc-a", memory_engines(policy.clone())).await;
    let b = start_process(&cfg, "proc-b", memory_engines(policy.clone())).await;
    wait_until("an 8/8 split", Duration::from_secs(15), || {
        a.partitions().len() == 8 && b.partitions().len() == 8
    })
    .await;
    assert!(a.partitions().is_disjoint(&b.partitions()));

    let convs: Vec<String> = (0..40).map(|i| format!("team/{i}:chat")).collect();
    let events: Vec<Envelope> = convs.iter().flat_map(|c| turns(c, 0..10, 10)).collect();
    raw_publish(&client, &events, true).await;
    wait_until("every conversation folded", Duration::from_secs(30), || {
        let (ca, cb) = (a.conversations(), b.conversations());
        convs
            .iter()
            .all(|k| ca.get(k).or(cb.get(k)).map(|(n, _)| *n) == Some(10))
    })
    .await;
    let (ca, cb) = (a.conversations(), b.conversations());
    let keys_a: BTreeSet<&String> = ca.keys().collect();
    let keys_b: BTreeSet<&String> = cb.keys().collect();
    assert!(keys_a.is_disjoint(&keys_b), "a conversation folded twice");
    assert_eq!(keys_a.len() + keys_b.len(), 40);
    assert!(!keys_a.is_empty() && !keys_b.is_empty());

    // Kill B; A takes its partitions, replays them, and keeps folding.
    let b_partitions = b.partitions();
    b.crash();
    let more: Vec<Envelope> = convs.iter().flat_map(|c| turns(c, 10..14, 10)).collect();
    raw_publish(&client, &more, true).await;
    wait_until("A holds everything", Duration::from_secs(10), || {
        a.partitions().len() == 16
    })
    .await;
    assert_matches_replay(&a, &js, &infra, &b_partitions, &policy).await;
    let all: BTreeSet<u32> = (0..cfg.partitions).collect();
    assert_matches_replay(&a, &js, &infra, &all, &policy).await;
    let final_state = a.conversations();
    assert_eq!(final_state.len(), 40);
    assert!(final_state.values().all(|(n, _)| *n == 14));
    a.shut_down().await;
}

#[tokio::test]
async fn one_compaction_job_per_conversation_however_many_triggers() {
    let server = NatsServer::start();
    let cfg = config(&server.url());
    let (client, js, infra) = connect(&cfg).await;
    let policy = small_policy();
    let p = start_process(&cfg, "solo", memory_engines(policy.clone())).await;
    wait_until("all partitions held", Duration::from_secs(10), || {
        p.partitions().len() == 16
    })
    .await;
    // Far past the threshold: every later turn would trigger again.
    let conv = "agent:compact";
    let events = turns(conv, 0..40, 120);
    raw_publish(&client, &events, true).await;
    wait_until("40 turns folded", Duration::from_secs(20), || {
        p.conversations().get(conv).map(|(n, _)| *n) == Some(40)
    })
    .await;
    let part = partition_of_token(&encode_conversation(conv).unwrap(), cfg.partitions);
    let pending = {
        let engine = p.engines.get(part).unwrap();
        let e = engine.lock().unwrap();
        e.state.conversations[conv]
            .pending_job
            .clone()
            .expect("a pending job")
    };
    let all: BTreeSet<u32> = (0..cfg.partitions).collect();
    assert_matches_replay(&p, &js, &infra, &all, &policy).await;

    let mut jobs = infra.jobs.clone();
    let info = jobs.info().await.unwrap().clone();
    assert_eq!(info.state.messages, 1, "one job on the queue");
    let stored = infra
        .jobs
        .direct_get_last_for_subject(format!("cf.job.{}", encode_conversation(conv).unwrap()))
        .await;
    let stored = match stored {
        Ok(m) => m,
        // Work queues do not allow direct get: read it with the API.
        Err(_) => infra
            .jobs
            .get_last_raw_message_by_subject(&format!(
                "cf.job.{}",
                encode_conversation(conv).unwrap()
            ))
            .await
            .unwrap(),
    };
    let job = JobMessage::decode(&stored.payload).unwrap();
    assert_eq!(job.job_id, pending.job.job_id);
    let snapshot = job.snapshot(&infra.payloads).await.unwrap();
    assert_eq!(snapshot.conversation, conv);
    // A compacting job carries its plan; a job granted only the rolling
    // state's refresh (as this one is, under the small policy) carries the
    // turns it reads, and no plan.
    if snapshot.job.compact {
        assert!(!snapshot.items.is_empty());
    } else {
        assert!(snapshot.job.refresh_rolling_state);
        assert!(snapshot.items.is_empty());
        assert!(!snapshot.rolling_sources.is_empty());
    }

    // The job_issued decision is in the log exactly once.
    let mut log = NatsEventLog::open_partition(js.clone(), infra.subjects.clone(), part)
        .await
        .unwrap();
    let records = log.read_after(0, 10_000).await.unwrap();
    let issued: Vec<Envelope> = records
        .iter()
        .map(|r| Envelope::decode(&r.bytes, r.encoding).unwrap())
        .filter(|e| matches!(e.body, EventBody::JobIssued(_)))
        .collect();
    assert_eq!(issued.len(), 1, "{issued:?}");

    // Republishing every turn (no msg id) triggers nothing new.
    raw_publish(&client, &events, false).await;
    assert_matches_replay(&p, &js, &infra, &all, &policy).await;
    assert_eq!(jobs.info().await.unwrap().state.messages, 1);
    let mut sub = client.subscribe("cf.job.>").await.unwrap();
    let none = tokio::time::timeout(Duration::from_millis(300), sub.next()).await;
    assert!(none.is_err(), "a second job was published");
    p.shut_down().await;
}
