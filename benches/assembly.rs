//! Assembly latency for a conversation of 26,500 turns with a context of
//! about 155,000 tokens (lossless-claw reports about 50 ms for this size;
//! the goal here is under 0.5 ms). Three shapes, each built once before
//! timing and described on stderr:
//! - `compacted`: 26,500 real turns (the tau-bench, pi and Claude Code
//!   transcripts repeated, ids rewritten) run through the embedded pipeline
//!   with the deterministic summarizer, context window 1,000,000 and
//!   threshold / target at 0.17 / 0.16 of it, chosen so that the context
//!   ends as summaries plus raw turns at about 155k tokens; assembled whole.
//! - `raw_newest_155k`: the same 26,500 real turns folded without
//!   compaction; assembled with a 155,000-token budget, so the newest turns
//!   fill it and the rest is listed as left out.
//! - `raw_all_155k`: 26,500 short synthetic turns (user and assistant, with
//!   tool calls) that all fit in about 155,000 tokens: every turn is sent,
//!   the most messages one assembly can produce at this size.
//!
//! Each shape is timed as `borrowed` (`assemble_borrowed`: stored turns
//! borrowed from the state, what a server serializing the answer needs)
//! and `owned` (`assemble`: every message copied out).
//!
//! Run: `cargo bench --bench assembly`.

#[path = "support/transcripts.rs"]
mod transcripts;

use contextfold::core::assembly::{
    assemble, assemble_borrowed, check_tool_pairing, AssemblyRequest,
};
use contextfold::core::event::{Envelope, EventBody, TurnAppended};
use contextfold::core::fold::fold;
use contextfold::core::message::{ChatMessage, FunctionCall, Role, ToolCall};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::{ContextItem, Conversation, State};
use contextfold::log::memory::MemoryLog;
use contextfold::runtime::embedded::Pipeline;
use contextfold::runtime::engine::Engine;
use contextfold::runtime::sweep::Deterministic;
use contextfold::store::memory_backend::MemoryBackend;
use divan::Bencher;
use std::sync::OnceLock;
use std::time::Instant;

const TURNS: usize = 26_500;
const CONTEXT_TOKENS: u64 = 155_000;
const KEY: &str = "bench:long";

struct Shape {
    conv: Conversation,
    policy: PolicyConfig,
    request: AssemblyRequest,
}

fn describe(name: &str, s: &Shape, built: std::time::Duration) {
    let out = assemble(&s.conv, &s.policy, &s.request);
    let summaries = s
        .conv
        .context
        .iter()
        .filter(|i| matches!(i, ContextItem::Summary(_)))
        .count();
    eprintln!(
        "{name}: {} turns, {} context items ({summaries} summaries, by depth {:?}), \
         {} context tokens; assembled {} messages, {} tokens (budget {}), {} left out; built in {built:.1?}",
        s.conv.turns.len(),
        s.conv.context.len(),
        s.conv.summaries_in_context_by_depth(),
        s.conv.context_tokens,
        out.messages.len(),
        out.tokens,
        out.budget,
        out.left_out.len(),
    );
    if let Err(e) = check_tool_pairing(&out.messages) {
        eprintln!("{name}: WARNING: tool pairing broken: {e}");
    }
}

fn fold_all(events: &[Envelope], policy: &PolicyConfig) -> Conversation {
    let mut state = State::default();
    for e in events {
        fold(&mut state, policy, e);
    }
    state
        .conversations
        .remove(KEY)
        .expect("the conversation was folded")
}

/// Never compacts: the threshold is far above the context.
fn raw_policy() -> PolicyConfig {
    PolicyConfig {
        default_context_window: 1_000_000_000,
        ..PolicyConfig::default()
    }
}

static COMPACTED: OnceLock<Option<Shape>> = OnceLock::new();
static RAW_NEWEST: OnceLock<Option<Shape>> = OnceLock::new();
static RAW_ALL: OnceLock<Shape> = OnceLock::new();

fn compacted() -> Option<&'static Shape> {
    COMPACTED
        .get_or_init(|| {
            let started = Instant::now();
            let events = transcripts::long_conversation(KEY, TURNS)?;
            let policy = PolicyConfig {
                default_context_window: 1_000_000,
                // Where 26,500 of these turns end at about 155,000 tokens.
                context_threshold: 0.17,
                context_target: 0.16,
                ..PolicyConfig::default()
            };
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("tokio runtime");
            let conv = rt.block_on(async {
                let engine =
                    Engine::open(MemoryBackend::default(), policy.clone()).expect("memory store");
                let mut p = Pipeline::open(MemoryLog::new(), engine, Deterministic)
                    .await
                    .expect("pipeline");
                for chunk in events.chunks(64) {
                    p.ingest(chunk).await.expect("memory log");
                }
                p.engine.state.conversations.remove(KEY)
            })?;
            let shape = Shape {
                conv,
                policy,
                request: AssemblyRequest::default(),
            };
            describe("compacted", &shape, started.elapsed());
            Some(shape)
        })
        .as_ref()
}

fn raw_newest() -> Option<&'static Shape> {
    RAW_NEWEST
        .get_or_init(|| {
            let started = Instant::now();
            let events = transcripts::long_conversation(KEY, TURNS)?;
            let policy = raw_policy();
            let shape = Shape {
                conv: fold_all(&events, &policy),
                policy,
                request: AssemblyRequest {
                    budget: Some(CONTEXT_TOKENS),
                    prompt: None,
                },
            };
            describe("raw_newest_155k", &shape, started.elapsed());
            Some(shape)
        })
        .as_ref()
}

fn turn(n: usize, message: ChatMessage) -> Envelope {
    Envelope::new(
        format!("{KEY}-s{n}"),
        KEY,
        1_700_000_000_000 + n as u64 * 1000,
        EventBody::TurnAppended(TurnAppended {
            message,
            model: None,
            sender: None,
            usage: None,
            metadata: None,
        }),
    )
}

/// Short turns in cycles of eight: user and assistant lines, then an
/// assistant tool call, its result and an answer. About 5.8 tokens a turn
/// (4 of them message overhead), so 26,500 turns make about 155,000.
fn synthetic_turns() -> Vec<Envelope> {
    (0..TURNS)
        .map(|n| {
            let m = match n % 8 {
                0 | 2 | 4 => ChatMessage::text(Role::User, "ok"),
                1 | 3 => ChatMessage::text(Role::Assistant, "ok"),
                5 => {
                    let mut m = ChatMessage::text(Role::Assistant, "");
                    m.content = None;
                    m.tool_calls = vec![ToolCall {
                        id: format!("c{n}"),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: "ls".into(),
                            arguments: "{}".into(),
                        },
                    }];
                    m
                }
                6 => {
                    let mut m = ChatMessage::text(Role::Tool, "ok");
                    m.tool_call_id = Some(format!("c{}", n - 1));
                    m
                }
                _ => ChatMessage::text(Role::Assistant, "done"),
            };
            turn(n, m)
        })
        .collect()
}

fn raw_all() -> &'static Shape {
    RAW_ALL.get_or_init(|| {
        let started = Instant::now();
        let policy = raw_policy();
        let conv = fold_all(&synthetic_turns(), &policy);
        let budget = conv.context_tokens.max(CONTEXT_TOKENS);
        let shape = Shape {
            conv,
            policy,
            request: AssemblyRequest {
                budget: Some(budget),
                prompt: None,
            },
        };
        describe("raw_all_155k", &shape, started.elapsed());
        shape
    })
}

/// The shapes, by name, for `args`.
const SHAPES: [&str; 3] = ["compacted", "raw_newest_155k", "raw_all_155k"];

fn shape(name: &str) -> Option<&'static Shape> {
    match name {
        "compacted" => compacted(),
        "raw_newest_155k" => raw_newest(),
        _ => Some(raw_all()),
    }
}

/// What a server answering from state does: stored turns borrowed, the
/// result ready to serialize.
#[divan::bench(args = SHAPES, sample_count = 300)]
fn borrowed(bencher: Bencher, name: &str) {
    let Some(s) = shape(name) else {
        eprintln!("{name} skipped: shared transcripts absent");
        return;
    };
    bencher.bench(|| assemble_borrowed(&s.conv, &s.policy, &s.request));
}

/// The same with every message copied out of the state (`assemble`).
#[divan::bench(args = SHAPES, sample_count = 300)]
fn owned(bencher: Bencher, name: &str) {
    let Some(s) = shape(name) else {
        eprintln!("{name} skipped: shared transcripts absent");
        return;
    };
    bencher.bench(|| assemble(&s.conv, &s.policy, &s.request));
}

fn main() {
    // Build every shape before timing, so the descriptions come first.
    compacted();
    raw_newest();
    raw_all();
    divan::main();
}
