//! The embedded store's sweeps, run beside its fold when a model
//! summarizes: a model's sweep takes seconds to minutes, and the turns
//! that arrive meanwhile must be stored and folded as they come, not
//! after it. (The deterministic summarizer runs each job inline, as the
//! embedded pipeline does: it takes milliseconds.)
//!
//! Jobs the fold issues queue here and run [`SWEEPS_AT_ONCE`] at a time on
//! the store's thread (one conversation has one job at a time, so they are
//! different conversations'); each sweep's events (summaries, rolling
//! state, its end with its spend) go back into the log as the service's
//! and are folded like any other, as a summarizer's over NATS would be.
//!
//! Crash reasoning: a job is pending in the state from the moment its
//! decision is folded (the log holds the decision first). A crash or a
//! close drops the sweeps in flight, their calls cancelled; the next
//! [`crate::runtime::embedded::Pipeline::open_leaving_jobs`] returns
//! every pending job, and they run again. A sweep's events that reached
//! the log are folded once (their ids are derived from the job).

use crate::core::event::Envelope;
use crate::core::sweep::SweepSnapshot;
use crate::runtime::sweep::run_sweep;
use crate::summarizer::Summarizer;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

/// Sweeps in flight at once (each is one conversation's).
pub const SWEEPS_AT_ONCE: usize = 4;

/// What one sweep produced: its conversation and its events.
pub struct SweepDone {
    pub conversation: String,
    pub events: Vec<Envelope>,
}

/// The queue and the sweeps in flight.
pub struct Sweeper<S> {
    summarizer: Arc<S>,
    queued: VecDeque<SweepSnapshot>,
    running: FuturesUnordered<BoxFuture<'static, SweepDone>>,
}

impl<S: Summarizer + 'static> Sweeper<S> {
    pub fn new(summarizer: Arc<S>) -> Self {
        Sweeper {
            summarizer,
            queued: VecDeque::new(),
            running: FuturesUnordered::new(),
        }
    }

    /// Queues jobs and starts as many as there is room for.
    pub fn add(&mut self, jobs: Vec<SweepSnapshot>) {
        self.queued.extend(jobs);
        while self.running.len() < SWEEPS_AT_ONCE {
            let Some(snap) = self.queued.pop_front() else {
                break;
            };
            let summarizer = self.summarizer.clone();
            self.running.push(Box::pin(async move {
                let conversation = snap.conversation.clone();
                let deadline = Duration::from_millis(snap.job.deadline_ms);
                let mut events = Vec::new();
                run_sweep(snap, &*summarizer, deadline, |e| events.push(e)).await;
                SweepDone {
                    conversation,
                    events,
                }
            }));
        }
    }

    /// Jobs queued or in flight.
    pub fn busy(&self) -> usize {
        self.queued.len() + self.running.len()
    }

    /// The next sweep to finish; never resolves while none is in flight.
    pub async fn finished(&mut self) -> SweepDone {
        match self.running.next().await {
            Some(done) => done,
            None => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::EventBody;
    use crate::summarizer::DeterministicSummarizer;
    use crate::testing::{small_policy, FoldTest};

    #[tokio::test]
    async fn jobs_run_a_few_at_a_time_and_each_ends_with_its_sweep() {
        let mut t = FoldTest::new(small_policy());
        let mut snaps = Vec::new();
        for c in 0..SWEEPS_AT_ONCE + 2 {
            let conv = format!("c{c}");
            let (job, _) = t.until_job(&conv, 0, 1_000_000);
            match crate::core::sweep::snapshot(t.conversation(&conv), &job, &t.policy) {
                Ok(snap) => snaps.push(snap),
                Err(e) => panic!("no snapshot of {conv}: {e:?}"),
            }
        }
        assert_eq!(snaps.len(), SWEEPS_AT_ONCE + 2);
        let mut sweeper = Sweeper::new(Arc::new(DeterministicSummarizer));
        sweeper.add(snaps);
        assert_eq!(sweeper.running.len(), SWEEPS_AT_ONCE);
        let mut ended = Vec::new();
        while sweeper.busy() > 0 {
            let done = sweeper.finished().await;
            assert!(
                matches!(
                    done.events.last().map(|e| &e.body),
                    Some(EventBody::SweepEnded(_))
                ),
                "a sweep's last event is its end"
            );
            ended.push(done.conversation);
            sweeper.add(Vec::new());
        }
        ended.sort();
        assert_eq!(ended.len(), SWEEPS_AT_ONCE + 2);
        ended.dedup();
        assert_eq!(ended.len(), SWEEPS_AT_ONCE + 2, "each conversation once");
    }
}
