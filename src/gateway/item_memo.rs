//! The items of a conversation's last request, kept by their bytes.
//!
//! A client sends its whole history every turn, so a request's items are,
//! byte for byte, mostly the last request's. Compared with `memcmp`, they
//! need no hash: the canonical items ([`Canon`]) of the items that match
//! are taken from the last request, and only the rest are hashed and
//! looked up in the canonical-item cache (`Gateway::canonical`). On a
//! 100k-token conversation that hashing was about half the gateway's time
//! before the upstream call.
//!
//! A request's memo is found by its tenant, surface, encoding and first
//! two items (a system prompt and a first message: two conversations of
//! one tenant seldom share both; when they do, the memo holds whichever
//! sent last, and fewer items match). Equal bytes are the same item for
//! the same surface and encoding, so a memo only saves work: it never
//! changes what an item becomes. Bounded by the bytes of the bodies it
//! holds, the least recently used leaving first.

use crate::core::tokens;
use crate::gateway::surface::{Canon, Surface};
use bytes::Bytes;
use std::ops::Range;
use std::sync::Arc;

/// Default bound of the bodies the memo holds, in bytes.
pub const DEFAULT_MEMO_BYTES: u64 = 64 << 20;

/// Where a request's memo is found.
pub type MemoKey = [u8; 32];

/// One request's items: its body, where each item lies in it, and what
/// each became.
pub struct Memo {
    body: Bytes,
    spans: Vec<Range<usize>>,
    canons: Vec<Arc<Canon>>,
}

impl Memo {
    /// What item `i` of a new request became last time, when its bytes
    /// are the same.
    pub fn canon(&self, i: usize, raw: &str) -> Option<Arc<Canon>> {
        let span = self.spans.get(i)?;
        let old = self.body.get(span.clone())?;
        (old == raw.as_bytes())
            .then(|| self.canons.get(i).cloned())
            .flatten()
    }
}

#[derive(Clone)]
struct BodyBytes;

impl quick_cache::Weighter<MemoKey, Arc<Memo>> for BodyBytes {
    fn weight(&self, _: &MemoKey, memo: &Arc<Memo>) -> u64 {
        memo.body.len().max(1) as u64
    }
}

/// The memo of the last request of each conversation.
pub struct ItemMemo {
    cache: quick_cache::sync::Cache<MemoKey, Arc<Memo>, BodyBytes>,
}

impl ItemMemo {
    /// A memo holding bodies of up to `max_bytes` in all.
    pub fn new(max_bytes: u64) -> ItemMemo {
        let estimated = usize::try_from(max_bytes / (64 << 10)).unwrap_or(usize::MAX);
        ItemMemo {
            cache: quick_cache::sync::Cache::with_weighter(
                estimated.max(16),
                max_bytes.max(1),
                BodyBytes,
            ),
        }
    }

    /// The key of a request's memo; `None` without items.
    pub fn key(
        tenant: &str,
        surface: Surface,
        enc: tokens::Encoding,
        items: &[&str],
    ) -> Option<MemoKey> {
        let first = items.first()?;
        let mut h = blake3::Hasher::new();
        h.update(&[surface as u8, enc as u8]);
        h.update(&(tenant.len() as u64).to_le_bytes());
        h.update(tenant.as_bytes());
        h.update(&(first.len() as u64).to_le_bytes());
        h.update(first.as_bytes());
        if let Some(second) = items.get(1) {
            h.update(second.as_bytes());
        }
        Some(*h.finalize().as_bytes())
    }

    pub fn get(&self, key: &MemoKey) -> Option<Arc<Memo>> {
        self.cache.get(key)
    }

    /// Keeps `items` (slices of `body`) and what they became as the memo
    /// of `key`; items that do not lie in `body` keep nothing.
    pub fn put(&self, key: MemoKey, body: &Bytes, items: &[&str], canons: &[Arc<Canon>]) {
        let base = body.as_ptr() as usize;
        let mut spans = Vec::with_capacity(items.len());
        for raw in items {
            let start = (raw.as_ptr() as usize).wrapping_sub(base);
            let end = start.wrapping_add(raw.len());
            if start > body.len() || end > body.len() {
                return;
            }
            spans.push(start..end);
        }
        let canons = canons[..items.len().min(canons.len())].to_vec();
        self.cache.insert(
            key,
            Arc::new(Memo {
                body: body.clone(),
                spans,
                canons,
            }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::surface::canonicalize;

    /// The raw items as the parser borrows them: slices of the body.
    fn items(body: &Bytes) -> Vec<&str> {
        match crate::gateway::surface::parse(Surface::Chat, body) {
            Ok(parsed) => parsed.items.iter().map(|r| r.get()).collect(),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn a_request_takes_what_matches_its_last_one_by_bytes_and_no_more() {
        let enc = tokens::Encoding::O200kBase;
        let first = Bytes::from(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"},{"role":"assistant","content":"hello"}]}"#,
        );
        let raw = items(&first);
        let canons: Vec<Arc<Canon>> = raw
            .iter()
            .map(|r| Arc::new(canonicalize(Surface::Chat, r, enc).unwrap()))
            .collect();
        let memo = ItemMemo::new(1 << 20);
        let key = ItemMemo::key("", Surface::Chat, enc, &raw).unwrap();
        memo.put(key, &first, &raw, &canons);

        // The next request: the same history, an edited reply, a new turn.
        let next = Bytes::from(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"},{"role":"assistant","content":"hello!"},{"role":"user","content":"more"}]}"#,
        );
        let raw2 = items(&next);
        assert_eq!(ItemMemo::key("", Surface::Chat, enc, &raw2), Some(key));
        assert!(
            ItemMemo::key("acme/", Surface::Chat, enc, &raw2).is_some_and(|k| k != key),
            "another tenant's key"
        );
        let m = memo.get(&key).unwrap();
        let found: Vec<bool> = raw2
            .iter()
            .enumerate()
            .map(|(i, r)| m.canon(i, r).is_some())
            .collect();
        assert_eq!(found, [true, true, false, false]);
        assert_eq!(m.canon(1, raw2[1]).unwrap().digest, canons[1].digest);
        // Slices of another buffer are not kept.
        let elsewhere = String::from(raw2[0]);
        memo.put(key, &first, &[elsewhere.as_str()], &canons);
        assert!(
            memo.get(&key).unwrap().canon(2, raw[2]).is_some(),
            "unchanged"
        );
    }
}
