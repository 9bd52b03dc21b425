//! contextfold: lossless, bounded context for LLM agents.
//!
//! - [`core`]: the pure, deterministic heart (events, fold, policy, assembly).
//! - [`log`], [`store`]: the event log and the durable state (adapters).
//! - [`summarizer`]: writing summaries (LLM, deterministic, external), with
//!   deadlines, retries, validation and escalation (an adapter).

pub mod core;
pub mod log;
pub mod store;
pub mod summarizer;
