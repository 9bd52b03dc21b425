//! The audit of one conversation: every compaction decision in log order,
//! with its reason and what it did to the context, built from the log's
//! events alone.
//!
//! Pure: the caller folds the log (see `runtime::audit`) and hands over,
//! for each event of the conversation, the event and a [`Snapshot`] of the
//! conversation before and after it. Decisions the fold derived
//! (`debt_recorded`, `job_issued`, ...) are in the log as events of their
//! own; summaries, rejections and sweep ends are the summarizers' results.
//! Nothing here reads a conversation's history or summary text: the log's
//! events are the record.

use crate::core::event::{
    CompactionRequested, ConversationReset, Covers, Debt, DebtCleared, DebtReason, Envelope,
    EventBody, EventKind, EventRejected, JobIssued, MemoryFlushRequested, ModelDeclared,
    PolicyRecorded, ProviderErrorObserved, RecallAnswered, RecallOutcome, RollingStateUpdated,
    SummaryKind, SummaryRecorded, SummaryRejected, SweepEnded, SweepStop,
};
use crate::core::overflow;
use crate::core::policy::{self, PolicyConfig};
use crate::core::state::{ContextItem, Conversation};
use serde::Serialize;
use std::collections::HashMap;

/// The numbers of one conversation the audit needs, taken between events.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Snapshot {
    pub context_tokens: u64,
    pub context_bytes: u64,
    /// Turns folded so far.
    pub turns: u64,
    /// Summaries accepted so far.
    pub summaries: u64,
    pub budget: u64,
    pub threshold_tokens: u64,
    pub target_tokens: u64,
    pub rolling_tokens: u64,
    pub threshold_share_millis: u64,
    pub turns_since_rolling: u64,
    pub consecutive_tool_calls: u64,
    pub rolling_due: bool,
    pub pending_job: Option<String>,
    pub rejections: u64,
}

impl Snapshot {
    /// The snapshot of `conv` under `policy` (no conversation yet: all zero
    /// but the levels of an empty one).
    pub fn of(conv: Option<&Conversation>, key: &str, policy: &PolicyConfig) -> Snapshot {
        let empty;
        let conv = match conv {
            Some(c) => c,
            None => {
                empty = Conversation::new(key);
                &empty
            }
        };
        let levels = policy::levels(conv, policy);
        Snapshot {
            context_tokens: conv.context.tokens(),
            context_bytes: conv.context.bytes(),
            turns: conv.turns.len() as u64,
            summaries: conv.summaries.len() as u64,
            budget: levels.budget,
            threshold_tokens: levels.threshold_tokens,
            target_tokens: levels.target_tokens,
            rolling_tokens: levels.rolling_tokens,
            threshold_share_millis: levels.threshold_share_millis,
            turns_since_rolling: conv.turns_since_rolling,
            consecutive_tool_calls: conv.consecutive_tool_calls,
            rolling_due: conv.rolling_due,
            pending_job: conv.pending_job.as_ref().map(|p| p.job.job_id.clone()),
            rejections: conv.rejections,
        }
    }
}

/// One event of the conversation as the fold saw it.
#[derive(Debug, Clone)]
pub struct Step {
    /// Its place in the log.
    pub position: u64,
    pub event: Envelope,
    /// The fold admitted it (false: refused by intake, or a duplicate id).
    pub folded: bool,
    pub before: Snapshot,
    pub after: Snapshot,
}

/// The policy knobs the audit names in its reasons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct AuditPolicy {
    pub rolling_every_turns: u64,
    pub rolling_tool_loop: u64,
    pub max_active_transcript_bytes: Option<u64>,
}

impl From<&PolicyConfig> for AuditPolicy {
    fn from(p: &PolicyConfig) -> Self {
        AuditPolicy {
            rolling_every_turns: p.rolling_every_turns,
            rolling_tool_loop: p.rolling_tool_loop,
            max_active_transcript_bytes: p.max_active_transcript_bytes,
        }
    }
}

/// Context tokens after one event: a point of the timeline chart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Point {
    /// Index among the conversation's events (0-based).
    pub index: usize,
    pub position: u64,
    pub event_id: String,
    #[serde(rename = "type")]
    pub event_type: EventKind,
    pub time: u64,
    pub context_tokens: u64,
    pub budget: u64,
    pub threshold_tokens: u64,
    pub target_tokens: u64,
    /// `compaction` (a compaction job was issued: one mark a compaction),
    /// `overflow` (a provider reported a context overflow), `trigger` (a
    /// debt was recorded), or none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mark: Option<&'static str>,
}

/// One line of the audit timeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Entry {
    /// Index of its event among the conversation's events (see [`Point`]).
    pub index: usize,
    pub event_id: String,
    pub time: u64,
    pub context_before: u64,
    pub context_after: u64,
    #[serde(flatten)]
    pub what: What,
}

/// What happened, by kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum What {
    /// A compaction debt was recorded or changed (`updated`).
    Trigger {
        reason: &'static str,
        updated: bool,
        urgent: bool,
        context_tokens: u64,
        threshold_tokens: u64,
        target_tokens: u64,
        detail: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        provider_error: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        instructions: Option<String>,
    },
    /// The rolling session state fell due (every N turns, the tool-loop
    /// guard, or the rolling threshold crossed).
    RollingDue {
        reason: &'static str,
        detail: String,
    },
    /// A provider error: an overflow raises urgent compaction.
    ProviderError {
        overflow: bool,
        error: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        requested_tokens: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        limit_tokens: Option<u64>,
    },
    /// A process recorded the policy it folds under from here on.
    PolicyRecorded {
        fingerprint: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        previous: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        recorded_by: Option<String>,
    },
    /// Someone asked for a compaction.
    ManualRequest {
        #[serde(skip_serializing_if = "Option::is_none")]
        instructions: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        target_tokens: Option<u64>,
    },
    JobIssued {
        job_id: String,
        reason: &'static str,
        urgent: bool,
        compact: bool,
        refresh_rolling_state: bool,
        context_tokens: u64,
        target_tokens: u64,
        deadline_ms: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        max_calls: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        max_tokens: Option<u64>,
    },
    Summary {
        summary_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        job_id: Option<String>,
        summary_kind: SummaryKind,
        depth: u32,
        /// Raw turns `first..=last` under it.
        turns: [u64; 2],
        /// Child summaries (condensed ones).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        children: Vec<String>,
        source_tokens: u64,
        tokens: u64,
        model: String,
        provider: String,
        fallback: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        supersedes: Option<String>,
        /// The fold accepted it (false: stale or refused; see `rejected`).
        accepted: bool,
    },
    SummaryRejected {
        summary_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        job_id: Option<String>,
        reason: String,
    },
    SweepEnded {
        job_id: String,
        stop: SweepStop,
        passes: u32,
        committed: u32,
        calls: u32,
        tokens_spent: u64,
        cost_micros: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        elapsed_ms: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        deadline_ms: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
    /// A pending job left without a sweep end (given up after twice its
    /// deadline, or dropped by a reset).
    JobAbandoned {
        job_id: String,
    },
    DebtCleared {
        reason: String,
    },
    RollingStateUpdated {
        through_turn: u64,
    },
    /// A delegated recall's model calls (counted in the spend window).
    RecallAnswered {
        outcome: RecallOutcome,
        #[serde(skip_serializing_if = "Option::is_none")]
        model: Option<String>,
        calls: u32,
        tokens_spent: u64,
        cost_micros: u64,
        prompt_tokens: u64,
        sources: usize,
    },
    MemoryFlush {
        cycle: u64,
        reason: &'static str,
    },
    ModelDeclared {
        model: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        context_window: Option<u64>,
    },
    Reset {
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    EventRejected {
        rejected_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        event_type: Option<String>,
        reason: String,
    },
}

/// One compaction job from issue to sweep end.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Compaction {
    pub job_id: String,
    pub reason: &'static str,
    /// The trigger's words (see [`What::Trigger`]).
    pub trigger: String,
    pub urgent: bool,
    /// False: only the rolling session state was refreshed.
    pub compact: bool,
    pub refresh_rolling_state: bool,
    pub issued_event: String,
    pub issued_at: u64,
    pub deadline_ms: u64,
    pub context_before: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_after: Option<u64>,
    pub target_tokens: u64,
    /// Summaries accepted for this job, in order.
    pub summaries: Vec<String>,
    pub leaves: u32,
    pub condensed: u32,
    pub fallbacks: u32,
    /// Raw turns newly under a leaf summary of this job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turns_covered: Option<[u64; 2]>,
    /// Summaries condensed by this job.
    pub summaries_covered: u32,
    pub models: Vec<String>,
    pub rejected: Vec<Rejected>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rejected {
    pub summary_id: String,
    pub reason: String,
}

/// How a job's sweep ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Outcome {
    pub stop: SweepStop,
    pub passes: u32,
    pub calls: u32,
    pub tokens_spent: u64,
    pub cost_micros: u64,
    /// Event time from issue to sweep end.
    pub elapsed_ms: u64,
    /// Ended within its deadline (and not stopped by it).
    pub deadline_met: bool,
    /// Stopped by the spend window (calls, tokens or money).
    pub spend_limited: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// A deterministic fallback summary and the model summary that replaced it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fallback {
    pub summary_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    pub recorded_event: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replaced_by: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replaced_event: Option<String>,
}

/// Totals over the whole conversation.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Totals {
    pub events: u64,
    pub turns: u64,
    pub compactions: u64,
    pub rolling_only_jobs: u64,
    pub summaries: u64,
    pub fallbacks: u64,
    pub fallbacks_replaced: u64,
    pub rejections: u64,
    pub overflows: u64,
    pub calls: u64,
    pub tokens_spent: u64,
    pub cost_micros: u64,
    pub peak_context_tokens: u64,
    /// Points whose context was over the budget.
    pub over_budget_points: u64,
}

/// The audit of one conversation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Audit {
    pub conversation: String,
    pub totals: Totals,
    pub entries: Vec<Entry>,
    pub compactions: Vec<Compaction>,
    pub fallbacks: Vec<Fallback>,
    /// Context tokens after every event (the timeline chart).
    pub points: Vec<Point>,
}

fn reason_name(r: DebtReason) -> &'static str {
    match r {
        DebtReason::Threshold => "threshold",
        DebtReason::Overflow => "overflow",
        DebtReason::Manual => "manual",
        DebtReason::TranscriptBytes => "transcript_bytes",
        DebtReason::Resummarize => "resummarize",
    }
}

fn permille(n: u64) -> String {
    if n.is_multiple_of(10) {
        format!("{}%", n / 10)
    } else {
        format!("{}.{}%", n / 10, n % 10)
    }
}

/// Builds the audit of `conversation` from its steps in log order.
pub fn build(conversation: &str, steps: &[Step], policy: AuditPolicy) -> Audit {
    let mut b = Builder {
        policy,
        entries: Vec::new(),
        compactions: Vec::new(),
        jobs: HashMap::new(),
        fallbacks: Vec::new(),
        fallback_at: HashMap::new(),
        last_provider_error: None,
        last_trigger: None,
        summaries: HashMap::new(),
        totals: Totals::default(),
    };
    let mut points = Vec::with_capacity(steps.len());
    for (index, step) in steps.iter().enumerate() {
        let mark = b.step(index, step);
        let s = &step.after;
        b.totals.peak_context_tokens = b.totals.peak_context_tokens.max(s.context_tokens);
        if s.context_tokens > s.budget {
            b.totals.over_budget_points += 1;
        }
        points.push(Point {
            index,
            position: step.position,
            event_id: step.event.id.clone(),
            event_type: step.event.body.kind(),
            time: step.event.time,
            context_tokens: s.context_tokens,
            budget: s.budget,
            threshold_tokens: s.threshold_tokens,
            target_tokens: s.target_tokens,
            mark,
        });
    }
    let mut totals = b.totals;
    totals.events = steps.len() as u64;
    totals.turns = steps.last().map_or(0, |s| s.after.turns);
    totals.compactions = b.compactions.iter().filter(|c| c.compact).count() as u64;
    totals.rolling_only_jobs = b.compactions.iter().filter(|c| !c.compact).count() as u64;
    totals.fallbacks = b.fallbacks.len() as u64;
    totals.fallbacks_replaced = b
        .fallbacks
        .iter()
        .filter(|f| f.replaced_by.is_some())
        .count() as u64;
    Audit {
        conversation: conversation.to_string(),
        totals,
        entries: b.entries,
        compactions: b.compactions,
        fallbacks: b.fallbacks,
        points,
    }
}

struct Builder {
    policy: AuditPolicy,
    entries: Vec<Entry>,
    compactions: Vec<Compaction>,
    /// Job id -> index in `compactions`.
    jobs: HashMap<String, usize>,
    fallbacks: Vec<Fallback>,
    /// Fallback summary id -> index in `fallbacks`.
    fallback_at: HashMap<String, usize>,
    last_provider_error: Option<String>,
    /// The words of the trigger of the pending debt.
    last_trigger: Option<String>,
    /// Accepted summaries: id -> (first, last) raw turn.
    summaries: HashMap<String, [u64; 2]>,
    totals: Totals,
}

/// Where an event is: its index among the conversation's events, and the
/// step that carries it.
#[derive(Clone, Copy)]
struct At<'a> {
    index: usize,
    step: &'a Step,
}

impl Builder {
    fn push(&mut self, at: At<'_>, what: What) {
        let step = at.step;
        self.entries.push(Entry {
            index: at.index,
            event_id: step.event.id.clone(),
            time: step.event.time,
            context_before: step.before.context_tokens,
            context_after: step.after.context_tokens,
            what,
        });
    }

    /// An event that only adds its line to the timeline (no chart mark).
    fn entry(&mut self, at: At<'_>, what: What) -> Option<&'static str> {
        self.push(at, what);
        None
    }

    /// Records what `step` says; returns its chart mark. One arm per event
    /// kind, without a catch-all: a new kind does not compile until the
    /// audit says what it shows of it.
    fn step(&mut self, index: usize, step: &Step) -> Option<&'static str> {
        let at = At { index, step };
        self.abandoned_job(at);
        if !step.folded {
            return None;
        }
        match &step.event.body {
            EventBody::TurnAppended(_) => self.turn_appended(at),
            EventBody::ProviderErrorObserved(e) => self.provider_error(at, e),
            EventBody::CompactionRequested(r) => self.entry(at, r.into()),
            EventBody::ModelDeclared(m) => self.entry(at, m.into()),
            EventBody::ConversationReset(r) => self.entry(at, r.into()),
            EventBody::DebtRecorded(d) => self.debt(at, d, false),
            EventBody::DebtUpdated(d) => self.debt(at, d, true),
            EventBody::DebtCleared(c) => self.debt_cleared(at, c),
            EventBody::JobIssued(j) => self.job_issued(at, j),
            EventBody::SummaryRejected(r) => self.summary_rejected(at, r),
            EventBody::EventRejected(r) => self.entry(at, r.into()),
            EventBody::MemoryFlushRequested(m) => self.entry(at, m.into()),
            EventBody::SummaryRecorded(s) => self.summary_recorded(at, s),
            EventBody::SweepEnded(s) => self.sweep_ended(at, s),
            EventBody::RollingStateUpdated(r) => self.entry(at, r.into()),
            EventBody::PolicyRecorded(p) => self.entry(at, p.into()),
            EventBody::RecallAnswered(r) => self.recall_answered(at, r),
            // Time passing changes a conversation only through the
            // decisions it leads to, which are steps of their own.
            EventBody::ClockTicked(_) => None,
        }
    }

    /// A job that left without a sweep end: expired, or reset away.
    fn abandoned_job(&mut self, at: At<'_>) {
        let (before, after) = (&at.step.before, &at.step.after);
        if let Some(job) = &before.pending_job {
            let ended = matches!(&at.step.event.body, EventBody::SweepEnded(s) if &s.job_id == job);
            if after.pending_job.as_ref() != Some(job) && !ended {
                let job_id = job.clone();
                self.push(at, What::JobAbandoned { job_id });
            }
        }
    }

    fn turn_appended(&mut self, at: At<'_>) -> Option<&'static str> {
        let (before, after) = (&at.step.before, &at.step.after);
        if !before.rolling_due && after.rolling_due {
            let (reason, detail) = self.rolling_reason(after);
            self.push(at, What::RollingDue { reason, detail });
        }
        None
    }

    fn provider_error(&mut self, at: At<'_>, e: &ProviderErrorObserved) -> Option<&'static str> {
        let verdict = overflow::classify(&e.error);
        let mut mark = None;
        if verdict.overflow {
            self.totals.overflows += 1;
            mark = Some("overflow");
            self.last_provider_error = Some(e.error.clone());
        }
        self.push(
            at,
            What::ProviderError {
                overflow: verdict.overflow,
                error: e.error.clone(),
                requested_tokens: verdict.requested_tokens,
                limit_tokens: verdict.limit_tokens,
            },
        );
        mark
    }

    /// `debt_recorded` (a trigger: marked) or `debt_updated`.
    fn debt(&mut self, at: At<'_>, d: &Debt, updated: bool) -> Option<&'static str> {
        let provider_error = match d.reason {
            DebtReason::Overflow => self.last_provider_error.clone(),
            _ => None,
        };
        let detail = self.trigger_detail(d, &at.step.before, provider_error.as_deref());
        self.last_trigger = Some(detail.clone());
        self.push(
            at,
            What::Trigger {
                reason: reason_name(d.reason),
                updated,
                urgent: d.urgent,
                context_tokens: d.context_tokens,
                threshold_tokens: d.threshold_tokens,
                target_tokens: d.target_tokens,
                detail,
                provider_error,
                instructions: d.instructions.clone(),
            },
        );
        (!updated).then_some("trigger")
    }

    /// Why a debt was recorded, in the words of what the fold measured
    /// `before` it.
    fn trigger_detail(&self, d: &Debt, before: &Snapshot, provider_error: Option<&str>) -> String {
        match d.reason {
            DebtReason::Threshold => format!(
                "context {} tokens over the threshold {} ({} of the {}-token budget)",
                d.context_tokens,
                d.threshold_tokens,
                permille(before.threshold_share_millis),
                before.budget
            ),
            DebtReason::Overflow => format!(
                "provider reported a context overflow: {}",
                provider_error.unwrap_or("(error text not in the log)")
            ),
            DebtReason::Manual => match &d.instructions {
                Some(i) => format!("manual request, instructions: {i}"),
                None => "manual request".to_string(),
            },
            DebtReason::TranscriptBytes => format!(
                "active transcript {} bytes over max_active_transcript_bytes {}",
                before.context_bytes,
                self.policy
                    .max_active_transcript_bytes
                    .map_or("?".to_string(), |m| m.to_string())
            ),
            DebtReason::Resummarize => "fallback summaries in context wait for a model".to_string(),
        }
    }

    fn debt_cleared(&mut self, at: At<'_>, c: &DebtCleared) -> Option<&'static str> {
        self.last_trigger = None;
        self.entry(
            at,
            What::DebtCleared {
                reason: c.reason.clone(),
            },
        )
    }

    /// A job opens a [`Compaction`] (once per job id; a compacting one is
    /// marked).
    fn job_issued(&mut self, at: At<'_>, j: &JobIssued) -> Option<&'static str> {
        let reason = if j.compact {
            reason_name(j.reason)
        } else {
            "rolling_state"
        };
        let mut mark = None;
        if !self.jobs.contains_key(&j.job_id) {
            let trigger = if j.compact {
                self.last_trigger.clone().unwrap_or_default()
            } else {
                self.rolling_reason(&at.step.before).1
            };
            if j.compact {
                mark = Some("compaction");
            }
            self.jobs.insert(j.job_id.clone(), self.compactions.len());
            self.compactions
                .push(Compaction::issued(j, reason, trigger, &at.step.event.id));
        }
        self.push(
            at,
            What::JobIssued {
                job_id: j.job_id.clone(),
                reason,
                urgent: j.urgent,
                compact: j.compact,
                refresh_rolling_state: j.refresh_rolling_state,
                context_tokens: j.context_tokens,
                target_tokens: j.target_tokens,
                deadline_ms: j.deadline_ms,
                max_calls: j.max_calls,
                max_tokens: j.max_tokens,
            },
        );
        mark
    }

    /// The compaction of a job, when the audit saw it issued.
    fn job(&mut self, job_id: Option<&String>) -> Option<&mut Compaction> {
        job_id
            .and_then(|j| self.jobs.get(j))
            .map(|&i| &mut self.compactions[i])
    }

    fn summary_recorded(&mut self, at: At<'_>, s: &SummaryRecorded) -> Option<&'static str> {
        let accepted = at.step.after.summaries > at.step.before.summaries;
        let (turns, children) = self.covered(&s.covers);
        if accepted {
            self.totals.summaries += 1;
            self.summaries.insert(s.summary_id.clone(), turns);
            if let Some(c) = self.job(s.job_id.as_ref()) {
                c.credit(s, turns, children.len());
            }
            self.track_fallback(at, s);
        }
        self.entry(
            at,
            What::Summary {
                summary_id: s.summary_id.clone(),
                job_id: s.job_id.clone(),
                summary_kind: s.kind,
                depth: s.depth,
                turns,
                children,
                source_tokens: s.source_tokens,
                tokens: s.tokens,
                model: s.model.clone(),
                provider: s.provider.clone(),
                fallback: s.fallback,
                supersedes: s.supersedes.clone(),
                accepted,
            },
        )
    }

    /// The raw turns `[first, last]` a summary covers (through the
    /// summaries it condenses) and the summaries it condenses.
    fn covered(&self, covers: &Covers) -> ([u64; 2], Vec<String>) {
        match covers {
            Covers::Turns { first, last } => ([*first, *last], Vec::new()),
            Covers::Summaries { ids } => {
                let first = ids
                    .first()
                    .and_then(|id| self.summaries.get(id))
                    .map_or(0, |r| r[0]);
                let last = ids
                    .last()
                    .and_then(|id| self.summaries.get(id))
                    .map_or(0, |r| r[1]);
                ([first, last], ids.clone())
            }
        }
    }

    /// An accepted fallback summary is listed; the model summary that
    /// supersedes one is linked to it.
    fn track_fallback(&mut self, at: At<'_>, s: &SummaryRecorded) {
        if s.fallback {
            self.fallback_at
                .insert(s.summary_id.clone(), self.fallbacks.len());
            self.fallbacks.push(Fallback {
                summary_id: s.summary_id.clone(),
                job_id: s.job_id.clone(),
                recorded_event: at.step.event.id.clone(),
                replaced_by: None,
                replaced_event: None,
            });
        }
        if let Some(&i) = s.supersedes.as_ref().and_then(|o| self.fallback_at.get(o)) {
            self.fallbacks[i].replaced_by = Some(s.summary_id.clone());
            self.fallbacks[i].replaced_event = Some(at.step.event.id.clone());
        }
    }

    fn summary_rejected(&mut self, at: At<'_>, r: &SummaryRejected) -> Option<&'static str> {
        self.totals.rejections += 1;
        if let Some(c) = self.job(r.job_id.as_ref()) {
            c.rejected.push(Rejected {
                summary_id: r.summary_id.clone(),
                reason: r.reason.clone(),
            });
        }
        self.entry(
            at,
            What::SummaryRejected {
                summary_id: r.summary_id.clone(),
                job_id: r.job_id.clone(),
                reason: r.reason.clone(),
            },
        )
    }

    /// A sweep's spend counts; its job gets its outcome.
    fn sweep_ended(&mut self, at: At<'_>, s: &SweepEnded) -> Option<&'static str> {
        self.spent(u64::from(s.calls), s.tokens_spent, s.cost_micros);
        let (time, context_after) = (at.step.event.time, at.step.after.context_tokens);
        let (elapsed_ms, deadline_ms) = match self.job(Some(&s.job_id)) {
            Some(c) => {
                let elapsed = c.ended(s, time, context_after);
                (Some(elapsed), Some(c.deadline_ms))
            }
            None => (None, None),
        };
        self.entry(
            at,
            What::SweepEnded {
                job_id: s.job_id.clone(),
                stop: s.stop,
                passes: s.passes,
                committed: s.committed,
                calls: s.calls,
                tokens_spent: s.tokens_spent,
                cost_micros: s.cost_micros,
                elapsed_ms,
                deadline_ms,
                retry_after_ms: s.retry_after_ms,
                detail: s.detail.clone(),
            },
        )
    }

    fn recall_answered(&mut self, at: At<'_>, r: &RecallAnswered) -> Option<&'static str> {
        self.spent(u64::from(r.calls), r.tokens_spent, r.cost_micros);
        self.entry(
            at,
            What::RecallAnswered {
                outcome: r.outcome,
                model: r.model.clone(),
                calls: r.calls,
                tokens_spent: r.tokens_spent,
                cost_micros: r.cost_micros,
                prompt_tokens: r.prompt_tokens,
                sources: r.sources.len(),
            },
        )
    }

    /// Model calls counted in the totals.
    fn spent(&mut self, calls: u64, tokens: u64, cost_micros: u64) {
        self.totals.calls += calls;
        self.totals.tokens_spent += tokens;
        self.totals.cost_micros += cost_micros;
    }

    /// Why the rolling session state is due in `s`.
    fn rolling_reason(&self, s: &Snapshot) -> (&'static str, String) {
        let p = &self.policy;
        if s.turns_since_rolling >= p.rolling_every_turns {
            (
                "every_n_turns",
                format!(
                    "{} turns since the last rolling state (rolling_every_turns {})",
                    s.turns_since_rolling, p.rolling_every_turns
                ),
            )
        } else if s.consecutive_tool_calls >= p.rolling_tool_loop {
            (
                "tool_loop",
                format!(
                    "{} consecutive tool calls (tool-loop guard, rolling_tool_loop {})",
                    s.consecutive_tool_calls, p.rolling_tool_loop
                ),
            )
        } else {
            (
                "rolling_threshold",
                format!(
                    "context {} tokens crossed the rolling threshold {}",
                    s.context_tokens, s.rolling_tokens
                ),
            )
        }
    }
}

impl Compaction {
    /// A job as issued: nothing summarized yet, no outcome.
    fn issued(j: &JobIssued, reason: &'static str, trigger: String, event: &str) -> Compaction {
        Compaction {
            job_id: j.job_id.clone(),
            reason,
            trigger,
            urgent: j.urgent,
            compact: j.compact,
            refresh_rolling_state: j.refresh_rolling_state,
            issued_event: event.to_string(),
            issued_at: j.issued_at,
            deadline_ms: j.deadline_ms,
            context_before: j.context_tokens,
            context_after: None,
            target_tokens: j.target_tokens,
            summaries: Vec::new(),
            leaves: 0,
            condensed: 0,
            fallbacks: 0,
            turns_covered: None,
            summaries_covered: 0,
            models: Vec::new(),
            rejected: Vec::new(),
            outcome: None,
        }
    }

    /// An accepted summary of this job, covering raw `turns` (a leaf) or
    /// `children` summaries (a condensed one).
    fn credit(&mut self, s: &SummaryRecorded, turns: [u64; 2], children: usize) {
        self.summaries.push(s.summary_id.clone());
        match s.kind {
            SummaryKind::Leaf => {
                self.leaves += 1;
                self.turns_covered = Some(match self.turns_covered {
                    Some([a, b]) => [a.min(turns[0]), b.max(turns[1])],
                    None => turns,
                });
            }
            SummaryKind::Condensed => {
                self.condensed += 1;
                self.summaries_covered += children as u32;
            }
        }
        if s.fallback {
            self.fallbacks += 1;
        }
        let model = format!("{}/{}", s.provider, s.model);
        if !self.models.contains(&model) {
            self.models.push(model);
        }
    }

    /// The job's sweep ended at event time `time`, leaving
    /// `context_after` tokens; returns the time it took.
    fn ended(&mut self, s: &SweepEnded, time: u64, context_after: u64) -> u64 {
        let elapsed = time.saturating_sub(self.issued_at);
        self.context_after = Some(context_after);
        self.outcome = Some(Outcome {
            stop: s.stop,
            passes: s.passes,
            calls: s.calls,
            tokens_spent: s.tokens_spent,
            cost_micros: s.cost_micros,
            elapsed_ms: elapsed,
            deadline_met: s.stop != SweepStop::Deadline && elapsed <= self.deadline_ms,
            spend_limited: s.stop == SweepStop::SpendLimit,
            detail: s.detail.clone(),
        });
        elapsed
    }
}

// The timeline lines of events that only add a line (no totals, no jobs).

impl From<&CompactionRequested> for What {
    fn from(r: &CompactionRequested) -> What {
        What::ManualRequest {
            instructions: r.instructions.clone(),
            target_tokens: r.target_tokens,
        }
    }
}

impl From<&ModelDeclared> for What {
    fn from(m: &ModelDeclared) -> What {
        What::ModelDeclared {
            model: m.model.clone(),
            context_window: m.context_window,
        }
    }
}

impl From<&ConversationReset> for What {
    fn from(r: &ConversationReset) -> What {
        What::Reset {
            reason: r.reason.clone(),
        }
    }
}

impl From<&EventRejected> for What {
    fn from(r: &EventRejected) -> What {
        What::EventRejected {
            rejected_id: r.rejected_id.clone(),
            event_type: r.event_type.clone(),
            reason: r.reason.clone(),
        }
    }
}

impl From<&MemoryFlushRequested> for What {
    fn from(m: &MemoryFlushRequested) -> What {
        What::MemoryFlush {
            cycle: m.cycle,
            reason: reason_name(m.reason),
        }
    }
}

impl From<&RollingStateUpdated> for What {
    fn from(r: &RollingStateUpdated) -> What {
        What::RollingStateUpdated {
            through_turn: r.through_turn,
        }
    }
}

impl From<&PolicyRecorded> for What {
    fn from(p: &PolicyRecorded) -> What {
        What::PolicyRecorded {
            fingerprint: p.fingerprint.clone(),
            previous: p.previous.clone(),
            recorded_by: p.recorded_by.clone(),
        }
    }
}

/// One node of the summary DAG.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DagNode {
    pub id: String,
    pub kind: SummaryKind,
    pub depth: u32,
    pub first_turn: u64,
    pub last_turn: u64,
    /// Child summary ids (condensed nodes).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<String>,
    pub tokens: u64,
    pub source_tokens: u64,
    pub fallback: bool,
    /// In what the model sees now.
    pub in_context: bool,
    /// Replaced in context by another summary (a re-summarization).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub superseded_by: Option<String>,
    pub model: String,
}

/// The summary DAG of a conversation: every summary ever accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Dag {
    pub turns: u64,
    pub nodes: Vec<DagNode>,
    /// Runs of raw turns in context now, `[first, last]`.
    pub raw_in_context: Vec<[u64; 2]>,
}

/// The DAG of `conv`'s summaries (no summary text is read).
pub fn dag(conv: &Conversation) -> Dag {
    let mut in_context = vec![false; conv.summaries.len()];
    for item in &conv.context {
        if let ContextItem::Summary(i) = item {
            if let Some(slot) = in_context.get_mut(*i as usize) {
                *slot = true;
            }
        }
    }
    let mut raw_in_context: Vec<[u64; 2]> = Vec::new();
    for item in &conv.context {
        if let ContextItem::Turn(seq) = *item {
            match raw_in_context.last_mut() {
                Some(run) if run[1] + 1 == seq => run[1] = seq,
                _ => raw_in_context.push([seq, seq]),
            }
        }
    }
    let mut superseded: HashMap<&str, &str> = HashMap::new();
    for s in &conv.summaries {
        if let Some(old) = &s.supersedes {
            superseded.insert(old.as_str(), s.id.as_str());
        }
    }
    let nodes = conv
        .summaries
        .iter()
        .enumerate()
        .map(|(i, s)| DagNode {
            id: s.id.clone(),
            kind: s.kind,
            depth: s.depth,
            first_turn: s.first_turn,
            last_turn: s.last_turn,
            children: match &s.covers {
                Covers::Summaries { ids } => ids.clone(),
                Covers::Turns { .. } => Vec::new(),
            },
            tokens: s.tokens,
            source_tokens: s.source_tokens,
            fallback: s.fallback,
            in_context: in_context[i],
            superseded_by: superseded.get(s.id.as_str()).map(|n| n.to_string()),
            model: s.model.clone(),
        })
        .collect();
    Dag {
        turns: conv.turns.len() as u64,
        nodes,
        raw_in_context,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{
        Debt, JobIssued, SummaryRecorded, SummaryRejected, SweepEnded, TurnAppended,
    };
    use crate::core::message::{ChatMessage, Role};

    fn snap(context_tokens: u64, summaries: u64) -> Snapshot {
        Snapshot {
            context_tokens,
            summaries,
            budget: 1_000,
            threshold_tokens: 750,
            target_tokens: 500,
            rolling_tokens: 700,
            threshold_share_millis: 750,
            ..Snapshot::default()
        }
    }

    fn step(id: &str, body: EventBody, before: Snapshot, after: Snapshot) -> Step {
        Step {
            position: 0,
            event: Envelope::new(id, "c", 1_000, body),
            folded: true,
            before,
            after,
        }
    }

    fn job(id: &str, compact: bool) -> EventBody {
        EventBody::JobIssued(JobIssued {
            job_id: id.into(),
            reason: DebtReason::Threshold,
            urgent: false,
            context_tokens: 800,
            target_tokens: 500,
            deadline_ms: 100,
            issued_at: 1_000,
            instructions: None,
            compact,
            refresh_rolling_state: !compact,
            max_calls: Some(3),
            max_tokens: None,
        })
    }

    fn summary(id: &str, job: &str, fallback: bool, supersedes: Option<&str>) -> EventBody {
        EventBody::SummaryRecorded(SummaryRecorded {
            summary_id: id.into(),
            job_id: Some(job.into()),
            kind: SummaryKind::Leaf,
            depth: 0,
            covers: Covers::Turns { first: 2, last: 5 },
            content: "text the audit never reads".into(),
            source_tokens: 400,
            tokens: 40,
            model: "m".into(),
            provider: "p".into(),
            prompt_version: "v".into(),
            fallback,
            supersedes: supersedes.map(str::to_string),
        })
    }

    fn sweep(job: &str, stop: SweepStop) -> EventBody {
        EventBody::SweepEnded(SweepEnded {
            job_id: job.into(),
            passes: 1,
            committed: 1,
            stop,
            detail: None,
            calls: 2,
            tokens_spent: 900,
            cost_micros: 1_500,
            retry_after_ms: None,
        })
    }

    fn policy() -> AuditPolicy {
        AuditPolicy {
            rolling_every_turns: 15,
            rolling_tool_loop: 10,
            max_active_transcript_bytes: Some(5_000),
        }
    }

    #[test]
    fn a_compaction_is_followed_from_trigger_to_sweep_end_and_its_fallback_to_its_replacement() {
        let debt = Debt {
            reason: DebtReason::Threshold,
            context_tokens: 800,
            threshold_tokens: 750,
            target_tokens: 500,
            urgent: false,
            since: 1_000,
            instructions: None,
        };
        let mut late_sweep = step(
            "s1",
            sweep("j1", SweepStop::Done),
            snap(440, 1),
            snap(440, 1),
        );
        late_sweep.event.time = 1_000 + 250;
        let steps = vec![
            step(
                "d",
                EventBody::DebtRecorded(debt),
                snap(800, 0),
                snap(800, 0),
            ),
            step("j1", job("j1", true), snap(800, 0), snap(800, 0)),
            step(
                "x",
                summary("bad", "j1", false, None),
                snap(800, 0),
                snap(800, 0),
            ),
            step(
                "r",
                EventBody::SummaryRejected(SummaryRejected {
                    summary_id: "bad".into(),
                    job_id: Some("j1".into()),
                    reason: "not smaller than its source".into(),
                }),
                snap(800, 0),
                snap(800, 0),
            ),
            step(
                "f",
                summary("fb", "j1", true, None),
                snap(800, 0),
                snap(440, 1),
            ),
            late_sweep,
            step("j2", job("j2", false), snap(440, 1), snap(440, 1)),
            step(
                "m",
                summary("model", "j2", false, Some("fb")),
                snap(440, 1),
                snap(440, 2),
            ),
            step(
                "s2",
                sweep("j2", SweepStop::SpendLimit),
                snap(440, 2),
                snap(440, 2),
            ),
        ];
        let a = build("c", &steps, policy());
        assert_eq!(a.totals.compactions, 1);
        assert_eq!(a.totals.rolling_only_jobs, 1);
        assert_eq!(a.totals.summaries, 2);
        assert_eq!(a.totals.rejections, 1);
        assert_eq!((a.totals.calls, a.totals.cost_micros), (4, 3_000));
        let c = &a.compactions[0];
        assert_eq!(c.reason, "threshold");
        assert!(c
            .trigger
            .contains("over the threshold 750 (75% of the 1000-token budget)"));
        assert_eq!(c.summaries, ["fb"]);
        assert_eq!((c.context_before, c.context_after), (800, Some(440)));
        assert_eq!(c.turns_covered, Some([2, 5]));
        assert_eq!(c.rejected[0].reason, "not smaller than its source");
        let o = c.outcome.as_ref().unwrap();
        assert_eq!((o.elapsed_ms, o.deadline_met), (250, false));
        assert!(a.compactions[1].outcome.as_ref().unwrap().spend_limited);
        assert_eq!(a.fallbacks.len(), 1);
        assert_eq!(a.fallbacks[0].replaced_by.as_deref(), Some("model"));
        assert_eq!(a.totals.fallbacks_replaced, 1);
        // The not-accepted summary is listed, but not counted.
        let unaccepted = a
            .entries
            .iter()
            .filter(|e| {
                matches!(
                    e.what,
                    What::Summary {
                        accepted: false,
                        ..
                    }
                )
            })
            .count();
        assert_eq!(unaccepted, 1);
        let marks: Vec<_> = a.points.iter().filter_map(|p| p.mark).collect();
        assert_eq!(marks, ["trigger", "compaction"]);
        let text = crate::audit_text::render(&a);
        assert!(text.contains("deadline MISSED"), "{text}");
        assert!(text.contains("stopped by the spend window"), "{text}");
        assert!(
            text.contains("fallback fb (f) replaced by model at m"),
            "{text}"
        );
    }

    #[test]
    fn rolling_state_reasons_and_abandoned_jobs_are_named() {
        let turn =
            || EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(Role::User, "hi")));
        let mut tool_loop = snap(100, 0);
        tool_loop.consecutive_tool_calls = 10;
        tool_loop.rolling_due = true;
        let mut every = snap(100, 0);
        every.turns_since_rolling = 15;
        every.rolling_due = true;
        let mut crossed = snap(720, 0);
        crossed.rolling_due = true;
        let mut pending = snap(100, 0);
        pending.pending_job = Some("j9".into());
        let steps = vec![
            step("a", turn(), snap(90, 0), tool_loop),
            step("b", turn(), snap(90, 0), every),
            step("c", turn(), snap(690, 0), crossed),
            step("d", turn(), pending.clone(), snap(100, 0)),
            // A sweep end for the pending job is no abandonment.
            step("e", sweep("j9", SweepStop::Done), pending, snap(100, 0)),
        ];
        let a = build("c", &steps, policy());
        let reasons: Vec<&str> = a
            .entries
            .iter()
            .filter_map(|e| match &e.what {
                What::RollingDue { reason, .. } => Some(*reason),
                _ => None,
            })
            .collect();
        assert_eq!(reasons, ["tool_loop", "every_n_turns", "rolling_threshold"]);
        let abandoned: Vec<&str> = a
            .entries
            .iter()
            .filter_map(|e| match &e.what {
                What::JobAbandoned { job_id } => {
                    Some(e.event_id.as_str()).filter(|_| job_id == "j9")
                }
                _ => None,
            })
            .collect();
        assert_eq!(abandoned, ["d"]);
    }
}
