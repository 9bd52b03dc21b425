//! The default [`KvBackend`]: one redb database file with one redb table per
//! [`Table`], keyed and valued by raw bytes.
//!
//! A commit is one redb write transaction. Non-durable commits use
//! `Durability::None` (atomic and ordered, not fsync'd); a durable commit or
//! [`KvBackend::flush`] is a `Durability::Immediate` commit, which makes it
//! and every earlier commit durable.

use super::{KvBackend, StoreError, Table, Write};
use redb::{Database, Durability, ReadableDatabase, TableDefinition};
use std::path::{Path, PathBuf};

fn definition(table: Table) -> TableDefinition<'static, &'static [u8], &'static [u8]> {
    TableDefinition::new(table.name())
}

fn backend_error(what: &str) -> impl FnOnce(redb::Error) -> StoreError + '_ {
    move |e| StoreError::Backend(format!("redb {what}: {e}"))
}

/// State store tables in a single redb file.
#[derive(Debug)]
pub struct RedbBackend {
    db: Database,
    path: PathBuf,
}

impl RedbBackend {
    /// Opens the database file at `path`, creating it (and its parent
    /// directories) when missing, and makes sure every table exists so that
    /// reads never meet a missing table.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let open_error = |detail: String| StoreError::Open {
            path: path.display().to_string(),
            detail,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|e| open_error(format!("cannot create its directory: {e}")))?;
        }
        let db = Database::create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => open_error(
                "it is already open in another process; stop that process or choose \
                 another --data directory"
                    .into(),
            ),
            other => open_error(other.to_string()),
        })?;
        let txn = db
            .begin_write()
            .map_err(|e| open_error(format!("cannot begin a transaction: {e}")))?;
        for table in Table::ALL {
            txn.open_table(definition(table))
                .map_err(|e| open_error(format!("cannot open table {}: {e}", table.name())))?;
        }
        txn.commit()
            .map_err(|e| open_error(format!("cannot create the tables: {e}")))?;
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

impl KvBackend for RedbBackend {
    fn get(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let txn = self
            .db
            .begin_read()
            .map_err(|e| backend_error("begin read")(e.into()))?;
        let t = txn
            .open_table(definition(table))
            .map_err(|e| backend_error("open table")(e.into()))?;
        let value = t
            .get(key)
            .map_err(|e| backend_error("get")(e.into()))?
            .map(|v| v.value().to_vec());
        Ok(value)
    }

    fn scan_prefix(
        &self,
        table: Table,
        prefix: &[u8],
    ) -> Result<crate::store::Entries, StoreError> {
        let txn = self
            .db
            .begin_read()
            .map_err(|e| backend_error("begin read")(e.into()))?;
        let t = txn
            .open_table(definition(table))
            .map_err(|e| backend_error("open table")(e.into()))?;
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
