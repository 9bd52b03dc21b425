//! OpenAI chat transcripts (`openai`) and SWE-agent trajectories (`swe-agent`).
//!
//! `openai` reads a JSON array of chat messages (mini-swe-agent), an object
//! holding `messages` / `traj` / `history`, an array of such objects (tau-bench:
//! one conversation per run), or JSON Lines of messages or of such objects.
//! An object's `model` (a string) is declared for its conversation.
//!
//! `swe-agent` reads a `.traj` object: `history` holds OpenAI-style messages,
//! tool messages name their calls in `tool_call_ids` (a list) and the model is
//! `replay_config.agent.model.name` (`replay_config` is an object or a JSON
//! string). ReAct-style trajectories without tool calls read the same way.
//! A message marked `is_demo` (the demonstration of another task SWE-agent
//! shows the agent) is named [`DEMONSTRATION_NAME`], so summaries know it is
//! not the task.
//!
//! Roles: `developer` reads as `system`; legacy `function` messages answer the
//! assistant's `function_call` (given a call id `function_call_<n>`).

use super::blocks::arguments_string;
use super::draft::Draft;
use super::ImportError;
use super::{JsonShape, Source};
use crate::core::event::TurnAppended;
use crate::core::message::{
    ChatMessage, Content, FunctionCall, Role, ToolCall, DEMONSTRATION_NAME,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

/// One chat message as sources write it (more lenient than [`ChatMessage`]).
#[derive(Debug, Deserialize)]
pub(crate) struct RawMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Option<Vec<RawToolCall>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// SWE-agent names the answered calls in a list.
    #[serde(default)]
    pub tool_call_ids: Option<Vec<String>>,
    #[serde(default)]
    pub name: Option<String>,
    /// Legacy single function call.
    #[serde(default)]
    pub function_call: Option<RawFunction>,
    /// SWE-agent marks the demonstration of another task it shows the agent.
    #[serde(default)]
    pub is_demo: bool,
}

#[derive(Debug, Deserialize)]
pub(crate) struct RawToolCall {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    pub function: RawFunction,
}

#[derive(Debug, Deserialize)]
pub(crate) struct RawFunction {
    #[serde(default)]
    pub name: String,
    /// A JSON string per the API; some sources write an object.
    #[serde(default)]
    pub arguments: Option<Value>,
}

impl RawToolCall {
    pub fn into_tool_call(self) -> ToolCall {
        ToolCall {
            id: self.id.unwrap_or_default(),
            kind: self.kind.unwrap_or_else(|| "function".to_string()),
            function: FunctionCall {
                name: self.function.name,
                arguments: arguments_string(self.function.arguments.as_ref()),
            },
        }
    }
}

/// Turns raw messages into chat messages, remembering legacy function calls.
#[derive(Default)]
pub(crate) struct Converter {
    function_calls: usize,
    open_function_call: Option<String>,
}

impl Converter {
    /// One raw message gives one chat message, or one per id for a tool
    /// message answering several calls. `Err` holds why the role is unknown.
    pub fn convert(&mut self, raw: RawMessage) -> Result<Vec<ChatMessage>, String> {
        let role = match raw.role.as_str() {
            "system" | "developer" => Role::System,
            "user" | "human" => Role::User,
            "assistant" | "ai" => Role::Assistant,
            "tool" | "function" => Role::Tool,
            other => {
                return Err(format!(
                    "unknown role `{other}` (expected system, developer, user, assistant, tool or function)"
                ))
            }
        };
        let mut message = ChatMessage {
            role,
            content: raw.content,
            tool_calls: raw
                .tool_calls
                .unwrap_or_default()
                .into_iter()
                .map(RawToolCall::into_tool_call)
                .collect(),
            tool_call_id: raw.tool_call_id,
            // A demonstration is named so: summaries must not report it as
            // the conversation's task (see `DEMONSTRATION_NAME`).
            name: match raw.name {
                None if raw.is_demo => Some(DEMONSTRATION_NAME.to_string()),
                name => name,
            },
        };
        if role == Role::Assistant {
            self.open_function_call = None;
            if let Some(function) = raw.function_call {
                self.function_calls += 1;
                let id = format!("function_call_{}", self.function_calls);
                message.tool_calls.push(ToolCall {
                    id: id.clone(),
                    kind: "function".to_string(),
                    function: FunctionCall {
                        name: function.name,
                        arguments: arguments_string(function.arguments.as_ref()),
                    },
                });
                self.open_function_call = Some(id);
            }
        }
        if role != Role::Tool {
            return Ok(vec![message]);
        }
        if message.content.is_none() {
            // Providers require a tool message to carry content.
            message.content = Some(Content::Text(String::new()));
        }
        if message.tool_call_id.is_none() && raw.role == "function" {
            message.tool_call_id = self.open_function_call.take();
        }
        match raw.tool_call_ids {
            Some(ids) if message.tool_call_id.is_none() && !ids.is_empty() => Ok(ids
                .into_iter()
                .map(|id| ChatMessage {
                    tool_call_id: Some(id),
                    ..message.clone()
                })
                .collect()),
            _ => Ok(vec![message]),
        }
    }
}

/// Holds a conversation: tau-bench runs, `{"messages": [...]}`, `.traj`.
#[derive(Deserialize)]
struct Holder<'a> {
    #[serde(borrow, default)]
    messages: Option<Vec<&'a RawValue>>,
    #[serde(borrow, default)]
    traj: Option<Vec<&'a RawValue>>,
    #[serde(borrow, default)]
    history: Option<Vec<&'a RawValue>>,
    #[serde(default)]
    model: Option<Value>,
    #[serde(borrow, default)]
    replay_config: Option<&'a RawValue>,
}

impl<'a> Holder<'a> {
    fn take_messages(&mut self) -> Option<Vec<&'a RawValue>> {
        self.messages
            .take()
            .or_else(|| self.traj.take())
            .or_else(|| self.history.take())
    }
}

pub(crate) fn parse(source: &Source<'_>) -> Result<Vec<Draft>, ImportError> {
    match source.json_shape()? {
        JsonShape::Document(raw) => parse_document(source, raw),
        JsonShape::Lines => parse_lines(source),
    }
}

fn parse_document<'a>(source: &Source<'a>, raw: &'a RawValue) -> Result<Vec<Draft>, ImportError> {
    let text = raw.get().trim_start();
    if text.starts_with('{') {
        if is_message(raw) {
            let mut d = Draft::new(None);
            add_messages(source, &mut d, &[raw], &mut Converter::default())?;
            return Ok(vec![d]);
        }
        return Ok(vec![holder_draft(source, raw, None)?]);
    }
    if !text.starts_with('[') {
        return Err(source.json_error_at(
            source.offset_of(raw),
            "expected an array of chat messages or of objects holding `messages`, `traj` or `history`",
        ));
    }
    let items: Vec<&'a RawValue> = source.parse_raw(raw)?;
    let Some(first) = items.first() else {
        return Ok(Vec::new());
    };
    if is_message(first) {
        let mut d = Draft::new(None);
        add_messages(source, &mut d, &items, &mut Converter::default())?;
        return Ok(vec![d]);
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| holder_draft(source, item, Some(i)))
        .collect()
}

fn parse_lines(source: &Source<'_>) -> Result<Vec<Draft>, ImportError> {
    let mut single = Draft::new(None);
    let mut converter = Converter::default();
    let mut holders = Vec::new();
    let mut messages_seen = false;
    for (number, line) in source.lines() {
        let raw: &RawValue =
            serde_json::from_slice(line).map_err(|e| source.line_json_error(number, &e))?;
        if is_message(raw) {
            messages_seen = true;
            add_messages(source, &mut single, &[raw], &mut converter)?;
        } else {
            holders.push(holder_draft(source, raw, Some(holders.len()))?);
        }
        if messages_seen && !holders.is_empty() {
            return Err(source.line_error(
                number,
                "mixes chat messages and objects holding messages; use one or the other",
            ));
        }
    }
    Ok(if messages_seen { vec![single] } else { holders })
}

/// A JSON object with a `role`: a chat message, not a holder.
fn is_message(raw: &RawValue) -> bool {
    #[derive(Deserialize)]
    struct Probe {
        #[serde(default)]
        role: Option<serde::de::IgnoredAny>,
    }
    serde_json::from_str::<Probe>(raw.get()).is_ok_and(|p| p.role.is_some())
}

fn holder_draft<'a>(
    source: &Source<'a>,
    raw: &'a RawValue,
    index: Option<usize>,
) -> Result<Draft, ImportError> {
    let mut holder: Holder<'a> = source.parse_raw(raw)?;
    let Some(messages) = holder.take_messages() else {
        return Err(source.json_error_at(
            source.offset_of(raw),
            "object holds no `messages`, `traj` or `history` array",
        ));
    };
    let mut d = Draft::new(index);
    d.model = holder
        .model
        .as_ref()
        .and_then(Value::as_str)
        .map(str::to_string);
    add_messages(source, &mut d, &messages, &mut Converter::default())?;
    Ok(d)
}

fn add_messages<'a>(
    source: &Source<'a>,
    d: &mut Draft,
    messages: &[&'a RawValue],
    converter: &mut Converter,
) -> Result<(), ImportError> {
    for raw in messages {
        let message: RawMessage = source.parse_raw(raw)?;
        let converted = converter
            .convert(message)
            .map_err(|why| source.json_error_at(source.offset_of(raw), why))?;
        for m in converted {
            d.push_turn(None, TurnAppended::from(m));
        }
    }
    Ok(())
}

pub(crate) fn parse_swe_agent(source: &Source<'_>) -> Result<Vec<Draft>, ImportError> {
    let raw = match source.json_shape()? {
        JsonShape::Document(raw) if raw.get().trim_start().starts_with('{') => raw,
        JsonShape::Document(raw) => {
            return Err(source.json_error_at(
                source.offset_of(raw),
                "expected a SWE-agent trajectory object with a `history` array",
            ))
        }
        JsonShape::Lines => {
            return Err(source.line_error(
                1,
                "expected one SWE-agent trajectory object, found JSON Lines",
            ))
        }
    };
    let mut holder: Holder<'_> = source.parse_raw(raw)?;
    let model = holder.replay_config.and_then(replay_model);
    let Some(history) = holder.history.take().or_else(|| holder.messages.take()) else {
        return Err(source.json_error_at(
            source.offset_of(raw),
            "SWE-agent trajectory has no `history` array",
        ));
    };
    let mut d = Draft::new(None);
    d.model = model;
    add_messages(source, &mut d, &history, &mut Converter::default())?;
    Ok(vec![d])
}

/// `agent.model.name` of a replay config given as an object or a JSON string.
fn replay_model(raw: &RawValue) -> Option<String> {
    let mut value: Value = serde_json::from_str(raw.get()).ok()?;
    if let Value::String(text) = &value {
        value = serde_json::from_str(text).ok()?;
    }
    let model = value.pointer("/agent/model")?;
    model
        .get("name")
        .or_else(|| model.get("model_name"))
        .and_then(Value::as_str)
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::import::{import_bytes, Format};

    fn roles(json: &str, format: Format) -> Vec<String> {
        import_bytes(json.as_bytes(), format, "t.json").unwrap()[0]
            .events
            .iter()
            .map(|e| match &e.body {
                crate::core::event::EventBody::TurnAppended(t) => {
                    t.message.role.as_str().to_string()
                }
                other => other.type_name().to_string(),
            })
            .collect()
    }

    #[test]
    fn tool_call_ids_list_answers_each_call() {
        let json = r#"{"history":[
            {"role":"assistant","content":"x","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]},
            {"role":"tool","content":"out","tool_call_ids":["a"]}],
            "trajectory":[], "replay_config":"{\"agent\":{\"model\":{\"name\":\"gpt-4o\"}}}"}"#;
        assert_eq!(
            roles(json, Format::SweAgent),
            ["model_declared", "assistant", "tool"]
        );
    }

    #[test]
    fn legacy_function_messages_pair_with_function_call() {
        let json = r#"[{"role":"user","content":"q"},
            {"role":"assistant","content":null,"function_call":{"name":"f","arguments":"{}"}},
            {"role":"function","name":"f","content":"42"}]"#;
        let conv = &import_bytes(json.as_bytes(), Format::Openai, "t.json").unwrap()[0];
        let crate::core::event::EventBody::TurnAppended(t) = &conv.events[2].body else {
            panic!()
        };
        assert_eq!(t.message.role, Role::Tool);
        assert_eq!(t.message.tool_call_id.as_deref(), Some("function_call_1"));
    }

    #[test]
    fn unknown_role_names_the_byte() {
        let json = r#"[{"role":"user","content":"q"},{"role":"robot","content":"x"}]"#;
        let err = import_bytes(json.as_bytes(), Format::Openai, "t.json").unwrap_err();
        assert_eq!(
            err.offset(),
            Some(json.find(r#"{"role":"robot""#).unwrap()),
            "{err}"
        );
        assert!(err.to_string().contains("robot"), "{err}");
    }

    #[test]
    fn bad_field_type_names_the_byte_of_the_field() {
        let json = "[{\"role\":\"user\",\n \"content\": 7}]";
        let err = import_bytes(json.as_bytes(), Format::Openai, "t.json").unwrap_err();
        // serde reports an untagged-enum mismatch once it has read the
        // value, so the offset lands between the value and its object's end.
        let at = err.offset().unwrap();
        assert!(
            (json.find('7').unwrap()..=json.find('}').unwrap() + 1).contains(&at),
            "{err}"
        );
        assert_eq!(err.line(), Some(2), "{err}");
    }

    #[test]
    fn jsonl_of_holders_gives_one_conversation_per_line() {
        let text = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"model\":\"m\"}\n\n{\"messages\":[{\"role\":\"user\",\"content\":\"b\"}]}\n";
        let convs = import_bytes(text.as_bytes(), Format::Auto, "ft.jsonl").unwrap();
        let ids: Vec<_> = convs.iter().map(|c| c.conversation.as_str()).collect();
        assert_eq!(ids, ["ft#0", "ft#1"]);
        assert_eq!(convs[0].events[0].type_name(), "model_declared");
    }

    #[test]
    fn runs_without_messages_are_an_error_at_their_byte() {
        let json = r#"[{"traj":[{"role":"user","content":"a"}]},{"reward":1}]"#;
        let err = import_bytes(json.as_bytes(), Format::Openai, "t.json").unwrap_err();
        assert_eq!(
            err.offset(),
            Some(json.find(r#"{"reward""#).unwrap()),
            "{err}"
        );
    }
}
