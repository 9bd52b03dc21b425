//! The event log abstraction: the runtime appends and reads events only
//! through [`EventLog`]. The embedded implementation is a checksummed segment
//! file ([`segment`]); the NATS JetStream one lives in `crate::nats`.

pub mod memory;
pub mod segment;

use crate::core::event::{Encoding, Origin};
use crate::core::intake::{Address, Arrival};

/// Position of a record in a log: 1-based, 0 means "before the first".
pub type Position = u64;

/// One stored event, as bytes in the encoding it arrived in, with what the
/// log vouches for about it (see [`crate::core::intake`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub position: Position,
    /// Who wrote it, as the log knows it.
    pub origin: Origin,
    /// The conversation its subject named, for logs with subjects.
    pub address: Address,
    /// When the log stored it (ms since the Unix epoch), for logs that
    /// record it.
    pub stored_at_ms: Option<u64>,
    pub encoding: Encoding,
    pub bytes: bytes::Bytes,
}

impl LogRecord {
    /// A record of a log that names no conversation and keeps no time
    /// (the embedded logs).
    pub fn unaddressed(
        position: Position,
        origin: Origin,
        encoding: Encoding,
        bytes: impl Into<bytes::Bytes>,
    ) -> Self {
        LogRecord {
            position,
            origin,
            address: Address::Unaddressed,
            stored_at_ms: None,
            encoding,
            bytes: bytes.into(),
        }
    }

    /// What intake needs of it.
    pub fn arrival(&self) -> Arrival<'_> {
        Arrival {
            origin: self.origin,
            address: &self.address,
            stored_at_ms: self.stored_at_ms,
            encoding: self.encoding,
            bytes: &self.bytes,
        }
    }
}

/// A record to append: who writes it, its encoding and its bytes.
pub type Appended = (Origin, Encoding, Vec<u8>);

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
    #[error(
        "the event log counts {owed} events pending past this read but delivered none \
         within {waited_secs}s; retry, or check the server's health"
    )]
    Stalled { owed: u64, waited_secs: u64 },
    #[error("event log backend error: {0}")]
    Backend(#[source] crate::BoxError),
}

/// An append-only, ordered log of encoded events.
#[allow(async_fn_in_trait)]
pub trait EventLog {
    /// Appends one record and returns its position. Durable when it returns
    /// (for the embedded log: written and fsync'd).
    async fn append(
        &mut self,
        origin: Origin,
        encoding: Encoding,
        bytes: &[u8],
    ) -> Result<Position, LogError>;

    /// Appends many records with one sync; returns the last position.
    async fn append_batch(&mut self, records: &[Appended]) -> Result<Position, LogError>;

    /// Reads up to `max` records with position > `after`, in order.
    async fn read_after(&mut self, after: Position, max: usize)
        -> Result<Vec<LogRecord>, LogError>;

    /// Position of the newest record (0 when empty).
    async fn last_position(&mut self) -> Result<Position, LogError>;

    /// Appends one record that is readable at once and durable after the
    /// next [`EventLog::sync`]; logs without a cheaper path append durably.
    async fn append_deferred(
        &mut self,
        origin: Origin,
        encoding: Encoding,
        bytes: &[u8],
    ) -> Result<Position, LogError> {
        self.append(origin, encoding, bytes).await
    }

    /// Makes every deferred append durable.
    async fn sync(&mut self) -> Result<(), LogError> {
        Ok(())
    }

    /// [`EventLog::sync`], and `work` meanwhile where the log can wait on
    /// its storage without this thread (the segment log syncs on another
    /// thread); both have finished when this returns. A state commit runs
    /// its encoding here, and writes only once the sync has succeeded.
    async fn sync_while<T>(&mut self, work: impl FnOnce() -> T) -> (Result<(), LogError>, T) {
        let done = work();
        (self.sync().await, done)
    }
}
