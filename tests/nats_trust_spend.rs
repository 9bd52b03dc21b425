//! Issue 23, finding 3, in the documented tenants deployment
//! (`docs/examples/nats-tenants.conf`): an agent that asks for compaction
//! again and again (`compaction_requested` on its own subject, which makes
//! its jobs urgent) used to run with no call cap (37 calls against a limit
//! of 4) and lock its neighbour in the partition out. Here it is held to
//! the urgent cap of each spend window, the partition's window holds, and
//! the neighbour still gets model calls and compacts. Spend windows run on
//! the partition's clock (the time the stream stored each record), so the
//! windows are a few seconds long and the test runs in real time.

// Tests fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/llm_server.rs"]
mod llm_server;
mod support;

use async_nats::jetstream;
use async_nats::ConnectOptions;
use contextfold::core::event::{CompactionRequested, Encoding, Envelope, EventBody};
use contextfold::core::policy::PolicyConfig;
use contextfold::nats::event_log::event_headers;
use contextfold::nats::serve::{ServeOptions, Service};
use contextfold::summarizer::stack;
use contextfold::summarizer::SummarizerConfig;
use llm_server::{completion, handover_answer, Scripted, ScriptedServer};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::serve::{client_for_config, partition_events, wait_until};
use support::spend::calls_of;
use support::tenants::{service_nats_config, Users, TENANTS_CONF, TENANTS_USERS};

/// What the example permits: agent-1 owns `agent-1`, agent-2 `team:alpha`.
const A: &str = "agent-1";
const B: &str = "team:alpha";
const B_SUBJECT: &str = "cf.in.~dGVhbTphbHBoYQ";
const WINDOW_MS: u64 = 3_000;
/// Calls a conversation's jobs may make per window (urgent ones apart,
/// with the same cap), and the partition's across its conversations.
const CAP: u32 = 2;
const PARTITION_CAP: u32 = 4;

async fn agent(url: &str, seed: String, inbox: &str) -> async_nats::Client {
    ConnectOptions::with_nkey(seed)
        .custom_inbox_prefix(inbox)
        .connect(url)
        .await
        .expect("the agent connects with its NKey")
}

/// A JetStream publish, acknowledged: the event is stored.
async fn store(client: &async_nats::Client, subject: &str, e: &Envelope) {
    jetstream::new(client.clone())
        .publish_with_headers(
            subject.to_string(),
            event_headers(&e.id, Encoding::Json),
            e.to_json().into(),
        )
        .await
        .unwrap_or_else(|err| panic!("publishing {}: {err}", e.id))
        .await
        .unwrap_or_else(|err| panic!("storing {}: {err}", e.id));
}

fn max_in_any_window(calls: &[(u64, u64)]) -> u64 {
    support::spend::max_in_any_window(calls, WINDOW_MS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_asking_again_and_again_is_held_to_its_cap_and_its_neighbour_compacts() {
    let users = Users::generate(&TENANTS_USERS);
    let server = users.server(TENANTS_CONF);
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let model = ScriptedServer::start(|req| {
        Scripted::json(200, completion(&req.model(), &handover_answer(&req.body)))
    })
    .await;
    // One partition: the two agents share its window.
    let nats = || {
        service_nats_config(
            &url,
            users.seed("ACME_SERVICE"),
            "cf",
            Some("_INBOX.cf-service"),
            1,
        )
    };
    let mut opts = ServeOptions::new(nats(), dir.path());
    opts.policy = PolicyConfig {
        default_context_window: 4_000,
        fresh_tail_count: 4,
        leaf_chunk_tokens: 600,
        leaf_target_tokens: 120,
        condensed_target_tokens: 120,
        // Compaction calls only: no rolling state.
        rolling_every_turns: 1_000_000,
        rolling_tool_loop: 1_000_000,
        rolling_threshold: 1.0,
        summary_max_calls_per_window: CAP,
        summary_max_calls_per_window_global: Some(PARTITION_CAP),
        summary_call_window_ms: WINDOW_MS,
        no_progress_backoff_ms: 500,
        summary_spend_backoff_ms: WINDOW_MS,
        ..PolicyConfig::default()
    };
    opts.member_name = Some("cf".into());
    opts.summarizer.poll = Duration::from_millis(100);
    let cfg = SummarizerConfig {
        base_url: model.base_url(),
        model: "m-summary".into(),
        call_timeout_ms: 20_000,
        connect_timeout_ms: 1_000,
        // One call an attempt: the calls the sweeps count are the calls made.
        max_retries: 0,
        ..SummarizerConfig::default()
    };
    let summarizer = stack::model_with_key(&cfg, "test-key-not-secret").expect("summarizer");
    let service = Service::start(opts, Arc::new(summarizer))
        .await
        .expect("serve starts as the service user");
    wait_until("the partition held", Duration::from_secs(10), || {
        service.engines().map(|e| e.partitions().len()) == Some(1)
    })
    .await;
    let a = agent(&url, users.seed("ACME_AGENT_1"), "_INBOX.agent-1").await;
    let b = agent(&url, users.seed("ACME_AGENT_2"), "_INBOX.agent-2").await;
    let (a_turns, b_turns) = (
        support::turns::turns(A, 0..400, 40),
        support::turns::turns(B, 0..400, 40),
    );
    // Both over the threshold first.
    for i in 0..30 {
        store(&a, "cf.in.agent-1", &a_turns[i]).await;
        store(&b, B_SUBJECT, &b_turns[i]).await;
    }
    // Then A asks for compaction every 200 ms for four windows, while both
    // agents go on talking.
    let until = Instant::now() + Duration::from_millis(4 * WINDOW_MS);
    let mut i = 30;
    while Instant::now() < until {
        let ask = Envelope::new(
            format!("ask-{i}"),
            A,
            a_turns[i].time,
            EventBody::CompactionRequested(CompactionRequested::default()),
        );
        store(&a, "cf.in.agent-1", &ask).await;
        store(&a, "cf.in.agent-1", &a_turns[i]).await;
        store(&b, B_SUBJECT, &b_turns[i]).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The jobs in flight end.
    tokio::time::sleep(Duration::from_millis(2 * WINDOW_MS)).await;

    let (_, js, infra) = client_for_config(&nats()).await;
    let log: Vec<Envelope> = partition_events(&js, &infra, 0)
        .await
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    let (calls_a, calls_b) = (calls_of(&log, A), calls_of(&log, B));
    let urgent_a = log
        .iter()
        .filter(|e| e.conversation == A)
        .filter(|e| matches!(&e.body, EventBody::JobIssued(j) if j.urgent))
        .count();
    let summaries_b = log
        .iter()
        .filter(|e| e.conversation == B && matches!(e.body, EventBody::SummaryRecorded(_)))
        .count();
    let max_a = max_in_any_window(&calls_a);
    let all: Vec<(u64, u64)> = calls_a.iter().chain(&calls_b).copied().collect();
    let total = |c: &[(u64, u64)]| c.iter().map(|c| c.1).sum::<u64>();
    eprintln!(
        "SPEND over NATS | A: {} calls, at most {max_a} in a window (cap {CAP}), {urgent_a} urgent \
         jobs | B: {} calls, {summaries_b} summaries | partition: at most {} in a window (cap \
         {PARTITION_CAP}) | model requests {}",
        total(&calls_a),
        total(&calls_b),
        max_in_any_window(&all),
        model.received().len()
    );
    assert!(urgent_a > 0, "A's requests issued urgent jobs");
    assert!(
        max_a <= u64::from(CAP),
        "A made {max_a} calls in one window (cap {CAP})"
    );
    assert!(max_in_any_window(&all) <= u64::from(PARTITION_CAP));
    assert!(total(&calls_b) > 0, "B got no call while A kept asking");
    assert!(summaries_b > 0, "B never compacted");
    service.shutdown().await;
}
