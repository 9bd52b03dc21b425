//! The engine: decodes log records, folds them into state, tracks which
//! conversations changed and commits them with the log position atomically.
//! The embedded pipeline and the NATS folder both drive one engine per
//! partition.

use crate::core::event::{Envelope, EventBody, JobIssued};
use crate::core::fold::{self, FoldStatus};
use crate::core::policy::PolicyConfig;
use crate::core::state::State;
use crate::log::{LogRecord, Position};
use crate::metrics as m;
use crate::store::state_store::StateStore;
use crate::store::{KvBackend, StoreError};
use std::collections::BTreeSet;

/// What folding one record produced.
#[derive(Debug, Default)]
pub struct Applied {
    /// Decisions to publish to the log.
    pub decisions: Vec<Envelope>,
    /// Jobs among them, to hand to summarizers.
    pub jobs: Vec<(String, JobIssued)>,
}

pub struct Engine<B: KvBackend> {
    pub state: State,
    pub policy: PolicyConfig,
    store: StateStore<B>,
    position: Position,
    dirty: BTreeSet<String>,
    fingerprint: String,
}

/// The layout of the stored state. Raise it when a state record changes
/// shape: a store written by another layout is then rebuilt from the log,
/// so its state (and hash) is always the one a clean replay gives.
/// 2: the duplicate and flood guards keep sketches of the turns they saw.
/// 3: one chunk record per conversation per commit, not one per item.
/// 4: the context list lives in the chunks, not in the head.
/// 5: seen turns are pairs, their digests byte strings.
/// 6: turns are rows of their fields, not maps of their names.
pub const STATE_LAYOUT: u32 = 6;

/// A fingerprint of the policy and the state layout: state folded under
/// another policy, or stored in another layout, is rebuilt from the log.
pub fn policy_fingerprint(policy: &PolicyConfig) -> String {
    let bytes = rmp_serde::to_vec(policy).expect("policy serializes");
    let mut h = blake3::Hasher::new();
    h.update(&STATE_LAYOUT.to_le_bytes());
    h.update(&bytes);
    h.finalize().to_hex()[..16].to_string()
}

impl<B: KvBackend> Engine<B> {
    /// Opens the engine on a store; the caller replays the log after
    /// [`Engine::position`].
    pub fn open(backend: B, policy: PolicyConfig) -> Result<Self, StoreError> {
        let mut store = StateStore::new(backend);
        let fingerprint = policy_fingerprint(&policy);
        let (state, position) = store.load(&fingerprint)?;
        Ok(Engine {
            state,
            policy,
            store,
            position,
            dirty: BTreeSet::new(),
            fingerprint,
        })
    }

    /// Position of the last record folded.
    pub fn position(&self) -> Position {
        self.position
    }

    pub fn set_flush_every(&mut self, n: u32) {
        self.store.flush_every = n.max(1);
    }

    /// Folds one log record (decoding it, or rejecting it with a reason).
    pub fn apply(&mut self, record: &LogRecord) -> Applied {
        self.position = self.position.max(record.position);
        match Envelope::decode(&record.bytes, record.encoding) {
            Ok(event) => self.apply_owned(event),
            Err(err) => {
                let (_, conv) = Envelope::salvage_id(&record.bytes, record.encoding);
                self.reject(record, conv.as_deref(), &err.to_string())
            }
        }
    }

    /// Folds an event the caller already decoded from the record at
    /// `position` (saves a second decode when the caller inspects it); its
    /// turn moves into the state uncopied.
    pub fn apply_at(&mut self, position: Position, event: Envelope) -> Applied {
        self.position = self.position.max(position);
        self.apply_owned(event)
    }

    /// Rejects a record without folding it: undecodable bytes, or a record
    /// a runtime refuses before the fold (e.g. published on a subject that
    /// names another conversation). Records an `event_rejected` decision.
    pub fn reject(
        &mut self,
        record: &LogRecord,
        conversation: Option<&str>,
        reason: &str,
    ) -> Applied {
        self.position = self.position.max(record.position);
        let time = self
            .state
            .conversations
            .get(conversation.unwrap_or(""))
            .map_or(0, |c| c.last_time);
        let env =
            fold::reject_undecodable(&mut self.state, &record.bytes, conversation, reason, time);
        tracing::warn!(position = record.position, %reason, "rejected event");
        metrics::counter!(m::EVENTS_REJECTED).increment(1);
        if let Some(c) = conversation {
            self.dirty.insert(c.to_string());
        }
        Applied {
            decisions: vec![env],
            jobs: Vec::new(),
        }
    }

    /// Folds an event just decoded: its turn moves into the state uncopied.
    fn apply_owned(&mut self, event: Envelope) -> Applied {
        let span = tracing::trace_span!("fold", conversation = %event.conversation, event = %event.id, kind = event.type_name());
        let _guard = span.enter();
        let conversation = event.conversation.clone();
        let outcome = fold::fold_owned(&mut self.state, &self.policy, event, None);
        self.folded(&conversation, outcome)
    }

    fn folded(&mut self, conversation: &str, outcome: fold::FoldOutcome) -> Applied {
        match &outcome.status {
            FoldStatus::Applied => metrics::counter!(m::EVENTS_FOLDED).increment(1),
            FoldStatus::Duplicate => metrics::counter!(m::EVENTS_DUPLICATE).increment(1),
            FoldStatus::Rejected(reason) => {
                tracing::info!(%reason, "event rejected");
                metrics::counter!(m::EVENTS_REJECTED).increment(1);
            }
            FoldStatus::Ignored => metrics::counter!(m::EVENTS_IGNORED).increment(1),
        }
        if outcome.status != FoldStatus::Duplicate
            && outcome.status != FoldStatus::Ignored
            && !self.dirty.contains(conversation)
        {
            self.dirty.insert(conversation.to_string());
        }
        let jobs: Vec<_> = outcome
            .decisions
            .iter()
            .filter_map(|d| match &d.body {
                EventBody::JobIssued(j) => Some((d.conversation.clone(), j.clone())),
                _ => None,
            })
            .collect();
        metrics::counter!(m::JOBS_ISSUED).increment(jobs.len() as u64);
        Applied {
            decisions: outcome.decisions,
            jobs,
        }
    }

    /// Commits the changed conversations together with the position.
    pub fn commit(&mut self) -> Result<(), StoreError> {
        let dirty = std::mem::take(&mut self.dirty);
        self.store
            .commit(&mut self.state, &dirty, self.position, &self.fingerprint)?;
        metrics::counter!(m::STATE_COMMITS).increment(1);
        Ok(())
    }

    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.store.flush()
    }

    pub fn has_uncommitted(&self) -> bool {
        !self.dirty.is_empty()
    }

    pub fn store(&self) -> &StateStore<B> {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut StateStore<B> {
        &mut self.store
    }
}
