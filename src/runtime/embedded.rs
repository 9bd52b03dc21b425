//! The embedded pipeline: one machine, no server. Events go into an
//! [`EventLog`]; the engine folds them; decisions are appended to the same
//! log; jobs run right here with a summarizer; their results go back into
//! the log and are folded like any other event.

use crate::core::event::{Encoding, Envelope, EventBody, Origin};
use crate::core::intake::{self, Address};
use crate::core::measure::{AdmittedAhead, TurnMeasure};
use crate::core::tokens;

use crate::core::fallback_summary;
use crate::core::policy::{self, PolicyConfig};
use crate::core::summary::SourceItem;
use crate::core::sweep::{self, SweepSnapshot};
use crate::log::{EventLog, LogError};
use crate::runtime::engine::{Effects, Engine};
use crate::runtime::sweep::run_sweep;
use crate::store::{KvBackend, StoreError};
use crate::summarizer::Summarizer;
use std::sync::Arc;
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
/// and a check against a clean replay need. Effects are dropped: the log
/// already holds them.
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
        let mut effects = Effects::default();
        for r in &records {
            let folded = engine.apply_record(r, &mut effects)?;
            effects.decisions.clear();
            effects.dead_letters.clear();
            if until.is_some() && folded.as_deref() == until {
                engine.commit()?;
                return Ok(true);
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
    /// Records refused without a conversation to count them against.
    pub dead_letters: u64,
}

pub struct Pipeline<L: EventLog, B: KvBackend, S: Summarizer> {
    pub log: L,
    pub engine: Engine<B>,
    summarizer: S,
    /// Records folded between commits.
    pub read_batch: usize,
}

impl<L: EventLog, B: KvBackend, S: Summarizer> Pipeline<L, B, S> {
    /// Opens the pipeline and catches the state up with the log: what the
    /// log holds past the store is history (its decisions are in the log
    /// already, see [`Engine::hold_through`]); jobs it left pending (their
    /// runner stopped with the previous process) run now.
    pub async fn open(log: L, engine: Engine<B>, summarizer: S) -> Result<Self, PipelineError> {
        let (mut p, pending) = Self::open_leaving_jobs(log, engine, summarizer).await?;
        p.settle_unsynced(pending, &mut CatchUp::default()).await?;
        p.commit().await?;
        Ok(p)
    }

    /// [`Pipeline::open`] for a runtime that runs jobs beside the fold (the
    /// gateway with a model): the jobs the history left pending are
    /// returned, not run; their results come back through
    /// [`Pipeline::append_leaving_jobs`].
    pub async fn open_leaving_jobs(
        mut log: L,
        mut engine: Engine<B>,
        summarizer: S,
    ) -> Result<(Self, Vec<SweepSnapshot>), PipelineError> {
        engine.hold_through(log.last_position().await?);
        let mut p = Pipeline {
            log,
            engine,
            summarizer,
            read_batch: 4096,
        };
        let mut total = CatchUp::default();
        // Every job the history left pending is returned below, the ones
        // its replay released among them.
        p.fold_available(&mut total).await?;
        // The policy this process folds under goes into the log before
        // anything is folded under it, when the log's differs and the
        // engine records its policy (`Engine::record_policy_as`).
        if let Some(policy) = p.engine.announce_policy() {
            p.log
                .append_deferred(Origin::Service, Encoding::Msgpack, &policy.to_msgpack())
                .await?;
            p.fold_available(&mut total).await?;
        }
        let pending = p.engine.pending_snapshots()?;
        p.commit().await?;
        Ok((p, pending))
    }

    /// The summarizer jobs run with.
    pub fn summarizer(&self) -> &S {
        &self.summarizer
    }

    /// Appends `events` (as `origin`'s: an agent's turns, or a job's
    /// results as the service's) and folds them, with one sync and one
    /// state commit; returns the jobs they issued, not run. The log holds
    /// every decision before the state that took it is committed, so a
    /// crash loses no job: the next open finds it pending.
    pub async fn append_leaving_jobs(
        &mut self,
        origin: Origin,
        events: &[Envelope],
    ) -> Result<Vec<SweepSnapshot>, PipelineError> {
        for e in events {
            self.log
                .append_deferred(origin, Encoding::Msgpack, &e.to_msgpack())
                .await?;
        }
        let jobs = self.fold_available(&mut CatchUp::default()).await?;
        self.commit().await?;
        Ok(jobs)
    }

    /// Folds every record after the engine's position, runs every job
    /// issued on the way, makes the log durable, then commits the state.
    pub async fn catch_up(&mut self) -> Result<CatchUp, PipelineError> {
        let mut total = CatchUp::default();
        let jobs = self.fold_available(&mut total).await?;
        self.settle_unsynced(jobs, &mut total).await?;
        self.commit().await?;
        Ok(total)
    }

    /// Folds what the log holds after the engine's position, appending the
    /// decisions (deferred: durable at the next sync); returns the jobs
    /// they issued.
    async fn fold_available(
        &mut self,
        total: &mut CatchUp,
    ) -> Result<Vec<SweepSnapshot>, PipelineError> {
        let mut jobs = Vec::new();
        loop {
            let records = self
                .log
                .read_after(self.engine.position(), self.read_batch)
                .await?;
            if records.is_empty() {
                return Ok(jobs);
            }
            total.records += records.len() as u64;
            let effects = self.engine.apply_batch(records)?;
            total.decisions += effects.decisions.len() as u64;
            // Dead letters of the embedded log stay where they are: the
            // record is in the log, and its refusal is counted in the state
            // (and logged) each time it is folded.
            total.dead_letters += effects.dead_letters.len() as u64;
            // Decisions reach the log before the state that took them is
            // committed: after a crash, the replay derives them again with
            // the same ids, and holds back the ones the log shows.
            for d in &effects.decisions {
                self.log
                    .append_deferred(Origin::Service, Encoding::Msgpack, &d.to_msgpack())
                    .await?;
            }
            jobs.extend(effects.jobs);
            // No queue to lose them: a job the history left pending runs
            // here (`Pipeline::open` runs every pending one).
            jobs.extend(effects.requeued);
        }
    }

    /// Runs jobs and folds their results until nothing is pending; nothing
    /// is synced or committed here.
    async fn settle_unsynced(
        &mut self,
        mut jobs: Vec<SweepSnapshot>,
        total: &mut CatchUp,
    ) -> Result<(), PipelineError> {
        // Each round either commits summaries or ends jobs; the cap only
        // guards against a policy bug turning into a hang.
        for _ in 0..100_000 {
            if jobs.is_empty() {
                return Ok(());
            }
            for snap in std::mem::take(&mut jobs) {
                let deadline = Duration::from_millis(snap.job.deadline_ms);
                let mut out = Vec::new();
                // Boxed: a sweep's future (the summarizer's calls under
                // their deadlines) is kilobytes, and held inline it made
                // this future, built for every record folded, as large.
                // Builds without LTO moved it per record (a tenth of the
                // fold thread's instructions); the release build does not.
                Box::pin(run_sweep(snap, &self.summarizer, deadline, |e| out.push(e))).await;
                for e in out {
                    self.log
                        .append_deferred(Origin::Service, Encoding::Msgpack, &e.to_msgpack())
                        .await?;
                }
            }
            jobs = self.fold_available(total).await?;
        }
        tracing::error!("compaction did not settle after 100000 rounds; stopping");
        Ok(())
    }

    /// Appends events (as an agent's) and folds each as it arrives, running
    /// jobs as soon as they are issued (as live summarizers would); one
    /// sync and one state commit for the whole batch.
    pub async fn ingest(&mut self, events: &[Envelope]) -> Result<(), PipelineError> {
        let records: Vec<(Encoding, Vec<u8>)> = events
            .iter()
            .map(|e| (Encoding::Msgpack, e.to_msgpack()))
            .collect();
        self.ingest_raw(&records).await
    }

    /// Like [`Pipeline::ingest`] for bytes as they arrived (possibly
    /// malformed: those are refused with a reason by intake).
    pub async fn ingest_raw(
        &mut self,
        records: &[(Encoding, Vec<u8>)],
    ) -> Result<(), PipelineError> {
        self.ingest_measured(records, Vec::new()).await
    }

    /// [`Pipeline::ingest_raw`] with the turns measured ahead
    /// ([`Measurer::measure`], the `i`th measure for the `i`th record;
    /// missing ones are measured by the fold): the same log and state,
    /// with less of the work on this thread.
    pub async fn ingest_measured(
        &mut self,
        records: &[(Encoding, Vec<u8>)],
        measures: Vec<Option<TurnMeasure>>,
    ) -> Result<(), PipelineError> {
        self.fold_measured(records, measures).await?;
        self.commit().await
    }

    /// The first half of [`Pipeline::ingest_measured`]: appends and folds
    /// the records, running the jobs they issue, without syncing the log
    /// or committing the state. Until [`Pipeline::commit`] a crash loses
    /// them, as it loses a batch in flight: folding the same input again
    /// restores them (events are deduplicated by id).
    pub async fn fold_measured(
        &mut self,
        records: &[(Encoding, Vec<u8>)],
        measures: Vec<Option<TurnMeasure>>,
    ) -> Result<(), PipelineError> {
        let mut total = CatchUp::default();
        let mut measures = measures.into_iter();
        for (encoding, bytes) in records {
            let position = self
                .log
                .append_deferred(Origin::Agent, *encoding, bytes)
                .await?;
            if let Some(measure) = measures.next().flatten() {
                self.engine.measured_ahead(position, measure);
            }
            let jobs = self.fold_available(&mut total).await?;
            self.settle_unsynced(jobs, &mut total).await?;
        }
        Ok(())
    }

    /// Syncs the log and commits the state folded since the last commit
    /// (the second half of [`Pipeline::ingest_measured`]).
    pub async fn commit(&mut self) -> Result<(), PipelineError> {
        // The state is encoded while the log syncs, and written only once
        // the log holds every record it follows: a crash between the two
        // leaves a log ahead of the state, which the next open folds.
        let engine = &mut self.engine;
        let (synced, encoded) = self.log.sync_while(|| engine.prepare_commit()).await;
        synced?;
        self.engine.apply_commit(encoded)?;
        Ok(())
    }

    /// Appends events the service itself writes (a recall's spend, for
    /// example: `Origin::Service`, so the fold accepts what agents may not
    /// write) and folds them with whatever they lead to; one sync and one
    /// state commit.
    pub async fn record(&mut self, events: &[Envelope]) -> Result<(), PipelineError> {
        for e in events {
            self.log
                .append_deferred(Origin::Service, Encoding::Msgpack, &e.to_msgpack())
                .await?;
        }
        self.catch_up().await.map(|_| ())
    }

    /// Catches up and runs every pending job.
    pub async fn settle(&mut self) -> Result<(), PipelineError> {
        self.catch_up().await.map(|_| ())
    }
}

/// Measures the turns of records ahead of the fold ([`crate::core::measure`]),
/// on whatever thread it is given, while the pipeline folds the records
/// before them. It counts each conversation's turns in the encoding of the
/// model its first turn named, as the fold does; where that guess is wrong
/// (a conversation begun before this process), the fold counts again.
///
/// It also reads each turn for its drafts ([`crate::runtime::read_ahead`]):
/// the output's signals always (rolling states read every turn), the
/// identifiers once the conversation has half the tokens that start
/// compaction (its threshold as the fold resolves it, `policy::levels_of`:
/// the model and window it declared, or the default, and the policy's
/// overrides; before that its turns may never be summarized; a turn not
/// read ahead is read by its draft).
///
/// Its caller may leave some readings to the drafts and rolling states
/// ([`Measurer::shed_readings`]): `run` does when the fold's thread waits
/// on this one. A reading is a shortcut (`fallback_summary::reading`), so
/// what is shed moves work to the other thread and never changes a state.
#[derive(Debug, Default)]
pub struct Measurer {
    /// Keyed by agents' ids, so hashed with a keyed hash (as
    /// `core::state::Conversations` is); looked up by `&str`, a key copied
    /// only for a conversation's first event.
    conversations: hashbrown::HashMap<String, Measured, std::hash::RandomState>,
    /// The policy the pipeline folds under: its levels (`policy::levels_of`)
    /// and the injected-context tags a turn's source text is stripped of
    /// (`sweep::turn_text`), as the snapshots strip them.
    policy: PolicyConfig,
    /// The share of turns whose reading is left to their readers (0 to 1).
    shed: f64,
    /// The shed share accumulated over turns: a turn is shed each time it
    /// reaches one, so the turns shed are spread evenly.
    shed_due: f64,
}

#[derive(Debug, Default)]
struct Measured {
    /// The encoding of the model its first turn named.
    encoding: Option<tokens::Encoding>,
    tokens: u64,
    /// The model and the context window it declared.
    model: Option<String>,
    window: Option<u64>,
    /// Tokens from which its turns' identifiers are read ahead: half its
    /// compaction threshold, resolved when first needed.
    identifiers_from: Option<u64>,
}

impl Measurer {
    /// A measurer for a pipeline folding under `policy`.
    pub fn for_policy(policy: &PolicyConfig) -> Measurer {
        Measurer {
            policy: policy.clone(),
            ..Measurer::default()
        }
    }

    /// From now on, leaves the readings of about `share` of the turns (0:
    /// none, the default; 1: all) to the drafts and rolling states that
    /// read them, which then read them on their own thread.
    pub fn shed_readings(&mut self, share: f64) {
        self.shed = if share.is_nan() {
            0.0
        } else {
            share.clamp(0.0, 1.0)
        };
    }

    /// Whether the next turn's reading is shed.
    fn sheds_next(&mut self) -> bool {
        self.shed_due += self.shed;
        let shed = self.shed_due >= 1.0;
        if shed {
            self.shed_due -= 1.0;
        }
        shed
    }

    /// One measure per record: `None` for a record that is not a turn (or
    /// that intake refuses).
    pub fn measure(&mut self, records: &[(Encoding, Vec<u8>)]) -> Vec<Option<TurnMeasure>> {
        records
            .iter()
            .map(|(encoding, bytes)| {
                // As `ingest_measured` appends it.
                let ahead = AdmittedAhead::admit(intake::Arrival {
                    origin: Origin::Agent,
                    address: &Address::Unaddressed,
                    stored_at_ms: None,
                    encoding: *encoding,
                    bytes,
                })?;
                let admitted = ahead.admitted();
                let turn = match &admitted.event.body {
                    EventBody::TurnAppended(turn) => turn,
                    EventBody::ModelDeclared(declared) => {
                        let measured = self
                            .conversations
                            .entry_ref(admitted.event.conversation.as_str())
                            .or_default();
                        measured.model = Some(declared.model.clone());
                        if declared.context_window.is_some() {
                            measured.window = declared.context_window;
                        }
                        measured.identifiers_from = None;
                        return None;
                    }
                    _ => return None,
                };
                let shed = self.sheds_next();
                let measured = self
                    .conversations
                    .entry_ref(admitted.event.conversation.as_str())
                    .or_default();
                let encoding = *measured
                    .encoding
                    .get_or_insert_with(|| tokens::Encoding::for_model(turn.model.as_deref()));
                let mut measure = TurnMeasure::of(encoding, &turn.message);
                measured.tokens += measure.tokens;
                let msg = &turn.message;
                let text = if shed {
                    None
                } else {
                    sweep::turn_text(msg, &self.policy.strip_injected_context_tags)
                };
                if let Some(text) = text {
                    let source = SourceItem {
                        role: Some(msg.role),
                        tool: sweep::source_tool(msg),
                        text,
                        ..SourceItem::default()
                    };
                    let key = &admitted.event.conversation;
                    let policy = &self.policy;
                    let from = *measured.identifiers_from.get_or_insert_with(|| {
                        policy::levels_of(key, measured.model.as_deref(), measured.window, policy)
                            .threshold_tokens
                            / 2
                    });
                    let identifiers = measured.tokens >= from;
                    measure.reading = Some(Arc::new(fallback_summary::read_source(
                        &source,
                        identifiers,
                    )));
                }
                measure.admitted = Some(ahead);
                Some(measure)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{EventBody, TurnAppended};
    use crate::core::message::{ChatMessage, Role};
    use crate::core::policy::PolicyConfig;
    use crate::log::memory::MemoryLog;
    use crate::log::Position;
    use crate::store::memory_backend::MemoryBackend;

    fn engine() -> Engine<MemoryBackend> {
        Engine::open(MemoryBackend::default(), PolicyConfig::default()).unwrap()
    }

    /// Three conversations that compact, with long tool results (masked),
    /// calls with long arguments (elided when masked), a model on the first
    /// turn (cl100k), and a model named only later.
    fn measured_session() -> Vec<(Encoding, Vec<u8>)> {
        use crate::core::message::{FunctionCall, ToolCall};
        let mut events = Vec::new();
        for (c, key) in ["m:a", "m:b", "m:c"].into_iter().enumerate() {
            for i in 0..60u64 {
                let time = 1_000_000 + i * 1_000 + c as u64;
                let mut user = TurnAppended::from(ChatMessage::text(
                    Role::User,
                    format!("step {i}: run the tests of crate {key} and fix what fails"),
                ));
                user.model = match (key, i) {
                    ("m:b", _) => Some("gpt-4-0613".into()),
                    ("m:c", 0) => None,
                    _ => Some("gpt-4o".into()),
                };
                let mut call = ChatMessage::text(Role::Assistant, "Running the tests.");
                call.tool_calls.push(ToolCall {
                    id: format!("call_{i}"),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: "Bash".into(),
                        arguments: r#"{"command":"cargo test"}"#.into(),
                    },
                });
                // Every third call writes a file: a long argument, elided
                // in the turn's masked rendering (counted ahead).
                if i % 3 == 0 {
                    call.tool_calls.push(ToolCall {
                        id: format!("write_{i}"),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: "Write".into(),
                            arguments: serde_json::json!({
                                "file_path": format!("src/step_{i}.rs"),
                                "content": "fn step() { /* the fix */ }\n".repeat(40),
                            })
                            .to_string(),
                        },
                    });
                }
                let mut result = ChatMessage::text(
                    Role::Tool,
                    format!(
                        "{}error[E0308]: mismatched types in step {i}\n{}",
                        "   Compiling crate v0.1.0\n".repeat(20),
                        "test result: FAILED. 3 passed; 1 failed\n".repeat(5)
                    ),
                );
                result.tool_call_id = Some(format!("call_{i}"));
                result.name = Some("Bash".into());
                for (k, body) in [
                    EventBody::TurnAppended(user),
                    EventBody::TurnAppended(TurnAppended::from(call)),
                    EventBody::TurnAppended(TurnAppended::from(result)),
                ]
                .into_iter()
                .enumerate()
                {
                    let e = Envelope::new(format!("{key}-{i}-{k}"), key, time + k as u64, body);
                    events.push((Encoding::Msgpack, e.to_msgpack()));
                }
            }
        }
        // Interleaved, as a fleet publishes.
        let mut interleaved: Vec<_> = events.chunks(3).map(<[_]>::to_vec).collect();
        let n = interleaved.len() / 3;
        let mut out = Vec::new();
        for i in 0..n {
            for c in 0..3 {
                out.extend(std::mem::take(&mut interleaved[c * n + i]));
            }
        }
        out
    }

    /// The policy [`measured_session`] compacts under.
    fn measured_policy() -> PolicyConfig {
        PolicyConfig {
            default_context_window: 6_000,
            ..PolicyConfig::default()
        }
    }

    /// A pipeline in memory under `policy`, with the deterministic summarizer.
    async fn memory_pipeline(
        policy: &PolicyConfig,
    ) -> Pipeline<MemoryLog, MemoryBackend, crate::summarizer::DeterministicSummarizer> {
        Pipeline::open(
            MemoryLog::new(),
            Engine::open(MemoryBackend::default(), policy.clone()).unwrap(),
            crate::summarizer::DeterministicSummarizer,
        )
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn turns_measured_ahead_fold_to_the_same_log_and_state() {
        let records = measured_session();
        let policy = measured_policy();
        let open = || memory_pipeline(&policy);
        let mut plain = open().await;
        let counted_before = crate::core::tokens::texts_counted();
        let admitted_before = intake::records_admitted();
        for chunk in records.chunks(50) {
            plain.ingest_raw(chunk).await.unwrap();
        }
        let counted_plain = crate::core::tokens::texts_counted() - counted_before;
        let admitted_plain = intake::records_admitted() - admitted_before;

        let mut measured = open().await;
        let mut measurer = Measurer::default();
        let mut read = Vec::new();
        let (mut counted_measured, mut counted_ahead) = (0, 0);
        let (mut admitted_measured, mut admitted_ahead) = (0, 0);
        for chunk in records.chunks(50) {
            let before = crate::core::tokens::texts_counted();
            let admitted_before = intake::records_admitted();
            let measures = measurer.measure(chunk);
            admitted_ahead += measures
                .iter()
                .filter(|m| m.as_ref().is_some_and(|m| m.admitted.is_some()))
                .count() as u64;
            assert_eq!(
                intake::records_admitted() - admitted_before,
                chunk.len() as u64
            );
            read.extend(
                measures
                    .iter()
                    .flatten()
                    .filter_map(|m| m.reading.as_ref().map(|reading| reading.text.clone())),
            );
            counted_ahead += crate::core::tokens::texts_counted() - before;
            assert_eq!(measures.len(), chunk.len());
            assert!(
                measures.iter().all(Option::is_some),
                "every record is a turn"
            );
            let before = crate::core::tokens::texts_counted();
            let admitted_before = intake::records_admitted();
            measured.ingest_measured(chunk, measures).await.unwrap();
            counted_measured += crate::core::tokens::texts_counted() - before;
            admitted_measured += intake::records_admitted() - admitted_before;
        }

        let summaries: usize = plain
            .engine
            .state
            .conversations
            .values()
            .map(|c| c.summaries.len())
            .sum();
        assert!(summaries > 0, "the session compacts");
        // The drafts read what the measurer read ahead (and wrote the same).
        assert!(read.iter().any(crate::core::fallback_summary::reading_used));
        assert_eq!(
            measured.engine.state_hash().unwrap(),
            plain.engine.state_hash().unwrap()
        );
        let log = |p: &mut Pipeline<MemoryLog, MemoryBackend, _>| {
            let mut log = std::mem::replace(&mut p.log, MemoryLog::new());
            async move { log.read_after(0, usize::MAX).await.unwrap() }
        };
        let (a, b) = (log(&mut plain).await, log(&mut measured).await);
        assert_eq!(a.len(), b.len());
        assert!(a.iter().zip(&b).all(|(a, b)| a.bytes == b.bytes));
        // The fold counted every text but the turns measured ahead (the
        // stubs, summaries and states it counts stay its own work). The
        // measurer counted fewer texts than the fold spared: an assistant
        // turn's masked calls are counted from its parts
        // (`mask::counted`), where the fold counts their rendering whole.
        let texts = |count: &dyn Fn()| {
            let before = tokens::texts_counted();
            count();
            tokens::texts_counted() - before
        };
        let encoding = tokens::Encoding::O200kBase;
        let spared_by_parts: u64 = records
            .iter()
            .filter_map(|(format, bytes)| match Envelope::decode(bytes, *format) {
                Ok(Envelope {
                    body: EventBody::TurnAppended(t),
                    ..
                }) => Some(t.message),
                _ => None,
            })
            .map(|msg| {
                let whole = texts(&|| {
                    tokens::count_message(encoding, &msg);
                    if let Some(m) = crate::core::mask::masked_calls(&msg) {
                        tokens::count_message(encoding, &m);
                    }
                });
                let by_parts = texts(&|| {
                    let _ = crate::core::mask::counted(encoding, &msg);
                });
                whole - by_parts
            })
            .sum();
        assert!(counted_ahead > 0);
        assert!(spared_by_parts > 0, "the session has calls to mask");
        assert_eq!(
            counted_plain - counted_measured,
            counted_ahead + spared_by_parts
        );
        // Nor did it admit (decode) again a turn admitted ahead.
        assert_eq!(admitted_ahead, records.len() as u64);
        assert_eq!(admitted_plain - admitted_measured, admitted_ahead);
    }

    /// A memory log whose syncs fail while `failing` is set.
    struct UnsyncableLog {
        inner: MemoryLog,
        failing: bool,
    }

    impl EventLog for UnsyncableLog {
        async fn append(
            &mut self,
            origin: Origin,
            encoding: Encoding,
            bytes: &[u8],
        ) -> Result<Position, LogError> {
            self.inner.append(origin, encoding, bytes).await
        }
        async fn append_batch(
            &mut self,
            records: &[crate::log::Appended],
        ) -> Result<Position, LogError> {
            self.inner.append_batch(records).await
        }
        async fn read_after(
            &mut self,
            after: Position,
            max: usize,
        ) -> Result<Vec<crate::log::LogRecord>, LogError> {
            self.inner.read_after(after, max).await
        }
        async fn last_position(&mut self) -> Result<Position, LogError> {
            self.inner.last_position().await
        }
        async fn sync(&mut self) -> Result<(), LogError> {
            if self.failing {
                return Err(LogError::Backend("the disk went away".into()));
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_state_is_committed_only_once_its_log_has_synced() {
        let records = measured_session();
        let policy = measured_policy();
        let log = UnsyncableLog {
            inner: MemoryLog::new(),
            failing: false,
        };
        let engine = Engine::open(MemoryBackend::default(), policy.clone()).unwrap();
        let mut p = Pipeline::open(log, engine, crate::summarizer::DeterministicSummarizer)
            .await
            .unwrap();
        let committed = p.engine.store().commits();
        p.fold_measured(&records, Vec::new()).await.unwrap();
        p.log.failing = true;
        assert!(matches!(
            p.commit().await,
            Err(PipelineError::Log(LogError::Backend(_)))
        ));
        // Nothing written, and nothing forgotten: the next commit has it all.
        assert_eq!(p.engine.store().commits(), committed);
        assert!(p.engine.has_uncommitted());
        p.log.failing = false;
        p.commit().await.unwrap();
        assert_eq!(p.engine.store().commits(), committed + 1);
        assert!(!p.engine.has_uncommitted());
        let mut plain = memory_pipeline(&policy).await;
        plain.fold_measured(&records, Vec::new()).await.unwrap();
        plain.commit().await.unwrap();
        assert_eq!(
            p.engine.state_hash().unwrap(),
            plain.engine.state_hash().unwrap()
        );
    }

    #[tokio::test]
    async fn readings_shed_to_the_fold_leave_the_same_log_and_state() {
        let records = measured_session();
        let policy = measured_policy();
        // The state hash, the log, and how many turns came with a reading
        // and with a telling line.
        let fold_shedding = |share: f64| {
            let policy = policy.clone();
            let records = records.clone();
            async move {
                let mut p = memory_pipeline(&policy).await;
                let mut measurer = Measurer::for_policy(&policy);
                measurer.shed_readings(share);
                let (mut readings, mut tellings, mut turns) = (0, 0, 0);
                for chunk in records.chunks(50) {
                    let measures = measurer.measure(chunk);
                    for m in measures.iter().flatten() {
                        turns += 1;
                        readings += usize::from(m.reading.is_some());
                        tellings += usize::from(m.telling.is_some());
                    }
                    p.ingest_measured(chunk, measures).await.unwrap();
                }
                let log = p.log.read_after(0, usize::MAX).await.unwrap();
                let log: Vec<bytes::Bytes> = log.into_iter().map(|r| r.bytes).collect();
                let hash = p.engine.state_hash().unwrap();
                (hash, log, readings, tellings, turns)
            }
        };
        let (hash, log, all_read, all_told, turns) = fold_shedding(0.0).await;
        assert_eq!(all_read, turns, "every turn here has text to read");
        assert!(all_told > 0, "the session has long outputs");
        // Only readings are shed: the telling lines are still found ahead.
        let (half_hash, half_log, half_read, half_told, _) = fold_shedding(0.5).await;
        assert_eq!((&half_hash, &half_log), (&hash, &log));
        assert_eq!((half_read, half_told), (turns / 2, all_told));
        let (none_hash, none_log, none_read, none_told, _) = fold_shedding(1.0).await;
        assert_eq!((&none_hash, &none_log), (&hash, &log));
        assert_eq!((none_read, none_told), (0, all_told));
        // Out-of-range shares are clamped, and NaN sheds nothing.
        let mut m = Measurer::default();
        m.shed_readings(f64::NAN);
        assert!(!m.sheds_next());
        m.shed_readings(7.0);
        assert!(m.sheds_next() && m.sheds_next());
    }

    #[test]
    fn identifiers_are_read_ahead_once_a_conversation_nears_compaction() {
        use crate::core::event::ModelDeclared;
        let event = |id: String, key: &str, body: EventBody| {
            (
                Encoding::Msgpack,
                Envelope::new(id, key, 1_000, body).to_msgpack(),
            )
        };
        let mut records = vec![event(
            "declared".into(),
            "w:small",
            EventBody::ModelDeclared(ModelDeclared {
                model: "gpt-4o".into(),
                context_window: Some(1_000),
            }),
        )];
        for i in 0..6 {
            for key in ["w:small", "w:default"] {
                let text = format!("step {i}: read src/lib.rs and fix it. ").repeat(12);
                records.push(event(
                    format!("{key}-{i}"),
                    key,
                    EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
                        Role::User,
                        text,
                    ))),
                ));
            }
        }
        let measures = Measurer::for_policy(&PolicyConfig::default()).measure(&records);
        let read = |key: &str| -> Vec<bool> {
            measures
                .iter()
                .filter_map(|m| {
                    let m = m.as_ref()?;
                    let id = &m.admitted.as_ref()?.admitted().event.id;
                    let reading = m.reading.as_ref()?;
                    id.starts_with(key).then(|| reading.identifiers.is_some())
                })
                .collect()
        };
        // 1,000 tokens declared: from 375 tokens (half the 0.75 that starts
        // compaction) every turn's identifiers are read too; under the
        // default window, only the output's signals.
        let small = read("w:small");
        assert_eq!(small.len(), 6);
        assert!(!small[0] && small[5], "{small:?}");
        assert!(small.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(read("w:default"), vec![false; 6]);
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
            log.append(Origin::Agent, Encoding::Json, e.to_json().as_bytes())
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
        assert_eq!(missing.state_hash().unwrap(), whole.state_hash().unwrap());
    }
}
