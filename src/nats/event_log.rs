//! [`EventLog`] over the JetStream events stream.
//!
//! Appending publishes to the subject of the record's origin (`cf.in.<conv>`
//! for an agent's, `cf.svc.<conv>` for the service's) with `Nats-Msg-Id` =
//! the event's message id (`nats::msg_id`: scoped to its conversation), so
//! the server drops a republished event within the dedup window, and
//! `Content-Type` naming the encoding. The stream stores it as
//! `cf.ev.<partition>.<in|svc>.<conv>`; reading gives each record the
//! origin and conversation its stored subject names. Positions
//! are stream sequence numbers. A log opened for one partition reads only
//! that partition's events (positions are still stream sequences, so they
//! have gaps).

use crate::core::event::{Encoding, Envelope, Origin, MAX_EVENT_BYTES};
use crate::log::{Appended as AppendRecord, EventLog, LogError, LogRecord, Position};
use crate::nats::msg_id::AgentKey;
use crate::nats::publish::Outbound;
use crate::nats::subjects::Subjects;
use crate::nats::NatsError;
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::{self, stream, Context};
use async_nats::HeaderMap;
use futures::StreamExt;
use std::time::Duration;

pub use crate::nats::publish::{content_type, event_headers, CONTENT_TYPE};

/// The encoding of a received event: the `Content-Type` header when
/// present, else JSON when the body starts with `{` (a MessagePack event
/// starts with a map marker, never with `{`, which is the integer 123),
/// else MessagePack. Agents should set the header; the sniffing lets a
/// plain `nats pub cf.in.x '{...}'` work.
pub fn encoding_of(headers: Option<&HeaderMap>, payload: &[u8]) -> Encoding {
    if let Some(value) = headers.and_then(|h| h.get(CONTENT_TYPE)) {
        return Encoding::from_header(Some(value.as_str()));
    }
    match payload.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => Encoding::Json,
        _ => Encoding::Msgpack,
    }
}

/// Result of publishing one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    /// Stream sequence of the event (of the first copy, for a duplicate).
    pub position: Position,
    /// The server had this event id already (within the dedup window).
    pub duplicate: bool,
}

/// A reading position kept between `read_after` calls so sequential reads
/// reuse one consumer.
struct Cursor {
    consumer: PullConsumer,
    /// Position of the last record delivered through `consumer`.
    after: Position,
}

/// The events stream as an [`EventLog`].
pub struct NatsEventLog {
    js: Context,
    stream: stream::Stream,
    subjects: Subjects,
    partition: Option<u32>,
    cursor: Option<Cursor>,
    /// The publisher's key for agent message ids, if it has credentials.
    agent_key: Option<AgentKey>,
}

fn backend(err: impl Into<crate::BoxError>) -> LogError {
    LogError::Backend(err.into())
}

impl NatsEventLog {
    /// The whole events stream (every partition).
    pub async fn open(js: Context, subjects: Subjects) -> Result<Self, NatsError> {
        let name = subjects.events_stream();
        let stream = js
            .get_stream(&name)
            .await
            .map_err(|e| NatsError::js(format!("opening stream {name}"), e))?;
        Ok(NatsEventLog {
            js,
            stream,
            subjects,
            partition: None,
            cursor: None,
            agent_key: None,
        })
    }

    /// Publishes agent events with message ids keyed by `key` (from the
    /// publisher's credentials: [`AgentKey::from_secret`]).
    pub fn with_agent_key(mut self, key: Option<AgentKey>) -> Self {
        self.agent_key = key;
        self
    }

    /// Only the events of one partition.
    pub async fn open_partition(
        js: Context,
        subjects: Subjects,
        partition: u32,
    ) -> Result<Self, NatsError> {
        let mut log = NatsEventLog::open(js, subjects).await?;
        log.partition = Some(partition);
        Ok(log)
    }

    pub fn partition(&self) -> Option<u32> {
        self.partition
    }

    fn filter(&self) -> Option<String> {
        self.partition.map(|p| self.subjects.partition_filter(p))
    }

    async fn start_publish(
        &self,
        origin: Origin,
        id: &str,
        conversation: &str,
        encoding: Encoding,
        bytes: Vec<u8>,
    ) -> Result<PublishAckFuture, LogError> {
        if bytes.len() > MAX_EVENT_BYTES {
            return Err(LogError::TooLarge {
                size: bytes.len(),
                limit: MAX_EVENT_BYTES,
            });
        }
        Outbound::event_bytes(
            &self.subjects,
            origin,
            self.agent_key.as_ref(),
            id,
            conversation,
            encoding,
            bytes,
        )
        .map_err(backend)?
        .send(&self.js)
        .await
        .map_err(backend)
    }

    /// Publishes one event: `Nats-Msg-Id` = its id, `Content-Type` = its
    /// encoding; waits for the stream's acknowledgement.
    pub async fn append_event(
        &mut self,
        origin: Origin,
        event: &Envelope,
        encoding: Encoding,
    ) -> Result<Appended, LogError> {
        let ack = self
            .start_publish(
                origin,
                &event.id,
                &event.conversation,
                encoding,
                event.encode(encoding),
            )
            .await?
            .await
            .map_err(backend)?;
        Ok(Appended {
            position: ack.sequence,
            duplicate: ack.duplicate,
        })
    }

    async fn publish_encoded(
        &self,
        origin: Origin,
        encoding: Encoding,
        bytes: &[u8],
    ) -> Result<PublishAckFuture, LogError> {
        let (id, conversation) = Envelope::salvage_id(bytes, encoding);
        match (id, conversation) {
            (Some(id), Some(conversation)) if !id.is_empty() && !conversation.is_empty() => {
                self.start_publish(origin, &id, &conversation, encoding, bytes.to_vec())
                    .await
            }
            _ => Err(LogError::Backend(
                "cannot publish bytes without an event id and conversation: the subject and \
                 Nats-Msg-Id come from them"
                    .into(),
            )),
        }
    }

    async fn reader(&mut self, after: Position) -> Result<&mut Cursor, LogError> {
        let reusable = matches!(&self.cursor, Some(c) if c.after == after);
        if !reusable {
            if let Some(old) = self.cursor.take() {
                // Best effort: the server also drops it when inactive.
                let name = old.consumer.cached_info().name.clone();
                let _ = self.stream.delete_consumer(&name).await;
            }
            let config = pull::Config {
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: after + 1,
                },
                ack_policy: AckPolicy::None,
                filter_subject: self.filter().unwrap_or_default(),
                inactive_threshold: Duration::from_secs(60),
                memory_storage: true,
                ..Default::default()
            };
            let consumer = self.stream.create_consumer(config).await.map_err(backend)?;
            self.cursor = Some(Cursor { consumer, after });
        }
        self.cursor
            .as_mut()
            .ok_or_else(|| LogError::Backend("reader cursor vanished".into()))
    }
}

impl EventLog for NatsEventLog {
    async fn append(
        &mut self,
        origin: Origin,
        encoding: Encoding,
        bytes: &[u8],
    ) -> Result<Position, LogError> {
        let ack = self
            .publish_encoded(origin, encoding, bytes)
            .await?
            .await
            .map_err(backend)?;
        Ok(ack.sequence)
    }

    /// Pipelines the publishes, then waits for every acknowledgement.
    async fn append_batch(&mut self, records: &[AppendRecord]) -> Result<Position, LogError> {
        let mut pending = Vec::with_capacity(records.len());
        for (origin, encoding, bytes) in records {
            pending.push(self.publish_encoded(*origin, *encoding, bytes).await?);
        }
        let mut last = 0;
        for ack in pending {
            last = last.max(ack.await.map_err(backend)?.sequence);
        }
        if last == 0 {
            last = self.last_position().await?;
        }
        Ok(last)
    }

    async fn read_after(
        &mut self,
        after: Position,
        max: usize,
    ) -> Result<Vec<LogRecord>, LogError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let subjects = self.subjects.clone();
        let partition = self.partition;
        let cursor = self.reader(after).await?;
        let mut batch = cursor
            .consumer
            .fetch()
            .max_messages(max)
            .messages()
            .await
            .map_err(backend)?;
        let mut records = Vec::new();
        while let Some(message) = batch.next().await {
            let message = message.map_err(backend)?;
            let info = message.info().map_err(backend)?;
            let position = info.stream_sequence;
            let stored_at_ms =
                u64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).ok();
            let (origin, address) = subjects.stored_routing(message.subject.as_str(), partition);
            records.push(LogRecord {
                position,
                origin,
                address,
                stored_at_ms,
                encoding: encoding_of(message.headers.as_ref(), &message.payload),
                bytes: message.payload.clone(),
            });
        }
        if let Some(last) = records.last() {
            cursor.after = last.position;
        }
        Ok(records)
    }

    async fn last_position(&mut self) -> Result<Position, LogError> {
        let Some(filter) = self.filter() else {
            let info = self.stream.info().await.map_err(backend)?;
            return Ok(info.state.last_sequence);
        };
        // The newest event of the partition: a consumer starting at the
        // last matching message hands it over at once, or nothing.
        let consumer: PullConsumer = self
            .stream
            .create_consumer(pull::Config {
                deliver_policy: DeliverPolicy::Last,
                ack_policy: AckPolicy::None,
                filter_subject: filter,
                inactive_threshold: Duration::from_secs(10),
                memory_storage: true,
                ..Default::default()
            })
            .await
            .map_err(backend)?;
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .messages()
            .await
            .map_err(backend)?;
        let mut last = 0;
        if let Some(message) = batch.next().await {
            let message: jetstream::Message = message.map_err(backend)?;
            last = message.info().map_err(backend)?.stream_sequence;
        }
        let name = consumer.cached_info().name.clone();
        let _ = self.stream.delete_consumer(&name).await;
        Ok(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_comes_from_the_header_else_the_first_byte() {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, "application/json");
        assert_eq!(encoding_of(Some(&h), b"\x82"), Encoding::Json);
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, content_type(Encoding::Msgpack));
        assert_eq!(encoding_of(Some(&h), b"{}"), Encoding::Msgpack);
        assert_eq!(encoding_of(None, b"  {\"id\":1}"), Encoding::Json);
        assert_eq!(encoding_of(None, b"\x85\xa2id"), Encoding::Msgpack);
        assert_eq!(encoding_of(None, b""), Encoding::Msgpack);
    }

    #[test]
    fn headers_carry_id_and_type() {
        let h = event_headers("evt-1", Encoding::Json);
        assert_eq!(h.get("Nats-Msg-Id").map(|v| v.as_str()), Some("evt-1"));
        assert_eq!(
            h.get(CONTENT_TYPE).map(|v| v.as_str()),
            Some("application/json")
        );
    }
}
