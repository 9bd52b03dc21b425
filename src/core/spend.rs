//! Spend windows: what summarizer calls, tokens and money a conversation
//! (and a partition) spent in the last `summary_call_window_ms` of the
//! partition's clock (`core::state::PartitionClock`), and what a new job
//! may still be granted. The scheduler (`core::policy::schedule`) decides
//! with [`allowance`]; `status` reports the very same numbers.
//!
//! Two kinds of work share a window. Routine jobs (thresholds, rolling
//! state, re-summarization) are held to `summary_max_calls_per_window`.
//! Urgent ones (an agent's compaction request, a provider's overflow) may
//! pre-empt them but are held to their own cap of urgent calls
//! (`summary_max_urgent_calls_per_window`), so no agent can buy unbounded
//! model calls by asking. Tokens and money are hard limits on both; the
//! partition's limits, with a fair share per conversation, hold for both.
//!
//! A tenant's limits sit between the two: a tenant is the part of a
//! conversation key up to its first `/` ([`tenant_of`]; the gateway keys
//! a tenant's conversations `name/…`), and its conversations' spend in the
//! partition's window is held to the tenant limits, so one tenant cannot
//! use up the calls that several share.
//!
//! The limits come in as [`SpendLimits`], so the spend window knows
//! nothing of the policy that sets them.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// The limits one spend window enforces (from `[policy]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpendLimits {
    pub window_ms: u64,
    /// Routine calls per window, the conversation's own.
    pub calls: u32,
    /// Urgent calls per window, the conversation's own.
    pub urgent_calls: u32,
    pub tokens: Option<u64>,
    pub cost_micros: Option<u64>,
    /// The partition's, across its conversations (`None`: unlimited).
    pub partition_calls: Option<u32>,
    pub partition_tokens: Option<u64>,
    pub partition_cost_micros: Option<u64>,
    /// Each tenant's, across its conversations in the partition.
    pub tenant_calls: Option<u32>,
    pub tenant_tokens: Option<u64>,
    pub tenant_cost_micros: Option<u64>,
}

impl SpendLimits {
    /// A limit across conversations (the partition's or each tenant's) is
    /// set: the partition's window is kept.
    pub fn has_partition_limits(&self) -> bool {
        self.partition_calls.is_some()
            || self.partition_tokens.is_some()
            || self.partition_cost_micros.is_some()
            || self.has_tenant_limits()
    }

    /// A per-tenant limit is set.
    pub fn has_tenant_limits(&self) -> bool {
        self.tenant_calls.is_some()
            || self.tenant_tokens.is_some()
            || self.tenant_cost_micros.is_some()
    }

    /// The conversation's own limits alone (no partition or tenant ones).
    pub fn own(&self) -> SpendLimits {
        SpendLimits {
            partition_calls: None,
            partition_tokens: None,
            partition_cost_micros: None,
            tenant_calls: None,
            tenant_tokens: None,
            tenant_cost_micros: None,
            ..*self
        }
    }

    /// The conversation's own limits and its tenant's (no partition ones).
    pub fn own_and_tenant(&self) -> SpendLimits {
        SpendLimits {
            partition_calls: None,
            partition_tokens: None,
            partition_cost_micros: None,
            ..*self
        }
    }
}

/// The tenant of a conversation: its key up to and including the first
/// `/`, or `""` (the partition's one tenant) when the key has none.
pub fn tenant_of(conversation: &str) -> &str {
    match conversation.find('/') {
        Some(at) => &conversation[..=at],
        None => "",
    }
}

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
    /// Spent by an urgent job (held to the urgent cap, not the routine one).
    #[serde(default)]
    pub urgent: bool,
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
    /// No job before this time (a round made no progress): routine ones
    /// wait for it, urgent ones too unless the agent asks again.
    pub backoff_until: u64,
    /// Rounds in a row that made no progress (each doubles the backoff).
    #[serde(default)]
    pub rounds_without_progress: u32,
    /// What the scheduler last held this conversation's debt for (so a
    /// window that closes is counted once, when it closes).
    #[serde(default)]
    pub holding: Option<Wait>,
    /// No job at all before this time: the provider asked (Retry-After).
    #[serde(default)]
    pub retry_at: u64,
    /// Conversations refused a job for want of the partition's allowance
    /// (or their tenant's part of it), and since when (partition window
    /// only): they count toward the fair share of the calls, and a job's
    /// end looks at them again.
    #[serde(default)]
    pub waiting: Vec<(String, u64)>,
}

/// What a debt waits for (`core::policy::schedule`): each is a window
/// or a delay of the conversation's spend, with an end in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Wait {
    /// The provider asked to wait (Retry-After).
    RetryAfter,
    /// A round made no progress: backing off before the next.
    Backoff,
    /// The conversation's spend window is used up (routine calls, tokens
    /// or money).
    SpendWindow,
    /// Its urgent calls are used up for this window.
    UrgentSpendWindow,
    /// The partition's window, or this conversation's fair share of it,
    /// is used up.
    PartitionWindow,
    /// Its tenant's share of the partition's window is used up.
    TenantWindow,
}

impl Wait {
    /// The wire name, also a bounded metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Wait::RetryAfter => "retry_after",
            Wait::Backoff => "backoff",
            Wait::SpendWindow => "spend_window",
            Wait::UrgentSpendWindow => "urgent_spend_window",
            Wait::PartitionWindow => "partition_window",
            Wait::TenantWindow => "tenant_window",
        }
    }

    /// A spend limit holds it (not a backoff or the provider's delay).
    pub fn is_spend(self) -> bool {
        matches!(
            self,
            Wait::SpendWindow
                | Wait::UrgentSpendWindow
                | Wait::PartitionWindow
                | Wait::TenantWindow
        )
    }
}

/// Summarizer spend: model calls, tokens and money. What one call cost
/// ([`Spend::of_call`]), what a sweep spent, and the totals of a
/// [`SpendWindow`] at one instant are all one `Spend`, added with `+`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spend {
    pub calls: u32,
    pub tokens: u64,
    pub cost_micros: u64,
}

impl Spend {
    fn of(e: &SpendEntry) -> Spend {
        Spend {
            calls: e.calls,
            tokens: e.tokens,
            cost_micros: e.cost_micros,
        }
    }
}

impl std::ops::Add for Spend {
    type Output = Spend;
    fn add(self, o: Spend) -> Spend {
        Spend {
            calls: self.calls.saturating_add(o.calls),
            tokens: self.tokens.saturating_add(o.tokens),
            cost_micros: self.cost_micros.saturating_add(o.cost_micros),
        }
    }
}

impl std::iter::Sum for Spend {
    fn sum<I: Iterator<Item = Spend>>(iter: I) -> Spend {
        iter.fold(Spend::default(), |a, b| a + b)
    }
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
        // A waiter is looked at again at least once a window (its wait ends
        // when the window reopens), which refreshes it: two windows without
        // that means it stopped waiting.
        self.waiting
            .retain(|(_, since)| since.saturating_add(2 * window_ms) > now);
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

    /// Marks `conversation` as waiting for an allowance at `now` (once;
    /// again only refreshes when).
    pub fn wait(&mut self, conversation: &str, now: u64) {
        match self.waiting.iter_mut().find(|(c, _)| c == conversation) {
            Some((_, since)) => *since = (*since).max(now),
            None => self.waiting.push((conversation.to_string(), now)),
        }
    }

    pub fn stop_waiting(&mut self, conversation: &str) {
        self.waiting.retain(|(c, _)| c != conversation);
    }

    /// What counts against the limits at `now` (reservations included).
    pub fn totals(&self, now: u64, window_ms: u64) -> Spend {
        self.recent
            .iter()
            .filter(|e| e.counts_at(now, window_ms))
            .map(Spend::of)
            .sum()
    }

    /// What the conversations of `tenant` ([`tenant_of`]) spend in the
    /// window at `now` (reservations included).
    pub fn tenant_totals(&self, tenant: &str, now: u64, window_ms: u64) -> Spend {
        self.recent
            .iter()
            .filter(|e| tenant_of(&e.conversation) == tenant && e.counts_at(now, window_ms))
            .map(Spend::of)
            .sum()
    }

    /// Calls of urgent jobs that count at `now`.
    pub fn urgent_calls(&self, now: u64, window_ms: u64) -> u32 {
        self.recent
            .iter()
            .filter(|e| e.urgent && e.counts_at(now, window_ms))
            .map(|e| e.calls)
            .fold(0u32, u32::saturating_add)
    }

    /// When the first spend that counts stops counting: a window's time
    /// passing, or a running job's reservation running out. `None` when
    /// nothing counts.
    pub fn reopens_at(&self, now: u64, window_ms: u64) -> Option<u64> {
        self.reopens_at_where(now, window_ms, |_| true)
    }

    /// [`SpendWindow::reopens_at`] of the spend of `tenant`'s conversations.
    pub fn tenant_reopens_at(&self, tenant: &str, now: u64, window_ms: u64) -> Option<u64> {
        self.reopens_at_where(now, window_ms, |e| tenant_of(&e.conversation) == tenant)
    }

    fn reopens_at_where(
        &self,
        now: u64,
        window_ms: u64,
        which: impl Fn(&SpendEntry) -> bool,
    ) -> Option<u64> {
        self.recent
            .iter()
            .filter(|e| which(e) && e.counts_at(now, window_ms))
            .map(|e| match e.reserved_until {
                Some(until) => until,
                None => e.time.saturating_add(window_ms),
            })
            .min()
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
    pub own: Spend,
    /// Routine calls its own window alone would still allow.
    pub own_calls_left: u32,
    /// Routine calls a job may be granted (own, partition and fair-share
    /// limits).
    pub calls_left: u32,
    /// Urgent calls a job may be granted (the urgent cap, partition and
    /// fair-share limits).
    pub urgent_calls_left: u32,
    pub tokens_left: Option<u64>,
    pub cost_left: Option<u64>,
    /// A round made no progress: no job yet.
    pub in_backoff: bool,
    /// Present when partition-wide limits are configured.
    pub partition: Option<PartitionAllowance>,
}

/// The partition-wide part of an [`Allowance`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionAllowance {
    pub totals: Spend,
    /// Conversations spending or waiting in the window (this one included).
    pub active_conversations: usize,
    /// Each active conversation's fair share of the partition's calls.
    pub share_calls: Option<u32>,
    /// What the conversation's tenant spends in the window, when a tenant
    /// limit is set.
    pub tenant: Option<Spend>,
}

impl Allowance {
    /// Tokens and money are left (hard limits on every kind of job).
    fn money_left(&self) -> bool {
        self.tokens_left != Some(0) && self.cost_left != Some(0)
    }

    /// A routine job may be issued.
    pub fn routine_ok(&self) -> bool {
        self.calls_left > 0 && self.money_left() && !self.in_backoff
    }

    /// An urgent job may be issued (backoff aside: the scheduler decides
    /// whether an urgent debt waits for it).
    pub fn urgent_ok(&self) -> bool {
        self.urgent_calls_left > 0 && self.money_left()
    }

    /// Holds the allowance to what a limit across conversations leaves:
    /// `calls` more calls of either kind, `tokens` and `cost` more (`None`:
    /// no such limit).
    fn hold_to(&mut self, calls: Option<u32>, tokens: Option<u64>, cost: Option<u64>) {
        if let Some(room) = calls {
            self.calls_left = self.calls_left.min(room);
            self.urgent_calls_left = self.urgent_calls_left.min(room);
        }
        self.tokens_left = min_limit(self.tokens_left, tokens);
        self.cost_left = min_limit(self.cost_left, cost);
    }
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
    limits: &SpendLimits,
    now: u64,
) -> Allowance {
    let window = limits.window_ms;
    let mine = own.totals(now, window);
    let left = |max: Option<u64>, used: u64| max.map(|m| m.saturating_sub(used));
    // Routine work is held to all of the conversation's calls (urgent ones
    // included: they took the room); urgent work to its own cap alone.
    let own_calls_left = limits.calls.saturating_sub(mine.calls);
    let urgent_left = limits
        .urgent_calls
        .saturating_sub(own.urgent_calls(now, window));
    let mut a = Allowance {
        own: mine,
        own_calls_left,
        calls_left: own_calls_left,
        urgent_calls_left: urgent_left,
        tokens_left: left(limits.tokens, mine.tokens),
        cost_left: left(limits.cost_micros, mine.cost_micros),
        in_backoff: now < own.backoff_until,
        partition: None,
    };
    if !limits.has_partition_limits() {
        return a;
    }
    let all = partition.totals(now, window);
    // A fair share of the partition's calls for each conversation that
    // spends or waits in the window, so the first to ask cannot hold the
    // whole window while others wait, urgently or not.
    let mut active = partition.active_conversations(now, window);
    active.insert(key);
    let share_calls = limits
        .partition_calls
        .map(|max| max.div_ceil(active.len().max(1) as u32));
    let calls_room = match (limits.partition_calls, share_calls) {
        (Some(max), Some(share)) => {
            let used = partition.calls_of(key, now, window);
            Some(
                max.saturating_sub(all.calls)
                    .min(share.saturating_sub(used)),
            )
        }
        _ => None,
    };
    a.hold_to(
        calls_room,
        left(limits.partition_tokens, all.tokens),
        left(limits.partition_cost_micros, all.cost_micros),
    );
    let tenant = limits.has_tenant_limits().then(|| {
        let theirs = partition.tenant_totals(tenant_of(key), now, window);
        a.hold_to(
            limits
                .tenant_calls
                .map(|max| max.saturating_sub(theirs.calls)),
            left(limits.tenant_tokens, theirs.tokens),
            left(limits.tenant_cost_micros, theirs.cost_micros),
        );
        theirs
    });
    a.partition = Some(PartitionAllowance {
        totals: all,
        active_conversations: active.len(),
        share_calls,
        tenant,
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
            urgent: false,
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

    #[test]
    fn a_tenant_is_held_to_its_limits_and_leaves_the_others_their_room() {
        assert_eq!(tenant_of("acme/agent-1"), "acme/");
        assert_eq!(tenant_of("acme/a/b"), "acme/");
        assert_eq!(tenant_of("agent-1"), "");
        let limits = SpendLimits {
            window_ms: 10_000,
            calls: 100,
            urgent_calls: 100,
            tokens: None,
            cost_micros: None,
            partition_calls: None,
            partition_tokens: None,
            partition_cost_micros: None,
            tenant_calls: Some(5),
            tenant_tokens: Some(1_000),
            tenant_cost_micros: None,
        };
        assert!(limits.has_partition_limits() && limits.has_tenant_limits());
        let mut partition = SpendWindow::default();
        for (i, conv) in ["acme/a", "acme/b"].iter().enumerate() {
            partition.record(SpendEntry {
                conversation: (*conv).into(),
                tokens: 300,
                ..entry(1_000 + i as u64, &format!("j{i}"), 2, None)
            });
        }
        let own = SpendWindow::default();
        // acme spent 4 calls and 600 tokens over two conversations: a third
        // gets what is left of the tenant's, not its own 100.
        let a = allowance(&own, &partition, "acme/c", &limits, 2_000);
        assert_eq!((a.calls_left, a.urgent_calls_left), (1, 1));
        assert_eq!(a.tokens_left, Some(400));
        let tenant = a.partition.as_ref().and_then(|p| p.tenant).unwrap();
        assert_eq!((tenant.calls, tenant.tokens), (4, 600));
        // Another tenant, and the keys without one, keep all of theirs.
        let b = allowance(&own, &partition, "globex/a", &limits, 2_000);
        assert_eq!((b.calls_left, b.tokens_left), (5, Some(1_000)));
        let c = allowance(&own, &partition, "agent-1", &limits, 2_000);
        assert_eq!(c.calls_left, 5);
        // The tenant's room comes back when its own spend leaves the window.
        assert_eq!(
            partition.tenant_reopens_at("acme/", 2_000, 10_000),
            Some(11_000)
        );
        assert_eq!(partition.tenant_reopens_at("globex/", 2_000, 10_000), None);
        partition.record(SpendEntry {
            conversation: "acme/c".into(),
            ..entry(2_000, "j9", 1, None)
        });
        let a = allowance(&own, &partition, "acme/c", &limits, 2_000);
        assert!(!a.routine_ok() && !a.urgent_ok());
    }
}
