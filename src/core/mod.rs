//! The pure core: events, state, the fold, the compaction policy, assembly
//! and the deterministic summarizer. Nothing here does I/O, reads a clock or
//! a random source, or knows about tokio; everything can be replayed.

pub mod assembly;
pub mod audit;
pub mod derived_id;
pub mod event;
pub mod fallback_summary;
pub mod fold;
pub mod glob;
pub mod identifiers;
pub mod intake;
pub mod line_pattern;
pub mod mask;
pub mod measure;
pub mod message;
pub mod overflow;
pub mod policy;
pub mod policy_config;
pub mod probes;
pub mod recall;
pub mod relevance;
pub mod spend;
pub mod state;
pub mod summary;
pub mod sweep;
pub mod tokens;
pub mod turn_notes;
