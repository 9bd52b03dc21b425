//! The gateway: an HTTP server in front of an upstream LLM provider that
//! speaks OpenAI Chat Completions, OpenAI Responses and Anthropic Messages,
//! keeps every turn in contextfold, and past the budget sends the model
//! contextfold's assembled context. Agents change nothing but their base
//! URL (docs/gateway.md).
//!
//! What it owns, one file a job:
//! - `surface.rs`: the three protocols: what is read of a request, how an
//!   item becomes stored turns and its identity, provider-shaped errors;
//! - `keying.rs`: which conversation a request continues, what is new,
//!   forks, the ids that make a retry change nothing;
//! - `rewrite.rs`: `[client head][summary block][fresh tail]`, byte for
//!   byte, tool pairs whole;
//! - `tee.rs`: streams passed through as they arrive and read back into
//!   the turn stored when they end;
//! - `upstream.rs`: where a path goes, which headers go with it, the
//!   credential;
//! - `store.rs` and `spool.rs`: the embedded pipeline or NATS, the summary
//!   blocks, turns kept while NATS is away;
//! - `compaction.rs`: Codex's compaction contract and `/responses/compact`
//!   answered from contextfold;
//! - `shadow.rs`: the per-conversation report;
//! - `server.rs`: the handler that puts them together.
//!
//! What a crash leaves: turns already handed to the store are in its log
//! (embedded: fsynced per batch; NATS: acknowledged by the stream, or in
//! the spool file); turns in flight are republished by the client's retry
//! under the same ids. The keying index and the blocks are memory, rebuilt
//! from traffic and state.

pub mod compaction;
pub mod item_memo;
pub mod keying;
pub mod rewrite;
pub mod server;
pub mod shadow;
pub mod spool;
pub mod store;
pub mod surface;
pub mod sweeper;
pub mod tee;
pub mod upstream;

pub use crate::config::{GatewayConfig, GatewayMode, GatewayTenant, StoreUnavailable};
pub use server::Gateway;
pub use store::Store;

use crate::config::Config;
use std::net::SocketAddr;
use std::sync::Arc;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Upstream(#[from] upstream::UpstreamError),
    #[error("opening the store: {0}")]
    Store(#[source] crate::BoxError),
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// The budget past which requests are assembled, when `[gateway]
/// budget_tokens` does not say: the policy's budget of a conversation that
/// declared no window.
pub fn policy_budget(config: &Config) -> u64 {
    crate::core::policy::budget(&crate::core::state::Conversation::new(""), &config.policy)
}

/// A running gateway.
pub struct Running {
    pub addr: SocketAddr,
    pub gateway: Arc<Gateway>,
    pub task: tokio::task::JoinHandle<()>,
}

/// Binds `config.gateway.listen` and serves until `shutdown` resolves.
pub async fn start(
    config: &Config,
    store: Store,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<Running, GatewayError> {
    // Its metrics are served at /contextfold/v1/metrics.
    if crate::telemetry::install_prometheus().is_ok() {
        crate::telemetry::describe();
    }
    let gateway = Arc::new(Gateway::new(
        config.gateway.clone(),
        policy_budget(config),
        store,
    )?);
    let addr = config.gateway.listen;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| GatewayError::Listen { addr, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| GatewayError::Listen { addr, source })?;
    let app = server::router(gateway.clone());
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await;
        if let Err(e) = served {
            crate::telemetry::GatewayStoreFailed {
                error: &format!("the gateway's server stopped: {e}"),
            }
            .emit();
        }
    });
    Ok(Running {
        addr,
        gateway,
        task,
    })
}

/// The store the configuration asks for: NATS when servers are given,
/// else the embedded pipeline under the data directory.
pub async fn open_store(config: &Config, nats: bool) -> Result<Store, GatewayError> {
    if nats {
        let dir = config
            .gateway
            .spool_dir
            .clone()
            .unwrap_or_else(|| config.data_dir.join("gateway-spool"));
        let spool = Arc::new(spool::Spool::open(&dir).map_err(|e| GatewayError::Store(e.into()))?);
        Store::nats(config, spool)
            .await
            .map_err(|e| GatewayError::Store(e.into()))
    } else {
        Store::embedded(config).map_err(|e| GatewayError::Store(e.into()))
    }
}
