//! `contextfold audit` and `contextfold plot` on a fixed conversation
//! folded by `run`: the golden `audit --json`, the text timeline, and the
//! SVG (parsed) holding one mark per compaction and per overflow; then a
//! 1,000-turn session, whose picture must stay legible.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use support::cli::{command, json_of, split};

const CONV: &str = "audit:golden";

/// The fold's policy for these tests: a small window, so a short
/// conversation compacts several times.
fn with_policy(cmd: &mut std::process::Command) -> &mut std::process::Command {
    cmd.env("CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW", "6000")
        .env("CONTEXTFOLD_POLICY__FRESH_TAIL_COUNT", "6")
        .env("CONTEXTFOLD_POLICY__LEAF_CHUNK_TOKENS", "1200")
        .env("CONTEXTFOLD_POLICY__LEAF_TARGET_TOKENS", "200")
        // Rarer than the tool loop below, so the loop's guard shows.
        .env("CONTEXTFOLD_POLICY__ROLLING_EVERY_TURNS", "60")
}

fn cli(data: &Path, args: &[&str]) -> (bool, String, String) {
    split(
        with_policy(&mut command(data, args))
            .output()
            .expect("the contextfold binary runs"),
    )
}

fn event(id: &str, conv: &str, time: u64, kind: &str, payload: Value) -> String {
    json!({"id": id, "conversation": conv, "time": time, "type": kind, "payload": payload})
        .to_string()
}

/// Words that differ turn to turn (so no turn is a duplicate).
fn words(i: usize, n: usize) -> String {
    (0..n)
        .map(|w| format!("w{}x{}", (w * 7 + i) % 97, i % 11))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The fixed conversation: a tool loop early on, turns past the threshold,
/// a provider overflow, a manual request with instructions, more turns.
fn golden_events(conv: &str, turns: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut t = 1_700_000_000_000u64;
    let mut next = |out: &mut Vec<String>, id: String, kind: &str, payload: Value| {
        t += 2_000;
        out.push(event(&id, conv, t, kind, payload));
    };
    for i in 0..turns {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let text = format!("turn {i}: {}", words(i, 60));
        next(
            &mut out,
            format!("{conv}#t{i}"),
            "turn_appended",
            json!({"message": {"role": role, "content": text}}),
        );
        if i == 1 {
            for k in 0..12 {
                let call = format!("call_{i}_{k}");
                next(
                    &mut out,
                    format!("{conv}#a{i}_{k}"),
                    "turn_appended",
                    json!({"message": {"role": "assistant", "tool_calls": [
                        {"id": call, "type": "function",
                         "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/f{k}.rs\"}}")}}
                    ]}}),
                );
                next(
                    &mut out,
                    format!("{conv}#r{i}_{k}"),
                    "turn_appended",
                    json!({"message": {"role": "tool", "tool_call_id": call,
                        "content": format!("fn f{k}() {{}} // {}", words(k, 20))}}),
                );
            }
        }
        if i == turns / 2 {
            next(
                &mut out,
                format!("{conv}#err{i}"),
                "provider_error_observed",
                json!({"error": "This model's maximum context length is 4000 tokens. However, your messages resulted in 4100 tokens. Please reduce the length of the messages."}),
            );
        }
        if i == 2 * turns / 3 {
            next(
                &mut out,
                format!("{conv}#manual{i}"),
                "compaction_requested",
                json!({"instructions": "keep every file path and the failing test names", "target_tokens": 1500}),
            );
        }
    }
    out
}

fn fold(dir: &Path, events: &[String]) -> PathBuf {
    let data = dir.join("data");
    let input = dir.join("events.jsonl");
    std::fs::write(&input, events.join("\n") + "\n").unwrap();
    let (ok, out, err) = cli(&data, &["run", input.to_str().unwrap()]);
    assert!(ok, "run failed: {out}\n{err}");
    data
}

fn audit_json(data: &Path, conv: &str) -> Value {
    let (ok, out, err) = cli(data, &["audit", conv, "--json"]);
    assert!(ok, "audit failed: {err}");
    json_of(&out)
}

/// Removes what varies run to run: sweep results are stamped with the
/// job's issue time plus the real time the sweep took.
fn scrub(v: &mut Value) {
    match v {
        Value::Object(map) => {
            for key in ["time", "elapsed_ms"] {
                map.remove(key);
            }
            for (_, child) in map.iter_mut() {
                scrub(child);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(scrub),
        _ => {}
    }
}

fn golden_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/audit/audit.json")
}

fn of_kind<'a>(audit: &'a Value, kind: &str) -> Vec<&'a Value> {
    audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == kind)
        .collect()
}

#[test]
fn audit_json_of_a_fixed_conversation_matches_the_golden_file() {
    let dir = tempfile::tempdir().unwrap();
    let data = fold(dir.path(), &golden_events(CONV, 70));
    let audit = audit_json(&data, CONV);

    // What the golden must show, checked apart from the bytes.
    let triggers = of_kind(&audit, "trigger");
    for reason in ["threshold", "overflow", "manual"] {
        assert!(
            triggers.iter().any(|t| t["reason"] == reason),
            "no {reason} trigger in {triggers:#?}"
        );
    }
    let overflow = triggers.iter().find(|t| t["reason"] == "overflow").unwrap();
    assert!(
        overflow["provider_error"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 4000"),
        "{overflow}"
    );
    let manual = triggers.iter().find(|t| t["reason"] == "manual").unwrap();
    assert_eq!(
        manual["instructions"],
        "keep every file path and the failing test names"
    );
    let rolling = of_kind(&audit, "rolling_due");
    assert!(
        rolling.iter().any(|r| r["reason"] == "tool_loop"),
        "{rolling:#?}"
    );
    let jobs = of_kind(&audit, "job_issued");
    let compactions = audit["compactions"].as_array().unwrap();
    assert_eq!(jobs.len(), compactions.len());
    let compacting = compactions.iter().filter(|c| c["compact"] == true).count();
    assert_eq!(audit["totals"]["compactions"], compacting as u64);
    assert!(compacting >= 3, "{compacting} compactions");
    for c in compactions.iter().filter(|c| c["compact"] == true) {
        let outcome = &c["outcome"];
        assert!(outcome.is_object(), "job without a sweep end: {c}");
        let (before, after) = (
            c["context_before"].as_u64().unwrap(),
            c["context_after"].as_u64().unwrap(),
        );
        if !c["summaries"].as_array().unwrap().is_empty() {
            assert!(after < before, "{c}");
        }
    }
    // Every accepted summary shows tokens taken out of context.
    for s in of_kind(&audit, "summary") {
        if s["accepted"] == true && s["summary_kind"] == "leaf" {
            assert!(
                s["context_after"].as_u64() < s["context_before"].as_u64(),
                "{s}"
            );
        }
    }
    let points = audit["points"].as_array().unwrap();
    assert_eq!(
        points.len() as u64,
        audit["totals"]["events"].as_u64().unwrap()
    );
    let marks = points.iter().filter(|p| p["mark"] == "compaction").count();
    assert_eq!(marks, compacting);

    let mut scrubbed = audit.clone();
    scrub(&mut scrubbed);
    let got = serde_json::to_string_pretty(&scrubbed).unwrap() + "\n";
    contextfold::testing::golden::check(
        &golden_path(),
        &got,
        "The audit of the fixed conversation changed: did the fold's decisions?",
        "cargo test --test audit",
    );
}

#[test]
fn audit_text_names_each_decision_and_unknown_conversations_fail() {
    let dir = tempfile::tempdir().unwrap();
    let data = fold(dir.path(), &golden_events(CONV, 70));
    let (ok, text, err) = cli(&data, &["audit", CONV]);
    assert!(ok, "{err}");
    for needle in [
        "debt recorded threshold: context ",
        "debt recorded overflow (urgent): provider reported a context overflow: This model's",
        "instructions: keep every file path",
        "rolling state due (tool_loop)",
        "compaction job_",
        "deadline met",
    ] {
        assert!(text.contains(needle), "no {needle:?} in\n{text}");
    }
    let (ok, _, err) = cli(&data, &["audit", "nobody"]);
    assert!(!ok);
    assert!(err.contains("no event in the log"), "{err}");
}

/// Attributes `fill` of every element of `svg`, counted per colour.
fn fills(svg: &str) -> std::collections::HashMap<String, usize> {
    let doc = roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("not XML: {e}"));
    let mut out = std::collections::HashMap::new();
    for node in doc.descendants().filter(|n| n.is_element()) {
        if let Some(fill) = node.attribute("fill") {
            *out.entry(fill.to_ascii_uppercase()).or_default() += 1;
        }
    }
    out
}

fn plot(data: &Path, conv: &str, out: &Path) -> String {
    let (ok, _, err) = cli(data, &["plot", conv, "--out", out.to_str().unwrap()]);
    assert!(ok, "plot failed: {err}");
    std::fs::read_to_string(out).unwrap()
}

#[test]
fn the_svg_parses_and_holds_one_mark_per_compaction_and_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let data = fold(dir.path(), &golden_events(CONV, 70));
    let audit = audit_json(&data, CONV);
    let svg = plot(&data, CONV, &dir.path().join("plot.svg"));
    let fills = fills(&svg);
    let count = |c: &str| fills.get(c).copied().unwrap_or(0) as u64;
    let compactions = audit["totals"]["compactions"].as_u64().unwrap();
    assert!(compactions > 0);
    assert_eq!(count(contextfold::plot::COMPACTION_FILL), compactions);
    assert_eq!(
        count(contextfold::plot::OVERFLOW_FILL),
        audit["totals"]["overflows"].as_u64().unwrap()
    );
    assert_eq!(audit["totals"]["overflows"], 1);
    assert!(svg.contains("summary DAG over"), "no DAG panel");
}

#[test]
fn a_thousand_turn_session_plots_legibly() {
    let dir = tempfile::tempdir().unwrap();
    let conv = "audit:long";
    let mut events = Vec::new();
    for i in 0..1_000u64 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        events.push(event(
            &format!("{conv}#{i}"),
            conv,
            1_700_000_000_000 + i * 1_000,
            "turn_appended",
            json!({"message": {"role": role, "content": format!("turn {i}: {}", words(i as usize, 40))}}),
        ));
    }
    let data = fold(dir.path(), &events);
    let svg = plot(&data, conv, &dir.path().join("long.svg"));
    let doc = roxmltree::Document::parse(&svg).unwrap();
    // Summary bars are the DAG's filled rectangles in the summary colours.
    let bars: Vec<f64> = doc
        .descendants()
        .filter(|n| n.has_tag_name("rect"))
        .filter(|n| {
            n.attribute("fill").is_some_and(|f| {
                ["#2E7D32", "#3949AB", "#EF6C00"].contains(&f.to_ascii_uppercase().as_str())
            })
        })
        .map(|n| {
            n.attribute("width")
                .and_then(|w| w.parse().ok())
                .unwrap_or(0.0)
        })
        .collect();
    assert!(bars.len() > 20, "{} summary bars", bars.len());
    let narrowest = bars.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(narrowest >= 3.0, "a summary bar is {narrowest} px wide");
}
