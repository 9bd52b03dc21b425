//! The 26,500-turn conversation shapes of the assembly benchmarks (the
//! in-process `assembly` bench and the over-NATS `nats_assemble` bench),
//! each with about 125,000 to 155,000 tokens of context:
//! - `compacted`: 26,500 real turns (the tau-bench, pi and Claude Code
//!   transcripts repeated, ids rewritten; see `transcripts.rs`) run through
//!   the embedded pipeline with the deterministic summarizer, context window
//!   1,000,000 and threshold / target at 0.17 / 0.16 of it, chosen so that
//!   the context ends as summaries plus raw turns at about 155k tokens;
//!   assembled whole, with its summaries as they are (the request's
//!   `summaries_as_they_are`, as the gateway's summary block asks).
//! - `compacted_opened`: the same conversation asked with the default
//!   request: the room left under the window (1,000,000 tokens) goes back
//!   (DESIGN 14), so summaries open into the turns they cover, masked,
//!   until it is spent: about 10,000 messages and 1,000,000 tokens, the
//!   largest answer this conversation gives.
//! - `raw_newest_155k`: the same 26,500 real turns folded without
//!   compaction; assembled with a 155,000-token budget, so the newest turns
//!   fill it and the rest is listed as left out.
//! - `raw_all_155k`: 26,500 short synthetic turns (user and assistant, with
//!   tool calls) that all fit in about 155,000 tokens: every turn is sent,
//!   the most messages one assembly can produce at this size.
//!
//! Include it after `transcripts.rs`:
//! `#[path = "support/transcripts.rs"] mod transcripts;`
//! `#[path = "support/shapes.rs"] mod shapes;`

#![allow(dead_code)]

use crate::transcripts;
use contextfold::core::assembly::{assemble, check_tool_pairing, AssemblyRequest};
use contextfold::core::event::{Envelope, EventBody, TurnAppended};
use contextfold::core::fold::fold;
use contextfold::core::message::{ChatMessage, FunctionCall, Role, ToolCall};
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::{ContextItem, Conversation, State};
use std::sync::OnceLock;
use std::time::Instant;

pub const TURNS: usize = 26_500;
pub const CONTEXT_TOKENS: u64 = 155_000;
/// The conversation's key in every shape.
pub const KEY: &str = "bench:long";

/// The shapes, by name.
pub const NAMES: [&str; 4] = [
    "compacted",
    "compacted_opened",
    "raw_newest_155k",
    "raw_all_155k",
];

/// A folded conversation, the policy it was folded under and the request
/// that assembles it.
pub struct Shape {
    pub conv: Conversation,
    pub policy: PolicyConfig,
    pub request: AssemblyRequest,
}

/// Builds shape `name` (one of [`NAMES`]) and describes it on stderr;
/// `None` (with a message) when a shape needs the shared transcripts and
/// they are absent.
pub fn build(name: &str) -> Option<Shape> {
    let started = Instant::now();
    let shape = match name {
        "compacted" => compacted(true)?,
        "compacted_opened" => compacted(false)?,
        "raw_newest_155k" => raw_newest()?,
        "raw_all_155k" => raw_all(),
        other => panic!("unknown shape {other:?}; known: {NAMES:?}"),
    };
    describe(name, &shape, started.elapsed());
    Some(shape)
}

fn describe(name: &str, s: &Shape, built: std::time::Duration) {
    let out = assemble(&s.conv, &s.policy, &s.request).expect("a shape holds its bodies");
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
        s.conv.context.tokens(),
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

/// The compacted conversation, folded once for both of its shapes.
static COMPACTED: OnceLock<Option<(Conversation, PolicyConfig)>> = OnceLock::new();

/// The compacted conversation, asked with its summaries as they are or
/// not.
fn compacted(summaries_as_they_are: bool) -> Option<Shape> {
    let (conv, policy) = COMPACTED.get_or_init(fold_compacted).clone()?;
    Some(Shape {
        conv,
        policy,
        request: AssemblyRequest {
            summaries_as_they_are,
            ..AssemblyRequest::default()
        },
    })
}

fn fold_compacted() -> Option<(Conversation, PolicyConfig)> {
    let events = transcripts::long_conversation(KEY, TURNS)?;
    let policy = PolicyConfig {
        default_context_window: 1_000_000,
        // Chosen for 26,500 of these turns to end at about 155,000 tokens
        // (about 125,000 now).
        context_threshold: 0.17,
        context_target: 0.16,
        ..PolicyConfig::default()
    };
    // On a thread of its own: a caller inside a runtime cannot start one.
    let conv = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                    .expect("tokio runtime");
                rt.block_on(async {
                    let mut p = contextfold::testing::memory_pipeline(policy.clone())
                        .await
                        .expect("pipeline");
                    for chunk in events.chunks(64) {
                        p.ingest(chunk).await.expect("memory log");
                    }
                    // Every body resident, as the state held them before
                    // bodies moved to the store.
                    p.engine
                        .materialized_conversation(KEY)
                        .expect("the memory store reads back")
                })
            })
            .join()
            .expect("folding the compacted shape")
    })?;
    Some((conv, policy))
}

fn raw_newest() -> Option<Shape> {
    let events = transcripts::long_conversation(KEY, TURNS)?;
    let policy = raw_policy();
    Some(Shape {
        conv: fold_all(&events, &policy),
        policy,
        request: AssemblyRequest {
            budget: Some(CONTEXT_TOKENS),
            prompt: None,
            prompt_aware_eviction: false,
            summaries_as_they_are: false,
        },
    })
}

fn turn(n: usize, message: ChatMessage) -> Envelope {
    Envelope::new(
        format!("{KEY}-s{n}"),
        KEY,
        1_700_000_000_000 + n as u64 * 1000,
        EventBody::TurnAppended(TurnAppended::from(message)),
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

fn raw_all() -> Shape {
    let policy = raw_policy();
    let conv = fold_all(&synthetic_turns(), &policy);
    let budget = conv.context.tokens().max(CONTEXT_TOKENS);
    Shape {
        conv,
        policy,
        request: AssemblyRequest {
            budget: Some(budget),
            prompt: None,
            prompt_aware_eviction: false,
            summaries_as_they_are: false,
        },
    }
}
