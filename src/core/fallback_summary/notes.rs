//! Candidate lines per section, read from turns or from child summaries:
//! what was asked, done, decided and left open, and the files touched.

use super::*;

/// Which lines of a section to keep first when not all fit.
#[derive(Clone, Copy)]
pub(super) enum Keep {
    /// The first and the last, then inwards: how it started and where it is.
    Ends,
    /// The newest first: what is still current.
    Newest,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub(super) enum SectionId {
    Asked,
    Done,
    Decisions,
    Open,
    Files,
}

impl SectionId {
    pub(super) fn heading(self) -> &'static str {
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
pub(super) struct Group {
    pub(super) section: SectionId,
    pub(super) keep: Keep,
    /// Percent of the narrative room this group gets in the first pass.
    pub(super) share: u64,
    /// (source position, line) in source order.
    pub(super) lines: Vec<(usize, String)>,
}

#[derive(Default)]
pub(super) struct Notes {
    pub(super) asked: Vec<(usize, String)>,
    pub(super) actions: Vec<(usize, String)>,
    pub(super) results: Vec<(usize, String)>,
    pub(super) decisions: Vec<(usize, String)>,
    pub(super) open: Vec<(usize, String)>,
    pub(super) files: Vec<(usize, String)>,
    /// Identifiers listed by child summaries, kept first.
    pub(super) child_identifiers: Vec<String>,
}

impl Notes {
    pub(super) fn groups(&self) -> Vec<Group> {
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

    pub(super) fn from_turns(sources: &[SourceItem]) -> Notes {
        let mut notes = Notes::default();
        let mut seen = Dedup::default();
        let mut files_seen: HashSet<String> = HashSet::new();
        for (at, item) in sources.iter().enumerate() {
            let label = &item.label;
            let text = item.text.as_str();
            match item.role {
                // Another task's example (its text is a note saying so): not
                // what the user asked.
                Some(Role::User) if item.tool.as_deref() == Some(DEMONSTRATION_NAME) => {}
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

    pub(super) fn from_children(sources: &[SourceItem]) -> Notes {
        let mut notes = Notes::default();
        let mut seen = Dedup::default();
        let mut files_seen: HashSet<String> = HashSet::new();
        for (at, item) in sources.iter().enumerate() {
            let child = parse_child(&item.text);
            notes.absorb_child(at, child, &mut seen, &mut files_seen);
        }
        notes
    }

    pub(super) fn absorb_child(
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
pub(super) struct Dedup(pub(super) HashSet<(SectionId, String)>);

impl Dedup {
    pub(super) fn first(&mut self, section: SectionId, text: &str) -> bool {
        let key: String = text
            .chars()
            .filter(|c| c.is_alphanumeric())
            .flat_map(char::to_lowercase)
            .collect();
        !key.is_empty() && self.0.insert((section, key))
    }
}

/// `turn 17: text` -> `text`, for deduplication across children.
pub(super) fn strip_label(line: &str) -> &str {
    match line.split_once(": ") {
        Some((head, rest))
            if head.len() <= 60 && (head.starts_with("turn ") || head.starts_with("summary ")) =>
        {
            rest
        }
        _ => line,
    }
}

pub(super) static DECISION: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:decid(?:e|ed|es|ing)|decision|chose|choose|chosen|opt(?:ed|ing)? (?:for|to)|will use|we'll use|i'll use|going to use|instead|because|rather than|prefer(?:red|s)?|switch(?:ed|ing)? to|settled on|agreed|the plan is|approach is|we will|let's go with|go with)\b",
    )
});
pub(super) static OPEN_ITEM: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:todo|fixme|next steps?|still (?:need|needs|to|failing|broken)|remaining|blocker|blocked|failing|fails|failed|error|unresolved|not yet|pending|open question|need to|needs to|has to be|follow[- ]up|tbd|wip|doesn't work|does not work|broken)\b",
    )
});
pub(super) static ERROR_LINE: LazyLock<Regex> = LazyLock::new(|| {
    regex_or_bug(
        r"(?i)\b(?:error|exception|traceback|failed|failure|panicked|fatal|denied|not found|no such|cannot|could not|unable to)\b",
    )
});

pub(super) fn regex_or_bug(pattern: &str) -> Regex {
    match Regex::new(pattern) {
        Ok(regex) => regex,
        // Constant patterns of this file: only a bug reaches this.
        Err(e) => panic!("summarizer pattern does not compile: {e}"),
    }
}

/// Decisions and open items among the sentences of a user or assistant turn.
pub(super) fn mine_sentences(
    notes: &mut Notes,
    seen: &mut Dedup,
    at: usize,
    label: &str,
    text: &str,
) {
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
pub(super) fn is_listing_line(line: &str) -> bool {
    let trimmed = line.trim_start();
    let digits = trimmed.bytes().take_while(u8::is_ascii_digit).count();
    (digits > 0 && trimmed[digits..].starts_with(':')) || looks_like_code(trimmed)
}

pub(super) fn looks_like_code(sentence: &str) -> bool {
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
pub(super) fn sentences(text: &str) -> Vec<&str> {
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
pub(super) fn first_meaningful_line(text: &str, max_chars: usize) -> String {
    let head = prefix_bytes(text, MINED_BYTES);
    for line in head.lines() {
        let trimmed = line.trim();
        if trimmed.chars().filter(|c| c.is_alphanumeric()).count() >= 3 {
            return condense(trimmed, max_chars);
        }
    }
    String::new()
}

pub(super) fn first_error_line(text: &str) -> Option<String> {
    let head = prefix_bytes(text, MINED_BYTES);
    head.lines()
        .find(|line| ERROR_LINE.is_match(line) && !is_listing_line(line))
        .map(|line| condense(line.trim(), RESULT_CHARS))
        .filter(|line| !line.is_empty())
}

/// At most `max` bytes of `text`, cut on a char boundary.
pub(super) fn prefix_bytes(text: &str, max: usize) -> &str {
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
pub(super) fn condense(text: &str, max_chars: usize) -> String {
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
