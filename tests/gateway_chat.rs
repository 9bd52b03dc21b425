//! The gateway in front of a scripted OpenAI Chat Completions upstream,
//! driven by the official `openai` Python SDK: streaming with
//! `include_usage`, parallel tool calls, a retried request, a malformed
//! one, upstream errors passed back with `Retry-After`, and what is stored.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/gateway.rs"]
mod gw;

use gw::{run_python, sdk_python, stored_messages, Behaviour, GatewayProc, Upstream};

const SESSION: &str = r#"
import json, sys, openai
base = sys.argv[1]
c = openai.OpenAI(base_url=base + "/v1", api_key="sk-client", max_retries=0)
out = {"convs": []}
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"}]
r = c.chat.completions.with_raw_response.create(model="gpt-4o", messages=msgs)
out["convs"].append(r.headers.get("x-contextfold-conversation"))
out["keyed_by"] = r.headers.get("x-contextfold-keyed-by")
first = r.parse()
msgs.append(first.choices[0].message.model_dump(exclude_none=True))
msgs.append({"role": "user", "content": "TOOLS please, check both cities"})
# streaming, include_usage, parallel tool calls
raw = c.chat.completions.with_raw_response.create(model="gpt-4o", messages=msgs, tools=tools, stream=True, stream_options={"include_usage": True})
out["convs"].append(raw.headers.get("x-contextfold-conversation"))
calls = {}
chunks = 0
usage = None
for ch in raw.parse():
    chunks += 1
    if ch.usage:
        usage = ch.usage.total_tokens
    for choice in ch.choices:
        for tc in (choice.delta.tool_calls or []):
            d = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id: d["id"] = tc.id
            if tc.function and tc.function.name: d["name"] += tc.function.name
            if tc.function and tc.function.arguments: d["arguments"] += tc.function.arguments
out["chunks"] = chunks
out["usage"] = usage
out["calls"] = [calls[i] for i in sorted(calls)]
msgs.append({"role": "assistant", "content": None, "tool_calls": [
    {"id": d["id"], "type": "function", "function": {"name": d["name"], "arguments": d["arguments"]}} for d in out["calls"]]})
for d in out["calls"]:
    msgs.append({"role": "tool", "tool_call_id": d["id"], "content": "sunny in " + json.loads(d["arguments"])["city"]})
r3 = c.chat.completions.with_raw_response.create(model="gpt-4o", messages=msgs)
out["convs"].append(r3.headers.get("x-contextfold-conversation"))
out["last"] = r3.parse().choices[0].message.content
# the client retries the same request (it lost the answer)
r4 = c.chat.completions.with_raw_response.create(model="gpt-4o", messages=msgs)
out["convs"].append(r4.headers.get("x-contextfold-conversation"))
out["sent_last"] = msgs
# a malformed request: provider-shaped 400, nothing stored
try:
    c.chat.completions.create(model="gpt-4o", messages=[{"role": "wizard", "content": "x"}])
    out["bad"] = None
except openai.BadRequestError as e:
    out["bad"] = {"status": e.status_code, "message": e.body.get("message") if isinstance(e.body, dict) else str(e.body)}
# an upstream 429 comes back as the provider shaped it, Retry-After included
try:
    c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "RATELIMIT now"}])
    out["rate"] = None
except openai.RateLimitError as e:
    out["rate"] = {"status": e.status_code, "retry_after": e.response.headers.get("retry-after"), "code": e.body.get("code")}
models = c.models.list()
out["models"] = [m.id for m in models.data]
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_sdk_session_through_the_gateway() {
    let Some(python) = sdk_python() else { return };
    let upstream = Upstream::start(Behaviour::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut g = GatewayProc::start(dir.path(), &upstream.base, "", &[]);
    let out = run_python(&python, SESSION, &[&g.base]).await;

    let convs: Vec<&str> = out["convs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        convs.iter().all(|c| *c == convs[0]),
        "one conversation: {convs:?}"
    );
    assert_eq!(out["keyed_by"], "new");
    // Streamed through: many chunks, the usage chunk, both parallel calls.
    assert!(out["chunks"].as_u64().unwrap() >= 6, "{out}");
    assert!(out["usage"].as_u64().unwrap() > 0);
    assert_eq!(out["calls"].as_array().unwrap().len(), 2);
    assert_eq!(out["calls"][1]["arguments"], "{\"city\":\"Rome\"}");
    assert_eq!(out["bad"]["status"], 400);
    assert!(
        out["bad"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown role"),
        "{out}"
    );
    assert_eq!(out["rate"]["status"], 429);
    assert_eq!(out["rate"]["retry_after"], "7");
    assert_eq!(out["rate"]["code"], "rate_limit_exceeded");
    assert_eq!(out["models"][0], "m-test");

    // Under the budget the upstream got the client's messages unchanged and
    // no x-contextfold header.
    let posts = upstream.model_requests();
    let last = posts
        .iter()
        .rev()
        .find(|r| {
            r.json()["messages"]
                .as_array()
                .is_some_and(|m| m.len() == 7)
        })
        .unwrap();
    assert_eq!(last.json()["messages"], out["sent_last"]);
    assert!(posts.iter().all(|r| r
        .headers
        .iter()
        .all(|(n, _)| !n.starts_with("x-contextfold"))));
    assert!(posts
        .iter()
        .all(|r| r.header("authorization") == Some("Bearer sk-client")));

    // The metrics count what happened.
    let metrics = g.get_text("/contextfold/v1/metrics");
    assert!(
        metrics.contains("contextfold_gateway_requests_total{surface=\"chat_completions\",outcome=\"forwarded\"} 4"),
        "{metrics}"
    );
    assert!(metrics.contains("contextfold_gateway_upstream_errors_total{surface=\"chat_completions\",class=\"rate_limited\"} 1"));
    assert!(metrics.contains("contextfold_gateway_added_latency_seconds_bucket"));
    g.stop();
    let stored = stored_messages(dir.path(), convs[0]);
    let roles: Vec<&str> = stored.iter().map(|m| m["role"].as_str().unwrap()).collect();
    // user, assistant, user, assistant(2 calls), tool, tool, assistant: the
    // retry added nothing, the malformed request nothing, the system
    // prompt is the client's (not a turn).
    assert_eq!(
        roles,
        [
            "user",
            "assistant",
            "user",
            "assistant",
            "tool",
            "tool",
            "assistant"
        ],
        "{stored:#?}"
    );
    assert_eq!(stored[3]["tool_calls"].as_array().unwrap().len(), 2);
    assert_eq!(stored[6]["content"], out["last"]);
}
