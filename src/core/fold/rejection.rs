//! Why the fold refuses an event, as types: a rejection can be counted by
//! its kind and matched in tests, and its text (what the `event_rejected`
//! and `summary_rejected` decisions carry, and the audit shows) is written
//! in one place.

use crate::core::event::{Covers, SummaryKind};

/// An event the fold refused (it is recorded, its id consumed, nothing
/// else changes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error(transparent)]
    Turn(#[from] TurnRejection),
    #[error(transparent)]
    Summary(#[from] SummaryRejection),
    /// Over an intake quota (`core::state::IntakeQuota`): the
    /// conversation's own, or the partition's across its conversations.
    #[error(
        "over the {scope} intake quota ({limit}): refused; further events are refused \
         without a record each until the rate falls (counted in `status`)"
    )]
    OverQuota { scope: QuotaScope, limit: String },
}

/// Whose intake quota refused an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaScope {
    /// The conversation's own (`policy.intake_*`).
    Conversation,
    /// The partition's, shared by its conversations (`policy.intake_partition_*`).
    Partition,
}

impl std::fmt::Display for QuotaScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QuotaScope::Conversation => "conversation's",
            QuotaScope::Partition => "partition's (shared by its conversations)",
        })
    }
}

impl Rejection {
    /// A closed set of labels, for counting (`contextfold_events_rejected_total{kind}`).
    pub fn kind(&self) -> &'static str {
        match self {
            Rejection::Turn(TurnRejection::ReplayFlood { .. }) => "replay_flood",
            Rejection::Turn(_) => "tool_pairing",
            Rejection::Summary(s) if s.is_stale() => "summary_stale",
            Rejection::Summary(_) => "summary_invalid",
            Rejection::OverQuota { .. } => "over_quota",
        }
    }
}

/// A turn that breaks the conversation's rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TurnRejection {
    #[error("tool turn without tool_call_id")]
    ToolTurnWithoutCallId,
    #[error("orphan tool result: no earlier assistant turn made tool call {call_id:?}")]
    OrphanToolResult { call_id: String },
    #[error("assistant tool call with an empty id")]
    EmptyToolCallId,
    #[error("replay flood: {count} identical {role} turns within one second (limit {limit})")]
    ReplayFlood {
        count: u32,
        role: &'static str,
        limit: u32,
    },
}

/// A recorded summary that does not fit the state it is folded into.
///
/// Stale ones ([`SummaryRejection::is_stale`]) are the expected end of a
/// race (a job that expired or was superseded while its worker ran); the
/// others mean a summarizer wrote something no state could accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SummaryRejection {
    #[error("id is not the content address of the summary (expected {expected})")]
    NotContentAddressed { expected: String },
    #[error("empty summary")]
    Empty,
    #[error("stale: this summary was already recorded")]
    AlreadyRecorded,
    #[error("a fallback summary cannot supersede {old}: only a model summary replaces a fallback")]
    FallbackSupersedes { old: String },
    #[error("supersedes unknown summary {old}")]
    SupersedesUnknown { old: String },
    #[error("supersedes {old}, which is not a deterministic fallback summary")]
    SupersedesModelSummary { old: String },
    #[error("stale: {old} is no longer in context (condensed, superseded or reset)")]
    SupersededGone { old: String },
    #[error(
        "does not cover exactly what {old} covers: kind, depth and covers must match \
         ({kind:?} depth {depth} {covers:?} vs {old_kind:?} depth {old_depth} {old_covers:?})"
    )]
    NotTheSameSpan {
        old: String,
        kind: SummaryKind,
        depth: u32,
        covers: Covers,
        old_kind: SummaryKind,
        old_depth: u32,
        old_covers: Covers,
    },
    #[error("a leaf summary has depth 0")]
    LeafDepth,
    #[error("covers unknown turns {first}..={last}")]
    UnknownTurns { first: u64, last: u64 },
    #[error("stale: turn {first} is no longer raw in context")]
    TurnNotRaw { first: u64 },
    #[error(
        "stale or out of order: turn {first} is not the oldest raw turn in context \
         (turn {oldest} is); a leaf summary must start there so no raw turn \
         is left between summaries"
    )]
    NotOldestRaw { first: u64, oldest: String },
    #[error("stale or non-contiguous: turn {seq} is not next in context")]
    TurnNotNext { seq: u64 },
    #[error("the chunk separates a tool call from its result")]
    SplitsToolPair,
    #[error("covers turns of the fresh tail")]
    FreshTail,
    #[error("a condensed summary covers at least two summaries")]
    TooFewChildren,
    #[error("covers unknown summary {id}")]
    UnknownChild { id: String },
    #[error("child {id} has depth {depth}, expected {expected}")]
    ChildDepth {
        id: String,
        depth: u32,
        expected: u32,
    },
    #[error("a condensed summary has depth 1 or more")]
    CondensedDepth,
    #[error("stale: summary {id} is already condensed")]
    ChildCondensed { id: String },
    #[error("children are not contiguous in context")]
    ChildrenApart,
    #[error("kind and covers disagree")]
    KindCoversDisagree,
}

impl SummaryRejection {
    /// The state moved on under the summary (its sources were covered,
    /// condensed or reset): a race, not a summarizer's mistake.
    pub fn is_stale(&self) -> bool {
        matches!(
            self,
            SummaryRejection::AlreadyRecorded
                | SummaryRejection::SupersededGone { .. }
                | SummaryRejection::TurnNotRaw { .. }
                | SummaryRejection::NotOldestRaw { .. }
                | SummaryRejection::TurnNotNext { .. }
                | SummaryRejection::ChildCondensed { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_tell_races_from_mistakes() {
        let stale = Rejection::from(SummaryRejection::TurnNotRaw { first: 3 });
        assert_eq!(stale.kind(), "summary_stale");
        assert_eq!(
            stale.to_string(),
            "stale: turn 3 is no longer raw in context"
        );
        let wrong = Rejection::from(SummaryRejection::SplitsToolPair);
        assert_eq!(wrong.kind(), "summary_invalid");
        let flood = Rejection::from(TurnRejection::ReplayFlood {
            count: 4,
            role: "user",
            limit: 3,
        });
        assert_eq!(flood.kind(), "replay_flood");
        assert_eq!(
            flood.to_string(),
            "replay flood: 4 identical user turns within one second (limit 3)"
        );
    }
}
