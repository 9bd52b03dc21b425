//! `contextfold publish`: sends inbound events to NATS as an agent would,
//! one JetStream publish per event on the conversation's inbound subject
//! with `Nats-Msg-Id` = the event's message id (`nats::msg_id`: scoped to
//! its conversation and keyed by the credentials given), so a re-run with
//! the same credentials stores nothing twice and no other agent can take
//! an event's id first.
//!
//! Up to [`IN_FLIGHT`] publishes await the stream's acknowledgement at once.
//! An event the stream did not store for a reason that passes (no leader
//! during an election, no answer in time, no responders, a lost
//! connection) is sent again, with the same message id, after a jittered
//! exponential backoff: first every event already in flight is settled,
//! then the unstored ones go again in their order, and only then new ones.
//! A retry therefore never stores an event twice (the stream drops a
//! repeated id within its dedup window, 2 minutes by default, far longer
//! than the retries). While it waits it says for what
//! (`waiting for the events stream's leader (attempt 3, 1.6 s)`); after
//! `--retry-for` seconds without progress it gives up and says what to
//! check. A refusal that passes no retry (larger than the server or stream
//! takes) fails at once.

use super::nats_args::NatsArgs;
use super::serve::runtime;
use anyhow::{bail, Context, Result};
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self};
use backon::BackoffBuilder;
use contextfold::config::Config;
use contextfold::core::event::{Envelope, Origin};
use contextfold::nats::msg_id::AgentKey;
use contextfold::nats::publish::{Outbound, PublishFailure};
use futures::future::BoxFuture;
use futures::stream::FuturesOrdered;
use futures::{FutureExt, StreamExt};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Publishes awaiting the stream's acknowledgement at once.
const IN_FLIGHT: usize = 512;

/// The first wait before sending unstored events again; it doubles (plus
/// up to as much again at random) up to [`RETRY_MAX_DELAY`].
const RETRY_FIRST_DELAY: Duration = Duration::from_millis(200);
const RETRY_MAX_DELAY: Duration = Duration::from_secs(5);

/// How long one publish waits for the stream's acknowledgement: an
/// election takes seconds, and a shorter wait lets the retries say so.
const ACK_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug, Default)]
struct Tally {
    published: u64,
    duplicates: u64,
    invalid: u64,
}

/// An event's index and what the stream answered to its publish.
type Acked = BoxFuture<'static, (usize, Result<PublishAck, PublishError>)>;

/// One event to publish: its id (to name it) and the message, with
/// `Nats-Msg-Id` the id scoped and keyed ([`Outbound::event_bytes`]).
struct Outgoing {
    id: String,
    message: Outbound,
}

/// Why an event was not stored, as far as waiting can change it.
#[derive(Debug)]
enum NotStored {
    /// Publishing the same bytes again cannot succeed.
    Permanent(String),
    /// A leader election, a timeout, a lost connection: worth waiting for.
    Passing {
        waiting_for: &'static str,
        detail: String,
    },
}

fn classify(e: &PublishError) -> NotStored {
    let detail = e.to_string();
    // The same judgement as the service's own publishes.
    let failure = PublishFailure::NotStored {
        what: String::new(),
        source: detail.clone().into(),
    };
    if e.kind() == PublishErrorKind::MaxPayloadExceeded || failure.is_permanent() {
        return NotStored::Permanent(detail);
    }
    let (waiting_for, detail) = match e.kind() {
        PublishErrorKind::TimedOut => (
            "the events stream's leader",
            format!("no answer within {} s", ACK_WAIT.as_secs()),
        ),
        // What a stream without a leader answers (and one that does not
        // exist: the message on giving up says both).
        PublishErrorKind::StreamNotFound => (
            "the events stream's leader",
            "no responders: the stream has no leader (or does not exist)".to_string(),
        ),
        PublishErrorKind::BrokenPipe => ("the connection to NATS", detail),
        _ if detail.contains("leader") || detail.contains("unavailable") => {
            ("the events stream's leader", detail)
        }
        _ => ("the events stream", detail),
    };
    NotStored::Passing {
        waiting_for,
        detail,
    }
}

/// The retry state of one run: the backoff of the current outage.
struct Retry {
    limit: Duration,
    backoff: backon::ExponentialBackoff,
    attempt: u32,
    since: Option<Instant>,
}

impl Retry {
    fn new(limit: Duration) -> Retry {
        Retry {
            limit,
            backoff: Retry::schedule(),
            attempt: 0,
            since: None,
        }
    }

    fn schedule() -> backon::ExponentialBackoff {
        backon::ExponentialBuilder::default()
            .with_jitter()
            .with_min_delay(RETRY_FIRST_DELAY)
            .with_max_delay(RETRY_MAX_DELAY)
            .without_max_times()
            .build()
    }

    /// An event was stored: the next outage gets a fresh budget.
    fn progressed(&mut self) {
        if self.since.take().is_some() {
            self.backoff = Retry::schedule();
            self.attempt = 0;
        }
    }

    /// How long to wait before sending again, or `None` once the budget
    /// of this outage is spent.
    fn next_wait(&mut self) -> Option<Duration> {
        let since = *self.since.get_or_insert_with(Instant::now);
        let wait = self.backoff.next()?;
        if since.elapsed() + wait > self.limit {
            return None;
        }
        self.attempt += 1;
        Some(wait)
    }
}

pub fn publish(
    config: &Config,
    nats: &NatsArgs,
    file: Option<&Path>,
    format: &str,
    retry_for: Duration,
) -> Result<ExitCode> {
    let cfg = nats.apply(&config.nats);
    let subjects = cfg.subjects()?;
    // A retry must stay within the window in which the stream drops a
    // repeated message id, or an event whose first copy was stored (its
    // acknowledgement lost) could be stored again.
    let dedup = cfg.dedup_window();
    if retry_for + ACK_WAIT * 2 >= dedup {
        bail!(
            "--retry-for {} s is too long: a retried event must be sent again within the events \
             stream's dedup window ({} s, dedup_window_ms) minus {} s, or it could be stored twice",
            retry_for.as_secs(),
            dedup.as_secs(),
            (ACK_WAIT * 2).as_secs()
        );
    }
    let input = super::local::read_input(file, format)?;
    let servers = cfg.connection.display_servers();
    runtime()?.block_on(async {
        let (client, _version) = cfg
            .connection
            .connect()
            .await
            .with_context(|| format!("connecting to {servers}"))?;
        let js = jetstream::ContextBuilder::new()
            .timeout(ACK_WAIT)
            .build(client.clone());
        let (_, auth) = cfg.connection.resolve()?;
        let key = AgentKey::from_secret(&auth.identity_secret()?);
        if key.is_none() {
            eprintln!(
                "note: no credentials: message ids are scoped to each conversation but not keyed, \
                 so anyone who may publish on this server could take them first (docs/subjects.md)"
            );
        }
        let mut tally = Tally::default();
        let mut conversations = BTreeSet::new();
        let mut events = Vec::with_capacity(input.len());
        for super::local::Input {
            at,
            encoding,
            bytes,
        } in input
        {
            let event = match Envelope::decode(&bytes, encoding) {
                Ok(e) => e,
                Err(e) => {
                    tally.invalid += 1;
                    eprintln!("{at} skipped: {e}");
                    continue;
                }
            };
            // JSONL lines go out as the bytes given (as an agent would send
            // them); imported transcripts as MessagePack.
            let message = Outbound::event_bytes(
                &subjects,
                Origin::Agent,
                key.as_ref(),
                &event.id,
                &event.conversation,
                encoding,
                bytes,
            )
            .with_context(|| format!("{at} ({})", event.id))?;
            conversations.insert(event.conversation);
            events.push(Outgoing {
                id: event.id,
                message,
            });
        }
        let started = Instant::now();
        let total = events.len();
        let mut retry = Retry::new(retry_for);
        let mut sent_again = 0u64;
        // Events not stored yet that go again, in their order, before any
        // new one; and what is awaited, oldest first.
        let mut again: BTreeSet<usize> = BTreeSet::new();
        // Awaited together, so that in an outage their timeouts run at once
        // rather than one after another.
        let mut pending: FuturesOrdered<Acked> = FuturesOrdered::new();
        let mut next = 0usize;
        // An outage: what it waits for and the last error; nothing new is
        // sent until what is in flight is settled and the backoff waited.
        let mut outage: Option<(&'static str, String)> = None;
        let mut last_progress = Instant::now();
        let mut duplicates: Vec<(usize, u64)> = Vec::new();
        loop {
            while outage.is_none() && pending.len() < IN_FLIGHT {
                let i = match again.pop_first() {
                    Some(i) => {
                        sent_again += 1;
                        i
                    }
                    None if next < total => {
                        next += 1;
                        next - 1
                    }
                    None => break,
                };
                let e = &events[i];
                let sent = e.message.send(&js).await;
                match sent {
                    Ok(ack) => pending.push_back(async move { (i, ack.await) }.boxed()),
                    Err(err) => match classify(&err) {
                        NotStored::Permanent(detail) => {
                            bail!("publishing event {}: {detail}", e.id)
                        }
                        NotStored::Passing {
                            waiting_for,
                            detail,
                        } => {
                            again.insert(i);
                            outage = Some((waiting_for, detail));
                        }
                    },
                }
            }
            if let Some((i, stored)) = pending.next().await {
                match stored {
                    Ok(ack) => {
                        if ack.duplicate {
                            tally.duplicates += 1;
                            // The stream answers a duplicate with the
                            // sequence of the record it kept.
                            duplicates.push((i, ack.sequence));
                        } else {
                            tally.published += 1;
                        }
                        retry.progressed();
                    }
                    Err(err) => match classify(&err) {
                        NotStored::Permanent(detail) => {
                            bail!("the events stream refused event {}: {detail}", events[i].id)
                        }
                        NotStored::Passing {
                            waiting_for,
                            detail,
                        } => {
                            again.insert(i);
                            outage = Some((waiting_for, detail));
                        }
                    },
                }
            } else if let Some((waiting_for, detail)) = outage.take() {
                let Some(wait) = retry.next_wait() else {
                    let first = again.first().map_or("", |i| events[*i].id.as_str());
                    bail!(
                        "the events stream did not store {} event(s) (the first: {first}), still \
                         after {} s of retries: {detail}. Check that the NATS servers at \
                         {servers} are up and that their JetStream has a leader for stream {} \
                         (`nats stream info {}`), that `contextfold serve` ran once against them \
                         (it creates the stream), and that this user may publish to {}.in.>. \
                         Published so far: {} new, {} duplicates; running this again publishes \
                         the rest and stores nothing twice.",
                        again.len() + (total - next),
                        retry_for.as_secs(),
                        subjects.events_stream(),
                        subjects.events_stream(),
                        subjects.prefix(),
                        tally.published,
                        tally.duplicates,
                    );
                };
                eprintln!(
                    "\rwaiting for {waiting_for} (attempt {}, {:.1} s): {detail}",
                    retry.attempt,
                    wait.as_secs_f64()
                );
                tokio::time::sleep(wait).await;
            } else if again.is_empty() && next >= total {
                break;
            }
            if last_progress.elapsed() >= Duration::from_millis(500) {
                last_progress = Instant::now();
                eprint!(
                    "\rpublished {}/{total} ({} duplicates)",
                    tally.published + tally.duplicates,
                    tally.duplicates
                );
                let _ = std::io::stderr().flush();
            }
        }
        let secs = started.elapsed().as_secs_f64();
        let retried = if sent_again > 0 {
            format!(", {sent_again} sent again after waiting")
        } else {
            String::new()
        };
        eprintln!(
            "\rpublished {} events in {} conversation(s) to {servers} ({} new, {} duplicates, {} \
             invalid{retried}) in {secs:.2} s ({:.0}/s)",
            tally.published + tally.duplicates,
            conversations.len(),
            tally.published,
            tally.duplicates,
            tally.invalid,
            (tally.published + tally.duplicates) as f64 / secs.max(1e-9),
        );
        if tally.invalid > 0 && tally.published + tally.duplicates == 0 {
            bail!("no valid event in the input");
        }
        let foreign = if duplicates.is_empty() {
            0
        } else {
            let stream = js
                .get_stream_no_info(subjects.events_stream())
                .await
                .context("opening the events stream to check the duplicates")?;
            report_duplicates(&stream, &events, &duplicates).await
        };
        Ok(if tally.invalid > 0 || foreign > 0 {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        })
    })
}

/// How many duplicates to name in the report.
const DUPLICATES_NAMED: usize = 5;

/// Reads the record the stream kept for each duplicate and says which
/// duplicates are this publisher's own (the same bytes: a re-run) and which
/// are not (another record stored under the event's message id first);
/// returns how many are not. A record it may not read (no permission for
/// direct gets) is reported as unchecked.
async fn report_duplicates(
    stream: &jetstream::stream::Stream<()>,
    events: &[Outgoing],
    duplicates: &[(usize, u64)],
) -> usize {
    let checks = futures::stream::iter(duplicates.iter().map(|&(i, sequence)| async move {
        let kept = stream.direct_get(sequence).await;
        (i, kept.map(|m| m.payload == events[i].message.bytes))
    }))
    .buffer_unordered(64)
    .collect::<Vec<_>>()
    .await;
    let (mut own, mut foreign, mut unchecked) = (Vec::new(), Vec::new(), Vec::new());
    let mut why_unchecked = None;
    for (i, check) in checks {
        match check {
            Ok(true) => own.push(i),
            Ok(false) => foreign.push(i),
            Err(e) => {
                why_unchecked.get_or_insert_with(|| e.to_string());
                unchecked.push(i);
            }
        }
    }
    let named = |set: &mut Vec<usize>| {
        set.sort_unstable();
        let ids: Vec<&str> = set
            .iter()
            .take(DUPLICATES_NAMED)
            .map(|&i| events[i].id.as_str())
            .collect();
        let more = set.len().saturating_sub(DUPLICATES_NAMED);
        if more > 0 {
            format!("{} and {more} more", ids.join(", "))
        } else {
            ids.join(", ")
        }
    };
    if !own.is_empty() {
        eprintln!(
            "{} duplicate(s) already stored with these same bytes (a re-run; nothing stored twice): {}",
            own.len(),
            named(&mut own)
        );
    }
    if !unchecked.is_empty() {
        eprintln!(
            "{} duplicate(s) not checked ({}): {}",
            unchecked.len(),
            why_unchecked.unwrap_or_default(),
            named(&mut unchecked)
        );
    }
    if !foreign.is_empty() {
        eprintln!(
            "error: {} event(s) NOT stored: the stream already holds a different record under their \
             message id, so these events never reached their conversation: {}. Publish with the \
             agent's own credentials (message ids are then keyed by them, docs/subjects.md), or \
             give these events new ids.",
            foreign.len(),
            named(&mut foreign)
        );
    }
    foreign.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_grow_with_jitter_and_end_with_the_budget() {
        let mut retry = Retry::new(Duration::from_secs(3));
        let first = retry.next_wait().unwrap();
        assert!(
            first >= RETRY_FIRST_DELAY && first < RETRY_FIRST_DELAY * 2,
            "{first:?}"
        );
        assert_eq!(retry.attempt, 1);
        let mut total = first;
        while let Some(w) = retry.next_wait() {
            assert!(w <= RETRY_MAX_DELAY * 2, "{w:?}");
            total += w;
        }
        // Nothing was slept here: the budget counts wall time, and the
        // schedule alone stops once a wait would end past it.
        assert!(retry.attempt >= 3, "{}", retry.attempt);
        assert!(total >= RETRY_FIRST_DELAY * 7, "{total:?}");
        // Progress gives the next outage a fresh budget.
        retry.progressed();
        assert_eq!(retry.attempt, 0);
        assert!(retry.next_wait().is_some());
    }

    #[test]
    fn size_refusals_are_permanent_and_the_rest_say_what_they_wait_for() {
        let permanent = PublishError::new(PublishErrorKind::MaxPayloadExceeded);
        assert!(matches!(classify(&permanent), NotStored::Permanent(_)));
        let timed_out = PublishError::new(PublishErrorKind::TimedOut);
        match classify(&timed_out) {
            NotStored::Passing { waiting_for, .. } => {
                assert_eq!(waiting_for, "the events stream's leader")
            }
            other => panic!("{other:?}"),
        }
        let no_responders = PublishError::new(PublishErrorKind::StreamNotFound);
        assert!(matches!(
            classify(&no_responders),
            NotStored::Passing { .. }
        ));
        let broken = PublishError::new(PublishErrorKind::BrokenPipe);
        match classify(&broken) {
            NotStored::Passing { waiting_for, .. } => {
                assert_eq!(waiting_for, "the connection to NATS")
            }
            other => panic!("{other:?}"),
        }
    }
}
