//! Reading spend windows back from a log: the calls each sweep made, at
//! the partition time its job was issued, and the most of them in any
//! one window.

use contextfold::core::event::{Envelope, EventBody};
use std::collections::HashMap;

/// `(issued_at, calls)` of every sweep in `log` whose job `log` issued.
pub fn calls_by_issue_time(log: &[Envelope]) -> Vec<(u64, u64)> {
    let issued: HashMap<&str, u64> = log
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::JobIssued(j) => Some((j.job_id.as_str(), j.issued_at)),
            _ => None,
        })
        .collect();
    log.iter()
        .filter_map(|e| match &e.body {
            EventBody::SweepEnded(s) => issued
                .get(s.job_id.as_str())
                .map(|&at| (at, u64::from(s.calls))),
            _ => None,
        })
        .collect()
}

/// [`calls_by_issue_time`] of `conv`'s events alone.
pub fn calls_of(log: &[Envelope], conv: &str) -> Vec<(u64, u64)> {
    let own: Vec<Envelope> = log
        .iter()
        .filter(|e| e.conversation == conv)
        .cloned()
        .collect();
    calls_by_issue_time(&own)
}

/// The most calls in any span of `window_ms`.
pub fn max_in_any_window(calls: &[(u64, u64)], window_ms: u64) -> u64 {
    calls
        .iter()
        .map(|&(t, _)| {
            calls
                .iter()
                .filter(|(tj, _)| *tj <= t && tj + window_ms > t)
                .map(|(_, c)| c)
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0)
}
