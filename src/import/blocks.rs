//! Anthropic-style content blocks to OpenAI chat pieces.
//!
//! Claude Code writes `text`, `thinking`, `tool_use`, `tool_result`, `image`;
//! pi writes `text`, `thinking`, `toolCall`, `image`. One wide block type
//! reads both; fields a block does not have stay `None`, and fields nobody
//! needs (thinking text, signatures) are never allocated.

use super::draft::{image_part, text_part};
use crate::core::message::{ContentPart, FunctionCall, ToolCall};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

#[derive(Debug, Deserialize)]
pub(crate) struct Block {
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    /// Claude `tool_use` arguments.
    #[serde(default)]
    pub input: Option<Value>,
    /// pi `toolCall` arguments.
    #[serde(default)]
    pub arguments: Option<Value>,
    #[serde(default)]
    pub tool_use_id: Option<String>,
    /// Claude `tool_result` content: text or blocks.
    #[serde(default)]
    pub content: Option<Value>,
    #[serde(default)]
    pub is_error: Option<bool>,
    /// Claude image source (`base64` with `media_type` and `data`, or `url`).
    #[serde(default)]
    pub source: Option<Value>,
    /// pi image data (base64) and its type.
    #[serde(default)]
    pub data: Option<String>,
    #[serde(default, rename = "mimeType")]
    pub mime_type: Option<String>,
}

/// What one block becomes.
pub(crate) enum Piece {
    Part(ContentPart),
    Call(ToolCall),
    Result {
        call_id: String,
        parts: Vec<ContentPart>,
        is_error: Option<bool>,
    },
    /// Thinking, whitespace-only text, server-side tool blocks and unknown
    /// kinds: not part of what the conversation says.
    Dropped,
}

/// Message content as a string or as blocks.
pub(crate) enum TextOrBlocks {
    Text(String),
    Blocks(Vec<Block>),
}

/// Reads `content` that is a string, an array of blocks, or null.
pub(crate) fn read_content(raw: Option<&RawValue>) -> Result<TextOrBlocks, serde_json::Error> {
    let Some(raw) = raw else {
        return Ok(TextOrBlocks::Blocks(Vec::new()));
    };
    match raw.get().trim_start().as_bytes().first() {
        Some(b'"') => serde_json::from_str(raw.get()).map(TextOrBlocks::Text),
        Some(b'n') => Ok(TextOrBlocks::Blocks(Vec::new())),
        _ => serde_json::from_str(raw.get()).map(TextOrBlocks::Blocks),
    }
}

pub(crate) fn piece(block: Block) -> Piece {
    match block.kind.as_str() {
        "text" => match block.text {
            Some(t) if !t.trim().is_empty() => Piece::Part(text_part(t)),
            _ => Piece::Dropped,
        },
        "image" => image(&block).map_or(Piece::Dropped, Piece::Part),
        "tool_use" | "toolCall" => Piece::Call(ToolCall {
            id: block.id.unwrap_or_default(),
            kind: "function".to_string(),
            function: FunctionCall {
                name: block.name.unwrap_or_default(),
                arguments: arguments_string(block.input.as_ref().or(block.arguments.as_ref())),
            },
        }),
        "tool_result" => Piece::Result {
            call_id: block.tool_use_id.unwrap_or_default(),
            parts: result_parts(block.content.as_ref()),
            is_error: block.is_error,
        },
        _ => Piece::Dropped,
    }
}

/// OpenAI wants arguments as a JSON string; sources give objects.
pub(crate) fn arguments_string(value: Option<&Value>) -> String {
    match value {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

fn image(block: &Block) -> Option<ContentPart> {
    if let (Some(data), Some(mime)) = (&block.data, &block.mime_type) {
        return Some(image_part(mime, data));
    }
    let source = block.source.as_ref()?;
    match source.get("type").and_then(Value::as_str) {
        Some("base64") => Some(image_part(
            source
                .get("media_type")
                .and_then(Value::as_str)
                .unwrap_or("image/png"),
            source.get("data").and_then(Value::as_str)?,
        )),
        Some("url") => {
            let url = source.get("url").and_then(Value::as_str)?;
            let mut other = std::collections::BTreeMap::new();
            other.insert("image_url".to_string(), serde_json::json!({ "url": url }));
            Some(ContentPart {
                kind: "image_url".to_string(),
                text: None,
                other,
            })
        }
        _ => None,
    }
}

/// A tool result's content (text, or text / image blocks) as parts. Text is
/// kept exactly, whitespace included: it is what the tool returned.
pub(crate) fn result_parts(content: Option<&Value>) -> Vec<ContentPart> {
    match content {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![text_part(s.clone())],
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|item| match item {
                Value::String(s) => Some(text_part(s.clone())),
                Value::Object(map) => match map.get("type").and_then(Value::as_str) {
                    Some("text") => map
                        .get("text")
                        .and_then(Value::as_str)
                        .map(|t| text_part(t.to_string())),
                    Some("image") => serde_json::from_value::<Block>(item.clone())
                        .ok()
                        .and_then(|b| image(&b)),
                    _ => Some(text_part(item.to_string())),
                },
                other => Some(text_part(other.to_string())),
            })
            .collect(),
        Some(other) => vec![text_part(other.to_string())],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(json: &str) -> Block {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn tool_use_and_tool_call_become_calls() {
        let Piece::Call(c) = piece(block(
            r#"{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"ls","timeout":5}}"#,
        )) else {
            panic!("not a call")
        };
        assert_eq!((c.id.as_str(), c.function.name.as_str()), ("t1", "Bash"));
        assert_eq!(c.function.arguments, r#"{"command":"ls","timeout":5}"#);
        let Piece::Call(c) = piece(block(
            r#"{"type":"toolCall","id":"t2","name":"read","arguments":{"path":"/a"}}"#,
        )) else {
            panic!("not a call")
        };
        assert_eq!(c.function.arguments, r#"{"path":"/a"}"#);
    }

    #[test]
    fn thinking_and_blank_text_are_dropped() {
        for json in [
            r#"{"type":"thinking","thinking":"secret plan","signature":"x"}"#,
            r#"{"type":"redacted_thinking","data":"x"}"#,
            r#"{"type":"text","text":"\n\n"}"#,
        ] {
            assert!(matches!(piece(block(json)), Piece::Dropped), "{json}");
        }
    }

    #[test]
    fn images_become_data_urls() {
        let Piece::Part(p) = piece(block(
            r#"{"type":"image","source":{"type":"base64","media_type":"image/jpeg","data":"QUJD"}}"#,
        )) else {
            panic!("not a part")
        };
        assert_eq!(p.kind, "image_url");
        assert_eq!(p.other["image_url"]["url"], "data:image/jpeg;base64,QUJD");
        let Piece::Part(p) = piece(block(
            r#"{"type":"image","data":"QUJD","mimeType":"image/png"}"#,
        )) else {
            panic!("not a part")
        };
        assert_eq!(p.other["image_url"]["url"], "data:image/png;base64,QUJD");
    }

    #[test]
    fn tool_result_content_keeps_text_exactly() {
        let v: Value =
            serde_json::from_str(r#"[{"type":"text","text":"a\n"},{"type":"text","text":" b"}]"#)
                .unwrap();
        let parts = result_parts(Some(&v));
        let texts: Vec<_> = parts.iter().map(|p| p.text.clone().unwrap()).collect();
        assert_eq!(texts, ["a\n", " b"]);
        assert!(result_parts(None).is_empty());
    }
}
