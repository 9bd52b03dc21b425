//! Per-conversation state: every turn's metadata, the summary DAG, the
//! ordered context items an agent would see now, the one pending debt,
//! sweep and spend-window bookkeeping, and rolling-state counters.
//!
//! Turns, summaries, applied ids and history are append-only vectors so the
//! state store can persist a conversation incrementally.
//!
//! # Bodies are not state held in memory
//!
//! A turn's body (the message exactly as published) is most of its bytes
//! and is read only by assembly, summarization snapshots and recall, never
//! by the fold's decisions. So a [`Turn`] holds what the fold decides on
//! (sequence, role, token counts, flags, digests of its tool-call ids) and
//! the body lives apart, read through [`TurnBodies`]: from the
//! conversation's [`ResidentBodies`] (what was folded and not yet handed to
//! a store, and what the duplicate and flood guards may still compare
//! with), from a cache, or from the state store. A state folded in memory
//! alone (tests, `eval`, what-if) simply keeps every body resident.

mod applied;
mod bodies;
mod clock;
mod context;
mod conversations;
mod history;

pub use applied::AppliedIds;
pub use bodies::{
    body_size, BodyError, GuardedTurn, Resident, ResidentBodies, ResidentTexts, TurnBodies,
    TurnBody,
};
pub use clock::PartitionClock;
pub use context::ContextWindow;
pub use conversations::Conversations;
pub use history::HistoryLog;

use crate::core::event::{Covers, Debt, RollingState, SummaryKind};
use crate::core::message::Role;
use crate::core::tokens;
use serde::{Deserialize, Serialize};
use serde_tuple::{Deserialize_tuple, Serialize_tuple};
use std::collections::{BTreeMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

pub use crate::core::spend::{Spend, SpendEntry, SpendWindow};

/// A short, fixed-size digest of an event id, for idempotency checks.
pub type IdDigest = [u8; 16];

pub fn id_digest(id: &str) -> IdDigest {
    let hash = blake3::hash(id.as_bytes());
    let mut out = [0u8; 16];
    out.copy_from_slice(&hash.as_bytes()[..16]);
    out
}

/// Hashes an [`IdDigest`] by its first eight bytes: a digest is already a
/// blake3 output, so SipHash over it again is wasted work on every event.
#[derive(Debug, Default, Clone, Copy)]
pub struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn write(&mut self, bytes: &[u8]) {
        match bytes.first_chunk::<8>() {
            Some(head) => self.0 ^= u64::from_le_bytes(*head),
            // Not a digest (nothing else is hashed here): still well defined.
            None => {
                for &b in bytes {
                    self.0 = self.0.rotate_left(8) ^ u64::from(b);
                }
            }
        }
    }
    /// The slice length prefix `[u8; 16]` hashes with carries nothing.
    fn write_usize(&mut self, _: usize) {}
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A set of event-id digests.
pub type DigestSet = HashSet<IdDigest, BuildHasherDefault<DigestHasher>>;

/// Everything a partition's folder knows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub conversations: Conversations,
    /// Events rejected before they could be attributed to a conversation.
    pub unattributed_rejections: u64,
    /// The partition's spend window across its conversations (used when a
    /// `*_global` spend limit is set).
    #[serde(default)]
    pub spend: SpendWindow,
    /// The partition's clock and the conversations waiting for it.
    #[serde(default)]
    pub clock: PartitionClock,
    /// The partition's intake quota across its conversations (used when
    /// `intake_partition_*` is set).
    #[serde(default)]
    pub intake: IntakeQuota,
}

/// One turn as folded: what the fold decides on, without its body
/// (see the module doc). Resident for every turn of every resident
/// conversation, so it is kept small: counts in 32 bits (a turn's size is
/// bounded by intake far below 4 GiB), the event id as a digest (the id
/// itself is in the body).
///
/// Stored as a list of its fields (`Serialize_tuple`): the store writes
/// every turn, and the names of these fields would be 91 more bytes of each.
/// In the positional form the state hash uses, a struct already is that list
/// (`rows_hash_as_the_derived_struct_did` checks both).
#[derive(Debug, Clone, PartialEq, Serialize_tuple, Deserialize_tuple)]
pub struct Turn {
    pub seq: u64,
    pub time: u64,
    /// [`event_digest`] of the id of the event that carried it.
    pub event: u64,
    /// Tokens of the verbatim message.
    pub tokens: u32,
    /// Tokens it costs in context (a stub when it is a large payload).
    pub context_tokens: u32,
    pub bytes: u32,
    /// Reset epoch the turn belongs to.
    pub epoch: u32,
    pub role: Role,
    /// False for duplicate user turns: recorded, kept out of context.
    pub in_context: bool,
    /// The payload exceeds `large_payload_threshold_tokens`: shown as a stub.
    pub large_payload: bool,
    /// Tokens its masked rendering ([`crate::core::mask::masked`]) costs
    /// in context, counted when it is folded; 0 when it has none shorter
    /// than the turn itself. Assembly then needs no tokenizer to weigh it.
    pub masked_tokens: u32,
    /// [`call_digest`]s of its tool-call ids: the calls an assistant turn
    /// makes, or the one call a tool turn answers. Enough for the guards
    /// and tool pairing, at 8 bytes an id instead of its text.
    pub tool_ids: Box<[u64]>,
}

/// The digest a [`Turn`] keeps of its event id: enough to find a turn by
/// its id (a candidate, confirmed by its body's id).
pub fn event_digest(id: &str) -> u64 {
    call_digest(id)
}

/// A count in a [`Turn`]: saturates (intake bounds a turn far below).
pub fn turn_count(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The digest a [`Turn`] keeps of a tool-call id: 64-bit FNV-1a, written
/// here so that it never changes under a stored state (a crate's hash may
/// change between versions), and cheap on the fold's hot path (every tool
/// turn digests its id twice). A collision within one conversation needs
/// billions of ids there, or ids crafted by the conversation's own agent
/// (whose results would then pair with the wrong call of its own turns);
/// either way every replay decides the same.
pub fn call_digest(id: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in id.as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Turn {
    /// The digests of the calls it makes (none for a tool turn).
    pub fn call_digests(&self) -> &[u64] {
        if self.role == Role::Tool {
            &[]
        } else {
            &self.tool_ids
        }
    }
    /// It makes the call whose id has this digest.
    pub fn makes_call(&self, call: u64) -> bool {
        self.call_digests().contains(&call)
    }
    /// The digest of the call it answers (tool turns only).
    pub fn result_for(&self) -> Option<u64> {
        if self.role == Role::Tool {
            self.tool_ids.first().copied()
        } else {
            None
        }
    }
    pub fn has_tool_calls(&self) -> bool {
        !self.call_digests().is_empty()
    }
}

/// The [`Turn::tool_ids`] of a message.
pub fn tool_ids_of(msg: &crate::core::message::ChatMessage) -> Box<[u64]> {
    if msg.role == Role::Tool {
        msg.tool_call_id
            .as_deref()
            .map(call_digest)
            .into_iter()
            .collect()
    } else {
        msg.tool_calls.iter().map(|c| call_digest(&c.id)).collect()
    }
}

/// A node of the summary DAG.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub id: String,
    pub kind: SummaryKind,
    pub depth: u32,
    pub covers: Covers,
    /// Oldest and newest raw turn under this summary.
    pub first_turn: u64,
    pub last_turn: u64,
    /// Tokens it costs in context: the rendered summary message
    /// ([`crate::core::assembly::summary_message`]), wrapper included.
    pub tokens: u64,
    pub source_tokens: u64,
    pub model: String,
    pub provider: String,
    pub prompt_version: String,
    pub fallback: bool,
    pub time: u64,
    pub job_id: Option<String>,
    /// The fallback summary this model summary replaced in context (a
    /// re-summarization). The link lives on the newer summary because
    /// summaries are append-only records in the state store: the replaced
    /// one is never rewritten, it only leaves the context. Skipped when
    /// absent so states without re-summarization hash and store as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supersedes: Option<String>,
}

/// One item of what the agent would see now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ContextItem {
    Turn(u64),
    /// Index into [`Conversation::summaries`].
    Summary(u32),
}

/// The job the summarizers are working on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingJob {
    pub job: crate::core::event::JobIssued,
    /// Summaries of this job accepted so far.
    pub committed: u32,
    /// The fold took a rolling session state from this job.
    #[serde(default)]
    pub rolling_refreshed: bool,
    /// When the job left: the clock when its `job_issued` came back from
    /// the log (it is given up twice its deadline after that).
    #[serde(default)]
    pub left_at: Option<u64>,
}

impl PendingJob {
    pub fn new(job: crate::core::event::JobIssued) -> Self {
        PendingJob {
            job,
            committed: 0,
            rolling_refreshed: false,
            left_at: None,
        }
    }

    /// The job changed the state: a summary or a rolling state of it was
    /// accepted. A job without progress is followed by a backoff, never by
    /// the same job again at once.
    pub fn made_progress(&self) -> bool {
        self.committed > 0 || self.rolling_refreshed
    }
}

/// A conversation's intake quota: two token buckets (events, and bytes of
/// message text) refilled on the partition's clock, so a replay admits and
/// refuses the same events. A flood from one agent is refused at the cost
/// of counting it, and its neighbours' turns, jobs and answers are not
/// held up behind it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntakeQuota {
    /// Events left, in thousandths (full when `at` is 0).
    pub events_milli: u64,
    pub bytes: u64,
    /// When the buckets were last refilled (the partition's clock).
    pub at: u64,
    /// Events refused over the quota, ever.
    pub refused: u64,
    /// Refusing now: the next refusal is counted without a record.
    pub refusing: bool,
}

impl IntakeQuota {
    /// Takes one event of `bytes` bytes at `now`; false when a bucket is
    /// short (nothing is taken then).
    pub fn take(
        &mut self,
        now: u64,
        bytes: u64,
        rates: (Option<u32>, u32, Option<u64>, u64),
    ) -> bool {
        let (events_per_s, burst_events, bytes_per_s, burst_bytes) = rates;
        let full = self.at == 0;
        let elapsed = now.saturating_sub(self.at);
        if let Some(rate) = events_per_s {
            let cap = u64::from(burst_events).saturating_mul(1000);
            self.events_milli = if full {
                cap
            } else {
                self.events_milli
                    .saturating_add(elapsed.saturating_mul(u64::from(rate)))
                    .min(cap)
            };
        }
        if let Some(rate) = bytes_per_s {
            self.bytes = if full {
                burst_bytes
            } else {
                // Bytes per millisecond, as the rate allows.
                self.bytes
                    .saturating_add(elapsed.saturating_mul(rate) / 1000)
                    .min(burst_bytes)
            };
        }
        self.at = now.max(self.at).max(1);
        let events_ok = events_per_s.is_none() || self.events_milli >= 1000;
        let bytes_ok = bytes_per_s.is_none() || self.bytes >= bytes;
        if !(events_ok && bytes_ok) {
            return false;
        }
        if events_per_s.is_some() {
            self.events_milli -= 1000;
        }
        if bytes_per_s.is_some() {
            self.bytes -= bytes;
        }
        true
    }
}

/// One line of a conversation's compaction history (for audit).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub time: u64,
    pub event_id: String,
    pub event_type: String,
    pub detail: String,
}

/// Identical turns seen in the current second (replay-flood guard): each
/// distinct turn once, with how many times it came.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FloodWindow {
    pub second: u64,
    pub counts: Vec<(SeenTurn, u32)>,
}

/// A turn the duplicate and flood guards compare later turns with. Turns
/// are identical when the digests of their normalized text are; the digest
/// is computed only when a later turn has the same sketch, a cheap value
/// identical turns always share (see `fold::turn_sketch`), itself computed
/// only once a later turn is compared with it.
///
/// Stored as a pair `[sketch, digest]`, the digest as an integer (`Of`) or
/// one 16-byte string (`Known`), not a map of field names holding a
/// one-entry map of 16 integers: every conversation head written carries
/// the lists of them (`a_known_digest_is_stored_as_sixteen_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize_tuple, Deserialize_tuple)]
pub struct SeenTurn {
    pub sketch: Option<u64>,
    pub digest: SeenDigest,
}

/// A [`SeenTurn`]'s digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeenDigest {
    /// Not computed yet: it is that of turn `seq`'s message.
    Of(u64),
    Known(IdDigest),
}

impl Serialize for SeenDigest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            SeenDigest::Of(seq) => s.serialize_u64(*seq),
            SeenDigest::Known(digest) => s.serialize_bytes(digest),
        }
    }
}

impl<'de> Deserialize<'de> for SeenDigest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<SeenDigest, D::Error> {
        struct DigestVisitor;
        impl<'de> serde::de::Visitor<'de> for DigestVisitor {
            type Value = SeenDigest;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a turn sequence number or a 16-byte digest")
            }
            fn visit_u64<E: serde::de::Error>(self, seq: u64) -> Result<SeenDigest, E> {
                Ok(SeenDigest::Of(seq))
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<SeenDigest, E> {
                let digest = IdDigest::try_from(v)
                    .map_err(|_| E::invalid_length(v.len(), &"a 16-byte digest"))?;
                Ok(SeenDigest::Known(digest))
            }
            // Formats without a byte string (JSON) write the bytes as a list.
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<SeenDigest, A::Error> {
                let mut digest = IdDigest::default();
                for (i, byte) in digest.iter_mut().enumerate() {
                    *byte = seq
                        .next_element()?
                        .ok_or_else(|| serde::de::Error::invalid_length(i, &"16 bytes"))?;
                }
                if seq.next_element::<u8>()?.is_some() {
                    return Err(serde::de::Error::invalid_length(17, &"16 bytes"));
                }
                Ok(SeenDigest::Known(digest))
            }
        }
        d.deserialize_any(DigestVisitor)
    }
}

/// One conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Conversation {
    pub key: String,
    pub model: Option<String>,
    pub context_window: Option<u64>,
    pub encoding: tokens::Encoding,
    pub epoch: u32,
    /// Append-only: every turn ever folded, by sequence number.
    pub turns: Vec<Turn>,
    /// Append-only: every summary ever accepted.
    pub summaries: Vec<Summary>,
    /// Digests of every applied event id.
    pub applied: AppliedIds,
    /// Compaction decisions and results, for `history` and audit (in a
    /// store once committed: read through [`TurnBodies::history`]).
    pub history: HistoryLog,
    /// What the agent would see now, oldest first, with its sums.
    pub context: ContextWindow,
    pub debt: Option<Debt>,
    pub pending_job: Option<PendingJob>,
    /// Jobs issued so far (job ids are derived from it).
    pub jobs_issued: u64,
    /// Compaction cycles started (one memory flush per cycle).
    pub cycle: u64,
    pub spend: SpendWindow,
    pub last_time: u64,
    pub turns_since_rolling: u64,
    pub consecutive_tool_calls: u64,
    pub rolling_due: bool,
    pub rolling: Option<RollingState>,
    pub rolling_through: Option<u64>,
    /// Tokens the rolling state costs in context (its rendered message),
    /// by the encoding it was counted with: counted once when it is
    /// folded, so assembling a context counts nothing it already knows
    /// (and a cold query need not load a tokenizer). Absent in stores
    /// written before it was kept: assembly counts it then.
    #[serde(default)]
    pub rolling_tokens: Option<(tokens::Encoding, u64)>,
    /// Recent long user turns (time, turn) for duplicate detection.
    pub recent_user_turns: Vec<(u64, SeenTurn)>,
    pub flood: FloodWindow,
    pub rejections: u64,
    /// The conversation's intake quota (its token buckets).
    #[serde(default)]
    pub quota: IntakeQuota,
    pub duplicates_dropped: u64,
    pub stale_summaries: u64,
    pub last_overflow_tokens: Option<u64>,
    /// How many summaries the conversation had when its re-summarization
    /// was given up (rounds in a row without progress: the model's
    /// summaries failed or were rejected, `fold::debt::RESUMMARY_ROUNDS`):
    /// none is owed again until a newer model summary is recorded, the
    /// next evidence that a model can do better. Skipped when absent, so
    /// other states hash and store as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resummary_given_up_at: Option<u64>,
    #[serde(skip)]
    pub bodies: ResidentBodies,
    /// Summary texts not handed to a store yet (read through
    /// [`TurnBodies::summary_text`]).
    #[serde(skip)]
    pub summary_texts: ResidentTexts,
}

impl Conversation {
    pub fn new(key: &str) -> Conversation {
        Conversation {
            key: key.to_string(),
            model: None,
            context_window: None,
            encoding: tokens::Encoding::O200kBase,
            epoch: 0,
            turns: Vec::new(),
            summaries: Vec::new(),
            applied: AppliedIds::default(),
            history: HistoryLog::default(),
            context: ContextWindow::default(),
            debt: None,
            pending_job: None,
            jobs_issued: 0,
            cycle: 0,
            spend: SpendWindow::default(),
            last_time: 0,
            turns_since_rolling: 0,
            consecutive_tool_calls: 0,
            rolling_due: false,
            rolling: None,
            rolling_through: None,
            rolling_tokens: None,
            recent_user_turns: Vec::new(),
            flood: FloodWindow::default(),
            rejections: 0,
            quota: IntakeQuota::default(),
            duplicates_dropped: 0,
            stale_summaries: 0,
            last_overflow_tokens: None,
            resummary_given_up_at: None,
            bodies: ResidentBodies::default(),
            summary_texts: ResidentTexts::default(),
        }
    }

    /// Turns whose bodies the duplicate and flood guards may read (their
    /// digests not computed yet): kept resident, reloaded with the
    /// conversation.
    pub fn guard_seqs(&self) -> impl Iterator<Item = u64> + '_ {
        self.flood
            .counts
            .iter()
            .map(|(seen, _)| seen)
            .chain(self.recent_user_turns.iter().map(|(_, seen)| seen))
            .filter_map(|seen| match seen.digest {
                SeenDigest::Of(seq) => Some(seq),
                SeenDigest::Known(_) => None,
            })
    }

    /// Drops every body from memory (once a store holds them); returns
    /// them, for a cache. The guards keep what they read of the ones they
    /// may still compare with (`read`: `fold::guard_read`).
    pub fn release_bodies(
        &mut self,
        read: impl Fn(&TurnBody) -> (u64, IdDigest),
    ) -> Vec<(u64, Arc<TurnBody>)> {
        let guarded: Vec<u64> = self.guard_seqs().collect();
        self.bodies.release(&guarded, read)
    }

    pub fn has_applied(&self, id: &str) -> bool {
        self.has_applied_digest(&id_digest(id))
    }

    pub fn has_applied_digest(&self, digest: &IdDigest) -> bool {
        self.applied.contains(digest)
    }

    /// Marks `id` applied (a no-op when it was).
    pub fn mark_applied(&mut self, id: &str) {
        self.applied.insert(id_digest(id));
    }

    /// Marks an event applied that [`Conversation::has_applied_digest`]
    /// just found not applied.
    pub fn mark_applied_digest(&mut self, digest: IdDigest) {
        self.applied.insert_new(digest);
    }

    pub fn item_tokens(&self, item: ContextItem) -> u64 {
        match item {
            ContextItem::Turn(seq) => u64::from(self.turns[seq as usize].context_tokens),
            ContextItem::Summary(i) => self.summaries[i as usize].tokens,
        }
    }

    /// The condensed summary that covers summary `id`, if any. Newest
    /// first: a re-summarized condensed summary shares its children with the
    /// fallback it replaced, and the replacement is the one in force.
    pub fn parent_of(&self, id: &str) -> Option<&Summary> {
        self.summaries.iter().rev().find(|s| matches!(&s.covers, crate::core::event::Covers::Summaries { ids } if ids.iter().any(|c| c == id)))
    }

    /// The model summary that replaced fallback summary `id` in context.
    pub fn superseded_by(&self, id: &str) -> Option<&Summary> {
        self.summaries
            .iter()
            .rev()
            .find(|s| s.supersedes.as_deref() == Some(id))
    }

    pub fn summary_index(&self, id: &str) -> Option<u32> {
        // Summaries are few relative to turns; newest are looked up most.
        self.summaries
            .iter()
            .rposition(|s| s.id == id)
            .map(|i| i as u32)
    }

    /// Tokens of the summaries in context (the summarized prefix).
    pub fn summarized_prefix_tokens(&self) -> u64 {
        self.context
            .iter()
            .filter(|i| matches!(i, ContextItem::Summary(_)))
            .map(|&i| self.item_tokens(i))
            .sum()
    }

    /// Deterministic fallback summaries in context, oldest first (what a
    /// re-summarization job replaces).
    pub fn fallback_summaries_in_context(&self) -> impl Iterator<Item = &Summary> + '_ {
        self.context.iter().filter_map(|item| match item {
            ContextItem::Summary(i) => self.summaries.get(*i as usize).filter(|s| s.fallback),
            ContextItem::Turn(_) => None,
        })
    }

    /// Summaries by depth that are in context now.
    pub fn summaries_in_context_by_depth(&self) -> BTreeMap<u32, usize> {
        let mut out = BTreeMap::new();
        for item in &self.context {
            if let ContextItem::Summary(i) = item {
                *out.entry(self.summaries[*i as usize].depth).or_insert(0) += 1;
            }
        }
        out
    }

    /// Source tokens of every raw turn (verbatim), for compression ratios.
    pub fn raw_tokens(&self) -> u64 {
        self.turns.iter().map(|t| u64::from(t.tokens)).sum()
    }

    pub fn push_history(&mut self, time: u64, event_id: &str, event_type: &str, detail: String) {
        self.history.push(HistoryEntry {
            time,
            event_id: event_id.to_string(),
            event_type: event_type.to_string(),
            detail,
        });
    }
}

/// Combines conversation hashes into a state hash: fed each
/// conversation's key and hash in key order, then the partition's own.
#[derive(Default)]
struct StateHasher(blake3::Hasher);

impl StateHasher {
    fn conversation(&mut self, key: &str, hash: &str) {
        self.0.update(key.as_bytes());
        self.0.update(hash.as_bytes());
    }
    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    fn finish(
        mut self,
        unattributed_rejections: u64,
        spend: &SpendWindow,
        clock: &PartitionClock,
        intake: &IntakeQuota,
    ) -> String {
        self.0.update(&unattributed_rejections.to_le_bytes());
        // Only when used, so states without a partition quota hash as before.
        if *intake != IntakeQuota::default() {
            self.0
                .update(&rmp_serde::to_vec(intake).expect("the quota serializes"));
        }
        // Only when used, so states without a global window hash as before.
        if *spend != SpendWindow::default() {
            self.0
                .update(&rmp_serde::to_vec(spend).expect("spend serializes"));
        }
        self.0
            .update(&rmp_serde::to_vec(clock).expect("the clock serializes"));
        self.0.finalize().to_hex()[..32].to_string()
    }
}

impl State {
    /// A stable hash of the whole state: the same events folded under the
    /// same policy give the same hash on any machine. For a state folded in
    /// memory, which holds every conversation and body; a store-backed
    /// engine hashes through its store (`Engine::state_hash`).
    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    pub fn hash(&self) -> String {
        self.hash_with(&Resident)
            .expect("a state folded in memory holds every body it folded")
    }

    pub fn hash_with(&self, bodies: &dyn TurnBodies) -> Result<String, BodyError> {
        let hashes = self
            .conversations
            .iter()
            .map(|(key, conv)| Ok((key.as_str(), conv.hash_with(bodies)?)))
            .collect::<Result<Vec<_>, BodyError>>()?;
        Ok(self.hash_of(hashes.iter().map(|(key, hash)| (*key, hash.as_str()))))
    }

    /// The state hash from every conversation's [`Conversation::hash_with`]
    /// given in key order, with this partition's own fields: for a caller
    /// that has the conversation hashes already (a report of each, a
    /// store that reads conversations one at a time).
    pub fn hash_of<'a>(
        &self,
        conversations: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> String {
        let mut hasher = StateHasher::default();
        for (key, hash) in conversations {
            hasher.conversation(key, hash);
        }
        hasher.finish(
            self.unattributed_rejections,
            &self.spend,
            &self.clock,
            &self.intake,
        )
    }
}

impl Conversation {
    /// A stable hash of this conversation's state, bodies included: its
    /// MessagePack form (field order fixed by the struct, maps are
    /// BTreeMaps, the one HashSet is skipped), then every turn's body.
    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    pub fn hash_with(&self, bodies: &dyn TurnBodies) -> Result<String, BodyError> {
        let mut hasher = blake3::Hasher::new();
        // One buffer for every encoding (a long conversation has thousands),
        // hashed as it fills (`hash_gathered`).
        let mut buf = rmp_serde::to_vec(self).expect("state serializes");
        for turn in &self.turns {
            let body = bodies.turn_body(self, turn.seq)?;
            rmp_serde::encode::write(&mut buf, &*body).expect("turns serialize");
            hash_gathered(&mut hasher, &mut buf, GATHERED_BYTES);
        }
        for index in 0..self.summaries.len() as u32 {
            let text = bodies.summary_text(self, index)?;
            rmp_serde::encode::write(&mut buf, &*text).expect("texts serialize");
            hash_gathered(&mut hasher, &mut buf, GATHERED_BYTES);
        }
        hasher.update(&buf);
        Ok(hasher.finalize().to_hex()[..32].to_string())
    }

    /// [`Conversation::hash_with`] the bodies it holds (folded in memory).
    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    pub fn hash(&self) -> String {
        self.hash_with(&Resident)
            .expect("a conversation folded in memory holds every body it folded")
    }
}

/// Bytes of encodings [`Conversation::hash_with`] gathers before hashing
/// them: BLAKE3 hashes 1 KiB chunks side by side (SIMD) only when one
/// update holds many, and a turn's body is a chunk or two.
const GATHERED_BYTES: usize = 64 * 1024;

/// Hashes what `buf` gathered, and empties it, once it holds `at` bytes or
/// more. A BLAKE3 digest is the same however its bytes are split between
/// updates.
fn hash_gathered(hasher: &mut blake3::Hasher, buf: &mut Vec<u8>, at: usize) {
    if buf.len() >= at {
        hasher.update(buf);
        buf.clear();
    }
}

/// The content address of a summary: the same summary of the same sources
/// by the same prompt always has the same id.
pub fn summary_id(
    conversation: &str,
    kind: SummaryKind,
    depth: u32,
    covers: &Covers,
    content: &str,
    prompt_version: &str,
) -> String {
    let mut h = blake3::Hasher::new();
    h.update(conversation.as_bytes());
    h.update(&[0, kind as u8]);
    h.update(&depth.to_le_bytes());
    match covers {
        Covers::Turns { first, last } => {
            h.update(b"turns");
            h.update(&first.to_le_bytes());
            h.update(&last.to_le_bytes());
        }
        Covers::Summaries { ids } => {
            h.update(b"summaries");
            for id in ids {
                h.update(id.as_bytes());
                h.update(&[0]);
            }
        }
    }
    h.update(prompt_version.as_bytes());
    h.update(&[0]);
    h.update(content.as_bytes());
    format!("sum_{}", &h.finalize().to_hex()[..24])
}

/// A deterministic id for an event the fold derives from `cause`.
pub fn derived_event_id(cause: &str, what: &str) -> String {
    crate::core::derived_id::DerivedId::Decision {
        cause,
        event_type: what,
    }
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen() -> Vec<SeenTurn> {
        vec![
            SeenTurn {
                sketch: None,
                digest: SeenDigest::Of(7),
            },
            SeenTurn {
                sketch: Some(u64::MAX),
                digest: SeenDigest::Known([0xa5; 16]),
            },
            SeenTurn {
                sketch: Some(0),
                digest: SeenDigest::Of(u64::MAX),
            },
        ]
    }

    fn turn() -> Turn {
        Turn {
            seq: 3,
            time: 1_700_000_000_000,
            event: event_digest("e3"),
            tokens: 12,
            context_tokens: 5,
            bytes: 40,
            epoch: 2,
            role: Role::Tool,
            in_context: false,
            large_payload: true,
            masked_tokens: 0,
            tool_ids: Box::new([call_digest("call_1")]),
        }
    }

    /// A conversation's hash is BLAKE3 over its encoding and then every
    /// body's, whatever sizes `hash_with` gathers them in: checked across
    /// flush points against each piece hashed on its own.
    #[test]
    fn gathered_encodings_hash_as_one_stream() {
        let pieces: Vec<Vec<u8>> = (0..300usize)
            .map(|i| vec![(i % 251) as u8; 1 + (i * 37) % 2_000])
            .collect();
        let mut one_by_one = blake3::Hasher::new();
        for piece in &pieces {
            one_by_one.update(piece);
        }
        for at in [1, 1_000, 4_096, GATHERED_BYTES] {
            let mut hasher = blake3::Hasher::new();
            let mut buf = Vec::new();
            for piece in &pieces {
                buf.extend_from_slice(piece);
                hash_gathered(&mut hasher, &mut buf, at);
            }
            hasher.update(&buf);
            assert_eq!(hasher.finalize(), one_by_one.finalize(), "gathered by {at}");
        }
    }

    #[test]
    fn a_turn_round_trips_as_a_row() {
        let t = turn();
        let named = rmp_serde::to_vec_named(&t).unwrap();
        assert_eq!(rmp_serde::from_slice::<Turn>(&named).unwrap(), t);
        // A list of twelve fields, not a map of their names.
        assert_eq!(named[0], 0x9c);
        assert!(!named.windows(7).any(|w| w == b"in_cont"));
        let positional = rmp_serde::to_vec(&t).unwrap();
        assert_eq!(rmp_serde::from_slice::<Turn>(&positional).unwrap(), t);
    }

    /// What `#[derive(Serialize)]` would write.
    #[derive(Serialize)]
    struct DerivedTurn<'a> {
        seq: u64,
        time: u64,
        event: u64,
        tokens: u32,
        context_tokens: u32,
        bytes: u32,
        epoch: u32,
        role: Role,
        in_context: bool,
        large_payload: bool,
        masked_tokens: u32,
        tool_ids: &'a [u64],
    }

    #[test]
    fn rows_hash_as_the_derived_struct_did() {
        let t = turn();
        let derived = DerivedTurn {
            seq: t.seq,
            time: t.time,
            event: t.event,
            tokens: t.tokens,
            context_tokens: t.context_tokens,
            bytes: t.bytes,
            epoch: t.epoch,
            role: t.role,
            in_context: t.in_context,
            large_payload: t.large_payload,
            masked_tokens: t.masked_tokens,
            tool_ids: &t.tool_ids,
        };
        assert_eq!(
            rmp_serde::to_vec(&t).unwrap(),
            rmp_serde::to_vec(&derived).unwrap()
        );
        let (named, row) = (
            rmp_serde::to_vec_named(&derived).unwrap().len(),
            rmp_serde::to_vec_named(&t).unwrap().len(),
        );
        assert_eq!(named - row, 102, "named {named}, row {row}");
    }

    #[test]
    fn seen_turns_round_trip_in_every_encoding() {
        let turns = seen();
        let named = rmp_serde::to_vec_named(&turns).unwrap();
        assert_eq!(
            rmp_serde::from_slice::<Vec<SeenTurn>>(&named).unwrap(),
            turns
        );
        let positional = rmp_serde::to_vec(&turns).unwrap();
        assert_eq!(
            rmp_serde::from_slice::<Vec<SeenTurn>>(&positional).unwrap(),
            turns
        );
        let json = serde_json::to_string(&turns).unwrap();
        assert_eq!(serde_json::from_str::<Vec<SeenTurn>>(&json).unwrap(), turns);
    }

    #[test]
    fn a_known_digest_is_stored_as_sixteen_bytes() {
        let known = SeenTurn {
            sketch: Some(1),
            digest: SeenDigest::Known([9; 16]),
        };
        // fixarray(2), positive fixint 1, bin8 of 16 bytes.
        let mut expected = vec![0x92, 0x01, 0xc4, 16];
        expected.extend([9; 16]);
        assert_eq!(rmp_serde::to_vec_named(&known).unwrap(), expected);
    }

    #[test]
    fn a_digest_of_another_length_is_an_error() {
        let bad = rmp_serde::to_vec(&(Some(1u64), serde_bytes_of(&[1, 2, 3]))).unwrap();
        let err = rmp_serde::from_slice::<SeenTurn>(&bad).unwrap_err();
        assert!(err.to_string().contains("16-byte digest"), "{err}");
    }

    /// Three bytes as a msgpack byte string.
    fn serde_bytes_of(bytes: &[u8]) -> impl Serialize + '_ {
        struct Bytes<'a>(&'a [u8]);
        impl Serialize for Bytes<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(self.0)
            }
        }
        Bytes(bytes)
    }
}
