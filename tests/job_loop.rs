//! The compaction job loop, on the fold itself (issue 10, item 5).
//!
//! Summarizer workers run each job on its snapshot (the real sweep runner
//! over the deterministic summarizer) and their events reach the fold in a
//! random interleaving with the agent's turns: turns far apart in time
//! expire a job while its worker still runs, so the summaries of an
//! expired job and of its successor arrive mixed; some workers die and
//! never report. After every folded event:
//!
//! - (b) the context has no raw turn between summaries: every summary in
//!   context comes before every raw turn in context. Assembly, the leaf
//!   planner (`policy::raw_start`) and the fold's leaf check rely on it.
//!
//! Once the agent stops, every event still owed is delivered (and every
//! job issued meanwhile is run to its end):
//!
//! - (a) the jobs issued without new agent input are bounded: at most
//!   `2 * raws + summaries + 2`, the raw turns and summaries in context when
//!   input stopped. A job is issued without input only after a job that
//!   made progress the fold accepted (a summary, which takes at least one
//!   raw turn or one summary out of context, or one rolling state), plus
//!   the job pending when input stopped and one rolling refresh;
//! - and the conversation settles: no job is pending at the end but one
//!   whose worker died.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::*;
use contextfold::core::fold;
use contextfold::core::message::{ChatMessage, FunctionCall, Role, ToolCall};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::{ContextItem, Conversation, State};
use contextfold::core::sweep;
use contextfold::runtime::sweep::run_sweep;
use contextfold::summarizer::DeterministicSummarizer;
use proptest::prelude::*;
use std::collections::VecDeque;
use std::time::Duration;

const CONV: &str = "agent:loop";
const T0: u64 = 1_700_000_000_000;

fn policy() -> PolicyConfig {
    PolicyConfig {
        default_context_window: 4_000,
        fresh_tail_count: 4,
        leaf_chunk_tokens: 500,
        leaf_target_tokens: 100,
        condensed_target_tokens: 100,
        leaf_fanout: 3,
        condensed_fanout: 2,
        rolling_every_turns: 6,
        ..PolicyConfig::default()
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// An agent turn of about this many words, `gap_s` seconds after the
    /// previous event (a long gap expires the pending job).
    User {
        words: usize,
        gap_s: u64,
    },
    Assistant {
        words: usize,
        gap_s: u64,
    },
    ToolRound {
        words: usize,
        gap_s: u64,
    },
    /// The worker of the `n`-th oldest live job delivers its next events.
    Deliver {
        worker: prop::sample::Index,
        events: usize,
    },
    /// That worker dies: its remaining events are never delivered.
    Kill {
        worker: prop::sample::Index,
    },
    Overflow,
}

fn gap() -> impl Strategy<Value = u64> {
    prop_oneof![8 => 0u64..20, 2 => 300u64..2_000]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (20usize..200, gap()).prop_map(|(words, gap_s)| Op::User { words, gap_s }),
        4 => (20usize..200, gap()).prop_map(|(words, gap_s)| Op::Assistant { words, gap_s }),
        2 => (20usize..300, gap()).prop_map(|(words, gap_s)| Op::ToolRound { words, gap_s }),
        6 => (any::<prop::sample::Index>(), 1usize..4)
            .prop_map(|(worker, events)| Op::Deliver { worker, events }),
        1 => any::<prop::sample::Index>().prop_map(|worker| Op::Kill { worker }),
        1 => Just(Op::Overflow),
    ]
}

fn words(n: usize, seed: usize) -> String {
    (0..n)
        .map(|i| format!("w{}q{} ", (i * 13 + seed) % 211, seed % 7))
        .collect()
}

/// A job's worker: the events it has still to deliver.
struct Worker {
    job_id: String,
    events: VecDeque<Envelope>,
}

/// The fold, the workers of the jobs it issued and what they still owe.
struct World {
    state: State,
    policy: PolicyConfig,
    rt: tokio::runtime::Runtime,
    /// Events each live worker has still to deliver, oldest worker first.
    workers: VecDeque<Worker>,
    /// Jobs whose worker died.
    killed: Vec<String>,
    time: u64,
    n: usize,
    jobs_issued: usize,
}

impl World {
    fn new() -> Self {
        World {
            state: State::default(),
            policy: policy(),
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("runtime"),
            workers: VecDeque::new(),
            killed: Vec::new(),
            time: T0,
            n: 0,
            jobs_issued: 0,
        }
    }

    fn conv(&self) -> Option<&Conversation> {
        self.state.conversations.get(CONV)
    }

    /// Folds one event, checks the invariant, and starts a worker for a
    /// job it issued: the sweep runs now on the snapshot the job gets, and
    /// its events are delivered later.
    fn fold(&mut self, e: &Envelope) -> Result<(), TestCaseError> {
        let out = fold::fold(&mut self.state, &self.policy, e);
        if let Some(conv) = self.conv() {
            no_raw_between_summaries(conv)?;
        }
        for d in &out.decisions {
            if let EventBody::JobIssued(job) = &d.body {
                self.jobs_issued += 1;
                let conv = self.conv().expect("a job has a conversation");
                let snap = sweep::snapshot(conv, job, &self.policy).unwrap();
                let mut events = Vec::new();
                self.rt.block_on(run_sweep(
                    snap,
                    &DeterministicSummarizer,
                    Duration::from_millis(job.deadline_ms),
                    |ev| events.push(ev),
                ));
                self.workers.push_back(Worker {
                    job_id: job.job_id.clone(),
                    events: events.into(),
                });
            }
        }
        Ok(())
    }

    fn agent(&mut self, body: EventBody, gap_s: u64) -> Result<(), TestCaseError> {
        self.n += 1;
        self.time += gap_s * 1_000 + 1;
        let e = Envelope::new(format!("{CONV}-e{}", self.n), CONV, self.time, body);
        self.fold(&e)
    }

    fn turn(&mut self, m: ChatMessage, gap_s: u64) -> Result<(), TestCaseError> {
        self.agent(EventBody::TurnAppended(TurnAppended::from(m)), gap_s)
    }

    fn deliver(&mut self, worker: usize, events: usize) -> Result<(), TestCaseError> {
        for _ in 0..events {
            let Some(e) = self
                .workers
                .get_mut(worker)
                .and_then(|w| w.events.pop_front())
            else {
                break;
            };
            self.fold(&e)?;
        }
        self.workers.retain(|w| !w.events.is_empty());
        Ok(())
    }

    fn apply(&mut self, op: &Op, i: usize) -> Result<(), TestCaseError> {
        match op {
            Op::User { words: w, gap_s } => {
                self.turn(ChatMessage::text(Role::User, words(*w, i)), *gap_s)
            }
            Op::Assistant { words: w, gap_s } => {
                self.turn(ChatMessage::text(Role::Assistant, words(*w, i)), *gap_s)
            }
            Op::ToolRound { words: w, gap_s } => {
                let call = ToolCall {
                    id: format!("call_{i}"),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: "read_file".into(),
                        arguments: format!("{{\"path\":\"src/f{i}.rs\"}}"),
                    },
                };
                let mut m = ChatMessage::text(Role::Assistant, "");
                m.content = None;
                m.tool_calls = vec![call.clone()];
                self.turn(m, *gap_s)?;
                let mut r = ChatMessage::text(Role::Tool, words(*w, i + 1));
                r.tool_call_id = Some(call.id);
                self.turn(r, 0)
            }
            Op::Deliver { worker, events } => {
                if self.workers.is_empty() {
                    return Ok(());
                }
                let k = worker.index(self.workers.len());
                self.deliver(k, *events)
            }
            Op::Kill { worker } => {
                if !self.workers.is_empty() {
                    let k = worker.index(self.workers.len());
                    if let Some(w) = self.workers.remove(k) {
                        self.killed.push(w.job_id);
                    }
                }
                Ok(())
            }
            Op::Overflow => self.agent(
                EventBody::ProviderErrorObserved(ProviderErrorObserved {
                    error: "prompt is too long: 208423 tokens > 200000 maximum".into(),
                    model: None,
                }),
                1,
            ),
        }
    }
}

/// (b): every summary in context comes before every raw turn in context.
fn no_raw_between_summaries(conv: &Conversation) -> Result<(), TestCaseError> {
    let first_raw = conv
        .context
        .iter()
        .position(|i| matches!(i, ContextItem::Turn(_)));
    if let Some(raw) = first_raw {
        let late = conv.context[raw..]
            .iter()
            .position(|i| matches!(i, ContextItem::Summary(_)));
        prop_assert!(
            late.is_none(),
            "a summary at context item {} comes after raw turn item {raw}: {:?}",
            raw + late.unwrap_or(0),
            conv.context
        );
    }
    Ok(())
}

/// Raw turns and summaries in context: each accepted summary takes at
/// least one of them out (`2 * raws + summaries` drops by one at least).
fn potential(conv: &Conversation) -> usize {
    conv.context
        .iter()
        .map(|i| match i {
            ContextItem::Turn(_) => 2,
            ContextItem::Summary(_) => 1,
        })
        .sum()
}

fn run(ops: &[Op], drain_order: &[prop::sample::Index]) -> Result<(), TestCaseError> {
    let mut world = World::new();
    for (i, op) in ops.iter().enumerate() {
        world.apply(op, i)?;
    }
    // The agent stops. Every event still owed is delivered, in an order of
    // the case's choosing, with every job issued meanwhile run to its end.
    let Some(conv) = world.conv() else {
        return Ok(());
    };
    let bound = potential(conv) + 2;
    let before = world.jobs_issued;
    let mut k = 0;
    while !world.workers.is_empty() {
        let without_input = world.jobs_issued - before;
        prop_assert!(
            without_input <= bound,
            "{without_input} jobs issued without agent input (bound {bound}); last history: {:#?}",
            world.conv().map(|c| c
                .history
                .resident()
                .iter()
                .rev()
                .take(8)
                .collect::<Vec<_>>())
        );
        let pick = drain_order
            .get(k % drain_order.len().max(1))
            .map_or(0, |i| i.index(world.workers.len()));
        k += 1;
        world.deliver(pick, 1)?;
    }
    let without_input = world.jobs_issued - before;
    prop_assert!(
        without_input <= bound,
        "{without_input} jobs issued without agent input (bound {bound})"
    );
    let conv = world.conv().expect("conversation");
    // A job whose worker died stays pending until time moves on.
    let pending = conv.pending_job.as_ref().map(|p| p.job.job_id.clone());
    prop_assert!(
        pending.is_none_or(|id| world.killed.contains(&id)),
        "a job is still pending once every live worker reported: {:?}",
        conv.pending_job
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn jobs_without_input_are_bounded_and_no_raw_turn_sits_between_summaries(
        ops in prop::collection::vec(op(), 1..160),
        drain_order in prop::collection::vec(any::<prop::sample::Index>(), 1..8),
    ) {
        run(&ops, &drain_order)?;
    }
}
