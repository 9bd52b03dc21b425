//! The per-provider auth circuit breaker and the clock it reads.
//!
//! A refused key (401/403) does not get better by retrying: after
//! `threshold` auth failures in a row the provider's breaker opens and every
//! call is refused locally for `cooldown_ms`. After the cooldown one probe
//! call is let through (half-open): success closes the breaker, another auth
//! failure opens it again for a full cooldown. Time comes from a [`Clock`]
//! so tests can move it.
//!
//! The breaker is process-local; the event-sourced spend windows and
//! breakers of the fold are the caller's (see `SummarizeError::BreakerOpen`
//! and the `Auth` call outcomes it can record).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ms(&self) -> u64;
}

#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }
}

/// A clock tests set by hand.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    pub fn new(now_ms: u64) -> Self {
        ManualClock {
            now: AtomicU64::new(now_ms),
        }
    }

    pub fn set(&self, now_ms: u64) {
        self.now.store(now_ms, Ordering::SeqCst);
    }

    pub fn advance(&self, ms: u64) {
        self.now.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct ProviderState {
    consecutive_failures: u32,
    open_until_ms: Option<u64>,
}

/// Auth breakers of all providers; cheap to clone and share between the
/// clients of one process.
#[derive(Debug, Clone)]
pub struct AuthBreakers {
    threshold: u32,
    cooldown_ms: u64,
    clock: Arc<dyn Clock>,
    state: Arc<Mutex<HashMap<String, ProviderState>>>,
}

impl AuthBreakers {
    pub fn new(threshold: u32, cooldown_ms: u64, clock: Arc<dyn Clock>) -> Self {
        AuthBreakers {
            threshold: threshold.max(1),
            cooldown_ms,
            clock,
            state: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, ProviderState>> {
        // The map stays consistent even if a holder panicked: every update is
        // a single assignment.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `Err(remaining_ms)` while the provider's breaker is open.
    pub fn check(&self, provider: &str) -> Result<(), u64> {
        let now = self.clock.now_ms();
        match self.lock().get(provider).and_then(|s| s.open_until_ms) {
            Some(until) if now < until => Err(until - now),
            _ => Ok(()),
        }
    }

    /// An auth failure; returns true when it (re)opened the breaker.
    pub fn record_auth_failure(&self, provider: &str) -> bool {
        let now = self.clock.now_ms();
        let mut map = self.lock();
        let state = map.entry(provider.to_string()).or_default();
        let half_open = state.open_until_ms.is_some_and(|until| now >= until);
        state.consecutive_failures = state.consecutive_failures.saturating_add(1);
        if half_open || state.consecutive_failures >= self.threshold {
            state.open_until_ms = Some(now.saturating_add(self.cooldown_ms));
            true
        } else {
            false
        }
    }

    /// A call the provider accepted (any answer but 401/403) closes it.
    pub fn record_success(&self, provider: &str) {
        let mut map = self.lock();
        if let Some(state) = map.get_mut(provider) {
            *state = ProviderState::default();
        }
    }

    /// Auth failures in a row so far.
    pub fn failures(&self, provider: &str) -> u32 {
        self.lock()
            .get(provider)
            .map_or(0, |s| s.consecutive_failures)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breakers() -> (AuthBreakers, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000));
        (AuthBreakers::new(5, 1_800_000, clock.clone()), clock)
    }

    #[test]
    fn opens_after_threshold_and_stays_open_for_the_cooldown() {
        let (b, clock) = breakers();
        for i in 1..5 {
            assert!(!b.record_auth_failure("p"), "failure {i} must not open");
            assert!(b.check("p").is_ok());
        }
        assert!(b.record_auth_failure("p"));
        assert_eq!(b.check("p"), Err(1_800_000));
        clock.advance(1_799_999);
        assert_eq!(b.check("p"), Err(1));
        // Other providers are unaffected.
        assert!(b.check("q").is_ok());
        clock.advance(1);
        assert!(b.check("p").is_ok(), "half-open after the cooldown");
    }

    #[test]
    fn half_open_probe_failure_reopens_and_success_closes() {
        let (b, clock) = breakers();
        for _ in 0..5 {
            b.record_auth_failure("p");
        }
        clock.advance(1_800_000);
        assert!(b.record_auth_failure("p"), "a failed probe reopens at once");
        assert_eq!(b.check("p"), Err(1_800_000));
        clock.advance(1_800_000);
        b.record_success("p");
        assert!(b.check("p").is_ok());
        assert_eq!(b.failures("p"), 0);
        assert!(!b.record_auth_failure("p"), "count starts again from zero");
    }

    #[test]
    fn success_resets_the_count_before_the_threshold() {
        let (b, _) = breakers();
        for _ in 0..4 {
            b.record_auth_failure("p");
        }
        b.record_success("p");
        for _ in 0..4 {
            assert!(!b.record_auth_failure("p"));
        }
    }
}
