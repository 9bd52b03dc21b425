//! `status`: the numbers an operator watches. Globally: conversations,
//! turns, tokens, summaries, pending jobs, debts, rejections. Per
//! conversation: turns and tokens (raw, in context, the frontier not yet
//! summarized, the fresh tail), compression ratio, summaries by depth, the
//! debt and its age and what it waits for (the scheduler's own answer,
//! `core::policy::schedule`), the pending job, the spend window and a
//! health verdict with its reasons. "Now" is the partition's clock (the
//! newest record time folded): the API reads no clock.

use crate::api::{conversation, summary_at, turn, ApiError};
use crate::core::event::DebtReason;
use crate::core::policy::{self, schedule, Blocked, PolicyConfig, Schedule, Wait};
use crate::core::spend::{self, Spend};
use crate::core::state::{ContextItem, Conversation, State};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatusRequest {
    /// One conversation; omitted: the whole state this process holds.
    #[serde(default)]
    pub conversation: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "scope", rename_all = "snake_case")]
pub enum StatusResponse {
    Global(Box<GlobalStatus>),
    Conversation(Box<ConversationStatus>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GlobalStatus {
    pub conversations: usize,
    pub turns: u64,
    pub raw_tokens: u64,
    pub context_tokens: u64,
    pub summaries: u64,
    /// Summaries at each depth, shallowest first.
    pub summaries_by_depth: Vec<DepthTotal>,
    pub fallback_summaries_in_context: u64,
    pub pending_jobs: u64,
    pub debts: u64,
    pub urgent_debts: u64,
    /// Rejected events, attributed or not.
    pub rejections: u64,
    /// Bytes that named no readable conversation.
    pub unattributed_rejections: u64,
    pub stale_summaries: u64,
    pub duplicates_dropped: u64,
    /// Newest event time over all conversations (ms).
    pub newest_event_time: u64,
    pub degraded_conversations: u64,
    /// Up to [`MAX_LISTED_DEGRADED`] degraded conversation keys.
    pub degraded: Vec<String>,
    /// Conversations whose debt waits for a backoff after a round that
    /// made no progress (`no_progress_backoff_ms`, doubling per round).
    #[serde(default)]
    pub spend_backoff_conversations: u64,
    /// Conversations whose debt waits for a spend window to reopen (the
    /// calls, tokens or money of `summary_max_*_per_window`, the urgent
    /// cap, or the partition's window).
    #[serde(default)]
    pub spend_exhausted_conversations: u64,
    /// When the last of those windows opens again (the partitions' clock,
    /// ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spend_paused_until: Option<u64>,
    /// Conversations whose debt cannot go on whatever the time
    /// (`DebtStatus::blocked` says why).
    #[serde(default)]
    pub blocked_conversations: u64,
    /// Conversations whose debt is stuck (`DebtStatus::stuck`).
    #[serde(default)]
    pub stuck_conversations: u64,
    /// Up to [`MAX_LISTED_DEGRADED`] stuck conversation keys.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stuck: Vec<String>,
    /// The partitions these totals cover (over NATS: every process's,
    /// gathered by the one that answered; empty locally).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionHealth>,
    /// How many partitions the service has (over NATS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions_total: Option<u32>,
    /// Partitions whose owner did not answer in time: these totals leave
    /// them out (`partial`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_partitions: Vec<u32>,
    pub health: Health,
}

/// How many degraded conversations the global status names.
pub const MAX_LISTED_DEGRADED: usize = 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConversationStatus {
    pub conversation: String,
    pub model: Option<String>,
    pub context_window: Option<u64>,
    pub encoding: String,
    pub epoch: u32,
    /// Newest event time (ms), as the agent stated it.
    pub last_event_time: u64,
    /// The partition's clock (ms): the "now" ages and waits are measured
    /// against (the time the log stored the newest record).
    #[serde(default)]
    pub now: u64,
    pub turns: TurnCounts,
    pub tokens: TokenCounts,
    pub compression: Compression,
    pub summaries: SummaryCounts,
    pub debt: Option<DebtStatus>,
    pub pending_job: Option<JobStatus>,
    pub spend_window: SpendStatus,
    pub rolling_state: RollingStatus,
    pub rejections: u64,
    /// Agent events refused over the conversation's intake quota.
    #[serde(default)]
    pub over_quota: u64,
    pub health: Health,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnCounts {
    pub total: u64,
    /// Raw in context now.
    pub in_context: u64,
    /// Under a summary that is in context.
    pub summarized: u64,
    /// Kept out of context when folded (duplicates, late tool results).
    pub excluded: u64,
    /// From before the last reset.
    pub earlier_epochs: u64,
    pub large_payloads: u64,
    pub duplicates_dropped: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenCounts {
    /// Every turn ever folded, verbatim.
    pub raw: u64,
    /// What the context costs now (summaries + raw turns).
    pub context: u64,
    pub budget: u64,
    pub threshold: u64,
    pub target: u64,
    /// Raw turns in context, not yet summarized (fresh tail included).
    pub frontier: u64,
    /// The fresh tail, never compacted.
    pub fresh_tail: u64,
    /// The frontier outside the fresh tail: what the next leaf pass takes.
    pub compactable: u64,
    /// Summaries in context.
    pub summarized_prefix: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Compression {
    /// `summarized_turn_tokens / summary_tokens`; 1.0 with no summary.
    pub ratio: f64,
    /// Context tokens of the raw turns under the summaries in context.
    pub summarized_turn_tokens: u64,
    /// Tokens of the summaries in context.
    pub summary_tokens: u64,
}

/// Summaries at one depth. (A list, not a map keyed by depth: JSON keys
/// are strings, and clients should not have to parse them.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DepthCount {
    pub depth: u32,
    pub total: u64,
    pub in_context: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DepthTotal {
    pub depth: u32,
    pub total: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SummaryCounts {
    pub total: u64,
    pub in_context: u64,
    /// Shallowest first.
    pub by_depth: Vec<DepthCount>,
    pub fallback: u64,
    pub fallback_in_context: u64,
    /// Summaries the fold rejected as stale or invalid.
    pub rejected: u64,
}

/// What an unpaid debt is waiting on: the scheduler's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DebtWait {
    /// A job is working on it.
    Job,
    /// Nothing holds it: the fold issues its job when it next looks at
    /// the conversation (the next record, or the partition's next tick).
    Due,
    /// The provider asked to wait (Retry-After): no job before `until`.
    RetryAfter,
    /// A round made no progress: no job before `until`.
    Backoff,
    /// The conversation's window (calls, tokens or money) is used up
    /// until `until`.
    SpendWindow,
    /// Its urgent calls are used up until `until`.
    UrgentSpendWindow,
    /// The partition's window, or this conversation's fair share of it,
    /// is used up until `until`.
    PartitionWindow,
    /// Its tenant's part of the partition's window is used up until
    /// `until`.
    TenantWindow,
    /// It cannot go on whatever the time: `blocked` says why.
    Blocked,
}

impl From<Wait> for DebtWait {
    fn from(w: Wait) -> Self {
        match w {
            Wait::RetryAfter => DebtWait::RetryAfter,
            Wait::Backoff => DebtWait::Backoff,
            Wait::SpendWindow => DebtWait::SpendWindow,
            Wait::UrgentSpendWindow => DebtWait::UrgentSpendWindow,
            Wait::PartitionWindow => DebtWait::PartitionWindow,
            Wait::TenantWindow => DebtWait::TenantWindow,
        }
    }
}

/// A debt is stuck when it has waited this long with no job out and no
/// wait ending in the future: its conversation has not been looked at
/// since its time came (a partition without records or ticks), which a
/// healthy service never leaves.
pub const STUCK_AFTER_MS: u64 = 120_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DebtStatus {
    pub reason: DebtReason,
    pub urgent: bool,
    pub context_tokens: u64,
    pub threshold_tokens: u64,
    pub target_tokens: u64,
    pub since: u64,
    /// `now - since`.
    pub age_ms: u64,
    pub waiting_on: DebtWait,
    /// When the wait ends (the job's expiry for `job`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<u64>,
    /// Why it cannot go on, and what to do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked: Option<String>,
    /// No job is out and no wait ends in the future, for longer than
    /// [`STUCK_AFTER_MS`]: the service should have acted and did not.
    #[serde(default)]
    pub stuck: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobStatus {
    pub job_id: String,
    pub reason: DebtReason,
    pub urgent: bool,
    pub compact: bool,
    pub refresh_rolling_state: bool,
    pub issued_at: u64,
    pub age_ms: u64,
    pub deadline_ms: u64,
    /// Older than its deadline by event time.
    pub overdue: bool,
    /// Summaries of this job committed so far.
    pub committed: u32,
    pub target_tokens: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpendStatus {
    pub window_start: u64,
    pub window_ms: u64,
    /// The window has ended: the next sweep starts a new one.
    pub expired: bool,
    /// Spent in the current window (0 once it expired).
    pub calls: u32,
    pub tokens: u64,
    pub cost_micros: u64,
    pub max_calls: u32,
    pub calls_left: u32,
    pub max_tokens: Option<u64>,
    pub tokens_left: Option<u64>,
    pub max_cost_micros: Option<u64>,
    /// What is left of every limit that applies (the conversation's and,
    /// with partition-wide limits, the partition's and its fair share).
    pub cost_left: Option<u64>,
    pub backoff_until: u64,
    pub in_backoff: bool,
    /// The provider asked to wait (Retry-After): no job of any kind before.
    pub retry_at: u64,
    pub waiting_retry_after: bool,
    /// The partition's window, when a `*_global` limit is set.
    pub partition: Option<PartitionSpend>,
    /// A routine (non-urgent) job may be issued now.
    pub routine_allowed: bool,
}

/// The partition-wide spend window (all conversations this state holds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionSpend {
    pub calls: u32,
    pub tokens: u64,
    pub cost_micros: u64,
    pub max_calls: Option<u32>,
    pub max_tokens: Option<u64>,
    pub max_cost_micros: Option<u64>,
    /// Conversations spending or waiting in the window (this one included).
    pub active_conversations: usize,
    /// Each active conversation's fair share of `max_calls`.
    pub share_calls: Option<u32>,
    /// The conversation's tenant's part of the window, when a `*_tenant`
    /// limit is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<TenantSpend>,
}

/// One tenant's spend in the partition's window (`core::spend::tenant_of`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantSpend {
    /// The tenant: the conversation key up to its first `/` (`""`: none).
    pub tenant: String,
    pub calls: u32,
    pub tokens: u64,
    pub cost_micros: u64,
    pub max_calls: Option<u32>,
    pub max_tokens: Option<u64>,
    pub max_cost_micros: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollingStatus {
    pub present: bool,
    pub through_turn: Option<u64>,
    pub due: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthStatus {
    Ok,
    Degraded,
}

/// Why a conversation (or the whole state) is degraded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthCode {
    /// Deterministic fallback summaries in context await a model.
    FallbackSummaries,
    /// The fresh tail alone exceeds the budget: assembly sends it over budget.
    OverBudget,
    /// Context above the budget: assembly leaves the oldest items out.
    ContextOverBudget,
    /// Events of this conversation were rejected (see `history`).
    Rejections,
    /// Its agent publishes over the intake quota: events are refused.
    OverQuota,
    /// An urgent debt older than `compact_until_under_deadline_ms`.
    StalledDebt,
    /// A job older than its deadline with no `sweep_ended`.
    OverdueJob,
    /// A debt with no job out and no wait ending in the future, for longer
    /// than [`STUCK_AFTER_MS`].
    StuckDebt,
    /// A debt that cannot go on whatever the time (a spend limit of 0).
    BlockedDebt,
    /// Context over the threshold with nothing a compaction could take:
    /// the fresh tail and summaries that cannot condense further.
    Incompressible,
    /// Degraded conversations (global status only).
    DegradedConversations,
    /// A partition cannot fold or publish and is retrying (global only).
    PartitionRetrying,
    /// A partition dead-lettered records (global only): see `cf.dead.partition.<p>`.
    DeadLetters,
    /// Partitions whose owner did not answer: the totals leave them out
    /// (global only).
    PartitionsMissing,
}

/// How one partition this process folds is doing (global status over
/// NATS). Wall-clock fields are the runtime's, never folded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionHealth {
    pub partition: u32,
    /// Stream sequence of the last record folded and committed.
    pub position: u64,
    /// Still folding history that was in the stream when this process
    /// took the partition.
    pub catching_up: bool,
    /// Folding or publishing failed and is being retried.
    pub retrying: bool,
    /// Since when (ms since the Unix epoch) it has been failing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failing_since_ms: Option<u64>,
    /// The last failure, retried or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Records dead-lettered by this process since it took the partition.
    pub dead_letters: u64,
    /// The partition-wide spend window, when a `*_global` limit is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spend_window: Option<PartitionWindow>,
}

/// A partition's spend window (`summary_max_*_per_window_global`) at the
/// newest event time of its conversations (the fold's time).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionWindow {
    pub calls: u32,
    pub tokens: u64,
    pub cost_micros: u64,
    pub max_calls: Option<u32>,
    pub max_tokens: Option<u64>,
    pub max_cost_micros: Option<u64>,
    /// A limit is used up: no conversation of the partition gets a routine
    /// job until older spend leaves the window.
    pub closed: bool,
    /// When the oldest spend that counts leaves the window (event time,
    /// ms); `None` with nothing spent or only running jobs' reservations.
    pub reopens_at: Option<u64>,
    /// Conversations refused a job for want of the partition's allowance.
    pub waiting_conversations: usize,
}

/// The partition-wide spend window of `state` (one partition's), or `None`
/// when no `*_global` limit is set.
pub fn partition_window(state: &State, policy: &PolicyConfig) -> Option<PartitionWindow> {
    if !policy.spend_limits().has_partition_limits() {
        return None;
    }
    let now = state.clock.now;
    let window_ms = policy.summary_call_window_ms;
    let mut w = state.spend.clone();
    w.prune(now, window_ms);
    let t = w.totals(now, window_ms);
    let used_up = |max: Option<u64>, used: u64| max.is_some_and(|m| used >= m);
    Some(PartitionWindow {
        calls: t.calls,
        tokens: t.tokens,
        cost_micros: t.cost_micros,
        max_calls: policy.summary_max_calls_per_window_global,
        max_tokens: policy.summary_max_tokens_per_window_global,
        max_cost_micros: policy.summary_max_cost_micros_per_window_global,
        closed: used_up(
            policy.summary_max_calls_per_window_global.map(u64::from),
            u64::from(t.calls),
        ) || used_up(policy.summary_max_tokens_per_window_global, t.tokens)
            || used_up(
                policy.summary_max_cost_micros_per_window_global,
                t.cost_micros,
            ),
        reopens_at: w.reopens_at(now, window_ms),
        waiting_conversations: w.waiting.len(),
    })
}

impl PartitionHealth {
    pub fn new(partition: u32) -> Self {
        PartitionHealth {
            partition,
            position: 0,
            catching_up: false,
            retrying: false,
            failing_since_ms: None,
            last_error: None,
            dead_letters: 0,
            spend_window: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthReason {
    pub code: HealthCode,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    pub status: HealthStatus,
    pub reasons: Vec<HealthReason>,
}

impl Health {
    fn from_reasons(reasons: Vec<HealthReason>) -> Health {
        Health {
            status: if reasons.is_empty() {
                HealthStatus::Ok
            } else {
                HealthStatus::Degraded
            },
            reasons,
        }
    }
}

pub fn status(
    state: &State,
    policy: &PolicyConfig,
    req: &StatusRequest,
) -> Result<StatusResponse, ApiError> {
    match &req.conversation {
        Some(key) => {
            let conv = conversation(state, key)?;
            Ok(StatusResponse::Conversation(Box::new(conversation_status(
                state, conv, policy,
            )?)))
        }
        None => Ok(StatusResponse::Global(Box::new(global_status(
            state, policy,
        )?))),
    }
}

/// The global status of a state folded in memory.
pub fn global_status(state: &State, policy: &PolicyConfig) -> Result<GlobalStatus, ApiError> {
    global_status_with(state, policy, |each| {
        for conv in state.conversations.values() {
            each(state, conv)?;
        }
        Ok(())
    })
}

/// The global status over `state`'s partition counts and the conversations
/// `conversations` hands its callback one at a time (with the state of
/// their partition).
pub fn global_status_with(
    state: &State,
    policy: &PolicyConfig,
    conversations: impl FnOnce(
        &mut dyn FnMut(&State, &Conversation) -> Result<(), ApiError>,
    ) -> Result<(), ApiError>,
) -> Result<GlobalStatus, ApiError> {
    let mut g = GlobalStatus {
        conversations: 0,
        turns: 0,
        raw_tokens: 0,
        context_tokens: 0,
        summaries: 0,
        summaries_by_depth: Vec::new(),
        fallback_summaries_in_context: 0,
        pending_jobs: 0,
        debts: 0,
        urgent_debts: 0,
        rejections: state.unattributed_rejections,
        unattributed_rejections: state.unattributed_rejections,
        stale_summaries: 0,
        duplicates_dropped: 0,
        newest_event_time: 0,
        degraded_conversations: 0,
        degraded: Vec::new(),
        spend_backoff_conversations: 0,
        spend_exhausted_conversations: 0,
        spend_paused_until: None,
        blocked_conversations: 0,
        stuck_conversations: 0,
        stuck: Vec::new(),
        partitions: Vec::new(),
        partitions_total: None,
        missing_partitions: Vec::new(),
        health: Health::from_reasons(Vec::new()),
    };
    let mut by_depth: BTreeMap<u32, u64> = BTreeMap::new();
    conversations(&mut |state, conv| {
        let s = conversation_status(state, conv, policy)?;
        if let Some(d) = &s.debt {
            match d.waiting_on {
                DebtWait::Backoff => {
                    g.spend_backoff_conversations += 1;
                    if let Some(until) = d.until {
                        g.spend_paused_until = Some(g.spend_paused_until.unwrap_or(0).max(until));
                    }
                }
                DebtWait::SpendWindow
                | DebtWait::UrgentSpendWindow
                | DebtWait::PartitionWindow
                | DebtWait::TenantWindow => {
                    g.spend_exhausted_conversations += 1;
                    if let Some(until) = d.until {
                        g.spend_paused_until = Some(g.spend_paused_until.unwrap_or(0).max(until));
                    }
                }
                DebtWait::Blocked => g.blocked_conversations += 1,
                DebtWait::Job | DebtWait::Due | DebtWait::RetryAfter => {}
            }
            if d.stuck {
                g.stuck_conversations += 1;
                if g.stuck.len() < MAX_LISTED_DEGRADED {
                    g.stuck.push(s.conversation.clone());
                }
            }
        }
        g.conversations += 1;
        g.turns += s.turns.total;
        g.raw_tokens += s.tokens.raw;
        g.context_tokens += s.tokens.context;
        g.summaries += s.summaries.total;
        for d in &s.summaries.by_depth {
            *by_depth.entry(d.depth).or_insert(0) += d.total;
        }
        g.fallback_summaries_in_context += s.summaries.fallback_in_context;
        g.pending_jobs += u64::from(s.pending_job.is_some());
        g.debts += u64::from(s.debt.is_some());
        g.urgent_debts += u64::from(s.debt.as_ref().is_some_and(|d| d.urgent));
        g.rejections += s.rejections;
        g.stale_summaries += s.summaries.rejected;
        g.duplicates_dropped += s.turns.duplicates_dropped;
        g.newest_event_time = g.newest_event_time.max(s.last_event_time);
        if s.health.status == HealthStatus::Degraded {
            g.degraded_conversations += 1;
            if g.degraded.len() < MAX_LISTED_DEGRADED {
                g.degraded.push(s.conversation);
            }
        }
        Ok(())
    })?;
    g.summaries_by_depth = by_depth
        .into_iter()
        .map(|(depth, total)| DepthTotal { depth, total })
        .collect();
    let mut reasons = Vec::new();
    if g.stuck_conversations > 0 {
        reasons.push(HealthReason {
            code: HealthCode::StuckDebt,
            message: format!(
                "{} conversations owe compaction with no job out and nothing to wait for (e.g. {}): \
                 their partitions have not folded a record or a tick since; check that every \
                 partition has a running folder (`doctor`)",
                g.stuck_conversations,
                g.stuck.first().map_or("", String::as_str)
            ),
        });
    }
    if g.degraded_conversations > 0 {
        reasons.push(HealthReason {
            code: HealthCode::DegradedConversations,
            message: format!(
                "{} of {} conversations are degraded (ask `status` for one to see why)",
                g.degraded_conversations, g.conversations
            ),
        });
    }
    if state.unattributed_rejections > 0 {
        reasons.push(HealthReason {
            code: HealthCode::Rejections,
            message: format!(
                "{} records were refused without a conversation to count them against \
                 (dead-lettered on NATS: `<prefix>.dead.partition.<p>`)",
                state.unattributed_rejections
            ),
        });
    }
    g.health = Health::from_reasons(reasons);
    Ok(g)
}

impl GlobalStatus {
    /// These totals and `other`'s, of other partitions, as one: what
    /// `cf.admin.status` answers when several processes hold the service's
    /// partitions.
    pub fn merge(mut self, other: GlobalStatus) -> GlobalStatus {
        self.conversations += other.conversations;
        self.turns += other.turns;
        self.raw_tokens += other.raw_tokens;
        self.context_tokens += other.context_tokens;
        self.summaries += other.summaries;
        let mut depths: BTreeMap<u32, u64> = BTreeMap::new();
        for d in self
            .summaries_by_depth
            .iter()
            .chain(&other.summaries_by_depth)
        {
            *depths.entry(d.depth).or_insert(0) += d.total;
        }
        self.summaries_by_depth = depths
            .into_iter()
            .map(|(depth, total)| DepthTotal { depth, total })
            .collect();
        self.fallback_summaries_in_context += other.fallback_summaries_in_context;
        self.pending_jobs += other.pending_jobs;
        self.debts += other.debts;
        self.urgent_debts += other.urgent_debts;
        self.rejections += other.rejections;
        self.unattributed_rejections += other.unattributed_rejections;
        self.stale_summaries += other.stale_summaries;
        self.duplicates_dropped += other.duplicates_dropped;
        self.newest_event_time = self.newest_event_time.max(other.newest_event_time);
        self.degraded_conversations += other.degraded_conversations;
        self.degraded.extend(other.degraded);
        self.degraded.truncate(MAX_LISTED_DEGRADED);
        self.spend_backoff_conversations += other.spend_backoff_conversations;
        self.spend_exhausted_conversations += other.spend_exhausted_conversations;
        self.spend_paused_until = self.spend_paused_until.max(other.spend_paused_until);
        self.blocked_conversations += other.blocked_conversations;
        self.stuck_conversations += other.stuck_conversations;
        self.stuck.extend(other.stuck);
        self.stuck.truncate(MAX_LISTED_DEGRADED);
        self.partitions.extend(other.partitions);
        self.partitions.sort_by_key(|p| p.partition);
        self.partitions_total = self.partitions_total.or(other.partitions_total);
        self.missing_partitions.extend(other.missing_partitions);
        let mut reasons = std::mem::take(&mut self.health.reasons);
        for r in other.health.reasons {
            if !reasons.contains(&r) {
                reasons.push(r);
            }
        }
        self.health = Health::from_reasons(reasons);
        self
    }

    /// Marks partitions whose owner did not answer (their totals are left
    /// out), with the reason in the health.
    pub fn missing(mut self, partitions: Vec<u32>) -> GlobalStatus {
        if partitions.is_empty() {
            return self;
        }
        let mut reasons = std::mem::take(&mut self.health.reasons);
        reasons.push(HealthReason {
            code: HealthCode::PartitionsMissing,
            message: format!(
                "partitions {partitions:?} did not answer in time: these totals leave them out \
                 (is a process holding them? `doctor` checks the leases)"
            ),
        });
        self.health = Health::from_reasons(reasons);
        self.missing_partitions = partitions;
        self
    }
}

/// Adds partition health to a global status, and its reasons to the
/// status's health.
pub fn with_partitions(mut g: GlobalStatus, partitions: Vec<PartitionHealth>) -> GlobalStatus {
    let mut reasons = std::mem::take(&mut g.health.reasons);
    for p in &partitions {
        if p.retrying {
            reasons.push(HealthReason {
                code: HealthCode::PartitionRetrying,
                message: format!(
                    "partition {} is retrying: {}",
                    p.partition,
                    p.last_error.as_deref().unwrap_or("unknown error")
                ),
            });
        }
        if p.dead_letters > 0 {
            reasons.push(HealthReason {
                code: HealthCode::DeadLetters,
                message: format!(
                    "partition {} dead-lettered {} records since this process took it",
                    p.partition, p.dead_letters
                ),
            });
        }
    }
    g.partitions = partitions;
    g.health = Health::from_reasons(reasons);
    g
}

/// The status of `conv`, held in `state` (whose partition-wide spend
/// window applies when a `*_global` limit is set).
pub fn conversation_status(
    state: &State,
    conv: &Conversation,
    policy: &PolicyConfig,
) -> Result<ConversationStatus, ApiError> {
    let now = state.clock.now;
    let levels = policy::levels(conv, policy);

    // Turns and the raw part of the context.
    let mut turns = TurnCounts {
        total: conv.turns.len() as u64,
        in_context: 0,
        summarized: 0,
        excluded: 0,
        earlier_epochs: 0,
        large_payloads: 0,
        duplicates_dropped: conv.duplicates_dropped,
    };
    let mut eligible = 0u64;
    for t in &conv.turns {
        turns.large_payloads += u64::from(t.large_payload);
        if t.epoch != conv.epoch {
            turns.earlier_epochs += 1;
        } else if t.in_context {
            eligible += 1;
        } else {
            turns.excluded += 1;
        }
    }
    let tail = policy::fresh_tail_start(conv, policy);
    let (mut frontier, mut fresh_tail) = (0u64, 0u64);
    let mut summarized_turn_tokens = 0u64;
    let mut summary_tokens = 0u64;
    let mut by_depth: BTreeMap<u32, DepthCount> = BTreeMap::new();
    let mut fallback_in_context = 0u64;
    for s in &conv.summaries {
        by_depth
            .entry(s.depth)
            .or_insert(DepthCount {
                depth: s.depth,
                total: 0,
                in_context: 0,
            })
            .total += 1;
    }
    for (i, item) in conv.context.iter().enumerate() {
        match *item {
            ContextItem::Turn(seq) => {
                let t = turn(conv, seq)?;
                turns.in_context += 1;
                frontier += u64::from(t.context_tokens);
                if i >= tail {
                    fresh_tail += u64::from(t.context_tokens);
                }
            }
            ContextItem::Summary(k) => {
                let s = summary_at(conv, k)?;
                summary_tokens += s.tokens;
                fallback_in_context += u64::from(s.fallback);
                if let Some(d) = by_depth.get_mut(&s.depth) {
                    d.in_context += 1;
                }
                // Each raw turn counted once, however deep the DAG above it.
                for seq in s.first_turn..=s.last_turn {
                    let t = turn(conv, seq)?;
                    if t.in_context {
                        summarized_turn_tokens += u64::from(t.context_tokens);
                    }
                }
            }
        }
    }
    turns.summarized = eligible.saturating_sub(turns.in_context);
    let tokens = TokenCounts {
        raw: conv.raw_tokens(),
        context: conv.context.tokens(),
        budget: levels.budget,
        threshold: levels.threshold_tokens,
        target: levels.target_tokens,
        frontier,
        fresh_tail,
        compactable: frontier - fresh_tail,
        summarized_prefix: summary_tokens,
    };
    let compression = Compression {
        ratio: if summary_tokens == 0 {
            1.0
        } else {
            summarized_turn_tokens as f64 / summary_tokens as f64
        },
        summarized_turn_tokens,
        summary_tokens,
    };
    let summaries = SummaryCounts {
        total: conv.summaries.len() as u64,
        in_context: by_depth.values().map(|d| d.in_context).sum(),
        by_depth: by_depth.into_values().collect(),
        fallback: conv.summaries.iter().filter(|s| s.fallback).count() as u64,
        fallback_in_context,
        rejected: conv.stale_summaries,
    };
    let spend = spend_status(state, conv, policy);
    let pending_job = conv.pending_job.as_ref().map(|p| {
        let age_ms = now.saturating_sub(p.job.issued_at);
        JobStatus {
            job_id: p.job.job_id.clone(),
            reason: p.job.reason,
            urgent: p.job.urgent,
            compact: p.job.compact,
            refresh_rolling_state: p.job.refresh_rolling_state,
            issued_at: p.job.issued_at,
            age_ms,
            deadline_ms: p.job.deadline_ms,
            overdue: age_ms > p.job.deadline_ms,
            committed: p.committed,
            target_tokens: p.job.target_tokens,
        }
    });
    let next = next_step(state, conv, policy, now);
    let debt = conv.debt.as_ref().map(|d| {
        let age_ms = now.saturating_sub(d.since);
        let (waiting_on, until, blocked) = match &next {
            Schedule::Running { expires_at } => (DebtWait::Job, Some(*expires_at), None),
            Schedule::Expired => (DebtWait::Job, None, None),
            Schedule::Wait { on, until } => ((*on).into(), Some(*until), None),
            Schedule::Blocked(b) => (DebtWait::Blocked, None, Some(explain(*b))),
            Schedule::Issue(_) | Schedule::Idle => (DebtWait::Due, None, None),
        };
        // Nothing out and nothing to wait for: the fold should have acted.
        let overdue_since = match &next {
            Schedule::Issue(_) | Schedule::Idle | Schedule::Expired => Some(d.since),
            Schedule::Wait { until, .. } => Some(*until),
            Schedule::Running { expires_at } => Some(*expires_at),
            Schedule::Blocked(_) => None,
        };
        let stuck = age_ms > STUCK_AFTER_MS
            && overdue_since.is_some_and(|t| t <= now.saturating_sub(STUCK_AFTER_MS));
        DebtStatus {
            reason: d.reason,
            urgent: d.urgent,
            context_tokens: d.context_tokens,
            threshold_tokens: d.threshold_tokens,
            target_tokens: d.target_tokens,
            since: d.since,
            age_ms,
            waiting_on,
            until,
            blocked,
            stuck,
            instructions: d.instructions.clone(),
        }
    });

    let mut reasons = Vec::new();
    if fallback_in_context > 0 {
        reasons.push(HealthReason {
            code: HealthCode::FallbackSummaries,
            message: format!(
                "{fallback_in_context} deterministic fallback summaries in context await re-summarization by a model"
            ),
        });
    }
    if fresh_tail > levels.budget {
        reasons.push(HealthReason {
            code: HealthCode::OverBudget,
            message: format!(
                "the fresh tail alone is {fresh_tail} tokens, over the budget of {}: assembly sends it whole, over budget",
                levels.budget
            ),
        });
    } else if conv.context.tokens() > levels.budget {
        reasons.push(HealthReason {
            code: HealthCode::ContextOverBudget,
            message: format!(
                "context is {} tokens, over the budget of {}: assembly leaves the oldest items out",
                conv.context.tokens(),
                levels.budget
            ),
        });
    }
    if conv.debt.is_none()
        && conv.context.tokens() > levels.threshold_tokens
        && fresh_tail <= levels.budget
        && policy::next_compaction(
            conv,
            policy,
            policy::Standing {
                context_tokens: conv.context.tokens(),
                target_tokens: levels.target_tokens,
                budget: levels.budget,
                prefix_target_tokens: levels.prefix_target_tokens,
                urgent: false,
            },
        )
        .is_none()
    {
        reasons.push(HealthReason {
            code: HealthCode::Incompressible,
            message: format!(
                "context is {} tokens, over the threshold of {}, and nothing is left to compact: \
                 the fresh tail is {fresh_tail} tokens and the {} summaries in context cannot \
                 condense further (raise the budget, lower fresh_tail_count, or compact with \
                 instructions)",
                conv.context.tokens(),
                levels.threshold_tokens,
                summary_tokens
            ),
        });
    }
    if conv.quota.refusing {
        reasons.push(HealthReason {
            code: HealthCode::OverQuota,
            message: format!(
                "its agent publishes faster than the intake quota allows: {} events refused so \
                 far (its own, policy.intake_events_per_second and intake_bytes_per_second, or \
                 its partition's, policy.intake_partition_*; the event_rejected in its history \
                 says which)",
                conv.quota.refused
            ),
        });
    }
    if conv.rejections > 0 {
        reasons.push(HealthReason {
            code: HealthCode::Rejections,
            message: format!(
                "{} events of this conversation were rejected (see `history`)",
                conv.rejections
            ),
        });
    }
    if let Some(d) = &debt {
        if d.stuck {
            reasons.push(HealthReason {
                code: HealthCode::StuckDebt,
                message: format!(
                    "{:?} debt of {} ms has no job out and nothing to wait for: its partition has \
                     not folded a record or a tick since its time came (is the partition's folder \
                     running? `doctor` checks); a `compact` request makes it go on now",
                    d.reason, d.age_ms
                ),
            });
        }
        if let Some(why) = &d.blocked {
            reasons.push(HealthReason {
                code: HealthCode::BlockedDebt,
                message: format!("{:?} debt cannot go on: {why}", d.reason),
            });
        }
        if d.urgent && d.age_ms > policy.compact_until_under_deadline_ms {
            reasons.push(HealthReason {
                code: HealthCode::StalledDebt,
                message: format!(
                    "urgent {:?} debt unpaid for {} ms (recovery deadline {} ms)",
                    d.reason, d.age_ms, policy.compact_until_under_deadline_ms
                ),
            });
        }
    }
    if let Some(j) = &pending_job {
        if j.overdue {
            reasons.push(HealthReason {
                code: HealthCode::OverdueJob,
                message: format!(
                    "job {} issued {} ms ago, past its {} ms deadline, has not ended",
                    j.job_id, j.age_ms, j.deadline_ms
                ),
            });
        }
    }

    Ok(ConversationStatus {
        conversation: conv.key.clone(),
        model: conv.model.clone(),
        context_window: conv.context_window,
        encoding: conv.encoding.name().to_string(),
        epoch: conv.epoch,
        last_event_time: conv.last_time,
        now,
        turns,
        tokens,
        compression,
        summaries,
        debt,
        pending_job,
        spend_window: spend,
        rolling_state: RollingStatus {
            present: conv.rolling.is_some(),
            through_turn: conv.rolling_through,
            due: conv.rolling_due,
        },
        rejections: conv.rejections,
        over_quota: conv.quota.refused,
        health: Health::from_reasons(reasons),
    })
}

/// What the scheduler says of `conv` at `now`, over its windows pruned as
/// the fold prunes them.
fn next_step(state: &State, conv: &Conversation, policy: &PolicyConfig, now: u64) -> Schedule {
    let limits = policy.spend_limits();
    let mut partition = state.spend.clone();
    partition.prune(now, limits.window_ms);
    let mut own = conv.spend.clone();
    own.prune(now, limits.window_ms);
    schedule(conv, &own, &partition, policy, now)
}

fn explain(b: Blocked) -> String {
    b.explain().to_string()
}

/// The spend window as the fold sees it at the partition's clock (the same
/// limits the scheduler checks before it issues a job).
fn spend_status(state: &State, conv: &Conversation, policy: &PolicyConfig) -> SpendStatus {
    let now = state.clock.now;
    let limits = policy.spend_limits();
    let window_ms = limits.window_ms;
    // The fold's own computation over windows pruned as the fold prunes them.
    let mut own = conv.spend.clone();
    own.prune(now, window_ms);
    let mut partition = state.spend.clone();
    partition.prune(now, window_ms);
    let a = spend::allowance(&own, &partition, &conv.key, &limits, now);
    // A sliding window: it starts at the oldest sweep that still counts.
    let window_start = own.recent.first().map_or(now, |e| e.time);
    let waiting_retry_after = now < own.retry_at;
    SpendStatus {
        window_start,
        window_ms,
        expired: a.own == Spend::default(),
        calls: a.own.calls,
        tokens: a.own.tokens,
        cost_micros: a.own.cost_micros,
        max_calls: policy.summary_max_calls_per_window,
        calls_left: a.calls_left,
        max_tokens: policy.summary_max_tokens_per_window,
        tokens_left: a.tokens_left,
        max_cost_micros: policy.summary_max_cost_micros_per_window,
        cost_left: a.cost_left,
        backoff_until: own.backoff_until,
        in_backoff: a.in_backoff,
        retry_at: own.retry_at,
        waiting_retry_after,
        routine_allowed: a.routine_ok() && !waiting_retry_after,
        partition: a.partition.map(|p| PartitionSpend {
            calls: p.totals.calls,
            tokens: p.totals.tokens,
            cost_micros: p.totals.cost_micros,
            max_calls: policy.summary_max_calls_per_window_global,
            max_tokens: policy.summary_max_tokens_per_window_global,
            max_cost_micros: policy.summary_max_cost_micros_per_window_global,
            active_conversations: p.active_conversations,
            share_calls: p.share_calls,
            tenant: p.tenant.map(|t| TenantSpend {
                tenant: spend::tenant_of(&conv.key).to_string(),
                calls: t.calls,
                tokens: t.tokens,
                cost_micros: t.cost_micros,
                max_calls: policy.summary_max_calls_per_window_tenant,
                max_tokens: policy.summary_max_tokens_per_window_tenant,
                max_cost_micros: policy.summary_max_cost_micros_per_window_tenant,
            }),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::{self, CONV};
    use crate::core::event::Debt;
    use crate::core::state::PendingJob;

    fn conv_status(state: &State, policy: &PolicyConfig) -> ConversationStatus {
        match status(
            state,
            policy,
            &StatusRequest {
                conversation: Some(CONV.into()),
            },
        )
        .unwrap()
        {
            StatusResponse::Conversation(s) => *s,
            other => panic!("expected a conversation status, got {other:?}"),
        }
    }

    #[test]
    fn per_conversation_numbers_add_up() {
        let (state, policy) = testing::folded();
        let conv = testing::conv(state);
        let s = conv_status(state, policy);
        assert_eq!(s.turns.total, conv.turns.len() as u64);
        assert_eq!(
            s.turns.in_context + s.turns.summarized + s.turns.excluded + s.turns.earlier_epochs,
            s.turns.total
        );
        assert!(s.turns.summarized > 0 && s.turns.in_context > 0);
        // Context = summaries + frontier.
        assert_eq!(
            s.tokens.context,
            s.tokens.summarized_prefix + s.tokens.frontier
        );
        assert!(s.tokens.fresh_tail > 0 && s.tokens.fresh_tail <= s.tokens.frontier);
        assert_eq!(
            s.tokens.compactable,
            s.tokens.frontier - s.tokens.fresh_tail
        );
        assert_eq!(s.tokens.raw, conv.raw_tokens());
        // Every summarized turn's tokens are under some summary in context.
        assert!(s.compression.ratio > 1.0, "{:?}", s.compression);
        assert_eq!(
            s.compression.ratio,
            s.compression.summarized_turn_tokens as f64 / s.compression.summary_tokens as f64
        );
        assert_eq!(s.summaries.total, conv.summaries.len() as u64);
        assert_eq!(
            s.summaries.by_depth.iter().map(|d| d.total).sum::<u64>(),
            s.summaries.total
        );
        assert!(s.summaries.by_depth.iter().any(|d| d.depth >= 1));
        assert!(s
            .summaries
            .by_depth
            .windows(2)
            .all(|w| w[0].depth < w[1].depth));
        assert_eq!(s.model.as_deref(), Some("gpt-4o"));
        assert_eq!(s.last_event_time, conv.last_time);
    }

    #[test]
    fn only_fallback_summaries_make_the_conversation_degraded() {
        let (state, policy) = testing::folded();
        let s = conv_status(state, policy);
        // Without a model the deterministic summarizer is the summarizer:
        // its summaries are final, nothing awaits a model.
        assert!(s.summaries.in_context > 0);
        assert_eq!(s.summaries.fallback_in_context, 0);
        let fallback = |s: &ConversationStatus| {
            s.health
                .reasons
                .iter()
                .any(|r| r.code == HealthCode::FallbackSummaries)
        };
        assert!(!fallback(&s));
        // One a failing model left in its place awaits re-summarization.
        let mut state = state.clone();
        let conv = state.conversations.get_mut(CONV).unwrap();
        let in_context = conv
            .context
            .iter()
            .find_map(|i| match i {
                ContextItem::Summary(k) => Some(*k as usize),
                ContextItem::Turn(_) => None,
            })
            .unwrap();
        conv.summaries[in_context].fallback = true;
        let s = conv_status(&state, policy);
        assert_eq!(s.summaries.fallback_in_context, 1);
        assert_eq!(s.health.status, HealthStatus::Degraded);
        assert!(fallback(&s));
    }

    #[test]
    fn debt_age_and_pending_job_use_the_partition_clock() {
        let (state, policy) = testing::folded();
        let mut state = state.clone();
        let state_now = state.clock.now;
        let conv = state.conversations.get_mut(CONV).unwrap();
        conv.debt = Some(Debt {
            reason: DebtReason::Overflow,
            context_tokens: 5000,
            threshold_tokens: 4500,
            target_tokens: 3000,
            urgent: true,
            since: state_now - policy.compact_until_under_deadline_ms - 1,
            instructions: None,
        });
        conv.pending_job = Some(PendingJob {
            job: crate::core::event::JobIssued {
                job_id: "job_x".into(),
                reason: DebtReason::Overflow,
                urgent: true,
                context_tokens: 5000,
                target_tokens: 3000,
                deadline_ms: 1000,
                issued_at: state_now - 5000,
                instructions: None,
                compact: true,
                refresh_rolling_state: false,
                max_calls: None,
                max_tokens: None,
            },
            committed: 2,
            rolling_refreshed: false,
            left_at: None,
        });
        let s = conv_status(&state, policy);
        let d = s.debt.unwrap();
        assert_eq!(d.age_ms, policy.compact_until_under_deadline_ms + 1);
        assert_eq!(d.waiting_on, DebtWait::Job);
        assert_eq!(d.until, Some(state_now - 5000 + 2 * 1000 + 60_000));
        assert!(!d.stuck, "a job is out");
        let j = s.pending_job.unwrap();
        assert_eq!((j.age_ms, j.overdue, j.committed), (5000, true, 2));
        let codes: Vec<HealthCode> = s.health.reasons.iter().map(|r| r.code).collect();
        assert!(codes.contains(&HealthCode::StalledDebt), "{codes:?}");
        assert!(codes.contains(&HealthCode::OverdueJob), "{codes:?}");
    }

    #[test]
    fn a_backoff_holds_a_debt_until_a_known_time() {
        let (state, policy) = testing::folded();
        let mut state = state.clone();
        let now = state.clock.now;
        let conv = state.conversations.get_mut(CONV).unwrap();
        conv.pending_job = None;
        conv.spend.backoff_until = now + 10;
        conv.debt = Some(Debt {
            reason: DebtReason::Threshold,
            context_tokens: 5000,
            threshold_tokens: 4500,
            target_tokens: 3000,
            urgent: false,
            since: conv.last_time,
            instructions: None,
        });
        let s = conv_status(&state, policy);
        assert!(s.spend_window.in_backoff && !s.spend_window.routine_allowed);
        let d = s.debt.unwrap();
        assert_eq!((d.waiting_on, d.until), (DebtWait::Backoff, Some(now + 10)));
        // An urgent debt waits for it too, until the agent asks again.
        let conv = state.conversations.get_mut(CONV).unwrap();
        if let Some(d) = &mut conv.debt {
            d.urgent = true;
        }
        let s = conv_status(&state, policy);
        assert_eq!(s.debt.unwrap().waiting_on, DebtWait::Backoff);
        // Past its end with nothing folded since: due, and stuck once the
        // partition has been quiet for long.
        state.clock.advance(now + 11);
        let s = conv_status(&state, policy);
        let d = s.debt.unwrap();
        assert_eq!(d.waiting_on, DebtWait::Due);
        assert!(!d.stuck);
        state.clock.advance(now + 11 + STUCK_AFTER_MS + 1);
        let s = conv_status(&state, policy);
        assert!(s.debt.unwrap().stuck);
        assert!(s
            .health
            .reasons
            .iter()
            .any(|r| r.code == HealthCode::StuckDebt));
    }

    #[test]
    fn partition_limits_and_retry_after_hold_jobs() {
        let (state, policy) = testing::folded();
        let mut state = state.clone();
        let now = testing::conv(&state).last_time;
        let global = PolicyConfig {
            summary_max_calls_per_window_global: Some(4),
            ..policy.clone()
        };
        state.spend.recent.push(crate::core::state::SpendEntry {
            time: now - 10,
            job_id: "job_other".into(),
            conversation: "other".into(),
            calls: 4,
            tokens: 100,
            cost_micros: 0,
            reserved_until: None,
            urgent: false,
        });
        let s = conversation_status(&state, testing::conv(&state), &global).unwrap();
        let p = s.spend_window.partition.clone().expect("global limits set");
        assert_eq!(
            (p.calls, p.max_calls, p.active_conversations),
            (4, Some(4), 2)
        );
        assert_eq!(p.share_calls, Some(2));
        assert_eq!(s.spend_window.calls_left, 0);
        assert!(!s.spend_window.routine_allowed);
        let alone = conversation_status(&state, testing::conv(&state), policy).unwrap();
        assert!(alone.spend_window.partition.is_none());

        let conv = state.conversations.get_mut(CONV).unwrap();
        conv.pending_job = None;
        conv.spend.retry_at = now + 5;
        conv.debt = Some(Debt {
            reason: DebtReason::Overflow,
            context_tokens: 5000,
            threshold_tokens: 4500,
            target_tokens: 3000,
            urgent: true,
            since: now,
            instructions: None,
        });
        let s = conversation_status(&state, testing::conv(&state), policy).unwrap();
        assert!(s.spend_window.waiting_retry_after);
        assert_eq!(s.debt.unwrap().waiting_on, DebtWait::RetryAfter);
    }

    #[test]
    fn over_budget_and_rejections_are_reported() {
        let (state, policy) = testing::folded();
        let tight = PolicyConfig {
            max_assembly_token_budget: Some(100),
            ..policy.clone()
        };
        let mut state = state.clone();
        state.conversations.get_mut(CONV).unwrap().rejections = 3;
        let s = conv_status(&state, &tight);
        let codes: Vec<HealthCode> = s.health.reasons.iter().map(|r| r.code).collect();
        // The fresh tail is capped by the budget, so the assembled context
        // may fit while the folded context is still over it.
        assert!(
            codes.contains(&HealthCode::OverBudget)
                || codes.contains(&HealthCode::ContextOverBudget),
            "{codes:?}"
        );
        assert!(codes.contains(&HealthCode::Rejections), "{codes:?}");
        assert_eq!(s.tokens.budget, 100);
    }

    #[test]
    fn global_sums_conversations() {
        let (state, policy) = testing::folded();
        let mut state = state.clone();
        let mut other = testing::conv(&state).clone();
        other.key = "other".into();
        state.conversations.insert("other".into(), other);
        state.unattributed_rejections = 2;
        let StatusResponse::Global(g) = status(&state, policy, &StatusRequest::default()).unwrap()
        else {
            panic!("expected global status");
        };
        let one = conversation_status(&state, testing::conv(&state), policy).unwrap();
        assert_eq!(g.conversations, 2);
        assert_eq!(g.turns, 2 * one.turns.total);
        assert_eq!(g.context_tokens, 2 * one.tokens.context);
        assert_eq!(g.summaries, 2 * one.summaries.total);
        assert_eq!(g.rejections, 2 * one.rejections + 2);
        let degraded = u64::from(one.health.status == HealthStatus::Degraded);
        assert_eq!(g.degraded_conversations, 2 * degraded);
        assert_eq!(g.degraded.len() as u64, 2 * degraded);
        assert_eq!(g.health.status, HealthStatus::Degraded);
        let json = serde_json::to_value(&g).unwrap();
        assert_eq!(json["summaries_by_depth"][0]["depth"], 0, "{json}");
        let back: GlobalStatus = serde_json::from_value(json).unwrap();
        assert_eq!(back, *g);
    }

    fn global(state: &State, policy: &PolicyConfig) -> GlobalStatus {
        global_status(state, policy).unwrap()
    }

    #[test]
    fn global_counts_debts_held_by_spend_at_the_partition_clock() {
        let (state, policy) = testing::folded();
        let mut state = state.clone();
        let now = state.clock.now;
        let conv = state.conversations.get_mut(CONV).unwrap();
        conv.spend = crate::core::state::SpendWindow::default();
        conv.pending_job = None;
        conv.debt = Some(Debt {
            reason: DebtReason::Threshold,
            context_tokens: 5000,
            threshold_tokens: 4500,
            target_tokens: 3000,
            urgent: false,
            since: now,
            instructions: None,
        });
        let open = global(&state, policy);
        assert_eq!(
            (
                open.spend_backoff_conversations,
                open.spend_exhausted_conversations,
                open.spend_paused_until
            ),
            (0, 0, None)
        );

        // A round without progress: backoff in force.
        let conv = state.conversations.get_mut(CONV).unwrap();
        conv.spend.backoff_until = now + 10;
        let g = global(&state, policy);
        assert_eq!(g.spend_backoff_conversations, 1);
        assert_eq!(g.spend_exhausted_conversations, 0);
        assert_eq!(g.spend_paused_until, Some(now + 10));
        // Once the partition's clock is past it, it is over.
        let mut later = state.clone();
        later.clock.advance(now + 10);
        let g = global(&later, policy);
        assert_eq!(
            (g.spend_backoff_conversations, g.spend_paused_until),
            (0, None)
        );

        // The window's calls used up: open again when the oldest leaves it.
        let conv = state.conversations.get_mut(CONV).unwrap();
        conv.spend.backoff_until = 0;
        conv.spend.recent.push(crate::core::state::SpendEntry {
            time: now - 10,
            job_id: "job_spent".into(),
            conversation: String::new(),
            calls: policy.summary_max_calls_per_window,
            tokens: 100,
            cost_micros: 0,
            reserved_until: None,
            urgent: false,
        });
        let g = global(&state, policy);
        assert_eq!(g.spend_backoff_conversations, 0);
        assert_eq!(g.spend_exhausted_conversations, 1);
        assert_eq!(
            g.spend_paused_until,
            Some(now - 10 + policy.summary_call_window_ms)
        );
        let json = serde_json::to_value(&g).unwrap();
        assert_eq!(json["spend_exhausted_conversations"], 1, "{json}");
        // A reply of an older serve, without these fields, still decodes.
        let mut old = json;
        for f in [
            "spend_backoff_conversations",
            "spend_exhausted_conversations",
            "spend_paused_until",
        ] {
            old.as_object_mut().unwrap().remove(f);
        }
        let back: GlobalStatus = serde_json::from_value(old).unwrap();
        assert_eq!(back.spend_exhausted_conversations, 0);
    }

    #[test]
    fn the_partition_window_closes_when_a_global_limit_is_used_up() {
        let (state, policy) = testing::folded();
        assert_eq!(partition_window(state, policy), None, "no global limit");
        let mut state = state.clone();
        let now = state.clock.now;
        let global_policy = PolicyConfig {
            summary_max_calls_per_window_global: Some(4),
            ..policy.clone()
        };
        let conv = state.conversations.get_mut(CONV).unwrap();
        conv.pending_job = None;
        conv.debt = Some(Debt {
            reason: DebtReason::Threshold,
            context_tokens: 5000,
            threshold_tokens: 4500,
            target_tokens: 3000,
            urgent: false,
            since: now,
            instructions: None,
        });
        let w = partition_window(&state, &global_policy).unwrap();
        assert!(!w.closed, "{w:?}");
        state.spend.recent.push(crate::core::state::SpendEntry {
            time: now - 10,
            job_id: "job_other".into(),
            conversation: "other".into(),
            calls: 4,
            tokens: 100,
            cost_micros: 0,
            reserved_until: None,
            urgent: false,
        });
        let w = partition_window(&state, &global_policy).unwrap();
        assert!(w.closed, "{w:?}");
        assert_eq!((w.calls, w.max_calls), (4, Some(4)));
        assert_eq!(
            w.reopens_at,
            Some(now - 10 + global_policy.summary_call_window_ms)
        );
        // The limit holds every debt of the partition.
        let g = global(&state, &global_policy);
        assert_eq!(g.spend_exhausted_conversations, 1, "{g:?}");
        let s = conversation_status(&state, testing::conv(&state), &global_policy).unwrap();
        let d = s.debt.unwrap();
        assert_eq!(
            (d.waiting_on, d.until),
            (
                DebtWait::PartitionWindow,
                Some(now - 10 + global_policy.summary_call_window_ms)
            )
        );
        let h = PartitionHealth {
            spend_window: Some(w),
            ..PartitionHealth::new(2)
        };
        let json = serde_json::to_value(&h).unwrap();
        assert_eq!(json["spend_window"]["closed"], true, "{json}");
        assert!(serde_json::to_value(PartitionHealth::new(1)).unwrap()["spend_window"].is_null());
    }

    #[test]
    fn empty_state_is_healthy() {
        let s = global_status(&State::default(), &PolicyConfig::default()).unwrap();
        assert_eq!(s.conversations, 0);
        assert_eq!(s.health.status, HealthStatus::Ok);
    }
}
