//! Job snapshots in the object store do not pile up (issue 23, finding 5,
//! the object-store part): a job's snapshot is deleted when the job ends,
//! acknowledged or dead-lettered, and the bucket has a `max_age`
//! (`payload_max_age_ms`, documented default one day), set on a new bucket
//! and applied to one made before, which `doctor` checks.
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use async_nats::jetstream::{self, object_store};
use contextfold::core::event::{Envelope, EventBody};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::summary::{RollingStateRequest, SummaryRequest};
use contextfold::nats::jobs::snapshot_object_name;
use contextfold::nats::serve::{Roles, Service};
use contextfold::nats::setup::ensure;
use contextfold::summarizer::{
    Budget, DeterministicSummarizer, RollingOutcome, SummarizeError, Summarizer, SummaryOutcome,
};
use contextfold::testing::small_policy;
use futures::{StreamExt, TryStreamExt};
use std::path::Path;
use std::time::{Duration, Instant};
use support::nats_server::NatsServer;
use support::serve::*;
use support::turns::turns;

/// The documented default of `payload_max_age_ms`: one day.
const DEFAULT_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// A summarizer whose provider always says "later": every job is deferred
/// until it is dead-lettered.
struct AlwaysLater;

fn later() -> SummarizeError {
    SummarizeError::RateLimited {
        provider: "p".into(),
        retry_after_ms: 100,
        calls: Vec::new(),
    }
}

impl Summarizer for AlwaysLater {
    async fn summarize(
        &self,
        _: &SummaryRequest,
        _: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        Err(later())
    }
    async fn rolling_state(
        &self,
        _: &RollingStateRequest,
        _: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        Err(later())
    }
    fn name(&self) -> &str {
        "always-later"
    }
}

fn policy() -> PolicyConfig {
    // Nothing compacts unless asked; a compaction takes a few turns.
    PolicyConfig {
        default_context_window: 128_000,
        fresh_tail_count: 2,
        ..small_policy()
    }
}

/// Serve (every role) whose every job snapshot goes to the object store.
async fn serve<S: Summarizer + 'static>(url: &str, data: &Path, summarizer: S) -> Service {
    let mut opts = options(url, data, &policy(), "snapshots");
    opts.roles = "all".parse::<Roles>().unwrap();
    opts.nats.max_inline_payload_bytes = 256;
    opts.nats.job_max_deliver = 2;
    opts.folder.max_inline_job_bytes = 256;
    opts.summarizer =
        contextfold::nats::summarizer_role::SummarizerSettings::from_config(&opts.nats);
    opts.summarizer.poll = Duration::from_millis(100);
    start_alone_with(opts, summarizer).await
}

/// Asks `conv` to compact and returns the `sweep_ended` that ends its job.
async fn compact_and_wait(client: &async_nats::Client, conv: &str) -> Envelope {
    let mut decisions = client.subscribe(format!("cf.svc.{conv}")).await.unwrap();
    client.flush().await.unwrap();
    raw_publish(client, &turns(conv, 0..10, 60)).await;
    let body =
        serde_json::json!({ "conversation": conv, "request_id": "r-1", "target_tokens": 50 });
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = client
            .request(format!("cf.api.compact.{conv}"), body.to_string().into())
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
        if v["published"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "compact was not stored: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let message = tokio::time::timeout(left, decisions.next())
            .await
            .expect("a sweep_ended within 30 s")
            .unwrap();
        let e = Envelope::decode(
            &message.payload,
            contextfold::core::event::Encoding::from_header(
                message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Content-Type"))
                    .map(|v| v.as_str()),
            ),
        )
        .unwrap();
        if matches!(e.body, EventBody::SweepEnded(_)) {
            return e;
        }
    }
}

/// Chunks the object store still holds, and whether `job_id`'s snapshot
/// is there (`Some(false)`: there and deleted; `None`: never stored).
async fn left_behind(js: &jetstream::Context, job_id: &str) -> (u64, Option<bool>) {
    let stream = js.get_stream("OBJ_cf_payloads").await.unwrap();
    let chunks: Vec<(String, usize)> = stream
        .info_with_subjects("$O.cf_payloads.C.>")
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let store = js.get_object_store("cf_payloads").await.unwrap();
    let live = store
        .info(snapshot_object_name(job_id))
        .await
        .ok()
        .map(|i| !i.deleted);
    (chunks.iter().map(|(_, n)| *n as u64).sum(), live)
}

async fn wait_deleted(js: &jetstream::Context, job_id: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (chunks, live) = left_behind(js, job_id).await;
        assert!(
            live.is_some(),
            "{what}: the snapshot never went through the object store"
        );
        if chunks == 0 && live == Some(false) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the snapshot of {job_id} is still there ({chunks} chunk(s), live {live:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_jobs_snapshot_is_deleted() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let service = serve(&server.url(), dir.path(), DeterministicSummarizer).await;
    let (client, js, _infra) = client_for(&server.url()).await;
    let ended = compact_and_wait(&client, "snap-done").await;
    let EventBody::SweepEnded(ended) = ended.body else {
        unreachable!()
    };
    assert!(ended.committed > 0, "{ended:?}");
    wait_deleted(&js, &ended.job_id, "after its job was acknowledged").await;
    service.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lettered_jobs_snapshot_is_deleted() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let service = serve(&server.url(), dir.path(), AlwaysLater).await;
    let (client, js, _infra) = client_for(&server.url()).await;
    let ended = compact_and_wait(&client, "snap-dead").await;
    let EventBody::SweepEnded(ended) = ended.body else {
        unreachable!()
    };
    assert!(
        ended
            .detail
            .as_deref()
            .unwrap_or_default()
            .contains("dead-lettered"),
        "{ended:?}"
    );
    wait_deleted(&js, &ended.job_id, "after its job was dead-lettered").await;
    service.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_bucket_expires_what_is_left_and_an_older_bucket_gets_the_age() {
    let server = NatsServer::start();
    let (client, _) = nats_config(&server.url())
        .connection
        .connect()
        .await
        .unwrap();
    let js = jetstream::new(client);
    // A bucket made as before: no max_age.
    js.create_object_store(object_store::Config {
        bucket: "cf_payloads".into(),
        storage: jetstream::stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();
    let max_age = |js: jetstream::Context| async move {
        js.get_stream("OBJ_cf_payloads")
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .config
            .max_age
    };
    assert_eq!(max_age(js.clone()).await, Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let doctor = |dir: std::path::PathBuf, url: String| async move {
        let config = dir.join("doctor.toml");
        std::fs::write(&config, "[nats]\nstorage = \"memory\"\n").unwrap();
        let out = tokio::task::spawn_blocking(move || {
            support::cli::command(
                &dir,
                &[
                    "--config",
                    config.to_str().unwrap(),
                    "doctor",
                    "--nats",
                    &url,
                ],
            )
            .output()
            .unwrap()
        })
        .await
        .unwrap();
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        out.lines()
            .find(|l| l.contains(" object store cf_payloads"))
            .unwrap_or_else(|| panic!("doctor checks no object store:\n{out}"))
            .to_string()
    };
    let line = doctor(dir.path().to_path_buf(), server.url()).await;
    assert!(
        line.starts_with("warn ") && line.contains("max_age"),
        "{line}"
    );
    // Setup applies the documented default to it, and doctor is content.
    ensure(&js, &nats_config(&server.url())).await.unwrap();
    assert_eq!(max_age(js.clone()).await, DEFAULT_MAX_AGE);
    let line = doctor(dir.path().to_path_buf(), server.url()).await;
    assert!(line.starts_with("ok "), "{line}");

    // A new bucket has it from the start.
    let other = NatsServer::start();
    let (client, js, _infra) = client_for(&other.url()).await;
    drop(client);
    assert_eq!(max_age(js).await, DEFAULT_MAX_AGE);
}
