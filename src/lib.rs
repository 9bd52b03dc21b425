//! contextfold: lossless, bounded context for LLM agents.
//!
//! - [`core`]: the pure, deterministic heart (events, fold, policy, assembly).
//! - [`log`], [`store`]: the event log and the durable state (adapters).
//! - [`import`]: real agent transcripts read as inbound events.

pub mod core;
pub mod import;
pub mod log;
pub mod store;
