//! Claude Code session JSONL (`~/.claude/projects/*/<session>.jsonl`).
//!
//! Only `user` and `assistant` records are turns; `progress`, `system`,
//! `summary`, `file-history-snapshot`, `queue-operation` and records marked
//! `isMeta` (hook reminders, command caveats) are skipped. Sidechain records
//! (a sub-agent's thread written into the parent session) are skipped when
//! the file also has main-thread records; a sub-agent's own file holds only
//! sidechain records and reads as its conversation.
//!
//! - Streaming writes one record per content block, each repeating the
//!   message's `message.id`: records with the same id are merged into one
//!   assistant message at the place of the first, so parallel tool calls stay
//!   one group even when results were written between them.
//! - `tool_use` blocks become `tool_calls`; each `tool_result` block becomes
//!   its own `tool` message (`is_error` kept in metadata). A user record that
//!   mixes results and text gives the tool messages first, then one `user`
//!   message with the text (results must follow their calls directly).
//! - `thinking` blocks are dropped; an assistant message left with neither
//!   text nor calls is dropped.
//! - `isCompactSummary` user records (Claude Code's own summary after it
//!   compacted) stay user turns, marked `compact_summary` in metadata.
//! - Records with `isApiErrorMessage` are provider errors, not turns.
//! - Usage: prompt = input + cache creation + cache read tokens.

use super::blocks::{piece, read_content, Block, Piece, TextOrBlocks};
use super::draft::{self, content_from_parts, text_part, usage, Draft, Item, ItemKind};
use super::timestamp::parse_iso8601;
use super::{ImportError, Source};
use crate::core::event::{ProviderUsage, TurnAppended};
use crate::core::message::{ChatMessage, Content, ContentPart, Role, ToolCall};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::HashMap;

#[derive(Deserialize)]
struct Record<'a> {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(borrow, default)]
    message: Option<&'a RawValue>,
    #[serde(rename = "isMeta", default)]
    is_meta: Option<bool>,
    #[serde(rename = "isSidechain", default)]
    is_sidechain: Option<bool>,
    #[serde(rename = "isCompactSummary", default)]
    is_compact_summary: Option<bool>,
    #[serde(rename = "isApiErrorMessage", default)]
    is_api_error: Option<bool>,
    #[serde(default)]
    timestamp: Option<String>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

impl Usage {
    fn provider_usage(&self) -> Option<ProviderUsage> {
        let prompt = match (
            self.input_tokens,
            self.cache_creation_input_tokens,
            self.cache_read_input_tokens,
        ) {
            (None, None, None) => None,
            (a, b, c) => Some(a.unwrap_or(0) + b.unwrap_or(0) + c.unwrap_or(0)),
        };
        usage(prompt, self.output_tokens, None)
    }
}

/// A conversation entry while records are still being merged.
enum Entry {
    Assistant(AssistantParts),
    Done(Item),
}

struct AssistantParts {
    time: Option<u64>,
    parts: Vec<ContentPart>,
    calls: Vec<ToolCall>,
    model: Option<String>,
    usage: Option<ProviderUsage>,
}

/// A record kept for the second pass (sidechains are known only at the end).
struct Kept<'a> {
    line: usize,
    assistant: bool,
    sidechain: bool,
    compact_summary: bool,
    api_error: bool,
    time: Option<u64>,
    message: &'a RawValue,
}

pub(crate) fn parse(source: &Source<'_>) -> Result<Vec<Draft>, ImportError> {
    let mut kept = Vec::new();
    for (number, line) in source.lines() {
        let record: Record<'_> =
            serde_json::from_slice(line).map_err(|e| source.line_json_error(number, &e))?;
        let assistant = match record.kind.as_deref() {
            Some("assistant") => true,
            Some("user") => false,
            _ => continue,
        };
        if record.is_meta == Some(true) {
            continue;
        }
        let Some(message) = record.message else {
            return Err(source.line_error(number, "user/assistant record without `message`"));
        };
        kept.push(Kept {
            line: number,
            assistant,
            sidechain: record.is_sidechain == Some(true),
            compact_summary: record.is_compact_summary == Some(true),
            api_error: record.is_api_error == Some(true),
            time: record.timestamp.as_deref().and_then(parse_iso8601),
            message,
        });
    }
    let main_thread = kept.iter().any(|k| !k.sidechain);

    let mut entries: Vec<Entry> = Vec::new();
    let mut by_message_id: HashMap<String, usize> = HashMap::new();
    let mut d = Draft::new(None);
    for k in kept.into_iter().filter(|k| !(main_thread && k.sidechain)) {
        let message: Message<'_> =
            serde_json::from_str(k.message.get()).map_err(|e| line_error(source, k.line, &e))?;
        let content = read_content(message.content).map_err(|e| line_error(source, k.line, &e))?;
        if k.assistant {
            let model = message
                .model
                .filter(|m| !m.is_empty() && m != "<synthetic>");
            if k.api_error {
                let text = match content {
                    TextOrBlocks::Text(t) => t,
                    TextOrBlocks::Blocks(blocks) => blocks
                        .into_iter()
                        .filter_map(|b| b.text)
                        .collect::<Vec<_>>()
                        .join("\n"),
                };
                entries.push(Entry::Done(Item {
                    time: k.time,
                    kind: ItemKind::ProviderError { error: text, model },
                }));
                continue;
            }
            let slot = match message.id.as_ref().and_then(|id| by_message_id.get(id)) {
                Some(&i) => i,
                None => {
                    entries.push(Entry::Assistant(AssistantParts {
                        time: k.time,
                        parts: Vec::new(),
                        calls: Vec::new(),
                        model: None,
                        usage: None,
                    }));
                    if let Some(id) = message.id {
                        by_message_id.insert(id, entries.len() - 1);
                    }
                    entries.len() - 1
                }
            };
            let Entry::Assistant(a) = &mut entries[slot] else {
                unreachable!("message ids map to assistant entries only");
            };
            if model.is_some() {
                a.model = model;
            }
            if let Some(u) = message.usage.as_ref().and_then(Usage::provider_usage) {
                a.usage = Some(u);
            }
            let blocks = match content {
                TextOrBlocks::Text(t) => vec![text_block(t)],
                TextOrBlocks::Blocks(b) => b,
            };
            for block in blocks {
                match piece(block) {
                    Piece::Part(p) => a.parts.push(p),
                    Piece::Call(c) => a.calls.push(c),
                    // A tool result inside an assistant message is not
                    // something Claude Code writes; keep its text visible.
                    Piece::Result { parts, .. } => a.parts.extend(parts),
                    Piece::Dropped => {}
                }
            }
        } else {
            let mut parts = Vec::new();
            match content {
                TextOrBlocks::Text(t) => parts.push(text_part(t)),
                TextOrBlocks::Blocks(blocks) => {
                    for block in blocks {
                        match piece(block) {
                            Piece::Part(p) => parts.push(p),
                            Piece::Result {
                                call_id,
                                parts: result,
                                is_error,
                            } => {
                                let mut m = ChatMessage::text(Role::Tool, "");
                                m.content = content_from_parts(result)
                                    .or(Some(Content::Text(String::new())));
                                m.tool_call_id = Some(call_id);
                                let mut turn = TurnAppended::from(m);
                                if is_error == Some(true) {
                                    draft::set_metadata(&mut turn, "is_error", Value::Bool(true));
                                }
                                entries.push(Entry::Done(Item {
                                    time: k.time,
                                    kind: ItemKind::Turn(turn),
                                }));
                            }
                            // A user record carries no calls.
                            Piece::Call(_) | Piece::Dropped => {}
                        }
                    }
                }
            }
            if let Some(content) = content_from_parts(parts) {
                let mut turn = TurnAppended::from(ChatMessage {
                    content: Some(content),
                    ..ChatMessage::text(Role::User, "")
                });
                if k.compact_summary {
                    draft::set_metadata(&mut turn, "compact_summary", Value::Bool(true));
                }
                entries.push(Entry::Done(Item {
                    time: k.time,
                    kind: ItemKind::Turn(turn),
                }));
            }
        }
    }

    for entry in entries {
        match entry {
            Entry::Done(item) => d.items.push(item),
            Entry::Assistant(a) => {
                if a.parts.is_empty() && a.calls.is_empty() {
                    continue;
                }
                let mut turn = TurnAppended::from(ChatMessage {
                    role: Role::Assistant,
                    content: content_from_parts(a.parts),
                    tool_calls: a.calls,
                    tool_call_id: None,
                    name: None,
                });
                turn.model = a.model;
                turn.usage = a.usage;
                d.push_turn(a.time, turn);
            }
        }
    }
    Ok(vec![d])
}

fn text_block(text: String) -> Block {
    Block {
        kind: "text".to_string(),
        text: Some(text),
        id: None,
        name: None,
        input: None,
        arguments: None,
        tool_use_id: None,
        content: None,
        is_error: None,
        source: None,
        data: None,
        mime_type: None,
    }
}

fn line_error(source: &Source<'_>, line: usize, err: &serde_json::Error) -> ImportError {
    source.line_error(line, format!("`message`: {err}"))
}

#[cfg(test)]
mod tests {
    use crate::core::event::EventBody;
    use crate::core::message::Role;
    use crate::import::{import_bytes, Format};

    fn turns(text: &str) -> Vec<crate::core::event::TurnAppended> {
        import_bytes(text.as_bytes(), Format::ClaudeCode, "s.jsonl").unwrap()[0]
            .events
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::TurnAppended(t) => Some(t.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn streamed_records_merge_and_mixed_user_records_split() {
        let text = concat!(
            r#"{"type":"progress","data":{"x":1}}"#,
            "\n",
            r#"{"type":"user","message":{"role":"user","content":"go"},"timestamp":"2026-01-01T00:00:00Z"}"#,
            "\n",
            r#"{"type":"assistant","message":{"id":"m1","model":"claude-x","content":[{"type":"thinking","thinking":"hmm"}]}}"#,
            "\n",
            r#"{"type":"assistant","message":{"id":"m1","model":"claude-x","content":[{"type":"tool_use","id":"t1","name":"Bash","input":{"c":"ls"}}]}}"#,
            "\n",
            r#"{"type":"user","message":{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a b"}]}}"#,
            "\n",
            r#"{"type":"assistant","message":{"id":"m1","model":"claude-x","content":[{"type":"tool_use","id":"t2","name":"Read","input":{}}]}}"#,
            "\n",
            r#"{"type":"user","message":{"role":"user","content":[{"type":"tool_result","tool_use_id":"t2","content":"x","is_error":true},{"type":"text","text":"stop"}]}}"#,
            "\n",
            r#"{"type":"user","isMeta":true,"message":{"role":"user","content":"<system-reminder>"}}"#,
            "\n",
        );
        let t = turns(text);
        let roles: Vec<Role> = t.iter().map(|t| t.message.role).collect();
        assert_eq!(
            roles,
            [
                Role::User,
                Role::Assistant,
                Role::Tool,
                Role::Tool,
                Role::User
            ]
        );
        let calls: Vec<&str> = t[1]
            .message
            .tool_calls
            .iter()
            .map(|c| c.id.as_str())
            .collect();
        assert_eq!(calls, ["t1", "t2"]);
        assert!(t[1].message.content.is_none(), "thinking is not content");
        assert_eq!(t[1].model.as_deref(), Some("claude-x"));
        assert_eq!(t[3].message.tool_call_id.as_deref(), Some("t2"));
        assert_eq!(t[3].metadata.as_ref().unwrap()["is_error"], true);
        assert_eq!(t[4].message.text_content(), "stop");
    }

    #[test]
    fn sidechains_are_skipped_beside_a_main_thread() {
        let text = concat!(
            r#"{"type":"user","isSidechain":false,"message":{"role":"user","content":"main"}}"#,
            "\n",
            r#"{"type":"user","isSidechain":true,"message":{"role":"user","content":"side"}}"#,
            "\n",
        );
        let t = turns(text);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].message.text_content(), "main");
    }

    #[test]
    fn api_errors_are_provider_errors() {
        let text = concat!(
            r#"{"type":"user","message":{"role":"user","content":"hi"}}"#,
            "\n",
            r#"{"type":"assistant","isApiErrorMessage":true,"message":{"id":"e","model":"<synthetic>","content":[{"type":"text","text":"API Error: prompt is too long: 210000 tokens > 200000 maximum"}]}}"#,
            "\n",
        );
        let conv = &import_bytes(text.as_bytes(), Format::ClaudeCode, "s.jsonl").unwrap()[0];
        let EventBody::ProviderErrorObserved(p) = &conv.events[1].body else {
            panic!("{:?}", conv.events[1])
        };
        assert!(p.error.contains("prompt is too long"));
        assert!(conv
            .events
            .iter()
            .all(|e| e.type_name() != "model_declared"));
    }

    #[test]
    fn a_broken_line_is_named() {
        let text = "{\"type\":\"progress\"}\n{\"type\":\"user\",\"message\":{\"role\":\"user\",\"content\":\"a\"}}\n{\"type\":\"assistant\",\"mess";
        let err = import_bytes(text.as_bytes(), Format::ClaudeCode, "s.jsonl").unwrap_err();
        assert_eq!(err.line(), Some(3), "{err}");
        let err = import_bytes(
            b"{\"type\":\"user\",\"message\":{\"content\":5}}\n",
            Format::ClaudeCode,
            "s.jsonl",
        )
        .unwrap_err();
        assert_eq!(err.line(), Some(1), "{err}");
    }
}
