//! What the fold measures of a turn, measured ahead of it: the record's
//! admission (decoding it), the turn's token count, for a long tool result
//! the line its masked rendering quotes, and for an assistant turn with
//! long call arguments what its masked rendering costs. All are pure
//! functions of the record and the encoding, and the costliest steps of
//! folding a turn (a decode, a tokenizer pass over its text, a pattern scan
//! of its output, parsing its calls' arguments), so a runtime may compute
//! them on another core while the fold works on the turns before
//! ([`crate::runtime::embedded`] does, for `run`).
//!
//! A measure is only a shortcut: the fold uses an admission for a record
//! that arrived as the one admitted ahead, and a count when it was taken
//! under the encoding the conversation counts in, and does the work itself
//! otherwise, so a stale or missing measure changes nothing but the time.

use crate::core::event::{Encoding as RecordEncoding, Origin};
use crate::core::intake::{self, Address, Arrival};
use crate::core::mask;
use crate::core::message::ChatMessage;
use crate::core::summary::SourceReading;
use crate::core::tokens::Encoding;
use std::sync::Arc;

/// A turn measured ahead of the fold.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnMeasure {
    /// The encoding `tokens` was counted in.
    pub encoding: Encoding,
    /// [`count_message`](crate::core::tokens::count_message) of the turn.
    pub tokens: u64,
    /// [`mask::telling_line`] of the output a masked rendering would stand
    /// for (`None`: the turn has no such output, or it was not measured).
    pub telling: Option<String>,
    /// [`count_message`](crate::core::tokens::count_message) under
    /// `encoding` of the turn's masked rendering when that does not name
    /// the turn ([`mask::masked_calls`]), counted from the turn's parts
    /// ([`mask::counted`]); `None` when it has none, or when it is a tool
    /// result (whose stub names its turn, so the fold renders and counts
    /// it).
    pub masked_calls_tokens: Option<u64>,
    /// What a summarizer reads of the turn, when it was read ahead too
    /// ([`SourceReading`]; the fold does not use it, its runtime hands it
    /// to the turn's drafts by the event id of `admitted`, so a reading
    /// without an admission is not kept).
    pub reading: Option<Arc<SourceReading>>,
    /// The record's admission, when it was admitted ahead too.
    pub admitted: Option<AdmittedAhead>,
}

/// A record's admission ([`intake::admit`]) and what it was admitted
/// from but its bytes: the fold takes it for the record at the same log
/// position when that arrived the same way.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmittedAhead {
    origin: Origin,
    address: Address,
    stored_at_ms: Option<u64>,
    encoding: RecordEncoding,
    admitted: intake::Admitted,
}

impl AdmittedAhead {
    /// `arrival`'s admission, if it admits.
    pub fn admit(arrival: Arrival<'_>) -> Option<AdmittedAhead> {
        let admitted = intake::admit(arrival).ok()?;
        Some(AdmittedAhead {
            origin: arrival.origin,
            address: arrival.address.clone(),
            stored_at_ms: arrival.stored_at_ms,
            encoding: arrival.encoding,
            admitted,
        })
    }

    /// What was admitted.
    pub fn admitted(&self) -> &intake::Admitted {
        &self.admitted
    }

    /// The admission, for a record with the bytes it was taken from that
    /// arrived as `arrival` did (else `None`: admit it again).
    pub fn for_arrival(self, arrival: &Arrival<'_>) -> Option<intake::Admitted> {
        (self.origin == arrival.origin
            && self.address == *arrival.address
            && self.stored_at_ms == arrival.stored_at_ms
            && self.encoding == arrival.encoding)
            .then_some(self.admitted)
    }
}

impl TurnMeasure {
    /// Measures `msg` as the fold would under `encoding`.
    pub fn of(encoding: Encoding, msg: &ChatMessage) -> TurnMeasure {
        let (tokens, masked_calls_tokens) = mask::counted(encoding, msg);
        TurnMeasure {
            encoding,
            tokens,
            telling: mask::output_to_mask(msg).map(|text| mask::telling_line(&text)),
            masked_calls_tokens,
            reading: None,
            admitted: None,
        }
    }

    /// The token count, when it was taken under `encoding`.
    pub fn tokens_in(&self, encoding: Encoding) -> Option<u64> {
        (self.encoding == encoding).then_some(self.tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::{ChatMessage, Role};
    use crate::core::tokens;

    fn tool_result(text: &str) -> ChatMessage {
        let mut m = ChatMessage::text(Role::Tool, text);
        m.tool_call_id = Some("call_1".into());
        m.name = Some("Bash".into());
        m
    }

    #[test]
    fn a_measure_is_what_the_fold_would_count_and_quote() {
        let long = format!(
            "{}\nerror[E0308]: mismatched types\n{}",
            "compiling crate\n".repeat(30),
            "note: see above\n".repeat(30)
        );
        let msg = tool_result(&long);
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            let m = TurnMeasure::of(encoding, &msg);
            assert_eq!(m.tokens, tokens::count_message(encoding, &msg));
            assert_eq!(m.tokens_in(encoding), Some(m.tokens));
            assert_eq!(
                m.telling.as_deref(),
                Some(mask::telling_line(&long).as_str())
            );
            assert_eq!(
                mask::masked_told(&msg, 7, m.telling.as_deref()),
                mask::masked(&msg, 7)
            );
        }
        let m = TurnMeasure::of(Encoding::O200kBase, &msg);
        assert_eq!(m.tokens_in(Encoding::Cl100kBase), None);
        assert_eq!(m.masked_calls_tokens, None);

        // An assistant turn's calls with a long argument: what its masked
        // rendering costs, whatever turn it is.
        let mut call = ChatMessage::text(Role::Assistant, "Writing the file.");
        call.tool_calls.push(crate::core::message::ToolCall {
            id: "call_2".into(),
            kind: "function".into(),
            function: crate::core::message::FunctionCall {
                name: "Write".into(),
                arguments: serde_json::json!({"path": "src/lib.rs", "content": long}).to_string(),
            },
        });
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            let m = TurnMeasure::of(encoding, &call);
            for seq in [0, 7, 123_456] {
                let rendered = mask::masked(&call, seq).expect("a long argument is elided");
                assert_eq!(
                    m.masked_calls_tokens,
                    Some(tokens::count_message(encoding, &rendered))
                );
            }
        }
        let short = ChatMessage::text(Role::Assistant, "Done.");
        assert_eq!(
            TurnMeasure::of(Encoding::O200kBase, &short).masked_calls_tokens,
            None
        );
    }

    #[test]
    fn an_admission_ahead_serves_only_a_record_that_arrived_the_same_way() {
        use crate::core::event::{Envelope, EventBody, TurnAppended};
        let bytes = Envelope::new(
            "e1",
            "c",
            1_000,
            EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(Role::User, "hi"))),
        )
        .to_json()
        .into_bytes();
        let unaddressed = Address::Unaddressed;
        let arrival = Arrival {
            origin: Origin::Agent,
            address: &unaddressed,
            stored_at_ms: None,
            encoding: RecordEncoding::Json,
            bytes: &bytes,
        };
        let ahead = AdmittedAhead::admit(arrival).unwrap();
        assert_eq!(
            ahead.clone().for_arrival(&arrival),
            intake::admit(arrival).ok()
        );
        let addressed = Address::Conversation("c".into());
        for other in [
            Arrival {
                origin: Origin::Service,
                ..arrival
            },
            Arrival {
                address: &addressed,
                ..arrival
            },
            Arrival {
                stored_at_ms: Some(2_000),
                ..arrival
            },
            Arrival {
                encoding: RecordEncoding::Msgpack,
                ..arrival
            },
        ] {
            assert_eq!(ahead.clone().for_arrival(&other), None);
        }
        // A record intake refuses has no admission to hand over.
        let refused = Arrival {
            bytes: b"not json",
            ..arrival
        };
        assert!(AdmittedAhead::admit(refused).is_none());
    }

    #[test]
    fn only_a_long_tool_result_has_a_telling_line() {
        let short = tool_result("ok");
        assert_eq!(TurnMeasure::of(Encoding::O200kBase, &short).telling, None);
        let user = ChatMessage::text(Role::User, "please fix the build\n".repeat(40));
        assert_eq!(TurnMeasure::of(Encoding::O200kBase, &user).telling, None);
    }
}
