//! The real Claude Code CLI (`@anthropic-ai/claude-code`, `claude -p`, then
//! `claude -p --continue`) with `ANTHROPIC_BASE_URL` pointed at the
//! gateway, in front of a scripted Anthropic Messages upstream on loopback:
//! its turns keyed to one conversation through its session (and its
//! `<system-reminder>` injections), stored, and its own `/compact` passed
//! through without breaking the session.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/gateway.rs"]
mod gw;

use gw::{settle, Behaviour, GatewayProc, Upstream};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn claude_bin() -> Option<PathBuf> {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join(".npm-gateway/node_modules/.bin/claude");
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

async fn claude(
    bin: &Path,
    home: &Path,
    work: &Path,
    base: &str,
    resume: bool,
    prompt: &str,
) -> (String, String) {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg("-p");
    if resume {
        cmd.arg("--continue");
    }
    cmd.args(["--model", "claude-sonnet-4-5"])
        .arg(prompt)
        .current_dir(work)
        .env("HOME", home)
        .env("ANTHROPIC_BASE_URL", base)
        .env("ANTHROPIC_API_KEY", "sk-ant-cc-test")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env_remove("ANTHROPIC_AUTH_TOKEN")
        .stdin(std::process::Stdio::null());
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("claude timed out")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "claude failed:\n{stdout}\n{stderr}");
    (stdout, stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_session_through_the_gateway() {
    let Some(bin) = claude_bin() else { return };
    let upstream = Upstream::start(Behaviour::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let mut g = GatewayProc::start(&dir.path().join("data"), &upstream.base, "", &[]);
    let prompts = [
        "fix the build of module_a",
        "now add a test for handler_b",
        "/compact",
        "and document it",
    ];
    let mut outs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (stdout, stderr) = claude(&bin, &home, &work, &g.base, i > 0, p).await;
        eprintln!("--- turn {i}: {stdout}\n{stderr}");
        outs.push(stdout);
        settle(&g.base).await;
    }
    if std::env::var_os("GW_DUMP").is_some() {
        for (i, r) in upstream.model_requests().iter().enumerate() {
            std::fs::write(format!("/tmp/cc-req-{i}.json"), &r.body).unwrap();
        }
    }
    let report = g.get("/contextfold/v1/report");
    let convs = report["conversations"].as_object().unwrap();
    eprintln!(
        "{}",
        serde_json::to_string_pretty(&report["totals"]).unwrap()
    );
    // One conversation, keyed by Claude Code's session, through its
    // compaction.
    assert_eq!(convs.len(), 1, "{:?}", convs.keys().collect::<Vec<_>>());
    let (conv, r) = convs.iter().next().unwrap();
    assert!(conv.starts_with("claude-code-"), "{conv}");
    assert_eq!(r["compactions_answered"], 1);
    // The compaction never reached the upstream; the turn after it carried
    // contextfold's summary.
    let posts = upstream.model_requests();
    assert_eq!(posts.len(), prompts.len() - 1);
    for p in &posts {
        assert!(!String::from_utf8_lossy(&p.body)
            .contains("create a detailed summary of the conversation so far"));
    }
    let after = String::from_utf8_lossy(&posts.last().unwrap().body).into_owned();
    assert!(
        after.contains("<contextfold_summary conversation="),
        "Claude Code kept contextfold's summary"
    );
    assert!(
        outs.last().unwrap().contains("and document it"),
        "Claude Code went on: {}",
        outs.last().unwrap()
    );
    g.stop();
    let stored = gw::stored_messages(&dir.path().join("data"), conv);
    let users: Vec<String> = stored
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| m["content"].to_string())
        .collect();
    assert!(
        users
            .iter()
            .all(|u| !u.contains("create a detailed summary")),
        "the harness's prompt is not a turn"
    );
    assert!(users
        .iter()
        .any(|u| u.contains("fix the build of module_a")));
    assert!(users.iter().any(|u| u.contains("and document it")));
}
