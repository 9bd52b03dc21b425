//! Token counting throughput: `count_text` (what the fold uses: our
//! pre-tokenizer, a memo of short pieces' counts, bpe-openai's BPE; the
//! `bpe_openai` rows), bpe-openai alone (`count_text_unremembered`) and
//! tiktoken-rs (`count_text_tiktoken`, the reference), in o200k_base
//! and cl100k_base, over real agent text counted per message as the fold
//! counts it: the tau-bench airline transcripts and aider's chat history
//! from `../shared/data` (set `CONTEXTFOLD_SHARED_DATA` to point elsewhere).
//!
//! Before timing, it checks that both engines give the same totals over each
//! whole corpus and prints the verdict.
//!
//! Run: `cargo bench --bench tokens`. One iteration counts a whole corpus;
//! the throughput column is text bytes per second.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)] // the Claude Code corpus is for benches/identifiers.rs
#[path = "../tests/corpus/mod.rs"]
mod corpus;

use contextfold::core::tokens::{
    count_text, count_text_tiktoken, count_text_unremembered, Encoding,
};
use corpus::Corpus;
use divan::counter::BytesCount;
use divan::Bencher;
use std::fmt;
use std::sync::OnceLock;
use std::time::Instant;

static CORPORA: OnceLock<Vec<Corpus>> = OnceLock::new();

fn corpora() -> &'static [Corpus] {
    CORPORA.get_or_init(|| {
        corpus::available(&[
            (corpus::TAU_BENCH, corpus::tau_bench as corpus::Loader),
            (corpus::AIDER, corpus::aider),
        ])
    })
}

/// One corpus in one encoding.
#[derive(Clone, Copy)]
struct Input {
    corpus: usize,
    encoding: Encoding,
}

impl fmt::Display for Input {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} / {}",
            corpora()[self.corpus].name,
            self.encoding.name()
        )
    }
}

fn inputs() -> Vec<Input> {
    (0..corpora().len())
        .flat_map(|corpus| {
            [Encoding::O200kBase, Encoding::Cl100kBase].map(|encoding| Input { corpus, encoding })
        })
        .collect()
}

type Counter = fn(Encoding, &str) -> u64;

fn count_corpus(corpus: &Corpus, encoding: Encoding, count: Counter) -> u64 {
    corpus
        .messages
        .iter()
        .flat_map(|m| &m.pieces)
        .map(|piece| count(encoding, divan::black_box(piece)))
        .sum()
}

fn run(bencher: Bencher, input: Input, count: Counter) {
    let corpus = &corpora()[input.corpus];
    bencher
        .counter(BytesCount::new(corpus.bytes()))
        .bench(|| count_corpus(corpus, input.encoding, count));
}

#[divan::bench(args = inputs(), sample_count = 10, sample_size = 1)]
fn bpe_openai(bencher: Bencher, input: Input) {
    run(bencher, input, count_text);
}

#[divan::bench(args = inputs(), sample_count = 10, sample_size = 1)]
fn bpe_openai_unremembered(bencher: Bencher, input: Input) {
    run(bencher, input, count_text_unremembered);
}

#[divan::bench(args = inputs(), sample_count = 10, sample_size = 1)]
fn tiktoken_rs(bencher: Bencher, input: Input) {
    run(bencher, input, count_text_tiktoken);
}

/// Same totals from both engines over each whole corpus, message by
/// message; also a first, single-pass throughput figure for each.
fn check_identical_counts() {
    for input in inputs() {
        let corpus = &corpora()[input.corpus];
        let mut per_engine = Vec::new();
        for (engine, count) in [
            ("bpe-openai", count_text as Counter),
            ("tiktoken-rs", count_text_tiktoken as Counter),
        ] {
            count(input.encoding, "warm up the tokenizer tables");
            let start = Instant::now();
            let per_message: Vec<u64> = corpus
                .messages
                .iter()
                .map(|m| m.pieces.iter().map(|p| count(input.encoding, p)).sum())
                .collect();
            let seconds = start.elapsed().as_secs_f64();
            per_engine.push((engine, per_message, seconds));
        }
        let (fast, reference) = (&per_engine[0], &per_engine[1]);
        let totals = (fast.1.iter().sum::<u64>(), reference.1.iter().sum::<u64>());
        let differing: Vec<usize> = (0..corpus.messages.len())
            .filter(|&i| fast.1[i] != reference.1[i])
            .collect();
        let mb = corpus.bytes() as f64 / 1e6;
        println!(
            "{input}: {} messages, {:.2} MB; tokens bpe-openai {} tiktoken-rs {} -> {}; \
             one pass {:.1} MB/s vs {:.1} MB/s",
            corpus.messages.len(),
            mb,
            totals.0,
            totals.1,
            if differing.is_empty() && totals.0 == totals.1 {
                "IDENTICAL".to_string()
            } else {
                format!(
                    "DIFFERENT in {} messages, first: {} ({} vs {})",
                    differing.len(),
                    differing
                        .first()
                        .map_or("-", |&i| corpus.messages[i].label.as_str()),
                    differing.first().map_or(0, |&i| fast.1[i]),
                    differing.first().map_or(0, |&i| reference.1[i]),
                )
            },
            mb / fast.2,
            mb / reference.2,
        );
    }
}

fn main() {
    if corpora().is_empty() {
        eprintln!("no corpus found: nothing to benchmark");
        return;
    }
    // Once per process, before anything counts: what `serve` pays at start.
    let started = std::time::Instant::now();
    contextfold::core::tokens::load_tokenizers();
    println!(
        "loading both tokenizers (o200k, cl100k): {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    check_identical_counts();
    divan::main();
}
