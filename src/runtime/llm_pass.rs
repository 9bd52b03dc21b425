//! The bridge from the sweep runner to the summarizers of
//! [`crate::summarizer`]: [`SummarizerPass`] implements [`PassSummarizer`]
//! for any [`Summarizer`], mapping its outcomes to drafts and spend and its
//! errors to what a sweep does next:
//!
//! - a summary -> the draft and the spend of every call it took;
//! - rate limited -> [`PassError::RateLimited`] with the Retry-After delay,
//!   so the fold returns the job with that delay instead of anyone sleeping;
//! - auth failure or open breaker -> [`PassError::Failed`], and never a
//!   fallback summary (the escalation refuses to write one for auth);
//! - anything else -> [`PassError::Failed`].
//!
//! A draft the escalation wrote with the deterministic fallback is marked
//! `fallback`; in a re-summarization pass the sweep records none of it (a
//! fallback cannot replace a fallback) and ends the job without progress.
//!
//! It also owns the two spend guarantees the fold cannot give alone:
//! - [`Gated`] sits between the escalation and the model client and holds
//!   each attempt to the calls the pass's [`Allowance`] has left (every
//!   model of the chain and every retry count), so a job never exceeds its
//!   spend-window allowance, even in the middle of a pass, and an allowance
//!   smaller than an attempt's worst case still buys its calls. It refuses
//!   an attempt only when no call is left or the prompt alone is over the
//!   tokens left;
//! - the client's [`CallLog`] keeps the calls of a pass the deadline cut
//!   short (their futures were dropped), which the sweep adds to the job's
//!   spend: the provider saw them.
//!
//! One adapter runs one pass at a time (the embedded pipeline does); give
//! concurrent sweeps an adapter each so cut-short calls are attributed to
//! the right job.

use crate::core::event::RollingState;
use crate::core::summary::{RollingStateRequest, SummaryDraft, SummaryRequest};
use crate::runtime::sweep::{Allowance, PassError, PassSummarizer, Spend};
use crate::summarizer::external::{ExternalSummarizer, WithFallback};
use crate::summarizer::{
    CallCapped, CallLog, CallRecord, DeterministicSummarizer, EscalatingSummarizer, LlmSummarizer,
    SummarizeError, Summarizer, SummarizerConfig, SummaryOutcome,
};
use std::sync::{Arc, Mutex};

/// Provider name of the error [`Gated`] answers with when it refuses.
const SPEND_WINDOW: &str = "spend window";

/// What is left of a pass's allowance while its attempts run.
#[derive(Debug)]
struct Meter {
    calls_left: Option<u32>,
    tokens_left: Option<u64>,
    /// An attempt was refused for want of allowance.
    refused: bool,
}

impl Meter {
    fn new(allowance: Allowance) -> Self {
        Meter {
            calls_left: allowance.calls,
            tokens_left: allowance.tokens,
            refused: false,
        }
    }

    /// The calls an attempt of at most `calls` calls and a prompt of
    /// `tokens` may make: all of them, or what is left when that is fewer.
    /// `None` (and the refusal noted) when no call is left or the prompt
    /// alone is over the tokens left.
    fn grant(&mut self, calls: u32, tokens: u64) -> Option<u32> {
        let calls = self.calls_left.map_or(calls, |left| left.min(calls));
        let ok = calls > 0 && self.tokens_left.is_none_or(|left| left >= tokens);
        if !ok {
            self.refused = true;
        }
        ok.then_some(calls)
    }

    fn charge(&mut self, calls: &[CallRecord]) {
        let spend = spend_of(calls);
        if let Some(left) = &mut self.calls_left {
            *left = left.saturating_sub(spend.calls);
        }
        if let Some(left) = &mut self.tokens_left {
            *left = left.saturating_sub(spend.tokens);
        }
    }
}

type SharedMeter = Arc<Mutex<Meter>>;

tokio::task_local! {
    /// The allowance of the pass running in this task. A task-local reaches
    /// [`Gated`] through the escalation, whose interface knows nothing of
    /// spend, and keeps concurrent passes apart.
    static METER: SharedMeter;
}

fn with_meter<T>(f: impl FnOnce(&mut Meter) -> T) -> Option<T> {
    METER
        .try_with(|m| f(&mut m.lock().unwrap_or_else(|e| e.into_inner())))
        .ok()
}

/// Spend of a batch of calls: each call counts (the provider saw it, even
/// when it failed or was cancelled), with the provider's token counts where
/// known, else ours.
pub fn spend_of(calls: &[CallRecord]) -> Spend {
    Spend {
        calls: calls.len() as u32,
        tokens: calls.iter().map(CallRecord::tokens).sum(),
        cost_micros: calls.iter().map(|c| c.cost_micros).sum(),
    }
}

/// Tokens an attempt will at least send: its sources and the previous
/// summary given as continuity.
fn prompt_estimate(req: &SummaryRequest) -> u64 {
    req.sources.iter().map(|s| s.tokens).sum::<u64>()
        + req
            .previous_summary
            .as_deref()
            .map_or(0, |p| p.len() as u64 / 4)
}

/// A summarizer that holds each attempt to the calls the running pass's
/// allowance has left, refuses one only when nothing is left, and charges
/// what the attempt spent. Outside a [`SummarizerPass`] (no allowance in
/// scope) it never refuses nor caps.
#[derive(Debug)]
pub struct Gated<S> {
    inner: S,
    calls_per_attempt: u32,
    name: String,
}

impl<S: CallCapped> Gated<S> {
    /// `calls_per_attempt`: the most calls one `inner.summarize` can make.
    pub fn new(inner: S, calls_per_attempt: u32) -> Self {
        let name = format!("gated({})", inner.name());
        Gated {
            inner,
            calls_per_attempt: calls_per_attempt.max(1),
            name,
        }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }
}

/// The most calls one summarize call of an [`LlmSummarizer`] built from
/// `config` can make: every model of the chain, each with all its retries.
pub fn calls_per_attempt(config: &SummarizerConfig) -> u32 {
    (config.model_chain().len() as u32).saturating_mul(1 + config.max_retries)
}

fn refused() -> SummarizeError {
    // Rate limited, because the escalation passes that through untouched:
    // it must neither escalate nor write a fallback over a spend limit.
    SummarizeError::RateLimited {
        provider: SPEND_WINDOW.into(),
        retry_after_ms: 0,
        calls: Vec::new(),
    }
}

impl<S: CallCapped> Summarizer for Gated<S> {
    async fn summarize(&self, req: &SummaryRequest) -> Result<SummaryOutcome, SummarizeError> {
        let estimate = prompt_estimate(req);
        let result = match with_meter(|m| m.grant(self.calls_per_attempt, estimate)) {
            None => self.inner.summarize(req).await,
            Some(None) => return Err(refused()),
            Some(Some(calls)) => self.inner.summarize_capped(req, calls).await,
        };
        let calls = match &result {
            Ok(outcome) => outcome.calls.as_slice(),
            Err(e) => e.calls(),
        };
        with_meter(|m| m.charge(calls));
        result
    }

    fn name(&self) -> &str {
        &self.name
    }
}

/// A [`Summarizer`] as the sweep runner's [`PassSummarizer`].
#[derive(Debug)]
pub struct SummarizerPass<S> {
    summarizer: S,
    /// Writes the rolling session state; `None`: the deterministic one.
    rolling: Option<Arc<LlmSummarizer>>,
    /// Receives every model call as it ends, including cancelled ones.
    call_log: Option<CallLog>,
    rolling_calls: u32,
}

/// The LLM path: validation and escalation over a gated model client.
pub type LlmPass = SummarizerPass<EscalatingSummarizer<Gated<Arc<LlmSummarizer>>>>;

/// The team's external summarizer first; the LLM path (gated, so spend
/// limits hold) when it fails, times out or returns nothing.
pub type ExternalPass = SummarizerPass<
    EscalatingSummarizer<
        WithFallback<ExternalSummarizer<async_nats::Client>, Gated<Arc<LlmSummarizer>>>,
    >,
>;

impl ExternalPass {
    /// The external path for `config` (`summarizer.external` must be set),
    /// asking over `nats`.
    pub fn external(
        config: &SummarizerConfig,
        nats: async_nats::Client,
    ) -> Result<Self, SummarizeError> {
        let Some(external) = &config.external else {
            return Err(SummarizeError::Config(
                "summarizer.external.subject is not set".into(),
            ));
        };
        let call_log = CallLog::new();
        let client = Arc::new(LlmSummarizer::new(config.clone())?.with_call_log(call_log.clone()));
        let gated = Gated::new(client.clone(), calls_per_attempt(config));
        let team = ExternalSummarizer::new(
            nats,
            external.subject.clone(),
            std::time::Duration::from_millis(external.timeout_ms),
        );
        let mut pass = SummarizerPass::new(
            EscalatingSummarizer::new(WithFallback::new(team, gated), config),
            Some(client),
            Some(call_log),
        );
        pass.rolling_calls = calls_per_attempt(config);
        Ok(pass)
    }
}

impl LlmPass {
    /// The LLM path for `config`, with the API key from the environment
    /// variable the config names.
    pub fn llm(config: &SummarizerConfig) -> Result<Self, SummarizeError> {
        Self::with_client(LlmSummarizer::new(config.clone())?, config)
    }

    /// The LLM path with an explicit API key (tests, secrets from elsewhere).
    pub fn llm_with_key(
        config: &SummarizerConfig,
        api_key: impl Into<String>,
    ) -> Result<Self, SummarizeError> {
        Self::with_client(
            LlmSummarizer::with_api_key(config.clone(), api_key)?,
            config,
        )
    }

    /// The LLM path around an existing client (shared breakers, a clock).
    pub fn with_client(
        client: LlmSummarizer,
        config: &SummarizerConfig,
    ) -> Result<Self, SummarizeError> {
        let call_log = CallLog::new();
        let client = Arc::new(client.with_call_log(call_log.clone()));
        let gated = Gated::new(client.clone(), calls_per_attempt(config));
        let mut pass = SummarizerPass::new(
            EscalatingSummarizer::new(gated, config),
            Some(client),
            Some(call_log),
        );
        pass.rolling_calls = calls_per_attempt(config);
        Ok(pass)
    }

    /// The model client (its breakers, its provider name).
    pub fn client(&self) -> Option<&LlmSummarizer> {
        self.rolling.as_deref()
    }
}

impl<S: Summarizer> SummarizerPass<S> {
    /// Any summarizer. For spend limits to hold inside a pass, its model
    /// calls must go through a [`Gated`]; `call_log` must be the one its
    /// client reports to for cut-short calls to be counted.
    pub fn new(
        summarizer: S,
        rolling: Option<Arc<LlmSummarizer>>,
        call_log: Option<CallLog>,
    ) -> Self {
        SummarizerPass {
            summarizer,
            rolling,
            call_log,
            rolling_calls: 1,
        }
    }

    pub fn summarizer(&self) -> &S {
        &self.summarizer
    }

    /// Forgets calls already accounted for (those of finished passes).
    fn start_pass(&self) {
        if let Some(log) = &self.call_log {
            log.drain();
        }
    }

    fn map_error(err: SummarizeError, refused: bool) -> PassError {
        let spend = spend_of(err.calls());
        match err {
            SummarizeError::RateLimited { .. } if refused => PassError::SpendLimit { spend },
            SummarizeError::RateLimited { retry_after_ms, .. } => PassError::RateLimited {
                retry_after_ms,
                spend,
            },
            // Auth: fix the key; no summary of any kind is written.
            other => PassError::Failed {
                reason: other.to_string(),
                spend,
            },
        }
    }
}

impl<S: Summarizer> PassSummarizer for SummarizerPass<S> {
    async fn summarize(&self, req: &SummaryRequest) -> Result<(SummaryDraft, Spend), PassError> {
        self.summarize_within(req, Allowance::default()).await
    }

    async fn rolling_state(
        &self,
        req: &RollingStateRequest,
    ) -> Result<(RollingState, Spend), PassError> {
        self.rolling_state_within(req, Allowance::default()).await
    }

    async fn summarize_within(
        &self,
        req: &SummaryRequest,
        allowance: Allowance,
    ) -> Result<(SummaryDraft, Spend), PassError> {
        self.start_pass();
        let meter: SharedMeter = Arc::new(Mutex::new(Meter::new(allowance)));
        let result = METER
            .scope(meter.clone(), self.summarizer.summarize(req))
            .await;
        let refused = meter.lock().unwrap_or_else(|e| e.into_inner()).refused;
        match result {
            Ok(outcome) => Ok((outcome.draft, spend_of(&outcome.calls))),
            Err(e) => Err(Self::map_error(e, refused)),
        }
    }

    async fn rolling_state_within(
        &self,
        req: &RollingStateRequest,
        allowance: Allowance,
    ) -> Result<(RollingState, Spend), PassError> {
        let Some(llm) = &self.rolling else {
            return Ok((
                DeterministicSummarizer::rolling_state_off_runtime(req).await,
                Spend::default(),
            ));
        };
        self.start_pass();
        let estimate: u64 = req.sources.iter().map(|s| s.tokens).sum();
        let Some(calls) = Meter::new(allowance).grant(self.rolling_calls, estimate) else {
            return Err(PassError::SpendLimit {
                spend: Spend::default(),
            });
        };
        match llm.refresh_rolling_state_capped(req, Some(calls)).await {
            Ok((state, calls)) => Ok((state, spend_of(&calls))),
            Err(e @ SummarizeError::RateLimited { .. }) => Err(Self::map_error(e, false)),
            Err(e) if e.is_auth() => Err(Self::map_error(e, false)),
            // A rejected answer is reported: the sweep writes the
            // deterministic state (better than a stale one) and says why.
            Err(e @ SummarizeError::Invalid { .. }) => Err(PassError::Failed {
                reason: e.to_string(),
                spend: spend_of(e.calls()),
            }),
            // No answer at all (timeouts, 5xx): the deterministic state is
            // still better than a stale one; the calls are spent.
            Err(e) => Ok((
                DeterministicSummarizer::rolling_state_off_runtime(req).await,
                spend_of(e.calls()),
            )),
        }
    }

    fn take_cut_short_spend(&self) -> Spend {
        self.call_log
            .as_ref()
            .map_or_else(Spend::default, |log| spend_of(&log.drain()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::SummaryKind;
    use crate::core::message::Role;
    use crate::core::summary::{IdentifierPolicy, SourceItem};
    use crate::summarizer::CallOutcome;
    use crate::summarizer::DeterministicSummarizer;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn request() -> SummaryRequest {
        SummaryRequest {
            conversation: "c".into(),
            kind: SummaryKind::Leaf,
            depth: 0,
            sources: vec![SourceItem {
                label: "turn 0".into(),
                role: Some(Role::User),
                tool: None,
                text: "we chose to keep the retry budget at three attempts per job ".repeat(20),
                tokens: 240,
                time: 0,
            }],
            target_tokens: 60,
            previous_summary: None,
            instructions: None,
            custom_instructions: None,
            identifier_policy: IdentifierPolicy::Off,
            aggressive: false,
        }
    }

    fn call(outcome: CallOutcome) -> CallRecord {
        CallRecord {
            model: "m".into(),
            provider: "p".into(),
            latency_ms: 1,
            prompt_tokens_provider: Some(100),
            completion_tokens_provider: Some(10),
            prompt_tokens_ours: 90,
            completion_tokens_ours: 9,
            cost_micros: 7,
            outcome,
        }
    }

    /// Answers with a scripted result, counting attempts and keeping the
    /// call cap each was held to.
    struct Scripted {
        attempts: AtomicU32,
        caps: Mutex<Vec<Option<u32>>>,
        answer: fn() -> Result<SummaryOutcome, SummarizeError>,
    }

    impl CallCapped for Scripted {
        async fn summarize_capped(
            &self,
            req: &SummaryRequest,
            max_calls: u32,
        ) -> Result<SummaryOutcome, SummarizeError> {
            let out = self.summarize(req).await;
            if let Some(last) = self.caps.lock().unwrap().last_mut() {
                *last = Some(max_calls);
            }
            out
        }
    }

    impl Summarizer for Scripted {
        async fn summarize(&self, _: &SummaryRequest) -> Result<SummaryOutcome, SummarizeError> {
            self.attempts.fetch_add(1, Ordering::SeqCst);
            self.caps.lock().unwrap().push(None);
            (self.answer)()
        }
        fn name(&self) -> &str {
            "scripted"
        }
    }

    fn good() -> Result<SummaryOutcome, SummarizeError> {
        Ok(SummaryOutcome {
            draft: SummaryDraft {
                content: "The team kept the retry budget at three attempts per job.".into(),
                model: "m".into(),
                provider: "p".into(),
                prompt_version: "v".into(),
                fallback: false,
            },
            calls: vec![call(CallOutcome::Ok)],
        })
    }

    fn pass(
        answer: fn() -> Result<SummaryOutcome, SummarizeError>,
    ) -> SummarizerPass<Gated<Scripted>> {
        let inner = Scripted {
            attempts: AtomicU32::new(0),
            caps: Mutex::new(Vec::new()),
            answer,
        };
        SummarizerPass::new(Gated::new(inner, 2), None, None)
    }

    #[tokio::test]
    async fn a_summary_maps_to_its_draft_and_spend() {
        let p = pass(good);
        let (draft, spend) = p.summarize(&request()).await.unwrap();
        assert!(draft.content.contains("three attempts"));
        assert_eq!(
            spend,
            Spend {
                calls: 1,
                tokens: 110,
                cost_micros: 7
            }
        );
    }

    #[tokio::test]
    async fn the_gate_holds_an_attempt_to_the_calls_left_and_refuses_only_at_none() {
        // Two calls an attempt at worst (see `pass`).
        let p = pass(good);
        let allow = |calls, tokens| Allowance { calls, tokens };
        // No call left: refused before any attempt.
        let err = p
            .summarize_within(&request(), allow(Some(0), None))
            .await
            .unwrap_err();
        assert_eq!(
            err,
            PassError::SpendLimit {
                spend: Spend::default()
            }
        );
        assert_eq!(p.summarizer().inner().attempts.load(Ordering::SeqCst), 0);
        // One call left, under the worst case: the attempt goes, held to it
        // (a window of one call buys that call, issue 10 item 6).
        assert!(p
            .summarize_within(&request(), allow(Some(1), None))
            .await
            .is_ok());
        // More than the worst case: held to the worst case.
        assert!(p
            .summarize_within(&request(), allow(Some(5), Some(1_000)))
            .await
            .is_ok());
        // The prompt alone is over the tokens left: refused.
        assert!(matches!(
            p.summarize_within(&request(), allow(None, Some(100))).await,
            Err(PassError::SpendLimit { .. })
        ));
        // Unlimited (an urgent job): held to the worst case, i.e. no cap.
        assert!(p.summarize(&request()).await.is_ok());
        let inner = p.summarizer().inner();
        assert_eq!(inner.attempts.load(Ordering::SeqCst), 3);
        assert_eq!(*inner.caps.lock().unwrap(), vec![Some(1), Some(2), Some(2)]);
    }

    #[tokio::test]
    async fn rate_limits_carry_their_delay_and_auth_is_a_failure() {
        let p = pass(|| {
            Err(SummarizeError::RateLimited {
                provider: "p".into(),
                retry_after_ms: 7_000,
                calls: vec![call(CallOutcome::RateLimited)],
            })
        });
        match p.summarize(&request()).await.unwrap_err() {
            PassError::RateLimited {
                retry_after_ms,
                spend,
            } => {
                assert_eq!(retry_after_ms, 7_000);
                assert_eq!(spend.calls, 1);
            }
            other => panic!("expected RateLimited, got {other:?}"),
        }
        let p = pass(|| {
            Err(SummarizeError::AuthFailed {
                provider: "p".into(),
                status: 401,
                api_key_env: "KEY".into(),
                detail: String::new(),
                calls: vec![call(CallOutcome::Auth)],
            })
        });
        match p.summarize(&request()).await.unwrap_err() {
            PassError::Failed { reason, spend } => {
                assert!(reason.contains("$KEY"), "{reason}");
                assert_eq!(spend.calls, 1);
            }
            other => panic!("expected Failed, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn the_deterministic_summarizer_through_a_pass_spends_nothing() {
        let p = SummarizerPass::new(DeterministicSummarizer, None, None);
        let (draft, spend) = p.summarize(&request()).await.unwrap();
        assert!(!draft.fallback, "the summarizer, not a fallback");
        assert_eq!(spend, Spend::default());
        assert_eq!(p.take_cut_short_spend(), Spend::default());
    }
}
