//! The gateway's added latency to first byte, over a loopback upstream,
//! for a conversation of about 100,000 tokens (goal: under 1 ms p50 and
//! 3 ms p99).
//!
//! An in-process upstream answers `POST /v1/chat/completions` with its
//! first SSE chunk at once. Each round sends the same request (the 100k
//! conversation plus one new user turn, as an agent does every turn) once
//! straight to the upstream and once through the gateway (embedded store
//! in memory), alternating, on kept-alive connections; the time to the
//! first body byte is measured for each, and the added latency is the
//! gateway's minus the direct one of the same round. Two cases:
//! `forwarded` (the conversation fits the budget: the body goes up
//! unchanged) and `assembled` (past the budget: rebuilt as client system,
//! summary block, fresh tail).
//!
//! Run: `cargo bench --bench gateway` (`CONTEXTFOLD_BENCH_ROUNDS`, default
//! 400).

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use axum::body::Body;
use axum::response::Response;
use contextfold::config::Config;
use contextfold::core::policy::PolicyConfig;
use contextfold::gateway::{self, Store};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

async fn upstream() -> String {
    let app = axum::Router::new().fallback(|req: axum::extract::Request| async {
        // Read the whole request as a provider does: a server that answers
        // before the body is in closes the connection under the client's
        // next request on it (hyper's IncompleteMessage).
        let _ = axum::body::to_bytes(req.into_body(), usize::MAX).await;
        let chunks = futures::stream::iter([
            Ok::<_, std::io::Error>(bytes::Bytes::from_static(
                b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"ok\"}}]}\n\n",
            )),
            Ok(bytes::Bytes::from_static(b"data: [DONE]\n\n")),
        ]);
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(chunks))
            .unwrap()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// About 100,000 tokens of a coding session: 200 turns.
fn conversation() -> Vec<Value> {
    let mut msgs = vec![json!({"role": "system", "content": "You are a coding agent."})];
    for i in 0..200 {
        let mut text = format!("Turn {i}: ");
        for k in 0..31 {
            text.push_str(&format!(
                "file src/m{i}/f{k}.rs line {} returns {} items; ",
                i * 31 + k,
                k * 7 + i
            ));
        }
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        msgs.push(json!({"role": role, "content": text}));
    }
    msgs
}

async fn ttfb(client: &reqwest::Client, url: &str, body: &[u8]) -> Duration {
    let started = Instant::now();
    let mut r = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .await
        .unwrap();
    let first = r.chunk().await.unwrap();
    let elapsed = started.elapsed();
    assert!(first.is_some());
    while r.chunk().await.unwrap().is_some() {}
    elapsed
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn case(name: &str, window: u64, rounds: usize) {
    let up = upstream().await;
    let mut config = Config {
        policy: PolicyConfig {
            default_context_window: window,
            ..PolicyConfig::default()
        },
        ..Config::default()
    };
    config.gateway.listen = "127.0.0.1:0".parse().unwrap();
    config.gateway.upstream = Some(up.clone());
    let store = Store::in_memory(config.policy.clone()).unwrap();
    let running = gateway::start(&config, store, std::future::pending())
        .await
        .unwrap();
    let gw = format!("http://{}", running.addr);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4)
        .build()
        .unwrap();
    let mut msgs = conversation();
    let tokens: u64 = msgs
        .iter()
        .map(|m| {
            contextfold::core::tokens::count_text(
                contextfold::core::tokens::Encoding::O200kBase,
                m["content"].as_str().unwrap(),
            )
        })
        .sum();
    // Warm: the gateway stores the conversation and compacts it.
    let warm =
        serde_json::to_vec(&json!({"model": "gpt-4o", "stream": true, "messages": msgs})).unwrap();
    for _ in 0..1 {
        ttfb(&client, &format!("{gw}/v1/chat/completions"), &warm).await;
        running.gateway.store.flush().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut direct = Vec::new();
    let mut through = Vec::new();
    let mut added = Vec::new();
    let mut assembled = 0;
    // The upstream's answer, as the client keeps it.
    msgs.push(json!({"role": "assistant", "content": "ok"}));
    let mut internal = Vec::new();
    for i in 0..rounds {
        msgs.push(json!({"role": "user", "content": format!("round {i}: continue with step {i}")}));
        let body =
            serde_json::to_vec(&json!({"model": "gpt-4o", "stream": true, "messages": msgs}))
                .unwrap();
        let d = ttfb(&client, &format!("{up}/v1/chat/completions"), &body).await;
        let started = Instant::now();
        let r = client
            .post(format!("{gw}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        if r.headers()["x-contextfold-context"] == "assembled" {
            assembled += 1;
        }
        if let Some(us) = r.headers().get("x-contextfold-added-us") {
            internal.push(us.to_str().unwrap().parse::<f64>().unwrap() / 1e3);
        }
        let mut r = r;
        r.chunk().await.unwrap();
        let g = started.elapsed();
        while r.chunk().await.unwrap().is_some() {}
        msgs.push(json!({"role": "assistant", "content": "ok"}));
        direct.push(d.as_secs_f64() * 1e3);
        through.push(g.as_secs_f64() * 1e3);
        added.push((g.as_secs_f64() - d.as_secs_f64()) * 1e3);
    }
    for v in [&mut direct, &mut through, &mut added, &mut internal] {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    println!(
        "{name}: {} messages at the start, ~{tokens} tokens, {} bytes a request, {assembled}/{rounds} assembled\n  \
         direct TTFB   p50 {:.3} ms  p99 {:.3} ms\n  \
         gateway TTFB  p50 {:.3} ms  p99 {:.3} ms\n  \
         added         p50 {:.3} ms  p99 {:.3} ms\n  \
         in the gateway before the upstream call  p50 {:.3} ms  p99 {:.3} ms",
        201,
        warm.len(),
        percentile(&direct, 0.5),
        percentile(&direct, 0.99),
        percentile(&through, 0.5),
        percentile(&through, 0.99),
        percentile(&added, 0.5),
        percentile(&added, 0.99),
        percentile(&internal, 0.5),
        percentile(&internal, 0.99),
    );
}

fn main() {
    let rounds: usize = std::env::var("CONTEXTFOLD_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        case("forwarded (fits a 200k budget)", 200_000, rounds).await;
        case("assembled (past a 64k budget)", 64_000, rounds).await;
    });
}
