//! Bad input never stops the worker: malformed JSON or MessagePack, unknown
//! event types or roles, orphan tool results, oversized payloads and invalid
//! UTF-8 are each rejected with a reason, and every other event is folded.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::*;
use contextfold::core::intake::Address;
use contextfold::core::message::{ChatMessage, Role};
use contextfold::core::policy::PolicyConfig;
use contextfold::log::LogRecord;
use contextfold::runtime::engine::Engine;
use contextfold::store::memory_backend::MemoryBackend;

fn turn(id: &str, role: Role, text: &str) -> Envelope {
    Envelope::new(
        id,
        "c:bad",
        1_000 + id.len() as u64,
        EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(role, text))),
    )
}

fn rejection_reason(decisions: &[Envelope]) -> Option<String> {
    decisions.iter().find_map(|d| match &d.body {
        EventBody::EventRejected(r) => Some(r.reason.clone()),
        _ => None,
    })
}

#[test]
fn every_kind_of_bad_input_is_rejected_with_a_reason_and_nothing_else_is_lost() {
    let mut engine = Engine::open(MemoryBackend::default(), PolicyConfig::default()).unwrap();
    let good = [
        turn("g1", Role::User, "please look at src/main.rs"),
        turn("g2", Role::Assistant, "looking"),
        turn("g3", Role::User, "thanks, and then run the tests"),
    ];
    let mut orphan = ChatMessage::text(Role::Tool, "result without a call");
    orphan.tool_call_id = Some("call_missing".into());
    let orphan = Envelope::new(
        "orphan",
        "c:bad",
        1_500,
        EventBody::TurnAppended(TurnAppended::from(orphan)),
    );
    let unknown_type = br#"{"id":"u1","conversation":"c:bad","version":1,"time":5,"type":"turn_exploded","payload":{}}"#.to_vec();
    let unknown_role =
        br#"{"id":"u2","conversation":"c:bad","version":1,"time":5,"type":"turn_appended","payload":{"message":{"role":"robot","content":"hi"}}}"#
            .to_vec();
    let malformed_json = br#"{"id":"u3","conversation":"c:bad","#.to_vec();
    let mut invalid_utf8 = br#"{"id":"u4","conversation":"c:bad","version":1,"time":5,"type":"turn_appended","payload":{"message":{"role":"user","content":"#.to_vec();
    invalid_utf8.extend_from_slice(b"\"\xff\xfe bad\"}}}");
    let malformed_msgpack = vec![0x93, 0xc1, 0xff, 0x00];
    let oversized = vec![b'{'; MAX_EVENT_BYTES + 10];

    let mut position = 0;
    // As published by an agent on the conversation's own subject: the
    // subject vouches for the conversation, so every refusal is counted
    // there, whatever the bytes say.
    let mut record = |encoding: Encoding, bytes: Vec<u8>| {
        position += 1;
        LogRecord {
            position,
            origin: Origin::Agent,
            address: Address::Conversation("c:bad".into()),
            stored_at_ms: None,
            encoding,
            bytes: bytes.into(),
        }
    };
    let records = vec![
        record(Encoding::Msgpack, good[0].to_msgpack()),
        record(Encoding::Json, unknown_type),
        record(Encoding::Json, unknown_role),
        record(Encoding::Msgpack, good[1].to_msgpack()),
        record(Encoding::Json, malformed_json),
        record(Encoding::Json, invalid_utf8),
        record(Encoding::Msgpack, malformed_msgpack),
        record(Encoding::Json, oversized),
        record(Encoding::Msgpack, orphan.to_msgpack()),
        record(Encoding::Json, good[2].to_json().into_bytes()),
    ];
    let mut reasons = Vec::new();
    for r in &records {
        let applied = engine.apply(r).unwrap();
        if let Some(reason) = rejection_reason(&applied.decisions) {
            reasons.push(reason);
        }
    }
    assert_eq!(reasons.len(), 7, "{reasons:#?}");
    let joined = reasons.join("\n");
    for needle in [
        "turn_exploded",
        "robot",
        "malformed json",
        "malformed msgpack",
        "exceeds",
        "orphan tool result",
    ] {
        assert!(
            joined.contains(needle),
            "no reason mentions {needle:?}:\n{joined}"
        );
    }
    assert!(
        joined.contains("utf-8") || joined.contains("UTF-8") || joined.contains("invalid unicode"),
        "{joined}"
    );
    let conv = &engine.state.conversations["c:bad"];
    let texts: Vec<String> = conv
        .turns
        .iter()
        .map(|t| conv.bodies.get(t.seq).unwrap().message.text_content())
        .collect();
    assert_eq!(
        texts,
        vec![
            "please look at src/main.rs",
            "looking",
            "thanks, and then run the tests"
        ]
    );
    // Rejections are counted where they can be attributed, never silently.
    assert_eq!(conv.rejections, 7);
    assert_eq!(engine.state.unattributed_rejections, 0);
}

#[test]
fn without_a_subject_undecodable_bytes_are_dead_letters_not_anyones_rejection() {
    let mut engine = Engine::open(MemoryBackend::default(), PolicyConfig::default()).unwrap();
    let claims_victim = br#"{"id":"x","conversation":"victim","type":"nope"}"#.to_vec();
    let effects = engine
        .apply(&LogRecord::unaddressed(
            1,
            Origin::Agent,
            Encoding::Json,
            claims_victim.clone(),
        ))
        .unwrap();
    assert!(effects.decisions.is_empty(), "{:?}", effects.decisions);
    assert_eq!(effects.dead_letters.len(), 1);
    assert_eq!(effects.dead_letters[0].kind, "undecodable");
    assert_eq!(&effects.dead_letters[0].bytes[..], &claims_victim[..]);
    assert!(
        engine.state.conversations.is_empty(),
        "no phantom conversation"
    );
    assert_eq!(engine.state.unattributed_rejections, 1);
    // The same position again is a redelivery: nothing changes.
    let again = engine
        .apply(&LogRecord::unaddressed(
            1,
            Origin::Agent,
            Encoding::Json,
            claims_victim,
        ))
        .unwrap();
    assert!(again.is_empty());
    assert_eq!(engine.state.unattributed_rejections, 1);
}

#[test]
fn replaying_the_same_bad_log_rejects_the_same_way() {
    let records: Vec<LogRecord> = [
        b"not json".to_vec(),
        br#"{"id":"x","conversation":"c","type":"nope"}"#.to_vec(),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, bytes)| LogRecord::unaddressed(i as u64 + 1, Origin::Agent, Encoding::Json, bytes))
    .collect();
    let run = || {
        let mut engine = Engine::open(MemoryBackend::default(), PolicyConfig::default()).unwrap();
        let ids: Vec<String> = records
            .iter()
            .flat_map(|r| {
                let effects = engine.apply(r).unwrap();
                let letters = effects.dead_letters.into_iter().map(|l| l.reason);
                effects.decisions.into_iter().map(|d| d.id).chain(letters)
            })
            .collect();
        (ids, engine.state_hash().unwrap())
    };
    assert_eq!(run(), run());
}
