//! The gateway in front of a scripted OpenAI Responses upstream, driven by
//! the official `openai` Python SDK (and raw HTTP where Codex sends what the
//! SDK does not: zstd bodies, `compaction_trigger`, checkpoint compaction
//! marked in `x-codex-turn-metadata`): stateless input arrays with
//! encrypted reasoning replayed, streamed parallel function calls,
//! `previous_response_id` lineage, and Codex's compaction contract
//! answered from contextfold without calling the upstream.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/gateway.rs"]
mod gw;

use gw::{run_python, sdk_python, settle, stored_messages, Behaviour, GatewayProc, Upstream};

const SESSION: &str = r#"
import json, sys, openai, httpx, zstandard
base = sys.argv[1]
c = openai.OpenAI(base_url=base + "/v1", api_key="sk-client", max_retries=0)
auth = {"authorization": "Bearer sk-client"}
out = {"convs": []}
tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
inp = [{"role": "developer", "content": "be terse"}, {"role": "user", "content": "hello responses"}]
r = c.responses.with_raw_response.create(model="gpt-5", input=inp, store=False, include=["reasoning.encrypted_content"])
out["convs"].append(r.headers.get("x-contextfold-conversation"))
inp += [o.model_dump(exclude_none=True) for o in r.parse().output]
inp.append({"role": "user", "content": "TOOLS both cities"})
raw = c.responses.with_raw_response.create(model="gpt-5", input=inp, tools=tools, store=False, stream=True)
out["convs"].append(raw.headers.get("x-contextfold-conversation"))
final = None
types = []
for ev in raw.parse():
    types.append(ev.type)
    if ev.type == "response.completed":
        final = ev.response
out["stream_types"] = sorted(set(types))
calls = [o for o in final.output if o.type == "function_call"]
out["calls"] = [x.call_id for x in calls]
inp += [o.model_dump(exclude_none=True) for o in final.output]
inp += [{"type": "function_call_output", "call_id": x.call_id, "output": "sunny"} for x in calls]
# A zstd body, as Codex sends it.
body = json.dumps({"model": "gpt-5", "input": inp, "store": False}).encode()
h = httpx.post(base + "/v1/responses", content=zstandard.ZstdCompressor().compress(body),
               headers={**auth, "content-encoding": "zstd", "content-type": "application/json"})
out["zstd_status"] = h.status_code
out["convs"].append(h.headers.get("x-contextfold-conversation"))
inp += h.json()["output"]
# Codex (built-in provider) asks for a compaction: exactly one compaction item.
events = []
with httpx.stream("POST", base + "/v1/responses", headers=auth,
                  json={"model": "gpt-5", "input": inp + [{"type": "compaction_trigger"}], "stream": True, "store": False}) as s:
    out["convs"].append(s.headers.get("x-contextfold-conversation"))
    data = "".join(s.iter_text())
for block in data.split("\n\n"):
    for line in block.splitlines():
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
out["trigger_items"] = [d["type"] for d in done]
out["trigger_last"] = events[-1]["type"]
compaction = done[0]
# Codex rebuilds its history: initial context, its user messages, the item.
post = [inp[0]] + [i for i in inp if i.get("role") == "user"] + [compaction, {"role": "user", "content": "continue after compaction"}]
r5 = c.responses.with_raw_response.create(model="gpt-5", input=post, store=False)
out["convs"].append(r5.headers.get("x-contextfold-conversation"))
out["after_keyed_by"] = r5.headers.get("x-contextfold-keyed-by")
# POST /v1/responses/compact
hc = httpx.post(base + "/v1/responses/compact", headers=auth, json={"model": "gpt-5", "input": inp, "instructions": "compact"})
out["compact_endpoint"] = [o["type"] for o in hc.json()["output"]]
# Codex behind a custom provider: a checkpoint compaction marked in its metadata.
cp = inp + [{"role": "user", "content": "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary."}]
hk = httpx.post(base + "/v1/responses", json={"model": "gpt-5", "input": cp},
                headers={**auth, "x-codex-turn-metadata": json.dumps({"turn_id": "t1", "request_kind": "compaction"})})
out["checkpoint"] = hk.json()["output"][0]["content"][0]["text"]
# previous_response_id: the provider's lineage keys the next turn.
r6 = c.responses.with_raw_response.create(model="gpt-5", input=[{"role": "user", "content": "a stateful thread begins"}])
r6p = r6.parse()
r7 = c.responses.with_raw_response.create(model="gpt-5", input=[{"role": "user", "content": "and goes on"}], previous_response_id=r6p.id)
out["lineage"] = [r6.headers.get("x-contextfold-conversation"), r7.headers.get("x-contextfold-conversation"), r7.headers.get("x-contextfold-keyed-by")]
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_and_codex_compaction_through_the_gateway() {
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
    assert_eq!(out["after_keyed_by"], "summary");
    assert!(out["stream_types"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t == "response.output_text.delta" || t == "response.output_item.done"));
    assert_eq!(out["calls"].as_array().unwrap().len(), 2);
    assert_eq!(out["zstd_status"], 200);
    assert_eq!(out["trigger_items"], serde_json::json!(["compaction"]));
    assert_eq!(out["trigger_last"], "response.completed");
    assert_eq!(out["compact_endpoint"], serde_json::json!(["compaction"]));
    let checkpoint = out["checkpoint"].as_str().unwrap();
    assert!(
        checkpoint.starts_with("<contextfold_summary conversation="),
        "{checkpoint}"
    );
    assert!(
        checkpoint.contains("hello responses"),
        "the summary names the task: {checkpoint}"
    );
    assert_eq!(out["lineage"][0], out["lineage"][1]);
    assert_eq!(out["lineage"][2], "lineage");

    let posts = upstream.model_requests();
    // r1, the stream, the zstd body, after the compaction, r6, r7: the
    // compaction trigger, /responses/compact and the checkpoint never
    // reached the upstream.
    assert_eq!(
        posts.len(),
        6,
        "{:?}",
        posts
            .iter()
            .map(|p| p.json()["input"].clone())
            .collect::<Vec<_>>()
    );
    let zstd = &posts[2];
    assert!(zstd.header("content-encoding").is_none());
    assert!(
        zstd.json()["input"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["type"] == "reasoning" && i["encrypted_content"] == "enc-1"),
        "encrypted reasoning replayed verbatim"
    );
    let after = String::from_utf8(posts[3].body.clone()).unwrap();
    assert!(
        !after.contains("contextfold.v1:"),
        "the handle never reaches the upstream"
    );
    assert!(
        after.contains("<contextfold_summary conversation="),
        "the compaction item went up as its summary"
    );
    assert_eq!(posts[5].json()["previous_response_id"], "resp_5");

    g.stop();
    let stored = stored_messages(dir.path(), convs[0]);
    let texts: Vec<String> = stored.iter().map(|m| m["content"].to_string()).collect();
    assert!(texts
        .iter()
        .any(|t| t.contains("continue after compaction")));
    assert!(
        !texts.iter().any(|t| t.contains("CONTEXT CHECKPOINT")),
        "the harness's prompt is not a turn"
    );
    let tool_results = stored.iter().filter(|m| m["role"] == "tool").count();
    assert_eq!(tool_results, 2);
    // hello, reasoning, message, TOOLS, reasoning, the 2 parallel calls as
    // one turn, 2 results, reasoning, message, then after the compaction:
    // the new user turn, reasoning, message.
    assert_eq!(stored.len(), 13, "{stored:#?}");
    let calls = stored.iter().find(|m| m["tool_calls"].is_array()).unwrap();
    assert_eq!(calls["tool_calls"].as_array().unwrap().len(), 2);
    assert!(texts.iter().all(|t| !t.contains("no result was recorded")));
}
