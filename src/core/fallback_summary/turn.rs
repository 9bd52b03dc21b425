//! What a draft notes of one turn on its own, whatever came before it
//! ([`TurnNotes`], whose data lives in `core::turn_notes` so that a
//! reading can keep it): a user's request and decisions; an assistant's first
//! sentence, the words that would answer an error, its sentences sorted
//! into intentions, milestones, diagnoses, decisions, open items and
//! questions, the files it changed and the actions it took, and its calls
//! (which the results after it answer). `Notes::from_turns` merges them in
//! order with what depends on the turns before: what was already noted,
//! the calls awaiting results, the error not yet answered.
//!
//! A turn is usually noted twice: by a rolling state while it is new, then
//! by the leaf that covers it. A turn read ahead keeps its notes with its
//! reading (`reading::read_of`), so the second draft merges what the first
//! noted. Notes are a pure function of the turn's role, tool and text,
//! which is what a reading is checked against before it is used.

use super::notes::{looks_like_code, sentences, words_only};
use super::signals::*;
use super::*;
use crate::core::turn_notes::{
    Ask, AssistantNotes, CallKind, Noted, Of, Said, TurnNotes, UserNotes,
};

impl TurnNotes {
    /// Notes `item` on its own.
    pub(super) fn of(item: &SourceItem) -> TurnNotes {
        let text = item.text.as_str();
        TurnNotes(match item.role {
            Some(Role::User) if item.tool.as_deref() == Some(DEMONSTRATION_NAME) => Of::Context,
            Some(Role::System) => Of::Context,
            Some(Role::User) => Of::User(user_notes(text)),
            Some(Role::Assistant) => Of::Assistant(assistant_notes(text, item.tool.as_deref())),
            Some(Role::Tool) => Of::Result,
            None => Of::Child,
        })
    }
}

fn user_notes(text: &str) -> UserNotes {
    let words = prose(text);
    if words.is_empty() {
        return UserNotes {
            ask: None,
            decisions: Vec::new(),
        };
    }
    let decisions = sentences(&words)
        .into_iter()
        .filter(|s| s.len() >= 12 && !s.ends_with('?') && !looks_like_code(s) && is_decision(s))
        .map(|s| sentences_up_to(s, SENTENCE_CHARS))
        .collect();
    UserNotes {
        ask: Some(Ask {
            long: sentences_up_to(&words, ASK_CHARS),
            short: sentences_up_to(&words, SHORT_ASK_CHARS),
        }),
        decisions,
    }
}

fn assistant_notes(text: &str, first_call: Option<&str>) -> AssistantNotes {
    let (words, calls) = split_calls(text, first_call);
    let narration = words_only(prefix_bytes(words, MINED_BYTES));
    let first = first_sentence_in(&narration);
    let fix = if first.is_some() {
        sentences_up_to(&narration, FIX_CHARS)
    } else {
        String::new()
    };
    let mut noted = Vec::new();
    note_sentences(&mut noted, &narration);
    for path in search_replace_paths(words) {
        noted.push(Noted::File {
            path,
            verb: "edited",
            what: first.iter().cloned().collect(),
        });
    }
    let mut kinds = Vec::with_capacity(calls.len());
    for call in calls {
        let args = call_arguments(&call);
        let kind = classify_parsed_call(&call, args.as_ref());
        match &kind {
            CallKind::File { path, verb } => {
                let change = args.as_ref().and_then(change_of);
                let mut what: Vec<String> = first
                    .clone()
                    .or_else(|| change.clone())
                    .into_iter()
                    .collect();
                if let Some(change) = change {
                    if !what.contains(&change) {
                        what.push(change);
                    }
                }
                noted.push(Noted::File {
                    path: path.clone(),
                    verb,
                    what,
                });
            }
            CallKind::Shell(command) => {
                for (path, verb) in shell_file_changes(command) {
                    noted.push(Noted::File {
                        path,
                        verb,
                        what: Vec::new(),
                    });
                }
            }
            CallKind::Action => noted.push(Noted::Action(action_line(&call))),
            CallKind::Thought(thought) => note_sentences(&mut noted, &words_only(thought)),
            CallKind::Read => {}
        }
        kinds.push((call.name, kind));
    }
    AssistantNotes {
        first,
        fix,
        noted,
        calls: kinds,
    }
}

/// The first sentence of an agent's words (code blocks already out) that
/// is prose, whole (up to [`SENTENCE_CHARS`]).
fn first_sentence_in(words: &str) -> Option<String> {
    sentences(words)
        .into_iter()
        .find(|s| s.len() >= 12 && !looks_like_code(s))
        .map(|s| sentences_up_to(s, SENTENCE_CHARS))
}

/// Intentions, milestones claimed, diagnoses, decisions, open items and
/// questions among the sentences of the agent's words (code blocks
/// already out).
fn note_sentences(noted: &mut Vec<Noted>, words: &str) {
    for sentence in sentences(words) {
        if sentence.len() < 12 || looks_like_code(sentence) {
            continue;
        }
        let said = if sentence.ends_with('?') {
            Said::Question
        } else if is_intention(sentence) {
            Said::Intention
        } else if claims_milestone(sentence) {
            Said::Milestone
        } else if is_diagnosis(sentence) {
            Said::Diagnosis
        } else if is_decision(sentence) {
            Said::Decision
        } else if is_open(sentence) {
            Said::Open
        } else {
            continue;
        };
        noted.push(Noted::Sentence(
            said,
            sentences_up_to(sentence, SENTENCE_CHARS),
        ));
    }
}

/// `name(key=value, ...)` for a call that changes something other than a
/// file: short scalar arguments only, never the JSON.
fn action_line(call: &Call) -> String {
    let args: Option<serde_json::Value> = serde_json::from_str(&call.arguments).ok();
    let mut parts: Vec<String> = Vec::new();
    if let Some(obj) = args.as_ref().and_then(|a| a.as_object()) {
        for (k, v) in obj {
            let shown = match v {
                serde_json::Value::String(s) if s.chars().count() <= 40 => s.clone(),
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => b.to_string(),
                serde_json::Value::Array(items) => format!("[{} items]", items.len()),
                _ => continue,
            };
            parts.push(format!("{k}={shown}"));
            if parts.len() == 4 {
                break;
            }
        }
    }
    format!("called `{}`({})", call.name, parts.join(", "))
}
