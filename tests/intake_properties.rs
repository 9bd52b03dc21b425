//! Intake properties (issue 10): records of any bytes, with any origin,
//! address and stored time, go through `Engine::apply` without a panic;
//! they create no conversation but the one their address names
//! (`Address::Conversation`) or, unaddressed, the one a decodable body
//! names; and the same records folded again (in one batch, or reloaded
//! from the store the first engine committed) give the same state hash.
//! Decisions the engine returns are appended back as the runtimes do.
//!
//! `benches/intake_fuzz.rs` runs a million such records; this is its fast
//! property-test counterpart.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::*;
use contextfold::core::intake::Address;
use contextfold::core::message::{ChatMessage, FunctionCall, Role, ToolCall};
use contextfold::log::LogRecord;
use contextfold::runtime::engine::Engine;
use contextfold::store::memory_backend::MemoryBackend;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use std::collections::BTreeSet;

mod support;
use contextfold::testing::small_policy;

const T0: u64 = 1_700_000_000_000;

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["a", "b", "a\0", "~", "*", ".", "会话"]).prop_map(String::from),
        1 => "[ab~.*> \u{0}é]{1,4}",
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-z ]{0,30}",
        1 => any::<String>(),
        1 => Just("prompt is too long: 210000 tokens > 200000 maximum".to_string()),
    ]
}

fn call_id() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["call_1", "call_2", "call_3"]).prop_map(String::from),
        1 => Just(String::new()),
    ]
}

fn role() -> impl Strategy<Value = Role> {
    prop::sample::select(vec![Role::System, Role::User, Role::Assistant, Role::Tool])
}

fn body() -> impl Strategy<Value = EventBody> {
    let turn = (role(), text(), option::of(call_id()), vec(call_id(), 0..3)).prop_map(
        |(role, text, result_for, calls)| {
            let mut m = ChatMessage::text(role, text);
            m.tool_call_id = result_for;
            m.tool_calls = calls
                .into_iter()
                .map(|id| ToolCall {
                    id,
                    kind: "function".into(),
                    function: FunctionCall {
                        name: "read".into(),
                        arguments: "{}".into(),
                    },
                })
                .collect();
            EventBody::TurnAppended(TurnAppended::from(m))
        },
    );
    prop_oneof![
        5 => turn,
        1 => text().prop_map(|error| EventBody::ProviderErrorObserved(ProviderErrorObserved {
            error,
            model: None,
        })),
        1 => option::of(any::<u64>()).prop_map(|target_tokens| {
            EventBody::CompactionRequested(CompactionRequested {
                target_tokens,
                ..CompactionRequested::default()
            })
        }),
        1 => (text(), option::of(any::<u64>())).prop_map(|(model, context_window)| {
            EventBody::ModelDeclared(ModelDeclared { model, context_window })
        }),
        1 => Just(EventBody::ConversationReset(ConversationReset::default())),
        1 => (call_id(), any::<u32>(), any::<u64>(), option::of(any::<u64>())).prop_map(
            |(job_id, calls, tokens_spent, retry_after_ms)| {
                EventBody::SweepEnded(SweepEnded {
                    job_id,
                    passes: 1,
                    committed: 1,
                    stop: SweepStop::Done,
                    detail: None,
                    calls,
                    tokens_spent,
                    cost_micros: tokens_spent,
                    retry_after_ms,
                })
            }
        ),
        1 => (text(), any::<u64>(), option::of(call_id())).prop_map(
            |(next, through_turn, job_id)| {
                EventBody::RollingStateUpdated(RollingStateUpdated {
                    state: RollingState {
                        next,
                        ..RollingState::default()
                    },
                    through_turn,
                    job_id,
                })
            }
        ),
        1 => (any::<u64>(), any::<u64>(), any::<u32>(), text()).prop_map(
            |(first, last, depth, content)| {
                EventBody::SummaryRecorded(SummaryRecorded {
                    summary_id: "sum_x".into(),
                    job_id: None,
                    kind: SummaryKind::Leaf,
                    depth,
                    covers: Covers::Turns { first, last },
                    content,
                    source_tokens: 10,
                    tokens: 1,
                    model: "m".into(),
                    provider: "p".into(),
                    prompt_version: "v".into(),
                    fallback: false,
                    supersedes: None,
                })
            }
        ),
        1 => text().prop_map(|reason| EventBody::EventRejected(EventRejected {
            rejected_id: "e1".into(),
            event_type: None,
            reason,
        })),
    ]
}

fn envelope() -> impl Strategy<Value = Envelope> {
    let id = prop_oneof![
        4 => prop::sample::select(vec!["e1", "e2", "e3", "e4", "e5"]).prop_map(String::from),
        1 => Just("i".repeat(257)),
        1 => Just(String::new()),
    ];
    let time = prop_oneof![
        3 => T0..T0 + 10_000_000,
        1 => Just(0u64),
        1 => any::<u64>(),
    ];
    (id, key(), time, 0u16..3, body()).prop_map(|(id, conversation, time, version, body)| {
        let mut e = Envelope::new(id, conversation, time, body);
        e.version = version;
        e
    })
}

/// One record as a log could deliver it, before its position.
#[derive(Debug, Clone)]
struct Rec {
    origin: Origin,
    address: Address,
    stored_at_ms: Option<u64>,
    encoding: Encoding,
    bytes: Vec<u8>,
}

impl Rec {
    fn at(&self, position: u64) -> LogRecord {
        LogRecord {
            position,
            origin: self.origin,
            address: self.address.clone(),
            stored_at_ms: self.stored_at_ms,
            encoding: self.encoding,
            bytes: self.bytes.clone().into(),
        }
    }
}

/// How a record's bytes are made from an event.
#[derive(Debug, Clone)]
enum Bytes {
    Encoded,
    Truncated(prop::sample::Index),
    Flipped(prop::sample::Index, u8),
    Random(Vec<u8>),
}

/// Where a record is addressed relative to its body's conversation.
#[derive(Debug, Clone)]
enum Addressing {
    Unaddressed,
    Own,
    Other(String),
    Unroutable,
}

fn record() -> impl Strategy<Value = Rec> {
    let origin = prop::sample::select(vec![Origin::Agent, Origin::Service, Origin::Legacy]);
    let encoding = prop::sample::select(vec![Encoding::Json, Encoding::Msgpack]);
    let bytes = prop_oneof![
        4 => Just(Bytes::Encoded),
        1 => any::<prop::sample::Index>().prop_map(Bytes::Truncated),
        1 => (any::<prop::sample::Index>(), 1u8..=255).prop_map(|(i, x)| Bytes::Flipped(i, x)),
        1 => vec(any::<u8>(), 0..64).prop_map(Bytes::Random),
    ];
    let addressing = prop_oneof![
        2 => Just(Addressing::Unaddressed),
        3 => Just(Addressing::Own),
        1 => key().prop_map(Addressing::Other),
        1 => Just(Addressing::Unroutable),
    ];
    let stored = option::of(prop_oneof![
        3 => T0..T0 + 10_000_000,
        1 => Just(0u64),
        1 => Just(u64::MAX),
    ]);
    (envelope(), origin, encoding, bytes, addressing, stored).prop_map(
        |(e, origin, encoding, bytes, addressing, stored_at_ms)| {
            let encoded = e.encode(encoding);
            let bytes = match bytes {
                Bytes::Encoded => encoded,
                Bytes::Truncated(i) => encoded[..i.index(encoded.len())].to_vec(),
                Bytes::Flipped(i, x) => {
                    let mut b = encoded;
                    let at = i.index(b.len());
                    b[at] ^= x;
                    b
                }
                Bytes::Random(b) => b,
            };
            let address = match addressing {
                Addressing::Unaddressed => Address::Unaddressed,
                Addressing::Own => Address::Conversation(e.conversation),
                Addressing::Other(k) => Address::Conversation(k),
                Addressing::Unroutable => Address::Unroutable("not a conversation's token".into()),
            };
            Rec {
                origin,
                address,
                stored_at_ms,
                encoding,
                bytes,
            }
        },
    )
}

/// The conversation a record may create: the one its address names, or,
/// unaddressed, the one its body names if it decodes.
fn may_create(r: &LogRecord) -> Option<String> {
    match &r.address {
        Address::Conversation(key) => Some(key.clone()),
        Address::Unaddressed => Envelope::decode(&r.bytes, r.encoding)
            .ok()
            .map(|e| e.conversation),
        Address::Unroutable(_) => None,
    }
}

fn open() -> Engine<MemoryBackend> {
    Engine::open(MemoryBackend::default(), small_policy()).expect("a memory store opens")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn any_records_fold_without_panics_phantoms_or_drift(recs in vec(record(), 1..30)) {
        let mut engine = open();
        let mut log: Vec<LogRecord> = Vec::new();
        let mut allowed = BTreeSet::new();
        let mut pending: Vec<LogRecord> =
            recs.iter().enumerate().map(|(i, r)| r.at(i as u64 + 1)).collect();
        pending.reverse();
        let mut position = pending.len() as u64;
        while let Some(record) = pending.pop() {
            allowed.extend(may_create(&record));
            let effects = engine.apply(&record).unwrap();
            for key in engine.state.conversations.keys() {
                prop_assert!(
                    allowed.contains(key),
                    "record {} ({:?}) created conversation {:?}",
                    record.position, record.address, key
                );
            }
            log.push(record);
            // The decisions go back into the log, as the service's.
            for d in effects.decisions {
                position += 1;
                let echo = Rec {
                    origin: Origin::Service,
                    address: Address::Conversation(d.conversation.clone()),
                    stored_at_ms: None,
                    encoding: Encoding::Msgpack,
                    bytes: d.to_msgpack(),
                };
                pending.insert(0, echo.at(position));
            }
        }
        // Echoes follow the records in the log: order it by position.
        log.sort_by_key(|r| r.position);
        let hash = engine.state_hash().unwrap();

        let mut again = open();
        again.apply_batch(log.clone()).unwrap();
        prop_assert_eq!(again.state_hash().unwrap(), hash.as_str(), "the same records in one batch");

        engine.commit().expect("a memory store commits");
        let reopened = Engine::open(engine.store().backend().clone(), small_policy())
            .expect("the store reopens");
        prop_assert_eq!(reopened.position(), engine.position());
        prop_assert_eq!(reopened.state_hash().unwrap(), hash, "the state reloaded from the store");
    }
}
