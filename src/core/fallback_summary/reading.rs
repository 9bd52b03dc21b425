//! What a draft reads of each source on its own ([`SourceReading`]): the
//! output's error, milestones and file changes, and the identifiers. Taken
//! here for each source, unless the source carries one read ahead (by
//! `run`'s measurer, on its other core) from the same text: a reading is
//! used only for the role, tool and text (by digest) it was taken from, so
//! the draft is the same either way.

use super::signals::*;
use crate::core::identifiers;
use crate::core::message::{Role, DEMONSTRATION_NAME};
use crate::core::summary::{IdentifierReading, OutputReading, SourceItem, SourceReading};
use std::borrow::Cow;
use std::collections::HashSet;

/// Reads `item`: its output always, its identifiers when `identifiers`.
pub fn read_source(item: &SourceItem, identifiers: bool) -> SourceReading {
    SourceReading {
        role: item.role,
        tool: item.tool.clone(),
        text_digest: digest(&item.text),
        output: read_output(item),
        identifiers: identifiers.then(|| read_identifiers(item)),
    }
}

/// What `item`'s output says: read ahead, or read now.
pub(super) fn output_of(item: &SourceItem) -> Cow<'_, OutputReading> {
    match read_ahead(item) {
        Some(reading) => Cow::Borrowed(&reading.output),
        None => Cow::Owned(read_output(item)),
    }
}

/// `item`'s identifiers: read ahead, or read now.
pub(super) fn identifiers_of(item: &SourceItem) -> Cow<'_, IdentifierReading> {
    match read_ahead(item).and_then(|r| r.identifiers.as_ref()) {
        Some(reading) => Cow::Borrowed(reading),
        None => Cow::Owned(read_identifiers(item)),
    }
}

/// The reading `item` carries, when it was taken from `item` as it is.
fn read_ahead(item: &SourceItem) -> Option<&SourceReading> {
    let reading = item.read_ahead.0.as_deref().filter(|r| {
        r.role == item.role && r.tool == item.tool && r.text_digest == digest(&item.text)
    });
    #[cfg(test)]
    if let Some(r) = reading {
        if let Ok(mut used) = READINGS_USED.lock() {
            used.insert(r.text_digest);
        }
    }
    reading
}

/// The texts (by digest) whose readings drafts used, in this process:
/// drafts run on other threads than the tests that start them, and tests
/// run beside each other, so a test asks about its own texts.
#[cfg(test)]
static READINGS_USED: std::sync::Mutex<std::collections::BTreeSet<[u8; 32]>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Whether a draft used the reading of a text of digest `text_digest`.
#[cfg(test)]
pub(crate) fn reading_used(text_digest: &[u8; 32]) -> bool {
    READINGS_USED
        .lock()
        .is_ok_and(|used| used.contains(text_digest))
}

fn digest(text: &str) -> [u8; 32] {
    *blake3::hash(text.as_bytes()).as_bytes()
}

/// The error a tool's result reports (or one pasted in a user's turn), its
/// milestones and the files it says were changed; nothing for other turns
/// and for a demonstration.
fn read_output(item: &SourceItem) -> OutputReading {
    let text = item.text.as_str();
    match item.role {
        Some(Role::User) if item.tool.as_deref() == Some(DEMONSTRATION_NAME) => {
            OutputReading::default()
        }
        Some(Role::User) => output_report(text, reports_an_error),
        Some(Role::Tool) => output_report(text, |_| true),
        _ => OutputReading::default(),
    }
}

/// The identifiers of `item`'s text and, for an assistant's turn, its
/// calls' names and the identifiers of the ones that act.
fn read_identifiers(item: &SourceItem) -> IdentifierReading {
    let mut acted: Vec<String> = Vec::new();
    let mut calls = Vec::new();
    if item.role == Some(Role::Assistant) {
        let (_, split) = split_calls(&item.text, item.tool.as_deref());
        let mut seen: HashSet<String> = HashSet::new();
        for call in split {
            if matches!(
                classify_call(&call),
                CallKind::File { .. } | CallKind::Shell(_) | CallKind::Action
            ) {
                for id in identifiers::extract(&call.arguments) {
                    if seen.insert(id.clone()) {
                        acted.push(id);
                    }
                }
            }
            calls.push(call.name);
        }
    }
    IdentifierReading {
        identifiers: identifiers::extract(&item.text),
        acted,
        calls,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(role: Role, tool: Option<&str>, text: &str) -> SourceItem {
        SourceItem {
            label: "turn 1".into(),
            role: Some(role),
            tool: tool.map(str::to_string),
            text: text.into(),
            ..SourceItem::default()
        }
    }

    #[test]
    fn a_reading_is_used_only_for_the_text_it_was_taken_from() {
        let output = "running 3 tests\nerror[E0308]: mismatched types at src/lib.rs:4\n";
        let mut source = item(Role::Tool, Some("Bash"), output);
        let mut reading = read_source(&source, true);
        assert_eq!(output_of(&source).error, read_output(&source).error);
        // A reading that says something else, carried by the same text, is
        // used (the shortcut) ...
        reading.output.error = Some("read ahead".into());
        source.read_ahead.0 = Some(std::sync::Arc::new(reading.clone()));
        assert_eq!(output_of(&source).error.as_deref(), Some("read ahead"));
        // ... and never for another text, role or tool.
        let mut other_text = source.clone();
        other_text.text.push('x');
        assert_ne!(output_of(&other_text).error.as_deref(), Some("read ahead"));
        let mut other_role = source.clone();
        other_role.role = Some(Role::User);
        assert_ne!(output_of(&other_role).error.as_deref(), Some("read ahead"));
        let mut other_tool = source.clone();
        other_tool.tool = Some("Read".into());
        assert_ne!(output_of(&other_tool).error.as_deref(), Some("read ahead"));
        // Output only: the identifiers are read from the text.
        reading.identifiers = None;
        source.read_ahead.0 = Some(std::sync::Arc::new(reading));
        assert_eq!(
            identifiers_of(&source).identifiers,
            identifiers::extract(output)
        );
    }

    #[test]
    fn an_assistant_turn_reads_its_calls_and_what_they_act_on() {
        let text = "I'll fix it.\nEdit({\"file_path\": \"/repo/src/lib.rs\", \"old_string\": \"a\", \"new_string\": \"b\"})\nRead({\"file_path\": \"/repo/README.md\"})";
        let source = item(Role::Assistant, Some("Edit"), text);
        let reading = read_identifiers(&source);
        assert_eq!(reading.calls, vec!["Edit".to_string(), "Read".to_string()]);
        assert!(reading.acted.contains(&"/repo/src/lib.rs".to_string()));
        assert!(!reading.acted.contains(&"/repo/README.md".to_string()));
        assert_eq!(reading.identifiers, identifiers::extract(text));
    }
}
