//! The handover notes of a span, read from its turns: the task in the
//! user's words, the files changed and what changed in each, errors and
//! how they were met, decisions, milestones done, what is open, and the
//! next step. Also the text helpers every part of the summarizer shares.

use super::reading::{read_of, readings_of, Read};
use super::signals::*;
use super::*;
use crate::core::summary::SourceReading;
use crate::core::turn_notes::{self, CallKind};

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
    Task,
    Progress,
    Files,
    Errors,
    Decisions,
    Done,
    Open,
    Next,
}

impl SectionId {
    pub(super) const ALL: [SectionId; 8] = [
        SectionId::Task,
        SectionId::Progress,
        SectionId::Files,
        SectionId::Errors,
        SectionId::Decisions,
        SectionId::Done,
        SectionId::Open,
        SectionId::Next,
    ];

    pub(super) fn heading(self) -> &'static str {
        match self {
            SectionId::Task => "## Task (the user's words)",
            SectionId::Progress => "## Progress",
            SectionId::Files => "## Files changed",
            SectionId::Errors => "## Errors and fixes",
            SectionId::Decisions => "## Decisions",
            SectionId::Done => "## Done",
            SectionId::Open => "## Open",
            SectionId::Next => "## Next",
        }
    }
}

/// One candidate line: where in the sources it comes from (for order),
/// its text (without the `- `), and a shorter form to fall back on.
#[derive(Clone, Debug)]
pub(super) struct Line {
    pub(super) at: usize,
    pub(super) text: String,
    pub(super) short: Option<String>,
}

/// A file changed in the span: how, in which turns, and what changed.
#[derive(Clone, Debug)]
pub(super) struct FileEntry {
    pub(super) path: String,
    pub(super) verbs: Vec<String>,
    pub(super) turns: Vec<String>,
    pub(super) what: Vec<String>,
    /// Position of its newest change, for ordering and keeping.
    pub(super) at: usize,
}

impl FileEntry {
    /// `path (edited in turns 3, 7): what; what`.
    pub(super) fn render(&self, max_what: usize) -> String {
        let mut out = self.path.clone();
        if !self.verbs.is_empty() || !self.turns.is_empty() {
            out.push_str(" (");
            out.push_str(&self.verbs.join(", "));
            if !self.turns.is_empty() {
                if !self.verbs.is_empty() {
                    out.push(' ');
                }
                out.push_str(&turn_list(&self.turns));
            }
            out.push(')');
        }
        let what: Vec<&str> = self
            .what
            .iter()
            .rev()
            .take(max_what)
            .rev()
            .map(String::as_str)
            .collect();
        if !what.is_empty() {
            out.push_str(": ");
            out.push_str(&what.join("; "));
        }
        out
    }

    pub(super) fn merge(&mut self, other: FileEntry) {
        for v in other.verbs {
            if !self.verbs.contains(&v) {
                self.verbs.push(v);
            }
        }
        for t in other.turns {
            if !self.turns.contains(&t) {
                self.turns.push(t);
            }
        }
        for w in other.what {
            if !self.what.contains(&w) {
                self.what.push(w);
            }
        }
        self.at = self.at.max(other.at);
    }
}

/// `turn 3`, `turn 7` -> `in turns 3, 7` (the first two and the last when
/// there are many).
fn turn_list(labels: &[String]) -> String {
    let nums: Vec<&str> = labels
        .iter()
        .map(|l| l.strip_prefix("turn ").unwrap_or(l))
        .collect();
    let shown: Vec<&str> = if nums.len() > 4 {
        let mut v = nums[..2].to_vec();
        v.push("…");
        v.push(nums[nums.len() - 1]);
        v
    } else {
        nums
    };
    if labels.len() == 1 {
        format!("in turn {}", shown[0])
    } else {
        format!("in turns {}", shown.join(", "))
    }
}

#[derive(Default)]
pub(super) struct Notes {
    pub(super) task: Vec<Line>,
    pub(super) progress: Vec<Line>,
    pub(super) files: Vec<FileEntry>,
    pub(super) errors: Vec<Line>,
    pub(super) decisions: Vec<Line>,
    pub(super) done: Vec<Line>,
    pub(super) open: Vec<Line>,
    pub(super) next: Option<Line>,
    /// Identifiers listed by child summaries, kept first.
    pub(super) child_identifiers: Vec<String>,
}

/// One group of candidate lines for the fitter.
pub(super) struct Group {
    pub(super) section: SectionId,
    pub(super) keep: Keep,
    /// Percent of the narrative room this group gets in the first pass.
    pub(super) share: u64,
    pub(super) lines: Vec<Line>,
}

impl Notes {
    pub(super) fn groups(&self) -> Vec<Group> {
        let mut files: Vec<&FileEntry> = self.files.iter().collect();
        files.sort_by_key(|f| f.at);
        let files = files
            .into_iter()
            .map(|f| Line {
                at: f.at,
                text: f.render(2),
                short: Some(f.render(0)),
            })
            .collect();
        vec![
            Group {
                section: SectionId::Task,
                keep: Keep::Ends,
                share: 25,
                lines: self.task.clone(),
            },
            Group {
                section: SectionId::Next,
                keep: Keep::Newest,
                share: 5,
                lines: self.next.iter().cloned().collect(),
            },
            Group {
                section: SectionId::Files,
                keep: Keep::Newest,
                share: 20,
                lines: files,
            },
            Group {
                section: SectionId::Done,
                keep: Keep::Newest,
                share: 15,
                lines: self.done.clone(),
            },
            Group {
                section: SectionId::Errors,
                keep: Keep::Newest,
                share: 15,
                lines: self.errors.clone(),
            },
            Group {
                section: SectionId::Decisions,
                keep: Keep::Newest,
                share: 10,
                lines: self.decisions.clone(),
            },
            Group {
                section: SectionId::Progress,
                keep: Keep::Ends,
                share: 5,
                lines: self.progress.clone(),
            },
            Group {
                section: SectionId::Open,
                keep: Keep::Newest,
                share: 5,
                lines: self.open.clone(),
            },
        ]
    }

    /// Adds a file change; a path that ends another (`reproduce.py`,
    /// `/testbed/reproduce.py`) is the same file, named by the longer.
    fn add_file(&mut self, mut entry: FileEntry) {
        let same = |a: &str, b: &str| a == b || a.ends_with(&format!("/{b}"));
        match self
            .files
            .iter_mut()
            .find(|f| same(&f.path, &entry.path) || same(&entry.path, &f.path))
        {
            Some(f) => {
                if entry.path.len() > f.path.len() {
                    std::mem::swap(&mut f.path, &mut entry.path);
                }
                f.merge(entry)
            }
            None => self.files.push(entry),
        }
    }

    pub(super) fn from_turns(sources: &[SourceItem]) -> Notes {
        Notes::from_turns_read(sources, &readings_of(sources))
    }

    /// [`Notes::from_turns`] with the readings the sources carry, checked
    /// already (`reading::readings_of`).
    pub(super) fn from_turns_read(
        sources: &[SourceItem],
        readings: &[Option<&SourceReading>],
    ) -> Notes {
        let mut notes = Notes::default();
        let mut seen = Dedup::default();
        // What each turn says on its own: its output's signals and its
        // notes, read ahead when they were (`reading::read_of`).
        let read: Vec<Read<'_>> = sources
            .iter()
            .zip(readings)
            .map(|(item, reading)| read_of(item, *reading))
            .collect();
        // The calls awaiting their results (by name), each with how it
        // was read.
        let mut pending: std::collections::VecDeque<(&str, &CallKind)> = Default::default();
        // The newest error not yet followed by the agent's words.
        let mut unanswered_error: Option<usize> = None;
        // The newest intention of the agent, and the newest user request.
        let mut intention: Option<Line> = None;
        let mut last_ask: Option<(usize, String)> = None;
        let mut last_question: Option<Line> = None;
        for (at, (item, read)) in sources.iter().zip(&read).enumerate() {
            let label = &item.label;
            let output = &read.output;
            match &read.notes.0 {
                // Another task's example (its text is a note saying so),
                // or a system prompt: context, not events of the segment;
                // their identifiers still reach the identifier list.
                turn_notes::Of::Context => {}
                turn_notes::Of::User(user) => {
                    if let Some(ask) = &user.ask {
                        if seen.first(SectionId::Task, &ask.long) {
                            notes.task.push(Line {
                                at,
                                text: format!("{label}: {}", ask.long),
                                short: (ask.short != ask.long)
                                    .then(|| format!("{label}: {}", ask.short)),
                            });
                        }
                        last_ask = Some((at, ask.short.clone()));
                        for s in &user.decisions {
                            keep_first(
                                &mut seen,
                                SectionId::Decisions,
                                &mut notes.decisions,
                                at,
                                label,
                                s,
                            );
                        }
                    }
                    // Output pasted or printed in the user's turn (an error
                    // to fix, a tool's console): its errors and milestones.
                    if let Some(error) = &output.error {
                        if seen.first(SectionId::Errors, error) {
                            notes.errors.push(Line {
                                at,
                                text: format!("{label}: reported {error}"),
                                short: None,
                            });
                            unanswered_error = Some(notes.errors.len() - 1);
                        }
                    }
                    for m in &output.milestones {
                        keep_first(&mut seen, SectionId::Done, &mut notes.done, at, label, m);
                    }
                    for (path, verb) in &output.file_changes {
                        notes.add_file(file_entry(path.clone(), verb, label, Vec::new(), at));
                    }
                    pending.clear();
                }
                turn_notes::Of::Assistant(turn) => {
                    if let (Some(i), Some(_)) = (unanswered_error, &turn.first) {
                        if !turn.fix.is_empty() {
                            let e = &mut notes.errors[i];
                            e.short = Some(e.text.clone());
                            e.text = format!("{} → {label}: {}", e.text, turn.fix);
                            unanswered_error = None;
                        }
                    }
                    for noted in &turn.noted {
                        let line = |s: &str| Line {
                            at,
                            text: format!("{label}: {s}"),
                            short: None,
                        };
                        match noted {
                            turn_notes::Noted::Sentence(said, s) => {
                                let (section, lines) = match said {
                                    turn_notes::Said::Question => {
                                        last_question = Some(line(s));
                                        continue;
                                    }
                                    turn_notes::Said::Intention => {
                                        intention = Some(line(s));
                                        continue;
                                    }
                                    turn_notes::Said::Milestone => {
                                        (SectionId::Done, &mut notes.done)
                                    }
                                    turn_notes::Said::Diagnosis => {
                                        (SectionId::Errors, &mut notes.errors)
                                    }
                                    turn_notes::Said::Decision => {
                                        (SectionId::Decisions, &mut notes.decisions)
                                    }
                                    turn_notes::Said::Open => (SectionId::Open, &mut notes.open),
                                };
                                keep_first(&mut seen, section, lines, at, label, s);
                            }
                            turn_notes::Noted::File { path, verb, what } => notes
                                .add_file(file_entry(path.clone(), verb, label, what.clone(), at)),
                            turn_notes::Noted::Action(action) => keep_first(
                                &mut seen,
                                SectionId::Done,
                                &mut notes.done,
                                at,
                                label,
                                action,
                            ),
                        }
                    }
                    pending.clear();
                    pending.extend(turn.calls.iter().map(|(name, kind)| (name.as_str(), kind)));
                }
                turn_notes::Of::Result => {
                    let call = pending.pop_front();
                    let edit_call = matches!(call, Some((_, CallKind::File { .. })));
                    let what = match call {
                        Some((_, CallKind::Shell(command))) => {
                            format!("`{}`", clip_words(command, COMMAND_CHARS))
                        }
                        _ => format!(
                            "`{}`",
                            call.map(|(name, _)| name)
                                .or(item.tool.as_deref())
                                .unwrap_or("tool")
                        ),
                    };
                    if let Some(error) = &output.error {
                        if seen.first(SectionId::Errors, error) {
                            notes.errors.push(Line {
                                at,
                                text: format!("{label}: {what} failed: {error}"),
                                short: Some(format!("{label}: {error}")),
                            });
                            unanswered_error = Some(notes.errors.len() - 1);
                        }
                    }
                    for m in &output.milestones {
                        keep_first(&mut seen, SectionId::Done, &mut notes.done, at, label, m);
                    }
                    // A result confirming its own call's edit adds nothing.
                    if !edit_call {
                        for (path, verb) in &output.file_changes {
                            notes.add_file(file_entry(path.clone(), verb, label, Vec::new(), at));
                        }
                    }
                }
                turn_notes::Of::Child => {
                    let child = parse_child(&item.text);
                    notes.absorb_child(at, child, &mut seen);
                }
            }
        }
        // The next step: the agent's newest intention, unless the user
        // spoke after it (then it is to answer them), or its newest
        // question to the user.
        let newest_intention =
            intention.filter(|i| last_ask.as_ref().is_none_or(|(a, _)| i.at > *a));
        notes.next = match (newest_intention, last_ask) {
            (Some(i), _) => Some(i),
            (None, Some((at, ask))) if sources.len() - at <= 2 || last_question.is_none() => {
                Some(Line {
                    at,
                    text: format!("{}: answer the user: {ask}", sources[at].label),
                    short: None,
                })
            }
            _ => None,
        };
        if let Some(q) = last_question.filter(|q| notes.next.as_ref().is_none_or(|n| q.at > n.at)) {
            notes.open.push(q);
        }
        notes
    }

    pub(super) fn from_children(sources: &[SourceItem]) -> Notes {
        let mut notes = Notes::default();
        let mut seen = Dedup::default();
        for (at, item) in sources.iter().enumerate() {
            let child = parse_child(&item.text);
            notes.absorb_child(at, child, &mut seen);
        }
        notes
    }

    pub(super) fn absorb_child(&mut self, at: usize, child: ChildSections, seen: &mut Dedup) {
        let mut add = |section: SectionId, lines: Vec<String>, into: &mut Vec<Line>| {
            for line in lines {
                if seen.first(section, strip_label(&line)) {
                    into.push(Line {
                        at,
                        text: line,
                        short: None,
                    });
                }
            }
        };
        add(SectionId::Task, child.task, &mut self.task);
        add(SectionId::Progress, child.progress, &mut self.progress);
        add(SectionId::Errors, child.errors, &mut self.errors);
        add(SectionId::Decisions, child.decisions, &mut self.decisions);
        add(SectionId::Done, child.done, &mut self.done);
        add(SectionId::Open, child.open, &mut self.open);
        for mut f in child.files {
            f.at = at;
            self.add_file(f);
        }
        // A child's next step was taken long ago (its span is history
        // now): not carried into a condensed summary.
        let _ = child.next;
        for id in child.identifiers {
            if !self.child_identifiers.contains(&id) {
                self.child_identifiers.push(id);
            }
        }
    }
}

fn file_entry(path: String, verb: &str, label: &str, what: Vec<String>, at: usize) -> FileEntry {
    FileEntry {
        path,
        verbs: vec![verb.to_string()],
        turns: vec![label.to_string()],
        what,
        at,
    }
}

/// An agent's words without code blocks and SEARCH/REPLACE blocks.
pub(super) fn words_only(text: &str) -> String {
    let mut out = String::new();
    let mut in_fence = false;
    for line in lines(text) {
        let t = line.trim_start();
        if t.starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence || t.starts_with("<<<<<<<") || t.starts_with(">>>>>>>") || t == "=======" {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Adds `label: text` to `lines` at `at`, unless its section has the text
/// already.
fn keep_first(
    seen: &mut Dedup,
    section: SectionId,
    lines: &mut Vec<Line>,
    at: usize,
    label: &str,
    text: &str,
) {
    if seen.first(section, text) {
        lines.push(Line {
            at,
            text: format!("{label}: {text}"),
            short: None,
        });
    }
}

/// Lines already taken, per section, compared without case, punctuation or
/// the turn label, so a repeated error or a re-asked question is kept once.
#[derive(Default)]
pub(super) struct Dedup(pub(super) HashSet<(SectionId, String)>);

impl Dedup {
    pub(super) fn first(&mut self, section: SectionId, text: &str) -> bool {
        // Sized once: a filtered iterator tells `collect` nothing of its
        // length, so it grew the key a character at a time.
        let mut key = String::with_capacity(text.len());
        key.extend(
            text.chars()
                .filter(|c| c.is_alphanumeric())
                .flat_map(char::to_lowercase),
        );
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

pub(super) static DECISION: LazyLock<LinePattern> = LazyLock::new(|| {
    LinePattern::new(
        r"(?i)\b(?:decid(?:e|ed|es|ing)|decision|chose|choose|chosen|opt(?:ed|ing)? (?:for|to)|will use|we'll use|i'll use|going to use|instead|rather than|prefer(?:red|s)?|switch(?:ed|ing)? to|settled on|agreed|the plan is|approach is|we will|let's go with|go with|should (?:be|use|go|live|stay)|must not|don't want|do not want|i want|we want|only want)\b",
    )
});

/// A line of a file listing (`1480:     except ValueError as error:`) or of
/// code: it mentions errors without reporting one.
pub fn is_listing_line(line: &str) -> bool {
    let trimmed = line.trim_start();
    let digits = trimmed.bytes().take_while(u8::is_ascii_digit).count();
    (digits > 0 && (trimmed[digits..].starts_with(':') || trimmed[digits..].starts_with('→')))
        || looks_like_code(trimmed)
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
    for line in lines(text) {
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

/// Whether `line` has at least `n` alphanumeric characters: stops at the
/// `n`-th (a long line of a tool output is not counted through).
pub fn has_alphanumerics(line: &str, n: usize) -> bool {
    n == 0
        || line
            .chars()
            .filter(|c| c.is_alphanumeric())
            .nth(n - 1)
            .is_some()
}

/// At most `max` bytes of `text`, cut on a char boundary.
pub fn prefix_bytes(text: &str, max: usize) -> &str {
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
    // Sized once (see `signals::condensed_prefix`), with room for the `…`.
    let mut out = String::with_capacity(text.len().min(max_chars.saturating_mul(4)) + 3);
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
