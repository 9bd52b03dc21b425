//! `contextfold audit --nats` and `plot --nats`: the audit of a
//! conversation a running service folded, read from its partition of the
//! JetStream events stream and folded by the command under the same policy,
//! shows the very summaries the service holds.
//!
//! Needs nats-server (`CONTEXTFOLD_NATS_SERVER`, see scripts/test.sh);
//! skips without one unless `CONTEXTFOLD_REQUIRE_NATS` is set.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use contextfold::testing::small_policy;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use support::cli::{json_of, split};
use support::nats_server::{find_binary, NatsServer};
use support::serve::*;
use support::turns::turns;

const KEY: &str = "agent:audit/one";

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

/// `contextfold` under the small policy of the in-process service.
fn cli(data: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = support::cli::command(data, args)
        .env("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "6000")
        .env("CONTEXTFOLD_POLICY__FRESH_TAIL_COUNT", "6")
        .env("CONTEXTFOLD_POLICY__LEAF_CHUNK_TOKENS", "1200")
        .env("CONTEXTFOLD_POLICY__LEAF_TARGET_TOKENS", "200")
        .env("CONTEXTFOLD_POLICY__CONDENSED_TARGET_TOKENS", "200")
        .env("CONTEXTFOLD_POLICY__LEAF_FANOUT", "3")
        .env("CONTEXTFOLD_POLICY__CONDENSED_FANOUT", "2")
        .output()
        .expect("the contextfold binary runs");
    split(out)
}

/// The ids of the summaries the service holds for `key`.
fn held_summaries(service: &contextfold::nats::serve::Service, key: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    if let Some(engines) = service.engines() {
        for p in engines.partitions() {
            if let Some(engine) = engines.get(p) {
                let e = engine.lock().unwrap();
                if let Some(conv) = e.state.conversations.get(key) {
                    out.extend(conv.summaries.iter().map(|s| s.id.clone()));
                }
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_over_nats_shows_the_summaries_the_service_holds() {
    if !nats_available() {
        return;
    }
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let service = start_alone(options(
        &server.url(),
        &dir.path().join("serve"),
        &small_policy(),
        "audit",
    ))
    .await;
    let client = async_nats::connect(server.url()).await.unwrap();
    raw_publish(&client, &turns(KEY, 0..40, 60)).await;
    // Folded, compacted and quiet: the same state for a second.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = None;
    let mut since = Instant::now();
    loop {
        let now = conversations(&service).get(KEY).cloned();
        if now != last {
            last = now;
            since = Instant::now();
        } else if last.as_ref().is_some_and(|(t, s, _)| *t == 40 && *s > 0)
            && since.elapsed() > Duration::from_secs(1)
        {
            break;
        }
        assert!(Instant::now() < deadline, "not folded in 60 s: {last:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let held = held_summaries(&service, KEY);

    let url = server.url();
    let local = dir.path().join("cli");
    let (ok, out, err) = cli(&local, &["audit", KEY, "--nats", &url, "--json"]);
    assert!(ok, "audit --nats failed: {err}");
    let audit = json_of(&out);
    assert_eq!(audit["totals"]["turns"], 40, "{}", audit["totals"]);
    let audited: BTreeSet<String> = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "summary" && e["accepted"] == true)
        .map(|e| e["summary_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(audited, held, "summaries audited vs held by the service");
    let compactions = audit["totals"]["compactions"].as_u64().unwrap();
    assert!(compactions > 0);
    for c in audit["compactions"].as_array().unwrap() {
        assert!(c["outcome"].is_object(), "no sweep end for {c}");
    }
    assert!(
        !local.join("log").exists(),
        "audit --nats wrote an embedded log"
    );

    let svg = dir.path().join("plot.svg");
    let (ok, _, err) = cli(
        &local,
        &["plot", KEY, "--nats", &url, "--out", svg.to_str().unwrap()],
    );
    assert!(ok, "plot --nats failed: {err}");
    let text = std::fs::read_to_string(&svg).unwrap();
    let marks = text
        .to_ascii_uppercase()
        .matches(&format!("FILL=\"{}\"", contextfold::plot::COMPACTION_FILL))
        .count();
    assert_eq!(marks as u64, compactions);

    let (ok, _, err) = cli(&local, &["audit", "agent:nobody", "--nats", &url]);
    assert!(!ok);
    assert!(err.contains("no event in the log"), "{err}");
    service.shutdown().await;
}

/// `serve --http 127.0.0.1:0 --audit-page` (the binary): the page's JSON
/// endpoints answer beside `/metrics`, and what the page shows the model
/// saw after the conversation's last event is what `assemble --nats` gives
/// now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_mounts_the_audit_page_beside_the_operators_endpoints() {
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
        .env("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "6000")
        .env("CONTEXTFOLD_POLICY__FRESH_TAIL_COUNT", "6")
        .env("CONTEXTFOLD_POLICY__LEAF_CHUNK_TOKENS", "1200")
        .env("CONTEXTFOLD_POLICY__LEAF_TARGET_TOKENS", "200")
        .env("CONTEXTFOLD_POLICY__CONDENSED_TARGET_TOKENS", "200")
        .env("CONTEXTFOLD_POLICY__LEAF_FANOUT", "3")
        .env("CONTEXTFOLD_POLICY__CONDENSED_FANOUT", "2")
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
    assert!(
        std::fs::read_to_string(&log_path)
            .unwrap()
            .contains("the audit page at /"),
        "no audit page announced"
    );
    let client = async_nats::connect(server.url()).await.unwrap();
    let events = turns(KEY, 0..40, 60);
    raw_publish(&client, &events).await;
    let http = reqwest::Client::new();
    let get = |path: String| {
        let http = http.clone();
        let url = format!("{base}{path}");
        async move {
            let resp = http.get(&url).send().await.unwrap();
            let status = resp.status();
            (status, resp.text().await.unwrap())
        }
    };
    let key = KEY.replace('/', "%2F").replace(':', "%3A");
    // Folded and compacted, and quiet: the audit no longer changes.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    let audit = loop {
        let (status, body) = get(format!("/api/audit?c={key}")).await;
        if status.is_success() {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            let t = &v["audit"]["totals"];
            let done = t["turns"] == 40
                && t["compactions"].as_u64() > Some(0)
                && v["audit"]["compactions"]
                    .as_array()
                    .is_some_and(|c| c.iter().all(|c| c["outcome"].is_object()));
            if done && body == last {
                break v;
            }
            last = body;
        }
        assert!(
            Instant::now() < deadline,
            "no settled audit in 60 s: {last}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let (status, page) = get("/".to_string()).await;
    assert!(
        status.is_success() && page.contains("contextfold audit"),
        "{page}"
    );
    let (status, metrics) = get("/metrics".to_string()).await;
    assert!(status.is_success(), "{metrics}");
    let (status, list) = get("/api/conversations".to_string()).await;
    assert!(status.is_success(), "{list}");
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert!(
        list["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["conversation"] == KEY && c["health"] == "ok"),
        "{list}"
    );
    let last_event = audit["audit"]["points"].as_array().unwrap().last().unwrap()["event_id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, shown) = get(format!(
        "/api/context?c={key}&at={}",
        last_event.replace('#', "%23")
    ))
    .await;
    assert!(status.is_success(), "{shown}");
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    let (ok, now, err) = cli(
        &dir.path().join("cli"),
        &["assemble", KEY, "--nats", &server.url(), "--json"],
    );
    assert!(ok, "{err}");
    let now = json_of(&now);
    assert_eq!(shown["messages"], now["messages"]);
    assert_eq!(shown["sources"], now["sources"]);
    let summary = audit["dag"]["nodes"][0]["id"].as_str().unwrap().to_string();
    let (status, described) = get(format!("/api/describe?c={key}&id={summary}")).await;
    assert!(
        status.is_success() && described.contains(&summary),
        "{described}"
    );
    child.kill().await.unwrap();
}
