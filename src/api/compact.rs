//! `compact`: a manual compaction request. The handler only builds and
//! checks the `compaction_requested` event; the transport publishes it into
//! the log, where the fold records (or coalesces) the debt. Its id comes
//! from the caller (`id`) or is derived from the caller's `request_id` and
//! the conversation, so a retried request is folded once.

use crate::api::{conversation, ApiError};
use crate::core::event::{CompactionRequested, Debt, Envelope, EventBody};
use crate::core::policy::{self, PolicyConfig};
use crate::core::state::State;
use serde::{Deserialize, Serialize};

/// Longest `instructions` accepted, in characters.
pub use crate::core::intake::limits::MAX_INSTRUCTIONS_CHARS;
/// Longest `id` / `request_id` accepted, in bytes.
pub const MAX_ID_BYTES: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompactRequest {
    pub conversation: String,
    /// What the summaries must keep or focus on.
    #[serde(default)]
    pub instructions: Option<String>,
    /// Compact down to this many context tokens (default: the policy's target).
    #[serde(default)]
    pub target_tokens: Option<u64>,
    /// Carried in the event (see `docs/api.md` on what the policy does with it).
    #[serde(default)]
    pub keep_recent_tokens: Option<u64>,
    /// The event id to publish under.
    #[serde(default)]
    pub id: Option<String>,
    /// A caller's idempotency key; the event id is derived from it.
    #[serde(default)]
    pub request_id: Option<String>,
    /// Event time (ms); default: the conversation's newest event time.
    #[serde(default)]
    pub time: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompactResponse {
    /// The event to publish, as a JSON envelope.
    pub event: Envelope,
    /// The debt the request will coalesce into, if one is pending.
    pub pending_debt: Option<Debt>,
    pub pending_job: Option<String>,
    /// Things the caller should know (the request would change nothing, ...).
    pub warnings: Vec<String>,
    /// The transport stored `event` in the log (the NATS service does);
    /// when false, the caller publishes it.
    #[serde(default)]
    pub published: bool,
}

/// The event id for a caller's `request_id` in a conversation. Includes the
/// conversation so the log's deduplication window (one per stream) never
/// merges two conversations' requests.
pub fn event_id_for_request(conversation: &str, request_id: &str) -> String {
    crate::core::derived_id::DerivedId::CompactionRequest {
        conversation,
        request_id,
    }
    .to_string()
}

pub fn compact(
    state: &State,
    policy: &PolicyConfig,
    req: &CompactRequest,
) -> Result<CompactResponse, ApiError> {
    let conv = conversation(state, &req.conversation)?;
    let bad = |m: String| Err(ApiError::BadRequest(m));
    if policy::session_matches(&policy.stateless_sessions, &conv.key) {
        return bad(format!(
            "{:?} matches policy.stateless_sessions: it is never compacted",
            conv.key
        ));
    }
    let id = match (&req.id, &req.request_id) {
        (Some(_), Some(_)) => return bad("give `id` or `request_id`, not both".into()),
        (Some(id), None) => id.clone(),
        (None, Some(r)) => {
            if r.is_empty() || r.len() > MAX_ID_BYTES {
                return bad(format!(
                    "`request_id` must be 1 to {MAX_ID_BYTES} bytes (got {})",
                    r.len()
                ));
            }
            event_id_for_request(&conv.key, r)
        }
        (None, None) => {
            return bad(
                "`compact` needs `id` (the event id) or `request_id` (an idempotency key) so a retried request is folded once"
                    .into(),
            )
        }
    };
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return bad(format!(
            "`id` must be 1 to {MAX_ID_BYTES} bytes (got {})",
            id.len()
        ));
    }
    let instructions = match &req.instructions {
        Some(text) if text.trim().is_empty() => {
            return bad("`instructions` is blank; omit it instead".into())
        }
        Some(text) if text.chars().count() > MAX_INSTRUCTIONS_CHARS => {
            return bad(format!(
            "`instructions` of {} characters exceeds the {MAX_INSTRUCTIONS_CHARS}-character limit",
            text.chars().count()
        ))
        }
        other => other.clone(),
    };
    let levels = policy::levels(conv, policy);
    if req.target_tokens == Some(0) {
        return bad("`target_tokens` must be at least 1".into());
    }
    if let Some(t) = req.target_tokens {
        if t > levels.budget {
            return bad(format!(
                "`target_tokens` {t} is above the conversation's budget of {} tokens",
                levels.budget
            ));
        }
    }
    if req.keep_recent_tokens == Some(0) {
        return bad(
            "`keep_recent_tokens` must be at least 1 (omit it for the policy's fresh tail)".into(),
        );
    }

    let mut warnings = Vec::new();
    let target = req.target_tokens.unwrap_or(levels.target_tokens);
    if conv.context.tokens() <= target {
        warnings.push(format!(
            "context is at {} tokens, already at or under the target of {target}: the request will be recorded and cleared without compacting",
            conv.context.tokens()
        ));
    }
    if req.keep_recent_tokens.is_some() {
        warnings.push(
            "keep_recent_tokens is recorded in the event; the fresh tail kept verbatim is set by policy.fresh_tail_count and policy.fresh_tail_max_tokens".into(),
        );
    }
    if conv.has_applied(&id) {
        warnings.push(format!(
            "event {id} was already folded: publishing it again changes nothing"
        ));
    }
    let event = Envelope::new(
        id,
        conv.key.clone(),
        req.time.unwrap_or(conv.last_time),
        EventBody::CompactionRequested(CompactionRequested {
            instructions,
            keep_recent_tokens: req.keep_recent_tokens,
            target_tokens: req.target_tokens,
        }),
    );
    event
        .validate()
        .map_err(|e| ApiError::BadRequest(format!("the event would be invalid: {e}")))?;
    Ok(CompactResponse {
        event,
        pending_debt: conv.debt.clone(),
        pending_job: conv.pending_job.as_ref().map(|p| p.job.job_id.clone()),
        warnings,
        published: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::{self, CONV};
    use crate::core::event::DebtReason;
    use crate::core::fold::{self, FoldStatus};

    fn req() -> CompactRequest {
        CompactRequest {
            conversation: CONV.into(),
            instructions: Some("keep the invoice numbers".into()),
            target_tokens: Some(1000),
            keep_recent_tokens: None,
            id: None,
            request_id: Some("req-1".into()),
            time: None,
        }
    }

    #[test]
    fn builds_an_event_the_fold_turns_into_urgent_manual_debt() {
        let (state, policy) = testing::folded();
        let out = compact(state, policy, &req()).unwrap();
        assert_eq!(out.event.id, event_id_for_request(CONV, "req-1"));
        assert_eq!(out.event.conversation, CONV);
        assert_eq!(out.event.time, testing::conv(state).last_time);
        assert!(out.warnings.is_empty(), "{:?}", out.warnings);
        // Same request, same id: a retry is folded once.
        assert_eq!(compact(state, policy, &req()).unwrap().event, out.event);

        let mut folded = state.clone();
        let result = fold::fold(&mut folded, policy, &out.event);
        assert_eq!(result.status, FoldStatus::Applied);
        let recorded = result.decisions.iter().find_map(|d| match &d.body {
            EventBody::DebtRecorded(debt) => Some(debt.clone()),
            _ => None,
        });
        let debt = recorded.expect("a manual debt is recorded");
        assert_eq!(debt.reason, DebtReason::Manual);
        assert!(debt.urgent);
        assert_eq!(debt.target_tokens, 1000);
        assert_eq!(
            debt.instructions.as_deref(),
            Some("keep the invoice numbers")
        );

        // Asking again for the folded id says it changes nothing.
        let again = compact(&folded, policy, &req()).unwrap();
        assert!(again.warnings.iter().any(|w| w.contains("already folded")));
    }

    #[test]
    fn the_request_id_is_scoped_to_the_conversation() {
        assert_ne!(
            event_id_for_request("a", "r1"),
            event_id_for_request("b", "r1")
        );
    }

    #[test]
    fn an_explicit_id_and_time_are_used() {
        let (state, policy) = testing::folded();
        let mut r = req();
        r.request_id = None;
        r.id = Some("my-event-1".into());
        r.time = Some(42);
        let out = compact(state, policy, &r).unwrap();
        assert_eq!((out.event.id.as_str(), out.event.time), ("my-event-1", 42));
    }

    #[test]
    fn a_request_that_would_change_nothing_is_flagged() {
        let (state, policy) = testing::folded();
        let mut r = req();
        r.target_tokens = Some(testing::conv(state).context.tokens());
        r.keep_recent_tokens = Some(500);
        let out = compact(state, policy, &r).unwrap();
        assert_eq!(out.warnings.len(), 2, "{:?}", out.warnings);
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let (state, policy) = testing::folded();
        let cases: Vec<(CompactRequest, &str)> = vec![
            (
                CompactRequest {
                    request_id: None,
                    ..req()
                },
                "needs `id`",
            ),
            (
                CompactRequest {
                    id: Some("x".into()),
                    ..req()
                },
                "not both",
            ),
            (
                CompactRequest {
                    instructions: Some("  ".into()),
                    ..req()
                },
                "blank",
            ),
            (
                CompactRequest {
                    instructions: Some("x".repeat(MAX_INSTRUCTIONS_CHARS + 1)),
                    ..req()
                },
                "limit",
            ),
            (
                CompactRequest {
                    target_tokens: Some(0),
                    ..req()
                },
                "at least 1",
            ),
            (
                CompactRequest {
                    target_tokens: Some(10_000_000),
                    ..req()
                },
                "above the conversation's budget",
            ),
            (
                CompactRequest {
                    request_id: Some(String::new()),
                    ..req()
                },
                "1 to 256 bytes",
            ),
        ];
        for (r, want) in cases {
            match compact(state, policy, &r) {
                Err(ApiError::BadRequest(m)) => assert!(m.contains(want), "{m} (want {want})"),
                other => panic!("expected bad_request for {r:?}, got {other:?}"),
            }
        }
        let stateless = PolicyConfig {
            stateless_sessions: vec!["team:*".parse().unwrap()],
            ..policy.clone()
        };
        assert!(matches!(
            compact(state, &stateless, &req()),
            Err(ApiError::BadRequest(m)) if m.contains("stateless")
        ));
    }
}
