//! A case-insensitive pattern with Unicode word boundaries, run on a line
//! by the regex crate's DFA whenever that gives the pattern's own answer.
//!
//! The deterministic summarizer and the mask ask such patterns of every
//! line a screen lets through (`fallback_summary::signals`). On a line with
//! a non-ASCII character the regex crate cannot run a Unicode `\b` in its
//! lazy DFA and falls back to a backtracker or the PikeVM: numbered file
//! listings (`  31→ …`) put one on every line of a `Read` output, and that
//! slow engine was a tenth of `run`'s measuring thread.
//!
//! A [`LinePattern`] keeps the pattern and its ASCII twin (the same
//! pattern under `(?-u)`). The twin answers the same on a line whose
//! non-ASCII characters are all neither word characters nor white space
//! (`→`, `✓`, `—`, quotes, box drawing): there
//! - `\b`, `\w`, `\d` and `\s` see those characters (Unicode) and their
//!   bytes (ASCII) alike, as non-word, non-digit, non-space;
//! - case-insensitive matching differs only by the two characters that
//!   fold to an ASCII letter (`ſ` to `s`, the Kelvin sign to `k`), both
//!   word characters, so never on such a line;
//! - what else could tell a character from its bytes (`.`, `\S`, a
//!   negated class: one character against one byte of it) makes the twin
//!   a pattern that can match invalid UTF-8, which [`Regex::new`] refuses
//!   for a `&str` pattern: such a pattern keeps no twin and always runs
//!   itself.
//!
//! Under `cfg(test)` every answer of a twin is checked against the pattern's
//! own, so the summarizer's and the mask's unit tests and proptests (one
//! over lines of mixed scripts, `fallback_summary::tests`) check every
//! pattern built this way.

use regex::Regex;

pub struct LinePattern {
    unicode: Regex,
    /// `None` when the pattern's ASCII form could tell a character from
    /// its bytes (see the module doc).
    ascii: Option<Regex>,
}

impl LinePattern {
    /// Panics on an invalid pattern: the patterns are literals of the
    /// crate, each built by a test.
    #[allow(clippy::expect_used)]
    pub fn new(pattern: &str) -> LinePattern {
        LinePattern {
            unicode: Regex::new(pattern).expect("a line pattern of the crate compiles"),
            ascii: Regex::new(&format!("(?-u){pattern}")).ok(),
        }
    }

    pub fn is_match(&self, line: &str) -> bool {
        match &self.ascii {
            Some(ascii) if ascii_answers(line) => {
                let answer = ascii.is_match(line);
                // Every unit test that reaches a line pattern checks the
                // twin (the summarizer's and the mask's tests and proptests).
                #[cfg(test)]
                assert_eq!(
                    answer,
                    self.unicode.is_match(line),
                    "the ASCII twin of {:?} answers otherwise on {line:?}",
                    self.unicode.as_str()
                );
                answer
            }
            _ => self.unicode.is_match(line),
        }
    }

    /// Whether an ASCII twin runs on the lines that allow it.
    #[cfg(test)]
    pub fn has_twin(&self) -> bool {
        self.ascii.is_some()
    }
}

/// Whether every non-ASCII character of `line` is neither a word character
/// (as the regex crate's Unicode `\w` has it) nor white space.
fn ascii_answers(line: &str) -> bool {
    line.is_ascii()
        || line.chars().all(|c| {
            c.is_ascii()
                || !(c.is_whitespace() || regex_syntax::try_is_word_character(c).unwrap_or(true))
        })
}

/// A `&'static` [`LinePattern`], built on first use.
#[macro_export]
macro_rules! line_pattern {
    ($pattern:literal) => {{
        static PATTERN: std::sync::LazyLock<$crate::core::line_pattern::LinePattern> =
            std::sync::LazyLock::new(|| $crate::core::line_pattern::LinePattern::new($pattern));
        &*PATTERN
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_of_arrows_and_marks_take_the_twin_and_words_do_not() {
        for line in ["  31→ error here", "✓ Closed #12", "a — b “c”", "plain"] {
            assert!(ascii_answers(line), "{line:?}");
        }
        // A letter, a Unicode digit, white space, the two folding letters,
        // a combining mark.
        for line in [
            "café error",
            "٣ passed",
            "a\u{3000}b",
            "\u{212A}",
            "ſ",
            "e\u{301}",
        ] {
            assert!(!ascii_answers(line), "{line:?}");
        }
    }

    #[test]
    fn a_pattern_that_could_tell_a_character_from_its_bytes_keeps_no_twin() {
        for pattern in [r"a.b", r"x\Sy", r"[^a]", r"(?i)\berror\b\s+\S"] {
            assert!(!LinePattern::new(pattern).has_twin(), "{pattern}");
        }
        assert!(LinePattern::new(r"(?i)\b\d+ passed\b").has_twin());
    }

    #[test]
    fn the_twin_answers_as_the_pattern_where_it_runs() {
        // `is_match` checks the twin against the pattern in tests; these
        // lines take the twin and differ from their ASCII reading only in
        // what the twin must see alike.
        let p = LinePattern::new(r"(?i)\b(error|failed)\b|\b\d+ passed\b");
        for (line, expected) in [
            ("  31→ error here", true),
            ("→error", true),
            ("errors→", false),
            ("✓ 12 passed", true),
            ("—failed—", true),
            ("café error", true),
            ("caféerror", false),
            ("\u{212A}", false),
        ] {
            assert_eq!(p.is_match(line), expected, "{line:?}");
        }
    }
}
