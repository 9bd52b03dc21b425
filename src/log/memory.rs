//! An in-memory [`EventLog`] for tests, benchmarks and `assemble --at`.

use crate::core::event::{Encoding, Origin};
use crate::log::{Appended, EventLog, LogError, LogRecord, Position};

#[derive(Debug, Default, Clone)]
pub struct MemoryLog {
    records: Vec<(Origin, Encoding, bytes::Bytes)>,
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
    async fn append(
        &mut self,
        origin: Origin,
        encoding: Encoding,
        bytes: &[u8],
    ) -> Result<Position, LogError> {
        self.records
            .push((origin, encoding, bytes::Bytes::copy_from_slice(bytes)));
        Ok(self.records.len() as Position)
    }
    async fn append_batch(&mut self, records: &[Appended]) -> Result<Position, LogError> {
        self.records.extend(
            records
                .iter()
                .map(|(o, e, b)| (*o, *e, bytes::Bytes::copy_from_slice(b))),
        );
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
            .map(|(i, (origin, encoding, bytes))| {
                LogRecord::unaddressed(i as u64 + 1, *origin, *encoding, bytes.clone())
            })
            .collect())
    }
    async fn last_position(&mut self) -> Result<Position, LogError> {
        Ok(self.records.len() as Position)
    }
}
