//! The digests of every event id a conversation applied (its idempotency
//! check), in a form that costs about 16 bytes an id resident: a sorted
//! vector of all but the newest ids, which a binary search reads, and the
//! newest in a small set merged into it now and then. A hash set of every
//! digest cost 33 bytes an id, and the list in applied order the store
//! needed beside it 16 more.
//!
//! The order ids were applied in is not state (an id is applied or not),
//! so the state hash and the store see the sorted digests: however often
//! the set was merged, evicted or reloaded, the same ids hash the same.

use super::{DigestSet, IdDigest};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The newest ids merge into the sorted vector when there are this many,
/// or an eighth of it: a merge copies the vector, so a long conversation
/// merges less often (an id is copied about eight times on average), and
/// a short one holds few ids in a hash table (33 bytes an id).
const MERGE_AT: usize = 32;

/// A digest's place in the sorted order: its bytes read as one big-endian
/// number, which orders exactly as the bytes do, compared in one
/// instruction rather than by a `memcmp` call (the sort of each merge was
/// most of the fold's cost of an id).
fn order(digest: &IdDigest) -> u128 {
    u128::from_be_bytes(*digest)
}

#[derive(Debug, Clone, Default)]
pub struct AppliedIds {
    /// All but `recent`, sorted, no duplicates.
    sorted: Vec<IdDigest>,
    /// The newest ids (none of them in `sorted`).
    recent: DigestSet,
    /// Ids applied since a store last took them ([`AppliedIds::take_unsaved`]),
    /// in applied order: what its next commit writes.
    unsaved: Vec<IdDigest>,
}

impl AppliedIds {
    /// From stored digests (any order, duplicates allowed).
    pub fn from_stored(mut digests: Vec<IdDigest>) -> AppliedIds {
        digests.sort_unstable_by_key(order);
        digests.dedup();
        digests.shrink_to_fit();
        AppliedIds {
            sorted: digests,
            ..AppliedIds::default()
        }
    }

    pub fn contains(&self, digest: &IdDigest) -> bool {
        self.recent.contains(digest)
            || self
                .sorted
                .binary_search_by_key(&order(digest), order)
                .is_ok()
    }

    /// Adds `digest`; false when it was applied already.
    pub fn insert(&mut self, digest: IdDigest) -> bool {
        if self.contains(&digest) {
            return false;
        }
        self.insert_new(digest);
        true
    }

    /// Adds `digest`, which the caller just found not applied
    /// ([`AppliedIds::contains`]): the fold checks every event once, and
    /// a second search per event was a tenth of its time.
    pub fn insert_new(&mut self, digest: IdDigest) {
        debug_assert!(!self.contains(&digest));
        self.recent.insert(digest);
        self.unsaved.push(digest);
        if self.recent.len() >= MERGE_AT.max(self.sorted.len() / 8) {
            self.merge();
        }
    }

    /// Merges `recent` into `sorted` in place, from the back: the recent
    /// ids are appended, then each slot from the end takes the larger of
    /// the two runs' last, so no second vector is allocated and the ids
    /// below the smallest recent one stay where they are.
    fn merge(&mut self) {
        let mut recent: Vec<IdDigest> = self.recent.drain().collect();
        recent.sort_unstable_by_key(order);
        let old = self.sorted.len();
        self.sorted.extend_from_slice(&recent);
        let (mut i, mut j) = (old, recent.len());
        let mut k = self.sorted.len();
        while j > 0 {
            k -= 1;
            if i > 0 && order(&self.sorted[i - 1]) > order(&recent[j - 1]) {
                self.sorted[k] = self.sorted[i - 1];
                i -= 1;
            } else {
                self.sorted[k] = recent[j - 1];
                j -= 1;
            }
        }
        // Emptied, its table kept: it fills again to about the size it
        // had (an eighth of the ids, or `MERGE_AT`), and growing it anew
        // from nothing was most of the cost of an insert (rehashes). It is
        // at most a few bytes per applied id.
        self.recent.clear();
    }

    /// How many ids were applied.
    pub fn len(&self) -> usize {
        self.sorted.len() + self.recent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every digest, sorted.
    pub fn sorted(&self) -> Vec<IdDigest> {
        let mut all = self.sorted.clone();
        all.extend(self.recent.iter().copied());
        all.sort_unstable_by_key(order);
        all
    }

    /// The ids applied since the store last took them, in order.
    pub fn unsaved(&self) -> &[IdDigest] {
        &self.unsaved
    }

    /// A store wrote [`AppliedIds::unsaved`]: they need not be kept apart.
    pub fn saved(&mut self) {
        self.unsaved = Vec::new();
    }
}

impl PartialEq for AppliedIds {
    fn eq(&self, other: &AppliedIds) -> bool {
        self.len() == other.len() && self.sorted() == other.sorted()
    }
}

/// As the sorted list of digests (what the state hash covers).
impl Serialize for AppliedIds {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.sorted().serialize(s)
    }
}

impl<'de> Deserialize<'de> for AppliedIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<AppliedIds, D::Error> {
        Ok(AppliedIds::from_stored(Vec::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::state::id_digest;
    use proptest::prelude::*;

    proptest! {
        /// Membership, count and the sorted form are those of a plain set,
        /// whatever the merges, and whatever was reloaded from the store.
        #[test]
        fn decides_as_a_set(ids in proptest::collection::vec(0u16..3000, 0..3000), reload_at in 0usize..3000) {
            let mut applied = AppliedIds::default();
            let mut set = std::collections::BTreeSet::new();
            let mut saved = Vec::new();
            for (i, id) in ids.iter().enumerate() {
                if i == reload_at {
                    saved.extend_from_slice(applied.unsaved());
                    applied = AppliedIds::from_stored(saved.clone());
                }
                let d = id_digest(&id.to_string());
                prop_assert_eq!(applied.contains(&d), set.contains(&d));
                prop_assert_eq!(applied.insert(d), set.insert(d));
                prop_assert_eq!(applied.len(), set.len());
            }
            prop_assert_eq!(applied.sorted(), set.iter().copied().collect::<Vec<_>>());
        }
    }

    #[test]
    fn unsaved_ids_are_kept_in_order_until_saved() {
        let mut applied = AppliedIds::default();
        let ids: Vec<IdDigest> = (0..600).map(|i| id_digest(&format!("e{i}"))).collect();
        for d in &ids {
            applied.insert(*d);
        }
        applied.insert(ids[3]);
        assert_eq!(applied.unsaved(), &ids[..]);
        applied.saved();
        assert!(applied.unsaved().is_empty());
        assert!(applied.contains(&ids[599]));
        let round: AppliedIds =
            rmp_serde::from_slice(&rmp_serde::to_vec(&applied).unwrap()).unwrap();
        assert_eq!(round, applied);
    }
}
