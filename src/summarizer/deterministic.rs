//! The deterministic summarizer: the core's summary writer behind the
//! [`Summarizer`] trait. It makes no call and cannot fail. Where no model
//! is configured it is the summarizer, and its summaries are final; where
//! a model failed and the escalation wrote one in its place, the
//! escalation marks that draft `fallback`, to be re-summarized when a
//! model answers again.
//!
//! It is pure CPU work (a 20,000-token leaf is tokenized several times
//! over), so on a runtime it is written on the blocking pool
//! ([`crate::blocking`]).

use super::{Budget, RollingOutcome, SummarizeError, Summarizer, SummaryOutcome};
use crate::core::event::RollingState;
use crate::core::fallback_summary;
use crate::core::summary::{RollingStateRequest, SummaryDraft, SummaryRequest};

#[derive(Debug, Clone, Copy, Default)]
pub struct DeterministicSummarizer;

impl DeterministicSummarizer {
    /// The deterministic draft for `req` (not marked `fallback`: see the
    /// module doc).
    pub fn draft(req: &SummaryRequest) -> SummaryDraft {
        let mut draft = fallback_summary::summarize(req);
        draft.fallback = false;
        draft
    }

    /// [`Self::draft`] on the blocking pool (see the module doc), or in
    /// place, without a copy of the request, where the task's work runs
    /// there ([`crate::blocking::inline_within`]: `run`'s fold).
    pub async fn draft_off_runtime(req: &SummaryRequest) -> SummaryDraft {
        crate::blocking::run_over(req, Self::draft).await
    }

    /// The deterministic rolling state, on the blocking pool (or in place,
    /// as [`Self::draft_off_runtime`]).
    pub async fn rolling_state_off_runtime(req: &RollingStateRequest) -> RollingState {
        crate::blocking::run_over(req, fallback_summary::rolling_state).await
    }
}

impl Summarizer for DeterministicSummarizer {
    async fn summarize(
        &self,
        req: &SummaryRequest,
        _: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        Ok(SummaryOutcome {
            draft: Self::draft_off_runtime(req).await,
            calls: Vec::new(),
        })
    }

    async fn rolling_state(
        &self,
        req: &RollingStateRequest,
        _: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        Ok(RollingOutcome {
            state: Self::rolling_state_off_runtime(req).await,
            calls: Vec::new(),
            refused: None,
        })
    }

    fn name(&self) -> &str {
        "deterministic"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn output_is_final_and_costs_no_call() {
        let req =
            crate::testing::summary_request("please rotate the key in /etc/app/key.pem", 12, 64);
        let budget = Budget::new(Some(0), Some(0));
        let a = DeterministicSummarizer
            .summarize(&req, &budget)
            .await
            .unwrap();
        let b = DeterministicSummarizer
            .summarize(&req, &budget)
            .await
            .unwrap();
        assert!(!a.draft.fallback, "the summarizer's own summary is final");
        assert!(a.calls.is_empty());
        assert!(!a.draft.content.is_empty());
        assert_eq!(a, b, "deterministic");
        assert_eq!(budget.spent(), Default::default(), "no call, in any budget");
    }
}
