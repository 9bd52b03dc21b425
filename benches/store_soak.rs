//! Store soak: many small atomic commits, the way the folder writes state.
//!
//! Each commit writes one conversation's state head (1-4 KB) and the log
//! checkpoint (in another table) atomically and non-durably; every 1000
//! commits a durable flush. Reports commits/s, wall time and the size of the
//! store on disk, for redb and (with `--features sled-store`) sled.
//!
//! Every run happens in a child process watched by a watchdog thread: sled
//! 0.34.7 deadlocks under this load with its default segment size (the sled
//! backend uses 16 MiB segments to make that rare, see
//! `src/store/sled_backend.rs`), and a stalled run is reported ("stalled
//! (deadlock?) after N commits") instead of hanging the bench.
//!
//! ```text
//! cargo bench --bench store_soak [--features sled-store] [-- redb|sled ...]
//! CONTEXTFOLD_BENCH_SCALE=0.1   # fraction of the 200,000 commits
//! CONTEXTFOLD_SOAK_RUNS=2       # runs per backend
//! CONTEXTFOLD_SOAK_STALL_SECS=30
//! ```

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::store::{KvBackend, Table, Write};
use std::path::Path;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const FULL_COMMITS: u64 = 200_000;
const FLUSH_EVERY: u64 = 1000;
const CONVERSATIONS: u64 = 64;
const CHILD_FLAG: &str = "--soak-child";
const STALL_EXIT: i32 = 3;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn commits() -> u64 {
    let scale: f64 = env_or("CONTEXTFOLD_BENCH_SCALE", 1.0);
    ((FULL_COMMITS as f64 * scale) as u64).max(FLUSH_EVERY)
}

fn backends() -> Vec<&'static str> {
    let mut all = vec!["redb"];
    if cfg!(feature = "sled-store") {
        all.push("sled");
    }
    all
}

fn dir_size(path: &Path) -> u64 {
    let Ok(meta) = std::fs::metadata(path) else {
        return 0;
    };
    if meta.is_file() {
        return meta.len();
    }
    std::fs::read_dir(path)
        .map(|entries| entries.flatten().map(|e| dir_size(&e.path())).sum())
        .unwrap_or(0)
}

/// A state head of 1-4 KB whose size and bytes vary with `i`.
fn state_value(i: u64) -> Vec<u8> {
    let len = 1024 + (i.wrapping_mul(2_654_435_761) % 3072) as usize;
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn soak(store: &mut dyn KvBackend, total: u64, progress: &AtomicU64) -> Result<(), String> {
    for i in 1..=total {
        let writes = [
            Write::Put {
                table: Table::Conversations,
                key: format!("conversation-{}", i % CONVERSATIONS).into_bytes(),
                value: state_value(i),
            },
            Write::Put {
                table: Table::Meta,
                key: b"checkpoint".to_vec(),
                value: i.to_be_bytes().to_vec(),
            },
        ];
        store
            .commit(&writes, false)
            .map_err(|e| format!("commit {i}: {e}"))?;
        if i % FLUSH_EVERY == 0 {
            store.flush().map_err(|e| format!("flush at {i}: {e}"))?;
        }
        progress.store(i, Ordering::Relaxed);
    }
    store.flush().map_err(|e| format!("final flush: {e}"))?;
    let checkpoint = store
        .get(Table::Meta, b"checkpoint")
        .map_err(|e| e.to_string())?;
    if checkpoint.as_deref() != Some(&total.to_be_bytes()[..]) {
        return Err(format!(
            "checkpoint reads {checkpoint:?} after {total} commits"
        ));
    }
    Ok(())
}

fn open(backend: &str, dir: &Path) -> Result<Box<dyn KvBackend>, String> {
    match backend {
        "redb" => contextfold::store::redb_backend::RedbBackend::open(&dir.join("state.redb"))
            .map(|b| Box::new(b) as Box<dyn KvBackend>)
            .map_err(|e| e.to_string()),
        #[cfg(feature = "sled-store")]
        "sled" => contextfold::store::sled_backend::SledBackend::open(&dir.join("sled"))
            .map(|b| Box::new(b) as Box<dyn KvBackend>)
            .map_err(|e| e.to_string()),
        other => Err(format!(
            "unknown backend {other}; built with: {:?}",
            backends()
        )),
    }
}

/// One soak run in this (child) process; prints a `RESULT` line.
fn child(backend: &str) -> ExitCode {
    let total = commits();
    let stall = Duration::from_secs(env_or("CONTEXTFOLD_SOAK_STALL_SECS", 30));
    let progress = Arc::new(AtomicU64::new(0));
    let watched = Arc::clone(&progress);
    let name = backend.to_string();
    std::thread::spawn(move || {
        let mut last = (0, Instant::now());
        loop {
            std::thread::sleep(Duration::from_millis(250));
            let now = watched.load(Ordering::Relaxed);
            if now != last.0 {
                last = (now, Instant::now());
            } else if last.1.elapsed() >= stall {
                println!(
                    "{name} soak stalled (deadlock?) after {now} commits: no progress for {} s",
                    stall.as_secs()
                );
                std::process::exit(STALL_EXIT);
            }
        }
    });
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            println!("cannot create a temporary directory: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut store = match open(backend, dir.path()) {
        Ok(s) => s,
        Err(e) => {
            println!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let start = Instant::now();
    if let Err(e) = soak(store.as_mut(), total, &progress) {
        println!("{backend} soak failed: {e}");
        return ExitCode::FAILURE;
    }
    let secs = start.elapsed().as_secs_f64();
    drop(store);
    let bytes = dir_size(dir.path());
    println!("RESULT commits={total} secs={secs:.3} bytes={bytes}");
    ExitCode::SUCCESS
}

fn parse_result(line: &str) -> Option<(u64, f64, u64)> {
    let rest = line.strip_prefix("RESULT ")?;
    let mut commits = None;
    let mut secs = None;
    let mut bytes = None;
    for field in rest.split_whitespace() {
        match field.split_once('=')? {
            ("commits", v) => commits = v.parse().ok(),
            ("secs", v) => secs = v.parse().ok(),
            ("bytes", v) => bytes = v.parse().ok(),
            _ => {}
        }
    }
    Some((commits?, secs?, bytes?))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == CHILD_FLAG) {
        return match args.get(i + 1) {
            Some(backend) => child(backend),
            None => ExitCode::FAILURE,
        };
    }
    // `cargo bench` passes `--bench`; anything else not a flag picks backends.
    let chosen: Vec<String> = args
        .iter()
        .filter(|a| !a.starts_with('-'))
        .cloned()
        .collect();
    let selected: Vec<String> = if chosen.is_empty() {
        backends().into_iter().map(String::from).collect()
    } else {
        chosen
    };
    let runs: u32 = env_or("CONTEXTFOLD_SOAK_RUNS", 2);
    let total = commits();
    println!(
        "store soak: {total} atomic commits (state head 1-4 KB + checkpoint), non-durable, \
         durable flush every {FLUSH_EVERY}; {runs} run(s) per backend"
    );
    if !cfg!(feature = "sled-store") {
        println!("(sled not built; add --features sled-store to include it)");
    }
    let Ok(exe) = std::env::current_exe() else {
        println!("cannot locate this benchmark's executable");
        return ExitCode::FAILURE;
    };
    let mut any_failed = false;
    for backend in &selected {
        let mut rates = Vec::new();
        let mut stalls = 0;
        for run in 1..=runs {
            let output = match Command::new(&exe).args([CHILD_FLAG, backend]).output() {
                Ok(o) => o,
                Err(e) => {
                    println!("{backend} run {run}: cannot start: {e}");
                    any_failed = true;
                    continue;
                }
            };
            let stdout = String::from_utf8_lossy(&output.stdout);
            match stdout.lines().find_map(parse_result) {
                Some((commits, secs, bytes)) => {
                    let rate = commits as f64 / secs;
                    rates.push(rate);
                    println!(
                        "{backend} run {run}: {commits} commits in {secs:.2} s = {rate:.0} commits/s, \
                         store on disk {:.1} MB",
                        bytes as f64 / 1e6
                    );
                }
                None => {
                    any_failed = true;
                    if output.status.code() == Some(STALL_EXIT) {
                        stalls += 1;
                    }
                    let said = stdout.trim();
                    println!(
                        "{backend} run {run}: FAILED ({}): {}",
                        output.status,
                        if said.is_empty() { "no output" } else { said }
                    );
                }
            }
        }
        if !rates.is_empty() {
            let mean = rates.iter().sum::<f64>() / rates.len() as f64;
            println!(
                "{backend}: {} of {runs} runs completed, mean {mean:.0} commits/s, {stalls} stalled",
                rates.len()
            );
        } else {
            println!("{backend}: no run completed ({stalls} stalled)");
        }
    }
    if any_failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
