//! Gathers the steps of one conversation's audit ([`crate::core::audit`])
//! by folding a log in memory, one record at a time, and snapshotting the
//! conversation before and after each of its events.
//!
//! Every record is folded (whatever its conversation), in log order, by a
//! fresh in-memory [`Engine`], exactly as `replay` folds them: the audit
//! sees the states the service had, and never touches a store.

use crate::core::audit::{self, Audit, AuditPolicy, Dag, Snapshot, Step};
use crate::core::event::Envelope;
use crate::core::policy::PolicyConfig;
use crate::log::EventLog;
use crate::runtime::embedded::PipelineError;
use crate::runtime::engine::{Effects, Engine, Residency};
use crate::store::memory_backend::MemoryBackend;

/// Records read from the log at a time.
const BATCH: usize = 4096;

/// The audit of one conversation and its summary DAG at the log's end.
#[derive(Debug, Clone)]
pub struct Audited {
    pub audit: Audit,
    pub dag: Dag,
}

/// Why an audit could not be made.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error(
        "conversation {0:?} has no event in the log; `contextfold replay` lists the known ones"
    )]
    Unknown(String),
}

impl From<crate::log::LogError> for AuditError {
    fn from(e: crate::log::LogError) -> Self {
        AuditError::Pipeline(e.into())
    }
}

impl From<crate::store::StoreError> for AuditError {
    fn from(e: crate::store::StoreError) -> Self {
        AuditError::Pipeline(e.into())
    }
}

/// The conversation's snapshot under the policy the engine folds with now
/// (so the levels follow a policy the log records, once replay applies it).
fn snapshot(engine: &Engine<MemoryBackend>, key: &str) -> Snapshot {
    Snapshot::of(engine.state.conversations.get(key), key, &engine.policy)
}

/// The steps of `conversation` in `log`, folded under `policy`.
pub async fn steps<L: EventLog>(
    log: &mut L,
    policy: &PolicyConfig,
    residency: Residency,
    conversation: &str,
) -> Result<(Vec<Step>, Engine<MemoryBackend>), AuditError> {
    let mut engine = Engine::open(MemoryBackend::default(), policy.clone())?;
    engine.set_residency(residency);
    let mut steps = Vec::new();
    loop {
        let records = log.read_after(engine.position(), BATCH).await?;
        if records.is_empty() {
            break;
        }
        let mut effects = Effects::default();
        for r in &records {
            let event = Envelope::decode(&r.bytes, r.encoding)
                .ok()
                // A policy event is the partition's: it governs this
                // conversation's later decisions too.
                .filter(|e| {
                    e.conversation == conversation
                        || matches!(e.body, crate::core::event::EventBody::PolicyRecorded(_))
                });
            let Some(event) = event else {
                engine.apply_record(r, &mut effects)?;
                effects.decisions.clear();
                effects.dead_letters.clear();
                continue;
            };
            engine.ensure_resident(conversation)?;
            let before = snapshot(&engine, conversation);
            let folded = engine.apply_record(r, &mut effects)?;
            effects.decisions.clear();
            effects.dead_letters.clear();
            let after = snapshot(&engine, conversation);
            steps.push(Step {
                position: r.position,
                folded: folded.is_some(),
                event,
                before,
                after,
            });
        }
        engine.commit()?;
    }
    Ok((steps, engine))
}

/// The audit of `conversation` in `log` and its DAG at the log's end.
pub async fn audit<L: EventLog>(
    log: &mut L,
    policy: &PolicyConfig,
    residency: Residency,
    conversation: &str,
) -> Result<Audited, AuditError> {
    let (steps, engine) = steps(log, policy, residency, conversation).await?;
    // Policy events are every conversation's: one of its own is needed.
    if steps.iter().all(|s| s.event.conversation != conversation) {
        return Err(AuditError::Unknown(conversation.to_string()));
    }
    let audit = audit::build(conversation, &steps, AuditPolicy::from(policy));
    let dag = engine.with_conversation(conversation, |state, _| {
        state
            .conversations
            .get(conversation)
            .map(audit::dag)
            .unwrap_or(Dag {
                turns: 0,
                nodes: Vec::new(),
                raw_in_context: Vec::new(),
            })
    })?;
    Ok(Audited { audit, dag })
}
