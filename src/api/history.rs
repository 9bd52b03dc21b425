//! `history`: the compaction decisions of a conversation in the order the
//! fold took them (debts recorded, updated and cleared, jobs issued,
//! summaries recorded or rejected, sweeps ended, overflows, manual
//! requests, rejected events, resets), each with the event that caused it.

use crate::api::{conversation, ApiError};
use crate::core::state::{State, TurnBodies};
use serde::{Deserialize, Serialize};

pub const DEFAULT_LIMIT: usize = 500;
pub const MAX_LIMIT: usize = 10_000;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryRequest {
    pub conversation: String,
    /// Entries returned at most (default 500, at most 10000), oldest first.
    #[serde(default)]
    pub limit: Option<usize>,
    /// Only entries at or after this event time (ms).
    #[serde(default)]
    pub since: Option<u64>,
    /// Only entries after this index (to page on from `next_after`).
    #[serde(default)]
    pub after: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Position in the conversation's history (stable: it only grows).
    pub index: usize,
    pub time: u64,
    /// The event that caused this decision.
    pub event_id: String,
    #[serde(rename = "type")]
    pub event_type: String,
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryResponse {
    pub conversation: String,
    /// Entries in the whole history.
    pub total: usize,
    pub entries: Vec<Entry>,
    /// More entries matched than `limit`: ask again with `after` = this.
    pub next_after: Option<usize>,
}

pub fn history(
    state: &State,
    bodies: &dyn TurnBodies,
    req: &HistoryRequest,
) -> Result<HistoryResponse, ApiError> {
    let conv = conversation(state, &req.conversation)?;
    let all = bodies.history(conv)?;
    let limit = req.limit.unwrap_or(DEFAULT_LIMIT);
    if limit == 0 || limit > MAX_LIMIT {
        return Err(ApiError::BadRequest(format!(
            "`limit` must be between 1 and {MAX_LIMIT} (got {limit})"
        )));
    }
    let start = req.after.map_or(0, |a| a.saturating_add(1));
    let since = req.since.unwrap_or(0);
    let mut selected = all
        .iter()
        .enumerate()
        .skip(start)
        .filter(|(_, h)| h.time >= since);
    let entries: Vec<Entry> = selected
        .by_ref()
        .take(limit)
        .map(|(index, h)| Entry {
            index,
            time: h.time,
            event_id: h.event_id.clone(),
            event_type: h.event_type.clone(),
            detail: h.detail.clone(),
        })
        .collect();
    let next_after = match (selected.next(), entries.last()) {
        (Some(_), Some(last)) => Some(last.index),
        _ => None,
    };
    Ok(HistoryResponse {
        conversation: conv.key.clone(),
        total: all.len(),
        entries,
        next_after,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::{self, CONV};
    use crate::core::state::Resident;

    fn req() -> HistoryRequest {
        HistoryRequest {
            conversation: CONV.into(),
            ..HistoryRequest::default()
        }
    }

    #[test]
    fn every_entry_in_order_with_the_compaction_story() {
        let (state, _) = testing::folded();
        let conv = testing::conv(state);
        let out = history(state, &Resident, &req()).unwrap();
        assert_eq!(out.total, conv.history.len());
        assert_eq!(out.entries.len(), conv.history.len());
        assert!(out.next_after.is_none());
        let types: Vec<&str> = out.entries.iter().map(|e| e.event_type.as_str()).collect();
        for want in [
            "debt_recorded",
            "job_issued",
            "summary_recorded",
            "sweep_ended",
            "debt_cleared",
            "provider_error_observed",
            "compaction_requested",
        ] {
            assert!(types.contains(&want), "no {want} in {types:?}");
        }
        assert!(out.entries.windows(2).all(|w| w[0].index + 1 == w[1].index));
        assert!(out.entries.windows(2).all(|w| w[0].time <= w[1].time));
    }

    #[test]
    fn pages_with_limit_and_after_and_filters_by_time() {
        let (state, _) = testing::folded();
        let all = history(state, &Resident, &req()).unwrap().entries;
        let mut r = req();
        r.limit = Some(4);
        let mut paged = Vec::new();
        loop {
            let page = history(state, &Resident, &r).unwrap();
            assert!(page.entries.len() <= 4);
            paged.extend(page.entries);
            match page.next_after {
                Some(a) => r.after = Some(a),
                None => break,
            }
        }
        assert_eq!(paged, all);

        let mid = all[all.len() / 2].time;
        let r = HistoryRequest {
            since: Some(mid),
            ..req()
        };
        let recent = history(state, &Resident, &r).unwrap().entries;
        assert!(recent.iter().all(|e| e.time >= mid));
        assert_eq!(recent.len(), all.iter().filter(|e| e.time >= mid).count());
    }

    #[test]
    fn bad_limits() {
        let (state, _) = testing::folded();
        for limit in [0, MAX_LIMIT + 1] {
            let r = HistoryRequest {
                limit: Some(limit),
                ..req()
            };
            assert!(matches!(
                history(state, &Resident, &r),
                Err(ApiError::BadRequest(_))
            ));
        }
    }
}
