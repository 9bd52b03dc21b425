//! Reading a child summary back into sections: this summarizer's own
//! headings, any markdown with headings, or plain prose.

use super::*;

#[derive(Default)]
pub(super) struct ChildSections {
    pub(super) asked: Vec<String>,
    pub(super) done: Vec<String>,
    pub(super) decisions: Vec<String>,
    pub(super) open: Vec<String>,
    pub(super) files: Vec<String>,
    pub(super) identifiers: Vec<String>,
}

/// Reads a child summary: this summarizer's own sections, or any markdown
/// with headings, or plain prose (whose lines count as Done, and whose
/// sentences are mined for decisions and open items).
pub(super) fn parse_child(text: &str) -> ChildSections {
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
