//! Codex CLI session rollouts (`~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl`).
//!
//! Every line is `{"timestamp", "type", "payload"}`; one file is one
//! conversation. What the model was told or said is in `response_item`
//! records; `event_msg` records mostly repeat it for the UI.
//!
//! - `session_meta`: the session's base instructions (`base_instructions.text`
//!   or `instructions`), when present, become the system message.
//! - `turn_context`: declares the model (`payload.model`) where it changes.
//! - `response_item` `message`: a `user`, `assistant` or `developer` /
//!   `system` (system) message; `input_text` / `output_text` parts are text,
//!   `input_image` parts images.
//! - `response_item` `function_call`, `custom_tool_call` (apply_patch and
//!   other free-form tools: arguments `{"input": …}`) and `local_shell_call`
//!   (arguments: the `action`): tool calls. Calls written one after another,
//!   and after the assistant text of the same response, are one assistant
//!   message, as the model sent them.
//! - `response_item` `function_call_output`, `custom_tool_call_output`,
//!   `local_shell_call_output`: the `tool` message answering `call_id`.
//!   Codex writes some messages (developer notes about approvals, a user's
//!   message sent while a command runs) between a call and its output; they
//!   are moved after the outputs of the open calls, since a chat provider
//!   wants the results right after the calls.
//! - `response_item` `reasoning` (thinking, often encrypted), `web_search_call`
//!   and `ghost_snapshot` are not content: dropped.
//! - `event_msg` `token_count`: `last_token_usage` is the usage of the last
//!   assistant message before it that has none; `event_msg` `error`: a
//!   provider error. Other `event_msg` payloads repeat `response_item`s or
//!   describe the UI: skipped.
//! - `compacted`: Codex's own summary after it compacted, a user turn marked
//!   `compact_summary` in metadata.
//!
//! Older rollouts (before the `payload` envelope) are read too: a first line
//! with the session `id` and `timestamp`, `{"record_type":"state"}` markers,
//! and bare response items one per line.
//!
//! A line that is not JSON, or a record or payload type this importer does
//! not know, is reported as skipped (line and reason) and the rest is read.

use super::draft::{self, content_from_parts, image_url, text_part, usage, Draft, ItemKind};
use super::timestamp::parse_iso8601;
use super::{ImportError, Source};
use crate::core::event::TurnAppended;
use crate::core::message::{ChatMessage, Content, ContentPart, FunctionCall, Role, ToolCall};
use serde_json::{Map, Value};
use std::collections::HashSet;

/// Payload types of `response_item` records, which older rollouts wrote
/// bare, one per line.
const ITEM_TYPES: [&str; 10] = [
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "local_shell_call",
    "local_shell_call_output",
    "reasoning",
    "web_search_call",
    "ghost_snapshot",
];

/// One line as `(type, time, payload)`: `{"timestamp","type","payload"}`,
/// or the older layout (before the `payload` envelope): a first line with
/// the session's `id` and `timestamp`, `{"record_type":"state"}` markers
/// (`None`: nothing to read), and bare response items.
fn record(
    mut object: Map<String, Value>,
    first: bool,
) -> Result<Option<(String, Option<u64>, Value)>, String> {
    let time = object
        .get("timestamp")
        .and_then(Value::as_str)
        .and_then(parse_iso8601);
    let kind = object
        .get("type")
        .and_then(Value::as_str)
        .map(str::to_string);
    if let Some(payload) = object.remove("payload") {
        return match kind {
            Some(kind) => Ok(Some((kind, time, payload))),
            None => Err("record with a `payload` but no `type`".to_string()),
        };
    }
    if object.contains_key("record_type") {
        return Ok(None);
    }
    match kind {
        Some(kind) if ITEM_TYPES.contains(&kind.as_str()) => Ok(Some((
            "response_item".to_string(),
            time,
            Value::Object(object),
        ))),
        None if first && object.contains_key("id") => Ok(Some((
            "session_meta".to_string(),
            time,
            Value::Object(object),
        ))),
        Some(kind) => Err(format!("unknown Codex record type `{kind}`")),
        None => Err("record without a `type`".to_string()),
    }
}

/// Calls waiting for their output, and the messages held back until then.
#[derive(Default)]
struct Pending {
    calls: HashSet<String>,
    held: Vec<(Option<u64>, TurnAppended)>,
}

impl Pending {
    /// Writes the held messages and forgets the open calls.
    fn flush(&mut self, d: &mut Draft) {
        self.calls.clear();
        for (time, turn) in self.held.drain(..) {
            d.push_turn(time, turn);
        }
    }
}

pub(crate) fn parse(source: &Source<'_>) -> Result<Vec<Draft>, ImportError> {
    let mut d = Draft::new(None);
    let mut pending = Pending::default();
    let mut model: Option<String> = None;
    let mut records = 0usize;
    for (number, line) in source.lines() {
        let object: Map<String, Value> = match serde_json::from_slice(line) {
            Ok(r) => r,
            Err(e) => {
                source.skip(number, format!("not a Codex rollout record: {e}"));
                continue;
            }
        };
        records += 1;
        let (kind, time, payload) = match record(object, records == 1) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(reason) => {
                source.skip(number, reason);
                continue;
            }
        };
        let payload = match payload {
            Value::Object(map) => map,
            other => {
                source.skip(
                    number,
                    format!(
                        "`{kind}` record whose payload is {} rather than an object",
                        json_kind(&other)
                    ),
                );
                continue;
            }
        };
        match kind.as_str() {
            "session_meta" => {
                pending.flush(&mut d);
                if d.start_time.is_none() {
                    d.start_time = time;
                }
                let instructions = payload
                    .get("base_instructions")
                    .and_then(|b| b.get("text"))
                    .or_else(|| payload.get("instructions"))
                    .and_then(Value::as_str)
                    .filter(|t| !t.trim().is_empty());
                if let Some(text) = instructions {
                    d.push_turn(
                        time,
                        TurnAppended::from(ChatMessage::text(Role::System, text)),
                    );
                }
            }
            "turn_context" => {
                if let Some(m) = payload.get("model").and_then(Value::as_str) {
                    if model.as_deref() != Some(m) {
                        d.push_model(time, m);
                        model = Some(m.to_string());
                    }
                }
            }
            "response_item" => {
                if let Err(reason) = response_item(&mut d, &mut pending, time, &payload) {
                    source.skip(number, reason);
                }
            }
            "event_msg" => event_msg(&mut d, time, &payload, model.as_deref()),
            "compacted" => match payload.get("message").and_then(Value::as_str) {
                Some(text) if !text.trim().is_empty() => {
                    pending.flush(&mut d);
                    let mut turn = TurnAppended::from(ChatMessage::text(Role::User, text));
                    draft::set_metadata(&mut turn, "compact_summary", Value::Bool(true));
                    d.push_turn(time, turn);
                }
                _ => source.skip(number, "`compacted` record without a `message` summary"),
            },
            other => source.skip(number, format!("unknown Codex record type `{other}`")),
        }
    }
    pending.flush(&mut d);
    if records == 0 {
        return Err(source.line_error(
            source.lines().next().map_or(1, |(n, _)| n),
            "no Codex rollout record in the file (every line failed to parse)",
        ));
    }
    Ok(vec![d])
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn str_field<'a>(payload: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    payload.get(key).and_then(Value::as_str)
}

/// One `response_item`; `Err` says why it was not understood.
fn response_item(
    d: &mut Draft,
    pending: &mut Pending,
    time: Option<u64>,
    payload: &Map<String, Value>,
) -> Result<(), String> {
    let kind = str_field(payload, "type").unwrap_or_default();
    match kind {
        "message" => {
            let role = match str_field(payload, "role") {
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                Some("developer" | "system") => Role::System,
                Some(other) => return Err(format!("message with unknown role `{other}`")),
                None => return Err("message without a `role`".to_string()),
            };
            let content = message_content(payload.get("content"))?;
            if let Some(content) = content {
                let turn = TurnAppended::from(ChatMessage {
                    content: Some(content),
                    ..ChatMessage::text(role, "")
                });
                if role != Role::Assistant && !pending.calls.is_empty() {
                    pending.held.push((time, turn));
                } else {
                    // A new assistant message: the calls before it are over.
                    pending.flush(d);
                    d.push_turn(time, turn);
                }
            }
            Ok(())
        }
        "function_call" | "custom_tool_call" | "local_shell_call" => {
            let call_id = str_field(payload, "call_id")
                .or_else(|| str_field(payload, "id"))
                .ok_or_else(|| format!("`{kind}` without a `call_id`"))?;
            let (name, arguments) = match kind {
                "function_call" => (
                    str_field(payload, "name").unwrap_or("function").to_string(),
                    match payload.get("arguments") {
                        Some(Value::String(s)) => s.clone(),
                        Some(other) => other.to_string(),
                        None => "{}".to_string(),
                    },
                ),
                "custom_tool_call" => (
                    str_field(payload, "name").unwrap_or("custom_tool").to_string(),
                    serde_json::json!({ "input": payload.get("input").cloned().unwrap_or(Value::Null) })
                        .to_string(),
                ),
                _ => (
                    "local_shell".to_string(),
                    payload
                        .get("action")
                        .cloned()
                        .unwrap_or(Value::Object(Map::new()))
                        .to_string(),
                ),
            };
            pending.calls.insert(call_id.to_string());
            push_call(
                d,
                time,
                ToolCall {
                    id: call_id.to_string(),
                    kind: "function".to_string(),
                    function: FunctionCall { name, arguments },
                },
            );
            Ok(())
        }
        "function_call_output" | "custom_tool_call_output" | "local_shell_call_output" => {
            let call_id = str_field(payload, "call_id")
                .ok_or_else(|| format!("`{kind}` without a `call_id`"))?;
            let text = match payload.get("output") {
                Some(Value::String(s)) => s.clone(),
                // Newer rollouts may write structured output.
                Some(Value::Object(o)) => match o.get("content").and_then(Value::as_str) {
                    Some(s) => s.to_string(),
                    None => Value::Object(o.clone()).to_string(),
                },
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            d.push_turn(
                time,
                TurnAppended::from(ChatMessage {
                    role: Role::Tool,
                    content: Some(Content::Text(text)),
                    tool_calls: Vec::new(),
                    tool_call_id: Some(call_id.to_string()),
                    name: None,
                }),
            );
            pending.calls.remove(call_id);
            if pending.calls.is_empty() {
                pending.flush(d);
            }
            Ok(())
        }
        // Thinking, a search the provider ran itself, an undo snapshot: not
        // content the model is sent back.
        "reasoning" | "web_search_call" | "ghost_snapshot" => Ok(()),
        "" => Err("response_item without a payload `type`".to_string()),
        other => Err(format!("unknown response_item type `{other}`")),
    }
}

/// Text and image parts of a message; `Err` for content of an unknown shape.
fn message_content(content: Option<&Value>) -> Result<Option<Content>, String> {
    let parts = match content {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => return Ok((!s.is_empty()).then(|| Content::Text(s.clone()))),
        Some(Value::Array(parts)) => parts,
        Some(other) => {
            return Err(format!(
                "message whose content is {} rather than a list of parts",
                json_kind(other)
            ))
        }
    };
    let mut out: Vec<ContentPart> = Vec::new();
    for part in parts {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "input_text" | "output_text" | "text" => {
                if let Some(t) = part.get("text").and_then(Value::as_str) {
                    if !t.is_empty() {
                        out.push(text_part(t));
                    }
                }
            }
            "input_image" => {
                let url = part
                    .get("image_url")
                    .and_then(|u| u.as_str().or_else(|| u.get("url").and_then(Value::as_str)));
                if let Some(url) = url {
                    out.push(image_url(url));
                }
            }
            "refusal" => {
                if let Some(t) = part.get("refusal").and_then(Value::as_str) {
                    out.push(text_part(t));
                }
            }
            other => {
                return Err(format!(
                    "message with a content part of unknown type `{other}`"
                ))
            }
        }
    }
    // Parts of one message are one text when they are all text.
    if out.len() > 1 && out.iter().all(|p| p.kind == "text" && p.other.is_empty()) {
        let text: Vec<String> = out.into_iter().filter_map(|p| p.text).collect();
        return Ok(Some(Content::Text(text.join("\n"))));
    }
    Ok(content_from_parts(out))
}

/// Adds a call to the assistant message right before it, or opens one.
fn push_call(d: &mut Draft, time: Option<u64>, call: ToolCall) {
    if let Some(draft::Item {
        kind: ItemKind::Turn(t),
        ..
    }) = d.items.last_mut()
    {
        if t.message.role == Role::Assistant {
            t.message.tool_calls.push(call);
            return;
        }
    }
    d.push_turn(
        time,
        TurnAppended::from(ChatMessage {
            role: Role::Assistant,
            content: None,
            tool_calls: vec![call],
            tool_call_id: None,
            name: None,
        }),
    );
}

fn event_msg(d: &mut Draft, time: Option<u64>, payload: &Map<String, Value>, model: Option<&str>) {
    match str_field(payload, "type") {
        Some("token_count") => {
            let Some(last) = payload.get("info").and_then(|i| i.get("last_token_usage")) else {
                return;
            };
            let n = |k: &str| last.get(k).and_then(Value::as_u64);
            let Some(u) = usage(n("input_tokens"), n("output_tokens"), n("total_tokens")) else {
                return;
            };
            // The usage of the response that just ended: its last message.
            for item in d.items.iter_mut().rev() {
                if let ItemKind::Turn(t) = &mut item.kind {
                    match t.message.role {
                        Role::Assistant if t.usage.is_none() => {
                            t.usage = Some(u);
                            return;
                        }
                        Role::Assistant => return,
                        _ => {}
                    }
                }
            }
        }
        Some("error") => {
            if let Some(message) = str_field(payload, "message").filter(|m| !m.is_empty()) {
                d.push_provider_error(time, message.to_string(), model.map(str::to_string));
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use crate::core::event::EventBody;
    use crate::core::message::Role;
    use crate::import::{import_bytes_reporting, Format};

    const ROLLOUT: &str = r#"{"timestamp":"2026-03-01T10:00:00.000Z","type":"session_meta","payload":{"id":"s1","cwd":"/w","cli_version":"0.111.0"}}
{"timestamp":"2026-03-01T10:00:01.000Z","type":"turn_context","payload":{"cwd":"/w","model":"gpt-5.3-codex"}}
{"timestamp":"2026-03-01T10:00:02.000Z","type":"response_item","payload":{"type":"message","role":"developer","content":[{"type":"input_text","text":"rules"}]}}
{"timestamp":"2026-03-01T10:00:03.000Z","type":"response_item","payload":{"type":"message","role":"user","content":[{"type":"input_text","text":"Fix main.go"}]}}
{"timestamp":"2026-03-01T10:00:03.100Z","type":"event_msg","payload":{"type":"user_message","message":"Fix main.go"}}
{"timestamp":"2026-03-01T10:00:04.000Z","type":"response_item","payload":{"type":"reasoning","summary":[],"content":null,"encrypted_content":"gAAAA"}}
{"timestamp":"2026-03-01T10:00:05.000Z","type":"response_item","payload":{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Looking."}]}}
{"timestamp":"2026-03-01T10:00:05.000Z","type":"response_item","payload":{"type":"function_call","name":"exec_command","arguments":"{\"cmd\":\"cat main.go\"}","call_id":"call_a"}}
{"timestamp":"2026-03-01T10:00:05.000Z","type":"response_item","payload":{"type":"custom_tool_call","status":"completed","call_id":"call_b","name":"apply_patch","input":"*** Begin Patch\n*** End Patch"}}
{"timestamp":"2026-03-01T10:00:05.100Z","type":"event_msg","payload":{"type":"token_count","info":{"last_token_usage":{"input_tokens":100,"output_tokens":7,"total_tokens":107}}}}
{"timestamp":"2026-03-01T10:00:06.000Z","type":"response_item","payload":{"type":"function_call_output","call_id":"call_a","output":"package main"}}
{"timestamp":"2026-03-01T10:00:06.000Z","type":"response_item","payload":{"type":"custom_tool_call_output","call_id":"call_b","output":"Success"}}
{"timestamp":"2026-03-01T10:00:07.000Z","type":"response_item","payload":{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Done."}]}}
"#;

    #[test]
    fn calls_of_one_response_are_one_message_and_results_follow() {
        let imported =
            import_bytes_reporting(ROLLOUT.as_bytes(), Format::Codex, "r.jsonl").unwrap();
        assert!(imported.skipped.is_empty(), "{:?}", imported.skipped);
        let conv = &imported.conversations[0];
        assert_eq!(conv.conversation, "r");
        let turns: Vec<_> = conv
            .events
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::TurnAppended(t) => Some(t),
                _ => None,
            })
            .collect();
        let roles: Vec<Role> = turns.iter().map(|t| t.message.role).collect();
        assert_eq!(
            roles,
            [
                Role::System,
                Role::User,
                Role::Assistant,
                Role::Tool,
                Role::Tool,
                Role::Assistant
            ]
        );
        let calls = &turns[2].message.tool_calls;
        assert_eq!(calls.len(), 2);
        assert_eq!(turns[2].message.text_content(), "Looking.");
        assert_eq!(calls[1].function.name, "apply_patch");
        assert_eq!(
            calls[1].function.arguments,
            r#"{"input":"*** Begin Patch\n*** End Patch"}"#
        );
        assert_eq!(turns[2].usage.unwrap().total_tokens, Some(107));
        assert_eq!(turns[3].message.tool_call_id.as_deref(), Some("call_a"));
        assert_eq!(turns[4].message.text_content(), "Success");
        assert_eq!(conv.events[0].type_name(), "model_declared");
    }

    #[test]
    fn a_message_between_a_call_and_its_output_follows_the_output() {
        // Codex writes approval notes (developer) and messages the user sent
        // while a command ran between the call and its output.
        let text = r#"{"type":"response_item","payload":{"type":"message","role":"user","content":[{"type":"input_text","text":"go"}]}}
{"type":"response_item","payload":{"type":"function_call","name":"exec_command","arguments":"{}","call_id":"c1"}}
{"type":"response_item","payload":{"type":"function_call","name":"exec_command","arguments":"{}","call_id":"c2"}}
{"type":"response_item","payload":{"type":"message","role":"developer","content":[{"type":"input_text","text":"approved"}]}}
{"type":"response_item","payload":{"type":"function_call_output","call_id":"c1","output":"one"}}
{"type":"response_item","payload":{"type":"message","role":"user","content":[{"type":"input_text","text":"also this"}]}}
{"type":"response_item","payload":{"type":"function_call_output","call_id":"c2","output":"two"}}
{"type":"response_item","payload":{"type":"message","role":"assistant","content":[{"type":"output_text","text":"ok"}]}}
"#;
        let conv = &import_bytes_reporting(text.as_bytes(), Format::Codex, "r.jsonl")
            .unwrap()
            .conversations[0];
        let seq: Vec<(Role, String)> = conv
            .events
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::TurnAppended(t) => Some((t.message.role, t.message.text_content())),
                _ => None,
            })
            .collect();
        let want = [
            (Role::User, "go"),
            (Role::Assistant, ""),
            (Role::Tool, "one"),
            (Role::Tool, "two"),
            (Role::System, "approved"),
            (Role::User, "also this"),
            (Role::Assistant, "ok"),
        ];
        let want: Vec<(Role, String)> = want.iter().map(|(r, t)| (*r, t.to_string())).collect();
        assert_eq!(seq, want);
    }

    #[test]
    fn older_rollouts_without_the_payload_envelope_are_read() {
        let text = r#"{"id":"02f3baa6","timestamp":"2025-09-11T16:38:04.973Z","instructions":null,"git":{"branch":"main"}}
{"record_type":"state"}
{"type":"message","role":"user","content":[{"type":"input_text","text":"Change main.py"}]}
{"record_type":"state"}
{"type":"reasoning","id":"rs_1","summary":[]}
{"type":"message","role":"assistant","content":[{"type":"output_text","text":"On it."}]}
{"type":"function_call","name":"shell","arguments":"{\"command\":[\"cat\",\"main.py\"]}","call_id":"call_abc"}
{"type":"function_call_output","call_id":"call_abc","output":"{\"output\":\"import torch\",\"metadata\":{\"exit_code\":0}}"}
{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Done."}]}
"#;
        assert_eq!(
            crate::import::detect_format(text.as_bytes()).unwrap(),
            Format::Codex
        );
        let imported = import_bytes_reporting(text.as_bytes(), Format::Auto, "old.jsonl").unwrap();
        assert!(imported.skipped.is_empty(), "{:?}", imported.skipped);
        let conv = &imported.conversations[0];
        let roles: Vec<Role> = conv
            .events
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::TurnAppended(t) => Some(t.message.role),
                _ => None,
            })
            .collect();
        assert_eq!(
            roles,
            [Role::User, Role::Assistant, Role::Tool, Role::Assistant]
        );
        // Times start at the session's.
        assert_eq!(conv.events[0].time, 1_757_608_684_973);
    }

    #[test]
    fn unknown_and_broken_records_are_reported_and_the_rest_read() {
        let text = format!(
            "{ROLLOUT}{{\"type\":\"response_item\",\"payload\":{{\"type\":\"hologram\"}}}}\nnot json at all\n{{\"type\":\"telepathy\",\"payload\":{{}}}}\n{{\"type\":\"response_item\",\"payload\":{{\"type\":\"message\",\"role\":\"user\",\"content\":[{{\"type\":\"input_text\",\"text\":\"more\"}}]}}}}\n"
        );
        let imported = import_bytes_reporting(text.as_bytes(), Format::Auto, "r.jsonl").unwrap();
        assert_eq!(imported.conversations[0].format, Format::Codex);
        let lines: Vec<usize> = imported.skipped.iter().map(|s| s.line).collect();
        assert_eq!(lines, [14, 15, 16], "{:?}", imported.skipped);
        assert!(imported.skipped[0].reason.contains("hologram"));
        assert!(imported.skipped[2].reason.contains("telepathy"));
        let last = imported.conversations[0].events.last().unwrap();
        let EventBody::TurnAppended(t) = &last.body else {
            panic!("{last:?}")
        };
        assert_eq!(t.message.text_content(), "more");
    }
}
