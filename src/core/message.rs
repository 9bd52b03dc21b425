//! The OpenAI chat-message shape that agents publish as turns.
//!
//! Any framework can publish what it already has: `role`, `content` as text
//! or as parts, `tool_calls`, `tool_call_id`, `name`. Unknown part fields are
//! kept so a turn is returned exactly as it was published.

use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::BTreeMap;

/// Who spoke. Anything else is rejected with a clear reason when decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One chat message, as the OpenAI chat-completions API defines it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Message content: plain text or a list of typed parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One content part (`{"type":"text","text":"..."}`, `image_url`, ...).
/// Fields other than `type` and `text` are preserved verbatim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// An assistant's request to call a tool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".to_string()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

/// The `name` an importer gives a message its source marks as a
/// demonstration: an example of another task the harness shows the agent
/// (SWE-agent's `is_demo`), not this conversation's work. Summaries do not
/// report it as the task; the turn itself stays in the log.
pub const DEMONSTRATION_NAME: &str = "demonstration";

impl ChatMessage {
    /// Whether this is a demonstration of another task ([`DEMONSTRATION_NAME`]).
    pub fn is_demonstration(&self) -> bool {
        self.role != Role::Tool && self.name.as_deref() == Some(DEMONSTRATION_NAME)
    }

    pub fn text(role: Role, text: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: Some(Content::Text(text.into())),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// The message's text: the string content, or the text parts joined by
    /// newlines. Non-text parts contribute nothing.
    pub fn text_content(&self) -> String {
        self.text_view().into_owned()
    }

    /// [`text_content`](Self::text_content) without a copy where the
    /// content is one string (what a reader that only looks at it wants:
    /// the token count of every turn, the masking of tool outputs).
    pub fn text_view(&self) -> Cow<'_, str> {
        match &self.content {
            None => Cow::Borrowed(""),
            Some(Content::Text(t)) => Cow::Borrowed(t),
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for p in parts {
                    if let Some(t) = &p.text {
                        if !out.is_empty() {
                            out.push('\n');
                        }
                        out.push_str(t);
                    }
                }
                Cow::Owned(out)
            }
        }
    }

    /// Everything a tokenizer or a summarizer should read: the text plus
    /// tool-call names and arguments.
    pub fn searchable_text(&self) -> String {
        let mut out = self.text_content();
        // One allocation of the final size: the calls' text was a second
        // (or third) growth of a long content's buffer.
        out.reserve_exact(
            self.tool_calls
                .iter()
                .map(|c| c.function.name.len() + c.function.arguments.len() + 3)
                .sum(),
        );
        for call in &self.tool_calls {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(&call.function.name);
            out.push('(');
            out.push_str(&call.function.arguments);
            out.push(')');
        }
        out
    }

    /// Total bytes of text this message carries (content and tool calls).
    pub fn text_bytes(&self) -> usize {
        let content = match &self.content {
            None => 0,
            Some(Content::Text(t)) => t.len(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .map(|p| p.text.as_ref().map_or(0, |t| t.len()))
                .sum(),
        };
        content
            + self
                .tool_calls
                .iter()
                .map(|c| c.function.name.len() + c.function.arguments.len() + c.id.len())
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_view_borrows_one_string_and_joins_parts() {
        let one = ChatMessage::text(Role::User, "one string");
        assert!(matches!(one.text_view(), Cow::Borrowed("one string")));
        let json = r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"https://x/y.png"}},{"type":"text","text":"b"}]}"#;
        let parts: ChatMessage = serde_json::from_str(json).unwrap();
        assert_eq!(parts.text_view(), "a\nb");
        assert_eq!(parts.text_view(), parts.text_content());
        let none = ChatMessage {
            content: None,
            ..one
        };
        assert_eq!(none.text_view(), "");
    }

    #[test]
    fn parts_round_trip_keeps_unknown_fields() {
        let json = r#"{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"https://x/y.png"}}]}"#;
        let m: ChatMessage = serde_json::from_str(json).unwrap();
        assert_eq!(m.text_content(), "hi");
        assert_eq!(serde_json::to_string(&m).unwrap(), json);
        let packed = rmp_serde::to_vec_named(&m).unwrap();
        let back: ChatMessage = rmp_serde::from_slice(&packed).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn unknown_role_is_an_error() {
        let err = serde_json::from_str::<ChatMessage>(r#"{"role":"robot","content":"x"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("robot"), "{err}");
    }
}
