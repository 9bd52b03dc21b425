//! `contextfold gateway`: the LLM gateway (src/gateway/, docs/gateway.md)
//! until SIGTERM or Ctrl-C.

use super::nats_args::NatsArgs;
use anyhow::{Context, Result};
use contextfold::config::{Config, GatewayMode};
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct GatewayArgs {
    /// Listen on this address (overrides `[gateway] listen`, default
    /// 127.0.0.1:8787; port 0 picks a free one, printed on stdout).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<std::net::SocketAddr>,
    /// The upstream provider's base URL, without `/v1` (overrides
    /// `[gateway] upstream`).
    #[arg(long, value_name = "URL")]
    pub upstream: Option<String>,
    /// Forward every request unchanged and report what would have been
    /// sent (`GET /contextfold/v1/report`).
    #[arg(long)]
    pub shadow: bool,
    /// A NATS deployment (`contextfold serve`) stores the turns instead of
    /// the embedded store.
    #[command(flatten)]
    pub nats: NatsArgs,
}

pub fn gateway(mut config: Config, args: GatewayArgs) -> Result<ExitCode> {
    if let Some(addr) = args.listen {
        config.gateway.listen = addr;
    }
    if let Some(url) = args.upstream {
        config.gateway.upstream = Some(url);
    }
    if args.shadow {
        config.gateway.mode = GatewayMode::Shadow;
    }
    config
        .gateway
        .validate()
        .map_err(|e| anyhow::anyhow!("[gateway] {e}"))?;
    let nats = !args.nats.servers.is_empty();
    if nats {
        config.nats = args.nats.apply(&config.nats);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let store = contextfold::gateway::open_store(&config, nats)
            .await
            .context("opening the gateway's store")?;
        let shutdown = async {
            let ctrl_c = tokio::signal::ctrl_c();
            #[cfg(unix)]
            {
                if let Ok(mut term) =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                {
                    tokio::select! {
                        _ = ctrl_c => {}
                        _ = term.recv() => {}
                    }
                    return;
                }
            }
            let _ = ctrl_c.await;
        };
        let running = contextfold::gateway::start(&config, store, shutdown)
            .await
            .context("starting the gateway")?;
        println!("contextfold gateway listening on http://{}", running.addr);
        let gateway = running.gateway.clone();
        running.task.await.context("the gateway stopped")?;
        gateway.store.close().await;
        Ok(ExitCode::SUCCESS)
    })
}
