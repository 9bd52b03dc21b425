//! The three HTTP surfaces the gateway speaks, what it reads of a request
//! (the conversation's items, borrowed from the body; the rest is never
//! parsed and goes upstream byte for byte) and how each item becomes the
//! turns contextfold stores (the OpenAI chat-message shape of the log).
//!
//! An item's *identity* is a digest of what stays the same between the
//! response the gateway stored and the copy the client sends back next
//! time: role, text, tool calls and results, reasoning and thinking by
//! their opaque content. What clients move or inject is left out of it:
//! Anthropic `cache_control` breakpoints, `<system-reminder>` text (Claude
//! Code), Anthropic `thinking` blocks of earlier turns (clients drop them,
//! the API ignores them there), Responses item `id`s and `status`.

use crate::core::message::{ChatMessage, Content, ContentPart, FunctionCall, Role, ToolCall};
use crate::core::tokens;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::ops::Range;

/// The marker a summary block carries, so a client that keeps it in its
/// history (Codex's own compaction keeps the text it was answered) is
/// recognised: everything up to it is already stored.
pub const SUMMARY_MARKER: &str = "<contextfold_summary conversation=\"";

/// The prefix of a `compaction` item's `encrypted_content` the gateway
/// issued: a handle to the conversation, never model state.
pub const COMPACTION_HANDLE_PREFIX: &str = "contextfold.v1:";

/// Which API a request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Surface {
    /// OpenAI Chat Completions (`POST /v1/chat/completions`).
    Chat,
    /// OpenAI Responses (`POST /v1/responses`).
    Responses,
    /// Anthropic Messages (`POST /v1/messages`).
    Messages,
}

impl Surface {
    /// The surface a `POST` path belongs to (with or without `/v1`).
    pub fn of_path(path: &str) -> Option<Surface> {
        let p = path.strip_prefix("/v1").unwrap_or(path);
        match p {
            "/chat/completions" => Some(Surface::Chat),
            "/responses" => Some(Surface::Responses),
            "/messages" => Some(Surface::Messages),
            _ => None,
        }
    }

    /// The closed label of metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Surface::Chat => "chat_completions",
            Surface::Responses => "responses",
            Surface::Messages => "messages",
        }
    }

    /// A provider-shaped error body: OpenAI's `{"error":{...}}` or
    /// Anthropic's `{"type":"error","error":{...}}`.
    pub fn error_body(self, kind: ErrorKind, message: &str) -> Vec<u8> {
        let v = match self {
            Surface::Messages => serde_json::json!({
                "type": "error",
                "error": {"type": kind.anthropic(), "message": message},
            }),
            Surface::Chat | Surface::Responses => serde_json::json!({
                "error": {
                    "message": message,
                    "type": kind.openai(),
                    "param": null,
                    "code": kind.openai_code(),
                },
            }),
        };
        v.to_string().into_bytes()
    }
}

/// Errors the gateway itself answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    TooLarge,
    Unauthorized,
    Unavailable,
    UpstreamUnreachable,
}

impl ErrorKind {
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest => 400,
            ErrorKind::TooLarge => 413,
            ErrorKind::Unauthorized => 401,
            ErrorKind::Unavailable => 503,
            ErrorKind::UpstreamUnreachable => 502,
        }
    }
    fn anthropic(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::TooLarge => "request_too_large",
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::Unavailable => "overloaded_error",
            ErrorKind::UpstreamUnreachable => "api_error",
        }
    }
    fn openai(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest | ErrorKind::TooLarge => "invalid_request_error",
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::Unavailable | ErrorKind::UpstreamUnreachable => "server_error",
        }
    }
    fn openai_code(self) -> Value {
        match self {
            ErrorKind::TooLarge => Value::from("request_too_large"),
            ErrorKind::Unauthorized => Value::from("invalid_api_key"),
            _ => Value::Null,
        }
    }
}

/// What the gateway reads of a request body; everything else stays
/// bytes.
#[derive(Debug)]
pub struct Parsed<'a> {
    pub surface: Surface,
    pub model: Option<String>,
    pub stream: bool,
    /// The conversation's items (`messages`, or `input`), borrowed.
    pub items: Vec<&'a RawValue>,
    /// Byte range of the items' array in the body (absent: a Responses
    /// `input` given as a string).
    pub items_span: Option<Range<usize>>,
    /// `metadata.conversation_id` / `metadata.session_id` / Anthropic
    /// `metadata.user_id` (Claude Code puts its session there).
    pub metadata_conversation: Option<String>,
    /// Responses `previous_response_id`.
    pub previous_response_id: Option<String>,
    /// A Responses `input` given as one string.
    pub input_text: Option<String>,
    /// Bytes outside the items (system, tools, instructions): counted as
    /// tokens once, cached by digest.
    pub rest_digest: [u8; 16],
    pub rest_len: usize,
}

#[derive(Deserialize)]
struct Top<'a> {
    #[serde(default, borrow)]
    messages: Option<&'a RawValue>,
    #[serde(default, borrow)]
    input: Option<&'a RawValue>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default, borrow)]
    metadata: Option<&'a RawValue>,
    #[serde(default)]
    previous_response_id: Option<String>,
}

/// Why a request cannot be read: answered with a provider-shaped 400,
/// nothing stored.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("request body is not a JSON object: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error("request has no `{0}` array")]
    NoItems(&'static str),
    #[error("`{field}` must be an array of objects: {source}")]
    BadItems {
        field: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("item {index} of `{field}`: {reason}")]
    BadItem {
        field: &'static str,
        index: usize,
        reason: String,
    },
}

fn span_of(body: &[u8], raw: &RawValue) -> Range<usize> {
    let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
    start..start + raw.get().len()
}

/// Reads what the gateway needs of a body, borrowing the items.
pub fn parse(surface: Surface, body: &[u8]) -> Result<Parsed<'_>, ParseError> {
    let top: Top<'_> = serde_json::from_slice(body).map_err(ParseError::NotJson)?;
    let (field, raw) = match surface {
        Surface::Chat | Surface::Messages => ("messages", top.messages),
        Surface::Responses => ("input", top.input),
    };
    let raw = raw.ok_or(ParseError::NoItems(field))?;
    let mut input_text = None;
    let (items, items_span) = if raw.get().starts_with('"') {
        if surface != Surface::Responses {
            return Err(ParseError::NoItems(field));
        }
        let text: String = serde_json::from_str(raw.get())
            .map_err(|source| ParseError::BadItems { field, source })?;
        input_text = Some(text);
        (Vec::new(), None)
    } else {
        let items: Vec<&RawValue> = serde_json::from_str(raw.get())
            .map_err(|source| ParseError::BadItems { field, source })?;
        for (index, item) in items.iter().enumerate() {
            if !item.get().starts_with('{') {
                return Err(ParseError::BadItem {
                    field,
                    index,
                    reason: "not an object".into(),
                });
            }
        }
        (items, Some(span_of(body, raw)))
    };
    let metadata_conversation = top.metadata.and_then(|m| {
        let m: Map<String, Value> = serde_json::from_str(m.get()).ok()?;
        for key in ["conversation_id", "contextfold_conversation", "session_id"] {
            if let Some(Value::String(s)) = m.get(key) {
                if !s.is_empty() {
                    return Some(s.clone());
                }
            }
        }
        // Claude Code: a JSON object with its `session_id`, or (older
        // versions) `user_<hash>_account_<uuid>_session_<uuid>`.
        match m.get("user_id") {
            Some(Value::String(s)) if s.starts_with('{') => serde_json::from_str::<Value>(s)
                .ok()
                .and_then(|v| {
                    v.get("session_id")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
                .filter(|id| !id.is_empty())
                .map(|id| format!("claude-code-{id}")),
            Some(Value::String(s)) => s
                .find("session_")
                .map(|i| format!("claude-code-{}", &s[i + "session_".len()..])),
            _ => None,
        }
    });
    let (rest_digest, rest_len) = match &items_span {
        Some(span) => {
            let mut h = blake3::Hasher::new();
            h.update(&body[..span.start]);
            h.update(&body[span.end..]);
            (digest16(h), body.len() - span.len())
        }
        None => (digest16(blake3::Hasher::new()), body.len()),
    };
    Ok(Parsed {
        surface,
        model: top.model,
        stream: top.stream.unwrap_or(false),
        items,
        items_span,
        metadata_conversation,
        previous_response_id: top.previous_response_id,
        input_text,
        rest_digest,
        rest_len,
    })
}

pub(crate) fn digest16(h: blake3::Hasher) -> [u8; 16] {
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}

/// What an item is, for keying, tool pairing and the compaction contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemKind {
    /// System or developer instructions at the head: the client's, sent
    /// byte-identical; not a turn.
    System,
    User,
    Assistant,
    /// A tool result (its call is in an earlier assistant item).
    ToolResult,
    /// Only injected content (`<system-reminder>`): not a turn.
    Injected,
    /// Codex's `compaction_trigger`: the request asks for a compaction.
    CompactionTrigger,
}

/// One item, canonical: the turns it stores, its identity and size.
#[derive(Debug, Clone)]
pub struct Canon {
    pub kind: ItemKind,
    /// The turns this item becomes (an Anthropic user message with tool
    /// results becomes one tool turn per result, then its text).
    pub messages: Vec<ChatMessage>,
    /// Identity digest (module doc).
    pub digest: [u8; 16],
    /// Identity digest of each of `messages` (what a stored turn is
    /// matched against).
    pub message_digests: Vec<[u8; 16]>,
    /// Tokens of the item as sent.
    pub tokens: u64,
    /// A contextfold summary it carries: the conversation it names.
    pub summary_of: Option<String>,
}

const REMINDER: &str = "<system-reminder>";

fn is_reminder(text: &str) -> bool {
    text.trim_start().starts_with(REMINDER)
}

/// The identity digest of a stored or canonical message.
pub fn message_digest(m: &ChatMessage) -> [u8; 16] {
    let mut h = blake3::Hasher::new();
    h.update(m.role.as_str().as_bytes());
    h.update(&[0]);
    match &m.content {
        Some(Content::Text(t)) if !is_reminder(t) => {
            h.update(b"t");
            h.update(t.as_bytes());
        }
        None | Some(Content::Text(_)) => {}
        Some(Content::Parts(parts)) => {
            for p in parts {
                // Clients drop earlier turns' thinking (the API ignores it
                // there): the turn is the same without it.
                if p.text.as_deref().is_some_and(is_reminder)
                    || p.kind == "thinking"
                    || p.kind == "redacted_thinking"
                {
                    continue;
                }
                h.update(&[1]);
                h.update(p.kind.as_bytes());
                h.update(&[0]);
                if let Some(t) = &p.text {
                    h.update(t.as_bytes());
                }
                for key in ["encrypted_content", "signature", "data", "thinking"] {
                    if let Some(v) = p.other.get(key) {
                        h.update(&[2]);
                        h.update(v.to_string().as_bytes());
                    }
                }
                if let Some(v) = p.other.get("summary") {
                    h.update(&[3]);
                    h.update(v.to_string().as_bytes());
                }
            }
        }
    }
    for c in &m.tool_calls {
        h.update(&[4]);
        h.update(c.id.as_bytes());
        h.update(&[0]);
        h.update(c.function.name.as_bytes());
        h.update(&[0]);
        h.update(c.function.arguments.as_bytes());
    }
    if let Some(id) = &m.tool_call_id {
        h.update(&[5]);
        h.update(id.as_bytes());
    }
    digest16(h)
}

fn only_reminders(m: &ChatMessage) -> bool {
    match &m.content {
        Some(Content::Text(t)) => is_reminder(t) && m.tool_calls.is_empty(),
        Some(Content::Parts(parts)) => {
            !parts.is_empty()
                && parts
                    .iter()
                    .all(|p| p.text.as_deref().is_some_and(is_reminder))
                && m.tool_calls.is_empty()
        }
        None => false,
    }
}

fn summary_conversation(m: &ChatMessage) -> Option<String> {
    let text = match &m.content {
        Some(Content::Text(t)) => t.as_str(),
        Some(Content::Parts(parts)) => parts
            .iter()
            .find_map(|p| p.text.as_deref().filter(|t| t.contains(SUMMARY_MARKER)))?,
        None => return None,
    };
    let at = text.find(SUMMARY_MARKER)? + SUMMARY_MARKER.len();
    let end = text[at..].find('"')?;
    Some(text[at..at + end].to_string())
}

/// The conversation a `compaction` item's handle names.
pub fn compaction_handle(item: &Map<String, Value>) -> Option<String> {
    let content = item.get("encrypted_content")?.as_str()?;
    let rest = content.strip_prefix(COMPACTION_HANDLE_PREFIX)?;
    let conv = rest.split('|').next()?;
    Some(conv.to_string())
}

fn text_or_parts(v: Option<Value>) -> Result<Option<Content>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(Content::Text(s))),
        Some(Value::Array(parts)) => {
            let mut out = Vec::with_capacity(parts.len());
            for p in parts {
                out.push(part_of(p)?);
            }
            Ok(if out.is_empty() {
                None
            } else {
                Some(Content::Parts(out))
            })
        }
        Some(other) => Err(format!(
            "`content` must be a string or an array, not {other}"
        )),
    }
}

/// A content part, keeping every field but `cache_control` (it moves
/// between requests; the block is the same).
fn part_of(p: Value) -> Result<ContentPart, String> {
    let Value::Object(mut o) = p else {
        return Err("a content part must be an object".into());
    };
    o.remove("cache_control");
    let kind = match o.remove("type") {
        Some(Value::String(s)) => s,
        _ => return Err("a content part has no `type`".into()),
    };
    let text = match o.remove("text") {
        Some(Value::String(s)) => Some(s),
        Some(other) => {
            o.insert("text".into(), other);
            None
        }
        None => None,
    };
    Ok(ContentPart {
        kind,
        text,
        other: o.into_iter().collect::<BTreeMap<_, _>>(),
    })
}

fn finish(kind: ItemKind, mut messages: Vec<ChatMessage>, enc: tokens::Encoding) -> Canon {
    // Injected text beside real content is not a turn of its own.
    if messages.len() > 1 && messages.iter().any(|m| !only_reminders(m)) {
        messages.retain(|m| !only_reminders(m));
    }
    let message_digests: Vec<[u8; 16]> = messages.iter().map(message_digest).collect();
    let mut h = blake3::Hasher::new();
    for d in &message_digests {
        h.update(d);
    }
    let tokens = messages.iter().map(|m| tokens::count_message(enc, m)).sum();
    let summary_of = messages.iter().find_map(summary_conversation);
    let kind = if kind != ItemKind::System
        && !messages.is_empty()
        && messages.iter().all(only_reminders)
    {
        ItemKind::Injected
    } else {
        kind
    };
    Canon {
        kind,
        messages,
        digest: digest16(h),
        message_digests,
        tokens,
        summary_of,
    }
}

/// Canonicalizes one item of a request (or of a response, put in request
/// shape).
pub fn canonicalize(surface: Surface, raw: &str, enc: tokens::Encoding) -> Result<Canon, String> {
    let v: Map<String, Value> =
        serde_json::from_str(raw).map_err(|e| format!("not a JSON object: {e}"))?;
    match surface {
        Surface::Chat => chat_item(v, enc),
        Surface::Messages => anthropic_item(v, enc),
        Surface::Responses => responses_item(v, enc),
    }
}

fn role_of(s: &str) -> Result<(Role, ItemKind), String> {
    Ok(match s {
        "system" | "developer" => (Role::System, ItemKind::System),
        "user" => (Role::User, ItemKind::User),
        "assistant" => (Role::Assistant, ItemKind::Assistant),
        "tool" | "function" => (Role::Tool, ItemKind::ToolResult),
        other => return Err(format!("unknown role {other:?}")),
    })
}

fn string_field(o: &mut Map<String, Value>, key: &str) -> Option<String> {
    match o.remove(key) {
        Some(Value::String(s)) => Some(s),
        _ => None,
    }
}

fn chat_item(mut o: Map<String, Value>, enc: tokens::Encoding) -> Result<Canon, String> {
    let role = string_field(&mut o, "role").ok_or("a message has no `role`")?;
    let (role, kind) = role_of(&role)?;
    let content = text_or_parts(o.remove("content"))?;
    let mut tool_calls = Vec::new();
    if let Some(Value::Array(calls)) = o.remove("tool_calls") {
        for c in calls {
            let call: ToolCall =
                serde_json::from_value(c).map_err(|e| format!("a tool call: {e}"))?;
            tool_calls.push(call);
        }
    }
    let m = ChatMessage {
        role,
        content,
        tool_calls,
        tool_call_id: string_field(&mut o, "tool_call_id"),
        name: if role == Role::Tool {
            None
        } else {
            string_field(&mut o, "name")
        },
    };
    Ok(finish(kind, vec![m], enc))
}

fn anthropic_item(mut o: Map<String, Value>, enc: tokens::Encoding) -> Result<Canon, String> {
    let role = string_field(&mut o, "role").ok_or("a message has no `role`")?;
    let (role, kind) = match role.as_str() {
        "user" => (Role::User, ItemKind::User),
        "assistant" => (Role::Assistant, ItemKind::Assistant),
        other => return Err(format!("role must be user or assistant, not {other:?}")),
    };
    let blocks = match o.remove("content") {
        Some(Value::String(s)) => {
            let m = ChatMessage::text(role, s);
            return Ok(finish(kind, vec![m], enc));
        }
        Some(Value::Array(blocks)) => blocks,
        _ => return Err("`content` must be a string or an array of blocks".into()),
    };
    let mut results = Vec::new();
    let mut parts = Vec::new();
    let mut tool_calls = Vec::new();
    for b in blocks {
        let Value::Object(mut b) = b else {
            return Err("a content block must be an object".into());
        };
        match b.get("type").and_then(Value::as_str) {
            Some("tool_use") | Some("server_tool_use") if role == Role::Assistant => {
                let id = string_field(&mut b, "id").ok_or("a tool_use block has no `id`")?;
                let name = string_field(&mut b, "name").unwrap_or_default();
                let input = b.remove("input").unwrap_or(Value::Object(Map::new()));
                tool_calls.push(ToolCall {
                    id,
                    kind: "function".into(),
                    function: FunctionCall {
                        name,
                        arguments: input.to_string(),
                    },
                });
            }
            Some("tool_result") if role == Role::User => {
                let id = string_field(&mut b, "tool_use_id")
                    .ok_or("a tool_result block has no `tool_use_id`")?;
                let content = text_or_parts(b.remove("content"))?;
                let mut m = ChatMessage {
                    role: Role::Tool,
                    content,
                    tool_calls: Vec::new(),
                    tool_call_id: Some(id),
                    name: None,
                };
                if b.get("is_error") == Some(&Value::Bool(true)) {
                    m.name = Some("error".into());
                }
                results.push(m);
            }
            Some(_) => parts.push(part_of(Value::Object(b))?),
            None => return Err("a content block has no `type`".into()),
        }
    }
    let mut messages = results;
    let item_kind = if messages.is_empty() {
        kind
    } else {
        ItemKind::ToolResult
    };
    if !parts.is_empty() || !tool_calls.is_empty() || messages.is_empty() {
        messages.push(ChatMessage {
            role,
            content: if parts.is_empty() {
                None
            } else {
                Some(Content::Parts(parts))
            },
            tool_calls,
            tool_call_id: None,
            name: None,
        });
    }
    Ok(finish(item_kind, messages, enc))
}

fn responses_item(mut o: Map<String, Value>, enc: tokens::Encoding) -> Result<Canon, String> {
    o.remove("id");
    o.remove("status");
    let kind = o
        .get("type")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| "message".into());
    let assistant_part = |o: Map<String, Value>| -> Result<ChatMessage, String> {
        let part = part_of(Value::Object(o))?;
        Ok(ChatMessage {
            role: Role::Assistant,
            content: Some(Content::Parts(vec![part])),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        })
    };
    match kind.as_str() {
        "message" => {
            let role = string_field(&mut o, "role").ok_or("a message item has no `role`")?;
            let (role, kind) = role_of(&role)?;
            if role == Role::Tool {
                return Err(
                    "a message item's role must be user, assistant, system or developer".into(),
                );
            }
            let content = text_or_parts(o.remove("content"))?;
            Ok(finish(
                kind,
                vec![ChatMessage {
                    role,
                    content,
                    tool_calls: Vec::new(),
                    tool_call_id: None,
                    name: None,
                }],
                enc,
            ))
        }
        "function_call" | "custom_tool_call" => {
            let call_id = string_field(&mut o, "call_id").ok_or("a call item has no `call_id`")?;
            let name = string_field(&mut o, "name").unwrap_or_default();
            let arguments = match o.remove("arguments").or_else(|| o.remove("input")) {
                Some(Value::String(s)) => s,
                Some(other) => other.to_string(),
                None => String::new(),
            };
            Ok(finish(
                ItemKind::Assistant,
                vec![ChatMessage {
                    role: Role::Assistant,
                    content: None,
                    tool_calls: vec![ToolCall {
                        id: call_id,
                        kind: if kind == "function_call" {
                            "function".into()
                        } else {
                            "custom".into()
                        },
                        function: FunctionCall { name, arguments },
                    }],
                    tool_call_id: None,
                    name: None,
                }],
                enc,
            ))
        }
        "function_call_output"
        | "custom_tool_call_output"
        | "local_shell_call_output"
        | "mcp_call_output" => {
            let call_id =
                string_field(&mut o, "call_id").ok_or("an output item has no `call_id`")?;
            let content = text_or_parts(o.remove("output"))?;
            Ok(finish(
                ItemKind::ToolResult,
                vec![ChatMessage {
                    role: Role::Tool,
                    content,
                    tool_calls: Vec::new(),
                    tool_call_id: Some(call_id),
                    name: None,
                }],
                enc,
            ))
        }
        "compaction_trigger" => Ok(finish(ItemKind::CompactionTrigger, Vec::new(), enc)),
        "compaction" | "compaction_summary" => {
            let summary_of = compaction_handle(&o);
            let mut c = finish(ItemKind::Assistant, vec![assistant_part(o)?], enc);
            c.summary_of = summary_of;
            Ok(c)
        }
        _ => Ok(finish(ItemKind::Assistant, vec![assistant_part(o)?], enc)),
    }
}

/// A Responses `input` string as its one item.
pub fn input_text_item(text: &str) -> String {
    serde_json::json!({"type": "message", "role": "user", "content": text}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENC: tokens::Encoding = tokens::Encoding::O200kBase;

    #[test]
    fn an_assistant_reply_and_its_echo_have_one_identity() {
        let reply = r#"{"role":"assistant","content":"Hi","refusal":null,"annotations":[],"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]}"#;
        let echo = r#"{"tool_calls":[{"function":{"arguments":"{}","name":"f"},"id":"c1","type":"function"}],"role":"assistant","content":"Hi"}"#;
        let a = canonicalize(Surface::Chat, reply, ENC).unwrap();
        let b = canonicalize(Surface::Chat, echo, ENC).unwrap();
        assert_eq!(a.digest, b.digest);
    }

    #[test]
    fn cache_control_and_reminders_do_not_change_identity() {
        let first = r#"{"role":"user","content":[{"type":"text","text":"fix it","cache_control":{"type":"ephemeral"}}]}"#;
        let later = r#"{"role":"user","content":[{"type":"text","text":"<system-reminder>files changed</system-reminder>"},{"type":"text","text":"fix it"}]}"#;
        let a = canonicalize(Surface::Messages, first, ENC).unwrap();
        let b = canonicalize(Surface::Messages, later, ENC).unwrap();
        assert_eq!(a.digest, b.digest);
        let only = r#"{"role":"user","content":"<system-reminder>todo list</system-reminder>"}"#;
        assert_eq!(
            canonicalize(Surface::Messages, only, ENC).unwrap().kind,
            ItemKind::Injected
        );
    }

    #[test]
    fn an_assistant_turn_echoed_without_its_thinking_is_the_same_turn() {
        let reply = r#"{"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"s"},{"type":"text","text":"done"}]}"#;
        let echo = r#"{"role":"assistant","content":[{"type":"text","text":"done"}]}"#;
        let a = canonicalize(Surface::Messages, reply, ENC).unwrap();
        let b = canonicalize(Surface::Messages, echo, ENC).unwrap();
        assert_eq!(a.digest, b.digest);
        assert_eq!(
            a.messages[0].content,
            canonicalize(Surface::Messages, reply, ENC)
                .unwrap()
                .messages[0]
                .content
        );
    }

    #[test]
    fn anthropic_tool_results_become_tool_turns() {
        let item = r#"{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"ok"},{"type":"tool_result","tool_use_id":"t2","content":[{"type":"text","text":"done"}]}]}"#;
        let c = canonicalize(Surface::Messages, item, ENC).unwrap();
        assert_eq!(c.kind, ItemKind::ToolResult);
        assert_eq!(c.messages.len(), 2);
        assert_eq!(c.messages[1].tool_call_id.as_deref(), Some("t2"));
    }

    #[test]
    fn responses_items_drop_ids_and_keep_reasoning_opaque() {
        let out = r#"{"id":"rs_1","type":"reasoning","summary":[],"encrypted_content":"gAAA"}"#;
        let echo = r#"{"type":"reasoning","summary":[],"encrypted_content":"gAAA"}"#;
        let a = canonicalize(Surface::Responses, out, ENC).unwrap();
        let b = canonicalize(Surface::Responses, echo, ENC).unwrap();
        assert_eq!(a.digest, b.digest);
        let other = r#"{"type":"reasoning","summary":[],"encrypted_content":"gBBB"}"#;
        assert_ne!(
            a.digest,
            canonicalize(Surface::Responses, other, ENC).unwrap().digest
        );
    }

    #[test]
    fn a_body_is_parsed_without_touching_the_rest() {
        let body =
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"a"}],"tools":[]}"#;
        let p = parse(Surface::Chat, body).unwrap();
        assert!(p.stream);
        assert_eq!(p.items.len(), 1);
        let span = p.items_span.unwrap();
        assert_eq!(&body[span], br#"[{"role":"user","content":"a"}]"#);
        assert!(matches!(
            parse(Surface::Chat, br#"{"model":"m"}"#),
            Err(ParseError::NoItems("messages"))
        ));
    }
}
