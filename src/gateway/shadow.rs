//! What the gateway did, or would have done, per conversation: tokens as
//! the client sent them, as they went upstream, and as the active mode
//! sends them, with the provider prompt-cache writes each way.
//!
//! The cache model is the providers' prefix cache: a request re-reads the
//! longest prefix an earlier request of the conversation wrote and writes
//! the rest. A client that appends writes only what it appended; the
//! assembled context writes only its grown tail while the summary block
//! stays, and all of itself when the block changes (a compaction). So the
//! report shows the net effect of turning the gateway on: fewer tokens
//! sent, and what the prefix changes cost in cache writes.

use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Mutex;

#[derive(Debug, Default, Clone, Serialize)]
pub struct ConversationReport {
    pub requests: u64,
    /// Requests past the budget: assembled (active) or that would be
    /// (shadow).
    pub assembled_requests: u64,
    /// Tokens of the requests as the client sent them.
    pub tokens_client: u64,
    /// Tokens that went upstream.
    pub tokens_sent: u64,
    /// Tokens the active mode sends.
    pub tokens_active: u64,
    /// Prompt-cache writes, sent as the client sent them.
    pub cache_write_tokens_client: u64,
    /// Prompt-cache writes, sent as the active mode sends them.
    pub cache_write_tokens_active: u64,
    /// Times the active mode's prefix (the summary block) changed.
    pub prefix_changes: u64,
    /// Compactions the client asked for and the gateway answered.
    pub compactions_answered: u64,
    #[serde(skip)]
    last_client: u64,
    #[serde(skip)]
    last_active: u64,
    #[serde(skip)]
    last_block: Option<Vec<String>>,
}

/// One request, as the report counts it.
pub struct Observed<'a> {
    pub client_tokens: u64,
    pub sent_tokens: u64,
    /// What the active mode sends, with the summaries its block holds
    /// (`None`: the request as the client sent it).
    pub active: Option<(u64, &'a [String])>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Totals {
    pub conversations: usize,
    pub requests: u64,
    pub assembled_requests: u64,
    pub tokens_client: u64,
    pub tokens_sent: u64,
    pub tokens_active: u64,
    pub tokens_saved: u64,
    pub cache_write_tokens_client: u64,
    pub cache_write_tokens_active: u64,
    pub prefix_changes: u64,
    pub compactions_answered: u64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub mode: &'static str,
    pub totals: Totals,
    pub conversations: BTreeMap<String, ConversationReport>,
}

#[derive(Default)]
pub struct Ledger(Mutex<BTreeMap<String, ConversationReport>>);

fn appended(now: u64, last: u64) -> u64 {
    if now >= last {
        now - last
    } else {
        now
    }
}

impl Ledger {
    pub fn observe(&self, conversation: &str, o: Observed<'_>) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let r = map.entry(conversation.to_string()).or_default();
        r.requests += 1;
        r.tokens_client += o.client_tokens;
        r.tokens_sent += o.sent_tokens;
        r.cache_write_tokens_client += appended(o.client_tokens, r.last_client);
        r.last_client = o.client_tokens;
        match o.active {
            Some((tokens, block)) => {
                r.assembled_requests += 1;
                r.tokens_active += tokens;
                let same = r.last_block.as_deref() == Some(block);
                r.cache_write_tokens_active += if same {
                    appended(tokens, r.last_active)
                } else {
                    r.prefix_changes += 1;
                    tokens
                };
                r.last_block = Some(block.to_vec());
                r.last_active = tokens;
            }
            None => {
                r.tokens_active += o.client_tokens;
                r.cache_write_tokens_active += if r.last_block.is_some() {
                    o.client_tokens
                } else {
                    appended(o.client_tokens, r.last_active)
                };
                r.last_block = None;
                r.last_active = o.client_tokens;
            }
        }
    }

    pub fn compaction_answered(&self, conversation: &str) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(conversation.to_string())
            .or_default()
            .compactions_answered += 1;
    }

    pub fn report(&self, mode: &'static str) -> Report {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut t = Totals {
            conversations: map.len(),
            ..Totals::default()
        };
        for r in map.values() {
            t.requests += r.requests;
            t.assembled_requests += r.assembled_requests;
            t.tokens_client += r.tokens_client;
            t.tokens_sent += r.tokens_sent;
            t.tokens_active += r.tokens_active;
            t.cache_write_tokens_client += r.cache_write_tokens_client;
            t.cache_write_tokens_active += r.cache_write_tokens_active;
            t.prefix_changes += r.prefix_changes;
            t.compactions_answered += r.compactions_answered;
        }
        t.tokens_saved = t.tokens_client.saturating_sub(t.tokens_active);
        Report {
            mode,
            totals: t,
            conversations: map.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stable_block_writes_only_the_grown_tail() {
        let l = Ledger::default();
        let block = vec!["s1".to_string()];
        for (client, active) in [(100, 100), (200, 60), (300, 70), (400, 80)] {
            let act = (client > 100).then_some((active, block.as_slice()));
            l.observe(
                "c",
                Observed {
                    client_tokens: client,
                    sent_tokens: client,
                    active: act,
                },
            );
        }
        let r = l.report("shadow");
        let c = &r.conversations["c"];
        assert_eq!(c.cache_write_tokens_client, 400);
        // 100 (before the budget) + 60 (the block's first request) + 10 + 10
        assert_eq!(c.cache_write_tokens_active, 180);
        assert_eq!(c.prefix_changes, 1);
        assert_eq!(r.totals.tokens_saved, 1000 - 310);
    }
}
