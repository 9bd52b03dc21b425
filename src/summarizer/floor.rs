//! The floor a model's summary must reach: every fact code can check in
//! the span (the user's requests, the errors, the decisions, the files
//! changed, [`HandoverFacts`]) that the deterministic summary of the same
//! span keeps. [`Floor::check`] refuses an answer below it with the facts
//! it misses; [`Floor::complete`] adds the deterministic summary's own
//! lines for them, so a stored model summary keeps, fact by fact, at least
//! what the fallback keeps. Pure: no I/O. Below [`super::checks`], which
//! reports a [`Below`] as one of its rejections.

use crate::core::fallback_summary::HandoverFacts;
use crate::core::summary::SourceItem;
use crate::core::tokens::{count_text, Encoding};

/// The bar a model's answer must reach: every fact code can check (the
/// user's requests, the errors, the decisions, the files changed) that the
/// deterministic summary of the same span keeps. An answer that misses some
/// can be completed with the deterministic summary's own lines for them
/// ([`Floor::complete`]): a stored model summary then keeps, fact by fact,
/// at least what the fallback keeps.
/// An answer below the floor: it keeps `kept` of the `deterministic` facts
/// the deterministic summary keeps; `missing` says which, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Below {
    pub kept: usize,
    pub deterministic: usize,
    pub missing: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct Floor {
    facts: HandoverFacts,
    /// For each fact (in [`HandoverFacts::each`]'s order) the deterministic
    /// summary keeps: its line there; `None` for a fact it does not keep.
    kept: Vec<Option<Kept>>,
}

#[derive(Debug, Clone)]
enum Kept {
    /// The deterministic summary's line that keeps the fact.
    Line(String),
    /// Kept, but across lines: no one line can stand for it.
    Spread,
}

impl Floor {
    /// The floor set by `deterministic`, a deterministic text written over
    /// `sources`.
    pub fn new(sources: &[SourceItem], deterministic: &str) -> Floor {
        Floor::of_facts(HandoverFacts::of(sources), deterministic)
    }

    /// The floor set by `deterministic` on `facts` (those of its sources,
    /// and for a rolling state those its previous state carried).
    pub fn of_facts(facts: HandoverFacts, deterministic: &str) -> Floor {
        let whole = deterministic.to_lowercase();
        let lines: Vec<(&str, String)> = deterministic
            .lines()
            .map(|l| (l, l.to_lowercase()))
            .collect();
        let kept = facts
            .each()
            .map(|fact| {
                if !fact.kept_in(&whole) {
                    return None;
                }
                Some(
                    lines
                        .iter()
                        .find(|(_, lower)| fact.kept_in(lower))
                        .map_or(Kept::Spread, |(line, _)| {
                            Kept::Line(line.trim().to_string())
                        }),
                )
            })
            .collect();
        Floor { facts, kept }
    }

    /// The facts the deterministic summary keeps that `text` misses.
    fn missing(&self, text: &str) -> Vec<(String, Option<&str>)> {
        let lower = text.to_lowercase();
        self.facts
            .each()
            .zip(&self.kept)
            .filter_map(|(fact, kept)| {
                let kept = kept.as_ref()?;
                if fact.kept_in(&lower) {
                    return None;
                }
                Some((
                    fact.describe(),
                    match kept {
                        Kept::Line(line) => Some(line.as_str()),
                        Kept::Spread => None,
                    },
                ))
            })
            .collect()
    }

    fn below(&self, missing: Vec<(String, Option<&str>)>) -> Below {
        let deterministic = self.kept.iter().flatten().count();
        Below {
            kept: deterministic - missing.len(),
            deterministic,
            missing: missing.into_iter().map(|(what, _)| what).collect(),
        }
    }

    /// Refuses `text` when it misses a fact the deterministic one keeps.
    pub fn check(&self, text: &str) -> Result<(), Below> {
        let missing = self.missing(text);
        if missing.is_empty() {
            return Ok(());
        }
        Err(self.below(missing))
    }

    /// `text` with the deterministic summary's lines for the facts it
    /// misses appended under [`FROM_THE_TURNS_HEADING`]: what the model
    /// said, anchored to what code knows. Refused when a missing fact has
    /// no one line to stand for it, or when the lines would take the text
    /// over `max_tokens`.
    pub fn complete(&self, text: &str, max_tokens: u64) -> Result<String, Below> {
        let missing = self.missing(text);
        if missing.is_empty() {
            return Ok(text.to_string());
        }
        if missing.iter().any(|(_, line)| line.is_none()) {
            return Err(self.below(missing));
        }
        let mut out = text.trim_end().to_string();
        out.push_str("\n\n");
        out.push_str(FROM_THE_TURNS_HEADING);
        let mut added: Vec<&str> = Vec::new();
        for line in missing.iter().filter_map(|(_, line)| *line) {
            if added.contains(&line) {
                continue;
            }
            added.push(line);
            out.push('\n');
            if !line.starts_with("- ") {
                out.push_str("- ");
            }
            out.push_str(line);
        }
        if count_text(Encoding::O200kBase, &out) > max_tokens {
            return Err(self.below(missing));
        }
        Ok(out)
    }
}

/// The heading under which [`Floor::complete`] adds the deterministic
/// lines a model's answer missed.
pub const FROM_THE_TURNS_HEADING: &str = "## Also in these turns";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::Role;
    use crate::core::summary::SummaryRequest;
    use crate::testing::summary_request as req;

    #[test]
    fn the_floor_holds_a_model_to_the_errors_the_deterministic_summary_keeps() {
        let turn = |label: &str, role: Role, tool: Option<&str>, text: &str| SourceItem {
            label: label.into(),
            role: Some(role),
            tool: tool.map(str::to_string),
            text: text.into(),
            tokens: 400,
            time: 0,
            ..SourceItem::default()
        };
        let sources = vec![
            turn(
                "turn 1",
                Role::User,
                None,
                "Fix the TimeDelta rounding in src/marshmallow/fields.py without touching the tests.",
            ),
            turn(
                "turn 2",
                Role::Tool,
                Some("bash"),
                "Traceback (most recent call last):\n  File \"reproduce.py\", line 3\nIndentationError: unexpected indent at reproduce_rounding line 3",
            ),
        ];
        let r = SummaryRequest {
            sources: sources.clone(),
            ..req("", 800, 200)
        };
        let deterministic = crate::summarizer::DeterministicSummarizer::draft(&r).content;
        let facts = HandoverFacts::of(&sources);
        assert_eq!(facts.errors.len(), 1, "{facts:?}");
        assert!(
            deterministic.contains("IndentationError"),
            "{deterministic}"
        );
        let floor = Floor::new(&sources, &deterministic);
        let dropped = "The user asked to fix the TimeDelta rounding in fields.py and to leave \
                       the tests untouched; the agent reproduced it.";
        match floor.check(dropped) {
            Err(Below { missing, .. }) => {
                assert!(
                    missing.iter().any(|m| m.starts_with("the error")),
                    "{missing:?}"
                )
            }
            other => panic!("{other:?}"),
        }
        let kept = "The user asked to fix the TimeDelta rounding in fields.py and to leave \
                    the tests untouched; running reproduce.py hit IndentationError: unexpected \
                    indent (reproduce_rounding, line 3).";
        assert_eq!(floor.check(kept), Ok(()));
        // Its words without its name are not the error.
        let unnamed = "The user asked to fix the TimeDelta rounding in fields.py and to leave \
                       the tests untouched; reproduce.py failed on an unexpected indent.";
        assert!(floor.check(unnamed).is_err());
        // Completed, it carries the deterministic line that names it.
        let completed = floor.complete(unnamed, 400).unwrap();
        assert!(completed.contains("IndentationError"), "{completed}");
        assert_eq!(floor.check(&completed), Ok(()));
    }
}
