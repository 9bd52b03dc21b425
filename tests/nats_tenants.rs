//! Tenants and NATS permissions (docs/subjects.md, "Permissions" and
//! "Tenants") against real nats-servers started with the shipped examples,
//! `docs/examples/nats-tenants.conf` and `nats-shared-service.conf`, whose
//! NKey users are generated here. `contextfold serve` runs in-process as
//! the service user; each agent connects as its own NKey user, permitted
//! only its conversation's subjects and its own inbox.
//!
//! - An agent folds and reads its own conversation, and can neither write,
//!   read, compact nor overhear another's: the server refuses (seen by the
//!   client), nothing is stored, the other conversation is unchanged.
//! - Service events an agent publishes on its own inbound subject are
//!   rejected by the fold with a reason, and refused by the server on the
//!   service subject; the same summary from the service is accepted.
//! - Way 1: two tenant accounts with a serve each share nothing, and a
//!   tenant whose serve is down gets no answer at all.
//! - Way 2: one service account with a serve per tenant prefix; the
//!   tenants keep the plain `cf.` subjects through imports.
//! - The examples' service permissions are enough: the server logs no
//!   violation by a service user.
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use async_nats::jetstream;
use async_nats::{Client, ConnectOptions, Event, HeaderMap, ServerError};
use contextfold::core::event::{
    Covers, Encoding, Envelope, EventBody, ModelDeclared, RollingState, RollingStateUpdated,
    SummaryKind, SummaryRecorded, SweepEnded, SweepStop, TurnAppended,
};
use contextfold::core::message::{ChatMessage, Role};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::{summary_id, TurnBodies};
use contextfold::nats::event_log::event_headers;
use contextfold::nats::jobs::snapshot_object_name;
use contextfold::nats::serve::{ServeOptions, Service};
use contextfold::nats::subjects::{encode_conversation, partition_of};
use contextfold::nats::NatsOptions;
use contextfold::summarizer::DeterministicSummarizer;
use contextfold::testing::small_policy;
use futures::StreamExt;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::tenants::{
    service_nats_config, violations_by, Users, SHARED_CONF, SHARED_USERS, TENANTS_CONF,
    TENANTS_USERS,
};

const PARTITIONS: u32 = 4;
/// What the examples permit: agent-1 owns `agent-1`, agent-2 `team:alpha`.
const A: &str = "agent-1";
const B: &str = "team:alpha";
/// The token nats-tenants.conf hard-codes for `team:alpha`.
const B_TOKEN: &str = "~dGVhbTphbHBoYQ";

/// How long a refused request waits before it counts as unanswered.
const REFUSED_WAIT: Duration = Duration::from_millis(700);

async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn policy() -> PolicyConfig {
    // Small chunks and a short fresh tail, so a few turns compact when
    // asked; a large window, so nothing compacts unless asked.
    PolicyConfig {
        default_context_window: 128_000,
        fresh_tail_count: 2,
        ..small_policy()
    }
}

/// `contextfold serve` (every role) as the NKey user `seed`, waiting until
/// it holds every partition.
async fn serve(url: &str, seed: String, prefix: &str, inbox: Option<&str>, data: &Path) -> Service {
    serve_with(url, seed, prefix, inbox, data, policy()).await
}

/// [`serve`] under `policy`.
async fn serve_with(
    url: &str,
    seed: String,
    prefix: &str,
    inbox: Option<&str>,
    data: &Path,
    policy: PolicyConfig,
) -> Service {
    let nats = service_nats_config(url, seed, prefix, inbox, PARTITIONS);
    let mut opts = ServeOptions::new(nats, data);
    opts.policy = policy;
    opts.member_name = Some(prefix.replace('.', "-"));
    opts.summarizer.poll = Duration::from_millis(100);
    let service = Service::start(opts, Arc::new(DeterministicSummarizer))
        .await
        .expect("serve starts as the service user");
    wait_until("all partitions held", Duration::from_secs(10), || {
        service.engines().map(|e| e.partitions().len()) == Some(PARTITIONS as usize)
    })
    .await;
    service
}

/// The documented tenants deployment with ACME's `serve` running under
/// `policy`: the users, the server, the service's data folder and the
/// service.
struct Acme {
    users: Users,
    server: support::nats_server::NatsServer,
    dir: tempfile::TempDir,
    service: Service,
}

impl Acme {
    async fn start(policy: PolicyConfig) -> Acme {
        let users = Users::generate(&TENANTS_USERS);
        let server = users.server(TENANTS_CONF);
        let dir = tempfile::tempdir().unwrap();
        let service = serve_with(
            &server.url(),
            users.seed("ACME_SERVICE"),
            "cf",
            Some("_INBOX.cf-service"),
            dir.path(),
            policy,
        )
        .await;
        Acme {
            users,
            server,
            dir,
            service,
        }
    }

    /// An ACME agent (`ACME_AGENT_1` or `ACME_AGENT_2`), replying on its inbox.
    async fn agent(&self, name: &str, inbox: &str) -> User {
        User::connect(&self.server.url(), self.users.seed(name), inbox).await
    }
}

/// Turns, summaries and state hash of a conversation the service folds.
fn folded(service: &Service, key: &str) -> Option<(usize, usize, String)> {
    with_folded(service, key, |conv, bodies| {
        (
            conv.turns.len(),
            conv.summaries.len(),
            conv.hash_with(bodies).unwrap(),
        )
    })
}

/// `f` of `key`'s conversation as the service folds it, with the bodies
/// its engine reads; `None` while the partition is not held here or the
/// conversation is unknown.
fn with_folded<R>(
    service: &Service,
    key: &str,
    f: impl FnOnce(&contextfold::core::state::Conversation, &dyn TurnBodies) -> R,
) -> Option<R> {
    let engines = service.engines()?;
    let engine = engines.get(partition_of(key, PARTITIONS).ok()?)?;
    let e = engine.lock().unwrap();
    let conv = e.state.conversations.get(key)?;
    Some(f(conv, &e.bodies()))
}

/// Whether every partition of `service` folded the policy it recorded
/// (each partition's first record on a new stream).
fn policy_recorded_everywhere(service: &Service) -> bool {
    service.engines().is_some_and(|e| {
        let held = e.partitions();
        held.len() == PARTITIONS as usize
            && held.iter().all(|p| {
                e.get(*p)
                    .is_some_and(|engine| engine.lock().unwrap().active_policy().recorded)
            })
    })
}

fn turns_of(service: &Service, key: &str) -> usize {
    folded(service, key).map_or(0, |c| c.0)
}

fn turn(conv: &str, i: u64, text: &str) -> Envelope {
    // Enough words that a summary is smaller than what it covers.
    let filler: String = (0..60).map(|w| format!(" w{}", (w * 7 + i) % 89)).collect();
    let role = if i.is_multiple_of(2) {
        Role::User
    } else {
        Role::Assistant
    };
    Envelope::new(
        format!("{conv}#{i}"),
        conv,
        1_700_000_000_000 + i * 2_000,
        EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
            role,
            format!("turn {i}: {text}.{filler}"),
        ))),
    )
}

/// A leaf summary of turns 0..=3 that the fold would accept: its own
/// content address, outside the fresh tail.
fn summary(conv: &str, id: &str, content: &str) -> Envelope {
    let covers = Covers::Turns { first: 0, last: 3 };
    let prompt_version = "forged-1";
    Envelope::new(
        id,
        conv,
        1_700_000_100_000,
        EventBody::SummaryRecorded(SummaryRecorded {
            summary_id: summary_id(conv, SummaryKind::Leaf, 0, &covers, content, prompt_version),
            job_id: None,
            kind: SummaryKind::Leaf,
            depth: 0,
            covers,
            content: content.to_string(),
            source_tokens: 100,
            tokens: 10,
            model: "forger".into(),
            provider: "forger".into(),
            prompt_version: prompt_version.into(),
            fallback: false,
            supersedes: None,
        }),
    )
}

/// A connected NATS user and the refusals the server reported to it.
struct User {
    client: Client,
    refusals: Arc<Mutex<Vec<String>>>,
}

impl User {
    /// Connects with an NKey seed, replies on `inbox`, and records every
    /// error the server reports (permission violations among them).
    async fn connect(url: &str, seed: String, inbox: &str) -> User {
        let refusals = Arc::new(Mutex::new(Vec::new()));
        let seen = refusals.clone();
        let client = ConnectOptions::with_nkey(seed)
            .custom_inbox_prefix(inbox)
            .event_callback(move |event| {
                let seen = seen.clone();
                async move {
                    if let Event::ServerError(ServerError::Other(e)) = event {
                        seen.lock().unwrap().push(e);
                    }
                }
            })
            .connect(url)
            .await
            .expect("the user connects with its NKey");
        User { client, refusals }
    }

    /// Waits until the server reported refusing `what` (`publish`,
    /// `subscription`) on `subject`.
    async fn refused(&self, what: &str, subject: &str) {
        let needle = format!("permissions violation for {what} to \"{subject}\"").to_lowercase();
        let refusals = self.refusals.clone();
        let found = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if refusals
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|e| e.to_lowercase().contains(&needle))
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            found.is_ok(),
            "the server did not refuse {what} on {subject}; refusals: {:?}",
            self.refusals.lock().unwrap()
        );
    }

    /// A request that must be answered; `not_owner` is asked again.
    async fn ask(&self, subject: &str, body: Value) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let reply = self
                .client
                .request(subject.to_string(), body.to_string().into())
                .await
                .unwrap_or_else(|e| panic!("no answer on {subject}: {e}"));
            let value: Value = serde_json::from_slice(&reply.payload).expect("a JSON reply");
            if value["error"]["code"] != "not_owner" || Instant::now() > deadline {
                return value;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A request the server must refuse: no answer, and a violation.
    async fn ask_refused(&self, subject: &str, body: Value) {
        let request = async_nats::Request::new()
            .payload(body.to_string().into())
            .timeout(Some(REFUSED_WAIT));
        let answer = self.client.send_request(subject.to_string(), request).await;
        assert!(answer.is_err(), "{subject} was answered: {answer:?}");
        self.refused("publish", subject).await;
    }

    /// A JetStream publish: the event is stored and acknowledged.
    async fn store(&self, subject: &str, event: &Envelope) -> jetstream::publish::PublishAck {
        jetstream::new(self.client.clone())
            .publish_with_headers(
                subject.to_string(),
                event_headers(&event.id, Encoding::Json),
                event.to_json().into(),
            )
            .await
            .unwrap_or_else(|e| panic!("publishing {} on {subject}: {e}", event.id))
            .await
            .unwrap_or_else(|e| panic!("storing {} from {subject}: {e}", event.id))
    }

    /// A plain publish the server must refuse.
    async fn publish_refused(&self, subject: &str, event: &Envelope) {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", event.id.as_str());
        headers.insert("Content-Type", "application/json");
        self.client
            .publish_with_headers(subject.to_string(), headers, event.to_json().into())
            .await
            .unwrap();
        self.client.flush().await.unwrap();
        self.refused("publish", subject).await;
    }

    /// A subscription the server must refuse; returns it, so the caller
    /// can check that nothing arrives on it.
    async fn subscribe_refused(&self, subject: &str) -> async_nats::Subscriber {
        let sub = self.client.subscribe(subject.to_string()).await.unwrap();
        self.client.flush().await.unwrap();
        self.refused("subscription", subject).await;
        sub
    }
}

/// The text of every message an `assemble` reply holds.
fn assembled_text(reply: &Value) -> String {
    assert!(reply.get("error").is_none(), "assemble failed: {reply}");
    reply["messages"].to_string()
}

/// Events received on a subscription, decoded.
async fn next_event(sub: &mut async_nats::Subscriber, limit: Duration) -> Option<Envelope> {
    let message = tokio::time::timeout(limit, sub.next()).await.ok()??;
    let encoding = Encoding::from_header(
        message
            .headers
            .as_ref()
            .and_then(|h| h.get("Content-Type"))
            .map(|v| v.as_str()),
    );
    Some(Envelope::decode(&message.payload, encoding).expect("a decodable event"))
}

/// Waits for an event of `kind` on `sub` for which `pick` holds.
async fn wait_event(
    sub: &mut async_nats::Subscriber,
    kind: &str,
    mut pick: impl FnMut(&Envelope) -> bool,
) -> Envelope {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen = Vec::new();
    while let Some(e) = next_event(sub, deadline.saturating_duration_since(Instant::now())).await {
        if e.type_name() == kind && pick(&e) {
            return e;
        }
        seen.push(e.to_json());
    }
    panic!("no {kind} event arrived; saw {seen:?}");
}

fn api(op: &str, key: &str) -> String {
    format!("cf.api.{op}.{}", encode_conversation(key).unwrap())
}

/// Every conversation operation, with a body naming `key`.
fn operations(key: &str) -> Vec<(&'static str, Value)> {
    vec![
        ("assemble", json!({ "conversation": key })),
        ("status", json!({ "conversation": key })),
        ("grep", json!({ "conversation": key, "pattern": "turn" })),
        ("describe", json!({ "conversation": key, "id": 0 })),
        (
            "expand",
            json!({ "conversation": key, "summary_id": "sum_x" }),
        ),
        ("history", json!({ "conversation": key })),
        (
            "compact",
            json!({ "conversation": key, "request_id": "r-1", "target_tokens": 50 }),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_reaches_only_its_own_conversation() {
    let users = Users::generate(&TENANTS_USERS);
    let server = users.server(TENANTS_CONF);
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let service = serve(
        &url,
        users.seed("ACME_SERVICE"),
        "cf",
        Some("_INBOX.cf-service"),
        dir.path(),
    )
    .await;
    assert_eq!(encode_conversation(B).unwrap(), B_TOKEN);
    let (a_in, b_in) = ("cf.in.agent-1".to_string(), format!("cf.in.{B_TOKEN}"));

    let a = User::connect(&url, users.seed("ACME_AGENT_1"), "_INBOX.agent-1").await;
    // B connects through contextfold's own options: seed file, inbox prefix.
    let seed_file = dir.path().join("agent-2.nk");
    std::fs::write(&seed_file, users.seed("ACME_AGENT_2")).unwrap();
    let b_options = NatsOptions {
        nkey_seed_file: Some(seed_file),
        inbox_prefix: Some("_INBOX.agent-2".into()),
        ..NatsOptions::with_servers([url.as_str()])
    };
    let b = User {
        client: b_options.connect().await.expect("B connects").0,
        refusals: Arc::default(),
    };
    let operator = User::connect(&url, users.seed("ACME_OPERATOR"), "_INBOX.operator").await;

    // Each agent stores its turns on its own subject (the acks come back on
    // its own inbox) and reads its own conversation.
    for i in 0..10 {
        a.store(&a_in, &turn(A, i, "notes of agent one")).await;
    }
    for i in 0..6 {
        b.store(&b_in, &turn(B, i, "secret of agent two")).await;
    }
    wait_until("both conversations folded", Duration::from_secs(10), || {
        turns_of(&service, A) == 10 && turns_of(&service, B) == 6
    })
    .await;
    let own = assembled_text(
        &a.ask(&api("assemble", A), json!({ "conversation": A }))
            .await,
    );
    assert!(own.contains("turn 9: notes of agent one"), "{own}");
    assert!(!own.contains("secret of agent two"), "{own}");
    // Every read on its own subjects is answered (so the refusals below
    // are the permissions', not a broken request).
    for (op, body) in operations(A) {
        if op != "compact" {
            let reply = a.ask(&api(op, A), body).await;
            if op != "expand" {
                assert!(reply.get("error").is_none(), "{op}: {reply}");
            }
        }
    }
    let b_before = folded(&service, B);
    let mut events = service.infrastructure().events.clone();
    let last_stored = events.info().await.unwrap().state.last_sequence;

    // A cannot write to B's conversation, nor service events anywhere.
    a.publish_refused(&b_in, &turn(B, 100, "FORGED BY AGENT ONE"))
        .await;
    for subject in ["cf.svc.agent-1".to_string(), format!("cf.svc.{B_TOKEN}")] {
        a.publish_refused(&subject, &summary(A, "forged-on-svc", "FORGED ON SVC"))
            .await;
    }
    // A reads or compacts B by no operation, and reads neither the global
    // status nor the events stream itself.
    let refused = operations(B)
        .into_iter()
        .map(|(op, body)| (api(op, B), body))
        .chain([
            ("cf.admin.status".to_string(), json!({})),
            ("$JS.API.STREAM.INFO.CF_EVENTS".to_string(), json!({})),
            (
                "$JS.API.DIRECT.GET.CF_EVENTS".to_string(),
                json!({ "seq": 1 }),
            ),
        ])
        .collect::<Vec<_>>();
    futures::future::join_all(
        refused
            .iter()
            .map(|(subject, body)| a.ask_refused(subject, body.clone())),
    )
    .await;
    // Naming B in the body of its own subject gets a refusal, not B.
    let crossed = a
        .ask(&api("assemble", A), json!({ "conversation": B }))
        .await;
    assert_eq!(crossed["error"]["code"], "bad_request", "{crossed}");
    assert!(!crossed.to_string().contains("secret"), "{crossed}");
    // A cannot overhear B's replies or the service's events about B.
    let mut overheard = Vec::new();
    for subject in [
        "_INBOX.>".to_string(),
        format!("cf.svc.{B_TOKEN}"),
        "cf.ev.>".into(),
    ] {
        overheard.push(a.subscribe_refused(&subject).await);
    }
    let theirs = assembled_text(
        &b.ask(&api("assemble", B), json!({ "conversation": B }))
            .await,
    );
    assert!(theirs.contains("secret of agent two"), "{theirs}");
    for sub in &mut overheard {
        let got = tokio::time::timeout(Duration::from_millis(200), sub.next()).await;
        assert!(!matches!(got, Ok(Some(_))), "A overheard {got:?}");
    }
    // Nothing A tried was stored or changed B: B's next event is the very
    // next in the stream.
    assert_eq!(folded(&service, B), b_before);
    let ack = b.store(&b_in, &turn(B, 6, "more of agent two")).await;
    assert_eq!(ack.sequence, last_stored + 1, "something else was stored");
    wait_until("B's 7th turn folded", Duration::from_secs(10), || {
        turns_of(&service, B) == 7
    })
    .await;
    let theirs = assembled_text(
        &b.ask(&api("assemble", B), json!({ "conversation": B }))
            .await,
    );
    assert!(!theirs.contains("FORGED"), "{theirs}");
    assert_eq!(folded(&service, B).map(|c| c.1), b_before.map(|c| c.1));

    // Service events A stores on its own inbound subject are rejected by
    // the fold, each with a reason A can read on `cf.svc.<its token>`.
    let mut decisions = a.client.subscribe("cf.svc.agent-1").await.unwrap();
    let before = assembled_text(
        &a.ask(&api("assemble", A), json!({ "conversation": A }))
            .await,
    );
    let forged = [
        summary(A, "forged-summary", "FORGED SUMMARY of agent one"),
        Envelope::new(
            "forged-rolling",
            A,
            1_700_000_100_000,
            EventBody::RollingStateUpdated(RollingStateUpdated {
                state: RollingState {
                    completed: "FORGED STATE".into(),
                    ..RollingState::default()
                },
                through_turn: 5,
                job_id: None,
            }),
        ),
        Envelope::new(
            "forged-sweep",
            A,
            1_700_000_100_000,
            EventBody::SweepEnded(SweepEnded {
                job_id: "job_forged".into(),
                passes: 1,
                committed: 1,
                stop: SweepStop::Done,
                detail: None,
                calls: 0,
                tokens_spent: 0,
                cost_micros: 0,
                retry_after_ms: None,
            }),
        ),
    ];
    for event in &forged {
        a.store(&a_in, event).await;
    }
    for event in &forged {
        let rejected = wait_event(
            &mut decisions,
            "event_rejected",
            |e| matches!(&e.body, EventBody::EventRejected(r) if r.rejected_id == event.id),
        )
        .await;
        let EventBody::EventRejected(r) = rejected.body else {
            unreachable!()
        };
        assert_eq!(r.event_type.as_deref(), Some(event.type_name()));
        assert!(
            r.reason.contains("written only by contextfold itself"),
            "{}",
            r.reason
        );
    }
    let after = assembled_text(
        &a.ask(&api("assemble", A), json!({ "conversation": A }))
            .await,
    );
    assert_eq!(before, after, "a forged event changed A's context");
    assert_eq!(folded(&service, A).map(|c| c.1), Some(0));
    // model_declared is an agent event: it passes.
    let model = Envelope::new(
        "model-1",
        A,
        1_700_000_100_000,
        EventBody::ModelDeclared(ModelDeclared {
            model: "gpt-4o".into(),
            context_window: None,
        }),
    );
    a.store(&a_in, &model).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.ask(&api("status", A), json!({ "conversation": A })).await["model"] != "gpt-4o" {
        assert!(Instant::now() < deadline, "model_declared was not folded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The control: the same summary from the service is accepted, so the
    // rejections above are what kept it out of A's context.
    let genuine = summary(A, "service-summary", "FORGED SUMMARY of agent one");
    jetstream::new(service.client().clone())
        .publish_with_headers(
            "cf.svc.agent-1",
            event_headers(&genuine.id, Encoding::Json),
            genuine.to_json().into(),
        )
        .await
        .unwrap()
        .await
        .expect("the service stores its own events");
    wait_until(
        "the service's summary folded",
        Duration::from_secs(10),
        || folded(&service, A).map(|c| c.1) == Some(1),
    )
    .await;
    // At a budget of the context as folded (the summary at its own size),
    // so that assembly does not open the summary back into its turns.
    let context = a.ask(&api("status", A), json!({ "conversation": A })).await["tokens"]["context"]
        .as_u64()
        .expect("status gives the context's tokens");
    let summarized = assembled_text(
        &a.ask(
            &api("assemble", A),
            json!({ "conversation": A, "budget": context }),
        )
        .await,
    );
    assert!(
        summarized.contains("FORGED SUMMARY of agent one"),
        "{summarized}"
    );

    // A compacts its own conversation: the service stores the request, and
    // the job runs through the queue and the object store.
    let body = json!({ "conversation": A, "request_id": "r-1", "target_tokens": 50 });
    let compacted = a.ask(&api("compact", A), body).await;
    assert_eq!(compacted["published"], true, "{compacted}");
    let ended = wait_event(&mut decisions, "sweep_ended", |_| true).await;
    let EventBody::SweepEnded(ended) = ended.body else {
        unreachable!()
    };
    assert!(ended.committed > 0, "{ended:?}");
    service
        .infrastructure()
        .payloads
        .info(&snapshot_object_name(&ended.job_id))
        .await
        .expect("the job's snapshot went through the object store");

    // The operator sees the whole tenant; the agent could not (above).
    let status = operator.ask("cf.admin.status", json!({})).await;
    assert_eq!(status["scope"], "global", "{status}");
    assert_eq!(status["conversations"], 2, "{status}");

    // The agents' refusals are in the server log under their keys, and
    // the service needed nothing it was not given.
    assert!(!violations_by(&server, &users.public("ACME_AGENT_1")).is_empty());
    let by_service = violations_by(&server, &users.public("ACME_SERVICE"));
    assert!(by_service.is_empty(), "{by_service:#?}");
    service.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_accounts_share_nothing() {
    let users = Users::generate(&TENANTS_USERS);
    let server = users.server(TENANTS_CONF);
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let (acme_data, globex_data) = (dir.path().join("acme"), dir.path().join("globex"));
    let acme = serve(
        &url,
        users.seed("ACME_SERVICE"),
        "cf",
        Some("_INBOX.cf-service"),
        &acme_data,
    )
    .await;
    let globex = serve(
        &url,
        users.seed("GLOBEX_SERVICE"),
        "cf",
        Some("_INBOX.cf-service"),
        &globex_data,
    )
    .await;
    let acme_agent = User::connect(&url, users.seed("ACME_AGENT_1"), "_INBOX.agent-1").await;
    let globex_agent = User::connect(&url, users.seed("GLOBEX_AGENT_1"), "_INBOX.agent-1").await;
    let subject = "cf.in.agent-1";

    // The same subject, the same conversation key, the same stream name:
    // two streams, each counting from 1 (after the policy each partition
    // recorded first).
    wait_until(
        "both tenants recorded their policy",
        Duration::from_secs(10),
        || policy_recorded_everywhere(&acme) && policy_recorded_everywhere(&globex),
    )
    .await;
    let first = u64::from(PARTITIONS) + 1;
    for i in 0..4 {
        let ack = acme_agent.store(subject, &turn(A, i, "acme only")).await;
        assert_eq!(
            (ack.stream.as_str(), ack.sequence),
            ("CF_EVENTS", first + i)
        );
        let ack = globex_agent
            .store(subject, &turn(A, i, "globex only"))
            .await;
        assert_eq!(
            (ack.stream.as_str(), ack.sequence),
            ("CF_EVENTS", first + i)
        );
    }
    wait_until("both tenants folded", Duration::from_secs(10), || {
        turns_of(&acme, A) == 4 && turns_of(&globex, A) == 4
    })
    .await;
    let body = json!({ "conversation": A });
    let mine = assembled_text(&acme_agent.ask(&api("assemble", A), body.clone()).await);
    assert!(
        mine.contains("acme only") && !mine.contains("globex"),
        "{mine}"
    );
    let theirs = assembled_text(&globex_agent.ask(&api("assemble", A), body.clone()).await);
    assert!(
        theirs.contains("globex only") && !theirs.contains("acme"),
        "{theirs}"
    );
    let operator = User::connect(&url, users.seed("ACME_OPERATOR"), "_INBOX.operator").await;
    let status = operator.ask("cf.admin.status", json!({})).await;
    assert_eq!(
        (status["conversations"].clone(), status["turns"].clone()),
        (json!(1), json!(4))
    );

    // With its own serve down, a tenant gets no answer at all: the other
    // tenant's serve, subscribed to the same subjects, is out of reach.
    acme.shutdown().await;
    let asked = acme_agent
        .client
        .request(api("assemble", A), body.to_string().into())
        .await;
    let kind = asked.as_ref().map(|_| ()).map_err(|e| e.kind());
    assert_eq!(
        kind,
        Err(async_nats::RequestErrorKind::NoResponders),
        "{asked:?}"
    );
    let theirs = assembled_text(&globex_agent.ask(&api("assemble", A), body.clone()).await);
    assert!(theirs.contains("globex only"), "{theirs}");
    // Its events are still stored in its own account, and folded when its
    // serve is back (over the streams it finds in place).
    let ack = acme_agent.store(subject, &turn(A, 4, "acme only")).await;
    assert_eq!(ack.sequence, first + 4);
    let acme = serve(
        &url,
        users.seed("ACME_SERVICE"),
        "cf",
        Some("_INBOX.cf-service"),
        &acme_data,
    )
    .await;
    wait_until("acme's fifth turn folded", Duration::from_secs(10), || {
        turns_of(&acme, A) == 5
    })
    .await;
    assert_eq!(turns_of(&globex, A), 4);

    for service in ["ACME_SERVICE", "GLOBEX_SERVICE"] {
        let refused = violations_by(&server, &users.public(service));
        assert!(refused.is_empty(), "{service}: {refused:#?}");
    }
    acme.shutdown().await;
    globex.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_service_account_serves_each_tenant_under_its_own_prefix() {
    let users = Users::generate(&SHARED_USERS);
    let server = users.server(SHARED_CONF);
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let acme = serve(
        &url,
        users.seed("CF_ACME_SERVICE"),
        "acme.cf",
        Some("_INBOX.acme-cf"),
        &dir.path().join("acme"),
    )
    .await;
    let globex = serve(
        &url,
        users.seed("CF_GLOBEX_SERVICE"),
        "globex.cf",
        Some("_INBOX.globex-cf"),
        &dir.path().join("globex"),
    )
    .await;
    let acme_agent = User::connect(&url, users.seed("ACME_AGENT_1"), "_INBOX.agent-1").await;
    let globex_agent = User::connect(&url, users.seed("GLOBEX_AGENT_1"), "_INBOX.agent-1").await;
    let mut acme_events = acme_agent.client.subscribe("cf.svc.agent-1").await.unwrap();
    let mut globex_events = globex_agent
        .client
        .subscribe("cf.svc.agent-1")
        .await
        .unwrap();

    // Both tenants publish on plain `cf.in.agent-1`; the imports store each
    // in its tenant's stream and the acknowledgement comes back.
    for i in 0..8 {
        let ack = acme_agent
            .store("cf.in.agent-1", &turn(A, i, "acme only"))
            .await;
        assert_eq!(ack.stream, "ACME_CF_EVENTS");
        let ack = globex_agent
            .store("cf.in.agent-1", &turn(A, i, "globex only"))
            .await;
        assert_eq!(ack.stream, "GLOBEX_CF_EVENTS");
    }
    wait_until("both tenants folded", Duration::from_secs(10), || {
        turns_of(&acme, A) == 8 && turns_of(&globex, A) == 8
    })
    .await;
    let body = json!({ "conversation": A });
    let mine = assembled_text(&acme_agent.ask(&api("assemble", A), body.clone()).await);
    assert!(
        mine.contains("acme only") && !mine.contains("globex"),
        "{mine}"
    );
    let theirs = assembled_text(&globex_agent.ask(&api("assemble", A), body.clone()).await);
    assert!(
        theirs.contains("globex only") && !theirs.contains("acme"),
        "{theirs}"
    );

    // The fold still tells agents from the service: a forged summary is
    // rejected, and the tenant's agent reads why on `cf.svc.<token>`.
    let forged = summary(A, "forged-summary", "FORGED");
    acme_agent.store("cf.in.agent-1", &forged).await;
    wait_event(
        &mut acme_events,
        "event_rejected",
        |e| matches!(&e.body, EventBody::EventRejected(r) if r.rejected_id == forged.id),
    )
    .await;
    assert_eq!(folded(&acme, A).map(|c| c.1), Some(0));
    // A compaction asked through the API runs in the tenant's service; its
    // decisions reach that tenant only.
    let body = json!({ "conversation": A, "request_id": "r-1", "target_tokens": 50 });
    let compacted = acme_agent.ask(&api("compact", A), body).await;
    assert_eq!(compacted["published"], true, "{compacted}");
    wait_event(&mut acme_events, "sweep_ended", |_| true).await;
    wait_until("acme's summaries folded", Duration::from_secs(10), || {
        folded(&acme, A).map(|c| c.1) > Some(0)
    })
    .await;
    let leaked = next_event(&mut globex_events, Duration::from_millis(300)).await;
    assert!(leaked.is_none(), "globex received {leaked:?}");
    assert_eq!(folded(&globex, A).map(|c| c.1), Some(0));
    // The tenant's operator sees its tenant's service only.
    let operator = User::connect(&url, users.seed("ACME_OPERATOR"), "_INBOX.operator").await;
    let status = operator.ask("cf.admin.status", json!({})).await;
    assert_eq!(
        (status["conversations"].clone(), status["turns"].clone()),
        (json!(1), json!(8))
    );

    for service in ["CF_ACME_SERVICE", "CF_GLOBEX_SERVICE"] {
        let refused = violations_by(&server, &users.public(service));
        assert!(refused.is_empty(), "{service}: {refused:#?}");
    }
    // In the shared account each service reaches only its own prefix's
    // streams.
    let probe = "$JS.API.STREAM.INFO.ACME_CF_EVENTS";
    let request = async_nats::Request::new().timeout(Some(REFUSED_WAIT));
    let answer = globex.client().send_request(probe, request).await;
    assert!(answer.is_err(), "{answer:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !violations_by(&server, &users.public("CF_GLOBEX_SERVICE"))
        .iter()
        .any(|l| l.contains(probe))
    {
        assert!(Instant::now() < deadline, "{probe} was not refused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    acme.shutdown().await;
    globex.shutdown().await;
}

/// Finding 5 of issue 23, in the documented tenants deployment: agent-1
/// floods its own conversation with plain publishes (as fast as the
/// server takes them) while agent-2 works. Intake holds agent-1 to its
/// conversation's quota (what is over it refused with a record per
/// episode, counted in `status`), and every turn of agent-2 is folded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_by_one_agent_is_held_to_its_quota_while_the_other_is_folded() {
    const RATE: u64 = 20;
    const BURST: u64 = 100;
    let acme = Acme::start(PolicyConfig {
        intake_events_per_second: Some(RATE as u32),
        intake_burst_events: BURST as u32,
        ..policy()
    })
    .await;
    let service = &acme.service;
    let a = acme.agent("ACME_AGENT_1", "_INBOX.agent-1").await;
    let b = acme.agent("ACME_AGENT_2", "_INBOX.agent-2").await;
    let started = Instant::now();
    const FLOOD: usize = 2_000;
    for e in &support::turns::turns(A, 0..FLOOD, 3) {
        a.client
            .publish_with_headers(
                "cf.in.agent-1",
                event_headers(&e.id, Encoding::Json),
                e.to_json().into(),
            )
            .await
            .unwrap();
    }
    a.client.flush().await.unwrap();
    let b_in = format!("cf.in.{B_TOKEN}");
    for e in &support::turns::turns(B, 0..20, 3) {
        b.store(&b_in, e).await;
    }
    wait_until("agent-2's turns folded", Duration::from_secs(20), || {
        folded(service, B).map(|c| c.0) == Some(20)
    })
    .await;
    // Every event agent-1 got stored was folded: admitted or refused.
    let quota_of = || {
        with_folded(service, A, |conv, _| {
            (conv.turns.len() as u64, conv.quota.refused, conv.rejections)
        })
    };
    wait_until("agent-1's flood folded", Duration::from_secs(20), || {
        quota_of().is_some_and(|(turns, refused, _)| turns + refused == FLOOD as u64)
    })
    .await;
    let (admitted, refused, records) = quota_of().unwrap();
    let allowed = BURST + RATE * (started.elapsed().as_secs() + 1);
    assert!(
        admitted <= allowed,
        "{admitted} of agent-1's events admitted, the quota allows {allowed}"
    );
    assert!(refused >= FLOOD as u64 - allowed, "{refused} refused");
    // A record per episode, not per event: an episode ends only when the
    // rate admits one again.
    assert!(
        records >= 1 && records <= admitted - BURST + 1,
        "{records} records for {refused} refusals"
    );
    // The agent sees it in its own status.
    let status = a.ask(&api("status", A), json!({ "conversation": A })).await;
    assert_eq!(status["over_quota"], refused, "{status}");
    acme.service.shutdown().await;
}

/// Finding 4 of issue 23, in the documented tenants deployment: a
/// `compaction_requested` an agent publishes with 900 KB of instructions
/// (once sent to the model as the operator's words) is refused at intake
/// with a reason the agent can read, and issues no job; instructions
/// within the API's 4,000 characters are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instructions_over_the_apis_limit_are_refused_on_the_event_path() {
    use contextfold::core::event::CompactionRequested;
    let acme = Acme::start(policy()).await;
    let service = &acme.service;
    let a = acme.agent("ACME_AGENT_1", "_INBOX.agent-1").await;
    let mut decisions = a.client.subscribe("cf.svc.agent-1").await.unwrap();
    for e in &support::turns::turns(A, 0..12, 40) {
        a.store("cf.in.agent-1", e).await;
    }
    let request = |id: &str, instructions: String| {
        Envelope::new(
            id,
            A,
            1_700_000_100_000,
            EventBody::CompactionRequested(CompactionRequested {
                instructions: Some(instructions),
                ..Default::default()
            }),
        )
    };
    let huge = request("huge-request", "Keep every detail. ".repeat(50_000));
    assert!(huge.to_json().len() > 900 * 1024);
    a.store("cf.in.agent-1", &huge).await;
    let rejected = wait_event(
        &mut decisions,
        "event_rejected",
        |e| matches!(&e.body, EventBody::EventRejected(r) if r.rejected_id == "huge-request"),
    )
    .await;
    let EventBody::EventRejected(r) = rejected.body else {
        unreachable!()
    };
    assert!(
        r.reason.contains("instructions") && r.reason.contains("4000"),
        "{}",
        r.reason
    );
    let pending = with_folded(service, A, |conv, _| conv.pending_job.is_some());
    assert_eq!(pending, Some(false), "the refused request issued a job");
    // Within the limit: taken, the instructions carried by its debt.
    let fine = request("fine-request", "Keep the file names exact.".into());
    a.store("cf.in.agent-1", &fine).await;
    wait_event(&mut decisions, "debt_recorded", |e| {
        e.to_json()
            .contains("\"instructions\":\"Keep the file names exact.\"")
    })
    .await;
    acme.service.shutdown().await;
}

/// Finding 2 of issue 23, in the documented tenants deployment: agent-1
/// publishes, on its own subject and within its permissions, a record
/// under every id agent-2's events could be deduplicated by (the bare
/// event id, as ids were, and the unkeyed scoped id anyone can compute).
/// agent-2's `contextfold publish`, connecting with its own NKey, then
/// stores every one of its events, and the service folds them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_agents_event_ids_cannot_be_squatted_in_the_tenants_deployment() {
    use contextfold::core::event::Origin;
    let acme = Acme::start(policy()).await;
    let (service, url, dir) = (&acme.service, acme.server.url(), &acme.dir);
    let a = acme.agent("ACME_AGENT_1", "_INBOX.agent-1").await;
    let victims = support::turns::turns(B, 0..10, 8);
    for (n, e) in victims.iter().enumerate() {
        for id in [
            e.id.clone(),
            contextfold::nats::msg_id::of(Origin::Agent, None, B, &e.id),
        ] {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", id.as_str());
            let decoy = &support::turns::turns(A, n..n + 1, 3)[0];
            a.client
                .publish_with_headers("cf.in.agent-1", headers, decoy.to_json().into())
                .await
                .unwrap();
        }
    }
    a.client.flush().await.unwrap();
    assert!(a.refusals.lock().unwrap().is_empty(), "{:?}", a.refusals);
    wait_until("agent-1's decoys folded", Duration::from_secs(20), || {
        folded(service, A).map(|c| c.0) == Some(10)
    })
    .await;

    let seed_file = dir.path().join("agent-2.nk");
    std::fs::write(&seed_file, acme.users.seed("ACME_AGENT_2")).unwrap();
    let file = dir.path().join("events.jsonl");
    let lines: Vec<String> = victims.iter().map(|e| e.to_json()).collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let out = tokio::process::Command::from({
        let mut c = support::cli::command(
            &dir.path().join("client"),
            &["publish", "--nats", &url, file.to_str().unwrap()],
        );
        c.env("CONTEXTFOLD_NATS__CONNECTION__NKEY_SEED_FILE", &seed_file)
            .env(
                "CONTEXTFOLD_NATS__CONNECTION__INBOX_PREFIX",
                "_INBOX.agent-2",
            );
        c
    })
    .output()
    .await
    .unwrap();
    let (ok, _, err) = support::cli::split(out);
    assert!(ok, "{err}");
    assert!(err.contains("(10 new, 0 duplicates"), "{err}");
    wait_until("agent-2's 10 turns folded", Duration::from_secs(20), || {
        folded(service, B).map(|c| c.0) == Some(10)
    })
    .await;
    acme.service.shutdown().await;
}
