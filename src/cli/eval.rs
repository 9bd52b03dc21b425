//! `contextfold eval`: the quality report. Each transcript runs through the
//! embedded pipeline in memory, one event at a time, with the deterministic
//! summarizer (or the model one when `[summarizer]` is configured). After
//! every turn the context is assembled within the budget; at the end the
//! report gives budget overflows (must be 0), compression per summary depth,
//! the share of the source's opaque identifiers still in the assembled
//! context, and what the summarizer spent.

use anyhow::{Context, Result};
use contextfold::config::Config;
use contextfold::core::assembly::{self, Assembled, AssemblyRequest};
use contextfold::core::event::EventBody;
use contextfold::core::identifiers;
use contextfold::core::message::Role;
use contextfold::core::policy::PolicyConfig;
use contextfold::core::probes::{self, Probe, ProbeKind, ProbeReport};
use contextfold::core::state::event_digest;
use contextfold::core::state::{ContextItem, Conversation, TurnBodies};
use contextfold::import::{self, Format};
use contextfold::log::memory::MemoryLog;
use contextfold::log::segment::SegmentLog;
use contextfold::log::EventLog;
use contextfold::runtime::embedded::Pipeline;
use contextfold::runtime::engine::Engine;
use contextfold::secret::redact_url;
use contextfold::store::memory_backend::MemoryBackend;
use contextfold::summarizer::prompts::EXACT_IDENTIFIERS_HEADING;
use contextfold::summarizer::stack;
use contextfold::summarizer::{DeterministicSummarizer, Summarizer};
use contextfold::telemetry;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// Budget when `--budget` is not given.
pub const DEFAULT_BUDGET: u64 = 32_000;

/// Raw tokens under the summaries of one depth in the final context, and
/// the summaries' own tokens.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct DepthCompression {
    pub summaries: usize,
    pub covered_tokens: u64,
    pub summary_tokens: u64,
    pub ratio: f64,
}

impl DepthCompression {
    fn add(&mut self, other: &DepthCompression) {
        self.summaries += other.summaries;
        self.covered_tokens += other.covered_tokens;
        self.summary_tokens += other.summary_tokens;
        self.ratio = ratio(self.covered_tokens, self.summary_tokens);
    }
}

fn ratio(covered: u64, summary: u64) -> f64 {
    if summary == 0 {
        1.0
    } else {
        covered as f64 / summary as f64
    }
}

/// What the summarizer spent, from the `sweep_ended` events in the log.
#[derive(Debug, Default, Clone, Serialize)]
pub struct SweepSpend {
    pub sweeps: u64,
    pub calls: u64,
    pub tokens: u64,
    pub cost_micros: u64,
    /// Sweeps by how they stopped (`done`, `deadline`, ...).
    pub stops: BTreeMap<String, u64>,
}

/// The report of one transcript file.
#[derive(Debug, Default, Clone, Serialize)]
pub struct FileReport {
    pub file: String,
    pub format: String,
    pub conversations: usize,
    /// The conversations' ids (for `describe`, `history` and `assemble`
    /// on a data directory kept with `--keep`).
    pub conversation_ids: Vec<String>,
    pub turns: u64,
    pub raw_tokens: u64,
    /// Context tokens at the end (what the fold holds for the agent).
    pub context_tokens: u64,
    /// Largest assembled context after any turn.
    pub max_assembled_tokens: u64,
    /// Tokens of the final assembled contexts.
    pub final_assembled_tokens: u64,
    /// Assemblies (one after every turn) larger than the budget.
    pub overflows: u64,
    pub assemblies: u64,
    pub identifiers: u64,
    pub identifiers_retained: u64,
    pub identifier_retention: f64,
    /// Identifiers found in the context apart from the "Exact identifiers"
    /// appendices: what the summaries' own text and the raw turns kept.
    pub identifiers_retained_in_text: u64,
    pub identifier_retention_in_text: f64,
    /// Identifiers found only in an "Exact identifiers" appendix.
    pub identifiers_only_in_appendix: u64,
    /// Identifiers that matter ([`matters`]): mentioned by two turns or
    /// more, or by the user. The retention goal is on these: every
    /// identifier of a long session does not fit its budget (the pi
    /// session's 1,738 cost 33,755 tokens listed one per line).
    pub identifiers_that_matter: u64,
    pub identifiers_that_matter_retained: u64,
    pub retention_of_identifiers_that_matter: f64,
    /// Identifiers only a demonstration of another task names (SWE-agent's
    /// `is_demo`): not this conversation's, so not counted above.
    pub identifiers_only_in_demonstrations: u64,
    /// Identifiers only large payloads name: a large payload is a stub in
    /// every context at this budget (larger than the compaction target),
    /// so not counted above either.
    pub identifiers_only_in_large_payloads: u64,
    /// Retention by the kind of identifier (paths, hashes, UUIDs, URLs, ...).
    pub retention_by_kind: BTreeMap<&'static str, KindRetention>,
    pub compression_by_depth: BTreeMap<u32, DepthCompression>,
    pub compression_ratio: f64,
    pub fallback_summaries: u64,
    /// Summaries refused by validation, by reason (`refusal`, `copy`,
    /// `truncated`, ...).
    pub rejections: BTreeMap<String, u64>,
    /// Escalations by kind (`aggressive`, `fallback`).
    pub escalations: BTreeMap<String, u64>,
    /// Prompt-aware eviction measured before every user turn, that turn as
    /// the prompt.
    pub prompt_aware: PromptAwareEffect,
    pub spend: SweepSpend,
    /// Continuity probes of this file's conversations, with the plain
    /// truncation baseline at the same budget.
    pub probes: ProbeReport,
    /// Probes whose `at_turn` the conversation never reached.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub probes_never_reached: Vec<String>,
    pub seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Runs `contextfold eval`: the whole evaluation once per budget.
pub fn eval(
    config: &Config,
    files: &[PathBuf],
    budgets: &[u64],
    probe_files: &[PathBuf],
    json: bool,
    keep: Option<&Path>,
) -> Result<ExitCode> {
    if budgets.is_empty() {
        anyhow::bail!("give at least one --budget");
    }
    let mut probes: Vec<Probe> = Vec::new();
    for path in probe_files {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the probe file {}", path.display()))?;
        let more = probes::parse(&text)
            .with_context(|| format!("reading the probe file {}", path.display()))?;
        if let Some(p) = more.iter().find(|p| probes.iter().any(|q| q.id == p.id)) {
            anyhow::bail!(
                "probe id {:?} of {} is used by an earlier probe file too",
                p.id,
                path.display()
            );
        }
        probes.extend(more);
    }
    let mut failed = false;
    for &budget in budgets {
        let keep = match keep {
            Some(dir) if budgets.len() > 1 => Some(dir.join(format!("budget-{budget}"))),
            Some(dir) => Some(dir.to_path_buf()),
            None => None,
        };
        failed |= eval_at(
            config,
            files,
            budget,
            &probes,
            !probe_files.is_empty(),
            json,
            keep.as_deref(),
        )?;
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// One evaluation at one budget; true when it failed (an overflow or a
/// file that could not be evaluated).
fn eval_at(
    config: &Config,
    files: &[PathBuf],
    budget: u64,
    probes: &[Probe],
    with_probes: bool,
    json: bool,
    keep: Option<&Path>,
) -> Result<bool> {
    if budget == 0 {
        anyhow::bail!("--budget must be at least 1 token");
    }
    let keep_dirs = match keep {
        Some(dir) => Some(keep_dirs(dir, files)?),
        None => None,
    };
    let mut policy = config.policy.clone();
    policy.default_context_window = budget;
    policy.max_assembly_token_budget = Some(budget);
    policy
        .validate()
        .context("the policy cannot work with this budget")?;
    let summarizer_name = match &config.summarizer {
        Some(s) => format!("llm {} at {}", s.model, redact_url(&s.base_url)),
        None => "deterministic".to_string(),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let mut reports = Vec::new();
    for (n, file) in files.iter().enumerate() {
        let started = Instant::now();
        let before = telemetry::summary_tally();
        let keep_dir = keep_dirs.as_ref().and_then(|d| d.get(n));
        let result = rt.block_on(async {
            match (&config.summarizer, keep_dir) {
                (Some(cfg), None) => {
                    let pass = stack::model(cfg).context("building the model summarizer")?;
                    eval_file(file, &policy, budget, probes, pass, MemoryLog::new()).await
                }
                (None, None) => {
                    eval_file(
                        file,
                        &policy,
                        budget,
                        probes,
                        DeterministicSummarizer,
                        MemoryLog::new(),
                    )
                    .await
                }
                (Some(cfg), Some(dir)) => {
                    let pass = stack::model(cfg).context("building the model summarizer")?;
                    eval_file(file, &policy, budget, probes, pass, kept_log(dir)?).await
                }
                (None, Some(dir)) => {
                    eval_file(
                        file,
                        &policy,
                        budget,
                        probes,
                        DeterministicSummarizer,
                        kept_log(dir)?,
                    )
                    .await
                }
            }
        });
        let mut report = result.unwrap_or_else(|e| FileReport {
            file: file.display().to_string(),
            error: Some(format!("{e:#}")),
            ..FileReport::default()
        });
        report.seconds = started.elapsed().as_secs_f64();
        let after = telemetry::summary_tally();
        for (&(what, kind), &n) in &after {
            let n = n.saturating_sub(before.get(&(what, kind)).copied().unwrap_or(0));
            if n == 0 {
                continue;
            }
            let into = if what == "rejected" {
                &mut report.rejections
            } else {
                &mut report.escalations
            };
            *into.entry(kind.to_string()).or_default() += n;
        }
        if let Some(dir) = keep_dir {
            eprintln!(
                "  kept {} (read it with `contextfold --data {} history|assemble|describe CONVERSATION`; conversations: {})",
                dir.display(),
                dir.display(),
                report.conversation_ids.join(", ")
            );
        }
        eprintln!(
            "  {}: {} turns in {:.1}s",
            report.file, report.turns, report.seconds
        );
        reports.push(report);
    }
    let total = totals(&reports);
    let evaluated: HashSet<&str> = reports
        .iter()
        .flat_map(|r| r.conversation_ids.iter().map(String::as_str))
        .collect();
    let probes_elsewhere = probes
        .iter()
        .filter(|p| !evaluated.contains(p.conversation.as_str()))
        .count();
    if json {
        let mut summary = serde_json::json!({
            "budget": budget,
            "summarizer": summarizer_name,
            "files": reports,
            "overflows": total.overflows,
            "assemblies": total.assemblies,
            "identifier_retention": total.identifier_retention,
            "identifiers": total.identifiers,
            "identifiers_retained": total.identifiers_retained,
            "identifier_retention_in_text": total.identifier_retention_in_text,
            "identifiers_retained_in_text": total.identifiers_retained_in_text,
            "identifiers_only_in_appendix": total.identifiers_only_in_appendix,
            "identifiers_that_matter": total.identifiers_that_matter,
            "identifiers_that_matter_retained": total.identifiers_that_matter_retained,
            "retention_of_identifiers_that_matter": total.retention_of_identifiers_that_matter,
            "identifiers_only_in_demonstrations": total.identifiers_only_in_demonstrations,
            "identifiers_only_in_large_payloads": total.identifiers_only_in_large_payloads,
            "retention_by_kind": total.retention_by_kind,
            "prompt_aware": total.prompt_aware,
            "rejections": total.rejections,
            "escalations": total.escalations,
            "compression_ratio": total.compression_ratio,
            "compression_by_depth": total.compression_by_depth,
            "calls": total.spend.calls,
            "tokens_spent": total.spend.tokens,
            "cost_micros": total.spend.cost_micros,
            "errors": reports.iter().filter(|r| r.error.is_some()).count(),
        });
        if with_probes {
            summary["probes"] = serde_json::json!({
                "by_kind": total.probes.by_kind,
                "total": total.probes.total(),
                "not_in_these_files": probes_elsewhere,
                "missed_by_contextfold": missed_ids(&total.probes, |o| o.contextfold),
                "missed_by_truncation": missed_ids(&total.probes, |o| o.truncation),
            });
        }
        println!("{summary}");
    } else {
        print_table(&reports, &total, budget, &summarizer_name);
        if with_probes {
            print_probes(&reports, &total, budget, probes_elsewhere);
        }
    }
    Ok(total.overflows > 0 || reports.iter().any(|r| r.error.is_some()))
}

/// The data directory kept for each file: `dir` itself for one file, a
/// numbered directory per file under it for several. Refuses a directory
/// that already holds a log, so runs never mix.
fn keep_dirs(dir: &Path, files: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let dirs: Vec<PathBuf> = if files.len() == 1 {
        vec![dir.to_path_buf()]
    } else {
        files
            .iter()
            .enumerate()
            .map(|(n, f)| {
                let stem = f
                    .file_stem()
                    .map_or("transcript".into(), |s| s.to_string_lossy().into_owned());
                dir.join(format!("{:02}-{stem}", n + 1))
            })
            .collect()
    };
    for d in &dirs {
        if d.join("log").exists() {
            anyhow::bail!(
                "--keep {}: {} already holds an event log; give an empty or new directory",
                dir.display(),
                d.display()
            );
        }
    }
    Ok(dirs)
}

/// The event log of a kept data directory.
fn kept_log(dir: &Path) -> Result<SegmentLog> {
    let log_dir = dir.join("log");
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    SegmentLog::open(&log_dir)
        .with_context(|| format!("opening the event log in {}", log_dir.display()))
}

/// One file through a fresh pipeline (its log in memory, or in a kept
/// data directory).
async fn eval_file<S: Summarizer, L: EventLog>(
    file: &Path,
    policy: &PolicyConfig,
    budget: u64,
    probes: &[Probe],
    summarizer: S,
    log: L,
) -> Result<FileReport> {
    let conversations = import::import_file(file, Format::Auto)
        .with_context(|| format!("importing {}", file.display()))?;
    let mut engine = Engine::open(MemoryBackend::default(), policy.clone())?;
    // The policy eval folds under (its window is the budget) goes into the
    // log first: a kept data dir read later by `history`/`assemble` must
    // replay under it, not under the configuration of the day, or every
    // summary's cut point is refused as stale.
    engine.record_policy_as(
        contextfold::core::event::EMBEDDED_PARTITION_KEY.into(),
        "eval",
    );
    let mut p = Pipeline::open(log, engine, summarizer).await?;
    let mut report = FileReport {
        file: file.display().to_string(),
        format: conversations
            .first()
            .map_or("-", |c| c.format.name())
            .to_string(),
        conversations: conversations.len(),
        conversation_ids: conversations
            .iter()
            .map(|c| c.conversation.clone())
            .collect(),
        ..FileReport::default()
    };
    let request = AssemblyRequest {
        budget: Some(budget),
        prompt: None,
        prompt_aware_eviction: false,
        summaries_as_they_are: false,
    };
    report.prompt_aware.budget = PromptAwareEffect::budget(budget);
    for event in conversations.iter().flat_map(|c| &c.events) {
        // Before each user turn: would prompt-aware eviction, given that
        // turn as the prompt, keep other items than the newest?
        if let EventBody::TurnAppended(t) = &event.body {
            if let (Role::User, Some(conv)) = (
                t.message.role,
                p.engine.state.conversations.get(&event.conversation),
            ) {
                let prompt = t.message.text_content();
                // A quarter of the budget: compaction keeps the context
                // under the budget itself, so eviction happens when an
                // agent asks for less (a smaller model, room for tools).
                let plain = AssemblyRequest {
                    budget: Some(PromptAwareEffect::budget(budget)),
                    prompt: Some(prompt),
                    prompt_aware_eviction: false,
                    summaries_as_they_are: false,
                };
                let aware = AssemblyRequest {
                    prompt_aware_eviction: true,
                    summaries_as_they_are: false,
                    ..plain.clone()
                };
                let bodies = p.engine.bodies();
                let a = assembly::assemble_from(conv, &bodies, policy, &plain)?;
                if !a.left_out.is_empty() {
                    let b = assembly::assemble_from(conv, &bodies, policy, &aware)?;
                    let e = &mut report.prompt_aware;
                    e.evicting_assemblies += 1;
                    if a.sources != b.sources {
                        e.changed += 1;
                    }
                    e.items_chosen_by_relevance += b.chosen_by_relevance.len() as u64;
                }
            }
        }
        p.ingest(std::slice::from_ref(event)).await?;
        if !matches!(event.body, EventBody::TurnAppended(_)) {
            continue;
        }
        let Some(conv) = p.engine.state.conversations.get(&event.conversation) else {
            continue;
        };
        let bodies = p.engine.bodies();
        let out = assembly::assemble_from(conv, &bodies, policy, &request)?;
        report.assemblies += 1;
        report.max_assembled_tokens = report.max_assembled_tokens.max(out.tokens);
        if out.tokens > budget {
            report.overflows += 1;
        }
        // Probes asked of the context right after this turn.
        let this_turn = conv
            .turns
            .last()
            .filter(|t| t.event == event_digest(&event.id))
            .map(|t| t.seq);
        let due: Vec<&Probe> = probes
            .iter()
            .filter(|pr| pr.conversation == event.conversation && pr.at_turn.is_some())
            .filter(|pr| pr.at_turn == this_turn)
            .collect();
        if !due.is_empty() {
            let ours = probes::context_text(&out.messages);
            let plain = probes::context_text(&probes::truncation(conv, &bodies, budget)?);
            for pr in due {
                report.probes.record(pr, &ours, &plain);
            }
        }
    }
    for imported in &conversations {
        let Some(conv) = p.engine.state.conversations.get(&imported.conversation) else {
            continue;
        };
        let bodies = p.engine.bodies();
        let out = assembly::assemble_from(conv, &bodies, policy, &request)?.into_owned();
        report.final_assembled_tokens += out.tokens;
        report.turns += conv.turns.len() as u64;
        report.raw_tokens += conv.raw_tokens();
        report.context_tokens += conv.context.tokens();
        report.fallback_summaries += conv.summaries.iter().filter(|s| s.fallback).count() as u64;
        let at_end: Vec<&Probe> = probes
            .iter()
            .filter(|pr| pr.conversation == imported.conversation && pr.at_turn.is_none())
            .collect();
        if !at_end.is_empty() {
            let ours = probes::context_text(&out.messages);
            let plain = probes::context_text(&probes::truncation(conv, &bodies, budget)?);
            for pr in at_end {
                report.probes.record(pr, &ours, &plain);
            }
        }
        for pr in probes.iter().filter(|pr| {
            pr.conversation == imported.conversation
                && pr.at_turn.is_some_and(|t| t >= conv.turns.len() as u64)
        }) {
            report.probes_never_reached.push(pr.id.clone());
        }
        let retention = identifier_retention(conv, &bodies, &out)?;
        report.identifiers += retention.identifiers;
        report.identifiers_retained += retention.retained;
        report.identifiers_retained_in_text += retention.retained_in_text;
        report.identifiers_only_in_appendix += retention.retained - retention.retained_in_text;
        report.identifiers_that_matter += retention.matter;
        report.identifiers_that_matter_retained += retention.matter_retained;
        report.identifiers_only_in_demonstrations += retention.only_in_demonstrations;
        report.identifiers_only_in_large_payloads += retention.only_in_large_payloads;
        for (kind, k) in &retention.by_kind {
            report.retention_by_kind.entry(kind).or_default().add(k);
        }
        for (depth, c) in compression_by_depth(conv) {
            report
                .compression_by_depth
                .entry(depth)
                .or_default()
                .add(&c);
        }
    }
    report.identifier_retention = share(report.identifiers_retained, report.identifiers);
    report.retention_of_identifiers_that_matter = share(
        report.identifiers_that_matter_retained,
        report.identifiers_that_matter,
    );
    report.identifier_retention_in_text =
        share(report.identifiers_retained_in_text, report.identifiers);
    report.compression_ratio = overall(&report.compression_by_depth);
    report.spend = spend(&mut p.log).await?;
    Ok(report)
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        1.0
    } else {
        part as f64 / whole as f64
    }
}

fn overall(by_depth: &BTreeMap<u32, DepthCompression>) -> f64 {
    // Summaries in context never overlap, so their sums count each raw
    // turn once.
    let covered = by_depth.values().map(|c| c.covered_tokens).sum();
    let tokens = by_depth.values().map(|c| c.summary_tokens).sum();
    ratio(covered, tokens)
}

/// Raw turn tokens under the summaries in context, by depth. A summary
/// replaced its turns' context tokens (a large payload's stub, not the
/// payload), so that is what it is measured against.
pub fn compression_by_depth(conv: &Conversation) -> BTreeMap<u32, DepthCompression> {
    let mut out: BTreeMap<u32, DepthCompression> = BTreeMap::new();
    for item in &conv.context {
        let ContextItem::Summary(i) = item else {
            continue;
        };
        let s = &conv.summaries[*i as usize];
        let covered: u64 = conv
            .turns
            .get(s.first_turn as usize..=s.last_turn as usize)
            .unwrap_or_default()
            .iter()
            .filter(|t| t.in_context)
            .map(|t| u64::from(t.context_tokens))
            .sum();
        let entry = out.entry(s.depth).or_default();
        entry.add(&DepthCompression {
            summaries: 1,
            covered_tokens: covered,
            summary_tokens: s.tokens,
            ratio: 0.0,
        });
    }
    out
}

/// The source's identifiers and how many the assembled context keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    pub identifiers: u64,
    /// Found anywhere in the context.
    pub retained: u64,
    /// Found outside the "Exact identifiers" appendices.
    pub retained_in_text: u64,
    /// Identifiers that matter ([`matters`]), and how many are in the context.
    pub matter: u64,
    pub matter_retained: u64,
    /// Identifiers only demonstrations name (not counted in the others).
    pub only_in_demonstrations: u64,
    /// Identifiers only large payloads name (stubs in every context at
    /// this budget; not counted in the others).
    pub only_in_large_payloads: u64,
    /// The same, by the kind of identifier (`identifiers::IdentifierKind`).
    pub by_kind: BTreeMap<&'static str, KindRetention>,
}

/// Retention of one kind of identifier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KindRetention {
    pub identifiers: u64,
    pub retained: u64,
    pub retained_in_text: u64,
    pub matter: u64,
    pub matter_retained: u64,
}

impl KindRetention {
    fn add(&mut self, other: &KindRetention) {
        self.identifiers += other.identifiers;
        self.retained += other.retained;
        self.retained_in_text += other.retained_in_text;
        self.matter += other.matter;
        self.matter_retained += other.matter_retained;
    }
}

/// How often prompt-aware eviction would change what is kept, at an
/// assembly budget of [`PromptAwareEffect::budget`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PromptAwareEffect {
    /// The assembly budget measured at.
    pub budget: u64,
    /// Assemblies before a user turn where the older context did not all fit.
    pub evicting_assemblies: u64,
    /// Of those, the ones where prompt-aware eviction kept other items.
    pub changed: u64,
    /// Items kept for their relevance in place of newer ones.
    pub items_chosen_by_relevance: u64,
}

impl PromptAwareEffect {
    /// A quarter of eval's budget.
    pub fn budget(eval_budget: u64) -> u64 {
        (eval_budget / 4).max(1)
    }
}

/// How a conversation's turns mention one identifier.
#[derive(Debug, Default)]
pub struct Mentions {
    /// Distinct turns that mention it.
    pub turns: u32,
    /// Whether a user turn does.
    pub by_user: bool,
}

/// Whether an identifier matters to an agent resuming the work: the user
/// named it, or the work came back to it (two turns or more mention it).
/// One mention in one tool output (a directory listing, a file's imports)
/// is what a summary may drop; the turn itself stays in the log, and
/// `grep`/`expand` reach it.
pub fn matters(m: &Mentions) -> bool {
    m.by_user || m.turns >= 2
}

/// `text` without its "Exact identifiers" appendices, in either form a
/// summary carries them: the model path's `Exact identifiers:` heading
/// with `- ` items, and the deterministic summarizer's `## Exact
/// identifiers` section, one bare identifier a line until the next
/// heading, blank line or closing tag.
pub fn without_appendix(text: &str) -> String {
    enum List {
        None,
        Dashed,
        Bare,
    }
    let colon = format!("{EXACT_IDENTIFIERS_HEADING}:");
    let section = format!("## {EXACT_IDENTIFIERS_HEADING}");
    let mut out = String::with_capacity(text.len());
    let mut list = List::None;
    for line in text.split_inclusive('\n') {
        let bare = line.trim_end_matches(['\n', '\r']);
        if bare.trim() == colon {
            list = List::Dashed;
            continue;
        }
        if bare.trim() == section {
            list = List::Bare;
            continue;
        }
        match list {
            List::Dashed if bare.starts_with("- ") => continue,
            List::Bare
                if !bare.trim().is_empty() && !bare.starts_with('#') && !bare.starts_with("</") =>
            {
                continue
            }
            _ => {}
        }
        list = List::None;
        out.push_str(line);
    }
    out
}

/// The source's opaque identifiers (over every raw turn but demonstrations
/// of another task), and how many of them appear verbatim in the assembled
/// context, with and without the "Exact identifiers" appendices.
pub fn identifier_retention(
    conv: &Conversation,
    bodies: &dyn TurnBodies,
    assembled: &Assembled,
) -> Result<Retention> {
    let mut ids: Vec<identifiers::Identifier> = Vec::new();
    // Per identifier: the turns that mention it, and whether the user did.
    let mut mentions: HashMap<String, Mentions> = HashMap::new();
    // A demonstration's identifiers are another task's (a pydicom run's
    // demonstration names marshmallow's files); summaries leave them out.
    let mut in_demonstrations: HashSet<String> = HashSet::new();
    // A large payload is a stub in every context at this budget (it is
    // larger than the compaction target): what only it names was never
    // the context's to keep; `describe` gives the payload.
    let mut in_large_payloads: HashSet<String> = HashSet::new();
    for turn in &conv.turns {
        let body = bodies.turn_body(conv, turn.seq)?;
        if body.message.is_demonstration() {
            for id in identifiers::extract(&body.message.searchable_text()) {
                in_demonstrations.insert(id);
            }
            continue;
        }
        if turn.large_payload {
            for id in identifiers::extract(&body.message.searchable_text()) {
                in_large_payloads.insert(id);
            }
            continue;
        }
        let mut here = HashSet::new();
        for id in identifiers::extract_with_kinds(&body.message.searchable_text()) {
            if !here.insert(id.text.clone()) {
                continue;
            }
            let m = mentions.entry(id.text.clone()).or_insert_with(|| {
                ids.push(id.clone());
                Mentions::default()
            });
            m.turns += 1;
            m.by_user |= body.message.role == Role::User;
        }
    }
    let mut context = String::new();
    for m in &assembled.messages {
        context.push_str(&m.searchable_text());
        context.push('\n');
    }
    let text = without_appendix(&context);
    let mut by_kind: BTreeMap<&'static str, KindRetention> = BTreeMap::new();
    for id in &ids {
        let k = by_kind.entry(id.kind.as_str()).or_default();
        k.identifiers += 1;
        let kept = context.contains(id.text.as_str());
        if kept {
            k.retained += 1;
        }
        if mentions.get(&id.text).is_some_and(matters) {
            k.matter += 1;
            k.matter_retained += u64::from(kept);
        }
        if text.contains(id.text.as_str()) {
            k.retained_in_text += 1;
        }
    }
    let mut all = KindRetention::default();
    for k in by_kind.values() {
        all.add(k);
    }
    let only_in_demonstrations = in_demonstrations
        .iter()
        .filter(|id| !mentions.contains_key(id.as_str()))
        .count() as u64;
    let only_in_large_payloads = in_large_payloads
        .iter()
        .filter(|id| !mentions.contains_key(id.as_str()) && !in_demonstrations.contains(*id))
        .count() as u64;
    Ok(Retention {
        only_in_demonstrations,
        only_in_large_payloads,
        identifiers: all.identifiers,
        retained: all.retained,
        retained_in_text: all.retained_in_text,
        matter: all.matter,
        matter_retained: all.matter_retained,
        by_kind,
    })
}

async fn spend<L: EventLog>(log: &mut L) -> Result<SweepSpend> {
    let mut out = SweepSpend::default();
    let mut after = 0;
    loop {
        let records = log.read_after(after, 4096).await?;
        if records.is_empty() {
            return Ok(out);
        }
        for r in &records {
            after = r.position;
            let Ok(env) = contextfold::core::event::Envelope::decode(&r.bytes, r.encoding) else {
                continue;
            };
            if let EventBody::SweepEnded(s) = &env.body {
                out.sweeps += 1;
                out.calls += s.calls as u64;
                out.tokens += s.tokens_spent;
                out.cost_micros += s.cost_micros;
                *out.stops.entry(s.stop.as_str().to_string()).or_default() += 1;
            }
        }
    }
}

fn totals(reports: &[FileReport]) -> FileReport {
    let mut t = FileReport {
        file: "total".into(),
        ..FileReport::default()
    };
    for r in reports {
        t.conversations += r.conversations;
        t.turns += r.turns;
        t.raw_tokens += r.raw_tokens;
        t.context_tokens += r.context_tokens;
        t.max_assembled_tokens = t.max_assembled_tokens.max(r.max_assembled_tokens);
        t.final_assembled_tokens += r.final_assembled_tokens;
        t.overflows += r.overflows;
        t.assemblies += r.assemblies;
        t.identifiers += r.identifiers;
        t.identifiers_retained += r.identifiers_retained;
        t.fallback_summaries += r.fallback_summaries;
        t.identifiers_retained_in_text += r.identifiers_retained_in_text;
        t.identifiers_only_in_appendix += r.identifiers_only_in_appendix;
        t.identifiers_that_matter += r.identifiers_that_matter;
        t.prompt_aware.budget = r.prompt_aware.budget;
        t.prompt_aware.evicting_assemblies += r.prompt_aware.evicting_assemblies;
        t.prompt_aware.changed += r.prompt_aware.changed;
        t.prompt_aware.items_chosen_by_relevance += r.prompt_aware.items_chosen_by_relevance;
        t.identifiers_that_matter_retained += r.identifiers_that_matter_retained;
        t.identifiers_only_in_demonstrations += r.identifiers_only_in_demonstrations;
        t.identifiers_only_in_large_payloads += r.identifiers_only_in_large_payloads;
        for (kind, k) in &r.retention_by_kind {
            t.retention_by_kind.entry(kind).or_default().add(k);
        }
        for (k, n) in &r.rejections {
            *t.rejections.entry(k.clone()).or_default() += n;
        }
        for (k, n) in &r.escalations {
            *t.escalations.entry(k.clone()).or_default() += n;
        }
        for (d, c) in &r.compression_by_depth {
            t.compression_by_depth.entry(*d).or_default().add(c);
        }
        t.spend.sweeps += r.spend.sweeps;
        t.spend.calls += r.spend.calls;
        t.spend.tokens += r.spend.tokens;
        t.spend.cost_micros += r.spend.cost_micros;
        for (k, n) in &r.spend.stops {
            *t.spend.stops.entry(k.clone()).or_default() += n;
        }
        t.seconds += r.seconds;
        t.probes.merge(&r.probes);
        t.probes_never_reached
            .extend(r.probes_never_reached.iter().cloned());
    }
    t.identifier_retention = share(t.identifiers_retained, t.identifiers);
    t.retention_of_identifiers_that_matter = share(
        t.identifiers_that_matter_retained,
        t.identifiers_that_matter,
    );
    t.identifier_retention_in_text = share(t.identifiers_retained_in_text, t.identifiers);
    t.compression_ratio = overall(&t.compression_by_depth);
    t
}

fn print_table(reports: &[FileReport], total: &FileReport, budget: u64, summarizer: &str) {
    println!("contextfold eval: budget {budget} tokens, summarizer {summarizer}");
    println!(
        "{:<44} {:>5} {:>6} {:>10} {:>8} {:>9} {:>5} {:>10} {:>8} {:>7} {:>7} {:>7} {:>6} {:>9}",
        "file",
        "convs",
        "turns",
        "raw tok",
        "ctx tok",
        "max asm",
        "ovf",
        "ids kept",
        "matter",
        "d0",
        "d1",
        "d2+",
        "calls",
        "tokens"
    );
    for r in reports.iter().chain(std::iter::once(total)) {
        if let Some(e) = &r.error {
            println!("{:<44} error: {e}", short(&r.file));
            continue;
        }
        let depth = |d: u32| {
            r.compression_by_depth
                .get(&d)
                .map_or("-".to_string(), |c| format!("{:.1}x", c.ratio))
        };
        let mut deep = DepthCompression::default();
        for (_, c) in r.compression_by_depth.range(2..) {
            deep.add(c);
        }
        let deep = if deep.summaries == 0 {
            "-".to_string()
        } else {
            format!("{:.1}x", deep.ratio)
        };
        println!(
            "{:<44} {:>5} {:>6} {:>10} {:>8} {:>9} {:>5} {:>9.1}% {:>7.1}% {:>7} {:>7} {:>7} {:>6} {:>9}",
            short(&r.file),
            r.conversations,
            r.turns,
            r.raw_tokens,
            r.context_tokens,
            r.max_assembled_tokens,
            r.overflows,
            100.0 * r.identifier_retention,
            100.0 * r.retention_of_identifiers_that_matter,
            depth(0),
            depth(1),
            deep,
            r.spend.calls,
            r.spend.tokens
        );
    }
    println!(
        "overall: {} overflows in {} assemblies; identifier retention {:.1}% ({}/{}); compression {:.1}x; {} fallback summaries; {} sweeps {:?}",
        total.overflows,
        total.assemblies,
        100.0 * total.identifier_retention,
        total.identifiers_retained,
        total.identifiers,
        total.compression_ratio,
        total.fallback_summaries,
        total.spend.sweeps,
        total.spend.stops
    );
    println!(
        "identifiers: {:.1}% in the summary text and turns ({}/{}), {} only in \"{}\" appendices",
        100.0 * total.identifier_retention_in_text,
        total.identifiers_retained_in_text,
        total.identifiers,
        total.identifiers_only_in_appendix,
        EXACT_IDENTIFIERS_HEADING
    );
    println!(
        "identifiers that matter (named by the user or by two turns or more): {:.1}% ({}/{})",
        100.0 * total.retention_of_identifiers_that_matter,
        total.identifiers_that_matter_retained,
        total.identifiers_that_matter
    );
    if total.identifiers_only_in_demonstrations > 0 {
        println!(
            "not counted: {} identifiers only a demonstration of another task names",
            total.identifiers_only_in_demonstrations
        );
    }
    if total.identifiers_only_in_large_payloads > 0 {
        println!(
            "not counted: {} identifiers only large payloads name (a stub in every context at this budget; `describe` gives them)",
            total.identifiers_only_in_large_payloads
        );
    }
    println!("retention by kind (in the context / in the text apart from appendices / of those that matter):");
    for (kind, k) in &total.retention_by_kind {
        println!(
            "  {kind:<11} {:>6.1}% / {:>5.1}%  of {:<5}  {:>6.1}% of {}",
            100.0 * share(k.retained, k.identifiers),
            100.0 * share(k.retained_in_text, k.identifiers),
            k.identifiers,
            100.0 * share(k.matter_retained, k.matter),
            k.matter
        );
    }
    println!(
        "prompt-aware eviction (before each user turn, that turn as the prompt, budget {}): {} of {} evicting assemblies keep other items, {} items chosen by relevance",
        PromptAwareEffect::budget(budget),
        total.prompt_aware.changed,
        total.prompt_aware.evicting_assemblies,
        total.prompt_aware.items_chosen_by_relevance
    );
    println!(
        "validation: rejections {}; escalations {}",
        by_reason(&total.rejections),
        by_reason(&total.escalations)
    );
}

/// The probes table: per file and kind, probes passed by the assembled
/// context / by plain truncation at the same budget, of those asked.
fn print_probes(reports: &[FileReport], total: &FileReport, budget: u64, elsewhere: usize) {
    println!(
        "continuity probes at budget {budget}: passed by contextfold / by plain truncation (the newest raw turns that fit), of the probes asked"
    );
    print!("{:<44}", "file");
    for kind in ProbeKind::ALL {
        print!(" {:>10}", kind.as_str());
    }
    println!(" {:>12}", "all");
    let cell = |t: probes::KindTally| {
        if t.probes == 0 {
            "-".to_string()
        } else {
            format!("{}/{} of {}", t.contextfold, t.truncation, t.probes)
        }
    };
    for r in reports.iter().chain(std::iter::once(total)) {
        if r.probes.outcomes.is_empty() {
            continue;
        }
        print!("{:<44}", short(&r.file));
        for kind in ProbeKind::ALL {
            let t = r.probes.by_kind.get(&kind).copied().unwrap_or_default();
            print!(" {:>10}", cell(t));
        }
        let all = r.probes.total();
        println!(
            " {:>12}  {:.1}% / {:.1}%",
            cell(all),
            100.0 * share(all.contextfold, all.probes),
            100.0 * share(all.truncation, all.probes)
        );
    }
    let missed = |passed: fn(&probes::ProbeOutcome) -> bool| -> String {
        let ids = missed_ids(&total.probes, passed);
        if ids.is_empty() {
            "none".into()
        } else {
            ids.join(", ")
        }
    };
    println!("missed by contextfold: {}", missed(|o| o.contextfold));
    println!("missed by truncation: {}", missed(|o| o.truncation));
    if !total.probes_never_reached.is_empty() {
        println!(
            "never checked (their at_turn is past the conversation's end): {}",
            total.probes_never_reached.join(", ")
        );
    }
    if elsewhere > 0 {
        println!("{elsewhere} probes name conversations not in these files");
    }
}

/// The ids of the probes `passed` says a context missed, in the order
/// they were checked.
fn missed_ids(report: &ProbeReport, passed: fn(&probes::ProbeOutcome) -> bool) -> Vec<&str> {
    report
        .outcomes
        .iter()
        .filter(|o| !passed(o))
        .map(|o| o.id.as_str())
        .collect()
}

/// `kind n, kind n` or `none`.
fn by_reason(counts: &BTreeMap<String, u64>) -> String {
    if counts.is_empty() {
        return "none".into();
    }
    counts
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The last two path components: enough to tell the transcripts apart.
fn short(path: &str) -> String {
    let mut parts: Vec<&str> = path.rsplit('/').take(2).collect();
    parts.reverse();
    let s = parts.join("/");
    if s.chars().count() > 44 {
        let tail: String = s
            .chars()
            .rev()
            .take(43)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        format!("…{tail}")
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Retention is counted per kind of identifier, from what the context
    /// still holds.
    #[test]
    fn retention_is_reported_by_kind() {
        use contextfold::core::assembly::{assemble, AssemblyRequest};
        use contextfold::core::event::{Envelope, EventBody, TurnAppended};
        use contextfold::core::fold::fold;
        use contextfold::core::message::{ChatMessage, Role};
        use contextfold::core::policy::PolicyConfig;
        use contextfold::core::state::{Resident, State};
        let policy = PolicyConfig::default();
        let mut state = State::default();
        for (i, text) in [
            "read /src/a.rs for 123e4567-e89b-12d3-a456-426614174000",
            "then https://example.com/x.html and /src/b.rs",
        ]
        .into_iter()
        .enumerate()
        {
            let turn = TurnAppended::from(ChatMessage::text(Role::User, text.to_string()));
            let e = Envelope::new(
                format!("t{i}"),
                "c",
                1 + i as u64,
                EventBody::TurnAppended(turn),
            );
            fold(&mut state, &policy, &e);
        }
        let conv = &state.conversations["c"];
        let mut out = assemble(conv, &policy, &AssemblyRequest::default()).unwrap();
        // The context lost the first turn.
        out.messages.remove(0);
        let r = identifier_retention(conv, &Resident, &out).unwrap();
        let kind = |k: &str| r.by_kind.get(k).copied().unwrap_or_default();
        assert_eq!(
            (kind("path").identifiers, kind("path").retained),
            (2, 1),
            "{r:?}"
        );
        assert_eq!(
            (kind("uuid").identifiers, kind("uuid").retained),
            (1, 0),
            "{r:?}"
        );
        assert_eq!(
            (kind("url").identifiers, kind("url").retained),
            (1, 1),
            "{r:?}"
        );
        let sum: u64 = r.by_kind.values().map(|k| k.identifiers).sum();
        assert_eq!(sum, r.identifiers);
    }

    #[test]
    fn the_appendix_is_left_out_of_the_summary_text() {
        // A refusal with the appended list scored 100% before (issue 14).
        let text = "I'm sorry, but I can't assist with that.\n\nExact identifiers:\n- \
                    1.2.840.10008.1.2.1\n- /testbed/pydicom/uid.py\nturn 3: edited uid.py";
        let body = without_appendix(text);
        assert!(!body.contains("1.2.840.10008.1.2.1"), "{body}");
        assert!(!body.contains("/testbed/pydicom/uid.py"), "{body}");
        assert!(body.contains("I'm sorry") && body.contains("turn 3: edited uid.py"));
        // Lists elsewhere stay.
        assert_eq!(without_appendix("Done:\n- a\n- b"), "Done:\n- a\n- b");
        // The deterministic summarizer's section: bare lines up to the
        // end of the summary.
        let det = "<context_summary id=\"s\">\n## Done\n- turn 2: edited src/a.rs\n\
                   ## Exact identifiers\nsrc/b.rs\n1f59687\n</context_summary>\nnext turn names c.rs";
        let body = without_appendix(det);
        assert!(
            !body.contains("src/b.rs") && !body.contains("1f59687"),
            "{body}"
        );
        assert!(body.contains("edited src/a.rs") && body.contains("</context_summary>"));
        assert!(body.contains("next turn names c.rs"), "{body}");
    }
}
