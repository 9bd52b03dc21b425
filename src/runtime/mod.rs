//! The runtime around the pure core: the engine (fold + durable state), the
//! sweep runner (summaries under a deadline) and the embedded pipeline that
//! wires them to the embedded event log on one machine.

pub mod audit;
pub mod embedded;
pub mod engine;
pub mod read_ahead;
pub mod recall;
pub mod sweep;
