//! `contextfold eval` as a user runs it: the built binary over real
//! transcripts from ../shared/data/transcripts (skipped with a message when
//! absent), checking the JSON report's invariants rather than fixed numbers,
//! and the model path against fakellm on loopback, whose own request count
//! must match the calls the report says were spent.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/llm_server.rs"]
mod llm_server;

use llm_server::FakeLlm;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const TRANSCRIPTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data/transcripts");

fn transcript(rel: &str) -> Option<PathBuf> {
    let p = Path::new(TRANSCRIPTS).join(rel);
    if p.is_file() {
        Some(p)
    } else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: {} not found (the shared data set is absent)",
            p.display()
        );
        None
    }
}

fn eval(args: &[&str], files: &[PathBuf], env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_contextfold"));
    cmd.arg("eval")
        .args(args)
        .args(files)
        // Nothing of the caller's environment may switch the summarizer.
        .env_remove("CONTEXTFOLD_CONFIG")
        .env_remove("CONTEXTFOLD_SUMMARIZER__BASE_URL")
        .current_dir(dir.path());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run contextfold eval")
}

/// The last line of stdout as JSON.
fn report(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| {
        panic!(
            "last line is not JSON ({e}): {last:?}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn f(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

#[test]
fn a_small_budget_compacts_without_overflow() {
    let (Some(a), Some(b)) = (
        transcript("swe-agent_SWE-agent/pydicom__pydicom-1458.traj"),
        transcript("claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl"),
    ) else {
        return;
    };
    let out = eval(&["--budget", "8000", "--json"], &[a, b], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&out);
    assert_eq!(r["overflows"], json!(0), "{r}");
    let retention = f(&r, "identifier_retention");
    assert!((0.0..=1.0).contains(&retention), "{retention}");
    let kept = f(&r, "identifiers_retained");
    let all = f(&r, "identifiers");
    assert!(all > 0.0 && (retention - kept / all).abs() < 1e-9);
    // By kind: the kinds add up to the whole, and paths are among them.
    let kinds = r["retention_by_kind"].as_object().expect("by kind");
    let sum = |field: &str| -> f64 { kinds.values().map(|k| k[field].as_f64().unwrap()).sum() };
    assert_eq!(sum("identifiers"), all, "{r}");
    assert_eq!(sum("retained"), kept, "{r}");
    assert!(kinds.contains_key("path"), "{r}");
    // With 8000 tokens for sessions of 14k and 145k, something was
    // summarized, and a summary is smaller than what it replaced.
    assert!(f(&r, "compression_ratio") > 1.0, "{r}");
    let depths = r["compression_by_depth"].as_object().expect("by depth");
    assert!(depths.contains_key("0"), "no leaf summary: {r}");
    for (depth, c) in depths {
        assert!(
            f(c, "covered_tokens") > f(c, "summary_tokens"),
            "depth {depth}: {c}"
        );
    }
    // The deterministic summarizer spends nothing.
    assert_eq!(r["calls"], json!(0));
    let files = r["files"].as_array().expect("files");
    assert_eq!(files.len(), 2);
    for file in files {
        assert!(f(file, "turns") > 0.0, "{file}");
        assert!(
            f(file, "assemblies") >= f(file, "turns"),
            "one per turn: {file}"
        );
        assert!(f(file, "max_assembled_tokens") <= 8000.0, "{file}");
    }
}

#[test]
fn a_budget_larger_than_the_session_keeps_every_identifier() {
    let Some(a) = transcript("claude-code_marot-spotter/tool_heavy.jsonl") else {
        return;
    };
    let out = eval(&["--budget", "1000000", "--json"], &[a], &[]);
    assert!(out.status.success());
    let r = report(&out);
    // Nothing needed compaction: the context is the verbatim transcript.
    assert_eq!(f(&r, "identifier_retention"), 1.0, "{r}");
    assert_eq!(f(&r, "compression_ratio"), 1.0, "{r}");
    assert!(f(&r, "identifiers") > 0.0, "the transcript has identifiers");
    assert_eq!(r["overflows"], json!(0));
}

#[test]
fn the_table_names_every_file_and_a_bad_file_fails_the_run() {
    let Some(a) = transcript("claude-code_marot-spotter/short.jsonl") else {
        return;
    };
    let missing = PathBuf::from("/nonexistent/transcript.jsonl");
    let out = eval(&[], &[a, missing], &[]);
    assert!(
        !out.status.success(),
        "a file that cannot be read fails the run"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("short.jsonl"), "{stdout}");
    assert!(stdout.contains("error:"), "{stdout}");
    assert!(stdout.contains("overall: 0 overflows"), "{stdout}");
    assert!(stdout.contains("budget 32000 tokens"), "{stdout}");
}

#[tokio::test]
async fn the_model_path_reports_the_calls_the_server_saw() {
    let Some(a) = transcript("swe-agent_SWE-agent/pydicom__pydicom-1458.traj") else {
        return;
    };
    // The run's demonstration (another task: marshmallow's TimeDelta fix)
    // is never sent; the request that covers it names it.
    let rules = json!({"rules": [
        {"name": "demonstration-sent", "when": {"messages_contain": "marshmallow"},
         "respond": {"content": "The agent fixed marshmallow's TimeDelta rounding."}},
        {"name": "demonstration-named", "when": {"messages_contain": "user (demonstration)"},
         "respond": {"content": "The agent was given the pydicom issue about float pixel data and reproduced the failure."}},
        {"name": "rolling", "when": {"messages_contain": "In progress"},
         "respond": {"content": "Completed: reproduced the bug\nIn progress: fixing the reader\nDecisions: keep the public API\nBlockers: none\nNext: add a test"}},
        {"name": "summary", "when": {"model_matches": "m-eval"},
         "respond": {"content": "The agent reproduced the failing pydicom read, traced it to the value reader, and patched the conversion while keeping the public API unchanged."}}
    ]});
    let Some(server) = FakeLlm::start(&rules.to_string()).await else {
        return;
    };
    let base = server.base_url();
    let out = tokio::task::spawn_blocking(move || {
        eval(
            &["--budget", "8000", "--json"],
            &[a],
            &[
                ("CONTEXTFOLD_SUMMARIZER__BASE_URL", base.as_str()),
                ("CONTEXTFOLD_SUMMARIZER__MODEL", "m-eval"),
                ("CONTEXTFOLD_SUMMARIZER__MAX_RETRIES", "0"),
            ],
        )
    })
    .await
    .expect("eval ran");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&out);
    assert!(
        r["summarizer"]
            .as_str()
            .unwrap_or_default()
            .contains("m-eval"),
        "{r}"
    );
    let calls = f(&r, "calls") as u64;
    assert!(calls > 0, "the model was never called: {r}");
    assert_eq!(
        calls,
        server.total().await,
        "calls in the report = calls at the server"
    );
    assert!(f(&r, "tokens_spent") > 0.0);
    assert_eq!(r["overflows"], json!(0));
    let by_rule = server.by_rule().await;
    assert_eq!(by_rule.get("demonstration-sent"), None, "{by_rule:?}");
    assert!(by_rule.get("demonstration-named") > Some(&0), "{by_rule:?}");
    assert!(
        f(&r, "identifiers_only_in_demonstrations") > 0.0,
        "marshmallow's identifiers are counted apart: {r}"
    );
}

/// A model that refuses every request (a real small model's answer, issue
/// 14): the report counts the refusals and the fallbacks, the retention
/// in the summary text stays apart from the "Exact identifiers" appendix,
/// and `--keep` leaves a data directory `history` can read.
#[tokio::test]
async fn refusals_are_counted_and_the_kept_data_dir_is_readable() {
    let Some(a) = transcript("swe-agent_SWE-agent/pydicom__pydicom-1458.traj") else {
        return;
    };
    let rules = json!({"rules": [
        {"name": "refuse", "when": {"model_matches": "m-refuse"},
         "respond": {"content": "I'm sorry, but I can't assist with that."}}
    ]});
    let Some(server) = FakeLlm::start(&rules.to_string()).await else {
        return;
    };
    let base = server.base_url();
    let keep = tempfile::tempdir().expect("tempdir");
    let keep_dir = keep.path().join("kept");
    let kd = keep_dir.clone();
    let out = tokio::task::spawn_blocking(move || {
        eval(
            &[
                "--budget",
                "8000",
                "--json",
                "--keep",
                kd.to_str().unwrap_or_default(),
            ],
            &[a],
            &[
                ("CONTEXTFOLD_SUMMARIZER__BASE_URL", base.as_str()),
                ("CONTEXTFOLD_SUMMARIZER__MODEL", "m-refuse"),
                ("CONTEXTFOLD_SUMMARIZER__MAX_RETRIES", "0"),
            ],
        )
    })
    .await
    .expect("eval ran");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&out);
    let refusals = r["rejections"]["refusal"].as_u64().unwrap_or(0);
    assert!(refusals > 0, "no refusal counted: {}", r["rejections"]);
    assert!(
        r["escalations"]["fallback"].as_u64().unwrap_or(0) > 0,
        "{}",
        r["escalations"]
    );
    // Every summary is a fallback: what the appendix adds is counted apart.
    let in_text = f(&r, "identifier_retention_in_text");
    assert!(in_text <= f(&r, "identifier_retention"), "{r}");
    assert_eq!(
        r["identifiers_retained"].as_u64().unwrap_or(0),
        r["identifiers_retained_in_text"].as_u64().unwrap_or(0)
            + r["identifiers_only_in_appendix"].as_u64().unwrap_or(0)
    );

    let conv = r["files"][0]["conversation_ids"][0]
        .as_str()
        .expect("a conversation id")
        .to_string();
    let history = Command::new(env!("CARGO_BIN_EXE_contextfold"))
        .args([
            "--data",
            keep_dir.to_str().unwrap_or_default(),
            "history",
            &conv,
        ])
        .env_remove("CONTEXTFOLD_CONFIG")
        .env_remove("CONTEXTFOLD_SUMMARIZER__BASE_URL")
        .current_dir(keep.path())
        .output()
        .expect("run contextfold history");
    let text = String::from_utf8_lossy(&history.stdout);
    assert!(
        history.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&history.stderr)
    );
    assert!(
        text.contains("summary"),
        "no summary in the kept history: {text}"
    );
    // The kept log replays under the policy eval folded with (recorded in
    // it), not today's default: its summaries apply, none is refused.
    let status = Command::new(env!("CARGO_BIN_EXE_contextfold"))
        .args([
            "--data",
            keep_dir.to_str().unwrap_or_default(),
            "status",
            &conv,
        ])
        .env_remove("CONTEXTFOLD_CONFIG")
        .env_remove("CONTEXTFOLD_SUMMARIZER__BASE_URL")
        .current_dir(keep.path())
        .output()
        .expect("run contextfold status");
    let stderr = String::from_utf8_lossy(&status.stderr);
    assert!(status.status.success(), "{stderr}");
    assert!(!stderr.contains("rejected"), "{stderr}");
    let s: Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    assert!(
        s["turns"]["summarized"].as_u64().unwrap_or(0) > 0,
        "the kept summaries do not apply: {s}"
    );
    // A second run into the same directory is refused, not mixed in.
    let again = eval(
        &["--keep", keep_dir.to_str().unwrap_or_default()],
        &[transcript("swe-agent_SWE-agent/pydicom__pydicom-1458.traj").unwrap_or_default()],
        &[],
    );
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds an event log"));
}

/// `--probes`: each probe is checked against the assembled context and
/// against plain truncation at the same budget, counted by kind, at the
/// end of the conversation or right after the turn it names; a bad probe
/// file is refused naming its line.
#[test]
fn probes_are_checked_against_the_context_and_truncation() {
    let Some(a) = transcript("swe-agent_SWE-agent/pydicom__pydicom-1458.traj") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let probes = dir.path().join("probes.jsonl");
    let conv = "pydicom__pydicom-1458";
    let lines = [
        // The run ends with `submit`: both contexts hold it.
        json!({"conversation": conv, "id": "end", "kind": "done", "question": "submitted?",
               "expect": ["(?i)\\bsubmit"]}),
        json!({"conversation": conv, "id": "never", "kind": "open", "question": "?",
               "expect": ["no such text anywhere 8c1f"]}),
        // Right after turn 3 the agent has only planned the reproduction.
        json!({"conversation": conv, "id": "early", "kind": "next", "question": "next?",
               "expect": ["reproduce_bug\\.py"], "at_turn": 3}),
        json!({"conversation": conv, "id": "not-yet", "kind": "done", "question": "?",
               "expect": ["Result: True"], "at_turn": 3}),
        json!({"conversation": conv, "id": "past-the-end", "kind": "next", "question": "?",
               "expect": ["x"], "at_turn": 9999}),
        json!({"conversation": "another-conversation", "id": "elsewhere", "kind": "task",
               "question": "?", "expect": ["x"]}),
    ];
    let text: Vec<String> = lines.iter().map(Value::to_string).collect();
    std::fs::write(&probes, text.join("\n")).expect("write probes");
    let out = eval(
        &[
            "--budget",
            "8000",
            "--json",
            "--probes",
            probes.to_str().unwrap(),
        ],
        std::slice::from_ref(&a),
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&out);
    let p = &r["probes"];
    assert_eq!(p["not_in_these_files"], json!(1), "{p}");
    assert_eq!(p["total"]["probes"], json!(4), "{p}");
    assert_eq!(p["by_kind"]["done"]["probes"], json!(2), "{p}");
    assert_eq!(p["by_kind"]["done"]["contextfold"], json!(1), "{p}");
    assert_eq!(p["by_kind"]["done"]["truncation"], json!(1), "{p}");
    assert_eq!(p["by_kind"]["next"]["contextfold"], json!(1), "{p}");
    assert_eq!(p["by_kind"]["open"]["contextfold"], json!(0), "{p}");
    let file = &r["files"][0];
    assert_eq!(
        file["probes_never_reached"],
        json!(["past-the-end"]),
        "{file}"
    );
    let outcomes = file["probes"]["outcomes"].as_array().expect("outcomes");
    let of = |id: &str| outcomes.iter().find(|o| o["id"] == json!(id)).cloned();
    assert_eq!(of("not-yet").unwrap()["contextfold"], json!(false));
    assert_eq!(of("end").unwrap()["truncation"], json!(true));

    // The table names both columns; two budgets give two reports.
    let out = eval(
        &[
            "--budget",
            "32000",
            "--budget",
            "8000",
            "--probes",
            probes.to_str().unwrap(),
        ],
        std::slice::from_ref(&a),
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("continuity probes at budget 32000"),
        "{stdout}"
    );
    assert!(
        stdout.contains("continuity probes at budget 8000"),
        "{stdout}"
    );
    assert!(stdout.contains("missed by truncation"), "{stdout}");

    std::fs::write(
        &probes,
        format!("{}\n{{\"conversation\": \"c\", \"id\": \"x\"}}", text[0]),
    )
    .expect("write probes");
    let bad = eval(&["--probes", probes.to_str().unwrap()], &[a], &[]);
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("line 2"), "{stderr}");
}
