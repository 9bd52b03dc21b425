//! Time from a folder taking a partition to its first fold, for a
//! partition holding a long history (issue 11), per binary side by side.
//!
//! Per binary, on its own nats-server (JetStream, file storage, free
//! loopback port), with `[nats] partitions = 1` so one partition holds
//! every event:
//!
//! 1. `serve` (folder, summarizer, api; data dir A) starts and takes the
//!    partition; `contextfold publish` sends N turns (default 100,000 of
//!    about 500 B of text, plain user / assistant turns over 200
//!    conversations); the bench waits until the folder folded the whole
//!    stream and stays quiet, then stops it with SIGTERM.
//! 2. One more turn is published while nobody folds, then `serve` starts
//!    again on data dir A (**restart**: its store holds the history) and
//!    is stopped again.
//! 3. One more turn, then `serve` starts on an empty data dir B (**new
//!    owner**: no local state, the stream is the only copy).
//!
//! Measured from the child's stderr (`--log-format json`,
//! `CONTEXTFOLD_LOG=contextfold=info,contextfold::telemetry=debug`), each
//! line stamped as it arrives: process start -> `partition lease`
//! (Acquired), lease -> `folder started`, lease -> first `batch folded`
//! (the fold of the new turn, for a restart), and lease -> caught up (the
//! batches since the start hold every message the stream had beyond the
//! store's position). Also the peak RSS of each serve process (wait4) and
//! the time SIGTERM takes.
//!
//! ```text
//! cargo bench --bench takeover
//! CONTEXTFOLD_BENCH_BINS=before=/path/contextfold,after=/path/contextfold
//! CONTEXTFOLD_TAKEOVER_TURNS=100000        # turns in the partition
//! CONTEXTFOLD_TAKEOVER_TURN_BYTES=500      # text per turn
//! CONTEXTFOLD_TAKEOVER_CONVERSATIONS=200
//! CONTEXTFOLD_TAKEOVER_PARTITIONS=1        # [nats] partitions
//! CONTEXTFOLD_TAKEOVER_TIMEOUT_SECS=900    # longest wait for any step
//! ```
//!
//! nats-server is looked up as the integration tests do
//! (`CONTEXTFOLD_NATS_SERVER`, `$CONTEXTFOLD_VENV/bin`, `.venv/bin`);
//! without one the bench says so and exits successfully.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
#[path = "../tests/support/nats_server.rs"]
mod nats_server;

#[allow(dead_code)]
#[path = "support/procs.rs"]
mod procs;

use nats_server::NatsServer;
use procs::{Bin, Rng, Table};
use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A log line of interest, stamped on arrival.
#[derive(Debug, Clone, Copy)]
enum Seen {
    LeaseAcquired,
    FolderStarted,
    Batch(u64),
}

/// A running `serve` whose stderr is read and stamped by a thread.
struct Serve {
    pid: u32,
    started: Instant,
    seen: Arc<Mutex<Vec<(Instant, Seen)>>>,
    reader: Option<std::thread::JoinHandle<()>>,
    reaped: bool,
}

impl Serve {
    fn start(
        bin: &Bin,
        url: &str,
        data: &Path,
        name: &str,
        log: &Path,
        partitions: u64,
    ) -> Result<Serve, String> {
        let mut cmd = procs::command(bin);
        cmd.args([
            "serve",
            "--nats",
            url,
            "--name",
            name,
            "--log-format",
            "json",
            "--data",
        ])
        .arg(data)
        .env("CONTEXTFOLD_NATS__PARTITIONS", partitions.to_string())
        .env(
            "CONTEXTFOLD_LOG",
            "contextfold=info,contextfold::telemetry=debug",
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("spawning {} serve: {e}", bin.label))?;
        let pid = child.id();
        let stderr = child.stderr.take().ok_or("no stderr pipe")?;
        // The child is reaped with wait4 (for its rusage), not by `Child`.
        drop(child);
        let seen: Arc<Mutex<Vec<(Instant, Seen)>>> = Arc::default();
        let sink = seen.clone();
        let mut file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let at = Instant::now();
                let _ = writeln!(file, "{line}");
                if let Some(s) = classify(&line) {
                    if let Ok(mut v) = sink.lock() {
                        v.push((at, s));
                    }
                }
            }
        });
        Ok(Serve {
            pid,
            started,
            seen,
            reader: Some(reader),
            reaped: false,
        })
    }

    fn seen(&self) -> Vec<(Instant, Seen)> {
        self.seen.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Waits until `done` holds on what was seen, or fails after `limit`.
    fn wait(
        &self,
        what: &str,
        limit: Duration,
        mut done: impl FnMut(&[(Instant, Seen)]) -> bool,
    ) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            if done(&self.seen()) {
                return Ok(());
            }
            if self.reader.as_ref().is_some_and(|r| r.is_finished()) {
                return Err(format!("serve exited while waiting for {what}"));
            }
            if Instant::now() > deadline {
                return Err(format!("timed out after {limit:?} waiting for {what}"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, then reap: (time to exit, peak RSS).
    fn stop(mut self) -> Result<(Duration, u64), String> {
        let asked = Instant::now();
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGTERM) };
        let (_, usage) = procs::wait4(self.pid)?;
        self.reaped = true;
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        Ok((asked.elapsed(), usage.ru_maxrss.max(0) as u64 * 1024))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if !self.reaped {
            // SAFETY: our own child, not yet reaped.
            unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) };
            let _ = procs::wait4(self.pid);
        }
    }
}

fn classify(line: &str) -> Option<Seen> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let f = v.get("fields")?;
    match f.get("message")?.as_str()? {
        "partition lease" if f.get("change").and_then(|c| c.as_str()) == Some("Acquired") => {
            Some(Seen::LeaseAcquired)
        }
        "folder started" => Some(Seen::FolderStarted),
        "batch folded" => Some(Seen::Batch(
            f.get("records").and_then(|r| r.as_u64()).unwrap_or(0),
        )),
        _ => None,
    }
}

fn first(seen: &[(Instant, Seen)], pred: impl Fn(&Seen) -> bool) -> Option<Instant> {
    seen.iter().find(|(_, s)| pred(s)).map(|(t, _)| *t)
}

fn folded(seen: &[(Instant, Seen)]) -> u64 {
    seen.iter()
        .map(|(_, s)| if let Seen::Batch(n) = s { *n } else { 0 })
        .sum()
}

/// When the batches seen reached `expected` records in all.
fn caught_up(seen: &[(Instant, Seen)], expected: u64) -> Option<Instant> {
    let mut sum = 0;
    for (t, s) in seen {
        if let Seen::Batch(n) = s {
            sum += n;
            if sum >= expected {
                return Some(*t);
            }
        }
    }
    None
}

fn write_turns(
    path: &Path,
    from: usize,
    n: usize,
    convs: usize,
    bytes: usize,
) -> Result<u64, String> {
    let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    let mut rng = Rng::new(from as u64 + 1);
    let words = [
        "partition",
        "lease",
        "fold",
        "turn",
        "budget",
        "summary",
        "stream",
        "token",
        "state",
        "cache",
        "store",
        "commit",
    ];
    let mut total = 0u64;
    for i in from..from + n {
        let mut text = format!("turn {i}: ");
        while text.len() < bytes {
            text.push_str(rng.pick(&words));
            text.push(' ');
            if rng.below(9) == 0 {
                text.push_str(&format!("id-{:06x} ", rng.below(1 << 24)));
            }
        }
        let conv = format!("tk-{:04}", i % convs);
        let role = if (i / convs).is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        };
        let e = json!({
            "id": format!("{conv}:{i}"), "conversation": conv, "version": 1,
            "time": 1_760_000_000_000u64 + i as u64 * 10, "type": "turn_appended",
            "payload": {"message": {"role": role, "content": text}},
        });
        let line = e.to_string();
        total += line.len() as u64 + 1;
        writeln!(out, "{line}").map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    out.flush()
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(total)
}

fn publish(
    bin: &Bin,
    url: &str,
    file: &Path,
    partitions: u64,
    log: &Path,
) -> Result<Duration, String> {
    let mut cmd = procs::command(bin);
    cmd.args(["publish", "--nats", url])
        .arg(file)
        .env("CONTEXTFOLD_NATS__PARTITIONS", partitions.to_string());
    let m = procs::measure(cmd, None, Some(log))?;
    if !m.success {
        return Err(format!(
            "publish failed: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        ));
    }
    Ok(m.wall)
}

/// The events stream's last sequence (every partition).
fn stream_head(rt: &tokio::runtime::Runtime, url: &str) -> Result<u64, String> {
    rt.block_on(async {
        let client = async_nats::connect(url)
            .await
            .map_err(|e| format!("connect {url}: {e}"))?;
        let js = async_nats::jetstream::new(client);
        let mut stream = js
            .get_stream("CF_EVENTS")
            .await
            .map_err(|e| format!("stream CF_EVENTS: {e}"))?;
        let info = stream
            .info()
            .await
            .map_err(|e| format!("stream info: {e}"))?;
        Ok(info.state.last_sequence)
    })
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| {
        format!("{:.0} ms", d.as_secs_f64() * 1000.0)
    })
}

struct Knobs {
    turns: usize,
    bytes: usize,
    convs: usize,
    partitions: u64,
    timeout: Duration,
}

/// One takeover (restart or new owner), measured into `table` under `tag`.
#[allow(clippy::too_many_arguments)]
fn takeover(
    bin: &Bin,
    col: usize,
    table: &mut Table,
    tag: &str,
    url: &str,
    data: &Path,
    store_position: u64,
    rt: &tokio::runtime::Runtime,
    k: &Knobs,
    logs: &Path,
) -> Result<u64, String> {
    let head = stream_head(rt, url)?;
    let expected = head.saturating_sub(store_position);
    let log = logs.join(format!("{}-serve-{tag}.log", bin.label));
    let s = Serve::start(bin, url, data, &format!("cf-{tag}"), &log, k.partitions)?;
    s.wait("the lease", k.timeout, |v| {
        first(v, |e| matches!(e, Seen::LeaseAcquired)).is_some()
    })?;
    s.wait("catching up", k.timeout, |v| {
        caught_up(v, expected).is_some()
    })?;
    let seen = s.seen();
    let lease = first(&seen, |e| matches!(e, Seen::LeaseAcquired));
    let started = first(&seen, |e| matches!(e, Seen::FolderStarted));
    let batch = first(&seen, |e| matches!(e, Seen::Batch(_)));
    let done = caught_up(&seen, expected);
    let since = |t: Option<Instant>, from: Option<Instant>| Some(t?.duration_since(from?));
    table.set(
        &format!("{tag}: start -> lease acquired"),
        col,
        ms(since(lease, Some(s.started))),
    );
    table.set(
        &format!("{tag}: lease -> folder started"),
        col,
        ms(since(started, lease)),
    );
    table.set(
        &format!("{tag}: lease -> first batch folded"),
        col,
        ms(since(batch, lease)),
    );
    table.set(
        &format!("{tag}: lease -> caught up ({expected} msgs)"),
        col,
        ms(since(done, lease)),
    );
    // Settle what the new turns caused (decisions, summaries) before stopping.
    std::thread::sleep(Duration::from_millis(1500));
    let (stop, rss) = s.stop()?;
    table.set(&format!("{tag}: peak RSS"), col, procs::mib(rss));
    table.set(&format!("{tag}: SIGTERM -> exit"), col, ms(Some(stop)));
    stream_head(rt, url)
}

fn run_bin(
    bin: &Bin,
    col: usize,
    table: &mut Table,
    k: &Knobs,
    root: &Path,
    rt: &tokio::runtime::Runtime,
) -> Result<(), String> {
    let nats = NatsServer::start();
    let url = nats.url();
    let dir = root.join(bin.label.clone());
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
    let turns = dir.join("turns.jsonl");
    let bytes = write_turns(&turns, 0, k.turns, k.convs, k.bytes)?;
    let data_a = dir.join("data-a");

    eprintln!(
        "[{}] first owner: publish {} turns ({}) and fold them ...",
        bin.label,
        k.turns,
        procs::mib(bytes)
    );
    let s = Serve::start(
        bin,
        &url,
        &data_a,
        "cf-first",
        &logs.join("serve-first.log"),
        k.partitions,
    )?;
    s.wait("the first lease", k.timeout, |v| {
        first(v, |e| matches!(e, Seen::LeaseAcquired)).is_some()
    })?;
    let t_pub = publish(bin, &url, &turns, k.partitions, &logs.join("publish.log"))?;
    table.set(
        &format!("publish {} turns", k.turns),
        col,
        procs::secs(t_pub),
    );
    // Folded and quiet: every message of the stream folded, no batch for 2 s.
    let deadline = Instant::now() + k.timeout;
    let t0 = s.started;
    let position = loop {
        let head = stream_head(rt, &url)?;
        let seen = s.seen();
        let last = seen
            .iter()
            .rev()
            .find(|(_, e)| matches!(e, Seen::Batch(_)))
            .map(|(t, _)| *t);
        if folded(&seen) >= head && last.is_some_and(|t| t.elapsed() > Duration::from_secs(2)) {
            table.set(
                "first owner: start -> all folded",
                col,
                procs::secs(last.map_or(Duration::ZERO, |t| t - t0)),
            );
            break head;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "first owner: folded {} of {head} messages after {:?}",
                folded(&seen),
                k.timeout
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let (stop, rss) = s.stop()?;
    table.set("first owner: peak RSS", col, procs::mib(rss));
    table.set("first owner: SIGTERM -> exit", col, ms(Some(stop)));
    table.set("stream messages", col, position.to_string());
    // The store's position is what the first owner folded: all of the stream.
    let position = stream_head(rt, &url)?.max(position);

    let one = dir.join("one.jsonl");
    write_turns(&one, k.turns, 1, k.convs, k.bytes)?;
    publish(bin, &url, &one, k.partitions, &logs.join("publish-one.log"))?;
    eprintln!("[{}] restart on the same store ...", bin.label);
    takeover(
        bin, col, table, "restart", &url, &data_a, position, rt, k, &logs,
    )?;

    write_turns(&one, k.turns + 1, 1, k.convs, k.bytes)?;
    publish(bin, &url, &one, k.partitions, &logs.join("publish-two.log"))?;
    eprintln!("[{}] new owner on an empty data dir ...", bin.label);
    takeover(
        bin,
        col,
        table,
        "new owner",
        &url,
        &dir.join("data-b"),
        0,
        rt,
        k,
        &logs,
    )?;
    table.set(
        "disk: data dir of first owner + restart",
        col,
        procs::mib(procs::disk_usage(&data_a)),
    );
    Ok(())
}

fn bench() -> Result<(), String> {
    if let Err(e) = nats_server::find_binary() {
        println!("takeover: skipped: {e}");
        return Ok(());
    }
    let bins = procs::bins()?;
    let k = Knobs {
        turns: procs::env_u64("CONTEXTFOLD_TAKEOVER_TURNS", 100_000)?.max(1) as usize,
        bytes: procs::env_u64("CONTEXTFOLD_TAKEOVER_TURN_BYTES", 500)?.max(20) as usize,
        convs: procs::env_u64("CONTEXTFOLD_TAKEOVER_CONVERSATIONS", 200)?.max(1) as usize,
        partitions: procs::env_u64("CONTEXTFOLD_TAKEOVER_PARTITIONS", 1)?.max(1),
        timeout: Duration::from_secs(procs::env_u64("CONTEXTFOLD_TAKEOVER_TIMEOUT_SECS", 900)?),
    };
    let dir = procs::scratch("cf-takeover-")?;
    let root: PathBuf = dir.path().to_path_buf();
    // JSON, the stream's copy, two stores (the issue's ~2.5x of the text).
    let need = (k.turns * (k.bytes + 200)) as u64 * 8 + (256 << 20);
    procs::require_free(&root, need, "the turns, the stream and two stores")?;
    println!(
        "takeover: {} turns of ~{} B over {} conversations in {} partition(s)",
        k.turns, k.bytes, k.convs, k.partitions
    );
    for b in &bins {
        println!(
            "  {:<8} {}  ({})",
            b.label,
            b.path.display(),
            procs::version(b)
        );
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let mut table = Table::new(bins.iter().map(|b| b.label.clone()));
    for (col, bin) in bins.iter().enumerate() {
        run_bin(bin, col, &mut table, &k, &root, &rt)?;
    }
    println!();
    print!("{}", table.render());
    if std::env::var_os("CONTEXTFOLD_TAKEOVER_KEEP").is_some() {
        println!("kept {}", dir.keep().display());
    }
    Ok(())
}

fn main() -> ExitCode {
    match bench() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("takeover: {e}");
            ExitCode::FAILURE
        }
    }
}
