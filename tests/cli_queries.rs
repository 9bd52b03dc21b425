//! The query subcommands over the local data directory: `compact` folds its
//! request into the local log once per idempotency key, and the other
//! queries answer with the API's JSON.

// Tests and benches fail loudly: a panic is their report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use contextfold::core::event::{Envelope, EventBody, TurnAppended};
use contextfold::core::message::{ChatMessage, Role};
use support::cli::{json_of, run as cli};

#[test]
fn local_compact_is_folded_once_per_request_id() {
    let dir = tempfile::tempdir().unwrap();
    let key = "agent:local";
    let lines: Vec<String> = (0..4u64)
        .map(|i| {
            let role = if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            };
            Envelope::new(
                format!("t{i}"),
                key,
                1_700_000_000_000 + i * 1_000,
                EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
                    role,
                    format!("turn {i} about port 8080"),
                ))),
            )
            .to_json()
        })
        .collect();
    let file = dir.path().join("events.jsonl");
    std::fs::write(&file, lines.join("\n")).unwrap();
    let data = dir.path().join("data");
    let (ok, _, err) = cli(&data, &["run", file.to_str().unwrap()]);
    assert!(ok, "run: {err}");

    let args = [
        "compact",
        key,
        "--instructions",
        "keep ports",
        "--request-id",
        "r1",
    ];
    let decisions_of = |id: &str| {
        let (ok, out, err) = cli(&data, &["history", key]);
        assert!(ok, "history: {err}");
        json_of(&out)["entries"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["event_id"] == id)
            .count()
    };
    let mut ids = Vec::new();
    let mut decisions = Vec::new();
    for _ in 0..2 {
        let (ok, out, err) = cli(&data, &args);
        assert!(ok, "compact: {err}");
        let v = json_of(&out);
        assert_eq!(v["published"], true, "{out}");
        let id = v["event"]["id"].as_str().unwrap().to_string();
        decisions.push(decisions_of(&id));
        ids.push(id);
    }
    assert_eq!(ids[0], ids[1], "the same request id gives the same event");
    assert!(decisions[0] >= 1, "the request was folded");
    assert_eq!(
        decisions[0], decisions[1],
        "asked again, it changed nothing"
    );
    let (ok, out, _) = cli(&data, &["status", key]);
    assert!(ok);
    assert_eq!(json_of(&out)["turns"]["total"], 4, "{out}");

    // The prompt's tokens are reserved from the budget.
    let (ok, out, err) = cli(
        &data,
        &["assemble", key, "--json", "--prompt", "hello there"],
    );
    assert!(ok, "assemble: {err}");
    assert!(
        json_of(&out)["prompt_tokens"].as_u64().unwrap() > 0,
        "{out}"
    );

    let (ok, _, err) = cli(&data, &["grep", "agent:nobody", "x"]);
    assert!(!ok && err.contains("unknown conversation"), "{err}");
}

/// Writes `n` turns of `key` as event JSONL, one line each.
fn turn_lines(key: &str, n: u64) -> Vec<String> {
    (0..n)
        .map(|i| {
            Envelope::new(
                format!("{key}-t{i}"),
                key,
                1_700_000_000_000 + i * 1_000,
                EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
                    Role::User,
                    format!("turn {i}"),
                ))),
            )
            .to_json()
        })
        .collect()
}

/// Every entry under `dir`, recursively, for "nothing was created" checks.
fn tree(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            out.push(e.path());
            out.extend(tree(&e.path()));
        }
    }
    out.sort();
    out
}

#[test]
fn read_only_commands_refuse_a_directory_without_data_and_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let key = "agent:x";
    let commands: Vec<Vec<&str>> = vec![
        vec!["status"],
        vec!["status", key],
        vec!["assemble", key],
        vec!["assemble", key, "--at", "e1"],
        vec!["grep", key, "turn"],
        vec!["describe", key, "1"],
        vec!["expand", key, "s1"],
        vec!["history", key],
        vec!["replay"],
        vec!["rebuild"],
        vec!["compact", key],
    ];
    for data in [&missing, &empty] {
        for args in &commands {
            let (ok, _, err) = cli(data, args);
            assert!(!ok, "{args:?} in {}: succeeded", data.display());
            assert!(
                err.contains(&format!("no contextfold data in {}", data.display()))
                    && err.contains("contextfold run"),
                "{args:?}: {err}"
            );
        }
    }
    assert!(!missing.exists(), "a read-only command created {missing:?}");
    assert_eq!(tree(&empty), Vec::<std::path::PathBuf>::new());
}

#[test]
fn without_a_store_the_queries_fold_the_log_in_memory_and_write_no_store() {
    let dir = tempfile::tempdir().unwrap();
    let key = "agent:logonly";
    let file = dir.path().join("events.jsonl");
    std::fs::write(&file, turn_lines(key, 3).join("\n")).unwrap();
    let data = dir.path().join("data");
    let (ok, _, err) = cli(&data, &["run", file.to_str().unwrap()]);
    assert!(ok, "run: {err}");
    std::fs::remove_file(data.join("state.redb")).unwrap();
    let before = tree(&data);
    let (ok, out, err) = cli(&data, &["status", key]);
    assert!(ok, "status: {err}");
    assert_eq!(json_of(&out)["turns"]["total"], 3, "{out}");
    let (ok, out, err) = cli(&data, &["assemble", key, "--json"]);
    assert!(ok, "assemble: {err}");
    assert_eq!(json_of(&out)["messages"].as_array().unwrap().len(), 3);
    assert!(
        !data.join("state.redb").exists(),
        "a query created the store"
    );
    assert_eq!(tree(&data), before);
}

#[test]
fn a_line_too_large_for_the_log_is_rejected_by_number_and_the_rest_folded() {
    let dir = tempfile::tempdir().unwrap();
    let key = "agent:big";
    let mut lines = turn_lines(key, 4);
    // 17 MiB: more than a log record holds (16 MiB).
    let huge = format!("{{\"junk\":\"{}\"}}", "x".repeat(17 * 1024 * 1024));
    let huge_len = huge.len();
    lines.insert(1, huge);
    let file = dir.path().join("events.jsonl");
    std::fs::write(&file, lines.join("\n")).unwrap();
    let data = dir.path().join("data");
    let (ok, _, err) = cli(&data, &["run", file.to_str().unwrap()]);
    assert!(!ok, "a rejected line makes the exit status a failure");
    assert!(
        err.contains(&format!("line 2 rejected: {huge_len} bytes")),
        "{err}"
    );
    let (ok, out, err) = cli(&data, &["status", key]);
    assert!(ok, "status: {err}");
    assert_eq!(
        json_of(&out)["turns"]["total"],
        4,
        "the lines after it were folded: {out}"
    );
}

/// `run` reads and measures its input a chunk ahead, on a thread of its
/// own: in chunks of two records it folds to the state that one chunk
/// gives, and a line too large for the log in a later chunk is named by its
/// line while the chunks after it are folded.
#[test]
fn a_run_in_small_chunks_folds_to_the_state_of_one_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let key = "agent:chunks";
    // 11 lines: the last chunk of two holds one.
    let mut lines = turn_lines(key, 10);
    // Line 7, in the fourth chunk of two; 17 MiB, more than a record holds.
    lines.insert(
        6,
        format!("{{\"junk\":\"{}\"}}", "x".repeat(17 * 1024 * 1024)),
    );
    let file = dir.path().join("events.jsonl");
    std::fs::write(&file, lines.join("\n")).unwrap();
    let state_of = |name: &str, extra: &[&str]| {
        let data = dir.path().join(name);
        let mut args = vec!["run", file.to_str().unwrap()];
        args.extend_from_slice(extra);
        let (ok, out, err) = cli(&data, &args);
        assert!(
            !ok,
            "{name}: a rejected line makes the exit status a failure"
        );
        assert!(err.contains("line 7 rejected: "), "{name}: {err}");
        let (ok, status, err) = cli(&data, &["status", key]);
        assert!(ok, "{name} status: {err}");
        assert_eq!(json_of(&status)["turns"]["total"], 10, "{name}: {status}");
        let total = out.lines().find(|l| l.starts_with("total:")).unwrap();
        total
            .split("state ")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        state_of("whole", &[]),
        state_of("chunks", &["--batch", "2"])
    );
}

/// `run` starts measuring its input before it opens the data directory (the
/// tokenizer loads while the store opens): when the directory cannot be
/// made, it still fails with the reason, folds nothing and exits, its
/// measuring thread stopped with it.
#[test]
fn a_run_whose_data_directory_cannot_be_made_fails_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("events.jsonl");
    std::fs::write(&file, turn_lines("agent:nowhere", 3000).join("\n")).unwrap();
    // A file where the data directory's parent should be.
    let blocker = dir.path().join("blocker");
    std::fs::write(&blocker, "not a directory").unwrap();
    let data = blocker.join("data");
    let (ok, out, err) = cli(&data, &["run", file.to_str().unwrap()]);
    assert!(!ok, "the run fails: {out}");
    assert!(
        err.contains("creating data directory") && err.contains(&*data.to_string_lossy()),
        "the reason names the directory: {err}"
    );
    assert!(!out.contains("total:"), "nothing was folded: {out}");
}

/// `classify-errors` tells a context overflow, a byte-size limit (no
/// compaction) and any other error apart, one line of stdin each.
#[test]
fn classify_errors_tells_overflow_from_size_limits() {
    use std::io::Write;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_contextfold"))
        .arg("classify-errors")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(
            b"This model's maximum context length is 4000 tokens. However, your messages resulted in 5000 tokens.\n\
              413 Request Entity Too Large\n\
              Rate limit reached, retry in 20s\n",
        )
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "overflow 4000 5000\nsize_limit\nother\n"
    );
}

/// Identical input, identical result: two `run`s of one transcript, with
/// compaction by the deterministic summarizer (summaries, sweep ends and
/// rolling states written back into the log), end in the same state hash
/// and write byte-identical logs. Nothing a sweep writes may carry a
/// wall-clock time or a measured duration (those go to telemetry only).
#[test]
fn two_runs_of_the_same_input_end_in_the_same_state_and_log() {
    let transcript = std::path::Path::new(
        "../shared/data/transcripts/claude-code_marot-spotter/fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl",
    );
    assert!(transcript.exists(), "{} is missing", transcript.display());
    let dir = tempfile::tempdir().unwrap();
    let mut states = Vec::new();
    let mut logs = Vec::new();
    for i in 0..2 {
        let data = dir.path().join(format!("run{i}"));
        let (ok, out, err) = cli(&data, &["run", transcript.to_str().unwrap()]);
        assert!(ok, "run {i}: {err}");
        let total = out.lines().find(|l| l.starts_with("total:")).unwrap();
        let summaries: u64 = total
            .split(" summaries")
            .next()
            .and_then(|s| s.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no summary count in {total:?}"));
        assert!(summaries > 0, "the run compacted nothing: {total}");
        let state = total.split("state ").nth(1).unwrap();
        states.push(state.split_whitespace().next().unwrap().to_string());
        let (ok, replayed, err) = cli(&data, &["replay"]);
        assert!(ok, "replay {i}: {err}");
        states.push(
            replayed
                .lines()
                .last()
                .unwrap()
                .split_whitespace()
                .nth(1)
                .unwrap()
                .to_string(),
        );
        let mut segments: Vec<_> = std::fs::read_dir(data.join("log"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "seg"))
            .collect();
        segments.sort();
        logs.push(
            segments
                .iter()
                .map(|p| std::fs::read(p).unwrap())
                .collect::<Vec<_>>(),
        );
    }
    assert!(states.iter().all(|s| s == &states[0]), "{states:?}");
    assert!(logs[0] == logs[1], "the two runs wrote different logs");
}
