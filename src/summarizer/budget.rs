//! What one summarizer request may spend, and the ledger of what it did.
//!
//! A [`Budget`] is handed to every [`super::Summarizer`] call, the way a
//! tower layer gets what it needs in the call and never from ambient state.
//! It holds the calls and tokens the job's spend-window allowance has left
//! (`None`: unlimited, as for an urgent job), and it is charged with every
//! model call as the call ends:
//!
//! - a client asks [`Budget::grant`] before each call; a call the budget
//!   cannot pay for is never started (the request ends in
//!   [`super::SummarizeError::OverBudget`], or, mid-chain, as if the models
//!   left had failed);
//! - the call is charged through an [`InFlight`] guard: when it ends, or,
//!   when the caller's deadline drops the future first, on drop as
//!   `cancelled` (the provider saw it). So what the budget says was spent is
//!   what the provider saw, deadline or not, and the sweep reads it from
//!   here alone.
//!
//! A budget is cheap to clone (clones share one ledger) and is used by one
//! request at a time.

use super::CallRecord;
use crate::core::spend::Spend;
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(Debug, Default)]
struct Ledger {
    calls_left: Option<u32>,
    tokens_left: Option<u64>,
    records: Vec<CallRecord>,
    /// A call was refused for want of budget.
    refused: bool,
}

/// The calls and tokens a request may spend, and every call it made.
#[derive(Debug, Clone, Default)]
pub struct Budget {
    ledger: Arc<Mutex<Ledger>>,
}

impl Budget {
    /// No limit: every call is granted (and still charged).
    pub fn unlimited() -> Self {
        Self::default()
    }

    /// At most `calls` model calls and `tokens` tokens (`None`: no limit).
    pub fn new(calls: Option<u32>, tokens: Option<u64>) -> Self {
        Budget {
            ledger: Arc::new(Mutex::new(Ledger {
                calls_left: calls,
                tokens_left: tokens,
                ..Ledger::default()
            })),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Ledger) -> T) -> T {
        // A poisoned lock only means another thread panicked mid-charge;
        // the ledger itself is still valid.
        f(&mut self.ledger.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether a call with a prompt of `prompt_tokens` may start: a call is
    /// left and the prompt alone is not over the tokens left. A refusal is
    /// noted ([`Self::refused`]).
    pub fn grant(&self, prompt_tokens: u64) -> bool {
        self.with(|l| {
            let ok = l.calls_left != Some(0) && l.tokens_left.is_none_or(|t| t >= prompt_tokens);
            l.refused |= !ok;
            ok
        })
    }

    /// Charges one call that ended (or was cut short).
    pub fn charge(&self, record: &CallRecord) {
        self.with(|l| {
            if let Some(left) = &mut l.calls_left {
                *left = left.saturating_sub(1);
            }
            if let Some(left) = &mut l.tokens_left {
                *left = left.saturating_sub(record.tokens());
            }
            l.records.push(record.clone());
        });
    }

    /// Everything charged so far.
    pub fn spent(&self) -> Spend {
        self.with(|l| l.records.iter().map(Spend::of_call).sum())
    }

    /// Every call charged so far, in the order they ended.
    pub fn calls(&self) -> Vec<CallRecord> {
        self.with(|l| l.records.clone())
    }

    /// A call was refused for want of budget.
    pub fn refused(&self) -> bool {
        self.with(|l| l.refused)
    }
}

impl Spend {
    /// What one call cost: it counts (the provider saw it, even when it
    /// failed or was cancelled), with the provider's token counts where
    /// known, else ours.
    pub fn of_call(record: &CallRecord) -> Spend {
        Spend {
            calls: 1,
            tokens: record.tokens(),
            cost_micros: record.cost_micros,
        }
    }
}

/// Charges a call to its budget when it ends, or as cut short (the record
/// it was started with, its latency so far) when the future holding it is
/// dropped first.
#[derive(Debug)]
pub struct InFlight<'a> {
    budget: &'a Budget,
    cut_short: Option<CallRecord>,
    started: Instant,
}

impl<'a> InFlight<'a> {
    /// A call starting now; `cut_short` is its record should it never end.
    pub fn start(budget: &'a Budget, cut_short: CallRecord) -> Self {
        InFlight {
            budget,
            cut_short: Some(cut_short),
            started: Instant::now(),
        }
    }

    /// The call ended with `record`: charged, and handed back.
    pub fn finish(mut self, record: CallRecord) -> CallRecord {
        self.cut_short = None;
        self.budget.charge(&record);
        record
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(mut record) = self.cut_short.take() {
            record.latency_ms = self.started.elapsed().as_millis() as u64;
            self.budget.charge(&record);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summarizer::CallOutcome;
    use crate::testing::call_record as record;

    #[test]
    fn a_budget_grants_what_it_has_left_and_notes_a_refusal() {
        let b = Budget::new(Some(2), Some(300));
        assert!(b.grant(200));
        b.charge(&record(CallOutcome::Ok));
        assert!(b.grant(190), "190 of the 190 tokens left");
        assert!(!b.grant(191), "the prompt alone is over the tokens left");
        assert!(b.refused());
        b.charge(&record(CallOutcome::Timeout));
        assert!(!b.grant(0), "no call left");
        assert_eq!(
            b.spent(),
            Spend {
                calls: 2,
                tokens: 220,
                cost_micros: 14
            }
        );
        let unlimited = Budget::unlimited();
        assert!(unlimited.grant(u64::MAX));
        assert!(!unlimited.refused());
    }

    #[test]
    fn a_call_dropped_in_flight_is_charged_as_cut_short() {
        let b = Budget::unlimited();
        let clone = b.clone();
        drop(InFlight::start(&clone, record(CallOutcome::Cancelled)));
        let done =
            InFlight::start(&b, record(CallOutcome::Cancelled)).finish(record(CallOutcome::Ok));
        assert_eq!(done.outcome, CallOutcome::Ok);
        let outcomes: Vec<_> = b.calls().into_iter().map(|c| c.outcome).collect();
        assert_eq!(outcomes, vec![CallOutcome::Cancelled, CallOutcome::Ok]);
        assert_eq!(b.spent().calls, 2, "clones share one ledger");
    }
}
