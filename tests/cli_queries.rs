//! The query subcommands over the local data directory: `compact` folds its
//! request into the local log once per idempotency key, and the other
//! queries answer with the API's JSON.

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
