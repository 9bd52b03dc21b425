//! The deterministic summarizer: the core's fallback summary behind the
//! [`Summarizer`] trait. It makes no call, cannot fail, and marks its output
//! `fallback` so it is re-summarized by a model later.

use super::{SummarizeError, Summarizer, SummaryOutcome};
use crate::core::fallback_summary;
use crate::core::summary::{SummaryDraft, SummaryRequest};

#[derive(Debug, Clone, Copy, Default)]
pub struct DeterministicSummarizer;

impl DeterministicSummarizer {
    /// The fallback draft for `req`, always marked `fallback`.
    pub fn draft(req: &SummaryRequest) -> SummaryDraft {
        let mut draft = fallback_summary::summarize(req);
        draft.fallback = true;
        draft
    }
}

impl Summarizer for DeterministicSummarizer {
    async fn summarize(&self, req: &SummaryRequest) -> Result<SummaryOutcome, SummarizeError> {
        Ok(SummaryOutcome {
            draft: Self::draft(req),
            calls: Vec::new(),
        })
    }

    fn name(&self) -> &str {
        "deterministic"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::SummaryKind;
    use crate::core::message::Role;
    use crate::core::summary::{IdentifierPolicy, SourceItem};

    #[tokio::test]
    async fn output_is_marked_and_costs_no_call() {
        let req = SummaryRequest {
            conversation: "c".into(),
            kind: SummaryKind::Leaf,
            depth: 0,
            sources: vec![SourceItem {
                label: "turn 1".into(),
                role: Some(Role::User),
                tool: None,
                text: "please rotate the key in /etc/app/key.pem".into(),
                tokens: 12,
                time: 0,
            }],
            target_tokens: 64,
            previous_summary: None,
            instructions: None,
            custom_instructions: None,
            identifier_policy: IdentifierPolicy::Strict,
            aggressive: false,
        };
        let a = DeterministicSummarizer.summarize(&req).await.unwrap();
        let b = DeterministicSummarizer.summarize(&req).await.unwrap();
        assert!(a.draft.fallback);
        assert!(a.calls.is_empty());
        assert!(!a.draft.content.is_empty());
        assert_eq!(a, b, "deterministic");
    }
}
