//! `contextfold demo` as a new user meets it: it says what happened and
//! what to look at next, prints the same state hash on every run (in
//! memory or kept with `--data DIR`), and with `--data DIR` keeps a log and
//! a state that `audit`, `plot` and `assemble` then read.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::process::Command;
use support::cli::{run, split};

/// `contextfold demo` without `--data` (nothing of the caller's
/// configuration, run in `cwd`).
fn demo_in_memory(cwd: &std::path::Path) -> (bool, String, String) {
    split(
        Command::new(env!("CARGO_BIN_EXE_contextfold"))
            .arg("demo")
            .current_dir(cwd)
            .env_remove("CONTEXTFOLD_CONFIG")
            .output()
            .unwrap(),
    )
}

fn state_hash(out: &str) -> String {
    let re = regex::Regex::new(r"State hash ([0-9a-f]{32})").unwrap();
    re.captures(out)
        .map(|c| c[1].to_string())
        .unwrap_or_else(|| panic!("no state hash in:\n{out}"))
}

#[test]
fn the_demo_explains_itself_keeps_its_store_with_data_and_prints_one_hash_everywhere() {
    let dir = tempfile::tempdir().unwrap();

    // In memory: nothing written where it runs, twice the same hash.
    let (ok, first, err) = demo_in_memory(dir.path());
    assert!(ok, "{err}");
    let (ok, second, err) = demo_in_memory(dir.path());
    assert!(ok, "{err}");
    assert_eq!(state_hash(&first), state_hash(&second));
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "the in-memory demo wrote into its working directory"
    );
    for said in [
        "What happened",
        "summaries form a DAG",
        "Nothing was lost",
        "This run kept nothing",
        "contextfold --data demo-data demo",
        "contextfold --data demo-data audit demo:billing-agent",
        "contextfold --data demo-data plot demo:billing-agent --out demo.svg",
        "contextfold --data demo-data ui",
    ] {
        assert!(first.contains(said), "`{said}` not in:\n{first}");
    }
    // How many times depends on the summarizer; that it did, and says so,
    // does not.
    let compacted = first
        .split("Compacted ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse::<u32>().ok());
    let compacted = compacted
        .filter(|&n| n > 0)
        .unwrap_or_else(|| panic!("no `Compacted N times` in:\n{first}"));

    // Kept: the same hash, and the store the next commands read.
    let data = dir.path().join("demo data");
    let (ok, kept, err) = run(&data, &["demo"]);
    assert!(ok, "{err}");
    assert_eq!(state_hash(&kept), state_hash(&first));
    assert!(data.join("log").is_dir() && data.join("state.redb").is_file());
    let quoted = format!(
        "contextfold --data '{}' audit demo:billing-agent",
        data.display()
    );
    assert!(kept.contains(&quoted), "`{quoted}` not in:\n{kept}");
    assert!(!kept.contains("This run kept nothing"), "{kept}");

    let (ok, audit, err) = run(&data, &["audit", "demo:billing-agent"]);
    assert!(ok, "{err}");
    // The audit of the kept store tells the same story as the demo.
    assert!(
        audit.contains(&format!("{compacted} compactions")),
        "{audit}"
    );
    let svg = dir.path().join("demo.svg");
    let (ok, _, err) = run(
        &data,
        &["plot", "demo:billing-agent", "--out", svg.to_str().unwrap()],
    );
    assert!(ok, "{err}");
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    let (ok, replayed, err) = run(&data, &["replay"]);
    assert!(ok, "{err}");
    assert!(
        replayed.contains(&format!("state {}", state_hash(&kept))),
        "replay of the kept log gives another hash:\n{replayed}"
    );

    // A directory that holds a log already is not folded into again.
    let (ok, _, err) = run(&data, &["demo"]);
    assert!(!ok);
    assert!(err.contains("already holds a log"), "{err}");
}
