//! The request/reply API, independent of any transport: JSON request and
//! response types and pure handlers over a partition's [`State`] and the
//! [`PolicyConfig`] it was folded under. No I/O, no clock, no waiting on a
//! summarizer: every answer comes from state as it is now.
//!
//! Operations (bodies documented in `docs/api.md`): `assemble`, `status`,
//! `grep`, `describe`, `expand`, `compact` (builds the event to publish;
//! the transport publishes it), `history` and `recall` (plans what a model
//! reads; the transport runs the model and publishes the spend). [`handle`] is the single JSON
//! dispatch any transport can serve; [`handle_view`] adds the ownership
//! check a partitioned runtime needs ([`StateView`]). Errors are always a
//! structured reply (`{"error": {"code", "message", ...}}`), never silence.

pub mod assemble;
pub mod compact;
mod coverage;
pub mod describe;
pub mod expand;
pub mod grep;
pub mod history;
pub mod recall;
pub mod status;
#[cfg(test)]
pub(crate) mod testing;

use crate::core::policy::PolicyConfig;
use crate::core::state::{BodyError, Conversation, Resident, State, Summary, Turn, TurnBodies};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::panic::AssertUnwindSafe;
use std::sync::RwLock;

pub use assemble::{AssembleRequest, AssembleResponse};
pub use compact::{CompactRequest, CompactResponse};
pub use describe::{DescribeRequest, DescribeResponse};
pub use expand::{ExpandRequest, ExpandResponse};
pub use grep::{GrepRequest, GrepResponse};
pub use history::{HistoryRequest, HistoryResponse};
pub use recall::{RecallRequest, RecallResponse};
pub use status::{StatusRequest, StatusResponse};

/// Largest request body accepted; larger ones are a `bad_request`.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// Retry hint sent with `not_owner` when the transport gives none: about
/// the time a partition lease takes to move.
pub const DEFAULT_NOT_OWNER_RETRY_MS: u64 = 500;

/// One API request: an operation and its body. The one table of the API's
/// operations: [`Op`] is derived from it (an operation's wire name is its
/// variant's name in snake case, for serde and strum alike, pinned by
/// `tests/api.rs`), and every `match` on either is exhaustive, so a new
/// operation does not compile until its handler, its NATS dispatch and
/// its client are written.
#[derive(Debug, Clone, Serialize, strum::EnumDiscriminants)]
#[serde(untagged)]
#[strum_discriminants(
    name(Op),
    vis(pub),
    doc = "One API operation ([`Request`] without its body).",
    derive(
        Hash,
        Serialize,
        Deserialize,
        strum::IntoStaticStr,
        strum::EnumString,
        strum::Display,
        strum::VariantArray,
        strum::VariantNames
    ),
    strum(serialize_all = "snake_case"),
    serde(rename_all = "snake_case")
)]
pub enum Request {
    Assemble(AssembleRequest),
    Status(StatusRequest),
    Grep(GrepRequest),
    Describe(DescribeRequest),
    Expand(ExpandRequest),
    Compact(CompactRequest),
    History(HistoryRequest),
    Recall(RecallRequest),
}

impl Request {
    /// Its operation.
    pub fn op(&self) -> Op {
        self.into()
    }

    /// The conversation it is about; `None`: the whole service.
    pub fn conversation(&self) -> Option<&str> {
        match self {
            Request::Status(r) => r.conversation.as_deref(),
            Request::Assemble(AssembleRequest { conversation, .. })
            | Request::Grep(GrepRequest { conversation, .. })
            | Request::Describe(DescribeRequest { conversation, .. })
            | Request::Expand(ExpandRequest { conversation, .. })
            | Request::Compact(CompactRequest { conversation, .. })
            | Request::History(HistoryRequest { conversation, .. })
            | Request::Recall(RecallRequest { conversation, .. }) => Some(conversation),
        }
    }

    /// The request body, as any API client sends it.
    pub fn body(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }
}

impl Op {
    /// Every operation, in declaration order.
    pub const ALL: &'static [Op] = <Op as strum::VariantArray>::VARIANTS;

    /// Every operation's wire name, in the order of [`Op::ALL`].
    pub const NAMES: &'static [&'static str] = <Op as strum::VariantNames>::VARIANTS;

    /// The wire name (`assemble`, ...): the subject token and the name
    /// `docs/api.md` uses.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// The operation of a wire name (exact: `Assemble` is none).
    pub fn parse(name: &str) -> Option<Op> {
        name.parse().ok()
    }
}

/// Why a request got no answer. Serialized as
/// `{"error": {"code": ..., "message": ..., "retry_after_ms"?, "conversation"?}}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    #[error("unknown conversation {conversation:?}: no event of it has been folded here (keys are exact and case-sensitive)")]
    UnknownConversation { conversation: String },
    #[error("{0}")]
    BadRequest(String),
    #[error("this process does not own conversation {conversation:?} now; retry in {retry_after_ms} ms (its partition is owned elsewhere or moving)")]
    NotOwner {
        conversation: String,
        retry_after_ms: u64,
    },
    #[error("internal error: {0}")]
    Internal(String),
    /// The spend window has nothing left for a model call.
    #[error("recall of {conversation:?} refused: {detail}; it opens again as older spend leaves the window (`status` shows its `spend_window`)")]
    SpendExhausted {
        conversation: String,
        detail: String,
    },
    /// The model did not answer within the deadline; the call in flight
    /// was cancelled.
    #[error("recall of {conversation:?} passed its deadline of {deadline_ms} ms: the model call in flight was cancelled ({calls} calls, counted in the spend window); ask with a smaller max_tokens or raise recall.deadline_ms")]
    DeadlineExceeded {
        conversation: String,
        deadline_ms: u64,
        calls: u32,
    },
    /// No model answered (none configured, unavailable, key refused).
    #[error("{0}")]
    ModelFailed(String),
}

impl From<BodyError> for ApiError {
    /// A body the state refers to and the store cannot give: the store is
    /// damaged (the message names `rebuild`) or unreachable, not the
    /// request at fault.
    fn from(e: BodyError) -> ApiError {
        ApiError::Internal(e.to_string())
    }
}

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> ApiError {
        ApiError::Internal(e.to_string())
    }
}

/// The machine-readable kind of an [`ApiError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    UnknownConversation,
    BadRequest,
    NotOwner,
    Internal,
    SpendExhausted,
    DeadlineExceeded,
    ModelFailed,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::UnknownConversation => "unknown_conversation",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::NotOwner => "not_owner",
            ErrorCode::Internal => "internal",
            ErrorCode::SpendExhausted => "spend_exhausted",
            ErrorCode::DeadlineExceeded => "deadline_exceeded",
            ErrorCode::ModelFailed => "model_failed",
        }
    }

    /// The HTTP-like status NATS services put in `Nats-Service-Error-Code`.
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::UnknownConversation => 404,
            ErrorCode::BadRequest => 400,
            ErrorCode::NotOwner => 503,
            ErrorCode::Internal => 500,
            ErrorCode::SpendExhausted => 429,
            ErrorCode::DeadlineExceeded => 504,
            ErrorCode::ModelFailed => 502,
        }
    }
}

/// The `error` object of an error reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
    /// Ask again after this long (`not_owner`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// The conversation the error is about, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<String>,
}

/// An error reply on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub error: ErrorBody,
}

impl ApiError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ApiError::UnknownConversation { .. } => ErrorCode::UnknownConversation,
            ApiError::BadRequest(_) => ErrorCode::BadRequest,
            ApiError::NotOwner { .. } => ErrorCode::NotOwner,
            ApiError::Internal(_) => ErrorCode::Internal,
            ApiError::SpendExhausted { .. } => ErrorCode::SpendExhausted,
            ApiError::DeadlineExceeded { .. } => ErrorCode::DeadlineExceeded,
            ApiError::ModelFailed(_) => ErrorCode::ModelFailed,
        }
    }

    pub fn body(&self) -> ErrorBody {
        let (retry_after_ms, conversation) = match self {
            ApiError::UnknownConversation { conversation }
            | ApiError::SpendExhausted { conversation, .. }
            | ApiError::DeadlineExceeded { conversation, .. } => (None, Some(conversation.clone())),
            ApiError::NotOwner {
                conversation,
                retry_after_ms,
            } => (Some(*retry_after_ms), Some(conversation.clone())),
            ApiError::BadRequest(_) | ApiError::Internal(_) | ApiError::ModelFailed(_) => {
                (None, None)
            }
        };
        ErrorBody {
            code: self.code(),
            message: self.to_string(),
            retry_after_ms,
            conversation,
        }
    }

    /// The JSON error reply.
    pub fn to_json(&self) -> Vec<u8> {
        encode(&ErrorReply { error: self.body() })
    }

    pub(crate) fn bad(message: impl Into<String>) -> ApiError {
        ApiError::BadRequest(message.into())
    }
}

/// Why a reply could not be read as the expected response.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    /// The service answered with a structured error.
    #[error("{}", .0.message)]
    Api(ErrorBody),
    #[error("malformed reply: {0}")]
    Malformed(String),
}

/// Reads a reply: the response, or the structured error it carries. For
/// clients of any transport.
pub fn decode_reply<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ReplyError> {
    #[derive(Deserialize)]
    struct Probe {
        error: Option<ErrorBody>,
    }
    if let Ok(Probe { error: Some(e) }) = serde_json::from_slice::<Probe>(bytes) {
        return Err(ReplyError::Api(e));
    }
    serde_json::from_slice(bytes).map_err(|e| ReplyError::Malformed(e.to_string()))
}

/// Encodes a response. sonic-rs rather than serde_json: an `assemble`
/// reply is hundreds of KB of message text, and escaping it byte by byte
/// was most of the handler's time (SIMD escaping halves it; see
/// `benches/nats_assemble.rs`). Same JSON (tested against serde_json).
#[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Response types hold only strings, numbers, maps with string keys and
    // JSON values: serializing them to a Vec cannot fail.
    sonic_rs::to_vec(value).expect("API responses serialize to JSON")
}

/// Reads a request body; an empty body is `{}`.
pub(crate) fn parse_request<T: DeserializeOwned>(op: Op, body: &[u8]) -> Result<T, ApiError> {
    if body.len() > MAX_REQUEST_BYTES {
        return Err(ApiError::bad(format!(
            "{op} request of {} bytes exceeds the {MAX_REQUEST_BYTES}-byte limit",
            body.len()
        )));
    }
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("malformed {op} request: {e} (see docs/api.md)")))
}

/// The conversation a request names.
pub(crate) fn conversation<'a>(state: &'a State, key: &str) -> Result<&'a Conversation, ApiError> {
    if key.is_empty() {
        return Err(ApiError::bad("`conversation` is empty"));
    }
    state
        .conversations
        .get(key)
        .ok_or_else(|| ApiError::UnknownConversation {
            conversation: key.to_string(),
        })
}

/// A turn by sequence number; a miss is a broken state, not a bad request.
pub(crate) fn turn(conv: &Conversation, seq: u64) -> Result<&Turn, ApiError> {
    usize::try_from(seq)
        .ok()
        .and_then(|i| conv.turns.get(i))
        .ok_or_else(|| {
            ApiError::Internal(format!(
                "state of {:?} refers to turn {seq} but holds {} turns",
                conv.key,
                conv.turns.len()
            ))
        })
}

/// A summary by index into [`Conversation::summaries`].
pub(crate) fn summary_at(conv: &Conversation, index: u32) -> Result<&Summary, ApiError> {
    conv.summaries.get(index as usize).ok_or_else(|| {
        ApiError::Internal(format!(
            "state of {:?} refers to summary #{index} but holds {} summaries",
            conv.key,
            conv.summaries.len()
        ))
    })
}

/// What a request is answered from: the state holding its conversation,
/// where that state's turn bodies are read, and the policy it was folded
/// under.
#[derive(Clone, Copy)]
pub struct Held<'a> {
    pub state: &'a State,
    pub bodies: &'a dyn TurnBodies,
    pub policy: &'a PolicyConfig,
}

impl<'a> Held<'a> {
    /// A state folded in memory (every body resident).
    pub fn resident(state: &'a State, policy: &'a PolicyConfig) -> Held<'a> {
        Held {
            state,
            bodies: &Resident,
            policy,
        }
    }
}

/// Answers one request from a state, as JSON bytes or a structured error.
pub fn answer(op: Op, body: &[u8], held: Held<'_>) -> Result<Vec<u8>, ApiError> {
    let Held {
        state,
        bodies,
        policy,
    } = held;
    // A handler bug must come back as an `internal` reply, not take the
    // serving task down or leave the caller waiting.
    let run = AssertUnwindSafe(|| -> Result<Vec<u8>, ApiError> {
        Ok(match op {
            Op::Assemble => {
                let started = std::time::Instant::now();
                let reply = encode(&assemble::assemble_borrowed(
                    state,
                    bodies,
                    policy,
                    &parse_request(op, body)?,
                )?);
                crate::telemetry::Assembled {
                    elapsed: started.elapsed(),
                    reply_bytes: reply.len(),
                }
                .emit();
                reply
            }
            Op::Status => encode(&status::status(state, policy, &parse_request(op, body)?)?),
            Op::Grep => encode(&grep::grep(state, bodies, &parse_request(op, body)?)?),
            Op::Describe => encode(&describe::describe(
                state,
                bodies,
                &parse_request(op, body)?,
            )?),
            Op::Expand => encode(&expand::expand(state, bodies, &parse_request(op, body)?)?),
            Op::Compact => encode(&compact::compact(state, policy, &parse_request(op, body)?)?),
            Op::History => encode(&history::history(state, bodies, &parse_request(op, body)?)?),
            Op::Recall => {
                parse_request::<RecallRequest>(op, body)?;
                return Err(ApiError::bad(
                    "recall runs a model, and this transport answers from state only: ask a \
                     `contextfold serve` over NATS (`contextfold recall --nats URL`) or \
                     `contextfold recall` on the embedded store",
                ));
            }
        })
    });
    match std::panic::catch_unwind(run) {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            tracing::error!(op = %op, panic = %what, "API handler panicked");
            Err(ApiError::Internal(format!(
                "the {op} handler failed ({what}); this is a bug: please report it with the request"
            )))
        }
    }
}

/// The operation a request names; an unknown one is a `bad_request`
/// listing the known ones.
pub fn parse_op(op: &str) -> Result<Op, ApiError> {
    Op::parse(op).ok_or_else(|| {
        ApiError::bad(format!(
            "unknown operation {op:?}; known: {}",
            Op::NAMES.join(", ")
        ))
    })
}

/// The single JSON dispatch: operation name and request body in, response
/// or error reply out, over a state folded in memory.
pub fn handle(op: &str, body: &[u8], state: &State, policy: &PolicyConfig) -> Vec<u8> {
    handle_held(op, body, Held::resident(state, policy))
}

/// [`handle`] over any [`Held`] state.
pub fn handle_held(op: &str, body: &[u8], held: Held<'_>) -> Vec<u8> {
    match parse_op(op) {
        Ok(op) => handle_op(op, body, held),
        Err(e) => e.to_json(),
    }
}

/// [`handle_held`] for an operation already parsed.
pub fn handle_op(op: Op, body: &[u8], held: Held<'_>) -> Vec<u8> {
    answer(op, body, held).unwrap_or_else(|e| e.to_json())
}

/// Access to the state a process holds, for a transport serving the API.
pub trait StateView: Send + Sync + 'static {
    /// Runs `f` over the state that holds `conversation` (or, for `None`,
    /// the state to report globally on). `f` gets `None` when this process
    /// does not own that conversation's partition.
    fn with_state<R>(&self, conversation: Option<&str>, f: impl FnOnce(Option<Held<'_>>) -> R)
        -> R;

    /// Calls `f` with every conversation this process holds, resident or
    /// stored, one at a time (with the state of its partition), for global
    /// status: memory stays that of one conversation, whatever their number.
    fn each_conversation(
        &self,
        f: &mut dyn FnMut(&State, &Conversation) -> Result<(), ApiError>,
    ) -> Result<(), ApiError> {
        self.with_state(None, |held| {
            let Some(held) = held else {
                return Ok(());
            };
            for conv in held.state.conversations.values() {
                f(held.state, conv)?;
            }
            Ok(())
        })
    }

    /// The health of the partitions this process folds, for global status
    /// (none for a process without partitions).
    fn partitions(&self) -> Vec<status::PartitionHealth> {
        Vec::new()
    }

    /// Partition `partition`'s own global status (its conversations and its
    /// health), when this process holds it.
    fn partition_status(&self, partition: u32) -> Option<Result<status::GlobalStatus, ApiError>> {
        let _ = partition;
        None
    }
}

/// A view over one state that owns every conversation (one process, or a
/// test).
#[derive(Debug, Default)]
pub struct LocalState {
    pub state: RwLock<State>,
    pub policy: PolicyConfig,
}

impl LocalState {
    pub fn new(state: State, policy: PolicyConfig) -> Self {
        LocalState {
            state: RwLock::new(state),
            policy,
        }
    }
}

impl StateView for LocalState {
    fn with_state<R>(
        &self,
        _conversation: Option<&str>,
        f: impl FnOnce(Option<Held<'_>>) -> R,
    ) -> R {
        // A writer that panicked left a state the fold had fully applied
        // up to its last event; reading it is still sound.
        let guard = self.state.read().unwrap_or_else(|e| e.into_inner());
        f(Some(Held::resident(&guard, &self.policy)))
    }
}

/// What a request's subject addresses: one conversation
/// (`<prefix>.api.<op>.<token>`) or the whole service
/// (`<prefix>.admin.<op>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target<'a> {
    Conversation(&'a str),
    Global,
}

/// Answers one request through a [`StateView`]: `not_owner` (with
/// `retry_after_ms`) when this process does not hold the conversation.
/// The body must name the conversation its subject names, so a NATS
/// permission on the subject scopes what a client may read or compact;
/// only `status` answers globally, and only on the admin subject.
pub fn answer_view<V: StateView + ?Sized>(
    op: Op,
    target: Target<'_>,
    body: &[u8],
    view: &V,
    retry_after_ms: u64,
) -> Result<Vec<u8>, ApiError> {
    #[derive(Deserialize)]
    struct Routing {
        #[serde(default)]
        conversation: Option<String>,
    }
    // Only the routing key here; the handler reads (and checks) the rest.
    let routing: Routing = parse_request(op, body)?;
    match target {
        Target::Conversation(key) => {
            match routing.conversation.as_deref() {
                Some(named) if named == key => {}
                Some(named) => {
                    return Err(ApiError::bad(format!(
                        "the request names conversation {named:?} but was sent on the subject of \
                         {key:?}: send it on its own conversation's subject"
                    )))
                }
                None => {
                    return Err(ApiError::bad(format!(
                        "the request must name the conversation its subject names ({key:?})"
                    )))
                }
            }
            view.with_state(Some(key), |held| match held {
                Some(held) => answer(op, body, held),
                None => Err(ApiError::NotOwner {
                    conversation: key.to_string(),
                    retry_after_ms,
                }),
            })
        }
        Target::Global => {
            if op != Op::Status {
                return Err(ApiError::bad(format!(
                    "{op} works on one conversation: send it on `<prefix>.api.{op}.<conversation \
                     token>` (docs/subjects.md)"
                )));
            }
            if routing.conversation.is_some() {
                return Err(ApiError::bad(
                    "the admin subject answers for the whole service: ask about one conversation \
                     on `<prefix>.api.status.<conversation token>`",
                ));
            }
            let partitions = view.partitions();
            let global = view.with_state(None, |held| {
                let Some(held) = held else {
                    return Err(ApiError::Internal("no state to report on".into()));
                };
                status::global_status_with(held.state, held.policy, |each| {
                    view.each_conversation(each)
                })
            })?;
            Ok(encode(&status::StatusResponse::Global(Box::new(
                status::with_partitions(global, partitions),
            ))))
        }
    }
}

/// [`answer_view`] as JSON bytes either way.
pub fn handle_view<V: StateView + ?Sized>(
    op: &str,
    target: Target<'_>,
    body: &[u8],
    view: &V,
    retry_after_ms: u64,
) -> Vec<u8> {
    match parse_op(op).and_then(|op| answer_view(op, target, body, view, retry_after_ms)) {
        Ok(bytes) => bytes,
        Err(e) => e.to_json(),
    }
}

/// Cuts `text` to at most `max` characters, marking the cut.
pub(crate) fn clip(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_string(),
        Some((cut, _)) => format!("{}…", &text[..cut]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_round_trips_its_name() {
        for &op in Op::ALL {
            assert_eq!(Op::parse(op.as_str()), Some(op));
            assert_eq!(
                serde_json::to_value(op).unwrap(),
                serde_json::json!(op.as_str())
            );
        }
        assert_eq!(Op::parse("Assemble"), None);
    }

    #[test]
    fn responses_encode_as_serde_json_encodes_them() {
        let mut every_char: String = (0u8..0x80).map(char::from).collect();
        every_char.push_str("é日本😀\u{2028}\u{2029}\u{85}\u{a0}\u{feff}\"\\/");
        let long = every_char.repeat(300);
        let value = serde_json::json!({
            "text": every_char,
            "long": long,
            "numbers": [0, 1, -1, u64::MAX, i64::MIN, 0.1, 1e-7, 123456.789, 1e300, -0.0, 2.5e-308],
            "not_finite": [f64::NAN, f64::INFINITY],
            "nested": {"empty": [], "map": {}, "null": null, "bools": [true, false]},
        });
        let ours = encode(&value);
        let reference = serde_json::to_vec(&value).unwrap();
        assert_eq!(
            String::from_utf8(ours).unwrap(),
            String::from_utf8(reference).unwrap()
        );
        // A real response type, with its flattened fields.
        let (state, policy) = testing::folded();
        let request = assemble::AssembleRequest {
            conversation: testing::CONV.into(),
            budget: Some(2_000),
            prompt: None,
            prompt_aware_eviction: false,
            summaries_as_they_are: false,
            // With the `delta` field.
            since: Some(assemble::Since {
                messages: 0,
                fingerprint: String::new(),
            }),
        };
        let reply = assemble::assemble_borrowed(state, &Resident, policy, &request).unwrap();
        assert!(reply.delta.is_some());
        assert!(!reply.assembled.sources.is_empty());
        assert_eq!(encode(&reply), serde_json::to_vec(&reply).unwrap());
    }

    #[test]
    fn error_reply_shape() {
        let e = ApiError::NotOwner {
            conversation: "a:b".into(),
            retry_after_ms: 250,
        };
        let v: serde_json::Value = serde_json::from_slice(&e.to_json()).unwrap();
        assert_eq!(v["error"]["code"], "not_owner");
        assert_eq!(v["error"]["retry_after_ms"], 250);
        assert_eq!(v["error"]["conversation"], "a:b");
        assert!(v["error"]["message"].as_str().unwrap().contains("250 ms"));
        let back = decode_reply::<serde_json::Value>(&e.to_json()).unwrap_err();
        assert_eq!(back, ReplyError::Api(e.body()));
        let bad = ApiError::BadRequest("x".into()).to_json();
        let v: serde_json::Value = serde_json::from_slice(&bad).unwrap();
        assert!(v["error"].get("retry_after_ms").is_none());
    }

    #[test]
    fn clip_counts_characters_not_bytes() {
        assert_eq!(clip("héllo", 2), "hé…");
        assert_eq!(clip("héllo", 5), "héllo");
    }
}
