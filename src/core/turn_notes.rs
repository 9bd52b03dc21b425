//! What the deterministic summarizer notes of one turn on its own
//! ([`TurnNotes`]): the data, kept with a turn's reading
//! ([`crate::core::summary::SourceReading`]) so a second draft of the same
//! turn takes what the first noted. How a turn is noted, and how notes
//! are merged in order, is `fallback_summary::turn` and
//! `fallback_summary::notes`.

/// What a draft notes of one turn on its own (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnNotes(pub(crate) Of);

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Of {
    /// A system prompt or another task's demonstration: context, not
    /// events of the span.
    Context,
    User(UserNotes),
    Assistant(AssistantNotes),
    /// A tool's result: its output is read apart (`fallback_summary::reading`).
    Result,
    /// A child summary, read back into sections by `fallback_summary::children`.
    Child,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UserNotes {
    /// The request in the user's words, whole and short; `None` when the
    /// turn holds no prose (only pasted output).
    pub(crate) ask: Option<Ask>,
    /// Its sentences that decide, each cut to `fallback_summary`'s `SENTENCE_CHARS`.
    pub(crate) decisions: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ask {
    /// Up to `fallback_summary`'s `ASK_CHARS`.
    pub(crate) long: String,
    /// Up to `fallback_summary`'s `SHORT_ASK_CHARS`.
    pub(crate) short: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AssistantNotes {
    /// The first sentence of its words that is prose.
    pub(crate) first: Option<String>,
    /// Its words up to `fallback_summary`'s `FIX_CHARS`: how it meets an error before it
    /// (empty when it has no first sentence, which is when they are not
    /// taken).
    pub(crate) fix: String,
    /// Its sentences, files and actions, in the order they are met.
    pub(crate) noted: Vec<Noted>,
    /// Its calls by name and kind, in order: the results after it answer
    /// them.
    pub(crate) calls: Vec<(String, CallKind)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Noted {
    Sentence(Said, String),
    /// A file changed: its path, how, and what changed (the first
    /// sentence, then the change when it says something else).
    File {
        path: String,
        verb: &'static str,
        what: Vec<String>,
    },
    /// A call that changes something other than a file.
    Action(String),
}

/// What a sentence of the agent's words says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Said {
    Question,
    Intention,
    Milestone,
    Diagnosis,
    Decision,
    Open,
}

/// How a tool call is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CallKind {
    /// It changes a file: the path and how.
    File { path: String, verb: &'static str },
    /// A shell command (its text, for naming what failed or passed).
    Shell(String),
    /// It reads or looks something up: nothing to record.
    Read,
    /// It changes something else (a booking, an issue, a deployment).
    Action,
    /// The agent thinking aloud: its text is narration.
    Thought(String),
}
