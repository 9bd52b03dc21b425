//! Assembly: what the model sees. Summaries, then the fresh tail verbatim,
//! within a token budget, valid for a provider (no tool result without its
//! call, no call without its result). Answers from state alone: the agent's
//! hot path never waits on a summarizer.

use crate::core::message::{ChatMessage, Content, Role};
use crate::core::policy::{self, PlanView, PolicyConfig};
use crate::core::relevance;
use crate::core::state::{BodyError, ContextItem, Conversation, Resident, TurnBodies, TurnBody};
use crate::core::tokens;
use serde::{Deserialize, Serialize};
use std::borrow::Borrow;
use std::sync::Arc;

/// What to assemble.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AssemblyRequest {
    /// Token budget for the whole context (prompt included when given).
    /// `None` uses the conversation's resolved budget.
    pub budget: Option<u64>,
    /// The prompt about to be sent; its tokens are reserved from the budget.
    pub prompt: Option<String>,
    /// Prompt-aware eviction (off unless asked): when the context older than
    /// the fresh tail does not all fit, keep the older items most relevant
    /// to `prompt` instead of the newest ones ([`relevance`]). Without a
    /// prompt, or when everything fits, it changes nothing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prompt_aware_eviction: bool,
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

/// The assembled context: owned messages by default, or stored turns
/// shared with the state and its body cache ([`AssembledRef`]); both
/// serialize the same.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assembled<M = ChatMessage> {
    pub messages: Vec<M>,
    pub sources: Vec<Source>,
    pub tokens: u64,
    pub budget: u64,
    pub prompt_tokens: u64,
    pub fresh_tail_tokens: u64,
    /// The fresh tail alone does not fit the budget: it is sent whole anyway.
    pub over_budget: bool,
    pub left_out: Vec<LeftOut>,
    /// With prompt-aware eviction: the items kept for their relevance to
    /// the prompt where the newest would have been kept otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chosen_by_relevance: Vec<Source>,
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

/// The message that carries a rolling session state in context.
pub fn rolling_message(state: &crate::core::event::RollingState) -> ChatMessage {
    let text = format!(
        "<session_state>\nCompleted: {}\nIn progress: {}\nDecisions: {}\nBlockers: {}\nNext: {}\n</session_state>",
        state.completed, state.in_progress, state.decisions, state.blockers, state.next
    );
    ChatMessage::text(Role::System, text)
}

/// Tokens a rolling session state costs in context (its message, overhead
/// included); the fold keeps it with the state.
pub fn rolling_tokens(enc: tokens::Encoding, state: &crate::core::event::RollingState) -> u64 {
    tokens::count_message(enc, &rolling_message(state))
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

/// Assembles the context of a conversation folded in memory (every body
/// resident), as owned messages; see [`assemble_from`] for a conversation
/// whose bodies live in a store.
pub fn assemble(
    conv: &Conversation,
    cfg: &PolicyConfig,
    req: &AssemblyRequest,
) -> Result<Assembled, BodyError> {
    Ok(assemble_from(conv, &Resident, cfg, req)?.into_owned())
}

/// A message of an assembled context: a stored turn (shared, not copied),
/// sent exactly as published, or a message assembly built (a summary, a
/// stub, the rolling state).
#[derive(Debug, Clone, PartialEq)]
pub enum SentMessage {
    Stored(Arc<TurnBody>),
    Built(Box<ChatMessage>),
}

impl SentMessage {
    pub fn into_owned(self) -> ChatMessage {
        match self {
            SentMessage::Stored(t) => t.message.clone(),
            SentMessage::Built(m) => *m,
        }
    }
}

impl std::ops::Deref for SentMessage {
    type Target = ChatMessage;
    fn deref(&self) -> &ChatMessage {
        match self {
            SentMessage::Stored(t) => &t.message,
            SentMessage::Built(m) => m,
        }
    }
}

impl Borrow<ChatMessage> for SentMessage {
    fn borrow(&self) -> &ChatMessage {
        self
    }
}

impl Serialize for SentMessage {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        ChatMessage::serialize(self, serializer)
    }
}

/// [`Assembled`] with stored turns shared: what a server answering from
/// state serializes without copying the context first.
pub type AssembledRef = Assembled<SentMessage>;

impl AssembledRef {
    pub fn into_owned(self) -> Assembled {
        Assembled {
            messages: self
                .messages
                .into_iter()
                .map(SentMessage::into_owned)
                .collect(),
            sources: self.sources,
            tokens: self.tokens,
            budget: self.budget,
            prompt_tokens: self.prompt_tokens,
            fresh_tail_tokens: self.fresh_tail_tokens,
            over_budget: self.over_budget,
            left_out: self.left_out,
            chosen_by_relevance: self.chosen_by_relevance,
        }
    }
}

/// Assembles the context of a conversation, its turns' bodies read from
/// `bodies` (and shared, not copied).
pub fn assemble_from(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    cfg: &PolicyConfig,
    req: &AssemblyRequest,
) -> Result<AssembledRef, BodyError> {
    let budget = req.budget.unwrap_or_else(|| policy::budget(conv, cfg));
    let enc = conv.encoding;
    let prompt_tokens = req.prompt.as_deref().map_or(0, |p| {
        tokens::count_text(enc, p) + tokens::MESSAGE_OVERHEAD_TOKENS
    });
    let tail = policy::fresh_tail_start(conv, cfg);
    let n = conv.context.len();
    let rolling = conv.rolling.as_ref().map(|state| {
        let msg = rolling_message(state);
        let t = match conv.rolling_tokens {
            Some((counted_by, t)) if counted_by == enc => t,
            _ => tokens::count_message(enc, &msg),
        };
        (msg, t)
    });

    // Units are tool groups: [start, end) with a boundary at both ends,
    // newest first. The fresh tail is always taken whole; older units are
    // taken newest first until one does not fit: it and everything older
    // is left out (or, with prompt-aware eviction, the most relevant older
    // units that fit are kept instead).
    let prompt = req.prompt.as_deref().filter(|p| !p.trim().is_empty());
    let aware = req.prompt_aware_eviction && prompt.is_some();
    let mut units: Vec<Unit> = Vec::new();
    let mut keep: Vec<bool> = Vec::new();
    let mut used = prompt_tokens;
    let mut fresh_tail_tokens = 0;
    let mut evicting = false;
    let mut end = n;
    let mut left_end = 0; // items [0, left_end) are left out unseen
    while end > 0 {
        let mut start = end - 1;
        while start > 0 && !policy::is_boundary(conv, start) {
            start -= 1;
        }
        let missing = missing_results(conv, bodies, start, end, end == n)?;
        let mut t: u64 = (start..end).map(|i| conv.item(i).tokens()).sum();
        t += missing.iter().map(|id| stub_tokens(enc, id)).sum::<u64>();
        let fresh = start >= tail;
        let fits = fresh || (!evicting && used + t <= budget);
        if !fits && !evicting {
            evicting = true;
            // Without prompt-aware eviction nothing older is looked at
            // (a long raw conversation costs what is sent, not its length).
            if !aware {
                left_end = end;
                break;
            }
        }
        if fresh {
            fresh_tail_tokens += t;
        }
        if fits {
            used += t;
        }
        units.push(Unit {
            start,
            end,
            tokens: t,
            missing,
            fresh,
        });
        keep.push(fits);
        end = start;
    }
    let mut chosen_by_relevance = Vec::new();
    if let (true, Some(prompt)) = (aware && evicting, prompt) {
        let relevant = relevance::choose(
            conv,
            bodies,
            prompt,
            &units,
            budget,
            prompt_tokens + fresh_tail_tokens,
        )?;
        if let Some(choice) = relevant {
            used = choice.used;
            for (u, unit) in units.iter().enumerate() {
                let kept = choice.keep[u];
                if kept && !keep[u] {
                    for i in unit.start..unit.end {
                        chosen_by_relevance.push(source_of(conv, conv.context[i]));
                    }
                }
                keep[u] = kept;
            }
            chosen_by_relevance.reverse();
        }
    }
    let mut messages = Vec::with_capacity(n + 1);
    let mut sources = Vec::with_capacity(n + 1);
    let mut left_out = Vec::new();
    for (u, unit) in units.into_iter().enumerate() {
        if !keep[u] {
            for i in (unit.start..unit.end).rev() {
                left_out.push(LeftOut {
                    source: source_of(conv, conv.context[i]),
                    tokens: conv.item(i).tokens(),
                });
            }
            continue;
        }
        for call_id in unit.missing.into_iter().rev() {
            messages.push(SentMessage::Built(Box::new(ChatMessage {
                role: Role::Tool,
                content: Some(Content::Text(STUB_NOTE.into())),
                tool_calls: Vec::new(),
                tool_call_id: Some(call_id.clone()),
                name: None,
            })));
            sources.push(Source::MissingToolResult { call_id });
        }
        for i in (unit.start..unit.end).rev() {
            let item = conv.context[i];
            messages.push(render(conv, bodies, cfg, item, i >= tail)?);
            sources.push(source_of(conv, item));
        }
    }
    left_out.extend((0..left_end).rev().map(|i| LeftOut {
        source: source_of(conv, conv.context[i]),
        tokens: conv.item(i).tokens(),
    }));
    left_out.reverse();
    let over_budget = fresh_tail_tokens + prompt_tokens > budget;
    // The rolling state is the first thing to go when space is short.
    if let Some((msg, t)) = rolling.filter(|(_, t)| used + t <= budget) {
        messages.push(SentMessage::Built(Box::new(msg)));
        sources.push(Source::RollingState);
        used += t;
    }
    messages.reverse();
    sources.reverse();
    Ok(AssembledRef {
        messages,
        sources,
        tokens: used - prompt_tokens,
        budget,
        prompt_tokens,
        fresh_tail_tokens,
        over_budget,
        left_out,
        chosen_by_relevance,
    })
}

/// A tool group of the context: items `[start, end)`, sent or left out
/// whole (no tool result without its call).
pub(crate) struct Unit {
    pub start: usize,
    pub end: usize,
    /// Its items' tokens, with the stubs for results never recorded.
    pub tokens: u64,
    missing: Vec<String>,
    pub fresh: bool,
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
fn missing_results(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    start: usize,
    end: usize,
    newest: bool,
) -> Result<Vec<String>, BodyError> {
    if newest {
        return Ok(Vec::new());
    }
    let ContextItem::Turn(seq) = conv.context[start] else {
        return Ok(Vec::new());
    };
    let head = &conv.turns[seq as usize];
    if head.role != Role::Assistant || !head.has_tool_calls() {
        return Ok(Vec::new());
    }
    let answered = |call: u64| {
        (start + 1..end).any(|i| match conv.context[i] {
            ContextItem::Turn(s) => conv.turns[s as usize].result_for() == Some(call),
            ContextItem::Summary(_) => false,
        })
    };
    if head.call_digests().iter().all(|&call| answered(call)) {
        return Ok(Vec::new());
    }
    // The turn keeps digests of its call ids; the stub names the id itself.
    let body = bodies.turn_body(conv, seq)?;
    Ok(body
        .message
        .tool_calls
        .iter()
        .map(|c| c.id.as_str())
        .filter(|id| !answered(crate::core::state::call_digest(id)))
        .map(str::to_string)
        .collect())
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

fn render(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    cfg: &PolicyConfig,
    item: ContextItem,
    fresh: bool,
) -> Result<SentMessage, BodyError> {
    Ok(match item {
        ContextItem::Summary(i) => {
            let s = &conv.summaries[i as usize];
            SentMessage::Built(Box::new(summary_message(
                &s.id,
                s.depth,
                s.first_turn,
                s.last_turn,
                s.fallback,
                &bodies.summary_text(conv, i)?,
            )))
        }
        ContextItem::Turn(seq) => {
            let turn = &conv.turns[seq as usize];
            let body = bodies.turn_body(conv, seq)?;
            let msg = &body.message;
            if turn.large_payload {
                return Ok(SentMessage::Built(Box::new(payload_stub_message(
                    msg,
                    &body.event_id,
                    u64::from(turn.tokens),
                ))));
            }
            if let Some(limit) = cfg.prune_tool_results_over_tokens {
                if !fresh && turn.role == Role::Tool && u64::from(turn.tokens) > limit {
                    let mut m = msg.clone();
                    m.content = Some(Content::Text(excerpt(&msg.text_content(), &body.event_id)));
                    return Ok(SentMessage::Built(Box::new(m)));
                }
            }
            SentMessage::Stored(body)
        }
    })
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

/// Fingerprints of a message list: of its first `prefix` messages (`None`
/// when it has fewer) and of all of them. Each message is hashed as its
/// MessagePack encoding, which is self-delimiting, so two lists share a
/// fingerprint exactly when they hold the same messages in the same order
/// (up to a blake3 collision). An agent that holds the first messages of a
/// context can thus ask for the rest only (`assemble`'s `since`).
#[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
pub fn fingerprints<M: Borrow<ChatMessage>>(
    messages: &[M],
    prefix: usize,
) -> (Option<String>, String) {
    fn hex(h: &blake3::Hasher) -> String {
        h.finalize().to_hex()[..32].to_string()
    }
    let mut hasher = blake3::Hasher::new();
    let mut at_prefix = (prefix == 0).then(|| hex(&hasher));
    // The encodings are gathered and hashed in (at most) two inputs: the
    // hasher works on many 1 KiB chunks at once only when it is given
    // them at once (hashed message by message, the `since` handler of
    // `cargo bench --bench nats_assemble` took twice as long). Where the
    // input is split does not change a blake3 hash.
    let mut encoded = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        rmp_serde::encode::write_named(&mut encoded, m.borrow()).expect("messages serialize");
        if i + 1 == prefix {
            hasher.update(&encoded);
            encoded.clear();
            at_prefix = Some(hex(&hasher));
        }
    }
    hasher.update(&encoded);
    (at_prefix, hex(&hasher))
}

/// Checks provider validity: every tool result follows the assistant turn
/// that called it (with only tool results between), and every call of a
/// non-final assistant turn has its result.
pub fn check_tool_pairing<M: Borrow<ChatMessage>>(messages: &[M]) -> Result<(), String> {
    let mut open: Vec<String> = Vec::new();
    let mut group_open = false;
    for (i, m) in messages.iter().enumerate() {
        let m: &ChatMessage = m.borrow();
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

    #[test]
    fn fingerprints_tell_prefixes_apart() {
        let a = ChatMessage::text(Role::User, "one");
        let b = ChatMessage::text(Role::Assistant, "two");
        let c = ChatMessage::text(Role::User, "three");
        let list = [a.clone(), b.clone(), c.clone()];
        let (p2, all) = fingerprints(&list, 2);
        assert_eq!(fingerprints(&list[..2], 0).1, p2.unwrap());
        assert_eq!(fingerprints(&list, 3).0.unwrap(), all);
        assert_eq!(fingerprints(&list, 4).0, None);
        assert_eq!(
            fingerprints(&list, 0).0,
            Some(fingerprints::<ChatMessage>(&[], 0).1)
        );
        // Order, content and boundaries all count.
        assert_ne!(fingerprints(&[b.clone(), a.clone(), c.clone()], 0).1, all);
        let merged = ChatMessage::text(Role::User, "onetwo");
        assert_ne!(fingerprints(&[merged], 0).1, fingerprints(&list[..2], 0).1);
        let mut renamed = c;
        renamed.name = Some("x".into());
        assert_ne!(fingerprints(&[a, b, renamed], 0).1, all);
    }
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
            EventBody::TurnAppended(TurnAppended::from(message)),
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
                supersedes: None,
            }),
        );
        assert_eq!(fold(&mut state, &cfg, &summary).status, FoldStatus::Applied);
        let conv = &state.conversations["c:acct"];
        assert!(conv.turns[3].large_payload);
        let out = assemble(conv, &cfg, &AssemblyRequest::default()).unwrap();
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
        assert_eq!(out.tokens, conv.context.tokens());
    }

    /// The rolling state's tokens are counted once, when it is folded:
    /// assembling a context counts none of the stored state again (a cold
    /// query loads no tokenizer), and what it accounts is what it sends.
    #[test]
    fn assembly_counts_nothing_the_fold_counted() {
        let cfg = PolicyConfig::default();
        let mut state = State::default();
        let turns = [
            ChatMessage::text(Role::User, "Fix the failing test in src/lib.rs."),
            ChatMessage::text(Role::Assistant, "Done: the off-by-one in parse()."),
        ];
        for (n, message) in turns.into_iter().enumerate() {
            fold(&mut state, &cfg, &turn(n as u64, message));
        }
        let rolling = Envelope::new(
            "rs_job-1",
            "c:acct",
            1_700_000_005_000,
            EventBody::RollingStateUpdated(crate::core::event::RollingStateUpdated {
                state: crate::core::event::RollingState {
                    completed: "fixed parse() in src/lib.rs".into(),
                    in_progress: "running the suite".into(),
                    decisions: "keep the old error type".into(),
                    blockers: String::new(),
                    next: "open the pull request".into(),
                },
                through_turn: 1,
                job_id: None,
            }),
        );
        assert_eq!(fold(&mut state, &cfg, &rolling).status, FoldStatus::Applied);
        let conv = &state.conversations["c:acct"];
        let before = tokens::texts_counted();
        let out = assemble(conv, &cfg, &AssemblyRequest::default()).unwrap();
        assert_eq!(tokens::texts_counted(), before, "assembly counted a text");
        assert!(
            out.sources.contains(&Source::RollingState),
            "{:?}",
            out.sources
        );
        let sent: u64 = out
            .messages
            .iter()
            .map(|m| tokens::count_message(conv.encoding, m))
            .sum();
        assert_eq!(out.tokens, sent);
        // A state stored before the count was kept is counted at assembly.
        let mut older = conv.clone();
        older.rolling_tokens = None;
        let again = assemble(&older, &cfg, &AssemblyRequest::default()).unwrap();
        assert_eq!(again.tokens, out.tokens);
    }

    /// What does not fit is listed oldest first, tool groups included, and
    /// what is sent is borrowed from the state.
    #[test]
    fn left_out_is_chronological_and_sent_turns_are_shared() {
        let cfg = PolicyConfig {
            fresh_tail_count: 2,
            ..PolicyConfig::default()
        };
        let mut state = State::default();
        for round in 0..4u64 {
            let call_id = format!("call_{round}");
            let mut call = ChatMessage::text(Role::Assistant, "looking");
            call.tool_calls = vec![ToolCall {
                id: call_id.clone(),
                kind: "function".into(),
                function: FunctionCall {
                    name: "ls".into(),
                    arguments: "{}".into(),
                },
            }];
            let mut result = ChatMessage::text(Role::Tool, "src tests benches");
            result.tool_call_id = Some(call_id);
            let question = ChatMessage::text(Role::User, format!("And now step {round}?"));
            for (k, m) in [question, call, result].into_iter().enumerate() {
                fold(&mut state, &cfg, &turn(round * 3 + k as u64, m));
            }
        }
        let conv = &state.conversations["c:acct"];
        let out = assemble_from(
            conv,
            &Resident,
            &cfg,
            &AssemblyRequest {
                budget: Some(60),
                prompt: None,
                prompt_aware_eviction: false,
            },
        )
        .unwrap();
        let left: Vec<u64> = out
            .left_out
            .iter()
            .map(|l| match l.source {
                Source::Turn { seq } => seq,
                ref other => panic!("{other:?}"),
            })
            .collect();
        assert!(left.len() >= 3, "{left:?}");
        assert!(left.windows(2).all(|w| w[0] < w[1]), "{left:?}");
        for (m, source) in out.messages.iter().zip(&out.sources) {
            let Source::Turn { seq } = source else {
                continue;
            };
            let stored = conv.bodies.get(*seq).unwrap();
            assert!(matches!(m, SentMessage::Stored(r) if Arc::ptr_eq(r, stored)));
        }
        check_tool_pairing(&out.messages).unwrap();
        assert_eq!(
            out.into_owned(),
            assemble(
                conv,
                &cfg,
                &AssemblyRequest {
                    budget: Some(60),
                    prompt: None,
                    prompt_aware_eviction: false,
                }
            )
            .unwrap()
        );
    }

    /// With prompt-aware eviction the old rounds the prompt is about are
    /// kept in place of newer ones, said in `chosen_by_relevance`; the
    /// context stays valid and within the budget; off, nothing changes.
    #[test]
    fn prompt_aware_eviction_keeps_what_the_prompt_is_about() {
        let cfg = PolicyConfig {
            fresh_tail_count: 2,
            ..PolicyConfig::default()
        };
        let mut state = State::default();
        let topics = [
            "ledger", "invoice", "rotation", "webhook", "billing", "quota",
        ];
        for (round, topic) in topics.iter().enumerate() {
            let round = round as u64;
            let call_id = format!("call_{round}");
            let mut call = ChatMessage::text(Role::Assistant, format!("checking the {topic}"));
            call.tool_calls = vec![ToolCall {
                id: call_id.clone(),
                kind: "function".into(),
                function: FunctionCall {
                    name: "grep".into(),
                    arguments: format!("{{\"q\":\"{topic}\"}}"),
                },
            }];
            let mut result = ChatMessage::text(
                Role::Tool,
                format!("src/{topic}.rs: {} lines about {topic}", 40 + round),
            );
            result.tool_call_id = Some(call_id);
            let question = ChatMessage::text(Role::User, format!("Look into the {topic} code."));
            for (k, m) in [question, call, result].into_iter().enumerate() {
                fold(&mut state, &cfg, &turn(round * 3 + k as u64, m));
            }
        }
        let conv = &state.conversations["c:acct"];
        let request = |aware: bool| AssemblyRequest {
            budget: Some(150),
            prompt: Some("What did the invoice search find?".into()),
            prompt_aware_eviction: aware,
        };
        let plain = assemble(conv, &cfg, &request(false)).unwrap();
        let aware = assemble(conv, &cfg, &request(true)).unwrap();
        let seqs = |a: &Assembled| -> Vec<u64> {
            a.sources
                .iter()
                .filter_map(|s| match s {
                    Source::Turn { seq } => Some(*seq),
                    _ => None,
                })
                .collect()
        };
        // The invoice round is turns 3..=5; the newest-first context has
        // no room for it.
        assert!(!plain.left_out.is_empty());
        assert!(!seqs(&plain).contains(&4), "{:?}", seqs(&plain));
        assert!(plain.chosen_by_relevance.is_empty());
        let kept = seqs(&aware);
        assert!(
            kept.contains(&3) && kept.contains(&4) && kept.contains(&5),
            "{kept:?}"
        );
        assert!(
            aware.chosen_by_relevance.contains(&Source::Turn { seq: 4 }),
            "{:?}",
            aware.chosen_by_relevance
        );
        assert!(kept.windows(2).all(|w| w[0] < w[1]), "{kept:?}");
        check_tool_pairing(&aware.messages).unwrap();
        assert!(
            aware.tokens + aware.prompt_tokens <= 150,
            "{}",
            aware.tokens
        );
        // Everything sent or left out, once.
        assert_eq!(
            aware.sources.len() + aware.left_out.len(),
            plain.sources.len() + plain.left_out.len()
        );
        // Without a prompt the flag changes nothing.
        let no_prompt = |aware: bool| AssemblyRequest {
            prompt: None,
            ..request(aware)
        };
        assert_eq!(
            assemble(conv, &cfg, &no_prompt(true)).unwrap(),
            assemble(conv, &cfg, &no_prompt(false)).unwrap()
        );
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
