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

/// The readings of the newest turns, by event id: at most [`Readings::CAP`]
/// of them, holding at most [`Readings::CAP_TEXT_BYTES`] of their texts,
/// the oldest dropped first (a turn is drafted within a few thousand turns
/// of its arrival, or read again by its draft).
#[derive(Debug, Default)]
pub struct Readings {
    by_event: foldhash::HashMap<Box<str>, Arc<SourceReading>>,
    order: VecDeque<Box<str>>,
    /// The bytes of text the readings hold ([`ReadText::held_bytes`]).
    ///
    /// [`ReadText::held_bytes`]: crate::core::summary::ReadText::held_bytes
    text_bytes: usize,
}

impl Readings {
    pub const CAP: usize = 8_192;
    /// Above what 8,192 turns of the shared real transcripts hold (1.4 KB
    /// of text a turn on average, about 11 MiB), so on them the count
    /// decides; a stretch of long texts keeps fewer readings rather than
    /// more memory.
    pub const CAP_TEXT_BYTES: usize = 16 << 20;

    pub fn insert(&mut self, event_id: Box<str>, reading: Arc<SourceReading>) {
        self.text_bytes += reading.text.held_bytes();
        match self.by_event.insert(event_id.clone(), reading) {
            Some(replaced) => self.text_bytes -= replaced.text.held_bytes(),
            None => self.order.push_back(event_id),
        }
        while self.order.len() > Self::CAP || self.text_bytes > Self::CAP_TEXT_BYTES {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(dropped) = self.by_event.remove(&oldest) {
                self.text_bytes -= dropped.text.held_bytes();
            }
        }
    }

    /// The bytes of text the readings hold.
    pub fn text_bytes(&self) -> usize {
        self.text_bytes
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
    use crate::core::summary::{OutputReading, ReadText};

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

    #[test]
    fn the_oldest_readings_go_first_past_the_bytes_of_text_they_may_hold() {
        let long = |n: usize| {
            Arc::new(SourceReading {
                role: None,
                tool: None,
                text: ReadText::of(&format!("{n:>16384}")),
                output: OutputReading::default(),
                identifiers: None,
                notes: Default::default(),
            })
        };
        let fit = Readings::CAP_TEXT_BYTES / ReadText::WHOLE_BYTES;
        let mut readings = Readings::default();
        for i in 0..fit + 3 {
            readings.insert(format!("e{i}").into(), long(i));
            assert!(readings.text_bytes() <= Readings::CAP_TEXT_BYTES);
        }
        assert_eq!(readings.len(), fit);
        assert_eq!(readings.text_bytes(), fit * ReadText::WHOLE_BYTES);
        assert!((0..3).all(|i| readings.get(&format!("e{i}")).is_none()));
        assert_eq!(readings.get(&format!("e{}", fit + 2)), Some(long(fit + 2)));
        // A reading replaced counts once; one held by digest counts none.
        readings.insert(format!("e{}", fit + 2).into(), long(fit + 2));
        assert_eq!(readings.text_bytes(), fit * ReadText::WHOLE_BYTES);
        readings.insert("digest".into(), {
            let mut r = (*long(0)).clone();
            r.text = ReadText::of(&"x".repeat(ReadText::WHOLE_BYTES + 1));
            Arc::new(r)
        });
        assert_eq!(readings.len(), fit + 1);
        assert_eq!(readings.text_bytes(), fit * ReadText::WHOLE_BYTES);
        assert!(readings.get("digest").is_some());
    }
}
