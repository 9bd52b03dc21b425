//! The request/reply API end to end: the JSON dispatch over a conversation
//! folded through the embedded pipeline (every operation, every error
//! code), the golden history of a fixed conversation
//! (`CONTEXTFOLD_BLESS=1 cargo test --test api` rewrites it), and the NATS
//! service against a real nats-server (skipped with a message when none is
//! installed, unless `CONTEXTFOLD_REQUIRE_NATS` is set).

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use contextfold::api::compact::{event_id_for_request, CompactResponse};
use contextfold::api::describe::DescribeResponse;
use contextfold::api::expand::ExpandResponse;
use contextfold::api::grep::{GrepResponse, MatchSource};
use contextfold::api::history::HistoryResponse;
use contextfold::api::status::{HealthStatus, StatusResponse};
use contextfold::api::{
    decode_reply, handle, handle_view, AssembleResponse, ErrorBody, ErrorCode, Held, LocalState,
    Op, ReplyError, StateView, Target,
};
use contextfold::core::event::*;
use contextfold::core::message::{ChatMessage, FunctionCall, Role, ToolCall};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::{ContextItem, State};
use contextfold::nats::api_role::{self, ServiceConfig};
use contextfold::nats::subjects::encode_conversation;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

const CONV: &str = "agent:billing/run 7";
const T0: u64 = 1_700_000_000_000;

fn policy() -> PolicyConfig {
    PolicyConfig {
        default_context_window: 5000,
        fresh_tail_count: 6,
        leaf_chunk_tokens: 1000,
        leaf_target_tokens: 160,
        condensed_target_tokens: 160,
        leaf_fanout: 3,
        condensed_fanout: 2,
        ..PolicyConfig::default()
    }
}

fn words(n: usize, seed: usize) -> String {
    (0..n)
        .map(|i| format!("v{}y{} ", (i * 11 + seed) % 89, seed % 7))
        .collect()
}

fn turn(m: ChatMessage) -> EventBody {
    EventBody::TurnAppended(TurnAppended::from(m))
}

/// A fixed conversation touching every kind of compaction decision:
/// threshold debt, jobs, leaf and condensed summaries, an overflow, a
/// manual request, a duplicate user turn and a rejected orphan result.
fn events(conv: &str) -> Vec<Envelope> {
    let mut out = Vec::new();
    let mut time = T0;
    let mut push = |body: EventBody| {
        time += 2000;
        let id = format!("{conv}#{}", out.len() + 1);
        out.push(Envelope::new(id, conv, time, body));
    };
    push(turn(ChatMessage::text(
        Role::User,
        "Refund invoice INV-2041 and close ticket T-88 once the ledger balances.",
    )));
    for i in 0..28 {
        match i % 3 {
            0 => {
                let id = format!("call_{i}");
                let mut call = ChatMessage::text(Role::Assistant, "");
                call.content = None;
                call.tool_calls = vec![ToolCall {
                    id: id.clone(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: "query_ledger".into(),
                        arguments: format!("{{\"account\":\"ACC-{i:03}\"}}"),
                    },
                }];
                push(turn(call));
                let mut result = ChatMessage::text(Role::Tool, words(160, i));
                result.tool_call_id = Some(id);
                push(turn(result));
            }
            1 => push(turn(ChatMessage::text(
                Role::Assistant,
                format!("ledger step {i}: {}", words(100, i)),
            ))),
            _ => push(turn(ChatMessage::text(
                Role::User,
                format!("continue with step {i}: {}", words(60, i)),
            ))),
        }
        if i == 10 {
            let mut orphan = ChatMessage::text(Role::Tool, "late output");
            orphan.tool_call_id = Some("never_called".into());
            push(turn(orphan));
        }
        if i == 14 {
            // The same long user turn twice within a minute.
            let text = format!("please double-check the refund amounts {}", words(20, 3));
            push(turn(ChatMessage::text(Role::User, text.clone())));
            push(turn(ChatMessage::text(Role::User, text)));
        }
        if i == 18 {
            push(EventBody::ProviderErrorObserved(ProviderErrorObserved {
                error: "This model's maximum context length is 8192 tokens. However, your messages resulted in 9120 tokens.".into(),
                model: Some("gpt-4".into()),
            }));
        }
        if i == 24 {
            push(EventBody::CompactionRequested(CompactionRequested {
                instructions: Some("keep invoice and ticket numbers".into()),
                target_tokens: Some(1500),
                keep_recent_tokens: None,
            }));
        }
    }
    push(turn(ChatMessage::text(
        Role::User,
        "Is the ledger balanced now?",
    )));
    out
}

fn fold(policy: &PolicyConfig, events: &[Envelope]) -> State {
    // On a thread of its own: async tests call this too, and a runtime
    // cannot be started inside another.
    std::thread::scope(|scope| {
        scope
            .spawn(|| fold_here(policy, events))
            .join()
            .expect("folding the fixture")
    })
}

fn fold_here(policy: &PolicyConfig, events: &[Envelope]) -> State {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut p = contextfold::testing::memory_pipeline(policy.clone())
            .await
            .unwrap();
        for e in events {
            p.ingest(std::slice::from_ref(e)).await.unwrap();
        }
        p.engine.materialized().unwrap()
    })
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(|| fold(&policy(), &events(CONV)))
}

fn call(op: &str, body: Value) -> Vec<u8> {
    handle(op, body.to_string().as_bytes(), state(), &policy())
}

fn ok<T: serde::de::DeserializeOwned>(op: &str, body: Value) -> T {
    let reply = call(op, body);
    decode_reply(&reply)
        .unwrap_or_else(|e| panic!("{op} failed: {e}: {}", String::from_utf8_lossy(&reply)))
}

fn error_of(reply: &[u8]) -> ErrorBody {
    match decode_reply::<Value>(reply) {
        Err(ReplyError::Api(e)) => e,
        other => panic!(
            "expected an error reply, got {other:?}: {}",
            String::from_utf8_lossy(reply)
        ),
    }
}

// ------------------------------------------------------------ dispatch --

/// The operations' wire names are the contract (docs/api.md, the subjects
/// `<prefix>.api.<op>.<token>`, NATS permissions written against them):
/// `Op` is derived from `Request`, so renaming a variant would rename an
/// operation; this pins them. Each has its section in docs/api.md.
#[test]
fn op_wire_names_are_pinned_and_documented() {
    let pinned = [
        "assemble", "status", "grep", "describe", "expand", "compact", "history", "recall",
    ];
    assert_eq!(Op::NAMES, pinned);
    for (&op, name) in Op::ALL.iter().zip(pinned) {
        assert_eq!(op.as_str(), name);
        assert_eq!(op.to_string(), name);
        assert_eq!(Op::parse(name), Some(op));
        assert_eq!(serde_json::to_value(op).unwrap(), json!(name));
    }
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/api.md")).unwrap();
    for name in Op::NAMES {
        assert!(
            docs.lines().any(|l| l == format!("## {name}")),
            "docs/api.md has no `## {name}` section"
        );
    }
}

#[test]
fn the_fixture_compacts_into_a_dag() {
    let conv = &state().conversations[CONV];
    assert!(conv.summaries.iter().any(|s| s.depth == 0));
    assert!(conv.summaries.iter().any(|s| s.depth >= 1));
    assert!(conv.rejections >= 1, "the orphan result is rejected");
    assert!(conv.duplicates_dropped >= 1);
}

#[test]
fn assemble_returns_openai_messages_and_accounting() {
    let out: AssembleResponse = ok("assemble", json!({"conversation": CONV, "budget": 3000}));
    assert_eq!(out.conversation, CONV);
    let a = &out.assembled;
    assert_eq!(a.messages.len(), a.sources.len());
    assert_eq!(a.budget, 3000);
    assert!(a.over_budget || a.tokens <= 3000);
    assert_eq!(
        a.messages.last().unwrap().text_content(),
        "Is the ledger balanced now?"
    );
    let raw: Value = serde_json::from_slice(&call(
        "assemble",
        json!({"conversation": CONV, "prompt": "Next?"}),
    ))
    .unwrap();
    assert!(raw["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(raw["messages"]
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m["role"].is_string()));
}

#[test]
fn status_global_and_per_conversation() {
    // An empty body is `{}`: the global status.
    let reply = handle("status", b"", state(), &policy());
    let StatusResponse::Global(g) = decode_reply(&reply).unwrap() else {
        panic!("expected global status");
    };
    assert_eq!(g.conversations, 1);
    assert!(g.rejections >= 1);
    let StatusResponse::Conversation(c) = ok("status", json!({"conversation": CONV})) else {
        panic!("expected conversation status");
    };
    let conv = &state().conversations[CONV];
    assert_eq!(c.turns.total, conv.turns.len() as u64);
    assert_eq!(c.tokens.context, conv.context.tokens());
    assert_eq!(
        c.tokens.context,
        c.tokens.summarized_prefix + c.tokens.frontier
    );
    assert!(c.compression.ratio > 1.0);
    assert_eq!(c.health.status, HealthStatus::Degraded);
    assert_eq!(g.turns, c.turns.total);
    let raw: Value =
        serde_json::from_slice(&call("status", json!({"conversation": CONV}))).unwrap();
    assert_eq!(raw["scope"], "conversation");
    assert_eq!(raw["summaries"]["by_depth"][0]["depth"], 0);
    assert!(raw["summaries"]["by_depth"][0]["total"].as_u64().unwrap() > 0);
}

#[test]
fn grep_describe_and_expand_walk_the_dag() {
    let found: GrepResponse = ok(
        "grep",
        json!({"conversation": CONV, "pattern": "INV-\\d+", "regex": true, "scope": "turns"}),
    );
    let (seq, covered_by) = found
        .matches
        .iter()
        .find_map(|m| match &m.source {
            MatchSource::Turn { seq, placement, .. } => Some((*seq, placement.covered_by.clone())),
            MatchSource::Summary { .. } => None,
        })
        .expect("the first turn names the invoice");
    assert_eq!(seq, 0);
    let top = covered_by.expect("the first turn is summarized by now");

    // The summary in context that covers turn 0, then down to the leaf.
    let DescribeResponse::Summary(s) = ok("describe", json!({"conversation": CONV, "id": top}))
    else {
        panic!("expected a summary");
    };
    assert!(s.in_context && s.first_turn == 0);
    let mut id = s.summary_id.clone();
    loop {
        let out: ExpandResponse = ok(
            "expand",
            json!({"conversation": CONV, "summary_id": id, "max_tokens": 100000}),
        );
        assert!(out.cut.is_none());
        match &out.items[0] {
            contextfold::api::expand::ExpandedItem::Summary(child) => {
                assert!(child.parent.as_deref() == Some(id.as_str()));
                id = child.summary_id.clone();
            }
            contextfold::api::expand::ExpandedItem::Turn { seq, message, .. } => {
                assert_eq!(*seq, 0);
                assert!(message.text_content().contains("INV-2041"));
                break;
            }
        }
    }

    // A turn by number and by event id describe the same turn.
    let by_seq: DescribeResponse = ok("describe", json!({"conversation": CONV, "id": 0}));
    let by_id: DescribeResponse = ok(
        "describe",
        json!({"conversation": CONV, "id": format!("{CONV}#1")}),
    );
    assert_eq!(by_seq, by_id);
}

#[test]
fn compact_builds_the_event_to_publish() {
    let out: CompactResponse = ok(
        "compact",
        json!({"conversation": CONV, "request_id": "r-1", "instructions": "keep INV numbers"}),
    );
    assert_eq!(out.event.id, event_id_for_request(CONV, "r-1"));
    assert_eq!(out.event.type_name(), "compaction_requested");
    let raw: Value = serde_json::from_slice(&call(
        "compact",
        json!({"conversation": CONV, "request_id": "r-1"}),
    ))
    .unwrap();
    // The event in the reply is the log's JSON envelope, ready to publish.
    let event: Envelope = serde_json::from_value(raw["event"].clone()).unwrap();
    assert!(Envelope::decode(event.to_json().as_bytes(), Encoding::Json).is_ok());
}

#[test]
fn history_pages() {
    let all: HistoryResponse = ok("history", json!({"conversation": CONV}));
    assert_eq!(all.entries.len(), all.total);
    let first: HistoryResponse = ok("history", json!({"conversation": CONV, "limit": 2}));
    assert_eq!(first.entries, all.entries[..2].to_vec());
    let next: HistoryResponse = ok(
        "history",
        json!({"conversation": CONV, "limit": 2, "after": first.next_after}),
    );
    assert_eq!(next.entries, all.entries[2..4].to_vec());
}

#[test]
fn every_error_code() {
    // unknown_conversation
    let e = error_of(&call("assemble", json!({"conversation": "nobody"})));
    assert_eq!(e.code, ErrorCode::UnknownConversation);
    assert_eq!(e.conversation.as_deref(), Some("nobody"));

    // bad_request: unknown op, malformed JSON, unknown field, out of range,
    // missing field, huge body.
    for (op, body) in [
        ("summon", json!({}).to_string()),
        ("grep", "{not json".to_string()),
        (
            "grep",
            json!({"conversation": CONV, "pattern": "x", "limt": 3}).to_string(),
        ),
        (
            "grep",
            json!({"conversation": CONV, "pattern": "x", "limit": 0}).to_string(),
        ),
        ("expand", json!({"conversation": CONV}).to_string()),
        (
            "describe",
            json!({"conversation": CONV, "id": "sum_nope"}).to_string(),
        ),
        ("compact", json!({"conversation": CONV}).to_string()),
        (
            "status",
            " ".repeat(contextfold::api::MAX_REQUEST_BYTES + 1),
        ),
    ] {
        let reply = handle(op, body.as_bytes(), state(), &policy());
        let e = error_of(&reply);
        assert_eq!(e.code, ErrorCode::BadRequest, "{op}: {}", e.message);
        assert!(!e.message.is_empty());
    }
    let e = error_of(&call(
        "grep",
        json!({"conversation": CONV, "pattern": "x", "limt": 3}),
    ));
    assert!(e.message.contains("limt"), "{}", e.message);
    let e = error_of(&call("summon", json!({})));
    assert!(
        e.message.contains("assemble"),
        "names the known ops: {}",
        e.message
    );

    // not_owner: through a view that holds no conversation.
    let view = Owning {
        inner: LocalState::new(state().clone(), policy()),
        owns: |_| false,
    };
    let reply = handle_view(
        "assemble",
        Target::Conversation(CONV),
        json!({"conversation": CONV}).to_string().as_bytes(),
        &view,
        750,
    );
    let e = error_of(&reply);
    assert_eq!(e.code, ErrorCode::NotOwner);
    assert_eq!(e.retry_after_ms, Some(750));
    assert_eq!(e.conversation.as_deref(), Some(CONV));
    // ...while the same view answers a global status.
    let reply = handle_view("status", Target::Global, b"{}", &view, 750);
    assert!(decode_reply::<StatusResponse>(&reply).is_ok());

    // The body must name the conversation of its subject: a permission on
    // the subject is a permission on the conversation.
    let local = LocalState::new(state().clone(), policy());
    for body in [json!({"conversation": "someone else"}), json!({})] {
        let reply = handle_view(
            "history",
            Target::Conversation(CONV),
            body.to_string().as_bytes(),
            &local,
            750,
        );
        let e = error_of(&reply);
        assert_eq!(e.code, ErrorCode::BadRequest, "{body}");
        assert!(e.message.contains("subject"), "{}", e.message);
    }
    // Only status answers globally, and only about the whole service.
    let reply = handle_view("assemble", Target::Global, b"{}", &local, 750);
    assert!(error_of(&reply).message.contains("one conversation"));
    let reply = handle_view(
        "status",
        Target::Global,
        json!({"conversation": CONV}).to_string().as_bytes(),
        &local,
        750,
    );
    assert_eq!(error_of(&reply).code, ErrorCode::BadRequest);

    // internal: a state whose context names a turn it does not hold.
    let mut broken = state().clone();
    let conv = broken.conversations.get_mut(CONV).unwrap();
    conv.context.push(ContextItem::Turn(1_000_000), 0, 0);
    for op in ["status", "assemble"] {
        let reply = handle(
            op,
            json!({"conversation": CONV}).to_string().as_bytes(),
            &broken,
            &policy(),
        );
        let e = error_of(&reply);
        assert_eq!(e.code, ErrorCode::Internal, "{op}: {}", e.message);
    }
}

/// Holds a state but owns only the conversations `owns` accepts.
struct Owning {
    inner: LocalState,
    owns: fn(&str) -> bool,
}

impl StateView for Owning {
    fn with_state<R>(
        &self,
        conversation: Option<&str>,
        f: impl FnOnce(Option<Held<'_>>) -> R,
    ) -> R {
        match conversation {
            Some(c) if !(self.owns)(c) => f(None),
            _ => self.inner.with_state(conversation, f),
        }
    }
}

// -------------------------------------------------------------- golden --

fn golden_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/api")
        .join(name)
}

#[test]
fn golden_history() {
    let reply = call("history", json!({"conversation": CONV}));
    let mut value: Value = serde_json::from_slice(&reply).unwrap();
    // Events written by a sweep are stamped with the job's issue time plus
    // the time the sweep took (real time), so their times vary run to run;
    // the golden keeps the order and the decisions, and checks times apart.
    let entries = value["entries"].as_array_mut().unwrap();
    let times: Vec<u64> = entries
        .iter()
        .map(|e| e["time"].as_u64().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    for e in entries.iter_mut() {
        e.as_object_mut().unwrap().remove("time");
    }
    let got = serde_json::to_string_pretty(&value).unwrap() + "\n";
    contextfold::testing::golden::check(
        &golden_path("history.json"),
        &got,
        "The history of the fixed conversation changed: did the fold's decisions?",
        "cargo test --test api",
    );
}

// ---------------------------------------------------------------- NATS --

/// A nats-server of this test's own and a client of it, when a binary is
/// installed where the shared harness looks (`CONTEXTFOLD_NATS_SERVER`,
/// `$CONTEXTFOLD_VENV/bin`, `.venv/bin`). Without one the test prints why
/// it skips, unless `CONTEXTFOLD_REQUIRE_NATS` is set (as in CI), which
/// makes it fail.
async fn nats() -> Option<(support::nats_server::NatsServer, async_nats::Client)> {
    if !nats_available() {
        return None;
    }
    let server = support::nats_server::NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    Some((server, client))
}

fn nats_available() -> bool {
    let Err(msg) = support::nats_server::find_binary() else {
        return true;
    };
    if std::env::var_os("CONTEXTFOLD_REQUIRE_NATS").is_some() {
        panic!("CONTEXTFOLD_REQUIRE_NATS is set but: {msg}");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {msg}");
    false
}

fn service_config() -> ServiceConfig {
    ServiceConfig {
        not_owner_retry_ms: 300,
        forward_timeout: Duration::from_secs(2),
        // These tests serve a bare state: there is no events stream to
        // store a compaction request in.
        publish_compactions: false,
        ..ServiceConfig::default()
    }
}

async fn request(client: &async_nats::Client, subject: &str, body: Value) -> async_nats::Message {
    client
        .request(subject.to_string(), body.to_string().into())
        .await
        .unwrap_or_else(|e| panic!("request on {subject}: {e}"))
}

/// The subject an operation with `body` is asked on: the conversation's
/// (`cf.api.<op>.<token>`), or the admin subject without one.
fn subject_of(op: impl std::fmt::Display, body: &Value) -> String {
    match body.get("conversation").and_then(Value::as_str) {
        Some(c) => format!("cf.api.{op}.{}", encode_conversation(c).unwrap()),
        None => format!("cf.admin.{op}"),
    }
}

/// Asks `op` on the subject its body's conversation gives.
async fn ask(
    client: &async_nats::Client,
    op: impl std::fmt::Display,
    body: Value,
) -> async_nats::Message {
    request(client, &subject_of(op, &body), body).await
}

fn header<'a>(m: &'a async_nats::Message, name: &str) -> Option<&'a str> {
    m.headers.as_ref()?.get(name).map(|v| v.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_serves_every_operation_and_structured_errors() {
    let Some((_server, client)) = nats().await else {
        return;
    };
    let view = Arc::new(LocalState::new(state().clone(), policy()));
    let service = api_role::start(client.clone(), view, service_config())
        .await
        .unwrap();
    assert_eq!(service.subject_filter(), "cf.api.*.* cf.admin.*");

    // Every operation answers exactly what the JSON dispatch answers.
    let bodies = [
        (Op::Assemble, json!({"conversation": CONV, "budget": 2500})),
        (Op::Status, json!({})),
        (Op::Status, json!({"conversation": CONV})),
        (Op::Grep, json!({"conversation": CONV, "pattern": "T-88"})),
        (Op::Describe, json!({"conversation": CONV, "id": 3})),
        (
            Op::Compact,
            json!({"conversation": CONV, "request_id": "n-1"}),
        ),
        (Op::History, json!({"conversation": CONV, "limit": 5})),
    ];
    for (op, body) in bodies {
        let reply = ask(&client, op, body.clone()).await;
        assert_eq!(
            reply.payload.as_ref(),
            call(op.as_str(), body).as_slice(),
            "{op}"
        );
        assert_eq!(header(&reply, "Content-Type"), Some("application/json"));
        assert_eq!(header(&reply, "Nats-Service-Error-Code"), None);
    }
    let summary = state().conversations[CONV].summaries[0].id.clone();
    let reply = ask(
        &client,
        "expand",
        json!({"conversation": CONV, "summary_id": summary}),
    )
    .await;
    assert!(decode_reply::<ExpandResponse>(&reply.payload).is_ok());

    // Errors are replies with the service headers, never silence.
    let reply = ask(&client, "summon", json!({})).await;
    assert_eq!(error_of(&reply.payload).code, ErrorCode::BadRequest);
    assert_eq!(header(&reply, "Nats-Service-Error-Code"), Some("400"));
    let reply = ask(
        &client,
        "grep",
        json!({"conversation": "nobody", "pattern": "x"}),
    )
    .await;
    assert_eq!(
        error_of(&reply.payload).code,
        ErrorCode::UnknownConversation
    );
    assert_eq!(header(&reply, "Nats-Service-Error-Code"), Some("404"));

    // A publish without a reply subject is dropped; the service goes on.
    client
        .publish("cf.admin.status", "{}".into())
        .await
        .unwrap();
    let reply = ask(&client, "status", json!({})).await;
    assert!(decode_reply::<StatusResponse>(&reply.payload).is_ok());

    // Stopped: nobody answers any more.
    service.stop().await;
    let err = client
        .request("cf.admin.status", "{}".into())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), async_nats::RequestErrorKind::NoResponders);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_forwards_to_the_partition_owner_or_says_not_owner() {
    let Some((server, client)) = nats().await else {
        return;
    };
    let partitions = 16;
    let partition = contextfold::nats::subjects::partition_of(CONV, partitions).unwrap();

    // Process A answers the public subjects but owns nothing.
    let stranger = Arc::new(Owning {
        inner: LocalState::new(State::default(), policy()),
        owns: |_| false,
    });
    let plain = api_role::start(client.clone(), stranger.clone(), service_config())
        .await
        .unwrap();
    let reply = ask(&client, "assemble", json!({"conversation": CONV})).await;
    let e = error_of(&reply.payload);
    assert_eq!(e.code, ErrorCode::NotOwner);
    assert_eq!(e.retry_after_ms, Some(300));
    assert_eq!(header(&reply, "Nats-Service-Error-Code"), Some("503"));
    plain.stop().await;

    let forwarding = api_role::start(
        client.clone(),
        stranger,
        ServiceConfig {
            forward_partitions: Some(partitions),
            ..service_config()
        },
    )
    .await
    .unwrap();
    // No owner yet: not_owner once the forward budget (with retries) is spent.
    let reply = ask(&client, "history", json!({"conversation": CONV})).await;
    assert_eq!(error_of(&reply.payload).code, ErrorCode::NotOwner);

    // Process B takes the partition while a request is waiting: the
    // forwarder asks again and the request is answered, not bounced.
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move { ask(&client, "history", json!({"conversation": CONV})).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let owner_client = async_nats::connect(server.url()).await.unwrap();
    let owner = api_role::start_partition(
        owner_client,
        Arc::new(LocalState::new(state().clone(), policy())),
        service_config(),
        partition,
    )
    .await
    .unwrap();
    let reply = waiting.await.unwrap();
    assert_eq!(
        reply.payload.as_ref(),
        call("history", json!({"conversation": CONV})).as_slice()
    );
    assert_eq!(owner.subject_filter(), format!("cf.api.p.{partition}.*.*"));
    for (op, body) in [
        ("assemble", json!({"conversation": CONV, "budget": 2000})),
        ("history", json!({"conversation": CONV})),
        (
            "grep",
            json!({"conversation": CONV, "pattern": "nobody", "limit": 0}),
        ),
    ] {
        let reply = ask(&client, op, body.clone()).await;
        assert_eq!(reply.payload.as_ref(), call(op, body).as_slice(), "{op}");
    }
    // The owner's error headers are relayed too.
    let reply = ask(
        &client,
        "grep",
        json!({"conversation": CONV, "pattern": ""}),
    )
    .await;
    assert_eq!(header(&reply, "Nats-Service-Error-Code"), Some("400"));
    owner.stop().await;
    forwarding.stop().await;
}

/// `start` returns once the server has the subscription: a request sent
/// right after, from another connection, is answered (never "no
/// responders"). A plain flush only writes to the socket, and the other
/// connection's request can overtake the subscription on a busy server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_started_service_answers_the_next_request() {
    let Some((server, client)) = nats().await else {
        return;
    };
    let view = Arc::new(LocalState::new(state().clone(), policy()));
    for attempt in 0..40 {
        let service = api_role::start(
            async_nats::connect(server.url()).await.unwrap(),
            view.clone(),
            service_config(),
        )
        .await
        .unwrap();
        let reply = client
            .request(
                subject_of("status", &json!({"conversation": CONV})),
                json!({"conversation": CONV}).to_string().into(),
            )
            .await
            .unwrap_or_else(|e| panic!("attempt {attempt}: {e}"));
        assert!(decode_reply::<StatusResponse>(&reply.payload).is_ok());
        service.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_queue_group_answers_each_request_once() {
    let Some((server, client)) = nats().await else {
        return;
    };
    let mut services = Vec::new();
    for _ in 0..2 {
        let c = async_nats::connect(server.url()).await.unwrap();
        let view = Arc::new(LocalState::new(state().clone(), policy()));
        services.push(api_role::start(c, view, service_config()).await.unwrap());
    }
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(format!("{inbox}.*")).await.unwrap();
    let n = 40;
    for i in 0..n {
        client
            .publish_with_reply(
                subject_of("status", &json!({"conversation": CONV})),
                format!("{inbox}.{i}"),
                json!({"conversation": CONV}).to_string().into(),
            )
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    let mut seen = vec![0u32; n];
    use futures::StreamExt;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while seen.contains(&0) {
        let m = tokio::time::timeout_at(deadline, replies.next())
            .await
            .expect("every request is answered")
            .unwrap();
        let i: usize = m
            .subject
            .as_str()
            .rsplit('.')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        seen[i] += 1;
    }
    // Wait a little for any duplicate.
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(300), replies.next()).await {
        let i: usize = m
            .subject
            .as_str()
            .rsplit('.')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        seen[i] += 1;
    }
    assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
    for s in services {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_reply_over_max_payload_becomes_an_error_reply() {
    let Some((_server, client)) = nats().await else {
        return;
    };
    let max = client.server_info().max_payload;
    // One turn bigger than the server's max_payload: describe returns it whole.
    let big = "ledger row 42 balanced ok\n".repeat(max / 26 + 100);
    let mut input = events("big");
    input.truncate(3);
    input.push(Envelope::new(
        "big#huge",
        "big",
        T0 + 1_000_000,
        turn(ChatMessage::text(Role::User, big)),
    ));
    let folded = fold(&policy(), &input);
    let view = Arc::new(LocalState::new(folded, policy()));
    let service = api_role::start(client.clone(), view, service_config())
        .await
        .unwrap();
    let reply = ask(
        &client,
        "describe",
        json!({"conversation": "big", "id": "big#huge"}),
    )
    .await;
    let e = error_of(&reply.payload);
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("max_payload"), "{}", e.message);
    // A smaller question about the same turn still works.
    let reply = ask(
        &client,
        "grep",
        json!({"conversation": "big", "pattern": "row 42", "limit": 1}),
    )
    .await;
    assert!(decode_reply::<GrepResponse>(&reply.payload).is_ok());
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_run_follows_the_held_partitions_and_stops_on_shutdown() {
    let Some((server, client)) = nats().await else {
        return;
    };
    let partition = contextfold::nats::subjects::partition_of(CONV, 16).unwrap();
    let held = Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let role = tokio::spawn(api_role::run(
        async_nats::connect(server.url()).await.unwrap(),
        Arc::new(LocalState::new(state().clone(), policy())),
        ServiceConfig {
            forward_partitions: Some(16),
            ..service_config()
        },
        {
            let held = held.clone();
            move || held.lock().unwrap().clone()
        },
        stop_rx,
    ));
    let owner_subject = format!(
        "cf.api.p.{partition}.status.{}",
        encode_conversation(CONV).unwrap()
    );
    let body = json!({"conversation": CONV}).to_string();
    // Polls until the owner subject is (or is not) answered.
    let answered = |want: bool| {
        let client = client.clone();
        let subject = owner_subject.clone();
        let body = body.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            loop {
                let got = client
                    .request(subject.clone(), body.clone().into())
                    .await
                    .is_ok();
                if got == want {
                    return;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{subject}: expected answered = {want}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    // The public subject answers from the start: once the role is up
    // (it subscribes after the spawn returns), and before it holds any
    // partition, whose owner subject stays unanswered.
    let public = subject_of("status", &json!({"conversation": CONV}));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let reply = loop {
        match client.request(public.clone(), body.clone().into()).await {
            Ok(reply) => break reply,
            Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{public}: the role never answered"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("request on {public}: {e}"),
        }
    };
    assert!(decode_reply::<StatusResponse>(&reply.payload).is_ok());
    answered(false).await;
    held.lock().unwrap().push(partition);
    answered(true).await;
    held.lock().unwrap().clear();
    answered(false).await;
    stop.send(true).unwrap();
    role.await.unwrap().unwrap();
    let err = client
        .request("cf.admin.status", "{}".into())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), async_nats::RequestErrorKind::NoResponders);
}
