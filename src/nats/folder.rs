//! The folder role: for every partition this process holds a lease on, a
//! task folds the partition's events into that partition's engine.
//!
//! Per partition and lease tenure:
//!
//! 1. open the partition's engine (its state and the stream position it
//!    reflects, from the local state store);
//! 2. recreate the durable pull consumer `cf_fold_<p>` to start right after
//!    that position (the previous owner's acknowledgements say nothing
//!    about this process's store);
//! 3. name the head of the stream as it is now: what lies between the
//!    store's position and there is history, whose decisions the log may
//!    hold already (the engine holds them back and drops the ones the log
//!    shows; see `runtime::engine`), so a replay never re-issues a job the
//!    log shows ended, whatever the dedup window;
//! 4. loop: take the messages that are ready (up to `batch`; while the
//!    server reports more of the partition pending, wait briefly for them,
//!    so a backlog goes in full batches), hand them to the engine as log
//!    records (origin and conversation read from the stored subject
//!    `cf.ev.<p>.<in|svc>.<conv>`, the stream's timestamp as stored time),
//!    publish its effects (decisions to `cf.svc.<conv>`, jobs to
//!    `cf.job.<conv>`, refused records to `cf.dead.partition.<p>`) with
//!    deterministic message ids and wait for the stream's
//!    acknowledgements, commit the state and position atomically, then
//!    acknowledge the batch (one ack-all of its last message). An ack-all
//!    acknowledges every earlier delivery too, so a delivery that never
//!    arrived (lost in flight when a NATS node dies) must not be acked
//!    past: the consumer numbers its deliveries, and a number skipped drops
//!    the batch and starts again at step 2 from the committed position. A
//!    pull request lost with a NATS node (missed idle heartbeats, or no
//!    consumer leader to answer) is sent again from the same consumer,
//!    which is not recreated: recreating it during its election would
//!    start the election over;
//! 5. when no record comes and a conversation of the partition waits for a
//!    time (a backoff's end, a job's expiry, a spend window reopening),
//!    record a `clock_ticked` for the partition once that time has passed
//!    by this process's clock: its stored time moves the partition's clock
//!    (`core::state::PartitionClock`), so every wait ends without agent
//!    traffic. Server and process clocks may differ: a tick stored before
//!    the wait ends wakes nothing, and the next one comes after a delay
//!    that doubles up to [`MAX_TICK_RETRY`].
//!
//! # Jobs the log shows pending
//!
//! When a tenure's history ends (at once, when the store is up to date),
//! every job the state shows pending is handed out again unless the job
//! queue still holds it (a work queue keeps a job until a worker
//! acknowledges it, so a missing one was never queued, or is done and its
//! `sweep_ended` is on its way). A crash after a batch's `job_issued`
//! decisions were stored and before its jobs were queued therefore loses
//! no job: the next owner finds the decisions in the log, drops its own
//! copies of them, and queues the jobs.
//!
//! # No message stops a partition
//!
//! Every message ends folded, rejected with a reason (an `event_rejected`
//! decision in the conversation its subject names), or dead-lettered (the
//! subject names no conversation). An effect that cannot be published
//! whatever the retries (larger than the stream takes) is dead-lettered in
//! its place; one the server refuses for a while (no leader, no
//! connection) is retried with backoff until the lease is lost or the
//! process stops, and the partition's health (`status`) says it is
//! retrying and why. Stopping never waits on a retry.
//!
//! Decisions are published before the commit, as in the embedded pipeline:
//! after a crash between the two, the replay derives the same decisions
//! with the same ids; JetStream drops the copies within the dedup window
//! and the fold drops later ones by id. Nothing decided is lost and nothing
//! is doubled. The lease is checked before publishing and before
//! committing: a process whose lease lapsed (not renewed in time, as in a
//! NATS leader election) pauses without either and goes on if the lease
//! resumes (its renewal proved nobody else took it); a process that lost
//! it stops. So two processes never commit the same partition's effects,
//! and an election costs a pause, not a new tenure.
//!

use crate::api::status::PartitionHealth;
use crate::core::derived_id::DerivedId;
use crate::core::event::Origin;
use crate::log::LogRecord;
use crate::nats::event_log::encoding_of;
use crate::nats::jobs::publish_job;
use crate::nats::leases::{Lease, LeaseEvent};
use crate::nats::publish::{stored, DeadLetterMessage, PublishFailure, Publisher};
use crate::nats::retry::Backoff;
use crate::nats::setup::{folder_consumer_config, Infrastructure};
use crate::nats::subjects::Subjects;
use crate::nats::NatsError;
use crate::runtime::engine::{Effects, Engine};
use crate::store::{KvBackend, StoreError};
use crate::telemetry;
use async_nats::jetstream::consumer::pull::{self, MessagesErrorKind};
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::object_store::ObjectStore;
use async_nats::jetstream::{self, stream, Context};
use futures::{FutureExt, StreamExt};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Opens the engine of a partition (its own state store).
pub type EngineFactory<B> = Arc<dyn Fn(u32) -> Result<Engine<B>, StoreError> + Send + Sync>;

/// An engine shared between its folder task and readers (the API).
pub type SharedEngine<B> = Arc<Mutex<Engine<B>>>;

/// Pulls a partition sends again in a row without a delivery (after two
/// missed pull heartbeats, or one heartbeat after "no responders") before
/// it takes the consumer for gone and recreates it: half a minute or more
/// at the default heartbeat, longer than a NATS election.
pub const UNANSWERED_PULLS: u32 = 30;

/// Tuning of the folder.
#[derive(Debug, Clone)]
pub struct FolderSettings {
    /// Most events folded between two commits. Default 1024.
    pub batch: usize,
    /// Unacknowledged messages the server lets a folder have. Default 8192.
    pub max_ack_pending: i64,
    /// A job message with its snapshot above this many bytes carries the
    /// snapshot in the object store instead. Default 262144.
    pub max_inline_job_bytes: usize,
    /// First delay before retrying after an error; doubles up to
    /// [`MAX_RETRY_BACKOFF`](crate::nats::retry::MAX_RETRY_BACKOFF), and
    /// starts again here once the partition folds again.
    pub retry_backoff: Duration,
    /// Longest a batch waits, from its first message, for more while it
    /// is not full and the server reports more of the partition pending.
    /// Default 50 ms. A caught-up partition never waits (nothing is
    /// pending). In a backlog the server delivers a partition's pull in
    /// bursts interleaved with the other partitions', and each commit
    /// rewrites the heads of the conversations it touched: the ingest bench
    /// (`CONTEXTFOLD_BENCH_GATHER_MS`) commits 100k events in about 390
    /// batches at 5 ms and about 150 at 50 ms.
    pub gather_wait: Duration,
    /// How often the server confirms an idle partition's pull is alive.
    /// Default 1 s. A pull request lives only on its consumer's leader and
    /// the connection that sent it: when a NATS node dies holding either,
    /// nothing is delivered and nothing says so. After two missed
    /// heartbeats the folder pulls again from the same consumer (a consumer
    /// electing a new leader answers "no responders" and is asked again
    /// every period, never recreated), so a lost pull costs about twice
    /// this beyond the consumer's election (the node-failure test in
    /// `tests/nats_takeover.rs` bounds it). An idle partition costs the
    /// server one small message per period.
    pub pull_heartbeat: Duration,
    /// A test's fault point ([`Fault`]); `None` in service.
    pub fault: Option<Fault>,
}

/// A fault point the convergence tests crash the folder at, named by the
/// environment variable [`FAULT_VAR`] (read by `serve`; never set in
/// service).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Abort the process once a batch's decisions are stored, before its
    /// jobs are queued (the first batch that issues a job): what a kill -9
    /// between the two leaves.
    AbortAfterJobDecisions,
}

/// The variable naming a [`Fault`] (`abort_after_job_decisions`).
pub const FAULT_VAR: &str = "CONTEXTFOLD_TEST_FAULT";

impl Fault {
    /// The fault the environment names, if any (unknown names are
    /// ignored with a warning: it is a test hook, not configuration).
    pub fn from_env() -> Option<Fault> {
        let name = std::env::var(FAULT_VAR).ok()?;
        match name.as_str() {
            "abort_after_job_decisions" => Some(Fault::AbortAfterJobDecisions),
            other => {
                tracing::warn!(fault = other, "unknown {FAULT_VAR}; ignored");
                None
            }
        }
    }
}

impl Default for FolderSettings {
    fn default() -> Self {
        FolderSettings {
            batch: 1024,
            max_ack_pending: 8192,
            max_inline_job_bytes: 256 * 1024,
            retry_backoff: Duration::from_millis(200),
            gather_wait: Duration::from_millis(50),
            pull_heartbeat: Duration::from_secs(1),
            fault: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("folder task of partition {partition} failed: {source}")]
    Task {
        partition: u32,
        #[source]
        source: tokio::task::JoinError,
    },
    /// The consumer delivered a message that never arrived (lost in flight,
    /// say when a NATS node died): acknowledging past it would skip it for
    /// good, so the consumer is recreated at the state's position.
    #[error(
        "partition {partition}: delivery {got} arrived after {last}; the deliveries between were \
         lost on the way, refolding from the last committed position"
    )]
    DeliveryGap { partition: u32, last: u64, got: u64 },
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // An engine is only left half-updated by a panic inside the fold, which
    // is a bug; readers then see the state as far as it got.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A partition's health, shared between its folder task and the API.
pub type SharedHealth = Arc<Mutex<PartitionHealth>>;

/// A partition's engine and health, and the lease it is folded under.
type Tenure<B> = (Lease, SharedEngine<B>, SharedHealth);

/// The engines of the partitions this process folds right now, with the
/// lease each runs under.
pub struct EngineMap<B: KvBackend> {
    inner: Arc<RwLock<BTreeMap<u32, Tenure<B>>>>,
}

impl<B: KvBackend> Clone for EngineMap<B> {
    fn clone(&self) -> Self {
        EngineMap {
            inner: self.inner.clone(),
        }
    }
}

impl<B: KvBackend> EngineMap<B> {
    fn new() -> Self {
        EngineMap {
            inner: Arc::new(RwLock::new(BTreeMap::new())),
        }
    }

    /// The engine of `partition`, while its lease is held.
    pub fn get(&self, partition: u32) -> Option<SharedEngine<B>> {
        let map = self.inner.read().unwrap_or_else(|p| p.into_inner());
        map.get(&partition)
            .filter(|(lease, _, _)| lease.still_held())
            .map(|(_, e, _)| e.clone())
    }

    /// The health of `partition`, while its lease is held.
    pub fn health(&self, partition: u32) -> Option<PartitionHealth> {
        let map = self.inner.read().unwrap_or_else(|p| p.into_inner());
        map.get(&partition)
            .filter(|(lease, _, _)| lease.still_held())
            .map(|(_, _, h)| lock(h).clone())
    }

    /// Partitions being folded here, ascending.
    pub fn partitions(&self) -> Vec<u32> {
        let map = self.inner.read().unwrap_or_else(|p| p.into_inner());
        map.iter()
            .filter(|(_, (lease, _, _))| lease.still_held())
            .map(|(p, _)| *p)
            .collect()
    }

    fn insert(&self, lease: &Lease, engine: SharedEngine<B>, health: SharedHealth) {
        let mut map = self.inner.write().unwrap_or_else(|p| p.into_inner());
        map.insert(lease.partition(), (lease.clone(), engine, health));
    }

    /// Removes the entry of this tenure (not a later one).
    fn remove(&self, lease: &Lease) {
        let mut map = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if map
            .get(&lease.partition())
            .is_some_and(|(l, _, _)| l.fencing_token() == lease.fencing_token())
        {
            map.remove(&lease.partition());
        }
    }
}

/// The folder role of one process.
pub struct FolderRole<B: KvBackend> {
    publisher: Publisher,
    subjects: Subjects,
    events: stream::Stream,
    jobs: stream::Stream,
    payloads: ObjectStore,
    open_engine: EngineFactory<B>,
    settings: FolderSettings,
    engines: EngineMap<B>,
}

impl<B: KvBackend> Clone for FolderRole<B> {
    fn clone(&self) -> Self {
        FolderRole {
            publisher: self.publisher.clone(),
            subjects: self.subjects.clone(),
            events: self.events.clone(),
            jobs: self.jobs.clone(),
            payloads: self.payloads.clone(),
            open_engine: self.open_engine.clone(),
            settings: self.settings.clone(),
            engines: self.engines.clone(),
        }
    }
}

/// Partition tasks, aborted when dropped.
struct Tasks(BTreeMap<u32, JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in self.0.values() {
            task.abort();
        }
    }
}

/// The longest wait between two ticks that woke nothing (the server's
/// clock behind this process's).
pub const MAX_TICK_RETRY: Duration = Duration::from_secs(5);

/// The first wait after a tick that woke nothing.
const FIRST_TICK_RETRY: Duration = Duration::from_millis(200);

/// When a quiet partition records its next `clock_ticked`.
#[derive(Debug)]
struct TickPlan {
    /// The engine's position when the last tick was published, and the
    /// delay before another may follow while nothing else is folded.
    last: Option<(u64, Duration)>,
}

impl TickPlan {
    /// How long from now (a wall-clock time, ms) until the tick for a
    /// timer due at `next_wake` (the partition's clock), given the
    /// engine's `position`: `None` when nothing waits.
    fn delay(&self, next_wake: Option<u64>, now_ms: u64, position: u64) -> Option<Duration> {
        let wake = next_wake?;
        let mut delay = Duration::from_millis(wake.saturating_sub(now_ms));
        if let Some((at, retry)) = self.last {
            if at == position {
                // The last tick is all that was folded since: it woke
                // nothing yet, so the next one waits.
                delay = delay.max(retry);
            }
        }
        Some(delay)
    }

    fn ticked(&mut self, position: u64) {
        let retry = match self.last {
            Some((at, retry)) if at == position => (retry * 2).min(MAX_TICK_RETRY),
            _ => FIRST_TICK_RETRY,
        };
        self.last = Some((position, retry));
    }
}

/// How one batch ended.
enum BatchEnd {
    Committed,
    /// The lease ran out, or the process is stopping: nothing was
    /// published or committed after that.
    Stopped,
}

/// Milliseconds since the Unix epoch, for health reports only (never folded).
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Records a failure in a partition's health.
fn note_failure(health: &SharedHealth, error: &dyn std::fmt::Display) {
    let mut h = lock(health);
    h.retrying = true;
    h.failing_since_ms.get_or_insert_with(wall_ms);
    h.last_error = Some(error.to_string().chars().take(500).collect());
}

fn note_recovered(health: &SharedHealth) {
    let mut h = lock(health);
    h.retrying = false;
    h.failing_since_ms = None;
}

impl<B: KvBackend + 'static> FolderRole<B> {
    /// Also loads the tokenizers, so the first batch does not wait for them.
    pub fn new(
        js: Context,
        infra: &Infrastructure,
        open_engine: EngineFactory<B>,
        settings: FolderSettings,
    ) -> Self {
        crate::core::tokens::load_tokenizers();
        FolderRole {
            publisher: Publisher::for_events(js, infra),
            subjects: infra.subjects.clone(),
            events: infra.events.clone(),
            jobs: infra.jobs.clone(),
            payloads: infra.payloads.clone(),
            open_engine,
            settings,
            engines: EngineMap::new(),
        }
    }

    /// The engines being folded here (for answering requests).
    pub fn engines(&self) -> EngineMap<B> {
        self.engines.clone()
    }

    /// Starts a task per acquired lease until `shutdown` turns true or the
    /// lease events end; then lets every task finish its batch (commit and
    /// ack) and returns. Release the leases after this returns.
    pub async fn run(
        self,
        mut leases: mpsc::UnboundedReceiver<LeaseEvent>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        // Dropping `run` (a crash, or an aborted task) aborts the partition
        // tasks with it.
        let mut tasks = Tasks(BTreeMap::new());
        loop {
            if *shutdown.borrow() {
                break;
            }
            let event = tokio::select! {
                changed = shutdown.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    continue;
                }
                event = leases.recv() => event,
            };
            match event {
                None => break,
                Some(LeaseEvent::Acquired(lease)) => {
                    let p = lease.partition();
                    // The previous tenure's lease is no longer held, so its
                    // task is stopping; two engines must never share a store.
                    if let Some(old) = tasks.0.remove(&p) {
                        let _ = old.await;
                    }
                    let role = self.clone();
                    let stop = shutdown.clone();
                    tasks
                        .0
                        .insert(p, tokio::spawn(role.run_partition(lease, stop)));
                }
                // Tasks see their lease end, lapse and resume by themselves.
                Some(
                    LeaseEvent::Released { .. }
                    | LeaseEvent::Lost { .. }
                    | LeaseEvent::Lapsed { .. }
                    | LeaseEvent::Resumed { .. },
                ) => {}
            }
        }
        for (_, task) in std::mem::take(&mut tasks.0) {
            let _ = task.await;
        }
    }

    /// Folds one partition while `lease` is held, retrying after errors.
    pub async fn run_partition(self, lease: Lease, mut shutdown: watch::Receiver<bool>) {
        let p = lease.partition();
        tracing::info!(
            partition = p,
            token = lease.fencing_token(),
            "folder started"
        );
        let health: SharedHealth = Arc::new(Mutex::new(PartitionHealth::new(p)));
        let mut backoff = Backoff::new(self.settings.retry_backoff);
        while carry_on(&lease, &mut shutdown).await {
            let (started, from) = (std::time::Instant::now(), lock(&health).position);
            match self.fold_while_held(&lease, &health, &mut shutdown).await {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(partition = p, error = %e, "folder error, retrying");
                    note_failure(&health, &e);
                    let progressed = lock(&health).position != from;
                    let delay = backoff.after_attempt(progressed, started.elapsed());
                    tokio::select! {
                        _ = lease.lost() => {}
                        _ = shutdown.changed() => {}
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        tracing::info!(partition = p, "folder stopped");
    }

    async fn open_engine(&self, partition: u32) -> Result<SharedEngine<B>, FolderError> {
        let open = self.open_engine.clone();
        let engine = tokio::task::spawn_blocking(move || open(partition))
            .await
            .map_err(|source| FolderError::Task { partition, source })??;
        Ok(Arc::new(Mutex::new(engine)))
    }

    /// Drops this tenure's engine once readers let go, so the next open of
    /// the same store (a retry, or the next tenure) does not find it busy.
    async fn close_engine(&self, lease: &Lease, engine: SharedEngine<B>) {
        self.engines.remove(lease);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&engine) > 1 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = tokio::task::spawn_blocking(move || {
            let mut e = lock(&engine);
            if let Err(err) = e.flush() {
                tracing::warn!(error = %err, "flushing the state store on close failed");
            }
        })
        .await;
    }

    async fn reset_consumer(&self, partition: u32, after: u64) -> Result<PullConsumer, NatsError> {
        let name = self.subjects.folder_consumer(partition);
        // Missing is fine: first owner, or deleted by an operator.
        let _ = self.events.delete_consumer(&name).await;
        let config = folder_consumer_config(
            &self.subjects,
            partition,
            after,
            self.settings.max_ack_pending,
        );
        self.events
            .create_consumer(config)
            .await
            .map_err(|e| NatsError::js(format!("creating consumer {name}"), e))
    }

    /// A partition's pull: batches of `batch`, idle heartbeats every
    /// `pull_heartbeat`.
    async fn pull(
        &self,
        partition: u32,
        consumer: &PullConsumer,
        batch: usize,
    ) -> Result<pull::Stream, NatsError> {
        consumer
            .stream()
            .max_messages_per_batch(batch)
            .heartbeat(self.settings.pull_heartbeat)
            .messages()
            .await
            .map_err(|e| NatsError::js(format!("pulling partition {partition}"), e))
    }

    async fn fold_while_held(
        &self,
        lease: &Lease,
        health: &SharedHealth,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), FolderError> {
        let p = lease.partition();
        let engine = self.open_engine(p).await?;
        self.engines.insert(lease, engine.clone(), health.clone());
        let result = self.consume(lease, &engine, health, shutdown).await;
        self.close_engine(lease, engine).await;
        result
    }

    async fn consume(
        &self,
        lease: &Lease,
        engine: &SharedEngine<B>,
        health: &SharedHealth,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), FolderError> {
        let p = lease.partition();
        let after = lock(engine).position();
        // Everything stored up to the head as it is now is history: its
        // decisions may be in the log already.
        let mut info = self.events.clone();
        let head = info
            .info()
            .await
            .map_err(|e| NatsError::js("reading the events stream's state", e))?
            .state
            .last_sequence;
        lock(engine).hold_through(head);
        let consumer = self.reset_consumer(p, after).await?;
        // Nothing of this partition past the store: no history to fold, and
        // the policy goes into the log before anything is folded under it
        // (with history, the engine asks for it where history ends). The
        // count is the one the consumer's creation answered with: no
        // request (and no permission) more.
        let pending = consumer.cached_info().num_pending;
        let starting = engine.clone();
        let effects = tokio::task::spawn_blocking(move || {
            let mut e = lock(&starting);
            let mut effects = Effects::default();
            if pending == 0 {
                // No history: the policy goes out now, and every job the
                // state shows pending (see the module doc).
                e.end_history();
                e.requeue_pending();
                e.finish(&mut effects)?;
            } else if let Some(policy) = e.announce_policy() {
                effects.decisions.push(policy);
            }
            Ok::<_, StoreError>(effects)
        })
        .await
        .map_err(|source| FolderError::Task {
            partition: p,
            source,
        })??;
        if !self
            .publish_effects(lease, health, &effects, shutdown)
            .await
        {
            return Ok(());
        }
        {
            let mut h = lock(health);
            h.position = after;
            // This partition's own backlog, not the whole stream's.
            h.catching_up = pending > 0;
        }
        let batch = self.settings.batch.max(1);
        let mut messages = self.pull(p, &consumer, batch).await?;
        let mut ticks = TickPlan { last: None };
        // A new consumer numbers its deliveries from 1.
        let mut delivered = 0u64;
        // Pulls sent again in a row without a delivery.
        let mut unanswered = 0u32;
        loop {
            let tick_in = {
                let e = lock(engine);
                ticks.delay(e.next_wake(), wall_ms(), e.position())
            };
            let first = tokio::select! {
                _ = lease.lost() => {
                    if carry_on(lease, shutdown).await {
                        continue;
                    }
                    return Ok(());
                }
                _ = shutdown.changed() => return Ok(()),
                _ = tick_after(tick_in) => {
                    let position = lock(engine).position();
                    if !self.tick(lease, engine, health, shutdown).await {
                        return Ok(());
                    }
                    ticks.ticked(position);
                    continue;
                }
                m = messages.next() => m,
            };
            if let Some(Err(e)) = &first {
                // The pull request was lost (see
                // `FolderSettings::pull_heartbeat`) or found no consumer
                // leader, with everything received folded: pull again from
                // the same consumer, which may be electing a leader (a
                // delivery lost with the request shows as a gap in the
                // delivery numbers). Recreating the consumer instead would
                // start its election over.
                //
                // A consumer unanswered for `UNANSWERED_PULLS` pulls is
                // gone (an operator deleted it while the server's notice
                // was lost): the error path recreates it.
                let kind = e.kind();
                unanswered += 1;
                if unanswered <= UNANSWERED_PULLS
                    && matches!(
                        kind,
                        MessagesErrorKind::MissingHeartbeat | MessagesErrorKind::NoResponders
                    )
                {
                    if unanswered == 1 {
                        tracing::info!(partition = p, error = %e, "pull lost; pulling again");
                    } else {
                        tracing::debug!(partition = p, error = %e, "pulling again");
                    }
                    if kind == MessagesErrorKind::NoResponders {
                        tokio::select! {
                            _ = shutdown.changed() => return Ok(()),
                            _ = tokio::time::sleep(self.settings.pull_heartbeat) => {}
                        }
                    }
                    messages = self.pull(p, &consumer, batch).await?;
                    continue;
                }
            }
            unanswered = 0;
            let mut msgs = Batch::new(&self.subjects, p, &mut delivered);
            msgs.push(pulled(p, first)?)?;
            let gathered = tokio::time::sleep(self.settings.gather_wait);
            tokio::pin!(gathered);
            // What is ready now, then, while the server says more of the
            // partition is pending and the batch is not full, what arrives
            // next: a backlog is folded in full batches (one commit each)
            // rather than in the small chunks the pull happens to deliver.
            // Caught up, the batch goes at once.
            loop {
                while msgs.len() < batch {
                    match messages.next().now_or_never() {
                        Some(m) => msgs.push(pulled(p, m)?)?,
                        None => break,
                    }
                }
                if msgs.len() >= batch || msgs.pending == 0 {
                    break;
                }
                let next = tokio::select! {
                    _ = lease.lost() => {
                        if carry_on(lease, shutdown).await {
                            continue;
                        }
                        return Ok(());
                    }
                    _ = shutdown.changed() => return Ok(()),
                    _ = &mut gathered => break,
                    m = messages.next() => m,
                };
                msgs.push(pulled(p, next)?)?;
            }
            match self
                .fold_batch(lease, engine, health, msgs, shutdown)
                .await?
            {
                BatchEnd::Committed => {}
                BatchEnd::Stopped => return Ok(()),
            }
        }
    }

    /// Records a `clock_ticked` for the partition (see the module doc);
    /// false when the lease ran out or the process is stopping first.
    async fn tick(
        &self,
        lease: &Lease,
        engine: &SharedEngine<B>,
        health: &SharedHealth,
        shutdown: &mut watch::Receiver<bool>,
    ) -> bool {
        let tick = {
            let e = lock(engine);
            e.partition_key().map(|(key, recorder)| {
                crate::core::event::Envelope::new(
                    DerivedId::ClockTick {
                        partition_key: key,
                        position: e.position(),
                    }
                    .to_string(),
                    key,
                    wall_ms(),
                    crate::core::event::EventBody::ClockTicked(crate::core::event::ClockTicked {
                        recorded_by: Some(recorder.to_string()),
                    }),
                )
            })
        };
        let Some(tick) = tick else {
            // An engine that records nothing for its partition (a test's)
            // waits for records instead.
            return lease.still_held();
        };
        telemetry::ClockTicked {
            partition: lease.partition(),
        }
        .emit();
        let effects = Effects {
            decisions: vec![tick],
            ..Effects::default()
        };
        self.publish_effects(lease, health, &effects, shutdown)
            .await
    }

    /// Whether the job queue still holds `snap`'s job (queued, or taken by
    /// a worker that has not acknowledged it). When it cannot tell, no.
    async fn job_queued(&self, snap: &crate::core::sweep::SweepSnapshot) -> bool {
        let Ok(subject) = self.subjects.job(&snap.conversation) else {
            return false;
        };
        match self.jobs.get_last_raw_message_by_subject(&subject).await {
            Ok(message) => crate::nats::jobs::JobMessage::decode(&message.payload)
                .is_ok_and(|m| m.job_id == snap.job.job_id),
            Err(_) => false,
        }
    }

    /// Folds, publishes, commits and acknowledges one batch.
    async fn fold_batch(
        &self,
        lease: &Lease,
        engine: &SharedEngine<B>,
        health: &SharedHealth,
        batch: Batch<'_>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<BatchEnd, FolderError> {
        let p = lease.partition();
        let Batch {
            records,
            last_ack,
            pending,
            ..
        } = batch;
        let Some(last_ack) = last_ack else {
            return Ok(BatchEnd::Committed);
        };
        let span = tracing::debug_span!(
            "folder_batch",
            partition = p,
            first_seq = records.first().map_or(0, |r| r.position),
            last_seq = records.last().map_or(0, |r| r.position),
            events = records.len()
        );
        telemetry::BatchFolded {
            partition: p,
            records: records.len(),
        }
        .emit();
        telemetry::ConsumerLag {
            partition: p,
            pending,
        }
        .emit();
        let folding = engine.clone();
        let (effects, position, holding) = tokio::task::spawn_blocking(move || {
            let _enter = span.enter();
            let mut e = lock(&folding);
            let mut effects = Effects::default();
            for r in &records {
                e.apply_record(r, &mut effects)?;
            }
            // Caught up: whatever is still held was never published.
            if pending == 0 {
                e.end_history();
            }
            e.finish(&mut effects)?;
            Ok::<_, crate::store::StoreError>((effects, e.position(), e.holding()))
        })
        .await
        .map_err(|source| FolderError::Task {
            partition: p,
            source,
        })??;

        if !carry_on(lease, shutdown).await {
            return Ok(BatchEnd::Stopped);
        }
        if !self
            .publish_effects(lease, health, &effects, shutdown)
            .await
        {
            return Ok(BatchEnd::Stopped);
        }
        if !carry_on(lease, shutdown).await {
            return Ok(BatchEnd::Stopped);
        }
        let committing = engine.clone();
        tokio::task::spawn_blocking(move || lock(&committing).commit())
            .await
            .map_err(|source| FolderError::Task {
                partition: p,
                source,
            })??;
        {
            let mut h = lock(health);
            h.position = position;
            h.catching_up = holding;
            h.dead_letters += effects.dead_letters.len() as u64;
        }
        // Ack-all: acknowledges every message of the batch. A lost ack only
        // means a redelivery, which the position check skips.
        if let Err(e) = last_ack.ack().await {
            tracing::debug!(partition = p, error = %e, "ack failed (redelivery will be skipped)");
        }
        Ok(BatchEnd::Committed)
    }

    /// Publishes a batch's effects, retrying what can succeed later until
    /// the stream has them all (true), or the lease runs out or the process
    /// stops (false). What can never be published is dead-lettered instead.
    async fn publish_effects(
        &self,
        lease: &Lease,
        health: &SharedHealth,
        effects: &Effects,
        shutdown: &mut watch::Receiver<bool>,
    ) -> bool {
        if effects.is_empty() {
            return true;
        }
        if self.settings.fault == Some(Fault::AbortAfterJobDecisions) && !effects.jobs.is_empty() {
            let decisions = Effects {
                decisions: effects.decisions.clone(),
                ..Effects::default()
            };
            if Box::pin(self.publish_effects(lease, health, &decisions, shutdown)).await {
                tracing::error!(
                    partition = lease.partition(),
                    "{FAULT_VAR}: aborting after the decisions were stored, before the jobs"
                );
                std::process::abort();
            }
            return false;
        }
        let mut backoff = Backoff::new(self.settings.retry_backoff);
        // Effects already stored, by index, so a retry sends only the rest.
        let mut done = Done::default();
        loop {
            match self
                .try_publish(lease.partition(), effects, &mut done)
                .await
            {
                Ok(()) => {
                    note_recovered(health);
                    return true;
                }
                Err(e) => {
                    tracing::warn!(partition = lease.partition(), error = %e, "publishing effects failed, retrying");
                    note_failure(health, &e);
                }
            }
            if *shutdown.borrow() {
                return false;
            }
            tokio::select! {
                _ = lease.lost() => {
                    if !carry_on(lease, shutdown).await {
                        return false;
                    }
                }
                _ = shutdown.changed() => return false,
                _ = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }

    async fn try_publish(
        &self,
        partition: u32,
        effects: &Effects,
        done: &mut Done,
    ) -> Result<(), PublishFailure> {
        let mut pending: Vec<(Effect, PublishAckFuture)> = Vec::new();
        let mut unpublishable: Vec<(String, String, Vec<u8>)> = Vec::new();
        for (i, d) in effects.decisions.iter().enumerate() {
            if done.decisions.contains(&i) {
                continue;
            }
            match self.publisher.event(Origin::Service, d).await {
                Ok(ack) => pending.push((Effect::Decision(i), ack)),
                Err(e) if e.is_permanent() => {
                    done.decisions.insert(i);
                    unpublishable.push((d.id.clone(), e.to_string(), d.to_msgpack()));
                }
                Err(e) => return Err(e),
            }
        }
        for (i, snap) in effects.requeued.iter().enumerate() {
            if done.requeued.contains(&i) {
                continue;
            }
            if self.job_queued(snap).await {
                done.requeued.insert(i);
                continue;
            }
            telemetry::JobRequeued {
                conversation_id: &snap.conversation,
                job_id: &snap.job.job_id,
            }
            .emit();
            let ack = publish_job(
                &self.publisher.js,
                &self.payloads,
                &self.subjects,
                snap,
                self.settings.max_inline_job_bytes,
            )
            .await
            .map_err(|e| PublishFailure::Nats {
                what: format!("job {}", snap.job.job_id),
                source: e.into(),
            })?;
            pending.push((Effect::Requeued(i), ack));
        }
        for (i, snap) in effects.jobs.iter().enumerate() {
            if done.jobs.contains(&i) {
                continue;
            }
            let ack = publish_job(
                &self.publisher.js,
                &self.payloads,
                &self.subjects,
                snap,
                self.settings.max_inline_job_bytes,
            )
            .await
            .map_err(|e| PublishFailure::Nats {
                what: format!("job {}", snap.job.job_id),
                source: e.into(),
            })?;
            pending.push((Effect::Job(i), ack));
        }
        let subject = self.subjects.partition_dead_letter(partition);
        for (i, letter) in effects.dead_letters.iter().enumerate() {
            if done.dead_letters.contains(&i) {
                continue;
            }
            let msg_id = DerivedId::DeadRecord {
                partition,
                position: letter.position,
            }
            .to_string();
            let ack = self
                .publisher
                .dead_letter(DeadLetterMessage {
                    subject: &subject,
                    msg_id: &msg_id,
                    partition,
                    position: Some(letter.position),
                    kind: letter.kind,
                    reason: &letter.reason,
                    payload: &letter.bytes,
                })
                .await?;
            pending.push((Effect::DeadLetter(i), ack));
        }
        for (id, reason, bytes) in &unpublishable {
            tracing::error!(partition, event_id = %id, error = %reason, "decision cannot be published; dead-lettering it");
            let msg_id = DerivedId::DeadEvent { event_id: id }.to_string();
            let ack = self
                .publisher
                .dead_letter(DeadLetterMessage {
                    subject: &subject,
                    msg_id: &msg_id,
                    partition,
                    position: None,
                    kind: "unpublishable",
                    reason,
                    payload: bytes,
                })
                .await?;
            // A dead letter that cannot be stored either is dropped with
            // the error above: nothing is retried for ever.
            if let Err(e) = stored(&msg_id, ack).await {
                tracing::error!(partition, event_id = %id, error = %e, "dead letter not stored");
            }
        }
        let mut first_error = None;
        for (effect, ack) in pending {
            let what = effect.describe(effects);
            match stored(&what, ack).await {
                Ok(()) => done.insert(effect),
                Err(e) if e.is_permanent() => {
                    tracing::error!(partition, error = %e, "effect refused by the stream for good; dropped");
                    done.insert(effect);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

/// Which effect of a batch an acknowledgement is for.
#[derive(Debug, Clone, Copy)]
enum Effect {
    Decision(usize),
    Job(usize),
    Requeued(usize),
    DeadLetter(usize),
}

impl Effect {
    fn describe(self, effects: &Effects) -> String {
        match self {
            Effect::Decision(i) => format!("decision {}", effects.decisions[i].id),
            Effect::Job(i) => format!("job {}", effects.jobs[i].job.job_id),
            Effect::Requeued(i) => format!("requeued job {}", effects.requeued[i].job.job_id),
            Effect::DeadLetter(i) => {
                format!("dead letter of record {}", effects.dead_letters[i].position)
            }
        }
    }
}

/// The effects of a batch the stream already has.
#[derive(Debug, Default)]
struct Done {
    decisions: std::collections::BTreeSet<usize>,
    jobs: std::collections::BTreeSet<usize>,
    requeued: std::collections::BTreeSet<usize>,
    dead_letters: std::collections::BTreeSet<usize>,
}

impl Done {
    fn insert(&mut self, effect: Effect) {
        match effect {
            Effect::Decision(i) => self.decisions.insert(i),
            Effect::Job(i) => self.jobs.insert(i),
            Effect::Requeued(i) => self.requeued.insert(i),
            Effect::DeadLetter(i) => self.dead_letters.insert(i),
        };
    }
}

/// Resolves after `delay`, or never when there is none.
async fn tick_after(delay: Option<Duration>) {
    match delay {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

/// Whether the tenure goes on: at once while `lease` is held; after a lapse,
/// once it is held again (its renewal proved that nobody else wrote the
/// key, so nobody else folded meanwhile and this state is still the
/// partition's latest); never once it is gone or the process stops.
async fn carry_on(lease: &Lease, shutdown: &mut watch::Receiver<bool>) -> bool {
    if *shutdown.borrow() {
        return false;
    }
    if lease.still_held() {
        return true;
    }
    tokio::select! {
        held = lease.regained() => held && !*shutdown.borrow(),
        _ = shutdown.changed() => false,
    }
}

/// A message the pull stream yielded, or why there is none.
fn pulled<E: std::error::Error + Send + Sync + 'static>(
    partition: u32,
    next: Option<Result<jetstream::Message, E>>,
) -> Result<jetstream::Message, FolderError> {
    match next {
        Some(Ok(m)) => Ok(m),
        Some(Err(e)) => Err(NatsError::js(format!("pulling partition {partition}"), e).into()),
        None => Err(NatsError::js(
            format!("pulling partition {partition}"),
            "the message stream ended",
        )
        .into()),
    }
}

/// The messages gathered for one fold and commit, taken apart into log
/// records as they arrive: a pulled message is large (it carries its own
/// client handle), and only the last one's acknowledgement is needed
/// (ack-all). It grows as messages come: a caught-up partition folds
/// batches of one.
struct Batch<'s> {
    subjects: &'s Subjects,
    partition: u32,
    /// The consumer's sequence of the last delivery received (0 before the
    /// first): each delivery must be the next one.
    delivered: &'s mut u64,
    records: Vec<LogRecord>,
    last_ack: Option<jetstream::message::Acker>,
    /// Messages of the partition the server had not delivered yet, as of
    /// the last message.
    pending: u64,
}

impl<'s> Batch<'s> {
    fn new(subjects: &'s Subjects, partition: u32, delivered: &'s mut u64) -> Self {
        Batch {
            subjects,
            partition,
            delivered,
            records: Vec::new(),
            last_ack: None,
            pending: 0,
        }
    }

    fn len(&self) -> usize {
        self.records.len()
    }

    fn push(&mut self, m: jetstream::Message) -> Result<(), FolderError> {
        let info = m
            .info()
            .map_err(|e| NatsError::js("reading message metadata", e))?;
        let (position, pending) = (info.stream_sequence, info.pending);
        // Deliveries are numbered by the consumer, redeliveries included; a
        // number skipped is a message that never reached us, and an ack of
        // a later one (ack-all) would acknowledge it unfolded. A number
        // repeated or lower (a new consumer leader that had not seen the
        // last deliveries) is a redelivery the engine drops by position.
        if info.consumer_sequence > *self.delivered + 1 {
            return Err(FolderError::DeliveryGap {
                partition: self.partition,
                last: *self.delivered,
                got: info.consumer_sequence,
            });
        }
        *self.delivered = info.consumer_sequence;
        let stored_at_ms = u64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).ok();
        let (m, acker) = m.split();
        let (origin, address) = self
            .subjects
            .stored_routing(&m.subject, Some(self.partition));
        self.records.push(LogRecord {
            position,
            origin,
            address,
            stored_at_ms,
            encoding: encoding_of(m.headers.as_ref(), &m.payload),
            bytes: m.payload,
        });
        self.last_ack = Some(acker);
        self.pending = pending;
        Ok(())
    }
}
