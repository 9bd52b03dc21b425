//! The state layout over a [`KvBackend`]: each conversation is a head (its
//! small, changing fields) plus append-only chunks, so a commit writes only
//! what changed. A chunk holds what one commit appended to a conversation's
//! turns, summaries, applied ids, history and context (or the whole context
//! when it was edited otherwise: a summary replaced turns, a reset): one
//! record per conversation per commit rather than one per item, because the
//! store's cost is per record (a busy partition commits hundreds of turns
//! at once), and a head that does not grow with the conversation. The log
//! position the state reflects is written in the same atomic commit.

use crate::core::state::{ContextItem, Conversation, HistoryEntry, IdDigest, State, Summary, Turn};
use crate::log::Position;
use crate::store::{KvBackend, StoreError, Table, Write};
use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};

pub(crate) const POSITION_KEY: &[u8] = b"position";
pub(crate) const POLICY_KEY: &[u8] = b"policy";
const UNATTRIBUTED_KEY: &[u8] = b"unattributed_rejections";
const GLOBAL_SPEND_KEY: &[u8] = b"global_spend";

/// Key kind of a conversation's chunks (after the conversation key and a 0).
const KIND_CHUNK: u8 = 5;

/// How much of each append-only vector is already on disk, and how many
/// chunks hold it.
#[derive(Debug, Clone, Copy, Default)]
struct Persisted {
    turns: usize,
    summaries: usize,
    applied: usize,
    history: usize,
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
            applied: conv.applied.len(),
            history: conv.history.len(),
            context: conv.context.len(),
            context_edits: conv.context_edits.0,
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

impl Chunk<'_> {
    /// About the encoded size: the turns' payloads plus their fields.
    fn size_hint(&self) -> usize {
        let turns: u64 = self.turns.iter().map(|t| t.bytes + 96).sum();
        turns as usize + 32 * (self.applied.len() + self.context.len()) + 256
    }
}

/// Durable, incrementally written state.
pub struct StateStore<B: KvBackend> {
    backend: B,
    persisted: HashMap<String, Persisted>,
    /// Debug builds keep the committed contexts, to catch a fold edit that
    /// did not count itself in `context_edits` (it would be lost on disk).
    #[cfg(debug_assertions)]
    committed_contexts: HashMap<String, Vec<ContextItem>>,
    commits_since_flush: u32,
    /// Commits since this store was opened (what the ingest bench divides
    /// its events by).
    commits: u64,
    /// Make every N-th commit durable (1 = every commit).
    pub flush_every: u32,
}

/// The prefix of a conversation's chunk keys: its key with each 0 byte
/// written as 0, 0xff (a byte UTF-8 never holds), then 0 and the kind. So
/// no conversation's prefix begins another's: a key may hold any byte,
/// and `a` never reads the records of `a\0...` as its own.
fn chunk_prefix(conv: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(conv.len() + 10);
    for &b in conv.as_bytes() {
        key.push(b);
        if b == 0 {
            key.push(0xff);
        }
    }
    key.push(0);
    key.push(KIND_CHUNK);
    key
}

/// Big-endian sequence numbers: a prefix scan reads chunks in commit order.
fn chunk_key(conv: &str, seq: u64) -> Vec<u8> {
    let mut key = chunk_prefix(conv);
    key.extend_from_slice(&seq.to_be_bytes());
    key
}

fn encode<T: serde::Serialize>(value: &T) -> Vec<u8> {
    encode_sized(value, 0)
}

/// Encodes into a buffer of `capacity` bytes to start with (a chunk of
/// hundreds of turns would otherwise grow and copy its buffer many times).
fn encode_sized<T: serde::Serialize>(value: &T, capacity: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(capacity);
    rmp_serde::encode::write_named(&mut buf, value).expect("state records serialize");
    buf
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, StoreError> {
    rmp_serde::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        what: what.to_string(),
        detail: e.to_string(),
    })
}

impl<B: KvBackend> StateStore<B> {
    pub fn new(backend: B) -> Self {
        StateStore {
            backend,
            persisted: HashMap::new(),
            #[cfg(debug_assertions)]
            committed_contexts: HashMap::new(),
            commits_since_flush: 0,
            commits: 0,
            flush_every: 1,
        }
    }

    /// Loads the state and the position it reflects. A store written under
    /// another policy fingerprint is ignored (empty state, position 0) so the
    /// caller replays the log: the fold's output depends on the policy.
    pub fn load(&mut self, policy_fingerprint: &str) -> Result<(State, Position), StoreError> {
        let stored_policy = self.backend.get(Table::Meta, POLICY_KEY)?;
        if stored_policy
            .as_deref()
            .is_some_and(|p| p != policy_fingerprint.as_bytes())
        {
            tracing::warn!(
                "state store was folded under another policy; replaying the log from the start"
            );
            self.persisted.clear();
            #[cfg(debug_assertions)]
            self.committed_contexts.clear();
            return Ok((State::default(), 0));
        }
        let position = match self.backend.get(Table::Meta, POSITION_KEY)? {
            Some(b) if b.len() == 8 => u64::from_be_bytes(b.try_into().expect("8 bytes")),
            Some(_) => {
                return Err(StoreError::Corrupt {
                    what: "checkpoint".into(),
                    detail: "not 8 bytes".into(),
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
        for (key, head) in self.backend.scan_prefix(Table::Conversations, b"")? {
            let key = String::from_utf8(key).map_err(|e| StoreError::Corrupt {
                what: "conversation key".into(),
                detail: e.to_string(),
            })?;
            let mut conv: Conversation = decode(&head, "conversation head")?;
            let prefix = chunk_prefix(&key);
            let mut chunks = 0;
            for (rk, value) in self.backend.scan_prefix(Table::Records, &prefix)? {
                if rk.len() != prefix.len() + 8 {
                    return Err(StoreError::Corrupt {
                        what: "record key".into(),
                        detail: format!("{rk:?}"),
                    });
                }
                let chunk: Chunk = decode(&value, "conversation chunk")?;
                conv.turns.extend(chunk.turns.into_owned());
                conv.summaries.extend(chunk.summaries.into_owned());
                conv.applied.extend(chunk.applied.into_owned());
                conv.history.extend(chunk.history.into_owned());
                if chunk.context_replaced {
                    conv.context.clear();
                }
                conv.context.extend(chunk.context.into_owned());
                chunks += 1;
            }
            conv.rebuild_indexes();
            #[cfg(debug_assertions)]
            self.committed_contexts
                .insert(key.clone(), conv.context.clone());
            self.persisted
                .insert(key.clone(), Persisted::of(&conv, chunks));
            state.conversations.insert(key, conv);
        }
        Ok((state, position))
    }

    /// Writes the dirty conversations and the position in one atomic commit.
    pub fn commit(
        &mut self,
        state: &mut State,
        dirty: &BTreeSet<String>,
        position: Position,
        policy_fingerprint: &str,
    ) -> Result<(), StoreError> {
        let mut writes = Vec::new();
        let mut committed = Vec::with_capacity(dirty.len());
        for key in dirty {
            let Some(conv) = state.conversations.get_mut(key) else {
                continue;
            };
            let p = self.persisted.get(key).copied().unwrap_or_default();
            let context_appended =
                conv.context_edits.0 == p.context_edits && conv.context.len() >= p.context;
            #[cfg(debug_assertions)]
            self.check_context_edits_counted(key, conv, context_appended, p.context);
            let chunk = Chunk {
                turns: Cow::Borrowed(conv.turns.get(p.turns..).unwrap_or_default()),
                summaries: Cow::Borrowed(conv.summaries.get(p.summaries..).unwrap_or_default()),
                applied: Cow::Borrowed(conv.applied.get(p.applied..).unwrap_or_default()),
                history: Cow::Borrowed(conv.history.get(p.history..).unwrap_or_default()),
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
                    key: chunk_key(key, p.chunks),
                    value: encode_sized(&chunk, chunk.size_hint()),
                });
                p.chunks + 1
            } else {
                p.chunks
            };
            committed.push((key, chunks));
            // The head is everything but what the chunks hold.
            let turns = std::mem::take(&mut conv.turns);
            let summaries = std::mem::take(&mut conv.summaries);
            let applied = std::mem::take(&mut conv.applied);
            let history = std::mem::take(&mut conv.history);
            let context = std::mem::take(&mut conv.context);
            let head = encode(&*conv);
            conv.turns = turns;
            conv.summaries = summaries;
            conv.applied = applied;
            conv.history = history;
            conv.context = context;
            writes.push(Write::Put {
                table: Table::Conversations,
                key: key.as_bytes().to_vec(),
                value: head,
            });
        }
        writes.push(Write::Put {
            table: Table::Meta,
            key: POSITION_KEY.to_vec(),
            value: position.to_be_bytes().to_vec(),
        });
        writes.push(Write::Put {
            table: Table::Meta,
            key: POLICY_KEY.to_vec(),
            value: policy_fingerprint.as_bytes().to_vec(),
        });
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
        self.commits_since_flush += 1;
        let durable = self.commits_since_flush >= self.flush_every;
        self.backend.commit(&writes, durable)?;
        self.commits += 1;
        if durable {
            self.commits_since_flush = 0;
        }
        for (key, chunks) in committed {
            if let Some(conv) = state.conversations.get(key) {
                self.persisted
                    .insert(key.clone(), Persisted::of(conv, chunks));
            }
        }
        Ok(())
    }

    #[cfg(debug_assertions)]
    fn check_context_edits_counted(
        &mut self,
        key: &str,
        conv: &Conversation,
        appended: bool,
        persisted: usize,
    ) {
        let committed = self.committed_contexts.entry(key.to_string()).or_default();
        if appended {
            assert_eq!(
                &conv.context[..persisted],
                &committed[..],
                "conversation {key}: context edited without counting it in context_edits"
            );
        }
        committed.clone_from(&conv.context);
    }

    /// The backend under the layout (e.g. to reopen a copy of it).
    /// Commits since this store was opened.
    pub fn commits(&self) -> u64 {
        self.commits
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{Envelope, EventBody, TurnAppended};
    use crate::core::fold::fold;
    use crate::core::message::{ChatMessage, Role};
    use crate::core::policy::PolicyConfig;
    use crate::store::memory_backend::MemoryBackend;

    #[test]
    fn keys_that_differ_after_a_zero_byte_keep_their_records_apart() {
        // Before record keys escaped 0 bytes, "a" scanned the records of
        // "a\0" (and refused them as corrupt) and took those of the last
        // key, crafted to look like its own chunk, into its state.
        let keys = ["a", "a\0", "a\0\x05\0\0\0\0\0\0\0\0", "\0", ""];
        let policy = PolicyConfig::default();
        let mut state = State::default();
        let mut store = StateStore::new(MemoryBackend::default());
        let dirty: BTreeSet<String> = keys.iter().map(|k| k.to_string()).collect();
        for round in 0..2u64 {
            for (i, key) in keys.iter().enumerate() {
                let text = format!("turn {round} of conversation {i}");
                let turn = TurnAppended::from(ChatMessage::text(Role::User, text));
                let id = format!("{i}-{round}");
                let e = Envelope::new(id, *key, 1 + round, EventBody::TurnAppended(turn));
                fold(&mut state, &policy, &e);
            }
            store.commit(&mut state, &dirty, round + 1, "fp").unwrap();
        }
        let (loaded, position) = StateStore::new(store.backend().clone()).load("fp").unwrap();
        assert_eq!(position, 2);
        for key in keys {
            assert_eq!(loaded.conversations[key].turns.len(), 2, "{key:?}");
        }
        assert_eq!(loaded.hash(), state.hash());
    }
}
