//! bpe-openai (the fold's counter) against tiktoken-rs (the reference) on
//! real text: every message of the tau-bench airline corpus, counted the way
//! the fold counts it, must get the same number of tokens from both engines
//! in both encodings. A difference is reported with the message, the text
//! and both counts. And on all three corpora no text counts fewer tokens
//! than the bound that spares a draft counting its sources
//! (`tokens::fewest_tokens_up_to`).

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)] // `corpus::available` is the benchmarks' (it skips what it cannot read)
mod corpus;

use contextfold::core::tokens::{count_text, count_text_tiktoken, fewest_tokens_up_to, Encoding};

#[test]
fn bpe_openai_counts_like_tiktoken_on_every_tau_bench_message() {
    let corpus = match corpus::tau_bench() {
        Ok(Some(corpus)) => corpus,
        Ok(None) => {
            eprintln!(
                "skipped: {} is absent (set {} to the shared data directory)",
                corpus::shared_path(corpus::TAU_BENCH).display(),
                corpus::SHARED_DATA_ENV
            );
            return;
        }
        Err(e) => panic!("{e}"),
    };
    assert!(
        corpus.messages.len() > 5000,
        "only {} messages read from {}",
        corpus.messages.len(),
        corpus::shared_path(corpus::TAU_BENCH).display()
    );
    let mut differences = Vec::new();
    for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
        let (mut fast_total, mut reference_total) = (0u64, 0u64);
        for message in &corpus.messages {
            let (mut fast, mut reference) = (0u64, 0u64);
            let mut pieces = Vec::new();
            for piece in &message.pieces {
                let (f, r) = (
                    count_text(encoding, piece),
                    count_text_tiktoken(encoding, piece),
                );
                if f != r {
                    let start: String = piece.chars().take(80).collect();
                    pieces.push(format!("    bpe-openai {f}, tiktoken {r} for {start:?}..."));
                }
                fast += f;
                reference += r;
            }
            if fast != reference || !pieces.is_empty() {
                differences.push(format!(
                    "{} {}: bpe-openai {fast}, tiktoken {reference} ({:+})\n{}",
                    encoding.name(),
                    message.label,
                    fast as i64 - reference as i64,
                    pieces.join("\n")
                ));
            }
            fast_total += fast;
            reference_total += reference;
        }
        eprintln!(
            "{} over {} messages ({} bytes): bpe-openai {fast_total}, tiktoken {reference_total}",
            encoding.name(),
            corpus.messages.len(),
            corpus.bytes()
        );
        assert!(fast_total > 0, "{} counted nothing", encoding.name());
    }
    assert!(
        differences.is_empty(),
        "{} messages counted differently:\n{}",
        differences.len(),
        differences.join("\n")
    );
}

#[test]
fn no_real_text_counts_fewer_tokens_than_its_ends_of_words() {
    let corpora = [
        ("tau-bench", corpus::tau_bench()),
        ("aider", corpus::aider()),
        ("Claude Code", corpus::claude_code()),
    ];
    let mut read = 0;
    for (name, corpus) in corpora {
        let corpus = match corpus {
            Ok(Some(corpus)) => corpus,
            Ok(None) => {
                eprintln!(
                    "skipped {name}: set {} to the shared data",
                    corpus::SHARED_DATA_ENV
                );
                continue;
            }
            Err(e) => panic!("{name}: {e}"),
        };
        read += 1;
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            let (mut fewest_total, mut total) = (0u64, 0u64);
            for message in &corpus.messages {
                for piece in &message.pieces {
                    let (fewest, n) = (
                        fewest_tokens_up_to(piece, u64::MAX),
                        count_text(encoding, piece),
                    );
                    if fewest > n {
                        let start: String = piece.chars().take(80).collect();
                        panic!(
                            "{name} {} {}: {fewest} ends of words, {n} tokens in {start:?}...",
                            encoding.name(),
                            message.label
                        );
                    }
                    fewest_total += fewest;
                    total += n;
                }
            }
            eprintln!(
                "{name} {}: ends of words {fewest_total} of {total} tokens ({:.0}%)",
                encoding.name(),
                100.0 * fewest_total as f64 / total.max(1) as f64
            );
            assert!(fewest_total > 0, "{name}: no letters read");
        }
    }
    if read == 0 {
        eprintln!("skipped: no corpus in {}", corpus::SHARED_DATA_ENV);
    }
}
