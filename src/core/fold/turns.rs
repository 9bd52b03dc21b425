//! Turn admission: a turn's tokens, its tool pairing, the duplicate and
//! flood guards, and what it adds to the context and the debt.

use super::*;

impl FoldContext<'_> {
    /// `shared` is `t` itself when the state may keep it as it is.
    pub(super) fn turn_appended(
        &mut self,
        t: &TurnAppended,
        shared: Option<&Arc<TurnBody>>,
    ) -> FoldStatus {
        let msg = &t.message;
        if msg.role == Role::Tool {
            let Some(call_id) = msg.tool_call_id.as_deref() else {
                return FoldStatus::Rejected(TurnRejection::ToolTurnWithoutCallId.into());
            };
            let call = call_digest(call_id);
            let known = self
                .conv
                .turns
                .iter()
                .rev()
                .any(|turn| turn.epoch == self.conv.epoch && turn.makes_call(call));
            if !known {
                return FoldStatus::Rejected(
                    TurnRejection::OrphanToolResult {
                        call_id: call_id.to_string(),
                    }
                    .into(),
                );
            }
        }
        if msg.tool_calls.iter().any(|c| c.id.is_empty()) {
            return FoldStatus::Rejected(TurnRejection::EmptyToolCallId.into());
        }
        // The guards compare turns by the digest of their normalized text,
        // computed only for turns whose cheap sketch matches (`Probe`).
        let seq = self.conv.turns.len() as u64;
        let mut probe = Probe::new(msg);
        let Conversation {
            turns,
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
            .find_map(|(seen, c)| probe.same_as(seen, turns, bodies).then_some(c))
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
            return FoldStatus::Rejected(
                TurnRejection::ReplayFlood {
                    count,
                    role: msg.role.as_str(),
                    limit,
                }
                .into(),
            );
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
                .any(|(_, seen)| probe.same_as(seen, turns, bodies))
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
        let encoding = self.conv.encoding;
        let tokens = self
            .measured
            .and_then(|m| m.tokens_in(encoding))
            .unwrap_or_else(|| tokens::count_message(encoding, msg));
        self.push_turn(t, tokens, in_context, shared);
        FoldStatus::Applied
    }

    pub(super) fn push_turn(
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
        let levels = self.levels();
        let large = tokens
            > self
                .policy
                .large_payload_threshold_tokens
                .min(levels.target_tokens);
        let context_tokens = if large {
            // Shown as a stub: it costs what the stub message costs.
            tokens::count_message(
                self.conv.encoding,
                &assembly::payload_stub_message(msg, self.id, tokens),
            )
        } else {
            tokens
        };
        let bytes = msg.text_bytes() as u64;
        // What its masked rendering would cost, counted once here so that
        // assembly (a cold query too) weighs it without a tokenizer.
        let masked_tokens = if large {
            0
        } else {
            // An assistant turn's masked rendering does not name the turn:
            // measured ahead in this encoding, its count is taken as it is.
            let measured_calls = self
                .measured
                .filter(|m| msg.role == Role::Assistant && m.encoding == self.conv.encoding)
                .map(|m| m.masked_calls_tokens);
            measured_calls
                .unwrap_or_else(|| {
                    let telling = self.measured.and_then(|m| m.telling.as_deref());
                    crate::core::mask::masked_told(msg, seq, telling)
                        .map(|m| tokens::count_message(self.conv.encoding, &m))
                })
                .filter(|&cost| cost < context_tokens)
                .unwrap_or(0)
        };
        // Stored as 32-bit counts; what context sums is the same count.
        let (tokens, context_tokens, bytes) = (
            u64::from(turn_count(tokens)),
            u64::from(turn_count(context_tokens)),
            u64::from(turn_count(bytes)),
        );
        // Grown by a quarter, not doubled: every resident turn is here, and
        // a doubled vector is a third empty on average. A quarter leaves it
        // about a tenth empty (some 6 bytes a turn of its 64) and copies each
        // turn about four times as it grows; an eighth copied it eight times,
        // 2% of the folder's CPU on the ingest bench (twenty-ninth pass).
        if self.conv.turns.len() == self.conv.turns.capacity() {
            let len = self.conv.turns.len();
            self.conv.turns.reserve_exact((len / 4).max(8));
        }
        self.conv.turns.push(Turn {
            seq,
            time: self.event.time,
            event: event_digest(self.id),
            tokens: turn_count(tokens),
            context_tokens: turn_count(context_tokens),
            bytes: turn_count(bytes),
            epoch: self.conv.epoch,
            role: msg.role,
            in_context,
            large_payload: large,
            masked_tokens: turn_count(masked_tokens),
            tool_ids: tool_ids_of(msg),
        });
        self.conv.bodies.insert(
            seq,
            shared.map_or_else(|| Arc::new(TurnBody::new(self.id, t.clone())), Arc::clone),
        );
        if in_context {
            self.conv
                .context
                .push(ContextItem::Turn(seq), context_tokens, bytes);
        }
        self.conv.turns_since_rolling += 1;
        match msg.role {
            Role::Assistant if !msg.tool_calls.is_empty() => {
                self.conv.consecutive_tool_calls += msg.tool_calls.len() as u64
            }
            Role::User => self.conv.consecutive_tool_calls = 0,
            _ => {}
        }
        let before = self.conv.context.tokens().saturating_sub(context_tokens);
        if self.conv.turns_since_rolling >= self.policy.rolling_every_turns
            || self.conv.consecutive_tool_calls >= self.policy.rolling_tool_loop
            || (before <= levels.rolling_tokens
                && self.conv.context.tokens() > levels.rolling_tokens)
        {
            self.conv.rolling_due = true;
        }
    }
}
