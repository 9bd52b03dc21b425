//! The audit page's conversation list: every conversation a source knows,
//! searched, sorted and paged on the server, so a deployment of any size is
//! listed whole (no cap) and the page holds one page of rows at a time.
//!
//! - **Search** (`q`): a key containing the query, case-insensitive (a
//!   prefix, a whole key or any part of one).
//! - **Sort** (`sort`): `key`, in natural order (`c#2` before `c#10`);
//!   `health`, degraded (and unknown) first, then by key; `recent`, the
//!   newest last event first, then by key.
//! - **Paging** (`offset`, `limit`): [`DEFAULT_LIMIT`] rows a page, at most
//!   [`MAX_LIMIT`]; the answer says how many conversations there are in
//!   all and how many match.
//!
//! Sorting by key needs only the keys, so only the page's rows are read.
//! Sorting by health or activity needs every matching row: over NATS that
//! is one `status` request a conversation, so rows are kept for
//! [`ROW_TTL`] and a page turn does not ask again.

use serde::Serialize;
use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Rows a page holds unless asked otherwise.
pub const DEFAULT_LIMIT: usize = 100;
/// The most rows one page holds (more are more pages, never left out).
pub const MAX_LIMIT: usize = 500;
/// How long a row read for a sort is reused.
pub const ROW_TTL: Duration = Duration::from_secs(5);

/// One conversation of the list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    pub conversation: String,
    /// `ok`, `degraded`, or `unknown` (its status could not be read).
    pub health: String,
    /// Why it is degraded (or unknown).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
    pub turns: u64,
    pub context_tokens: u64,
    pub budget: u64,
    pub summaries: u64,
    /// Newest event time (ms since the epoch), as the agent stated it.
    pub last_event_time: u64,
    pub pending_job: bool,
}

impl Row {
    /// The row of a `status` answer (JSON) of `key`.
    pub fn from_status(key: &str, status: &serde_json::Value) -> Row {
        let n = |path: &[&str]| {
            path.iter()
                .try_fold(status, |v, k| v.get(k))
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0)
        };
        Row {
            conversation: key.to_string(),
            health: status["health"]["status"]
                .as_str()
                .unwrap_or("unknown")
                .to_string(),
            reasons: status["health"]["reasons"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r["message"].as_str().map(str::to_string))
                .collect(),
            turns: n(&["turns", "total"]),
            context_tokens: n(&["tokens", "context"]),
            budget: n(&["tokens", "budget"]),
            summaries: n(&["summaries", "total"]),
            last_event_time: n(&["last_event_time"]),
            pending_job: !status["pending_job"].is_null(),
        }
    }

    /// The row of a conversation whose status could not be read.
    pub fn unknown(key: &str, why: impl Into<String>) -> Row {
        Row {
            conversation: key.to_string(),
            health: "unknown".into(),
            reasons: vec![why.into()],
            turns: 0,
            context_tokens: 0,
            budget: 0,
            summaries: 0,
            last_event_time: 0,
            pending_job: false,
        }
    }

    fn healthy(&self) -> bool {
        self.health == "ok"
    }
}

/// Natural order: runs of ASCII digits compare as numbers (`c#2` < `c#10`
/// < `c#100`), everything else as text; equal numbers with more leading
/// zeros sort after, so no two different keys are equal.
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let da = a.iter().take_while(|c| c.is_ascii_digit()).count();
                let db = b.iter().take_while(|c| c.is_ascii_digit()).count();
                let (na, nb) = (&a[..da], &b[..db]);
                let ta: &[u8] = match na.iter().position(|&c| c != b'0') {
                    Some(i) => &na[i..],
                    None => &[],
                };
                let tb: &[u8] = match nb.iter().position(|&c| c != b'0') {
                    Some(i) => &nb[i..],
                    None => &[],
                };
                let by_value = ta.len().cmp(&tb.len()).then_with(|| ta.cmp(tb));
                match by_value.then_with(|| da.cmp(&db)) {
                    Ordering::Equal => {
                        a = &a[da..];
                        b = &b[db..];
                    }
                    other => return other,
                }
            }
            (Some(x), Some(y)) => match x.cmp(y) {
                Ordering::Equal => {
                    a = &a[1..];
                    b = &b[1..];
                }
                other => return other,
            },
        }
    }
}

/// How the list is sorted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Sort {
    /// Natural order of the keys.
    #[default]
    Key,
    /// Degraded and unknown first, then by key.
    Health,
    /// Newest activity first, then by key.
    Recent,
}

/// What the page asks for.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct ListQuery {
    #[serde(default)]
    pub q: String,
    #[serde(default)]
    pub sort: Sort,
    #[serde(default)]
    pub offset: usize,
    pub limit: Option<usize>,
}

/// One page of the list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ListPage {
    /// Every conversation the source knows.
    pub total: usize,
    /// Those the search matches.
    pub matched: usize,
    pub offset: usize,
    pub limit: usize,
    pub sort: Sort,
    pub q: String,
    pub conversations: Vec<Row>,
}

/// Rows read for a sort, kept for [`ROW_TTL`].
#[derive(Default)]
pub struct RowCache(Mutex<HashMap<String, (Instant, Row)>>);

impl RowCache {
    /// The rows of `keys` (in their order): kept ones while fresh, the
    /// others from `read` in one call.
    pub fn rows<E>(
        &self,
        keys: &[String],
        read: impl FnOnce(&[String]) -> Result<Vec<Row>, E>,
    ) -> Result<Vec<Row>, E> {
        let now = Instant::now();
        let missing: Vec<String> = {
            let cache = self.0.lock().unwrap_or_else(|p| p.into_inner());
            keys.iter()
                .filter(|k| {
                    cache
                        .get(*k)
                        .is_none_or(|(at, _)| now.duration_since(*at) > ROW_TTL)
                })
                .cloned()
                .collect()
        };
        let fresh = if missing.is_empty() {
            Vec::new()
        } else {
            read(&missing)?
        };
        let mut cache = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for row in fresh {
            cache.insert(row.conversation.clone(), (now, row));
        }
        Ok(keys
            .iter()
            .map(|k| {
                cache
                    .get(k)
                    .map_or_else(|| Row::unknown(k, "no status"), |(_, r)| r.clone())
            })
            .collect())
    }
}

/// The page `query` asks for, over every conversation key the source
/// knows; `rows` reads the rows of some keys.
pub fn page<E>(
    mut keys: Vec<String>,
    query: &ListQuery,
    rows: impl FnOnce(&[String]) -> Result<Vec<Row>, E>,
) -> Result<ListPage, E> {
    let total = keys.len();
    let needle = query.q.trim().to_lowercase();
    if !needle.is_empty() {
        keys.retain(|k| k.to_lowercase().contains(&needle));
    }
    keys.sort_by(|a, b| natural_cmp(a, b));
    keys.dedup();
    let matched = keys.len();
    let limit = query.limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT);
    let offset = query.offset.min(matched);
    let conversations = match query.sort {
        Sort::Key => {
            let end = (offset + limit).min(matched);
            rows(&keys[offset..end])?
        }
        Sort::Health | Sort::Recent => {
            let mut all = rows(&keys)?;
            // `keys` is in natural order and the sort is stable: ties stay
            // in key order.
            match query.sort {
                Sort::Health => all.sort_by_key(Row::healthy),
                _ => all.sort_by_key(|r| std::cmp::Reverse(r.last_event_time)),
            }
            all.into_iter().skip(offset).take(limit).collect()
        }
    };
    Ok(ListPage {
        total,
        matched,
        offset,
        limit,
        sort: query.sort,
        q: query.q.clone(),
        conversations,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(key: &str, health: &str, last: u64) -> Row {
        Row {
            health: health.into(),
            last_event_time: last,
            ..Row::unknown(key, "")
        }
    }

    #[test]
    fn natural_order_compares_numbers_as_numbers() {
        let mut keys = vec![
            "c#10", "c#1", "c#100", "c#2", "b", "c#02", "c#0", "a#9", "c#1x",
        ];
        keys.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            keys,
            ["a#9", "b", "c#0", "c#1", "c#1x", "c#2", "c#02", "c#10", "c#100"]
        );
        assert_eq!(natural_cmp("x", "x"), Ordering::Equal);
        assert_eq!(
            natural_cmp("v99999999999999999999999", "v100000000000000000000000"),
            Ordering::Less,
            "numbers longer than any integer type"
        );
    }

    fn keys(n: usize) -> Vec<String> {
        (0..n).rev().map(|i| format!("fleet:#{i}")).collect()
    }

    fn no_rows(keys: &[String]) -> Result<Vec<Row>, ()> {
        Ok(keys.iter().map(|k| row(k, "ok", 0)).collect())
    }

    #[test]
    fn every_conversation_is_reached_page_by_page_in_natural_order() {
        let all = keys(2_000);
        let mut seen = Vec::new();
        let mut offset = 0;
        loop {
            let p = page(
                all.clone(),
                &ListQuery {
                    offset,
                    limit: Some(MAX_LIMIT),
                    ..ListQuery::default()
                },
                no_rows,
            )
            .unwrap();
            assert_eq!((p.total, p.matched), (2_000, 2_000));
            if p.conversations.is_empty() {
                break;
            }
            offset += p.conversations.len();
            seen.extend(p.conversations.into_iter().map(|r| r.conversation));
        }
        assert_eq!(seen.len(), 2_000, "no cap");
        assert_eq!(seen[..3], ["fleet:#0", "fleet:#1", "fleet:#2"]);
        assert_eq!(seen[1999], "fleet:#1999");
        let p = page(
            all,
            &ListQuery {
                limit: Some(100_000),
                ..ListQuery::default()
            },
            no_rows,
        )
        .unwrap();
        assert_eq!(p.limit, MAX_LIMIT);
    }

    #[test]
    fn search_matches_any_part_of_a_key_and_counts_the_matches() {
        let p = page(
            keys(2_000),
            &ListQuery {
                q: "#19".into(),
                ..ListQuery::default()
            },
            no_rows,
        )
        .unwrap();
        // #19, #190-#199, #1900-#1999
        assert_eq!(p.matched, 1 + 10 + 100);
        assert_eq!(p.total, 2_000);
        assert_eq!(p.conversations[0].conversation, "fleet:#19");
        assert_eq!(p.conversations[1].conversation, "fleet:#190");
        let p = page(
            keys(20),
            &ListQuery {
                q: "FLEET:#7".into(),
                ..ListQuery::default()
            },
            no_rows,
        )
        .unwrap();
        assert_eq!(p.matched, 1, "case-insensitive, a whole key");
    }

    #[test]
    fn health_puts_degraded_first_and_recent_the_newest_first() {
        let read = |keys: &[String]| -> Result<Vec<Row>, ()> {
            Ok(keys
                .iter()
                .map(|k| {
                    let i: u64 = k.trim_start_matches("fleet:#").parse().unwrap_or(0);
                    row(k, if i % 7 == 3 { "degraded" } else { "ok" }, i * 10)
                })
                .collect())
        };
        let p = page(
            keys(30),
            &ListQuery {
                sort: Sort::Health,
                limit: Some(5),
                ..ListQuery::default()
            },
            read,
        )
        .unwrap();
        let got: Vec<&str> = p
            .conversations
            .iter()
            .map(|r| r.conversation.as_str())
            .collect();
        assert_eq!(
            got,
            [
                "fleet:#3",
                "fleet:#10",
                "fleet:#17",
                "fleet:#24",
                "fleet:#0"
            ]
        );
        let p = page(
            keys(30),
            &ListQuery {
                sort: Sort::Recent,
                offset: 1,
                limit: Some(2),
                ..ListQuery::default()
            },
            read,
        )
        .unwrap();
        let got: Vec<&str> = p
            .conversations
            .iter()
            .map(|r| r.conversation.as_str())
            .collect();
        assert_eq!(got, ["fleet:#28", "fleet:#27"]);
    }

    #[test]
    fn a_status_answer_becomes_a_row() {
        let status = serde_json::json!({
            "conversation": "c",
            "last_event_time": 17,
            "turns": {"total": 4},
            "tokens": {"context": 900, "budget": 32000},
            "summaries": {"total": 2},
            "pending_job": {"job_id": "j"},
            "health": {"status": "degraded", "reasons": [{"code": "over_budget", "message": "the fresh tail alone exceeds the budget"}]}
        });
        let r = Row::from_status("c", &status);
        assert_eq!(
            (
                r.health.as_str(),
                r.turns,
                r.context_tokens,
                r.summaries,
                r.last_event_time
            ),
            ("degraded", 4, 900, 2, 17)
        );
        assert!(r.pending_job);
        assert_eq!(r.reasons, ["the fresh tail alone exceeds the budget"]);
    }

    #[test]
    fn kept_rows_are_not_read_again() {
        let cache = RowCache::default();
        let keys = vec!["a".to_string(), "b".to_string()];
        let mut reads = 0;
        let _ = cache.rows(&keys, |k| {
            reads += k.len();
            no_rows(k)
        });
        let rows = cache
            .rows(&keys, |k| {
                reads += k.len();
                no_rows(k)
            })
            .unwrap();
        assert_eq!(reads, 2);
        assert_eq!(rows[1].conversation, "b");
    }
}
