//! Reading a child summary back into sections: this summarizer's own
//! headings (and those of its earlier versions), any markdown with
//! headings (a model's summary), or plain prose.

use super::signals::*;
use super::*;

#[derive(Default)]
pub(super) struct ChildSections {
    pub(super) task: Vec<String>,
    pub(super) progress: Vec<String>,
    pub(super) files: Vec<FileEntry>,
    pub(super) errors: Vec<String>,
    pub(super) decisions: Vec<String>,
    pub(super) done: Vec<String>,
    pub(super) open: Vec<String>,
    pub(super) next: Option<String>,
    pub(super) identifiers: Vec<String>,
}

#[derive(Clone, Copy)]
enum Into {
    Task,
    Progress,
    Files,
    Errors,
    Decisions,
    Done,
    Open,
    Next,
    Identifiers,
}

/// Which section a heading's words name.
fn section_of(heading: &str) -> Into {
    let h = heading.to_lowercase();
    if h.contains("identifier") {
        Into::Identifiers
    } else if h.contains("file") {
        Into::Files
    } else if h.contains("error") || h.contains("fix") || h.contains("problem") {
        Into::Errors
    } else if h.contains("decision") {
        Into::Decisions
    } else if h.contains("next") {
        Into::Next
    } else if h.contains("open")
        || h.contains("todo")
        || h.contains("block")
        || h.contains("pending")
        || h.contains("question")
    {
        Into::Open
    } else if h.contains("task")
        || h.contains("ask")
        || h.contains("request")
        || h.contains("goal")
        || h.contains("user")
        || h.contains("intent")
    {
        Into::Task
    } else if h.contains("done") || h.contains("complet") || h.contains("milestone") {
        Into::Done
    } else {
        Into::Progress
    }
}

/// Reads a child summary: sections by their headings, the lines of
/// `Files changed` back into entries (so a file changed in several children
/// is one entry), and prose (a model's summary without headings) mined
/// sentence by sentence.
pub(super) fn parse_child(text: &str) -> ChildSections {
    let mut child = ChildSections::default();
    let mut into = Into::Progress;
    let mut structured = false;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        if i == 0 && line.contains("deterministic") {
            continue;
        }
        if let Some(heading) = line.strip_prefix('#') {
            structured = true;
            into = section_of(heading.trim_start_matches('#').trim());
            continue;
        }
        // `Exact identifiers:` as the model path appends it.
        if line.trim_end_matches(':') == "Exact identifiers" {
            structured = true;
            into = Into::Identifiers;
            continue;
        }
        let item = line
            .strip_prefix("- ")
            .or_else(|| line.strip_prefix("* "))
            .unwrap_or(line)
            .to_string();
        // A lead-in ("You'll need to:", a model copying a turn's first
        // line) tells nothing by itself: the items of its list, when one
        // came, are lines of their own.
        if item.ends_with(':') && !matches!(into, Into::Identifiers) {
            continue;
        }
        match into {
            Into::Progress if !structured => mine_prose(&mut child, &item),
            Into::Progress => child.progress.push(item),
            Into::Task => child.task.push(item),
            Into::Files => child.files.push(parse_file_line(&item)),
            Into::Errors => child.errors.push(item),
            Into::Decisions => child.decisions.push(item),
            Into::Done => child.done.push(item),
            Into::Open => child.open.push(item),
            Into::Next => child.next = Some(item),
            Into::Identifiers => child.identifiers.push(item),
        }
    }
    child
}

/// A prose line of a model's summary: its sentences sorted by what they
/// say; the line itself is progress.
fn mine_prose(child: &mut ChildSections, line: &str) {
    for sentence in sentences(line) {
        if sentence.len() < 12 {
            continue;
        }
        let s = sentences_up_to(sentence, SENTENCE_CHARS);
        if is_error_line(sentence) {
            child.errors.push(s);
        } else if claims_milestone(sentence) {
            child.done.push(s);
        } else if is_decision(sentence) {
            child.decisions.push(s);
        } else if is_open(sentence) {
            child.open.push(s);
        }
    }
    child.progress.push(line.to_string());
}

/// `path (edited, written in turns 3, 7): what; what` back into an entry;
/// any other line is a path alone.
fn parse_file_line(line: &str) -> FileEntry {
    let (head, what) = match line.split_once("): ") {
        Some((h, w)) => (format!("{h})"), w),
        None => (line.to_string(), ""),
    };
    let (path, verbs, turns) = match head.split_once(" (") {
        Some((path, rest)) => {
            let inner = rest.trim_end_matches(')');
            let (verbs, turns) = match inner.split_once(" in turn") {
                Some((v, t)) => (v, t),
                None if inner.starts_with("in turn") => ("", &inner[7..]),
                None => (inner, ""),
            };
            let verbs: Vec<String> = verbs
                .split(", ")
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_string)
                .collect();
            let turns: Vec<String> = turns
                .trim_start_matches('s')
                .split(", ")
                .map(str::trim)
                .filter(|t| !t.is_empty() && *t != "…")
                .map(|t| format!("turn {t}"))
                .collect();
            (path.to_string(), verbs, turns)
        }
        None => (
            head.trim_end_matches(')').to_string(),
            Vec::new(),
            Vec::new(),
        ),
    };
    FileEntry {
        path,
        verbs,
        turns,
        what: what
            .split("; ")
            .map(str::trim)
            .filter(|w| !w.is_empty())
            .map(str::to_string)
            .collect(),
        at: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_line_reads_back_into_its_entry() {
        let e = FileEntry {
            path: "lib/a.ex".into(),
            verbs: vec!["edited".into(), "written".into()],
            turns: vec!["turn 3".into(), "turn 7".into()],
            what: vec!["Now add the identity.".into(), "+ identity :u".into()],
            at: 0,
        };
        let back = parse_file_line(&e.render(2));
        assert_eq!(back.path, e.path);
        assert_eq!(back.verbs, e.verbs);
        assert_eq!(back.turns, e.turns);
        assert_eq!(back.what, e.what);
        let one = parse_file_line("/srv/x.py");
        assert_eq!(one.path, "/srv/x.py");
        assert!(one.verbs.is_empty());
    }

    #[test]
    fn a_model_summary_is_read_by_its_headings_or_its_sentences() {
        let md = "## Goal\nFix the deploy.\n## Key files\n- deploy.sh\n## Next steps\n- rerun it\n\nExact identifiers:\n- 10.0.0.1";
        let c = parse_child(md);
        assert_eq!(c.task, vec!["Fix the deploy."]);
        assert_eq!(c.files[0].path, "deploy.sh");
        assert_eq!(c.next.as_deref(), Some("rerun it"));
        assert_eq!(c.identifiers, vec!["10.0.0.1"]);
        let prose = parse_child(
            "The agent switched to redb instead of sled because sled stalled. All 12 tests pass now.",
        );
        assert_eq!(prose.decisions.len(), 1, "{:?}", prose.decisions);
        assert_eq!(prose.done.len(), 1, "{:?}", prose.done);
        assert_eq!(prose.progress.len(), 1);
    }

    /// A depth-2 summary of the real-model run carried a Progress item
    /// "You'll need to:" (a model child's copy of a turn's first line)
    /// into every summary above it.
    #[test]
    fn a_lead_in_without_its_list_is_not_carried() {
        let c = parse_child(
            "The agent added the touch calls.\n## Progress\n- You'll need to:\n\
             - wired the registry\n## Files changed\n- Changed:\n- lib/a.ex (edited in turn 3)",
        );
        assert_eq!(
            c.progress,
            vec!["The agent added the touch calls.", "wired the registry"]
        );
        assert_eq!(c.files.len(), 1);
        assert_eq!(c.files[0].path, "lib/a.ex");
    }
}
