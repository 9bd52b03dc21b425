//! Durable state: a transactional key-value backend ([`KvBackend`]: redb by
//! default, sled behind the `sled-store` feature) and the state layout on top
//! of it ([`state_store`]): materialized conversations, turn bodies, blobs
//! and the log position they reflect, committed together.

mod body_runs;
pub mod config;
pub mod memory_backend;
pub mod redb_backend;
#[cfg(feature = "sled-store")]
pub mod sled_backend;
pub mod state_store;

pub use config::{StoreBackend, StoreConfig};

/// The named tables of the state store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Table {
    /// Checkpoints (log positions) and store metadata.
    Meta,
    /// Materialized per-conversation state heads.
    Conversations,
    /// Append-only records (turns, summaries, applied ids) keyed by conversation and sequence.
    Records,
    /// Large payloads, content-addressed.
    Blobs,
}

impl Table {
    pub const ALL: [Table; 4] = [
        Table::Meta,
        Table::Conversations,
        Table::Records,
        Table::Blobs,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Table::Meta => "meta",
            Table::Conversations => "conversations",
            Table::Records => "records",
            Table::Blobs => "blobs",
        }
    }
}

/// One write in an atomic commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    Put {
        table: Table,
        key: Vec<u8>,
        value: Vec<u8>,
    },
    Delete {
        table: Table,
        key: Vec<u8>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state store at {path} could not be opened: {source}")]
    Open {
        path: String,
        /// The backend's error, an [`OpenStep`] naming the step it failed
        /// at, or a sentence saying what to do.
        #[source]
        source: crate::BoxError,
    },
    #[error("state store error: {what}: {source}")]
    Backend {
        /// The backend and the operation (`redb commit`).
        what: String,
        #[source]
        source: crate::BoxError,
    },
    #[error(
        "state store holds an unreadable record ({what}): {source}; run `contextfold rebuild`"
    )]
    Corrupt {
        what: String,
        #[source]
        source: crate::BoxError,
    },
    #[error(
        "state store was written in {found}, this build reads {expected}: a command that \
         folds (`contextfold run /dev/null`, or a serve) refolds the log into it; `contextfold \
         rebuild` builds a fresh copy beside it"
    )]
    OtherLayout { found: String, expected: String },
    #[error("state store was opened read-only; a read-only command never writes it")]
    ReadOnly,
}

/// The step of opening a store that failed, and its cause.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {source}")]
pub struct OpenStep {
    /// What was being done (`cannot open table records`).
    pub step: String,
    #[source]
    pub source: crate::BoxError,
}

impl OpenStep {
    /// `source` at `step`, boxed as an [`StoreError::Open`]'s cause.
    pub fn boxed(step: impl Into<String>, source: impl Into<crate::BoxError>) -> crate::BoxError {
        Box::new(OpenStep {
            step: step.into(),
            source: source.into(),
        })
    }
}

impl From<crate::core::state::BodyError> for StoreError {
    /// A body the state names and the store cannot give.
    fn from(e: crate::core::state::BodyError) -> StoreError {
        StoreError::Corrupt {
            what: "turn body".into(),
            source: e.into(),
        }
    }
}

/// One key and its value.
pub type Entry = (Vec<u8>, Vec<u8>);

/// Key-value pairs in key order.
pub type Entries = Vec<Entry>;

/// A transactional key-value store with a few named tables.
pub trait KvBackend: Send {
    fn get(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;

    /// All entries whose key starts with `prefix`, in key order.
    fn scan_prefix(&self, table: Table, prefix: &[u8]) -> Result<Entries, StoreError>;

    /// The entry with the greatest key at or before `key` among those that
    /// start with `prefix` (`key` starts with `prefix`): what holds `key`
    /// when records are keyed by the first of a run of keys.
    fn last_at_or_before(
        &self,
        table: Table,
        prefix: &[u8],
        key: &[u8],
    ) -> Result<Option<Entry>, StoreError>;

    /// Applies every write or none. With `durable`, the commit is on disk
    /// when this returns; without, it is atomic and ordered but may be lost
    /// in a crash together with every later commit (never torn).
    fn commit(&mut self, writes: &[Write], durable: bool) -> Result<(), StoreError>;

    /// Makes every earlier commit durable.
    fn flush(&mut self) -> Result<(), StoreError>;
}
