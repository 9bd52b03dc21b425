//! The deterministic summarizer: the embedded default, and the last step of
//! escalation when no model can write a summary.
//!
//! No model, no clock, no randomness: the same request always gives the same
//! text, so replays agree. It does not understand the conversation; it
//! sorts what it can recognize into sections a reader (or a model that
//! re-summarizes it later) can use:
//!
//! - **Asked**: the user turns, condensed;
//! - **Done**: assistant actions with their tool names, and tool results;
//! - **Decisions**: sentences that decide, choose or give a reason;
//! - **Open items**: TODOs, next steps, errors, failing things;
//! - **Files touched**: paths the assistant and its tools worked on;
//! - **Exact identifiers**: every opaque identifier of the source that the
//!   sections above do not already quote, as long as there is room.
//!
//! Size: it fits `target_tokens` (half of it when `aggressive`), measured with
//! the real tokenizer, and is never larger than its source. When the source
//! itself fits that size it is returned verbatim (nothing is lost); when not
//! even the structure fits, a verbatim excerpt cut to size is returned.
//! Condensed summaries merge their children's sections, line by line.
//! Instructions and the previous summary are for models; this summarizer
//! reads only the sources.
//!
//! Here: the request's budget, the identifier ranking and the header.
//! `notes` gathers candidate lines per section, `children` reads a child
//! summary back into sections, `fit` chooses what fits the budget, and
//! `rolling` writes the rolling session state.

use crate::core::event::RollingState;
use crate::core::event::SummaryKind;
use crate::core::identifiers::{self, IdentifierKind};
use crate::core::message::{Role, DEMONSTRATION_NAME};
use crate::core::summary::{
    IdentifierPolicy, RollingStateRequest, SourceItem, SummaryDraft, SummaryRequest,
    ROLLING_SECTION_MAX_CHARS, ROLLING_STATE_MAX_CHARS,
};
use crate::core::tokens::{count_text, Encoding};
use regex::Regex;
use std::collections::{BTreeSet, HashSet};
use std::sync::LazyLock;

mod children;
mod fit;
mod notes;
mod rolling;

use children::*;
use fit::*;
use notes::*;
pub use rolling::rolling_state;

/// What [`SummaryDraft::model`] says for this summarizer.
pub const MODEL: &str = "deterministic";
/// What [`SummaryDraft::provider`] says for this summarizer.
pub const PROVIDER: &str = "contextfold";
/// Part of the summary id: change it whenever the output changes.
pub const PROMPT_VERSION: &str = "det-3";

/// Sizes are measured in this encoding whatever the conversation's model:
/// the summary must be comparable with other summaries of any conversation.
const ENCODING: Encoding = Encoding::O200kBase;

/// Share of the source aimed for when a request names no target
/// (2400 tokens for a 20000-token leaf).
const DEFAULT_TARGET_PERCENT: u64 = 12;

/// At most this share of the room goes to the identifier list before the
/// narrative sections have had theirs.
const IDENTIFIER_RESERVE_PERCENT: u64 = 45;

/// Characters a condensed line keeps.
const ASK_CHARS: usize = 280;
const ACTION_CHARS: usize = 200;
const RESULT_CHARS: usize = 160;
const SENTENCE_CHARS: usize = 220;

/// Sentence mining stops after this many bytes of one item: tool outputs can
/// be whole files, and their first part says what they are.
const MINED_BYTES: usize = 6000;

/// Writes a summary of `req.sources`.
pub fn summarize(req: &SummaryRequest) -> SummaryDraft {
    SummaryDraft {
        content: write_summary(req),
        model: MODEL.to_string(),
        provider: PROVIDER.to_string(),
        prompt_version: PROMPT_VERSION.to_string(),
        fallback: true,
    }
}

fn tokens(text: &str) -> u64 {
    count_text(ENCODING, text)
}

/// The size the summary must fit: the target (or the default share of the
/// source), halved when aggressive, and never more than the source.
fn budget_of(req: &SummaryRequest) -> u64 {
    let source = req.source_tokens();
    let target = if req.target_tokens == 0 {
        source * DEFAULT_TARGET_PERCENT / 100
    } else {
        req.target_tokens
    };
    let target = if req.aggressive { target / 2 } else { target };
    target.min(source)
}

fn write_summary(req: &SummaryRequest) -> String {
    let budget = budget_of(req);
    if budget == 0 || req.sources.is_empty() {
        return String::new();
    }
    let verbatim = req
        .sources
        .iter()
        .map(|s| s.text.as_str())
        .filter(|t| !t.trim().is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    if tokens(&verbatim) <= budget {
        return verbatim;
    }
    let condensed = req.kind == SummaryKind::Condensed
        || req.depth > 0
        || req.sources.iter().all(|s| s.role.is_none());
    let notes = if condensed {
        Notes::from_children(&req.sources)
    } else {
        Notes::from_turns(&req.sources)
    };
    let ids = match req.identifier_policy {
        IdentifierPolicy::Off => Vec::new(),
        IdentifierPolicy::Strict | IdentifierPolicy::Custom(_) => ranked_identifiers(&req.sources),
    };
    let header = header_line(req, condensed);
    if let Some(text) = render_within(&notes, &ids, &header, budget) {
        return text;
    }
    truncate_to_tokens(&verbatim, budget)
}

/// The sources' identifiers, the ones that matter most first: what room
/// there is goes to them (`render_once` lists in this order).
///
/// Which matter: the ones the user named, then the ones the most sources
/// mention (a path read, edited and tested; for a condensed summary, an
/// identifier several children kept), then the newest (the work still
/// open), then the longest: a full path first, so its suffixes (`main.ts`,
/// `src/main.ts`) are already quoted by it and cost nothing. One mention in
/// one tool output (a directory listing, a file's imports) comes last. A
/// child summary lists its identifiers in this order already (its asks
/// first), so among children the best place an identifier had decides, and
/// on a tie the older child's: its first identifiers are the task the
/// session started with, while newer work is still in newer summaries.
fn ranked_identifiers(sources: &[SourceItem]) -> Vec<String> {
    struct Seen {
        by_user: bool,
        sources: u32,
        /// Best position in a child summary's own order (0 for turns).
        rank: usize,
        newest: usize,
    }
    let mut order: Vec<String> = Vec::new();
    let mut seen: std::collections::HashMap<String, Seen> = std::collections::HashMap::new();
    for (at, source) in sources.iter().enumerate() {
        let mut here: HashSet<String> = HashSet::new();
        for id in identifiers::extract(&source.text) {
            if !here.insert(id.clone()) {
                continue;
            }
            let by_user = source.role == Some(Role::User);
            let child = source.role.is_none();
            let rank = if child { here.len() } else { 0 };
            // Recency and length order turns only (see above).
            let at = if child { 0 } else { at };
            match seen.get_mut(&id) {
                Some(s) => {
                    s.by_user |= by_user;
                    s.sources += 1;
                    s.rank = s.rank.min(rank);
                    s.newest = at;
                }
                None => {
                    seen.insert(
                        id.clone(),
                        Seen {
                            by_user,
                            sources: 1,
                            rank,
                            newest: at,
                        },
                    );
                    order.push(id);
                }
            }
        }
    }
    // A stable sort: equal keys keep their first-seen order, so the same
    // sources always give the same list.
    order.sort_by(|a, b| {
        let (sa, sb) = (&seen[a], &seen[b]);
        sb.by_user
            .cmp(&sa.by_user)
            .then(sb.sources.cmp(&sa.sources))
            .then(sa.rank.cmp(&sb.rank))
            .then(sb.newest.cmp(&sa.newest))
            .then(if sa.rank == 0 && sb.rank == 0 {
                b.len().cmp(&a.len())
            } else {
                std::cmp::Ordering::Equal
            })
    });
    order
}

fn header_line(req: &SummaryRequest, condensed: bool) -> String {
    let first = req.sources.first().map_or("", |s| s.label.as_str());
    let last = req.sources.last().map_or("", |s| s.label.as_str());
    // Children are named by count, not by id: two summary ids cost some 40
    // tokens, all of a small condensed summary's room, and the DAG (and the
    // `<context_summary turns=...>` wrapper) says which they are.
    let span = if condensed && req.sources.iter().all(|s| s.role.is_none()) {
        format!("{} summaries", req.sources.len())
    } else if first == last {
        first.to_string()
    } else {
        format!("{first} … {last}")
    };
    let what = if condensed {
        format!("Condensed summary (depth {})", req.depth)
    } else {
        "Summary".to_string()
    };
    format!(
        "{what} of {span} ({} items, {} tokens); deterministic fallback {PROMPT_VERSION}, to be re-summarized.",
        req.sources.len(),
        req.source_tokens()
    )
}

#[cfg(test)]
mod tests;
