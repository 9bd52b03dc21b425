//! contextfold: lossless, bounded context for LLM agents.
//!
//! - [`core`]: the pure, deterministic heart (events, fold, policy, assembly).
//! - [`log`], [`store`]: the event log and the durable state (adapters).
//! - [`runtime`]: the engine, the sweep runner and the embedded pipeline.
//! - [`import`]: real agent transcripts read as inbound events.
//! - [`api`]: the request/reply API (pure handlers, JSON dispatch, NATS service).
//! - [`summarizer`]: writing summaries (LLM, deterministic, external), with
//!   deadlines, retries, validation and escalation (an adapter).
//! - [`telemetry`]: every metric name, and the operational events that log
//!   and count them.
//! - [`http`]: the operators' HTTP server (`/metrics`, `/healthz`, `/readyz`).
//! - [`blocking`]: pure CPU work of the async adapters, off their workers.
//! - [`secret`]: secrets that are never printed, and URLs without their
//!   credentials.

/// The cause of an error kept whole (an error value, or a sentence where
/// there is none), so `{err:#}` and `Error::source` reach it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub mod api;
pub mod audit_text;
pub mod blocking;
pub mod config;
pub mod core;
pub mod demo;
pub mod gateway;
pub mod http;
pub mod import;
pub mod log;
pub mod nats;
pub mod plot;
pub mod runtime;
pub mod secret;
pub mod store;
pub mod summarizer;
pub mod telemetry;
pub mod testing;
