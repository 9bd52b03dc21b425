//! The log's vocabulary: a versioned envelope and every event type.
//!
//! Names are past-tense facts. Inbound events come from agents; the rest are
//! decisions of the fold (published for audit and folded back as no-ops, by
//! id) or results of the summarizers (folded as facts). Each type has a JSON
//! Schema in `schemas/`, checked against this code by `tests/schemas.rs`.

use crate::core::message::ChatMessage;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The envelope version this build writes and the newest it reads.
pub const EVENT_VERSION: u16 = 1;

/// Hard cap on one encoded event; larger ones are rejected, not truncated.
pub const MAX_EVENT_BYTES: usize = 8 * 1024 * 1024;

/// Deepest nesting of arrays and maps an encoded event may have (the
/// envelope's own levels included), in either encoding: serde_json's
/// limit, which MessagePack now shares (rmp-serde allows 1,024). Deeper
/// input is refused as malformed before its decoding exhausts the stack of
/// the thread that decodes it (a tokio worker has 2 MiB).
pub const MAX_NESTING_DEPTH: usize = 128;

/// One event in the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Idempotency key: an event whose id was already applied changes nothing.
    pub id: String,
    /// The conversation (session key) this event belongs to.
    pub conversation: String,
    /// Envelope version ([`EVENT_VERSION`]).
    #[serde(default = "default_version")]
    pub version: u16,
    /// Event time in milliseconds since the Unix epoch, set by the producer.
    /// The fold takes time only from here, never from a clock.
    #[serde(default)]
    pub time: u64,
    #[serde(flatten)]
    pub body: EventBody,
}

fn default_version() -> u16 {
    EVENT_VERSION
}

/// The event's type (`type`) and its `payload`.
///
/// Its variants are the event types; [`EventKind`] (derived from them)
/// names each and says who may write it and how the audit labels it. The
/// order of the variants is the order of [`EventKind::ALL`], which the
/// golden file of canonical events (`tests/golden/events.jsonl`) follows;
/// on the wire a type is its name, never its position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, strum::EnumDiscriminants)]
#[serde(tag = "type", content = "payload", rename_all = "snake_case")]
#[strum_discriminants(
    name(EventKind),
    vis(pub),
    derive(
        Hash,
        Serialize,
        strum::IntoStaticStr,
        strum::EnumString,
        strum::VariantArray,
        strum::VariantNames
    ),
    strum(serialize_all = "snake_case"),
    serde(rename_all = "snake_case")
)]
pub enum EventBody {
    // ---- from agents ----
    TurnAppended(TurnAppended),
    ProviderErrorObserved(ProviderErrorObserved),
    CompactionRequested(CompactionRequested),
    ModelDeclared(ModelDeclared),
    ConversationReset(ConversationReset),
    // ---- decisions of the fold ----
    DebtRecorded(Debt),
    DebtUpdated(Debt),
    DebtCleared(DebtCleared),
    JobIssued(JobIssued),
    SummaryRejected(SummaryRejected),
    EventRejected(EventRejected),
    MemoryFlushRequested(MemoryFlushRequested),
    // ---- results of summarizers ----
    SummaryRecorded(SummaryRecorded),
    SweepEnded(SweepEnded),
    RollingStateUpdated(RollingStateUpdated),
    // ---- of the partition, not of a conversation ----
    PolicyRecorded(PolicyRecorded),
    // ---- of the API's model calls ----
    RecallAnswered(RecallAnswered),
    // ---- of the partition, not of a conversation ----
    ClockTicked(ClockTicked),
}

/// Who may write an event type ([`Origin::may_write`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Writer {
    /// Agents (and the service, which may write anything).
    Agent,
    /// Only contextfold itself.
    Service,
}

impl Writer {
    pub fn as_str(self) -> &'static str {
        match self {
            Writer::Agent => "agent",
            Writer::Service => "service",
        }
    }
}

/// What an event type is for, beside its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// An agent's input: the only events that can make new compaction work.
    Input,
    /// A decision of the fold: derived by the fold itself, so seeing one
    /// again in the log must never change state.
    Decision,
    /// The result of work the service was asked for: summaries, rolling
    /// state, sweep ends, recalls.
    Result,
    /// Of the partition, not of a conversation: policies and clock ticks.
    Partition,
}

impl EventKind {
    /// Every event type, in declaration order.
    pub const ALL: &'static [EventKind] = <EventKind as strum::VariantArray>::VARIANTS;

    /// Every event type's wire name, in the order of [`EventKind::ALL`].
    pub const NAMES: &'static [&'static str] = <EventKind as strum::VariantNames>::VARIANTS;

    /// The one table of what an event type is beside its wire name (which
    /// is its variant's name in snake case, for serde and strum alike):
    /// its family (whence who may write it) and its label in the audit
    /// page. A new type does not compile until it has its row.
    const fn row(self) -> (Family, &'static str) {
        use EventKind as K;
        use Family::*;
        match self {
            K::TurnAppended => (Input, "turn"),
            K::ProviderErrorObserved => (Input, "provider error"),
            K::CompactionRequested => (Input, "compaction requested"),
            K::ModelDeclared => (Input, "model declared"),
            K::ConversationReset => (Input, "conversation reset"),
            K::DebtRecorded => (Decision, "debt recorded"),
            K::DebtUpdated => (Decision, "debt updated"),
            K::DebtCleared => (Decision, "debt cleared"),
            K::JobIssued => (Decision, "job issued"),
            K::SummaryRejected => (Decision, "summary rejected"),
            K::EventRejected => (Decision, "event rejected"),
            K::MemoryFlushRequested => (Decision, "memory flush requested"),
            K::SummaryRecorded => (Result, "summary"),
            K::SweepEnded => (Result, "sweep ended"),
            K::RollingStateUpdated => (Result, "rolling state updated"),
            K::PolicyRecorded => (Partition, "policy recorded"),
            K::RecallAnswered => (Result, "recall answered"),
            K::ClockTicked => (Partition, "clock ticked"),
        }
    }

    /// The wire name (`turn_appended`, ...).
    pub fn name(self) -> &'static str {
        self.into()
    }

    pub const fn family(self) -> Family {
        self.row().0
    }

    /// How the audit page labels an event of this type.
    pub const fn label(self) -> &'static str {
        self.row().1
    }

    /// Agents may write only their inputs; everything else (decisions,
    /// summaries, rolling state, sweep ends, policies) is the service's,
    /// the results of work already asked for, and the fold refuses it when
    /// the log says an agent published it.
    pub const fn writer(self) -> Writer {
        match self.family() {
            Family::Input => Writer::Agent,
            Family::Decision | Family::Result | Family::Partition => Writer::Service,
        }
    }

    /// The wire names of the types agents may write, as a sentence
    /// (`turn_appended, ... and conversation_reset`).
    pub fn agent_types_listed() -> String {
        let names: Vec<&str> = EventKind::ALL
            .iter()
            .filter(|k| k.writer() == Writer::Agent)
            .map(|k| k.name())
            .collect();
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            Some((last, _)) => last.to_string(),
            None => String::new(),
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl EventBody {
    /// This event's type.
    pub fn kind(&self) -> EventKind {
        EventKind::from(self)
    }

    /// The wire name of this event type (`turn_appended`, ...).
    pub fn type_name(&self) -> &'static str {
        self.kind().name()
    }

    /// Every event type's wire name, for schemas and docs.
    pub const TYPE_NAMES: &'static [&'static str] = EventKind::NAMES;

    /// The types an agent may write, and the only ones that can make new
    /// compaction work ([`EventKind::writer`]).
    pub fn is_agent_event(&self) -> bool {
        self.kind().writer() == Writer::Agent
    }

    /// Decisions are derived by the fold itself; seeing one again in the log
    /// must never change state.
    pub fn is_decision(&self) -> bool {
        self.kind().family() == Family::Decision
    }
}

/// Who wrote a record, as the log's transport knows it: the subject a NATS
/// message was published on (`<prefix>.in.*` for agents, `<prefix>.svc.*`
/// for the service, kept in the stored subject), or the flag the embedded
/// segment log stores beside each record. Never what the event says of
/// itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// An agent: may write only the agent event types
    /// ([`EventBody::is_agent_event`]).
    Agent,
    /// contextfold itself: its decisions, summaries, rolling state and
    /// sweep ends, and the compactions its API was asked for.
    Service,
    /// A record of an embedded log written before origins were recorded.
    /// Such a log was written only by the local `run` command, so it is
    /// read as before, with the service's rights.
    Legacy,
}

impl Origin {
    /// Whether this origin may write events of `body`'s type.
    pub fn may_write(self, body: &EventBody) -> bool {
        match self {
            Origin::Agent => body.kind().writer() == Writer::Agent,
            Origin::Service | Origin::Legacy => true,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Agent => "agent",
            Origin::Service => "service",
            Origin::Legacy => "legacy",
        }
    }
}

/// Token usage as the provider reported it for the call that produced a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ProviderUsage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_tokens: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnAppended {
    pub message: ChatMessage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Which agent or process sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<ProviderUsage>,
    /// Free-form metadata, stored and returned untouched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

impl From<ChatMessage> for TurnAppended {
    /// A turn that is its message alone: no model, sender, usage or metadata.
    fn from(message: ChatMessage) -> Self {
        TurnAppended {
            message,
            model: None,
            sender: None,
            usage: None,
            metadata: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProviderErrorObserved {
    /// The raw error text as the provider returned it.
    pub error: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CompactionRequested {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_recent_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_tokens: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelDeclared {
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ConversationReset {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Why compaction is owed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DebtReason {
    /// Context tokens above the resolved threshold.
    Threshold,
    /// A provider reported a context overflow.
    Overflow,
    /// Someone asked for it.
    Manual,
    /// The active transcript grew past `max_active_transcript_bytes`.
    TranscriptBytes,
    /// Deterministic fallback summaries in context wait for a model: raised
    /// only once a model summary shows a model is available again, paid when
    /// none is left in context. Routine; any other trigger takes it over.
    Resummarize,
}

/// The one pending compaction debt of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Debt {
    pub reason: DebtReason,
    /// Context tokens when the debt was recorded or last updated.
    pub context_tokens: u64,
    /// The resolved trigger threshold.
    pub threshold_tokens: u64,
    /// Where a sweep should bring the context down to.
    pub target_tokens: u64,
    /// Overflow recovery and manual requests bypass spend backoff.
    pub urgent: bool,
    /// Event time the debt was first recorded.
    pub since: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DebtCleared {
    pub reason: String,
}

/// A compaction job handed to the summarizers (the log keeps this record;
/// the work item itself carries the content snapshot).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobIssued {
    pub job_id: String,
    pub reason: DebtReason,
    pub urgent: bool,
    pub context_tokens: u64,
    pub target_tokens: u64,
    /// Deadline for the whole sweep, in milliseconds after `issued_at`.
    pub deadline_ms: u64,
    pub issued_at: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Compact old history (false: only the rolling session state is due).
    #[serde(default = "yes")]
    pub compact: bool,
    /// Refresh the rolling session state as part of this job.
    #[serde(default)]
    pub refresh_rolling_state: bool,
    /// Summarizer calls this job may still make within the spend window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_calls: Option<u32>,
    /// Summarizer tokens this job may still spend within the spend window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryRejected {
    pub summary_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRejected {
    /// Id of the rejected event, when it could be read.
    pub rejected_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_type: Option<String>,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryFlushRequested {
    /// Compaction cycle number (one flush per cycle).
    pub cycle: u64,
    pub reason: DebtReason,
}

/// What kind of summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum SummaryKind {
    /// Over a contiguous run of raw turns.
    Leaf,
    /// Over a contiguous run of same-depth summaries.
    Condensed,
}

/// Exactly what a summary covers.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Covers {
    /// Raw turns `first..=last` by turn sequence number.
    Turns { first: u64, last: u64 },
    /// Child summaries, oldest first.
    Summaries { ids: Vec<String> },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryRecorded {
    /// Content address: see [`crate::core::state::summary_id`].
    pub summary_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    pub kind: SummaryKind,
    /// 0 for leaf summaries; 1 + the children's depth for condensed ones.
    pub depth: u32,
    pub covers: Covers,
    pub content: String,
    /// Tokens of what it covers (as currently in context).
    pub source_tokens: u64,
    /// Tokens of `content`.
    pub tokens: u64,
    pub model: String,
    pub provider: String,
    pub prompt_version: String,
    /// A deterministic fallback, to be re-summarized by a model later.
    pub fallback: bool,
    /// The in-context fallback summary this model summary replaces (a
    /// re-summarization): same kind, depth and covers. The fold accepts it
    /// only while that summary is still in context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supersedes: Option<String>,
}

/// Why a sweep stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SweepStop {
    Done,
    Deadline,
    IterationCap,
    SpendLimit,
    NoProgress,
    Failed,
}

impl SweepStop {
    /// The wire name (`done`, `deadline`, ...), also a bounded metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            SweepStop::Done => "done",
            SweepStop::Deadline => "deadline",
            SweepStop::IterationCap => "iteration_cap",
            SweepStop::SpendLimit => "spend_limit",
            SweepStop::NoProgress => "no_progress",
            SweepStop::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepEnded {
    pub job_id: String,
    pub passes: u32,
    /// Summaries this sweep published. A claim, for the audit trail: the
    /// fold counts the job's summaries it accepted and trusts only that.
    pub committed: u32,
    pub stop: SweepStop,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Summarizer calls and tokens spent (for the spend window).
    #[serde(default)]
    pub calls: u32,
    #[serde(default)]
    pub tokens_spent: u64,
    /// Money spent, in micro-dollars.
    #[serde(default)]
    pub cost_micros: u64,
    /// Ask for the job again after this delay (rate limits, spend window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

/// How a delegated recall ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecallOutcome {
    /// The model answered.
    Answered,
    /// The deadline passed: the call in flight was cancelled.
    Deadline,
    /// No model answered (unavailable, refused key, unusable answer).
    Failed,
}

impl RecallOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            RecallOutcome::Answered => "answered",
            RecallOutcome::Deadline => "deadline",
            RecallOutcome::Failed => "failed",
        }
    }
}

/// A delegated recall ran: a model read part of the conversation's history
/// to answer a question (`recall` in the API). Written by the service after
/// the model call, whatever its outcome, so that what it spent counts in
/// the conversation's spend window like a sweep's; it changes nothing else.
/// The question itself is not kept, only its digest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecallAnswered {
    /// `core::recall::question_digest` of the question.
    pub question_digest: String,
    pub outcome: RecallOutcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The model that answered (or was asked last).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Model calls made, tokens and money spent.
    #[serde(default)]
    pub calls: u32,
    #[serde(default)]
    pub tokens_spent: u64,
    #[serde(default)]
    pub cost_micros: u64,
    /// Tokens of the prompt the model was given (our count).
    #[serde(default)]
    pub prompt_tokens: u64,
    /// What it was given to read, as cited: `turn 12`, `sum_…`.
    #[serde(default)]
    pub sources: Vec<String>,
}

/// The policy every later event of the partition is folded under, until
/// the next `policy_recorded`: the whole effective `[policy]` section, so
/// the log alone reproduces what the service decided, whatever the
/// configuration of the process that replays it.
///
/// It is partition-wide, not a conversation's: its envelope's
/// `conversation` is a reserved routing key ([`is_partition_key`]) that
/// only places it in the partition's part of the log; no conversation is
/// created for it. Only the service writes it (a process appends one when
/// it starts folding with a policy whose fingerprint differs from the last
/// one recorded); a log without any folds under the configured policy
/// until its first one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyRecorded {
    /// `runtime::engine::policy_fingerprint` of `policy`.
    pub fingerprint: String,
    /// The fingerprint recorded before this one in the log, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    /// Which process recorded it (its member name or `embedded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded_by: Option<String>,
    /// Boxed: the other event types are far smaller.
    pub policy: Box<crate::core::policy_config::PolicyConfig>,
}

/// Time passed in a quiet partition: the service records one when a
/// conversation of the partition waits for a time (a backoff's end, a
/// job's expiry, a spend window reopening) and no record has come to move
/// the partition's clock there. Its stored time moves the clock
/// (`core::state::PartitionClock`); it changes nothing else. Partition-wide
/// like [`PolicyRecorded`], and only the service writes it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ClockTicked {
    /// Which process recorded it (its member name or `embedded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded_by: Option<String>,
}

/// The reserved conversation keys of partition-wide events: `contextfold-
/// partition-<p>-<n>`, with `n` the smallest number that makes the key fall
/// in partition `p` (so the event is stored in the partition it is about;
/// see [`partition_key`]). Agents' conversations should not use keys of
/// this form: events of other types on them fold as an ordinary
/// conversation, and a policy event on them is the partition's.
pub const PARTITION_KEY_PREFIX: &str = "contextfold-partition-";

/// The reserved key of the embedded log's partition-wide events (its one
/// partition's [`partition_key`]).
pub const EMBEDDED_PARTITION_KEY: &str = "contextfold-partition-0-0";

/// Whether `key` is of the reserved form of [`PARTITION_KEY_PREFIX`].
pub fn is_partition_key(key: &str) -> bool {
    key.strip_prefix(PARTITION_KEY_PREFIX).is_some_and(|rest| {
        let mut parts = rest.split('-');
        let ok = |p: Option<&str>| {
            p.is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        };
        ok(parts.next()) && ok(parts.next()) && parts.next().is_none()
    })
}

/// The reserved key of partition `partition`'s partition-wide events, for
/// a log cut into partitions by `partition_of(key)`; the embedded log (one
/// partition) uses `partition_key(0, |_| 0)` = `contextfold-partition-0-0`.
/// `None` when no key of the form falls in `partition` (it is not one of
/// the log's partitions).
pub fn partition_key(partition: u32, partition_of: impl Fn(&str) -> u32) -> Option<String> {
    // A uniform hash puts one key in N in each partition: a million tries
    // fail only for a partition that does not exist.
    (0..1_000_000u64)
        .map(|n| format!("{PARTITION_KEY_PREFIX}{partition}-{n}"))
        .find(|key| partition_of(key) == partition)
}

/// The rolling session state (Completed / In progress / Decisions /
/// Blockers / Next; at most 500 characters in all, 200 a section).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RollingState {
    pub completed: String,
    pub in_progress: String,
    pub decisions: String,
    pub blockers: String,
    pub next: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RollingStateUpdated {
    pub state: RollingState,
    /// Turn sequence number the state reflects (inclusive).
    pub through_turn: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
}

/// How an event is encoded on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    #[default]
    Msgpack,
    Json,
}

impl Encoding {
    /// From a `Content-Type`-like header value; MessagePack when absent.
    pub fn from_header(value: Option<&str>) -> Encoding {
        // "json" in any ASCII case, without a lowercased copy of the value.
        match value {
            Some(v)
                if v.as_bytes()
                    .windows(4)
                    .any(|w| w.eq_ignore_ascii_case(b"json")) =>
            {
                Encoding::Json
            }
            _ => Encoding::Msgpack,
        }
    }
}

impl fmt::Display for Encoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Encoding::Msgpack => "msgpack",
            Encoding::Json => "json",
        })
    }
}

/// Why bytes could not become an event.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("event of {size} bytes exceeds the {limit}-byte limit")]
    Oversized { size: usize, limit: usize },
    #[error("malformed {encoding} event: {detail}")]
    Malformed { encoding: Encoding, detail: String },
    #[error("event version {found} is newer than this build reads ({supported})")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("event has an empty {field}")]
    Empty { field: &'static str },
}

impl Envelope {
    pub fn new(
        id: impl Into<String>,
        conversation: impl Into<String>,
        time: u64,
        body: EventBody,
    ) -> Self {
        Envelope {
            id: id.into(),
            conversation: conversation.into(),
            version: EVENT_VERSION,
            time,
            body,
        }
    }

    pub fn type_name(&self) -> &'static str {
        self.body.type_name()
    }

    /// MessagePack with named fields.
    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    pub fn to_msgpack(&self) -> Vec<u8> {
        // Serializing owned, well-formed data into a Vec cannot fail.
        rmp_serde::to_vec_named(self).expect("msgpack encoding of an event")
    }

    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("json encoding of an event")
    }

    pub fn encode(&self, encoding: Encoding) -> Vec<u8> {
        match encoding {
            Encoding::Msgpack => self.to_msgpack(),
            Encoding::Json => self.to_json().into_bytes(),
        }
    }

    pub fn decode(bytes: &[u8], encoding: Encoding) -> Result<Envelope, DecodeError> {
        if bytes.len() > MAX_EVENT_BYTES {
            return Err(DecodeError::Oversized {
                size: bytes.len(),
                limit: MAX_EVENT_BYTES,
            });
        }
        // The direct decoder first; whatever it does not take (payload
        // before type, unknown type, duplicate or malformed fields) goes
        // through the derived one, which decides and words the error.
        let fast = match encoding {
            Encoding::Msgpack => from_msgpack::<direct::Direct>(bytes).ok(),
            // JSON that is UTF-8 as a whole (checked at once, with SIMD) is
            // decoded as `str`, so serde_json checks none of its strings and
            // keys again one by one. What is not goes to the derived
            // decoder, which words the error as before.
            Encoding::Json => simdutf8::basic::from_utf8(bytes)
                .ok()
                .and_then(|text| serde_json::from_str::<direct::Direct>(text).ok()),
        };
        let env: Envelope = match (fast, encoding) {
            (Some(direct::Direct(env)), _) => env,
            (None, Encoding::Msgpack) => {
                from_msgpack(bytes).map_err(|e| DecodeError::Malformed {
                    encoding,
                    detail: e.to_string(),
                })?
            }
            (None, Encoding::Json) => {
                serde_json::from_slice(bytes).map_err(|e| DecodeError::Malformed {
                    encoding,
                    detail: e.to_string(),
                })?
            }
        };
        env.validate()?;
        Ok(env)
    }

    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.version > EVENT_VERSION {
            return Err(DecodeError::UnsupportedVersion {
                found: self.version,
                supported: EVENT_VERSION,
            });
        }
        if self.id.is_empty() {
            return Err(DecodeError::Empty { field: "id" });
        }
        if self.conversation.is_empty() {
            return Err(DecodeError::Empty {
                field: "conversation",
            });
        }
        Ok(())
    }

    /// A best-effort id and type out of bytes that did not decode, so the
    /// rejection can name what it rejected.
    pub fn salvage_id(bytes: &[u8], encoding: Encoding) -> (Option<String>, Option<String>) {
        #[derive(Deserialize)]
        struct Partial {
            id: Option<String>,
            conversation: Option<String>,
        }
        let partial: Option<Partial> = match encoding {
            Encoding::Msgpack => from_msgpack(bytes).ok(),
            Encoding::Json => serde_json::from_slice(bytes).ok(),
        };
        match partial {
            Some(p) => (p.id, p.conversation),
            None => (None, None),
        }
    }
}

/// `rmp_serde::from_slice` within [`MAX_NESTING_DEPTH`].
fn from_msgpack<'de, T: Deserialize<'de>>(bytes: &'de [u8]) -> Result<T, rmp_serde::decode::Error> {
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_NESTING_DEPTH);
    T::deserialize(&mut de)
}

/// An envelope decoded without buffering: the derived `Deserialize` of
/// [`Envelope`] (its body is `#[serde(flatten)]`) first copies every field
/// into an intermediate tree, which costs about as much as the rest of the
/// decode. When `type` comes before `payload`, as every encoder here writes
/// them, the payload can be read straight into its type. Anything else is
/// an error here, and [`Envelope::decode`] falls back to the derived path.
mod direct {
    use super::*;
    use serde::de::{self, IgnoredAny, MapAccess, Visitor};

    pub(super) struct Direct(pub(super) Envelope);

    enum Key {
        Id,
        Conversation,
        Version,
        Time,
        Type,
        Payload,
        Other,
    }

    impl<'de> Deserialize<'de> for Key {
        fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
            struct KeyVisitor;
            impl Visitor<'_> for KeyVisitor {
                type Value = Key;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a field name")
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                    Ok(match v {
                        "id" => Key::Id,
                        "conversation" => Key::Conversation,
                        "version" => Key::Version,
                        "time" => Key::Time,
                        "type" => Key::Type,
                        "payload" => Key::Payload,
                        _ => Key::Other,
                    })
                }
                fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Key, E> {
                    match std::str::from_utf8(v) {
                        Ok(s) => self.visit_str(s),
                        Err(_) => Ok(Key::Other),
                    }
                }
            }
            d.deserialize_identifier(KeyVisitor)
        }
    }

    /// The body of a known type, read from the map's next value.
    fn payload<'de, A: MapAccess<'de>>(map: &mut A, kind: &str) -> Result<EventBody, A::Error> {
        let Ok(kind) = kind.parse::<EventKind>() else {
            return Err(de::Error::custom(format!("unknown type {kind:?}")));
        };
        use EventKind as K;
        Ok(match kind {
            K::TurnAppended => EventBody::TurnAppended(map.next_value()?),
            K::ProviderErrorObserved => EventBody::ProviderErrorObserved(map.next_value()?),
            K::CompactionRequested => EventBody::CompactionRequested(map.next_value()?),
            K::ModelDeclared => EventBody::ModelDeclared(map.next_value()?),
            K::ConversationReset => EventBody::ConversationReset(map.next_value()?),
            K::DebtRecorded => EventBody::DebtRecorded(map.next_value()?),
            K::DebtUpdated => EventBody::DebtUpdated(map.next_value()?),
            K::DebtCleared => EventBody::DebtCleared(map.next_value()?),
            K::JobIssued => EventBody::JobIssued(map.next_value()?),
            K::SummaryRejected => EventBody::SummaryRejected(map.next_value()?),
            K::EventRejected => EventBody::EventRejected(map.next_value()?),
            K::MemoryFlushRequested => EventBody::MemoryFlushRequested(map.next_value()?),
            K::SummaryRecorded => EventBody::SummaryRecorded(map.next_value()?),
            K::SweepEnded => EventBody::SweepEnded(map.next_value()?),
            K::RollingStateUpdated => EventBody::RollingStateUpdated(map.next_value()?),
            K::RecallAnswered => EventBody::RecallAnswered(map.next_value()?),
            K::PolicyRecorded => EventBody::PolicyRecorded(map.next_value()?),
            K::ClockTicked => EventBody::ClockTicked(map.next_value()?),
        })
    }

    fn once<T, E: de::Error>(slot: &mut Option<T>, value: T, name: &str) -> Result<(), E> {
        if slot.replace(value).is_some() {
            return Err(E::custom(format!("duplicate field {name}")));
        }
        Ok(())
    }

    impl<'de> Deserialize<'de> for Direct {
        fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Direct, D::Error> {
            struct EnvelopeVisitor;
            impl<'de> Visitor<'de> for EnvelopeVisitor {
                type Value = Direct;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("an event envelope")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Direct, A::Error> {
                    let mut id = None;
                    let mut conversation = None;
                    let mut version = None;
                    let mut time = None;
                    let mut kind: Option<String> = None;
                    let mut body = None;
                    while let Some(key) = map.next_key::<Key>()? {
                        match key {
                            Key::Id => once(&mut id, map.next_value::<String>()?, "id")?,
                            Key::Conversation => once(
                                &mut conversation,
                                map.next_value::<String>()?,
                                "conversation",
                            )?,
                            Key::Version => {
                                once(&mut version, map.next_value::<u16>()?, "version")?
                            }
                            Key::Time => once(&mut time, map.next_value::<u64>()?, "time")?,
                            Key::Type => once(&mut kind, map.next_value::<String>()?, "type")?,
                            Key::Payload => {
                                let Some(kind) = kind.as_deref() else {
                                    return Err(de::Error::custom("payload before type"));
                                };
                                let value = payload(&mut map, kind)?;
                                once(&mut body, value, "payload")?;
                            }
                            Key::Other => {
                                map.next_value::<IgnoredAny>()?;
                            }
                        }
                    }
                    let missing = |name| de::Error::custom(format!("missing field {name}"));
                    Ok(Direct(Envelope {
                        id: id.ok_or_else(|| missing("id"))?,
                        conversation: conversation.ok_or_else(|| missing("conversation"))?,
                        version: version.unwrap_or_else(default_version),
                        time: time.unwrap_or_default(),
                        body: body.ok_or_else(|| missing("payload"))?,
                    }))
                }
            }
            d.deserialize_map(EnvelopeVisitor)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::Role;

    #[test]
    fn an_encoding_is_json_when_its_header_says_json_in_any_case() {
        for json in [
            "application/json",
            " APPLICATION/JSON; charset=utf-8",
            "text/Json",
            "json",
        ] {
            assert_eq!(Encoding::from_header(Some(json)), Encoding::Json, "{json}");
        }
        for packed in ["application/msgpack", "application/jso", "", "js on"] {
            assert_eq!(
                Encoding::from_header(Some(packed)),
                Encoding::Msgpack,
                "{packed}"
            );
        }
        assert_eq!(Encoding::from_header(None), Encoding::Msgpack);
    }

    #[test]
    fn sweep_stop_names_are_the_wire_names() {
        use SweepStop::*;
        for stop in [Done, Deadline, IterationCap, SpendLimit, NoProgress, Failed] {
            let wire = serde_json::to_string(&stop).unwrap();
            assert_eq!(wire, format!("\"{}\"", stop.as_str()));
        }
    }

    fn turn() -> Envelope {
        Envelope::new(
            "e1",
            "agent:alpha",
            1_700_000_000_000,
            EventBody::TurnAppended(TurnAppended {
                message: ChatMessage::text(Role::User, "hello"),
                model: Some("gpt-4o".into()),
                sender: None,
                usage: None,
                metadata: None,
            }),
        )
    }

    #[test]
    fn both_encodings_round_trip() {
        let e = turn();
        for enc in [Encoding::Msgpack, Encoding::Json] {
            let back = Envelope::decode(&e.encode(enc), enc).unwrap();
            assert_eq!(back, e);
        }
        let json = e.to_json();
        assert!(json.contains(r#""type":"turn_appended""#), "{json}");
        assert!(json.contains(r#""payload":{"message""#), "{json}");
    }

    #[test]
    fn unknown_type_is_a_clear_error() {
        let bad = r#"{"id":"x","conversation":"c","version":1,"time":0,"type":"turn_exploded","payload":{}}"#;
        let err = Envelope::decode(bad.as_bytes(), Encoding::Json)
            .unwrap_err()
            .to_string();
        assert!(err.contains("turn_exploded"), "{err}");
    }

    #[test]
    fn oversized_and_newer_versions_are_rejected() {
        let big = vec![b' '; MAX_EVENT_BYTES + 1];
        assert!(matches!(
            Envelope::decode(&big, Encoding::Json),
            Err(DecodeError::Oversized { .. })
        ));
        let mut e = turn();
        e.version = 99;
        assert!(matches!(
            Envelope::decode(&e.to_msgpack(), Encoding::Msgpack),
            Err(DecodeError::UnsupportedVersion { .. })
        ));
    }

    /// The derived decoder alone, which the direct one must agree with.
    fn derived(bytes: &[u8], enc: Encoding) -> Result<Envelope, String> {
        match enc {
            Encoding::Json => serde_json::from_slice(bytes).map_err(|e| e.to_string()),
            Encoding::Msgpack => rmp_serde::from_slice(bytes).map_err(|e| e.to_string()),
        }
    }

    #[test]
    fn the_direct_decoder_agrees_with_the_derived_one() {
        let mut events = vec![turn()];
        let mut bare = turn();
        bare.version = 0;
        bare.time = 0;
        events.push(bare);
        events.push(Envelope::new(
            "e2",
            "agent:alpha",
            7,
            EventBody::ModelDeclared(ModelDeclared {
                model: "gpt-4.1".into(),
                context_window: Some(1_000_000),
            }),
        ));
        for e in &events {
            for enc in [Encoding::Msgpack, Encoding::Json] {
                let bytes = e.encode(enc);
                let direct = match enc {
                    Encoding::Json => serde_json::from_slice::<direct::Direct>(&bytes).ok(),
                    Encoding::Msgpack => rmp_serde::from_slice::<direct::Direct>(&bytes).ok(),
                };
                let direct = direct.expect("type before payload: decoded directly").0;
                assert_eq!(direct, *e);
                assert_eq!(Ok(direct), derived(&bytes, enc));
            }
        }
    }

    #[test]
    fn the_direct_decoder_knows_every_event_type() {
        for name in EventBody::TYPE_NAMES {
            // A payload no type accepts: the error must come from the type.
            let json = format!(r#"{{"id":"a","conversation":"c","type":"{name}","payload":true}}"#);
            let err = serde_json::from_str::<direct::Direct>(&json)
                .err()
                .expect("true is no payload")
                .to_string();
            assert!(!err.contains("unknown type"), "{name}: {err}");
        }
    }

    #[test]
    fn what_the_direct_decoder_refuses_decodes_as_before() {
        let cases = [
            // Payload first: the derived decoder buffers it.
            r#"{"payload":{"message":{"role":"user","content":"hi"}},"type":"turn_appended","id":"a","conversation":"c"}"#,
            // Unknown fields are ignored either way.
            r#"{"id":"a","conversation":"c","type":"turn_appended","extra":[1,{"x":null}],"payload":{"message":{"role":"user","content":"hi"}}}"#,
            // Errors keep the derived decoder's words.
            r#"{"id":"a","conversation":"c","type":"turn_appended"}"#,
            r#"{"id":"a","id":"b","conversation":"c","type":"turn_appended","payload":{"message":{"role":"user","content":"hi"}}}"#,
            r#"{"id":"a","conversation":"c","time":-1,"type":"turn_appended","payload":{"message":{"role":"user","content":"hi"}}}"#,
            r#"{"id":"a","conversation":"c","type":"turn_appended","payload":{"message":{"role":"robot","content":"hi"}}}"#,
            r#"[1,2]"#,
        ];
        for case in cases {
            let got = Envelope::decode(case.as_bytes(), Encoding::Json);
            match derived(case.as_bytes(), Encoding::Json) {
                Ok(want) => assert_eq!(got.unwrap(), want, "{case}"),
                Err(want) => {
                    let got = got.unwrap_err().to_string();
                    assert!(got.contains(&want), "{case}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn json_decoded_from_str_agrees_with_bytes_on_any_text() {
        // `decode` reads UTF-8 JSON as `str`; every other record goes to the
        // derived decoder. Both must give what the bytes always gave.
        let record = |content: &[u8]| {
            let mut r = br#"{"id":"a","conversation":"c","type":"turn_appended","payload":{"message":{"role":"user","content":""#.to_vec();
            r.extend_from_slice(content);
            r.extend_from_slice(br#""}}}"#);
            r
        };
        let contents: [&[u8]; 9] = [
            "café ✓ 漢字 🦀".as_bytes(),
            br"caf\u00e9 \ud83e\udd80 \n\t\\ \/",
            br"lone \ud800 surrogate",
            b"invalid \xff\xfe bytes",
            b"truncated \xe2\x9c",
            b"overlong \xc0\xaf",
            b"raw \x01 control",
            b"raw\nnewline",
            b"",
        ];
        for content in contents {
            let bytes = record(content);
            let got = Envelope::decode(&bytes, Encoding::Json);
            let shown = String::from_utf8_lossy(content);
            match derived(&bytes, Encoding::Json) {
                Ok(want) => assert_eq!(got.unwrap(), want, "{shown}"),
                Err(want) => {
                    let got = got.unwrap_err().to_string();
                    assert!(got.contains(&want), "{shown}: {got} vs {want}");
                }
            }
        }
    }

    /// A turn whose metadata holds `depth` nested arrays, in `enc`, type
    /// before payload or (`payload_first`) after it.
    fn deeply_nested(depth: usize, enc: Encoding, payload_first: bool) -> Vec<u8> {
        fn str_(out: &mut Vec<u8>, s: &str) {
            out.push(0xa0 | s.len() as u8);
            out.extend_from_slice(s.as_bytes());
        }
        let mut out = Vec::new();
        match enc {
            Encoding::Json => {
                let payload = format!(
                    r#""payload":{{"message":{{"role":"user","content":"x"}},"metadata":{{"m":{}{}}}}}"#,
                    "[".repeat(depth),
                    "]".repeat(depth)
                );
                let head = r#""id":"deep","conversation":"c","type":"turn_appended""#;
                let body = if payload_first {
                    format!("{{{payload},{head}}}")
                } else {
                    format!("{{{head},{payload}}}")
                };
                out.extend_from_slice(body.as_bytes());
            }
            Encoding::Msgpack => {
                let mut payload = vec![0x82];
                str_(&mut payload, "message");
                payload.push(0x82);
                for s in ["role", "user", "content", "x", "metadata"] {
                    str_(&mut payload, s);
                }
                payload.push(0x81);
                str_(&mut payload, "m");
                payload.extend(std::iter::repeat_n(0x91, depth));
                payload.push(0xc0);
                out.push(0x84);
                if payload_first {
                    str_(&mut out, "payload");
                    out.extend_from_slice(&payload);
                }
                for s in ["id", "deep", "conversation", "c", "type", "turn_appended"] {
                    str_(&mut out, s);
                }
                if !payload_first {
                    str_(&mut out, "payload");
                    out.extend_from_slice(&payload);
                }
            }
        }
        out
    }

    #[test]
    fn deep_nesting_is_refused_within_a_worker_stack() {
        // A tokio worker's stack: the NATS folder decodes on one.
        let run = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| {
                for enc in [Encoding::Json, Encoding::Msgpack] {
                    for payload_first in [false, true] {
                        // The deepest metadata within the limit (the
                        // envelope, payload and metadata maps are 3 more).
                        let depth = MAX_NESTING_DEPTH - 4;
                        let ok = Envelope::decode(&deeply_nested(depth, enc, payload_first), enc);
                        assert!(ok.is_ok(), "{enc} depth {depth}: {ok:?}");
                        for depth in [MAX_NESTING_DEPTH, 1_000, 100_000] {
                            let bytes = deeply_nested(depth, enc, payload_first);
                            let err = Envelope::decode(&bytes, enc).unwrap_err();
                            assert!(
                                matches!(err, DecodeError::Malformed { .. }),
                                "{enc} depth {depth}: {err}"
                            );
                        }
                    }
                }
            })
            .unwrap()
            .join();
        assert!(run.is_ok(), "decoding panicked");
    }

    #[test]
    fn every_kind_is_named_as_serde_names_it() {
        assert_eq!(EventKind::ALL.len(), EventKind::NAMES.len());
        for (&kind, &name) in EventKind::ALL.iter().zip(EventKind::NAMES) {
            assert_eq!(kind.name(), name);
            assert_eq!(name.parse::<EventKind>(), Ok(kind));
            assert_eq!(serde_json::to_value(kind).unwrap(), name);
            // The derived decoder knows the name: a payload no type accepts
            // fails on the payload, not on the type.
            let json = format!(r#"{{"id":"a","conversation":"c","type":"{name}","payload":true}}"#);
            let err = derived(json.as_bytes(), Encoding::Json).unwrap_err();
            assert!(!err.contains("unknown variant"), "{name}: {err}");
        }
    }

    #[test]
    fn agents_may_write_exactly_their_inputs() {
        let agents: Vec<&str> = EventKind::ALL
            .iter()
            .filter(|k| k.writer() == Writer::Agent)
            .map(|k| k.name())
            .collect();
        assert_eq!(
            agents,
            [
                "turn_appended",
                "provider_error_observed",
                "compaction_requested",
                "model_declared",
                "conversation_reset"
            ]
        );
        assert_eq!(
            EventKind::agent_types_listed(),
            "turn_appended, provider_error_observed, compaction_requested, model_declared and \
             conversation_reset"
        );
        for &kind in EventKind::ALL {
            assert_eq!(
                kind.family() == Family::Input,
                kind.writer() == Writer::Agent,
                "{kind}"
            );
            assert!(!kind.label().is_empty(), "{kind}");
        }
    }

    /// docs/subjects.md's "who may write it" table lists every type once,
    /// as the code's table says.
    #[test]
    fn the_docs_table_of_writers_is_the_codes() {
        let doc = include_str!("../../docs/subjects.md");
        let mut rows = doc
            .lines()
            .skip_while(|l| !l.starts_with("| event `type` | who may write it |"))
            .skip(2)
            .take_while(|l| l.starts_with('|'));
        let mut listed = Vec::new();
        for row in rows.by_ref() {
            let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
            assert_eq!(cells.len(), 2, "{row}");
            listed.push((cells[0].trim_matches('`').to_string(), cells[1].to_string()));
        }
        let want: Vec<(String, String)> = EventKind::ALL
            .iter()
            .map(|k| (k.name().to_string(), k.writer().as_str().to_string()))
            .collect();
        assert_eq!(listed, want, "docs/subjects.md against EventKind");
    }

    #[test]
    fn type_names_match_serde() {
        let json = serde_json::to_value(turn()).unwrap();
        assert_eq!(json["type"], turn().type_name());
        assert!(EventBody::TYPE_NAMES.contains(&turn().type_name()));
    }
}
