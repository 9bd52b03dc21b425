//! What a draft reads of each source on its own ([`SourceReading`]): the
//! output's error, milestones and file changes, and the identifiers. Taken
//! here for each source, unless the source carries one read ahead (by
//! `run`'s measurer, on its other core) from the same text: a reading is
//! used only for the role, tool and text it was taken from (a short text
//! compared byte for byte, a long one by digest: [`ReadText`]), so the
//! draft is the same either way. A reading also keeps the turn's notes
//! ([`TurnNotes`]) once a draft has taken them, for the next draft of the
//! same turn (a rolling state's, then a leaf's).

use super::signals::*;
use crate::core::identifiers;
use crate::core::message::{Role, DEMONSTRATION_NAME};
use crate::core::summary::{IdentifierReading, OutputReading, ReadText, SourceItem, SourceReading};
use crate::core::turn_notes::{CallKind, TurnNotes};
use std::borrow::Cow;
use std::collections::HashSet;

/// Reads `item`: its output always, its identifiers when `identifiers`.
pub fn read_source(item: &SourceItem, identifiers: bool) -> SourceReading {
    SourceReading {
        role: item.role,
        tool: item.tool.clone(),
        text: ReadText::of(&item.text),
        output: read_output(item),
        identifiers: identifiers.then(|| read_identifiers(item)),
        notes: std::sync::OnceLock::new(),
    }
}

/// What a draft reads of one source in its notes: its output's signals
/// and its own notes ([`TurnNotes`]).
pub(super) struct Read<'a> {
    pub(super) output: Cow<'a, OutputReading>,
    pub(super) notes: Cow<'a, TurnNotes>,
}

/// The reading each source carries, where it was taken from the source
/// as it is: checked once per draft, for its notes and its identifiers.
pub(super) fn readings_of(sources: &[SourceItem]) -> Vec<Option<&SourceReading>> {
    sources.iter().map(read_ahead).collect()
}

/// What `item`'s output says and what it notes on its own: from its
/// reading (`readings_of`; its notes taken by the first draft to need
/// them and kept there for the next), or read now.
pub(super) fn read_of<'a>(item: &SourceItem, reading: Option<&'a SourceReading>) -> Read<'a> {
    match reading {
        Some(reading) => Read {
            output: Cow::Borrowed(&reading.output),
            notes: Cow::Borrowed(reading.notes.get_or_init(|| TurnNotes::of(item))),
        },
        None => Read {
            output: Cow::Owned(read_output(item)),
            notes: Cow::Owned(TurnNotes::of(item)),
        },
    }
}

/// `item`'s identifiers: from its reading (`readings_of`) when it has
/// them, or read now.
pub(super) fn identifiers_of<'a>(
    item: &SourceItem,
    reading: Option<&'a SourceReading>,
) -> Cow<'a, IdentifierReading> {
    match reading.and_then(|r| r.identifiers.as_ref()) {
        Some(reading) => Cow::Borrowed(reading),
        None => Cow::Owned(read_identifiers(item)),
    }
}

/// The reading `item` carries, when it was taken from `item` as it is.
///
/// A short text is compared byte for byte ([`ReadText`]): a draft checks
/// each source's reading once, a rolling state once more, and a BLAKE3
/// digest of every source each time was 7% of the instructions of `run`'s
/// fold thread.
fn read_ahead(item: &SourceItem) -> Option<&SourceReading> {
    let reading = item
        .read_ahead
        .0
        .as_deref()
        .filter(|r| r.role == item.role && r.tool == item.tool && r.text.is(&item.text));
    #[cfg(test)]
    if let Some(r) = reading {
        if let Ok(mut used) = READINGS_USED.lock() {
            used.push(r.text.clone());
        }
    }
    reading
}

/// The texts whose readings drafts used, in this process: drafts run on
/// other threads than the tests that start them, and tests run beside
/// each other, so a test asks about its own texts.
#[cfg(test)]
static READINGS_USED: std::sync::Mutex<Vec<ReadText>> = std::sync::Mutex::new(Vec::new());

/// Whether a draft used the reading of `text`.
#[cfg(test)]
pub(crate) fn reading_used(text: &ReadText) -> bool {
    READINGS_USED.lock().is_ok_and(|used| used.contains(text))
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
/// calls' names and the identifiers of the ones that act (their arguments
/// are in the text, which is searched once for both).
fn read_identifiers(item: &SourceItem) -> IdentifierReading {
    let text = item.text.as_str();
    let mut acting = Vec::new();
    let mut calls = Vec::new();
    if item.role == Some(Role::Assistant) {
        let (_, spans) = call_spans(text, item.tool.as_deref());
        for span in spans {
            let call = Call {
                name: text[span.name].to_string(),
                arguments: text[span.arguments.clone()].to_string(),
            };
            if matches!(
                classify_call(&call),
                CallKind::File { .. } | CallKind::Shell(_) | CallKind::Action
            ) {
                acting.push(span.arguments);
            }
            calls.push(call.name);
        }
    }
    let (identifiers, in_acting) = identifiers::extract_with_parts(text, &acting);
    let mut seen: HashSet<&str> = HashSet::new();
    let mut acted: Vec<String> = Vec::new();
    for id in in_acting.iter().flatten() {
        if seen.insert(id) {
            acted.push(id.clone());
        }
    }
    IdentifierReading {
        identifiers,
        acted,
        calls,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::{ChatMessage, Content, FunctionCall, ToolCall};

    fn item(role: Role, tool: Option<&str>, text: &str) -> SourceItem {
        SourceItem {
            label: "turn 1".into(),
            role: Some(role),
            tool: tool.map(str::to_string),
            text: text.into(),
            ..SourceItem::default()
        }
    }

    /// The error a draft takes `item`'s output to report.
    fn error_read(item: &SourceItem) -> Option<String> {
        read_of(item, read_ahead(item)).output.error.clone()
    }

    #[test]
    fn a_reading_is_used_only_for_the_text_it_was_taken_from() {
        let output = "running 3 tests\nerror[E0308]: mismatched types at src/lib.rs:4\n";
        let mut source = item(Role::Tool, Some("Bash"), output);
        let mut reading = read_source(&source, true);
        assert_eq!(error_read(&source), read_output(&source).error);
        // A reading that says something else, carried by the same text, is
        // used (the shortcut) ...
        reading.output.error = Some("read ahead".into());
        source.read_ahead.0 = Some(std::sync::Arc::new(reading.clone()));
        assert_eq!(error_read(&source).as_deref(), Some("read ahead"));
        // ... and never for another text, role or tool.
        let mut other_text = source.clone();
        other_text.text.push('x');
        assert_ne!(error_read(&other_text).as_deref(), Some("read ahead"));
        let mut other_role = source.clone();
        other_role.role = Some(Role::User);
        assert_ne!(error_read(&other_role).as_deref(), Some("read ahead"));
        let mut other_tool = source.clone();
        other_tool.tool = Some("Read".into());
        assert_ne!(error_read(&other_tool).as_deref(), Some("read ahead"));
        // Output only: the identifiers are read from the text.
        reading.identifiers = None;
        source.read_ahead.0 = Some(std::sync::Arc::new(reading));
        assert_eq!(
            identifiers_of(&source, read_ahead(&source)).identifiers,
            identifiers::extract(output)
        );
    }

    #[test]
    fn a_turn_is_noted_once_per_reading_and_as_it_would_be_afresh() {
        let edit = "I will add the identity to Message, since the upsert needs it.\n\
                    Edit({\"file_path\":\"lib/spotter/message.ex\",\"new_string\":\"identity\"})";
        let mut source = item(Role::Assistant, Some("Edit"), edit);
        let afresh = TurnNotes::of(&source);
        assert!(
            matches!(&afresh.0, crate::core::turn_notes::Of::Assistant(a)
            if a.first.is_some() && !a.noted.is_empty() && a.calls.len() == 1)
        );
        // Without a reading: noted now, nothing kept.
        assert!(matches!(
            read_of(&source, read_ahead(&source)).notes,
            Cow::Owned(_)
        ));
        // With one: noted by the first draft as afresh, kept in the reading.
        let reading = std::sync::Arc::new(read_source(&source, true));
        source.read_ahead.0 = Some(reading.clone());
        assert!(reading.notes.get().is_none());
        assert_eq!(*read_of(&source, read_ahead(&source)).notes, afresh);
        assert_eq!(reading.notes.get(), Some(&afresh));
        // The next draft takes what was kept (a planted note shows it is
        // not noted again) ...
        let planted = TurnNotes::of(&item(Role::User, None, "Rather use Postgres for this."));
        let mut kept = read_source(&source, true);
        kept.notes = planted.clone().into();
        source.read_ahead.0 = Some(std::sync::Arc::new(kept));
        assert!(
            matches!(read_of(&source, read_ahead(&source)).notes, Cow::Borrowed(n) if *n == planted)
        );
        // ... and never for another text, role or tool.
        let mut other_text = source.clone();
        other_text.text.push('x');
        assert_eq!(
            *read_of(&other_text, read_ahead(&other_text)).notes,
            TurnNotes::of(&other_text)
        );
        let mut other_role = source.clone();
        other_role.role = Some(Role::User);
        assert_eq!(
            *read_of(&other_role, read_ahead(&other_role)).notes,
            TurnNotes::of(&other_role)
        );
        let mut other_tool = source;
        other_tool.tool = None;
        assert_eq!(
            *read_of(&other_tool, read_ahead(&other_tool)).notes,
            TurnNotes::of(&other_tool)
        );
    }

    #[test]
    fn a_long_text_is_kept_by_digest_and_a_short_one_whole() {
        let short = "error: 1 test failed";
        let long = format!("{}error: 1 test failed\n", "running tests\n".repeat(1200));
        assert!(matches!(ReadText::of(short), ReadText::Whole(_)));
        assert!(matches!(ReadText::of(&long), ReadText::Digest { .. }));
        for text in [short, long.as_str()] {
            let kept = ReadText::of(text);
            assert!(kept.is(text));
            // Another byte, one more, one fewer: another text.
            let mut changed = text.to_string().into_bytes();
            changed[3] ^= 1;
            assert!(!kept.is(std::str::from_utf8(&changed).unwrap()));
            assert!(!kept.is(&format!("{text}x")));
            assert!(!kept.is(&text[..text.len() - 1]));
        }
        // And a reading of a long text is used for that text only.
        let mut source = item(Role::Tool, Some("Bash"), &long);
        let mut reading = read_source(&source, false);
        reading.output.error = Some("read ahead".into());
        source.read_ahead.0 = Some(std::sync::Arc::new(reading));
        assert_eq!(error_read(&source).as_deref(), Some("read ahead"));
        source.text.push('x');
        assert_ne!(error_read(&source).as_deref(), Some("read ahead"));
    }

    /// What an assistant turn's reading was before its text was searched
    /// once: every acting call's arguments searched again on their own.
    fn acted_searched_alone(calls: &[Call]) -> Vec<String> {
        let mut seen = HashSet::new();
        let mut acted = Vec::new();
        for call in calls {
            if matches!(
                classify_call(call),
                CallKind::File { .. } | CallKind::Shell(_) | CallKind::Action
            ) {
                for id in identifiers::extract(&call.arguments) {
                    if seen.insert(id.clone()) {
                        acted.push(id);
                    }
                }
            }
        }
        acted
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// An assistant turn rendered as `searchable_text` renders one
        /// (its words, then `name(arguments)` per call): the identifiers
        /// its acting calls act on are the ones their arguments hold
        /// alone, and its text's are `extract`'s.
        #[test]
        fn acted_on_identifiers_are_the_arguments_own(
            words in "(see |src/lib\\.rs|v1\\.2\\.3|E0308| |\n|\\(){0,6}",
            calls in proptest::collection::vec((
                proptest::sample::select(&["Bash", "Edit", "Read", "Write", "Glob", "mcp__db_v2", "x1"][..]),
                proptest::collection::vec(
                    proptest::sample::select(&[
                        "cargo test -p core", "/repo/src/main.rs", "src/a.rs:12", "https://w.org/A_(b",
                        "C:\\\\x(", "10.0.0.1:8080", "#123", "ABC-123", "toolu_01ABC", "é", "(", ")", "\\n",
                        "a", " ",
                    ][..]),
                    0..5,
                ),
                proptest::sample::select(&["command", "file_path", "pattern", "path"][..]),
                proptest::bool::ANY,
            ), 0..4),
        ) {
            let message = ChatMessage {
                role: Role::Assistant,
                content: (!words.is_empty()).then(|| Content::Text(words.clone())),
                tool_calls: calls
                    .iter()
                    .enumerate()
                    .map(|(i, (name, value, key, json))| {
                        let value = value.concat();
                        let arguments = if *json {
                            serde_json::json!({ *key: value }).to_string()
                        } else {
                            value
                        };
                        ToolCall {
                            id: format!("call_{i}"),
                            kind: "function".into(),
                            function: FunctionCall {
                                name: name.to_string(),
                                arguments,
                            },
                        }
                    })
                    .collect(),
                tool_call_id: None,
                name: None,
            };
            let first = message.tool_calls.first().map(|c| c.function.name.clone());
            let source = item(Role::Assistant, first.as_deref(), &message.searchable_text());
            let reading = read_identifiers(&source);
            // The calls as made (no argument holds a line of its own, so
            // the text splits back into exactly these).
            let made: Vec<Call> = message
                .tool_calls
                .iter()
                .map(|c| Call { name: c.function.name.clone(), arguments: c.function.arguments.clone() })
                .collect();
            proptest::prop_assert_eq!(&reading.acted, &acted_searched_alone(&made));
            proptest::prop_assert_eq!(&reading.identifiers, &identifiers::extract(&source.text));
        }
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
