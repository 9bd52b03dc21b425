//! The policy is an event of the log: a process folding under a policy
//! the log does not say records it first, and replays fold each recorded
//! policy from where it was recorded, so the log alone reproduces every
//! state, whatever the configuration that replays it. Also: read-only
//! commands never write the store, and `replay --policy` (what-if).

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::{Encoding, EventBody, Origin};
use contextfold::core::policy::PolicyConfig;
use contextfold::log::memory::MemoryLog;
use contextfold::log::segment::SegmentLog;
use contextfold::log::EventLog;
use contextfold::runtime::embedded::{self, Pipeline};
use contextfold::runtime::engine::{policy_fingerprint, Effects, Engine};
use contextfold::store::memory_backend::MemoryBackend;
use contextfold::summarizer::{
    Budget, DeterministicSummarizer, RollingOutcome, SummarizeError, Summarizer, SummaryOutcome,
};
use proptest::prelude::*;
use std::path::{Path, PathBuf};

mod support;
use contextfold::testing::small_policy;
use support::cli;
use support::turns::turns;

/// Three policies that fold the same turns differently.
fn policies() -> Vec<PolicyConfig> {
    vec![
        small_policy(),
        PolicyConfig {
            default_context_window: 9000,
            fresh_tail_count: 4,
            ..small_policy()
        },
        PolicyConfig {
            leaf_chunk_tokens: 800,
            context_threshold: 0.6,
            ..small_policy()
        },
    ]
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The state hash and policy in force of a clean replay of `log` up to
/// `upto` under `configured` (which matters only before the log's first
/// recorded policy).
async fn clean_replay(
    log: &mut MemoryLog,
    configured: &PolicyConfig,
    upto: u64,
) -> (String, String) {
    let mut engine = Engine::open(MemoryBackend::default(), configured.clone()).unwrap();
    let records = log.read_after(0, usize::MAX).await.unwrap();
    let mut effects = Effects::default();
    for r in records.iter().filter(|r| r.position <= upto) {
        engine.apply_record(r, &mut effects).unwrap();
        effects = Effects::default();
    }
    (
        engine.state_hash().unwrap(),
        engine.active_policy().fingerprint.clone(),
    )
}

/// The policy events of a log, in order: their fingerprints.
async fn recorded_policies(log: &mut MemoryLog) -> Vec<String> {
    let mut out = Vec::new();
    for r in log.read_after(0, usize::MAX).await.unwrap() {
        let e = contextfold::core::event::Envelope::decode(&r.bytes, r.encoding).unwrap();
        if let EventBody::PolicyRecorded(p) = e.body {
            assert_eq!(r.origin, Origin::Service);
            assert!(contextfold::core::event::is_partition_key(&e.conversation));
            out.push(p.fingerprint);
        }
    }
    out
}

type Local = Pipeline<MemoryLog, MemoryBackend, DeterministicSummarizer>;

/// A process: opens the store left by the previous one with `policy`.
async fn open(log: MemoryLog, store: MemoryBackend, policy: &PolicyConfig) -> Local {
    let mut engine = Engine::open(store, policy.clone()).unwrap();
    engine.record_policy_as(
        contextfold::core::event::EMBEDDED_PARTITION_KEY.into(),
        "test",
    );
    Pipeline::open(log, engine, DeterministicSummarizer)
        .await
        .unwrap()
}

/// Stops a process: its log and its store as it left them.
fn close(mut p: Local) -> (MemoryLog, MemoryBackend) {
    p.engine.flush().unwrap();
    let store = p.engine.store().backend().clone();
    (p.log, store)
}

#[test]
fn a_process_records_its_policy_once_and_replays_fold_under_it() {
    rt().block_on(async {
        let [a, b, _]: [PolicyConfig; 3] = policies().try_into().unwrap();
        let mut p = open(MemoryLog::new(), MemoryBackend::default(), &a).await;
        p.ingest(&turns("c", 0..30, 60)).await.unwrap();
        let (log, store) = close(p);
        // The same policy again: nothing recorded.
        let mut p = open(log, store, &a).await;
        p.ingest(&turns("c", 30..40, 60)).await.unwrap();
        let (mut log, store) = close(p);
        assert_eq!(recorded_policies(&mut log).await, [policy_fingerprint(&a)]);
        // Another one: recorded once, before anything folded under it.
        let mut p = open(log, store, &b).await;
        let at = p.engine.position();
        p.ingest(&turns("c", 40..80, 60)).await.unwrap();
        let turns_now = p.engine.state.conversations["c"].turns.len();
        let live = p.engine.state_hash().unwrap();
        let (mut log, store) = close(p);
        assert_eq!(
            recorded_policies(&mut log).await,
            [policy_fingerprint(&a), policy_fingerprint(&b)]
        );
        let switched = log.read_after(at - 1, 1).await.unwrap();
        let first =
            contextfold::core::event::Envelope::decode(&switched[0].bytes, switched[0].encoding)
                .unwrap();
        assert!(
            matches!(first.body, EventBody::PolicyRecorded(_)),
            "{first:?}"
        );
        assert_eq!(turns_now, 80);
        // Replayed under a configuration that is neither: the same state.
        let end = log.last_position().await.unwrap();
        let (hash, active) = clean_replay(&mut log, &PolicyConfig::default(), end).await;
        assert_eq!(hash, live);
        assert_eq!(active, policy_fingerprint(&b));
        // And a store reopened with yet another policy folds under b until
        // it records its own.
        let reopened = Engine::open(store, PolicyConfig::default()).unwrap();
        assert_eq!(reopened.active_policy().fingerprint, policy_fingerprint(&b));
        assert_eq!(reopened.state_hash().unwrap(), live);
    });
}

#[derive(Debug, Clone)]
enum Op {
    /// A process starts with policy i (the previous one stops).
    Open(usize),
    /// n turns folded into conversation c or d.
    Fold(usize, bool),
    /// `rebuild`: the log folded into a fresh store, which replaces it.
    Rebuild(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0usize..3).prop_map(Op::Open),
        4 => (1usize..25, any::<bool>()).prop_map(|(n, d)| Op::Fold(n, d)),
        1 => (0usize..3).prop_map(Op::Rebuild),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Whatever sequence of opens, folds, rebuilds and policy switches a
    /// store sees, it equals a clean replay of the log, and never counts
    /// a turn twice.
    #[test]
    fn the_store_always_equals_a_clean_replay_of_the_log(ops in prop::collection::vec(op(), 1..12)) {
        let all = policies();
        rt().block_on(async {
            let mut p = open(MemoryLog::new(), MemoryBackend::default(), &all[0]).await;
            let mut sent = [0usize; 2];
            for op in ops {
                match op {
                    Op::Open(i) => {
                        let (log, store) = close(p);
                        p = open(log, store, &all[i]).await;
                    }
                    Op::Fold(n, d) => {
                        let (conv, k) = if d { ("d", 1) } else { ("c", 0) };
                        p.ingest(&turns(conv, sent[k]..sent[k] + n, 50)).await.unwrap();
                        sent[k] += n;
                    }
                    Op::Rebuild(i) => {
                        let (mut log, _) = close(p);
                        let mut fresh = Engine::open(MemoryBackend::default(), all[i].clone()).unwrap();
                        embedded::replay(&mut log, &mut fresh, None).await.unwrap();
                        fresh.flush().unwrap();
                        let store = fresh.store().backend().clone();
                        p = open(log, store, &all[i]).await;
                    }
                }
                // The store as a new process reads it, against the log.
                let (mut log, store) = close(p);
                let stored = Engine::open(store.clone(), PolicyConfig::default()).unwrap();
                let end = log.last_position().await.unwrap();
                let (hash, active) = clean_replay(&mut log, &all[2], end).await;
                prop_assert_eq!(stored.state_hash().unwrap(), hash);
                prop_assert_eq!(&stored.active_policy().fingerprint, &active);
                for (conv, k) in [("c", 0), ("d", 1)] {
                    let turns = stored
                        .materialized_conversation(conv)
                        .unwrap()
                        .map_or(0, |c| c.turns.len());
                    prop_assert_eq!(turns, sent[k], "conversation {}", conv);
                }
                drop(stored);
                let last = p_policy(&log).await;
                p = open(log, store, &all[last]).await;
            }
            Ok(())
        })?;
    }

    /// A log folded in segments under several policies replays, under any
    /// configuration, to the hash the service had after each segment.
    #[test]
    fn a_log_with_several_policy_changes_replays_to_the_hashes_it_was_folded_to(
        segments in prop::collection::vec((0usize..3, 1usize..30), 1..6),
        replayed_under in 0usize..3,
    ) {
        let all = policies();
        rt().block_on(async {
            let mut log = MemoryLog::new();
            let mut store = MemoryBackend::default();
            let mut sent = 0;
            let mut seen = Vec::new();
            for (i, n) in segments {
                let mut p = open(log, store, &all[i]).await;
                p.ingest(&turns("c", sent..sent + n, 50)).await.unwrap();
                sent += n;
                seen.push((p.engine.position(), p.engine.state_hash().unwrap(), policy_fingerprint(&all[i])));
                (log, store) = close(p);
            }
            for (position, hash, fingerprint) in seen {
                let (replayed, active) = clean_replay(&mut log, &all[replayed_under], position).await;
                prop_assert_eq!(replayed, hash, "at {}", position);
                prop_assert_eq!(active, fingerprint);
            }
            Ok(())
        })?;
    }
}

/// The index of the policy the last process of the property test ran
/// with: the last one the log recorded.
async fn p_policy(log: &MemoryLog) -> usize {
    let mut log = log.clone();
    let last = recorded_policies(&mut log).await.pop();
    policies()
        .iter()
        .position(|p| Some(policy_fingerprint(p)) == last)
        .unwrap_or(0)
}

// ------------------------------------------------------------------ the CLI

fn shared(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/data/transcripts")
        .join(path)
}

const PI: &str = "pi-openclaw_badlogic-pi-mono/before-compaction.jsonl";

fn line_with<'a>(text: &'a str, prefix: &str) -> &'a str {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{text}"))
}

/// The scenario: a long pi session folded with a 32,000-token
/// window replays, rebuilds and reports status under the default
/// configuration to the same state.
#[test]
fn a_session_folded_under_one_configuration_replays_the_same_under_another() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let file = shared(PI);
    let mut run = cli::command(data, &["run", file.to_str().unwrap()]);
    run.env("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "32000");
    let (ok, _, err) = cli::split(run.output().unwrap());
    assert!(ok, "{err}");
    let mut replay = cli::command(data, &["replay"]);
    replay.env("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "32000");
    let (ok, under_32k, err) = cli::split(replay.output().unwrap());
    assert!(ok, "{err}");
    let (ok, under_default, err) = cli::run(data, &["replay"]);
    assert!(ok, "{err}");
    let state = line_with(&under_32k, "state ")
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string();
    eprintln!("replay scenario: state {state}");
    assert_eq!(
        line_with(&under_default, "state ")
            .split_whitespace()
            .nth(1),
        Some(state.as_str())
    );
    // Without its policy events (what every log was before them), the same
    // log replayed under the default configuration reaches another state:
    // the event is what makes the two agree.
    let without = rt().block_on(async {
        let mut log = SegmentLog::open(&data.join("log")).unwrap();
        let records = log.read_after(0, usize::MAX).await.unwrap();
        let mut engine = Engine::open(MemoryBackend::default(), PolicyConfig::default()).unwrap();
        let mut effects = Effects::default();
        for r in &records {
            let e = contextfold::core::event::Envelope::decode(&r.bytes, r.encoding).unwrap();
            if !matches!(e.body, EventBody::PolicyRecorded(_)) {
                engine.apply_record(r, &mut effects).unwrap();
            }
            effects = Effects::default();
        }
        engine.state_hash().unwrap()
    });
    eprintln!("replay scenario: without the policy in the log, state {without}");
    assert_ne!(without, state);
    // Same conversations, same hashes, same summaries.
    let convs = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| !l.starts_with("state "))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(convs(&under_32k), convs(&under_default));
    let conv_line = convs(&under_default).into_iter().next().unwrap();
    assert!(!conv_line.contains(" 0 summaries"), "{conv_line}");
    let key = conv_line.split_whitespace().nth(1).unwrap().to_string();
    // Status under the default configuration: what the service had.
    // (`run` summarizes with the deterministic summarizer, whose fallback
    // summaries await a model either way: the health must be the same as
    // under the policy it was folded with, with nothing stale or pending.)
    let (ok, out, err) = cli::run(data, &["status", &key]);
    assert!(ok, "{err}");
    assert!(!err.contains("behind"), "{err}");
    let mut status_32k = cli::command(data, &["status", &key]);
    status_32k.env("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "32000");
    let (ok, out_32k, err) = cli::split(status_32k.output().unwrap());
    assert!(ok, "{err}");
    let status = cli::json_of(&out);
    assert_eq!(status, cli::json_of(&out_32k));
    assert_eq!(status["tokens"]["budget"], 32000, "{out}");
    assert!(status["pending_job"].is_null(), "{out}");
    let reasons = status["health"]["reasons"].to_string();
    assert!(!reasons.contains("stale"), "{out}");
    assert!(!reasons.contains("pending"), "{out}");
    // rebuild under the default configuration agrees.
    let (ok, out, err) = cli::run(data, &["rebuild"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("hashes agree"), "{out}");
    assert!(out.contains(&state), "{out}");
}

fn sha(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

/// Read-only commands open the store read-only: behind the log, they say
/// so and answer from it; the file stays byte for byte as it was.
#[test]
fn read_only_commands_never_write_the_store_and_say_it_is_behind() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let file =
        shared("swe-agent_SWE-agent/marshmallow-code__marshmallow-1867.function_calling.traj");
    let mut run = cli::command(data, &["run", file.to_str().unwrap()]);
    run.env("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "8000");
    let (ok, _, err) = cli::split(run.output().unwrap());
    assert!(ok, "{err}");
    let (ok, out, err) = cli::run(data, &["replay"]);
    assert!(ok, "{err}");
    let key = out
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string();
    let (ok, before, err) = cli::run(data, &["status", &key]);
    assert!(ok, "{err}");
    assert!(!err.contains("behind"), "{err}");
    let turns_before = cli::json_of(&before)["turns"].clone();
    // Three turns reach the log that no process has folded yet.
    rt().block_on(async {
        let mut log = SegmentLog::open(&data.join("log")).unwrap();
        for e in turns(&key, 1000..1003, 20) {
            log.append(Origin::Agent, Encoding::Json, e.to_json().as_bytes())
                .await
                .unwrap();
        }
        log.sync().await.unwrap();
    });
    let store = data.join("state.redb");
    let bytes = sha(&store);
    let summary = {
        let (ok, out, err) = cli::run(data, &["history", &key]);
        assert!(ok, "{err}");
        assert!(err.contains("3 record(s) behind"), "{err}");
        assert!(err.contains("contextfold run"), "{err}");
        let h = cli::json_of(&out);
        let text = h.to_string();
        let at = text.find("sum_").expect("a summary id in the history");
        text[at..].split('"').next().unwrap().to_string()
    };
    for args in [
        vec!["status"],
        vec!["status", &key],
        vec!["assemble", &key],
        vec!["grep", &key, "marshmallow"],
        vec!["describe", &key, &summary],
        vec!["expand", &key, &summary],
    ] {
        let (ok, out, err) = cli::run(data, &args);
        assert!(ok, "{args:?}: {out}\n{err}");
        assert!(err.contains("3 record(s) behind"), "{args:?}: {err}");
        assert_eq!(sha(&store), bytes, "{args:?} wrote the store");
    }
    let (_, now, _) = cli::run(data, &["status", &key]);
    assert_eq!(
        cli::json_of(&now)["turns"],
        turns_before,
        "answered from the store"
    );
    // The command it names brings it up to date.
    let (ok, _, err) = cli::run(data, &["run", "/dev/null"]);
    assert!(ok, "{err}");
    let (ok, caught_up, err) = cli::run(data, &["status", &key]);
    assert!(ok && !err.contains("behind"), "{err}");
    assert_ne!(cli::json_of(&caught_up)["turns"], turns_before);
    // A store of an older layout is not read, nor touched: the log answers.
    {
        use contextfold::store::{KvBackend, Table, Write};
        let mut backend = contextfold::store::redb_backend::RedbBackend::open(&store).unwrap();
        backend
            .commit(
                &[Write::Put {
                    table: Table::Meta,
                    key: b"layout".to_vec(),
                    value: b"layout-9".to_vec(),
                }],
                true,
            )
            .unwrap();
    }
    let bytes = sha(&store);
    let (ok, old_layout, err) = cli::run(data, &["status", &key]);
    assert!(ok, "{err}");
    assert!(
        err.contains("layout-9") && err.contains("run /dev/null"),
        "{err}"
    );
    assert_eq!(cli::json_of(&old_layout), cli::json_of(&caught_up));
    assert_eq!(sha(&store), bytes, "status wrote a store of another layout");
}

// ------------------------------------------------------------------ what-if

/// Summaries of a log by (conversation, depth, first and last source
/// label, number of sources): the test's own lookup, written apart from
/// the command's.
struct LogSummaries {
    by_sources: std::collections::HashMap<
        (String, u32, String, String, usize),
        contextfold::core::summary::SummaryDraft,
    >,
    misses: std::sync::atomic::AtomicU64,
    hits: std::sync::atomic::AtomicU64,
}

struct Shared(std::sync::Arc<LogSummaries>);

impl Summarizer for Shared {
    async fn summarize(
        &self,
        req: &contextfold::core::summary::SummaryRequest,
        budget: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let k = (
            req.conversation.clone(),
            req.depth,
            req.sources
                .first()
                .map(|s| s.label.clone())
                .unwrap_or_default(),
            req.sources
                .last()
                .map(|s| s.label.clone())
                .unwrap_or_default(),
            req.sources.len(),
        );
        use std::sync::atomic::Ordering::Relaxed;
        match self.0.by_sources.get(&k) {
            Some(d) => {
                self.0.hits.fetch_add(1, Relaxed);
                Ok(SummaryOutcome::without_calls(d.clone()))
            }
            None => {
                self.0.misses.fetch_add(1, Relaxed);
                DeterministicSummarizer.summarize(req, budget).await
            }
        }
    }
    async fn rolling_state(
        &self,
        req: &contextfold::core::summary::RollingStateRequest,
        budget: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        DeterministicSummarizer.rolling_state(req, budget).await
    }
    fn name(&self) -> &str {
        "from-log"
    }
}

/// (compactions, peak, mean, overflows, summaries by depth) of a fold.
type Numbers = (u64, u64, u64, u64, std::collections::BTreeMap<u32, u64>);

fn numbers_of(v: &serde_json::Value) -> Numbers {
    let depths = v["summaries_by_depth"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(d, n)| (d.parse().unwrap(), n.as_u64().unwrap()))
        .collect();
    (
        v["compactions"].as_u64().unwrap(),
        v["peak_context_tokens"].as_u64().unwrap(),
        v["mean_context_tokens"].as_u64().unwrap(),
        v["budget_overflows"].as_u64().unwrap(),
        depths,
    )
}

#[derive(Default)]
struct Tally {
    jobs: u64,
    peak: u64,
    sum: u64,
    n: u64,
    over: u64,
}

impl Tally {
    fn after<B: contextfold::store::KvBackend>(&mut self, engine: &Engine<B>, key: &str) {
        let conv = engine.materialized_conversation(key).unwrap().unwrap();
        let budget = contextfold::core::policy::budget(&conv, &engine.policy);
        self.peak = self.peak.max(conv.context.tokens());
        self.sum += conv.context.tokens();
        self.n += 1;
        self.over += u64::from(conv.context.tokens() > budget);
    }
    fn numbers<B: contextfold::store::KvBackend>(&self, engine: &Engine<B>, key: &str) -> Numbers {
        let mut depths = std::collections::BTreeMap::new();
        for s in &engine
            .materialized_conversation(key)
            .unwrap()
            .unwrap()
            .summaries
        {
            *depths.entry(s.depth).or_insert(0) += 1;
        }
        (
            self.jobs,
            self.peak,
            self.sum / self.n.max(1),
            self.over,
            depths,
        )
    }
}

/// What happened and what `policy` would have done, folded here.
fn independent(data: &Path, policy: &PolicyConfig) -> (String, Numbers, Numbers, u64) {
    rt().block_on(async {
        let mut log = SegmentLog::open(&data.join("log")).unwrap();
        let records = log.read_after(0, usize::MAX).await.unwrap();
        let decode = |r: &contextfold::log::LogRecord| {
            contextfold::core::event::Envelope::decode(&r.bytes, r.encoding).unwrap()
        };
        let mut engine = Engine::open(MemoryBackend::default(), PolicyConfig::default()).unwrap();
        let mut actual = Tally::default();
        let mut key = String::new();
        let mut by_sources = std::collections::HashMap::new();
        let mut answered = false;
        for r in &records {
            // What happened is measured once the service answered an agent
            // event: before the next one, and at the end.
            if r.origin == Origin::Agent && std::mem::take(&mut answered) {
                actual.after(&engine, &key);
            }
            let mut effects = Effects::default();
            engine.apply_record(r, &mut effects).unwrap();
            let e = decode(r);
            match (&e.body, r.origin) {
                (EventBody::JobIssued(j), Origin::Service) if j.compact => actual.jobs += 1,
                (EventBody::SummaryRecorded(s), _) => {
                    let labels: Vec<String> = match &s.covers {
                        contextfold::core::event::Covers::Turns { first, last } => {
                            (*first..=*last).map(|t| format!("turn {t}")).collect()
                        }
                        contextfold::core::event::Covers::Summaries { ids } => {
                            ids.iter().map(|i| format!("summary {i}")).collect()
                        }
                    };
                    by_sources.insert(
                        (
                            e.conversation.clone(),
                            s.depth,
                            labels[0].clone(),
                            labels[labels.len() - 1].clone(),
                            labels.len(),
                        ),
                        contextfold::core::summary::SummaryDraft {
                            content: s.content.clone(),
                            model: s.model.clone(),
                            provider: s.provider.clone(),
                            prompt_version: s.prompt_version.clone(),
                            fallback: s.fallback,
                        },
                    );
                }
                (_, Origin::Agent) => {
                    key = e.conversation.clone();
                    answered = true;
                }
                _ => {}
            }
        }
        if answered {
            actual.after(&engine, &key);
        }
        let summaries = std::sync::Arc::new(LogSummaries {
            by_sources,
            misses: Default::default(),
            hits: Default::default(),
        });
        let mut sim = Pipeline::open(
            MemoryLog::new(),
            Engine::open(MemoryBackend::default(), policy.clone()).unwrap(),
            Shared(std::sync::Arc::clone(&summaries)),
        )
        .await
        .unwrap();
        let mut what_if = Tally::default();
        for r in records.iter().filter(|r| r.origin == Origin::Agent) {
            sim.ingest_raw(&[(r.encoding, r.bytes.to_vec())])
                .await
                .unwrap();
            what_if.after(&sim.engine, &key);
        }
        for r in sim.log.read_after(0, usize::MAX).await.unwrap() {
            if matches!(decode(&r).body, EventBody::JobIssued(j) if j.compact) {
                what_if.jobs += 1;
            }
        }
        (
            key.clone(),
            actual.numbers(&engine, &key),
            what_if.numbers(&sim.engine, &key),
            summaries.misses.load(std::sync::atomic::Ordering::Relaxed),
        )
    })
}

/// `replay --policy` on a long shared transcript under two policies: its
/// numbers are those of a fold made here, and under the log's own policy
/// the what-if is what happened.
#[test]
fn what_if_under_two_policies_matches_an_independent_fold() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let file = shared(PI);
    let mut run = cli::command(&data, &["run", file.to_str().unwrap()]);
    run.env("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "32000");
    let (ok, _, err) = cli::split(run.output().unwrap());
    assert!(ok, "{err}");
    let own = dir.path().join("own.toml");
    std::fs::write(&own, "default_context_window = 32000\n").unwrap();
    let a = dir.path().join("a.toml");
    std::fs::write(&a, "context_threshold = 0.6\nfresh_tail_count = 32\n").unwrap();
    let b = dir.path().join("b.toml");
    std::fs::write(
        &b,
        "[policy]\ndefault_context_window = 64000\nleaf_chunk_tokens = 8000\n",
    )
    .unwrap();
    let policies = [
        (
            &own,
            PolicyConfig {
                default_context_window: 32000,
                ..PolicyConfig::default()
            },
        ),
        (
            &a,
            PolicyConfig {
                context_threshold: 0.6,
                fresh_tail_count: 32,
                ..PolicyConfig::default()
            },
        ),
        (
            &b,
            PolicyConfig {
                default_context_window: 64000,
                leaf_chunk_tokens: 8000,
                ..PolicyConfig::default()
            },
        ),
    ];
    let mut what_ifs = Vec::new();
    for (file, policy) in &policies {
        let (ok, out, err) = cli::run(
            &data,
            &["replay", "--policy", file.to_str().unwrap(), "--json"],
        );
        assert!(ok, "{err}");
        let w = cli::json_of(&out);
        assert_eq!(w["policy_fingerprint"], policy_fingerprint(policy));
        let c = &w["conversations"][0];
        let (key, actual, what_if, misses) = independent(&data, policy);
        assert_eq!(c["conversation"], key.as_str());
        assert_eq!(
            numbers_of(&c["actual"]),
            actual,
            "actual, {}",
            file.display()
        );
        assert_eq!(
            numbers_of(&c["what_if"]),
            what_if,
            "what-if, {}",
            file.display()
        );
        assert_eq!(c["summaries_deterministic"], misses, "{}", file.display());
        assert_eq!(c["what_if"]["model_calls"], misses);
        what_ifs.push((numbers_of(&c["actual"]), numbers_of(&c["what_if"]), misses));
    }
    // Under the log's own policy nothing differs, and every summary was in the log.
    assert_eq!(what_ifs[0].0, what_ifs[0].1);
    assert_eq!(what_ifs[0].2, 0);
    // The others differ from what happened, and say where summaries came from.
    assert_ne!(what_ifs[1].1, what_ifs[1].0);
    assert_ne!(what_ifs[2].1, what_ifs[2].0);
    let (ok, out, err) = cli::run(&data, &["replay", "--policy", a.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(
        out.contains("written by the deterministic summarizer"),
        "{out}"
    );
    assert!(out.contains("actual") && out.contains("what-if"), "{out}");
    // Unknown keys are refused, as in the configuration.
    std::fs::write(&a, "context_thresholdd = 0.6\n").unwrap();
    let (ok, _, err) = cli::run(&data, &["replay", "--policy", a.to_str().unwrap()]);
    assert!(!ok && err.contains("context_thresholdd"), "{err}");
}
