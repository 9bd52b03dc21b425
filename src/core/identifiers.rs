//! Opaque identifiers: the exact strings a summary must not paraphrase.
//!
//! This module owns what counts as an opaque identifier (file paths, URLs,
//! hashes, UUIDs, IP addresses, hosts and ports, error codes, ticket ids,
//! versions, dates, machine-made ids such as `toolu_01...` or `mia_li_3668`)
//! and how they are found in text. The summarizers keep them, the validator
//! checks for them and the eval measures their retention, so all three use
//! [`extract`].
//!
//! It runs over whole transcripts, so every pattern is compiled once and only
//! uses ASCII word boundaries: a Unicode `\b` makes the regex crate leave its
//! fast DFA as soon as the text holds one non-ASCII byte. And most rules
//! search only part of a text: a match of theirs holds no whitespace and one
//! of a few bytes (a `/` for a path, a digit for a version), so it lies in
//! one word that holds such a byte, and the words that hold none are
//! skipped (`Words`). What those rules find in a word depends on the word
//! alone (its edges are whitespace, which every rule and judge reads
//! alike, but for one case `words_found` names), and a session repeats its
//! words (paths, ids, hashes, tool output read again): each thread
//! remembers the finds of the last few thousand words it read twice, and
//! a word read again costs a hash lookup instead of a search per rule.

use regex_automata::meta::{Cache, Regex};
use regex_automata::util::iter::Searcher;
use regex_automata::{Input, Match};
use std::cell::RefCell;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::ops::Range;
use std::sync::LazyLock;

/// What kind of opaque identifier a string is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IdentifierKind {
    Url,
    /// A file or directory path (absolute, relative, Windows, or a bare file
    /// name with a known extension).
    Path,
    Uuid,
    /// Hex digests: git SHAs (7 to 40), sha256 and longer, `0x` values.
    Hash,
    /// IPv4 or IPv6, with port or prefix length when given.
    IpAddress,
    /// `host:port` or a bare host name with a well-known top-level domain.
    Host,
    /// A port stated as `port 8080` or `:8080`.
    Port,
    /// Compiler / errno / HTTP / exception / exit codes.
    ErrorCode,
    /// Issue or ticket ids: `#123`, `owner/repo#123`, `ABC-123`, `CVE-...`.
    Ticket,
    Version,
    /// Dotted numeric object identifiers with five or more arcs
    /// (`1.2.840.10008.1.2.1`, a DICOM transfer syntax UID), kept whole.
    Oid,
    Date,
    /// Machine-made ids: `call_abc123`, `mia_li_3668`, `HAT136`, `4WQ150`.
    Token,
}

impl IdentifierKind {
    /// Its name in reports (`eval`'s retention by kind).
    pub fn as_str(self) -> &'static str {
        match self {
            IdentifierKind::Url => "url",
            IdentifierKind::Path => "path",
            IdentifierKind::Uuid => "uuid",
            IdentifierKind::Hash => "hash",
            IdentifierKind::IpAddress => "ip_address",
            IdentifierKind::Host => "host",
            IdentifierKind::Port => "port",
            IdentifierKind::ErrorCode => "error_code",
            IdentifierKind::Ticket => "ticket",
            IdentifierKind::Version => "version",
            IdentifierKind::Oid => "oid",
            IdentifierKind::Date => "date",
            IdentifierKind::Token => "token",
        }
    }
}

/// One identifier found in a text.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identifier {
    pub kind: IdentifierKind,
    pub text: String,
}

/// Every opaque identifier of `text`, each once, in order of first appearance.
pub fn extract(text: &str) -> Vec<String> {
    extract_with_kinds(text)
        .into_iter()
        .map(|identifier| identifier.text)
        .collect()
}

/// Like [`extract`], with the kind of each identifier.
pub fn extract_with_kinds(text: &str) -> Vec<Identifier> {
    extract_by(text, Some(&Words::of(text)))
}

/// Like [`extract_with_kinds`], with every rule searching the whole text:
/// the reference that skipping texts and words is proptested against here
/// and measured against in `benches/identifiers.rs`.
pub fn extract_with_kinds_unskipped(text: &str) -> Vec<Identifier> {
    extract_by(text, None)
}

/// Like [`extract`], and for each of `parts` (byte ranges of `text`) what
/// [`extract`] finds in that part alone: a turn's text holds its calls'
/// arguments (`name(arguments)`), which a draft also reads apart, so the
/// text is searched once for both. A part is answered from the search of
/// the whole text when it is fenced as a call's arguments are (a `(` or
/// the text's start before it, a `)`, whitespace or the text's end after
/// it) and no match there, kept or not, crosses its edges. The rules'
/// `\b` and the judges ask of the bytes just around a match only whether
/// they are word bytes or one of a few punctuation marks; a fence answers
/// every such question as the part's own edge would (`(` is among the
/// marks only for a bare port, which it lets stand alone as an edge
/// does). Any other part is searched alone.
pub fn extract_with_parts(text: &str, parts: &[Range<usize>]) -> (Vec<String>, Vec<Vec<String>>) {
    let bytes = text.as_bytes();
    let mut crossed: Vec<bool> = parts
        .iter()
        .map(|part| {
            let before = part.start.checked_sub(1).and_then(|i| bytes.get(i));
            let after = bytes.get(part.end);
            let fenced = matches!(before, None | Some(b'('))
                && after.is_none_or(|&b| b == b')' || b.is_ascii_whitespace());
            !fenced
        })
        .collect();
    let kept = found_in(text, Some(&Words::of(text)), parts, &mut crossed);
    let texts = |ids: Vec<Identifier>| ids.into_iter().map(|id| id.text).collect::<Vec<_>>();
    let whole = texts(distinct(text, kept.iter()));
    let each = parts
        .iter()
        .zip(crossed)
        .map(|(part, crossed)| match text.get(part.clone()) {
            Some(alone) if crossed => extract(alone),
            Some(_) => texts(distinct(
                text,
                kept.iter()
                    .filter(|f| f.start >= part.start && f.end <= part.end),
            )),
            // Not a range of the text: nothing is in it.
            None => Vec::new(),
        })
        .collect();
    (whole, each)
}

/// Every identifier of `text`, each rule searching only the spans of
/// `words` that hold its bytes (a rule finds nothing elsewhere), or the
/// whole text without `words`.
fn extract_by(text: &str, words: Option<&Words>) -> Vec<Identifier> {
    distinct(text, found_in(text, words, &[], &mut []).iter())
}

/// The identifiers `kept` spans, each once, in order of first appearance.
fn distinct<'a>(text: &'a str, kept: impl Iterator<Item = &'a Found>) -> Vec<Identifier> {
    let mut seen: foldhash::HashSet<&str> = foldhash::HashSet::default();
    kept.filter_map(|f| {
        let s = &text[f.start..f.end];
        seen.insert(s).then(|| Identifier {
            kind: f.kind,
            text: s.to_string(),
        })
    })
    .collect()
}

/// The matches of every rule in `text` that are kept, in order (see
/// [`extract_by`] for `words`); for each of `parts`, whether a match, kept
/// or not, crosses one of its edges (`crossed`).
fn found_in(
    text: &str,
    words: Option<&Words>,
    parts: &[Range<usize>],
    crossed: &mut [bool],
) -> Vec<Found> {
    let mut found: Vec<Found> = Vec::new();
    let mut spans: Vec<Range<usize>> = Vec::new();
    let mut matched = |range: Range<usize>| {
        for (part, crossed) in parts.iter().zip(crossed.iter_mut()) {
            let overlaps = range.start < part.end && range.end > part.start;
            let within = range.start >= part.start && range.end <= part.end;
            *crossed |= overlaps && !within;
        }
    };
    CACHES.with_borrow_mut(|caches| {
        if let Some(words) = words {
            WORD_FINDS.with_borrow_mut(|memo| {
                words_found(text, &words.list, caches, memo, &mut found, &mut matched);
            });
        }
        for (rule, cache) in RULES.iter().zip(caches.iter_mut()) {
            spans.clear();
            match words {
                Some(_) if rule.within_words => continue,
                Some(words) if !words.may_match(rule.needs) => continue,
                _ => spans.push(0..text.len()),
            }
            search(rule, cache, text, &spans, &mut found, &mut matched);
        }
    });
    // Text that still holds JSON escapes (`\nsrc/lib.rs`) must not glue the
    // escape letter to the identifier after it.
    for f in &mut found {
        if f.end - f.start > 1
            && byte_before(text, f.start) == Some(b'\\')
            && matches!(byte_at(text, f.start), Some(b'n' | b'r' | b't'))
        {
            f.start += 1;
        }
        // A judge may reach before its match (`owner/repo#12`).
        matched(f.start..f.end);
    }
    // Leftmost wins, then the longest: a URL hides the path inside it, an IP
    // with its port hides the bare version-like prefix, a path hides the file
    // name at its end.
    found.sort_by(|a, b| {
        a.start
            .cmp(&b.start)
            .then(b.end.cmp(&a.end))
            .then(a.kind.cmp(&b.kind))
    });
    let mut covered_to = 0usize;
    found.retain(|f| {
        let kept = f.start >= covered_to;
        if kept {
            covered_to = f.end;
        }
        kept
    });
    found
}

struct Found {
    start: usize,
    end: usize,
    kind: IdentifierKind,
}

struct Rule {
    regex: Regex,
    /// Pushes what a match of `regex` in the text is, if anything.
    judge: fn(&str, Match, &mut Vec<Found>),
    /// The bytes (bits) of which every match holds one (0: no such
    /// bytes): a text without any of them is not searched.
    needs: u8,
    /// No match holds whitespace (the pattern has no `\s`, space or
    /// class that takes one), so each lies within one word: only the words
    /// holding one of `needs` are searched ([`words_found`]).
    within_words: bool,
}

// The bytes the rules need, one bit each (a rule's `needs`, the bits a
// word holds): most rules have no literal for the regex crate to look
// for, so each would otherwise scan every byte of a text that cannot match
// it (a call's arguments without a `/`, a sentence without a digit).
const COLON: u8 = 1;
const DOT: u8 = 1 << 1;
const SLASH: u8 = 1 << 2;
const DASH: u8 = 1 << 3;
const HASH: u8 = 1 << 4;
const BRACKET: u8 = 1 << 5;
const DIGIT: u8 = 1 << 6;
const UPPER: u8 = 1 << 7;

/// Marks ASCII whitespace in [`BYTE_CLASS`], which no match holds.
const SPACE: u16 = 1 << 8;

/// Each byte's bit (`COLON` ... `UPPER`), or [`SPACE`] (0: neither).
static BYTE_CLASS: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = match b as u8 {
            b' ' | b'\t' | b'\n' | b'\r' | b'\x0b' | b'\x0c' => SPACE,
            byte => holds_bit(byte) as u16,
        };
        b += 1;
    }
    table
};

/// The bit a byte sets (0: none).
const fn holds_bit(b: u8) -> u8 {
    match b {
        b':' => COLON,
        b'.' => DOT,
        b'/' => SLASH,
        b'-' => DASH,
        b'#' => HASH,
        b'[' => BRACKET,
        b'0'..=b'9' => DIGIT,
        b'A'..=b'Z' => UPPER,
        _ => 0,
    }
}

/// A text's words (runs between ASCII whitespace) that hold a byte the
/// rules need, each with the bits it holds, from one pass over the text.
struct Words {
    /// The words holding a byte the rules need, in order, with their bits.
    list: Vec<(Range<usize>, u8)>,
    /// Every bit some word holds.
    bits: u8,
}

impl Words {
    fn of(text: &str) -> Words {
        let mut words = Words {
            list: Vec::new(),
            bits: 0,
        };
        let mut start = 0usize;
        let mut bits = 0u8;
        for (i, &b) in text.as_bytes().iter().enumerate() {
            let class = BYTE_CLASS[usize::from(b)];
            if class == SPACE {
                if bits != 0 {
                    words.list.push((start..i, bits));
                    words.bits |= bits;
                    bits = 0;
                }
                start = i + 1;
            } else {
                bits |= class as u8;
            }
        }
        if bits != 0 {
            words.list.push((start..text.len(), bits));
            words.bits |= bits;
        }
        words
    }

    /// Whether the text holds one of `needs` (a rule that needs none may
    /// match anywhere).
    fn may_match(&self, needs: u8) -> bool {
        needs == 0 || self.bits & needs != 0
    }
}

/// A match within one word, from the word's start: found (`kind`) or only
/// matched (`None`: its judge kept nothing, yet it moved the search).
#[derive(Clone, Copy)]
struct Hit {
    start: u32,
    end: u32,
    kind: Option<IdentifierKind>,
}

/// Words longer than this are searched each time, not remembered (a
/// long URL still is; a blob of base64 is not worth the key).
const REMEMBERED_WORD_BYTES: usize = 256;
/// Words remembered per thread before the memo starts over: keys of 2 MiB
/// at most (8,192 of 256 bytes), and their finds.
const REMEMBERED_WORDS: usize = 8_192;
/// Slots of the memo's doorkeeper (a power of two): the hashes of words
/// read once, 128 KiB per thread.
const SEEN_WORDS: usize = 16_384;

/// The words' finds, and which words were read once: a word is remembered
/// the second time it is read, so text whose words never repeat (ids made
/// fresh per line, generated data) costs a hash per word rather than a
/// key and its finds allocated, kept and dropped unused.
struct WordMemo {
    finds: foldhash::HashMap<Box<str>, Box<[Hit]>>,
    /// Direct-mapped by hash: a collision only remembers a word a read
    /// earlier or later, never changes what is found.
    seen: Box<[u64]>,
}

impl Default for WordMemo {
    fn default() -> Self {
        WordMemo {
            finds: Default::default(),
            seen: vec![0; SEEN_WORDS].into_boxed_slice(),
        }
    }
}

impl WordMemo {
    /// Whether `word` was read before (by its hash), noting that it now is.
    fn read_before(&mut self, word: &str) -> bool {
        use std::hash::BuildHasher;
        let hash = self.finds.hasher().hash_one(word);
        let slot = &mut self.seen[hash as usize & (SEEN_WORDS - 1)];
        let before = *slot == hash;
        *slot = hash;
        before
    }
}

thread_local! {
    /// What the rules searching within words found in each word read
    /// lately on this thread ([`words_found`]); seeded per process, as the
    /// piece memo of `core::tokens` is, for the same reason.
    static WORD_FINDS: RefCell<WordMemo> = RefCell::new(WordMemo::default());
}

/// Empties this thread's memo of words, so that the next texts are read
/// as a session's first ones are (`benches/identifiers.rs` starts each
/// sample so); it changes no answer.
#[doc(hidden)]
pub fn forget_words() {
    WORD_FINDS.with_borrow_mut(|memo| *memo = WordMemo::default());
}

/// Every match of the rules searching within words in the words `list` of
/// `text` (each with its bits), told to `matched`, and what their judges
/// keep, pushed to `out`: from the memo for the words read lately, by a
/// search for the others, rule by rule over all of them (each rule's lazy
/// DFA stays warm over the words it searches, as it did before the memo).
///
/// The rules' `\b` and the judges ask of the bytes around a match inside a
/// word what the word's own bytes answer; at its edges they see ASCII
/// whitespace or the text's end, and ask only whether that is a word byte
/// or a punctuation mark, which none is. But for one question: a bare port
/// (`:8080`) stands alone after `is_ascii_whitespace`, which a vertical tab
/// is not (it still ends a word here, as the regex crate's `\s` does). A
/// word at a vertical tab is searched each time.
fn words_found(
    text: &str,
    list: &[(Range<usize>, u8)],
    caches: &mut [Cache],
    memo: &mut WordMemo,
    out: &mut Vec<Found>,
    matched: &mut impl FnMut(Range<usize>),
) {
    /// A word the memo did not answer: searched, and remembered after
    /// when `remember` still holds.
    struct Unanswered {
        span: Range<usize>,
        bits: u8,
        remember: bool,
        hits: Vec<Hit>,
    }
    let mut unanswered: Vec<Unanswered> = Vec::new();
    for (span, bits) in list {
        let word = &text[span.clone()];
        let plain_edges = !matches!(byte_before(text, span.start), Some(b'\x0b'))
            && !matches!(byte_at(text, span.end), Some(b'\x0b'));
        let mut remember = plain_edges && word.len() <= REMEMBERED_WORD_BYTES;
        if remember {
            if let Some(hits) = memo.finds.get(word) {
                for hit in hits.iter() {
                    let (start, end) = (
                        span.start + hit.start as usize,
                        span.start + hit.end as usize,
                    );
                    match hit.kind {
                        None => matched(start..end),
                        Some(kind) => out.push(Found { start, end, kind }),
                    }
                }
                continue;
            }
            remember = memo.read_before(word);
        }
        unanswered.push(Unanswered {
            span: span.clone(),
            bits: *bits,
            remember,
            hits: Vec::new(),
        });
    }
    let relative = |from: usize, range: Range<usize>, kind| Hit {
        start: (range.start - from) as u32,
        end: (range.end - from) as u32,
        kind,
    };
    for (rule, cache) in RULES.iter().zip(caches.iter_mut()) {
        if !rule.within_words {
            continue;
        }
        for word in unanswered.iter_mut().filter(|w| rule.needs & w.bits != 0) {
            let (from, keep, hits) = (word.span.start, word.remember, &mut word.hits);
            let judged = out.len();
            // A match lies in the span searched.
            let mut raw = |range: Range<usize>| {
                if keep {
                    hits.push(relative(from, range.clone(), None));
                }
                matched(range);
            };
            search(
                rule,
                cache,
                text,
                std::slice::from_ref(&word.span),
                out,
                &mut raw,
            );
            // A judge may reach past its match (`owner/repo#12`); none
            // reaches past the word, but one that did would make the word's
            // finds depend on its neighbours: it is not remembered then.
            for f in &out[judged..] {
                if f.start < word.span.start || f.end > word.span.end {
                    word.remember = false;
                } else if word.remember {
                    word.hits.push(relative(from, f.start..f.end, Some(f.kind)));
                }
            }
        }
    }
    for word in unanswered {
        if word.remember {
            if memo.finds.len() >= REMEMBERED_WORDS {
                memo.finds.clear();
            }
            memo.finds.insert(text[word.span].into(), word.hits.into());
        }
    }
}

thread_local! {
    /// Each rule's search cache, per thread: the regex's own pool of them
    /// is fast only for the thread that first used it, and a text's
    /// rules make thousands of short searches.
    static CACHES: RefCell<Vec<Cache>> =
        RefCell::new(RULES.iter().map(|rule| rule.regex.create_cache()).collect());
}

/// Every match of `rule` in `spans` of `text`, in order, told to `matched`
/// and judged; look-around (`\b`) sees the whole text.
fn search(
    rule: &Rule,
    cache: &mut Cache,
    text: &str,
    spans: &[Range<usize>],
    out: &mut Vec<Found>,
    matched: &mut impl FnMut(Range<usize>),
) {
    for span in spans {
        let mut searcher = Searcher::new(Input::new(text).range(span.clone()));
        while let Some(m) = searcher.advance(|input| Ok(rule.regex.search_with(cache, input))) {
            // Judged or not, a match moves the search past it.
            matched(m.range());
            (rule.judge)(text, m, out);
        }
    }
}

/// Compiles a pattern with ASCII-only word boundaries (see the module doc).
fn compile(pattern: &str) -> Regex {
    let ascii = pattern.replace(r"\b", r"(?-u:\b)");
    match Regex::new(&ascii) {
        Ok(regex) => regex,
        // The patterns are constants of this file: only a bug reaches this.
        Err(e) => panic!("identifier pattern does not compile: {e}"),
    }
}

/// File extensions that make a bare `name.ext` a file name, and that make
/// `name.ext:42` a file position rather than a host and port.
const FILE_EXTENSIONS: &[&str] = &[
    "rs",
    "py",
    "pyi",
    "ipynb",
    "js",
    "mjs",
    "cjs",
    "ts",
    "tsx",
    "jsx",
    "go",
    "java",
    "kt",
    "kts",
    "scala",
    "c",
    "h",
    "cc",
    "cpp",
    "cxx",
    "hpp",
    "hh",
    "cs",
    "fs",
    "swift",
    "m",
    "mm",
    "rb",
    "php",
    "pl",
    "lua",
    "r",
    "jl",
    "dart",
    "ex",
    "exs",
    "erl",
    "hs",
    "ml",
    "clj",
    "zig",
    "nim",
    "sh",
    "bash",
    "zsh",
    "fish",
    "ps1",
    "bat",
    "cmd",
    "md",
    "markdown",
    "rst",
    "txt",
    "adoc",
    "toml",
    "yaml",
    "yml",
    "json",
    "jsonl",
    "ndjson",
    "xml",
    "html",
    "htm",
    "css",
    "scss",
    "sass",
    "less",
    "vue",
    "svelte",
    "sql",
    "proto",
    "graphql",
    "ini",
    "cfg",
    "conf",
    "env",
    "lock",
    "csv",
    "tsv",
    "parquet",
    "log",
    "diff",
    "patch",
    "traj",
    "dockerfile",
    "gradle",
    "cmake",
    "mk",
    "tf",
    "tfvars",
    "hcl",
    "nix",
    "pem",
    "crt",
    "key",
    "pdf",
    "png",
    "jpg",
    "jpeg",
    "gif",
    "svg",
    "webp",
    "zip",
    "tar",
    "gz",
    "tgz",
    "whl",
    "so",
    "dll",
    "exe",
    "wasm",
    "db",
    "sqlite",
    "pyc",
    "o",
    "a",
    "bin",
    "dat",
    "msgpack",
    "redb",
    "dcm",
];

/// Top-level domains accepted for a bare host name (`api.example.com`).
/// Kept short: `self.name`-style attribute access must not look like a host.
const HOST_TLDS: &[&str] = &[
    "com",
    "org",
    "net",
    "io",
    "dev",
    "ai",
    "co",
    "app",
    "edu",
    "gov",
    "cloud",
    "internal",
    "local",
    "localdomain",
    "lan",
    "corp",
    "xyz",
    "info",
    "tech",
    "site",
    "run",
    "sh",
    "so",
    "gg",
    "ly",
    "me",
    "uk",
    "de",
    "fr",
    "jp",
    "cn",
    "eu",
    "nl",
    "ch",
    "ca",
    "au",
    "ru",
    "us",
];

/// Uppercase prefixes of `ABC-123`/`UTF-16`-shaped strings that name a
/// standard or an encoding, not a ticket or an id.
const NOT_TICKET_PREFIXES: &[&str] = &[
    "UTF", "UCS", "SHA", "MD", "ISO", "IEC", "GPT", "AES", "RSA", "DES", "TLS", "SSL", "HTTP",
    "COVID", "PDF", "WCAG", "IPV", "CP", "WIN", "LATIN", "KOI", "ES", "ECMA", "X", "H", "P", "MP",
    "BASE", "CRC", "PBKDF", "HMAC", "ED", "CHACHA", "ARM", "X86", "I", "A", "TOP", "PHASE", "STEP",
    "PART", "Q", "PEP",
];

/// errno names worth keeping exactly.
const ERRNO: &[&str] = &[
    "EPERM",
    "ENOENT",
    "ESRCH",
    "EINTR",
    "EIO",
    "ENXIO",
    "E2BIG",
    "ENOEXEC",
    "EBADF",
    "ECHILD",
    "EAGAIN",
    "ENOMEM",
    "EACCES",
    "EFAULT",
    "EBUSY",
    "EEXIST",
    "EXDEV",
    "ENODEV",
    "ENOTDIR",
    "EISDIR",
    "EINVAL",
    "ENFILE",
    "EMFILE",
    "ENOTTY",
    "EFBIG",
    "ENOSPC",
    "ESPIPE",
    "EROFS",
    "EMLINK",
    "EPIPE",
    "EDOM",
    "ERANGE",
    "EDEADLK",
    "ENAMETOOLONG",
    "ENOSYS",
    "ENOTEMPTY",
    "ELOOP",
    "EWOULDBLOCK",
    "ENOTSOCK",
    "EADDRINUSE",
    "EADDRNOTAVAIL",
    "ENETDOWN",
    "ENETUNREACH",
    "ENETRESET",
    "ECONNABORTED",
    "ECONNRESET",
    "ENOBUFS",
    "EISCONN",
    "ENOTCONN",
    "ETIMEDOUT",
    "ECONNREFUSED",
    "EHOSTDOWN",
    "EHOSTUNREACH",
    "EALREADY",
    "EINPROGRESS",
    "ESTALE",
    "EDQUOT",
    "ECANCELED",
    "EOVERFLOW",
    "ENOTSUP",
    "EOPNOTSUPP",
    "EPROTO",
    "ENOTFOUND",
    "EAI_AGAIN",
    "ESOCKETTIMEDOUT",
];

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn byte_before(text: &str, start: usize) -> Option<u8> {
    start.checked_sub(1).map(|i| text.as_bytes()[i])
}

fn byte_at(text: &str, i: usize) -> Option<u8> {
    text.as_bytes().get(i).copied()
}

/// Drops sentence punctuation a pattern swallowed at the end of a match,
/// keeping a closing bracket that has its opening one inside.
fn trim_trailing(text: &str, start: usize, mut end: usize) -> usize {
    while end > start {
        let s = &text[start..end];
        let Some(last) = s.as_bytes().last().copied() else {
            break;
        };
        let drop = match last {
            b'.' | b',' | b';' | b':' | b'!' | b'?' | b'\'' | b'"' | b'`' | b'*' => true,
            b')' => s.matches('(').count() < s.matches(')').count(),
            b']' => s.matches('[').count() < s.matches(']').count(),
            b'}' => s.matches('{').count() < s.matches('}').count(),
            b'>' => !s.contains('<'),
            _ => false,
        };
        if !drop {
            break;
        }
        end -= 1;
    }
    end
}

fn extension_of(name: &str) -> Option<&str> {
    let (stem, ext) = name.rsplit_once('.')?;
    if stem.is_empty() {
        return None;
    }
    Some(ext)
}

fn is_file_extension(ext: &str) -> bool {
    let lower = ext.to_ascii_lowercase();
    FILE_EXTENSIONS.contains(&lower.as_str())
}

fn digit_count(s: &str) -> usize {
    s.bytes().filter(u8::is_ascii_digit).count()
}

static RULES: LazyLock<Vec<Rule>> = LazyLock::new(|| {
    vec![
        Rule {
            regex: compile(
                r#"\b(?:https?|wss?|ftp|sftp|ssh|git|file|s3|gs|nats|redis|postgres(?:ql)?|mysql|mongodb(?:\+srv)?|amqp)://[^\s<>"'`\\]+"#,
            ),
            judge: judge_urls,
            needs: COLON,
            within_words: true,
        },
        Rule {
            regex: compile(
                r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b",
            ),
            judge: |_, m, out| push(m, out, IdentifierKind::Uuid),
            needs: DASH,
            within_words: true,
        },
        Rule {
            // A digest mixes digits and letters: the pattern requires both, so
            // plain numbers and words never become candidates.
            regex: compile(
                r"\b(?:0x[0-9a-fA-F]{4,64}|[0-9a-f]*(?:[0-9][0-9a-f]*[a-f]|[a-f][0-9a-f]*[0-9])[0-9a-f]*|[0-9A-F]*(?:[0-9][0-9A-F]*[A-F]|[A-F][0-9A-F]*[0-9])[0-9A-F]*)\b",
            ),
            judge: judge_hashes,
            needs: DIGIT,
            within_words: true,
        },
        Rule {
            regex: compile(r"\b(?:[0-9]{1,3}\.){3}[0-9]{1,3}(?::[0-9]{1,5}|/[0-9]{1,2})?\b"),
            judge: judge_ipv4,
            needs: DOT,
            within_words: true,
        },
        Rule {
            regex: compile(
                r"\[[0-9a-fA-F:.]{2,45}\](?::[0-9]{1,5})?|[0-9a-fA-F]{0,4}(?::[0-9a-fA-F]{0,4}){2,7}(?:/[0-9]{1,3})?",
            ),
            judge: judge_ipv6,
            needs: COLON | BRACKET,
            within_words: true,
        },
        Rule {
            regex: compile(&format!(
                r"\b(?:localhost:[0-9]{{2,5}}|(?:[A-Za-z0-9](?:[A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?\.)+(?:[A-Za-z]{{2,24}}:[0-9]{{2,5}}|(?i:{})))\b",
                HOST_TLDS.join("|")
            )),
            judge: judge_hosts,
            needs: DOT | COLON,
            within_words: true,
        },
        Rule {
            // Absolute, home- or dot-relative unix paths.
            regex: compile(r"(?:~|\.{1,2})?/[A-Za-z0-9_.@+%-]+(?:/[A-Za-z0-9_.@+%-]+)*/?"),
            judge: judge_unix_paths,
            needs: SLASH,
            within_words: true,
        },
        Rule {
            regex: compile(r#"\b[A-Za-z]:\\[^\s"'<>|*?]+"#),
            judge: judge_windows_paths,
            needs: COLON,
            within_words: true,
        },
        Rule {
            // Relative paths with at least one directory: src/core/mod.rs.
            regex: compile(r"\b[A-Za-z0-9_.@+-]+(?:/[A-Za-z0-9_.@+-]+)+"),
            judge: judge_relative_paths,
            needs: SLASH,
            within_words: true,
        },
        Rule {
            // Bare file names: Cargo.toml, README.md, test_schema.py.
            regex: compile(&format!(
                r"\b[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.(?i:{})\b",
                FILE_EXTENSIONS.join("|")
            )),
            judge: judge_file_names,
            needs: DOT,
            within_words: true,
        },
        Rule {
            regex: compile(r"(?i)\bports?\s*(?:number\s*)?[:=#]?\s*[0-9]{2,5}\b"),
            judge: judge_ports,
            needs: 0,
            within_words: false,
        },
        Rule {
            // `:8080` standing alone (`listening on :8080`).
            regex: compile(r":[0-9]{2,5}\b"),
            judge: judge_bare_ports,
            needs: COLON,
            within_words: true,
        },
        Rule {
            regex: compile(
                r"\b(?:E[0-9]{4}|(?:TS|CS|SC|SA|PLR|PLW|PLE|RUF|SIM|UP|ANN|E|W|F|C|D|N|B|I)[0-9]{3,4}|SIG[A-Z]{2,7}|E[A-Z0-9_]{2,14}|[A-Z][A-Za-z0-9]+(?:Error|Exception|Warning))\b",
            ),
            judge: judge_codes,
            needs: UPPER,
            within_words: true,
        },
        Rule {
            regex: compile(
                r"(?i)\bHTTP(?:/[0-9.]+)?\s*[1-5][0-9]{2}\b|\bstatus(?:[ _]code)?\s*[:=]?\s*[1-5][0-9]{2}\b|\bexit(?:ed)?(?: with)? (?:code|status)\s*[:=]?\s*-?[0-9]{1,3}\b",
            ),
            judge: |_, m, out| push(m, out, IdentifierKind::ErrorCode),
            needs: DIGIT,
            within_words: false,
        },
        Rule {
            regex: compile(
                r"\b[1-5][0-9]{2} (?:Not Found|Bad Request|Unauthorized|Forbidden|Internal Server Error|Bad Gateway|Service Unavailable|Gateway Timeout|Too Many Requests|Conflict|Method Not Allowed|Unprocessable Entity|Payload Too Large|Request Entity Too Large|Not Implemented|Moved Permanently|Not Modified|Gone|Precondition Failed|Request Timeout)\b",
            ),
            judge: |_, m, out| push(m, out, IdentifierKind::ErrorCode),
            needs: DIGIT,
            within_words: false,
        },
        Rule {
            // Found by its `#`; an `owner/repo` before it is taken in by hand.
            regex: compile(r"#[0-9]{2,7}\b"),
            judge: judge_hash_tickets,
            needs: HASH,
            within_words: true,
        },
        Rule {
            regex: compile(r"\bCVE-[0-9]{4}-[0-9]{4,7}\b|\b[A-Z][A-Z0-9]{1,9}-[0-9]{1,7}\b"),
            judge: judge_key_tickets,
            needs: DASH,
            within_words: true,
        },
        Rule {
            // Five or more numeric arcs: longer than an IPv4 address, so the
            // version rule below cannot cut it into `1.2.840` and `10008.1.2`.
            regex: compile(r"\b[0-9]+(?:\.[0-9]+){4,}\b"),
            judge: |_, m, out| push(m, out, IdentifierKind::Oid),
            needs: DOT,
            within_words: true,
        },
        Rule {
            regex: compile(
                r"\bv?[0-9]+\.[0-9]+\.[0-9]+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?\b|\bv[0-9]+\.[0-9]+\b",
            ),
            judge: |_, m, out| push(m, out, IdentifierKind::Version),
            needs: DOT,
            within_words: true,
        },
        Rule {
            regex: compile(
                r"\b[0-9]{4}-[0-9]{2}-[0-9]{2}(?:[T ][0-9]{2}:[0-9]{2}(?::[0-9]{2}(?:\.[0-9]+)?)?(?:Z|[+-][0-9]{2}:?[0-9]{2})?)?\b",
            ),
            judge: |_, m, out| push(m, out, IdentifierKind::Date),
            needs: DASH,
            within_words: false,
        },
        Rule {
            // Machine-made ids: snake/kebab compounds and uppercase codes.
            // Both shapes need a digit, and the pattern says so: plain words
            // never become candidates.
            regex: compile(
                r"\b[A-Za-z][A-Za-z0-9_-]*[0-9][A-Za-z0-9_-]*\b|\b[A-Z0-9]*(?:[A-Z][A-Z0-9]*[0-9]|[0-9][A-Z0-9]*[A-Z])[A-Z0-9]*\b",
            ),
            judge: judge_tokens,
            needs: DIGIT,
            within_words: true,
        },
    ]
});

fn push(m: Match, out: &mut Vec<Found>, kind: IdentifierKind) {
    out.push(Found {
        start: m.start(),
        end: m.end(),
        kind,
    });
}

fn judge_urls(text: &str, m: Match, out: &mut Vec<Found>) {
    let end = trim_trailing(text, m.start(), m.end());
    // A scheme alone (`https://`) is not an identifier.
    if text[m.start()..end].ends_with("://") {
        return;
    }
    out.push(Found {
        start: m.start(),
        end,
        kind: IdentifierKind::Url,
    });
}

fn judge_hashes(text: &str, m: Match, out: &mut Vec<Found>) {
    let s = &text[m.range()];
    if !s.starts_with("0x") && !(7..=128).contains(&s.len()) {
        return;
    }
    // Part of a longer token such as `abc1234-foo` or `x.abcdef12`.
    if matches!(byte_before(text, m.start()), Some(b'-' | b'.' | b'/'))
        || matches!(byte_at(text, m.end()), Some(b'-'))
    {
        return;
    }
    push(m, out, IdentifierKind::Hash);
}

fn judge_ipv4(text: &str, m: Match, out: &mut Vec<Found>) {
    let s = &text[m.range()];
    let addr = s.split([':', '/']).next().unwrap_or(s);
    if addr.parse::<Ipv4Addr>().is_err() {
        return;
    }
    // `1.2.3.4.5` is a version or an OID, not an address.
    if matches!(byte_before(text, m.start()), Some(b'.'))
        || (matches!(byte_at(text, m.end()), Some(b'.'))
            && byte_at(text, m.end() + 1).is_some_and(|b| b.is_ascii_digit()))
    {
        return;
    }
    push(m, out, IdentifierKind::IpAddress);
}

fn judge_ipv6(text: &str, m: Match, out: &mut Vec<Found>) {
    let s = &text[m.range()];
    let (addr, bracketed) = if let Some(rest) = s.strip_prefix('[') {
        (rest.split(']').next().unwrap_or(rest), true)
    } else {
        (s.split('/').next().unwrap_or(s), false)
    };
    if addr.parse::<Ipv6Addr>().is_err() {
        return;
    }
    if !bracketed {
        // Rust paths (`de::Error`, `crate::db::add`) and clock times
        // share the alphabet: require a digit and clean edges.
        if !addr.bytes().any(|b| b.is_ascii_digit())
            || byte_before(text, m.start()).is_some_and(|b| is_ident_byte(b) || b == b':')
            || byte_at(text, m.end()).is_some_and(|b| is_ident_byte(b) || b == b':')
        {
            return;
        }
    }
    push(m, out, IdentifierKind::IpAddress);
}

fn judge_hosts(text: &str, m: Match, out: &mut Vec<Found>) {
    let s = &text[m.range()];
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (s, None),
    };
    // Inside an e-mail address, a path or a dotted attribute chain.
    if matches!(
        byte_before(text, m.start()),
        Some(b'@' | b'.' | b'/' | b'-')
    ) {
        return;
    }
    if host.eq_ignore_ascii_case("localhost") {
        if port.is_none() {
            return;
        }
    } else {
        let tld = host.rsplit('.').next().unwrap_or(host);
        // `lib.rs:120` is a file position, `self.config` is code.
        if is_file_extension(tld) {
            return;
        }
        if port.is_none() && !HOST_TLDS.contains(&tld.to_ascii_lowercase().as_str()) {
            return;
        }
        if port.is_none() && byte_at(text, m.end()) == Some(b'(') {
            return;
        }
    }
    if port.is_some_and(|p| p.parse::<u32>().map_or(true, |n| n > 65535)) {
        return;
    }
    push(m, out, IdentifierKind::Host);
}

fn judge_unix_paths(text: &str, m: Match, out: &mut Vec<Found>) {
    // `and/or`, `1/2`, the `//host` of a URL.
    if byte_before(text, m.start())
        .is_some_and(|b| is_ident_byte(b) || matches!(b, b'/' | b':' | b'.' | b'-' | b'<'))
    {
        return;
    }
    let end = trim_trailing(text, m.start(), m.end());
    let s = &text[m.start()..end];
    let anchored = s.starts_with('~') || s.starts_with('.');
    let body = s.trim_start_matches(['~', '.']).trim_matches('/');
    if body.is_empty() || !body.bytes().any(|b| b.is_ascii_alphabetic()) {
        return;
    }
    let segments = body.split('/').count();
    let last = body.rsplit('/').next().unwrap_or(body);
    let has_ext = extension_of(last).is_some_and(|e| e.bytes().any(|b| b.is_ascii_alphabetic()));
    if !(anchored || segments >= 2 || has_ext) {
        return;
    }
    out.push(Found {
        start: m.start(),
        end,
        kind: IdentifierKind::Path,
    });
}

fn judge_windows_paths(text: &str, m: Match, out: &mut Vec<Found>) {
    let end = trim_trailing(text, m.start(), m.end());
    if end - m.start() <= 3 {
        return;
    }
    out.push(Found {
        start: m.start(),
        end,
        kind: IdentifierKind::Path,
    });
}

fn judge_relative_paths(text: &str, m: Match, out: &mut Vec<Found>) {
    if matches!(
        byte_before(text, m.start()),
        Some(b'/' | b'.' | b'-' | b'@')
    ) {
        return;
    }
    let end = trim_trailing(text, m.start(), m.end());
    let s = &text[m.start()..end];
    let last = s.rsplit('/').next().unwrap_or(s);
    // Without an extension `input/output` is prose; with one it is a file.
    let Some(ext) = extension_of(last) else {
        return;
    };
    if !ext.bytes().next().is_some_and(|b| b.is_ascii_alphabetic()) {
        return;
    }
    out.push(Found {
        start: m.start(),
        end,
        kind: IdentifierKind::Path,
    });
}

fn judge_file_names(text: &str, m: Match, out: &mut Vec<Found>) {
    let s = &text[m.range()];
    let Some(ext) = extension_of(s) else {
        return;
    };
    if !is_file_extension(ext) {
        return;
    }
    // `response.json()` and `obj.py_attr` are code, not files.
    if matches!(byte_at(text, m.end()), Some(b'(' | b'_'))
        || matches!(byte_before(text, m.start()), Some(b'.' | b'-'))
    {
        return;
    }
    // A lone letter before the dot (`e.g`, `a.out`-like prose) is noise.
    if s.find('.').is_some_and(|i| i < 2) && !s.starts_with('_') {
        return;
    }
    push(m, out, IdentifierKind::Path);
}

fn judge_bare_ports(text: &str, m: Match, out: &mut Vec<Found>) {
    let alone = match byte_before(text, m.start()) {
        None => true,
        Some(b) => b.is_ascii_whitespace() || matches!(b, b'(' | b'[' | b'=' | b','),
    };
    if alone {
        push_port(text, m.start(), m.end(), out);
    }
}

/// The port is the match's trailing digits: nothing the pattern takes
/// before them is a digit.
fn judge_ports(text: &str, m: Match, out: &mut Vec<Found>) {
    let digits = text[m.range()]
        .bytes()
        .rev()
        .take_while(u8::is_ascii_digit)
        .count();
    push_port(text, m.end() - digits, m.end(), out);
}

fn push_port(text: &str, start: usize, end: usize, out: &mut Vec<Found>) {
    let digits = text[start..end].trim_start_matches(':');
    if digits.parse::<u32>().map_or(true, |n| n == 0 || n > 65535) {
        return;
    }
    // `:3.5` is a ratio, not a port.
    if byte_at(text, end) == Some(b'.')
        && byte_at(text, end + 1).is_some_and(|b| b.is_ascii_digit())
    {
        return;
    }
    out.push(Found {
        start,
        end,
        kind: IdentifierKind::Port,
    });
}

fn judge_codes(text: &str, m: Match, out: &mut Vec<Found>) {
    let s = &text[m.range()];
    let keep = if s.ends_with("Error") || s.ends_with("Exception") || s.ends_with("Warning") {
        true
    } else if s.starts_with("SIG") && s.bytes().all(|b| b.is_ascii_uppercase()) {
        matches!(
            s,
            "SIGKILL"
                | "SIGTERM"
                | "SIGINT"
                | "SIGSEGV"
                | "SIGABRT"
                | "SIGHUP"
                | "SIGPIPE"
                | "SIGBUS"
                | "SIGFPE"
                | "SIGILL"
                | "SIGQUIT"
                | "SIGUSR1"
                | "SIGUSR2"
                | "SIGCHLD"
                | "SIGALRM"
                | "SIGSTOP"
                | "SIGCONT"
                | "SIGTRAP"
        )
    } else if s.bytes().skip(1).all(|b| b.is_ascii_digit()) || digit_count(s) >= 3 {
        // E0308, W291, TS2345: a prefix then digits.
        let digits = digit_count(s);
        digits >= 3 && s.bytes().rev().take(digits).all(|b| b.is_ascii_digit())
    } else {
        ERRNO.contains(&s)
    };
    if keep && !matches!(byte_before(text, m.start()), Some(b'-' | b'.')) {
        push(m, out, IdentifierKind::ErrorCode);
    }
}

fn judge_hash_tickets(text: &str, m: Match, out: &mut Vec<Found>) {
    let bytes = text.as_bytes();
    let repo_byte = |b: u8| is_ident_byte(b) || b == b'.' || b == b'-';
    let mut start = m.start();
    // `owner/repo#123`: walk back over `repo`, `/`, `owner`.
    let mut i = start;
    while i > 0 && repo_byte(bytes[i - 1]) {
        i -= 1;
    }
    if i < start && i > 0 && bytes[i - 1] == b'/' {
        let mut j = i - 1;
        while j > 0 && repo_byte(bytes[j - 1]) {
            j -= 1;
        }
        if j < i - 1 && (j == 0 || bytes[j - 1] != b'/') {
            start = j;
        }
    }
    // `&#123;` is an HTML entity, `abc#12` an anchor inside a word.
    if start == m.start() && byte_before(text, start).is_some_and(|b| is_ident_byte(b) || b == b'&')
    {
        return;
    }
    out.push(Found {
        start,
        end: m.end(),
        kind: IdentifierKind::Ticket,
    });
}

fn judge_key_tickets(text: &str, m: Match, out: &mut Vec<Found>) {
    let s = &text[m.range()];
    let prefix = s.split('-').next().unwrap_or(s);
    if !s.starts_with("CVE-") && NOT_TICKET_PREFIXES.contains(&prefix) {
        return;
    }
    if matches!(byte_before(text, m.start()), Some(b'-' | b'_' | b'.'))
        || matches!(byte_at(text, m.end()), Some(b'-' | b'_'))
    {
        return;
    }
    push(m, out, IdentifierKind::Ticket);
}

fn judge_tokens(text: &str, m: Match, out: &mut Vec<Found>) {
    let s = &text[m.range()];
    let letters = s.bytes().filter(u8::is_ascii_alphabetic).count();
    let digits = digit_count(s);
    if s.len() < 5 || letters == 0 || digits < 2 {
        return;
    }
    if s.contains(['_', '-']) {
        // Compound ids have clean separators (`a_b-c`, not `a__b`, `a-`).
        if s.ends_with(['_', '-']) || s.contains("__") || s.contains("--") {
            return;
        }
    } else if s.len() > 12 || s.bytes().any(|b| b.is_ascii_lowercase()) {
        // Unseparated, only short uppercase codes (`HAT136`, `4WQ150`).
        return;
    }
    if matches!(
        byte_before(text, m.start()),
        Some(b'-' | b'.' | b'/' | b'$')
    ) || matches!(byte_at(text, m.end()), Some(b'('))
    {
        return;
    }
    let first = s.split(['-', '_']).next().unwrap_or(s).to_ascii_uppercase();
    if NOT_TICKET_PREFIXES.contains(&first.as_str()) {
        return;
    }
    push(m, out, IdentifierKind::Token);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Pieces of text around identifiers: each rule's bytes alone and in
    /// its shapes, words, non-ASCII text and the JSON escape before a path.
    const PIECES: &[&str] = &[
        "https://example.com/a?b=1",
        "postgres://db:5432",
        "://",
        "3f2b8c1e-9a4d-4e6f-8b2a-1c3d5e7f9a0b",
        "deadbeef1",
        "0x1F2E3D",
        "abc1234",
        "ABC123F",
        "10.0.0.1:8080",
        "192.168.1.0/24",
        "1.2.3.4.5",
        "[::1]:80",
        "fe80::1",
        "2001:db8::1/64",
        "de::Error",
        "12:30:45",
        "api.example.com",
        "host.io:443",
        "localhost:3000",
        "self.config",
        "/usr/lib/x.so",
        "~/a/b",
        "../up",
        "./here",
        "C:\\Users\\x.txt",
        "src/core/mod.rs",
        "Cargo.toml",
        "README.md",
        "lib.rs:120",
        "port 8080",
        "PORT=9000",
        ":8080",
        "E0308",
        "TS2345",
        "SIGKILL",
        "ENOENT",
        "ValueError",
        "HTTP 404",
        "status code 500",
        "exit code 2",
        "404 Not Found",
        "#123",
        "owner/repo#45",
        "ABC-123",
        "CVE-2024-12345",
        "UTF-8",
        "1.2.840.10008.1.2.1",
        "v1.2.3",
        "1.2.3-rc.1+build.5",
        "v2.0",
        "2026-12-03",
        "2026-12-03T20:40:00Z",
        "toolu_01ABC",
        "mia_li_3668",
        "HAT136",
        "4WQ150",
        "\\nsrc/lib.rs",
        "\\t",
        "\t",
        "\r\n",
        "\u{b}",
        "\u{c}",
        "\u{a0}",
        "\u{3000}",
        "word",
        "Word",
        "x",
        "é",
        "→",
        "日本",
        "ſ",
        "\u{212A}",
        ".",
        ":",
        "/",
        "-",
        "#",
        "[",
        "]",
        "0",
        "9",
        "A",
        "Z",
        "_",
        " ",
        "\n",
        ",",
        "(",
        ")",
        "\"",
        "'",
        "`",
    ];

    /// The ASCII whitespace that ends a word ([`BYTE_CLASS`]'s `SPACE`).
    const WORD_ENDS: &[&str] = &[" ", "\t", "\n", "\r", "\u{b}", "\u{c}"];

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => prop::collection::vec(prop::sample::select(PIECES), 0..16).prop_map(|p| p.join(" ")),
            3 => prop::collection::vec(prop::sample::select(PIECES), 0..16).prop_map(|p| p.concat()),
            // Pieces apart by each kind of whitespace that ends a word: the
            // same word at different edges, which the word memo must not mix.
            3 => prop::collection::vec(
                (prop::sample::select(PIECES), prop::sample::select(WORD_ENDS)),
                0..16,
            )
            .prop_map(|p| p.into_iter().flat_map(|(piece, end)| [piece, end]).collect()),
            1 => "\\PC{0,80}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Skipping the rules whose bytes a text lacks, and the words
        /// that hold none of a rule's bytes, finds what every rule finds
        /// over the whole text.
        #[test]
        fn rules_skipped_by_their_bytes_find_nothing(text in text()) {
            prop_assert_eq!(extract_with_kinds(&text), extract_with_kinds_unskipped(&text));
        }
    }

    /// A turn's text as `searchable_text` renders it: its words, then a
    /// line per call, `name(arguments)` (the `)` sometimes cut off); and
    /// where each call's arguments lie in it.
    fn rendered_turn() -> impl Strategy<Value = (String, Vec<Range<usize>>)> {
        let arguments = prop_oneof![
            text(),
            text().prop_map(|t| format!("{{\"command\": \"{t}\"}}")),
            text().prop_map(|t| format!("{{\"file_path\":\"{t}\",\"n\":1}}")),
            // Ending where a match runs on into the call's `)`: a bracket
            // the `)` closes is kept, so the match crosses the edge.
            (
                text(),
                prop::sample::select(&["C:\\x(", "https://w.org/A_(b", "(", "a"][..])
            )
                .prop_map(|(t, end)| format!("{t} {end}")),
        ];
        let name = prop::sample::select(&["Bash", "Edit", "mcp__db_v2", "Read", "x1"][..]);
        (
            text(),
            prop::collection::vec((name, arguments, any::<bool>()), 0..4),
        )
            .prop_map(|(words, calls)| {
                let mut out = words;
                let mut parts = Vec::new();
                for (name, arguments, closed) in calls {
                    if !out.is_empty() {
                        out.push('\n');
                    }
                    out.push_str(name);
                    out.push('(');
                    parts.push(out.len()..out.len() + arguments.len());
                    out.push_str(&arguments);
                    if closed {
                        out.push(')');
                    }
                }
                (out, parts)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// The whole text's search answers for each call's arguments as
        /// searching them alone does, and for the text as `extract`.
        #[test]
        fn parts_answered_from_the_whole_text_find_what_they_find_alone(
            (text, parts) in rendered_turn(),
        ) {
            let (whole, each) = extract_with_parts(&text, &parts);
            prop_assert_eq!(whole, extract(&text));
            for (part, found) in parts.iter().zip(each) {
                prop_assert_eq!(found, extract(&text[part.clone()]), "{:?}", &text[part.clone()]);
            }
        }

        /// Any part of any text, fenced or not, is answered as searched
        /// alone (an unfenced one is).
        #[test]
        fn any_part_finds_what_it_finds_alone(text in text(), a in 0usize..200, b in 0usize..200) {
            let (lo, hi) = (a.min(b).min(text.len()), a.max(b).min(text.len()));
            prop_assume!(text.is_char_boundary(lo) && text.is_char_boundary(hi));
            let part = lo..hi;
            let (whole, each) = extract_with_parts(&text, std::slice::from_ref(&part));
            prop_assert_eq!(whole, extract(&text));
            prop_assert_eq!(&each[0], &extract(&text[lo..hi]));
        }
    }

    /// A word's finds are remembered apart from its edges, which every
    /// rule and judge reads alike but for one: `:8080` stands alone after
    /// a space or the text's start, not after a vertical tab (no
    /// `is_ascii_whitespace`). So a word at a vertical tab is searched
    /// each time, and either order of the two is answered as unremembered.
    #[test]
    fn a_remembered_word_is_answered_as_its_edges_ask() {
        for texts in [
            ["at :8080 now", "at\u{b}:8080 now"],
            ["at\u{b}:8080\u{b}", ":8080"],
        ] {
            // Each read twice: a word is remembered at its second read.
            let twice = texts.iter().flat_map(|text| [text, text]);
            for text in twice.clone().chain(twice.rev()) {
                assert_eq!(
                    extract_with_kinds(text),
                    extract_with_kinds_unskipped(text),
                    "{text:?}"
                );
            }
        }
        assert!(extract("at :8080 now").contains(&":8080".to_string()));
        assert!(extract("at\u{b}:8080 now").is_empty());
    }

    /// More words than the memo holds are answered as unremembered ones,
    /// while it fills, when it starts over and after: read once (noted),
    /// twice (remembered) and a third time (answered from the memo).
    #[test]
    fn words_past_the_memo_are_answered_alike() {
        for round in 0..3 {
            for i in 0..REMEMBERED_WORDS + 100 {
                let text = format!("see src/m{i}.rs and v{round}.{i}.0 at :{}", 1000 + i % 9000);
                assert_eq!(
                    extract_with_kinds(&text),
                    extract_with_kinds_unskipped(&text),
                    "{text:?}"
                );
            }
        }
    }

    #[test]
    fn a_rule_searched_in_words_names_the_bytes_its_words_hold() {
        // A rule with no bytes to look for would search no word at all.
        for (i, rule) in RULES.iter().enumerate() {
            assert!(!rule.within_words || rule.needs != 0, "rule {i}");
        }
        let text = "see src/lib.rs\tand\u{a0}v1.2.3 at :8080\n";
        let words = Words::of(text);
        let listed: Vec<(&str, u8)> = words
            .list
            .iter()
            .map(|(span, bits)| (&text[span.clone()], *bits))
            .collect();
        assert_eq!(
            listed,
            [
                ("src/lib.rs", SLASH | DOT),
                ("and\u{a0}v1.2.3", DOT | DIGIT),
                (":8080", COLON | DIGIT)
            ]
        );
        assert!(words.may_match(HASH | DIGIT));
        assert!(!words.may_match(BRACKET | HASH));
    }

    fn ids(text: &str) -> Vec<String> {
        extract(text)
    }

    fn has(text: &str, want: &str) {
        let got = ids(text);
        assert!(
            got.iter().any(|s| s == want),
            "{want:?} not found in {text:?}: {got:?}"
        );
    }

    fn lacks(text: &str, unwanted: &str) {
        let got = ids(text);
        assert!(
            !got.iter().any(|s| s == unwanted),
            "{unwanted:?} wrongly found in {text:?}: {got:?}"
        );
    }

    #[test]
    fn finds_paths_of_every_shape() {
        has(
            "see /home/USER/src/lib.rs:120:5 for it",
            "/home/USER/src/lib.rs",
        );
        has("edit src/core/mod.rs now", "src/core/mod.rs");
        has("open ./scripts/run and ../x/y.py", "./scripts/run");
        has("open ./scripts/run and ../x/y.py", "../x/y.py");
        has("config in ~/.config/app.toml.", "~/.config/app.toml");
        has(
            r"copied to C:\Users\dev\proj\main.rs, then",
            r"C:\Users\dev\proj\main.rs",
        );
        has("bump Cargo.toml and README.md", "Cargo.toml");
        has("bump Cargo.toml and README.md", "README.md");
        has("the file test_schema.py fails", "test_schema.py");
        lacks("this and/or that, 1/2 of it", "and/or");
        lacks("call response.json() then", "response.json");
        lacks("e.g. this", "e.g");
    }

    #[test]
    fn finds_urls_without_trailing_punctuation() {
        has(
            "see https://github.com/org/repo/pull/42.",
            "https://github.com/org/repo/pull/42",
        );
        has(
            "(docs: https://en.wikipedia.org/wiki/Foo_(bar)).",
            "https://en.wikipedia.org/wiki/Foo_(bar)",
        );
        // The path inside the URL is not reported again.
        let got = ids("at https://example.com/a/b.html here");
        assert_eq!(got, vec!["https://example.com/a/b.html".to_string()]);
    }

    #[test]
    fn finds_hashes_and_uuids() {
        has("commit 3ea751c0 fixed it", "3ea751c0");
        has(
            "at 3ea751c087f32b16e039a2233dd6eefecef325d5",
            "3ea751c087f32b16e039a2233dd6eefecef325d5",
        );
        let sha256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        has(&format!("digest sha256:{sha256}"), sha256);
        has(
            "session fa812bfe-b295-4cca-9c2f-fdf01028cb46 ended",
            "fa812bfe-b295-4cca-9c2f-fdf01028cb46",
        );
        lacks("we defaced the facade", "defaced");
        lacks("in 1234567 cases", "1234567");
    }

    #[test]
    fn finds_addresses_hosts_and_ports() {
        has("bind 192.168.1.10:8080 ok", "192.168.1.10:8080");
        has("cidr 10.0.0.0/8", "10.0.0.0/8");
        has("ipv6 [2001:db8::1]:443 up", "[2001:db8::1]:443");
        has("ping fe80::1 and ::1", "fe80::1");
        has("connect to db.internal:5432 failed", "db.internal:5432");
        has("serve on localhost:3000", "localhost:3000");
        has("call api.example.com please", "api.example.com");
        has("listening on port 8080", "8080");
        has("listening on :9090 now", ":9090");
        lacks("at 10:30:00 we met", "10:30:00");
        lacks("use crate::db::add and de::Error", "db::add");
        lacks("see lib.rs:120", "lib.rs:120");
        lacks("self.config is set", "self.config");
        lacks("port 99999", "99999");
    }

    #[test]
    fn finds_error_codes() {
        has("error[E0308]: mismatched types", "E0308");
        has("open failed: ENOENT", "ENOENT");
        has("got HTTP 404 from it", "HTTP 404");
        has(
            "returned 503 Service Unavailable",
            "503 Service Unavailable",
        );
        has("raised ValueError: bad", "ValueError");
        has("ruff: F401 unused import", "F401");
        has("process exited with code 137", "exited with code 137");
        has("killed by SIGKILL", "SIGKILL");
        lacks("the END of EXAMPLE", "EXAMPLE");
        lacks("an Error occurred", "Error");
    }

    #[test]
    fn finds_tickets_versions_dates_and_machine_ids() {
        has("fixes #1234 and org/repo#56", "#1234");
        has("fixes #1234 and org/repo#56", "org/repo#56");
        has("see PROJ-123 first", "PROJ-123");
        has("patch CVE-2024-3094 now", "CVE-2024-3094");
        has("bump to v1.2.3-rc.1", "v1.2.3-rc.1");
        has("python 3.11.4 installed", "3.11.4");
        has("flight on 2024-05-17 leaves", "2024-05-17");
        has("user mia_li_3668 booked HAT136", "mia_li_3668");
        has("user mia_li_3668 booked HAT136", "HAT136");
        has("reservation 4WQ150 changed", "4WQ150");
        has("tool call toolu_01XyZabc9 done", "toolu_01XyZabc9");
        lacks("encoded as UTF-8 or UTF-16", "UTF-16");
        lacks("hash with SHA-256", "SHA-256");
        lacks("item #1 is first", "#1");
        lacks("pi is 3.14 roughly", "3.14");
    }

    #[test]
    fn ignores_plain_prose_and_small_numbers() {
        let got = ids("The quick brown fox jumped over 3 lazy dogs in 2 minutes, twice.");
        assert!(got.is_empty(), "{got:?}");
    }

    #[test]
    fn unique_in_first_appearance_order() {
        let got = ids("src/b.rs then src/a.rs then src/b.rs again, #42 and #42");
        assert_eq!(got, vec!["src/b.rs", "src/a.rs", "#42"]);
    }

    #[test]
    fn handles_unicode_text() {
        has("日本語のテキスト src/lib.rs を編集 ✓ café", "src/lib.rs");
        has("ошибка E0308 в файле ./main.rs", "./main.rs");
        let got = ids("ünïcödé ✓ 日本語 — no identifiers here");
        assert!(got.is_empty(), "{got:?}");
    }

    #[test]
    fn keeps_dotted_numeric_oids_whole() {
        // A real model's source (issue 14): the transfer syntax UID.
        let got = extract_with_kinds("transfer syntax 1.2.840.10008.1.2.1 is not supported.");
        assert_eq!(
            got,
            vec![Identifier {
                kind: IdentifierKind::Oid,
                text: "1.2.840.10008.1.2.1".into()
            }],
        );
        lacks("syntax 1.2.840.10008.1.2.1 here", "1.2.840");
        lacks("syntax 1.2.840.10008.1.2.1 here", "10008.1.2");
        // An address and a version beside it keep their kinds.
        let got = extract_with_kinds("at 10.0.0.1:80 with 1.2.3 and 1.2.840.113619.2.55");
        let kinds: Vec<_> = got.iter().map(|i| (i.kind, i.text.as_str())).collect();
        assert_eq!(
            kinds,
            vec![
                (IdentifierKind::IpAddress, "10.0.0.1:80"),
                (IdentifierKind::Version, "1.2.3"),
                (IdentifierKind::Oid, "1.2.840.113619.2.55"),
            ]
        );
    }

    #[test]
    fn kinds_are_reported() {
        let got = extract_with_kinds("see https://x.io/a and src/a.rs at 1.2.3.4:80");
        let kinds: Vec<_> = got.iter().map(|i| i.kind).collect();
        assert_eq!(
            kinds,
            vec![
                IdentifierKind::Url,
                IdentifierKind::Path,
                IdentifierKind::IpAddress
            ]
        );
    }
}
