//! Compaction asked of the gateway, answered from contextfold.
//!
//! Three ways a client asks: a Responses request whose last item is
//! `{"type":"compaction_trigger"}` (Codex with the built-in provider) gets
//! exactly one `compaction` output item; `POST /v1/responses/compact`
//! gets the same item in its JSON answer; a request Codex marks as a
//! compaction (`x-codex-turn-metadata` `request_kind: "compaction"`, a
//! custom provider) gets the summary as the assistant's text. None of them
//! calls the upstream.
//!
//! The summary is the conversation's block (its summaries in context, the
//! same bytes every replica renders) followed by a deterministic summary of
//! the items after what the block covers (`core::fallback_summary`), so it
//! covers the whole history at once and never waits on a model. It carries
//! the block's marker, and a `compaction` item's `encrypted_content` is a
//! handle holding the conversation and the text itself: Codex returns it
//! byte-exact, the gateway expands it into a message before the upstream
//! sees it (any upstream model, any replica, after any restart), and
//! everything before it is known to be stored.
//!
//! Codex compacts when the usage a response reports reaches its limit; the
//! gateway remembers the usage that made it compact and from then on sends
//! the conversation upstream under 80% of it (the summary and the items
//! after it, when the client's own history is larger), so the next usage
//! is below the limit and Codex does not compact on every turn.

use crate::core::event::SummaryKind;
use crate::core::fallback_summary;
use crate::core::message::Role;
use crate::core::summary::{IdentifierPolicy, SourceItem, SummaryRequest};
use crate::gateway::store::SummaryBlock;
use crate::gateway::surface::{Canon, ItemKind, COMPACTION_HANDLE_PREFIX, SUMMARY_MARKER};
use base64::Engine as _;
use serde_json::{json, Value};
use std::sync::Arc;

/// The first words of Codex's compaction prompt (custom providers).
pub const CODEX_CHECKPOINT_PROMPT: &str = "You are performing a CONTEXT CHECKPOINT COMPACTION";

/// Words of Claude Code's compaction prompt (its `/compact` and its
/// auto-compaction send the history with it as the last user turn).
pub const CLAUDE_CODE_COMPACT_PROMPT: &str =
    "Your task is to create a detailed summary of the conversation so far";

/// Whether a user turn's text is a harness's compaction prompt (not a
/// turn of the conversation).
pub fn is_harness_prompt(text: &str) -> bool {
    text.starts_with(CODEX_CHECKPOINT_PROMPT) || text.contains(CLAUDE_CODE_COMPACT_PROMPT)
}

/// Whether a Messages request is Claude Code asking for a compaction.
pub fn is_claude_code_compaction(items: &[Arc<Canon>]) -> bool {
    items.last().is_some_and(|c| {
        c.kind == ItemKind::User
            && c.messages
                .iter()
                .any(|m| m.text_content().contains(CLAUDE_CODE_COMPACT_PROMPT))
    })
}

/// An Anthropic Messages answer holding `text` (SSE when `stream`).
pub fn messages_answer(
    id: &str,
    model: &str,
    text: &str,
    input_tokens: u64,
    stream: bool,
) -> (Vec<u8>, &'static str) {
    let usage = json!({"input_tokens": input_tokens, "output_tokens": 0});
    if !stream {
        let v = json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn", "stop_sequence": null, "usage": usage,
        });
        return (v.to_string().into_bytes(), "application/json");
    }
    let events = [
        (
            "message_start",
            json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": usage}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 0}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ];
    (sse(&events), "text/event-stream")
}

/// Whether `x-codex-turn-metadata` marks a compaction.
pub fn is_codex_compaction(turn_metadata: Option<&str>) -> bool {
    turn_metadata
        .and_then(|t| serde_json::from_str::<Value>(t).ok())
        .and_then(|v| {
            v.get("request_kind")
                .and_then(Value::as_str)
                .map(|k| k == "compaction")
        })
        .unwrap_or(false)
}

/// The summary of the whole history a compaction answers with.
pub fn summary_text(
    conversation: &str,
    items: &[Arc<Canon>],
    block: Option<&SummaryBlock>,
    tail_start: Option<usize>,
) -> String {
    let from = match (block, tail_start) {
        (Some(_), Some(t)) => t,
        _ => 0,
    };
    let sources: Vec<SourceItem> = items[from.min(items.len())..]
        .iter()
        .filter(|c| {
            matches!(
                c.kind,
                ItemKind::User | ItemKind::Assistant | ItemKind::ToolResult
            )
        })
        .filter(|c| c.summary_of.is_none())
        .flat_map(|c| c.messages.iter())
        .filter(|m| !is_harness_prompt(&m.text_content()))
        .enumerate()
        .map(|(i, m)| SourceItem {
            label: format!("turn {}", i + 1),
            role: Some(m.role),
            tool: m.tool_calls.first().map(|c| c.function.name.clone()),
            text: if m.role == Role::Assistant && !m.tool_calls.is_empty() {
                format!(
                    "{}\n{}",
                    m.text_content(),
                    m.tool_calls
                        .iter()
                        .map(|c| format!("{}({})", c.function.name, c.function.arguments))
                        .collect::<Vec<_>>()
                        .join("\n")
                )
            } else {
                m.text_content()
            },
            tokens: crate::core::tokens::count_message(crate::core::tokens::Encoding::O200kBase, m),
            time: 0,
            ..SourceItem::default()
        })
        .collect();
    let recent = if sources.is_empty() {
        String::new()
    } else {
        let source_tokens: u64 = sources.iter().map(|s| s.tokens).sum();
        fallback_summary::summarize(&SummaryRequest {
            conversation: conversation.to_string(),
            kind: SummaryKind::Leaf,
            depth: 0,
            target_tokens: (source_tokens / 4).clamp(200, 3000),
            sources,
            previous_summary: None,
            instructions: None,
            custom_instructions: None,
            identifier_policy: IdentifierPolicy::Strict,
            aggressive: false,
        })
        .content
    };
    match block {
        Some(b) if recent.is_empty() => b.text.clone(),
        Some(b) => format!(
            "{}\n\n<recent_turns_summary>\n{recent}\n</recent_turns_summary>",
            b.text
        ),
        None => format!(
            "{SUMMARY_MARKER}{conversation}\">\nThe earlier part of this conversation is summarized below (contextfold keeps every turn).\n\n{recent}\n</contextfold_summary>"
        ),
    }
}

/// A `compaction` item's handle: the conversation and the text.
pub fn handle(conversation: &str, text: &str) -> String {
    format!(
        "{COMPACTION_HANDLE_PREFIX}{conversation}|{}",
        base64::engine::general_purpose::STANDARD.encode(text)
    )
}

/// The text a handle holds.
pub fn handle_text(encrypted_content: &str) -> Option<String> {
    let rest = encrypted_content.strip_prefix(COMPACTION_HANDLE_PREFIX)?;
    let (_, b64) = rest.split_once('|')?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    String::from_utf8(bytes).ok()
}

/// A gateway `compaction` item as the message the upstream receives.
pub fn expanded(raw_item: &str) -> Option<String> {
    let v: Value = serde_json::from_str(raw_item).ok()?;
    let kind = v.get("type")?.as_str()?;
    if kind != "compaction" && kind != "compaction_summary" {
        return None;
    }
    let text = handle_text(v.get("encrypted_content")?.as_str()?)?;
    Some(
        json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
            .to_string(),
    )
}

fn usage(input: u64) -> Value {
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input,
    })
}

fn response_object(id: &str, model: &str, output: Vec<Value>, input_tokens: u64) -> Value {
    json!({
        "id": id,
        "object": "response",
        "created_at": 0,
        "status": "completed",
        "model": model,
        "output": output,
        "usage": usage(input_tokens),
    })
}

fn sse(events: &[(&str, Value)]) -> Vec<u8> {
    let mut out = String::new();
    for (name, data) in events {
        out.push_str("event: ");
        out.push_str(name);
        out.push_str("\ndata: ");
        out.push_str(&data.to_string());
        out.push_str("\n\n");
    }
    out.into_bytes()
}

/// A Responses answer holding `output` (SSE when `stream`); the body and
/// its content type.
pub fn responses_answer(
    id: &str,
    model: &str,
    output: Vec<Value>,
    input_tokens: u64,
    stream: bool,
) -> (Vec<u8>, &'static str) {
    let response = response_object(id, model, output.clone(), input_tokens);
    if !stream {
        return (response.to_string().into_bytes(), "application/json");
    }
    let mut created = response.clone();
    created["status"] = Value::from("in_progress");
    created["output"] = Value::Array(Vec::new());
    let mut events = vec![(
        "response.created",
        json!({"type": "response.created", "sequence_number": 0, "response": created}),
    )];
    let mut seq = 1;
    for (i, item) in output.iter().enumerate() {
        events.push((
            "response.output_item.added",
            json!({"type": "response.output_item.added", "sequence_number": seq, "output_index": i, "item": item}),
        ));
        seq += 1;
        if let Some(text) = item.pointer("/content/0/text").and_then(Value::as_str) {
            events.push((
                "response.output_text.delta",
                json!({"type": "response.output_text.delta", "sequence_number": seq, "output_index": i,
                       "item_id": item.get("id"), "content_index": 0, "delta": text}),
            ));
            seq += 1;
        }
        events.push((
            "response.output_item.done",
            json!({"type": "response.output_item.done", "sequence_number": seq, "output_index": i, "item": item}),
        ));
        seq += 1;
    }
    events.push((
        "response.completed",
        json!({"type": "response.completed", "sequence_number": seq, "response": response}),
    ));
    (sse(&events), "text/event-stream")
}

/// The one `compaction` output item.
pub fn compaction_item(id: &str, conversation: &str, text: &str) -> Value {
    json!({"type": "compaction", "id": id, "encrypted_content": handle(conversation, text)})
}

/// The assistant message answering a checkpoint compaction.
pub fn checkpoint_item(id: &str, text: &str) -> Value {
    json!({
        "type": "message", "id": id, "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    })
}

/// `POST /v1/responses/compact`'s answer.
pub fn compact_endpoint_answer(
    id: &str,
    conversation: &str,
    text: &str,
    input_tokens: u64,
) -> Vec<u8> {
    json!({
        "id": id,
        "object": "response.compaction",
        "created_at": 0,
        "output": [compaction_item(&format!("cmp_{id}"), conversation, text)],
        "usage": usage(input_tokens),
    })
    .to_string()
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_holds_its_text_and_expands_to_a_message() {
        let item = compaction_item(
            "c1",
            "conv",
            "<contextfold_summary conversation=\"conv\">x</contextfold_summary>",
        );
        let raw = item.to_string();
        let m: Value = serde_json::from_str(&expanded(&raw).unwrap()).unwrap();
        assert_eq!(m["role"], "user");
        assert!(m["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("x</contextfold_summary>"));
        let parsed: serde_json::Map<String, Value> = serde_json::from_str(&raw).unwrap();
        assert_eq!(
            crate::gateway::surface::compaction_handle(&parsed).as_deref(),
            Some("conv")
        );
    }

    #[test]
    fn codex_metadata_marks_compactions() {
        assert!(is_codex_compaction(Some(
            r#"{"turn_id":"t","request_kind":"compaction"}"#
        )));
        assert!(!is_codex_compaction(Some(
            r#"{"turn_id":"t","request_kind":"turn"}"#
        )));
        assert!(!is_codex_compaction(None));
    }
}
