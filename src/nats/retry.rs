//! The delays between retries of a NATS operation that fails for a while
//! (no leader, no connection): doubling from a first delay up to
//! [`MAX_RETRY_BACKOFF`], and short again once the operation succeeds or
//! a failure is a new one. No clock is read here: callers say how long an
//! attempt ran.

use std::time::Duration;

/// The longest delay between two retries.
pub const MAX_RETRY_BACKOFF: Duration = Duration::from_secs(5);

/// The delays between retries of a failing attempt: doubling from the
/// first up to the longest ([`MAX_RETRY_BACKOFF`] unless said otherwise),
/// and short again for a new failure.
#[derive(Debug)]
pub(crate) struct Backoff {
    first: Duration,
    next: Duration,
    longest: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration) -> Self {
        Backoff::up_to(first, MAX_RETRY_BACKOFF)
    }

    /// Delays doubling from `first` up to `longest` (never below `first`).
    pub(crate) fn up_to(first: Duration, longest: Duration) -> Self {
        Backoff {
            first,
            next: first,
            longest: longest.max(first),
        }
    }

    /// The delay before the next retry; each one doubles.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (delay * 2).min(self.longest);
        delay
    }

    /// The delay after an attempt that failed having run for `ran_for`: an
    /// attempt that made progress, or ran longer than the longest delay,
    /// failed anew, and its retries start short again.
    pub(crate) fn after_attempt(&mut self, progressed: bool, ran_for: Duration) -> Duration {
        if progressed || ran_for >= self.longest {
            self.reset();
        }
        self.next_delay()
    }

    /// After a success: the next failure's first retry is short again.
    pub(crate) fn reset(&mut self) {
        self.next = self.first;
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    const FIRST: Duration = Duration::from_millis(200);

    #[test]
    fn retries_double_up_to_the_longest_delay() {
        let mut b = Backoff::new(FIRST);
        let delays: Vec<u128> = (0..8).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
    }

    #[test]
    fn a_backoff_up_to_its_own_longest_stops_there() {
        let mut b = Backoff::up_to(Duration::from_millis(50), Duration::from_millis(400));
        let delays: Vec<u128> = (0..6).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [50, 100, 200, 400, 400, 400]);
        // A longest below the first is the first.
        let mut b = Backoff::up_to(FIRST, Duration::from_millis(1));
        assert_eq!((b.next_delay(), b.next_delay()), (FIRST, FIRST));
    }

    #[test]
    fn a_reset_after_a_success_retries_short_again() {
        let mut b = Backoff::new(FIRST);
        b.next_delay();
        b.next_delay();
        b.reset();
        assert_eq!(b.next_delay(), FIRST);
    }

    #[test]
    fn a_failure_after_progress_or_a_long_run_retries_short_again() {
        let quick = Duration::from_millis(10);
        let mut b = Backoff::new(FIRST);
        for _ in 0..6 {
            b.after_attempt(false, quick);
        }
        // Failing fast without progress: still the longest delay.
        assert_eq!(b.after_attempt(false, quick), MAX_RETRY_BACKOFF);
        // The partition folded again before it failed: a new failure.
        assert_eq!(b.after_attempt(true, quick), FIRST);
        assert_eq!(b.after_attempt(false, quick), FIRST * 2);
        // Ran for longer than the longest delay without folding (an idle
        // partition): a new failure too.
        assert_eq!(b.after_attempt(false, MAX_RETRY_BACKOFF), FIRST);
    }
}
