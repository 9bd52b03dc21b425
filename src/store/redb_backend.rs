//! The default [`KvBackend`]: one redb database file with one redb table per
//! [`Table`], keyed and valued by raw bytes.
//!
//! A commit is one redb write transaction. Non-durable commits use
//! `Durability::None` (atomic and ordered, not fsync'd); a durable commit or
//! [`KvBackend::flush`] is a `Durability::Immediate` commit, which makes it
//! and every earlier commit durable.

use super::{KvBackend, OpenStep, StoreError, Table, Write};
use crate::BoxError;
use redb::{Database, Durability, ReadableDatabase, ReadableTableMetadata, TableDefinition};
use std::path::{Path, PathBuf};

fn definition(table: Table) -> TableDefinition<'static, &'static [u8], &'static [u8]> {
    TableDefinition::new(table.name())
}

fn backend_error(what: &str) -> impl FnOnce(redb::Error) -> StoreError + '_ {
    move |e| StoreError::Backend {
        what: format!("redb {what}"),
        source: e.into(),
    }
}

/// What a state store file says of itself, read without writing to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSummary {
    /// Log (stream) position the stored state reflects; 0 when none.
    pub position: u64,
    /// Policy fingerprint the state was folded under, if any was stored.
    pub policy_fingerprint: Option<String>,
    pub conversations: usize,
}

/// Why [`inspect`] could not read a store.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// Another process (a running serve) has it open: normal.
    #[error("{0} is in use by another process")]
    InUse(String),
    /// Not closed cleanly: the next read-write open repairs it.
    #[error("{0} needs recovery after an unclean stop; the next serve repairs it on open")]
    NeedsRepair(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Reads a store's position, policy fingerprint and conversation count
/// through a read-only open: nothing is created or written, and a store a
/// running process holds is reported as in use.
pub fn inspect(path: &Path) -> Result<StoreSummary, InspectError> {
    let open_error = |source: BoxError| StoreError::Open {
        path: path.display().to_string(),
        source,
    };
    let db = redb::ReadOnlyDatabase::open(path).map_err(|e| match e {
        redb::DatabaseError::DatabaseAlreadyOpen => InspectError::InUse(path.display().to_string()),
        redb::DatabaseError::RepairAborted => InspectError::NeedsRepair(path.display().to_string()),
        other => open_error(other.into()).into(),
    })?;
    let txn = db
        .begin_read()
        .map_err(|e| backend_error("begin read")(e.into()))?;
    let meta = txn
        .open_table(definition(Table::Meta))
        .map_err(|e| backend_error("open table")(e.into()))?;
    let get = |key: &[u8]| -> Result<Option<Vec<u8>>, StoreError> {
        Ok(meta
            .get(key)
            .map_err(|e| backend_error("get")(e.into()))?
            .map(|v| v.value().to_vec()))
    };
    let position = match get(super::state_store::POSITION_KEY)? {
        Some(b) => <[u8; 8]>::try_from(b.as_slice())
            .map(u64::from_be_bytes)
            .map_err(|_| StoreError::Corrupt {
                what: "checkpoint".into(),
                source: "not 8 bytes".into(),
            })?,
        None => 0,
    };
    let policy_fingerprint =
        get(super::state_store::POLICY_KEY)?.map(|b| String::from_utf8_lossy(&b).into_owned());
    let conversations = txn
        .open_table(definition(Table::Conversations))
        .map_err(|e| backend_error("open table")(e.into()))?
        .len()
        .map_err(|e| backend_error("count")(e.into()))?;
    Ok(StoreSummary {
        position,
        policy_fingerprint,
        conversations: usize::try_from(conversations).unwrap_or(usize::MAX),
    })
}

/// The page cache a redb store keeps by default: 16 MiB. `run` over the
/// real-transcript fleet is as fast with it as with 64 MiB and peaks
/// ~51 MiB lower, and `serve` opens one store per partition it owns
/// (docs/notes/issue-26.md, fifteenth pass).
pub const DEFAULT_CACHE_BYTES: usize = 16 << 20;

/// State store tables in a single redb file.
#[derive(Debug)]
pub struct RedbBackend {
    db: Database,
    path: PathBuf,
}

impl RedbBackend {
    /// [`RedbBackend::open_with_cache`] with [`DEFAULT_CACHE_BYTES`].
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::open_with_cache(path, DEFAULT_CACHE_BYTES)
    }

    /// Opens the database file at `path`, creating it (and its parent
    /// directories) when missing, and makes sure every table exists so that
    /// reads never meet a missing table. redb keeps up to `cache_bytes` of
    /// its pages in memory (its own default, 1 GiB, would let a process grow
    /// with its store: the bodies are read through the body cache instead).
    pub fn open_with_cache(path: &Path, cache_bytes: usize) -> Result<Self, StoreError> {
        let open_error = |source: BoxError| StoreError::Open {
            path: path.display().to_string(),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|e| open_error(OpenStep::boxed("cannot create its directory", e)))?;
        }
        let db = Database::builder()
            .set_cache_size(cache_bytes)
            .create(path)
            .map_err(|e| match e {
                redb::DatabaseError::DatabaseAlreadyOpen => open_error(
                    "it is already open in another process; stop that process or choose \
                 another --data directory"
                        .into(),
                ),
                other => open_error(other.into()),
            })?;
        let txn = db
            .begin_write()
            .map_err(|e| open_error(OpenStep::boxed("cannot begin a transaction", e)))?;
        for table in Table::ALL {
            txn.open_table(definition(table)).map_err(|e| {
                open_error(OpenStep::boxed(
                    format!("cannot open table {}", table.name()),
                    e,
                ))
            })?;
        }
        txn.commit()
            .map_err(|e| open_error(OpenStep::boxed("cannot create the tables", e)))?;
        Ok(RedbBackend {
            db,
            path: path.to_path_buf(),
        })
    }

    /// Path of the database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn durable_commit_of_nothing(&self) -> Result<(), StoreError> {
        let mut txn = self
            .db
            .begin_write()
            .map_err(|e| backend_error("begin flush")(e.into()))?;
        txn.set_durability(Durability::Immediate)
            .map_err(|e| backend_error("set durability")(e.into()))?;
        txn.commit()
            .map_err(|e| backend_error("flush commit")(e.into()))
    }
}

/// A read transaction as `begin_read` gives it.
type Begun = Result<redb::ReadTransaction, redb::TransactionError>;
/// One of the store's tables, read.
type ReadTable = redb::ReadOnlyTable<&'static [u8], &'static [u8]>;

/// A table of a read transaction; `None` when the store never wrote it (a
/// read-only store opened before its first commit of that table).
fn read_table(txn: Begun, table: Table) -> Result<Option<ReadTable>, StoreError> {
    let txn = txn.map_err(|e| backend_error("begin read")(e.into()))?;
    match txn.open_table(definition(table)) {
        Ok(t) => Ok(Some(t)),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(backend_error("open table")(e.into())),
    }
}

fn read_get(txn: Begun, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
    let Some(t) = read_table(txn, table)? else {
        return Ok(None);
    };
    let value = t
        .get(key)
        .map_err(|e| backend_error("get")(e.into()))?
        .map(|v| v.value().to_vec());
    Ok(value)
}

fn read_last_at_or_before(
    txn: Begun,
    table: Table,
    prefix: &[u8],
    key: &[u8],
) -> Result<Option<crate::store::Entry>, StoreError> {
    let Some(t) = read_table(txn, table)? else {
        return Ok(None);
    };
    let last = t
        .range::<&[u8]>(..=key)
        .map_err(|e| backend_error("seek")(e.into()))?
        .next_back()
        .transpose()
        .map_err(|e| backend_error("seek")(e.into()))?;
    Ok(last
        .filter(|(k, _)| k.value().starts_with(prefix))
        .map(|(k, v)| (k.value().to_vec(), v.value().to_vec())))
}

fn read_scan(txn: Begun, table: Table, prefix: &[u8]) -> Result<crate::store::Entries, StoreError> {
    let Some(t) = read_table(txn, table)? else {
        return Ok(Vec::new());
    };
    // An open-ended range cut off at the first key without the prefix:
    // computing an exclusive upper bound breaks on prefixes of 0xff bytes.
    let range = t
        .range::<&[u8]>(prefix..)
        .map_err(|e| backend_error("scan")(e.into()))?;
    let mut out = Vec::new();
    for entry in range {
        let (k, v) = entry.map_err(|e| backend_error("scan")(e.into()))?;
        let key = k.value();
        if !key.starts_with(prefix) {
            break;
        }
        out.push((key.to_vec(), v.value().to_vec()));
    }
    Ok(out)
}

impl KvBackend for RedbBackend {
    fn get(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        read_get(self.db.begin_read(), table, key)
    }

    fn scan_prefix(
        &self,
        table: Table,
        prefix: &[u8],
    ) -> Result<crate::store::Entries, StoreError> {
        read_scan(self.db.begin_read(), table, prefix)
    }

    fn last_at_or_before(
        &self,
        table: Table,
        prefix: &[u8],
        key: &[u8],
    ) -> Result<Option<crate::store::Entry>, StoreError> {
        read_last_at_or_before(self.db.begin_read(), table, prefix, key)
    }

    fn commit(&mut self, writes: &[Write], durable: bool) -> Result<(), StoreError> {
        if writes.is_empty() {
            return if durable {
                self.durable_commit_of_nothing()
            } else {
                Ok(())
            };
        }
        let mut txn = self
            .db
            .begin_write()
            .map_err(|e| backend_error("begin write")(e.into()))?;
        txn.set_durability(if durable {
            Durability::Immediate
        } else {
            Durability::None
        })
        .map_err(|e| backend_error("set durability")(e.into()))?;
        // redb allows one open handle per table in a transaction, so writes
        // are applied table by table; order within a table is kept, and
        // writes to different tables do not interact.
        for table in Table::ALL {
            let mut mine = writes.iter().filter(|w| match w {
                Write::Put { table: t, .. } | Write::Delete { table: t, .. } => *t == table,
            });
            let Some(first) = mine.next() else {
                continue;
            };
            let mut t = txn
                .open_table(definition(table))
                .map_err(|e| backend_error("open table")(e.into()))?;
            for write in std::iter::once(first).chain(mine) {
                match write {
                    Write::Put { key, value, .. } => {
                        t.insert(key.as_slice(), value.as_slice())
                            .map_err(|e| backend_error("put")(e.into()))?;
                    }
                    Write::Delete { key, .. } => {
                        t.remove(key.as_slice())
                            .map_err(|e| backend_error("delete")(e.into()))?;
                    }
                }
            }
        }
        // An error above drops `txn`, which aborts it: nothing is applied.
        txn.commit().map_err(|e| backend_error("commit")(e.into()))
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        self.durable_commit_of_nothing()
    }
}

/// A store opened for reading only (redb's read-only open): nothing is
/// created, repaired or written, so the file stays byte for byte as it
/// was; commits fail with [`StoreError::ReadOnly`]. What the read-only
/// commands (`status`, `assemble`, `grep`, ...) answer from.
pub struct ReadOnlyRedb {
    db: redb::ReadOnlyDatabase,
}

impl ReadOnlyRedb {
    /// Opens `path` read-only; a store a running process holds, or one
    /// that needs a repair after an unclean stop, is an error that says so.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let open_error = |source: BoxError| StoreError::Open {
            path: path.display().to_string(),
            source,
        };
        let db = redb::ReadOnlyDatabase::open(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => open_error(
                "it is open in another process (a running `run` or `serve`); ask that process \
                 (--nats) or wait until it ends"
                    .into(),
            ),
            redb::DatabaseError::RepairAborted => open_error(
                "it was not closed cleanly and needs a repair, which only a process that \
                 writes makes: run `contextfold run` (with no input: `run /dev/null`) once"
                    .into(),
            ),
            other => open_error(other.into()),
        })?;
        Ok(ReadOnlyRedb { db })
    }
}

impl KvBackend for ReadOnlyRedb {
    fn get(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        read_get(self.db.begin_read(), table, key)
    }

    fn scan_prefix(
        &self,
        table: Table,
        prefix: &[u8],
    ) -> Result<crate::store::Entries, StoreError> {
        read_scan(self.db.begin_read(), table, prefix)
    }

    fn last_at_or_before(
        &self,
        table: Table,
        prefix: &[u8],
        key: &[u8],
    ) -> Result<Option<crate::store::Entry>, StoreError> {
        read_last_at_or_before(self.db.begin_read(), table, prefix, key)
    }

    fn commit(&mut self, _writes: &[Write], _durable: bool) -> Result<(), StoreError> {
        Err(StoreError::ReadOnly)
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &[u8], value: &[u8]) -> Write {
        Write::Put {
            table: Table::Meta,
            key: key.to_vec(),
            value: value.to_vec(),
        }
    }

    #[test]
    fn inspect_reads_position_and_policy_and_sees_a_store_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.redb");
        let mut backend = RedbBackend::open(&path).unwrap();
        backend
            .commit(
                &[
                    put(
                        super::super::state_store::POSITION_KEY,
                        &42u64.to_be_bytes(),
                    ),
                    put(super::super::state_store::POLICY_KEY, b"fp-1"),
                ],
                true,
            )
            .unwrap();
        assert!(matches!(inspect(&path), Err(InspectError::InUse(_))));
        drop(backend);
        let summary = inspect(&path).unwrap();
        assert_eq!(summary.position, 42);
        assert_eq!(summary.policy_fingerprint.as_deref(), Some("fp-1"));
        assert_eq!(summary.conversations, 0);
        // Read-only: opening it again for writing still works and sees the same.
        let backend = RedbBackend::open(&path).unwrap();
        assert_eq!(
            backend
                .get(Table::Meta, super::super::state_store::POSITION_KEY)
                .unwrap(),
            Some(42u64.to_be_bytes().to_vec())
        );
    }

    #[test]
    fn an_open_that_fails_keeps_its_step_and_cause() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"not a directory").unwrap();
        let err = RedbBackend::open(&file.join("state.redb")).unwrap_err();
        assert!(matches!(err, StoreError::Open { .. }), "{err:?}");
        let step = std::error::Error::source(&err)
            .and_then(|s| s.downcast_ref::<OpenStep>())
            .expect("the step it failed at");
        assert_eq!(step.step, "cannot create its directory");
        let io = std::error::Error::source(step).expect("the I/O error");
        assert!(io.is::<std::io::Error>());
        assert!(err.to_string().ends_with(&io.to_string()), "{err}");
        // A sentence where there is no error value to keep.
        let path = dir.path().join("state.redb");
        let _held = RedbBackend::open(&path).unwrap();
        let err = RedbBackend::open(&path).unwrap_err();
        let sentence = std::error::Error::source(&err).unwrap().to_string();
        assert!(sentence.starts_with("it is already open in another process"));
    }
}
