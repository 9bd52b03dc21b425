//! The stacks `serve` and the embedded pipeline run, built from the
//! configuration: the model stack (escalation over the model client) and
//! the external one (escalation over the team's summarizer, the model
//! client when it fails). Without `[summarizer]` the stack is
//! [`super::DeterministicSummarizer`] alone.

use super::external::{ExternalSummarizer, WithFallback};
use super::{EscalatingSummarizer, LlmSummarizer, SummarizeError, SummarizerConfig};

/// Escalation over the model client.
pub type ModelStack = EscalatingSummarizer<LlmSummarizer>;

/// Escalation over the team's external summarizer, the model client when
/// it fails, times out or returns nothing.
pub type ExternalStack =
    EscalatingSummarizer<WithFallback<ExternalSummarizer<async_nats::Client>, LlmSummarizer>>;

/// The model stack for `config`, with the API key from the environment
/// variable the config names.
pub fn model(config: &SummarizerConfig) -> Result<ModelStack, SummarizeError> {
    Ok(over(LlmSummarizer::new(config.clone())?, config))
}

/// The model stack with an explicit API key (tests, secrets from elsewhere).
pub fn model_with_key(
    config: &SummarizerConfig,
    api_key: impl Into<String>,
) -> Result<ModelStack, SummarizeError> {
    Ok(over(
        LlmSummarizer::with_api_key(config.clone(), api_key)?,
        config,
    ))
}

/// The model stack around an existing client (shared breakers, a clock).
pub fn over(client: LlmSummarizer, config: &SummarizerConfig) -> ModelStack {
    EscalatingSummarizer::new(client, config)
}

/// The external stack for `config` (`summarizer.external` must be set),
/// asking over `nats`.
pub fn external(
    config: &SummarizerConfig,
    nats: async_nats::Client,
) -> Result<ExternalStack, SummarizeError> {
    let Some(external) = &config.external else {
        return Err(SummarizeError::Config(
            "summarizer.external.subject is not set".into(),
        ));
    };
    let team = ExternalSummarizer::new(
        nats,
        external.subject.clone(),
        std::time::Duration::from_millis(external.timeout_ms),
    );
    let client = LlmSummarizer::new(config.clone())?;
    Ok(EscalatingSummarizer::new(
        WithFallback::new(team, client),
        config,
    ))
}
