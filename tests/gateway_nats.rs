//! The gateway with `--nats`: turns published to a real JetStream
//! deployment (`contextfold serve` in-process, its api role answering the
//! blocks), two gateway replicas sending the same bytes, and NATS going
//! away: fail-open (forwarded, spooled, published when NATS is back) or
//! refuse (a provider-shaped 503 with Retry-After), as configured.
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/gateway.rs"]
mod gw;
mod support;

use contextfold::core::policy::PolicyConfig;
use contextfold::nats::config::StorageKind;
use contextfold::nats::serve::Roles;
use gw::{long_turn, settle, Behaviour, GatewayProc, Upstream};
use serde_json::{json, Value};
use std::time::Duration;
use support::nats_server::NatsServer;
use support::serve::{conversation_of, options, start_alone, wait_until};

fn policy() -> PolicyConfig {
    PolicyConfig {
        default_context_window: 20000,
        fresh_tail_count: 6,
        leaf_chunk_tokens: 4000,
        leaf_target_tokens: 300,
        condensed_target_tokens: 300,
        leaf_fanout: 3,
        condensed_fanout: 2,
        ..PolicyConfig::default()
    }
}

async fn post(base: &str, msgs: &[Value]) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .header("x-contextfold-conversation", "nats-session")
        .json(&json!({"model": "gpt-4o", "messages": msgs}))
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_mode_replicas_and_failures() {
    let mut nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&nats.url(), &dir.path().join("serve"), &policy(), "serve-1");
    opts.nats.storage = StorageKind::File;
    opts.roles = "folder,summarizer,api".parse::<Roles>().unwrap();
    let service = start_alone(opts).await;

    let up = Upstream::start(Behaviour::default()).await;
    let config = format!(
        "{}\n[gateway]\nupstream_timeout_ms = 20000\n",
        gw::SMALL_POLICY
    );
    let refuse = format!("{config}on_store_unavailable = \"refuse\"\n");
    let ga = GatewayProc::start(
        &dir.path().join("a"),
        &up.base,
        &config,
        &["--nats", &nats.url()],
    );
    let gb = GatewayProc::start(
        &dir.path().join("b"),
        &up.base,
        &config,
        &["--nats", &nats.url()],
    );
    let gc = GatewayProc::start(
        &dir.path().join("c"),
        &up.base,
        &refuse,
        &["--nats", &nats.url()],
    );

    // A session through replica A, long enough to compact in the deployment.
    let mut msgs = vec![json!({"role": "system", "content": "terse"})];
    for i in 0..45 {
        msgs.push(json!({"role": "user", "content": long_turn(i)}));
        let r = post(&ga.base, &msgs).await;
        assert!(r.status().is_success());
        let v: Value = r.json().await.unwrap();
        msgs.push(v["choices"][0]["message"].clone());
        settle(&ga.base).await;
    }
    let conv = "nats-session";
    wait_until(
        "the deployment holds every turn",
        Duration::from_secs(20),
        || conversation_of(&service, conv).is_some_and(|c| c.turns.len() == 90),
    )
    .await;
    wait_until(
        "summaries in the deployment",
        Duration::from_secs(20),
        || conversation_of(&service, conv).is_some_and(|c| !c.summaries.is_empty()),
    )
    .await;

    // Both replicas learn the block from the deployment; the same request
    // through each sends the same bytes.
    msgs.push(json!({"role": "user", "content": "short: what is next?"}));
    let mut bodies = Vec::new();
    let mut first_answer = None;
    for _ in 0..3 {
        for g in [&ga, &gb] {
            let n = up.model_requests().len();
            let r = post(&g.base, &msgs).await;
            assert!(r.status().is_success());
            let v: Value = r.json().await.unwrap();
            first_answer.get_or_insert(v["choices"][0]["message"].clone());
            settle(&g.base).await;
            bodies.push(up.model_requests()[n].body.clone());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (a, b) = (&bodies[bodies.len() - 2], &bodies[bodies.len() - 1]);
    assert!(
        String::from_utf8_lossy(a).contains("<contextfold_summary"),
        "assembled from the deployment's summaries"
    );
    assert!(a == b, "two replicas, the same bytes");

    // NATS goes away.
    nats.kill();
    let before = up.model_requests().len();
    // The client goes on with the answer the deployment kept (the
    // replicas' later answers to the same request had its id: dropped).
    msgs.push(first_answer.unwrap());
    msgs.push(json!({"role": "user", "content": "while NATS is down: keep going"}));
    let r = post(&ga.base, &msgs).await;
    assert!(
        r.status().is_success(),
        "fail-open: the request still went upstream"
    );
    assert_eq!(up.model_requests().len(), before + 1);
    let refused = post(&gc.base, &msgs).await;
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "5");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["type"], "server_error");
    assert_eq!(
        up.model_requests().len(),
        before + 1,
        "refused: nothing went upstream"
    );
    let mut spooled = 0;
    for i in 0..300 {
        let ready = ga.get("/contextfold/v1/readyz");
        if i % 20 == 0 {
            eprintln!("readyz while NATS is down: {ready}");
        }
        spooled = ready["spooled"].as_u64().unwrap_or(0);
        if spooled >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(spooled >= 2, "the accepted turns wait in the spool");
    assert_eq!(ga.get("/contextfold/v1/readyz")["store_reachable"], false);

    // NATS is back: the spool drains, in order, and the turns are stored.
    nats.restart();
    let mut drained = false;
    for i in 0..600 {
        let ready = ga.get("/contextfold/v1/readyz");
        if i % 50 == 0 {
            eprintln!("readyz after NATS is back: {ready}");
        }
        if ready["spooled"] == 0 {
            drained = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(drained, "the spool drains when NATS is back");
    wait_until(
        "the spooled turns in the deployment",
        Duration::from_secs(20),
        || conversation_of(&service, conv).is_some_and(|c| c.turns.len() == 94),
    )
    .await;
    drop((ga, gb, gc));
    service.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_the_gateway_role() {
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start(Behaviour::default()).await;
    let port = gw::free_port();
    let conf = dir.path().join("c.toml");
    std::fs::write(
        &conf,
        format!(
            "[gateway]\nupstream = \"{}\"\nlisten = \"127.0.0.1:{port}\"\n",
            up.base
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_contextfold"))
        .arg("--config")
        .arg(&conf)
        .arg("--data")
        .arg(dir.path())
        .args([
            "serve",
            "--roles",
            "folder,summarizer,api,gateway",
            "--nats",
            &nats.url(),
        ])
        .env_remove("CONTEXTFOLD_CONFIG")
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let mut up_now = false;
    for _ in 0..200 {
        if client
            .get(format!("{base}/contextfold/v1/healthz"))
            .send()
            .await
            .is_ok()
        {
            up_now = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up_now, "serve's gateway role listens");
    let msgs = [json!({"role": "user", "content": "through serve's gateway role"})];
    let r = post(&base, &msgs).await;
    assert!(r.status().is_success());
    settle(&base).await;
    // The deployment serve runs stored the turns: ask its API.
    let mut stored = 0;
    for _ in 0..100 {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_contextfold"))
            .arg("--data")
            .arg(dir.path())
            .args(["status", "nats-session", "--nats", &nats.url()])
            .env_remove("CONTEXTFOLD_CONFIG")
            .output()
            .unwrap();
        if let Ok(v) = serde_json::from_slice::<Value>(&out.stdout) {
            stored = v["turns"]["total"].as_u64().unwrap_or(0);
            if stored == 2 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stored, 2);
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let _ = child.wait();
}
