//! One agent floods, another works: what the flood costs the other agent
//! and the service (issue 23, finding 5). Runs a `contextfold serve`
//! binary (default `target/release/contextfold`, or `CONTEXTFOLD_FLOOD_BIN`,
//! so an older build can be measured the same way) against a nats-server
//! the bench starts, then:
//!
//! - agent A publishes 100-byte turns on its one conversation as fast as
//!   core NATS takes them, for `CONTEXTFOLD_FLOOD_SECS` (default 5);
//! - agent B, on a conversation of another partition, publishes one turn
//!   every 100 ms from the flood's start until `CONTEXTFOLD_FLOOD_OBSERVE_SECS`
//!   (default 20) after its end, and after each asks `status` until its
//!   turn is folded (fold latency) and then `assemble` (answer latency);
//! - serve's resident memory is sampled every 100 ms (Linux `/proc`).
//!
//! Prints A's events sent and what serve made of them, B's latencies
//! (p50, p99, max) during and after the flood, and serve's RSS before,
//! peak and at the end.
//!
//! ```text
//! cargo build --release && cargo bench --bench flood
//! CONTEXTFOLD_FLOOD_BIN=/path/to/old/contextfold cargo bench --bench flood
//! ```

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
#[path = "../tests/support/nats_server.rs"]
mod nats_server;

use contextfold::api::Op;
use contextfold::core::event::{Envelope, EventBody, TurnAppended};
use contextfold::core::message::{ChatMessage, Role};
use contextfold::nats::subjects::{partition_of, Subjects};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

fn turn(conv: &str, n: u64, text: String) -> Envelope {
    Envelope::new(
        format!("{conv}#{n}"),
        conv,
        // Now (an older build refuses times far ahead of the clock).
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(Role::User, text))),
    )
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn line(label: &str, mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    format!(
        "{label:<34} n={:<4} p50 {:>8.1} ms  p99 {:>8.1} ms  max {:>8.1} ms",
        v.len(),
        pct(&v, 0.5),
        pct(&v, 0.99),
        v.last().copied().unwrap_or(f64::NAN)
    )
}

struct Serve(Child);
impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Some(bin) = std::env::var("CONTEXTFOLD_FLOOD_BIN")
        .ok()
        .or_else(|| Some("target/release/contextfold".into()))
        .filter(|b| std::path::Path::new(b).is_file())
    else {
        println!(
            "flood: no binary (build with `cargo build --release` or set CONTEXTFOLD_FLOOD_BIN)"
        );
        return;
    };
    let Ok(_) = nats_server::find_binary() else {
        println!("flood: no nats-server (scripts/install-nats.sh); skipped");
        return;
    };
    let flood_secs = env_u64("CONTEXTFOLD_FLOOD_SECS", 5);
    let observe_secs = env_u64("CONTEXTFOLD_FLOOD_OBSERVE_SECS", 20);
    let server = nats_server::NatsServer::start();
    let url = server.url();
    let data = tempfile::tempdir().unwrap();
    // The bench's own knobs are not serve's configuration (an older build
    // refuses every CONTEXTFOLD_* variable it does not know).
    let mut command = Command::new(&bin);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("CONTEXTFOLD_") {
            command.env_remove(key);
        }
    }
    let serve = Serve(
        command
            .args(["serve", "--nats", &url, "--data"])
            .arg(data.path())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            // CONTEXTFOLD_FLOOD_SERVE_LOG=FILE keeps what serve said.
            .stderr(
                std::env::var_os("CONTEXTFOLD_FLOOD_SERVE_LOG")
                    .and_then(|p| std::fs::File::create(p).ok())
                    .map_or_else(Stdio::null, Stdio::from),
            )
            .spawn()
            .expect("serve starts"),
    );
    let pid = serve.0.id();
    let client = async_nats::connect(&url).await.unwrap();
    let subjects = Subjects::new("cf").unwrap();
    let a = "flood-a";
    let b = (0..)
        .map(|i| format!("worker-b{i}"))
        .find(|k| partition_of(k, 16).unwrap() != partition_of(a, 16).unwrap())
        .unwrap();
    // Serve is up when B's first turn is folded (published again, the
    // same id, until the stream serve creates has stored it).
    let first = turn(&b, 0, "hello: the first turn".into());
    let started = Instant::now();
    let mut last_publish: Option<Instant> = None;
    while folded_turns(&client, &subjects, &b).await < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "serve never folded a turn"
        );
        if last_publish.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            publish(&client, &subjects, &first).await;
            last_publish = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss_before = rss_mib(pid);

    let flooding = Arc::new(AtomicBool::new(true));
    let sent = Arc::new(AtomicU64::new(0));
    let flood = {
        let (client, subjects, flooding, sent) = (
            client.clone(),
            subjects.clone(),
            flooding.clone(),
            sent.clone(),
        );
        tokio::spawn(async move {
            let subject = subjects.inbound(a).unwrap();
            let mut n = 0u64;
            while flooding.load(Ordering::Relaxed) {
                for _ in 0..256 {
                    n += 1;
                    let e = turn(a, n, format!("flood {n:>10} {}", "x".repeat(70)));
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Nats-Msg-Id", format!("flood-{n}").as_str());
                    let _ = client
                        .publish_with_headers(subject.clone(), headers, e.to_json().into())
                        .await;
                }
                sent.store(n, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
            let _ = client.flush().await;
        })
    };
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut peak = 0f64;
            while sampling.load(Ordering::Relaxed) {
                peak = peak.max(rss_mib(pid));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            peak
        })
    };
    let t0 = Instant::now();
    let (mut fold_during, mut fold_after, mut asm_during, mut asm_after) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut unfolded = 0u64;
    let mut k = 1u64;
    while t0.elapsed() < Duration::from_secs(flood_secs + observe_secs) {
        if flooding.load(Ordering::Relaxed) && t0.elapsed() >= Duration::from_secs(flood_secs) {
            flooding.store(false, Ordering::Relaxed);
        }
        let during = flooding.load(Ordering::Relaxed);
        let tick = Instant::now();
        publish(
            &client,
            &subjects,
            &turn(&b, k, format!("turn {k} of agent b")),
        )
        .await;
        k += 1;
        let wait = Instant::now();
        let mut folded = false;
        while wait.elapsed() < Duration::from_secs(5) {
            if folded_turns(&client, &subjects, &b).await >= k {
                folded = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let fold_ms = wait.elapsed().as_secs_f64() * 1e3;
        if !folded {
            unfolded += 1;
        }
        let ask = Instant::now();
        let ok = client
            .request(
                subjects.api(Op::Assemble, &b).unwrap(),
                serde_json::json!({ "conversation": b }).to_string().into(),
            )
            .await
            .is_ok_and(|m| !m.payload.starts_with(b"{\"error\""));
        let asm_ms = ask.elapsed().as_secs_f64() * 1e3;
        let (f, s) = if during {
            (&mut fold_during, &mut asm_during)
        } else {
            (&mut fold_after, &mut asm_after)
        };
        if folded {
            f.push(fold_ms);
        }
        if ok {
            s.push(asm_ms);
        }
        let pause = Duration::from_millis(100).saturating_sub(tick.elapsed());
        tokio::time::sleep(pause).await;
    }
    flooding.store(false, Ordering::Relaxed);
    flood.await.unwrap();
    sampling.store(false, Ordering::Relaxed);
    let peak = sampler.await.unwrap();
    let a_folded = folded_turns(&client, &subjects, a).await;
    println!("flood: {bin}");
    println!(
        "agent A: {} turns sent in {flood_secs} s; folded into A's context: {a_folded}",
        sent.load(Ordering::Relaxed)
    );
    println!("{}", line("B publish->folded, during flood", fold_during));
    println!("{}", line("B publish->folded, after flood", fold_after));
    println!("{}", line("B assemble, during flood", asm_during));
    println!("{}", line("B assemble, after flood", asm_after));
    println!("B turns not folded within 5 s: {unfolded}");
    println!(
        "serve RSS: {rss_before:.0} MiB before, {peak:.0} MiB peak, {:.0} MiB {} s after the flood",
        rss_mib(pid),
        observe_secs
    );
    drop(serve);
}

async fn publish(client: &async_nats::Client, subjects: &Subjects, e: &Envelope) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", e.id.as_str());
    client
        .publish_with_headers(
            subjects.inbound(&e.conversation).unwrap(),
            headers,
            e.to_json().into(),
        )
        .await
        .unwrap();
}

/// The conversation's folded turns as `status` says (0 while unknown).
async fn folded_turns(client: &async_nats::Client, subjects: &Subjects, conv: &str) -> u64 {
    let Ok(reply) = client
        .request(
            subjects.api(Op::Status, conv).unwrap(),
            serde_json::json!({ "conversation": conv })
                .to_string()
                .into(),
        )
        .await
    else {
        return 0;
    };
    serde_json::from_slice::<serde_json::Value>(&reply.payload)
        .ok()
        .and_then(|v| v["turns"]["total"].as_u64())
        .unwrap_or(0)
}
