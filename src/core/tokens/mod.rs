//! Token counting: each message is counted once, when it is folded.
//!
//! The encoding follows the declared model: `o200k_base` for current OpenAI
//! models (gpt-4o, gpt-4.1, gpt-5, o1/o3/o4), `cl100k_base` for older ones
//! (gpt-4, gpt-3.5, text-embedding-*), and for unknown models `o200k_base`
//! as well: a real BPE over the text is a better estimate for Claude, Llama
//! or Qwen than characters / 4, and it keeps counts stable across models.
//! The BPE engine is `bpe-openai` (same counts as tiktoken-rs, faster: see
//! `benches/tokens.rs` and the README), fed by our own pre-tokenizer
//! (`pretokenizer`: the same pieces, mostly without the regex) and a memo
//! of the counts of short pieces; tiktoken-rs stays available for the
//! comparison and as the reference in tests.

mod pretokenizer;

use crate::core::message::ChatMessage;
use serde::{Deserialize, Serialize};
use std::cell::RefCell;

/// Tokens every chat message costs beyond its text (role, separators), as
/// OpenAI's own accounting for chat models does.
pub const MESSAGE_OVERHEAD_TOKENS: u64 = 4;

/// Which BPE encoding counts a model's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    O200kBase,
    Cl100kBase,
}

impl Encoding {
    /// The encoding for a declared model name; `o200k_base` when unknown.
    pub fn for_model(model: Option<&str>) -> Encoding {
        let Some(model) = model else {
            return Encoding::O200kBase;
        };
        let m = model.to_ascii_lowercase();
        let m = m.rsplit('/').next().unwrap_or(&m);
        let old = m.starts_with("gpt-4-")
            || m == "gpt-4"
            || m.starts_with("gpt-4-32k")
            || m.starts_with("gpt-3.5")
            || m.starts_with("gpt-35")
            || m.starts_with("text-embedding-ada")
            || m.starts_with("text-embedding-3")
            || m.starts_with("davinci-002")
            || m.starts_with("babbage-002");
        if old && !m.starts_with("gpt-4o") {
            Encoding::Cl100kBase
        } else {
            Encoding::O200kBase
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Encoding::O200kBase => "o200k_base",
            Encoding::Cl100kBase => "cl100k_base",
        }
    }
}

fn tokenizer(encoding: Encoding) -> &'static bpe_openai::Tokenizer {
    match encoding {
        Encoding::O200kBase => bpe_openai::o200k_base(),
        Encoding::Cl100kBase => bpe_openai::cl100k_base(),
    }
}

/// Loads both encodings' tokenizers now (the first use of each loads it;
/// `cargo bench --bench tokens` prints how long both take). A service
/// calls this at start so that its first turn is not the one that waits.
pub fn load_tokenizers() {
    for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
        load_tokenizer(encoding);
    }
}

/// Loads one encoding's pre-tokenizer patterns, then its BPE, now. Another
/// thread loading either at the same time waits for it rather than loading
/// it twice, so two threads calling this (or counting) share the work:
/// while one builds the BPE (tens of milliseconds), the other builds the
/// patterns.
pub fn load_tokenizer(encoding: Encoding) {
    pretokenizer::load(encoding);
    tokenizer(encoding);
}

/// Pieces no longer than this are remembered: words, numbers and
/// punctuation runs, which repeat all the time in natural text and code.
const REMEMBERED_PIECE_BYTES: usize = 24;
/// Pieces remembered per encoding and thread before the memo starts over
/// (about 1 MiB at most).
const REMEMBERED_PIECES: usize = 16_384;

/// Token counts of pre-tokenized pieces already seen on this thread, per
/// encoding. The BPE of a piece allocates its working buffers anew each
/// time; a hash lookup of a short piece costs a fraction of that, and the
/// count of a piece never depends on its neighbours, so the memo changes
/// no count (`tests/token_counts.rs` checks the totals against tiktoken).
/// Its hash is seeded per process: its keys are what agents wrote, and a
/// fixed hash would let a text of colliding pieces turn each lookup into
/// a scan.
#[derive(Default)]
struct PieceCounts([foldhash::HashMap<Box<[u8]>, u32>; 2]);

thread_local! {
    static PIECE_COUNTS: RefCell<PieceCounts> = RefCell::new(PieceCounts::default());
}

/// The byte length of the longest prefix of `text`, cut at a char
/// boundary, for which `fits` holds (0 when none but the empty one does):
/// a binary search, for `fits` that holds of every prefix shorter than one
/// it holds of (a token budget over prefixes, as nearly as BPE allows).
pub fn longest_prefix(text: &str, fits: impl Fn(usize) -> bool) -> usize {
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain(std::iter::once(text.len()))
        .collect();
    let (mut lo, mut hi) = (0usize, bounds.len() - 1);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(bounds[mid]) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    bounds[lo]
}

#[cfg(test)]
thread_local! {
    /// Texts counted on this thread, for tests that check what needs no count.
    static TEXTS_COUNTED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many texts [`count_text`] was asked to count on this thread.
#[cfg(test)]
pub(crate) fn texts_counted() -> u64 {
    TEXTS_COUNTED.with(std::cell::Cell::get)
}

/// Counts tokens of text (the same count as tiktoken's `encode_ordinary`).
pub fn count_text(encoding: Encoding, text: &str) -> u64 {
    count_up_to(encoding, text, u64::MAX)
}

/// [`count_text`] when it is `limit` or less, else `None`, found without
/// counting the pieces past the limit (a piece's tokens never depend on
/// the pieces after it): whether a long text fits a small budget costs
/// what the budget's worth of it does.
/// (A caller whose text is often far over screens it first with
/// [`fewest_tokens_up_to`], as the deterministic draft does.)
pub fn count_within(encoding: Encoding, text: &str, limit: u64) -> Option<u64> {
    Some(count_up_to(encoding, text, limit)).filter(|&n| n <= limit)
}

/// A count of `text`'s tokens that no encoding goes under, counted only
/// until it passes `limit` (then some count over it): the ASCII letters
/// followed by ASCII other than a letter or an apostrophe (or by the
/// text's end). A scan that compiles to vector compares, a small fraction
/// of a count's cost: whether a long text is sure to pass a small budget
/// needs no tokenizer.
///
/// Why no encoding goes under it (both patterns are in `pretokenizer`'s
/// doc): a piece that holds a letter is an optional character that is no
/// letter, digit or line break, then letters and marks, then at most a
/// contraction (`'s`, `'ll`, ...); cl100k also cuts a contraction alone. No
/// other alternative holds a letter. So a piece's letters are never apart
/// by ASCII but an apostrophe, and a letter followed by such ASCII is the
/// last letter of its piece: each one counted is in a piece of its own,
/// and every piece is at least one token. On the shared real transcripts
/// the bound is 40-54% of the count (`tests/token_counts.rs`), against
/// summary budgets of 12% (a leaf) to 33% (a condensed summary) of their
/// sources.
pub fn fewest_tokens_up_to(text: &str, limit: u64) -> u64 {
    let letter = |b: u8| (b | 0x20).wrapping_sub(b'a') < 26;
    let apart = |b: u8| b < 0x80 && b != b'\'' && !letter(b);
    let bytes = text.as_bytes();
    let mut ends = 0u64;
    // In blocks, so the compares run as vectors and the limit is checked
    // once a block.
    let mut at = 0;
    while at + 1 < bytes.len() {
        let block = &bytes[at..bytes.len().min(at + 4096 + 1)];
        ends += block
            .windows(2)
            .map(|w| u64::from(letter(w[0]) & apart(w[1])))
            .sum::<u64>();
        if ends > limit {
            return ends;
        }
        at += block.len() - 1;
    }
    ends + u64::from(bytes.last().is_some_and(|&b| letter(b)))
}

/// The count of `text`, or some count over `limit` once it is sure to pass it.
fn count_up_to(encoding: Encoding, text: &str, limit: u64) -> u64 {
    #[cfg(test)]
    TEXTS_COUNTED.with(|n| n.set(n.get() + 1));
    if text.is_empty() {
        return 0;
    }
    let tokenizer = tokenizer(encoding);
    PIECE_COUNTS.with(|memo| {
        let mut memo = memo.borrow_mut();
        let remembered = &mut memo.0[encoding as usize];
        let mut total = 0u64;
        // Once past `limit` the count is sure to pass it: the rest of the
        // text is not cut into pieces.
        pretokenizer::for_each_piece_while(encoding, text, |piece| {
            let piece = piece.as_bytes();
            // Every byte is a token of both vocabularies: a piece of one
            // byte (a space, a bracket, a digit) is one token, and about
            // two fifths of the pieces of the bench's real transcripts
            // are, so they skip the memo's lookup.
            total += if piece.len() == 1 {
                1
            } else if piece.len() > REMEMBERED_PIECE_BYTES {
                tokenizer.bpe.count(piece) as u64
            } else if let Some(&n) = remembered.get(piece) {
                u64::from(n)
            } else {
                let n = tokenizer.bpe.count(piece) as u32;
                if remembered.len() >= REMEMBERED_PIECES {
                    remembered.clear();
                }
                remembered.insert(piece.into(), n);
                u64::from(n)
            };
            total <= limit
        });
        total
    })
}

/// Counts tokens of text without the piece memo (for the benchmark).
pub fn count_text_unremembered(encoding: Encoding, text: &str) -> u64 {
    if text.is_empty() {
        return 0;
    }
    tokenizer(encoding).count(text) as u64
}

/// Reference counter (tiktoken-rs), used to check that the fast path agrees.
pub fn count_text_tiktoken(encoding: Encoding, text: &str) -> u64 {
    let bpe = match encoding {
        Encoding::O200kBase => tiktoken_rs::o200k_base_singleton(),
        Encoding::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
    };
    bpe.encode_ordinary(text).len() as u64
}

/// Tokens a chat message costs in a prompt: text, tool calls, name, overhead.
pub fn count_message(encoding: Encoding, message: &ChatMessage) -> u64 {
    count_message_telling_arguments(encoding, message, |_, _| {})
}

/// Texts counted with [`count_text_kept`] on this thread, the newest last.
const KEPT_TEXTS: usize = 4;

thread_local! {
    static KEPT: RefCell<std::collections::VecDeque<(Encoding, Box<str>, u64)>> =
        const { RefCell::new(std::collections::VecDeque::new()) };
}

/// [`count_text`], for a text likely to be counted again soon on this
/// thread: the last few such texts keep their counts, so the same text
/// (compared whole) is counted once. A summary is counted where its draft
/// fits it, where its record is made, where a sweep's snapshot places it
/// and where the fold applies it; `run` does all four on one thread.
pub fn count_text_kept(encoding: Encoding, text: &str) -> u64 {
    let kept = KEPT.with_borrow(|kept| {
        kept.iter()
            .find(|(e, t, _)| *e == encoding && **t == *text)
            .map(|&(_, _, n)| n)
    });
    if let Some(n) = kept {
        return n;
    }
    let n = count_text(encoding, text);
    KEPT.with_borrow_mut(|kept| {
        if kept.len() == KEPT_TEXTS {
            kept.pop_front();
        }
        kept.push_back((encoding, text.into(), n));
    });
    n
}

/// [`count_message`] with its text counted by [`count_text_kept`].
pub fn count_message_kept(encoding: Encoding, message: &ChatMessage) -> u64 {
    count_message_by(encoding, message, count_text_kept, |_, _| {})
}

/// [`count_message`], telling `arguments` what each call's arguments
/// count (the call's index and its count, in order). The count is a sum
/// of its parts, so a caller may take a rendering that differs only in
/// some calls' arguments from it without counting the rest again
/// ([`crate::core::mask::counted`]).
pub fn count_message_telling_arguments(
    encoding: Encoding,
    message: &ChatMessage,
    arguments: impl FnMut(usize, u64),
) -> u64 {
    count_message_by(encoding, message, count_text, arguments)
}

/// A message's count with its text counted by `count_text`.
fn count_message_by(
    encoding: Encoding,
    message: &ChatMessage,
    count_text: fn(Encoding, &str) -> u64,
    mut arguments: impl FnMut(usize, u64),
) -> u64 {
    let mut total = MESSAGE_OVERHEAD_TOKENS + count_text(encoding, &message.text_view());
    for (i, call) in message.tool_calls.iter().enumerate() {
        let counted = count_text(encoding, &call.function.arguments);
        arguments(i, counted);
        total += 3 + count_text(encoding, &call.function.name) + counted;
    }
    if let Some(name) = &message.name {
        total += 1 + count_text(encoding, name);
    }
    if let Some(id) = &message.tool_call_id {
        total += count_text(encoding, id);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_count_is_the_count_of_that_text_in_that_encoding() {
        // The same length, other counts; the same text, other counts in
        // the two encodings.
        let (runs, words) = ("aaaaaaaaaaaaaaaaaaaa", "a b c d e f g h i j ");
        let other = "日本語のテキストと、ですます調の文章。";
        assert_eq!(runs.len(), words.len());
        assert_ne!(
            count_text(Encoding::O200kBase, runs),
            count_text(Encoding::O200kBase, words)
        );
        assert_ne!(
            count_text(Encoding::O200kBase, other),
            count_text(Encoding::Cl100kBase, other)
        );
        // More texts than are kept, counted in turn, several times over.
        let texts = [runs, words, other, "fn main() {}", "", "x\n\ny"];
        for _ in 0..3 {
            for text in texts {
                for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                    assert_eq!(
                        count_text_kept(encoding, text),
                        count_text(encoding, text),
                        "{encoding:?} {text:?}"
                    );
                }
            }
        }
        let message = ChatMessage::text(crate::core::message::Role::User, other);
        assert_eq!(
            count_message_kept(Encoding::Cl100kBase, &message),
            count_message(Encoding::Cl100kBase, &message)
        );
    }

    #[test]
    fn model_picks_encoding() {
        assert_eq!(
            Encoding::for_model(Some("gpt-4o-mini")),
            Encoding::O200kBase
        );
        assert_eq!(
            Encoding::for_model(Some("gpt-4-0613")),
            Encoding::Cl100kBase
        );
        assert_eq!(
            Encoding::for_model(Some("gpt-3.5-turbo")),
            Encoding::Cl100kBase
        );
        assert_eq!(
            Encoding::for_model(Some("openai/gpt-4.1")),
            Encoding::O200kBase
        );
        assert_eq!(
            Encoding::for_model(Some("claude-opus-4-5")),
            Encoding::O200kBase
        );
        assert_eq!(Encoding::for_model(None), Encoding::O200kBase);
    }

    /// The one-byte pieces the memo is skipped for are one token in both
    /// vocabularies: every ASCII character alone, and in a text of such
    /// pieces (the count is the tokenizer's own, which has no shortcut).
    #[test]
    fn a_piece_of_one_byte_is_one_token() {
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            let mut all = String::new();
            for b in 0u8..128 {
                let c = (b as char).to_string();
                assert_eq!(
                    count_text(encoding, &c),
                    count_text_unremembered(encoding, &c),
                    "{c:?}"
                );
                assert_eq!(count_text_unremembered(encoding, &c), 1, "{c:?}");
                all.push(b as char);
                all.push_str(" x");
            }
            assert_eq!(
                count_text(encoding, &all),
                count_text_unremembered(encoding, &all)
            );
        }
    }

    #[test]
    fn counting_within_a_limit_is_the_count_or_none() {
        let text = "fn main() { println!(\"héllo, wörld\"); }\n".repeat(50);
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            let n = count_text(encoding, &text);
            assert!(n > 100);
            assert_eq!(count_within(encoding, &text, n), Some(n));
            assert_eq!(count_within(encoding, &text, u64::MAX), Some(n));
            assert_eq!(count_within(encoding, &text, n - 1), None);
            assert_eq!(count_within(encoding, &text, 10), None);
            assert_eq!(count_within(encoding, "", 0), Some(0));
        }
    }

    proptest::proptest! {
        /// Counting stops once past the limit (`for_each_piece_while`):
        /// the answer is the whole count's, for ASCII and mixed text.
        #[test]
        fn counting_within_stops_past_the_limit_with_the_same_answer(
            text in "([ -~\n]{0,40}|\\PC{0,20}){0,12}",
            limit in 0u64..120,
        ) {
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                let n = count_text(encoding, &text);
                proptest::prop_assert_eq!(
                    count_within(encoding, &text, limit),
                    (n <= limit).then_some(n)
                );
            }
        }
    }

    proptest::proptest! {
        /// No text counts fewer tokens than its ends of words, in either
        /// encoding: prose, code, contractions, marks and letters outside
        /// ASCII next to ASCII ones, apostrophes and digits between letters.
        #[test]
        fn no_encoding_counts_fewer_tokens_than_the_ends_of_words(
            text in "([ -~\n]{0,40}|\\PC{0,20}|[a-zA-Z'\u{300}\u{e9}\u{3b1}\u{4e00}0-9 .\n-]{0,30}|( ?(I|it|we|you|they|don|[a-z]{1,5})(?i:'s|'t|'re|'ve|'m|'ll|'d)| the| a| sure| fine| runs){1,8}){0,12}",
            limit in 0u64..200,
        ) {
            let fewest = fewest_tokens_up_to(&text, u64::MAX);
            // Up to a limit: the count, or some count over the limit.
            let up_to = fewest_tokens_up_to(&text, limit);
            let answered = if fewest > limit { up_to > limit } else { up_to == fewest };
            proptest::prop_assert!(answered, "{} up to {}: {}", fewest, limit, up_to);
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                let n = count_text_unremembered(encoding, &text);
                proptest::prop_assert!(fewest <= n, "{} ends of words, {} tokens: {:?}", fewest, n, text);
            }
        }
    }

    #[test]
    fn the_ends_of_words_are_counted_as_pieces_would_hold_them() {
        // Words, a contraction, a letter outside ASCII inside a word, and
        // digits, punctuation and line breaks apart words.
        assert_eq!(fewest_tokens_up_to("", 10), 0);
        assert_eq!(fewest_tokens_up_to("don't stop", 10), 2);
        assert_eq!(fewest_tokens_up_to("caf\u{e9}s a\u{e9}b", 10), 2);
        assert_eq!(fewest_tokens_up_to("abc123def.ghi\njkl", 10), 4);
        // Words without an ASCII letter count nothing.
        assert_eq!(fewest_tokens_up_to("42 \u{2014}.\u{2014} ''", 10), 0);
        // Past the limit, some count over it; under it, every word's end,
        // those across the scan's blocks too, wherever they fall.
        assert!(fewest_tokens_up_to(&"word ".repeat(1000), 10) > 10);
        for lead in 0..5 {
            let text = format!("{}{}", "x".repeat(lead), "word ".repeat(1000));
            assert_eq!(fewest_tokens_up_to(&text, u64::MAX), 1000, "{lead}");
        }
        // Prose with contractions, where the bound comes closest to the
        // count (o200k holds `I'm` and `it's` as one token each: an
        // apostrophe ending a word would pass it), and a line of an
        // agent's work.
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            for text in [
                "I'm sure it's fine, and we'll see what they've done.",
                "Let's run `cargo test -p contextfold` and fix src/core/tokens/mod.rs:42.\n",
            ] {
                let n = count_text_unremembered(encoding, text);
                let fewest = fewest_tokens_up_to(text, u64::MAX);
                assert!(fewest <= n && fewest * 2 >= n, "{fewest} of {n}: {text:?}");
            }
        }
    }

    #[test]
    fn remembered_pieces_count_as_computed_ones() {
        // More distinct words than the memo holds, each seen twice, and
        // long pieces that bypass it.
        let word = |mut i: usize| {
            let mut w = String::from(" ");
            loop {
                w.push((b'a' + (i % 26) as u8) as char);
                i /= 26;
                if i == 0 {
                    break w;
                }
            }
        };
        let mut text: String = (0..REMEMBERED_PIECES + 5_000).map(word).collect();
        text.push_str(&text.clone());
        text.push_str(
            " Pneumonoultramicroscopicsilicovolcanoconiosis 1234567 ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~",
        );
        for enc in [Encoding::O200kBase, Encoding::Cl100kBase] {
            let expected = count_text_unremembered(enc, &text);
            assert_eq!(count_text(enc, &text), expected, "{enc:?} cold");
            assert_eq!(count_text(enc, &text), expected, "{enc:?} warm");
            assert_eq!(
                count_text_tiktoken(enc, &text),
                expected,
                "{enc:?} tiktoken"
            );
        }
    }

    #[test]
    fn fast_counter_agrees_with_tiktoken() {
        let samples = [
            "hello world",
            "fn main() { println!(\"{}\", 42); } // ünïcödé ✓ 日本語",
            "/home/USER/src/lib.rs:120:5 error[E0308]: mismatched types",
            "   many    spaces\n\n\ttabs\r\n",
        ];
        for enc in [Encoding::O200kBase, Encoding::Cl100kBase] {
            for s in samples {
                assert_eq!(
                    count_text(enc, s),
                    count_text_tiktoken(enc, s),
                    "{enc:?} {s:?}"
                );
            }
        }
    }
}
