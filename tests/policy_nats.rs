//! The policy in the log over NATS: a folder taking partitions with a
//! policy the log does not say records it once in each partition, in the
//! partition's own part of the stream; a process folding the same stream
//! under yet another policy is reported, naming both fingerprints.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::{is_partition_key, EventBody};
use contextfold::core::policy::PolicyConfig;
use contextfold::nats::serve::Service;
use contextfold::runtime::engine::policy_fingerprint;
use contextfold::summarizer::DeterministicSummarizer;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

mod support;
use support::nats_server::NatsServer;
use support::serve::{
    client_for, options, partition_events, partition_of, raw_publish, start_alone, wait_until,
};
use support::turns::turns;

/// Every warning the process logs, from any thread.
fn warnings() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = Arc::clone(&buf);
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || Captured(Arc::clone(&writer)))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one subscriber");
        buf
    })
    .clone()
}

struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logged() -> String {
    String::from_utf8_lossy(&warnings().lock().unwrap()).into_owned()
}

/// The fingerprints recorded in partition `p`, in order.
async fn recorded(
    js: &async_nats::jetstream::Context,
    infra: &contextfold::nats::setup::Infrastructure,
    p: u32,
) -> Vec<String> {
    partition_events(js, infra, p)
        .await
        .into_iter()
        .filter_map(|(_, e)| match e.body {
            EventBody::PolicyRecorded(r) => {
                assert!(is_partition_key(&e.conversation), "{}", e.conversation);
                assert_eq!(partition_of(&e.conversation), p, "{}", e.conversation);
                Some(r.fingerprint)
            }
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_records_another_policy_once_and_a_third_one_beside_it_is_reported() {
    let logs = warnings();
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let a = PolicyConfig::default();
    let b = PolicyConfig {
        default_context_window: 64_000,
        ..PolicyConfig::default()
    };
    let c = PolicyConfig {
        fresh_tail_count: 12,
        ..PolicyConfig::default()
    };
    let (fa, fb, fc) = (
        policy_fingerprint(&a),
        policy_fingerprint(&b),
        policy_fingerprint(&c),
    );
    let (client, js, infra) = client_for(&server.url()).await;

    let first = start_alone(options(&server.url(), &dir.path().join("a"), &a, "pol-a")).await;
    raw_publish(&client, &turns("conv-1", 0..6, 20)).await;
    let p1 = partition_of("conv-1");
    for p in 0..16 {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while recorded(&js, &infra, p).await != [fa.clone()] {
            assert!(
                std::time::Instant::now() < deadline,
                "partition {p}: {:?}\n{}",
                partition_events(&js, &infra, p).await,
                logged()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    first.shutdown().await;

    // Another process, another policy: one more policy event a partition,
    // after the history it folded under the first.
    let second = start_alone(options(&server.url(), &dir.path().join("b"), &b, "pol-b")).await;
    for p in 0..16 {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while recorded(&js, &infra, p).await != [fa.clone(), fb.clone()] {
            assert!(
                std::time::Instant::now() < deadline,
                "partition {p}: {:?}",
                recorded(&js, &infra, p).await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let events = partition_events(&js, &infra, p1).await;
    let turn_at = events
        .iter()
        .filter(|(_, e)| e.conversation == "conv-1")
        .map(|(at, _)| *at)
        .max()
        .unwrap();
    let b_at = events
        .iter()
        .find(|(_, e)| matches!(&e.body, EventBody::PolicyRecorded(r) if r.fingerprint == fb))
        .map(|(at, _)| *at)
        .unwrap();
    assert!(b_at > turn_at, "recorded after the history it folded");
    assert!(!logged().contains("different policies"), "{}", logged());

    // A third process with a third policy on the same stream: reported by
    // both, with both fingerprints.
    let third = Service::start(
        options(&server.url(), &dir.path().join("c"), &c, "pol-c"),
        Arc::new(DeterministicSummarizer),
    )
    .await
    .expect("serve c starts");
    wait_until("the conflict reported", Duration::from_secs(20), || {
        let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
        text.lines()
            .any(|l| l.contains("different policies") && l.contains(&fb) && l.contains(&fc))
    })
    .await;
    third.shutdown().await;
    second.shutdown().await;
}
