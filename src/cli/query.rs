//! The API's queries from the command line: `assemble`, `status`, `grep`,
//! `describe`, `expand`, `compact` and `history`. Without `--nats` they are
//! answered from the local state (caught up with the log); with `--nats`
//! they are asked of a running `contextfold serve` over request/reply. Both
//! go through the same API handlers, so the output is the JSON a NATS
//! client gets (pretty), and an API error is the command's error.

use super::local::{answer_from, open_pipeline, read_engine, require_data, runtime};
use super::nats_args::NatsArgs;
use super::report;
use anyhow::{bail, Context, Result};
use contextfold::api::grep::GrepScope;
use contextfold::api::{
    self, decode_reply, AssembleResponse, CompactResponse, ErrorCode, ReplyError,
};
use contextfold::config::Config;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

/// How long a request over NATS may wait for its answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `not_owner` answers (a partition moving) are retried.
const NOT_OWNER_PATIENCE: Duration = Duration::from_secs(15);

/// One query: the API request it sends (its operation, conversation and
/// body come from the API's one table of operations).
pub use contextfold::api::Request as Query;

/// An idempotency key for one `compact` invocation: the process id and
/// the wall clock, unique enough for a person at a terminal (pass
/// `--request-id` to make retries across invocations fold once).
pub fn fresh_request_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("cli-{}-{nanos}", std::process::id())
}

/// How an answer is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// The API's JSON response, pretty.
    Json,
    /// `assemble` only: the messages as the model sees them.
    Text,
}

pub(super) fn api_error(e: ReplyError) -> anyhow::Error {
    match e {
        ReplyError::Api(body) => anyhow::anyhow!("{} ({})", body.message, body.code.as_str()),
        ReplyError::Malformed(m) => anyhow::anyhow!("the service sent a malformed reply: {m}"),
    }
}

/// The text of a reply; an error reply is an error.
fn render(reply: &[u8], output: Output) -> Result<String> {
    if output == Output::Text {
        let r: AssembleResponse = decode_reply(reply).map_err(api_error)?;
        return Ok(report::format_assembled(&r.assembled));
    }
    let value: serde_json::Value = decode_reply(reply).map_err(api_error)?;
    serde_json::to_string_pretty(&value).context("encoding the response")
}

/// Answers from the local state. A `compact` request's event is appended
/// to the local log and folded, and its jobs run, before the answer; the
/// other queries create nothing (see `local::read_engine`).
async fn ask_locally(config: &Config, query: &Query) -> Result<Vec<u8>> {
    if !matches!(query, Query::Compact(_)) {
        let engine = read_engine(config).await?;
        return Ok(engine.answer(
            query.op(),
            query.conversation(),
            &query.body().context("encoding the request")?,
        ));
    }
    require_data(config)?;
    let mut pipeline = open_pipeline(config).await?;
    let reply = answer_from(
        &pipeline.engine,
        query.op(),
        query.conversation(),
        &query.body().context("encoding the request")?,
        &pipeline.engine.policy,
    );
    if let Query::Compact(_) = query {
        if let Ok(mut response) = decode_reply::<CompactResponse>(&reply) {
            pipeline
                .ingest(std::slice::from_ref(&response.event))
                .await?;
            pipeline.settle().await?;
            response.published = true;
            return serde_json::to_vec(&response).context("encoding the response");
        }
    }
    Ok(reply)
}

/// Asks a running service; `not_owner` (a partition moving between
/// processes) is asked again after the hinted pause.
pub(super) async fn ask_over_nats(
    config: &Config,
    nats: &NatsArgs,
    query: &Query,
) -> Result<Vec<u8>> {
    // A recall waits on the service's model: this side's recall deadline
    // (the service's own, when both read one configuration) and a margin.
    let timeout = match query {
        Query::Recall(_) => {
            Duration::from_millis(config.recall.deadline_ms) + Duration::from_secs(15)
        }
        _ => REQUEST_TIMEOUT,
    };
    let cfg = nats.apply(&config.nats);
    let servers = cfg.connection.display_servers();
    let subjects = cfg.subjects()?;
    // Conversation-scoped requests go to that conversation's subject, so
    // NATS permissions decide who may ask; global status to the admin one.
    let subject = match query.conversation() {
        Some(conversation) => subjects
            .api(query.op(), conversation)
            .with_context(|| format!("conversation {conversation:?}"))?,
        None => subjects.admin(query.op()),
    };
    let body = query.body().context("encoding the request")?;
    let (client, _version) = cfg
        .connection
        .connect()
        .await
        .with_context(|| format!("connecting to {servers}"))?;
    let patience = tokio::time::Instant::now() + NOT_OWNER_PATIENCE;
    loop {
        let request = async_nats::Request::new()
            .payload(body.clone().into())
            .timeout(Some(timeout));
        let reply = match client.send_request(subject.clone(), request).await {
            Ok(message) => message.payload.to_vec(),
            Err(e) => match e.kind() {
                async_nats::client::RequestErrorKind::NoResponders => bail!(
                    "no contextfold API answers on {subject} at {servers}: is `contextfold serve` \
                     (role api, prefix {:?}) running there?",
                    cfg.prefix
                ),
                async_nats::client::RequestErrorKind::TimedOut => {
                    bail!("no answer on {subject} within {} s", timeout.as_secs())
                }
                _ => bail!("asking {subject}: {e}"),
            },
        };
        match decode_reply::<serde::de::IgnoredAny>(&reply) {
            Err(ReplyError::Api(e))
                if e.code == ErrorCode::NotOwner && tokio::time::Instant::now() < patience =>
            {
                let pause = Duration::from_millis(
                    e.retry_after_ms
                        .unwrap_or(api::DEFAULT_NOT_OWNER_RETRY_MS)
                        .clamp(50, 5_000),
                );
                tracing::debug!(%subject, ?pause, "not owner; asking again");
                tokio::time::sleep(pause).await;
            }
            _ => return Ok(reply),
        }
    }
}

/// Answers a query, locally or over NATS (`--nats`), and prints it.
pub fn run(config: &Config, nats: &NatsArgs, query: Query, output: Output) -> Result<ExitCode> {
    let rt = runtime()?;
    let reply = if nats.servers.is_empty() {
        rt.block_on(ask_locally(config, &query))?
    } else {
        rt.block_on(ask_over_nats(config, nats, &query))?
    };
    print_answer(&render(&reply, output)?)
}

/// Prints an answer on stdout.
pub(super) fn print_answer(text: &str) -> Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{}", text.trim_end()) {
        // Piped into `head`: the reader has what it wanted.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(ExitCode::SUCCESS),
        other => {
            other.context("writing the response")?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Parses `--scope`.
pub fn parse_scope(s: &str) -> Result<GrepScope, String> {
    match s {
        "turns" => Ok(GrepScope::Turns),
        "summaries" => Ok(GrepScope::Summaries),
        "all" => Ok(GrepScope::All),
        other => Err(format!(
            "unknown scope {other:?}: use turns, summaries or all"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use contextfold::api::{HistoryRequest, StatusRequest};
    use contextfold::core::policy::PolicyConfig;
    use contextfold::core::state::State;

    fn answer(query: Query, state: &State, policy: &PolicyConfig) -> Result<String> {
        let reply = api::handle(
            query.op().as_str(),
            &query.body().context("encoding the request")?,
            state,
            policy,
        );
        render(&reply, Output::Json)
    }

    #[test]
    fn answers_are_the_api_json_and_errors_are_errors() {
        let state = State::default();
        let policy = PolicyConfig::default();
        let text = answer(
            Query::Status(StatusRequest { conversation: None }),
            &state,
            &policy,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["scope"], "global");
        assert_eq!(v["conversations"], 0);
        let err = answer(
            Query::History(HistoryRequest {
                conversation: "nobody".into(),
                limit: None,
                since: None,
                after: None,
            }),
            &state,
            &policy,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown conversation"), "{err}");
    }

    #[test]
    fn scopes_parse() {
        assert_eq!(parse_scope("turns"), Ok(GrepScope::Turns));
        assert_eq!(parse_scope("all"), Ok(GrepScope::All));
        assert!(parse_scope("everything").unwrap_err().contains("turns"));
    }
}
