//! The response, passed through as it arrives and copied aside: when it
//! ends, the copy becomes the turn that is stored.
//!
//! [`Tee`] forwards every chunk the moment the upstream yields it (no
//! buffering on the way to the client) and keeps a copy up to a bound.
//! When the stream ends, the copy is read back into items in request shape
//! ([`completed`]): the SSE events of each surface are folded into the
//! message they describe (Chat deltas and tool-call fragments by index;
//! Anthropic content blocks with text, JSON, thinking and signature deltas;
//! Responses `response.completed` or, cut short, the items already done).
//! A client that goes away mid-stream drops the tee: what arrived is stored
//! as a partial turn marked `aborted`.

use crate::core::event::ProviderUsage;
use crate::gateway::surface::Surface;
use bytes::Bytes;
use futures::Stream;
use serde_json::{Map, Value};
use std::pin::Pin;
use std::task::{Context, Poll};

/// What the copy is handed to when the stream ends: the bytes, and
/// whether the stream ended (false: cut, or the client left).
pub type OnDone = Box<dyn FnOnce(Vec<u8>, bool) + Send>;

pub struct Tee<S> {
    inner: S,
    copy: Vec<u8>,
    limit: usize,
    on_done: Option<OnDone>,
}

impl<S> Tee<S> {
    pub fn new(inner: S, limit: usize, on_done: OnDone) -> Tee<S> {
        Tee {
            inner,
            copy: Vec::new(),
            limit,
            on_done: Some(on_done),
        }
    }

    fn finish(&mut self, complete: bool) {
        if let Some(f) = self.on_done.take() {
            f(std::mem::take(&mut self.copy), complete);
        }
    }
}

impl<S, E> Stream for Tee<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
{
    type Item = Result<Bytes, E>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match Pin::new(&mut self.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                if self.copy.len() + chunk.len() <= self.limit {
                    self.copy.extend_from_slice(&chunk);
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => {
                self.finish(false);
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                self.finish(true);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S> Drop for Tee<S> {
    fn drop(&mut self) {
        self.finish(false);
    }
}

/// A response read back: its items in request shape.
#[derive(Debug, Default, Clone)]
pub struct Completed {
    /// JSON objects, each one item as the client will send it back.
    pub items: Vec<String>,
    pub usage: Option<ProviderUsage>,
    pub response_id: Option<String>,
    pub model: Option<String>,
}

/// Reads a whole response (SSE when `stream`) back into items.
pub fn completed(surface: Surface, stream: bool, bytes: &[u8]) -> Completed {
    if !stream {
        let Ok(v) = serde_json::from_slice::<Value>(bytes) else {
            return Completed::default();
        };
        return match surface {
            Surface::Chat => chat_final(&v),
            Surface::Messages => anthropic_final(&v),
            Surface::Responses => responses_final(&v),
        };
    }
    let events = sse_events(bytes);
    match surface {
        Surface::Chat => chat_stream(&events),
        Surface::Messages => anthropic_stream(&events),
        Surface::Responses => responses_stream(&events),
    }
}

/// `(event name, data)` of every SSE event whose data is JSON.
pub fn sse_events(bytes: &[u8]) -> Vec<(String, Value)> {
    let text = String::from_utf8_lossy(bytes);
    let mut out = Vec::new();
    for block in text.split("\n\n").flat_map(|b| b.split("\r\n\r\n")) {
        let mut event = String::new();
        let mut data = String::new();
        for line in block.lines() {
            if let Some(rest) = line.strip_prefix("event:") {
                event = rest.trim().to_string();
            } else if let Some(rest) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(rest.strip_prefix(' ').unwrap_or(rest));
            }
        }
        if data.is_empty() || data == "[DONE]" {
            continue;
        }
        if let Ok(v) = serde_json::from_str::<Value>(&data) {
            out.push((event, v));
        }
    }
    out
}

fn u(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

fn openai_usage(v: &Value) -> Option<ProviderUsage> {
    let usage = v.get("usage")?;
    if usage.is_null() {
        return None;
    }
    let prompt = u(usage, "prompt_tokens").or_else(|| u(usage, "input_tokens"));
    let completion = u(usage, "completion_tokens").or_else(|| u(usage, "output_tokens"));
    Some(ProviderUsage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: u(usage, "total_tokens").or(match (prompt, completion) {
            (Some(p), Some(c)) => Some(p + c),
            _ => None,
        }),
    })
}

fn anthropic_usage(input: Option<u64>, output: Option<u64>) -> Option<ProviderUsage> {
    if input.is_none() && output.is_none() {
        return None;
    }
    Some(ProviderUsage {
        prompt_tokens: input,
        completion_tokens: output,
        total_tokens: Some(input.unwrap_or(0) + output.unwrap_or(0)),
    })
}

fn str_of(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_string)
}

fn chat_final(v: &Value) -> Completed {
    let items = v
        .pointer("/choices/0/message")
        .map(|m| vec![m.to_string()])
        .unwrap_or_default();
    Completed {
        items,
        usage: openai_usage(v),
        response_id: str_of(v, "id"),
        model: str_of(v, "model"),
    }
}

fn chat_stream(events: &[(String, Value)]) -> Completed {
    let mut content = String::new();
    let mut any_content = false;
    let mut calls: Vec<Map<String, Value>> = Vec::new();
    let mut out = Completed::default();
    for (_, v) in events {
        if out.response_id.is_none() {
            out.response_id = str_of(v, "id");
            out.model = str_of(v, "model");
        }
        if let Some(usage) = openai_usage(v) {
            out.usage = Some(usage);
        }
        let Some(delta) = v.pointer("/choices/0/delta") else {
            continue;
        };
        if let Some(t) = delta.get("content").and_then(Value::as_str) {
            content.push_str(t);
            any_content = true;
        }
        if let Some(Value::Array(parts)) = delta.get("tool_calls") {
            for p in parts {
                let index = u(p, "index").unwrap_or(calls.len() as u64) as usize;
                while calls.len() <= index {
                    let mut call = Map::new();
                    call.insert("id".into(), Value::from(""));
                    call.insert("type".into(), Value::from("function"));
                    call.insert(
                        "function".into(),
                        serde_json::json!({"name": "", "arguments": ""}),
                    );
                    calls.push(call);
                }
                let call = &mut calls[index];
                if let Some(id) = p.get("id").and_then(Value::as_str) {
                    call.insert("id".into(), Value::from(id));
                }
                if let Some(f) = p.get("function") {
                    if let Some(Value::Object(func)) = call.get_mut("function") {
                        for key in ["name", "arguments"] {
                            if let Some(piece) = f.get(key).and_then(Value::as_str) {
                                let prev = func.get(key).and_then(Value::as_str).unwrap_or("");
                                let joined = format!("{prev}{piece}");
                                func.insert(key.into(), Value::from(joined));
                            }
                        }
                    }
                }
            }
        }
    }
    if !any_content && calls.is_empty() {
        return out;
    }
    let mut msg = Map::new();
    msg.insert("role".into(), Value::from("assistant"));
    msg.insert(
        "content".into(),
        if any_content {
            Value::from(content)
        } else {
            Value::Null
        },
    );
    if !calls.is_empty() {
        msg.insert(
            "tool_calls".into(),
            Value::Array(calls.into_iter().map(Value::Object).collect()),
        );
    }
    out.items.push(Value::Object(msg).to_string());
    out
}

fn anthropic_final(v: &Value) -> Completed {
    let mut out = Completed {
        response_id: str_of(v, "id"),
        model: str_of(v, "model"),
        ..Completed::default()
    };
    if let Some(content) = v.get("content") {
        out.items
            .push(serde_json::json!({"role": "assistant", "content": content}).to_string());
    }
    let usage = v.get("usage");
    out.usage = anthropic_usage(
        usage.and_then(|x| u(x, "input_tokens")),
        usage.and_then(|x| u(x, "output_tokens")),
    );
    out
}

fn anthropic_stream(events: &[(String, Value)]) -> Completed {
    let mut out = Completed::default();
    let mut blocks: Vec<Map<String, Value>> = Vec::new();
    let mut json_parts: Vec<String> = Vec::new();
    let (mut input, mut output) = (None, None);
    for (_, v) in events {
        match v.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                if let Some(m) = v.get("message") {
                    out.response_id = str_of(m, "id");
                    out.model = str_of(m, "model");
                    if let Some(usage) = m.get("usage") {
                        input = u(usage, "input_tokens");
                        output = u(usage, "output_tokens").or(output);
                    }
                }
            }
            Some("content_block_start") => {
                let index = u(v, "index").unwrap_or(blocks.len() as u64) as usize;
                while blocks.len() <= index {
                    blocks.push(Map::new());
                    json_parts.push(String::new());
                }
                if let Some(Value::Object(b)) = v.get("content_block") {
                    blocks[index] = b.clone();
                }
            }
            Some("content_block_delta") => {
                let index = u(v, "index").unwrap_or(0) as usize;
                let (Some(block), Some(delta)) = (blocks.get_mut(index), v.get("delta")) else {
                    continue;
                };
                let append = |block: &mut Map<String, Value>, key: &str, piece: &str| {
                    let prev = block.get(key).and_then(Value::as_str).unwrap_or("");
                    let joined = format!("{prev}{piece}");
                    block.insert(key.into(), Value::from(joined));
                };
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => append(
                        block,
                        "text",
                        delta.get("text").and_then(Value::as_str).unwrap_or(""),
                    ),
                    Some("thinking_delta") => append(
                        block,
                        "thinking",
                        delta.get("thinking").and_then(Value::as_str).unwrap_or(""),
                    ),
                    Some("signature_delta") => append(
                        block,
                        "signature",
                        delta.get("signature").and_then(Value::as_str).unwrap_or(""),
                    ),
                    Some("input_json_delta") => {
                        if let Some(p) = delta.get("partial_json").and_then(Value::as_str) {
                            json_parts[index].push_str(p);
                        }
                    }
                    _ => {}
                }
            }
            Some("message_delta") => {
                if let Some(usage) = v.get("usage") {
                    output = u(usage, "output_tokens").or(output);
                    input = u(usage, "input_tokens").or(input);
                }
            }
            _ => {}
        }
    }
    for (block, json) in blocks.iter_mut().zip(&json_parts) {
        let is_tool = matches!(
            block.get("type").and_then(Value::as_str),
            Some("tool_use") | Some("server_tool_use")
        );
        if is_tool && !json.is_empty() {
            let input = serde_json::from_str::<Value>(json).unwrap_or(Value::from(json.as_str()));
            block.insert("input".into(), input);
        }
    }
    if !blocks.is_empty() {
        let content: Vec<Value> = blocks.into_iter().map(Value::Object).collect();
        out.items
            .push(serde_json::json!({"role": "assistant", "content": content}).to_string());
    }
    out.usage = anthropic_usage(input, output);
    out
}

fn responses_final(v: &Value) -> Completed {
    let items = match v.get("output") {
        Some(Value::Array(items)) => items.iter().map(Value::to_string).collect(),
        _ => Vec::new(),
    };
    Completed {
        items,
        usage: openai_usage(v),
        response_id: str_of(v, "id"),
        model: str_of(v, "model"),
    }
}

fn responses_stream(events: &[(String, Value)]) -> Completed {
    let mut done_items = Vec::new();
    for (name, v) in events {
        let kind = v.get("type").and_then(Value::as_str).unwrap_or(name);
        match kind {
            "response.completed" | "response.incomplete" => {
                if let Some(r) = v.get("response") {
                    let mut c = responses_final(r);
                    if c.items.is_empty() {
                        c.items = done_items;
                    }
                    return c;
                }
            }
            "response.output_item.done" => {
                if let Some(item) = v.get("item") {
                    done_items.push(item.to_string());
                }
            }
            _ => {}
        }
    }
    Completed {
        items: done_items,
        ..Completed::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_deltas_and_parallel_tool_calls_fold_into_one_message() {
        let sse = concat!(
            "data: {\"id\":\"c1\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"index\":0,\"id\":\"a\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"\"}}]}}]}\n\n",
            "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"b\",\"type\":\"function\",\"function\":{\"name\":\"g\",\"arguments\":\"{\\\"x\\\"\"}}]}}]}\n\n",
            "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"function\":{\"arguments\":\":1}\"}}]}}]}\n\n",
            "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n",
            "data: [DONE]\n\n"
        );
        let c = completed(Surface::Chat, true, sse.as_bytes());
        assert_eq!(c.items.len(), 1);
        let m: Value = serde_json::from_str(&c.items[0]).unwrap();
        assert_eq!(m["tool_calls"][1]["function"]["arguments"], "{\"x\":1}");
        assert_eq!(c.usage.unwrap().total_tokens, Some(7));
    }

    #[test]
    fn anthropic_blocks_keep_thinking_signatures_and_tool_input() {
        let sse = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"c\",\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hmm\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"SIG\"}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"t1\",\"name\":\"ls\",\"input\":{}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"p\\\":\\\"/\\\"}\"}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\"},\"usage\":{\"output_tokens\":9}}\n\n",
        );
        let c = completed(Surface::Messages, true, sse.as_bytes());
        let m: Value = serde_json::from_str(&c.items[0]).unwrap();
        assert_eq!(m["content"][0]["signature"], "SIG");
        assert_eq!(m["content"][1]["input"]["p"], "/");
        assert_eq!(c.usage.unwrap().completion_tokens, Some(9));
    }
}
