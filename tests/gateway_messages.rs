//! The gateway in front of a scripted Anthropic Messages upstream, driven
//! by the official `anthropic` Python SDK as Claude Code uses the API:
//! top-level system with `cache_control`, thinking with signatures,
//! streamed `tool_use` and `tool_result`, `anthropic-beta` and
//! `context_management` passed on, `<system-reminder>` turns that do not
//! start a new conversation, and a second conversation with the same system
//! prompt and key kept apart.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/gateway.rs"]
mod gw;

use gw::{run_python, sdk_python, settle, stored_messages, Behaviour, GatewayProc, Upstream};

const SESSION: &str = r#"
import json, sys, anthropic
base = sys.argv[1]
c = anthropic.Anthropic(base_url=base, api_key="sk-ant-client", max_retries=0)
out = {"convs": []}
system = [{"type": "text", "text": "You are Claude Code, a coding agent.", "cache_control": {"type": "ephemeral"}}]
tools = [{"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
beta = {"anthropic-beta": "interleaved-thinking-2025-05-14,context-management-2025-06-27"}
thinking = {"type": "enabled", "budget_tokens": 1024}
msgs = [{"role": "user", "content": [
    {"type": "text", "text": "<system-reminder>The todo list is empty.</system-reminder>"},
    {"type": "text", "text": "hello claude, fix the build", "cache_control": {"type": "ephemeral"}}]}]
r = c.messages.with_raw_response.create(model="claude-test", max_tokens=200, system=system, messages=msgs, thinking=thinking, extra_headers=beta)
out["convs"].append(r.headers.get("x-contextfold-conversation"))
m = r.parse()
del msgs[0]["content"][1]["cache_control"]  # the breakpoint moves to the newest turn
msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
msgs.append({"role": "user", "content": [
    {"type": "text", "text": "<system-reminder>src/a.rs was modified.</system-reminder>"},
    {"type": "text", "text": "TOOLS for both cities", "cache_control": {"type": "ephemeral"}}]})
events = 0
with c.messages.stream(model="claude-test", max_tokens=200, system=system, messages=msgs, tools=tools, thinking=thinking,
                       extra_headers=beta, extra_body={"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}) as s:
    out["convs"].append(s.response.headers.get("x-contextfold-conversation"))
    for ev in s:
        events += 1
    final = s.get_final_message()
out["events"] = events
out["blocks"] = [b.type for b in final.content]
out["signature"] = final.content[0].signature
del msgs[2]["content"][1]["cache_control"]
msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]})
uses = [b for b in final.content if b.type == "tool_use"]
msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny in " + u.input["city"]} for u in uses]
             + [{"type": "text", "text": "<system-reminder>Reminder: keep going.</system-reminder>"}]})
# A reminder-only turn (Claude Code injects them) does not start anything.
r3 = c.messages.with_raw_response.create(model="claude-test", max_tokens=200, system=system, messages=msgs, extra_headers=beta)
out["convs"].append(r3.headers.get("x-contextfold-conversation"))
out["last"] = r3.parse().content[-1].text
out["sent_last"] = msgs
# Another conversation: same system prompt, same key.
r4 = c.messages.with_raw_response.create(model="claude-test", max_tokens=200, system=system,
    messages=[{"role": "user", "content": "an unrelated task: write the release notes"}])
out["other"] = r4.headers.get("x-contextfold-conversation")
try:
    c.messages.create(model="claude-test", max_tokens=10, messages=[{"role": "system", "content": "x"}])
    out["bad"] = None
except anthropic.BadRequestError as e:
    out["bad"] = {"status": e.status_code, "type": e.body["error"]["type"], "message": e.body["error"]["message"]}
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_sdk_session_through_the_gateway() {
    let Some(python) = sdk_python() else { return };
    let upstream = Upstream::start(Behaviour::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut g = GatewayProc::start(dir.path(), &upstream.base, "", &[]);
    let out = run_python(&python, SESSION, &[&g.base]).await;
    settle(&g.base).await;

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
    assert_ne!(
        out["other"].as_str().unwrap(),
        convs[0],
        "same system prompt and key, another task"
    );
    assert!(out["events"].as_u64().unwrap() > 8, "{out}");
    assert_eq!(
        out["blocks"],
        serde_json::json!(["thinking", "tool_use", "tool_use"])
    );
    assert_eq!(out["signature"], "sig-2");
    assert_eq!(out["bad"]["status"], 400);
    assert_eq!(out["bad"]["type"], "invalid_request_error");

    let posts = upstream.model_requests();
    assert_eq!(posts.len(), 4, "the bad request never reached the upstream");
    let streamed = &posts[1];
    assert_eq!(
        streamed.header("anthropic-beta"),
        Some("interleaved-thinking-2025-05-14,context-management-2025-06-27")
    );
    assert_eq!(
        streamed.json()["context_management"]["edits"][0]["type"],
        "clear_tool_uses_20250919"
    );
    assert_eq!(
        streamed.json()["system"][0]["cache_control"]["type"],
        "ephemeral"
    );
    assert_eq!(posts[2].json()["messages"], out["sent_last"]);
    for r in &posts {
        // The client's credential, as the SDK sent it (this SDK version
        // sends it as a bearer token).
        let credential = r.header("x-api-key").or_else(|| {
            r.header("authorization")
                .and_then(|a| a.strip_prefix("Bearer "))
        });
        assert_eq!(credential, Some("sk-ant-client"), "{:?}", r.headers);
    }

    g.stop();
    let stored = stored_messages(dir.path(), convs[0]);
    let roles: Vec<&str> = stored.iter().map(|m| m["role"].as_str().unwrap()).collect();
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
    // Thinking kept with its signature; both calls; results paired.
    assert_eq!(stored[1]["content"][0]["type"], "thinking");
    assert_eq!(stored[1]["content"][0]["signature"], "sig-1");
    assert_eq!(stored[3]["tool_calls"].as_array().unwrap().len(), 2);
    assert_eq!(stored[4]["tool_call_id"], stored[3]["tool_calls"][0]["id"]);
    assert_eq!(stored[6]["content"][1]["text"], out["last"]);
}
