//! The summarizer role: stateless workers that take compaction jobs from the
//! work queue (`cf.job.*`, through the durable consumer `cf_summarizers`
//! that every process shares), run the sweep and publish what it produced.
//!
//! Per job:
//!
//! 1. decode the [`JobMessage`] and fetch its snapshot (inline, or from the
//!    object store);
//! 2. run [`run_sweep`] under the job's deadline, sending an in-progress
//!    acknowledgement every `progress_every` so the server does not hand the
//!    job to another worker while this one is working;
//! 3. publish each produced event (summaries, rolling state) to the
//!    conversation's inbound subject, where the folder consumes it, with
//!    the event id as `Nats-Msg-Id`, wait until the stream stored them,
//!    then the same for the `sweep_ended` (so the folder never reads a
//!    job's end before what the job produced);
//! 4. acknowledge the job, and once the server confirmed it, delete its
//!    snapshot from the object store (if it travelled there).
//!
//! While the stream cannot take the results (no leader for a moment, the
//! connection down), the worker keeps the job and publishes them again,
//! all of them (the server's duplicate window and the fold drop what is
//! already stored), with a growing pause, sending in-progress
//! acknowledgements, for up to `store_patience`: an outage of the stream
//! is not the job's fault and must not use up its deliveries. The same
//! holds for a dead letter, whose delivery is the job's last (the server
//! delivers it no more). Only a failure that cannot pass (an event larger
//! than the stream takes) or patience run out hands the job back.
//!
//! A job that cannot run now (rate limited or spend window closed before
//! any pass committed: `SweepEnded.retry_after_ms`) is negatively
//! acknowledged with that delay and nothing is published; the worker moves
//! on instead of sleeping. A crash anywhere leaves the job unacknowledged:
//! the server redelivers it after `ack_wait`, and the rerun publishes the
//! same event ids, which the server (dedup window) or the fold (by id)
//! drops.
//!
//! The delivery numbered `job_max_deliver` is not run: the job goes to the
//! dead-letter subject `cf.dead.<conv>` with the reason, a `sweep_ended`
//! (stop `failed`) is published so the folder can issue the next job, and
//! the job is acknowledged (and its snapshot deleted: the dead letter
//! keeps the job message, which names it). Counting the dead-lettering delivery itself
//! means a job whose every worker died still ends somewhere (the server
//! never delivers a job more than `max_deliver` times).

use crate::core::derived_id::DerivedId;
use crate::core::event::{Envelope, EventBody, Origin, SweepEnded, SweepStop};
use crate::nats::jobs::JobMessage;
use crate::nats::publish::{self, PublishFailure, Publisher};
use crate::nats::retry::Backoff;
use crate::nats::setup::Infrastructure;
use crate::nats::subjects::Subjects;
use crate::nats::NatsError;
use crate::runtime::sweep::run_sweep;
use crate::summarizer::Summarizer;
use crate::telemetry;
use async_nats::jetstream::consumer::{pull, PullConsumer};
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::object_store::ObjectStore;
use async_nats::jetstream::{self, Context};
use futures::StreamExt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::Instrument;

/// The headers of a dead-lettered job (named in [`crate::nats::publish`]).
pub use crate::nats::publish::{DEAD_DELIVERIES_HEADER, DEAD_JOB_HEADER, DEAD_REASON_HEADER};

/// Tuning of the summarizer role.
#[derive(Debug, Clone)]
pub struct SummarizerSettings {
    /// Jobs worked on at once by this process. Default 4.
    pub concurrency: usize,
    /// Interval of in-progress acknowledgements; well below the consumer's
    /// `ack_wait`. Default 10 s (a third of the default `job_ack_wait_ms`).
    pub progress_every: Duration,
    /// Deliveries after which a job is dead-lettered (the consumer's
    /// `max_deliver`, `job_max_deliver`). Default 5.
    pub max_deliver: i64,
    /// How long one pull waits for a job before checking for shutdown.
    /// Default 1 s.
    pub poll: Duration,
    /// On shutdown, how long a job in flight may still run before it is
    /// handed back (NAK without delay). Default 10 s.
    pub shutdown_grace: Duration,
    /// First delay before retrying after an error; doubles up to
    /// [`MAX_RETRY_BACKOFF`](crate::nats::retry::MAX_RETRY_BACKOFF), and
    /// starts again here after a job.
    pub retry_backoff: Duration,
    /// How long a worker keeps publishing a job's results (or its dead
    /// letter) again while the stream cannot store them, before it hands
    /// the job back. Default 60 s.
    pub store_patience: Duration,
}

impl Default for SummarizerSettings {
    fn default() -> Self {
        SummarizerSettings {
            concurrency: 4,
            progress_every: Duration::from_secs(10),
            max_deliver: 5,
            poll: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(10),
            retry_backoff: Duration::from_millis(200),
            store_patience: Duration::from_secs(60),
        }
    }
}

impl SummarizerSettings {
    /// Settings matching the consumer of `cfg` (ack wait, max deliver).
    pub fn from_config(cfg: &crate::nats::NatsConfig) -> Self {
        SummarizerSettings {
            progress_every: Duration::from_millis((cfg.job_ack_wait_ms / 3).max(100)),
            max_deliver: cfg.job_max_deliver,
            ..SummarizerSettings::default()
        }
    }
}

/// What happened to one delivered job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobOutcome {
    /// Ran; its events are stored and the job acknowledged.
    Done { job_id: String, stop: SweepStop },
    /// Could not run now; handed back to run again after the delay.
    Deferred { job_id: String, delay: Duration },
    /// Sent to the dead-letter subject with the reason.
    DeadLettered { job_id: String, reason: String },
    /// Shutdown came first; handed back without delay.
    Returned { job_id: String },
}

/// Counters of one process's summarizer role.
#[derive(Debug, Default)]
pub struct SummarizerCounters {
    pub done: AtomicU64,
    pub deferred: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub returned: AtomicU64,
    pub progress_acks: AtomicU64,
}

/// The summarizer role of one process.
pub struct SummarizerRole<S: Summarizer + 'static> {
    js: Context,
    publisher: Publisher,
    subjects: Subjects,
    payloads: ObjectStore,
    consumer: PullConsumer,
    summarizer: Arc<S>,
    settings: SummarizerSettings,
    counters: Arc<SummarizerCounters>,
    outcomes: Option<mpsc::UnboundedSender<JobOutcome>>,
}

impl<S: Summarizer + 'static> Clone for SummarizerRole<S> {
    fn clone(&self) -> Self {
        SummarizerRole {
            js: self.js.clone(),
            publisher: self.publisher.clone(),
            subjects: self.subjects.clone(),
            payloads: self.payloads.clone(),
            consumer: self.consumer.clone(),
            summarizer: self.summarizer.clone(),
            settings: self.settings.clone(),
            counters: self.counters.clone(),
            outcomes: self.outcomes.clone(),
        }
    }
}

/// How running a job ended (acknowledgement aside).
enum Ran {
    /// Events stored and the job acknowledged.
    Done(SweepStop),
    /// Nothing could run now; nothing published, not yet acknowledged.
    Deferred(Duration),
    /// Shutdown grace ran out; handed back.
    Returned,
}

/// Shutdown was asked, or nobody is left to ask for it (the sender was
/// dropped): a job in flight treats a closed channel as shutdown, and so
/// does the pull loop, rather than pulling jobs only to hand each back
/// when its grace runs out.
fn stopping(shutdown: &watch::Receiver<bool>) -> bool {
    *shutdown.borrow() || shutdown.has_changed().is_err()
}

/// Waits out the shutdown grace, if one started.
async fn until(grace: &mut Option<std::pin::Pin<Box<tokio::time::Sleep>>>) {
    match grace {
        Some(sleep) => sleep.await,
        None => std::future::pending().await,
    }
}

/// How long, and how often, to try again what the stream did not take.
#[derive(Debug, Clone, Copy)]
struct Patience {
    /// The first pause; each next one is twice as long, up to `longest`.
    first: Duration,
    longest: Duration,
    /// No try starts once this has passed since the first.
    total: Duration,
}

/// Runs `attempt` until it succeeds, fails for good
/// ([`PublishFailure::is_permanent`]), the process stops, or the next try
/// would start after `patience.total`; before each pause, `hold`. Returns
/// the last failure when it gives up.
async fn patiently<A, AF, H, HF>(
    patience: Patience,
    shutdown: &mut watch::Receiver<bool>,
    mut attempt: A,
    mut hold: H,
) -> Result<(), PublishFailure>
where
    A: FnMut() -> AF,
    AF: Future<Output = Result<(), PublishFailure>>,
    H: FnMut() -> HF,
    HF: Future<Output = ()>,
{
    let give_up = tokio::time::Instant::now() + patience.total;
    let mut backoff = Backoff::up_to(
        patience.first.max(Duration::from_millis(1)),
        patience.longest,
    );
    loop {
        let failure = match attempt().await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let pause = backoff.next_delay();
        if failure.is_permanent()
            || stopping(shutdown)
            || tokio::time::Instant::now() + pause > give_up
        {
            return Err(failure);
        }
        tracing::warn!(
            error = %failure,
            retry_in_ms = pause.as_millis() as u64,
            "the stream did not store a job's output; the job is held and published again"
        );
        hold().await;
        tokio::select! {
            _ = shutdown.changed() => {}
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// The pause before a job that could not run is delivered again: 1 s (or
/// `backoff`, when longer) after its first delivery, doubling with each
/// next one, at most 30 s.
fn redelivery_delay(backoff: Duration, delivered: i64) -> Duration {
    let doublings = u32::try_from(delivered.saturating_sub(1).clamp(0, 5)).unwrap_or(0);
    backoff
        .max(Duration::from_secs(1))
        .saturating_mul(1 << doublings)
        .min(Duration::from_secs(30))
}

/// Why a job could not be run at all (it will be dead-lettered at its last
/// delivery, retried before).
#[derive(Debug, thiserror::Error)]
enum Unrunnable {
    #[error("{0}")]
    Bad(String),
}

impl<S: Summarizer + 'static> SummarizerRole<S> {
    /// Binds to the shared summarizer consumer that `setup::ensure` created.
    pub async fn new(
        js: Context,
        infra: &Infrastructure,
        summarizer: Arc<S>,
        settings: SummarizerSettings,
    ) -> Result<Self, NatsError> {
        let name = infra.subjects.summarizer_consumer();
        let consumer: PullConsumer = infra
            .jobs
            .get_consumer::<pull::Config>(&name)
            .await
            .map_err(|e| NatsError::js(format!("looking up consumer {name}"), e))?;
        Ok(SummarizerRole {
            publisher: Publisher::for_events(js.clone(), infra),
            js,
            subjects: infra.subjects.clone(),
            payloads: infra.payloads.clone(),
            consumer,
            summarizer,
            settings,
            counters: Arc::new(SummarizerCounters::default()),
            outcomes: None,
        })
    }

    /// Reports every job outcome on the returned channel (tests, metrics).
    pub fn watch_outcomes(&mut self) -> mpsc::UnboundedReceiver<JobOutcome> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.outcomes = Some(tx);
        rx
    }

    pub fn counters(&self) -> Arc<SummarizerCounters> {
        self.counters.clone()
    }

    /// Runs `concurrency` workers until `shutdown` turns true; each stops
    /// pulling, then finishes (or hands back) the job it holds.
    ///
    /// Dropping `run` (a crash, or an aborted task as in `Service::abort`)
    /// aborts the workers with it, as killing the process would: their
    /// progress acknowledgements stop, so the server hands their jobs to
    /// another worker after `ack_wait`, and they pull no more jobs.
    pub async fn run(self, shutdown: watch::Receiver<bool>) {
        let mut workers = JoinSet::new();
        for i in 0..self.settings.concurrency.max(1) {
            workers.spawn(self.clone().worker(i, shutdown.clone()));
        }
        while workers.join_next().await.is_some() {}
    }

    async fn worker(self, index: usize, mut shutdown: watch::Receiver<bool>) {
        tracing::debug!(worker = index, "summarizer worker started");
        let mut backoff = Backoff::new(self.settings.retry_backoff);
        while !stopping(&shutdown) {
            match self.next_job().await {
                Ok(Some(message)) => {
                    backoff.reset();
                    let span = tracing::info_span!(
                        "summarizer_job",
                        stream_seq = message.info().map_or(0, |i| i.stream_sequence),
                        job_id = tracing::field::Empty,
                        conversation_id = tracing::field::Empty,
                    );
                    let outcome = self.handle(message, &mut shutdown).instrument(span).await;
                    self.record(outcome);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(worker = index, "pulling a job failed, retrying: {e}");
                    tokio::select! {
                        _ = shutdown.changed() => {}
                        _ = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                }
            }
        }
        tracing::debug!(worker = index, "summarizer worker stopped");
    }

    /// One job, or none within the poll interval. Pulling one at a time
    /// means a stopping worker never holds jobs it has not started.
    async fn next_job(&self) -> Result<Option<jetstream::Message>, NatsError> {
        let mut batch = self
            .consumer
            .batch()
            .max_messages(1)
            .expires(self.settings.poll)
            .messages()
            .await
            .map_err(|e| NatsError::js("pulling a job", e))?;
        match batch.next().await {
            None => Ok(None),
            Some(Ok(m)) => Ok(Some(m)),
            Some(Err(e)) => Err(NatsError::js("pulling a job", e)),
        }
    }

    fn record(&self, outcome: Result<JobOutcome, NatsError>) {
        let outcome = match outcome {
            Ok(o) => o,
            Err(e) => {
                // Unacknowledged: the error says what becomes of the job.
                tracing::warn!("job not finished: {e}");
                return;
            }
        };
        if let JobOutcome::Deferred { job_id, delay } = &outcome {
            telemetry::JobRetried {
                job_id,
                delay: *delay,
            }
            .emit();
        }
        let c = &self.counters;
        match &outcome {
            JobOutcome::Done { .. } => c.done.fetch_add(1, Ordering::Relaxed),
            JobOutcome::Deferred { .. } => c.deferred.fetch_add(1, Ordering::Relaxed),
            JobOutcome::DeadLettered { .. } => c.dead_lettered.fetch_add(1, Ordering::Relaxed),
            JobOutcome::Returned { .. } => c.returned.fetch_add(1, Ordering::Relaxed),
        };
        if let Some(tx) = &self.outcomes {
            let _ = tx.send(outcome);
        }
    }

    async fn handle(
        &self,
        message: jetstream::Message,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<JobOutcome, NatsError> {
        let delivered = message
            .info()
            .map_err(|e| NatsError::js("reading job metadata", e))?
            .delivered;
        let job = match JobMessage::decode(&message.payload) {
            Ok(job) => job,
            Err(e) => {
                // Undecodable bytes never become runnable: dead-letter now.
                let reason = format!("undecodable job: {e}");
                return self
                    .dead_letter(&message, None, delivered, "undecodable", reason, shutdown)
                    .await;
            }
        };
        let span = tracing::Span::current();
        span.record("job_id", job.job_id.as_str());
        span.record("conversation_id", job.conversation.as_str());
        let max = self.settings.max_deliver;
        if max > 1 && delivered >= max {
            let reason = format!(
                "delivered {delivered} times without completing (workers died, timed out or \
                 were deferred each time)"
            );
            return self
                .dead_letter(
                    &message,
                    Some(&job),
                    delivered,
                    "max_deliveries",
                    reason,
                    shutdown,
                )
                .await;
        }
        let job_id = job.job_id.clone();
        match self.run_job(&message, &job, shutdown).await {
            Ok(Ran::Done(stop)) => Ok(JobOutcome::Done { job_id, stop }),
            Ok(Ran::Returned) => Ok(JobOutcome::Returned { job_id }),
            Ok(Ran::Deferred(delay)) if delivered >= max => {
                let reason = format!(
                    "could not run by its last delivery (last: retry after {} ms)",
                    delay.as_millis()
                );
                self.dead_letter(
                    &message,
                    Some(&job),
                    delivered,
                    "deferred_too_often",
                    reason,
                    shutdown,
                )
                .await
            }
            Ok(Ran::Deferred(delay)) => {
                let _ = message.ack_with(AckKind::Nak(Some(delay))).await;
                Ok(JobOutcome::Deferred { job_id, delay })
            }
            Err(Unrunnable::Bad(reason)) if delivered >= max => {
                self.dead_letter(
                    &message,
                    Some(&job),
                    delivered,
                    "unrunnable",
                    reason,
                    shutdown,
                )
                .await
            }
            Err(Unrunnable::Bad(reason)) => {
                // Maybe transient (the object store was unreachable): hand
                // it back for another try, later with each delivery, so
                // the deliveries span a longer outage.
                let delay = redelivery_delay(self.settings.retry_backoff, delivered);
                tracing::warn!(
                    job = %job_id,
                    delivered,
                    retry_in_ms = delay.as_millis() as u64,
                    "job could not run, retrying later: {reason}"
                );
                let _ = message.ack_with(AckKind::Nak(Some(delay))).await;
                Ok(JobOutcome::Deferred { job_id, delay })
            }
        }
    }

    async fn run_job(
        &self,
        message: &jetstream::Message,
        job: &JobMessage,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Ran, Unrunnable> {
        let snapshot = job
            .snapshot(&self.payloads)
            .await
            .map_err(|e| Unrunnable::Bad(e.to_string()))?;
        if snapshot.job.job_id != job.job_id || snapshot.conversation != job.conversation {
            return Err(Unrunnable::Bad(format!(
                "job {} carries the snapshot of job {} of {:?}",
                job.job_id, snapshot.job.job_id, snapshot.conversation
            )));
        }
        let deadline = Duration::from_millis(snapshot.job.deadline_ms.max(1));

        // Events go out as soon as the sweep commits them, so a worker
        // dying mid-sweep loses nothing committed; the sweep_ended is held
        // back until it is known whether the job is deferred instead.
        let (tx, mut rx) = mpsc::unbounded_channel::<Envelope>();
        let mut ended_event = None;
        let sweep = run_sweep(snapshot, self.summarizer.as_ref(), deadline, |e| {
            if matches!(e.body, EventBody::SweepEnded(_)) {
                ended_event = Some(e);
            } else {
                let _ = tx.send(e);
            }
        });
        let mut sweep = Box::pin(sweep);
        let mut pending: Vec<PublishAckFuture> = Vec::new();
        // Every result, in order: what the stream has not confirmed goes
        // out again from here.
        let mut results: Vec<Envelope> = Vec::new();
        let mut all_sent = true;
        let mut progress = tokio::time::interval(self.settings.progress_every);
        progress.tick().await;
        let mut grace: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        let ended: SweepEnded = loop {
            tokio::select! {
                ended = &mut sweep => break ended,
                Some(e) = rx.recv() => {
                    match self.publisher.event(Origin::Service, &e).await {
                        Ok(ack) => pending.push(ack),
                        Err(_) => all_sent = false,
                    }
                    results.push(e);
                }
                _ = progress.tick() => {
                    if message.ack_with(AckKind::Progress).await.is_ok() {
                        self.counters.progress_acks.fetch_add(1, Ordering::Relaxed);
                    }
                }
                changed = shutdown.changed(), if grace.is_none() => {
                    if changed.is_err() || *shutdown.borrow() {
                        grace = Some(Box::pin(tokio::time::sleep(self.settings.shutdown_grace)));
                    }
                }
                _ = until(&mut grace), if grace.is_some() => {
                    // Out of grace: whatever was committed stays published;
                    // another worker reruns the rest.
                    drop(sweep);
                    while let Ok(e) = rx.try_recv() {
                        if let Ok(ack) = self.publisher.event(Origin::Service, &e).await {
                            pending.push(ack);
                        }
                    }
                    for ack in pending {
                        let _ = ack.await;
                    }
                    let _ = message.ack_with(AckKind::Nak(None)).await;
                    return Ok(Ran::Returned);
                }
            }
        };
        drop(sweep);
        drop(tx);
        let streamed = results.len();
        results.extend(std::iter::from_fn(|| rx.try_recv().ok()));
        for ack in pending {
            all_sent &= publish::stored("a job's result", ack).await.is_ok();
        }
        // The results not yet out, or all of them when the stream missed
        // one (the server's duplicate window and the fold drop the rest).
        let unstored = |e: PublishFailure| {
            // Not acknowledged: run again; what was stored is deduplicated.
            Unrunnable::Bad(format!("publishing the results failed: {e}"))
        };
        let rest = &results[if all_sent { streamed } else { 0 }..];
        if !rest.is_empty() {
            self.patiently(message, shutdown, || self.store(rest))
                .await
                .map_err(unstored)?;
        }
        if ended.committed == 0 && ended.retry_after_ms.is_some() {
            return Ok(Ran::Deferred(Duration::from_millis(
                ended.retry_after_ms.unwrap_or(0),
            )));
        }
        // The end, once the stream holds everything the job produced.
        if let Some(e) = ended_event.take() {
            let end = std::slice::from_ref(&e);
            self.patiently(message, shutdown, || self.store(end))
                .await
                .map_err(unstored)?;
        }
        // A lost ack means one redelivery, whose events are dropped as
        // duplicates: the snapshot stays for it (the bucket's max_age
        // removes it if it is not needed).
        match message.double_ack().await {
            Ok(()) => self.discard_snapshot(job).await,
            Err(e) => tracing::debug!(job = %job.job_id, "job ack not confirmed: {e}"),
        }
        Ok(Ran::Done(ended.stop))
    }

    /// Publishes `events` in order and waits until the stream stored them all.
    async fn store(&self, events: &[Envelope]) -> Result<(), PublishFailure> {
        let mut pending = Vec::with_capacity(events.len());
        for e in events {
            pending.push((e, self.publisher.event(Origin::Service, e).await?));
        }
        for (e, ack) in pending {
            publish::stored(&format!("{} {}", e.type_name(), e.id), ack).await?;
        }
        Ok(())
    }

    /// [`patiently`], holding `message`'s job meanwhile (an in-progress
    /// acknowledgement before each pause).
    async fn patiently<A, AF>(
        &self,
        message: &jetstream::Message,
        shutdown: &mut watch::Receiver<bool>,
        attempt: A,
    ) -> Result<(), PublishFailure>
    where
        A: FnMut() -> AF,
        AF: Future<Output = Result<(), PublishFailure>>,
    {
        let patience = Patience {
            first: self.settings.retry_backoff,
            // Pauses no longer than the progress interval keep the job
            // held whatever the consumer's ack_wait.
            longest: Duration::from_secs(5).min(self.settings.progress_every),
            total: self.settings.store_patience,
        };
        patiently(patience, shutdown, attempt, || async {
            if message.ack_with(AckKind::Progress).await.is_ok() {
                self.counters.progress_acks.fetch_add(1, Ordering::Relaxed);
            }
        })
        .await
    }

    /// Moves a job to `cf.dead.<conv>` with the reason, tells the folder the
    /// job ended (so the conversation is not left with a pending job for
    /// ever), then acknowledges it. Both publishes are retried
    /// [`patiently`]: this is usually the job's last delivery.
    async fn dead_letter(
        &self,
        message: &jetstream::Message,
        job: Option<&JobMessage>,
        delivered: i64,
        kind: &'static str,
        reason: String,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<JobOutcome, NatsError> {
        let conversation = match job {
            Some(j) => j.conversation.clone(),
            None => message
                .subject
                .as_str()
                .rsplit('.')
                .next()
                .and_then(|t| crate::nats::subjects::decode_conversation(t).ok())
                .unwrap_or_default(),
        };
        let job_id = job.map_or_else(
            || format!("seq-{}", message.info().map_or(0, |i| i.stream_sequence)),
            |j| j.job_id.clone(),
        );
        telemetry::JobDeadLettered {
            conversation_id: &conversation,
            job_id: &job_id,
            delivered,
            reason: kind,
            error: &reason,
        }
        .emit();
        let subject = if conversation.is_empty() {
            format!("{}.dead.unknown", self.subjects.prefix())
        } else {
            self.subjects.dead_letter(&conversation)?
        };
        let last = self.settings.max_deliver > 0 && delivered >= self.settings.max_deliver;
        let unstored = |what: &str, e: PublishFailure| {
            let then = if last {
                "its last delivery: the server delivers it no more, the folder issues the \
                 conversation's next job when this one expires"
            } else {
                "the server delivers it again after ack_wait"
            };
            NatsError::js(format!("{what} of job {job_id} ({then})"), e)
        };
        self.patiently(message, shutdown, || async {
            let ack = publish::dead_job(
                &self.js,
                subject.clone(),
                &job_id,
                &reason,
                delivered,
                message.payload.clone(),
            )
            .await?;
            publish::stored("a dead letter", ack).await
        })
        .await
        .map_err(|e| unstored("dead-lettering", e))?;
        if let Some(j) = job {
            // The conversation's clock, as the sweep's own events carry it.
            let issued_at = match &j.snapshot {
                Some(s) => s.job.issued_at,
                None => j
                    .snapshot(&self.payloads)
                    .await
                    .map_or(0, |s| s.job.issued_at),
            };
            let ended = Envelope::new(
                DerivedId::SweepEnded { job_id: &job_id }.to_string(),
                conversation.clone(),
                issued_at,
                EventBody::SweepEnded(SweepEnded {
                    job_id: job_id.clone(),
                    passes: 0,
                    committed: 0,
                    stop: SweepStop::Failed,
                    detail: Some(format!("dead-lettered: {reason}")),
                    calls: 0,
                    tokens_spent: 0,
                    cost_micros: 0,
                    retry_after_ms: None,
                }),
            );
            self.patiently(message, shutdown, || {
                self.store(std::slice::from_ref(&ended))
            })
            .await
            .map_err(|e| unstored("publishing the end", e))?;
        }
        match message.double_ack().await {
            Ok(()) => {
                if let Some(j) = job {
                    self.discard_snapshot(j).await;
                }
            }
            Err(e) => tracing::debug!(job = %job_id, "dead-lettered job ack not confirmed: {e}"),
        }
        Ok(JobOutcome::DeadLettered { job_id, reason })
    }

    /// Deletes an ended job's snapshot from the object store; a failure is
    /// only logged (the bucket's `max_age` removes it later).
    async fn discard_snapshot(&self, job: &JobMessage) {
        if let Err(e) = job.discard_snapshot(&self.payloads).await {
            tracing::warn!(
                job_id = %job.job_id,
                error = %e,
                "cannot delete the ended job's snapshot; the object store's max_age removes it"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn transient() -> PublishFailure {
        PublishFailure::NotStored {
            what: "a job's result".into(),
            source: "no stream found for given subject".into(),
        }
    }

    const PATIENCE: Patience = Patience {
        first: Duration::from_millis(200),
        longest: Duration::from_millis(500),
        total: Duration::from_secs(2),
    };

    /// Runs [`patiently`] over `outcomes` (the attempts' results in turn,
    /// transient failures after the last): the result, attempts, holds and
    /// the time it took.
    async fn run(
        outcomes: Vec<Result<(), PublishFailure>>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> (Result<(), PublishFailure>, usize, usize, Duration) {
        let outcomes = std::cell::RefCell::new(outcomes.into_iter());
        let (attempts, holds) = (Cell::new(0), Cell::new(0));
        let started = tokio::time::Instant::now();
        let result = patiently(
            PATIENCE,
            shutdown,
            || {
                attempts.set(attempts.get() + 1);
                let next = outcomes
                    .borrow_mut()
                    .next()
                    .unwrap_or_else(|| Err(transient()));
                async move { next }
            },
            || {
                holds.set(holds.get() + 1);
                async {}
            },
        )
        .await;
        (result, attempts.get(), holds.get(), started.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn results_the_stream_did_not_take_are_sent_again_until_it_does() {
        let (_stop, mut shutdown) = watch::channel(false);
        let outcomes = vec![Err(transient()), Err(transient()), Err(transient()), Ok(())];
        let (result, attempts, holds, took) = run(outcomes, &mut shutdown).await;
        assert!(result.is_ok());
        assert_eq!((attempts, holds), (4, 3), "the job held before each pause");
        // Pauses of 200, 400, then 500 ms (the longest).
        assert_eq!(took, Duration::from_millis(1_100));
    }

    #[tokio::test(start_paused = true)]
    async fn patience_runs_out_with_the_last_failure() {
        let (_stop, mut shutdown) = watch::channel(false);
        let (result, attempts, _, took) = run(Vec::new(), &mut shutdown).await;
        assert!(result.unwrap_err().to_string().contains("no stream found"));
        // Tries at 0, 0.2, 0.6, 1.1 and 1.6 s; the next would start after 2 s.
        assert_eq!(attempts, 5);
        assert_eq!(took, Duration::from_millis(1_600));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_no_retry_can_mend_or_a_stop_ends_it_at_once() {
        let (stop, mut shutdown) = watch::channel(false);
        let too_large = PublishFailure::TooLarge {
            what: "summary s".into(),
            size: 2 << 20,
            limit: 1 << 20,
        };
        let (result, attempts, holds, took) = run(vec![Err(too_large)], &mut shutdown).await;
        assert!(matches!(result, Err(PublishFailure::TooLarge { .. })));
        assert_eq!((attempts, holds, took), (1, 0, Duration::ZERO));

        stop.send(true).unwrap();
        let (result, attempts, holds, _) = run(Vec::new(), &mut shutdown).await;
        assert!(result.is_err());
        assert_eq!((attempts, holds), (1, 0));
    }

    #[test]
    fn redeliveries_of_a_job_that_could_not_run_come_later_each_time() {
        let delays: Vec<u64> = (0..=7)
            .map(|d| redelivery_delay(Duration::from_millis(200), d).as_secs())
            .collect();
        assert_eq!(delays, [1, 1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(
            redelivery_delay(Duration::from_secs(3), 2),
            Duration::from_secs(6)
        );
    }
}
