//! The small policy the fold and NATS tests share: a 6,000-token window and
//! small leaf/condensed targets, so a few dozen turns already compact.

use contextfold::core::policy::PolicyConfig;

pub fn small_policy() -> PolicyConfig {
    PolicyConfig {
        default_context_window: 6000,
        fresh_tail_count: 6,
        leaf_chunk_tokens: 1200,
        leaf_target_tokens: 200,
        condensed_target_tokens: 200,
        leaf_fanout: 3,
        condensed_fanout: 2,
        ..PolicyConfig::default()
    }
}
