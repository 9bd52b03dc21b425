//! The sweep runner: runs a job's passes against a summarizer under a hard
//! deadline. The deadline cancels the call in flight (its future is
//! dropped), every committed pass is kept, and the sweep ends with an event
//! saying why it stopped.

use crate::core::event::{
    Envelope, EventBody, RollingState, RollingStateUpdated, SweepEnded, SweepStop,
};
use crate::core::summary::{RollingStateRequest, SummaryDraft, SummaryRequest};
use crate::core::sweep::{summary_event, Pass, SweepSnapshot};
use crate::summarizer::DeterministicSummarizer;
use crate::telemetry as t;
use std::future::Future;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// Spend of one summarizer call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spend {
    pub calls: u32,
    pub tokens: u64,
    pub cost_micros: u64,
}

/// Why a pass could not produce a summary.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PassError {
    #[error("rate limited; retry after {retry_after_ms} ms")]
    RateLimited { retry_after_ms: u64, spend: Spend },
    #[error("summarizer failed: {reason}")]
    Failed { reason: String, spend: Spend },
    /// The pass would have needed more calls or tokens than the job's
    /// spend-window allowance had left; nothing over it was spent.
    #[error("the job's spend-window allowance is used up")]
    SpendLimit { spend: Spend },
}

/// What one pass may still spend: the job's spend-window allowance
/// (`JobIssued::max_calls` / `max_tokens`) minus what the sweep has spent.
/// `None` is unlimited (urgent jobs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Allowance {
    pub calls: Option<u32>,
    pub tokens: Option<u64>,
}

/// What the sweep runner needs of a summarizer.
pub trait PassSummarizer: Send + Sync {
    fn summarize(
        &self,
        req: &SummaryRequest,
    ) -> impl Future<Output = Result<(SummaryDraft, Spend), PassError>> + Send;
    fn rolling_state(
        &self,
        req: &RollingStateRequest,
    ) -> impl Future<Output = Result<(RollingState, Spend), PassError>> + Send;

    /// [`Self::summarize`] within `allowance`: a summarizer that spends
    /// must not start a call the allowance cannot pay for, and answers
    /// [`PassError::SpendLimit`] instead. One that never spends ignores it.
    fn summarize_within(
        &self,
        req: &SummaryRequest,
        allowance: Allowance,
    ) -> impl Future<Output = Result<(SummaryDraft, Spend), PassError>> + Send {
        let _ = allowance;
        self.summarize(req)
    }

    /// [`Self::rolling_state`] within `allowance`.
    fn rolling_state_within(
        &self,
        req: &RollingStateRequest,
        allowance: Allowance,
    ) -> impl Future<Output = Result<(RollingState, Spend), PassError>> + Send {
        let _ = allowance;
        self.rolling_state(req)
    }

    /// Spend of the last call cut short by the deadline (its future was
    /// dropped, so it could not report it), taken once. The sweep adds it
    /// to the job's spend: the provider saw those calls.
    fn take_cut_short_spend(&self) -> Spend {
        Spend::default()
    }
}

/// The deterministic summarizer of the core: no model, no spend.
#[derive(Debug, Clone, Copy, Default)]
pub struct Deterministic;

impl PassSummarizer for Deterministic {
    async fn summarize(&self, req: &SummaryRequest) -> Result<(SummaryDraft, Spend), PassError> {
        Ok((
            DeterministicSummarizer::draft_off_runtime(req).await,
            Spend::default(),
        ))
    }
    async fn rolling_state(
        &self,
        req: &RollingStateRequest,
    ) -> Result<(RollingState, Spend), PassError> {
        Ok((
            DeterministicSummarizer::rolling_state_off_runtime(req).await,
            Spend::default(),
        ))
    }
}

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
    S: PassSummarizer,
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
    S: PassSummarizer,
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
    let allowance = |spent: &Spend, snap: &SweepSnapshot| Allowance {
        calls: snap
            .job
            .max_calls
            .map(|max| max.saturating_sub(spent.calls)),
        tokens: snap
            .job
            .max_tokens
            .map(|max| max.saturating_sub(spent.tokens)),
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
        let result = tokio::time::timeout(
            remaining,
            summarizer.summarize_within(&request, allowance(&spent, &snap)),
        )
        .await;
        passes += 1;
        pass_telemetry(&result, pass_started.elapsed());
        match result {
            Err(_) => {
                // The timeout has dropped the pass: its calls are reported
                // here or nowhere.
                add(&mut spent, summarizer.take_cut_short_spend());
                detail = Some(deadline_note());
                break SweepStop::Deadline;
            }
            Ok(Err(PassError::RateLimited {
                retry_after_ms: ms,
                spend,
            })) => {
                add(&mut spent, spend);
                retry_after_ms = Some(ms);
                detail = Some(format!("rate limited; retry after {ms} ms"));
                break if committed == 0 {
                    SweepStop::NoProgress
                } else {
                    SweepStop::SpendLimit
                };
            }
            Ok(Err(PassError::SpendLimit { spend })) => {
                add(&mut spent, spend);
                detail = Some("the spend-window allowance cannot pay for another call".into());
                break SweepStop::SpendLimit;
            }
            Ok(Err(PassError::Failed { reason, spend })) => {
                add(&mut spent, spend);
                detail = Some(reason);
                break SweepStop::Failed;
            }
            Ok(Ok((draft, spend))) => {
                add(&mut spent, spend);
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
            let result = tokio::time::timeout(
                remaining,
                summarizer.rolling_state_within(&req, allowance(&spent, &snap)),
            )
            .await;
            // A rejected answer: the deterministic state is written and
            // the sweep says why (not `done`).
            let result = match result {
                Ok(Err(PassError::Failed { reason, spend })) => {
                    tracing::warn!(%reason, "rolling state answer rejected; writing the deterministic state");
                    if stop == SweepStop::Done {
                        stop = SweepStop::Failed;
                    }
                    let note = format!("rolling state: {reason}");
                    detail = Some(match detail.take() {
                        Some(d) => format!("{d}; {note}"),
                        None => note,
                    });
                    Ok(Ok((
                        DeterministicSummarizer::rolling_state_off_runtime(&req).await,
                        spend,
                    )))
                }
                other => other,
            };
            match result {
                Ok(Ok((state, spend))) => {
                    add(&mut spent, spend);
                    publish(Envelope::new(
                        format!("rs_{job_id}"),
                        conversation.clone(),
                        event_time,
                        EventBody::RollingStateUpdated(RollingStateUpdated {
                            state,
                            through_turn: snap.through_turn,
                            job_id: Some(job_id.clone()),
                        }),
                    ));
                }
                Ok(Err(
                    PassError::RateLimited { spend, .. }
                    | PassError::Failed { spend, .. }
                    | PassError::SpendLimit { spend },
                )) => add(&mut spent, spend),
                Err(_) => add(&mut spent, summarizer.take_cut_short_spend()),
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
        format!("se_{job_id}"),
        conversation,
        event_time,
        EventBody::SweepEnded(ended.clone()),
    ));
    ended
}

/// Counts one summarizer pass: its calls, tokens, cost and latency, by the
/// model that answered (from the configuration) and outcome.
fn pass_telemetry(
    result: &Result<Result<(SummaryDraft, Spend), PassError>, tokio::time::error::Elapsed>,
    elapsed: Duration,
) {
    let (model, outcome, spend) = match result {
        Ok(Ok((draft, spend))) => (
            draft.model.as_str(),
            if draft.fallback { "fallback" } else { "ok" },
            *spend,
        ),
        Ok(Err(PassError::RateLimited { spend, .. })) => ("unknown", "rate_limited", *spend),
        Ok(Err(PassError::SpendLimit { spend })) => ("unknown", "spend_limit", *spend),
        Ok(Err(PassError::Failed { spend, .. })) => ("unknown", "failed", *spend),
        // The cut-short spend is taken (and counted in the sweep) later.
        Err(_) => ("unknown", "deadline", Spend::default()),
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

fn add(total: &mut Spend, s: Spend) {
    total.calls += s.calls;
    total.tokens += s.tokens;
    total.cost_micros += s.cost_micros;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{DebtReason, JobIssued, TurnAppended};
    use crate::core::fold::fold;
    use crate::core::message::{ChatMessage, Role};
    use crate::core::policy::PolicyConfig;
    use crate::core::state::State;

    /// Summarizes deterministically; its rolling-state answers are rejected.
    struct RejectsRolling;

    impl PassSummarizer for RejectsRolling {
        async fn summarize(
            &self,
            req: &SummaryRequest,
        ) -> Result<(SummaryDraft, Spend), PassError> {
            Deterministic.summarize(req).await
        }
        async fn rolling_state(
            &self,
            _req: &RollingStateRequest,
        ) -> Result<(RollingState, Spend), PassError> {
            Err(PassError::Failed {
                reason:
                    "rolling state rejected: copies the prompt's delimiter </data-3f9a1c0b77de>"
                        .into(),
                spend: Spend {
                    calls: 1,
                    ..Spend::default()
                },
            })
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
        let ended = run_sweep(snap, &RejectsRolling, Duration::from_secs(5), |e| {
            out.push(e)
        })
        .await;
        assert_eq!(ended.stop, SweepStop::Failed, "{ended:?}");
        let detail = ended.detail.clone().unwrap_or_default();
        assert!(detail.contains("rolling state rejected"), "{detail}");
        assert_eq!(ended.calls, 1, "the rejected call is spent");
        // The deterministic state is written in its place.
        assert!(out
            .iter()
            .any(|e| matches!(e.body, EventBody::RollingStateUpdated(_))));
    }
}
