//! The scheduler, table-tested: each row is a conversation's situation at
//! one instant and what the scheduler must answer.

use super::*;
use crate::core::event::{Debt, JobIssued};
use crate::core::spend::SpendEntry;

const NOW: u64 = 1_700_000_000_000;

fn policy() -> PolicyConfig {
    PolicyConfig {
        summary_max_calls_per_window: 4,
        summary_max_urgent_calls_per_window: Some(2),
        summary_call_window_ms: 600_000,
        ..PolicyConfig::default()
    }
}

fn debt(urgent: bool) -> Debt {
    Debt {
        reason: if urgent {
            DebtReason::Manual
        } else {
            DebtReason::Threshold
        },
        context_tokens: 100_000,
        threshold_tokens: 96_000,
        target_tokens: 64_000,
        urgent,
        since: NOW - 1_000,
        instructions: None,
    }
}

fn spent(time: u64, calls: u32, urgent: bool, conversation: &str) -> SpendEntry {
    SpendEntry {
        time,
        job_id: format!("job_{time}_{calls}"),
        conversation: conversation.into(),
        calls,
        tokens: 0,
        cost_micros: 0,
        reserved_until: None,
        urgent,
    }
}

fn job(issued_at: u64) -> JobIssued {
    JobIssued {
        job_id: "job_c_0".into(),
        reason: DebtReason::Threshold,
        urgent: false,
        context_tokens: 100_000,
        target_tokens: 64_000,
        deadline_ms: 120_000,
        issued_at,
        instructions: None,
        compact: true,
        refresh_rolling_state: false,
        max_calls: Some(4),
        max_tokens: None,
    }
}

/// One situation: the conversation, its partition's window, the policy.
struct Case {
    name: &'static str,
    conv: Conversation,
    partition: SpendWindow,
    policy: PolicyConfig,
    expect: Schedule,
}

fn conv(debt: Option<Debt>) -> Conversation {
    let mut c = Conversation::new("c");
    c.debt = debt;
    c
}

fn grant(urgent: bool, max_calls: u32) -> Schedule {
    let d = debt(urgent);
    Schedule::Issue(Grant {
        compact: true,
        urgent,
        reason: d.reason,
        target_tokens: d.target_tokens,
        instructions: None,
        max_calls,
        max_tokens: None,
    })
}

fn cases() -> Vec<Case> {
    let window = policy().summary_call_window_ms;
    let mut out = Vec::new();
    let mut add = |name, conv, partition, policy, expect| {
        out.push(Case {
            name,
            conv,
            partition,
            policy,
            expect,
        })
    };
    add(
        "nothing owed",
        conv(None),
        SpendWindow::default(),
        policy(),
        Schedule::Idle,
    );
    let mut rolling = conv(None);
    rolling.rolling_due = true;
    add(
        "a rolling state due is routine work",
        rolling,
        SpendWindow::default(),
        policy(),
        Schedule::Issue(Grant {
            compact: false,
            urgent: false,
            reason: DebtReason::Threshold,
            target_tokens: 64_000,
            instructions: None,
            max_calls: 4,
            max_tokens: None,
        }),
    );
    add(
        "a routine debt gets its calls",
        conv(Some(debt(false))),
        SpendWindow::default(),
        policy(),
        grant(false, 4),
    );
    add(
        "an urgent debt gets the urgent cap",
        conv(Some(debt(true))),
        SpendWindow::default(),
        policy(),
        grant(true, 2),
    );
    let mut running = conv(Some(debt(false)));
    running.pending_job = Some(PendingJob::new(job(NOW - 10_000)));
    add(
        "a job out expires twice its deadline and a grace after it was issued",
        running,
        SpendWindow::default(),
        policy(),
        Schedule::Running {
            expires_at: NOW - 10_000 + 240_000 + JOB_GRACE_MS,
        },
    );
    let mut left = conv(Some(debt(false)));
    let mut pending = PendingJob::new(job(NOW - 1_000_000));
    pending.left_at = Some(NOW - 5_000);
    left.pending_job = Some(pending);
    add(
        "... or after it left, once its decision came back from the log",
        left,
        SpendWindow::default(),
        policy(),
        Schedule::Running {
            expires_at: NOW - 5_000 + 240_000 + JOB_GRACE_MS,
        },
    );
    let mut expired = conv(Some(debt(false)));
    expired.pending_job = Some(PendingJob::new(job(NOW - 240_000 - JOB_GRACE_MS)));
    add(
        "a job past its expiry",
        expired,
        SpendWindow::default(),
        policy(),
        Schedule::Expired,
    );
    let mut retry = conv(Some(debt(true)));
    retry.spend.retry_at = NOW + 30_000;
    retry.spend.backoff_until = NOW + 60_000;
    add(
        "a Retry-After holds even urgent work, before anything else",
        retry,
        SpendWindow::default(),
        policy(),
        Schedule::Wait {
            on: Wait::RetryAfter,
            until: NOW + 30_000,
        },
    );
    for urgent in [false, true] {
        let mut backoff = conv(Some(debt(urgent)));
        backoff.spend.backoff_until = NOW + 60_000;
        add(
            "a backoff holds routine and urgent work until its end",
            backoff,
            SpendWindow::default(),
            policy(),
            Schedule::Wait {
                on: Wait::Backoff,
                until: NOW + 60_000,
            },
        );
    }
    let mut used = conv(Some(debt(false)));
    used.spend.recent = vec![
        spent(NOW - 500_000, 3, false, ""),
        spent(NOW - 100_000, 1, false, ""),
    ];
    add(
        "a used-up window holds routine work until its oldest spend leaves",
        used,
        SpendWindow::default(),
        policy(),
        Schedule::Wait {
            on: Wait::SpendWindow,
            until: NOW - 500_000 + window,
        },
    );
    let mut preempt = conv(Some(debt(true)));
    preempt.spend.recent = vec![spent(NOW - 500_000, 4, false, "")];
    add(
        "urgent work pre-empts a used-up routine window",
        preempt,
        SpendWindow::default(),
        policy(),
        grant(true, 2),
    );
    let mut capped = conv(Some(debt(true)));
    capped.spend.recent = vec![spent(NOW - 400_000, 2, true, "")];
    add(
        "urgent work is held to its own cap",
        capped,
        SpendWindow::default(),
        policy(),
        Schedule::Wait {
            on: Wait::UrgentSpendWindow,
            until: NOW - 400_000 + window,
        },
    );
    let mut after_urgent = conv(Some(debt(false)));
    after_urgent.spend.recent = vec![spent(NOW - 300_000, 2, true, "")];
    add(
        "urgent calls take routine room",
        after_urgent,
        SpendWindow::default(),
        policy(),
        grant(false, 2),
    );
    let global = PolicyConfig {
        summary_max_calls_per_window_global: Some(6),
        ..policy()
    };
    let partition = SpendWindow {
        recent: vec![spent(NOW - 200_000, 6, false, "other")],
        ..SpendWindow::default()
    };
    add(
        "the partition's window holds a conversation its own would let go",
        conv(Some(debt(false))),
        partition.clone(),
        global.clone(),
        Schedule::Wait {
            on: Wait::PartitionWindow,
            until: NOW - 200_000 + window,
        },
    );
    add(
        "... urgent work too",
        conv(Some(debt(true))),
        partition,
        global.clone(),
        Schedule::Wait {
            on: Wait::PartitionWindow,
            until: NOW - 200_000 + window,
        },
    );
    let share = SpendWindow {
        recent: vec![
            spent(NOW - 200_000, 3, false, "c"),
            spent(NOW - 100_000, 1, false, "other"),
        ],
        ..SpendWindow::default()
    };
    let mut fair = conv(Some(debt(true)));
    fair.spend.recent = vec![spent(NOW - 200_000, 3, false, "")];
    add(
        "a conversation past its fair share waits, urgently or not",
        fair,
        share,
        global,
        Schedule::Wait {
            on: Wait::PartitionWindow,
            until: NOW - 200_000 + window,
        },
    );
    add(
        "a limit of zero never reopens",
        conv(Some(debt(false))),
        SpendWindow::default(),
        PolicyConfig {
            summary_max_calls_per_window: 0,
            ..policy()
        },
        Schedule::Blocked(Blocked::ZeroSpendLimit),
    );
    let mut money = conv(Some(debt(true)));
    money.spend.recent = vec![SpendEntry {
        cost_micros: 5_000,
        ..spent(NOW - 100_000, 1, true, "")
    }];
    add(
        "money is a hard limit on urgent work",
        money,
        SpendWindow::default(),
        PolicyConfig {
            summary_max_cost_micros_per_window: Some(5_000),
            ..policy()
        },
        Schedule::Wait {
            on: Wait::UrgentSpendWindow,
            until: NOW - 100_000 + window,
        },
    );
    out
}

#[test]
fn the_scheduler_answers_each_situation() {
    for case in cases() {
        let got = schedule(
            &case.conv,
            &case.conv.spend,
            &case.partition,
            &case.policy,
            NOW,
        );
        assert_eq!(got, case.expect, "{}", case.name);
    }
}

#[test]
fn every_answer_but_idle_and_blocked_keeps_the_debt_moving() {
    // A debt always has a job out, one to issue, or a wait with an end.
    for case in cases() {
        let got = schedule(
            &case.conv,
            &case.conv.spend,
            &case.partition,
            &case.policy,
            NOW,
        );
        let moving = matches!(got, Schedule::Issue(_) | Schedule::Expired)
            || got.wake_at().is_some_and(|at| at > NOW);
        let owed = case.conv.debt.is_some() || case.conv.rolling_due;
        assert!(
            !owed || moving || matches!(got, Schedule::Blocked(_)),
            "{}: {got:?}",
            case.name
        );
    }
}
