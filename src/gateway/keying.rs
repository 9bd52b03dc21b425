//! Which conversation a request continues, which of its items are new, and
//! the ids they are published under.
//!
//! First match wins: an explicit conversation (the `x-contextfold-conversation`
//! header, `metadata.conversation_id` / `session_id`, Claude Code's
//! session in `metadata.user_id`), then the provider's lineage
//! (`previous_response_id`, whose ids the gateway records), then a
//! contextfold summary the client kept (Codex keeps the compaction it was
//! answered: everything before it is stored already), then harness session
//! headers, then the longest stored prefix of the items.
//!
//! Items form a *chain*: `c[i] = H(c[i-1], identity(item i))`, seeded with
//! the tenant and the explicit or harness key (so two keyed conversations
//! never share a chain). The index maps each chain value to the
//! conversation and position that stored it, so the longest stored prefix
//! is one lookup per item, and a request whose next item differs from
//! what the conversation holds there (a rewind, an edit, a client's own
//! rolling window) *forks*: a new conversation, named after its parent and
//! the divergent item, gets the shared prefix and the new items. Never a
//! system prompt, `prompt_cache_key` or API key alone.
//!
//! Event ids are `gw-<H(conversation, chain before the item)>.<n>`: the
//! turn that follows this exact history in this conversation. A retried or
//! replayed request publishes the ids it published before, and a retried
//! request answered differently (by this replica or another) publishes its
//! answer under the first answer's id: the fold keeps one, changes nothing.
//!
//! The index is memory (a restart forgets it): conversation ids and event
//! ids are derived from content, so after a restart an unkeyed
//! conversation resolves to the same id and its republished turns are
//! duplicates the fold drops; only a fork made before the restart is found
//! again by its divergent item, not by lookup.
//!
//! It is bounded (`gateway.keying_max_turns`): past that many turns held,
//! the conversations used least recently are forgotten whole (their chain
//! values, their turns' positions and their response ids), exactly as a
//! restart forgets them, so nothing is lost but the lookup: the next
//! request of a forgotten conversation resolves to the same id by the same
//! derivation.

use crate::gateway::surface::{Canon, ItemKind};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

pub type Chain = [u8; 16];

/// How the conversation was found (a response header says which).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyedBy {
    Explicit,
    Lineage,
    Summary,
    Harness,
    Prefix,
    New,
}

impl KeyedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            KeyedBy::Explicit => "explicit",
            KeyedBy::Lineage => "lineage",
            KeyedBy::Summary => "summary",
            KeyedBy::Harness => "harness",
            KeyedBy::Prefix => "prefix",
            KeyedBy::New => "new",
        }
    }
}

/// What the request names about its conversation.
#[derive(Debug, Default, Clone)]
pub struct Hints {
    pub explicit: Option<String>,
    pub previous_response_id: Option<String>,
    pub harness: Option<String>,
}

/// The answer for one request.
#[derive(Debug, Clone)]
pub struct Resolution {
    pub conversation: Arc<str>,
    pub keyed_by: KeyedBy,
    /// Per request item: its chain value, when it is a turn.
    pub chains: Vec<Option<Chain>>,
    /// Per request item: the chain value before it (what its event ids
    /// are derived from: the turn that follows this exact history).
    pub prevs: Vec<Option<Chain>>,
    /// Items to publish, in order (for a fork: the shared prefix too).
    pub new_items: Vec<usize>,
    /// Where the response's turn goes: the position after the last item,
    /// and the chain value it extends.
    pub tail: (u32, Chain),
    /// The conversation this one forked from.
    pub forked_from: Option<Arc<str>>,
}

/// What the index holds of one conversation.
#[derive(Default)]
struct Held {
    chains: Vec<Chain>,
    /// The response ids recorded for it (forgotten with it).
    responses: Vec<String>,
    /// When it was last used (the index's own counter).
    used: u64,
}

#[derive(Default)]
struct Inner {
    by_chain: HashMap<Chain, (Arc<str>, u32)>,
    chains: HashMap<Arc<str>, Held>,
    responses: HashMap<String, (Arc<str>, u32, Chain)>,
    /// Conversations by last use, oldest first.
    recency: BTreeMap<u64, Arc<str>>,
    clock: u64,
}

/// The in-memory index (module doc).
pub struct Index {
    inner: Mutex<Inner>,
    max_turns: usize,
}

impl Default for Index {
    fn default() -> Self {
        Index::with_max_turns(crate::config::DEFAULT_KEYING_MAX_TURNS)
    }
}

impl Inner {
    /// `conversation` was used now: it is the last to be forgotten.
    fn touch(&mut self, conversation: &Arc<str>) {
        self.clock += 1;
        let now = self.clock;
        let held = self.chains.entry(conversation.clone()).or_default();
        let before = std::mem::replace(&mut held.used, now);
        self.recency.remove(&before);
        self.recency.insert(now, conversation.clone());
    }

    /// Forgets `conversation` whole: its chain values, its positions and
    /// its response ids.
    fn forget(&mut self, conversation: &Arc<str>) {
        let Some(held) = self.chains.remove(conversation) else {
            return;
        };
        self.recency.remove(&held.used);
        for c in &held.chains {
            if self
                .by_chain
                .get(c)
                .is_some_and(|(conv, _)| conv == conversation)
            {
                self.by_chain.remove(c);
            }
        }
        for id in &held.responses {
            self.responses.remove(id);
        }
    }

    /// Forgets the conversations used least recently until at most
    /// `max_turns` chain values are held, never `keep`.
    fn bound(&mut self, max_turns: usize, keep: &Arc<str>) {
        while self.by_chain.len() > max_turns {
            let Some(oldest) = self.recency.values().find(|c| *c != keep).cloned() else {
                return;
            };
            self.forget(&oldest);
        }
    }
}

fn h(parts: &[&[u8]]) -> Chain {
    let mut chain = Chain::default();
    chain.copy_from_slice(&crate::core::derived_id::hash_of_parts(parts).as_bytes()[..16]);
    chain
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The chain value after `item` on `prev`.
pub fn link(prev: &Chain, digest: &[u8; 16]) -> Chain {
    h(&[prev, digest])
}

/// The id of the `n`-th turn of the item that follows `chain` (the history
/// before it) in `conversation`.
pub fn event_id(conversation: &str, chain: &Chain, n: usize) -> String {
    crate::core::derived_id::DerivedId::GatewayTurn {
        conversation,
        chain,
        n,
    }
    .to_string()
}

/// Whether an item is a turn of the chain.
fn is_turn(kind: ItemKind) -> bool {
    matches!(
        kind,
        ItemKind::User | ItemKind::Assistant | ItemKind::ToolResult | ItemKind::System
    )
}

/// A conversation key from a client-given name: kept readable, bounded.
fn key_of(prefix: &str, name: &str) -> String {
    let clean: String = name
        .chars()
        .take(128)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_:.@#".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{prefix}{clean}")
}

impl Index {
    /// An index holding at most about `max_turns` turns (module doc).
    pub fn with_max_turns(max_turns: usize) -> Self {
        Index {
            inner: Mutex::new(Inner::default()),
            max_turns: max_turns.max(1),
        }
    }

    /// Resolves a request's conversation and registers its items.
    /// `prefix` is the tenant's conversation prefix (`""` or `name/`).
    pub fn resolve(&self, prefix: &str, hints: &Hints, items: &[Arc<Canon>]) -> Option<Resolution> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        // The head's system items are the client's instructions, not turns.
        let head = items
            .iter()
            .take_while(|c| matches!(c.kind, ItemKind::System | ItemKind::Injected))
            .count();
        // A contextfold summary the client kept: what precedes it is stored.
        let boundary = items
            .iter()
            .enumerate()
            .rev()
            .find(|(_, c)| {
                c.summary_of
                    .as_deref()
                    .is_some_and(|conv| conv.starts_with(prefix))
            })
            .map(|(i, c)| (i, c.summary_of.clone().unwrap_or_default(), c.digest));

        let explicit = hints.explicit.as_deref().map(|n| key_of(prefix, n));
        let lineage = hints
            .previous_response_id
            .as_deref()
            .and_then(|id| inner.responses.get(id).cloned())
            .filter(|(conv, _, _)| conv.starts_with(prefix));
        let harness = hints.harness.as_deref().map(|n| key_of(prefix, n));

        let (start, seed, fixed, keyed_by): (usize, Chain, Option<String>, KeyedBy) =
            if let Some((conv, _, chain)) = &lineage {
                (0, *chain, Some(conv.to_string()), KeyedBy::Lineage)
            } else if let Some((i, conv, digest)) = &boundary {
                let seed = h(&[b"summary", conv.as_bytes(), digest]);
                let by = if explicit.is_some() {
                    KeyedBy::Explicit
                } else {
                    KeyedBy::Summary
                };
                (
                    i + 1,
                    seed,
                    Some(explicit.as_ref().unwrap_or(conv).clone()),
                    by,
                )
            } else if let Some(key) = &explicit {
                (
                    head,
                    h(&[b"key", key.as_bytes()]),
                    Some(key.clone()),
                    KeyedBy::Explicit,
                )
            } else if let Some(key) = &harness {
                (
                    head,
                    h(&[b"key", key.as_bytes()]),
                    Some(key.clone()),
                    KeyedBy::Harness,
                )
            } else {
                (
                    head,
                    h(&[b"tenant", prefix.as_bytes()]),
                    None,
                    KeyedBy::Prefix,
                )
            };

        let mut chains = vec![None; items.len()];
        let mut prevs = vec![None; items.len()];
        let mut walk: Vec<(usize, Chain)> = Vec::new();
        let mut prev = seed;
        for (i, c) in items.iter().enumerate().skip(start) {
            if is_turn(c.kind) {
                prevs[i] = Some(prev);
                prev = link(&prev, &c.digest);
                chains[i] = Some(prev);
                walk.push((i, prev));
            }
        }
        // The longest stored prefix.
        let found = walk.iter().enumerate().rev().find_map(|(w, (_, c))| {
            inner
                .by_chain
                .get(c)
                .map(|(conv, pos)| (w, conv.clone(), *pos))
        });

        let (conversation, keyed_by, new_from, first_pos, forked_from) = match found {
            Some((w, conv, pos)) => {
                let held = inner.chains.get(&conv).map_or(0, |h| h.chains.len());
                let diverges = w + 1 < walk.len() && held > pos as usize + 1;
                let by = if keyed_by == KeyedBy::Prefix {
                    KeyedBy::Prefix
                } else {
                    keyed_by
                };
                if diverges {
                    let (_, next) = walk[w + 1];
                    let fork: Arc<str> =
                        format!("{conv}~{}", hex(&h(&[conv.as_bytes(), &next])[..4])).into();
                    // The fork holds the shared prefix as its own turns.
                    (fork, by, 0usize, 0u32, Some(conv))
                } else {
                    (conv, by, w + 1, pos + 1, None)
                }
            }
            None => {
                let Some(&(_, first)) = walk.first() else {
                    // Nothing that is a turn: nothing to key.
                    let conv: Arc<str> = fixed?.into();
                    let next = inner.chains.get(&conv).map_or(0, |h| h.chains.len()) as u32;
                    return Some(Resolution {
                        conversation: conv,
                        keyed_by,
                        chains,
                        prevs,
                        new_items: Vec::new(),
                        tail: (next, seed),
                        forked_from: None,
                    });
                };
                let (conv, by): (Arc<str>, KeyedBy) = match fixed {
                    Some(k) => (k.into(), keyed_by),
                    None => (
                        format!("{prefix}gw-{}", hex(&first[..10])).into(),
                        KeyedBy::New,
                    ),
                };
                let pos = match (&lineage, &boundary) {
                    (Some((_, p, _)), _) => p + 1,
                    (None, Some(_)) => inner.chains.get(&conv).map_or(0, |h| h.chains.len()) as u32,
                    _ => 0,
                };
                (conv, by, 0, pos, None)
            }
        };
        // A fork copies the prefix: every walked item is new to it.
        let new_walk = &walk[new_from..];
        inner.touch(&conversation);
        let mut dropped = Vec::new();
        let entry = &mut inner.chains.entry(conversation.clone()).or_default().chains;
        let mut pos = first_pos;
        for (_, c) in new_walk {
            let at = pos as usize;
            if entry.len() > at {
                dropped.extend(entry.drain(at..));
            }
            entry.push(*c);
            pos += 1;
        }
        // A rewritten tail's chain values lead nowhere now.
        for c in dropped {
            if inner
                .by_chain
                .get(&c)
                .is_some_and(|(conv, _)| *conv == conversation)
            {
                inner.by_chain.remove(&c);
            }
        }
        let tail_pos = if new_walk.is_empty() { first_pos } else { pos };
        for (k, (_, c)) in new_walk.iter().enumerate() {
            inner
                .by_chain
                .entry(*c)
                .or_insert((conversation.clone(), first_pos + k as u32));
        }
        let last = walk.last().map_or(seed, |(_, c)| *c);
        inner.bound(self.max_turns, &conversation);
        Some(Resolution {
            conversation,
            keyed_by,
            chains,
            prevs,
            new_items: new_walk.iter().map(|(i, _)| *i).collect(),
            tail: (tail_pos, last),
            forked_from,
        })
    }

    /// Registers the response's turn after `tail`; returns its chain, or
    /// `None` when the conversation already holds another item there (a
    /// retried request answered differently: the first answer stays, and
    /// the client's next request forks if it kept the second).
    pub fn append_response(
        &self,
        conversation: &Arc<str>,
        tail: (u32, Chain),
        digest: &[u8; 16],
        response_id: Option<&str>,
    ) -> Option<Chain> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let chain = link(&tail.1, digest);
        inner.touch(conversation);
        let entry = &mut inner.chains.entry(conversation.clone()).or_default().chains;
        let at = tail.0 as usize;
        let fresh = match entry.get(at) {
            Some(c) if *c == chain => false,
            Some(_) => return None,
            None => {
                if entry.len() == at {
                    entry.push(chain);
                }
                true
            }
        };
        if fresh {
            inner
                .by_chain
                .entry(chain)
                .or_insert((conversation.clone(), tail.0));
        }
        if let Some(id) = response_id {
            let before = inner
                .responses
                .insert(id.to_string(), (conversation.clone(), tail.0, chain));
            if before.is_none() {
                if let Some(held) = inner.chains.get_mut(conversation) {
                    held.responses.push(id.to_string());
                }
            }
        }
        inner.bound(self.max_turns, conversation);
        Some(chain)
    }

    /// Conversations the index holds.
    pub fn conversations(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.chains.len()
    }

    /// Turns (chain values) the index holds.
    pub fn turns(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.by_chain.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::tokens::Encoding;
    use crate::gateway::surface::{canonicalize, Surface};

    fn items(msgs: &[(&str, &str)]) -> Vec<Arc<Canon>> {
        msgs.iter()
            .map(|(role, text)| {
                let raw = serde_json::json!({"role": role, "content": text}).to_string();
                Arc::new(canonicalize(Surface::Chat, &raw, Encoding::O200kBase).unwrap())
            })
            .collect()
    }

    #[test]
    fn an_appended_request_continues_and_a_replay_adds_nothing() {
        let index = Index::default();
        let first = items(&[("system", "be brief"), ("user", "hello")]);
        let r1 = index.resolve("", &Hints::default(), &first).unwrap();
        assert_eq!(r1.new_items, vec![1]);
        let reply = items(&[("assistant", "hi")]);
        index
            .append_response(&r1.conversation, r1.tail, &reply[0].digest, None)
            .unwrap();
        let again = index.resolve("", &Hints::default(), &first).unwrap();
        assert_eq!(again.conversation, r1.conversation);
        assert!(again.new_items.is_empty());
        let second = items(&[
            ("system", "be brief"),
            ("user", "hello"),
            ("assistant", "hi"),
            ("user", "more"),
        ]);
        let r2 = index.resolve("", &Hints::default(), &second).unwrap();
        assert_eq!(r2.conversation, r1.conversation);
        assert_eq!(r2.new_items, vec![3]);
    }

    #[test]
    fn same_system_prompt_different_users_stay_apart_and_a_rewind_forks() {
        let index = Index::default();
        let a = index
            .resolve(
                "",
                &Hints::default(),
                &items(&[("system", "S"), ("user", "task A")]),
            )
            .unwrap();
        let b = index
            .resolve(
                "",
                &Hints::default(),
                &items(&[("system", "S"), ("user", "task B")]),
            )
            .unwrap();
        assert_ne!(a.conversation, b.conversation);
        let long = items(&[
            ("user", "task A"),
            ("assistant", "ok"),
            ("user", "step 2"),
            ("assistant", "done"),
        ]);
        let l = index.resolve("", &Hints::default(), &long).unwrap();
        assert_eq!(l.conversation, a.conversation);
        let rewind = items(&[
            ("user", "task A"),
            ("assistant", "ok"),
            ("user", "step 2, differently"),
        ]);
        let f = index.resolve("", &Hints::default(), &rewind).unwrap();
        assert_eq!(f.forked_from.as_deref(), Some(&*a.conversation));
        assert_ne!(f.conversation, a.conversation);
        assert_eq!(f.new_items, vec![0, 1, 2]);
        // The fork continues as itself.
        let cont = items(&[
            ("user", "task A"),
            ("assistant", "ok"),
            ("user", "step 2, differently"),
            ("assistant", "x"),
            ("user", "y"),
        ]);
        let c = index.resolve("", &Hints::default(), &cont).unwrap();
        assert_eq!(c.conversation, f.conversation);
        assert_eq!(c.new_items, vec![3, 4]);
    }

    #[test]
    fn explicit_keys_keep_identical_content_apart() {
        let index = Index::default();
        let msgs = items(&[("user", "same")]);
        let k1 = Hints {
            explicit: Some("one".into()),
            ..Hints::default()
        };
        let k2 = Hints {
            explicit: Some("two".into()),
            ..Hints::default()
        };
        let a = index.resolve("t/", &k1, &msgs).unwrap();
        let b = index.resolve("t/", &k2, &msgs).unwrap();
        assert_eq!(&*a.conversation, "t/one");
        assert_eq!(&*b.conversation, "t/two");
        assert_eq!(b.new_items, vec![0]);
        assert_ne!(
            event_id(&a.conversation, &a.chains[0].unwrap(), 0),
            event_id(&b.conversation, &b.chains[0].unwrap(), 0)
        );
    }

    /// A conversation of `n` user/assistant turns about `topic`.
    fn talk(topic: &str, n: usize) -> Vec<Arc<Canon>> {
        let msgs: Vec<(String, String)> = (0..n)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                (role.to_string(), format!("{topic} {i}"))
            })
            .collect();
        let refs: Vec<(&str, &str)> = msgs.iter().map(|(r, t)| (r.as_str(), t.as_str())).collect();
        items(&refs)
    }

    #[test]
    fn a_bounded_index_forgets_the_least_recently_used_and_finds_them_again_by_content() {
        let index = Index::with_max_turns(10);
        let a = index
            .resolve("", &Hints::default(), &talk("alpha", 4))
            .unwrap();
        let b = index
            .resolve("", &Hints::default(), &talk("beta", 4))
            .unwrap();
        assert_eq!(index.turns(), 8);
        // `a` is used again: `b` is now the oldest.
        let a2 = index
            .resolve("", &Hints::default(), &talk("alpha", 5))
            .unwrap();
        assert_eq!(a2.conversation, a.conversation);
        assert_eq!(a2.new_items, vec![4]);
        // A third conversation goes over the bound: `b` is forgotten.
        let c = index
            .resolve("", &Hints::default(), &talk("gamma", 4))
            .unwrap();
        assert!(index.turns() <= 10, "{} turns held", index.turns());
        assert_eq!(index.conversations(), 2);
        // `b` comes back as the same conversation, its turns under the
        // same ids (duplicates the fold drops), and takes a place again.
        let b2 = index
            .resolve("", &Hints::default(), &talk("beta", 4))
            .unwrap();
        assert_eq!(b2.conversation, b.conversation);
        assert_eq!(b2.new_items, vec![0, 1, 2, 3]);
        for i in 0..4 {
            assert_eq!(
                event_id(&b2.conversation, &b2.prevs[i].unwrap(), i),
                event_id(&b.conversation, &b.prevs[i].unwrap(), i),
                "turn {i}: the same event id as before it was forgotten"
            );
        }
        assert!(index.turns() <= 10);
        assert_ne!(c.conversation, b2.conversation);
    }
}
