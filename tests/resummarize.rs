//! Re-summarization end to end: fallback summaries written while the model
//! was down are replaced by model summaries over exactly the same sources
//! once a model summary shows it is back, through real sweeps
//! (`run_sweep`) whose events are folded like any other.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::api::describe::{describe, DescribeRequest, DescribeResponse, NodeRef};
use contextfold::core::event::*;
use contextfold::core::fallback_summary;
use contextfold::core::fold::FoldStatus;
use contextfold::core::message::ChatMessage;
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::{ContextItem, Resident, Summary};
use contextfold::core::summary::{RollingStateRequest, SummaryRequest};
use contextfold::core::sweep;
use contextfold::runtime::sweep::run_sweep;
use contextfold::summarizer::{Budget, RollingOutcome, SummarizeError, Summarizer, SummaryOutcome};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

const CONV: &str = "c";
use contextfold::testing::{role_of, turn_of, FoldTest, T0};

fn policy() -> PolicyConfig {
    PolicyConfig {
        fresh_tail_count: 4,
        summary_max_calls_per_window: 10_000,
        rolling_every_turns: 1_000_000,
        rolling_tool_loop: 1_000_000,
        rolling_threshold: 1.0,
        ..contextfold::testing::small_policy()
    }
}

/// A model that is down (the escalation falls back to the deterministic
/// summary, as the LLM path does) or up (the same text, as a model's).
#[derive(Default)]
struct Flaky {
    up: AtomicBool,
    calls: AtomicU32,
}

impl Summarizer for Flaky {
    async fn summarize(
        &self,
        req: &SummaryRequest,
        _: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut draft = fallback_summary::summarize(req);
        if self.up.load(Ordering::Relaxed) {
            draft.fallback = false;
            draft.model = "flaky-model".into();
            draft.provider = "test".into();
            draft.prompt_version = "model-v1".into();
            draft.content = draft
                .content
                .replace("[fallback summary]", "[model summary]");
        }
        Ok(SummaryOutcome::without_calls(draft))
    }
    async fn rolling_state(
        &self,
        req: &RollingStateRequest,
        _: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        Ok(RollingOutcome::without_calls(
            fallback_summary::rolling_state(req),
        ))
    }
    fn name(&self) -> &str {
        "flaky"
    }
}

fn turn(i: u64, time: u64) -> Envelope {
    turn_of(
        CONV,
        i,
        time,
        ChatMessage::text(
            role_of(i),
            format!(
                "turn {i}: edited src/mod_{i}.rs; {}",
                "more words ".repeat(60)
            ),
        ),
    )
}

/// The embedded pipeline in miniature, with the summarizer chosen per call:
/// folds an event, then runs every job it issues, folding what the sweep
/// publishes. Returns every event folded and decided.
struct Harness {
    t: FoldTest,
    ran: HashSet<String>,
    log: Vec<Envelope>,
    /// Leave re-summarization jobs pending instead of running them.
    hold_resummarize: bool,
}

impl Harness {
    fn new() -> Harness {
        Harness {
            t: FoldTest::new(policy()),
            ran: HashSet::new(),
            log: Vec::new(),
            hold_resummarize: false,
        }
    }

    fn apply(&mut self, e: Envelope) {
        let out = self.t.fold(&e);
        assert!(
            !matches!(out.status, FoldStatus::Rejected(_)),
            "{:?} rejected: {:?}",
            e.type_name(),
            out
        );
        self.log.push(e);
        self.log.extend(out.decisions);
    }

    async fn settle<S: Summarizer>(&mut self, summarizer: &S) {
        for _ in 0..1000 {
            let conv = &self.t.state.conversations[CONV];
            let Some(p) = conv
                .pending_job
                .as_ref()
                .filter(|p| !self.ran.contains(&p.job.job_id))
            else {
                return;
            };
            if self.hold_resummarize && p.job.reason == DebtReason::Resummarize {
                return;
            }
            self.ran.insert(p.job.job_id.clone());
            let snap = sweep::snapshot(conv, &p.job, &self.t.policy).unwrap();
            let mut out = Vec::new();
            run_sweep(snap, summarizer, Duration::from_secs(60), |e| out.push(e)).await;
            for e in out {
                self.apply(e);
            }
        }
        panic!("jobs did not settle");
    }

    async fn turns<S: Summarizer>(&mut self, range: std::ops::Range<u64>, t: u64, s: &S) {
        for i in range {
            self.apply(turn(i, t + i * 10_000));
            self.settle(s).await;
        }
    }

    fn fallbacks_in_context(&self) -> Vec<Summary> {
        self.t.state.conversations[CONV]
            .fallback_summaries_in_context()
            .cloned()
            .collect()
    }

    fn debts(&self) -> Vec<DebtReason> {
        self.log
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::DebtRecorded(d) | EventBody::DebtUpdated(d) => Some(d.reason),
                _ => None,
            })
            .collect()
    }

    fn resummaries(&self) -> Vec<SummaryRecorded> {
        self.log
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::SummaryRecorded(s) if s.supersedes.is_some() => Some(s.clone()),
                _ => None,
            })
            .collect()
    }

    /// Every fallback in `old` was replaced in context by a model summary
    /// over exactly its sources, and stays in the DAG.
    fn assert_replaced(&self, old: &[Summary]) {
        let conv = &self.t.state.conversations[CONV];
        for x in old {
            let k = conv.summary_index(&x.id).expect("kept in the DAG");
            assert!(!conv.context.contains(&ContextItem::Summary(k)));
            let new = conv
                .summaries
                .iter()
                .find(|s| s.supersedes.as_deref() == Some(x.id.as_str()))
                .unwrap_or_else(|| panic!("{} was not replaced", x.id));
            assert!(!new.fallback);
            assert_eq!(new.model, "flaky-model");
            assert_eq!(
                (new.kind, new.depth, &new.covers),
                (x.kind, x.depth, &x.covers)
            );
            assert_eq!((new.first_turn, new.last_turn), (x.first_turn, x.last_turn));
        }
        let sum: u64 = conv.context.iter().map(|&i| conv.item_tokens(i)).sum();
        assert_eq!(conv.context.tokens(), sum);
        // `describe` links both ways and finds what holds the fallback now.
        for x in old {
            let req = DescribeRequest {
                conversation: CONV.into(),
                id: NodeRef::Id(x.id.clone()),
            };
            let Ok(DescribeResponse::Summary(d)) = describe(&self.t.state, &Resident, &req) else {
                panic!("{} is not described as a summary", x.id);
            };
            let by = d.superseded_by.clone().expect("superseded_by");
            assert!(!d.in_context);
            assert!(d.covered_by.is_some(), "held by {by} or its ancestor");
            let req = DescribeRequest {
                conversation: CONV.into(),
                id: NodeRef::Id(by),
            };
            let Ok(DescribeResponse::Summary(n)) = describe(&self.t.state, &Resident, &req) else {
                panic!("the replacement is not described");
            };
            assert_eq!(n.supersedes.as_deref(), Some(x.id.as_str()));
        }
    }
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime")
        .block_on(f)
}

#[test]
fn fallbacks_written_while_the_model_was_down_are_replaced_when_it_is_back() {
    block_on(async {
        let model = Flaky::default();
        let mut h = Harness::new();
        // Down: the first compaction jobs write fallback summaries.
        h.turns(0..60, T0, &model).await;
        let old = h.fallbacks_in_context();
        assert!(old.len() >= 2, "{} fallbacks", old.len());
        // Condensed ones: their sources are child summaries out of context.
        assert!(old.iter().any(|s| s.kind == SummaryKind::Condensed));
        assert!(!h.debts().contains(&DebtReason::Resummarize));
        // Up: the next compaction's model summary raises the re-summarization,
        // whose job replaces every fallback in context.
        model.up.store(true, Ordering::Relaxed);
        h.turns(60..120, T0, &model).await;
        assert!(h.debts().contains(&DebtReason::Resummarize));
        assert!(h.fallbacks_in_context().is_empty());
        h.assert_replaced(&old);
        assert!(h.resummaries().len() >= old.len());
        assert!(h.t.state.conversations[CONV]
            .debt
            .as_ref()
            .is_none_or(|d| d.reason != DebtReason::Resummarize));
        // The log replays to the same state.
        let mut replayed = FoldTest::new(h.t.policy.clone());
        for e in &h.log {
            replayed.fold(e);
        }
        assert_eq!(replayed.state.hash(), h.t.state.hash());
    });
}

#[test]
fn a_resummarization_that_falls_back_again_records_nothing_and_backs_off() {
    block_on(async {
        let model = Flaky::default();
        let mut h = Harness::new();
        h.turns(0..60, T0, &model).await;
        let old = h.fallbacks_in_context();
        // Up for compaction, but the re-summarization job runs while the
        // model is down again (a down `Flaky` falls back, as the
        // escalation does when its model fails).
        model.up.store(true, Ordering::Relaxed);
        h.hold_resummarize = true;
        let mut i = 60;
        while !h.t.state.conversations[CONV]
            .pending_job
            .as_ref()
            .is_some_and(|p| p.job.reason == DebtReason::Resummarize)
        {
            assert!(i < 200, "no re-summarization job");
            h.apply(turn(i, T0 + i * 10_000));
            h.settle(&model).await;
            i += 1;
        }
        h.hold_resummarize = false;
        let before = h.log.len();
        h.settle(&Flaky::default()).await;
        let after = &h.log[before..];
        assert!(!after.iter().any(|e| matches!(
            &e.body,
            EventBody::SummaryRecorded(s) if s.supersedes.is_some()
        )));
        let end = after
            .iter()
            .find_map(|e| match &e.body {
                EventBody::SweepEnded(s) => Some(s.clone()),
                _ => None,
            })
            .expect("the sweep ended");
        assert_eq!(end.stop, SweepStop::NoProgress, "{end:?}");
        assert_eq!(end.committed, 0);
        let conv = &h.t.state.conversations[CONV];
        assert_eq!(
            conv.debt.as_ref().map(|d| d.reason),
            Some(DebtReason::Resummarize)
        );
        assert!(conv.spend.backoff_until > 0, "routine: backoff applies");
        let backoff_until = conv.spend.backoff_until;
        // Within the backoff, turns issue no job (as long as no compaction
        // is owed).
        h.apply(turn(i, h.t.state.conversations[CONV].last_time + 1_000));
        assert!(h.t.state.conversations[CONV].pending_job.is_none());
        // After it, the model is back: every fallback is replaced.
        h.apply(turn(i + 1, backoff_until + 1));
        h.settle(&model).await;
        assert!(h.fallbacks_in_context().is_empty());
        h.assert_replaced(&old);
    });
}
