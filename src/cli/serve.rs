//! `contextfold serve`: every role over NATS in one process (or the ones
//! `--roles` names), until SIGTERM or SIGINT.

use super::audit::{AskRoute, NatsSource};
use super::nats_args::NatsArgs;
use anyhow::{Context, Result};
use contextfold::config::Config;
use contextfold::http::access::PageAccess;
use contextfold::http::audit_page::{self, Late};
use contextfold::http::{Check, HttpListener, OpsState, ReadyProbe, ReadyReport, Refresh};
use contextfold::nats::api_role::RecallService;
use contextfold::nats::serve::{shutdown_signal, Roles, ServeOptions, Service};
use contextfold::nats::NatsConfig;
use contextfold::runtime::recall::{RecallSetupError, Recaller};
use contextfold::secret::redact_url;
use contextfold::summarizer::{stack, DeterministicSummarizer, Summarizer};
use contextfold::telemetry;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::RwLock;
use tokio::sync::watch;

pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn serve(
    config: &Config,
    nats: &NatsArgs,
    roles: Roles,
    concurrency: Option<usize>,
    audit_page: bool,
) -> Result<ExitCode> {
    if audit_page && config.http.listen.is_none() {
        anyhow::bail!("--audit-page needs the HTTP server: give --http ADDR (or [http] listen)");
    }
    // The page shows conversations: beyond loopback it needs a token, and
    // this is refused before anything starts.
    let page_access = match (audit_page, config.http.listen) {
        (true, Some(addr)) => Some(
            PageAccess::new(addr, &config.http)
                .context("--audit-page cannot be served as configured")?,
        ),
        _ => None,
    };
    let mut opts = ServeOptions::new(nats.apply(&config.nats), config.data_dir.clone());
    let with_gateway = roles.gateway;
    let gateway_only = with_gateway && !(roles.folder || roles.summarizer || roles.api);
    opts.roles = roles;
    opts.policy = config.policy.clone();
    opts.flush_every = config.store.flush_every;
    opts.store = config.store.clone();
    // `recall` over NATS asks `[recall]`'s model (the summarizer's when it
    // names none); without any, the API refuses recall saying so.
    opts.recall = match Recaller::new(&config.recall, config.summarizer.as_ref()) {
        Ok(r) => {
            tracing::info!(model = r.model(), endpoint = %r.endpoint(), "recall answered over NATS");
            RecallService::On(Arc::new(r))
        }
        Err(e @ RecallSetupError::NoModel) => RecallService::Off(e.to_string()),
        Err(e) => return Err(e).context("the [recall] model cannot be asked"),
    };
    if let Some(n) = concurrency {
        opts.summarizer.concurrency = n.max(1);
    }
    let servers = opts.nats.connection.display_servers();
    let http = config.http.listen;
    runtime()?.block_on(async {
        // The gateway role: the LLM gateway storing turns in this
        // deployment (turns it takes before the streams exist are spooled).
        let gateway = if with_gateway {
            let mut gconfig = config.clone();
            gconfig.nats = opts.nats.clone();
            gconfig
                .gateway
                .validate()
                .map_err(|e| anyhow::anyhow!("[gateway] {e}"))?;
            let store = contextfold::gateway::open_store(&gconfig, true)
                .await
                .context("opening the gateway's store")?;
            let running = contextfold::gateway::start(
                &gconfig,
                store,
                contextfold::nats::serve::shutdown_signal(),
            )
            .await
            .context("starting the gateway")?;
            eprintln!(
                "contextfold serve: gateway listening on http://{}",
                running.addr
            );
            Some(running)
        } else {
            None
        };
        if gateway_only {
            if let Some(running) = gateway {
                let g = running.gateway.clone();
                running.task.await.context("the gateway stopped")?;
                g.store.close().await;
            }
            return Ok(ExitCode::SUCCESS);
        }
        let page = audit_page.then(|| Arc::new(Late::default()));
        let ops = match http {
            Some(addr) => {
                let page = page.clone().zip(page_access);
                Some(OpsHttp::start(addr, page, &known_labels(config, &opts.nats)).await?)
            }
            None => None,
        };
        if let Some(page) = page {
            // The page reads through its own connection, made once serve's
            // is (the streams exist then); until then it says so.
            let (config, nats) = (config.clone(), opts.nats.clone());
            tokio::spawn(async move {
                match NatsSource::connect(&config, &nats, AskRoute::Owner).await {
                    Ok(source) => page.set(Arc::new(source)),
                    Err(e) => tracing::error!(error = %format!("{e:#}"), "audit page: no NATS"),
                }
            });
        }
        // The summarizer role uses the model when `[summarizer]` is
        // configured (behind the team's external summarizer when that is),
        // else the deterministic summarizer.
        match &config.summarizer {
            None => {
                run_until_signal(
                    opts,
                    ops,
                    Arc::new(DeterministicSummarizer),
                    &servers,
                    "deterministic",
                )
                .await
            }
            Some(cfg) if cfg.external.is_some() => {
                let (client, _) = opts.nats.connection.connect().await.with_context(|| {
                    format!("connecting to {servers} for the external summarizer")
                })?;
                let pass =
                    stack::external(cfg, client).context("building the external summarizer")?;
                let name = format!(
                    "external on {}, then {} at {}",
                    cfg.external
                        .as_ref()
                        .map(|e| e.subject.as_str())
                        .unwrap_or_default(),
                    cfg.model,
                    redact_url(&cfg.base_url)
                );
                run_until_signal(opts, ops, Arc::new(pass), &servers, &name).await
            }
            Some(cfg) => {
                let pass = stack::model(cfg).context("building the model summarizer")?;
                let name = format!("{} at {}", cfg.model, redact_url(&cfg.base_url));
                run_until_signal(opts, ops, Arc::new(pass), &servers, &name).await
            }
        }
    })
}

/// The label values the configuration knows: its partitions and the
/// summarizer's models.
fn known_labels(config: &Config, nats: &NatsConfig) -> telemetry::Known {
    telemetry::Known {
        partitions: nats.partitions,
        models: config
            .summarizer
            .iter()
            .flat_map(|s| std::iter::once(&s.model).chain(&s.fallback_models))
            .cloned()
            .collect(),
    }
}

/// The operators' HTTP server, listening from before NATS is reached so
/// `/healthz` answers and `/readyz` says 503 while `serve` starts.
struct OpsHttp {
    addr: SocketAddr,
    /// The running service's readiness and gauge refresh, once started.
    service: Arc<RwLock<Option<(ReadyProbe, Refresh)>>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl OpsHttp {
    async fn start(
        addr: SocketAddr,
        page: Option<(Arc<Late>, PageAccess)>,
        known: &telemetry::Known,
    ) -> Result<OpsHttp> {
        let metrics = telemetry::install_prometheus()?;
        // Every documented family from the first scrape on, so dashboards
        // and `increase()` alerts see the first event.
        telemetry::register_known(known);
        let listener = HttpListener::bind(addr).await?;
        let addr = listener.local_addr();
        let service: Arc<RwLock<Option<(ReadyProbe, Refresh)>>> = Arc::default();
        let ready: ReadyProbe = {
            let service = service.clone();
            Arc::new(move || {
                let slot = service.read().unwrap_or_else(|p| p.into_inner());
                match slot.as_ref() {
                    Some((probe, _)) => probe(),
                    None => ReadyReport::new(vec![Check::failing(
                        "streams",
                        "connecting to NATS and validating the JetStream streams",
                    )]),
                }
            })
        };
        let refresh: Refresh = {
            let service = service.clone();
            Arc::new(move || {
                let refresh = service
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
                    .map(|(_, r)| r.clone());
                Box::pin(async move {
                    if let Some(r) = refresh {
                        r().await;
                    }
                })
            })
        };
        let page_on = page.as_ref().map(|(_, access)| access.needs_token());
        let (stop, mut stop_rx) = watch::channel(false);
        let state = OpsState {
            metrics,
            ready,
            refresh: Some(refresh),
        };
        let task = tokio::spawn(async move {
            let shutdown = async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            };
            let mut router = contextfold::http::router(state);
            if let Some((page, access)) = page {
                router = router.merge(audit_page::router(page, access));
            }
            if let Err(e) = listener.serve_router(router, shutdown).await {
                tracing::error!(error = %e, "HTTP server stopped");
            }
        });
        eprintln!(
            "contextfold serve: /metrics, /healthz, /readyz{} on http://{addr}",
            match page_on {
                Some(false) => ", the audit page at /",
                Some(true) => ", the audit page at / (open /?token=<[http] token> once)",
                None => "",
            }
        );
        Ok(OpsHttp {
            addr,
            service,
            stop,
            task,
        })
    }

    fn attach(&self, service: &Service) {
        let mut slot = self.service.write().unwrap_or_else(|p| p.into_inner());
        *slot = Some((service.readiness(), service.metrics_refresh()));
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        tracing::debug!(addr = %self.addr, "HTTP server stopped");
    }
}

async fn run_until_signal<S: Summarizer + 'static>(
    opts: ServeOptions,
    ops: Option<OpsHttp>,
    summarizer: Arc<S>,
    servers: &str,
    name: &str,
) -> Result<ExitCode> {
    let service = Service::start(opts, summarizer)
        .await
        .with_context(|| format!("starting contextfold serve against {servers}"))?;
    if let Some(ops) = &ops {
        ops.attach(&service);
    }
    eprintln!(
        "contextfold serve: roles {} on nats-server {} at {servers}{}, summarizer {name}; Ctrl-C or SIGTERM stops",
        service.roles(),
        service.server_version(),
        service
            .member_id()
            .map(|m| format!(" as member {m}"))
            .unwrap_or_default()
    );
    shutdown_signal().await;
    eprintln!("contextfold serve: stopping (finishing in-flight work, releasing leases)");
    service.shutdown().await;
    if let Some(ops) = ops {
        ops.stop().await;
    }
    eprintln!("contextfold serve: stopped");
    Ok(ExitCode::SUCCESS)
}
