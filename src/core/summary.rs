//! What a summarizer is asked for and what it gives back, shared by every
//! summarizer (deterministic, LLM, external) so the job protocol never
//! depends on which one runs.

use crate::core::event::{RollingState, SummaryKind};
use crate::core::message::Role;
use crate::core::turn_notes::TurnNotes;
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
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
    /// What the deterministic summarizer reads of this source, when it was
    /// read ahead of the draft (see [`SourceReading`]); never sent.
    #[serde(skip)]
    pub read_ahead: ReadAhead,
}

/// What the deterministic summarizer reads of one source on its own,
/// whatever came before it: the error its output reports, its milestones
/// and the files it says were changed, and (when read) its identifiers.
/// These are most of a draft's work and pure functions of the source, so
/// `run` reads them on its other core while the fold works on the turns
/// before (`runtime::embedded::Measurer`), and the draft, which waits on
/// the fold's thread, only merges them. A reading names the text it was
/// taken from (role, tool and text, [`ReadText`]): a draft uses it only for
/// that text and reads anything else itself, so a reading changes the time
/// a draft takes, never what it writes (`fallback_summary::reading`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceReading {
    pub role: Option<Role>,
    pub tool: Option<String>,
    /// The text read, to be compared with a source's before the reading is
    /// used for it.
    pub text: ReadText,
    pub output: OutputReading,
    /// `None` when only the output was read.
    pub identifiers: Option<IdentifierReading>,
    /// What the first draft to read this source noted of it, kept for the
    /// next (a turn is noted by a rolling state while it is new, then by
    /// the leaf that covers it).
    pub notes: std::sync::OnceLock<TurnNotes>,
}

/// The text a [`SourceReading`] was taken from, as kept to be compared:
/// whole up to [`ReadText::WHOLE_BYTES`] (compared byte for byte: a draft
/// and a rolling state each compare every source, and digesting each text
/// over 1 KiB at every comparison was 4.9% of the instructions of `run`'s
/// fold thread; `docs/notes/issue-26.md`, twenty-seventh pass), else by
/// its BLAKE3 digest, so a reading holds at most 16 KiB of its text (and
/// `run`'s store of readings a bounded sum of them:
/// `runtime::read_ahead::Readings`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadText {
    Whole(std::sync::Arc<str>),
    Digest { len: usize, blake3: [u8; 32] },
}

impl ReadText {
    /// The longest text kept whole.
    pub const WHOLE_BYTES: usize = 16 * 1024;

    pub fn of(text: &str) -> ReadText {
        if text.len() <= Self::WHOLE_BYTES {
            ReadText::Whole(text.into())
        } else {
            ReadText::Digest {
                len: text.len(),
                blake3: *blake3::hash(text.as_bytes()).as_bytes(),
            }
        }
    }

    /// The bytes of text it holds.
    pub fn held_bytes(&self) -> usize {
        match self {
            ReadText::Whole(whole) => whole.len(),
            ReadText::Digest { .. } => 0,
        }
    }

    /// Whether this is `text`.
    pub fn is(&self, text: &str) -> bool {
        match self {
            ReadText::Whole(whole) => **whole == *text,
            ReadText::Digest { len, blake3 } => {
                *len == text.len() && *blake3 == *blake3::hash(text.as_bytes()).as_bytes()
            }
        }
    }
}

/// What a turn's output says on its own (a tool's result, or console
/// output pasted in a user's turn); empty for other turns.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutputReading {
    pub error: Option<String>,
    pub milestones: Vec<String>,
    pub file_changes: Vec<(String, &'static str)>,
}

/// A source's identifiers in order of appearance, the identifiers of the
/// arguments of the calls that act (an edit, a command, an action) and
/// the names of every call it makes, in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IdentifierReading {
    pub identifiers: Vec<String>,
    pub acted: Vec<String>,
    pub calls: Vec<String>,
}

/// A [`SourceReading`] taken ahead, if any: a shortcut, not content, so
/// two sources that differ only in it are equal.
#[derive(Clone, Default)]
pub struct ReadAhead(pub Option<std::sync::Arc<SourceReading>>);

impl PartialEq for ReadAhead {
    fn eq(&self, _: &ReadAhead) -> bool {
        true
    }
}

impl std::fmt::Debug for ReadAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ReadAhead(Some(..))"
        } else {
            "ReadAhead(None)"
        })
    }
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
