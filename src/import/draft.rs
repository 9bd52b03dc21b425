//! From what a source says to inbound events.
//!
//! Every format parser produces [`Draft`]s: the conversation's turns, model
//! declarations and provider errors in source order, with source times where
//! the source has them. [`finish`] then applies the rules every format shares,
//! so they hold for all of them alike:
//!
//! - **Tool pairing.** A tool message must answer a call of the assistant
//!   message that opened the current tool group (the assistant message and the
//!   tool messages right after it), each call at most once; that is what
//!   providers accept. A tool message that answers nothing (unknown or empty
//!   id, a second answer, or a result arriving after another message closed
//!   the group) becomes a `user` message named `tool_result`, content
//!   unchanged, with `orphan_tool_call_id` in its metadata. Nothing is dropped.
//! - **Unique call ids.** A call id already used earlier in the conversation
//!   (SWE-agent replays reuse them) is renamed `<id>_2`, `<id>_3`, ... and its
//!   results follow, because the fold pairs results to calls by id.
//! - **Models.** The first model the conversation names is declared before the
//!   first turn; every later change is declared right before the turn or at the
//!   point where the source changed it.
//! - **Time.** Source time when present; otherwise one second after the
//!   previous event (the first at the draft's start time or [`SYNTHETIC_EPOCH_MS`]).
//!   Time never goes backwards within a conversation: a source clock that
//!   steps back is held at the previous time, because the fold's duplicate
//!   and flood guards read time as monotonic.
//! - **Ids.** `imp-` + 16 hex digits of blake3(conversation id, event index):
//!   the same file gives the same ids, and re-importing a file that has grown
//!   gives the old events their old ids, so the log ignores them.

use crate::core::event::Envelope;
use crate::core::event::{
    EventBody, ModelDeclared, ProviderErrorObserved, ProviderUsage, TurnAppended,
};
use crate::core::message::{Content, ContentPart, Role};
use serde_json::{Map, Value};
use std::collections::HashSet;

/// Base of synthetic times (2023-11-14T22:13:20Z) for sources without any.
pub const SYNTHETIC_EPOCH_MS: u64 = 1_700_000_000_000;

/// Spacing of synthetic times, one second per event.
const SYNTHETIC_STEP_MS: u64 = 1000;

/// One conversation as its source tells it.
#[derive(Debug, Default)]
pub(crate) struct Draft {
    /// Position among the file's conversations, for formats that hold many
    /// (the conversation id gets `#<index>`); `None` for one-conversation formats.
    pub index: Option<usize>,
    /// The source's own name for the conversation among the file's (an
    /// OpenHands `instance_id`): the id gets `#<key>`, ahead of `index`.
    pub key: Option<String>,
    /// Time of the first item when the source gives a start but no per-turn times.
    pub start_time: Option<u64>,
    /// The model the source declares for the whole conversation up front.
    pub model: Option<String>,
    pub items: Vec<Item>,
}

#[derive(Debug)]
pub(crate) struct Item {
    pub time: Option<u64>,
    pub kind: ItemKind,
}

// Nearly every item is a turn, so boxing turns would only add an allocation each.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum ItemKind {
    Turn(TurnAppended),
    /// The source declared (or switched to) this model.
    Model(String),
    ProviderError {
        error: String,
        model: Option<String>,
    },
}

impl Draft {
    pub fn new(index: Option<usize>) -> Self {
        Draft {
            index,
            ..Draft::default()
        }
    }

    pub fn push_turn(&mut self, time: Option<u64>, turn: TurnAppended) {
        self.items.push(Item {
            time,
            kind: ItemKind::Turn(turn),
        });
    }

    pub fn push_model(&mut self, time: Option<u64>, model: impl Into<String>) {
        let model = model.into();
        if !model.trim().is_empty() {
            self.items.push(Item {
                time,
                kind: ItemKind::Model(model),
            });
        }
    }

    pub fn push_provider_error(&mut self, time: Option<u64>, error: String, model: Option<String>) {
        self.items.push(Item {
            time,
            kind: ItemKind::ProviderError { error, model },
        });
    }

    fn has_turns(&self) -> bool {
        self.items
            .iter()
            .any(|i| matches!(i.kind, ItemKind::Turn(_)))
    }
}

/// Sets one metadata key on a turn.
pub(crate) fn set_metadata(turn: &mut TurnAppended, key: &str, value: Value) {
    turn.metadata
        .get_or_insert_with(Map::new)
        .insert(key.to_string(), value);
}

/// Message content from parts: none, one text part as plain text, or parts.
pub(crate) fn content_from_parts(mut parts: Vec<ContentPart>) -> Option<Content> {
    match parts.len() {
        0 => None,
        1 if parts[0].kind == "text" && parts[0].other.is_empty() => {
            parts.pop().and_then(|p| p.text).map(Content::Text)
        }
        _ => Some(Content::Parts(parts)),
    }
}

pub(crate) fn text_part(text: impl Into<String>) -> ContentPart {
    ContentPart {
        kind: "text".to_string(),
        text: Some(text.into()),
        other: Default::default(),
    }
}

/// An OpenAI `image_url` part holding a data URL.
pub(crate) fn image_part(media_type: &str, base64: &str) -> ContentPart {
    let mut other = std::collections::BTreeMap::new();
    other.insert(
        "image_url".to_string(),
        serde_json::json!({ "url": format!("data:{media_type};base64,{base64}") }),
    );
    ContentPart {
        kind: "image_url".to_string(),
        text: None,
        other,
    }
}

/// An OpenAI `image_url` part for a URL as a transcript gives it: a data
/// URL is split into its media type and data, any other kept as it is.
pub(crate) fn image_url(url: &str) -> ContentPart {
    if let Some((media, data)) = url
        .strip_prefix("data:")
        .and_then(|rest| rest.split_once(";base64,"))
    {
        return image_part(media, data);
    }
    let mut other = std::collections::BTreeMap::new();
    other.insert("image_url".to_string(), serde_json::json!({ "url": url }));
    ContentPart {
        kind: "image_url".to_string(),
        text: None,
        other,
    }
}

/// Provider usage from prompt / completion counts, `None` when all are absent.
pub(crate) fn usage(
    prompt: Option<u64>,
    completion: Option<u64>,
    total: Option<u64>,
) -> Option<ProviderUsage> {
    if prompt.is_none() && completion.is_none() && total.is_none() {
        return None;
    }
    let total = total.or(match (prompt, completion) {
        (Some(p), Some(c)) => Some(p + c),
        _ => None,
    });
    Some(ProviderUsage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: total,
    })
}

/// What [`finish`] changed to keep a conversation valid for a provider.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PairingRepairs {
    pub renamed_calls: usize,
    pub orphan_results: usize,
}

/// Applies the shared rules (module doc) and builds the events. A draft
/// without any turn gives `None`.
pub(crate) fn finish(mut draft: Draft, stem: &str) -> Option<(String, Vec<Envelope>)> {
    if !draft.has_turns() {
        return None;
    }
    let conversation = match (&draft.key, draft.index) {
        (Some(key), _) => format!("{stem}#{key}"),
        (None, Some(i)) => format!("{stem}#{i}"),
        (None, None) => stem.to_string(),
    };
    repair_tool_pairing(&mut draft.items);
    let times = event_times(&draft);
    let first_model = draft.model.take().or_else(|| {
        draft.items.iter().find_map(|item| match &item.kind {
            ItemKind::Model(m) => Some(m.clone()),
            ItemKind::Turn(t) => t.model.clone(),
            ItemKind::ProviderError { .. } => None,
        })
    });

    let mut bodies: Vec<(u64, EventBody)> = Vec::with_capacity(draft.items.len() + 1);
    let mut declared: Option<String> = None;
    if let Some(model) = first_model {
        bodies.push((times[0], declare(&model)));
        declared = Some(model);
    }
    for (item, time) in draft.items.into_iter().zip(times) {
        match item.kind {
            ItemKind::Model(model) => {
                if declared.as_deref() != Some(model.as_str()) {
                    bodies.push((time, declare(&model)));
                    declared = Some(model);
                }
            }
            ItemKind::Turn(turn) => {
                if let Some(model) = &turn.model {
                    if declared.as_deref() != Some(model.as_str()) {
                        bodies.push((time, declare(model)));
                        declared = Some(model.clone());
                    }
                }
                bodies.push((time, EventBody::TurnAppended(turn)));
            }
            ItemKind::ProviderError { error, model } => {
                bodies.push((
                    time,
                    EventBody::ProviderErrorObserved(ProviderErrorObserved { error, model }),
                ));
            }
        }
    }
    let events = bodies
        .into_iter()
        .enumerate()
        .map(|(n, (time, body))| {
            Envelope::new(event_id(&conversation, n), &conversation, time, body)
        })
        .collect();
    Some((conversation, events))
}

fn declare(model: &str) -> EventBody {
    EventBody::ModelDeclared(ModelDeclared {
        model: model.to_string(),
        context_window: None,
    })
}

/// The id of the `index`-th event imported into `conversation`.
pub(crate) fn event_id(conversation: &str, index: usize) -> String {
    crate::core::derived_id::DerivedId::Imported {
        conversation,
        index,
    }
    .to_string()
}

fn event_times(draft: &Draft) -> Vec<u64> {
    let mut times = Vec::with_capacity(draft.items.len());
    let mut previous: Option<u64> = None;
    for item in &draft.items {
        let t = match (item.time, previous) {
            (Some(t), Some(p)) => t.max(p),
            (Some(t), None) => t,
            (None, Some(p)) => p + SYNTHETIC_STEP_MS,
            (None, None) => draft.start_time.unwrap_or(SYNTHETIC_EPOCH_MS),
        };
        times.push(t);
        previous = Some(t);
    }
    times
}

/// Makes call ids unique and every tool message answer an open call (module doc).
pub(crate) fn repair_tool_pairing(items: &mut [Item]) -> PairingRepairs {
    let mut repairs = PairingRepairs::default();
    let mut used: HashSet<String> = HashSet::new();
    // The open tool group: (id as the source wrote it, id as imported, answered).
    let mut open: Vec<(String, String, bool)> = Vec::new();
    let mut unnamed = 0usize;
    for item in items.iter_mut() {
        let ItemKind::Turn(turn) = &mut item.kind else {
            continue;
        };
        match turn.message.role {
            Role::Assistant => {
                open.clear();
                for call in &mut turn.message.tool_calls {
                    if call.id.is_empty() {
                        unnamed += 1;
                        call.id = format!("call_unnamed_{unnamed}");
                    }
                    let original = call.id.clone();
                    if used.contains(&call.id) {
                        let mut n = 2;
                        while used.contains(&format!("{original}_{n}")) {
                            n += 1;
                        }
                        call.id = format!("{original}_{n}");
                        repairs.renamed_calls += 1;
                    }
                    used.insert(call.id.clone());
                    open.push((original, call.id.clone(), false));
                }
            }
            Role::Tool => {
                let wanted = turn.message.tool_call_id.clone().unwrap_or_default();
                let slot = open
                    .iter_mut()
                    .find(|(original, _, answered)| !answered && *original == wanted);
                match slot {
                    Some((_, imported, answered)) => {
                        *answered = true;
                        turn.message.tool_call_id = Some(imported.clone());
                    }
                    None => {
                        repairs.orphan_results += 1;
                        let tool_name = turn.message.name.take();
                        turn.message.role = Role::User;
                        turn.message.tool_call_id = None;
                        turn.message.name = Some("tool_result".to_string());
                        set_metadata(turn, "orphan_tool_call_id", Value::String(wanted));
                        if let Some(tool) = tool_name {
                            set_metadata(turn, "tool_name", Value::String(tool));
                        }
                    }
                }
            }
            Role::System | Role::User => open.clear(),
        }
    }
    repairs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::{ChatMessage, FunctionCall, ToolCall};

    fn call(id: &str) -> ToolCall {
        ToolCall {
            id: id.to_string(),
            kind: "function".to_string(),
            function: FunctionCall {
                name: "bash".to_string(),
                arguments: "{}".to_string(),
            },
        }
    }

    fn assistant(ids: &[&str]) -> Item {
        let mut m = ChatMessage::text(Role::Assistant, "");
        m.content = None;
        m.tool_calls = ids.iter().map(|id| call(id)).collect();
        Item {
            time: None,
            kind: ItemKind::Turn(TurnAppended::from(m)),
        }
    }

    fn result(id: &str) -> Item {
        let mut m = ChatMessage::text(Role::Tool, format!("out {id}"));
        m.tool_call_id = Some(id.to_string());
        Item {
            time: None,
            kind: ItemKind::Turn(TurnAppended::from(m)),
        }
    }

    fn user(text: &str) -> Item {
        Item {
            time: None,
            kind: ItemKind::Turn(TurnAppended::from(ChatMessage::text(Role::User, text))),
        }
    }

    fn message(item: &Item) -> &ChatMessage {
        match &item.kind {
            ItemKind::Turn(t) => &t.message,
            other => panic!("not a turn: {other:?}"),
        }
    }

    #[test]
    fn reused_call_ids_are_renamed_and_results_follow() {
        let mut items = vec![
            assistant(&["a"]),
            result("a"),
            assistant(&["a"]),
            result("a"),
        ];
        let repairs = repair_tool_pairing(&mut items);
        assert_eq!(repairs.renamed_calls, 1);
        assert_eq!(message(&items[2]).tool_calls[0].id, "a_2");
        assert_eq!(message(&items[3]).tool_call_id.as_deref(), Some("a_2"));
        assert_eq!(message(&items[1]).tool_call_id.as_deref(), Some("a"));
    }

    #[test]
    fn orphans_become_user_messages_with_their_content() {
        let mut items = vec![
            result("ghost"),
            assistant(&["x"]),
            user("interrupt"),
            result("x"),
            assistant(&["y"]),
            result("y"),
            result("y"),
        ];
        let repairs = repair_tool_pairing(&mut items);
        assert_eq!(repairs.orphan_results, 3);
        for i in [0, 3, 6] {
            let m = message(&items[i]);
            assert_eq!(m.role, Role::User, "item {i}");
            assert_eq!(m.name.as_deref(), Some("tool_result"));
            assert!(m.tool_call_id.is_none());
        }
        assert_eq!(message(&items[3]).text_content(), "out x");
        assert_eq!(message(&items[5]).role, Role::Tool);
    }

    #[test]
    fn models_are_declared_first_and_on_change() {
        let mut d = Draft::new(None);
        d.push_turn(
            Some(5_000),
            TurnAppended::from(ChatMessage::text(Role::User, "hi")),
        );
        let mut a = TurnAppended::from(ChatMessage::text(Role::Assistant, "hello"));
        a.model = Some("m1".into());
        d.push_turn(None, a);
        d.push_model(None, "m1");
        d.push_model(Some(1_000), "m2");
        d.push_turn(
            None,
            TurnAppended::from(ChatMessage::text(Role::User, "again")),
        );
        let (conv, events) = finish(d, "stem").unwrap();
        assert_eq!(conv, "stem");
        let kinds: Vec<_> = events.iter().map(|e| e.type_name()).collect();
        assert_eq!(
            kinds,
            [
                "model_declared",
                "turn_appended",
                "turn_appended",
                "model_declared",
                "turn_appended"
            ]
        );
        let times: Vec<u64> = events.iter().map(|e| e.time).collect();
        // The repeated m1 declaration takes a slot but gives no event; the
        // step back to 1_000 is held at the previous time.
        assert_eq!(times, [5_000, 5_000, 6_000, 7_000, 8_000]);
    }

    #[test]
    fn ids_are_stable_and_distinct() {
        assert_eq!(event_id("c", 0), event_id("c", 0));
        assert_ne!(event_id("c", 0), event_id("c", 1));
        assert_ne!(event_id("c#1", 0), event_id("c", 0));
        assert!(event_id("c", 0).starts_with("imp-"));
        assert_eq!(event_id("c", 0).len(), 20);
    }

    #[test]
    fn a_draft_without_turns_gives_nothing() {
        let mut d = Draft::new(Some(3));
        d.push_model(None, "m");
        assert!(finish(d, "s").is_none());
    }
}
