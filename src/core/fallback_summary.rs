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

use crate::core::event::RollingState;
use crate::core::event::SummaryKind;
use crate::core::identifiers::{self, IdentifierKind};
use crate::core::message::Role;
use crate::core::summary::{
    IdentifierPolicy, RollingStateRequest, SourceItem, SummaryDraft, SummaryRequest,
    ROLLING_SECTION_MAX_CHARS, ROLLING_STATE_MAX_CHARS,
};
use crate::core::tokens::{count_text, Encoding};
use regex::Regex;
use std::collections::{BTreeSet, HashSet};
use std::sync::LazyLock;

/// What [`SummaryDraft::model`] says for this summarizer.
pub const MODEL: &str = "deterministic";
/// What [`SummaryDraft::provider`] says for this summarizer.
pub const PROVIDER: &str = "contextfold";
/// Part of the summary id: change it whenever the output changes.
pub const PROMPT_VERSION: &str = "det-2";

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

// ---- notes: candidate lines per section ----

/// Which lines of a section to keep first when not all fit.
#[derive(Clone, Copy)]
enum Keep {
    /// The first and the last, then inwards: how it started and where it is.
    Ends,
    /// The newest first: what is still current.
    Newest,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
enum SectionId {
    Asked,
    Done,
    Decisions,
    Open,
    Files,
}

impl SectionId {
    fn heading(self) -> &'static str {
        match self {
            SectionId::Asked => "## Asked",
            SectionId::Done => "## Done",
            SectionId::Decisions => "## Decisions",
            SectionId::Open => "## Open items",
            SectionId::Files => "## Files touched",
        }
    }
}

/// One group of candidate lines (a section may have two: Done has actions
/// and, kept after them, tool results).
struct Group {
    section: SectionId,
    keep: Keep,
    /// Percent of the narrative room this group gets in the first pass.
    share: u64,
    /// (source position, line) in source order.
    lines: Vec<(usize, String)>,
}

#[derive(Default)]
struct Notes {
    asked: Vec<(usize, String)>,
    actions: Vec<(usize, String)>,
    results: Vec<(usize, String)>,
    decisions: Vec<(usize, String)>,
    open: Vec<(usize, String)>,
    files: Vec<(usize, String)>,
    /// Identifiers listed by child summaries, kept first.
    child_identifiers: Vec<String>,
}

impl Notes {
    fn groups(&self) -> Vec<Group> {
        vec![
            Group {
                section: SectionId::Asked,
                keep: Keep::Ends,
                share: 25,
                lines: self.asked.clone(),
            },
            Group {
                section: SectionId::Done,
                keep: Keep::Ends,
                share: 25,
                lines: self.actions.clone(),
            },
            Group {
                section: SectionId::Decisions,
                keep: Keep::Newest,
                share: 15,
                lines: self.decisions.clone(),
            },
            Group {
                section: SectionId::Open,
                keep: Keep::Newest,
                share: 15,
                lines: self.open.clone(),
            },
            Group {
                section: SectionId::Files,
                keep: Keep::Ends,
                share: 10,
                lines: self.files.clone(),
            },
            Group {
                section: SectionId::Done,
                keep: Keep::Newest,
                share: 10,
                lines: self.results.clone(),
            },
        ]
    }

    fn from_turns(sources: &[SourceItem]) -> Notes {
        let mut notes = Notes::default();
        let mut seen = Dedup::default();
        let mut files_seen: HashSet<String> = HashSet::new();
        for (at, item) in sources.iter().enumerate() {
            let label = &item.label;
            let text = item.text.as_str();
            match item.role {
                Some(Role::User) => {
                    let ask = condense(text, ASK_CHARS);
                    if !ask.is_empty() && seen.first(SectionId::Asked, &ask) {
                        notes.asked.push((at, format!("- {label}: {ask}")));
                    }
                    mine_sentences(&mut notes, &mut seen, at, label, text);
                }
                Some(Role::Assistant) => {
                    let action = condense(text, ACTION_CHARS);
                    let line = match &item.tool {
                        Some(tool) => format!("- {label}: called `{tool}`: {action}"),
                        None if action.is_empty() => continue,
                        None => format!("- {label}: {action}"),
                    };
                    let key = format!("{}{action}", item.tool.as_deref().unwrap_or(""));
                    if seen.first(SectionId::Done, &key) {
                        notes.actions.push((at, line));
                    }
                    mine_sentences(&mut notes, &mut seen, at, label, text);
                }
                Some(Role::Tool) => {
                    let tool = item.tool.as_deref().unwrap_or("tool");
                    let head = first_meaningful_line(text, RESULT_CHARS);
                    if !head.is_empty() {
                        notes
                            .results
                            .push((at, format!("- {label}: `{tool}` returned: {head}")));
                    }
                    if let Some(error) = first_error_line(text) {
                        let line = format!("- {label}: `{tool}` reported: {error}");
                        if seen.first(SectionId::Open, &error) {
                            notes.open.push((at, line));
                        }
                    }
                }
                // System prompts are context, not events of the segment;
                // their identifiers still reach the identifier list.
                Some(Role::System) => {}
                None => {
                    let child = parse_child(text);
                    notes.absorb_child(at, child, &mut seen, &mut files_seen);
                    continue;
                }
            }
            if matches!(item.role, Some(Role::Assistant) | Some(Role::Tool)) {
                for id in identifiers::extract_with_kinds(text) {
                    if id.kind == IdentifierKind::Path && files_seen.insert(id.text.clone()) {
                        notes.files.push((at, format!("- {}", id.text)));
                    }
                }
            }
        }
        notes
    }

    fn from_children(sources: &[SourceItem]) -> Notes {
        let mut notes = Notes::default();
        let mut seen = Dedup::default();
        let mut files_seen: HashSet<String> = HashSet::new();
        for (at, item) in sources.iter().enumerate() {
            let child = parse_child(&item.text);
            notes.absorb_child(at, child, &mut seen, &mut files_seen);
        }
        notes
    }

    fn absorb_child(
        &mut self,
        at: usize,
        child: ChildSections,
        seen: &mut Dedup,
        files_seen: &mut HashSet<String>,
    ) {
        for line in child.asked {
            if seen.first(SectionId::Asked, strip_label(&line)) {
                self.asked.push((at, format!("- {line}")));
            }
        }
        for line in child.done {
            if seen.first(SectionId::Done, strip_label(&line)) {
                self.actions.push((at, format!("- {line}")));
            }
        }
        for line in child.decisions {
            if seen.first(SectionId::Decisions, strip_label(&line)) {
                self.decisions.push((at, format!("- {line}")));
            }
        }
        for line in child.open {
            if seen.first(SectionId::Open, strip_label(&line)) {
                self.open.push((at, format!("- {line}")));
            }
        }
        for file in child.files {
            if files_seen.insert(file.clone()) {
                self.files.push((at, format!("- {file}")));
            }
        }
        for id in child.identifiers {
            if !self.child_identifiers.contains(&id) {
                self.child_identifiers.push(id);
            }
        }
    }
}

/// Lines already taken, per section, compared without case, punctuation or
/// the turn label, so a repeated error or a re-asked question is kept once.
#[derive(Default)]
struct Dedup(HashSet<(SectionId, String)>);

impl Dedup {
    fn first(&mut self, section: SectionId, text: &str) -> bool {
        let key: String = text
            .chars()
            .filter(|c| c.is_alphanumeric())
            .flat_map(char::to_lowercase)
            .collect();
        !key.is_empty() && self.0.insert((section, key))
    }
}

/// `turn 17: text` -> `text`, for deduplication across children.
fn strip_label(line: &str) -> &str {
    match line.split_once(": ") {
        Some((head, rest))
            if head.len() <= 60 && (head.starts_with("turn ") || head.starts_with("summary ")) =>
        {
            rest
        }
        _ => line,
    }
}

static DECISION: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:decid(?:e|ed|es|ing)|decision|chose|choose|chosen|opt(?:ed|ing)? (?:for|to)|will use|we'll use|i'll use|going to use|instead|because|rather than|prefer(?:red|s)?|switch(?:ed|ing)? to|settled on|agreed|the plan is|approach is|we will|let's go with|go with)\b",
    )
});
static OPEN_ITEM: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:todo|fixme|next steps?|still (?:need|needs|to|failing|broken)|remaining|blocker|blocked|failing|fails|failed|error|unresolved|not yet|pending|open question|need to|needs to|has to be|follow[- ]up|tbd|wip|doesn't work|does not work|broken)\b",
    )
});
static ERROR_LINE: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:error|exception|traceback|failed|failure|panicked|fatal|denied|not found|no such|cannot|could not|unable to)\b",
    )
});

fn regex_or_bug(pattern: &str) -> Regex {
    match Regex::new(pattern) {
        Ok(regex) => regex,
        // Constant patterns of this file: only a bug reaches this.
        Err(e) => panic!("summarizer pattern does not compile: {e}"),
    }
}

/// Decisions and open items among the sentences of a user or assistant turn.
fn mine_sentences(notes: &mut Notes, seen: &mut Dedup, at: usize, label: &str, text: &str) {
    let head = prefix_bytes(text, MINED_BYTES);
    for sentence in sentences(head) {
        // A question decides nothing and leaves the answer open elsewhere.
        if sentence.len() < 12 || sentence.ends_with('?') || looks_like_code(sentence) {
            continue;
        }
        if DECISION.is_match(sentence) {
            let s = condense(sentence, SENTENCE_CHARS);
            if seen.first(SectionId::Decisions, &s) {
                notes.decisions.push((at, format!("- {label}: {s}")));
            }
        } else if OPEN_ITEM.is_match(sentence) {
            let s = condense(sentence, SENTENCE_CHARS);
            if seen.first(SectionId::Open, &s) {
                notes.open.push((at, format!("- {label}: {s}")));
            }
        }
    }
}

/// A line of a file listing (`1480:     except ValueError as error:`) or of
/// code: it mentions errors without reporting one.
fn is_listing_line(line: &str) -> bool {
    let trimmed = line.trim_start();
    let digits = trimmed.bytes().take_while(u8::is_ascii_digit).count();
    (digits > 0 && trimmed[digits..].starts_with(':')) || looks_like_code(trimmed)
}

fn looks_like_code(sentence: &str) -> bool {
    let symbols = sentence
        .chars()
        .filter(|c| {
            matches!(
                c,
                '{' | '}' | '(' | ')' | ';' | '=' | '<' | '>' | '[' | ']' | '"' | '\\'
            )
        })
        .count();
    symbols * 8 > sentence.chars().count()
}

/// Sentences of a text: split at line ends and after `.`, `!`, `?` followed
/// by a space. Empty pieces are dropped.
fn sentences(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut start = 0;
        let bytes = line.as_bytes();
        for (i, &b) in bytes.iter().enumerate() {
            if matches!(b, b'.' | b'!' | b'?') && bytes.get(i + 1).is_some_and(|n| *n == b' ') {
                let piece = line[start..=i].trim();
                if !piece.is_empty() {
                    out.push(piece);
                }
                start = i + 1;
            }
        }
        let piece = line[start..].trim();
        if !piece.is_empty() {
            out.push(piece);
        }
    }
    out
}

/// The first line of a tool result that says something (not blank, not a
/// lone bracket), condensed.
fn first_meaningful_line(text: &str, max_chars: usize) -> String {
    let head = prefix_bytes(text, MINED_BYTES);
    for line in head.lines() {
        let trimmed = line.trim();
        if trimmed.chars().filter(|c| c.is_alphanumeric()).count() >= 3 {
            return condense(trimmed, max_chars);
        }
    }
    String::new()
}

fn first_error_line(text: &str) -> Option<String> {
    let head = prefix_bytes(text, MINED_BYTES);
    head.lines()
        .find(|line| ERROR_LINE.is_match(line) && !is_listing_line(line))
        .map(|line| condense(line.trim(), RESULT_CHARS))
        .filter(|line| !line.is_empty())
}

/// At most `max` bytes of `text`, cut on a char boundary.
fn prefix_bytes(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Whitespace collapsed to single spaces, at most `max_chars` characters,
/// cut at a word boundary when one is near, `…` marking the cut.
fn condense(text: &str, max_chars: usize) -> String {
    let mut out = String::new();
    let mut count = 0usize;
    let mut pending_space = false;
    let mut cut = false;
    for c in text.chars() {
        if c.is_whitespace() {
            pending_space = !out.is_empty();
            continue;
        }
        let need = if pending_space { 2 } else { 1 };
        if count + need > max_chars.saturating_sub(1) {
            cut = true;
            break;
        }
        if pending_space {
            out.push(' ');
            count += 1;
            pending_space = false;
        }
        out.push(c);
        count += 1;
    }
    if cut {
        // Back to the last space if it is close, so no word is cut in half.
        if let Some(space) = out.rfind(' ') {
            if out[space..].chars().count() <= 24 {
                out.truncate(space);
            }
        }
        out.push('…');
    }
    out
}

// ---- child summaries ----

#[derive(Default)]
struct ChildSections {
    asked: Vec<String>,
    done: Vec<String>,
    decisions: Vec<String>,
    open: Vec<String>,
    files: Vec<String>,
    identifiers: Vec<String>,
}

/// Reads a child summary: this summarizer's own sections, or any markdown
/// with headings, or plain prose (whose lines count as Done, and whose
/// sentences are mined for decisions and open items).
fn parse_child(text: &str) -> ChildSections {
    #[derive(Clone, Copy)]
    enum Into {
        Asked,
        Done,
        Decisions,
        Open,
        Files,
        Identifiers,
    }
    let mut child = ChildSections::default();
    let mut into = Into::Done;
    let mut structured = false;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        if i == 0 && line.contains("deterministic fallback") {
            continue;
        }
        if let Some(heading) = line.strip_prefix('#') {
            structured = true;
            let h = heading.trim_start_matches('#').trim().to_lowercase();
            into = if h.contains("identifier") {
                Into::Identifiers
            } else if h.contains("file") {
                Into::Files
            } else if h.contains("decision") {
                Into::Decisions
            } else if h.contains("open")
                || h.contains("todo")
                || h.contains("next")
                || h.contains("block")
                || h.contains("pending")
            {
                Into::Open
            } else if h.contains("ask")
                || h.contains("request")
                || h.contains("goal")
                || h.contains("user")
            {
                Into::Asked
            } else {
                Into::Done
            };
            continue;
        }
        let item = line
            .strip_prefix("- ")
            .or_else(|| line.strip_prefix("* "))
            .unwrap_or(line)
            .to_string();
        match into {
            Into::Asked => child.asked.push(item),
            Into::Done if !structured => {
                // Prose from a model: its decisions and open items still count.
                for sentence in sentences(&item) {
                    if sentence.len() >= 12 && DECISION.is_match(sentence) {
                        child.decisions.push(condense(sentence, SENTENCE_CHARS));
                    } else if sentence.len() >= 12 && OPEN_ITEM.is_match(sentence) {
                        child.open.push(condense(sentence, SENTENCE_CHARS));
                    }
                }
                child.done.push(item);
            }
            Into::Done => child.done.push(item),
            Into::Decisions => child.decisions.push(item),
            Into::Open => child.open.push(item),
            Into::Files => child.files.push(item),
            Into::Identifiers => child.identifiers.push(item),
        }
    }
    child
}

// ---- fitting the budget ----

fn line_cost(line: &str) -> u64 {
    tokens(line) + 1
}

/// Renders the sections and identifiers within `budget` tokens, or `None`
/// when not even the header fits.
fn render_within(notes: &Notes, ids: &[String], header: &str, budget: u64) -> Option<String> {
    let mut room = budget;
    // The per-line estimate (each line counted alone, plus its newline) can
    // differ from the count of the joined text by a few tokens; shrink and
    // retry on the rare overshoot.
    for _ in 0..4 {
        let text = render_once(notes, ids, header, room)?;
        let used = tokens(&text);
        if used <= budget {
            return Some(text);
        }
        room = room.checked_sub(used - budget + 8)?;
    }
    None
}

struct Chosen {
    /// Per group: indices into its lines.
    lines: Vec<BTreeSet<usize>>,
    ids: Vec<usize>,
}

fn render_once(notes: &Notes, ids: &[String], header: &str, budget: u64) -> Option<String> {
    let header_cost = line_cost(header);
    if header_cost > budget {
        return None;
    }
    let room = budget - header_cost;
    let groups = notes.groups();
    let costs: Vec<Vec<u64>> = groups
        .iter()
        .map(|g| g.lines.iter().map(|(_, l)| line_cost(l)).collect())
        .collect();
    let id_costs: Vec<u64> = ids.iter().map(|id| line_cost(id)).collect();
    let ids_heading = "## Exact identifiers";
    let all_ids_cost: u64 = id_costs.iter().sum::<u64>() + line_cost(ids_heading);
    let reserve = all_ids_cost.min(room * IDENTIFIER_RESERVE_PERCENT / 100);
    let narrative_room = room - reserve;

    let mut chosen = Chosen {
        lines: vec![BTreeSet::new(); groups.len()],
        ids: Vec::new(),
    };
    let mut headings_paid: BTreeSet<SectionId> = BTreeSet::new();
    let mut used = 0u64;
    // First pass: each group up to its share of the narrative room.
    for (g, group) in groups.iter().enumerate() {
        let share = narrative_room * group.share / 100;
        used += fill_group(
            group,
            &costs[g],
            share,
            &mut chosen.lines[g],
            &mut headings_paid,
        );
    }
    // Then the identifiers the narrative does not already quote.
    let narrative = render_text(header, &groups, &chosen, ids);
    let missing: Vec<usize> = (0..ids.len())
        .filter(|&i| !narrative.contains(ids[i].as_str()))
        .collect();
    let mut id_room = room.saturating_sub(used);
    let mut all_listed = missing.is_empty();
    if !missing.is_empty() && id_room > line_cost(ids_heading) {
        all_listed = true;
        id_room -= line_cost(ids_heading);
        let mut listed = String::new();
        for &i in &missing {
            // A suffix of a path already listed is quoted by it.
            if listed.contains(ids[i].as_str()) {
                continue;
            }
            if id_costs[i] <= id_room {
                id_room -= id_costs[i];
                chosen.ids.push(i);
                listed.push_str(&ids[i]);
                listed.push('\n');
            } else {
                all_listed = false;
            }
        }
        used = room - id_room;
    }
    // Room left: more narrative, in section order; the identifier list is
    // then recomputed, and can only shrink.
    if all_listed {
        let mut left = room.saturating_sub(used);
        for (g, group) in groups.iter().enumerate() {
            let spent = fill_group(
                group,
                &costs[g],
                left,
                &mut chosen.lines[g],
                &mut headings_paid,
            );
            left = left.saturating_sub(spent);
        }
        let narrative = render_text(
            header,
            &groups,
            &Chosen {
                lines: chosen.lines.clone(),
                ids: Vec::new(),
            },
            ids,
        );
        chosen.ids = chosen
            .ids
            .iter()
            .copied()
            .filter(|&i| !narrative.contains(ids[i].as_str()))
            .collect();
    }
    Some(render_text(header, &groups, &chosen, ids))
}

/// Adds lines of `group` in its keep order while they fit `room`; returns
/// the tokens spent (a section heading is paid by its first line).
fn fill_group(
    group: &Group,
    costs: &[u64],
    room: u64,
    chosen: &mut BTreeSet<usize>,
    headings_paid: &mut BTreeSet<SectionId>,
) -> u64 {
    let heading_cost = line_cost(group.section.heading());
    let mut spent = 0u64;
    for i in keep_order(group.keep, group.lines.len()) {
        if chosen.contains(&i) {
            continue;
        }
        let extra = if headings_paid.contains(&group.section) {
            0
        } else {
            heading_cost
        };
        let cost = costs[i] + extra;
        if spent + cost > room {
            continue;
        }
        spent += cost;
        headings_paid.insert(group.section);
        chosen.insert(i);
    }
    spent
}

fn keep_order(keep: Keep, n: usize) -> Vec<usize> {
    match keep {
        Keep::Newest => (0..n).rev().collect(),
        Keep::Ends => {
            let mut order = Vec::with_capacity(n);
            let (mut lo, mut hi) = (0usize, n);
            while lo < hi {
                order.push(lo);
                lo += 1;
                if lo < hi {
                    hi -= 1;
                    order.push(hi);
                }
            }
            order
        }
    }
}

fn render_text(header: &str, groups: &[Group], chosen: &Chosen, ids: &[String]) -> String {
    let mut out = String::from(header);
    let sections = [
        SectionId::Asked,
        SectionId::Done,
        SectionId::Decisions,
        SectionId::Open,
        SectionId::Files,
    ];
    for section in sections {
        // Lines of every group of this section, in source order.
        let mut lines: Vec<(usize, usize, &str)> = Vec::new();
        for (g, group) in groups.iter().enumerate() {
            if group.section != section {
                continue;
            }
            for &i in &chosen.lines[g] {
                let (at, line) = &group.lines[i];
                lines.push((*at, g, line.as_str()));
            }
        }
        if lines.is_empty() {
            continue;
        }
        lines.sort_by_key(|&(at, g, _)| (at, g));
        out.push('\n');
        out.push_str(section.heading());
        for (_, _, line) in lines {
            out.push('\n');
            out.push_str(line);
        }
    }
    if !chosen.ids.is_empty() {
        out.push_str("\n## Exact identifiers");
        for &i in &chosen.ids {
            out.push('\n');
            out.push_str(&ids[i]);
        }
    }
    out
}

/// The longest prefix of `text` (cut on a char boundary, preferably at a
/// line or word end) that is at most `budget` tokens.
fn truncate_to_tokens(text: &str, budget: u64) -> String {
    if tokens(text) <= budget {
        return text.to_string();
    }
    // Token counts of prefixes grow with the prefix.
    let end = crate::core::tokens::longest_prefix(text, |end| tokens(&text[..end]) <= budget);
    let cut = &text[..end];
    // Prefer ending at whitespace if one is close: a half word is noise.
    // BPE counts are not monotonic in the prefix, so the shorter cut is
    // measured again.
    match cut.rfind(char::is_whitespace) {
        Some(at) if cut.len() - at <= 40 && at > 0 => {
            let shorter = cut[..at].trim_end();
            if tokens(shorter) <= budget {
                shorter.to_string()
            } else {
                cut.to_string()
            }
        }
        _ => cut.to_string(),
    }
}

// ---- rolling session state ----

static COMPLETED: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:done|completed?|fixed|added|implemented|created|updated|passed|passing|merged|booked|cancell?ed|resolved|wrote|written|finished|removed|renamed|refactored|installed|deployed|confirmed|succeeded|works now)\b",
    )
});
static NEXT: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:todo|next|then|still need|need to|needs to|will|going to|plan to|should|remaining|follow[- ]up)\b",
    )
});
static BLOCKER: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:blocked|blocker|error|exception|traceback|failing|fails|failed|failure|panicked|cannot|can't|could not|unable to|denied|not found|broken|doesn't work|does not work)\b",
    )
});

/// Refreshes the rolling session state from the turns since the last one.
///
/// Newest facts first in each section; the previous state's entries follow
/// (blockers and next steps are carried only when the new turns say nothing
/// of them). Sections are cut to [`ROLLING_SECTION_MAX_CHARS`] and the whole
/// to [`ROLLING_STATE_MAX_CHARS`], on character boundaries.
pub fn rolling_state(req: &RollingStateRequest) -> RollingState {
    let mut completed: Vec<String> = Vec::new();
    let mut decisions: Vec<String> = Vec::new();
    let mut blockers: Vec<String> = Vec::new();
    let mut next: Vec<String> = Vec::new();
    let mut last_ask: Option<String> = None;
    let mut last_action: Option<String> = None;

    for item in req.sources.iter().rev() {
        let text = prefix_bytes(&item.text, MINED_BYTES);
        match item.role {
            Some(Role::User) => {
                last_ask = last_ask.or_else(|| Some(condense(text, 120)).filter(|a| !a.is_empty()));
            }
            Some(Role::Assistant) => {
                if last_action.is_none() {
                    last_action = match &item.tool {
                        Some(tool) => Some(format!("`{tool}`")),
                        None => first_sentence(text),
                    };
                }
                if let Some(tool) = &item.tool {
                    completed.push(format!("ran `{tool}`"));
                }
            }
            Some(Role::Tool) => {
                if let Some(error) = first_error_line(text) {
                    let tool = item.tool.as_deref().unwrap_or("tool");
                    blockers.push(format!("`{tool}`: {}", condense(&error, 90)));
                }
                continue;
            }
            Some(Role::System) => continue,
            None => {}
        }
        for sentence in sentences(text) {
            if sentence.len() < 8 || looks_like_code(sentence) {
                continue;
            }
            let s = condense(sentence, 90);
            if DECISION.is_match(sentence) {
                decisions.push(s);
            } else if BLOCKER.is_match(sentence) {
                blockers.push(s);
            } else if NEXT.is_match(sentence) && item.role != Some(Role::User) {
                next.push(s);
            } else if COMPLETED.is_match(sentence) && item.role != Some(Role::User) {
                completed.push(s);
            }
        }
    }

    let previous = req.previous.clone().unwrap_or_default();
    let in_progress = match (last_ask, last_action) {
        (Some(ask), Some(action)) => format!("{ask} (last step: {action})"),
        (Some(ask), None) => ask,
        (None, Some(action)) => action,
        (None, None) => previous.in_progress.clone(),
    };
    let carry = |mut new: Vec<String>, old: &str, always: bool| -> String {
        dedup_keep_first(&mut new);
        let mut joined = new.join("; ");
        if (always || new.is_empty()) && !old.is_empty() {
            if !joined.is_empty() {
                joined.push_str("; ");
            }
            joined.push_str(old);
        }
        joined
    };
    let sections = [
        carry(completed, &previous.completed, true),
        in_progress,
        carry(decisions, &previous.decisions, true),
        carry(blockers, &previous.blockers, false),
        carry(next, &previous.next, false),
    ];
    let limits = fair_limits(&sections);
    let mut cut = sections
        .iter()
        .zip(limits)
        .map(|(s, limit)| truncate_chars(s, limit));
    RollingState {
        completed: cut.next().unwrap_or_default(),
        in_progress: cut.next().unwrap_or_default(),
        decisions: cut.next().unwrap_or_default(),
        blockers: cut.next().unwrap_or_default(),
        next: cut.next().unwrap_or_default(),
    }
}

fn first_sentence(text: &str) -> Option<String> {
    sentences(text)
        .into_iter()
        .find(|s| s.len() >= 8 && !looks_like_code(s))
        .map(|s| condense(s, 90))
}

fn dedup_keep_first(items: &mut Vec<String>) {
    let mut seen = HashSet::new();
    items.retain(|item| seen.insert(item.to_lowercase()));
}

/// Character limits per section: each at most the section maximum, the
/// sum at most the state maximum, short sections keeping all they have and
/// long ones sharing the rest equally.
fn fair_limits(sections: &[String; 5]) -> [usize; 5] {
    let wanted: Vec<usize> = sections
        .iter()
        .map(|s| s.chars().count().min(ROLLING_SECTION_MAX_CHARS))
        .collect();
    let mut limits = [0usize; 5];
    let mut order: Vec<usize> = (0..5).collect();
    order.sort_by_key(|&i| (wanted[i], i));
    let mut left = ROLLING_STATE_MAX_CHARS;
    for (k, &i) in order.iter().enumerate() {
        let fair = left / (5 - k);
        limits[i] = wanted[i].min(fair);
        left -= limits[i];
    }
    limits
}

/// At most `max` characters; a cut text ends with `…` (counted).
fn truncate_chars(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    if max == 0 {
        return String::new();
    }
    let mut out: String = text.chars().take(max - 1).collect();
    if let Some(space) = out.rfind(' ') {
        if out[space..].chars().count() <= 16 && space > 0 {
            out.truncate(space);
            out = out.trim_end_matches([';', ',', ' ']).to_string();
        }
    }
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::ChatMessage;
    use crate::core::tokens::count_message;

    fn shared_transcript(name: &str) -> Option<String> {
        let base = env!("CARGO_MANIFEST_DIR");
        // The crate root's sibling `shared/`, or one level further up (a
        // worktree in a sibling directory).
        for dir in ["/../shared/data", "/../../shared/data"] {
            if let Ok(text) = std::fs::read_to_string(format!("{base}{dir}/transcripts/{name}")) {
                return Some(text);
            }
        }
        eprintln!("skipped: shared/data/transcripts/{name} not found next to the crate");
        None
    }

    fn item_of(turn: usize, message: &ChatMessage) -> SourceItem {
        let tool = match message.role {
            Role::Assistant => message.tool_calls.first().map(|c| c.function.name.clone()),
            Role::Tool => message.name.clone(),
            _ => None,
        };
        SourceItem {
            label: format!("turn {turn}"),
            role: Some(message.role),
            tool,
            text: message.searchable_text(),
            tokens: count_message(ENCODING, message),
            time: turn as u64,
        }
    }

    /// The non-system messages of the tau-bench conversations (OpenAI chat
    /// messages), read once for all tests.
    fn tau_bench_messages() -> Option<&'static [ChatMessage]> {
        static MESSAGES: std::sync::OnceLock<Option<Vec<ChatMessage>>> = std::sync::OnceLock::new();
        MESSAGES
            .get_or_init(|| {
                let text = shared_transcript("tau-bench_sierra-research/gpt-4o-airline.json")?;
                let runs: Vec<serde_json::Value> = match serde_json::from_str(&text) {
                    Ok(runs) => runs,
                    Err(e) => panic!("tau-bench file does not parse: {e}"),
                };
                let messages = runs
                    .iter()
                    .filter_map(|run| run.get("traj").and_then(|t| t.as_array()))
                    .flatten()
                    .filter_map(|v| serde_json::from_value::<ChatMessage>(v.clone()).ok())
                    .filter(|m| m.role != Role::System)
                    .collect();
                Some(messages)
            })
            .as_deref()
    }

    /// Turns of the tau-bench conversations, numbered across conversations,
    /// until `max_tokens`.
    fn tau_bench_items(max_tokens: u64) -> Option<Vec<SourceItem>> {
        let mut items = Vec::new();
        let mut total = 0;
        for message in tau_bench_messages()? {
            let item = item_of(items.len() + 1, message);
            if total + item.tokens > max_tokens {
                break;
            }
            total += item.tokens;
            items.push(item);
        }
        Some(items)
    }

    fn swe_agent_items() -> Option<Vec<SourceItem>> {
        let text = shared_transcript(
            "swe-agent_SWE-agent/marshmallow-code__marshmallow-1867.function_calling.traj",
        )?;
        let traj: serde_json::Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => panic!("swe-agent file does not parse: {e}"),
        };
        let history = traj.get("history")?.as_array()?;
        let items = history
            .iter()
            .filter_map(|v| serde_json::from_value::<ChatMessage>(v.clone()).ok())
            .filter(|m| m.role != Role::System)
            .enumerate()
            .map(|(i, m)| item_of(i + 1, &m))
            .collect();
        Some(items)
    }

    fn leaf(sources: Vec<SourceItem>, target_tokens: u64) -> SummaryRequest {
        SummaryRequest {
            conversation: "test:conv".to_string(),
            kind: SummaryKind::Leaf,
            depth: 0,
            sources,
            target_tokens,
            previous_summary: None,
            instructions: None,
            custom_instructions: None,
            identifier_policy: IdentifierPolicy::Strict,
            aggressive: false,
        }
    }

    fn turn(n: usize, role: Role, text: &str) -> SourceItem {
        let message = ChatMessage::text(role, text);
        item_of(n, &message)
    }

    fn retention(content: &str, sources: &[SourceItem]) -> (usize, usize) {
        let mut all = Vec::new();
        let mut seen = HashSet::new();
        for s in sources {
            for id in identifiers::extract(&s.text) {
                if seen.insert(id.clone()) {
                    all.push(id);
                }
            }
        }
        let kept = all
            .iter()
            .filter(|id| content.contains(id.as_str()))
            .count();
        (kept, all.len())
    }

    #[test]
    fn marked_as_deterministic_fallback() {
        let draft = summarize(&leaf(vec![turn(1, Role::User, "hello there")], 100));
        assert!(draft.fallback);
        assert_eq!(draft.model, "deterministic");
        assert_eq!(draft.provider, "contextfold");
        assert_eq!(draft.prompt_version, "det-2");
    }

    #[test]
    fn same_input_same_output() {
        let Some(items) = tau_bench_items(20_000) else {
            return;
        };
        let req = leaf(items, 2400);
        let a = summarize(&req);
        let b = summarize(&req.clone());
        assert_eq!(a, b);
        assert!(!a.content.is_empty());
    }

    #[test]
    fn a_20000_token_leaf_fits_about_2400_tokens() {
        let Some(items) = tau_bench_items(20_000) else {
            return;
        };
        let req = leaf(items, 2400);
        let source = req.source_tokens();
        assert!(source > 15_000, "leaf too small to test: {source}");
        let draft = summarize(&req);
        let size = tokens(&draft.content);
        assert!(size <= 2400, "{size} tokens");
        // It uses the room it was given (the structure is not empty).
        assert!(size >= 1800, "only {size} tokens:\n{}", draft.content);
        for heading in ["## Asked", "## Done", "## Exact identifiers"] {
            assert!(
                draft.content.contains(heading),
                "no {heading}:\n{}",
                draft.content
            );
        }
        // Same with no target given: 12% of the source.
        let mut untargeted = req.clone();
        untargeted.target_tokens = 0;
        let size = tokens(&summarize(&untargeted).content);
        assert!(size <= source * 12 / 100, "{size} > 12% of {source}");
    }

    #[test]
    fn aggressive_aims_at_half() {
        let Some(items) = tau_bench_items(20_000) else {
            return;
        };
        let mut req = leaf(items, 2400);
        req.aggressive = true;
        let size = tokens(&summarize(&req).content);
        assert!(size <= 1200, "{size}");
        assert!(size >= 800, "{size}");
    }

    #[test]
    fn never_larger_than_the_source_or_the_target() {
        let Some(items) = tau_bench_items(60_000) else {
            return;
        };
        // Windows of many sizes and targets, from tiny to larger than the source.
        for (start, len) in [(0, 1), (3, 2), (10, 5), (20, 12), (40, 40), (100, 150)] {
            let window: Vec<SourceItem> = items.iter().skip(start).take(len).cloned().collect();
            for target in [1, 5, 10, 40, 200, 2400, 100_000] {
                for aggressive in [false, true] {
                    let mut req = leaf(window.clone(), target);
                    req.aggressive = aggressive;
                    let size = tokens(&summarize(&req).content);
                    let source = req.source_tokens();
                    let cap = if aggressive { target / 2 } else { target };
                    assert!(
                        size <= source,
                        "{size} > source {source} ({start},{len},{target})"
                    );
                    assert!(
                        size <= cap,
                        "{size} > target {cap} ({start},{len},{target})"
                    );
                }
            }
        }
    }

    #[test]
    fn keeps_identifiers_of_a_real_transcript() {
        let Some(items) = tau_bench_items(20_000) else {
            return;
        };
        let req = leaf(items, 2400);
        let draft = summarize(&req);
        let (kept, all) = retention(&draft.content, &req.sources);
        assert!(all > 50, "too few identifiers to test: {all}");
        // Every identifier in 2400 tokens is not always possible; most are.
        assert!(kept * 100 >= all * 80, "kept {kept} of {all}");
        assert!(draft.content.contains("mia_li_3668"));

        // With room for them, all of them.
        let mut roomy = req.clone();
        roomy.target_tokens = 6000;
        let draft = summarize(&roomy);
        let (kept, all) = retention(&draft.content, &roomy.sources);
        assert_eq!(kept, all, "with room, every identifier:\n{}", draft.content);
    }

    #[test]
    fn summarizes_a_swe_agent_trajectory() {
        let Some(items) = swe_agent_items() else {
            return;
        };
        let req = leaf(items, 1500);
        let draft = summarize(&req);
        let size = tokens(&draft.content);
        assert!(size <= 1500, "{size}");
        assert!(
            draft.content.contains("## Files touched"),
            "{}",
            draft.content
        );
        assert!(
            draft.content.contains("src/marshmallow/fields.py"),
            "{}",
            draft.content
        );
        assert!(
            draft.content.contains("called `"),
            "tool names: {}",
            draft.content
        );
        let (kept, all) = retention(&draft.content, &req.sources);
        assert!(kept * 100 >= all * 80, "kept {kept} of {all}");
    }

    #[test]
    fn sorts_sentences_into_sections() {
        let mut items =
            vec![
            turn(1, Role::User, "Please migrate the store at /srv/data/app.db to redb."),
            turn(
                2,
                Role::Assistant,
                "I decided to use redb instead of sled because sled deadlocked in the soak test. \
                 TODO: benchmark compaction on 192.168.1.20:6379 next.",
            ),
            turn(3, Role::Tool, "error[E0308]: mismatched types at src/store/redb.rs:42"),
        ];
        items[2].tool = Some("cargo_build".to_string());
        for i in 0..30 {
            items.push(turn(
                4 + i,
                Role::User,
                &format!("filler question number {i} about nothing in particular at all"),
            ));
        }
        let req = leaf(items, 400);
        let content = summarize(&req).content;
        let section = |name: &str| -> String {
            content
                .split("\n## ")
                .find(|s| s.starts_with(name))
                .unwrap_or("")
                .to_string()
        };
        assert!(
            section("Decisions").contains("redb instead of sled"),
            "{content}"
        );
        assert!(section("Open items").contains("E0308"), "{content}");
        assert!(section("Asked").contains("/srv/data/app.db"), "{content}");
        assert!(content.contains("192.168.1.20:6379"), "{content}");
        assert!(tokens(&content) <= 400);
    }

    #[test]
    fn tiny_source_gives_a_verbatim_excerpt_no_larger() {
        let text = "Fix the flaky test in src/lib.rs please, it fails on CI every time we run it.";
        let message = ChatMessage::text(Role::User, text);
        let mut item = item_of(1, &message);
        item.tokens = 10;
        let req = leaf(vec![item], 2400);
        let content = summarize(&req).content;
        assert!(tokens(&content) <= 10, "{content:?}");
        assert!(!content.is_empty());
        assert!(text.starts_with(&content), "{content:?}");
        // A source that fits its target whole is returned whole.
        let whole = leaf(vec![turn(1, Role::User, text)], 2400);
        assert_eq!(summarize(&whole).content, text);
    }

    #[test]
    fn empty_sources_give_an_empty_summary() {
        assert_eq!(summarize(&leaf(Vec::new(), 2400)).content, "");
        let zero = leaf(vec![turn(1, Role::User, "")], 2400);
        assert_eq!(summarize(&zero).content, "");
        let mut no_target = leaf(vec![turn(1, Role::User, "some words here")], 0);
        no_target.sources[0].tokens = 5;
        // 12% of 5 tokens is 0 tokens.
        assert_eq!(summarize(&no_target).content, "");
    }

    #[test]
    fn unicode_is_cut_on_char_boundaries() {
        let long = "日本語のテキスト 🚀 ünïcödé — ".repeat(40);
        let items: Vec<SourceItem> = (0..20)
            .map(|i| {
                turn(
                    i + 1,
                    if i % 2 == 0 {
                        Role::User
                    } else {
                        Role::Assistant
                    },
                    &long,
                )
            })
            .collect();
        for target in [3, 17, 64, 300, 1000] {
            let req = leaf(items.clone(), target);
            let content = summarize(&req).content;
            assert!(tokens(&content) <= target, "{target}");
            // A String is valid UTF-8 by construction; check no replacement
            // characters were produced by byte slicing either.
            assert!(!content.contains('\u{FFFD}'));
        }
        let state = rolling_state(&RollingStateRequest {
            conversation: "c".to_string(),
            previous: None,
            sources: items,
        });
        for section in [
            &state.completed,
            &state.in_progress,
            &state.decisions,
            &state.blockers,
            &state.next,
        ] {
            assert!(section.chars().count() <= ROLLING_SECTION_MAX_CHARS);
        }
    }

    #[test]
    fn condensed_merges_children() {
        let Some(items) = tau_bench_items(40_000) else {
            return;
        };
        let half = items.len() / 2;
        let first = summarize(&leaf(items[..half].to_vec(), 2400)).content;
        let second = summarize(&leaf(items[half..].to_vec(), 2400)).content;
        let child = |n: usize, content: &str| SourceItem {
            label: format!("summary sum_{n}"),
            role: None,
            tool: None,
            text: content.to_string(),
            tokens: tokens(content),
            time: n as u64,
        };
        let children = vec![child(1, &first), child(2, &first), child(3, &second)];
        let mut req = leaf(children, 0);
        req.kind = SummaryKind::Condensed;
        req.depth = 1;
        req.target_tokens = 2000;
        let content = summarize(&req).content;
        assert!(tokens(&content) <= 2000);
        assert!(
            content.starts_with("Condensed summary (depth 1)"),
            "{content}"
        );
        // A child given twice adds nothing twice.
        let asked: Vec<&str> = content
            .split("\n## ")
            .find(|s| s.starts_with("Asked"))
            .unwrap_or("")
            .lines()
            .skip(1)
            .collect();
        let unique: HashSet<&str> = asked.iter().copied().collect();
        assert_eq!(unique.len(), asked.len(), "{content}");
        // With room, every identifier of every child is kept.
        req.target_tokens = 4400;
        let content = summarize(&req).content;
        let (kept, all) = retention(&content, &req.sources);
        assert_eq!(kept, all, "{content}");
    }

    #[test]
    fn identifiers_the_user_named_or_the_work_repeated_are_kept_first() {
        // A listing of 300 files seen once, between a path the user named
        // and one the assistant came back to: not all fit, those two do.
        let listing: String = (0..300)
            .map(|i| format!("vendor/pkg{i:03}/generated/module_{i:03}_bindings.rs\n"))
            .collect();
        let sources = vec![
            turn(
                0,
                Role::User,
                "please fix crates/core/src/ledger.rs, it panics",
            ),
            turn(1, Role::Tool, &listing),
            turn(
                2,
                Role::Assistant,
                "reading crates/core/src/journal_index.rs",
            ),
            turn(3, Role::Tool, &listing.replace("vendor", "third_party")),
            turn(
                4,
                Role::Assistant,
                "patched crates/core/src/journal_index.rs",
            ),
        ];
        let content = summarize(&leaf(sources, 300)).content;
        assert!(tokens(&content) <= 300, "{content}");
        assert!(content.contains("crates/core/src/ledger.rs"), "{content}");
        assert!(
            content.contains("crates/core/src/journal_index.rs"),
            "{content}"
        );
    }

    #[test]
    fn a_suffix_of_a_listed_path_is_not_listed_again() {
        let long = "/home/dev/work/project/packages/agent/src/session_store.ts";
        let mut sources = vec![turn(
            0,
            Role::User,
            &format!("look at {long} and session_store.ts and src/session_store.ts"),
        )];
        for i in 1..40 {
            sources.push(turn(i, Role::Tool, &"filler output line\n".repeat(60)));
        }
        let content = summarize(&leaf(sources, 400)).content;
        let listed: Vec<&str> = content
            .split("## Exact identifiers")
            .nth(1)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("session_store.ts"))
            .collect();
        assert!(content.contains(long), "{content}");
        assert!(listed.len() <= 1, "{listed:?}");
    }

    #[test]
    fn identifier_policy_off_lists_none() {
        let Some(items) = tau_bench_items(20_000) else {
            return;
        };
        let mut req = leaf(items, 2400);
        req.identifier_policy = IdentifierPolicy::Off;
        let content = summarize(&req).content;
        assert!(!content.contains("## Exact identifiers"));
        assert!(tokens(&content) <= 2400);
    }

    #[test]
    fn rolling_state_fits_its_limits() {
        let Some(items) = tau_bench_items(20_000) else {
            return;
        };
        let previous = RollingState {
            completed: "x".repeat(300),
            in_progress: "y".repeat(300),
            decisions: "z".repeat(300),
            blockers: "w".repeat(300),
            next: "v".repeat(300),
        };
        for prev in [None, Some(previous)] {
            let req = RollingStateRequest {
                conversation: "c".to_string(),
                previous: prev,
                sources: items.clone(),
            };
            let state = rolling_state(&req);
            let sections = [
                &state.completed,
                &state.in_progress,
                &state.decisions,
                &state.blockers,
                &state.next,
            ];
            let total: usize = sections.iter().map(|s| s.chars().count()).sum();
            assert!(total <= ROLLING_STATE_MAX_CHARS, "{total}: {state:?}");
            for s in sections {
                assert!(s.chars().count() <= ROLLING_SECTION_MAX_CHARS, "{s}");
            }
            assert!(!state.in_progress.is_empty());
            assert_eq!(state, rolling_state(&req), "deterministic");
        }
    }

    #[test]
    fn rolling_state_reads_the_turns() {
        let mut items = vec![
            turn(1, Role::User, "Please book the flight HAT136 for me."),
            turn(
                2,
                Role::Assistant,
                "We decided to pay with the gift card because it covers the fare.",
            ),
            turn(3, Role::Tool, "Error: payment method not found"),
            turn(
                4,
                Role::Assistant,
                "Next I will retry with the credit card.",
            ),
        ];
        items[2].tool = Some("book_reservation".to_string());
        let state = rolling_state(&RollingStateRequest {
            conversation: "c".to_string(),
            previous: Some(RollingState {
                completed: "looked up user mia_li_3668".to_string(),
                ..RollingState::default()
            }),
            sources: items,
        });
        assert!(state.in_progress.contains("HAT136"), "{state:?}");
        assert!(state.decisions.contains("gift card"), "{state:?}");
        assert!(
            state.blockers.contains("payment method not found"),
            "{state:?}"
        );
        assert!(
            state.next.contains("retry with the credit card"),
            "{state:?}"
        );
        assert!(state.completed.contains("mia_li_3668"), "{state:?}");
    }

    #[test]
    fn truncation_helpers_are_unicode_safe() {
        let s = "ab🚀cd日本語ef";
        for max in 0..12 {
            let t = truncate_chars(s, max);
            assert!(t.chars().count() <= max, "{max}: {t}");
        }
        for budget in 0..8 {
            let t = truncate_to_tokens(s, budget);
            assert!(tokens(&t) <= budget);
            assert!(s.starts_with(&t));
        }
        assert_eq!(condense("  a \n\t b  ", 10), "a b");
        assert!(condense(&"word ".repeat(100), 30).chars().count() <= 30);
        assert_eq!(prefix_bytes("日本語", 4), "日");
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn role_strategy() -> impl Strategy<Value = Option<Role>> {
            prop_oneof![
                Just(Some(Role::User)),
                Just(Some(Role::Assistant)),
                Just(Some(Role::Tool)),
                Just(Some(Role::System)),
                Just(None),
            ]
        }

        fn item_strategy() -> impl Strategy<Value = SourceItem> {
            (
                role_strategy(),
                proptest::option::of("[a-z_]{1,8}"),
                "(\\PC|[ \n./:#-]|src/a\\.rs|E0308|##? [A-Za-z]+|TODO|because){0,60}",
                0u64..400,
            )
                .prop_map(|(role, tool, text, tokens)| SourceItem {
                    label: "turn 1".to_string(),
                    role,
                    tool,
                    text,
                    tokens,
                    time: 0,
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(48))]
            #[test]
            fn bounded_and_deterministic(
                sources in proptest::collection::vec(item_strategy(), 0..12),
                target in 0u64..600,
                aggressive: bool,
                depth in 0u32..3,
            ) {
                let mut req = leaf(sources, target);
                req.aggressive = aggressive;
                req.depth = depth;
                if depth > 0 {
                    req.kind = SummaryKind::Condensed;
                }
                let draft = summarize(&req);
                let size = tokens(&draft.content);
                prop_assert!(size <= req.source_tokens());
                let target = if target == 0 { req.source_tokens() * 12 / 100 } else { target };
                let cap = if aggressive { target / 2 } else { target };
                prop_assert!(size <= cap, "{} > {}", size, cap);
                prop_assert_eq!(&draft, &summarize(&req));
                let state = rolling_state(&RollingStateRequest {
                    conversation: "c".to_string(),
                    previous: None,
                    sources: req.sources.clone(),
                });
                let sections = [&state.completed, &state.in_progress, &state.decisions, &state.blockers, &state.next];
                let total: usize = sections.iter().map(|s| s.chars().count()).sum();
                prop_assert!(total <= ROLLING_STATE_MAX_CHARS);
                prop_assert!(sections.iter().all(|s| s.chars().count() <= ROLLING_SECTION_MAX_CHARS));
            }
        }
    }
}
