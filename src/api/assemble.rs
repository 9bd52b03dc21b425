//! `assemble`: what the model sees now, within a budget, in OpenAI chat
//! shape, with token counts, where each message came from and what did not
//! fit. A thin wrapper over [`crate::core::assembly::assemble`].

use crate::api::{conversation, ApiError};
use crate::core::assembly::{self, Assembled, AssemblyRequest, LeftOut, SentMessage};
use crate::core::message::ChatMessage;
use crate::core::policy::PolicyConfig;
use crate::core::state::{State, TurnBodies};
use serde::{Deserialize, Serialize};
use std::borrow::Borrow;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssembleRequest {
    pub conversation: String,
    /// Token budget for the whole context, prompt included (default: the
    /// conversation's resolved budget).
    #[serde(default)]
    pub budget: Option<u64>,
    /// The prompt about to be sent; its tokens are reserved from the budget.
    #[serde(default)]
    pub prompt: Option<String>,
    /// Prompt-aware eviction (default false): when the context older than
    /// the fresh tail does not all fit, keep the items most relevant to
    /// `prompt` rather than the newest; the reply's `chosen_by_relevance`
    /// lists the items kept that way.
    #[serde(default)]
    pub prompt_aware_eviction: bool,
    /// Summaries as they are (default false): the room left is not given
    /// back by opening summaries into what they cover, so the answer
    /// changes only when the summaries do (the gateway's summary block).
    #[serde(default)]
    pub summaries_as_they_are: bool,
    /// The context the agent already holds (from an earlier reply's
    /// `delta`): when it is still the start of the context, only the
    /// messages after it are sent. The reply then carries a `delta`.
    #[serde(default)]
    pub since: Option<Since>,
}

/// The first `messages` messages of an earlier reply, by fingerprint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Since {
    pub messages: usize,
    /// The earlier reply's `delta.fingerprint`; may be left out (or empty)
    /// with `messages: 0`, to ask for a first reply with a `delta`.
    #[serde(default)]
    pub fingerprint: String,
}

/// Which part of the context a reply to a request with `since` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    /// Index in the context of the reply's first message: the `since`
    /// count when the agent's messages are still the start of the context,
    /// else 0 (the context changed before that point: all of it is sent).
    pub from: usize,
    /// Messages in the whole context.
    pub messages: usize,
    /// Fingerprint of the whole context: send it back as
    /// `since.fingerprint`, with `since.messages` = `messages`.
    pub fingerprint: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AssembleResponse<M = ChatMessage> {
    pub conversation: String,
    /// `messages`, `sources` (one per message), `tokens`, `budget`,
    /// `prompt_tokens`, `fresh_tail_tokens`, `over_budget`, `left_out`.
    #[serde(flatten)]
    pub assembled: Assembled<M>,
    /// Tokens of everything left out (listed or not).
    pub left_out_tokens: u64,
    /// Items left out; `left_out` lists the newest [`MAX_LEFT_OUT_LISTED`].
    pub left_out_count: usize,
    /// Present when the request had `since`: `messages` and `sources` then
    /// start at `delta.from`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta>,
}

/// Keeps only what follows `since` when it still starts the context.
fn apply_since<M: Borrow<ChatMessage>>(
    assembled: &mut Assembled<M>,
    since: Option<&Since>,
) -> Option<Delta> {
    let since = since?;
    let (prefix, fingerprint) = assembly::fingerprints(&assembled.messages, since.messages);
    let unchanged = prefix.is_some_and(|p| since.messages == 0 || p == since.fingerprint);
    let from = if unchanged { since.messages } else { 0 };
    assembled.messages.drain(..from);
    assembled.sources.drain(..from);
    Some(Delta {
        from,
        messages: from + assembled.messages.len(),
        fingerprint,
    })
}

/// Most left-out items listed in a reply. A long uncompacted conversation
/// leaves out tens of thousands of turns; listing them all made replies
/// bigger than the server's max payload. The newest are the ones worth
/// expanding, so they are kept.
pub const MAX_LEFT_OUT_LISTED: usize = 500;

/// Totals the left-out items, then keeps the newest listed.
fn cap_left_out(left_out: &mut Vec<LeftOut>) -> (usize, u64) {
    let count = left_out.len();
    let tokens = left_out.iter().map(|l| l.tokens).sum();
    left_out.drain(..count.saturating_sub(MAX_LEFT_OUT_LISTED));
    (count, tokens)
}

/// [`assemble_borrowed`], with the stored turns copied into the reply.
pub fn assemble(
    state: &State,
    bodies: &dyn TurnBodies,
    policy: &PolicyConfig,
    req: &AssembleRequest,
) -> Result<AssembleResponse, ApiError> {
    Ok(assemble_borrowed(state, bodies, policy, req)?.into_owned())
}

/// [`AssembleResponse`] with the stored turns borrowed from the state:
/// what a server serializes (the same JSON), without copying the context
/// first.
pub type AssembleResponseRef = AssembleResponse<SentMessage>;

impl AssembleResponseRef {
    pub fn into_owned(self) -> AssembleResponse {
        AssembleResponse {
            conversation: self.conversation,
            assembled: self.assembled.into_owned(),
            left_out_tokens: self.left_out_tokens,
            left_out_count: self.left_out_count,
            delta: self.delta,
        }
    }
}

/// Assembles a conversation's context, stored turns shared with the state
/// and its body cache.
pub fn assemble_borrowed(
    state: &State,
    bodies: &dyn TurnBodies,
    policy: &PolicyConfig,
    req: &AssembleRequest,
) -> Result<AssembleResponseRef, ApiError> {
    let conv = conversation(state, &req.conversation)?;
    if req.budget == Some(0) {
        return Err(ApiError::BadRequest(
            "`budget` must be at least 1 token (omit it for the conversation's budget)".into(),
        ));
    }
    let mut assembled = assembly::assemble_from(
        conv,
        bodies,
        policy,
        &AssemblyRequest {
            budget: req.budget,
            prompt: req.prompt.clone(),
            prompt_aware_eviction: req.prompt_aware_eviction,
            summaries_as_they_are: req.summaries_as_they_are,
        },
    )?;
    let (left_out_count, left_out_tokens) = cap_left_out(&mut assembled.left_out);
    let delta = apply_since(&mut assembled, req.since.as_ref());
    Ok(AssembleResponseRef {
        conversation: conv.key.clone(),
        left_out_tokens,
        left_out_count,
        assembled,
        delta,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::{self, CONV};
    use crate::core::assembly::{check_tool_pairing, Source};
    use crate::core::state::Resident;

    fn req(budget: Option<u64>) -> AssembleRequest {
        AssembleRequest {
            conversation: CONV.into(),
            budget,
            prompt: None,
            prompt_aware_eviction: false,
            summaries_as_they_are: false,
            since: None,
        }
    }

    fn since(messages: usize, fingerprint: &str) -> AssembleRequest {
        AssembleRequest {
            since: Some(Since {
                messages,
                fingerprint: fingerprint.into(),
            }),
            ..req(None)
        }
    }

    #[test]
    fn since_sends_only_what_follows_an_unchanged_start() {
        let (state, policy) = testing::folded();
        let full = assemble(state, &Resident, policy, &req(None)).unwrap();
        assert_eq!(full.delta, None);
        let n = full.assembled.messages.len();
        assert!(n > 3);

        // A first reply with a delta: everything, and its fingerprint.
        let first = assemble(state, &Resident, policy, &since(0, "")).unwrap();
        let delta = first.delta.clone().unwrap();
        assert_eq!((delta.from, delta.messages), (0, n));
        assert_eq!(first.assembled.messages, full.assembled.messages);

        // An agent holding all but the last two messages gets those two.
        assert_eq!(prefix_of(&full, n), delta.fingerprint);
        let tail = assemble(
            state,
            &Resident,
            policy,
            &since(n - 2, &prefix_of(&full, n - 2)),
        )
        .unwrap();
        assert_eq!(tail.delta.as_ref().unwrap().from, n - 2);
        assert_eq!(tail.delta.as_ref().unwrap().messages, n);
        assert_eq!(tail.assembled.messages, full.assembled.messages[n - 2..]);
        assert_eq!(tail.assembled.sources, full.assembled.sources[n - 2..]);
        // Token counts and what was left out still describe the whole context.
        assert_eq!(tail.assembled.tokens, full.assembled.tokens);
        assert_eq!(tail.left_out_count, full.left_out_count);

        // Holding it all: nothing to send.
        let none = assemble(state, &Resident, policy, &since(n, &delta.fingerprint)).unwrap();
        assert!(none.assembled.messages.is_empty());
        assert_eq!(none.delta.unwrap().from, n);

        // The borrowed form (what the service encodes) agrees.
        let borrowed = assemble_borrowed(
            state,
            &Resident,
            policy,
            &since(n - 2, &prefix_of(&full, n - 2)),
        )
        .unwrap();
        assert_eq!(
            serde_json::to_value(&borrowed).unwrap(),
            serde_json::to_value(&tail).unwrap()
        );
    }

    /// The fingerprint of `full`'s first `n` messages.
    fn prefix_of(full: &AssembleResponse, n: usize) -> String {
        assembly::fingerprints(&full.assembled.messages, n)
            .0
            .unwrap()
    }

    #[test]
    fn since_a_changed_or_unknown_start_sends_everything() {
        let (state, policy) = testing::folded();
        let full = assemble(state, &Resident, policy, &req(None)).unwrap();
        let n = full.assembled.messages.len();
        for request in [
            // Another fingerprint: the agent's messages are not this start.
            since(n - 2, &prefix_of(&full, n - 1)),
            since(n - 2, "not a fingerprint"),
            // More messages than the context has.
            since(
                n + 1,
                &assembly::fingerprints(&full.assembled.messages, 0).1,
            ),
        ] {
            let out = assemble(state, &Resident, policy, &request).unwrap();
            let delta = out.delta.unwrap();
            assert_eq!((delta.from, delta.messages), (0, n));
            assert_eq!(out.assembled.messages, full.assembled.messages);
        }
    }

    #[test]
    fn since_is_checked_like_the_rest_of_the_request() {
        let err = serde_json::from_str::<AssembleRequest>(
            r#"{"conversation": "c", "since": {"messages": 1, "fingerprnt": "x"}}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("fingerprnt"), "{err}");
        let ok: AssembleRequest =
            serde_json::from_str(r#"{"conversation": "c", "since": {"messages": 0}}"#).unwrap();
        assert_eq!(ok.since.unwrap().fingerprint, "");
    }

    #[test]
    fn assembles_summaries_then_the_fresh_tail() {
        let (state, policy) = testing::folded();
        let out = assemble(state, &Resident, policy, &req(None)).unwrap();
        let a = &out.assembled;
        assert_eq!(a.messages.len(), a.sources.len());
        assert!(check_tool_pairing(&a.messages).is_ok());
        // The rolling session state (if any) first, then summaries.
        let first = a
            .sources
            .iter()
            .find(|s| **s != Source::RollingState)
            .unwrap();
        assert!(matches!(first, Source::Summary { .. }), "{:?}", a.sources);
        assert!(!a.over_budget);
        assert!(a.tokens <= a.budget);
        assert_eq!(out.left_out_tokens, 0);
        let last = a.messages.last().unwrap();
        assert_eq!(last.text_content(), "What is left to do?");
    }

    #[test]
    fn a_long_left_out_list_keeps_the_newest_and_counts_all() {
        let mut left_out: Vec<LeftOut> = (0..MAX_LEFT_OUT_LISTED as u64 + 7)
            .map(|seq| LeftOut {
                source: Source::Turn { seq },
                tokens: 2,
            })
            .collect();
        let total = left_out.len();
        let (count, tokens) = cap_left_out(&mut left_out);
        assert_eq!((count, tokens), (total, 2 * total as u64));
        assert_eq!(left_out.len(), MAX_LEFT_OUT_LISTED);
        assert_eq!(left_out[0].source, Source::Turn { seq: 7 }, "the oldest go");
        let mut short = left_out[..3].to_vec();
        assert_eq!(cap_left_out(&mut short), (3, 6));
        assert_eq!(short.len(), 3, "a short list is whole");
    }

    #[test]
    fn a_small_budget_leaves_out_the_oldest_and_says_so() {
        let (state, policy) = testing::folded();
        let full = assemble(state, &Resident, policy, &req(None)).unwrap();
        let budget = full.assembled.fresh_tail_tokens + 1;
        let out = assemble(state, &Resident, policy, &req(Some(budget))).unwrap();
        assert!(!out.assembled.left_out.is_empty());
        assert_eq!(
            out.left_out_tokens,
            out.assembled.left_out.iter().map(|l| l.tokens).sum::<u64>()
        );
        assert!(out.left_out_tokens > 0);
        assert!(out.assembled.messages.len() < full.assembled.messages.len());
        let json = serde_json::to_value(&out).unwrap();
        assert_eq!(json["budget"], budget);
        assert!(json["messages"][0]["role"].is_string(), "OpenAI chat shape");
    }

    #[test]
    fn the_prompt_is_reserved_from_the_budget() {
        let (state, policy) = testing::folded();
        let mut r = req(None);
        r.prompt = Some("Summarize the billing work so far.".into());
        let out = assemble(state, &Resident, policy, &r).unwrap();
        assert!(out.assembled.prompt_tokens > 0);
    }

    #[test]
    fn the_borrowed_response_serializes_as_the_owned_one() {
        let (state, policy) = testing::folded();
        let full = assemble(state, &Resident, policy, &req(None)).unwrap();
        let mut prompted = req(Some(full.assembled.fresh_tail_tokens + 1));
        prompted.prompt = Some("What \"next\"?\n".into());
        for r in [req(None), req(Some(1)), prompted] {
            let owned =
                serde_json::to_string(&assemble(state, &Resident, policy, &r).unwrap()).unwrap();
            let borrowed =
                serde_json::to_string(&assemble_borrowed(state, &Resident, policy, &r).unwrap())
                    .unwrap();
            assert_eq!(borrowed, owned);
        }
        let mut r = req(None);
        r.conversation = "nobody".into();
        assert!(matches!(
            assemble_borrowed(state, &Resident, policy, &r),
            Err(ApiError::UnknownConversation { .. })
        ));
    }

    #[test]
    fn zero_budget_and_unknown_conversation_are_errors() {
        let (state, policy) = testing::folded();
        assert!(matches!(
            assemble(state, &Resident, policy, &req(Some(0))),
            Err(ApiError::BadRequest(_))
        ));
        let mut r = req(None);
        r.conversation = "nobody".into();
        assert!(matches!(
            assemble(state, &Resident, policy, &r),
            Err(ApiError::UnknownConversation { .. })
        ));
    }
}
