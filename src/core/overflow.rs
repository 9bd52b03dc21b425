//! TEMPORARY stub, replaced by the textcore branch.
pub struct ErrorVerdict {
    pub overflow: bool,
    pub requested_tokens: Option<u64>,
    pub limit_tokens: Option<u64>,
    pub token_counts: Vec<u64>,
}
pub fn classify(text: &str) -> ErrorVerdict {
    let t = text.to_lowercase();
    ErrorVerdict {
        overflow: t.contains("context"),
        requested_tokens: None,
        limit_tokens: None,
        token_counts: vec![],
    }
}
