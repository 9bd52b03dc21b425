//! What an operator relies on: keying (a rewind forks, a replay stores
//! nothing twice, explicit keys), overflow errors recorded and (opt-in)
//! retried with the assembled context, tenants by gateway key (their own
//! conversation prefix and upstream credential, unknown keys refused,
//! `x-contextfold-*` never upstream, one tenant's slow upstream never
//! holding another's requests), bounded bodies.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/gateway.rs"]
mod gw;

use gw::{cli_json, long_turn, settle, stored_messages, Behaviour, GatewayProc, Upstream};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

async fn chat(
    base: &str,
    headers: &[(&str, &str)],
    msgs: &[Value],
) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "gpt-4o", "messages": msgs}));
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let h = r.headers().clone();
    (status, h, r.json().await.unwrap_or(Value::Null))
}

fn conv_of(h: &reqwest::header::HeaderMap) -> String {
    h["x-contextfold-conversation"]
        .to_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewind_forks_and_a_replay_stores_nothing_twice() {
    let up = Upstream::start(Behaviour::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut g = GatewayProc::start(dir.path(), &up.base, "", &[]);
    let sys = json!({"role": "system", "content": "S"});
    let mut msgs = vec![
        sys.clone(),
        json!({"role": "user", "content": "plan the migration"}),
    ];
    let (_, h, v) = chat(&g.base, &[], &msgs).await;
    let root = conv_of(&h);
    msgs.push(v["choices"][0]["message"].clone());
    msgs.push(json!({"role": "user", "content": "step two: migrate users"}));
    let (_, h, v) = chat(&g.base, &[], &msgs).await;
    assert_eq!(conv_of(&h), root);
    msgs.push(v["choices"][0]["message"].clone());
    settle(&g.base).await;
    // The same request again, twice: nothing new.
    let replay = msgs[..4].to_vec();
    for _ in 0..2 {
        let (_, h, _) = chat(&g.base, &[], &replay).await;
        assert_eq!(conv_of(&h), root);
    }
    // A rewind: the client edits step two.
    let mut rewound = msgs[..3].to_vec();
    rewound.push(json!({"role": "user", "content": "step two: migrate orders instead"}));
    let (_, h, _) = chat(&g.base, &[], &rewound).await;
    let fork = conv_of(&h);
    assert_ne!(fork, root);
    assert!(fork.starts_with(&root), "{fork} names its parent {root}");
    assert_eq!(h["x-contextfold-keyed-by"], "prefix");
    settle(&g.base).await;
    g.stop();
    let original = stored_messages(dir.path(), &root);
    assert_eq!(original.len(), 4, "{original:#?}");
    assert_eq!(original[2]["content"], "step two: migrate users");
    let forked = stored_messages(dir.path(), &fork);
    assert_eq!(forked.len(), 4, "the shared prefix, the edit, its answer");
    assert_eq!(forked[0]["content"], "plan the migration");
    assert_eq!(forked[2]["content"], "step two: migrate orders instead");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflow_is_recorded_and_retried_with_the_assembled_context() {
    let up = Upstream::start(Behaviour::default()).await;
    let dir = tempfile::tempdir().unwrap();
    // A budget the gateway thinks is large; the upstream overflows first.
    let config = format!(
        "{}\n[gateway]\nretry_overflow = true\nbudget_tokens = 1000000\n",
        gw::SMALL_POLICY
    );
    let mut g = GatewayProc::start(dir.path(), &up.base, &config, &[]);
    let mut msgs = vec![json!({"role": "system", "content": "S"})];
    for i in 0..45 {
        msgs.push(json!({"role": "user", "content": long_turn(i)}));
        let (status, _, v) = chat(&g.base, &[("x-contextfold-conversation", "ovf")], &msgs).await;
        assert_eq!(status, 200);
        msgs.push(v["choices"][0]["message"].clone());
        settle(&g.base).await;
    }
    let size = up.model_requests().last().unwrap().body.len();
    up.set(Behaviour {
        overflow_over_bytes: Some(size / 2),
        ..Behaviour::default()
    });
    msgs.push(json!({"role": "user", "content": "one more"}));
    let (status, h, v) = chat(&g.base, &[("x-contextfold-conversation", "ovf")], &msgs).await;
    assert_eq!(status, 200, "retried with the assembled context: {v}");
    assert_eq!(h["x-contextfold-context"], "assembled");
    let posts = up.model_requests();
    let (failed, retried) = (&posts[posts.len() - 2], &posts[posts.len() - 1]);
    assert!(failed.body.len() > size / 2 && retried.body.len() <= size / 2);
    settle(&g.base).await;
    g.stop();
    // Recorded as the provider said it.
    let history = cli_json(dir.path(), &["history", "ovf"]);
    let text = history.to_string();
    assert!(text.contains("overflow"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_opt_in_an_overflow_goes_back_unchanged() {
    let up = Upstream::start(Behaviour {
        overflow_over_bytes: Some(10),
        ..Behaviour::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let g = GatewayProc::start(dir.path(), &up.base, "", &[]);
    let (status, _, v) = chat(&g.base, &[], &[json!({"role": "user", "content": "hi"})]).await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(up.model_requests().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_kept_apart_and_hold_their_credentials() {
    let up = Upstream::start(Behaviour {
        slow_marker: Some("SLOW".into()),
        slow_delay: Duration::from_secs(3),
        ..Behaviour::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = r#"
[gateway]
max_in_flight_per_tenant = 2
max_body_bytes = 65536
[[gateway.tenants]]
name = "acme"
key = "gk-acme-0001"
upstream_api_key = "sk-upstream-acme"
[[gateway.tenants]]
name = "globex"
key = "gk-globex-0002"
"#;
    let g = GatewayProc::start(dir.path(), &up.base, config, &[]);
    let same = [json!({"role": "user", "content": "the same first words"})];
    let (s1, h1, _) = chat(
        &g.base,
        &[
            ("x-contextfold-key", "gk-acme-0001"),
            ("authorization", "Bearer sk-client"),
        ],
        &same,
    )
    .await;
    let (s2, h2, _) = chat(
        &g.base,
        &[("authorization", "Bearer gk-globex-0002")],
        &same,
    )
    .await;
    assert_eq!((s1, s2), (200, 200));
    assert!(conv_of(&h1).starts_with("acme/"), "{}", conv_of(&h1));
    assert!(conv_of(&h2).starts_with("globex/"), "{}", conv_of(&h2));
    let (s3, _, v3) = chat(&g.base, &[("x-contextfold-key", "wrong")], &same).await;
    assert_eq!(s3, 401);
    assert_eq!(v3["error"]["type"], "authentication_error");
    let posts = up.model_requests();
    assert_eq!(posts.len(), 2, "the refused request never went upstream");
    // acme's held credential replaced the client's; globex's gateway key
    // (its bearer token) never left the gateway.
    assert_eq!(
        posts[0].header("authorization"),
        Some("Bearer sk-upstream-acme")
    );
    assert_eq!(posts[1].header("authorization"), None);
    assert!(posts.iter().all(|p| p
        .headers
        .iter()
        .all(|(n, _)| !n.starts_with("x-contextfold"))));
    // A body over the limit: 413 in the provider's shape, nothing upstream.
    let big = [json!({"role": "user", "content": "x".repeat(70_000)})];
    let (s4, _, v4) = chat(&g.base, &[("x-contextfold-key", "gk-acme-0001")], &big).await;
    assert_eq!(s4, 413);
    assert_eq!(v4["error"]["code"], "request_too_large");
    // acme's slow upstream fills acme's allowance, never globex's.
    let base = g.base.clone();
    let slow: Vec<_> = (0..4)
        .map(|i| {
            let base = base.clone();
            tokio::spawn(async move {
                chat(
                    &base,
                    &[("x-contextfold-key", "gk-acme-0001")],
                    &[json!({"role": "user", "content": format!("SLOW {i}")})],
                )
                .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let (s5, _, _) = chat(
        &g.base,
        &[("x-contextfold-key", "gk-globex-0002")],
        &[json!({"role": "user", "content": "quick one"})],
    )
    .await;
    assert_eq!(s5, 200);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "globex waited {:?} behind acme",
        started.elapsed()
    );
    for s in slow {
        assert_eq!(s.await.unwrap().0, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_leaves_a_partial_turn_marked_aborted() {
    let up = Upstream::start(Behaviour {
        chunk_delay: Duration::from_millis(150),
        ..Behaviour::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut g = GatewayProc::start(dir.path(), &up.base, "", &[]);
    let mut r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", g.base))
        .header("x-contextfold-conversation", "leaver")
        .json(&json!({"model": "gpt-4o", "stream": true,
            "messages": [{"role": "user", "content": "tell me a long story about the gateway"}]}))
        .send()
        .await
        .unwrap();
    let first = r.chunk().await.unwrap().unwrap();
    let second = r.chunk().await.unwrap().unwrap();
    assert!(!first.is_empty() && !second.is_empty());
    drop(r);
    tokio::time::sleep(Duration::from_millis(500)).await;
    settle(&g.base).await;
    g.stop();
    let turn = cli_json(dir.path(), &["describe", "leaver", "1"]);
    let text = turn.to_string();
    assert!(text.contains("\"aborted\":true"), "{text}");
    let content = turn["message"]["content"].as_str().unwrap();
    assert!(content.starts_with("reply"), "what arrived is kept: {text}");
    assert!(!content.contains("gateway"), "the stream was cut: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_checks_the_upstream() {
    let up = Upstream::start(Behaviour::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("c.toml");
    std::fs::write(&conf, format!("[gateway]\nupstream = \"{}\"\n", up.base)).unwrap();
    let run = |conf: &std::path::Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_contextfold"))
            .arg("--config")
            .arg(conf)
            .arg("--data")
            .arg(dir.path())
            .args(["doctor", "--json", "--nats", "nats://127.0.0.1:9"])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == "gateway upstream")
            .cloned()
            .unwrap()
    };
    let ok = run(&conf);
    assert_eq!(ok["level"], "ok", "{ok}");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[gateway]\nupstream = \"http://127.0.0.1:9\"\n").unwrap();
    let fail = run(&bad);
    assert_eq!(fail["level"], "fail", "{fail}");
    assert!(fail["detail"].as_str().unwrap().contains("unreachable"));
}
