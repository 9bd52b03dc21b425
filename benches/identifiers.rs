//! Identifier extraction throughput (`core::identifiers`, what the
//! measurer reads ahead and every draft, validator and eval reads): the
//! rules searching only the words that hold their bytes (`extract`, what
//! the code uses) against every rule searching each whole text
//! (`unskipped`, the reference the skipping is proptested against), over
//! real agent text message by message: the tau-bench airline transcripts,
//! aider's chat history and a long Claude Code session from
//! `../shared/data` (set `CONTEXTFOLD_SHARED_DATA` to point elsewhere).
//!
//! Before timing, it checks that both find the same identifiers in every
//! message of every corpus and prints the verdict.
//!
//! Run: `cargo bench --bench identifiers`. One iteration reads a whole
//! corpus; the throughput column is text bytes per second.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/corpus/mod.rs"]
mod corpus;

use contextfold::core::identifiers::{
    extract_with_kinds, extract_with_kinds_unskipped, forget_words, Identifier,
};
use corpus::Corpus;
use divan::counter::BytesCount;
use divan::Bencher;
use std::sync::OnceLock;

static CORPORA: OnceLock<Vec<Corpus>> = OnceLock::new();

fn corpora() -> &'static [Corpus] {
    CORPORA.get_or_init(|| {
        corpus::available(&[
            (corpus::TAU_BENCH, corpus::tau_bench as corpus::Loader),
            (corpus::AIDER, corpus::aider),
            (corpus::CLAUDE_CODE, corpus::claude_code),
        ])
    })
}

fn names() -> Vec<&'static str> {
    corpora().iter().map(|c| c.name).collect()
}

type Extract = fn(&str) -> Vec<Identifier>;

fn run(bencher: Bencher, name: &str, extract: Extract) {
    let corpus = corpora().iter().find(|c| c.name == name).unwrap();
    // Each sample starts with no word remembered, as a session's first
    // read does: the corpus's own repeats are all the memo gets.
    bencher
        .counter(BytesCount::new(corpus.bytes()))
        .with_inputs(forget_words)
        .bench_values(|()| {
            corpus
                .messages
                .iter()
                .flat_map(|m| &m.pieces)
                .map(|piece| extract(divan::black_box(piece)).len())
                .sum::<usize>()
        });
}

#[divan::bench(args = names(), sample_count = 10, sample_size = 1)]
fn extract(bencher: Bencher, name: &str) {
    run(bencher, name, extract_with_kinds);
}

#[divan::bench(args = names(), sample_count = 10, sample_size = 1)]
fn unskipped(bencher: Bencher, name: &str) {
    run(bencher, name, extract_with_kinds_unskipped);
}

/// Both find the same identifiers, piece by piece, in every corpus.
fn check_identical() {
    for corpus in corpora() {
        let mut found = 0;
        let mut differing = Vec::new();
        for message in &corpus.messages {
            for piece in &message.pieces {
                let ids = extract_with_kinds(piece);
                found += ids.len();
                if ids != extract_with_kinds_unskipped(piece) {
                    differing.push(message.label.as_str());
                }
            }
        }
        println!(
            "{}: {} messages, {:.2} MB, {found} identifiers; pieces differing: {}",
            corpus.name,
            corpus.messages.len(),
            corpus.bytes() as f64 / 1e6,
            differing.len()
        );
        assert!(
            differing.is_empty(),
            "{}: skipping changed what is found in {differing:?}",
            corpus.name
        );
    }
}

fn main() {
    check_identical();
    divan::main();
}
