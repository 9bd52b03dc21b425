//! `contextfold recall` as a user runs it: the built binary over an embedded
//! store that compacted a conversation (deterministic summaries), asking a
//! loopback OpenAI-compatible server of our own (`ScriptedServer`), which
//! records what it was sent. Checks the answer and its sources, that what
//! the model was sent is bounded by the cap and holds the turn with the
//! answer, that the spend shows in `status`, that a deadline shorter than
//! the server's delay ends the call quickly with the deadline error (its
//! spend counted too), and that an exhausted spend window refuses without
//! calling the model.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/llm_server.rs"]
mod llm_server;
mod support;

use contextfold::core::message::{ChatMessage, Role};
use contextfold::core::tokens::{count_message, Encoding};
use llm_server::{completion, Scripted, ScriptedServer};
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

const CONV: &str = "team:billing/recall";
const NEEDLE: &str = "deploy key K-7731";
const MODEL: &str = "m-recall";
const ANSWER: &str = "The deploy key to rotate is K-7731 (turn 0).";

/// Policy small enough that the conversation compacts.
const POLICY: [(&str, &str); 4] = [
    ("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "6000"),
    ("CONTEXTFOLD_POLICY__FRESH_TAIL_COUNT", "6"),
    ("CONTEXTFOLD_POLICY__LEAF_CHUNK_TOKENS", "1200"),
    ("CONTEXTFOLD_POLICY__LEAF_TARGET_TOKENS", "200"),
];

fn filler(i: usize, n: usize) -> String {
    (0..n)
        .map(|k| format!("w{}x{} ", (k * 7 + i) % 97, i % 13))
        .collect()
}

/// A conversation whose first turn holds the needle, then 60 filler turns.
fn events_file(dir: &Path) -> std::path::PathBuf {
    let mut lines = Vec::new();
    let mut push = |role: &str, content: String| {
        let i = lines.len();
        lines.push(
            json!({
                "id": format!("e{i}"),
                "conversation": CONV,
                "time": 1_700_000_000_000u64 + 1_000 * i as u64,
                "type": "turn_appended",
                "payload": {"message": {"role": role, "content": content}},
            })
            .to_string(),
        );
    };
    push(
        "user",
        format!("Rotate the {NEEDLE} on the billing host, then fix src/billing/invoice.rs."),
    );
    for i in 0..60 {
        let role = if i % 2 == 0 { "assistant" } else { "user" };
        push(role, format!("step {i}: {}", filler(i, 120)));
    }
    let path = dir.join("events.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").expect("write events");
    path
}

/// A loopback model answering `answer` to every request.
async fn answering(answer: &'static str) -> ScriptedServer {
    ScriptedServer::start(move |_| Scripted::json(200, completion(MODEL, answer))).await
}

/// The `[recall]` model settings for `server`, then `extra`.
fn recall_env<'a>(server: &'a str, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut env = vec![
        ("CONTEXTFOLD_RECALL__BASE_URL", server),
        ("CONTEXTFOLD_RECALL__MODEL", MODEL),
    ];
    env.extend_from_slice(extra);
    env
}

/// `contextfold --data DATA ARGS` with the test policy and `env`.
fn run(data: &Path, args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = support::cli::command(data, args);
    cmd.env_remove("CONTEXTFOLD_SUMMARIZER__BASE_URL")
        .env_remove("CONTEXTFOLD_RECALL__BASE_URL");
    for (k, v) in POLICY.iter().chain(env) {
        cmd.env(k, v);
    }
    support::cli::split(cmd.output().expect("the contextfold binary runs"))
}

/// Runs the binary off the async runtime the mock server answers on.
async fn run_async(
    data: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (bool, String, String, Duration) {
    let data = data.to_path_buf();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let started = Instant::now();
        let (ok, out, err) = run(&data, &args, &env);
        (ok, out, err, started.elapsed())
    })
    .await
    .expect("the command's thread")
}

fn spend_window(data: &Path) -> Value {
    let (ok, out, err) = run(data, &["status", CONV], &[]);
    assert!(ok, "status failed: {err}");
    support::cli::json_of(&out)["spend_window"].clone()
}

/// A data dir with the conversation folded and compacted.
fn compacted() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let events = events_file(dir.path());
    let data = dir.path().join("data");
    let (ok, _, err) = run(&data, &["run", events.to_str().expect("utf-8 path")], &[]);
    assert!(ok, "run failed: {err}");
    let (ok, out, err) = run(&data, &["status", CONV], &[]);
    assert!(ok, "{err}");
    let status = support::cli::json_of(&out);
    assert!(
        status["summaries"]["total"].as_u64().unwrap_or(0) > 0,
        "the fixture compacts: {status:#}"
    );
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recall_answers_from_the_relevant_turn_within_the_cap_and_counts_its_spend() {
    let dir = compacted();
    let data = dir.path().join("data");
    let server = answering(ANSWER).await;
    let base = server.base_url();
    let env = recall_env(&base, &[("CONTEXTFOLD_SUMMARIZER__MAX_RETRIES", "0")]);
    let before = spend_window(&data);
    let cap = 1500u64;
    let (ok, out, err, _) = run_async(
        &data,
        &[
            "recall",
            CONV,
            "Which deploy key K-7731 must be rotated on the billing host?",
            "--max-tokens",
            &cap.to_string(),
            "--json",
        ],
        &env,
    )
    .await;
    assert!(ok, "recall failed: {err}");
    let reply = support::cli::json_of(&out);
    assert_eq!(reply["answer"], ANSWER);
    assert_eq!(reply["unsupported"], json!([]), "every citation was read");
    assert_eq!(reply["model"], MODEL);
    assert_eq!(reply["calls"], 1);
    assert_eq!(reply["tokens_spent"], 120, "the server's usage: 100 + 20");
    let sources = reply["sources"].as_array().expect("sources");
    assert!(!sources.is_empty());
    assert!(
        sources.iter().any(|s| s["kind"] == "turn" && s["seq"] == 0),
        "the needle's turn is read: {sources:#?}"
    );
    let read: u64 = sources.iter().filter_map(|s| s["tokens"].as_u64()).sum();
    assert!(reply["tokens"].as_u64().unwrap() <= cap);
    assert!(read <= cap);

    // What the server received: bounded by the cap as the model's
    // tokenizer counts it, and holding the turn with the answer.
    let received = server.received();
    assert_eq!(received.len(), 1);
    let body = &received[0].body;
    assert_eq!(body["model"], MODEL);
    let messages = body["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 2);
    let encoding = Encoding::for_model(Some(MODEL));
    let sent: u64 = messages
        .iter()
        .map(|m| {
            let role = if m["role"] == "system" {
                Role::System
            } else {
                Role::User
            };
            count_message(
                encoding,
                &ChatMessage::text(role, m["content"].as_str().unwrap_or_default()),
            )
        })
        .sum();
    assert!(sent <= cap, "{sent} tokens sent over a cap of {cap}");
    assert_eq!(sent, reply["tokens"].as_u64().unwrap());
    let user = messages[1]["content"].as_str().unwrap_or_default();
    assert!(user.contains(NEEDLE), "{user}");
    assert!(user.contains("### turn 0"), "{user}");
    assert!(body["max_tokens"].as_u64().is_some_and(|m| m > 0));

    // The spend is in the conversation's spend window.
    let after = spend_window(&data);
    assert_eq!(
        after["calls"].as_u64().unwrap(),
        before["calls"].as_u64().unwrap() + 1,
        "{after:#}"
    );
    assert_eq!(
        after["tokens"].as_u64().unwrap(),
        before["tokens"].as_u64().unwrap() + 120
    );

    // The text form: the answer, then the sources.
    let (ok, out, err, _) = run_async(
        &data,
        &["recall", CONV, "Which deploy key must be rotated?"],
        &env,
    )
    .await;
    assert!(ok, "{err}");
    assert!(out.starts_with(ANSWER), "{out}");
    assert!(out.contains("\nsources ("), "{out}");
    assert!(out.contains("  turn 0 (user"), "{out}");
    assert!(!out.contains("not in what the model read"), "{out}");

    // An answer citing a turn it was not given and a path from nowhere is
    // passed on, with both named.
    const INVENTED: &str =
        "Rotate K-7731 (turn 0); its copy is in /etc/billing/keys.pem (turn 4242).";
    let invents = answering(INVENTED).await;
    let base = invents.base_url();
    let env = recall_env(&base, &[]);
    let question = "Which deploy key K-7731 must be rotated?";
    let (ok, out, err, _) = run_async(&data, &["recall", CONV, question, "--json"], &env).await;
    assert!(ok, "{err}");
    let reply = support::cli::json_of(&out);
    assert_eq!(
        reply["unsupported"],
        json!(["turn 4242", "/etc/billing/keys.pem"])
    );
    let (ok, out, err, _) = run_async(&data, &["recall", CONV, question], &env).await;
    assert!(ok, "{err}");
    assert!(
        out.contains("not in what the model read (2): turn 4242, /etc/billing/keys.pem"),
        "{out}"
    );
    // The audit shows every recall.
    let (ok, out, err) = run(&data, &["audit", CONV, "--json"], &[]);
    assert!(ok, "{err}");
    assert_eq!(
        out.matches("\"kind\": \"recall_answered\"").count(),
        4,
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_shorter_than_the_server_cancels_the_call_and_says_so() {
    let dir = compacted();
    let data = dir.path().join("data");
    let server = ScriptedServer::start(|_| {
        Scripted::json(200, completion(MODEL, ANSWER)).delayed(Duration::from_secs(5))
    })
    .await;
    let base = server.base_url();
    let before = spend_window(&data);
    let (ok, out, err, took) = run_async(
        &data,
        &["recall", CONV, "Which deploy key must be rotated?"],
        &recall_env(&base, &[("CONTEXTFOLD_RECALL__DEADLINE_MS", "400")]),
    )
    .await;
    assert!(!ok, "a deadline is an error: {out}");
    assert!(err.contains("deadline_exceeded"), "{err}");
    assert!(err.contains("400 ms") && err.contains("cancelled"), "{err}");
    assert!(took < Duration::from_secs(4), "took {took:?}");
    // The server saw the client leave.
    let deadline = Instant::now() + Duration::from_secs(3);
    while server.disconnects().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        server.disconnects().len(),
        1,
        "the call in flight was closed"
    );
    // The cancelled call counts in the spend window.
    let after = spend_window(&data);
    assert_eq!(
        after["calls"].as_u64().unwrap(),
        before["calls"].as_u64().unwrap() + 1,
        "{after:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_spend_window_refuses_without_calling_the_model() {
    let dir = compacted();
    let data = dir.path().join("data");
    let server = answering(ANSWER).await;
    let base = server.base_url();
    let env = recall_env(
        &base,
        &[("CONTEXTFOLD_POLICY__SUMMARY_MAX_CALLS_PER_WINDOW", "1")],
    );
    let (ok, _, err, _) = run_async(&data, &["recall", CONV, "Which deploy key?"], &env).await;
    assert!(ok, "the one call the window allows: {err}");
    assert_eq!(server.received().len(), 1);
    let (ok, out, err, _) = run_async(&data, &["recall", CONV, "Which host?"], &env).await;
    assert!(!ok, "refused: {out}");
    assert!(err.contains("spend_exhausted"), "{err}");
    assert!(err.contains("spend window"), "{err}");
    assert_eq!(server.received().len(), 1, "no call for a refused recall");
}

#[test]
fn without_a_model_recall_says_what_to_configure() {
    let dir = compacted();
    let data = dir.path().join("data");
    let (ok, _, err) = run(&data, &["recall", CONV, "Which deploy key?"], &[]);
    assert!(!ok);
    assert!(err.contains("recall.base_url"), "{err}");
    let (ok, _, err) = run(
        &data,
        &["recall", CONV, "Which deploy key?"],
        &[("CONTEXTFOLD_RECALL__DEADLINE_MS", "0")],
    );
    assert!(!ok);
    assert!(err.contains("recall.deadline_ms"), "{err}");
}
