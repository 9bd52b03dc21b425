//! Pure CPU work of the async adapters, run on tokio's blocking pool.
//!
//! The NATS roles share a few async workers (two on a two-core machine)
//! with the lease renewals, the NATS client's connection and every other
//! task. Work that does not await and can take long (writing a
//! deterministic summary, cutting a big prompt's sources to excerpts,
//! token count by token count) must not run on them: it once held both
//! workers for 1.6 s while four summarizer jobs ran, the renewals stalled,
//! and a `serve` lost every partition it held in the middle of a burst.

/// Runs `work` on the blocking pool and waits for it. A panic in it is a
/// bug and is resumed here, as if it had run inline. `None` only when the
/// runtime shut down before the pool started it.
pub async fn run<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    match tokio::task::spawn_blocking(work).await {
        Ok(done) => Some(done),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn runs_off_the_calling_thread_even_on_a_current_thread_runtime() {
        let caller = std::thread::current().id();
        let ran_on = run(|| std::thread::current().id()).await;
        assert!(ran_on.is_some_and(|t| t != caller));
    }

    #[tokio::test]
    #[should_panic(expected = "a bug")]
    async fn a_panic_in_the_work_is_resumed() {
        let _ = run(|| -> u8 { panic!("a bug") }).await;
    }
}
