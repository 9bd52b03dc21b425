//! The gateway's tests: a scripted upstream provider on loopback (the three
//! surfaces, streaming or not, tool calls, thinking, reasoning, errors),
//! the `contextfold gateway` process in front of it, and the official
//! Python SDKs as clients (`scripts/install-test-gateway.sh` puts them in
//! `.venv-gateway`; without them a test says why it skips, unless
//! `CONTEXTFOLD_REQUIRE_LLM_SERVERS` is set).

#![allow(dead_code)]

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

include!("free_port.rs");

/// One request the upstream received.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Received {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// How the upstream behaves.
#[derive(Debug, Clone, Default)]
pub struct Behaviour {
    /// Answer a context-overflow 400 when the body is larger than this.
    pub overflow_over_bytes: Option<usize>,
    /// Pause between streamed events.
    pub chunk_delay: Duration,
    /// Pause before answering at all.
    pub delay: Duration,
    /// Chat answers to give, in order (a transcript replayed): each is the
    /// assistant message of the next completion.
    pub script: Option<Arc<Mutex<std::collections::VecDeque<Value>>>>,
    /// Requests whose last user text holds this are answered after
    /// `slow_delay`.
    pub slow_marker: Option<String>,
    pub slow_delay: Duration,
}

struct Inner {
    received: Mutex<Vec<Received>>,
    count: AtomicU64,
    behaviour: Mutex<Behaviour>,
}

/// A scripted upstream provider (module doc).
pub struct Upstream {
    pub base: String,
    inner: Arc<Inner>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream {
    pub async fn start(behaviour: Behaviour) -> Upstream {
        let inner = Arc::new(Inner {
            received: Mutex::new(Vec::new()),
            count: AtomicU64::new(0),
            behaviour: Mutex::new(behaviour),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let app = axum::Router::new()
            .fallback(answer)
            .with_state(inner.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Upstream {
            base: format!("http://127.0.0.1:{port}"),
            inner,
            task,
        }
    }

    pub fn received(&self) -> Vec<Received> {
        self.inner.received.lock().unwrap().clone()
    }

    /// Requests to the model surfaces (not `/v1/models`).
    pub fn model_requests(&self) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| r.method == "POST")
            .collect()
    }

    pub fn set(&self, behaviour: Behaviour) {
        *self.inner.behaviour.lock().unwrap() = behaviour;
    }
}

fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .rfind(|t| !t.starts_with("<system-reminder>"))
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// The text the reply is scripted on: the last user text of the request.
fn last_user_text(path: &str, body: &Value) -> String {
    let items = if path.ends_with("/responses") {
        match &body["input"] {
            Value::String(s) => return s.clone(),
            Value::Array(a) => a.clone(),
            _ => Vec::new(),
        }
    } else {
        body["messages"].as_array().cloned().unwrap_or_default()
    };
    for item in items.iter().rev() {
        let results = item["content"]
            .as_array()
            .is_some_and(|c| c.iter().any(|b| b["type"] == "tool_result"));
        if results {
            return "after tools".into();
        }
        if item["role"] == "user" {
            let t = text_of(&item["content"]);
            if !t.is_empty() {
                return t;
            }
        }
        if item["role"] == "tool" || item["type"] == "function_call_output" {
            return "after tools".into();
        }
    }
    String::new()
}

fn sse(events: &[(Option<&str>, Value)], done: bool) -> Vec<String> {
    let mut out: Vec<String> = events
        .iter()
        .map(|(name, data)| match name {
            Some(n) => format!("event: {n}\ndata: {data}\n\n"),
            None => format!("data: {data}\n\n"),
        })
        .collect();
    if done {
        out.push("data: [DONE]\n\n".into());
    }
    out
}

async fn answer(State(inner): State<Arc<Inner>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 256 << 20)
        .await
        .unwrap_or_default();
    let path = parts.uri.path().to_string();
    inner.received.lock().unwrap().push(Received {
        method: parts.method.to_string(),
        path: path.clone(),
        headers: parts
            .headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("").to_string()))
            .collect(),
        body: bytes.to_vec(),
    });
    let behaviour = inner.behaviour.lock().unwrap().clone();
    tokio::time::sleep(behaviour.delay).await;
    if parts.method == "GET" {
        return json_reply(
            200,
            json!({"object": "list", "data": [{"id": "m-test", "object": "model"}]}),
        );
    }
    let n = inner.count.fetch_add(1, Ordering::SeqCst) + 1;
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let text = last_user_text(&path, &body);
    let stream = body["stream"] == true;
    let input_tokens = (bytes.len() / 4) as u64;
    if text.contains("RATELIMIT") {
        let mut r = json_reply(
            429,
            json!({"error": {"message": "Rate limit reached, retry later", "type": "rate_limit_error", "code": "rate_limit_exceeded"}}),
        );
        r.headers_mut().insert("retry-after", "7".parse().unwrap());
        return r;
    }
    if behaviour
        .overflow_over_bytes
        .is_some_and(|limit| bytes.len() > limit)
    {
        return json_reply(
            400,
            json!({"error": {
            "message": format!("This model's maximum context length is 8192 tokens. However, your messages resulted in {input_tokens} tokens. Please reduce the length of the messages."),
            "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
        );
    }
    if behaviour
        .slow_marker
        .as_deref()
        .is_some_and(|m| text.contains(m))
    {
        tokio::time::sleep(behaviour.slow_delay).await;
    }
    if path.ends_with("/chat/completions") {
        if let Some(script) = &behaviour.script {
            if let Some(message) = script.lock().unwrap().pop_front() {
                return json_reply(
                    200,
                    json!({"id": format!("chatcmpl-{n}"), "object": "chat.completion", "created": 1, "model": "m-test",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": input_tokens, "completion_tokens": 7, "total_tokens": input_tokens + 7}}),
                );
            }
        }
    }
    let tools = text.contains("TOOLS");
    let reply = format!(
        "reply {n} to: {}",
        text.chars().take(60).collect::<String>()
    );
    let chunks = if path.ends_with("/chat/completions") {
        chat(n, &body, tools, &reply, stream, input_tokens)
    } else if path.ends_with("/messages") {
        messages(n, tools, &reply, stream, input_tokens)
    } else if path.ends_with("/responses") {
        responses(n, tools, &reply, stream, input_tokens)
    } else {
        return json_reply(404, json!({"error": {"message": "no such path"}}));
    };
    match chunks {
        Err(v) => json_reply(200, v),
        Ok(events) => {
            let delay = behaviour.chunk_delay;
            let s = futures::stream::iter(events).then(move |e| async move {
                tokio::time::sleep(delay).await;
                Ok::<_, std::io::Error>(bytes::Bytes::from(e))
            });
            Response::builder()
                .status(200)
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(s))
                .unwrap()
        }
    }
}

use futures::StreamExt;

fn json_reply(status: u16, v: Value) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(status).unwrap())
        .header("content-type", "application/json")
        .body(Body::from(v.to_string()))
        .unwrap()
}

type Answer = Result<Vec<String>, Value>;

fn chat(n: u64, body: &Value, tools: bool, reply: &str, stream: bool, input: u64) -> Answer {
    let calls = json!([
        {"id": format!("call_{n}_a"), "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
        {"id": format!("call_{n}_b"), "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}},
    ]);
    let usage = json!({"prompt_tokens": input, "completion_tokens": 7, "total_tokens": input + 7});
    let id = format!("chatcmpl-{n}");
    if !stream {
        let message = if tools {
            json!({"role": "assistant", "content": null, "tool_calls": calls, "refusal": null})
        } else {
            json!({"role": "assistant", "content": reply, "refusal": null, "annotations": []})
        };
        return Err(
            json!({"id": id, "object": "chat.completion", "created": 1, "model": "m-test",
            "choices": [{"index": 0, "message": message, "finish_reason": if tools {"tool_calls"} else {"stop"}}],
            "usage": usage}),
        );
    }
    let base = |delta: Value, finish: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": 1, "model": "m-test",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut events = vec![(
        None,
        base(
            json!({"role": "assistant", "content": if tools { Value::Null } else { Value::from("") }}),
            Value::Null,
        ),
    )];
    if tools {
        for (i, c) in calls.as_array().unwrap().iter().enumerate() {
            events.push((None, base(json!({"tool_calls": [{"index": i, "id": c["id"], "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}), Value::Null)));
            let args = c["function"]["arguments"].as_str().unwrap();
            let (a, b) = args.split_at(args.len() / 2);
            for piece in [a, b] {
                events.push((
                    None,
                    base(
                        json!({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}),
                        Value::Null,
                    ),
                ));
            }
        }
    } else {
        let words: Vec<&str> = reply.split_inclusive(' ').collect();
        for w in words {
            events.push((None, base(json!({"content": w}), Value::Null)));
        }
    }
    events.push((
        None,
        base(
            json!({}),
            Value::from(if tools { "tool_calls" } else { "stop" }),
        ),
    ));
    if body["stream_options"]["include_usage"] == true {
        events.push((None, json!({"id": id, "object": "chat.completion.chunk", "created": 1, "model": "m-test", "choices": [], "usage": usage})));
    }
    Ok(sse(&events, true))
}

fn messages(n: u64, tools: bool, reply: &str, stream: bool, input: u64) -> Answer {
    let thinking = json!({"type": "thinking", "thinking": format!("thinking {n}"), "signature": format!("sig-{n}")});
    let mut content = vec![thinking];
    if tools {
        content.push(json!({"type": "tool_use", "id": format!("toolu_{n}_a"), "name": "get_weather", "input": {"city": "Paris"}}));
        content.push(json!({"type": "tool_use", "id": format!("toolu_{n}_b"), "name": "get_weather", "input": {"city": "Rome"}}));
    } else {
        content.push(json!({"type": "text", "text": reply}));
    }
    let id = format!("msg_{n}");
    let stop = if tools { "tool_use" } else { "end_turn" };
    if !stream {
        return Err(
            json!({"id": id, "type": "message", "role": "assistant", "model": "claude-test",
            "content": content, "stop_reason": stop, "stop_sequence": null,
            "usage": {"input_tokens": input, "output_tokens": 9}}),
        );
    }
    let mut events = vec![(
        Some("message_start"),
        json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant", "model": "claude-test", "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": input, "output_tokens": 1}}}),
    )];
    for (i, block) in content.iter().enumerate() {
        let start = match block["type"].as_str().unwrap() {
            "thinking" => json!({"type": "thinking", "thinking": ""}),
            "text" => json!({"type": "text", "text": ""}),
            _ => json!({"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}),
        };
        events.push((
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": i, "content_block": start}),
        ));
        let deltas = match block["type"].as_str().unwrap() {
            "thinking" => vec![
                json!({"type": "thinking_delta", "thinking": block["thinking"]}),
                json!({"type": "signature_delta", "signature": block["signature"]}),
            ],
            "text" => block["text"]
                .as_str()
                .unwrap()
                .split_inclusive(' ')
                .map(|w| json!({"type": "text_delta", "text": w}))
                .collect(),
            _ => {
                let s = block["input"].to_string();
                let (a, b) = s.split_at(s.len() / 2);
                vec![
                    json!({"type": "input_json_delta", "partial_json": a}),
                    json!({"type": "input_json_delta", "partial_json": b}),
                ]
            }
        };
        for d in deltas {
            events.push((
                Some("content_block_delta"),
                json!({"type": "content_block_delta", "index": i, "delta": d}),
            ));
        }
        events.push((
            Some("content_block_stop"),
            json!({"type": "content_block_stop", "index": i}),
        ));
    }
    events.push((Some("message_delta"), json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": 9}})));
    events.push((Some("message_stop"), json!({"type": "message_stop"})));
    Ok(sse(&events, false))
}

fn responses(n: u64, tools: bool, reply: &str, stream: bool, input: u64) -> Answer {
    let mut output = vec![
        json!({"id": format!("rs_{n}"), "type": "reasoning", "summary": [], "encrypted_content": format!("enc-{n}")}),
    ];
    if tools {
        output.push(json!({"id": format!("fc_{n}_a"), "type": "function_call", "status": "completed", "call_id": format!("call_{n}_a"), "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}));
        output.push(json!({"id": format!("fc_{n}_b"), "type": "function_call", "status": "completed", "call_id": format!("call_{n}_b"), "name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}));
    } else {
        output.push(json!({"id": format!("msg_{n}"), "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": reply, "annotations": []}]}));
    }
    let usage = json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input + 9});
    let response = json!({"id": format!("resp_{n}"), "object": "response", "created_at": 1, "status": "completed",
        "model": "m-test", "output": output, "usage": usage});
    if !stream {
        return Err(response);
    }
    let mut created = response.clone();
    created["status"] = json!("in_progress");
    created["output"] = json!([]);
    let mut seq = 0;
    let mut next = || {
        seq += 1;
        seq
    };
    let mut events = vec![(
        Some("response.created"),
        json!({"type": "response.created", "sequence_number": next(), "response": created}),
    )];
    for (i, item) in response["output"].as_array().unwrap().iter().enumerate() {
        events.push((Some("response.output_item.added"), json!({"type": "response.output_item.added", "sequence_number": next(), "output_index": i, "item": item})));
        if item["type"] == "message" {
            for w in reply.split_inclusive(' ') {
                events.push((Some("response.output_text.delta"), json!({"type": "response.output_text.delta", "sequence_number": next(), "output_index": i, "item_id": item["id"], "content_index": 0, "delta": w})));
            }
        }
        events.push((Some("response.output_item.done"), json!({"type": "response.output_item.done", "sequence_number": next(), "output_index": i, "item": item})));
    }
    events.push((
        Some("response.completed"),
        json!({"type": "response.completed", "sequence_number": next(), "response": response}),
    ));
    Ok(sse(&events, false))
}

/// The `contextfold gateway` process.
pub struct GatewayProc {
    child: Child,
    pub base: String,
    pub data: PathBuf,
}

impl GatewayProc {
    /// Starts a gateway in front of `upstream` with the `config` TOML
    /// (its `[gateway] upstream` and `listen` are set here) and `args`.
    pub fn start(data: &Path, upstream: &str, config: &str, args: &[&str]) -> GatewayProc {
        let port = free_port();
        let file = data.join(format!("gateway-{port}.toml"));
        std::fs::create_dir_all(data).unwrap();
        std::fs::write(&file, config).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_contextfold"))
            .arg("--config")
            .arg(&file)
            .arg("--data")
            .arg(data)
            .arg("gateway")
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--upstream")
            .arg(upstream)
            .args(args)
            .env_remove("CONTEXTFOLD_CONFIG")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting contextfold gateway");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        assert!(
            line.contains("listening on"),
            "gateway did not start: {line:?}"
        );
        GatewayProc {
            child,
            base: format!("http://127.0.0.1:{port}"),
            data: data.to_path_buf(),
        }
    }

    /// SIGTERM, then waits: the store is flushed on the way out.
    pub fn stop(&mut self) {
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }

    pub fn get_text(&self, path: &str) -> String {
        let out = Command::new("curl")
            .args(["-sS", &format!("{}{path}", self.base)])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn get(&self, path: &str) -> Value {
        let out = Command::new("curl")
            .args(["-sS", &format!("{}{path}", self.base)])
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }
}

impl Drop for GatewayProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The virtualenv with the official SDKs.
pub fn sdk_python() -> Option<PathBuf> {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-gateway/bin/python");
    if bin.is_file() {
        return Some(bin);
    }
    let msg = format!(
        "{} not found: run scripts/install-test-gateway.sh",
        bin.display()
    );
    if std::env::var_os("CONTEXTFOLD_REQUIRE_LLM_SERVERS").is_some() {
        panic!("{msg}");
    }
    eprintln!("skipping: {msg}");
    None
}

/// Runs a Python client script (stdin) with `args`; its last stdout line
/// is JSON.
pub async fn run_python(python: &Path, script: &str, args: &[&str]) -> Value {
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg("-c").arg(script).args(args);
    cmd.env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("ANTHROPIC_API_KEY");
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("python client timed out")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or("null");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("not JSON ({e}): {last}"))
}

/// `contextfold --data DATA ARGS` to the end, stdout as JSON.
pub fn cli_json(data: &Path, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_contextfold"))
        .arg("--data")
        .arg(data)
        .args(args)
        .env_remove("CONTEXTFOLD_CONFIG")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// Every turn a conversation holds, through `assemble --json` with a
/// budget that leaves nothing out (after the gateway stopped).
pub fn stored_messages(data: &Path, conversation: &str) -> Vec<Value> {
    let v = cli_json(
        data,
        &["assemble", conversation, "--budget", "100000000", "--json"],
    );
    v["messages"].as_array().cloned().unwrap_or_default()
}

/// Waits until every turn the gateway took is stored (`/readyz` says
/// `settled`).
pub async fn settle(base: &str) {
    let client = reqwest::Client::new();
    for _ in 0..1000 {
        if let Ok(r) = client
            .get(format!("{base}/contextfold/v1/readyz"))
            .send()
            .await
        {
            if let Ok(v) = r.json::<Value>().await {
                if v["settled"] == true {
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the gateway at {base} did not settle");
}

/// The small policy of the assembly tests: a 20,000-token window, so a
/// few dozen long turns compact, and a hundred short ones do not.
pub const SMALL_POLICY: &str = r#"
[policy]
default_context_window = 20000
fresh_tail_count = 6
leaf_chunk_tokens = 4000
leaf_target_tokens = 300
condensed_target_tokens = 300
leaf_fanout = 3
condensed_fanout = 2
"#;

/// A long user turn with identifiers: `i`-th of a session.
pub fn long_turn(i: usize) -> String {
    let mut s = format!(
        "Step {i}: edit src/module_{i}.rs and run the tests for ticket CF-{}. ",
        1000 + i
    );
    for k in 0..60 {
        s.push_str(&format!(
            "Observation {i}.{k}: the function handler_{i}_{k} returns {} items. ",
            i * k
        ));
    }
    s
}
