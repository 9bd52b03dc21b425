//! The audit page of `serve --http ADDR --audit-page` over a deployment with
//! more conversations than the page once listed (500): every one is reached
//! page by page, counted, searched and naturally sorted, and a degraded one
//! comes first when sorted by health, its status asked of the API role.
//!
//! Needs nats-server (`CONTEXTFOLD_NATS_SERVER`, see scripts/test.sh);
//! skips without one unless `CONTEXTFOLD_REQUIRE_NATS` is set.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use contextfold::core::event::Envelope;
use contextfold::core::message::{ChatMessage, Role};
use std::time::{Duration, Instant};
use support::nats_server::{find_binary, NatsServer};
use support::serve::raw_publish;

const CONVERSATIONS: usize = 640;

fn nats_available() -> bool {
    let Err(msg) = find_binary() else {
        return true;
    };
    if std::env::var_os("CONTEXTFOLD_REQUIRE_NATS").is_some() {
        panic!("CONTEXTFOLD_REQUIRE_NATS is set but: {msg}");
    }
    eprintln!("SKIPPED: {msg}");
    false
}

fn turn(conv: &str, i: usize, message: ChatMessage) -> Envelope {
    let i = i as u64;
    contextfold::testing::turn_of(conv, i, 1_700_000_000_000 + i * 1_000, message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_lists_every_conversation_of_a_deployment_past_500() {
    if !nats_available() {
        return;
    }
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("serve.log");
    let stderr = std::fs::File::create(&log_path).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_contextfold"))
        .arg("--data")
        .arg(dir.path().join("serve"))
        .args([
            "serve",
            "--nats",
            &server.url(),
            "--http",
            "127.0.0.1:0",
            "--audit-page",
        ])
        .env_remove("CONTEXTFOLD_CONFIG")
        .env("CONTEXTFOLD_NATS__STORAGE", "memory")
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .expect("contextfold serve starts");
    let up = Instant::now() + Duration::from_secs(30);
    let base = loop {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        if let Some(url) = log
            .split_whitespace()
            .find(|w| w.starts_with("http://127.0.0.1:"))
        {
            if log.contains("Ctrl-C or SIGTERM stops") {
                break url.trim_end_matches('/').to_string();
            }
        }
        assert!(Instant::now() < up, "serve did not come up:\n{log}");
        assert!(child.try_wait().unwrap().is_none(), "serve exited:\n{log}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // 640 conversations of two turns; `agent-7`'s third turn is a tool
    // result without its call: rejected, so it is degraded.
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut events = Vec::new();
    for c in 0..CONVERSATIONS {
        let conv = format!("agent-{c}");
        events.push(turn(
            &conv,
            0,
            ChatMessage::text(Role::User, format!("hello from {conv}")),
        ));
        events.push(turn(&conv, 1, ChatMessage::text(Role::Assistant, "hi")));
    }
    events.push(turn("agent-7", 2, ChatMessage::text(Role::Tool, "exit 0")));
    raw_publish(&client, &events).await;

    let http = reqwest::Client::new();
    let get = |path: String| {
        let http = http.clone();
        let url = format!("{base}{path}");
        async move {
            let resp = http.get(&url).send().await.unwrap();
            assert!(resp.status().is_success(), "{url}: {}", resp.status());
            resp.json::<serde_json::Value>().await.unwrap()
        }
    };
    // Every conversation folded and listed.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let page = get("/api/conversations?sort=health&limit=1".into()).await;
        if page["total"] == CONVERSATIONS && page["conversations"][0]["health"] == "degraded" {
            assert_eq!(
                page["conversations"][0]["conversation"], "agent-7",
                "{page}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every conversation listed: {page}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut listed = Vec::new();
    let mut offset = 0;
    loop {
        let page = get(format!("/api/conversations?limit=500&offset={offset}")).await;
        assert_eq!(page["total"], CONVERSATIONS);
        let rows = page["conversations"].as_array().unwrap();
        if rows.is_empty() {
            break;
        }
        for r in rows {
            assert_ne!(r["health"], "unknown", "{r}");
            assert_eq!(r["turns"], 2, "{r}");
        }
        offset += rows.len();
        listed.extend(
            rows.iter()
                .map(|r| r["conversation"].as_str().unwrap().to_string()),
        );
    }
    assert_eq!(listed.len(), CONVERSATIONS, "the page lists them all");
    let want: Vec<String> = (0..CONVERSATIONS).map(|c| format!("agent-{c}")).collect();
    assert_eq!(listed, want, "natural order");
    let found = get("/api/conversations?q=agent-63".into()).await;
    assert_eq!(found["matched"], 11, "agent-63 and agent-630..639: {found}");
    child.kill().await.unwrap();
}
