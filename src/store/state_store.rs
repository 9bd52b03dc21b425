//! The state layout over a [`KvBackend`]: each conversation is a head (its
//! small, changing fields) plus append-only records (turns, summaries,
//! applied ids, history), so a commit writes only what changed. The log
//! position the state reflects is written in the same atomic commit.

use crate::core::state::{Conversation, HistoryEntry, IdDigest, State, Summary, Turn};
use crate::log::Position;
use crate::store::{KvBackend, StoreError, Table, Write};
use std::collections::{BTreeSet, HashMap};

const POSITION_KEY: &[u8] = b"position";
const POLICY_KEY: &[u8] = b"policy";
const UNATTRIBUTED_KEY: &[u8] = b"unattributed_rejections";
const GLOBAL_SPEND_KEY: &[u8] = b"global_spend";

const KIND_TURN: u8 = 1;
const KIND_SUMMARY: u8 = 2;
const KIND_APPLIED: u8 = 3;
const KIND_HISTORY: u8 = 4;

/// How much of each append-only vector is already on disk.
#[derive(Debug, Clone, Copy, Default)]
struct Persisted {
    turns: usize,
    summaries: usize,
    applied: usize,
    history: usize,
}

impl Persisted {
    /// All of `conv`'s records, as they are once it is committed.
    fn of(conv: &Conversation) -> Persisted {
        Persisted {
            turns: conv.turns.len(),
            summaries: conv.summaries.len(),
            applied: conv.applied.len(),
            history: conv.history.len(),
        }
    }
}

/// Durable, incrementally written state.
pub struct StateStore<B: KvBackend> {
    backend: B,
    persisted: HashMap<String, Persisted>,
    commits_since_flush: u32,
    /// Make every N-th commit durable (1 = every commit).
    pub flush_every: u32,
}

fn record_key(conv: &str, kind: u8, index: usize) -> Vec<u8> {
    let mut key = Vec::with_capacity(conv.len() + 10);
    key.extend_from_slice(conv.as_bytes());
    key.push(0);
    key.push(kind);
    key.extend_from_slice(&(index as u64).to_be_bytes());
    key
}

fn encode<T: serde::Serialize>(value: &T) -> Vec<u8> {
    rmp_serde::to_vec_named(value).expect("state records serialize")
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
            commits_since_flush: 0,
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
            let mut prefix = key.as_bytes().to_vec();
            prefix.push(0);
            for (rk, value) in self.backend.scan_prefix(Table::Records, &prefix)? {
                match rk.get(prefix.len()) {
                    Some(&KIND_TURN) => conv.turns.push(decode::<Turn>(&value, "turn")?),
                    Some(&KIND_SUMMARY) => {
                        conv.summaries.push(decode::<Summary>(&value, "summary")?)
                    }
                    Some(&KIND_APPLIED) => {
                        conv.applied.push(decode::<IdDigest>(&value, "applied id")?)
                    }
                    Some(&KIND_HISTORY) => conv
                        .history
                        .push(decode::<HistoryEntry>(&value, "history")?),
                    _ => {
                        return Err(StoreError::Corrupt {
                            what: "record key".into(),
                            detail: format!("{rk:?}"),
                        })
                    }
                }
            }
            conv.rebuild_indexes();
            self.persisted.insert(key.clone(), Persisted::of(&conv));
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
        for key in dirty {
            let Some(conv) = state.conversations.get_mut(key) else {
                continue;
            };
            let p = self.persisted.get(key).copied().unwrap_or_default();
            for (i, t) in conv.turns.iter().enumerate().skip(p.turns) {
                writes.push(Write::Put {
                    table: Table::Records,
                    key: record_key(key, KIND_TURN, i),
                    value: encode(t),
                });
            }
            for (i, s) in conv.summaries.iter().enumerate().skip(p.summaries) {
                writes.push(Write::Put {
                    table: Table::Records,
                    key: record_key(key, KIND_SUMMARY, i),
                    value: encode(s),
                });
            }
            for (i, a) in conv.applied.iter().enumerate().skip(p.applied) {
                writes.push(Write::Put {
                    table: Table::Records,
                    key: record_key(key, KIND_APPLIED, i),
                    value: encode(a),
                });
            }
            for (i, h) in conv.history.iter().enumerate().skip(p.history) {
                writes.push(Write::Put {
                    table: Table::Records,
                    key: record_key(key, KIND_HISTORY, i),
                    value: encode(h),
                });
            }
            // The head is everything but the append-only vectors.
            let turns = std::mem::take(&mut conv.turns);
            let summaries = std::mem::take(&mut conv.summaries);
            let applied = std::mem::take(&mut conv.applied);
            let history = std::mem::take(&mut conv.history);
            let head = encode(&*conv);
            conv.turns = turns;
            conv.summaries = summaries;
            conv.applied = applied;
            conv.history = history;
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
        if durable {
            self.commits_since_flush = 0;
        }
        for key in dirty {
            if let Some(conv) = state.conversations.get(key) {
                self.persisted.insert(key.clone(), Persisted::of(conv));
            }
        }
        Ok(())
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
