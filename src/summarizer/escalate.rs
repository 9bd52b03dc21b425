//! Escalation: what to do with what the layer below wrote, for summaries
//! and rolling states alike.
//!
//! A summary answer is checked ([`super::checks`]); a refused or unusable
//! one escalates normal -> aggressive (shorter target) -> the deterministic
//! summary, marked `fallback` (to be re-summarized when a model answers
//! again). An accepted answer is anchored to the deterministic summary of
//! the same span: the facts code can check that the deterministic summary
//! keeps and the answer misses (a request, an error, a decision, a file
//! changed) are added as the deterministic summary's own lines
//! ([`Floor::complete`]), and under the strict identifier policy so are
//! the identifiers it keeps: one retry naming the missing ones, then an
//! "Exact identifiers" section. The deterministic summary ranked those
//! identifiers and fitted them to the target, so a model's summary costs
//! no more room than the fallback would; a compaction never fails because
//! of identifiers. A refused rolling state, or none at all (no model
//! answered), is replaced by the deterministic one, and the outcome says
//! why.
//!
//! What escalation never does: escalate or fall back over a spend refusal
//! ([`SummarizeError::OverBudget`]) of a pass's first call, a rate limit or
//! an auth failure. Those pass through untouched, so the sweep can wait for
//! the window, the Retry-After, or a fixed key. A spend refusal after the
//! pass spent a call on a refused answer ends it with the fallback, as a
//! refusal inside a model chain does ([`super::LlmSummarizer`]): the span
//! is not left, with what it cost, for nothing.

use super::checks::{
    append_identifiers_within, check, deterministic_identifiers, missing_identifiers,
    retry_is_better, unusable_kind, Rejection,
};
use super::deterministic::DeterministicSummarizer;
use super::floor::Floor;
use super::prompts;
use super::{
    Budget, CallOutcome, CallRecord, RollingOutcome, SummarizeError, Summarizer, SummarizerConfig,
    SummaryOutcome,
};
use crate::core::summary::{IdentifierPolicy, RollingStateRequest, SummaryRequest};
use crate::core::tokens::Encoding;
use crate::telemetry;
use std::borrow::Cow;

/// Marks the last successful call of a batch as having produced rejected
/// output, so the records say why it was not used.
fn mark_invalid(calls: &mut [CallRecord], reason: &str) {
    if let Some(last) = calls.iter_mut().rev().find(|c| c.outcome.is_ok()) {
        last.outcome = CallOutcome::Invalid(reason.to_string());
    }
}

/// Validation and escalation around another summarizer.
#[derive(Debug)]
pub struct EscalatingSummarizer<S> {
    inner: S,
    overage_factor: f64,
    aggressive_target_factor: f64,
    fallback_on_unavailable: bool,
    name: String,
}

/// What one escalation carries through its attempts: the floor every
/// answer is held to, the budget every call is charged to, and the calls
/// made so far.
struct Escalation<'a> {
    floor: Floor,
    budget: &'a Budget,
    calls: Vec<CallRecord>,
}

/// What one stage produced.
enum Stage {
    Accepted(SummaryOutcome),
    /// The text was rejected (or the answer unusable): escalate.
    Rejected {
        reason: String,
        /// The answer echoed the previous summary.
        copied_previous: bool,
    },
    /// No model could answer: go to the fallback if configured.
    Unavailable(String),
}

impl<S: Summarizer> EscalatingSummarizer<S> {
    pub fn new(inner: S, config: &SummarizerConfig) -> Self {
        let name = format!("escalating({})", inner.name());
        EscalatingSummarizer {
            inner,
            overage_factor: config.summary_max_overage_factor,
            aggressive_target_factor: config.aggressive_target_factor,
            fallback_on_unavailable: config.fallback_on_unavailable,
            name,
        }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn aggressive(&self, req: &SummaryRequest) -> SummaryRequest {
        let mut out = req.clone();
        out.aggressive = true;
        out.target_tokens =
            ((req.target_tokens as f64 * self.aggressive_target_factor).round() as u64).max(1);
        out
    }

    /// One call through the inner summarizer with `req`, its answer
    /// validated against `against`: `req` itself, or `req` with the
    /// previous summary it was sent without (an answer must not copy it
    /// even when it was not shown).
    async fn attempt(
        &self,
        req: &SummaryRequest,
        against: &SummaryRequest,
        run: &mut Escalation<'_>,
    ) -> Result<Stage, SummarizeError> {
        let calls = &mut run.calls;
        let floor = &run.floor;
        match self.inner.summarize(req, run.budget).await {
            Ok(mut outcome) => {
                let encoding = Encoding::for_model(Some(&outcome.draft.model));
                let checked = check(
                    against,
                    &outcome.draft.content,
                    encoding,
                    self.overage_factor,
                )
                .and_then(|text| Ok(floor.complete(&text, self.room(against))?));
                match checked {
                    Ok(text) => {
                        outcome.draft.content = text;
                        calls.append(&mut outcome.calls);
                        Ok(Stage::Accepted(outcome))
                    }
                    Err(rejection) => {
                        let reason = rejection.to_string();
                        let copied_previous =
                            matches!(&rejection, Rejection::Copy(c) if c.is_previous_summary());
                        mark_invalid(&mut outcome.calls, &reason);
                        calls.append(&mut outcome.calls);
                        tracing::warn!(summarizer = %self.inner.name(), %reason, "summary rejected");
                        telemetry::ValidationRejected {
                            kind: rejection.kind(),
                        }
                        .emit();
                        Ok(Stage::Rejected {
                            reason,
                            copied_previous,
                        })
                    }
                }
            }
            Err(SummarizeError::Invalid {
                reason,
                calls: mut c,
            }) => {
                calls.append(&mut c);
                let kind = unusable_kind(&reason);
                tracing::warn!(summarizer = %self.inner.name(), %reason, kind, "summary rejected");
                telemetry::ValidationRejected { kind }.emit();
                Ok(Stage::Rejected {
                    reason,
                    copied_previous: false,
                })
            }
            Err(SummarizeError::Unavailable {
                reason,
                calls: mut c,
            }) if self.fallback_on_unavailable => {
                calls.append(&mut c);
                Ok(Stage::Unavailable(reason))
            }
            Err(e) => Err(e),
        }
    }

    /// Under the strict policy: one retry naming the missing identifiers,
    /// then the deterministic section for whatever is still missing.
    async fn keep_identifiers(
        &self,
        req: &SummaryRequest,
        against: &SummaryRequest,
        ids: &[String],
        mut outcome: SummaryOutcome,
        run: &mut Escalation<'_>,
    ) -> SummaryOutcome {
        let missing = missing_identifiers(ids, &outcome.draft.content);
        if missing.is_empty() {
            return outcome;
        }
        let retry = prompts::with_missing_identifiers(req, &missing);
        // Any failure of the retry keeps the valid first draft: identifiers
        // are then appended, never a reason to fail.
        // The retry passed `check` (a refusal does not); it replaces the
        // first draft only when it is better, a tie keeps the first.
        if let Ok(Stage::Accepted(retried)) = self.attempt(&retry, against, run).await {
            if retry_is_better(ids, &outcome.draft.content, &retried.draft.content) {
                outcome.draft = retried.draft;
            } else {
                tracing::warn!(
                    summarizer = %self.inner.name(),
                    "identifier retry kept the first draft: the retry was not better"
                );
                telemetry::ValidationRejected { kind: "not_better" }.emit();
            }
        }
        let still = missing_identifiers(ids, &outcome.draft.content);
        outcome.draft.content =
            append_identifiers_within(&outcome.draft.content, &still, self.room(req));
        outcome
    }

    /// The most a summary of `req` may cost with its identifier section:
    /// under its source (or the pass makes no progress) and within the
    /// overage factor of its target.
    fn room(&self, req: &SummaryRequest) -> u64 {
        let source = req.source_tokens();
        // The fold counts the rendered summary (its wrapper too): a margin.
        let under_source = source.saturating_sub(source / 10 + 32);
        let over_target = (req.target_tokens as f64 * self.overage_factor) as u64;
        under_source.min(over_target.max(req.target_tokens))
    }
}

impl<S: Summarizer> Summarizer for EscalatingSummarizer<S> {
    async fn summarize(
        &self,
        req: &SummaryRequest,
        budget: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let strict = req.identifier_policy == IdentifierPolicy::Strict;
        let mut why_fallback = String::new();
        let mut copied_previous = false;
        // The deterministic summary of the same request: what a model's
        // answer must at least keep, and the fallback when none does.
        let fallback = DeterministicSummarizer::draft_off_runtime(req).await;
        let ids = if strict {
            deterministic_identifiers(req, &fallback.content)
        } else {
            Vec::new()
        };
        let mut run = Escalation {
            floor: Floor::new(&req.sources, &fallback.content),
            budget,
            calls: Vec::new(),
        };
        for i in 0..2 {
            // What is validated: the stage's request with the previous
            // summary, whether or not it is sent.
            let against = if i == 0 {
                Cow::Borrowed(req)
            } else {
                telemetry::Escalated { kind: "aggressive" }.emit();
                Cow::Owned(self.aggressive(req))
            };
            // A small model that echoed the previous summary echoes it
            // again when shown it: the retry is sent without it.
            let stage_req = if i > 0 && copied_previous {
                Cow::Owned(SummaryRequest {
                    previous_summary: None,
                    ..against.as_ref().clone()
                })
            } else {
                Cow::Borrowed(against.as_ref())
            };
            let stage = match self.attempt(&stage_req, &against, &mut run).await {
                Ok(stage) => stage,
                // The allowance ran out after this pass spent a call on a
                // refused answer: as when it runs out inside a model chain
                // (an outage to the escalation), the pass ends with the
                // fallback rather than leaving its span, and its spend,
                // for nothing.
                Err(SummarizeError::OverBudget { calls: mut c })
                    if !run.calls.is_empty() && self.fallback_on_unavailable =>
                {
                    run.calls.append(&mut c);
                    why_fallback = format!(
                        "{why_fallback}; the spend allowance cannot pay for another attempt"
                    );
                    break;
                }
                Err(e) => return Err(e.prepend_calls(run.calls)),
            };
            match stage {
                Stage::Accepted(outcome) => {
                    let mut outcome = if strict {
                        self.keep_identifiers(&stage_req, &against, &ids, outcome, &mut run)
                            .await
                    } else {
                        outcome
                    };
                    outcome.calls = run.calls;
                    return Ok(outcome);
                }
                Stage::Rejected {
                    reason,
                    copied_previous: copied,
                } => {
                    why_fallback = reason;
                    copied_previous = copied;
                }
                Stage::Unavailable(reason) => {
                    why_fallback = reason;
                    break;
                }
            }
        }
        tracing::warn!(
            conversation_id = %req.conversation,
            reason = %why_fallback,
            "writing the deterministic fallback summary"
        );
        telemetry::Escalated { kind: "fallback" }.emit();
        // The deterministic summary as it is: it already keeps the
        // identifiers it ranked first, within its target.
        let mut draft = fallback;
        // Written in a model's place: re-summarized when one answers again.
        draft.fallback = true;
        Ok(SummaryOutcome {
            draft,
            calls: run.calls,
        })
    }

    async fn rolling_state(
        &self,
        req: &RollingStateRequest,
        budget: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        let (refused, calls) = match self.inner.rolling_state(req, budget).await {
            Ok(outcome) => return Ok(outcome),
            // A refused answer: the deterministic state (better than a
            // stale one), and the sweep says why.
            Err(SummarizeError::Invalid { reason, calls }) => (Some(reason), calls),
            // No answer at all (timeouts, 5xx): the deterministic state is
            // still better than a stale one; the calls are spent.
            Err(SummarizeError::Unavailable { calls, .. }) => (None, calls),
            Err(e) => return Err(e),
        };
        Ok(RollingOutcome {
            state: DeterministicSummarizer::rolling_state_off_runtime(req).await,
            calls,
            refused,
        })
    }

    fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::message::Role;
    use crate::core::summary::{SourceItem, SummaryDraft};
    use crate::summarizer::checks::tests::{req, with_previous, PREVIOUS, REFUSAL, SOURCE};
    use std::collections::VecDeque;
    use std::sync::Mutex;

    /// A summarizer answering from a script, recording the requests.
    struct Scripted {
        answers: Mutex<VecDeque<Result<&'static str, SummarizeError>>>,
        seen: Mutex<Vec<SummaryRequest>>,
    }

    impl Scripted {
        fn new(answers: Vec<Result<&'static str, SummarizeError>>) -> Self {
            Scripted {
                answers: Mutex::new(answers.into()),
                seen: Mutex::new(Vec::new()),
            }
        }
    }

    use crate::testing::call_record as call;

    impl Summarizer for Scripted {
        async fn summarize(
            &self,
            req: &SummaryRequest,
            _: &Budget,
        ) -> Result<SummaryOutcome, SummarizeError> {
            self.seen.lock().unwrap().push(req.clone());
            let next = self.answers.lock().unwrap().pop_front();
            match next {
                Some(Ok(text)) => Ok(SummaryOutcome {
                    draft: SummaryDraft {
                        content: text.into(),
                        model: "m".into(),
                        provider: "p".into(),
                        prompt_version: prompts::PROMPT_VERSION.into(),
                        fallback: false,
                    },
                    calls: vec![call(CallOutcome::Ok)],
                }),
                Some(Err(e)) => Err(e),
                None => panic!("script exhausted"),
            }
        }
        async fn rolling_state(
            &self,
            _: &RollingStateRequest,
            _: &Budget,
        ) -> Result<RollingOutcome, SummarizeError> {
            Err(SummarizeError::Unavailable {
                reason: "scripted summaries only".into(),
                calls: Vec::new(),
            })
        }
        fn name(&self) -> &str {
            "scripted"
        }
    }

    fn escalating(
        answers: Vec<Result<&'static str, SummarizeError>>,
    ) -> EscalatingSummarizer<Scripted> {
        EscalatingSummarizer::new(Scripted::new(answers), &SummarizerConfig::default())
    }

    impl EscalatingSummarizer<Scripted> {
        async fn summarize_unlimited(
            &self,
            req: &SummaryRequest,
        ) -> Result<SummaryOutcome, SummarizeError> {
            self.summarize(req, &Budget::unlimited()).await
        }
    }

    #[tokio::test]
    async fn a_spend_refusal_falls_back_only_after_the_pass_spent_a_call() {
        let over = || SummarizeError::OverBudget { calls: Vec::new() };
        // The allowance paid for one answer, refused: the pass still ends
        // with a summary, the fallback, and the call it cost is recorded.
        let s = escalating(vec![Ok(REFUSAL), Err(over())]);
        let out = s
            .summarize_unlimited(&req(SOURCE, 2000, 400))
            .await
            .unwrap();
        assert!(out.draft.fallback);
        assert_eq!(out.calls.len(), 1);
        assert!(
            matches!(&out.calls[0].outcome, CallOutcome::Invalid(r) if r.starts_with("refusal")),
            "{:?}",
            out.calls[0].outcome
        );
        // Nothing spent yet: the refusal passes through (the work waits for
        // the window).
        let s = escalating(vec![Err(over())]);
        assert!(matches!(
            s.summarize_unlimited(&req(SOURCE, 2000, 400)).await,
            Err(SummarizeError::OverBudget { .. })
        ));
        // Without the fallback configured, it passes through either way.
        let config = SummarizerConfig {
            fallback_on_unavailable: false,
            ..SummarizerConfig::default()
        };
        let s = EscalatingSummarizer::new(Scripted::new(vec![Ok(REFUSAL), Err(over())]), &config);
        assert!(matches!(
            s.summarize_unlimited(&req(SOURCE, 2000, 400)).await,
            Err(SummarizeError::OverBudget { calls }) if calls.len() == 1
        ));
    }

    #[tokio::test]
    async fn a_refused_retry_never_replaces_a_valid_draft() {
        let first = "The assistant investigated why the deploy failed and found the service \
                     could not reach its backend after the last build was rolled out.";
        let s = escalating(vec![Ok(first), Ok(REFUSAL)]);
        let out = s
            .summarize_unlimited(&req(SOURCE, 2000, 400))
            .await
            .unwrap();
        assert!(!out.draft.fallback);
        assert!(
            out.draft.content.starts_with(first),
            "{:?}",
            out.draft.content
        );
        assert!(!out.draft.content.contains("sorry"));
        assert!(out.draft.content.contains("- 9fceb02d0ae5"));
        assert_eq!(out.calls.len(), 2);
        assert!(
            matches!(&out.calls[1].outcome, CallOutcome::Invalid(r) if r.starts_with("refusal")),
            "{:?}",
            out.calls[1].outcome
        );
    }

    #[tokio::test]
    async fn a_retry_after_a_copy_of_the_previous_summary_is_sent_without_it() {
        // 13 of the real 0.5B model's 16 rejections were copies of the
        // previous summary: shown it again, it echoes it again.
        let fresh = "Continuing the DICOM fix, the assistant found the transfer syntax \
                     constant in pydicom/uid.py beside the other syntax UIDs.";
        let s = escalating(vec![Ok(PREVIOUS), Ok(fresh)]);
        let out = s
            .summarize_unlimited(&with_previous(PREVIOUS))
            .await
            .unwrap();
        assert!(!out.draft.fallback, "{:?}", out.draft.content);
        assert!(
            out.draft.content.starts_with(fresh),
            "{:?}",
            out.draft.content
        );
        let seen = s.inner().seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 2);
        assert!(seen[0].previous_summary.is_some());
        assert!(seen[1].aggressive);
        assert_eq!(
            seen[1].previous_summary, None,
            "the retry is sent without it"
        );
        // A copy is refused even when the previous summary was not shown.
        let s = escalating(vec![Ok(PREVIOUS), Ok(PREVIOUS)]);
        let out = s
            .summarize_unlimited(&with_previous(PREVIOUS))
            .await
            .unwrap();
        assert!(out.draft.fallback);
        assert!(
            matches!(&out.calls[1].outcome, CallOutcome::Invalid(r) if r.starts_with("copy of the previous summary")),
            "{:?}",
            out.calls[1].outcome
        );
        // Any other rejection keeps the previous summary in the retry.
        let s = escalating(vec![Ok(REFUSAL), Ok(fresh)]);
        s.summarize_unlimited(&with_previous(PREVIOUS))
            .await
            .unwrap();
        let seen = s.inner().seen.lock().unwrap().clone();
        assert!(seen[1].previous_summary.is_some());
    }

    #[tokio::test]
    async fn a_retry_that_is_no_better_keeps_the_first_draft() {
        let first = "The deploy of build 9fceb02d0ae5 failed on the new host.";
        // Same missing count (a tie): the first stays.
        let tie = "The deploy of build 9fceb02d0ae5 failed again on the new host today.";
        let s = escalating(vec![Ok(first), Ok(tie)]);
        let out = s
            .summarize_unlimited(&req(SOURCE, 2000, 400))
            .await
            .unwrap();
        assert!(
            out.draft.content.starts_with(first),
            "{:?}",
            out.draft.content
        );
        let ids: Vec<String> = ["9fceb02d0ae5", "10.0.4.17:8443", "/var/log/app/deploy.log"]
            .map(String::from)
            .to_vec();
        // More identifiers but one the first kept is lost: not better.
        assert!(!retry_is_better(
            &ids,
            first,
            "Deploy to 10.0.4.17:8443 failed, see logs."
        ));
        // More identifiers, none lost: better.
        assert!(retry_is_better(
            &ids,
            first,
            "The deploy of build 9fceb02d0ae5 to 10.0.4.17:8443 failed on the new host."
        ));
        // Collapsed to a bare list: not better.
        assert!(!retry_is_better(
            &ids,
            PREVIOUS,
            "9fceb02d0ae5 10.0.4.17:8443"
        ));
    }

    #[tokio::test]
    async fn truncated_answers_are_counted_and_escalate() {
        let truncated = || SummarizeError::Invalid {
            reason: "m: truncated at the output cap (finish_reason length)".into(),
            calls: vec![call(CallOutcome::Invalid(
                "truncated at the output cap (finish_reason length)".into(),
            ))],
        };
        let before = telemetry::summary_tally();
        let s = escalating(vec![Err(truncated()), Err(truncated())]);
        let out = s
            .summarize_unlimited(&req(SOURCE, 2000, 400))
            .await
            .unwrap();
        assert!(out.draft.fallback);
        let after = telemetry::summary_tally();
        let grew = |key: (&'static str, &'static str)| {
            after.get(&key).copied().unwrap_or(0) - before.get(&key).copied().unwrap_or(0)
        };
        assert!(grew(("rejected", "truncated")) >= 2);
        assert!(grew(("escalated", "fallback")) >= 1);
    }

    #[tokio::test]
    async fn escalates_normal_then_aggressive_then_fallback() {
        let s = escalating(vec![
            Ok("Let me think about this first."),
            Ok("Sure, I'll help with the deploy."),
        ]);
        let out = s
            .summarize_unlimited(&req(SOURCE, 2000, 400))
            .await
            .unwrap();
        assert!(out.draft.fallback);
        assert_eq!(out.calls.len(), 2);
        assert!(out
            .calls
            .iter()
            .all(|c| matches!(c.outcome, CallOutcome::Invalid(_))));
        let seen = s.inner.seen.lock().unwrap();
        assert!(!seen[0].aggressive);
        assert!(seen[1].aggressive);
        assert_eq!(seen[1].target_tokens, 200);
        // Strict: the fallback keeps every identifier.
        for id in ["9fceb02d0ae5", "10.0.4.17:8443", "/var/log/app/deploy.log"] {
            assert!(
                out.draft.content.contains(id),
                "{id} in {:?}",
                out.draft.content
            );
        }
    }

    /// A model's answer that misses facts the deterministic summary of the
    /// same span keeps gets the deterministic lines for them; an answer
    /// that has no room for them is refused, and the next one is stored.
    #[tokio::test]
    async fn an_answer_below_the_deterministic_summary_is_anchored_or_refused() {
        let turns = vec![
            SourceItem {
                label: "turn 1".into(),
                role: Some(Role::User),
                tool: None,
                text: "Add an upsert for messages, keyed by session and uuid.".into(),
                tokens: 600,
                time: 0,
                ..SourceItem::default()
            },
            SourceItem {
                label: "turn 2".into(),
                role: Some(Role::Assistant),
                tool: Some("Edit".into()),
                text: "Now add the identity.\nEdit({\"file_path\":\"lib/spotter/message.ex\",\
                       \"old_string\":\"end\",\"new_string\":\"identity :unique_session_uuid\\nend\"})"
                    .into(),
                tokens: 700,
                time: 0,
                ..SourceItem::default()
            },
            SourceItem {
                label: "turn 3".into(),
                role: Some(Role::Tool),
                tool: None,
                text: "The file lib/spotter/message.ex has been updated successfully.".into(),
                tokens: 700,
                time: 0,
                ..SourceItem::default()
            },
        ];
        let r = SummaryRequest {
            sources: turns,
            identifier_policy: IdentifierPolicy::Off,
            ..req(SOURCE, 2000, 400)
        };
        let deterministic = DeterministicSummarizer::draft(&r).content;
        let floor = Floor::new(&r.sources, &deterministic);
        let vague = "The agent worked on the code as asked.";
        assert!(matches!(
            floor.check(vague).map_err(Rejection::from),
            Err(Rejection::BelowDeterministic {
                kept: 0,
                deterministic: 2,
                ..
            })
        ));
        // With room, the vague answer is completed by the deterministic
        // summary's own lines, and then keeps what it keeps.
        let s = escalating(vec![Ok(vague)]);
        let out = s.summarize_unlimited(&r).await.unwrap();
        assert!(!out.draft.fallback, "{}", out.draft.content);
        let content = &out.draft.content;
        assert!(content.starts_with(vague), "{content}");
        assert!(
            content.contains(crate::summarizer::floor::FROM_THE_TURNS_HEADING)
                && content.contains("upsert for messages")
                && content.contains("message.ex"),
            "{content}"
        );
        assert_eq!(floor.check(content), Ok(()));
        // Without room for those lines (a target of a few tokens), it is
        // refused, and a complete answer is stored as written.
        let tight = SummaryRequest {
            target_tokens: 12,
            ..r.clone()
        };
        let complete = "Upsert for messages keyed by session added; message.ex has the identity.";
        let long_vague = "The agent worked on the code as it was asked to, read the files \
                          it needed and kept going until the work was finished for now.";
        let s = escalating(vec![Ok(long_vague), Ok(complete)]);
        let out = s.summarize_unlimited(&tight).await.unwrap();
        assert!(!out.draft.fallback, "{}", out.draft.content);
        assert_eq!(out.draft.content, complete);
        assert!(
            matches!(out.calls[0].outcome, CallOutcome::Invalid(ref why) if why.contains("deterministic")),
            "{:?}",
            out.calls[0].outcome
        );
    }

    #[tokio::test]
    async fn identifier_retry_names_the_missing_then_appends() {
        let s = escalating(vec![
            Ok("The deploy of build 9fceb02d0ae5 failed."),
            Ok("The deploy of build 9fceb02d0ae5 to 10.0.4.17:8443 failed."),
        ]);
        let out = s
            .summarize_unlimited(&req(SOURCE, 2000, 400))
            .await
            .unwrap();
        assert!(!out.draft.fallback);
        assert_eq!(out.calls.len(), 2);
        let seen = s.inner.seen.lock().unwrap();
        let retry = seen[1].custom_instructions.as_deref().unwrap();
        assert!(retry.contains("- 10.0.4.17:8443") && retry.contains("- /var/log/app/deploy.log"));
        assert!(!retry.contains("- 9fceb02d0ae5"));
        assert!(out
            .draft
            .content
            .ends_with("Exact identifiers:\n- /var/log/app/deploy.log"));
        assert!(out
            .draft
            .content
            .starts_with("The deploy of build 9fceb02d0ae5 to 10.0.4.17:8443"));
    }

    #[tokio::test]
    async fn a_failed_identifier_retry_keeps_the_first_summary() {
        let s = escalating(vec![
            Ok("The deploy of build 9fceb02d0ae5 failed."),
            Err(SummarizeError::Unavailable {
                reason: "503".into(),
                calls: vec![call(CallOutcome::HttpStatus(503))],
            }),
        ]);
        let out = s
            .summarize_unlimited(&req(SOURCE, 2000, 400))
            .await
            .unwrap();
        assert!(!out.draft.fallback);
        assert!(out
            .draft
            .content
            .starts_with("The deploy of build 9fceb02d0ae5 failed."));
        assert!(out.draft.content.contains("- 10.0.4.17:8443"));
        assert_eq!(out.calls.len(), 2);
    }

    #[tokio::test]
    async fn off_policy_does_not_retry_for_identifiers() {
        // The answer keeps the failure (the floor) but not every identifier.
        let answer = "The deploy of build 9fceb02d0ae5 failed on an expired certificate.";
        let s = escalating(vec![Ok(answer)]);
        let r = SummaryRequest {
            identifier_policy: IdentifierPolicy::Off,
            ..req(SOURCE, 2000, 400)
        };
        let out = s.summarize_unlimited(&r).await.unwrap();
        assert_eq!(out.draft.content, answer);
        assert_eq!(out.calls.len(), 1);
    }

    #[tokio::test]
    async fn auth_and_rate_limits_propagate_without_fallback() {
        let s = escalating(vec![Err(SummarizeError::AuthFailed {
            provider: "p".into(),
            status: 401,
            api_key_env: "K".into(),
            detail: String::new(),
            calls: vec![call(CallOutcome::Auth)],
        })]);
        let err = s
            .summarize_unlimited(&req(SOURCE, 2000, 400))
            .await
            .unwrap_err();
        assert!(err.is_auth());
        assert_eq!(err.calls().len(), 1);

        let s = escalating(vec![
            Ok("Let me think."),
            Err(SummarizeError::RateLimited {
                provider: "p".into(),
                retry_after_ms: 5000,
                calls: vec![call(CallOutcome::RateLimited)],
            }),
        ]);
        let err = s
            .summarize_unlimited(&req(SOURCE, 2000, 400))
            .await
            .unwrap_err();
        assert_eq!(err.retry_after_ms(), Some(5000));
        assert_eq!(err.calls().len(), 2, "earlier calls are kept for spend");
    }

    #[tokio::test]
    async fn unavailable_goes_straight_to_the_fallback() {
        let s = escalating(vec![Err(SummarizeError::Unavailable {
            reason: "all models timed out".into(),
            calls: vec![call(CallOutcome::Timeout)],
        })]);
        let out = s
            .summarize_unlimited(&req(SOURCE, 2000, 400))
            .await
            .unwrap();
        assert!(out.draft.fallback);
        assert_eq!(s.inner.seen.lock().unwrap().len(), 1, "no aggressive retry");
    }
}
