//! What the fold measures of a turn, measured ahead of it: the turn's
//! token count and, for a long tool result, the line its masked rendering
//! quotes. Both are pure functions of the turn and the encoding, and the
//! two costliest steps of folding a turn (a tokenizer pass over its text,
//! a pattern scan of its output), so a runtime may compute them on another
//! core while the fold works on the turns before ([`crate::runtime::embedded`]
//! does, for `run`).
//!
//! A measure is only a shortcut: the fold uses it when it was taken under
//! the encoding the conversation counts in, and measures the turn itself
//! otherwise, so a stale or missing measure changes nothing but the time.

use crate::core::mask;
use crate::core::message::ChatMessage;
use crate::core::summary::SourceReading;
use crate::core::tokens::{self, Encoding};
use std::sync::Arc;

/// A turn measured ahead of the fold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnMeasure {
    /// The encoding `tokens` was counted in.
    pub encoding: Encoding,
    /// [`tokens::count_message`] of the turn.
    pub tokens: u64,
    /// [`mask::telling_line`] of the output a masked rendering would stand
    /// for (`None`: the turn has no such output, or it was not measured).
    pub telling: Option<String>,
    /// What a summarizer reads of the turn, with the turn's event id, when
    /// it was read ahead too ([`SourceReading`]; the fold does not use it,
    /// its runtime hands it to the turn's drafts).
    pub reading: Option<(Box<str>, Arc<SourceReading>)>,
}

impl TurnMeasure {
    /// Measures `msg` as the fold would under `encoding`.
    pub fn of(encoding: Encoding, msg: &ChatMessage) -> TurnMeasure {
        TurnMeasure {
            encoding,
            tokens: tokens::count_message(encoding, msg),
            telling: mask::output_to_mask(msg).map(|text| mask::telling_line(&text)),
            reading: None,
        }
    }

    /// The token count, when it was taken under `encoding`.
    pub fn tokens_in(&self, encoding: Encoding) -> Option<u64> {
        (self.encoding == encoding).then_some(self.tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::{ChatMessage, Role};

    fn tool_result(text: &str) -> ChatMessage {
        let mut m = ChatMessage::text(Role::Tool, text);
        m.tool_call_id = Some("call_1".into());
        m.name = Some("Bash".into());
        m
    }

    #[test]
    fn a_measure_is_what_the_fold_would_count_and_quote() {
        let long = format!(
            "{}\nerror[E0308]: mismatched types\n{}",
            "compiling crate\n".repeat(30),
            "note: see above\n".repeat(30)
        );
        let msg = tool_result(&long);
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            let m = TurnMeasure::of(encoding, &msg);
            assert_eq!(m.tokens, tokens::count_message(encoding, &msg));
            assert_eq!(m.tokens_in(encoding), Some(m.tokens));
            assert_eq!(
                m.telling.as_deref(),
                Some(mask::telling_line(&long).as_str())
            );
            assert_eq!(
                mask::masked_told(&msg, 7, m.telling.as_deref()),
                mask::masked(&msg, 7)
            );
        }
        let m = TurnMeasure::of(Encoding::O200kBase, &msg);
        assert_eq!(m.tokens_in(Encoding::Cl100kBase), None);
    }

    #[test]
    fn only_a_long_tool_result_has_a_telling_line() {
        let short = tool_result("ok");
        assert_eq!(TurnMeasure::of(Encoding::O200kBase, &short).telling, None);
        let user = ChatMessage::text(Role::User, "please fix the build\n".repeat(40));
        assert_eq!(TurnMeasure::of(Encoding::O200kBase, &user).telling, None);
    }
}
