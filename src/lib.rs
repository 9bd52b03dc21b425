//! contextfold: lossless, bounded context for LLM agents.
//!
//! - [`core`]: the pure, deterministic heart (events, fold, policy, assembly).
//! - [`log`], [`store`]: the event log and the durable state (adapters).

pub mod core;
pub mod log;
pub mod nats;
pub mod store;
