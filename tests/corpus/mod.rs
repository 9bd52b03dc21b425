//! Real transcripts from `../shared/data/transcripts/`, cut the way the fold
//! counts them: one entry per message, holding each text that
//! `core::tokens::count_message` tokenizes (content, tool-call names and
//! arguments, name, tool-call id). Shared by `tests/token_counts.rs` and
//! `benches/tokens.rs`; the files are read in place, never copied.

use contextfold::core::message::ChatMessage;
use std::path::PathBuf;

/// The shared data directory, next to the crate root.
pub const SHARED_DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data");
/// Overrides [`SHARED_DATA`], for checkouts that do not sit next to it (a
/// git worktree, a CI cache).
pub const SHARED_DATA_ENV: &str = "CONTEXTFOLD_SHARED_DATA";
pub const TAU_BENCH: &str = "transcripts/tau-bench_sierra-research/gpt-4o-airline.json";
pub const AIDER: &str = "transcripts/aider_Aider-AI-aider/chat-history.md";
pub const CLAUDE_CODE: &str =
    "transcripts/claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl";

/// Where a file of the shared data directory is.
pub fn shared_path(relative: &str) -> PathBuf {
    let dir = std::env::var_os(SHARED_DATA_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(SHARED_DATA));
    dir.join(relative)
}

/// One message: where it is, and the texts the fold tokenizes for it.
pub struct Message {
    pub label: String,
    pub pieces: Vec<String>,
}

pub struct Corpus {
    pub name: &'static str,
    pub messages: Vec<Message>,
}

impl Corpus {
    /// Bytes of text tokenized over the whole corpus.
    pub fn bytes(&self) -> usize {
        self.messages
            .iter()
            .flat_map(|m| &m.pieces)
            .map(String::len)
            .sum()
    }
}

/// Loads one corpus: `Ok(None)` when its file is absent.
pub type Loader = fn() -> Result<Option<Corpus>, CorpusError>;

/// The corpora of `loaders` (each with its file, for the message) that can
/// be read; each one absent or unreadable is said on stderr and left out,
/// so a bench times what there is.
pub fn available(loaders: &[(&str, Loader)]) -> Vec<Corpus> {
    let mut found = Vec::new();
    for &(path, load) in loaders {
        match load() {
            Ok(Some(c)) => found.push(c),
            Ok(None) => eprintln!(
                "skipping {}: absent (set {} to the shared data directory)",
                shared_path(path).display(),
                SHARED_DATA_ENV
            ),
            Err(e) => eprintln!("skipping {path}: {e}"),
        }
    }
    found
}

/// Why a corpus could not be loaded (absent files are `Ok(None)` instead).
#[derive(Debug)]
pub struct CorpusError(pub String);

impl std::fmt::Display for CorpusError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn read(relative: &str) -> Result<Option<String>, CorpusError> {
    let path = shared_path(relative);
    if !path.exists() {
        return Ok(None);
    }
    std::fs::read_to_string(&path)
        .map(Some)
        .map_err(|e| CorpusError(format!("cannot read {}: {e}", path.display())))
}

/// The texts `count_message` tokenizes, in its order; empty ones left out
/// (they cost no tokens and neither engine is asked about them).
pub fn pieces_of(message: &ChatMessage) -> Vec<String> {
    let mut pieces = vec![message.text_content()];
    for call in &message.tool_calls {
        pieces.push(call.function.name.clone());
        pieces.push(call.function.arguments.clone());
    }
    pieces.extend(message.name.clone());
    pieces.extend(message.tool_call_id.clone());
    pieces.retain(|p| !p.is_empty());
    pieces
}

/// tau-bench airline: 200 conversations of OpenAI chat messages (`traj`).
pub fn tau_bench() -> Result<Option<Corpus>, CorpusError> {
    let Some(text) = read(TAU_BENCH)? else {
        return Ok(None);
    };
    let runs: Vec<serde_json::Value> = serde_json::from_str(&text)
        .map_err(|e| CorpusError(format!("{TAU_BENCH}: not a JSON array: {e}")))?;
    let mut messages = Vec::new();
    for (c, run) in runs.iter().enumerate() {
        let traj = run
            .get("traj")
            .and_then(|t| t.as_array())
            .ok_or_else(|| CorpusError(format!("{TAU_BENCH}: conversation {c} has no `traj`")))?;
        for (m, raw) in traj.iter().enumerate() {
            let message: ChatMessage = serde_json::from_value(raw.clone()).map_err(|e| {
                CorpusError(format!("{TAU_BENCH}: conversation {c} message {m}: {e}"))
            })?;
            messages.push(Message {
                label: format!(
                    "conversation {c} (task {}), message {m} ({})",
                    run.get("task_id").unwrap_or(&serde_json::Value::Null),
                    message.role.as_str()
                ),
                pieces: pieces_of(&message),
            });
        }
    }
    Ok(Some(Corpus {
        name: "tau-bench airline",
        messages,
    }))
}

#[derive(Clone, Copy, PartialEq)]
enum AiderLine {
    User,
    Output,
    Assistant,
}

/// aider's chat-history.md, cut into messages by line kind: `#### ` lines
/// are the user's, `> ` lines (and the unmarked lines right after one) tool
/// and command output, anything else the assistant's; blank lines stay with
/// the message they are in, and a `# aider chat started` header ends one. An approximation of aider's
/// turns, good enough to count text the way the fold would.
pub fn aider() -> Result<Option<Corpus>, CorpusError> {
    let Some(text) = read(AIDER)? else {
        return Ok(None);
    };
    let mut messages = Vec::new();
    let mut current: Option<(AiderLine, usize, String)> = None;
    let mut flush = |current: &mut Option<(AiderLine, usize, String)>| {
        if let Some((kind, line, body)) = current.take() {
            let body = body.trim_end().to_string();
            if !body.is_empty() {
                let who = match kind {
                    AiderLine::User => "user",
                    AiderLine::Output => "output",
                    AiderLine::Assistant => "assistant",
                };
                messages.push(Message {
                    label: format!("line {line} ({who})"),
                    pieces: vec![body],
                });
            }
        }
    };
    // aider prefixes only the first line of a multi-line output with `> `:
    // the lines right after it, up to a blank line, are output too.
    let mut output_continues = false;
    for (i, line) in text.lines().enumerate() {
        if line.starts_with("# aider chat started") {
            output_continues = false;
            flush(&mut current);
            continue;
        }
        let (kind, body) = if let Some(rest) = line.strip_prefix("#### ") {
            (Some(AiderLine::User), rest)
        } else if let Some(rest) = line.strip_prefix('>') {
            (
                Some(AiderLine::Output),
                rest.strip_prefix(' ').unwrap_or(rest),
            )
        } else if line.trim().is_empty() {
            (None, line)
        } else if output_continues {
            (Some(AiderLine::Output), line)
        } else {
            (Some(AiderLine::Assistant), line)
        };
        output_continues = kind == Some(AiderLine::Output);
        match (kind, &mut current) {
            (Some(k), Some((open, _, _))) if k != *open => {
                flush(&mut current);
                current = Some((k, i + 1, format!("{body}\n")));
            }
            (Some(k), None) => current = Some((k, i + 1, format!("{body}\n"))),
            (_, Some((_, _, text))) => {
                text.push_str(body);
                text.push('\n');
            }
            (None, None) => {}
        }
    }
    flush(&mut current);
    Ok(Some(Corpus {
        name: "aider chat-history",
        messages,
    }))
}

/// A Claude Code session (the long one `scripts/bench-run-transcripts.sh`
/// folds), read with contextfold's own importer: one message per turn.
pub fn claude_code() -> Result<Option<Corpus>, CorpusError> {
    use contextfold::core::event::EventBody;
    use contextfold::import::{import_file, Format};
    let path = shared_path(CLAUDE_CODE);
    if !path.exists() {
        return Ok(None);
    }
    let conversations = import_file(&path, Format::ClaudeCode)
        .map_err(|e| CorpusError(format!("{CLAUDE_CODE}: {e}")))?;
    let mut messages = Vec::new();
    for conversation in conversations {
        for (i, event) in conversation.events.iter().enumerate() {
            if let EventBody::TurnAppended(turn) = &event.body {
                messages.push(Message {
                    label: format!("{} event {i}", conversation.conversation),
                    pieces: pieces_of(&turn.message),
                });
            }
        }
    }
    Ok(Some(Corpus {
        name: "claude-code session",
        messages,
    }))
}
