//! The OpenAI-compatible chat-completions summarizer (OpenAI, vLLM, Ollama,
//! llama.cpp server, LiteLLM, ...), on async-openai.
//!
//! async-openai is used as the client, but its transport is ours
//! (`Client::with_http_service`): its default executor retries 429s by
//! sleeping, reads only OpenAI-shaped 429 bodies, does not cap Retry-After
//! and has no timeout. Here:
//! - the reqwest client has a connect timeout and a whole-call timeout;
//! - 5xx and connection errors are retried a bounded number of times with
//!   capped exponential backoff and jitter;
//! - a 429 is never slept on: the next model of the chain is tried, and when
//!   none answers the error carries the Retry-After delay (seconds, HTTP
//!   date or `retry-after-ms`, capped) for the caller to requeue the job;
//! - 401/403 stop the chain and feed the provider's auth breaker;
//! - the response body is read leniently (async-openai's `byot` calls with
//!   our own types): `finish_reason: null`, missing ids, missing or zero
//!   usage (then our own token counts are used) are all accepted.
//!
//! Dropping the future (the caller's deadline) drops the HTTP request, which
//! closes its connection; the call is charged to its [`Budget`] as
//! `Cancelled` (its [`InFlight`] guard is dropped with it).

use super::breaker::{AuthBreakers, Clock, SystemClock};
use super::budget::InFlight;
use super::checks::output_cap;
use super::prompts::{self, Prompt, PROMPT_VERSION};
use super::{
    Budget, CallOutcome, CallRecord, RollingOutcome, SummarizeError, Summarizer, SummarizerConfig,
    SummaryOutcome,
};
use crate::core::message::{ChatMessage, Role};
use crate::core::summary::{RollingStateRequest, SummaryDraft, SummaryRequest};
use crate::core::tokens::{count_message, count_text, Encoding};
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::middleware::HttpRequestFactory;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most bytes of an error body kept for messages.
const ERROR_BODY_LIMIT: usize = 16 * 1024;

/// A non-success HTTP answer, carried through async-openai as a boxed error
/// so the status and Retry-After headers survive (its own error type drops
/// the headers).
#[derive(Debug, thiserror::Error)]
#[error("HTTP {status}")]
struct HttpFailure {
    status: u16,
    retry_after: Option<String>,
    retry_after_ms: Option<String>,
    body: String,
}

/// Why one call failed.
#[derive(Debug)]
enum Failure {
    Timeout,
    Connect(String),
    Status {
        status: u16,
        retry_after_ms: Option<u64>,
        detail: String,
    },
    /// The answer could not be used (malformed body, no text, truncated).
    Unusable(String),
}

// ---- lenient response types (byot) ----

#[derive(Debug, Default, Deserialize)]
struct LenientCompletion {
    #[serde(default)]
    model: Option<serde_json::Value>,
    #[serde(default)]
    choices: Option<Vec<LenientChoice>>,
    #[serde(default)]
    usage: Option<LenientUsage>,
}

#[derive(Debug, Default, Deserialize)]
struct LenientChoice {
    #[serde(default)]
    message: Option<LenientMessage>,
    /// Legacy completions-style servers put the text here.
    #[serde(default)]
    text: Option<serde_json::Value>,
    #[serde(default)]
    finish_reason: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
struct LenientMessage {
    #[serde(default)]
    content: Option<serde_json::Value>,
    #[serde(default)]
    reasoning_content: Option<serde_json::Value>,
    #[serde(default)]
    reasoning: Option<serde_json::Value>,
    #[serde(default)]
    refusal: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
struct LenientUsage {
    #[serde(default)]
    prompt_tokens: Option<serde_json::Value>,
    #[serde(default)]
    completion_tokens: Option<serde_json::Value>,
}

/// Text of a content value: a string, or the text of its parts.
fn value_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| match p {
                serde_json::Value::String(s) => Some(s.as_str()),
                other => other.get("text").and_then(|t| t.as_str()),
            })
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// Usage counts: missing, null, zero or not a number all mean unknown.
fn usage_count(v: Option<&serde_json::Value>) -> Option<u64> {
    let n = match v? {
        serde_json::Value::Number(n) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))?,
        _ => return None,
    };
    (n > 0).then_some(n)
}

#[derive(Debug, Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Debug, Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    messages: [WireMessage<'a>; 2],
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u64>,
}

/// What a successful call gave.
#[derive(Debug)]
struct Answer {
    content: String,
    model: String,
}

/// A prompt answered through the model chain ([`LlmSummarizer::complete_prompt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The answer's text, as the model wrote it.
    pub content: String,
    /// The model that answered (as the server named it).
    pub model: String,
    /// Every call made for it, failed attempts included.
    pub calls: Vec<CallRecord>,
}

/// Parses `Retry-After` (delay-seconds or HTTP date) and `retry-after-ms`
/// into a delay in milliseconds from `now_ms`. `retry-after-ms` wins when
/// both are present (it is the more precise).
pub fn parse_retry_after(
    retry_after: Option<&str>,
    retry_after_ms: Option<&str>,
    now_ms: u64,
) -> Option<u64> {
    if let Some(ms) = retry_after_ms
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
    {
        return Some(ms.ceil() as u64);
    }
    let v = retry_after?.trim();
    if let Ok(secs) = v.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| (secs * 1000.0).ceil() as u64);
    }
    parse_http_date(v).map(|at| at.saturating_sub(now_ms))
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`) in ms since the epoch.
fn parse_http_date(s: &str) -> Option<u64> {
    let rest = s.split_once(',').map_or(s, |(_, r)| r).trim();
    let mut parts = rest.split_whitespace();
    let day: u64 = parts.next()?.parse().ok()?;
    let month = match parts.next()?.to_ascii_lowercase().as_str() {
        "jan" => 1,
        "feb" => 2,
        "mar" => 3,
        "apr" => 4,
        "may" => 5,
        "jun" => 6,
        "jul" => 7,
        "aug" => 8,
        "sep" => 9,
        "oct" => 10,
        "nov" => 11,
        "dec" => 12,
        _ => return None,
    };
    let year: i64 = parts.next()?.parse().ok()?;
    let mut hms = parts.next()?.split(':');
    let h: u64 = hms.next()?.parse().ok()?;
    let m: u64 = hms.next()?.parse().ok()?;
    let sec: u64 = hms.next()?.parse().ok()?;
    if !matches!(parts.next(), Some("GMT") | Some("UTC") | None)
        || !(1..=31).contains(&day)
        || h > 23
        || m > 59
        || sec > 60
    {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    if days < 0 {
        return Some(0);
    }
    Some(((days as u64) * 86_400 + h * 3_600 + m * 60 + sec) * 1_000)
}

/// A random number in `0..=max` for backoff jitter (std's randomly keyed
/// hasher is random enough for spreading retries).
fn jitter(max: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    if max == 0 {
        return 0;
    }
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() % (max + 1)
}

/// Backoff before retry number `retry` (0-based): half of the capped
/// exponential delay, plus up to the other half at random.
pub fn backoff_ms(retry: u32, base_ms: u64, cap_ms: u64) -> u64 {
    let exp = base_ms.saturating_mul(1u64 << retry.min(30)).min(cap_ms);
    exp / 2 + jitter(exp - exp / 2)
}

/// Keeps a key out of text that may be logged (error bodies can echo it).
fn redact(text: &str, key: &str) -> String {
    if key.len() >= 4 && text.contains(key) {
        text.replace(key, "[redacted]")
    } else {
        text.to_string()
    }
}

/// The message of an OpenAI-style error body, or the body itself.
fn error_detail(body: &str) -> String {
    let msg = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("error"))
                .and_then(|m| m.as_str().map(str::to_string))
        })
        .unwrap_or_else(|| body.trim().to_string());
    msg.chars().take(300).collect()
}

/// Loads the BPE tables of the models' encodings now. Their first use takes
/// seconds (in a debug build) of synchronous work that no deadline can
/// interrupt; paying it at construction keeps every call cancellable.
pub fn warm_tokenizers(models: &[String]) {
    let mut encodings = vec![Encoding::O200kBase];
    for m in models {
        let e = Encoding::for_model(Some(m));
        if !encodings.contains(&e) {
            encodings.push(e);
        }
    }
    for e in encodings {
        count_text(e, "warm");
    }
}

/// The API key, never printed.
#[derive(Clone, Default)]
struct ApiKey(String);

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("ApiKey(unset)")
        } else {
            f.write_str("ApiKey([redacted])")
        }
    }
}

/// The OpenAI-compatible summarizer.
pub struct LlmSummarizer {
    config: SummarizerConfig,
    provider: String,
    chain: Vec<String>,
    key: ApiKey,
    client: async_openai::Client<OpenAIConfig>,
    breakers: AuthBreakers,
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for LlmSummarizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmSummarizer")
            .field("provider", &self.provider)
            .field(
                "base_url",
                &crate::secret::redact_url(&self.config.base_url),
            )
            .field("chain", &self.chain)
            .field("api_key_env", &self.config.api_key_env)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl LlmSummarizer {
    /// A summarizer for `config`, with the key read from the environment
    /// variable `config.api_key_env` (an unset variable means no key, as
    /// local servers such as Ollama need none).
    pub fn new(config: SummarizerConfig) -> Result<Self, SummarizeError> {
        let key = std::env::var(&config.api_key_env).unwrap_or_default();
        Self::with_api_key(config, key)
    }

    /// A summarizer with an explicit key (tests, secrets from elsewhere).
    pub fn with_api_key(
        config: SummarizerConfig,
        api_key: impl Into<String>,
    ) -> Result<Self, SummarizeError> {
        config.validate().map_err(SummarizeError::Config)?;
        let key = ApiKey(api_key.into());
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
            .timeout(Duration::from_millis(config.call_timeout_ms))
            .build()
            .map_err(|e| SummarizeError::Config(format!("cannot build the HTTP client: {e}")))?;
        let openai_config = OpenAIConfig::new()
            .with_api_base(config.base_url.trim_end_matches('/'))
            .with_api_key(key.0.clone())
            // OpenAIConfig::new() reads these from the environment; the
            // endpoint is ours to configure, not the process environment's.
            .with_org_id("")
            .with_project_id("");
        let service = tower::service_fn(move |factory: HttpRequestFactory| {
            let http = http.clone();
            async move {
                let request = factory.build().await?;
                let response = http.execute(request).await.map_err(OpenAIError::Reqwest)?;
                if response.status().is_success() {
                    return Ok(response);
                }
                let header = |name: &str| {
                    response
                        .headers()
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string)
                };
                let status = response.status().as_u16();
                let retry_after = header("retry-after");
                let retry_after_ms = header("retry-after-ms");
                let body = response.bytes().await.unwrap_or_default();
                let body =
                    String::from_utf8_lossy(&body[..body.len().min(ERROR_BODY_LIMIT)]).into_owned();
                Err(OpenAIError::Boxed(Box::new(HttpFailure {
                    status,
                    retry_after,
                    retry_after_ms,
                    body,
                })))
            }
        });
        let client = async_openai::Client::with_config(openai_config).with_http_service(service);
        warm_tokenizers(&config.model_chain());
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        Ok(LlmSummarizer {
            provider: config.provider_name(),
            chain: config.model_chain(),
            breakers: AuthBreakers::new(
                config.breaker_threshold,
                config.breaker_cooldown_ms,
                clock.clone(),
            ),
            key,
            client,
            clock,
            config,
        })
    }

    /// Uses `clock` for Retry-After dates (and for the breakers, which are
    /// recreated: call before [`Self::with_breakers`]).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.breakers = AuthBreakers::new(
            self.config.breaker_threshold,
            self.config.breaker_cooldown_ms,
            clock.clone(),
        );
        self.clock = clock;
        self
    }

    /// Shares auth breakers with other clients of the process.
    pub fn with_breakers(mut self, breakers: AuthBreakers) -> Self {
        self.breakers = breakers;
        self
    }

    pub fn breakers(&self) -> &AuthBreakers {
        &self.breakers
    }

    pub fn provider(&self) -> &str {
        &self.provider
    }

    pub fn config(&self) -> &SummarizerConfig {
        &self.config
    }

    fn classify(&self, err: OpenAIError) -> Failure {
        match err {
            OpenAIError::Boxed(boxed) => match boxed.downcast::<HttpFailure>() {
                Ok(f) => {
                    let retry_after_ms = parse_retry_after(
                        f.retry_after.as_deref(),
                        f.retry_after_ms.as_deref(),
                        self.clock.now_ms(),
                    );
                    Failure::Status {
                        status: f.status,
                        retry_after_ms,
                        detail: redact(&error_detail(&f.body), &self.key.0),
                    }
                }
                Err(other) => Failure::Connect(redact(&other.to_string(), &self.key.0)),
            },
            OpenAIError::Reqwest(e) if e.is_timeout() => Failure::Timeout,
            OpenAIError::Reqwest(e) => {
                // Without the URL: it is configuration, and may carry
                // credentials.
                Failure::Connect(e.without_url().to_string())
            }
            OpenAIError::ApiError(api) => Failure::Status {
                status: api.status_code.as_u16(),
                retry_after_ms: None,
                detail: redact(&api.api_error.message, &self.key.0),
            },
            OpenAIError::JSONDeserialize(e, _) => {
                Failure::Unusable(format!("malformed response body: {e}"))
            }
            other => Failure::Unusable(redact(&other.to_string(), &self.key.0)),
        }
    }

    fn prompt_tokens(prompt: &Prompt, encoding: Encoding) -> u64 {
        count_message(
            encoding,
            &ChatMessage::text(Role::System, prompt.system.as_str()),
        ) + count_message(
            encoding,
            &ChatMessage::text(Role::User, prompt.user.as_str()),
        )
    }

    /// One HTTP call to one model.
    async fn call_model(
        &self,
        model: &str,
        prompt: &Prompt,
        prompt_tokens_ours: u64,
        max_output: Option<u64>,
        budget: &Budget,
    ) -> (CallRecord, Result<Answer, Failure>) {
        let encoding = Encoding::for_model(Some(model));
        let price = self.config.price(model);
        let started = Instant::now();
        let cancelled = CallRecord {
            model: model.to_string(),
            provider: self.provider.clone(),
            latency_ms: 0,
            prompt_tokens_provider: None,
            completion_tokens_provider: None,
            prompt_tokens_ours,
            completion_tokens_ours: 0,
            // The provider may have processed the prompt before we left.
            cost_micros: price.cost_micros(prompt_tokens_ours, 0),
            outcome: CallOutcome::Cancelled,
        };
        let guard = InFlight::start(budget, cancelled.clone());
        let (max_tokens, max_completion_tokens) = match self.config.max_tokens_field {
            super::config::MaxTokensField::MaxTokens => (max_output, None),
            super::config::MaxTokensField::MaxCompletionTokens => (None, max_output),
            super::config::MaxTokensField::None => (None, None),
        };
        let body = ChatRequest {
            model,
            messages: [
                WireMessage {
                    role: "system",
                    content: &prompt.system,
                },
                WireMessage {
                    role: "user",
                    content: &prompt.user,
                },
            ],
            stream: false,
            temperature: self.config.temperature,
            max_tokens,
            max_completion_tokens,
        };
        let result: Result<LenientCompletion, OpenAIError> =
            self.client.chat().create_byot(&body).await;
        let latency_ms = started.elapsed().as_millis() as u64;
        let mut record = CallRecord {
            latency_ms,
            cost_micros: 0,
            ..cancelled
        };
        let outcome = match result {
            Ok(completion) => {
                let usage = completion.usage.unwrap_or_default();
                record.prompt_tokens_provider = usage_count(usage.prompt_tokens.as_ref());
                record.completion_tokens_provider = usage_count(usage.completion_tokens.as_ref());
                let answered_model = completion
                    .model
                    .as_ref()
                    .and_then(|m| m.as_str())
                    .filter(|m| !m.is_empty())
                    .unwrap_or(model)
                    .to_string();
                let choice = completion.choices.and_then(|c| c.into_iter().next());
                let parsed = match choice {
                    None => Err(Failure::Unusable("response has no choices".into())),
                    Some(choice) => {
                        let message = choice.message.unwrap_or_default();
                        let mut content = value_text(message.content.as_ref());
                        if content.is_empty() {
                            content = value_text(choice.text.as_ref());
                        }
                        record.completion_tokens_ours = count_text(encoding, &content);
                        let finish = choice
                            .finish_reason
                            .as_ref()
                            .and_then(|f| f.as_str())
                            .unwrap_or("");
                        let reasoning = value_text(message.reasoning_content.as_ref())
                            + &value_text(message.reasoning.as_ref());
                        let refusal = value_text(message.refusal.as_ref());
                        if finish == "length" {
                            Err(Failure::Unusable(
                                "truncated at the output cap (finish_reason length)".into(),
                            ))
                        } else if content.trim().is_empty() && !reasoning.trim().is_empty() {
                            Err(Failure::Unusable(
                                "reasoning only: the model wrote reasoning and no summary".into(),
                            ))
                        } else if content.trim().is_empty() && !refusal.trim().is_empty() {
                            Err(Failure::Unusable(format!(
                                "refused: {}",
                                refusal.chars().take(200).collect::<String>()
                            )))
                        } else {
                            Ok(Answer {
                                content,
                                model: answered_model,
                            })
                        }
                    }
                };
                record.cost_micros = price.cost_micros(
                    record
                        .prompt_tokens_provider
                        .unwrap_or(record.prompt_tokens_ours),
                    record
                        .completion_tokens_provider
                        .unwrap_or(record.completion_tokens_ours),
                );
                parsed
            }
            Err(e) => {
                let failure = self.classify(e);
                if matches!(failure, Failure::Timeout) {
                    record.cost_micros = price.cost_micros(prompt_tokens_ours, 0);
                }
                Err(failure)
            }
        };
        record.outcome = match &outcome {
            Ok(_) => CallOutcome::Ok,
            Err(Failure::Timeout) => CallOutcome::Timeout,
            Err(Failure::Connect(_)) => CallOutcome::Connect,
            Err(Failure::Status {
                status: 401 | 403, ..
            }) => CallOutcome::Auth,
            Err(Failure::Status { status: 429, .. }) => CallOutcome::RateLimited,
            Err(Failure::Status { status, .. }) => CallOutcome::HttpStatus(*status),
            Err(Failure::Unusable(reason)) => CallOutcome::Invalid(reason.clone()),
        };
        let record = guard.finish(record);
        (record, outcome)
    }

    /// Runs the model chain for one prompt within `budget`: every model of
    /// the chain and every retry asks it before its call. When it refuses
    /// the first call, nothing is spent and the answer is
    /// [`SummarizeError::OverBudget`]; when it refuses a later one, the chain
    /// stops there, as if the models left had failed too (the caller's
    /// escalation then decides, as for any outage).
    async fn complete(
        &self,
        prompt: &Prompt,
        max_output: Option<u64>,
        budget: &Budget,
    ) -> Result<(Answer, Vec<CallRecord>), SummarizeError> {
        if let Err(remaining) = self.breakers.check(&self.provider) {
            return Err(SummarizeError::BreakerOpen {
                provider: self.provider.clone(),
                retry_after_ms: remaining,
            });
        }
        let mut calls = Vec::new();
        let mut rate_limited: Option<u64> = None;
        let mut failures: Vec<String> = Vec::new();
        'chain: for model in &self.chain {
            let prompt_tokens = Self::prompt_tokens(prompt, Encoding::for_model(Some(model)));
            let mut retry = 0u32;
            loop {
                if !budget.grant(prompt_tokens) {
                    if calls.is_empty() {
                        return Err(SummarizeError::OverBudget { calls });
                    }
                    failures.push(format!(
                        "stopped at the spend allowance after {} calls",
                        calls.len()
                    ));
                    break 'chain;
                }
                let (record, result) = self
                    .call_model(model, prompt, prompt_tokens, max_output, budget)
                    .await;
                calls.push(record);
                match result {
                    Ok(answer) => {
                        self.breakers.record_success(&self.provider);
                        return Ok((answer, calls));
                    }
                    Err(Failure::Status {
                        status: status @ (401 | 403),
                        detail,
                        ..
                    }) => {
                        let opened = self.breakers.record_auth_failure(&self.provider);
                        if opened {
                            tracing::error!(provider = %self.provider, "auth breaker opened");
                        }
                        return Err(SummarizeError::AuthFailed {
                            provider: self.provider.clone(),
                            status,
                            api_key_env: self.config.api_key_env.clone(),
                            detail,
                            calls,
                        });
                    }
                    Err(Failure::Status {
                        status: 429,
                        retry_after_ms,
                        ..
                    }) => {
                        self.breakers.record_success(&self.provider);
                        let delay = retry_after_ms
                            .unwrap_or(self.config.rate_limit_default_ms)
                            .min(self.config.retry_after_cap_ms);
                        rate_limited = Some(rate_limited.map_or(delay, |d| d.min(delay)));
                        failures.push(format!("{model}: rate limited ({delay} ms)"));
                        break;
                    }
                    Err(Failure::Unusable(reason)) => {
                        self.breakers.record_success(&self.provider);
                        // Bad output is not a reason to try another model:
                        // escalation decides what comes next.
                        return Err(SummarizeError::Invalid {
                            reason: format!("{model}: {reason}"),
                            calls,
                        });
                    }
                    Err(Failure::Timeout) => {
                        failures.push(format!(
                            "{model}: timed out after {} ms",
                            self.config.call_timeout_ms
                        ));
                        break;
                    }
                    Err(failure) => {
                        let (transient, what) = match &failure {
                            Failure::Status { status, detail, .. } => {
                                self.breakers.record_success(&self.provider);
                                (*status >= 500, format!("HTTP {status} {detail}"))
                            }
                            Failure::Connect(e) => (true, format!("connection failed: {e}")),
                            _ => (false, format!("{failure:?}")),
                        };
                        if transient && retry < self.config.max_retries {
                            let delay = backoff_ms(
                                retry,
                                self.config.retry_base_ms,
                                self.config.retry_max_backoff_ms,
                            );
                            tracing::debug!(%model, retry, delay, %what, "retrying");
                            tokio::time::sleep(Duration::from_millis(delay)).await;
                            retry += 1;
                            continue;
                        }
                        failures.push(format!("{model}: {}", what.trim()));
                        break;
                    }
                }
            }
        }
        if let Some(retry_after_ms) = rate_limited {
            return Err(SummarizeError::RateLimited {
                provider: self.provider.clone(),
                retry_after_ms,
                calls,
            });
        }
        Err(SummarizeError::Unavailable {
            reason: format!(
                "no model of {} answered: {}",
                self.provider,
                failures.join("; ")
            ),
            calls,
        })
    }

    /// Answers any prompt through the model chain, with the same timeouts,
    /// retries, rate-limit and auth handling as a summary, within `budget`:
    /// for callers that are not summaries (delegated recall). The text is
    /// returned as it is; checking it is the caller's business.
    pub async fn complete_prompt(
        &self,
        prompt: &Prompt,
        max_output: Option<u64>,
        budget: &Budget,
    ) -> Result<Completion, SummarizeError> {
        let (answer, calls) = self.complete(prompt, max_output, budget).await?;
        Ok(Completion {
            content: answer.content,
            model: answer.model,
            calls,
        })
    }

    /// Refreshes the rolling session state (the handover sections), within
    /// its size limits and `budget`; an answer that fails its checks is
    /// [`SummarizeError::Invalid`].
    async fn refresh_rolling_state(
        &self,
        req: &RollingStateRequest,
        budget: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        let prompt = prompts::render_rolling_state(req);
        let (answer, mut calls) = self.complete(&prompt, Some(400), budget).await?;
        let cleaned = super::checks::clean(&answer.content);
        match prompts::parse_rolling_state(&cleaned) {
            Some(state) => {
                // The instructions only: the user part holds the sources.
                match super::checks::check_rolling_state(req, &prompt.system, &state) {
                    Ok(()) => Ok(RollingOutcome {
                        state,
                        calls,
                        refused: None,
                    }),
                    Err(rejection) => {
                        let reason = format!("rolling state rejected: {rejection}");
                        tracing::warn!(
                            conversation_id = %req.conversation,
                            %reason,
                            "rolling state rejected"
                        );
                        crate::telemetry::ValidationRejected {
                            kind: rejection.kind(),
                        }
                        .emit();
                        if let Some(last) = calls.last_mut() {
                            last.outcome = CallOutcome::Invalid(reason.clone());
                        }
                        Err(SummarizeError::Invalid { reason, calls })
                    }
                }
            }
            None => {
                let reason = "rolling state answer has none of the five sections".to_string();
                tracing::warn!(conversation_id = %req.conversation, %reason, "rolling state rejected");
                crate::telemetry::ValidationRejected {
                    kind: "rolling_state_unparsed",
                }
                .emit();
                if let Some(last) = calls.last_mut() {
                    last.outcome = CallOutcome::Invalid(reason.clone());
                }
                Err(SummarizeError::Invalid { reason, calls })
            }
        }
    }
}

impl LlmSummarizer {
    async fn summarize_with(
        &self,
        req: &SummaryRequest,
        budget: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let prompt = prompts::render(req);
        let cap = output_cap(req.target_tokens, self.config.summary_max_overage_factor);
        let (answer, calls) = self.complete(&prompt, Some(cap), budget).await?;
        Ok(SummaryOutcome {
            draft: SummaryDraft {
                content: answer.content,
                model: answer.model,
                provider: self.provider.clone(),
                prompt_version: PROMPT_VERSION.to_string(),
                fallback: false,
            },
            calls,
        })
    }
}

impl Summarizer for LlmSummarizer {
    async fn summarize(
        &self,
        req: &SummaryRequest,
        budget: &Budget,
    ) -> Result<SummaryOutcome, SummarizeError> {
        self.summarize_with(req, budget).await
    }

    async fn rolling_state(
        &self,
        req: &RollingStateRequest,
        budget: &Budget,
    ) -> Result<RollingOutcome, SummarizeError> {
        self.refresh_rolling_state(req, budget).await
    }

    fn name(&self) -> &str {
        "llm"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_forms() {
        let now = 784_111_777_000; // Sun, 06 Nov 1994 08:49:37 GMT
        assert_eq!(parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT"), Some(now));
        assert_eq!(parse_retry_after(Some("7"), None, now), Some(7_000));
        assert_eq!(parse_retry_after(Some("0.5"), None, now), Some(500));
        assert_eq!(parse_retry_after(Some("7"), Some("6500"), now), Some(6_500));
        assert_eq!(
            parse_retry_after(Some("Sun, 06 Nov 1994 08:50:07 GMT"), None, now),
            Some(30_000)
        );
        assert_eq!(
            parse_retry_after(Some("Sun, 06 Nov 1994 08:00:00 GMT"), None, now),
            Some(0),
            "a date in the past means now"
        );
        assert_eq!(parse_retry_after(Some("soon"), None, now), None);
        assert_eq!(parse_retry_after(Some("-3"), None, now), None);
        assert_eq!(parse_retry_after(None, None, now), None);
        assert_eq!(parse_http_date("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        assert_eq!(
            parse_http_date("Tue, 29 Feb 2028 23:59:59 GMT"),
            Some(1_835_481_599_000)
        );
    }

    #[test]
    fn backoff_is_capped_and_jittered() {
        for retry in 0..40 {
            let d = backoff_ms(retry, 500, 8_000);
            let exp = (500u64 << retry.min(30)).min(8_000);
            assert!(d >= exp / 2 && d <= exp, "retry {retry}: {d}");
        }
        let samples: std::collections::HashSet<u64> =
            (0..50).map(|_| backoff_ms(4, 500, 8_000)).collect();
        assert!(samples.len() > 1, "jitter varies");
    }

    #[test]
    fn lenient_bodies_parse() {
        let body = r#"{"choices":[{"message":{"content":"hi"},"finish_reason":null}]}"#;
        let c: LenientCompletion = serde_json::from_str(body).unwrap();
        let choice = c.choices.unwrap().into_iter().next().unwrap();
        assert_eq!(value_text(choice.message.unwrap().content.as_ref()), "hi");
        assert!(c.usage.is_none());

        let body = r#"{"choices":null,"usage":{"prompt_tokens":0,"completion_tokens":null}}"#;
        let c: LenientCompletion = serde_json::from_str(body).unwrap();
        assert!(c.choices.is_none());
        let u = c.usage.unwrap();
        assert_eq!(
            usage_count(u.prompt_tokens.as_ref()),
            None,
            "zero is unknown"
        );
        assert_eq!(usage_count(u.completion_tokens.as_ref()), None);

        let parts = serde_json::json!([{"type":"text","text":"a"},{"type":"text","text":"b"}]);
        assert_eq!(value_text(Some(&parts)), "ab");
        assert_eq!(usage_count(Some(&serde_json::json!(12.0))), Some(12));
    }

    #[test]
    fn key_never_shows_in_debug_or_details() {
        let cfg = SummarizerConfig {
            base_url: "http://127.0.0.1:9/v1".into(),
            ..Default::default()
        };
        let s = LlmSummarizer::with_api_key(cfg, "sk-very-secret-key").unwrap();
        let dbg = format!("{s:?}");
        assert!(!dbg.contains("sk-very-secret-key"), "{dbg}");
        assert!(dbg.contains("[redacted]"));
        assert_eq!(
            redact(
                "Incorrect API key provided: sk-very-secret-key",
                "sk-very-secret-key"
            ),
            "Incorrect API key provided: [redacted]"
        );
    }

    #[test]
    fn error_detail_reads_openai_and_plain_bodies() {
        assert_eq!(
            error_detail(r#"{"error":{"message":"bad key","type":"x"}}"#),
            "bad key"
        );
        assert_eq!(error_detail(r#"{"error":"quota"}"#), "quota");
        assert_eq!(error_detail("  upstream down \n"), "upstream down");
    }
}
