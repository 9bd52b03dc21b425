//! Publishing to JetStream, in one place: every message the service
//! stores in a stream is built and sent here, and every header it sets is
//! named here.
//!
//! - **Events** ([`Outbound::event`], [`Publisher::event`]) go on the
//!   subject of their origin (`cf.in.<conv>` for agents, `cf.svc.<conv>`
//!   for the service) with `Nats-Msg-Id` = the event's message id
//!   (`nats::msg_id`: scoped to its conversation, unguessable for the
//!   service's) and `Content-Type` naming the encoding.
//! - **Jobs** ([`Outbound::job`]) go on the work queue with `Nats-Msg-Id` =
//!   the job id, so a republished job is dropped by the server.
//! - **Dead letters** ([`Publisher::dead_letter`] for refused records,
//!   [`dead_job`] for jobs that cannot run) carry their reason in headers.
//!
//! Every publish returns the stream's acknowledgement as a future, so a
//! caller can have many in flight and wait for them together.
//! [`PublishFailure::is_permanent`] tells a failure that publishing again
//! cannot mend (the message is larger than the server or stream takes) from
//! one that retrying can (no connection, no leader for a moment): a caller
//! never retries a permanent one for ever, it dead-letters it.

use crate::core::derived_id::DerivedId;
use crate::core::event::{Encoding, Envelope, Origin};
use crate::nats::msg_id::{self, AgentKey};
use crate::nats::setup::Infrastructure;
use crate::nats::subjects::{SubjectError, Subjects};
use crate::BoxError;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::Context;
use async_nats::HeaderMap;
use bytes::Bytes;

/// The header naming an event's encoding.
pub const CONTENT_TYPE: &str = "Content-Type";
/// Why a dead letter is there, one line.
pub const DEAD_REASON_HEADER: &str = "Contextfold-Dead-Reason";
/// The kind of refusal (`undecodable`, `unroutable`, ..., `unpublishable`).
pub const DEAD_KIND_HEADER: &str = "Contextfold-Dead-Kind";
/// The events stream sequence of the refused record, when it was one.
pub const DEAD_POSITION_HEADER: &str = "Contextfold-Dead-Position";
/// The partition that refused it.
pub const DEAD_PARTITION_HEADER: &str = "Contextfold-Dead-Partition";
/// The payload was cut to fit the dead-letter stream (original size).
pub const DEAD_TRUNCATED_HEADER: &str = "Contextfold-Dead-Truncated-From";
/// How many times a dead-lettered job was delivered.
pub const DEAD_DELIVERIES_HEADER: &str = "Contextfold-Deliveries";
/// The id of a dead-lettered job.
pub const DEAD_JOB_HEADER: &str = "Contextfold-Job-Id";

/// `Content-Type` value for an encoding.
pub fn content_type(encoding: Encoding) -> &'static str {
    match encoding {
        Encoding::Json => "application/json",
        Encoding::Msgpack => "application/msgpack",
    }
}

/// Headers for publishing one event with message id `msg_id`
/// ([`crate::nats::msg_id::of`]).
pub fn event_headers(msg_id: &str, encoding: Encoding) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, msg_id);
    headers.insert(CONTENT_TYPE, content_type(encoding));
    headers
}

/// One message for a stream as it goes on the wire: where, the id the
/// stream deduplicates it by, and the encoded body. Sending the same
/// `Outbound` again (a retry) is dropped by the server within its dedup
/// window.
#[derive(Debug, Clone)]
pub struct Outbound {
    pub subject: String,
    /// `Nats-Msg-Id`.
    pub msg_id: String,
    pub encoding: Encoding,
    pub bytes: Bytes,
}

impl Outbound {
    /// `event` as `origin` publishes it, encoded in `encoding`; `agent`
    /// keys an agent's message id ([`msg_id::of`]).
    pub fn event(
        subjects: &Subjects,
        origin: Origin,
        agent: Option<&AgentKey>,
        event: &Envelope,
        encoding: Encoding,
    ) -> Result<Outbound, SubjectError> {
        let subject = subjects.publish(origin, &event.conversation)?;
        Ok(Outbound {
            subject,
            msg_id: msg_id::of(origin, agent, &event.conversation, &event.id),
            encoding,
            bytes: event.encode(encoding).into(),
        })
    }

    /// Event `id` of `conversation`, already encoded as `bytes` (sent as
    /// given), as `origin` publishes it.
    pub fn event_bytes(
        subjects: &Subjects,
        origin: Origin,
        agent: Option<&AgentKey>,
        id: &str,
        conversation: &str,
        encoding: Encoding,
        bytes: impl Into<Bytes>,
    ) -> Result<Outbound, SubjectError> {
        Ok(Outbound {
            subject: subjects.publish(origin, conversation)?,
            msg_id: msg_id::of(origin, agent, conversation, id),
            encoding,
            bytes: bytes.into(),
        })
    }

    /// A job on the work queue (`subject`), MessagePack `bytes`, with the
    /// job id as its message id.
    pub fn job(subject: String, job_id: &str, bytes: impl Into<Bytes>) -> Outbound {
        Outbound {
            subject,
            msg_id: job_id.to_string(),
            encoding: Encoding::Msgpack,
            bytes: bytes.into(),
        }
    }

    /// Starts publishing: `Nats-Msg-Id` and `Content-Type` set.
    pub async fn send(&self, js: &Context) -> Result<PublishAckFuture, PublishError> {
        js.publish_with_headers(
            self.subject.clone(),
            event_headers(&self.msg_id, self.encoding),
            self.bytes.clone(),
        )
        .await
    }
}

/// Room kept for headers when a payload is cut to fit.
const HEADER_ROOM: usize = 8 * 1024;

/// A publish that did not reach the stream.
#[derive(Debug, thiserror::Error)]
pub enum PublishFailure {
    #[error("cannot route {what}: {source}")]
    Subject {
        what: String,
        #[source]
        source: SubjectError,
    },
    #[error("{what} of {size} bytes is larger than the {limit} bytes the stream takes")]
    TooLarge {
        what: String,
        size: usize,
        limit: usize,
    },
    #[error("publishing {what}: {source}")]
    Nats {
        what: String,
        #[source]
        source: BoxError,
    },
    #[error("waiting for the stream to store {what}: {source}")]
    NotStored {
        what: String,
        #[source]
        source: BoxError,
    },
}

impl PublishFailure {
    /// Publishing the same bytes again cannot succeed.
    pub fn is_permanent(&self) -> bool {
        match self {
            PublishFailure::Subject { .. } | PublishFailure::TooLarge { .. } => true,
            PublishFailure::Nats { source, .. } | PublishFailure::NotStored { source, .. } => {
                let d = source.to_string().to_ascii_lowercase();
                d.contains("max payload")
                    || d.contains("maximum payload")
                    || d.contains("message size")
            }
        }
    }
}

fn nats_failure(what: &str, e: async_nats::jetstream::context::PublishError) -> PublishFailure {
    let source: BoxError = match e.kind() {
        // The client refuses before sending: say it plainly.
        PublishErrorKind::MaxPayloadExceeded => "max payload size exceeded".into(),
        _ => e.into(),
    };
    PublishFailure::Nats {
        what: what.to_string(),
        source,
    }
}

/// What publishing needs: the context, the subjects and the size limit of
/// the events stream (its `max_message_size`, or the server's
/// `max_payload` when smaller).
#[derive(Clone)]
pub struct Publisher {
    pub js: Context,
    pub subjects: Subjects,
    pub max_message_bytes: usize,
}

impl Publisher {
    /// Publishes to `infra`'s events stream, as large as the stream's
    /// `max_message_size` (or the server's `max_payload` when smaller).
    pub fn for_events(js: Context, infra: &Infrastructure) -> Publisher {
        let stream_max = usize::try_from(infra.events.cached_info().config.max_message_size)
            .ok()
            .filter(|&m| m > 0)
            .unwrap_or(crate::core::event::MAX_EVENT_BYTES);
        let server_max = js.client().server_info().max_payload;
        let max_message_bytes = if server_max > 0 {
            stream_max.min(server_max)
        } else {
            stream_max
        };
        Publisher {
            js,
            subjects: infra.subjects.clone(),
            max_message_bytes,
        }
    }

    /// Starts publishing `event` as `origin` wrote it, MessagePack encoded.
    pub async fn event(
        &self,
        origin: Origin,
        event: &Envelope,
    ) -> Result<PublishAckFuture, PublishFailure> {
        self.event_encoded(origin, event, Encoding::Msgpack).await
    }

    /// [`Publisher::event`] in a chosen encoding.
    pub async fn event_encoded(
        &self,
        origin: Origin,
        event: &Envelope,
        encoding: Encoding,
    ) -> Result<PublishAckFuture, PublishFailure> {
        let what = || format!("{} {}", event.type_name(), event.id);
        let message =
            Outbound::event(&self.subjects, origin, None, event, encoding).map_err(|source| {
                PublishFailure::Subject {
                    what: what(),
                    source,
                }
            })?;
        if message.bytes.len() + HEADER_ROOM > self.max_message_bytes {
            return Err(PublishFailure::TooLarge {
                what: what(),
                size: message.bytes.len(),
                limit: self.max_message_bytes.saturating_sub(HEADER_ROOM),
            });
        }
        message
            .send(&self.js)
            .await
            .map_err(|e| nats_failure(&what(), e))
    }

    /// Starts publishing a dead letter to `subject`: `payload` (cut to fit,
    /// saying so) with its reason and kind in headers. `msg_id` makes a
    /// retried dead letter one message.
    pub async fn dead_letter(
        &self,
        letter: DeadLetterMessage<'_>,
    ) -> Result<PublishAckFuture, PublishFailure> {
        let mut headers = HeaderMap::new();
        headers.insert(NATS_MESSAGE_ID, letter.msg_id);
        // Header values are one line, and bounded.
        let reason: String = letter
            .reason
            .replace(['\r', '\n'], " ")
            .chars()
            .take(2048)
            .collect();
        headers.insert(DEAD_REASON_HEADER, reason.as_str());
        headers.insert(DEAD_KIND_HEADER, letter.kind);
        headers.insert(DEAD_PARTITION_HEADER, letter.partition.to_string().as_str());
        if let Some(position) = letter.position {
            headers.insert(DEAD_POSITION_HEADER, position.to_string().as_str());
        }
        let room = self.max_message_bytes.saturating_sub(HEADER_ROOM);
        let mut payload = bytes::Bytes::copy_from_slice(letter.payload);
        if payload.len() > room {
            headers.insert(DEAD_TRUNCATED_HEADER, payload.len().to_string().as_str());
            payload.truncate(room);
        }
        let what = format!("dead letter {}", letter.msg_id);
        self.js
            .publish_with_headers(letter.subject.to_string(), headers, payload)
            .await
            .map_err(|e| nats_failure(&what, e))
    }
}

/// One dead letter to publish.
#[derive(Debug, Clone, Copy)]
pub struct DeadLetterMessage<'a> {
    pub subject: &'a str,
    pub msg_id: &'a str,
    pub partition: u32,
    pub position: Option<u64>,
    pub kind: &'a str,
    pub reason: &'a str,
    pub payload: &'a [u8],
}

/// Starts moving a job that cannot run to the dead-letter `subject`:
/// `payload` (the job message as received) with the job id, the reason
/// (one line) and the deliveries in headers. The message id is derived
/// from the job id, so dead-lettering a redelivered job again is one
/// message.
pub async fn dead_job(
    js: &Context,
    subject: String,
    job_id: &str,
    reason: &str,
    delivered: i64,
    payload: Bytes,
) -> Result<PublishAckFuture, PublishFailure> {
    let msg_id = DerivedId::DeadJob { job_id }.to_string();
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, msg_id.as_str());
    headers.insert(DEAD_JOB_HEADER, job_id);
    // Header values are one line.
    headers.insert(
        DEAD_REASON_HEADER,
        reason.replace(['\r', '\n'], " ").as_str(),
    );
    headers.insert(DEAD_DELIVERIES_HEADER, delivered.to_string().as_str());
    js.publish_with_headers(subject, headers, payload)
        .await
        .map_err(|e| nats_failure(&format!("dead letter {msg_id}"), e))
}

/// Waits for the stream to store what `ack` was published as.
pub async fn stored(what: &str, ack: PublishAckFuture) -> Result<(), PublishFailure> {
    ack.await
        .map(|_| ())
        .map_err(|e| PublishFailure::NotStored {
            what: what.to_string(),
            source: e.into(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_size_and_routing_failures_are_permanent() {
        let nats = |detail: &str| PublishFailure::Nats {
            what: "x".into(),
            source: detail.into(),
        };
        assert!(nats("max payload size exceeded").is_permanent());
        assert!(PublishFailure::NotStored {
            what: "x".into(),
            source: "nats: message size exceeds maximum allowed".into()
        }
        .is_permanent());
        assert!(!nats("timed out: didn't receive ack in time").is_permanent());
        assert!(!nats("broken pipe").is_permanent());
        assert!(PublishFailure::TooLarge {
            what: "x".into(),
            size: 2,
            limit: 1
        }
        .is_permanent());
    }
}
