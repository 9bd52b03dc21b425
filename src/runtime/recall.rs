//! Delegated recall, the effectful half: runs a planned recall
//! ([`crate::api::recall::Prepared`]) against its model under a hard
//! deadline, and configures that model (`[recall]`).
//!
//! Protocol: one chat-completions prompt (system instructions, then the
//! question and the excerpts) through the summarizer's OpenAI-compatible
//! client ([`LlmSummarizer::complete_prompt`]): the same connect and call
//! timeouts, bounded retries of 5xx and connection errors, the model chain
//! on 429 and timeouts, and auth failures that stop the chain. The answer's
//! length is capped by `recall.max_answer_tokens`; the number of calls by
//! what the spend window still allows.
//!
//! Failure reasoning: the whole run is bounded by `recall.deadline_ms`
//! (`tokio::time::timeout`). At the deadline the future is dropped, which
//! drops the HTTP request in flight and closes its connection; the call is
//! charged as `cancelled` to this run's own [`Budget`], so even
//! a cancelled call's prompt is counted as spend (the provider may have
//! processed it). Every outcome (answered, deadline, failed) becomes a
//! [`ModelRun`] whose calls the transport records in a `recall_answered`
//! event: spend is never lost because the answer was.
//!
//! Which model: `recall.base_url` / `recall.model` / `recall.api_key_env`
//! when set, else the summarizer's (`[summarizer]`), with its price table
//! either way. With neither a `recall.base_url` nor a `[summarizer]`
//! section there is no model to ask, and the run says so before any call.

use crate::api::recall::{ModelRun, Prepared, RecallLimits};
use crate::core::event::RecallOutcome;
use crate::core::tokens::Encoding;
use crate::secret::redact_url;
use crate::summarizer::prompts::Prompt;
use crate::summarizer::{AuthBreakers, Budget, LlmSummarizer, SummarizerConfig};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// `[recall]`: the model that answers `recall` and its bounds. Every key
/// is optional.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecallConfig {
    /// OpenAI-compatible base URL; default: `summarizer.base_url` when a
    /// `[summarizer]` is configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// The recall model; default: the summarizer's model (and its
    /// fallbacks), else `gpt-4o-mini` at `recall.base_url`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The variable holding the key; default: the summarizer's
    /// (`OPENAI_API_KEY`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Cap on the tokens the model reads (the whole prompt), when a request
    /// names none. Default 6000.
    pub max_tokens: u64,
    /// The whole recall's deadline; the call in flight is cancelled at it.
    /// Default 30000 ms.
    pub deadline_ms: u64,
    /// Output cap of the answer. Default 800.
    pub max_answer_tokens: u64,
}

impl Default for RecallConfig {
    fn default() -> Self {
        RecallConfig {
            base_url: None,
            model: None,
            api_key_env: None,
            max_tokens: 6000,
            deadline_ms: 30_000,
            max_answer_tokens: 800,
        }
    }
}

/// Largest deadline accepted (10 minutes).
pub const MAX_DEADLINE_MS: u64 = 600_000;
/// Largest answer cap accepted.
pub const MAX_ANSWER_TOKENS: u64 = 32_000;

impl RecallConfig {
    /// Checks that cannot be expressed in types; the message says what to fix.
    pub fn validate(&self) -> Result<(), String> {
        let max = crate::api::recall::MAX_MAX_TOKENS;
        if self.max_tokens < 100 || self.max_tokens > max {
            return Err(format!(
                "recall.max_tokens must be between 100 and {max} (got {})",
                self.max_tokens
            ));
        }
        if self.deadline_ms == 0 || self.deadline_ms > MAX_DEADLINE_MS {
            return Err(format!(
                "recall.deadline_ms must be between 1 and {MAX_DEADLINE_MS} (got {})",
                self.deadline_ms
            ));
        }
        if self.max_answer_tokens == 0 || self.max_answer_tokens > MAX_ANSWER_TOKENS {
            return Err(format!(
                "recall.max_answer_tokens must be between 1 and {MAX_ANSWER_TOKENS} (got {})",
                self.max_answer_tokens
            ));
        }
        if self.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
            return Err("recall.model is empty: name the recall model or leave it unset".into());
        }
        if self.api_key_env.as_deref().is_some_and(str::is_empty) {
            return Err("recall.api_key_env is empty: name a variable or leave it unset".into());
        }
        if let Some(url) = &self.base_url {
            // The same checks as the summarizer's endpoint, named as ours.
            let probe = SummarizerConfig {
                base_url: url.clone(),
                ..SummarizerConfig::default()
            };
            probe
                .validate()
                .map_err(|e| e.replace("summarizer.base_url", "recall.base_url"))?;
        }
        Ok(())
    }

    /// The client configuration the recall model is called with: the
    /// summarizer's, with the recall keys over it.
    pub fn model_config(
        &self,
        summarizer: Option<&SummarizerConfig>,
    ) -> Result<SummarizerConfig, RecallSetupError> {
        let mut config = match (summarizer, &self.base_url) {
            (Some(s), _) => s.clone(),
            (None, Some(_)) => SummarizerConfig::default(),
            (None, None) => return Err(RecallSetupError::NoModel),
        };
        if let Some(url) = &self.base_url {
            if *url != config.base_url {
                // Another endpoint: its own provider name.
                config.provider = None;
            }
            config.base_url = url.clone();
        }
        if let Some(model) = &self.model {
            config.model = model.trim().to_string();
            config.fallback_models.clear();
        }
        if let Some(var) = &self.api_key_env {
            config.api_key_env = var.clone();
        }
        // The per-call timeout stays the summarizer's: the recall's own
        // deadline bounds the whole run above it, and is what the caller
        // is told about when it passes.
        config.validate().map_err(RecallSetupError::Invalid)?;
        Ok(config)
    }
}

/// Why the recall model cannot be asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecallSetupError {
    #[error(
        "recall needs a model and none is configured: set recall.base_url (and recall.model), \
         e.g. CONTEXTFOLD_RECALL__BASE_URL=http://127.0.0.1:8080/v1, or configure [summarizer]"
    )]
    NoModel,
    #[error("the recall model is misconfigured: {0}")]
    Invalid(String),
}

/// Runs recalls against one configured model.
#[derive(Debug, Clone)]
pub struct Recaller {
    model: SummarizerConfig,
    key: String,
    deadline_ms: u64,
    max_answer_tokens: u64,
    default_max_tokens: u64,
    breakers: AuthBreakers,
}

impl Recaller {
    /// The recaller `config` describes, with the key read from the
    /// variable its `api_key_env` names (unset: no key, as local servers
    /// need none).
    pub fn new(
        config: &RecallConfig,
        summarizer: Option<&SummarizerConfig>,
    ) -> Result<Recaller, RecallSetupError> {
        let model = config.model_config(summarizer)?;
        let key = std::env::var(&model.api_key_env).unwrap_or_default();
        Ok(Self::with_api_key(config, model, key))
    }

    /// A recaller with an explicit key and client configuration.
    pub fn with_api_key(
        config: &RecallConfig,
        model: SummarizerConfig,
        key: impl Into<String>,
    ) -> Recaller {
        let breakers = AuthBreakers::new(
            model.breaker_threshold,
            model.breaker_cooldown_ms,
            std::sync::Arc::new(crate::summarizer::SystemClock),
        );
        Recaller {
            model,
            key: key.into(),
            deadline_ms: config.deadline_ms,
            max_answer_tokens: config.max_answer_tokens,
            default_max_tokens: config.max_tokens,
            breakers,
        }
    }

    /// What the planner needs of this model.
    pub fn limits(&self) -> RecallLimits {
        RecallLimits {
            default_max_tokens: self.default_max_tokens,
            max_answer_tokens: self.max_answer_tokens,
            encoding: Encoding::for_model(Some(&self.model.model)),
        }
    }

    pub fn model(&self) -> &str {
        &self.model.model
    }

    /// How long a recall may take, every call included.
    pub fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms)
    }

    /// The endpoint, credentials hidden.
    pub fn endpoint(&self) -> String {
        redact_url(&self.model.base_url)
    }

    /// Asks the model, within the deadline; never fails: every outcome,
    /// with every call it made, is a [`ModelRun`].
    pub async fn run(&self, prepared: &Prepared) -> ModelRun {
        let started = Instant::now();
        let provider = self.model.provider_name();
        let budget = Budget::new(Some(prepared.max_calls), None);
        let failed = |detail: String, budget: &Budget| ModelRun {
            outcome: RecallOutcome::Failed,
            answer: None,
            model: Some(self.model.model.clone()),
            provider: provider.clone(),
            detail: Some(detail),
            calls: budget.calls(),
            deadline_ms: self.deadline_ms,
            elapsed_ms: started.elapsed().as_millis() as u64,
        };
        let client = match LlmSummarizer::with_api_key(self.model.clone(), self.key.clone()) {
            Ok(c) => c.with_breakers(self.breakers.clone()),
            Err(e) => return failed(e.to_string(), &budget),
        };
        let prompt = Prompt {
            system: prepared.plan.system.clone(),
            user: prepared.plan.user.clone(),
        };
        let deadline = Duration::from_millis(self.deadline_ms);
        let call = client.complete_prompt(&prompt, Some(self.max_answer_tokens), &budget);
        let result = tokio::time::timeout(deadline, call).await;
        // The future is gone: the budget was charged with every call, a
        // cancelled one too.
        let calls = budget.calls();
        let elapsed_ms = started.elapsed().as_millis() as u64;
        let last_model = calls.last().map(|c| c.model.clone());
        match result {
            Ok(Ok(done)) => ModelRun {
                outcome: RecallOutcome::Answered,
                answer: Some(done.content.trim().to_string()),
                model: Some(done.model),
                provider,
                detail: None,
                calls,
                deadline_ms: self.deadline_ms,
                elapsed_ms,
            },
            Ok(Err(e)) => ModelRun {
                outcome: RecallOutcome::Failed,
                answer: None,
                model: last_model.or_else(|| Some(self.model.model.clone())),
                provider,
                detail: Some(e.to_string()),
                calls,
                deadline_ms: self.deadline_ms,
                elapsed_ms,
            },
            Err(_) => ModelRun {
                outcome: RecallOutcome::Deadline,
                answer: None,
                model: last_model.or_else(|| Some(self.model.model.clone())),
                provider,
                detail: Some(format!(
                    "deadline of {} ms passed; the call in flight was cancelled",
                    self.deadline_ms
                )),
                calls,
                deadline_ms: self.deadline_ms,
                elapsed_ms,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_table_gives_the_documented_defaults() {
        let c: RecallConfig = toml::from_str("").unwrap();
        assert_eq!(c, RecallConfig::default());
        assert_eq!(
            (c.max_tokens, c.deadline_ms, c.max_answer_tokens),
            (6000, 30_000, 800)
        );
        assert!(c.validate().is_ok());
        assert!(toml::from_str::<RecallConfig>("max_tokenz = 3").is_err());
    }

    #[test]
    fn invalid_values_are_refused_with_the_key_to_fix() {
        for (c, key) in [
            (
                RecallConfig {
                    max_tokens: 0,
                    ..RecallConfig::default()
                },
                "recall.max_tokens",
            ),
            (
                RecallConfig {
                    deadline_ms: MAX_DEADLINE_MS + 1,
                    ..RecallConfig::default()
                },
                "recall.deadline_ms",
            ),
            (
                RecallConfig {
                    max_answer_tokens: 0,
                    ..RecallConfig::default()
                },
                "recall.max_answer_tokens",
            ),
            (
                RecallConfig {
                    base_url: Some("localhost:8080".into()),
                    ..RecallConfig::default()
                },
                "recall.base_url",
            ),
            (
                RecallConfig {
                    base_url: Some("http://u:s3cret@127.0.0.1:9/v1".into()),
                    ..RecallConfig::default()
                },
                "recall.base_url",
            ),
        ] {
            let err = c.validate().unwrap_err();
            assert!(err.contains(key), "{err}");
            assert!(!err.contains("s3cret"), "{err}");
        }
    }

    #[test]
    fn the_model_falls_back_to_the_summarizers() {
        let summarizer = SummarizerConfig {
            base_url: "http://127.0.0.1:9/v1".into(),
            model: "sum-model".into(),
            fallback_models: vec!["sum-2".into()],
            ..SummarizerConfig::default()
        };
        let unset = RecallConfig::default();
        assert_eq!(unset.model_config(None), Err(RecallSetupError::NoModel));
        let m = unset.model_config(Some(&summarizer)).unwrap();
        assert_eq!(m.model_chain(), vec!["sum-model", "sum-2"]);
        assert_eq!(m.base_url, summarizer.base_url);
        let own = RecallConfig {
            base_url: Some("http://127.0.0.1:7/v1".into()),
            model: Some("recall-model".into()),
            api_key_env: Some("RECALL_KEY".into()),
            ..RecallConfig::default()
        };
        let m = own.model_config(Some(&summarizer)).unwrap();
        assert_eq!(m.model_chain(), vec!["recall-model"]);
        assert_eq!(m.base_url, "http://127.0.0.1:7/v1");
        assert_eq!(m.provider_name(), "127.0.0.1:7");
        assert_eq!(m.api_key_env, "RECALL_KEY");
        let alone = own.model_config(None).unwrap();
        assert_eq!(alone.model, "recall-model");
    }
}
