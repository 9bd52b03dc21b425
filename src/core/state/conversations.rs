//! A partition's conversations by key: looked up on every event, iterated
//! in key order wherever the order shows (the state hash, the stored form,
//! listings).
//!
//! Hashed, not a B-tree: a B-tree lookup compared the key with a dozen
//! others (a `memcmp` each, over keys that share long prefixes), about a
//! tenth of the fold's cost of an event. The hasher is std's, randomly
//! keyed: keys come from publishers, and a fixed hash would let them pick
//! keys that collide. So iteration sorts the keys first, and the order is
//! the key order a `BTreeMap` gave: nothing that iterates sees the change.
//! A conversation is boxed: a table's empty slots then cost a pointer, not
//! a whole conversation (896 bytes).

use super::Conversation;
use hashbrown::HashMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::ops::Index;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Conversations(HashMap<String, Box<Conversation>, RandomState>);

impl Conversations {
    pub fn get(&self, key: &str) -> Option<&Conversation> {
        self.0.get(key).map(|c| &**c)
    }

    pub fn get_mut(&mut self, key: &str) -> Option<&mut Conversation> {
        self.0.get_mut(key).map(|c| &mut **c)
    }

    /// The conversation `key`, made by `new` when absent; looked up once
    /// when present, and its key copied only when absent.
    pub fn get_or_insert_with(
        &mut self,
        key: &str,
        new: impl FnOnce() -> Conversation,
    ) -> &mut Conversation {
        self.0.entry_ref(key).or_insert_with(|| Box::new(new()))
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    pub fn insert(&mut self, key: String, conversation: Conversation) -> Option<Conversation> {
        self.0.insert(key, Box::new(conversation)).map(|c| *c)
    }

    pub fn remove(&mut self, key: &str) -> Option<Conversation> {
        self.0.remove(key).map(|c| *c)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// In key order.
    pub fn iter(&self) -> std::vec::IntoIter<(&String, &Conversation)> {
        let mut all: Vec<_> = self.0.iter().map(|(k, c)| (k, &**c)).collect();
        all.sort_unstable_by(|a, b| a.0.cmp(b.0));
        all.into_iter()
    }

    /// In key order.
    pub fn iter_mut(&mut self) -> std::vec::IntoIter<(&String, &mut Conversation)> {
        let mut all: Vec<_> = self.0.iter_mut().map(|(k, c)| (k, &mut **c)).collect();
        all.sort_unstable_by(|a, b| a.0.cmp(b.0));
        all.into_iter()
    }

    /// In key order.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut Conversation> {
        self.iter_mut().map(|(_, c)| c)
    }

    /// In key order.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.iter().map(|(k, _)| k)
    }

    /// In key order.
    pub fn values(&self) -> impl Iterator<Item = &Conversation> {
        self.iter().map(|(_, c)| c)
    }
}

impl<'a> IntoIterator for &'a Conversations {
    type Item = (&'a String, &'a Conversation);
    type IntoIter = std::vec::IntoIter<(&'a String, &'a Conversation)>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<K: Borrow<str> + ?Sized> Index<&K> for Conversations {
    type Output = Conversation;

    /// Panics when absent, as a map's index does (tests read this way).
    fn index(&self, key: &K) -> &Conversation {
        &self.0[key.borrow()]
    }
}

/// As a map in key order: the form a `BTreeMap` had.
impl Serialize for Conversations {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for Conversations {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Conversations, D::Error> {
        let all = std::collections::HashMap::<String, Box<Conversation>>::deserialize(d)?;
        Ok(Conversations(all.into_iter().collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iterates_and_serializes_in_key_order() {
        let mut map = Conversations::default();
        let mut sorted = std::collections::BTreeMap::new();
        for key in ["b", "a:2", "c", "a:10", "a", ""] {
            map.insert(key.to_string(), Conversation::new(key));
            sorted.insert(key.to_string(), Conversation::new(key));
        }
        let keys: Vec<&String> = map.keys().collect();
        assert_eq!(keys, sorted.keys().collect::<Vec<_>>());
        assert_eq!(
            rmp_serde::to_vec(&map).unwrap(),
            rmp_serde::to_vec(&sorted).unwrap()
        );
        let back: Conversations = rmp_serde::from_slice(&rmp_serde::to_vec(&map).unwrap()).unwrap();
        assert_eq!(back, map);
        assert_eq!(map["a:2"].key, "a:2");
    }
}
