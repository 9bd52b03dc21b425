//! A conversation's compaction history (for `history` and audit): entries
//! only ever appended, by every decision the fold takes. They are read by
//! people, never by the fold, so like turn bodies they are not kept in
//! memory once a store holds them: what stays resident is their count and
//! a running digest of every entry in order (what the state hash and a
//! store's head cover), plus the entries a store has not taken yet (all of
//! them for a state folded in memory alone).

use super::HistoryEntry;
use serde::{Deserialize, Serialize};

/// The digest of no entry.
const EMPTY_CHAIN: [u8; 16] = [0; 16];

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(from = "Stored")]
pub struct HistoryLog {
    len: u64,
    chain: [u8; 16],
    /// Entries `len - entries.len()..len`.
    entries: Vec<HistoryEntry>,
}

/// What is written and hashed: the count and the digest, as two
/// integers (not a list of 16).
#[derive(Serialize, Deserialize)]
struct Stored(u64, u64, u64);

impl From<Stored> for HistoryLog {
    fn from(Stored(len, hi, lo): Stored) -> HistoryLog {
        let mut chain = [0; 16];
        chain[..8].copy_from_slice(&hi.to_be_bytes());
        chain[8..].copy_from_slice(&lo.to_be_bytes());
        HistoryLog {
            len,
            chain,
            entries: Vec::new(),
        }
    }
}

impl Serialize for HistoryLog {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let [h0, h1, h2, h3, h4, h5, h6, h7, l0, l1, l2, l3, l4, l5, l6, l7] = self.chain;
        Stored(
            self.len,
            u64::from_be_bytes([h0, h1, h2, h3, h4, h5, h6, h7]),
            u64::from_be_bytes([l0, l1, l2, l3, l4, l5, l6, l7]),
        )
        .serialize(s)
    }
}

impl Default for HistoryLog {
    fn default() -> Self {
        HistoryLog {
            len: 0,
            chain: EMPTY_CHAIN,
            entries: Vec::new(),
        }
    }
}

impl HistoryLog {
    /// A log of `entries`, every one in memory.
    pub fn from_entries(entries: Vec<HistoryEntry>) -> HistoryLog {
        let mut log = HistoryLog::default();
        log.entries.reserve_exact(entries.len());
        for e in entries {
            log.push(e);
        }
        log
    }

    pub fn push(&mut self, entry: HistoryEntry) {
        self.chain = link(&self.chain, &entry);
        self.len += 1;
        self.entries.push(entry);
    }

    /// Entries ever recorded.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Index of the first entry held in memory (the ones before are in a
    /// store).
    pub fn first_resident(&self) -> usize {
        self.len() - self.entries.len()
    }

    /// The entries held in memory: those a store has not taken yet, every
    /// entry of a state folded in memory alone.
    pub fn resident(&self) -> &[HistoryEntry] {
        &self.entries
    }

    /// Every entry, when all are in memory (a state folded in memory).
    pub fn all(&self) -> Option<&[HistoryEntry]> {
        (self.entries.len() as u64 == self.len).then_some(&self.entries[..])
    }

    /// A store wrote [`HistoryLog::resident`]: drop them from memory.
    pub fn saved(&mut self) {
        self.entries = Vec::new();
    }

    /// Whether `entries`, read from a store, are the ones recorded
    /// before the resident ones (the digest chain checks them).
    pub fn verify(&self, stored: &[HistoryEntry]) -> bool {
        let mut chain = EMPTY_CHAIN;
        let mut len = 0;
        for e in stored.iter().chain(&self.entries) {
            chain = link(&chain, e);
            len += 1;
        }
        len == self.len && chain == self.chain
    }
}

/// The digest of the entries up to `entry`, from that of those before it.
#[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
fn link(chain: &[u8; 16], entry: &HistoryEntry) -> [u8; 16] {
    let mut h = blake3::Hasher::new();
    h.update(chain);
    h.update(&rmp_serde::to_vec(entry).expect("history entries serialize"));
    let mut out = [0; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u64) -> HistoryEntry {
        HistoryEntry {
            time: i,
            event_id: format!("e{i}"),
            event_type: "debt_recorded".into(),
            detail: format!("share {i}"),
        }
    }

    #[test]
    fn the_digest_covers_every_entry_in_order_whatever_was_saved() {
        let (mut a, mut b) = (HistoryLog::default(), HistoryLog::default());
        for i in 0..5 {
            a.push(entry(i));
            b.push(entry(i));
            if i == 2 {
                b.saved();
            }
        }
        assert_eq!(
            rmp_serde::to_vec(&a).unwrap(),
            rmp_serde::to_vec(&b).unwrap()
        );
        assert_eq!(b.first_resident(), 3);
        assert_eq!(b.resident().len(), 2);
        assert!(b.all().is_none() && a.all().is_some());
        let stored: Vec<_> = (0..3).map(entry).collect();
        assert!(b.verify(&stored));
        assert!(!b.verify(&stored[..2]));
        let mut swapped = HistoryLog::default();
        for i in [1, 0] {
            swapped.push(entry(i));
        }
        let mut ordered = HistoryLog::default();
        for i in [0, 1] {
            ordered.push(entry(i));
        }
        assert_ne!(
            rmp_serde::to_vec(&swapped).unwrap(),
            rmp_serde::to_vec(&ordered).unwrap()
        );
        // A count and two 64-bit integers.
        assert_eq!(rmp_serde::to_vec(&ordered).unwrap().len(), 1 + 1 + 9 + 9);
    }
}
