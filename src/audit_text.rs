//! The audit ([`crate::core::audit`]) as text: one sentence per timeline
//! entry, shared by `contextfold audit` and the audit page's timeline, and
//! the whole audit as the CLI prints it. Presentation only: the audit
//! itself is built in the pure core.

use crate::core::audit::{Audit, What};
use crate::core::event::SummaryKind;

/// One entry of the timeline as one sentence (what the CLI's `audit`
/// prints after the token counts, and the audit page shows).
pub fn sentence(what: &What) -> String {
    match what {
        What::Trigger {
            reason,
            updated,
            urgent,
            target_tokens,
            detail,
            ..
        } => format!(
            "{} {reason}{}: {detail}; target {target_tokens}",
            if *updated {
                "debt updated"
            } else {
                "debt recorded"
            },
            if *urgent { " (urgent)" } else { "" }
        ),
        What::RollingDue { reason, detail } => {
            format!("rolling state due ({reason}): {detail}")
        }
        What::ProviderError {
            overflow, error, ..
        } => format!(
            "provider error ({}): {error}",
            if *overflow {
                "overflow"
            } else {
                "not an overflow"
            }
        ),
        What::PolicyRecorded {
            fingerprint,
            previous,
            recorded_by,
        } => format!(
            "policy {fingerprint} recorded{}{}: later decisions fold under it",
            recorded_by
                .as_ref()
                .map_or(String::new(), |w| format!(" by {w}")),
            previous
                .as_ref()
                .map_or(String::new(), |p| format!(" (was {p})"))
        ),
        What::ManualRequest { instructions, .. } => format!(
            "compaction requested{}",
            instructions
                .as_ref()
                .map_or(String::new(), |i| format!(": {i}"))
        ),
        What::JobIssued {
            job_id,
            reason,
            urgent,
            compact,
            context_tokens,
            target_tokens,
            deadline_ms,
            ..
        } => {
            if *compact {
                format!(
                    "job {job_id} issued ({reason}{}): {context_tokens} -> {target_tokens} \
                     tokens, deadline {deadline_ms} ms",
                    if *urgent { ", urgent" } else { "" }
                )
            } else {
                format!("job {job_id} issued: rolling session state only")
            }
        }
        What::Summary {
            summary_id,
            summary_kind,
            depth,
            turns,
            children,
            source_tokens,
            tokens,
            model,
            fallback,
            supersedes,
            accepted,
            ..
        } => format!(
            "{} {} d{depth} {summary_id} over {} ({source_tokens} -> {tokens} tokens) by \
             {model}{}{}",
            if *accepted {
                "summary"
            } else {
                "summary NOT accepted"
            },
            match summary_kind {
                SummaryKind::Leaf => "leaf",
                SummaryKind::Condensed => "condensed",
            },
            if children.is_empty() {
                format!("turns {}..={}", turns[0], turns[1])
            } else {
                format!(
                    "{} summaries (turns {}..={})",
                    children.len(),
                    turns[0],
                    turns[1]
                )
            },
            if *fallback { " [fallback]" } else { "" },
            supersedes
                .as_ref()
                .map_or(String::new(), |s| format!(", replaces fallback {s}"))
        ),
        What::SummaryRejected {
            summary_id, reason, ..
        } => format!("summary {summary_id} rejected: {reason}"),
        What::SweepEnded {
            job_id,
            stop,
            passes,
            committed,
            calls,
            tokens_spent,
            cost_micros,
            elapsed_ms,
            deadline_ms,
            detail,
            ..
        } => format!(
            "sweep {job_id} ended {}: {passes} passes, {committed} summaries, {calls} calls, \
             {tokens_spent} tokens, ${:.4}{}{}",
            stop.as_str(),
            *cost_micros as f64 / 1e6,
            match (elapsed_ms, deadline_ms) {
                (Some(e), Some(d)) => format!(", {e} of {d} ms"),
                _ => String::new(),
            },
            detail.as_ref().map_or(String::new(), |d| format!(" ({d})"))
        ),
        What::JobAbandoned { job_id } => format!("job {job_id} abandoned without a sweep end"),
        What::DebtCleared { reason } => format!("debt cleared: {reason}"),
        What::RollingStateUpdated { through_turn } => {
            format!("rolling state updated through turn {through_turn}")
        }
        What::RecallAnswered {
            outcome,
            model,
            calls,
            tokens_spent,
            cost_micros,
            prompt_tokens,
            sources,
        } => format!(
            "recall {}: read {sources} sources ({prompt_tokens} tokens), {calls} calls, \
             {tokens_spent} tokens, ${:.4}{}",
            outcome.as_str(),
            *cost_micros as f64 / 1e6,
            model.as_ref().map_or(String::new(), |m| format!(" ({m})"))
        ),
        What::MemoryFlush { cycle, reason } => {
            format!("memory flush requested (cycle {cycle}, {reason})")
        }
        What::ModelDeclared {
            model,
            context_window,
        } => format!(
            "model {model}{}",
            context_window.map_or(String::new(), |w| format!(", window {w}"))
        ),
        What::Reset { reason } => format!(
            "conversation reset{}",
            reason.as_ref().map_or(String::new(), |r| format!(": {r}"))
        ),
        What::EventRejected {
            rejected_id,
            reason,
            ..
        } => format!("event {rejected_id} rejected: {reason}"),
    }
}

/// The audit as text: its totals, one line per entry (`#index before ->
/// after sentence`), then one per compaction and one per fallback.
pub fn render(a: &Audit) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let t = &a.totals;
    let _ = writeln!(
        out,
        "audit of {}: {} events, {} turns, {} compactions ({} rolling-state only), {} summaries \
         ({} fallbacks, {} replaced), {} rejections, {} overflows; peak context {} tokens; \
         {} summarizer calls, {} tokens, ${:.4}",
        a.conversation,
        t.events,
        t.turns,
        t.compactions,
        t.rolling_only_jobs,
        t.summaries,
        t.fallbacks,
        t.fallbacks_replaced,
        t.rejections,
        t.overflows,
        t.peak_context_tokens,
        t.calls,
        t.tokens_spent,
        t.cost_micros as f64 / 1e6
    );
    for e in &a.entries {
        let line = sentence(&e.what);
        let _ = writeln!(
            out,
            "#{:<5} {:>7} -> {:<7} {line}",
            e.index, e.context_before, e.context_after
        );
    }
    for c in &a.compactions {
        let _ = writeln!(
            out,
            "compaction {} ({}{}): {} -> {} tokens (target {}), {} summaries ({} leaves, {} \
             condensed, {} fallbacks){}{}, models {}{}",
            c.job_id,
            c.reason,
            if c.urgent { ", urgent" } else { "" },
            c.context_before,
            c.context_after.map_or("?".to_string(), |t| t.to_string()),
            c.target_tokens,
            c.summaries.len(),
            c.leaves,
            c.condensed,
            c.fallbacks,
            c.turns_covered
                .map_or(String::new(), |[a, b]| format!(", turns {a}..={b}")),
            if c.summaries_covered > 0 {
                format!(", {} summaries condensed", c.summaries_covered)
            } else {
                String::new()
            },
            if c.models.is_empty() {
                "-".to_string()
            } else {
                c.models.join(",")
            },
            match &c.outcome {
                Some(o) => format!(
                    "; {} in {} ms ({}), {} calls, {} tokens, ${:.4}{}",
                    o.stop.as_str(),
                    o.elapsed_ms,
                    if o.deadline_met {
                        "deadline met"
                    } else {
                        "deadline MISSED"
                    },
                    o.calls,
                    o.tokens_spent,
                    o.cost_micros as f64 / 1e6,
                    if o.spend_limited {
                        ", stopped by the spend window"
                    } else {
                        ""
                    }
                ),
                None => "; no sweep end in the log".to_string(),
            }
        );
    }
    for f in &a.fallbacks {
        let _ = writeln!(
            out,
            "fallback {} ({}){}",
            f.summary_id,
            f.recorded_event,
            match (&f.replaced_by, &f.replaced_event) {
                (Some(by), Some(at)) => format!(" replaced by {by} at {at}"),
                _ => " not replaced yet".to_string(),
            }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_and_summary_entries_read_as_sentences() {
        let policy = sentence(&What::PolicyRecorded {
            fingerprint: "13f4439014fcbd36".into(),
            previous: Some("aaaa".into()),
            recorded_by: Some("embedded".into()),
        });
        assert_eq!(
            policy,
            "policy 13f4439014fcbd36 recorded by embedded (was aaaa): later decisions fold under it"
        );
        let summary = sentence(&What::Summary {
            summary_id: "sum_1".into(),
            job_id: None,
            summary_kind: SummaryKind::Condensed,
            depth: 1,
            turns: [0, 122],
            children: vec!["a".into(), "b".into()],
            source_tokens: 5726,
            tokens: 717,
            model: "m".into(),
            provider: "p".into(),
            fallback: true,
            supersedes: None,
            accepted: true,
        });
        assert_eq!(
            summary,
            "summary condensed d1 sum_1 over 2 summaries (turns 0..=122) (5726 -> 717 tokens) by m \
             [fallback]"
        );
        for s in [policy, summary] {
            assert!(!s.contains('{') && !s.contains('\n'), "{s}");
        }
    }
}
