//! Assembly: what the model sees. Summaries, then the fresh tail verbatim,
//! within a token budget, valid for a provider (no tool result without its
//! call, no call without its result). Answers from state alone: the agent's
//! hot path never waits on a summarizer.

use crate::core::event::Covers;
use crate::core::mask;
use crate::core::message::{ChatMessage, Content, Role};
use crate::core::policy::{self, PlanView, PolicyConfig};
use crate::core::relevance::{self, Group};
use crate::core::state::{BodyError, ContextItem, Conversation, Resident, TurnBodies, TurnBody};
use crate::core::tokens;
use serde::{Deserialize, Serialize};
use std::borrow::Borrow;
use std::collections::BTreeSet;
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
    /// Summaries as they are (off unless asked): the room left is not
    /// given back (no summary opened into what it covers, no user turn
    /// under a summary added, no masked output restored), so what is sent
    /// changes only when the summaries do. The gateway's summary block is
    /// built this way: a provider's prompt cache keeps hitting.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub summaries_as_they_are: bool,
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
    /// A turn older than the fresh tail, masked to save room: its tool
    /// output as a one-line stub, long call arguments cut
    /// ([`crate::core::mask`]); `describe` gives it whole.
    MaskedTurn {
        seq: u64,
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
    /// Summaries in context that were sent as what they cover (their
    /// children, or their turns) because the budget had room for it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expanded: Vec<String>,
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
    // Counted where a sweep places it and again where the fold applies
    // it: kept for the second count.
    tokens::count_message_kept(
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
            expanded: self.expanded,
        }
    }
}

/// Share of the budget (percent) that user turns summarized away may take
/// back verbatim, newest first, each whole or not at all.
pub const USER_TURNS_SHARE_PERCENT: u64 = 30;

/// Assembles the context of a conversation, its turns' bodies read from
/// `bodies` (and shared, not copied).
///
/// Three steps, each within the budget:
///
/// 1. The fresh tail, whole; then the older context items (tool groups,
///    newest first, or with prompt-aware eviction the most relevant) at
///    their most compact: summaries as they are, raw turns older than the
///    fresh tail masked ([`mask`]: tool output as a one-line stub, long
///    call arguments cut). A fresh tail over the whole budget has its own
///    tool output masked, oldest first, until it fits. Then the rolling
///    session state.
/// 2. The room left goes back, in the reverse of the order things are
///    compressed: the user's own words first (user turns under the
///    summaries in context, verbatim, newest first, up to
///    [`USER_TURNS_SHARE_PERCENT`] of the budget, never cut), then
///    summaries of summaries opened into their children, then leaf
///    summaries opened into their turns (masked), newest first, each only
///    whole; then masked tool output restored, newest first.
/// 3. Everything in conversation order, the rolling state first.
///
/// What a summary stands for is never sent twice: an opened summary is
/// replaced by what it covers, and a user turn is sent after the summary
/// that covers it.
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

    // Step 1. Units are tool groups: [start, end) with a boundary at both
    // ends, newest first. The fresh tail is always taken whole; older
    // units are taken newest first, at their compact cost, until one does
    // not fit: it and everything older is left out (or, with prompt-aware
    // eviction, the most relevant older units that fit are kept instead).
    let prompt = req.prompt.as_deref().filter(|p| !p.trim().is_empty());
    let aware = req.prompt_aware_eviction && prompt.is_some();
    // The tool groups ("units") looked at, newest first, and their slots.
    let mut units: Vec<Group> = Vec::new();
    let mut unit_slots: Vec<Vec<Slot>> = Vec::new();
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
        let fresh = start >= tail;
        let missing = missing_results(conv, bodies, start, end, end == n)?;
        let mut slots = Vec::with_capacity(end - start + missing.len());
        for i in start..end {
            slots.push(match conv.context[i] {
                ContextItem::Turn(seq) => turn_slot(conv, bodies, seq, !fresh)?,
                ContextItem::Summary(k) => Slot::Summary {
                    index: k,
                    cost: conv.summaries[k as usize].tokens,
                },
            });
        }
        for call_id in missing {
            slots.push(Slot::Stub {
                cost: stub_tokens(enc, &call_id),
                call_id,
            });
        }
        let t: u64 = slots.iter().map(Slot::cost).sum();
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
        units.push(Group {
            start,
            end,
            tokens: t,
            fresh,
        });
        unit_slots.push(slots);
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
    // What is left out, oldest first: the items never looked at, then the
    // units that did not fit.
    let mut left_out: Vec<LeftOut> = (0..left_end)
        .map(|i| LeftOut {
            source: source_of(conv, conv.context[i]),
            tokens: conv.item(i).tokens(),
        })
        .collect();
    let mut older: Vec<Slot> = Vec::new();
    let mut fresh_slots: Vec<Slot> = Vec::new();
    for ((unit, slots), kept) in units.into_iter().zip(unit_slots).zip(keep).rev() {
        if !kept {
            left_out.extend((unit.start..unit.end).map(|i| LeftOut {
                source: source_of(conv, conv.context[i]),
                tokens: conv.item(i).tokens(),
            }));
        } else if unit.fresh {
            fresh_slots.extend(slots);
        } else {
            older.extend(slots);
        }
    }
    // A fresh tail over the whole budget (a tool group of many results)
    // has its tool output masked, oldest first, until it fits: better than
    // a context the provider refuses. Over budget is then what even that
    // cannot bring under it.
    if fresh_tail_tokens + prompt_tokens > budget {
        let saved = fit_fresh(
            conv,
            bodies,
            &mut fresh_slots,
            fresh_tail_tokens + prompt_tokens - budget,
        )?;
        fresh_tail_tokens -= saved;
        used -= saved;
    }
    let over_budget = fresh_tail_tokens + prompt_tokens > budget;
    // The rolling state comes before the room is given back: it is the
    // handover in a few hundred characters.
    let rolling = rolling.filter(|(_, t)| used + t <= budget);
    if let Some((_, t)) = &rolling {
        used += t;
    }

    // Step 2: give the room back (unless summaries go as they are).
    let mut users = BTreeSet::new();
    let mut expanded = Vec::new();
    if !req.summaries_as_they_are {
        let mut room = budget.saturating_sub(used);
        let room_before = room;
        users = user_turns_back(conv, bodies, &older, budget, &mut room)?;
        open_condensed(conv, &mut older, &mut room, &mut expanded);
        open_leaves(conv, bodies, &users, &mut older, &mut room, &mut expanded)?;
        unmask(&mut older, &mut room);
        used = (used + room_before).saturating_sub(room);
    }

    // Step 3: in conversation order.
    let mut messages = Vec::with_capacity(older.len() + fresh_slots.len() + users.len() + 1);
    let mut sources = Vec::with_capacity(messages.capacity());
    if let Some((msg, _)) = rolling {
        messages.push(SentMessage::Built(Box::new(msg)));
        sources.push(Source::RollingState);
    }
    for (slot, fresh) in older
        .into_iter()
        .map(|s| (s, false))
        .chain(fresh_slots.into_iter().map(|s| (s, true)))
    {
        match slot {
            Slot::Summary { index, .. } => {
                let s = &conv.summaries[index as usize];
                messages.push(render(
                    conv,
                    bodies,
                    cfg,
                    ContextItem::Summary(index),
                    fresh,
                )?);
                sources.push(source_of(conv, ContextItem::Summary(index)));
                for &seq in users.range(s.first_turn..=s.last_turn) {
                    messages.push(render(conv, bodies, cfg, ContextItem::Turn(seq), false)?);
                    sources.push(Source::Turn { seq });
                }
            }
            Slot::Turn {
                seq,
                masked: Some((m, _)),
                show_raw: false,
                ..
            } => {
                messages.push(SentMessage::Built(m));
                sources.push(Source::MaskedTurn { seq });
            }
            Slot::Turn { seq, .. } => {
                messages.push(render(conv, bodies, cfg, ContextItem::Turn(seq), fresh)?);
                sources.push(Source::Turn { seq });
            }
            Slot::Stub { call_id, .. } => {
                messages.push(SentMessage::Built(Box::new(ChatMessage {
                    role: Role::Tool,
                    content: Some(Content::Text(STUB_NOTE.into())),
                    tool_calls: Vec::new(),
                    tool_call_id: Some(call_id.clone()),
                    name: None,
                })));
                sources.push(Source::MissingToolResult { call_id });
            }
        }
    }
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
        expanded,
    })
}

/// One piece of the assembled context, and what it costs.
#[derive(Debug)]
pub(crate) enum Slot {
    Turn {
        seq: u64,
        raw: u64,
        /// The masked rendering and its cost, when it is shorter.
        masked: Option<(Box<ChatMessage>, u64)>,
        show_raw: bool,
    },
    Summary {
        index: u32,
        cost: u64,
    },
    /// A result the provider requires but the agent never recorded.
    Stub {
        call_id: String,
        cost: u64,
    },
}

impl Slot {
    fn cost(&self) -> u64 {
        match self {
            Slot::Turn {
                masked: Some((_, c)),
                show_raw: false,
                ..
            } => *c,
            Slot::Turn { raw, .. } => *raw,
            Slot::Summary { cost, .. } | Slot::Stub { cost, .. } => *cost,
        }
    }
}

/// Turn `seq` as a slot: masked when `maskable` and masking makes it
/// shorter, else as assembly always sends it.
fn turn_slot(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    seq: u64,
    maskable: bool,
) -> Result<Slot, BodyError> {
    let t = &conv.turns[seq as usize];
    let raw = u64::from(t.context_tokens);
    let plain = Slot::Turn {
        seq,
        raw,
        masked: None,
        show_raw: true,
    };
    // The fold counted its masked rendering (0: none is shorter).
    let cost = u64::from(t.masked_tokens);
    if !maskable || t.large_payload || cost == 0 || cost >= raw {
        return Ok(plain);
    }
    let body = bodies.turn_body(conv, seq)?;
    Ok(match mask::masked(&body.message, seq) {
        Some(m) => Slot::Turn {
            seq,
            raw,
            masked: Some((Box::new(m), cost)),
            show_raw: false,
        },
        None => plain,
    })
}

/// The user turns under the summaries kept, newest first, that fit the
/// room and [`USER_TURNS_SHARE_PERCENT`] of the budget (a turn that does
/// not fit is skipped, never cut); demonstrations of another task are not
/// the user's words.
fn user_turns_back(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    older: &[Slot],
    budget: u64,
    room: &mut u64,
) -> Result<BTreeSet<u64>, BodyError> {
    let mut users = BTreeSet::new();
    // Without overflow for any budget a request may name (the gateway
    // asks with a quarter of u64's range to mean "no budget").
    let cap =
        budget / 100 * USER_TURNS_SHARE_PERCENT + budget % 100 * USER_TURNS_SHARE_PERCENT / 100;
    let mut taken = 0u64;
    // The user turns under the summaries kept, newest first.
    let mut candidates: Vec<u64> = Vec::new();
    for slot in older.iter().rev() {
        let Slot::Summary { index, .. } = slot else {
            continue;
        };
        let s = &conv.summaries[*index as usize];
        for seq in (s.first_turn..=s.last_turn).rev() {
            let Some(t) = conv.turns.get(seq as usize) else {
                continue;
            };
            if t.role == Role::User && t.in_context && t.epoch == conv.epoch {
                candidates.push(seq);
            }
        }
    }
    // The oldest request goes first: it states the task the rest of the
    // conversation works on.
    let first = candidates.iter().rev().copied().find(|&seq| {
        bodies
            .turn_body(conv, seq)
            .is_ok_and(|b| !b.message.is_demonstration())
    });
    for seq in first.into_iter().chain(candidates) {
        let cost = u64::from(conv.turns[seq as usize].context_tokens);
        if users.contains(&seq) || taken + cost > cap || cost > *room {
            continue;
        }
        if bodies.turn_body(conv, seq)?.message.is_demonstration() {
            continue;
        }
        taken += cost;
        *room -= cost;
        users.insert(seq);
    }
    Ok(users)
}

/// Opens summaries of summaries into their children, newest first, while
/// the children fit; stops at the first that does not.
fn open_condensed(
    conv: &Conversation,
    older: &mut Vec<Slot>,
    room: &mut u64,
    expanded: &mut Vec<String>,
) {
    while let Some(pos) = older.iter().rposition(|s| {
        matches!(s, Slot::Summary { index, .. }
            if matches!(conv.summaries[*index as usize].covers, Covers::Summaries { .. }))
    }) {
        let Slot::Summary { index, cost } = older[pos] else {
            return;
        };
        let s = &conv.summaries[index as usize];
        let Covers::Summaries { ids } = &s.covers else {
            return;
        };
        let children: Vec<Slot> = ids
            .iter()
            .filter_map(|id| conv.summary_index(id))
            .map(|k| Slot::Summary {
                index: k,
                cost: conv.summaries[k as usize].tokens,
            })
            .collect();
        let more: u64 = children.iter().map(Slot::cost).sum();
        if children.is_empty() || more.saturating_sub(cost) > *room {
            return;
        }
        *room = (*room + cost).saturating_sub(more);
        expanded.push(s.id.clone());
        older.splice(pos..=pos, children);
    }
}

/// Opens leaf summaries into the turns they cover (masked, with stubs for
/// results never recorded), newest first, while they fit; stops at the
/// first that does not. User turns already sent after the summary are
/// paid for.
fn open_leaves(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    users: &BTreeSet<u64>,
    older: &mut Vec<Slot>,
    room: &mut u64,
    expanded: &mut Vec<String>,
) -> Result<(), BodyError> {
    let mut tried = older.len();
    while let Some(pos) = older[..tried].iter().rposition(|s| {
        matches!(s, Slot::Summary { index, .. }
            if matches!(conv.summaries[*index as usize].covers, Covers::Turns { .. }))
    }) {
        tried = pos;
        let Slot::Summary { index, cost } = older[pos] else {
            return Ok(());
        };
        let s = &conv.summaries[index as usize];
        let seqs: Vec<u64> = (s.first_turn..=s.last_turn)
            .filter(|&q| {
                conv.turns
                    .get(q as usize)
                    .is_some_and(|t| t.in_context && t.epoch == conv.epoch)
            })
            .collect();
        // Already paid: the summary and the user turns sent after it.
        let paid = cost
            + users
                .range(s.first_turn..=s.last_turn)
                .map(|&q| u64::from(conv.turns[q as usize].context_tokens))
                .sum::<u64>();
        // A cheap bound first: even masked, a turn costs a few tokens.
        if seqs.is_empty() || (seqs.len() as u64 * 4).saturating_sub(paid) > *room {
            return Ok(());
        }
        let slots = span_slots(conv, bodies, &seqs)?;
        let more: u64 = slots.iter().map(Slot::cost).sum();
        if more.saturating_sub(paid) > *room {
            return Ok(());
        }
        *room = (*room + paid).saturating_sub(more);
        expanded.push(s.id.clone());
        older.splice(pos..=pos, slots);
    }
    Ok(())
}

/// The slots of a run of turns (whole tool groups), masked where that is
/// shorter, each group followed by stubs for the results it never got.
fn span_slots(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    seqs: &[u64],
) -> Result<Vec<Slot>, BodyError> {
    let mut slots = Vec::with_capacity(seqs.len());
    let mut g = 0;
    while g < seqs.len() {
        let mut e = g + 1;
        while e < seqs.len() && conv.turns[seqs[e] as usize].role == Role::Tool {
            e += 1;
        }
        for &seq in &seqs[g..e] {
            slots.push(turn_slot(conv, bodies, seq, true)?);
        }
        let head = &conv.turns[seqs[g] as usize];
        if head.role == Role::Assistant && head.has_tool_calls() {
            let answered = |call: u64| {
                seqs[g + 1..e]
                    .iter()
                    .any(|&q| conv.turns[q as usize].result_for() == Some(call))
            };
            if !head.call_digests().iter().all(|&c| answered(c)) {
                let body = bodies.turn_body(conv, seqs[g])?;
                for call in &body.message.tool_calls {
                    if !answered(crate::core::state::call_digest(&call.id)) {
                        slots.push(Slot::Stub {
                            cost: stub_tokens(conv.encoding, &call.id),
                            call_id: call.id.clone(),
                        });
                    }
                }
            }
        }
        g = e;
    }
    Ok(slots)
}

/// Masks the fresh tail's tool output, oldest first, until `over` tokens
/// are saved (or nothing more can be); returns the tokens saved.
fn fit_fresh(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    fresh: &mut [Slot],
    over: u64,
) -> Result<u64, BodyError> {
    let mut saved = 0u64;
    for slot in fresh.iter_mut() {
        if saved >= over {
            break;
        }
        let Slot::Turn { seq, .. } = *slot else {
            continue;
        };
        if let masked @ Slot::Turn {
            masked: Some(_),
            show_raw: false,
            ..
        } = turn_slot(conv, bodies, seq, true)?
        {
            let before = slot.cost();
            *slot = masked;
            saved += before.saturating_sub(slot.cost());
        }
    }
    Ok(saved)
}

/// Restores masked turns to their full text, newest first, while each
/// fits.
fn unmask(older: &mut [Slot], room: &mut u64) {
    for slot in older.iter_mut().rev() {
        if let Slot::Turn {
            raw,
            masked: Some((_, c)),
            show_raw,
            ..
        } = slot
        {
            if !*show_raw && raw.saturating_sub(*c) <= *room {
                *room -= raw.saturating_sub(*c);
                *show_raw = true;
            }
        }
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
                ChatMessage::text(
                    Role::Assistant,
                    "In src/main.rs, I think, past the argument parsing. ".repeat(7),
                ),
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
            crate::core::derived_id::DerivedId::SummaryRecorded { summary_id: &id }.to_string(),
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
        let sent = |out: &Assembled| -> u64 {
            out.messages
                .iter()
                .map(|m| tokens::count_message(conv.encoding, m))
                .sum()
        };
        // A budget of exactly the context: the summary is sent as it is.
        let tight = AssemblyRequest {
            budget: Some(conv.context.tokens()),
            ..AssemblyRequest::default()
        };
        let out = assemble(conv, &cfg, &tight).unwrap();
        assert!(
            matches!(out.sources[0], Source::Summary { .. }),
            "{:?}",
            out.sources
        );
        assert_eq!(out.tokens, sent(&out));
        assert_eq!(out.tokens, conv.context.tokens());
        // With room, the summary is opened into its turns: still counted
        // as sent.
        let out = assemble(conv, &cfg, &AssemblyRequest::default()).unwrap();
        assert_eq!(out.expanded, vec![conv.summaries[0].id.clone()]);
        assert_eq!(out.sources[0], Source::Turn { seq: 0 });
        assert_eq!(out.tokens, sent(&out));
        // Any budget a request names is taken without overflow (the
        // gateway asks with a quarter of u64's range for "no budget").
        for budget in [u64::MAX / 4, u64::MAX] {
            let huge = AssemblyRequest {
                budget: Some(budget),
                ..AssemblyRequest::default()
            };
            let out = assemble(conv, &cfg, &huge).unwrap();
            assert_eq!(out.sources[0], Source::Turn { seq: 0 });
            assert_eq!(out.tokens, sent(&out));
        }
        // Summaries as they are: not opened, whatever the room.
        let whole = AssemblyRequest {
            budget: Some(u64::MAX / 4),
            summaries_as_they_are: true,
            ..AssemblyRequest::default()
        };
        let out = assemble(conv, &cfg, &whole).unwrap();
        assert!(
            matches!(out.sources[0], Source::Summary { .. }),
            "{:?}",
            out.sources
        );
        assert!(out.expanded.is_empty());
        assert_eq!(out.tokens, sent(&out));
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
                summaries_as_they_are: false,
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
                    summaries_as_they_are: false,
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
            summaries_as_they_are: false,
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

    /// A fresh tail larger than the whole budget (one tool group of three
    /// long results) has its tool output masked, oldest first, until it
    /// fits: the context stays within the budget, tool pairs intact, and
    /// the newest result is the last to be masked.
    #[test]
    fn fresh_tail_over_the_budget_is_masked_until_it_fits() {
        let cfg = PolicyConfig {
            fresh_tail_count: 64,
            ..PolicyConfig::default()
        };
        let mut state = State::default();
        let mut n = 0u64;
        let mut push = |state: &mut State, m: ChatMessage| {
            assert_eq!(fold(state, &cfg, &turn(n, m)).status, FoldStatus::Applied);
            n += 1;
        };
        push(
            &mut state,
            ChatMessage::text(Role::User, "List the tree, three times."),
        );
        let ids = ["call_a", "call_b", "call_c"];
        let mut call = ChatMessage::text(Role::Assistant, "listing");
        call.tool_calls = ids
            .iter()
            .map(|id| ToolCall {
                id: (*id).into(),
                kind: "function".into(),
                function: FunctionCall {
                    name: "find".into(),
                    arguments: "{}".into(),
                },
            })
            .collect();
        push(&mut state, call);
        for (k, id) in ids.iter().enumerate() {
            let listing: String = (0..300)
                .map(|i| format!("./src/module_{k}/file_{i}.rs\n"))
                .collect();
            let mut result = ChatMessage::text(Role::Tool, listing);
            result.tool_call_id = Some((*id).into());
            push(&mut state, result);
        }
        let conv = &state.conversations["c:acct"];
        let raw: u64 = conv.context.tokens();
        let one = u64::from(conv.turns[4].context_tokens);
        // Room for the newest result raw, not for all three.
        let budget = raw - one;
        let req = AssemblyRequest {
            budget: Some(budget),
            ..AssemblyRequest::default()
        };
        // The fold weighed the masked renderings: assembly counts nothing.
        let before = tokens::texts_counted();
        let out = assemble(conv, &cfg, &req).unwrap();
        assert_eq!(tokens::texts_counted(), before, "assembly counted a text");
        assert!(!out.over_budget, "{:?}", out.sources);
        assert!(out.tokens <= budget, "{} > {budget}", out.tokens);
        check_tool_pairing(&out.messages).unwrap();
        assert!(out.sources.contains(&Source::MaskedTurn { seq: 2 }));
        assert!(out.sources.contains(&Source::Turn { seq: 4 }));
        let sent: u64 = out
            .messages
            .iter()
            .map(|m| tokens::count_message(conv.encoding, m))
            .sum();
        assert_eq!(out.tokens, sent);
    }
}
