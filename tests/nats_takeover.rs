//! Partition takeover with the default lease settings (issue 22), against
//! real nats-server processes:
//!
//! - a `contextfold serve` killed with SIGKILL: every partition it held is
//!   folding again under the other process within 5 s (the worst
//!   bound; the median is the takeover bench's to show);
//! - a 3-node cluster with every stream and bucket at 3 replicas and two
//!   serve processes: SIGKILL of the node that leads the lease bucket costs
//!   folding no more than the cluster's own re-election (until both the
//!   events stream and the lease bucket take writes again) plus 1 s (and
//!   a second of slack), and no partition changes hands: both processes
//!   keep theirs, paused while their leases lapse and resumed after. A
//!   partition whose consumer lost its leader too waits for that
//!   consumer's election and the folder's pull to reach the new leader
//!   (within two of the pull's idle heartbeats). A partition whose folder
//!   failed on the way (a delivery lost at the kill, a request timed out)
//!   is allowed its retry's longest delay and one more consumer election:
//!   the product's cost today, which these tests report (`last folder
//!   errors`). The same run is also compared with a clean replay: nothing
//!   lost, nothing doubled.
//!
//! Folding is observed from outside: a turn published to every partition
//! every 50 ms, and the `batch folded` lines of the serve logs (the kill
//! test) or the engines' positions (the cluster test).
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;
use support::nats_server::{start_cluster, wait_for_jetstream, NatsServer};
use support::serve::*;

use async_nats::jetstream;
use contextfold::core::event::Envelope;
use contextfold::nats::config::StorageKind;
use contextfold::nats::event_log::NatsEventLog;
use contextfold::nats::folder::FolderSettings;
use contextfold::nats::leases::owner_of;
use contextfold::nats::serve::{Roles, ServeOptions, Service};
use contextfold::nats::{NatsConfig, NatsOptions};
use contextfold::runtime::embedded;
use contextfold::runtime::engine::Engine;
use contextfold::store::memory_backend::MemoryBackend;
use contextfold::summarizer::DeterministicSummarizer;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PARTITIONS: u32 = 16;

/// One conversation key per partition.
fn one_conversation_per_partition(stem: &str) -> Vec<String> {
    let mut by_partition: BTreeMap<u32, String> = BTreeMap::new();
    let mut i = 0;
    while by_partition.len() < PARTITIONS as usize {
        let key = format!("{stem}-{i}");
        by_partition.entry(partition_of(&key)).or_insert(key);
        i += 1;
    }
    by_partition.into_values().collect()
}

/// A turn as an agent would publish it (JSON).
fn turn(conv: &str, i: u64) -> Envelope {
    support::turns::turns(conv, i as usize..i as usize + 1, 8)
        .pop()
        .unwrap()
}

/// What the trickle publisher got stored: per partition, (stream
/// sequence, when the ack came, when the publish was first sent).
type Acks = Arc<Mutex<BTreeMap<u32, Vec<(u64, Instant, Instant)>>>>;

/// Publishes a turn to every conversation every `every`, each until the
/// stream acknowledges it (the same id again after a failure, so nothing
/// is stored twice), recording the acknowledgements.
fn trickle(
    js: jetstream::Context,
    convs: Vec<String>,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> (Acks, tokio::task::JoinHandle<u64>) {
    let acks: Acks = Arc::default();
    let sink = acks.clone();
    let task = tokio::spawn(async move {
        let mut round = 0u64;
        while !stop.load(Ordering::Acquire) {
            let began = Instant::now();
            for conv in &convs {
                let event = turn(conv, round);
                let first_sent = Instant::now();
                loop {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Nats-Msg-Id", event.id.as_str());
                    headers.insert("Content-Type", "application/json");
                    let sent = js
                        .publish_with_headers(
                            format!("cf.in.{}", token(conv)),
                            headers,
                            event.to_json().into(),
                        )
                        .await;
                    let acked = match sent {
                        Ok(ack) => tokio::time::timeout(Duration::from_secs(1), ack).await,
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    if let Ok(Ok(ack)) = acked {
                        sink.lock()
                            .unwrap()
                            .entry(partition_of(conv))
                            .or_default()
                            .push((ack.sequence, Instant::now(), first_sent));
                        break;
                    }
                    if stop.load(Ordering::Acquire) {
                        return round;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            round += 1;
            if let Some(rest) = every.checked_sub(began.elapsed()) {
                tokio::time::sleep(rest).await;
            }
        }
        round
    });
    (acks, task)
}

/// A `contextfold serve` child whose stderr (JSON lines) goes to a file.
struct Child {
    child: tokio::process::Child,
    log: PathBuf,
}

async fn spawn(url: &str, dir: &Path, name: &str) -> Child {
    let log = dir.join(format!("{name}.log"));
    let stderr = std::fs::File::create(&log).unwrap();
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_contextfold"));
    command
        .arg("--data")
        .arg(dir.join(name))
        .args([
            "--log-format",
            "json",
            "serve",
            "--nats",
            url,
            "--name",
            name,
        ])
        .env_remove("CONTEXTFOLD_CONFIG")
        .env_remove("CONTEXTFOLD_SUMMARIZER__BASE_URL")
        .env(
            "CONTEXTFOLD_LOG",
            "contextfold=info,contextfold::telemetry=debug",
        )
        .env("OPENAI_API_KEY", "test-key-not-secret")
        .stderr(stderr)
        .kill_on_drop(true);
    Child {
        child: command.spawn().expect("contextfold serve starts"),
        log,
    }
}

/// Reads a growing log file and stamps each `batch folded` line (its
/// partition) as it arrives.
struct Folds {
    file: std::fs::File,
    offset: u64,
    partial: String,
    seen: Vec<(Instant, u32)>,
}

impl Folds {
    fn open(path: &Path) -> Folds {
        Folds {
            file: std::fs::File::open(path).unwrap(),
            offset: 0,
            partial: String::new(),
            seen: Vec::new(),
        }
    }

    fn poll(&mut self) {
        let now = Instant::now();
        self.file.seek(SeekFrom::Start(self.offset)).unwrap();
        let mut reader = BufReader::new(&self.file);
        let mut line = String::new();
        loop {
            line.clear();
            let n = reader.read_line(&mut line).unwrap();
            if n == 0 {
                break;
            }
            self.offset += n as u64;
            if !line.ends_with('\n') {
                self.partial.push_str(&line);
                continue;
            }
            let whole = std::mem::take(&mut self.partial) + &line;
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&whole) else {
                continue;
            };
            let fields = &v["fields"];
            if fields["message"] == "batch folded" {
                if let Some(p) = fields["partition"].as_u64() {
                    self.seen.push((now, p as u32));
                }
            }
        }
    }

    /// When `partition` was first folded at or after `since`.
    fn first_after(&self, partition: u32, since: Instant) -> Option<Instant> {
        self.seen
            .iter()
            .find(|(t, p)| *p == partition && *t >= since)
            .map(|(t, _)| *t)
    }
}

/// Who holds each partition, by the member-id stem (the `--name`).
async fn owners(kv: &async_nats::jetstream::kv::Store) -> BTreeMap<u32, String> {
    let mut out = BTreeMap::new();
    for p in 0..PARTITIONS {
        if let Ok(Some(owner)) = owner_of(kv, p).await {
            out.insert(p, owner);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owner_s_partitions_fold_again_within_seconds() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let mut a = spawn(&server.url(), dir.path(), "tk-a").await;
    let mut b = spawn(&server.url(), dir.path(), "tk-b").await;
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    // serve creates the bucket and streams.
    let kv = loop {
        if let Ok(kv) = js.get_key_value("cf_leases").await {
            break kv;
        }
        assert!(a.child.try_wait().unwrap().is_none(), "serve a exited");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let held_by = |owners: &BTreeMap<u32, String>, stem: &str| -> BTreeSet<u32> {
        owners
            .iter()
            .filter(|(_, o)| o.starts_with(&format!("{stem}-")))
            .map(|(p, _)| *p)
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = owners(&kv).await;
        let (ha, hb) = (held_by(&now, "tk-a"), held_by(&now, "tk-b"));
        if ha.len() + hb.len() == PARTITIONS as usize && ha.len() == hb.len() {
            break;
        }
        assert!(Instant::now() < deadline, "no 8/8 split: {now:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let stop = Arc::new(AtomicBool::new(false));
    let convs = one_conversation_per_partition("tk");
    let (_acks, publisher) = trickle(js.clone(), convs, Duration::from_millis(50), stop.clone());
    let mut folds_a = Folds::open(&a.log);
    let mut folds_b = Folds::open(&b.log);
    // Folding everywhere before the kill.
    let warm = Instant::now();
    let deadline = warm + Duration::from_secs(30);
    loop {
        folds_a.poll();
        folds_b.poll();
        let all = (0..PARTITIONS).all(|p| {
            folds_a.first_after(p, warm).is_some() || folds_b.first_after(p, warm).is_some()
        });
        if all {
            break;
        }
        assert!(Instant::now() < deadline, "not every partition folds");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let victim = held_by(&owners(&kv).await, "tk-b");
    b.child.start_kill().unwrap();
    let killed = Instant::now();
    b.child.wait().await.unwrap();
    let mut again: BTreeMap<u32, Duration> = BTreeMap::new();
    let deadline = killed + Duration::from_secs(40);
    while again.len() < victim.len() && Instant::now() < deadline {
        folds_a.poll();
        for p in &victim {
            if let Some(t) = folds_a.first_after(*p, killed) {
                again.entry(*p).or_insert(t - killed);
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::Release);
    let _ = publisher.await;
    let _ = a.child.start_kill();
    eprintln!("kill -9 -> folding again under the other process: {again:?}");
    assert_eq!(
        again.len(),
        victim.len(),
        "partitions of the killed process not folded again within 40 s: {:?}",
        victim
            .iter()
            .filter(|p| !again.contains_key(p))
            .collect::<Vec<_>>()
    );
    let worst = again.values().max().copied().unwrap_or_default();
    assert!(
        worst < Duration::from_secs(5),
        "a partition of the killed process folded again only after {worst:?}: {again:?}"
    );
}

/// A policy under which the trickle never makes a job (no compaction, no
/// rolling state): the batches' effects go to the events stream only, so
/// what is measured is folding, not also the jobs stream's own election
/// and the folder's retry backoff for it.
fn quiet_policy() -> contextfold::core::policy::PolicyConfig {
    contextfold::core::policy::PolicyConfig {
        rolling_every_turns: 1_000_000,
        ..Default::default()
    }
}

fn cluster_options(urls: &[String], data: &Path, name: &str) -> ServeOptions {
    let nats = NatsConfig {
        connection: NatsOptions::with_servers(urls.iter().cloned()),
        replicas: 3,
        storage: StorageKind::File,
        job_ack_wait_ms: 1_000,
        ..NatsConfig::default()
    };
    let mut o = ServeOptions::new(nats, data);
    o.policy = quiet_policy();
    o.member_name = Some(name.to_string());
    o.roles = "folder,summarizer".parse::<Roles>().unwrap();
    o.summarizer.poll = Duration::from_millis(200);
    o
}

/// Starts serve on a cluster whose JetStream may still be settling.
async fn start_on_cluster(urls: &[String], data: &Path, name: &str) -> Service {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match Service::start(
            cluster_options(urls, data, name),
            Arc::new(DeterministicSummarizer),
        )
        .await
        {
            Ok(s) => return s,
            Err(e) => {
                assert!(Instant::now() < deadline, "serve does not start: {e}");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    }
}

/// Position and state hash of a clean replay of partition `p` from the
/// events stream, or `None` if the stream could not be read just now.
async fn clean_replay(
    js: &jetstream::Context,
    infra: &contextfold::nats::setup::Infrastructure,
    p: u32,
    policy: &contextfold::core::policy::PolicyConfig,
) -> Option<(u64, String)> {
    let mut log = NatsEventLog::open_partition(js.clone(), infra.subjects.clone(), p)
        .await
        .ok()?;
    let mut engine = Engine::open(MemoryBackend::default(), policy.clone()).unwrap();
    embedded::replay(&mut log, &mut engine, None).await.ok()?;
    Some((engine.position(), engine.state_hash().unwrap()))
}

/// Per partition, the last failure its folder noted (retried or not), so
/// a slow partition's report says what it waited on.
fn last_errors(services: &[&Service]) -> BTreeMap<u32, String> {
    let mut out = BTreeMap::new();
    for s in services {
        let Some(engines) = s.engines() else { continue };
        for p in engines.partitions() {
            if let Some(error) = engines.health(p).and_then(|h| h.last_error) {
                out.insert(p, error);
            }
        }
    }
    out
}

/// Per partition, the highest position any of `services` has folded.
fn positions(services: &[&Service]) -> BTreeMap<u32, u64> {
    let mut out = BTreeMap::new();
    for s in services {
        let Some(engines) = s.engines() else { continue };
        for p in engines.partitions() {
            if let Some(e) = engines.get(p) {
                let pos = e.lock().unwrap().position();
                let slot = out.entry(p).or_insert(0);
                *slot = (*slot).max(pos);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nats_node_failure_costs_folding_no_more_than_the_re_election_plus_a_second() {
    kill_the_lease_bucket_leader(false).await;
}

/// The same, then every partition compared with a clean replay: a
/// delivery lost with the killed node (seen: consumer sequence 21 -> 23
/// right at the kill) must not be acknowledged past by the next batch's
/// ack-all; the folder notices the gap in the delivery numbers and refolds
/// from its store (`FolderError::DeliveryGap`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nats_node_failure_loses_no_turn() {
    kill_the_lease_bucket_leader(true).await;
}

/// Two serve processes on a 3-node cluster, a turn to every partition every
/// 50 ms, then SIGKILL of the lease bucket's leader node (see the module
/// doc); `check_replay` also compares every partition with a clean replay.
async fn kill_the_lease_bucket_leader(check_replay: bool) {
    let mut cluster = start_cluster(3);
    wait_for_jetstream(&cluster.nodes[0].url()).await;
    let urls = cluster.urls();
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start_on_cluster(&urls, dir_a.path(), "nf-a").await;
    let b = start_on_cluster(&urls, dir_b.path(), "nf-b").await;
    wait_until("an 8/8 split", Duration::from_secs(30), || {
        held(&a).len() == 8 && held(&b).len() == 8
    })
    .await;
    let cfg = cluster_options(&urls, dir_a.path(), "client").nats;
    let (client, js, infra) = client_for_config(&cfg).await;
    let _ = client;
    let mut kv_stream = infra.leases.stream.clone();

    let stop = Arc::new(AtomicBool::new(false));
    let convs = one_conversation_per_partition("nf");
    let (acks, publisher) = trickle(js.clone(), convs, Duration::from_millis(50), stop.clone());
    // A probe of the lease bucket: when does it take writes again?
    let probes: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let probe = {
        let (kv, probes, stop) = (infra.leases.clone(), probes.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Acquire) {
                let put = kv.put("probe.writes", "x".into());
                if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(500), put).await {
                    probes.lock().unwrap().push(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    // And of every partition's consumer (its own raft group, with its own
    // election when its leader dies): when does it answer again?
    let consumers: Arc<Mutex<BTreeMap<u32, Vec<Instant>>>> = Arc::default();
    let consumer_probe = {
        let (events, consumers, stop) = (infra.events.clone(), consumers.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Acquire) {
                let asked = (0..PARTITIONS).map(|p| {
                    let events = events.clone();
                    async move {
                        let info = events.consumer_info(format!("cf_fold_{p}"));
                        let answered = tokio::time::timeout(Duration::from_millis(300), info).await;
                        (p, matches!(answered, Ok(Ok(_))).then(Instant::now))
                    }
                });
                for (p, at) in futures::future::join_all(asked).await {
                    if let Some(at) = at {
                        consumers.lock().unwrap().entry(p).or_default().push(at);
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    wait_until("every partition folding", Duration::from_secs(30), || {
        positions(&[&a, &b]).values().filter(|p| **p > 0).count() == PARTITIONS as usize
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let info = kv_stream.info().await.unwrap();
    let leader = info
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone())
        .unwrap();
    let mut events = infra.events.clone();
    let events_leader = events
        .info()
        .await
        .unwrap()
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone());
    let before = (held(&a), held(&b));
    let victim = cluster.index_of(&leader).unwrap();
    cluster.kill_node(victim);
    let killed = Instant::now();

    // When each partition's folded position moved, until the cluster
    // answers again (events stream, lease bucket, every consumer) and every
    // partition has folded for 3 s since.
    let answered_again = |samples: &[Instant]| samples.iter().find(|t| **t > killed).copied();
    let re_elected = || -> Option<Instant> {
        let events = acks
            .lock()
            .unwrap()
            .values()
            .flatten()
            .filter(|(_, acked, sent)| *acked > killed && *sent > killed)
            .map(|(_, acked, _)| *acked)
            .min()?;
        let bucket = answered_again(&probes.lock().unwrap())?;
        let consumers = consumers.lock().unwrap();
        let mut all = events.max(bucket);
        for p in 0..PARTITIONS {
            all = all.max(answered_again(consumers.get(&p)?)?);
        }
        Some(all)
    };
    // Per partition: since when a stored turn has waited to be folded (from
    // the kill at the earliest), and the end of its longest wait.
    let mut waiting: BTreeMap<u32, Instant> = BTreeMap::new();
    let mut back: BTreeMap<u32, Duration> = BTreeMap::new();
    let mut longest: BTreeMap<u32, Duration> = BTreeMap::new();
    let mut gaps: BTreeMap<&str, (Option<Instant>, Duration)> = BTreeMap::new();
    let deadline = killed + Duration::from_secs(60);
    loop {
        let now = Instant::now();
        let folded = positions(&[&a, &b]);
        let oldest_unfolded: BTreeMap<u32, Instant> = acks
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(p, v)| {
                let at = folded.get(p).copied().unwrap_or(0);
                v.iter()
                    .filter(|(seq, _, _)| *seq > at)
                    .map(|(_, acked, _)| (*acked).max(killed))
                    .min()
                    .map(|t| (*p, t))
            })
            .collect();
        for p in 0..PARTITIONS {
            match (waiting.get(&p).copied(), oldest_unfolded.get(&p)) {
                (None, Some(since)) => {
                    waiting.insert(p, *since);
                }
                (Some(since), None) => {
                    // Folded all it had: the wait ended now.
                    waiting.remove(&p);
                    let waited = now - since;
                    if waited > longest.get(&p).copied().unwrap_or_default() {
                        longest.insert(p, waited);
                        back.insert(p, now - killed);
                    }
                }
                _ => {}
            }
        }
        // How long each process held fewer partitions than before.
        for (name, s, had) in [("a", &a, &before.0), ("b", &b, &before.1)] {
            let short = held(s).len() < had.len();
            let gap = gaps.entry(name).or_insert((None, Duration::ZERO));
            match (short, gap.0) {
                (true, None) => gap.0 = Some(now),
                (false, Some(since)) => {
                    gap.1 = gap.1.max(now - since);
                    gap.0 = None;
                }
                _ => {}
            }
        }
        let settled = re_elected().is_some_and(|t| {
            now > t + Duration::from_secs(3)
                && (0..PARTITIONS).all(|p| back.contains_key(&p) && !waiting.contains_key(&p))
        });
        if settled || now > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first_ack = acks
        .lock()
        .unwrap()
        .values()
        .flatten()
        .filter(|(_, acked, sent)| *acked > killed && *sent > killed)
        .map(|(_, acked, _)| *acked - killed)
        .min();
    let first_probe = probes
        .lock()
        .unwrap()
        .iter()
        .find(|t| **t > killed)
        .map(|t| *t - killed);
    let consumer_back: BTreeMap<u32, Duration> = consumers
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(p, v)| v.iter().find(|t| **t > killed).map(|t| (*p, *t - killed)))
        .collect();
    let after = (held(&a), held(&b));
    eprintln!("consumers answering again after: {consumer_back:?}");
    eprintln!("last folder errors: {:?}", last_errors(&[&a, &b]));
    eprintln!(
        "killed {leader} (events stream leader: {events_leader:?}); events stream back after \
         {first_ack:?}, lease bucket back after {first_probe:?}; longest wait of a stored turn to \
         be folded, per partition: {longest:?}, ending after {back:?}; longest time a process \
         held fewer partitions: {gaps:?}; held before {before:?} after {after:?}"
    );
    assert_eq!(
        back.len(),
        PARTITIONS as usize,
        "partitions not folding 60 s after the node died: {:?}",
        (0..PARTITIONS)
            .filter(|p| !back.contains_key(p))
            .collect::<Vec<_>>()
    );
    assert!(re_elected().is_some(), "the cluster did not answer again");
    // The cluster's own re-election, as folding needs it: the events
    // stream and the lease bucket answer again; and a partition whose
    // consumer lost its leader waits for that consumer's own election.
    let re_election = first_ack.unwrap().max(first_probe.unwrap());
    // A partition whose folder failed on the way (a delivery lost at the
    // kill, `FolderError::DeliveryGap`; a request that timed out; a
    // consumer the cluster would not make yet) retries after its backoff,
    // up to `MAX_RETRY_BACKOFF`, and refolds on a consumer made anew,
    // whose own election on a cluster short of a node takes as long as the
    // longest this run saw. Seen: 3 to 8 s beyond the bounds below, in CI
    // once and in loaded runs. That is the product's cost today, not
    // slack. What would spare it: a delivery gap filled from the stream
    // (direct get) instead of a new consumer, retries woken when the
    // cluster answers again rather than only by the timer, and a consumer
    // re-created even when its delete was lost.
    let errors = last_errors(&[&a, &b]);
    let longest_consumer_election = consumer_back.values().max().copied().unwrap_or_default();
    let after_failures = |p: &u32| {
        if errors.contains_key(p) {
            contextfold::nats::retry::MAX_RETRY_BACKOFF + longest_consumer_election
        } else {
            Duration::ZERO
        }
    };
    let mut beyond = Vec::new();
    for (p, at) in &back {
        let consumer = consumer_back.get(p).copied().unwrap_or_default();
        // A consumer that answered within a second kept its leader.
        if consumer <= Duration::from_secs(1) {
            // The bound is re-election + 1 s; a second of slack for
            // a machine shared with other tests.
            assert!(
                *at <= re_election + after_failures(p) + Duration::from_secs(2),
                "partition {p} folded again {at:?} after the kill, the cluster re-elected in \
                 {re_election:?} (allowed for its failures: {:?})",
                after_failures(p)
            );
        } else {
            // Its consumer lost its leader too, and with it the folder's
            // pull request: once both elections are over, the folder's
            // next pull reaches the new leader within two of the pull's
            // idle heartbeats (a pull sent during the election is lost the
            // same way), plus the slack above.
            let repull = FolderSettings::default().pull_heartbeat * 2;
            assert!(
                *at <= consumer.max(re_election)
                    + repull
                    + after_failures(p)
                    + Duration::from_secs(2),
                "partition {p} folded again {at:?} after the kill, its consumer answered again \
                 after {consumer:?} (allowed for its failures: {:?})",
                after_failures(p)
            );
        }
        if consumer <= Duration::from_secs(1) && after_failures(p).is_zero() {
            beyond.push(at.saturating_sub(re_election));
        }
    }
    beyond.sort();
    if let (Some(median), Some(worst)) = (beyond.get(beyond.len() / 2), beyond.last()) {
        eprintln!(
            "partitions whose consumer kept its leader ({}): folding back after the re-election: \
             median {median:?}, worst {worst:?}",
            beyond.len()
        );
    }
    for (name, (open, gap)) in &gaps {
        assert!(open.is_none(), "{name} still holds fewer partitions");
        assert!(
            *gap <= first_probe.unwrap() + Duration::from_secs(1),
            "{name} held fewer partitions for {gap:?} (the bucket re-elected in {:?})",
            first_probe.unwrap()
        );
    }
    // Nobody took a partition from a process that never died.
    assert_eq!(before, after, "partitions changed hands");

    // Nothing lost, nothing doubled: each process ends with the state a
    // clean replay of its partitions gives.
    stop.store(true, Ordering::Release);
    let published = publisher.await.unwrap();
    let _ = probe.await;
    let _ = consumer_probe.await;
    let policy = quiet_policy();
    for s in [&a, &b] {
        if !check_replay {
            break;
        }
        let engines = s.engines().unwrap();
        for p in held(s) {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                // A read right after a node died may find no responder:
                // asked again.
                let replayed = clean_replay(&js, &infra, p, &policy).await;
                let live = engines.get(p).map(|e| {
                    let e = e.lock().unwrap();
                    (e.position(), e.state_hash().unwrap())
                });
                if replayed.is_some() && live == replayed {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "partition {p}: live {live:?} vs replay {replayed:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    assert!(published > 0);
    a.shutdown().await;
    b.shutdown().await;
}

/// `contextfold publish` as a user runs it, with stderr captured.
fn publish_command(
    urls: &str,
    file: &Path,
    data: &Path,
    extra: &[&str],
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_contextfold"));
    command
        .arg("--data")
        .arg(data)
        .args(["publish", "--nats", urls])
        .args(extra)
        .arg(file)
        .env_remove("CONTEXTFOLD_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    command
}

fn write_events(path: &Path, convs: usize, turns_each: usize) -> usize {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut n = 0;
    for i in 0..turns_each {
        for c in 0..convs {
            let event = turn(&format!("pub-{c}"), i as u64);
            writeln!(out, "{}", event.to_json()).unwrap();
            n += 1;
        }
    }
    out.flush().unwrap();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_waits_through_a_leader_election_and_stores_every_event_once() {
    let mut cluster = start_cluster(3);
    wait_for_jetstream(&cluster.nodes[0].url()).await;
    let urls = cluster.urls();
    let dir = tempfile::tempdir().unwrap();
    // The streams as serve would create them (no serve runs: the stream
    // holds exactly what publish stored).
    let cfg = cluster_options(&urls, dir.path(), "setup").nats;
    let (_client, _js, infra) = loop {
        let (client, _) = cfg.connection.connect().await.expect("connect");
        let js = jetstream::new(client.clone());
        match contextfold::nats::setup::ensure(&js, &cfg).await {
            Ok(infra) => break (client, js, infra),
            Err(e) => {
                eprintln!("setup not ready yet: {e}");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    };
    let file = dir.path().join("events.jsonl");
    let total = write_events(&file, 50, 400);
    let mut events = infra.events.clone();
    let leader = events
        .info()
        .await
        .unwrap()
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone())
        .unwrap();

    let log = dir.path().join("publish.log");
    let mut child = publish_command(&urls.join(","), &file, dir.path(), &[])
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("contextfold publish starts");
    // Once it has stored some, the events stream loses its leader.
    let deadline = Instant::now() + Duration::from_secs(30);
    while events.info().await.map(|i| i.state.messages).unwrap_or(0) < 2_000 {
        assert!(Instant::now() < deadline, "publish stored nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.kill_node(cluster.index_of(&leader).unwrap());
    let status = tokio::time::timeout(Duration::from_secs(120), child.wait()).await;
    let stderr = std::fs::read_to_string(&log).unwrap();
    eprintln!("{stderr}");
    let status = status.expect("publish ends within 2 minutes").unwrap();
    assert!(status.success(), "publish failed: {stderr}");
    assert!(
        stderr.contains("waiting for the events stream's leader"),
        "publish did not say what it waited for: {stderr}"
    );
    // Every event stored, none twice (the stream would hold more).
    let deadline = Instant::now() + Duration::from_secs(30);
    let stored = loop {
        match events.info().await {
            Ok(info) => break info.state.messages,
            Err(e) => {
                assert!(Instant::now() < deadline, "stream info: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(stored, total as u64, "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_gives_up_after_its_retries_and_says_what_to_check() {
    // A server where no serve ever created the events stream.
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("events.jsonl");
    write_events(&file, 2, 2);
    let started = Instant::now();
    let out = publish_command(&server.url(), &file, dir.path(), &["--retry-for", "2"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30), "{stderr}");
    assert!(
        stderr.contains("waiting for the events stream's leader"),
        "{stderr}"
    );
    for what in [
        "did not store 4 event(s)",
        "`nats stream info CF_EVENTS`",
        "`contextfold serve` ran once",
        "stores nothing twice",
    ] {
        assert!(stderr.contains(what), "missing {what:?} in: {stderr}");
    }
}
