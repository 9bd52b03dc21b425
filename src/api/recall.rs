//! `recall`: delegated recall. A question about a conversation's history is
//! answered by a model that reads the turns and summaries most relevant to
//! it, under a token cap and a deadline, with its spend counted in the
//! conversation's spend window.
//!
//! This module is the pure half, as `compact` is: [`prepare`] checks the
//! request and the spend window and plans what the model reads
//! ([`crate::core::recall::plan`]); [`answered_event`] builds the
//! `recall_answered` event that carries the spend into the log, whatever
//! the outcome; [`response`] is the reply. Running the plan against the
//! model, under the deadline, is the transport's (`runtime::recall`), as
//! is storing the event before it answers. [`crate::api::answer`] alone,
//! which cannot call a model, refuses `recall` with a `bad_request`.

use crate::api::{conversation, ApiError};
use crate::core::event::{Envelope, EventBody, RecallAnswered, RecallOutcome};
use crate::core::policy::PolicyConfig;
use crate::core::recall::{self, RecallError, RecallPlan, RecallSource};
use crate::core::spend;
use crate::core::state::{State, TurnBodies};
use crate::core::tokens::Encoding;
use crate::summarizer::CallRecord;
use serde::{Deserialize, Serialize};

/// The largest cap a request may ask for.
pub const MAX_MAX_TOKENS: u64 = 100_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecallRequest {
    pub conversation: String,
    /// What to find out from the history (at most 4000 characters).
    pub question: String,
    /// Cap on the tokens the model reads: the whole prompt (default
    /// `recall.max_tokens`, at most 100000).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// An idempotency key: the event id is `recall_` + 24 hex digits of
    /// BLAKE3(conversation, NUL, request_id). A transport gives a fresh one
    /// when the request has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// What the model's configuration gives the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecallLimits {
    /// Cap when the request names none.
    pub default_max_tokens: u64,
    /// Output cap of the answer (reserved from a token limit of the window).
    pub max_answer_tokens: u64,
    /// The recall model's tokenizer.
    pub encoding: Encoding,
}

/// A planned recall, ready for the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    pub conversation: String,
    pub question: String,
    pub plan: RecallPlan,
    /// The cap the plan was made under (the request's, or less when the
    /// spend window's token limit leaves less).
    pub max_tokens: u64,
    /// Calls the spend window still allows.
    pub max_calls: u32,
    /// The event time of the `recall_answered` event: the conversation's
    /// newest event time (the fold never reads a clock).
    pub time: u64,
    pub event_id: String,
}

/// The reply to a recall the model answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecallResponse {
    pub conversation: String,
    pub answer: String,
    /// What the model read, in the order it read it.
    pub sources: Vec<RecallSource>,
    /// What the answer names that the model was not given: cited ids not
    /// among `sources`, identifiers neither they nor the question hold
    /// ([`recall::unsupported_in_answer`]). Empty when every citation and
    /// identifier checks out.
    #[serde(default)]
    pub unsupported: Vec<String>,
    pub max_tokens: u64,
    /// Tokens of the prompt it was sent (our count; never over `max_tokens`).
    pub tokens: u64,
    /// Items of the history that held a term of the question.
    pub matched: usize,
    /// Of those, left out for want of room.
    pub left_out: usize,
    pub model: String,
    pub provider: String,
    pub calls: u32,
    pub tokens_spent: u64,
    pub cost_micros: u64,
    pub deadline_ms: u64,
    pub elapsed_ms: u64,
    pub outcome: RecallOutcome,
    /// The `recall_answered` event that counts the spend.
    pub event_id: String,
    /// Whether the transport stored that event before answering.
    pub published: bool,
}

/// The event id of a recall.
pub fn event_id(conversation: &str, request_id: &str) -> String {
    crate::core::derived_id::DerivedId::Recall {
        conversation,
        request_id,
    }
    .to_string()
}

fn spend_refusal(conversation: &str, detail: String) -> ApiError {
    ApiError::SpendExhausted {
        conversation: conversation.to_string(),
        detail,
    }
}

/// Checks a recall request and the spend window, and plans what the model
/// reads. `request_id` must be set (the transport fills it in).
pub fn prepare(
    state: &State,
    bodies: &dyn TurnBodies,
    policy: &PolicyConfig,
    req: &RecallRequest,
    limits: &RecallLimits,
) -> Result<Prepared, ApiError> {
    let conv = conversation(state, &req.conversation)?;
    let Some(request_id) = req.request_id.as_deref().filter(|r| !r.is_empty()) else {
        return Err(ApiError::BadRequest(
            "`request_id` is empty: a recall needs an idempotency key".into(),
        ));
    };
    let requested = req.max_tokens.unwrap_or(limits.default_max_tokens);
    if requested == 0 || requested > MAX_MAX_TOKENS {
        return Err(ApiError::BadRequest(format!(
            "`max_tokens` must be between 1 and {MAX_MAX_TOKENS} (got {requested})"
        )));
    }
    // The spend window as the fold will count this recall: at the
    // partition's clock.
    let now = state.clock.now;
    let window = policy.summary_call_window_ms;
    let mut own = conv.spend.clone();
    own.prune(now, window);
    let mut partition = state.spend.clone();
    partition.prune(now, window);
    let allowance = spend::allowance(&own, &partition, &conv.key, &policy.spend_limits(), now);
    let totals = allowance.own;
    if allowance.calls_left == 0 {
        return Err(spend_refusal(
            &conv.key,
            format!(
                "no model call is left in the spend window ({} calls in the last {window} ms of \
                 conversation time; summary_max_calls_per_window is {}{})",
                totals.calls,
                policy.summary_max_calls_per_window,
                if allowance.partition.is_some() {
                    ", partition-wide limits included"
                } else {
                    ""
                }
            ),
        ));
    }
    if allowance.cost_left == Some(0) {
        return Err(spend_refusal(
            &conv.key,
            format!(
                "no money is left in the spend window ({} micro-dollars in the last {window} ms)",
                totals.cost_micros
            ),
        ));
    }
    let mut max_tokens = requested;
    if let Some(left) = allowance.tokens_left {
        let readable = left.saturating_sub(limits.max_answer_tokens);
        if readable == 0 {
            return Err(spend_refusal(
                &conv.key,
                format!(
                    "{left} tokens are left in the spend window, not more than the answer's own \
                     cap of {} (recall.max_answer_tokens)",
                    limits.max_answer_tokens
                ),
            ));
        }
        max_tokens = max_tokens.min(readable);
    }
    let plan = recall::plan(conv, bodies, &req.question, max_tokens, limits.encoding).map_err(
        |e| match e {
            RecallError::Body(b) => ApiError::from(b),
            RecallError::CapTooSmall { .. } if max_tokens < requested => spend_refusal(
                &conv.key,
                format!("the spend window's token limit leaves too little to read: {e}"),
            ),
            other => ApiError::BadRequest(other.to_string()),
        },
    )?;
    Ok(Prepared {
        conversation: conv.key.clone(),
        question: req.question.trim().to_string(),
        plan,
        max_tokens,
        max_calls: allowance.calls_left,
        time: now,
        event_id: event_id(&conv.key, request_id),
    })
}

/// The model's side of a recall, as the transport saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRun {
    pub outcome: RecallOutcome,
    /// The answer (for `answered`).
    pub answer: Option<String>,
    /// The model that answered, or the one asked last.
    pub model: Option<String>,
    pub provider: String,
    /// Why it did not answer, in words.
    pub detail: Option<String>,
    pub calls: Vec<CallRecord>,
    pub deadline_ms: u64,
    pub elapsed_ms: u64,
}

impl ModelRun {
    fn tokens_spent(&self) -> u64 {
        self.calls.iter().map(CallRecord::tokens).sum()
    }

    fn cost_micros(&self) -> u64 {
        self.calls.iter().map(|c| c.cost_micros).sum()
    }
}

/// The `recall_answered` event that counts a recall's spend (stored by
/// the service, on its own subject).
pub fn answered_event(prepared: &Prepared, run: &ModelRun) -> Envelope {
    Envelope::new(
        prepared.event_id.clone(),
        prepared.conversation.clone(),
        prepared.time,
        EventBody::RecallAnswered(RecallAnswered {
            question_digest: recall::question_digest(&prepared.question),
            outcome: run.outcome,
            detail: run.detail.clone(),
            model: run.model.clone(),
            calls: u32::try_from(run.calls.len()).unwrap_or(u32::MAX),
            tokens_spent: run.tokens_spent(),
            cost_micros: run.cost_micros(),
            prompt_tokens: prepared.plan.tokens,
            sources: prepared
                .plan
                .sources
                .iter()
                .map(RecallSource::citation)
                .collect(),
        }),
    )
}

/// The reply: the answer, or the typed error of a deadline or a failure.
/// `published`: the transport stored the event.
pub fn response(
    prepared: &Prepared,
    run: &ModelRun,
    published: bool,
) -> Result<RecallResponse, ApiError> {
    let calls = u32::try_from(run.calls.len()).unwrap_or(u32::MAX);
    match (run.outcome, &run.answer) {
        (RecallOutcome::Answered, Some(answer)) => Ok(RecallResponse {
            conversation: prepared.conversation.clone(),
            answer: answer.clone(),
            sources: prepared.plan.sources.clone(),
            unsupported: recall::unsupported_in_answer(&prepared.plan, answer),
            max_tokens: prepared.max_tokens,
            tokens: prepared.plan.tokens,
            matched: prepared.plan.matched,
            left_out: prepared.plan.left_out,
            model: run.model.clone().unwrap_or_default(),
            provider: run.provider.clone(),
            calls,
            tokens_spent: run.tokens_spent(),
            cost_micros: run.cost_micros(),
            deadline_ms: run.deadline_ms,
            elapsed_ms: run.elapsed_ms,
            outcome: RecallOutcome::Answered,
            event_id: prepared.event_id.clone(),
            published,
        }),
        (RecallOutcome::Deadline, _) => Err(ApiError::DeadlineExceeded {
            conversation: prepared.conversation.clone(),
            deadline_ms: run.deadline_ms,
            calls,
        }),
        _ => Err(ApiError::ModelFailed(format!(
            "recall of {:?} got no answer from {}: {} ({calls} calls, counted in the spend window)",
            prepared.conversation,
            run.provider,
            run.detail.as_deref().unwrap_or("no detail")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::{self, CONV, NEEDLE};
    use crate::core::spend::SpendEntry;
    use crate::core::state::Resident;

    fn limits() -> RecallLimits {
        RecallLimits {
            default_max_tokens: 2000,
            max_answer_tokens: 300,
            encoding: Encoding::O200kBase,
        }
    }

    fn req(question: &str) -> RecallRequest {
        RecallRequest {
            conversation: CONV.into(),
            question: question.into(),
            max_tokens: None,
            request_id: Some("r1".into()),
        }
    }

    fn run(outcome: RecallOutcome, calls: usize) -> ModelRun {
        let call = CallRecord {
            model: "m".into(),
            provider: "p".into(),
            latency_ms: 3,
            prompt_tokens_provider: Some(900),
            completion_tokens_provider: Some(40),
            prompt_tokens_ours: 880,
            completion_tokens_ours: 41,
            cost_micros: 17,
            outcome: crate::summarizer::CallOutcome::Ok,
        };
        ModelRun {
            outcome,
            answer: (outcome == RecallOutcome::Answered).then(|| "turn 0".to_string()),
            model: Some("m".into()),
            provider: "p".into(),
            detail: None,
            calls: vec![call; calls],
            deadline_ms: 500,
            elapsed_ms: 20,
        }
    }

    #[test]
    fn a_request_is_planned_under_the_default_cap_at_conversation_time() {
        let (state, policy) = testing::folded();
        let p = prepare(state, &Resident, policy, &req(NEEDLE), &limits()).unwrap();
        assert_eq!(p.max_tokens, 2000);
        assert!(p.plan.tokens <= 2000);
        assert_eq!(p.time, testing::conv(state).last_time);
        assert_eq!(p.event_id, event_id(CONV, "r1"));
        assert_ne!(p.event_id, event_id(CONV, "r2"));
        assert!(p.max_calls > 0);
    }

    #[test]
    fn the_event_carries_the_spend_and_the_reply_the_outcome() {
        let (state, policy) = testing::folded();
        let p = prepare(state, &Resident, policy, &req(NEEDLE), &limits()).unwrap();
        let ok = run(RecallOutcome::Answered, 2);
        let e = answered_event(&p, &ok);
        let EventBody::RecallAnswered(r) = &e.body else {
            panic!("a recall_answered event");
        };
        assert_eq!((r.calls, r.tokens_spent, r.cost_micros), (2, 1880, 34));
        assert_eq!(r.sources.len(), p.plan.sources.len());
        assert!(!r.question_digest.contains(NEEDLE));
        let reply = response(&p, &ok, true).unwrap();
        assert_eq!(reply.answer, "turn 0");
        assert_eq!(reply.calls, 2);
        let late = run(RecallOutcome::Deadline, 1);
        let err = response(&p, &late, true).unwrap_err();
        assert!(matches!(err, ApiError::DeadlineExceeded { .. }), "{err}");
        assert!(err.to_string().contains("500 ms"), "{err}");
        let failed = run(RecallOutcome::Failed, 1);
        assert!(matches!(
            response(&p, &failed, true),
            Err(ApiError::ModelFailed(_))
        ));
    }

    #[test]
    fn an_exhausted_spend_window_refuses_with_the_reason() {
        let (state, policy) = testing::folded();
        let mut state = state.clone();
        let conv = state.conversations.get_mut(CONV).unwrap();
        conv.spend.recent.push(SpendEntry {
            time: conv.last_time,
            job_id: "j".into(),
            conversation: String::new(),
            calls: policy.summary_max_calls_per_window,
            tokens: 0,
            cost_micros: 0,
            reserved_until: None,
            urgent: false,
        });
        let err = prepare(&state, &Resident, policy, &req(NEEDLE), &limits()).unwrap_err();
        assert!(matches!(err, ApiError::SpendExhausted { .. }), "{err}");
        assert!(err.to_string().contains("spend window"), "{err}");
        // A token limit shrinks the cap to what it leaves.
        let mut tight = policy.clone();
        tight.summary_max_calls_per_window = 1_000;
        tight.summary_max_tokens_per_window = Some(1_500);
        let p = prepare(&state, &Resident, &tight, &req(NEEDLE), &limits()).unwrap();
        assert_eq!(p.max_tokens, 1_200);
        assert!(p.plan.tokens <= 1_200);
    }

    #[test]
    fn bad_requests() {
        let (state, policy) = testing::folded();
        let mut r = req(NEEDLE);
        r.max_tokens = Some(MAX_MAX_TOKENS + 1);
        assert!(matches!(
            prepare(state, &Resident, policy, &r, &limits()),
            Err(ApiError::BadRequest(_))
        ));
        let mut r = req(NEEDLE);
        r.request_id = None;
        assert!(matches!(
            prepare(state, &Resident, policy, &r, &limits()),
            Err(ApiError::BadRequest(_))
        ));
        assert!(matches!(
            prepare(state, &Resident, policy, &req(" "), &limits()),
            Err(ApiError::BadRequest(_))
        ));
        let mut r = req(NEEDLE);
        r.conversation = "nobody".into();
        assert!(matches!(
            prepare(state, &Resident, policy, &r, &limits()),
            Err(ApiError::UnknownConversation { .. })
        ));
    }
}
