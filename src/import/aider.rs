//! Aider chat history markdown (`.aider.chat.history.md`).
//!
//! Every `# aider chat started at <time>` line starts a session, and every
//! session in which someone spoke to the model is one conversation
//! (`<stem>#<n>`, `n` counting the session headers before it, so text before
//! the first header is `#0`). A session with only console output (aider
//! started and quit) gives no conversation.
//!
//! - `#### ` lines are the user's input; consecutive ones are one user turn.
//! - `> ` lines are aider's console output (command echo, lint and test
//!   output, "Applied edit", commits). Aider has no tool calls, so a tool
//!   message would answer nothing: consecutive console lines become one
//!   `user` message named `console`, keeping what the session showed
//!   without inventing calls. `> Model: X`, `> Models: X ...` and
//!   `> Main model: X ...` also declare X as the session's model.
//! - Everything else is the assistant's reply (edits as SEARCH/REPLACE
//!   blocks included), up to the next user or console line.
//! - Trailing whitespace of `#### ` and `> ` lines (aider's markdown hard
//!   break) is removed; an Emacs mode line (`-*- ... -*-`) on the first
//!   line is not a turn.
//!
//! Aider writes the session start in local time without a zone; it is read
//! as UTC, and turns follow it one second apart.

use super::draft::Draft;
use super::timestamp::parse_iso8601;
use super::{ImportError, Source};
use crate::core::event::TurnAppended;
use crate::core::message::{ChatMessage, Role};

/// True when the text has an aider session header, or both user (`#### `)
/// and console (`> `) lines.
pub(crate) fn looks_like_aider(bytes: &[u8]) -> bool {
    let mut user = false;
    let mut console = false;
    for line in bytes.split(|b| *b == b'\n') {
        if line.starts_with(b"# aider chat started at") {
            return true;
        }
        user |= line.starts_with(b"#### ");
        console |= line.starts_with(b"> ");
    }
    user && console
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    User,
    Console,
    Assistant,
}

struct Session<'a> {
    draft: Draft,
    block: Option<Block>,
    lines: Vec<&'a str>,
    model: Option<String>,
    spoke: bool,
}

impl<'a> Session<'a> {
    fn new(index: usize, start_time: Option<u64>) -> Self {
        let mut draft = Draft::new(Some(index));
        draft.start_time = start_time;
        Session {
            draft,
            block: None,
            lines: Vec::new(),
            model: None,
            spoke: false,
        }
    }

    fn feed(&mut self, block: Block, text: &'a str) {
        if self.block != Some(block) {
            self.flush();
            self.block = Some(block);
        }
        self.lines.push(text);
    }

    fn blank(&mut self) {
        match self.block {
            Some(Block::Assistant) => self.lines.push(""),
            Some(Block::User | Block::Console) => {
                self.flush();
                self.block = None;
            }
            None => {}
        }
    }

    fn declare_model(&mut self, model: String) {
        self.draft.push_model(None, model.clone());
        self.model = Some(model);
    }

    fn flush(&mut self) {
        let Some(block) = self.block else {
            return;
        };
        let joined = self.lines.join("\n");
        self.lines.clear();
        let text = joined.trim_end().trim_start_matches(['\n', '\r']);
        if text.is_empty() {
            return;
        }
        let turn = match block {
            Block::User => TurnAppended::from(ChatMessage::text(Role::User, text)),
            Block::Console => {
                let mut m = ChatMessage::text(Role::User, text);
                m.name = Some("console".to_string());
                TurnAppended::from(m)
            }
            Block::Assistant => {
                let mut turn = TurnAppended::from(ChatMessage::text(Role::Assistant, text));
                turn.model = self.model.clone();
                turn
            }
        };
        if block != Block::Console {
            self.spoke = true;
        }
        self.draft.push_turn(None, turn);
    }

    fn finish_into(mut self, drafts: &mut Vec<Draft>) {
        self.flush();
        if self.spoke {
            drafts.push(self.draft);
        }
    }
}

pub(crate) fn parse(source: &Source<'_>) -> Result<Vec<Draft>, ImportError> {
    let text = std::str::from_utf8(source.bytes).map_err(|e| {
        let at = e.valid_up_to();
        let line = source.bytes[..at].iter().filter(|b| **b == b'\n').count() + 1;
        source.line_error(line, format!("invalid UTF-8 at byte {at}"))
    })?;
    let mut drafts = Vec::new();
    let mut headers = 0usize;
    let mut session = Session::new(0, None);
    for (i, raw) in text.split('\n').enumerate() {
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        if i == 0 && is_mode_line(line) {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# aider chat started at") {
            session.finish_into(&mut drafts);
            headers += 1;
            session = Session::new(headers, parse_iso8601(rest.trim()));
        } else if let Some(rest) = marked(line, "####") {
            session.feed(Block::User, rest);
        } else if let Some(rest) = marked(line, ">") {
            if let Some(model) = declared_model(rest) {
                session.declare_model(model);
            }
            session.feed(Block::Console, rest);
        } else if line.trim().is_empty() {
            session.blank();
        } else {
            session.feed(Block::Assistant, line);
        }
    }
    session.finish_into(&mut drafts);
    Ok(drafts)
}

/// The text after `mark` + space (or the empty text of a bare `mark`).
/// Trailing whitespace goes: aider appends a markdown hard break (two
/// spaces, more on empty lines) to every line it marks.
fn marked<'a>(line: &'a str, mark: &str) -> Option<&'a str> {
    let rest = line.strip_prefix(mark)?;
    if rest.is_empty() {
        return Some("");
    }
    Some(rest.strip_prefix(' ')?.trim_end())
}

fn is_mode_line(line: &str) -> bool {
    let t = line.trim();
    t.len() > 6 && t.starts_with("-*-") && t.ends_with("-*-")
}

/// The model of a `Model:` / `Models:` / `Main model:` console line.
fn declared_model(console: &str) -> Option<String> {
    let rest = ["Model: ", "Models: ", "Main model: "]
        .iter()
        .find_map(|p| console.strip_prefix(p))?;
    let token = rest.split_whitespace().next()?;
    let model =
        token.trim_end_matches(|c: char| !(c.is_ascii_alphanumeric() || "._/:@-".contains(c)));
    (!model.is_empty()).then(|| model.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::EventBody;
    use crate::import::{import_bytes, Format};

    const HISTORY: &str = "-*- mode: fundamental -*-\n\
> leftover output  \n\
\n\
# aider chat started at 2024-08-05 19:33:02\n\
\n\
> aider --lint  \n\
> Models: claude-3-5-sonnet-20240620 with diff edit format, weak model claude-3-haiku-20240307  \n\
\n\
# aider chat started at 2024-08-05 19:33:32\n\
\n\
> Main model: gpt-4o⚡ with diff edit format  \n\
\n\
#### Use the Spinner  \n\
#### ,  \n\
####   \n\
#### in utils.py  \n\
\n\
Certainly! Here's the change:\n\
\n\
aider/utils.py\n\
```python\n\
<<<<<<< SEARCH\n\
=======\n\
>>>>>>> REPLACE\n\
```\n\
\n\
> Applied edit to aider/utils.py  \n\
> Commit d0ffbf1 fix  \n\
\n\
#### thanks  \n";

    #[test]
    fn sessions_turns_and_console_output() {
        let convs = import_bytes(HISTORY.as_bytes(), Format::Aider, "chat-history.md").unwrap();
        // #0 (leftover console) and #1 (banner only) have no dialogue.
        assert_eq!(convs.len(), 1);
        let c = &convs[0];
        assert_eq!(c.conversation, "chat-history#2");
        let turns: Vec<_> = c
            .events
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::TurnAppended(t) => Some(t),
                _ => None,
            })
            .collect();
        let shape: Vec<(Role, Option<&str>)> = turns
            .iter()
            .map(|t| (t.message.role, t.message.name.as_deref()))
            .collect();
        assert_eq!(
            shape,
            [
                (Role::User, Some("console")),
                (Role::User, None),
                (Role::Assistant, None),
                (Role::User, Some("console")),
                (Role::User, None)
            ]
        );
        assert_eq!(
            turns[1].message.text_content(),
            "Use the Spinner\n,\n\nin utils.py"
        );
        assert!(turns[2].message.text_content().starts_with("Certainly!"));
        assert!(turns[2]
            .message
            .text_content()
            .ends_with(">>>>>>> REPLACE\n```"));
        assert_eq!(turns[2].model.as_deref(), Some("gpt-4o"));
        let EventBody::ModelDeclared(m) = &c.events[0].body else {
            panic!()
        };
        assert_eq!(m.model, "gpt-4o");
        // 2024-08-05 19:33:32 UTC.
        assert_eq!(c.events[0].time, 1_722_886_412_000);
    }

    #[test]
    fn detection_needs_a_header_or_both_markers() {
        assert!(looks_like_aider(b"# aider chat started at x\n"));
        assert!(looks_like_aider(b"#### hi\n> out\n"));
        assert!(!looks_like_aider(b"#### A heading\nprose\n"));
    }

    #[test]
    fn invalid_utf8_names_the_line() {
        let err = import_bytes(b"#### a\n> b\n\xff\n", Format::Aider, "h.md").unwrap_err();
        assert_eq!(err.line(), Some(3), "{err}");
    }
}
