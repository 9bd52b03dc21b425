//! Continuity probes: what an agent resuming a conversation needs to know,
//! checked against the context it would be given.
//!
//! A probe file is JSON Lines, one probe a line (blank lines and lines
//! starting with `//` are skipped):
//!
//! ```json
//! {"conversation": "fa812bfe-…", "id": "cc-task-1", "kind": "task",
//!  "question": "What did the user ask for?",
//!  "expect": ["(?i)work on (the )?bead spotter-a0y"], "at_turn": 287}
//! ```
//!
//! - `kind`: `task`, `file`, `error`, `decision`, `done`, `open` or `next`;
//! - `expect`: regular expressions (Rust `regex` syntax); the probe passes
//!   when any of them matches the context's text;
//! - `at_turn` (optional): check the context as it was right after that
//!   turn (its sequence number, as `assemble --at` and summaries count);
//!   without it, the context at the end of the conversation.
//!
//! [`parse`] refuses a file with a reason naming the line: bad JSON, an
//! unknown kind, no or a bad expression, a repeated id. The context's text
//! is every message's content and tool calls ([`context_text`]).
//!
//! The baseline a context must beat is plain truncation: the newest raw
//! turns that fit the budget, tool groups whole, each rendered as assembly
//! renders a turn (a large payload as its stub) ([`truncation`]).

use crate::core::assembly;
use crate::core::message::{ChatMessage, Role};
use crate::core::state::{BodyError, Conversation, TurnBodies};
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::borrow::Borrow;
use std::collections::{BTreeMap, HashSet};
use std::fmt;

/// What a probe asks about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    /// The task and its constraints, in the user's words.
    Task,
    /// A file changed and what changed in it.
    File,
    /// An error met, and how it was fixed.
    Error,
    /// A decision (the user's or the agent's) and why.
    Decision,
    /// A milestone reached: tests passing, a commit, a task closed.
    Done,
    /// An open question or unfinished work.
    Open,
    /// The next step.
    Next,
}

impl ProbeKind {
    pub const ALL: [ProbeKind; 7] = [
        ProbeKind::Task,
        ProbeKind::File,
        ProbeKind::Error,
        ProbeKind::Decision,
        ProbeKind::Done,
        ProbeKind::Open,
        ProbeKind::Next,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ProbeKind::Task => "task",
            ProbeKind::File => "file",
            ProbeKind::Error => "error",
            ProbeKind::Decision => "decision",
            ProbeKind::Done => "done",
            ProbeKind::Open => "open",
            ProbeKind::Next => "next",
        }
    }
}

impl fmt::Display for ProbeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One probe, its expressions compiled.
#[derive(Debug, Clone)]
pub struct Probe {
    pub conversation: String,
    pub id: String,
    pub kind: ProbeKind,
    pub question: String,
    pub expect: Vec<Regex>,
    pub at_turn: Option<u64>,
}

impl Probe {
    /// Whether the context's text answers it: any expression matches.
    pub fn passes(&self, context: &str) -> bool {
        self.expect.iter().any(|re| re.is_match(context))
    }
}

/// A line of a probe file as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProbeLine {
    conversation: String,
    id: String,
    kind: ProbeKind,
    question: String,
    expect: Vec<String>,
    #[serde(default)]
    at_turn: Option<u64>,
}

/// Why a probe file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("line {line}: not a probe ({source}); a probe is {{\"conversation\", \"id\", \"kind\": task|file|error|decision|done|open|next, \"question\", \"expect\": [regex, ...], \"at_turn\"?}}")]
    Json {
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("line {line}: probe {id:?} has no expression in \"expect\"")]
    NoExpectation { line: usize, id: String },
    #[error("line {line}: probe {id:?}: expression {pattern:?} does not compile")]
    Regex {
        line: usize,
        id: String,
        pattern: String,
        #[source]
        source: regex::Error,
    },
    #[error("line {line}: probe id {id:?} is used twice (first on line {first})")]
    DuplicateId {
        line: usize,
        first: usize,
        id: String,
    },
    #[error("line {line}: {what} is empty")]
    Empty { line: usize, what: &'static str },
}

/// Reads a probe file's text.
pub fn parse(text: &str) -> Result<Vec<Probe>, ProbeError> {
    let mut probes = Vec::new();
    let mut ids: BTreeMap<String, usize> = BTreeMap::new();
    for (n, raw) in text.lines().enumerate() {
        let line = n + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with("//") {
            continue;
        }
        let p: ProbeLine =
            serde_json::from_str(trimmed).map_err(|source| ProbeError::Json { line, source })?;
        for (what, value) in [
            ("conversation", &p.conversation),
            ("id", &p.id),
            ("question", &p.question),
        ] {
            if value.trim().is_empty() {
                return Err(ProbeError::Empty { line, what });
            }
        }
        if let Some(&first) = ids.get(&p.id) {
            return Err(ProbeError::DuplicateId {
                line,
                first,
                id: p.id,
            });
        }
        ids.insert(p.id.clone(), line);
        if p.expect.is_empty() {
            return Err(ProbeError::NoExpectation { line, id: p.id });
        }
        let mut expect = Vec::with_capacity(p.expect.len());
        for pattern in p.expect {
            let re = Regex::new(&pattern).map_err(|source| ProbeError::Regex {
                line,
                id: p.id.clone(),
                pattern: pattern.clone(),
                source,
            })?;
            expect.push(re);
        }
        probes.push(Probe {
            conversation: p.conversation,
            id: p.id,
            kind: p.kind,
            question: p.question,
            expect,
            at_turn: p.at_turn,
        });
    }
    Ok(probes)
}

/// The text probes are checked against: each message's content and tool
/// calls, one message after another.
pub fn context_text<M: Borrow<ChatMessage>>(messages: &[M]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str(&m.borrow().searchable_text());
        out.push('\n');
    }
    out
}

/// Plain truncation: the newest raw turns of the conversation's current
/// epoch that fit `budget` tokens, oldest first. Tool groups (an assistant
/// turn and the results after it) are taken whole or not at all, newest
/// first, stopping at the first that does not fit; each turn costs and is
/// rendered what assembly sends for it (a large payload is its stub).
/// Turns the fold kept out of context (duplicates) are left out too.
pub fn truncation(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    budget: u64,
) -> Result<Vec<ChatMessage>, BodyError> {
    let turns: Vec<usize> = conv
        .turns
        .iter()
        .enumerate()
        .filter(|(_, t)| t.in_context && t.epoch == conv.epoch)
        .map(|(i, _)| i)
        .collect();
    let mut used = 0u64;
    let mut end = turns.len();
    let mut start_kept = turns.len();
    while end > 0 {
        let mut start = end - 1;
        while start > 0 && conv.turns[turns[start]].role == Role::Tool {
            start -= 1;
        }
        let cost: u64 = turns[start..end]
            .iter()
            .map(|&i| u64::from(conv.turns[i].context_tokens))
            .sum();
        if used + cost > budget {
            break;
        }
        used += cost;
        start_kept = start;
        end = start;
    }
    let mut out = Vec::with_capacity(turns.len() - start_kept);
    for &i in &turns[start_kept..] {
        let turn = &conv.turns[i];
        let body = bodies.turn_body(conv, turn.seq)?;
        out.push(if turn.large_payload {
            assembly::payload_stub_message(&body.message, &body.event_id, u64::from(turn.tokens))
        } else {
            body.message.clone()
        });
    }
    Ok(out)
}

/// Probes passed, of those asked, by kind: for the assembled context and
/// for plain truncation at the same budget.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KindTally {
    pub probes: u64,
    pub contextfold: u64,
    pub truncation: u64,
}

impl KindTally {
    pub fn add(&mut self, other: &KindTally) {
        self.probes += other.probes;
        self.contextfold += other.contextfold;
        self.truncation += other.truncation;
    }
}

/// The outcome of one probe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProbeOutcome {
    pub id: String,
    pub kind: ProbeKind,
    pub conversation: String,
    pub contextfold: bool,
    pub truncation: bool,
}

/// Probe results of one run: by kind, and each probe's outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ProbeReport {
    pub by_kind: BTreeMap<ProbeKind, KindTally>,
    pub outcomes: Vec<ProbeOutcome>,
}

impl ProbeReport {
    /// Checks `probe` against both contexts' texts and records it.
    pub fn record(&mut self, probe: &Probe, contextfold: &str, truncation: &str) {
        let outcome = ProbeOutcome {
            id: probe.id.clone(),
            kind: probe.kind,
            conversation: probe.conversation.clone(),
            contextfold: probe.passes(contextfold),
            truncation: probe.passes(truncation),
        };
        let t = self.by_kind.entry(probe.kind).or_default();
        t.probes += 1;
        t.contextfold += u64::from(outcome.contextfold);
        t.truncation += u64::from(outcome.truncation);
        self.outcomes.push(outcome);
    }

    pub fn merge(&mut self, other: &ProbeReport) {
        for (kind, t) in &other.by_kind {
            self.by_kind.entry(*kind).or_default().add(t);
        }
        self.outcomes.extend(other.outcomes.iter().cloned());
    }

    /// All kinds together.
    pub fn total(&self) -> KindTally {
        let mut all = KindTally::default();
        for t in self.by_kind.values() {
            all.add(t);
        }
        all
    }
}

/// The conversations a probe set names, for telling the probes of a file
/// from the rest.
pub fn conversations(probes: &[Probe]) -> HashSet<&str> {
    probes.iter().map(|p| p.conversation.as_str()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{Envelope, EventBody, TurnAppended};
    use crate::core::fold::fold;
    use crate::core::message::{FunctionCall, ToolCall};
    use crate::core::policy::PolicyConfig;
    use crate::core::state::{Resident, State};

    #[test]
    fn a_probe_file_is_read_and_refused_with_the_line() {
        let text = r#"
// comment
{"conversation":"c","id":"a","kind":"task","question":"What?","expect":["(?i)rotate the key"]}

{"conversation":"c","id":"b","kind":"next","question":"Then?","expect":["deploy","ship"],"at_turn":3}
"#;
        let probes = parse(text).unwrap();
        assert_eq!(probes.len(), 2);
        assert_eq!(probes[1].kind, ProbeKind::Next);
        assert_eq!(probes[1].at_turn, Some(3));
        assert!(probes[0].passes("we must ROTATE THE KEY today"));
        assert!(probes[1].passes("then ship it"));
        assert!(!probes[1].passes("then wait"));

        let bad_kind =
            r#"{"conversation":"c","id":"a","kind":"plan","question":"q","expect":["x"]}"#;
        let e = parse(bad_kind).unwrap_err().to_string();
        assert!(e.starts_with("line 1:") && e.contains("task|file"), "{e}");
        let bad_regex =
            r#"{"conversation":"c","id":"a","kind":"task","question":"q","expect":["(x"]}"#;
        assert!(matches!(
            parse(bad_regex),
            Err(ProbeError::Regex { line: 1, .. })
        ));
        let none = r#"{"conversation":"c","id":"a","kind":"task","question":"q","expect":[]}"#;
        assert!(matches!(parse(none), Err(ProbeError::NoExpectation { .. })));
        let twice = format!(
            "{}\n{}",
            &text.lines().nth(2).unwrap(),
            &text.lines().nth(2).unwrap()
        );
        assert!(matches!(
            parse(&twice),
            Err(ProbeError::DuplicateId {
                line: 2,
                first: 1,
                ..
            })
        ));
        let unknown = r#"{"conversation":"c","id":"a","kind":"task","question":"q","expect":["x"],"budget":3}"#;
        assert!(parse(unknown).is_err());
    }

    fn folded(messages: Vec<ChatMessage>) -> State {
        let policy = PolicyConfig::default();
        let mut state = State::default();
        for (i, m) in messages.into_iter().enumerate() {
            let e = Envelope::new(
                format!("t{i}"),
                "c",
                1 + i as u64,
                EventBody::TurnAppended(TurnAppended::from(m)),
            );
            fold(&mut state, &policy, &e);
        }
        state
    }

    /// Truncation keeps the newest turns that fit, a tool group whole or
    /// not at all, oldest first.
    #[test]
    fn truncation_keeps_the_newest_turns_and_whole_tool_groups() {
        let mut call = ChatMessage::text(Role::Assistant, "listing");
        call.tool_calls = vec![ToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "ls".into(),
                arguments: "{}".into(),
            },
        }];
        let mut result = ChatMessage::text(Role::Tool, "src tests ".repeat(40));
        result.tool_call_id = Some("call_1".into());
        let state = folded(vec![
            ChatMessage::text(Role::User, "first request about the ledger"),
            call,
            result,
            ChatMessage::text(Role::User, "second request about the invoice"),
        ]);
        let conv = &state.conversations["c"];
        let costs: Vec<u64> = conv
            .turns
            .iter()
            .map(|t| u64::from(t.context_tokens))
            .collect();
        // Room for the newest turn and the tool result, not for the call:
        // the group goes whole, so only the newest turn is kept.
        let budget = costs[3] + costs[2];
        let kept = truncation(conv, &Resident, budget).unwrap();
        assert_eq!(kept.len(), 1);
        assert!(context_text(&kept).contains("invoice"));
        // With room for the group, it is kept whole, oldest first.
        let kept = truncation(conv, &Resident, costs[1] + costs[2] + costs[3]).unwrap();
        assert_eq!(kept.len(), 3);
        assert_eq!(kept[0].role, Role::Assistant);
        assert_eq!(kept[1].role, Role::Tool);
        // Everything fits: everything is kept.
        let all: u64 = costs.iter().sum();
        assert_eq!(truncation(conv, &Resident, all).unwrap().len(), 4);
        assert!(truncation(conv, &Resident, 0).unwrap().is_empty());
    }

    #[test]
    fn reports_count_both_contexts_by_kind() {
        let probes = parse(
            r#"{"conversation":"c","id":"a","kind":"file","question":"q","expect":["src/a\\.rs"]}
{"conversation":"c","id":"b","kind":"file","question":"q","expect":["src/b\\.rs"]}"#,
        )
        .unwrap();
        let mut report = ProbeReport::default();
        for p in &probes {
            report.record(p, "edited src/a.rs and src/b.rs", "edited src/b.rs");
        }
        assert_eq!(
            report.by_kind[&ProbeKind::File],
            KindTally {
                probes: 2,
                contextfold: 2,
                truncation: 1
            }
        );
        let mut both = report.clone();
        both.merge(&report);
        assert_eq!(both.total().probes, 4);
        assert_eq!(both.outcomes.len(), 4);
    }
}
