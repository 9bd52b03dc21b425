//! Embedded event log: append rate (512-byte records, each appended and
//! fsync'd alone, then in batches of 1000 with one fsync per batch), open
//! (scan + checksum + index) rate, and replay rate (`read_after` over the
//! whole log in pages).
//!
//! ```text
//! cargo bench --bench event_log
//! CONTEXTFOLD_BENCH_SCALE=0.1   # fraction of the default record counts
//! CONTEXTFOLD_BENCH_DIR=/path   # where the log is written (default: a temp dir)
//! ```

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::{Encoding, Origin};
use contextfold::log::segment::{SegmentLog, RECORD_OVERHEAD};
use std::process::ExitCode;
use std::time::Instant;

const RECORD_BYTES: usize = 512;
const SINGLE_APPENDS: f64 = 2_000.0;
const BATCHED_RECORDS: f64 = 500_000.0;
const BATCH: usize = 1000;
const REPLAY_PAGE: usize = 10_000;

fn scale() -> f64 {
    std::env::var("CONTEXTFOLD_BENCH_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0)
}

fn record(i: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; RECORD_BYTES];
    for (j, b) in bytes.iter_mut().enumerate() {
        *b = (i as usize).wrapping_mul(31).wrapping_add(j) as u8;
    }
    bytes
}

fn report(what: &str, records: u64, secs: f64) {
    let payload_mb = records as f64 * RECORD_BYTES as f64 / 1e6;
    let disk_mb = records as f64 * (RECORD_BYTES as u64 + RECORD_OVERHEAD) as f64 / 1e6;
    println!(
        "{what:<28} {records:>9} records in {secs:>7.3} s = {:>11.0} records/s, {:>8.1} MB/s payload ({:.1} MB/s on disk)",
        records as f64 / secs,
        payload_mb / secs,
        disk_mb / secs,
    );
}

fn run() -> Result<(), String> {
    let singles = ((SINGLE_APPENDS * scale()) as u64).max(10);
    let batched =
        (((BATCHED_RECORDS * scale()) as u64).max(BATCH as u64) / BATCH as u64) * BATCH as u64;
    let temp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let dir = match std::env::var_os("CONTEXTFOLD_BENCH_DIR") {
        Some(d) => std::path::PathBuf::from(d).join(format!("event-log-{}", std::process::id())),
        None => temp.path().join("log"),
    };
    println!(
        "embedded event log in {}: {RECORD_BYTES}-byte records ({} bytes framed)",
        dir.display(),
        RECORD_BYTES as u64 + RECORD_OVERHEAD
    );
    let mut log = SegmentLog::open(&dir).map_err(|e| e.to_string())?;

    let start = Instant::now();
    for i in 0..singles {
        log.append_sync(Origin::Agent, Encoding::Msgpack, &record(i))
            .map_err(|e| e.to_string())?;
    }
    report(
        "append, batch of 1 (fsync)",
        singles,
        start.elapsed().as_secs_f64(),
    );

    let batches: Vec<Vec<(Origin, Encoding, Vec<u8>)>> = (0..batched / BATCH as u64)
        .map(|b| {
            (0..BATCH as u64)
                .map(|j| {
                    (
                        Origin::Agent,
                        Encoding::Msgpack,
                        record(singles + b * BATCH as u64 + j),
                    )
                })
                .collect()
        })
        .collect();
    let start = Instant::now();
    for batch in &batches {
        log.append_batch_sync(batch).map_err(|e| e.to_string())?;
    }
    report(
        "append, batch of 1000",
        batched,
        start.elapsed().as_secs_f64(),
    );
    drop(batches);

    let total = log.last_position_sync();
    if total != singles + batched {
        return Err(format!(
            "log holds {total} records, expected {}",
            singles + batched
        ));
    }
    let size = log.size_bytes();
    drop(log);

    let start = Instant::now();
    let mut log = SegmentLog::open(&dir).map_err(|e| e.to_string())?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{:<28} {total:>9} records in {secs:>7.3} s = {:>11.0} records/s, {:>8.1} MB/s scanned",
        "open (scan, verify, index)",
        total as f64 / secs,
        size as f64 / 1e6 / secs
    );

    let start = Instant::now();
    let mut after = 0;
    let mut checksum = 0u64;
    loop {
        let page = log
            .read_after_sync(after, REPLAY_PAGE)
            .map_err(|e| e.to_string())?;
        let Some(last) = page.last() else { break };
        after = last.position;
        checksum = page
            .iter()
            .fold(checksum, |c, r| c.wrapping_add(r.bytes[0] as u64));
    }
    let secs = start.elapsed().as_secs_f64();
    if after != total {
        return Err(format!("replay stopped at {after} of {total}"));
    }
    report("replay, read_after x10000", total, secs);
    std::hint::black_box(checksum);
    println!(
        "log size on disk: {:.1} MB in {} segment(s)",
        size as f64 / 1e6,
        log.segment_count()
    );
    drop(log);
    if std::env::var_os("CONTEXTFOLD_BENCH_DIR").is_some() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("event log bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}
