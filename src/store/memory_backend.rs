//! An in-memory [`KvBackend`] for tests and benchmarks of the pure parts.

use crate::store::{KvBackend, StoreError, Table, Write};
use std::collections::BTreeMap;

#[derive(Debug, Default, Clone)]
pub struct MemoryBackend {
    tables: BTreeMap<(u8, Vec<u8>), Vec<u8>>,
}

fn tag(t: Table) -> u8 {
    t as u8
}

impl KvBackend for MemoryBackend {
    fn get(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.tables.get(&(tag(table), key.to_vec())).cloned())
    }
    fn scan_prefix(
        &self,
        table: Table,
        prefix: &[u8],
    ) -> Result<crate::store::Entries, StoreError> {
        Ok(self
            .tables
            .range((tag(table), prefix.to_vec())..)
            .take_while(|((t, k), _)| *t == tag(table) && k.starts_with(prefix))
            .map(|((_, k), v)| (k.clone(), v.clone()))
            .collect())
    }
    fn last_at_or_before(
        &self,
        table: Table,
        prefix: &[u8],
        key: &[u8],
    ) -> Result<Option<crate::store::Entry>, StoreError> {
        Ok(self
            .tables
            .range(..=(tag(table), key.to_vec()))
            .next_back()
            .filter(|((t, k), _)| *t == tag(table) && k.starts_with(prefix))
            .map(|((_, k), v)| (k.clone(), v.clone())))
    }
    fn commit(&mut self, writes: &[Write], _durable: bool) -> Result<(), StoreError> {
        for w in writes {
            match w {
                Write::Put { table, key, value } => {
                    self.tables
                        .insert((tag(*table), key.clone()), value.clone());
                }
                Write::Delete { table, key } => {
                    self.tables.remove(&(tag(*table), key.clone()));
                }
            }
        }
        Ok(())
    }
    fn flush(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
}
