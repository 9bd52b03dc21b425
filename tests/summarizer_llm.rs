//! The summarizer against real HTTP servers on loopback (never a hosted
//! API), proving each behaviour by what the server saw:
//! - llmock: 429 + Retry-After, 5xx, 401, latency, and its request journal;
//! - fakellm: scripted "summaries" (chain-of-thought, empty, continuation,
//!   oversized, identifier-dropping), counted per rule;
//! - a scripted server of our own (tests/support/llm_server.rs) for client
//!   disconnects, lenient bodies and HTTP-date Retry-After.
//!
//! The Python servers come from scripts/install-test-llm.sh; without them
//! those tests print SKIPPED, unless CONTEXTFOLD_REQUIRE_LLM_SERVERS is set.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/llm_server.rs"]
mod llm_server;

use contextfold::core::message::Role;
use contextfold::core::summary::{
    IdentifierPolicy, RollingStateRequest, SummaryRequest, ROLLING_STATE_MAX_CHARS,
};
use contextfold::core::tokens::{count_text, Encoding};
use contextfold::summarizer::breaker::ManualClock;
use contextfold::summarizer::config::ExternalConfig;
use contextfold::summarizer::external::{ExternalSummarizer, WithFallback};
use contextfold::summarizer::prompts::MISSING_IDENTIFIERS_PHRASE;
use contextfold::summarizer::{
    stack, Budget, CallOutcome, EscalatingSummarizer, LlmSummarizer, ModelPrice, RollingOutcome,
    SummarizeError, Summarizer, SummarizerConfig,
};
use futures::StreamExt;
use llm_server::{completion, FakeLlm, Llmock, NatsForTests, Scripted, ScriptedServer};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The team's summarizer on NATS first, the built-in model client when it
/// fails, validated and escalated: the external stack (`stack::external`).
fn team_then_builtin(
    config: &SummarizerConfig,
    client: &async_nats::Client,
) -> EscalatingSummarizer<WithFallback<ExternalSummarizer<async_nats::Client>, LlmSummarizer>> {
    let external = config.external.as_ref().expect("an external subject");
    let team = ExternalSummarizer::new(
        client.clone(),
        external.subject.clone(),
        Duration::from_millis(external.timeout_ms),
    );
    let builtin = LlmSummarizer::new(config.clone()).expect("model client");
    EscalatingSummarizer::new(WithFallback::new(team, builtin), config)
}

const GOOD: &str = "The user traced the failing deploy of build \
9fceb02d0ae598e95dc970b74767f19372d61af8 to an expired certificate, renewed it and redeployed; \
the database at 10.20.30.40:5432 was left untouched.";

/// Identifiers in [`source_text`], in order.
const IDS: [&str; 5] = [
    "/srv/api/config.toml",
    "https://ci.example.test/jobs/4711",
    "123e4567-e89b-12d3-a456-426614174000",
    "10.20.30.40:5432",
    "9fceb02d0ae598e95dc970b74767f19372d61af8",
];

fn source_text() -> String {
    let mut text = format!(
        "The deploy of build {} fails at startup. The config is {} and the CI job is {}. \
         The request id in the error is {}. The database at {} must not be touched.\n",
        IDS[4], IDS[0], IDS[1], IDS[2], IDS[3]
    );
    for i in 0..40 {
        text.push_str(&format!(
            "log line {i}: TLS handshake failed: certificate has expired (notAfter reached); \
             retrying the connection pool warm-up with exponential backoff\n"
        ));
    }
    text
}

fn request(target: u64) -> SummaryRequest {
    let text = source_text();
    let tokens = count_text(Encoding::O200kBase, &text);
    let mut req = contextfold::testing::summary_request(&text, tokens, target);
    req.conversation = "agent:ops:deploy".into();
    req.sources[0].role = Some(Role::Tool);
    req.sources[0].tool = Some("bash".into());
    req
}

fn config(base_url: &str, model: &str, fallbacks: &[&str]) -> SummarizerConfig {
    SummarizerConfig {
        base_url: base_url.to_string(),
        model: model.to_string(),
        fallback_models: fallbacks.iter().map(|s| s.to_string()).collect(),
        call_timeout_ms: 5_000,
        connect_timeout_ms: 1_000,
        max_retries: 2,
        retry_base_ms: 50,
        retry_max_backoff_ms: 200,
        ..SummarizerConfig::default()
    }
}

fn llm(cfg: SummarizerConfig) -> LlmSummarizer {
    LlmSummarizer::with_api_key(cfg, "test-key-not-secret").expect("summarizer")
}

fn outcomes(calls: &[contextfold::summarizer::CallRecord]) -> Vec<CallOutcome> {
    calls.iter().map(|c| c.outcome.clone()).collect()
}

// ---------------------------------------------------------------- llmock --

#[tokio::test]
async fn rate_limit_returns_the_retry_after_delay_capped_without_sleeping() {
    let Some(server) = Llmock::start().await else {
        return;
    };
    let cfg = SummarizerConfig {
        retry_after_cap_ms: 20_000,
        ..config(&server.base_url(), "m-main", &[])
    };
    let s = EscalatingSummarizer::new(llm(cfg.clone()), &cfg);

    server
        .script(json!([{"type": "fail", "status": 429, "retry_after": 7, "times": 1}]))
        .await;
    let started = Instant::now();
    let err = s
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "must not sleep on a 429: took {:?}",
        started.elapsed()
    );
    match &err {
        SummarizeError::RateLimited {
            retry_after_ms,
            calls,
            ..
        } => {
            assert_eq!(*retry_after_ms, 7_000);
            assert_eq!(outcomes(calls), vec![CallOutcome::RateLimited]);
        }
        other => panic!("expected RateLimited, got {other:?}"),
    }
    assert_eq!(
        server.requests().await.len(),
        1,
        "exactly one call, no retry"
    );

    // An hour-long Retry-After is capped by configuration.
    server
        .script(json!([{"type": "fail", "status": 429, "retry_after": 3600, "times": 1}]))
        .await;
    let started = Instant::now();
    let err = s
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(err.retry_after_ms(), Some(20_000));
    assert_eq!(server.requests().await.len(), 2);
}

#[tokio::test]
async fn fallback_chain_is_taken_in_order_and_stops_at_auth() {
    let Some(server) = Llmock::start().await else {
        return;
    };
    let cfg = SummarizerConfig {
        call_timeout_ms: 700,
        max_retries: 1,
        ..config(&server.base_url(), "m-a", &["m-b", "m-c", "m-d"])
    };
    let s = llm(cfg);
    server
        .script(json!([
            {"type": "fail", "status": 503, "times": null, "match": {"model": "m-a"}},
            {"type": "delay", "seconds": 1.5, "times": null, "match": {"model": "m-b"}},
            {"type": "fail", "status": 429, "retry_after": 30, "times": null, "match": {"model": "m-c"}},
            {"type": "reply", "text": GOOD, "times": null, "match": {"model": "m-d"}}
        ]))
        .await;
    let out = s
        .summarize(&request(200), &Budget::unlimited())
        .await
        .expect("m-d answers");
    assert_eq!(out.draft.content, GOOD);
    assert_eq!(out.draft.model, "m-d");
    assert!(!out.draft.fallback);
    assert_eq!(
        outcomes(&out.calls),
        vec![
            CallOutcome::HttpStatus(503),
            CallOutcome::HttpStatus(503),
            CallOutcome::Timeout,
            CallOutcome::RateLimited,
            CallOutcome::Ok
        ]
    );
    // llmock journals a request when it has answered it: let the delayed
    // one finish (the client left at its 700 ms timeout).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        server.models().await,
        vec!["m-a", "m-a", "m-b", "m-c", "m-d"],
        "server saw the chain in order, 5xx retried once"
    );

    // An auth failure is not a reason to try the next model.
    server.reset().await;
    server
        .script(
            json!([{"type": "fail", "status": 401, "times": null, "match": {"model": "m-a"}},
                       {"type": "reply", "text": GOOD, "times": null}]),
        )
        .await;
    let err = s
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap_err();
    assert!(
        matches!(err, SummarizeError::AuthFailed { status: 401, .. }),
        "{err:?}"
    );
    assert_eq!(server.models().await, vec!["m-a"]);
}

#[tokio::test]
async fn auth_failures_open_the_breaker_and_write_nothing() {
    let Some(server) = Llmock::start().await else {
        return;
    };
    server
        .script(json!([{"type": "fail", "status": 401, "times": null}]))
        .await;
    let clock = Arc::new(ManualClock::new(1_000_000));
    let cfg = SummarizerConfig {
        api_key_env: "CONTEXTFOLD_TEST_KEY".into(),
        ..config(&server.base_url(), "m-main", &["m-other"])
    };
    let inner = llm(cfg.clone()).with_clock(clock.clone());
    let s = EscalatingSummarizer::new(inner, &cfg);
    let budget = Budget::unlimited();

    for i in 0..8 {
        let result = s.summarize(&request(200), &budget).await;
        let err = match result {
            Ok(out) => panic!("attempt {i}: an auth failure wrote a summary: {out:?}"),
            Err(e) => e,
        };
        assert!(err.is_auth(), "attempt {i}: {err:?}");
        if i < 5 {
            assert!(
                matches!(err, SummarizeError::AuthFailed { status: 401, .. }),
                "attempt {i}: {err:?}"
            );
            assert!(err.to_string().contains("$CONTEXTFOLD_TEST_KEY"), "{err}");
        } else {
            assert!(
                matches!(
                    err,
                    SummarizeError::BreakerOpen {
                        retry_after_ms: 1_800_000,
                        ..
                    }
                ),
                "attempt {i}: {err:?}"
            );
        }
    }
    assert_eq!(
        server.requests().await.len(),
        5,
        "the open breaker makes no call"
    );
    assert_eq!(budget.calls().len(), 5);

    // After the cooldown one probe goes out; it fails, and the breaker
    // opens again at once.
    clock.advance(1_800_000);
    let err = s
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap_err();
    assert!(matches!(err, SummarizeError::AuthFailed { .. }), "{err:?}");
    let err = s
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap_err();
    assert!(matches!(err, SummarizeError::BreakerOpen { .. }), "{err:?}");
    assert_eq!(server.requests().await.len(), 6);
}

#[tokio::test]
async fn server_errors_are_retried_with_backoff_then_the_fallback_is_marked() {
    let Some(server) = Llmock::start().await else {
        return;
    };
    let cfg = SummarizerConfig {
        retry_base_ms: 200,
        retry_max_backoff_ms: 400,
        ..config(&server.base_url(), "m-main", &[])
    };
    server
        .script(json!([
            {"type": "fail", "status": 503, "times": 2},
            {"type": "reply", "text": GOOD, "times": null}
        ]))
        .await;
    let out = llm(cfg.clone())
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap();
    assert_eq!(out.draft.content, GOOD);
    assert_eq!(
        outcomes(&out.calls),
        vec![
            CallOutcome::HttpStatus(503),
            CallOutcome::HttpStatus(503),
            CallOutcome::Ok
        ]
    );
    let seen = server.requests().await;
    assert_eq!(seen.len(), 3);
    let start = |i: usize| seen[i]["started_at"].as_f64().unwrap();
    // Backoff: at least half of 200 ms, then half of 400 ms (jitter adds
    // up to the other half).
    assert!(start(1) - start(0) >= 0.095, "{}", start(1) - start(0));
    assert!(start(2) - start(1) >= 0.195, "{}", start(2) - start(1));

    // A provider that stays down: bounded attempts, then the marked
    // deterministic fallback (it is re-summarized later).
    server.reset().await;
    server
        .script(json!([{"type": "fail", "status": 500, "times": null}]))
        .await;
    let s = EscalatingSummarizer::new(llm(cfg.clone()), &cfg);
    let out = s
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap();
    assert!(out.draft.fallback);
    assert_eq!(server.requests().await.len(), 3, "1 + max_retries attempts");
    assert_eq!(out.calls.len(), 3);
    for id in IDS {
        assert!(out.draft.content.contains(id), "{id} kept in the fallback");
    }
}

#[tokio::test]
async fn a_call_cap_stops_retries_and_the_chain_where_it_falls() {
    let Some(server) = Llmock::start().await else {
        return;
    };
    // Two models, two retries each: six calls at worst.
    let cfg = config(&server.base_url(), "m-main", &["m-second"]);
    server
        .script(json!([{"type": "fail", "status": 503, "times": null}]))
        .await;
    let client = llm(cfg.clone());
    let budget = Budget::new(Some(2), None);
    let err = client.summarize(&request(200), &budget).await.unwrap_err();
    assert!(matches!(err, SummarizeError::Unavailable { .. }), "{err:?}");
    assert!(
        err.to_string().contains("spend allowance after 2 calls"),
        "{err}"
    );
    assert_eq!(err.calls().len(), 2);
    assert_eq!(budget.spent().calls, 2, "charged call by call");
    assert_eq!(server.requests().await.len(), 2, "held to 2 calls");
    // A spent budget starts no call at all: over budget, not a failure.
    let err = client.summarize(&request(200), &budget).await.unwrap_err();
    assert!(matches!(err, SummarizeError::OverBudget { .. }), "{err:?}");
    assert_eq!(server.requests().await.len(), 2, "no call started");
    // A cap of one call on a healthy provider: that call is the summary.
    server.reset().await;
    server
        .script(json!([{"type": "reply", "text": GOOD, "times": null}]))
        .await;
    let out = client
        .summarize(&request(200), &Budget::new(Some(1), None))
        .await
        .unwrap();
    assert_eq!(out.draft.content, GOOD);
    assert_eq!(out.calls.len(), 1);
    // The rolling state is held the same way.
    server.reset().await;
    server
        .script(json!([{"type": "fail", "status": 500, "times": null}]))
        .await;
    let req = RollingStateRequest {
        conversation: "agent:ops:deploy".into(),
        previous: None,
        sources: request(200).sources,
    };
    let err = client
        .rolling_state(&req, &Budget::new(Some(1), None))
        .await
        .unwrap_err();
    assert_eq!(err.calls().len(), 1, "{err}");
    assert_eq!(server.requests().await.len(), 1);
}

// ------------------------------------------------------- scripted server --

#[tokio::test]
async fn a_deadline_cancels_the_call_in_flight() {
    let server = ScriptedServer::start(|r| {
        Scripted::json(200, completion(&r.model(), GOOD)).delayed(Duration::from_secs(30))
    })
    .await;
    let cfg = SummarizerConfig {
        call_timeout_ms: 60_000,
        ..config(&server.base_url(), "m-slow", &["m-other"])
    };
    let s = EscalatingSummarizer::new(llm(cfg.clone()), &cfg);

    let deadline = Duration::from_secs(1);
    let started = Instant::now();
    let budget = Budget::unlimited();
    let result = tokio::time::timeout(deadline, s.summarize(&request(200), &budget)).await;
    let returned = started.elapsed();
    assert!(result.is_err(), "the deadline expired");
    assert!(
        returned < deadline + Duration::from_secs(1),
        "returned {returned:?} after start"
    );

    // The server sees the connection closed: the call was cancelled, not
    // left running in the background.
    let mut waited = Duration::ZERO;
    while server.disconnects().is_empty() && waited < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += Duration::from_millis(20);
    }
    let disconnects = server.disconnects();
    assert_eq!(disconnects.len(), 1, "server saw the client go away");
    let after_deadline = disconnects[0].saturating_duration_since(started + deadline);
    eprintln!(
        "deadline {deadline:?}: summarize returned after {returned:?}; server saw the \
         connection closed {after_deadline:?} after the deadline"
    );
    assert!(
        after_deadline < Duration::from_secs(1),
        "connection closed {after_deadline:?} after the deadline"
    );
    assert_eq!(server.received().len(), 1, "one call, nothing after it");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        server.received().len(),
        1,
        "no call started after the deadline"
    );

    // The cancelled call is still charged to the budget.
    let records = budget.calls();
    assert_eq!(outcomes(&records), vec![CallOutcome::Cancelled]);
    assert!(records[0].latency_ms >= 900, "{}", records[0].latency_ms);
    assert!(records[0].prompt_tokens_ours > 0);
}

#[tokio::test]
async fn the_per_call_timeout_moves_to_the_next_model() {
    let server = ScriptedServer::start(|r| {
        if r.model() == "m-slow" {
            Scripted::json(200, completion("m-slow", GOOD)).delayed(Duration::from_secs(10))
        } else {
            Scripted::json(200, completion("m-fast", GOOD))
        }
    })
    .await;
    let cfg = SummarizerConfig {
        call_timeout_ms: 400,
        ..config(&server.base_url(), "m-slow", &["m-fast"])
    };
    let started = Instant::now();
    let out = llm(cfg)
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(out.draft.model, "m-fast");
    assert_eq!(
        outcomes(&out.calls),
        vec![CallOutcome::Timeout, CallOutcome::Ok]
    );
    let models: Vec<String> = server.received().iter().map(|r| r.model()).collect();
    assert_eq!(
        models,
        vec!["m-slow", "m-fast"],
        "a timeout is not retried on the same model"
    );
    assert_eq!(
        server.disconnects().len(),
        1,
        "the timed-out call was closed"
    );
}

#[tokio::test]
async fn lenient_responses_are_accepted_and_missing_usage_falls_back_to_our_counts() {
    let server = ScriptedServer::start(|r| {
        let body = match r.model().as_str() {
            // No id, object, created, model or usage; finish_reason null.
            "m-bare" => json!({"choices": [{"message": {"content": GOOD}, "finish_reason": null}]}),
            // Zero usage means unknown; content given as parts.
            "m-zero" => json!({
                "choices": [{"message": {"role": "assistant",
                    "content": [{"type": "text", "text": GOOD}]}}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0}
            }),
            _ => completion("served-name", GOOD),
        };
        Scripted::json(200, body)
    })
    .await;
    let price = ModelPrice {
        input_per_million: 1.0,
        output_per_million: 2.0,
    };
    for model in ["m-bare", "m-zero"] {
        let mut cfg = config(&server.base_url(), model, &[]);
        cfg.prices.insert(model.to_string(), price);
        let out = llm(cfg)
            .summarize(&request(200), &Budget::unlimited())
            .await
            .unwrap();
        assert_eq!(out.draft.content, GOOD, "{model}");
        assert_eq!(out.draft.model, model);
        let call = &out.calls[0];
        assert_eq!(call.outcome, CallOutcome::Ok);
        assert_eq!(call.prompt_tokens_provider, None, "{model}");
        assert_eq!(call.completion_tokens_provider, None, "{model}");
        assert!(call.prompt_tokens_ours > 300, "{}", call.prompt_tokens_ours);
        assert_eq!(
            call.completion_tokens_ours,
            count_text(Encoding::O200kBase, GOOD)
        );
        assert_eq!(
            call.cost_micros,
            call.prompt_tokens_ours + 2 * call.completion_tokens_ours
        );
    }

    // With usage reported, the provider's numbers price the call.
    let mut cfg = config(&server.base_url(), "m-full", &[]);
    cfg.prices.insert("*".into(), price);
    let out = llm(cfg)
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap();
    assert_eq!(out.draft.model, "served-name");
    assert_eq!(out.calls[0].prompt_tokens_provider, Some(100));
    assert_eq!(out.calls[0].completion_tokens_provider, Some(20));
    assert_eq!(out.calls[0].cost_micros, 100 + 2 * 20);

    // What went on the wire: the key as a bearer token, no streaming, and
    // the output cap at 3 x target.
    let sent = &server.received()[0];
    assert_eq!(sent.body["stream"], json!(false));
    assert_eq!(sent.body["max_tokens"], json!(600));
    assert_eq!(sent.body["messages"][0]["role"], json!("system"));
    assert!(sent
        .headers
        .iter()
        .any(|(k, v)| k == "authorization" && v == "Bearer test-key-not-secret"));
}

#[tokio::test]
async fn retry_after_as_http_date_ms_or_missing() {
    let server = ScriptedServer::start(|r| {
        let limited = Scripted::json(429, json!({"error": {"message": "slow down"}}));
        match r.model().as_str() {
            "m-date" => limited.header("retry-after", "Wed, 21 Oct 2026 07:28:00 GMT"),
            "m-ms" => limited.header("retry-after-ms", "1500"),
            _ => limited,
        }
    })
    .await;
    // 90 s before the date in the header.
    let clock = Arc::new(ManualClock::new(1_792_567_680_000 - 90_000));
    let cases = [("m-date", 90_000), ("m-ms", 1_500), ("m-none", 12_345)];
    for (model, expected) in cases {
        let cfg = SummarizerConfig {
            rate_limit_default_ms: 12_345,
            ..config(&server.base_url(), model, &[])
        };
        let started = Instant::now();
        let err = llm(cfg)
            .with_clock(clock.clone())
            .summarize(&request(200), &Budget::unlimited())
            .await
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(err.retry_after_ms(), Some(expected), "{model}: {err:?}");
    }
    assert_eq!(server.received().len(), 3, "one call each, never retried");
}

#[tokio::test]
async fn connection_errors_are_retried_a_bounded_number_of_times() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let cfg = config(&format!("http://127.0.0.1:{port}/v1"), "m-main", &[]);
    let err = llm(cfg)
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap_err();
    match err {
        SummarizeError::Unavailable { reason, calls } => {
            assert_eq!(outcomes(&calls), vec![CallOutcome::Connect; 3]);
            assert!(reason.contains("m-main"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn rolling_state_is_refreshed_within_its_limits() {
    let long = "renewing the certificate for the api service and checking every pool ".repeat(5);
    let server = ScriptedServer::start(move |r| {
        let text = if r.model() == "m-state" {
            format!(
                "**Completed:** traced the failure to an expired certificate\n\
                 **In progress:** {long}\n**Decisions:** keep the database at 10.20.30.40:5432 \
                 untouched\n**Blockers:** none\n**Next:** redeploy build 9fceb02d0ae5"
            )
        } else {
            "I think the agent is doing well.".to_string()
        };
        Scripted::json(200, completion(&r.model(), &text))
    })
    .await;
    let req = RollingStateRequest {
        conversation: "agent:ops:deploy".into(),
        previous: None,
        sources: request(200).sources,
    };
    let RollingOutcome { state, calls, .. } = llm(config(&server.base_url(), "m-state", &[]))
        .rolling_state(&req, &Budget::unlimited())
        .await
        .unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        state.completed,
        "traced the failure to an expired certificate"
    );
    assert!(state.decisions.contains("10.20.30.40:5432"));
    assert_eq!(state.next, "redeploy build 9fceb02d0ae5");
    let total = [
        &state.completed,
        &state.in_progress,
        &state.decisions,
        &state.blockers,
        &state.next,
    ]
    .iter()
    .map(|s| s.chars().count())
    .sum::<usize>();
    assert!(total <= ROLLING_STATE_MAX_CHARS, "{total}");

    let err = llm(config(&server.base_url(), "m-chatty", &[]))
        .rolling_state(&req, &Budget::unlimited())
        .await
        .unwrap_err();
    assert!(matches!(err, SummarizeError::Invalid { .. }), "{err:?}");
    assert!(matches!(err.calls()[0].outcome, CallOutcome::Invalid(_)));
}

/// A small model's rolling states (issue 14) held a delimiter line and
/// claimed outcomes: they are rejected with a reason, never stored.
#[tokio::test]
async fn rolling_state_answers_are_validated_like_summaries() {
    let server = ScriptedServer::start(move |r| {
        let text = if r.model() == "m-delim" {
            "Completed: reproduced the failure\nIn progress: </data-3f9a1c0b77de>\n\
             Decisions: none\nBlockers: none\nNext: fix it"
                .to_string()
        } else {
            "Completed: After making these changes, I ran the reproduce script. All the tests \
             passed.\nIn progress: none\nDecisions: none\nBlockers: none\nNext: none"
                .to_string()
        };
        Scripted::json(200, completion(&r.model(), &text))
    })
    .await;
    let req = RollingStateRequest {
        conversation: "agent:ops:deploy".into(),
        previous: None,
        sources: request(200).sources,
    };
    for (model, kind) in [("m-delim", "delimiter"), ("m-voice", "agent voice")] {
        let err = llm(config(&server.base_url(), model, &[]))
            .rolling_state(&req, &Budget::unlimited())
            .await
            .unwrap_err();
        let SummarizeError::Invalid { reason, calls } = &err else {
            panic!("{model}: {err:?}");
        };
        assert!(reason.starts_with("rolling state rejected"), "{reason}");
        assert!(reason.contains(kind), "{model}: {reason}");
        assert!(matches!(&calls[0].outcome, CallOutcome::Invalid(r) if r == reason));
    }
}

// --------------------------------------------------------------- fakellm --

fn oversized_text() -> String {
    "The deploy failed because the certificate expired and the pool kept retrying. ".repeat(60)
}

fn rules() -> String {
    let yaml = json!({
        "rules": [
            {"name": "cot", "when": {"model_matches": "cot"},
             "respond": {"content": "<think>The user wants a summary. I should list the decisions.</think>"}},
            {"name": "selftalk", "when": {"model_matches": "selftalk"},
             "respond": {"content": "Let me think step by step. First, I need to read the turns."}},
            {"name": "empty", "when": {"model_matches": "empty"},
             "respond": {"content": ""}},
            {"name": "continuation", "when": {"model_matches": "continuation"},
             "respond": {"content": "Sure, I'll renew the certificate and redeploy now."}},
            {"name": "role_prefix", "when": {"model_matches": "roleprefix"},
             "respond": {"content": "Assistant: I renewed the certificate."}},
            {"name": "oversized", "when": {"model_matches": "oversized"},
             "respond": {"content": oversized_text()}},
            {"name": "recovers_terse", "when": {"model_matches": "recovers", "messages_contain": "be terse"},
             "respond": {"content": GOOD}},
            {"name": "recovers_rambling", "when": {"model_matches": "recovers"},
             "respond": {"content": "Okay, so the conversation is about a deploy."}},
            {"name": "ids_retry", "when": {"model_matches": "ids", "messages_contain": MISSING_IDENTIFIERS_PHRASE},
             "respond": {"content": format!(
                 "The deploy of build {} fails on an expired certificate: config {}, CI job {}, database {} untouched.",
                 IDS[4], IDS[0], IDS[1], IDS[3])}},
            {"name": "ids_first", "when": {"model_matches": "ids"},
             "respond": {"content": format!(
                 "The deploy fails on an expired certificate; the config is {}.", IDS[0])}},
            {"name": "good", "when": {"model_matches": "good"},
             "respond": {"content": GOOD}}
        ]
    });
    // JSON is YAML.
    yaml.to_string()
}

#[tokio::test]
async fn rejected_results_are_never_returned_as_the_summary() {
    let Some(server) = FakeLlm::start(&rules()).await else {
        return;
    };
    let bad = [
        ("cot", "<think>"),
        ("selftalk", "Let me think"),
        ("empty", ""),
        ("continuation", "Sure, I'll"),
        ("roleprefix", "Assistant:"),
        ("oversized", "pool kept retrying. The deploy"),
    ];
    for (model, marker) in bad {
        let cfg = config(&server.base_url(), model, &["good"]);
        let s = EscalatingSummarizer::new(llm(cfg.clone()), &cfg);
        let out = s
            .summarize(&request(100), &Budget::unlimited())
            .await
            .unwrap();
        assert!(out.draft.fallback, "{model}: escalated to the fallback");
        assert!(!out.draft.content.is_empty());
        if !marker.is_empty() {
            assert!(
                !out.draft.content.contains(marker),
                "{model}: {:?}",
                out.draft.content
            );
        }
        assert_eq!(out.calls.len(), 2, "{model}: normal + aggressive");
        assert!(
            out.calls
                .iter()
                .all(|c| matches!(c.outcome, CallOutcome::Invalid(_))),
            "{model}: {:?}",
            out.calls
        );
        // The fallback is the deterministic summary as it is: it keeps the
        // identifiers it ranked first, within its target.
        assert_eq!(
            out.draft.content,
            contextfold::summarizer::deterministic::DeterministicSummarizer::draft(&request(100))
                .content,
            "{model}"
        );
    }
    let counts = server.by_rule().await;
    for (rule, _) in bad {
        let rule = if rule == "roleprefix" {
            "role_prefix"
        } else {
            rule
        };
        assert_eq!(counts.get(rule), Some(&2), "{rule}: {counts:?}");
    }
    assert_eq!(
        counts.get("good"),
        None,
        "invalid output does not take the model fallback chain"
    );

    // Rambling at first, fine when asked to be terse: the aggressive
    // attempt's summary is used.
    let cfg = config(&server.base_url(), "recovers", &[]);
    let s = EscalatingSummarizer::new(llm(cfg.clone()), &cfg);
    let out = s
        .summarize(&request(200), &Budget::unlimited())
        .await
        .unwrap();
    assert!(!out.draft.fallback);
    assert!(
        out.draft.content.starts_with(GOOD),
        "{:?}",
        out.draft.content
    );
    // Rejected, accepted, then the strict policy's one retry naming the
    // identifiers GOOD lacks (still terse, so the same rule answers).
    assert!(matches!(out.calls[0].outcome, CallOutcome::Invalid(_)));
    assert_eq!(out.calls.len(), 3);
    assert!(out.draft.content.contains("Exact identifiers:"));
    let counts = server.by_rule().await;
    assert_eq!(counts.get("recovers_rambling"), Some(&1));
    assert_eq!(counts.get("recovers_terse"), Some(&2));
}

#[tokio::test]
async fn strict_identifiers_survive_retry_then_appended_section() {
    let Some(server) = FakeLlm::start(&rules()).await else {
        return;
    };
    let cfg = config(&server.base_url(), "ids", &[]);
    let s = EscalatingSummarizer::new(llm(cfg.clone()), &cfg);
    let out = s
        .summarize(&request(300), &Budget::unlimited())
        .await
        .unwrap();
    assert!(!out.draft.fallback, "identifiers never force the fallback");
    for id in IDS {
        assert!(
            out.draft.content.contains(id),
            "{id} missing from {:?}",
            out.draft.content
        );
    }
    // The retry's summary is used; the one identifier it still dropped is
    // appended deterministically.
    let expected = format!(
        "The deploy of build {} fails on an expired certificate: config {}, CI job {}, \
         database {} untouched.\n\n\
         Exact identifiers:\n- {}",
        IDS[4], IDS[0], IDS[1], IDS[3], IDS[2]
    );
    assert_eq!(out.draft.content, expected);
    assert_eq!(outcomes(&out.calls), vec![CallOutcome::Ok, CallOutcome::Ok]);
    let counts = server.by_rule().await;
    assert_eq!(counts.get("ids_first"), Some(&1));
    assert_eq!(
        counts.get("ids_retry"),
        Some(&1),
        "the retry named the missing identifiers"
    );
    assert_eq!(server.total().await, 2);
}

// ------------------------------------------------------ external (NATS) --

#[tokio::test]
async fn external_summarizer_over_nats_falls_back_to_the_built_in_path() {
    let Some(nats) = NatsForTests::start().await else {
        return;
    };
    let client = async_nats::connect(nats.url()).await.expect("connect");

    // The team's summarizer, answering by conversation name.
    let mut requests = client.subscribe("summarize.team").await.expect("subscribe");
    let responder = client.clone();
    tokio::spawn(async move {
        while let Some(msg) = requests.next().await {
            let responder = responder.clone();
            tokio::spawn(async move {
                let req: SummaryRequest = serde_json::from_slice(&msg.payload).expect("request");
                let reply = match req.conversation.as_str() {
                    "team:ok" => {
                        json!({"content": format!("Team summary: the TLS handshake failed, the certificate had expired. {}", IDS.join(" ")),
                                        "model": "team-model"})
                    }
                    "team:error" => json!({"error": "model overloaded"}),
                    "team:slow" => {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        json!({"content": "too late"})
                    }
                    _ => json!({"content": ""}),
                };
                if let Some(to) = msg.reply {
                    let _ = responder.publish(to, reply.to_string().into()).await;
                }
            });
        }
    });
    client.flush().await.expect("flush");

    // The built-in path, counting its calls.
    let builtin =
        ScriptedServer::start(|r| Scripted::json(200, completion(&r.model(), GOOD))).await;
    let external_cfg = |subject: &str| SummarizerConfig {
        api_key_env: "CONTEXTFOLD_TEST_UNSET_KEY".into(),
        external: Some(ExternalConfig {
            subject: subject.into(),
            timeout_ms: 500,
        }),
        ..config(&builtin.base_url(), "m-builtin", &[])
    };
    let team = team_then_builtin(&external_cfg("summarize.team"), &client);
    let named = |conversation: &str| SummaryRequest {
        conversation: conversation.into(),
        identifier_policy: IdentifierPolicy::Off,
        ..request(200)
    };

    let out = team
        .summarize(&named("team:ok"), &Budget::unlimited())
        .await
        .unwrap();
    assert_eq!(out.draft.model, "team-model");
    assert_eq!(out.draft.provider, "nats:summarize.team");
    assert!(!out.draft.fallback);
    assert_eq!(
        builtin.received().len(),
        0,
        "the built-in path was not needed"
    );

    let mut expected_builtin_calls = 0;
    for (conversation, outcome) in [
        ("team:error", "Invalid"),
        ("team:empty", "Invalid"),
        ("team:slow", "Timeout"),
    ] {
        let started = Instant::now();
        let out = team
            .summarize(&named(conversation), &Budget::unlimited())
            .await
            .unwrap();
        expected_builtin_calls += 1;
        assert_eq!(out.draft.model, "m-builtin", "{conversation}");
        assert_eq!(out.draft.content, GOOD);
        assert_eq!(
            builtin.received().len(),
            expected_builtin_calls,
            "{conversation}"
        );
        assert!(
            format!("{:?}", out.calls[0].outcome).starts_with(outcome),
            "{conversation}: {:?}",
            out.calls
        );
        assert_eq!(out.calls[1].outcome, CallOutcome::Ok);
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "{conversation}"
        );
    }

    // Nobody listening on the subject: straight to the built-in path.
    let nobody = team_then_builtin(&external_cfg("summarize.nobody"), &client);
    let out = nobody
        .summarize(&named("team:ok"), &Budget::unlimited())
        .await
        .unwrap();
    assert_eq!(out.draft.model, "m-builtin");
    assert_eq!(out.calls[0].outcome, CallOutcome::Connect);
    assert_eq!(builtin.received().len(), expected_builtin_calls + 1);

    // The pass `serve` runs with `[summarizer.external]`: the team first,
    // the built-in path when the team fails.
    let pass =
        stack::external(&external_cfg("summarize.team"), client.clone()).expect("external stack");
    let draft = pass
        .summarize(&named("team:ok"), &Budget::unlimited())
        .await
        .unwrap()
        .draft;
    assert_eq!(draft.model, "team-model");
    assert_eq!(builtin.received().len(), expected_builtin_calls + 1);
    let budget = Budget::unlimited();
    let draft = pass
        .summarize(&named("team:error"), &budget)
        .await
        .unwrap()
        .draft;
    let spend = budget.spent();
    assert_eq!(draft.model, "m-builtin");
    assert!(!draft.fallback);
    assert_eq!(builtin.received().len(), expected_builtin_calls + 2);
    assert!(spend.calls >= 1, "the built-in call is spent: {spend:?}");
}
