//! TEMPORARY stub, replaced by the textcore branch.
use crate::core::event::RollingState;
use crate::core::summary::*;
pub fn summarize(req: &SummaryRequest) -> SummaryDraft {
    let mut content = String::new();
    for s in &req.sources {
        content.push_str(&s.text.chars().take(200).collect::<String>());
        content.push('\n');
    }
    let content: String = content
        .chars()
        .take((req.target_tokens * 3) as usize)
        .collect();
    SummaryDraft {
        content,
        model: "deterministic".into(),
        provider: "contextfold".into(),
        prompt_version: "det-1".into(),
        fallback: true,
    }
}
pub fn rolling_state(_req: &RollingStateRequest) -> RollingState {
    RollingState::default()
}
