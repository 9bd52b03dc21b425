//! Real transcripts from `../shared/data/transcripts/` as inbound events, for
//! the fold and assembly benchmarks: the tau-bench airline runs (200
//! conversations), the pi session before compaction and the long Claude Code
//! session, imported with `contextfold::import` and read in place.

#![allow(dead_code)]

use contextfold::core::event::{Envelope, EventBody, TurnAppended};
use contextfold::import::{import_file, Format};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Overrides the shared data directory (a checkout not beside it).
pub const SHARED_DATA_ENV: &str = "CONTEXTFOLD_SHARED_DATA";

/// The shared data beside the crate; from a git worktree one level deeper
/// (`wt/<branch>`), beside its parent.
const DATA_DIRS: [&str; 2] = [
    concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data"),
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data"),
];

pub const FILES: [&str; 3] = [
    "transcripts/tau-bench_sierra-research/gpt-4o-airline.json",
    "transcripts/pi-openclaw_badlogic-pi-mono/before-compaction.jsonl",
    "transcripts/claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl",
];

fn shared_path(relative: &str) -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os(SHARED_DATA_ENV) {
        let p = Path::new(&dir).join(relative);
        return p.exists().then_some(p);
    }
    DATA_DIRS
        .iter()
        .map(|d| Path::new(d).join(relative))
        .find(|p| p.exists())
}

/// Every inbound event of the benchmark transcripts, conversation after
/// conversation, ids unique. `None` (with a message) when the data is absent.
pub fn events() -> Option<Vec<Envelope>> {
    events_of(&FILES)
}

/// The inbound events of some of [`FILES`], ids unique.
pub fn events_of(files: &[&str]) -> Option<Vec<Envelope>> {
    let mut out = Vec::new();
    for &rel in files {
        let Some(path) = shared_path(rel) else {
            eprintln!(
                "skipping {rel}: absent from {DATA_DIRS:?} (set {SHARED_DATA_ENV} to the shared data directory)"
            );
            continue;
        };
        match import_file(&path, Format::Auto) {
            Ok(conversations) => out.extend(conversations.into_iter().flat_map(|c| c.events)),
            Err(e) => eprintln!("skipping {rel}: {e}"),
        }
    }
    if out.is_empty() {
        return None;
    }
    let mut seen = HashSet::new();
    for (n, e) in out.iter_mut().enumerate() {
        if !seen.insert(e.id.clone()) {
            e.id = format!("{}~{n}", e.id);
            seen.insert(e.id.clone());
        }
    }
    Some(out)
}

/// `count` turns of one long conversation `key`, made of the benchmark
/// transcripts' turns repeated: ids, tool-call ids and times rewritten so
/// every repetition is new (one second apart, so neither the duplicate nor
/// the flood guard fires on a repetition).
pub fn long_conversation(key: &str, count: usize) -> Option<Vec<Envelope>> {
    let turns: Vec<TurnAppended> = events()?
        .into_iter()
        .filter_map(|e| match e.body {
            EventBody::TurnAppended(t) => Some(t),
            _ => None,
        })
        .collect();
    let mut out = Vec::with_capacity(count);
    let mut time = 1_700_000_000_000u64;
    for (n, t) in turns.iter().cycle().take(count).enumerate() {
        let round = n / turns.len();
        let mut t = t.clone();
        for call in &mut t.message.tool_calls {
            call.id = format!("{}~{round}", call.id);
        }
        if let Some(id) = &mut t.message.tool_call_id {
            *id = format!("{id}~{round}");
        }
        time += 1000;
        out.push(Envelope::new(
            format!("{key}-t{n}"),
            key,
            time,
            EventBody::TurnAppended(t),
        ));
    }
    Some(out)
}
