//! What a line, a sentence or a tool call says, recognized without a
//! model: an error, a milestone (tests passing, a commit, a push, a task
//! closed), a decision, an intention (the next step), a file changed.
//! Patterns are about the shape of common tool output and of how people
//! and agents write, never about one transcript.

use super::call_args::CallArgs;
use super::*;
use crate::core::summary::OutputReading;
use crate::core::turn_notes::CallKind;
use crate::line_pattern;
use lazy_regex::regex;

/// `pattern` matches `text`, asked only when `screen` does first.
///
/// The patterns below are case-insensitive with Unicode word boundaries:
/// on a line with a non-ASCII character (`→` in numbered file listings,
/// `✓`, accented words) the regex crate leaves its DFA for a slower engine.
/// A screen is an alternation of literals (ASCII, any case) of which every
/// match of its pattern holds one, plus `[\x{17F}\x{212A}]`: the two
/// characters a case-insensitive Unicode pattern takes for an ASCII letter
/// (`ſ` for `s`, the Kelvin sign for `k`). The regex crate searches such a
/// screen with a literal search or its DFA, never the slower engines,
/// whatever the text (with many literals in every case it may pick the
/// DFA, which costs little on a sentence; the screens of whole outputs are
/// [`Screen`]s, lowercase literals searched in a [`Lowered`] copy, for the
/// literal search, with the two characters searched apart), and most lines
/// hold none of the words. So the answer is the
/// pattern's own, and the pattern runs on the few lines that could match.
fn screened(screen: &Regex, pattern: &LinePattern, text: &str) -> bool {
    screen.is_match(text) && pattern.is_match(text)
}

/// The screen of [`is_error_line`], searched in a [`Lowered`] text.
fn error_screen() -> &'static Screen {
    crate::screen!(
        "error|fatal|panic|exception|traceback|fail|no such file|not found|permission denied|cannot|could not|unable to|exit|e999"
    )
}

/// Whether `screen` (lowercase literals) matches in `line`, of any case.
fn screen_matches(screen: &Screen, line: &str) -> bool {
    if line.bytes().any(|b| b.is_ascii_uppercase()) {
        screen.is_match(&line.to_ascii_lowercase())
    } else {
        screen.is_match(line)
    }
}

/// A line that reports an error or a failure (not a listing or code line
/// that merely mentions one).
pub(super) fn is_error_line(line: &str) -> bool {
    screen_matches(error_screen(), line) && is_screened_error_line(line)
}

/// [`is_error_line`] for a line the error screen matched in.
fn is_screened_error_line(line: &str) -> bool {
    // A listing line (`  31→ {:error, reason}`) is told without a regex:
    // asked before the pattern, it spares the pattern's slow engine.
    !is_listing_line(line)
        && error_pattern().is_match(line)
        && !line_pattern!(r"(?i)\b0 (failures?|failed|errors?)\b").is_match(line)
}

/// The pattern of [`is_error_line`].
fn error_pattern() -> &'static LinePattern {
    line_pattern!(
        r"(?i)^\s*(error|fatal|panic|exception|traceback)\b|\b\w*(Error|Exception)\b:|\berror(\[\w+\])?:|\bfailed\b|(?-i:\bFAIL(ED)?\b)|\b[1-9]\d* (failures?|failed|errors?)\b|\bno such file\b|\bnot found\b|\bpermission denied\b|\b(cannot|could not|unable to)\b|\bexit(ed)? (with )?code [1-9]|\bE999\b|\bsyntax error"
    )
}

/// A bare exit status or a traceback's header: an error, but a weak one to
/// quote (the line that says what went wrong comes after it).
fn is_bare_exit(line: &str) -> bool {
    line_pattern!(r"(?i)^\s*((exit code|command exited with code|exited with code) \d+|traceback \(most recent call last\):?)\s*$").is_match(line)
}

/// Whether an error line of a user turn looks like output (pasted output,
/// a traceback, a tool's console), not a sentence that says something
/// "cannot" be done: what [`output_report`] accepts for a user turn.
pub(super) fn reports_an_error(line: &str) -> bool {
    line_pattern!(r"(?i)\b\w*(Error|Exception)\b|error(\[\w+\])?:|\btraceback\b|\bfatal:|(?-i:\bFAIL(ED)?\b)|\bfailed\b|\bexit(ed)? (with )?code [1-9]|\bE\d{3}\b|\bno such file\b|\bpanicked\b")
        .is_match(line)
}

/// What a tool output (or console output pasted in a user turn) reports,
/// from one screening of its head and tail:
/// - the line that best says what went wrong: the first error line with
///   some words that `accept` takes (a bare "Exit code 2" only when there
///   is nothing better);
/// - the lines that report a milestone: tests passing, a commit, a push, a
///   task or issue closed;
/// - the files it says were changed ([`reported_file_changes`], from the
///   same lowered head).
pub(super) fn output_report(text: &str, accept: impl Fn(&str) -> bool) -> OutputReading {
    let mut pick = ErrorPick::default();
    let mut milestones = Vec::new();
    let head = Lowered::new(prefix_bytes(text, MINED_BYTES));
    let tail = Lowered::new(suffix_bytes(text, 2000));
    for part in [&head, &tail] {
        for line in screened_output_lines(part) {
            pick.offer(&line, &accept);
            add_milestone(&line, &mut milestones);
        }
    }
    OutputReading {
        error: pick.line(),
        milestones,
        file_changes: reported_file_changes(&head),
    }
}

/// A line of an output's head or tail, trimmed, as the error and milestone
/// checks read it.
struct OutputLine<'a> {
    line: &'a str,
    /// An error line ([`is_error_line`], asked only where the error screen
    /// hit).
    error: bool,
    /// Whether the test counts' screen hit it.
    counts_hit: bool,
}

/// The lines of `part` (an output's head, [`MINED_BYTES`], or its tail,
/// 2,000 bytes) as [`str::lines`] cuts them, each screened for errors and
/// test counts.
fn screened_output_lines<'a, 's>(
    part: &'s Lowered<'a>,
) -> impl Iterator<Item = OutputLine<'a>> + 's {
    part.lines_with_hits(error_screen())
        .zip(part.lines_with_hits(counts_screen()))
        .map(|((line, error_hit), (_, counts_hit))| {
            let line = line.trim();
            OutputLine {
                line,
                error: error_hit && is_screened_error_line(line),
                counts_hit,
            }
        })
}

/// The error line looked for, as lines are offered in order.
#[derive(Default)]
struct ErrorPick<'a> {
    found: Option<&'a str>,
    /// The first bare exit status or traceback header, kept in case nothing
    /// better comes.
    bare: Option<&'a str>,
}

impl<'a> ErrorPick<'a> {
    /// Takes `line` if it is the error line looked for.
    fn offer(&mut self, line: &OutputLine<'a>, accept: impl Fn(&str) -> bool) {
        if self.found.is_none() && line.error && accept(line.line) {
            if is_bare_exit(line.line) {
                self.bare = self.bare.or(Some(line.line));
            } else {
                self.found = Some(line.line);
            }
        }
    }

    fn line(self) -> Option<String> {
        self.found
            .or(self.bare)
            .map(|l| clip_words(l, RESULT_CHARS))
    }
}

/// The screen of the test counts among the milestone patterns, searched
/// in a [`Lowered`] text.
fn counts_screen() -> &'static Screen {
    crate::screen!("0 failures|passed|test result: ok")
}

/// Adds `line` to `out` (once) if it reports a milestone.
fn add_milestone(line: &OutputLine<'_>, out: &mut Vec<String>) {
    // Test counts anywhere in the line, screened; the rest are anchored at
    // the line's start (one alternation), so a line can match them only
    // when it starts, after its white space, with `[`, `Commit `, `✓ ` or
    // a hex digit, and the last only when it holds `..` (a line of a
    // numbered file listing starts with a digit, and few hold `..`).
    let counts = regex!(
        r"(?i)\b\d+ (tests?|examples?|specs?|doctests?|properties)\b[^\n]{0,40}\b0 failures\b|\b\d+ passed\b|\btest result: ok\b"
    );
    let at_start = regex!(
        r"^\s*\[[\w./-]+ [0-9a-f]{7,40}\] \S|^\s*Commit [0-9a-f]{7,40} \S|^\s*[0-9a-f]{7,40}\.\.[0-9a-f]{7,40}\s+\S+\s+->\s+\S+|^\s*✓ (Closed|Created|Merged|Completed|Resolved)\b"
    );
    let text = line.line;
    if text.is_empty() || line.error && !text.contains(" 0 fail") {
        return;
    }
    let start = text.trim_start();
    let may_start_one = start.starts_with(['[', 'C', '✓'])
        || start.starts_with(|c: char| matches!(c, '0'..='9' | 'a'..='f')) && start.contains("..");
    if line.counts_hit && counts.is_match(text) || may_start_one && at_start.is_match(text) {
        let l = clip_words(text, RESULT_CHARS);
        if !out.contains(&l) {
            out.push(l);
        }
    }
}

/// A sentence in which the agent says something is done (tests pass, a
/// commit or push, a task complete).
pub(super) fn claims_milestone(sentence: &str) -> bool {
    let screen = regex!(
        r"(?i-u:test|committed|pushed|merged|deployed|released|complete|done|fixed|resolved|closed|successfully)|[\x{17F}\x{212A}]"
    );
    let claim = line_pattern!(
        r"(?i)\b(all )?\d+ tests? (pass|passed|passing)\b|\btests? (all )?(pass|passed|passing)\b|\b(committed|pushed|merged|deployed|released)\b|\b(is|are|now) (now )?(complete|completed|done|fixed|resolved|closed)\b|\bcomplete\.|^(done|fixed|all done)\b|\bclosed \S+|\bsuccessfully (booked|cancell?ed|updated|changed|modified|processed|completed)\b"
    );
    screened(screen, claim, sentence)
}

/// A sentence that explains a failure: what went wrong and why.
pub(super) fn is_diagnosis(sentence: &str) -> bool {
    let failure_screen = regex!(
        r"(?i-u:fail|error|bug|issue|problem|broke|wrong|crash|exception)|[\x{17F}\x{212A}]"
    );
    let failure = line_pattern!(
        r"(?i)\b(fail(s|ed|ing|ure)?|errors?|bug|issue|problem|broke|broken|wrong|crash\w*|exception)\b"
    );
    let cause_screen = regex!(
        r"(?i-u:because|caused by|due to|comes from|root cause|the reason|is that|since the|so the|the issue|the problem|the bug|the cause|the error)|[\x{17F}\x{212A}]"
    );
    let cause = line_pattern!(
        r"(?i)\b(because|caused by|due to|comes from|root cause|the reason|is that|since the|so the)\b|\bthe (issue|problem|bug|cause|error) (is|was)\b"
    );
    screened(failure_screen, failure, sentence) && screened(cause_screen, cause, sentence)
}

/// A sentence that decides, chooses or gives a reason.
pub(super) fn is_decision(sentence: &str) -> bool {
    let screen = regex!(
        r"(?i-u:decid|decision|chose|choose|opt|ll use|going to use|instead|rather than|prefer|switch|settled on|agreed|the plan is|approach is|we will|go with|should|must not|want)|[\x{17F}\x{212A}]"
    );
    screened(screen, &DECISION, sentence)
}

/// A sentence saying what comes next.
pub(super) fn is_intention(sentence: &str) -> bool {
    line_pattern!(
        r"(?i)^(now,? |next,? |then,? |first,? |finally,? |so,? |ok,? |okay,? )?(let me|let's|let us|i'll|i will|i need to|i'm going to|i am going to|we need to|we should|the next step|next step|next,)\b"
    )
    .is_match(sentence)
}

/// A sentence that leaves something open (work not done, a question).
pub(super) fn is_open(sentence: &str) -> bool {
    let screen = regex!(
        r"(?i-u:todo|fixme|still |remaining|not yet|pending|open question|follow|tbd|left to do|yet to)|[\x{17F}\x{212A}]"
    );
    let open = line_pattern!(
        r"(?i)\b(todo|fixme|still (need|needs|to|missing)|remaining|not yet|pending|open question|follow[- ]up|tbd|left to do|yet to)\b"
    );
    screened(screen, open, sentence)
}

/// One call of an assistant turn, parsed back from its searchable text.
#[derive(Debug, Clone)]
pub(super) struct Call {
    pub(super) name: String,
    pub(super) arguments: String,
}

/// An assistant turn's searchable text split back into its words and its
/// calls (`name(arguments)` lines after the words, the first named
/// `first_call`).
pub(super) fn split_calls<'a>(text: &'a str, first_call: Option<&str>) -> (&'a str, Vec<Call>) {
    let (words, spans) = call_spans(text, first_call);
    let calls = spans
        .into_iter()
        .map(|span| Call {
            name: text[span.name].to_string(),
            arguments: text[span.arguments].to_string(),
        })
        .collect();
    (words, calls)
}

/// Where a call of [`split_calls`] lies in the text: its name and its
/// arguments.
pub(super) struct CallSpan {
    pub(super) name: std::ops::Range<usize>,
    pub(super) arguments: std::ops::Range<usize>,
}

/// [`split_calls`] as places in the text: its words, and each call's name
/// and arguments.
pub(super) fn call_spans<'a>(text: &'a str, first_call: Option<&str>) -> (&'a str, Vec<CallSpan>) {
    let Some(first) = first_call else {
        return (text, Vec::new());
    };
    let start = if text.starts_with(&format!("{first}(")) {
        Some(0)
    } else {
        text.find(&format!("\n{first}(")).map(|i| i + 1)
    };
    let Some(start) = start else {
        return (text, Vec::new());
    };
    let words = text[..start].trim_end();
    let mut calls = Vec::new();
    let rest = &text[start..];
    let starts: Vec<usize> = regex!(r"(?m)^[A-Za-z_][A-Za-z0-9_.\-]*\(")
        .find_iter(rest)
        .map(|m| m.start())
        .collect();
    for (k, &s) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(rest.len());
        let piece = rest[s..end].trim_end();
        if let Some(open) = piece.find('(') {
            let at = start + s;
            let arguments = &piece[open + 1..];
            let len = arguments.strip_suffix(')').unwrap_or(arguments).len();
            calls.push(CallSpan {
                name: at..at + open,
                arguments: at + open + 1..at + open + 1 + len,
            });
        }
    }
    (words, calls)
}

/// Keys of call arguments that name the file a call works on.
const PATH_KEYS: [&str; 8] = [
    "file_path",
    "path",
    "filename",
    "file",
    "target_file",
    "notebook_path",
    "filePath",
    "file_name",
];

pub(super) fn classify_call(call: &Call) -> CallKind {
    classify_parsed_call(call, call_arguments(call).as_ref())
}

/// A call's arguments read as JSON, when they are JSON.
pub(super) fn call_arguments(call: &Call) -> Option<CallArgs<'_>> {
    CallArgs::parse(&call.arguments)
}

/// [`classify_call`] with the call's arguments parsed already
/// ([`call_arguments`]): a draft reads a call's arguments (a written file's
/// whole content, often) once, not for each question it asks of them.
pub(super) fn classify_parsed_call(call: &Call, args: Option<&CallArgs>) -> CallKind {
    let name = call.name.to_lowercase();
    let string_arg =
        |keys: &[&str]| -> Option<String> { args?.first_string(keys).map(str::to_string) };
    if regex!(r"^(bash|shell|sh|zsh|run|exec|execute|terminal|command|cmd|run_command|execute_command|run_shell_command|run_terminal_cmd|shell_exec)$").is_match(&name) {
        let command = string_arg(&["command", "cmd", "script", "input"])
            .unwrap_or_else(|| call.arguments.clone());
        return CallKind::Shell(command);
    }
    if name == "think" || name.ends_with("_think") {
        return CallKind::Thought(string_arg(&["thought", "text", "content"]).unwrap_or_default());
    }
    let editing = regex!(
        r"(edit|write|create|patch|replace|insert|str_replace|notebook|save|overwrite|apply|update_file|append|delete_file|remove_file)"
    );
    if editing.is_match(&name) {
        if let Some(path) = string_arg(&PATH_KEYS) {
            let command = string_arg(&["command"]).unwrap_or_default();
            let verb = if name.contains("delete") || name.contains("remove") {
                "deleted"
            } else if name.contains("write")
                || name.contains("create")
                || command == "create"
                || name.contains("overwrite")
            {
                "written"
            } else {
                "edited"
            };
            return CallKind::File { path, verb };
        }
        if let Some(path) = patched_path(&call.arguments) {
            return CallKind::File {
                path,
                verb: "edited",
            };
        }
    }
    if regex!(r"^(get|read|search|list|find|grep|glob|view|open|cat|ls|fetch|look|lookup|query|show|describe|check|inspect|stat|head|tail|web|task|todo|calculate|scroll|goto|browse|navigate|screenshot|wait|sleep|submit)").is_match(&name)
        || regex!(r"(read|search|list|view|get_|find|lookup|query|fetch|output)").is_match(&name)
    {
        return CallKind::Read;
    }
    CallKind::Action
}

/// A tool that lists what exists (files, matches): its output names many
/// things the work was not about.
pub(super) fn is_listing_tool(name: &str) -> bool {
    regex!(r"(?i)^(glob|ls|find|list|list_dir|list_files|search|grep|find_file|search_dir|search_file|codebase_search|file_search)$")
        .is_match(name)
}

/// The first file an `apply_patch`-style patch names.
fn patched_path(arguments: &str) -> Option<String> {
    regex!(r"\*\*\* (?:Update|Add|Delete) File: (\S+)")
        .captures(arguments)
        .map(|c| c[1].to_string())
}

/// What an edit call changed, in a few words, from its arguments
/// ([`call_arguments`]): the first line its new text adds (for an edit with
/// old and new text), or a new file's first line.
pub(super) fn change_of(args: &CallArgs) -> Option<String> {
    let new = args.first_string(&[
        "new_string",
        "new_str",
        "newText",
        "new_text",
        "replace",
        "replacement",
    ]);
    let old = args
        .first_string(&["old_string", "old_str", "oldText", "old_text", "search"])
        .unwrap_or("");
    let content = args.first_string(&["content", "file_text", "text", "contents"]);
    let added = match (new, content) {
        (Some(new), _) => {
            // The first added line that says something (a keyword and a
            // brace say little), else the first added line.
            let old_lines: HashSet<&str> = old.lines().map(str::trim).collect();
            let added: Vec<&str> = new
                .lines()
                .map(str::trim)
                .filter(|l| has_alphanumerics(l, 4) && !old_lines.contains(l))
                .collect();
            added
                .iter()
                .find(|l| has_alphanumerics(l, 16))
                .or(added.first())
                .map(|l| format!("+ {}", clip_words(l, 90)))
        }
        (None, Some(content)) => content
            .lines()
            .map(str::trim)
            .find(|l| has_alphanumerics(l, 4))
            .map(|l| format!("new: {}", clip_words(l, 90))),
        (None, None) => None,
    };
    added
}

/// Files a shell command removes or moves, with the verb.
pub(super) fn shell_file_changes(command: &str) -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    for piece in command.split(['\n', ';', '&', '|']) {
        let words: Vec<&str> = piece.split_whitespace().collect();
        let (verb, args) = match words.as_slice() {
            ["git", "rm", rest @ ..] | ["rm", rest @ ..] => ("deleted", rest),
            ["git", "mv", rest @ ..] | ["mv", rest @ ..] => ("moved", rest),
            _ => continue,
        };
        let paths: Vec<&&str> = args.iter().filter(|a| !a.starts_with('-')).collect();
        match verb {
            "deleted" => {
                for p in paths {
                    out.push((p.trim_matches(['"', '\'']).to_string(), verb));
                }
            }
            _ => {
                if let [from, to] = paths.as_slice() {
                    out.push((
                        format!(
                            "{} -> {}",
                            from.trim_matches(['"', '\'']),
                            to.trim_matches(['"', '\''])
                        ),
                        verb,
                    ));
                }
            }
        }
    }
    out
}

/// Files a tool output says were written or edited ("File created
/// successfully at: X", "The file X has been updated", "Applied edit to
/// X", "Successfully wrote N bytes to X", "[File: X" followed by "File
/// updated"), read from the output's head ([`MINED_BYTES`]), lowered.
fn reported_file_changes(head: &Lowered<'_>) -> Vec<(String, &'static str)> {
    // Most outputs say none of it: one search for the words every report
    // holds spares the patterns' six.
    let screen = crate::screen!(
        "file created successfully|has been|applied edit to|successfully wr|successfully replaced text in|file updated"
    );
    if !head.has(screen) {
        return Vec::new();
    }
    file_changes_in(head.text)
}

/// [`reported_file_changes`] of an output's head, unscreened.
fn file_changes_in(head: &str) -> Vec<(String, &'static str)> {
    let mut out: Vec<(String, &'static str)> = Vec::new();
    let mut push = |path: &str, verb: &'static str| {
        let path = path
            .trim_matches(|c: char| matches!(c, '`' | '"' | '\'' | ',' | '.' | ':' | ')' | '('))
            .to_string();
        if path.len() > 2 && !out.iter().any(|(p, _)| *p == path) {
            out.push((path, verb));
        }
    };
    for c in regex!(r"(?i)file created successfully at:? (\S+)").captures_iter(head) {
        push(&c[1], "written");
    }
    for c in regex!(r"(?i)the file (\S+) has been (updated|edited|modified)").captures_iter(head) {
        push(&c[1], "edited");
    }
    for c in regex!(r"(?im)^applied edit to (\S+)").captures_iter(head) {
        push(&c[1], "edited");
    }
    for c in regex!(r"(?i)successfully (?:wrote|written) [\d,]+ bytes to (\S+)").captures_iter(head)
    {
        push(&c[1], "written");
    }
    for c in regex!(r"(?i)successfully replaced text in (\S+)").captures_iter(head) {
        push(&c[1], "edited");
    }
    if regex!(r"(?i)\bfile updated\b").is_match(head) {
        if let Some(c) = regex!(r"\[File: ([^\s\]]+)").captures(head) {
            push(&c[1], "edited");
        }
    }
    out
}

/// Files an assistant's words edit with SEARCH/REPLACE blocks (a path on
/// the line before the fence).
pub(super) fn search_replace_paths(words: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for c in regex!(r"(?m)^([\w./-]+\.\w+)\s*\n```[\w+-]*\s*\n<<<<<<< SEARCH").captures_iter(words)
    {
        let p = c[1].to_string();
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// The words of a user turn that read as a request: its lines of prose
/// (not output, code, markup or paths), joined.
pub(super) fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut in_fence = false;
    for line in lines(prefix_bytes(text, MINED_BYTES)) {
        let t = line.trim();
        if t.starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence || t.is_empty() {
            continue;
        }
        if t.starts_with(['[', '(', '{', '<', '>', '$', '|', '/', '\\', '+', '=', '@'])
            || is_listing_line(t)
            || looks_like_code(t)
        {
            continue;
        }
        let words: Vec<&str> = t.split_whitespace().collect();
        let wordy = words
            .iter()
            .filter(|w| w.chars().filter(|c| c.is_alphabetic()).count() * 2 > w.chars().count())
            .count();
        if words.len() < 3 || wordy * 3 < words.len() * 2 {
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(t);
    }
    out
}

/// The tail of `text` of at most `max` bytes, cut on a char boundary.
pub(super) fn suffix_bytes(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return "";
    }
    let mut start = text.len() - max;
    while start < text.len() && !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// At most `max` characters, whitespace collapsed, cut at a word boundary
/// with `…` when cut.
pub(super) fn clip_words(text: &str, max: usize) -> String {
    condense(text, max)
}

/// Whole sentences from the start of `text` (whitespace collapsed) up to
/// `max` characters; a first sentence longer than that is cut at a word
/// with `…`. Never ends in the middle of a sentence otherwise.
pub(super) fn sentences_up_to(text: &str, max: usize) -> String {
    // The sentences kept end within `max` characters of the flat text, and
    // whether the next one fits is known two characters past it: the
    // rest of a long text (a 6 KB narration for a 200-character fix) is
    // not flattened.
    let (flat, more) = condensed_prefix(text, max.saturating_add(2));
    if !more && flat.chars().count() <= max {
        return flat;
    }
    let mut out = String::with_capacity(flat.len());
    let mut chars = 0;
    for s in sentences(&flat) {
        let need = s.chars().count() + usize::from(!out.is_empty());
        if chars + need > max {
            break;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(s);
        chars += need;
    }
    if out.is_empty() {
        condense(&flat, max)
    } else {
        out
    }
}

/// The first `limit` characters of `condense(text, usize::MAX)`, and
/// whether it has more.
fn condensed_prefix(text: &str, limit: usize) -> (String, bool) {
    // Sized once: flattening never lengthens a text, and `limit`
    // characters take four bytes each at most (growing it a character at a
    // time reallocated it six times, from 8 bytes to 512, for a
    // 300-character turn).
    let mut out = String::with_capacity(text.len().min(limit.saturating_mul(4)));
    let mut count = 0usize;
    let mut pending_space = false;
    for c in text.chars() {
        if c.is_whitespace() {
            pending_space = !out.is_empty();
            continue;
        }
        if count == limit {
            return (out, true);
        }
        if pending_space {
            out.push(' ');
            count += 1;
            pending_space = false;
            if count == limit {
                return (out, true);
            }
        }
        out.push(c);
        count += 1;
    }
    (out, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn error_line(text: &str) -> Option<String> {
        output_report(text, |_| true).error
    }

    fn reported_error_line(text: &str) -> Option<String> {
        output_report(text, reports_an_error).error
    }

    fn milestone_lines(text: &str) -> Vec<String> {
        output_report(text, |_| true).milestones
    }

    fn file_changes(text: &str) -> Vec<(String, &'static str)> {
        output_report(text, |_| true).file_changes
    }

    /// The recognizers as they were before their screens: the oracle the
    /// screened ones must agree with on every text.
    mod unscreened {
        use super::super::*;

        pub(super) fn is_error_line(line: &str) -> bool {
            let strong = regex!(
                r"(?i)^\s*(error|fatal|panic|exception|traceback)\b|\b\w*(Error|Exception)\b:|\berror(\[\w+\])?:|\bfailed\b|(?-i:\bFAIL(ED)?\b)|\b[1-9]\d* (failures?|failed|errors?)\b|\bno such file\b|\bnot found\b|\bpermission denied\b|\b(cannot|could not|unable to)\b|\bexit(ed)? (with )?code [1-9]|\bE999\b|\bsyntax error"
            );
            strong.is_match(line)
                && !is_listing_line(line)
                && !regex!(r"(?i)\b0 (failures?|failed|errors?)\b").is_match(line)
        }

        pub(super) fn find_error_line(text: &str, accept: impl Fn(&str) -> bool) -> Option<String> {
            let head = prefix_bytes(text, MINED_BYTES);
            let tail = suffix_bytes(text, 2000);
            let mut bare = None;
            for line in head.lines().chain(tail.lines()) {
                let line = line.trim();
                if !is_error_line(line) || !accept(line) {
                    continue;
                }
                if is_bare_exit(line) {
                    bare = bare.or(Some(line));
                    continue;
                }
                return Some(clip_words(line, RESULT_CHARS));
            }
            bare.map(|l| clip_words(l, RESULT_CHARS))
        }

        pub(super) fn reported_error_line(text: &str) -> Option<String> {
            find_error_line(text, |line| {
                regex!(r"(?i)\b\w*(Error|Exception)\b|error(\[\w+\])?:|\btraceback\b|\bfatal:|(?-i:\bFAIL(ED)?\b)|\bfailed\b|\bexit(ed)? (with )?code [1-9]|\bE\d{3}\b|\bno such file\b|\bpanicked\b")
                    .is_match(line)
            })
        }

        pub(super) fn milestone_lines(text: &str) -> Vec<String> {
            let patterns = [
                regex!(
                    r"(?i)\b\d+ (tests?|examples?|specs?|doctests?|properties)\b[^\n]{0,40}\b0 failures\b"
                ),
                regex!(r"(?i)\b\d+ passed\b"),
                regex!(r"(?i)\btest result: ok\b"),
                regex!(r"^\s*\[[\w./-]+ [0-9a-f]{7,40}\] \S"),
                regex!(r"^\s*Commit [0-9a-f]{7,40} \S"),
                regex!(r"^\s*[0-9a-f]{7,40}\.\.[0-9a-f]{7,40}\s+\S+\s+->\s+\S+"),
                regex!(r"^\s*✓ (Closed|Created|Merged|Completed|Resolved)\b"),
            ];
            let mut out: Vec<String> = Vec::new();
            let head = prefix_bytes(text, MINED_BYTES);
            let tail = suffix_bytes(text, 2000);
            for line in head.lines().chain(tail.lines()) {
                let line = line.trim();
                if line.is_empty() || is_error_line(line) && !line.contains(" 0 fail") {
                    continue;
                }
                if patterns.iter().any(|p| p.is_match(line)) {
                    let l = clip_words(line, RESULT_CHARS);
                    if !out.contains(&l) {
                        out.push(l);
                    }
                }
            }
            out
        }

        pub(super) fn claims_milestone(sentence: &str) -> bool {
            regex!(
                r"(?i)\b(all )?\d+ tests? (pass|passed|passing)\b|\btests? (all )?(pass|passed|passing)\b|\b(committed|pushed|merged|deployed|released)\b|\b(is|are|now) (now )?(complete|completed|done|fixed|resolved|closed)\b|\bcomplete\.|^(done|fixed|all done)\b|\bclosed \S+|\bsuccessfully (booked|cancell?ed|updated|changed|modified|processed|completed)\b"
            )
            .is_match(sentence)
        }

        pub(super) fn is_diagnosis(sentence: &str) -> bool {
            regex!(r"(?i)\b(fail(s|ed|ing|ure)?|errors?|bug|issue|problem|broke|broken|wrong|crash\w*|exception)\b").is_match(sentence)
                && regex!(r"(?i)\b(because|caused by|due to|comes from|root cause|the reason|is that|since the|so the)\b|\bthe (issue|problem|bug|cause|error) (is|was)\b").is_match(sentence)
        }

        pub(super) fn is_decision(sentence: &str) -> bool {
            DECISION.is_match(sentence)
        }

        pub(super) fn is_open(sentence: &str) -> bool {
            regex!(
                r"(?i)\b(todo|fixme|still (need|needs|to|missing)|remaining|not yet|pending|open question|follow[- ]up|tbd|left to do|yet to)\b"
            )
            .is_match(sentence)
        }
    }

    /// Pieces of tool output and of agent prose, the recognizers' words in
    /// several cases, and non-ASCII text: accented and non-Latin words,
    /// the arrow of numbered listings, and the two characters a
    /// case-insensitive Unicode pattern takes for `s` and `k`.
    const PIECES: &[&str] = &[
        "error",
        "Error",
        "ERROR",
        "error:",
        "error[E0308]:",
        "TypeError:",
        "ValueError",
        "Exception",
        "exception",
        "traceback",
        "Traceback",
        "fatal:",
        "panic",
        "panicked",
        "failed",
        "FAILED",
        "FAIL",
        "fail",
        "failures",
        "1 failure",
        "3 failed",
        "0 failures",
        "0 errors",
        "2 errors",
        "no such file",
        "No such file",
        "not found",
        "permission denied",
        "cannot",
        "could not",
        "unable to",
        "exit code 1",
        "Exit code 2",
        "exited with code 3",
        "E999",
        "syntax error",
        "389 tests, 0 failures",
        "12 passed",
        "test result: ok",
        "[main 3114215] feat",
        "Commit 0a3c6bf fix",
        "f0b86dd..3114215  main -> main",
        "✓ Closed",
        "✓ Resolved",
        "all 12 tests pass",
        "tests passed",
        "committed",
        "pushed",
        "is now complete",
        "complete.",
        "done",
        "fixed",
        "closed x",
        "successfully booked",
        "because",
        "caused by",
        "due to",
        "the reason",
        "is that",
        "the issue is",
        "the bug was",
        "bug",
        "issue",
        "problem",
        "broken",
        "wrong",
        "crashed",
        "decided",
        "decision",
        "chose",
        "opted for",
        "we'll use",
        "I'll use",
        "instead",
        "rather than",
        "prefer",
        "switched to",
        "settled on",
        "agreed",
        "the plan is",
        "we will",
        "let's go with",
        "should be",
        "must not",
        "don't want",
        "I want",
        "todo",
        "TODO",
        "FIXME",
        "still need",
        "remaining",
        "not yet",
        "pending",
        "follow-up",
        "follow up",
        "tbd",
        "left to do",
        "yet to",
        "Let me",
        "next,",
        "Now, let me",
        "31→",
        "  42→ ",
        "é",
        "éerror",
        "errorß",
        "naïve",
        "→",
        "✓",
        "日本語",
        "ſ",
        "\u{212A}",
        "no ſuch file",
        "tracebac\u{212A}",
        "ſucceſſfully",
        "Ωmega",
        "İ",
        "ı",
        "ǅ",
        "ﬁ",
        "x",
        "foo",
        "bar_baz",
        "123",
        "7",
        ":",
        ";",
        ".",
        ". ",
        "!",
        "?",
        "(",
        ")",
        "{",
        "}",
        "=",
        "\"",
        "[",
        "]",
        "/",
        "-",
        "_",
        "1480:",
        "  ",
        "\t",
        " ",
        "\r",
        "Exit code 1\n",
        // What an ASCII twin (`core::line_pattern`) must not be used on:
        // Unicode white space, digits and marks; and what it may be.
        "\u{3000}",
        "\u{a0}",
        "٣",
        "e\u{301}",
        "—",
        "“",
    ];

    fn text(max_pieces: usize) -> impl Strategy<Value = String> {
        prop_oneof![
            4 => prop::collection::vec(prop::sample::select(PIECES), 0..max_pieces)
                .prop_map(|pieces| pieces.join(" ")),
            2 => prop::collection::vec(prop::sample::select(PIECES), 0..max_pieces)
                .prop_map(|pieces| pieces.concat()),
            1 => "\\PC{0,60}",
        ]
    }

    /// What tools say when they change a file, and near misses.
    const FILE_REPORTS: &[&str] = &[
        "File created successfully at: /w/a.ex",
        "file created successfully at /w/b.ex",
        "The file /w/c.ex has been updated",
        "the file src/d.rs has been modified.",
        "Applied edit to src/e.py",
        "Successfully wrote 1,204 bytes to /w/f.txt",
        "successfully written 12 bytes to g.md",
        "Successfully replaced text in /w/h.ts",
        "[File: /repo/i.py (3 lines total)]",
        "File updated. Please review.",
        "ſucceſſfully wrote 3 bytes to /w/j.txt",
        "the file has been",
        "applied edit",
    ];

    fn lines() -> impl Strategy<Value = String> {
        (
            prop::collection::vec(text(10), 0..8),
            prop::sample::select(&["\n", "\r\n", "\n\n"][..]),
        )
            .prop_map(|(lines, end)| lines.join(end))
    }

    /// Outputs longer than the head and the tail the recognizers read.
    fn long_lines() -> impl Strategy<Value = String> {
        prop::collection::vec(text(10), 100..900).prop_map(|lines| lines.join("\n"))
    }

    /// [`sentences_up_to`] as it was, flattening the whole text first.
    fn sentences_up_to_whole(text: &str, max: usize) -> String {
        let flat = condense(text, usize::MAX);
        if flat.chars().count() <= max {
            return flat;
        }
        let mut out = String::new();
        for s in crate::core::fallback_summary::notes::sentences(&flat) {
            let need = s.chars().count() + usize::from(!out.is_empty());
            if out.chars().count() + need > max {
                break;
            }
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(s);
        }
        if out.is_empty() {
            condense(&flat, max)
        } else {
            out
        }
    }

    /// Sentences of words and spaces of any kind, ending at every mark
    /// (a mark followed by a space or not, at the text's end or not).
    fn prose_text() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            "[a-zé]{1,9}",
            Just(" ".to_string()),
            Just("  ".to_string()),
            Just("\n".to_string()),
            Just("\t ".to_string()),
            Just(". ".to_string()),
            Just("? ".to_string()),
            Just("!".to_string()),
            Just(".".to_string()),
            Just("\u{a0}".to_string()),
            Just("日本".to_string()),
        ];
        prop::collection::vec(piece, 0..80).prop_map(|pieces| pieces.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn sentences_up_to_reads_only_what_it_keeps(text in prose_text(), max in 0usize..90) {
            prop_assert_eq!(sentences_up_to(&text, max), sentences_up_to_whole(&text, max));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn screened_long_outputs_agree_with_the_unscreened_patterns(text in long_lines()) {
            prop_assert_eq!(milestone_lines(&text), unscreened::milestone_lines(&text));
            prop_assert_eq!(error_line(&text), unscreened::find_error_line(&text, |_| true));
            prop_assert_eq!(reported_error_line(&text), unscreened::reported_error_line(&text));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn screened_line_checks_agree_with_the_unscreened_patterns(line in text(12)) {
            prop_assert_eq!(is_error_line(&line), unscreened::is_error_line(&line));
            prop_assert_eq!(claims_milestone(&line), unscreened::claims_milestone(&line));
            prop_assert_eq!(is_diagnosis(&line), unscreened::is_diagnosis(&line));
            prop_assert_eq!(is_decision(&line), unscreened::is_decision(&line));
            prop_assert_eq!(is_open(&line), unscreened::is_open(&line));
        }

        #[test]
        fn screened_file_changes_are_the_unscreened_ones(
            reports in prop::collection::vec(
                (prop::sample::select(FILE_REPORTS), text(3), any::<bool>()),
                0..6,
            ),
        ) {
            // Reports in any case, between other words.
            let text: String = reports
                .iter()
                .map(|(report, words, upper)| {
                    let report = if *upper { report.to_uppercase() } else { report.to_string() };
                    format!("{words} {report} {words}\n")
                })
                .collect();
            prop_assert_eq!(
                file_changes(&text),
                file_changes_in(prefix_bytes(&text, MINED_BYTES))
            );
        }

        #[test]
        fn screened_output_lines_agree_with_the_unscreened_patterns(text in lines()) {
            prop_assert_eq!(milestone_lines(&text), unscreened::milestone_lines(&text));
            prop_assert_eq!(error_line(&text), unscreened::find_error_line(&text, |_| true));
            prop_assert_eq!(reported_error_line(&text), unscreened::reported_error_line(&text));
        }
    }

    /// The screens add `[\x{17F}\x{212A}]` (a [`Screen`] searches them
    /// apart) because those are the only characters outside ASCII that a
    /// case-insensitive pattern matches for an ASCII letter; a new Unicode
    /// table in the regex crate that adds one must fail here.
    #[test]
    fn only_two_characters_fold_to_ascii_letters() {
        let letter = Regex::new(r"(?i)^[a-z]$").unwrap();
        let folding: Vec<char> = (0x80..=0x10FFFFu32)
            .filter_map(char::from_u32)
            .filter(|c| letter.is_match(c.encode_utf8(&mut [0; 4])))
            .collect();
        assert_eq!(folding, vec!['\u{17F}', '\u{212A}']);
    }

    /// The patterns asked of every screened line of an output run as their
    /// ASCII twin where it answers the same (`core::line_pattern`): an edit
    /// that adds a `\S`, a `.` or a negated class loses the twin.
    #[test]
    fn the_line_patterns_keep_their_ascii_twins() {
        assert!(error_pattern().has_twin());
        assert!(super::super::notes::DECISION.has_twin());
        assert!(crate::core::mask::telling_patterns_have_twins());
    }

    #[test]
    fn errors_are_told_from_listings_and_passing_counts() {
        assert!(is_error_line(
            "error: undefined function find_transcript_file/1"
        ));
        assert!(is_error_line(
            "AttributeError: Unable to convert the pixel data"
        ));
        assert!(is_error_line("- E999 SyntaxError: unmatched ']'"));
        assert!(is_error_line(
            "fatal: The current branch spotter-a0y has no upstream branch."
        ));
        assert!(!is_error_line("389 tests, 0 failures"));
        assert!(!is_error_line("293:        raise AttributeError("));
        assert!(!is_error_line("{:error, reason} ->"));
        assert_eq!(
            error_line("Exit code 2\nChecking 3 source files\n  [F] error: nested too deep\n")
                .as_deref(),
            Some("[F] error: nested too deep")
        );
        assert_eq!(error_line("Exit code 1\n").as_deref(), Some("Exit code 1"));
        assert_eq!(error_line("all good"), None);
    }

    #[test]
    fn milestones_are_found_in_output() {
        let out = "Finished in 0.7 seconds\n389 tests, 0 failures\n\
                   [spotter-a0y 3114215] feat: wire live activity\n \
                   f0b86dd..3114215  spotter-a0y -> spotter-a0y\n✓ Closed spotter-a0y.4: Wired PubSub\n\
                   Commit 0a3c6bf feat: Change blue color to light blue\n3 tests, 1 failure";
        let m = milestone_lines(out);
        assert_eq!(m.len(), 5, "{m:?}");
        assert!(claims_milestone("All 389 tests pass, 0 failures."));
        assert!(claims_milestone("Epic spotter-a0y is complete."));
        assert!(!claims_milestone("Let me run the tests."));
    }

    #[test]
    fn calls_are_split_back_and_classified() {
        let text = "Now add the identity to Message.\nEdit({\"file_path\":\"lib/m.ex\",\"old_string\":\"  end\\nend\",\"new_string\":\"  end\\n  identities do\\n    identity :unique_session, [:a]\\n  end\\nend\"})\nBash({\"command\":\"rm priv/x.exs && mix test\"})";
        let (words, calls) = split_calls(text, Some("Edit"));
        assert_eq!(words, "Now add the identity to Message.");
        assert_eq!(calls.len(), 2);
        assert_eq!(
            classify_call(&calls[0]),
            CallKind::File {
                path: "lib/m.ex".into(),
                verb: "edited"
            }
        );
        assert_eq!(
            call_arguments(&calls[0])
                .as_ref()
                .and_then(change_of)
                .as_deref(),
            Some("+ identity :unique_session, [:a]")
        );
        let CallKind::Shell(cmd) = classify_call(&calls[1]) else {
            panic!("{calls:?}");
        };
        assert_eq!(
            shell_file_changes(&cmd),
            vec![("priv/x.exs".to_string(), "deleted")]
        );
        let read = Call {
            name: "get_reservation_details".into(),
            arguments: "{}".into(),
        };
        assert_eq!(classify_call(&read), CallKind::Read);
        let act = Call {
            name: "update_reservation_flights".into(),
            arguments: "{}".into(),
        };
        assert_eq!(classify_call(&act), CallKind::Action);
    }

    #[test]
    fn file_changes_are_read_from_tool_output_and_words() {
        let out = "File created successfully at: /w/lib/a.ex\nThe file /w/lib/b.ex has been updated successfully.";
        assert_eq!(
            file_changes(out),
            vec![
                ("/w/lib/a.ex".to_string(), "written"),
                ("/w/lib/b.ex".to_string(), "edited")
            ]
        );
        let swe = "[File: /repo/pkg/handler.py (373 lines total)]\n(236 more lines above)\nFile updated. Please review.";
        assert_eq!(file_changes(swe)[0].0, "/repo/pkg/handler.py");
        let words = "Here is the change:\n\nbenchmark/over_time.py\n```python\n<<<<<<< SEARCH\nx\n=======\ny\n>>>>>>> REPLACE\n```";
        assert_eq!(search_replace_paths(words), vec!["benchmark/over_time.py"]);
    }

    #[test]
    fn prose_keeps_the_request_and_drops_output() {
        let text = "the graph comes out with no data on it?\n[File: a.py (3 lines)]\n1: x = 1\n```\ncode here\n```\nTokens: 4,331 sent, 541 received.";
        assert_eq!(prose(text), "the graph comes out with no data on it?");
        assert_eq!(
            sentences_up_to("One two three. Four five six. Seven.", 20),
            "One two three."
        );
    }
}
