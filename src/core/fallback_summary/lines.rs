//! Cutting an output or a turn into lines, for the readers that look at
//! every line of every turn: [`Lowered`] (a text beside its ASCII-lowered
//! copy, in which the screens of `signals` search once for the whole
//! text), the lines a screen hit or a mark falls in, and [`lines`]
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

    /// Whether `screen` (lowercase literals) matches anywhere in the text.
    pub fn has(&self, screen: &Regex) -> bool {
        screen.is_match(&self.lower)
    }

    /// The lines of the text as [`str::lines`] cuts them (a last line's
    /// `\r` dropped too), each with whether `screen` (lowercase literals)
    /// matches in it, from one search of the whole lowered copy rather than
    /// one a line (a screen's literals hold no line end, so a match lies in
    /// the line where it starts). A line without a hit fails the screened
    /// check without asking.
    pub fn lines_with_hits<'s>(
        &'s self,
        screen: &'static Regex,
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

    /// Where `screen` (lowercase literals) matches, by the byte each match
    /// starts at, in order.
    pub fn hits<'s>(&'s self, screen: &'static Regex) -> impl Iterator<Item = usize> + 's {
        screen.find_iter(&self.lower).map(|m| m.start())
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
