//! Subcommands. Each reads the configuration, opens what it needs under the
//! data directory and reports in plain text (or JSON where asked).

pub(crate) mod audit;
mod demo;
mod doctor;
mod eval;
mod gateway;
mod local;
mod nats_args;
mod publish;
mod query;
mod recall;
mod report;
mod serve;
mod whatif;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use contextfold::api::describe::NodeRef;
use contextfold::api::{
    AssembleRequest, CompactRequest, DescribeRequest, ExpandRequest, GrepRequest, HistoryRequest,
    StatusRequest,
};
use contextfold::config::{Config, LogFormat};
use contextfold::core::assembly::AssemblyRequest;
use query::{Output, Query};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "contextfold",
    version,
    about = "Lossless, bounded context for LLM agents"
)]
pub struct Cli {
    /// Configuration file (TOML); `CONTEXTFOLD_*` variables override it.
    #[arg(long, global = true, env = "CONTEXTFOLD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Where the embedded log and the state live (default `.contextfold`,
    /// the same for every subcommand).
    #[arg(long, global = true)]
    pub data: Option<PathBuf>,
    /// Log format on stderr: text or json (default `[log] format`, text).
    /// The filter is `CONTEXTFOLD_LOG` (default `warn`, e.g.
    /// `CONTEXTFOLD_LOG=contextfold=info`).
    #[arg(long, global = true, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Convert a transcript file into inbound events (JSONL on stdout).
    Import {
        #[arg(
            long,
            default_value = "auto",
            help = format!("{}.", contextfold::import::Format::NAMES.join(", "))
        )]
        format: String,
        file: PathBuf,
    },
    /// Classify provider error texts (one per line on stdin): `overflow` or `other`.
    ClassifyErrors,
    /// Fold events (JSONL from `import`, or a transcript file) into the
    /// embedded log and state, compacting with the deterministic summarizer.
    Run {
        /// Events as JSONL, or any transcript `import` reads; `-` or none for stdin.
        file: Option<PathBuf>,
        /// Transcript format when FILE is a transcript.
        #[arg(long, default_value = "auto")]
        format: String,
        /// Events appended (and fsync'd) per batch: one log sync and one
        /// state commit each. Turns are measured ahead of the fold in
        /// pieces of a sixteenth of it, up to a batch ahead.
        /// 4096 ran ~5% faster than 512 on real transcripts without
        /// compaction (fewer commits) and the same with it; a crash loses
        /// at most the batch in flight, which running the same input again
        /// restores (events are deduplicated by id).
        #[arg(long, default_value_t = 4096)]
        batch: usize,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Rebuild every conversation's state from the log; print state hashes.
    /// With --policy: what that policy would have done with the same agent
    /// events, beside what happened (in memory; nothing is written).
    Replay {
        /// A `[policy]` section (TOML) to fold the agent events under.
        #[arg(long)]
        policy: Option<PathBuf>,
        /// Print the what-if as JSON.
        #[arg(long, requires = "policy")]
        json: bool,
        /// Only these conversations (default: every one).
        #[arg(requires = "policy")]
        conversations: Vec<String>,
    },
    /// Print exactly what the model sees for a conversation.
    Assemble {
        conversation: String,
        /// Assemble as of this event id (replays the local log up to it).
        #[arg(long, conflicts_with = "servers")]
        at: Option<String>,
        /// Token budget (default: the conversation's resolved budget).
        #[arg(long)]
        budget: Option<u64>,
        /// The prompt about to be sent: its tokens are reserved from the budget.
        #[arg(long)]
        prompt: Option<String>,
        /// Prompt-aware eviction: when the older context does not all fit,
        /// keep what is most relevant to `--prompt` rather than the newest
        /// (the output says which items were chosen by relevance).
        #[arg(long, requires = "prompt")]
        prompt_aware: bool,
        /// Print JSON (messages in OpenAI chat shape plus accounting).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// Rebuild the state from the log into a fresh store and check the
    /// hashes agree with the current one. Deletes nothing.
    Rebuild,
    /// Run the whole pipeline on a realistic long agent session and say
    /// what happened and what to look at next. In memory, unless `--data
    /// DIR` is given: then its log and state are kept there, for `audit`,
    /// `plot` and `ui`.
    Demo {
        /// Use this transcript instead of the built-in session.
        #[arg(long)]
        file: Option<PathBuf>,
        /// Budget (context window) for the demo.
        #[arg(long, default_value_t = 32_000)]
        budget: u64,
    },
    /// Quality report: run transcripts through the pipeline in memory and
    /// measure budget overflows, compression and identifier retention.
    Eval {
        /// Token budget of every assembled context; repeat it to run the
        /// whole evaluation at several budgets (one report each).
        #[arg(long, default_values_t = [eval::DEFAULT_BUDGET])]
        budget: Vec<u64>,
        /// Continuity probes (JSON Lines, `core::probes`; repeat it for
        /// several files): each probe is checked against the assembled
        /// context and against plain truncation (the newest raw turns that
        /// fit) at the same budget.
        #[arg(long, value_name = "FILE")]
        probes: Vec<PathBuf>,
        /// Print one JSON object (the last line of output).
        #[arg(long)]
        json: bool,
        /// Keep the run's data directory here (one numbered directory per
        /// file when several), so its summaries can be read with
        /// `--data DIR describe`, `history` and `assemble`.
        #[arg(long, value_name = "DIR")]
        keep: Option<PathBuf>,
        /// Transcript files (any format `import` reads).
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Print the effective configuration as TOML.
    Config,
    /// Status of the whole state, or of one conversation (JSON): tokens,
    /// frontier, compression, summaries by depth, debt, spend, health.
    Status {
        conversation: Option<String>,
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// Search a conversation's raw turns and summaries (JSON).
    Grep {
        conversation: String,
        pattern: String,
        /// PATTERN is a regular expression (default: plain text).
        #[arg(long)]
        regex: bool,
        #[arg(long, short = 'i')]
        ignore_case: bool,
        /// Items returned at most (default 50, at most 500).
        #[arg(long)]
        limit: Option<usize>,
        /// turns, summaries or all.
        #[arg(long, default_value = "all", value_parser = query::parse_scope)]
        scope: contextfold::api::grep::GrepScope,
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// A summary, or a turn by event id or turn number, in full (JSON).
    Describe {
        conversation: String,
        id: String,
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// The child summaries or raw turns under a summary, within a token cap (JSON).
    Expand {
        conversation: String,
        summary_id: String,
        /// Token cap (default 4000).
        #[arg(long)]
        max_tokens: Option<u64>,
        /// Items to skip first (the `next_skip` of a cut expansion).
        #[arg(long, default_value_t = 0)]
        skip: usize,
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// Ask for a compaction now (JSON): records a manual debt that the next
    /// sweep pays, with optional instructions for the summaries.
    Compact {
        conversation: String,
        /// What the summaries must keep or focus on.
        #[arg(long)]
        instructions: Option<String>,
        /// Compact down to this many context tokens (default: the policy's target).
        #[arg(long)]
        target_tokens: Option<u64>,
        /// Recorded in the event (see docs/api.md).
        #[arg(long)]
        keep_recent_tokens: Option<u64>,
        /// Idempotency key: asking again with the same key is folded once
        /// (default: a fresh key per invocation).
        #[arg(long)]
        request_id: Option<String>,
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// The compaction decisions of a conversation, in order (JSON).
    History {
        conversation: String,
        /// Entries at most (default 500).
        #[arg(long)]
        limit: Option<usize>,
        /// Only entries at or after this event time (ms since the epoch).
        #[arg(long)]
        since: Option<u64>,
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// Answer a question about a conversation's history with a model that
    /// reads the most relevant turns and summaries under a token cap and a
    /// deadline (`[recall]`); prints the answer, then the sources it read.
    /// Its spend is recorded in the embedded log and counts in the
    /// conversation's spend window.
    Recall {
        conversation: String,
        question: String,
        /// Cap on the tokens the model reads (default `recall.max_tokens`).
        #[arg(long)]
        max_tokens: Option<u64>,
        /// Print the API's JSON response.
        #[arg(long)]
        json: bool,
        /// Idempotency key (default: a fresh one per invocation).
        #[arg(long)]
        request_id: Option<String>,
        /// Ask a running `contextfold serve` over NATS (its model answers,
        /// its events stream records the spend) instead of the embedded store.
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// Every compaction decision of a conversation in log order, with its
    /// reason, context tokens before and after, summaries, model, calls,
    /// tokens, cost and outcomes, from the embedded log folded in memory.
    /// With --nats, the conversation's partition of the JetStream events
    /// stream is read (and folded here) instead.
    Audit {
        conversation: String,
        /// Print JSON (entries, compactions, fallbacks, chart points).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// Draw a conversation as SVG: context tokens at every event (with the
    /// threshold, target and budget lines, compactions and overflows)
    /// above its summary DAG.
    Plot {
        conversation: String,
        /// The SVG file to write.
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// The audit page over the embedded store: conversations, timeline
    /// chart, what the model saw at each event, the summary DAG.
    Ui {
        /// Listen on this address (loopback by default; beyond loopback
        /// the page needs `[http] token`, CONTEXTFOLD_HTTP__TOKEN).
        #[arg(long, default_value = "127.0.0.1")]
        host: std::net::IpAddr,
        /// Port (0: any free one; the URL is printed).
        #[arg(long, default_value_t = 8765)]
        port: u16,
        /// A NATS deployment instead of the embedded store.
        #[command(flatten)]
        nats: nats_args::NatsArgs,
    },
    /// Run contextfold over NATS JetStream: fold published turns, run
    /// compaction jobs, answer requests; until SIGTERM or Ctrl-C.
    Serve {
        #[command(flatten)]
        nats: nats_args::NatsArgs,
        /// Roles of this process: folder, summarizer, api, gateway
        /// (comma-separated) or all (every one but the gateway, which
        /// needs `[gateway] upstream`).
        #[arg(long, default_value = "folder,summarizer,api")]
        roles: contextfold::nats::serve::Roles,
        /// Compaction jobs run at once by the summarizer role.
        #[arg(long)]
        concurrency: Option<usize>,
        /// Serve /metrics, /healthz and /readyz on this address
        /// (`127.0.0.1:9464`; overrides `[http] listen`). Unauthenticated
        /// and without conversation data: keep it on loopback or a private
        /// network.
        #[arg(long, value_name = "ADDR")]
        http: Option<std::net::SocketAddr>,
        /// Also serve the audit page at `/` of the HTTP server. It shows
        /// conversation content: it answers only requests naming this
        /// server, and beyond loopback needs `[http] token`
        /// (CONTEXTFOLD_HTTP__TOKEN), without which it refuses to start.
        #[arg(long)]
        audit_page: bool,
    },
    /// Check a NATS deployment as an operator would (server, JetStream,
    /// streams, consumers and lag, jobs, dead letters, leases): one line
    /// per check, `ok`, `warn` or `FAIL` with what to do; exit 1 on a FAIL.
    /// Reads only.
    Doctor {
        #[command(flatten)]
        nats: nats_args::NatsArgs,
        /// Print one JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// An LLM gateway in front of an upstream provider (OpenAI Chat
    /// Completions, OpenAI Responses, Anthropic Messages): keeps every turn,
    /// and past the budget sends the model contextfold's assembled context
    /// (docs/gateway.md). Embedded store by default; a deployment with --nats.
    Gateway(gateway::GatewayArgs),
    /// Publish inbound events to NATS as an agent would (Nats-Msg-Id scoped to the conversation, keyed by the credentials given).
    Publish {
        #[command(flatten)]
        nats: nats_args::NatsArgs,
        /// Events as JSONL (what `import` writes), or any transcript `import`
        /// reads; `-` or none for stdin.
        file: Option<PathBuf>,
        /// Transcript format when FILE is a transcript.
        #[arg(long, default_value = "auto")]
        format: String,
        /// How long to keep sending again, with a jittered exponential
        /// backoff, events the stream did not store for a reason that
        /// passes (no leader during an election, no answer, no responders,
        /// a lost connection), counted from the first failure and afresh
        /// after any progress; 0 fails at once. Retries reuse the message
        /// ids, so nothing is stored twice.
        #[arg(long, value_name = "SECONDS", default_value_t = 60)]
        retry_for: u64,
    },
}

/// Logs to stderr, filtered by `CONTEXTFOLD_LOG` (default `warn`).
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CONTEXTFOLD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
}

pub fn run(cli: Cli) -> Result<ExitCode> {
    let mut config = Config::load(cli.config.as_deref()).context("loading configuration")?;
    let data_given = cli.data.is_some();
    if let Some(d) = cli.data {
        config.data_dir = d;
    }
    if let Some(f) = cli.log_format {
        config.log.format = f;
    }
    init_logging(config.log.format);
    match cli.command {
        Command::Import { format, file } => local::import(&format, &file),
        Command::ClassifyErrors => local::classify_errors(),
        Command::Run {
            file,
            format,
            batch,
            json,
        } => local::run(&config, file.as_deref(), &format, batch, json),
        Command::Replay { policy: None, .. } => local::replay(&config),
        Command::Replay {
            policy: Some(file),
            json,
            conversations,
        } => local::what_if(&config, &file, &conversations, json),
        Command::Assemble {
            conversation,
            at,
            budget,
            prompt,
            prompt_aware,
            json,
            nats,
        } => {
            if nats.servers.is_empty() {
                let request = AssemblyRequest {
                    budget,
                    prompt,
                    prompt_aware_eviction: prompt_aware,
                    summaries_as_they_are: false,
                };
                local::assemble(&config, &conversation, at.as_deref(), request, json)
            } else {
                let output = if json { Output::Json } else { Output::Text };
                let request = AssembleRequest {
                    conversation,
                    budget,
                    prompt,
                    prompt_aware_eviction: prompt_aware,
                    summaries_as_they_are: false,
                    since: None,
                };
                query::run(&config, &nats, Query::Assemble(request), output)
            }
        }
        Command::Rebuild => local::rebuild(&config),
        Command::Recall {
            conversation,
            question,
            max_tokens,
            json,
            request_id,
            nats,
        } => recall::recall(
            &config,
            &nats,
            contextfold::api::RecallRequest {
                conversation,
                question,
                max_tokens,
                request_id,
            },
            json,
        ),
        Command::Audit {
            conversation,
            json,
            nats,
        } => audit::audit(&config, &nats, &conversation, json),
        Command::Plot {
            conversation,
            out,
            nats,
        } => audit::plot(&config, &nats, &conversation, &out),
        Command::Ui { host, port, nats } => {
            audit::ui(&config, &nats, std::net::SocketAddr::new(host, port))
        }

        Command::Demo { file, budget } => {
            let keep = if data_given {
                demo::Keep::Data(&config.data_dir)
            } else {
                demo::Keep::Nothing
            };
            demo::demo(&config, keep, file.as_deref(), budget)
        }
        Command::Eval {
            budget,
            probes,
            json,
            keep,
            files,
        } => eval::eval(&config, &files, &budget, &probes, json, keep.as_deref()),
        Command::Serve {
            nats,
            roles,
            concurrency,
            http,
            audit_page,
        } => {
            if let Some(addr) = http {
                config.http.listen = Some(addr);
            }
            serve::serve(&config, &nats, roles, concurrency, audit_page)
        }
        Command::Doctor { nats, json } => doctor::doctor(&config, &nats, json),
        Command::Gateway(args) => gateway::gateway(config, args),
        Command::Publish {
            nats,
            file,
            format,
            retry_for,
        } => publish::publish(
            &config,
            &nats,
            file.as_deref(),
            &format,
            std::time::Duration::from_secs(retry_for),
        ),
        Command::Config => {
            print!("{}", config.to_toml());
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { conversation, nats } => ask(
            &config,
            &nats,
            Query::Status(StatusRequest { conversation }),
        ),
        Command::Grep {
            conversation,
            pattern,
            regex,
            ignore_case,
            limit,
            scope,
            nats,
        } => ask(
            &config,
            &nats,
            Query::Grep(GrepRequest {
                conversation,
                pattern,
                regex,
                ignore_case,
                limit,
                scope,
            }),
        ),
        Command::Describe {
            conversation,
            id,
            nats,
        } => ask(
            &config,
            &nats,
            Query::Describe(DescribeRequest {
                conversation,
                id: NodeRef::Id(id),
            }),
        ),
        Command::Expand {
            conversation,
            summary_id,
            max_tokens,
            skip,
            nats,
        } => ask(
            &config,
            &nats,
            Query::Expand(ExpandRequest {
                conversation,
                summary_id,
                max_tokens,
                skip,
            }),
        ),
        Command::Compact {
            conversation,
            instructions,
            target_tokens,
            keep_recent_tokens,
            request_id,
            nats,
        } => ask(
            &config,
            &nats,
            Query::Compact(CompactRequest {
                conversation,
                instructions,
                target_tokens,
                keep_recent_tokens,
                id: None,
                request_id: Some(request_id.unwrap_or_else(query::fresh_request_id)),
                time: None,
            }),
        ),
        Command::History {
            conversation,
            limit,
            since,
            nats,
        } => ask(
            &config,
            &nats,
            Query::History(HistoryRequest {
                conversation,
                limit,
                since,
                after: None,
            }),
        ),
    }
}

fn ask(config: &Config, nats: &nats_args::NatsArgs, query: Query) -> Result<ExitCode> {
    query::run(config, nats, query, Output::Json)
}
