use super::rolling::truncate_chars;
use super::*;
use crate::core::message::ChatMessage;
use crate::core::tokens::count_message;

fn shared_transcript(name: &str) -> Option<String> {
    let base = env!("CARGO_MANIFEST_DIR");
    // The crate root's sibling `shared/`, or one level further up (a
    // worktree in a sibling directory).
    for dir in ["/../shared/data", "/../../shared/data"] {
        if let Ok(text) = std::fs::read_to_string(format!("{base}{dir}/transcripts/{name}")) {
            return Some(text);
        }
    }
    eprintln!("skipped: shared/data/transcripts/{name} not found next to the crate");
    None
}

fn item_of(turn: usize, message: &ChatMessage) -> SourceItem {
    let tool = match message.role {
        Role::Assistant => message.tool_calls.first().map(|c| c.function.name.clone()),
        Role::Tool => message.name.clone(),
        _ => None,
    };
    SourceItem {
        label: format!("turn {turn}"),
        role: Some(message.role),
        tool,
        text: message.searchable_text(),
        tokens: count_message(ENCODING, message),
        time: turn as u64,
        ..SourceItem::default()
    }
}

/// The non-system messages of the tau-bench conversations (OpenAI chat
/// messages), read once for all tests.
fn tau_bench_messages() -> Option<&'static [ChatMessage]> {
    static MESSAGES: std::sync::OnceLock<Option<Vec<ChatMessage>>> = std::sync::OnceLock::new();
    MESSAGES
        .get_or_init(|| {
            let text = shared_transcript("tau-bench_sierra-research/gpt-4o-airline.json")?;
            let runs: Vec<serde_json::Value> = match serde_json::from_str(&text) {
                Ok(runs) => runs,
                Err(e) => panic!("tau-bench file does not parse: {e}"),
            };
            let messages = runs
                .iter()
                .filter_map(|run| run.get("traj").and_then(|t| t.as_array()))
                .flatten()
                .filter_map(|v| serde_json::from_value::<ChatMessage>(v.clone()).ok())
                .filter(|m| m.role != Role::System)
                .collect();
            Some(messages)
        })
        .as_deref()
}

/// Turns of the tau-bench conversations, numbered across conversations,
/// until `max_tokens`.
fn tau_bench_items(max_tokens: u64) -> Option<Vec<SourceItem>> {
    let mut items = Vec::new();
    let mut total = 0;
    for message in tau_bench_messages()? {
        let item = item_of(items.len() + 1, message);
        if total + item.tokens > max_tokens {
            break;
        }
        total += item.tokens;
        items.push(item);
    }
    Some(items)
}

fn swe_agent_items() -> Option<Vec<SourceItem>> {
    let text = shared_transcript(
        "swe-agent_SWE-agent/marshmallow-code__marshmallow-1867.function_calling.traj",
    )?;
    let traj: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => panic!("swe-agent file does not parse: {e}"),
    };
    let history = traj.get("history")?.as_array()?;
    let items = history
        .iter()
        .filter_map(|v| serde_json::from_value::<ChatMessage>(v.clone()).ok())
        .filter(|m| m.role != Role::System)
        .enumerate()
        .map(|(i, m)| item_of(i + 1, &m))
        .collect();
    Some(items)
}

fn leaf(sources: Vec<SourceItem>, target_tokens: u64) -> SummaryRequest {
    SummaryRequest {
        conversation: "test:conv".to_string(),
        kind: SummaryKind::Leaf,
        depth: 0,
        sources,
        target_tokens,
        previous_summary: None,
        instructions: None,
        custom_instructions: None,
        identifier_policy: IdentifierPolicy::Strict,
        aggressive: false,
    }
}

fn turn(n: usize, role: Role, text: &str) -> SourceItem {
    let message = ChatMessage::text(role, text);
    item_of(n, &message)
}

fn retention(content: &str, sources: &[SourceItem]) -> (usize, usize) {
    let mut all = Vec::new();
    let mut seen = HashSet::new();
    for s in sources {
        for id in identifiers::extract(&s.text) {
            if seen.insert(id.clone()) {
                all.push(id);
            }
        }
    }
    let kept = all
        .iter()
        .filter(|id| content.contains(id.as_str()))
        .count();
    (kept, all.len())
}

#[test]
fn marked_as_deterministic_fallback() {
    let draft = summarize(&leaf(vec![turn(1, Role::User, "hello there")], 100));
    assert!(draft.fallback);
    assert_eq!(draft.model, "deterministic");
    assert_eq!(draft.provider, "contextfold");
    assert_eq!(draft.prompt_version, PROMPT_VERSION);
}

#[test]
fn the_header_pattern_matches_the_headers_written() {
    let long = "The parser drops the last field of a quoted row; see src/parse.rs. ".repeat(40);
    let sources = vec![
        turn(1, Role::User, &format!("Fix the parser. {long}")),
        turn(2, Role::Assistant, &long),
    ];
    let leaf_text = summarize(&leaf(sources, 200)).content;
    let child = SourceItem {
        label: "summary sum_1".into(),
        role: None,
        tool: None,
        text: leaf_text.clone(),
        tokens: 50,
        time: 0,
        ..SourceItem::default()
    };
    let mut condensed = leaf(vec![child.clone(), child], 200);
    condensed.kind = SummaryKind::Condensed;
    condensed.depth = 1;
    let condensed_text = summarize(&condensed).content;
    for text in [&leaf_text, &condensed_text] {
        let first = text.lines().next().unwrap_or("");
        assert!(header_pattern().is_match(first), "{first:?}");
        // Only the header: the rest of the summary is left alone.
        let rest = header_pattern().replace_all(text, "");
        assert_eq!(rest, text[first.len()..].trim_start_matches('\n'));
    }
}

#[test]
fn same_input_same_output() {
    let Some(items) = tau_bench_items(20_000) else {
        return;
    };
    let req = leaf(items, 2400);
    let a = summarize(&req);
    let b = summarize(&req);
    assert_eq!(a, b);
    assert!(!a.content.is_empty());
}

#[test]
fn a_20000_token_leaf_fits_about_2400_tokens() {
    let Some(items) = tau_bench_items(20_000) else {
        return;
    };
    let req = leaf(items, 2400);
    let source = req.source_tokens();
    assert!(source > 15_000, "leaf too small to test: {source}");
    let draft = summarize(&req);
    let size = tokens(&draft.content);
    assert!(size <= 2400, "{size} tokens");
    // It uses the room it was given (the structure is not empty).
    assert!(size >= 1800, "only {size} tokens:\n{}", draft.content);
    for heading in [
        "## Task (the user's words)",
        "## Done",
        "## Exact identifiers",
    ] {
        assert!(
            draft.content.contains(heading),
            "no {heading}:\n{}",
            draft.content
        );
    }
    // Same with no target given: 12% of the source.
    let mut untargeted = req;
    untargeted.target_tokens = 0;
    let size = tokens(&summarize(&untargeted).content);
    assert!(size <= source * 12 / 100, "{size} > 12% of {source}");
}

#[test]
fn aggressive_aims_at_half() {
    let Some(items) = tau_bench_items(20_000) else {
        return;
    };
    let mut req = leaf(items, 2400);
    req.aggressive = true;
    let size = tokens(&summarize(&req).content);
    assert!(size <= 1200, "{size}");
    assert!(size >= 800, "{size}");
}

#[test]
fn never_larger_than_the_source_or_the_target() {
    let Some(items) = tau_bench_items(60_000) else {
        return;
    };
    // Windows of many sizes and targets, from tiny to larger than the source.
    for (start, len) in [(0, 1), (3, 2), (10, 5), (20, 12), (40, 40), (100, 150)] {
        let window: Vec<SourceItem> = items.iter().skip(start).take(len).cloned().collect();
        for target in [1, 5, 10, 40, 200, 2400, 100_000] {
            for aggressive in [false, true] {
                let mut req = leaf(window.clone(), target);
                req.aggressive = aggressive;
                let size = tokens(&summarize(&req).content);
                let source = req.source_tokens();
                let cap = if aggressive { target / 2 } else { target };
                assert!(
                    size <= source,
                    "{size} > source {source} ({start},{len},{target})"
                );
                assert!(
                    size <= cap,
                    "{size} > target {cap} ({start},{len},{target})"
                );
            }
        }
    }
}

#[test]
fn keeps_identifiers_of_a_real_transcript() {
    let Some(items) = tau_bench_items(20_000) else {
        return;
    };
    let req = leaf(items, 2400);
    let draft = summarize(&req);
    let (kept, all) = retention(&draft.content, &req.sources);
    assert!(all > 50, "too few identifiers to test: {all}");
    // Every identifier in 2400 tokens is not always possible; most are.
    assert!(kept * 100 >= all * 80, "kept {kept} of {all}");
    assert!(draft.content.contains("mia_li_3668"));

    // With room for them, all of them.
    let mut roomy = req;
    roomy.target_tokens = 6000;
    let draft = summarize(&roomy);
    let (kept, all) = retention(&draft.content, &roomy.sources);
    assert_eq!(kept, all, "with room, every identifier:\n{}", draft.content);
}

#[test]
fn summarizes_a_swe_agent_trajectory() {
    let Some(items) = swe_agent_items() else {
        return;
    };
    let req = leaf(items, 1500);
    let draft = summarize(&req);
    let size = tokens(&draft.content);
    assert!(size <= 1500, "{size}");
    // The file the fix edited, the edit refused for its indentation and
    // what the agent did about it.
    let files = draft.content.split("## Files changed").nth(1).unwrap_or("");
    assert!(
        files.contains("src/marshmallow/fields.py (edited"),
        "{}",
        draft.content
    );
    let errors = draft
        .content
        .split("## Errors and fixes")
        .nth(1)
        .unwrap_or("");
    assert!(
        errors.contains("IndentationError") && errors.contains("→ turn"),
        "{}",
        draft.content
    );
    let (kept, all) = retention(&draft.content, &req.sources);
    assert!(kept * 100 >= all * 80, "kept {kept} of {all}");
}

#[test]
fn sorts_sentences_into_sections() {
    let mut items = vec![
        turn(
            1,
            Role::User,
            "Please migrate the store at /srv/data/app.db to redb.",
        ),
        turn(
            2,
            Role::Assistant,
            "I decided to use redb instead of sled because sled deadlocked in the soak test. \
             TODO: benchmark compaction on 192.168.1.20:6379 later.",
        ),
        turn(
            3,
            Role::Tool,
            "error[E0308]: mismatched types at src/store/redb.rs:42",
        ),
        turn(
            4,
            Role::Assistant,
            "The build fails because the key type changed. Let me fix the key type.",
        ),
    ];
    items[2].tool = Some("cargo_build".to_string());
    for i in 0..30 {
        items.push(turn(
            5 + i,
            Role::Assistant,
            &format!("filler remark number {i} about nothing in particular at all"),
        ));
    }
    let req = leaf(items, 400);
    let content = summarize(&req).content;
    let section = |name: &str| -> String {
        content
            .split("\n## ")
            .find(|s| s.starts_with(name))
            .unwrap_or("")
            .to_string()
    };
    assert!(
        section("Decisions").contains("redb instead of sled"),
        "{content}"
    );
    // The failure, with what the agent said right after it.
    let errors = section("Errors and fixes");
    assert!(errors.contains("E0308"), "{content}");
    assert!(
        errors.contains("→ turn 4: The build fails because"),
        "{content}"
    );
    assert!(section("Task").contains("/srv/data/app.db"), "{content}");
    assert!(section("Open").contains("192.168.1.20:6379"), "{content}");
    assert!(
        section("Next").contains("Let me fix the key type"),
        "{content}"
    );
    assert!(tokens(&content) <= 400);
}

/// The handover's facts: files changed and what changed, milestones, no
/// tool-call JSON, and the next step never older than the user's newest
/// request.
#[test]
fn a_handover_names_files_milestones_and_the_next_step() {
    let edit = "Now add the identity to Message.\nEdit({\"file_path\":\"lib/spotter/message.ex\",\
                \"old_string\":\"  end\\nend\",\"new_string\":\"  end\\n  identities do\\n    \
                identity :unique_session_uuid, [:session_id, :uuid]\\n  end\\nend\"})";
    let mut call = turn(2, Role::Assistant, edit);
    call.tool = Some("Edit".to_string());
    let mut ok = turn(
        3,
        Role::Tool,
        "The file lib/spotter/message.ex has been updated successfully.",
    );
    ok.tool = None;
    let mut run = turn(
        4,
        Role::Assistant,
        "Bash({\"command\":\"mix test && git commit -m 'feat: upsert'\"})",
    );
    run.tool = Some("Bash".to_string());
    let out = turn(
        5,
        Role::Tool,
        "Finished in 0.7 seconds\n379 tests, 0 failures\n[spotter-a0y 66e1a0a] feat: upsert",
    );
    let mut items = vec![
        turn(
            1,
            Role::User,
            "Add an upsert for messages, keyed by session and uuid.",
        ),
        call,
        ok,
        run,
        out,
        turn(6, Role::Assistant, "Next I will wire the tail workers."),
        turn(7, Role::User, "wait, first show me the migration please"),
    ];
    for i in 0..20 {
        items.insert(
            1,
            turn(
                100 + i,
                Role::Assistant,
                &format!("looking at module number {i} which is not relevant here"),
            ),
        );
    }
    let content = summarize(&leaf(items, 250)).content;
    assert!(
        content.contains(
            "lib/spotter/message.ex (edited in turn 2): Now add the identity to Message."
        ),
        "{content}"
    );
    assert!(
        content.contains("identity :unique_session_uuid"),
        "{content}"
    );
    assert!(content.contains("379 tests, 0 failures"), "{content}");
    assert!(
        content.contains("[spotter-a0y 66e1a0a] feat: upsert"),
        "{content}"
    );
    assert!(!content.contains("{\""), "no call JSON: {content}");
    let next = content.split("## Next").nth(1).unwrap_or("");
    assert!(
        next.contains("answer the user: wait, first show me the migration"),
        "{content}"
    );
    assert!(!next.contains("tail workers"), "stale next step: {content}");
}

#[test]
fn a_demonstration_is_not_what_was_asked() {
    let mut demo = turn(
        1,
        Role::User,
        "(A demonstration of another task, shown to the agent as an example.)",
    );
    demo.tool = Some(DEMONSTRATION_NAME.to_string());
    let mut items = vec![
        demo,
        turn(2, Role::User, "Fix the float pixel data read in pydicom."),
    ];
    for i in 0..30 {
        items.push(turn(
            3 + i,
            Role::Assistant,
            &format!("looked at handler number {i} and found nothing relevant there"),
        ));
    }
    let content = summarize(&leaf(items, 200)).content;
    let asked = content
        .split("\n## ")
        .find(|s| s.starts_with("Task"))
        .unwrap_or("");
    assert!(asked.contains("pydicom"), "{content}");
    assert!(!content.contains("demonstration"), "{content}");
}

#[test]
fn tiny_source_gives_a_verbatim_excerpt_no_larger() {
    let text = "Fix the flaky test in src/lib.rs please, it fails on CI every time we run it.";
    let message = ChatMessage::text(Role::User, text);
    let mut item = item_of(1, &message);
    item.tokens = 10;
    let req = leaf(vec![item], 2400);
    let content = summarize(&req).content;
    assert!(tokens(&content) <= 10, "{content:?}");
    assert!(!content.is_empty());
    assert!(text.starts_with(&content), "{content:?}");
    // A source that fits its target whole is returned whole.
    let whole = leaf(vec![turn(1, Role::User, text)], 2400);
    assert_eq!(summarize(&whole).content, text);
}

#[test]
fn empty_sources_give_an_empty_summary() {
    assert_eq!(summarize(&leaf(Vec::new(), 2400)).content, "");
    let zero = leaf(vec![turn(1, Role::User, "")], 2400);
    assert_eq!(summarize(&zero).content, "");
    let mut no_target = leaf(vec![turn(1, Role::User, "some words here")], 0);
    no_target.sources[0].tokens = 5;
    // 12% of 5 tokens is 0 tokens.
    assert_eq!(summarize(&no_target).content, "");
}

#[test]
fn unicode_is_cut_on_char_boundaries() {
    let long = "日本語のテキスト 🚀 ünïcödé — ".repeat(40);
    let items: Vec<SourceItem> = (0..20)
        .map(|i| {
            turn(
                i + 1,
                if i % 2 == 0 {
                    Role::User
                } else {
                    Role::Assistant
                },
                &long,
            )
        })
        .collect();
    for target in [3, 17, 64, 300, 1000] {
        let req = leaf(items.clone(), target);
        let content = summarize(&req).content;
        assert!(tokens(&content) <= target, "{target}");
        // A String is valid UTF-8 by construction; check no replacement
        // characters were produced by byte slicing either.
        assert!(!content.contains('\u{FFFD}'));
    }
    let state = rolling_state(&RollingStateRequest {
        conversation: "c".to_string(),
        previous: None,
        sources: items,
    });
    for section in [
        &state.completed,
        &state.in_progress,
        &state.decisions,
        &state.blockers,
        &state.next,
    ] {
        assert!(section.chars().count() <= ROLLING_SECTION_MAX_CHARS);
    }
}

#[test]
fn condensed_merges_children() {
    let Some(items) = tau_bench_items(40_000) else {
        return;
    };
    let half = items.len() / 2;
    let first = summarize(&leaf(items[..half].to_vec(), 2400)).content;
    let second = summarize(&leaf(items[half..].to_vec(), 2400)).content;
    let child = |n: usize, content: &str| SourceItem {
        label: format!("summary sum_{n}"),
        role: None,
        tool: None,
        text: content.to_string(),
        tokens: tokens(content),
        time: n as u64,
        ..SourceItem::default()
    };
    let children = vec![child(1, &first), child(2, &first), child(3, &second)];
    let mut req = leaf(children, 0);
    req.kind = SummaryKind::Condensed;
    req.depth = 1;
    req.target_tokens = 2000;
    let content = summarize(&req).content;
    assert!(tokens(&content) <= 2000);
    assert!(
        content.starts_with("Condensed summary (depth 1)"),
        "{content}"
    );
    // A child given twice adds nothing twice.
    let asked: Vec<&str> = content
        .split("\n## ")
        .find(|s| s.starts_with("Task"))
        .unwrap_or("")
        .lines()
        .skip(1)
        .collect();
    let unique: HashSet<&str> = asked.iter().copied().collect();
    assert_eq!(unique.len(), asked.len(), "{content}");
    // With room, every identifier of every child is kept.
    req.target_tokens = 4400;
    let content = summarize(&req).content;
    let (kept, all) = retention(&content, &req.sources);
    assert_eq!(kept, all, "{content}");
}

#[test]
fn identifiers_the_user_named_or_the_work_repeated_are_kept_first() {
    // A listing of 300 files seen once, between a path the user named
    // and one the assistant came back to: not all fit, those two do.
    let listing: String = (0..300)
        .map(|i| format!("vendor/pkg{i:03}/generated/module_{i:03}_bindings.rs\n"))
        .collect();
    let sources = vec![
        turn(
            0,
            Role::User,
            "please fix crates/core/src/ledger.rs, it panics",
        ),
        turn(1, Role::Tool, &listing),
        turn(
            2,
            Role::Assistant,
            "reading crates/core/src/journal_index.rs",
        ),
        turn(3, Role::Tool, &listing.replace("vendor", "third_party")),
        turn(
            4,
            Role::Assistant,
            "patched crates/core/src/journal_index.rs",
        ),
    ];
    let content = summarize(&leaf(sources, 300)).content;
    assert!(tokens(&content) <= 300, "{content}");
    assert!(content.contains("crates/core/src/ledger.rs"), "{content}");
    assert!(
        content.contains("crates/core/src/journal_index.rs"),
        "{content}"
    );
}

#[test]
fn a_suffix_of_a_listed_path_is_not_listed_again() {
    let long = "/home/dev/work/project/packages/agent/src/session_store.ts";
    let mut sources = vec![turn(
        0,
        Role::User,
        &format!("look at {long} and session_store.ts and src/session_store.ts"),
    )];
    for i in 1..40 {
        sources.push(turn(i, Role::Tool, &"filler output line\n".repeat(60)));
    }
    let content = summarize(&leaf(sources, 400)).content;
    let listed: Vec<&str> = content
        .split("## Exact identifiers")
        .nth(1)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("session_store.ts"))
        .collect();
    assert!(content.contains(long), "{content}");
    assert!(listed.len() <= 1, "{listed:?}");
}

#[test]
fn identifier_policy_off_lists_none() {
    let Some(items) = tau_bench_items(20_000) else {
        return;
    };
    let mut req = leaf(items, 2400);
    req.identifier_policy = IdentifierPolicy::Off;
    let content = summarize(&req).content;
    assert!(!content.contains("## Exact identifiers"));
    assert!(tokens(&content) <= 2400);
}

#[test]
fn rolling_state_fits_its_limits() {
    let Some(items) = tau_bench_items(20_000) else {
        return;
    };
    let previous = RollingState {
        completed: "x".repeat(300),
        in_progress: "y".repeat(300),
        decisions: "z".repeat(300),
        blockers: "w".repeat(300),
        next: "v".repeat(300),
    };
    for prev in [None, Some(previous)] {
        let req = RollingStateRequest {
            conversation: "c".to_string(),
            previous: prev,
            sources: items.clone(),
        };
        let state = rolling_state(&req);
        let sections = [
            &state.completed,
            &state.in_progress,
            &state.decisions,
            &state.blockers,
            &state.next,
        ];
        let total: usize = sections.iter().map(|s| s.chars().count()).sum();
        assert!(total <= ROLLING_STATE_MAX_CHARS, "{total}: {state:?}");
        for s in sections {
            assert!(s.chars().count() <= ROLLING_SECTION_MAX_CHARS, "{s}");
        }
        assert!(!state.in_progress.is_empty());
        assert_eq!(state, rolling_state(&req), "deterministic");
    }
}

#[test]
fn rolling_state_reads_the_turns() {
    let mut items = vec![
        turn(1, Role::User, "Please book the flight HAT136 for me."),
        turn(
            2,
            Role::Assistant,
            "We decided to pay with the gift card because it covers the fare.",
        ),
        turn(3, Role::Tool, "Error: payment method not found"),
        turn(
            4,
            Role::Assistant,
            "Next I will retry with the credit card.",
        ),
    ];
    items[2].tool = Some("book_reservation".to_string());
    let state = rolling_state(&RollingStateRequest {
        conversation: "c".to_string(),
        previous: Some(RollingState {
            completed: "looked up user mia_li_3668".to_string(),
            ..RollingState::default()
        }),
        sources: items,
    });
    assert!(state.in_progress.contains("HAT136"), "{state:?}");
    assert!(state.decisions.contains("gift card"), "{state:?}");
    assert!(
        state.blockers.contains("payment method not found"),
        "{state:?}"
    );
    assert!(
        state.next.contains("retry with the credit card"),
        "{state:?}"
    );
    assert!(state.completed.contains("mia_li_3668"), "{state:?}");
}

#[test]
fn truncation_helpers_are_unicode_safe() {
    let s = "ab🚀cd日本語ef";
    for max in 0..12 {
        let t = truncate_chars(s, max);
        assert!(t.chars().count() <= max, "{max}: {t}");
    }
    for budget in 0..8 {
        let t = truncate_to_tokens(s, budget);
        assert!(tokens(&t) <= budget);
        assert!(s.starts_with(&t));
    }
    assert_eq!(condense("  a \n\t b  ", 10), "a b");
    assert!(condense(&"word ".repeat(100), 30).chars().count() <= 30);
    assert_eq!(prefix_bytes("日本語", 4), "日");
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Stopping at the n-th alphanumeric answers as counting them all.
        #[test]
        fn has_alphanumerics_is_a_count_that_stops(line in "[a-zé9 .:_\\-日]{0,40}", n in 0usize..20) {
            let all = line.chars().filter(|c| c.is_alphanumeric()).count();
            prop_assert_eq!(has_alphanumerics(&line, n), all >= n);
        }

        /// The runs' screen never turns away a string the text holds,
        /// whether the text was noted at once or piece by piece:
        /// overlapping strings, one inside another, empty and one-byte
        /// ones, text outside ASCII.
        #[test]
        fn trigrams_never_turn_away_what_the_text_holds(
            pieces in proptest::collection::vec("(src/|lib\\.rs|a|ab|b|é|日|/| |\n){0,8}", 0..6),
            wanted in proptest::collection::vec("(src/|lib\\.rs|a|b|é|日|/|\n){0,4}", 0..24),
        ) {
            let text = pieces.concat();
            let mut pushed = fit::Trigrams::of("");
            for piece in &pieces {
                pushed.push(piece);
            }
            for runs in [fit::Trigrams::of(&text), pushed] {
                for s in wanted.iter().filter(|s| text.contains(s.as_str())) {
                    prop_assert!(runs.may_hold(s), "{:?} in {:?}", s, text);
                }
            }
        }
    }

    /// The runs' screen turns away what the text lacks a run of: the name
    /// of a file beside a listed path, and a path beside a file's name it
    /// ends with.
    #[test]
    fn trigrams_turn_away_what_the_text_lacks_a_run_of() {
        let listed = fit::Trigrams::of("/repo/src/core/mod.rs\n");
        assert!(!listed.may_hold("main.rs"));
        assert!(listed.may_hold("mod.rs"));
        assert!(!fit::Trigrams::of("mod.rs").may_hold("/repo/src/core/mod.rs"));
    }

    fn role_strategy() -> impl Strategy<Value = Option<Role>> {
        prop_oneof![
            Just(Some(Role::User)),
            Just(Some(Role::Assistant)),
            Just(Some(Role::Tool)),
            Just(Some(Role::System)),
            Just(None),
        ]
    }

    fn item_strategy() -> impl Strategy<Value = SourceItem> {
        (
            role_strategy(),
            proptest::option::of("[a-z_]{1,8}"),
            "(\\PC|[ \n./:#-]|src/a\\.rs|E0308|##? [A-Za-z]+|TODO|because){0,60}",
            0u64..400,
        )
            .prop_map(|(role, tool, text, tokens)| SourceItem {
                label: "turn 1".to_string(),
                role,
                tool,
                text,
                tokens,
                time: 0,
                ..SourceItem::default()
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn bounded_and_deterministic(
            sources in proptest::collection::vec(item_strategy(), 0..12),
            target in 0u64..600,
            aggressive: bool,
            depth in 0u32..3,
        ) {
            let mut req = leaf(sources, target);
            req.aggressive = aggressive;
            req.depth = depth;
            if depth > 0 {
                req.kind = SummaryKind::Condensed;
            }
            let draft = summarize(&req);
            let size = tokens(&draft.content);
            prop_assert!(size <= req.source_tokens());
            let target = if target == 0 { req.source_tokens() * 12 / 100 } else { target };
            let cap = if aggressive { target / 2 } else { target };
            prop_assert!(size <= cap, "{} > {}", size, cap);
            prop_assert_eq!(&draft, &summarize(&req));
            let state = rolling_state(&RollingStateRequest {
                conversation: "c".to_string(),
                previous: None,
                sources: req.sources,
            });
            let sections = [&state.completed, &state.in_progress, &state.decisions, &state.blockers, &state.next];
            let total: usize = sections.iter().map(|s| s.chars().count()).sum();
            prop_assert!(total <= ROLLING_STATE_MAX_CHARS);
            prop_assert!(sections.iter().all(|s| s.chars().count() <= ROLLING_SECTION_MAX_CHARS));
        }
    }
}
