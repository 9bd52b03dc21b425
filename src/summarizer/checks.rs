//! What a model wrote is checked before it can become a summary or a
//! rolling state.
//!
//! [`check`] rejects, with a reason: empty text, chain-of-thought or
//! reasoning-only output, a continuation of the conversation (answering the
//! user, role prefixes), output not smaller than its source, output over
//! `summary_max_overage_factor` x target, a refusal, a copy of the previous
//! summary or of one source, the prompt's delimiters, the agent's voice, and
//! outcomes no source shows (tests passed, a file edited, or a fix done when
//! the newest edit a tool answered was refused), and
//! [`check_rolling_state`] holds rolling states to the same rules (the
//! deterministic summary's own bar is [`super::floor`]'s). What
//! happens to a refused answer is [`super::escalate`]'s business.

use super::floor::{Below, Floor};
use super::prompts::{self, EXACT_IDENTIFIERS_HEADING};
use crate::core::event::RollingState;
use crate::core::fallback_summary::HandoverFacts;
use crate::core::identifiers;
use crate::core::summary::{RollingStateRequest, SourceItem, SummaryRequest};
use crate::core::tokens::{count_text, Encoding};
use lazy_regex::regex;
use regex::Regex;
use std::fmt;

/// What an answer copied instead of summarizing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Copied {
    /// The previous summary: most of the answer is in it.
    PreviousSummary,
    /// The previous summary restated whole, with something added (the
    /// context would hold it twice).
    PreviousSummaryRestated,
    /// One source, by its label.
    Source(String),
    /// The prompt's own instructions (its section list, its rules).
    Instructions,
}

impl Copied {
    /// Whether the answer echoed the previous summary: the next attempt is
    /// then sent without it.
    pub fn is_previous_summary(&self) -> bool {
        matches!(
            self,
            Copied::PreviousSummary | Copied::PreviousSummaryRestated
        )
    }
}

impl fmt::Display for Copied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Copied::PreviousSummary => write!(f, "the previous summary"),
            Copied::PreviousSummaryRestated => write!(f, "the previous summary, restated in full"),
            Copied::Source(label) => write!(f, "one source ({label})"),
            Copied::Instructions => write!(f, "the prompt's instructions"),
        }
    }
}

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
    /// The model refused the task ("I'm sorry, but I can't assist with
    /// that.") instead of summarizing.
    Refusal(String),
    /// The prompt's data delimiters (`<data-TAG>`, `</data-TAG>`) were
    /// copied into the answer.
    Delimiter(String),
    /// The answer is a copy of the previous summary or of one source, not
    /// a summary of the new span.
    Copy(Copied),
    /// The agent's first-person voice ("I ran ...") that no source has.
    AgentVoice(String),
    /// An outcome (tests passed, a file updated) that no source shows.
    UnsupportedClaim(String),
    /// It misses some of what code can check (the user's requests, the
    /// errors, the decisions, the files changed) that the deterministic
    /// summary of the same sources keeps: a stored model summary is never
    /// worse than the fallback.
    BelowDeterministic {
        kept: usize,
        deterministic: usize,
        missing: Vec<String>,
    },
}

impl From<Below> for Rejection {
    fn from(b: Below) -> Rejection {
        Rejection::BelowDeterministic {
            kept: b.kept,
            deterministic: b.deterministic,
            missing: b.missing,
        }
    }
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
            Rejection::Refusal(_) => "refusal",
            Rejection::Delimiter(_) => "delimiter",
            Rejection::Copy(_) => "copy",
            Rejection::AgentVoice(_) => "agent_voice",
            Rejection::UnsupportedClaim(_) => "unsupported_claim",
            Rejection::BelowDeterministic { .. } => "below_deterministic",
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
            Rejection::Refusal(m) => write!(f, "refusal ({m})"),
            Rejection::Delimiter(m) => write!(f, "copies the prompt's delimiter {m}"),
            Rejection::Copy(m) => write!(f, "copy of {m}"),
            Rejection::AgentVoice(m) => {
                write!(f, "agent voice no source has ({m})")
            }
            Rejection::UnsupportedClaim(m) => {
                write!(f, "claims an outcome no source shows ({m})")
            }
            Rejection::BelowDeterministic {
                kept,
                deterministic,
                missing,
            } => write!(
                f,
                "keeps {kept} of the {deterministic} requests, errors, decisions and files changed the deterministic summary keeps (missing {})",
                missing
                    .iter()
                    .take(3)
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// The output cap for a target: `factor x target`, rounded up.
pub fn output_cap(target_tokens: u64, overage_factor: f64) -> u64 {
    ((target_tokens.max(1) as f64) * overage_factor.max(1.0)).ceil() as u64
}

fn reasoning_block() -> &'static Regex {
    regex!(
        r"(?is)^\s*<(think|thinking|reasoning|reflection)>.*?</(think|thinking|reasoning|reflection)>\s*"
    )
}

fn preamble() -> &'static Regex {
    regex!(r"(?i)^\s*(here is|here's|below is)\b[^\n]{0,60}\bsummary\b[^\n]{0,40}:\s*\n")
}

fn role_prefix() -> &'static Regex {
    regex!(r"(?i)^\s*[*_#>\s]*(assistant|user|system|human|ai|tool|model)\s*[*_]*\s*:")
}

fn self_talk_line() -> &'static Regex {
    regex!(
        r"(?im)^\s*(?:[-*]\s*)?(?:step \d+\s*[:.)-]\s*)?(?:first,? |then,? |next,? |now,? |so,? |okay,? |ok,? |wait,? |hmm,? )?(?:i need to|i should|i will|i'll|i must|i have to|let me|let's|we need to)\b"
    )
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

fn delimiter_tag() -> &'static Regex {
    regex!(r"(?i)</?(?:data|previous-state|previous-summary)-[a-z0-9]*>")
}

fn refusal_phrase() -> &'static Regex {
    regex!(
        r"(?i)\b(?:i'm sorry|i am sorry|sorry, but i|i apologi[sz]e|i (?:can't|cannot|can not|am unable to|'m unable to|won't|will not) (?:assist|help|comply|provide|fulfil|fulfill|do that|summari[sz]e|complete|continue))"
    )
}

fn agent_voice() -> &'static Regex {
    regex!(
        r"(?i)\b(?:i|we) (?:have |had |then |also |just |finally |first |now )?(?:ran|re-?ran|executed|tested|edited|modified|updated|changed|fixed|created|added|implemented|made|wrote|verified|confirmed|checked|applied|replaced|installed|opened|tried|searched)\b"
    )
}

fn tests_passed_claim() -> &'static Regex {
    regex!(
        r"(?i)\b(?:all (?:of )?(?:the )?tests?|the tests?|tests?|the test suite)\s+(?:have |has |now |all |then )*(?:passed|pass|passes|succeeded|are passing|were passing|ran successfully)\b"
    )
}

fn tests_passed_evidence() -> &'static Regex {
    regex!(r"(?i:\bpassed\b|\bpassing\b|\bsucceeded\b|\btests? pass(?:es)?\b)|\bOK\b|\bPASS")
}

fn edit_claim() -> &'static Regex {
    regex!(
        r"(?i)\b(?:has|have|had) (?:now |already |successfully )*been (?:successfully )?(?:updated|edited|modified|changed|fixed|patched|rewritten|applied|resolved|implemented|corrected)\b"
    )
}

fn edit_evidence() -> &'static Regex {
    regex!(
        r"(?i)\b(?:updated|edited|modified|changed|fixed|patched|rewrote|rewritten|applied|resolved|implemented|replaced|wrote|written|corrected)\b"
    )
}

/// A fix told as done: "the error is fixed", "the change was applied".
fn fix_claim() -> &'static Regex {
    regex!(
        r"(?i)\b(?:is|was|were|are|got|gets) (?:now |then |finally |successfully )*(?:fixed|resolved|solved|patched|applied|corrected)\b"
    )
}

/// A tool's answer that an edit was refused (SWE-agent's linter: "E999
/// IndentationError ... Your changes have NOT been applied").
fn edit_refused() -> &'static Regex {
    regex!(
        r"(?i)\b(?:changes|edits?) (?:have|has|were|was) not been applied\b|\bnot been applied\b|\bedit (?:failed|was rejected)\b|\bE999\b"
    )
}

/// Whether the newest tool result that tells an edit's outcome refused it:
/// then no fix or edit is done as of these sources, whatever the assistant
/// said it would change.
fn last_edit_refused(items: &[SourceItem]) -> bool {
    for s in items
        .iter()
        .rev()
        .filter(|s| matches!(s.role, Some(crate::core::message::Role::Tool)))
    {
        // A refusal first: it also says how the edit "would have looked if
        // applied".
        if edit_refused().is_match(&s.text) {
            return true;
        }
        if edit_evidence().is_match(&s.text) {
            return false;
        }
    }
    false
}

/// Lowercased, apostrophes unified, whitespace collapsed.
fn normalize(text: &str) -> String {
    text.replace(['\u{2019}', '\u{2018}'], "'")
        .to_lowercase()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// Word 4-grams of a normalized text (the whole text when shorter).
fn shingles(words: &[&str]) -> std::collections::HashSet<String> {
    if words.len() < 4 {
        return std::iter::once(words.join(" ")).collect();
    }
    words.windows(4).map(|w| w.join(" ")).collect()
}

/// Share of `text`'s 4-grams found in `other` (both normalized).
fn containment(text: &str, other: &str) -> f64 {
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.is_empty() {
        return 0.0;
    }
    let mine = shingles(&words);
    let other_words: Vec<&str> = other.split_whitespace().collect();
    let theirs = shingles(&other_words);
    let shared = mine.iter().filter(|s| theirs.contains(*s)).count();
    shared as f64 / mine.len() as f64
}

/// Of the answer's 4-grams, this share found in the previous summary (or
/// in one source at least half the answer's size) makes it a copy.
const COPY_CONTAINMENT: f64 = 0.9;

/// A copy of the previous summary, or of one source: the answer adds
/// nothing of the span it was asked to summarize.
fn find_copy(req: &SummaryRequest, text: &str) -> Option<Copied> {
    let norm = normalize(&delimiter_tag().replace_all(text, " "));
    if norm.is_empty() {
        return None;
    }
    if let Some(prev) = req.previous_summary.as_deref() {
        let told = normalize(narrative(prev));
        let prev = normalize(prev);
        if !prev.is_empty() && (norm == prev || containment(&norm, &prev) >= COPY_CONTAINMENT) {
            return Some(Copied::PreviousSummary);
        }
        // The previous summary restated whole, with something added: the
        // context would then hold it twice (a real 0.5B model's answer).
        if !prev.is_empty() && containment(&prev, &norm) >= COPY_CONTAINMENT {
            return Some(Copied::PreviousSummaryRestated);
        }
        // Its story restated, whatever identifiers follow it.
        if told.split_whitespace().count() >= 8
            && containment(&told, &normalize(narrative(text))) >= COPY_CONTAINMENT
        {
            return Some(Copied::PreviousSummaryRestated);
        }
    }
    let words = norm.split_whitespace().count();
    for source in &req.sources {
        let src = normalize(&source.text);
        if src.is_empty() {
            continue;
        }
        let same_size = words * 2 >= src.split_whitespace().count();
        if norm == src || (same_size && containment(&norm, &src) >= COPY_CONTAINMENT) {
            return Some(Copied::Source(source.label.clone()));
        }
    }
    None
}

/// Whether a source may show what happened (not a user stating the task).
fn shows_work(source: &SourceItem) -> bool {
    !matches!(source.role, Some(crate::core::message::Role::User))
}

/// Agent voice and claimed outcomes the sources do not contain. The rules
/// are conservative: a phrase a source has verbatim passes, a test result
/// passes when a non-user source shows one, an edit when a tool call or
/// result or a non-user source naming an edit exists, unless the newest
/// edit outcome a tool gave was a refusal: then neither an edit nor a fix
/// ("the error is fixed") passes.
fn find_unsupported(items: &[SourceItem], text: &str) -> Option<Rejection> {
    let norm = normalize(text);
    let sources: Vec<String> = items.iter().map(|s| normalize(&s.text)).collect();
    if let Some(m) = agent_voice().find(&norm) {
        let phrase = m.as_str();
        if !sources.iter().any(|s| s.contains(phrase)) {
            return Some(Rejection::AgentVoice(format!("{phrase:?}")));
        }
    }
    if let Some(m) = tests_passed_claim().find(&norm) {
        let shown = items
            .iter()
            .filter(|s| shows_work(s))
            .any(|s| tests_passed_evidence().is_match(&s.text));
        if !shown {
            return Some(Rejection::UnsupportedClaim(format!("{:?}", m.as_str())));
        }
    }
    if let Some(m) = edit_claim().find(&norm).or_else(|| fix_claim().find(&norm)) {
        if last_edit_refused(items) {
            return Some(Rejection::UnsupportedClaim(format!(
                "{:?} while the last edit in the sources was not applied",
                m.as_str()
            )));
        }
    }
    if let Some(m) = edit_claim().find(&norm) {
        let shown = items.iter().filter(|s| shows_work(s)).any(|s| {
            s.tool.is_some()
                || matches!(s.role, Some(crate::core::message::Role::Tool))
                || edit_evidence().is_match(&s.text)
        });
        if !shown {
            return Some(Rejection::UnsupportedClaim(format!("{:?}", m.as_str())));
        }
    }
    None
}

/// A refusal the sources do not themselves contain.
fn find_refusal(items: &[SourceItem], text: &str) -> Option<String> {
    let norm = normalize(text);
    let m = refusal_phrase().find(&norm)?;
    let phrase = m.as_str();
    let quoted = items.iter().any(|s| normalize(&s.text).contains(phrase));
    (!quoted).then(|| format!("{phrase:?}"))
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
    // A deterministic header copied from the previous summary says nothing
    // of this span and names a summarizer that did not write it.
    let text = crate::core::fallback_summary::header_pattern()
        .replace_all(&clean(raw), "")
        .trim()
        .to_string();
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
    if let Some(m) = delimiter_tag().find(&text) {
        return Err(Rejection::Delimiter(m.as_str().to_string()));
    }
    if let Some(phrase) = find_refusal(&req.sources, &text) {
        return Err(Rejection::Refusal(phrase));
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
    if copies_instructions(&text, &req.sources) {
        return Err(Rejection::Copy(Copied::Instructions));
    }
    if narrative_words(&text) < 3 && source_tokens >= 200 {
        return Err(Rejection::TooShort {
            tokens: count_text(encoding, narrative(&text)),
            source_tokens,
        });
    }
    if let Some(what) = find_copy(req, &text) {
        return Err(Rejection::Copy(what));
    }
    if let Some(rejection) = find_unsupported(&req.sources, &text) {
        return Err(rejection);
    }
    Ok(text)
}

/// A summary's text before its identifier appendix: what it tells.
fn narrative(text: &str) -> &str {
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let bare = line.trim_start_matches(['#', ' ', '*']);
        if bare.starts_with(EXACT_IDENTIFIERS_HEADING) {
            return &text[..at];
        }
        at += line.len();
    }
    text
}

/// The words of [`narrative`] outside headings: a model that wrote only
/// section titles and an identifier list told nothing.
fn narrative_words(text: &str) -> usize {
    narrative(text)
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| l.split_whitespace().count())
        .sum()
}

/// Whether the answer repeats the prompt's instructions instead of
/// following them: anywhere in it (its identifier appendix too), one of the
/// phrases that say what a section holds ([`holds_an_instruction_phrase`]);
/// in its narrative, two lines of the instructions, or a third of it.
fn copies_instructions(text: &str, sources: &[SourceItem]) -> bool {
    static INSTRUCTIONS: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| normalize(&prompts::instructions()));
    if text
        .lines()
        .any(|line| holds_an_instruction_phrase(line, sources))
    {
        return true;
    }
    let (mut lines, mut copied, mut total) = (0, 0, 0);
    for line in narrative(text).lines() {
        let norm = normalize(line);
        let words = norm.split_whitespace().count();
        total += words;
        if words >= 6 && containment(&norm, &INSTRUCTIONS) >= COPY_CONTAINMENT {
            lines += 1;
            copied += words;
        }
    }
    lines >= 2 || (copied > 0 && copied * 3 >= total)
}

/// Whether `line` holds, word for word (case, punctuation and spacing
/// aside), a clause of five words or more of one of the prompts' phrases
/// for what a section holds ([`prompts::instruction_phrases`]), such as
/// "each error or failure and how it was fixed" or "the user's current
/// request, in the user's words", that no source has: no summary of real
/// turns says that unless the turns do.
fn holds_an_instruction_phrase(line: &str, sources: &[SourceItem]) -> bool {
    // Each clause as " words ": found only at word boundaries.
    static CLAUSES: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(|| {
        prompts::instruction_phrases()
            .flat_map(|p| p.split(['(', ')']))
            .map(words_only)
            .filter(|c| c.split(' ').count() >= 5)
            .map(|c| format!(" {c} "))
            .collect()
    });
    let line = format!(" {} ", words_only(line));
    CLAUSES
        .iter()
        .filter(|c| line.contains(c.as_str()))
        .any(|c| {
            !sources
                .iter()
                .any(|s| format!(" {} ", words_only(&s.text)).contains(c.as_str()))
        })
}

/// [`normalize`]d words (letters, digits, apostrophes), punctuation
/// dropped, joined by one space.
fn words_only(text: &str) -> String {
    normalize(text)
        .split(|c: char| !(c.is_alphanumeric() || c == '\''))
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Checks a rolling-state answer like a summary: no delimiters, reasoning
/// tags, refusals, role prefixes, copies of one source or of the prompt
/// (`prompt_text`), agent voice or outcomes the sources do not show.
pub fn check_rolling_state(
    req: &RollingStateRequest,
    prompt_text: &str,
    state: &RollingState,
) -> Result<(), Rejection> {
    let text = prompts::format_rolling_state(state);
    if let Some(m) = delimiter_tag().find(&text) {
        return Err(Rejection::Delimiter(m.as_str().to_string()));
    }
    let lower = text.to_lowercase();
    if let Some(tag) = COT_TAGS.iter().find(|t| lower.contains(*t)) {
        return Err(Rejection::ChainOfThought(format!("tag {tag}")));
    }
    if let Some(phrase) = find_refusal(&req.sources, &text) {
        return Err(Rejection::Refusal(phrase));
    }
    let prompt = normalize(prompt_text);
    for section in [
        &state.completed,
        &state.in_progress,
        &state.decisions,
        &state.blockers,
        &state.next,
    ] {
        if let Some(m) = role_prefix().find(section) {
            return Err(Rejection::Continuation(format!(
                "role prefix {:?}",
                m.as_str().trim()
            )));
        }
        if holds_an_instruction_phrase(section, &req.sources) {
            return Err(Rejection::Copy(Copied::Instructions));
        }
        let norm = normalize(section);
        // Short sections ("none", a file name) may match anything.
        if norm.split_whitespace().count() < 12 {
            continue;
        }
        if containment(&norm, &prompt) >= COPY_CONTAINMENT {
            return Err(Rejection::Copy(Copied::Instructions));
        }
        if let Some(source) = req
            .sources
            .iter()
            .find(|s| containment(&norm, &normalize(&s.text)) >= COPY_CONTAINMENT)
        {
            return Err(Rejection::Copy(Copied::Source(source.label.clone())));
        }
    }
    // What the previous state told is shown too: a model that carries its
    // "All 386 tests pass" forward claims nothing new.
    let mut shown: Vec<SourceItem> = Vec::with_capacity(req.sources.len() + 1);
    if let Some(previous) = &req.previous {
        shown.push(SourceItem {
            label: "previous state".into(),
            role: None,
            tool: None,
            text: prompts::format_rolling_state(previous),
            tokens: 0,
            time: 0,
            ..SourceItem::default()
        });
    }
    shown.extend(req.sources.iter().cloned());
    if let Some(rejection) = find_unsupported(&shown, &text) {
        return Err(rejection);
    }
    // Never below the deterministic update of the same state and turns:
    // the facts of the turns, and those the previous state carried.
    let deterministic = crate::core::fallback_summary::rolling_state(req);
    let mut facts = HandoverFacts::of(&req.sources);
    if let Some(previous) = &req.previous {
        facts.extend(HandoverFacts::carried_by(previous));
    }
    Floor::of_facts(facts, &prompts::format_rolling_state(&deterministic))
        .check(&text)
        .map_err(Rejection::from)
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

/// The identifiers of the request's sources that `deterministic` (the
/// deterministic summary of the same request) keeps, in the order it
/// names them: it ranked them (touched by an edit, named by the user,
/// named often) and fitted them to the target, so a model's summary is
/// held to those, not to every path a listing printed.
pub fn deterministic_identifiers(req: &SummaryRequest, deterministic: &str) -> Vec<String> {
    let mut kept: Vec<(usize, String)> = source_identifiers(req)
        .into_iter()
        .filter_map(|id| deterministic.find(id.as_str()).map(|at| (at, id)))
        .collect();
    kept.sort_by_key(|(at, _)| *at);
    kept.into_iter().map(|(_, id)| id).collect()
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

/// [`append_identifiers`] within room: the summary with the section stays
/// under `max_tokens` (the source's size, and the most a summary of it may
/// be), identifiers taken in the order given (the most important first)
/// while they fit, and the rest counted in one closing line: they stay in
/// the log, where `grep` and `expand` reach them. A section that made the
/// summary as large as its source would make the pass fail as no progress,
/// for ever (every retry writes the same section).
pub fn append_identifiers_within(summary: &str, missing: &[String], max_tokens: u64) -> String {
    let whole = append_identifiers(summary, missing);
    if missing.is_empty() || count_text(Encoding::O200kBase, &whole) <= max_tokens {
        return whole;
    }
    let base = summary.trim_end();
    let mut used = count_text(Encoding::O200kBase, base) + 16;
    let mut kept = Vec::new();
    for id in missing {
        let cost = count_text(Encoding::O200kBase, id) + 2;
        if used + cost > max_tokens {
            break;
        }
        used += cost;
        kept.push(id.clone());
    }
    let left = missing.len() - kept.len();
    let mut out = append_identifiers(base, &kept);
    if kept.is_empty() {
        return base.to_string();
    }
    out.push_str(&format!(
        "\n- ({left} more identifiers of these turns are in the log: `grep` finds them)"
    ));
    out
}

/// Whether a retry's text is a better summary than the first draft's: it
/// keeps strictly more of the source's identifiers, loses none the first
/// kept, and is not collapsed to under half the first draft's words (a
/// terse answer that names identifiers but drops the story is worse). A
/// tie keeps the first.
pub fn retry_is_better(ids: &[String], first: &str, retry: &str) -> bool {
    let first_missing = missing_identifiers(ids, first);
    let retry_missing = missing_identifiers(ids, retry);
    let loses_kept = ids
        .iter()
        .any(|id| first.contains(id.as_str()) && !retry.contains(id.as_str()));
    let first_words = first.split_whitespace().count();
    let retry_words = retry.split_whitespace().count();
    retry_missing.len() < first_missing.len() && !loses_kept && retry_words * 2 >= first_words
}

/// The bounded label of an answer the summarizer found unusable before
/// any text check (the reason strings of `llm.rs`).
pub fn unusable_kind(reason: &str) -> &'static str {
    if reason.contains("finish_reason length") {
        "truncated"
    } else if reason.contains("reasoning only") {
        "reasoning_only"
    } else if reason.contains("refused") {
        "refusal"
    } else if reason.contains("rolling state") {
        "rolling_state_unparsed"
    } else {
        "unusable"
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::core::event::SummaryKind;
    use crate::core::message::Role;

    use crate::core::summary::SourceItem;

    pub(crate) fn req(source_text: &str, source_tokens: u64, target: u64) -> SummaryRequest {
        crate::testing::summary_request(source_text, source_tokens, target)
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

    pub(crate) const SOURCE: &str =
        "Deploy of build 9fceb02d0ae5 to 10.0.4.17:8443 failed; see /var/log/app/deploy.log";

    // Fixtures below are a real small model's answers (Qwen2.5-Coder-0.5B,
    // issue 14 "What a real model showed").
    pub(crate) const REFUSAL: &str = "I'm sorry, but I can't assist with that.";
    pub(crate) const PREVIOUS: &str =
        "The user asked to fix the DICOM transfer syntax handling in \
        pydicom so that explicit VR little endian files are read correctly; the assistant \
        opened the reader module and looked at how the syntax UID is compared.";

    pub(crate) fn with_previous(previous: &str) -> SummaryRequest {
        SummaryRequest {
            previous_summary: Some(previous.into()),
            ..req(
                "The assistant searched for the transfer syntax constant and found it in \
                 pydicom/uid.py next to the other syntax UIDs.",
                1000,
                100,
            )
        }
    }

    #[test]
    fn rejects_a_refusal_unless_a_source_has_it() {
        assert!(
            matches!(ok(REFUSAL), Err(Rejection::Refusal(_))),
            "{:?}",
            ok(REFUSAL)
        );
        assert!(matches!(
            ok("I am sorry, I cannot help with summarizing this conversation."),
            Err(Rejection::Refusal(_))
        ));
        assert_eq!(Rejection::Refusal("x".into()).kind(), "refusal");
        // A source that is itself a refusal may be reported.
        let r = req(
            "assistant: I'm sorry, but I can't assist with that. The user then rephrased.",
            1000,
            100,
        );
        let text = "The assistant first answered \"I'm sorry, but I can't assist with that.\"; \
                    the user rephrased the request about the deploy.";
        assert!(check(&r, text, Encoding::O200kBase, 3.0).is_ok());
    }

    #[test]
    fn rejects_a_copy_of_the_previous_summary_with_the_closing_delimiter() {
        let r = with_previous(PREVIOUS);
        let answer = format!("{PREVIOUS}\n</data-3f9a1c0b77de>");
        let got = check(&r, &answer, Encoding::O200kBase, 3.0);
        assert!(matches!(got, Err(Rejection::Delimiter(_))), "{got:?}");
        // Without the delimiter it is still a copy.
        let got = check(&r, PREVIOUS, Encoding::O200kBase, 3.0);
        assert_eq!(got, Err(Rejection::Copy(Copied::PreviousSummary)));
        // A summary of the new span that continues from the previous passes.
        let text = "Continuing the DICOM fix, the assistant found the transfer syntax \
                    constant in pydicom/uid.py beside the other syntax UIDs.";
        assert!(check(&r, text, Encoding::O200kBase, 3.0).is_ok());
    }

    /// Qwen2.5-Coder-0.5B's leaf over pydicom turn 2 (real-model eval):
    /// the previous leaf's paragraph word for word, then one of its own.
    #[test]
    fn rejects_an_answer_that_restates_the_previous_summary() {
        const QWEN_PREVIOUS: &str = "The conversation segment discusses how to correctly use \
            the special interface to solve a timeDelta serialization precision issue in a \
            Python project. The user is provided with a demonstration of how to reproduce \
            the bug and submit their changes to the code base.";
        let r = with_previous(QWEN_PREVIOUS);
        let answer = format!(
            "{QWEN_PREVIOUS}\n\nThe conversation segment also includes instructions on how \
             to solve this issue on your own. The user is re-implementing the bug in their \
             environment and running the bug reproduction script to make sure that the bug \
             has indeed been fixed."
        );
        let got = check(&r, &answer, Encoding::O200kBase, 3.0);
        assert_eq!(got, Err(Rejection::Copy(Copied::PreviousSummaryRestated)));
        // Naming the previous summary's subject again is not a restatement.
        let text = "Continuing the timeDelta precision fix, the assistant opened \
                    pydicom/valuerep.py and found the rounding in the DSfloat constructor.";
        assert!(check(&r, text, Encoding::O200kBase, 3.0).is_ok());
    }

    #[test]
    fn rejects_a_copy_of_one_source() {
        // A depth-1 summary byte-identical to the last leaf it condenses.
        let mut r = req(
            "The first leaf: the user reported the crash on startup.",
            60,
            40,
        );
        r.kind = SummaryKind::Condensed;
        r.depth = 1;
        r.sources.push(SourceItem {
            label: "summary sum_2".into(),
            role: None,
            tool: None,
            text: PREVIOUS.into(),
            tokens: 60,
            time: 0,
            ..SourceItem::default()
        });
        let got = check(&r, PREVIOUS, Encoding::O200kBase, 3.0);
        assert_eq!(
            got,
            Err(Rejection::Copy(Copied::Source("summary sum_2".into())))
        );
        assert_eq!(got.unwrap_err().kind(), "copy");
    }

    #[test]
    fn rejects_agent_voice_and_outcomes_the_sources_do_not_show() {
        // Sources that only state the task.
        let task = req(
            "<pr_description>Reading a file with transfer syntax 1.2.840.10008.1.2.1 \
             raises KeyError.</pr_description> Can you help me implement the necessary \
             changes to the repository so that the requirements are met?",
            2000,
            300,
        );
        let ran = "After making these changes, I ran the reproduce script to confirm the \
                   fix. All the tests passed.";
        let got = check(&task, ran, Encoding::O200kBase, 3.0);
        assert!(matches!(got, Err(Rejection::AgentVoice(_))), "{got:?}");
        let passed = "The reproduce script was run after the change. All the tests passed.";
        let got = check(&task, passed, Encoding::O200kBase, 3.0);
        assert!(
            matches!(got, Err(Rejection::UnsupportedClaim(_))),
            "{got:?}"
        );
        let updated = "The file has been updated to handle the explicit VR little endian \
                       transfer syntax.";
        let got = check(&task, updated, Encoding::O200kBase, 3.0);
        assert!(
            matches!(got, Err(Rejection::UnsupportedClaim(_))),
            "{got:?}"
        );
        assert_eq!(got.unwrap_err().kind(), "unsupported_claim");
    }

    /// Qwen2.5-Coder-0.5B's leaf over marshmallow-1867 turns 14-15 (real-model
    /// eval): the assistant proposed an edit, the linter refused it (E999),
    /// and the summary said the error was fixed.
    #[test]
    fn rejects_a_fix_claimed_over_a_refused_edit() {
        let mut r = req("Fix the TimeDelta rounding in marshmallow.", 2000, 300);
        r.sources.push(SourceItem {
            label: "turn 14".into(),
            role: Some(Role::Assistant),
            tool: Some("edit".into()),
            text: "To fix this issue, we should ensure that the division results in a float, \
                   and then round the result to the nearest integer before converting it to an \
                   int. Let's make the necessary edit to the code."
                .into(),
            tokens: 60,
            time: 0,
            ..SourceItem::default()
        });
        let refused = SourceItem {
            label: "turn 15".into(),
            role: Some(Role::Tool),
            tool: Some("edit".into()),
            text: "Your proposed edit has introduced new syntax error(s). Please read this error \
                   message carefully and then retry editing the file.\n\nERRORS:\n- E999 \
                   IndentationError: unexpected indent\n\nThis is how your edit would have \
                   looked if applied\n...\nYour changes have NOT been applied. Please fix your \
                   edit command and try again."
                .into(),
            tokens: 80,
            time: 0,
            ..SourceItem::default()
        };
        r.sources.push(refused.clone());
        const QWEN: &str = "The conversation segment below introduces a new syntax error in the \
            `fields.py` file, which prevents the rounding of milliseconds precision. The error \
            is fixed by ensuring that the division results in a float and then rounding the \
            result to the nearest integer before converting it to an int. This ensures that \
            the milliseconds precision is preserved as expected.";
        let got = check(&r, QWEN, Encoding::O200kBase, 3.0);
        assert!(
            matches!(&got, Err(Rejection::UnsupportedClaim(m)) if m.contains("not applied")),
            "{got:?}"
        );
        let edited = "The file has been updated to round the division.";
        assert!(check(&r, edited, Encoding::O200kBase, 3.0).is_err());
        // Telling the refusal as it was passes.
        let told = "The assistant proposed rounding the division in `fields.py`; the edit \
                    was refused with E999 IndentationError and not applied.";
        let got = check(&r, told, Encoding::O200kBase, 3.0);
        assert!(got.is_ok(), "{got:?}");
        // A later edit the tool accepted makes the fix true.
        r.sources.push(SourceItem {
            label: "turn 17".into(),
            text: "File updated. Please review the changes and make sure they are correct.".into(),
            ..refused
        });
        let got = check(&r, QWEN, Encoding::O200kBase, 3.0);
        assert!(got.is_ok(), "{got:?}");
    }

    #[test]
    fn accepts_outcomes_the_sources_show() {
        let mut r = req(
            "Fix the KeyError for transfer syntax 1.2.840.10008.1.2.1.",
            2000,
            300,
        );
        r.sources.push(SourceItem {
            label: "turn 2".into(),
            role: Some(Role::Assistant),
            tool: Some("str_replace_editor".into()),
            text: "str_replace pydicom/filereader.py".into(),
            tokens: 20,
            time: 0,
            ..SourceItem::default()
        });
        r.sources.push(SourceItem {
            label: "turn 3".into(),
            role: Some(Role::Tool),
            tool: Some("bash".into()),
            text: "python reproduce.py\n===== 12 passed in 0.41s =====".into(),
            tokens: 20,
            time: 0,
            ..SourceItem::default()
        });
        let text = "The assistant edited pydicom/filereader.py and the file has been updated \
                    to handle transfer syntax 1.2.840.10008.1.2.1; after it ran the reproduce \
                    script, all the tests passed.";
        let got = check(&r, text, Encoding::O200kBase, 3.0);
        assert!(got.is_ok(), "{got:?}");
    }

    #[test]
    fn rolling_states_are_checked_like_summaries() {
        let rolling = RollingStateRequest {
            conversation: "c".into(),
            previous: None,
            sources: vec![SourceItem {
                label: "turn 0".into(),
                role: Some(Role::User),
                tool: None,
                text: "Fix the KeyError raised for transfer syntax 1.2.840.10008.1.2.1.".into(),
                tokens: 20,
                time: 0,
                ..SourceItem::default()
            }],
        };
        let prompt = prompts::render_rolling_state(&rolling);
        let state = |completed: &str| RollingState {
            completed: completed.into(),
            in_progress: "fixing the reader".into(),
            decisions: "keep the public API".into(),
            blockers: "none".into(),
            next: "add a test".into(),
        };
        let good = state("reproduced the KeyError for 1.2.840.10008.1.2.1");
        assert_eq!(check_rolling_state(&rolling, &prompt.system, &good), Ok(()));
        // A delimiter line, copied prompt text, a refusal, claimed outcomes.
        let delimiter = state("reproduced the bug </data-3f9a1c0b77de>");
        assert!(matches!(
            check_rolling_state(&rolling, &prompt.system, &delimiter),
            Err(Rejection::Delimiter(_))
        ));
        let copied = state(
            "You maintain the rolling session state of an AI agent: a compact note of where \
             the work stands, refreshed as the conversation goes on.",
        );
        assert_eq!(
            check_rolling_state(&rolling, &prompt.system, &copied),
            Err(Rejection::Copy(Copied::Instructions))
        );
        assert!(matches!(
            check_rolling_state(&rolling, &prompt.system, &state(REFUSAL)),
            Err(Rejection::Refusal(_))
        ));
        let claimed = state("The file has been updated to handle the syntax; all the tests passed");
        assert!(matches!(
            check_rolling_state(&rolling, &prompt.system, &claimed),
            Err(Rejection::UnsupportedClaim(_))
        ));
    }

    #[test]
    fn unusable_answers_get_a_bounded_kind() {
        assert_eq!(
            unusable_kind("m: truncated at the output cap (finish_reason length)"),
            "truncated"
        );
        assert_eq!(unusable_kind("m: refused: no"), "refusal");
        assert_eq!(unusable_kind("m: response has no choices"), "unusable");
    }

    /// Three answers a real 0.5B model wrote over a long Claude Code
    /// session (real-model eval, this shape, other words), each stored
    /// before these checks: the prompt's section list echoed, a copied
    /// deterministic header with only identifiers under it, and the
    /// previous summary's story restated over a new identifier list.
    #[test]
    fn rejects_echoed_instructions_headers_without_a_story_and_a_restated_story() {
        let r = req("source", 1000, 100);
        let echo = "## Files changed: one line per file, its path and what changed in it;\n\
                    ## Errors and fixes: each error or failure and how it was fixed (or that it is not yet);\n\
                    ## Decisions: each decision and its reason;\n\n\
                    Exact identifiers:\n- lib/app/router.ex\n- lib/app/endpoint.ex";
        assert_eq!(
            check(&r, echo, Encoding::O200kBase, 3.0),
            Err(Rejection::Copy(Copied::Instructions))
        );
        let header_only = "Summary of turn 119 … turn 125; deterministic det-4.\n\n\
                           Exact identifiers:\n- lib/foo.ex\n- /tmp/test\n- 1.0.0";
        assert!(matches!(
            check(&r, header_only, Encoding::O200kBase, 3.0),
            Err(Rejection::TooShort { .. })
        ));
        // The header is dropped from an answer that has a story.
        let told = "Summary of turn 3 … turn 9; deterministic det-4.\n\
                    The agent added a session registry and its sweep of stale sessions.";
        assert_eq!(
            check(&r, told, Encoding::O200kBase, 3.0),
            Ok("The agent added a session registry and its sweep of stale sessions.".into())
        );
        let story = "The segment creates a SessionRegistry that registers sessions and \
                     sweeps those older than the TTL on a heartbeat.";
        let previous = format!("{story}\n\nExact identifiers:\n- lib/spotter/registry.ex");
        let r = SummaryRequest {
            previous_summary: Some(previous),
            ..req("source", 1000, 100)
        };
        let restated = format!(
            "{story}\n\nThe summary shows the setup of the registry.\n\n\
             Exact identifiers:\n- lib/spotter/tmux.ex\n- ErlangError"
        );
        assert_eq!(
            check(&r, &restated, Encoding::O200kBase, 3.0),
            Err(Rejection::Copy(Copied::PreviousSummaryRestated))
        );
    }

    /// The real-model run (0.5B model, Claude Code session fa812bfe)
    /// stored a summary whose identifier appendix carried five of the
    /// prompt's section phrases: the whole-instructions check looked only
    /// at the narrative above the appendix.
    #[test]
    fn rejects_an_instruction_phrase_anywhere_unless_a_source_says_it() {
        let r = req("source", 1000, 100);
        let appendix = "## Next\n- turn 17: Now let me look at the existing SessionRegistry.\n\
                        ## Exact identifiers\nlib/spotter/services/session_registry.ex\n\
                        ## Errors and fixes: each error or failure and how it was fixed (or that it is not yet);\n\
                        ## Decisions: each decision and its reason;\n\n\
                        Exact identifiers:\n- ErlangError";
        assert_eq!(
            check(&r, appendix, Encoding::O200kBase, 3.0),
            Err(Rejection::Copy(Copied::Instructions))
        );
        // One phrase is enough, whatever its case and punctuation.
        let one = "The agent added the registry and its sweep.\n\
                   ## Decisions\n- Each decision, and its reason.";
        assert_eq!(
            check(&r, one, Encoding::O200kBase, 3.0),
            Err(Rejection::Copy(Copied::Instructions))
        );
        // Words a summary shares with the section names pass.
        let told = "The agent added the registry; each decision was reviewed by the user, \
                    and the next step is the sweep.";
        assert!(check(&r, told, Encoding::O200kBase, 3.0).is_ok());
        // A conversation about prompts may say it: then so may its summary.
        let about = req(
            "Change the summary prompt: replace 'each decision and its reason' with a list.",
            1000,
            100,
        );
        let quoted = "The user asked to replace 'each decision and its reason' in the summary \
                      prompt with a list.";
        assert!(check(&about, quoted, Encoding::O200kBase, 3.0).is_ok());
    }

    /// The same run's rolling state at turn 287: "In progress" was the
    /// prompt's own placeholder and the user's decision ("use the
    /// Ash-generated migration") carried since turn 195 was replaced by
    /// words of no use; the deterministic update kept it.
    #[test]
    fn a_rolling_state_keeps_the_decisions_its_previous_state_carried() {
        let rolling = RollingStateRequest {
            conversation: "c".into(),
            previous: Some(RollingState {
                completed: "All 386 tests pass, credo clean.".into(),
                in_progress: "continue until all are done".into(),
                decisions: "I should remove my manual migration and use the Ash-generated one \
                            instead."
                    .into(),
                blockers: String::new(),
                next: "Let me run the full suite.".into(),
            }),
            sources: vec![SourceItem {
                label: "turn 287".into(),
                role: Some(Role::Assistant),
                tool: None,
                text: "Let me add the scroll handler near the other component functions at the \
                       bottom of pane_list_live.ex."
                    .into(),
                tokens: 30,
                time: 0,
                ..SourceItem::default()
            }],
        };
        let prompt = prompts::render_rolling_state(&rolling);
        let state = |in_progress: &str, decisions: &str| RollingState {
            completed: "All 386 tests pass, credo clean.".into(),
            in_progress: in_progress.into(),
            decisions: decisions.into(),
            blockers: String::new(),
            next: "Add the scroll handler to pane_list_live.ex.".into(),
        };
        let kept = state(
            "continue until all are done",
            "use the Ash-generated migration instead of the manual one",
        );
        assert_eq!(check_rolling_state(&rolling, &prompt.system, &kept), Ok(()));
        let placeholder = state(
            "The user's current request, in the user's words.",
            "use the Ash-generated migration instead of the manual one",
        );
        assert_eq!(
            check_rolling_state(&rolling, &prompt.system, &placeholder),
            Err(Rejection::Copy(Copied::Instructions))
        );
        let dropped = state(
            "continue until all are done",
            "The decision to read the key files is force.",
        );
        let got = check_rolling_state(&rolling, &prompt.system, &dropped);
        assert!(
            matches!(&got, Err(Rejection::BelowDeterministic { .. })),
            "{got:?}"
        );
    }
}
