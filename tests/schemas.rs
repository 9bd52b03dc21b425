//! The JSON Schemas in `schemas/` against the codec in `core::event`.
//!
//! Both directions: what the encoder writes (JSON, and MessagePack read back
//! as JSON) validates against the schema of its type, and every example in a
//! schema decodes and re-encodes to the same JSON. Inputs one side rejects
//! must be rejected by the other too, except for the differences that
//! `schemas/README.md` documents, which are pinned here so the README stays
//! true. A golden file holds one canonical event per type byte for byte:
//! `CONTEXTFOLD_BLESS=1 cargo test --test schemas` rewrites it.
//!
//! Validation is offline: every schema file is registered under a fixed base
//! URI, so the relative `$ref`s between files resolve from memory.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::{ClockTicked, CompactionRequested, EVENT_VERSION};
use contextfold::core::event::{
    ConversationReset, Covers, Debt, DebtCleared, DebtReason, Encoding, Envelope, EventBody,
    EventRejected, JobIssued, MemoryFlushRequested, ModelDeclared, PolicyRecorded,
    ProviderErrorObserved, ProviderUsage, RecallAnswered, RecallOutcome, RollingState,
    RollingStateUpdated, SummaryKind, SummaryRecorded, SummaryRejected, SweepEnded, SweepStop,
    TurnAppended,
};
use contextfold::core::message::{ChatMessage, Content, ContentPart, FunctionCall, Role, ToolCall};
use jsonschema::{Registry, Validator};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const SCHEMA_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/schemas");
const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/events.jsonl");
/// Where the schema files live for the validator; never fetched.
const BASE_URI: &str = "file:///contextfold/schemas/";
/// Schema files that are not one event type: the envelope alone, any
/// event (dispatching on `type`), and the chat message turns carry.
const SHARED_SCHEMAS: [&str; 3] = ["envelope", "event", "chat_message"];

// ------------------------------------------------------------------ schemas

struct Schemas {
    /// Schema name (file name without `.schema.json`) to its document.
    docs: BTreeMap<String, Value>,
    validators: BTreeMap<String, Validator>,
}

impl Schemas {
    fn load() -> Schemas {
        let mut docs = BTreeMap::new();
        let entries = std::fs::read_dir(SCHEMA_DIR)
            .unwrap_or_else(|e| panic!("cannot read {SCHEMA_DIR}: {e}"));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            let Some(name) = schema_name(&path) else {
                continue;
            };
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            let doc: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
            docs.insert(name, doc);
        }
        let registry = docs
            .iter()
            .fold(Registry::new(), |registry, (name, doc)| {
                registry
                    .add(uri_of(name), doc.clone())
                    .unwrap_or_else(|e| panic!("cannot register {name}: {e}"))
            })
            .prepare()
            .unwrap_or_else(|e| panic!("schema registry does not resolve: {e}"));
        let validators = docs
            .iter()
            .map(|(name, doc)| {
                let validator = jsonschema::options()
                    .offline()
                    .with_registry(&registry)
                    .with_base_uri(uri_of(name))
                    .build(doc)
                    .unwrap_or_else(|e| panic!("{name}.schema.json does not compile: {e}"));
                (name.clone(), validator)
            })
            .collect();
        Schemas { docs, validators }
    }

    fn validator(&self, name: &str) -> &Validator {
        self.validators
            .get(name)
            .unwrap_or_else(|| panic!("no schemas/{name}.schema.json"))
    }

    /// The schema's verdict, with every error when it rejects.
    fn check(&self, name: &str, instance: &Value) -> Result<(), String> {
        let errors: Vec<String> = self
            .validator(name)
            .iter_errors(instance)
            .map(|e| format!("at {}: {e}", e.instance_path()))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    fn examples(&self, name: &str) -> Vec<Value> {
        match self.docs.get(name).and_then(|d| d.get("examples")) {
            Some(Value::Array(examples)) => examples.clone(),
            _ => Vec::new(),
        }
    }

    fn first_example(&self, name: &str) -> Value {
        self.examples(name)
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("{name}.schema.json has no examples"))
    }

    fn type_schemas(&self) -> impl Iterator<Item = &str> {
        self.docs
            .keys()
            .map(String::as_str)
            .filter(|n| !SHARED_SCHEMAS.contains(n))
    }
}

fn schema_name(path: &Path) -> Option<String> {
    let file = path.file_name()?.to_str()?;
    file.strip_suffix(".schema.json").map(str::to_string)
}

fn uri_of(name: &str) -> String {
    format!("{BASE_URI}{name}.schema.json")
}

// ------------------------------------------------------------------ samples

const CONV: &str = "airline:agent-7:mia_li_3668";
const T0: u64 = 1_715_799_600_000;

fn event(id: &str, time: u64, body: EventBody) -> Envelope {
    Envelope::new(id, CONV, time, body)
}

fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: id.into(),
        kind: "function".into(),
        function: FunctionCall {
            name: name.into(),
            arguments: arguments.into(),
        },
    }
}

fn messages() -> Vec<ChatMessage> {
    let image = ContentPart {
        kind: "image_url".into(),
        text: None,
        other: BTreeMap::from([(
            "image_url".to_string(),
            json!({"url": "https://files.example.com/bp-HAT136.png", "detail": "low"}),
        )]),
    };
    let text_part = ContentPart {
        kind: "text".into(),
        text: Some("This boarding pass failed to scan at gate B22.".into()),
        other: BTreeMap::new(),
    };
    vec![
        ChatMessage::text(Role::System, "# Airline Agent Policy\n\nBe brief."),
        ChatMessage::text(
            Role::User,
            "Book JFK -> SEA on 2024-05-20, user mia_li_3668.",
        ),
        ChatMessage {
            content: Some(Content::Parts(vec![text_part, image])),
            name: Some("mia".into()),
            ..ChatMessage::text(Role::User, "")
        },
        ChatMessage {
            content: None,
            tool_calls: vec![call(
                "call_Vx8pQ2mN4kL7",
                "get_user_details",
                r#"{"user_id": "mia_li_3668"}"#,
            )],
            ..ChatMessage::text(Role::Assistant, "")
        },
        ChatMessage {
            tool_calls: vec![
                call("call_1", "search_direct_flight", r#"{"origin":"JFK"}"#),
                ToolCall {
                    kind: "custom".into(),
                    ..call("call_2", "search_onestop_flight", "")
                },
            ],
            ..ChatMessage::text(Role::Assistant, "Searching both kinds of flights.")
        },
        ChatMessage {
            tool_call_id: Some("call_Vx8pQ2mN4kL7".into()),
            name: Some("get_user_details".into()),
            ..ChatMessage::text(Role::Tool, r#"{"membership": "gold"}"#)
        },
        ChatMessage {
            content: Some(Content::Parts(Vec::new())),
            ..ChatMessage::text(Role::Assistant, "")
        },
    ]
}

fn debt(reason: DebtReason, instructions: Option<&str>) -> Debt {
    Debt {
        reason,
        context_tokens: 97_311,
        threshold_tokens: 96_000,
        target_tokens: 64_000,
        urgent: matches!(reason, DebtReason::Overflow | DebtReason::Manual),
        since: T0,
        instructions: instructions.map(str::to_string),
    }
}

const REASONS: [DebtReason; 5] = [
    DebtReason::Threshold,
    DebtReason::Overflow,
    DebtReason::Manual,
    DebtReason::TranscriptBytes,
    DebtReason::Resummarize,
];

const STOPS: [SweepStop; 6] = [
    SweepStop::Done,
    SweepStop::Deadline,
    SweepStop::IterationCap,
    SweepStop::SpendLimit,
    SweepStop::NoProgress,
    SweepStop::Failed,
];

/// Representative events: every type, every enum value, optional fields
/// both set and unset. The first event of each type is its canonical one
/// (the golden file).
fn samples() -> Vec<Envelope> {
    let mut out = Vec::new();
    let mut n = 0u64;
    let mut push = |body: EventBody| {
        n += 1;
        out.push(event(&format!("01HXYQ{n:020}"), T0 + n * 1000, body));
    };

    // turn_appended: the canonical one first, then every message shape.
    push(EventBody::TurnAppended(TurnAppended {
        model: Some("gpt-4o".into()),
        sender: Some("airline-frontdesk".into()),
        ..TurnAppended::from(ChatMessage::text(Role::User, "I'd like to book a flight."))
    }));
    for message in messages() {
        push(EventBody::TurnAppended(TurnAppended::from(message)));
    }
    let mut metadata = Map::new();
    metadata.insert("tool_latency_ms".into(), json!(74));
    metadata.insert("ratio".into(), json!(0.25));
    metadata.insert("tags".into(), json!(["airline", {"nested": null}]));
    metadata.insert("negative".into(), json!(-3));
    push(EventBody::TurnAppended(TurnAppended {
        message: ChatMessage::text(Role::Assistant, "Booked."),
        model: Some("gpt-4o-2024-08-06".into()),
        sender: Some("airline-frontdesk".into()),
        usage: Some(ProviderUsage {
            prompt_tokens: Some(2871),
            completion_tokens: Some(23),
            total_tokens: Some(2894),
        }),
        metadata: Some(metadata),
    }));
    push(EventBody::TurnAppended(TurnAppended {
        usage: Some(ProviderUsage::default()),
        metadata: Some(Map::new()),
        ..TurnAppended::from(ChatMessage::text(Role::User, ""))
    }));

    push(EventBody::ProviderErrorObserved(ProviderErrorObserved {
        error: "prompt is too long: 208423 tokens > 200000 maximum".into(),
        model: Some("claude-sonnet-4-5".into()),
    }));
    push(EventBody::ProviderErrorObserved(ProviderErrorObserved {
        error: "rate limit exceeded".into(),
        model: None,
    }));

    push(EventBody::CompactionRequested(CompactionRequested {
        instructions: Some("Keep every reservation id.".into()),
        keep_recent_tokens: Some(20_000),
        target_tokens: Some(48_000),
    }));
    push(EventBody::CompactionRequested(
        CompactionRequested::default(),
    ));

    push(EventBody::ModelDeclared(ModelDeclared {
        model: "gpt-4o".into(),
        context_window: Some(128_000),
    }));
    push(EventBody::ModelDeclared(ModelDeclared {
        model: "qwen2.5-coder-32b-instruct".into(),
        context_window: None,
    }));

    push(EventBody::ConversationReset(ConversationReset {
        reason: Some("user ran /new".into()),
    }));
    push(EventBody::ConversationReset(ConversationReset::default()));

    push(EventBody::DebtRecorded(debt(DebtReason::Threshold, None)));
    for reason in REASONS {
        push(EventBody::DebtRecorded(debt(reason, None)));
    }
    push(EventBody::DebtUpdated(debt(
        DebtReason::Manual,
        Some("Keep the failing test names."),
    )));
    for reason in REASONS {
        push(EventBody::DebtUpdated(debt(reason, None)));
    }

    push(EventBody::DebtCleared(DebtCleared {
        reason: "context 61840 tokens is under the 64000-token target".into(),
    }));

    let job = JobIssued {
        job_id: "airline:agent-7:mia_li_3668/job-3".into(),
        reason: DebtReason::Threshold,
        urgent: false,
        context_tokens: 97_311,
        target_tokens: 64_000,
        deadline_ms: 120_000,
        issued_at: T0,
        instructions: None,
        compact: true,
        refresh_rolling_state: false,
        max_calls: Some(24),
        max_tokens: None,
    };
    push(EventBody::JobIssued(job.clone()));
    for reason in REASONS {
        push(EventBody::JobIssued(JobIssued {
            reason,
            urgent: true,
            instructions: Some("Focus on decisions.".into()),
            ..job.clone()
        }));
    }

    push(EventBody::SummaryRejected(SummaryRejected {
        summary_id: "7f3a9c0e".into(),
        job_id: Some(job.job_id.clone()),
        reason: "stale: turns 0..=41 are already covered".into(),
    }));
    push(EventBody::SummaryRejected(SummaryRejected {
        summary_id: "0b1d3f5a".into(),
        job_id: None,
        reason: "covers turns past the end of the conversation".into(),
    }));

    push(EventBody::EventRejected(EventRejected {
        rejected_id: "01HXYW5E6F7G8H9J0K1L2M3N4P".into(),
        event_type: Some("turn_exploded".into()),
        reason: "malformed json event: unknown variant `turn_exploded`".into(),
    }));
    push(EventBody::EventRejected(EventRejected {
        rejected_id: String::new(),
        event_type: None,
        reason: "malformed msgpack event: invalid type".into(),
    }));

    push(EventBody::MemoryFlushRequested(MemoryFlushRequested {
        cycle: 1,
        reason: DebtReason::Threshold,
    }));
    for reason in REASONS {
        push(EventBody::MemoryFlushRequested(MemoryFlushRequested {
            cycle: u64::MAX,
            reason,
        }));
    }

    let leaf = SummaryRecorded {
        summary_id: "1c2e4a6b8d0f".into(),
        job_id: Some(job.job_id.clone()),
        kind: SummaryKind::Leaf,
        depth: 0,
        covers: Covers::Turns { first: 0, last: 41 },
        content: "Asked: book JFK -> SEA. Done: get_user_details(mia_li_3668).".into(),
        source_tokens: 18_944,
        tokens: 21,
        model: "gpt-4o-mini".into(),
        provider: "openai".into(),
        prompt_version: "leaf-v1".into(),
        fallback: false,
        supersedes: None,
    };
    push(EventBody::SummaryRecorded(leaf.clone()));
    push(EventBody::SummaryRecorded(SummaryRecorded {
        job_id: None,
        kind: SummaryKind::Condensed,
        depth: u32::MAX,
        covers: Covers::Summaries {
            ids: vec!["1c2e4a6b8d0f".into(), "5d7f9e1a3c5b".into()],
        },
        fallback: true,
        ..leaf.clone()
    }));
    // A re-summarization: a model summary replacing a fallback one.
    push(EventBody::SummaryRecorded(SummaryRecorded {
        supersedes: Some("4f6a8c0e2b4d".into()),
        ..leaf.clone()
    }));
    push(EventBody::SummaryRecorded(SummaryRecorded {
        covers: Covers::Summaries { ids: Vec::new() },
        kind: SummaryKind::Condensed,
        depth: 1,
        ..leaf
    }));

    let sweep = SweepEnded {
        job_id: job.job_id.clone(),
        passes: 2,
        committed: 2,
        stop: SweepStop::Done,
        detail: None,
        calls: 2,
        tokens_spent: 41_377,
        cost_micros: 6_912,
        retry_after_ms: None,
    };
    push(EventBody::SweepEnded(sweep.clone()));
    for stop in STOPS {
        push(EventBody::SweepEnded(SweepEnded {
            stop,
            detail: Some("24 summarizer calls in the last 600000 ms".into()),
            retry_after_ms: Some(1_800_000),
            ..sweep.clone()
        }));
    }

    push(EventBody::RollingStateUpdated(RollingStateUpdated {
        state: RollingState {
            completed: "Booked NO6JO3.".into(),
            in_progress: "Adding 2 checked bags.".into(),
            decisions: "Pay with certificate_7504069.".into(),
            blockers: String::new(),
            next: "Close.".into(),
        },
        through_turn: 45,
        job_id: Some(job.job_id),
    }));
    push(EventBody::RollingStateUpdated(RollingStateUpdated {
        state: RollingState::default(),
        through_turn: 0,
        job_id: None,
    }));

    // policy_recorded: the whole effective [policy], with and without a
    // previous one.
    let policy = contextfold::core::policy::PolicyConfig::default();
    push(EventBody::PolicyRecorded(PolicyRecorded {
        fingerprint: contextfold::runtime::engine::policy_fingerprint(&policy),
        previous: Some("5f0c2a7d91e3b846".into()),
        recorded_by: Some("serve-a-7c1f".into()),
        policy: Box::new(policy.clone()),
    }));
    push(EventBody::PolicyRecorded(PolicyRecorded {
        fingerprint: contextfold::runtime::engine::policy_fingerprint(&policy),
        previous: None,
        recorded_by: None,
        policy: Box::new(policy),
    }));

    // clock_ticked: a quiet partition's clock moved, by whom, or not said.
    push(EventBody::ClockTicked(ClockTicked {
        recorded_by: Some("serve-a-7c1f".into()),
    }));
    push(EventBody::ClockTicked(ClockTicked::default()));

    // recall_answered: an answer, and a deadline with its detail.
    let recall = RecallAnswered {
        question_digest: "9a1c3f5e7b2d4f6a8c0e1a3b".into(),
        outcome: RecallOutcome::Answered,
        detail: None,
        model: Some("gpt-4o-mini".into()),
        calls: 1,
        tokens_spent: 4_210,
        cost_micros: 690,
        prompt_tokens: 3_990,
        sources: vec!["sum_2f4e6a8c0b1d3f5a".into(), "turn 41".into()],
    };
    push(EventBody::RecallAnswered(recall.clone()));
    push(EventBody::RecallAnswered(RecallAnswered {
        outcome: RecallOutcome::Deadline,
        detail: Some("deadline of 30000 ms passed; the call in flight was cancelled".into()),
        model: None,
        sources: Vec::new(),
        ..recall
    }));

    // The envelope's own range: an old version and the largest time.
    let mut old = event(
        "01HXYQ-version-0",
        0,
        EventBody::ConversationReset(ConversationReset::default()),
    );
    old.version = 0;
    out.push(old);
    out.push(event(
        "01HXYQ-time-max",
        u64::MAX,
        EventBody::ConversationReset(ConversationReset::default()),
    ));
    out
}

/// One canonical event per type, in `TYPE_NAMES` order: the first sample
/// of the type, with an id and time that do not move when samples are added.
fn canonical() -> Vec<Envelope> {
    let all = samples();
    EventBody::TYPE_NAMES
        .iter()
        .zip(0u64..)
        .map(|(name, i)| {
            let sample = all
                .iter()
                .find(|e| e.type_name() == *name)
                .unwrap_or_else(|| panic!("no sample of {name}"));
            event(
                &format!("golden:{name}"),
                T0 + i * 1000,
                sample.body.clone(),
            )
        })
        .collect()
}

fn json_of(e: &Envelope) -> Value {
    serde_json::from_str(&e.to_json()).expect("the encoder writes JSON")
}

// ------------------------------------------------------------------ encoder output validates

#[test]
fn samples_cover_every_type() {
    let covered: BTreeSet<&str> = samples().iter().map(|e| e.type_name()).collect();
    let all: BTreeSet<&str> = EventBody::TYPE_NAMES.iter().copied().collect();
    assert_eq!(covered, all);
}

#[test]
fn encoder_output_validates_against_its_type_schema() {
    let schemas = Schemas::load();
    for e in samples() {
        let name = e.type_name();
        let direct = json_of(&e);
        // MessagePack is the default wire: what a reader gets back from it
        // must be the same event, hence the same JSON.
        let unpacked = Envelope::decode(&e.to_msgpack(), Encoding::Msgpack)
            .unwrap_or_else(|err| panic!("{name} {}: msgpack round trip: {err}", e.id));
        assert_eq!(unpacked, e, "{name} {}: msgpack round trip", e.id);
        assert_eq!(json_of(&unpacked), direct);

        for schema in [name, "envelope", "event"] {
            if let Err(why) = schemas.check(schema, &direct) {
                panic!(
                    "{name} {} fails {schema}.schema.json: {why}\n{direct}",
                    e.id
                );
            }
        }
        if let EventBody::TurnAppended(t) = &e.body {
            let message = serde_json::to_value(&t.message).expect("a message is JSON");
            if let Err(why) = schemas.check("chat_message", &message) {
                panic!("message of {} fails chat_message.schema.json: {why}", e.id);
            }
        }
        // The type schemas discriminate: no other type's schema accepts it.
        for other in schemas.type_schemas().filter(|o| *o != name) {
            assert!(
                schemas.check(other, &direct).is_err(),
                "{other}.schema.json accepts a {name} event"
            );
        }
    }
}

// ------------------------------------------------------------------ schema examples decode

#[test]
fn every_schema_is_valid_draft_2020_12_with_examples() {
    let schemas = Schemas::load();
    for (name, doc) in &schemas.docs {
        if let Err(e) = jsonschema::meta::validate(doc) {
            panic!("{name}.schema.json is not a valid schema: {e}");
        }
        assert_eq!(
            doc["$schema"], "https://json-schema.org/draft/2020-12/schema",
            "{name}"
        );
        assert_eq!(doc["$id"], format!("{name}.schema.json"), "{name}: $id");
        let examples = schemas.examples(name);
        assert!(!examples.is_empty(), "{name}.schema.json has no examples");
        for (i, example) in examples.iter().enumerate() {
            if let Err(why) = schemas.check(name, example) {
                panic!("{name} example {i} fails its own schema: {why}");
            }
        }
    }
}

#[test]
fn schema_examples_decode_and_re_encode_unchanged() {
    let schemas = Schemas::load();
    for name in schemas.docs.keys() {
        for (i, example) in schemas.examples(name).into_iter().enumerate() {
            if name == "chat_message" {
                let message: ChatMessage = serde_json::from_value(example.clone())
                    .unwrap_or_else(|e| panic!("chat_message example {i}: {e}"));
                let back = serde_json::to_value(&message).expect("a message is JSON");
                assert_eq!(back, example, "chat_message example {i} re-encoded");
                continue;
            }
            let bytes = serde_json::to_vec(&example).expect("an example is JSON");
            let decoded = Envelope::decode(&bytes, Encoding::Json)
                .unwrap_or_else(|e| panic!("{name} example {i} does not decode: {e}"));
            if !SHARED_SCHEMAS.contains(&name.as_str()) {
                assert_eq!(decoded.type_name(), name, "{name} example {i}");
            }
            assert_eq!(json_of(&decoded), example, "{name} example {i} re-encoded");
            let unpacked = Envelope::decode(&decoded.to_msgpack(), Encoding::Msgpack)
                .unwrap_or_else(|e| panic!("{name} example {i} via msgpack: {e}"));
            assert_eq!(unpacked, decoded, "{name} example {i} via msgpack");
        }
    }
}

#[test]
fn turn_examples_show_every_message_shape() {
    let schemas = Schemas::load();
    let messages: Vec<ChatMessage> = schemas
        .examples("turn_appended")
        .into_iter()
        .filter_map(|e| serde_json::from_value(e["payload"]["message"].clone()).ok())
        .collect();
    let has = |f: &dyn Fn(&ChatMessage) -> bool| messages.iter().any(f);
    assert!(has(&|m| matches!(m.content, Some(Content::Text(_)))));
    assert!(has(&|m| matches!(m.content, Some(Content::Parts(_)))));
    assert!(has(
        &|m| m.role == Role::Assistant && !m.tool_calls.is_empty()
    ));
    assert!(has(&|m| m.role == Role::Tool && m.tool_call_id.is_some()));
}

// ------------------------------------------------------------------ one schema per type

#[test]
fn every_type_has_a_schema_file_and_every_file_a_type() {
    let schemas = Schemas::load();
    let files: BTreeSet<&str> = schemas.type_schemas().collect();
    let types: BTreeSet<&str> = EventBody::TYPE_NAMES.iter().copied().collect();
    assert_eq!(files, types, "schemas/ against EventBody::TYPE_NAMES");
    for shared in SHARED_SCHEMAS {
        assert!(schemas.docs.contains_key(shared), "no {shared}.schema.json");
    }
    for name in types {
        let doc = &schemas.docs[name];
        assert_eq!(
            doc["properties"]["type"]["const"], name,
            "{name}: type const"
        );
        assert_eq!(doc["$ref"], "envelope.schema.json", "{name}: envelope");
    }
    let listed: BTreeSet<&str> = schemas.docs["envelope"]["properties"]["type"]["enum"]
        .as_array()
        .expect("envelope lists the types")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(listed, EventBody::TYPE_NAMES.iter().copied().collect());
}

// ------------------------------------------------------------------ negative cases

/// Edits to a JSON value by JSON pointer.
enum Edit {
    Set(&'static str, Value),
    Remove(&'static str),
}

fn apply(mut value: Value, edits: &[Edit]) -> Value {
    for edit in edits {
        let (pointer, new) = match edit {
            Edit::Set(p, v) => (*p, Some(v.clone())),
            Edit::Remove(p) => (*p, None),
        };
        let (parent, key) = pointer.rsplit_once('/').expect("pointer has a key");
        let target = value
            .pointer_mut(parent)
            .unwrap_or_else(|| panic!("no {parent} to edit"));
        match (target, new) {
            (Value::Object(map), Some(v)) => {
                map.insert(key.to_string(), v);
            }
            (Value::Object(map), None) => {
                assert!(map.remove(key).is_some(), "nothing at {pointer} to remove");
            }
            (Value::Array(items), v) => {
                let i: usize = key.parse().expect("array index");
                match v {
                    Some(v) => items[i] = v,
                    None => {
                        items.remove(i);
                    }
                }
            }
            _ => panic!("{parent} is not a container"),
        }
    }
    value
}

fn decodes(value: &Value) -> Result<Envelope, String> {
    let bytes = serde_json::to_vec(value).expect("JSON");
    Envelope::decode(&bytes, Encoding::Json).map_err(|e| e.to_string())
}

/// `(schema, what, edits to the schema's first example)`: each must be
/// rejected by the schema and by the decoder.
fn invalid_cases() -> Vec<(&'static str, &'static str, Vec<Edit>)> {
    use Edit::{Remove, Set};
    vec![
        ("envelope", "missing id", vec![Remove("/id")]),
        (
            "policy_recorded",
            "missing policy",
            vec![Remove("/payload/policy")],
        ),
        (
            "policy_recorded",
            "an unknown policy key",
            vec![Set("/payload/policy/context_thresholdd", json!(0.8))],
        ),
        ("envelope", "empty id", vec![Set("/id", json!(""))]),
        (
            "envelope",
            "empty conversation",
            vec![Set("/conversation", json!(""))],
        ),
        (
            "envelope",
            "missing conversation",
            vec![Remove("/conversation")],
        ),
        (
            "envelope",
            "newer version",
            vec![Set("/version", json!(EVENT_VERSION + 1))],
        ),
        ("envelope", "negative time", vec![Set("/time", json!(-1))]),
        ("envelope", "time null", vec![Set("/time", Value::Null)]),
        (
            "envelope",
            "unknown type",
            vec![Set("/type", json!("turn_exploded"))],
        ),
        ("envelope", "missing type", vec![Remove("/type")]),
        ("envelope", "missing payload", vec![Remove("/payload")]),
        (
            "envelope",
            "payload null",
            vec![Set("/payload", Value::Null)],
        ),
        ("envelope", "id a number", vec![Set("/id", json!(7))]),
        (
            "event",
            "payload of another type",
            vec![Set("/type", json!("sweep_ended"))],
        ),
        (
            "event",
            "unknown type",
            vec![Set("/type", json!("turn_exploded"))],
        ),
        ("event", "missing payload", vec![Remove("/payload")]),
        (
            "turn_appended",
            "unknown role",
            vec![Set("/payload/message/role", json!("robot"))],
        ),
        (
            "turn_appended",
            "developer role",
            vec![Set("/payload/message/role", json!("developer"))],
        ),
        (
            "turn_appended",
            "missing role",
            vec![Remove("/payload/message/role")],
        ),
        (
            "turn_appended",
            "missing message",
            vec![Remove("/payload/message")],
        ),
        (
            "turn_appended",
            "content a number",
            vec![Set("/payload/message/content", json!(42))],
        ),
        (
            "turn_appended",
            "content an object",
            vec![Set(
                "/payload/message/content",
                json!({"type": "text", "text": "x"}),
            )],
        ),
        (
            "turn_appended",
            "part without type",
            vec![Set("/payload/message/content", json!([{"text": "x"}]))],
        ),
        (
            "turn_appended",
            "tool_calls null",
            vec![Set("/payload/message/tool_calls", Value::Null)],
        ),
        (
            "turn_appended",
            "tool call without function name",
            vec![Set(
                "/payload/message/tool_calls",
                json!([{"id": "c1", "function": {"arguments": "{}"}}]),
            )],
        ),
        (
            "turn_appended",
            "tool call without id",
            vec![Set(
                "/payload/message/tool_calls",
                json!([{"function": {"name": "f"}}]),
            )],
        ),
        (
            "turn_appended",
            "arguments as an object",
            vec![Set(
                "/payload/message/tool_calls",
                json!([{"id": "c1", "function": {"name": "f", "arguments": {}}}]),
            )],
        ),
        (
            "turn_appended",
            "metadata a list",
            vec![Set("/payload/metadata", json!([1]))],
        ),
        (
            "turn_appended",
            "negative usage",
            vec![Set("/payload/usage", json!({"prompt_tokens": -1}))],
        ),
        (
            "provider_error_observed",
            "missing error",
            vec![Remove("/payload/error")],
        ),
        (
            "provider_error_observed",
            "error an object",
            vec![Set("/payload/error", json!({"message": "x"}))],
        ),
        (
            "compaction_requested",
            "negative target",
            vec![Set("/payload/target_tokens", json!(-5))],
        ),
        (
            "compaction_requested",
            "instructions a list",
            vec![Set("/payload/instructions", json!(["a"]))],
        ),
        (
            "model_declared",
            "missing model",
            vec![Remove("/payload/model")],
        ),
        (
            "model_declared",
            "window a string",
            vec![Set("/payload/context_window", json!("128k"))],
        ),
        (
            "conversation_reset",
            "reason a number",
            vec![Set("/payload/reason", json!(42))],
        ),
        (
            "debt_recorded",
            "unknown reason",
            vec![Set("/payload/reason", json!("bored"))],
        ),
        (
            "debt_recorded",
            "missing urgent",
            vec![Remove("/payload/urgent")],
        ),
        (
            "debt_updated",
            "missing since",
            vec![Remove("/payload/since")],
        ),
        (
            "debt_updated",
            "urgent a string",
            vec![Set("/payload/urgent", json!("yes"))],
        ),
        (
            "debt_cleared",
            "missing reason",
            vec![Remove("/payload/reason")],
        ),
        (
            "job_issued",
            "missing deadline",
            vec![Remove("/payload/deadline_ms")],
        ),
        (
            "job_issued",
            "unknown reason",
            vec![Set("/payload/reason", json!("whim"))],
        ),
        (
            "summary_rejected",
            "missing summary id",
            vec![Remove("/payload/summary_id")],
        ),
        (
            "event_rejected",
            "missing rejected id",
            vec![Remove("/payload/rejected_id")],
        ),
        (
            "memory_flush_requested",
            "negative cycle",
            vec![Set("/payload/cycle", json!(-1))],
        ),
        (
            "memory_flush_requested",
            "missing reason",
            vec![Remove("/payload/reason")],
        ),
        (
            "summary_recorded",
            "rolling kind",
            vec![Set("/payload/kind", json!("rolling"))],
        ),
        (
            "summary_recorded",
            "unknown covers kind",
            vec![Set(
                "/payload/covers",
                json!({"kind": "bytes", "first": 0, "last": 9}),
            )],
        ),
        (
            "summary_recorded",
            "turns without last",
            vec![Set("/payload/covers", json!({"kind": "turns", "first": 0}))],
        ),
        (
            "summary_recorded",
            "summaries without ids",
            vec![Set("/payload/covers", json!({"kind": "summaries"}))],
        ),
        (
            "summary_recorded",
            "depth past u32",
            vec![Set("/payload/depth", json!(u64::from(u32::MAX) + 1))],
        ),
        (
            "summary_recorded",
            "missing fallback",
            vec![Remove("/payload/fallback")],
        ),
        (
            "sweep_ended",
            "unknown stop",
            vec![Set("/payload/stop", json!("tired"))],
        ),
        (
            "sweep_ended",
            "calls null",
            vec![Set("/payload/calls", Value::Null)],
        ),
        (
            "sweep_ended",
            "missing passes",
            vec![Remove("/payload/passes")],
        ),
        (
            "rolling_state_updated",
            "missing a section",
            vec![Remove("/payload/state/next")],
        ),
        (
            "rolling_state_updated",
            "missing through_turn",
            vec![Remove("/payload/through_turn")],
        ),
        (
            "recall_answered",
            "unknown outcome",
            vec![Set("/payload/outcome", json!("maybe"))],
        ),
        (
            "recall_answered",
            "missing question digest",
            vec![Remove("/payload/question_digest")],
        ),
        (
            "recall_answered",
            "calls past u32",
            vec![Set("/payload/calls", json!(u64::from(u32::MAX) + 1))],
        ),
        (
            "clock_ticked",
            "a recorder that is not a string",
            vec![Set("/payload/recorded_by", json!(7))],
        ),
    ]
}

#[test]
fn invalid_events_are_rejected_by_schema_and_decoder() {
    let schemas = Schemas::load();
    let cases = invalid_cases();
    let mut per_schema: BTreeSet<&str> = BTreeSet::new();
    for (schema, what, edits) in &cases {
        let bad = apply(schemas.first_example(schema), edits);
        // A type's events must also fail the envelope-plus-type schema of
        // that type; envelope cases are checked against the envelope schema.
        assert!(
            schemas.check(schema, &bad).is_err(),
            "{schema}.schema.json accepts {what}: {bad}"
        );
        if let Ok(e) = decodes(&bad) {
            panic!("the decoder accepts {schema} with {what}: {e:?}");
        }
        per_schema.insert(schema);
    }
    let all: BTreeSet<&str> = schemas.docs.keys().map(String::as_str).collect();
    let expected: BTreeSet<&str> = all
        .difference(&BTreeSet::from(["chat_message"]))
        .copied()
        .collect();
    assert_eq!(
        per_schema, expected,
        "a negative case for every event schema"
    );
}

#[test]
fn invalid_messages_are_rejected_by_schema_and_decoder() {
    let schemas = Schemas::load();
    let good = schemas.first_example("chat_message");
    for (what, bad) in [
        ("unknown role", json!({"role": "robot", "content": "x"})),
        ("no role", json!({"content": "x"})),
        ("content a number", json!({"role": "user", "content": 1})),
        (
            "tool_calls null",
            json!({"role": "assistant", "tool_calls": null}),
        ),
        (
            "part without type",
            json!({"role": "user", "content": [{"text": "x"}]}),
        ),
        (
            "tool call type null",
            json!({"role": "assistant", "tool_calls": [{"id": "c", "type": null, "function": {"name": "f"}}]}),
        ),
        (
            "arguments null",
            json!({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": null}}]}),
        ),
        ("not an object", json!([good])),
    ] {
        assert!(
            schemas.check("chat_message", &bad).is_err(),
            "chat_message.schema.json accepts {what}"
        );
        assert!(
            serde_json::from_value::<ChatMessage>(bad).is_err(),
            "the decoder accepts a message with {what}"
        );
    }
}

// ------------------------------------------------------------------ lenient inputs

/// What producers really send and the decoder accepts must pass the schema
/// too: OpenAI SDK messages with `null`s and extra fields, provider usage
/// objects as-is, absent defaults.
#[test]
fn lenient_inputs_pass_schema_and_decoder() {
    use Edit::{Remove, Set};
    let schemas = Schemas::load();
    let cases: Vec<(&str, &str, Vec<Edit>)> = vec![
        (
            "envelope",
            "no version, no time",
            vec![Remove("/version"), Remove("/time")],
        ),
        ("envelope", "version 0", vec![Set("/version", json!(0))]),
        (
            "turn_appended",
            "SDK nulls and extras",
            vec![Set(
                "/payload/message",
                json!({"role": "assistant", "content": null, "refusal": null, "audio": null,
                "function_call": null, "annotations": [], "name": null, "tool_call_id": null,
                "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}),
            )],
        ),
        (
            "turn_appended",
            "parts with unknown fields and null text",
            vec![Set(
                "/payload/message/content",
                json!([{"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}}, {"type": "text", "text": null}]),
            )],
        ),
        (
            "turn_appended",
            "provider usage as-is",
            vec![Set(
                "/payload/usage",
                json!({"prompt_tokens": 3, "completion_tokens": null, "prompt_tokens_details": {"cached_tokens": 0}}),
            )],
        ),
        (
            "turn_appended",
            "null options",
            vec![
                Set("/payload/model", Value::Null),
                Set("/payload/sender", Value::Null),
                Set("/payload/usage", Value::Null),
                Set("/payload/metadata", Value::Null),
            ],
        ),
        (
            "compaction_requested",
            "null options",
            vec![
                Set("/payload/instructions", Value::Null),
                Set("/payload/target_tokens", Value::Null),
            ],
        ),
        (
            "sweep_ended",
            "spend fields absent",
            vec![
                Remove("/payload/calls"),
                Remove("/payload/tokens_spent"),
                Remove("/payload/cost_micros"),
            ],
        ),
        (
            "summary_recorded",
            "null job id",
            vec![Set("/payload/job_id", Value::Null)],
        ),
        (
            "summary_recorded",
            "null supersedes",
            vec![Set("/payload/supersedes", Value::Null)],
        ),
    ];
    for (schema, what, edits) in cases {
        let input = apply(schemas.first_example(schema), &edits);
        if let Err(why) = schemas.check(schema, &input) {
            panic!("{schema}.schema.json rejects {what}, which the decoder accepts: {why}");
        }
        if let Err(why) = decodes(&input) {
            panic!("the decoder rejects {schema} with {what}: {why}");
        }
    }
}

/// Every field of every example, removed or replaced by a value of each
/// JSON type: the schema and the decoder give the same verdict. This is what
/// keeps `required`, nullability, enums and integer ranges honest without a
/// hand-written case for each.
#[test]
fn schema_and_decoder_agree_field_by_field() {
    let schemas = Schemas::load();
    let replacements = [
        Value::Null,
        json!(true),
        json!(-1),
        json!(7),
        // The integer widths: u16 (version), u32 (depth, passes), u64.
        json!(u16::MAX),
        json!(u64::from(u16::MAX) + 1),
        json!(u64::from(u32::MAX) + 1),
        json!(u64::MAX),
        json!(2.5),
        json!("x"),
        json!(""),
        json!(["x"]),
        json!({}),
    ];
    // The envelope schema leaves the payload open, so only its own fields
    // count there; `event.schema.json` must agree on every type's examples.
    let mut pairs: Vec<(&str, Value, usize)> = Vec::new();
    for name in schemas.type_schemas() {
        for example in schemas.examples(name) {
            pairs.push((name, example.clone(), usize::MAX));
            pairs.push(("event", example, usize::MAX));
        }
    }
    for example in schemas.examples("envelope") {
        pairs.push(("envelope", example, 1));
    }
    let mut disagreements = Vec::new();
    let mut checked = 0usize;
    for (name, example, max_depth) in pairs {
        {
            for pointer in field_pointers(&example, max_depth) {
                let mut variants =
                    vec![("removed".to_string(), vec![Edit::Remove(leak(&pointer))])];
                for r in &replacements {
                    variants.push((format!("= {r}"), vec![Edit::Set(leak(&pointer), r.clone())]));
                }
                for (what, edits) in variants {
                    let input = apply(example.clone(), &edits);
                    if name == "envelope" && pointer == "/payload" && input["payload"].is_object() {
                        // A payload's contents are for the type schemas.
                        continue;
                    }
                    let schema_says = schemas.check(name, &input).is_ok();
                    let decoder_says = decodes(&input).is_ok();
                    checked += 1;
                    if schema_says != decoder_says
                        && !known_difference(&input, &pointer, schema_says, decoder_says)
                    {
                        disagreements.push(format!(
                            "{name} {} {pointer} {what}: schema {}, decoder {}",
                            example["id"],
                            verdict(schema_says),
                            verdict(decoder_says)
                        ));
                    }
                }
            }
        }
    }
    assert!(checked > 1000, "only {checked} inputs checked");
    assert!(
        disagreements.is_empty(),
        "{} disagreements:\n{}",
        disagreements.len(),
        disagreements.join("\n")
    );
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "accepts"
    } else {
        "rejects"
    }
}

fn leak(s: &str) -> &'static str {
    Box::leak(s.to_string().into_boxed_str())
}

/// JSON pointers to every object member under `value` (array items are
/// walked into, not pointed at), at most `max_depth` members deep.
fn field_pointers(value: &Value, max_depth: usize) -> Vec<String> {
    fn walk(value: &Value, at: &str, depth: usize, max: usize, out: &mut Vec<String>) {
        if depth >= max {
            return;
        }
        match value {
            Value::Object(map) => {
                for (k, v) in map {
                    let p = format!("{at}/{k}");
                    out.push(p.clone());
                    walk(v, &p, depth + 1, max, out);
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    walk(v, &format!("{at}/{i}"), depth, max, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(value, "", 0, max_depth, &mut out);
    out
}

/// Where schema and decoder may differ, as schemas/README.md documents:
/// serde also reads a struct from an array of its fields in declaration
/// order (the positional form); the schemas describe named fields only.
fn known_difference(input: &Value, pointer: &str, schema_ok: bool, decoder_ok: bool) -> bool {
    let positional = matches!(input.pointer(pointer), Some(Value::Array(_)));
    positional && !schema_ok && decoder_ok
}

/// The differences `schemas/README.md` documents, pinned so it stays true.
#[test]
fn documented_differences_hold() {
    use Edit::Set;
    let schemas = Schemas::load();
    // Unknown fields in contextfold's own objects: the decoder drops them
    // (so they would be silently lost); the schema rejects them.
    for (schema, edits) in [
        ("envelope", vec![Set("/trace", json!("abc"))]),
        ("debt_recorded", vec![Set("/payload/reson", json!("typo"))]),
        (
            "summary_recorded",
            vec![Set("/payload/covers/extra", json!(1))],
        ),
        (
            "rolling_state_updated",
            vec![Set("/payload/state/notes", json!(""))],
        ),
    ] {
        let input = apply(schemas.first_example(schema), &edits);
        assert!(
            schemas.check(schema, &input).is_err(),
            "{schema}: schema accepts an unknown field"
        );
        let decoded = decodes(&input).unwrap_or_else(|e| panic!("{schema}: decoder rejects: {e}"));
        assert_ne!(
            json_of(&decoded),
            input,
            "{schema}: the unknown field survived"
        );
    }
    // Which is how a mislabelled event gets through the decoder: a turn
    // typed as model_declared decodes, keeping only the turn's `model`.
    let mislabelled = apply(
        schemas.first_example("turn_appended"),
        &[Set("/type", json!("model_declared"))],
    );
    assert!(schemas.check("event", &mislabelled).is_err());
    let decoded = decodes(&mislabelled).expect("decoder accepts the mislabelled turn");
    assert_eq!(decoded.type_name(), "model_declared");
    // Unknown chat-message fields: both accept; the decoder drops them.
    let input = apply(
        schemas.first_example("turn_appended"),
        &[Set("/payload/message/refusal", Value::Null)],
    );
    assert!(schemas.check("turn_appended", &input).is_ok());
    let decoded = decodes(&input).expect("decoder accepts unknown message fields");
    assert!(json_of(&decoded)["payload"]["message"]
        .get("refusal")
        .is_none());
    // An integral float: JSON Schema calls 1.0 an integer, serde does not.
    let input = apply(
        schemas.first_example("model_declared"),
        &[Set("/payload/context_window", json!(128000.0))],
    );
    assert!(schemas.check("model_declared", &input).is_ok());
    assert!(decodes(&input).is_err());
}

// ------------------------------------------------------------------ golden file

#[test]
fn golden_events_match_the_encoder_byte_for_byte() {
    let schemas = Schemas::load();
    let mut expected = String::new();
    for e in canonical() {
        let line = e.to_json();
        let value: Value = serde_json::from_str(&line).expect("JSON");
        if let Err(why) = schemas.check(e.type_name(), &value) {
            panic!("canonical {} fails its schema: {why}", e.type_name());
        }
        expected.push_str(&line);
        expected.push('\n');
    }
    contextfold::testing::golden::check(
        Path::new(GOLDEN),
        &expected,
        "The wire format changed: say so in the commit message.",
        "cargo test --test schemas",
    );
    let actual = expected;
    // Each golden line decodes back to its event, in both encodings.
    for (line, e) in actual.lines().zip(canonical()) {
        assert_eq!(
            Envelope::decode(line.as_bytes(), Encoding::Json).as_ref(),
            Ok(&e)
        );
    }
}
