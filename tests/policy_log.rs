//! The policy is an event of the log: a process folding under a policy
//! the log does not say records it first, and replays fold each recorded
//! policy from where it was recorded, so the log alone reproduces every
//! state, whatever the configuration that replays it. Also: read-only
//! commands never write the store, and `replay --policy` (what-if).

use contextfold::core::event::{Encoding, EventBody, Origin};
use contextfold::core::policy::PolicyConfig;
use contextfold::log::memory::MemoryLog;
use contextfold::log::segment::SegmentLog;
use contextfold::log::EventLog;
use contextfold::runtime::embedded::{self, Pipeline};
use contextfold::runtime::engine::{policy_fingerprint, Effects, Engine};
use contextfold::runtime::sweep::Deterministic;
use contextfold::store::memory_backend::MemoryBackend;
use proptest::prelude::*;
use std::path::{Path, PathBuf};

mod support;
use support::cli;
use support::policy::small_policy;
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

type Local = Pipeline<MemoryLog, MemoryBackend, Deterministic>;

/// A process: opens the store left by the previous one with `policy`.
async fn open(log: MemoryLog, store: MemoryBackend, policy: &PolicyConfig) -> Local {
    let mut engine = Engine::open(store, policy.clone()).unwrap();
    engine.record_policy_as(
        contextfold::core::event::EMBEDDED_PARTITION_KEY.into(),
        "test",
    );
    Pipeline::open(log, engine, Deterministic).await.unwrap()
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
    let (ok, _, err) = cli::run(data, &["status", &key]);
    assert!(ok && !err.contains("behind"), "{err}");
}
