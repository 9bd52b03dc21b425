//! Shadow mode on a long real transcript (a Claude Code session from the
//! shared data, 350 turns) replayed through the gateway: every request goes
//! upstream unchanged, every turn is stored, and the report says per
//! conversation what the active mode would have sent, prompt-cache writes
//! counted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/gateway.rs"]
mod gw;

use gw::{cli_json, settle, Behaviour, GatewayProc, Upstream};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

const TRANSCRIPT: &str =
    "../shared/data/transcripts/claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl";

/// The transcript's turns, in chat shape.
fn turns() -> Option<Vec<Value>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(TRANSCRIPT);
    if !path.is_file() {
        eprintln!("skipping: {} not found", path.display());
        return None;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_contextfold"))
        .arg("import")
        .arg(&path)
        .env_remove("CONTEXTFOLD_CONFIG")
        .output()
        .unwrap();
    assert!(out.status.success());
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["type"] == "turn_appended")
            .map(|e| e["payload"]["message"].clone())
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_report_on_a_long_transcript() {
    let Some(turns) = turns() else { return };
    let answers: VecDeque<Value> = turns
        .iter()
        .filter(|m| m["role"] == "assistant")
        .cloned()
        .collect();
    let script = Arc::new(Mutex::new(answers));
    let up = Upstream::start(Behaviour {
        script: Some(script),
        ..Behaviour::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    // The policy's budget as a 64k-token model would have it.
    let config = "[policy]\ndefault_context_window = 64000\n";
    let mut g = GatewayProc::start(dir.path(), &up.base, config, &["--shadow"]);
    let client = reqwest::Client::new();
    let mut msgs = vec![json!({"role": "system", "content": "You are Claude Code."})];
    let mut sent = Vec::new();
    let mut conv = String::new();
    for t in &turns {
        if t["role"] == "assistant" {
            let r = client
                .post(format!("{}/v1/chat/completions", g.base))
                .json(&json!({"model": "claude-opus-4-6", "messages": msgs}))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success());
            conv = r.headers()["x-contextfold-conversation"]
                .to_str()
                .unwrap()
                .to_string();
            assert_eq!(r.headers()["x-contextfold-context"], "forwarded");
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["choices"][0]["message"], *t);
            sent.push(
                serde_json::to_vec(&json!({"model": "claude-opus-4-6", "messages": msgs})).unwrap(),
            );
            settle(&g.base).await;
        }
        msgs.push(t.clone());
    }
    let report = g.get("/contextfold/v1/report");
    eprintln!("{}", serde_json::to_string_pretty(&report).unwrap());
    let posts = up.model_requests();
    assert_eq!(posts.len(), sent.len());
    // Shadow: the upstream got exactly what the client sent.
    for (p, s) in posts.iter().zip(&sent) {
        assert_eq!(p.json(), serde_json::from_slice::<Value>(s).unwrap());
    }
    let totals = &report["totals"];
    assert_eq!(report["mode"], "shadow");
    assert_eq!(totals["conversations"], 1, "one conversation, never forked");
    assert_eq!(totals["tokens_sent"], totals["tokens_client"]);
    assert!(totals["assembled_requests"].as_u64().unwrap() > 0);
    assert!(totals["tokens_active"].as_u64() < totals["tokens_client"].as_u64());
    assert!(totals["prefix_changes"].as_u64().unwrap() >= 1);
    g.stop();
    // Every turn is stored.
    let status = cli_json(dir.path(), &["status", &conv]);
    assert_eq!(
        status["turns"]["total"].as_u64().unwrap() as usize,
        turns.len(),
        "{status}"
    );
}
