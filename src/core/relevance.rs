//! Prompt-aware eviction: which older context items to keep, by relevance
//! to the prompt about to be sent, when they do not all fit the budget.
//!
//! Off unless a request asks for it (`prompt_aware_eviction`). Assembly
//! keeps the fresh tail whole and, by default, the newest older items that
//! fit. With this on, the older tool groups (units) are scored against the
//! prompt's terms and the most relevant are kept first; the room left goes
//! to the newest of the others, as before. Deterministic and pure: the
//! same state and prompt give the same choice; no model, no clock.
//!
//! Scoring is lexical: each distinct prompt term (words of three characters
//! or more that are not stop words, and the prompt's identifiers: paths,
//! hashes, ids) found in a unit adds its inverse document frequency over
//! the older units, so a term every unit has counts for little and a path
//! only one unit names decides. It costs a read of every older unit's
//! bodies, which is why it is asked for, not always on.

use crate::core::assembly::Unit;
use crate::core::identifiers;
use crate::core::state::{BodyError, ContextItem, Conversation, TurnBodies};
use std::collections::BTreeSet;

/// What prompt-aware eviction keeps.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Choice {
    /// Per unit (newest first, as assembly lists them): kept or not.
    pub keep: Vec<bool>,
    /// Tokens used, the prompt and the fresh tail included.
    pub used: u64,
}

/// Words too common to say what a prompt is about.
const STOP_WORDS: &[&str] = &[
    "the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her", "was",
    "one", "our", "out", "has", "have", "what", "when", "where", "which", "who", "why", "how",
    "this", "that", "these", "those", "with", "from", "into", "about", "then", "than", "them",
    "they", "there", "their", "will", "would", "could", "should", "does", "did", "done", "been",
    "being", "were", "your", "yours", "just", "also", "only", "some", "more", "most", "such",
    "very", "over", "again", "let", "lets", "please", "now", "use", "using", "make", "need",
    "want", "get", "got", "its", "it's", "i'm", "don't",
];

/// The prompt's distinct terms, lowercased, in first-seen order.
pub fn terms(prompt: &str) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for id in identifiers::extract(prompt) {
        let t = id.to_lowercase();
        if seen.insert(t.clone()) {
            out.push(t);
        }
    }
    for word in prompt.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '\'')) {
        let w = word.trim_matches('\'').to_lowercase();
        if w.chars().count() < 3 || STOP_WORDS.contains(&w.as_str()) {
            continue;
        }
        if seen.insert(w.clone()) {
            out.push(w);
        }
    }
    out
}

/// Chooses the older units to keep by relevance to `prompt`, within
/// `budget` once `used` (prompt and fresh tail) is spent. `None` when the
/// prompt has no term to go by: assembly then keeps the newest, as always.
pub(crate) fn choose(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    prompt: &str,
    units: &[Unit],
    budget: u64,
    used: u64,
) -> Result<Option<Choice>, BodyError> {
    let terms = terms(prompt);
    if terms.is_empty() {
        return Ok(None);
    }
    // Which terms each older unit holds.
    let mut holds: Vec<Vec<usize>> = vec![Vec::new(); units.len()];
    let mut df = vec![0u32; terms.len()];
    let mut older = 0u32;
    for (u, unit) in units.iter().enumerate() {
        if unit.fresh {
            continue;
        }
        older += 1;
        let mut text = String::new();
        for i in unit.start..unit.end {
            match conv.context[i] {
                ContextItem::Turn(seq) => {
                    text.push_str(&bodies.turn_body(conv, seq)?.message.searchable_text());
                }
                ContextItem::Summary(s) => text.push_str(&bodies.summary_text(conv, s)?),
            }
            text.push('\n');
        }
        let text = text.to_lowercase();
        for (t, term) in terms.iter().enumerate() {
            if text.contains(term.as_str()) {
                holds[u].push(t);
                df[t] += 1;
            }
        }
    }
    let idf: Vec<f64> = df
        .iter()
        .map(|&d| ((1.0 + f64::from(older)) / (1.0 + f64::from(d))).ln() + 1e-9)
        .collect();
    let score = |u: usize| -> f64 { holds[u].iter().map(|&t| idf[t]).sum() };
    let mut keep: Vec<bool> = units.iter().map(|u| u.fresh).collect();
    let mut used = used;
    // Relevant units first (best score, then newest), then the newest of
    // the rest: index order is newest first, and the sort is stable.
    let mut order: Vec<usize> = (0..units.len()).filter(|&u| !units[u].fresh).collect();
    order.sort_by(|&a, &b| score(b).total_cmp(&score(a)));
    let (relevant, rest): (Vec<usize>, Vec<usize>) =
        order.into_iter().partition(|&u| !holds[u].is_empty());
    let mut rest = rest;
    rest.sort_unstable();
    for u in relevant.into_iter().chain(rest) {
        if used + units[u].tokens <= budget {
            used += units[u].tokens;
            keep[u] = true;
        }
    }
    Ok(Some(Choice { keep, used }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_drop_stop_words_and_keep_identifiers() {
        let t = terms("What did we decide about src/billing/invoice.rs and the K-7731 token?");
        assert!(t.contains(&"src/billing/invoice.rs".to_string()), "{t:?}");
        assert!(t.contains(&"decide".to_string()), "{t:?}");
        assert!(t.contains(&"token".to_string()), "{t:?}");
        assert!(!t.contains(&"the".to_string()), "{t:?}");
        assert!(!t.contains(&"what".to_string()), "{t:?}");
    }

    #[test]
    fn a_prompt_of_stop_words_has_no_terms() {
        assert!(terms("what is it? and then?").is_empty());
    }
}
