//! The embedded pipeline: one machine, no server. Events go into an
//! [`EventLog`]; the engine folds them; decisions are appended to the same
//! log; jobs run right here with a summarizer; their results go back into
//! the log and are folded like any other event.

use crate::core::event::{Encoding, Envelope};
use crate::core::sweep;
use crate::log::{EventLog, LogError};
use crate::runtime::engine::Engine;
use crate::runtime::sweep::{run_sweep, PassSummarizer};
use crate::store::{KvBackend, StoreError};
use std::collections::HashSet;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Records read from the log at a time when replaying it.
const REPLAY_BATCH: usize = 4096;

/// Folds the records `log` holds after `engine`'s position, with no
/// summarizer (jobs stay pending, as the log recorded them), committing
/// after each batch; stops after the event `until` when given. Returns
/// whether `until` was found (true without one). What `replay`, `rebuild`
/// and a check against a clean replay need.
pub async fn replay<L: EventLog, B: KvBackend>(
    log: &mut L,
    engine: &mut Engine<B>,
    until: Option<&str>,
) -> Result<bool, PipelineError> {
    loop {
        let records = log.read_after(engine.position(), REPLAY_BATCH).await?;
        if records.is_empty() {
            return Ok(until.is_none());
        }
        for r in &records {
            engine.apply(r);
            if let Some(id) = until {
                if Envelope::decode(&r.bytes, r.encoding).is_ok_and(|e| e.id == id) {
                    engine.commit()?;
                    return Ok(true);
                }
            }
        }
        engine.commit()?;
    }
}

/// Counts of one catch-up.
#[derive(Debug, Default, Clone, Copy)]
pub struct CatchUp {
    pub records: u64,
    pub decisions: u64,
}

pub struct Pipeline<L: EventLog, B: KvBackend, S: PassSummarizer> {
    pub log: L,
    pub engine: Engine<B>,
    summarizer: S,
    /// Records folded between commits.
    pub read_batch: usize,
    jobs_run: HashSet<String>,
}

impl<L: EventLog, B: KvBackend, S: PassSummarizer> Pipeline<L, B, S> {
    /// Opens the pipeline and catches the state up with the log.
    pub async fn open(log: L, engine: Engine<B>, summarizer: S) -> Result<Self, PipelineError> {
        let mut p = Pipeline {
            log,
            engine,
            summarizer,
            read_batch: 4096,
            jobs_run: HashSet::new(),
        };
        p.catch_up().await?;
        Ok(p)
    }

    /// Folds every record after the engine's position, runs every job
    /// issued on the way, makes the log durable, then commits the state.
    pub async fn catch_up(&mut self) -> Result<CatchUp, PipelineError> {
        let total = self.settle_unsynced().await?;
        self.log.sync().await?;
        self.engine.commit()?;
        Ok(total)
    }

    /// Folds what the log holds after the engine's position, appending the
    /// decisions (deferred: durable at the next sync).
    async fn fold_available(&mut self, total: &mut CatchUp) -> Result<(), PipelineError> {
        loop {
            let records = self
                .log
                .read_after(self.engine.position(), self.read_batch)
                .await?;
            if records.is_empty() {
                return Ok(());
            }
            for record in &records {
                let applied = self.engine.apply(record);
                total.decisions += applied.decisions.len() as u64;
                // Decisions reach the log before the state that took them is
                // committed: after a crash, the replay derives them again with
                // the same ids, and the fold drops the copies.
                for d in applied.decisions {
                    self.log
                        .append_deferred(Encoding::Msgpack, &d.to_msgpack())
                        .await?;
                }
            }
            total.records += records.len() as u64;
        }
    }

    /// Folds and runs jobs until nothing is pending; nothing is synced or
    /// committed here.
    async fn settle_unsynced(&mut self) -> Result<CatchUp, PipelineError> {
        let mut total = CatchUp::default();
        // Each round either commits summaries or ends jobs; the cap only
        // guards against a policy bug turning into a hang.
        for _ in 0..100_000 {
            self.fold_available(&mut total).await?;
            let jobs: Vec<_> = self
                .engine
                .state
                .conversations
                .values()
                .filter_map(|c| c.pending_job.as_ref().map(|p| (c, p)))
                .filter(|(_, p)| !self.jobs_run.contains(&p.job.job_id))
                .map(|(c, p)| sweep::snapshot(c, &p.job, &self.engine.policy))
                .collect();
            if jobs.is_empty() {
                return Ok(total);
            }
            for snap in jobs {
                self.jobs_run.insert(snap.job.job_id.clone());
                let deadline = Duration::from_millis(snap.job.deadline_ms);
                let mut out = Vec::new();
                run_sweep(snap, &self.summarizer, deadline, |e| out.push(e)).await;
                for e in out {
                    self.log
                        .append_deferred(Encoding::Msgpack, &e.to_msgpack())
                        .await?;
                }
            }
        }
        tracing::error!("compaction did not settle after 100000 rounds; stopping");
        Ok(total)
    }

    /// Appends events and folds each as it arrives, running jobs as soon as
    /// they are issued (as live summarizers would); one sync and one state
    /// commit for the whole batch.
    pub async fn ingest(&mut self, events: &[Envelope]) -> Result<(), PipelineError> {
        let records: Vec<(Encoding, Vec<u8>)> = events
            .iter()
            .map(|e| (Encoding::Msgpack, e.to_msgpack()))
            .collect();
        self.ingest_raw(&records).await
    }

    /// Like [`Pipeline::ingest`] for bytes as they arrived (possibly
    /// malformed: those are rejected with a reason by the fold).
    pub async fn ingest_raw(
        &mut self,
        records: &[(Encoding, Vec<u8>)],
    ) -> Result<(), PipelineError> {
        for (encoding, bytes) in records {
            self.log.append_deferred(*encoding, bytes).await?;
            self.settle_unsynced().await?;
        }
        self.log.sync().await?;
        self.engine.commit()?;
        Ok(())
    }

    /// Catches up and runs every pending job.
    pub async fn settle(&mut self) -> Result<(), PipelineError> {
        self.catch_up().await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{EventBody, TurnAppended};
    use crate::core::message::{ChatMessage, Role};
    use crate::core::policy::PolicyConfig;
    use crate::log::memory::MemoryLog;
    use crate::store::memory_backend::MemoryBackend;

    fn engine() -> Engine<MemoryBackend> {
        Engine::open(MemoryBackend::default(), PolicyConfig::default()).unwrap()
    }

    #[tokio::test]
    async fn replay_folds_the_log_or_stops_after_an_event() {
        let mut log = MemoryLog::new();
        for i in 0..3 {
            let turn = ChatMessage::text(Role::User, format!("turn number {i}"));
            let e = Envelope::new(
                format!("t{i}"),
                "c",
                1_000 * i,
                EventBody::TurnAppended(TurnAppended::from(turn)),
            );
            log.append(Encoding::Json, e.to_json().as_bytes())
                .await
                .unwrap();
        }
        let mut whole = engine();
        assert!(replay(&mut log, &mut whole, None).await.unwrap());
        assert_eq!(whole.state.conversations["c"].turns.len(), 3);

        let mut upto = engine();
        assert!(replay(&mut log, &mut upto, Some("t1")).await.unwrap());
        assert_eq!(upto.state.conversations["c"].turns.len(), 2);

        let mut missing = engine();
        assert!(!replay(&mut log, &mut missing, Some("t9")).await.unwrap());
        assert_eq!(missing.state.hash(), whole.state.hash());
    }
}
