//! The embedded gateway with `[summarizer]` configured: its sweeps run
//! with the model beside the fold (turns keep being stored while a sweep
//! waits on the model), and each tenant is held to its own spend window
//! (`summary_max_calls_per_window_tenant`), so one tenant's long sessions
//! cannot use up the model calls another's need.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/gateway.rs"]
mod gw;
#[path = "support/llm_server.rs"]
mod llm_server;

use gw::{cli_json, long_turn, settle, Behaviour, GatewayProc, Upstream, SMALL_POLICY};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TENANT_CALLS: u64 = 3;

/// Sends `turns` long user turns of one conversation through the gateway,
/// the whole history each time as a client does; returns the resolved
/// conversation id.
async fn session(base: &str, key: &str, name: &str, turns: usize) -> String {
    let client = reqwest::Client::new();
    let mut msgs = vec![json!({"role": "system", "content": "You are a coding agent."})];
    let mut conversation = String::new();
    for i in 0..turns {
        msgs.push(json!({"role": "user", "content": format!("{name}: {}", long_turn(i))}));
        let r = client
            .post(format!("{base}/v1/chat/completions"))
            .header("x-contextfold-key", key)
            .header("x-contextfold-conversation", name)
            .json(&json!({"model": "gpt-4o", "messages": msgs}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        conversation = r.headers()["x-contextfold-conversation"]
            .to_str()
            .unwrap()
            .to_string();
        let v: Value = r.json().await.unwrap();
        msgs.push(v["choices"][0]["message"].clone());
        settle(base).await;
    }
    conversation
}

/// Waits until the model has been quiet for two seconds.
async fn until_quiet(llm: &llm_server::ScriptedServer) {
    let started = Instant::now();
    let mut seen = usize::MAX;
    while llm.received().len() != seen {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the sweeps never ended"
        );
        seen = llm.received().len();
        tokio::time::sleep(Duration::from_millis(2_000)).await;
    }
}

fn model_config(llm: &llm_server::ScriptedServer, extra: &str) -> String {
    format!(
        r#"{SMALL_POLICY}{extra}

[summarizer]
base_url = "{}"
model = "good"
api_key_env = "CONTEXTFOLD_TEST_UNSET_KEY"
"#,
        llm.base_url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_gateway_summarizes_with_the_model_and_holds_each_tenant_to_its_window() {
    // A model that answers in the handover shape (the checks refuse an
    // echo of the request).
    let llm = llm_server::ScriptedServer::start(llm_server::Scripted::handover).await;
    let up = Upstream::start(Behaviour::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = model_config(
        &llm,
        &format!(
            r#"summary_max_calls_per_window_tenant = {TENANT_CALLS}

[[gateway.tenants]]
name = "acme"
key = "gk-acme-0001"
[[gateway.tenants]]
name = "globex"
key = "gk-globex-0002""#
        ),
    );
    let mut g = GatewayProc::start(dir.path(), &up.base, &config, &[]);
    // acme's two long sessions come first and owe more calls than acme
    // may make; globex's comes after.
    let a1 = session(&g.base, "gk-acme-0001", "a1", 40).await;
    let a2 = session(&g.base, "gk-acme-0001", "a2", 40).await;
    let g1 = session(&g.base, "gk-globex-0002", "g1", 40).await;
    assert!(a1.starts_with("acme/") && a2.starts_with("acme/") && g1.starts_with("globex/"));
    // The sweeps run beside the fold: wait until the model is quiet.
    until_quiet(&llm).await;
    g.stop();

    let status = |conv: &str| cli_json(dir.path(), &["status", conv]);
    let (s1, s2, sg) = (status(&a1), status(&a2), status(&g1));
    let tenant = |s: &Value| s["spend_window"]["partition"]["tenant"].clone();
    assert_eq!(tenant(&s1)["tenant"], "acme/");
    assert_eq!(tenant(&sg)["tenant"], "globex/");
    let acme_calls = tenant(&s1)["calls"].as_u64().unwrap();
    let globex_calls = tenant(&sg)["calls"].as_u64().unwrap();
    assert_eq!(tenant(&s2)["calls"].as_u64().unwrap(), acme_calls);
    assert!(
        (1..=TENANT_CALLS).contains(&acme_calls),
        "acme made {acme_calls} calls: {}",
        tenant(&s1)
    );
    // Every model call the server saw was counted against a tenant.
    assert_eq!(
        llm.received().len() as u64,
        acme_calls + globex_calls,
        "calls seen by the model against calls counted"
    );
    // acme owes more than its window allows: one of its sessions waits on
    // the tenant's window, not its own.
    let waits: Vec<Value> = [&s1, &s2]
        .iter()
        .map(|s| s["debt"]["waiting_on"].clone())
        .collect();
    assert!(
        waits.iter().any(|w| w == "tenant_window"),
        "acme's debts wait on {waits:?}"
    );
    // globex got its calls, and its summaries are the model's.
    assert!(globex_calls >= 1, "{}", tenant(&sg));
    let model_written =
        sg["summaries"]["total"].as_u64().unwrap() - sg["summaries"]["fallback"].as_u64().unwrap();
    assert!(model_written >= 1, "{}", sg["summaries"]);
}

/// A stop drops the sweeps in flight; their jobs are pending in the state
/// and run again when the gateway starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweeps_a_stop_cut_short_run_again_when_the_gateway_starts() {
    let slow = Arc::new(AtomicBool::new(true));
    let s = slow.clone();
    let llm = llm_server::ScriptedServer::start(move |req| {
        let answer = llm_server::Scripted::handover(req);
        if s.load(Ordering::SeqCst) {
            answer.delayed(Duration::from_secs(60))
        } else {
            answer
        }
    })
    .await;
    let up = Upstream::start(Behaviour::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = model_config(&llm, "");
    let mut g = GatewayProc::start(dir.path(), &up.base, &config, &[]);
    let conv = session(&g.base, "", "long", 30).await;
    // A sweep waits on the model; the gateway stops under it.
    let started = Instant::now();
    while llm.received().is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no sweep began"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    g.stop();
    let before = cli_json(dir.path(), &["status", &conv]);
    assert_eq!(before["summaries"]["total"], 0, "{}", before["summaries"]);
    assert!(!before["pending_job"].is_null(), "the job is pending");

    slow.store(false, Ordering::SeqCst);
    let mut g = GatewayProc::start(dir.path(), &up.base, &config, &[]);
    until_quiet(&llm).await;
    g.stop();
    let after = cli_json(dir.path(), &["status", &conv]);
    let model_written = after["summaries"]["total"].as_u64().unwrap()
        - after["summaries"]["fallback"].as_u64().unwrap();
    assert!(model_written >= 1, "{}", after["summaries"]);
}
