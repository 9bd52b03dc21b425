//! Fold throughput on one core over real inbound events: the tau-bench
//! airline runs, the pi session and the long Claude Code session from
//! `../shared/data` (see `support/transcripts.rs`), each alone and all
//! together (6,649 events, 4.7 MB of message text), and 20,000 short
//! synthetic turns (about 15 bytes of text each) for the per-event cost.
//!
//! One iteration folds a whole corpus into an empty state, under the
//! default policy (no summarizer runs, so the long sessions carry their
//! pending debt and job as a worker that has not answered yet would leave
//! them). Four paths:
//! - `fold_precounted`: events decoded and turns measured beforehand
//!   (`fold_counted` with each turn's `TurnMeasure`: its tokens and a long
//!   tool output's telling line, as `run` measures them on its other core),
//!   the fold alone; goal 1,000,000 events/s;
//! - `fold_counting`: the fold counting each turn's tokens itself (`fold`);
//! - `fold_owned_precounted`: the same with events the fold may keep
//!   (`fold_owned`): turns move into the state instead of being copied;
//! - `decode_and_fold`: MessagePack bytes as the log holds them, decoded
//!   (`Envelope::decode`) then folded with pre-measured turns (`fold_owned`,
//!   as the engine does).
//!
//! And `decode_json`: the same events as JSON, as agents publish them and
//! `run` reads them, decoded (`Envelope::decode`) and not folded.
//!
//! The duplicate and flood guards read a turn's text only when a turn it
//! could be identical to is in their windows (the same conversation's
//! second for floods, its last minute of long user turns for duplicates):
//! first a cheap sketch, then the digest of the normalized text if the
//! sketches match. So throughput depends on message size and on how turns
//! are spaced in time; the corpus line printed first gives the bytes, to
//! read events/s against. `fold_precounted` also copies every turn into
//! the state (its events are borrowed), which `fold_owned_precounted` does
//! not.
//!
//! Run: `cargo bench --bench fold`. The throughput column is events/s.
//! `CONTEXTFOLD_BENCH_CORPORA=all,pi` loads only the corpora named (divan
//! filters benches, not their arguments): what a profiler run wants.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/transcripts.rs"]
mod transcripts;

use contextfold::core::event::{Encoding, Envelope, EventBody, TurnAppended};
use contextfold::core::fold::{fold, fold_counted, fold_owned};
use contextfold::core::measure::TurnMeasure;
use contextfold::core::message::{ChatMessage, FunctionCall, Role, ToolCall};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::State;
use divan::counter::ItemsCount;
use divan::Bencher;
use std::collections::HashMap;
use std::fmt;
use std::sync::OnceLock;

struct Corpus {
    name: &'static str,
    events: Vec<Envelope>,
    /// Each turn measured as the fold measures it; `None` for other events.
    tokens: Vec<Option<TurnMeasure>>,
    msgpack: Vec<Vec<u8>>,
    json: Vec<Vec<u8>>,
}

/// Which transcripts a corpus holds.
const CORPORA: [(&str, &[&str]); 4] = [
    ("all", &transcripts::FILES),
    ("tau-bench", &[transcripts::FILES[0]]),
    ("pi", &[transcripts::FILES[1]]),
    ("claude-code", &[transcripts::FILES[2]]),
];

/// Short synthetic turns (about 15 bytes of text each) in 100
/// conversations: what the fold costs per event when there is little text
/// to digest.
fn short_turns() -> Vec<Envelope> {
    let mut out = Vec::new();
    for c in 0..100u64 {
        let key = format!("short:{c}");
        for n in 0..200u64 {
            let message = match n % 4 {
                0 => ChatMessage::text(Role::User, format!("Check file {n}.")),
                1 => {
                    let mut m = ChatMessage::text(Role::Assistant, "");
                    m.content = None;
                    m.tool_calls = vec![ToolCall {
                        id: format!("call_{n}"),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: "read".into(),
                            arguments: format!("{{\"f\":{n}}}"),
                        },
                    }];
                    m
                }
                2 => {
                    let mut m = ChatMessage::text(Role::Tool, "12 lines");
                    m.tool_call_id = Some(format!("call_{}", n - 1));
                    m
                }
                _ => ChatMessage::text(Role::Assistant, format!("File {n} is fine.")),
            };
            out.push(Envelope::new(
                format!("{key}-{n}"),
                key.as_str(),
                1_700_000_000_000 + n * 1000,
                EventBody::TurnAppended(TurnAppended::from(message)),
            ));
        }
    }
    out
}

static LOADED: OnceLock<Vec<Corpus>> = OnceLock::new();

fn policy() -> PolicyConfig {
    PolicyConfig::default()
}

fn load(name: &'static str, events: Vec<Envelope>) -> Option<Corpus> {
    let policy = policy();
    // Count once the way the fold does (per conversation encoding), and
    // keep what it counted.
    let mut state = State::default();
    for e in &events {
        fold(&mut state, &policy, e);
    }
    let counted: HashMap<String, TurnMeasure> = state
        .conversations
        .values()
        .flat_map(|c| {
            c.turns.iter().map(|t| {
                let body = c.bodies.get(t.seq).expect("folded in memory");
                let measure = TurnMeasure::of(c.encoding, &body.turn.message);
                (body.event_id.to_string(), measure)
            })
        })
        .collect();
    let tokens = events
        .iter()
        .map(|e| counted.get(e.id.as_str()).cloned())
        .collect();
    let msgpack: Vec<Vec<u8>> = events.iter().map(Envelope::to_msgpack).collect();
    let json = events.iter().map(|e| e.to_json().into_bytes()).collect();
    let text: u64 = state
        .conversations
        .values()
        .flat_map(|c| &c.turns)
        .map(|t| u64::from(t.bytes))
        .sum();
    // The state hash lets a change to the fold be checked for identical
    // results: it must not move unless the fold's semantics do.
    eprintln!(
        "{name}: {} events ({} turns) in {} conversations, {text} bytes of message text \
         ({} per event), {} MessagePack bytes; state hash {}",
        events.len(),
        counted.len(),
        state.conversations.len(),
        text / events.len().max(1) as u64,
        msgpack.iter().map(Vec::len).sum::<usize>(),
        state.hash()
    );
    Some(Corpus {
        name,
        events,
        tokens,
        msgpack,
        json,
    })
}

/// Whether `CONTEXTFOLD_BENCH_CORPORA` (a comma list; unset: all) names it.
fn wanted(name: &str) -> bool {
    match std::env::var("CONTEXTFOLD_BENCH_CORPORA") {
        Ok(list) => list.split(',').any(|n| n.trim() == name),
        Err(_) => true,
    }
}

fn corpora() -> &'static [Corpus] {
    LOADED.get_or_init(|| {
        let loaded: Vec<Corpus> = CORPORA
            .iter()
            .filter(|(name, _)| wanted(name))
            .filter_map(|(name, files)| load(name, transcripts::events_of(files)?))
            .chain(
                wanted("synthetic-short")
                    .then(|| load("synthetic-short", short_turns()))
                    .flatten(),
            )
            .collect();
        assert!(
            !loaded.is_empty(),
            "CONTEXTFOLD_BENCH_CORPORA names no corpus: all, tau-bench, pi, claude-code, synthetic-short"
        );
        loaded
    })
}

#[derive(Clone, Copy)]
struct Input(usize);

impl fmt::Display for Input {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(corpora()[self.0].name)
    }
}

fn inputs() -> Vec<Input> {
    (0..corpora().len()).map(Input).collect()
}

#[divan::bench(args = inputs(), sample_count = 30)]
fn fold_precounted(bencher: Bencher, input: Input) {
    let c = &corpora()[input.0];
    let policy = policy();
    bencher
        .counter(ItemsCount::new(c.events.len()))
        .with_inputs(State::default)
        .bench_local_values(|mut state| {
            for (e, t) in c.events.iter().zip(&c.tokens) {
                fold_counted(&mut state, &policy, e, t.as_ref());
            }
            state
        });
}

/// As `fold_precounted`, with events the fold may keep (`fold_owned`, what
/// the engine does with an event it just decoded): turns move into the
/// state instead of being copied. The copies are made outside the timing.
#[divan::bench(args = inputs(), sample_count = 30)]
fn fold_owned_precounted(bencher: Bencher, input: Input) {
    let c = &corpora()[input.0];
    let policy = policy();
    bencher
        .counter(ItemsCount::new(c.events.len()))
        .with_inputs(|| (State::default(), c.events.clone()))
        .bench_local_values(|(mut state, events)| {
            for (e, t) in events.into_iter().zip(&c.tokens) {
                fold_owned(&mut state, &policy, e, None, t.as_ref());
            }
            state
        });
}

#[divan::bench(args = inputs(), sample_count = 10)]
fn fold_counting(bencher: Bencher, input: Input) {
    let c = &corpora()[input.0];
    let policy = policy();
    bencher
        .counter(ItemsCount::new(c.events.len()))
        .with_inputs(State::default)
        .bench_local_values(|mut state| {
            for e in &c.events {
                fold(&mut state, &policy, e);
            }
            state
        });
}

#[divan::bench(args = inputs(), sample_count = 30)]
fn decode_and_fold(bencher: Bencher, input: Input) {
    let c = &corpora()[input.0];
    let policy = policy();
    bencher
        .counter(ItemsCount::new(c.events.len()))
        .with_inputs(State::default)
        .bench_local_values(|mut state| {
            for (bytes, t) in c.msgpack.iter().zip(&c.tokens) {
                let e = Envelope::decode(bytes, Encoding::Msgpack).expect("corpus decodes");
                fold_owned(&mut state, &policy, e, None, t.as_ref());
            }
            state
        });
}

#[divan::bench(args = inputs(), sample_count = 30)]
fn decode_json(bencher: Bencher, input: Input) {
    let c = &corpora()[input.0];
    bencher
        .counter(ItemsCount::new(c.events.len()))
        .bench_local(|| {
            for bytes in &c.json {
                divan::black_box(Envelope::decode(bytes, Encoding::Json).expect("corpus decodes"));
            }
        });
}

fn main() {
    if corpora().iter().all(|c| c.name == "synthetic-short") && wanted("all") {
        eprintln!("no transcript found: only the synthetic corpus is measured");
    }
    divan::main();
}
