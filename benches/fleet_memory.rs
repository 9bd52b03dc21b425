//! Memory and latency of `contextfold run` / `status` / `assemble` over a
//! generated fleet, one child process per measurement (issue 11), for one
//! or more binaries side by side.
//!
//! The fleet (seeded, the same bytes every time): N conversations
//! `agent-00000`.. of T turns each (default 2,000 x 100) of about 1.8 KB of
//! text (words, file paths, ids and numbers), each conversation opening
//! with a `model_declared` (gpt-4o, a 32,000-token window so that the
//! ~49,000 tokens of a conversation are compacted) and then repeating user, assistant with a tool
//! call, its tool result, another call and result, assistant reply; as
//! events JSONL (what `contextfold import` writes). Conversations are
//! interleaved as a cluster's traffic would be: a window of 64 active
//! conversations, bursts of 1-4 turns (a tool call always with its result)
//! from a random one, a finished conversation replaced by the next, event
//! times increasing.
//!
//! For each binary, on a fresh data directory:
//! - `run FLEET --data DIR`: peak RSS (wait4 of exactly that child), wall
//!   time, events/s, and peak RSS per turn;
//! - cold processes on that store (page cache warm: nothing is dropped),
//!   3 times each, min / median: `status KEY` and
//!   `assemble KEY --budget 8000`, KEY `agent-01234` (or the middle
//!   conversation of a smaller fleet);
//! - the fixed cost: `--version` (process start), and `status` /
//!   `assemble` / `assemble --prompt` (the prompt is counted: it loads the
//!   tokenizer) on a one-conversation store;
//! - disk: the state store (`state.redb`) and the log (`log/`).
//!
//! ```text
//! cargo bench --bench fleet_memory
//! CONTEXTFOLD_BENCH_BINS=before=/path/contextfold,after=/path/contextfold
//! CONTEXTFOLD_FLEET_CONVERSATIONS=2000  # conversations (10000: 1M turns)
//! CONTEXTFOLD_FLEET_TURNS=100           # turns per conversation
//! CONTEXTFOLD_FLEET_SCALE=0.1           # fraction of the conversations (quick run)
//! CONTEXTFOLD_FLEET_TURN_BYTES=1800     # mean text per turn
//! CONTEXTFOLD_FLEET_WINDOW=32000      # declared context window (128000: no compaction)
//! CONTEXTFOLD_FLEET_REPEATS=3           # cold status / assemble runs
//! CONTEXTFOLD_FLEET_KEEP=1              # keep the fleet and data dirs
//! CONTEXTFOLD_BENCH_DIR=/work/tmp       # scratch space (default: temp dir)
//! ```

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
#[path = "support/procs.rs"]
mod procs;

use procs::{Bin, Measured, Rng, Table};
use serde_json::json;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

const WINDOW: usize = 64;
const START_MS: u64 = 1_760_000_000_000;

struct Fleet {
    conversations: usize,
    turns: usize,
    turn_bytes: usize,
    /// The context window each conversation declares.
    window: u64,
}

impl Fleet {
    fn key(i: usize) -> String {
        format!("agent-{i:05}")
    }

    /// The conversation the per-conversation queries ask about.
    fn probe(&self) -> String {
        if self.conversations > 1234 {
            Fleet::key(1234)
        } else {
            Fleet::key(self.conversations / 2)
        }
    }

    fn events(&self) -> usize {
        self.conversations * (self.turns + 1)
    }
}

const WORDS: &[&str] = &[
    "the",
    "build",
    "fails",
    "because",
    "the",
    "handler",
    "returns",
    "early",
    "when",
    "config",
    "value",
    "is",
    "missing",
    "we",
    "should",
    "retry",
    "with",
    "backoff",
    "and",
    "log",
    "error",
    "instead",
    "of",
    "panic",
    "check",
    "whether",
    "cache",
    "entry",
    "expired",
    "before",
    "reading",
    "it",
    "again",
    "test",
    "passes",
    "locally",
    "but",
    "not",
    "in",
    "ci",
    "timeout",
    "after",
    "seconds",
    "request",
    "response",
    "status",
    "field",
    "parser",
    "token",
    "budget",
    "summary",
    "stream",
    "partition",
    "lease",
    "commit",
    "offset",
    "schema",
    "migration",
    "index",
    "query",
    "latency",
    "p99",
    "regression",
    "fix",
    "refactor",
    "rename",
    "module",
    "function",
    "struct",
    "trait",
    "async",
    "await",
    "mutex",
    "deadlock",
    "allocation",
    "buffer",
    "overflow",
    "bounds",
];
const DIRS: &[&str] = &[
    "src/api",
    "src/core",
    "src/store",
    "src/net",
    "tests",
    "lib/util",
];
const FILES: &[&str] = &[
    "handler", "config", "state", "client", "parser", "cache", "mod",
];
const TOOLS: &[&str] = &["read_file", "run_tests", "grep", "edit_file", "list_dir"];

/// About `bytes` of prose with paths, ids and numbers mixed in.
fn text(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 64);
    let mut in_line = 0;
    while s.len() < bytes {
        match rng.below(20) {
            0 => s.push_str(&format!(
                "{}/{}_{}.rs:{}",
                rng.pick(DIRS),
                rng.pick(FILES),
                rng.below(40),
                rng.below(900) + 1
            )),
            1 => s.push_str(&format!("req-{:08x}", rng.next() as u32)),
            2 => s.push_str(&format!("{}", rng.below(100_000))),
            _ => s.push_str(rng.pick(WORDS)),
        }
        in_line += 1;
        if in_line >= 14 && rng.below(3) == 0 {
            s.push_str(".\n");
            in_line = 0;
        } else {
            s.push(' ');
        }
    }
    s
}

/// Lines as a tool would print them: a listing, test output or a file.
fn tool_output(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 80);
    while s.len() < bytes {
        match rng.below(3) {
            0 => s.push_str(&format!(
                "{}/{}_{}.rs:{}: {}\n",
                rng.pick(DIRS),
                rng.pick(FILES),
                rng.below(40),
                rng.below(900) + 1,
                text(rng, 60).trim_end()
            )),
            1 => s.push_str(&format!(
                "test {}::{}_{} ... {}\n",
                rng.pick(FILES),
                rng.pick(WORDS),
                rng.below(99),
                if rng.below(8) == 0 { "FAILED" } else { "ok" }
            )),
            _ => s.push_str(&format!(
                "    let {}_{} = {}({});\n",
                rng.pick(WORDS),
                rng.below(9),
                rng.pick(FILES),
                rng.below(1000)
            )),
        }
    }
    s
}

/// Turn `t` of conversation `c` as a chat message.
fn message(rng: &mut Rng, f: &Fleet, c: usize, t: usize) -> serde_json::Value {
    let b = f.turn_bytes;
    let call_id = |t: usize| format!("call_{c:05}_{t:03}");
    match t % 6 {
        0 => json!({"role": "user", "content": text(rng, b)}),
        1 | 3 => {
            let tool = rng.pick(TOOLS);
            let args = json!({
                "path": format!("{}/{}_{}.rs", rng.pick(DIRS), rng.pick(FILES), rng.below(40)),
                "pattern": rng.pick(WORDS),
                "context": rng.below(20),
            });
            json!({
                "role": "assistant",
                "content": text(rng, b * 2 / 5),
                "tool_calls": [{
                    "id": call_id(t),
                    "type": "function",
                    "function": {"name": tool, "arguments": args.to_string()},
                }],
            })
        }
        2 | 4 => json!({
            "role": "tool",
            "tool_call_id": call_id(t - 1),
            "content": tool_output(rng, b * 8 / 5),
        }),
        _ => json!({"role": "assistant", "content": text(rng, b)}),
    }
}

/// Writes the fleet as events JSONL; returns its size in bytes.
fn write_fleet(f: &Fleet, path: &Path) -> Result<u64, String> {
    let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let mut rng = Rng::new(11);
    let mut time = START_MS;
    let mut next_conv = 0;
    // (conversation, next turn; None = model not declared yet)
    let mut active: Vec<(usize, Option<usize>)> = Vec::new();
    let mut bytes = 0u64;
    let mut emit = |line: String, out: &mut BufWriter<std::fs::File>| -> Result<(), String> {
        bytes += line.len() as u64 + 1;
        writeln!(out, "{line}").map_err(|e| format!("writing {}: {e}", path.display()))
    };
    loop {
        while active.len() < WINDOW && next_conv < f.conversations {
            active.push((next_conv, None));
            next_conv += 1;
        }
        if active.is_empty() {
            break;
        }
        let slot = rng.below(active.len() as u64) as usize;
        let (c, next) = active[slot];
        let key = Fleet::key(c);
        time += 20 + rng.below(3000);
        let Some(mut t) = next else {
            let e = json!({
                "id": format!("{key}:model"), "conversation": key, "version": 1, "time": time,
                "type": "model_declared",
                "payload": {"model": "gpt-4o", "context_window": f.window},
            });
            emit(e.to_string(), &mut out)?;
            active[slot].1 = Some(0);
            continue;
        };
        let mut burst = 1 + rng.below(4) as usize;
        while burst > 0 && t < f.turns {
            let e = json!({
                "id": format!("{key}:{t}"), "conversation": key, "version": 1, "time": time,
                "type": "turn_appended",
                "payload": {"message": message(&mut rng, f, c, t), "model": "gpt-4o", "sender": "fleet"},
            });
            emit(e.to_string(), &mut out)?;
            time += 1 + rng.below(400);
            // A tool call goes out with its result.
            if !(t % 6 == 1 || t % 6 == 3) {
                burst -= 1;
            }
            t += 1;
        }
        if t >= f.turns {
            active.swap_remove(slot);
        } else {
            active[slot].1 = Some(t);
        }
    }
    out.flush()
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(bytes)
}

/// A one-conversation input for the fixed-cost baseline.
fn write_tiny(path: &Path) -> Result<(), String> {
    let f = Fleet {
        conversations: 1,
        turns: 4,
        turn_bytes: 400,
        window: 128_000,
    };
    let mut rng = Rng::new(7);
    let mut s = String::new();
    for t in 0..f.turns {
        let e = json!({
            "id": format!("tiny:{t}"), "conversation": "tiny", "version": 1,
            "time": START_MS + t as u64 * 1000, "type": "turn_appended",
            "payload": {"message": message(&mut rng, &f, 0, t)},
        });
        s.push_str(&e.to_string());
        s.push('\n');
    }
    std::fs::write(path, s).map_err(|e| format!("{}: {e}", path.display()))
}

/// `bin ARGS --data DATA`, measured; a failure is an error naming its log.
fn run_one(
    bin: &Bin,
    data: &Path,
    args: &[&str],
    logs: &Path,
    name: &str,
) -> Result<Measured, String> {
    let mut cmd = procs::command(bin);
    cmd.args(args).arg("--data").arg(data);
    let out = logs.join(format!("{}-{name}.out", bin.label));
    let err = logs.join(format!("{}-{name}.err", bin.label));
    let m = procs::measure(cmd, Some(&out), Some(&err))?;
    if !m.success {
        let tail = std::fs::read_to_string(&err).unwrap_or_default();
        let lines: Vec<&str> = tail.lines().collect();
        let last = &lines[lines.len().saturating_sub(8)..];
        return Err(format!(
            "{} {} failed: {}",
            bin.label,
            args.join(" "),
            last.join("\n")
        ));
    }
    Ok(m)
}

/// Runs `args` `n` times; (walls, peak RSSs).
fn repeat(
    bin: &Bin,
    data: &Path,
    args: &[&str],
    logs: &Path,
    name: &str,
    n: usize,
) -> Result<(Vec<Duration>, Vec<u64>), String> {
    let mut walls = Vec::new();
    let mut rss = Vec::new();
    for _ in 0..n {
        let m = run_one(bin, data, args, logs, name)?;
        walls.push(m.wall);
        rss.push(m.peak_rss);
    }
    Ok((walls, rss))
}

fn bench() -> Result<(), String> {
    let bins = procs::bins()?;
    let scale = procs::env_f64("CONTEXTFOLD_FLEET_SCALE", 1.0)?;
    let conversations = procs::env_u64("CONTEXTFOLD_FLEET_CONVERSATIONS", 2000)?;
    let fleet = Fleet {
        conversations: ((conversations as f64 * scale).round() as usize).max(1),
        turns: procs::env_u64("CONTEXTFOLD_FLEET_TURNS", 100)?.max(1) as usize,
        turn_bytes: procs::env_u64("CONTEXTFOLD_FLEET_TURN_BYTES", 1800)?.max(50) as usize,
        window: procs::env_u64("CONTEXTFOLD_FLEET_WINDOW", 32_000)?.max(1000),
    };
    let repeats = procs::env_u64("CONTEXTFOLD_FLEET_REPEATS", 3)?.max(1) as usize;
    let keep = std::env::var_os("CONTEXTFOLD_FLEET_KEEP").is_some();
    let dir = procs::scratch("cf-fleet-")?;
    let root: PathBuf = dir.path().to_path_buf();
    let turns = fleet.conversations * fleet.turns;
    // Input, plus one binary's log and store at a time (the issue measured
    // 887 MB for 360 MB of text), with room to spare.
    let est_input = (turns * (fleet.turn_bytes + 320)) as u64;
    let need = est_input + est_input * 3 + (256 << 20);
    procs::require_free(&root, need, "the fleet and one binary's data directory")?;

    println!(
        "fleet_memory: {} conversations x {} turns = {turns} turns (~{} B of text each), {} events",
        fleet.conversations,
        fleet.turns,
        fleet.turn_bytes,
        fleet.events()
    );
    for b in &bins {
        println!(
            "  {:<8} {}  ({})",
            b.label,
            b.path.display(),
            procs::version(b)
        );
    }
    println!(
        "  scratch  {}{}",
        root.display(),
        if keep { " (kept)" } else { "" }
    );

    let input = root.join("fleet.jsonl");
    let t0 = std::time::Instant::now();
    let input_bytes = write_fleet(&fleet, &input)?;
    println!(
        "  input    {} in {} ({} written in {})",
        input.display(),
        procs::mib(input_bytes),
        fleet.events(),
        procs::secs(t0.elapsed())
    );
    let tiny = root.join("tiny.jsonl");
    write_tiny(&tiny)?;
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;

    let probe = fleet.probe();
    let mut table = Table::new(bins.iter().map(|b| b.label.clone()));
    for (col, bin) in bins.iter().enumerate() {
        eprintln!("[{}] run over the fleet ...", bin.label);
        let data = root.join(format!("data-{}", bin.label));
        let input_arg = input.display().to_string();
        let m = run_one(bin, &data, &["run", &input_arg], &logs, "run")?;
        let events_per_s = fleet.events() as f64 / m.wall.as_secs_f64().max(1e-9);
        table.set("run: peak RSS", col, procs::mib(m.peak_rss));
        table.set(
            "run: peak RSS per turn",
            col,
            format!("{:.0} B", m.peak_rss as f64 / turns as f64),
        );
        table.set("run: wall", col, procs::secs(m.wall));
        table.set("run: user + sys CPU", col, procs::secs(m.user + m.sys));
        table.set("run: events/s", col, format!("{events_per_s:.0}"));

        eprintln!("[{}] cold status / assemble of {probe} ...", bin.label);
        let (w, r) = repeat(bin, &data, &["status", &probe], &logs, "status", repeats)?;
        table.set(
            &format!("status {probe}: wall min/med"),
            col,
            procs::min_median(&w),
        );
        table.set(
            &format!("status {probe}: RSS min/med"),
            col,
            procs::min_median_bytes(&r),
        );
        let (w, r) = repeat(
            bin,
            &data,
            &["assemble", &probe, "--budget", "8000"],
            &logs,
            "assemble",
            repeats,
        )?;
        table.set(
            &format!("assemble {probe} 8000: wall min/med"),
            col,
            procs::min_median(&w),
        );
        table.set(
            &format!("assemble {probe} 8000: RSS min/med"),
            col,
            procs::min_median_bytes(&r),
        );
        let assembled = std::fs::read_to_string(logs.join(format!("{}-assemble.out", bin.label)))
            .unwrap_or_default();
        table.set(
            "assemble output",
            col,
            format!("{} lines", assembled.lines().count()),
        );

        table.set(
            "disk: state store",
            col,
            procs::mib(procs::disk_usage(&data.join("state.redb"))),
        );
        table.set(
            "disk: log",
            col,
            procs::mib(procs::disk_usage(&data.join("log"))),
        );
        table.set("disk: data dir", col, procs::mib(procs::disk_usage(&data)));

        eprintln!("[{}] fixed costs ...", bin.label);
        let tiny_data = root.join(format!("tiny-{}", bin.label));
        let tiny_arg = tiny.display().to_string();
        run_one(bin, &tiny_data, &["run", &tiny_arg], &logs, "tiny-run")?;
        let (w, r) = repeat(bin, &tiny_data, &["--version"], &logs, "version", repeats)?;
        table.set("base --version: wall min/med", col, procs::min_median(&w));
        table.set(
            "base --version: RSS min/med",
            col,
            procs::min_median_bytes(&r),
        );
        let (w, r) = repeat(
            bin,
            &tiny_data,
            &["status", "tiny"],
            &logs,
            "tiny-status",
            repeats,
        )?;
        table.set(
            "base status (1 conv store): wall",
            col,
            procs::min_median(&w),
        );
        table.set(
            "base status (1 conv store): RSS",
            col,
            procs::min_median_bytes(&r),
        );
        let (w, r) = repeat(
            bin,
            &tiny_data,
            &["assemble", "tiny", "--budget", "8000"],
            &logs,
            "tiny-assemble",
            repeats,
        )?;
        table.set("base assemble (1 conv): wall", col, procs::min_median(&w));
        table.set(
            "base assemble (1 conv): RSS",
            col,
            procs::min_median_bytes(&r),
        );
        let (w, r) = repeat(
            bin,
            &tiny_data,
            &[
                "assemble",
                "tiny",
                "--budget",
                "8000",
                "--prompt",
                "count me: this loads the tokenizer",
            ],
            &logs,
            "tiny-assemble-prompt",
            repeats,
        )?;
        table.set(
            "base assemble --prompt (tokenizer)",
            col,
            procs::min_median(&w),
        );
        table.set(
            "base assemble --prompt: RSS",
            col,
            procs::min_median_bytes(&r),
        );
        if !keep {
            let _ = std::fs::remove_dir_all(&data);
            let _ = std::fs::remove_dir_all(&tiny_data);
        }
    }
    println!();
    println!("{turns} turns, {} events, input {} (wall/RSS cells: min / median of {repeats} cold processes)", fleet.events(), procs::mib(input_bytes));
    print!("{}", table.render());
    if keep {
        let kept = dir.keep();
        println!("kept {}", kept.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; nothing else is taken.
    match bench() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fleet_memory: {e}");
            ExitCode::FAILURE
        }
    }
}
