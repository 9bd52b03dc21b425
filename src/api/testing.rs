//! A small synthetic conversation folded through the embedded pipeline
//! (with the deterministic summarizer), so the handlers' tests see real
//! leaf and condensed summaries, tool groups and history.

use crate::core::event::*;
use crate::core::message::{ChatMessage, FunctionCall, Role, ToolCall};
use crate::core::policy::PolicyConfig;
use crate::core::state::{Conversation, State};
use std::sync::OnceLock;

pub const CONV: &str = "team:alpha/session 1";
/// A phrase said once, early, so it ends up under summaries.
pub const NEEDLE: &str = "deploy key K-7731";
pub const T0: u64 = 1_700_000_000_000;

fn words(n: usize, seed: usize) -> String {
    (0..n)
        .map(|i| format!("w{}x{} ", (i * 7 + seed) % 97, seed % 13))
        .collect()
}

fn turn(m: ChatMessage) -> EventBody {
    EventBody::TurnAppended(TurnAppended {
        message: m,
        model: None,
        sender: Some("agent-7".into()),
        usage: None,
        metadata: None,
    })
}

/// The fixture's inbound events, in order.
pub fn events() -> Vec<Envelope> {
    let mut out = Vec::new();
    let mut time = T0;
    let mut push = |body: EventBody| {
        time += 1500;
        let id = format!("e{}", out.len() + 1);
        out.push(Envelope::new(id, CONV, time, body));
    };
    push(EventBody::ModelDeclared(ModelDeclared {
        model: "gpt-4o".into(),
        context_window: Some(6000),
    }));
    push(turn(ChatMessage::text(
        Role::User,
        format!("Rotate the {NEEDLE} on the billing host, then fix src/billing/invoice.rs."),
    )));
    for i in 0..40 {
        match i % 4 {
            0 => push(turn(ChatMessage::text(
                Role::User,
                format!("step {i}: {}", words(120, i)),
            ))),
            1 | 2 => {
                let id = format!("call_{i}");
                let mut call = ChatMessage::text(Role::Assistant, "");
                call.content = None;
                call.tool_calls = vec![ToolCall {
                    id: id.clone(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: "read_file".into(),
                        arguments: format!("{{\"path\":\"src/billing/f{i}.rs\"}}"),
                    },
                }];
                push(turn(call));
                let mut result = ChatMessage::text(Role::Tool, words(180, i + 3));
                result.tool_call_id = Some(id);
                push(turn(result));
            }
            _ => push(turn(ChatMessage::text(
                Role::Assistant,
                format!("done with step {i}: {}", words(90, i + 1)),
            ))),
        }
        if i == 20 {
            push(EventBody::ProviderErrorObserved(ProviderErrorObserved {
                error: "prompt is too long: 208423 tokens > 200000 maximum".into(),
                model: None,
            }));
        }
        if i == 30 {
            push(EventBody::CompactionRequested(CompactionRequested {
                instructions: Some("keep every file path".into()),
                ..CompactionRequested::default()
            }));
        }
    }
    push(turn(ChatMessage::text(Role::User, "What is left to do?")));
    out
}

/// Folds [`events`] one by one through the embedded pipeline.
pub fn fold_events(policy: &PolicyConfig, events: &[Envelope]) -> State {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("test runtime");
    rt.block_on(async {
        let mut p = crate::testing::memory_pipeline(policy.clone())
            .await
            .expect("pipeline");
        for e in events {
            p.ingest(std::slice::from_ref(e)).await.expect("ingest");
        }
        p.engine.materialized().expect("a memory store reads back")
    })
}

/// The folded fixture (built once per test binary).
pub fn folded() -> (&'static State, &'static PolicyConfig) {
    static FIXTURE: OnceLock<(State, PolicyConfig)> = OnceLock::new();
    let (s, p) = FIXTURE.get_or_init(|| {
        let policy = crate::testing::small_policy();
        (fold_events(&policy, &events()), policy)
    });
    (s, p)
}

pub fn conv(state: &State) -> &Conversation {
    &state.conversations[CONV]
}

#[test]
fn fixture_has_leaf_and_condensed_summaries() {
    let (state, _) = folded();
    let c = conv(state);
    assert!(c.summaries.iter().any(|s| s.depth == 0));
    assert!(c.summaries.iter().any(|s| s.depth >= 1), "{:#?}", c.history);
    assert!(c.turns.len() > 50);
}
