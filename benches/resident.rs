//! Resident memory per turn (issue 11's "at most 200 bytes resident per
//! turn beyond a bounded body cache, measured"): the live heap, counted by
//! a global allocator, of an engine that folded a fleet into a redb state
//! store with the body cache off, divided by the turns it holds; then the
//! same after every conversation is dropped from memory.
//!
//! Not a timing bench: it prints the bytes. The fleet is issue 11's shape
//! (conversations of user turns, assistant tool calls and their results,
//! ~1.8 KB of text a turn), folded as `run` folds: through the embedded
//! pipeline over a segment log, jobs run by the deterministic summarizer as
//! they are issued, commits of 512 records.
//!
//! ```text
//! cargo bench --bench resident
//! CONTEXTFOLD_BENCH_CONVERSATIONS=2000   # conversations
//! CONTEXTFOLD_BENCH_TURNS=100            # turns each
//! CONTEXTFOLD_BENCH_WINDOW=32000         # declared window (compaction)
//! ```

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::event::{Envelope, EventBody, ModelDeclared, TurnAppended};
use contextfold::core::message::{ChatMessage, FunctionCall, Role, ToolCall};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::Turn;
use contextfold::log::segment::SegmentLog;
use contextfold::runtime::embedded::Pipeline;
use contextfold::runtime::engine::Engine;
use contextfold::store::redb_backend::RedbBackend;
use contextfold::store::state_store::{BodyCache, StateStore};
use contextfold::summarizer::DeterministicSummarizer;
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
    // The tokenizers' tables (tens of MiB, loaded once per process) and the
    // piece memo are not state: loaded before anything is counted.
    contextfold::core::tokens::load_tokenizers();
    for seed in 0..200 {
        contextfold::core::tokens::count_text(
            contextfold::core::tokens::Encoding::O200kBase,
            &text(seed, 1800),
        );
    }
    // The same on the one blocking-pool thread the runtime may use: the
    // deterministic summaries are drafted there (`contextfold::blocking`),
    // and each thread has its own memo (bounded, not state). The thread
    // is kept for the whole bench so it is not replaced by a fresh one.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(1)
        .thread_keep_alive(std::time::Duration::from_secs(24 * 3600))
        .build()
        .expect("runtime");
    let before_pool = LIVE.load(Ordering::Relaxed);
    rt.block_on(rt.spawn_blocking(|| {
        for seed in 0..200 {
            contextfold::core::tokens::count_text(
                contextfold::core::tokens::Encoding::O200kBase,
                &text(seed, 1800),
            );
        }
    }))
    .expect("blocking pool");
    let pool_caches = LIVE.load(Ordering::Relaxed) - before_pool;
    let baseline = LIVE.load(Ordering::Relaxed);
    let backend =
        RedbBackend::open_with_cache(&dir.path().join("state.redb"), 1 << 20).expect("redb");
    let store = StateStore::with_cache(backend, Arc::new(BodyCache::new(0)));
    let engine = Engine::open_with(store, PolicyConfig::default()).expect("engine");
    let log = SegmentLog::open(&dir.path().join("log")).expect("log");
    let mut pipeline = rt
        .block_on(Pipeline::open(log, engine, DeterministicSummarizer))
        .expect("pipeline");
    let opened = LIVE.load(Ordering::Relaxed);
    let mut position = 0u64;
    let mut batch = Vec::new();
    let mut fold = |batch: &mut Vec<Envelope>| {
        rt.block_on(pipeline.ingest(&std::mem::take(batch)))
            .expect("fold");
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
            batch.push(e);
            if batch.len() == 512 {
                fold(&mut batch);
            }
        }
    }
    fold(&mut batch);
    let Pipeline {
        log, mut engine, ..
    } = pipeline;
    let log_bytes = {
        let held = LIVE.load(Ordering::Relaxed);
        drop(log);
        held.saturating_sub(LIVE.load(Ordering::Relaxed))
    };
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
    // Texts of summaries still in memory (a commit hands them to the store).
    let summary_text: usize = engine
        .state
        .conversations
        .values()
        .map(|c| c.summary_texts.len())
        .sum();
    let resident = LIVE.load(Ordering::Relaxed).saturating_sub(opened);
    // Where it goes: each part of every conversation freed in turn, the
    // bytes the allocator got back (capacities as allocated).
    {
        let mut parts: Vec<(&str, usize)> = Vec::new();
        macro_rules! take {
            ($name:expr, $field:ident) => {{
                let before = LIVE.load(Ordering::Relaxed);
                for c in engine.state.conversations.values_mut() {
                    drop(std::mem::take(&mut c.$field));
                }
                let after = LIVE.load(Ordering::Relaxed);
                parts.push(($name, (before - after) / folded_turns.max(1)));
            }};
        }
        take!("turns", turns);
        take!("summaries", summaries);
        take!("applied", applied);
        take!("history", history);
        take!("context", context);
        take!("bodies", bodies);
        take!("summary_texts", summary_texts);
        take!("recent", recent_user_turns);
        take!("flood", flood);
        take!("pending", pending_job);
        take!("rolling", rolling);
        take!("debt", debt);
        let before = LIVE.load(Ordering::Relaxed);
        engine.evict_all();
        parts.push((
            "the rest",
            (before - LIVE.load(Ordering::Relaxed)) / folded_turns.max(1),
        ));
        println!("  freed by field, B per turn: {parts:?}");
    }
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
    println!(
        "  token memos of the blocking-pool thread {pool_caches} B (primed before counting, not state)"
    );
    println!("  engine opened                    {} B", opened - baseline);
    println!(
        "  the segment log held             {:.1} MiB (not counted below)",
        log_bytes as f64 / (1 << 20) as f64
    );
    println!(
        "  all resident: {folded_turns} turns, {summaries} summaries ({summary_text} summary texts in memory)"
    );
    println!(
        "  live heap                        {:.1} MiB = {} B per turn",
        resident as f64 / (1 << 20) as f64,
        resident / folded_turns.max(1),
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
