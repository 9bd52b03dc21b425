//! The fold: `fold(state, event)` applies one event to a partition's state
//! and returns the decisions it took (debt changes, jobs, rejections) as
//! events with deterministic ids, to be published to the log.
//!
//! Pure and deterministic: time comes from the log (each record's stored
//! time, or in a log that stores none the event's own time), never from a
//! clock; ids are derived from the causing event, and a decision seen
//! again in the log changes nothing.
//!
//! # Time
//!
//! Each record first moves the partition's clock
//! ([`crate::core::state::PartitionClock`]) to its time and wakes the
//! conversations whose timers that makes due ([`wake`]): a backoff ends, a
//! spend window reopens, a job whose worker vanished is given up, whatever
//! conversation the record is about. Scheduling (deadlines, spend windows,
//! backoffs) reads only that clock; the guards that compare turns (the
//! duplicate and flood guards) read the event's own time, which only
//! affects the conversation that claims it.
//!
//! Here: dispatch (`FoldContext::apply`), waking, and how a decision is
//! recorded.
//! Each kind of event is handled in its own module: `turns` (admission and
//! the guards' bookkeeping), `summaries` (acceptance and placement),
//! `sweeps` (a sweep's or a recall's end and its spend), `debt` (what
//! raises debt and the scheduler that issues jobs); `guards` is the text
//! identity the duplicate and flood guards compare by.

use crate::core::assembly;
use crate::core::event::*;
use crate::core::measure::TurnMeasure;
use crate::core::message::{ChatMessage, Content, Role};
use crate::core::overflow;
use crate::core::policy::{self, schedule, PolicyConfig, Schedule, Wait};
use crate::core::state::{
    call_digest, derived_event_id, event_digest, id_digest, summary_id, tool_ids_of, turn_count,
    ContextItem, Conversation, IdDigest, IntakeQuota, PartitionClock, PendingJob, ResidentBodies,
    SeenDigest, SeenTurn, SpendEntry, SpendWindow, State, Summary, Turn, TurnBody,
};
use crate::core::tokens;
use std::cell::RefCell;
use std::sync::Arc;

mod debt;
mod guards;
mod rejection;
mod summaries;
mod sweeps;
mod turns;

pub use debt::RESUMMARY_ROUNDS;
pub use guards::guard_read;
use guards::*;
pub use rejection::{QuotaScope, Rejection, SummaryRejection, TurnRejection};

/// What became of one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FoldStatus {
    Applied,
    /// Its id was already applied: nothing changed.
    Duplicate,
    /// Rejected with a reason (also recorded as an `event_rejected` or
    /// `summary_rejected` decision).
    Rejected(Rejection),
    /// The conversation matches an `ignore_sessions` glob.
    Ignored,
    /// Over the conversation's intake quota while it is already refusing:
    /// counted, its id consumed, nothing recorded (the first refusal of an
    /// episode is `Rejected`, with its `event_rejected`).
    Throttled,
}

/// The result of folding one event.
#[derive(Debug, Clone, PartialEq)]
pub struct FoldOutcome {
    pub status: FoldStatus,
    /// Decisions to publish, in order.
    pub decisions: Vec<Envelope>,
    /// The jobs issued, as (conversation, job id): what the runtime hands
    /// to summarizers once the decisions are out, if still pending.
    pub issued: Vec<(String, String)>,
    /// Conversations the record woke (their timers were due): changed
    /// though the record is not theirs.
    pub woken: Vec<String>,
    /// What changed in scheduling, for telemetry.
    pub notes: Vec<ScheduleNote>,
}

impl FoldOutcome {
    fn new(status: FoldStatus) -> Self {
        FoldOutcome {
            status,
            decisions: Vec::new(),
            issued: Vec::new(),
            woken: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Adds what waking conversations did before the record was folded.
    fn after(mut self, mut woke: FoldOutcome) -> Self {
        woke.decisions.append(&mut self.decisions);
        woke.issued.append(&mut self.issued);
        woke.notes.append(&mut self.notes);
        self.decisions = woke.decisions;
        self.issued = woke.issued;
        self.notes = woke.notes;
        self.woken = woke.woken;
        self
    }
}

/// A change in a conversation's scheduling worth counting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScheduleNote {
    /// A spend window (the conversation's, its urgent cap, or the
    /// partition's) closed on its debt: counted once per closing.
    SpendWindowClosed { conversation: String, on: Wait },
    /// A round made no progress: no job before `until`.
    BackedOff { conversation: String, until: u64 },
    /// A job's worker vanished: given up at its expiry.
    JobExpired {
        conversation: String,
        job_id: String,
    },
}

/// Folds one event into the state, at its own time (a log that stores no
/// time: see the module doc).
pub fn fold(state: &mut State, policy: &PolicyConfig, event: &Envelope) -> FoldOutcome {
    fold_counted(state, policy, event, None)
}

/// Folds one event whose turn was measured ahead of the fold (see
/// [`crate::core::measure`]): the same outcome as [`fold`], sooner.
pub fn fold_counted(
    state: &mut State,
    policy: &PolicyConfig,
    event: &Envelope,
    measured: Option<&TurnMeasure>,
) -> FoldOutcome {
    let woke = wake(state, policy, event.time, &event.id);
    fold_with(state, policy, event, measured, None).after(woke)
}

/// [`fold_counted`] for an event the caller owns (one just decoded): a
/// turn moves into the state instead of being copied there. Same result.
/// `stored_at` is when the log stored its record, for logs that record it:
/// the clock moves there rather than to the event's time.
pub fn fold_owned(
    state: &mut State,
    policy: &PolicyConfig,
    mut event: Envelope,
    stored_at: Option<u64>,
    measured: Option<&TurnMeasure>,
) -> FoldOutcome {
    let woke = wake(state, policy, stored_at.unwrap_or(event.time), &event.id);
    // The id moves with the turn (the fold reads it from there): a copy
    // was an allocation and a free per turn.
    let turn = match &mut event.body {
        EventBody::TurnAppended(t) => Some(Arc::new(TurnBody {
            event_id: std::mem::take(&mut event.id).into_boxed_str(),
            turn: std::mem::replace(t, empty_turn()),
        })),
        _ => None,
    };
    fold_with(state, policy, &event, measured, turn.as_ref()).after(woke)
}

/// Moves the partition's clock to `time` (never back) and evaluates every
/// conversation whose timer that makes due, earliest first: a record's
/// first step, whatever it is (an event of any conversation, a refused
/// record, a `clock_ticked`). Decisions are derived from `cause` (the
/// record's event id) and the conversation. The caller makes the due
/// conversations resident first ([`PartitionClock::due`]); one that is
/// not in the state has its timer dropped.
pub fn wake(state: &mut State, policy: &PolicyConfig, time: u64, cause: &str) -> FoldOutcome {
    let now = state.clock.advance(time);
    let mut out = FoldOutcome::new(FoldStatus::Applied);
    if state.clock.next_due().is_none_or(|at| at > now) {
        return out;
    }
    let due: Vec<String> = state.clock.due(now).map(str::to_string).collect();
    for key in due {
        let State {
            conversations,
            spend: global,
            clock,
            intake,
            ..
        } = &mut *state;
        let Some(conv) = conversations.get_mut(&key) else {
            clock.set(&key, None);
            continue;
        };
        // The timer is spent; `evaluate` sets the next one.
        clock.set(&key, None);
        let id = format!("{cause}@{key}");
        let event = Envelope::new(
            id.clone(),
            key.clone(),
            now,
            EventBody::ClockTicked(ClockTicked::default()),
        );
        let mut cx = FoldContext {
            conv,
            global,
            clock,
            intake,
            now,
            policy,
            event: &event,
            id: &id,
            event_digest: id_digest(&id),
            measured: None,
            turn: None,
            out: FoldOutcome::new(FoldStatus::Applied),
            levels: None,
        };
        cx.evaluate();
        out.decisions.append(&mut cx.out.decisions);
        out.issued.append(&mut cx.out.issued);
        out.notes.append(&mut cx.out.notes);
        out.woken.push(key);
    }
    out
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

/// `turn` is the event's turn, already moved out of it with its id when
/// given.
fn fold_with(
    state: &mut State,
    policy: &PolicyConfig,
    event: &Envelope,
    measured: Option<&TurnMeasure>,
    turn: Option<&Arc<TurnBody>>,
) -> FoldOutcome {
    if policy::session_matches(&policy.ignore_sessions, &event.conversation) {
        return FoldOutcome::new(FoldStatus::Ignored);
    }
    let State {
        conversations,
        spend: global,
        clock,
        intake,
        ..
    } = state;
    let now = clock.now;
    let conv = conversations.get_or_insert_with(&event.conversation, || {
        Conversation::new(&event.conversation)
    });
    let id = turn.map_or(event.id.as_str(), |b| &b.event_id);
    let event_digest = id_digest(id);
    if conv.has_applied_digest(&event_digest) {
        if let EventBody::JobIssued(job) = &event.body {
            job_left(conv, clock, job, now);
        }
        return FoldOutcome::new(FoldStatus::Duplicate);
    }
    let mut cx = FoldContext {
        conv,
        global,
        clock,
        intake,
        now,
        policy,
        event,
        id,
        event_digest,
        measured,
        turn,
        out: FoldOutcome::new(FoldStatus::Applied),
        levels: None,
    };
    let status = cx.apply();
    let mut out = cx.out;
    out.status = status;
    out
}

/// The copy of a `job_issued` this fold decided came back from the log:
/// the job has left, and its expiry runs from now (once).
fn job_left(conv: &mut Conversation, clock: &mut PartitionClock, job: &JobIssued, now: u64) {
    if let Some(pending) = conv
        .pending_job
        .as_mut()
        .filter(|p| p.job.job_id == job.job_id && p.left_at.is_none())
    {
        pending.left_at = Some(now);
        clock.set(&conv.key, Some(schedule::expires_at(pending)));
    }
}

/// The id a rejection gives a record that has none of its own (bytes that
/// never became an event, or an id too long to repeat): derived from the
/// bytes, so replaying the same log rejects the same way.
pub fn undecodable_id(bytes: &[u8]) -> String {
    crate::core::derived_id::DerivedId::Undecodable { bytes }.to_string()
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
        derived_event_id(rejected_id, EventKind::EventRejected.name()),
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

struct FoldContext<'a> {
    conv: &'a mut Conversation,
    /// The partition's spend window across conversations.
    global: &'a mut SpendWindow,
    /// The partition's timers.
    clock: &'a mut PartitionClock,
    /// The partition's intake quota across its conversations.
    intake: &'a mut IntakeQuota,
    /// The partition's clock: the time scheduling decides by.
    now: u64,
    policy: &'a PolicyConfig,
    event: &'a Envelope,
    /// The event's id (read it here: a turn given up took it along).
    id: &'a str,
    event_digest: IdDigest,
    /// The turn's measure, taken ahead of the fold (used when it was taken
    /// in the conversation's encoding).
    measured: Option<&'a TurnMeasure>,
    /// The turn, when the caller gave it up: it is kept without a copy.
    turn: Option<&'a Arc<TurnBody>>,
    /// Decisions, jobs issued and notes so far.
    out: FoldOutcome,
    /// The conversation's levels, resolved once per event ([`FoldContext::levels`]).
    levels: Option<policy::Levels>,
}

impl FoldContext<'_> {
    fn apply(&mut self) -> FoldStatus {
        let event = self.event;
        if event.body.is_agent_event() {
            if let Some(status) = self.over_quota() {
                return status;
            }
        }
        self.conv.last_time = self.conv.last_time.max(event.time);
        let status = match &event.body {
            EventBody::TurnAppended(t) => match self.turn {
                Some(owned) => self.turn_appended(&owned.turn, Some(owned)),
                None => self.turn_appended(t, None),
            },
            EventBody::ProviderErrorObserved(e) => self.provider_error(e),
            EventBody::CompactionRequested(r) => self.compaction_requested(r),
            EventBody::ModelDeclared(m) => {
                self.conv.model = Some(m.model.clone());
                if m.context_window.is_some() {
                    self.conv.context_window = m.context_window;
                }
                // They decide the levels.
                self.levels = None;
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
                let encoding = self.conv.encoding;
                self.conv.rolling_tokens =
                    Some((encoding, assembly::rolling_tokens(encoding, &r.state)));
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
            body @ (EventBody::DebtRecorded(_)
            | EventBody::DebtUpdated(_)
            | EventBody::DebtCleared(_)
            | EventBody::JobIssued(_)
            | EventBody::SummaryRejected(_)
            | EventBody::MemoryFlushRequested(_)) => {
                // A decision this fold did not take (another policy wrote it):
                // kept for audit, never acted on.
                self.history(
                    body.type_name(),
                    "observed, not derived by this policy".into(),
                );
                FoldStatus::Applied
            }
            // Partition-wide: the policy is read by whoever folds the
            // partition, and time moved the clock before this (`wake`).
            EventBody::PolicyRecorded(_) | EventBody::ClockTicked(_) => FoldStatus::Applied,
        };
        match &status {
            // A rejected summary already produced its `summary_rejected`.
            FoldStatus::Rejected(reason)
                if !matches!(event.body, EventBody::SummaryRecorded(_)) =>
            {
                self.conv.rejections += 1;
                let reason = reason.to_string();
                self.history("event_rejected", reason.clone());
                self.decide(EventBody::EventRejected(EventRejected {
                    rejected_id: self.id.to_string(),
                    event_type: Some(event.type_name().to_string()),
                    reason,
                }));
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

    /// The conversation's budget and trigger levels: they depend on its
    /// model, window and key, which only a `model_declared` changes, so
    /// they are resolved once per event, not at every use.
    fn levels(&mut self) -> policy::Levels {
        *self
            .levels
            .get_or_insert_with(|| policy::levels(self.conv, self.policy))
    }

    /// Takes the event from the conversation's intake quota, then (when
    /// one is set) from the partition's; when either is short, refuses it:
    /// the first of the conversation's episode with a record (an
    /// `event_rejected`), the others counted only, each id consumed. None:
    /// admitted. A conversation refused on its own quota takes nothing from
    /// the partition's, so one flooding conversation does not spend the
    /// others' share.
    fn over_quota(&mut self) -> Option<FoldStatus> {
        let p = self.policy;
        let own = p.conversation_intake();
        let shared = p.partition_intake();
        let partition = shared.0.is_some() || shared.2.is_some();
        if own.0.is_none() && own.2.is_none() && !partition {
            return None;
        }
        // A turn given up by the caller is no longer in the event.
        let bytes = match (&self.event.body, self.turn) {
            (EventBody::TurnAppended(_), Some(owned)) => owned.turn.message.text_bytes() as u64,
            (EventBody::TurnAppended(t), None) => t.message.text_bytes() as u64,
            _ => 0,
        } + 256;
        let now = self.now;
        let admitted_here = self.conv.quota.take(now, bytes, own);
        let admitted = admitted_here && (!partition || self.intake.take(now, bytes, shared));
        let quota = &mut self.conv.quota;
        if admitted {
            if quota.refusing {
                quota.refusing = false;
                let refused = quota.refused;
                self.history(
                    "quota",
                    format!(
                        "admitting again: {refused} events refused over the intake quota so far"
                    ),
                );
            }
            return None;
        }
        quota.refused += 1;
        let first = !quota.refusing;
        quota.refusing = true;
        if admitted_here {
            // Counted only: episodes are the conversation's (its record).
            self.intake.refused += 1;
        }
        self.conv.mark_applied_digest(self.event_digest);
        if !first {
            return Some(FoldStatus::Throttled);
        }
        let rates = |(events, burst_events, bytes, burst_bytes): (
            Option<u32>,
            u32,
            Option<u64>,
            u64,
        )| {
            format!(
                "{} events/s with bursts of {burst_events}, {} bytes/s with bursts of {burst_bytes}",
                events.map_or("unlimited".to_string(), |r| r.to_string()),
                bytes.map_or("unlimited".to_string(), |r| r.to_string()),
            )
        };
        let rejection = if admitted_here {
            Rejection::OverQuota {
                scope: QuotaScope::Partition,
                limit: rates(shared),
            }
        } else {
            Rejection::OverQuota {
                scope: QuotaScope::Conversation,
                limit: rates(own),
            }
        };
        self.conv.rejections += 1;
        let reason = rejection.to_string();
        self.history("event_rejected", reason.clone());
        self.decide(EventBody::EventRejected(EventRejected {
            rejected_id: self.id.to_string(),
            event_type: Some(self.event.type_name().to_string()),
            reason,
        }));
        Some(FoldStatus::Rejected(rejection))
    }

    fn history(&mut self, event_type: &str, detail: String) {
        self.conv
            .push_history(self.now, self.id, event_type, detail);
    }

    /// Records a decision; its id is derived from the event's and the
    /// decision's type.
    fn decide(&mut self, body: EventBody) {
        let env = Envelope::new(
            derived_event_id(self.id, body.type_name()),
            self.conv.key.clone(),
            self.now,
            body,
        );
        self.conv.mark_applied(&env.id);
        self.out.decisions.push(env);
    }
}

#[cfg(test)]
mod guard_tests;
#[cfg(test)]
mod tests;
