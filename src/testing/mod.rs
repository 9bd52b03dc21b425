//! Fixtures for contextfold's own tests and benches, in one place: the
//! fold's given/when/then harness ([`FoldTest`]), synthetic turns, the
//! small policies the tests share, a summary request, the in-memory
//! pipeline, and golden files ([`golden::check`]). Not part of the
//! service: nothing outside tests and benches calls it.

pub mod fold_test;
pub mod golden;

pub use fold_test::{FoldTest, Then};

use crate::core::event::{Envelope, EventBody, SummaryKind, TurnAppended};
use crate::core::message::{ChatMessage, Role};
use crate::core::policy::PolicyConfig;
use crate::core::summary::{IdentifierPolicy, SourceItem, SummaryRequest};
use crate::log::memory::MemoryLog;
use crate::runtime::embedded::{Pipeline, PipelineError};
use crate::runtime::engine::Engine;
use crate::store::memory_backend::MemoryBackend;
use crate::summarizer::{CallOutcome, CallRecord, DeterministicSummarizer};

/// A time the tests' conversations start at (2023-11-14).
pub const T0: u64 = 1_700_000_000_000;

/// The role of turn `i` of a synthetic conversation: user, assistant,
/// user, ...
pub fn role_of(i: u64) -> Role {
    if i.is_multiple_of(2) {
        Role::User
    } else {
        Role::Assistant
    }
}

/// An agent's turn of `conv` with id `<conv>-t<i>`: `message` at `time`.
pub fn turn_of(conv: &str, i: u64, time: u64, message: ChatMessage) -> Envelope {
    Envelope::new(
        format!("{conv}-t{i}"),
        conv,
        time,
        EventBody::TurnAppended(TurnAppended::from(message)),
    )
}

/// Turn `i` of a synthetic conversation: alternating roles, about 160
/// tokens of text ("turn i: words of a turn ..."), so three make a
/// 600-token leaf chunk.
pub fn turn(conv: &str, i: u64, time: u64) -> Envelope {
    turn_of(
        conv,
        i,
        time,
        ChatMessage::text(
            role_of(i),
            format!("turn {i}: {}", "words of a turn ".repeat(40)),
        ),
    )
}

/// The small policy the fold and NATS tests share: a 6,000-token window
/// and small leaf and condensed targets, so a few dozen turns compact.
pub fn small_policy() -> PolicyConfig {
    PolicyConfig {
        default_context_window: 6000,
        fresh_tail_count: 6,
        leaf_chunk_tokens: 1200,
        leaf_target_tokens: 200,
        condensed_target_tokens: 200,
        leaf_fanout: 3,
        condensed_fanout: 2,
        ..PolicyConfig::default()
    }
}

/// A leaf request of conversation `c` over one user source, `turn 1`, of
/// `text` (`tokens` tokens), aiming at `target` tokens; no previous
/// summary, identifiers kept strictly.
pub fn summary_request(text: &str, tokens: u64, target: u64) -> SummaryRequest {
    SummaryRequest {
        conversation: "c".into(),
        kind: SummaryKind::Leaf,
        depth: 0,
        sources: vec![SourceItem {
            label: "turn 1".into(),
            role: Some(Role::User),
            tool: None,
            text: text.into(),
            tokens,
            time: 0,
            ..SourceItem::default()
        }],
        target_tokens: target,
        previous_summary: None,
        instructions: None,
        custom_instructions: None,
        identifier_policy: IdentifierPolicy::Strict,
        aggressive: false,
    }
}

/// A model call that ended as `outcome`: 100 prompt and 10 completion
/// tokens by the provider's count (90 and 9 by ours), 7 micro-dollars.
pub fn call_record(outcome: CallOutcome) -> CallRecord {
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

/// The embedded pipeline in memory, with the deterministic summarizer.
pub type MemoryPipeline = Pipeline<MemoryLog, MemoryBackend, DeterministicSummarizer>;

/// A fresh in-memory pipeline folding under `policy`.
pub async fn memory_pipeline(policy: PolicyConfig) -> Result<MemoryPipeline, PipelineError> {
    let engine = Engine::open(MemoryBackend::default(), policy)?;
    Pipeline::open(MemoryLog::new(), engine, DeterministicSummarizer).await
}
