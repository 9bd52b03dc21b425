//! The deterministic summarizer: the embedded default, and the last step of
//! escalation when no model can write a summary.
//!
//! No model, no clock, no randomness: the same request always gives the same
//! text, so replays agree. It does not understand the conversation; it
//! writes the handover an agent resuming the work needs, from what it can
//! recognize (the `signals` module):
//!
//! - **Task (the user's words)**: each request, whole sentences;
//! - **Files changed**: each file an edit, a write, a patch or a removal
//!   touched, in which turns, and what changed (the agent's words for the
//!   edit, the first line it added);
//! - **Errors and fixes**: each failure (a tool's, or one the user pasted)
//!   and the agent's words right after it;
//! - **Decisions**: sentences that decide, choose or give a reason;
//! - **Done**: milestones (tests passing, commits, pushes, tasks closed,
//!   actions such as a booking changed);
//! - **Open** and **Next**: what is left, and the newest next step (or
//!   the user's newest request when they spoke last);
//! - **Exact identifiers**: identifiers the lines above do not quote,
//!   ranked by use (changed or run, named by the user, mentioned more,
//!   newer), as room allows.
//!
//! No tool-call JSON, no code line as a finding, no sentence cut in the
//! middle. Size: it fits `target_tokens` (half of it when `aggressive`),
//! measured with the real tokenizer, and is never larger than its source.
//! When the source itself fits that size it is returned verbatim (nothing
//! is lost); when not even the structure fits, a verbatim excerpt cut to
//! size is returned. Condensed summaries merge their children's sections
//! (a file changed in several children is one line); only the newest
//! child's next step is kept. Instructions and the previous summary are for
//! models; this summarizer reads only the sources.
//!
//! Here: the request's budget, the identifier ranking and the header.
//! `notes` gathers candidate lines per section, `children` reads a child
//! summary back into sections, `fit` chooses what fits the budget, and
//! `rolling` writes the rolling session state.

use crate::core::event::RollingState;
use crate::core::event::SummaryKind;
use crate::core::identifiers;
use crate::core::line_pattern::LinePattern;
use crate::core::message::{Role, DEMONSTRATION_NAME};
use crate::core::summary::{
    IdentifierPolicy, RollingStateRequest, SourceItem, SourceReading, SummaryDraft, SummaryRequest,
    ROLLING_SECTION_MAX_CHARS, ROLLING_STATE_MAX_CHARS,
};
use crate::core::tokens::{
    count_text, count_text_kept, count_within, fewest_tokens_up_to, Encoding,
};
use regex::Regex;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::LazyLock;

mod call_args;
mod children;
mod fit;
mod lines;
mod notes;
mod reading;
mod rolling;
mod signals;
mod turn;

use children::*;
use fit::*;
pub use lines::{ascending, lines, Lowered, Screen};
use notes::*;
pub use notes::{has_alphanumerics, is_listing_line, prefix_bytes};
pub use reading::read_source;
#[cfg(test)]
pub(crate) use reading::reading_used;
pub use rolling::rolling_state;

/// What [`SummaryDraft::model`] says for this summarizer.
pub const MODEL: &str = "deterministic";
/// What [`SummaryDraft::provider`] says for this summarizer.
pub const PROVIDER: &str = "contextfold";
/// Part of the summary id: change it whenever the output changes.
pub const PROMPT_VERSION: &str = "det-4";

/// Sizes are measured in this encoding whatever the conversation's model:
/// the summary must be comparable with other summaries of any conversation.
const ENCODING: Encoding = Encoding::O200kBase;

/// Share of the source aimed for when a request names no target
/// (2400 tokens for a 20000-token leaf).
const DEFAULT_TARGET_PERCENT: u64 = 12;

/// At most this share of the room goes to the identifier list before the
/// narrative sections have had theirs.
const IDENTIFIER_RESERVE_PERCENT: u64 = 30;

/// Characters a line keeps: a user request (whole sentences; a shorter
/// form when room is short), an error line, a sentence, the agent's words
/// after an error (how it met it), a command.
const ASK_CHARS: usize = 400;
const SHORT_ASK_CHARS: usize = 160;
const RESULT_CHARS: usize = 160;
const SENTENCE_CHARS: usize = 220;
const FIX_CHARS: usize = 200;
const COMMAND_CHARS: usize = 60;

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
    let texts = || {
        req.sources
            .iter()
            .map(|s| s.text.as_str())
            .filter(|t| !t.trim().is_empty())
    };
    let verbatim = || texts().collect::<Vec<_>>().join("\n");
    // Usually far over, and the ends of the sources' words alone show it
    // (the line breaks that would join them end a word as the join's end
    // does: `fewest_tokens_up_to`), so they are neither joined nor
    // counted; else counted only as far as the budget.
    let mut fewest = 0u64;
    for text in texts() {
        if fewest > budget {
            break;
        }
        fewest += fewest_tokens_up_to(text, budget - fewest);
    }
    if fewest <= budget {
        let verbatim = verbatim();
        if count_within(ENCODING, &verbatim, budget).is_some() {
            return verbatim;
        }
    }
    let condensed = req.kind == SummaryKind::Condensed
        || req.depth > 0
        || req.sources.iter().all(|s| s.role.is_none());
    // Each source's reading checked once for both its notes and its
    // identifiers.
    let readings = reading::readings_of(&req.sources);
    let notes = if condensed {
        Notes::from_children(&req.sources)
    } else {
        Notes::from_turns_read(&req.sources, &readings)
    };
    let ids = match req.identifier_policy {
        IdentifierPolicy::Off => Vec::new(),
        IdentifierPolicy::Strict | IdentifierPolicy::Custom(_) => {
            ranked_identifiers(&req.sources, &readings)
        }
    };
    let header = header_line(req, condensed);
    if let Some(text) = render_within(&notes, &ids, &header, budget) {
        return text;
    }
    truncate_to_tokens(&verbatim(), budget)
}

/// The sources' identifiers, the ones that matter most first: what room
/// there is goes to them (`render_once` lists in this order).
///
/// Which matter, by use: the ones the work acted on (the arguments of a
/// call that edits a file, runs a command or changes something), then the
/// ones the user named, then the ones the most sources mention (a path
/// read, edited and tested; for a condensed summary, an identifier several
/// children kept), then the newest (the work still open), then the
/// longest: a full path first, so its suffixes (`main.ts`, `src/main.ts`)
/// are already quoted by it and cost nothing. A listing (a glob, `ls`,
/// `find`, a search's hits) does not count as a mention: 34 theme files
/// one glob printed are not what the work was about. A child summary
/// lists its identifiers in this order already, so among children the
/// best place an identifier had decides, and on a tie the older child's:
/// its first identifiers are the task the session started with, while
/// newer work is still in newer summaries.
fn ranked_identifiers(sources: &[SourceItem], readings: &[Option<&SourceReading>]) -> Vec<String> {
    struct Seen {
        acted_on: bool,
        by_user: bool,
        sources: u32,
        /// Best position in a child summary's own order (0 for turns).
        rank: usize,
        newest: usize,
    }
    // Read ahead when it was (`reading`); all held at once, so the
    // identifiers are borrowed from them, not copied.
    let readings: Vec<_> = sources
        .iter()
        .zip(readings)
        .map(|(item, reading)| reading::identifiers_of(item, *reading))
        .collect();
    // Each identifier once, in first-seen order, with where it is in it.
    let mut order: Vec<(&str, Seen)> = Vec::new();
    let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    // Names of the calls whose results come next, in order.
    let mut pending: std::collections::VecDeque<&str> = Default::default();
    // Per source: the identifiers its turn acted on, and those it named
    // so far (both reused from source to source).
    let (mut acted, mut here): (HashSet<&str>, HashSet<&str>) = Default::default();
    for (at, (source, read)) in sources.iter().zip(&readings).enumerate() {
        acted.clear();
        acted.extend(read.acted.iter().map(String::as_str));
        let mut listing = false;
        match source.role {
            Some(Role::Assistant) => {
                pending.clear();
                pending.extend(read.calls.iter().map(String::as_str));
            }
            Some(Role::Tool) => {
                let name = pending.pop_front().or(source.tool.as_deref());
                listing = name.is_some_and(signals::is_listing_tool);
            }
            _ => pending.clear(),
        }
        here.clear();
        for id in &read.identifiers {
            let id = id.as_str();
            if !here.insert(id) {
                continue;
            }
            let by_user = source.role == Some(Role::User);
            let acted_on = acted.contains(id);
            let child = source.role.is_none();
            let rank = if child { here.len() } else { 0 };
            // Recency and length order turns only (see above).
            let at = if child { 0 } else { at };
            let mention = u32::from(!listing);
            match seen.get(id) {
                Some(&i) => {
                    let s = &mut order[i].1;
                    s.acted_on |= acted_on;
                    s.by_user |= by_user;
                    s.sources += mention;
                    s.rank = s.rank.min(rank);
                    s.newest = at;
                }
                None => {
                    seen.insert(id, order.len());
                    order.push((
                        id,
                        Seen {
                            acted_on,
                            by_user,
                            sources: mention,
                            rank,
                            newest: at,
                        },
                    ));
                }
            }
        }
    }
    // A stable sort: equal keys keep their first-seen order, so the same
    // sources always give the same list.
    order.sort_by(|(a, sa), (b, sb)| {
        sb.acted_on
            .cmp(&sa.acted_on)
            .then(sb.by_user.cmp(&sa.by_user))
            .then(sb.sources.cmp(&sa.sources))
            .then(sa.rank.cmp(&sb.rank))
            .then(sb.newest.cmp(&sa.newest))
            .then(if sa.rank == 0 && sb.rank == 0 {
                b.len().cmp(&a.len())
            } else {
                std::cmp::Ordering::Equal
            })
    });
    order.into_iter().map(|(id, _)| id.to_string()).collect()
}

/// What code can check a summary of some sources keeps, so that a model's
/// summary can be held to at least what the deterministic one keeps: the
/// user's requests, the errors that came up and the decisions taken (each
/// as its content words) and the files changed (each by its name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandoverFacts {
    pub requests: Vec<Vec<String>>,
    pub files: Vec<String>,
    pub errors: Vec<Vec<String>>,
    pub decisions: Vec<Vec<String>>,
}

/// One fact of [`HandoverFacts`], as [`HandoverFacts::each`] yields it:
/// a request, an error or a decision by its content words, a file changed
/// by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fact<'a> {
    Request(&'a [String]),
    Error(&'a [String]),
    Decision(&'a [String]),
    File(&'a str),
}

impl Fact<'_> {
    /// Whether `lower` (a lower-cased text) keeps this fact: a request or
    /// a decision when a third of its words are there; an error when two
    /// of them are, or a third of fewer (a summary names an error by its
    /// gist, not its whole line), and its identifiers (an exception's
    /// name, an error code) when it has any; a file when its name is.
    pub fn kept_in(&self, lower: &str) -> bool {
        let found = |terms: &[String]| terms.iter().filter(|t| lower.contains(t.as_str())).count();
        match *self {
            Fact::Request(terms) | Fact::Decision(terms) => found(terms) >= terms.len().div_ceil(3),
            Fact::Error(terms) => {
                found(terms) >= terms.len().div_ceil(3).min(2)
                    && terms
                        .iter()
                        .filter(|t| is_error_name(t))
                        .all(|t| lower.contains(t.as_str()))
            }
            Fact::File(name) => lower.contains(&name.to_lowercase()),
        }
    }

    /// How a rejection names it: `the error "connection refused 10.0.4.17…"`.
    pub fn describe(&self) -> String {
        let (what, terms) = match *self {
            Fact::Request(terms) => ("request", terms),
            Fact::Error(terms) => ("error", terms),
            Fact::Decision(terms) => ("decision", terms),
            Fact::File(name) => return format!("the file {name}"),
        };
        format!("the {what} \"{}…\"", terms[..terms.len().min(4)].join(" "))
    }
}

/// An error's own name among its terms: an exception or error type
/// (`attributeerror`, `enoent`, `e0502`), lower-cased as terms are.
fn is_error_name(term: &str) -> bool {
    let t = term.trim_matches(|c: char| !c.is_alphanumeric());
    (t.len() > 5 && (t.ends_with("error") || t.ends_with("exception")) && !t.contains(['/', '.']))
        || (t.len() >= 4 && t.starts_with('e') && t[1..].chars().all(|c| c.is_ascii_digit()))
}

impl HandoverFacts {
    /// The facts of `sources` (turns, or child summaries when they are all
    /// summaries).
    pub fn of(sources: &[SourceItem]) -> HandoverFacts {
        let notes = if !sources.is_empty() && sources.iter().all(|s| s.role.is_none()) {
            Notes::from_children(sources)
        } else {
            Notes::from_turns(sources)
        };
        let mut files: Vec<String> = Vec::new();
        for f in &notes.files {
            // The path of a move is its destination.
            let path = f.path.rsplit(" -> ").next().unwrap_or(&f.path);
            let name = path.rsplit('/').next().unwrap_or(path).to_string();
            if name.len() > 2 && !files.contains(&name) {
                files.push(name);
            }
        }
        let terms_of = |lines: &[Line], short: bool| -> Vec<Vec<String>> {
            lines
                .iter()
                .map(|l| {
                    let text = if short {
                        l.short.as_deref().unwrap_or(&l.text)
                    } else {
                        &l.text
                    };
                    content_terms(strip_label(text))
                })
                .filter(|t| !t.is_empty())
                .collect()
        };
        HandoverFacts {
            requests: terms_of(&notes.task, false),
            files,
            // An error by what went wrong, not by the command that met it.
            errors: terms_of(&notes.errors, true),
            decisions: terms_of(&notes.decisions, false),
        }
    }

    /// Every fact, in a fixed order: requests, errors, decisions, files.
    pub fn each(&self) -> impl Iterator<Item = Fact<'_>> {
        self.requests
            .iter()
            .map(|t| Fact::Request(t))
            .chain(self.errors.iter().map(|t| Fact::Error(t)))
            .chain(self.decisions.iter().map(|t| Fact::Decision(t)))
            .chain(self.files.iter().map(|f| Fact::File(f.as_str())))
    }
}

/// The words of a request that carry its meaning: its identifiers, and
/// words of four letters or more that are not glue, lower-cased; at most
/// 12.
fn content_terms(text: &str) -> Vec<String> {
    const GLUE: &[&str] = &[
        "that", "this", "with", "from", "have", "what", "when", "then", "there", "they", "them",
        "their", "would", "could", "should", "about", "into", "also", "just", "like", "want",
        "need", "please", "make", "sure", "some", "more", "very", "only", "which", "will", "does",
        "doing", "been", "were", "your", "here", "than", "each", "other",
    ];
    let mut out: Vec<String> = identifiers::extract(text)
        .into_iter()
        .map(|i| i.to_lowercase())
        .collect();
    for w in text
        .to_lowercase()
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
    {
        if w.chars().count() >= 4
            && w.chars().all(char::is_alphabetic)
            && !GLUE.contains(&w)
            && !out.iter().any(|o| o == w)
        {
            out.push(w.to_string());
        }
    }
    out.truncate(12);
    out
}

/// Matches the header line the deterministic summary opens with (what
/// `header_line` writes), wherever a text holds it (a model may copy it
/// from the previous summary it is shown), with its line end.
pub fn header_pattern() -> &'static Regex {
    lazy_regex::regex!(
        r"(?m)^[#>*_ ]*(?:Condensed summary \(depth \d+\)|Summary) of [^\n]*; deterministic [^\n]*(?:\n|$)"
    )
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
    format!("{what} of {span}; deterministic {PROMPT_VERSION}.")
}

#[cfg(test)]
mod tests;
