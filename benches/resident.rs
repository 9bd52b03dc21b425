//! Resident memory per turn (issue 11's "at most 200 bytes resident per
//! turn beyond a bounded body cache, measured"): the live heap, counted by
//! a global allocator, of an engine that folded a fleet into a redb state
//! store with the body cache off, divided by the turns it holds; then the
//! same after every conversation is dropped from memory.
//!
//! Not a timing bench: it prints the bytes. The fleet is issue 11's shape
//! (conversations of user turns, assistant tool calls and their results,
//! ~1.8 KB of text a turn), folded as `run` folds: commits of 512 records.
//!
//! ```text
//! cargo bench --bench resident
//! CONTEXTFOLD_BENCH_CONVERSATIONS=2000   # conversations
//! CONTEXTFOLD_BENCH_TURNS=100            # turns each
//! CONTEXTFOLD_BENCH_WINDOW=32000         # declared window (compaction)
//! ```

use contextfold::core::event::{
    Encoding, Envelope, EventBody, ModelDeclared, Origin, TurnAppended,
};
use contextfold::core::message::{ChatMessage, FunctionCall, Role, ToolCall};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::Turn;
use contextfold::log::LogRecord;
use contextfold::runtime::engine::Engine;
use contextfold::store::redb_backend::RedbBackend;
use contextfold::store::state_store::{BodyCache, StateStore};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as given.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as given.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as given.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// ~`bytes` of words, paths and ids, different for every `seed`.
fn text(seed: usize, bytes: usize) -> String {
    let mut out = String::with_capacity(bytes + 64);
    let mut i = seed;
    while out.len() < bytes {
        i = i
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407)
            >> 1;
        match i % 7 {
            0 => out.push_str(&format!("src/module_{}/file_{}.rs ", i % 97, i % 13)),
            1 => out.push_str(&format!("id-{:x} ", i % 0xfffff)),
            _ => out.push_str(["the ", "build ", "fails ", "because ", "config ", "tests "][i % 6]),
        }
    }
    out
}

fn main() {
    let conversations = env_or("CONTEXTFOLD_BENCH_CONVERSATIONS", 2000);
    let turns = env_or("CONTEXTFOLD_BENCH_TURNS", 100);
    let window = env_or("CONTEXTFOLD_BENCH_WINDOW", 32000) as u64;
    let dir = tempfile::tempdir().expect("temp dir");
    let baseline = LIVE.load(Ordering::Relaxed);
    let backend =
        RedbBackend::open_with_cache(&dir.path().join("state.redb"), 1 << 20).expect("redb");
    let store = StateStore::with_cache(backend, Arc::new(BodyCache::new(0)));
    let mut engine = Engine::open_with(store, PolicyConfig::default()).expect("engine");
    let opened = LIVE.load(Ordering::Relaxed);
    let mut position = 0u64;
    let mut batch = Vec::new();
    let fold = |engine: &mut Engine<RedbBackend>, batch: &mut Vec<LogRecord>| {
        engine.apply_batch(std::mem::take(batch)).expect("fold");
        engine.commit().expect("commit");
    };
    // Round-robin: every conversation advances one turn at a time, as a
    // cluster's traffic would (all of them stay active to the end).
    for t in 0..=turns {
        for c in 0..conversations {
            let key = format!("agent-{c:05}");
            let body = if t == 0 {
                EventBody::ModelDeclared(ModelDeclared {
                    model: "gpt-4o".into(),
                    context_window: Some(window),
                })
            } else {
                let seed = c * 1000 + t;
                let msg = match t % 4 {
                    1 => ChatMessage::text(Role::User, text(seed, 1800)),
                    2 => {
                        let mut m = ChatMessage::text(Role::Assistant, text(seed, 1700));
                        m.tool_calls = vec![ToolCall {
                            id: format!("call_{c}_{t}"),
                            kind: "function".into(),
                            function: FunctionCall {
                                name: "read_file".into(),
                                arguments: format!("{{\"path\":\"src/f{t}.rs\"}}"),
                            },
                        }];
                        m
                    }
                    3 => {
                        let mut m = ChatMessage::text(Role::Tool, text(seed, 1800));
                        m.tool_call_id = Some(format!("call_{c}_{}", t - 1));
                        m
                    }
                    _ => ChatMessage::text(Role::Assistant, text(seed, 1800)),
                };
                EventBody::TurnAppended(TurnAppended::from(msg))
            };
            let e = Envelope::new(
                format!("{key}-e{t}"),
                &key,
                1_700_000_000_000 + position * 1000,
                body,
            );
            position += 1;
            batch.push(LogRecord::unaddressed(
                position,
                Origin::Agent,
                Encoding::Msgpack,
                e.to_msgpack(),
            ));
            if batch.len() == 512 {
                fold(&mut engine, &mut batch);
            }
        }
    }
    fold(&mut engine, &mut batch);
    let folded_turns: usize = engine
        .state
        .conversations
        .values()
        .map(|c| c.turns.len())
        .sum();
    let summaries: usize = engine
        .state
        .conversations
        .values()
        .map(|c| c.summaries.len())
        .sum();
    let summary_text: usize = engine
        .state
        .conversations
        .values()
        .flat_map(|c| &c.summaries)
        .map(|s| s.content.len())
        .sum();
    let resident = LIVE.load(Ordering::Relaxed) - opened;
    // Where it goes, by part (capacities, as allocated).
    let convs = engine.state.conversations.values();
    let (
        mut turns_b,
        mut applied_b,
        mut set_b,
        mut context_b,
        mut ids_b,
        mut bodies_b,
        mut history_b,
    ) = (0, 0, 0, 0, 0, 0, 0);
    for c in convs {
        turns_b += c.turns.capacity() * std::mem::size_of::<Turn>();
        applied_b += c.applied.capacity() * 16;
        set_b += c.applied_set.capacity() * 17;
        context_b += c.context.capacity() * 16;
        ids_b += c
            .turns
            .iter()
            .map(|t| t.event_id.capacity() + t.tool_ids.len() * 8)
            .sum::<usize>();
        bodies_b += c.bodies.bytes() as usize;
        history_b += c
            .history
            .iter()
            .map(|h| 72 + h.detail.len() + h.event_id.len() + h.event_type.len())
            .sum::<usize>();
    }
    let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
    for c in engine.state.conversations.values() {
        for h in &c.history {
            *kinds.entry(h.event_type.as_str()).or_default() += 1;
        }
    }
    println!("  history entries by type: {kinds:?}");
    let per = |b: usize| b / folded_turns.max(1);
    println!(
        "  by part, B per turn: turns {} applied {} applied_set {} context {} ids {} resident bodies {} history {}",
        per(turns_b), per(applied_b), per(set_b), per(context_b), per(ids_b), per(bodies_b), per(history_b)
    );
    engine.evict_all();
    let evicted = LIVE.load(Ordering::Relaxed).saturating_sub(opened);
    let store_bytes = {
        let held = LIVE.load(Ordering::Relaxed);
        drop(engine);
        held.saturating_sub(LIVE.load(Ordering::Relaxed))
    };
    println!(
        "resident: {conversations} conversations x {turns} turns (~1.8 KB each), window {window}, \
         body cache off, redb cache 1 MiB"
    );
    println!(
        "  size_of::<Turn>()                {} B",
        std::mem::size_of::<Turn>()
    );
    println!("  engine opened                    {} B", opened - baseline);
    println!(
        "  all resident: {folded_turns} turns, {summaries} summaries ({} KiB of summary text)",
        summary_text / 1024
    );
    println!(
        "  live heap                        {:.1} MiB = {} B per turn ({} B per turn without the summary text)",
        resident as f64 / (1 << 20) as f64,
        resident / folded_turns.max(1),
        resident.saturating_sub(summary_text) / folded_turns.max(1)
    );
    println!(
        "  after evicting every conversation {:.1} MiB = {} B per turn",
        evicted as f64 / (1 << 20) as f64,
        evicted / folded_turns.max(1)
    );
    println!(
        "  of which the engine and its redb store hold {:.1} MiB (freed when it is dropped)",
        store_bytes as f64 / (1 << 20) as f64
    );
}
