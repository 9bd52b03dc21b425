//! `demo`: the whole pipeline on a long session, explained.
//!
//! The session ([`contextfold::demo::session`], or a transcript with
//! `--file`) is folded event by event under a small budget with the
//! deterministic summarizer, exactly as `run` folds: in memory by default,
//! or into the embedded log and state of `--data DIR`, which it keeps so
//! that `audit`, `plot` and `ui` can be opened on it. Then it says in a few
//! lines what happened (compactions and why, the summary DAG, what the
//! model sees now, that nothing was lost), prints the state hash (the fold
//! is deterministic and the demo's events carry their own times, so every
//! run on every machine prints the same one) and what to look at next.

use super::local;
use anyhow::{bail, Context, Result};
use contextfold::config::Config;
use contextfold::core::assembly::{self, AssemblyRequest, Source};
use contextfold::core::event::Envelope;
use contextfold::core::policy::PolicyConfig;
use contextfold::import::{self, Format};
use contextfold::log::memory::MemoryLog;
use contextfold::log::EventLog;
use contextfold::runtime::audit as gather;
use contextfold::runtime::embedded::Pipeline;
use contextfold::runtime::engine::Engine;
use contextfold::store::memory_backend::MemoryBackend;
use contextfold::store::KvBackend;
use contextfold::summarizer::DeterministicSummarizer;
use std::path::Path;
use std::process::ExitCode;

/// Where the demo folds: in memory, or into a kept data directory.
pub enum Keep<'a> {
    Nothing,
    Data(&'a Path),
}

pub fn demo(config: &Config, keep: Keep<'_>, file: Option<&Path>, budget: u64) -> Result<ExitCode> {
    let events: Vec<Envelope> = match file {
        Some(f) => import::import_file(f, Format::Auto)?
            .into_iter()
            .flat_map(|c| c.events)
            .collect(),
        None => contextfold::demo::session(),
    };
    if events.is_empty() {
        bail!("no event to fold");
    }
    let mut config = config.clone();
    config.policy.default_context_window = budget;
    config.policy.max_assembly_token_budget = Some(budget);
    let rt = local::runtime()?;
    rt.block_on(async {
        let folded = match keep {
            Keep::Nothing => {
                let mut engine = Engine::open(MemoryBackend::default(), config.policy.clone())?;
                engine.set_residency(config.store.residency());
                let mut p =
                    Pipeline::open(MemoryLog::new(), engine, DeterministicSummarizer).await?;
                fold(&mut p, &events, &config).await?
            }
            Keep::Data(dir) => {
                let log = dir.join("log");
                let used = std::fs::read_dir(&log).is_ok_and(|mut d| d.next().is_some());
                if used {
                    bail!(
                        "{} already holds a log (a previous demo's, or other data): the demo \
                         keeps its store only in a new or empty directory. `contextfold --data \
                         {} audit CONV`, `plot` and `ui` read what is there; for a fresh demo, \
                         give another directory or remove this one",
                        dir.display(),
                        shell_word(&dir.display().to_string())
                    );
                }
                let mut p = local::open_pipeline(&config).await?;
                fold(&mut p, &events, &config).await?
            }
        };
        print!(
            "{}",
            wrapped(&explain(&folded, &config.policy, &keep, file, budget), 96)
        );
        Ok(ExitCode::SUCCESS)
    })
}

/// What the demo saw, for its explanation.
struct Folded {
    events: usize,
    conversations: usize,
    /// The conversation explained (the one with the most turns).
    key: String,
    turns: usize,
    raw_tokens: u64,
    audit: gather::Audited,
    /// The largest assembled context after any event of `key`.
    max_assembled: u64,
    now: contextfold::core::assembly::Assembled,
    leaves: usize,
    condensed: usize,
    depth: u32,
    state_hash: String,
}

/// Folds `events` one by one (the context after each is measured), then
/// gathers what [`explain`] tells.
async fn fold<L: EventLog, B: KvBackend>(
    p: &mut Pipeline<L, B, DeterministicSummarizer>,
    events: &[Envelope],
    config: &Config,
) -> Result<Folded> {
    let policy = &config.policy;
    let total = events.len();
    let mut max_assembled = std::collections::BTreeMap::<String, u64>::new();
    for (i, e) in events.iter().enumerate() {
        p.ingest(std::slice::from_ref(e)).await?;
        let tokens = p
            .engine
            .with_conversation(&e.conversation, |state, bodies| {
                state
                    .conversations
                    .get(&e.conversation)
                    .map(|conv| {
                        assembly::assemble_from(conv, bodies, policy, &AssemblyRequest::default())
                            .map(|out| out.tokens)
                    })
                    .transpose()
            })??;
        if let Some(tokens) = tokens {
            let max = max_assembled.entry(e.conversation.clone()).or_default();
            *max = (*max).max(tokens);
        }
        if (i + 1) % 100 == 0 || i + 1 == total {
            eprintln!("  {}/{total} events folded", i + 1);
        }
    }
    p.engine.flush()?;
    let mut largest: Option<(String, usize, u64)> = None;
    let mut conversations = 0;
    p.engine
        .each_conversation(|_, conv| -> Result<(), contextfold::store::StoreError> {
            conversations += 1;
            if largest
                .as_ref()
                .is_none_or(|(_, n, _)| conv.turns.len() > *n)
            {
                largest = Some((conv.key.clone(), conv.turns.len(), conv.raw_tokens()));
            }
            Ok(())
        })?;
    let Some((key, turns, raw_tokens)) = largest else {
        bail!("the events hold no conversation");
    };
    let (now, leaves, condensed, depth) =
        p.engine.with_conversation(&key, |state, bodies| {
            let conv = state
                .conversations
                .get(&key)
                .context("the conversation vanished")?;
            let now = assembly::assemble_from(conv, bodies, policy, &AssemblyRequest::default())?
                .into_owned();
            let leaves = conv.summaries.iter().filter(|s| s.depth == 0).count();
            let depth = conv.summaries.iter().map(|s| s.depth).max().unwrap_or(0);
            anyhow::Ok((now, leaves, conv.summaries.len() - leaves, depth))
        })??;
    let state_hash = p.engine.state_hash()?;
    let audit = gather::audit(&mut p.log, policy, config.store.residency(), &key).await?;
    Ok(Folded {
        events: total,
        conversations,
        max_assembled: max_assembled.get(&key).copied().unwrap_or_default(),
        key,
        turns,
        raw_tokens,
        audit,
        now,
        leaves,
        condensed,
        depth,
        state_hash,
    })
}

/// `n` with thousands separated by commas.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `text` with its long lines (not the indented command lines) wrapped at
/// `width`, continuation lines indented like the line they continue.
fn wrapped(text: &str, width: usize) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        if line.len() <= width || indent >= 4 {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let pad = " ".repeat(indent + 2);
        let mut current = line[..indent].to_string();
        let mut first = true;
        for word in line.split_whitespace() {
            let start = if first { indent } else { pad.len() };
            if current.len() > start && current.len() + 1 + word.len() > width {
                out.push_str(&current);
                out.push('\n');
                current = pad.clone();
                first = false;
            } else if current.len() > start {
                current.push(' ');
            }
            current.push_str(word);
        }
        out.push_str(&current);
        out.push('\n');
    }
    out
}

/// `s` as one shell word.
fn shell_word(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/=@%+,".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The demo's account of what it did and what to look at next.
fn explain(
    f: &Folded,
    policy: &PolicyConfig,
    keep: &Keep<'_>,
    file: Option<&Path>,
    budget: u64,
) -> String {
    use std::fmt::Write as _;
    let t = &f.audit.audit.totals;
    let threshold = f
        .audit
        .audit
        .points
        .last()
        .map_or(0, |p| p.threshold_tokens);
    let mut out = String::new();
    let what = match file {
        Some(path) => format!("{} ({})", path.display(), f.key),
        None => format!("a generated coding-agent session ({})", f.key),
    };
    let _ = writeln!(
        out,
        "\ncontextfold demo: {what}, {} events and {} turns ({} tokens of history), folded \
         event by event under a {}-token budget with the deterministic summarizer (no model, \
         no key, no server).",
        thousands(f.events as u64),
        thousands(f.turns as u64),
        thousands(f.raw_tokens),
        thousands(budget)
    );
    if f.conversations > 1 {
        let _ = writeln!(
            out,
            "({} conversations; the one with the most turns is explained.)",
            f.conversations
        );
    }
    let _ = writeln!(out, "\nWhat happened");
    if t.compactions == 0 {
        let _ = writeln!(
            out,
            "  No compaction: the context never passed its threshold ({} tokens). A smaller \
             --budget makes it compact.",
            thousands(threshold)
        );
    } else {
        let overflow = if t.overflows > 0 {
            format!(
                "; {} of them forced at once by a provider's context-overflow error",
                t.overflows
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "  Compacted {} times: whenever the context passed {} tokens (context_threshold \
             {} of the budget), the oldest turns outside the fresh tail (the newest turns, kept \
             verbatim) were summarized in the background{overflow}.",
            t.compactions,
            thousands(threshold),
            policy.context_threshold
        );
        let _ = writeln!(
            out,
            "  {} summaries form a DAG of depth {}: {} leaves over raw turns and {} condensed \
             summaries over other summaries.",
            t.summaries.max((f.leaves + f.condensed) as u64),
            f.depth,
            f.leaves,
            f.condensed
        );
    }
    let summaries_now = f
        .now
        .sources
        .iter()
        .filter(|s| matches!(s, Source::Summary { .. }))
        .count();
    let turns_now: Vec<u64> = f
        .now
        .sources
        .iter()
        .filter_map(|s| match s {
            Source::Turn { seq } => Some(*seq),
            _ => None,
        })
        .collect();
    let rolling = f
        .now
        .sources
        .iter()
        .any(|s| matches!(s, Source::RollingState));
    let _ = writeln!(
        out,
        "  The model never saw more than {} tokens (budget {}). Now it sees {}: {} \
         summar{}{}, and {} turns verbatim{}.",
        thousands(f.max_assembled),
        thousands(budget),
        thousands(f.now.tokens),
        summaries_now,
        if summaries_now == 1 { "y" } else { "ies" },
        if rolling {
            ", the rolling session state"
        } else {
            ""
        },
        turns_now.len(),
        match (turns_now.first(), turns_now.last()) {
            (Some(a), Some(b)) => format!(" (turns {a} to {b})"),
            _ => String::new(),
        }
    );
    let _ = writeln!(
        out,
        "  Nothing was lost: all {} turns stay in the log byte for byte; `describe`, `expand` \
         and `grep` reach any of them.",
        thousands(f.turns as u64)
    );
    let _ = writeln!(
        out,
        "  State hash {}: the fold reads no clock, so every run of this demo on every \
         machine prints this hash.",
        f.state_hash
    );
    let key = shell_word(&f.key);
    let (data, note) = match keep {
        Keep::Data(dir) => (
            format!("--data {}", shell_word(&dir.display().to_string())),
            format!(
                "Look next (the log and the state are kept in {}):",
                dir.display()
            ),
        ),
        Keep::Nothing => (
            "--data demo-data".to_string(),
            "Look next. This run kept nothing: to keep its log and state, give it a data \
             directory first, `contextfold --data demo-data demo`, then:"
                .to_string(),
        ),
    };
    let _ = writeln!(out, "\n{note}");
    let rows = [
        (
            "every compaction as a sentence: why, tokens before and after, what was summarized",
            format!("contextfold {data} audit {key}"),
        ),
        (
            "context tokens after every event, above the summary DAG",
            format!("contextfold {data} plot {key} --out demo.svg"),
        ),
        (
            "the audit page in a browser: click a point to see what the model saw then",
            format!("contextfold {data} ui"),
        ),
        (
            "exactly what the model sees now, message by message",
            format!("contextfold {data} assemble {key}"),
        ),
    ];
    for (what, command) in rows {
        let _ = writeln!(out, "  {what}\n      {command}");
    }
    out
}
