//! From contextfold's state to the request the model receives.
//!
//! Past the budget the body is rebuilt as `[the client's head system items,
//! byte-identical] [the summary block] [the client's items from the fresh
//! tail on, byte-identical]`; every byte outside the items' array (system,
//! tools, settings) is the client's. The block is the conversation's
//! [`SummaryBlock`]: it changes only when a sweep changes the summaries in
//! context, so between two compactions every request begins with the same
//! bytes and the provider's prompt cache keeps hitting.
//!
//! Where the tail starts is found by identity, not position: the first
//! turns in context after the summaries (`tail_digests`) are looked up in
//! the request's items. The start then moves back, never forward, until
//! every tool result in the tail has its call there too (and a Responses
//! call its reasoning item), so a tool pair is never split; a call still in
//! flight is in the tail by construction.

use crate::core::message::{Content, Role};
use crate::gateway::store::SummaryBlock;
use crate::gateway::surface::{Canon, ItemKind, Surface};
use serde_json::value::RawValue;
use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

/// Leading items the client keeps ahead of the block.
pub fn head_len(surface: Surface, items: &[Arc<Canon>]) -> usize {
    match surface {
        Surface::Messages => 0,
        Surface::Chat | Surface::Responses => items
            .iter()
            .take_while(|c| c.kind == ItemKind::System)
            .count(),
    }
}

fn is_reasoning(c: &Canon) -> bool {
    c.messages.len() == 1
        && c.messages[0].role == Role::Assistant
        && c.messages[0].tool_calls.is_empty()
        && matches!(&c.messages[0].content, Some(Content::Parts(p)) if p.len() == 1 && p[0].kind == "reasoning")
}

/// Where the verbatim tail starts in `items`, or `None` when the request
/// does not hold the turns that follow the block.
pub fn tail_start(items: &[Arc<Canon>], head: usize, block: &SummaryBlock) -> Option<usize> {
    let first = *block.tail_digests.first()?;
    // (item, message) of every message from the head on.
    let flat: Vec<(usize, [u8; 16])> = items
        .iter()
        .enumerate()
        .skip(head)
        .flat_map(|(i, c)| c.message_digests.iter().map(move |d| (i, *d)))
        .collect();
    let mut start = None;
    for (k, (i, d)) in flat.iter().enumerate() {
        if *d != first {
            continue;
        }
        let follows = block
            .tail_digests
            .iter()
            .skip(1)
            .zip(flat.iter().skip(k + 1))
            .all(|(want, (_, got))| want == got);
        if follows {
            start = Some(*i);
            break;
        }
    }
    let mut start = start?;
    // Never split a tool pair: every result's call is in the tail.
    loop {
        let tail = &items[start..];
        let calls: HashSet<&str> = tail
            .iter()
            .flat_map(|c| c.messages.iter())
            .flat_map(|m| m.tool_calls.iter().map(|t| t.id.as_str()))
            .collect();
        let orphan = tail
            .iter()
            .flat_map(|c| c.messages.iter())
            .filter_map(|m| m.tool_call_id.as_deref())
            .any(|id| !calls.contains(id));
        let reasoning_before = start > head && is_reasoning(&items[start - 1]);
        if !orphan && !reasoning_before {
            break;
        }
        if start <= head {
            return None;
        }
        start -= 1;
    }
    (start > head).then_some(start)
}

/// The rebuilt body (module doc).
pub fn rebuild(
    body: &[u8],
    span: &Range<usize>,
    items: &[&RawValue],
    head: usize,
    block_item: &str,
    tail_start: usize,
) -> Vec<u8> {
    let tail_bytes: usize = items[tail_start..].iter().map(|r| r.get().len() + 1).sum();
    let mut out = Vec::with_capacity(
        span.start + block_item.len() + tail_bytes + (body.len() - span.end) + 64,
    );
    out.extend_from_slice(&body[..span.start]);
    out.push(b'[');
    for r in &items[..head] {
        out.extend_from_slice(r.get().as_bytes());
        out.push(b',');
    }
    out.extend_from_slice(block_item.as_bytes());
    for r in &items[tail_start..] {
        out.push(b',');
        out.extend_from_slice(r.get().as_bytes());
    }
    out.push(b']');
    out.extend_from_slice(&body[span.end..]);
    out
}

/// The length of what precedes the tail in a rebuilt body: the bytes the
/// provider's prompt cache sees as the stable prefix.
pub fn prefix_len(
    span: &Range<usize>,
    items: &[&RawValue],
    head: usize,
    block_item: &str,
) -> usize {
    span.start
        + 1
        + items[..head]
            .iter()
            .map(|r| r.get().len() + 1)
            .sum::<usize>()
        + block_item.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::ChatMessage;
    use crate::core::tokens::Encoding;
    use crate::gateway::surface::canonicalize;

    fn canon(v: serde_json::Value) -> Arc<Canon> {
        Arc::new(canonicalize(Surface::Chat, &v.to_string(), Encoding::O200kBase).unwrap())
    }

    #[test]
    fn the_tail_never_starts_at_a_tool_result() {
        let call = serde_json::json!({"role":"assistant","content":null,"tool_calls":[
            {"id":"a","type":"function","function":{"name":"f","arguments":"{}"}},
            {"id":"b","type":"function","function":{"name":"f","arguments":"{}"}}]});
        let items = vec![
            canon(serde_json::json!({"role":"system","content":"s"})),
            canon(serde_json::json!({"role":"user","content":"u1"})),
            canon(call),
            canon(serde_json::json!({"role":"tool","tool_call_id":"a","content":"ra"})),
            canon(serde_json::json!({"role":"tool","tool_call_id":"b","content":"rb"})),
            canon(serde_json::json!({"role":"user","content":"u2"})),
        ];
        let tail: Vec<ChatMessage> = items[4].messages.clone();
        let block = SummaryBlock::new("c", vec!["s1".into()], &["x".into()], &tail);
        assert_eq!(tail_start(&items, 1, &block), Some(2));
    }

    #[test]
    fn the_rebuilt_body_keeps_every_byte_outside_the_items() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"old"},{"role":"user","content":"new"}],"tools":[1]}"#;
        let p = crate::gateway::surface::parse(Surface::Chat, body).unwrap();
        let span = p.items_span.clone().unwrap();
        let out = rebuild(
            body,
            &span,
            &p.items,
            1,
            r#"{"role":"user","content":"SUM"}"#,
            2,
        );
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"SUM"},{"role":"user","content":"new"}],"tools":[1]}"#
        );
    }
}
