//! Cutting an output or a turn into lines, for the readers that look at
//! every line of every turn: [`Lowered`] (a text beside its ASCII-lowered
//! copy, in which the [`Screen`]s of `signals` and `mask` search once for
//! the whole text), the lines a screen hit or a mark falls in, and [`lines`]
//! (`str::lines` with each line end found by `memchr`). Each cut is the
//! standard library's (but that the marked cutters drop a last line's lone
//! `\r` too, which their callers trim anyway), held to it by the proptests
//! below.

use regex::Regex;

/// A text beside a copy of it with its ASCII letters lowered (the same
/// bytes at the same offsets, but for case), in which the screens search.
///
/// A screen is an alternation of lowercase literals, case-sensitive, so
/// the regex crate runs it as one SIMD search of a few literals. The same
/// screen written ASCII case-insensitive (`(?i-u:…)`) has every case of
/// every literal to look for, too many for that search, and the crate ran
/// some as a lazy DFA over every byte: the screens were half of the time
/// spent on an output's report and telling line (docs/notes/issue-26.md,
/// tenth pass). Lowering a copy costs a copy.
pub struct Lowered<'a> {
    pub(super) text: &'a str,
    lower: String,
}

impl<'a> Lowered<'a> {
    /// `text` and its lowered copy.
    pub fn new(text: &'a str) -> Lowered<'a> {
        Lowered {
            text,
            lower: text.to_ascii_lowercase(),
        }
    }

    /// Whether `screen` hits anywhere in the text.
    pub fn has(&self, screen: &Screen) -> bool {
        screen.is_match(&self.lower)
    }

    /// The lines of the text as [`str::lines`] cuts them (a last line's
    /// `\r` dropped too), each with whether `screen` hits in it, from one
    /// search of the whole lowered copy rather than one a line (a screen's
    /// literals hold no line end, so a hit lies in the line where it
    /// starts). A line without a hit fails the screened check without
    /// asking.
    pub fn lines_with_hits<'s>(
        &'s self,
        screen: &'static Screen,
    ) -> impl Iterator<Item = (&'a str, bool)> + 's {
        let mut hits = self.hits(screen).peekable();
        let mut end = 0;
        split_inclusive_lines(self.text).map(move |piece| {
            end += piece.len();
            let mut hit = false;
            while hits.next_if(|&start| start < end).is_some() {
                hit = true;
            }
            (line_of(piece), hit)
        })
    }

    /// Where `screen` hits, by the byte each hit starts at, in order.
    pub fn hits<'s>(&'s self, screen: &'static Screen) -> impl Iterator<Item = usize> + 's {
        screen.hits(&self.lower)
    }

    /// The lines of the text, cut as [`Lowered::lines_with_hits`] cuts
    /// them, that hold one of `marks` (byte offsets in ascending order, each
    /// with a flag), each line once, in order, with whether any of its
    /// marks was flagged. For a check only a marked line can pass: the
    /// lines between marks are never cut (most lines of most outputs).
    pub fn lines_at<'s>(
        &'s self,
        marks: impl Iterator<Item = (usize, bool)> + 's,
    ) -> impl Iterator<Item = (&'a str, bool)> + 's {
        let text: &'a str = self.text;
        let bytes = text.as_bytes();
        let mut marks = marks.peekable();
        std::iter::from_fn(move || {
            let (at, mut flagged) = marks.next()?;
            let at = at.min(bytes.len());
            let start = memchr::memrchr(b'\n', &bytes[..at]).map_or(0, |i| i + 1);
            let end = memchr::memchr(b'\n', &bytes[at..]).map_or(bytes.len(), |i| at + i);
            // A mark on the line end belongs to the line, as a hit of
            // `lines_with_hits` does.
            while let Some((_, also)) = marks.next_if(|&(m, _)| m <= end) {
                flagged |= also;
            }
            Some((line_of(&text[start..end]), flagged))
        })
    }
}

/// What a pattern's screen looks for in a [`Lowered`] text: lowercase
/// ASCII literals (an alternation, case-sensitive), of which every match of
/// the pattern holds one. A screen also hits wherever the text holds one of
/// the two characters a case-insensitive Unicode pattern takes for an ASCII
/// letter (`ſ` for `s`, the Kelvin sign for `k`; `signals` has the test
/// that they are the only two), which lowering cannot turn into the
/// literals' letters.
///
/// Those two are searched on their own, not as literals of the
/// alternation. The literal search fingerprints each literal by as many of
/// its first bytes as the shortest literal has (up to four), and `ſ` is two
/// bytes: in the alternation, every literal was looked for by its first two
/// bytes (`er`, `co`, `no`, `un`), a candidate to check in most words of
/// most texts. Apart, the literals' search ran about four times as fast on
/// real transcripts, and the two characters cost one search at memory
/// speed (docs/notes/issue-26.md, twentieth pass).
#[derive(Debug)]
pub struct Screen {
    literals: Regex,
}

impl Screen {
    /// The screen of `literals`, an alternation of lowercase ASCII
    /// literals (`error|not found|fail`).
    ///
    /// # Panics
    ///
    /// On an invalid pattern: screens are written in the code
    /// ([`crate::screen`]), and the tests of the output readers build each.
    #[allow(clippy::expect_used)]
    pub fn new(literals: &str) -> Screen {
        // An uppercase literal would never hit a lowered text.
        debug_assert!(
            literals.is_ascii() && !literals.bytes().any(|b| b.is_ascii_uppercase()),
            "a screen's literals are lowercase ASCII: {literals:?}"
        );
        Screen {
            literals: Regex::new(literals).expect("a screen is an alternation of literals"),
        }
    }

    /// Whether it hits anywhere in `lowered` (a text with its ASCII letters
    /// lowered).
    pub fn is_match(&self, lowered: &str) -> bool {
        self.literals.is_match(lowered) || folds_to_ascii().is_match(lowered)
    }

    /// Where it hits in `lowered`, by the byte each hit starts at, in order.
    fn hits<'t>(&'t self, lowered: &'t str) -> impl Iterator<Item = usize> + 't {
        let literals = self.literals.find_iter(lowered).map(|m| (m.start(), true));
        let folds = folds_to_ascii()
            .find_iter(lowered)
            .map(|m| (m.start(), true));
        ascending(literals, folds).map(|(at, _)| at)
    }
}

/// The two characters outside ASCII that a case-insensitive pattern
/// matches for an ASCII letter.
fn folds_to_ascii() -> &'static Regex {
    lazy_regex::regex!(r"[\x{17F}\x{212A}]")
}

/// A `&'static` [`Screen`], built on first use.
#[macro_export]
macro_rules! screen {
    ($literals:literal) => {{
        static SCREEN: std::sync::LazyLock<$crate::core::fallback_summary::Screen> =
            std::sync::LazyLock::new(|| $crate::core::fallback_summary::Screen::new($literals));
        &*SCREEN
    }};
}

/// A piece of [`split_inclusive_lines`] without its line end, `\n`, `\r\n`
/// or a last line's `\r` (the output readers trim each line anyway).
fn line_of(piece: &str) -> &str {
    let line = piece.strip_suffix('\n').unwrap_or(piece);
    line.strip_suffix('\r').unwrap_or(line)
}

/// `text.split_inclusive('\n')`, each line end found by `memchr` (the
/// standard library's search for a char costs a call and a compare of
/// its encoding per line, most of the time of a listing's short lines).
fn split_inclusive_lines(text: &str) -> impl Iterator<Item = &str> {
    let mut from = 0;
    std::iter::from_fn(move || {
        let rest = text.get(from..).filter(|rest| !rest.is_empty())?;
        let len = memchr::memchr(b'\n', rest.as_bytes()).map_or(rest.len(), |i| i + 1);
        from += len;
        rest.get(..len)
    })
}

/// [`str::lines`], each line end found by `memchr` (the standard
/// library's char search is no SIMD search): for the texts every turn is
/// read through.
pub fn lines(text: &str) -> impl Iterator<Item = &str> {
    split_inclusive_lines(text).map(|piece| match piece.strip_suffix('\n') {
        Some(line) => line.strip_suffix('\r').unwrap_or(line),
        None => piece,
    })
}

/// Two ascending sequences of marks ([`Lowered::lines_at`]) as one.
pub fn ascending(
    a: impl Iterator<Item = (usize, bool)>,
    b: impl Iterator<Item = (usize, bool)>,
) -> impl Iterator<Item = (usize, bool)> {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    std::iter::from_fn(move || match (a.peek(), b.peek()) {
        (Some(x), Some(y)) if y.0 < x.0 => b.next(),
        (Some(_), _) => a.next(),
        (None, _) => b.next(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The lines a screen's hits fall in, as [`Lowered::lines_at`] groups
    /// them.
    fn hit_lines<'a>(text: &'a Lowered<'a>, hits: impl Iterator<Item = usize>) -> Vec<&'a str> {
        text.lines_at(hits.map(|at| (at, true)))
            .map(|(line, _)| line)
            .collect()
    }

    proptest! {
        /// A screen hits the lines that the alternation of its literals and
        /// the two folding characters hits, the way screens were written
        /// before they searched the two apart.
        #[test]
        fn a_screen_hits_the_lines_its_literals_or_a_folding_character_hit(
            text in "(fail|FAIL|error|err|or|ſ|\u{212A}|K|k|é|→| |\n|\r\n){0,24}",
        ) {
            let screen = crate::screen!("error|fail|exit code");
            let together = Regex::new(r"error|fail|exit code|[\x{17F}\x{212A}]").unwrap();
            let lowered = Lowered::new(&text);
            let want = hit_lines(&lowered, together.find_iter(&lowered.lower).map(|m| m.start()));
            prop_assert_eq!(hit_lines(&lowered, lowered.hits(screen)), want.clone());
            prop_assert_eq!(lowered.has(screen), !want.is_empty());
            let with_hits: Vec<&str> =
                lowered.lines_with_hits(screen).filter(|l| l.1).map(|l| l.0).collect();
            prop_assert_eq!(with_hits, want);
        }
    }

    proptest! {
        #[test]
        fn lines_are_cut_as_split_inclusive_cuts_them(text in "(a|é|\r|\n|\n\n| ){0,24}") {
            let ours: Vec<&str> = split_inclusive_lines(&text).collect();
            let std: Vec<&str> = text.split_inclusive('\n').collect();
            prop_assert_eq!(ours, std);
            let ours: Vec<&str> = super::lines(&text).collect();
            let std: Vec<&str> = text.lines().collect();
            prop_assert_eq!(ours, std);
        }

        #[test]
        fn marked_lines_are_the_lines_holding_a_mark(
            text in "(ab|é|\r|\n|\n\n| ){0,24}",
            picks in prop::collection::vec((any::<prop::sample::Index>(), any::<bool>()), 0..6),
        ) {
            let head = Lowered::new(&text);
            let mut marks: Vec<(usize, bool)> =
                picks.iter().filter(|_| !text.is_empty()).map(|(i, f)| (i.index(text.len()), *f)).collect();
            marks.sort_unstable();
            // Each line (its bytes and its end) with whether a mark lies
            // in it and whether one of those is flagged.
            let mut want = Vec::new();
            let mut start = 0;
            for piece in text.split_inclusive('\n') {
                let end = start + piece.len();
                let inside: Vec<bool> =
                    marks.iter().filter(|(m, _)| (start..end).contains(m)).map(|m| m.1).collect();
                if !inside.is_empty() {
                    let line = piece.strip_suffix('\n').unwrap_or(piece);
                    want.push((line.strip_suffix('\r').unwrap_or(line), inside.contains(&true)));
                }
                start = end;
            }
            let got: Vec<(&str, bool)> = head.lines_at(marks.into_iter()).collect();
            prop_assert_eq!(got, want);
        }
    }
}
