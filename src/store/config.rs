//! `[store]`: which state store backend, and what it keeps in memory
//! (part of [`crate::config::Config`], which re-exports it).

use serde::{Deserialize, Serialize};

/// Which state store backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StoreBackend {
    /// redb (default): see README for the soak numbers behind the choice.
    #[default]
    Redb,
    /// sled 0.34: refused by [`StoreConfig::validate`], since `run` and
    /// `serve` open redb stores only (the `sled-store` feature builds the
    /// backend for the conformance tests).
    Sled,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    pub backend: StoreBackend,
    /// Make every N-th state commit durable (1 = every commit).
    pub flush_every: u32,
    /// Bytes of turn bodies kept in memory per state store for assembly
    /// and summarization to read again (default 128 MiB; 0 turns the cache
    /// off: every body is read from the store).
    pub body_cache_bytes: u64,
    /// Conversations kept in memory per state store; beyond it the least
    /// recently touched are dropped after a commit (their state stays on
    /// disk and is read again when touched). Default 10,000.
    pub resident_conversations: usize,
    /// A conversation untouched this long is dropped from memory at the
    /// next commit (default 600,000 ms).
    pub conversation_idle_ms: u64,
    /// Bytes of redb pages each state store keeps in memory (default
    /// 16 MiB; `serve` opens one store per partition it owns).
    pub redb_cache_bytes: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            backend: StoreBackend::Redb,
            flush_every: 1,
            body_cache_bytes: crate::store::state_store::DEFAULT_BODY_CACHE_BYTES,
            resident_conversations: 10_000,
            conversation_idle_ms: 600_000,
            redb_cache_bytes: crate::store::redb_backend::DEFAULT_CACHE_BYTES as u64,
        }
    }
}

impl StoreConfig {
    /// Refuses what this build cannot honour; the message says what to do.
    pub fn validate(&self) -> Result<(), String> {
        if self.resident_conversations == 0 {
            return Err("store.resident_conversations must be at least 1".into());
        }
        if self.flush_every == 0 {
            return Err("store.flush_every must be at least 1".into());
        }
        if self.backend == StoreBackend::Sled {
            return Err(if cfg!(feature = "sled-store") {
                "store.backend = \"sled\": `run` and `serve` open redb stores only; the sled \
                 backend is built for the conformance tests (cargo test --features sled-store \
                 --test store_conformance). Remove the setting to use redb"
                    .into()
            } else {
                "store.backend = \"sled\" needs contextfold built with `--features \
                 sled-store`; this build has only redb. Remove the setting to use redb"
                    .into()
            });
        }
        Ok(())
    }
}
