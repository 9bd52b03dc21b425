//! Masked rendering of an old turn: what assembly sends for a turn older
//! than the fresh tail when the room is better spent on more history.
//!
//! Tool output goes first (it is what the agent read, not what it did): a
//! result longer than [`MASK_MIN_BYTES`] becomes one line saying what it
//! was, its size, its most telling line (an error, a test count, a commit,
//! else its first line) and how to get it back (`describe` the turn: every
//! turn stays in the log, byte for byte). An assistant turn keeps its words
//! and each call's name and short arguments (paths, commands); a long
//! string argument (a file's new content, an edit's old and new text)
//! keeps its first line and says how much is left out. User and system
//! turns are never masked. Deterministic: the same turn always masks the
//! same way.

use crate::core::line_pattern::LinePattern;
use crate::core::message::{ChatMessage, Content, Role};
use crate::core::tokens::{self, Encoding};
use serde_json::Value;

/// Turns shorter than this (content and calls) are sent as they are.
pub const MASK_MIN_BYTES: usize = 400;

/// A string argument longer than this is cut to its first line.
const LONG_ARGUMENT_CHARS: usize = 160;

/// Characters kept of a long argument's first line, and of the line a
/// masked result keeps.
const KEPT_LINE_CHARS: usize = 100;

/// Whether a turn of this role and size may have a masked rendering.
pub fn maskable(role: Role, bytes: usize, has_tool_calls: bool) -> bool {
    bytes >= MASK_MIN_BYTES
        && match role {
            Role::Tool => true,
            Role::Assistant => has_tool_calls,
            Role::User | Role::System => false,
        }
}

/// The masked rendering of turn `seq`, or `None` when masking would not
/// make it shorter (nothing long to leave out).
pub fn masked(msg: &ChatMessage, seq: u64) -> Option<ChatMessage> {
    masked_told(msg, seq, None)
}

/// The tool output a turn's masked rendering quotes from: `Some` for a
/// tool result long enough to be masked (see [`masked`]), `None` for any
/// other turn.
pub fn output_to_mask(msg: &ChatMessage) -> Option<std::borrow::Cow<'_, str>> {
    if msg.role != Role::Tool || !maskable(msg.role, msg.text_bytes(), !msg.tool_calls.is_empty()) {
        return None;
    }
    let text = msg.text_view();
    (text.len() >= MASK_MIN_BYTES).then_some(text)
}

/// [`masked`] with the output's [`telling_line`] when it is already known
/// (measured ahead of the fold: see [`crate::core::measure`]); the same
/// rendering either way.
pub fn masked_told(msg: &ChatMessage, seq: u64, telling: Option<&str>) -> Option<ChatMessage> {
    if !maskable(msg.role, msg.text_bytes(), !msg.tool_calls.is_empty()) {
        return None;
    }
    match msg.role {
        Role::Tool => {
            let text = output_to_mask(msg)?;
            let line = match telling {
                Some(line) => std::borrow::Cow::Borrowed(line),
                None => std::borrow::Cow::Owned(telling_line(&text)),
            };
            // Built from its parts: a clone would copy the whole output
            // only to drop it (the fold masks every long output it folds).
            Some(ChatMessage {
                role: msg.role,
                content: Some(Content::Text(result_stub(msg, &text, &line, seq))),
                tool_calls: msg.tool_calls.clone(),
                tool_call_id: msg.tool_call_id.clone(),
                name: msg.name.clone(),
            })
        }
        Role::Assistant => elided_calls(msg),
        Role::User | Role::System => None,
    }
}

/// An assistant turn's masked rendering: its calls with their long
/// arguments elided (`None`: another role, or nothing long to elide). It
/// does not name the turn, unlike a tool result's stub, so it may be
/// rendered (and counted) ahead of the fold (`core::measure`).
pub fn masked_calls(msg: &ChatMessage) -> Option<ChatMessage> {
    if !masks_calls(msg) {
        return None;
    }
    elided_calls(msg)
}

/// Whether `msg` is an assistant turn [`maskable`] (whose calls' long
/// arguments a masked rendering elides).
fn masks_calls(msg: &ChatMessage) -> bool {
    msg.role == Role::Assistant && maskable(msg.role, msg.text_bytes(), !msg.tool_calls.is_empty())
}

/// `msg` with its calls' long arguments elided, once [`maskable`] said so.
fn elided_calls(msg: &ChatMessage) -> Option<ChatMessage> {
    let elided = elided_arguments(msg)?;
    let mut m = msg.clone();
    for (call, args) in m.tool_calls.iter_mut().zip(elided) {
        if let Some(args) = args {
            call.function.arguments = args;
        }
    }
    Some(m)
}

/// Each call's arguments as [`elided_calls`] renders them (`None`: kept
/// as they are), or `None` when it elides none.
fn elided_arguments(msg: &ChatMessage) -> Option<Vec<Option<String>>> {
    let elided: Vec<Option<String>> = msg
        .tool_calls
        .iter()
        .map(|call| elide_arguments(&call.function.arguments))
        .collect();
    elided.iter().any(Option::is_some).then_some(elided)
}

/// `msg`'s [`tokens::count_message`] and its [`masked_calls`] rendering's
/// (`None` when it has none), from one count of `msg`: the rendering
/// differs only in the elided calls' arguments, and a message's count is
/// the sum of its parts', so those arguments' counts are taken out of
/// `msg`'s and their elided forms' put in. Neither the message is copied
/// nor its words and other calls counted again (the measuring thread of
/// `run` does this for every assistant turn with long arguments).
pub fn counted(encoding: Encoding, msg: &ChatMessage) -> (u64, Option<u64>) {
    let Some(elided) = masks_calls(msg).then(|| elided_arguments(msg)).flatten() else {
        return (tokens::count_message(encoding, msg), None);
    };
    let mut left_out = 0;
    let total = tokens::count_message_telling_arguments(encoding, msg, |i, counted| {
        if elided.get(i).is_some_and(Option::is_some) {
            left_out += counted;
        }
    });
    let put_in: u64 = elided
        .iter()
        .flatten()
        .map(|args| tokens::count_text(encoding, args))
        .sum();
    (total, Some(total - left_out + put_in))
}

/// `[output of `Read` masked: 32,133 bytes; "…line…"; `describe` turn 291
/// shows it whole]`.
fn result_stub(msg: &ChatMessage, text: &str, line: &str, seq: u64) -> String {
    let tool = msg
        .name
        .as_deref()
        .map_or(String::from("tool output"), |n| format!("output of `{n}`"));
    let quoted = if line.is_empty() {
        String::new()
    } else {
        format!(" \"{line}\";")
    };
    format!(
        "[{tool} masked here: {} bytes;{quoted} `describe` turn {seq} shows it whole]",
        group_digits(text.len())
    )
}

/// The line of a tool output that says most in a few words: an error, a
/// failure or a test count first, then a milestone (a commit, a closed
/// task, a push), else the first line with some letters in it.
pub fn telling_line(text: &str) -> String {
    use crate::core::fallback_summary::{
        ascending, has_alphanumerics, is_listing_line, lines, Lowered,
    };
    let text = crate::core::fallback_summary::prefix_bytes(text, 20_000);
    let head = Lowered::new(text);
    // Only the lines a screen found a word of are read, from one search
    // of the whole head (see `fallback_summary::Lowered`): the fold masks
    // every long tool output as it arrives, and most of their lines hold
    // none. Each pattern runs only on those lines.
    let error_screen = crate::screen!(
        "error|exception|traceback|fail|fatal|panicked|denied|not found|no such file|cannot|could not|unable to|exit code"
    );
    let worded = |line: &str| has_alphanumerics(line, 3);
    let pick = head
        .lines_at(head.hits(error_screen).map(|at| (at, true)))
        .map(|(line, _)| line.trim())
        .find(|&l| worded(l) && telling_error().is_match(l) && !is_listing_line(l))
        .or_else(|| {
            // A milestone's words; its two shapes without one (`[main
            // 1a2b3c4]` at the line's start, `1a2b3c4..5d6e7f8`) are found
            // by their bytes: a line holding `..`, or one with a `[` that
            // starts it (told once the line is cut). As literals of the
            // screen they would hit half the lines of code and data.
            let milestone_screen = crate::screen!(
                "pass|run|0 failures|closed|committed|merged|pushed|created|successfully"
            );
            let bytes = text.as_bytes();
            let shapes = ascending(
                memchr::memmem::find_iter(bytes, "..").map(|at| (at, true)),
                memchr::memchr_iter(b'[', bytes).map(|at| (at, false)),
            );
            head.lines_at(ascending(
                head.hits(milestone_screen).map(|at| (at, true)),
                shapes,
            ))
            .map(|(line, marked)| {
                let line = line.trim();
                (line, marked || line.starts_with('['))
            })
            .find(|&(l, hit)| hit && worded(l) && telling_milestone().is_match(l))
            .map(|(line, _)| line)
        })
        .or_else(|| lines(text).map(str::trim).find(|line| worded(line)))
        .unwrap_or("");
    clip(pick, KEPT_LINE_CHARS).replace('"', "'")
}

fn telling_error() -> &'static LinePattern {
    crate::line_pattern!(
        r"(?i)\b(error|exception|traceback|failed|failures?|fatal|panicked|denied|not found|no such file|cannot|could not|unable to)\b|exit code [1-9]"
    )
}

/// Whether both patterns of [`telling_line`] run as ASCII twins where they may.
#[cfg(test)]
pub(crate) fn telling_patterns_have_twins() -> bool {
    telling_error().has_twin() && telling_milestone().has_twin()
}

fn telling_milestone() -> &'static LinePattern {
    crate::line_pattern!(
        r"(?i)\b(\d+ (tests?|examples?|specs?) (passed|pass|run)|\d+ passed|0 failures|tests? pass|closed|committed|merged|pushed|created|successfully)\b|^\[[\w./-]+ [0-9a-f]{7,}\]|[0-9a-f]{7,}\.\.[0-9a-f]{7,}"
    )
}

pub fn elide_arguments(arguments: &str) -> Option<String> {
    if arguments.len() < MASK_MIN_BYTES {
        return None;
    }
    match serde_json::from_str::<Value>(arguments) {
        Ok(mut value) => {
            let changed = elide_value(&mut value);
            changed.then(|| value.to_string())
        }
        Err(_) => Some(elide_string(arguments)),
    }
}

fn elide_value(value: &mut Value) -> bool {
    match value {
        Value::String(s) if s.chars().count() > LONG_ARGUMENT_CHARS => {
            *s = elide_string(s);
            true
        }
        Value::Array(items) => items.iter_mut().fold(false, |c, v| elide_value(v) | c),
        Value::Object(map) => map.values_mut().fold(false, |c, v| elide_value(v) | c),
        _ => false,
    }
}

fn elide_string(s: &str) -> String {
    let first = s
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let kept = clip(first, KEPT_LINE_CHARS);
    format!(
        "{kept} […{} more chars masked]",
        group_digits(s.len().saturating_sub(kept.len()))
    )
}

/// At most `max` characters, cut at a word boundary when one is near,
/// with `…` marking the cut.
fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max).collect();
    if let Some(space) = out.rfind(' ') {
        if out[space..].chars().count() <= 20 && space > 0 {
            out.truncate(space);
        }
    }
    out.push('…');
    out
}

/// `32133` -> `32,133`.
pub fn group_digits(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::{FunctionCall, ToolCall};
    use proptest::prelude::*;

    /// [`telling_line`] as it was before its screens: the oracle.
    fn unscreened_telling_line(text: &str) -> String {
        let head = crate::core::fallback_summary::prefix_bytes(text, 20_000);
        let lines = || {
            head.lines()
                .map(str::trim)
                .filter(|l| l.chars().filter(|c| c.is_alphanumeric()).count() >= 3)
        };
        let pick = lines()
            .find(|l| {
                telling_error().is_match(l) && !crate::core::fallback_summary::is_listing_line(l)
            })
            .or_else(|| lines().find(|l| telling_milestone().is_match(l)))
            .or_else(|| lines().next())
            .unwrap_or("");
        clip(pick, KEPT_LINE_CHARS).replace('"', "'")
    }

    const PIECES: &[&str] = &[
        "error",
        "ERROR:",
        "Error",
        "NOT FOUND",
        "Exit Code 3",
        "Exception",
        "TypeError:",
        "traceback",
        "FAILED",
        "failures",
        "fatal",
        "panicked",
        "denied",
        "not found",
        "no such file",
        "cannot",
        "could not",
        "unable to",
        "exit code 2",
        "exit code 0",
        "3 tests passed",
        "12 passed",
        "12 PASSED",
        "Ran 4 tests",
        "0 failures",
        "0 Failures",
        "Committed",
        "MERGED",
        "Successfully",
        "closed",
        "committed",
        "merged",
        "pushed",
        "created",
        "successfully",
        "[main 1a2b3c4d]",
        "1a2b3c4..5d6e7f8",
        "1A2B3C4..5D6E7F8",
        "[",
        "  [x",
        "..",
        ".",
        "→",
        "✓",
        "é",
        "ſ",
        "\u{212A}",
        "faıled",
        "src/lib.rs",
        "42",
        "the",
        "build",
        "ok",
        "  31→",
        "{:error, reason}",
        "-",
        ":",
    ];

    fn outputs() -> impl Strategy<Value = String> {
        let line = prop_oneof![
            4 => prop::collection::vec(prop::sample::select(PIECES), 0..10)
                .prop_map(|pieces| pieces.join(" ")),
            1 => prop::collection::vec(prop::sample::select(PIECES), 0..10)
                .prop_map(|pieces| pieces.concat()),
            1 => "\\PC{0,60}",
        ];
        (prop::collection::vec(line, 0..12), any::<bool>())
            .prop_map(|(lines, crlf)| lines.join(if crlf { "\r\n" } else { "\n" }))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn the_screened_telling_line_is_the_unscreened_one(text in outputs()) {
            prop_assert_eq!(telling_line(&text), unscreened_telling_line(&text));
        }
    }

    /// Call arguments of every kind `elide_arguments` meets: short and
    /// long JSON (long strings nested or not, escapes, text outside
    /// ASCII), text that is not JSON, and nothing.
    fn arguments() -> impl Strategy<Value = String> {
        let long = "[a-zé→ \\n\\\"{}]{0,40}".prop_map(|s| s.repeat(12));
        prop_oneof![
            Just(String::new()),
            "[a-z/.]{0,30}".prop_map(|p| serde_json::json!({ "file_path": p }).to_string()),
            (long.clone(), "[a-z]{0,8}").prop_map(|(content, path)| {
                serde_json::json!({ "file_path": path, "content": content }).to_string()
            }),
            (long.clone(), long.clone()).prop_map(|(old, new)| {
                serde_json::json!({ "edits": [{ "old_string": old, "new_string": new }], "n": 3 })
                    .to_string()
            }),
            long.prop_map(|text| format!("{text} not json {{")),
        ]
    }

    fn turns() -> impl Strategy<Value = ChatMessage> {
        let role = prop::sample::select(vec![
            Role::Assistant,
            Role::Assistant,
            Role::Tool,
            Role::User,
        ]);
        let call = ("[A-Za-z_]{1,12}", arguments()).prop_map(|(name, arguments)| ToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: FunctionCall { name, arguments },
        });
        (role, "\\PC{0,300}", prop::collection::vec(call, 0..4)).prop_map(|(role, text, calls)| {
            let mut m = ChatMessage::text(role, text);
            m.tool_calls = calls;
            m
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Counted from its parts, a turn's masked calls cost what their
        /// rendering counts whole.
        #[test]
        fn masked_calls_counted_by_parts_cost_what_their_rendering_counts(msg in turns()) {
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                let whole = (
                    tokens::count_message(encoding, &msg),
                    masked_calls(&msg).map(|m| tokens::count_message(encoding, &m)),
                );
                prop_assert_eq!(counted(encoding, &msg), whole);
            }
        }
    }

    #[test]
    fn a_milestone_without_its_words_is_found_by_its_shape() {
        // No screen word in either: a commit line told by its `[` (after
        // white space), a push by its `..`, between lines of code.
        let commit = "fn main() {}\n let v = [1, 2, 3];\n  [main 1a2b3c4] Fix the parser\n}";
        assert_eq!(telling_line(commit), "[main 1a2b3c4] Fix the parser");
        let push = "To origin\n   1a2b3c4..5d6e7f8  main -> main\nDone";
        assert_eq!(telling_line(push), "1a2b3c4..5d6e7f8  main -> main");
        for text in [commit, push] {
            assert_eq!(telling_line(text), unscreened_telling_line(text));
        }
    }

    #[test]
    fn a_long_tool_output_becomes_one_line_naming_its_turn() {
        let mut out = ChatMessage::text(
            Role::Tool,
            format!(
                "Compiling 2 files\n{}\nFinished in 0.7 seconds\n389 tests, 0 failures\n",
                "....".repeat(200)
            ),
        );
        out.tool_call_id = Some("call_1".into());
        out.name = Some("Bash".into());
        let m = masked(&out, 316).unwrap();
        let text = m.text_content();
        assert!(text.contains("`describe` turn 316"), "{text}");
        assert!(text.contains("389 tests, 0 failures"), "{text}");
        assert!(text.contains("output of `Bash`"), "{text}");
        assert!(!text.contains('\n'), "one line: {text}");
        assert_eq!(m.tool_call_id.as_deref(), Some("call_1"), "pairing kept");
        // An error line wins over a milestone.
        let err = "ok\nerror: undefined function find_transcript_file/1\n3 tests, 1 failure";
        assert!(telling_line(err).starts_with("error: undefined"));
        // Short outputs and user turns are sent as they are.
        let mut short = out;
        short.content = Some(Content::Text("✓ Closed spotter-a0y.1".into()));
        assert!(masked(&short, 1).is_none());
        let user = ChatMessage::text(Role::User, "x".repeat(5000));
        assert!(masked(&user, 1).is_none());
    }

    #[test]
    fn long_arguments_keep_their_first_line_and_short_ones_stay() {
        let content = format!("defmodule A do\n{}\nend\n", "  def f, do: 1\n".repeat(60));
        let args = serde_json::json!({"file_path": "lib/a.ex", "content": content}).to_string();
        let mut call = ChatMessage::text(Role::Assistant, "Now write the module.");
        call.tool_calls = vec![ToolCall {
            id: "call_9".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "Write".into(),
                arguments: args,
            },
        }];
        let m = masked(&call, 24).unwrap();
        let a: Value = serde_json::from_str(&m.tool_calls[0].function.arguments).unwrap();
        assert_eq!(a["file_path"], "lib/a.ex");
        let kept = a["content"].as_str().unwrap();
        assert!(kept.starts_with("defmodule A do […"), "{kept}");
        assert!(kept.contains("more chars masked"), "{kept}");
        assert_eq!(m.text_content(), "Now write the module.");
        assert_eq!(m.tool_calls[0].id, "call_9");
        // Not JSON: cut as one string.
        assert!(elide_arguments(&"x ".repeat(400)).unwrap().len() < 200);
        assert_eq!(group_digits(1234567), "1,234,567");
        assert_eq!(group_digits(12), "12");
    }
}
