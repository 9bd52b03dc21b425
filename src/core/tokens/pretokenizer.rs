//! Pre-tokenization: the split of text into the pieces BPE encodes one by
//! one, with the very patterns of `o200k_base` and `cl100k_base` as
//! bpe-openai writes them (tiktoken's patterns, with the `\s+(?!\S)`
//! look-ahead emulated by a second pattern whose last character is given
//! back).
//!
//! Two paths give the same pieces:
//! - ASCII text (most agent traffic: English, code, JSON, logs) is split by
//!   hand-written rules that follow the patterns' leftmost-first semantics
//!   for ASCII characters, at a fraction of the regex's cost per piece. So
//!   are the characters outside ASCII that every pattern treats as it
//!   treats ASCII punctuation ([`is_punctuation`]: the `→` on every line of
//!   a numbered file listing, `✓`, `─`, `…`, most emoji);
//! - any other text (letters, digits, spaces and marks outside ASCII, and
//!   the few bytes before them) goes through the regex. bpe-openai searches through
//!   the regex's shared cache pool, which is a mutex for every thread but
//!   the first one to use it (per piece, on the folder's blocking threads);
//!   here each thread keeps its own search cache.
//!
//! The tests split random ASCII over the characters the rules tell apart,
//! and random mixed text, and compare with bpe-openai's own split.

use super::Encoding;
use regex_automata::meta::{Cache, Regex};
use regex_automata::{Anchored, Input};
use regex_syntax::hir::{Class, HirKind};
use std::cell::RefCell;
use std::sync::LazyLock;

struct Patterns {
    regex: Regex,
    /// Per pattern: whether its last character is a look-ahead to give back.
    lookahead: [bool; 3],
}

impl Patterns {
    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    fn new(main: &str) -> Patterns {
        let regex = Regex::new_many(&[main, r"\s+\s", r"\s+"])
            .expect("the pre-tokenization patterns compile");
        Patterns {
            regex,
            lookahead: [false, true, false],
        }
    }
}

static O200K: LazyLock<Patterns> = LazyLock::new(|| {
    Patterns::new(
        &[
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"\p{N}{1,3}",
            r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
            r"\s*[\r\n]+",
            r"\s+$",
        ]
        .join("|"),
    )
});

static CL100K: LazyLock<Patterns> = LazyLock::new(|| {
    Patterns::new(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+$",
    )
});

/// Builds `encoding`'s patterns now rather than on the first text outside
/// the ASCII fast path.
pub(super) fn load(encoding: Encoding) {
    patterns(encoding);
}

fn patterns(encoding: Encoding) -> &'static Patterns {
    match encoding {
        Encoding::O200kBase => &O200K,
        Encoding::Cl100kBase => &CL100K,
    }
}

/// The characters outside ASCII in none of `\s`, `\p{L}`, `\p{N}` and
/// `\p{M}`, as ranges, from the regex crate's own Unicode tables (the
/// ones the patterns are compiled with). Each class of the patterns holds
/// such a character exactly when it holds ASCII punctuation: `[^\r\n\p{L}\p{N}]`
/// and `[^\s\p{L}\p{N}]` do, the letter, digit, space and newline classes
/// do not.
static PUNCTUATION: LazyLock<Vec<(char, char)>> = LazyLock::new(|| {
    match regex_syntax::parse(r"[^\s\p{L}\p{N}\p{M}\x00-\x7F]").map(|hir| hir.into_kind()) {
        Ok(HirKind::Class(Class::Unicode(class))) => class
            .ranges()
            .iter()
            .map(|range| (range.start(), range.end()))
            .collect(),
        // Only a bug gets here (the pattern is a constant class); with no
        // ranges, all text outside ASCII goes through the regex, as it did.
        _ => Vec::new(),
    }
});

/// Whether `c` (outside ASCII) is punctuation to every pattern (see
/// [`PUNCTUATION`]).
fn is_punctuation(c: char) -> bool {
    let ranges = &*PUNCTUATION;
    let at = ranges.partition_point(|&(_, last)| last < c);
    ranges.get(at).is_some_and(|&(first, _)| first <= c)
}

thread_local! {
    static CACHES: RefCell<[Option<Cache>; 2]> = const { RefCell::new([None, None]) };
}

/// Calls `piece` with each piece of `text`, in order.
#[cfg(test)]
pub fn for_each_piece(encoding: Encoding, text: &str, mut piece: impl FnMut(&str)) {
    for_each_piece_while(encoding, text, |p| {
        piece(p);
        true
    });
}

/// Calls `piece` with each piece of `text`, in order, until it returns
/// false: a count that has passed its limit stops cutting the text there
/// (a draft asks whether 80 KB of sources fit in 2,400 tokens).
pub fn for_each_piece_while(encoding: Encoding, text: &str, mut piece: impl FnMut(&str) -> bool) {
    if text.is_ascii() {
        ascii::split(encoding, text, piece);
        return;
    }
    // Mixed text: the ASCII rules wherever the bytes they look at (the
    // piece and the three bytes after it) are ASCII or punctuation, the
    // regex elsewhere.
    let t = text.as_bytes();
    let patterns = patterns(encoding);
    CACHES.with(|caches| {
        let mut caches = caches.borrow_mut();
        let cache = caches[encoding as usize].get_or_insert_with(|| patterns.regex.create_cache());
        let mut i = 0;
        let mut unhandled = first_unhandled(text, 0);
        while i < t.len() {
            if unhandled < i {
                unhandled = first_unhandled(text, i);
            }
            if i < unhandled {
                let end = ascii::piece_end(encoding, t, i);
                if unhandled == t.len() || end + LOOKS_PAST_PIECE < unhandled {
                    if !piece(&text[i..end]) {
                        break;
                    }
                    i = end;
                    continue;
                }
            }
            let Some(end) = regex_piece_end(patterns, cache, text, i) else {
                break;
            };
            if !piece(&text[i..end]) {
                break;
            }
            i = end;
        }
    });
}

/// How far past a piece's end the ASCII rules may look (a contraction
/// after a word: `'ll`).
const LOOKS_PAST_PIECE: usize = 3;

/// The first byte at or after `from` (a character boundary) of a
/// character the ASCII rules leave to the regex: outside ASCII and not
/// punctuation.
fn first_unhandled(text: &str, from: usize) -> usize {
    let t = text.as_bytes();
    let mut i = from;
    loop {
        i += first_non_ascii(&t[i..]);
        if i == t.len() {
            return i;
        }
        match text[i..].chars().next() {
            Some(c) if is_punctuation(c) => i += c.len_utf8(),
            _ => return i,
        }
    }
}

/// The first byte of `t` outside ASCII (`t.len()`: none), looked for 16
/// bytes at a time: a mixed text's ASCII stretches (a numbered listing's
/// lines between its arrows) are most of it.
fn first_non_ascii(t: &[u8]) -> usize {
    const HIGH_BITS: u128 = u128::from_ne_bytes([0x80; 16]);
    let mut i = 0;
    while let Some((chunk, _)) = t[i..].split_first_chunk::<16>() {
        if u128::from_ne_bytes(*chunk) & HIGH_BITS != 0 {
            break;
        }
        i += 16;
    }
    t[i..]
        .iter()
        .position(|b| !b.is_ascii())
        .map_or(t.len(), |n| i + n)
}

/// The end of the piece at `start`, as the regex finds it.
fn regex_piece_end(
    patterns: &Patterns,
    cache: &mut Cache,
    text: &str,
    start: usize,
) -> Option<usize> {
    let input = Input::new(&text[start..]).anchored(Anchored::Yes);
    let m = patterns.regex.search_with(cache, &input)?;
    let mut end = start + m.range().end;
    if patterns.lookahead[m.pattern().as_usize()] {
        // The look-ahead pattern always matches two or more whitespace
        // characters, so one is left after giving one back.
        end -= text[start..end]
            .chars()
            .next_back()
            .map_or(0, char::len_utf8);
    }
    (end > start).then_some(end)
}

#[cfg(test)]
fn split_by_regex(encoding: Encoding, text: &str, mut piece: impl FnMut(&str)) {
    let patterns = patterns(encoding);
    let mut cache = patterns.regex.create_cache();
    let mut start = 0;
    while let Some(end) = regex_piece_end(patterns, &mut cache, text, start) {
        piece(&text[start..end]);
        start = end;
    }
}

/// The patterns restricted to ASCII, where `\p{L}` is `[A-Za-z]` (upper
/// case `Lu`, lower case `Ll`, no `Lt`/`Lm`/`Lo`/`M`), `\p{N}` is `[0-9]`
/// and `\s` is `[\t\n\x0B\x0C\r ]`. Each rule below is one alternative,
/// tried in the patterns' order; the first that matches gives the piece.
/// A byte outside ASCII they are given is part of a punctuation character
/// ([`super::is_punctuation`]): the classes take each of its bytes as they
/// take ASCII punctuation, and a word's prefix takes the whole character.
mod ascii {
    use super::Encoding;

    // The classes the rules ask about, a bit each in [`CLASS`]: one
    // table load per byte, where the rules' tests compared each byte
    // with up to six ranges. It counts 3-4% fewer of `run`'s
    // instructions; no change in its time was measured.
    const UPPER: u8 = 1;
    const LOWER: u8 = 1 << 1;
    const DIGIT: u8 = 1 << 2;
    /// `\s`
    const SPACE: u8 = 1 << 3;
    /// `[\r\n]`
    const NEWLINE: u8 = 1 << 4;
    /// `[^\s\p{L}\p{N}]`
    const OTHER: u8 = 1 << 5;
    /// `[^\r\n\p{L}\p{N}]`: the optional character before a word.
    const WORD_PREFIX: u8 = 1 << 6;
    /// `[\r\n/]`: what o200k's punctuation takes after it.
    const NEWLINE_OR_SLASH: u8 = 1 << 7;

    /// Each byte's classes. A byte outside ASCII is part of a punctuation
    /// character here (see the module above), so it is in the classes
    /// ASCII punctuation is in.
    static CLASS: [u8; 256] = {
        let mut class = [0u8; 256];
        let mut b = 0;
        while b < 256 {
            let c = b as u8;
            let letter = c.is_ascii_alphabetic();
            let digit = c.is_ascii_digit();
            let space = matches!(c, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ');
            let newline = matches!(c, b'\r' | b'\n');
            let mut bits = 0;
            if c.is_ascii_uppercase() {
                bits |= UPPER;
            }
            if c.is_ascii_lowercase() {
                bits |= LOWER;
            }
            if digit {
                bits |= DIGIT;
            }
            if space {
                bits |= SPACE;
            }
            if newline {
                bits |= NEWLINE | NEWLINE_OR_SLASH;
            }
            if !space && !letter && !digit {
                bits |= OTHER;
            }
            if !newline && !letter && !digit {
                bits |= WORD_PREFIX;
            }
            if c == b'/' {
                bits |= NEWLINE_OR_SLASH;
            }
            class[b] = bits;
            b += 1;
        }
        class
    };

    fn is(b: u8, class: u8) -> bool {
        CLASS[b as usize] & class != 0
    }

    /// The end of the run of bytes in `class` from `from`.
    #[inline(always)]
    fn run(t: &[u8], from: usize, class: u8) -> usize {
        let mut i = from;
        while i < t.len() && is(t[i], class) {
            i += 1;
        }
        i
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at `i`: its end.
    fn contraction(t: &[u8], i: usize) -> Option<usize> {
        if t.get(i) != Some(&b'\'') {
            return None;
        }
        let lower = |k: usize| t.get(i + k).map(u8::to_ascii_lowercase);
        match lower(1)? {
            b's' | b't' | b'm' | b'd' => Some(i + 2),
            b'r' | b'v' if lower(2) == Some(b'e') => Some(i + 3),
            b'l' if lower(2) == Some(b'l') => Some(i + 3),
            _ => None,
        }
    }

    /// The optional word prefix at `i`, taken if it is one (a greedy `?`
    /// that only matters when letters follow it): one character, of one
    /// to four bytes.
    fn after_prefix(t: &[u8], i: usize) -> usize {
        if is(t[i], WORD_PREFIX) {
            i + char_len(t[i])
        } else {
            i
        }
    }

    /// The length of the UTF-8 character `lead` starts.
    fn char_len(lead: u8) -> usize {
        match lead {
            0..=0x7f => 1,
            0xc0..=0xdf => 2,
            0xe0..=0xef => 3,
            _ => 4,
        }
    }

    /// o200k: `P?[Lu]*[Ll]+C?` then `P?[Lu]+[Ll]*C?`.
    fn o200k_word(t: &[u8], i: usize) -> Option<usize> {
        let start = after_prefix(t, i);
        let upper_end = run(t, start, UPPER);
        let lower_end = run(t, upper_end, LOWER);
        // The first form needs a lower-case letter after the upper-case
        // run; the second an upper-case letter (the prefix, if any, was
        // taken: without it the word would have to start at a non-letter).
        if lower_end > upper_end || upper_end > start {
            Some(contraction(t, lower_end).unwrap_or(lower_end))
        } else {
            None
        }
    }

    /// cl100k: `P?\p{L}+`.
    fn cl100k_word(t: &[u8], i: usize) -> Option<usize> {
        let start = after_prefix(t, i);
        let end = run(t, start, UPPER | LOWER);
        (end > start).then_some(end)
    }

    /// ` ?[^\s\p{L}\p{N}]+` followed by `[\r\n/]*` (o200k) or `[\r\n]*`.
    fn punctuation(t: &[u8], i: usize, slash_too: bool) -> Option<usize> {
        let start = if t[i] == b' ' { i + 1 } else { i };
        let end = run(t, start, OTHER);
        if end == start {
            return None;
        }
        let after = if slash_too { NEWLINE_OR_SLASH } else { NEWLINE };
        Some(run(t, end, after))
    }

    /// The whitespace alternatives, in order: `\s*[\r\n]+`, `\s+$`,
    /// `\s+(?!\S)` (`\s+\s` giving the last character back), `\s+`.
    fn whitespace(t: &[u8], i: usize) -> usize {
        let end = run(t, i, SPACE);
        if let Some(last_newline) = t[i..end].iter().rposition(|&b| is(b, NEWLINE)) {
            return i + last_newline + 1;
        }
        if end == t.len() || end - i < 2 {
            end
        } else {
            end - 1
        }
    }

    /// The end of the piece at `i` (`t[i]` is ASCII).
    pub(super) fn piece_end(encoding: Encoding, t: &[u8], i: usize) -> usize {
        let (word, slash_too) = match encoding {
            Encoding::O200kBase => (o200k_word(t, i), true),
            Encoding::Cl100kBase => (contraction(t, i).or_else(|| cl100k_word(t, i)), false),
        };
        if let Some(end) = word {
            return end;
        }
        if is(t[i], DIGIT) {
            return run(t, i, DIGIT).min(i + 3);
        }
        if let Some(end) = punctuation(t, i, slash_too) {
            return end;
        }
        whitespace(t, i)
    }

    /// Calls `piece` with each piece of ASCII `text` until it returns false.
    pub(super) fn split(encoding: Encoding, text: &str, mut piece: impl FnMut(&str) -> bool) {
        let t = text.as_bytes();
        let mut i = 0;
        while i < t.len() {
            let end = piece_end(encoding, t, i);
            // Every rule consumes at least one byte of ASCII text, so the
            // slices fall on character boundaries.
            if !piece(&text[i..end]) {
                return;
            }
            i = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::Strategy;

    fn pieces(encoding: Encoding, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        for_each_piece(encoding, text, |p| out.push(p.to_string()));
        out
    }

    fn regex_pieces(encoding: Encoding, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        split_by_regex(encoding, text, |p| out.push(p.to_string()));
        out
    }

    /// Characters the rules tell apart, and non-ASCII ones next to which
    /// they must leave the decision to the regex: letters and digits
    /// outside ASCII, Unicode spaces, a combining mark, `ſ` (matches `s`
    /// case-insensitively), a variation selector (a mark); and punctuation
    /// they split themselves: symbols, quotes, box drawing, emoji, a skin
    /// tone, a zero-width joiner.
    const MIXED: &[&str] = &[
        "é", "ſ", "٣", "\u{85}", "\u{a0}", "日", "\u{301}", "É", "\u{2028}", "ǅ", "ʰ", "😀", "→",
        "✓", "─", "…", "“", "•", "🏽", "\u{200d}", "\u{fe0f}", "²",
    ];

    #[test]
    fn the_first_byte_outside_ascii_is_found_across_chunks() {
        for len in 0..50 {
            let ascii = vec![b'a'; len];
            assert_eq!(first_non_ascii(&ascii), len);
            for at in 0..len {
                let mut bytes = ascii.clone();
                bytes[at] = 0xC3;
                if at + 1 < len {
                    bytes[len - 1] = 0xE2;
                }
                assert_eq!(first_non_ascii(&bytes), at, "{len} {at}");
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4000))]
        #[test]
        fn mixed_text_splits_as_the_patterns_do(
            parts in proptest::collection::vec(proptest::prop_oneof![
                4 => proptest::sample::select(b"aZbYsSTtmMdDrReEvVlLxQ0159 \t\n\r\x0B\x0C'/.,(\"-_\x00\x7F~".to_vec())
                    .prop_map(|b| (b as char).to_string()),
                2 => proptest::sample::select(MIXED.to_vec()).prop_map(str::to_string),
            ], 0..40)
        ) {
            let text: String = parts.concat();
            for (encoding, reference) in [
                (Encoding::O200kBase, bpe_openai::o200k_base()),
                (Encoding::Cl100kBase, bpe_openai::cl100k_base()),
            ] {
                let expected: Vec<String> = reference.split(&text).map(str::to_string).collect();
                proptest::prop_assert_eq!(&pieces(encoding, &text), &expected, "{:?} {:?}", encoding, text);
            }
        }

        #[test]
        fn ascii_rules_split_as_the_patterns_do(
            bytes in proptest::collection::vec(proptest::sample::select(
                b"aZbYsSTtmMdDrReEvVlLxQ0159 \t\n\r\x0B\x0C'/.,(\"-_\x00\x7F~".to_vec()), 0..40)
        ) {
            let text = String::from_utf8(bytes).unwrap();
            for (encoding, reference) in [
                (Encoding::O200kBase, bpe_openai::o200k_base()),
                (Encoding::Cl100kBase, bpe_openai::cl100k_base()),
            ] {
                let expected: Vec<String> = reference.split(&text).map(str::to_string).collect();
                let mut got = Vec::new();
                ascii::split(encoding, &text, |p| {
                    got.push(p.to_string());
                    true
                });
                proptest::prop_assert_eq!(&got, &expected, "{:?} {:?}", encoding, text);
                proptest::prop_assert_eq!(&regex_pieces(encoding, &text), &expected);
            }
        }
    }

    #[test]
    fn punctuation_is_what_no_letter_digit_space_or_mark_class_holds() {
        for c in [
            '→', '✓', '─', '…', '“', '•', '😀', '🏽', '\u{200d}', '€', '©',
        ] {
            assert!(is_punctuation(c), "{c:?}");
        }
        for c in [
            'é', 'ſ', '٣', '²', '\u{85}', '\u{a0}', '\u{2028}', '日', '\u{301}', '\u{fe0f}',
        ] {
            assert!(!is_punctuation(c), "{c:?}");
        }
        // A numbered file listing's line: only `→` outside ASCII, no regex.
        let line = "    12→    let x = foo(); // ok\n";
        assert_eq!(first_unhandled(line, 0), line.len());
        assert_eq!(first_unhandled("→ é", 0), 4);
    }

    #[test]
    fn splits_as_bpe_openai_does() {
        let samples = [
            "hello world",
            "Hello, World! It's 2026; we've 12345 items.\n\n  indented\tline  \n",
            "fn main() { println!(\"{}\", 42); } // ünïcödé ✓ 日本語 ÉCOLE Straße",
            "/home/USER/src/lib.rs:120:5 error[E0308]: mismatched types\r\n",
            "   many    spaces\n\n\ttabs\r\n   ",
            "",
            " ",
            "x  ",
            "CamelCaseWords andALLCAPS I'M YOU'LL",
            "     1→use std::io;\n     2→\n     3→fn main() {}\n",
            "⏺ Done ✓ — “quoted” … ├── src/ └── 👍🏽 €5",
        ];
        for (encoding, reference) in [
            (Encoding::O200kBase, bpe_openai::o200k_base()),
            (Encoding::Cl100kBase, bpe_openai::cl100k_base()),
        ] {
            for s in samples {
                let expected: Vec<String> = reference.split(s).map(str::to_string).collect();
                assert_eq!(pieces(encoding, s), expected, "{encoding:?} {s:?}");
            }
        }
    }
}
