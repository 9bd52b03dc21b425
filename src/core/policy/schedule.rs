//! The scheduler: what one conversation's compaction does next, at one
//! instant of its partition's clock. Pure: the fold acts on its answer
//! (issues the job, sets the conversation's timer, gives up an expired
//! job), and `status` reports the very same answer, so what an operator
//! reads is what the fold does.
//!
//! Every answer but [`Schedule::Idle`] keeps a debt moving: a job that is
//! out (and its expiry), a job to issue now, a wait with a known end (the
//! fold wakes the conversation then, without any agent traffic), or a
//! [`Blocked`] reason that time alone cannot lift, which status shows and
//! telemetry counts. That is DESIGN invariant 12, and
//! `tests/fold_properties.rs` checks it over random interleavings.
//!
//! # Which work waits for what
//!
//! - A Retry-After from the provider holds every job until it passes.
//! - A round that made no progress backs off (doubling per round in a row,
//!   [`PolicyConfig::no_progress_backoff`]); an agent that asks again (a
//!   compaction request, an overflow) ends the backoff, so a backoff never
//!   blocks a new request, and never lets a failing model spin.
//! - Routine work (thresholds, rolling state, re-summarization) is held to
//!   the routine calls of the spend window; urgent work (requests and
//!   overflows) to the urgent cap. Tokens and money hold for both, and so
//!   do the partition's limits with their fair share per conversation
//!   (`core::spend`).

use crate::core::event::{Debt, DebtReason};
use crate::core::policy::PolicyConfig;
pub use crate::core::spend::Wait;
use crate::core::spend::{self, SpendLimits, SpendWindow};
use crate::core::state::{Conversation, PendingJob};
use serde::{Deserialize, Serialize};

/// Time a job's worker is given beyond twice the job's deadline before
/// the fold gives the job up (its worker vanished).
pub const JOB_GRACE_MS: u64 = 60_000;

/// When the fold gives `pending` up if its `sweep_ended` has not come:
/// twice its deadline and [`JOB_GRACE_MS`] after it left (its decision's
/// copy reached the log), or after it was issued until that is known.
pub fn expires_at(pending: &PendingJob) -> u64 {
    pending
        .left_at
        .unwrap_or(pending.job.issued_at)
        .saturating_add(pending.job.deadline_ms.saturating_mul(2))
        .saturating_add(JOB_GRACE_MS)
}

/// What a conversation's compaction does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Schedule {
    /// Nothing is owed and no rolling state is due.
    Idle,
    /// A job is out; it is given up at `expires_at` if it never ends.
    Running { expires_at: u64 },
    /// The job that is out is past its expiry: give it up.
    Expired,
    /// Issue a job now, with this grant.
    Issue(Grant),
    /// Owed, and waiting for time to pass: for what, and until when.
    Wait { on: Wait, until: u64 },
    /// Owed, and time alone will not let it go on.
    Blocked(Blocked),
}

impl Schedule {
    /// When the fold should look at the conversation again without new
    /// input: the job's expiry or the end of the wait.
    pub fn wake_at(&self) -> Option<u64> {
        match self {
            Schedule::Running { expires_at } => Some(*expires_at),
            Schedule::Wait { until, .. } => Some(*until),
            Schedule::Idle | Schedule::Expired | Schedule::Issue(_) | Schedule::Blocked(_) => None,
        }
    }
}

/// A job the scheduler grants, and what it may spend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Compact old history (false: only the rolling state is due).
    pub compact: bool,
    pub urgent: bool,
    pub reason: DebtReason,
    pub target_tokens: u64,
    pub instructions: Option<String>,
    /// Calls the job may make (its kind's cap, the partition's share).
    pub max_calls: u32,
    pub max_tokens: Option<u64>,
}

/// Why a debt cannot go on, whatever the time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Blocked {
    /// A spend limit is set to 0 (no call, token or money is ever
    /// allowed): nothing spent can leave the window to make room.
    ZeroSpendLimit,
}

impl Blocked {
    pub fn as_str(self) -> &'static str {
        match self {
            Blocked::ZeroSpendLimit => "zero_spend_limit",
        }
    }

    /// What an operator reads, and what to do.
    pub fn explain(self) -> &'static str {
        match self {
            Blocked::ZeroSpendLimit => {
                "a spend limit of [policy] is 0, so no summarizer call is ever allowed: \
                 raise summary_max_*_per_window (or its _global or urgent form)"
            }
        }
    }
}

/// The work a conversation owes, if any: its debt, or a rolling state.
fn owed(conv: &Conversation, policy: &PolicyConfig) -> Option<Grant> {
    match &conv.debt {
        Some(Debt {
            reason,
            urgent,
            target_tokens,
            instructions,
            ..
        }) => Some(Grant {
            compact: true,
            urgent: *urgent,
            reason: *reason,
            target_tokens: *target_tokens,
            instructions: instructions.clone(),
            max_calls: 0,
            max_tokens: None,
        }),
        None if conv.rolling_due => Some(Grant {
            compact: false,
            urgent: false,
            reason: DebtReason::Threshold,
            target_tokens: super::levels(conv, policy).target_tokens,
            instructions: None,
            max_calls: 0,
            max_tokens: None,
        }),
        None => None,
    }
}

/// What `conv` does next at `now`, given its spend window (`own`: the
/// conversation's, passed apart so a reader can prune a copy) and its
/// partition's, both pruned to `now` ([`SpendWindow::prune`]).
pub fn schedule(
    conv: &Conversation,
    own: &SpendWindow,
    partition: &SpendWindow,
    policy: &PolicyConfig,
    now: u64,
) -> Schedule {
    if let Some(pending) = &conv.pending_job {
        let at = expires_at(pending);
        return if now >= at {
            Schedule::Expired
        } else {
            Schedule::Running { expires_at: at }
        };
    }
    let Some(mut grant) = owed(conv, policy) else {
        return Schedule::Idle;
    };
    if now < own.retry_at {
        return Schedule::Wait {
            on: Wait::RetryAfter,
            until: own.retry_at,
        };
    }
    let limits = policy.spend_limits();
    let a = spend::allowance(own, partition, &conv.key, &limits, now);
    if a.in_backoff {
        return Schedule::Wait {
            on: Wait::Backoff,
            until: own.backoff_until,
        };
    }
    let (ok, calls) = if grant.urgent {
        (a.urgent_ok(), a.urgent_calls_left)
    } else {
        (a.routine_ok(), a.calls_left)
    };
    if ok {
        grant.max_calls = calls;
        grant.max_tokens = a.tokens_left;
        return Schedule::Issue(grant);
    }
    spend_wait(&conv.key, own, partition, &limits, grant.urgent, now)
}

/// The wait of a debt the spend windows hold: which window binds (the
/// conversation's own when its own limits refuse the job, else its
/// tenant's when those do, else the partition's) and when it next has
/// room. A wake that comes early only looks again; one that never comes
/// (a limit of 0) is [`Blocked`].
fn spend_wait(
    key: &str,
    own_window: &SpendWindow,
    partition: &SpendWindow,
    limits: &SpendLimits,
    urgent: bool,
    now: u64,
) -> Schedule {
    let allows = |limits: &SpendLimits| {
        let a = spend::allowance(own_window, partition, key, limits, now);
        if urgent {
            a.urgent_ok()
        } else {
            a.routine_ok()
        }
    };
    let window = limits.window_ms;
    let (on, reopens) = if !allows(&limits.own()) {
        let on = if urgent {
            Wait::UrgentSpendWindow
        } else {
            Wait::SpendWindow
        };
        (on, own_window.reopens_at(now, window))
    } else if limits.has_tenant_limits() && !allows(&limits.own_and_tenant()) {
        let tenant = spend::tenant_of(key);
        (
            Wait::TenantWindow,
            partition.tenant_reopens_at(tenant, now, window),
        )
    } else {
        (Wait::PartitionWindow, partition.reopens_at(now, window))
    };
    match reopens {
        Some(until) => Schedule::Wait {
            on,
            until: until.max(now.saturating_add(1)),
        },
        None => Schedule::Blocked(Blocked::ZeroSpendLimit),
    }
}

#[cfg(test)]
mod tests;
