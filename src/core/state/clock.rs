//! A partition's clock and its timers: the time the fold decides by, and
//! the conversations that wait for it.
//!
//! # Which time
//!
//! Every log record moves the clock to the time it carries as a recorded
//! fact, never backwards: over JetStream, the time the stream stored it
//! (the server's, written in the log, the same in every replay); in the
//! embedded log, which stores no time, the event's own time (one local
//! publisher). A producer's claimed time therefore never runs a
//! partition's deadlines, spend windows or backoffs ahead over NATS, and a
//! session backfilled with week-old timestamps is scheduled as it arrives.
//! When a partition is quiet, the service records `clock_ticked` events
//! (their stored time moves the clock), so every wait ends without agent
//! traffic.
//!
//! # Timers
//!
//! A conversation whose compaction waits for time (a job's expiry, a
//! backoff, a Retry-After, a spend window reopening) has one timer here:
//! when the clock reaches it, the fold evaluates that conversation again
//! ([`crate::core::fold::wake`]). The timers are the partition's, not the
//! conversations': a conversation need not be in memory to be woken, and
//! the runtime loads the ones a record makes due before folding it
//! ([`PartitionClock::due`]).

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// The partition's time (ms since the Unix epoch) and its timers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Stored", into = "Stored")]
pub struct PartitionClock {
    /// The newest record time folded.
    pub now: u64,
    /// Each waiting conversation's wake time, by key.
    timers: BTreeMap<String, u64>,
    /// The same timers by time, for the due ones (derived: not stored).
    by_time: BTreeSet<(u64, String)>,
}

/// What is stored and hashed of a [`PartitionClock`].
#[derive(Serialize, Deserialize)]
struct Stored {
    now: u64,
    timers: BTreeMap<String, u64>,
}

impl From<Stored> for PartitionClock {
    fn from(s: Stored) -> Self {
        PartitionClock::with_timers(s.now, s.timers)
    }
}

impl From<PartitionClock> for Stored {
    fn from(c: PartitionClock) -> Self {
        Stored {
            now: c.now,
            timers: c.timers,
        }
    }
}

impl PartitionClock {
    /// A clock at `now` with these timers (what a store read back).
    pub fn with_timers(now: u64, timers: BTreeMap<String, u64>) -> Self {
        let by_time = timers.iter().map(|(k, t)| (*t, k.clone())).collect();
        PartitionClock {
            now,
            timers,
            by_time,
        }
    }

    /// Moves the clock to `time` when that is later; returns the time the
    /// fold decides by now.
    pub fn advance(&mut self, time: u64) -> u64 {
        self.now = self.now.max(time);
        self.now
    }

    /// Sets (or with `None` clears) `key`'s timer.
    pub fn set(&mut self, key: &str, at: Option<u64>) {
        let old = self.timers.get(key).copied();
        if old == at {
            return;
        }
        if let Some(old) = old {
            self.by_time.remove(&(old, key.to_string()));
        }
        match at {
            Some(at) => {
                self.timers.insert(key.to_string(), at);
                self.by_time.insert((at, key.to_string()));
            }
            None => {
                self.timers.remove(key);
            }
        }
    }

    /// `key`'s timer, if it has one.
    pub fn timer(&self, key: &str) -> Option<u64> {
        self.timers.get(key).copied()
    }

    /// The conversations whose timers are due at `time`, earliest first
    /// (ties in key order): what a record at `time` wakes.
    pub fn due(&self, time: u64) -> impl Iterator<Item = &str> + '_ {
        self.by_time
            .iter()
            .take_while(move |(at, _)| *at <= time)
            .map(|(_, key)| key.as_str())
    }

    /// The earliest timer, if any: when a quiet partition needs a tick.
    pub fn next_due(&self) -> Option<u64> {
        self.by_time.first().map(|(at, _)| *at)
    }

    /// Every timer, by key.
    pub fn timers(&self) -> &BTreeMap<String, u64> {
        &self.timers
    }

    pub fn len(&self) -> usize {
        self.timers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.timers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers_fire_in_time_order_and_move_when_set_again() {
        let mut c = PartitionClock::default();
        c.set("b", Some(20));
        c.set("a", Some(20));
        c.set("c", Some(5));
        assert_eq!(c.due(19).collect::<Vec<_>>(), ["c"]);
        assert_eq!(c.due(20).collect::<Vec<_>>(), ["c", "a", "b"]);
        c.set("c", Some(30));
        assert_eq!(c.next_due(), Some(20));
        c.set("a", None);
        c.set("b", None);
        assert_eq!(c.due(29).count(), 0);
        assert_eq!(c.timer("c"), Some(30));
        let stored = PartitionClock::with_timers(7, c.timers().clone());
        assert_eq!(stored, c.clone_with_now(7));
    }

    #[test]
    fn the_clock_never_goes_back() {
        let mut c = PartitionClock::default();
        assert_eq!(c.advance(100), 100);
        assert_eq!(c.advance(50), 100);
        assert_eq!(c.now, 100);
    }

    impl PartitionClock {
        fn clone_with_now(&self, now: u64) -> Self {
            PartitionClock {
                now,
                ..self.clone()
            }
        }
    }
}
