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
    // A name built once: a `&str` key is made a header name (and this one,
    // not a standard NATS header, copied into a buffer) at every lookup, for
    // every message folded.
    const NAME: async_nats::HeaderName = async_nats::HeaderName::from_static(CONTENT_TYPE);
    if let Some(value) = headers.and_then(|h| h.get(NAME)) {
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
        let messages = drain(&mut cursor.consumer, max, None).await?;
        let mut records = Vec::with_capacity(messages.len());
        for message in messages {
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
        // last matching message counts it pending (1) or has none (0).
        let mut consumer: PullConsumer = self
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
        let pending = consumer.cached_info().num_pending;
        let newest = drain(&mut consumer, 1, Some(pending)).await;
        let name = consumer.cached_info().name.clone();
        let _ = self.stream.delete_consumer(&name).await;
        match newest?.first() {
            Some(message) => Ok(message.info().map_err(backend)?.stream_sequence),
            None => Ok(0),
        }
    }
}

/// How long a read waits for events its consumer counts as pending but a
/// no-wait fetch did not hand over.
const PENDING_WAIT: Duration = Duration::from_secs(5);

/// What [`drain`] asks its consumer for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pull {
    /// A no-wait fetch of up to this many.
    Fetch(usize),
    /// A request waiting up to [`PENDING_WAIT`] for exactly this many.
    Wait(usize),
    /// `max` read, or nothing pending: the read is whole.
    Done,
    /// A wait delivered none of the events the consumer still counts.
    Stalled(u64),
}

/// The pull after one that `delivered` messages (`have` in all, of
/// `max`), when the consumer counts `owed` more pending.
fn next_pull(max: usize, have: usize, delivered: usize, owed: u64, waited: bool) -> Pull {
    if owed == 0 || have >= max {
        return Pull::Done;
    }
    let want = max - have;
    match (delivered, waited) {
        (0, true) => Pull::Stalled(owed),
        (0, false) => Pull::Wait(want.min(usize::try_from(owed).unwrap_or(usize::MAX))),
        _ => Pull::Fetch(want),
    }
}

/// Up to `max` messages from `consumer`: all it has pending, up to `max`.
///
/// A no-wait fetch may end short: under load a CI run saw one end with
/// nothing while the consumer still counted two events pending (the
/// server refuses a no-wait pull while it believes earlier requests still
/// wait). Every caller takes an empty read for the end of the log, so this
/// trusts the consumer's count, not the fetch's end: each delivered
/// message says how many remain after it, and when a fetch delivers
/// nothing the consumer is asked (or the caller's `pending`, known from
/// the consumer's creation, is used once). What is still pending is asked
/// for again, waiting for exactly that many; a wait that delivers none is
/// an error, never a short read.
async fn drain(
    consumer: &mut PullConsumer,
    max: usize,
    mut pending: Option<u64>,
) -> Result<Vec<jetstream::Message>, LogError> {
    let mut messages: Vec<jetstream::Message> = Vec::new();
    let mut pull = Pull::Fetch(max);
    loop {
        let (batch, waited) = match pull {
            Pull::Done => return Ok(messages),
            Pull::Stalled(owed) => {
                return Err(LogError::Stalled {
                    owed,
                    waited_secs: PENDING_WAIT.as_secs(),
                })
            }
            Pull::Fetch(n) => (consumer.fetch().max_messages(n).messages().await, false),
            Pull::Wait(n) => (
                consumer
                    .batch()
                    .max_messages(n)
                    .expires(PENDING_WAIT)
                    .messages()
                    .await,
                true,
            ),
        };
        let mut batch = batch.map_err(backend)?;
        let before = messages.len();
        while let Some(message) = batch.next().await {
            messages.push(message.map_err(backend)?);
        }
        let owed = match messages[before..].last() {
            Some(last) => last.info().map_err(backend)?.pending,
            None => match pending.take().filter(|_| !waited) {
                Some(known) => known,
                None => consumer.info().await.map_err(backend)?.num_pending,
            },
        };
        pull = next_pull(max, messages.len(), messages.len() - before, owed, waited);
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
    fn a_read_is_whole_only_when_nothing_is_pending_or_max_is_read() {
        // A full fetch, or nothing left: done.
        assert_eq!(next_pull(4, 4, 4, 2, false), Pull::Done);
        assert_eq!(next_pull(100, 6, 6, 0, false), Pull::Done);
        assert_eq!(next_pull(100, 0, 0, 0, false), Pull::Done);
        // A short fetch with more pending: fetch the rest.
        assert_eq!(next_pull(100, 4, 4, 2, false), Pull::Fetch(96));
        // A fetch that ended empty while two are pending: wait for the two,
        // not for all 100 (a wait asks for exactly what is owed).
        assert_eq!(next_pull(100, 4, 0, 2, false), Pull::Wait(2));
        assert_eq!(next_pull(3, 0, 0, 7, false), Pull::Wait(3));
        // A wait that delivered some goes on; one that delivered none fails.
        assert_eq!(next_pull(100, 6, 2, 1, true), Pull::Fetch(94));
        assert_eq!(next_pull(100, 4, 0, 2, true), Pull::Stalled(2));
    }

    #[test]
    fn a_stalled_read_says_what_it_waited_for() {
        let err = LogError::Stalled {
            owed: 2,
            waited_secs: PENDING_WAIT.as_secs(),
        };
        let said = err.to_string();
        assert!(
            said.contains("2 events pending") && said.contains("within 5s"),
            "{said}"
        );
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
