//! Summarizers: the effectful side of compaction. One [`Summarizer`] trait
//! turns a [`SummaryRequest`] into a [`SummaryDraft`], and a
//! [`RollingStateRequest`] into a [`RollingState`], each within the
//! [`Budget`] the caller gives it (the job's spend-window allowance) and
//! charged to that budget call by call.
//!
//! The stack, outermost first:
//! - [`escalate::EscalatingSummarizer`]: checks what the layer below wrote
//!   ([`checks`]) and escalates normal -> aggressive -> the deterministic
//!   summary, for summaries and rolling states alike; a spend refusal
//!   ([`SummarizeError::OverBudget`]) of a pass's first call and a rate
//!   limit pass through it untouched (a spend refusal after a refused
//!   answer ends the pass with the fallback);
//! - [`external::WithFallback`] over [`external::ExternalSummarizer`]: a
//!   team's own summarizer over NATS request/reply, the model when it fails;
//! - [`llm::LlmSummarizer`]: any OpenAI-compatible chat-completions
//!   endpoint, with its own timeouts, retries, rate-limit handling, model
//!   fallback chain and auth circuit breaker; it asks the budget before
//!   every call;
//! - [`deterministic::DeterministicSummarizer`]: no model. Where none is
//!   configured it is the summarizer, and its summaries are final.
//!
//! Deadlines belong to the caller: it drops the future (for example with
//! `tokio::time::timeout`), and dropping cancels the HTTP request in flight.
//! A call cut short that way is charged to the budget as
//! [`CallOutcome::Cancelled`] ([`budget::InFlight`]), so no spend goes
//! unaccounted.

pub mod breaker;
pub mod budget;
pub mod checks;
pub mod config;
pub mod deterministic;
pub mod escalate;
pub mod external;
pub mod floor;
pub mod llm;
pub mod prompts;
pub mod stack;

pub use breaker::{AuthBreakers, Clock, ManualClock, SystemClock};
pub use budget::Budget;
pub use config::{ModelPrice, SummarizerConfig};
pub use deterministic::DeterministicSummarizer;
pub use escalate::EscalatingSummarizer;
pub use external::{ExternalSummarizer, WithFallback};
pub use llm::LlmSummarizer;
pub use prompts::PROMPT_VERSION;

use crate::core::event::RollingState;
use crate::core::summary::{RollingStateRequest, SummaryDraft, SummaryRequest};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::sync::Arc;

/// Writes summaries and rolling states, within a budget.
pub trait Summarizer: Send + Sync {
    /// Summarizes `req`, charging every model call to `budget` and starting
    /// none it cannot pay for. Dropping the future cancels any call in
    /// flight (and charges it as cancelled).
    fn summarize(
        &self,
        req: &SummaryRequest,
        budget: &Budget,
    ) -> impl Future<Output = Result<SummaryOutcome, SummarizeError>> + Send;

    /// Refreshes the rolling session state for `req`, within `budget`.
    fn rolling_state(
        &self,
        req: &RollingStateRequest,
        budget: &Budget,
    ) -> impl Future<Output = Result<RollingOutcome, SummarizeError>> + Send;

    /// A short name for logs and records (`llm`, `deterministic`, ...).
    fn name(&self) -> &str;
}

impl<S: Summarizer> Summarizer for Arc<S> {
    fn summarize(
        &self,
        req: &SummaryRequest,
        budget: &Budget,
    ) -> impl Future<Output = Result<SummaryOutcome, SummarizeError>> + Send {
        (**self).summarize(req, budget)
    }

    fn rolling_state(
        &self,
        req: &RollingStateRequest,
        budget: &Budget,
    ) -> impl Future<Output = Result<RollingOutcome, SummarizeError>> + Send {
        (**self).rolling_state(req, budget)
    }

    fn name(&self) -> &str {
        (**self).name()
    }
}

/// What a summarizer answers with: something written and the calls it
/// took.
pub trait Outcome {
    fn calls_mut(&mut self) -> &mut Vec<CallRecord>;
}

impl Outcome for SummaryOutcome {
    fn calls_mut(&mut self) -> &mut Vec<CallRecord> {
        &mut self.calls
    }
}

impl Outcome for RollingOutcome {
    fn calls_mut(&mut self) -> &mut Vec<CallRecord> {
        &mut self.calls
    }
}

/// A rolling state and the calls spent on it.
#[derive(Debug, Clone, PartialEq)]
pub struct RollingOutcome {
    pub state: RollingState,
    pub calls: Vec<CallRecord>,
    /// The model's answer was refused, and this is why: `state` is the
    /// deterministic one written in its place.
    pub refused: Option<String>,
}

impl RollingOutcome {
    /// A state that cost no call.
    pub fn without_calls(state: RollingState) -> Self {
        RollingOutcome {
            state,
            calls: Vec::new(),
            refused: None,
        }
    }
}

/// A summary and every call spent to write it (including failed attempts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryOutcome {
    pub draft: SummaryDraft,
    pub calls: Vec<CallRecord>,
}

impl SummaryOutcome {
    /// A draft that cost no call.
    pub fn without_calls(draft: SummaryDraft) -> Self {
        SummaryOutcome {
            draft,
            calls: Vec::new(),
        }
    }

    /// Tokens spent by all calls (provider's counts where known, else ours).
    pub fn tokens_spent(&self) -> u64 {
        self.calls.iter().map(CallRecord::tokens).sum()
    }

    pub fn cost_micros(&self) -> u64 {
        self.calls.iter().map(|c| c.cost_micros).sum()
    }
}

/// How one model call ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum CallOutcome {
    /// The model answered (its text may still be rejected: see `Invalid`).
    Ok,
    /// The per-call timeout expired.
    Timeout,
    /// The server answered with this non-success status (5xx, 4xx other
    /// than 401/403/429).
    HttpStatus(u16),
    /// 429: the caller should come back after the Retry-After delay.
    RateLimited,
    /// 401/403: the key was refused.
    Auth,
    /// The answer was unusable: malformed body or rejected summary text.
    Invalid(String),
    /// Could not connect (refused, DNS, TLS, reset before an answer).
    Connect,
    /// The caller dropped the call in flight (its deadline passed).
    Cancelled,
}

impl CallOutcome {
    pub fn is_ok(&self) -> bool {
        matches!(self, CallOutcome::Ok)
    }
}

/// One call to a model, for spend accounting and audit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRecord {
    pub model: String,
    pub provider: String,
    pub latency_ms: u64,
    /// Usage as the provider reported it; `None` when missing or zero.
    pub prompt_tokens_provider: Option<u64>,
    pub completion_tokens_provider: Option<u64>,
    /// Our own counts (the model's BPE, or `o200k_base` when unknown).
    pub prompt_tokens_ours: u64,
    pub completion_tokens_ours: u64,
    /// Cost from the configured price table, in micro-dollars.
    pub cost_micros: u64,
    pub outcome: CallOutcome,
}

impl CallRecord {
    /// Tokens this call spent: the provider's counts where known, else ours.
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens_provider
            .unwrap_or(self.prompt_tokens_ours)
            + self
                .completion_tokens_provider
                .unwrap_or(self.completion_tokens_ours)
    }
}

/// Why no summary was written. Each variant says what the caller should do.
#[derive(Debug, thiserror::Error)]
pub enum SummarizeError {
    /// Every model in the chain was rate limited (or the last one was): put
    /// the job back on the queue with this delay instead of sleeping.
    #[error(
        "rate limited by {provider}: return the job to the queue and retry in {retry_after_ms} ms"
    )]
    RateLimited {
        provider: String,
        retry_after_ms: u64,
        calls: Vec<CallRecord>,
    },
    /// The provider refused the API key (401/403). No fallback summary may
    /// be written for this: fix the key.
    #[error(
        "authentication failed at {provider} (HTTP {status}): check the API key in ${api_key_env}{}",
        detail_suffix(detail)
    )]
    AuthFailed {
        provider: String,
        status: u16,
        api_key_env: String,
        detail: String,
        calls: Vec<CallRecord>,
    },
    /// Repeated auth failures opened the provider's circuit breaker; no call
    /// was made.
    #[error(
        "circuit breaker for {provider} is open after repeated authentication failures: \
         fix the API key; calls resume in {retry_after_ms} ms"
    )]
    BreakerOpen {
        provider: String,
        retry_after_ms: u64,
    },
    /// No model could answer (timeouts, 5xx, connection errors through the
    /// whole chain, or an external summarizer that failed).
    #[error("summarizer unavailable: {reason}")]
    Unavailable {
        reason: String,
        calls: Vec<CallRecord>,
    },
    /// A model answered, but with something that is not a usable summary
    /// (malformed body, no text). Escalation treats it like rejected output.
    #[error("unusable summarizer answer: {reason}")]
    Invalid {
        reason: String,
        calls: Vec<CallRecord>,
    },
    /// The budget cannot pay for the next call (no call left, or the
    /// prompt alone is over the tokens left): nothing over it was spent.
    /// Not a failure of the model: no escalation, no fallback summary.
    #[error(
        "the job's spend-window allowance cannot pay for another call; \
         the work waits for the window to reopen"
    )]
    OverBudget { calls: Vec<CallRecord> },
    /// The summarizer cannot run as configured.
    #[error("summarizer misconfigured: {0}")]
    Config(String),
}

fn detail_suffix(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(" ({detail})")
    }
}

impl SummarizeError {
    /// Calls made before the failure (for spend accounting).
    pub fn calls(&self) -> &[CallRecord] {
        match self {
            SummarizeError::RateLimited { calls, .. }
            | SummarizeError::AuthFailed { calls, .. }
            | SummarizeError::Unavailable { calls, .. }
            | SummarizeError::Invalid { calls, .. }
            | SummarizeError::OverBudget { calls } => calls,
            SummarizeError::BreakerOpen { .. } | SummarizeError::Config(_) => &[],
        }
    }

    /// Takes the calls out (leaving none), to merge them into an outcome.
    pub fn take_calls(&mut self) -> Vec<CallRecord> {
        match self {
            SummarizeError::RateLimited { calls, .. }
            | SummarizeError::AuthFailed { calls, .. }
            | SummarizeError::Unavailable { calls, .. }
            | SummarizeError::Invalid { calls, .. }
            | SummarizeError::OverBudget { calls } => std::mem::take(calls),
            SummarizeError::BreakerOpen { .. } | SummarizeError::Config(_) => Vec::new(),
        }
    }

    /// Puts earlier calls in front of this error's own.
    pub fn prepend_calls(mut self, mut earlier: Vec<CallRecord>) -> Self {
        let own = self.take_calls();
        earlier.extend(own);
        match &mut self {
            SummarizeError::RateLimited { calls, .. }
            | SummarizeError::AuthFailed { calls, .. }
            | SummarizeError::Unavailable { calls, .. }
            | SummarizeError::Invalid { calls, .. }
            | SummarizeError::OverBudget { calls } => *calls = earlier,
            SummarizeError::BreakerOpen { .. } | SummarizeError::Config(_) => {}
        }
        self
    }

    /// When the job should be tried again, if the error says.
    pub fn retry_after_ms(&self) -> Option<u64> {
        match self {
            SummarizeError::RateLimited { retry_after_ms, .. }
            | SummarizeError::BreakerOpen { retry_after_ms, .. } => Some(*retry_after_ms),
            _ => None,
        }
    }

    /// True for failures that must never produce a fallback summary: the
    /// provider refused our credentials.
    pub fn is_auth(&self) -> bool {
        matches!(
            self,
            SummarizeError::AuthFailed { .. } | SummarizeError::BreakerOpen { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(outcome: CallOutcome) -> CallRecord {
        CallRecord {
            model: "m".into(),
            provider: "p".into(),
            latency_ms: 1,
            prompt_tokens_provider: None,
            completion_tokens_provider: Some(7),
            prompt_tokens_ours: 100,
            completion_tokens_ours: 9,
            cost_micros: 3,
            outcome,
        }
    }

    #[test]
    fn tokens_prefer_provider_counts_where_known() {
        assert_eq!(record(CallOutcome::Ok).tokens(), 107);
    }

    #[test]
    fn prepend_keeps_call_order() {
        let err = SummarizeError::Unavailable {
            reason: "x".into(),
            calls: vec![record(CallOutcome::Timeout)],
        };
        let err = err.prepend_calls(vec![record(CallOutcome::HttpStatus(503))]);
        let outcomes: Vec<_> = err.calls().iter().map(|c| c.outcome.clone()).collect();
        assert_eq!(
            outcomes,
            vec![CallOutcome::HttpStatus(503), CallOutcome::Timeout]
        );
    }

    #[test]
    fn messages_say_what_to_do() {
        let err = SummarizeError::AuthFailed {
            provider: "127.0.0.1:1".into(),
            status: 401,
            api_key_env: "MY_KEY".into(),
            detail: String::new(),
            calls: vec![],
        };
        let msg = err.to_string();
        assert!(msg.contains("$MY_KEY"), "{msg}");
        assert!(err.is_auth());
        let err = SummarizeError::RateLimited {
            provider: "p".into(),
            retry_after_ms: 1500,
            calls: vec![],
        };
        assert!(err.to_string().contains("1500 ms"));
        assert_eq!(err.retry_after_ms(), Some(1500));
    }

    #[test]
    fn call_outcome_serializes_in_snake_case() {
        let json = serde_json::to_string(&CallOutcome::HttpStatus(503)).unwrap();
        assert_eq!(json, r#"{"kind":"http_status","detail":503}"#);
        let json = serde_json::to_string(&CallOutcome::RateLimited).unwrap();
        assert_eq!(json, r#"{"kind":"rate_limited"}"#);
    }
}
