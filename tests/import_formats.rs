//! The formats real users have, on real examples committed under
//! `tests/data/` (sources and licences in `tests/data/README.md`): an
//! OpenHands evaluation output (`output.jsonl`) and a Codex CLI rollout.
//! Expected counts are computed here from the raw records with a reading of
//! each format independent of the importer's.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::{EventBody, TurnAppended};
use contextfold::core::message::Role;
use contextfold::import::{
    detect_format, import_bytes, import_bytes_reporting, Format, ImportedConversation,
};
use serde_json::Value;
use std::collections::{BTreeMap, HashSet};
use std::path::Path;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");
const OPENHANDS: &str = "openhands/multi_swe_bench_output.jsonl";
const CODEX: &str = "codex/agent-history_session-01.jsonl";

/// The formats' names are the contract of `--format` (and of the error
/// that lists them): `Format` derives them from its variants, so renaming
/// one would rename a format; this pins them.
#[test]
fn format_names_are_pinned() {
    let pinned = [
        "auto",
        "openai",
        "pi",
        "claude-code",
        "swe-agent",
        "openhands",
        "aider",
        "codex",
    ];
    assert_eq!(Format::NAMES, pinned);
    for (&format, name) in Format::ALL.iter().zip(pinned) {
        assert_eq!(format.name(), name);
        assert_eq!(format.to_string(), name);
        assert_eq!(name.parse::<Format>(), Ok(format));
    }
    let unknown = detect_format(b"not a transcript").unwrap_err().to_string();
    assert!(
        unknown.ends_with(
            "pass --format with one of: openai, pi, claude-code, swe-agent, openhands, aider, codex"
        ),
        "{unknown}"
    );
}

fn read(rel: &str) -> Vec<u8> {
    let path = Path::new(DATA).join(rel);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn turns(conv: &ImportedConversation) -> Vec<&TurnAppended> {
    conv.events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::TurnAppended(t) => Some(t),
            _ => None,
        })
        .collect()
}

fn roles(conv: &ImportedConversation) -> BTreeMap<&'static str, usize> {
    let mut out = BTreeMap::new();
    for t in turns(conv) {
        *out.entry(t.message.role.as_str()).or_default() += 1;
    }
    out
}

/// Every tool message answers a call of the assistant message that opened
/// its group, once.
fn assert_paired(conv: &ImportedConversation) -> usize {
    let mut open: Vec<String> = Vec::new();
    let mut answered = 0;
    for t in turns(conv) {
        match t.message.role {
            Role::Assistant => open = t.message.tool_calls.iter().map(|c| c.id.clone()).collect(),
            Role::Tool => {
                let id = t.message.tool_call_id.clone().unwrap_or_default();
                let at = open.iter().position(|c| *c == id);
                assert!(
                    at.is_some(),
                    "{}: tool result {id} answers no open call",
                    conv.conversation
                );
                open.retain(|c| *c != id);
                answered += 1;
            }
            _ => open.clear(),
        }
    }
    answered
}

// ------------------------------------------------------------ OpenHands

/// Turns an OpenHands history gives, read from the raw events: user / agent
/// messages, the system prompt, one assistant message per model response (or
/// per action without one) and one tool message per observation answering a
/// call.
fn openhands_expectation(history: &[Value]) -> (BTreeMap<&'static str, usize>, usize) {
    let mut roles: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut calls = 0;
    let mut responses: HashSet<String> = HashSet::new();
    for e in history {
        let meta = e.get("tool_call_metadata").filter(|m| !m.is_null());
        let call_id = meta
            .and_then(|m| m.get("tool_call_id"))
            .and_then(Value::as_str);
        if e.get("observation").is_some() {
            if call_id.is_some() {
                *roles.entry("tool").or_default() += 1;
            }
            continue;
        }
        let Some(action) = e.get("action").and_then(Value::as_str) else {
            continue;
        };
        if call_id.is_some() {
            calls += 1;
            let response = meta
                .and_then(|m| m.get("model_response"))
                .and_then(|r| r.get("id"))
                .and_then(Value::as_str);
            if response.is_none_or(|r| responses.insert(r.to_string())) {
                *roles.entry("assistant").or_default() += 1;
            }
            continue;
        }
        let content = e
            .get("args")
            .and_then(|a| a.get("content"))
            .and_then(Value::as_str)
            .or(e.get("message").and_then(Value::as_str))
            .unwrap_or_default();
        match (action, e.get("source").and_then(Value::as_str)) {
            ("message", Some("user")) if !content.is_empty() => {
                *roles.entry("user").or_default() += 1
            }
            ("message", Some("agent")) if !content.is_empty() => {
                *roles.entry("assistant").or_default() += 1
            }
            ("system", _) => *roles.entry("system").or_default() += 1,
            _ => {}
        }
    }
    (roles, calls)
}

fn instances(bytes: &[u8]) -> Vec<Value> {
    bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("the committed example is valid JSONL"))
        .collect()
}

#[test]
fn openhands_eval_output_gives_one_conversation_per_instance() {
    let bytes = read(OPENHANDS);
    assert_eq!(detect_format(&bytes).unwrap(), Format::Openhands);
    let auto = import_bytes_reporting(&bytes, Format::Auto, "output.jsonl").unwrap();
    // `--format openhands` reads it too, the same way.
    let named = import_bytes(&bytes, Format::Openhands, "output.jsonl").unwrap();
    assert_eq!(auto.conversations, named);
    assert!(auto.skipped.is_empty(), "{:?}", auto.skipped);

    let raw = instances(&bytes);
    assert_eq!(auto.conversations.len(), raw.len());
    for (conv, inst) in auto.conversations.iter().zip(&raw) {
        let id = inst["instance_id"].as_str().unwrap();
        assert_eq!(conv.conversation, format!("output#{id}"));
        assert_eq!(conv.format, Format::Openhands);
        let history = inst["history"].as_array().unwrap();
        let (want_roles, want_calls) = openhands_expectation(history);
        assert_eq!(roles(conv), want_roles, "{id}");
        let calls: usize = turns(conv).iter().map(|t| t.message.tool_calls.len()).sum();
        assert_eq!(calls, want_calls, "{id}");
        // Every observation answers the call its action made.
        assert_eq!(
            assert_paired(conv),
            want_roles.get("tool").copied().unwrap_or(0)
        );
        // The first turns are the system prompt and the task.
        let first = turns(conv);
        assert_eq!(first[0].message.role, Role::System);
        assert_eq!(first[1].message.role, Role::User);
        assert!(
            first[1].message.text_content().contains(
                inst["instance"]["repo"]
                    .as_str()
                    .unwrap()
                    .split('/')
                    .nth(1)
                    .unwrap()
            ),
            "{id}: the task names the repository"
        );
        // The model the responses name is declared.
        let model = conv.events.iter().find_map(|e| match &e.body {
            EventBody::ModelDeclared(m) => Some(m.model.clone()),
            _ => None,
        });
        assert!(model.is_some(), "{id}: no model declared");
    }
}

#[test]
fn openhands_eval_output_reports_a_damaged_line_and_imports_the_rest() {
    let bytes = read(OPENHANDS);
    let text = String::from_utf8(bytes).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // A torn copy of the first instance after it, and an object that is no
    // instance, between the real ones.
    let torn = &lines[0][..lines[0].len() / 2];
    let damaged = format!(
        "{}\n{torn}\n{}\n{{\"instance_id\":\"x-1\",\"test_result\":{{}}}}\n{}\n",
        lines[0], lines[1], lines[2]
    );
    let imported =
        import_bytes_reporting(damaged.as_bytes(), Format::Auto, "output.jsonl").unwrap();
    let ids: Vec<&str> = imported
        .conversations
        .iter()
        .map(|c| c.conversation.as_str())
        .collect();
    assert_eq!(
        ids,
        [
            "output#ponylang__ponyc-4595",
            "output#ponylang__ponyc-4593",
            "output#ponylang__ponyc-4588"
        ]
    );
    let skipped: Vec<usize> = imported.skipped.iter().map(|s| s.line).collect();
    assert_eq!(skipped, [2, 4], "{:?}", imported.skipped);
    assert!(imported.skipped[0].reason.contains("not a JSON object"));
    assert!(
        imported.skipped[1].reason.contains("x-1"),
        "{}",
        imported.skipped[1]
    );
    assert!(imported.skipped[1].reason.contains("history"));
    // Nothing of the good instances is lost.
    let clean = import_bytes(text.as_bytes(), Format::Openhands, "output.jsonl").unwrap();
    assert_eq!(imported.conversations, clean);
}

#[test]
fn openhands_eval_instance_with_a_bad_event_keeps_the_others() {
    let bytes = read(OPENHANDS);
    let mut inst: Value = instances(&bytes).remove(0);
    let history = inst["history"].as_array_mut().unwrap();
    let before = history.len();
    // An event whose `args` is not an object cannot be read.
    history.insert(
        3,
        serde_json::json!({"id": 999, "source": "agent", "action": "run", "args": 5}),
    );
    let line = serde_json::to_string(&inst).unwrap();
    let imported = import_bytes_reporting(line.as_bytes(), Format::Auto, "one.jsonl").unwrap();
    assert_eq!(imported.skipped.len(), 1, "{:?}", imported.skipped);
    assert_eq!(imported.skipped[0].line, 1);
    assert!(
        imported.skipped[0].reason.contains("history event 3"),
        "{}",
        imported.skipped[0]
    );
    let (want, _) =
        openhands_expectation(&instances(&bytes)[0]["history"].as_array().unwrap()[..before]);
    assert_eq!(roles(&imported.conversations[0]), want);
}

// ---------------------------------------------------------------- Codex

#[test]
fn codex_rollout_imports_its_messages_model_and_usage() {
    let bytes = read(CODEX);
    assert_eq!(detect_format(&bytes).unwrap(), Format::Codex);
    let imported = import_bytes_reporting(&bytes, Format::Auto, "session-01.jsonl").unwrap();
    assert!(imported.skipped.is_empty(), "{:?}", imported.skipped);
    let named = import_bytes(&bytes, Format::Codex, "session-01.jsonl").unwrap();
    assert_eq!(imported.conversations, named);
    let conv = &imported.conversations[0];
    assert_eq!(conv.conversation, "session-01");

    // Independent reading: each response_item message is a turn (developer
    // as system), the session's base instructions the system message.
    let records: Vec<Value> = bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect();
    let mut want: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut models = Vec::new();
    let mut last_usage = None;
    for r in &records {
        let p = &r["payload"];
        match r["type"].as_str().unwrap() {
            "session_meta" if p["base_instructions"]["text"].is_string() => {
                *want.entry("system").or_default() += 1
            }
            "response_item" if p["type"] == "message" => {
                let role = match p["role"].as_str().unwrap() {
                    "developer" | "system" => "system",
                    "user" => "user",
                    "assistant" => "assistant",
                    other => panic!("role {other}"),
                };
                *want.entry(role).or_default() += 1;
            }
            "turn_context" => models.push(p["model"].as_str().unwrap().to_string()),
            "event_msg" if p["type"] == "token_count" => {
                last_usage = p["info"]["last_token_usage"]["total_tokens"].as_u64()
            }
            _ => {}
        }
    }
    assert_eq!(roles(conv), want);
    let declared: Vec<String> = conv
        .events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::ModelDeclared(m) => Some(m.model.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(declared, models);
    let assistant = turns(conv)
        .into_iter()
        .find(|t| t.message.role == Role::Assistant)
        .unwrap();
    assert_eq!(assistant.usage.and_then(|u| u.total_tokens), last_usage);
    assert!(last_usage.is_some());
}

#[test]
fn codex_rollout_reports_a_damaged_line_and_imports_the_rest() {
    let text = String::from_utf8(read(CODEX)).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let n = lines.len();
    // Tear the developer message's record in half (a crash mid-write leaves
    // such a line) and add a record of a type this importer does not know.
    let at = lines
        .iter()
        .position(|l| l.contains("\"role\":\"developer\""))
        .unwrap();
    let half = lines[at].len() / 2;
    lines[at].truncate(half);
    lines.push(
        r#"{"timestamp":"2026-06-05T04:58:27.000Z","type":"world_state","payload":{"x":1}}"#
            .to_string(),
    );
    let damaged = lines.join("\n") + "\n";
    let imported = import_bytes_reporting(damaged.as_bytes(), Format::Auto, "s.jsonl").unwrap();
    assert_eq!(imported.conversations[0].format, Format::Codex);
    let skipped: Vec<(usize, bool)> = imported
        .skipped
        .iter()
        .map(|s| (s.line, s.reason.contains("world_state")))
        .collect();
    assert_eq!(
        skipped,
        [(at + 1, false), (n + 1, true)],
        "{:?}",
        imported.skipped
    );
    let clean = import_bytes(text.as_bytes(), Format::Codex, "s.jsonl").unwrap();
    let mut want = roles(&clean[0]);
    *want.get_mut("system").unwrap() -= 1;
    assert_eq!(roles(&imported.conversations[0]), want);
}

#[test]
fn codex_and_openhands_eval_are_told_apart_from_the_other_jsonl_formats() {
    let cases: [(&str, Format); 5] = [
        (
            "{\"timestamp\":\"t\",\"type\":\"session_meta\",\"payload\":{\"id\":\"a\"}}\n",
            Format::Codex,
        ),
        (
            "{\"type\":\"response_item\",\"payload\":{\"type\":\"message\",\"role\":\"user\",\"content\":[]}}\n{\"type\":\"event_msg\",\"payload\":{}}\n",
            Format::Codex,
        ),
        (
            "{\"instance_id\":\"a__b-1\",\"instruction\":\"x\",\"history\":[]}\n{\"instance_id\":\"a__b-2\",\"history\":[]}\n",
            Format::Openhands,
        ),
        // A pi record is still pi, a Claude Code record still Claude Code.
        ("{\"type\":\"session\",\"id\":\"x\"}\n{\"type\":\"message\",\"message\":{}}\n", Format::Pi),
        ("{\"type\":\"user\",\"message\":{}}\n", Format::ClaudeCode),
    ];
    for (text, want) in cases {
        assert_eq!(detect_format(text.as_bytes()).unwrap(), want, "{text}");
    }
    // A damaged first record does not hide the format of the next.
    let text = "{\"type\":\"session_meta\",\"payl\n{\"type\":\"turn_context\",\"payload\":{\"model\":\"m\"}}\n";
    assert_eq!(detect_format(text.as_bytes()).unwrap(), Format::Codex);
}

#[test]
fn an_instance_of_events_this_importer_does_not_read_is_reported() {
    // One real instance, then one whose history holds OpenHands SDK (V1)
    // events, which carry a `kind` and no `action` / `observation`.
    let bytes = read(OPENHANDS);
    let first = String::from_utf8(bytes)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string();
    let sdk = r#"{"instance_id":"sdk-1","instruction":"x","history":[{"kind":"SystemPromptEvent","source":"agent"},{"kind":"MessageEvent","source":"user"}]}"#;
    let text = format!("{first}\n{sdk}\n");
    let imported = import_bytes_reporting(text.as_bytes(), Format::Auto, "o.jsonl").unwrap();
    assert_eq!(imported.conversations.len(), 1);
    assert_eq!(imported.skipped.len(), 1, "{:?}", imported.skipped);
    let s = &imported.skipped[0];
    assert_eq!(s.line, 2);
    assert!(
        s.reason.contains("sdk-1") && s.reason.contains("MessageEvent"),
        "{s}"
    );
}
