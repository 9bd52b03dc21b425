//! A fuzz-style run of intake and the fold (issue 10): N generated inputs
//! (default 1,000,000; `CONTEXTFOLD_BENCH_FUZZ_N`) through
//! `Engine::apply_batch` on a `MemoryBackend` store, committed every
//! [`COMMIT_EVERY`] records so the store path runs too. Not a timed test:
//! it reports what became of every input, and fails on a panic.
//!
//! # Inputs
//!
//! Seeded and deterministic (`CONTEXTFOLD_BENCH_FUZZ_SEED`, default
//! [`DEFAULT_SEED`]; a hand-written splitmix64, no dependency), in batches
//! of 1 to 1,023 records:
//! - `session`: realistic per-conversation sequences (a model declared with
//!   a small window, user, system and assistant turns, tool calls with and
//!   without results, orphan results, duplicate long user turns, replay
//!   floods, overflow and other provider errors, compaction requests,
//!   resets), as an agent on its own subject, an embedded log or a legacy
//!   one would deliver them;
//! - `result`: every job the engine hands out, swept right here with the
//!   core's steps and its deterministic summarizer (some drafts passed off
//!   as a model's, so re-summarization happens), published later as the
//!   service: summaries, rolling states and sweep ends that meet real
//!   state, some of them stale by then; `result_mutant`: the same with a
//!   field changed (content without its address, depth 0 condensations of
//!   real summaries, shifted covers, huge spend, forged by an agent, sent
//!   to another conversation);
//! - `echo`: decisions the engine returned, appended back as the runtimes
//!   do (duplicates by id);
//! - `event`: every agent and service event type with random fields, ids
//!   and keys at and past the limits, empty, unicode, `~`, `.`, `*`, `>`,
//!   times 0, `u64::MAX`, just within and past the stored time's slack;
//! - `mutant`: encodings of such events truncated, with bytes flipped,
//!   inserted, deleted, repeated or set to telling values (MessagePack
//!   32-bit length headers), or spliced with another encoding;
//! - `json_edit`: decoded-value edits: fields removed or of another type,
//!   wrong versions and times, another `type` for the payload, unknown
//!   fields, payload before type, duplicate keys, deeply nested garbage,
//!   positional MessagePack;
//! - `bytes`: pure random byte strings;
//! - `replay`: an earlier input again (maybe under another origin or
//!   address), or its id with another body.
//!
//! Each record gets a random origin ([`Origin`]) and address
//! ([`Address`]): the body's conversation, another one, none, or an
//! unroutable subject, with a stored time that is absent, near the event's
//! time, 0, `u64::MAX` or random.
//!
//! # What it checks and prints
//!
//! The engine runs on a thread with a 2 MiB stack, what a tokio worker
//! (the NATS folder) has: input nested deep enough to overflow it would
//! abort the run, which is itself a finding. Each batch runs under
//! `catch_unwind`: a panic is counted, the record that caused it (the
//! engine's position names it) is written with the seed and the panic to
//! `<target>/tmp/intake_fuzz/`, the engine is reopened from its last
//! commit and the batch is folded again without that record.
//!
//! The bench runs intake itself on each folded record (pure, so the same
//! answer) to count refusals by [`Refusal::kind`] and to tell the
//! `event_rejected` decisions of refusals from those of the fold; the
//! engine's own metrics (a recorder installed here) give what the fold did
//! with what intake admitted. Both must agree, dead letters must match the
//! refusals without a conversation, and the store, reopened at the end,
//! must give the state hash the engine has. It prints a progress line
//! every 100,000 inputs (stderr), then inputs by family, admitted,
//! folded, duplicates, ignored, refusals by kind (with their details),
//! fold rejections grouped by a normalized reason, decisions by type,
//! dead letters, the state reached, panics, wall time and inputs/s. It
//! exits non-zero on a panic or a failed check.
//!
//! Run: `cargo bench --bench intake_fuzz`. With overflow checks (a debug
//! build), fewer inputs: `CONTEXTFOLD_BENCH_FUZZ_N=100000 cargo test
//! --bench intake_fuzz`.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::{
    CompactionRequested, ConversationReset, Covers, DebtCleared, DebtReason, DecodeError, Encoding,
    Envelope, EventBody, EventRejected, JobIssued, MemoryFlushRequested, ModelDeclared, Origin,
    ProviderErrorObserved, ProviderUsage, RollingState, RollingStateUpdated, SummaryKind,
    SummaryRecorded, SummaryRejected, SweepEnded, SweepStop, TurnAppended,
};
use contextfold::core::fallback_summary;
use contextfold::core::glob::SessionGlob;
use contextfold::core::intake::{self, limits, Address, Refusal};
use contextfold::core::message::{ChatMessage, Content, ContentPart, FunctionCall, Role, ToolCall};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::summary_id;
use contextfold::core::sweep::{summary_event, Pass, SweepSnapshot};
use contextfold::log::{LogRecord, Position};
use contextfold::runtime::engine::{Effects, Engine};
use contextfold::store::memory_backend::MemoryBackend;
use contextfold::telemetry as m;
use metrics::{Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The seed when `CONTEXTFOLD_BENCH_FUZZ_SEED` is not set.
const DEFAULT_SEED: u64 = 0x00c0_ffee_f01d_0010;
/// Records between commits.
const COMMIT_EVERY: u64 = 4096;
/// Realistic conversations in flight at once.
const SESSIONS: usize = 24;
/// Earlier inputs kept for replays and splices.
const RECENT: usize = 512;
/// Refusal details printed (the most frequent).
const TOP: usize = 30;
/// A tokio worker's default stack.
const STACK_BYTES: usize = 2 << 20;
/// The clock the generated events start at (2023-11-14).
const EPOCH_MS: u64 = 1_700_000_000_000;

fn main() {
    let n = env_u64("CONTEXTFOLD_BENCH_FUZZ_N", 1_000_000);
    let seed = env_u64("CONTEXTFOLD_BENCH_FUZZ_SEED", DEFAULT_SEED);
    let run = std::thread::Builder::new()
        .name("intake_fuzz".into())
        .stack_size(STACK_BYTES)
        .spawn(move || run(n, seed));
    let ok = match run.map(|h| h.join()) {
        Ok(Ok(ok)) => ok,
        Ok(Err(_)) => {
            eprintln!("intake_fuzz: the harness itself panicked (see above)");
            false
        }
        Err(e) => {
            eprintln!("intake_fuzz: cannot start the fuzz thread: {e}");
            false
        }
    };
    if !ok {
        std::process::exit(1);
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            match parsed {
                Ok(n) => n,
                Err(_) => {
                    eprintln!("intake_fuzz: {name}={v:?} is not a number; using {default}");
                    default
                }
            }
        }
        Err(_) => default,
    }
}

/// The policy of the run: the tests' small one (a 6,000-token window, small
/// chunks, so a few dozen turns compact), and one ignored session glob.
fn policy() -> PolicyConfig {
    PolicyConfig {
        ignore_sessions: SessionGlob::parse("fuzz:ignored:*").into_iter().collect(),
        ..contextfold::testing::small_policy()
    }
}

// ---------------------------------------------------------------------------
// The run

fn run(n: u64, seed: u64) -> bool {
    let counters = Counters::default();
    let _recorder = metrics::set_default_local_recorder(&counters);
    panic::set_hook(Box::new(|info| {
        if let Ok(mut s) = LAST_PANIC.lock() {
            *s = Some(info.to_string());
        }
    }));
    let policy = policy();
    let mut engine = match Engine::open(MemoryBackend::default(), policy.clone()) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("intake_fuzz: cannot open the engine: {e}");
            return false;
        }
    };
    let mut gen = Generator::new(seed);
    let mut tally = Tally::default();
    let mut position: Position = 0;
    // The batches folded since the last commit, to fold again on a panic.
    let mut since_commit: Vec<Vec<LogRecord>> = Vec::new();
    let mut uncommitted = 0u64;
    let mut batches = 0u64;
    let started = Instant::now();
    let mut next_progress = 100_000;
    eprintln!(
        "intake_fuzz: seed {seed:#x}, {n} inputs, commit every {COMMIT_EVERY} records, \
         {} KiB stack",
        STACK_BYTES >> 10
    );
    while tally.inputs < n {
        let want = gen.rng.range(1, 1024).min(n - tally.inputs);
        let batch: Vec<(Input, LogRecord)> = (0..want)
            .map(|_| {
                let input = gen.next();
                position += 1;
                let record = input.record(position);
                (input, record)
            })
            .collect();
        tally.inputs += want;
        batches += 1;
        let records: Vec<LogRecord> = batch.iter().map(|(_, r)| r.clone()).collect();
        let (effects, folded) = match guarded(|| {
            engine
                .apply_batch(records.clone())
                .expect("a memory store never fails")
        }) {
            Ok(effects) => (effects, vec![records]),
            Err(message) => {
                match diagnose(seed, &mut engine, &policy, &since_commit, batch, message) {
                    Ok((effects, folded, panics)) => {
                        tally.panics += panics;
                        (effects, folded)
                    }
                    Err(e) => {
                        eprintln!("intake_fuzz: cannot recover from a panic: {e}");
                        return false;
                    }
                }
            }
        };
        let applied: Vec<&LogRecord> = folded.iter().flatten().collect();
        tally.count(&applied, &effects);
        gen.feed(&effects);
        uncommitted += applied.len() as u64;
        since_commit.extend(folded);
        if uncommitted >= COMMIT_EVERY {
            commit(&mut engine, &mut tally);
            uncommitted = 0;
            since_commit.clear();
        }
        if tally.inputs >= next_progress {
            next_progress += 100_000;
            let secs = started.elapsed().as_secs_f64();
            eprintln!(
                "intake_fuzz: {}/{n} inputs, {secs:.1} s, {:.0} inputs/s, admitted {}, \
                 conversations {}, panics {}",
                tally.inputs,
                tally.inputs as f64 / secs.max(1e-9),
                tally.admitted,
                engine.state.conversations.len(),
                tally.panics
            );
        }
    }
    commit(&mut engine, &mut tally);
    let wall = started.elapsed().as_secs_f64();
    let reload = reopen(&engine, &policy, &[]).map(|e| (e.state.hash(), e.position()));
    let hash = engine.state.hash();
    let report = Report {
        seed,
        batches,
        wall,
        tally: &tally,
        counters: &counters,
        engine: &engine,
        hash: &hash,
        reload,
        families: &gen.families,
        jobs_by_reason: &gen.jobs_by_reason,
    };
    report.print()
}

/// What the panic hook saw last (its message has the location).
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Runs `f`, turning a panic into its message.
fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let hook = LAST_PANIC.lock().ok().and_then(|mut s| s.take());
        hook.or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

/// After `batch` panicked: reopens the engine as it was before the batch
/// and folds the batch again one record at a time, to find the records
/// that panic alone (each reported, then left out). Returns the effects,
/// the batches folded, and how many panics to count (at least the one).
fn diagnose(
    seed: u64,
    engine: &mut Engine<MemoryBackend>,
    policy: &PolicyConfig,
    since_commit: &[Vec<LogRecord>],
    batch: Vec<(Input, LogRecord)>,
    message: String,
) -> Result<(Effects, Vec<Vec<LogRecord>>, u64), String> {
    *engine = reopen(engine, policy, since_commit)?;
    let mut effects = Effects::default();
    let mut folded: Vec<Vec<LogRecord>> = Vec::new();
    let mut culprits = 0;
    let first = batch.first().map_or(0, |(_, r)| r.position);
    let last = batch.last().map_or(0, |(_, r)| r.position);
    for (input, record) in batch {
        match guarded(|| {
            engine
                .apply_batch([record.clone()])
                .expect("a memory store never fails")
        }) {
            Ok(e) => {
                effects.decisions.extend(e.decisions);
                effects.jobs.extend(e.jobs);
                effects.dead_letters.extend(e.dead_letters);
                folded.push(vec![record]);
            }
            Err(message) => {
                culprits += 1;
                report_panic(seed, &input, &record, &message);
                let replay: Vec<Vec<LogRecord>> =
                    since_commit.iter().chain(&folded).cloned().collect();
                *engine = reopen(engine, policy, &replay)?;
            }
        }
    }
    if culprits == 0 {
        eprintln!(
            "intake_fuzz: PANIC in the batch of positions {first}..={last} that no record \
             of it causes alone: {message}"
        );
    }
    Ok((effects, folded, culprits.max(1)))
}

/// An engine on a copy of `engine`'s store as last committed, with
/// `replay` (the batches folded since) folded again.
fn reopen(
    engine: &Engine<MemoryBackend>,
    policy: &PolicyConfig,
    replay: &[Vec<LogRecord>],
) -> Result<Engine<MemoryBackend>, String> {
    let backend = engine.store().backend().clone();
    let mut fresh = Engine::open(backend, policy.clone()).map_err(|e| e.to_string())?;
    for batch in replay {
        let batch = batch.clone();
        guarded(|| fresh.apply_batch(batch))
            .map_err(|m| format!("replay panicked: {m}"))?
            .map_err(|e| e.to_string())?;
    }
    Ok(fresh)
}

fn commit(engine: &mut Engine<MemoryBackend>, tally: &mut Tally) {
    match guarded(|| engine.commit()) {
        Ok(Ok(())) => tally.commits += 1,
        Ok(Err(e)) => {
            tally.store_errors += 1;
            eprintln!(
                "intake_fuzz: commit failed at position {}: {e}",
                engine.position()
            );
        }
        Err(message) => {
            tally.panics += 1;
            eprintln!(
                "intake_fuzz: PANIC in commit at position {}: {message}",
                engine.position()
            );
        }
    }
}

/// Writes the record that panicked, with the seed, where it can be rerun.
fn report_panic(seed: u64, input: &Input, record: &LogRecord, message: &str) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("intake_fuzz");
    let stem = format!("panic-{seed:x}-{}", record.position);
    let mut text = String::new();
    let _ = writeln!(text, "seed: {seed:#x}");
    let _ = writeln!(text, "position: {}", record.position);
    let _ = writeln!(text, "family: {}", input.family);
    let _ = writeln!(text, "origin: {:?}", record.origin);
    let _ = writeln!(text, "address: {:?}", record.address);
    let _ = writeln!(text, "stored_at_ms: {:?}", record.stored_at_ms);
    let _ = writeln!(text, "encoding: {}", record.encoding);
    let _ = writeln!(text, "panic: {message}");
    let _ = writeln!(
        text,
        "bytes ({}): {}",
        record.bytes.len(),
        hex(&record.bytes)
    );
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(format!("{stem}.txt")), &text))
        .and_then(|()| std::fs::write(dir.join(format!("{stem}.bin")), &record.bytes));
    let place = match written {
        Ok(()) => dir.join(format!("{stem}.txt")).display().to_string(),
        Err(e) => format!("(not written: {e})"),
    };
    eprintln!(
        "intake_fuzz: PANIC at position {} ({} input): {message}; written to {place}",
        record.position, input.family
    );
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

// ---------------------------------------------------------------------------
// Counting

#[derive(Default)]
struct Tally {
    inputs: u64,
    admitted: u64,
    refused: BTreeMap<&'static str, u64>,
    refusal_details: BTreeMap<String, u64>,
    dead_letters: u64,
    /// Refusals intake attributes to no conversation: each one a dead letter.
    unattributed: u64,
    fold_rejections: BTreeMap<String, u64>,
    decisions: BTreeMap<&'static str, u64>,
    /// Refusal decisions the bench expected and did not find.
    missing_refusals: u64,
    commits: u64,
    store_errors: u64,
    panics: u64,
}

impl Tally {
    /// Counts a folded batch: intake's answer for each record, and what the
    /// decisions say of the rest.
    fn count(&mut self, records: &[&LogRecord], effects: &Effects) {
        // The reasons of the refusals recorded in conversations: their
        // `event_rejected` decisions are intake's, the others the fold's.
        let mut refusal_reasons: HashMap<String, u64> = HashMap::new();
        for record in records {
            match intake::admit(record.arrival()) {
                Ok(_) => self.admitted += 1,
                Err(refused) => {
                    let kind = refused.refusal.kind();
                    *self.refused.entry(kind).or_default() += 1;
                    *self
                        .refusal_details
                        .entry(refusal_detail(&refused.refusal))
                        .or_default() += 1;
                    match refused.conversation {
                        Some(_) => *refusal_reasons.entry(refused.to_string()).or_default() += 1,
                        None => self.unattributed += 1,
                    }
                }
            }
        }
        self.dead_letters += effects.dead_letters.len() as u64;
        for d in &effects.decisions {
            *self.decisions.entry(d.type_name()).or_default() += 1;
            let reason = match &d.body {
                EventBody::EventRejected(r) => {
                    if let Some(left) = refusal_reasons.get_mut(&r.reason).filter(|n| **n > 0) {
                        *left -= 1;
                        continue;
                    }
                    format!(
                        "{}: {}",
                        r.event_type.as_deref().unwrap_or("?"),
                        normalize(&r.reason)
                    )
                }
                EventBody::SummaryRejected(r) => {
                    format!("summary_recorded: {}", normalize(&r.reason))
                }
                _ => continue,
            };
            *self.fold_rejections.entry(reason).or_default() += 1;
        }
        self.missing_refusals += refusal_reasons.values().sum::<u64>();
    }
}

/// A refusal's kind with what varies within it (the decode error's kind,
/// the field), without the values.
fn refusal_detail(refusal: &Refusal) -> String {
    match refusal {
        Refusal::Undecodable(e) => match e {
            DecodeError::Oversized { .. } => "undecodable: oversized".into(),
            DecodeError::Malformed { encoding, detail } => {
                // The error's first phrase: "invalid type", "missing field
                // `id`", "EOF while parsing a value", "depth limit exceeded".
                let phrase = detail.split([':', ',']).next().unwrap_or("");
                let phrase = phrase.split(" at line").next().unwrap_or("");
                format!("undecodable: malformed {encoding}: {}", normalize(phrase))
            }
            DecodeError::UnsupportedVersion { .. } => "undecodable: newer version".into(),
            DecodeError::Empty { field } => format!("undecodable: empty {field}"),
        },
        Refusal::TooLong { field, .. } => format!("too_long: {field}"),
        Refusal::NotAnAgentEvent { event_type } => format!("not_an_agent_event: {event_type}"),
        other => other.kind().to_string(),
    }
}

/// Fold rejections that name a summary without quoting it, and their group.
const KNOWN_REASONS: &[(&str, &str)] = &[
    (
        "cannot supersede",
        "a fallback summary cannot supersede <id>: only a model summary replaces a fallback",
    ),
    (
        "supersedes unknown summary",
        "supersedes unknown summary <id>",
    ),
    (
        "which is not a deterministic fallback",
        "supersedes <id>, which is not a deterministic fallback summary",
    ),
    (
        "does not cover exactly what",
        "does not cover exactly what <id> covers",
    ),
    ("covers unknown summary", "covers unknown summary <id>"),
    ("expected", "child <id> has depth N, expected N"),
    (
        "is already condensed",
        "stale: summary <id> is already condensed",
    ),
    (
        "is no longer in context",
        "stale: <id> is no longer in context",
    ),
];

/// A reason without what varies between instances: the group of a known
/// phrase, or the text with quotes as `"…"`, words with digits as `N` and
/// ids as `<id>`, cut at a parenthesis and at 90 characters.
fn normalize(reason: &str) -> String {
    if let Some((_, group)) = KNOWN_REASONS.iter().find(|(needle, _)| {
        reason.contains(needle) && (*needle != "expected" || reason.starts_with("child "))
    }) {
        return group.to_string();
    }
    let mut unquoted = String::with_capacity(reason.len());
    let mut chars = reason.chars();
    while let Some(c) = chars.next() {
        if c == '"' || c == '`' {
            unquoted.push_str("\"…\"");
            let mut escaped = false;
            for q in chars.by_ref() {
                if escaped {
                    escaped = false;
                } else if q == '\\' {
                    escaped = true;
                } else if q == c {
                    break;
                }
            }
        } else {
            unquoted.push(c);
        }
    }
    let head = unquoted.split(" (").next().unwrap_or("");
    let words: Vec<String> = head
        .split_whitespace()
        .map(|w| {
            let bare = w.trim_matches(|c: char| !c.is_alphanumeric() && c != '_');
            if bare.starts_with("sum_")
                || bare.starts_with("d_")
                || bare.starts_with("undecodable_")
            {
                "<id>".into()
            } else if w.chars().any(|c| c.is_ascii_digit()) {
                "N".into()
            } else {
                w.to_string()
            }
        })
        .collect();
    let mut out = words.join(" ");
    if out.chars().count() > 90 {
        out = out.chars().take(89).collect::<String>() + "…";
    }
    out
}

/// A metrics recorder that counts counters by name and `kind` label.
#[derive(Default)]
struct Counters {
    counts: Mutex<BTreeMap<String, Arc<Count>>>,
}

#[derive(Default)]
struct Count(AtomicU64);

impl CounterFn for Count {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::Relaxed);
    }
}

impl Counters {
    fn name(key: &Key) -> String {
        let mut name = key.name().to_string();
        for label in key.labels() {
            let _ = write!(name, ",{}={}", label.key(), label.value());
        }
        name
    }
    /// A counter with `kind` as its label, or (`None`) summed over all its
    /// labels (`origin` of duplicates, say).
    fn get(&self, name: &str, kind: Option<&str>) -> u64 {
        let Ok(counts) = self.counts.lock() else {
            return 0;
        };
        match kind {
            Some(kind) => counts
                .get(&format!("{name},kind={kind}"))
                .map_or(0, |c| c.0.load(Ordering::Relaxed)),
            None => counts
                .iter()
                .filter(|(k, _)| {
                    k.as_str() == name || k.strip_prefix(name).is_some_and(|r| r.starts_with(','))
                })
                .map(|(_, c)| c.0.load(Ordering::Relaxed))
                .sum(),
        }
    }
}

impl metrics::Recorder for Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let Ok(mut counts) = self.counts.lock() else {
            return Counter::noop();
        };
        let count = counts.entry(Self::name(key)).or_default();
        Counter::from_arc(Arc::clone(count))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

struct Report<'a> {
    seed: u64,
    batches: u64,
    wall: f64,
    tally: &'a Tally,
    counters: &'a Counters,
    engine: &'a Engine<MemoryBackend>,
    hash: &'a str,
    reload: Result<(String, Position), String>,
    families: &'a BTreeMap<&'static str, u64>,
    jobs_by_reason: &'a BTreeMap<String, u64>,
}

impl Report<'_> {
    /// Prints the report; returns whether every check passed.
    fn print(&self) -> bool {
        let t = self.tally;
        let c = |name: &str, kind: Option<&str>| self.counters.get(name, kind);
        let pct = |n: u64| 100.0 * n as f64 / t.inputs.max(1) as f64;
        let folded = c(m::EVENTS_FOLDED, None);
        let duplicates = c(m::EVENTS_DUPLICATE, None);
        let ignored = c(m::EVENTS_IGNORED, None);
        let fold_rejected = c(m::EVENTS_REJECTED, Some("fold"));
        let refused: u64 = t.refused.values().sum();
        let fold_reasons: u64 = t.fold_rejections.values().sum();
        println!(
            "intake_fuzz: seed {:#x}, {} inputs in {} batches, {} commits",
            self.seed, t.inputs, self.batches, t.commits
        );
        let mix: Vec<String> = self
            .families
            .iter()
            .map(|(f, n)| format!("{f} {n}"))
            .collect();
        println!("  inputs by family: {}", mix.join(", "));
        println!(
            "  admitted {} ({:.1}%): folded {folded}, duplicates {duplicates}, ignored {ignored}, \
             rejected by the fold {fold_rejected}",
            t.admitted,
            pct(t.admitted)
        );
        println!("  refused by intake {refused} ({:.1}%):", pct(refused));
        for (kind, n) in &t.refused {
            println!("    {n:>9}  {kind}");
        }
        let details = sorted(&t.refusal_details);
        println!(
            "  refusal details (the {} most frequent):",
            details.len().min(TOP)
        );
        for (detail, n) in details.iter().take(TOP) {
            println!("    {n:>9}  {detail}");
        }
        if details.len() > TOP {
            let rest: u64 = details[TOP..].iter().map(|(_, n)| **n).sum();
            println!("    {rest:>9}  ({} rarer details)", details.len() - TOP);
        }
        println!(
            "  dead letters {} (refusals with no conversation to count them against)",
            t.dead_letters
        );
        println!("  fold rejections by reason ({fold_reasons}):");
        for (reason, n) in sorted(&t.fold_rejections) {
            println!("    {n:>9}  {reason}");
        }
        let decisions: Vec<String> = t
            .decisions
            .iter()
            .map(|(d, n)| format!("{d} {n}"))
            .collect();
        println!("  decisions: {}", decisions.join(", "));
        let state = &self.engine.state;
        let turns: usize = state.conversations.values().map(|c| c.turns.len()).sum();
        let summaries: usize = state
            .conversations
            .values()
            .map(|c| c.summaries.len())
            .sum();
        let fallbacks: usize = state
            .conversations
            .values()
            .flat_map(|c| &c.summaries)
            .filter(|s| s.fallback)
            .count();
        let resummaries: usize = state
            .conversations
            .values()
            .flat_map(|c| &c.summaries)
            .filter(|s| s.supersedes.is_some())
            .count();
        let rolling = state
            .conversations
            .values()
            .filter(|c| c.rolling.is_some())
            .count();
        println!(
            "  state: {} conversations, {turns} turns, {summaries} summaries accepted \
             ({fallbacks} fallback, {resummaries} re-summarizations), {rolling} with a rolling \
             state, {} unattributed rejections; hash {}",
            state.conversations.len(),
            state.unattributed_rejections,
            self.hash
        );
        let jobs: Vec<String> = self
            .jobs_by_reason
            .iter()
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        println!(
            "  jobs swept here: {} ({})",
            self.jobs_by_reason.values().sum::<u64>(),
            jobs.join(", ")
        );
        let mut ok = true;
        let mut check = |what: String, pass: bool| {
            println!("  check: {what}: {}", if pass { "ok" } else { "FAILED" });
            ok &= pass;
        };
        // A recovery from a panic folds records again, and the engine's
        // metrics count them again: the checks against them would fail.
        let metrics_valid = t.panics == 0;
        let mut agree = t.missing_refusals == 0;
        for (kind, n) in &t.refused {
            agree &= c(m::EVENTS_REJECTED, Some(kind)) == *n;
        }
        let against_metrics = [
            (
                "refusals by kind agree with the engine's metrics".to_string(),
                agree,
            ),
            (
                format!(
                    "admitted = folded + duplicates + ignored + fold rejections ({})",
                    folded + duplicates + ignored + fold_rejected
                ),
                t.admitted == folded + duplicates + ignored + fold_rejected,
            ),
            (
                "each fold rejection has its decision".to_string(),
                fold_reasons == fold_rejected,
            ),
        ];
        for (what, pass) in against_metrics {
            if metrics_valid {
                check(what, pass);
            } else {
                println!("  check: {what}: skipped after a panic");
            }
        }
        check(
            format!(
                "dead letters = refusals without a conversation ({})",
                t.unattributed
            ),
            t.dead_letters == t.unattributed,
        );
        check(
            format!("store errors: {}", t.store_errors),
            t.store_errors == 0,
        );
        let reloaded = match &self.reload {
            Ok((hash, position)) => *hash == self.hash && *position == self.engine.position(),
            Err(e) => {
                println!("  store reload failed: {e}");
                false
            }
        };
        check(
            "the store reopens into the same state hash".into(),
            reloaded,
        );
        println!("  panics: {}", t.panics);
        println!(
            "  wall time {:.1} s, {:.0} inputs/s",
            self.wall,
            t.inputs as f64 / self.wall.max(1e-9)
        );
        ok && t.panics == 0
    }
}

/// Largest counts first.
fn sorted(map: &BTreeMap<String, u64>) -> Vec<(&String, &u64)> {
    let mut v: Vec<_> = map.iter().collect();
    v.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    v
}

// ---------------------------------------------------------------------------
// Generation

/// splitmix64: small, fast, and the same sequence on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    /// In `lo..hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo))
    }
    fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(1000) < percent * 10
    }
    /// One in `n`.
    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.index(items.len())]
    }
    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
    /// An index by weight.
    fn weighted(&mut self, weights: &[u64]) -> usize {
        let total: u64 = weights.iter().sum();
        let mut x = self.below(total);
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }
}

/// One generated record before the log gives it a position.
#[derive(Clone)]
struct Input {
    family: &'static str,
    origin: Origin,
    address: Address,
    stored_at_ms: Option<u64>,
    encoding: Encoding,
    bytes: Vec<u8>,
}

impl Input {
    fn record(&self, position: Position) -> LogRecord {
        LogRecord {
            position,
            origin: self.origin,
            address: self.address.clone(),
            stored_at_ms: self.stored_at_ms,
            encoding: self.encoding,
            bytes: self.bytes.clone().into(),
        }
    }
}

/// How a realistic conversation reaches the log.
#[derive(Clone, Copy)]
enum Delivery {
    /// An agent on its conversation's subject (JetStream stores a time).
    Subject,
    /// The embedded log: no subject, no stored time, the agent flag.
    Embedded,
    /// An embedded log written before origins were recorded.
    Legacy,
}

struct Session {
    key: String,
    delivery: Delivery,
    time: u64,
    left: u32,
    n: u64,
    open_calls: Vec<String>,
    last_user: Option<String>,
    /// Identical turns still to send within this second (a replay flood).
    flood: u32,
}

struct Generator {
    rng: Rng,
    clock: u64,
    count: u64,
    sessions: Vec<Session>,
    sessions_started: u64,
    /// Service results and echoes, by the input count they are released at.
    pending: BTreeMap<(u64, u64), Input>,
    recent_inputs: VecDeque<Input>,
    recent_events: VecDeque<Envelope>,
    /// Summary ids seen in results, for mutants that name real summaries.
    summary_ids: VecDeque<(String, String)>,
    keys: Vec<String>,
    families: BTreeMap<&'static str, u64>,
    jobs_swept: u64,
    jobs_by_reason: BTreeMap<String, u64>,
    /// Inputs queued so far (orders the queue within one release time).
    queued: u64,
}

const WORDS: &[&str] = &[
    "the",
    "build",
    "fails",
    "on",
    "src/main.rs",
    "because",
    "ERR_CONN_42",
    "please",
    "check",
    "config.toml",
    "and",
    "rerun",
    "tests",
    "with",
    "--release",
    "0xdeadbeef",
    "https://x.test/a",
    "deploy",
    "rollback",
    "user",
    "asked",
    "for",
    "/etc/app/key.pem",
    "v1.2.3",
    "ok",
    "done",
    "naïve",
    "café",
    "日本語",
    "テスト",
    "🙂",
    "Ω",
    "\u{202e}rtl",
    "tab\there",
    "line\nbreak",
    "quote\"d",
    "back\\slash",
    "<relevant-memories>remembered</relevant-memories>",
    "null",
    "{\"json\":1}",
    "~",
    ".",
    "*",
    ">",
    "a.b",
    "$SYS",
];

const MODELS: &[&str] = &[
    "gpt-4o",
    "gpt-4.1",
    "o3",
    "claude-sonnet-4",
    "claude-3-5-haiku",
    "llama-3.1-70b",
    "",
    "unknown/model:v9",
];

const PROVIDER_ERRORS: &[&str] = &[
    "This model's maximum context length is 128000 tokens. However, your messages resulted in 131072 tokens.",
    "prompt is too long: 210000 tokens > 200000 maximum",
    "Input length 14295 tokens exceeds the model limit of 8192",
    "context_length_exceeded",
    "Prompt has 256468 tokens, but the configured context size is 256000 tokens",
    "Rate limit reached for gpt-4o: Limit 30000, Requested 45000. Please try again in 2s.",
    "401 Unauthorized: invalid api key",
    "upstream connect error or disconnect/reset before headers",
    "",
    "context window exceeded by 18446744073709551615 tokens",
];

impl Generator {
    fn new(seed: u64) -> Self {
        let mut keys: Vec<String> = (0..16).map(|i| format!("fuzz:hot:{i}")).collect();
        keys.extend(
            [
                "~",
                ".",
                "*",
                ">",
                "**",
                "a.b.c",
                "a b",
                "tenant:*:x",
                "fuzz:ignored:1",
                "会话:ü",
                "🙂",
                "\u{0}",
                " ",
                "\n",
                "a/b",
                "$SYS",
                "fuzz:hot:0 ",
                "",
            ]
            .map(String::from),
        );
        keys.push("k".repeat(limits::MAX_CONVERSATION_KEY_BYTES));
        keys.push("k".repeat(limits::MAX_CONVERSATION_KEY_BYTES + 1));
        keys.push("é".repeat(limits::MAX_CONVERSATION_KEY_BYTES / 2 + 1));
        keys.push("z".repeat(8192));
        let mut gen = Generator {
            rng: Rng(seed),
            clock: EPOCH_MS,
            count: 0,
            sessions: Vec::new(),
            sessions_started: 0,
            pending: BTreeMap::new(),
            recent_inputs: VecDeque::new(),
            recent_events: VecDeque::new(),
            summary_ids: VecDeque::new(),
            keys,
            families: BTreeMap::new(),
            jobs_swept: 0,
            jobs_by_reason: BTreeMap::new(),
            queued: 0,
        };
        for _ in 0..SESSIONS {
            let s = gen.new_session();
            gen.sessions.push(s);
        }
        gen
    }

    fn next(&mut self) -> Input {
        self.count += 1;
        self.clock += self.rng.range(1, 400);
        let input = match self.pending.first_key_value() {
            Some((&(at, _), _)) if at <= self.count => match self.pending.pop_first() {
                Some((_, input)) => input,
                None => self.fresh(),
            },
            _ => self.fresh(),
        };
        *self.families.entry(input.family).or_default() += 1;
        if self.recent_inputs.len() >= RECENT {
            self.recent_inputs.pop_front();
        }
        self.recent_inputs.push_back(input.clone());
        input
    }

    fn fresh(&mut self) -> Input {
        match self.rng.weighted(&[42, 14, 17, 10, 8, 6]) {
            0 => self.session_step(),
            1 => {
                let e = self.random_event();
                self.remember(&e);
                self.deliver("event", &e)
            }
            2 => self.mutant(),
            3 => self.json_edit(),
            4 => {
                let len = match self.rng.below(10) {
                    0 => 0,
                    1..=6 => self.rng.range(1, 64),
                    7 | 8 => self.rng.range(64, 1024),
                    _ => self.rng.range(1024, 16384),
                } as usize;
                let mut bytes = self.rng.bytes(len);
                // Sometimes a plausible first byte: an object, a map.
                if !bytes.is_empty() && self.rng.chance(50) {
                    bytes[0] = *self
                        .rng
                        .pick(&[b'{', b'[', b'"', 0x80, 0x85, 0x86, 0xde, 0xdf]);
                }
                let (origin, address, stored) = self.random_routing(None, self.clock);
                Input {
                    family: "bytes",
                    origin,
                    address,
                    stored_at_ms: stored,
                    encoding: self.encoding(),
                    bytes,
                }
            }
            _ => self.replay(),
        }
    }

    fn encoding(&mut self) -> Encoding {
        if self.rng.chance(50) {
            Encoding::Json
        } else {
            Encoding::Msgpack
        }
    }

    fn remember(&mut self, e: &Envelope) {
        if self.recent_events.len() >= RECENT {
            self.recent_events.pop_front();
        }
        self.recent_events.push_back(e.clone());
    }

    /// Queues `input` for release after some more inputs.
    fn later(&mut self, input: Input, max_delay: u64) {
        let at = self.count + self.rng.range(1, max_delay);
        self.queue(at, input);
    }

    /// Queues `input` for release at input `at`, after what is queued
    /// there already.
    fn queue(&mut self, at: u64, input: Input) {
        self.queued += 1;
        self.pending.insert((at, self.queued), input);
    }

    /// What came of a batch: its jobs are swept, some decisions echoed.
    fn feed(&mut self, effects: &Effects) {
        for job in &effects.jobs {
            self.jobs_swept += 1;
            *self
                .jobs_by_reason
                .entry(format!("{:?}", job.job.reason))
                .or_default() += 1;
            let model = self.rng.chance(40);
            let results = sweep(job.clone(), model);
            let dropped = self.rng.one_in(40);
            // A sweep publishes in order, over a while.
            let mut at = self.count + self.rng.range(1, 150);
            for e in results {
                if let EventBody::SummaryRecorded(s) = &e.body {
                    if self.summary_ids.len() >= RECENT {
                        self.summary_ids.pop_front();
                    }
                    self.summary_ids
                        .push_back((e.conversation.clone(), s.summary_id.clone()));
                }
                // A lost sweep end: the job stays pending until it expires.
                if dropped && matches!(e.body, EventBody::SweepEnded(_)) {
                    continue;
                }
                let input = if self.rng.chance(12) {
                    self.result_mutant(e)
                } else {
                    self.result(e, "result")
                };
                if self.rng.one_in(30) {
                    // Redelivered, later.
                    self.later(input.clone(), 3000);
                }
                at += self.rng.below(8);
                self.queue(at, input);
            }
        }
        for d in &effects.decisions {
            if self.rng.chance(15) {
                let input = self.result(d.clone(), "echo");
                self.later(input, 200);
            }
        }
    }

    /// A service-written event as the service would publish it.
    fn result(&mut self, e: Envelope, family: &'static str) -> Input {
        let (address, stored) = if self.rng.chance(80) {
            (
                Address::Conversation(e.conversation.clone()),
                Some(e.time.saturating_add(self.rng.below(50))),
            )
        } else {
            (Address::Unaddressed, None)
        };
        let origin = match address {
            Address::Unaddressed if self.rng.chance(50) => Origin::Legacy,
            _ => Origin::Service,
        };
        let encoding = self.encoding();
        Input {
            family,
            origin,
            address,
            stored_at_ms: stored,
            encoding,
            bytes: e.encode(encoding),
        }
    }

    fn result_mutant(&mut self, mut e: Envelope) -> Input {
        let conv = e.conversation.clone();
        match &mut e.body {
            EventBody::SummaryRecorded(s) => match self.rng.below(8) {
                0 => s.content.push_str(" (edited after the fact)"),
                1 => {
                    // A condensation of depth 0 over real summaries.
                    let ids: Vec<String> = self
                        .summary_ids
                        .iter()
                        .filter(|(c, _)| *c == conv)
                        .map(|(_, id)| id.clone())
                        .take(3)
                        .collect();
                    s.kind = SummaryKind::Condensed;
                    s.depth = *self.rng.pick(&[0, 0, 2, u32::MAX]);
                    s.covers = Covers::Summaries { ids };
                    s.supersedes = None;
                    readdress(&conv, s);
                }
                2 => {
                    if let Covers::Turns { first, last } = &mut s.covers {
                        let shift = *self.rng.pick(&[1u64, 2, u64::MAX]);
                        *first = first.wrapping_add(shift);
                        *last = last.wrapping_add(shift);
                    }
                    readdress(&conv, s);
                }
                3 => {
                    s.covers = Covers::Turns {
                        first: *self.rng.pick(&[0, u64::MAX, 5]),
                        last: *self.rng.pick(&[0, u64::MAX, u64::MAX - 1, 4]),
                    };
                    s.depth = *self.rng.pick(&[0, 1, u32::MAX]);
                    readdress(&conv, s);
                }
                4 => {
                    let other = self.summary_ids.back().map(|(_, id)| id.clone());
                    s.supersedes = other.or_else(|| Some("sum_nothing".into()));
                    s.fallback = self.rng.chance(30);
                    readdress(&conv, s);
                }
                5 => {
                    // Sent to another conversation, its address recomputed.
                    e.conversation = self.key();
                    let key = e.conversation.clone();
                    readdress(&key, s);
                }
                6 => {
                    s.content = self.rng.pick(&["", "   ", "\u{0}"]).to_string();
                    readdress(&conv, s);
                }
                _ => {
                    s.tokens = u64::MAX;
                    s.source_tokens = 0;
                }
            },
            EventBody::SweepEnded(s) => {
                match self.rng.below(4) {
                    0 => {
                        s.calls = u32::MAX;
                        s.tokens_spent = u64::MAX;
                        s.cost_micros = u64::MAX;
                    }
                    1 => s.retry_after_ms = Some(*self.rng.pick(&[0, u64::MAX, 1_000])),
                    2 => s.job_id = format!("{}-other", s.job_id),
                    _ => s.stop = *self.rng.pick(&STOPS),
                }
                s.committed = self.rng.next() as u32;
            }
            EventBody::RollingStateUpdated(r) => {
                r.through_turn = *self.rng.pick(&[0, u64::MAX, 1 << 40]);
                r.state.completed = "x".repeat(self.rng.range(0, 5000) as usize);
                if self.rng.chance(50) {
                    r.job_id = None;
                }
            }
            _ => {}
        }
        let mut input = self.result(e, "result_mutant");
        if self.rng.chance(25) {
            // Forged: published by an agent.
            input.origin = Origin::Agent;
        }
        input
    }

    fn replay(&mut self) -> Input {
        if self.rng.chance(60) && !self.recent_inputs.is_empty() {
            let i = self.rng.index(self.recent_inputs.len());
            let mut input = self.recent_inputs[i].clone();
            input.family = "replay";
            if self.rng.chance(30) {
                let (origin, address, stored) = self.random_routing(None, self.clock);
                input.origin = origin;
                input.address = address;
                input.stored_at_ms = stored;
            }
            return input;
        }
        // An earlier id with another body.
        let mut e = self.random_event();
        if !self.recent_events.is_empty() {
            let i = self.rng.index(self.recent_events.len());
            let old = &self.recent_events[i];
            e.id = old.id.clone();
            e.conversation = old.conversation.clone();
        }
        let mut input = self.deliver("replay", &e);
        input.family = "replay";
        input
    }

    // ---- realistic sessions ----

    fn new_session(&mut self) -> Session {
        self.sessions_started += 1;
        let n = self.sessions_started;
        let key = match self.rng.below(20) {
            0 => format!("fuzz:ignored:{n}"),
            1 => format!("会话:{n}:ü"),
            2 => format!("fuzz.dots.{n}"),
            3 => format!("fuzz:~{n}*"),
            _ => format!("fuzz:s:{n}"),
        };
        let delivery = match self.rng.below(10) {
            0..=6 => Delivery::Subject,
            7 | 8 => Delivery::Embedded,
            _ => Delivery::Legacy,
        };
        Session {
            key,
            delivery,
            time: self.clock,
            left: self.rng.range(30, 600) as u32,
            n: 0,
            open_calls: Vec::new(),
            last_user: None,
            flood: 0,
        }
    }

    fn session_step(&mut self) -> Input {
        let i = self.rng.index(self.sessions.len());
        let mut s = std::mem::replace(&mut self.sessions[i], Session::placeholder());
        let e = self.session_event(&mut s);
        s.left = s.left.saturating_sub(1);
        let input = self.session_input(&s, &e);
        self.remember(&e);
        self.sessions[i] = if s.left == 0 { self.new_session() } else { s };
        input
    }

    fn session_input(&mut self, s: &Session, e: &Envelope) -> Input {
        let encoding = self.encoding();
        let (origin, address, stored) = match s.delivery {
            Delivery::Subject => (
                Origin::Agent,
                Address::Conversation(s.key.clone()),
                Some(e.time.saturating_add(self.rng.below(100))),
            ),
            Delivery::Embedded => (Origin::Agent, Address::Unaddressed, None),
            Delivery::Legacy => (Origin::Legacy, Address::Unaddressed, None),
        };
        Input {
            family: "session",
            origin,
            address,
            stored_at_ms: stored,
            encoding,
            bytes: e.encode(encoding),
        }
    }

    fn session_event(&mut self, s: &mut Session) -> Envelope {
        s.n += 1;
        let id = format!("{}#{}", s.key, s.n);
        if s.flood > 0 {
            // The same turn again, within the same second.
            s.flood -= 1;
            let text = s.last_user.clone().unwrap_or_default();
            return turn_event(id, &s.key, s.time, ChatMessage::text(Role::User, text));
        }
        s.time += self.rng.range(200, 20_000);
        if s.n == 1 {
            let body = EventBody::ModelDeclared(ModelDeclared {
                model: self.rng.pick(MODELS).to_string(),
                context_window: Some(self.rng.range(3000, 16_000)),
            });
            return Envelope::new(id, s.key.clone(), s.time, body);
        }
        let weights = [24, 20, 16, 22, 2, 3, 2, 2, 1, 2, 1, 3, 1, 1];
        let message = match self.rng.weighted(&weights) {
            0 => {
                let text = self.sentence(4, 120);
                s.last_user = Some(text.clone());
                ChatMessage::text(Role::User, text)
            }
            1 => ChatMessage::text(Role::Assistant, self.sentence(2, 200)),
            2 => {
                let calls = (0..self.rng.range(1, 4))
                    .map(|k| {
                        let id = format!("call_{}_{}_{k}", s.key.len(), s.n);
                        s.open_calls.push(id.clone());
                        tool_call(id, "read_file", format!("{{\"path\":\"src/{k}.rs\"}}"))
                    })
                    .collect();
                let mut m = ChatMessage::text(Role::Assistant, "");
                m.content = if self.rng.chance(50) {
                    None
                } else {
                    Some(Content::Text(self.sentence(1, 20)))
                };
                m.tool_calls = calls;
                m
            }
            3 if !s.open_calls.is_empty() => {
                // Results mostly in order, sometimes out of it.
                let k = if self.rng.chance(80) {
                    0
                } else {
                    self.rng.index(s.open_calls.len())
                };
                let call = s.open_calls.remove(k);
                let mut m = ChatMessage::text(Role::Tool, self.sentence(1, 300));
                m.tool_call_id = Some(call);
                m.name = Some("read_file".into());
                m
            }
            3 | 4 => {
                let mut m = ChatMessage::text(Role::Tool, "a result nobody asked for");
                m.tool_call_id = Some(format!("call_orphan_{}", self.rng.below(1000)));
                m
            }
            5 => {
                // A long user turn again within the duplicate window.
                let text = match &s.last_user {
                    Some(t) if t.chars().count() >= 24 => t.clone(),
                    _ => "please run the whole test suite again now".into(),
                };
                s.last_user = Some(text.clone());
                ChatMessage::text(Role::User, text)
            }
            6 => {
                s.flood = self.rng.range(2, 6) as u32;
                let text = format!("flood {}", self.rng.below(5));
                s.last_user = Some(text.clone());
                ChatMessage::text(Role::User, text)
            }
            7 => {
                let error = self.rng.pick(PROVIDER_ERRORS).to_string();
                let body = EventBody::ProviderErrorObserved(ProviderErrorObserved {
                    error,
                    model: self.rng.chance(50).then(|| "gpt-4o".into()),
                });
                return Envelope::new(id, s.key.clone(), s.time, body);
            }
            8 => {
                let body = EventBody::CompactionRequested(CompactionRequested {
                    instructions: self.rng.chance(50).then(|| "keep the file names".into()),
                    keep_recent_tokens: None,
                    target_tokens: self.rng.chance(30).then(|| self.rng.range(0, 4000)),
                });
                return Envelope::new(id, s.key.clone(), s.time, body);
            }
            9 => ChatMessage::text(Role::System, self.sentence(3, 40)),
            10 => {
                let mut m = ChatMessage::text(Role::User, "");
                m.content = Some(Content::Parts(vec![
                    ContentPart {
                        kind: "text".into(),
                        text: Some(self.sentence(2, 30)),
                        other: BTreeMap::new(),
                    },
                    ContentPart {
                        kind: "image_url".into(),
                        text: None,
                        other: [(
                            "image_url".to_string(),
                            json!({"url": "https://x.test/a.png"}),
                        )]
                        .into_iter()
                        .collect(),
                    },
                ]));
                m
            }
            11 if self.rng.one_in(20) => {
                s.open_calls.clear();
                let body = EventBody::ConversationReset(ConversationReset {
                    reason: Some("new task".into()),
                });
                return Envelope::new(id, s.key.clone(), s.time, body);
            }
            11 => ChatMessage::text(Role::User, self.sentence(30, 400)),
            12 => {
                let mut m = ChatMessage::text(Role::Tool, "no id");
                m.tool_call_id = None;
                m
            }
            _ => {
                let mut m = ChatMessage::text(Role::Assistant, "");
                m.tool_calls = vec![tool_call(String::new(), "noop", String::new())];
                m
            }
        };
        turn_event(id, &s.key, s.time, message)
    }

    fn sentence(&mut self, min: u64, max: u64) -> String {
        let n = self.rng.range(min, max + 1);
        let mut out = String::new();
        for i in 0..n {
            if i > 0 {
                out.push(' ');
            }
            let word: &&str = self.rng.pick(WORDS);
            out.push_str(word);
        }
        out
    }

    // ---- random events ----

    fn key(&mut self) -> String {
        if self.rng.chance(70) {
            let i = self.rng.index(self.keys.len());
            self.keys[i].clone()
        } else {
            self.string()
        }
    }

    fn id(&mut self) -> String {
        match self.rng.below(12) {
            0 => String::new(),
            1 => "i".repeat(limits::MAX_EVENT_ID_BYTES),
            2 => "i".repeat(limits::MAX_EVENT_ID_BYTES + 1),
            3 => "é".repeat(limits::MAX_EVENT_ID_BYTES / 2 + 1),
            4 => self.string(),
            5 if !self.recent_events.is_empty() => {
                let i = self.rng.index(self.recent_events.len());
                self.recent_events[i].id.clone()
            }
            _ => format!("ev-{}", self.rng.below(1 << 20)),
        }
    }

    fn string(&mut self) -> String {
        match self.rng.below(100) {
            0..=9 => String::new(),
            10..=24 => self.rng.pick(WORDS).to_string(),
            25..=29 => "n".repeat(limits::MAX_NAME_BYTES),
            30..=34 => "n".repeat(limits::MAX_NAME_BYTES + 1),
            35..=49 => {
                let len = self.rng.range(1, 40) as usize;
                (0..len)
                    .map(|_| char::from_u32(self.rng.below(0x11_0000) as u32).unwrap_or('\u{fffd}'))
                    .collect()
            }
            50 => "x".repeat(self.rng.range(1000, 20_000) as usize),
            _ => self.sentence(1, 12),
        }
    }

    fn opt_string(&mut self) -> Option<String> {
        self.rng.chance(50).then(|| self.string())
    }

    fn u64(&mut self) -> u64 {
        match self.rng.below(8) {
            0 => *self.rng.pick(&[
                0,
                1,
                255,
                256,
                1024,
                u32::MAX as u64,
                u64::MAX / 2,
                u64::MAX - 1,
                u64::MAX,
            ]),
            1 => self.rng.next(),
            _ => self.rng.below(10_000),
        }
    }

    fn u32(&mut self) -> u32 {
        match self.rng.below(6) {
            0 => *self.rng.pick(&[0, 1, u32::MAX - 1, u32::MAX]),
            _ => self.rng.below(20) as u32,
        }
    }

    fn time(&mut self) -> u64 {
        let now = self.clock;
        match self.rng.below(14) {
            0 => 0,
            1 => u64::MAX,
            2 => limits::MAX_EVENT_TIME_MS,
            3 => limits::MAX_EVENT_TIME_MS + 1,
            4 => now + limits::MAX_TIME_AHEAD_MS,
            5 => now + limits::MAX_TIME_AHEAD_MS + 1,
            6 => self.rng.next(),
            7 => now.saturating_sub(self.rng.below(10_000_000)),
            _ => now,
        }
    }

    fn role(&mut self) -> Role {
        *self
            .rng
            .pick(&[Role::System, Role::User, Role::Assistant, Role::Tool])
    }

    fn value(&mut self, depth: u32) -> Value {
        match self.rng.below(if depth > 3 { 5 } else { 8 }) {
            0 => Value::Null,
            1 => Value::Bool(self.rng.chance(50)),
            2 => json!(self.u64()),
            3 => json!(-(self.rng.below(1000) as i64)),
            4 => Value::String(self.string()),
            5 => json!(1.5e300),
            6 => Value::Array(
                (0..self.rng.below(4))
                    .map(|_| self.value(depth + 1))
                    .collect(),
            ),
            _ => {
                let mut map = Map::new();
                for _ in 0..self.rng.below(4) {
                    let k = self.string();
                    let v = self.value(depth + 1);
                    map.insert(k, v);
                }
                Value::Object(map)
            }
        }
    }

    fn message(&mut self) -> ChatMessage {
        let role = self.role();
        let mut m = ChatMessage::text(role, self.string());
        match self.rng.below(4) {
            0 => m.content = None,
            1 => {
                m.content = Some(Content::Parts(
                    (0..self.rng.below(4))
                        .map(|_| ContentPart {
                            kind: self.string(),
                            text: self.opt_string(),
                            other: BTreeMap::new(),
                        })
                        .collect(),
                ))
            }
            _ => {}
        }
        if self.rng.chance(40) {
            m.tool_calls = (0..self.rng.below(4))
                .map(|_| {
                    let id = if self.rng.chance(70) {
                        format!("call_{}", self.rng.below(50))
                    } else {
                        self.string()
                    };
                    tool_call(id, &self.string(), self.string())
                })
                .collect();
        }
        if self.rng.chance(50) {
            m.tool_call_id = Some(if self.rng.chance(70) {
                format!("call_{}", self.rng.below(50))
            } else {
                self.string()
            });
        }
        m.name = self.opt_string();
        m
    }

    fn debt(&mut self) -> contextfold::core::event::Debt {
        contextfold::core::event::Debt {
            reason: *self.rng.pick(&REASONS),
            context_tokens: self.u64(),
            threshold_tokens: self.u64(),
            target_tokens: self.u64(),
            urgent: self.rng.chance(50),
            since: self.time(),
            instructions: self.opt_string(),
        }
    }

    fn random_event(&mut self) -> Envelope {
        let conversation = self.key();
        let body = match self.rng.below(15) {
            0 => EventBody::TurnAppended(TurnAppended {
                message: self.message(),
                model: self.opt_string(),
                sender: self.opt_string(),
                usage: self.rng.chance(30).then(|| ProviderUsage {
                    prompt_tokens: Some(self.u64()),
                    completion_tokens: Some(self.u64()),
                    total_tokens: None,
                }),
                metadata: self.rng.chance(30).then(|| match self.value(0) {
                    Value::Object(map) => map,
                    other => [("v".to_string(), other)].into_iter().collect(),
                }),
            }),
            1 => EventBody::ProviderErrorObserved(ProviderErrorObserved {
                error: if self.rng.chance(50) {
                    self.rng.pick(PROVIDER_ERRORS).to_string()
                } else {
                    self.string()
                },
                model: self.opt_string(),
            }),
            2 => EventBody::CompactionRequested(CompactionRequested {
                instructions: self.opt_string(),
                keep_recent_tokens: self.rng.chance(50).then(|| self.u64()),
                target_tokens: self.rng.chance(50).then(|| self.u64()),
            }),
            3 => EventBody::ModelDeclared(ModelDeclared {
                model: if self.rng.chance(50) {
                    self.rng.pick(MODELS).to_string()
                } else {
                    self.string()
                },
                context_window: self.rng.chance(70).then(|| self.u64()),
            }),
            4 => EventBody::ConversationReset(ConversationReset {
                reason: self.opt_string(),
            }),
            5 => EventBody::DebtRecorded(self.debt()),
            6 => EventBody::DebtUpdated(self.debt()),
            7 => EventBody::DebtCleared(DebtCleared {
                reason: self.string(),
            }),
            8 => EventBody::JobIssued(JobIssued {
                job_id: self.id(),
                reason: *self.rng.pick(&REASONS),
                urgent: self.rng.chance(50),
                context_tokens: self.u64(),
                target_tokens: self.u64(),
                deadline_ms: self.u64(),
                issued_at: self.time(),
                instructions: self.opt_string(),
                compact: self.rng.chance(70),
                refresh_rolling_state: self.rng.chance(50),
                max_calls: self.rng.chance(50).then(|| self.u32()),
                max_tokens: self.rng.chance(50).then(|| self.u64()),
            }),
            9 => EventBody::SummaryRejected(SummaryRejected {
                summary_id: self.id(),
                job_id: self.opt_string(),
                reason: self.string(),
            }),
            10 => EventBody::EventRejected(EventRejected {
                rejected_id: self.id(),
                event_type: self.opt_string(),
                reason: self.string(),
            }),
            11 => EventBody::MemoryFlushRequested(MemoryFlushRequested {
                cycle: self.u64(),
                reason: *self.rng.pick(&REASONS),
            }),
            12 => {
                let kind = if self.rng.chance(50) {
                    SummaryKind::Leaf
                } else {
                    SummaryKind::Condensed
                };
                let covers = if self.rng.chance(60) {
                    Covers::Turns {
                        first: self.u64() % 64,
                        last: self.u64() % 128,
                    }
                } else {
                    let mut ids: Vec<String> = Vec::new();
                    for _ in 0..self.rng.below(4) {
                        let real = self.summary_ids.back().map(|(_, id)| id.clone());
                        ids.push(
                            real.filter(|_| self.rng.chance(50))
                                .unwrap_or_else(|| self.id()),
                        );
                    }
                    Covers::Summaries { ids }
                };
                let mut s = SummaryRecorded {
                    summary_id: self.id(),
                    job_id: self.opt_string(),
                    kind,
                    depth: self.u32(),
                    covers,
                    content: self.string(),
                    source_tokens: self.u64(),
                    tokens: self.u64(),
                    model: self.string(),
                    provider: self.string(),
                    prompt_version: self.string(),
                    fallback: self.rng.chance(50),
                    supersedes: self.opt_string(),
                };
                if self.rng.chance(60) {
                    readdress(&conversation, &mut s);
                }
                EventBody::SummaryRecorded(s)
            }
            13 => EventBody::SweepEnded(SweepEnded {
                job_id: self.id(),
                passes: self.u32(),
                committed: self.u32(),
                stop: *self.rng.pick(&STOPS),
                detail: self.opt_string(),
                calls: self.u32(),
                tokens_spent: self.u64(),
                cost_micros: self.u64(),
                retry_after_ms: self.rng.chance(50).then(|| self.u64()),
            }),
            _ => EventBody::RollingStateUpdated(RollingStateUpdated {
                state: RollingState {
                    completed: self.string(),
                    in_progress: self.string(),
                    decisions: self.string(),
                    blockers: self.string(),
                    next: self.string(),
                },
                through_turn: self.u64(),
                job_id: self.opt_string(),
            }),
        };
        let mut e = Envelope::new(self.id(), conversation, self.time(), body);
        if self.rng.one_in(10) {
            e.version = *self.rng.pick(&[0, 2, u16::MAX]);
        }
        e
    }

    /// Origin, address and stored time for an event of conversation
    /// `body_key` (or bytes without one) at `time`.
    fn random_routing(
        &mut self,
        body_key: Option<&str>,
        time: u64,
    ) -> (Origin, Address, Option<u64>) {
        let origin = match self.rng.below(10) {
            0..=5 => Origin::Agent,
            6..=8 => Origin::Service,
            _ => Origin::Legacy,
        };
        let address = match (self.rng.below(20), body_key) {
            (0..=10, Some(key)) => Address::Conversation(key.to_string()),
            (0..=12, _) => Address::Conversation(self.key()),
            (13..=17, _) => Address::Unaddressed,
            _ => Address::Unroutable(
                self.rng
                    .pick(&[
                        "empty conversation token",
                        "token is not base64url",
                        "subject has too few tokens",
                    ])
                    .to_string(),
            ),
        };
        let stored = match self.rng.below(10) {
            0..=3 => None,
            4..=7 => Some(time.saturating_add(self.rng.below(1000))),
            8 => Some(*self.rng.pick(&[0, u64::MAX, limits::MAX_EVENT_TIME_MS])),
            _ => Some(self.rng.next()),
        };
        (origin, address, stored)
    }

    fn deliver(&mut self, family: &'static str, e: &Envelope) -> Input {
        let (origin, address, stored) = self.random_routing(Some(&e.conversation), e.time);
        let encoding = self.encoding();
        Input {
            family,
            origin,
            address,
            stored_at_ms: stored,
            encoding,
            bytes: e.encode(encoding),
        }
    }

    // ---- mutations ----

    /// A valid event's bytes, mutated.
    fn mutant(&mut self) -> Input {
        let e = if self.rng.chance(50) && !self.recent_events.is_empty() {
            let i = self.rng.index(self.recent_events.len());
            self.recent_events[i].clone()
        } else {
            self.random_event()
        };
        let mut input = self.deliver("mutant", &e);
        let rounds = if self.rng.chance(70) {
            1
        } else {
            self.rng.range(2, 6)
        };
        for _ in 0..rounds {
            input.bytes = self.mutate(std::mem::take(&mut input.bytes));
        }
        input
    }

    fn mutate(&mut self, mut b: Vec<u8>) -> Vec<u8> {
        if b.is_empty() {
            return self.rng.bytes(4);
        }
        let at = self.rng.index(b.len());
        match self.rng.below(8) {
            0 => b.truncate(at),
            1 => {
                for _ in 0..self.rng.range(1, 9) {
                    let i = self.rng.index(b.len());
                    b[i] ^= 1 << self.rng.below(8);
                }
            }
            2 => {
                let len = self.rng.range(1, 16) as usize;
                let insert = self.rng.bytes(len);
                b.splice(at..at, insert);
            }
            3 => {
                let end = (at + self.rng.range(1, 32) as usize).min(b.len());
                b.drain(at..end);
            }
            4 => {
                // Prefix of this encoding, suffix of another.
                let other = self
                    .recent_inputs
                    .get(self.rng.index(self.recent_inputs.len().max(1)))
                    .map(|i| i.bytes.clone())
                    .unwrap_or_default();
                let from = self.rng.index(other.len().max(1)).min(other.len());
                b.truncate(at);
                b.extend_from_slice(&other[from..]);
            }
            5 => {
                let end = (at + self.rng.range(1, 64) as usize).min(b.len());
                let chunk = b[at..end].to_vec();
                for _ in 0..self.rng.range(1, 8) {
                    b.splice(at..at, chunk.iter().copied());
                }
            }
            6 => {
                let telling: &[&[u8]] = &[
                    &[0x00],
                    &[0xff],
                    &[0xc1],
                    b"\"",
                    b"{",
                    b"}",
                    b"\\",
                    &[0xdd, 0xff, 0xff, 0xff, 0xff],
                    &[0xdf, 0xff, 0xff, 0xff, 0xff],
                    &[0xdb, 0x7f, 0xff, 0xff, 0xff],
                    &[0xc6, 0xff, 0xff, 0xff, 0xff],
                    &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                    &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],
                    &[0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 0],
                    b"\xed\xa0\x80",
                    b"\\ud800",
                    b"1e999",
                    b"-0",
                ];
                let t = self.rng.pick(telling);
                let end = (at + t.len()).min(b.len());
                b.splice(at..end, t.iter().copied());
            }
            _ => {
                let n = self.rng.range(1, 4) as usize;
                b.extend(self.rng.bytes(n));
            }
        }
        b
    }

    /// Edits of an event's decoded value.
    fn json_edit(&mut self) -> Input {
        let e = if self.rng.chance(50) && !self.recent_events.is_empty() {
            let i = self.rng.index(self.recent_events.len());
            self.recent_events[i].clone()
        } else {
            self.random_event()
        };
        let mut input = self.deliver("json_edit", &e);
        let Ok(Value::Object(mut map)) = serde_json::to_value(&e) else {
            return input;
        };
        let mut text: Option<Vec<u8>> = None;
        match self.rng.below(12) {
            0 => {
                let v = self.pick_value(&[
                    json!(0),
                    json!(2),
                    json!(65535),
                    json!(65536),
                    json!(-1),
                    json!("1"),
                    Value::Null,
                    json!(1.5),
                ]);
                map.insert("version".into(), v);
            }
            1 => {
                let v = self.pick_value(&[
                    json!(-1),
                    json!(u64::MAX),
                    json!(1e20),
                    json!("5"),
                    json!(true),
                    Value::Null,
                    json!(1.5),
                    json!([1]),
                ]);
                map.insert("time".into(), v);
            }
            2 => {
                let t = if self.rng.chance(70) {
                    json!(self.rng.pick(EventBody::TYPE_NAMES))
                } else {
                    self.pick_value(&[json!("turn_exploded"), json!(5), Value::Null, json!("")])
                };
                map.insert("type".into(), t);
            }
            3 => {
                let fields = ["id", "conversation", "type", "payload", "version", "time"];
                map.remove(*self.rng.pick(&fields));
            }
            4 => {
                let field = *self.rng.pick(&["id", "conversation"]);
                let v = self.value(0);
                map.insert(field.into(), v);
            }
            5 => {
                // A value somewhere in the payload of another type.
                if let Some(payload) = map.get_mut("payload") {
                    let v = self.value(0);
                    let rng = &mut self.rng;
                    replace_somewhere(rng, payload, v);
                }
            }
            6 => {
                for _ in 0..self.rng.range(1, 4) {
                    let k = self.string();
                    let v = self.value(0);
                    map.insert(k, v);
                }
                if let Some(Value::Object(p)) = map.get_mut("payload") {
                    p.insert("unknown_field".into(), json!({"x": [1, 2, null]}));
                }
            }
            7 => {
                // Payload before type (the derived decoder's path).
                let mut reordered = Map::new();
                if let Some(p) = map.remove("payload") {
                    reordered.insert("payload".into(), p);
                }
                reordered.extend(map);
                map = reordered;
            }
            8 => {
                // Duplicate keys, which only text can say.
                let mut s = serde_json::to_string(&Value::Object(map.clone())).unwrap_or_default();
                let dup = *self.rng.pick(&[
                    "\"id\":\"dup\",",
                    "\"conversation\":\"other\",",
                    "\"type\":\"sweep_ended\",",
                    "\"payload\":{},",
                    "\"time\":1,",
                ]);
                s.insert_str(1.min(s.len()), dup);
                text = Some(s.into_bytes());
            }
            9 => {
                // Deeply nested garbage where the payload goes.
                let depth = *self
                    .rng
                    .pick(&[100usize, 127, 129, 1000, 1025, 5000, 100_000]);
                let as_json = self.rng.chance(50);
                let mut s = Vec::new();
                if as_json {
                    let head = format!(
                        "{{\"id\":\"deep\",\"conversation\":{},\"type\":\"turn_appended\",\"payload\":{{\"message\":{{\"role\":\"user\",\"content\":\"x\"}},\"metadata\":{{\"m\":",
                        serde_json::to_string(&e.conversation).unwrap_or_else(|_| "\"c\"".into())
                    );
                    s.extend_from_slice(head.as_bytes());
                    s.extend(std::iter::repeat_n(b'[', depth));
                    s.extend(std::iter::repeat_n(b']', depth));
                    s.extend_from_slice(b"}}}");
                    input.encoding = Encoding::Json;
                } else {
                    // The same in MessagePack: fixmap of 4, then nested fixarrays.
                    s.push(0x84);
                    for (k, v) in [("id", "deep"), ("type", "turn_appended")] {
                        push_str(&mut s, k);
                        push_str(&mut s, v);
                    }
                    push_str(&mut s, "conversation");
                    push_str(&mut s, &e.conversation);
                    push_str(&mut s, "payload");
                    s.push(0x82);
                    push_str(&mut s, "message");
                    s.push(0x82);
                    push_str(&mut s, "role");
                    push_str(&mut s, "user");
                    push_str(&mut s, "content");
                    push_str(&mut s, "x");
                    push_str(&mut s, "metadata");
                    s.push(0x81);
                    push_str(&mut s, "m");
                    s.extend(std::iter::repeat_n(0x91, depth));
                    s.push(0xc0);
                    input.encoding = Encoding::Msgpack;
                }
                text = Some(s);
            }
            10 => {
                // Positional MessagePack (arrays for structs).
                text = Some(rmp_serde::to_vec(&e).unwrap_or_default());
                input.encoding = Encoding::Msgpack;
            }
            _ => {
                let v = self.pick_value(&[Value::Null, json!([]), json!("payload"), json!(7)]);
                map.insert("payload".into(), v);
            }
        }
        input.bytes = match text {
            Some(bytes) => bytes,
            None => {
                let value = Value::Object(map);
                match input.encoding {
                    Encoding::Json => serde_json::to_vec(&value).unwrap_or_default(),
                    Encoding::Msgpack => rmp_serde::to_vec_named(&value).unwrap_or_default(),
                }
            }
        };
        input
    }

    fn pick_value(&mut self, values: &[Value]) -> Value {
        self.rng.pick(values).clone()
    }
}

impl Session {
    fn placeholder() -> Session {
        Session {
            key: String::new(),
            delivery: Delivery::Subject,
            time: 0,
            left: 0,
            n: 0,
            open_calls: Vec::new(),
            last_user: None,
            flood: 0,
        }
    }
}

const REASONS: [DebtReason; 5] = [
    DebtReason::Threshold,
    DebtReason::Overflow,
    DebtReason::Manual,
    DebtReason::TranscriptBytes,
    DebtReason::Resummarize,
];

const STOPS: [SweepStop; 6] = [
    SweepStop::Done,
    SweepStop::Deadline,
    SweepStop::IterationCap,
    SweepStop::SpendLimit,
    SweepStop::NoProgress,
    SweepStop::Failed,
];

fn turn_event(id: String, key: &str, time: u64, message: ChatMessage) -> Envelope {
    Envelope::new(
        id,
        key,
        time,
        EventBody::TurnAppended(TurnAppended::from(message)),
    )
}

fn tool_call(id: String, name: &str, arguments: String) -> ToolCall {
    ToolCall {
        id,
        kind: "function".into(),
        function: FunctionCall {
            name: name.to_string(),
            arguments,
        },
    }
}

/// Gives `s` the content address it has in conversation `conv`.
fn readdress(conv: &str, s: &mut SummaryRecorded) {
    s.summary_id = summary_id(
        conv,
        s.kind,
        s.depth,
        &s.covers,
        &s.content,
        &s.prompt_version,
    );
}

/// A MessagePack string: the smallest header for its length, then the bytes.
fn push_str(out: &mut Vec<u8>, s: &str) {
    let len = s.len();
    if len < 32 {
        out.push(0xa0 | len as u8);
    } else if len <= 0xff {
        out.extend([0xd9, len as u8]);
    } else if len <= 0xffff {
        out.push(0xda);
        out.extend((len as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend((len as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

/// Replaces a random node of `v` (maybe `v` itself) with `new`.
fn replace_somewhere(rng: &mut Rng, v: &mut Value, new: Value) {
    let children = match v {
        Value::Object(map) => map.len(),
        Value::Array(items) => items.len(),
        _ => 0,
    };
    if children == 0 || rng.chance(30) {
        *v = new;
        return;
    }
    let i = rng.index(children);
    let child = match v {
        Value::Object(map) => map.values_mut().nth(i),
        Value::Array(items) => items.get_mut(i),
        _ => None,
    };
    if let Some(child) = child {
        replace_somewhere(rng, child, new);
    }
}

/// Runs a job as a summarizer would, with the core's steps and its
/// deterministic summarizer, on the job's own clock (deterministic:
/// `issued_at` plus one per event). `model`: pass the drafts off as a
/// model's, so the fold sees non-fallback summaries and re-summarizes.
fn sweep(mut snap: SweepSnapshot, model: bool) -> Vec<Envelope> {
    let job_id = snap.job.job_id.clone();
    let conversation = snap.conversation.clone();
    let mut time = snap.job.issued_at;
    let mut out = Vec::new();
    let (mut passes, mut committed) = (0u32, 0u32);
    let stop = loop {
        if passes >= snap.policy.max_sweep_iterations {
            break SweepStop::IterationCap;
        }
        let Some(pass) = snap.next_pass() else {
            break SweepStop::Done;
        };
        passes += 1;
        let request = snap.request(pass, false);
        let mut draft = fallback_summary::summarize(&request);
        if model {
            // Another prompt: the same text is another summary, not the
            // fallback's own address (and event id) again.
            draft.fallback = false;
            draft.model = "fuzz-model".into();
            draft.provider = "fuzz".into();
            draft.prompt_version = "fuzz-model-v1".into();
        } else if matches!(pass, Pass::Resummarize(_)) {
            // As the runtime: a fallback in place of a fallback is no
            // progress, and is not published.
            break SweepStop::NoProgress;
        }
        let record = snap.record(pass, &draft);
        if record.tokens >= record.source_tokens {
            break SweepStop::NoProgress;
        }
        snap.apply(pass, &record);
        committed += 1;
        time = time.saturating_add(1);
        out.push(summary_event(&conversation, time, record));
    };
    if let Some(request) = snap.rolling_request() {
        time = time.saturating_add(1);
        out.push(Envelope::new(
            format!("rs_{job_id}"),
            conversation.clone(),
            time,
            EventBody::RollingStateUpdated(RollingStateUpdated {
                state: fallback_summary::rolling_state(&request),
                through_turn: snap.through_turn,
                job_id: Some(job_id.clone()),
            }),
        ));
    }
    out.push(Envelope::new(
        format!("se_{job_id}"),
        conversation,
        time.saturating_add(1),
        EventBody::SweepEnded(SweepEnded {
            job_id,
            passes,
            committed,
            stop,
            detail: None,
            calls: if model { passes } else { 0 },
            tokens_spent: 0,
            cost_micros: 0,
            retry_after_ms: None,
        }),
    ));
    out
}
