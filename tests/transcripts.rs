//! Every transcript in `../shared/data/transcripts/`, run through the
//! embedded pipeline (memory log, memory store, deterministic summarizer)
//! with a 32000-token budget, one event at a time.
//!
//! After every turn it checks what an agent would be sent:
//! - the assembled context fits the budget, counted again from the messages
//!   actually sent (summaries with their wrapper, stubs, the rolling state),
//!   unless `over_budget` is reported, and then only the fresh tail is sent;
//! - tool pairing holds (`assembly::check_tool_pairing`);
//! - every summary covers exactly what it says, and the context items
//!   partition the current epoch's in-context turns: each exactly once, in
//!   order, none both raw and summarized, none lost;
//! - compaction kept up: a context over its threshold has no raw run
//!   outside the fresh tail big enough to summarize.
//!
//! At the end of each conversation: every raw turn is still retrievable
//! byte for byte (its message re-encoded as JSON equals the imported one),
//! every imported turn is either a turn of the state or a rejection with a
//! reason; and per file, a replay of the log gives the same state hash.
//!
//! Every turn of every conversation is checked, the multi-conversation
//! corpora (aider: 704 sessions, tau-bench: 200) included.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use contextfold::core::assembly::{self, Assembled, AssemblyRequest, Source};
use contextfold::core::event::{Covers, Envelope, EventBody, SummaryKind};
use contextfold::core::policy::{self, PolicyConfig};
use contextfold::core::state::{ContextItem, Conversation};
use contextfold::core::tokens;
use contextfold::import::{import_file, Format};
use contextfold::log::EventLog;
use contextfold::runtime::engine::Engine;
use contextfold::store::memory_backend::MemoryBackend;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

const BUDGET: u64 = 32_000;

/// The shared data beside the crate; from a git worktree one level deeper
/// (`wt/<branch>`), beside its parent.
const DATA_DIRS: [&str; 2] = [
    concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data/transcripts"),
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/transcripts"),
];

fn policy() -> PolicyConfig {
    PolicyConfig {
        default_context_window: BUDGET,
        max_assembly_token_budget: Some(BUDGET),
        ..PolicyConfig::default()
    }
}

/// Every transcript file (licence copies left out), sorted.
fn transcript_files() -> Option<Vec<PathBuf>> {
    let dir = DATA_DIRS.iter().map(Path::new).find(|d| d.is_dir())?;
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).expect("transcript directory is readable") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if !path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("LICENSE"))
            {
                files.push(path);
            }
        }
    }
    files.sort();
    Some(files)
}

/// What one file's run saw, for the closing line.
#[derive(Default)]
struct Tally {
    conversations: usize,
    turns: usize,
    checks: usize,
    rejected: usize,
    summaries: usize,
    condensed: usize,
    over_budget: usize,
}

/// Token counts of rendered messages, cached: every turn is re-counted once
/// from what is sent, every summary once with its wrapper.
#[derive(Default)]
struct Recount {
    turns: HashMap<u64, u64>,
    summaries: HashMap<String, u64>,
}

impl Recount {
    /// Tokens of the messages actually sent, counted from the messages.
    fn sent_tokens(&mut self, conv: &Conversation, out: &Assembled) -> u64 {
        let enc = conv.encoding;
        out.messages
            .iter()
            .zip(&out.sources)
            .map(|(m, source)| match source {
                Source::Turn { seq } => *self
                    .turns
                    .entry(*seq)
                    .or_insert_with(|| tokens::count_message(enc, m)),
                Source::Summary { id, .. } => *self
                    .summaries
                    .entry(id.clone())
                    .or_insert_with(|| tokens::count_message(enc, m)),
                // A masked turn, a stub or the rolling state: what is sent
                // depends on the assembly, so it is counted every time.
                Source::MaskedTurn { .. }
                | Source::RollingState
                | Source::MissingToolResult { .. } => tokens::count_message(enc, m),
            })
            .sum()
    }
}

/// Raw turns of the current epoch a context item stands for, oldest first.
fn expand(conv: &Conversation, item: ContextItem, out: &mut Vec<u64>) -> Result<(), String> {
    match item {
        ContextItem::Turn(seq) => out.push(seq),
        ContextItem::Summary(i) => {
            let s = conv
                .summaries
                .get(i as usize)
                .ok_or_else(|| format!("context names summary #{i}, which does not exist"))?;
            out.extend(
                (s.first_turn..=s.last_turn)
                    .filter(|&seq| conv.turns[seq as usize].in_context)
                    .filter(|&seq| conv.turns[seq as usize].epoch == conv.epoch),
            );
        }
    }
    Ok(())
}

/// Every summary covers exactly what it says; the context partitions the
/// current epoch's in-context turns.
fn check_structure(conv: &Conversation) -> Result<(), String> {
    let index: HashMap<&str, usize> = conv
        .summaries
        .iter()
        .enumerate()
        .map(|(i, s)| (s.id.as_str(), i))
        .collect();
    let raw_in_context: HashSet<u64> = conv
        .context
        .iter()
        .filter_map(|i| match i {
            ContextItem::Turn(seq) => Some(*seq),
            ContextItem::Summary(_) => None,
        })
        .collect();
    for s in &conv.summaries {
        if s.first_turn > s.last_turn || s.last_turn as usize >= conv.turns.len() {
            return Err(format!(
                "{}: span {}..={} is not a span of known turns",
                s.id, s.first_turn, s.last_turn
            ));
        }
        match (&s.kind, &s.covers) {
            (SummaryKind::Leaf, Covers::Turns { first, last }) => {
                if s.depth != 0 || (*first, *last) != (s.first_turn, s.last_turn) {
                    return Err(format!(
                        "leaf {} says it covers {first}..={last} at depth {}, records {}..={}",
                        s.id, s.depth, s.first_turn, s.last_turn
                    ));
                }
                if let Some(seq) = (*first..=*last).find(|seq| raw_in_context.contains(seq)) {
                    return Err(format!(
                        "turn {seq} is both raw in context and summarized by {}",
                        s.id
                    ));
                }
            }
            (SummaryKind::Condensed, Covers::Summaries { ids }) => {
                if ids.len() < 2 {
                    return Err(format!("condensed {} covers {} summaries", s.id, ids.len()));
                }
                let mut children = Vec::new();
                for id in ids {
                    let child = index
                        .get(id.as_str())
                        .map(|&i| &conv.summaries[i])
                        .ok_or_else(|| format!("{} covers unknown summary {id}", s.id))?;
                    if child.depth + 1 != s.depth {
                        return Err(format!(
                            "{} at depth {} covers {id} at depth {}",
                            s.id, s.depth, child.depth
                        ));
                    }
                    children.push(child);
                }
                if children[0].first_turn != s.first_turn
                    || children[children.len() - 1].last_turn != s.last_turn
                {
                    return Err(format!(
                        "{} spans {}..={} but its children {}..={}",
                        s.id,
                        s.first_turn,
                        s.last_turn,
                        children[0].first_turn,
                        children[children.len() - 1].last_turn
                    ));
                }
                for pair in children.windows(2) {
                    let (a, b) = (pair[0], pair[1]);
                    // Only turns that never entered context (duplicates,
                    // late tool results) may lie between two children.
                    let gap_ok = a.last_turn < b.first_turn
                        && (a.last_turn + 1..b.first_turn)
                            .all(|seq| !conv.turns[seq as usize].in_context);
                    if !gap_ok {
                        return Err(format!(
                            "children of {} are not contiguous: {} ends at {}, {} starts at {}",
                            s.id, a.id, a.last_turn, b.id, b.first_turn
                        ));
                    }
                }
            }
            _ => {
                return Err(format!(
                    "{}: kind {:?} with covers {:?}",
                    s.id, s.kind, s.covers
                ))
            }
        }
    }
    let mut covered = Vec::new();
    for &item in &conv.context {
        expand(conv, item, &mut covered)?;
    }
    let expected: Vec<u64> = conv
        .turns
        .iter()
        .filter(|t| t.in_context && t.epoch == conv.epoch)
        .map(|t| t.seq)
        .collect();
    if covered != expected {
        let seen: HashSet<u64> = covered.iter().copied().collect();
        let lost: Vec<u64> = expected
            .iter()
            .filter(|s| !seen.contains(s))
            .copied()
            .collect();
        let mut once = HashSet::new();
        let twice: Vec<u64> = covered
            .iter()
            .filter(|s| !once.insert(**s))
            .copied()
            .collect();
        return Err(format!(
            "context does not partition the in-context turns: lost {lost:?}, twice {twice:?}, \
             {} covered vs {} expected",
            covered.len(),
            expected.len()
        ));
    }
    Ok(())
}

/// Compaction keeps up: once the pipeline has settled, a context over its
/// threshold has no raw run outside the fresh tail big enough to summarize.
fn check_compaction_kept_up(conv: &Conversation, policy: &PolicyConfig) -> Result<(), String> {
    let levels = policy::levels(conv, policy);
    if conv.context.tokens() <= levels.threshold_tokens {
        return Ok(());
    }
    let tail = policy::fresh_tail_start(conv, policy);
    let raw: u64 = conv.context[..tail]
        .iter()
        .filter(|i| matches!(i, ContextItem::Turn(_)))
        .map(|&i| conv.item_tokens(i))
        .sum();
    if raw >= policy::MIN_LEAF_CHUNK_TOKENS {
        return Err(format!(
            "settled at {} tokens (threshold {}) with {raw} raw tokens outside the fresh tail \
             left uncompacted",
            conv.context.tokens(),
            levels.threshold_tokens
        ));
    }
    Ok(())
}

/// What an agent would be sent now fits, pairs its tool calls, and is the
/// fresh tail alone when even that does not fit.
fn check_assembly(
    conv: &Conversation,
    policy: &PolicyConfig,
    recount: &mut Recount,
) -> Result<bool, String> {
    let out = assembly::assemble(conv, policy, &AssemblyRequest::default()).unwrap();
    if out.budget != BUDGET {
        return Err(format!("budget {} instead of {BUDGET}", out.budget));
    }
    assembly::check_tool_pairing(&out.messages)?;
    if out.messages.len() != out.sources.len() {
        return Err("messages and sources differ in length".into());
    }
    let sent = recount.sent_tokens(conv, &out);
    if !out.over_budget {
        if out.tokens > out.budget || sent > out.budget {
            return Err(format!(
                "context of {} tokens ({sent} counted from the messages sent) exceeds the budget {} \
                 and over_budget is not reported",
                out.tokens, out.budget
            ));
        }
        return Ok(false);
    }
    // Over budget: only the fresh tail (and stubs for its missing results).
    let tail = policy::fresh_tail_start(conv, policy);
    let fresh: HashSet<u64> = conv.context[tail..]
        .iter()
        .filter_map(|i| match i {
            ContextItem::Turn(seq) => Some(*seq),
            ContextItem::Summary(_) => None,
        })
        .collect();
    for source in &out.sources {
        match source {
            Source::Turn { seq } if fresh.contains(seq) => {}
            Source::MissingToolResult { .. } => {}
            other => {
                return Err(format!(
                    "over budget, yet {other:?} is sent besides the fresh tail"
                ))
            }
        }
    }
    if out.tokens != out.fresh_tail_tokens || out.fresh_tail_tokens <= out.budget {
        return Err(format!(
            "over_budget reported with {} tokens sent, a fresh tail of {} and a budget of {}",
            out.tokens, out.fresh_tail_tokens, out.budget
        ));
    }
    Ok(true)
}

/// Every imported turn is a turn of the state, byte for byte, or was
/// rejected with a reason; no turn of the state came from elsewhere.
fn check_turns_retrievable(
    conv: &Conversation,
    events: &[Envelope],
    tally: &mut Tally,
) -> Result<(), String> {
    let by_id: HashMap<&str, usize> = conv
        .turns
        .iter()
        .enumerate()
        .filter_map(|(i, t)| Some((&*conv.bodies.get(t.seq)?.event_id, i)))
        .collect();
    let rejected: HashMap<&str, &str> = conv
        .history
        .resident()
        .iter()
        .filter(|h| h.event_type == "event_rejected")
        .map(|h| (h.event_id.as_str(), h.detail.as_str()))
        .collect();
    let mut found = 0;
    for e in events {
        let EventBody::TurnAppended(t) = &e.body else {
            continue;
        };
        match by_id.get(e.id.as_str()) {
            Some(&i) => {
                found += 1;
                let stored = conv.bodies.get(i as u64).ok_or("body not resident")?;
                let want = serde_json::to_vec(&t.message).map_err(|e| e.to_string())?;
                let got = serde_json::to_vec(&stored.message).map_err(|e| e.to_string())?;
                if want != got {
                    return Err(format!(
                        "turn {i} (event {}) differs from the imported message:\n  imported {}\n  stored   {}",
                        e.id,
                        String::from_utf8_lossy(&want),
                        String::from_utf8_lossy(&got)
                    ));
                }
                if stored.turn != *t || &*stored.event_id != e.id.as_str() {
                    return Err(format!("turn {i} (event {}): metadata differs", e.id));
                }
            }
            None => match rejected.get(e.id.as_str()) {
                Some(reason) if !reason.is_empty() => tally.rejected += 1,
                _ => {
                    return Err(format!(
                        "imported turn {} is neither in the state nor rejected with a reason",
                        e.id
                    ))
                }
            },
        }
    }
    if found != conv.turns.len() {
        return Err(format!(
            "{} turns in the state, {found} of them imported",
            conv.turns.len()
        ));
    }
    Ok(())
}

fn run_file(path: &Path, rt: &tokio::runtime::Runtime) -> Result<Tally, String> {
    let conversations = import_file(path, Format::Auto).map_err(|e| e.to_string())?;
    let policy = policy();
    let mut tally = Tally::default();
    rt.block_on(async {
        let mut pipeline = contextfold::testing::memory_pipeline(policy.clone())
            .await
            .map_err(|e| e.to_string())?;
        for imported in &conversations {
            let key = &imported.conversation;
            let mut recount = Recount::default();
            tally.conversations += 1;
            for event in &imported.events {
                pipeline
                    .ingest(std::slice::from_ref(event))
                    .await
                    .map_err(|e| e.to_string())?;
                if !matches!(event.body, EventBody::TurnAppended(_)) {
                    continue;
                }
                let conv = &pipeline
                    .engine
                    .materialized_conversation(key)
                    .map_err(|e| e.to_string())?
                    .ok_or("the conversation was folded")?;
                let at = format!(
                    "{key}, after event {} ({} turns)",
                    event.id,
                    conv.turns.len()
                );
                check_structure(conv).map_err(|e| format!("{at}: {e}"))?;
                check_compaction_kept_up(conv, &policy).map_err(|e| format!("{at}: {e}"))?;
                if check_assembly(conv, &policy, &mut recount).map_err(|e| format!("{at}: {e}"))? {
                    tally.over_budget += 1;
                }
                tally.checks += 1;
            }
            let conv = &pipeline
                .engine
                .materialized_conversation(key)
                .map_err(|e| e.to_string())?
                .ok_or("the conversation was folded")?;
            check_turns_retrievable(conv, &imported.events, &mut tally)
                .map_err(|e| format!("{key}: {e}"))?;
            tally.turns += conv.turns.len();
            tally.summaries += conv.summaries.len();
            tally.condensed += conv
                .summaries
                .iter()
                .filter(|s| s.kind == SummaryKind::Condensed)
                .count();
        }
        // The log is the truth: replaying it gives the very same state.
        let mut replay =
            Engine::open(MemoryBackend::default(), policy.clone()).map_err(|e| e.to_string())?;
        for record in pipeline
            .log
            .read_after(0, usize::MAX)
            .await
            .map_err(|e| e.to_string())?
        {
            replay.apply(&record).unwrap();
        }
        if replay.state_hash().map_err(|e| e.to_string())?
            != pipeline.engine.state_hash().map_err(|e| e.to_string())?
        {
            return Err("replaying the log gives another state hash".to_string());
        }
        Ok(tally)
    })
}

#[test]
fn every_transcript_compacts_within_budget_and_loses_nothing() {
    let Some(files) = transcript_files() else {
        eprintln!(
            "skipping: no transcript directory at {DATA_DIRS:?} (shared test data not mounted)"
        );
        return;
    };
    assert!(!files.is_empty(), "no transcript files in {DATA_DIRS:?}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("tokio runtime");
    let mut failures = Vec::new();
    for path in &files {
        let started = Instant::now();
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        match run_file(path, &rt) {
            Ok(t) => eprintln!(
                "{name}: {} conversations, {} turns, {} checks ({} over budget: fresh tail alone), \
                 {} rejected, {} summaries ({} condensed) in {:.1?}",
                t.conversations,
                t.turns,
                t.checks,
                t.over_budget,
                t.rejected,
                t.summaries,
                t.condensed,
                started.elapsed()
            ),
            Err(e) => {
                eprintln!("{name}: FAILED: {e}");
                failures.push(format!("{name}: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
