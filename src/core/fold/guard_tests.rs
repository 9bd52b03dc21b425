//! The duplicate and flood guards' sketch pre-filter decides exactly as
//! comparing every turn's digest did.

use super::*;
use crate::core::message::{ContentPart, FunctionCall, ToolCall};
use proptest::prelude::*;

/// The reference: every turn's digest, compared as the guards first did.
#[derive(Default)]
struct Reference {
    second: u64,
    counts: Vec<(IdDigest, u32)>,
    recent: Vec<(u64, IdDigest)>,
}

impl Reference {
    /// `Err(reason)` for a rejected turn, else whether it stays in context.
    fn decide(&mut self, p: &PolicyConfig, msg: &ChatMessage, time: u64) -> Result<bool, String> {
        let (digest, chars) = turn_digest(msg);
        let second = time / 1000;
        if self.second != second {
            self.second = second;
            self.counts.clear();
        }
        let count = match self.counts.iter_mut().find(|(d, _)| *d == digest) {
            Some((_, c)) => {
                *c += 1;
                *c
            }
            None => {
                self.counts.push((digest, 1));
                1
            }
        };
        let limit = if msg.role == Role::User {
            p.flood_max_user_per_second
        } else {
            p.flood_max_other_per_second
        };
        if count > limit {
            return Err(format!(
                "replay flood: {count} identical {} turns within one second (limit {limit})",
                msg.role.as_str()
            ));
        }
        if msg.role == Role::User && chars >= p.duplicate_min_chars {
            let window = p.duplicate_window_ms;
            self.recent
                .retain(|(t, _)| time.saturating_sub(*t) <= window);
            if self.recent.iter().any(|(_, d)| *d == digest) {
                return Ok(false);
            }
            self.recent.push((time, digest));
        }
        Ok(true)
    }
}

/// Every char: what its normalized form holds of ASCII graphic bytes is
/// itself lowercased, or `k` for the Kelvin sign, `i` for `İ`, or nothing.
#[test]
fn only_kelvin_and_dotted_i_lowercase_into_ascii() {
    for c in (0..=0x10FFFFu32).filter_map(char::from_u32) {
        let normalized = normalize(&c.to_string());
        let graphic: Vec<u8> = normalized
            .bytes()
            .filter(|b| b.is_ascii_graphic())
            .collect();
        let expected: Vec<u8> = match c {
            '\u{212A}' => vec![b'k'],
            '\u{130}' => vec![b'i'],
            c if c.is_ascii_graphic() => vec![c.to_ascii_lowercase() as u8],
            _ => vec![],
        };
        assert_eq!(graphic, expected, "{c:?} (U+{:04X})", c as u32);
    }
}

/// `msg` with one tool call of `name` and `arguments`.
fn with_call(mut msg: ChatMessage, name: &str, arguments: &str) -> ChatMessage {
    msg.tool_calls = vec![ToolCall {
        id: "c1".into(),
        kind: "function".into(),
        function: FunctionCall {
            name: name.into(),
            arguments: arguments.into(),
        },
    }];
    msg
}

/// What makes `searchable_bytes` an upper bound of the normalized length.
#[test]
fn no_char_lowercases_to_more_chars_than_its_bytes() {
    for c in (0..=0x10FFFFu32).filter_map(char::from_u32) {
        assert!(
            c.to_lowercase().count() <= c.len_utf8(),
            "{c:?} (U+{:04X})",
            c as u32
        );
    }
}

/// The normalized length never exceeds `searchable_bytes`, whatever the
/// shape: parts, tool calls, whitespace, case.
#[test]
fn searchable_bytes_bound_the_normalized_length() {
    let calls = with_call(
        ChatMessage::text(Role::Assistant, "İİ  K\n x"),
        "İ",
        "{ \"a\":  1 }",
    );
    for msg in [
        ChatMessage::text(Role::User, ""),
        ChatMessage::text(Role::User, "Check file 12."),
        ChatMessage::text(Role::User, "İİİİ"),
        ChatMessage::text(Role::User, "  a \t\n b  "),
        calls,
    ] {
        let (_, chars) = turn_digest(&msg);
        assert!(chars <= searchable_bytes(&msg), "{msg:?}: {chars}");
    }
}

proptest! {
    #[test]
    fn searchable_bytes_bound_any_text(text in any::<String>(), args in any::<String>()) {
        let msg = with_call(ChatMessage::text(Role::User, text), "f", &args);
        let (_, chars) = turn_digest(&msg);
        prop_assert!(chars <= searchable_bytes(&msg));
    }
}

/// Spellings that normalize the same: case, whitespace, the Kelvin sign and
/// the dotted capital I.
fn respell(text: &str, choices: &[u8]) -> String {
    let mut out = String::new();
    let mut n = 0;
    let mut pick = |k: u8| {
        n += 1;
        choices.get(n % choices.len().max(1)).copied().unwrap_or(0) % k
    };
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_whitespace() {
            while chars.peek().is_some_and(|c| c.is_whitespace()) {
                chars.next();
            }
            out.push_str([" ", "  ", "\t", "\n", "\u{3000}", "\r\n "][pick(6) as usize]);
        } else if c == 'k' && pick(2) == 0 {
            out.push('\u{212A}');
        } else if c == 'i' && chars.peek() == Some(&'\u{307}') && pick(2) == 0 {
            chars.next();
            out.push('\u{130}');
        } else if c.is_ascii_lowercase() && pick(2) == 0 {
            out.push(c.to_ascii_uppercase());
        } else {
            out.push(c);
        }
    }
    if pick(2) == 0 {
        out.insert(0, ' ');
    }
    out
}

/// Texts that share sketches without being identical (anagrams), or are
/// identical once normalized, or differ only in places.
fn base_text() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "please change my flight to tomorrow morning",
        "please change my flight to morning tomorrow",
        "Please change my flight to tomorrow morning!",
        "ok",
        "ok thanks",
        "the kelvin sign k and i\u{307} dotted",
        "the kelvin sign K and I\u{307} dotted",
        "日本語のテキストです、十分に長い文章を書きます",
        "{\"path\":\"src/main.rs\",\"line\":12}",
        "{\"line\":12,\"path\":\"src/main.rs\"}",
        "abc def ghi jkl mno pqr stu vwx",
        "cba fed ihg lkj onm rqp uts xwv",
        "",
    ])
    .prop_map(String::from)
}

fn variant_message() -> impl Strategy<Value = ChatMessage> {
    (
        0usize..3,
        base_text(),
        prop::collection::vec(any::<u8>(), 1..8),
        0usize..3,
        prop::option::of(prop::sample::select(vec!["call_1", "call_2"])),
    )
        .prop_map(|(role, text, choices, shape, call_id)| {
            let role = [Role::User, Role::Assistant, Role::System][role];
            let spelled = respell(&text, &choices);
            let mut msg = ChatMessage::text(role, "");
            msg.tool_call_id = call_id.map(String::from);
            match shape {
                // Plain text.
                0 => msg.content = Some(Content::Text(spelled)),
                // Parts (joined by a newline, which normalizes as a space).
                1 => {
                    let half = spelled.len() / 2;
                    let (a, b) = if spelled.is_char_boundary(half) {
                        let (a, b) = spelled.split_at(half);
                        (a.to_string(), b.to_string())
                    } else {
                        (spelled, String::new())
                    };
                    msg.content = Some(Content::Parts(
                        [a, b]
                            .into_iter()
                            .map(|t| ContentPart {
                                kind: "text".into(),
                                text: Some(t),
                                other: Default::default(),
                            })
                            .collect(),
                    ));
                }
                // A tool call.
                _ => {
                    msg.content = None;
                    msg.tool_calls = vec![ToolCall {
                        id: "c".into(),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: "Read".into(),
                            arguments: spelled,
                        },
                    }];
                }
            }
            msg
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// Turns with the same digest have the same sketch, and the graphic
    /// counts never exceed the normalized length.
    #[test]
    fn identical_turns_share_their_sketch(a in variant_message(), b in variant_message()) {
        let (da, ca) = turn_digest(&a);
        let (db, _) = turn_digest(&b);
        let (sa, sb) = (turn_sketch(&a), turn_sketch(&b));
        if da == db {
            prop_assert_eq!(sa, sb);
        }
        prop_assert!(sa.text_graphic <= ca);
        for min in [0, 1, 5, 24, 40] {
            // A lower bound, exact for ASCII text.
            if graphic_at_least(&a, min) {
                prop_assert!(ca >= min);
            }
            if turn_digest(&a).1 == a.searchable_text().len() {
                let graphic = a.searchable_text().bytes().filter(u8::is_ascii_graphic).count();
                prop_assert_eq!(graphic_at_least(&a, min), graphic >= min);
            }
        }
    }

    /// Folding turns decides (rejections, reasons, duplicates kept out of
    /// context) exactly as the reference comparing every digest.
    #[test]
    fn guards_decide_as_comparing_every_digest(
        turns in prop::collection::vec((variant_message(), 0u64..4, any::<bool>()), 1..40),
        user_limit in 0u32..4,
        other_limit in 0u32..3,
        min_chars in prop::sample::select(vec![0usize, 3, 24, 40]),
        window in prop::sample::select(vec![0u64, 1_500, 60_000]),
    ) {
        let policy = PolicyConfig {
            flood_max_user_per_second: user_limit,
            flood_max_other_per_second: other_limit,
            duplicate_min_chars: min_chars,
            duplicate_window_ms: window,
            ..PolicyConfig::default()
        };
        let mut state = State::default();
        let mut reference = Reference::default();
        let mut time = 1_700_000_000_000u64;
        let half = turns.len() / 2;
        for (n, (msg, step, back)) in turns.into_iter().enumerate() {
            if n == half {
                // As the store persists and loads it: digests not computed
                // yet are computed after a reload too, from what
                // `guard_read` takes of the bodies the store reads back for
                // the turns the guards name (no body is resident then).
                let bytes = rmp_serde::to_vec_named(&state).expect("state serializes");
                let before = state.clone();
                state = rmp_serde::from_slice(&bytes).expect("state deserializes");
                for (key, conv) in state.conversations.iter_mut() {
                    let old = &before.conversations[key];
                    // Collected: the loop writes to `conv` the iterator borrows.
                    #[allow(clippy::needless_collect)]
                    let guarded: Vec<u64> = conv.guard_seqs().collect();
                    for seq in guarded {
                        let body = old.bodies.get(seq).expect("a guarded body");
                        let (sketch, digest) = super::guard_read(body);
                        conv.bodies.remember_guard(seq, sketch, digest);
                    }
                }
            }
            // Steps of nothing to a minute; now and then back in time.
            time = match (step, back) {
                (0, _) => time,
                (1, _) => time + 400,
                (2, true) => time - 1_200,
                (2, false) => time + 1_200,
                _ => time + 59_000,
            };
            let expected = reference.decide(&policy, &msg, time);
            let event = Envelope::new(
                format!("e{n}"),
                "c:guard",
                time,
                EventBody::TurnAppended(TurnAppended::from(msg)),
            );
            let outcome = fold(&mut state, &policy, &event);
            let conv = &state.conversations["c:guard"];
            match expected {
                Err(reason) => {
                    let FoldStatus::Rejected(rejection) = &outcome.status else {
                        return Err(TestCaseError::fail(format!("not rejected: {:?}", outcome.status)));
                    };
                    prop_assert_eq!(rejection.to_string(), reason);
                }
                Ok(in_context) => {
                    prop_assert_eq!(outcome.status, FoldStatus::Applied);
                    let turn = conv.turns.last().expect("the turn was kept");
                    prop_assert_eq!(turn.event, event_digest(&event.id));
                    prop_assert_eq!(&*conv.bodies.get(turn.seq).expect("its body").event_id, event.id.as_str());
                    prop_assert_eq!(turn.in_context, in_context);
                }
            }
        }
    }
}
