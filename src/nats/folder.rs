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
//! 3. loop: take the messages that are ready (up to `batch`; while the
//!    server reports more of the partition pending, wait briefly for them,
//!    so a backlog goes in full batches), fold them,
//!    publish the fold's decisions to `cf.in.<conv>` and its jobs to
//!    `cf.job.<conv>` with deterministic message ids and wait for the
//!    stream's acknowledgements, commit the state and position atomically,
//!    then acknowledge the batch (one ack-all of its last message).
//!
//! Decisions are published before the commit, as in the embedded pipeline:
//! after a crash between the two, the replay derives the same decisions
//! with the same ids; JetStream drops the copies within the dedup window
//! and the fold drops later ones by id. Nothing decided is lost and nothing
//! is doubled. The lease is checked before publishing and before
//! committing: a process that lost it stops without either, so two
//! processes never commit the same partition's effects.
//!
//! An event whose subject names another conversation than its envelope is
//! rejected with that reason (its partition would be wrong).

use crate::core::event::{Encoding, Envelope};
use crate::core::sweep::{self, SweepSnapshot};
use crate::log::LogRecord;
use crate::nats::event_log::{encoding_of, event_headers};
use crate::nats::jobs::publish_job;
use crate::nats::leases::{Lease, LeaseEvent};
use crate::nats::setup::{folder_consumer_config, Infrastructure};
use crate::nats::subjects::Subjects;
use crate::nats::NatsError;
use crate::runtime::engine::Engine;
use crate::store::{KvBackend, StoreError};
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

/// Tuning of the folder.
#[derive(Debug, Clone)]
pub struct FolderSettings {
    /// Most events folded between two commits. Default 1024.
    pub batch: usize,
    /// Unacknowledged messages the server lets a folder have. Default 8192.
    pub max_ack_pending: i64,
    /// Job snapshots above this go to the object store. Default 262144.
    pub max_inline_job_bytes: usize,
    /// First delay before retrying after an error; doubles up to 5 s.
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
}

impl Default for FolderSettings {
    fn default() -> Self {
        FolderSettings {
            batch: 1024,
            max_ack_pending: 8192,
            max_inline_job_bytes: 256 * 1024,
            retry_backoff: Duration::from_millis(200),
            gather_wait: Duration::from_millis(50),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("folder task of partition {partition} failed: {detail}")]
    Task { partition: u32, detail: String },
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // An engine is only left half-updated by a panic inside the fold, which
    // is a bug; readers then see the state as far as it got.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A partition's engine and the lease it is folded under.
type Tenure<B> = (Lease, SharedEngine<B>);

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
            .filter(|(lease, _)| lease.still_held())
            .map(|(_, e)| e.clone())
    }

    /// Partitions being folded here, ascending.
    pub fn partitions(&self) -> Vec<u32> {
        let map = self.inner.read().unwrap_or_else(|p| p.into_inner());
        map.iter()
            .filter(|(_, (lease, _))| lease.still_held())
            .map(|(p, _)| *p)
            .collect()
    }

    fn insert(&self, lease: &Lease, engine: SharedEngine<B>) {
        let mut map = self.inner.write().unwrap_or_else(|p| p.into_inner());
        map.insert(lease.partition(), (lease.clone(), engine));
    }

    /// Removes the entry of this tenure (not a later one).
    fn remove(&self, lease: &Lease) {
        let mut map = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if map
            .get(&lease.partition())
            .is_some_and(|(l, _)| l.fencing_token() == lease.fencing_token())
        {
            map.remove(&lease.partition());
        }
    }
}

/// The folder role of one process.
pub struct FolderRole<B: KvBackend> {
    js: Context,
    subjects: Subjects,
    events: stream::Stream,
    payloads: ObjectStore,
    open_engine: EngineFactory<B>,
    settings: FolderSettings,
    engines: EngineMap<B>,
}

impl<B: KvBackend> Clone for FolderRole<B> {
    fn clone(&self) -> Self {
        FolderRole {
            js: self.js.clone(),
            subjects: self.subjects.clone(),
            events: self.events.clone(),
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

/// How one batch ended.
enum BatchEnd {
    Committed,
    /// The lease ran out: nothing was published or committed after that.
    LeaseLost,
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
            js,
            subjects: infra.subjects.clone(),
            events: infra.events.clone(),
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
                // Tasks see their lease end by themselves.
                Some(LeaseEvent::Released { .. } | LeaseEvent::Lost { .. }) => {}
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
        let mut backoff = self.settings.retry_backoff;
        while lease.still_held() && !*shutdown.borrow() {
            match self.fold_while_held(&lease, &mut shutdown).await {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(partition = p, "folder error, retrying: {e}");
                    tokio::select! {
                        _ = lease.lost() => {}
                        _ = shutdown.changed() => {}
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        tracing::info!(partition = p, "folder stopped");
    }

    async fn open_engine(&self, partition: u32) -> Result<SharedEngine<B>, FolderError> {
        let open = self.open_engine.clone();
        let engine = tokio::task::spawn_blocking(move || open(partition))
            .await
            .map_err(|e| FolderError::Task {
                partition,
                detail: e.to_string(),
            })??;
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
                tracing::warn!("flushing the state store on close failed: {err}");
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

    async fn fold_while_held(
        &self,
        lease: &Lease,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), FolderError> {
        let p = lease.partition();
        let engine = self.open_engine(p).await?;
        self.engines.insert(lease, engine.clone());
        let result = self.consume(lease, &engine, shutdown).await;
        self.close_engine(lease, engine).await;
        result
    }

    async fn consume(
        &self,
        lease: &Lease,
        engine: &SharedEngine<B>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), FolderError> {
        let p = lease.partition();
        let after = lock(engine).position();
        let consumer = self.reset_consumer(p, after).await?;
        let batch = self.settings.batch.max(1);
        let messages = consumer
            .stream()
            .max_messages_per_batch(batch)
            .heartbeat(Duration::from_secs(5))
            .messages()
            .await
            .map_err(|e| NatsError::js(format!("pulling partition {p}"), e))?;
        let mut messages = messages;
        loop {
            let first = tokio::select! {
                _ = lease.lost() => return Ok(()),
                _ = shutdown.changed() => return Ok(()),
                m = messages.next() => m,
            };
            let mut msgs = Batch::default();
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
                    _ = lease.lost() => return Ok(()),
                    _ = shutdown.changed() => return Ok(()),
                    _ = &mut gathered => break,
                    m = messages.next() => m,
                };
                msgs.push(pulled(p, next)?)?;
            }
            match self.fold_batch(lease, engine, msgs).await? {
                BatchEnd::Committed => {}
                BatchEnd::LeaseLost => return Ok(()),
            }
        }
    }

    /// Folds, publishes, commits and acknowledges one batch.
    async fn fold_batch(
        &self,
        lease: &Lease,
        engine: &SharedEngine<B>,
        batch: Batch,
    ) -> Result<BatchEnd, FolderError> {
        let p = lease.partition();
        let Batch {
            inbound, last_ack, ..
        } = batch;
        let Some(last_ack) = last_ack else {
            return Ok(BatchEnd::Committed);
        };

        let folding = engine.clone();
        let subjects = self.subjects.clone();
        let (decisions, jobs) = tokio::task::spawn_blocking(move || {
            let mut e = lock(&folding);
            fold_records(&mut e, &subjects, p, inbound)
        })
        .await
        .map_err(|e| FolderError::Task {
            partition: p,
            detail: e.to_string(),
        })?;

        if !lease.still_held() {
            return Ok(BatchEnd::LeaseLost);
        }
        if !self.publish_effects(lease, &decisions, jobs).await? {
            return Ok(BatchEnd::LeaseLost);
        }
        if !lease.still_held() {
            return Ok(BatchEnd::LeaseLost);
        }
        let committing = engine.clone();
        tokio::task::spawn_blocking(move || lock(&committing).commit())
            .await
            .map_err(|e| FolderError::Task {
                partition: p,
                detail: e.to_string(),
            })??;
        // Ack-all: acknowledges every message of the batch. A lost ack only
        // means a redelivery, which the position check skips.
        if let Err(e) = last_ack.ack().await {
            tracing::debug!(
                partition = p,
                "ack failed (redelivery will be skipped): {e}"
            );
        }
        Ok(BatchEnd::Committed)
    }

    /// Publishes decisions and jobs, retrying until the stream has them all
    /// or the lease runs out (false).
    async fn publish_effects(
        &self,
        lease: &Lease,
        decisions: &[Envelope],
        jobs: Vec<SweepSnapshot>,
    ) -> Result<bool, FolderError> {
        let mut backoff = self.settings.retry_backoff;
        loop {
            match self.try_publish(decisions, &jobs).await {
                Ok(()) => return Ok(true),
                Err(e) => {
                    tracing::warn!(
                        partition = lease.partition(),
                        "publishing decisions failed, retrying: {e}"
                    );
                }
            }
            tokio::select! {
                _ = lease.lost() => return Ok(false),
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    async fn try_publish(
        &self,
        decisions: &[Envelope],
        jobs: &[SweepSnapshot],
    ) -> Result<(), NatsError> {
        let mut pending: Vec<PublishAckFuture> = Vec::with_capacity(decisions.len() + jobs.len());
        for d in decisions {
            let subject = self.subjects.inbound(&d.conversation)?;
            let ack = self
                .js
                .publish_with_headers(
                    subject,
                    event_headers(&d.id, Encoding::Msgpack),
                    d.to_msgpack().into(),
                )
                .await
                .map_err(|e| NatsError::js(format!("publishing decision {}", d.id), e))?;
            pending.push(ack);
        }
        for snap in jobs {
            pending.push(
                publish_job(
                    &self.js,
                    &self.payloads,
                    &self.subjects,
                    snap.clone(),
                    self.settings.max_inline_job_bytes,
                )
                .await?,
            );
        }
        for ack in pending {
            ack.await
                .map_err(|e| NatsError::js("waiting for the stream to store a decision", e))?;
        }
        Ok(())
    }
}

/// A message the pull stream yielded, or why there is none.
fn pulled<E: std::fmt::Display>(
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

/// The messages gathered for one fold and commit, taken apart as they
/// arrive: a pulled message is large (it carries its own client handle),
/// and only the last one's acknowledgement is needed (ack-all). It grows
/// as messages come: a caught-up partition folds batches of one.
#[derive(Default)]
struct Batch {
    inbound: Vec<Inbound>,
    last_ack: Option<jetstream::message::Acker>,
    /// Messages of the partition the server had not delivered yet, as of
    /// the last message.
    pending: u64,
}

impl Batch {
    fn len(&self) -> usize {
        self.inbound.len()
    }

    fn push(&mut self, m: jetstream::Message) -> Result<(), FolderError> {
        let info = m
            .info()
            .map_err(|e| NatsError::js("reading message metadata", e))?;
        let (position, pending) = (info.stream_sequence, info.pending);
        let (m, acker) = m.split();
        self.inbound.push(Inbound {
            position,
            encoding: encoding_of(m.headers.as_ref(), &m.payload),
            subject: m.subject,
            payload: m.payload,
        });
        self.last_ack = Some(acker);
        self.pending = pending;
        Ok(())
    }
}

/// A pulled message, as the fold needs it (its subject and payload are
/// the message's own buffers, not copies).
struct Inbound {
    position: u64,
    encoding: Encoding,
    subject: async_nats::Subject,
    payload: bytes::Bytes,
}

impl Inbound {
    /// The log record of a message the fold refuses (rare: copied then).
    fn record(&self) -> LogRecord {
        LogRecord {
            position: self.position,
            encoding: self.encoding,
            bytes: self.payload.to_vec(),
        }
    }
}

/// Why an event may not be folded in this partition, if so.
fn misrouted(
    subjects: &Subjects,
    partition: u32,
    subject: &str,
    event: &Envelope,
) -> Option<String> {
    if subjects.is_event_subject_of(subject, partition, &event.conversation) {
        return None;
    }
    match subjects.parse_event_subject(subject) {
        Ok((p, conversation)) if p == partition && conversation == event.conversation => None,
        Ok((p, conversation)) if p == partition => Some(format!(
            "event {} names conversation {:?} but was published for {conversation:?}; publish \
             to the subject of its own conversation",
            event.id, event.conversation
        )),
        Ok((p, _)) => Some(format!(
            "event {} is stored under partition {p}, not {partition}",
            event.id
        )),
        Err(e) => Some(format!("event {} arrived on a bad subject: {e}", event.id)),
    }
}

/// Folds the records not folded yet; returns the decisions to publish and
/// the snapshots of jobs still pending.
fn fold_records<B: KvBackend>(
    engine: &mut Engine<B>,
    subjects: &Subjects,
    partition: u32,
    inbound: Vec<Inbound>,
) -> (Vec<Envelope>, Vec<SweepSnapshot>) {
    let mut decisions = Vec::new();
    let mut issued = Vec::new();
    for message in inbound {
        // Redelivered, or folded before the last restart.
        if message.position <= engine.position() {
            continue;
        }
        let applied = match Envelope::decode(&message.payload, message.encoding) {
            Ok(event) => match misrouted(subjects, partition, &message.subject, &event) {
                None => engine.apply_at(message.position, event),
                // Attributed to no conversation: folding it into this
                // partition's state would split the conversation.
                Some(reason) => engine.reject(&message.record(), None, &reason),
            },
            Err(_) => engine.apply(&message.record()),
        };
        decisions.extend(applied.decisions);
        issued.extend(applied.jobs);
    }
    // A job is handed out only while it is the conversation's pending one:
    // one issued and superseded within the batch never reaches a worker.
    let snapshots = issued
        .into_iter()
        .filter_map(|(conversation, job)| {
            let conv = engine.state.conversations.get(&conversation)?;
            let pending = conv.pending_job.as_ref()?;
            (pending.job.job_id == job.job_id)
                .then(|| sweep::snapshot(conv, &pending.job, &engine.policy))
        })
        .collect();
    (decisions, snapshots)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{EventBody, TurnAppended};
    use crate::core::message::{ChatMessage, Role};

    fn event(conversation: &str) -> Envelope {
        Envelope::new(
            "e1",
            conversation,
            1,
            EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(Role::User, "hi"))),
        )
    }

    #[test]
    fn events_on_another_conversations_subject_are_refused() {
        let s = Subjects::new("cf").unwrap();
        let e = event("agent:a");
        assert_eq!(misrouted(&s, 3, &s.event(3, "agent:a").unwrap(), &e), None);
        let wrong = misrouted(&s, 3, &s.event(3, "agent:b").unwrap(), &e).unwrap();
        assert!(wrong.contains("agent:b"), "{wrong}");
        assert!(misrouted(&s, 3, &s.event(4, "agent:a").unwrap(), &e).is_some());
        // A non-canonical spelling of the same key is refused too: it
        // hashes to another partition.
        let plain = event("abc");
        assert!(misrouted(&s, 3, "cf.ev.3.~YWJj", &plain).is_some());
        assert_eq!(misrouted(&s, 3, "cf.ev.3.abc", &plain), None);
    }
}
