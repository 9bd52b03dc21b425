//! The fold: `fold(state, event)` applies one event to a partition's state
//! and returns the decisions it took (debt changes, jobs, rejections) as
//! events with deterministic ids, to be published to the log.
//!
//! Pure and deterministic: time comes from events, ids are derived from the
//! causing event, and a decision seen again in the log changes nothing.

use crate::core::assembly;
use crate::core::event::*;
use crate::core::message::{ChatMessage, Content, Role};
use crate::core::overflow;
use crate::core::policy::{self, PolicyConfig};
use crate::core::spend;
use crate::core::state::{
    call_digest, derived_event_id, event_digest, id_digest, summary_id, tool_ids_of, turn_count,
    ContextItem, Conversation, IdDigest, PendingJob, ResidentBodies, SeenDigest, SeenTurn,
    SpendEntry, SpendWindow, State, Summary, Turn, TurnBody,
};
use crate::core::tokens;
use std::cell::RefCell;
use std::sync::Arc;

/// What became of one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FoldStatus {
    Applied,
    /// Its id was already applied: nothing changed.
    Duplicate,
    /// Rejected with a reason (also recorded as an `event_rejected` or
    /// `summary_rejected` decision).
    Rejected(String),
    /// The conversation matches an `ignore_sessions` glob.
    Ignored,
}

/// The result of folding one event.
#[derive(Debug, Clone, PartialEq)]
pub struct FoldOutcome {
    pub status: FoldStatus,
    /// Decisions to publish, in order.
    pub decisions: Vec<Envelope>,
}

/// Folds one event into the state.
pub fn fold(state: &mut State, policy: &PolicyConfig, event: &Envelope) -> FoldOutcome {
    fold_counted(state, policy, event, None)
}

/// Folds one event whose turn tokens were already counted (by the same
/// encoding the conversation uses), so counting can run ahead of the fold.
pub fn fold_counted(
    state: &mut State,
    policy: &PolicyConfig,
    event: &Envelope,
    turn_tokens: Option<u64>,
) -> FoldOutcome {
    fold_with(state, policy, event, turn_tokens, None)
}

/// [`fold_counted`] for an event the caller owns (one just decoded): a
/// turn moves into the state instead of being copied there. Same result.
pub fn fold_owned(
    state: &mut State,
    policy: &PolicyConfig,
    mut event: Envelope,
    turn_tokens: Option<u64>,
) -> FoldOutcome {
    let turn = match &mut event.body {
        EventBody::TurnAppended(t) => Some(Arc::new(TurnBody::new(
            &event.id,
            std::mem::replace(t, empty_turn()),
        ))),
        _ => None,
    };
    fold_with(state, policy, &event, turn_tokens, turn)
}

/// What is left in an event whose turn was moved out; never read.
fn empty_turn() -> TurnAppended {
    TurnAppended::from(ChatMessage {
        role: Role::User,
        content: None,
        tool_calls: Vec::new(),
        tool_call_id: None,
        name: None,
    })
}

/// `turn` is the event's turn, already moved out of it when given.
fn fold_with(
    state: &mut State,
    policy: &PolicyConfig,
    event: &Envelope,
    turn_tokens: Option<u64>,
    turn: Option<Arc<TurnBody>>,
) -> FoldOutcome {
    if policy::session_matches(&policy.ignore_sessions, &event.conversation) {
        return FoldOutcome {
            status: FoldStatus::Ignored,
            decisions: Vec::new(),
        };
    }
    let State {
        conversations,
        spend: global,
        ..
    } = state;
    // Look up before inserting: `entry` would allocate the key every event.
    if !conversations.contains_key(&event.conversation) {
        conversations.insert(
            event.conversation.clone(),
            Conversation::new(&event.conversation),
        );
    }
    let Some(conv) = conversations.get_mut(&event.conversation) else {
        unreachable!("the conversation was just inserted");
    };
    let event_digest = id_digest(&event.id);
    if conv.has_applied_digest(&event_digest) {
        return FoldOutcome {
            status: FoldStatus::Duplicate,
            decisions: Vec::new(),
        };
    }
    let mut cx = FoldContext {
        conv,
        global,
        policy,
        event,
        event_digest,
        turn_tokens,
        turn,
        decisions: Vec::new(),
    };
    let status = cx.apply();
    FoldOutcome {
        status,
        decisions: cx.decisions,
    }
}

/// The id a rejection gives a record that has none of its own (bytes that
/// never became an event, or an id too long to repeat): derived from the
/// bytes, so replaying the same log rejects the same way.
pub fn undecodable_id(bytes: &[u8]) -> String {
    let digest = blake3::hash(bytes).to_hex();
    format!("undecodable_{}", &digest[..20])
}

/// Records a record that intake refused (see [`crate::core::intake`]) in
/// the conversation its transport vouches for, as an `event_rejected`
/// decision; returns it. Refusing the same record again changes nothing.
/// The refused event's own id is not consumed: a forged event must not
/// keep the real one with that id out.
pub fn reject_record(
    state: &mut State,
    conversation: &str,
    rejected_id: &str,
    event_type: Option<&str>,
    reason: &str,
    time: u64,
) -> Envelope {
    let env = Envelope::new(
        derived_event_id(rejected_id, "event_rejected"),
        conversation,
        time,
        EventBody::EventRejected(EventRejected {
            rejected_id: rejected_id.to_string(),
            event_type: event_type.map(str::to_string),
            reason: reason.to_string(),
        }),
    );
    if !state.conversations.contains_key(conversation) {
        state
            .conversations
            .insert(conversation.to_string(), Conversation::new(conversation));
    }
    if let Some(conv) = state.conversations.get_mut(conversation) {
        if !conv.has_applied(&env.id) {
            conv.mark_applied(&env.id);
            conv.rejections += 1;
            conv.push_history(time, &env.id, "event_rejected", reason.to_string());
        }
    }
    env
}

/// Where an accepted summary goes: the context range it takes the place
/// of, the raw turns under it, the tokens it was written over and the
/// tokens that leave the context.
struct Placement {
    start: usize,
    end: usize,
    first_turn: u64,
    last_turn: u64,
    source_tokens: u64,
    removed_tokens: u64,
}

struct FoldContext<'a> {
    conv: &'a mut Conversation,
    /// The partition's spend window across conversations.
    global: &'a mut SpendWindow,
    policy: &'a PolicyConfig,
    event: &'a Envelope,
    event_digest: IdDigest,
    turn_tokens: Option<u64>,
    /// The turn, when the caller gave it up: it is kept without a copy.
    turn: Option<Arc<TurnBody>>,
    decisions: Vec<Envelope>,
}

impl FoldContext<'_> {
    fn apply(&mut self) -> FoldStatus {
        let event = self.event;
        self.conv.last_time = self.conv.last_time.max(event.time);
        let status = match &event.body {
            EventBody::TurnAppended(t) => match self.turn.take() {
                Some(owned) => self.turn_appended(&owned.turn, Some(&owned)),
                None => self.turn_appended(t, None),
            },
            EventBody::ProviderErrorObserved(e) => self.provider_error(e),
            EventBody::CompactionRequested(r) => self.compaction_requested(r),
            EventBody::ModelDeclared(m) => {
                self.conv.model = Some(m.model.clone());
                if m.context_window.is_some() {
                    self.conv.context_window = m.context_window;
                }
                if self.conv.turns.is_empty() {
                    self.conv.encoding = tokens::Encoding::for_model(Some(&m.model));
                }
                FoldStatus::Applied
            }
            EventBody::ConversationReset(r) => self.reset(r),
            EventBody::SummaryRecorded(s) => self.summary_recorded(s),
            EventBody::SweepEnded(s) => self.sweep_ended(s),
            EventBody::RecallAnswered(r) => self.recall_answered(r),
            EventBody::RollingStateUpdated(r) => {
                if let (Some(pending), Some(id)) = (&mut self.conv.pending_job, &r.job_id) {
                    if &pending.job.job_id == id {
                        pending.rolling_refreshed = true;
                    }
                }
                self.conv.rolling = Some(r.state.clone());
                self.conv.rolling_through = Some(r.through_turn);
                self.conv.rolling_due = false;
                self.conv.turns_since_rolling = 0;
                self.conv.consecutive_tool_calls = 0;
                FoldStatus::Applied
            }
            EventBody::EventRejected(r) => {
                // A rejection made by a runtime that could not decode bytes.
                self.conv.rejections += 1;
                self.history("event_rejected", r.reason.clone());
                FoldStatus::Applied
            }
            body if body.is_decision() => {
                // A decision this fold did not take (another policy wrote it):
                // kept for audit, never acted on.
                self.history(
                    body.type_name(),
                    "observed, not derived by this policy".into(),
                );
                FoldStatus::Applied
            }
            _ => FoldStatus::Applied,
        };
        if status == FoldStatus::Applied && event.body.is_agent_event() {
            self.conv.awaiting_input = false;
        }
        match &status {
            // A rejected summary already produced its `summary_rejected`.
            FoldStatus::Rejected(reason)
                if !matches!(event.body, EventBody::SummaryRecorded(_)) =>
            {
                self.conv.rejections += 1;
                let reason = reason.clone();
                self.history("event_rejected", reason.clone());
                self.decide(
                    "event_rejected",
                    EventBody::EventRejected(EventRejected {
                        rejected_id: event.id.clone(),
                        event_type: Some(event.type_name().to_string()),
                        reason,
                    }),
                );
            }
            _ => {}
        }
        // A rejected event's id is still consumed: a redelivery is a no-op.
        self.conv.mark_applied_digest(self.event_digest);
        if status != FoldStatus::Duplicate {
            self.evaluate();
        }
        status
    }

    fn history(&mut self, event_type: &str, detail: String) {
        let (time, id) = (self.event.time, self.event.id.clone());
        self.conv.push_history(time, &id, event_type, detail);
    }

    fn decide(&mut self, what: &str, body: EventBody) {
        let env = Envelope::new(
            derived_event_id(&self.event.id, what),
            self.conv.key.clone(),
            self.event.time,
            body,
        );
        self.conv.mark_applied(&env.id);
        self.decisions.push(env);
    }

    /// `shared` is `t` itself when the state may keep it as it is.
    fn turn_appended(&mut self, t: &TurnAppended, shared: Option<&Arc<TurnBody>>) -> FoldStatus {
        let msg = &t.message;
        if msg.role == Role::Tool {
            let Some(call_id) = msg.tool_call_id.as_deref() else {
                return FoldStatus::Rejected("tool turn without tool_call_id".into());
            };
            let call = call_digest(call_id);
            let known = self
                .conv
                .turns
                .iter()
                .rev()
                .any(|turn| turn.epoch == self.conv.epoch && turn.makes_call(call));
            if !known {
                return FoldStatus::Rejected(format!(
                    "orphan tool result: no earlier assistant turn made tool call {call_id:?}"
                ));
            }
        }
        if msg.tool_calls.iter().any(|c| c.id.is_empty()) {
            return FoldStatus::Rejected("assistant tool call with an empty id".into());
        }
        // The guards compare turns by the digest of their normalized text,
        // computed only for turns whose cheap sketch matches (`Probe`).
        let seq = self.conv.turns.len() as u64;
        let mut probe = Probe::new(msg);
        let Conversation {
            bodies,
            flood,
            recent_user_turns,
            ..
        } = &mut *self.conv;
        // Replay-flood guard.
        let second = self.event.time / 1000;
        if flood.second != second {
            flood.second = second;
            flood.counts.clear();
        }
        let count = match flood
            .counts
            .iter_mut()
            .find_map(|(seen, c)| probe.same_as(seen, bodies).then_some(c))
        {
            Some(c) => {
                *c += 1;
                *c
            }
            None => {
                flood.counts.push((probe.seen(seq), 1));
                1
            }
        };
        let limit = if msg.role == Role::User {
            self.policy.flood_max_user_per_second
        } else {
            self.policy.flood_max_other_per_second
        };
        if count > limit {
            if count == 1 {
                // Rejected, so never turn `seq`: its entry keeps the digest.
                if let Some((seen, _)) = flood.counts.last_mut() {
                    seen.digest = SeenDigest::Known(probe.digest().0);
                }
            }
            return FoldStatus::Rejected(format!(
                "replay flood: {count} identical {} turns within one second (limit {limit})",
                msg.role.as_str()
            ));
        }
        // Duplicate long user turns within the window stay out of context.
        let mut in_context = true;
        if msg.role == Role::User
            && probe.normalized_chars_at_least(self.policy.duplicate_min_chars)
        {
            let now = self.event.time;
            let window = self.policy.duplicate_window_ms;
            recent_user_turns.retain(|(t, _)| now.saturating_sub(*t) <= window);
            if recent_user_turns
                .iter_mut()
                .any(|(_, seen)| probe.same_as(seen, bodies))
            {
                in_context = false;
                self.conv.duplicates_dropped += 1;
                self.history(
                    "duplicate_user_turn",
                    format!("identical to a user turn within {window} ms"),
                );
            } else {
                recent_user_turns.push((now, probe.seen(seq)));
            }
        }
        if self.conv.model.is_none() && self.conv.turns.is_empty() {
            if let Some(model) = &t.model {
                self.conv.encoding = tokens::Encoding::for_model(Some(model));
            }
        }
        let tokens = self
            .turn_tokens
            .unwrap_or_else(|| tokens::count_message(self.conv.encoding, msg));
        self.push_turn(t, tokens, in_context, shared);
        FoldStatus::Applied
    }

    fn push_turn(
        &mut self,
        t: &TurnAppended,
        tokens: u64,
        mut in_context: bool,
        shared: Option<&Arc<TurnBody>>,
    ) {
        let msg = &t.message;
        let seq = self.conv.turns.len() as u64;
        // A late tool result (its call's group already closed) would break
        // tool pairing in context: it is kept, but out of context.
        if in_context && msg.role == Role::Tool {
            let call_id = msg.tool_call_id.as_deref().unwrap_or("");
            let call = call_digest(call_id);
            let attached = self.conv.context.iter().rev().find_map(|item| match *item {
                ContextItem::Turn(s) => {
                    let prev = &self.conv.turns[s as usize];
                    if prev.role == Role::Tool {
                        None
                    } else {
                        Some(prev.makes_call(call))
                    }
                }
                ContextItem::Summary(_) => Some(false),
            });
            if attached != Some(true) {
                in_context = false;
                self.history(
                    "late_tool_result",
                    format!("result for {call_id:?} arrived after its group closed"),
                );
            }
        }
        // A turn bigger than the compaction target could never be kept in
        // a context that respects the budget (and may hold the fresh tail
        // over it): it is a large payload there too, whatever the knob says.
        let levels = policy::levels(self.conv, self.policy);
        let large = tokens
            > self
                .policy
                .large_payload_threshold_tokens
                .min(levels.target_tokens);
        let context_tokens = if large {
            // Shown as a stub: it costs what the stub message costs.
            tokens::count_message(
                self.conv.encoding,
                &assembly::payload_stub_message(msg, &self.event.id, tokens),
            )
        } else {
            tokens
        };
        let bytes = msg.text_bytes() as u64;
        // Stored as 32-bit counts; what context sums is the same count.
        let (tokens, context_tokens, bytes) = (
            u64::from(turn_count(tokens)),
            u64::from(turn_count(context_tokens)),
            u64::from(turn_count(bytes)),
        );
        // Grown by an eighth, not doubled: every resident turn is here, and
        // a doubled vector is a third empty on average.
        if self.conv.turns.len() == self.conv.turns.capacity() {
            let len = self.conv.turns.len();
            self.conv.turns.reserve_exact((len / 8).max(8));
        }
        self.conv.turns.push(Turn {
            seq,
            time: self.event.time,
            event: event_digest(&self.event.id),
            tokens: turn_count(tokens),
            context_tokens: turn_count(context_tokens),
            bytes: turn_count(bytes),
            epoch: self.conv.epoch,
            role: msg.role,
            in_context,
            large_payload: large,
            tool_ids: tool_ids_of(msg),
        });
        self.conv.bodies.insert(
            seq,
            shared.map_or_else(
                || Arc::new(TurnBody::new(&self.event.id, t.clone())),
                Arc::clone,
            ),
        );
        if in_context {
            self.conv.context.push(ContextItem::Turn(seq));
            self.conv.context_tokens += context_tokens;
            self.conv.context_bytes += bytes;
        }
        self.conv.turns_since_rolling += 1;
        match msg.role {
            Role::Assistant if !msg.tool_calls.is_empty() => {
                self.conv.consecutive_tool_calls += msg.tool_calls.len() as u64
            }
            Role::User => self.conv.consecutive_tool_calls = 0,
            _ => {}
        }
        let before = self.conv.context_tokens.saturating_sub(context_tokens);
        if self.conv.turns_since_rolling >= self.policy.rolling_every_turns
            || self.conv.consecutive_tool_calls >= self.policy.rolling_tool_loop
            || (before <= levels.rolling_tokens && self.conv.context_tokens > levels.rolling_tokens)
        {
            self.conv.rolling_due = true;
        }
    }

    fn provider_error(&mut self, e: &ProviderErrorObserved) -> FoldStatus {
        let verdict = overflow::classify(&e.error);
        if !verdict.overflow {
            self.history(
                "provider_error_observed",
                "not a context overflow; no compaction".into(),
            );
            return FoldStatus::Applied;
        }
        self.conv.last_overflow_tokens = verdict.requested_tokens;
        let levels = policy::levels(self.conv, self.policy);
        let mut target = levels.target_tokens;
        if let Some(limit) = verdict.limit_tokens {
            // The provider told us its real limit: aim under it.
            target = target.min((limit as f64 * self.policy.context_target) as u64);
        }
        self.history(
            "provider_error_observed",
            format!(
                "context overflow (requested {:?}, limit {:?}); urgent compaction to {target} tokens",
                verdict.requested_tokens, verdict.limit_tokens
            ),
        );
        self.raise_debt(DebtReason::Overflow, true, target, None);
        FoldStatus::Applied
    }

    fn compaction_requested(&mut self, r: &CompactionRequested) -> FoldStatus {
        let levels = policy::levels(self.conv, self.policy);
        let target = r.target_tokens.unwrap_or(levels.target_tokens);
        self.history(
            "compaction_requested",
            format!("manual compaction to {target} tokens"),
        );
        self.raise_debt(DebtReason::Manual, true, target, r.instructions.clone());
        FoldStatus::Applied
    }

    fn reset(&mut self, r: &ConversationReset) -> FoldStatus {
        let c = &mut *self.conv;
        c.epoch += 1;
        c.context.clear();
        c.context_edits.record();
        c.context_tokens = 0;
        c.context_bytes = 0;
        c.pending_job = None;
        c.turns_since_rolling = 0;
        c.consecutive_tool_calls = 0;
        c.rolling_due = false;
        c.rolling = None;
        c.rolling_through = None;
        c.recent_user_turns.clear();
        let reason = r
            .reason
            .clone()
            .unwrap_or_else(|| "conversation reset".into());
        self.history("conversation_reset", reason);
        if self.conv.debt.take().is_some() {
            self.decide(
                "debt_cleared",
                EventBody::DebtCleared(DebtCleared {
                    reason: "conversation reset".into(),
                }),
            );
        }
        FoldStatus::Applied
    }

    /// Records a new debt or coalesces a trigger into the pending one.
    fn raise_debt(
        &mut self,
        reason: DebtReason,
        urgent: bool,
        target: u64,
        instructions: Option<String>,
    ) {
        let levels = policy::levels(self.conv, self.policy);
        let now = self.event.time;
        match &mut self.conv.debt {
            None => {
                let debt = Debt {
                    reason,
                    context_tokens: self.conv.context_tokens,
                    threshold_tokens: levels.threshold_tokens,
                    target_tokens: target,
                    urgent,
                    since: now,
                    instructions,
                };
                self.conv.debt = Some(debt.clone());
                self.history(
                    "debt_recorded",
                    format!("{reason:?} at {} tokens", debt.context_tokens),
                );
                self.decide("debt_recorded", EventBody::DebtRecorded(debt));
                // Re-summarization takes nothing out of context, so it is not
                // a compaction cycle: no memory flush for it.
                if reason != DebtReason::Resummarize {
                    self.start_cycle(reason);
                }
            }
            Some(debt) => {
                // Re-summarization is the least important reason: any other
                // trigger takes the debt over (its reason, urgency and
                // target), so compaction is never held up behind it.
                let takes_over =
                    debt.reason == DebtReason::Resummarize && reason != DebtReason::Resummarize;
                let stronger = urgent && !debt.urgent;
                let changed =
                    takes_over || stronger || target < debt.target_tokens || instructions.is_some();
                if !changed {
                    return;
                }
                if takes_over {
                    debt.reason = reason;
                    debt.urgent = urgent;
                    debt.target_tokens = target;
                    debt.threshold_tokens = levels.threshold_tokens;
                    // Its age is the compaction's, not the re-summarization's.
                    debt.since = now;
                } else if stronger {
                    debt.reason = reason;
                    debt.urgent = true;
                }
                debt.target_tokens = debt.target_tokens.min(target);
                debt.context_tokens = self.conv.context_tokens;
                if instructions.is_some() {
                    debt.instructions = instructions;
                }
                let debt = debt.clone();
                self.history(
                    "debt_updated",
                    format!("{:?}, target {}", debt.reason, debt.target_tokens),
                );
                self.decide("debt_updated", EventBody::DebtUpdated(debt));
                // Compaction starts here: its cycle (and memory flush) too.
                if takes_over {
                    self.start_cycle(reason);
                }
            }
        }
    }

    /// A compaction cycle begins: one memory flush for it.
    fn start_cycle(&mut self, reason: DebtReason) {
        self.conv.cycle += 1;
        let cycle = self.conv.cycle;
        self.decide(
            "memory_flush_requested",
            EventBody::MemoryFlushRequested(MemoryFlushRequested { cycle, reason }),
        );
    }

    fn summary_recorded(&mut self, s: &SummaryRecorded) -> FoldStatus {
        let checked = match &s.supersedes {
            None => self.validate_summary(s),
            Some(old) => self.validate_resummary(s, old),
        };
        match checked {
            Ok(Placement {
                start,
                end,
                first_turn,
                last_turn,
                source_tokens,
                removed_tokens,
            }) => {
                // What it costs in context is its rendered message, wrapper
                // included: assembly's budget is kept in real tokens.
                let tokens = assembly::summary_tokens(
                    self.conv.encoding,
                    &s.summary_id,
                    s.depth,
                    first_turn,
                    last_turn,
                    s.fallback,
                    &s.content,
                );
                let index = self.conv.summaries.len() as u32;
                self.conv.summaries.push(Summary {
                    id: s.summary_id.clone(),
                    kind: s.kind,
                    depth: s.depth,
                    covers: s.covers.clone(),
                    first_turn,
                    last_turn,
                    tokens,
                    source_tokens,
                    model: s.model.clone(),
                    provider: s.provider.clone(),
                    prompt_version: s.prompt_version.clone(),
                    fallback: s.fallback,
                    time: self.event.time,
                    job_id: s.job_id.clone(),
                    supersedes: s.supersedes.clone(),
                });
                self.conv
                    .summary_texts
                    .push(index, Arc::from(s.content.as_str()));
                let removed_bytes: u64 = self.conv.context[start..end]
                    .iter()
                    .map(|i| match i {
                        ContextItem::Turn(seq) => u64::from(self.conv.turns[*seq as usize].bytes),
                        ContextItem::Summary(_) => 0,
                    })
                    .sum();
                self.conv
                    .context
                    .splice(start..end, [ContextItem::Summary(index)]);
                self.conv.context_edits.record();
                self.conv.context_tokens = self.conv.context_tokens - removed_tokens + tokens;
                self.conv.context_bytes -= removed_bytes;
                if let (Some(pending), Some(id)) = (&mut self.conv.pending_job, &s.job_id) {
                    if &pending.job.job_id == id {
                        pending.committed += 1;
                    }
                }
                self.history(
                    "summary_recorded",
                    format!(
                        "{} {:?} depth {} over turns {first_turn}..={last_turn}: {source_tokens} -> {tokens} tokens{}{}",
                        s.summary_id,
                        s.kind,
                        s.depth,
                        if s.fallback { " (deterministic fallback)" } else { "" },
                        s.supersedes.as_ref().map_or(String::new(), |old| format!(
                            ", replaces fallback {old} ({removed_tokens} tokens in context)"
                        ))
                    ),
                );
                FoldStatus::Applied
            }
            Err(reason) => {
                self.conv.stale_summaries += 1;
                self.history("summary_rejected", format!("{}: {reason}", s.summary_id));
                self.decide(
                    "summary_rejected",
                    EventBody::SummaryRejected(SummaryRejected {
                        summary_id: s.summary_id.clone(),
                        job_id: s.job_id.clone(),
                        reason: reason.clone(),
                    }),
                );
                FoldStatus::Rejected(reason)
            }
        }
    }

    /// What every recorded summary must be: its own content address, not
    /// empty, not recorded before.
    fn validate_identity(&self, s: &SummaryRecorded) -> Result<(), String> {
        let expected = summary_id(
            &self.conv.key,
            s.kind,
            s.depth,
            &s.covers,
            &s.content,
            &s.prompt_version,
        );
        if expected != s.summary_id {
            return Err(format!(
                "id is not the content address of the summary (expected {expected})"
            ));
        }
        if s.content.trim().is_empty() {
            return Err("empty summary".into());
        }
        if self.conv.summary_index(&s.summary_id).is_some() {
            return Err("stale: this summary was already recorded".into());
        }
        Ok(())
    }

    /// Checks a re-summarization: a model summary that takes the place of
    /// fallback summary `old` in context, over exactly the same sources.
    /// The sources are no longer in context, so the placement is `old`'s
    /// own slot and the source tokens are the ones `old` was written over.
    fn validate_resummary(&self, s: &SummaryRecorded, old: &str) -> Result<Placement, String> {
        self.validate_identity(s)?;
        if s.fallback {
            return Err(format!(
                "a fallback summary cannot supersede {old}: only a model summary replaces a fallback"
            ));
        }
        let Some(index) = self.conv.summary_index(old) else {
            return Err(format!("supersedes unknown summary {old}"));
        };
        let replaced = &self.conv.summaries[index as usize];
        if !replaced.fallback {
            return Err(format!(
                "supersedes {old}, which is not a deterministic fallback summary"
            ));
        }
        let Some(pos) = self
            .conv
            .context
            .iter()
            .position(|i| *i == ContextItem::Summary(index))
        else {
            return Err(format!(
                "stale: {old} is no longer in context (condensed, superseded or reset)"
            ));
        };
        if s.kind != replaced.kind || s.depth != replaced.depth || s.covers != replaced.covers {
            return Err(format!(
                "does not cover exactly what {old} covers: kind, depth and covers must match \
                 ({:?} depth {} {:?} vs {:?} depth {} {:?})",
                s.kind, s.depth, s.covers, replaced.kind, replaced.depth, replaced.covers
            ));
        }
        Ok(Placement {
            start: pos,
            end: pos + 1,
            first_turn: replaced.first_turn,
            last_turn: replaced.last_turn,
            source_tokens: replaced.source_tokens,
            removed_tokens: replaced.tokens,
        })
    }

    /// Checks that a summary matches the current state exactly; returns the
    /// context range it replaces, its turn span and source tokens.
    fn validate_summary(&self, s: &SummaryRecorded) -> Result<Placement, String> {
        self.validate_identity(s)?;
        let ctx = &self.conv.context;
        match (&s.kind, &s.covers) {
            (SummaryKind::Leaf, Covers::Turns { first, last }) => {
                if s.depth != 0 {
                    return Err("a leaf summary has depth 0".into());
                }
                if first > last || *last as usize >= self.conv.turns.len() {
                    return Err(format!("covers unknown turns {first}..={last}"));
                }
                let Some(start) = ctx.iter().position(|i| *i == ContextItem::Turn(*first)) else {
                    return Err(format!("stale: turn {first} is no longer raw in context"));
                };
                // Summaries stay a prefix of the context: a leaf that did not
                // start at the oldest raw turn would leave raw turns between
                // two summaries, which no later leaf could cover. A chunk
                // planned on an old snapshot (an expired or superseded job)
                // is refused here once another summary took its place.
                let oldest = policy::raw_start(&*self.conv);
                if start != oldest {
                    let oldest_turn = match ctx.get(oldest) {
                        Some(ContextItem::Turn(seq)) => seq.to_string(),
                        _ => "none".into(),
                    };
                    return Err(format!(
                        "stale or out of order: turn {first} is not the oldest raw turn in context \
                         (turn {oldest_turn} is); a leaf summary must start there so no raw turn \
                         is left between summaries"
                    ));
                }
                let mut end = start;
                let mut tokens = 0;
                for seq in *first..=*last {
                    let turn = &self.conv.turns[seq as usize];
                    if !turn.in_context {
                        continue;
                    }
                    if ctx.get(end) != Some(&ContextItem::Turn(seq)) {
                        return Err(format!(
                            "stale or non-contiguous: turn {seq} is not next in context"
                        ));
                    }
                    tokens += turn.context_tokens;
                    end += 1;
                }
                let conv: &Conversation = self.conv;
                if !policy::is_boundary(conv, start) || !policy::is_boundary(conv, end) {
                    return Err("the chunk separates a tool call from its result".into());
                }
                // The hard line: the newest fresh_tail_count turns are never summarized.
                let tail = policy::fresh_tail_start_with(conv, self.policy, false);
                if end > tail {
                    return Err("covers turns of the fresh tail".into());
                }
                Ok(Placement {
                    start,
                    end,
                    first_turn: *first,
                    last_turn: *last,
                    source_tokens: u64::from(tokens),
                    removed_tokens: u64::from(tokens),
                })
            }
            (SummaryKind::Condensed, Covers::Summaries { ids }) => {
                if ids.len() < 2 {
                    return Err("a condensed summary covers at least two summaries".into());
                }
                let mut start = None;
                let mut tokens = 0;
                let (mut first_turn, mut last_turn) = (u64::MAX, 0);
                for (k, id) in ids.iter().enumerate() {
                    let Some(index) = self.conv.summary_index(id) else {
                        return Err(format!("covers unknown summary {id}"));
                    };
                    let child = &self.conv.summaries[index as usize];
                    if child.depth + 1 != s.depth {
                        return Err(match s.depth.checked_sub(1) {
                            Some(expected) => {
                                format!("child {id} has depth {}, expected {expected}", child.depth)
                            }
                            None => "a condensed summary has depth 1 or more".into(),
                        });
                    }
                    let Some(pos) = ctx.iter().position(|i| *i == ContextItem::Summary(index))
                    else {
                        return Err(format!("stale: summary {id} is already condensed"));
                    };
                    match start {
                        None => start = Some(pos),
                        Some(s0) if pos != s0 + k => {
                            return Err("children are not contiguous in context".into())
                        }
                        _ => {}
                    }
                    tokens += child.tokens;
                    first_turn = first_turn.min(child.first_turn);
                    last_turn = last_turn.max(child.last_turn);
                }
                let start = start.unwrap_or(0);
                Ok(Placement {
                    start,
                    end: start + ids.len(),
                    first_turn,
                    last_turn,
                    source_tokens: tokens,
                    removed_tokens: tokens,
                })
            }
            _ => Err("kind and covers disagree".into()),
        }
    }

    fn sweep_ended(&mut self, s: &SweepEnded) -> FoldStatus {
        let now = self.event.time;
        let window = self.policy.summary_call_window_ms;
        // Only the pending job's end decides what comes next. The end of a
        // job that expired (its progress was judged then) or was reset away
        // still counts its spend and its Retry-After, nothing else.
        let pending = match &self.conv.pending_job {
            Some(p) if p.job.job_id == s.job_id => self.conv.pending_job.take(),
            _ => None,
        };
        let current = pending.is_some();
        // Spend counts from when the job was granted its allowance, so the
        // job's calls and the window that allowed them are the same window.
        let spent_at = pending.as_ref().map_or(now, |p| p.job.issued_at.min(now));
        let entry = SpendEntry {
            time: spent_at,
            job_id: s.job_id.clone(),
            conversation: String::new(),
            calls: s.calls,
            tokens: s.tokens_spent,
            cost_micros: s.cost_micros,
            reserved_until: None,
        };
        self.record_spend(entry, now, window);
        // What the fold accepted of this job, never what the sweep claims:
        // a sweep cannot know which of its summaries a concurrent change
        // made stale.
        let committed = pending.as_ref().map_or(0, |p| p.committed);
        let progress = pending.as_ref().is_some_and(PendingJob::made_progress);
        let urgent = pending.as_ref().is_some_and(|p| p.job.urgent);
        self.history(
            "sweep_ended",
            format!(
                "{}: {:?} after {} passes, {committed} committed{}, {} calls{}",
                s.job_id,
                s.stop,
                s.passes,
                if s.committed == committed {
                    String::new()
                } else {
                    format!(" ({} published by the sweep)", s.committed)
                },
                s.calls,
                s.retry_after_ms
                    .map_or(String::new(), |ms| format!(", retry after {ms} ms"))
            ),
        );
        if let Some(delay) = s.retry_after_ms {
            // The provider said when to come back: no job of any kind before
            // then, whatever the round achieved.
            self.conv.spend.retry_at = self.conv.spend.retry_at.max(now.saturating_add(delay));
        }
        if !current {
            return FoldStatus::Applied;
        }
        if !progress {
            self.round_without_progress(urgent, s.retry_after_ms.is_some());
        }
        // An urgent round that found nothing to compact ends its debt; one
        // that failed (auth, deadline, rate limit) or whose summaries were
        // all stale keeps it for the next agent input.
        let nothing_to_do =
            matches!(s.stop, SweepStop::Done | SweepStop::NoProgress) && s.retry_after_ms.is_none();
        if !progress
            && s.committed == 0
            && urgent
            && nothing_to_do
            && self.conv.debt.as_ref().is_some_and(|d| d.urgent)
        {
            self.conv.debt = None;
            self.decide(
                "debt_cleared",
                EventBody::DebtCleared(DebtCleared {
                    reason: format!("urgent compaction made no progress ({:?}); nothing left outside the fresh tail", s.stop),
                }),
            );
        }
        FoldStatus::Applied
    }

    /// Records spend in the conversation's window and, under a
    /// partition-wide limit, in the partition's, both pruned to `now`.
    fn record_spend(&mut self, entry: SpendEntry, now: u64, window: u64) {
        self.conv.spend.prune(now, window);
        if spend::has_partition_limits(self.policy) {
            self.global.prune(now, window);
            self.global.record(SpendEntry {
                conversation: self.conv.key.clone(),
                ..entry.clone()
            });
        }
        self.conv.spend.record(entry);
    }

    /// A delegated recall's model calls count in the spend window (the
    /// conversation's, and the partition's under a partition-wide limit)
    /// at the event's time; nothing else changes.
    fn recall_answered(&mut self, r: &RecallAnswered) -> FoldStatus {
        let now = self.event.time;
        let window = self.policy.summary_call_window_ms;
        let entry = SpendEntry {
            time: now,
            // Not a job: the event id keeps it apart from every job's.
            job_id: self.event.id.clone(),
            conversation: String::new(),
            calls: r.calls,
            tokens: r.tokens_spent,
            cost_micros: r.cost_micros,
            reserved_until: None,
        };
        self.record_spend(entry, now, window);
        self.history(
            "recall_answered",
            format!(
                "{}: {} calls, {} tokens, {} micro-dollars; read {} sources in {} tokens{}",
                r.outcome.as_str(),
                r.calls,
                r.tokens_spent,
                r.cost_micros,
                r.sources.len(),
                r.prompt_tokens,
                r.model
                    .as_deref()
                    .map_or(String::new(), |m| format!(" ({m})"))
            ),
        );
        FoldStatus::Applied
    }

    /// The pending job ended or expired and the fold accepted nothing of
    /// it: the next job waits for agent input that comes after it, and a
    /// routine one also for the backoff (a Retry-After is its own delay).
    /// Never the same job again at once: with no new input it would meet
    /// the same state and fail the same way, for ever.
    fn round_without_progress(&mut self, urgent: bool, retry_after: bool) {
        self.conv.awaiting_input = true;
        if !urgent && !retry_after {
            let until = self
                .event
                .time
                .saturating_add(self.policy.summary_spend_backoff_ms);
            self.conv.spend.backoff_until = self.conv.spend.backoff_until.max(until);
        }
    }

    /// Raises a re-summarization debt when fallback summaries are in
    /// context, no other debt is owed, and the newest summary recorded was
    /// written by a model: the evidence that a model is available again. A
    /// deployment with only the deterministic summarizer never records a
    /// model summary, so it never owes (and never runs) a re-summarization.
    ///
    /// Model summaries are mostly recorded while a compaction debt is owed,
    /// so the evidence is read from the state, not from this event alone;
    /// it is only looked at when the answer can have changed (a summary or
    /// a sweep end folded, or a debt just paid), not on every turn.
    fn maybe_owe_resummary(&mut self, cleared: bool, levels: &policy::Levels) {
        let may_change = cleared
            || matches!(
                self.event.body,
                EventBody::SummaryRecorded(_) | EventBody::SweepEnded(_)
            );
        if !may_change || self.conv.debt.is_some() {
            return;
        }
        let model_available = self.conv.summaries.last().is_some_and(|s| !s.fallback);
        if !model_available {
            return;
        }
        if self.conv.fallback_summaries_in_context().next().is_none() {
            return;
        }
        self.raise_debt(DebtReason::Resummarize, false, levels.target_tokens, None);
    }

    /// Re-evaluates the triggers after every event: records, updates or
    /// clears the single debt and issues a job when none is pending.
    fn evaluate(&mut self) {
        if policy::session_matches(&self.policy.stateless_sessions, &self.conv.key) {
            return;
        }
        let levels = policy::levels(self.conv, self.policy);
        let tokens = self.conv.context_tokens;
        let over_bytes = self
            .policy
            .max_active_transcript_bytes
            .is_some_and(|max| self.conv.context_bytes > max);
        // A routine trigger with nothing outside the fresh tail to compact
        // records no debt: it would be cleared at once and flap every turn.
        // A pending re-summarization counts as no debt here: a trigger
        // takes it over only when there is compaction work to do, or the
        // debt would be taken over and cleared at once, every event.
        let compaction_debt = self
            .conv
            .debt
            .as_ref()
            .is_some_and(|d| d.reason != DebtReason::Resummarize);
        let routine_work = (tokens > levels.threshold_tokens || over_bytes)
            && !compaction_debt
            && (policy::next_leaf_chunk_with(
                &*self.conv,
                self.policy,
                true,
                tokens <= levels.budget,
            )
            .is_some()
                || policy::next_condensation(&*self.conv, self.policy, false, false).is_some());
        if tokens > levels.threshold_tokens && (routine_work || compaction_debt) {
            self.raise_debt(DebtReason::Threshold, false, levels.target_tokens, None);
        }
        let compaction_debt = self
            .conv
            .debt
            .as_ref()
            .is_some_and(|d| d.reason != DebtReason::Resummarize);
        if over_bytes && (routine_work || compaction_debt) {
            self.raise_debt(
                DebtReason::TranscriptBytes,
                false,
                levels.target_tokens,
                None,
            );
        }
        let now = self.event.time;
        // A job whose worker vanished is given up after twice its deadline.
        let expired = self.conv.pending_job.as_ref().is_some_and(|p| {
            now > p
                .job
                .issued_at
                .saturating_add(2 * p.job.deadline_ms + 60_000)
        });
        if let Some(pending) = self.conv.pending_job.take_if(|_| expired) {
            self.history(
                "job_expired",
                format!(
                    "{} ended without a sweep_ended event; {} of its summaries accepted",
                    pending.job.job_id, pending.committed
                ),
            );
            if !pending.made_progress() {
                self.round_without_progress(pending.job.urgent, false);
            }
        }
        if self.conv.pending_job.is_some() {
            return;
        }
        let mut cleared = false;
        // A re-summarization is paid when no fallback summary is left in
        // context, whatever the token count.
        let resummarizing = self
            .conv
            .debt
            .as_ref()
            .is_some_and(|d| d.reason == DebtReason::Resummarize);
        if resummarizing && self.conv.fallback_summaries_in_context().next().is_none() {
            let reason = "no deterministic fallback summary is left in context".to_string();
            self.conv.debt = None;
            cleared = true;
            self.history("debt_cleared", reason.clone());
            self.decide(
                "debt_cleared",
                EventBody::DebtCleared(DebtCleared { reason }),
            );
        }
        // Debt that is paid: under target, or nothing left to compact.
        if let Some(debt) = self
            .conv
            .debt
            .as_ref()
            .filter(|d| d.reason != DebtReason::Resummarize)
        {
            let conv: &Conversation = self.conv;
            let over = tokens > debt.target_tokens;
            let reach_back = !(debt.urgent || tokens > policy::budget(conv, self.policy));
            let work_left =
                policy::next_leaf_chunk_with(conv, self.policy, over || debt.urgent, reach_back)
                    .is_some()
                    || policy::next_condensation(conv, self.policy, false, debt.urgent).is_some();
            if !over || !work_left {
                let reason = if !over {
                    format!(
                        "context at {tokens} tokens, under target {}",
                        debt.target_tokens
                    )
                } else {
                    format!("context at {tokens} tokens but nothing outside the fresh tail is left to compact")
                };
                self.conv.debt = None;
                cleared = true;
                self.history("debt_cleared", reason.clone());
                self.decide(
                    "debt_cleared",
                    EventBody::DebtCleared(DebtCleared { reason }),
                );
            }
        }
        self.maybe_owe_resummary(cleared, &levels);
        // A round that made no progress is not followed by another until
        // something new comes from the agent (a turn, an error, a request):
        // the results of older jobs are no reason, so a summarizer that
        // keeps failing, or a chunk that keeps being stale, cannot spin.
        if self.conv.awaiting_input {
            return;
        }
        // The provider asked us to wait (Retry-After): no job of any kind.
        if now < self.conv.spend.retry_at {
            return;
        }
        let window = self.policy.summary_call_window_ms;
        self.conv.spend.prune(now, window);
        let global = spend::has_partition_limits(self.policy);
        if global {
            self.global.prune(now, window);
        }
        let allowance = spend::allowance(
            &self.conv.spend,
            self.global,
            &self.conv.key,
            self.policy,
            now,
        );
        let (calls_left, tokens_left) = (allowance.calls_left, allowance.tokens_left);
        let spend_ok = allowance.routine_ok();
        let (compact, urgent, reason, target, instructions) = match &self.conv.debt {
            Some(d) if d.urgent || spend_ok => (
                true,
                d.urgent,
                d.reason,
                d.target_tokens,
                d.instructions.clone(),
            ),
            _ if self.conv.rolling_due && spend_ok => (
                false,
                false,
                DebtReason::Threshold,
                levels.target_tokens,
                None,
            ),
            Some(_)
                if global
                    && allowance.own_calls_left > 0
                    && calls_left == 0
                    && !allowance.in_backoff =>
            {
                // Refused only for the partition's sake: wait for a share.
                self.global.wait(&self.conv.key, now);
                return;
            }
            _ => return,
        };
        if global {
            self.global.stop_waiting(&self.conv.key);
        }
        let job_id = format!(
            "job_{}_{}",
            &blake3::hash(self.conv.key.as_bytes()).to_hex()[..12],
            self.conv.jobs_issued
        );
        self.conv.jobs_issued += 1;
        let deadline_ms = if reason == DebtReason::Overflow {
            self.policy.compact_until_under_deadline_ms
        } else {
            self.policy.sweep_deadline_ms
        };
        let refresh_rolling_state = self.conv.rolling_due;
        self.history(
            "job_issued",
            if compact {
                format!(
                    "{job_id}: {reason:?}{}, {tokens} -> {target} tokens",
                    if urgent { " (urgent)" } else { "" }
                )
            } else {
                format!("{job_id}: rolling session state only")
            },
        );
        if global && !urgent {
            // Hold the allowance until the job ends, so jobs of other
            // conversations cannot be granted the same calls.
            self.global.record(SpendEntry {
                time: now,
                job_id: job_id.clone(),
                conversation: self.conv.key.clone(),
                calls: calls_left,
                tokens: tokens_left.unwrap_or(0),
                cost_micros: 0,
                reserved_until: Some(now + 2 * deadline_ms + 60_000),
            });
        }
        let job = JobIssued {
            job_id,
            reason,
            urgent,
            context_tokens: tokens,
            target_tokens: target,
            deadline_ms,
            issued_at: now,
            instructions,
            compact,
            refresh_rolling_state,
            max_calls: if urgent { None } else { Some(calls_left) },
            max_tokens: if urgent { None } else { tokens_left },
        };
        self.conv.pending_job = Some(PendingJob::new(job.clone()));
        self.decide("job_issued", EventBody::JobIssued(job));
    }
}

/// The turn being folded as the duplicate and flood guards see it. Nothing
/// of its text is read unless a seen turn could be identical: its sketch is
/// computed when there is one to compare with, its digest only when the
/// sketches match (or its length is in doubt).
struct Probe<'m> {
    msg: &'m ChatMessage,
    sketch: Option<u64>,
    digest: Option<(IdDigest, usize)>,
}

impl<'m> Probe<'m> {
    fn new(msg: &'m ChatMessage) -> Self {
        Probe {
            msg,
            sketch: None,
            digest: None,
        }
    }

    fn sketch(&mut self) -> u64 {
        *self
            .sketch
            .get_or_insert_with(|| turn_sketch(self.msg).value)
    }

    fn digest(&mut self) -> (IdDigest, usize) {
        *self.digest.get_or_insert_with(|| turn_digest(self.msg))
    }

    /// Whether its normalized text has at least `min` characters: its
    /// count of ASCII graphic characters is a lower bound.
    fn normalized_chars_at_least(&mut self, min: usize) -> bool {
        graphic_at_least(self.msg, min) || self.digest().1 >= min
    }

    /// Whether it is identical to `seen` (same digest), a turn whose body
    /// is in `bodies` (they keep every body a seen turn needs).
    /// Computes (and keeps) `seen`'s sketch and digest only when needed.
    fn same_as(&mut self, seen: &mut SeenTurn, bodies: &ResidentBodies) -> bool {
        let theirs = match seen.digest {
            SeenDigest::Known(d) => d,
            SeenDigest::Of(seq) => match (bodies.get(seq), bodies.guard(seq)) {
                (Some(body), _) => {
                    let msg = &body.message;
                    let sketch = *seen.sketch.get_or_insert_with(|| turn_sketch(msg).value);
                    if sketch != self.sketch() {
                        return false;
                    }
                    let d = turn_digest(msg).0;
                    seen.digest = SeenDigest::Known(d);
                    d
                }
                // Its body is in a store: what `guard_read` took of it.
                (None, Some((_, sketch, d))) => {
                    let sketch = *seen.sketch.get_or_insert(sketch);
                    if sketch != self.sketch() {
                        return false;
                    }
                    seen.digest = SeenDigest::Known(d);
                    d
                }
                // Never so: a seen turn's body is kept or what it reads is.
                (None, None) => return false,
            },
        };
        if seen.sketch.is_some_and(|s| s != self.sketch()) {
            return false;
        }
        theirs == self.digest().0
    }

    /// How it is remembered once it is turn `seq`.
    fn seen(&self, seq: u64) -> SeenTurn {
        SeenTurn {
            sketch: self.sketch,
            digest: match self.digest {
                Some((d, _)) => SeenDigest::Known(d),
                None => SeenDigest::Of(seq),
            },
        }
    }
}

/// What the duplicate and flood guards read of a turn's body: its sketch
/// and its digest, kept when the body leaves memory.
pub fn guard_read(body: &TurnBody) -> (u64, IdDigest) {
    (
        turn_sketch(&body.message).value,
        turn_digest(&body.message).0,
    )
}

/// Whether `msg`'s text (as [`turn_digest`] normalizes it) has at least
/// `min` ASCII graphic bytes; reads no further than it takes to know.
fn graphic_at_least(msg: &ChatMessage, min: usize) -> bool {
    let mut left = min;
    let mut take = |text: &str| {
        for block in text.as_bytes().chunks(64) {
            if left == 0 {
                return;
            }
            let n = block.iter().filter(|b| b.is_ascii_graphic()).count();
            left = left.saturating_sub(n);
        }
    };
    match &msg.content {
        None => {}
        Some(Content::Text(t)) => take(t),
        Some(Content::Parts(parts)) => {
            for t in parts.iter().filter_map(|p| p.text.as_deref()) {
                take(t);
            }
        }
    }
    for call in &msg.tool_calls {
        take(&call.function.name);
        take(&call.function.arguments);
        take("()");
    }
    left == 0
}

/// A cheap function of what [`turn_digest`] hashes (role, tool call id and
/// normalized text): identical turns have the same sketch, so turns with
/// different sketches need no digest to be told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TurnSketch {
    value: u64,
    /// ASCII graphic characters (`!`..=`~`) of the normalized text: a lower
    /// bound of its length in characters.
    text_graphic: usize,
}

/// The sketch is the role and the count, sum and sum of low nibbles of the
/// ASCII graphic bytes (`!`..=`~`) of the digested stream after the role.
/// Normalizing keeps those bytes and their order: whitespace is dropped or
/// becomes a space (not graphic), ASCII letters are lowercased, and of the
/// other characters only `K` (U+212A KELVIN SIGN) and `İ` (U+0130) lowercase
/// to anything ASCII (`k`; `i` and a combining dot), as
/// `tests::only_kelvin_and_dotted_i_lowercase_into_ascii` checks over every
/// char. So the sums are taken over the raw text, letters folded, plus those
/// two characters as the letters they become; the tool call id, hashed as
/// it is, is summed as it is.
fn turn_sketch(msg: &ChatMessage) -> TurnSketch {
    let mut text = GraphicSums::default();
    match &msg.content {
        None => {}
        Some(Content::Text(t)) => text.add_text(t),
        Some(Content::Parts(parts)) => {
            for t in parts.iter().filter_map(|p| p.text.as_deref()) {
                text.add_text(t);
            }
        }
    }
    for call in &msg.tool_calls {
        text.add_text(&call.function.name);
        text.add_text("(");
        text.add_text(&call.function.arguments);
        text.add_text(")");
    }
    let text_graphic = text.count as usize;
    let mut all = text;
    all.add_bytes(msg.tool_call_id.as_deref().unwrap_or("").as_bytes(), false);
    let role = match msg.role {
        Role::System => 0,
        Role::User => 1,
        Role::Assistant => 2,
        Role::Tool => 3,
    };
    let h = mix(role ^ (u64::from(all.count) << 8));
    let h = mix(h ^ (u64::from(all.sum) << 32 | u64::from(all.nibbles)));
    TurnSketch {
        value: h,
        text_graphic,
    }
}

/// SplitMix64's finalizer.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Count, sum and sum of low nibbles of ASCII graphic bytes (wrapping).
#[derive(Debug, Default, Clone, Copy)]
struct GraphicSums {
    count: u32,
    sum: u32,
    nibbles: u32,
}

impl GraphicSums {
    /// Text as it normalizes: letters lowercased, `K` and `İ` as `k`, `i`.
    fn add_text(&mut self, text: &str) {
        if self.add_bytes(text.as_bytes(), true) {
            for (c, ascii) in [('\u{212A}', b'k'), ('\u{130}', b'i')] {
                let n = text.matches(c).count() as u32;
                self.count = self.count.wrapping_add(n);
                self.sum = self.sum.wrapping_add(n.wrapping_mul(u32::from(ascii)));
                self.nibbles = self
                    .nibbles
                    .wrapping_add(n.wrapping_mul(u32::from(ascii & 15)));
            }
        }
    }

    /// Adds `bytes` (lowercased when `fold`); whether any is not ASCII.
    fn add_bytes(&mut self, bytes: &[u8], fold: bool) -> bool {
        let mut high = 0u8;
        // 16-bit sums over chunks short enough not to overflow (at most
        // 256 × 126): the loop vectorizes with SSE2's 16-bit lanes. All sums
        // are modulo 2^32 in the end, so any split of the same bytes
        // (chunks, pieces) adds up to the same sketch.
        for chunk in bytes.chunks(256) {
            let (mut count, mut sum, mut nibbles) = (0u16, 0u16, 0u16);
            for &b in chunk {
                high |= b;
                let upper = fold & (b.wrapping_sub(b'A') < 26);
                let f = b | (u8::from(upper) << 5);
                let graphic = b.wrapping_sub(b'!') < 94;
                let v = if graphic { f } else { 0 };
                count += u16::from(graphic);
                sum += u16::from(v);
                nibbles += u16::from(v & 15);
            }
            self.count = self.count.wrapping_add(u32::from(count));
            self.sum = self.sum.wrapping_add(u32::from(sum));
            self.nibbles = self.nibbles.wrapping_add(u32::from(nibbles));
        }
        high >= 0x80
    }
}

/// The digest duplicate detection and the flood guard compare turns by:
/// blake3 of `role \0 tool_call_id \0 normalized text`, where the text is
/// [`ChatMessage::searchable_text`] whitespace-collapsed and case-folded.
/// Streamed into the hasher (no intermediate strings), with the number of
/// characters of the normalized text; the same bytes as building the
/// strings would hash.
fn turn_digest(msg: &ChatMessage) -> (IdDigest, usize) {
    thread_local! {
        // Reused: zeroing a fresh 8 KB buffer for every turn showed in profiles.
        static SCRATCH: RefCell<Box<[u8; Normalizer::BUF]>> =
            RefCell::new(Box::new([0; Normalizer::BUF]));
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => digest_with(msg, &mut buf),
        // Only reentrancy could get here; a fresh buffer hashes the same.
        Err(_) => digest_with(msg, &mut Box::new([0; Normalizer::BUF])),
    })
}

fn digest_with(msg: &ChatMessage, buf: &mut [u8; Normalizer::BUF]) -> (IdDigest, usize) {
    let mut n = Normalizer::new(buf);
    n.hasher.update(msg.role.as_str().as_bytes());
    n.hasher.update(&[0]);
    n.hasher
        .update(msg.tool_call_id.as_deref().unwrap_or("").as_bytes());
    n.hasher.update(&[0]);
    // The pieces of `searchable_text`, with its newline separators.
    match &msg.content {
        None => {}
        Some(Content::Text(t)) => n.raw(t),
        Some(Content::Parts(parts)) => {
            for text in parts.iter().filter_map(|p| p.text.as_deref()) {
                if n.raw_len > 0 {
                    n.raw("\n");
                }
                n.raw(text);
            }
        }
    }
    for call in &msg.tool_calls {
        if n.raw_len > 0 {
            n.raw("\n");
        }
        n.raw(&call.function.name);
        n.raw("(");
        n.raw(&call.function.arguments);
        n.raw(")");
    }
    n.finish()
}

/// Whitespace-collapsing, case-folding writer into a blake3 hasher.
struct Normalizer<'b> {
    hasher: blake3::Hasher,
    buf: &'b mut [u8; Normalizer::BUF],
    len: usize,
    /// Bytes of raw text seen (for `searchable_text`'s separators).
    raw_len: usize,
    /// Characters written.
    chars: usize,
    /// A word was written and whitespace followed it.
    space: bool,
}

impl<'b> Normalizer<'b> {
    /// Large enough for blake3 to hash several chunks at once.
    const BUF: usize = 8192;

    fn new(buf: &'b mut [u8; Normalizer::BUF]) -> Self {
        Normalizer {
            hasher: blake3::Hasher::new(),
            buf,
            len: 0,
            raw_len: 0,
            chars: 0,
            space: false,
        }
    }

    fn raw(&mut self, text: &str) {
        self.raw_len += text.len();
        // Locals, not fields, in the loop: the compiler keeps them in
        // registers instead of storing them after every byte.
        let Normalizer {
            hasher,
            buf,
            len,
            chars,
            space,
            ..
        } = self;
        let (mut len, mut chars, mut space) = (*len, *chars, *space);
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            // Room for a space and a lowercase expansion (at most 3 chars).
            if len + 16 > Normalizer::BUF {
                hasher.update(&buf[..len]);
                len = 0;
            }
            if let Some(word) = bytes.get(i..i + 8) {
                let x = u64::from_le_bytes(word.try_into().unwrap_or([0; 8]));
                if let Some(lower) = plain_words(x) {
                    // Eight bytes of words with single spaces between them:
                    // their normalized form is themselves, lowercased.
                    if space {
                        buf[len] = b' ';
                        len += 1;
                        chars += 1;
                        space = false;
                    }
                    buf[len..len + 8].copy_from_slice(&lower.to_le_bytes());
                    len += 8;
                    chars += 8;
                    i += 8;
                    continue;
                }
            }
            let b = bytes[i];
            let c = if b.is_ascii() {
                i += 1;
                // `char::is_whitespace` in ASCII: \t \n \x0B \x0C \r and space.
                if b == b' ' || (b'\t'..=b'\r').contains(&b) {
                    space = chars > 0;
                    continue;
                }
                None
            } else {
                // `i` is on a char boundary: only whole chars are skipped.
                let Some(c) = text[i..].chars().next() else {
                    break;
                };
                i += c.len_utf8();
                if c.is_whitespace() {
                    space = chars > 0;
                    continue;
                }
                Some(c)
            };
            if space {
                buf[len] = b' ';
                len += 1;
                chars += 1;
                space = false;
            }
            match c {
                None => {
                    buf[len] = b.to_ascii_lowercase();
                    len += 1;
                    chars += 1;
                }
                Some(c) => {
                    for l in c.to_lowercase() {
                        len += l.encode_utf8(&mut buf[len..]).len();
                        chars += 1;
                    }
                }
            }
        }
        (self.len, self.chars, self.space) = (len, chars, space);
    }

    fn finish(mut self) -> (IdDigest, usize) {
        self.hasher.update(&self.buf[..self.len]);
        let hash = self.hasher.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&hash.as_bytes()[..16]);
        (out, self.chars)
    }
}

/// Eight bytes (little endian) that normalize to themselves lowercased:
/// printable ASCII, no space first or last, no two spaces in a row. Returns
/// them lowercased; `None` sends the caller byte by byte.
fn plain_words(x: u64) -> Option<u64> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // Any byte >= 0x80 (not ASCII) or < 0x20 (tab, newline, controls)?
    let below_space = x.wrapping_sub(0x20 * ONES) & !x & HIGH;
    if (x & HIGH) | below_space != 0 {
        return None;
    }
    // High bit of each byte that is a space (exact: no borrows).
    let y = x ^ (0x20 * ONES);
    let spaces = !(((y & !HIGH) + !HIGH) | y) & HIGH;
    let first_or_last = 0x80 | (0x80 << 56);
    if spaces & first_or_last != 0 || spaces & (spaces >> 8) != 0 {
        return None;
    }
    // Bytes in 'A'..='Z' (all bytes are ASCII: no carries between bytes).
    let at_least_a = x + (0x80 - u64::from(b'A')) * ONES;
    let above_z = x + (0x7f - u64::from(b'Z')) * ONES;
    let upper = at_least_a & !above_z & HIGH;
    Some(x | (upper >> 2))
}

/// Whitespace-collapsed, case-folded text: the reference [`turn_digest`]
/// is checked against.
#[cfg(test)]
fn normalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.extend(word.chars().flat_map(char::to_lowercase));
    }
    out
}

#[cfg(test)]
mod guard_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::ChatMessage;
    use crate::core::message::{ContentPart, FunctionCall, ToolCall};
    use proptest::prelude::*;

    const T0: u64 = 1_700_000_000_000;

    fn policy() -> PolicyConfig {
        PolicyConfig {
            default_context_window: 2_000,
            fresh_tail_count: 2,
            // Three of the tests' turns a chunk.
            leaf_chunk_tokens: 600,
            rolling_every_turns: 1_000_000,
            rolling_tool_loop: 1_000_000,
            rolling_threshold: 1.0,
            summary_max_calls_per_window: 5,
            summary_max_cost_micros_per_window: Some(1_000),
            ..PolicyConfig::default()
        }
    }

    fn turn(conv: &str, i: u64, time: u64) -> Envelope {
        let role = if i.is_multiple_of(2) {
            Role::User
        } else {
            Role::Assistant
        };
        Envelope::new(
            format!("{conv}-t{i}"),
            conv,
            time,
            EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
                role,
                format!("turn {i}: {}", "words of a turn ".repeat(40)),
            ))),
        )
    }

    fn jobs(decisions: &[Envelope]) -> Vec<JobIssued> {
        decisions
            .iter()
            .filter_map(|d| match &d.body {
                EventBody::JobIssued(j) => Some(j.clone()),
                _ => None,
            })
            .collect()
    }

    /// Folds turns until a job is issued; returns it and the next turn index.
    fn until_job(
        state: &mut State,
        p: &PolicyConfig,
        conv: &str,
        from: u64,
        time: u64,
    ) -> (JobIssued, u64) {
        for i in from..from + 200 {
            let out = fold(state, p, &turn(conv, i, time + (i - from) * 1_000));
            if let Some(j) = jobs(&out.decisions).pop() {
                return (j, i + 1);
            }
        }
        panic!("no job issued");
    }

    fn ended(job: &JobIssued, committed: u32, stop: SweepStop) -> SweepEnded {
        SweepEnded {
            job_id: job.job_id.clone(),
            passes: committed.max(1),
            committed,
            stop,
            detail: None,
            calls: 1,
            tokens_spent: 100,
            cost_micros: 10,
            retry_after_ms: None,
        }
    }

    /// Runs up to `passes` passes of `job` as its worker would (the
    /// deterministic summarizer on the job's snapshot) and folds each
    /// summary at `time`; returns how many the fold accepted.
    fn commit(
        state: &mut State,
        p: &PolicyConfig,
        conv: &str,
        job: &JobIssued,
        passes: u32,
        time: u64,
    ) -> u32 {
        let mut snap = crate::core::sweep::snapshot(&state.conversations[conv], job, p).unwrap();
        let mut accepted = 0;
        for _ in 0..passes {
            let Some(pass) = snap.next_pass() else { break };
            let draft = crate::core::fallback_summary::summarize(&snap.request(pass, false));
            let rec = snap.record(pass, &draft);
            snap.apply(pass, &rec);
            let e = crate::core::sweep::summary_event(conv, time, rec);
            if fold(state, p, &e).status == FoldStatus::Applied {
                accepted += 1;
            }
        }
        accepted
    }

    fn event(s: SweepEnded, conv: &str, time: u64) -> Envelope {
        Envelope::new(
            format!("se-{}-{time}", s.job_id),
            conv,
            time,
            EventBody::SweepEnded(s),
        )
    }

    #[test]
    fn a_turn_bigger_than_the_target_is_a_large_payload() {
        let p = policy(); // budget 2000, target 1000
        let mut state = State::default();
        let big = Envelope::new(
            "big",
            "c",
            T0,
            EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
                Role::User,
                "a line of a long log\n".repeat(300),
            ))),
        );
        fold(&mut state, &p, &big);
        let turn = &state.conversations["c"].turns[0];
        assert!(turn.tokens > 1_000 && u64::from(turn.tokens) < p.large_payload_threshold_tokens);
        assert!(turn.large_payload, "{} tokens kept whole", turn.tokens);
        assert!(
            turn.context_tokens < 100,
            "a stub costs {} tokens",
            turn.context_tokens
        );
        fold(&mut state, &p, &turn_small("c", 1));
        assert!(!state.conversations["c"].turns[1].large_payload);
    }

    fn turn_small(conv: &str, i: u64) -> Envelope {
        turn(conv, i, T0 + i)
    }

    #[test]
    fn a_rate_limit_delays_the_next_job_even_after_progress() {
        let p = policy();
        let mut state = State::default();
        let (job, next) = until_job(&mut state, &p, "c", 0, T0);
        assert_eq!(commit(&mut state, &p, "c", &job, 1, job.issued_at + 5), 1);
        let mut s = ended(&job, 1, SweepStop::SpendLimit);
        s.retry_after_ms = Some(20_000);
        let out = fold(&mut state, &p, &event(s, "c", job.issued_at + 10));
        assert!(jobs(&out.decisions).is_empty());
        let conv = &state.conversations["c"];
        assert_eq!(conv.spend.retry_at, job.issued_at + 20_010);
        assert_eq!(conv.spend.backoff_until, 0, "progress: no backoff");
        // Turns before the delay get no job, however far over the threshold.
        for i in next..next + 10 {
            let out = fold(&mut state, &p, &turn("c", i, job.issued_at + 5_000 + i));
            assert!(jobs(&out.decisions).is_empty(), "job before Retry-After");
        }
        let out = fold(
            &mut state,
            &p,
            &turn("c", next + 10, job.issued_at + 20_011),
        );
        assert_eq!(
            jobs(&out.decisions).len(),
            1,
            "the job comes back after the delay"
        );
    }

    #[test]
    fn backoff_only_after_rounds_without_progress() {
        let p = policy();
        // (summaries the fold accepts, what the sweep claims, its stop)
        for (accepted, claimed, stop, backoff) in [
            (2, 2, SweepStop::Deadline, false),
            (1, 1, SweepStop::NoProgress, false),
            (0, 0, SweepStop::Deadline, true),
            (0, 0, SweepStop::Failed, true),
            (0, 0, SweepStop::Done, true),
            // A claim of work the fold never accepted is no progress.
            (0, 1, SweepStop::Done, true),
            (0, 3, SweepStop::IterationCap, true),
        ] {
            let mut state = State::default();
            let (job, next) = until_job(&mut state, &p, "c", 0, T0);
            let done = commit(&mut state, &p, "c", &job, accepted, job.issued_at + 5);
            assert_eq!(done, accepted);
            let e = event(ended(&job, claimed, stop), "c", job.issued_at + 10);
            let out = fold(&mut state, &p, &e);
            let conv = &state.conversations["c"];
            let why = format!("{accepted} accepted, {claimed} claimed, {stop:?}");
            assert_eq!(conv.spend.backoff_until > 0, backoff, "{why}");
            assert_eq!(conv.awaiting_input, backoff, "{why}");
            let history = &conv.history;
            let line = history
                .resident()
                .iter()
                .rfind(|h| h.event_type == "sweep_ended");
            let line = line.map(|h| h.detail.clone()).unwrap_or_default();
            assert!(line.contains(&format!("{accepted} committed")), "{line}");
            if backoff {
                // No job on its end, nor on the next turn: the backoff holds.
                assert!(jobs(&out.decisions).is_empty(), "{why}");
                let out = fold(&mut state, &p, &turn("c", next, job.issued_at + 20));
                assert!(jobs(&out.decisions).is_empty(), "{why}");
            }
        }
    }

    #[test]
    fn a_leaf_that_skips_the_oldest_raw_turn_is_refused() {
        let p = policy();
        let mut state = State::default();
        let (job, _) = until_job(&mut state, &p, "c", 0, T0);
        // The worker's second pass, planned after a first pass that never
        // reached the fold (stale, or from an expired job's worker).
        let mut snap = crate::core::sweep::snapshot(&state.conversations["c"], &job, &p).unwrap();
        let first = snap.next_pass().expect("a first pass");
        let draft = crate::core::fallback_summary::summarize(&snap.request(first, false));
        let rec = snap.record(first, &draft);
        snap.apply(first, &rec);
        let second = snap.next_pass().expect("a second pass");
        let draft = crate::core::fallback_summary::summarize(&snap.request(second, false));
        let rec = snap.record(second, &draft);
        let e = crate::core::sweep::summary_event("c", job.issued_at + 1, rec);
        let out = fold(&mut state, &p, &e);
        let FoldStatus::Rejected(reason) = &out.status else {
            panic!("accepted a leaf after raw turns: {:?}", out.status);
        };
        assert!(reason.contains("not the oldest raw turn"), "{reason}");
        assert!(
            out.decisions
                .iter()
                .any(|d| matches!(d.body, EventBody::SummaryRejected(_))),
            "the refusal is recorded"
        );
        let conv = &state.conversations["c"];
        assert!(conv.summaries.is_empty());
        assert_eq!(conv.pending_job.as_ref().map(|j| j.committed), Some(0));
    }

    #[test]
    fn an_expired_job_without_progress_backs_off_and_one_with_progress_does_not() {
        let p = policy();
        for progress in [false, true] {
            let mut state = State::default();
            let (job, next) = until_job(&mut state, &p, "c", 0, T0);
            if progress {
                assert_eq!(commit(&mut state, &p, "c", &job, 1, job.issued_at + 1), 1);
            }
            // The worker vanished: a turn long after its deadline expires it.
            let late = job.issued_at + 2 * job.deadline_ms + 60_001;
            let out = fold(&mut state, &p, &turn("c", next, late));
            let conv = &state.conversations["c"];
            assert!(conv
                .history
                .resident()
                .iter()
                .any(|h| h.event_type == "job_expired"));
            if progress {
                assert_eq!(jobs(&out.decisions).len(), 1, "its successor at once");
                assert!(!conv.awaiting_input);
            } else {
                assert!(jobs(&out.decisions).is_empty(), "re-issued at once");
                assert!(conv.awaiting_input);
                assert!(conv.spend.backoff_until > late);
                // Its sweep_ended, arriving after all, changes nothing more.
                let before = conv.spend.backoff_until;
                let e = event(ended(&job, 1, SweepStop::Done), "c", late + 1);
                let out = fold(&mut state, &p, &e);
                assert!(jobs(&out.decisions).is_empty());
                assert_eq!(state.conversations["c"].spend.backoff_until, before);
            }
        }
    }

    #[test]
    fn results_of_old_jobs_issue_no_job_while_awaiting_input() {
        let p = policy();
        let mut state = State::default();
        let (job, next) = until_job(&mut state, &p, "c", 0, T0);
        let manual = Envelope::new(
            "m1",
            "c",
            job.issued_at + 1,
            EventBody::CompactionRequested(CompactionRequested::default()),
        );
        fold(&mut state, &p, &manual);
        if let Some(pending) = &mut state.conversations.get_mut("c").unwrap().pending_job {
            pending.job.urgent = true;
        }
        let e = event(ended(&job, 0, SweepStop::Failed), "c", job.issued_at + 2);
        fold(&mut state, &p, &e);
        // An urgent debt ignores the backoff; the late end of some older
        // job is still no reason for a new one.
        let stale = SweepEnded {
            job_id: "job_older".into(),
            ..ended(&job, 1, SweepStop::Done)
        };
        let out = fold(&mut state, &p, &event(stale, "c", job.issued_at + 3));
        assert!(
            jobs(&out.decisions).is_empty(),
            "issued on an old job's end"
        );
        let out = fold(&mut state, &p, &turn("c", next, job.issued_at + 4));
        assert_eq!(jobs(&out.decisions).len(), 1, "agent input brings it back");
    }

    #[test]
    fn a_barren_sweep_is_not_retried_on_its_own_end() {
        let p = policy();
        let mut state = State::default();
        let (job, next) = until_job(&mut state, &p, "c", 0, T0);
        // Urgent: no backoff, so only the barren-end rule stops a retry loop.
        let manual = Envelope::new(
            "m1",
            "c",
            job.issued_at + 1,
            EventBody::CompactionRequested(CompactionRequested::default()),
        );
        fold(&mut state, &p, &manual);
        let mut urgent = job.clone();
        urgent.urgent = true;
        if let Some(pending) = &mut state.conversations.get_mut("c").unwrap().pending_job {
            pending.job.urgent = true;
        }
        let e = event(ended(&urgent, 0, SweepStop::Failed), "c", job.issued_at + 2);
        let out = fold(&mut state, &p, &e);
        assert!(jobs(&out.decisions).is_empty(), "retried on its own end");
        let conv = &state.conversations["c"];
        assert!(
            conv.debt.as_ref().is_some_and(|d| d.urgent),
            "a failed urgent round keeps its debt"
        );
        let out = fold(&mut state, &p, &turn("c", next, job.issued_at + 3));
        let again = jobs(&out.decisions);
        assert_eq!(again.len(), 1, "the next inbound event retries");
        assert!(again[0].urgent);
    }

    #[test]
    fn a_debt_recorded_during_a_rolling_refresh_gets_its_job_when_it_ends() {
        let p = PolicyConfig {
            rolling_every_turns: 2,
            ..policy()
        };
        let mut state = State::default();
        let (rolling, mut next) = until_job(&mut state, &p, "c", 0, T0);
        assert!(
            !rolling.compact && rolling.refresh_rolling_state,
            "{rolling:?}"
        );
        // Turns go on while it runs, until the threshold records a debt.
        let mut time = rolling.issued_at;
        while state.conversations["c"].debt.is_none() {
            time += 1_000;
            let out = fold(&mut state, &p, &turn("c", next, time));
            assert!(jobs(&out.decisions).is_empty(), "one job at a time");
            next += 1;
        }
        let state_of = |job: &JobIssued, time: u64| {
            Envelope::new(
                format!("rs_{}", job.job_id),
                "c",
                time,
                EventBody::RollingStateUpdated(RollingStateUpdated {
                    state: RollingState::default(),
                    through_turn: next - 1,
                    job_id: Some(job.job_id.clone()),
                }),
            )
        };
        let refreshed = SweepEnded {
            passes: 0,
            ..ended(&rolling, 0, SweepStop::Done)
        };
        fold(&mut state, &p, &state_of(&rolling, time + 1));
        let out = fold(&mut state, &p, &event(refreshed, "c", time + 1));
        let issued = jobs(&out.decisions);
        assert_eq!(
            issued.len(),
            1,
            "the debt's job, without waiting for a turn"
        );
        assert!(issued[0].compact, "{:?}", issued[0]);
    }

    #[test]
    fn a_rolling_refresh_that_wrote_nothing_is_no_progress() {
        let p = PolicyConfig {
            rolling_every_turns: 2,
            ..policy()
        };
        let mut state = State::default();
        let (rolling, next) = until_job(&mut state, &p, "c", 0, T0);
        assert!(!rolling.compact && rolling.refresh_rolling_state);
        // Done, but no rolling state came (the call was refused): the same
        // job again at once would be refused the same way.
        let barren = SweepStop::Done;
        let out = fold(
            &mut state,
            &p,
            &event(ended(&rolling, 0, barren), "c", rolling.issued_at + 5),
        );
        assert!(jobs(&out.decisions).is_empty(), "re-issued on its own end");
        let conv = &state.conversations["c"];
        assert!(conv.rolling_due && conv.awaiting_input);
        assert!(conv.spend.backoff_until > rolling.issued_at);
        let out = fold(&mut state, &p, &turn("c", next, rolling.issued_at + 10));
        assert!(jobs(&out.decisions).is_empty(), "issued in backoff");
    }

    #[test]
    fn spend_counts_in_a_sliding_window_of_calls_tokens_and_money() {
        let p = policy();
        let mut state = State::default();
        let (job, mut next) = until_job(&mut state, &p, "c", 0, T0);
        assert_eq!(job.max_calls, Some(5));
        // A productive round that spent the whole money allowance.
        assert_eq!(commit(&mut state, &p, "c", &job, 1, job.issued_at + 5), 1);
        let mut s = ended(&job, 1, SweepStop::Done);
        s.cost_micros = 1_000;
        fold(&mut state, &p, &event(s, "c", job.issued_at + 10));
        let window_end = job.issued_at + p.summary_call_window_ms;
        let mut t = job.issued_at + 1_000;
        while t < window_end {
            let out = fold(&mut state, &p, &turn("c", next, t));
            assert!(
                jobs(&out.decisions).is_empty(),
                "job with no money left at {t}"
            );
            next += 1;
            t += 30_000;
        }
        // The window slides past the spending job: compaction may resume.
        let out = fold(&mut state, &p, &turn("c", next, window_end));
        assert_eq!(jobs(&out.decisions).len(), 1);
        assert!(state.conversations["c"].spend.recent.is_empty(), "pruned");
    }

    #[test]
    fn the_partition_window_reserves_and_shares_calls() {
        let p = PolicyConfig {
            summary_max_calls_per_window_global: Some(4),
            ..policy()
        };
        let mut state = State::default();
        let (a, _) = until_job(&mut state, &p, "a", 0, T0);
        assert_eq!(a.max_calls, Some(4), "alone, a may use the whole window");
        // b asks while a's allowance is reserved: nothing is left for it.
        for i in 0..200 {
            let out = fold(&mut state, &p, &turn("b", i, T0 + 100_000 + i * 1_000));
            assert!(
                jobs(&out.decisions).is_empty(),
                "b was granted calls a holds"
            );
            if !state.spend.waiting.is_empty() {
                break;
            }
        }

        assert_eq!(state.spend.waiting.len(), 1, "b waits for a share");
        // a ends having spent 1 call: b gets its fair share, half of 4.
        fold(
            &mut state,
            &p,
            &event(ended(&a, 1, SweepStop::Done), "a", T0 + 400_000),
        );
        let (b, _) = until_job(&mut state, &p, "b", 500, T0 + 401_000);
        assert_eq!(b.max_calls, Some(2), "{b:?}");
        assert!(state.spend.waiting.is_empty(), "b no longer waits");
    }

    /// The digest as it was first written: build the strings, hash them.
    fn reference(msg: &ChatMessage) -> (IdDigest, usize) {
        let normalized = normalize(&msg.searchable_text());
        let digest = id_digest(&format!(
            "{}\u{0}{}\u{0}{}",
            msg.role.as_str(),
            msg.tool_call_id.as_deref().unwrap_or(""),
            normalized
        ));
        (digest, normalized.chars().count())
    }

    /// Text with every kind of whitespace and case the normalizer treats
    /// specially, long enough to cross its buffer.
    fn text() -> impl Strategy<Value = String> {
        let pieces = prop::sample::select(vec![
            "a",
            "Z",
            "Hello",
            " ",
            "  ",
            "\t",
            "\n",
            "\r\n",
            "\u{0B}",
            "\u{0C}",
            "\u{85}",
            "\u{A0}",
            "\u{3000}",
            "\u{2028}",
            "İ",
            "Σ",
            "ẞ",
            "ǅ",
            "日本語",
            "é",
            "É",
            "🙂",
            "(",
            "{\"k\":1}",
            "x",
        ]);
        let prose = "[ -~]{0,40}|[ -~\t\n]{0,40}|[A-Za-z ]{0,40}";
        prop::collection::vec(prop_oneof![pieces.prop_map(String::from), prose], 0..40)
            .prop_map(|v| v.concat())
    }

    fn message() -> impl Strategy<Value = ChatMessage> {
        (
            0usize..4,
            prop::option::of(text()),
            prop::collection::vec(prop::option::of(text()), 0..4),
            any::<bool>(),
            prop::collection::vec((text(), text()), 0..3),
            prop::option::of("[a-z_0-9]{0,12}"),
        )
            .prop_map(|(role, plain, parts, use_parts, calls, call_id)| {
                let role = [Role::System, Role::User, Role::Assistant, Role::Tool][role];
                let content = if use_parts {
                    Some(Content::Parts(
                        parts
                            .into_iter()
                            .map(|text| ContentPart {
                                kind: "text".into(),
                                text,
                                other: Default::default(),
                            })
                            .collect(),
                    ))
                } else {
                    plain.map(Content::Text)
                };
                ChatMessage {
                    role,
                    content,
                    tool_calls: calls
                        .into_iter()
                        .enumerate()
                        .map(|(i, (name, arguments))| ToolCall {
                            id: format!("call_{i}"),
                            kind: "function".into(),
                            function: FunctionCall { name, arguments },
                        })
                        .collect(),
                    tool_call_id: call_id,
                    name: None,
                }
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// The streamed digest is byte for byte the digest of the built
        /// strings, so states folded before and after hash the same.
        #[test]
        fn streamed_turn_digest_is_the_reference_digest(msg in message()) {
            prop_assert_eq!(turn_digest(&msg), reference(&msg));
        }
    }

    /// Moving a turn into the state folds exactly as copying it.
    #[test]
    fn owned_and_borrowed_folds_agree() {
        let policy = PolicyConfig::default();
        let mut call = ChatMessage::text(Role::Assistant, "Reading it.");
        call.tool_calls = vec![ToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "read_file".into(),
                arguments: r#"{"path":"src/main.rs"}"#.into(),
            },
        }];
        let mut result = ChatMessage::text(Role::Tool, "fn main() {}");
        result.tool_call_id = Some("call_1".into());
        let mut orphan = ChatMessage::text(Role::Tool, "nobody asked");
        orphan.tool_call_id = Some("call_9".into());
        let events: Vec<Envelope> = [
            ChatMessage::text(Role::User, "Where is the entry point of this crate?"),
            call,
            result,
            orphan,
            ChatMessage::text(Role::User, "Where is the entry point of this crate?"),
        ]
        .into_iter()
        .enumerate()
        .map(|(n, message)| {
            Envelope::new(
                format!("e{n}"),
                "c:owned",
                1_700_000_000_000 + n as u64 * 1000,
                EventBody::TurnAppended(TurnAppended::from(message)),
            )
        })
        .collect();
        let (mut borrowed, mut owned) = (State::default(), State::default());
        for e in events.iter().chain(&events) {
            let a = fold_counted(&mut borrowed, &policy, e, None);
            let b = fold_owned(&mut owned, &policy, e.clone(), None);
            assert_eq!(a, b);
        }
        assert_eq!(borrowed.hash(), owned.hash());
        assert_eq!(borrowed, owned);
        assert_eq!(borrowed.conversations["c:owned"].turns.len(), 4);
    }

    #[test]
    fn streamed_turn_digest_crosses_its_buffer() {
        let long = "Word\tÉTÉ  \u{3000}İ ".repeat(3000);
        for role in [Role::User, Role::Tool] {
            let mut msg = ChatMessage::text(role, long.clone());
            msg.tool_call_id = Some("call_1".into());
            assert_eq!(turn_digest(&msg), reference(&msg));
        }
    }

    // ---- re-summarization of deterministic fallback summaries ----

    use crate::core::fallback_summary;
    use crate::core::sweep::{self, Pass};

    /// Runs the conversation's pending job in process, as a sweep would:
    /// every pass answered by the deterministic summarizer, marked as a
    /// model's when `model`. A re-summarization the "model" could not do
    /// (fallback again) is not recorded. Returns every decision.
    fn run_job(state: &mut State, p: &PolicyConfig, conv: &str, model: bool) -> Vec<Envelope> {
        let c = &state.conversations[conv];
        let pending = c.pending_job.clone().expect("a pending job");
        let mut snap = sweep::snapshot(c, &pending.job, p).unwrap();
        let time = c.last_time + 100;
        let mut decisions = Vec::new();
        let mut committed = 0;
        while let Some(pass) = snap.next_pass() {
            let req = snap.request(pass, false);
            let mut draft = fallback_summary::summarize(&req);
            if model {
                draft.fallback = false;
                draft.model = "test-model".into();
                draft.provider = "test".into();
                draft.prompt_version = "model-v1".into();
            } else if matches!(pass, Pass::Resummarize(_)) {
                break;
            }
            let rec = snap.record(pass, &draft);
            if rec.tokens >= rec.source_tokens || committed > 100 {
                break;
            }
            snap.apply(pass, &rec);
            let out = fold(state, p, &sweep::summary_event(conv, time, rec));
            assert_eq!(out.status, FoldStatus::Applied, "{:?}", out.decisions);
            decisions.extend(out.decisions);
            committed += 1;
        }
        let end = SweepEnded {
            job_id: pending.job.job_id.clone(),
            passes: committed.max(1),
            committed,
            stop: if committed > 0 {
                SweepStop::Done
            } else {
                SweepStop::NoProgress
            },
            detail: None,
            calls: 0,
            tokens_spent: 0,
            cost_micros: 0,
            retry_after_ms: None,
        };
        decisions.extend(fold(state, p, &event(end, conv, time + 1)).decisions);
        decisions
    }

    fn debts_recorded(decisions: &[Envelope]) -> Vec<DebtReason> {
        decisions
            .iter()
            .filter_map(|d| match &d.body {
                EventBody::DebtRecorded(debt) | EventBody::DebtUpdated(debt) => Some(debt.reason),
                _ => None,
            })
            .collect()
    }

    fn fallbacks_in_context(state: &State, conv: &str) -> Vec<Summary> {
        state.conversations[conv]
            .fallback_summaries_in_context()
            .cloned()
            .collect()
    }

    fn assert_accounting(conv: &Conversation) {
        let sum: u64 = conv.context.iter().map(|&i| conv.item_tokens(i)).sum();
        assert_eq!(
            conv.context_tokens, sum,
            "context tokens are the items' sum"
        );
    }

    /// Turns and fallback-only jobs until fallback summaries are in context
    /// and no job is pending; returns the next turn index.
    fn with_fallbacks(state: &mut State, p: &PolicyConfig, conv: &str) -> u64 {
        let (_, next) = until_job(state, p, conv, 0, T0);
        let decisions = run_job(state, p, conv, false);
        assert!(!fallbacks_in_context(state, conv).is_empty());
        assert!(state.conversations[conv].pending_job.is_none());
        assert!(!debts_recorded(&decisions).contains(&DebtReason::Resummarize));
        next
    }

    #[test]
    fn a_deterministic_only_deployment_never_owes_resummarization() {
        let p = policy();
        let mut state = State::default();
        let mut next = 0;
        let mut all = Vec::new();
        for round in 0..4 {
            let (_, n) = until_job(&mut state, &p, "c", next, T0 + round * 1_000_000);
            all.extend(run_job(&mut state, &p, "c", false));
            next = n;
        }
        assert!(!fallbacks_in_context(&state, "c").is_empty());
        assert!(
            state.conversations["c"].summaries.len() > 2,
            "several rounds"
        );
        assert!(!debts_recorded(&all).contains(&DebtReason::Resummarize));
        assert!(state.conversations["c"]
            .debt
            .as_ref()
            .is_none_or(|d| d.reason != DebtReason::Resummarize));
    }

    #[test]
    fn a_model_summary_raises_resummarization_which_replaces_every_fallback() {
        let p = policy();
        let mut state = State::default();
        let next = with_fallbacks(&mut state, &p, "c");
        let old = fallbacks_in_context(&state, "c");
        // The next compaction is done by a model: evidence it is back.
        let (_, _) = until_job(&mut state, &p, "c", next, T0 + 1_000_000);
        let decisions = run_job(&mut state, &p, "c", true);
        assert_eq!(
            debts_recorded(&decisions).last(),
            Some(&DebtReason::Resummarize)
        );
        // Not a compaction cycle: no memory flush for it.
        assert!(!decisions.iter().any(|d| matches!(
            &d.body,
            EventBody::MemoryFlushRequested(m) if m.reason == DebtReason::Resummarize
        )));
        let job = jobs(&decisions).pop().expect("a re-summarization job");
        assert_eq!(job.reason, DebtReason::Resummarize);
        assert!(!job.urgent, "routine: spend window and backoff apply");

        let decisions = run_job(&mut state, &p, "c", true);
        assert!(fallbacks_in_context(&state, "c").is_empty());
        assert!(decisions.iter().any(|d| matches!(
            &d.body,
            EventBody::DebtCleared(c) if c.reason.contains("no deterministic fallback")
        )));
        let conv = &state.conversations["c"];
        assert!(conv.debt.is_none());
        assert_accounting(conv);
        for x in &old {
            // Lossless: the fallback stays in the DAG, out of context, and a
            // model summary over exactly its sources took its place.
            let k = conv.summary_index(&x.id).expect("kept in the DAG");
            assert!(!conv.context.contains(&ContextItem::Summary(k)));
            let new = conv
                .summaries
                .iter()
                .find(|s| s.supersedes.as_deref() == Some(x.id.as_str()))
                .expect("a replacement");
            assert!(!new.fallback);
            assert_eq!(
                (new.kind, new.depth, &new.covers),
                (x.kind, x.depth, &x.covers)
            );
            assert_eq!((new.first_turn, new.last_turn), (x.first_turn, x.last_turn));
            assert_eq!(new.source_tokens, x.source_tokens);
            let at = conv.summary_index(&new.id).expect("recorded");
            assert!(conv.context.contains(&ContextItem::Summary(at)));
        }
    }

    /// A fallback leaf in context and a model leaf over the same turns.
    fn resummary_of(state: &State, conv: &str) -> (Summary, SummaryRecorded) {
        let c = &state.conversations[conv];
        let x = c
            .fallback_summaries_in_context()
            .next()
            .expect("a fallback")
            .clone();
        let content = "Asked and done, as a model tells it.".to_string();
        let rec = SummaryRecorded {
            summary_id: summary_id(&c.key, x.kind, x.depth, &x.covers, &content, "model-v1"),
            job_id: None,
            kind: x.kind,
            depth: x.depth,
            covers: x.covers.clone(),
            content,
            source_tokens: x.source_tokens,
            tokens: 10,
            model: "test-model".into(),
            provider: "test".into(),
            prompt_version: "model-v1".into(),
            fallback: false,
            supersedes: Some(x.id.clone()),
        };
        (x, rec)
    }

    fn readdress(conv: &str, mut rec: SummaryRecorded) -> SummaryRecorded {
        rec.summary_id = summary_id(
            conv,
            rec.kind,
            rec.depth,
            &rec.covers,
            &rec.content,
            &rec.prompt_version,
        );
        rec
    }

    #[test]
    fn a_resummary_is_accepted_in_the_place_of_its_fallback() {
        let p = policy();
        let mut state = State::default();
        with_fallbacks(&mut state, &p, "c");
        let (x, rec) = resummary_of(&state, "c");
        let before = state.conversations["c"].clone();
        let pos = before
            .context
            .iter()
            .position(|&i| i == ContextItem::Summary(before.summary_index(&x.id).unwrap()))
            .unwrap();
        let out = fold(
            &mut state,
            &p,
            &sweep::summary_event("c", T0 + 9_000_000, rec.clone()),
        );
        assert_eq!(out.status, FoldStatus::Applied);
        let conv = &state.conversations["c"];
        let k = conv.summary_index(&rec.summary_id).unwrap();
        assert_eq!(conv.context[pos], ContextItem::Summary(k), "same position");
        assert_eq!(conv.context.len(), before.context.len());
        assert_eq!(
            conv.context_tokens,
            before.context_tokens - x.tokens + conv.summaries[k as usize].tokens
        );
        assert_eq!(conv.context_bytes, before.context_bytes);
        assert_accounting(conv);
        assert_eq!(
            conv.summaries[k as usize].supersedes.as_deref(),
            Some(x.id.as_str())
        );
        // Its sources' parents are the replacement from now on.
        assert!(conv.summary_index(&x.id).is_some());
    }

    #[test]
    fn a_resummary_that_does_not_match_is_rejected_whole() {
        let p = policy();
        let mut state = State::default();
        with_fallbacks(&mut state, &p, "c");
        let (x, good) = resummary_of(&state, "c");
        let model_leaf = {
            // A model summary in context, to be wrongly "superseded".
            let mut s2 = state.clone();
            fold(
                &mut s2,
                &p,
                &sweep::summary_event("c", T0 + 9_000_000, good.clone()),
            );
            s2
        };
        let Covers::Turns { first, last } = x.covers else {
            panic!("a leaf")
        };
        let cases: Vec<(&str, State, SummaryRecorded)> = vec![
            (
                "unknown summary",
                state.clone(),
                readdress(
                    "c",
                    SummaryRecorded {
                        supersedes: Some("sum_nope".into()),
                        ..good.clone()
                    },
                ),
            ),
            (
                "fallback summary cannot supersede",
                state.clone(),
                readdress(
                    "c",
                    SummaryRecorded {
                        fallback: true,
                        ..good.clone()
                    },
                ),
            ),
            (
                "must match",
                state.clone(),
                readdress(
                    "c",
                    SummaryRecorded {
                        covers: Covers::Turns {
                            first,
                            last: last + 1,
                        },
                        ..good.clone()
                    },
                ),
            ),
            (
                "must match",
                state.clone(),
                readdress(
                    "c",
                    SummaryRecorded {
                        kind: SummaryKind::Condensed,
                        depth: 1,
                        ..good.clone()
                    },
                ),
            ),
            (
                "content address",
                state.clone(),
                SummaryRecorded {
                    content: "tampered".into(),
                    ..good.clone()
                },
            ),
            (
                // The fallback was already replaced: stale.
                "no longer in context",
                model_leaf.clone(),
                readdress(
                    "c",
                    SummaryRecorded {
                        content: "another model's take".into(),
                        ..good.clone()
                    },
                ),
            ),
            (
                "not a deterministic fallback",
                model_leaf.clone(),
                readdress(
                    "c",
                    SummaryRecorded {
                        supersedes: Some(good.summary_id.clone()),
                        content: "a model over a model".into(),
                        ..good.clone()
                    },
                ),
            ),
        ];
        for (why, mut st, rec) in cases {
            let before = st.conversations["c"].clone();
            let out = fold(&mut st, &p, &sweep::summary_event("c", T0 + 9_100_000, rec));
            let FoldStatus::Rejected(reason) = &out.status else {
                panic!("{why}: accepted");
            };
            assert!(reason.contains(why), "{why}: {reason}");
            assert!(out
                .decisions
                .iter()
                .any(|d| matches!(&d.body, EventBody::SummaryRejected(r) if &r.reason == reason)));
            let conv = &st.conversations["c"];
            assert_eq!(conv.context, before.context, "{why}: nothing applied");
            assert_eq!(conv.context_tokens, before.context_tokens);
            assert_eq!(conv.summaries.len(), before.summaries.len());
        }
    }

    #[test]
    fn a_condensed_summary_of_depth_zero_is_rejected() {
        // Its children's expected depth was depth - 1: an overflow.
        let p = policy();
        let mut state = State::default();
        with_fallbacks(&mut state, &p, "c");
        let mut ids: Vec<String> = state.conversations["c"]
            .summaries
            .iter()
            .map(|s| s.id.clone())
            .collect();
        ids.extend(ids.clone());
        let (_, leaf) = resummary_of(&state, "c");
        let rec = readdress(
            "c",
            SummaryRecorded {
                kind: SummaryKind::Condensed,
                depth: 0,
                covers: Covers::Summaries { ids },
                supersedes: None,
                ..leaf
            },
        );
        let out = fold(
            &mut state,
            &p,
            &sweep::summary_event("c", T0 + 9_100_000, rec),
        );
        let FoldStatus::Rejected(reason) = &out.status else {
            panic!("accepted: {:?}", out.decisions);
        };
        assert!(reason.contains("depth 1 or more"), "{reason}");
    }

    #[test]
    fn a_threshold_trigger_takes_over_a_pending_resummarization() {
        let p = policy();
        let mut state = State::default();
        let next = with_fallbacks(&mut state, &p, "c");
        let (_, next) = until_job(&mut state, &p, "c", next, T0 + 1_000_000);
        let decisions = run_job(&mut state, &p, "c", true);
        let job = jobs(&decisions).pop().expect("a re-summarization job");
        assert_eq!(job.reason, DebtReason::Resummarize);
        let cycle = state.conversations["c"].cycle;
        // Turns arrive while it runs, until compaction is owed again.
        let mut taken = Vec::new();
        for i in next..next + 40 {
            let out = fold(&mut state, &p, &turn("c", i, T0 + 2_000_000 + i * 1_000));
            taken.extend(out.decisions);
            if debts_recorded(&taken).contains(&DebtReason::Threshold) {
                break;
            }
        }
        assert_eq!(debts_recorded(&taken), vec![DebtReason::Threshold]);
        let conv = &state.conversations["c"];
        let debt = conv.debt.as_ref().expect("one debt");
        assert_eq!(debt.reason, DebtReason::Threshold);
        assert_eq!(conv.cycle, cycle + 1, "compaction starts a cycle");
        assert!(taken
            .iter()
            .any(|d| matches!(&d.body, EventBody::MemoryFlushRequested(m) if m.reason == DebtReason::Threshold)));
        // The re-summarization job fails; its end issues nothing, and the
        // next turn gets the compaction job.
        let failed = SweepEnded {
            committed: 0,
            stop: SweepStop::NoProgress,
            ..ended(&job, 0, SweepStop::NoProgress)
        };
        let out = fold(&mut state, &p, &event(failed, "c", T0 + 3_000_000));
        assert!(jobs(&out.decisions).is_empty());
        assert_eq!(
            state.conversations["c"].debt.as_ref().map(|d| d.reason),
            Some(DebtReason::Threshold)
        );
    }

    #[test]
    fn a_trigger_with_nothing_to_compact_leaves_a_resummarization_alone() {
        let p = policy();
        let mut state = State::default();
        let next = with_fallbacks(&mut state, &p, "c");
        let (_, next) = until_job(&mut state, &p, "c", next, T0 + 1_000_000);
        let decisions = run_job(&mut state, &p, "c", true);
        let job = jobs(&decisions).pop().expect("a re-summarization job");
        // The model failed again: backoff, the debt stays.
        let failed = ended(&job, 0, SweepStop::NoProgress);
        fold(&mut state, &p, &event(failed, "c", T0 + 2_000_000));
        // Everything raw is fresh tail and nothing condenses: over the
        // threshold, a trigger has no compaction work. It must neither take
        // the debt over nor let it be cleared and raised again every turn.
        let q = PolicyConfig {
            fresh_tail_count: 10_000,
            // Capped at the budget: the tail holds every raw turn in context.
            fresh_tail_max_tokens: Some(u64::MAX),
            leaf_fanout: 10_000,
            condensed_fanout: 10_000,
            ..p.clone()
        };
        let mut all = Vec::new();
        let mut i = next;
        while {
            let conv = &state.conversations["c"];
            conv.context_tokens <= policy::levels(conv, &q).threshold_tokens
        } {
            let out = fold(&mut state, &q, &turn("c", i, T0 + 2_100_000 + i * 1_000));
            all.extend(out.decisions);
            i += 1;
        }
        // Events that change nothing, over the threshold: no flapping.
        for k in 0..5 {
            let declared = Envelope::new(
                format!("model-{k}"),
                "c",
                T0 + 2_900_000 + k,
                EventBody::ModelDeclared(ModelDeclared {
                    model: "gpt-4o".into(),
                    context_window: None,
                }),
            );
            all.extend(fold(&mut state, &q, &declared).decisions);
        }
        let conv = &state.conversations["c"];
        assert!(conv.context_tokens > policy::levels(conv, &q).threshold_tokens);
        assert!(
            !all.iter().any(|d| matches!(
                d.body,
                EventBody::DebtRecorded(_) | EventBody::DebtUpdated(_) | EventBody::DebtCleared(_)
            )),
            "{all:?}"
        );
        assert_eq!(
            conv.debt.as_ref().map(|d| d.reason),
            Some(DebtReason::Resummarize)
        );
        assert!(jobs(&all).is_empty(), "in backoff");
    }
}
