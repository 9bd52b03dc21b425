//! Publishing to JetStream, in one place: events on the subject of their
//! origin (`cf.in.<conv>` for agents, `cf.svc.<conv>` for the service) with
//! `Nats-Msg-Id` = the event's message id (`nats::msg_id`: scoped to its
//! conversation, unguessable for the service's) and `Content-Type` naming
//! the encoding, and dead letters with their reason in headers.
//!
//! Every publish returns the stream's acknowledgement as a future, so a
//! caller can have many in flight and wait for them together.
//! [`PublishFailure::is_permanent`] tells a failure that publishing again
//! cannot mend (the message is larger than the server or stream takes) from
//! one that retrying can (no connection, no leader for a moment): a caller
//! never retries a permanent one for ever, it dead-letters it.

use crate::core::event::{Encoding, Envelope, Origin};
use crate::nats::event_log::event_headers;
use crate::nats::msg_id;
use crate::nats::subjects::{SubjectError, Subjects};
use crate::BoxError;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::Context;
use async_nats::HeaderMap;

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
        let subject = self
            .subjects
            .publish(origin, &event.conversation)
            .map_err(|source| PublishFailure::Subject {
                what: what(),
                source,
            })?;
        let bytes = event.encode(encoding);
        if bytes.len() + HEADER_ROOM > self.max_message_bytes {
            return Err(PublishFailure::TooLarge {
                what: what(),
                size: bytes.len(),
                limit: self.max_message_bytes.saturating_sub(HEADER_ROOM),
            });
        }
        self.js
            .publish_with_headers(
                subject,
                event_headers(
                    &msg_id::of(origin, None, &event.conversation, &event.id),
                    encoding,
                ),
                bytes.into(),
            )
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
        headers.insert(async_nats::header::NATS_MESSAGE_ID, letter.msg_id);
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
