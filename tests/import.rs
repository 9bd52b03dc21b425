//! Every transcript in `../shared/data/transcripts/` imports into valid,
//! deterministic inbound events. Expected counts are computed here from the
//! raw files with simple, independent readings of each format, and checked
//! against the figures the data README states where it states them.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::{Encoding, Envelope, EventBody, TurnAppended};
use contextfold::core::message::Role;
use contextfold::import::{
    detect_format, import_bytes, import_file, Format, ImportError, ImportedConversation,
};
use serde_json::Value;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The shared data beside the crate; from a git worktree one level deeper
/// (`wt/<branch>`), beside its parent.
const DATA_DIRS: [&str; 2] = [
    concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data/transcripts"),
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/transcripts"),
];

const FILES: [(&str, Format); 12] = [
    ("claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl", Format::ClaudeCode),
    (
        "claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.subagents.agent-acompact-70d8e7.jsonl",
        Format::ClaudeCode,
    ),
    ("claude-code_marot-spotter/tool_heavy.jsonl", Format::ClaudeCode),
    ("claude-code_marot-spotter/short.jsonl", Format::ClaudeCode),
    ("pi-openclaw_badlogic-pi-mono/before-compaction.jsonl", Format::Pi),
    ("aider_Aider-AI-aider/chat-history.md", Format::Aider),
    ("tau-bench_sierra-research/gpt-4o-airline.json", Format::Openai),
    ("openhands_All-Hands-AI/basic.json", Format::Openhands),
    ("openhands_All-Hands-AI/basic_interactions.json", Format::Openhands),
    ("swe-agent_SWE-agent/marshmallow-code__marshmallow-1867.function_calling.traj", Format::SweAgent),
    ("swe-agent_SWE-agent/pydicom__pydicom-1458.traj", Format::SweAgent),
    ("mini-swe-agent_SWE-agent/github_issue.traj.json", Format::Openai),
];

fn data_path(rel: &str) -> Option<PathBuf> {
    let found = DATA_DIRS
        .iter()
        .map(|d| Path::new(d).join(rel))
        .find(|p| p.exists());
    if found.is_none() {
        eprintln!("skipping: {rel} is absent from {DATA_DIRS:?} (shared test data not mounted)");
    }
    found
}

fn turns(conv: &ImportedConversation) -> impl Iterator<Item = &TurnAppended> {
    conv.events.iter().filter_map(|e| match &e.body {
        EventBody::TurnAppended(t) => Some(t),
        _ => None,
    })
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Counts {
    conversations: usize,
    turns: usize,
    tool_calls: usize,
    roles: BTreeMap<&'static str, usize>,
    /// Tool results that answered nothing and were kept as user messages.
    orphans: usize,
    console: usize,
    /// Calls no tool message answers (aborted or interrupted in the source).
    unanswered: usize,
    models_declared: usize,
    provider_errors: usize,
}

fn counts(convs: &[ImportedConversation]) -> Counts {
    let mut c = Counts {
        conversations: convs.len(),
        ..Counts::default()
    };
    for conv in convs {
        let answered: HashSet<&str> = turns(conv)
            .filter_map(|t| t.message.tool_call_id.as_deref())
            .collect();
        for e in &conv.events {
            match &e.body {
                EventBody::TurnAppended(t) => {
                    c.unanswered += t
                        .message
                        .tool_calls
                        .iter()
                        .filter(|k| !answered.contains(k.id.as_str()))
                        .count();
                    c.turns += 1;
                    c.tool_calls += t.message.tool_calls.len();
                    *c.roles.entry(t.message.role.as_str()).or_default() += 1;
                    if t.metadata
                        .as_ref()
                        .is_some_and(|m| m.contains_key("orphan_tool_call_id"))
                    {
                        c.orphans += 1;
                    }
                    if t.message.name.as_deref() == Some("console") {
                        c.console += 1;
                    }
                }
                EventBody::ModelDeclared(_) => c.models_declared += 1,
                EventBody::ProviderErrorObserved(_) => c.provider_errors += 1,
                other => panic!(
                    "importers publish inbound events only, got {}",
                    other.type_name()
                ),
            }
        }
    }
    c
}

/// What a provider accepts: every tool message answers an unanswered call of
/// the assistant message that opened the current run of tool messages.
fn assert_tool_pairing(conv: &ImportedConversation) {
    let mut open: Vec<String> = Vec::new();
    let mut all_calls = HashSet::new();
    for t in turns(conv) {
        let m = &t.message;
        match m.role {
            Role::Assistant => {
                open = m.tool_calls.iter().map(|c| c.id.clone()).collect();
                for c in &m.tool_calls {
                    assert!(!c.id.is_empty(), "{}: empty call id", conv.conversation);
                    assert!(
                        all_calls.insert(c.id.clone()),
                        "{}: call id {} reused",
                        conv.conversation,
                        c.id
                    );
                }
            }
            Role::Tool => {
                let id = m.tool_call_id.as_deref().unwrap_or_else(|| {
                    panic!("{}: tool message without tool_call_id", conv.conversation)
                });
                let at = open.iter().position(|c| c == id).unwrap_or_else(|| {
                    panic!(
                        "{}: tool result {id} answers no open call",
                        conv.conversation
                    )
                });
                open.remove(at);
                assert!(
                    m.content.is_some(),
                    "{}: tool message without content",
                    conv.conversation
                );
            }
            Role::User | Role::System => open.clear(),
        }
    }
}

fn assert_envelopes(convs: &[ImportedConversation], format: Format) {
    let mut ids = HashSet::new();
    let mut conversations = HashSet::new();
    for conv in convs {
        assert_eq!(conv.format, format);
        assert!(
            conversations.insert(conv.conversation.clone()),
            "duplicate conversation {}",
            conv.conversation
        );
        assert!(
            turns(conv).next().is_some(),
            "{} has no turn",
            conv.conversation
        );
        let mut last_time = 0;
        for e in &conv.events {
            assert_eq!(e.conversation, conv.conversation);
            assert!(ids.insert(e.id.clone()), "duplicate event id {}", e.id);
            assert!(
                e.time >= last_time,
                "{}: time goes back at {}",
                conv.conversation,
                e.id
            );
            last_time = e.time;
            e.validate().unwrap();
            for enc in [Encoding::Msgpack, Encoding::Json] {
                let back = Envelope::decode(&e.encode(enc), enc)
                    .unwrap_or_else(|err| panic!("{} does not decode as {enc}: {err}", e.id));
                assert_eq!(&back, e, "{} changes through {enc}", e.id);
            }
        }
        // A model declared at all is declared before the first turn.
        let first_model = conv
            .events
            .iter()
            .position(|e| matches!(e.body, EventBody::ModelDeclared(_)));
        let first_turn = conv
            .events
            .iter()
            .position(|e| matches!(e.body, EventBody::TurnAppended(_)));
        if let (Some(m), Some(t)) = (first_model, first_turn) {
            assert!(
                m < t,
                "{}: model declared after the first turn",
                conv.conversation
            );
        }
        assert_tool_pairing(conv);
        for t in turns(conv) {
            assert!(
                t.message.content.is_some() || !t.message.tool_calls.is_empty(),
                "{}: empty message",
                conv.conversation
            );
        }
    }
}

#[test]
fn every_transcript_imports_valid_deterministic_events() {
    println!(
        "{:<100} {:>6} {:>6} {:>6} {:>5} {:>5} {:>8}  roles",
        "file", "convs", "turns", "calls", "orph", "model", "ms"
    );
    for (rel, format) in FILES {
        let Some(path) = data_path(rel) else { continue };
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(detect_format(&bytes).unwrap(), format, "{rel}");
        let started = Instant::now();
        let convs = import_file(&path, Format::Auto).unwrap_or_else(|e| panic!("{rel}: {e}"));
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        assert!(!convs.is_empty(), "{rel}");
        assert_envelopes(&convs, format);
        // Deterministic: again, explicitly, and from bytes under the same name.
        assert_eq!(
            import_file(&path, format).unwrap(),
            convs,
            "{rel}: not deterministic"
        );
        let name = path.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            import_bytes(&bytes, Format::Auto, name).unwrap(),
            convs,
            "{rel}"
        );
        let c = counts(&convs);
        println!(
            "{rel:<100} {:>6} {:>6} {:>6} {:>5} {:>5} {ms:>8.1}  {:?} console={} unanswered={} errors={}",
            c.conversations, c.turns, c.tool_calls, c.orphans, c.models_declared, c.roles, c.console, c.unanswered, c.provider_errors
        );
    }
}

fn read_json(rel: &str) -> Option<(PathBuf, Value)> {
    let path = data_path(rel)?;
    let value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    Some((path, value))
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Role counts and tool calls of plain OpenAI messages, read straight from JSON.
fn openai_expectation(messages: &[Value]) -> (BTreeMap<&'static str, usize>, usize) {
    let mut roles = BTreeMap::new();
    let mut calls = 0;
    for m in messages {
        let role = match m["role"].as_str().unwrap() {
            "system" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            other => panic!("unexpected role {other}"),
        };
        *roles.entry(role).or_default() += 1;
        calls += m["tool_calls"].as_array().map_or(0, Vec::len);
    }
    (roles, calls)
}

#[test]
fn tau_bench_gives_one_conversation_per_run() {
    let Some((path, runs)) = read_json("tau-bench_sierra-research/gpt-4o-airline.json") else {
        return;
    };
    let runs = runs.as_array().unwrap();
    let convs = import_file(&path, Format::Auto).unwrap();
    assert_eq!(runs.len(), 200, "the data README says 200 runs");
    assert_eq!(convs.len(), runs.len());
    for (i, (run, conv)) in runs.iter().zip(&convs).enumerate() {
        assert_eq!(conv.conversation, format!("gpt-4o-airline#{i}"));
        let traj = run["traj"].as_array().unwrap();
        let (roles, calls) = openai_expectation(traj);
        let c = counts(std::slice::from_ref(conv));
        assert_eq!(c.roles, roles, "run {i}");
        assert_eq!(c.tool_calls, calls, "run {i}");
        assert_eq!(c.orphans, 0, "run {i}");
        // tau-bench names no model; none is guessed.
        assert_eq!(c.models_declared, 0);
        // Messages are published as they are.
        for (raw, t) in traj.iter().zip(turns(conv)) {
            assert_eq!(
                serde_json::to_value(&t.message).unwrap()["content"],
                raw["content"],
                "run {i}"
            );
        }
    }
    let c = counts(&convs);
    assert_eq!(c.turns, 5308, "the data README says 5308 messages");
    assert_eq!(c.roles["tool"], 1164);
}

#[test]
fn openai_message_arrays_and_swe_agent_histories_keep_every_message() {
    for rel in [
        "mini-swe-agent_SWE-agent/github_issue.traj.json",
        "swe-agent_SWE-agent/marshmallow-code__marshmallow-1867.function_calling.traj",
        "swe-agent_SWE-agent/pydicom__pydicom-1458.traj",
    ] {
        let Some((path, value)) = read_json(rel) else {
            continue;
        };
        let messages = value
            .get("history")
            .unwrap_or(&value)
            .as_array()
            .unwrap()
            .clone();
        let convs = import_file(&path, Format::Auto).unwrap();
        assert_eq!(convs.len(), 1, "{rel}");
        let (roles, calls) = openai_expectation(&messages);
        let c = counts(&convs);
        assert_eq!(c.roles, roles, "{rel}");
        assert_eq!(c.tool_calls, calls, "{rel}");
        assert_eq!(c.orphans, 0, "{rel}");
        for (raw, t) in messages.iter().zip(turns(&convs[0])) {
            assert_eq!(
                t.message.text_content(),
                raw["content"].as_str().unwrap(),
                "{rel}"
            );
            // SWE-agent's demonstration of another task is named so, and
            // nothing else is.
            assert_eq!(
                t.message.is_demonstration(),
                raw["is_demo"].as_bool() == Some(true),
                "{rel}"
            );
        }
    }
    if let Some((path, _)) = read_json("swe-agent_SWE-agent/pydicom__pydicom-1458.traj") {
        let convs = import_file(&path, Format::SweAgent).unwrap();
        let demos: Vec<usize> = turns(&convs[0])
            .enumerate()
            .filter(|(_, t)| t.message.is_demonstration())
            .map(|(i, _)| i)
            .collect();
        assert_eq!(demos, [1], "the pydicom run shows one demonstration");
    }
    // The function-calling replay reuses call ids; each answer still finds its call.
    if let Some(path) =
        data_path("swe-agent_SWE-agent/marshmallow-code__marshmallow-1867.function_calling.traj")
    {
        let convs = import_file(&path, Format::SweAgent).unwrap();
        let EventBody::ModelDeclared(m) = &convs[0].events[0].body else {
            panic!("no model declared")
        };
        assert_eq!(m.model, "gpt-4o");
        assert_eq!(
            counts(&convs).tool_calls,
            11,
            "the data README says 11 steps with tool_calls"
        );
    }
}

/// Thinking text of a Claude Code / pi source, to check none of it leaks.
fn thinking_texts(records: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for r in records {
        if let Some(blocks) = r["message"]["content"].as_array() {
            for b in blocks {
                if b["type"] == "thinking" {
                    if let Some(t) = b["thinking"].as_str().filter(|t| t.len() > 40) {
                        out.push(t.to_string());
                    }
                }
            }
        }
    }
    out
}

fn all_text(convs: &[ImportedConversation]) -> String {
    convs
        .iter()
        .flat_map(|c| turns(c).map(|t| t.message.searchable_text()))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn claude_code_maps_tool_use_and_tool_result_blocks() {
    for rel in [
        "claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl",
        "claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.subagents.agent-acompact-70d8e7.jsonl",
        "claude-code_marot-spotter/tool_heavy.jsonl",
        "claude-code_marot-spotter/short.jsonl",
    ] {
        let Some(path) = data_path(rel) else { continue };
        let records = jsonl(&path);
        let main_thread = records.iter().any(|r| r["isSidechain"] == false && r["message"].is_object());
        let spoken: Vec<&Value> = records
            .iter()
            .filter(|r| matches!(r["type"].as_str(), Some("user" | "assistant")))
            .filter(|r| r["isMeta"] != true)
            .filter(|r| !(main_thread && r["isSidechain"] == true))
            .collect();
        let blocks = |kind: &str| {
            spoken
                .iter()
                .filter_map(|r| r["message"]["content"].as_array())
                .flatten()
                .filter(|b| b["type"] == kind)
                .count()
        };
        let assistant_ids: HashSet<&str> = spoken
            .iter()
            .filter(|r| r["type"] == "assistant")
            .filter(|r| {
                r["message"]["content"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|b| b["type"] == "tool_use" || (b["type"] == "text" && b["text"].as_str().is_some_and(|t| !t.trim().is_empty()))))
            })
            .map(|r| r["message"]["id"].as_str().unwrap())
            .collect();

        let convs = import_file(&path, Format::Auto).unwrap();
        assert_eq!(convs.len(), 1, "{rel}");
        let c = counts(&convs);
        assert_eq!(c.tool_calls, blocks("tool_use"), "{rel}: every tool_use is a call");
        assert_eq!(c.roles.get("tool").copied().unwrap_or(0) + c.orphans, blocks("tool_result"), "{rel}");
        assert_eq!(c.roles.get("assistant").copied().unwrap_or(0), assistant_ids.len(), "{rel}: one message per message.id");
        assert_eq!(c.roles.get("system"), None, "{rel}");
        let text = all_text(&convs);
        for thought in thinking_texts(&records) {
            assert!(!text.contains(&thought), "{rel}: thinking leaked into content");
        }
        let said: HashSet<String> = convs.iter().flat_map(|c| turns(c).map(|t| t.message.text_content())).collect();
        for meta in records.iter().filter(|r| r["isMeta"] == true) {
            if let Some(content) = meta["message"]["content"].as_str() {
                assert!(!said.contains(content), "{rel}: a meta record became a turn");
            }
        }
    }
    if let Some(path) =
        data_path("claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl")
    {
        let c = counts(&import_file(&path, Format::Auto).unwrap());
        assert_eq!(c.tool_calls, 197, "the data README says 197 tool_use");
    }
}

#[test]
fn pi_maps_tool_calls_results_and_bash_executions() {
    let Some(path) = data_path("pi-openclaw_badlogic-pi-mono/before-compaction.jsonl") else {
        return;
    };
    let records = jsonl(&path);
    let messages: Vec<&Value> = records
        .iter()
        .filter(|r| r["type"] == "message")
        .map(|r| &r["message"])
        .collect();
    let count_role = |role: &str| messages.iter().filter(|m| m["role"] == role).count();
    let tool_call_blocks = messages
        .iter()
        .filter_map(|m| m["content"].as_array())
        .flatten()
        .filter(|b| b["type"] == "toolCall")
        .count();
    let errors = messages
        .iter()
        .filter(|m| m["stopReason"] == "error")
        .count();
    let empty_assistants = messages
        .iter()
        .filter(|m| m["role"] == "assistant")
        .filter(|m| {
            !m["content"].as_array().unwrap().iter().any(|b| {
                b["type"] == "toolCall"
                    || (b["type"] == "text"
                        && b["text"].as_str().is_some_and(|t| !t.trim().is_empty()))
            })
        })
        .count();

    let convs = import_file(&path, Format::Auto).unwrap();
    assert_eq!(convs.len(), 1);
    let c = counts(&convs);
    assert_eq!(tool_call_blocks, 454, "the data README says 454 toolCall");
    assert_eq!(c.tool_calls, tool_call_blocks);
    assert_eq!(c.roles["tool"] + c.orphans, count_role("toolResult"));
    assert_eq!(c.console, count_role("bashExecution"));
    assert_eq!(
        c.roles["user"],
        count_role("user") + count_role("bashExecution") + c.orphans
    );
    assert_eq!(
        c.roles["assistant"],
        count_role("assistant") - empty_assistants
    );
    assert_eq!(c.provider_errors, errors);
    let EventBody::ModelDeclared(m) = &convs[0].events[0].body else {
        panic!("no model declared first")
    };
    assert_eq!(m.model, records[0]["modelId"].as_str().unwrap());
    let text = all_text(&convs);
    for thought in thinking_texts(&records) {
        assert!(!text.contains(&thought), "thinking leaked into content");
    }
}

#[test]
fn openhands_maps_actions_and_observations() {
    for rel in [
        "openhands_All-Hands-AI/basic.json",
        "openhands_All-Hands-AI/basic_interactions.json",
    ] {
        let Some((path, events)) = read_json(rel) else {
            continue;
        };
        let events = events.as_array().unwrap();
        let messages = events.iter().filter(|e| e["action"] == "message").count();
        let responses: HashSet<&str> = events
            .iter()
            .filter(|e| e["action"].is_string())
            .filter_map(|e| e["tool_call_metadata"]["model_response"]["id"].as_str())
            .collect();
        let observed = events
            .iter()
            .filter(|e| {
                e["observation"].is_string() && e["tool_call_metadata"]["tool_call_id"].is_string()
            })
            .count();
        let convs = import_file(&path, Format::Auto).unwrap();
        let c = counts(&convs);
        assert_eq!(c.turns, messages + responses.len() + observed, "{rel}");
        assert_eq!(c.roles.get("tool").copied().unwrap_or(0), observed, "{rel}");
        assert!(
            c.models_declared >= 1,
            "{rel}: the model responses name the model"
        );
    }
}

#[test]
fn aider_gives_one_conversation_per_session_with_dialogue() {
    let Some(path) = data_path("aider_Aider-AI-aider/chat-history.md") else {
        return;
    };
    let text = std::fs::read_to_string(&path).unwrap();
    // Sessions split at headers; a session counts when a line is neither
    // blank, console (`>`), nor the mode line at the very top.
    let mut sessions = vec![Vec::new()];
    for (i, line) in text.lines().enumerate() {
        if line.starts_with("# aider chat started at") {
            sessions.push(Vec::new());
        } else if !(i == 0 && line.starts_with("-*-")) {
            sessions.last_mut().unwrap().push(line);
        }
    }
    let with_dialogue = sessions
        .iter()
        .filter(|s| {
            s.iter()
                .any(|l| !l.trim().is_empty() && !l.starts_with('>'))
        })
        .count();
    let user_turns: usize = sessions
        .iter()
        .map(|s| {
            s.iter()
                .zip(std::iter::once(&"").chain(s.iter()))
                .filter(|(line, prev)| line.starts_with("####") && !prev.starts_with("####"))
                .count()
        })
        .sum();

    let convs = import_file(&path, Format::Auto).unwrap();
    let c = counts(&convs);
    assert_eq!(
        sessions.len() - 1,
        1133,
        "the data README says 1133 sessions"
    );
    assert_eq!(c.conversations, with_dialogue);
    assert_eq!(c.roles["user"] - c.console, user_turns);
    assert_eq!(
        c.roles.get("tool"),
        None,
        "aider has no tool calls, so no tool messages"
    );
    assert_eq!(c.tool_calls, 0);
    assert!(convs
        .iter()
        .all(|conv| conv.conversation.starts_with("chat-history#")));
}

#[test]
fn broken_and_unknown_inputs_name_where_they_fail() {
    let truncated = b"[{\"role\":\"user\",\"content\":\"hi\"},\n {\"role\":";
    let err = import_bytes(truncated, Format::Auto, "bad.json").unwrap_err();
    let at = err
        .offset()
        .unwrap_or_else(|| panic!("no offset in `{err}`"));
    assert!(at + 1 >= truncated.len() && at <= truncated.len(), "{err}");
    assert_eq!(err.line(), Some(2), "{err}");
    enum Want {
        /// The reported byte is at (or just after) this text's first byte.
        Byte(&'static str),
        Line(usize),
        Says(&'static str),
    }
    let cases: [(&str, Format, Want); 8] = [
        (
            "{\"type\":\"session\",\"modelId\":\"m\"}\n{\"type\":\"message\",\"message\":{\"role\":\"user\",\"content\":\"a\"}}\n{\"type\":\"message\"",
            Format::Auto,
            Want::Line(3),
        ),
        ("{\"type\":\"progress\"}\nnot json\n", Format::ClaudeCode, Want::Line(2)),
        ("{\"type\":\"user\",\"message\":{\"content\":[{\"type\":7}]}}\n", Format::ClaudeCode, Want::Line(1)),
        ("[{\"id\":0,\"source\":\"user\",\"action\":\"message\",\"args\":[]}]", Format::Openhands, Want::Byte("[]}")),
        ("{\"history\":7,\"trajectory\":[]}", Format::SweAgent, Want::Byte("7,")),
        ("[{\"traj\":[{\"role\":\"user\",\"content\":\"a\"}]},\n{\"traj\":[{\"role\":\"wizard\"}]}]", Format::Auto, Want::Byte("{\"role\":\"wizard")),
        ("just some prose\n", Format::Auto, Want::Says("not a transcript format")),
        ("", Format::Auto, Want::Says("empty")),
    ];
    for (input, format, want) in cases {
        let err = import_bytes(input.as_bytes(), format, "bad.json").unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("bad.json"), "{text}");
        match want {
            Want::Byte(needle) => {
                let at = input.find(needle).unwrap();
                let got = err
                    .offset()
                    .unwrap_or_else(|| panic!("no byte offset in `{text}`"));
                assert!(
                    got == at || got == at + 1,
                    "{input}: `{text}` should point at byte {at}"
                );
                assert!(text.contains(&format!("byte {got}")), "{text}");
            }
            Want::Line(line) => {
                assert_eq!(err.line(), Some(line), "{input}: {text}");
                assert!(text.contains(&format!("line {line}")), "{text}");
            }
            Want::Says(words) => assert!(text.contains(words), "{input}: `{text}` lacks `{words}`"),
        }
    }
    // Right shape, nothing to publish.
    let err =
        import_bytes(b"{\"type\":\"progress\"}\n", Format::ClaudeCode, "p.jsonl").unwrap_err();
    assert!(matches!(err, ImportError::NoConversation { .. }), "{err}");
    let err = import_file(Path::new("/nonexistent/x.jsonl"), Format::Auto).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/x.jsonl"), "{err}");
}
