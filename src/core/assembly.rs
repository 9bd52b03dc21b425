//! Assembly: what the model sees. Summaries, then the fresh tail verbatim,
//! within a token budget, valid for a provider (no tool result without its
//! call, no call without its result). Answers from state alone: the agent's
//! hot path never waits on a summarizer.

use crate::core::message::{ChatMessage, Content, Role};
use crate::core::policy::{self, PlanView, PolicyConfig};
use crate::core::state::{ContextItem, Conversation};
use crate::core::tokens;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// What to assemble.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AssemblyRequest {
    /// Token budget for the whole context (prompt included when given).
    /// `None` uses the conversation's resolved budget.
    pub budget: Option<u64>,
    /// The prompt about to be sent; its tokens are reserved from the budget.
    pub prompt: Option<String>,
}

/// Where an assembled message came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    Turn {
        seq: u64,
    },
    Summary {
        id: String,
        depth: u32,
    },
    RollingState,
    /// A result the provider requires but the agent never recorded.
    MissingToolResult {
        call_id: String,
    },
}

/// An item that did not fit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeftOut {
    pub source: Source,
    pub tokens: u64,
}

/// The assembled context.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assembled {
    pub messages: Vec<ChatMessage>,
    pub sources: Vec<Source>,
    pub tokens: u64,
    pub budget: u64,
    pub prompt_tokens: u64,
    pub fresh_tail_tokens: u64,
    /// The fresh tail alone does not fit the budget: it is sent whole anyway.
    pub over_budget: bool,
    pub left_out: Vec<LeftOut>,
}

const STUB_NOTE: &str = "no result was recorded for this tool call";

/// Renders a summary as the message an agent sees.
pub fn summary_message(
    id: &str,
    depth: u32,
    first: u64,
    last: u64,
    fallback: bool,
    content: &str,
) -> ChatMessage {
    let mark = if fallback { " fallback=\"true\"" } else { "" };
    ChatMessage::text(
        Role::User,
        format!(
            "<context_summary id=\"{id}\" depth=\"{depth}\" turns=\"{first}-{last}\"{mark}>\n{content}\n</context_summary>"
        ),
    )
}

/// Tokens a summary costs in context: its rendered message, wrapper and
/// message overhead included, so that what is sent is what was counted.
pub fn summary_tokens(
    enc: tokens::Encoding,
    id: &str,
    depth: u32,
    first: u64,
    last: u64,
    fallback: bool,
    content: &str,
) -> u64 {
    tokens::count_message(
        enc,
        &summary_message(id, depth, first, last, fallback, content),
    )
}

/// Assembles the context of a conversation.
pub fn assemble(conv: &Conversation, cfg: &PolicyConfig, req: &AssemblyRequest) -> Assembled {
    let budget = req.budget.unwrap_or_else(|| policy::budget(conv, cfg));
    let enc = conv.encoding;
    let prompt_tokens = req.prompt.as_deref().map_or(0, |p| {
        tokens::count_text(enc, p) + tokens::MESSAGE_OVERHEAD_TOKENS
    });
    let tail = policy::fresh_tail_start(conv, cfg);
    let n = conv.context.len();

    // Units are tool groups: [start, end) with a boundary at both ends.
    // Walk back from the end; the fresh tail is always taken whole.
    let mut units: Vec<(usize, usize, u64)> = Vec::new();
    let mut end = n;
    let mut used = prompt_tokens;
    let mut fresh_tail_tokens = 0;
    let mut cut = 0; // first included item
    let mut rolling: Option<(ChatMessage, u64)> = None;
    if let Some(state) = &conv.rolling {
        let text = format!(
            "<session_state>\nCompleted: {}\nIn progress: {}\nDecisions: {}\nBlockers: {}\nNext: {}\n</session_state>",
            state.completed, state.in_progress, state.decisions, state.blockers, state.next
        );
        let msg = ChatMessage::text(Role::System, text);
        let t = tokens::count_message(enc, &msg);
        rolling = Some((msg, t));
    }
    let mut left_out = Vec::new();
    let mut stopped = false;
    while end > 0 {
        let mut start = end - 1;
        while start > 0 && !policy::is_boundary(conv, start) {
            start -= 1;
        }
        let mut t: u64 = (start..end).map(|i| conv.item(i).tokens()).sum();
        t += missing_results(conv, start, end, end == n)
            .iter()
            .map(|id| stub_tokens(enc, id))
            .sum::<u64>();
        let in_tail = start >= tail;
        if in_tail {
            fresh_tail_tokens += t;
        } else if stopped || used + t > budget {
            stopped = true;
            for i in start..end {
                left_out.push(LeftOut {
                    source: source_of(conv, conv.context[i]),
                    tokens: conv.item(i).tokens(),
                });
            }
            end = start;
            continue;
        }
        used += t;
        units.push((start, end, t));
        cut = start;
        end = start;
    }
    left_out.reverse();
    let _ = cut;
    // The rolling state is the first thing to go when space is short.
    let rolling = rolling.filter(|(_, t)| used + t <= budget);
    let over_budget = fresh_tail_tokens + prompt_tokens > budget;

    let mut messages = Vec::with_capacity(units.iter().map(|u| u.1 - u.0).sum::<usize>() + 1);
    let mut sources = Vec::with_capacity(messages.capacity());
    let mut total = used;
    if let Some((msg, t)) = rolling {
        messages.push(msg);
        sources.push(Source::RollingState);
        total += t;
    }
    for &(start, end, _) in units.iter().rev() {
        for i in start..end {
            let item = conv.context[i];
            messages.push(render(conv, cfg, item, i >= tail).into_owned());
            sources.push(source_of(conv, item));
        }
        for call_id in missing_results(conv, start, end, end == n) {
            messages.push(ChatMessage {
                role: Role::Tool,
                content: Some(Content::Text(STUB_NOTE.into())),
                tool_calls: Vec::new(),
                tool_call_id: Some(call_id.clone()),
                name: None,
            });
            sources.push(Source::MissingToolResult { call_id });
        }
    }
    Assembled {
        messages,
        sources,
        tokens: total - prompt_tokens,
        budget,
        prompt_tokens,
        fresh_tail_tokens,
        over_budget,
        left_out,
    }
}

/// Tokens of the stub result for `call_id`: exactly what `count_message`
/// gives for the message sent (the call id can be long: count it).
fn stub_tokens(enc: tokens::Encoding, call_id: &str) -> u64 {
    tokens::MESSAGE_OVERHEAD_TOKENS
        + tokens::count_text(enc, STUB_NOTE)
        + tokens::count_text(enc, call_id)
}

/// Tool calls of a group's assistant turn that have no result in the group.
/// The newest group may still be waiting for its results: it is left as is.
fn missing_results(conv: &Conversation, start: usize, end: usize, newest: bool) -> Vec<String> {
    if newest {
        return Vec::new();
    }
    let ContextItem::Turn(seq) = conv.context[start] else {
        return Vec::new();
    };
    let head = &conv.turns[seq as usize];
    if !head.has_tool_calls() {
        return Vec::new();
    }
    head.tool_call_ids()
        .filter(|id| {
            !(start + 1..end).any(|i| match conv.context[i] {
                ContextItem::Turn(s) => conv.turns[s as usize].tool_result_for() == Some(id),
                ContextItem::Summary(_) => false,
            })
        })
        .map(str::to_string)
        .collect()
}

fn source_of(conv: &Conversation, item: ContextItem) -> Source {
    match item {
        ContextItem::Turn(seq) => Source::Turn { seq },
        ContextItem::Summary(i) => {
            let s = &conv.summaries[i as usize];
            Source::Summary {
                id: s.id.clone(),
                depth: s.depth,
            }
        }
    }
}

/// Stub text for a large payload.
pub fn payload_stub(event_id: &str, tokens: u64) -> String {
    format!("[large payload of {tokens} tokens stored as {event_id}; ask `describe` for it]")
}

/// The message sent in place of a large payload: its text replaced by a
/// stub naming the stored event, long tool-call arguments by `{}`. The fold
/// counts this very message as the turn's cost in context.
pub fn payload_stub_message(msg: &ChatMessage, event_id: &str, tokens: u64) -> ChatMessage {
    let mut m = msg.clone();
    m.content = Some(Content::Text(payload_stub(event_id, tokens)));
    for c in &mut m.tool_calls {
        if c.function.arguments.len() > 256 {
            c.function.arguments = "{}".into();
        }
    }
    m
}

fn render<'a>(
    conv: &'a Conversation,
    cfg: &PolicyConfig,
    item: ContextItem,
    fresh: bool,
) -> Cow<'a, ChatMessage> {
    match item {
        ContextItem::Summary(i) => {
            let s = &conv.summaries[i as usize];
            Cow::Owned(summary_message(
                &s.id,
                s.depth,
                s.first_turn,
                s.last_turn,
                s.fallback,
                &s.content,
            ))
        }
        ContextItem::Turn(seq) => {
            let turn = &conv.turns[seq as usize];
            let msg = &turn.body.message;
            if turn.large_payload {
                return Cow::Owned(payload_stub_message(msg, &turn.event_id, turn.tokens));
            }
            if let Some(limit) = cfg.prune_tool_results_over_tokens {
                if !fresh && turn.role == Role::Tool && turn.tokens > limit {
                    let mut m = msg.clone();
                    m.content = Some(Content::Text(excerpt(&msg.text_content(), &turn.event_id)));
                    return Cow::Owned(m);
                }
            }
            Cow::Borrowed(msg)
        }
    }
}

/// Head and tail of a long tool result.
fn excerpt(text: &str, event_id: &str) -> String {
    const KEEP: usize = 600;
    if text.len() <= 2 * KEEP {
        return text.to_string();
    }
    let head_end = text
        .char_indices()
        .map(|(i, _)| i)
        .take_while(|&i| i <= KEEP)
        .last()
        .unwrap_or(0);
    let tail_start = text
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| i >= text.len() - KEEP)
        .unwrap_or(text.len());
    format!(
        "{}\n[... {} bytes pruned; full result stored as {event_id} ...]\n{}",
        &text[..head_end],
        tail_start - head_end,
        &text[tail_start..]
    )
}

/// Checks provider validity: every tool result follows the assistant turn
/// that called it (with only tool results between), and every call of a
/// non-final assistant turn has its result.
pub fn check_tool_pairing(messages: &[ChatMessage]) -> Result<(), String> {
    let mut open: Vec<String> = Vec::new();
    let mut group_open = false;
    for (i, m) in messages.iter().enumerate() {
        if m.role == Role::Tool {
            let id = m.tool_call_id.as_deref().unwrap_or("");
            if !group_open {
                return Err(format!(
                    "message {i}: tool result {id:?} without a preceding call"
                ));
            }
            match open.iter().position(|c| c == id) {
                Some(p) => {
                    open.remove(p);
                }
                None => {
                    return Err(format!(
                        "message {i}: tool result {id:?} answers no open call"
                    ))
                }
            }
            continue;
        }
        if !open.is_empty() {
            return Err(format!("message {i}: calls {open:?} have no result"));
        }
        group_open = !m.tool_calls.is_empty();
        open = m.tool_calls.iter().map(|c| c.id.clone()).collect();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{
        Covers, Envelope, EventBody, SummaryKind, SummaryRecorded, TurnAppended,
    };
    use crate::core::fold::{fold, FoldStatus};
    use crate::core::message::{FunctionCall, ToolCall};
    use crate::core::state::{summary_id, State};

    fn turn(n: u64, message: ChatMessage) -> Envelope {
        Envelope::new(
            format!("imp-00000000000000{n:02}"),
            "c:acct",
            1_700_000_000_000 + n * 1000,
            EventBody::TurnAppended(TurnAppended {
                message,
                model: None,
                sender: None,
                usage: None,
                metadata: None,
            }),
        )
    }

    /// The tokens assembly accounts are the tokens of the messages it sends:
    /// summaries with their wrapper, large payloads as their stub.
    #[test]
    fn accounted_tokens_are_the_tokens_sent() {
        let cfg = PolicyConfig {
            fresh_tail_count: 1,
            large_payload_threshold_tokens: 100,
            ..PolicyConfig::default()
        };
        let call_id = "toolu_01XfdvT2StjnLNw7MpkvVvJP";
        let mut call = ChatMessage::text(Role::Assistant, "reading it");
        call.tool_calls = vec![ToolCall {
            id: call_id.into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "read_file".into(),
                arguments: r#"{"path":"/home/USER/src/main.rs"}"#.into(),
            },
        }];
        let mut result = ChatMessage::text(Role::Tool, "fn main() {}\n".repeat(200));
        result.tool_call_id = Some(call_id.into());
        let events = [
            turn(
                0,
                ChatMessage::text(Role::User, "Where is the entry point?"),
            ),
            turn(
                1,
                ChatMessage::text(Role::Assistant, "In src/main.rs, I think."),
            ),
            turn(2, call),
            turn(3, result),
            turn(4, ChatMessage::text(Role::User, "Thanks.")),
        ];
        let mut state = State::default();
        for e in &events {
            assert_eq!(fold(&mut state, &cfg, e).status, FoldStatus::Applied);
        }
        let covers = Covers::Turns { first: 0, last: 1 };
        let content = "The user asked where the entry point is: src/main.rs.";
        let id = summary_id("c:acct", SummaryKind::Leaf, 0, &covers, content, "leaf-v1");
        let summary = Envelope::new(
            format!("sr_{id}"),
            "c:acct",
            1_700_000_010_000,
            EventBody::SummaryRecorded(SummaryRecorded {
                summary_id: id,
                job_id: None,
                kind: SummaryKind::Leaf,
                depth: 0,
                covers,
                content: content.into(),
                source_tokens: 0,
                tokens: 0,
                model: "test".into(),
                provider: "test".into(),
                prompt_version: "leaf-v1".into(),
                fallback: false,
            }),
        );
        assert_eq!(fold(&mut state, &cfg, &summary).status, FoldStatus::Applied);
        let conv = &state.conversations["c:acct"];
        assert!(conv.turns[3].large_payload);
        let out = assemble(conv, &cfg, &AssemblyRequest::default());
        assert!(
            matches!(out.sources[0], Source::Summary { .. }),
            "{:?}",
            out.sources
        );
        let sent: u64 = out
            .messages
            .iter()
            .map(|m| tokens::count_message(conv.encoding, m))
            .sum();
        assert_eq!(out.tokens, sent);
        assert_eq!(out.tokens, conv.context_tokens);
    }

    /// A stub result costs what its message costs, long call id included.
    #[test]
    fn missing_result_stub_is_counted_with_its_call_id() {
        let enc = tokens::Encoding::O200kBase;
        let id = "toolu_01XfdvT2StjnLNw7MpkvVvJP";
        let stub = ChatMessage {
            role: Role::Tool,
            content: Some(Content::Text(STUB_NOTE.into())),
            tool_calls: Vec::new(),
            tool_call_id: Some(id.into()),
            name: None,
        };
        assert_eq!(stub_tokens(enc, id), tokens::count_message(enc, &stub));
    }
}
