//! Replies go only to inboxes (issue 23, finding 1; DESIGN.md invariant
//! 13), against a nats-server running `docs/examples/nats-tenants.conf` as
//! shipped, with one more user: an observer in the tenant's account that
//! may subscribe to everything and publish nothing, so the test sees
//! whatever the service publishes.
//!
//! An agent may name any reply subject on its own request subject, and the
//! service user's `allow_responses` lets the service publish there, past
//! its own permissions. So a `status` request on the agent's own
//! `cf.api.status.<own>` with its reply set to a lease key, another
//! conversation's service subject, an inbound subject, a JetStream API
//! call, the job queue or any plain subject made the service write there.
//! Each such request must get no answer at all, be counted by family and
//! change nothing; a request replying to an inbox is still answered.
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use async_nats::jetstream;
use async_nats::ConnectOptions;
use contextfold::nats::serve::{ServeOptions, Service};
use contextfold::summarizer::DeterministicSummarizer;
use contextfold::telemetry;
use contextfold::testing::small_policy;
use futures::{StreamExt, TryStreamExt};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use support::serve::wait_until;
use support::tenants::{service_nats_config, Users, TENANTS_CONF, TENANTS_USERS};

const PARTITIONS: u32 = 4;
/// The token nats-tenants.conf gives agent-2's conversation `team:alpha`.
const B_TOKEN: &str = "~dGVhbTphbHBoYQ";

/// `nats-tenants.conf` with an observer in ACME: subscribes to anything,
/// publishes nothing. Every documented user keeps its permissions.
fn with_observer(example: &str) -> String {
    let anchor = "{ nkey: $ACME_OPERATOR, permissions: $CF_OPERATOR }";
    assert!(example.contains(anchor), "the example changed: {anchor}");
    example.replacen(
        anchor,
        &format!(
            "{anchor}\n      {{ nkey: $ACME_OBSERVER, permissions: {{ publish: {{ deny: \">\" }}, \
             subscribe: \">\" }} }}"
        ),
        1,
    )
}

/// Messages the events stream holds on subjects matching `filter`.
async fn stored_on(events: &mut jetstream::stream::Stream, filter: &str) -> u64 {
    let counts: Vec<(String, usize)> = events
        .info_with_subjects(filter)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    counts.iter().map(|(_, n)| *n as u64).sum()
}

/// The job stream's last sequence: how many jobs were ever queued.
async fn last_job(service: &Service) -> u64 {
    let mut jobs = service.infrastructure().jobs.clone();
    jobs.info().await.unwrap().state.last_sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_answers_only_on_inboxes_and_counts_every_other_reply_subject() {
    let metrics = telemetry::install_prometheus().unwrap();
    let mut names = TENANTS_USERS.to_vec();
    names.push("ACME_OBSERVER");
    let users = Users::generate(&names);
    let server = support::nats_server::NatsServer::start_with_config(
        &users.config_text(&with_observer(TENANTS_CONF)),
    );
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let nats = service_nats_config(
        &url,
        users.seed("ACME_SERVICE"),
        "cf",
        Some("_INBOX.cf-service"),
        PARTITIONS,
    );
    let mut opts = ServeOptions::new(nats, dir.path());
    opts.policy = small_policy();
    opts.member_name = Some("acme".into());
    let service = Service::start(opts, Arc::new(DeterministicSummarizer))
        .await
        .expect("serve starts as the service user");
    wait_until("all partitions held", Duration::from_secs(10), || {
        service.engines().map(|e| e.partitions().len()) == Some(PARTITIONS as usize)
    })
    .await;
    let agent = ConnectOptions::with_nkey(users.seed("ACME_AGENT_1"))
        .custom_inbox_prefix("_INBOX.agent-1")
        .connect(&url)
        .await
        .unwrap();
    let observer = ConnectOptions::with_nkey(users.seed("ACME_OBSERVER"))
        .connect(&url)
        .await
        .unwrap();
    let js = jetstream::new(service.client().clone());
    let mut events = service.infrastructure().events.clone();
    let jobs_before = last_job(&service).await;

    // (label of the refusal metric, reply subject the agent names)
    let families = [
        ("kv", "$KV.cf_leases.members.fake-1".to_string()),
        ("kv", "$KV.cf_leases.partitions.0".to_string()),
        ("service_events", format!("cf.svc.{B_TOKEN}")),
        ("inbound", "cf.in.phantom-1".to_string()),
        ("jetstream_api", "$JS.API.STREAM.DELETE.CF_DEAD".to_string()),
        ("jobs", "cf.job.agent-1".to_string()),
        ("other", "reports.daily".to_string()),
    ];
    let mut watched = Vec::new();
    for (_, subject) in &families {
        watched.push(observer.subscribe(subject.clone()).await.unwrap());
    }
    observer.flush().await.unwrap();
    // The observer may publish nothing, so no round trip confirms its
    // subscriptions: give the server a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let body = json!({ "conversation": "agent-1" }).to_string();
    for (_, reply) in &families {
        agent
            .publish_with_reply("cf.api.status.agent-1", reply.clone(), body.clone().into())
            .await
            .unwrap();
    }
    // A request on an inbox is still answered (and comes after the others).
    let answered = agent
        .request("cf.api.status.agent-1", body.clone().into())
        .await
        .expect("a request with an inbox is answered");
    let answered: serde_json::Value = serde_json::from_slice(&answered.payload).unwrap();
    // (An unknown conversation: the answer says so.)
    assert!(answered.to_string().contains("agent-1"), "{answered}");
    let mut own = agent.subscribe("_INBOX.agent-1.by-hand").await.unwrap();
    agent.flush().await.unwrap();
    agent
        .publish_with_reply(
            "cf.api.status.agent-1",
            "_INBOX.agent-1.by-hand",
            body.clone().into(),
        )
        .await
        .unwrap();
    let by_hand = tokio::time::timeout(Duration::from_secs(5), own.next()).await;
    assert!(
        matches!(by_hand, Ok(Some(_))),
        "a reply subject under the agent's own inbox prefix was not answered"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;

    // What the observer saw of the answers (they name the conversation; a
    // lease key also carries the service's own renewals).
    let mut published = Vec::new();
    for ((_, subject), sub) in families.iter().zip(watched.iter_mut()) {
        while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(50), sub.next()).await {
            let text = String::from_utf8_lossy(&m.payload);
            if text.contains("agent-1") {
                published.push(format!("{subject}: {}", &text[..text.len().min(60)]));
            }
        }
    }
    let mut harm = Vec::new();
    if let Ok(Some(_)) = service
        .infrastructure()
        .leases
        .entry("members.fake-1")
        .await
    {
        harm.push("a lease member `fake-1` was written".to_string());
    }
    let b = stored_on(&mut events, &format!("cf.ev.*.svc.{B_TOKEN}")).await;
    if b > 0 {
        harm.push(format!("{b} record(s) stored in team:alpha's conversation"));
    }
    let phantom = stored_on(&mut events, "cf.ev.*.in.phantom-1").await;
    if phantom > 0 {
        harm.push(format!("{phantom} record(s) stored for phantom-1"));
    }
    if js.get_stream("CF_DEAD").await.is_err() {
        harm.push("the dead-letter stream CF_DEAD was deleted".to_string());
    }
    let jobs_after = last_job(&service).await;
    if jobs_after != jobs_before {
        harm.push(format!(
            "{} message(s) queued as jobs",
            jobs_after - jobs_before
        ));
    }
    assert!(
        published.is_empty() && harm.is_empty(),
        "the service answered on reply subjects that are no inbox:\n  {}\nand so:\n  {}",
        published.join("\n  "),
        harm.join("\n  ")
    );

    let text = metrics.render();
    for (family, expected) in [
        ("kv", 2),
        ("service_events", 1),
        ("inbound", 1),
        ("jetstream_api", 1),
        ("jobs", 1),
        ("other", 1),
    ] {
        let line =
            format!("contextfold_api_replies_refused_total{{family=\"{family}\"}} {expected}");
        assert!(text.contains(&line), "no `{line}` in:\n{text}");
    }
    service.shutdown().await;
}
