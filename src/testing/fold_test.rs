//! The fold's given/when/then harness (cqrs-es's `TestFramework` is the
//! model): a state and a policy, events folded as given, one folded as
//! the event under test, and its outcome checked.
//!
//! ```
//! use contextfold::testing::{turn, FoldTest, T0};
//! let mut t = FoldTest::new(contextfold::testing::small_policy())
//!     .given((0..3).map(|i| turn("c", i, T0 + i)));
//! t.when(&turn("c", 3, T0 + 3)).then_applied().then_decisions(&[]);
//! ```
//!
//! Beside given/when/then it drives what a worker does between folds
//! (`until_job`, `commit`, `run_job`), so a test reads as the story of a
//! conversation, with the state at hand (`t.state`) for what no `then_`
//! says.

use crate::core::event::{Envelope, EventBody, JobIssued, SweepEnded, SweepStop};
use crate::core::fallback_summary;
use crate::core::fold::{fold, fold_owned, FoldOutcome, FoldStatus};
use crate::core::policy::PolicyConfig;
use crate::core::state::{Conversation, State};
use crate::core::sweep::{self, Pass};

/// A state folding under one policy.
#[derive(Debug, Clone, Default)]
pub struct FoldTest {
    pub state: State,
    pub policy: PolicyConfig,
}

/// The outcome of the event under test, to check.
#[derive(Debug)]
pub struct Then<'a> {
    pub test: &'a FoldTest,
    pub outcome: FoldOutcome,
}

/// The jobs among `decisions`.
pub fn jobs(decisions: &[Envelope]) -> Vec<JobIssued> {
    decisions
        .iter()
        .filter_map(|d| match &d.body {
            EventBody::JobIssued(j) => Some(j.clone()),
            _ => None,
        })
        .collect()
}

/// The `sweep_ended` of `job` at `time` (id `se-<job>-<time>`).
pub fn sweep_ended(s: SweepEnded, conv: &str, time: u64) -> Envelope {
    Envelope::new(
        format!("se-{}-{time}", s.job_id),
        conv,
        time,
        EventBody::SweepEnded(s),
    )
}

impl FoldTest {
    pub fn new(policy: PolicyConfig) -> Self {
        FoldTest {
            state: State::default(),
            policy,
        }
    }

    /// Given: `events` folded in order; each must be applied.
    pub fn given(mut self, events: impl IntoIterator<Item = Envelope>) -> Self {
        for e in events {
            let out = self.fold(&e);
            assert!(
                matches!(out.status, FoldStatus::Applied),
                "given event {} was not applied: {:?}",
                e.id,
                out.status
            );
        }
        self
    }

    /// When: folds the event under test; its outcome is checked on the
    /// answer.
    pub fn when(&mut self, event: &Envelope) -> Then<'_> {
        let outcome = fold(&mut self.state, &self.policy, event);
        Then {
            test: self,
            outcome,
        }
    }

    /// Folds one event, as a log with no stored times does.
    pub fn fold(&mut self, event: &Envelope) -> FoldOutcome {
        fold(&mut self.state, &self.policy, event)
    }

    /// Folds one event as a log that stores times folds it: at `stored`.
    pub fn fold_at(&mut self, event: &Envelope, stored: u64) -> FoldOutcome {
        fold_owned(
            &mut self.state,
            &self.policy,
            event.clone(),
            Some(stored),
            None,
        )
    }

    /// The conversation `key` (it must exist).
    pub fn conversation(&self, key: &str) -> &Conversation {
        match self.state.conversations.get(key) {
            Some(c) => c,
            None => panic!("no conversation {key}"),
        }
    }

    /// Folds synthetic turns `from..` of `conv`, a second apart from
    /// `time`, until a job is issued; returns it and the next turn index.
    pub fn until_job(&mut self, conv: &str, from: u64, time: u64) -> (JobIssued, u64) {
        for i in from..from + 200 {
            let out = self.fold(&super::turn(conv, i, time + (i - from) * 1_000));
            if let Some(j) = jobs(&out.decisions).pop() {
                return (j, i + 1);
            }
        }
        panic!("no job issued in 200 turns");
    }

    /// Runs up to `passes` passes of `job` as its worker would (the
    /// deterministic summarizer on the job's snapshot) and folds each
    /// summary at `time`; returns how many the fold accepted.
    pub fn commit(&mut self, conv: &str, job: &JobIssued, passes: u32, time: u64) -> u32 {
        let Ok(mut snap) = sweep::snapshot(self.conversation(conv), job, &self.policy) else {
            panic!("no snapshot of {conv} for {}", job.job_id);
        };
        let mut accepted = 0;
        for _ in 0..passes {
            let Some(pass) = snap.next_pass() else { break };
            let draft = fallback_summary::summarize(&snap.request(pass, false));
            let rec = snap.record(pass, &draft);
            snap.apply(pass, &rec);
            let e = sweep::summary_event(conv, time, rec);
            if self.fold(&e).status == FoldStatus::Applied {
                accepted += 1;
            }
        }
        accepted
    }

    /// Runs the conversation's pending job in process, as a sweep would:
    /// every pass answered by the deterministic summarizer, marked as a
    /// model's when `model`. A re-summarization the "model" could not do
    /// (fallback again) is not recorded. Returns every decision.
    pub fn run_job(&mut self, conv: &str, model: bool) -> Vec<Envelope> {
        let c = self.conversation(conv);
        let Some(pending) = c.pending_job.clone() else {
            panic!("{conv} has no pending job");
        };
        let Ok(mut snap) = sweep::snapshot(c, &pending.job, &self.policy) else {
            panic!("no snapshot of {conv}");
        };
        let time = c.last_time + 100;
        let mut decisions = Vec::new();
        let mut committed = 0;
        while let Some(pass) = snap.next_pass() {
            let req = snap.request(pass, false);
            let mut draft = fallback_summary::summarize(&req);
            if model {
                draft.fallback = false;
                draft.model = "test-model".into();
                draft.provider = "test".into();
                draft.prompt_version = "model-v1".into();
            } else if matches!(pass, Pass::Resummarize(_)) {
                break;
            }
            let rec = snap.record(pass, &draft);
            if rec.tokens >= rec.source_tokens || committed > 100 {
                break;
            }
            snap.apply(pass, &rec);
            let out = self.fold(&sweep::summary_event(conv, time, rec));
            assert_eq!(out.status, FoldStatus::Applied, "{:?}", out.decisions);
            decisions.extend(out.decisions);
            committed += 1;
        }
        let end = SweepEnded {
            job_id: pending.job.job_id,
            passes: committed.max(1),
            committed,
            stop: if committed > 0 {
                SweepStop::Done
            } else {
                SweepStop::NoProgress
            },
            detail: None,
            calls: 0,
            tokens_spent: 0,
            cost_micros: 0,
            retry_after_ms: None,
        };
        decisions.extend(self.fold(&sweep_ended(end, conv, time + 1)).decisions);
        decisions
    }
}

impl Then<'_> {
    /// The event was applied.
    pub fn then_applied(self) -> Self {
        assert!(
            matches!(self.outcome.status, FoldStatus::Applied),
            "not applied: {:?}",
            self.outcome.status
        );
        self
    }

    /// The event was refused with a rejection of this kind
    /// (`Rejection::kind`, the telemetry label).
    pub fn then_rejected(self, kind: &str) -> Self {
        match &self.outcome.status {
            FoldStatus::Rejected(r) => assert_eq!(r.kind(), kind, "{r}"),
            other => panic!("not rejected ({kind} expected): {other:?}"),
        }
        self
    }

    /// The decisions, by type name, in order.
    pub fn then_decisions(self, types: &[&str]) -> Self {
        let got: Vec<&str> = self
            .outcome
            .decisions
            .iter()
            .map(Envelope::type_name)
            .collect();
        assert_eq!(got, types, "decisions");
        self
    }

    /// Among the decisions, a decision of this type.
    pub fn then_decides(self, type_name: &str) -> Self {
        assert!(
            self.outcome
                .decisions
                .iter()
                .any(|d| d.type_name() == type_name),
            "no {type_name} among {:?}",
            self.outcome
                .decisions
                .iter()
                .map(Envelope::type_name)
                .collect::<Vec<_>>()
        );
        self
    }

    /// The jobs issued.
    pub fn jobs(&self) -> Vec<JobIssued> {
        jobs(&self.outcome.decisions)
    }

    /// `n` jobs issued.
    pub fn then_jobs(self, n: usize) -> Self {
        assert_eq!(self.jobs().len(), n, "jobs issued");
        self
    }

    /// The conversation `key` after the event.
    pub fn conversation(&self, key: &str) -> &Conversation {
        self.test.conversation(key)
    }
}
