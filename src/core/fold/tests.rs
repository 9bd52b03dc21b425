use super::*;
use crate::core::message::ChatMessage;
use crate::core::message::{ContentPart, FunctionCall, ToolCall};
use crate::testing::fold_test::{jobs, sweep_ended as event};
use crate::testing::{turn, FoldTest};
use proptest::prelude::*;

use crate::testing::T0;

fn policy() -> PolicyConfig {
    PolicyConfig {
        default_context_window: 2_000,
        fresh_tail_count: 2,
        // Three of the tests' turns a chunk.
        leaf_chunk_tokens: 600,
        rolling_every_turns: 1_000_000,
        rolling_tool_loop: 1_000_000,
        rolling_threshold: 1.0,
        summary_max_calls_per_window: 5,
        summary_max_cost_micros_per_window: Some(1_000),
        ..PolicyConfig::default()
    }
}

fn ended(job: &JobIssued, committed: u32, stop: SweepStop) -> SweepEnded {
    SweepEnded {
        job_id: job.job_id.clone(),
        passes: committed.max(1),
        committed,
        stop,
        detail: None,
        calls: 1,
        tokens_spent: 100,
        cost_micros: 10,
        retry_after_ms: None,
    }
}

#[test]
fn a_turn_bigger_than_the_target_is_a_large_payload() {
    let p = policy(); // budget 2000, target 1000
    let mut t = FoldTest::new(p.clone());
    let big = Envelope::new(
        "big",
        "c",
        T0,
        EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
            Role::User,
            "a line of a long log\n".repeat(300),
        ))),
    );
    let then = t.when(&big).then_applied().then_decisions(&[]);
    let turn = &then.conversation("c").turns[0];
    assert!(turn.tokens > 1_000 && u64::from(turn.tokens) < p.large_payload_threshold_tokens);
    assert!(turn.large_payload, "{} tokens kept whole", turn.tokens);
    assert!(
        turn.context_tokens < 100,
        "a stub costs {} tokens",
        turn.context_tokens
    );
    let then = t.when(&turn_small("c", 1)).then_applied();
    assert!(!then.conversation("c").turns[1].large_payload);
}

fn turn_small(conv: &str, i: u64) -> Envelope {
    turn(conv, i, T0 + i)
}

#[test]
fn a_rate_limit_delays_the_next_job_even_after_progress() {
    let p = policy();
    let mut t = FoldTest::new(p);
    let (job, next) = t.until_job("c", 0, T0);
    assert_eq!(t.commit("c", &job, 1, job.issued_at + 5), 1);
    let mut s = ended(&job, 1, SweepStop::SpendLimit);
    s.retry_after_ms = Some(20_000);
    let out = t.fold(&event(s, "c", job.issued_at + 10));
    assert!(jobs(&out.decisions).is_empty());
    let conv = &t.state.conversations["c"];
    assert_eq!(conv.spend.retry_at, job.issued_at + 20_010);
    assert_eq!(conv.spend.backoff_until, 0, "progress: no backoff");
    // Turns before the delay get no job, however far over the threshold.
    for i in next..next + 10 {
        let out = t.fold(&turn("c", i, job.issued_at + 5_000 + i));
        assert!(jobs(&out.decisions).is_empty(), "job before Retry-After");
    }
    let out = t.fold(&turn("c", next + 10, job.issued_at + 20_011));
    assert_eq!(
        jobs(&out.decisions).len(),
        1,
        "the job comes back after the delay"
    );
}

#[test]
fn backoff_only_after_rounds_without_progress() {
    let p = policy();
    // (summaries the fold accepts, what the sweep claims, its stop)
    for (accepted, claimed, stop, backoff) in [
        (2, 2, SweepStop::Deadline, false),
        (1, 1, SweepStop::NoProgress, false),
        (0, 0, SweepStop::Deadline, true),
        (0, 0, SweepStop::Failed, true),
        (0, 0, SweepStop::Done, true),
        // A claim of work the fold never accepted is no progress.
        (0, 1, SweepStop::Done, true),
        (0, 3, SweepStop::IterationCap, true),
    ] {
        let mut t = FoldTest::new(p.clone());
        let (job, next) = t.until_job("c", 0, T0);
        let done = t.commit("c", &job, accepted, job.issued_at + 5);
        assert_eq!(done, accepted);
        let e = event(ended(&job, claimed, stop), "c", job.issued_at + 10);
        let out = t.fold(&e);
        let conv = &t.state.conversations["c"];
        let why = format!("{accepted} accepted, {claimed} claimed, {stop:?}");
        assert_eq!(conv.spend.backoff_until > 0, backoff, "{why}");
        assert_eq!(
            conv.spend.rounds_without_progress,
            u32::from(backoff),
            "{why}"
        );
        let history = &conv.history;
        let line = history
            .resident()
            .iter()
            .rfind(|h| h.event_type == "sweep_ended");
        let line = line.map(|h| h.detail.clone()).unwrap_or_default();
        assert!(line.contains(&format!("{accepted} committed")), "{line}");
        if backoff {
            // No job on its end, nor on the next turn: the backoff holds.
            assert!(jobs(&out.decisions).is_empty(), "{why}");
            let out = t.fold(&turn("c", next, job.issued_at + 20));
            assert!(jobs(&out.decisions).is_empty(), "{why}");
        }
    }
}

#[test]
fn a_leaf_that_skips_the_oldest_raw_turn_is_refused() {
    let p = policy();
    let mut t = FoldTest::new(p.clone());
    let (job, _) = t.until_job("c", 0, T0);
    // The worker's second pass, planned after a first pass that never
    // reached the fold (stale, or from an expired job's worker).
    let mut snap = crate::core::sweep::snapshot(&t.state.conversations["c"], &job, &p).unwrap();
    let first = snap.next_pass().expect("a first pass");
    let draft = crate::core::fallback_summary::summarize(&snap.request(first, false));
    let rec = snap.record(first, &draft);
    snap.apply(first, &rec);
    let second = snap.next_pass().expect("a second pass");
    let draft = crate::core::fallback_summary::summarize(&snap.request(second, false));
    let rec = snap.record(second, &draft);
    let e = crate::core::sweep::summary_event("c", job.issued_at + 1, rec);
    let then = t
        .when(&e)
        .then_rejected("summary_stale")
        .then_decisions(&["summary_rejected"]);
    let FoldStatus::Rejected(reason) = &then.outcome.status else {
        unreachable!("checked above");
    };
    assert!(
        matches!(
            reason,
            Rejection::Summary(SummaryRejection::NotOldestRaw { first: 3, oldest })
                if oldest == "0"
        ),
        "{reason}"
    );
    let conv = then.conversation("c");
    assert!(conv.summaries.is_empty());
    assert_eq!(conv.pending_job.as_ref().map(|j| j.committed), Some(0));
}

#[test]
fn an_expired_job_without_progress_backs_off_and_one_with_progress_does_not() {
    let p = policy();
    for progress in [false, true] {
        let mut t = FoldTest::new(p.clone());
        let (job, next) = t.until_job("c", 0, T0);
        if progress {
            assert_eq!(t.commit("c", &job, 1, job.issued_at + 1), 1);
        }
        // The worker vanished: a turn long after its deadline expires it.
        let late = job.issued_at + 2 * job.deadline_ms + 60_001;
        let out = t.fold(&turn("c", next, late));
        let conv = &t.state.conversations["c"];
        assert!(conv
            .history
            .resident()
            .iter()
            .any(|h| h.event_type == "job_expired"));
        if progress {
            assert_eq!(jobs(&out.decisions).len(), 1, "its successor at once");
            assert_eq!(conv.spend.rounds_without_progress, 0);
        } else {
            assert!(jobs(&out.decisions).is_empty(), "re-issued at once");
            assert_eq!(conv.spend.rounds_without_progress, 1);
            assert!(conv.spend.backoff_until > late);
            // Its sweep_ended, arriving after all, changes nothing more.
            let before = conv.spend.backoff_until;
            let e = event(ended(&job, 1, SweepStop::Done), "c", late + 1);
            let out = t.fold(&e);
            assert!(jobs(&out.decisions).is_empty());
            assert_eq!(t.state.conversations["c"].spend.backoff_until, before);
        }
    }
}

#[test]
fn a_failed_urgent_round_waits_for_its_backoff_or_a_new_request() {
    let p = policy();
    for asks_again in [false, true] {
        let mut t = FoldTest::new(p.clone());
        let (job, next) = t.until_job("c", 0, T0);
        let manual = |id: &str, time| {
            Envelope::new(
                id,
                "c",
                time,
                EventBody::CompactionRequested(CompactionRequested::default()),
            )
        };
        t.fold(&manual("m1", job.issued_at + 1));
        if let Some(pending) = &mut t.state.conversations.get_mut("c").unwrap().pending_job {
            pending.job.urgent = true;
        }
        let e = event(ended(&job, 0, SweepStop::Failed), "c", job.issued_at + 2);
        let out = t.fold(&e);
        assert!(jobs(&out.decisions).is_empty(), "retried on its own end");
        let until = t.state.conversations["c"].spend.backoff_until;
        assert_eq!(until, job.issued_at + 2 + p.no_progress_backoff_ms);
        // Neither an older job's late end nor a turn is a reason to retry
        // a round that failed: the backoff holds them.
        let stale = SweepEnded {
            job_id: "job_older".into(),
            ..ended(&job, 1, SweepStop::Done)
        };
        let out = t.fold(&event(stale, "c", job.issued_at + 3));
        assert!(
            jobs(&out.decisions).is_empty(),
            "issued on an old job's end"
        );
        let out = t.fold(&turn("c", next, job.issued_at + 4));
        assert!(jobs(&out.decisions).is_empty(), "issued in backoff");
        let out = if asks_again {
            // A new request is never held by the backoff.
            t.fold(&manual("m2", job.issued_at + 5))
        } else {
            // Time passing alone ends it: the conversation's timer.
            assert_eq!(t.state.clock.timer("c"), Some(until));
            wake(&mut t.state, &p, until, "tick")
        };
        let again = jobs(&out.decisions);
        assert_eq!(again.len(), 1, "asks again: {asks_again}");
        assert!(again[0].urgent);
    }
}

#[test]
fn backoffs_double_per_round_without_progress_and_reset_on_progress() {
    let p = policy();
    let mut t = FoldTest::new(p.clone());
    let (mut job, _) = t.until_job("c", 0, T0);
    let mut expected = p.no_progress_backoff_ms;
    for round in 1..=4u32 {
        let at = job.issued_at + 10;
        t.fold(&event(ended(&job, 0, SweepStop::Failed), "c", at));
        let spend = &t.state.conversations["c"].spend;
        assert_eq!(spend.rounds_without_progress, round);
        assert_eq!(spend.backoff_until, at + expected, "round {round}");
        let until = spend.backoff_until;
        let out = wake(&mut t.state, &p, until, &format!("tick{round}"));
        job = jobs(&out.decisions)
            .pop()
            .expect("a job at the backoff's end");
        expected = (expected * 2).min(p.summary_spend_backoff_ms);
    }
    assert_eq!(t.commit("c", &job, 1, job.issued_at + 1), 1);
    t.fold(&event(
        ended(&job, 1, SweepStop::Deadline),
        "c",
        job.issued_at + 2,
    ));
    assert_eq!(t.state.conversations["c"].spend.rounds_without_progress, 0);
}

#[test]
fn a_barren_sweep_is_not_retried_on_its_own_end() {
    let p = policy();
    let mut t = FoldTest::new(p);
    let (job, next) = t.until_job("c", 0, T0);
    let manual = Envelope::new(
        "m1",
        "c",
        job.issued_at + 1,
        EventBody::CompactionRequested(CompactionRequested::default()),
    );
    t.fold(&manual);
    let mut urgent = job.clone();
    urgent.urgent = true;
    if let Some(pending) = &mut t.state.conversations.get_mut("c").unwrap().pending_job {
        pending.job.urgent = true;
    }
    let e = event(ended(&urgent, 0, SweepStop::Failed), "c", job.issued_at + 2);
    let out = t.fold(&e);
    assert!(jobs(&out.decisions).is_empty(), "retried on its own end");
    let conv = &t.state.conversations["c"];
    assert!(
        conv.debt.as_ref().is_some_and(|d| d.urgent),
        "a failed urgent round keeps its debt"
    );
    let until = conv.spend.backoff_until;
    let out = t.fold(&turn("c", next, until));
    let again = jobs(&out.decisions);
    assert_eq!(again.len(), 1, "the first event after its backoff retries");
    assert!(again[0].urgent);
}

#[test]
fn a_debt_recorded_during_a_rolling_refresh_gets_its_job_when_it_ends() {
    let p = PolicyConfig {
        rolling_every_turns: 2,
        ..policy()
    };
    let mut t = FoldTest::new(p);
    let (rolling, mut next) = t.until_job("c", 0, T0);
    assert!(
        !rolling.compact && rolling.refresh_rolling_state,
        "{rolling:?}"
    );
    // Turns go on while it runs, until the threshold records a debt.
    let mut time = rolling.issued_at;
    while t.state.conversations["c"].debt.is_none() {
        time += 1_000;
        let out = t.fold(&turn("c", next, time));
        assert!(jobs(&out.decisions).is_empty(), "one job at a time");
        next += 1;
    }
    let state_of = |job: &JobIssued, time: u64| {
        Envelope::new(
            crate::core::derived_id::DerivedId::RollingState {
                job_id: &job.job_id,
            }
            .to_string(),
            "c",
            time,
            EventBody::RollingStateUpdated(RollingStateUpdated {
                state: RollingState::default(),
                through_turn: next - 1,
                job_id: Some(job.job_id.clone()),
            }),
        )
    };
    let refreshed = SweepEnded {
        passes: 0,
        ..ended(&rolling, 0, SweepStop::Done)
    };
    t.fold(&state_of(&rolling, time + 1));
    let out = t.fold(&event(refreshed, "c", time + 1));
    let issued = jobs(&out.decisions);
    assert_eq!(
        issued.len(),
        1,
        "the debt's job, without waiting for a turn"
    );
    assert!(issued[0].compact, "{:?}", issued[0]);
}

#[test]
fn a_rolling_refresh_that_wrote_nothing_is_no_progress() {
    let p = PolicyConfig {
        rolling_every_turns: 2,
        ..policy()
    };
    let mut t = FoldTest::new(p);
    let (rolling, next) = t.until_job("c", 0, T0);
    assert!(!rolling.compact && rolling.refresh_rolling_state);
    // Done, but no rolling state came (the call was refused): the same
    // job again at once would be refused the same way.
    let barren = SweepStop::Done;
    let out = t.fold(&event(
        ended(&rolling, 0, barren),
        "c",
        rolling.issued_at + 5,
    ));
    assert!(jobs(&out.decisions).is_empty(), "re-issued on its own end");
    let conv = &t.state.conversations["c"];
    assert!(conv.rolling_due && conv.spend.rounds_without_progress == 1);
    assert!(conv.spend.backoff_until > rolling.issued_at);
    let out = t.fold(&turn("c", next, rolling.issued_at + 10));
    assert!(jobs(&out.decisions).is_empty(), "issued in backoff");
}

#[test]
fn spend_counts_in_a_sliding_window_of_calls_tokens_and_money() {
    let p = policy();
    let mut t = FoldTest::new(p.clone());
    let (job, mut next) = t.until_job("c", 0, T0);
    assert_eq!(job.max_calls, Some(5));
    // A productive round that spent the whole money allowance.
    assert_eq!(t.commit("c", &job, 1, job.issued_at + 5), 1);
    let mut s = ended(&job, 1, SweepStop::Done);
    s.cost_micros = 1_000;
    t.fold(&event(s, "c", job.issued_at + 10));
    let window_end = job.issued_at + p.summary_call_window_ms;
    let mut at = job.issued_at + 1_000;
    while at < window_end {
        let out = t.fold(&turn("c", next, at));
        assert!(
            jobs(&out.decisions).is_empty(),
            "job with no money left at {at}"
        );
        next += 1;
        at += 30_000;
    }
    // The window slides past the spending job: compaction may resume.
    let out = t.fold(&turn("c", next, window_end));
    assert_eq!(jobs(&out.decisions).len(), 1);
    assert!(t.state.conversations["c"].spend.recent.is_empty(), "pruned");
}

#[test]
fn the_partition_window_reserves_and_shares_calls() {
    let p = PolicyConfig {
        summary_max_calls_per_window_global: Some(4),
        ..policy()
    };
    let mut t = FoldTest::new(p);
    let (a, _) = t.until_job("a", 0, T0);
    assert_eq!(a.max_calls, Some(4), "alone, a may use the whole window");
    // b asks while a's allowance is reserved: nothing is left for it.
    for i in 0..200 {
        let out = t.fold(&turn("b", i, T0 + 100_000 + i * 1_000));
        assert!(
            jobs(&out.decisions).is_empty(),
            "b was granted calls a holds"
        );
        if !t.state.spend.waiting.is_empty() {
            break;
        }
    }

    assert_eq!(t.state.spend.waiting.len(), 1, "b waits for a share");
    // a ends having spent 1 call: b gets its fair share, half of 4.
    t.fold(&event(ended(&a, 1, SweepStop::Done), "a", T0 + 400_000));
    let (b, _) = t.until_job("b", 500, T0 + 401_000);
    assert_eq!(b.max_calls, Some(2), "{b:?}");
    assert!(t.state.spend.waiting.is_empty(), "b no longer waits");
}

/// The digest as it was first written: build the strings, hash them.
fn reference(msg: &ChatMessage) -> (IdDigest, usize) {
    let normalized = normalize(&msg.searchable_text());
    let digest = id_digest(&format!(
        "{}\u{0}{}\u{0}{}",
        msg.role.as_str(),
        msg.tool_call_id.as_deref().unwrap_or(""),
        normalized
    ));
    (digest, normalized.chars().count())
}

/// Text with every kind of whitespace and case the normalizer treats
/// specially, long enough to cross its buffer.
fn text() -> impl Strategy<Value = String> {
    let pieces = prop::sample::select(vec![
        "a",
        "Z",
        "Hello",
        " ",
        "  ",
        "\t",
        "\n",
        "\r\n",
        "\u{0B}",
        "\u{0C}",
        "\u{85}",
        "\u{A0}",
        "\u{3000}",
        "\u{2028}",
        "İ",
        "Σ",
        "ẞ",
        "ǅ",
        "日本語",
        "é",
        "É",
        "🙂",
        "(",
        "{\"k\":1}",
        "x",
    ]);
    let prose = "[ -~]{0,40}|[ -~\t\n]{0,40}|[A-Za-z ]{0,40}";
    prop::collection::vec(prop_oneof![pieces.prop_map(String::from), prose], 0..40)
        .prop_map(|v| v.concat())
}

fn message() -> impl Strategy<Value = ChatMessage> {
    (
        0usize..4,
        prop::option::of(text()),
        prop::collection::vec(prop::option::of(text()), 0..4),
        any::<bool>(),
        prop::collection::vec((text(), text()), 0..3),
        prop::option::of("[a-z_0-9]{0,12}"),
    )
        .prop_map(|(role, plain, parts, use_parts, calls, call_id)| {
            let role = [Role::System, Role::User, Role::Assistant, Role::Tool][role];
            let content = if use_parts {
                Some(Content::Parts(
                    parts
                        .into_iter()
                        .map(|text| ContentPart {
                            kind: "text".into(),
                            text,
                            other: Default::default(),
                        })
                        .collect(),
                ))
            } else {
                plain.map(Content::Text)
            };
            ChatMessage {
                role,
                content,
                tool_calls: calls
                    .into_iter()
                    .enumerate()
                    .map(|(i, (name, arguments))| ToolCall {
                        id: format!("call_{i}"),
                        kind: "function".into(),
                        function: FunctionCall { name, arguments },
                    })
                    .collect(),
                tool_call_id: call_id,
                name: None,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// The streamed digest is byte for byte the digest of the built
    /// strings, so states folded before and after hash the same.
    #[test]
    fn streamed_turn_digest_is_the_reference_digest(msg in message()) {
        prop_assert_eq!(turn_digest(&msg), reference(&msg));
    }
}

/// Moving a turn into the state folds exactly as copying it.
#[test]
fn owned_and_borrowed_folds_agree() {
    let policy = PolicyConfig::default();
    let mut call = ChatMessage::text(Role::Assistant, "Reading it.");
    call.tool_calls = vec![ToolCall {
        id: "call_1".into(),
        kind: "function".into(),
        function: FunctionCall {
            name: "read_file".into(),
            arguments: r#"{"path":"src/main.rs"}"#.into(),
        },
    }];
    let mut result = ChatMessage::text(Role::Tool, "fn main() {}");
    result.tool_call_id = Some("call_1".into());
    let mut orphan = ChatMessage::text(Role::Tool, "nobody asked");
    orphan.tool_call_id = Some("call_9".into());
    let events: Vec<Envelope> = [
        ChatMessage::text(Role::User, "Where is the entry point of this crate?"),
        call,
        result,
        orphan,
        ChatMessage::text(Role::User, "Where is the entry point of this crate?"),
    ]
    .into_iter()
    .enumerate()
    .map(|(n, message)| {
        Envelope::new(
            format!("e{n}"),
            "c:owned",
            1_700_000_000_000 + n as u64 * 1000,
            EventBody::TurnAppended(TurnAppended::from(message)),
        )
    })
    .collect();
    let (mut borrowed, mut owned) = (State::default(), State::default());
    for e in events.iter().chain(&events) {
        let a = fold_counted(&mut borrowed, &policy, e, None);
        let b = fold_owned(&mut owned, &policy, e.clone(), None, None);
        assert_eq!(a, b);
    }
    assert_eq!(borrowed.hash(), owned.hash());
    assert_eq!(borrowed, owned);
    assert_eq!(borrowed.conversations["c:owned"].turns.len(), 4);
}

#[test]
fn streamed_turn_digest_crosses_its_buffer() {
    let long = "Word\tÉTÉ  \u{3000}İ ".repeat(3000);
    for role in [Role::User, Role::Tool] {
        let mut msg = ChatMessage::text(role, long.clone());
        msg.tool_call_id = Some("call_1".into());
        assert_eq!(turn_digest(&msg), reference(&msg));
    }
}

// ---- re-summarization of deterministic fallback summaries ----

use crate::core::sweep;

fn debts_recorded(decisions: &[Envelope]) -> Vec<DebtReason> {
    decisions
        .iter()
        .filter_map(|d| match &d.body {
            EventBody::DebtRecorded(debt) | EventBody::DebtUpdated(debt) => Some(debt.reason),
            _ => None,
        })
        .collect()
}

fn fallbacks_in_context(state: &State, conv: &str) -> Vec<Summary> {
    state.conversations[conv]
        .fallback_summaries_in_context()
        .cloned()
        .collect()
}

fn assert_accounting(conv: &Conversation) {
    let sum: u64 = conv.context.iter().map(|&i| conv.item_tokens(i)).sum();
    assert_eq!(
        conv.context.tokens(),
        sum,
        "context tokens are the items' sum"
    );
}

/// Turns and fallback-only jobs until fallback summaries are in context
/// and no job is pending; returns the next turn index.
fn with_fallbacks(t: &mut FoldTest, conv: &str) -> u64 {
    let (_, next) = t.until_job(conv, 0, T0);
    let decisions = t.run_job(conv, false);
    assert!(!fallbacks_in_context(&t.state, conv).is_empty());
    assert!(t.conversation(conv).pending_job.is_none());
    assert!(!debts_recorded(&decisions).contains(&DebtReason::Resummarize));
    next
}

/// Fallback summaries in context, then a compaction by a model, whose
/// summary owes their re-summarization: returns its job and the next turn
/// index.
fn with_resummarization_job(t: &mut FoldTest, conv: &str) -> (JobIssued, u64) {
    let next = with_fallbacks(t, conv);
    let (_, next) = t.until_job(conv, next, T0 + 1_000_000);
    let decisions = t.run_job(conv, true);
    let job = jobs(&decisions).pop().expect("a re-summarization job");
    assert_eq!(job.reason, DebtReason::Resummarize);
    (job, next)
}

#[test]
fn a_deterministic_only_deployment_never_owes_resummarization() {
    let p = policy();
    let mut t = FoldTest::new(p);
    let mut next = 0;
    let mut all = Vec::new();
    for round in 0..4 {
        let (_, n) = t.until_job("c", next, T0 + round * 1_000_000);
        all.extend(t.run_job("c", false));
        next = n;
    }
    assert!(!fallbacks_in_context(&t.state, "c").is_empty());
    assert!(
        t.state.conversations["c"].summaries.len() > 2,
        "several rounds"
    );
    assert!(!debts_recorded(&all).contains(&DebtReason::Resummarize));
    assert!(t.state.conversations["c"]
        .debt
        .as_ref()
        .is_none_or(|d| d.reason != DebtReason::Resummarize));
}

#[test]
fn a_model_summary_raises_resummarization_which_replaces_every_fallback() {
    let p = policy();
    let mut t = FoldTest::new(p);
    let next = with_fallbacks(&mut t, "c");
    let old = fallbacks_in_context(&t.state, "c");
    // The next compaction is done by a model: evidence it is back.
    let (_, _) = t.until_job("c", next, T0 + 1_000_000);
    let decisions = t.run_job("c", true);
    assert_eq!(
        debts_recorded(&decisions).last(),
        Some(&DebtReason::Resummarize)
    );
    // Not a compaction cycle: no memory flush for it.
    assert!(!decisions.iter().any(|d| matches!(
        &d.body,
        EventBody::MemoryFlushRequested(m) if m.reason == DebtReason::Resummarize
    )));
    let job = jobs(&decisions).pop().expect("a re-summarization job");
    assert_eq!(job.reason, DebtReason::Resummarize);
    assert!(!job.urgent, "routine: spend window and backoff apply");

    let decisions = t.run_job("c", true);
    assert!(fallbacks_in_context(&t.state, "c").is_empty());
    assert!(decisions.iter().any(|d| matches!(
        &d.body,
        EventBody::DebtCleared(c) if c.reason.contains("no deterministic fallback")
    )));
    let conv = &t.state.conversations["c"];
    assert!(conv.debt.is_none());
    assert_accounting(conv);
    for x in &old {
        // Lossless: the fallback stays in the DAG, out of context, and a
        // model summary over exactly its sources took its place.
        let k = conv.summary_index(&x.id).expect("kept in the DAG");
        assert!(!conv.context.contains(&ContextItem::Summary(k)));
        let new = conv
            .summaries
            .iter()
            .find(|s| s.supersedes.as_deref() == Some(x.id.as_str()))
            .expect("a replacement");
        assert!(!new.fallback);
        assert_eq!(
            (new.kind, new.depth, &new.covers),
            (x.kind, x.depth, &x.covers)
        );
        assert_eq!((new.first_turn, new.last_turn), (x.first_turn, x.last_turn));
        assert_eq!(new.source_tokens, x.source_tokens);
        let at = conv.summary_index(&new.id).expect("recorded");
        assert!(conv.context.contains(&ContextItem::Summary(at)));
    }
}

#[test]
fn a_resummarization_the_model_cannot_do_gives_up_until_a_newer_model_summary() {
    let p = policy();
    let mut t = FoldTest::new(p);
    let (_, next) = with_resummarization_job(&mut t, "c");
    let fallbacks = fallbacks_in_context(&t.state, "c");
    assert!(!fallbacks.is_empty());

    // The model fails every re-summary (rejected, or erring): a round
    // without progress backs off and tries again (a failure may pass),
    // until RESUMMARY_ROUNDS of them in a row end the debt.
    let mut decisions = t.run_job("c", false);
    for round in 2..=debt::RESUMMARY_ROUNDS {
        let conv = t.conversation("c");
        assert_eq!(
            conv.debt.as_ref().map(|d| d.reason),
            Some(DebtReason::Resummarize),
            "kept after {} rounds",
            round - 1
        );
        // The next event after the backoff issues the next round.
        let tick = Envelope::new(
            format!("tick-{round}"),
            "c",
            conv.spend.backoff_until + 1,
            EventBody::ModelDeclared(ModelDeclared {
                model: "gpt-4o".into(),
                context_window: None,
            }),
        );
        let job = jobs(&t.fold(&tick).decisions).pop().expect("another round");
        assert_eq!(job.reason, DebtReason::Resummarize);
        decisions = t.run_job("c", false);
    }
    assert!(
        decisions.iter().any(|d| matches!(
            &d.body,
            EventBody::DebtCleared(c) if c.reason.contains("re-summarization made no progress")
        )),
        "{decisions:?}"
    );
    let conv = t.conversation("c");
    assert!(conv.debt.is_none() && conv.pending_job.is_none());
    assert_eq!(fallbacks_in_context(&t.state, "c"), fallbacks, "they stay");

    // Nothing new to go on: later events, long after any backoff, owe no
    // re-summarization and issue no job (it used to come back for ever).
    let later = conv.spend.backoff_until + 100_000_000;
    for i in next..next + 2 {
        let out = t.fold(&turn("c", i, later + i));
        assert!(jobs(&out.decisions).is_empty(), "{:?}", out.decisions);
        assert!(!debts_recorded(&out.decisions).contains(&DebtReason::Resummarize));
    }
    assert!(t.conversation("c").debt.is_none());

    // A newer model summary is new evidence: re-summarization is owed again.
    let (_, _) = t.until_job("c", next + 2, later + 1_000);
    let decisions = t.run_job("c", true);
    assert_eq!(
        debts_recorded(&decisions).last(),
        Some(&DebtReason::Resummarize)
    );
}

/// A fallback leaf in context and a model leaf over the same turns.
fn resummary_of(state: &State, conv: &str) -> (Summary, SummaryRecorded) {
    let c = &state.conversations[conv];
    let x = c
        .fallback_summaries_in_context()
        .next()
        .expect("a fallback")
        .clone();
    let content = "Asked and done, as a model tells it.".to_string();
    let rec = SummaryRecorded {
        summary_id: summary_id(&c.key, x.kind, x.depth, &x.covers, &content, "model-v1"),
        job_id: None,
        kind: x.kind,
        depth: x.depth,
        covers: x.covers.clone(),
        content,
        source_tokens: x.source_tokens,
        tokens: 10,
        model: "test-model".into(),
        provider: "test".into(),
        prompt_version: "model-v1".into(),
        fallback: false,
        supersedes: Some(x.id.clone()),
    };
    (x, rec)
}

fn readdress(conv: &str, mut rec: SummaryRecorded) -> SummaryRecorded {
    rec.summary_id = summary_id(
        conv,
        rec.kind,
        rec.depth,
        &rec.covers,
        &rec.content,
        &rec.prompt_version,
    );
    rec
}

#[test]
fn a_resummary_is_accepted_in_the_place_of_its_fallback() {
    let p = policy();
    let mut t = FoldTest::new(p);
    with_fallbacks(&mut t, "c");
    let (x, rec) = resummary_of(&t.state, "c");
    let before = t.state.conversations["c"].clone();
    let pos = before
        .context
        .iter()
        .position(|&i| i == ContextItem::Summary(before.summary_index(&x.id).unwrap()))
        .unwrap();
    let out = t.fold(&sweep::summary_event("c", T0 + 9_000_000, rec.clone()));
    assert_eq!(out.status, FoldStatus::Applied);
    let conv = &t.state.conversations["c"];
    let k = conv.summary_index(&rec.summary_id).unwrap();
    assert_eq!(conv.context[pos], ContextItem::Summary(k), "same position");
    assert_eq!(conv.context.len(), before.context.len());
    assert_eq!(
        conv.context.tokens(),
        before.context.tokens() - x.tokens + conv.summaries[k as usize].tokens
    );
    assert_eq!(conv.context.bytes(), before.context.bytes());
    assert_accounting(conv);
    assert_eq!(
        conv.summaries[k as usize].supersedes.as_deref(),
        Some(x.id.as_str())
    );
    // Its sources' parents are the replacement from now on.
    assert!(conv.summary_index(&x.id).is_some());
}

#[test]
fn a_resummary_that_does_not_match_is_rejected_whole() {
    let p = policy();
    let mut t = FoldTest::new(p.clone());
    with_fallbacks(&mut t, "c");
    let (x, good) = resummary_of(&t.state, "c");
    let model_leaf = {
        // A model summary in context, to be wrongly "superseded".
        let mut s2 = t.state.clone();
        fold(
            &mut s2,
            &p,
            &sweep::summary_event("c", T0 + 9_000_000, good.clone()),
        );
        s2
    };
    let Covers::Turns { first, last } = x.covers else {
        panic!("a leaf")
    };
    let cases: Vec<(&str, State, SummaryRecorded)> = vec![
        (
            "unknown summary",
            t.state.clone(),
            readdress(
                "c",
                SummaryRecorded {
                    supersedes: Some("sum_nope".into()),
                    ..good.clone()
                },
            ),
        ),
        (
            "fallback summary cannot supersede",
            t.state.clone(),
            readdress(
                "c",
                SummaryRecorded {
                    fallback: true,
                    ..good.clone()
                },
            ),
        ),
        (
            "must match",
            t.state.clone(),
            readdress(
                "c",
                SummaryRecorded {
                    covers: Covers::Turns {
                        first,
                        last: last + 1,
                    },
                    ..good.clone()
                },
            ),
        ),
        (
            "must match",
            t.state.clone(),
            readdress(
                "c",
                SummaryRecorded {
                    kind: SummaryKind::Condensed,
                    depth: 1,
                    ..good.clone()
                },
            ),
        ),
        (
            "content address",
            t.state.clone(),
            SummaryRecorded {
                content: "tampered".into(),
                ..good.clone()
            },
        ),
        (
            // The fallback was already replaced: stale.
            "no longer in context",
            model_leaf.clone(),
            readdress(
                "c",
                SummaryRecorded {
                    content: "another model's take".into(),
                    ..good.clone()
                },
            ),
        ),
        (
            "not a deterministic fallback",
            model_leaf,
            readdress(
                "c",
                SummaryRecorded {
                    supersedes: Some(good.summary_id.clone()),
                    content: "a model over a model".into(),
                    ..good
                },
            ),
        ),
    ];
    for (why, mut st, rec) in cases {
        let before = st.conversations["c"].clone();
        let out = fold(&mut st, &p, &sweep::summary_event("c", T0 + 9_100_000, rec));
        let FoldStatus::Rejected(reason) = &out.status else {
            panic!("{why}: accepted");
        };
        let reason = reason.to_string();
        assert!(reason.contains(why), "{why}: {reason}");
        assert!(out
            .decisions
            .iter()
            .any(|d| matches!(&d.body, EventBody::SummaryRejected(r) if r.reason == reason)));
        let conv = &st.conversations["c"];
        assert_eq!(conv.context, before.context, "{why}: nothing applied");
        assert_eq!(conv.context.tokens(), before.context.tokens());
        assert_eq!(conv.summaries.len(), before.summaries.len());
    }
}

#[test]
fn a_condensed_summary_of_depth_zero_is_rejected() {
    // Its children's expected depth was depth - 1: an overflow.
    let p = policy();
    let mut t = FoldTest::new(p);
    with_fallbacks(&mut t, "c");
    let mut ids: Vec<String> = t.state.conversations["c"]
        .summaries
        .iter()
        .map(|s| s.id.clone())
        .collect();
    ids.extend(ids.clone());
    let (_, leaf) = resummary_of(&t.state, "c");
    let rec = readdress(
        "c",
        SummaryRecorded {
            kind: SummaryKind::Condensed,
            depth: 0,
            covers: Covers::Summaries { ids },
            supersedes: None,
            ..leaf
        },
    );
    let out = t.fold(&sweep::summary_event("c", T0 + 9_100_000, rec));
    let FoldStatus::Rejected(reason) = &out.status else {
        panic!("accepted: {:?}", out.decisions);
    };
    assert_eq!(
        *reason,
        Rejection::Summary(SummaryRejection::CondensedDepth),
        "{reason}"
    );
}

#[test]
fn a_threshold_trigger_takes_over_a_pending_resummarization() {
    let p = policy();
    let mut t = FoldTest::new(p);
    let (job, next) = with_resummarization_job(&mut t, "c");
    let cycle = t.state.conversations["c"].cycle;
    // Turns arrive while it runs (before it could expire), until
    // compaction is owed again.
    let mut taken = Vec::new();
    for i in next..next + 40 {
        let out = t.fold(&turn("c", i, job.issued_at + 1_000 + i));
        taken.extend(out.decisions);
        if debts_recorded(&taken).contains(&DebtReason::Threshold) {
            break;
        }
    }
    assert_eq!(debts_recorded(&taken), vec![DebtReason::Threshold]);
    let conv = &t.state.conversations["c"];
    let debt = conv.debt.as_ref().expect("one debt");
    assert_eq!(debt.reason, DebtReason::Threshold);
    assert_eq!(conv.cycle, cycle + 1, "compaction starts a cycle");
    assert!(taken
        .iter()
        .any(|d| matches!(&d.body, EventBody::MemoryFlushRequested(m) if m.reason == DebtReason::Threshold)));
    // The re-summarization job fails; its end issues nothing, and the
    // next turn gets the compaction job.
    let failed = SweepEnded {
        committed: 0,
        stop: SweepStop::NoProgress,
        ..ended(&job, 0, SweepStop::NoProgress)
    };
    let out = t.fold(&event(failed, "c", job.issued_at + 100_000));
    assert!(jobs(&out.decisions).is_empty());
    assert_eq!(
        t.state.conversations["c"].debt.as_ref().map(|d| d.reason),
        Some(DebtReason::Threshold)
    );
}

#[test]
fn a_trigger_with_nothing_to_compact_leaves_a_resummarization_alone() {
    // A backoff long enough to outlast the turns below.
    let p = PolicyConfig {
        no_progress_backoff_ms: 1_800_000,
        ..policy()
    };
    let mut t = FoldTest::new(p.clone());
    let (job, next) = with_resummarization_job(&mut t, "c");
    // Its worker vanished: the job expires before its end arrives (a
    // round without progress, backoff; the debt stays).
    let failed = ended(&job, 0, SweepStop::NoProgress);
    t.fold(&event(failed, "c", T0 + 2_000_000));
    // Everything raw is fresh tail and nothing condenses: over the
    // threshold, a trigger has no compaction work. It must neither take
    // the debt over nor let it be cleared and raised again every turn.
    let q = PolicyConfig {
        fresh_tail_count: 10_000,
        // Capped at the budget: the tail holds every raw turn in context.
        fresh_tail_max_tokens: Some(u64::MAX),
        leaf_fanout: 10_000,
        condensed_fanout: 10_000,
        ..p
    };
    let mut all = Vec::new();
    let mut i = next;
    while {
        let conv = &t.state.conversations["c"];
        conv.context.tokens() <= policy::levels(conv, &q).threshold_tokens
    } {
        let out = fold(&mut t.state, &q, &turn("c", i, T0 + 2_100_000 + i * 1_000));
        all.extend(out.decisions);
        i += 1;
    }
    // Events that change nothing, over the threshold: no flapping.
    for k in 0..5 {
        let declared = Envelope::new(
            format!("model-{k}"),
            "c",
            T0 + 2_900_000 + k,
            EventBody::ModelDeclared(ModelDeclared {
                model: "gpt-4o".into(),
                context_window: None,
            }),
        );
        all.extend(fold(&mut t.state, &q, &declared).decisions);
    }
    let conv = &t.state.conversations["c"];
    assert!(conv.context.tokens() > policy::levels(conv, &q).threshold_tokens);
    assert!(
        !all.iter().any(|d| matches!(
            d.body,
            EventBody::DebtRecorded(_) | EventBody::DebtUpdated(_) | EventBody::DebtCleared(_)
        )),
        "{all:?}"
    );
    assert_eq!(
        conv.debt.as_ref().map(|d| d.reason),
        Some(DebtReason::Resummarize)
    );
    assert!(jobs(&all).is_empty(), "in backoff");
}

#[test]
fn a_backfilled_session_is_scheduled_by_the_log_not_by_its_timestamps() {
    // Turns a day apart by their own clock, stored within one second.
    let p = policy();
    let day = 86_400_000;
    let stored = T0 + 30 * day;
    let mut t = FoldTest::new(p.clone());
    let mut issued = None;
    for i in 0..40u64 {
        let out = t.fold_at(&turn("c", i, T0 + i * day), stored + i);
        if let Some(j) = jobs(&out.decisions).pop() {
            issued.get_or_insert(j);
        }
        let conv = &t.state.conversations["c"];
        assert!(
            !conv
                .history
                .resident()
                .iter()
                .any(|h| h.event_type == "job_expired"),
            "turn {i}: a job expired while the backfill was arriving"
        );
    }
    let job = issued.expect("a job during the backfill");
    assert!(
        job.issued_at >= stored && job.issued_at < stored + 40,
        "{}",
        job.issued_at
    );
    assert_eq!(t.state.clock.now, stored + 39);
    // The same turns folded at their own times expire the job at once.
    let mut by_event_time = State::default();
    for i in 0..40u64 {
        fold(&mut by_event_time, &p, &turn("c", i, T0 + i * day));
    }
    assert!(by_event_time.conversations["c"]
        .history
        .resident()
        .iter()
        .any(|h| h.event_type == "job_expired"));
}

#[test]
fn a_job_expires_twice_its_deadline_after_its_decision_came_back() {
    let p = policy();
    let mut t = FoldTest::new(p.clone());
    let mut decided = None;
    let mut i = 0;
    while decided.is_none() {
        let out = t.fold_at(&turn("c", i, T0 + i), T0 + i);
        decided = out
            .decisions
            .into_iter()
            .find(|d| matches!(d.body, EventBody::JobIssued(_)));
        i += 1;
    }
    let decision = decided.unwrap();
    let EventBody::JobIssued(job) = &decision.body else {
        unreachable!()
    };
    // Its copy reaches the log (and the fold) a minute later.
    let left = job.issued_at + 60_000;
    assert_eq!(t.fold_at(&decision, left).status, FoldStatus::Duplicate);
    let pending = t.state.conversations["c"].pending_job.clone().unwrap();
    assert_eq!(pending.left_at, Some(left));
    let expiry = left + 2 * job.deadline_ms + schedule::JOB_GRACE_MS;
    assert_eq!(t.state.clock.timer("c"), Some(expiry));
    // A second copy changes nothing.
    t.fold_at(&decision, left + 5);
    assert_eq!(
        t.state.conversations["c"]
            .pending_job
            .as_ref()
            .unwrap()
            .left_at,
        Some(left)
    );
    // Not expired a moment before; expired at its time, by the clock alone.
    assert!(wake(&mut t.state, &p, expiry - 1, "tick1").woken.is_empty());
    let out = wake(&mut t.state, &p, expiry, "tick2");
    assert_eq!(out.woken, ["c"]);
    assert!(out
        .notes
        .iter()
        .any(|n| matches!(n, ScheduleNote::JobExpired { job_id, .. } if job_id == &job.job_id)));
    let conv = &t.state.conversations["c"];
    assert!(conv.pending_job.is_none());
    assert_eq!(t.state.clock.timer("c"), Some(conv.spend.backoff_until));
}

#[test]
fn any_record_moves_the_partition_clock_and_wakes_who_is_due() {
    let p = policy();
    let mut t = FoldTest::new(p);
    let (job, _) = t.until_job("a", 0, T0);
    t.fold(&event(
        ended(&job, 0, SweepStop::Failed),
        "a",
        job.issued_at + 1,
    ));
    let until = t.state.conversations["a"].spend.backoff_until;
    // Another conversation's turn, stored after `a`'s backoff ends, wakes
    // `a` first and issues its job: no event of `a` is needed.
    let out = t.fold_at(&turn("b", 0, T0), until);
    assert_eq!(out.woken, ["a"]);
    let issued = jobs(&out.decisions);
    assert_eq!(issued.len(), 1);
    assert!(out.issued.iter().any(|(c, _)| c == "a"));
    assert!(out
        .decisions
        .iter()
        .all(|d| d.conversation == "a" || d.conversation == "b"));
    // The clock never goes back: an older record does not rewind it.
    t.fold_at(&turn("b", 1, T0), until - 5_000);
    assert_eq!(t.state.clock.now, until);
}

#[test]
fn a_job_end_wakes_the_conversations_waiting_for_the_partition() {
    let p = PolicyConfig {
        summary_max_calls_per_window_global: Some(5),
        ..policy()
    };
    let mut t = FoldTest::new(p.clone());
    let (job_a, _) = t.until_job("a", 0, T0);
    // `a` holds the whole partition allowance while its job runs: `b`
    // waits for the partition.
    let mut i = 0;
    while t
        .state
        .conversations
        .get("b")
        .is_none_or(|b| b.debt.is_none())
    {
        t.fold(&turn("b", i, job_a.issued_at + 10 + i));
        i += 1;
    }
    assert!(t.state.conversations["b"].pending_job.is_none());
    assert_eq!(
        t.state.conversations["b"].spend.holding,
        Some(Wait::PartitionWindow)
    );
    let b_wait = t.state.clock.timer("b").expect("b waits with an end");
    let end = job_a.issued_at + 100;
    assert!(b_wait > end);
    let mut done = ended(&job_a, 0, SweepStop::Done);
    done.calls = 1;
    t.fold(&event(done, "a", end));
    assert_eq!(
        t.state.clock.timer("b"),
        Some(end),
        "b looked at again at once"
    );
    let out = wake(&mut t.state, &p, end, "tick");
    assert!(out.issued.iter().any(|(c, _)| c == "b"), "{out:?}");
}

#[test]
fn a_flood_is_refused_over_the_quota_with_one_record_and_admitted_again_as_the_rate_falls() {
    let p = PolicyConfig {
        intake_events_per_second: Some(10),
        intake_burst_events: 50,
        ..policy()
    };
    let mut t = FoldTest::new(p.clone());
    let flood: Vec<Envelope> = (0..200)
        .map(|i| {
            Envelope::new(
                format!("flood-{i}"),
                "c",
                T0,
                EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
                    Role::User,
                    format!("message {i}"),
                ))),
            )
        })
        .collect();
    let mut statuses = Vec::new();
    let mut records = 0;
    // 200 events stored within 100 ms: the burst of 50 (100 ms refill
    // less than one more at 10/s).
    for (i, e) in flood.iter().enumerate() {
        let out = t.fold_at(e, T0 + i as u64 / 2);
        records += out
            .decisions
            .iter()
            .filter(|d| matches!(d.body, EventBody::EventRejected(_)))
            .count();
        statuses.push(out.status);
    }
    let admitted = statuses
        .iter()
        .filter(|s| **s == FoldStatus::Applied)
        .count();
    let throttled = statuses
        .iter()
        .filter(|s| **s == FoldStatus::Throttled)
        .count();
    assert_eq!(admitted, 50, "the burst");
    assert_eq!(records, 1, "one record for the episode, not one per event");
    assert_eq!(throttled, 200 - 50 - 1);
    let conv = &t.state.conversations["c"];
    assert_eq!(conv.quota.refused, 150);
    assert_eq!(conv.turns.len(), 50);
    // A refused id is consumed: the same event later changes nothing.
    let again = t.fold_at(&flood[199], T0 + 60_000);
    assert_eq!(again.status, FoldStatus::Duplicate);
    // A second later, the rate lets the agent in again.
    let next = Envelope::new(
        "after",
        "c",
        T0 + 2_000,
        EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(Role::User, "back"))),
    );
    assert_eq!(t.fold_at(&next, T0 + 2_000).status, FoldStatus::Applied);
    assert!(!t.state.conversations["c"].quota.refusing);
    // Replaying gives the same admissions (the buckets run on stored time).
    let mut replay = FoldTest::new(p);
    for (i, e) in flood.iter().enumerate() {
        replay.fold_at(e, T0 + i as u64 / 2);
    }
    replay.fold_at(&flood[199], T0 + 60_000);
    replay.fold_at(&next, T0 + 2_000);
    assert_eq!(replay.state.hash(), t.state.hash());
}

/// A flood spread over many conversations, each within its own quota, is
/// held to the partition's (one tenant prefix's `serve` holds every
/// partition): one record per conversation refused, counted, admitted
/// again as the rate falls; a conversation refused on its own quota takes
/// nothing from the others' share; and a state without a partition quota
/// hashes as it did before the quota existed.
#[test]
fn a_flood_over_many_conversations_is_held_to_the_partitions_quota() {
    let p = PolicyConfig {
        intake_events_per_second: Some(10),
        intake_burst_events: 50,
        intake_partition_events_per_second: Some(20),
        intake_partition_burst_events: Some(100),
        ..policy()
    };
    let turn = |conv: &str, i: usize| {
        Envelope::new(
            format!("{conv}-{i}"),
            conv,
            T0,
            EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
                Role::User,
                format!("message {i}"),
            ))),
        )
    };
    let mut t = FoldTest::new(p.clone());
    // One conversation over its own quota first: 80 events, 50 admitted,
    // 30 refused without touching the partition's bucket beyond the 50.
    for i in 0..80 {
        t.fold_at(&turn("hog", i), T0);
    }
    assert_eq!(t.state.conversations["hog"].turns.len(), 50);
    assert_eq!(t.state.intake.refused, 0, "the hog's own refusals");
    // Twenty more conversations, 10 events each, all at once: 50 left in
    // the partition's burst.
    let mut records = 0;
    let mut admitted = 0;
    for c in 0..20 {
        let conv = format!("agent-{c}");
        for i in 0..10 {
            let out = t.fold_at(&turn(&conv, i), T0 + 1);
            admitted += usize::from(out.status == FoldStatus::Applied);
            records += out
                .decisions
                .iter()
                .filter(|d| match &d.body {
                    EventBody::EventRejected(r) => r.reason.contains("partition's"),
                    _ => false,
                })
                .count();
        }
    }
    assert_eq!(admitted, 50, "the partition's burst left after the hog");
    assert_eq!(t.state.intake.refused, 150);
    assert_eq!(records, 15, "one record for each conversation refused");
    let refused: u64 = (0..20)
        .map(|c| {
            t.state.conversations[format!("agent-{c}").as_str()]
                .quota
                .refused
        })
        .sum();
    assert_eq!(refused, 150, "counted in each conversation's status");
    // Ten seconds later the partition's rate lets them in again.
    let later = t.fold_at(&turn("agent-19", 99), T0 + 10_000);
    assert_eq!(later.status, FoldStatus::Applied);
    // Replay gives the same state; without a partition quota the state
    // keeps no partition bucket and hashes as before it existed.
    let mut without = FoldTest::new(PolicyConfig {
        intake_partition_events_per_second: None,
        intake_partition_burst_events: None,
        ..p
    });
    without.fold_at(&turn("hog", 0), T0);
    assert_eq!(without.state.intake, IntakeQuota::default());
}

#[test]
fn a_tenant_limit_holds_its_conversations_and_leaves_other_tenants_their_jobs() {
    let p = PolicyConfig {
        summary_max_calls_per_window_tenant: Some(5),
        ..policy()
    };
    let mut t = FoldTest::new(p.clone());
    // `acme/a`'s job holds all of acme's calls while it runs; another
    // tenant's conversation gets its job all the same.
    let (job_a, _) = t.until_job("acme/a", 0, T0);
    assert_eq!(job_a.max_calls, Some(5));
    let (job_g, _) = t.until_job("globex/a", 0, t.state.clock.now + 10);
    assert_eq!(job_g.max_calls, Some(5));
    let mut i = 0;
    let from = t.state.clock.now + 10;
    while t
        .state
        .conversations
        .get("acme/b")
        .is_none_or(|b| b.debt.is_none())
    {
        t.fold(&turn("acme/b", i, from + i));
        i += 1;
    }
    assert!(t.state.conversations["acme/b"].pending_job.is_none());
    assert_eq!(
        t.state.conversations["acme/b"].spend.holding,
        Some(Wait::TenantWindow)
    );
    let waits_until = t.state.clock.timer("acme/b").expect("a wait with an end");
    // acme's job ends having spent 1 call: acme/b is looked at at once and
    // gets the 4 left.
    let end = t.state.clock.now + 100;
    assert!(waits_until > end);
    let mut done = ended(&job_a, 0, SweepStop::Done);
    done.calls = 1;
    t.fold(&event(done, "acme/a", end));
    assert_eq!(t.state.clock.timer("acme/b"), Some(end));
    let out = wake(&mut t.state, &p, end, "tick");
    let job_b = out
        .decisions
        .iter()
        .find_map(|d| match &d.body {
            EventBody::JobIssued(j) if d.conversation == "acme/b" => Some(j),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{out:?}"));
    assert_eq!(job_b.max_calls, Some(4));
}
