//! STUB (summarizer branch): the deterministic fallback summary. The real
//! implementation is written on another branch with this exact signature;
//! the lead keeps that one when merging. This stub is a truncated
//! concatenation of the sources, enough for the summarizer's escalation.

use crate::core::summary::{SummaryDraft, SummaryRequest};

/// Prompt-version tag of deterministic output.
pub const FALLBACK_VERSION: &str = "deterministic-stub-1";

/// A summary made without a model: each source's label and the start of its
/// text, cut to about the target size (4 characters a token).
pub fn summarize(req: &SummaryRequest) -> SummaryDraft {
    let budget_chars = (req.target_tokens.max(16) as usize).saturating_mul(4);
    let per_source = (budget_chars / req.sources.len().max(1)).max(40);
    let mut content = String::new();
    for source in &req.sources {
        if content.len() >= budget_chars {
            break;
        }
        let text: String = source.text.chars().take(per_source).collect();
        let role = source.role.map(|r| r.as_str()).unwrap_or("summary");
        content.push_str(&format!("[{}] {}: {}\n", source.label, role, text.trim()));
    }
    let content: String = content.chars().take(budget_chars).collect();
    SummaryDraft {
        content: content.trim_end().to_string(),
        model: "deterministic".to_string(),
        provider: "contextfold".to_string(),
        prompt_version: FALLBACK_VERSION.to_string(),
        fallback: true,
    }
}
