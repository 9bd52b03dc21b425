//! Ingest rate of the folder role against the raw rate of the same
//! JetStream consumers, measured in one run on one nats-server (started by
//! the bench, file storage, like `serve`'s default).
//!
//! Setup: N turn events of about 490 bytes of JSON (default 100,000) over
//! 256 conversations are published to `cf.in.<conv>` with their ids as
//! `Nats-Msg-Id` and stored by the events stream (16 partitions). Then,
//! for each round (default 3):
//!
//! - **raw**: one durable pull consumer per partition, configured as the
//!   folder's (`folder_consumer_config`: filter on the partition, ack-all,
//!   max 8192 unacknowledged), pulling in batches of 1024 (the folder's
//!   batch) and acknowledging each chunk of ready messages with one ack of
//!   its last message, no other work. Timed from creating the consumers
//!   until the server reports every partition's ack floor at its last
//!   message.
//! - **end to end**: the folder role as `serve` runs it (`FolderRole`,
//!   redb state store per partition, every commit durable, default
//!   policy and folder settings) with all 16 partition leases already
//!   held: per partition it recreates its consumer, pulls, folds,
//!   publishes the fold's decisions and waits for the stream's acks,
//!   commits state and position (fsync), and acknowledges the batch.
//!   Timed from starting the role until every partition's engine has
//!   committed its last message and the server reports the ack floor
//!   there. Each round starts from empty state stores.
//!
//! The ratio is end-to-end rate / raw rate of the same round; the goal
//! (issue 26) is a median of at least 0.6 with no round under 0.55.
//! Telemetry runs as under `serve --http` (the Prometheus recorder, logs
//! at warn); built with `--features telemetry-off` it compiles to nothing,
//! and the two builds side by side are its cost.
//!
//! ```text
//! cargo bench --bench nats_ingest
//! CONTEXTFOLD_BENCH_EVENTS=100000  # events published (default 100,000)
//! CONTEXTFOLD_BENCH_ROUNDS=3       # raw / end-to-end pairs (default 3)
//! CONTEXTFOLD_BENCH_BATCH=1024     # folder batch and raw pull batch (default: the folder's)
//! CONTEXTFOLD_BENCH_RAW_BATCH=1024 # raw pull batch alone (default: the folder batch)
//! CONTEXTFOLD_BENCH_FLUSH_EVERY=1  # every N-th state commit durable (default: serve's, 1)
//! CONTEXTFOLD_BENCH_GATHER_MS=50   # folder's wait for a backlog batch to fill (default: the folder's)
//! ```
//!
//! Each phase also reports the CPU time the bench process (client and
//! folder) and the nats-server process used during it (Linux `/proc`), to
//! tell a CPU-bound phase from one waiting on I/O or round trips, and the
//! end-to-end phase the state commits it made (one per folded batch).
//!
//! nats-server is looked up as the integration tests do
//! (`CONTEXTFOLD_NATS_SERVER`, `$CONTEXTFOLD_VENV/bin`, `.venv/bin`);
//! without one the bench says so and exits successfully.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// The integration tests' nats-server harness; not all of it is used here.
#[allow(dead_code)]
#[path = "../tests/support/nats_server.rs"]
mod nats_server;

use async_nats::jetstream::{self, consumer::PullConsumer};
use contextfold::core::event::{Encoding, Envelope, EventBody, TurnAppended};
use contextfold::core::message::{ChatMessage, Role};
use contextfold::core::policy::PolicyConfig;
use contextfold::log::EventLog;
use contextfold::nats::config::StorageKind;
use contextfold::nats::event_log::{event_headers, NatsEventLog};
use contextfold::nats::folder::{FolderRole, FolderSettings};
use contextfold::nats::leases::{LeaseEvent, LeaseSettings, PartitionLeases};
use contextfold::nats::serve::redb_engines;
use contextfold::nats::setup::{ensure, folder_consumer_config, Infrastructure};
use contextfold::nats::{NatsConfig, NatsOptions};
use futures::StreamExt;
use nats_server::NatsServer;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

// `serve` runs on the binary's allocator (src/main.rs); so does the folder
// role measured here.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const CONVERSATIONS: usize = 256;
/// How long one measurement may take before the bench gives up.
const LIMIT: Duration = Duration::from_secs(600);

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

type Error = Box<dyn std::error::Error + Send + Sync>;

fn events(n: usize) -> Vec<Envelope> {
    let filler = "lorem ipsum dolor sit amet consectetur ".repeat(10);
    (0..n)
        .map(|i| {
            let role = if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            };
            Envelope::new(
                format!("b{i}"),
                format!("bench:{}", i % CONVERSATIONS),
                1_700_000_000_000 + i as u64,
                EventBody::TurnAppended(TurnAppended {
                    message: ChatMessage::text(role, format!("{i} {}", &filler[..330])),
                    model: None,
                    sender: Some("agent".into()),
                    usage: None,
                    metadata: None,
                }),
            )
        })
        .collect()
}

/// Publishes every event, 4096 acks in flight at most; events/s.
async fn publish(
    js: &jetstream::Context,
    infra: &Infrastructure,
    events: &[Envelope],
) -> Result<f64, Error> {
    let started = Instant::now();
    let mut acks = Vec::with_capacity(4096);
    for e in events {
        let subject = infra.subjects.inbound(&e.conversation)?;
        acks.push(
            js.publish_with_headers(
                subject,
                event_headers(&e.id, Encoding::Json),
                e.to_json().into(),
            )
            .await?,
        );
        if acks.len() == 4096 {
            for a in acks.drain(..) {
                a.await?;
            }
        }
    }
    for a in acks.drain(..) {
        a.await?;
    }
    Ok(events.len() as f64 / started.elapsed().as_secs_f64())
}

/// The last stream sequence of each partition.
async fn last_positions(
    js: &jetstream::Context,
    infra: &Infrastructure,
    partitions: u32,
) -> Result<Vec<u64>, Error> {
    let mut out = Vec::new();
    for p in 0..partitions {
        let mut log = NatsEventLog::open_partition(js.clone(), infra.subjects.clone(), p).await?;
        out.push(log.last_position().await?);
    }
    Ok(out)
}

/// Waits until the server reports every consumer's ack floor at (or past)
/// its partition's last message.
async fn wait_acked(
    infra: &Infrastructure,
    names: &[String],
    last: &[u64],
    started: Instant,
) -> Result<(), Error> {
    for (name, &last) in names.iter().zip(last) {
        loop {
            let info = infra.events.consumer_info(name).await?;
            if info.ack_floor.stream_sequence >= last {
                break;
            }
            if started.elapsed() > LIMIT {
                return Err(format!(
                    "{name}: ack floor {} short of {last} after {LIMIT:?}",
                    info.ack_floor.stream_sequence
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    Ok(())
}

/// What both measurements run against, and how.
struct Bench {
    js: jetstream::Context,
    infra: Infrastructure,
    cfg: NatsConfig,
    settings: FolderSettings,
    /// The raw phase's pull batch (the folder's unless set apart).
    raw_batch: usize,
    /// Every N-th state commit is durable.
    flush_every: u32,
    server_pid: Option<u32>,
}

/// The raw rate: pull and ack everything, no work. Seconds, and the CPU
/// used.
async fn raw(bench: &Bench, round: usize, last: &[u64]) -> Result<(f64, String), Error> {
    let Bench {
        infra,
        settings,
        raw_batch,
        server_pid,
        ..
    } = bench;
    let (server_pid, batch) = (*server_pid, *raw_batch);
    let names: Vec<String> = (0..last.len())
        .map(|p| format!("raw_{round}_{p}"))
        .collect();
    let cpu = Cpu::start(server_pid);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (p, name) in names.iter().enumerate() {
        let mut config =
            folder_consumer_config(&infra.subjects, p as u32, 0, settings.max_ack_pending);
        config.durable_name = Some(name.clone());
        config.description = Some("contextfold benchmark: raw pull and ack".into());
        let consumer: PullConsumer = infra.events.create_consumer(config).await?;
        let last = last[p];
        tasks.push(tokio::spawn(async move {
            if last == 0 {
                return Ok::<(), Error>(());
            }
            let mut chunks = consumer
                .stream()
                .max_messages_per_batch(batch)
                .messages()
                .await?
                .ready_chunks(batch);
            loop {
                let Some(chunk) = chunks.next().await else {
                    return Err("the message stream ended".into());
                };
                let Some(newest) = chunk.into_iter().last() else {
                    continue;
                };
                let newest = newest?;
                let position = newest.info()?.stream_sequence;
                newest.ack().await?;
                if position >= last {
                    return Ok(());
                }
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    wait_acked(infra, &names, last, started).await?;
    let secs = started.elapsed().as_secs_f64();
    let cpu = cpu.used();
    for name in &names {
        let _ = infra.events.delete_consumer(name).await;
    }
    Ok((secs, cpu))
}

/// What the end-to-end run found.
struct EndToEnd {
    secs: f64,
    /// Until every engine committed its last message (acks not yet seen).
    committed_secs: f64,
    turns: usize,
    /// State commits over all partitions (one per folded batch).
    commits: u64,
    cpu: String,
}

/// The folder role over every partition, leases held beforehand.
async fn end_to_end(bench: &Bench, round: usize, last: &[u64]) -> Result<EndToEnd, Error> {
    let Bench {
        js,
        infra,
        cfg,
        settings,
        raw_batch: _,
        flush_every,
        server_pid,
    } = bench;
    let (flush_every, server_pid) = (*flush_every, *server_pid);
    let dir = tempfile::tempdir()?;
    let mut runner = PartitionLeases::new(
        infra.leases.clone(),
        format!("bench-{round}"),
        LeaseSettings::from_config(cfg),
    )?
    .spawn();
    let mut lease_events = runner.take_events();
    // Every lease first, so the timing holds no lease election.
    let (tx, rx) = mpsc::unbounded_channel();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut held = 0;
    while held < cfg.partitions {
        let left = deadline.saturating_duration_since(Instant::now());
        let event = tokio::time::timeout(left, lease_events.recv())
            .await
            .map_err(|_| format!("only {held} leases acquired after 60 s"))?
            .ok_or("the lease runner stopped")?;
        if matches!(event, LeaseEvent::Acquired(_)) {
            held += 1;
        }
        let _ = tx.send(event);
    }
    let forward = tokio::spawn(async move {
        while let Some(e) = lease_events.recv().await {
            if tx.send(e).is_err() {
                break;
            }
        }
    });

    let role = FolderRole::new(
        js.clone(),
        infra,
        redb_engines(dir.path(), PolicyConfig::default(), flush_every),
        settings.clone(),
    );
    let engines = role.engines();
    let (stop, stop_rx) = watch::channel(false);
    let cpu = Cpu::start(server_pid);
    let started = Instant::now();
    let folder = tokio::spawn(role.run(rx, stop_rx));
    loop {
        let done = last.iter().enumerate().all(|(p, &last)| {
            engines.get(p as u32).is_some_and(|e| {
                let e = e.lock().unwrap_or_else(|p| p.into_inner());
                e.position() >= last && !e.has_uncommitted()
            })
        });
        if done {
            break;
        }
        if started.elapsed() > LIMIT {
            return Err(format!("ingest did not finish in {LIMIT:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let committed_secs = started.elapsed().as_secs_f64();
    let names: Vec<String> = (0..last.len() as u32)
        .map(|p| infra.subjects.folder_consumer(p))
        .collect();
    wait_acked(infra, &names, last, started).await?;
    let secs = started.elapsed().as_secs_f64();
    let cpu = cpu.used();
    let (mut turns, mut commits) = (0, 0);
    for e in engines
        .partitions()
        .into_iter()
        .filter_map(|p| engines.get(p))
    {
        let e = e.lock().unwrap_or_else(|p| p.into_inner());
        turns += e
            .state
            .conversations
            .values()
            .map(|c| c.turns.len())
            .sum::<usize>();
        commits += e.store().commits();
    }
    let _ = stop.send(true);
    let _ = folder.await;
    runner.stop().await;
    forward.abort();
    Ok(EndToEnd {
        secs,
        committed_secs,
        turns,
        commits,
        cpu,
    })
}

/// CPU seconds (user + system) a process used so far, from
/// `/proc/<pid>/stat`; `None` where there is no such file.
fn cpu_secs(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesized command name; utime and stime are the
    // 14th and 15th fields, in clock ticks (USER_HZ, 100 on Linux).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// CPU time of the bench process and of the nats-server over a phase.
struct Cpu {
    server_pid: Option<u32>,
    start: (Option<f64>, Option<f64>),
}

impl Cpu {
    fn now(server_pid: Option<u32>) -> (Option<f64>, Option<f64>) {
        (
            cpu_secs("self"),
            server_pid.and_then(|p| cpu_secs(&p.to_string())),
        )
    }

    fn start(server_pid: Option<u32>) -> Cpu {
        Cpu {
            server_pid,
            start: Cpu::now(server_pid),
        }
    }

    /// "cpu: bench X s, nats-server Y s" since the start.
    fn used(&self) -> String {
        let (bench, server) = Cpu::now(self.server_pid);
        let show = |now: Option<f64>, then: Option<f64>| match (now, then) {
            (Some(a), Some(b)) => format!("{:.2} s", a - b),
            _ => "n/a".to_string(),
        };
        format!(
            "cpu: bench {}, nats-server {}",
            show(bench, self.start.0),
            show(server, self.start.1)
        )
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

async fn run() -> Result<(), Error> {
    let n = env_usize("CONTEXTFOLD_BENCH_EVENTS", 100_000).max(1);
    let rounds = env_usize("CONTEXTFOLD_BENCH_ROUNDS", 3).max(1);
    let server = NatsServer::start();
    let cfg = NatsConfig {
        connection: NatsOptions::with_servers([server.url()]),
        storage: StorageKind::File,
        ..NatsConfig::default()
    };
    let (client, _) = cfg.connection.connect().await?;
    let js = jetstream::new(client);
    let infra = ensure(&js, &cfg).await?;
    let defaults = FolderSettings::default();
    let settings = FolderSettings {
        batch: env_usize("CONTEXTFOLD_BENCH_BATCH", defaults.batch).max(1),
        gather_wait: Duration::from_millis(env_usize(
            "CONTEXTFOLD_BENCH_GATHER_MS",
            defaults.gather_wait.as_millis() as usize,
        ) as u64),
        ..defaults
    };
    let raw_batch = env_usize("CONTEXTFOLD_BENCH_RAW_BATCH", settings.batch).max(1);
    let flush_every =
        env_usize("CONTEXTFOLD_BENCH_FLUSH_EVERY", 1).clamp(1, u32::MAX as usize) as u32;

    let events = events(n);
    let size = events[0].to_json().len();
    let publish_rate = publish(&js, &infra, &events).await?;
    drop(events);
    println!(
        "nats_ingest: {n} turn events of about {size} bytes (JSON) over {CONVERSATIONS} \
         conversations, {} partitions, file storage; published at {publish_rate:.0} events/s; \
         folder batch {} (gathered for up to {:?}), raw pull batch {raw_batch}, max_ack_pending \
         {}, state commits durable every {flush_every}",
        cfg.partitions, settings.batch, settings.gather_wait, settings.max_ack_pending
    );
    let bench = Bench {
        js,
        infra,
        cfg,
        settings,
        raw_batch,
        flush_every,
        server_pid: server.pid(),
    };

    let mut ratios = Vec::new();
    let mut raw_rates = Vec::new();
    let mut e2e_rates = Vec::new();
    for round in 1..=rounds {
        let last = last_positions(&bench.js, &bench.infra, bench.cfg.partitions).await?;
        let (raw_secs, raw_cpu) = raw(&bench, round, &last).await?;
        let e2e = end_to_end(&bench, round, &last).await?;
        if e2e.turns != n {
            return Err(format!("round {round}: folded {} turns of {n}", e2e.turns).into());
        }
        let raw_rate = n as f64 / raw_secs;
        let e2e_rate = n as f64 / e2e.secs;
        let ratio = e2e_rate / raw_rate;
        println!(
            "round {round}: raw pull+ack {raw_rate:>6.0} events/s ({raw_secs:.3} s; {raw_cpu})\n  \
             end to end fold+publish+commit+ack {e2e_rate:>6.0} events/s ({:.3} s, committed at \
             {:.3} s; {}; {} state commits, {:.0} events each)\n  ratio {ratio:.2}",
            e2e.secs,
            e2e.committed_secs,
            e2e.cpu,
            e2e.commits,
            n as f64 / e2e.commits.max(1) as f64,
        );
        ratios.push(ratio);
        raw_rates.push(raw_rate);
        e2e_rates.push(e2e_rate);
    }
    let lowest = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let ratio = median(ratios);
    println!(
        "median of {rounds}: raw {:.0} events/s, end to end {:.0} events/s, ratio {ratio:.2}, \
         lowest {lowest:.2} (goal: median >= 0.6, every round >= 0.55: {})",
        median(raw_rates),
        median(e2e_rates),
        if ratio >= 0.6 && lowest >= 0.55 {
            "met"
        } else {
            "NOT met"
        }
    );
    Ok(())
}

fn main() -> ExitCode {
    if let Err(e) = nats_server::find_binary() {
        println!("nats_ingest skipped: {e}");
        return ExitCode::SUCCESS;
    }
    // Telemetry as `serve --http` runs it: the Prometheus recorder and a
    // log subscriber at the default filter (warn). With `--features
    // telemetry-off` every telemetry event compiles to nothing: the two
    // builds side by side are telemetry's cost on the hot path.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
        .with_writer(std::io::stderr)
        .init();
    if cfg!(feature = "telemetry-off") {
        println!("telemetry: compiled out (--features telemetry-off)");
    } else {
        if let Err(e) = contextfold::telemetry::install_prometheus() {
            println!("nats_ingest: cannot install the Prometheus recorder: {e}");
            return ExitCode::FAILURE;
        }
        println!("telemetry: Prometheus recorder installed, as `serve --http` runs");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nats_ingest failed: {e}");
            ExitCode::FAILURE
        }
    }
}
