//! Where a turn or summary stands now: raw in context, under a summary that
//! is in context (and which leaf summarized it), or out of context (a
//! duplicate, a late tool result, an earlier epoch). Built once per request
//! so looking up many turns stays a binary search each.

use crate::api::{summary_at, ApiError};
use crate::core::event::Covers;
use crate::core::state::{ContextItem, Conversation, Summary, Turn};
use serde::{Deserialize, Serialize};

/// Where a turn stands in the conversation's context now.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TurnPlacement {
    /// The turn is in context verbatim now.
    pub in_context: bool,
    /// The summary in context now whose span covers it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub covered_by: Option<String>,
    /// The leaf summary that first summarized it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leaf_summary: Option<String>,
    /// Why the turn is in no context at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub excluded: Option<String>,
}

pub(crate) struct Coverage<'a> {
    conv: &'a Conversation,
    /// Turn spans of the summaries in context, oldest first.
    in_context: Vec<(u64, u64, &'a Summary)>,
    /// Turn spans of every leaf summary, by first turn.
    leaves: Vec<(u64, u64, &'a Summary)>,
}

fn find<'a>(spans: &[(u64, u64, &'a Summary)], seq: u64) -> Option<&'a Summary> {
    let after = spans.partition_point(|(first, _, _)| *first <= seq);
    let (_, last, s) = spans.get(after.checked_sub(1)?)?;
    (seq <= *last).then_some(*s)
}

impl<'a> Coverage<'a> {
    pub fn new(conv: &'a Conversation) -> Result<Self, ApiError> {
        let mut in_context = Vec::new();
        for item in &conv.context {
            if let ContextItem::Summary(i) = *item {
                let s = summary_at(conv, i)?;
                in_context.push((s.first_turn, s.last_turn, s));
            }
        }
        let mut leaves: Vec<_> = conv
            .summaries
            .iter()
            .filter_map(|s| match s.covers {
                Covers::Turns { first, last } => Some((first, last, s)),
                Covers::Summaries { .. } => None,
            })
            .collect();
        leaves.sort_by_key(|(first, _, _)| *first);
        Ok(Coverage {
            conv,
            in_context,
            leaves,
        })
    }

    pub fn turn(&self, turn: &Turn) -> TurnPlacement {
        let leaf_summary = find(&self.leaves, turn.seq).map(|s| s.id.clone());
        if turn.epoch != self.conv.epoch {
            return TurnPlacement {
                leaf_summary,
                excluded: Some(format!(
                    "belongs to epoch {} (the conversation was reset; now epoch {})",
                    turn.epoch, self.conv.epoch
                )),
                ..TurnPlacement::default()
            };
        }
        if !turn.in_context {
            return TurnPlacement {
                excluded: Some(
                    "kept out of context when folded (a duplicate user turn or a late tool result)"
                        .into(),
                ),
                ..TurnPlacement::default()
            };
        }
        match find(&self.in_context, turn.seq) {
            Some(s) => TurnPlacement {
                in_context: false,
                covered_by: Some(s.id.clone()),
                leaf_summary,
                excluded: None,
            },
            None => TurnPlacement {
                in_context: true,
                leaf_summary,
                ..TurnPlacement::default()
            },
        }
    }

    /// Is this summary itself in context now?
    pub fn summary_in_context(&self, id: &str) -> bool {
        self.in_context.iter().any(|(_, _, s)| s.id == id)
    }

    /// The summary in context now that holds `summary` (itself, or an
    /// ancestor), if any.
    pub fn summary_covered_by(&self, summary: &Summary) -> Option<&'a Summary> {
        let mut current: &Summary = summary;
        // The DAG is acyclic by construction (a parent is recorded after its
        // children); the bound only guards against a corrupted state.
        for _ in 0..=self.conv.summaries.len() {
            if self.summary_in_context(&current.id) {
                return self
                    .in_context
                    .iter()
                    .find(|(_, _, s)| s.id == current.id)
                    .map(|(_, _, s)| *s);
            }
            // A re-summarized fallback is held by its replacement's place.
            current = self
                .conv
                .parent_of(&current.id)
                .or_else(|| self.conv.superseded_by(&current.id))?;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing;

    #[test]
    fn every_in_context_turn_is_raw_or_covered_exactly_once() {
        let (state, _) = testing::folded();
        let conv = testing::conv(state);
        let cov = Coverage::new(conv).unwrap();
        let raw: Vec<u64> = conv
            .context
            .iter()
            .filter_map(|i| match i {
                ContextItem::Turn(s) => Some(*s),
                ContextItem::Summary(_) => None,
            })
            .collect();
        let mut covered = 0;
        for t in &conv.turns {
            let p = cov.turn(t);
            assert_eq!(p.in_context, raw.contains(&t.seq), "turn {}", t.seq);
            if let Some(id) = &p.covered_by {
                covered += 1;
                let s = &conv.summaries[conv.summary_index(id).unwrap() as usize];
                assert!(s.first_turn <= t.seq && t.seq <= s.last_turn);
                assert!(p.leaf_summary.is_some(), "a covered turn has a leaf");
            }
            assert!(!(p.in_context && p.covered_by.is_some()));
        }
        assert!(covered > 0, "the fixture has summarized turns");
    }

    #[test]
    fn summaries_resolve_to_their_ancestor_in_context() {
        let (state, _) = testing::folded();
        let conv = testing::conv(state);
        let cov = Coverage::new(conv).unwrap();
        for s in &conv.summaries {
            let top = cov
                .summary_covered_by(s)
                .expect("in one epoch every summary is under one in context");
            assert!(top.depth >= s.depth);
            assert!(top.first_turn <= s.first_turn && s.last_turn <= top.last_turn);
        }
    }
}
