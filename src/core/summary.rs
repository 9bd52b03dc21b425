//! What a summarizer is asked for and what it gives back, shared by every
//! summarizer (deterministic, LLM, external) so the job protocol never
//! depends on which one runs.

use crate::core::event::{RollingState, SummaryKind};
use crate::core::message::Role;
use serde::{Deserialize, Serialize};

/// How strictly opaque identifiers (paths, URLs, hashes, UUIDs, ports, ...)
/// must survive summarization.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case", tag = "mode", content = "text")]
pub enum IdentifierPolicy {
    /// Preserve every opaque identifier exactly (default).
    #[default]
    Strict,
    Off,
    /// A team's own wording.
    Custom(String),
}

/// One thing a summary is written over: a raw turn or a child summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceItem {
    /// `turn 17` or `summary sum_ab12...`: how the summary may refer to it.
    pub label: String,
    /// The turn's role; `None` for a child summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// Tool name for tool calls / results, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The text to summarize (injected-context tags already stripped).
    pub text: String,
    pub tokens: u64,
    /// Event time of the turn (or newest covered turn).
    #[serde(default)]
    pub time: u64,
}

/// A request for one summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryRequest {
    pub conversation: String,
    pub kind: SummaryKind,
    /// Depth of the summary to write (0 = leaf).
    pub depth: u32,
    pub sources: Vec<SourceItem>,
    /// Size to aim for, in tokens.
    pub target_tokens: u64,
    /// The previous summary, given as continuity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_summary: Option<String>,
    /// A manual compaction's instructions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_instructions: Option<String>,
    #[serde(default)]
    pub identifier_policy: IdentifierPolicy,
    /// Escalation: aim shorter than usual.
    #[serde(default)]
    pub aggressive: bool,
}

impl SummaryRequest {
    pub fn source_tokens(&self) -> u64 {
        self.sources.iter().map(|s| s.tokens).sum()
    }
}

/// What a summarizer produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryDraft {
    pub content: String,
    pub model: String,
    pub provider: String,
    pub prompt_version: String,
    /// True for deterministic fallback output.
    pub fallback: bool,
}

/// A request to refresh the rolling session state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RollingStateRequest {
    pub conversation: String,
    pub previous: Option<RollingState>,
    pub sources: Vec<SourceItem>,
}

/// Limits of the rolling session state.
pub const ROLLING_STATE_MAX_CHARS: usize = 500;
pub const ROLLING_SECTION_MAX_CHARS: usize = 200;
