//! Spend windows: what summarizer calls, tokens and money a conversation
//! (and a partition) spent in the last `summary_call_window_ms` of
//! conversation time, and what a new job may still be granted. The fold
//! decides with [`allowance`]; `status` reports the very same numbers.

use crate::core::policy::PolicyConfig;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Spend of one sweep in a spend window, counted at the time its job was
/// issued (conversation time). While `reserved_until` is set, the amounts
/// are the allowance the running job may still use, not yet what it spent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpendEntry {
    pub time: u64,
    pub job_id: String,
    /// Whose job it was (kept in the partition's window only).
    #[serde(default)]
    pub conversation: String,
    pub calls: u32,
    pub tokens: u64,
    pub cost_micros: u64,
    /// The job is running: its allowance is held until it ends, or until
    /// this time if its `sweep_ended` never comes.
    #[serde(default)]
    pub reserved_until: Option<u64>,
}

impl SpendEntry {
    /// Whether it counts against the limits at `now`: held for a running
    /// job, or spent within the last `window_ms`.
    pub fn counts_at(&self, now: u64, window_ms: u64) -> bool {
        self.reserved_until.is_some() || self.time.saturating_add(window_ms) > now
    }
}

/// Spend in a sliding window of conversation time: whatever the instant,
/// the sweeps of the last `summary_call_window_ms` count, so no span of
/// that length ever holds more than the limits allow.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpendWindow {
    /// Sweeps that still count, oldest first.
    pub recent: Vec<SpendEntry>,
    /// No routine job before this time (a round made no progress).
    pub backoff_until: u64,
    /// No job at all before this time: the provider asked (Retry-After).
    #[serde(default)]
    pub retry_at: u64,
    /// Conversations refused a job for want of the partition's allowance,
    /// and since when (partition window only): they count toward the fair
    /// share of the calls.
    #[serde(default)]
    pub waiting: Vec<(String, u64)>,
}

/// Totals of a [`SpendWindow`] at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpendTotals {
    pub calls: u32,
    pub tokens: u64,
    pub cost_micros: u64,
}

impl SpendWindow {
    /// Drops sweeps that no longer count at `now`; a reservation whose job
    /// vanished becomes spend (the worker may have used all of it).
    pub fn prune(&mut self, now: u64, window_ms: u64) {
        for e in &mut self.recent {
            if e.reserved_until.is_some_and(|until| until <= now) {
                e.reserved_until = None;
            }
        }
        self.recent.retain(|e| e.counts_at(now, window_ms));
        self.waiting
            .retain(|(_, since)| since.saturating_add(window_ms) > now);
    }

    /// Calls of `conversation`'s sweeps that count at `now`.
    pub fn calls_of(&self, conversation: &str, now: u64, window_ms: u64) -> u32 {
        self.recent
            .iter()
            .filter(|e| e.conversation == conversation && e.counts_at(now, window_ms))
            .map(|e| e.calls)
            .fold(0u32, u32::saturating_add)
    }

    /// Conversations that spend or wait in the window at `now`.
    pub fn active_conversations(&self, now: u64, window_ms: u64) -> BTreeSet<&str> {
        self.recent
            .iter()
            .filter(|e| e.counts_at(now, window_ms))
            .map(|e| e.conversation.as_str())
            .chain(self.waiting.iter().map(|(c, _)| c.as_str()))
            .collect()
    }

    /// Marks `conversation` as waiting for an allowance (once).
    pub fn wait(&mut self, conversation: &str, now: u64) {
        if !self.waiting.iter().any(|(c, _)| c == conversation) {
            self.waiting.push((conversation.to_string(), now));
        }
    }

    pub fn stop_waiting(&mut self, conversation: &str) {
        self.waiting.retain(|(c, _)| c != conversation);
    }

    /// What counts against the limits at `now` (reservations included).
    pub fn totals(&self, now: u64, window_ms: u64) -> SpendTotals {
        let mut t = SpendTotals::default();
        for e in &self.recent {
            if e.counts_at(now, window_ms) {
                t.calls = t.calls.saturating_add(e.calls);
                t.tokens = t.tokens.saturating_add(e.tokens);
                t.cost_micros = t.cost_micros.saturating_add(e.cost_micros);
            }
        }
        t
    }

    /// Records a sweep's spend, replacing what was held for its job.
    pub fn record(&mut self, entry: SpendEntry) {
        // A job's spend replaces what was held for it, even a reservation
        // that expired into spend while its sweep ran late.
        if let Some(held) = self
            .recent
            .iter_mut()
            .find(|e| !e.job_id.is_empty() && e.job_id == entry.job_id)
        {
            *held = SpendEntry {
                time: held.time,
                ..entry
            };
            return;
        }
        if entry.calls == 0 && entry.tokens == 0 && entry.cost_micros == 0 {
            return;
        }
        let at = self.recent.partition_point(|e| e.time <= entry.time);
        self.recent.insert(at, entry);
    }
}

/// What a conversation may still spend at one instant. The windows must be
/// pruned to that instant first ([`SpendWindow::prune`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowance {
    /// The conversation's own spend in the window.
    pub own: SpendTotals,
    /// Calls its own window alone would still allow.
    pub own_calls_left: u32,
    /// Calls a job may be granted (own, partition and fair-share limits).
    pub calls_left: u32,
    pub tokens_left: Option<u64>,
    pub cost_left: Option<u64>,
    /// A round made no progress: no routine job yet.
    pub in_backoff: bool,
    /// Present when partition-wide limits are configured.
    pub partition: Option<PartitionAllowance>,
}

/// The partition-wide part of an [`Allowance`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionAllowance {
    pub totals: SpendTotals,
    /// Conversations spending or waiting in the window (this one included).
    pub active_conversations: usize,
    /// Each active conversation's fair share of the partition's calls.
    pub share_calls: Option<u32>,
}

impl Allowance {
    /// A routine (non-urgent) job may be issued.
    pub fn routine_ok(&self) -> bool {
        self.calls_left > 0
            && self.tokens_left != Some(0)
            && self.cost_left != Some(0)
            && !self.in_backoff
    }
}

/// A partition-wide spend limit is configured.
pub fn has_partition_limits(policy: &PolicyConfig) -> bool {
    policy.summary_max_calls_per_window_global.is_some()
        || policy.summary_max_tokens_per_window_global.is_some()
        || policy.summary_max_cost_micros_per_window_global.is_some()
}

/// The tighter of two optional limits (`None` is unlimited).
fn min_limit(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What conversation `key` may still spend at `now`, given its own window
/// and its partition's (both pruned to `now`).
pub fn allowance(
    own: &SpendWindow,
    partition: &SpendWindow,
    key: &str,
    policy: &PolicyConfig,
    now: u64,
) -> Allowance {
    let window = policy.summary_call_window_ms;
    let mine = own.totals(now, window);
    let left = |max: Option<u64>, used: u64| max.map(|m| m.saturating_sub(used));
    let own_calls_left = policy
        .summary_max_calls_per_window
        .saturating_sub(mine.calls);
    let mut a = Allowance {
        own: mine,
        own_calls_left,
        calls_left: own_calls_left,
        tokens_left: left(policy.summary_max_tokens_per_window, mine.tokens),
        cost_left: left(policy.summary_max_cost_micros_per_window, mine.cost_micros),
        in_backoff: now < own.backoff_until,
        partition: None,
    };
    if !has_partition_limits(policy) {
        return a;
    }
    let all = partition.totals(now, window);
    // A fair share of the partition's calls for each conversation that
    // spends or waits in the window, so the first to ask cannot hold the
    // whole window while others wait.
    let mut active = partition.active_conversations(now, window);
    active.insert(key);
    let share_calls = policy
        .summary_max_calls_per_window_global
        .map(|max| max.div_ceil(active.len().max(1) as u32));
    if let (Some(max), Some(share)) = (policy.summary_max_calls_per_window_global, share_calls) {
        let used = partition.calls_of(key, now, window);
        a.calls_left = a
            .calls_left
            .min(max.saturating_sub(all.calls))
            .min(share.saturating_sub(used));
    }
    a.tokens_left = min_limit(
        a.tokens_left,
        left(policy.summary_max_tokens_per_window_global, all.tokens),
    );
    a.cost_left = min_limit(
        a.cost_left,
        left(
            policy.summary_max_cost_micros_per_window_global,
            all.cost_micros,
        ),
    );
    a.partition = Some(PartitionAllowance {
        totals: all,
        active_conversations: active.len(),
        share_calls,
    });
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(time: u64, job: &str, calls: u32, reserved_until: Option<u64>) -> SpendEntry {
        SpendEntry {
            time,
            job_id: job.into(),
            conversation: "c".into(),
            calls,
            tokens: 0,
            cost_micros: 0,
            reserved_until,
        }
    }

    #[test]
    fn the_window_slides_and_a_late_sweep_replaces_its_expired_reservation() {
        let mut w = SpendWindow::default();
        w.record(entry(1_000, "j1", 4, Some(5_000)));
        w.record(entry(2_000, "j2", 2, None));
        assert_eq!(w.totals(2_000, 10_000).calls, 6);
        // The worker vanished: its reservation turns into spend...
        w.prune(6_000, 10_000);
        assert_eq!(w.recent[0].reserved_until, None);
        assert_eq!(w.totals(6_000, 10_000).calls, 6);
        // ...until its sweep ends after all, with what it really spent.
        w.record(entry(7_000, "j1", 1, None));
        assert_eq!(w.recent.len(), 2);
        assert_eq!(w.recent[0].time, 1_000, "counted when it was granted");
        assert_eq!(w.totals(7_000, 10_000).calls, 3);
        assert_eq!(w.calls_of("c", 7_000, 10_000), 3);
        // Entries leave the window a window after they were granted.
        w.prune(11_000, 10_000);
        assert_eq!(w.totals(11_000, 10_000).calls, 2);
        w.prune(12_000, 10_000);
        assert!(w.recent.is_empty());
    }
}
