//! Assembly latency for a conversation of 26,500 turns with a context of
//! about 155,000 tokens (lossless-claw reports about 50 ms for this size;
//! the goal here is under 0.5 ms). Three shapes (`support/shapes.rs`:
//! `compacted`, `raw_newest_155k`, `raw_all_155k`), each built once before
//! timing and described on stderr.
//!
//! Each shape is timed as `borrowed` (`assemble_borrowed`: stored turns
//! borrowed from the state, what a server serializing the answer needs)
//! and `owned` (`assemble`: every message copied out). The same shapes
//! over NATS request/reply: `cargo bench --bench nats_assemble`.
//!
//! Run: `cargo bench --bench assembly`.

#[path = "support/transcripts.rs"]
mod transcripts;

#[path = "support/shapes.rs"]
mod shapes;

use contextfold::core::assembly::{assemble, assemble_from};
use contextfold::core::state::Resident;
use divan::Bencher;
use shapes::Shape;
use std::sync::OnceLock;

static COMPACTED: OnceLock<Option<Shape>> = OnceLock::new();
static RAW_NEWEST: OnceLock<Option<Shape>> = OnceLock::new();
static RAW_ALL: OnceLock<Option<Shape>> = OnceLock::new();

fn shape(name: &str) -> Option<&'static Shape> {
    let cell = match name {
        "compacted" => &COMPACTED,
        "raw_newest_155k" => &RAW_NEWEST,
        _ => &RAW_ALL,
    };
    cell.get_or_init(|| shapes::build(name)).as_ref()
}

/// What a server answering from state does: stored turns borrowed, the
/// result ready to serialize.
#[divan::bench(args = shapes::NAMES, sample_count = 300)]
fn borrowed(bencher: Bencher, name: &str) {
    let Some(s) = shape(name) else {
        eprintln!("{name} skipped: shared transcripts absent");
        return;
    };
    bencher.bench(|| assemble_from(&s.conv, &Resident, &s.policy, &s.request));
}

/// The same with every message copied out of the state (`assemble`).
#[divan::bench(args = shapes::NAMES, sample_count = 300)]
fn owned(bencher: Bencher, name: &str) {
    let Some(s) = shape(name) else {
        eprintln!("{name} skipped: shared transcripts absent");
        return;
    };
    bencher.bench(|| assemble(&s.conv, &s.policy, &s.request));
}

fn main() {
    // Build every shape before timing, so the descriptions come first.
    for name in shapes::NAMES {
        shape(name);
    }
    divan::main();
}
