//! The end of a sweep and a recall: their spend goes into the conversation's
//! and the partition's spend windows, and a round that made no progress is
//! counted.

use super::*;

impl FoldContext<'_> {
    pub(super) fn sweep_ended(&mut self, s: &SweepEnded) -> FoldStatus {
        let now = self.now;
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
            urgent: pending.as_ref().is_some_and(|p| p.job.urgent),
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
        if progress {
            self.conv.spend.rounds_without_progress = 0;
        } else {
            self.round_without_progress(s.retry_after_ms.is_some());
        }
        // An urgent round that found nothing to compact ends its debt; one
        // that failed (auth, deadline, rate limit) or whose summaries were
        // all stale keeps it for the next agent input.
        let nothing_to_do =
            matches!(s.stop, SweepStop::Done | SweepStop::NoProgress) && s.retry_after_ms.is_none();
        let resummarizing = pending
            .as_ref()
            .is_some_and(|p| p.job.reason == DebtReason::Resummarize)
            && self
                .conv
                .debt
                .as_ref()
                .is_some_and(|d| d.reason == DebtReason::Resummarize);
        if resummarizing && !progress && s.retry_after_ms.is_none() {
            self.resummary_made_no_progress();
        }
        if !progress
            && s.committed == 0
            && urgent
            && nothing_to_do
            && self.conv.debt.as_ref().is_some_and(|d| d.urgent)
        {
            self.conv.debt = None;
            self.decide(EventBody::DebtCleared(DebtCleared {
                    reason: format!("urgent compaction made no progress ({:?}); nothing left outside the fresh tail", s.stop),
                }),
            );
        }
        FoldStatus::Applied
    }

    /// Records spend in the conversation's window and, under a
    /// partition-wide limit, in the partition's, both pruned to `now`.
    ///
    /// A job's end releases what it held in the partition's window: the
    /// conversations waiting for the partition are looked at again at once
    /// (their timers move to now), not when their wait would have ended.
    pub(super) fn record_spend(&mut self, entry: SpendEntry, now: u64, window: u64) {
        self.conv.spend.prune(now, window);
        if self.policy.spend_limits().has_partition_limits() {
            self.global.prune(now, window);
            self.global.record(SpendEntry {
                conversation: self.conv.key.clone(),
                ..entry.clone()
            });
            for (waiting, _) in &self.global.waiting {
                if waiting != &self.conv.key && self.clock.timer(waiting).is_some_and(|at| at > now)
                {
                    self.clock.set(waiting, Some(now));
                }
            }
        }
        self.conv.spend.record(entry);
    }

    /// A delegated recall's model calls count in the spend window (the
    /// conversation's, and the partition's under a partition-wide limit)
    /// at the event's time; nothing else changes.
    pub(super) fn recall_answered(&mut self, r: &RecallAnswered) -> FoldStatus {
        let now = self.now;
        let window = self.policy.summary_call_window_ms;
        let entry = SpendEntry {
            time: now,
            // Not a job: the event id keeps it apart from every job's.
            job_id: self.id.to_string(),
            conversation: String::new(),
            calls: r.calls,
            tokens: r.tokens_spent,
            cost_micros: r.cost_micros,
            reserved_until: None,
            urgent: false,
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
}
