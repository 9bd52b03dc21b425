//! The real Codex CLI (`@openai/codex`, `codex exec` then `codex exec
//! resume --last`) pointed at the gateway, in front of a scripted Responses
//! upstream on loopback: a session long enough to cross Codex's compaction
//! limit, once with the built-in provider (its `compaction_trigger` gets one
//! `compaction` item) and once behind a custom provider (its checkpoint
//! compaction request gets contextfold's summary as text). Either way the
//! upstream is never asked to compact, Codex goes on working, and it never
//! compacts on every turn.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/gateway.rs"]
mod gw;

use gw::{settle, Behaviour, GatewayProc, Upstream};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn codex_bin() -> Option<PathBuf> {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join(".npm-gateway/node_modules/.bin/codex");
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

#[derive(Clone, Copy, PartialEq)]
enum Provider {
    /// `openai_base_url`: compactions end in `compaction_trigger`.
    BuiltIn,
    /// `model_providers.cf`: compactions are checkpoint requests.
    Custom,
}

/// Compaction limit of the session (tokens of usage).
const LIMIT: u64 = 16_000;

/// One `codex exec` run (a turn); (stdout, stderr).
async fn codex(
    bin: &Path,
    home: &Path,
    work: &Path,
    base: &str,
    provider: Provider,
    resume: bool,
    prompt: &str,
) -> (String, String) {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg("exec");
    if resume {
        cmd.args(["resume", "--last"]);
    }
    cmd.args(["--skip-git-repo-check", "-m", "gpt-5"]);
    match provider {
        Provider::BuiltIn => {
            cmd.arg("-c").arg(format!("openai_base_url=\"{base}/v1\""));
        }
        Provider::Custom => {
            cmd.arg("-c")
                .arg(format!("model_providers.cf={{name=\"contextfold\", base_url=\"{base}/v1\", wire_api=\"responses\", env_key=\"CF_GATEWAY_KEY\"}}"))
                .args(["-c", "model_provider=\"cf\""]);
        }
    }
    cmd.arg("-c")
        .arg(format!("model_auto_compact_token_limit={LIMIT}"))
        .args(["-c", "model_context_window=1000000"])
        .arg(prompt)
        .current_dir(work)
        .env("CODEX_HOME", home)
        .env("CODEX_API_KEY", "sk-codex-test")
        .env("CF_GATEWAY_KEY", "sk-codex-test")
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .stdin(std::process::Stdio::null());
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("codex timed out")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "codex failed:\n{stdout}\n{stderr}");
    (stdout, stderr)
}

fn prompt(i: usize) -> String {
    let mut s = format!(
        "Task {i}: review module_{i}.rs for ticket CF-{}. ",
        4000 + i
    );
    for k in 0..120 {
        s.push_str(&format!(
            "Note {i}.{k}: handler_{i}_{k} must keep returning {} items. ",
            i * 7 + k
        ));
    }
    s
}

/// Every rollout line Codex wrote under its home.
fn rollout_items(home: &Path) -> Vec<Value> {
    let mut out = Vec::new();
    let mut dirs = vec![home.join("sessions")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "jsonl") {
                for line in std::fs::read_to_string(&p).unwrap().lines() {
                    if let Ok(v) = serde_json::from_str::<Value>(line) {
                        out.push(v);
                    }
                }
            }
        }
    }
    out
}

async fn session(provider: Provider) {
    let Some(bin) = codex_bin() else { return };
    let upstream = Upstream::start(Behaviour::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("codex-home");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let mut g = GatewayProc::start(&dir.path().join("data"), &upstream.base, "", &[]);

    let turns = 10;
    let mut compacted_at = Vec::new();
    for i in 0..turns {
        let (stdout, stderr) =
            codex(&bin, &home, &work, &g.base, provider, i > 0, &prompt(i)).await;
        // Codex went on: this turn's answer came back.
        assert!(
            stdout.contains(&format!("to: Task {i}:"))
                || stderr.contains(&format!("to: Task {i}:")),
            "turn {i} got no answer:\n{stdout}\n{stderr}"
        );
        if stderr.contains("context compacted") || stdout.contains("context compacted") {
            compacted_at.push(i);
        }
        settle(&g.base).await;
    }
    let report = g.get("/contextfold/v1/report");
    let totals = &report["totals"];
    let posts = upstream.model_requests();
    let summarized = posts
        .iter()
        .filter(|p| String::from_utf8_lossy(&p.body).contains("<contextfold_summary"))
        .count();
    eprintln!(
        "codex ({}): {turns} turns, compacted before turns {compacted_at:?}, {} upstream requests ({summarized} carrying contextfold's summary); tokens Codex sent {} / tokens sent upstream {}; report {}",
        if provider == Provider::BuiltIn { "built-in provider" } else { "custom provider" },
        posts.len(),
        totals["tokens_client"],
        totals["tokens_sent"],
        serde_json::to_string(totals).unwrap()
    );
    for (i, p) in posts.iter().enumerate() {
        eprintln!(
            "  upstream {i}: {} bytes, {} input items",
            p.body.len(),
            p.json()["input"].as_array().map_or(0, Vec::len)
        );
    }
    let answered = totals["compactions_answered"].as_u64().unwrap();
    assert!(answered >= 1, "Codex never compacted: {totals}");
    assert_eq!(
        answered as usize,
        compacted_at.len(),
        "each compaction Codex made was answered by the gateway"
    );
    assert!(
        answered as usize <= turns / 2,
        "Codex compacted on every turn: {compacted_at:?}"
    );
    // The upstream did the turns, never a compaction.
    assert_eq!(posts.len(), turns);
    for p in &posts {
        let body = String::from_utf8_lossy(&p.body);
        assert!(!body.contains("compaction_trigger"));
        assert!(!body.contains("CONTEXT CHECKPOINT COMPACTION"));
        assert!(
            !body.contains("contextfold.v1:"),
            "a handle reached the upstream"
        );
    }
    assert!(
        summarized >= 1,
        "the upstream saw contextfold's summary after the compaction"
    );
    assert!(totals["tokens_sent"].as_u64() < totals["tokens_client"].as_u64());

    let items = rollout_items(&home);
    match provider {
        Provider::BuiltIn => {
            // The item is kept byte-exact in Codex's rollout, wherever it
            // records it.
            let kept = items
                .iter()
                .map(|v| v.to_string())
                .find(|s| s.contains("contextfold.v1:"))
                .unwrap_or_else(|| {
                    let kinds: Vec<String> = items
                        .iter()
                        .map(|v| format!("{}/{}", v["type"], v["payload"]["type"]))
                        .collect();
                    panic!("Codex kept no compaction handle; rollout items: {kinds:?}")
                });
            let item = items
                .iter()
                .flat_map(|v| {
                    v["payload"]["replacement_history"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .find(|i| {
                    i["encrypted_content"]
                        .as_str()
                        .is_some_and(|e| e.starts_with("contextfold.v1:"))
                })
                .unwrap_or_else(|| {
                    panic!("no compaction item in Codex's replacement history: {kept}")
                });
            let handle = item["encrypted_content"].as_str().unwrap();
            eprintln!(
                "the compaction item Codex received: {{\"type\":{},\"encrypted_content\":\"{}…\"}} ({} bytes of handle)",
                item["type"],
                &handle[..handle.len().min(80)],
                handle.len()
            );
        }
        Provider::Custom => {
            let text = items
                .iter()
                .map(|v| v.to_string())
                .find(|s| s.contains("<contextfold_summary"))
                .expect("Codex kept contextfold's summary");
            eprintln!("the summary Codex kept: {}…", &text[..text.len().min(200)]);
        }
    }
    g.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_builtin_provider_compacts_through_the_gateway_and_goes_on() {
    session(Provider::BuiltIn).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_custom_provider_compacts_through_the_gateway_and_goes_on() {
    session(Provider::Custom).await;
}
