//! Message ids (`Nats-Msg-Id`): what JetStream deduplicates a stream's
//! messages by, across all of its subjects.
//!
//! An event's own id cannot be its message id: the events stream
//! deduplicates message ids over every subject, so an agent that published
//! another conversation's next event ids first, on its own subject, made
//! the server drop that conversation's real events as duplicates (and a
//! sweep-end id guessed ahead left a job pending). So a message id is
//! claimable only by whoever publishes the event legitimately:
//!
//! - **the service's events** (decisions, summaries, sweep ends, ticks,
//!   the API's records): `s1-` and a BLAKE3 hash, keyed with a secret each
//!   process draws at start and never sends, over the conversation and the
//!   event id. A retry from the same process is dropped by the server; a
//!   copy from another process (after a crash or a takeover) is stored
//!   once more and dropped by the fold, which applies an event id once per
//!   conversation. No agent can compute one.
//! - **an agent's events**: `a1-` and a hash over the conversation and the
//!   event id, keyed with a key derived from the publisher's own NATS
//!   credentials (its token, password, seed or credentials file) when it
//!   has some: a re-run with the same credentials is dropped by the
//!   server, and no other agent can compute the id. Without credentials (a
//!   server anyone may publish to) the hash is unkeyed: still scoped to its
//!   conversation, so two conversations that use the same event ids never
//!   drop each other's events.
//!
//! Either way the fold stays the judge of "the same event": it applies an
//! id once per conversation, whatever the message ids.

use crate::core::event::Origin;
use std::sync::OnceLock;

/// The version prefix of agent message ids (`a1-`).
pub const AGENT_PREFIX: &str = "a1-";
/// The version prefix of the service's message ids (`s1-`).
pub const SERVICE_PREFIX: &str = "s1-";

/// The key of an agent's message ids, derived from its credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct AgentKey([u8; 32]);

impl std::fmt::Debug for AgentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A secret.
        f.write_str("AgentKey(..)")
    }
}

impl AgentKey {
    /// The key for `secret` (credentials as bytes); none when it is empty.
    pub fn from_secret(secret: &[u8]) -> Option<AgentKey> {
        (!secret.is_empty()).then(|| {
            AgentKey(blake3::derive_key(
                "contextfold 2026 agent message ids v1",
                secret,
            ))
        })
    }
}

/// This process's key for the service's message ids (see the module doc).
fn service_key() -> &'static [u8; 32] {
    static KEY: OnceLock<[u8; 32]> = OnceLock::new();
    KEY.get_or_init(|| {
        let mut key = [0u8; 32];
        if let Err(e) = getrandom::fill(&mut key) {
            // Not seen on the systems contextfold runs on; the time, the
            // process and an address are no more readable by an agent.
            tracing::warn!(error = %e, "no random source for message-id keys; deriving one");
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            let mut h = blake3::Hasher::new();
            h.update(&nanos.to_le_bytes());
            h.update(&std::process::id().to_le_bytes());
            h.update(&(&key as *const _ as usize).to_le_bytes());
            key = *h.finalize().as_bytes();
        }
        key
    })
}

fn hashed(prefix: &str, key: Option<&[u8; 32]>, conversation: &str, event_id: &str) -> String {
    let mut h = match key {
        Some(k) => blake3::Hasher::new_keyed(k),
        None => blake3::Hasher::new(),
    };
    h.update(conversation.as_bytes());
    h.update(&[0]);
    h.update(event_id.as_bytes());
    format!("{prefix}{}", &h.finalize().to_hex()[..40])
}

/// The message id of event `event_id` of `conversation` published as
/// `origin`; `agent` keys an agent's (see the module doc).
pub fn of(origin: Origin, agent: Option<&AgentKey>, conversation: &str, event_id: &str) -> String {
    match origin {
        Origin::Agent => hashed(AGENT_PREFIX, agent.map(|k| &k.0), conversation, event_id),
        Origin::Service | Origin::Legacy => {
            hashed(SERVICE_PREFIX, Some(service_key()), conversation, event_id)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_scoped_to_their_conversation_and_keyed_by_publisher() {
        let agent = |key: Option<&AgentKey>, c: &str, e: &str| of(Origin::Agent, key, c, e);
        // Unkeyed agent ids: apart by conversation.
        assert_ne!(agent(None, "c1", "t1"), agent(None, "c2", "t1"));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(agent(None, "ab", "c"), agent(None, "a", "bc"));
        // Keyed by credentials: stable for the holder, not computable by
        // anyone else.
        let mine = AgentKey::from_secret(b"seed-A");
        let again = AgentKey::from_secret(b"seed-A");
        let other = AgentKey::from_secret(b"seed-B");
        assert!(AgentKey::from_secret(b"").is_none());
        assert_eq!(
            agent(mine.as_ref(), "c1", "t1"),
            agent(again.as_ref(), "c1", "t1")
        );
        assert_ne!(
            agent(mine.as_ref(), "c1", "t1"),
            agent(other.as_ref(), "c1", "t1")
        );
        assert_ne!(agent(mine.as_ref(), "c1", "t1"), agent(None, "c1", "t1"));
        assert!(!format!("{mine:?}").contains("seed"));
        // The service's: stable in a process, never an agent's.
        let s = of(Origin::Service, None, "c1", "se_job_1");
        assert_eq!(s, of(Origin::Service, mine.as_ref(), "c1", "se_job_1"));
        assert!(s.starts_with(SERVICE_PREFIX));
        assert_ne!(s, agent(None, "c1", "se_job_1"));
        assert!(agent(None, "c1", "t1").starts_with(AGENT_PREFIX));
    }
}
