//! Turns read ahead of their drafts ([`SourceReading`]): `run`'s measurer
//! reads each turn on its other core as it measures it, the engine keeps
//! the readings by event id, and the snapshots it hands to summarizers
//! carry them ([`WithReadings`]), so a draft, which holds up the fold,
//! only merges what was read. A reading is used only for the text it was
//! read from (`fallback_summary::reading`), so what is kept, evicted or
//! missed here changes the time a draft takes, never what it writes.

use crate::core::state::{BodyError, Conversation, HistoryEntry, TurnBodies, TurnBody};
use crate::core::summary::SourceReading;
use std::collections::VecDeque;
use std::sync::Arc;

/// The readings of the newest turns, by event id: at most [`Readings::CAP`],
/// the oldest dropped first (a turn is drafted within a few thousand turns
/// of its arrival, or read again by its draft).
#[derive(Debug, Default)]
pub struct Readings {
    by_event: foldhash::HashMap<Box<str>, Arc<SourceReading>>,
    order: VecDeque<Box<str>>,
}

impl Readings {
    pub const CAP: usize = 8_192;

    pub fn insert(&mut self, event_id: Box<str>, reading: Arc<SourceReading>) {
        if self.by_event.insert(event_id.clone(), reading).is_none() {
            self.order.push_back(event_id);
        }
        while self.order.len() > Self::CAP {
            if let Some(oldest) = self.order.pop_front() {
                self.by_event.remove(&oldest);
            }
        }
    }

    pub fn get(&self, event_id: &str) -> Option<Arc<SourceReading>> {
        self.by_event.get(event_id).cloned()
    }

    pub fn len(&self) -> usize {
        self.by_event.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_event.is_empty()
    }
}

/// `bodies` with the readings of [`Readings`] for their turns.
pub struct WithReadings<'a, T: TurnBodies> {
    pub bodies: T,
    pub readings: &'a Readings,
}

impl<T: TurnBodies> TurnBodies for WithReadings<'_, T> {
    fn turn_body(&self, conv: &Conversation, seq: u64) -> Result<Arc<TurnBody>, BodyError> {
        self.bodies.turn_body(conv, seq)
    }

    fn summary_text(&self, conv: &Conversation, index: u32) -> Result<Arc<str>, BodyError> {
        self.bodies.summary_text(conv, index)
    }

    fn history(&self, conv: &Conversation) -> Result<Vec<HistoryEntry>, BodyError> {
        self.bodies.history(conv)
    }

    fn read_ahead(&self, event_id: &str) -> Option<Arc<SourceReading>> {
        self.readings.get(event_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::summary::OutputReading;

    fn reading(n: u8) -> Arc<SourceReading> {
        Arc::new(SourceReading {
            role: None,
            tool: None,
            text: crate::core::summary::ReadText::of(&format!("text {n}")),
            output: OutputReading::default(),
            identifiers: None,
            notes: Default::default(),
        })
    }

    #[test]
    fn the_oldest_readings_go_first_past_the_cap() {
        let mut readings = Readings::default();
        for i in 0..Readings::CAP + 2 {
            readings.insert(format!("e{i}").into(), reading((i % 251) as u8));
        }
        assert_eq!(readings.len(), Readings::CAP);
        assert!(readings.get("e0").is_none() && readings.get("e1").is_none());
        assert_eq!(
            readings.get(&format!("e{}", Readings::CAP + 1)),
            Some(reading(((Readings::CAP + 1) % 251) as u8))
        );
        // The same event read again is one entry.
        readings.insert("e5".into(), reading(9));
        readings.insert("e5".into(), reading(9));
        assert_eq!(readings.len(), Readings::CAP);
    }
}
