//! The NATS JetStream adapter: subjects, connection, the streams and buckets
//! contextfold runs on, partition leases, and the JetStream event log.
//!
//! - [`config`]: `[nats]` settings ([`NatsConfig`]).
//! - [`connect`]: connection options ([`NatsOptions`]) and connecting.
//! - [`version`]: refusing servers too old for the features used.
//! - [`subjects`]: subject names and the conversation-key encoding.
//! - [`setup`]: create-or-validate of streams, KV and object store.
//! - [`leases`]: partition ownership through KV leases.
//! - [`event_log`]: [`crate::log::EventLog`] over the events stream.
//! - [`folder`]: the folder role (one engine per held partition).
//! - [`jobs`]: the compaction job on the work queue.
//! - [`summarizer_role`]: stateless workers running jobs from the queue.
//! - [`api_role`]: the API over NATS request/reply (public and per-partition
//!   subjects, forwarding to the owner, recall with its spend event).
//! - [`replies`]: which reply subjects the API answers on (inboxes only).
//! - [`serve`]: every role of one process, started and stopped together.

pub mod api_role;
pub mod config;
pub mod connect;
pub mod event_log;
pub mod folder;
pub mod jobs;
pub mod leases;
pub mod msg_id;
pub mod publish;
pub mod replies;
pub mod retry;
pub mod serve;
pub mod setup;
pub mod subjects;
pub mod summarizer_role;
pub mod version;

pub use config::NatsConfig;
pub use connect::NatsOptions;
pub use subjects::Subjects;

use crate::BoxError;
use std::path::PathBuf;

/// What went wrong talking to NATS, phrased for the operator.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    #[error("invalid NATS setting `{field}`: {reason}")]
    Config { field: &'static str, reason: String },
    #[error("cannot read {what} {path}: {source}")]
    File {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot connect to NATS at {servers}: {detail}")]
    Connect { servers: String, detail: String },
    #[error("nats-server {found} is not supported (need {minimum} or newer): {detail}")]
    ServerVersion {
        found: String,
        minimum: version::ServerVersion,
        detail: String,
    },
    #[error("JetStream is not enabled on NATS server {server}: start it with `-js` (or `jetstream {{}}` in its config)")]
    JetStreamDisabled { server: String },
    #[error("{resource} exists with settings contextfold cannot use: {detail}")]
    Incompatible { resource: String, detail: String },
    #[error("JetStream {operation} failed: {source}")]
    JetStream {
        operation: String,
        #[source]
        source: BoxError,
    },
    #[error(transparent)]
    Subject(#[from] subjects::SubjectError),
}

impl NatsError {
    /// A JetStream call that failed, naming what was attempted; `err` is
    /// the client's error (or, where there is none, a sentence).
    pub(crate) fn js(operation: impl Into<String>, err: impl Into<BoxError>) -> Self {
        NatsError::JetStream {
            operation: operation.into(),
            source: err.into(),
        }
    }
}
