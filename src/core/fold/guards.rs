//! The duplicate and flood guards' view of a turn's text: a cheap sketch,
//! then the digest of its normalized text when the sketches match, without
//! reading the text at all when no seen turn could be identical.

use super::*;

/// The turn being folded as the duplicate and flood guards see it. Nothing
/// of its text is read unless a seen turn could be identical: its sketch is
/// computed when there is one to compare with, its digest only when the
/// sketches match (or its length is in doubt).
pub(super) struct Probe<'m> {
    msg: &'m ChatMessage,
    sketch: Option<u64>,
    digest: Option<(IdDigest, usize)>,
}

impl<'m> Probe<'m> {
    pub(super) fn new(msg: &'m ChatMessage) -> Self {
        Probe {
            msg,
            sketch: None,
            digest: None,
        }
    }

    pub(super) fn sketch(&mut self) -> u64 {
        *self
            .sketch
            .get_or_insert_with(|| turn_sketch(self.msg).value)
    }

    pub(super) fn digest(&mut self) -> (IdDigest, usize) {
        *self.digest.get_or_insert_with(|| turn_digest(self.msg))
    }

    /// Whether its normalized text has at least `min` characters: its
    /// count of ASCII graphic characters is a lower bound, the bytes of
    /// the text it normalizes an upper bound; only between the two is
    /// the text normalized (and digested) to count.
    pub(super) fn normalized_chars_at_least(&mut self, min: usize) -> bool {
        graphic_at_least(self.msg, min)
            || (searchable_bytes(self.msg) >= min && self.digest().1 >= min)
    }

    /// Whether it is identical to `seen` (same digest), a turn of `turns`
    /// whose body is in `bodies` (they keep every body a seen turn needs).
    /// Computes (and keeps) `seen`'s sketch and digest only when needed:
    /// a seen turn of another role, or a result for another call, differs
    /// in what the digest hashes before its text, so neither text is read
    /// (in a burst of tool calls and results, most pairs are such).
    #[inline]
    pub(super) fn same_as(
        &mut self,
        seen: &mut SeenTurn,
        turns: &[Turn],
        bodies: &ResidentBodies,
    ) -> bool {
        // Both sketches known (ours is, once one seen turn was compared):
        // most pairs differ here, in the caller's loop, without reading
        // `seen`'s turn. A duplicate guard's window holds a minute of a
        // conversation's user turns, each compared with every new one (on
        // the ingest bench's turns, 8.2M comparisons, of which 0.4M get
        // past this check: twenty-ninth pass).
        if let (Some(theirs), Some(ours)) = (seen.sketch, self.sketch) {
            if theirs != ours {
                return false;
            }
        }
        self.same_as_read(seen, turns, bodies)
    }

    /// [`Probe::same_as`] past the sketches known to both.
    #[inline(never)]
    fn same_as_read(
        &mut self,
        seen: &mut SeenTurn,
        turns: &[Turn],
        bodies: &ResidentBodies,
    ) -> bool {
        let theirs = match seen.digest {
            SeenDigest::Known(d) => d,
            SeenDigest::Of(seq) if !self.may_equal(turns.get(seq as usize)) => return false,
            // Its sketch is known once it was compared: no body is looked
            // up to tell most pairs apart (a duplicate guard compares each
            // long user turn with every one of the window's).
            SeenDigest::Of(_) if seen.sketch.is_some_and(|s| s != self.sketch()) => return false,
            SeenDigest::Of(seq) => match bodies.get(seq) {
                Some(body) => {
                    let msg = &body.message;
                    let sketch = *seen.sketch.get_or_insert_with(|| turn_sketch(msg).value);
                    if sketch != self.sketch() {
                        return false;
                    }
                    let d = turn_digest(msg).0;
                    seen.digest = SeenDigest::Known(d);
                    d
                }
                None => match bodies.guard(seq) {
                    // Its body is in a store: what `guard_read` took of it.
                    Some((_, sketch, d)) => {
                        let sketch = *seen.sketch.get_or_insert(sketch);
                        if sketch != self.sketch() {
                            return false;
                        }
                        seen.digest = SeenDigest::Known(d);
                        d
                    }
                    // Never so: a seen turn's body is kept or what it reads is.
                    None => return false,
                },
            },
        };
        if seen.sketch.is_some_and(|s| s != self.sketch()) {
            return false;
        }
        theirs == self.digest().0
    }

    /// Whether the digests may be equal by what a folded turn keeps: its
    /// role, and for a tool result the digest of the call id it answers
    /// (which the digest hashes whole). `None`: not known, so they may.
    fn may_equal(&self, turn: Option<&Turn>) -> bool {
        let Some(turn) = turn else {
            return true;
        };
        if turn.role != self.msg.role {
            return false;
        }
        match (turn.result_for(), self.msg.tool_call_id.as_deref()) {
            (Some(theirs), Some(ours)) if turn.role == Role::Tool => theirs == call_digest(ours),
            _ => true,
        }
    }

    /// How it is remembered once it is turn `seq`.
    pub(super) fn seen(&self, seq: u64) -> SeenTurn {
        SeenTurn {
            sketch: self.sketch,
            digest: match self.digest {
                Some((d, _)) => SeenDigest::Known(d),
                None => SeenDigest::Of(seq),
            },
        }
    }
}

/// What the duplicate and flood guards read of a turn's body: its sketch
/// and its digest, kept when the body leaves memory.
pub fn guard_read(body: &TurnBody) -> (u64, IdDigest) {
    (
        turn_sketch(&body.message).value,
        turn_digest(&body.message).0,
    )
}

/// Whether `msg`'s text (as [`turn_digest`] normalizes it) has at least
/// `min` ASCII graphic bytes; reads no further than it takes to know.
pub(super) fn graphic_at_least(msg: &ChatMessage, min: usize) -> bool {
    let mut left = min;
    let mut take = |text: &str| {
        for block in text.as_bytes().chunks(64) {
            if left == 0 {
                return;
            }
            let n = block.iter().filter(|b| b.is_ascii_graphic()).count();
            left = left.saturating_sub(n);
        }
    };
    match &msg.content {
        None => {}
        Some(Content::Text(t)) => take(t),
        Some(Content::Parts(parts)) => {
            for t in parts.iter().filter_map(|p| p.text.as_deref()) {
                take(t);
            }
        }
    }
    for call in &msg.tool_calls {
        take(&call.function.name);
        take(&call.function.arguments);
        take("()");
    }
    left == 0
}

/// The bytes of the text [`turn_digest`] normalizes (with its separators),
/// or more: an upper bound of the normalized text's characters, since a
/// byte becomes at most one character (whitespace runs collapse to one
/// space, and the one character whose lowercase is two, `İ`, takes two
/// bytes: `tests::no_char_lowercases_to_more_chars_than_its_bytes`).
pub(super) fn searchable_bytes(msg: &ChatMessage) -> usize {
    let text = match &msg.content {
        None => 0,
        Some(Content::Text(t)) => t.len(),
        Some(Content::Parts(parts)) => parts
            .iter()
            .filter_map(|p| p.text.as_deref())
            .map(|t| t.len() + 1)
            .sum(),
    };
    let calls: usize = msg
        .tool_calls
        .iter()
        .map(|c| c.function.name.len() + c.function.arguments.len() + 3)
        .sum();
    text + calls
}

/// A cheap function of what [`turn_digest`] hashes (role, tool call id and
/// normalized text): identical turns have the same sketch, so turns with
/// different sketches need no digest to be told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TurnSketch {
    value: u64,
    /// ASCII graphic characters (`!`..=`~`) of the normalized text: a lower
    /// bound of its length in characters.
    pub(super) text_graphic: usize,
}

/// The sketch is the role and the count, sum and sum of low nibbles of the
/// ASCII graphic bytes (`!`..=`~`) of the digested stream after the role.
/// Normalizing keeps those bytes and their order: whitespace is dropped or
/// becomes a space (not graphic), ASCII letters are lowercased, and of the
/// other characters only `K` (U+212A KELVIN SIGN) and `İ` (U+0130) lowercase
/// to anything ASCII (`k`; `i` and a combining dot), as
/// `tests::only_kelvin_and_dotted_i_lowercase_into_ascii` checks over every
/// char. So the sums are taken over the raw text, letters folded, plus those
/// two characters as the letters they become; the tool call id, hashed as
/// it is, is summed as it is.
pub(super) fn turn_sketch(msg: &ChatMessage) -> TurnSketch {
    let mut text = GraphicSums::default();
    match &msg.content {
        None => {}
        Some(Content::Text(t)) => text.add_text(t),
        Some(Content::Parts(parts)) => {
            for t in parts.iter().filter_map(|p| p.text.as_deref()) {
                text.add_text(t);
            }
        }
    }
    for call in &msg.tool_calls {
        text.add_text(&call.function.name);
        text.add_text("(");
        text.add_text(&call.function.arguments);
        text.add_text(")");
    }
    let text_graphic = text.count as usize;
    let mut all = text;
    all.add_bytes(msg.tool_call_id.as_deref().unwrap_or("").as_bytes(), false);
    let role = match msg.role {
        Role::System => 0,
        Role::User => 1,
        Role::Assistant => 2,
        Role::Tool => 3,
    };
    let h = mix(role ^ (u64::from(all.count) << 8));
    let h = mix(h ^ (u64::from(all.sum) << 32 | u64::from(all.nibbles)));
    TurnSketch {
        value: h,
        text_graphic,
    }
}

/// SplitMix64's finalizer.
pub(super) fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Count, sum and sum of low nibbles of ASCII graphic bytes (wrapping).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct GraphicSums {
    count: u32,
    sum: u32,
    nibbles: u32,
}

impl GraphicSums {
    /// Text as it normalizes: letters lowercased, `K` and `İ` as `k`, `i`.
    pub(super) fn add_text(&mut self, text: &str) {
        if self.add_bytes(text.as_bytes(), true) {
            for (c, ascii) in [('\u{212A}', b'k'), ('\u{130}', b'i')] {
                let n = text.matches(c).count() as u32;
                self.count = self.count.wrapping_add(n);
                self.sum = self.sum.wrapping_add(n.wrapping_mul(u32::from(ascii)));
                self.nibbles = self
                    .nibbles
                    .wrapping_add(n.wrapping_mul(u32::from(ascii & 15)));
            }
        }
    }

    /// Adds `bytes` (lowercased when `fold`); whether any is not ASCII.
    pub(super) fn add_bytes(&mut self, bytes: &[u8], fold: bool) -> bool {
        let mut high = 0u8;
        // 16-bit sums over chunks short enough not to overflow (at most
        // 256 × 126): the loop vectorizes with SSE2's 16-bit lanes. All sums
        // are modulo 2^32 in the end, so any split of the same bytes
        // (chunks, pieces) adds up to the same sketch.
        for chunk in bytes.chunks(256) {
            let (mut count, mut sum, mut nibbles) = (0u16, 0u16, 0u16);
            for &b in chunk {
                high |= b;
                let upper = fold & (b.wrapping_sub(b'A') < 26);
                let f = b | (u8::from(upper) << 5);
                let graphic = b.wrapping_sub(b'!') < 94;
                let v = if graphic { f } else { 0 };
                count += u16::from(graphic);
                sum += u16::from(v);
                nibbles += u16::from(v & 15);
            }
            self.count = self.count.wrapping_add(u32::from(count));
            self.sum = self.sum.wrapping_add(u32::from(sum));
            self.nibbles = self.nibbles.wrapping_add(u32::from(nibbles));
        }
        high >= 0x80
    }
}

/// The digest duplicate detection and the flood guard compare turns by:
/// blake3 of `role \0 tool_call_id \0 normalized text`, where the text is
/// [`ChatMessage::searchable_text`] whitespace-collapsed and case-folded.
/// Streamed into the hasher (no intermediate strings), with the number of
/// characters of the normalized text; the same bytes as building the
/// strings would hash.
pub(super) fn turn_digest(msg: &ChatMessage) -> (IdDigest, usize) {
    thread_local! {
        // Reused: zeroing a fresh 8 KB buffer for every turn showed in profiles.
        static SCRATCH: RefCell<Box<[u8; Normalizer::BUF]>> =
            RefCell::new(Box::new([0; Normalizer::BUF]));
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => digest_with(msg, &mut buf),
        // Only reentrancy could get here; a fresh buffer hashes the same.
        Err(_) => digest_with(msg, &mut Box::new([0; Normalizer::BUF])),
    })
}

pub(super) fn digest_with(msg: &ChatMessage, buf: &mut [u8; Normalizer::BUF]) -> (IdDigest, usize) {
    let mut n = Normalizer::new(buf);
    n.hasher.update(msg.role.as_str().as_bytes());
    n.hasher.update(&[0]);
    n.hasher
        .update(msg.tool_call_id.as_deref().unwrap_or("").as_bytes());
    n.hasher.update(&[0]);
    // The pieces of `searchable_text`, with its newline separators.
    match &msg.content {
        None => {}
        Some(Content::Text(t)) => n.raw(t),
        Some(Content::Parts(parts)) => {
            for text in parts.iter().filter_map(|p| p.text.as_deref()) {
                if n.raw_len > 0 {
                    n.raw("\n");
                }
                n.raw(text);
            }
        }
    }
    for call in &msg.tool_calls {
        if n.raw_len > 0 {
            n.raw("\n");
        }
        n.raw(&call.function.name);
        n.raw("(");
        n.raw(&call.function.arguments);
        n.raw(")");
    }
    n.finish()
}

/// Whitespace-collapsing, case-folding writer into a blake3 hasher.
pub(super) struct Normalizer<'b> {
    hasher: blake3::Hasher,
    buf: &'b mut [u8; Normalizer::BUF],
    len: usize,
    /// Bytes of raw text seen (for `searchable_text`'s separators).
    raw_len: usize,
    /// Characters written.
    chars: usize,
    /// A word was written and whitespace followed it.
    space: bool,
}

impl<'b> Normalizer<'b> {
    /// Large enough for blake3 to hash several chunks at once.
    const BUF: usize = 8192;

    pub(super) fn new(buf: &'b mut [u8; Normalizer::BUF]) -> Self {
        Normalizer {
            hasher: blake3::Hasher::new(),
            buf,
            len: 0,
            raw_len: 0,
            chars: 0,
            space: false,
        }
    }

    pub(super) fn raw(&mut self, text: &str) {
        self.raw_len += text.len();
        // Locals, not fields, in the loop: the compiler keeps them in
        // registers instead of storing them after every byte.
        let Normalizer {
            hasher,
            buf,
            len,
            chars,
            space,
            ..
        } = self;
        let (mut len, mut chars, mut space) = (*len, *chars, *space);
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            // Room for a space and a lowercase expansion (at most 3 chars).
            if len + 16 > Normalizer::BUF {
                hasher.update(&buf[..len]);
                len = 0;
            }
            if let Some(word) = bytes.get(i..i + 8) {
                let x = u64::from_le_bytes(word.try_into().unwrap_or([0; 8]));
                if let Some(lower) = plain_words(x) {
                    // Eight bytes of words with single spaces between them:
                    // their normalized form is themselves, lowercased.
                    if space {
                        buf[len] = b' ';
                        len += 1;
                        chars += 1;
                        space = false;
                    }
                    buf[len..len + 8].copy_from_slice(&lower.to_le_bytes());
                    len += 8;
                    chars += 8;
                    i += 8;
                    continue;
                }
            }
            let b = bytes[i];
            let c = if b.is_ascii() {
                i += 1;
                // `char::is_whitespace` in ASCII: \t \n \x0B \x0C \r and space.
                if b == b' ' || (b'\t'..=b'\r').contains(&b) {
                    space = chars > 0;
                    continue;
                }
                None
            } else {
                // `i` is on a char boundary: only whole chars are skipped.
                let Some(c) = text[i..].chars().next() else {
                    break;
                };
                i += c.len_utf8();
                if c.is_whitespace() {
                    space = chars > 0;
                    continue;
                }
                Some(c)
            };
            if space {
                buf[len] = b' ';
                len += 1;
                chars += 1;
                space = false;
            }
            match c {
                None => {
                    buf[len] = b.to_ascii_lowercase();
                    len += 1;
                    chars += 1;
                }
                Some(c) => {
                    for l in c.to_lowercase() {
                        len += l.encode_utf8(&mut buf[len..]).len();
                        chars += 1;
                    }
                }
            }
        }
        (self.len, self.chars, self.space) = (len, chars, space);
    }

    pub(super) fn finish(mut self) -> (IdDigest, usize) {
        self.hasher.update(&self.buf[..self.len]);
        let hash = self.hasher.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&hash.as_bytes()[..16]);
        (out, self.chars)
    }
}

/// Eight bytes (little endian) that normalize to themselves lowercased:
/// printable ASCII, no space first or last, no two spaces in a row. Returns
/// them lowercased; `None` sends the caller byte by byte.
pub(super) fn plain_words(x: u64) -> Option<u64> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // Any byte >= 0x80 (not ASCII) or < 0x20 (tab, newline, controls)?
    let below_space = x.wrapping_sub(0x20 * ONES) & !x & HIGH;
    if (x & HIGH) | below_space != 0 {
        return None;
    }
    // High bit of each byte that is a space (exact: no borrows).
    let y = x ^ (0x20 * ONES);
    let spaces = !(((y & !HIGH) + !HIGH) | y) & HIGH;
    let first_or_last = 0x80 | (0x80 << 56);
    if spaces & first_or_last != 0 || spaces & (spaces >> 8) != 0 {
        return None;
    }
    // Bytes in 'A'..='Z' (all bytes are ASCII: no carries between bytes).
    let at_least_a = x + (0x80 - u64::from(b'A')) * ONES;
    let above_z = x + (0x7f - u64::from(b'Z')) * ONES;
    let upper = at_least_a & !above_z & HIGH;
    Some(x | (upper >> 2))
}

/// Whitespace-collapsed, case-folded text: the reference [`turn_digest`]
/// is checked against.
#[cfg(test)]
pub(super) fn normalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.extend(word.chars().flat_map(char::to_lowercase));
    }
    out
}
