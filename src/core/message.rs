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
///
/// Written as the text or the list itself (untagged). Read by the one
/// visitor below, not by serde's untagged derive: that one buffers every
/// content into an intermediate tree and copies each string out of it
/// again, on the path of every turn folded (`docs/notes/issue-26.md`,
/// twenty-ninth pass).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContentVisitor;

        impl<'de> serde::de::Visitor<'de> for ContentVisitor {
            type Value = Content;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a message content: a string, or a list of content parts")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Content, E> {
                Ok(Content::Text(v.to_owned()))
            }

            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Content, E> {
                Ok(Content::Text(v))
            }

            // A format that writes strings as bytes (as the derive took them).
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Content, E> {
                match std::str::from_utf8(v) {
                    Ok(text) => Ok(Content::Text(text.to_owned())),
                    Err(_) => Err(E::invalid_value(serde::de::Unexpected::Bytes(v), &self)),
                }
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Content, A::Error> {
                // A hint from the input is not trusted beyond a small start.
                let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(16));
                while let Some(part) = seq.next_element::<ContentPart>()? {
                    parts.push(part);
                }
                Ok(Content::Parts(parts))
            }
        }

        deserializer.deserialize_any(ContentVisitor)
    }
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
    use proptest::strategy::Strategy as _;

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

    /// The content as serde's untagged derive read it before the visitor.
    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(untagged)]
    enum DerivedContent {
        Text(String),
        Parts(Vec<ContentPart>),
    }

    impl From<DerivedContent> for Content {
        fn from(d: DerivedContent) -> Content {
            match d {
                DerivedContent::Text(t) => Content::Text(t),
                DerivedContent::Parts(p) => Content::Parts(p),
            }
        }
    }

    /// Field names, text with spaces and escapes at either end, and any
    /// printable text.
    fn json_string() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        prop_oneof![
            Just("text".to_string()),
            Just("type".to_string()),
            "[ \t]?[a-z\u{e9}\"\\\\\n]{0,6}[ \t]?",
            "\\PC{0,12}",
        ]
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            json_string().prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("type".to_string()),
                        Just("text".to_string()),
                        "[a-z_]{1,6}"
                    ],
                    inner,
                    0..4
                )
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// The visitor accepts what the untagged derive accepted, reads it
        /// the same, and refuses what it refused, from JSON and from
        /// MessagePack alike.
        #[test]
        fn content_reads_as_the_untagged_derive_did(
            value in proptest::prop_oneof![
                json_string().prop_map(serde_json::Value::String),
                json_value(),
            ]
        ) {
            let json = serde_json::to_string(&value).unwrap();
            let ours = serde_json::from_str::<Content>(&json).ok();
            let derived = serde_json::from_str::<DerivedContent>(&json).ok().map(Content::from);
            proptest::prop_assert_eq!(&ours, &derived, "{}", json);
            let packed = rmp_serde::to_vec_named(&value).unwrap();
            let ours = rmp_serde::from_slice::<Content>(&packed).ok();
            let derived = rmp_serde::from_slice::<DerivedContent>(&packed).ok().map(Content::from);
            proptest::prop_assert_eq!(&ours, &derived, "{}", json);
        }
    }

    #[test]
    fn content_neither_text_nor_parts_is_refused_with_what_was_expected() {
        for bad in [
            r#"{"role":"user","content":42}"#,
            r#"{"role":"user","content":{"text":"x"}}"#,
        ] {
            let err = serde_json::from_str::<ChatMessage>(bad)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("a string, or a list of content parts"),
                "{bad}: {err}"
            );
        }
        let err =
            serde_json::from_str::<ChatMessage>(r#"{"role":"user","content":[{"text":"x"}]}"#)
                .unwrap_err()
                .to_string();
        assert!(err.contains("type"), "{err}");
    }

    #[test]
    fn content_as_bytes_is_read_as_text_when_utf8() {
        // MessagePack `bin 8`: 0xc4, the length, the bytes.
        let packed = [&[0xc4, 5][..], b"plain"].concat();
        assert_eq!(
            rmp_serde::from_slice::<Content>(&packed).unwrap(),
            Content::Text("plain".into())
        );
        assert!(rmp_serde::from_slice::<Content>(&[0xc4, 2, 0xff, 0xfe]).is_err());
    }
}
