//! `grep`: recall by text. Searches the raw turns (text content and tool
//! calls) and the summaries of one conversation, plain text or a regular
//! expression (the `regex` crate: linear time, with compiled-size limits so
//! a hostile pattern is refused, not run), and says for each turn matched
//! which summary now stands for it in context.

use crate::api::coverage::{Coverage, TurnPlacement};
use crate::api::{clip, conversation, ApiError};
use crate::core::event::SummaryKind;
use crate::core::message::Role;
use crate::core::state::{State, TurnBodies};
use regex::{Regex, RegexBuilder};
use serde::{Deserialize, Serialize};

pub const DEFAULT_LIMIT: usize = 50;
pub const MAX_LIMIT: usize = 500;
/// Longest pattern accepted, in bytes.
pub const MAX_PATTERN_BYTES: usize = 1024;
/// Compiled program size allowed (regex `size_limit`).
pub const REGEX_SIZE_LIMIT: usize = 1 << 20;
/// Lazy-DFA cache allowed (regex `dfa_size_limit`).
pub const REGEX_DFA_SIZE_LIMIT: usize = 2 << 20;
/// Characters of context either side of a match in a snippet.
pub const SNIPPET_CONTEXT_CHARS: usize = 60;
/// Longest matched text quoted in a snippet.
pub const MAX_MATCH_CHARS: usize = 200;
/// Occurrences counted per item before giving up counting.
pub const MAX_COUNTED_OCCURRENCES: usize = 1000;

/// What to search.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GrepScope {
    Turns,
    Summaries,
    #[default]
    All,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrepRequest {
    pub conversation: String,
    pub pattern: String,
    /// `pattern` is a regular expression (default: plain text).
    #[serde(default)]
    pub regex: bool,
    #[serde(default)]
    pub ignore_case: bool,
    /// Items returned at most (default 50, at most 500).
    #[serde(default)]
    pub limit: Option<usize>,
    #[serde(default)]
    pub scope: GrepScope,
}

/// Where a match was found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MatchSource {
    Turn {
        seq: u64,
        event_id: String,
        role: Role,
        time: u64,
        #[serde(flatten)]
        placement: TurnPlacement,
    },
    Summary {
        summary_id: String,
        summary_kind: SummaryKind,
        depth: u32,
        first_turn: u64,
        last_turn: u64,
        in_context: bool,
        /// The condensed summary above it, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<String>,
        fallback: bool,
    },
}

/// One matched item (a turn or a summary), with its first match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrepMatch {
    #[serde(flatten)]
    pub source: MatchSource,
    /// Occurrences in this item (counting stops at 1000).
    pub occurrences: usize,
    /// Byte offset of the first match in the searched text.
    pub offset: usize,
    /// The first match, with up to 60 characters either side.
    pub snippet: String,
    /// The matched text itself (cut at 200 characters).
    pub matched: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrepResponse {
    pub conversation: String,
    pub pattern: String,
    pub regex: bool,
    pub scope: GrepScope,
    pub limit: usize,
    pub matches: Vec<GrepMatch>,
    /// More items matched than `limit`.
    pub truncated: bool,
    pub turns_searched: usize,
    pub summaries_searched: usize,
}

/// Compiles a request's pattern under the size limits.
pub fn compile(pattern: &str, regex: bool, ignore_case: bool) -> Result<Regex, ApiError> {
    if pattern.is_empty() {
        return Err(ApiError::BadRequest("`pattern` is empty".into()));
    }
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err(ApiError::BadRequest(format!(
            "pattern of {} bytes exceeds the {MAX_PATTERN_BYTES}-byte limit",
            pattern.len()
        )));
    }
    let source = if regex {
        pattern.to_string()
    } else {
        regex::escape(pattern)
    };
    let re = RegexBuilder::new(&source)
        .case_insensitive(ignore_case)
        .size_limit(REGEX_SIZE_LIMIT)
        .dfa_size_limit(REGEX_DFA_SIZE_LIMIT)
        .build()
        .map_err(|e| match e {
            regex::Error::CompiledTooBig(limit) => ApiError::BadRequest(format!(
                "pattern compiles to more than {limit} bytes; use a simpler pattern (fewer repetitions, smaller counted repeats)"
            )),
            other => ApiError::BadRequest(format!("invalid regular expression: {other}")),
        })?;
    if re.is_match("") {
        return Err(ApiError::BadRequest(format!(
            "pattern {pattern:?} matches the empty string, so it would match everything; make it require at least one character"
        )));
    }
    Ok(re)
}

/// The snippet around `text[start..end]`, on one line.
fn snippet(text: &str, start: usize, end: usize) -> String {
    let from = text[..start]
        .char_indices()
        .rev()
        .nth(SNIPPET_CONTEXT_CHARS - 1)
        .map_or(0, |(i, _)| i);
    let to = text[end..]
        .char_indices()
        .nth(SNIPPET_CONTEXT_CHARS)
        .map_or(text.len(), |(i, _)| end + i);
    let mut out = String::with_capacity(to - from + 8);
    if from > 0 {
        out.push('…');
    }
    out.push_str(&text[from..start]);
    out.push_str(&clip(&text[start..end], MAX_MATCH_CHARS));
    out.push_str(&text[end..to]);
    if to < text.len() {
        out.push('…');
    }
    out.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

fn first_match(re: &Regex, text: &str) -> Option<(usize, usize, String, String)> {
    let m = re.find(text)?;
    let occurrences = re.find_iter(text).take(MAX_COUNTED_OCCURRENCES).count();
    Some((
        occurrences,
        m.start(),
        snippet(text, m.start(), m.end()),
        clip(m.as_str(), MAX_MATCH_CHARS),
    ))
}

pub fn grep(
    state: &State,
    bodies: &dyn TurnBodies,
    req: &GrepRequest,
) -> Result<GrepResponse, ApiError> {
    let conv = conversation(state, &req.conversation)?;
    let limit = req.limit.unwrap_or(DEFAULT_LIMIT);
    if limit == 0 || limit > MAX_LIMIT {
        return Err(ApiError::BadRequest(format!(
            "`limit` must be between 1 and {MAX_LIMIT} (got {limit})"
        )));
    }
    let re = compile(&req.pattern, req.regex, req.ignore_case)?;
    let coverage = Coverage::new(conv)?;
    let want_turns = req.scope != GrepScope::Summaries;
    let want_summaries = req.scope != GrepScope::Turns;

    // Reading order: a summary comes just before the first turn it covers
    // (deeper ones first), so results read like the conversation.
    let mut summaries: Vec<usize> = if want_summaries {
        (0..conv.summaries.len()).collect()
    } else {
        Vec::new()
    };
    summaries.sort_by_key(|&i| {
        let s = &conv.summaries[i];
        (s.first_turn, std::cmp::Reverse(s.depth), i)
    });
    let mut next_summary = summaries.iter().peekable();
    let mut matches = Vec::new();
    let mut truncated = false;
    let (mut turns_searched, mut summaries_searched) = (0, 0);
    let mut push = |m: GrepMatch, matches: &mut Vec<GrepMatch>| {
        if matches.len() == limit {
            truncated = true;
            false
        } else {
            matches.push(m);
            true
        }
    };
    let turn_count = if want_turns { conv.turns.len() } else { 0 };
    'walk: for seq in 0..=turn_count {
        while let Some(&&i) = next_summary.peek() {
            let s = &conv.summaries[i];
            if seq < turn_count && s.first_turn > seq as u64 {
                break;
            }
            next_summary.next();
            summaries_searched += 1;
            let text = bodies.summary_text(conv, i as u32)?;
            if let Some((occurrences, offset, snippet, matched)) = first_match(&re, &text) {
                let m = GrepMatch {
                    source: MatchSource::Summary {
                        summary_id: s.id.clone(),
                        summary_kind: s.kind,
                        depth: s.depth,
                        first_turn: s.first_turn,
                        last_turn: s.last_turn,
                        in_context: coverage.summary_in_context(&s.id),
                        parent: conv.parent_of(&s.id).map(|p| p.id.clone()),
                        fallback: s.fallback,
                    },
                    occurrences,
                    offset,
                    snippet,
                    matched,
                };
                if !push(m, &mut matches) {
                    break 'walk;
                }
            }
        }
        let Some(t) = conv.turns.get(seq).filter(|_| want_turns) else {
            continue;
        };
        turns_searched += 1;
        let body = bodies.turn_body(conv, t.seq)?;
        let text = body.message.searchable_text();
        if let Some((occurrences, offset, snippet, matched)) = first_match(&re, &text) {
            let m = GrepMatch {
                source: MatchSource::Turn {
                    seq: t.seq,
                    event_id: body.event_id.to_string(),
                    role: t.role,
                    time: t.time,
                    placement: coverage.turn(t),
                },
                occurrences,
                offset,
                snippet,
                matched,
            };
            if !push(m, &mut matches) {
                break 'walk;
            }
        }
    }
    Ok(GrepResponse {
        conversation: conv.key.clone(),
        pattern: req.pattern.clone(),
        regex: req.regex,
        scope: req.scope,
        limit,
        matches,
        truncated,
        turns_searched,
        summaries_searched,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::{self, CONV, NEEDLE};
    use crate::core::state::Resident;

    fn req(pattern: &str) -> GrepRequest {
        GrepRequest {
            conversation: CONV.into(),
            pattern: pattern.into(),
            regex: false,
            ignore_case: false,
            limit: None,
            scope: GrepScope::All,
        }
    }

    #[test]
    fn finds_an_early_turn_and_the_summary_that_covers_it() {
        let (state, _) = testing::folded();
        let out = grep(state, &Resident, &req(NEEDLE)).unwrap();
        let turn = out
            .matches
            .iter()
            .find_map(|m| match &m.source {
                MatchSource::Turn { seq, placement, .. } => Some((*seq, placement.clone(), m)),
                _ => None,
            })
            .expect("the needle's turn");
        assert_eq!(turn.0, 0);
        assert!(!turn.1.in_context);
        let cover = turn.1.covered_by.clone().expect("summarized by now");
        let conv = testing::conv(state);
        let s = &conv.summaries[conv.summary_index(&cover).unwrap() as usize];
        assert!(s.first_turn == 0);
        assert!(turn.2.snippet.contains(NEEDLE), "{}", turn.2.snippet);
        assert_eq!(turn.2.matched, NEEDLE);
    }

    #[test]
    fn summaries_come_before_the_turns_they_cover() {
        let (state, _) = testing::folded();
        // File paths are identifiers: the deterministic summaries keep them.
        let out = grep(state, &Resident, &req("src/billing/invoice.rs")).unwrap();
        assert!(
            matches!(out.matches[0].source, MatchSource::Summary { depth, .. } if depth >= 1),
            "{:#?}",
            out.matches
        );
        let mut last_turn_seen = None;
        for m in &out.matches {
            match &m.source {
                MatchSource::Summary { first_turn, .. } => {
                    assert!(last_turn_seen.is_none_or(|t| t < *first_turn));
                }
                MatchSource::Turn { seq, .. } => last_turn_seen = Some(*seq),
            }
        }
        assert!(last_turn_seen.is_some(), "the turn itself matches too");
    }

    #[test]
    fn tool_call_arguments_are_searched() {
        let (state, _) = testing::folded();
        let out = grep(state, &Resident, &req("src/billing/f37.rs")).unwrap();
        let roles: Vec<Role> = out
            .matches
            .iter()
            .filter_map(|m| match &m.source {
                MatchSource::Turn { role, .. } => Some(*role),
                _ => None,
            })
            .collect();
        assert_eq!(roles, vec![Role::Assistant], "{:#?}", out.matches);
    }

    #[test]
    fn regex_scope_limit_and_truncation() {
        let (state, _) = testing::folded();
        let mut r = req(r"step \d+:");
        r.regex = true;
        r.scope = GrepScope::Turns;
        let all = grep(state, &Resident, &r).unwrap();
        assert!(!all.truncated);
        assert_eq!(all.matches.len(), 20, "10 user steps and 10 answers");
        assert!(all
            .matches
            .iter()
            .all(|m| matches!(m.source, MatchSource::Turn { .. })));
        r.limit = Some(3);
        let few = grep(state, &Resident, &r).unwrap();
        assert!(few.truncated);
        assert_eq!(few.matches, all.matches[..3].to_vec());
        r.scope = GrepScope::Summaries;
        r.limit = None;
        let sums = grep(state, &Resident, &r).unwrap();
        assert_eq!(sums.turns_searched, 0);
        assert!(sums
            .matches
            .iter()
            .all(|m| matches!(m.source, MatchSource::Summary { .. })));
    }

    #[test]
    fn plain_text_is_literal_and_case_can_be_ignored() {
        let (state, _) = testing::folded();
        // `.` is literal in plain mode.
        assert!(!grep(state, &Resident, &req("invoice.rs"))
            .unwrap()
            .matches
            .is_empty());
        assert!(grep(state, &Resident, &req("invoiceXrs"))
            .unwrap()
            .matches
            .is_empty());
        assert!(grep(state, &Resident, &req("ROTATE THE"))
            .unwrap()
            .matches
            .is_empty());
        let mut r = req("ROTATE THE");
        r.ignore_case = true;
        assert!(!grep(state, &Resident, &r).unwrap().matches.is_empty());
    }

    #[test]
    fn bad_patterns_and_limits_are_refused_clearly() {
        let (state, _) = testing::folded();
        let err = |r: GrepRequest| match grep(state, &Resident, &r) {
            Err(ApiError::BadRequest(m)) => m,
            other => panic!("expected bad_request, got {other:?}"),
        };
        let mut r = req("(unclosed");
        r.regex = true;
        assert!(err(r).contains("invalid regular expression"));
        let mut r = req(r"\w{1000}\w{1000}\w{1000}");
        r.regex = true;
        assert!(err(r).contains("compiles to more than"));
        assert!(err(req(&"x".repeat(MAX_PATTERN_BYTES + 1))).contains("limit"));
        let mut r = req("a*");
        r.regex = true;
        assert!(err(r).contains("empty string"));
        assert!(err(req("")).contains("empty"));
        let mut r = req("x");
        r.limit = Some(MAX_LIMIT + 1);
        assert!(err(r).contains("between 1 and 500"));
    }

    #[test]
    fn snippets_stay_on_char_boundaries_and_one_line() {
        let text = format!("{}é\nneedle\n{}", "ü".repeat(100), "ß".repeat(100));
        let start = text.find("needle").unwrap();
        let s = snippet(&text, start, start + 6);
        assert!(s.starts_with('…') && s.ends_with('…'), "{s}");
        assert!(!s.contains('\n'));
        assert_eq!(s.chars().count(), 2 + 60 + 6 + 60);
    }
}
