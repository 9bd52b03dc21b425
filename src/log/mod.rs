//! The event log abstraction: the runtime appends and reads events only
//! through [`EventLog`]. The embedded implementation is a checksummed segment
//! file ([`segment`]); the NATS JetStream one lives in `crate::nats`.

pub mod memory;
pub mod segment;

use crate::core::event::Encoding;

/// Position of a record in a log: 1-based, 0 means "before the first".
pub type Position = u64;

/// One stored event, as bytes in the encoding it arrived in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub position: Position,
    pub encoding: Encoding,
    pub bytes: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("event log I/O error at {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("event log {path} is corrupt at byte {offset}: {detail}")]
    Corrupt {
        path: String,
        offset: u64,
        detail: String,
    },
    #[error("record of {size} bytes exceeds the log's {limit}-byte record limit")]
    TooLarge { size: usize, limit: usize },
    #[error("event log backend error: {0}")]
    Backend(String),
}

/// An append-only, ordered log of encoded events.
#[allow(async_fn_in_trait)]
pub trait EventLog {
    /// Appends one record and returns its position. Durable when it returns
    /// (for the embedded log: written and fsync'd).
    async fn append(&mut self, encoding: Encoding, bytes: &[u8]) -> Result<Position, LogError>;

    /// Appends many records with one sync; returns the last position.
    async fn append_batch(&mut self, records: &[(Encoding, Vec<u8>)])
        -> Result<Position, LogError>;

    /// Reads up to `max` records with position > `after`, in order.
    async fn read_after(&mut self, after: Position, max: usize)
        -> Result<Vec<LogRecord>, LogError>;

    /// Position of the newest record (0 when empty).
    async fn last_position(&mut self) -> Result<Position, LogError>;

    /// Appends one record that is readable at once and durable after the
    /// next [`EventLog::sync`]; logs without a cheaper path append durably.
    async fn append_deferred(
        &mut self,
        encoding: Encoding,
        bytes: &[u8],
    ) -> Result<Position, LogError> {
        self.append(encoding, bytes).await
    }

    /// Makes every deferred append durable.
    async fn sync(&mut self) -> Result<(), LogError> {
        Ok(())
    }
}
