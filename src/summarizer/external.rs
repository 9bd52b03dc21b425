//! A team's own summarizer, in any language, reached by NATS request/reply
//! on a configured subject.
//!
//! Wire contract: the request body is a JSON [`SummaryRequest`]; the reply
//! is a JSON [`SummaryDraft`] (`prompt_version` and `fallback` may be
//! omitted; `model`/`provider` default to the subject), or `{"error": "..."}`.
//! A timeout, no responder, an error reply, an unreadable or empty reply is
//! a failure, and [`WithFallback`] then uses the built-in path.

use super::budget::InFlight;
use super::{
    Budget, CallOutcome, CallRecord, Outcome, RollingOutcome, SummarizeError, Summarizer,
    SummaryOutcome,
};
use crate::core::summary::{RollingStateRequest, SummaryDraft, SummaryRequest};
use crate::core::tokens::{count_text, Encoding};
use bytes::Bytes;
use serde::Deserialize;
use std::future::Future;
use std::time::{Duration, Instant};

/// Why a request over the transport got no reply.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TransportError {
    #[error("no reply within {0} ms")]
    TimedOut(u64),
    #[error("no summarizer is listening on the subject")]
    NoResponders,
    #[error("request failed: {0}")]
    Other(String),
}

/// Request/reply, abstracted so the fallback logic is testable without a
/// NATS server. Implemented for `async_nats::Client`.
pub trait RequestTransport: Send + Sync {
    fn request(
        &self,
        subject: &str,
        payload: Bytes,
        timeout: Duration,
    ) -> impl Future<Output = Result<Bytes, TransportError>> + Send;
}

impl RequestTransport for async_nats::Client {
    async fn request(
        &self,
        subject: &str,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, TransportError> {
        let request = async_nats::Request::new()
            .payload(payload)
            .timeout(Some(timeout));
        match self.send_request(subject.to_string(), request).await {
            Ok(message) => Ok(message.payload),
            Err(e) => Err(match e.kind() {
                async_nats::RequestErrorKind::TimedOut => {
                    TransportError::TimedOut(timeout.as_millis() as u64)
                }
                async_nats::RequestErrorKind::NoResponders => TransportError::NoResponders,
                _ => TransportError::Other(e.to_string()),
            }),
        }
    }
}

/// The reply: a draft, or an error.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Reply {
    Error { error: String },
    Draft(ReplyDraft),
}

#[derive(Debug, Deserialize)]
struct ReplyDraft {
    content: String,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    provider: Option<String>,
    #[serde(default)]
    prompt_version: Option<String>,
    #[serde(default)]
    fallback: bool,
}

/// The external summarizer.
#[derive(Debug)]
pub struct ExternalSummarizer<T> {
    transport: T,
    subject: String,
    timeout: Duration,
    name: String,
}

impl<T: RequestTransport> ExternalSummarizer<T> {
    pub fn new(transport: T, subject: impl Into<String>, timeout: Duration) -> Self {
        let subject = subject.into();
        ExternalSummarizer {
            name: format!("external({subject})"),
            transport,
            subject,
            timeout,
        }
    }

    fn record(
        &self,
        model: &str,
        latency_ms: u64,
        prompt: u64,
        completion: u64,
        outcome: CallOutcome,
    ) -> CallRecord {
        CallRecord {
            model: model.to_string(),
            provider: format!("nats:{}", self.subject),
            latency_ms,
            prompt_tokens_provider: None,
            completion_tokens_provider: None,
            prompt_tokens_ours: prompt,
            completion_tokens_ours: completion,
            // What an external summarizer costs is its team's to account.
            cost_micros: 0,
            outcome,
        }
    }
}

impl<T: RequestTransport> Summarizer for ExternalSummarizer<T> {
    async fn summarize(
        &self,
        req: &SummaryRequest,
        budget: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let payload = serde_json::to_vec(req)
            .map_err(|e| SummarizeError::Config(format!("cannot encode the request: {e}")))?;
        let prompt_tokens = req.source_tokens();
        let started = Instant::now();
        // Charged to the budget when it ends, or as cancelled when the
        // caller's deadline drops this future first.
        let in_flight = InFlight::start(
            budget,
            self.record("external", 0, prompt_tokens, 0, CallOutcome::Cancelled),
        );
        let result = self
            .transport
            .request(&self.subject, Bytes::from(payload), self.timeout)
            .await;
        let latency = started.elapsed().as_millis() as u64;
        // What came back: a draft, or why there is none (its call outcome).
        let answer = match result {
            Err(TransportError::TimedOut(ms)) => {
                Err((CallOutcome::Timeout, format!("no reply within {ms} ms")))
            }
            Err(e) => Err((CallOutcome::Connect, e.to_string())),
            Ok(bytes) => match serde_json::from_slice::<Reply>(&bytes) {
                Err(e) => {
                    let reason = format!("unreadable reply: {e}");
                    Err((CallOutcome::Invalid(reason.clone()), reason))
                }
                Ok(Reply::Error { error }) => {
                    let reason = format!("replied with an error: {error}");
                    Err((CallOutcome::Invalid(reason.clone()), reason))
                }
                Ok(Reply::Draft(d)) if d.content.trim().is_empty() => {
                    let reason = "replied with an empty summary".to_string();
                    Err((CallOutcome::Invalid(reason.clone()), reason))
                }
                Ok(Reply::Draft(d)) => Ok(d),
            },
        };
        let d = match answer {
            Ok(d) => d,
            Err((outcome, reason)) => {
                let record = self.record("external", latency, prompt_tokens, 0, outcome);
                return Err(SummarizeError::Unavailable {
                    reason: format!("external summarizer on {}: {reason}", self.subject),
                    calls: vec![in_flight.finish(record)],
                });
            }
        };
        let model = d
            .model
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| "external".to_string());
        let completion = count_text(Encoding::for_model(Some(&model)), &d.content);
        let record = self.record(&model, latency, prompt_tokens, completion, CallOutcome::Ok);
        Ok(SummaryOutcome {
            draft: SummaryDraft {
                content: d.content,
                provider: d
                    .provider
                    .filter(|p| !p.is_empty())
                    .unwrap_or_else(|| format!("nats:{}", self.subject)),
                model,
                prompt_version: d
                    .prompt_version
                    .filter(|v| !v.is_empty())
                    .unwrap_or_else(|| format!("external:{}", self.subject)),
                fallback: d.fallback,
            },
            calls: vec![in_flight.finish(record)],
        })
    }

    /// A team's summarizer writes summaries only: the rolling state is the
    /// next layer's (see [`WithFallback`]).
    async fn rolling_state(
        &self,
        _: &RollingStateRequest,
        _: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        Err(SummarizeError::Unavailable {
            reason: format!(
                "the external summarizer on {} writes summaries only",
                self.subject
            ),
            calls: Vec::new(),
        })
    }

    fn name(&self) -> &str {
        &self.name
    }
}

/// The fallback's answer with the primary's `earlier` calls in front.
fn after<T: Outcome>(
    earlier: Vec<CallRecord>,
    answer: Result<T, SummarizeError>,
) -> Result<T, SummarizeError> {
    match answer {
        Ok(mut outcome) => {
            let own = std::mem::replace(outcome.calls_mut(), earlier);
            outcome.calls_mut().extend(own);
            Ok(outcome)
        }
        Err(e) => Err(e.prepend_calls(earlier)),
    }
}

/// Tries `primary`; on any failure uses `fallback`, keeping the calls of
/// both.
#[derive(Debug)]
pub struct WithFallback<P, F> {
    primary: P,
    fallback: F,
    name: String,
}

impl<P: Summarizer, F: Summarizer> WithFallback<P, F> {
    pub fn new(primary: P, fallback: F) -> Self {
        let name = format!("{}|{}", primary.name(), fallback.name());
        WithFallback {
            primary,
            fallback,
            name,
        }
    }
}

impl<P: Summarizer, F: Summarizer> Summarizer for WithFallback<P, F> {
    async fn summarize(
        &self,
        req: &SummaryRequest,
        budget: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        match self.primary.summarize(req, budget).await {
            Ok(outcome) => Ok(outcome),
            Err(mut e) => {
                tracing::warn!(
                    primary = %self.primary.name(),
                    error = %e,
                    "primary summarizer failed; using the fallback"
                );
                let earlier = e.take_calls();
                after(earlier, self.fallback.summarize(req, budget).await)
            }
        }
    }

    async fn rolling_state(
        &self,
        req: &RollingStateRequest,
        budget: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        match self.primary.rolling_state(req, budget).await {
            Ok(outcome) => Ok(outcome),
            Err(mut e) => {
                let earlier = e.take_calls();
                after(earlier, self.fallback.rolling_state(req, budget).await)
            }
        }
    }

    fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::summarizer::DeterministicSummarizer;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// A transport answering from a script and recording requests.
    struct FakeTransport {
        reply: Mutex<Option<Result<Bytes, TransportError>>>,
        delay: Duration,
        requests: AtomicUsize,
        last: Mutex<Option<(String, Bytes, Duration)>>,
    }

    impl FakeTransport {
        fn new(reply: Result<&str, TransportError>) -> Self {
            FakeTransport {
                reply: Mutex::new(Some(reply.map(|s| Bytes::from(s.to_string())))),
                delay: Duration::ZERO,
                requests: AtomicUsize::new(0),
                last: Mutex::new(None),
            }
        }
    }

    impl RequestTransport for FakeTransport {
        async fn request(
            &self,
            subject: &str,
            payload: Bytes,
            timeout: Duration,
        ) -> Result<Bytes, TransportError> {
            self.requests.fetch_add(1, Ordering::SeqCst);
            *self.last.lock().unwrap() = Some((subject.to_string(), payload, timeout));
            tokio::time::sleep(self.delay).await;
            self.reply
                .lock()
                .unwrap()
                .take()
                .unwrap_or(Err(TransportError::Other("script exhausted".into())))
        }
    }

    fn req() -> SummaryRequest {
        crate::testing::summary_request("rotate /etc/app/key.pem", 9, 64)
    }

    fn external(t: FakeTransport) -> ExternalSummarizer<FakeTransport> {
        ExternalSummarizer::new(t, "summarize.team", Duration::from_millis(750))
    }

    #[tokio::test]
    async fn a_draft_reply_is_used_and_the_request_is_the_json_request() {
        let ext = external(FakeTransport::new(Ok(
            r#"{"content":"Key rotation of /etc/app/key.pem requested.","model":"team-model"}"#,
        )));
        let s = WithFallback::new(ext, DeterministicSummarizer);
        let budget = Budget::unlimited();
        let out = s.summarize(&req(), &budget).await.unwrap();
        assert_eq!(budget.spent().calls, 1, "the team's call is charged");
        assert_eq!(
            out.draft.content,
            "Key rotation of /etc/app/key.pem requested."
        );
        assert_eq!(out.draft.model, "team-model");
        assert_eq!(out.draft.provider, "nats:summarize.team");
        assert!(!out.draft.fallback);
        assert_eq!(out.calls.len(), 1);
        let (subject, payload, timeout) = s.primary.transport.last.lock().unwrap().clone().unwrap();
        assert_eq!(subject, "summarize.team");
        assert_eq!(timeout, Duration::from_millis(750));
        let sent: SummaryRequest = serde_json::from_slice(&payload).unwrap();
        assert_eq!(sent, req());
    }

    #[tokio::test]
    async fn every_failure_falls_back_to_the_built_in_path() {
        let cases: Vec<(Result<&str, TransportError>, CallOutcome)> = vec![
            (Err(TransportError::TimedOut(750)), CallOutcome::Timeout),
            (Err(TransportError::NoResponders), CallOutcome::Connect),
            (
                Ok(r#"{"error":"model overloaded"}"#),
                CallOutcome::Invalid("replied with an error: model overloaded".into()),
            ),
            (
                Ok(r#"{"content":"   "}"#),
                CallOutcome::Invalid("replied with an empty summary".into()),
            ),
            (Ok("not json"), CallOutcome::Invalid(String::new())),
            (Ok(""), CallOutcome::Invalid(String::new())),
        ];
        for (reply, expected) in cases {
            let s = WithFallback::new(external(FakeTransport::new(reply)), DeterministicSummarizer);
            let out = s.summarize(&req(), &Budget::unlimited()).await.unwrap();
            assert_eq!(
                out.draft.model,
                crate::core::fallback_summary::MODEL,
                "{expected:?}: built-in path used"
            );
            assert_eq!(s.primary.transport.requests.load(Ordering::SeqCst), 1);
            assert_eq!(out.calls.len(), 1, "the failed external call is kept");
            match (&out.calls[0].outcome, &expected) {
                (CallOutcome::Invalid(_), CallOutcome::Invalid(e)) if e.is_empty() => {}
                (got, want) => assert_eq!(got, want),
            }
        }
    }

    #[tokio::test]
    async fn a_failing_fallback_reports_both_calls() {
        struct Down;
        impl Summarizer for Down {
            async fn summarize(
                &self,
                _: &SummaryRequest,
                _: &Budget,
            ) -> Result<SummaryOutcome, SummarizeError> {
                Err(SummarizeError::RateLimited {
                    provider: "p".into(),
                    retry_after_ms: 900,
                    calls: vec![CallRecord {
                        model: "m".into(),
                        provider: "p".into(),
                        latency_ms: 1,
                        prompt_tokens_provider: None,
                        completion_tokens_provider: None,
                        prompt_tokens_ours: 1,
                        completion_tokens_ours: 0,
                        cost_micros: 0,
                        outcome: CallOutcome::RateLimited,
                    }],
                })
            }
            async fn rolling_state(
                &self,
                _: &RollingStateRequest,
                _: &Budget,
            ) -> Result<RollingOutcome, SummarizeError> {
                unreachable!("summaries only")
            }
            fn name(&self) -> &str {
                "down"
            }
        }
        let s = WithFallback::new(
            external(FakeTransport::new(Err(TransportError::TimedOut(750)))),
            Down,
        );
        let err = s.summarize(&req(), &Budget::unlimited()).await.unwrap_err();
        assert_eq!(err.retry_after_ms(), Some(900));
        let outcomes: Vec<_> = err.calls().iter().map(|c| c.outcome.clone()).collect();
        assert_eq!(
            outcomes,
            vec![CallOutcome::Timeout, CallOutcome::RateLimited]
        );
    }
}
