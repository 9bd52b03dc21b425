//! The state layout over a [`KvBackend`]: each conversation is a head (its
//! small, changing fields) plus append-only chunks, so a commit writes only
//! what changed. A chunk holds what one commit appended to a conversation's
//! turns (their metadata), summaries, applied ids, history and context (or
//! the whole context when it was edited otherwise: a summary replaced
//! turns, a reset): one record per conversation per commit rather than one
//! per item, because the store's cost is per record (a busy partition
//! commits hundreds of turns at once), and a head that does not grow with
//! the conversation. The log position the state reflects is written in the
//! same atomic commit.
//!
//! # Bodies apart, conversations on demand
//!
//! Turn bodies are records apart from the chunks: the bodies one commit adds
//! to a conversation, in runs of consecutive sequences of about 64 KiB
//! (`store::body_runs`; key: the conversation's escaped key, 0,
//! `KIND_BODY_RUN`, the big-endian sequence of the run's first body). So one
//! body is read with one seek and without reading its conversation, and
//! loading a conversation never reads a body (but the few its duplicate and
//! flood guards still compare with). Opening a store
//! reads the position and the partition's counts only; a conversation is
//! read when [`StateStore::load_conversation`] asks for it, and forgotten
//! with [`StateStore::forget`] (its records stay). Bodies read through
//! [`StoredBodies`] go through a [`BodyCache`] bounded in bytes.
//!
//! Crash reasoning is unchanged: a commit is atomic, bodies included, so
//! the state on disk is always that of one log position.

use crate::core::state::{
    body_size, id_digest, AppliedIds, BodyError, ContextItem, Conversation, HistoryEntry, IdDigest,
    IntakeQuota, State, Summary, Turn, TurnBodies, TurnBody,
};
use crate::log::Position;
use crate::store::{body_runs, KvBackend, StoreError, Table, Write};
use crate::BoxError;
use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

pub(crate) const POSITION_KEY: &[u8] = b"position";
/// The fingerprint of the policy in force (what `doctor` compares).
pub(crate) const POLICY_KEY: &[u8] = b"policy";
/// The state layout (`runtime::engine::layout_fingerprint`).
pub(crate) const LAYOUT_KEY: &[u8] = b"layout";
/// The policy in force, as the log recorded it (`policy_recorded`).
const ACTIVE_POLICY_KEY: &[u8] = b"active_policy";
const UNATTRIBUTED_KEY: &[u8] = b"unattributed_rejections";
const GLOBAL_SPEND_KEY: &[u8] = b"global_spend";
/// The partition's clock and timers (`PartitionClock`).
const CLOCK_KEY: &[u8] = b"clock";
/// The partition's intake quota (absent until a partition quota is used).
const INTAKE_KEY: &[u8] = b"intake";
/// The keys of the conversations with a pending job (an index, derived
/// from their heads: what a restarted runner must resume).
const PENDING_KEY: &[u8] = b"pending_jobs";

/// Key kind of a conversation's chunks (after the conversation key and a 0).
const KIND_CHUNK: u8 = 5;
/// Key kind of a conversation's runs of turn bodies (keyed by the first
/// body's sequence), and of each body in the cache. (6 was one record per
/// body, up to layout 14.)
const KIND_BODY_RUN: u8 = 8;
/// Key kind of a conversation's summary texts (by summary index).
const KIND_SUMMARY_TEXT: u8 = 7;

/// How much of each append-only vector is already on disk, and how many
/// chunks hold it.
#[derive(Debug, Clone, Copy, Default)]
struct Persisted {
    turns: usize,
    summaries: usize,
    context: usize,
    context_edits: u64,
    chunks: u64,
}

impl Persisted {
    /// All of `conv`'s records, as they are once it is committed in `chunks`.
    fn of(conv: &Conversation, chunks: u64) -> Persisted {
        Persisted {
            turns: conv.turns.len(),
            summaries: conv.summaries.len(),
            context: conv.context.len(),
            context_edits: conv.context.edits(),
            chunks,
        }
    }
}

/// What one commit appended to a conversation: borrowed from the state
/// when written, owned when read back.
#[derive(serde::Serialize, serde::Deserialize)]
struct Chunk<'a> {
    turns: Cow<'a, [Turn]>,
    summaries: Cow<'a, [Summary]>,
    applied: Cow<'a, [IdDigest]>,
    history: Cow<'a, [HistoryEntry]>,
    /// Appended context items, or the whole context when `context_replaced`.
    context: Cow<'a, [ContextItem]>,
    context_replaced: bool,
}

/// A chunk as a conversation is loaded: its history entries are skipped
/// (they stay in the store: [`StateStore::read_history`]).
#[derive(serde::Deserialize)]
struct LoadedChunk {
    turns: Vec<Turn>,
    summaries: Vec<Summary>,
    applied: Vec<IdDigest>,
    #[allow(dead_code)]
    history: serde::de::IgnoredAny,
    context: Vec<ContextItem>,
    context_replaced: bool,
}

/// A chunk's history entries alone.
#[derive(serde::Deserialize)]
struct ChunkHistory {
    history: Vec<HistoryEntry>,
}

impl Chunk<'_> {
    /// About the encoded size.
    fn size_hint(&self) -> usize {
        64 * self.turns.len() + 32 * (self.applied.len() + self.context.len()) + 256
    }
}

/// Where a body is cached: its conversation's key digest, its record
/// kind and its sequence (a turn's, or a summary's index).
type BodyKey = (IdDigest, u8, u64);

/// A cached body: a turn's, or a summary's text.
#[derive(Clone)]
enum Cached {
    Turn(Arc<TurnBody>),
    SummaryText(Arc<str>),
}

#[derive(Clone)]
struct BodyWeight;

impl quick_cache::Weighter<BodyKey, Cached> for BodyWeight {
    fn weight(&self, _: &BodyKey, body: &Cached) -> u64 {
        match body {
            Cached::Turn(body) => body_size(body),
            Cached::SummaryText(text) => text.len() as u64 + 64,
        }
    }
}

/// Turn bodies read again and again (the fresh tails assembly sends, what
/// a commit just wrote), bounded in bytes; shared by the folder and the
/// readers of one store (it locks internally).
pub struct BodyCache {
    cache: quick_cache::sync::Cache<BodyKey, Cached, BodyWeight>,
    capacity_bytes: u64,
}

/// The body cache's default size per store.
pub const DEFAULT_BODY_CACHE_BYTES: u64 = 128 << 20;

impl BodyCache {
    pub fn new(capacity_bytes: u64) -> BodyCache {
        // The item estimate only sizes the table: ~2 KB a body.
        let items = (capacity_bytes / 2048).clamp(16, 1 << 20) as usize;
        BodyCache {
            cache: quick_cache::sync::Cache::with_weighter(
                items,
                capacity_bytes.max(1),
                BodyWeight,
            ),
            capacity_bytes,
        }
    }
    fn get(&self, key: &BodyKey) -> Option<Cached> {
        self.cache.get(key)
    }
    /// Whether it keeps anything (`store.body_cache_bytes` 0 turns it off).
    fn keeps(&self) -> bool {
        self.capacity_bytes > 0
    }
    fn insert(&self, key: BodyKey, body: Cached) {
        if self.keeps() {
            self.cache.insert(key, body);
        }
    }
    /// Bytes the cached bodies hold now.
    pub fn bytes(&self) -> u64 {
        self.cache.weight()
    }
    pub fn len(&self) -> usize {
        self.cache.len()
    }
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
    pub fn hits(&self) -> u64 {
        self.cache.hits()
    }
    pub fn misses(&self) -> u64 {
        self.cache.misses()
    }
}

impl Default for BodyCache {
    fn default() -> Self {
        BodyCache::new(DEFAULT_BODY_CACHE_BYTES)
    }
}

/// A commit encoded and not yet written ([`StateStore::prepare_commit`]).
#[derive(Debug)]
#[must_use = "a prepared commit writes nothing until it is applied"]
pub struct PreparedCommit {
    writes: Vec<Write>,
    /// The conversations written, with what is on disk of each after it.
    committed: Vec<(String, Persisted)>,
    /// The keys with pending jobs after it, when that changed.
    pending: Option<BTreeSet<String>>,
}

/// Durable, incrementally written state.
pub struct StateStore<B: KvBackend> {
    backend: B,
    /// What is on disk of each conversation loaded (or created) since the
    /// store was opened; a conversation not here has not been read.
    persisted: HashMap<String, Persisted>,
    cache: Arc<BodyCache>,
    /// Conversations with a pending job, as committed.
    pending: BTreeSet<String>,
    commits_since_flush: u32,
    /// Commits since this store was opened (what the ingest bench divides
    /// its events by).
    commits: u64,
    /// Make every N-th commit durable (1 = every commit).
    pub flush_every: u32,
    /// The policy in force, written with every commit: its fingerprint,
    /// and the policy itself when the log recorded it.
    policy: (String, Option<Vec<u8>>),
}

/// The prefix of a conversation's record keys of `kind`: its key with
/// each 0 byte written as 0, 0xff (a byte UTF-8 never holds), then 0 and
/// the kind. So no conversation's prefix begins another's: a key may hold
/// any byte, and `a` never reads the records of `a\0...` as its own.
fn record_prefix(conv: &str, kind: u8) -> Vec<u8> {
    let mut key = Vec::with_capacity(conv.len() + 10);
    for &b in conv.as_bytes() {
        key.push(b);
        if b == 0 {
            key.push(0xff);
        }
    }
    key.push(0);
    key.push(kind);
    key
}

/// Big-endian sequence numbers: a prefix scan reads records in order.
fn record_key(conv: &str, kind: u8, seq: u64) -> Vec<u8> {
    let mut key = record_prefix(conv, kind);
    key.extend_from_slice(&seq.to_be_bytes());
    key
}

fn encode<T: serde::Serialize + ?Sized>(value: &T) -> Vec<u8> {
    encode_sized(value, 0)
}

/// Encodes into a buffer of `capacity` bytes to start with (a chunk of
/// hundreds of turns would otherwise grow and copy its buffer many times).
#[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
fn encode_sized<T: serde::Serialize + ?Sized>(value: &T, capacity: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(capacity);
    rmp_serde::encode::write_named(&mut buf, value).expect("state records serialize");
    buf
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, StoreError> {
    rmp_serde::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        what: what.to_string(),
        source: e.into(),
    })
}

/// The partition-wide part of a stored state and the position it reflects.
pub struct Opened {
    /// No conversations: they are read on demand.
    pub state: State,
    pub position: Position,
    /// The store was written in another layout (and is read as empty, to
    /// be replayed from the log).
    pub other_layout: bool,
    /// The policy in force at `position`, when the log recorded one.
    pub policy: Option<crate::core::policy::PolicyConfig>,
}

impl<B: KvBackend> StateStore<B> {
    pub fn new(backend: B) -> Self {
        Self::with_cache(backend, Arc::new(BodyCache::default()))
    }

    pub fn with_cache(backend: B, cache: Arc<BodyCache>) -> Self {
        StateStore {
            backend,
            persisted: HashMap::new(),
            cache,
            pending: BTreeSet::new(),
            commits_since_flush: 0,
            commits: 0,
            flush_every: 1,
            policy: (String::new(), None),
        }
    }

    pub fn cache(&self) -> &Arc<BodyCache> {
        &self.cache
    }

    /// Opens the stored state: the position and the partition's own
    /// counts, not one conversation. A store written in another layout
    /// (`layout`) reads as empty at position 0 (`other_layout`), so the
    /// caller replays the log. The policy does not matter here: the log
    /// records it, and the store keeps the one in force at its position.
    pub fn open(&mut self, layout: &str) -> Result<Opened, StoreError> {
        if self.other_layout(layout)? {
            tracing::warn!(
                "state store was written in another layout; replaying the log from the start"
            );
            self.clear()?;
            self.reset_memory();
            return Ok(Opened {
                state: State::default(),
                position: 0,
                other_layout: true,
                policy: None,
            });
        }
        self.read_opened()
    }

    /// [`StateStore::open`] for a reader: a store of another layout is
    /// [`StoreError::OtherLayout`], and nothing is ever cleared.
    pub fn open_read_only(&mut self, layout: &str) -> Result<Opened, StoreError> {
        if self.other_layout(layout)? {
            return Err(StoreError::OtherLayout {
                found: self
                    .backend
                    .get(Table::Meta, LAYOUT_KEY)?
                    .map_or("an older layout".into(), |b| {
                        String::from_utf8_lossy(&b).into_owned()
                    }),
                expected: layout.to_string(),
            });
        }
        self.read_opened()
    }

    /// Whether the store holds state of a layout other than `layout` (a
    /// store of layout 9 or older has a policy but no layout record).
    fn other_layout(&self, layout: &str) -> Result<bool, StoreError> {
        Ok(match self.backend.get(Table::Meta, LAYOUT_KEY)? {
            Some(stored) => stored != layout.as_bytes(),
            None => {
                self.backend.get(Table::Meta, POLICY_KEY)?.is_some()
                    || self.backend.get(Table::Meta, POSITION_KEY)?.is_some()
            }
        })
    }

    fn reset_memory(&mut self) {
        self.persisted.clear();
        self.pending.clear();
    }

    /// Sets the policy written with the next commits: its fingerprint, and
    /// the policy when the log recorded it.
    pub fn set_policy(
        &mut self,
        fingerprint: &str,
        recorded: Option<&crate::core::policy::PolicyConfig>,
    ) {
        self.policy = (fingerprint.to_string(), recorded.map(encode));
    }

    fn read_opened(&mut self) -> Result<Opened, StoreError> {
        self.reset_memory();
        let position = match self.backend.get(Table::Meta, POSITION_KEY)? {
            Some(b) if b.len() == 8 => b
                .first_chunk::<8>()
                .map_or(0, |bytes| u64::from_be_bytes(*bytes)),
            Some(_) => {
                return Err(StoreError::Corrupt {
                    what: "checkpoint".into(),
                    source: "not 8 bytes".into(),
                })
            }
            None => 0,
        };
        let mut state = State::default();
        if let Some(b) = self.backend.get(Table::Meta, UNATTRIBUTED_KEY)? {
            state.unattributed_rejections = decode(&b, "unattributed rejections")?;
        }
        if let Some(b) = self.backend.get(Table::Meta, GLOBAL_SPEND_KEY)? {
            state.spend = decode(&b, "global spend window")?;
        }
        if let Some(b) = self.backend.get(Table::Meta, CLOCK_KEY)? {
            state.clock = decode(&b, "partition clock")?;
        }
        if let Some(b) = self.backend.get(Table::Meta, INTAKE_KEY)? {
            state.intake = decode(&b, "partition intake quota")?;
        }
        if let Some(b) = self.backend.get(Table::Meta, PENDING_KEY)? {
            self.pending = decode(&b, "pending job index")?;
        }
        let policy = match self.backend.get(Table::Meta, ACTIVE_POLICY_KEY)? {
            Some(b) => Some(decode(&b, "policy in force")?),
            None => None,
        };
        Ok(Opened {
            state,
            position,
            other_layout: false,
            policy,
        })
    }

    /// Deletes every conversation, record and count in one commit (the
    /// position and policy with them), so a replay from the start writes
    /// into an empty store. Left in place, the records of the old fold
    /// would be read back after the new one's and count its turns twice.
    fn clear(&mut self) -> Result<(), StoreError> {
        let mut writes = Vec::new();
        for table in [Table::Conversations, Table::Records, Table::Meta] {
            for (key, _) in self.backend.scan_prefix(table, b"")? {
                writes.push(Write::Delete { table, key });
            }
        }
        if !writes.is_empty() {
            self.backend.commit(&writes, true)?;
        }
        Ok(())
    }

    /// The keys of every stored conversation, in key order (the index: one
    /// small head each, no chunk or body read).
    pub fn conversation_keys(&self) -> Result<Vec<String>, StoreError> {
        self.backend
            .scan_prefix(Table::Conversations, b"")?
            .into_iter()
            .map(|(key, _)| {
                String::from_utf8(key).map_err(|e| StoreError::Corrupt {
                    what: "conversation key".into(),
                    source: e.into(),
                })
            })
            .collect()
    }

    /// The keys of the stored conversations and of `resident`'s (those
    /// folded since the last commit), in key order.
    pub fn keys_with(&self, resident: &State) -> Result<BTreeSet<String>, StoreError> {
        let mut keys: BTreeSet<String> = self.conversation_keys()?.into_iter().collect();
        keys.extend(resident.conversations.keys().cloned());
        Ok(keys)
    }

    /// Reads one conversation (its head, its chunks, and the bodies its
    /// guards need) without keeping note of it: for a reader.
    pub fn read_conversation(&self, key: &str) -> Result<Option<Conversation>, StoreError> {
        Ok(self.read(key)?.map(|(conv, _)| conv))
    }

    fn read(&self, key: &str) -> Result<Option<(Conversation, u64)>, StoreError> {
        let Some(head) = self.backend.get(Table::Conversations, key.as_bytes())? else {
            return Ok(None);
        };
        let mut conv: Conversation = decode(&head, "conversation head")?;
        let prefix = record_prefix(key, KIND_CHUNK);
        let mut chunks = 0;
        let mut applied = Vec::new();
        // The head holds the context's sums; the chunks its items.
        let mut context = conv.context.take_items();
        for (rk, value) in self.backend.scan_prefix(Table::Records, &prefix)? {
            if rk.len() != prefix.len() + 8 {
                return Err(StoreError::Corrupt {
                    what: "record key".into(),
                    source: format!("{rk:?}").into(),
                });
            }
            let chunk: LoadedChunk = decode(&value, "conversation chunk")?;
            conv.turns.extend(chunk.turns);
            conv.summaries.extend(chunk.summaries);
            applied.extend(chunk.applied);
            if chunk.context_replaced {
                context.clear();
            }
            context.extend(chunk.context);
            chunks += 1;
        }
        conv.applied = AppliedIds::from_stored(applied);
        // Read in chunks, the vectors grew by doubling.
        conv.turns.shrink_to_fit();
        conv.summaries.shrink_to_fit();
        context.shrink_to_fit();
        conv.context.restore_items(context);
        // The guards read a sketch and digest of a few bodies; those, not
        // the bodies, stay in memory.
        let guarded: Vec<u64> = conv.guard_seqs().collect();
        for seq in guarded {
            let body = self.stored_body(&conv, seq)?;
            let (sketch, digest) = crate::core::fold::guard_read(&body);
            conv.bodies.remember_guard(seq, sketch, digest);
        }
        Ok(Some((conv, chunks)))
    }

    /// Loads one conversation for folding: later commits write what it
    /// appends after what is on disk. `None` when the store has none.
    pub fn load_conversation(&mut self, key: &str) -> Result<Option<Conversation>, StoreError> {
        let Some((conv, chunks)) = self.read(key)? else {
            return Ok(None);
        };
        self.persisted
            .insert(key.to_string(), Persisted::of(&conv, chunks));
        Ok(Some(conv))
    }

    /// The history entries of `key` on disk, oldest first.
    pub fn read_history(&self, key: &str) -> Result<Vec<HistoryEntry>, StoreError> {
        let mut entries = Vec::new();
        for (_, value) in self
            .backend
            .scan_prefix(Table::Records, &record_prefix(key, KIND_CHUNK))?
        {
            let chunk: ChunkHistory = decode(&value, "conversation chunk")?;
            entries.extend(chunk.history);
        }
        Ok(entries)
    }

    /// The conversations whose committed state has a pending job.
    pub fn pending_conversations(&self) -> &BTreeSet<String> {
        &self.pending
    }

    /// Whether `key` was loaded or created since the store was opened.
    pub fn knows(&self, key: &str) -> bool {
        self.persisted.contains_key(key)
    }

    /// Forgets a committed conversation dropped from memory (an eviction);
    /// its records stay, and [`StateStore::load_conversation`] reads it
    /// again.
    pub fn forget(&mut self, key: &str) {
        self.persisted.remove(key);
    }

    /// A body from the cache or the backend (not from the conversation).
    fn stored_body(&self, conv: &Conversation, seq: u64) -> Result<Arc<TurnBody>, BodyError> {
        self.stored_body_keyed(conv, id_digest(&conv.key), seq)
    }

    fn stored_body_keyed(
        &self,
        conv: &Conversation,
        key_digest: IdDigest,
        seq: u64,
    ) -> Result<Arc<TurnBody>, BodyError> {
        let cache_key = (key_digest, KIND_BODY_RUN, seq);
        if let Some(Cached::Turn(body)) = self.cache.get(&cache_key) {
            return Ok(body);
        }
        let unreadable = |source: BoxError| BodyError::Unreadable {
            conversation: conv.key.clone(),
            seq,
            source,
        };
        let missing = || BodyError::Missing {
            conversation: conv.key.clone(),
            seq,
        };
        let prefix = record_prefix(&conv.key, KIND_BODY_RUN);
        let (run_key, value) = self
            .backend
            .last_at_or_before(
                Table::Records,
                &prefix,
                &record_key(&conv.key, KIND_BODY_RUN, seq),
            )
            .map_err(|e| unreadable(e.into()))?
            .ok_or_else(missing)?;
        let first = run_key
            .get(prefix.len()..)
            .and_then(|first| <[u8; 8]>::try_from(first).ok())
            .map(u64::from_be_bytes)
            .ok_or_else(|| {
                unreadable(format!("a run of bodies under the key {run_key:?}").into())
            })?;
        let encoded = body_runs::encoded_bodies(&value).map_err(|e| unreadable(e.into()))?;
        // The run's neighbours are what a reader asks for next (a fresh
        // tail, a summary's sources, the state hash): they go to the cache
        // too, when there is one. A body that does not decode fails only its
        // own reads.
        let neighbours = self.cache.keeps();
        let mut wanted = None;
        for (index, (at, bytes)) in (first..).zip(encoded).enumerate() {
            if at != seq && !neighbours {
                continue;
            }
            match body_runs::decode_body(index, bytes) {
                Ok(body) => {
                    let body = Arc::new(body);
                    if at == seq {
                        wanted = Some(Ok(Arc::clone(&body)));
                    }
                    self.cache
                        .insert((key_digest, KIND_BODY_RUN, at), Cached::Turn(body));
                }
                Err(e) if at == seq => wanted = Some(Err(unreadable(e.into()))),
                Err(_) => {}
            }
        }
        wanted.unwrap_or_else(|| Err(missing()))
    }

    fn stored_summary_text(
        &self,
        conv: &Conversation,
        key_digest: IdDigest,
        index: u32,
    ) -> Result<Arc<str>, BodyError> {
        let cache_key = (key_digest, KIND_SUMMARY_TEXT, u64::from(index));
        if let Some(Cached::SummaryText(text)) = self.cache.get(&cache_key) {
            return Ok(text);
        }
        let unreadable = |source: BoxError| BodyError::SummaryUnreadable {
            conversation: conv.key.clone(),
            index,
            source,
        };
        let bytes = self
            .backend
            .get(
                Table::Records,
                &record_key(&conv.key, KIND_SUMMARY_TEXT, u64::from(index)),
            )
            .map_err(|e| unreadable(e.into()))?
            .ok_or_else(|| BodyError::SummaryMissing {
                conversation: conv.key.clone(),
                index,
            })?;
        let text: String = rmp_serde::from_slice(&bytes).map_err(|e| unreadable(e.into()))?;
        let text: Arc<str> = Arc::from(text);
        self.cache
            .insert(cache_key, Cached::SummaryText(Arc::clone(&text)));
        Ok(text)
    }

    /// Reads bodies: the conversation's resident ones, then the cache,
    /// then the store.
    pub fn bodies(&self) -> StoredBodies<'_, B> {
        StoredBodies {
            store: self,
            last_key: std::cell::RefCell::new(None),
        }
    }

    /// `key`'s conversation: `resident`'s copy when it holds one, else the
    /// stored one, read now (`None` when neither has it).
    pub fn resident_or_stored<'a>(
        &self,
        resident: &'a State,
        key: &str,
    ) -> Result<Option<Cow<'a, Conversation>>, StoreError> {
        Ok(match resident.conversations.get(key) {
            Some(conv) => Some(Cow::Borrowed(conv)),
            None => self.read_conversation(key)?.map(Cow::Owned),
        })
    }

    /// The hash of the whole stored state with `resident`'s conversations
    /// in place of their stored copies (what a clean fold of the same log
    /// in memory gives as [`State::hash`]); reads one stored conversation
    /// at a time.
    pub fn state_hash(&self, resident: &State) -> Result<String, StoreError> {
        let keys = self.keys_with(resident)?;
        let mut hashes = Vec::with_capacity(keys.len());
        let bodies = self.bodies();
        let corrupt = |e: BodyError| StoreError::Corrupt {
            what: "turn body".into(),
            source: e.into(),
        };
        for key in keys {
            let Some(conv) = self.resident_or_stored(resident, &key)? else {
                continue;
            };
            let hash = conv.hash_with(&bodies).map_err(corrupt)?;
            hashes.push((key, hash));
        }
        Ok(resident.hash_of(
            hashes
                .iter()
                .map(|(key, hash)| (key.as_str(), hash.as_str())),
        ))
    }

    /// Writes the dirty conversations and the position in one atomic
    /// commit; then drops from memory the bodies it wrote (but those the
    /// guards need), into the body cache.
    pub fn commit(
        &mut self,
        state: &mut State,
        dirty: &BTreeSet<String>,
        position: Position,
        layout: &str,
    ) -> Result<(), StoreError> {
        let prepared = self.prepare_commit(state, dirty, position, layout);
        self.apply_commit(state, prepared)
    }

    /// The first half of [`StateStore::commit`]: the commit's writes,
    /// encoded from `state` and not yet written. Nothing is changed (each
    /// conversation's turns are lent out of it while its head is encoded,
    /// and put back), so the caller may make what the state follows
    /// durable meanwhile (the log's sync, on another thread) and write
    /// them after, with [`StateStore::apply_commit`], before `state`
    /// changes.
    pub fn prepare_commit(
        &self,
        state: &mut State,
        dirty: &BTreeSet<String>,
        position: Position,
        layout: &str,
    ) -> PreparedCommit {
        let mut writes = Vec::new();
        let mut committed = Vec::with_capacity(dirty.len());
        let mut pending_changed = Vec::new();
        for key in dirty {
            let Some(conv) = state.conversations.get_mut(key) else {
                continue;
            };
            if conv.pending_job.is_some() != self.pending.contains(key) {
                pending_changed.push(key);
            }
            let p = self.persisted.get(key).copied().unwrap_or_default();
            // `ContextWindow` counts every change but an append.
            let context_appended =
                conv.context.edits() == p.context_edits && conv.context.len() >= p.context;
            body_runs::write_runs(
                conv.bodies
                    .from(p.turns as u64)
                    .map(|(seq, body)| (seq, &**body)),
                |first, value| {
                    writes.push(Write::Put {
                        table: Table::Records,
                        key: record_key(key, KIND_BODY_RUN, first),
                        value,
                    })
                },
            );
            for (index, text) in conv.summary_texts.from(p.summaries as u32) {
                writes.push(Write::Put {
                    table: Table::Records,
                    key: record_key(key, KIND_SUMMARY_TEXT, u64::from(index)),
                    value: encode_sized(&**text, text.len() + 8),
                });
            }
            let chunk = Chunk {
                turns: Cow::Borrowed(conv.turns.get(p.turns..).unwrap_or_default()),
                summaries: Cow::Borrowed(conv.summaries.get(p.summaries..).unwrap_or_default()),
                applied: Cow::Borrowed(conv.applied.unsaved()),
                history: Cow::Borrowed(conv.history.resident()),
                context: Cow::Borrowed(if context_appended {
                    &conv.context[p.context..]
                } else {
                    &conv.context
                }),
                context_replaced: !context_appended,
            };
            let appended = !(chunk.turns.is_empty()
                && chunk.summaries.is_empty()
                && chunk.applied.is_empty()
                && chunk.history.is_empty()
                && chunk.context.is_empty()
                && !chunk.context_replaced);
            let chunks = if appended {
                writes.push(Write::Put {
                    table: Table::Records,
                    key: record_key(key, KIND_CHUNK, p.chunks),
                    value: encode_sized(&chunk, chunk.size_hint()),
                });
                p.chunks + 1
            } else {
                p.chunks
            };
            committed.push((key.clone(), Persisted::of(conv, chunks)));
            // The head is everything but what the chunks hold.
            let turns = std::mem::take(&mut conv.turns);
            let summaries = std::mem::take(&mut conv.summaries);
            let applied = std::mem::take(&mut conv.applied);
            let context = conv.context.take_items();
            let head = encode(&*conv);
            conv.turns = turns;
            conv.summaries = summaries;
            conv.applied = applied;
            conv.context.restore_items(context);
            writes.push(Write::Put {
                table: Table::Conversations,
                key: key.as_bytes().to_vec(),
                value: head,
            });
        }
        let pending = (!pending_changed.is_empty()).then(|| {
            let mut set = self.pending.clone();
            for key in pending_changed {
                if !set.remove(key) {
                    set.insert(key.clone());
                }
            }
            writes.push(Write::Put {
                table: Table::Meta,
                key: PENDING_KEY.to_vec(),
                value: encode(&set),
            });
            set
        });
        writes.push(Write::Put {
            table: Table::Meta,
            key: POSITION_KEY.to_vec(),
            value: position.to_be_bytes().to_vec(),
        });
        writes.push(Write::Put {
            table: Table::Meta,
            key: LAYOUT_KEY.to_vec(),
            value: layout.as_bytes().to_vec(),
        });
        writes.push(Write::Put {
            table: Table::Meta,
            key: POLICY_KEY.to_vec(),
            value: self.policy.0.as_bytes().to_vec(),
        });
        if let Some(policy) = &self.policy.1 {
            writes.push(Write::Put {
                table: Table::Meta,
                key: ACTIVE_POLICY_KEY.to_vec(),
                value: policy.clone(),
            });
        }
        writes.push(Write::Put {
            table: Table::Meta,
            key: UNATTRIBUTED_KEY.to_vec(),
            value: encode(&state.unattributed_rejections),
        });
        // Small (the sweeps of one window) and changed by any conversation's
        // fold: written with every commit, atomically with the position.
        writes.push(Write::Put {
            table: Table::Meta,
            key: GLOBAL_SPEND_KEY.to_vec(),
            value: encode(&state.spend),
        });
        // The time moves with every record; the timers with the waits.
        writes.push(Write::Put {
            table: Table::Meta,
            key: CLOCK_KEY.to_vec(),
            value: encode(&state.clock),
        });
        // Only once used: a store without a partition quota writes no key.
        if state.intake != IntakeQuota::default() {
            writes.push(Write::Put {
                table: Table::Meta,
                key: INTAKE_KEY.to_vec(),
                value: encode(&state.intake),
            });
        }
        PreparedCommit {
            writes,
            committed,
            pending,
        }
    }

    /// The second half of [`StateStore::commit`]: writes what
    /// [`StateStore::prepare_commit`] encoded from `state`, which has not
    /// changed since.
    pub fn apply_commit(
        &mut self,
        state: &mut State,
        prepared: PreparedCommit,
    ) -> Result<(), StoreError> {
        let PreparedCommit {
            writes,
            committed,
            pending,
        } = prepared;
        self.commits_since_flush += 1;
        let durable = self.commits_since_flush >= self.flush_every;
        self.backend.commit(&writes, durable)?;
        self.commits += 1;
        if durable {
            self.commits_since_flush = 0;
        }
        if let Some(changed) = pending {
            self.pending = changed;
        }
        for (key, persisted) in committed {
            if let Some(conv) = state.conversations.get_mut(&key) {
                // On disk now: the newest turns, what assembly reads next.
                let digest = id_digest(&key);
                self.persisted.insert(key, persisted);
                conv.applied.saved();
                conv.history.saved();
                for (seq, body) in conv.release_bodies(crate::core::fold::guard_read) {
                    self.cache
                        .insert((digest, KIND_BODY_RUN, seq), Cached::Turn(body));
                }
                for (index, text) in conv.summary_texts.release() {
                    self.cache.insert(
                        (digest, KIND_SUMMARY_TEXT, u64::from(index)),
                        Cached::SummaryText(text),
                    );
                }
            }
        }
        Ok(())
    }

    /// Commits since this store was opened.
    pub fn commits(&self) -> u64 {
        self.commits
    }

    /// The backend under the layout (e.g. to reopen a copy of it).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.commits_since_flush = 0;
        self.backend.flush()
    }

    /// A large payload by its content address.
    pub fn put_blob(&mut self, key: &str, bytes: &[u8]) -> Result<(), StoreError> {
        self.backend.commit(
            &[Write::Put {
                table: Table::Blobs,
                key: key.as_bytes().to_vec(),
                value: bytes.to_vec(),
            }],
            false,
        )
    }

    pub fn blob(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.backend.get(Table::Blobs, key.as_bytes())
    }
}

/// [`TurnBodies`] of a store: resident, cached, then stored.
pub struct StoredBodies<'a, B: KvBackend> {
    store: &'a StateStore<B>,
    /// The digest of the conversation key read last: one assembly reads
    /// many bodies of one conversation.
    last_key: std::cell::RefCell<Option<(String, IdDigest)>>,
}

impl<B: KvBackend> StoredBodies<'_, B> {
    fn key_digest(&self, conv: &Conversation) -> IdDigest {
        let mut last = self.last_key.borrow_mut();
        match &*last {
            Some((key, digest)) if *key == conv.key => *digest,
            _ => {
                let digest = id_digest(&conv.key);
                *last = Some((conv.key.clone(), digest));
                digest
            }
        }
    }
}

impl<B: KvBackend> TurnBodies for StoredBodies<'_, B> {
    fn turn_body(&self, conv: &Conversation, seq: u64) -> Result<Arc<TurnBody>, BodyError> {
        if let Some(body) = conv.bodies.get(seq) {
            return Ok(Arc::clone(body));
        }
        self.store
            .stored_body_keyed(conv, self.key_digest(conv), seq)
    }

    fn summary_text(&self, conv: &Conversation, index: u32) -> Result<Arc<str>, BodyError> {
        if let Some(text) = conv.summary_texts.get(index) {
            return Ok(Arc::clone(text));
        }
        self.store
            .stored_summary_text(conv, self.key_digest(conv), index)
    }

    fn history(&self, conv: &Conversation) -> Result<Vec<HistoryEntry>, BodyError> {
        if let Some(all) = conv.history.all() {
            return Ok(all.to_vec());
        }
        let mut entries =
            self.store
                .read_history(&conv.key)
                .map_err(|e| BodyError::HistoryUnreadable {
                    conversation: conv.key.clone(),
                    source: e.into(),
                })?;
        // The store may hold some of the resident ones already (a commit
        // that has not dropped them yet): those before them come from it.
        entries.truncate(conv.history.first_resident());
        if !conv.history.verify(&entries) {
            return Err(BodyError::HistoryMismatch {
                conversation: conv.key.clone(),
            });
        }
        entries.extend_from_slice(conv.history.resident());
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{Envelope, EventBody, TurnAppended};
    use crate::core::fold::fold;
    use crate::core::message::{ChatMessage, Role};
    use crate::core::policy::PolicyConfig;
    use crate::store::memory_backend::MemoryBackend;

    /// Opens under one layout, another, then the first again, folding the
    /// same events each time from the start as the engine does: the store
    /// never counts a turn twice (it did when a switch left the old fold's
    /// chunks behind the new one's).
    #[test]
    fn a_layout_switch_never_counts_a_turn_twice() {
        let policy = PolicyConfig::default();
        let mut store = StateStore::new(MemoryBackend::default());
        for (round, fingerprint) in ["a", "b", "a", "a"].into_iter().enumerate() {
            let opened = store.open(fingerprint).unwrap();
            let mut state = opened.state;
            let mut dirty = BTreeSet::new();
            if opened.position == 0 {
                // Folded from the start in commits of a few turns, more
                // commits in some rounds than in others.
                for i in 0..12u64 {
                    let text = format!("turn {i} of the conversation about the build");
                    let turn = TurnAppended::from(ChatMessage::text(Role::User, text));
                    let e =
                        Envelope::new(format!("t{i}"), "c", 1 + i, EventBody::TurnAppended(turn));
                    fold(&mut state, &policy, &e);
                    dirty.insert("c".to_string());
                    if i % (round as u64 + 2) == 0 {
                        store
                            .commit(&mut state, &dirty, i + 1, fingerprint)
                            .unwrap();
                    }
                }
                store.commit(&mut state, &dirty, 12, fingerprint).unwrap();
            }
            let mut reopened = StateStore::new(store.backend().clone());
            reopened.open(fingerprint).unwrap();
            let conv = reopened.load_conversation("c").unwrap().unwrap();
            assert_eq!(conv.turns.len(), 12, "round {round} ({fingerprint})");
        }
    }

    #[test]
    fn keys_that_differ_after_a_zero_byte_keep_their_records_apart() {
        // Before record keys escaped 0 bytes, "a" scanned the records of
        // "a\0" (and refused them as corrupt) and took those of the last
        // key, crafted to look like its own chunk, into its state.
        let keys = ["a", "a\0", "a\0\x05\0\0\0\0\0\0\0\0", "\0", ""];
        let policy = PolicyConfig::default();
        let mut state = State::default();
        // The same events folded in memory alone: every body stays in it.
        let mut reference = State::default();
        let mut store = StateStore::new(MemoryBackend::default());
        let dirty: BTreeSet<String> = keys.iter().map(|k| k.to_string()).collect();
        for round in 0..2u64 {
            for (i, key) in keys.iter().enumerate() {
                let text = format!("turn {round} of conversation {i}");
                let turn = TurnAppended::from(ChatMessage::text(Role::User, text));
                let id = format!("{i}-{round}");
                let e = Envelope::new(id, *key, 1 + round, EventBody::TurnAppended(turn));
                fold(&mut state, &policy, &e);
                fold(&mut reference, &policy, &e);
            }
            store.commit(&mut state, &dirty, round + 1, "fp").unwrap();
        }
        let mut reopened = StateStore::new(store.backend().clone());
        let opened = reopened.open("fp").unwrap();
        assert_eq!(opened.position, 2);
        assert_eq!(reopened.conversation_keys().unwrap().len(), keys.len());
        for key in keys {
            let conv = reopened.load_conversation(key).unwrap().unwrap();
            assert_eq!(conv.turns.len(), 2, "{key:?}");
            assert_eq!(
                conv.hash_with(&reopened.bodies()).unwrap(),
                reference.conversations[key].hash()
            );
        }
        assert_eq!(
            reopened.state_hash(&opened.state).unwrap(),
            reference.hash()
        );
    }

    /// A conversation's bodies, committed in runs over a few commits, read
    /// back one by one from a store with an empty cache; a damaged run is
    /// an error that names the turn, and a turn past the last run is missing.
    #[test]
    fn bodies_read_back_from_their_runs_one_by_one() {
        let policy = PolicyConfig::default();
        let mut state = State::default();
        let mut reference = State::default();
        let mut store = StateStore::new(MemoryBackend::default());
        let dirty: BTreeSet<String> = ["c".to_string()].into();
        let turns = 300u64;
        for i in 0..turns {
            let text = format!("turn {i} {}", "of the build log ".repeat(120));
            let turn = TurnAppended::from(ChatMessage::text(Role::User, text));
            let e = Envelope::new(format!("t{i}"), "c", 1 + i, EventBody::TurnAppended(turn));
            fold(&mut state, &policy, &e);
            fold(&mut reference, &policy, &e);
            if i % 100 == 99 {
                store.commit(&mut state, &dirty, i + 1, "fp").unwrap();
            }
        }
        let runs = store
            .backend()
            .scan_prefix(Table::Records, &record_prefix("c", KIND_BODY_RUN))
            .unwrap();
        // ~2 KB a body: a few dozen to a run, and a run never spans commits.
        assert!(
            (6..=30).contains(&runs.len()),
            "{} runs for {turns} bodies",
            runs.len()
        );
        let reader = StateStore::new(store.backend().clone());
        let conv = reader.read_conversation("c").unwrap().unwrap();
        let want = &reference.conversations["c"];
        // With the cache, and without one (only the wanted body decoded).
        let uncached = StateStore::with_cache(store.backend().clone(), Arc::new(BodyCache::new(0)));
        for seq in (0..turns).rev() {
            for r in [&reader, &uncached] {
                let body = r.bodies().turn_body(&conv, seq).unwrap();
                assert_eq!(body, *want.bodies.get(seq).unwrap(), "turn {seq}");
            }
        }
        assert!(uncached.cache().is_empty());
        assert!(matches!(
            reader.bodies().turn_body(&conv, turns),
            Err(BodyError::Missing { seq, .. }) if seq == turns
        ));
        // The second run cut short (its table of offsets lost): its turns
        // fail with a reason. The third's first body damaged (0xc1 is no
        // MessagePack): that turn fails, the one after it reads.
        let first_of = |key: &[u8]| u64::from_be_bytes(key[key.len() - 8..].try_into().unwrap());
        let (second, cut) = runs[1].clone();
        let (third, mut flipped) = runs[2].clone();
        flipped[0] = 0xc1;
        let mut damaged = store.backend().clone();
        damaged
            .commit(
                &[
                    Write::Put {
                        table: Table::Records,
                        key: second.clone(),
                        value: cut[..cut.len() / 2].to_vec(),
                    },
                    Write::Put {
                        table: Table::Records,
                        key: third.clone(),
                        value: flipped,
                    },
                ],
                false,
            )
            .unwrap();
        let reader = StateStore::new(damaged);
        for seq in [first_of(&second), first_of(&second) + 1, first_of(&third)] {
            assert!(matches!(
                reader.bodies().turn_body(&conv, seq),
                Err(BodyError::Unreadable { seq: s, .. }) if s == seq
            ));
        }
        // Each keeps its cause: the run's damage, and under a damaged body
        // the decoder's own error.
        let cause = |seq, check: &dyn Fn(&body_runs::RunError)| {
            let err = reader.bodies().turn_body(&conv, seq).unwrap_err();
            let source = std::error::Error::source(&err).expect("a cause");
            check(source.downcast_ref().expect("a run's error"));
        };
        cause(first_of(&second), &|run| {
            assert!(matches!(
                run,
                body_runs::RunError::Truncated { .. } | body_runs::RunError::BadOffset { .. }
            ));
            assert!(std::error::Error::source(run).is_none());
        });
        cause(first_of(&third), &|run| {
            let decoder = std::error::Error::source(run).expect("the decoder's error");
            assert!(decoder.is::<rmp_serde::decode::Error>());
            let text = run.to_string();
            assert!(text.starts_with("turn body 0 of its run could not be decoded: "));
            assert!(text.ends_with(&decoder.to_string()), "{text}");
        });
        assert!(reader.bodies().turn_body(&conv, 0).is_ok());
        assert_eq!(
            reader
                .bodies()
                .turn_body(&conv, first_of(&third) + 1)
                .unwrap(),
            *want.bodies.get(first_of(&third) + 1).unwrap()
        );
    }
}
