//! Debt bookkeeping and the job scheduler: what raises debt (thresholds,
//! overflows, manual requests, resets), when a compaction cycle starts, and
//! `evaluate`, which decides whether a job is issued now.

use super::*;

impl FoldContext<'_> {
    pub(super) fn provider_error(&mut self, e: &ProviderErrorObserved) -> FoldStatus {
        let verdict = overflow::classify(&e.error);
        if !verdict.overflow {
            self.history(
                "provider_error_observed",
                "not a context overflow; no compaction".into(),
            );
            return FoldStatus::Applied;
        }
        self.conv.last_overflow_tokens = verdict.requested_tokens;
        let levels = self.levels();
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

    pub(super) fn compaction_requested(&mut self, r: &CompactionRequested) -> FoldStatus {
        let levels = self.levels();
        let target = r.target_tokens.unwrap_or(levels.target_tokens);
        self.history(
            "compaction_requested",
            format!("manual compaction to {target} tokens"),
        );
        self.raise_debt(DebtReason::Manual, true, target, r.instructions.clone());
        FoldStatus::Applied
    }

    pub(super) fn reset(&mut self, r: &ConversationReset) -> FoldStatus {
        let c = &mut *self.conv;
        c.epoch += 1;
        c.context.clear();
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

    /// The debt is paid: dropped, with a history entry and a `debt_cleared`
    /// decision saying why.
    fn clear_debt(&mut self, reason: String) {
        self.conv.debt = None;
        self.history("debt_cleared", reason.clone());
        self.decide(
            "debt_cleared",
            EventBody::DebtCleared(DebtCleared { reason }),
        );
    }

    /// Records a new debt or coalesces a trigger into the pending one.
    pub(super) fn raise_debt(
        &mut self,
        reason: DebtReason,
        urgent: bool,
        target: u64,
        instructions: Option<String>,
    ) {
        let levels = self.levels();
        let now = self.event.time;
        match &mut self.conv.debt {
            None => {
                let debt = Debt {
                    reason,
                    context_tokens: self.conv.context.tokens(),
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
                debt.context_tokens = self.conv.context.tokens();
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
    pub(super) fn start_cycle(&mut self, reason: DebtReason) {
        self.conv.cycle += 1;
        let cycle = self.conv.cycle;
        self.decide(
            "memory_flush_requested",
            EventBody::MemoryFlushRequested(MemoryFlushRequested { cycle, reason }),
        );
    }

    /// The pending job ended or expired and the fold accepted nothing of
    /// it: the next job waits for agent input that comes after it, and a
    /// routine one also for the backoff (a Retry-After is its own delay).
    /// Never the same job again at once: with no new input it would meet
    /// the same state and fail the same way, for ever.
    pub(super) fn round_without_progress(&mut self, urgent: bool, retry_after: bool) {
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
    pub(super) fn maybe_owe_resummary(&mut self, cleared: bool, levels: &policy::Levels) {
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
    pub(super) fn evaluate(&mut self) {
        if policy::session_matches(&self.policy.stateless_sessions, &self.conv.key) {
            return;
        }
        let levels = self.levels();
        let tokens = self.conv.context.tokens();
        let over_bytes = self
            .policy
            .max_active_transcript_bytes
            .is_some_and(|max| self.conv.context.bytes() > max);
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
            cleared = true;
            self.clear_debt("no deterministic fallback summary is left in context".to_string());
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
                cleared = true;
                self.clear_debt(reason);
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
