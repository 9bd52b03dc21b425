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

use crate::core::identifiers;
use crate::core::state::{BodyError, ContextItem, Conversation, TurnBodies};

/// A tool group of the context as assembly lists them: items `[start,
/// end)`, sent or left out whole (no tool result without its call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Group {
    pub start: usize,
    pub end: usize,
    /// Its items' compact cost, with the stubs for results never recorded.
    pub tokens: u64,
    pub fresh: bool,
}

/// What prompt-aware eviction keeps.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Choice {
    /// Per unit (newest first, as assembly lists them): kept or not.
    pub keep: Vec<bool>,
    /// Tokens used, the prompt and the fresh tail included.
    pub used: u64,
}

/// How much an identifier of the prompt weighs against a word.
const IDENTIFIER_WEIGHT: f64 = 3.0;

/// Words that say nothing about which part of the history is meant.
const STOP_WORDS: &[&str] = &[
    "about", "after", "again", "all", "and", "any", "are", "was", "were", "been", "before", "but",
    "can", "could", "did", "does", "doing", "for", "from", "had", "has", "have", "how", "into",
    "its", "just", "not", "now", "our", "out", "said", "say", "should", "that", "the", "their",
    "them", "then", "there", "these", "they", "this", "those", "what", "when", "where", "which",
    "who", "why", "will", "with", "would", "you", "your", "tell", "give", "please", "let", "also",
    "only", "some", "more", "most", "very", "over", "than", "want", "need",
];

/// One term of a prompt or question.
#[derive(Debug, Clone, PartialEq)]
pub struct Term {
    /// Lower-cased for words, exact for identifiers.
    pub text: String,
    pub exact: bool,
    pub weight: f64,
}

/// The terms of a prompt: its identifiers (paths, hashes, ids: matched
/// exactly), then its words of three characters or more that are not stop
/// words (lower-cased).
pub fn terms(prompt: &str) -> Vec<Term> {
    let mut out: Vec<Term> = Vec::new();
    for id in identifiers::extract(prompt) {
        if !out.iter().any(|t| t.exact && t.text == id) {
            out.push(Term {
                text: id,
                exact: true,
                weight: IDENTIFIER_WEIGHT,
            });
        }
    }
    let lowered = prompt.to_lowercase();
    for word in lowered.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
        if word.chars().count() < 3 || STOP_WORDS.contains(&word) {
            continue;
        }
        if !out.iter().any(|t| !t.exact && t.text == word) {
            out.push(Term {
                text: word.to_string(),
                exact: false,
                weight: 1.0,
            });
        }
    }
    out
}

/// Occurrences of `needle` in `haystack` (non-overlapping, at most 64).
fn occurrences(haystack: &str, needle: &str) -> usize {
    haystack.match_indices(needle).take(64).count()
}

/// Each text's relevance to `terms`: per term found, its weight times its
/// inverse document frequency over `texts` (a term every text holds counts
/// for little), a little more when it is repeated. 0 for a text holding
/// none.
pub fn scores(terms: &[Term], texts: &[&str]) -> Vec<f64> {
    let mut hits: Vec<Vec<(usize, usize)>> = vec![Vec::new(); texts.len()];
    let mut df = vec![0usize; terms.len()];
    for (text, hits) in texts.iter().zip(&mut hits) {
        let lowered = text.to_lowercase();
        for (i, t) in terms.iter().enumerate() {
            let n = if t.exact {
                occurrences(text, &t.text)
            } else {
                occurrences(&lowered, &t.text)
            };
            if n > 0 {
                hits.push((i, n));
                df[i] += 1;
            }
        }
    }
    let n = texts.len() as f64;
    hits.iter()
        .map(|hits| {
            hits.iter()
                .map(|&(i, count)| {
                    let idf = ((n + 1.0) / (df[i] as f64 + 0.5)).ln().max(0.05);
                    let repeats = 1.0 + 0.25 * (count.min(9) - 1) as f64;
                    terms[i].weight * idf * repeats
                })
                .sum()
        })
        .collect()
}

/// Chooses the older units to keep by relevance to `prompt`, within
/// `budget` once `used` (prompt and fresh tail) is spent. `None` when the
/// prompt has no term to go by: assembly then keeps the newest, as always.
pub(crate) fn choose(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    prompt: &str,
    units: &[Group],
    budget: u64,
    used: u64,
) -> Result<Option<Choice>, BodyError> {
    let terms = terms(prompt);
    if terms.is_empty() {
        return Ok(None);
    }
    // The older units' texts, scored together.
    let mut older: Vec<usize> = Vec::new();
    let mut texts: Vec<String> = Vec::new();
    for (u, unit) in units.iter().enumerate() {
        if unit.fresh {
            continue;
        }
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
        older.push(u);
        texts.push(text);
    }
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let mut score = vec![0.0f64; units.len()];
    for (&u, s) in older.iter().zip(scores(&terms, &refs)) {
        score[u] = s;
    }
    let mut keep: Vec<bool> = units.iter().map(|u| u.fresh).collect();
    let mut used = used;
    // Relevant units first (best score, then newest), then the newest of
    // the rest: index order is newest first, and the sort is stable.
    let mut order = older;
    order.sort_by(|&a, &b| score[b].total_cmp(&score[a]));
    let (relevant, rest): (Vec<usize>, Vec<usize>) =
        order.into_iter().partition(|&u| score[u] > 0.0);
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
    fn a_prompt_of_stop_words_has_no_terms() {
        assert!(terms("what is it? and then?").is_empty());
    }

    #[test]
    fn a_rare_identifier_outweighs_a_common_word() {
        let t = terms("where is the config parsed in src/config/load.rs?");
        let texts = [
            "the config is read here",
            "src/config/load.rs parses it",
            "config config config",
        ];
        let s = scores(&t, &texts);
        assert!(s[1] > s[0] && s[1] > s[2], "{s:?}");
        assert_eq!(scores(&t, &["nothing relevant"]), vec![0.0]);
    }
}
