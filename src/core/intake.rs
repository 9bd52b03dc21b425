//! Intake: the one door every log record passes before the fold.
//!
//! A record arrives as bytes with what its transport vouches for: who wrote
//! it ([`Origin`]), which conversation its subject names ([`Address`]) and,
//! for JetStream, when the stream stored it. [`admit`] decodes the bytes
//! once and checks, in this order:
//!
//! 1. the bytes are an event this build reads ([`Refusal::Undecodable`]);
//! 2. its fields are within the documented bounds ([`limits`]):
//!    id, conversation key, model and sender names, a provider error's text
//!    ([`Refusal::TooLong`]), a compaction request's instructions (the
//!    API's own limit, so no path sends a model more:
//!    [`Refusal::TooManyCharacters`]), time ([`Refusal::TimeOutOfRange`]);
//! 3. it names the conversation its subject names
//!    ([`Refusal::WrongConversation`]);
//! 4. its origin may write its type: agents write only agent events
//!    ([`Refusal::NotAnAgentEvent`]).
//!
//! A refusal is attributed only to what the transport vouches for: the
//! conversation of its subject, or, when the subject names none (the
//! embedded log, or a subject that is not a conversation's), to the
//! partition. An event never decides where its own rejection is counted.
//!
//! # Time
//!
//! Producers set an event's `time`, and the fold reads time only from
//! events. So that a producer cannot pin a conversation's clock, a time
//! more than [`limits::MAX_TIME_AHEAD_MS`] ahead of the time the stream
//! stored the record at is clamped to that stored time. The stored time is
//! part of the log (the JetStream message timestamp), so a replay clamps
//! the same way. Logs without stored times (the embedded log) refuse only
//! times past [`limits::MAX_EVENT_TIME_MS`].
//!
//! Pure: no clock, no I/O. Replaying a record always gives the same answer.

use crate::core::event::{DecodeError, Encoding, Envelope, EventBody, EventKind, Origin};
use std::fmt;

/// The documented bounds on producer input (docs/subjects.md, "Limits").
pub mod limits {
    /// Longest event id, in bytes.
    pub const MAX_EVENT_ID_BYTES: usize = 256;
    /// Longest conversation key, in UTF-8 bytes. Its subject token (at most
    /// 1 + 4/3 of it) keeps a subject far below the server's default 4 KiB
    /// control-line limit.
    pub const MAX_CONVERSATION_KEY_BYTES: usize = 1024;
    /// Longest model or sender name, in bytes.
    pub const MAX_NAME_BYTES: usize = 256;
    /// How far ahead of the stream's stored time an event's time may be;
    /// later times are clamped to the stored time.
    pub const MAX_TIME_AHEAD_MS: u64 = 5 * 60 * 1000;
    /// The latest event time accepted at all (9999-12-31T23:59:59.999Z).
    pub const MAX_EVENT_TIME_MS: u64 = 253_402_300_799_999;
    /// Longest `instructions` of a compaction request, in characters: the
    /// same on the event path as through the API, since they reach the
    /// model's prompt.
    pub const MAX_INSTRUCTIONS_CHARS: usize = 4000;
    /// Longest provider error text, in bytes (the overflow classifier reads
    /// all of it; provider errors are a few hundred bytes).
    pub const MAX_PROVIDER_ERROR_BYTES: usize = 64 * 1024;
    pub use crate::core::event::{MAX_EVENT_BYTES, MAX_NESTING_DEPTH};
}

/// Which conversation a record's transport addressed it to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// The transport names no conversation (the embedded log): the event's
    /// own conversation is taken, and undecodable bytes count against the
    /// partition.
    Unaddressed,
    /// The subject names this conversation: the event must name it too,
    /// and any refusal is counted against it.
    Conversation(String),
    /// The subject names no valid conversation (why): nothing in the record
    /// is attributed to a conversation.
    Unroutable(String),
}

/// One record as the log delivered it.
#[derive(Debug, Clone, Copy)]
pub struct Arrival<'a> {
    pub origin: Origin,
    pub address: &'a Address,
    /// When the stream stored it (ms since the Unix epoch), if the log
    /// records that.
    pub stored_at_ms: Option<u64>,
    pub encoding: Encoding,
    pub bytes: &'a [u8],
}

/// Why a record is not folded. Every variant is recorded (an
/// `event_rejected` decision, or a dead letter for the partition) and
/// counted by [`Refusal::kind`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    #[error("{0}")]
    Undecodable(DecodeError),
    #[error("published on a subject that names no conversation: {0}")]
    Unroutable(String),
    #[error(
        "event names conversation {named:?} but was published on the subject of {addressed:?}; \
         publish each event to its own conversation's subject"
    )]
    WrongConversation { named: String, addressed: String },
    #[error(
        "{event_type} events are written only by contextfold itself; agents may publish {}",
        EventKind::agent_types_listed()
    )]
    NotAnAgentEvent { event_type: &'static str },
    #[error("event {field} of {bytes} bytes is longer than the {limit}-byte limit")]
    TooLong {
        field: &'static str,
        bytes: usize,
        limit: usize,
    },
    #[error("event {field} of {chars} characters is longer than the {limit}-character limit")]
    TooManyCharacters {
        field: &'static str,
        chars: usize,
        limit: usize,
    },
    #[error(
        "event time {time} is past the latest accepted time {limit} (ms since the Unix epoch)"
    )]
    TimeOutOfRange { time: u64, limit: u64 },
}

impl Refusal {
    /// A fixed name per kind, for metrics labels and counts.
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::Undecodable(_) => "undecodable",
            Refusal::Unroutable(_) => "unroutable",
            Refusal::WrongConversation { .. } => "wrong_conversation",
            Refusal::NotAnAgentEvent { .. } => "not_an_agent_event",
            Refusal::TooLong { .. } | Refusal::TooManyCharacters { .. } => "too_long",
            Refusal::TimeOutOfRange { .. } => "time_out_of_range",
        }
    }
}

/// A refused record, and what it is attributed to.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub refusal: Refusal,
    /// The conversation its transport vouches for; `None`: the partition.
    pub conversation: Option<String>,
    /// The id it gave itself, when it decoded with one short enough to
    /// repeat.
    pub event_id: Option<String>,
    pub event_type: Option<&'static str>,
}

/// An admitted event, ready to fold.
#[derive(Debug, Clone, PartialEq)]
pub struct Admitted {
    pub event: Envelope,
    /// The time the producer gave, when it was clamped (see the module doc).
    pub clamped_from: Option<u64>,
}

#[cfg(test)]
thread_local! {
    static RECORDS_ADMITTED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many records [`admit`] was asked to admit on this thread.
#[cfg(test)]
pub(crate) fn records_admitted() -> u64 {
    RECORDS_ADMITTED.with(std::cell::Cell::get)
}

/// The admission rules of the module doc.
pub fn admit(arrival: Arrival<'_>) -> Result<Admitted, Box<Refused>> {
    #[cfg(test)]
    RECORDS_ADMITTED.with(|n| n.set(n.get() + 1));
    let addressed = match arrival.address {
        Address::Conversation(c) => Some(c.as_str()),
        Address::Unaddressed | Address::Unroutable(_) => None,
    };
    let refuse = |refusal, conversation: Option<&str>, event: Option<&Envelope>| {
        Box::new(Refused {
            refusal,
            conversation: conversation.map(str::to_string),
            event_id: event
                .map(|e| e.id.clone())
                .filter(|id| id.len() <= limits::MAX_EVENT_ID_BYTES),
            event_type: event.map(Envelope::type_name),
        })
    };
    let mut event = match Envelope::decode(arrival.bytes, arrival.encoding) {
        Ok(event) => event,
        Err(e) => return Err(refuse(Refusal::Undecodable(e), addressed, None)),
    };
    if let Address::Unroutable(reason) = arrival.address {
        return Err(refuse(
            Refusal::Unroutable(reason.clone()),
            None,
            Some(&event),
        ));
    }
    let key_len = event.conversation.len();
    if key_len > limits::MAX_CONVERSATION_KEY_BYTES {
        let refusal = Refusal::TooLong {
            field: "conversation",
            bytes: key_len,
            limit: limits::MAX_CONVERSATION_KEY_BYTES,
        };
        return Err(refuse(refusal, addressed, Some(&event)));
    }
    // From here on the event's own conversation is a valid key: without a
    // subject to vouch for another, refusals are counted against it.
    let attributed = addressed.unwrap_or(&event.conversation).to_string();
    if let Some(refusal) = bounds(&event) {
        return Err(refuse(refusal, Some(&attributed), Some(&event)));
    }
    if let Some(addressed) = addressed {
        if addressed != event.conversation {
            let refusal = Refusal::WrongConversation {
                named: event.conversation.clone(),
                addressed: addressed.to_string(),
            };
            return Err(refuse(refusal, Some(addressed), Some(&event)));
        }
    }
    if !arrival.origin.may_write(&event.body) {
        let refusal = Refusal::NotAnAgentEvent {
            event_type: event.type_name(),
        };
        return Err(refuse(refusal, Some(&attributed), Some(&event)));
    }
    let mut clamped_from = None;
    match arrival.stored_at_ms {
        Some(stored) if event.time > stored.saturating_add(limits::MAX_TIME_AHEAD_MS) => {
            clamped_from = Some(event.time);
            event.time = stored;
        }
        _ if event.time > limits::MAX_EVENT_TIME_MS => {
            let refusal = Refusal::TimeOutOfRange {
                time: event.time,
                limit: limits::MAX_EVENT_TIME_MS,
            };
            return Err(refuse(refusal, Some(&attributed), Some(&event)));
        }
        _ => {}
    }
    Ok(Admitted {
        event,
        clamped_from,
    })
}

/// The first field of `event` over its bound, if any.
fn bounds(event: &Envelope) -> Option<Refusal> {
    let too_long = |field, bytes: usize, limit| {
        (bytes > limit).then_some(Refusal::TooLong {
            field,
            bytes,
            limit,
        })
    };
    too_long("id", event.id.len(), limits::MAX_EVENT_ID_BYTES).or_else(|| {
        let (model, sender) = match &event.body {
            EventBody::TurnAppended(t) => (t.model.as_deref(), t.sender.as_deref()),
            EventBody::ModelDeclared(m) => (Some(m.model.as_str()), None),
            EventBody::ProviderErrorObserved(e) => (e.model.as_deref(), None),
            _ => (None, None),
        };
        let name = |f, v: Option<&str>| too_long(f, v.map_or(0, str::len), limits::MAX_NAME_BYTES);
        name("model", model)
            .or_else(|| name("sender", sender))
            .or_else(|| match &event.body {
                EventBody::ProviderErrorObserved(e) => {
                    too_long("error", e.error.len(), limits::MAX_PROVIDER_ERROR_BYTES)
                }
                EventBody::CompactionRequested(r) => {
                    let text = r.instructions.as_deref().unwrap_or("");
                    // Counted only past the byte count that could be over.
                    let chars = if text.len() > limits::MAX_INSTRUCTIONS_CHARS {
                        text.chars().count()
                    } else {
                        text.len()
                    };
                    (chars > limits::MAX_INSTRUCTIONS_CHARS).then_some(Refusal::TooManyCharacters {
                        field: "instructions",
                        chars,
                        limit: limits::MAX_INSTRUCTIONS_CHARS,
                    })
                }
                _ => None,
            })
    })
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.event_id, self.event_type) {
            (Some(id), Some(t)) => write!(f, "{t} event {id:?} refused: {}", self.refusal),
            (Some(id), None) => write!(f, "event {id:?} refused: {}", self.refusal),
            _ => write!(f, "record refused: {}", self.refusal),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{SweepEnded, SweepStop, TurnAppended};
    use crate::core::message::{ChatMessage, Role};

    fn turn(conversation: &str, time: u64) -> Envelope {
        Envelope::new(
            "t1",
            conversation,
            time,
            EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(Role::User, "hi"))),
        )
    }

    fn sweep_end(conversation: &str) -> Envelope {
        Envelope::new(
            "s1",
            conversation,
            5,
            EventBody::SweepEnded(SweepEnded {
                job_id: "job".into(),
                passes: 0,
                committed: 0,
                stop: SweepStop::Done,
                calls: 0,
                tokens_spent: 0,
                cost_micros: 0,
                retry_after_ms: None,
                detail: None,
            }),
        )
    }

    fn arrive(
        e: &[u8],
        origin: Origin,
        address: &Address,
        stored: Option<u64>,
    ) -> Result<Admitted, Box<Refused>> {
        admit(Arrival {
            origin,
            address,
            stored_at_ms: stored,
            encoding: Encoding::Json,
            bytes: e,
        })
    }

    fn json(e: &Envelope) -> Vec<u8> {
        e.to_json().into_bytes()
    }

    #[test]
    fn agents_may_write_only_agent_events() {
        let to_a = Address::Conversation("a".into());
        assert!(arrive(&json(&turn("a", 1)), Origin::Agent, &to_a, None).is_ok());
        let forged = arrive(&json(&sweep_end("a")), Origin::Agent, &to_a, None).unwrap_err();
        assert_eq!(forged.refusal.kind(), "not_an_agent_event");
        assert_eq!(forged.conversation.as_deref(), Some("a"));
        assert_eq!(forged.event_type, Some("sweep_ended"));
        assert!(forged.to_string().contains("written only by contextfold"));
        assert!(arrive(&json(&sweep_end("a")), Origin::Service, &to_a, None).is_ok());
        assert!(arrive(&json(&sweep_end("a")), Origin::Legacy, &to_a, None).is_ok());
    }

    #[test]
    fn refusals_count_against_the_subject_not_the_body() {
        let to_attacker = Address::Conversation("attacker".into());
        let r = arrive(&json(&turn("victim", 1)), Origin::Agent, &to_attacker, None).unwrap_err();
        assert_eq!(r.conversation.as_deref(), Some("attacker"));
        assert!(matches!(r.refusal, Refusal::WrongConversation { .. }));
        let garbage = br#"{"id":"x","conversation":"victim","type":"nope"}"#;
        let r = arrive(garbage, Origin::Agent, &to_attacker, None).unwrap_err();
        assert_eq!(r.conversation.as_deref(), Some("attacker"));
        // Without a subject, undecodable bytes belong to no conversation.
        let r = arrive(garbage, Origin::Agent, &Address::Unaddressed, None).unwrap_err();
        assert_eq!(r.conversation, None);
        let bad = Address::Unroutable("bad token".into());
        let r = arrive(&json(&turn("a", 1)), Origin::Agent, &bad, None).unwrap_err();
        assert_eq!((r.conversation, r.refusal.kind()), (None, "unroutable"));
    }

    #[test]
    fn empty_and_oversized_keys_are_refused_without_a_phantom_conversation() {
        let r = arrive(
            &json(&turn("", 1)),
            Origin::Agent,
            &Address::Unaddressed,
            None,
        )
        .unwrap_err();
        assert_eq!((r.conversation, r.refusal.kind()), (None, "undecodable"));
        let long = "k".repeat(limits::MAX_CONVERSATION_KEY_BYTES + 1);
        let r = arrive(
            &json(&turn(&long, 1)),
            Origin::Agent,
            &Address::Unaddressed,
            None,
        )
        .unwrap_err();
        assert_eq!((r.conversation, r.refusal.kind()), (None, "too_long"));
    }

    #[test]
    fn long_ids_and_names_are_refused() {
        let mut e = turn("a", 1);
        e.id = "i".repeat(limits::MAX_EVENT_ID_BYTES + 1);
        let r = arrive(&json(&e), Origin::Agent, &Address::Unaddressed, None).unwrap_err();
        assert!(matches!(r.refusal, Refusal::TooLong { field: "id", .. }));
        assert_eq!(r.event_id, None, "an over-long id is not repeated");
        let mut e = turn("a", 1);
        if let EventBody::TurnAppended(t) = &mut e.body {
            t.model = Some("m".repeat(limits::MAX_NAME_BYTES + 1));
        }
        let r = arrive(&json(&e), Origin::Agent, &Address::Unaddressed, None).unwrap_err();
        assert!(matches!(r.refusal, Refusal::TooLong { field: "model", .. }));
    }

    #[test]
    fn instructions_and_error_texts_are_held_to_the_apis_limits_on_every_path() {
        let request = |instructions: String| {
            Envelope::new(
                "r1",
                "a",
                1,
                EventBody::CompactionRequested(crate::core::event::CompactionRequested {
                    instructions: Some(instructions),
                    ..Default::default()
                }),
            )
        };
        let to_a = Address::Conversation("a".into());
        // At the limit in characters (each `é` two bytes): admitted.
        let at_limit = "é".repeat(limits::MAX_INSTRUCTIONS_CHARS);
        assert!(arrive(&json(&request(at_limit)), Origin::Agent, &to_a, None).is_ok());
        // 900 KB of instructions (what was once sent to a model six times).
        let huge = "x".repeat(900 * 1024);
        let r = arrive(&json(&request(huge)), Origin::Agent, &to_a, None).unwrap_err();
        assert!(matches!(
            r.refusal,
            Refusal::TooManyCharacters {
                field: "instructions",
                chars: 921_600,
                limit: limits::MAX_INSTRUCTIONS_CHARS
            }
        ));
        assert_eq!(r.refusal.kind(), "too_long");
        assert_eq!(r.conversation.as_deref(), Some("a"));
        let error = Envelope::new(
            "e1",
            "a",
            1,
            EventBody::ProviderErrorObserved(crate::core::event::ProviderErrorObserved {
                error: "context_length_exceeded ".repeat(10_000),
                model: None,
            }),
        );
        let r = arrive(&json(&error), Origin::Agent, &to_a, None).unwrap_err();
        assert!(matches!(r.refusal, Refusal::TooLong { field: "error", .. }));
    }

    #[test]
    fn times_ahead_of_the_stream_are_clamped_to_it() {
        let to_a = Address::Conversation("a".into());
        let stored = 1_700_000_000_000;
        let ok = arrive(
            &json(&turn("a", stored + 1000)),
            Origin::Agent,
            &to_a,
            Some(stored),
        );
        assert_eq!(ok.unwrap().clamped_from, None);
        let far = arrive(
            &json(&turn("a", u64::MAX)),
            Origin::Agent,
            &to_a,
            Some(stored),
        )
        .unwrap();
        assert_eq!((far.event.time, far.clamped_from), (stored, Some(u64::MAX)));
        // No stored time: only the absolute limit.
        let r = arrive(
            &json(&turn("a", u64::MAX)),
            Origin::Agent,
            &Address::Unaddressed,
            None,
        )
        .unwrap_err();
        assert_eq!(r.refusal.kind(), "time_out_of_range");
        assert_eq!(r.conversation.as_deref(), Some("a"));
    }
}
