//! `contextfold serve`: the roles of one process, started together over one
//! NATS connection and stopped together.
//!
//! Start: connect (several URLs, credentials, NKey, TLS, name: see
//! [`NatsOptions`](crate::nats::NatsOptions)), refuse a server too old or
//! without JetStream, create or validate the streams, buckets and shared
//! consumers, then start the roles asked for:
//!
//! - `folder`: join the partition leases and fold every held partition into
//!   its own state store under `<data>/nats/<prefix>/partition-<p>.redb`;
//! - `summarizer`: run compaction jobs from the work queue;
//! - `api`: answer requests (`<prefix>.api.<op>.<conversation token>`,
//!   `<prefix>.admin.status`) from the state of held
//!   partitions and forward the rest to their owners (`crate::api`).
//!
//! Graceful stop ([`Service::shutdown`], on SIGTERM or SIGINT in the CLI):
//! summarizers stop pulling and finish or hand back the job they hold,
//! folders finish their batch (commit, then ack), and only then the leases
//! are released, so the next owner starts from a committed position.

use crate::core::policy::PolicyConfig;
use crate::http::{Check, ReadyProbe, ReadyReport, Refresh};
use crate::nats::api_role::{self, EngineView, HeldEngines, ServiceConfig};
use crate::nats::config::NatsConfig;
use crate::nats::folder::{EngineFactory, EngineMap, FolderRole, FolderSettings};
use crate::nats::leases::{
    generate_member_id, LeaseRunner, LeaseSettings, LeaseTable, PartitionLeases,
};
use crate::nats::setup::{ensure, Infrastructure};
use crate::nats::summarizer_role::{SummarizerCounters, SummarizerRole, SummarizerSettings};
use crate::nats::version::ServerVersion;
use crate::nats::NatsError;
use crate::runtime::engine::{policy_fingerprint, Engine};
use crate::store::redb_backend::RedbBackend;
use crate::store::{KvBackend, StoreError};
use crate::summarizer::Summarizer;
use crate::telemetry;
use async_nats::jetstream;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Which roles a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    pub folder: bool,
    pub summarizer: bool,
    pub api: bool,
    /// The LLM gateway (`src/gateway/`) on `[gateway] listen`, storing
    /// turns in this deployment. Never part of `all`: it needs an upstream.
    pub gateway: bool,
}

impl Default for Roles {
    /// Every role, as a single process deployment wants.
    fn default() -> Self {
        Roles {
            folder: true,
            summarizer: true,
            api: true,
            gateway: false,
        }
    }
}

impl FromStr for Roles {
    type Err = String;

    /// `folder,summarizer,api` (any subset, comma-separated) or `all`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut roles = Roles {
            folder: false,
            summarizer: false,
            api: false,
            gateway: false,
        };
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "all" => roles = Roles::default(),
                "folder" => roles.folder = true,
                "summarizer" => roles.summarizer = true,
                "api" => roles.api = true,
                "gateway" => roles.gateway = true,
                other => {
                    return Err(format!(
                        "unknown role {other:?}: use folder, summarizer, api, gateway \
                         (comma-separated) or all"
                    ))
                }
            }
        }
        if !(roles.folder || roles.summarizer || roles.api || roles.gateway) {
            return Err("no role given: use folder, summarizer, api, gateway or all".to_string());
        }
        Ok(roles)
    }
}

impl fmt::Display for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = [
            (self.folder, "folder"),
            (self.summarizer, "summarizer"),
            (self.api, "api"),
            (self.gateway, "gateway"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, n)| *n)
        .collect();
        f.write_str(&names.join(","))
    }
}

/// Everything `serve` needs to start.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub nats: NatsConfig,
    pub roles: Roles,
    /// State stores live under `<data_dir>/nats/<prefix>/`.
    pub data_dir: PathBuf,
    pub policy: PolicyConfig,
    /// Make every N-th state commit durable (the `[store]` setting).
    pub flush_every: u32,
    /// What each partition's engine keeps in memory, and the process's
    /// body cache (shared by its partitions).
    pub store: crate::store::StoreConfig,
    /// Stem of the lease member id (`<name>-<pid>-<random>`); defaults to
    /// the connection name, else `contextfold`.
    pub member_name: Option<String>,
    pub folder: FolderSettings,
    pub summarizer: SummarizerSettings,
    /// The model the API role's `recall` asks (off: refused with why).
    pub recall: crate::nats::api_role::RecallService,
}

impl ServeOptions {
    /// Defaults for everything but the NATS settings and data directory;
    /// summarizer timing follows the job consumer of `nats`, and a job
    /// message that would be above `nats.max_inline_payload_bytes` with its
    /// snapshot carries the snapshot in the object store instead.
    pub fn new(nats: NatsConfig, data_dir: impl Into<PathBuf>) -> Self {
        let summarizer = SummarizerSettings::from_config(&nats);
        let folder = FolderSettings {
            fault: crate::nats::folder::Fault::from_env(),
            max_inline_job_bytes: usize::try_from(nats.max_inline_payload_bytes)
                .unwrap_or(usize::MAX),
            ..FolderSettings::default()
        };
        ServeOptions {
            nats,
            roles: Roles::default(),
            data_dir: data_dir.into(),
            policy: PolicyConfig::default(),
            flush_every: 1,
            store: crate::store::StoreConfig::default(),
            member_name: None,
            folder,
            summarizer,
            recall: ServiceConfig::default().recall,
        }
    }

    /// Where this prefix's partition state stores live.
    pub fn state_dir(&self) -> PathBuf {
        self.data_dir.join("nats").join(&self.nats.prefix)
    }
}

/// Why `serve` could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot create the state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A redb state store per partition under `dir`, with the default memory
/// limits.
pub fn redb_engines(
    dir: &Path,
    policy: PolicyConfig,
    flush_every: u32,
) -> EngineFactory<RedbBackend> {
    redb_engines_with(
        dir,
        policy,
        flush_every,
        &crate::store::StoreConfig::default(),
    )
}

/// [`redb_engines`] with `store`'s memory limits: one body cache of
/// `store.body_cache_bytes` for the process, shared by its partitions.
/// Opening an engine reads no conversation, so taking a partition over
/// costs the same whatever its history.
pub fn redb_engines_with(
    dir: &Path,
    policy: PolicyConfig,
    flush_every: u32,
    store: &crate::store::StoreConfig,
) -> EngineFactory<RedbBackend> {
    let dir = dir.to_path_buf();
    let cache = Arc::new(crate::store::state_store::BodyCache::new(
        store.body_cache_bytes,
    ));
    let residency = store.residency();
    let redb_cache = usize::try_from(store.redb_cache_bytes).unwrap_or(usize::MAX);
    Arc::new(move |p| {
        let backend =
            RedbBackend::open_with_cache(&dir.join(format!("partition-{p}.redb")), redb_cache)?;
        let state_store =
            crate::store::state_store::StateStore::with_cache(backend, Arc::clone(&cache));
        let mut engine = Engine::open_with(state_store, policy.clone())?;
        engine.set_flush_every(flush_every);
        engine.set_residency(residency);
        Ok(engine)
    })
}

/// Engines of `factory` that record their policy in their partition's
/// part of the log (`policy_recorded`, addressed to the partition's
/// reserved key) and sign it `member`.
pub fn recording_policy<B: KvBackend + 'static>(
    factory: EngineFactory<B>,
    partitions: u32,
    member: String,
) -> EngineFactory<B> {
    Arc::new(move |p| {
        let mut engine = factory(p)?;
        let key = crate::core::event::partition_key(p, |k| {
            crate::nats::subjects::partition_of(k, partitions).unwrap_or(u32::MAX)
        });
        match key {
            Some(key) => engine.record_policy_as(key, member.clone()),
            None => tracing::warn!(
                partition = p,
                partitions,
                "no reserved key falls in this partition: its policy is not recorded"
            ),
        }
        Ok(engine)
    })
}

/// Reports, once each, the live members that announce another policy
/// fingerprint than `ours` (the comparison `doctor` makes): processes
/// folding one stream under different policies would switch a partition's
/// policy each time it moves between them.
async fn watch_member_policies(
    leases: LeaseTable,
    ours: String,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut reported = std::collections::BTreeSet::<(String, String)>::new();
    let mut interval = tokio::time::interval(every.max(Duration::from_millis(100)));
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = interval.tick() => {}
        }
        // The live members as the lease runner's watch of the bucket shows
        // them: no request of its own.
        for m in leases.members() {
            let Some(fp) = m.record.and_then(|r| r.policy_fingerprint) else {
                continue;
            };
            if fp != ours && reported.insert((m.member.clone(), fp.clone())) {
                telemetry::PolicyConflict {
                    event_id: "",
                    ours: &ours,
                    recorded: &fp,
                    recorded_by: &m.member,
                }
                .emit();
            }
        }
    }
}

/// How long a `/metrics` scrape waits for one JetStream read.
pub const METRICS_READ_LIMIT: Duration = Duration::from_secs(2);

/// A running `serve` process.
pub struct Service {
    client: async_nats::Client,
    server_version: ServerVersion,
    infra: Infrastructure,
    roles: Roles,
    stop: watch::Sender<bool>,
    leases: Option<LeaseRunner>,
    engines: Option<EngineMap<RedbBackend>>,
    folder: Option<JoinHandle<()>>,
    summarizer: Option<JoinHandle<()>>,
    summarizer_counters: Option<Arc<SummarizerCounters>>,
    api: Option<JoinHandle<()>>,
}

impl Service {
    /// Connects, sets up JetStream and starts the roles of `opts.roles`.
    pub async fn start<S: Summarizer + 'static>(
        opts: ServeOptions,
        summarizer: Arc<S>,
    ) -> Result<Service, ServeError> {
        opts.nats.validate()?;
        let (client, server_version) = opts.nats.connection.connect().await?;
        let js = jetstream::new(client.clone());
        let infra = ensure(&js, &opts.nats).await?;
        tracing::info!(
            server = %server_version,
            roles = %opts.roles,
            prefix = %opts.nats.prefix,
            "contextfold serve: JetStream ready"
        );
        let (stop, stop_rx) = watch::channel(false);

        let mut leases = None;
        let mut engines = None;
        let mut folder = None;
        // The API answers from the engines of held partitions, so it needs
        // the folder's leases too.
        if opts.roles.folder || opts.roles.api {
            let dir = opts.state_dir();
            std::fs::create_dir_all(&dir).map_err(|source| ServeError::StateDir {
                path: dir.clone(),
                source,
            })?;
            let name = opts
                .member_name
                .clone()
                .or_else(|| opts.nats.connection.name.clone())
                .unwrap_or_else(|| "contextfold".to_string());
            let mut runner = PartitionLeases::new(
                infra.leases.clone(),
                generate_member_id(&name),
                LeaseSettings::from_config(&opts.nats),
            )?
            // Every member that folds says under which policy, for doctor.
            .with_policy_fingerprint(policy_fingerprint(&opts.policy))
            .spawn();
            let events = runner.take_events();
            tokio::spawn(watch_member_policies(
                runner.table(),
                policy_fingerprint(&opts.policy),
                LeaseSettings::from_config(&opts.nats).renew,
                stop_rx.clone(),
            ));
            let role = FolderRole::new(
                js.clone(),
                &infra,
                recording_policy(
                    redb_engines_with(&dir, opts.policy.clone(), opts.flush_every, &opts.store),
                    opts.nats.partitions,
                    runner.member_id().to_string(),
                ),
                opts.folder.clone(),
            );
            engines = Some(role.engines());
            folder = Some(tokio::spawn(role.run(events, stop_rx.clone())));
            tracing::info!(member = runner.member_id(), state = %dir.display(), "folder role started");
            leases = Some(runner);
        }

        let mut summarizer_task = None;
        let mut summarizer_counters = None;
        if opts.roles.summarizer {
            let role = SummarizerRole::new(js.clone(), &infra, summarizer, opts.summarizer.clone())
                .await?;
            summarizer_counters = Some(role.counters());
            summarizer_task = Some(tokio::spawn(role.run(stop_rx.clone())));
            tracing::info!(
                concurrency = opts.summarizer.concurrency,
                "summarizer role started"
            );
        }

        // The API answers from the engines of the partitions this process
        // folds and forwards every other conversation to its owner.
        let mut api = None;
        if opts.roles.api {
            if let Some(engines) = engines.clone() {
                let view = Arc::new(EngineView::new(
                    engines.clone(),
                    opts.nats.partitions,
                    opts.policy.clone(),
                ));
                let config = ServiceConfig {
                    prefix: opts.nats.prefix.clone(),
                    forward_partitions: Some(opts.nats.partitions),
                    recall: opts.recall.clone(),
                    replies: opts.nats.reply_policy()?,
                    ..ServiceConfig::default()
                };
                let held = move || engines.held();
                let client = client.clone();
                let stop_rx = stop_rx.clone();
                api = Some(tokio::spawn(async move {
                    if let Err(e) = api_role::run(client, view, config, held, stop_rx).await {
                        tracing::error!(error = %e, "api role stopped");
                    }
                }));
                tracing::info!(prefix = %opts.nats.prefix, "api role started");
            }
        }

        Ok(Service {
            client,
            server_version,
            infra,
            roles: opts.roles,
            stop,
            leases,
            engines,
            folder,
            summarizer: summarizer_task,
            summarizer_counters,
            api,
        })
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    pub fn server_version(&self) -> ServerVersion {
        self.server_version
    }

    pub fn infrastructure(&self) -> &Infrastructure {
        &self.infra
    }

    pub fn roles(&self) -> Roles {
        self.roles
    }

    /// The readiness of this process, for `/readyz` (see [`crate::http`]):
    /// connected to NATS, partition leases joined (when folding or
    /// answering), no held partition retrying a failed fold or publish.
    /// The streams were validated by [`Service::start`] before this exists.
    pub fn readiness(&self) -> ReadyProbe {
        let client = self.client.clone();
        let table = self.leases.as_ref().map(LeaseRunner::table);
        let engines = self.engines.clone();
        Arc::new(move || {
            let mut checks = vec![Check::ok("streams")];
            checks.push(match client.connection_state() {
                async_nats::connection::State::Connected => Check::ok("connected"),
                other => Check::failing("connected", format!("NATS connection is {other}")),
            });
            if let Some(table) = &table {
                checks.push(if table.joined() {
                    Check::ok("leases")
                } else {
                    Check::failing("leases", "the first lease round has not completed")
                });
            }
            if let Some(engines) = &engines {
                let stalled: Vec<String> = engines
                    .partitions()
                    .into_iter()
                    .filter_map(|p| engines.health(p))
                    .filter(|h| h.retrying)
                    .map(|h| {
                        format!(
                            "partition {} retrying: {}",
                            h.partition,
                            h.last_error.as_deref().unwrap_or("unknown error")
                        )
                    })
                    .collect();
                checks.push(if stalled.is_empty() {
                    Check::ok("partitions")
                } else {
                    Check::failing("partitions", stalled.join("; "))
                });
            }
            ReadyReport::new(checks)
        })
    }

    /// Reads the gauges that cost a JetStream request (consumer lag per
    /// held partition, jobs queued and in flight), for each `/metrics`
    /// scrape: all at once, each within [`METRICS_READ_LIMIT`], so a scrape
    /// never waits on a slow or refused request (a refused one only times
    /// out). A failed read leaves the gauge at its last value.
    pub fn metrics_refresh(&self) -> Refresh {
        let events = self.infra.events.clone();
        let jobs = self.infra.jobs.clone();
        let subjects = self.infra.subjects.clone();
        let engines = self.engines.clone();
        Arc::new(move || {
            let events = events.clone();
            let jobs = jobs.clone();
            let subjects = subjects.clone();
            let engines = engines.clone();
            Box::pin(async move {
                let held = engines.map(|e| e.partitions()).unwrap_or_default();
                telemetry::PartitionsHeld { count: held.len() }.emit();
                let lags = held.into_iter().map(|p| {
                    let name = subjects.folder_consumer(p);
                    let events = &events;
                    async move {
                        let read =
                            tokio::time::timeout(METRICS_READ_LIMIT, events.consumer_info(name));
                        if let Ok(Ok(info)) = read.await {
                            telemetry::ConsumerLag {
                                partition: p,
                                pending: info.num_pending,
                            }
                            .emit();
                        }
                    }
                });
                let queue = async {
                    let read = tokio::time::timeout(
                        METRICS_READ_LIMIT,
                        jobs.consumer_info(subjects.summarizer_consumer()),
                    );
                    if let Ok(Ok(info)) = read.await {
                        telemetry::JobQueue {
                            queued: info.num_pending,
                            running: info.num_ack_pending as u64,
                        }
                        .emit();
                    }
                };
                futures::join!(futures::future::join_all(lags), queue);
            })
        })
    }

    /// The lease member id, when folding.
    pub fn member_id(&self) -> Option<&str> {
        self.leases.as_ref().map(LeaseRunner::member_id)
    }

    /// The engines of the partitions folded here right now (for answering
    /// requests), when folding.
    pub fn engines(&self) -> Option<EngineMap<RedbBackend>> {
        self.engines.clone()
    }

    pub fn summarizer_counters(&self) -> Option<Arc<SummarizerCounters>> {
        self.summarizer_counters.clone()
    }

    /// Graceful stop: stop pulling, finish or hand back in-flight jobs,
    /// commit and ack the batches being folded, then release the leases.
    pub async fn shutdown(mut self) {
        tracing::info!("contextfold serve: shutting down");
        let _ = self.stop.send(true);
        for task in [self.summarizer.take(), self.api.take(), self.folder.take()]
            .into_iter()
            .flatten()
        {
            let _ = task.await;
        }
        if let Some(leases) = self.leases.take() {
            leases.stop().await;
        }
        // Publishes and acks still buffered in the client go out first.
        let _ = tokio::time::timeout(Duration::from_secs(5), self.client.flush()).await;
        tracing::info!("contextfold serve: stopped");
    }

    /// Stops at once without releasing anything, as `kill -9` would (for
    /// tests): leases expire, unacked jobs and events are redelivered.
    /// Dropping the service does exactly that.
    pub fn abort(self) {
        drop(self);
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        for task in [self.summarizer.take(), self.api.take(), self.folder.take()]
            .into_iter()
            .flatten()
        {
            task.abort();
        }
        if let Some(leases) = self.leases.take() {
            leases.abort();
        }
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM ({e}); stopping on Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_parse_subsets_and_refuse_unknown_names() {
        assert_eq!("all".parse::<Roles>().unwrap(), Roles::default());
        let r: Roles = "folder, summarizer".parse().unwrap();
        assert!(r.folder && r.summarizer && !r.api);
        assert_eq!(r.to_string(), "folder,summarizer");
        let err = "folder,sumarizer".parse::<Roles>().unwrap_err();
        assert!(err.contains("sumarizer"), "{err}");
        assert!("".parse::<Roles>().is_err());
    }

    #[test]
    fn the_configured_inline_limit_reaches_the_folder() {
        let nats = NatsConfig {
            max_inline_payload_bytes: 4096,
            ..NatsConfig::default()
        };
        let opts = ServeOptions::new(nats, "data");
        assert_eq!(opts.folder.max_inline_job_bytes, 4096);
    }
}
