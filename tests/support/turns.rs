//! Synthetic turns for the NATS tests: alternating user and assistant
//! turns of `words` words each, ids `<conv>#<i>`, two seconds apart.

use contextfold::core::event::{Envelope, EventBody, TurnAppended};
use contextfold::core::message::{ChatMessage, Role};
use std::ops::Range;

/// Turns `range` of conversation `conv`.
pub fn turns(conv: &str, range: Range<usize>, words: usize) -> Vec<Envelope> {
    range
        .map(|i| {
            let role = if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            };
            let text: String = (0..words)
                .map(|w| format!("{conv}-w{}-{} ", (w * 7 + i) % 89, i % 5))
                .collect();
            Envelope::new(
                format!("{conv}#{i}"),
                conv,
                1_700_000_000_000 + i as u64 * 2_000,
                EventBody::TurnAppended(TurnAppended {
                    message: ChatMessage::text(role, format!("turn {i}: {text}")),
                    model: None,
                    sender: Some("agent".into()),
                    usage: None,
                    metadata: None,
                }),
            )
        })
        .collect()
}
