//! Debt bookkeeping: what raises debt (thresholds, overflows, manual
//! requests, resets), when a compaction cycle starts, when a debt is paid,
//! and `evaluate`, which carries out what the scheduler
//! (`core::policy::schedule`) says: give up an expired job, issue a job,
//! or set the conversation's timer for the end of its wait.

use super::*;
use crate::core::derived_id::DerivedId;

/// Rounds in a row without progress (the model's re-summaries failed or
/// were rejected) after which a re-summarization debt is cleared, and none
/// is owed again until a newer model summary is recorded.
pub const RESUMMARY_ROUNDS: u32 = 3;

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
        c.rolling_tokens = None;
        c.recent_user_turns.clear();
        let reason = r
            .reason
            .clone()
            .unwrap_or_else(|| "conversation reset".into());
        self.history("conversation_reset", reason);
        if self.conv.debt.take().is_some() {
            self.decide(EventBody::DebtCleared(DebtCleared {
                reason: "conversation reset".into(),
            }));
        }
        FoldStatus::Applied
    }

    /// The debt is paid: dropped, with a history entry and a `debt_cleared`
    /// decision saying why.
    fn clear_debt(&mut self, reason: String) {
        self.conv.debt = None;
        self.history("debt_cleared", reason.clone());
        self.decide(EventBody::DebtCleared(DebtCleared { reason }));
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
        let now = self.now;
        if urgent {
            // The agent asks again: whatever a failed round said about
            // waiting, this request is not held by the backoff (the urgent
            // spend cap still holds it).
            let spend = &mut self.conv.spend;
            spend.backoff_until = spend.backoff_until.min(now);
        }
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
                self.decide(EventBody::DebtRecorded(debt));
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
                self.decide(EventBody::DebtUpdated(debt));
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
        self.decide(EventBody::MemoryFlushRequested(MemoryFlushRequested {
            cycle,
            reason,
        }));
    }

    /// The pending job ended or expired and the fold accepted nothing of
    /// it: the next job waits for a backoff that doubles with each such
    /// round in a row (a Retry-After is its own delay). Never the same job
    /// again at once: with nothing new it would meet the same state and
    /// fail the same way; never a wait without an end either.
    pub(super) fn round_without_progress(&mut self, retry_after: bool) {
        if retry_after {
            return;
        }
        let spend = &mut self.conv.spend;
        spend.rounds_without_progress = spend.rounds_without_progress.saturating_add(1);
        let until = self.now.saturating_add(
            self.policy
                .no_progress_backoff(spend.rounds_without_progress),
        );
        spend.backoff_until = spend.backoff_until.max(until);
        self.out.notes.push(ScheduleNote::BackedOff {
            conversation: self.conv.key.clone(),
            until: spend.backoff_until,
        });
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
        // A round gave up on this evidence: wait for newer.
        if self.conv.resummary_given_up_at == Some(self.conv.summaries.len() as u64) {
            return;
        }
        if self.conv.fallback_summaries_in_context().next().is_none() {
            return;
        }
        self.conv.resummary_given_up_at = None;
        self.raise_debt(DebtReason::Resummarize, false, levels.target_tokens, None);
    }

    /// A re-summarization round ended without progress (not told to retry
    /// later): its model summaries failed or were rejected. A failure may
    /// pass, so the debt waits out the backoff and tries again; after
    /// [`RESUMMARY_ROUNDS`] such rounds in a row, another would meet the
    /// same sources and the same model, and spend on them, without an end
    /// (re-summarizing is opportunistic): the debt is cleared and the
    /// fallbacks stay until a newer model summary is recorded
    /// ([`FoldContext::maybe_owe_resummary`]).
    pub(super) fn resummary_made_no_progress(&mut self) {
        let rounds = self.conv.spend.rounds_without_progress;
        if rounds < RESUMMARY_ROUNDS {
            return;
        }
        self.conv.resummary_given_up_at = Some(self.conv.summaries.len() as u64);
        let fallbacks = self.conv.fallback_summaries_in_context().count();
        self.clear_debt(format!(
            "re-summarization made no progress in {rounds} rounds (the model's summaries \
             failed or were rejected); {fallbacks} fallback summaries stay in context until a \
             newer model summary is recorded"
        ));
    }

    /// Re-evaluates the triggers after every event (and when the
    /// conversation's timer is due): records, updates or clears the single
    /// debt, then does what the scheduler says.
    pub(super) fn evaluate(&mut self) {
        if policy::session_matches(&self.policy.stateless_sessions, &self.conv.key) {
            return;
        }
        let levels = self.levels();
        self.raise_threshold_debts(&levels);
        let now = self.now;
        if let Some(pending) = self
            .conv
            .pending_job
            .take_if(|p| now >= schedule::expires_at(p))
        {
            self.expire(pending);
        }
        if let Some(pending) = &self.conv.pending_job {
            let at = schedule::expires_at(pending);
            self.clock.set(&self.conv.key, Some(at));
            return;
        }
        let cleared = self.clear_paid_debt();
        self.maybe_owe_resummary(cleared, &levels);
        let limits = self.policy.spend_limits();
        self.conv.spend.prune(now, limits.window_ms);
        if limits.has_partition_limits() {
            self.global.prune(now, limits.window_ms);
        }
        let next = policy::schedule(self.conv, &self.conv.spend, self.global, self.policy, now);
        self.clock.set(&self.conv.key, next.wake_at());
        match next {
            Schedule::Issue(grant) => {
                self.conv.spend.holding = None;
                self.issue(grant, limits.has_partition_limits());
            }
            Schedule::Wait { on, until: _ } => {
                if matches!(on, Wait::PartitionWindow | Wait::TenantWindow) {
                    // Refused only for the partition's (or its tenant's)
                    // sake: it counts toward the fair share while it
                    // waits, and a job's end looks at it again at once.
                    self.global.wait(&self.conv.key, now);
                }
                if on.is_spend() && self.conv.spend.holding != Some(on) {
                    self.out.notes.push(ScheduleNote::SpendWindowClosed {
                        conversation: self.conv.key.clone(),
                        on,
                    });
                }
                self.conv.spend.holding = Some(on);
            }
            Schedule::Idle
            | Schedule::Blocked(_)
            | Schedule::Running { .. }
            | Schedule::Expired => {
                self.conv.spend.holding = None;
            }
        }
    }

    /// Records, updates or takes over debt for a context over its
    /// threshold or transcript bytes, when there is work to do.
    fn raise_threshold_debts(&mut self, levels: &policy::Levels) {
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
            && policy::next_compaction(
                &*self.conv,
                self.policy,
                policy::Standing {
                    context_tokens: tokens,
                    target_tokens: levels.target_tokens,
                    budget: levels.budget,
                    prefix_target_tokens: levels.prefix_target_tokens,
                    urgent: false,
                },
            )
            .is_some();
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
    }

    /// Gives up a job whose worker vanished (no `sweep_ended` by its
    /// expiry): what it committed stays; without progress it backs off.
    fn expire(&mut self, pending: PendingJob) {
        self.history(
            "job_expired",
            format!(
                "{} ended without a sweep_ended event; {} of its summaries accepted",
                pending.job.job_id, pending.committed
            ),
        );
        self.out.notes.push(ScheduleNote::JobExpired {
            conversation: self.conv.key.clone(),
            job_id: pending.job.job_id.clone(),
        });
        if pending.made_progress() {
            self.conv.spend.rounds_without_progress = 0;
        } else {
            self.round_without_progress(false);
        }
    }

    /// Clears the debt when it is paid: a re-summarization when no fallback
    /// summary is left in context; a compaction when the context is under
    /// its target, or nothing outside the fresh tail is left to compact.
    /// Returns whether it cleared one.
    fn clear_paid_debt(&mut self) -> bool {
        let tokens = self.conv.context.tokens();
        let resummarizing = self
            .conv
            .debt
            .as_ref()
            .is_some_and(|d| d.reason == DebtReason::Resummarize);
        if resummarizing && self.conv.fallback_summaries_in_context().next().is_none() {
            self.clear_debt("no deterministic fallback summary is left in context".to_string());
            return true;
        }
        let Some(debt) = self
            .conv
            .debt
            .as_ref()
            .filter(|d| d.reason != DebtReason::Resummarize)
        else {
            return false;
        };
        let conv: &Conversation = self.conv;
        let over = tokens > debt.target_tokens;
        let levels = policy::levels(conv, self.policy);
        let work_left = policy::next_compaction(
            conv,
            self.policy,
            policy::Standing {
                context_tokens: tokens,
                target_tokens: debt.target_tokens,
                budget: levels.budget,
                prefix_target_tokens: levels.prefix_target_tokens,
                urgent: debt.urgent,
            },
        )
        .is_some();
        if over && work_left {
            return false;
        }
        let reason = if !over {
            format!(
                "context at {tokens} tokens, under target {}",
                debt.target_tokens
            )
        } else {
            format!(
                "context at {tokens} tokens but nothing outside the fresh tail is left to compact"
            )
        };
        self.clear_debt(reason);
        true
    }

    /// Issues the job the scheduler granted.
    fn issue(&mut self, grant: policy::Grant, partition_limits: bool) {
        let now = self.now;
        let tokens = self.conv.context.tokens();
        if partition_limits {
            self.global.stop_waiting(&self.conv.key);
        }
        let job_id = DerivedId::Job {
            conversation: &self.conv.key,
            issued: self.conv.jobs_issued,
        }
        .to_string();
        self.conv.jobs_issued += 1;
        let deadline_ms = if grant.reason == DebtReason::Overflow {
            self.policy.compact_until_under_deadline_ms
        } else {
            self.policy.sweep_deadline_ms
        };
        let refresh_rolling_state = self.conv.rolling_due;
        self.history(
            "job_issued",
            if grant.compact {
                format!(
                    "{job_id}: {:?}{}, {tokens} -> {} tokens, up to {} calls",
                    grant.reason,
                    if grant.urgent { " (urgent)" } else { "" },
                    grant.target_tokens,
                    grant.max_calls
                )
            } else {
                format!("{job_id}: rolling session state only")
            },
        );
        if partition_limits {
            // Hold the allowance until the job ends, so jobs of other
            // conversations cannot be granted the same calls.
            self.global.record(SpendEntry {
                time: now,
                job_id: job_id.clone(),
                conversation: self.conv.key.clone(),
                calls: grant.max_calls,
                tokens: grant.max_tokens.unwrap_or(0),
                cost_micros: 0,
                reserved_until: Some(now + 2 * deadline_ms + schedule::JOB_GRACE_MS),
                urgent: grant.urgent,
            });
        }
        let job = JobIssued {
            job_id: job_id.clone(),
            reason: grant.reason,
            urgent: grant.urgent,
            context_tokens: tokens,
            target_tokens: grant.target_tokens,
            deadline_ms,
            issued_at: now,
            instructions: grant.instructions,
            compact: grant.compact,
            refresh_rolling_state,
            max_calls: Some(grant.max_calls),
            max_tokens: grant.max_tokens,
        };
        let pending = PendingJob::new(job.clone());
        self.clock
            .set(&self.conv.key, Some(schedule::expires_at(&pending)));
        self.conv.pending_job = Some(pending);
        self.out.issued.push((self.conv.key.clone(), job_id));
        self.decide(EventBody::JobIssued(job));
    }
}
