//! The engine under a simulated clock (issue 22, DESIGN invariant 12):
//! random interleavings of agents publishing, time passing, summarizers
//! that answer, fail, vanish or answer after their job expired, and
//! crashes (one right after a batch's decisions were stored and before
//! its jobs were queued). At quiescence (a healthy summarizer works the
//! queue and time passes) every debt has ended: no job is out, no
//! conversation owes compaction but for a counted reason, and the state is
//! the one a clean replay of the log gives.
//!
//! The log is a JetStream-like stream: every record carries the time the
//! stream stored it, the simulated clock, which alone drives scheduling.

// Tests fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use contextfold::api::status::{self, HealthCode, StatusRequest, StatusResponse};
use contextfold::core::event::{
    ClockTicked, Encoding, Envelope, EventBody, Origin, SweepEnded, SweepStop,
    EMBEDDED_PARTITION_KEY,
};
use contextfold::core::intake::Address;
use contextfold::core::policy::PolicyConfig;
use contextfold::core::sweep::SweepSnapshot;
use contextfold::log::LogRecord;
use contextfold::runtime::engine::{Effects, Engine};
use contextfold::runtime::sweep::run_sweep;
use contextfold::store::memory_backend::MemoryBackend;
use contextfold::summarizer::DeterministicSummarizer;
use contextfold::testing::small_policy;
use proptest::prelude::*;
use std::collections::VecDeque;
use std::time::Duration;
use support::turns::turns;

const T0: u64 = 1_800_000_000_000;
const CONVERSATIONS: [&str; 3] = ["agent:a", "agent:b", "agent:c"];

#[derive(Debug, Clone)]
enum Step {
    /// An agent publishes its next `n` turns.
    Publish { conv: usize, n: usize },
    /// The same, and the process crashes once the batch's decisions are
    /// stored, before its jobs are queued or its state committed.
    PublishThenCrash { conv: usize, n: usize },
    /// Time passes (a quiet partition records a tick when due).
    Wait { ms: u64 },
    /// A summarizer takes a job: the `pick`-th queued one.
    Work { pick: usize, how: Worker },
    /// The process crashes and restarts (its uncommitted state is lost).
    Crash,
}

#[derive(Debug, Clone, Copy)]
enum Worker {
    /// Runs the sweep (the deterministic summarizer).
    Answers,
    /// Ends the job without progress (a failing model).
    Fails,
    /// Vanishes: no `sweep_ended` ever comes.
    Vanishes,
    /// Answers after the job expired.
    Late,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..3usize, 1..25usize).prop_map(|(conv, n)| Step::Publish { conv, n }),
        1 => (0..3usize, 1..25usize).prop_map(|(conv, n)| Step::PublishThenCrash { conv, n }),
        3 => (1u64..900_000).prop_map(|ms| Step::Wait { ms }),
        4 => (0..4usize, prop_oneof![
            4 => Just(Worker::Answers),
            2 => Just(Worker::Fails),
            1 => Just(Worker::Vanishes),
            1 => Just(Worker::Late),
        ]).prop_map(|(pick, how)| Step::Work { pick, how }),
        1 => Just(Step::Crash),
    ]
}

/// A stream, a work queue, and the process folding them.
struct Sim {
    policy: PolicyConfig,
    /// The state store the process commits to (survives its crashes).
    backend: MemoryBackend,
    engine: Engine<MemoryBackend>,
    /// The events stream.
    log: Vec<LogRecord>,
    /// The stream's clock.
    now: u64,
    /// The work queue (a job once).
    queue: VecDeque<SweepSnapshot>,
    next_turn: [usize; 3],
    runtime: tokio::runtime::Runtime,
}

impl Sim {
    fn new(policy: PolicyConfig) -> Sim {
        let backend = MemoryBackend::default();
        let engine = Engine::open(backend.clone(), policy.clone()).unwrap();
        Sim {
            policy,
            backend,
            engine,
            log: Vec::new(),
            now: T0,
            queue: VecDeque::new(),
            next_turn: [0; 3],
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    /// Appends `e` as `origin` wrote it, stored now.
    fn append(&mut self, origin: Origin, e: &Envelope) -> LogRecord {
        self.now += 1;
        let record = LogRecord {
            position: self.log.len() as u64 + 1,
            origin,
            address: Address::Unaddressed,
            stored_at_ms: Some(self.now),
            encoding: Encoding::Msgpack,
            bytes: e.to_msgpack().into(),
        };
        self.log.push(record.clone());
        record
    }

    /// Folds what the log holds past the engine, stores its decisions and
    /// queues its jobs (unless the process dies in between), then commits.
    fn fold(&mut self, crash_before_jobs: bool) {
        let records: Vec<LogRecord> = self
            .log
            .iter()
            .filter(|r| r.position > self.engine.position())
            .cloned()
            .collect();
        let effects = self.engine.apply_batch(records).unwrap();
        self.carry_out(effects, crash_before_jobs);
    }

    fn carry_out(&mut self, effects: Effects, crash_before_jobs: bool) {
        for d in &effects.decisions {
            self.append(Origin::Service, d);
        }
        if crash_before_jobs {
            self.crash();
            return;
        }
        for job in effects.jobs.into_iter().chain(effects.requeued) {
            if !self.queue.iter().any(|q| q.job.job_id == job.job.job_id) {
                self.queue.push_back(job);
            }
        }
        self.engine.commit().unwrap();
    }

    /// The process dies: what it did not commit is lost; the next one
    /// opens the store, folds the history past it and finds its jobs.
    fn crash(&mut self) {
        self.engine = Engine::open(self.backend.clone(), self.policy.clone()).unwrap();
        self.engine.hold_through(self.log.len() as u64);
        let records: Vec<LogRecord> = self
            .log
            .iter()
            .filter(|r| r.position > self.engine.position())
            .cloned()
            .collect();
        let mut effects = Effects::default();
        for r in &records {
            self.engine.apply_record(r, &mut effects).unwrap();
        }
        self.engine.end_history();
        self.engine.requeue_pending();
        self.engine.finish(&mut effects).unwrap();
        self.carry_out(effects, false);
    }

    fn publish(&mut self, conv: usize, n: usize, crash_before_jobs: bool) {
        let from = self.next_turn[conv];
        self.next_turn[conv] += n;
        for e in turns(CONVERSATIONS[conv], from..from + n, 40) {
            self.append(Origin::Agent, &e);
        }
        self.fold(crash_before_jobs);
    }

    /// Time passes; a quiet partition records a tick once a timer is due.
    fn wait(&mut self, ms: u64) {
        self.now += ms;
        if self.engine.next_wake().is_some_and(|at| at <= self.now) {
            let tick = Envelope::new(
                format!("tick:{}", self.now),
                EMBEDDED_PARTITION_KEY,
                self.now,
                EventBody::ClockTicked(ClockTicked::default()),
            );
            self.append(Origin::Service, &tick);
            self.fold(false);
        }
    }

    fn work(&mut self, pick: usize, how: Worker) {
        if self.queue.is_empty() {
            return;
        }
        let snap = self.queue.remove(pick % self.queue.len()).unwrap();
        match how {
            Worker::Vanishes => {}
            Worker::Fails => {
                let end = Envelope::new(
                    format!("se_{}", snap.job.job_id),
                    snap.conversation.clone(),
                    snap.job.issued_at,
                    EventBody::SweepEnded(SweepEnded {
                        job_id: snap.job.job_id,
                        passes: 1,
                        committed: 0,
                        stop: SweepStop::Failed,
                        detail: Some("the model failed".into()),
                        calls: 1,
                        tokens_spent: 100,
                        cost_micros: 0,
                        retry_after_ms: None,
                    }),
                );
                self.append(Origin::Service, &end);
                self.fold(false);
            }
            Worker::Answers | Worker::Late => {
                if matches!(how, Worker::Late) {
                    self.wait(2 * snap.job.deadline_ms + 61_000);
                }
                let deadline = Duration::from_millis(snap.job.deadline_ms);
                let mut out = Vec::new();
                self.runtime
                    .block_on(run_sweep(snap, &DeterministicSummarizer, deadline, |e| {
                        out.push(e)
                    }));
                for e in &out {
                    self.append(Origin::Service, e);
                }
                self.fold(false);
            }
        }
    }

    fn run(&mut self, step: &Step) {
        match step {
            Step::Publish { conv, n } => self.publish(*conv, *n, false),
            Step::PublishThenCrash { conv, n } => self.publish(*conv, *n, true),
            Step::Wait { ms } => self.wait(*ms),
            Step::Work { pick, how } => self.work(*pick, *how),
            Step::Crash => self.crash(),
        }
    }

    /// A healthy summarizer works the queue and time passes, until nothing
    /// is queued and no timer is due within an hour.
    fn quiesce(&mut self) {
        for _ in 0..500 {
            while !self.queue.is_empty() {
                self.work(0, Worker::Answers);
            }
            match self.engine.next_wake() {
                Some(at) if at <= self.now + 3_600_000 => {
                    self.wait(at.saturating_sub(self.now) + 1)
                }
                _ => return,
            }
        }
        panic!(
            "no quiescence after 500 rounds: {} queued",
            self.queue.len()
        );
    }
}

/// Why `key` may still owe compaction at quiescence, if it may.
fn counted_reason(sim: &Sim, key: &str) -> Option<HealthCode> {
    let status = sim
        .engine
        .with_conversation(key, |state, _| {
            status::status(
                state,
                &sim.engine.policy,
                &StatusRequest {
                    conversation: Some(key.to_string()),
                },
            )
        })
        .unwrap()
        .unwrap();
    let StatusResponse::Conversation(s) = status else {
        unreachable!()
    };
    s.health.reasons.iter().map(|r| r.code).find(|c| {
        matches!(
            c,
            HealthCode::OverBudget | HealthCode::Incompressible | HealthCode::BlockedDebt
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_debt_ends(steps in proptest::collection::vec(step(), 1..40)) {
        let policy = PolicyConfig {
            no_progress_backoff_ms: 30_000,
            summary_spend_backoff_ms: 240_000,
            sweep_deadline_ms: 20_000,
            ..small_policy()
        };
        let mut sim = Sim::new(policy);
        for step in &steps {
            sim.run(step);
        }
        sim.quiesce();
        for key in CONVERSATIONS {
            let found = sim
                .engine
                .with_conversation(key, |state, _| state.conversations.get(key).cloned())
                .unwrap();
            let Some(conv) = found else { continue };
            prop_assert!(
                conv.pending_job.is_none(),
                "{key}: a job left out at quiescence: {:?}",
                conv.pending_job
            );
            if conv.debt.is_some() {
                let reason = counted_reason(&sim, key);
                prop_assert!(reason.is_some(), "{key}: a debt with no job, no wait and no reason: {:?}", conv.debt);
            }
        }
        // The state is what a clean replay of the log gives (once the
        // process has folded the copies of its last decisions too).
        while sim.engine.position() < sim.log.len() as u64 {
            sim.fold(false);
        }
        let mut clean = Engine::open(MemoryBackend::default(), sim.policy.clone()).unwrap();
        let _ = clean.apply_batch(sim.log.clone()).unwrap();
        clean.commit().unwrap();
        prop_assert_eq!(clean.state_hash().unwrap(), sim.engine.state_hash().unwrap());
    }
}
