//! The sled [`KvBackend`] (cargo feature `sled-store`): one sled tree per
//! [`Table`] in one sled database directory.
//!
//! A commit is one multi-tree sled transaction; a durable commit and
//! [`KvBackend::flush`] call `Db::flush`, which makes every earlier write
//! durable.
//!
//! Not the default, because sled 0.34.7 deadlocks under the store soak
//! (`benches/store_soak.rs`) with its default 512 KiB segments: the writer
//! holds the segment accountant's mutex in `SegmentAccountant::next` ->
//! `bump_tip` while waiting for a file truncation queued on sled's IO thread
//! pool, and every pool thread is blocked on that same mutex in
//! `sa_stabilize`. Truncations happen when segments at the end of the file
//! are freed, so this backend uses the largest segment size sled accepts
//! ([`SEGMENT_BYTES`]), which makes them rare. That is a mitigation, not a
//! fix: it costs disk space (the soak's store is ~67 MB where redb's is
//! ~2 MB) and the deadlock remains possible. sled records the segment size
//! in the database, so a database made with another size will not open.

use super::{KvBackend, OpenStep, StoreError, Table, Write};
use sled::transaction::{ConflictableTransactionError, TransactionError, TransactionalTree};
use sled::Transactional;
use std::path::{Path, PathBuf};

/// How long [`SledBackend::open`] waits for the lock of a database this
/// process has just closed. sled 0.34 releases its `flock` on the background
/// flusher thread, which `Db::drop` signals but does not join (sled issues
/// #1234, #1289), so a reopen right after a drop can meet the old handle's
/// lock for a few milliseconds. Another process holding the database keeps
/// it far longer, and is reported after this wait.
const LOCK_RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether sled failed to take the database's lock. sled 0.34.7 reports it
/// as `ErrorKind::Other` with the `flock` error only in the message, so the
/// message is what tells it apart from other I/O errors.
fn is_lock_contention(e: &std::io::Error) -> bool {
    e.to_string().starts_with("could not acquire lock on")
}

/// sled's segment size: its maximum, to make the truncations that can
/// deadlock sled 0.34.7 rare (see the module documentation).
pub const SEGMENT_BYTES: usize = 16 << 20;

fn backend_error(what: &str) -> impl FnOnce(sled::Error) -> StoreError + '_ {
    move |e| StoreError::Backend {
        what: format!("sled {what}"),
        source: e.into(),
    }
}

fn table_index(table: Table) -> usize {
    match table {
        Table::Meta => 0,
        Table::Conversations => 1,
        Table::Records => 2,
        Table::Blobs => 3,
    }
}

/// State store tables as trees of one sled database.
pub struct SledBackend {
    db: sled::Db,
    /// In [`Table::ALL`] order, indexed by [`table_index`].
    trees: Vec<sled::Tree>,
    path: PathBuf,
}

impl std::fmt::Debug for SledBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledBackend")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl SledBackend {
    /// Opens (creating if needed) the sled database directory at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let open_error = |source: crate::BoxError| StoreError::Open {
            path: path.display().to_string(),
            source,
        };
        let config = sled::Config::new().path(path).segment_size(SEGMENT_BYTES);
        let deadline = std::time::Instant::now() + LOCK_RELEASE_WAIT;
        let mut pause = std::time::Duration::from_millis(5);
        let db = loop {
            match config.open() {
                Ok(db) => break db,
                Err(sled::Error::Io(e))
                    if is_lock_contention(&e) && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_millis(100));
                }
                Err(e) => return Err(open_error(e.into())),
            }
        };
        let mut trees = Vec::with_capacity(Table::ALL.len());
        for table in Table::ALL {
            debug_assert_eq!(table_index(table), trees.len());
            let tree = db.open_tree(table.name()).map_err(|e| {
                open_error(OpenStep::boxed(
                    format!("cannot open tree {}", table.name()),
                    e,
                ))
            })?;
            trees.push(tree);
        }
        Ok(SledBackend {
            db,
            trees,
            path: path.to_path_buf(),
        })
    }

    /// Path of the database directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn tree(&self, table: Table) -> &sled::Tree {
        &self.trees[table_index(table)]
    }
}

fn apply(
    views: &[TransactionalTree],
    writes: &[Write],
) -> Result<(), ConflictableTransactionError<StoreError>> {
    for write in writes {
        match write {
            Write::Put { table, key, value } => {
                views[table_index(*table)].insert(key.as_slice(), value.as_slice())?;
            }
            Write::Delete { table, key } => {
                views[table_index(*table)].remove(key.as_slice())?;
            }
        }
    }
    Ok(())
}

impl KvBackend for SledBackend {
    fn get(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let value = self.tree(table).get(key).map_err(backend_error("get"))?;
        Ok(value.map(|v| v.to_vec()))
    }

    fn scan_prefix(
        &self,
        table: Table,
        prefix: &[u8],
    ) -> Result<crate::store::Entries, StoreError> {
        self.tree(table)
            .scan_prefix(prefix)
            .map(|entry| {
                entry
                    .map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .map_err(backend_error("scan"))
            })
            .collect()
    }

    fn last_at_or_before(
        &self,
        table: Table,
        prefix: &[u8],
        key: &[u8],
    ) -> Result<Option<crate::store::Entry>, StoreError> {
        let entry = self
            .tree(table)
            .range(..=key)
            .next_back()
            .transpose()
            .map_err(backend_error("seek"))?;
        Ok(entry
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.to_vec(), v.to_vec())))
    }

    fn commit(&mut self, writes: &[Write], durable: bool) -> Result<(), StoreError> {
        if !writes.is_empty() {
            self.trees
                .as_slice()
                .transaction(|views| apply(views, writes))
                .map_err(|e| match e {
                    TransactionError::Abort(e) => e,
                    TransactionError::Storage(e) => backend_error("commit")(e),
                })?;
        }
        if durable {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        self.db.flush().map(drop).map_err(backend_error("flush"))
    }
}
