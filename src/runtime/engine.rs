//! The engine: takes log records in through intake (decoded once, bounded,
//! checked against the origin and subject the log vouches for), folds them
//! into state, tracks which conversations changed and commits them with the
//! log position atomically. It returns what folding produced as
//! [`Effects`]: the decisions to append to the log, the snapshots of the
//! jobs to hand to summarizers and the records to dead-letter. The embedded
//! pipeline and the NATS folder both drive one engine per partition and
//! only carry its effects out.
//!
//! # Replaying history that already has effects
//!
//! A process that folds records the log already holds beyond its store
//! (a new owner of a partition whose store is behind, a fresh `serve` on
//! an existing stream) derives decisions whose copies, published by the
//! process that folded them first, may follow in the log. Publishing them
//! again would store them twice and put finished jobs back on the work
//! queue. So the runtime names the log's head when it starts
//! ([`Engine::hold_through`]): decisions derived from records up to there
//! are held back; each one whose copy the log then shows is dropped; what
//! is left when the head is reached (decisions that a crash kept from the
//! log) is released, and only then are jobs snapshotted, for the jobs still
//! pending. While decisions are held the state is not committed, so a crash
//! loses nothing: the next open replays the same records again.
//!
//! # Memory follows the working set
//!
//! Opening reads the position and the partition's counts, no conversation.
//! A conversation is loaded from the store the first time a record
//! touches it ([`Engine::ensure_resident`]); after a commit, conversations
//! beyond [`Residency::conversations`] (least recently touched first) or
//! idle for [`Residency::idle`] are dropped from memory, their state on
//! disk. Loading one again gives exactly the conversation that was
//! dropped, so eviction never changes what is folded (the fold properties
//! test folds with random evictions). Turn bodies leave memory at commit,
//! into the store's bounded body cache.

use crate::core::derived_id::DerivedId;
use crate::core::event::{self, Encoding, Envelope, EventBody};
use crate::core::fold::{self, FoldStatus};
use crate::core::intake::{self, Refused};
use crate::core::measure::TurnMeasure;
use crate::core::policy::PolicyConfig;
use crate::core::state::State;
use crate::core::sweep::{self, SweepSnapshot};
use crate::log::{LogRecord, Position};
use crate::runtime::read_ahead::{Readings, WithReadings};
use crate::store::state_store::{PreparedCommit, StateStore, StoredBodies};
use crate::store::{KvBackend, StoreError};
use crate::telemetry as t;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// What folding records produced, for the runtime to carry out.
#[derive(Debug, Default)]
pub struct Effects {
    /// Decisions to append to the log, in order.
    pub decisions: Vec<Envelope>,
    /// Jobs still pending once their decisions are appended.
    pub jobs: Vec<SweepSnapshot>,
    /// Jobs the log shows pending when its history ended (or a runtime
    /// asked: [`Engine::requeue_pending`]): their work items may never have
    /// reached the queue. A runtime hands each out again unless its queue
    /// still holds it.
    pub requeued: Vec<SweepSnapshot>,
    /// Records refused with no conversation to count them against.
    pub dead_letters: Vec<DeadLetter>,
}

impl Effects {
    pub fn is_empty(&self) -> bool {
        self.decisions.is_empty()
            && self.jobs.is_empty()
            && self.requeued.is_empty()
            && self.dead_letters.is_empty()
    }
}

/// A record the partition refused without a conversation to record the
/// rejection in (its subject named none, or it named none a subject could
/// vouch for): kept, with its reason, where an operator looks.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    pub position: Position,
    /// [`intake::Refusal::kind`].
    pub kind: &'static str,
    pub reason: String,
    pub encoding: Encoding,
    pub bytes: bytes::Bytes,
}

/// Decisions derived from history, held until the log's head is reached.
#[derive(Debug, Default)]
struct Held {
    /// Records up to here are history.
    through: Position,
    decisions: Vec<Envelope>,
    /// Ids of the held decisions not seen in the log yet.
    ids: HashSet<String>,
}

/// How many conversations an engine keeps in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Residency {
    /// At most this many resident after a commit (the least recently
    /// touched go first).
    pub conversations: usize,
    /// Conversations untouched this long are dropped at the next commit.
    pub idle: Duration,
}

impl Default for Residency {
    fn default() -> Self {
        Residency {
            conversations: 10_000,
            idle: Duration::from_secs(600),
        }
    }
}

impl crate::store::StoreConfig {
    /// What the engine keeps in memory (here, beside [`Residency`]: the
    /// store's configuration is below the runtime).
    pub fn residency(&self) -> Residency {
        Residency {
            conversations: self.resident_conversations,
            idle: std::time::Duration::from_millis(self.conversation_idle_ms),
        }
    }
}

/// A commit encoded and not yet written ([`Engine::prepare_commit`]),
/// with the position it was encoded at and the time encoding took;
/// nothing (`None`) while the engine holds.
#[must_use = "an encoded commit writes nothing until it is applied"]
pub struct EncodedCommit(Option<(PreparedCommit, Position, std::time::Duration)>);

pub struct Engine<B: KvBackend> {
    /// The partition's counts and its resident conversations (the others
    /// are in the store: [`Engine::ensure_resident`]).
    pub state: State,
    pub policy: PolicyConfig,
    store: StateStore<B>,
    position: Position,
    dirty: BTreeSet<String>,
    /// The partition's own counts changed (a dead letter).
    dirty_partition: bool,
    held: Held,
    /// The policy this process was configured with (what it records when
    /// the log's differs), and whether it has asked to record it.
    configured: PolicyConfig,
    configured_fingerprint: String,
    announced: bool,
    /// The fingerprint of [`Engine::policy`] and whether the log recorded it.
    active: ActivePolicy,
    /// Where partition-wide events are addressed ([`event::partition_key`]);
    /// an engine that is not told records no policy (replays, tests).
    partition_key: Option<String>,
    /// Who this process is, in the policy events it records.
    recorder: String,
    residency: Residency,
    /// When each resident conversation was last touched (the runtime's
    /// clock: eviction is outside the fold and never changes it).
    touched: HashMap<String, Instant>,
    /// The time records are touched at: read once per commit, not once per
    /// record (idle eviction counts in minutes; a batch is milliseconds).
    clock: Instant,
    /// What the fold did since the last [`Engine::finish`] (emitted there).
    tally: t::FoldTally,
    /// Jobs the fold issued since the last [`Engine::finish`], as
    /// (conversation, job id).
    issued: Vec<(String, String)>,
    /// Hand out every pending job at the next [`Engine::finish`].
    requeue_pending: bool,
    /// Folding history ([`Engine::hold_through`]) that has not ended yet.
    in_history: bool,
    /// Turns measured ahead of the fold, by log position, oldest first
    /// ([`Engine::measured_ahead`]).
    ahead: VecDeque<(Position, TurnMeasure)>,
    /// Turns read ahead of their drafts, by event id (the measures' readings).
    readings: Readings,
}

/// The layout of the stored state. Raise it when a state record changes
/// shape: a store written by another layout is then rebuilt from the log,
/// so its state (and hash) is always the one a clean replay gives.
/// 2: the duplicate and flood guards keep sketches of the turns they saw.
/// 3: one chunk record per conversation per commit, not one per item.
/// 4: the context list lives in the chunks, not in the head.
/// 5: seen turns are pairs, their digests byte strings.
/// 6: turns are rows of their fields, not maps of their names.
/// 7: records pass intake (origins, bounds, subject attribution).
/// 8: chunk keys escape 0 bytes of conversation keys.
/// 9: turn bodies are records of their own; turns keep tool-call digests.
/// 10: turns keep 32-bit counts and an event-id digest (the id is in the
///     body); applied ids are hashed sorted; history entries and summary
///     texts stay in the store (the head keeps the history's count and
///     digest).
/// 11: the layout and the policy are apart in the store's meta, which
///     keeps the policy in force (the log records it: `policy_recorded`).
/// 12: the head keeps the context's sums as one `ContextWindow`.
/// 13: the partition's clock and timers (`PartitionClock`); spend windows
///     count no-progress rounds and urgent spend; no `awaiting_input`.
/// 14: turns keep what their masked rendering costs (`masked_tokens`).
/// 15: turn bodies are stored in runs, one or a few records per
///     conversation per commit (`store::body_runs`), not one per body.
pub const STATE_LAYOUT: u32 = 15;

/// What the store records of its layout: a store of another layout is
/// rebuilt from the log by a process that folds, and refused by a reader.
pub fn layout_fingerprint() -> String {
    format!("layout-{STATE_LAYOUT}")
}

/// A fingerprint of a policy (its every field): what `policy_recorded`
/// events, member records and `doctor` compare.
#[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
pub fn policy_fingerprint(policy: &PolicyConfig) -> String {
    let bytes = rmp_serde::to_vec(policy).expect("policy serializes");
    blake3::hash(&bytes).to_hex()[..16].to_string()
}

/// The policy in force and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct ActivePolicy {
    pub fingerprint: String,
    /// Whether the log recorded it (else: the configured policy, folding a
    /// log that has recorded none so far).
    pub recorded: bool,
}

impl<B: KvBackend> Engine<B> {
    /// Opens the engine on a store; the caller replays the log after
    /// [`Engine::position`].
    pub fn open(backend: B, policy: PolicyConfig) -> Result<Self, StoreError> {
        Self::open_with(StateStore::new(backend), policy)
    }

    /// [`Engine::open`] on a store set up by the caller (its body cache).
    ///
    /// `policy` is the configured one: the engine folds under the policy
    /// the store recorded as in force (the last `policy_recorded` it
    /// folded), or under `policy` when the log has recorded none yet; it
    /// asks to record `policy` (a `policy_recorded` decision) once its
    /// history is folded, if that differs ([`Engine::finish`]).
    pub fn open_with(mut store: StateStore<B>, policy: PolicyConfig) -> Result<Self, StoreError> {
        let opened = store.open(&layout_fingerprint())?;
        Ok(Self::from_opened(store, opened, policy))
    }

    fn from_opened(
        mut store: StateStore<B>,
        opened: crate::store::state_store::Opened,
        configured: PolicyConfig,
    ) -> Self {
        let configured_fingerprint = policy_fingerprint(&configured);
        let (policy, active) = match opened.policy {
            Some(recorded) => {
                let fingerprint = policy_fingerprint(&recorded);
                (
                    recorded,
                    ActivePolicy {
                        fingerprint,
                        recorded: true,
                    },
                )
            }
            None => (
                configured.clone(),
                ActivePolicy {
                    fingerprint: configured_fingerprint.clone(),
                    recorded: false,
                },
            ),
        };
        store.set_policy(&active.fingerprint, active.recorded.then_some(&policy));
        Engine {
            state: opened.state,
            policy,
            store,
            position: opened.position,
            dirty: BTreeSet::new(),
            dirty_partition: false,
            configured,
            configured_fingerprint,
            announced: false,
            active,
            partition_key: None,
            recorder: String::new(),
            held: Held::default(),
            residency: Residency::default(),
            touched: HashMap::new(),
            clock: Instant::now(),
            tally: t::FoldTally::default(),
            issued: Vec::new(),
            requeue_pending: false,
            in_history: false,
            ahead: VecDeque::new(),
            readings: Readings::default(),
        }
    }

    /// Opens the engine on a store for reading only: a store of another
    /// layout is an error ([`StoreError::OtherLayout`]), never cleared, and
    /// nothing is written (commit only what a reader never changes).
    pub fn open_read_only(
        mut store: StateStore<B>,
        policy: PolicyConfig,
    ) -> Result<Self, StoreError> {
        let opened = store.open_read_only(&layout_fingerprint())?;
        Ok(Self::from_opened(store, opened, policy))
    }

    /// The policy in force ([`Engine::policy`]) and whether the log
    /// recorded it.
    pub fn active_policy(&self) -> &ActivePolicy {
        &self.active
    }

    /// The fingerprint of the configured policy.
    pub fn configured_fingerprint(&self) -> &str {
        &self.configured_fingerprint
    }

    /// Makes this engine record its configured policy in the log (a
    /// `policy_recorded` decision, once its history is folded, when the
    /// policy in force differs), addressed to `key` (its partition's
    /// [`event::partition_key`]) and signed `recorder`. A runtime that
    /// folds live calls it; replays and tests do not.
    pub fn record_policy_as(&mut self, key: String, recorder: impl Into<String>) {
        self.partition_key = Some(key);
        self.recorder = recorder.into();
    }

    /// Whether [`Engine::record_policy_as`] was called.
    pub fn records_policy(&self) -> bool {
        self.partition_key.is_some()
    }

    /// The key partition-wide events of this engine's partition are
    /// addressed to, and who records them ([`Engine::record_policy_as`]).
    pub fn partition_key(&self) -> Option<(&str, &str)> {
        self.partition_key
            .as_deref()
            .map(|key| (key, self.recorder.as_str()))
    }

    /// Folds a `policy_recorded`: every later record is folded under it.
    /// Partition-wide: no conversation is touched. A policy recorded by
    /// another process after this one recorded its own means two
    /// processes fold the partition under different policies: reported.
    fn policy_recorded(&mut self, id: &str, recorded: event::PolicyRecorded) {
        let fingerprint = policy_fingerprint(&recorded.policy);
        if fingerprint != recorded.fingerprint {
            tracing::warn!(
                event_id = id,
                stated = %recorded.fingerprint,
                computed = %fingerprint,
                "policy_recorded states another fingerprint than its policy has; folding under its policy"
            );
        }
        if self.announced
            && fingerprint != self.configured_fingerprint
            && fingerprint != self.active.fingerprint
        {
            t::PolicyConflict {
                event_id: id,
                ours: &self.configured_fingerprint,
                recorded: &fingerprint,
                recorded_by: recorded.recorded_by.as_deref().unwrap_or(""),
            }
            .emit();
        }
        self.policy = *recorded.policy;
        self.active = ActivePolicy {
            fingerprint,
            recorded: true,
        };
        self.store
            .set_policy(&self.active.fingerprint, Some(&self.policy));
        // Not counted among the events folded: it is no conversation's.
        self.dirty_partition = true;
    }

    /// The `policy_recorded` to append when the configured policy is not
    /// the one in force once history is folded (given once per engine;
    /// [`Engine::finish`] gives it when history ends within a batch). A
    /// runtime calls it before folding live records, so nothing is folded
    /// under a policy the log does not say.
    pub fn announce_policy(&mut self) -> Option<Envelope> {
        if self.announced || self.holding() {
            return None;
        }
        let key = self.partition_key.clone()?;
        self.announced = true;
        if self.active.recorded && self.active.fingerprint == self.configured_fingerprint {
            return None;
        }
        let previous = self
            .active
            .recorded
            .then(|| self.active.fingerprint.clone());
        let time = self
            .state
            .conversations
            .values()
            .map(|c| c.last_time)
            .max()
            .unwrap_or(0);
        Some(Envelope::new(
            DerivedId::PolicyRecorded {
                partition_key: &key,
                fingerprint: &self.configured_fingerprint,
                position: self.position,
            }
            .to_string(),
            key,
            time,
            EventBody::PolicyRecorded(event::PolicyRecorded {
                fingerprint: self.configured_fingerprint.clone(),
                previous,
                recorded_by: Some(self.recorder.clone()),
                policy: Box::new(self.configured.clone()),
            }),
        ))
    }

    pub fn set_residency(&mut self, residency: Residency) {
        self.residency = residency;
    }

    /// Loads `key` from the store unless it is resident (or new), and notes
    /// it as touched now.
    pub fn ensure_resident(&mut self, key: &str) -> Result<(), StoreError> {
        let now = self.clock;
        match self.touched.get_mut(key) {
            Some(at) => *at = now,
            None => {
                self.touched.insert(key.to_string(), now);
            }
        }
        if self.state.conversations.contains_key(key) || self.store.knows(key) {
            return Ok(());
        }
        if let Some(conv) = self.store.load_conversation(key)? {
            self.state.conversations.insert(key.to_string(), conv);
        }
        Ok(())
    }

    /// Drops committed conversations from memory: those idle too long,
    /// then the least recently touched beyond the limit. Never while
    /// decisions are held (nothing is committed then).
    fn evict(&mut self) {
        self.clock = Instant::now();
        if self.holding() || !self.dirty.is_empty() {
            return;
        }
        let now = self.clock;
        let idle = self.residency.idle;
        let mut gone: Vec<String> = self
            .touched
            .iter()
            .filter(|(_, at)| now.duration_since(**at) >= idle)
            .map(|(k, _)| k.clone())
            .collect();
        let over = self
            .touched
            .len()
            .saturating_sub(gone.len())
            .saturating_sub(self.residency.conversations);
        if over > 0 {
            let mut by_age: Vec<(&String, &Instant)> = self
                .touched
                .iter()
                .filter(|(_, at)| now.duration_since(**at) < idle)
                .collect();
            by_age.sort_by_key(|(_, at)| **at);
            gone.extend(by_age.into_iter().take(over).map(|(k, _)| k.clone()));
        }
        for key in gone {
            self.evict_one(&key);
        }
    }

    fn evict_one(&mut self, key: &str) {
        self.touched.remove(key);
        self.state.conversations.remove(key);
        self.store.forget(key);
    }

    /// Drops every committed conversation from memory (tests, and a
    /// process handing a partition over).
    pub fn evict_all(&mut self) {
        if self.holding() || !self.dirty.is_empty() {
            return;
        }
        let keys: Vec<String> = self.state.conversations.keys().cloned().collect();
        for key in keys {
            self.evict_one(&key);
        }
        self.touched.clear();
    }

    /// Conversations in memory now.
    pub fn resident(&self) -> usize {
        self.state.conversations.len()
    }

    /// Runs `f` over a state holding conversation `key` (resident, or
    /// read from the store for this call without making it resident) and
    /// the bodies to read with it. `None` when there is no such
    /// conversation.
    pub fn with_conversation<R>(
        &self,
        key: &str,
        f: impl FnOnce(&State, &dyn crate::core::state::TurnBodies) -> R,
    ) -> Result<R, StoreError> {
        let bodies = self.store.bodies();
        if self.state.conversations.contains_key(key) {
            return Ok(f(&self.state, &bodies));
        }
        let mut state = State {
            conversations: Default::default(),
            unattributed_rejections: self.state.unattributed_rejections,
            spend: self.state.spend.clone(),
            clock: self.state.clock.clone(),
            intake: self.state.intake.clone(),
        };
        // Not resident: what the store committed is the conversation.
        if let Some(conv) = self.store.read_conversation(key)? {
            state.conversations.insert(key.to_string(), conv);
        }
        Ok(f(&state, &bodies))
    }

    /// Calls `f` with every conversation, resident or stored, one at a
    /// time, in key order.
    pub fn each_conversation<E: From<StoreError>>(
        &self,
        mut f: impl FnMut(&State, &crate::core::state::Conversation) -> Result<(), E>,
    ) -> Result<(), E> {
        for key in self.store.keys_with(&self.state)? {
            if let Some(conv) = self.store.resident_or_stored(&self.state, &key)? {
                f(&self.state, &conv)?;
            }
        }
        Ok(())
    }

    /// Every conversation, resident or stored, given to `f` with the bodies
    /// to read it by, on up to `threads` threads (each takes the next
    /// conversation in key order, reading a stored one only then): `f`'s
    /// results in key order, or the first error (the other threads stop
    /// at their next conversation). For a report over every conversation,
    /// whose bodies are read back and hashed, on cores otherwise idle at
    /// the end of a run.
    pub fn map_conversations<T: Send, E: From<StoreError> + Send>(
        &self,
        threads: usize,
        f: impl Fn(&crate::core::state::Conversation, &StoredBodies<'_, B>) -> Result<T, E> + Sync,
    ) -> Result<Vec<T>, E>
    where
        B: Sync,
    {
        let keys: Vec<String> = self.store.keys_with(&self.state)?.into_iter().collect();
        let next = AtomicUsize::new(0);
        let (store, state) = (&self.store, &self.state);
        let take_each = || -> Result<Vec<(usize, T)>, E> {
            let bodies = store.bodies();
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(key) = keys.get(i) else {
                    return Ok(out);
                };
                if let Some(conv) = store.resident_or_stored(state, key)? {
                    out.push((i, f(&conv, &bodies)?));
                }
            }
        };
        let work = || {
            let taken = take_each();
            if taken.is_err() {
                // The other threads stop at their next conversation.
                next.store(keys.len(), Ordering::Relaxed);
            }
            taken
        };
        let mut all = std::thread::scope(|scope| {
            let helpers: Vec<_> = (1..threads.max(1).min(keys.len()))
                .map(|_| scope.spawn(work))
                .collect();
            let mut all = work()?;
            for helper in helpers {
                // A helper panics only on a bug: carried to this thread.
                let part = helper
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
                all.extend(part);
            }
            Ok::<_, E>(all)
        })?;
        all.sort_unstable_by_key(|(i, _)| *i);
        Ok(all.into_iter().map(|(_, t)| t).collect())
    }

    /// Snapshots of every conversation's pending job (what a runner that
    /// stopped left undone), read through the store's index of them: no
    /// other conversation is read.
    pub fn pending_snapshots(&mut self) -> Result<Vec<SweepSnapshot>, StoreError> {
        let mut keys: BTreeSet<String> = self.store.pending_conversations().clone();
        keys.extend(
            self.state
                .conversations
                .iter()
                .filter(|(_, c)| c.pending_job.is_some())
                .map(|(k, _)| k.clone()),
        );
        let mut out = Vec::new();
        for key in keys {
            self.ensure_resident(&key)?;
            let Some(conv) = self.state.conversations.get(&key) else {
                continue;
            };
            let Some(pending) = &conv.pending_job else {
                continue;
            };
            out.push(sweep::snapshot_from(
                conv,
                &WithReadings {
                    bodies: self.store.bodies(),
                    readings: &self.readings,
                },
                &pending.job,
                &self.policy,
            )?);
        }
        Ok(out)
    }

    /// The whole state in memory, every conversation and turn body
    /// resident: what folding the same log in memory gives (its
    /// [`State::hash`] is [`Engine::state_hash`]). It reads everything:
    /// for tests and small tools, not for a service.
    pub fn materialized(&self) -> Result<State, StoreError> {
        let mut state = State {
            conversations: Default::default(),
            unattributed_rejections: self.state.unattributed_rejections,
            spend: self.state.spend.clone(),
            clock: self.state.clock.clone(),
            intake: self.state.intake.clone(),
        };
        self.each_conversation(|_, conv| -> Result<(), StoreError> {
            state
                .conversations
                .insert(conv.key.clone(), self.with_every_body(conv)?);
            Ok(())
        })?;
        Ok(state)
    }

    /// A copy of `conv` holding every one of its turns' bodies.
    fn with_every_body(
        &self,
        conv: &crate::core::state::Conversation,
    ) -> Result<crate::core::state::Conversation, StoreError> {
        let bodies = self.store.bodies();
        let mut full = conv.clone();
        for seq in 0..conv.turns.len() as u64 {
            full.bodies.insert(
                seq,
                crate::core::state::TurnBodies::turn_body(&bodies, conv, seq)?,
            );
        }
        full.summary_texts = Default::default();
        for index in 0..conv.summaries.len() as u32 {
            let text = crate::core::state::TurnBodies::summary_text(&bodies, conv, index)?;
            full.summary_texts.push(index, text);
        }
        let history = crate::core::state::TurnBodies::history(&bodies, conv)?;
        full.history = crate::core::state::HistoryLog::from_entries(history);
        Ok(full)
    }

    /// One conversation with every body resident (see
    /// [`Engine::materialized`]).
    pub fn materialized_conversation(
        &self,
        key: &str,
    ) -> Result<Option<crate::core::state::Conversation>, StoreError> {
        match self.state.conversations.get(key) {
            Some(conv) => self.with_every_body(conv).map(Some),
            None => match self.store.read_conversation(key)? {
                Some(conv) => self.with_every_body(&conv).map(Some),
                None => Ok(None),
            },
        }
    }

    /// Where this engine's turn bodies are read.
    pub fn bodies(&self) -> crate::store::state_store::StoredBodies<'_, B> {
        self.store.bodies()
    }

    /// The hash of the whole state, stored conversations included: what
    /// [`State::hash`] gives for the same log folded in memory.
    pub fn state_hash(&self) -> Result<String, StoreError> {
        self.store.state_hash(&self.state)
    }

    /// Position of the last record folded.
    pub fn position(&self) -> Position {
        self.position
    }

    pub fn set_flush_every(&mut self, n: u32) {
        self.store.flush_every = n.max(1);
    }

    /// Records up to `head` are history whose effects may already be in the
    /// log: their decisions are held back (see the module doc).
    pub fn hold_through(&mut self, head: Position) {
        if head > self.position {
            self.held.through = self.held.through.max(head);
            self.in_history = true;
        }
    }

    /// The log has nothing more to deliver now: history ends here, and
    /// the next [`Engine::finish`] releases what is still held (decisions
    /// whose copies the log does not have).
    pub fn end_history(&mut self) {
        self.held.through = self.held.through.min(self.position);
    }

    /// Whether decisions derived from history are held back right now.
    pub fn holding(&self) -> bool {
        self.held.through > self.position || !self.held.decisions.is_empty()
    }

    /// Folds the records after [`Engine::position`] (earlier ones are
    /// redeliveries and skipped) and returns their effects.
    pub fn apply_batch(
        &mut self,
        records: impl IntoIterator<Item = LogRecord>,
    ) -> Result<Effects, StoreError> {
        let mut effects = Effects::default();
        for record in records {
            self.apply_record(&record, &mut effects)?;
        }
        self.finish(&mut effects)?;
        Ok(effects)
    }

    /// [`Engine::apply_batch`] of one record.
    pub fn apply(&mut self, record: &LogRecord) -> Result<Effects, StoreError> {
        let mut effects = Effects::default();
        self.apply_record(record, &mut effects)?;
        self.finish(&mut effects)?;
        Ok(effects)
    }

    /// Folds one record into `effects` (without snapshotting jobs: see
    /// [`Engine::finish`]); returns the id of the event it folded, if it
    /// was admitted. Fails only when the store cannot give the state of
    /// the record's conversation (nothing is folded then).
    pub fn apply_record(
        &mut self,
        record: &LogRecord,
        effects: &mut Effects,
    ) -> Result<Option<String>, StoreError> {
        if record.position <= self.position {
            return Ok(None);
        }
        // Admitted ahead (decoded on the measuring core) or here.
        let mut measured = self.take_measure(record.position);
        let arrival = record.arrival();
        let ahead = measured
            .as_mut()
            .and_then(|m| m.admitted.take())
            .and_then(|ahead| ahead.for_arrival(&arrival));
        let admitted = match ahead {
            Some(admitted) => Ok(admitted),
            None => intake::admit(arrival),
        };
        let conversation = match &admitted {
            Ok(a) => Some(a.event.conversation.as_str()),
            Err(refused) => refused.conversation.as_deref(),
        };
        if let Some(key) = conversation {
            self.ensure_resident(key)?;
        }
        // The record's time, as the log vouches for it (the event's own
        // when the log stores none): the conversations it makes due are
        // woken before it is folded, so they must be in memory.
        let time = record
            .stored_at_ms
            .or_else(|| admitted.as_ref().ok().map(|a| a.event.time))
            .unwrap_or(self.state.clock.now);
        self.load_due(time)?;
        self.position = record.position;
        let history = self.position <= self.held.through;
        let decisions_before = effects.decisions.len();
        let folded = match admitted {
            Ok(intake::Admitted {
                event:
                    Envelope {
                        id,
                        body: EventBody::PolicyRecorded(recorded),
                        ..
                    },
                ..
            }) => {
                let woke = fold::wake(&mut self.state, &self.policy, time, &id);
                self.woke(woke, effects);
                self.policy_recorded(&id, recorded);
                Some(id)
            }
            Ok(intake::Admitted {
                event:
                    Envelope {
                        id,
                        body: EventBody::ClockTicked(_),
                        ..
                    },
                ..
            }) => {
                // Partition-wide: it moves the clock, and what that wakes.
                let woke = fold::wake(&mut self.state, &self.policy, time, &id);
                self.woke(woke, effects);
                Some(id)
            }
            Ok(admitted) => Some(self.fold_admitted(admitted, measured, time, history, effects)),
            Err(refused) => {
                let cause = refused
                    .event_id
                    .clone()
                    .unwrap_or_else(|| fold::undecodable_id(&record.bytes));
                let woke = fold::wake(&mut self.state, &self.policy, time, &cause);
                self.woke(woke, effects);
                self.refuse(record, *refused, effects);
                None
            }
        };
        if history {
            let derived = effects.decisions.drain(decisions_before..);
            for d in derived {
                self.held.ids.insert(d.id.clone());
                self.held.decisions.push(d);
            }
        }
        Ok(folded)
    }

    /// Releases held decisions once the head is passed, and snapshots the
    /// jobs the fold issued that are still pending. When history ends,
    /// every job still pending goes out again too: its `job_issued` may be
    /// in the log while its work item never reached the queue (a crash
    /// between the two), and a decision dropped as already published must
    /// not take its job with it. The queue drops a copy of a job it still
    /// holds (its message id is the job's); one already taken runs twice at
    /// worst, and the fold keeps only the first result (summaries by their
    /// content address, a `sweep_ended` by its id).
    pub fn finish(&mut self, effects: &mut Effects) -> Result<(), StoreError> {
        if self.position >= self.held.through && !self.held.decisions.is_empty() {
            let held = std::mem::take(&mut self.held);
            let released = held
                .decisions
                .into_iter()
                .filter(|d| held.ids.contains(&d.id));
            let live = std::mem::take(&mut effects.decisions);
            effects.decisions = released.chain(live).collect();
        }
        let ended_history = self.in_history && !self.holding();
        if ended_history {
            self.in_history = false;
        }
        if let Some(policy) = self.announce_policy() {
            effects.decisions.push(policy);
        }
        let issued = std::mem::take(&mut self.issued);
        let mut seen = HashSet::new();
        if (ended_history || self.requeue_pending) && !self.holding() {
            self.requeue_pending = false;
            for snapshot in self.pending_snapshots()? {
                seen.insert(snapshot.job.job_id.clone());
                effects.requeued.push(snapshot);
            }
        }
        if !self.holding() {
            for (key, job_id) in issued {
                // A job is handed out only while it is the conversation's
                // pending one: one issued and superseded within the batch
                // never reaches a worker.
                let Some(conv) = self.state.conversations.get(&key) else {
                    continue;
                };
                let Some(pending) = conv.pending_job.as_ref() else {
                    continue;
                };
                if pending.job.job_id == job_id && seen.insert(job_id) {
                    let snapshot = sweep::snapshot_from(
                        conv,
                        &WithReadings {
                            bodies: self.store.bodies(),
                            readings: &self.readings,
                        },
                        &pending.job,
                        &self.policy,
                    )?;
                    effects.jobs.push(snapshot);
                }
            }
        }
        t::JobsIssued {
            count: effects.jobs.len(),
        }
        .emit();
        std::mem::take(&mut self.tally).emit();
        Ok(())
    }

    /// Loads the conversations whose timers a record at `time` makes due.
    fn load_due(&mut self, time: u64) -> Result<(), StoreError> {
        let time = time.max(self.state.clock.now);
        if self.state.clock.next_due().is_none_or(|at| at > time) {
            return Ok(());
        }
        let due: Vec<String> = self.state.clock.due(time).map(str::to_string).collect();
        for key in due {
            self.ensure_resident(&key)?;
        }
        Ok(())
    }

    /// Carries out what waking conversations did.
    fn woke(&mut self, outcome: fold::FoldOutcome, effects: &mut Effects) {
        self.dirty_partition = true;
        for key in &outcome.woken {
            if !self.dirty.contains(key) {
                self.dirty.insert(key.clone());
            }
        }
        self.took(outcome, effects);
    }

    /// Takes the decisions, jobs and notes of a fold into `effects`.
    fn took(&mut self, outcome: fold::FoldOutcome, effects: &mut Effects) {
        for note in &outcome.notes {
            match note {
                fold::ScheduleNote::SpendWindowClosed { conversation, on } => {
                    t::SpendWindowClosed {
                        conversation_id: conversation,
                        window: on.as_str(),
                    }
                    .emit()
                }
                fold::ScheduleNote::BackedOff {
                    conversation,
                    until,
                } => t::NoProgressBackoff {
                    conversation_id: conversation,
                    until: *until,
                }
                .emit(),
                fold::ScheduleNote::JobExpired {
                    conversation,
                    job_id,
                } => t::JobExpired {
                    conversation_id: conversation,
                    job_id,
                }
                .emit(),
            }
        }
        self.issued.extend(outcome.issued);
        effects.decisions.extend(outcome.decisions);
    }

    /// When the earliest timer of the partition is due (its clock, ms): a
    /// runtime that has no record to fold by then records a
    /// `clock_ticked`, so every wait ends without agent traffic.
    pub fn next_wake(&self) -> Option<u64> {
        self.state.clock.next_due()
    }

    /// The partition's clock (the newest record time folded, ms).
    pub fn clock(&self) -> u64 {
        self.state.clock.now
    }

    /// Gives the fold the measure of the turn the record at `position`
    /// holds, taken ahead of it (on another core: see
    /// [`crate::core::measure`]). Measures are given in log order, before
    /// their records are folded; one whose record is never folded is
    /// dropped when a later record is.
    pub fn measured_ahead(&mut self, position: Position, mut measure: TurnMeasure) {
        if let (Some(reading), Some(ahead)) = (measure.reading.take(), &measure.admitted) {
            self.readings
                .insert(ahead.admitted().event.id.as_str().into(), reading);
        }
        self.ahead.push_back((position, measure));
    }

    /// The measure given for the record at `position`, if any (the ones
    /// for records before it are dropped: their records were folded).
    fn take_measure(&mut self, position: Position) -> Option<TurnMeasure> {
        while self.ahead.front().is_some_and(|(p, _)| *p < position) {
            self.ahead.pop_front();
        }
        match self.ahead.front() {
            Some((p, _)) if *p == position => self.ahead.pop_front().map(|(_, m)| m),
            _ => None,
        }
    }

    /// Hands out every pending job again at the next [`Engine::finish`]
    /// (a runtime whose job queue may have lost them, e.g. after it was
    /// recreated).
    pub fn requeue_pending(&mut self) {
        self.requeue_pending = true;
    }

    fn fold_admitted(
        &mut self,
        admitted: intake::Admitted,
        measured: Option<TurnMeasure>,
        time: u64,
        history: bool,
        effects: &mut Effects,
    ) -> String {
        let intake::Admitted {
            event,
            clamped_from,
        } = admitted;
        let span = tracing::trace_span!("fold", conversation_id = %event.conversation, event_id = %event.id, stream_seq = self.position, kind = event.type_name());
        let _guard = span.enter();
        let id = event.id.clone();
        let conversation = event.conversation.clone();
        let event_time = event.time;
        let decision = event.body.is_decision();
        let job_copy = matches!(event.body, EventBody::JobIssued(_));
        let outcome = fold::fold_owned(
            &mut self.state,
            &self.policy,
            event,
            Some(time),
            measured.as_ref(),
        );
        for key in &outcome.woken {
            if !self.dirty.contains(key) {
                self.dirty.insert(key.clone());
            }
        }
        if !outcome.woken.is_empty() {
            self.dirty_partition = true;
        }
        match &outcome.status {
            FoldStatus::Applied => {
                self.tally.applied += 1;
            }
            FoldStatus::Duplicate => {
                // The copy of a job decision tells when the job left.
                if job_copy && !self.dirty.contains(&conversation) {
                    self.dirty.insert(conversation.clone());
                }
                if history {
                    // The copy of a held decision: it reached the log.
                    self.held.ids.remove(&id);
                }
                // Decisions are the fold's own: their copy in the log is
                // expected; any other duplicate was delivered again.
                if decision {
                    self.tally.own_decisions += 1;
                } else {
                    self.tally.redelivered += 1;
                }
            }
            FoldStatus::Rejected(rejection) => {
                t::EventRejected {
                    conversation_id: &conversation,
                    event_id: &id,
                    stream_seq: self.position,
                    kind: rejection.kind(),
                    reason: &rejection.to_string(),
                }
                .emit();
            }
            FoldStatus::Ignored => self.tally.ignored += 1,
            FoldStatus::Throttled => self.tally.throttled += 1,
        }
        if outcome.status == FoldStatus::Throttled {
            // Counted in the conversation; nothing else to record.
            if !self.dirty.contains(&conversation) {
                self.dirty.insert(conversation.clone());
            }
        } else if outcome.status != FoldStatus::Duplicate && outcome.status != FoldStatus::Ignored {
            if let (Some(original), Some(conv)) = (
                clamped_from,
                self.state.conversations.get_mut(&conversation),
            ) {
                conv.push_history(
                    event_time,
                    &id,
                    "time_clamped",
                    format!(
                        "event time {original} is more than {} ms ahead of the stream's; \
                         folded at the stream's time {event_time}",
                        intake::limits::MAX_TIME_AHEAD_MS
                    ),
                );
            }
            if !self.dirty.contains(&conversation) {
                self.dirty.insert(conversation);
            }
        }
        self.took(outcome, effects);
        id
    }

    /// Records a refusal: an `event_rejected` decision in the conversation
    /// the transport vouches for, or a dead letter of the partition.
    fn refuse(&mut self, record: &LogRecord, refused: Refused, effects: &mut Effects) {
        let kind = refused.refusal.kind();
        let reason = refused.to_string();
        t::RecordRefused {
            conversation_id: refused.conversation.as_deref().unwrap_or(""),
            stream_seq: record.position,
            kind,
            reason: &reason,
        }
        .emit();
        match &refused.conversation {
            Some(conversation) => {
                let time = self
                    .state
                    .conversations
                    .get(conversation)
                    .map_or(0, |c| c.last_time);
                let rejected_id = refused
                    .event_id
                    .clone()
                    .unwrap_or_else(|| fold::undecodable_id(&record.bytes));
                let decision = fold::reject_record(
                    &mut self.state,
                    conversation,
                    &rejected_id,
                    refused.event_type,
                    &reason,
                    time,
                );
                if !self.dirty.contains(conversation) {
                    self.dirty.insert(conversation.clone());
                }
                effects.decisions.push(decision);
            }
            None => {
                self.state.unattributed_rejections += 1;
                self.dirty_partition = true;
                effects.dead_letters.push(DeadLetter {
                    position: record.position,
                    kind,
                    reason,
                    encoding: record.encoding,
                    bytes: record.bytes.clone(),
                });
            }
        }
    }

    /// Commits the changed conversations together with the position;
    /// does nothing while decisions derived from history are held back
    /// (see the module doc), which [`Engine::holding`] tells.
    pub fn commit(&mut self) -> Result<(), StoreError> {
        let prepared = self.prepare_commit();
        self.apply_commit(prepared)
    }

    /// The first half of [`Engine::commit`]: the commit encoded, not
    /// written (an empty one while holding: nothing to commit). The engine must
    /// not fold, run or change anything before [`Engine::apply_commit`]
    /// writes it; until then the caller may make durable what the state
    /// follows (the log's sync: see `Pipeline::commit`).
    pub fn prepare_commit(&mut self) -> EncodedCommit {
        if self.holding() {
            return EncodedCommit(None);
        }
        let started = std::time::Instant::now();
        let prepared = self.store.prepare_commit(
            &mut self.state,
            &self.dirty,
            self.position,
            &layout_fingerprint(),
        );
        EncodedCommit(Some((prepared, self.position, started.elapsed())))
    }

    /// The second half of [`Engine::commit`]: writes what
    /// [`Engine::prepare_commit`] encoded.
    pub fn apply_commit(&mut self, encoded: EncodedCommit) -> Result<(), StoreError> {
        let EncodedCommit(Some((prepared, position, encoding))) = encoded else {
            return Ok(());
        };
        debug_assert_eq!(
            position, self.position,
            "folded between encoding and writing"
        );
        let started = std::time::Instant::now();
        self.store.apply_commit(&mut self.state, prepared)?;
        self.dirty_partition = false;
        self.dirty.clear();
        // Encoding and writing, not what the caller did between the two.
        t::StateCommitted {
            elapsed: encoding + started.elapsed(),
        }
        .emit();
        let cache = self.store.cache();
        t::BodyCacheState {
            bytes: cache.bytes(),
            hits: cache.hits(),
            misses: cache.misses(),
        }
        .emit();
        self.evict();
        Ok(())
    }

    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.store.flush()
    }

    pub fn has_uncommitted(&self) -> bool {
        !self.dirty.is_empty() || self.dirty_partition
    }

    pub fn store(&self) -> &StateStore<B> {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut StateStore<B> {
        &mut self.store
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{Origin, TurnAppended};
    use crate::core::message::{ChatMessage, Role};
    use crate::store::memory_backend::MemoryBackend;
    use std::sync::{Arc, Mutex};

    /// A log writer for tests: everything written, in one buffer.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn rejections_are_logged_at_warn_where_the_default_filter_shows_them() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .finish();
        let mut orphan = ChatMessage::text(Role::Tool, "result");
        orphan.tool_call_id = Some("call_missing".into());
        let event = Envelope::new(
            "orphan",
            "c",
            1,
            EventBody::TurnAppended(TurnAppended::from(orphan)),
        );
        tracing::subscriber::with_default(subscriber, || {
            let mut engine =
                Engine::open(MemoryBackend::default(), PolicyConfig::default()).unwrap();
            engine
                .apply(&LogRecord::unaddressed(
                    1,
                    Origin::Agent,
                    Encoding::Json,
                    event.to_json().into_bytes(),
                ))
                .unwrap();
            engine
                .apply(&LogRecord::unaddressed(
                    2,
                    Origin::Agent,
                    Encoding::Json,
                    b"garbage".to_vec(),
                ))
                .unwrap();
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert!(
            text.contains("event rejected") && text.contains("orphan tool result"),
            "{text}"
        );
        assert!(
            text.contains("record refused") && text.contains("undecodable"),
            "{text}"
        );
    }

    #[test]
    fn conversations_mapped_on_several_threads_come_back_in_key_order() {
        let mut engine = Engine::open(MemoryBackend::default(), PolicyConfig::default()).unwrap();
        engine.set_residency(Residency {
            conversations: 2,
            ..Residency::default()
        });
        let mut position = 0;
        for conv in ["c4", "c1", "c6", "c0", "c3", "c5", "c2"] {
            for i in 0..3 {
                position += 1;
                let e = crate::testing::turn(conv, i, position);
                engine.apply(&record(position, Origin::Agent, &e)).unwrap();
            }
            engine.commit().unwrap();
        }
        assert!(
            engine.state.conversations.len() < 7,
            "some conversations are read from the store, not memory"
        );
        let bodies = engine.bodies();
        let mut expected = Vec::new();
        engine
            .each_conversation(|_, conv| -> Result<(), StoreError> {
                expected.push((conv.key.clone(), conv.hash_with(&bodies).unwrap()));
                Ok(())
            })
            .unwrap();
        assert_eq!(expected.len(), 7);
        assert!(expected.is_sorted());
        for threads in [0, 1, 2, 3, 16] {
            let mapped = engine
                .map_conversations(threads, |conv, bodies| -> Result<_, StoreError> {
                    Ok((conv.key.clone(), conv.hash_with(bodies).unwrap()))
                })
                .unwrap();
            assert_eq!(mapped, expected, "{threads} threads");
        }
        let failed = engine.map_conversations(2, |conv, _| match conv.key.as_str() {
            "c3" => Err(StoreError::Corrupt {
                what: "c3".into(),
                source: "test".into(),
            }),
            _ => Ok(()),
        });
        assert!(
            matches!(failed, Err(StoreError::Corrupt { .. })),
            "{failed:?}"
        );
    }

    /// User turn `i` of conversation `c`, long enough that a few compact.
    fn turn(i: u64) -> Envelope {
        crate::testing::turn_of(
            "c",
            i,
            i,
            ChatMessage::text(Role::User, format!("turn {i} about the build: ").repeat(10)),
        )
    }

    /// `e` as the log's record at position `p`.
    fn record(p: u64, origin: Origin, e: &Envelope) -> LogRecord {
        LogRecord::unaddressed(p, origin, Encoding::Json, e.to_json().into_bytes())
    }

    /// A window small enough that [`turn`]s issue jobs within a dozen.
    fn crash_policy() -> PolicyConfig {
        PolicyConfig {
            default_context_window: 200,
            fresh_tail_count: 2,
            ..PolicyConfig::default()
        }
    }

    #[test]
    fn held_decisions_are_dropped_when_the_log_shows_them_and_released_at_the_head() {
        let policy = crash_policy();
        // What a first process folded and published (and folded back, as
        // runtimes do).
        let mut first = Engine::open(MemoryBackend::default(), policy.clone()).unwrap();
        let mut log = Vec::new();
        for i in 1..=12 {
            log.push(record(log.len() as u64 + 1, Origin::Agent, &turn(i)));
            let effects = first.apply(log.last().unwrap()).unwrap();
            for d in effects.decisions {
                log.push(record(log.len() as u64 + 1, Origin::Service, &d));
                first.apply(log.last().unwrap()).unwrap();
            }
        }
        assert!(log.len() > 12, "the first process decided something");
        // A crash kept the last decision out of the log.
        let lost = log
            .iter()
            .rposition(|r| r.origin == Origin::Service)
            .unwrap();
        let missing = Envelope::decode(&log[lost].bytes, log[lost].encoding)
            .unwrap()
            .id;
        let mut kept = log.clone();
        kept.remove(lost);
        let mut second = Engine::open(MemoryBackend::default(), policy).unwrap();
        second.hold_through(log.len() as u64);
        let mut released = Vec::new();
        for r in &kept {
            assert!(second.holding() || released.is_empty());
            released.extend(second.apply(r).unwrap().decisions);
        }
        second.end_history();
        let mut tail = Effects::default();
        second.finish(&mut tail).unwrap();
        released.extend(tail.decisions);
        assert!(!second.holding());
        // Only what the log lacks goes out again.
        let ids: Vec<_> = released.iter().map(|d| d.id.clone()).collect();
        assert_eq!(ids, [missing]);
        assert_eq!(second.state_hash().unwrap(), first.state_hash().unwrap());
    }

    #[test]
    fn jobs_the_log_shows_pending_go_out_again_when_history_ends() {
        let policy = crash_policy();
        // A first process stored its decisions, then crashed before the
        // job reached the queue (and before its state was committed).
        let mut first = Engine::open(MemoryBackend::default(), policy.clone()).unwrap();
        let mut log = Vec::new();
        let mut issued = None;
        for i in 1..=12 {
            log.push(record(log.len() as u64 + 1, Origin::Agent, &turn(i)));
            let effects = first.apply(log.last().unwrap()).unwrap();
            if let Some(job) = effects.jobs.first() {
                issued.get_or_insert(job.job.job_id.clone());
            }
            for d in effects.decisions {
                log.push(record(log.len() as u64 + 1, Origin::Service, &d));
            }
        }
        let issued = issued.expect("a job was issued");
        // The next owner folds the same log: every decision is in it, so
        // none goes out again; the job does.
        let mut second = Engine::open(MemoryBackend::default(), policy).unwrap();
        second.hold_through(log.len() as u64);
        let mut out = Effects::default();
        for r in &log {
            second.apply_record(r, &mut out).unwrap();
        }
        second.end_history();
        second.finish(&mut out).unwrap();
        assert!(out.decisions.is_empty(), "{:?}", out.decisions);
        let pending = second.state.conversations["c"].pending_job.clone().unwrap();
        let requeued: Vec<_> = out.requeued.iter().map(|s| s.job.job_id.clone()).collect();
        assert_eq!(requeued, [pending.job.job_id]);
        assert!(out.jobs.is_empty(), "handed out once, as a requeue");
        assert!(issued.starts_with("job_"));
        // Once: the next batch hands out nothing more.
        let mut next = Effects::default();
        second.finish(&mut next).unwrap();
        assert!(next.requeued.is_empty() && next.jobs.is_empty());
    }
}
