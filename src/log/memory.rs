//! An in-memory [`EventLog`] for tests, benchmarks and `assemble --at`.

use crate::core::event::Encoding;
use crate::log::{EventLog, LogError, LogRecord, Position};

#[derive(Debug, Default, Clone)]
pub struct MemoryLog {
    records: Vec<(Encoding, Vec<u8>)>,
}

impl MemoryLog {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn len(&self) -> usize {
        self.records.len()
    }
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

impl EventLog for MemoryLog {
    async fn append(&mut self, encoding: Encoding, bytes: &[u8]) -> Result<Position, LogError> {
        self.records.push((encoding, bytes.to_vec()));
        Ok(self.records.len() as Position)
    }
    async fn append_batch(
        &mut self,
        records: &[(Encoding, Vec<u8>)],
    ) -> Result<Position, LogError> {
        self.records.extend_from_slice(records);
        Ok(self.records.len() as Position)
    }
    async fn read_after(
        &mut self,
        after: Position,
        max: usize,
    ) -> Result<Vec<LogRecord>, LogError> {
        Ok(self
            .records
            .iter()
            .enumerate()
            .skip(after as usize)
            .take(max)
            .map(|(i, (encoding, bytes))| LogRecord {
                position: i as u64 + 1,
                encoding: *encoding,
                bytes: bytes.clone(),
            })
            .collect())
    }
    async fn last_position(&mut self) -> Result<Position, LogError> {
        Ok(self.records.len() as Position)
    }
}
