//! `contextfold recall CONV QUESTION`: delegated recall on the embedded
//! store. The request is planned by the API's pure handler
//! (`api::recall::prepare`) from the state as the log leaves it, the model
//! is asked under the deadline (`runtime::recall`), and the
//! `recall_answered` event carrying its spend is appended to the embedded
//! log and folded before the answer is printed, whatever the outcome, so
//! `status` shows the spend in the conversation's spend window. With
//! `--nats`, a running service answers (`nats::api_role`: its model,
//! its events stream records the spend).

use super::local::{open_pipeline, require_data, runtime};
use super::nats_args::NatsArgs;
use super::query::{api_error, ask_over_nats, print_answer, Query};
use anyhow::{Context, Result};
use contextfold::api::decode_reply;
use contextfold::api::recall::{self, RecallRequest, RecallResponse};
use contextfold::config::Config;
use contextfold::core::recall::RecallSource;
use contextfold::runtime::recall::Recaller;
use std::process::ExitCode;

/// Answers a recall from the embedded store (the reply's JSON bytes, or
/// an error reply).
async fn recall_locally(config: &Config, request: RecallRequest) -> Result<Vec<u8>> {
    require_data(config)?;
    let recaller = Recaller::new(&config.recall, config.summarizer.as_ref())?;
    let mut pipeline = open_pipeline(config).await?;
    let limits = recaller.limits();
    let engine = &pipeline.engine;
    let prepared = engine.with_conversation(&request.conversation, |state, bodies| {
        recall::prepare(state, bodies, &engine.policy, &request, &limits)
    })?;
    let prepared = match prepared {
        Ok(p) => p,
        Err(e) => return Ok(e.to_json()),
    };
    let run = recaller.run(&prepared).await;
    pipeline
        .record(&[recall::answered_event(&prepared, &run)])
        .await
        .context("recording the recall's spend in the embedded log")?;
    Ok(match recall::response(&prepared, &run, true) {
        Ok(response) => serde_json::to_vec(&response).context("encoding the response")?,
        Err(e) => e.to_json(),
    })
}

/// A value's wire name (`user`, `leaf`).
fn wire<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn describe_source(s: &RecallSource) -> String {
    match s {
        RecallSource::Turn {
            seq,
            role,
            tokens,
            expanded_from,
            ..
        } => format!(
            "turn {seq} ({}, {tokens} tokens{})",
            wire(role),
            expanded_from
                .as_ref()
                .map_or(String::new(), |f| format!(", expanded from {f}"))
        ),
        RecallSource::Summary {
            id,
            summary_kind,
            depth,
            first_turn,
            last_turn,
            tokens,
        } => format!(
            "{id} ({} summary, depth {depth}, turns {first_turn}-{last_turn}, {tokens} tokens)",
            wire(summary_kind)
        ),
    }
}

/// The answer, then the sources it read.
fn render(r: &RecallResponse) -> String {
    let mut out = format!(
        "{}\n\nsources ({}, {} of {} tokens read",
        r.answer.trim(),
        r.sources.len(),
        r.tokens,
        r.max_tokens
    );
    if r.left_out > 0 {
        out.push_str(&format!(", {} matching items left out", r.left_out));
    }
    out.push_str("):\n");
    for s in &r.sources {
        out.push_str(&format!("  {}\n", describe_source(s)));
    }
    if !r.unsupported.is_empty() {
        out.push_str(&format!(
            "not in what the model read ({}): {}\n",
            r.unsupported.len(),
            r.unsupported.join(", ")
        ));
    }
    out.push_str(&format!(
        "model {} at {}: {} call(s), {} tokens, ${:.4}, {} of {} ms\n",
        r.model,
        r.provider,
        r.calls,
        r.tokens_spent,
        r.cost_micros as f64 / 1e6,
        r.elapsed_ms,
        r.deadline_ms
    ));
    out
}

pub fn recall(
    config: &Config,
    nats: &NatsArgs,
    mut request: RecallRequest,
    json: bool,
) -> Result<ExitCode> {
    let rt = runtime()?;
    if request.request_id.is_none() {
        request.request_id = Some(super::query::fresh_request_id());
    }
    let reply = if nats.servers.is_empty() {
        rt.block_on(recall_locally(config, request))?
    } else {
        rt.block_on(ask_over_nats(config, nats, &Query::Recall(request)))?
    };
    let response: RecallResponse = decode_reply(&reply).map_err(api_error)?;
    let text = if json {
        serde_json::to_string_pretty(&response).context("encoding the response")?
    } else {
        render(&response)
    };
    print_answer(&text)
}
