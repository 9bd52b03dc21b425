//! OpenHands event streams: a JSON array of events (trajectory replays), or
//! the evaluation output a benchmark run writes (`output.jsonl`: one JSON
//! object per instance with `instance_id`, `instruction`, `metadata`,
//! `history`, `metrics`, …; also read as one object or an array of them).
//! Each instance is one conversation, `<stem>#<instance_id>` (an id seen
//! twice gets `.<position>`), made of its `history` events; its model is the
//! one the model responses name, else `metadata.llm_config.model`. An
//! instance line that cannot be read, has no `history`, or gives no turn is
//! reported as skipped, as is a history event that cannot be read, and the
//! rest is imported. Histories of OpenHands SDK (V1) events (a `kind` per
//! event, no `action` / `observation`) are not read yet: such an instance is
//! reported with the kinds it holds.
//!
//! Events:
//!
//! - `action: "message"`: a `user` or `assistant` message (by `source`), text
//!   from `args.content` (else `message`), `args.image_urls` as image parts.
//! - `action: "system"`: the system prompt.
//! - An agent action with `tool_call_metadata.tool_call_id`: the assistant
//!   message that called the tool. When the metadata carries the raw model
//!   response, its first choice is the message (content, every tool call,
//!   model, usage), emitted once per response id even when the response made
//!   several calls (several actions). Without it, the call is rebuilt from
//!   `function_name` and the action's `args` (minus `thought`, which becomes
//!   the content).
//! - An observation with `tool_call_metadata.tool_call_id`: the `tool` message
//!   answering it, content from `content` (else `message`).
//! - Everything else (state changes, recalls, observations of commands the
//!   user ran) is not part of what the model was told and is skipped.

use super::draft::{self, content_from_parts, image_url, text_part, usage, Draft};
use super::openai::RawToolCall;
use super::timestamp::parse_iso8601;
use super::{ImportError, JsonShape, Source};
use crate::core::event::TurnAppended;
use crate::core::message::{ChatMessage, Content, ContentPart, FunctionCall, Role, ToolCall};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::collections::HashMap;

#[derive(Deserialize)]
struct Event<'a> {
    #[serde(default)]
    timestamp: Option<String>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    action: Option<String>,
    #[serde(default)]
    observation: Option<String>,
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    args: Option<Map<String, Value>>,
    #[serde(borrow, default)]
    tool_call_metadata: Option<ToolCallMetadata<'a>>,
}

#[derive(Deserialize)]
struct ToolCallMetadata<'a> {
    #[serde(default)]
    function_name: Option<String>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(borrow, default)]
    model_response: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ModelResponse {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<ResponseUsage>,
}

#[derive(Deserialize)]
struct Choice {
    message: ResponseMessage,
}

/// The response's message; its role is always the assistant.
#[derive(Deserialize)]
struct ResponseMessage {
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    tool_calls: Option<Vec<RawToolCall>>,
}

#[derive(Deserialize)]
struct ResponseUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    total_tokens: Option<u64>,
}

/// An evaluation output instance; the rest of its fields are not read.
#[derive(Deserialize)]
struct Instance<'a> {
    #[serde(default)]
    instance_id: Option<Value>,
    #[serde(borrow, default)]
    history: Option<&'a RawValue>,
    #[serde(default)]
    metadata: Option<Value>,
}

/// Top-level keys that tell an instance from an event.
#[derive(Deserialize)]
struct InstanceProbe {
    #[serde(default)]
    instance_id: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    history: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct KindProbe {
    #[serde(default)]
    kind: Option<String>,
}

fn is_instance(raw: &RawValue) -> bool {
    serde_json::from_str::<InstanceProbe>(raw.get())
        .map(|p| p.instance_id.is_some() && p.history.is_some())
        .unwrap_or(false)
}

pub(crate) fn parse(source: &Source<'_>) -> Result<Vec<Draft>, ImportError> {
    let raw = match source.json_shape()? {
        JsonShape::Document(raw) if raw.get().trim_start().starts_with('[') => raw,
        JsonShape::Document(raw) if is_instance(raw) => {
            let mut instances = Instances::default();
            return Ok(instances.read(source, 1, raw).into_iter().collect());
        }
        JsonShape::Document(raw) => {
            return Err(source.json_error_at(
                source.offset_of(raw),
                "expected a JSON array of OpenHands events, or an evaluation instance (an object with `instance_id` and `history`)",
            ))
        }
        JsonShape::Lines => return Ok(parse_instance_lines(source)),
    };
    let events: Vec<&RawValue> = source.parse_raw(raw)?;
    if events.first().is_some_and(|e| is_instance(e)) {
        let mut instances = Instances::default();
        let mut drafts = Vec::new();
        for raw in events {
            let line = line_of(source, raw);
            drafts.extend(instances.read(source, line, raw));
        }
        return Ok(drafts);
    }
    let mut d = Draft::new(None);
    push_events(source, &mut d, events, None)?;
    Ok(vec![d])
}

/// 1-based line where a value borrowed from the input starts.
fn line_of(source: &Source<'_>, raw: &RawValue) -> usize {
    let offset = source.offset_of(raw).min(source.bytes.len());
    source.bytes[..offset]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

fn parse_instance_lines(source: &Source<'_>) -> Vec<Draft> {
    let mut instances = Instances::default();
    let mut drafts = Vec::new();
    for (number, line) in source.lines() {
        let raw: &RawValue = match serde_json::from_slice(line) {
            Ok(raw) => raw,
            Err(e) => {
                source.skip(number, format!("not a JSON object: {e}"));
                continue;
            }
        };
        drafts.extend(instances.read(source, number, raw));
    }
    drafts
}

/// The instances read so far, to keep conversation ids apart.
#[derive(Default)]
struct Instances {
    seen: std::collections::HashSet<String>,
    position: usize,
}

impl Instances {
    /// One instance as a draft, or `None` (reported as skipped).
    fn read(&mut self, source: &Source<'_>, line: usize, raw: &RawValue) -> Option<Draft> {
        let position = self.position;
        self.position += 1;
        let instance: Instance<'_> = match serde_json::from_str(raw.get()) {
            Ok(i) => i,
            Err(e) => {
                source.skip(line, format!("not an OpenHands evaluation instance: {e}"));
                return None;
            }
        };
        let id = match &instance.instance_id {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => format!("instance-{position}"),
        };
        let Some(history) = instance.history else {
            source.skip(line, format!("instance `{id}` has no `history` of events"));
            return None;
        };
        let events: Vec<&RawValue> = match serde_json::from_str(history.get()) {
            Ok(events) => events,
            Err(e) => {
                source.skip(
                    line,
                    format!("instance `{id}`: `history` is not a list of events: {e}"),
                );
                return None;
            }
        };
        let count = events.len();
        // The OpenHands SDK (V1) writes events with a `kind` instead.
        let sdk_kinds: std::collections::BTreeSet<String> = events
            .iter()
            .filter_map(|e| serde_json::from_str::<KindProbe>(e.get()).ok()?.kind)
            .collect();
        let mut d = Draft::new(None);
        // Reporting mode never fails: every error becomes a skipped record.
        if push_events(source, &mut d, events, Some((line, &id))).is_err() {
            return None;
        }
        if !d
            .items
            .iter()
            .any(|i| matches!(i.kind, draft::ItemKind::Turn(_)))
        {
            let why = if sdk_kinds.is_empty() {
                String::new()
            } else {
                let kinds: Vec<String> = sdk_kinds.into_iter().collect();
                format!(
                    " (they are OpenHands SDK events, kinds {}, which this importer does not read yet)",
                    kinds.join(", ")
                )
            };
            source.skip(
                line,
                format!(
                    "instance `{id}`: none of its {count} history events is a message, action or observation this importer reads{why}"
                ),
            );
            return None;
        }
        let has_model = d.items.iter().any(|i| match &i.kind {
            draft::ItemKind::Turn(t) => t.model.is_some(),
            draft::ItemKind::Model(_) => true,
            draft::ItemKind::ProviderError { .. } => false,
        });
        if !has_model {
            d.model = instance
                .metadata
                .as_ref()
                .and_then(|m| m.get("llm_config"))
                .and_then(|c| c.get("model"))
                .and_then(Value::as_str)
                .filter(|m| !m.is_empty())
                .map(str::to_string);
        }
        d.key = Some(if self.seen.insert(id.clone()) {
            id
        } else {
            format!("{id}.{position}")
        });
        Some(d)
    }
}

/// The message of an error inside an instance, for a skipped-record reason.
fn detail(err: ImportError) -> String {
    match err {
        ImportError::Json { detail, offset, .. } => format!("{detail} (byte {offset})"),
        other => other.to_string(),
    }
}

/// Appends the turns of `events`. With `report` (the instance's line and
/// id), an event that cannot be read is reported as skipped and the rest
/// read; without, it is an error.
fn push_events(
    source: &Source<'_>,
    d: &mut Draft,
    events: Vec<&RawValue>,
    report: Option<(usize, &str)>,
) -> Result<(), ImportError> {
    let failed = |k: usize, e: ImportError| -> Result<(), ImportError> {
        match report {
            None => Err(e),
            Some((line, id)) => {
                source.skip(
                    line,
                    format!("instance `{id}`: history event {k} not read: {}", detail(e)),
                );
                Ok(())
            }
        }
    };
    // Response id -> index of the assistant turn made from it.
    let mut responses: HashMap<String, usize> = HashMap::new();
    for (k, raw_event) in events.into_iter().enumerate() {
        let event: Event<'_> = match source.parse_raw(raw_event) {
            Ok(e) => e,
            Err(e) => {
                failed(k, e)?;
                continue;
            }
        };
        let time = event.timestamp.as_deref().and_then(parse_iso8601);
        let call = event
            .tool_call_metadata
            .as_ref()
            .and_then(|m| m.tool_call_id.clone().map(|id| (id, m)));
        if event.observation.is_some() {
            let Some((call_id, meta)) = call else {
                continue;
            };
            let text = event.content.or(event.message).unwrap_or_default();
            let m = ChatMessage {
                role: Role::Tool,
                content: Some(Content::Text(text)),
                tool_calls: Vec::new(),
                tool_call_id: Some(call_id),
                name: meta.function_name.clone(),
            };
            d.push_turn(time, TurnAppended::from(m));
            continue;
        }
        let Some(action) = event.action.as_deref() else {
            continue;
        };
        let args = event.args.clone().unwrap_or_default();
        match (action, call) {
            ("message", None) => {
                let role = match event.source.as_deref() {
                    Some("user") => Role::User,
                    Some("agent") => Role::Assistant,
                    _ => continue,
                };
                let text = args
                    .get("content")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .or(event.message)
                    .unwrap_or_default();
                let mut parts: Vec<ContentPart> = Vec::new();
                if !text.is_empty() {
                    parts.push(text_part(text));
                }
                if let Some(Value::Array(urls)) = args.get("image_urls") {
                    parts.extend(urls.iter().filter_map(Value::as_str).map(image_url));
                }
                if let Some(content) = content_from_parts(parts) {
                    d.push_turn(
                        time,
                        TurnAppended::from(ChatMessage {
                            content: Some(content),
                            ..ChatMessage::text(role, "")
                        }),
                    );
                }
            }
            ("system", None) => {
                if let Some(text) = args.get("content").and_then(Value::as_str) {
                    d.push_turn(
                        time,
                        TurnAppended::from(ChatMessage::text(Role::System, text)),
                    );
                }
            }
            (_, Some((call_id, meta))) => {
                let fallback_call = || ToolCall {
                    id: call_id.clone(),
                    kind: "function".to_string(),
                    function: FunctionCall {
                        name: meta
                            .function_name
                            .clone()
                            .unwrap_or_else(|| action.to_string()),
                        arguments: Value::Object(
                            args.iter()
                                .filter(|(k, _)| k.as_str() != "thought")
                                .map(|(k, v)| (k.clone(), v.clone()))
                                .collect(),
                        )
                        .to_string(),
                    },
                };
                let response: Option<ModelResponse> = match meta.model_response {
                    Some(r) if r.get() != "null" => match source.parse_raw(r) {
                        Ok(r) => Some(r),
                        Err(e) => {
                            failed(k, e)?;
                            continue;
                        }
                    },
                    _ => None,
                };
                if let Some(index) = response
                    .as_ref()
                    .and_then(|r| r.id.as_ref())
                    .and_then(|id| responses.get(id))
                {
                    // A later call of a response already emitted.
                    if let Some(draft::Item {
                        kind: draft::ItemKind::Turn(t),
                        ..
                    }) = d.items.get_mut(*index)
                    {
                        if !t.message.tool_calls.iter().any(|c| c.id == call_id) {
                            t.message.tool_calls.push(fallback_call());
                        }
                    }
                    continue;
                }
                let mut turn = match response {
                    Some(response) => {
                        let message = response.choices.into_iter().next().map(|c| c.message);
                        let (content, calls) = match message {
                            Some(m) => (
                                m.content
                                    .filter(|c| !matches!(c, Content::Text(t) if t.is_empty())),
                                m.tool_calls
                                    .unwrap_or_default()
                                    .into_iter()
                                    .map(RawToolCall::into_tool_call)
                                    .collect(),
                            ),
                            None => (None, Vec::new()),
                        };
                        let mut turn = TurnAppended::from(ChatMessage {
                            role: Role::Assistant,
                            content,
                            tool_calls: calls,
                            tool_call_id: None,
                            name: None,
                        });
                        turn.model = response.model.filter(|m| !m.is_empty());
                        turn.usage = response.usage.and_then(|u| {
                            usage(u.prompt_tokens, u.completion_tokens, u.total_tokens)
                        });
                        if let Some(id) = response.id {
                            responses.insert(id, d.items.len());
                        }
                        turn
                    }
                    None => {
                        let thought = args
                            .get("thought")
                            .and_then(Value::as_str)
                            .filter(|t| !t.is_empty())
                            .map(|t| Content::Text(t.to_string()));
                        TurnAppended::from(ChatMessage {
                            role: Role::Assistant,
                            content: thought,
                            tool_calls: Vec::new(),
                            tool_call_id: None,
                            name: None,
                        })
                    }
                };
                if !turn.message.tool_calls.iter().any(|c| c.id == call_id) {
                    turn.message.tool_calls.push(fallback_call());
                }
                d.push_turn(time, turn);
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::core::event::EventBody;
    use crate::core::message::Role;
    use crate::import::{import_bytes, Format};

    #[test]
    fn one_response_with_two_calls_gives_one_assistant_message() {
        let resp = r#"{"id":"r1","model":"gpt-4o","choices":[{"message":{"role":"assistant","content":"doing","tool_calls":[
            {"id":"a","type":"function","function":{"name":"bash","arguments":"{\"c\":1}"}},
            {"id":"b","type":"function","function":{"name":"bash","arguments":"{\"c\":2}"}}]}}],
            "usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}"#;
        let text = format!(
            r#"[{{"id":0,"timestamp":"2025-01-27T22:44:56.900854","source":"user","action":"message","args":{{"content":"go"}}}},
            {{"id":1,"source":"agent","action":"run","args":{{"command":"x"}},"tool_call_metadata":{{"function_name":"bash","tool_call_id":"a","model_response":{resp}}}}},
            {{"id":2,"source":"agent","action":"run","args":{{"command":"y"}},"tool_call_metadata":{{"function_name":"bash","tool_call_id":"b","model_response":{resp}}}}},
            {{"id":3,"source":"agent","observation":"run","content":"out a","tool_call_metadata":{{"function_name":"bash","tool_call_id":"a"}}}},
            {{"id":4,"source":"agent","observation":"run","content":"out b","tool_call_metadata":{{"function_name":"bash","tool_call_id":"b"}}}},
            {{"id":5,"source":"environment","observation":"agent_state_changed","content":""}}]"#
        );
        let conv = &import_bytes(text.as_bytes(), Format::Openhands, "o.json").unwrap()[0];
        let turns: Vec<_> = conv
            .events
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::TurnAppended(t) => Some(t),
                _ => None,
            })
            .collect();
        let roles: Vec<Role> = turns.iter().map(|t| t.message.role).collect();
        assert_eq!(roles, [Role::User, Role::Assistant, Role::Tool, Role::Tool]);
        assert_eq!(turns[1].message.tool_calls.len(), 2);
        assert_eq!(turns[1].model.as_deref(), Some("gpt-4o"));
        assert_eq!(turns[1].usage.unwrap().total_tokens, Some(12));
        assert_eq!(turns[3].message.text_content(), "out b");
        assert_eq!(conv.events[0].type_name(), "model_declared");
    }

    #[test]
    fn actions_without_a_response_rebuild_the_call() {
        let text = r#"[{"source":"user","action":"message","args":{"content":"go"}},
            {"source":"agent","action":"run","args":{"command":"ls","thought":"look"},"tool_call_metadata":{"function_name":"execute_bash","tool_call_id":"c"}}]"#;
        let conv = &import_bytes(text.as_bytes(), Format::Openhands, "o.json").unwrap()[0];
        let EventBody::TurnAppended(t) = &conv.events[1].body else {
            panic!()
        };
        assert_eq!(t.message.text_content(), "look");
        assert_eq!(t.message.tool_calls[0].function.name, "execute_bash");
        assert_eq!(
            t.message.tool_calls[0].function.arguments,
            r#"{"command":"ls"}"#
        );
    }
}
