//! What a model wrote is checked before it can become a summary, and a bad
//! answer escalates instead of being stored.
//!
//! [`check`] rejects, with a reason: empty text, chain-of-thought or
//! reasoning-only output, a continuation of the conversation (answering the
//! user, role prefixes), output not smaller than its source, and output over
//! `summary_max_overage_factor` x target. [`EscalatingSummarizer`] runs
//! normal -> aggressive (shorter target) -> the deterministic fallback
//! (marked `fallback`), and under the strict identifier policy makes sure
//! every opaque identifier of the source survives: one retry naming the
//! missing ones, then a deterministic "Exact identifiers" section. It never
//! fails a compaction because of identifiers.

use super::deterministic::DeterministicSummarizer;
use super::prompts::{self, EXACT_IDENTIFIERS_HEADING};
use super::{
    CallOutcome, CallRecord, SummarizeError, Summarizer, SummarizerConfig, SummaryOutcome,
};
use crate::core::identifiers;
use crate::core::summary::{IdentifierPolicy, SummaryRequest};
use crate::core::tokens::{count_text, Encoding};
use crate::telemetry;
use regex::Regex;
use std::fmt;
use std::sync::OnceLock;

/// Why a model's text is not a summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    Empty,
    /// Only reasoning (a `<think>` block or a reasoning field) and no summary.
    ReasoningOnly,
    /// Reasoning or self-talk in the text (marker found).
    ChainOfThought(String),
    /// Continues the conversation instead of summarizing it (marker found).
    Continuation(String),
    /// Too short to be a summary of a large source (an obeyed injection
    /// like "OK" looks like this).
    TooShort {
        tokens: u64,
        source_tokens: u64,
    },
    NotSmaller {
        tokens: u64,
        source_tokens: u64,
    },
    Oversized {
        tokens: u64,
        cap: u64,
    },
    /// Cut off by the output cap (finish_reason `length`).
    Truncated,
}

impl Rejection {
    /// The bounded metric label of this rejection.
    pub fn kind(&self) -> &'static str {
        match self {
            Rejection::Empty => "empty",
            Rejection::ReasoningOnly => "reasoning_only",
            Rejection::ChainOfThought(_) => "chain_of_thought",
            Rejection::Continuation(_) => "continuation",
            Rejection::TooShort { .. } => "too_short",
            Rejection::NotSmaller { .. } => "not_smaller",
            Rejection::Oversized { .. } => "oversized",
            Rejection::Truncated => "truncated",
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::Empty => write!(f, "empty summary"),
            Rejection::ReasoningOnly => write!(f, "reasoning only, no summary"),
            Rejection::ChainOfThought(m) => write!(f, "chain-of-thought ({m})"),
            Rejection::Continuation(m) => write!(f, "continues the conversation ({m})"),
            Rejection::TooShort {
                tokens,
                source_tokens,
            } => write!(
                f,
                "too short: {tokens} tokens for a {source_tokens}-token source"
            ),
            Rejection::NotSmaller {
                tokens,
                source_tokens,
            } => write!(
                f,
                "not smaller than its source: {tokens} tokens >= {source_tokens}"
            ),
            Rejection::Oversized { tokens, cap } => {
                write!(f, "oversized: {tokens} tokens > cap {cap}")
            }
            Rejection::Truncated => write!(f, "truncated at the output cap"),
        }
    }
}

/// The output cap for a target: `factor x target`, rounded up.
pub fn output_cap(target_tokens: u64, overage_factor: f64) -> u64 {
    ((target_tokens.max(1) as f64) * overage_factor.max(1.0)).ceil() as u64
}

fn reasoning_block() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"(?is)^\s*<(think|thinking|reasoning|reflection)>.*?</(think|thinking|reasoning|reflection)>\s*")
            .expect("constant regex")
    })
}

fn preamble() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"(?i)^\s*(here is|here's|below is)\b[^\n]{0,60}\bsummary\b[^\n]{0,40}:\s*\n")
            .expect("constant regex")
    })
}

fn role_prefix() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"(?i)^\s*[*_#>\s]*(assistant|user|system|human|ai|tool|model)\s*[*_]*\s*:")
            .expect("constant regex")
    })
}

fn self_talk_line() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(
            r"(?im)^\s*(?:[-*]\s*)?(?:step \d+\s*[:.)-]\s*)?(?:first,? |then,? |next,? |now,? |so,? |okay,? |ok,? |wait,? |hmm,? )?(?:i need to|i should|i will|i'll|i must|i have to|let me|let's|we need to)\b",
        )
        .expect("constant regex")
    })
}

const COT_TAGS: [&str; 8] = [
    "<think>",
    "</think>",
    "<thinking>",
    "</thinking>",
    "<reasoning>",
    "</reasoning>",
    "<reflection>",
    "</reflection>",
];

const COT_OPENINGS: [&str; 16] = [
    "let me think",
    "let me ",
    "let's think",
    "let's start",
    "first, i need to",
    "first i need to",
    "i need to ",
    "okay, so",
    "okay so",
    "ok, so",
    "alright, ",
    "hmm",
    "thinking:",
    "reasoning:",
    "we need to ",
    "to summarize this, i",
];

const CONTINUATION_OPENINGS: [&str; 19] = [
    "sure",
    "certainly",
    "of course",
    "absolutely",
    "i'll ",
    "i will ",
    "i can ",
    "i'd be happy",
    "i would be happy",
    "happy to help",
    "great question",
    "as an ai",
    "thanks",
    "thank you",
    "you're welcome",
    "got it",
    "ok, i",
    "okay, i",
    "no problem",
];

fn starts_with_word(text: &str, opening: &str) -> bool {
    if !text.starts_with(opening) {
        return false;
    }
    // "sure" must not match "surely"; openings ending in a space or
    // punctuation are already delimited.
    match text[opening.len()..].chars().next() {
        None => true,
        Some(c) => !opening.ends_with(|e: char| e.is_alphanumeric()) || !c.is_alphanumeric(),
    }
}

/// Removes what is safe to remove without a new call: a complete leading
/// reasoning block (`<think>...</think>`, as reasoning models emit) and a
/// one-line "Here is the summary:" preamble.
pub fn clean(text: &str) -> String {
    let text = reasoning_block().replace(text, "");
    let text = preamble().replace(&text, "");
    text.trim().to_string()
}

/// Checks a model's answer for `req`; returns the cleaned summary text.
pub fn check(
    req: &SummaryRequest,
    raw: &str,
    encoding: Encoding,
    overage_factor: f64,
) -> Result<String, Rejection> {
    let had_reasoning = reasoning_block().is_match(raw);
    let text = clean(raw);
    if text.is_empty() {
        return Err(if had_reasoning {
            Rejection::ReasoningOnly
        } else {
            Rejection::Empty
        });
    }
    let lower = text.to_lowercase();
    if let Some(tag) = COT_TAGS.iter().find(|t| lower.contains(*t)) {
        return Err(Rejection::ChainOfThought(format!("tag {tag}")));
    }
    if let Some(m) = role_prefix().find(&text) {
        return Err(Rejection::Continuation(format!(
            "role prefix {:?}",
            m.as_str().trim()
        )));
    }
    let opening = lower.trim_start_matches(['*', '#', '>', ' ', '-', '_']);
    if let Some(o) = COT_OPENINGS.iter().find(|o| starts_with_word(opening, o)) {
        return Err(Rejection::ChainOfThought(format!(
            "opens with {:?}",
            o.trim()
        )));
    }
    if let Some(o) = CONTINUATION_OPENINGS
        .iter()
        .find(|o| starts_with_word(opening, o))
    {
        return Err(Rejection::Continuation(format!(
            "opens with {:?}",
            o.trim()
        )));
    }
    let self_talk = self_talk_line().find_iter(&text).count();
    if self_talk >= 2 {
        return Err(Rejection::ChainOfThought(format!(
            "{self_talk} lines of first-person planning"
        )));
    }

    let tokens = count_text(encoding, &text);
    let source_tokens = match req.source_tokens() {
        0 => req
            .sources
            .iter()
            .map(|s| count_text(encoding, &s.text))
            .sum(),
        n => n,
    };
    if tokens >= source_tokens {
        return Err(Rejection::NotSmaller {
            tokens,
            source_tokens,
        });
    }
    let cap = output_cap(req.target_tokens, overage_factor);
    if tokens > cap {
        return Err(Rejection::Oversized { tokens, cap });
    }
    if tokens < 8 && source_tokens >= 200 {
        return Err(Rejection::TooShort {
            tokens,
            source_tokens,
        });
    }
    Ok(text)
}

/// Identifiers of the request's sources (what the strict policy protects).
pub fn source_identifiers(req: &SummaryRequest) -> Vec<String> {
    let mut all = Vec::new();
    for source in &req.sources {
        for id in identifiers::extract(&source.text) {
            if !all.contains(&id) {
                all.push(id);
            }
        }
    }
    all
}

/// The identifiers not found verbatim in `summary`, in source order.
pub fn missing_identifiers(identifiers: &[String], summary: &str) -> Vec<String> {
    identifiers
        .iter()
        .filter(|id| !summary.contains(id.as_str()))
        .cloned()
        .collect()
}

/// Appends the "Exact identifiers" section listing `missing`.
pub fn append_identifiers(summary: &str, missing: &[String]) -> String {
    if missing.is_empty() {
        return summary.to_string();
    }
    let mut out = summary.trim_end().to_string();
    out.push_str("\n\n");
    out.push_str(EXACT_IDENTIFIERS_HEADING);
    out.push(':');
    for id in missing {
        out.push_str("\n- ");
        out.push_str(id);
    }
    out
}

/// Marks the last successful call of a batch as having produced rejected
/// output, so the records say why it was not used.
fn mark_invalid(calls: &mut [CallRecord], reason: &str) {
    if let Some(last) = calls.iter_mut().rev().find(|c| c.outcome.is_ok()) {
        last.outcome = CallOutcome::Invalid(reason.to_string());
    }
}

/// Validation and escalation around another summarizer.
#[derive(Debug)]
pub struct EscalatingSummarizer<S> {
    inner: S,
    overage_factor: f64,
    aggressive_target_factor: f64,
    fallback_on_unavailable: bool,
    name: String,
}

/// What one stage produced.
enum Stage {
    Accepted(SummaryOutcome),
    /// The text was rejected (or the answer unusable): escalate.
    Rejected(String),
    /// No model could answer: go to the fallback if configured.
    Unavailable(String),
}

impl<S: Summarizer> EscalatingSummarizer<S> {
    pub fn new(inner: S, config: &SummarizerConfig) -> Self {
        let name = format!("escalating({})", inner.name());
        EscalatingSummarizer {
            inner,
            overage_factor: config.summary_max_overage_factor,
            aggressive_target_factor: config.aggressive_target_factor,
            fallback_on_unavailable: config.fallback_on_unavailable,
            name,
        }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn aggressive(&self, req: &SummaryRequest) -> SummaryRequest {
        let mut out = req.clone();
        out.aggressive = true;
        out.target_tokens =
            ((req.target_tokens as f64 * self.aggressive_target_factor).round() as u64).max(1);
        out
    }

    /// One call through the inner summarizer plus validation.
    async fn attempt(
        &self,
        req: &SummaryRequest,
        calls: &mut Vec<CallRecord>,
    ) -> Result<Stage, SummarizeError> {
        match self.inner.summarize(req).await {
            Ok(mut outcome) => {
                let encoding = Encoding::for_model(Some(&outcome.draft.model));
                let checked = check(req, &outcome.draft.content, encoding, self.overage_factor);
                match checked {
                    Ok(text) => {
                        outcome.draft.content = text;
                        calls.append(&mut outcome.calls);
                        Ok(Stage::Accepted(outcome))
                    }
                    Err(rejection) => {
                        let reason = rejection.to_string();
                        mark_invalid(&mut outcome.calls, &reason);
                        calls.append(&mut outcome.calls);
                        tracing::warn!(summarizer = %self.inner.name(), %reason, "summary rejected");
                        telemetry::ValidationRejected {
                            kind: rejection.kind(),
                        }
                        .emit();
                        Ok(Stage::Rejected(reason))
                    }
                }
            }
            Err(SummarizeError::Invalid {
                reason,
                calls: mut c,
            }) => {
                calls.append(&mut c);
                telemetry::ValidationRejected { kind: "unusable" }.emit();
                Ok(Stage::Rejected(reason))
            }
            Err(SummarizeError::Unavailable {
                reason,
                calls: mut c,
            }) if self.fallback_on_unavailable => {
                calls.append(&mut c);
                Ok(Stage::Unavailable(reason))
            }
            Err(e) => Err(e),
        }
    }

    /// Under the strict policy: one retry naming the missing identifiers,
    /// then the deterministic section for whatever is still missing.
    async fn keep_identifiers(
        &self,
        req: &SummaryRequest,
        ids: &[String],
        mut outcome: SummaryOutcome,
        calls: &mut Vec<CallRecord>,
    ) -> SummaryOutcome {
        let missing = missing_identifiers(ids, &outcome.draft.content);
        if missing.is_empty() {
            return outcome;
        }
        let retry = prompts::with_missing_identifiers(req, &missing);
        // Any failure of the retry keeps the valid first draft: identifiers
        // are then appended, never a reason to fail.
        if let Ok(Stage::Accepted(better)) = self.attempt(&retry, calls).await {
            let still = missing_identifiers(ids, &better.draft.content);
            if still.len() <= missing.len() {
                outcome.draft = better.draft;
            }
        }
        let still = missing_identifiers(ids, &outcome.draft.content);
        outcome.draft.content = append_identifiers(&outcome.draft.content, &still);
        outcome
    }
}

impl<S: Summarizer> Summarizer for EscalatingSummarizer<S> {
    async fn summarize(&self, req: &SummaryRequest) -> Result<SummaryOutcome, SummarizeError> {
        let strict = req.identifier_policy == IdentifierPolicy::Strict;
        let ids = if strict {
            source_identifiers(req)
        } else {
            Vec::new()
        };
        let mut calls: Vec<CallRecord> = Vec::new();
        let mut why_fallback = String::new();
        for (i, stage_req) in [req.clone(), self.aggressive(req)].into_iter().enumerate() {
            if i > 0 {
                telemetry::Escalated { kind: "aggressive" }.emit();
            }
            let stage = match self.attempt(&stage_req, &mut calls).await {
                Ok(stage) => stage,
                Err(e) => return Err(e.prepend_calls(calls)),
            };
            match stage {
                Stage::Accepted(outcome) => {
                    let mut outcome = if strict {
                        self.keep_identifiers(&stage_req, &ids, outcome, &mut calls)
                            .await
                    } else {
                        outcome
                    };
                    outcome.calls = calls;
                    return Ok(outcome);
                }
                Stage::Rejected(reason) => why_fallback = reason,
                Stage::Unavailable(reason) => {
                    why_fallback = reason;
                    break;
                }
            }
        }
        tracing::warn!(
            conversation_id = %req.conversation,
            reason = %why_fallback,
            "writing the deterministic fallback summary"
        );
        telemetry::Escalated { kind: "fallback" }.emit();
        let mut draft = DeterministicSummarizer::draft(req);
        if strict {
            let still = missing_identifiers(&ids, &draft.content);
            draft.content = append_identifiers(&draft.content, &still);
        }
        Ok(SummaryOutcome { draft, calls })
    }

    fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::SummaryKind;
    use crate::core::message::Role;
    use crate::core::summary::{SourceItem, SummaryDraft};
    use std::collections::VecDeque;
    use std::sync::Mutex;

    fn req(source_text: &str, source_tokens: u64, target: u64) -> SummaryRequest {
        SummaryRequest {
            conversation: "c".into(),
            kind: SummaryKind::Leaf,
            depth: 0,
            sources: vec![SourceItem {
                label: "turn 1".into(),
                role: Some(Role::User),
                tool: None,
                text: source_text.into(),
                tokens: source_tokens,
                time: 0,
            }],
            target_tokens: target,
            previous_summary: None,
            instructions: None,
            custom_instructions: None,
            identifier_policy: IdentifierPolicy::Strict,
            aggressive: false,
        }
    }

    fn ok(text: &str) -> Result<String, Rejection> {
        check(&req("source", 1000, 100), text, Encoding::O200kBase, 3.0)
    }

    #[test]
    fn accepts_a_plain_summary() {
        let s = "The user fixed the expired certificate and redeployed the service.";
        assert_eq!(ok(s).unwrap(), s);
    }

    #[test]
    fn rejects_empty_and_reasoning_only() {
        assert_eq!(ok("   \n"), Err(Rejection::Empty));
        assert_eq!(
            ok("<think>The user wants a summary.</think>\n  "),
            Err(Rejection::ReasoningOnly)
        );
    }

    #[test]
    fn strips_a_complete_leading_think_block_and_preamble() {
        let text = "<think>I should list the decisions.</think>\nHere is the summary:\n\
                    The user pinned openssl 3.0.13 for FIPS mode.";
        assert_eq!(
            ok(text).unwrap(),
            "The user pinned openssl 3.0.13 for FIPS mode."
        );
    }

    #[test]
    fn rejects_chain_of_thought() {
        for text in [
            "Let me think about what matters here. The user...",
            "First, I need to identify the decisions. Then list them.",
            "Okay, so the conversation is about a deploy.",
            "The user deployed. <think>is that right?</think>",
            "The deploy failed on the certificate. <reasoning>why?</reasoning>",
            "Step 1: I need to read the turns.\nStep 2: I will list decisions.\nDone.",
        ] {
            assert!(
                matches!(ok(text), Err(Rejection::ChainOfThought(_))),
                "{text:?} -> {:?}",
                ok(text)
            );
        }
    }

    #[test]
    fn rejects_continuations() {
        for text in [
            "Sure, I'll fix the deploy now.",
            "assistant: I ran the tests.",
            "User: what about the cert?",
            "**Assistant:** done",
            "Certainly! Here's how to renew the certificate.",
            "I'll run the migration next.",
        ] {
            assert!(
                matches!(ok(text), Err(Rejection::Continuation(_))),
                "{text:?} -> {:?}",
                ok(text)
            );
        }
        // A word that merely starts with an opening is fine.
        assert!(ok("Surely enough, the deploy failed on the expired cert.").is_ok());
    }

    #[test]
    fn rejects_not_smaller_and_oversized() {
        let long = "word ".repeat(400);
        let r = check(&req("x", 300, 100), &long, Encoding::O200kBase, 3.0);
        assert!(matches!(r, Err(Rejection::NotSmaller { .. })), "{r:?}");
        let r = check(&req("x", 5000, 100), &long, Encoding::O200kBase, 3.0);
        assert!(
            matches!(r, Err(Rejection::Oversized { cap: 300, .. })),
            "{r:?}"
        );
        // Exactly at the cap is accepted.
        let text = "word ".repeat(300);
        let tokens = count_text(Encoding::O200kBase, text.trim());
        let r = check(&req("x", 5000, tokens), &text, Encoding::O200kBase, 1.0);
        assert!(r.is_ok(), "{r:?}");
    }

    #[test]
    fn rejects_an_obeyed_injection() {
        let r = check(&req("x", 2000, 300), "OK", Encoding::O200kBase, 3.0);
        assert!(matches!(r, Err(Rejection::TooShort { .. })), "{r:?}");
    }

    #[test]
    fn appends_missing_identifiers_in_source_order() {
        let ids = vec![
            "/a/b.rs".to_string(),
            "10.0.0.1:80".into(),
            "abc1234".into(),
        ];
        let missing = missing_identifiers(&ids, "edited /a/b.rs");
        assert_eq!(missing, vec!["10.0.0.1:80", "abc1234"]);
        let out = append_identifiers("edited /a/b.rs", &missing);
        assert_eq!(
            out,
            "edited /a/b.rs\n\nExact identifiers:\n- 10.0.0.1:80\n- abc1234"
        );
        assert!(missing_identifiers(&ids, &out).is_empty());
    }

    /// A summarizer answering from a script, recording the requests.
    struct Scripted {
        answers: Mutex<VecDeque<Result<&'static str, SummarizeError>>>,
        seen: Mutex<Vec<SummaryRequest>>,
    }

    impl Scripted {
        fn new(answers: Vec<Result<&'static str, SummarizeError>>) -> Self {
            Scripted {
                answers: Mutex::new(answers.into()),
                seen: Mutex::new(Vec::new()),
            }
        }
    }

    fn call(outcome: CallOutcome) -> CallRecord {
        CallRecord {
            model: "m".into(),
            provider: "p".into(),
            latency_ms: 1,
            prompt_tokens_provider: Some(10),
            completion_tokens_provider: Some(5),
            prompt_tokens_ours: 10,
            completion_tokens_ours: 5,
            cost_micros: 1,
            outcome,
        }
    }

    impl Summarizer for Scripted {
        async fn summarize(&self, req: &SummaryRequest) -> Result<SummaryOutcome, SummarizeError> {
            self.seen.lock().unwrap().push(req.clone());
            let next = self.answers.lock().unwrap().pop_front();
            match next {
                Some(Ok(text)) => Ok(SummaryOutcome {
                    draft: SummaryDraft {
                        content: text.into(),
                        model: "m".into(),
                        provider: "p".into(),
                        prompt_version: prompts::PROMPT_VERSION.into(),
                        fallback: false,
                    },
                    calls: vec![call(CallOutcome::Ok)],
                }),
                Some(Err(e)) => Err(e),
                None => panic!("script exhausted"),
            }
        }
        fn name(&self) -> &str {
            "scripted"
        }
    }

    fn escalating(
        answers: Vec<Result<&'static str, SummarizeError>>,
    ) -> EscalatingSummarizer<Scripted> {
        EscalatingSummarizer::new(Scripted::new(answers), &SummarizerConfig::default())
    }

    const SOURCE: &str =
        "Deploy of build 9fceb02d0ae5 to 10.0.4.17:8443 failed; see /var/log/app/deploy.log";

    #[tokio::test]
    async fn escalates_normal_then_aggressive_then_fallback() {
        let s = escalating(vec![
            Ok("Let me think about this first."),
            Ok("Sure, I'll help with the deploy."),
        ]);
        let out = s.summarize(&req(SOURCE, 2000, 400)).await.unwrap();
        assert!(out.draft.fallback);
        assert_eq!(out.calls.len(), 2);
        assert!(out
            .calls
            .iter()
            .all(|c| matches!(c.outcome, CallOutcome::Invalid(_))));
        let seen = s.inner.seen.lock().unwrap();
        assert!(!seen[0].aggressive);
        assert!(seen[1].aggressive);
        assert_eq!(seen[1].target_tokens, 200);
        // Strict: the fallback keeps every identifier.
        for id in ["9fceb02d0ae5", "10.0.4.17:8443", "/var/log/app/deploy.log"] {
            assert!(
                out.draft.content.contains(id),
                "{id} in {:?}",
                out.draft.content
            );
        }
    }

    #[tokio::test]
    async fn identifier_retry_names_the_missing_then_appends() {
        let s = escalating(vec![
            Ok("The deploy of build 9fceb02d0ae5 failed."),
            Ok("The deploy of build 9fceb02d0ae5 to 10.0.4.17:8443 failed."),
        ]);
        let out = s.summarize(&req(SOURCE, 2000, 400)).await.unwrap();
        assert!(!out.draft.fallback);
        assert_eq!(out.calls.len(), 2);
        let seen = s.inner.seen.lock().unwrap();
        let retry = seen[1].custom_instructions.as_deref().unwrap();
        assert!(retry.contains("- 10.0.4.17:8443") && retry.contains("- /var/log/app/deploy.log"));
        assert!(!retry.contains("- 9fceb02d0ae5"));
        assert!(out
            .draft
            .content
            .ends_with("Exact identifiers:\n- /var/log/app/deploy.log"));
        assert!(out
            .draft
            .content
            .starts_with("The deploy of build 9fceb02d0ae5 to 10.0.4.17:8443"));
    }

    #[tokio::test]
    async fn a_failed_identifier_retry_keeps_the_first_summary() {
        let s = escalating(vec![
            Ok("The deploy of build 9fceb02d0ae5 failed."),
            Err(SummarizeError::Unavailable {
                reason: "503".into(),
                calls: vec![call(CallOutcome::HttpStatus(503))],
            }),
        ]);
        let out = s.summarize(&req(SOURCE, 2000, 400)).await.unwrap();
        assert!(!out.draft.fallback);
        assert!(out
            .draft
            .content
            .starts_with("The deploy of build 9fceb02d0ae5 failed."));
        assert!(out.draft.content.contains("- 10.0.4.17:8443"));
        assert_eq!(out.calls.len(), 2);
    }

    #[tokio::test]
    async fn off_policy_does_not_retry_for_identifiers() {
        let s = escalating(vec![Ok("The deploy failed on an expired certificate.")]);
        let r = SummaryRequest {
            identifier_policy: IdentifierPolicy::Off,
            ..req(SOURCE, 2000, 400)
        };
        let out = s.summarize(&r).await.unwrap();
        assert_eq!(
            out.draft.content,
            "The deploy failed on an expired certificate."
        );
        assert_eq!(out.calls.len(), 1);
    }

    #[tokio::test]
    async fn auth_and_rate_limits_propagate_without_fallback() {
        let s = escalating(vec![Err(SummarizeError::AuthFailed {
            provider: "p".into(),
            status: 401,
            api_key_env: "K".into(),
            detail: String::new(),
            calls: vec![call(CallOutcome::Auth)],
        })]);
        let err = s.summarize(&req(SOURCE, 2000, 400)).await.unwrap_err();
        assert!(err.is_auth());
        assert_eq!(err.calls().len(), 1);

        let s = escalating(vec![
            Ok("Let me think."),
            Err(SummarizeError::RateLimited {
                provider: "p".into(),
                retry_after_ms: 5000,
                calls: vec![call(CallOutcome::RateLimited)],
            }),
        ]);
        let err = s.summarize(&req(SOURCE, 2000, 400)).await.unwrap_err();
        assert_eq!(err.retry_after_ms(), Some(5000));
        assert_eq!(err.calls().len(), 2, "earlier calls are kept for spend");
    }

    #[tokio::test]
    async fn unavailable_goes_straight_to_the_fallback() {
        let s = escalating(vec![Err(SummarizeError::Unavailable {
            reason: "all models timed out".into(),
            calls: vec![call(CallOutcome::Timeout)],
        })]);
        let out = s.summarize(&req(SOURCE, 2000, 400)).await.unwrap();
        assert!(out.draft.fallback);
        assert_eq!(s.inner.seen.lock().unwrap().len(), 1, "no aggressive retry");
    }
}
