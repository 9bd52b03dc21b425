//! Read-only queries of the local state through the API handlers: `status`,
//! `grep`, `describe`, `expand`, `history`. The output is the API's JSON
//! response (pretty), the same a NATS client gets.

use super::local::{open_pipeline, runtime};
use anyhow::{Context, Result};
use contextfold::api::describe::NodeRef;
use contextfold::api::grep::GrepScope;
use contextfold::api::{self, ApiError};
use contextfold::config::Config;
use contextfold::core::policy::PolicyConfig;
use contextfold::core::state::State;
use serde::Serialize;
use std::io::Write;
use std::process::ExitCode;

/// One query, as the CLI parsed it.
#[derive(Debug, Clone)]
pub enum Query {
    Status {
        conversation: Option<String>,
    },
    Grep {
        conversation: String,
        pattern: String,
        regex: bool,
        ignore_case: bool,
        limit: Option<usize>,
        scope: GrepScope,
    },
    Describe {
        conversation: String,
        id: String,
    },
    Expand {
        conversation: String,
        summary_id: String,
        max_tokens: Option<u64>,
        skip: usize,
    },
    History {
        conversation: String,
        limit: Option<usize>,
        since: Option<u64>,
    },
}

fn pretty<T: Serialize>(value: Result<T, ApiError>) -> Result<String> {
    // An API error is the command's error: printed on stderr, exit status 1.
    let value = value?;
    serde_json::to_string_pretty(&value).context("encoding the response")
}

/// Answers a query from a state, as pretty JSON.
pub fn answer(query: Query, state: &State, policy: &PolicyConfig) -> Result<String> {
    match query {
        Query::Status { conversation } => pretty(api::status::status(
            state,
            policy,
            &api::StatusRequest { conversation },
        )),
        Query::Grep {
            conversation,
            pattern,
            regex,
            ignore_case,
            limit,
            scope,
        } => pretty(api::grep::grep(
            state,
            &api::GrepRequest {
                conversation,
                pattern,
                regex,
                ignore_case,
                limit,
                scope,
            },
        )),
        Query::Describe { conversation, id } => pretty(api::describe::describe(
            state,
            &api::DescribeRequest {
                conversation,
                id: NodeRef::Id(id),
            },
        )),
        Query::Expand {
            conversation,
            summary_id,
            max_tokens,
            skip,
        } => pretty(api::expand::expand(
            state,
            &api::ExpandRequest {
                conversation,
                summary_id,
                max_tokens,
                skip,
            },
        )),
        Query::History {
            conversation,
            limit,
            since,
        } => pretty(api::history::history(
            state,
            &api::HistoryRequest {
                conversation,
                limit,
                since,
                after: None,
            },
        )),
    }
}

/// Opens the local state (catching it up with the log) and answers.
pub fn run(config: &Config, query: Query) -> Result<ExitCode> {
    let rt = runtime()?;
    let pipeline = rt.block_on(open_pipeline(config))?;
    let text = answer(query, &pipeline.engine.state, &config.policy)?;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}") {
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

    #[test]
    fn answers_are_the_api_json_and_errors_are_errors() {
        let state = State::default();
        let policy = PolicyConfig::default();
        let text = answer(Query::Status { conversation: None }, &state, &policy).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["scope"], "global");
        assert_eq!(v["conversations"], 0);
        let err = answer(
            Query::History {
                conversation: "nobody".into(),
                limit: None,
                since: None,
            },
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
