//! Shared test harness: integration tests include it with `mod support;`.
#![allow(dead_code)]

pub mod cli;
pub mod nats_server;
pub mod replay;
pub mod serve;
pub mod spend;
pub mod tenants;
pub mod turns;
