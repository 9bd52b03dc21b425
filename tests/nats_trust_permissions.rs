//! The documented service permissions are enough for the documented
//! features (issue 23, finding 7): a nats-server runs
//! `docs/examples/nats-tenants.conf` or `nats-shared-service.conf` exactly
//! as shipped (only the NKey variables are defined ahead of it, as its
//! header says), `contextfold serve` runs as the binary under the tenant's
//! service user with `--http --audit-page`, and an agent publishes turns
//! under its own user (through the imports, in the shared service).
//! Then, as the service user:
//!
//! - `/metrics` answers at once with the partitions' consumer lag and the
//!   job queue (a refused consumer-info call used to hold it 10 s and leave
//!   the gauges empty);
//! - the audit page's API lists the conversation with its status, and
//!   answers its audit, what the model saw at an event and a describe;
//! - `contextfold doctor` passes every check;
//! - and the server logged no permission violation by the service user.
//!
//! Needs the pinned nats-server: run `scripts/install-nats.sh` first.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use async_nats::jetstream;
use async_nats::ConnectOptions;
use contextfold::core::event::Encoding;
use contextfold::nats::event_log::event_headers;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use support::cli::command;
use support::nats_server::free_port;
use support::tenants::{
    violations_by, Users, SHARED_CONF, SHARED_USERS, TENANTS_CONF, TENANTS_USERS,
};
use support::turns::turns;

const CONV: &str = "agent-1";

/// One documented deployment and the users the test acts as.
struct Deployment {
    example: &'static str,
    users: &'static [&'static str],
    /// The tenant's service user, its `[nats] prefix` and inbox prefix.
    service: &'static str,
    prefix: &'static str,
    inbox: &'static str,
    agent: &'static str,
}

/// The environment of every command run as the tenant's service user.
fn as_service<'a>(
    cmd: &'a mut std::process::Command,
    d: &Deployment,
    seed: &Path,
) -> &'a mut std::process::Command {
    cmd.env_remove("CONTEXTFOLD_SUMMARIZER__BASE_URL")
        .env("CONTEXTFOLD_NATS__CONNECTION__NKEY_SEED_FILE", seed)
        .env("CONTEXTFOLD_NATS__CONNECTION__INBOX_PREFIX", d.inbox)
        .env("CONTEXTFOLD_NATS__PREFIX", d.prefix)
        .env("CONTEXTFOLD_NATS__STORAGE", "memory")
        // Every job snapshot through the object store.
        .env("CONTEXTFOLD_NATS__MAX_INLINE_PAYLOAD_BYTES", "256")
}

/// (status, body, time taken); status 0 when nothing came within 15 s.
async fn http_get(url: &str) -> (u16, String, Duration) {
    let started = Instant::now();
    let resp = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(15))
        .send()
        .await;
    match resp {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let body = resp.text().await.unwrap_or_default();
            (status, body, started.elapsed())
        }
        Err(e) => (0, e.to_string(), started.elapsed()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_the_audit_page_and_doctor_work_under_the_tenants_example() {
    check(Deployment {
        example: TENANTS_CONF,
        users: &TENANTS_USERS,
        service: "ACME_SERVICE",
        prefix: "cf",
        inbox: "_INBOX.cf-service",
        agent: "ACME_AGENT_1",
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_the_audit_page_and_doctor_work_under_the_shared_service_example() {
    check(Deployment {
        example: SHARED_CONF,
        users: &SHARED_USERS,
        service: "CF_ACME_SERVICE",
        prefix: "acme.cf",
        inbox: "_INBOX.acme-cf",
        agent: "ACME_AGENT_1",
    })
    .await;
}

async fn check(d: Deployment) {
    let users = Users::generate(d.users);
    let server = users.server(d.example);
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let seed = dir.path().join("service.nk");
    std::fs::write(&seed, users.seed(d.service)).unwrap();
    let data = dir.path().join("serve");
    let port = free_port();
    let log = std::fs::File::create(dir.path().join("serve.log")).unwrap();
    let mut serve = tokio::process::Command::from({
        let mut c = command(
            &data,
            &[
                "serve",
                "--nats",
                &url,
                "--http",
                &format!("127.0.0.1:{port}"),
                "--audit-page",
            ],
        );
        as_service(&mut c, &d, &seed);
        c.stdout(Stdio::null()).stderr(log);
        c
    });
    serve.kill_on_drop(true);
    let _serve = serve.spawn().unwrap();

    // The agent stores turns under its own user and reads its status.
    let agent = ConnectOptions::with_nkey(users.seed(d.agent))
        .custom_inbox_prefix("_INBOX.agent-1")
        .connect(&url)
        .await
        .unwrap();
    let up = Instant::now() + Duration::from_secs(30);
    let js = jetstream::new(agent.clone());
    loop {
        // The stream exists once serve set it up.
        let e = &turns(CONV, 0..1, 40)[0];
        let stored = js
            .publish_with_headers(
                format!("cf.in.{CONV}"),
                event_headers(&e.id, Encoding::Json),
                e.to_json().into(),
            )
            .await
            .unwrap()
            .await;
        if stored.is_ok() {
            break;
        }
        assert!(Instant::now() < up, "serve did not set up the streams");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for e in turns(CONV, 1..8, 40) {
        js.publish_with_headers(
            format!("cf.in.{CONV}"),
            event_headers(&e.id, Encoding::Json),
            e.to_json().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let body = serde_json::json!({ "conversation": CONV }).to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(reply) = agent
            .request(format!("cf.api.status.{CONV}"), body.clone().into())
            .await
        {
            let status: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
            if status["turns"]["total"] == 8 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the turns were not folded");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let mut broken = Vec::new();
    let base = format!("http://127.0.0.1:{port}");
    let (status, metrics, took) = http_get(&format!("{base}/metrics")).await;
    if status != 200 || took > Duration::from_secs(2) {
        broken.push(format!("/metrics: {status} after {took:?}"));
    }
    for family in [
        "contextfold_consumer_pending_messages{partition=",
        "contextfold_jobs_queued ",
    ] {
        if !metrics.contains(family) {
            broken.push(format!("/metrics has no {family}"));
        }
    }
    let (status, listed, _) = http_get(&format!("{base}/api/conversations")).await;
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap_or_default();
    let entry = listed
        .as_array()
        .and_then(|a| a.iter().find(|c| c["conversation"] == CONV));
    match entry {
        Some(e) if status == 200 && e.get("error").is_none() && e["turns"]["total"] == 8 => {}
        other => broken.push(format!("/api/conversations: {status} {other:?}")),
    }
    let at = format!("{CONV}%235");
    for (path, expected) in [
        (format!("/api/audit?c={CONV}"), "\"turns\":8"),
        (format!("/api/context?c={CONV}&at={at}"), "turn 5"),
        (format!("/api/describe?c={CONV}&id={at}"), "turn 5"),
    ] {
        let (status, body, _) = http_get(&format!("{base}{path}")).await;
        if status != 200 || !body.contains(expected) {
            broken.push(format!("{path}: {status} {}", &body[..body.len().min(200)]));
        }
    }
    let doctor = {
        let mut c = command(&data, &["doctor", "--nats", &url]);
        as_service(&mut c, &d, &seed);
        tokio::task::spawn_blocking(move || c.output().unwrap())
            .await
            .unwrap()
    };
    let report = String::from_utf8_lossy(&doctor.stdout).into_owned();
    for line in report.lines().filter(|l| !l.starts_with("ok ")) {
        broken.push(format!("doctor: {line}"));
    }
    if !doctor.status.success() {
        broken.push(format!(
            "doctor exited {:?}: {}",
            doctor.status.code(),
            String::from_utf8_lossy(&doctor.stderr)
        ));
    }
    let refused = violations_by(&server, &users.public(d.service));
    broken.extend(refused.iter().map(|l| format!("server: {l}")));
    assert!(
        broken.is_empty(),
        "under the documented service permissions:\n  {}\nserve's log:\n{}",
        broken.join("\n  "),
        std::fs::read_to_string(dir.path().join("serve.log")).unwrap_or_default()
    );
}
