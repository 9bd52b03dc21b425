//! `expand`: one level down the summary DAG. A condensed summary expands to
//! its child summaries, a leaf to the raw turns it summarized, in order and
//! within a token cap; what did not fit is counted and can be fetched with
//! `skip`. Large payloads come as their stub (ask `describe` for the body).

use crate::api::describe::{describe_summary, SummaryDescription};
use crate::api::{conversation, turn, ApiError};
use crate::core::assembly::payload_stub;
use crate::core::event::Covers;
use crate::core::message::{ChatMessage, Content, Role};
use crate::core::state::{State, TurnBodies};
use serde::{Deserialize, Serialize};

pub const DEFAULT_MAX_TOKENS: u64 = 4000;
pub const MAX_MAX_TOKENS: u64 = 100_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpandRequest {
    pub conversation: String,
    pub summary_id: String,
    /// Token cap on the items returned (default 4000, at most 100000).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Items to skip first (to fetch what an earlier call cut).
    #[serde(default)]
    pub skip: usize,
}

/// One item under the summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ExpandedItem {
    Summary(Box<SummaryDescription>),
    Turn {
        seq: u64,
        event_id: String,
        role: Role,
        time: u64,
        /// Tokens counted against the cap (the stub's for a large payload).
        tokens: u64,
        large_payload: bool,
        message: ChatMessage,
    },
}

/// What the cap left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cut {
    pub items: usize,
    pub tokens: u64,
    /// Ask again with this `skip` for the rest.
    pub next_skip: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpandResponse {
    pub conversation: String,
    pub summary_id: String,
    /// `summaries` (condensed) or `turns` (leaf).
    pub children: ChildKind,
    pub max_tokens: u64,
    pub items: Vec<ExpandedItem>,
    pub tokens: u64,
    /// Items under the summary in all.
    pub total_items: usize,
    pub total_tokens: u64,
    pub skipped: usize,
    /// Set when the cap cut the expansion.
    pub cut: Option<Cut>,
    /// Turns in a leaf's span that were never in context (duplicates,
    /// late tool results): not part of what it summarized.
    pub excluded_turns: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChildKind {
    Summaries,
    Turns,
}

pub fn expand(
    state: &State,
    bodies: &dyn TurnBodies,
    req: &ExpandRequest,
) -> Result<ExpandResponse, ApiError> {
    let conv = conversation(state, &req.conversation)?;
    let max_tokens = req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    if max_tokens == 0 || max_tokens > MAX_MAX_TOKENS {
        return Err(ApiError::BadRequest(format!(
            "`max_tokens` must be between 1 and {MAX_MAX_TOKENS} (got {max_tokens})"
        )));
    }
    let Some(index) = conv.summary_index(&req.summary_id) else {
        return Err(ApiError::BadRequest(format!(
            "no summary {:?} in {:?} (`grep` or `status` name the summaries)",
            req.summary_id, conv.key
        )));
    };
    let summary = &conv.summaries[index as usize];
    let coverage = super::coverage::Coverage::new(conv)?;

    let mut items: Vec<(ExpandedItem, u64)> = Vec::new();
    let mut excluded_turns = Vec::new();
    let children = match &summary.covers {
        Covers::Summaries { ids } => {
            for id in ids {
                let child = conv.summary_index(id).ok_or_else(|| {
                    ApiError::Internal(format!(
                        "summary {} covers {id}, which this state does not hold",
                        summary.id
                    ))
                })?;
                items.push((
                    ExpandedItem::Summary(Box::new(describe_summary(
                        conv, bodies, &coverage, child,
                    )?)),
                    conv.summaries[child as usize].tokens,
                ));
            }
            ChildKind::Summaries
        }
        Covers::Turns { first, last } => {
            for seq in *first..=*last {
                let t = turn(conv, seq)?;
                if !t.in_context {
                    excluded_turns.push(seq);
                    continue;
                }
                let body = bodies.turn_body(conv, seq)?;
                let mut message = body.message.clone();
                if t.large_payload {
                    message.content = Some(Content::Text(payload_stub(
                        &body.event_id,
                        u64::from(t.tokens),
                    )));
                    message.tool_calls.iter_mut().for_each(|c| {
                        if c.function.arguments.len() > 256 {
                            c.function.arguments = "{}".into();
                        }
                    });
                }
                items.push((
                    ExpandedItem::Turn {
                        seq,
                        event_id: body.event_id.to_string(),
                        role: t.role,
                        time: t.time,
                        tokens: u64::from(t.context_tokens),
                        large_payload: t.large_payload,
                        message,
                    },
                    u64::from(t.context_tokens),
                ));
            }
            ChildKind::Turns
        }
    };

    let total_items = items.len();
    let total_tokens = items.iter().map(|(_, t)| *t).sum();
    let skipped = req.skip.min(total_items);
    let mut out = Vec::new();
    let mut used = 0u64;
    let mut rest = items.into_iter().skip(skipped).peekable();
    // In order: stop at the first item that does not fit, so what is
    // returned is always a contiguous run.
    while let Some((_, t)) = rest.peek() {
        if used + t > max_tokens {
            break;
        }
        used += t;
        if let Some((item, _)) = rest.next() {
            out.push(item);
        }
    }
    let left: Vec<u64> = rest.map(|(_, t)| t).collect();
    let cut = (!left.is_empty()).then(|| Cut {
        items: left.len(),
        tokens: left.iter().sum(),
        next_skip: skipped + out.len(),
    });
    Ok(ExpandResponse {
        conversation: conv.key.clone(),
        summary_id: summary.id.clone(),
        children,
        max_tokens,
        items: out,
        tokens: used,
        total_items,
        total_tokens,
        skipped,
        cut,
        excluded_turns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::{self, CONV};
    use crate::core::state::Resident;

    fn req(id: &str, max_tokens: Option<u64>, skip: usize) -> ExpandRequest {
        ExpandRequest {
            conversation: CONV.into(),
            summary_id: id.into(),
            max_tokens,
            skip,
        }
    }

    #[test]
    fn a_condensed_summary_expands_to_its_children_in_order() {
        let (state, _) = testing::folded();
        let conv = testing::conv(state);
        let top = conv.summaries.iter().find(|s| s.depth >= 1).unwrap();
        let Covers::Summaries { ids } = &top.covers else {
            panic!("condensed covers summaries");
        };
        let out = expand(state, &Resident, &req(&top.id, Some(100_000), 0)).unwrap();
        assert_eq!(out.children, ChildKind::Summaries);
        let got: Vec<&str> = out
            .items
            .iter()
            .map(|i| match i {
                ExpandedItem::Summary(s) => s.summary_id.as_str(),
                ExpandedItem::Turn { .. } => panic!("no turns under a condensed summary"),
            })
            .collect();
        assert_eq!(got, ids.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(out.cut.is_none());
        assert_eq!(out.tokens, out.total_tokens);
    }

    #[test]
    fn a_leaf_expands_to_its_turns_within_the_cap_and_pages() {
        let (state, _) = testing::folded();
        let conv = testing::conv(state);
        let leaf = conv.summaries.iter().find(|s| s.depth == 0).unwrap();
        let full = expand(state, &Resident, &req(&leaf.id, Some(100_000), 0)).unwrap();
        assert_eq!(full.children, ChildKind::Turns);
        let seqs: Vec<u64> = full
            .items
            .iter()
            .map(|i| match i {
                ExpandedItem::Turn { seq, .. } => *seq,
                ExpandedItem::Summary(_) => panic!("no summaries under a leaf"),
            })
            .collect();
        assert_eq!(seqs.first(), Some(&leaf.first_turn));
        assert_eq!(seqs.last(), Some(&leaf.last_turn));
        assert_eq!(full.total_tokens, leaf.source_tokens);
        assert!(full.total_items >= 2);

        // A cap that fits the first item only.
        let first_tokens = match &full.items[0] {
            ExpandedItem::Turn { tokens, .. } => *tokens,
            ExpandedItem::Summary(_) => unreachable!(),
        };
        let part = expand(state, &Resident, &req(&leaf.id, Some(first_tokens), 0)).unwrap();
        assert_eq!(part.items.len(), 1);
        let cut = part.cut.expect("the cap cut it");
        assert_eq!(cut.items, full.total_items - 1);
        assert_eq!(cut.tokens, full.total_tokens - first_tokens);
        let rest = expand(
            state,
            &Resident,
            &req(&leaf.id, Some(100_000), cut.next_skip),
        )
        .unwrap();
        assert_eq!(rest.items, full.items[1..].to_vec());
        assert!(rest.cut.is_none());
    }

    #[test]
    fn bad_requests() {
        let (state, _) = testing::folded();
        let conv = testing::conv(state);
        let id = conv.summaries[0].id.clone();
        for r in [
            req("sum_missing", None, 0),
            req(&id, Some(0), 0),
            req(&id, Some(MAX_MAX_TOKENS + 1), 0),
        ] {
            assert!(
                matches!(expand(state, &Resident, &r), Err(ApiError::BadRequest(_))),
                "{r:?}"
            );
        }
    }
}
