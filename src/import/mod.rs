//! Importers: real agent transcripts to inbound events.
//!
//! This module owns reading transcripts that other agent frameworks wrote and
//! turning each conversation in them into the events an agent would have
//! published: `model_declared` where the source names a model, then one
//! `turn_appended` per message in the OpenAI chat shape, and
//! `provider_error_observed` where the source recorded a provider error.
//!
//! Formats ([`Format`]), each in its own submodule:
//! - `openai`: a JSON array of chat messages, or an object / array of objects
//!   holding `messages` / `traj` / `history` (tau-bench runs, mini-swe-agent),
//!   or JSONL of either.
//! - `swe-agent`: SWE-agent `.traj` (`history` plus `tool_call_ids`).
//! - `pi`: pi / OpenClaw session JSONL.
//! - `claude-code`: Claude Code session JSONL.
//! - `openhands`: OpenHands event-stream JSON arrays, and the evaluation
//!   output (`output.jsonl`: one benchmark instance per line, its events in
//!   `history`), one conversation per instance.
//! - `codex`: Codex CLI session rollouts (`rollout-*.jsonl`).
//! - `aider`: `.aider.chat.history.md`, one conversation per session.
//!
//! What every format shares (tool pairing, unique call ids, model declarations,
//! ids, times) lives in `draft`; read its doc for the exact rules. Conversation
//! ids are the file stem (known extensions `.json`, `.jsonl`, `.traj`, `.md`
//! removed), plus `#<n>` for formats that hold many conversations (an array
//! of runs, JSONL of `messages` objects, aider), `n` being the position in the
//! file, so ids stay put when a file grows. Thinking / reasoning blocks are
//! never content: they are dropped.
//!
//! Turns carry `model` and provider `usage` where the source records them,
//! and these `metadata` keys when they apply: `is_error` (a failed tool
//! result), `compact_summary` (Claude Code's own compaction summary),
//! `orphan_tool_call_id` / `tool_name` (a tool result that answered no call,
//! kept as a user message). User messages named `console` are output a
//! person saw rather than typed (aider's `> ` lines, pi's `!` commands).
//!
//! Reading never panics on input: broken input gives an [`ImportError`]
//! naming the line (JSONL, markdown) or the byte offset (JSON) where it failed.
//! Formats written one record per line by long-running tools (OpenHands
//! evaluation output, Codex rollouts) instead skip a record they cannot read
//! or do not know, and say so: [`import_bytes_reporting`] returns each
//! [`SkippedRecord`] (line and reason) beside the conversations, and
//! [`import_bytes`] logs them as warnings.

mod aider;
mod blocks;
mod claude_code;
mod codex;
mod draft;
mod openai;
mod openhands;
mod pi;
mod timestamp;

pub use draft::SYNTHETIC_EPOCH_MS;

use crate::core::event::Envelope;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// A transcript format; `Auto` detects it from the content. The one table
/// of formats: a format's name (what `--format` takes, and `Display`
/// writes) is its variant's name in kebab case, pinned by
/// `tests/import_formats.rs`; the lists below are generated from it.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    strum::IntoStaticStr,
    strum::Display,
    strum::VariantArray,
    strum::VariantNames,
)]
#[strum(serialize_all = "kebab-case")]
pub enum Format {
    #[default]
    Auto,
    Openai,
    Pi,
    ClaudeCode,
    SweAgent,
    Openhands,
    Aider,
    Codex,
}

impl Format {
    /// Every format, in the order of [`Format::NAMES`].
    pub const ALL: &'static [Format] = <Format as strum::VariantArray>::VARIANTS;

    /// The names `FromStr` accepts and `Display` writes.
    pub const NAMES: &'static [&'static str] = <Format as strum::VariantNames>::VARIANTS;

    pub fn name(self) -> &'static str {
        self.into()
    }

    /// The formats that can be named rather than detected (all but
    /// `auto`), comma-separated, for messages.
    pub fn named_list() -> String {
        Format::NAMES
            .iter()
            .copied()
            .filter(|&n| n != Format::Auto.name())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim().to_ascii_lowercase().replace('_', "-");
        Format::ALL
            .iter()
            .copied()
            .find(|f| f.name() == wanted)
            .ok_or_else(|| {
                format!(
                    "unknown transcript format `{s}`; expected one of: {}",
                    Format::NAMES.join(", ")
                )
            })
    }
}

impl clap::ValueEnum for Format {
    fn value_variants<'a>() -> &'a [Self] {
        Format::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()))
    }
}

/// One conversation read from a transcript, as inbound events in order.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportedConversation {
    /// The conversation id every event carries.
    pub conversation: String,
    /// The format it was read as (never `Auto`).
    pub format: Format,
    pub events: Vec<Envelope>,
}

/// A record an importer did not understand and left out; the rest of the
/// file was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedRecord {
    /// 1-based line of the record in the file.
    pub line: usize,
    /// Why it was left out.
    pub reason: String,
}

impl fmt::Display for SkippedRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

/// The conversations of a transcript and the records left out of them.
#[derive(Debug, Clone, PartialEq)]
pub struct Imported {
    pub conversations: Vec<ImportedConversation>,
    /// In file order.
    pub skipped: Vec<SkippedRecord>,
}

/// Why a transcript could not be imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("cannot read {path}: {error}")]
    Io {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error(
        "{input}: not a transcript format contextfold recognizes ({reason}); \
         pass --format with one of: {}",
        Format::named_list()
    )]
    UnknownFormat { input: String, reason: String },
    #[error("{input}: invalid {} at byte {offset} (line {line}, column {column}): {detail}", what(*format, "JSON"))]
    Json {
        input: String,
        format: Format,
        offset: usize,
        line: usize,
        column: usize,
        detail: String,
    },
    #[error("{input}: line {line}: invalid {}: {detail}", what(*format, "record"))]
    Line {
        input: String,
        format: Format,
        line: usize,
        detail: String,
    },
    #[error("{input}: no conversation with any turn in this {format} transcript")]
    NoConversation { input: String, format: Format },
}

/// "claude-code record", or just "record" while the format is unknown.
fn what(format: Format, thing: &str) -> String {
    match format {
        Format::Auto => thing.to_string(),
        f => format!("{f} {thing}"),
    }
}

impl ImportError {
    /// The 1-based line where reading failed, when known.
    pub fn line(&self) -> Option<usize> {
        match self {
            ImportError::Json { line, .. } | ImportError::Line { line, .. } => Some(*line),
            _ => None,
        }
    }

    /// The byte offset where reading JSON failed, when known.
    pub fn offset(&self) -> Option<usize> {
        match self {
            ImportError::Json { offset, .. } => Some(*offset),
            _ => None,
        }
    }
}

/// Reads one transcript file. The file name (not its directory) names the
/// conversations and seeds the event ids. Skipped records are logged as
/// warnings.
pub fn import_file(path: &Path, format: Format) -> Result<Vec<ImportedConversation>, ImportError> {
    Ok(log_skipped(
        import_file_reporting(path, format)?,
        &path.display().to_string(),
    ))
}

/// [`import_file`], returning the skipped records instead of logging them.
pub fn import_file_reporting(path: &Path, format: Format) -> Result<Imported, ImportError> {
    let bytes = std::fs::read(path).map_err(|error| ImportError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    import_bytes_reporting(&bytes, format, &name)
}

/// Reads a transcript held in memory. `source_name` is a file name or path
/// (only its last component counts) that names the conversations. Skipped
/// records are logged as warnings.
pub fn import_bytes(
    bytes: &[u8],
    format: Format,
    source_name: &str,
) -> Result<Vec<ImportedConversation>, ImportError> {
    Ok(log_skipped(
        import_bytes_reporting(bytes, format, source_name)?,
        source_name,
    ))
}

fn log_skipped(imported: Imported, input: &str) -> Vec<ImportedConversation> {
    for s in &imported.skipped {
        tracing::warn!(input, line = s.line, reason = %s.reason, "import skipped a record");
    }
    imported.conversations
}

/// [`import_bytes`], returning the skipped records instead of logging them.
pub fn import_bytes_reporting(
    bytes: &[u8],
    format: Format,
    source_name: &str,
) -> Result<Imported, ImportError> {
    let bytes = strip_bom(bytes);
    let format = match format {
        Format::Auto => detect(bytes, source_name)?,
        f => f,
    };
    let source = Source {
        input: source_name,
        format,
        bytes,
        skipped: RefCell::new(Vec::new()),
    };
    let drafts = match format {
        Format::Openai | Format::Auto => openai::parse(&source)?,
        Format::SweAgent => openai::parse_swe_agent(&source)?,
        Format::Pi => pi::parse(&source)?,
        Format::ClaudeCode => claude_code::parse(&source)?,
        Format::Openhands => openhands::parse(&source)?,
        Format::Aider => aider::parse(&source)?,
        Format::Codex => codex::parse(&source)?,
    };
    let stem = conversation_stem(source_name);
    let conversations: Vec<ImportedConversation> = drafts
        .into_iter()
        .filter_map(|d| draft::finish(d, &stem))
        .map(|(conversation, events)| ImportedConversation {
            conversation,
            format,
            events,
        })
        .collect();
    if conversations.is_empty() {
        return Err(ImportError::NoConversation {
            input: source_name.to_string(),
            format,
        });
    }
    Ok(Imported {
        conversations,
        skipped: source.skipped.into_inner(),
    })
}

/// Which format the content is in, from the content alone.
pub fn detect_format(bytes: &[u8]) -> Result<Format, ImportError> {
    detect(strip_bom(bytes), "input")
}

/// The file stem conversation ids start with.
fn conversation_stem(source_name: &str) -> String {
    let name = source_name
        .rsplit(['/', '\\'])
        .next()
        .unwrap_or(source_name);
    let mut stem = name;
    loop {
        let lower = stem.to_ascii_lowercase();
        let Some(ext) = [".jsonl", ".json", ".traj", ".md"]
            .into_iter()
            .find(|ext| lower.ends_with(ext) && lower.len() > ext.len())
        else {
            break;
        };
        stem = &stem[..stem.len() - ext.len()];
    }
    if stem.is_empty() {
        "import".to_string()
    } else {
        stem.to_string()
    }
}

fn strip_bom(bytes: &[u8]) -> &[u8] {
    bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes)
}

/// What a parser needs to read its input and to say where it failed.
pub(crate) struct Source<'a> {
    pub input: &'a str,
    pub format: Format,
    pub bytes: &'a [u8],
    /// Records left out, for formats that read past what they do not know.
    pub skipped: RefCell<Vec<SkippedRecord>>,
}

/// The shape of a JSON input: one document, or JSON Lines.
pub(crate) enum JsonShape<'a> {
    Document(&'a RawValue),
    Lines,
}

impl<'a> Source<'a> {
    /// Notes a record left out (1-based line) and why; reading goes on.
    pub fn skip(&self, line: usize, reason: impl Into<String>) {
        self.skipped.borrow_mut().push(SkippedRecord {
            line,
            reason: reason.into(),
        });
    }

    /// An error inside a JSON value that starts at byte `base` of the input.
    pub fn json_error(&self, base: usize, err: &serde_json::Error) -> ImportError {
        let within = offset_of(
            self.bytes.get(base..).unwrap_or_default(),
            err.line(),
            err.column(),
        );
        let offset = (base + within).min(self.bytes.len());
        let (line, column) = line_and_column(self.bytes, offset);
        ImportError::Json {
            input: self.input.to_string(),
            format: self.format,
            offset,
            line,
            column,
            detail: strip_position(err),
        }
    }

    /// A JSON error at a known byte offset, with a message of ours.
    pub fn json_error_at(&self, offset: usize, detail: impl Into<String>) -> ImportError {
        let offset = offset.min(self.bytes.len());
        let (line, column) = line_and_column(self.bytes, offset);
        ImportError::Json {
            input: self.input.to_string(),
            format: self.format,
            offset,
            line,
            column,
            detail: detail.into(),
        }
    }

    pub fn line_error(&self, line: usize, detail: impl Into<String>) -> ImportError {
        ImportError::Line {
            input: self.input.to_string(),
            format: self.format,
            line,
            detail: detail.into(),
        }
    }

    /// A serde error on JSONL line `line`, keeping the column.
    pub fn line_json_error(&self, line: usize, err: &serde_json::Error) -> ImportError {
        let detail = if err.column() > 0 {
            format!("{} (column {})", strip_position(err), err.column())
        } else {
            strip_position(err)
        };
        self.line_error(line, detail)
    }

    /// Byte offset of a value borrowed from the input.
    pub fn offset_of(&self, raw: &RawValue) -> usize {
        (raw.get().as_ptr() as usize).saturating_sub(self.bytes.as_ptr() as usize)
    }

    /// Deserializes a value borrowed from the input, errors at its position.
    pub fn parse_raw<T: Deserialize<'a>>(&self, raw: &'a RawValue) -> Result<T, ImportError> {
        serde_json::from_str(raw.get()).map_err(|e| self.json_error(self.offset_of(raw), &e))
    }

    /// One JSON document, or JSON Lines when the whole input is not one
    /// value but one of its first non-empty lines is (a torn first record
    /// does not make a JSONL file unreadable).
    pub fn json_shape(&self) -> Result<JsonShape<'a>, ImportError> {
        match serde_json::from_slice::<&RawValue>(self.bytes) {
            Ok(raw) => Ok(JsonShape::Document(raw)),
            Err(whole) => {
                if self
                    .lines()
                    .take(DETECT_LINES)
                    .any(|(_, line)| serde_json::from_slice::<IgnoredAny>(line).is_ok())
                {
                    Ok(JsonShape::Lines)
                } else {
                    Err(self.json_error(0, &whole))
                }
            }
        }
    }

    /// Non-blank lines with their 1-based numbers.
    pub fn lines(&self) -> impl Iterator<Item = (usize, &'a [u8])> {
        self.bytes
            .split(|b| *b == b'\n')
            .enumerate()
            .map(|(i, line)| (i + 1, line.strip_suffix(b"\r").unwrap_or(line)))
            .filter(|(_, line)| line.iter().any(|b| !b.is_ascii_whitespace()))
    }
}

/// Byte offset within `bytes` of serde_json's line and column. serde_json's
/// column counts the bytes of the line it consumed, so for an error found on
/// peeking (a wrong type, end of input) this is the offending byte, and for a
/// consumed bad character the byte after it.
fn offset_of(bytes: &[u8], line: usize, column: usize) -> usize {
    let mut line_start = 0;
    if line > 1 {
        let mut seen = 1;
        match bytes.iter().enumerate().find(|(_, b)| {
            if **b == b'\n' {
                seen += 1;
            }
            seen == line
        }) {
            Some((i, _)) => line_start = i + 1,
            None => return bytes.len(),
        }
    }
    (line_start + column).min(bytes.len())
}

fn line_and_column(bytes: &[u8], offset: usize) -> (usize, usize) {
    let before = &bytes[..offset.min(bytes.len())];
    let line = before.iter().filter(|b| **b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |p| p + 1);
    (line, offset - line_start + 1)
}

/// serde_json's message without its " at line L column C" (relative to the
/// slice it read, so misleading here; we report absolute positions).
fn strip_position(err: &serde_json::Error) -> String {
    let text = err.to_string();
    match text.rfind(" at line ") {
        Some(i) if err.line() > 0 => text[..i].to_string(),
        _ => text,
    }
}

// ---------------------------------------------------------------- detection

/// Top-level keys of a JSON object, values left unread.
type Keys = BTreeMap<String, IgnoredAny>;

fn detect(bytes: &[u8], input: &str) -> Result<Format, ImportError> {
    let unknown = |reason: &str| ImportError::UnknownFormat {
        input: input.to_string(),
        reason: reason.to_string(),
    };
    let Some(first) = bytes.iter().find(|b| !b.is_ascii_whitespace()) else {
        return Err(unknown("the input is empty"));
    };
    if !matches!(first, b'[' | b'{') {
        return if aider::looks_like_aider(bytes) {
            Ok(Format::Aider)
        } else {
            Err(unknown(
                "neither JSON, JSON Lines nor an aider chat history (no `# aider chat started at` or `#### ` line)",
            ))
        };
    }
    let source = Source {
        input,
        format: Format::Auto,
        bytes,
        skipped: RefCell::new(Vec::new()),
    };
    match source.json_shape()? {
        JsonShape::Document(raw) => detect_document(&source, raw).map_err(|r| unknown(&r)),
        JsonShape::Lines => detect_lines(&source),
    }
}

fn detect_document(source: &Source<'_>, raw: &RawValue) -> Result<Format, String> {
    let text = raw.get().trim_start();
    if text.starts_with('{') {
        let keys: Keys = serde_json::from_str(text).map_err(|e| e.to_string())?;
        // A one-line JSONL file parses as one document.
        let probe: RecordProbe = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if probe.kind.is_some() {
            if let Some(format) = classify_probe(&probe) {
                return Ok(format);
            }
        }
        if is_openhands_instance(&keys) {
            return Ok(Format::Openhands);
        }
        if keys.contains_key("history")
            && ["trajectory", "info", "environment", "replay_config"]
                .iter()
                .any(|k| keys.contains_key(*k))
        {
            return Ok(Format::SweAgent);
        }
        if ["messages", "traj", "history", "role"]
            .iter()
            .any(|k| keys.contains_key(*k))
        {
            return Ok(Format::Openai);
        }
        return Err("a JSON object without `messages`, `traj` or `history`".to_string());
    }
    let items: Vec<&RawValue> = serde_json::from_str(text)
        .map_err(|_| "a JSON value that is neither an object nor an array".to_string())?;
    let Some(first) = items.first() else {
        return Err("an empty JSON array".to_string());
    };
    let keys: Keys = serde_json::from_str(first.get()).map_err(|_| {
        format!(
            "a JSON array whose first element (byte {}) is not an object",
            source.offset_of(first)
        )
    })?;
    if is_openhands_instance(&keys) {
        return Ok(Format::Openhands);
    }
    if keys.contains_key("role")
        || ["messages", "traj", "history"]
            .iter()
            .any(|k| keys.contains_key(*k))
    {
        return Ok(Format::Openai);
    }
    if keys.contains_key("source")
        && (keys.contains_key("action") || keys.contains_key("observation"))
    {
        return Ok(Format::Openhands);
    }
    Err("a JSON array of objects that are neither chat messages, runs with `traj`/`messages`/`history`, nor OpenHands events".to_string())
}

/// An OpenHands evaluation instance: `instance_id` beside the event `history`.
fn is_openhands_instance(keys: &Keys) -> bool {
    keys.contains_key("instance_id") && keys.contains_key("history")
}

#[derive(Deserialize)]
struct RecordProbe {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    message: Option<IgnoredAny>,
    #[serde(default)]
    role: Option<IgnoredAny>,
    #[serde(default)]
    messages: Option<IgnoredAny>,
    #[serde(default)]
    traj: Option<IgnoredAny>,
    #[serde(default)]
    payload: Option<IgnoredAny>,
    /// Older Codex rollouts mark state with `{"record_type":"state"}`.
    #[serde(default)]
    record_type: Option<IgnoredAny>,
    #[serde(default)]
    instance_id: Option<IgnoredAny>,
    #[serde(default)]
    history: Option<IgnoredAny>,
}

/// Pi, Claude Code, Codex, an OpenHands evaluation instance or OpenAI from
/// one JSONL record.
fn classify_probe(probe: &RecordProbe) -> Option<Format> {
    if probe.instance_id.is_some() && probe.history.is_some() {
        return Some(Format::Openhands);
    }
    if probe.record_type.is_some() {
        return Some(Format::Codex);
    }
    match probe.kind.as_deref() {
        Some("session_meta" | "response_item" | "event_msg" | "turn_context" | "compacted")
            if probe.payload.is_some() =>
        {
            return Some(Format::Codex)
        }
        Some(
            "session" | "model_change" | "thinking_level_change" | "compaction" | "branch_summary",
        ) => return Some(Format::Pi),
        Some("message") if probe.message.is_some() => return Some(Format::Pi),
        Some("user" | "assistant") if probe.message.is_some() => return Some(Format::ClaudeCode),
        Some("summary" | "progress" | "file-history-snapshot" | "queue-operation" | "system") => {
            return Some(Format::ClaudeCode)
        }
        _ => {}
    }
    if probe.role.is_some() || probe.messages.is_some() || probe.traj.is_some() {
        return Some(Format::Openai);
    }
    None
}

/// How many JSONL records detection reads before giving up.
const DETECT_LINES: usize = 200;

fn detect_lines(source: &Source<'_>) -> Result<Format, ImportError> {
    // A damaged record does not hide the format of the ones after it; the
    // format's reader then reports it (or fails on it).
    let mut first_error = None;
    for (number, line) in source.lines().take(DETECT_LINES) {
        let probe: RecordProbe = match serde_json::from_slice(line) {
            Ok(p) => p,
            Err(e) => {
                first_error.get_or_insert_with(|| source.line_json_error(number, &e));
                continue;
            }
        };
        if let Some(format) = classify_probe(&probe) {
            return Ok(format);
        }
    }
    if let Some(err) = first_error {
        return Err(err);
    }
    Err(ImportError::UnknownFormat {
        input: source.input.to_string(),
        reason: format!(
            "JSON Lines whose first {DETECT_LINES} records are neither pi, Claude Code, Codex, OpenHands evaluation instances nor OpenAI chat records"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_names_round_trip() {
        for (&format, &name) in Format::ALL.iter().zip(Format::NAMES) {
            assert_eq!(format.to_string(), name);
            assert_eq!(name.parse::<Format>(), Ok(format));
        }
        assert_eq!("Claude_Code".parse::<Format>(), Ok(Format::ClaudeCode));
        use clap::ValueEnum;
        assert_eq!(
            <Format as ValueEnum>::from_str("swe-agent", false),
            Ok(Format::SweAgent)
        );
        assert!(<Format as ValueEnum>::from_str("sweagent", false).is_err());
        let err = "word".parse::<Format>().unwrap_err();
        assert!(err.contains("claude-code"), "{err}");
    }

    #[test]
    fn stems_drop_known_extensions_and_directories() {
        assert_eq!(
            conversation_stem("a/b/github_issue.traj.json"),
            "github_issue"
        );
        assert_eq!(conversation_stem("C:\\x\\s.jsonl"), "s");
        assert_eq!(
            conversation_stem("m.function_calling.traj"),
            "m.function_calling"
        );
        assert_eq!(conversation_stem("notes.txt"), "notes.txt");
        assert_eq!(conversation_stem(".json"), ".json");
        assert_eq!(conversation_stem(""), "import");
    }

    #[test]
    fn detects_from_content() {
        let cases: [(&str, Format); 9] = [
            (r#"[{"role":"user","content":"hi"}]"#, Format::Openai),
            (r#"{"messages":[{"role":"user","content":"hi"}]}"#, Format::Openai),
            (r#"[{"traj":[{"role":"user","content":"hi"}]}]"#, Format::Openai),
            (r#"{"history":[],"trajectory":[]}"#, Format::SweAgent),
            (r#"[{"id":0,"source":"user","action":"message"}]"#, Format::Openhands),
            ("{\"type\":\"session\",\"id\":\"x\"}\n{\"type\":\"message\",\"message\":{}}\n", Format::Pi),
            ("{\"type\":\"progress\"}\n{\"type\":\"user\",\"message\":{}}\n", Format::ClaudeCode),
            ("{\"role\":\"user\",\"content\":\"a\"}\n{\"role\":\"assistant\",\"content\":\"b\"}\n", Format::Openai),
            ("# aider chat started at 2024-01-01 00:00:00\n\n#### hi\n", Format::Aider),
        ];
        for (text, want) in cases {
            assert_eq!(detect_format(text.as_bytes()).unwrap(), want, "{text}");
        }
    }

    #[test]
    fn unknown_inputs_say_why() {
        for text in ["", "hello world", "[]", "[1,2]", r#"{"a":1}"#, "42"] {
            let err = detect_format(text.as_bytes()).unwrap_err();
            assert!(
                matches!(err, ImportError::UnknownFormat { .. }),
                "{text}: {err}"
            );
            assert!(err.to_string().contains("--format"), "{err}");
        }
    }

    #[test]
    fn broken_json_names_the_byte() {
        let text = b"[\n  {\"role\": \"user\", \"content\": \"hi\"},\n  {\"role\": \"assistant\", \"content\": \"x\"\n";
        let err = detect_format(text).unwrap_err();
        assert_eq!(err.offset(), Some(text.len()), "{err}");
        assert!(err.to_string().contains("byte"), "{err}");
    }

    #[test]
    fn broken_jsonl_names_the_line() {
        // Detection stops at the first telling record; reading finds the break.
        let text = b"{\"type\":\"progress\"}\n\n{\"type\":\"user\",\"message\":{\"role\"\n";
        assert_eq!(detect_format(text).unwrap(), Format::ClaudeCode);
        let err = import_bytes(text, Format::Auto, "s.jsonl").unwrap_err();
        assert_eq!(err.line(), Some(3), "{err}");
        assert!(err.to_string().contains("line 3"), "{err}");
        // A first line that is not JSON at all, in a file that is not one
        // JSON document either.
        let err = detect_format(b"{\"type\":\n\"x\"} {").unwrap_err();
        assert!(err.to_string().contains("byte"), "{err}");
    }
}
