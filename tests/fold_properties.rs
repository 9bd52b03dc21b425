//! Property tests of the fold: replaying a log twice gives identical state
//! hashes, duplicated or redelivered events change nothing, and the
//! assembled context never breaks tool pairing or the budget.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::assembly::{self, AssemblyRequest};
use contextfold::core::event::*;
use contextfold::core::fold;
use contextfold::core::message::{ChatMessage, FunctionCall, Role, ToolCall};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::State;
use contextfold::log::memory::MemoryLog;
use contextfold::log::EventLog;
use contextfold::runtime::embedded::Pipeline;
use contextfold::runtime::engine::{Engine, Residency};
use contextfold::store::memory_backend::MemoryBackend;
use contextfold::summarizer::DeterministicSummarizer;
use proptest::prelude::*;

mod support;
use contextfold::testing::small_policy;

#[derive(Debug, Clone)]
enum Step {
    User(usize),
    Assistant(usize),
    ToolRound(u8, usize),
    AbortedCall,
    Overflow,
    Manual,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (10usize..400).prop_map(Step::User),
        6 => (10usize..400).prop_map(Step::Assistant),
        4 => (1u8..4, 10usize..600).prop_map(|(n, s)| Step::ToolRound(n, s)),
        1 => Just(Step::AbortedCall),
        1 => Just(Step::Overflow),
        1 => Just(Step::Manual),
    ]
}

fn words(n: usize, seed: usize) -> String {
    (0..n)
        .map(|i| format!("w{}x{} ", (i * 7 + seed) % 97, seed % 13))
        .collect()
}

fn events(conv: &str, steps: &[Step]) -> Vec<Envelope> {
    let mut out = Vec::new();
    let mut time = 1_700_000_000_000u64;
    let mut n = 0usize;
    let mut push = |out: &mut Vec<Envelope>, body: EventBody, time: &mut u64| {
        n += 1;
        *time += 1500;
        out.push(Envelope::new(format!("{conv}-e{n}"), conv, *time, body));
    };
    let turn = |m: ChatMessage| EventBody::TurnAppended(TurnAppended::from(m));
    for (i, s) in steps.iter().enumerate() {
        match s {
            Step::User(len) => push(
                &mut out,
                turn(ChatMessage::text(Role::User, words(*len, i))),
                &mut time,
            ),
            Step::Assistant(len) => push(
                &mut out,
                turn(ChatMessage::text(Role::Assistant, words(*len, i + 1))),
                &mut time,
            ),
            Step::ToolRound(k, len) => {
                let calls: Vec<ToolCall> = (0..*k)
                    .map(|j| ToolCall {
                        id: format!("call_{i}_{j}"),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: "read_file".into(),
                            arguments: format!("{{\"path\":\"src/f{i}_{j}.rs\"}}"),
                        },
                    })
                    .collect();
                let mut m = ChatMessage::text(Role::Assistant, "");
                m.content = None;
                m.tool_calls = calls.clone();
                push(&mut out, turn(m), &mut time);
                for c in calls {
                    let mut r = ChatMessage::text(Role::Tool, words(*len, i + 2));
                    r.tool_call_id = Some(c.id);
                    push(&mut out, turn(r), &mut time);
                }
            }
            Step::AbortedCall => {
                let mut m = ChatMessage::text(Role::Assistant, "trying a tool");
                m.tool_calls = vec![ToolCall {
                    id: format!("aborted_{i}"),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: "bash".into(),
                        arguments: "{}".into(),
                    },
                }];
                push(&mut out, turn(m), &mut time);
            }
            Step::Overflow => push(
                &mut out,
                EventBody::ProviderErrorObserved(ProviderErrorObserved {
                    error: "prompt is too long: 208423 tokens > 200000 maximum".into(),
                    model: None,
                }),
                &mut time,
            ),
            Step::Manual => push(
                &mut out,
                EventBody::CompactionRequested(CompactionRequested::default()),
                &mut time,
            ),
        }
    }
    out
}

/// Folds `input` in chunks through the embedded pipeline (a commit per
/// chunk); returns the state, the log, and the state as loaded back from
/// what the store committed.
fn run_pipeline_and_reload(
    policy: &PolicyConfig,
    input: &[Envelope],
    chunk: usize,
) -> (State, MemoryLog, State) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut p = contextfold::testing::memory_pipeline(policy.clone())
            .await
            .unwrap();
        for c in input.chunks(chunk.max(1)) {
            p.ingest(c).await.unwrap();
        }
        let stored = p.engine.store().backend().clone();
        let reloaded = Engine::open(stored, policy.clone())
            .unwrap()
            .materialized()
            .unwrap();
        (p.engine.materialized().unwrap(), p.log.clone(), reloaded)
    })
}

fn run_pipeline(policy: &PolicyConfig, input: &[Envelope], chunk: usize) -> (State, MemoryLog) {
    let (state, log, _) = run_pipeline_and_reload(policy, input, chunk);
    (state, log)
}

fn replay(policy: &PolicyConfig, log: &mut MemoryLog) -> State {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut engine = Engine::open(MemoryBackend::default(), policy.clone()).unwrap();
        for r in log.read_after(0, usize::MAX).await.unwrap() {
            engine.apply(&r).unwrap();
        }
        engine.materialized().unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn replay_gives_identical_hashes(steps in prop::collection::vec(step(), 1..120), chunk in 1usize..40) {
        let policy = small_policy();
        let input = events("c:prop", &steps);
        let (state, mut log, reloaded) = run_pipeline_and_reload(&policy, &input, chunk);
        let a = replay(&policy, &mut log);
        let b = replay(&policy, &mut log);
        prop_assert_eq!(a.hash(), b.hash());
        prop_assert_eq!(a.hash(), state.hash());
        // What the store committed, chunk by chunk, loads back whole.
        prop_assert_eq!(reloaded.hash(), state.hash());
    }

    #[test]
    fn duplicates_and_redeliveries_change_nothing(
        steps in prop::collection::vec(step(), 1..80),
        dups in prop::collection::vec((any::<prop::sample::Index>(), any::<prop::sample::Index>()), 1..30),
    ) {
        let policy = small_policy();
        let input = events("c:dup", &steps);
        let (_, mut log) = run_pipeline(&policy, &input, 7);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let records = rt.block_on(log.read_after(0, usize::MAX)).unwrap();
        // Redeliver random records again at later positions.
        // A redelivery always comes after the first delivery.
        let mut order: Vec<usize> = (0..records.len()).collect();
        for (what, at) in dups {
            let from = what.index(records.len());
            let first = order.iter().position(|&i| i == from).unwrap();
            let to = first + 1 + at.index(order.len() - first);
            order.insert(to, from);
        }
        let with_dups: Vec<(Origin, Encoding, Vec<u8>)> = order
            .iter()
            .map(|&i| (records[i].origin, records[i].encoding, records[i].bytes.to_vec()))
            .collect();
        let mut dup_log = MemoryLog::new();
        rt.block_on(dup_log.append_batch(&with_dups)).unwrap();
        prop_assert_eq!(replay(&policy, &mut log).hash(), replay(&policy, &mut dup_log).hash());
    }

    #[test]
    fn assembly_keeps_pairing_and_budget(steps in prop::collection::vec(step(), 1..120), budget in 500u64..8000) {
        let policy = small_policy();
        let input = events("c:asm", &steps);
        let (state, _) = run_pipeline(&policy, &input, 5);
        let conv = &state.conversations["c:asm"];
        let out = assembly::assemble(conv, &policy, &AssemblyRequest { budget: Some(budget), prompt: None, prompt_aware_eviction: false, summaries_as_they_are: false }).unwrap();
        prop_assert!(assembly::check_tool_pairing(&out.messages).is_ok(), "{:?}", assembly::check_tool_pairing(&out.messages));
        if !out.over_budget {
            prop_assert!(out.tokens <= budget, "{} > {}", out.tokens, budget);
        }
    }
}

#[test]
fn redelivered_event_is_a_no_op() {
    let policy = small_policy();
    let input = events(
        "c:x",
        &[Step::User(50), Step::ToolRound(2, 40), Step::Assistant(30)],
    );
    let mut state = State::default();
    for e in &input {
        fold::fold(&mut state, &policy, e);
    }
    let before = state.hash();
    for e in &input {
        let out = fold::fold(&mut state, &policy, e);
        assert_eq!(out.status, fold::FoldStatus::Duplicate);
        assert!(out.decisions.is_empty());
    }
    assert_eq!(before, state.hash());
}

#[test]
fn orphan_tool_result_is_rejected_and_the_rest_still_folds() {
    let policy = small_policy();
    let mut state = State::default();
    let mut orphan = ChatMessage::text(Role::Tool, "result");
    orphan.tool_call_id = Some("nope".into());
    let turn = |id: &str, m: ChatMessage| {
        Envelope::new(id, "c:o", 1, EventBody::TurnAppended(TurnAppended::from(m)))
    };
    let out = fold::fold(&mut state, &policy, &turn("a", orphan));
    assert!(
        matches!(
            out.status,
            fold::FoldStatus::Rejected(fold::Rejection::Turn(
                fold::TurnRejection::OrphanToolResult { ref call_id }
            )) if call_id == "nope"
        ),
        "{:?}",
        out.status
    );
    assert!(matches!(out.decisions[0].body, EventBody::EventRejected(_)));
    let out = fold::fold(
        &mut state,
        &policy,
        &turn("b", ChatMessage::text(Role::User, "hello there")),
    );
    assert_eq!(out.status, fold::FoldStatus::Applied);
    assert_eq!(state.conversations["c:o"].turns.len(), 1);
}

#[test]
fn compaction_happens_and_debt_is_single() {
    let policy = small_policy();
    let steps: Vec<Step> = (0..200)
        .map(|i| {
            if i % 3 == 0 {
                Step::User(200)
            } else {
                Step::ToolRound(1, 300)
            }
        })
        .collect();
    let input = events("c:big", &steps);
    let (state, mut log) = run_pipeline(&policy, &input, 1);
    let conv = &state.conversations["c:big"];
    assert!(!conv.summaries.is_empty(), "expected summaries");
    assert!(
        conv.summaries.iter().any(|s| s.depth >= 1),
        "expected condensed summaries"
    );
    // Never two jobs pending: every job_issued is followed by its sweep_ended before the next.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut open: Option<String> = None;
    for r in rt.block_on(log.read_after(0, usize::MAX)).unwrap() {
        let e = Envelope::decode(&r.bytes, r.encoding).unwrap();
        match &e.body {
            EventBody::JobIssued(j) => {
                assert!(
                    open.is_none(),
                    "job {} issued while {:?} pending",
                    j.job_id,
                    open
                );
                open = Some(j.job_id.clone());
            }
            EventBody::SweepEnded(s) if open.as_deref() == Some(s.job_id.as_str()) => open = None,
            _ => {}
        }
    }
    let out = assembly::assemble(conv, &policy, &AssemblyRequest::default()).unwrap();
    assert!(out.tokens <= 6000);
}

/// Events of three conversations interleaved as `picks` says (each pick
/// takes the next event of conversation `pick % 3`).
fn interleaved(steps: &[Vec<Step>; 3], picks: &[usize]) -> Vec<Envelope> {
    let mut queues: Vec<std::collections::VecDeque<Envelope>> = ["c:one", "c:two", "c:three"]
        .iter()
        .zip(steps)
        .map(|(key, s)| events(key, s).into())
        .collect();
    let mut out = Vec::new();
    for pick in picks.iter().cycle() {
        if queues.iter().all(|q| q.is_empty()) {
            break;
        }
        let q = (0..3)
            .map(|k| (pick + k) % 3)
            .find(|&k| !queues[k].is_empty())
            .unwrap();
        out.extend(queues[q].pop_front());
    }
    out
}

/// Folds through the embedded pipeline in chunks (a commit each), the
/// engine keeping at most `resident` conversations in memory (0: the
/// default) and dropping the idle ones at every commit when `drop_idle`.
fn pipeline_with_residency(
    policy: &PolicyConfig,
    input: &[Envelope],
    chunk: usize,
    resident: usize,
    drop_idle: bool,
) -> (String, MemoryLog, usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut engine = Engine::open(MemoryBackend::default(), policy.clone()).unwrap();
        if resident > 0 || drop_idle {
            engine.set_residency(Residency {
                conversations: if resident > 0 { resident } else { usize::MAX },
                idle: if drop_idle {
                    std::time::Duration::ZERO
                } else {
                    std::time::Duration::from_secs(3600)
                },
            });
        }
        let mut p = Pipeline::open(MemoryLog::new(), engine, DeterministicSummarizer)
            .await
            .unwrap();
        let mut most = 0;
        for c in input.chunks(chunk.max(1)) {
            p.ingest(c).await.unwrap();
            most = most.max(p.engine.resident());
        }
        (p.engine.state_hash().unwrap(), p.log.clone(), most)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// A conversation dropped from memory and loaded again folds exactly
    /// as one that stayed resident: live (the pipeline deciding and
    /// summarizing with evictions) and in replay (random evictions between
    /// commits), the hashes equal the all-resident fold's.
    #[test]
    fn evictions_change_no_hash(
        a in prop::collection::vec(step(), 1..60),
        b in prop::collection::vec(step(), 1..60),
        c in prop::collection::vec(step(), 1..60),
        picks in prop::collection::vec(0usize..3, 1..50),
        chunk in 1usize..12,
        resident in 1usize..3,
        evict_at in prop::collection::vec(any::<bool>(), 1..40),
    ) {
        let policy = small_policy();
        let input = interleaved(&[a, b, c], &picks);
        let (resident_hash, mut log, _) = pipeline_with_residency(&policy, &input, chunk, 0, false);
        prop_assert_eq!(replay(&policy, &mut log).hash(), resident_hash.as_str());
        // Live folding with evictions (the summarizer stamps its events
        // with the time it took, so each run has its own log): the state
        // is the one its log folds to with every conversation resident.
        // At most `resident` conversations after each commit:
        let (capped_hash, mut capped_log, most) =
            pipeline_with_residency(&policy, &input, chunk, resident, false);
        prop_assert!(most <= resident, "{} resident, cap {}", most, resident);
        prop_assert_eq!(replay(&policy, &mut capped_log).hash(), capped_hash);
        // Every conversation dropped at every commit:
        let (idle_hash, mut idle_log, none) = pipeline_with_residency(&policy, &input, chunk, 0, true);
        prop_assert_eq!(none, 0);
        prop_assert_eq!(replay(&policy, &mut idle_log).hash(), idle_hash);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let records = rt.block_on(log.read_after(0, usize::MAX)).unwrap();
        // Replay with evictions at random commits.
        let mut engine = Engine::open(MemoryBackend::default(), policy.clone()).unwrap();
        for (i, r) in records.iter().enumerate() {
            engine.apply(r).unwrap();
            if evict_at[i % evict_at.len()] {
                engine.commit().unwrap();
                engine.evict_all();
                prop_assert_eq!(engine.resident(), 0);
            }
        }
        engine.commit().unwrap();
        prop_assert_eq!(engine.state_hash().unwrap(), resident_hash.as_str());
        prop_assert_eq!(engine.materialized().unwrap().hash(), resident_hash);
    }
}

/// The partition's intake quota is committed with the state and loads
/// back: a flood over many conversations, folded in chunks, gives the
/// same state (the partition's bucket and refusals included) when the
/// store is reopened and when the log is replayed.
#[test]
fn the_partitions_intake_quota_survives_a_reload_and_a_replay() {
    let policy = PolicyConfig {
        intake_partition_events_per_second: Some(5),
        intake_partition_burst_events: Some(40),
        ..small_policy()
    };
    let input: Vec<Envelope> = (0..30)
        .flat_map(|c| {
            let conv = format!("c:tenant-{c}");
            let steps = vec![Step::User(3), Step::Assistant(4)];
            events(&conv, &steps)
        })
        .collect();
    let (state, mut log, reloaded) = run_pipeline_and_reload(&policy, &input, 9);
    assert!(
        state.intake.refused > 0,
        "the flood met the partition's quota"
    );
    assert_eq!(reloaded.intake, state.intake);
    assert_eq!(reloaded.hash(), state.hash());
    assert_eq!(replay(&policy, &mut log).hash(), state.hash());
}
