//! Past the budget the model receives `[client system, byte-identical]
//! [summary block] [fresh tail, verbatim]`: tool pairs whole, the prefix
//! unchanged across a hundred requests between two compactions, and two
//! gateway replicas sending the same bytes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/gateway.rs"]
mod gw;

use gw::{long_turn, settle, Behaviour, GatewayProc, Upstream, SMALL_POLICY};
use serde_json::{json, Value};
use std::collections::HashSet;

const SYSTEM: &str = "You are a careful coding agent. Keep every identifier exact.";

/// One client session: long turns (some asking for tools), then short
/// ones; returns the number of requests sent.
async fn session(base: &str, long: usize, short: usize, tail_long: usize) -> Vec<Vec<Value>> {
    let client = reqwest::Client::new();
    let mut msgs = vec![json!({"role": "system", "content": SYSTEM})];
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let mut sent = Vec::new();
    let texts: Vec<String> = (0..long)
        .map(long_turn)
        .chain((0..short).map(|i| format!("short step {i}: looks fine, continue with item {i}")))
        .chain((long..long + tail_long).map(long_turn))
        .collect();
    for (i, text) in texts.iter().enumerate() {
        let text = if i % 7 == 3 {
            format!("TOOLS {text}")
        } else {
            text.clone()
        };
        msgs.push(json!({"role": "user", "content": text}));
        loop {
            let r = client
                .post(format!("{base}/v1/chat/completions"))
                .json(&json!({"model": "gpt-4o", "messages": msgs, "tools": tools}))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success(), "{}", r.text().await.unwrap());
            let v: Value = r.json().await.unwrap();
            sent.push(msgs.clone());
            let m = v["choices"][0]["message"].clone();
            msgs.push(m.clone());
            settle(base).await;
            let Some(calls) = m["tool_calls"].as_array() else {
                break;
            };
            for c in calls {
                msgs.push(json!({"role": "tool", "tool_call_id": c["id"], "content": format!("result for {}", c["id"])}));
            }
        }
    }
    sent
}

/// The raw bytes of the items array of a body, split at the block: (bytes
/// before the tail, tail items).
fn split_at_block(body: &[u8]) -> Option<(Vec<u8>, Vec<Value>)> {
    let v: Value = serde_json::from_slice(body).unwrap();
    let msgs = v["messages"].as_array().unwrap();
    let k = msgs.iter().position(|m| {
        m["content"]
            .as_str()
            .is_some_and(|t| t.starts_with("<contextfold_summary"))
    })?;
    let tail = msgs[k + 1..].to_vec();
    let text = std::str::from_utf8(body).unwrap();
    let marker = "<contextfold_summary";
    let at = text.find(marker).unwrap();
    let end = at + text[at..].find("</contextfold_summary>").unwrap();
    Some((body[..end].to_vec(), tail))
}

fn tool_pairs_whole(body: &[u8]) -> bool {
    let v: Value = serde_json::from_slice(body).unwrap();
    let mut calls = HashSet::new();
    for m in v["messages"].as_array().unwrap() {
        for c in m["tool_calls"].as_array().into_iter().flatten() {
            calls.insert(c["id"].as_str().unwrap().to_string());
        }
        if let Some(id) = m["tool_call_id"].as_str() {
            if !calls.contains(id) {
                return false;
            }
        }
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_budget_the_prefix_is_stable_and_replicas_agree() {
    let up_a = Upstream::start(Behaviour::default()).await;
    let up_b = Upstream::start(Behaviour::default()).await;
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ga = GatewayProc::start(da.path(), &up_a.base, SMALL_POLICY, &[]);
    let gb = GatewayProc::start(db.path(), &up_b.base, SMALL_POLICY, &[]);
    let (na, nb) = tokio::join!(
        session(&ga.base, 40, 100, 30),
        session(&gb.base, 40, 100, 30)
    );
    assert_eq!(na, nb);
    let client = na;

    let a = up_a.model_requests();
    let b = up_b.model_requests();
    assert_eq!(a.len(), b.len());
    // Two replicas: the same bytes upstream, request for request.
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(x.body == y.body, "request {i} differs between replicas");
    }

    let mut assembled = 0;
    let mut prefixes: Vec<Vec<u8>> = Vec::new();
    let mut longest_run = 0;
    let mut run = 0;
    for (r, sent) in a.iter().zip(&client) {
        assert!(tool_pairs_whole(&r.body), "a tool pair was split");
        let v = r.json();
        // The client's system message is first, byte for byte.
        assert_eq!(v["messages"][0]["content"], SYSTEM);
        let Some((prefix, tail)) = split_at_block(&r.body) else {
            continue;
        };
        assembled += 1;
        assert!(!tail.is_empty());
        // The tail is the client's newest messages, verbatim.
        assert_eq!(&tail[..], &sent[sent.len() - tail.len()..]);
        if prefixes.last() == Some(&prefix) {
            run += 1;
        } else {
            prefixes.push(prefix);
            run = 1;
        }
        longest_run = longest_run.max(run);
    }
    eprintln!(
        "{} requests, {assembled} assembled, {} distinct prefixes, longest run {longest_run}",
        a.len(),
        prefixes.len()
    );
    assert!(assembled > 100, "only {assembled} requests were assembled");
    assert!(
        longest_run >= 100,
        "the prefix changed within 100 requests (longest run {longest_run})"
    );
    assert!(
        prefixes.len() >= 2,
        "the second compaction changed the prefix"
    );
    // The context the model saw was smaller than what the client sent.
    let last = a.last().unwrap();
    let client_msgs = 1 + 2 * 170;
    assert!(last.json()["messages"].as_array().unwrap().len() < client_msgs / 4);
}
