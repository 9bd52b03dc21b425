//! The summarizer's configuration: where the model is, how long a call may
//! take, how hard to retry, what a token costs, and when to stop calling a
//! provider whose key is refused. Every field has a documented default, so
//! an empty `[summarizer]` table is a working configuration.

use crate::core::summary::IdentifierPolicy;
use crate::secret::{redact_url, split_userinfo};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Price of one model, in US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    pub input_per_million: f64,
    pub output_per_million: f64,
}

impl ModelPrice {
    /// Cost of a call in micro-dollars: a price of P dollars per million
    /// tokens is exactly P micro-dollars per token.
    pub fn cost_micros(&self, prompt_tokens: u64, completion_tokens: u64) -> u64 {
        let cost = prompt_tokens as f64 * self.input_per_million.max(0.0)
            + completion_tokens as f64 * self.output_per_million.max(0.0);
        cost.round() as u64
    }
}

/// Which request field carries the output cap. OpenAI's reasoning models
/// reject `max_tokens`; some local servers ignore `max_completion_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum MaxTokensField {
    #[default]
    MaxTokens,
    MaxCompletionTokens,
    /// Send no output cap (the validator still rejects oversized output).
    None,
}

/// An external summarizer reached by NATS request/reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExternalConfig {
    /// Subject the team's summarizer answers on.
    pub subject: String,
    /// How long to wait for its reply before the built-in path is used.
    #[serde(default = "defaults::external_timeout_ms")]
    pub timeout_ms: u64,
}

/// Configuration of the summarizers (`[summarizer]` in the config file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SummarizerConfig {
    /// OpenAI-compatible base URL, up to and including `/v1`
    /// (OpenAI, vLLM, Ollama, llama.cpp server, LiteLLM, ...).
    /// Default: OpenAI's public endpoint.
    pub base_url: String,
    /// Name of this endpoint in call records and for the auth breaker.
    /// Default: the host (and port) of `base_url`.
    pub provider: Option<String>,
    /// The summary model. Default `gpt-4o-mini`.
    pub model: String,
    /// Models tried in order after `model` on timeouts, 5xx and rate limits
    /// (never on auth failures or invalid output). Default: none.
    pub fallback_models: Vec<String>,
    /// Name of the environment variable holding the API key (the key itself
    /// is never in the config and never logged). Default `OPENAI_API_KEY`.
    pub api_key_env: String,
    /// Whole-call timeout (connect, send, wait, read). Default 60000 ms.
    pub call_timeout_ms: u64,
    /// TCP/TLS connect timeout. Default 5000 ms.
    pub connect_timeout_ms: u64,
    /// Retries of one model on 5xx and connection errors (so at most
    /// `1 + max_retries` attempts a model). Default 2.
    pub max_retries: u32,
    /// First backoff before a retry; doubles each retry, with jitter.
    /// Default 500 ms.
    pub retry_base_ms: u64,
    /// Largest backoff between retries. Default 8000 ms.
    pub retry_max_backoff_ms: u64,
    /// Largest delay a 429's Retry-After can impose. Default 600000 ms.
    pub retry_after_cap_ms: u64,
    /// Delay used when a 429 carries no usable Retry-After. Default 30000 ms.
    pub rate_limit_default_ms: u64,
    /// Prices per model (exact model name; `*` for any other model).
    /// Default: empty (cost 0).
    pub prices: BTreeMap<String, ModelPrice>,
    /// Identifier policy put into summary requests. Default strict.
    pub identifier_policy: IdentifierPolicy,
    /// Output larger than this many times the target is rejected. Default 3.
    pub summary_max_overage_factor: f64,
    /// Target multiplier for the aggressive retry. Default 0.5.
    pub aggressive_target_factor: f64,
    /// Auth failures (401/403) in a row that open a provider's breaker.
    /// Default 5.
    pub breaker_threshold: u32,
    /// How long an open breaker refuses calls. Default 1800000 ms (30 min).
    pub breaker_cooldown_ms: u64,
    /// Sampling temperature; omitted from the request when unset (some
    /// reasoning models reject it). Default unset.
    pub temperature: Option<f32>,
    /// Field carrying the output cap (overage factor x target). Default
    /// `max_tokens`.
    pub max_tokens_field: MaxTokensField,
    /// When every model times out or fails with 5xx, write the marked
    /// deterministic fallback instead of failing. Default true.
    pub fallback_on_unavailable: bool,
    /// An external summarizer tried before the built-in one. Default none.
    pub external: Option<ExternalConfig>,
}

mod defaults {
    pub fn external_timeout_ms() -> u64 {
        30_000
    }
}

impl Default for SummarizerConfig {
    fn default() -> Self {
        SummarizerConfig {
            base_url: "https://api.openai.com/v1".to_string(),
            provider: None,
            model: "gpt-4o-mini".to_string(),
            fallback_models: Vec::new(),
            api_key_env: "OPENAI_API_KEY".to_string(),
            call_timeout_ms: 60_000,
            connect_timeout_ms: 5_000,
            max_retries: 2,
            retry_base_ms: 500,
            retry_max_backoff_ms: 8_000,
            retry_after_cap_ms: 600_000,
            rate_limit_default_ms: 30_000,
            prices: BTreeMap::new(),
            identifier_policy: IdentifierPolicy::Strict,
            summary_max_overage_factor: 3.0,
            aggressive_target_factor: 0.5,
            breaker_threshold: 5,
            breaker_cooldown_ms: 1_800_000,
            temperature: None,
            max_tokens_field: MaxTokensField::MaxTokens,
            fallback_on_unavailable: true,
            external: None,
        }
    }
}

impl SummarizerConfig {
    /// The models to try, in order: the summary model, then the fallbacks
    /// (duplicates dropped).
    pub fn model_chain(&self) -> Vec<String> {
        let mut chain: Vec<String> = Vec::with_capacity(1 + self.fallback_models.len());
        for m in std::iter::once(&self.model).chain(&self.fallback_models) {
            let m = m.trim();
            if !m.is_empty() && !chain.iter().any(|c| c == m) {
                chain.push(m.to_string());
            }
        }
        chain
    }

    /// The provider name: configured, or the `host[:port]` of the base URL.
    pub fn provider_name(&self) -> String {
        if let Some(p) = self.provider.as_deref().filter(|p| !p.trim().is_empty()) {
            return p.trim().to_string();
        }
        let rest = self
            .base_url
            .split_once("://")
            .map_or(self.base_url.as_str(), |(_, r)| r);
        let host = rest.split(['/', '?', '#']).next().unwrap_or(rest);
        // Drop credentials a URL might carry so they never reach a record.
        let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
        if host.is_empty() {
            "openai-compatible".to_string()
        } else {
            host.to_string()
        }
    }

    /// Price of a model: the exact entry, else `*`, else free.
    pub fn price(&self, model: &str) -> ModelPrice {
        self.prices
            .get(model)
            .or_else(|| self.prices.get("*"))
            .copied()
            .unwrap_or_default()
    }

    /// Checks that cannot be expressed in types; the message says what to fix.
    pub fn validate(&self) -> Result<(), String> {
        if self.model_chain().is_empty() {
            return Err("summarizer.model is empty: name the summary model".into());
        }
        if !(self.base_url.starts_with("http://") || self.base_url.starts_with("https://")) {
            return Err(format!(
                "summarizer.base_url {:?} must start with http:// or https://",
                redact_url(&self.base_url)
            ));
        }
        if split_userinfo(&self.base_url).0.is_some() {
            return Err(format!(
                "summarizer.base_url {} carries credentials, which are never sent: remove them \
                 and put the API key in the environment variable summarizer.api_key_env names \
                 (now {})",
                redact_url(&self.base_url),
                self.api_key_env
            ));
        }
        if self.call_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            return Err("summarizer.call_timeout_ms and connect_timeout_ms must be > 0".into());
        }
        if self.summary_max_overage_factor.is_nan() || self.summary_max_overage_factor < 1.0 {
            return Err("summarizer.summary_max_overage_factor must be >= 1".into());
        }
        if !(0.0..=1.0).contains(&self.aggressive_target_factor)
            || self.aggressive_target_factor == 0.0
        {
            return Err("summarizer.aggressive_target_factor must be in (0, 1]".into());
        }
        if self.breaker_threshold == 0 {
            return Err("summarizer.breaker_threshold must be >= 1".into());
        }
        for (model, price) in &self.prices {
            let valid = |p: f64| p.is_finite() && p >= 0.0;
            if !valid(price.input_per_million) || !valid(price.output_per_million) {
                return Err(format!("summarizer.prices.{model}: prices must be >= 0"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_table_gives_documented_defaults() {
        let cfg: SummarizerConfig = toml::from_str("").unwrap();
        assert_eq!(cfg, SummarizerConfig::default());
        assert_eq!(cfg.call_timeout_ms, 60_000);
        assert_eq!(cfg.connect_timeout_ms, 5_000);
        assert_eq!(cfg.max_retries, 2);
        assert_eq!(cfg.retry_after_cap_ms, 600_000);
        assert_eq!(cfg.breaker_threshold, 5);
        assert_eq!(cfg.breaker_cooldown_ms, 1_800_000);
        assert_eq!(cfg.summary_max_overage_factor, 3.0);
        assert_eq!(cfg.api_key_env, "OPENAI_API_KEY");
        assert_eq!(cfg.identifier_policy, IdentifierPolicy::Strict);
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn parses_snake_case_table_with_prices() {
        let cfg: SummarizerConfig = toml::from_str(
            r#"
            base_url = "http://127.0.0.1:8000/v1"
            model = "qwen2.5"
            fallback_models = ["llama3.1", "qwen2.5"]
            identifier_policy = { mode = "custom", text = "keep ticket ids" }
            [prices.qwen2]
            input_per_million = 0.15
            output_per_million = 0.6
            "#,
        )
        .unwrap();
        assert_eq!(cfg.model_chain(), vec!["qwen2.5", "llama3.1"]);
        assert_eq!(cfg.provider_name(), "127.0.0.1:8000");
        assert_eq!(
            cfg.identifier_policy,
            IdentifierPolicy::Custom("keep ticket ids".into())
        );
        assert_eq!(
            cfg.price("qwen2").cost_micros(1_000_000, 1_000),
            150_000 + 600
        );
        assert_eq!(cfg.price("unknown").cost_micros(10, 10), 0);
    }

    #[test]
    fn unknown_keys_are_rejected() {
        assert!(toml::from_str::<SummarizerConfig>("modle = \"x\"").is_err());
    }

    #[test]
    fn provider_name_never_carries_credentials() {
        let cfg = SummarizerConfig {
            base_url: "https://user:secret@llm.internal:8443/v1".into(),
            ..Default::default()
        };
        assert_eq!(cfg.provider_name(), "llm.internal:8443");
    }

    #[test]
    fn validation_names_the_field_to_fix() {
        let cfg = SummarizerConfig {
            base_url: "localhost:8000".into(),
            ..Default::default()
        };
        assert!(cfg.validate().unwrap_err().contains("base_url"));
        let cfg = SummarizerConfig {
            summary_max_overage_factor: 0.5,
            ..Default::default()
        };
        assert!(cfg.validate().unwrap_err().contains("overage"));
    }

    #[test]
    fn a_base_url_with_credentials_is_refused_without_showing_them() {
        for url in [
            "https://user:s3cret@llm.internal/v1",
            "http://s3cret@127.0.0.1:8/v1",
        ] {
            let cfg = SummarizerConfig {
                base_url: url.into(),
                ..Default::default()
            };
            let err = cfg.validate().unwrap_err();
            assert!(
                err.contains("carries credentials") && err.contains("***@"),
                "{err}"
            );
            assert!(err.contains("OPENAI_API_KEY"), "{err}");
            assert!(!err.contains("s3cret"), "{err}");
        }
        let cfg = SummarizerConfig {
            base_url: "ftp://u:s3cret@host".into(),
            ..Default::default()
        };
        assert!(!cfg.validate().unwrap_err().contains("s3cret"));
    }
}
