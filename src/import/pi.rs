//! pi coding-agent / OpenClaw session JSONL.
//!
//! Records: `session` (declares `modelId`), `message`, `model_change`
//! (declares the new model); the rest (`thinking_level_change`, `compaction`:
//! pi's own summary, `label`, ...) are not turns and are skipped. Message
//! roles:
//! - `user`, `assistant`: text / `toolCall` / `thinking` / `image` blocks;
//!   `toolCall` becomes `tool_calls`, thinking is dropped. An assistant
//!   message with `stopReason: "error"` also gives a `provider_error_observed`
//!   with its `errorMessage`; an assistant message left empty (aborted before
//!   any output) gives no turn.
//! - `toolResult`: a `tool` message answering `toolCallId`, named `toolName`,
//!   `isError` kept in metadata.
//! - `bashExecution` (a command the user ran with `!`): a `user` message named
//!   `console`, worded the way pi puts it in context ("Ran `cmd`" and the
//!   output in a fence). Ones marked `excludeFromContext` are skipped.
//! - other roles (extension messages) are skipped.

use super::blocks::{piece, read_content, Piece, TextOrBlocks};
use super::draft::{self, content_from_parts, text_part, usage, Draft};
use super::timestamp::parse_iso8601;
use super::{ImportError, Source};
use crate::core::event::TurnAppended;
use crate::core::message::{ChatMessage, Content, Role};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

#[derive(Deserialize)]
struct Record<'a> {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(borrow, default)]
    message: Option<&'a RawValue>,
    #[serde(default)]
    timestamp: Option<Value>,
    #[serde(rename = "modelId", default)]
    model_id: Option<String>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(default)]
    role: String,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(default)]
    timestamp: Option<Value>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(rename = "stopReason", default)]
    stop_reason: Option<String>,
    #[serde(rename = "errorMessage", default)]
    error_message: Option<String>,
    #[serde(rename = "toolCallId", default)]
    tool_call_id: Option<String>,
    #[serde(rename = "toolName", default)]
    tool_name: Option<String>,
    #[serde(rename = "isError", default)]
    is_error: Option<bool>,
    #[serde(default)]
    command: Option<String>,
    #[serde(default)]
    output: Option<String>,
    #[serde(rename = "exitCode", default)]
    exit_code: Option<i64>,
    #[serde(default)]
    cancelled: Option<bool>,
    #[serde(default)]
    truncated: Option<bool>,
    #[serde(rename = "fullOutputPath", default)]
    full_output_path: Option<String>,
    #[serde(rename = "excludeFromContext", default)]
    exclude_from_context: Option<bool>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    input: Option<u64>,
    #[serde(default)]
    output: Option<u64>,
    #[serde(rename = "cacheRead", default)]
    cache_read: Option<u64>,
    #[serde(rename = "cacheWrite", default)]
    cache_write: Option<u64>,
    #[serde(rename = "totalTokens", default)]
    total_tokens: Option<u64>,
}

/// Milliseconds from a number, or from an ISO 8601 string.
fn time_of(value: Option<&Value>) -> Option<u64> {
    match value? {
        Value::Number(n) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64)),
        Value::String(s) => parse_iso8601(s),
        _ => None,
    }
}

pub(crate) fn parse(source: &Source<'_>) -> Result<Vec<Draft>, ImportError> {
    let mut d = Draft::new(None);
    for (number, line) in source.lines() {
        let record: Record<'_> =
            serde_json::from_slice(line).map_err(|e| source.line_json_error(number, &e))?;
        let record_time = time_of(record.timestamp.as_ref());
        match record.kind.as_deref() {
            Some("session") => {
                if d.model.is_none() && d.items.is_empty() {
                    d.model = record.model_id.filter(|m| !m.is_empty());
                } else if let Some(model) = record.model_id {
                    d.push_model(record_time, model);
                }
            }
            Some("model_change") => {
                if let Some(model) = record.model_id {
                    d.push_model(record_time, model);
                }
            }
            Some("message") => {
                let Some(raw) = record.message else {
                    return Err(source.line_error(number, "`message` record without `message`"));
                };
                let message: Message<'_> = serde_json::from_str(raw.get())
                    .map_err(|e| source.line_error(number, format!("`message`: {e}")))?;
                let time = time_of(message.timestamp.as_ref()).or(record_time);
                add_message(source, &mut d, number, message, time)?;
            }
            _ => {}
        }
    }
    Ok(vec![d])
}

fn add_message(
    source: &Source<'_>,
    d: &mut Draft,
    number: usize,
    message: Message<'_>,
    time: Option<u64>,
) -> Result<(), ImportError> {
    let blocks = || -> Result<_, ImportError> {
        read_content(message.content)
            .map_err(|e| source.line_error(number, format!("`message.content`: {e}")))
    };
    match message.role.as_str() {
        "user" | "assistant" => {
            let role = if message.role == "user" {
                Role::User
            } else {
                Role::Assistant
            };
            let mut parts = Vec::new();
            let mut calls = Vec::new();
            match blocks()? {
                TextOrBlocks::Text(t) => parts.push(text_part(t)),
                TextOrBlocks::Blocks(blocks) => {
                    for block in blocks {
                        match piece(block) {
                            Piece::Part(p) => parts.push(p),
                            Piece::Call(c) if role == Role::Assistant => calls.push(c),
                            Piece::Result { parts: r, .. } => parts.extend(r),
                            Piece::Call(_) | Piece::Dropped => {}
                        }
                    }
                }
            }
            let model = message.model.filter(|m| !m.is_empty());
            if role == Role::Assistant && message.stop_reason.as_deref() == Some("error") {
                let error = message
                    .error_message
                    .clone()
                    .unwrap_or_else(|| "provider error (no message recorded)".to_string());
                d.push_provider_error(time, error, model.clone());
            }
            if parts.is_empty() && calls.is_empty() {
                return Ok(());
            }
            let mut turn = TurnAppended::from(ChatMessage {
                role,
                content: content_from_parts(parts),
                tool_calls: calls,
                tool_call_id: None,
                name: None,
            });
            if role == Role::Assistant {
                turn.model = model;
                turn.usage = message.usage.as_ref().and_then(|u| {
                    let prompt = match (u.input, u.cache_read, u.cache_write) {
                        (None, None, None) => None,
                        (a, b, c) => Some(a.unwrap_or(0) + b.unwrap_or(0) + c.unwrap_or(0)),
                    };
                    usage(prompt, u.output, u.total_tokens)
                });
            }
            d.push_turn(time, turn);
        }
        "toolResult" => {
            let parts = match blocks()? {
                TextOrBlocks::Text(t) => vec![text_part(t)],
                TextOrBlocks::Blocks(blocks) => blocks
                    .into_iter()
                    .filter_map(|b| match b.kind.as_str() {
                        // Tool output is kept exactly, blank text included.
                        "text" => b.text.map(text_part),
                        _ => match piece(b) {
                            Piece::Part(p) => Some(p),
                            _ => None,
                        },
                    })
                    .collect(),
            };
            let mut turn = TurnAppended::from(ChatMessage {
                role: Role::Tool,
                content: content_from_parts(parts).or(Some(Content::Text(String::new()))),
                tool_calls: Vec::new(),
                tool_call_id: message.tool_call_id,
                name: message.tool_name,
            });
            if message.is_error == Some(true) {
                draft::set_metadata(&mut turn, "is_error", Value::Bool(true));
            }
            d.push_turn(time, turn);
        }
        "bashExecution" => {
            if message.exclude_from_context == Some(true) {
                return Ok(());
            }
            let mut m = ChatMessage::text(Role::User, bash_execution_text(&message));
            m.name = Some("console".to_string());
            d.push_turn(time, TurnAppended::from(m));
        }
        _ => {}
    }
    Ok(())
}

/// How pi words a user-run command for the model.
fn bash_execution_text(m: &Message<'_>) -> String {
    let mut text = format!("Ran `{}`\n", m.command.as_deref().unwrap_or(""));
    match m.output.as_deref() {
        Some(out) if !out.is_empty() => text.push_str(&format!("```\n{out}\n```")),
        _ => text.push_str("(no output)"),
    }
    if m.cancelled == Some(true) {
        text.push_str("\n\n(command cancelled)");
    } else if let Some(code) = m.exit_code.filter(|c| *c != 0) {
        text.push_str(&format!("\n\nCommand exited with code {code}"));
    }
    if m.truncated == Some(true) {
        if let Some(path) = &m.full_output_path {
            text.push_str(&format!("\n\n[Output truncated. Full output: {path}]"));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use crate::core::event::EventBody;
    use crate::core::message::Role;
    use crate::import::{import_bytes, Format};

    const SESSION: &str = concat!(
        r#"{"type":"session","id":"s","timestamp":"2025-12-09T00:53:29.825Z","modelId":"claude-opus-4-5"}"#,
        "\n",
        r#"{"type":"message","message":{"role":"user","content":[{"type":"text","text":"read it"}],"timestamp":1765233665292}}"#,
        "\n",
        r#"{"type":"message","message":{"role":"assistant","content":[{"type":"thinking","thinking":"x"},{"type":"toolCall","id":"c1","name":"read","arguments":{"path":"/a"}}],"model":"claude-opus-4-5","usage":{"input":10,"output":5,"cacheRead":100,"cacheWrite":1,"totalTokens":116},"timestamp":1765233666000}}"#,
        "\n",
        r#"{"type":"message","message":{"role":"toolResult","toolCallId":"c1","toolName":"read","content":[{"type":"text","text":"data"}],"isError":false,"timestamp":1765233667000}}"#,
        "\n",
        r#"{"type":"thinking_level_change","thinkingLevel":"high"}"#,
        "\n",
        r#"{"type":"model_change","modelId":"claude-sonnet-4-5","timestamp":"2025-12-09T00:00:00Z"}"#,
        "\n",
        r#"{"type":"message","message":{"role":"assistant","content":[],"stopReason":"error","errorMessage":"400 prompt is too long","model":"claude-sonnet-4-5"}}"#,
        "\n",
        r#"{"type":"message","message":{"role":"bashExecution","command":"ls","output":"a\nb","exitCode":2,"cancelled":false,"truncated":false}}"#,
        "\n",
    );

    #[test]
    fn maps_a_session() {
        let conv = &import_bytes(SESSION.as_bytes(), Format::Pi, "p.jsonl").unwrap()[0];
        let kinds: Vec<String> = conv
            .events
            .iter()
            .map(|e| match &e.body {
                EventBody::TurnAppended(t) => t.message.role.as_str().to_string(),
                EventBody::ModelDeclared(m) => format!("model {}", m.model),
                other => other.type_name().to_string(),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "model claude-opus-4-5",
                "user",
                "assistant",
                "tool",
                "model claude-sonnet-4-5",
                "provider_error_observed",
                "user"
            ]
        );
        assert_eq!(conv.events[1].time, 1_765_233_665_292);
        let EventBody::TurnAppended(a) = &conv.events[2].body else {
            panic!()
        };
        assert_eq!(
            a.message.tool_calls[0].function.arguments,
            r#"{"path":"/a"}"#
        );
        assert_eq!(a.usage.unwrap().prompt_tokens, Some(111));
        assert_eq!(a.usage.unwrap().total_tokens, Some(116));
        let EventBody::TurnAppended(b) = &conv.events[6].body else {
            panic!()
        };
        assert_eq!(b.message.name.as_deref(), Some("console"));
        assert_eq!(
            b.message.text_content(),
            "Ran `ls`\n```\na\nb\n```\n\nCommand exited with code 2"
        );
        assert_eq!(b.message.role, Role::User);
    }
}
