//! `contextfold serve` in-process against a test nats-server: its
//! configuration for tests, starting it alone, reading what it folded, and
//! publishing as an agent would.

use super::nats_server::NatsServer;
use super::replay::replay_partition;
use async_nats::jetstream;
use base64::Engine as _;
use contextfold::core::event::Envelope;
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::Conversation;
use contextfold::log::EventLog;
use contextfold::nats::config::StorageKind;
use contextfold::nats::event_log::NatsEventLog;
use contextfold::nats::serve::{Roles, ServeOptions, Service};
use contextfold::nats::setup::{ensure, Infrastructure};
use contextfold::nats::subjects;
use contextfold::nats::{NatsConfig, NatsOptions};
use contextfold::summarizer::{DeterministicSummarizer, Summarizer};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub fn nats_config(url: &str) -> NatsConfig {
    NatsConfig {
        connection: NatsOptions::with_servers([url]),
        lease_ttl_ms: 2_000,
        lease_renew_ms: 250,
        lease_margin_ms: 700,
        job_ack_wait_ms: 1_000,
        storage: StorageKind::Memory,
        ..NatsConfig::default()
    }
}

pub fn options(url: &str, data: &Path, policy: &PolicyConfig, name: &str) -> ServeOptions {
    let mut o = ServeOptions::new(nats_config(url), data);
    o.policy = policy.clone();
    o.member_name = Some(name.to_string());
    o.roles = "folder,summarizer".parse::<Roles>().unwrap();
    o.summarizer.poll = Duration::from_millis(200);
    o
}

pub async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts a serve process alone on the server and waits until it holds
/// every partition.
pub async fn start_alone(opts: ServeOptions) -> Service {
    start_alone_with(opts, DeterministicSummarizer).await
}

/// [`start_alone`] with `summarizer`.
pub async fn start_alone_with<S: Summarizer + 'static>(
    opts: ServeOptions,
    summarizer: S,
) -> Service {
    let service = Service::start(opts, Arc::new(summarizer))
        .await
        .expect("serve starts");
    wait_until("all partitions held", Duration::from_secs(10), || {
        held(&service).len() == 16
    })
    .await;
    service
}

pub fn held(s: &Service) -> BTreeSet<u32> {
    s.engines()
        .map(|e| e.partitions().into_iter().collect())
        .unwrap_or_default()
}

/// `key` as the engine of its partition holds it: resident, or only in
/// its store (a new lease tenure opens the store with nothing resident).
/// `None` while the partition is not held here or the conversation is
/// unknown.
pub fn conversation_of(s: &Service, key: &str) -> Option<Conversation> {
    let engine = s.engines()?.get(partition_of(key))?;
    let e = engine.lock().unwrap();
    e.with_conversation(key, |state, _| state.conversations.get(key).cloned())
        .unwrap()
}

/// Conversation -> (turns, summaries, state hash) over the partitions held.
pub fn conversations(s: &Service) -> BTreeMap<String, (usize, usize, String)> {
    let mut out = BTreeMap::new();
    let Some(engines) = s.engines() else {
        return out;
    };
    for p in engines.partitions() {
        if let Some(engine) = engines.get(p) {
            let e = engine.lock().unwrap();
            // Resident or not: a new tenure has nothing resident.
            e.each_conversation(|_, conv| {
                out.insert(
                    conv.key.clone(),
                    (
                        conv.turns.len(),
                        conv.summaries.len(),
                        conv.hash_with(&e.bodies()).unwrap(),
                    ),
                );
                Ok::<(), contextfold::store::StoreError>(())
            })
            .unwrap();
        }
    }
    out
}

/// The subject token as a client in any language computes it (see
/// docs/subjects.md): plain when safe, else `~` + unpadded base64url.
pub fn token(key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if plain {
        key.to_string()
    } else {
        format!(
            "~{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key)
        )
    }
}

/// As an agent would: a plain NATS publish of the JSON bytes with
/// hand-written headers.
pub async fn raw_publish(client: &async_nats::Client, events: &[Envelope]) {
    for e in events {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", e.id.as_str());
        headers.insert("Content-Type", "application/json");
        client
            .publish_with_headers(
                format!("cf.in.{}", token(&e.conversation)),
                headers,
                e.to_json().into(),
            )
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
}

pub async fn client_for(url: &str) -> (async_nats::Client, jetstream::Context, Infrastructure) {
    client_for_config(&nats_config(url)).await
}

/// A client, with the infrastructure set up (or validated) as `cfg` says:
/// the same settings as the service's, or setup would change them.
pub async fn client_for_config(
    cfg: &NatsConfig,
) -> (async_nats::Client, jetstream::Context, Infrastructure) {
    let (client, _) = cfg.connection.connect().await.expect("connect");
    let js = jetstream::new(client.clone());
    let infra = ensure(&js, cfg).await.expect("setup");
    (client, js, infra)
}

pub async fn partition_events(
    js: &jetstream::Context,
    infra: &Infrastructure,
    p: u32,
) -> Vec<(u64, Envelope)> {
    let mut log = NatsEventLog::open_partition(js.clone(), infra.subjects.clone(), p)
        .await
        .unwrap();
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let records = log.read_after(after, 1000).await.unwrap();
        let Some(last) = records.last() else {
            return out;
        };
        after = last.position;
        for r in &records {
            if let Ok(e) = Envelope::decode(&r.bytes, r.encoding) {
                out.push((r.position, e));
            }
        }
    }
}

/// Waits until `service` folded each partition to the stream's end with
/// the state a clean replay gives.
pub async fn assert_matches_replay(
    service: &Service,
    js: &jetstream::Context,
    infra: &Infrastructure,
    partitions: &BTreeSet<u32>,
    policy: &PolicyConfig,
) {
    let engines = service.engines().unwrap();
    for &p in partitions {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let replayed = replay_partition(js, infra, p, policy).await;
            let live = engines.get(p).map(|e| {
                let e = e.lock().unwrap();
                (e.position(), e.state_hash().unwrap())
            });
            if live.as_ref() == Some(&replayed) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "partition {p}: live {live:?} vs replay {replayed:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

pub fn partition_of(key: &str) -> u32 {
    subjects::partition_of(key, 16).unwrap()
}

/// Starts `contextfold serve` on `server` with its data and log
/// (`serve.log`) under `dir`, the caller's summarizer settings removed and
/// `env` set, and returns it with a client once the API answers (serve has
/// set up the streams by then: publish after).
pub async fn spawn_serve(
    server: &NatsServer,
    dir: &Path,
    env: &[(&str, &str)],
) -> (tokio::process::Child, async_nats::Client) {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    spawn_serve_at(&server.url(), dir, &env).await
}

/// [`spawn_serve`] on the server (or cluster: comma-separated URLs) at
/// `url`.
pub async fn spawn_serve_at(
    url: &str,
    dir: &Path,
    env: &[(String, String)],
) -> (tokio::process::Child, async_nats::Client) {
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("serve.log"))
        .unwrap();
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_contextfold"));
    command
        .arg("--data")
        .arg(dir.join("serve"))
        .args(["serve", "--nats", url])
        .env_remove("CONTEXTFOLD_CONFIG")
        .env_remove("CONTEXTFOLD_SUMMARIZER__BASE_URL")
        .env("OPENAI_API_KEY", "test-key-not-secret")
        .stderr(stderr)
        .kill_on_drop(true);
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().expect("contextfold serve starts");
    let servers: Vec<async_nats::ServerAddr> = url
        .split(',')
        .map(|u| u.parse().expect("a server URL"))
        .collect();
    let client = async_nats::connect(servers).await.unwrap();
    let up = Instant::now() + Duration::from_secs(30);
    while client
        .request("cf.admin.status", "{}".into())
        .await
        .is_err()
    {
        assert!(Instant::now() < up, "serve did not come up");
        assert!(child.try_wait().unwrap().is_none(), "serve exited");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (child, client)
}
