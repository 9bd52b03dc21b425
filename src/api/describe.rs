//! `describe`: one node of a conversation in full. A summary: its content,
//! kind, depth, what it covers, turn span, tokens, model, fallback mark,
//! its parent and where it stands in context. A turn (by event id or turn
//! sequence number): the message exactly as published, large payloads
//! included, with its tokens and where it stands in context.

use crate::api::coverage::{Coverage, TurnPlacement};
use crate::api::{conversation, turn, ApiError};
use crate::core::event::{Covers, ProviderUsage, SummaryKind};
use crate::core::message::{ChatMessage, Role};
use crate::core::state::{event_digest, Conversation, State, Turn, TurnBodies};
use serde::{Deserialize, Serialize};

/// What to describe: a summary id, a turn's event id, or a turn sequence
/// number (as a JSON number, or a string of digits that is no event id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NodeRef {
    Seq(u64),
    Id(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescribeRequest {
    pub conversation: String,
    pub id: NodeRef,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DescribeResponse {
    Summary(Box<SummaryDescription>),
    Turn(Box<TurnDescription>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryDescription {
    pub conversation: String,
    pub summary_id: String,
    pub summary_kind: SummaryKind,
    pub depth: u32,
    pub covers: Covers,
    pub first_turn: u64,
    pub last_turn: u64,
    /// Turns in the span (including any kept out of context).
    pub turn_span: u64,
    pub tokens: u64,
    /// Tokens of what it replaced in context.
    pub source_tokens: u64,
    pub content: String,
    pub model: String,
    pub provider: String,
    pub prompt_version: String,
    /// A deterministic fallback, to be re-summarized by a model.
    pub fallback: bool,
    /// Event time it was recorded.
    pub time: u64,
    pub job_id: Option<String>,
    /// The condensed summary above it, if any.
    pub parent: Option<String>,
    /// It is in context itself now.
    pub in_context: bool,
    /// The summary in context now that holds it (itself or an ancestor).
    pub covered_by: Option<String>,
    /// A model summary: the fallback summary it replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supersedes: Option<String>,
    /// A fallback summary: the model summary that replaced it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub superseded_by: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnDescription {
    pub conversation: String,
    pub seq: u64,
    pub event_id: String,
    pub time: u64,
    pub role: Role,
    /// Tokens of the message verbatim.
    pub tokens: u64,
    /// What it costs in context (a stub for a large payload).
    pub context_tokens: u64,
    pub bytes: u64,
    pub large_payload: bool,
    pub epoch: u32,
    #[serde(flatten)]
    pub placement: TurnPlacement,
    /// The message exactly as published.
    pub message: ChatMessage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<ProviderUsage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

/// Summary `index` of `conv`, its text read through `bodies`.
pub(crate) fn describe_summary(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    coverage: &Coverage<'_>,
    index: u32,
) -> Result<SummaryDescription, ApiError> {
    let s = &conv.summaries[index as usize];
    Ok(SummaryDescription {
        conversation: conv.key.clone(),
        summary_id: s.id.clone(),
        summary_kind: s.kind,
        depth: s.depth,
        covers: s.covers.clone(),
        first_turn: s.first_turn,
        last_turn: s.last_turn,
        turn_span: s.last_turn.saturating_sub(s.first_turn) + 1,
        tokens: s.tokens,
        source_tokens: s.source_tokens,
        content: bodies.summary_text(conv, index)?.to_string(),
        model: s.model.clone(),
        provider: s.provider.clone(),
        prompt_version: s.prompt_version.clone(),
        fallback: s.fallback,
        time: s.time,
        job_id: s.job_id.clone(),
        parent: conv.parent_of(&s.id).map(|p| p.id.clone()),
        in_context: coverage.summary_in_context(&s.id),
        covered_by: coverage.summary_covered_by(s).map(|c| c.id.clone()),
        supersedes: s.supersedes.clone(),
        superseded_by: conv.superseded_by(&s.id).map(|r| r.id.clone()),
    })
}

fn describe_turn(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    coverage: &Coverage<'_>,
    t: &Turn,
) -> Result<TurnDescription, ApiError> {
    let body = bodies.turn_body(conv, t.seq)?;
    Ok(TurnDescription {
        conversation: conv.key.clone(),
        seq: t.seq,
        event_id: body.event_id.to_string(),
        time: t.time,
        role: t.role,
        tokens: u64::from(t.tokens),
        context_tokens: u64::from(t.context_tokens),
        bytes: u64::from(t.bytes),
        large_payload: t.large_payload,
        epoch: t.epoch,
        placement: coverage.turn(t),
        message: body.message.clone(),
        model: body.model.clone(),
        sender: body.sender.clone(),
        usage: body.usage,
        metadata: body.metadata.clone(),
    })
}

pub fn describe(
    state: &State,
    bodies: &dyn TurnBodies,
    req: &DescribeRequest,
) -> Result<DescribeResponse, ApiError> {
    let conv = conversation(state, &req.conversation)?;
    let coverage = Coverage::new(conv)?;
    let seq = match &req.id {
        NodeRef::Seq(seq) => Some(*seq),
        NodeRef::Id(id) => {
            if id.is_empty() {
                return Err(ApiError::BadRequest("`id` is empty".into()));
            }
            if let Some(i) = conv.summary_index(id) {
                return Ok(DescribeResponse::Summary(Box::new(describe_summary(
                    conv, bodies, &coverage, i,
                )?)));
            }
            // Newest first: ids are looked up mostly for recent turns.
            let digest = event_digest(id);
            for t in conv.turns.iter().rev().filter(|t| t.event == digest) {
                // A digest names a candidate; its body has the id.
                if &*bodies.turn_body(conv, t.seq)?.event_id == id.as_str() {
                    return Ok(DescribeResponse::Turn(Box::new(describe_turn(
                        conv, bodies, &coverage, t,
                    )?)));
                }
            }
            id.parse::<u64>().ok()
        }
    };
    match seq {
        Some(seq) if seq < conv.turns.len() as u64 => {
            let t = turn(conv, seq)?;
            Ok(DescribeResponse::Turn(Box::new(describe_turn(
                conv, bodies, &coverage, t,
            )?)))
        }
        Some(seq) => Err(ApiError::BadRequest(format!(
            "no turn {seq} in {:?}: it has {} turns (0..={})",
            conv.key,
            conv.turns.len(),
            conv.turns.len().saturating_sub(1)
        ))),
        None => Err(ApiError::BadRequest(format!(
            "{:?} is neither a summary id, a turn's event id nor a turn number in {:?}",
            match &req.id {
                NodeRef::Id(id) => id.as_str(),
                NodeRef::Seq(_) => "",
            },
            conv.key
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::{self, CONV, NEEDLE};
    use crate::core::state::Resident;

    fn req(id: NodeRef) -> DescribeRequest {
        DescribeRequest {
            conversation: CONV.into(),
            id,
        }
    }

    #[test]
    fn a_leaf_summary_with_its_parent() {
        let (state, _) = testing::folded();
        let conv = testing::conv(state);
        let leaf = conv
            .summaries
            .iter()
            .find(|s| s.depth == 0 && conv.parent_of(&s.id).is_some())
            .expect("a condensed leaf");
        let DescribeResponse::Summary(d) =
            describe(state, &Resident, &req(NodeRef::Id(leaf.id.clone()))).unwrap()
        else {
            panic!("expected a summary");
        };
        assert_eq!(d.summary_kind, SummaryKind::Leaf);
        let index = conv.summary_index(&leaf.id).unwrap();
        assert_eq!(d.content, &**conv.summary_texts.get(index).unwrap());
        assert_eq!(d.parent, conv.parent_of(&leaf.id).map(|p| p.id.clone()));
        assert!(!d.in_context);
        assert!(d.covered_by.is_some());
        assert!(
            !d.fallback,
            "the deterministic summarizer's summaries are final"
        );
        assert_eq!(d.turn_span, leaf.last_turn - leaf.first_turn + 1);
        assert_eq!(
            d.covers,
            Covers::Turns {
                first: leaf.first_turn,
                last: leaf.last_turn
            }
        );
    }

    #[test]
    fn a_turn_by_seq_by_event_id_and_by_digits() {
        let (state, _) = testing::folded();
        let conv = testing::conv(state);
        let by_seq = describe(state, &Resident, &req(NodeRef::Seq(0))).unwrap();
        let by_id = describe(
            state,
            &Resident,
            &req(NodeRef::Id(
                conv.bodies.get(0).unwrap().event_id.to_string(),
            )),
        )
        .unwrap();
        let by_digits = describe(state, &Resident, &req(NodeRef::Id("0".into()))).unwrap();
        assert_eq!(by_seq, by_id);
        assert_eq!(by_seq, by_digits);
        let DescribeResponse::Turn(t) = by_seq else {
            panic!("expected a turn");
        };
        assert!(t.message.text_content().contains(NEEDLE));
        assert_eq!(t.sender.as_deref(), Some("agent-7"));
        assert!(!t.placement.in_context && t.placement.covered_by.is_some());
        let last = conv.turns.len() as u64 - 1;
        let DescribeResponse::Turn(t) =
            describe(state, &Resident, &req(NodeRef::Seq(last))).unwrap()
        else {
            panic!("expected a turn");
        };
        assert!(
            t.placement.in_context,
            "the newest turn is in the fresh tail"
        );
    }

    #[test]
    fn a_large_payload_comes_back_whole() {
        let (state, policy) = testing::folded();
        let small = crate::core::policy::PolicyConfig {
            large_payload_threshold_tokens: 100,
            ..policy.clone()
        };
        let mut events = testing::events();
        events.truncate(4);
        let big = "payload line with many words in it\n".repeat(40);
        events.push(crate::core::event::Envelope::new(
            "big",
            CONV,
            testing::T0 + 100_000,
            crate::core::event::EventBody::TurnAppended(crate::core::event::TurnAppended::from(
                ChatMessage::text(Role::User, big.clone()),
            )),
        ));
        let folded = testing::fold_events(&small, &events);
        let _ = state;
        let DescribeResponse::Turn(t) =
            describe(&folded, &Resident, &req(NodeRef::Id("big".into()))).unwrap()
        else {
            panic!("expected a turn");
        };
        assert!(t.large_payload);
        assert!(t.context_tokens < t.tokens);
        assert_eq!(t.message.text_content(), big);
    }

    #[test]
    fn unknown_ids_are_bad_requests() {
        let (state, _) = testing::folded();
        for id in [
            NodeRef::Id("sum_nope".into()),
            NodeRef::Seq(1_000_000),
            NodeRef::Id(String::new()),
        ] {
            assert!(
                matches!(
                    describe(state, &Resident, &req(id.clone())),
                    Err(ApiError::BadRequest(_))
                ),
                "{id:?}"
            );
        }
    }
}
