//! Assembly latency for a conversation of 26,500 turns with a context of
//! about 155,000 tokens (lossless-claw reports about 50 ms for this size;
//! the goal here is under 0.5 ms). Four shapes (`support/shapes.rs`:
//! `compacted`, `compacted_opened`, `raw_newest_155k`, `raw_all_155k`),
//! each built once before timing and described on stderr.
//!
//! `compacted` meets the goal (about 0.1 ms on the 2-core machine). The
//! others send far more: `compacted_opened` is the same conversation with
//! the room given back, summaries opened into about 10,000 masked turns
//! (a reply some 55 times `compacted`'s); `raw_all_155k` sends all 26,500
//! turns; and since older tool output is masked (DESIGN 14),
//! `raw_newest_155k` fits 1,464 messages in its budget where it fitted
//! 461. They take about 2.5 to 10 ms (see
//! `docs/notes/issue-26.md`, twenty-eighth pass).
//!
//! Each shape is timed as `borrowed` (`assemble_borrowed`: stored turns
//! borrowed from the state, what a server serializing the answer needs)
//! and `owned` (`assemble`: every message copied out). The same shapes
//! over NATS request/reply: `cargo bench --bench nats_assemble`.
//!
//! Run: `cargo bench --bench assembly`.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/transcripts.rs"]
mod transcripts;

#[path = "support/shapes.rs"]
mod shapes;

use contextfold::core::assembly::{assemble, assemble_from};
use contextfold::core::state::{Conversation, Resident, State};
use contextfold::store::redb_backend::RedbBackend;
use contextfold::store::state_store::{BodyCache, StateStore};
use divan::Bencher;
use shapes::Shape;
use std::sync::OnceLock;

static COMPACTED: OnceLock<Option<Shape>> = OnceLock::new();
static COMPACTED_OPENED: OnceLock<Option<Shape>> = OnceLock::new();
static RAW_NEWEST: OnceLock<Option<Shape>> = OnceLock::new();
static RAW_ALL: OnceLock<Option<Shape>> = OnceLock::new();

fn shape(name: &str) -> Option<&'static Shape> {
    let cell = match name {
        "compacted" => &COMPACTED,
        "compacted_opened" => &COMPACTED_OPENED,
        "raw_newest_155k" => &RAW_NEWEST,
        _ => &RAW_ALL,
    };
    cell.get_or_init(|| shapes::build(name)).as_ref()
}

/// What a server answering from state does: stored turns borrowed, the
/// result ready to serialize.
#[divan::bench(args = shapes::NAMES, sample_count = 300)]
fn borrowed(bencher: Bencher, name: &str) {
    let Some(s) = shape(name) else {
        eprintln!("{name} skipped: shared transcripts absent");
        return;
    };
    bencher.bench(|| assemble_from(&s.conv, &Resident, &s.policy, &s.request));
}

/// The same with every message copied out of the state (`assemble`).
#[divan::bench(args = shapes::NAMES, sample_count = 300)]
fn owned(bencher: Bencher, name: &str) {
    let Some(s) = shape(name) else {
        eprintln!("{name} skipped: shared transcripts absent");
        return;
    };
    bencher.bench(|| assemble(&s.conv, &s.policy, &s.request));
}

/// A shape committed to a redb state store of its own: the conversation
/// as the engine holds it after a commit (no body resident), and its store.
struct Stored {
    conv: Conversation,
    store: StateStore<RedbBackend>,
    _dir: tempfile::TempDir,
}

/// `cache_bytes` 0: every body is read from the store (cold).
fn stored(s: &Shape, cache_bytes: u64) -> Stored {
    let dir = tempfile::tempdir().expect("temp dir");
    let backend = RedbBackend::open(&dir.path().join("state.redb")).expect("redb");
    let mut store =
        StateStore::with_cache(backend, std::sync::Arc::new(BodyCache::new(cache_bytes)));
    let mut state = State::default();
    state
        .conversations
        .insert(s.conv.key.clone(), s.conv.clone());
    let dirty = [s.conv.key.clone()].into_iter().collect();
    store
        .commit(&mut state, &dirty, 1, "bench")
        .expect("commit");
    let conv = state.conversations.remove(&s.conv.key).expect("the shape");
    Stored {
        conv,
        store,
        _dir: dir,
    }
}

static COLD: OnceLock<Option<Stored>> = OnceLock::new();
static WARM: OnceLock<Option<Stored>> = OnceLock::new();

/// The compacted shape with its bodies in a state store: `cold` reads every
/// body the reply sends from the store (no cache), `warm` from the body
/// cache (what the engine keeps of an active conversation).
#[divan::bench(args = ["cold", "warm"], sample_count = 300)]
fn compacted_from_store(bencher: Bencher, temperature: &str) {
    let Some(s) = shape("compacted") else {
        eprintln!("compacted skipped: shared transcripts absent");
        return;
    };
    let cell = if temperature == "cold" { &COLD } else { &WARM };
    let Some(st) = cell
        .get_or_init(|| Some(stored(s, if temperature == "cold" { 0 } else { 128 << 20 })))
        .as_ref()
    else {
        return;
    };
    // Warm: the first reply fills the cache.
    assemble_from(&st.conv, &st.store.bodies(), &s.policy, &s.request).expect("assembles");
    // A reader per request, as the API takes one.
    bencher.bench(|| {
        assemble_from(&st.conv, &st.store.bodies(), &s.policy, &s.request).expect("assembles")
    });
}

fn main() {
    // Build every shape before timing, so the descriptions come first.
    for name in shapes::NAMES {
        shape(name);
    }
    divan::main();
}
