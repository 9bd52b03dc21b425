//! Turn bodies: the message exactly as published with the id of the event
//! that carried it. Most of a turn's bytes, read only by assembly,
//! summarization snapshots, recall and the state hash, never by the fold's
//! decisions; so they live apart from [`super::Turn`], read through
//! [`TurnBodies`] (see the parent module's doc).

use super::{Conversation, HistoryEntry};
use crate::core::event::TurnAppended;
use crate::core::summary::SourceReading;
use crate::BoxError;
use serde_tuple::{Deserialize_tuple, Serialize_tuple};
use std::sync::Arc;

/// One turn's body. Stored as the pair `[event_id, turn]`.
#[derive(Debug, Clone, PartialEq, Serialize_tuple, Deserialize_tuple)]
pub struct TurnBody {
    pub event_id: Box<str>,
    pub turn: TurnAppended,
}

impl TurnBody {
    pub fn new(event_id: &str, turn: TurnAppended) -> TurnBody {
        TurnBody {
            event_id: event_id.into(),
            turn,
        }
    }
}

impl std::ops::Deref for TurnBody {
    type Target = TurnAppended;
    fn deref(&self) -> &TurnAppended {
        &self.turn
    }
}

/// Turn bodies a conversation holds in memory, by sequence number: those
/// folded and not yet handed to a store, and those its duplicate and flood
/// guards may still compare a new turn with. Bookkeeping beside the state:
/// not serialized, hashed or compared (the hash reads bodies through
/// [`TurnBodies`]).
///
/// A vector in sequence order, not a map: the fold appends each turn's
/// body at the end (its sequence is the conversation's newest), on the hot
/// path of every event.
#[derive(Debug, Clone, Default)]
pub struct ResidentBodies {
    bodies: Vec<(u64, Arc<TurnBody>)>,
    bytes: u64,
    /// What the duplicate and flood guards read of the bodies they may
    /// still compare with, once the bodies themselves are in a store: the
    /// turn's sketch and digest (pure functions of the body, so a guard
    /// decides the same from them as from the body), 32 bytes instead of
    /// the body's kilobytes. Sorted by sequence.
    guards: Vec<GuardedTurn>,
}

/// A released body as the guards read it: (seq, sketch, digest).
pub type GuardedTurn = (u64, u64, super::IdDigest);

impl PartialEq for ResidentBodies {
    fn eq(&self, _: &ResidentBodies) -> bool {
        true
    }
}

impl ResidentBodies {
    fn index(&self, seq: u64) -> Result<usize, usize> {
        // The newest is asked for most (guards, the turn just folded).
        match self.bodies.last() {
            Some((last, _)) if *last == seq => Ok(self.bodies.len() - 1),
            Some((last, _)) if *last < seq => Err(self.bodies.len()),
            _ => self.bodies.binary_search_by_key(&seq, |(s, _)| *s),
        }
    }
    pub fn get(&self, seq: u64) -> Option<&Arc<TurnBody>> {
        self.index(seq).ok().map(|i| &self.bodies[i].1)
    }
    pub fn insert(&mut self, seq: u64, body: Arc<TurnBody>) {
        self.bytes += body_size(&body);
        match self.index(seq) {
            Ok(i) => {
                let old = std::mem::replace(&mut self.bodies[i].1, body);
                self.bytes -= body_size(&old);
            }
            Err(i) => self.bodies.insert(i, (seq, body)),
        }
    }
    /// Bodies of turns `from..`, in order (what a commit writes).
    pub fn from(&self, from: u64) -> impl Iterator<Item = (u64, &Arc<TurnBody>)> {
        let start = self.bodies.partition_point(|(s, _)| *s < from);
        self.bodies[start..].iter().map(|(s, b)| (*s, b))
    }
    /// Drops every body from memory; returns them. The guards keep what
    /// they read of the ones `guarded` names: `read` of each body (it is
    /// only called for a turn not already remembered).
    pub fn release(
        &mut self,
        guarded: &[u64],
        read: impl Fn(&TurnBody) -> (u64, super::IdDigest),
    ) -> Vec<(u64, Arc<TurnBody>)> {
        let mut guards: Vec<GuardedTurn> = Vec::with_capacity(guarded.len());
        for &seq in guarded {
            if let Some(g) = self.guard(seq) {
                guards.push(g);
            } else if let Some(body) = self.get(seq) {
                let (sketch, digest) = read(body);
                guards.push((seq, sketch, digest));
            }
        }
        guards.sort_unstable_by_key(|g| g.0);
        guards.dedup_by_key(|g| g.0);
        self.guards = guards;
        self.bytes = 0;
        std::mem::take(&mut self.bodies)
    }
    /// Remembers what the guards read of turn `seq` (a body read back from
    /// a store, not kept).
    pub fn remember_guard(&mut self, seq: u64, sketch: u64, digest: super::IdDigest) {
        match self.guards.binary_search_by_key(&seq, |g| g.0) {
            Ok(i) => self.guards[i] = (seq, sketch, digest),
            Err(i) => self.guards.insert(i, (seq, sketch, digest)),
        }
    }
    /// What the guards read of turn `seq`, when its body was released.
    pub fn guard(&self, seq: u64) -> Option<GuardedTurn> {
        self.guards
            .binary_search_by_key(&seq, |g| g.0)
            .ok()
            .map(|i| self.guards[i])
    }
    pub fn len(&self) -> usize {
        self.bodies.len()
    }
    pub fn is_empty(&self) -> bool {
        self.bodies.is_empty()
    }
    /// About the bytes they hold (their text).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Summary texts a conversation holds in memory, by summary index: those
/// accepted and not yet handed to a store (every one, for a state folded
/// in memory alone). Bookkeeping like [`ResidentBodies`].
#[derive(Debug, Clone, Default)]
pub struct ResidentTexts {
    texts: Vec<(u32, Arc<str>)>,
}

impl PartialEq for ResidentTexts {
    fn eq(&self, _: &ResidentTexts) -> bool {
        true
    }
}

impl ResidentTexts {
    pub fn get(&self, index: u32) -> Option<&Arc<str>> {
        self.texts
            .binary_search_by_key(&index, |(i, _)| *i)
            .ok()
            .map(|at| &self.texts[at].1)
    }
    /// Summaries are only appended: `index` is the newest.
    pub fn push(&mut self, index: u32, text: Arc<str>) {
        debug_assert!(self.texts.last().is_none_or(|(i, _)| *i < index));
        self.texts.push((index, text));
    }
    /// Texts of summaries `from..`, in order (what a commit writes).
    pub fn from(&self, from: u32) -> impl Iterator<Item = (u32, &Arc<str>)> {
        let start = self.texts.partition_point(|(i, _)| *i < from);
        self.texts[start..].iter().map(|(i, t)| (*i, t))
    }
    /// Drops them all from memory (a store holds them); returns them.
    pub fn release(&mut self) -> Vec<(u32, Arc<str>)> {
        std::mem::take(&mut self.texts)
    }
    pub fn len(&self) -> usize {
        self.texts.len()
    }
    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }
}

/// About the bytes a body holds in memory: its text plus a fixed overhead.
pub fn body_size(body: &TurnBody) -> u64 {
    (body.message.text_bytes() + body.event_id.len()) as u64 + 160
}

/// Why a turn body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error(
        "turn {seq} of conversation {conversation:?} has no body in memory and no store to read it from"
    )]
    NotResident { conversation: String, seq: u64 },
    #[error(
        "turn {seq} of conversation {conversation:?} has no body in the state store; run `contextfold rebuild`"
    )]
    Missing { conversation: String, seq: u64 },
    #[error(
        "summary {index} of conversation {conversation:?} has no text in memory and no store to read it from"
    )]
    SummaryNotResident { conversation: String, index: u32 },
    #[error(
        "summary {index} of conversation {conversation:?} has no text in the state store; run `contextfold rebuild`"
    )]
    SummaryMissing { conversation: String, index: u32 },
    #[error("summary {index} of conversation {conversation:?} could not be read: {source}")]
    SummaryUnreadable {
        conversation: String,
        index: u32,
        #[source]
        source: BoxError,
    },
    #[error(
        "the history of conversation {conversation:?} is not in memory and there is no store to read it from"
    )]
    HistoryNotResident { conversation: String },
    #[error(
        "the stored history of conversation {conversation:?} does not match its digest; run `contextfold rebuild`"
    )]
    HistoryMismatch { conversation: String },
    #[error("the history of conversation {conversation:?} could not be read: {source}")]
    HistoryUnreadable {
        conversation: String,
        #[source]
        source: BoxError,
    },
    #[error("turn {seq} of conversation {conversation:?} could not be read: {source}")]
    Unreadable {
        conversation: String,
        seq: u64,
        #[source]
        source: BoxError,
    },
}

/// Where the parts of a conversation kept out of memory are read from:
/// turn bodies, and its history entries.
pub trait TurnBodies {
    fn turn_body(&self, conv: &Conversation, seq: u64) -> Result<Arc<TurnBody>, BodyError>;
    /// The text of summary `index` of `conv`.
    fn summary_text(&self, conv: &Conversation, index: u32) -> Result<Arc<str>, BodyError>;
    /// Every history entry of `conv`, oldest first.
    fn history(&self, conv: &Conversation) -> Result<Vec<HistoryEntry>, BodyError>;
    /// What a summarizer reads of the turn of event `event_id`, when a
    /// runtime read it ahead (see [`SourceReading`]): a shortcut only.
    fn read_ahead(&self, _event_id: &str) -> Option<Arc<SourceReading>> {
        None
    }
}

/// Bodies from the conversation alone: for a state folded in memory,
/// which keeps every body it folded.
#[derive(Debug, Clone, Copy, Default)]
pub struct Resident;

impl TurnBodies for Resident {
    fn turn_body(&self, conv: &Conversation, seq: u64) -> Result<Arc<TurnBody>, BodyError> {
        conv.bodies
            .get(seq)
            .cloned()
            .ok_or_else(|| BodyError::NotResident {
                conversation: conv.key.clone(),
                seq,
            })
    }
    fn summary_text(&self, conv: &Conversation, index: u32) -> Result<Arc<str>, BodyError> {
        conv.summary_texts
            .get(index)
            .cloned()
            .ok_or_else(|| BodyError::SummaryNotResident {
                conversation: conv.key.clone(),
                index,
            })
    }
    fn history(&self, conv: &Conversation) -> Result<Vec<HistoryEntry>, BodyError> {
        conv.history
            .all()
            .map(<[HistoryEntry]>::to_vec)
            .ok_or_else(|| BodyError::HistoryNotResident {
                conversation: conv.key.clone(),
            })
    }
}
