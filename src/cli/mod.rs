//! Subcommands. Each reads the configuration, opens what it needs under the
//! data directory and reports in plain text (or JSON where asked).

mod eval;
mod local;
mod publish;
mod report;
mod serve;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use contextfold::config::Config;
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
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Convert a transcript file into inbound events (JSONL on stdout).
    Import {
        /// auto, openai, pi, claude-code, swe-agent, openhands, aider.
        #[arg(long, default_value = "auto")]
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
        /// Events appended (and fsync'd) per batch.
        #[arg(long, default_value_t = 512)]
        batch: usize,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Rebuild every conversation's state from the log; print state hashes.
    Replay,
    /// Print exactly what the model sees for a conversation.
    Assemble {
        conversation: String,
        /// Assemble as of this event id (replays the log up to it).
        #[arg(long)]
        at: Option<String>,
        /// Token budget (default: the conversation's resolved budget).
        #[arg(long)]
        budget: Option<u64>,
        /// Print JSON (messages in OpenAI chat shape plus accounting).
        #[arg(long)]
        json: bool,
    },
    /// Rebuild the state from the log into a fresh store and check the
    /// hashes agree with the current one. Deletes nothing.
    Rebuild,
    /// Run the whole pipeline on a realistic long agent session.
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
        /// Token budget of every assembled context.
        #[arg(long, default_value_t = eval::DEFAULT_BUDGET)]
        budget: u64,
        /// Print one JSON object (the last line of output).
        #[arg(long)]
        json: bool,
        /// Transcript files (any format `import` reads).
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Print the effective configuration as TOML.
    Config,
    /// Run contextfold over NATS JetStream: fold published turns, run
    /// compaction jobs, answer requests; until SIGTERM or Ctrl-C.
    Serve {
        #[command(flatten)]
        nats: serve::NatsArgs,
        /// Roles of this process: folder, summarizer, api (comma-separated) or all.
        #[arg(long, default_value = "folder,summarizer,api")]
        roles: contextfold::nats::serve::Roles,
        /// Compaction jobs run at once by the summarizer role.
        #[arg(long)]
        concurrency: Option<usize>,
    },
    /// Publish inbound events to NATS as an agent would (Nats-Msg-Id = event id).
    Publish {
        #[command(flatten)]
        nats: serve::NatsArgs,
        /// Events as JSONL (what `import` writes), or any transcript `import`
        /// reads; `-` or none for stdin.
        file: Option<PathBuf>,
        /// Transcript format when FILE is a transcript.
        #[arg(long, default_value = "auto")]
        format: String,
    },
}

pub fn run(cli: Cli) -> Result<ExitCode> {
    let mut config = Config::load(cli.config.as_deref()).context("loading configuration")?;
    if let Some(d) = cli.data {
        config.data_dir = d;
    }
    match cli.command {
        Command::Import { format, file } => local::import(&format, &file),
        Command::ClassifyErrors => local::classify_errors(),
        Command::Run {
            file,
            format,
            batch,
            json,
        } => local::run(&config, file.as_deref(), &format, batch, json),
        Command::Replay => local::replay(&config),
        Command::Assemble {
            conversation,
            at,
            budget,
            json,
        } => local::assemble(&config, &conversation, at.as_deref(), budget, json),
        Command::Rebuild => local::rebuild(&config),
        Command::Demo { file, budget } => local::demo(&config, file.as_deref(), budget),
        Command::Eval {
            budget,
            json,
            files,
        } => eval::eval(&config, &files, budget, json),
        Command::Serve {
            nats,
            roles,
            concurrency,
        } => serve::serve(&config, &nats, roles, concurrency),
        Command::Publish { nats, file, format } => {
            publish::publish(&config, &nats, file.as_deref(), &format)
        }
        Command::Config => {
            print!("{}", config.to_toml());
            Ok(ExitCode::SUCCESS)
        }
    }
}
