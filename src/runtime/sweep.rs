//! The sweep runner: runs a job's passes against a summarizer under a hard
//! deadline. The deadline cancels the call in flight (its future is
//! dropped), every committed pass is kept, and the sweep ends with an event
//! saying why it stopped.
//!
//! Each pass gets a [`Budget`]: what the job's spend-window allowance
//! (`JobIssued::max_calls` / `max_tokens`) has left after the passes before
//! it. The summarizer charges every call to it, a call the deadline cut
//! short included, so what the sweep reports spent is read from the budgets
//! alone.

use crate::core::derived_id::DerivedId;
use crate::core::event::{Envelope, EventBody, RollingStateUpdated, SweepEnded, SweepStop};
use crate::core::spend::Spend;
use crate::core::sweep::{summary_event, Pass, SweepSnapshot};
use crate::summarizer::{Budget, SummarizeError, Summarizer, SummaryOutcome};
use crate::telemetry as t;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// Runs `plan` over the snapshot on the blocking pool and hands the
/// snapshot back with its answer: a pass's prompt cuts large sources to
/// excerpts token count by token count, pure CPU that must not hold the
/// async workers ([`crate::blocking`]). The sweep is dropped with a runtime
/// that shuts down before the pool could run it.
async fn planned<R: Send + 'static>(
    snap: SweepSnapshot,
    plan: impl FnOnce(&SweepSnapshot) -> R + Send + 'static,
) -> (SweepSnapshot, R) {
    match crate::blocking::run(move || {
        let answer = plan(&snap);
        (snap, answer)
    })
    .await
    {
        Some(done) => done,
        None => std::future::pending().await,
    }
}

/// Runs one job. `publish` receives each event as soon as it is committed
/// (summaries, the rolling state, and last the `sweep_ended`).
pub async fn run_sweep<S, F>(
    snap: SweepSnapshot,
    summarizer: &S,
    deadline: Duration,
    mut publish: F,
) -> SweepEnded
where
    S: Summarizer,
    F: FnMut(Envelope),
{
    let span = tracing::info_span!("sweep", conversation_id = %snap.conversation, job_id = %snap.job.job_id);
    // Instrumented rather than entered: an entered span guard held across
    // awaits makes the future !Send, and a NATS worker spawns it.
    sweep_in_span(snap, summarizer, deadline, &mut publish)
        .instrument(span)
        .await
}

async fn sweep_in_span<S, F>(
    mut snap: SweepSnapshot,
    summarizer: &S,
    deadline: Duration,
    publish: &mut F,
) -> SweepEnded
where
    S: Summarizer,
    F: FnMut(Envelope),
{
    let started = Instant::now();
    // Events a sweep writes carry the job's issue time (the partition's
    // clock when the fold issued it), never a duration measured here: the
    // log's stored time says when they came, and the same job writes the
    // same events on every run (identical input, identical state hash).
    let event_time = snap.job.issued_at;
    let job_id = snap.job.job_id.clone();
    let conversation = snap.conversation.clone();
    let max_passes = snap.policy.max_sweep_iterations;
    let mut spent = Spend::default();
    let mut passes = 0u32;
    let mut committed = 0u32;
    let mut retry_after_ms = None;
    let mut detail = None;
    let over_budget = |spent: &Spend, snap: &SweepSnapshot| {
        snap.job.max_calls.is_some_and(|max| spent.calls >= max)
            || snap.job.max_tokens.is_some_and(|max| spent.tokens >= max)
    };
    let budget = |spent: &Spend, snap: &SweepSnapshot| {
        Budget::new(
            snap.job
                .max_calls
                .map(|max| max.saturating_sub(spent.calls)),
            snap.job
                .max_tokens
                .map(|max| max.saturating_sub(spent.tokens)),
        )
    };
    let deadline_note = || {
        format!(
            "deadline of {} ms reached; the call in flight was cancelled",
            deadline.as_millis()
        )
    };
    let mut stop = loop {
        if passes >= max_passes {
            break SweepStop::IterationCap;
        }
        if over_budget(&spent, &snap) {
            break SweepStop::SpendLimit;
        }
        let Some(pass) = snap.next_pass() else {
            break SweepStop::Done;
        };
        // A call started with no time left could reach the provider before
        // it is cancelled: spend for nothing.
        let Some(remaining) = deadline
            .checked_sub(started.elapsed())
            .filter(|r| !r.is_zero())
        else {
            detail = Some(format!("deadline of {} ms reached", deadline.as_millis()));
            break SweepStop::Deadline;
        };
        let (back, request) = planned(snap, move |s| s.request(pass, false)).await;
        snap = back;
        let pass_started = Instant::now();
        let pass_budget = budget(&spent, &snap);
        let result =
            tokio::time::timeout(remaining, summarizer.summarize(&request, &pass_budget)).await;
        passes += 1;
        // Every call of the pass, one the deadline cut short included.
        let pass_spend = pass_budget.spent();
        spent = spent + pass_spend;
        pass_telemetry(&result, pass_spend, pass_started.elapsed());
        match result {
            Err(_) => {
                detail = Some(deadline_note());
                break SweepStop::Deadline;
            }
            Ok(Err(SummarizeError::RateLimited {
                retry_after_ms: ms, ..
            })) => {
                retry_after_ms = Some(ms);
                detail = Some(format!("rate limited; retry after {ms} ms"));
                break if committed == 0 {
                    SweepStop::NoProgress
                } else {
                    SweepStop::SpendLimit
                };
            }
            Ok(Err(SummarizeError::OverBudget { .. })) => {
                detail = Some("the spend-window allowance cannot pay for another call".into());
                break SweepStop::SpendLimit;
            }
            // Auth: fix the key; no summary of any kind is written.
            Ok(Err(e)) => {
                detail = Some(e.to_string());
                break SweepStop::Failed;
            }
            Ok(Ok(SummaryOutcome { draft, .. })) => {
                if draft.fallback && matches!(pass, Pass::Resummarize(_)) {
                    // The model failed again and the escalation fell back:
                    // a fallback in place of a fallback is no progress, and
                    // the summary keeps waiting (the fold's backoff applies).
                    detail = Some(
                        "re-summarization fell back to the deterministic summary: no model available"
                            .into(),
                    );
                    break SweepStop::NoProgress;
                }
                let record = snap.record(pass, &draft);
                if record.tokens >= record.source_tokens {
                    detail = Some(format!(
                        "summary of {} tokens is not smaller than its {}-token source",
                        record.tokens, record.source_tokens
                    ));
                    break SweepStop::NoProgress;
                }
                snap.apply(pass, &record);
                committed += 1;
                t::SummaryWritten.emit();
                publish(summary_event(&conversation, event_time, record));
            }
        }
    };
    if stop == SweepStop::Done
        && committed == 0
        && snap.job.compact
        && snap.context_tokens > snap.job.target_tokens
    {
        stop = SweepStop::NoProgress;
        detail.get_or_insert_with(|| "nothing eligible outside the fresh tail".into());
    }
    // The rolling state is refreshed only with time and allowance left, and
    // never after a rate limit or an auth failure (the same provider would
    // refuse it).
    let rolling_allowed = !over_budget(&spent, &snap)
        && !matches!(stop, SweepStop::Deadline | SweepStop::Failed)
        && retry_after_ms.is_none();
    let rolling_request = if rolling_allowed {
        let (back, request) = planned(snap, SweepSnapshot::rolling_request).await;
        snap = back;
        request
    } else {
        None
    };
    if let Some(req) = rolling_request {
        let remaining = deadline.saturating_sub(started.elapsed());
        if !remaining.is_zero() {
            let rolling_budget = budget(&spent, &snap);
            let result =
                tokio::time::timeout(remaining, summarizer.rolling_state(&req, &rolling_budget))
                    .await;
            spent = spent + rolling_budget.spent();
            // A refused answer, a rate limit, no allowance or a deadline
            // leave the state as it was; only a refusal is written in its
            // place (the deterministic state) and said.
            if let Ok(Ok(outcome)) = result {
                if let Some(reason) = &outcome.refused {
                    tracing::warn!(%reason, "rolling state answer refused; writing the deterministic state");
                    if stop == SweepStop::Done {
                        stop = SweepStop::Failed;
                    }
                    let note = format!("rolling state: {reason}");
                    detail = Some(match detail.take() {
                        Some(d) => format!("{d}; {note}"),
                        None => note,
                    });
                }
                publish(Envelope::new(
                    DerivedId::RollingState { job_id: &job_id }.to_string(),
                    conversation.clone(),
                    event_time,
                    EventBody::RollingStateUpdated(RollingStateUpdated {
                        state: outcome.state,
                        through_turn: snap.through_turn,
                        job_id: Some(job_id.clone()),
                    }),
                ));
            }
        }
    }
    t::SweepFinished {
        conversation_id: &conversation,
        job_id: &job_id,
        outcome: stop.as_str(),
        elapsed: started.elapsed(),
        summaries: committed,
    }
    .emit();
    let ended = SweepEnded {
        job_id: job_id.clone(),
        passes,
        committed,
        stop,
        detail,
        calls: spent.calls,
        tokens_spent: spent.tokens,
        cost_micros: spent.cost_micros,
        retry_after_ms,
    };
    tracing::info!(passes, committed, stop = ?stop, "sweep ended");
    publish(Envelope::new(
        DerivedId::SweepEnded { job_id: &job_id }.to_string(),
        conversation,
        event_time,
        EventBody::SweepEnded(ended.clone()),
    ));
    ended
}

/// Counts one summarizer pass: its calls, tokens, cost and latency, by the
/// model that answered (from the configuration) and outcome.
fn pass_telemetry(
    result: &Result<Result<SummaryOutcome, SummarizeError>, tokio::time::error::Elapsed>,
    spend: Spend,
    elapsed: Duration,
) {
    let (model, outcome) = match result {
        Ok(Ok(outcome)) => (
            outcome.draft.model.as_str(),
            if outcome.draft.fallback {
                "fallback"
            } else {
                "ok"
            },
        ),
        Ok(Err(SummarizeError::RateLimited { .. })) => ("unknown", "rate_limited"),
        Ok(Err(SummarizeError::OverBudget { .. })) => ("unknown", "spend_limit"),
        Ok(Err(_)) => ("unknown", "failed"),
        Err(_) => ("unknown", "deadline"),
    };
    t::SummarizerPass {
        model,
        outcome,
        calls: u64::from(spend.calls),
        tokens: spend.tokens,
        cost_micros: spend.cost_micros,
        elapsed,
    }
    .emit();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{DebtReason, JobIssued, TurnAppended};
    use crate::core::fold::fold;
    use crate::core::message::{ChatMessage, Role};
    use crate::core::policy::PolicyConfig;
    use crate::core::state::State;
    use crate::core::summary::{RollingStateRequest, SummaryRequest};
    use crate::summarizer::SummarizeError;
    use crate::summarizer::{
        CallOutcome, CallRecord, DeterministicSummarizer, EscalatingSummarizer, RollingOutcome,
        SummarizerConfig,
    };

    /// Summarizes deterministically; its rolling-state answers fail their
    /// checks (one call spent each).
    struct RejectsRolling;

    impl Summarizer for RejectsRolling {
        async fn summarize(
            &self,
            req: &SummaryRequest,
            budget: &Budget,
        ) -> Result<SummaryOutcome, SummarizeError> {
            DeterministicSummarizer.summarize(req, budget).await
        }
        async fn rolling_state(
            &self,
            _req: &RollingStateRequest,
            budget: &Budget,
        ) -> Result<RollingOutcome, SummarizeError> {
            let call = CallRecord {
                model: "m".into(),
                provider: "p".into(),
                latency_ms: 1,
                prompt_tokens_provider: None,
                completion_tokens_provider: None,
                prompt_tokens_ours: 10,
                completion_tokens_ours: 2,
                cost_micros: 0,
                outcome: CallOutcome::Ok,
            };
            budget.charge(&call);
            Err(SummarizeError::Invalid {
                reason:
                    "rolling state rejected: copies the prompt's delimiter </data-3f9a1c0b77de>"
                        .into(),
                calls: vec![call],
            })
        }
        fn name(&self) -> &str {
            "rejects-rolling"
        }
    }

    #[tokio::test]
    async fn a_rejected_rolling_state_is_reported_not_done() {
        let policy = PolicyConfig::default();
        let mut state = State::default();
        let turn = ChatMessage::text(Role::User, "rotate the key for 10.0.4.17:8443");
        fold(
            &mut state,
            &policy,
            &Envelope::new(
                "t1",
                "c",
                1,
                EventBody::TurnAppended(TurnAppended::from(turn)),
            ),
        );
        let job = JobIssued {
            job_id: "j".into(),
            reason: DebtReason::Manual,
            urgent: false,
            context_tokens: 0,
            target_tokens: 0,
            deadline_ms: 5000,
            issued_at: 2,
            instructions: None,
            compact: false,
            refresh_rolling_state: true,
            max_calls: None,
            max_tokens: None,
        };
        let snap = crate::core::sweep::snapshot(&state.conversations["c"], &job, &policy).unwrap();
        let mut out = Vec::new();
        let stack = EscalatingSummarizer::new(RejectsRolling, &SummarizerConfig::default());
        let ended = run_sweep(snap, &stack, Duration::from_secs(5), |e| out.push(e)).await;
        assert_eq!(ended.stop, SweepStop::Failed, "{ended:?}");
        let detail = ended.detail.clone().unwrap_or_default();
        assert!(detail.contains("rolling state rejected"), "{detail}");
        assert_eq!(ended.calls, 1, "the rejected call is spent");
        // The deterministic state is written in its place.
        assert!(out
            .iter()
            .any(|e| matches!(e.body, EventBody::RollingStateUpdated(_))));
    }

    /// What the scripted summarizer below does with a pass.
    #[derive(Clone, Copy, Debug)]
    enum Answer {
        RateLimited,
        OverBudget,
        AuthFailed,
        /// Starts a call and never ends it: the deadline cuts it short.
        Hangs,
    }

    struct Scripted(Answer);

    fn call() -> CallRecord {
        crate::testing::call_record(CallOutcome::Cancelled)
    }

    impl Summarizer for Scripted {
        async fn summarize(
            &self,
            _: &SummaryRequest,
            budget: &Budget,
        ) -> Result<SummaryOutcome, SummarizeError> {
            match self.0 {
                Answer::OverBudget => Err(SummarizeError::OverBudget { calls: Vec::new() }),
                Answer::Hangs => {
                    let _in_flight = crate::summarizer::budget::InFlight::start(budget, call());
                    std::future::pending().await
                }
                Answer::RateLimited => {
                    budget.charge(&call());
                    Err(SummarizeError::RateLimited {
                        provider: "p".into(),
                        retry_after_ms: 7_000,
                        calls: vec![call()],
                    })
                }
                Answer::AuthFailed => {
                    budget.charge(&call());
                    Err(SummarizeError::AuthFailed {
                        provider: "p".into(),
                        status: 401,
                        api_key_env: "KEY".into(),
                        detail: String::new(),
                        calls: vec![call()],
                    })
                }
            }
        }
        async fn rolling_state(
            &self,
            req: &RollingStateRequest,
            budget: &Budget,
        ) -> Result<RollingOutcome, SummarizeError> {
            DeterministicSummarizer.rolling_state(req, budget).await
        }
        fn name(&self) -> &str {
            "scripted"
        }
    }

    /// How a sweep reads each answer: its stop, its delay, and the spend
    /// the budget was charged (a call the deadline cut short included).
    #[tokio::test]
    async fn each_answer_ends_the_sweep_as_it_should_and_every_charged_call_is_spent() {
        let policy = PolicyConfig {
            fresh_tail_count: 2,
            ..PolicyConfig::default()
        };
        let mut state = State::default();
        for i in 0..12u64 {
            let role = if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            };
            let text =
                format!("turn {i}: the deploy of build {i} to staging failed again ").repeat(20);
            fold(
                &mut state,
                &policy,
                &Envelope::new(
                    format!("t{i}"),
                    "c",
                    1 + i,
                    EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(role, text))),
                ),
            );
        }
        let job = JobIssued {
            job_id: "j".into(),
            reason: DebtReason::Manual,
            urgent: false,
            context_tokens: 0,
            target_tokens: 0,
            deadline_ms: 300,
            issued_at: 20,
            instructions: None,
            compact: true,
            refresh_rolling_state: false,
            max_calls: Some(4),
            max_tokens: None,
        };
        let cases = [
            (Answer::RateLimited, SweepStop::NoProgress, Some(7_000), 1),
            (Answer::OverBudget, SweepStop::SpendLimit, None, 0),
            (Answer::AuthFailed, SweepStop::Failed, None, 1),
            (Answer::Hangs, SweepStop::Deadline, None, 1),
        ];
        for (answer, stop, retry_after_ms, calls) in cases {
            let snap =
                crate::core::sweep::snapshot(&state.conversations["c"], &job, &policy).unwrap();
            let ended =
                run_sweep(snap, &Scripted(answer), Duration::from_millis(300), |_| {}).await;
            assert_eq!(ended.stop, stop, "{answer:?}: {ended:?}");
            assert_eq!(ended.retry_after_ms, retry_after_ms, "{answer:?}");
            assert_eq!(ended.calls, calls, "{answer:?}: calls spent");
            assert_eq!(
                ended.tokens_spent,
                u64::from(calls) * call().tokens(),
                "{answer:?}"
            );
            assert_eq!(ended.committed, 0, "{answer:?}");
        }
    }
}
